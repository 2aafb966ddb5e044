/*
 * `pinmem bench blocks`: KV-cache blocks between a device tensor and pinned host blocks, the
 * way LLM servers offload them: N blocks of one size at random ids on both sides, both ways,
 * by three paths in one run:
 *   - memcpy_loop: one plain backend copy per block (a cudaMemcpyAsync loop);
 *   - batch_dma:   one backend batch copy of all blocks (cudaMemcpyBatchAsync, vLLM's path;
 *                  a loop where the backend has none, and the row says so);
 *   - pinmem:      pm_blocks_swap_out / pm_blocks_swap_in (kernel or DMA by the cut-off).
 * Every path uses the same arena blocks and ids; every run's bytes are checked (the destination
 * is cleared first). Then the arena itself: time to the first usable blocks and to the whole
 * arena, against one backend host_alloc of the same size (cudaHostAlloc).
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_copy_common.h"

/* Targets (cuda backend). */
#define T_GBPS_16K 40.0
#define T_RATIO_SMALL 5.0 /* pinmem over batch_dma at 4 and 16 KiB */
#define T_RATIO_256K 1.0
#define T_FIRST_S 0.1
#define T_ARENA_S_PER_GIB 0.05
#define T_ARENA_BYTES ((size_t)64 << 30)

#define MAX_LIST 16

typedef struct blk_opts {
  bool json, quiet, help;
  size_t sizes[MAX_LIST];
  int nsizes;
  uint64_t counts[MAX_LIST];
  int ncounts;
  size_t arena;
  int repeat;
} blk_opts_t;

static const char *blocks_usage =
    "pinmem [--json] bench blocks [--quiet] [--sizes LIST] [--blocks LIST] [--arena SIZE]\n"
    "    [--repeat N]";

static void print_help(void) {
  printf(
      "usage: pinmem bench blocks [--json] [--quiet] [--sizes LIST] [--blocks LIST]\n"
      "                           [--arena SIZE] [--repeat N]\n"
      "  KV-cache blocks device <-> pinned host blocks at random ids, both ways: a plain copy\n"
      "  per block, one batched copy (cudaMemcpyBatchAsync) and pinmem's block store.\n"
      "  --sizes LIST   block sizes, multiples of 8 bytes (default 4K,16K,64K,256K; --bytes and\n"
      "                 --size are other names for it)\n"
      "  --blocks LIST  blocks per call (default 1024,16384 on cuda; 1024 on the host backend;\n"
      "                 counts whose blocks do not fit in 1/4 of the device memory are skipped)\n"
      "  --arena SIZE   arena of the pinning rows (default 64G where RAM holds 4x that, else\n"
      "                 1/4 of RAM; 64M on the host backend), within the pool's budget\n"
      "  --repeat N     timed runs per row, the median is reported (default 5)\n"
      "  --json         one JSON object per row on stdout (TARGET lines go to stderr)\n"
      "  --quiet        no progress line on stderr\n"
      "  TARGET (cuda backend): pinmem >= %.0f GB/s at 16 KiB both ways; >= %.0fx batch_dma at\n"
      "  4 and 16 KiB; >= batch_dma at 256 KiB; a 64 GiB arena's first blocks in < %.1f s and\n"
      "  the whole arena in <= %.2f s/GiB.\n",
      T_GBPS_16K, T_RATIO_SMALL, T_FIRST_S, T_ARENA_S_PER_GIB);
}

static int parse_counts(const char *v, blk_opts_t *o) {
  int empty = cli_list_empty_item(v);
  if (empty) return cli_usage_fail("--blocks: item %d of '%s' is empty", empty, v);
  o->ncounts = 0;
  for (const char *p = v; *p;) {
    char *end;
    errno = 0;
    unsigned long long k = strtoull(p, &end, 10);
    if (o->ncounts == MAX_LIST) return cli_usage_fail("--blocks: at most %d counts", MAX_LIST);
    if (errno || end == p || (*end && *end != ',') || k == 0 || k > (1ull << 32))
      return cli_usage_fail("--blocks: counts must be whole numbers from 1 to 2^32, in '%s'", v);
    o->counts[o->ncounts++] = k;
    if (!*end) break;
    p = end + 1;
  }
  return 0;
}

