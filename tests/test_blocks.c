/* The KV-cache block store (pm_blocks_*): every layout and direction byte for byte against a
 * reference kept on the host, under each path choice (always DMA, always the kernel, the
 * calibrated cut-off); bad ids, repeated ids in one call, exhaustion and other bad input; two
 * streams swapping at once; swaps racing the background pinning of the arena; blocks freed while
 * a swap still uses them are not handed out again until it completed. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "internal.h"

/* The layouts servers use, over nl layers of [nb, bs, heads, hd] elements of isz bytes. */
enum { LAY_KV_APART, LAY_KV_STACKED_OUTER, LAY_KV_STACKED_INNER, LAY_ONE_TENSOR, LAY_COUNT };
static const char *lay_name[] = {"K and V apart", "[2, blocks, ...]", "[blocks, 2, ...]",
                                 "one tensor a layer"};

typedef struct kv {
  int layout, nl;
  uint64_t nb; /* device blocks */
  size_t piece; /* bytes of one block of one K or V tensor */
  int ntensors;
  char *dev[8];         /* device tensors */
  size_t tensor_bytes[8];
  char *mirror[8];      /* what the device tensors should hold */
  pm_kv_region_t regions[16];
  pm_kv_layout_t layout_desc;
  size_t block_bytes;
} kv_t;

static void kv_make(kv_t *k, int layout, int nl, uint64_t nb, size_t piece, uint64_t seed) {
  memset(k, 0, sizeof *k);
  k->layout = layout;
  k->nl = nl;
  k->nb = nb;
  k->piece = piece;
  int nr = 0;
  for (int l = 0; l < nl; l++) {
    switch (layout) {
    case LAY_KV_APART: /* two tensors a layer, one region each */
      for (int h = 0; h < 2; h++) {
        int t = k->ntensors++;
        k->tensor_bytes[t] = nb * piece;
        k->regions[nr++] = (pm_kv_region_t){NULL, piece, piece};
      }
      break;
    case LAY_KV_STACKED_OUTER: /* one tensor [2, nb, ...]: two regions */
      k->tensor_bytes[k->ntensors++] = 2 * nb * piece;
      k->regions[nr++] = (pm_kv_region_t){NULL, piece, piece};
      k->regions[nr++] = (pm_kv_region_t){NULL, piece, piece};
      break;
    case LAY_KV_STACKED_INNER: /* one tensor [nb, 2, ...]: one region of both halves */
      k->tensor_bytes[k->ntensors++] = nb * 2 * piece;
      k->regions[nr++] = (pm_kv_region_t){NULL, 2 * piece, 2 * piece};
      break;
    default: /* one tensor a layer [nb, bs, heads, hd] */
      k->tensor_bytes[k->ntensors++] = nb * piece;
      k->regions[nr++] = (pm_kv_region_t){NULL, piece, piece};
      break;
    }
  }
  for (int t = 0; t < k->ntensors; t++) {
    REQUIRE_OK(pm_device_alloc(k->tensor_bytes[t], (void **)&k->dev[t]));
    k->mirror[t] = malloc(k->tensor_bytes[t]);
    REQUIRE(k->mirror[t]);
    pm_test_fill(k->mirror[t], k->tensor_bytes[t], seed + (uint64_t)t);
    REQUIRE_OK(pm_memcpy(k->dev[t], k->mirror[t], k->tensor_bytes[t], PM_COPY_H2D));
  }
  /* Region bases, in the order the regions were made. */
  nr = 0;
  for (int t = 0; t < k->ntensors; t++) {
    if (layout == LAY_KV_STACKED_OUTER) {
      k->regions[nr++].base = k->dev[t];
      k->regions[nr++].base = k->dev[t] + nb * piece;
    } else {
      k->regions[nr++].base = k->dev[t];
    }
  }
  k->layout_desc = (pm_kv_layout_t){nr, k->regions, nb, -1};
  k->block_bytes = 0;
  for (int r = 0; r < nr; r++) k->block_bytes += k->regions[r].bytes;
}

static void kv_free(kv_t *k) {
  for (int t = 0; t < k->ntensors; t++) {
    CHECK_OK(pm_device_free(k->dev[t]));
    free(k->mirror[t]);
  }
}

/* The host address of region r of device block d in the mirror. */
static const char *mirror_at(const kv_t *k, int r, uint64_t d) {
  /* Regions map to tensors in order; the outer-stacked layout has two regions a tensor. */
  int t = k->layout == LAY_KV_STACKED_OUTER ? r / 2 : r;
  size_t extra = k->layout == LAY_KV_STACKED_OUTER && r % 2 ? k->nb * k->piece : 0;
  return k->mirror[t] + extra + d * k->regions[r].block_stride;
}

/* Host block h (from the store) holds device block d of the mirror, region after region. */
static bool host_block_is(pm_blocks_t *s, const kv_t *k, uint64_t h, uint64_t d) {
  char *p;
  if (pm_blocks_ptr(s, h, (void **)&p) != PM_OK) return false;
  size_t off = 0;
  for (int r = 0; r < k->layout_desc.nregions; r++) {
    if (memcmp(p + off, mirror_at(k, r, d), k->regions[r].bytes) != 0) return false;
    off += k->regions[r].bytes;
  }
  return true;
}

/* The device tensors hold exactly the mirror. */
static bool device_is_mirror(const kv_t *k) {
  bool ok = true;
  for (int t = 0; t < k->ntensors && ok; t++) {
    char *tmp = malloc(k->tensor_bytes[t]);
    REQUIRE(tmp);
    REQUIRE_OK(pm_memcpy(tmp, k->dev[t], k->tensor_bytes[t], PM_COPY_D2H));
    ok = memcmp(tmp, k->mirror[t], k->tensor_bytes[t]) == 0;
    free(tmp);
  }
  return ok;
}

/* A permutation of [0, n) by Fisher-Yates. */
static void shuffle(uint64_t *v, size_t n, uint64_t *rng) {
  for (size_t i = n; i > 1; i--) {
    size_t j = (size_t)(pm_test_rand(rng) % i);
    uint64_t t = v[i - 1];
    v[i - 1] = v[j];
    v[j] = t;
  }
}

static pm_blocks_t *make_store(size_t block_bytes, uint64_t n, size_t chunk, int background) {
  pm_blocks_config_t c;
  pm_blocks_config_init(&c);
  c.block_bytes = block_bytes;
  c.num_blocks = n;
  c.chunk_bytes = chunk;
  c.background = background;
  pm_blocks_t *s = NULL;
  REQUIRE_OK(pm_blocks_create(&c, &s));
  return s;
}

/* Out with random ids both sides, check the arena; scramble the device; back in to other
 * device blocks, check the device. */
