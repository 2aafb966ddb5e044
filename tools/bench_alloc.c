/*
 * `pinmem bench alloc`: what it costs to get pinned memory, pinmem against the plain backend
 * calls, side by side in one run.
 *
 * 1. Cold pinning of each size: (a) pinmem, a fresh pool per run so nothing is cached, timing
 *    pm_host_alloc; (b) the backend's own allocation (cudaHostAlloc); (c) malloc + the backend's
 *    registration (cudaHostRegister). The runs of the three cases are interleaved, with the order
 *    rotated, so drift of the machine hits all of them alike; the median is reported. The matching
 *    releases are timed too (for pinmem: pm_host_free + pm_pool_destroy, which gives the memory
 *    back to the system).
 * 2. Cached pairs: pm_host_alloc + pm_host_free of a block the pool already holds, the median
 *    of many batches, per pair; beside it the backend's alloc+free pair of the same size.
 * 3. Memory overhead: a fixed pseudo-random set of sizes between 1 MiB and 64 MiB allocated from
 *    a fresh pool; pinned bytes held / bytes requested. Then half are freed and as many bytes
 *    requested again in other sizes, and the ratio is measured once more (cache included).
 *
 * Every measured block is checked: a pattern written over its whole length and read back, and
 * a 1 MiB piece copied to device memory and back with pm_memcpy must match. A block that fails
 * is reported with "verified": false and the command exits 1.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "internal.h"

#define MIB ((size_t)1 << 20)
#define GIB ((size_t)1 << 30)

/* pinmem's targets. */
#define TARGET_COLD_SECONDS 0.060
#define TARGET_COLD_RATIO (1.0 / 6.0)
#define TARGET_PAIR_SECONDS 1e-6
#define TARGET_OVERHEAD 1.125

#define PAIRS_PER_BATCH 1000
#define PAIR_BATCHES 21
#define BASELINE_PAIR_RUNS 11

/* What the TARGET lines need, gathered from the rows as they are printed (so a results file
 * read back with --summarize gives the same lines). */
typedef struct summary {
  bool cuda;
  double gib_pin, gib_ratio; /* cold pin of exactly 1 GiB; NaN if not measured */
  double worst_pair;         /* slowest cached pair median */
  size_t worst_pair_bytes;
  double overhead; /* pinmem_overhead; NaN if absent */
  bool all_verified;
} summary_t;

typedef struct bench {
  const cli_bench_alloc_args_t *args;
  summary_t sum;
  unsigned long long steps, steps_done; /* progress: measured runs in all */
  const pm__backend_t *b;
  bool cuda;
  int pin_threads; /* resolved */
  void *dev;       /* 1 MiB of device memory for the round trip check */
  unsigned char *scratch;
  /* Names of the baseline cases: the CUDA call on the cuda backend, the contract's name on host. */
  const char *n_alloc, *n_free, *n_reg, *n_unreg, *n_pair;
} bench_t;

typedef struct row {
  const char *name;
  const char *op; /* alloc, free, pair, overhead */
  size_t bytes;
  double seconds, min_s, max_s;
  int runs;
  double gbps;  /* NaN: not meaningful */
  double ratio; /* vs the backend baseline; NaN: none */
  const char *baseline;
  bool verified;
  /* optional extras; NaN / 0 when absent */
  double backend_alloc_seconds;
  double overhead;
  size_t pinned_bytes, requested_bytes;
  int allocations;
  unsigned long long cache_hits, backend_allocs;
  const char *target;
  int target_met; /* 1, 0, or -1: the target does not apply to this backend */
} row_t;

static void row_init(row_t *r, const char *name, const char *op, size_t bytes) {
  memset(r, 0, sizeof *r);
  r->name = name;
  r->op = op;
  r->bytes = bytes;
  r->seconds = r->min_s = r->max_s = r->gbps = r->ratio = NAN;
  r->backend_alloc_seconds = r->overhead = NAN;
  r->target_met = -1;
}

static void summarize(row_t *r, double *v, int n) {
  r->runs = n;
  r->seconds = cli_median(v, n); /* sorts v */
  r->min_s = v[0];
  r->max_s = v[n - 1];
}

/* ---- verification ------------------------------------------------------------------------ */

static uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return x;
}

static void fill_pattern(void *p, size_t n, uint64_t seed) {
  uint64_t *w = p;
  size_t words = n / 8;
  for (size_t i = 0; i < words; i++) w[i] = mix(seed + i) | 1; /* never a zero word */
  unsigned char *t = (unsigned char *)p + words * 8;
  for (size_t i = 0; i < n % 8; i++) t[i] = (unsigned char)(0xa5 ^ (seed + i));
}

static bool check_pattern(const void *p, size_t n, uint64_t seed) {
  const uint64_t *w = p;
  size_t words = n / 8;
  for (size_t i = 0; i < words; i++)
    if (w[i] != (mix(seed + i) | 1)) return false;
  const unsigned char *t = (const unsigned char *)p + words * 8;
  for (size_t i = 0; i < n % 8; i++)
    if (t[i] != (unsigned char)(0xa5 ^ (seed + i))) return false;
  return true;
}