static int parse_args(int argc, char **argv, blk_opts_t *o) {
  cli_usage_context("bench blocks", blocks_usage);
  memset(o, 0, sizeof *o);
  o->repeat = 5;
  static const char *const valued[] = {"--sizes", "--blocks", "--arena", "--repeat", NULL};
  static const char *const flags[] = {"--json", "--quiet", "--help", NULL};
  cli_opts_t op;
  cli_opts_init(&op, "bench blocks", argc, argv, valued, flags);
  const char *v;
  int got;
  while ((got = cli_opts_next(&op, &v)) == 1) {
    const char *name = op.name;
    if (!strcmp(name, "--json")) o->json = true;
    if (!strcmp(name, "--quiet")) o->quiet = true;
    if (!strcmp(name, "--help")) o->help = true;
    if (!v) continue;
    int rc = 0;
    if (!strcmp(name, "--sizes")) {
      rc = cli_parse_sizes("--sizes", v, o->sizes, MAX_LIST, &o->nsizes);
      for (int k = 0; !rc && k < o->nsizes; k++)
        if (o->sizes[k] % 8)
          rc = cli_usage_fail("--sizes: block sizes must be multiples of 8 bytes, not %zu",
                              o->sizes[k]);
    } else if (!strcmp(name, "--blocks")) {
      rc = parse_counts(v, o);
    } else if (!strcmp(name, "--arena")) {
      if (pm_parse_size(v, &o->arena) != PM_OK || o->arena == 0)
        return cli_usage_fail("--arena: '%s' is not a size above 0", v);
    } else if (!strcmp(name, "--repeat")) {
      long long n = 0;
      rc = cli_opt_int("--repeat", v, 1, 1000, &n);
      o->repeat = (int)n;
    }
    if (rc) return rc;
  }
  return got;
}

/* ---- the copy rows -------------------------------------------------------------------------- */

typedef enum { P_LOOP, P_BATCH, P_PINMEM, P_COUNT } path_t;
static const char *const path_name[] = {"memcpy_loop", "batch_dma", "pinmem"};

typedef struct brun {
  const pm__backend_t *be;
  pm_blocks_t *store;
  pm_kv_layout_t layout;
  pm_kv_region_t region;
  char *dev;   /* device tensor of n blocks */
  char *ref;   /* what the device tensor holds (host copy) */
  char *check; /* scratch for reading the device back */
  uint64_t *dids, *hids;
  void **dsts;
  const void **srcs;
  size_t *szs;
  char **host; /* host address of hids[i] */
  size_t bs;
  uint64_t n;
  pm_stream_t s;
  pm_event_t e0, e1;
} brun_t;

/* Queue one call of `path` moving every block one way. */
static void queue(brun_t *r, path_t path, bool out) {
  if (path == P_PINMEM) {
    cli_check(out ? pm_blocks_swap_out(r->store, &r->layout, r->dids, r->hids, r->n, r->s, NULL)
                  : pm_blocks_swap_in(r->store, &r->layout, r->dids, r->hids, r->n, r->s, NULL));
    return;
  }
  for (uint64_t i = 0; i < r->n; i++) {
    char *d = r->dev + r->dids[i] * r->bs;
    r->dsts[i] = out ? (void *)r->host[i] : d;
    r->srcs[i] = out ? d : r->host[i];
    r->szs[i] = r->bs;
  }
  if (path == P_BATCH && r->be->memcpy_batch_async) {
    cli_check(r->be->memcpy_batch_async(r->dsts, r->srcs, r->szs, r->n, r->s));
    return;
  }
  /* The backend's own copy (cudaMemcpyAsync), not pm_memcpy_async: the baseline carries no
   * pinmem checks. */
  for (uint64_t i = 0; i < r->n; i++)
    cli_check(
        r->be->memcpy_async(r->dsts[i], r->srcs[i], r->bs, out ? PM_COPY_D2H : PM_COPY_H2D, r->s));
}