static void round_trip(int layout, size_t piece, const char *cut) {
  REQUIRE_OK(pm_option_set("blocks_kernel_max", cut));
  uint64_t rng = 0x5eed + (uint64_t)layout * 31 + piece;
  kv_t k;
  uint64_t nb = 12, nh = 10;
  int nl = 2;
  kv_make(&k, layout, nl, nb, piece, rng);
  pm_blocks_t *s = make_store(k.block_bytes, nh, 3 * k.block_bytes, 1);
  pm_stream_t st;
  REQUIRE_OK(pm_stream_create(&st));

  size_t n = 7;
  uint64_t host[16], dev[12];
  REQUIRE_OK(pm_blocks_alloc(s, nh, host));
  shuffle(host, nh, &rng);
  for (uint64_t i = 0; i < nb; i++) dev[i] = i;
  shuffle(dev, nb, &rng);
  /* Device ids may repeat going out: block dev[0] goes to two host blocks. */
  dev[n - 1] = dev[0];
  pm_event_t ev = NULL;
  CHECK_OK(pm_blocks_swap_out(s, &k.layout_desc, dev, host, n, st, &ev));
  REQUIRE(ev != NULL);
  CHECK_OK(pm_event_synchronize(ev));
  CHECK_OK(pm_event_destroy(ev));
  bool all = true;
  for (size_t i = 0; i < n; i++) all = all && host_block_is(s, &k, host[i], dev[i]);
  if (!all)
    fprintf(stderr, "swap_out: %s, piece %zu, cut-off %s: a host block differs\n",
            lay_name[layout], piece, cut);
  CHECK(all);

  /* Scramble the device, then bring the blocks back into other device blocks: the mirror
   * follows what the swap in must do. */
  for (int t = 0; t < k.ntensors; t++) {
    pm_test_fill(k.mirror[t], k.tensor_bytes[t], rng + 100 + (uint64_t)t);
    REQUIRE_OK(pm_memcpy(k.dev[t], k.mirror[t], k.tensor_bytes[t], PM_COPY_H2D));
  }
  uint64_t to[12];
  for (uint64_t i = 0; i < nb; i++) to[i] = nb - 1 - i;
  /* Host ids may repeat coming in. */
  uint64_t from[7];
  memcpy(from, host, sizeof from);
  from[2] = host[5];
  for (size_t i = 0; i < n; i++) {
    char *p;
    REQUIRE_OK(pm_blocks_ptr(s, from[i], (void **)&p));
    size_t off = 0;
    for (int r = 0; r < k.layout_desc.nregions; r++) {
      memcpy((char *)mirror_at(&k, r, to[i]), p + off, k.regions[r].bytes);
      off += k.regions[r].bytes;
    }
  }
  CHECK_OK(pm_blocks_swap_in(s, &k.layout_desc, to, from, n, st, NULL));
  CHECK_OK(pm_stream_synchronize(st));
  bool same = device_is_mirror(&k);
  if (!same)
    fprintf(stderr, "swap_in: %s, piece %zu, cut-off %s: the device differs\n", lay_name[layout],
            piece, cut);
  CHECK(same);

  pm_blocks_stats_t stats;
  CHECK_OK(pm_blocks_get_stats(s, &stats));
  CHECK_EQ_SIZE(stats.swaps_out, 1);
  CHECK_EQ_SIZE(stats.swaps_in, 1);
  CHECK_EQ_SIZE(stats.blocks_out, n);
  CHECK_EQ_SIZE(stats.bytes_in, n * k.block_bytes);
  CHECK_EQ_SIZE(stats.pieces_kernel + stats.pieces_dma, 2 * n * (size_t)k.layout_desc.nregions);
  CHECK_EQ_INT(stats.kernel_max_calibrated, !strcmp(cut, "auto"));
  /* The option as set, where the kernel can reach pinned memory (always on the host backend;
   * elsewhere the device must allow it, else 0: always DMA). */
  if (strcmp(cut, "auto") != 0 && pm_backend_kind() == PM_BACKEND_HOST) {
    size_t want;
    REQUIRE_OK(pm_parse_size(cut, &want));
    CHECK_EQ_SIZE(stats.kernel_max, want);
  }
  if (!strcmp(cut, "0")) CHECK_EQ_SIZE(stats.pieces_kernel, 0);
  if (!strcmp(cut, "1G") && stats.kernel_max) CHECK_EQ_SIZE(stats.pieces_dma, 0);
  CHECK_OK(pm_blocks_free(s, host, nh));
  CHECK_OK(pm_stream_destroy(st));
  CHECK_OK(pm_blocks_destroy(s));
  kv_free(&k);
}

static void test_layouts(void) {
  /* Odd sizes (bf16 [16 tokens, 3 heads, 5 dims] = 480 bytes and a 1-byte-aligned 333), and a
   * piece above the kernel's 64 KiB tile. */
  static const size_t pieces[] = {480, 333, 70000};
  static const char *cuts[] = {"0", "1G", "auto"};
  size_t np = pm_test_small() ? 2 : 3;
  for (int l = 0; l < LAY_COUNT; l++)
    for (size_t p = 0; p < np; p++)
      for (size_t c = 0; c < 3; c++) round_trip(l, pieces[p], cuts[c]);
  /* A cut-off between the two region sizes of one call: both paths at once. */
  round_trip(LAY_KV_STACKED_INNER, 480, "500");
  CHECK_OK(pm_option_set("blocks_kernel_max", NULL));
}

static void test_bad_input(void) {
  kv_t k;
  kv_make(&k, LAY_KV_APART, 1, 8, 256, 77);
  pm_blocks_t *s = make_store(k.block_bytes, 4, 0, 1);
  uint64_t h[4], d[4] = {0, 1, 2, 3};
  REQUIRE_OK(pm_blocks_alloc(s, 3, h));
  /* Exhaustion: one left, two asked for, nothing taken. */
  uint64_t more[2];
  CHECK_ERR_MSG(pm_blocks_alloc(s, 2, more), PM_ERR_NOMEM);
  CHECK(strstr(pm_last_error(), "exhausted") != NULL);
  CHECK_OK(pm_blocks_alloc(s, 1, &h[3]));
  CHECK_ERR_MSG(pm_blocks_alloc(s, 1, more), PM_ERR_NOMEM);

  /* Bad ids, named with their position. */
  uint64_t bad[2] = {h[0], 4};
  CHECK_ERR_MSG(pm_blocks_swap_out(s, &k.layout_desc, d, bad, 2, NULL, NULL), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "host_ids[1] = 4") != NULL);
  uint64_t bad_dev[2] = {0, 8};
  CHECK_ERR_MSG(pm_blocks_swap_in(s, &k.layout_desc, bad_dev, h, 2, NULL, NULL), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "device_ids[1] = 8") != NULL);
  /* Repeated destination ids in one call: host ids going out, device ids coming in. */
  uint64_t twice[3] = {h[0], h[1], h[0]};
  CHECK_ERR_MSG(pm_blocks_swap_out(s, &k.layout_desc, d, twice, 3, NULL, NULL), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "host_ids[2]") != NULL);
  uint64_t dtwice[2] = {3, 3};
  CHECK_ERR_MSG(pm_blocks_swap_in(s, &k.layout_desc, dtwice, h, 2, NULL, NULL), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "distinct") != NULL);
  /* A freed block is not a swap's. */
  CHECK_OK(pm_blocks_free(s, &h[1], 1));
  CHECK_ERR_MSG(pm_blocks_swap_out(s, &k.layout_desc, d, h, 2, NULL, NULL), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "not allocated") != NULL);
  /* Frees: twice in one call, twice over, out of range; nothing is freed then. */
  uint64_t f2[2] = {h[0], h[0]};
  CHECK_ERR_MSG(pm_blocks_free(s, f2, 2), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "named twice") != NULL);
  CHECK_ERR_MSG(pm_blocks_free(s, &h[1], 1), PM_ERR_INVALID);
  uint64_t oob = 99;
  CHECK_ERR_MSG(pm_blocks_free(s, &oob, 1), PM_ERR_INVALID);
  pm_blocks_stats_t stats;
  CHECK_OK(pm_blocks_get_stats(s, &stats));
  CHECK_EQ_SIZE(stats.free_blocks, 1);

  /* Layouts that do not fit: bytes that do not sum to a block, host memory, another device,
   * a stride below the bytes, nothing at all. */
  pm_kv_layout_t L = k.layout_desc;
  pm_kv_region_t r[2] = {k.regions[0], k.regions[1]};
  L.regions = r;
  r[1].bytes = 255;
  CHECK_ERR_MSG(pm_blocks_swap_out(s, &L, d, h, 1, NULL, NULL), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "hold 511 bytes") != NULL);
  r[1] = k.regions[1];
  char *hostmem = malloc(8 * 256);
  REQUIRE(hostmem);
  r[1].base = hostmem;
  CHECK_ERR_MSG(pm_blocks_swap_out(s, &L, d, h, 1, NULL, NULL), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "not device memory") != NULL);
  r[1] = k.regions[1];
  r[1].block_stride = 100;
  CHECK_ERR_MSG(pm_blocks_swap_out(s, &L, d, h, 1, NULL, NULL), PM_ERR_INVALID);
  r[1] = k.regions[1];
  L.device = 1;
  CHECK_ERR_MSG(pm_blocks_swap_out(s, &L, d, h, 1, NULL, NULL), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "device 1") != NULL);
  L.device = -1;
  L.nregions = 0;
  CHECK_ERR_MSG(pm_blocks_swap_out(s, &L, d, h, 1, NULL, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_blocks_swap_out(s, NULL, d, h, 1, NULL, NULL), PM_ERR_INVALID);
  free(hostmem);
  /* Nothing was queued by the refused calls. */
  CHECK_OK(pm_blocks_get_stats(s, &stats));
  CHECK_EQ_SIZE(stats.swaps_out + stats.swaps_in, 0);
  /* A count of 0 is a swap of nothing, with its event. */
  pm_event_t ev = NULL;
  CHECK_OK(pm_blocks_swap_out(s, &k.layout_desc, NULL, NULL, 0, NULL, &ev));
  CHECK(ev != NULL);
  if (ev) CHECK_OK(pm_event_destroy(ev));

  /* Bad configs; a stale handle. */
  pm_blocks_config_t c;
  pm_blocks_config_init(&c);
  pm_blocks_t *x = NULL;
  CHECK_ERR_MSG(pm_blocks_create(&c, &x), PM_ERR_INVALID);
  c.block_bytes = 4096;
  CHECK_ERR_MSG(pm_blocks_create(&c, &x), PM_ERR_INVALID);
  c.num_blocks = 4;
  c.device = 5;
  CHECK_ERR_MSG(pm_blocks_create(&c, &x), PM_ERR_INVALID);
  c.device = -1;
  c.background = 2;
  CHECK_ERR_MSG(pm_blocks_create(&c, &x), PM_ERR_INVALID);
  CHECK(x == NULL);
  CHECK_OK(pm_blocks_destroy(s));
  CHECK_ERR_MSG(pm_blocks_destroy(s), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_blocks_alloc(s, 1, more), PM_ERR_INVALID);
  kv_free(&k);
}