/* Write and read back the whole block, then send 1 MiB of it (from the middle) to the device
 * and back. A failing copy call is a failure of the command, not of the data. */
static bool verify_block(bench_t *bn, void *p, size_t n, uint64_t seed) {
  fill_pattern(p, n, seed);
  if (!check_pattern(p, n, seed)) return false;
  size_t piece = n < MIB ? n : MIB;
  size_t off = ((n - piece) / 2) & ~(size_t)4095;
  unsigned char *src = (unsigned char *)p + off;
  memset(bn->scratch, 0x3c, piece);
  cli_check(pm_memcpy(bn->dev, src, piece, PM_COPY_H2D));
  cli_check(pm_memcpy(bn->scratch, bn->dev, piece, PM_COPY_D2H));
  return memcmp(bn->scratch, src, piece) == 0;
}

/* ---- output ------------------------------------------------------------------------------ */

static const char *fmt_seconds(double s, char *buf, size_t len) {
  if (!isfinite(s))
    snprintf(buf, len, "-");
  else if (s >= 1.0)
    snprintf(buf, len, "%.3f s", s);
  else if (s >= 1e-3)
    snprintf(buf, len, "%.2f ms", s * 1e3);
  else if (s >= 1e-5)
    snprintf(buf, len, "%.1f us", s * 1e6);
  else
    snprintf(buf, len, "%.3f us", s * 1e6);
  return buf;
}

static void print_header(void) {
  printf("%-10s  %-26s  %10s  %21s  %8s  %9s  %s\n", "SIZE", "CASE", "MEDIAN", "MIN..MAX", "GB/s",
         "RATIO", "VERIFIED");
}

static void print_row(const row_t *r) {
  cli_progress_clear();
  char sz[32], med[32], lo[32], hi[32], range[64], gbps[32], ratio[32];
  cli_fmt_bytes(r->bytes, sz, sizeof sz);
  fmt_seconds(r->seconds, med, sizeof med);
  if (r->runs > 1)
    snprintf(range, sizeof range, "%s..%s", fmt_seconds(r->min_s, lo, sizeof lo),
             fmt_seconds(r->max_s, hi, sizeof hi));
  else
    snprintf(range, sizeof range, "-");
  if (isfinite(r->gbps))
    snprintf(gbps, sizeof gbps, "%.2f", r->gbps);
  else
    snprintf(gbps, sizeof gbps, "-");
  if (isfinite(r->overhead))
    snprintf(ratio, sizeof ratio, "%.4f", r->overhead);
  else if (isfinite(r->ratio) && r->ratio >= 0.01)
    snprintf(ratio, sizeof ratio, "%.3f", r->ratio);
  else if (isfinite(r->ratio))
    snprintf(ratio, sizeof ratio, "%.2e", r->ratio);
  else
    snprintf(ratio, sizeof ratio, "-");
  printf("%-10s  %-26s  %10s  %21s  %8s  %9s  %s\n", sz, r->name, med, range, gbps, ratio,
         r->verified ? "yes" : "NO");
  fflush(stdout);
}

static void summary_init(summary_t *s, bool cuda) {
  memset(s, 0, sizeof *s);
  s->cuda = cuda;
  s->gib_pin = s->gib_ratio = s->overhead = NAN;
  s->all_verified = true;
}

static void summary_add(summary_t *s, const row_t *r) {
  if (!r->verified) s->all_verified = false;
  if (strcmp(r->name, "pinmem_cold_pin") == 0 && r->bytes == GIB) {
    s->gib_pin = r->seconds;
    s->gib_ratio = r->ratio;
  } else if (strcmp(r->name, "pinmem_cached_pair") == 0 && r->seconds > s->worst_pair) {
    s->worst_pair = r->seconds;
    s->worst_pair_bytes = r->bytes;
  } else if (strcmp(r->name, "pinmem_overhead") == 0) {
    s->overhead = r->overhead;
  }
}

static void target_line(const char *what, const char *figure, bool met, bool applies) {
  cli_target(stdout, what, true, applies, met, figure);
}