/* Clear the destination, time one call, check every byte. */
static double timed(brun_t *r, path_t path, bool out, bool *ok) {
  if (out) {
    for (uint64_t i = 0; i < r->n; i++) memset(r->host[i], 0, r->bs);
  } else {
    cli_check(pm_device_memset_async(r->dev, 0, r->n * r->bs, r->s));
    for (uint64_t i = 0; i < r->n; i++) memcpy(r->host[i], r->ref + r->dids[i] * r->bs, r->bs);
  }
  cli_check(pm_stream_synchronize(r->s));
  cli_check(pm_event_record(r->e0, r->s));
  queue(r, path, out);
  cli_check(pm_event_record(r->e1, r->s));
  cli_check(pm_event_synchronize(r->e1));
  double t;
  cli_check(pm_event_elapsed(r->e0, r->e1, &t));
  bool good = true;
  if (out) {
    for (uint64_t i = 0; i < r->n && good; i++)
      good = memcmp(r->host[i], r->ref + r->dids[i] * r->bs, r->bs) == 0;
  } else {
    cli_check(pm_memcpy(r->check, r->dev, r->n * r->bs, PM_COPY_D2H));
    good = memcmp(r->check, r->ref, r->n * r->bs) == 0;
  }
  if (!good) {
    cli_progress_clear();
    fprintf(stderr, "VERIFY FAILED: blocks %s %s, %zu bytes x %llu\n", path_name[path],
            out ? "out" : "in", r->bs, (unsigned long long)r->n);
    *ok = false;
  }
  return t;
}

static void shuffle(uint64_t *v, uint64_t n, uint64_t *rng) {
  for (uint64_t i = n; i > 1; i--) {
    *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
    uint64_t j = (*rng >> 33) % i;
    uint64_t t = v[i - 1];
    v[i - 1] = v[j];
    v[j] = t;
  }
}

typedef struct res {
  double gbps[P_COUNT][2]; /* [path][out] */
  bool measured;
} res_t;