static void test_budget(void) {
  pm_pool_config_t pc;
  pm_pool_config_init(&pc);
  pc.budget = 256 << 10;
  pm_pool_t *pool;
  REQUIRE_OK(pm_pool_create(&pc, &pool));
  pm_blocks_config_t c;
  pm_blocks_config_init(&c);
  c.block_bytes = 64 << 10;
  c.num_blocks = 5; /* 320 KiB: over the budget */
  c.pool = pool;
  pm_blocks_t *s = NULL;
  CHECK_ERR_MSG(pm_blocks_create(&c, &s), PM_ERR_BUDGET);
  CHECK(strstr(pm_last_error(), "block store arena") != NULL);
  c.num_blocks = 4; /* exactly the budget: sizes are exact */
  CHECK_OK(pm_blocks_create(&c, &s));
  pm_pool_stats_t ps;
  CHECK_OK(pm_pool_get_stats(pool, &ps));
  CHECK_EQ_SIZE(ps.pinned_bytes, 256 << 10);
  if (s) CHECK_OK(pm_blocks_destroy(s));
  CHECK_OK(pm_pool_get_stats(pool, &ps));
  CHECK_EQ_SIZE(ps.pinned_bytes, 0);
  /* The charge counts each chunk page-rounded: 4 chunks of one block fit exactly, and 3
   * blocks of 64 KiB + 1 byte in chunks of one block take 3 x 68 KiB. */
  c.chunk_bytes = 64 << 10;
  c.background = 0;
  REQUIRE_OK(pm_blocks_create(&c, &s));
  CHECK_OK(pm_pool_get_stats(pool, &ps));
  CHECK_EQ_SIZE(ps.pinned_bytes, 256 << 10);
  CHECK_OK(pm_blocks_destroy(s));
  size_t page = pm__page_size();
  c.block_bytes = (64 << 10) + 1;
  c.num_blocks = 3;
  c.chunk_bytes = 1;
  REQUIRE_OK(pm_blocks_create(&c, &s));
  CHECK_OK(pm_pool_get_stats(pool, &ps));
  CHECK_EQ_SIZE(ps.pinned_bytes, 3 * (((64 << 10) + page) / page * page));
  CHECK_OK(pm_blocks_destroy(s));
  /* A store far past the budget is refused by it before its bookkeeping (9 bytes a block,
   * here 2^62) is asked of the system: PM_ERR_BUDGET, not PM_ERR_NOMEM. */
  c.block_bytes = 1;
  c.num_blocks = (uint64_t)(SIZE_MAX / 32);
  c.background = 1;
  s = NULL;
  CHECK_ERR_MSG(pm_blocks_create(&c, &s), PM_ERR_BUDGET);
  CHECK(s == NULL);
  CHECK_OK(pm_pool_get_stats(pool, &ps));
  CHECK_EQ_SIZE(ps.pinned_bytes, 0);
  CHECK_OK(pm_pool_destroy(pool));
}

/* Two threads, each on its own stream with its own host and device blocks, swapping at once. */
typedef struct worker {
  pm_blocks_t *s;
  kv_t *k;
  uint64_t first_dev, ndev;
  int rounds;
  bool ok;
} worker_t;

static void *worker_main(void *arg) {
  worker_t *w = arg;
  pm_stream_t st;
  w->ok = pm_stream_create(&st) == PM_OK;
  uint64_t h[4], d[4], back[4];
  w->ok = w->ok && pm_blocks_alloc(w->s, w->ndev, h) == PM_OK;
  for (int r = 0; r < w->rounds && w->ok; r++) {
    for (uint64_t i = 0; i < w->ndev; i++) d[i] = w->first_dev + i;
    pm_event_t ev = NULL;
    w->ok = pm_blocks_swap_out(w->s, &w->k->layout_desc, d, h, w->ndev, st, &ev) == PM_OK;
    /* The swap in comes after the swap out on the same stream: blocks rotate by one. */
    for (uint64_t i = 0; i < w->ndev; i++) back[i] = w->first_dev + (i + 1) % w->ndev;
    w->ok = w->ok && pm_blocks_swap_in(w->s, &w->k->layout_desc, back, h, w->ndev, st, NULL) ==
                         PM_OK;
    w->ok = w->ok && pm_event_synchronize(ev) == PM_OK && pm_event_destroy(ev) == PM_OK;
  }
  w->ok = w->ok && pm_stream_synchronize(st) == PM_OK;
  w->ok = w->ok && pm_blocks_free(w->s, h, w->ndev) == PM_OK;
  if (st) (void)pm_stream_destroy(st);
  return NULL;
}

static void test_two_streams(void) {
  kv_t k;
  kv_make(&k, LAY_KV_APART, 2, 8, 1000, 9);
  pm_blocks_t *s = make_store(k.block_bytes, 8, 0, 1);
  int rounds = pm_test_small() ? 3 : 20;
  worker_t w[2] = {{s, &k, 0, 4, rounds, false}, {s, &k, 4, 4, rounds, false}};
  pthread_t t[2];
  for (int i = 0; i < 2; i++) REQUIRE(pthread_create(&t[i], NULL, worker_main, &w[i]) == 0);
  for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
  CHECK(w[0].ok && w[1].ok);
  /* Each round rotates a worker's 4 blocks by one: after `rounds` rounds, device block
   * first + (i + rounds) % 4 holds what block first + i held. */
  for (int t2 = 0; t2 < k.ntensors; t2++) {
    char *old = malloc(k.tensor_bytes[t2]);
    REQUIRE(old);
    memcpy(old, k.mirror[t2], k.tensor_bytes[t2]);
    for (int g = 0; g < 2; g++)
      for (uint64_t i = 0; i < 4; i++) {
        uint64_t from = (uint64_t)g * 4 + i, to = (uint64_t)g * 4 + (i + (uint64_t)rounds) % 4;
        memcpy(k.mirror[t2] + to * k.piece, old + from * k.piece, k.piece);
      }
    free(old);
  }
  CHECK(device_is_mirror(&k));
  CHECK_OK(pm_blocks_destroy(s));
  kv_free(&k);
}

/* Swaps while the background thread is still pinning: the last block waits for its chunk,
 * the first is usable at once; then every block round trips. */