static void print_targets(const summary_t *s) {
  char fig[200], what[120], b1[32], b2[32];
  /* The baseline the ratio was taken against: cudaHostAlloc on cuda, the host backend's own
   * allocation there. */
  const char *base_name = s->cuda ? "cudaHostAlloc" : "host_alloc";
  cli_progress_clear();
  printf("\n");
  if (isfinite(s->gib_pin)) {
    double base = s->gib_pin / s->gib_ratio;
    snprintf(fig, sizeof fig, "%s", fmt_seconds(s->gib_pin, b1, sizeof b1));
    target_line("cold pin 1 GiB <= 60 ms", fig, s->gib_pin <= TARGET_COLD_SECONDS, s->cuda);
    snprintf(fig, sizeof fig, "%.3f (%s vs %s for %s)", s->gib_ratio, b1,
             fmt_seconds(base, b2, sizeof b2), base_name);
    snprintf(what, sizeof what, "cold pin 1 GiB <= 1/6 of %s", base_name);
    target_line(what, fig, isfinite(s->gib_ratio) && s->gib_ratio <= TARGET_COLD_RATIO, s->cuda);
  } else {
    printf("TARGET cold pin 1 GiB <= 60 ms and <= 1/6 of %s: not measured (add 1G to --sizes)\n",
           base_name);
  }
  if (s->worst_pair_bytes) {
    snprintf(fig, sizeof fig, "worst %s (at %s)", fmt_seconds(s->worst_pair, b1, sizeof b1),
             cli_fmt_bytes(s->worst_pair_bytes, b2, sizeof b2));
    target_line("cached alloc+free pair median <= 1 us", fig, s->worst_pair <= TARGET_PAIR_SECONDS,
                s->cuda);
  } else {
    printf("TARGET cached alloc+free pair median <= 1 us: not measured\n");
  }
  if (isfinite(s->overhead)) {
    snprintf(fig, sizeof fig, "%.4f", s->overhead);
    target_line("pool overhead (pinned / requested, 1-64 MiB requests) <= 1.125", fig,
                s->overhead <= TARGET_OVERHEAD, true);
  } else {
    printf("TARGET pool overhead <= 1.125: not measured\n");
  }
}

static void emit(bench_t *bn, const row_t *r) {
  summary_add(&bn->sum, r);
  if (!bn->args->json) {
    print_row(r);
    return;
  }
  cli_json_t j;
  cli_json_row(&j, "alloc", r->name, r->bytes, r->seconds, r->gbps);
  cli_json_bool(&j, "verified", r->verified);
  /* Every block is checked over its whole length (pattern written and read back) plus a 1 MiB
   * round trip through device memory. */
  cli_json_str(&j, "verify_method", "full");
  cli_json_str(&j, "backend", pm_backend_name());
  cli_json_double(&j, "ratio_vs_cudaHostAlloc", r->ratio);
  cli_json_str(&j, "baseline", r->baseline);
  cli_json_str(&j, "op", r->op);
  cli_json_int(&j, "runs", r->runs);
  cli_json_double(&j, "min_seconds", r->min_s);
  cli_json_double(&j, "max_seconds", r->max_s);
  cli_json_int(&j, "pin_threads", bn->pin_threads);
  if (isfinite(r->backend_alloc_seconds))
    cli_json_double(&j, "backend_alloc_seconds", r->backend_alloc_seconds);
  if (strcmp(r->op, "pair") == 0 && strncmp(r->name, "pinmem", 6) == 0) {
    cli_json_int(&j, "pairs_per_batch", PAIRS_PER_BATCH);
    cli_json_int(&j, "batches", PAIR_BATCHES);
    cli_json_uint(&j, "cache_hits", r->cache_hits);
    cli_json_uint(&j, "backend_allocs", r->backend_allocs);
  }
  if (isfinite(r->overhead)) {
    cli_json_double(&j, "overhead", r->overhead);
    cli_json_uint(&j, "pinned_bytes", r->pinned_bytes);
    cli_json_uint(&j, "requested_bytes", r->requested_bytes);
    cli_json_int(&j, "allocations", r->allocations);
  }
  if (r->target) {
    cli_json_str(&j, "target", r->target);
    if (r->target_met < 0)
      cli_json_null(&j, "target_met");
    else
      cli_json_bool(&j, "target_met", r->target_met == 1);
    cli_json_bool(&j, "target_applies", r->target_met >= 0);
  }
  cli_json_end(&j);
}

/* ---- the cases --------------------------------------------------------------------------- */

static pm_pool_t *fresh_pool(bench_t *bn) {
  pm_pool_config_t c;
  pm_pool_t *pool;
  pm_pool_config_init(&c);
  if (bn->args->threads > 0) c.pin_threads = bn->args->threads;
  cli_check(pm_pool_create(&c, &pool));
  return pool;
}

static void run_pinmem(bench_t *bn, size_t bytes, uint64_t seed, double *t_alloc, double *t_free,
                       double *t_backend, bool *ok) {
  pm_pool_t *pool = fresh_pool(bn);
  pm_pool_stats_t st;
  void *p;
  double t0 = pm__now();
  cli_check(pm_host_alloc(pool, bytes, PM_HOST_DEFAULT, &p));
  double t1 = pm__now();
  cli_check(pm_pool_get_stats(pool, &st));
  *t_backend = st.backend_alloc_seconds;
  *ok = verify_block(bn, p, bytes, seed) && *ok;
  double t2 = pm__now();
  cli_check(pm_host_free(p));
  cli_check(pm_pool_destroy(pool));
  double t3 = pm__now();
  *t_alloc = t1 - t0;
  *t_free = t3 - t2;
}

