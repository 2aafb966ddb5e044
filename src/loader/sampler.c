/*
 * DESIGN: the loader's sampler: which dataset index sits at each position of one rank's epoch.
 *
 * Order: sequential, or a permutation of [0, n) that is a function of (seed, epoch) alone: a
 * Feistel network over the smallest even number of bits that covers n, keyed per epoch, with
 * cycle walking (apply it again while the result is >= n; the cycle through any i < n returns
 * below n, and the domain is under 4n, so the expected number of steps is below 4). It is a
 * bijection computed per position in O(1) time and memory: a dataset of a billion samples needs
 * no 8 GB index array, any worker can find any position without shared state, and a resumed job
 * recomputes exactly the order it stopped in.
 *
 * Sharding, as torch's DistributedSampler: with W ranks, rank r takes positions r, r+W, r+2W...
 * of the epoch's order. Without drop_last the order is padded to ceil(n/W)*W by repeating its
 * beginning (position g >= n holds order[g mod n]), so every rank has ceil(n/W) samples and each
 * sample comes at least once per epoch, exactly once when W divides n; the last batch of a rank
 * may be partial. With drop_last the order is cut to floor(n/W)*W (no sample twice) and each rank
 * drops its partial last batch.
 *
 * Pure functions over an immutable struct: no locks.
 */
#include "internal.h"

uint64_t pm__mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

#define FEISTEL_ROUNDS 6

uint64_t pm__permute(uint64_t i, uint64_t n, uint64_t key) {
  if (n <= 1) return 0;
  unsigned bits = 64u - (unsigned)__builtin_clzll(n - 1); /* bits of n - 1 */
  if (bits < 2) bits = 2;
  bits += bits & 1u;
  unsigned half = bits / 2;
  uint64_t mask = half >= 64 ? ~0ull : ((1ull << half) - 1);
  uint64_t rk[FEISTEL_ROUNDS];
  for (int r = 0; r < FEISTEL_ROUNDS; r++) rk[r] = pm__mix64(key + 0x632BE59BD9B4E019ull * (r + 1));
  uint64_t x = i;
  do {
    uint64_t l = x >> half, rt = x & mask;
    for (int r = 0; r < FEISTEL_ROUNDS; r++) {
      uint64_t f = pm__mix64(rt ^ rk[r]) & mask;
      uint64_t nl = rt;
      rt = l ^ f;
      l = nl;
    }
    x = (l << half) | rt;
  } while (x >= n);
  return x;
}

void pm__sampler_count(uint64_t n, uint64_t batch, bool drop_last, int world, uint64_t *per_rank,
                       uint64_t *batches) {
  uint64_t w = (uint64_t)world;
  uint64_t p = drop_last ? n / w : n / w + (n % w != 0);
  *per_rank = p;
  *batches = drop_last ? p / batch : p / batch + (p % batch != 0);
}

pm_status_t pm__sampler_init(pm__sampler_t *s, uint64_t n, uint64_t batch, bool shuffle,
                             uint64_t seed, bool drop_last, int rank, int world) {
  if (n == 0) return pm__set_error(PM_ERR_INVALID, "sampler: the dataset has no samples");
  if (batch == 0) return pm__set_error(PM_ERR_INVALID, "sampler: batch size is 0");
  if (world < 1)
    return pm__set_error(PM_ERR_INVALID, "sampler: world size %d (must be at least 1)", world);
  if (rank < 0 || rank >= world)
    return pm__set_error(PM_ERR_INVALID, "sampler: rank %d is not in 0..%d (world size %d)", rank,
                         world - 1, world);
  uint64_t per_rank, batches;
  pm__sampler_count(n, batch, drop_last, world, &per_rank, &batches);
  if (per_rank == 0)
    return pm__set_error(PM_ERR_INVALID,
                         "sampler: with drop_last, %llu samples over %d ranks leave none per rank",
                         (unsigned long long)n, world);
  if (batches == 0)
    return pm__set_error(PM_ERR_INVALID,
                         "sampler: with drop_last, %llu samples per rank make no whole batch of "
                         "%llu",
                         (unsigned long long)per_rank, (unsigned long long)batch);
  s->n = n;
  s->batch = batch;
  s->seed = seed;
  s->rank = rank;
  s->world = world;
  s->shuffle = shuffle;
  s->drop_last = drop_last;
  s->per_rank = per_rank;
  s->batches = batches;
  return PM_OK;
}

uint64_t pm__sampler_rows(const pm__sampler_t *s, uint64_t b) {
  uint64_t start = b * s->batch;
  if (start >= s->per_rank) return 0;
  return PM__MIN(s->batch, s->per_rank - start);
}

uint64_t pm__sampler_index(const pm__sampler_t *s, uint64_t epoch, uint64_t pos) {
  uint64_t g = pos * (uint64_t)s->world + (uint64_t)s->rank; /* position in the epoch's order */
  uint64_t k = g % s->n;                                     /* padding repeats the start */
  if (!s->shuffle) return k;
  uint64_t key = pm__mix64(s->seed ^ pm__mix64(epoch ^ 0xD1B54A32D192ED03ull));
  return pm__permute(k, s->n, key);
}