static void test_background_race(void) {
  kv_t k;
  uint64_t nb = 64;
  kv_make(&k, LAY_ONE_TENSOR, 1, nb, 4096, 13);
  for (int rep = 0; rep < (pm_test_small() ? 1 : 4); rep++) {
    /* One block a chunk: 64 chunks, 63 of them pinned in the background. */
    pm_blocks_t *s = make_store(k.block_bytes, nb, k.block_bytes, 1);
    pm_blocks_stats_t st0;
    CHECK_OK(pm_blocks_get_stats(s, &st0));
    CHECK(st0.chunks == nb);
    CHECK(st0.chunks_ready >= 1);
    CHECK(st0.first_ready_seconds > 0);
    uint64_t h[64], d[64];
    REQUIRE_OK(pm_blocks_alloc(s, nb, h));
    CHECK(h[0] == 0 && h[nb - 1] == nb - 1); /* low ids first */
    /* The highest id first, then the rest in reverse. */
    for (uint64_t i = 0; i < nb; i++) d[i] = i, h[i] = nb - 1 - i;
    pm_event_t ev;
    CHECK_OK(pm_blocks_swap_out(s, &k.layout_desc, d, h, nb, NULL, &ev));
    CHECK_OK(pm_event_synchronize(ev));
    CHECK_OK(pm_event_destroy(ev));
    bool all = true;
    for (uint64_t i = 0; i < nb; i++) all = all && host_block_is(s, &k, h[i], d[i]);
    CHECK(all);
    CHECK_OK(pm_blocks_wait_ready(s, 0));
    pm_blocks_stats_t st1;
    CHECK_OK(pm_blocks_get_stats(s, &st1));
    CHECK(st1.chunks_ready == nb && st1.ready_blocks == nb);
    CHECK(st1.all_ready_seconds >= st1.first_ready_seconds);
    CHECK_EQ_SIZE(st1.arena_bytes, nb * pm__align_up(4096, pm__page_size()));
    CHECK_OK(pm_blocks_destroy(s));
  }
  /* A first chunk smaller than the others (3 blocks, then chunks of 5): ids on both sides of
   * every boundary land in their own block. */
  atomic_store(&pm__blocks_first_bytes, 3 * k.block_bytes);
  {
    pm_blocks_t *s = make_store(k.block_bytes, 20, 5 * k.block_bytes, 1);
    pm_blocks_stats_t st;
    CHECK_OK(pm_blocks_get_stats(s, &st));
    CHECK_EQ_SIZE(st.chunks, 5); /* 3 + 5 + 5 + 5 + 2 */
    CHECK_EQ_SIZE(st.chunk_bytes, 5 * k.block_bytes);
    uint64_t h[20], d[20];
    REQUIRE_OK(pm_blocks_alloc(s, 20, h));
    for (uint64_t i = 0; i < 20; i++) d[i] = (i * 7) % 20;
    CHECK_OK(pm_blocks_swap_out(s, &k.layout_desc, d, h, 20, NULL, NULL));
    CHECK_OK(pm_stream_synchronize(NULL));
    bool all = true;
    char *prev = NULL;
    for (uint64_t i = 0; i < 20; i++) {
      all = all && host_block_is(s, &k, h[i], d[i]);
      char *p;
      CHECK_OK(pm_blocks_ptr(s, i, (void **)&p));
      CHECK(p != prev);
      prev = p;
    }
    CHECK(all);
    CHECK_OK(pm_blocks_get_stats(s, &st));
    CHECK_EQ_SIZE(st.ready_blocks, 20);
    CHECK_EQ_SIZE(st.arena_bytes, 20 * pm__align_up(4096, pm__page_size()));
    CHECK_OK(pm_blocks_destroy(s));
  }
  atomic_store(&pm__blocks_first_bytes, (size_t)64 << 20);
  /* Destroy while the pinning still runs: it stops and unpins what it pinned. */
  pm_blocks_t *s = make_store(k.block_bytes, nb, k.block_bytes, 1);
  CHECK_OK(pm_blocks_destroy(s));
  /* background 0: the whole arena is pinned on return. */
  s = make_store(k.block_bytes, nb, 8 * k.block_bytes, 0);
  pm_blocks_stats_t st2;
  CHECK_OK(pm_blocks_get_stats(s, &st2));
  CHECK(st2.chunks == 8 && st2.chunks_ready == 8);
  CHECK_OK(pm_blocks_destroy(s));
  kv_free(&k);
}

/* The arena is pinned for the node option numa names for the store's device (auto: the
 * device's node); where binding to it fails the arena is still pinned and usable. */
static void test_numa_node(void) {
  kv_t k;
  kv_make(&k, LAY_ONE_TENSOR, 1, 4, 4096, 41);
  static const struct {
    const char *opt;
    int node;
  } cases[] = {{"off", -1}, {"0", 0}, {"1", 1}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    REQUIRE_OK(pm_option_set("numa", cases[i].opt));
    pm__numa_state_t before, after;
    pm__numa_state(&before);
    pm_blocks_t *s = make_store(k.block_bytes, 4, 2 * k.block_bytes, 1);
    pm_blocks_stats_t st;
    CHECK_OK(pm_blocks_wait_ready(s, 0));
    CHECK_OK(pm_blocks_get_stats(s, &st));
    CHECK_EQ_INT(st.numa_node, cases[i].node);
    pm__numa_state(&after);
    /* Each of the two chunks was bound or its refusal counted. */
    if (cases[i].node >= 0)
      CHECK(after.bind_ok + after.bind_failures >= before.bind_ok + before.bind_failures + 2);
    uint64_t h[4], d[4] = {3, 2, 1, 0};
    REQUIRE_OK(pm_blocks_alloc(s, 4, h));
    CHECK_OK(pm_blocks_swap_out(s, &k.layout_desc, d, h, 4, NULL, NULL));
    CHECK_OK(pm_stream_synchronize(NULL));
    bool all = true;
    for (int j = 0; j < 4; j++) all = all && host_block_is(s, &k, h[j], d[j]);
    CHECK(all);
    CHECK_OK(pm_blocks_destroy(s));
  }
  CHECK_OK(pm_option_set("numa", NULL));
  kv_free(&k);
}

/* Pieces that continue each other are joined: a one-region layout with ids consecutive on both
 * sides is one copy per host chunk (never one across two registrations), under each path. */
static void test_joined_pieces(void) {
  static const char *cuts[] = {"0", "1G"};
  kv_t k;
  kv_make(&k, LAY_ONE_TENSOR, 1, 16, 4096, 31);
  for (int c = 0; c < 2; c++) {
    REQUIRE_OK(pm_option_set("blocks_kernel_max", cuts[c]));
    pm_blocks_t *s = make_store(k.block_bytes, 10, 5 * k.block_bytes, 0);
    uint64_t h[10], d[10];
    REQUIRE_OK(pm_blocks_alloc(s, 10, h)); /* 0..9: chunks [0, 5) and [5, 10) */
    for (uint64_t i = 0; i < 8; i++) d[i] = 4 + i;
    pm_blocks_stats_t st;
    CHECK_OK(pm_blocks_swap_out(s, &k.layout_desc, d, h + 1, 3, NULL, NULL)); /* 1..3 */
    CHECK_OK(pm_blocks_get_stats(s, &st));
    CHECK_EQ_SIZE(st.transfers, 1);
    CHECK_OK(pm_blocks_swap_out(s, &k.layout_desc, d, h + 2, 6, NULL, NULL)); /* 2..4 | 5..7 */
    CHECK_OK(pm_blocks_get_stats(s, &st));
    CHECK_EQ_SIZE(st.transfers, 3);
    CHECK_EQ_SIZE(st.pieces_kernel + st.pieces_dma, 9);
    CHECK_OK(pm_stream_synchronize(NULL));
    bool all = true;
    for (uint64_t i = 0; i < 6; i++) all = all && host_block_is(s, &k, h[2 + i], d[i]);
    CHECK(all);
    /* Back in reverse order: nothing continues, one copy a block. */
    uint64_t rd[6], rh[6];
    for (uint64_t i = 0; i < 6; i++) rd[i] = 15 - i, rh[i] = h[2 + i];
    CHECK_OK(pm_blocks_swap_in(s, &k.layout_desc, rd, rh, 6, NULL, NULL));
    CHECK_OK(pm_blocks_get_stats(s, &st));
    CHECK_EQ_SIZE(st.transfers, 9);
    CHECK_OK(pm_stream_synchronize(NULL));
    for (uint64_t i = 0; i < 6; i++)
      memcpy(k.mirror[0] + rd[i] * k.piece, k.mirror[0] + d[i] * k.piece, k.piece);
    CHECK(device_is_mirror(&k));
    CHECK_OK(pm_blocks_destroy(s));
  }
  CHECK_OK(pm_option_set("blocks_kernel_max", NULL));
  kv_free(&k);
}

/* A chunk that cannot be pinned (the third registration fails): the blocks before it work, a
 * call that names a block at or after it gets the pinning error (never hangs), the unpinned
 * chunks' charge goes back at once and their blocks leave the free list, and destroy unpins what
 * was pinned and gives the rest of the charge back. */