static void run_backend(bench_t *bn, size_t bytes, uint64_t seed, double *t_alloc, double *t_free,
                        bool *ok) {
  void *p;
  double t0 = pm__now();
  cli_check(bn->b->host_alloc(bytes, PM_HOST_DEFAULT, &p));
  double t1 = pm__now();
  *ok = verify_block(bn, p, bytes, seed) && *ok;
  double t2 = pm__now();
  cli_check(bn->b->host_free(p, bytes));
  double t3 = pm__now();
  *t_alloc = t1 - t0;
  *t_free = t3 - t2;
}

static void run_register(bench_t *bn, size_t bytes, uint64_t seed, double *t_alloc, double *t_free,
                         bool *ok) {
  void *p = NULL;
  double t0 = pm__now();
  /* Page aligned, as large mallocs are in practice (glibc mmaps them). */
  if (posix_memalign(&p, pm__page_size(), bytes) != 0 || !p)
    cli_check(pm__set_error(PM_ERR_NOMEM, "posix_memalign(%zu bytes) failed", bytes));
  pm_status_t st = bn->b->host_register(p, bytes, PM_REGISTER_DEFAULT);
  if (st != PM_OK) {
    free(p);
    cli_fail(st);
  }
  double t1 = pm__now();
  *ok = verify_block(bn, p, bytes, seed) && *ok;
  double t2 = pm__now();
  st = bn->b->host_unregister(p, bytes);
  free(p);
  cli_check(st);
  double t3 = pm__now();
  *t_alloc = t1 - t0;
  *t_free = t3 - t2;
}

static bool backend_target_applies(const bench_t *bn) {
  return bn->cuda;
}

/* Cold pinning of one size: three cases interleaved, `runs` times. */
static void bench_cold(bench_t *bn, size_t bytes) {
  int runs = bn->args->repeat > 0 ? bn->args->repeat : (bytes >= GIB ? 3 : 5);
  double *v = cli_xmalloc(sizeof(double) * (size_t)runs * 7);
  double *pa = v, *pf = v + runs, *ba = v + 2 * runs, *bf = v + 3 * runs, *ra = v + 4 * runs,
         *rf = v + 5 * runs, *pb = v + 6 * runs;
  bool ok_p = true, ok_b = true, ok_r = true;
  char sz[32];
  cli_fmt_bytes(bytes, sz, sizeof sz);
  for (int r = 0; r < runs; r++) {
    uint64_t seed = (uint64_t)bytes * 31 + (uint64_t)r;
    for (int k = 0; k < 3; k++) {
      static const char *const what[] = {"pinmem_cold_pin", "backend alloc", "malloc+register"};
      cli_progress(bn->steps_done++, bn->steps, "cold pin %s: %s, run %d/%d", sz, what[(r + k) % 3],
                   r + 1, runs);
      switch ((r + k) % 3) {
        case 0:
          run_pinmem(bn, bytes, seed, &pa[r], &pf[r], &pb[r], &ok_p);
          break;
        case 1:
          run_backend(bn, bytes, seed + 1, &ba[r], &bf[r], &ok_b);
          break;
        default:
          run_register(bn, bytes, seed + 2, &ra[r], &rf[r], &ok_r);
          break;
      }
    }
  }

  row_t base_a, base_f, pin_a, pin_f, reg_a, reg_f;
  row_init(&base_a, bn->n_alloc, "alloc", bytes);
  row_init(&base_f, bn->n_free, "free", bytes);
  row_init(&pin_a, "pinmem_cold_pin", "alloc", bytes);
  row_init(&pin_f, "pinmem_free+destroy", "free", bytes);
  row_init(&reg_a, bn->n_reg, "alloc", bytes);
  row_init(&reg_f, bn->n_unreg, "free", bytes);
  summarize(&base_a, ba, runs);
  summarize(&base_f, bf, runs);
  summarize(&pin_a, pa, runs);
  summarize(&pin_f, pf, runs);
  summarize(&reg_a, ra, runs);
  summarize(&reg_f, rf, runs);
  pin_a.backend_alloc_seconds = cli_median(pb, runs);
  base_a.verified = base_f.verified = ok_b;
  pin_a.verified = pin_f.verified = ok_p;
  reg_a.verified = reg_f.verified = ok_r;
  row_t *rows[] = {&pin_a, &base_a, &reg_a, &pin_f, &base_f, &reg_f};
  for (size_t i = 0; i < 6; i++) {
    row_t *r = rows[i];
    bool is_alloc = strcmp(r->op, "alloc") == 0;
    const row_t *base = is_alloc ? &base_a : &base_f;
    r->gbps = (double)bytes / r->seconds / 1e9;
    r->ratio = r->seconds / base->seconds;
    r->baseline = base->name;
  }
  if (bytes == GIB) {
    pin_a.target = bn->cuda ? "cold pin of 1 GiB <= 0.060 s and <= 1/6 of cudaHostAlloc"
                            : "cold pin of 1 GiB <= 0.060 s and <= 1/6 of host_alloc";
    if (backend_target_applies(bn))
      pin_a.target_met = pin_a.seconds <= TARGET_COLD_SECONDS && pin_a.ratio <= TARGET_COLD_RATIO;
  }
  for (size_t i = 0; i < 6; i++) emit(bn, rows[i]);
  free(v);
}