static bool run_size(const blk_opts_t *o, size_t bs, uint64_t n, res_t *res, int *step, int steps) {
  brun_t r;
  memset(&r, 0, sizeof r);
  r.be = pm__backend();
  r.bs = bs;
  r.n = n;
  pm_blocks_config_t c;
  pm_blocks_config_init(&c);
  c.block_bytes = bs;
  c.num_blocks = n;
  c.background = 0;
  cli_check(pm_blocks_create(&c, &r.store));
  cli_check(pm_device_alloc(n * bs, (void **)&r.dev));
  r.ref = cli_xmalloc(n * bs);
  r.check = cli_xmalloc(n * bs);
  uint64_t seed = 0x9e3779b97f4a7c15ull ^ bs ^ n;
  for (size_t i = 0; i < n * bs / 8; i++) {
    seed ^= seed << 13, seed ^= seed >> 7, seed ^= seed << 17;
    memcpy(r.ref + 8 * i, &seed, 8);
  }
  cli_check(pm_memcpy(r.dev, r.ref, n * bs, PM_COPY_H2D));
  r.dids = cli_xmalloc(n * sizeof *r.dids);
  r.hids = cli_xmalloc(n * sizeof *r.hids);
  r.host = cli_xmalloc(n * sizeof *r.host);
  r.dsts = cli_xmalloc(n * sizeof *r.dsts);
  r.srcs = cli_xmalloc(n * sizeof *r.srcs);
  r.szs = cli_xmalloc(n * sizeof *r.szs);
  cli_check(pm_blocks_alloc(r.store, n, r.hids));
  uint64_t rng = seed;
  for (uint64_t i = 0; i < n; i++) r.dids[i] = i;
  shuffle(r.dids, n, &rng);
  shuffle(r.hids, n, &rng);
  for (uint64_t i = 0; i < n; i++)
    cli_check(pm_blocks_ptr(r.store, r.hids[i], (void **)&r.host[i]));
  r.region = (pm_kv_region_t){r.dev, bs, bs};
  r.layout = (pm_kv_layout_t){1, &r.region, n, -1};
  cli_check(pm_stream_create(&r.s));
  cli_check(pm_event_create(PM_EVENT_TIMING, &r.e0));
  cli_check(pm_event_create(PM_EVENT_TIMING, &r.e1));

  bool ok = true;
  double *t = cli_xmalloc(sizeof(double) * (size_t)o->repeat);
  char sz[32];
  cli_fmt_bytes(bs, sz, sizeof sz);
  for (int out = 1; out >= 0; out--) {
    for (int p = 0; p < P_COUNT; p++) {
      bool row_ok = true;
      cli_progress((unsigned long long)(*step)++, (unsigned long long)steps,
                   "blocks: %s x %llu %s %s", sz, (unsigned long long)n, path_name[p],
                   out ? "out" : "in");
      (void)timed(&r, (path_t)p, out, &row_ok); /* warm-up (and the calibration, pinmem) */
      for (int k = 0; k < o->repeat; k++) t[k] = timed(&r, (path_t)p, out, &row_ok);
      double med = cli_median(t, o->repeat);
      double gbps = (double)(n * bs) / med / 1e9;
      res->gbps[p][out] = row_ok ? gbps : NAN;
      ok = ok && row_ok;
      char cname[64];
      snprintf(cname, sizeof cname, "%s_%s", path_name[p], out ? "out" : "in");
      bool loop_fallback = p == P_BATCH && !r.be->memcpy_batch_async;
      if (o->json) {
        cli_json_t j;
        cli_json_row(&j, "blocks", cname, (unsigned long long)(n * bs), med, gbps);
        cli_json_bool(&j, "verified", row_ok);
        cli_json_str(&j, "verify_method", "full");
        cli_json_uint(&j, "block_bytes", bs);
        cli_json_uint(&j, "blocks", n);
        cli_json_str(&j, "direction", out ? "D2H" : "H2D");
        cli_json_str(&j, "path", path_name[p]);
        cli_json_bool(&j, "batch_call", p == P_BATCH && !loop_fallback);
        cli_json_str(&j, "timing", "events");
        cli_json_int(&j, "runs", o->repeat);
        cli_json_str(&j, "backend", pm_backend_name());
        if (p == P_PINMEM) {
          pm_blocks_stats_t st;
          cli_check(pm_blocks_get_stats(r.store, &st));
          cli_json_uint(&j, "kernel_max", st.kernel_max);
          cli_json_bool(&j, "kernel", bs <= st.kernel_max);
        }
        cli_json_end(&j);
      } else {
        cli_progress_clear();
        printf("%-8s %7llu  %-4s  %-12s  %9.3f ms  %8.2f GB/s  %s%s\n", sz, (unsigned long long)n,
               out ? "D2H" : "H2D", path_name[p], med * 1e3, gbps, row_ok ? "verified" : "FAILED",
               loop_fallback ? "  (no batch call in this backend: a loop)" : "");
      }
    }
  }
  res->measured = true;
  free(t);
  cli_check(pm_event_destroy(r.e0));
  cli_check(pm_event_destroy(r.e1));
  cli_check(pm_stream_destroy(r.s));
  cli_check(pm_blocks_destroy(r.store));
  cli_check(pm_device_free(r.dev));
  free(r.ref);
  free(r.check);
  free(r.dids);
  free(r.hids);
  free(r.host);
  free(r.dsts);
  free((void *)r.srcs);
  free(r.szs);
  return ok;
}

/* ---- the arena rows ------------------------------------------------------------------------- */

typedef struct arena_res {
  double first_s, all_s, host_alloc_s;
  size_t bytes;
  bool ok;
} arena_res_t;