static void test_pinning_fails(void) {
  kv_t k;
  kv_make(&k, LAY_ONE_TENSOR, 1, 8, 4096, 21);
  pm_pool_t *pool;
  REQUIRE_OK(pm_pool_default(&pool));
  pm_pool_stats_t p0;
  REQUIRE_OK(pm_pool_get_stats(pool, &p0));
  long long locked0 = pm_test_vm_locked();
  REQUIRE_OK(pm__fault_set(PM__FAULT_HOST_REGISTER, 3, 0));
  pm_blocks_config_t c;
  pm_blocks_config_init(&c);
  c.block_bytes = k.block_bytes;
  c.num_blocks = 8;
  c.chunk_bytes = 2 * k.block_bytes; /* 4 chunks of 2 blocks: chunk 2 fails */
  pm_blocks_t *s = NULL;
  REQUIRE_OK(pm_blocks_create(&c, &s));
  uint64_t h[8], d[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  /* The pinner races this alloc: before chunk 2 fails, all 8 blocks are handed out (a swap on
   * the late ones waits for their chunk and gets its error); once it has failed, only the 4
   * pinned ones are. Either order is correct, and each is checked where it happened. */
  pm_status_t early = pm_blocks_alloc(s, 8, h);
  if (early != PM_OK) {
    CHECK_EQ_INT(early, PM_ERR_NOMEM);
    CHECK(strstr(pm_last_error(), "blocks from 4 on could not be pinned") != NULL);
    REQUIRE_OK(pm_blocks_alloc(s, 4, h));
  }
  uint64_t held = early == PM_OK ? 8 : 4;
  /* The registration's own status (the host backend's refusal is PM_ERR_MEMLOCK). */
  pm_status_t failed = pm_blocks_wait_ready(s, 0);
  CHECK(failed < 0);
  CHECK(strstr(pm_last_error(), "background pinning failed") != NULL);
  CHECK(strstr(pm_last_error(), "from 4 on") != NULL);
  CHECK_OK(pm_blocks_wait_ready(s, 4));
  CHECK_OK(pm_blocks_swap_out(s, &k.layout_desc, d, h, 4, NULL, NULL));
  CHECK_OK(pm_stream_synchronize(NULL));
  bool all = true;
  for (int i = 0; i < 4; i++) all = all && host_block_is(s, &k, h[i], d[i]);
  CHECK(all);
  if (held == 8)
    CHECK_ERR_MSG(pm_blocks_swap_in(s, &k.layout_desc, d, h + 2, 3, NULL, NULL), failed);
  /* After the failure, alloc never hands out a block of an unpinned chunk. */
  uint64_t more[4];
  CHECK_ERR_MSG(pm_blocks_alloc(s, 8 - held + 1, more), PM_ERR_NOMEM);
  CHECK(strstr(pm_last_error(), "blocks from 4 on could not be pinned") != NULL);
  void *p;
  CHECK_ERR_MSG(pm_blocks_ptr(s, 7, &p), failed);
  pm_blocks_stats_t st;
  CHECK_OK(pm_blocks_get_stats(s, &st));
  CHECK_EQ_SIZE(st.chunks_ready, 2);
  CHECK_EQ_SIZE(st.ready_blocks, 4);
  CHECK_EQ_SIZE(st.swaps_in, 0);
  /* The chunks that were never pinned are given back to the budget, and their blocks never go
   * back to the free list: alloc hands out only blocks a swap can use, and says why not more. */
  size_t chunk_charge = pm__align_up(2 * k.block_bytes, pm__page_size());
  CHECK_EQ_SIZE(st.arena_bytes, 2 * chunk_charge);
  pm_pool_stats_t pf;
  CHECK_OK(pm_pool_get_stats(pool, &pf));
  CHECK_EQ_SIZE(pf.registered_bytes, p0.registered_bytes + 2 * chunk_charge);
  CHECK_OK(pm_blocks_free(s, h, held));
  CHECK_OK(pm_blocks_get_stats(s, &st));
  CHECK_EQ_SIZE(st.free_blocks, 4);
  for (int round = 0; round < 2; round++) {
    uint64_t a[4];
    CHECK_OK(pm_blocks_alloc(s, 4, a));
    for (int i = 0; i < 4; i++) CHECK(a[i] < 4);
    CHECK_ERR_MSG(pm_blocks_alloc(s, 1, a), PM_ERR_NOMEM);
    CHECK(strstr(pm_last_error(), "blocks from 4 on could not be pinned") != NULL);
    CHECK_OK(pm_blocks_free(s, a, 4));
  }
  pm__fault_reset();
  CHECK_OK(pm_blocks_destroy(s));
  pm_pool_stats_t p1;
  CHECK_OK(pm_pool_get_stats(pool, &p1));
  CHECK_EQ_SIZE(p1.registered_bytes, p0.registered_bytes);
  CHECK_EQ_SIZE(p1.pinned_bytes, p0.pinned_bytes);
  if (locked0 >= 0) CHECK(pm_test_vm_locked() <= locked0);
  kv_free(&k);
}

/* A store of nblocks host blocks for k, a stream, and every block allocated into h. */
static pm_blocks_t *store_all_allocated(kv_t *k, uint64_t nblocks, pm_stream_t *stream,
                                        uint64_t *h) {
  pm_blocks_t *s = make_store(k->block_bytes, nblocks, 0, 0);
  REQUIRE_OK(pm_stream_create(stream));
  REQUIRE_OK(pm_blocks_alloc(s, nblocks, h));
  return s;
}

/* Host block h[i] holds device block d[i] of the mirror, for i < n. */
static bool hosts_hold(pm_blocks_t *s, const kv_t *k, const uint64_t *h, const uint64_t *d, int n) {
  bool ok = true;
  for (int i = 0; i < n; i++) ok = ok && host_block_is(s, k, h[i], d[i]);
  return ok;
}

static uint64_t event_syncs(void) {
  pm__fault_counts_t c;
  pm__fault_counts(&c);
  return c.calls[PM__FAULT_EVENT_SYNC];
}

/* A store of 4 blocks, all allocated (h) and holding device blocks 0-3, streams a and b, and a
 * swap_in of h[0], h[1] into device blocks 4, 5 held on a behind gate g (the mirror says so). */
static pm_blocks_t *store_held_swap_in(kv_t *k, pm_stream_t *a, pm_stream_t *b, uint64_t *h,
                                       pm_test_gate_t *g) {
  uint64_t d[4] = {0, 1, 2, 3}, din[2] = {4, 5};
  pm_blocks_t *s = store_all_allocated(k, 4, a, h);
  REQUIRE_OK(pm_stream_create(b));
  REQUIRE_OK(pm_blocks_swap_out(s, &k->layout_desc, d, h, 4, NULL, NULL));
  REQUIRE_OK(pm_stream_synchronize(NULL));
  pm_test_gate_init(g);
  REQUIRE_OK(pm_launch_host_func(*a, pm_test_gate_wait, g));
  REQUIRE_OK(pm_blocks_swap_in(s, &k->layout_desc, din, h, 2, *a, NULL));
  for (int t = 0; t < k->ntensors; t++) {
    memcpy(k->mirror[t] + 4 * k->piece, k->mirror[t] + 0 * k->piece, k->piece);
    memcpy(k->mirror[t] + 5 * k->piece, k->mirror[t] + 1 * k->piece, k->piece);
  }
  return s;
}

/* Host blocks freed while a swap_in still reads them (its stream held by a gate) are not
 * handed out again until it completed: alloc takes the idle blocks first without waiting; an
 * alloc of every block waits for the swap_in (an opener thread lets its stream go once alloc
 * waits); and the new owner's swap_out into the re-allocated blocks neither corrupts what the
 * swap_in read nor is itself overwritten. */
static void test_free_during_swap(void) {
  kv_t k;
  kv_make(&k, LAY_ONE_TENSOR, 1, 8, 4096, 31);
  pm_stream_t a, b;
  uint64_t h[4];
  pm_test_gate_t g;
  pm_blocks_t *s = store_held_swap_in(&k, &a, &b, h, &g);
  CHECK_OK(pm_blocks_free(s, h, 4)); /* h[0], h[1]: the swap_in still reads them */
  pm_blocks_stats_t st;
  CHECK_OK(pm_blocks_get_stats(s, &st));
  CHECK_EQ_SIZE(st.free_blocks, 2); /* what alloc takes without waiting */
  uint64_t waiting = 9, quarantined = 9;
  CHECK_OK(pm_blocks_get_free(s, NULL, &waiting, &quarantined));
  CHECK_EQ_SIZE(waiting, 2); /* and what it waits for */
  CHECK_EQ_SIZE(quarantined, 0);
  REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_SYNC, 0, 0)); /* count waits, fail none */
  uint64_t idle[2];
  CHECK_OK(pm_blocks_alloc(s, 2, idle));
  CHECK((idle[0] == h[2] && idle[1] == h[3]) || (idle[0] == h[3] && idle[1] == h[2]));
  CHECK_EQ_SIZE(event_syncs(), 0);
  CHECK_OK(pm_blocks_free(s, idle, 2));
  /* The gate goes once alloc waits for a swap (its first event_synchronize). */
  pm_test_opener_t o;
  pm_test_opener_start(&o, &g, (const int[]){PM__FAULT_EVENT_SYNC}, 1);
  uint64_t all[4];
  CHECK_OK(pm_blocks_alloc(s, 4, all));
  uint64_t dout[4] = {6, 7, 2, 3};
  CHECK_OK(pm_blocks_swap_out(s, &k.layout_desc, dout, all, 4, b, NULL));
  CHECK_OK(pm_stream_synchronize(b));
  CHECK(pm_test_opener_stop(&o)); /* alloc waited for the swap_in */
  pm_test_gate_open(&g);          /* (already open unless alloc handed out busy blocks) */
  CHECK_OK(pm_stream_synchronize(a));
  CHECK(device_is_mirror(&k)); /* the swap_in read what h[0], h[1] held when it was queued */
  CHECK(hosts_hold(s, &k, all, dout, 4));
  pm__fault_reset();
  CHECK_OK(pm_stream_destroy(a));
  CHECK_OK(pm_stream_destroy(b));
  pm_test_gate_destroy(&g);
  CHECK_OK(pm_blocks_destroy(s));
  kv_free(&k);
}