/* Cached alloc+free pairs of one size from a pool that already holds the block. */
static void bench_pair(bench_t *bn, size_t bytes) {
  double base[BASELINE_PAIR_RUNS], batches[PAIR_BATCHES];
  char sz[32];
  cli_progress(bn->steps_done++, bn->steps, "cached alloc+free pairs %s",
               cli_fmt_bytes(bytes, sz, sizeof sz));
  for (int i = 0; i < BASELINE_PAIR_RUNS; i++) {
    void *p;
    double t0 = pm__now();
    cli_check(bn->b->host_alloc(bytes, PM_HOST_DEFAULT, &p));
    cli_check(bn->b->host_free(p, bytes));
    base[i] = pm__now() - t0;
  }
  row_t br;
  row_init(&br, bn->n_pair, "pair", bytes);
  summarize(&br, base, BASELINE_PAIR_RUNS);
  br.ratio = 1.0;
  br.baseline = bn->n_pair;
  {
    /* The baseline's memory is checked like every other measured block. */
    void *p;
    cli_check(bn->b->host_alloc(bytes, PM_HOST_DEFAULT, &p));
    br.verified = verify_block(bn, p, bytes, bytes ^ 0x77);
    cli_check(bn->b->host_free(p, bytes));
  }

  pm_pool_t *pool = fresh_pool(bn);
  pm_pool_stats_t before, after;
  void *p;
  cli_check(pm_host_alloc(pool, bytes, PM_HOST_DEFAULT, &p)); /* the cold pin, not measured */
  cli_check(pm_host_free(p));
  cli_check(pm_pool_get_stats(pool, &before));
  for (int b = 0; b < PAIR_BATCHES; b++) {
    double t0 = pm__now();
    for (int i = 0; i < PAIRS_PER_BATCH; i++) {
      cli_check(pm_host_alloc(pool, bytes, PM_HOST_DEFAULT, &p));
      cli_check(pm_host_free(p));
    }
    batches[b] = (pm__now() - t0) / PAIRS_PER_BATCH;
  }
  cli_check(pm_pool_get_stats(pool, &after));
  cli_check(pm_host_alloc(pool, bytes, PM_HOST_DEFAULT, &p));
  bool ok = verify_block(bn, p, bytes, bytes ^ 0x99);
  cli_check(pm_host_free(p));
  cli_check(pm_pool_destroy(pool));

  row_t pr;
  row_init(&pr, "pinmem_cached_pair", "pair", bytes);
  summarize(&pr, batches, PAIR_BATCHES);
  pr.verified = ok;
  pr.ratio = pr.seconds / br.seconds;
  pr.baseline = br.name;
  pr.cache_hits = (unsigned long long)(after.cache_hits - before.cache_hits);
  pr.backend_allocs = (unsigned long long)(after.backend_allocs - before.backend_allocs);
  pr.target = "cached alloc+free pair median <= 1 us";
  if (backend_target_applies(bn)) pr.target_met = pr.seconds <= TARGET_PAIR_SECONDS;
  emit(bn, &pr);
  emit(bn, &br);
}

static uint64_t xorshift(uint64_t *s) {
  uint64_t x = *s;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return *s = x;
}

static size_t random_size(uint64_t *s) {
  return MIB + (size_t)(xorshift(s) % (63 * MIB + 1));
}