static arena_res_t run_arena(const blk_opts_t *o, size_t bytes) {
  arena_res_t a = {0};
  a.bytes = bytes;
  size_t bs = 2 << 20;
  pm_blocks_config_t c;
  pm_blocks_config_init(&c);
  c.block_bytes = bs;
  c.num_blocks = (bytes + bs - 1) / bs;
  a.bytes = c.num_blocks * bs;
  pm_blocks_t *s = NULL;
  double t0 = pm__now();
  pm_status_t st = pm_blocks_create(&c, &s);
  if (st != PM_OK) {
    fprintf(stderr,
            "pinmem: bench blocks: an arena of %zu bytes: %s\n(a smaller --arena, or a larger "
            "PINMEM_BUDGET: the arena counts against the default pool's budget)\n",
            a.bytes, pm_last_error());
    return a;
  }
  /* The first block is usable: write it and read it back. */
  void *p;
  cli_check(pm_blocks_ptr(s, 0, &p));
  a.first_s = pm__now() - t0;
  cli_check(pm_blocks_wait_ready(s, 0));
  a.all_s = pm__now() - t0;
  void *last;
  cli_check(pm_blocks_ptr(s, c.num_blocks - 1, &last));
  /* Each checked right after its write: an arena of one block has p == last. */
  memset(p, 0x11, bs);
  a.ok = ((unsigned char *)p)[bs - 1] == 0x11;
  memset(last, 0x22, bs);
  a.ok = a.ok && ((unsigned char *)last)[0] == 0x22;
  cli_check(pm_blocks_destroy(s));

  const pm__backend_t *be = pm__backend();
  void *h = NULL;
  double t1 = pm__now();
  st = be->host_alloc(a.bytes, PM_HOST_PORTABLE, &h);
  a.host_alloc_s = st == PM_OK ? pm__now() - t1 : NAN;
  if (st == PM_OK) (void)be->host_free(h, a.bytes);
  char sz[32];
  cli_fmt_bytes(a.bytes, sz, sizeof sz);
  double gib = (double)a.bytes / (double)((size_t)1 << 30);
  if (o->json) {
    const char *names[] = {"arena_first_block", "arena_whole", "host_alloc_whole"};
    double secs[] = {a.first_s, a.all_s, a.host_alloc_s};
    for (int i = 0; i < 3; i++) {
      cli_json_t j;
      size_t b = i == 0 ? bs : a.bytes;
      cli_json_row(&j, "blocks", names[i], b, secs[i], (double)b / secs[i] / 1e9);
      cli_json_bool(&j, "verified", i == 2 ? st == PM_OK : a.ok);
      cli_json_uint(&j, "arena_bytes", a.bytes);
      cli_json_double(&j, "seconds_per_gib", secs[i] / gib);
      cli_json_str(&j, "timing", "wall");
      cli_json_str(&j, "backend", pm_backend_name());
      cli_json_end(&j);
    }
  } else {
    cli_progress_clear();
    printf("\narena of %s (2 MiB blocks, chunks of option blocks_chunk):\n", sz);
    printf("  pinmem first block usable   %9.4f s\n", a.first_s);
    printf("  pinmem whole arena          %9.4f s  (%.4f s/GiB)\n", a.all_s, a.all_s / gib);
    if (st == PM_OK)
      printf("  one host_alloc (cudaHostAlloc) %6.4f s  (%.4f s/GiB)\n", a.host_alloc_s,
             a.host_alloc_s / gib);
    else
      printf("  one host_alloc (cudaHostAlloc) failed: %s\n", pm_last_error());
  }
  return a;
}

static size_t default_arena(bool cuda) {
  size_t ram = pm__physical_memory();
  if (!cuda) {
    size_t lim = pm__memlock_limit();
    size_t a = (size_t)64 << 20;
    return lim != SIZE_MAX && lim / 4 < a ? PM__MAX(lim / 4, (size_t)2 << 20) : a;
  }
  if (ram / 4 >= T_ARENA_BYTES) return T_ARENA_BYTES;
  return PM__MAX((ram / 4) & ~(((size_t)1 << 30) - 1), (size_t)1 << 30);
}