/* Freed blocks come back as soon as the swaps that named them completed, whatever runs on other
 * streams: a swap_in held on stream a (by a gate) keeps its own blocks, not blocks that only a
 * completed swap on stream b used. Freed after waiting for b's swap, or before it (the store
 * learns from b's event, without waiting), those blocks are handed out with no wait at all (an
 * opener lets a go if alloc waits for an event, so a wait shows as a failed check, not a hang).
 * A block that the held swap and a completed one on b both read waits for the held one. */
static void test_free_other_stream(void) {
  kv_t k;
  kv_make(&k, LAY_KV_APART, 2, 8, 512, 37);
  pm_stream_t a, b;
  uint64_t h[4];
  pm_test_gate_t g;
  pm_blocks_t *s = store_held_swap_in(&k, &a, &b, h, &g);
  REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_SYNC, 0, 0)); /* count waits, fail none */
  pm_test_opener_t o;
  pm_test_opener_start(&o, &g, (const int[]){PM__FAULT_EVENT_SYNC}, 1);
  for (int before = 0; before < 2; before++) {
    /* h[2], h[3] out again on b (device blocks 6, 7), freed after or before its event. */
    uint64_t dout[2] = {6, 7};
    CHECK_OK(pm_blocks_swap_out(s, &k.layout_desc, dout, h + 2, 2, b, NULL));
    if (before) CHECK_OK(pm_blocks_free(s, h + 2, 2));
    CHECK_OK(pm_stream_synchronize(b)); /* (not an event wait: the opener counts those) */
    CHECK(hosts_hold(s, &k, h + 2, dout, 2));
    if (!before) CHECK_OK(pm_blocks_free(s, h + 2, 2));
    pm_blocks_stats_t st;
    CHECK_OK(pm_blocks_get_stats(s, &st));
    CHECK_EQ_SIZE(st.free_blocks, 2); /* b's swap completed: idle, whatever a holds */
    uint64_t got[2];
    CHECK_OK(pm_blocks_alloc(s, 2, got));
    CHECK((got[0] == h[2] && got[1] == h[3]) || (got[0] == h[3] && got[1] == h[2]));
    h[2] = got[0];
    h[3] = got[1];
    CHECK_EQ_SIZE(event_syncs(), 0);
  }
  CHECK(!pm_test_opener_stop(&o)); /* alloc never waited for the held swap_in */
  /* h[0] read by the held swap_in and by a completed one on b: it waits for the held one. */
  pm_test_opener_start(&o, &g, (const int[]){PM__FAULT_EVENT_SYNC}, 1);
  uint64_t d2[1] = {2};
  CHECK_OK(pm_blocks_swap_in(s, &k.layout_desc, d2, h, 1, b, NULL));
  for (int t = 0; t < k.ntensors; t++)
    memcpy(k.mirror[t] + 2 * k.piece, k.mirror[t] + 0 * k.piece, k.piece);
  CHECK_OK(pm_stream_synchronize(b));
  CHECK_OK(pm_blocks_free(s, h, 1));
  uint64_t waiting = 0;
  CHECK_OK(pm_blocks_get_free(s, NULL, &waiting, NULL));
  CHECK_EQ_SIZE(waiting, 1);
  uint64_t got;
  CHECK_OK(pm_blocks_alloc(s, 1, &got));
  CHECK_EQ_SIZE(got, h[0]);
  CHECK(pm_test_opener_stop(&o)); /* it waited for the held swap_in */
  pm_test_gate_open(&g);
  CHECK_OK(pm_stream_synchronize(a));
  CHECK(device_is_mirror(&k)); /* the swap_ins read what h[0], h[1] held */
  pm__fault_reset();
  CHECK_OK(pm_stream_destroy(a));
  CHECK_OK(pm_stream_destroy(b));
  pm_test_gate_destroy(&g);
  CHECK_OK(pm_blocks_destroy(s));
  kv_free(&k);
}

/* A caller that waits for its swaps before freeing sees alloc as it always was: freed blocks
 * come back at once, last freed first, alloc never waits, exactly the free count succeeds and
 * one more is PM_ERR_NOMEM with nothing taken. */
static void test_free_after_wait(void) {
  kv_t k;
  kv_make(&k, LAY_KV_APART, 2, 8, 1000, 33);
  pm_stream_t a;
  uint64_t h[6], d[6] = {2, 3, 4, 5, 6, 7};
  pm_blocks_t *s = store_all_allocated(&k, 6, &a, h);
  for (int dir = 0; dir < 2; dir++) {
    pm_event_t ev = NULL;
    if (dir == 0)
      REQUIRE_OK(pm_blocks_swap_out(s, &k.layout_desc, d, h, 6, a, &ev));
    else
      REQUIRE_OK(pm_blocks_swap_in(s, &k.layout_desc, d, h, 6, a, &ev));
    CHECK_OK(pm_event_synchronize(ev));
    CHECK_OK(pm_event_destroy(ev));
    REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_SYNC, 0, 0));
    CHECK_OK(pm_blocks_free(s, h, 6));
    pm_blocks_stats_t st;
    CHECK_OK(pm_blocks_get_stats(s, &st));
    CHECK_EQ_SIZE(st.free_blocks, 6);
    uint64_t more[7];
    CHECK_ERR_MSG(pm_blocks_alloc(s, 7, more), PM_ERR_NOMEM);
    CHECK(strstr(pm_last_error(), "asked for 7 blocks, 6 of 6 are free") != NULL);
    CHECK_OK(pm_blocks_get_stats(s, &st));
    CHECK_EQ_SIZE(st.free_blocks, 6);
    CHECK_OK(pm_blocks_alloc(s, 6, more));
    bool lifo = true;
    for (int i = 0; i < 6; i++) lifo = lifo && more[i] == h[5 - i];
    CHECK(lifo);
    CHECK_EQ_SIZE(event_syncs(), 0);
    pm__fault_reset();
    memcpy(h, more, sizeof h);
    for (int i = 0; i < 3; i++) { /* the same ids again, in their first order */
      uint64_t x = h[i];
      h[i] = h[5 - i];
      h[5 - i] = x;
    }
  }
  CHECK(device_is_mirror(&k));
  CHECK_OK(pm_stream_destroy(a));
  CHECK_OK(pm_blocks_destroy(s));
  kv_free(&k);
}