/* Pinned bytes held / bytes requested for sizes of 1 MiB to 64 MiB. */
static void bench_overhead(bench_t *bn) {
  cli_progress(bn->steps_done++, bn->steps, "pool overhead (1-64 MiB requests)");
  pm_pool_t *pool = fresh_pool(bn);
  pm_pool_stats_t st;
  cli_check(pm_pool_get_stats(pool, &st));
  size_t total = bn->args->overhead_total;
  /* Stay well inside the budget: the pool must never have to fail or trim here. */
  if (st.budget && total > st.budget / 4 * 3) total = st.budget / 4 * 3;
  enum { MAX_BLOCKS = 4096 };
  void **blocks = cli_xmalloc(sizeof(void *) * MAX_BLOCKS);
  size_t *sizes = cli_xmalloc(sizeof(size_t) * MAX_BLOCKS);
  uint64_t rng = 0x5eed5eed12345678ULL;
  size_t requested = 0;
  int n = 0;
  bool ok = true;
  double t0 = pm__now();
  while (n < MAX_BLOCKS) {
    size_t sz = random_size(&rng);
    if (requested + sz > total && n >= 1) break;
    cli_check(pm_host_alloc(pool, sz, PM_HOST_DEFAULT, &blocks[n]));
    sizes[n++] = sz;
    requested += sz;
  }
  double t_alloc = pm__now() - t0;
  cli_check(pm_pool_get_stats(pool, &st));
  for (int i = 0; i < n; i++) {
    fill_pattern(blocks[i], sizes[i], (uint64_t)i * 7919);
  }
  for (int i = 0; i < n; i++) ok = check_pattern(blocks[i], sizes[i], (uint64_t)i * 7919) && ok;
  ok = verify_block(bn, blocks[0], sizes[0], 4242) && ok;

  row_t r;
  row_init(&r, "pinmem_overhead", "overhead", st.requested_bytes);
  r.seconds = t_alloc;
  r.runs = 1;
  r.verified = ok;
  r.pinned_bytes = st.pinned_bytes;
  r.requested_bytes = st.requested_bytes;
  r.overhead = st.requested_bytes ? (double)st.pinned_bytes / (double)st.requested_bytes : NAN;
  r.allocations = n;
  r.target = "pinned bytes / requested bytes <= 1.125 (requests of 1 MiB to 64 MiB)";
  r.target_met = isfinite(r.overhead) && r.overhead <= TARGET_OVERHEAD;
  emit(bn, &r);

  /* Churn: free every other block, then ask for the same number of bytes in new sizes. */
  size_t freed = 0;
  for (int i = 0; i < n; i += 2) {
    freed += sizes[i];
    cli_check(pm_host_free(blocks[i]));
    blocks[i] = NULL;
  }
  size_t again = 0;
  int extra_from = n;
  t0 = pm__now();
  while (again < freed && n < MAX_BLOCKS) {
    size_t sz = random_size(&rng);
    if (again + sz > freed) sz = freed - again < MIB ? MIB : freed - again;
    cli_check(pm_host_alloc(pool, sz, PM_HOST_DEFAULT, &blocks[n]));
    sizes[n++] = sz;
    again += sz;
  }
  t_alloc = pm__now() - t0;
  cli_check(pm_pool_get_stats(pool, &st));
  ok = true;
  for (int i = extra_from; i < n; i++) {
    fill_pattern(blocks[i], sizes[i], (uint64_t)i * 104729);
    ok = check_pattern(blocks[i], sizes[i], (uint64_t)i * 104729) && ok;
  }
  for (int i = 1; i < extra_from; i += 2) /* the survivors kept their bytes */
    ok = check_pattern(blocks[i], sizes[i], (uint64_t)i * 7919) && ok;
  if (n > extra_from) ok = verify_block(bn, blocks[extra_from], sizes[extra_from], 4343) && ok;

  row_t c;
  row_init(&c, "pinmem_overhead_churn", "overhead", st.requested_bytes);
  c.seconds = t_alloc;
  c.runs = 1;
  c.verified = ok;
  c.pinned_bytes = st.pinned_bytes;
  c.requested_bytes = st.requested_bytes;
  c.overhead = st.requested_bytes ? (double)st.pinned_bytes / (double)st.requested_bytes : NAN;
  c.allocations = n - extra_from;
  emit(bn, &c);

  for (int i = 0; i < n; i++)
    if (blocks[i]) cli_check(pm_host_free(blocks[i]));
  cli_check(pm_pool_destroy(pool));
  free(blocks);
  free(sizes);
}

/* ---- the command ------------------------------------------------------------------------- */

/* A row of bench alloc read back must have what the table needs, with the types --json writes;
 * NULL when it does, else what is wrong. */
static const char *row_problem(const cli_jfield_t *fields, int n) {
  static const struct {
    const char *key;
    const char *types; /* allowed cli_jfield_t types */
  } need[] = {{"case", "s"}, {"bytes", "n"}, {"seconds", "nz"}, {"verified", "b"}};
  static char why[160];
  for (size_t i = 0; i < sizeof need / sizeof need[0]; i++) {
    const cli_jfield_t *v = cli_json_get(fields, n, need[i].key);
    if (!v) {
      snprintf(why, sizeof why, "a bench alloc row without \"%s\"", need[i].key);
      return why;
    }
    if (!strchr(need[i].types, v->type)) {
      snprintf(why, sizeof why, "\"%s\" has the wrong type", need[i].key);
      return why;
    }
  }
  const cli_jfield_t *b = cli_json_get(fields, n, "bytes");
  if (!(b->num >= 0) || b->num != floor(b->num)) return "\"bytes\" is not a whole number";
  return NULL;
}

/* Print the table and TARGET lines of a results file written with --json. Lines of other
 * benchmarks are passed over; a line that is not a JSON object, or a bench alloc row that lacks
 * what the table needs, stops it with the line's number (exit 1): a summary of a damaged file
 * would print rows that were never measured. */