int pm_cli_bench_blocks(int argc, char **argv) {
  blk_opts_t o;
  int rc = parse_args(argc, argv, &o);
  if (rc) return rc;
  if (o.help) {
    print_help();
    return 0;
  }
  cli_progress_init(o.quiet || o.json);
  cli_check(pm_init());
  bool cuda = pm_backend_kind() == PM_BACKEND_CUDA;
  if (!o.nsizes) {
    static const size_t def[] = {4 << 10, 16 << 10, 64 << 10, 256 << 10};
    memcpy(o.sizes, def, sizeof def);
    o.nsizes = 4;
  }
  if (!o.ncounts) {
    o.counts[0] = 1024;
    o.ncounts = 1;
    if (cuda) o.counts[o.ncounts++] = 16384;
  }
  if (!o.arena) o.arena = default_arena(cuda);
  pm_device_info_t di;
  cli_check(pm_device_get_info(0, &di));
  size_t dev_cap = di.total_memory ? di.total_memory / 4 : SIZE_MAX;

  if (!o.json) {
    printf("pinmem bench blocks: backend %s, random block ids both sides, median of %d runs\n",
           pm_backend_name(), o.repeat);
    cli_host_note(false, "these figures");
    printf("\n%-8s %7s  %-4s  %-12s  %12s  %13s\n", "block", "blocks", "dir", "path", "time",
           "rate");
  }
  /* The results per size at the largest count that ran. */
  res_t res[MAX_LIST];
  memset(res, 0, sizeof res);
  bool ok = true;
  int steps = o.nsizes * o.ncounts * 2 * P_COUNT, step = 0;
  for (int i = 0; i < o.nsizes; i++)
    for (int k = 0; k < o.ncounts; k++) {
      if (o.sizes[i] * o.counts[k] > dev_cap) {
        fprintf(o.json ? stderr : stdout,
                "(skipped: %zu bytes x %llu blocks > 1/4 of device "
                "memory)\n",
                o.sizes[i], (unsigned long long)o.counts[k]);
        continue;
      }
      res_t r;
      memset(&r, 0, sizeof r);
      ok = run_size(&o, o.sizes[i], o.counts[k], &r, &step, steps) && ok;
      res[i] = r;
    }
  arena_res_t a = run_arena(&o, o.arena);

  /* Targets, from the largest count of each size. */
  cli_progress_clear();
  FILE *tf = o.json ? stderr : stdout;
  if (o.json) cli_host_note(true, "these figures");
  fprintf(tf, "\n");
  for (int i = 0; i < o.nsizes; i++) {
    size_t bs = o.sizes[i];
    const res_t *r = &res[i];
    char what[160], fig[96];
    if (bs == (16 << 10)) {
      for (int out = 1; out >= 0; out--) {
        snprintf(what, sizeof what, "pinmem %s at 16 KiB blocks >= %.0f GB/s",
                 out ? "swap_out (D2H)" : "swap_in (H2D)", T_GBPS_16K);
        snprintf(fig, sizeof fig, "%.2f GB/s", r->gbps[P_PINMEM][out]);
        cli_target(tf, what, r->measured, cuda, r->gbps[P_PINMEM][out] >= T_GBPS_16K, fig);
      }
    }
    if (bs == (4 << 10) || bs == (16 << 10) || bs == (256 << 10)) {
      double want = bs == (256 << 10) ? T_RATIO_256K : T_RATIO_SMALL;
      for (int out = 1; out >= 0; out--) {
        double ratio = r->gbps[P_PINMEM][out] / r->gbps[P_BATCH][out];
        snprintf(what, sizeof what, "pinmem %s at %zu KiB >= %.0fx batch_dma", out ? "D2H" : "H2D",
                 bs >> 10, want);
        snprintf(fig, sizeof fig, "%.2fx", ratio);
        cli_target(tf, what, r->measured, cuda, ratio >= want, fig);
      }
    }
  }
  {
    char what[160], fig[96];
    bool at64 = a.bytes >= T_ARENA_BYTES;
    snprintf(what, sizeof what, "64 GiB arena: first blocks usable in < %.1f s", T_FIRST_S);
    snprintf(fig, sizeof fig, "%.4f s", a.first_s);
    cli_target(tf, what, at64 && a.ok, cuda, a.first_s < T_FIRST_S, fig);
    double spg = a.all_s / ((double)a.bytes / (double)((size_t)1 << 30));
    snprintf(what, sizeof what, "64 GiB arena: whole arena in <= %.2f s/GiB", T_ARENA_S_PER_GIB);
    snprintf(fig, sizeof fig, "%.4f s/GiB", spg);
    cli_target(tf, what, at64 && a.ok, cuda, spg <= T_ARENA_S_PER_GIB, fig);
    if (!at64)
      fprintf(tf, "(the arena rows ran at %zu MiB: --arena 64G where the machine holds it)\n",
              a.bytes >> 20);
  }
  if (!ok) fprintf(stderr, "pinmem: some blocks arrived wrong (see VERIFY FAILED above)\n");
  if (!a.ok) fprintf(stderr, "pinmem: the arena rows failed (above)\n");
  return ok && a.ok ? 0 : CLI_EXIT_FAILURE;
}