/* When the store cannot record a swap's own event it synchronizes the swap's stream instead:
 * the swap succeeds and its blocks are idle at once. When the device cannot say whether a swap
 * completed (its event fails), the blocks freed while it used them are never handed out again
 * (alloc says why, naming the swap), while idle blocks still are. */
static void test_free_swap_untracked(void) {
  kv_t k;
  kv_make(&k, LAY_ONE_TENSOR, 1, 8, 4096, 35);
  pm_stream_t a;
  uint64_t h[4], d[4] = {0, 1, 2, 3};
  pm_blocks_t *s = store_all_allocated(&k, 4, &a, h);
  REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_RECORD, 1, 0)); /* the store's own event */
  pm_event_t ev = NULL;
  CHECK_OK(pm_blocks_swap_out(s, &k.layout_desc, d, h, 4, a, &ev));
  pm__fault_counts_t c;
  pm__fault_counts(&c);
  CHECK_EQ_SIZE(c.injected[PM__FAULT_EVENT_RECORD], 1);
  pm__fault_reset();
  CHECK_OK(pm_event_synchronize(ev));
  CHECK_OK(pm_event_destroy(ev));
  CHECK(hosts_hold(s, &k, h, d, 4));
  CHECK_OK(pm_blocks_free(s, h, 4));
  REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_SYNC, 0, 0));
  uint64_t got[4];
  CHECK_OK(pm_blocks_alloc(s, 4, got)); /* idle: the stream was synchronized */
  CHECK_EQ_SIZE(event_syncs(), 0);
  pm__fault_reset();

  pm_test_gate_t g;
  pm_test_gate_init(&g);
  REQUIRE_OK(pm_launch_host_func(a, pm_test_gate_wait, &g));
  uint64_t din[2] = {4, 5};
  REQUIRE_OK(pm_blocks_swap_in(s, &k.layout_desc, din, got, 2, a, NULL));
  CHECK_OK(pm_blocks_free(s, got, 4)); /* got[0], got[1]: the held swap_in reads them */
  REQUIRE_OK(pm__fault_configure("event_sync=1+")); /* the device cannot tell */
  uint64_t all[4];
  pm_status_t st = pm_blocks_alloc(s, 4, all);
  CHECK(st < 0);
  CHECK(strstr(pm_last_error(), "completion cannot be known") != NULL);
  uint64_t idle[2];
  CHECK_OK(pm_blocks_alloc(s, 2, idle));
  CHECK((idle[0] == got[2] && idle[1] == got[3]) || (idle[0] == got[3] && idle[1] == got[2]));
  pm__fault_reset();
  pm_test_gate_open(&g);
  CHECK_OK(pm_stream_synchronize(a));
  CHECK_EQ_INT(pm_blocks_alloc(s, 1, all), st); /* kept out of use */
  pm_blocks_stats_t bs;
  CHECK_OK(pm_blocks_get_stats(s, &bs));
  CHECK_EQ_SIZE(bs.free_blocks, 0);
  uint64_t waiting = 9, quarantined = 9;
  CHECK_OK(pm_blocks_get_free(s, NULL, &waiting, &quarantined));
  CHECK_EQ_SIZE(waiting, 0);
  CHECK_EQ_SIZE(quarantined, 2);
  CHECK_OK(pm_blocks_free(s, idle, 2));
  CHECK_OK(pm_blocks_alloc(s, 2, idle)); /* idle blocks still come and go */
  CHECK_OK(pm_stream_destroy(a));
  pm_test_gate_destroy(&g);
  CHECK_OK(pm_blocks_destroy(s));
  kv_free(&k);
}

/* A swap that got no event and whose stream could not be synchronized either (its completion
 * cannot be tracked) fails with that error; its blocks are kept out of use once freed (an alloc
 * that only they would satisfy fails naming the swap), the others come and go, and every event
 * made is destroyed by the close. A swap whose copies failed midway keeps its own error and its
 * blocks come back once its stream is done with them. */
static void test_swap_untrackable(void) {
  kv_t k;
  kv_make(&k, LAY_KV_APART, 1, 8, 256, 41);
  pm_stream_t a;
  uint64_t h[4], d[4] = {0, 1, 2, 3};
  REQUIRE_OK(pm_option_set("blocks_kernel_max", "0")); /* DMA: the memcpy fault below hits */
  pm_blocks_t *s = store_all_allocated(&k, 4, &a, h);
  REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_DESTROY, 0, 0)); /* count */
  REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_CREATE, 1, 0));  /* the store's event (none cached) */
  REQUIRE_OK(pm__fault_set(PM__FAULT_STREAM_SYNC, 1, 0));   /* and the stream instead */
  pm_event_t ev = NULL;
  pm_status_t st = pm_blocks_swap_out(s, &k.layout_desc, d, h, 2, a, &ev);
  CHECK_EQ_INT(st, PM_ERR_BACKEND);
  CHECK(strstr(pm_last_error(), "completion cannot be tracked") != NULL);
  CHECK(ev == NULL);
  REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_CREATE, 0, 0));
  REQUIRE_OK(pm__fault_set(PM__FAULT_STREAM_SYNC, 0, 0));
  CHECK_OK(pm_stream_synchronize(a));
  CHECK_OK(pm_blocks_free(s, h, 4));
  uint64_t idle = 9, waiting = 9, quar = 9;
  CHECK_OK(pm_blocks_get_free(s, &idle, &waiting, &quar));
  CHECK_EQ_SIZE(idle, 2);
  CHECK_EQ_SIZE(waiting, 0);
  CHECK_EQ_SIZE(quar, 2);
  uint64_t got[4];
  CHECK_EQ_INT(pm_blocks_alloc(s, 3, got), PM_ERR_BACKEND);
  CHECK(strstr(pm_last_error(), "(swap 1 failed on the device)") != NULL);
  CHECK_OK(pm_blocks_alloc(s, 2, got));
  CHECK((got[0] == h[2] && got[1] == h[3]) || (got[0] == h[3] && got[1] == h[2]));
  /* Copies that fail midway: the swap's error; its blocks are not quarantined. */
  REQUIRE_OK(pm__fault_set(PM__FAULT_MEMCPY, 2, 0));
  st = pm_blocks_swap_in(s, &k.layout_desc, d, got, 2, a, NULL);
  CHECK_EQ_INT(st, PM_ERR_BACKEND);
  CHECK(strstr(pm_last_error(), "queueing 2 blocks") != NULL);
  REQUIRE_OK(pm__fault_set(PM__FAULT_MEMCPY, 0, 0));
  CHECK_OK(pm_stream_synchronize(a));
  CHECK_OK(pm_blocks_free(s, got, 2));
  CHECK_OK(pm_blocks_get_free(s, &idle, &waiting, &quar));
  CHECK_EQ_SIZE(idle, 2);
  CHECK_EQ_SIZE(quar, 2);
  CHECK_OK(pm_blocks_alloc(s, 2, got));
  CHECK_OK(pm_blocks_free(s, got, 2));
  CHECK_OK(pm_blocks_destroy(s));
  pm__fault_counts_t fc;
  pm__fault_counts(&fc);
  CHECK_EQ_SIZE(fc.calls[PM__FAULT_EVENT_CREATE], fc.calls[PM__FAULT_EVENT_DESTROY]);
  pm__fault_reset();
  CHECK_OK(pm_stream_destroy(a));
  kv_free(&k);
}

/* A stream the caller destroyed while the store still kept records of its swaps (queued, not
 * yet learnt complete), and a stream made after it (which may get the same handle): the old
 * swaps are learnt complete from their events, the new stream's swaps are tracked on their own,
 * and no block waits for a stream that is gone. */