static int summarize_file(const char *path) {
  FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "r");
  if (!f) {
    fprintf(stderr, "pinmem: cannot open %s: %s\n", path, strerror(errno));
    return CLI_EXIT_FAILURE;
  }
  summary_t sum;
  summary_init(&sum, false);
  char *line = NULL;
  size_t cap = 0;
  long lineno = 0, rows = 0;
  enum { MAXF = 48 };
  cli_jfield_t *fields = cli_xmalloc(sizeof *fields * MAXF);
  while (getline(&line, &cap, f) > 0) {
    lineno++;
    if (line[strspn(line, " \t\r\n")] == '\0') continue; /* a blank line */
    int n = cli_json_parse_flat(line, fields, MAXF);
    const char *bad =
        n < 0 ? "not a flat JSON object (one result per line, as --json writes)" : NULL;
    const cli_jfield_t *bench = n < 0 ? NULL : cli_json_get(fields, n, "bench");
    if (!bad && (!bench || bench->type != 's' || strcmp(bench->str, "alloc") != 0)) continue;
    if (!bad) bad = row_problem(fields, n);
    if (bad) {
      fflush(stdout);
      fprintf(stderr, "pinmem: %s:%ld: %s\n", path, lineno, bad);
      free(line);
      free(fields);
      if (f != stdin) fclose(f);
      return CLI_EXIT_FAILURE;
    }
    const cli_jfield_t *v;
    row_t r;
    char name[512] = "?", op[64] = "";
    if ((v = cli_json_get(fields, n, "case")) && v->type == 's')
      snprintf(name, sizeof name, "%s", v->str);
    if ((v = cli_json_get(fields, n, "op")) && v->type == 's')
      snprintf(op, sizeof op, "%.63s", v->str);
    row_init(&r, name, op, 0);
#define NUM(key, dst) \
  if ((v = cli_json_get(fields, n, key)) && v->type == 'n') (dst) = v->num
    double bytes = 0, runs = 0;
    NUM("bytes", bytes);
    NUM("seconds", r.seconds);
    NUM("min_seconds", r.min_s);
    NUM("max_seconds", r.max_s);
    NUM("runs", runs);
    NUM("gbps", r.gbps);
    NUM("ratio_vs_cudaHostAlloc", r.ratio);
    NUM("overhead", r.overhead);
#undef NUM
    r.bytes = bytes > 0 ? (size_t)bytes : 0;
    r.runs = (int)runs;
    r.verified = (v = cli_json_get(fields, n, "verified")) && v->type == 'b' && v->b;
    if (rows++ == 0) {
      v = cli_json_get(fields, n, "backend");
      const char *backend = v && v->type == 's' ? v->str : "unknown";
      sum.cuda = strcmp(backend, "cuda") == 0;
      printf("pinmem bench alloc, from %s: backend %s\n\n", path, backend);
      print_header();
    }
    summary_add(&sum, &r);
    print_row(&r);
  }
  free(line);
  free(fields);
  if (f != stdin) fclose(f);
  if (rows == 0) {
    fprintf(stderr, "pinmem: %s has no bench alloc rows\n", path);
    return CLI_EXIT_FAILURE;
  }
  print_targets(&sum);
  return 0;
}

int cli_bench_alloc_help(void) {
  pm_status_t st = pm_init();
  bool cuda = st == PM_OK && pm_backend_kind() == PM_BACKEND_CUDA;
  const char *a = cuda ? "cudaHostAlloc" : "host_alloc";
  printf(
      "usage: pinmem bench alloc [--json] [--quiet] [--sizes LIST] [--repeat N] [--threads N]\n"
      "                          [--overhead-total SIZE]\n"
      "       pinmem bench alloc --summarize FILE\n"
      "\n"
      "cases (backend %s%s):\n"
      "  pinmem_cold_pin            pm_host_alloc from a fresh pool (nothing cached)\n"
      "  %-26s the backend's own pinned allocation (the RATIO baseline)\n"
      "  %-26s malloc, then the backend's registration\n"
      "  pinmem_free+destroy, %s, %s\n"
      "                             the matching releases\n"
      "  pinmem_cached_pair         pm_host_alloc + pm_host_free of a cached block, at 4K, 64K,\n"
      "                             1M and 16M, beside %s\n"
      "  pinmem_overhead, pinmem_overhead_churn\n"
      "                             pinned bytes / requested bytes for 1-64 MiB requests\n"
      "\n"
      "options (default on this backend):\n"
      "  --sizes LIST           cold pin sizes, K/M/G suffixes (16M,256M,1G); --bytes and\n"
      "                         --size are other names for it\n"
      "  --repeat N             runs per size, median reported (5; 3 for sizes >= 1 GiB)\n"
      "  --threads N            first-touch threads of the pools measured (0: option\n"
      "                         pin_threads, now %ld)\n"
      "  --overhead-total SIZE  bytes requested in the overhead rows (1G)\n"
      "  --summarize FILE       the table and TARGET lines of a --json results file ('-':\n"
      "                         standard input); a malformed line is an error\n"
      "  --json                 one JSON object per line: bench, case, bytes, seconds, gbps,\n"
      "                         verified (bool), verify_method (\"full\"), ratio_vs_cudaHostAlloc\n"
      "                         (against the row's baseline), baseline, op, runs, ...\n"
      "  --quiet                no progress on stderr (else one line rewritten on a terminal, a line\n"
      "                         per case on a pipe or a log)\n",
      st == PM_OK ? pm_backend_name() : "none",
      st == PM_OK ? "" : ": it did not start, names shown for host", a,
      cuda ? "malloc+cudaHostRegister" : "malloc+host_register",
      cuda ? "cudaFreeHost" : "host_free",
      cuda ? "cudaHostUnregister+free" : "host_unregister+free",
      cuda ? "cudaHostAlloc+cudaFreeHost" : "host_alloc+host_free",
      pm__opt_int(PM__OPT_PIN_THREADS));
  return 0;
}

int cli_cmd_bench_alloc(const cli_bench_alloc_args_t *args) {
  if (args->summarize) return summarize_file(args->summarize);

  bench_t bn;
  memset(&bn, 0, sizeof bn);
  bn.args = args;
  cli_check(pm_init());
  bn.b = pm__backend();
  if (!bn.b) cli_fail(PM_ERR_NO_DEVICE);
  bn.cuda = bn.b->kind == PM_BACKEND_CUDA;
  summary_init(&bn.sum, bn.cuda);
  bn.n_alloc = bn.cuda ? "cudaHostAlloc" : "host_alloc";
  bn.n_free = bn.cuda ? "cudaFreeHost" : "host_free";
  bn.n_reg = bn.cuda ? "malloc+cudaHostRegister" : "malloc+host_register";
  bn.n_unreg = bn.cuda ? "cudaHostUnregister+free" : "host_unregister+free";
  bn.n_pair = bn.cuda ? "cudaHostAlloc+cudaFreeHost" : "host_alloc+host_free";
  bn.pin_threads = args->threads > 0 ? args->threads : (int)pm__opt_int(PM__OPT_PIN_THREADS);

  cli_check(pm_device_alloc(MIB, &bn.dev));
  bn.scratch = cli_xmalloc(MIB);
  cli_progress_init(args->quiet);
  for (int i = 0; i < args->nsizes; i++) {
    size_t sz = args->sizes[i];
    bn.steps += 3 * (unsigned long long)(args->repeat > 0 ? args->repeat : (sz >= GIB ? 3 : 5));
  }
  bn.steps += 4 + 1; /* the cached pair sizes, the overhead */

  if (!args->json) {
    char dev[300] = "";
    pm_device_info_t di;
    int cur = 0;
    if (pm_device_get(&cur) == PM_OK && pm_device_get_info(cur, &di) == PM_OK)
      snprintf(dev, sizeof dev, ", device %d: %s", cur, di.name);
    printf("pinmem %s bench alloc: backend %s%s; pin threads %d\n", pm_version(), pm_backend_name(),
           dev, bn.pin_threads);
    printf(
        "median of the runs; RATIO = time / the backend's own call of the same size\n"
        "(overhead rows: pinned bytes / requested bytes)\n");
  }
  if (!args->json) {
    cli_host_note(false, "these timings");
    printf("\n");
    print_header();
  }

  /* Warm up once, unmeasured: the first calls of a process pay for thread and context start. */
  {
    size_t w = args->sizes[0] < 64 * MIB ? args->sizes[0] : 64 * MIB;
    size_t fast = pm__opt_size(PM__OPT_FAST_PIN_MIN);
    if (fast > w && fast <= 64 * MIB) w = fast;
    double a, f, bt;
    bool ok = true;
    run_pinmem(&bn, w, 1, &a, &f, &bt, &ok);
    run_backend(&bn, w, 2, &a, &f, &ok);
    run_register(&bn, w, 3, &a, &f, &ok);
    if (!ok) bn.sum.all_verified = false;
  }

  for (int i = 0; i < args->nsizes; i++) bench_cold(&bn, args->sizes[i]);
  static const size_t pair_sizes[] = {4096, 65536, MIB, 16 * MIB};
  for (size_t i = 0; i < sizeof pair_sizes / sizeof pair_sizes[0]; i++)
    bench_pair(&bn, pair_sizes[i]);
  bench_overhead(&bn);
  cli_progress_clear();
  if (!args->json) print_targets(&bn.sum);
  if (args->json) cli_host_note(true, "these timings");

  cli_check(pm_device_free(bn.dev));
  free(bn.scratch);
  if (!bn.sum.all_verified) {
    fflush(stdout);
    fprintf(stderr, "pinmem: data verification failed (see the rows with verified false)\n");
    return CLI_EXIT_FAILURE;
  }
  return 0;
}