static void test_stream_destroyed(void) {
  kv_t k;
  kv_make(&k, LAY_ONE_TENSOR, 1, 8, 512, 43);
  pm_stream_t a, b;
  uint64_t h[4], d[4] = {0, 1, 2, 3};
  pm_blocks_t *s = store_all_allocated(&k, 4, &a, h);
  for (int round = 0; round < 8; round++) {
    pm_test_gate_t g;
    pm_test_gate_init(&g);
    REQUIRE_OK(pm_launch_host_func(a, pm_test_gate_wait, &g));
    CHECK_OK(pm_blocks_swap_out(s, &k.layout_desc, d, h, 2, a, NULL));
    CHECK_OK(pm_blocks_free(s, h, 2)); /* waiting: the swap is held */
    pm_test_gate_open(&g);
    CHECK_OK(pm_stream_destroy(a)); /* its work finishes; the store has not looked yet */
    pm_test_gate_destroy(&g);
    REQUIRE_OK(pm_stream_create(&b));
    pm_test_gate_init(&g);
    REQUIRE_OK(pm_launch_host_func(b, pm_test_gate_wait, &g));
    CHECK_OK(pm_blocks_swap_out(s, &k.layout_desc, d + 2, h + 2, 2, b, NULL));
    CHECK_OK(pm_blocks_free(s, h + 2, 2)); /* waiting for b's held swap */
    uint64_t idle = 9, waiting = 9, quar = 9;
    CHECK_OK(pm_blocks_get_free(s, &idle, &waiting, &quar));
    CHECK_EQ_SIZE(idle, 2);
    CHECK_EQ_SIZE(waiting, 2);
    uint64_t got[2];
    CHECK_OK(pm_blocks_alloc(s, 2, got));
    CHECK((got[0] == h[0] && got[1] == h[1]) || (got[0] == h[1] && got[1] == h[0]));
    pm_test_gate_open(&g);
    CHECK_OK(pm_stream_synchronize(b));
    pm_test_gate_destroy(&g);
    uint64_t got2[2];
    CHECK_OK(pm_blocks_alloc(s, 2, got2));
    CHECK((got2[0] == h[2] && got2[1] == h[3]) || (got2[0] == h[3] && got2[1] == h[2]));
    h[0] = got[0];
    h[1] = got[1];
    h[2] = got2[0];
    h[3] = got2[1];
    CHECK_OK(pm_blocks_get_free(s, &idle, &waiting, &quar));
    CHECK_EQ_SIZE(idle + waiting + quar, 0);
    a = b; /* the next round destroys it while its record may still be kept */
  }
  CHECK_OK(pm_blocks_destroy(s));
  CHECK_OK(pm_stream_destroy(a));
  kv_free(&k);
}

typedef struct queueing_arg {
  pm_blocks_t *s;
  kv_t *k;
  const uint64_t *d, *h;
  pm_stream_t stream;
  pm_status_t st;
} queueing_arg_t;

static void *queueing_swap(void *arg) {
  queueing_arg_t *q = arg;
  q->st = pm_blocks_swap_out(q->s, &q->k->layout_desc, q->d, q->h, 2, q->stream, NULL);
  return NULL;
}

static void *open_now(void *gate) {
  pm_test_gate_open(gate);
  return NULL;
}

/* Blocks freed while their swap is still being queued on another thread (its record has no
 * event yet): here the swap got no event and synchronizes its stream, which a gate holds, so it
 * stays in that state for as long as the test needs. The freed blocks wait (the stats say so
 * exactly), the idle ones are handed out, an alloc of the waiting ones returns them once the
 * swap is done, and they then hold what it wrote. */
static void test_free_while_queueing(void) {
  kv_t k;
  kv_make(&k, LAY_ONE_TENSOR, 1, 8, 1024, 45);
  pm_stream_t a;
  uint64_t h[4], d[2] = {0, 1};
  pm_blocks_t *s = store_all_allocated(&k, 4, &a, h);
  pm_test_gate_t g;
  pm_test_gate_init(&g);
  REQUIRE_OK(pm_launch_host_func(a, pm_test_gate_wait, &g));
  REQUIRE_OK(pm__fault_set(PM__FAULT_STREAM_SYNC, 0, 0));  /* count */
  REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_CREATE, 1, 0)); /* the store's first event */
  queueing_arg_t q = {s, &k, d, h, a, PM_ERR_INTERNAL};
  pthread_t t;
  REQUIRE(pthread_create(&t, NULL, queueing_swap, &q) == 0);
  pm__fault_counts_t fc;
  do { /* until the swap synchronizes its stream: its record is queueing until the gate opens */
    sched_yield();
    pm__fault_counts(&fc);
  } while (fc.calls[PM__FAULT_STREAM_SYNC] == 0);
  CHECK_OK(pm_blocks_free(s, h, 4));
  uint64_t idle = 9, waiting = 9, quar = 9;
  CHECK_OK(pm_blocks_get_free(s, &idle, &waiting, &quar));
  CHECK_EQ_SIZE(idle, 2);
  CHECK_EQ_SIZE(waiting, 2);
  CHECK_EQ_SIZE(quar, 0);
  uint64_t got[2];
  CHECK_OK(pm_blocks_alloc(s, 2, got));
  CHECK((got[0] == h[2] && got[1] == h[3]) || (got[0] == h[3] && got[1] == h[2]));
  pthread_t o;
  REQUIRE(pthread_create(&o, NULL, open_now, &g) == 0);
  uint64_t got2[2];
  CHECK_OK(pm_blocks_alloc(s, 2, got2)); /* waits for the swap, whenever the gate opens */
  CHECK((got2[0] == h[0] && got2[1] == h[1]) || (got2[0] == h[1] && got2[1] == h[0]));
  pthread_join(o, NULL);
  pthread_join(t, NULL);
  CHECK_OK(q.st);
  pm__fault_reset();
  CHECK(hosts_hold(s, &k, h, d, 2)); /* the swap had completed before its blocks came back */
  CHECK_OK(pm_blocks_free(s, got, 2));
  CHECK_OK(pm_blocks_free(s, got2, 2));
  CHECK_OK(pm_blocks_get_free(s, &idle, &waiting, &quar));
  CHECK_EQ_SIZE(idle, 4);
  CHECK_OK(pm_blocks_destroy(s));
  CHECK_OK(pm_stream_destroy(a));
  pm_test_gate_destroy(&g);
  kv_free(&k);
}

/* An alloc that must wait for a swap but cannot make the store's device current (a device
 * error) fails with that error, naming the wait, not with an "exhausted" arena whose blocks
 * it counts as free; once the device answers again the same alloc waits and succeeds. */
static void test_wait_no_device(void) {
  kv_t k;
  kv_make(&k, LAY_ONE_TENSOR, 1, 8, 512, 47);
  pm_stream_t a, b;
  uint64_t h[4];
  pm_test_gate_t g;
  pm_blocks_t *s = store_held_swap_in(&k, &a, &b, h, &g);
  CHECK_OK(pm_blocks_free(s, h, 4)); /* h[0], h[1] wait for the held swap_in */
  REQUIRE_OK(pm__fault_configure("device_query=1+"));
  uint64_t got[4];
  pm_status_t st = pm_blocks_alloc(s, 4, got);
  CHECK_EQ_INT(st, PM_ERR_BACKEND);
  CHECK(strstr(pm_last_error(), "making the store's device") != NULL);
  CHECK(strstr(pm_last_error(), "exhausted") == NULL);
  pm__fault_reset();
  uint64_t idle = 9, waiting = 9, quar = 9;
  CHECK_OK(pm_blocks_get_free(s, &idle, &waiting, &quar)); /* nothing taken, nothing lost */
  CHECK_EQ_SIZE(idle, 2);
  CHECK_EQ_SIZE(waiting, 2);
  CHECK_EQ_SIZE(quar, 0);
  REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_SYNC, 0, 0)); /* count, for the opener */
  pm_test_opener_t o;
  pm_test_opener_start(&o, &g, (const int[]){PM__FAULT_EVENT_SYNC}, 1);
  CHECK_OK(pm_blocks_alloc(s, 4, got));
  CHECK(pm_test_opener_stop(&o));
  pm__fault_reset();
  CHECK_OK(pm_stream_synchronize(a));
  CHECK_OK(pm_blocks_destroy(s));
  CHECK_OK(pm_stream_destroy(a));
  CHECK_OK(pm_stream_destroy(b));
  pm_test_gate_destroy(&g);
  kv_free(&k);
}

int main(void) {
  pm_test_init();
  test_layouts();
  test_bad_input();
  test_budget();
  test_two_streams();
  test_background_race();
  test_pinning_fails();
  test_free_during_swap();
  test_free_after_wait();
  test_free_other_stream();
  test_free_swap_untracked();
  test_swap_untrackable();
  test_stream_destroyed();
  test_free_while_queueing();
  test_wait_no_device();
  test_joined_pieces();
  test_numa_node();
  CHECK_OK(pm_finalize());
  return pm_test_finish("test_blocks");
}
