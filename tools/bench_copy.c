/*
 * `pinmem bench copy`: what pinned memory and pinmem's copy engine buy for host<->device copies,
 * side by side in one run (bench_copy_common.h names the files of the other parts).
 *
 * bench copy: for each size and for H2D, D2H and both at once (two streams), the plain backend
 * copy (cudaMemcpyAsync) from pageable, pinned and write-combined pinned memory, pinmem's
 * pm_copy_async from pageable memory (staged; also forced through the ring, and H2D through the
 * slab layout of copy_piece) and from pinned memory, a kernel reading mapped
 * (zero-copy) pinned memory, and managed-memory prefetch. Then 4096 x 64 KiB pieces in one
 * pm_copy_batch_async against a loop of plain copies. At the largest size, the host's share of
 * staging (bench_movers.c).
 *
 * Method: every case gets a warm-up run, then --repeat timed runs; the median is reported. The
 * timed runs of the cases of one direction and size are interleaved in rounds, each round
 * starting one case later, so drift of the machine during the run hits a case and its baseline
 * alike ("order": "interleaved" in each row; the batch rows run case after case). A run
 * is timed with PM_EVENT_TIMING events recorded on the stream around the submission (for calls
 * that block the caller, like plain pageable copies, the end event is recorded after they
 * return, so their host-side time counts too; a staged D2H holds the stream until its bytes are
 * in dst, so its end event counts the copy-out). Small sizes repeat the copy back to back
 * within a run (at least 64 MiB per run) and report the time per copy. The destination is
 * cleared before every run and the bytes that arrived are checked after it: a full compare up
 * to 256 MiB, beyond that the first and last 64 KiB and 4096 random 4 KiB windows
 * ("verified": "full" / "sampled"); the zero-copy kernel's result is compared with the host
 * checksum of the buffer ("checksum"). A failed check reports "verified": false and the command
 * exits 1. Speed targets (TARGET lines) apply to the cuda backend; on the host backend the runs
 * prove correctness only, so the default sizes stop at 64 MiB there.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_copy_common.h"

#define INNER_BYTES (64 * MIB) /* small copies repeat within a run up to this many bytes */
#define INNER_MAX 256

/* pinmem's targets (cuda backend). */
#define T_PINNED_RATIO 0.99
#define T_PINNED_MIN_BYTES (8 * MIB)
#define T_PAGEABLE_H2D_GBPS 50.0
#define T_PAGEABLE_H2D_RATIO 5.0
#define T_PAGEABLE_D2H_GBPS 45.0
#define T_BIDIR_GBPS 100.0
#define T_BATCH_GBPS 40.0

/* ---- cases ------------------------------------------------------------------------------------
 */

typedef void (*op_fn)(bench_t *b, size_t n);
typedef const char *(*verify_fn)(bench_t *b, size_t n, const char *what);
typedef void (*prep_fn)(bench_t *b, size_t n);

static void d2h_plain(bench_t *b, size_t n, void *dst, pm_stream_t s) {
  cli_check(pm_memcpy_async(dst, b->d2, n, PM_COPY_D2H, s));
}

static void op_h2d_plain_pageable(bench_t *b, size_t n) {
  bc_h2d_plain(b, n, b->hsrc);
}
static void op_h2d_plain_pinned(bench_t *b, size_t n) {
  bc_h2d_plain(b, n, b->psrc);
}
static void op_h2d_plain_wc(bench_t *b, size_t n) {
  bc_h2d_plain(b, n, b->wsrc);
}
static void op_h2d_pinmem_pageable(bench_t *b, size_t n) {
  cli_check(pm_copy_async(b->d1, b->hsrc, n, b->s1, NULL, NULL));
}
/* A staged copy through the ring of chunk buffers (option copy_bounce=ring), to weigh the two
 * staging layouts in one run; the option is set around the call only. */
static void copy_through_ring(bench_t *b, void *dst, const void *src, size_t n) {
  cli_check(pm_option_set("copy_bounce", "ring"));
  pm_status_t st = pm_copy_async(dst, src, n, b->s1, NULL, NULL);
  cli_check(pm_option_set("copy_bounce", NULL));
  cli_check(st);
}
static void op_h2d_pinmem_pageable_ring(bench_t *b, size_t n) {
  copy_through_ring(b, b->d1, b->hsrc, n);
}
/* The whole-chunk H2D layout (docs/performance.md, pageable host to device): each thread
 * stages whole chunks into a 32-slot ring with non-temporal stores (copy_piece=0,
 * copy_memcpy=stream, copy_bounce=ring), set around the call only, beside the default (slots
 * filled in pieces) in every run, so each run shows what the pieces bring. */
static void op_h2d_pinmem_pageable_units(bench_t *b, size_t n) {
  static const char *opts[][2] = {
      {"copy_bounce", "ring"}, {"copy_piece", "0"}, {"copy_memcpy", "stream"}};
  enum { NOPTS = sizeof opts / sizeof opts[0] };
  for (int i = 0; i < NOPTS; i++) cli_check(pm_option_set(opts[i][0], opts[i][1]));
  pm_status_t st = pm_copy_async(b->d1, b->hsrc, n, b->s1, NULL, NULL);
  for (int i = 0; i < NOPTS; i++) cli_check(pm_option_set(opts[i][0], NULL));
  cli_check(st);
}
static void op_h2d_pinmem_pinned(bench_t *b, size_t n) {
  cli_check(pm_copy_async(b->d1, b->psrc, n, b->s1, NULL, NULL));
}
static void op_h2d_zerocopy(bench_t *b, size_t n) {
  cli_check(pm__launch_checksum(b->msrc_dev, n, b->dres, (struct CUstream_st *)b->s1));
}
static void op_h2d_managed(bench_t *b, size_t n) {
  int dev = 0;
  cli_check(pm_device_get(&dev));
  cli_check(pm_managed_prefetch(b->man, n, dev, b->s1));
}
static void op_d2h_plain_pageable(bench_t *b, size_t n) {
  d2h_plain(b, n, b->hdst, b->s1);
}
static void op_d2h_plain_pinned(bench_t *b, size_t n) {
  d2h_plain(b, n, b->pdst, b->s1);
}
static void op_d2h_pinmem_pageable(bench_t *b, size_t n) {
  cli_check(pm_copy_async(b->hdst, b->d2, n, b->s1, NULL, NULL));
}
static void op_d2h_pinmem_pageable_ring(bench_t *b, size_t n) {
  copy_through_ring(b, b->hdst, b->d2, n);
}
static void op_d2h_pinmem_pinned(bench_t *b, size_t n) {
  cli_check(pm_copy_async(b->pdst, b->d2, n, b->s1, NULL, NULL));
}
static void op_d2h_managed(bench_t *b, size_t n) {
  cli_check(pm_managed_prefetch(b->man, n, PM_CPU_DEVICE, b->s1));
}
/* Both directions at once: D2H on s2 first (it does not block the caller on these paths, or
 * blocks it anyway on the plain pageable one), then H2D on s1. */
static void op_bi_plain_pageable(bench_t *b, size_t n) {
  d2h_plain(b, n, b->hdst, b->s2);
  bc_h2d_plain(b, n, b->hsrc);
}
static void op_bi_plain_pinned(bench_t *b, size_t n) {
  d2h_plain(b, n, b->pdst, b->s2);
  bc_h2d_plain(b, n, b->psrc);
}
static void op_bi_pinmem_pageable(bench_t *b, size_t n) {
  cli_check(pm_copy_async(b->hdst, b->d2, n, b->s2, NULL, NULL));
  cli_check(pm_copy_async(b->d1, b->hsrc, n, b->s1, NULL, NULL));
}
static void op_bi_pinmem_pinned(bench_t *b, size_t n) {
  cli_check(pm_copy_async(b->pdst, b->d2, n, b->s2, NULL, NULL));
  cli_check(pm_copy_async(b->d1, b->psrc, n, b->s1, NULL, NULL));
}

static void prep_hdst(bench_t *b, size_t n) {
  bc_clear_host(b->hdst, n);
}
static void prep_pdst(bench_t *b, size_t n) {
  bc_clear_host(b->pdst, n);
}
static void prep_bi_pageable(bench_t *b, size_t n) {
  bc_prep_d1(b, n);
  prep_hdst(b, n);
}
static void prep_bi_pinned(bench_t *b, size_t n) {
  bc_prep_d1(b, n);
  prep_pdst(b, n);
}
static void prep_zerocopy(bench_t *b, size_t n) {
  cli_check(pm_device_memset_async(b->dres, 0, sizeof(uint64_t), b->s1));
  if (b->sum_bytes != n) { /* the expected checksum, once per size */
    b->want_sum = pm__checksum_host(b->msrc, n);
    b->sum_bytes = n;
  }
}
/* The data must be where the prefetch takes it from, and must be the pattern. */
static void prep_managed_h2d(bench_t *b, size_t n) {
  cli_check(pm_managed_prefetch(b->man, n, PM_CPU_DEVICE, b->s1));
  cli_check(pm_stream_synchronize(b->s1));
}
static void prep_managed_d2h(bench_t *b, size_t n) {
  int dev = 0;
  cli_check(pm_device_get(&dev));
  cli_check(pm_managed_prefetch(b->man, n, dev, b->s1));
}

static const char *v_hdst(bench_t *b, size_t n, const char *what) {
  return bc_pat_verify(what, b->hdst, n, 0);
}
static const char *v_pdst(bench_t *b, size_t n, const char *what) {
  return bc_pat_verify(what, b->pdst, n, 0);
}
static const char *v_bi_pageable(bench_t *b, size_t n, const char *what) {
  const char *m = bc_v_d1(b, n, what);
  return m && v_hdst(b, n, what) ? m : NULL;
}
static const char *v_bi_pinned(bench_t *b, size_t n, const char *what) {
  const char *m = bc_v_d1(b, n, what);
  return m && v_pdst(b, n, what) ? m : NULL;
}
static const char *v_zerocopy(bench_t *b, size_t n, const char *what) {
  (void)n; /* prep_zerocopy computed the expected sum for n */
  uint64_t got = 0;
  cli_check(pm_memcpy(&got, b->dres, sizeof got, PM_COPY_D2H));
  if (got == b->want_sum) return "checksum";
  fprintf(stderr, "pinmem: VERIFY FAILED: %s: device checksum %016llx, host %016llx\n", what,
          (unsigned long long)got, (unsigned long long)b->want_sum);
  return NULL;
}
static const char *v_managed(bench_t *b, size_t n, const char *what) {
  cli_check(pm_stream_synchronize(b->s1));
  return bc_pat_verify(what, b->man, n, 0);
}

typedef struct ccase {
  const char *name;
  const char *dir; /* h2d, d2h, bidir */
  const char *baseline;
  op_fn op;
  prep_fn prep;
  verify_fn verify;
  int need;    /* 0 always, 1 device checksum kernel, 2 managed memory */
  bool pinmem; /* report pm_copy_async's path */
} ccase_t;

static const ccase_t cases[] = {
    {"plain_pageable", "h2d", NULL, op_h2d_plain_pageable, bc_prep_d1, bc_v_d1, 0, false},
    {"plain_pinned", "h2d", NULL, op_h2d_plain_pinned, bc_prep_d1, bc_v_d1, 0, false},
    {"plain_wc_pinned", "h2d", "plain_pinned", op_h2d_plain_wc, bc_prep_d1, bc_v_d1, 0, false},
    {"pinmem_pageable", "h2d", "plain_pageable", op_h2d_pinmem_pageable, bc_prep_d1, bc_v_d1, 0,
     true},
    {"pinmem_pageable_ring", "h2d", "plain_pageable", op_h2d_pinmem_pageable_ring, bc_prep_d1,
     bc_v_d1, 0, true},
    {"pinmem_pageable_units", "h2d", "plain_pageable", op_h2d_pinmem_pageable_units, bc_prep_d1,
     bc_v_d1, 0, true},
    {"pinmem_pinned", "h2d", "plain_pinned", op_h2d_pinmem_pinned, bc_prep_d1, bc_v_d1, 0, true},
    {"zerocopy_mapped", "h2d", "plain_pinned", op_h2d_zerocopy, prep_zerocopy, v_zerocopy, 1,
     false},
    {"managed_prefetch", "h2d", "plain_pinned", op_h2d_managed, prep_managed_h2d, v_managed, 2,
     false},
    {"plain_pageable", "d2h", NULL, op_d2h_plain_pageable, prep_hdst, v_hdst, 0, false},
    {"plain_pinned", "d2h", NULL, op_d2h_plain_pinned, prep_pdst, v_pdst, 0, false},
    {"pinmem_pageable", "d2h", "plain_pageable", op_d2h_pinmem_pageable, prep_hdst, v_hdst, 0,
     true},
    {"pinmem_pageable_ring", "d2h", "plain_pageable", op_d2h_pinmem_pageable_ring, prep_hdst,
     v_hdst, 0, true},
    {"pinmem_pinned", "d2h", "plain_pinned", op_d2h_pinmem_pinned, prep_pdst, v_pdst, 0, true},
    {"managed_prefetch", "d2h", "plain_pinned", op_d2h_managed, prep_managed_d2h, v_managed, 2,
     false},
    {"plain_pageable", "bidir", NULL, op_bi_plain_pageable, prep_bi_pageable, v_bi_pageable, 0,
     false},
    {"plain_pinned", "bidir", NULL, op_bi_plain_pinned, prep_bi_pinned, v_bi_pinned, 0, false},
    {"pinmem_pageable", "bidir", "plain_pageable", op_bi_pinmem_pageable, prep_bi_pageable,
     v_bi_pageable, 0, true},
    {"pinmem_pinned", "bidir", "plain_pinned", op_bi_pinmem_pinned, prep_bi_pinned, v_bi_pinned, 0,
     true},
};

static const char *path_name(pm_copy_path_t p) {
  switch (p) {
    case PM_PATH_DIRECT:
      return "direct";
    case PM_PATH_STAGED:
      return "staged";
    case PM_PATH_REGISTER:
      return "register";
    default:
      return "auto";
  }
}

/* The path pm_copy_async picks for this case (one untimed copy with a fence). */
static const char *pinmem_path(bench_t *b, const ccase_t *c, size_t n) {
  bool h2d = strcmp(c->dir, "d2h") != 0;
  bool pageable_src = strstr(c->name, "pageable") != NULL;
  void *dst = h2d ? (void *)b->d1 : (pageable_src ? b->hdst : b->pdst);
  const void *src = h2d ? (pageable_src ? b->hsrc : b->psrc) : b->d2;
  pm_fence_t f;
  cli_check(pm_copy_async(dst, src, n, b->s1, NULL, &f));
  cli_check(pm_fence_wait(f));
  pm_copy_path_t p;
  cli_check(pm_fence_path(f, &p));
  cli_check(pm_fence_release(f));
  return path_name(p);
}

/* Why a case cannot run here, or NULL. */
static const char *case_skip(const bench_t *b, const ccase_t *c) {
  if (c->need == 1 && !b->have_checksum)
    return b->cuda ? "the device checksum kernel is not in this build"
                   : "needs a device kernel (cuda backend)";
  if (c->need == 2 && !b->man) return "managed memory is not available here";
  return NULL;
}

/* A case that measures a GPU feature (the zero-copy kernel, managed memory) means nothing for
 * speed on the host backend, which only imitates the feature. */
static bool case_applicable(const bench_t *b, const ccase_t *c) {
  return b->cuda || c->need == 0;
}

static void report_skip(const bench_t *b, const ccase_t *c, size_t n, const char *skip) {
  char sz[32];
  cli_progress_clear();
  cli_fmt_bytes(n, sz, sizeof sz);
  size_t moved = strcmp(c->dir, "bidir") == 0 ? 2 * n : n;
  if (b->o.json) {
    cli_json_t j;
    cli_json_row(&j, "copy", c->name, moved, NAN, NAN);
    cli_json_str(&j, "dir", c->dir);
    cli_json_bool(&j, "verified", false);
    cli_json_str(&j, "verify_method", "none");
    cli_json_bool(&j, "applicable", case_applicable(b, c));
    cli_json_str(&j, "skipped", skip);
    cli_json_str(&j, "backend", pm_backend_name());
    cli_json_end(&j);
  } else {
    printf("%-5s  %-13s  %-22s  %9s  %8s  %-8s  skipped: %s\n", c->dir, sz, c->name, "-", "-", "-",
           skip);
  }
}

/* The timed runs of one case at one size, filled in as the group's rounds go. */
typedef struct case_runs {
  const ccase_t *c;
  double *t; /* seconds per copy, one per timed run */
  int inner; /* copies per run */
  const char *method;
  bool ok;
  char what[96];
} case_runs_t;

/* One run of a case: `inner` copies between two events, then the bytes verified. Returns the
 * seconds per copy. */
static double time_once(bench_t *b, case_runs_t *cr, size_t n) {
  const ccase_t *c = cr->c;
  bool bidir = strcmp(c->dir, "bidir") == 0;
  c->prep(b, n);
  bc_sync_all(b);
  cli_check(pm_event_record(b->e0, b->s1));
  if (bidir) cli_check(pm_stream_wait_event(b->s2, b->e0));
  for (int k = 0; k < cr->inner; k++) c->op(b, n);
  double s = bc_end_timing(b, bidir);
  const char *m = c->verify(b, n, cr->what);
  if (!m) {
    cr->ok = false;
    b->failed = true;
  } else if (strcmp(m, "full") != 0) {
    cr->method = m;
  }
  return s / cr->inner;
}

/* One row: the median of the case's timed runs, with its ratio to the baseline case. */
static void report_case(bench_t *b, const case_runs_t *cr, size_t n, int runs) {
  const ccase_t *c = cr->c;
  size_t moved = strcmp(c->dir, "bidir") == 0 ? 2 * n : n;
  double med = cli_median(cr->t, runs), lo = cr->t[0], hi = cr->t[runs - 1];
  double gbps = (double)moved / med / 1e9;
  const char *path = c->pinmem ? pinmem_path(b, c, n) : "plain";
  if (!strcmp(c->name, "zerocopy_mapped")) path = "kernel";
  if (!strcmp(c->name, "managed_prefetch")) path = "prefetch";
  double ratio = NAN;
  const char *base = c->baseline;
  if (base) {
    const result_t *br = bc_find_result(b, base, c->dir, moved);
    if (br && br->gbps > 0) ratio = gbps / br->gbps;
  }
  bc_add_result(b, c->name, c->dir, moved, gbps, cr->ok);

  if (b->o.json) {
    cli_json_t j;
    bc_copy_row_json(&j, c->name, c->dir, moved, med, gbps, cr->ok, cr->method, ratio, base,
                     case_applicable(b, c));
    cli_json_str(&j, "path", path);
    cli_json_str(&j, "timing", "events");
    cli_json_int(&j, "runs", runs);
    cli_json_int(&j, "copies_per_run", cr->inner);
    cli_json_str(&j, "order", "interleaved");
    cli_json_double(&j, "min_seconds", lo);
    cli_json_double(&j, "max_seconds", hi);
    cli_json_str(&j, "backend", pm_backend_name());
    cli_json_end(&j);
  } else {
    char sz[32];
    cli_fmt_bytes(n, sz, sizeof sz);
    bc_text_row(c->dir, sz, c->name, gbps, ratio, path, cr->ok, cr->method, case_applicable(b, c));
  }
}

/* Every wanted case of one direction at one size. After one warm-up run each (bounce buffers,
 * page state), the timed runs go in rounds: each round runs every case once, starting one case
 * later than the round before, so drift of the machine (clocks, other tenants, the kernel
 * reclaiming memory) hits a case and its baseline alike instead of landing on whichever case
 * ran during it. Each case's median is reported, in the table's order (baselines first). */
static void run_group(bench_t *b, const char *dir, size_t n) {
  enum { MAX_GROUP = sizeof cases / sizeof cases[0] };
  case_runs_t cr[MAX_GROUP];
  const ccase_t *order[MAX_GROUP]; /* the group in the table's order, skipped cases included */
  int m = 0, all = 0, runs = b->o.repeat;
  char sz[32];
  cli_fmt_bytes(n, sz, sizeof sz);
  for (size_t i = 0; i < MAX_GROUP; i++) {
    const ccase_t *c = &cases[i];
    if (strcmp(c->dir, dir) != 0 || !bc_wanted(b, c->name)) continue;
    order[all++] = c;
    if (case_skip(b, c)) continue;
    case_runs_t *r = &cr[m++];
    r->c = c;
    r->t = cli_xmalloc(sizeof(double) * (size_t)runs);
    /* A managed prefetch moves the pages once: a second prefetch to where they already are
     * does nothing, so repeating it inside a run would time no-ops (and report more than the
     * link can carry). One prefetch per run, small sizes included. */
    r->inner =
        (n >= INNER_BYTES || c->need == 2) ? 1 : (int)PM__MIN((size_t)INNER_MAX, INNER_BYTES / n);
    r->method = "full";
    r->ok = true;
    snprintf(r->what, sizeof r->what, "%s %s %s", c->dir, sz, c->name);
  }
  for (int i = 0; i < m; i++) {
    cli_progress(b->steps_done, b->steps, "%s %s: %s, warm-up", dir, sz, cr[i].c->name);
    (void)time_once(b, &cr[i], n);
  }
  for (int round = 0; round < runs; round++)
    for (int k = 0; k < m; k++) {
      case_runs_t *r = &cr[(k + round) % m];
      cli_progress(b->steps_done, b->steps, "%s %s: %s, round %d/%d", dir, sz, r->c->name,
                   round + 1, runs);
      r->t[round] = time_once(b, r, n);
    }
  b->steps_done++;
  for (int i = 0, k = 0; i < all; i++) {
    const char *skip = case_skip(b, order[i]);
    if (skip) {
      report_skip(b, order[i], n, skip);
    } else {
      report_case(b, &cr[k], n, runs);
      free(cr[k++].t);
    }
  }
}

/* ---- batched pieces ----------------------------------------------------------------------------
 */

typedef struct batch_case {
  const char *name;
  const char *dir;
  bool pageable;
  bool engine;      /* pm_copy_batch_async (else a loop of plain copies) */
  const char *mode; /* copy_batch for the call (NULL: the option as it stands) */
} batch_case_t;

/* The pinmem rows use copy_batch as it stands; the _dma and _kernel rows force each way, so
 * one run weighs the two (and tells which default to take). */
static const batch_case_t bcases[] = {
    {"batch_pinned_loop", "h2d", false, false, NULL},
    {"batch_pinned_pinmem", "h2d", false, true, NULL},
    {"batch_pinned_dma", "h2d", false, true, "dma"},
    {"batch_pinned_kernel", "h2d", false, true, "kernel"},
    {"batch_pinned_loop", "d2h", false, false, NULL},
    {"batch_pinned_pinmem", "d2h", false, true, NULL},
    {"batch_pinned_dma", "d2h", false, true, "dma"},
    {"batch_pinned_kernel", "d2h", false, true, "kernel"},
    {"batch_pageable_loop", "h2d", true, false, NULL},
    {"batch_pageable_pinmem", "h2d", true, true, NULL},
};

static int add_name(const char **out, int n, int max, const char *name) {
  for (int i = 0; i < n; i++)
    if (!strcmp(out[i], name)) return n;
  if (n < max) out[n++] = name;
  return n;
}

int bc_case_names(const char **out, int max) {
  int n = 0;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    n = add_name(out, n, max, cases[i].name);
  for (size_t i = 0; i < 3; i++) n = add_name(out, n, max, bc_mover_names[i]);
  for (size_t i = 0; i < 4; i++) n = add_name(out, n, max, bc_contention_names[i]);
  for (size_t i = 0; i < sizeof bcases / sizeof bcases[0]; i++)
    n = add_name(out, n, max, bcases[i].name);
  return n;
}

static void run_batch(bench_t *b, const batch_case_t *bc, size_t count, size_t piece) {
  size_t total = count * piece;
  bool h2d = !strcmp(bc->dir, "h2d");
  size_t *perm = cli_xmalloc(count * sizeof *perm);
  for (size_t i = 0; i < count; i++) perm[i] = i;
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (size_t i = count; i > 1; i--) { /* scattered slots: no two pieces are adjacent twice */
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    size_t j = (size_t)(x % i), tmp = perm[i - 1];
    perm[i - 1] = perm[j];
    perm[j] = tmp;
  }
  pm_copy_item_t *it = cli_xmalloc(count * sizeof *it);
  char *host = h2d ? (bc->pageable ? b->hsrc : b->psrc) : (bc->pageable ? b->hdst : b->pdst);
  for (size_t i = 0; i < count; i++) {
    if (h2d) {
      it[i].src = host + i * piece;
      it[i].dst = b->d1 + perm[i] * piece;
    } else {
      it[i].src = b->d2 + perm[i] * piece;
      it[i].dst = host + i * piece;
    }
    it[i].bytes = piece;
  }
  int runs = b->o.repeat;
  double *t = cli_xmalloc(sizeof(double) * (size_t)runs);
  bool ok = true;
  const char *method = total <= FULL_VERIFY_MAX ? "full" : "sampled";
  char what[96];
  snprintf(what, sizeof what, "%s batch %s", bc->dir, bc->name);
  for (int r = -1; r < runs; r++) {
    cli_progress(b->steps_done, b->steps, "%s %s, run %d/%d", bc->dir, bc->name, r + 2, runs + 1);
    if (h2d)
      bc_prep_d1(b, total);
    else
      bc_clear_host(host, total);
    bc_sync_all(b);
    cli_check(pm_event_record(b->e0, b->s1));
    if (bc->engine) {
      if (bc->mode) cli_check(pm_option_set("copy_batch", bc->mode));
      pm_status_t st = pm_copy_batch_async(it, count, b->s1, NULL, NULL);
      if (bc->mode) cli_check(pm_option_set("copy_batch", NULL));
      cli_check(st);
    } else {
      for (size_t i = 0; i < count; i++)
        cli_check(
            pm_memcpy_async(it[i].dst, it[i].src, piece, h2d ? PM_COPY_H2D : PM_COPY_D2H, b->s1));
    }
    cli_check(pm_event_record(b->e1, b->s1));
    cli_check(pm_event_synchronize(b->e1));
    double s;
    cli_check(pm_event_elapsed(b->e0, b->e1, &s));
    if (r >= 0) t[r] = s;
    /* Piece i must hold the pattern of its source offset. */
    const char *got = h2d ? b->vbuf : host;
    if (h2d) cli_check(pm_memcpy(b->vbuf, b->d1, total, PM_COPY_D2H));
    for (size_t i = 0; i < count && ok; i++) {
      size_t doff = h2d ? perm[i] * piece : i * piece;
      size_t soff = h2d ? i * piece : perm[i] * piece;
      if (!bc_pat_verify(what, got + doff, piece, soff)) ok = false;
    }
    if (!ok) b->failed = true;
  }
  b->steps_done++;
  double med = cli_median(t, runs);
  free(t);
  double gbps = (double)total / med / 1e9;
  char base[40];
  snprintf(base, sizeof base, "%s", bc->name);
  char *us = strrchr(base, '_');
  if (us) strcpy(us, "_loop");
  double ratio = NAN;
  const result_t *br = bc_find_result(b, base, bc->dir, total);
  if (br && bc->engine && br->gbps > 0) ratio = gbps / br->gbps;
  bc_add_result(b, bc->name, bc->dir, total, gbps, ok);
  if (b->o.json) {
    cli_json_t j;
    bc_copy_row_json(&j, bc->name, bc->dir, total, med, gbps, ok, method, ratio,
                     bc->engine ? base : NULL, true);
    cli_json_uint(&j, "items", count);
    cli_json_uint(&j, "item_bytes", piece);
    cli_json_str(&j, "timing", "events");
    cli_json_int(&j, "runs", runs);
    cli_json_str(&j, "backend", pm_backend_name());
    cli_json_end(&j);
  } else {
    char sz[32], label[64]; /* a 20-digit count, 'x' and sz fit */
    cli_fmt_bytes(piece, sz, sizeof sz);
    snprintf(label, sizeof label, "%zux%s", count, sz);
    bc_text_row(bc->dir, label, bc->name, gbps, ratio, bc->engine ? "batch" : "loop", ok, method,
                true);
  }
  free(it);
  free(perm);
}

/* ---- targets -----------------------------------------------------------------------------------
 */

static void print_targets(const bench_t *b, size_t batch_total) {
  fprintf(b->o.json ? stderr : stdout, "\n");
  char fig[256];
  /* pinmem from pinned >= 0.99x plain pinned, every size >= 8 MiB, H2D and D2H */
  {
    bool any = false, met = true;
    double worst = INFINITY;
    size_t worst_n = 0;
    const char *worst_dir = "";
    for (int i = 0; i < b->nres; i++) {
      const result_t *r = &b->res[i];
      if (strcmp(r->name, "pinmem_pinned") || !strcmp(r->dir, "bidir")) continue;
      if (r->bytes < T_PINNED_MIN_BYTES) continue;
      const result_t *p = bc_find_result(b, "plain_pinned", r->dir, r->bytes);
      if (!p || !(p->gbps > 0)) continue;
      any = true;
      double q = r->gbps / p->gbps;
      if (q < worst) {
        worst = q;
        worst_n = r->bytes;
        worst_dir = r->dir;
      }
      if (q < T_PINNED_RATIO || !r->verified) met = false;
    }
    char sz[32];
    cli_fmt_bytes(worst_n, sz, sizeof sz);
    snprintf(fig, sizeof fig, "lowest %.3fx (%s %s)", worst, worst_dir, sz);
    bc_target(b, "pinmem from pinned >= 0.99x plain pinned at >= 8 MiB", any, met, fig);
  }
  {
    const result_t *r = bc_find_result(b, "pinmem_pageable", "h2d", GIB);
    const result_t *p = bc_find_result(b, "plain_pageable", "h2d", GIB);
    double q = r && p && p->gbps > 0 ? r->gbps / p->gbps : NAN;
    int len = snprintf(fig, sizeof fig, "%.1f GB/s, %.1fx plain pageable", r ? r->gbps : NAN, q);
    /* The ceiling the shared memory puts on staging here, when the run measured it. */
    const result_t *dl = bc_find_result(b, "dma_under_h2h", "h2d", GIB);
    const result_t *hl = bc_find_result(b, "h2h_under_dma", "h2h", GIB);
    if (dl && hl && len > 0 && (size_t)len < sizeof fig)
      snprintf(fig + len, sizeof fig - (size_t)len,
               "; both halves at once: DMA %.1f GB/s, host copy %.1f GB/s", dl->gbps, hl->gbps);
    bc_target(b, "pageable H2D 1 GiB >= 50 GB/s and >= 5x plain pageable", r != NULL,
              r && r->verified && r->gbps >= T_PAGEABLE_H2D_GBPS && q >= T_PAGEABLE_H2D_RATIO, fig);
  }
  {
    const result_t *r = bc_find_result(b, "pinmem_pageable", "d2h", GIB);
    snprintf(fig, sizeof fig, "%.1f GB/s", r ? r->gbps : NAN);
    bc_target(b, "pageable D2H 1 GiB >= 45 GB/s", r != NULL,
              r && r->verified && r->gbps >= T_PAGEABLE_D2H_GBPS, fig);
  }
  {
    const result_t *best = NULL;
    for (int i = 0; i < b->nres; i++) {
      const result_t *r = &b->res[i];
      if (!strcmp(r->name, "pinmem_pinned") && !strcmp(r->dir, "bidir") &&
          (!best || r->bytes > best->bytes))
        best = r;
    }
    char sz[32];
    cli_fmt_bytes(best ? best->bytes / 2 : 0, sz, sizeof sz);
    snprintf(fig, sizeof fig, "%.1f GB/s (pinmem, %s each way)", best ? best->gbps : NAN, sz);
    bc_target(b, "bidirectional pinned >= 100 GB/s", best != NULL,
              best && best->verified && best->gbps >= T_BIDIR_GBPS, fig);
  }
  {
    const result_t *r = bc_find_result(b, "batch_pinned_pinmem", "h2d", batch_total);
    const result_t *l = bc_find_result(b, "batch_pinned_loop", "h2d", batch_total);
    const result_t *dm = bc_find_result(b, "batch_pinned_dma", "h2d", batch_total);
    const result_t *kn = bc_find_result(b, "batch_pinned_kernel", "h2d", batch_total);
    snprintf(fig, sizeof fig, "%.1f GB/s (dma %.1f, kernel %.1f; plain loop %.1f GB/s)",
             r ? r->gbps : NAN, dm ? dm->gbps : NAN, kn ? kn->gbps : NAN, l ? l->gbps : NAN);
    bc_target(b, "batch 4096 x 64 KiB >= 40 GB/s", r != NULL && batch_total == 4096 * 64 * KIB,
              r && r->verified && r->gbps >= T_BATCH_GBPS, fig);
  }
}

/* ---- pinmem bench copy --------------------------------------------------------------------------
 */

/* --devices LIST|all: the several-device rows (bench_devices.c), with --sizes (each size in
 * turn), --repeat and --json; the rest of bench copy's options do not apply there. */
static int devices_mode(int argc, char **argv) {
  static const char *const valued[] = {"--devices", "--sizes", "--repeat", "--cases", NULL};
  static const char *const flags[] = {"--json", "--quiet", NULL};
  const char *list = NULL;
  bool json = false;
  size_t sizes[32] = {64 * MIB};
  int nsizes = 1, repeat = 5;
  cli_opts_t op;
  cli_opts_init(&op, "bench copy", argc, argv, valued, flags);
  const char *v;
  int got;
  while ((got = cli_opts_next(&op, &v)) == 1) {
    if (!strcmp(op.name, "--json")) json = true;
    if (!v) continue;
    if (!strcmp(op.name, "--cases"))
      cli_usage_error("--cases does not apply to --devices (it takes --sizes, --repeat, --json)");
    if (!strcmp(op.name, "--devices")) {
      list = v;
    } else if (!strcmp(op.name, "--sizes")) {
      int rc = cli_parse_sizes("--sizes", v, sizes, 32, &nsizes);
      if (rc) return rc;
    } else {
      long long r = 0;
      if (cli_opt_int("--repeat", v, 1, 10000, &r)) return CLI_EXIT_USAGE;
      repeat = (int)r;
    }
  }
  if (got) return got;
  if (!list || !*list) cli_usage_error("--devices needs a list of devices or 'all'");
  int rc = 0;
  for (int i = 0; i < nsizes && !rc; i++) rc = bc_bench_devices(list, json, sizes[i], repeat);
  return rc;
}

int pm_cli_bench_copy(int argc, char **argv) {
  for (int i = 1; i < argc; i++)
    if (!strcmp(argv[i], "--devices") || !strncmp(argv[i], "--devices=", 10)) {
      cli_usage_context("bench copy",
                        "pinmem bench copy --devices LIST|all [--sizes LIST] "
                        "[--repeat N] [--json]");
      return devices_mode(argc, argv);
    }
  bench_t *b = NULL;
  int rc = bc_bench_begin("copy", argc, argv, &b);
  if (rc) return rc;
  if (!b->o.nsizes) {
    static const size_t def[] = {4 * KIB, 64 * KIB, MIB, 8 * MIB, 64 * MIB, 256 * MIB, GIB};
    int n = b->cuda ? 7 : 5; /* host backend: up to 64 MiB */
    for (int i = 0; i < n; i++) b->o.sizes[i] = def[i];
    b->o.nsizes = n;
  }
  size_t count = b->cuda ? 4096 : 1024, piece = 64 * KIB;
  size_t cap = count * piece;
  for (int i = 0; i < b->o.nsizes; i++) cap = PM__MAX(cap, b->o.sizes[i]);
  size_t top = 0;
  for (int i = 0; i < b->o.nsizes; i++) top = PM__MAX(top, b->o.sizes[i]);
  /* Progress counts groups of rows: a direction at a size, the movers, the contention rows, a
   * batch case. */
  b->steps = 3 * (unsigned long long)b->o.nsizes + (top >= 8 * MIB ? 2 : 0);
  for (size_t i = 0; i < sizeof bcases / sizeof bcases[0]; i++)
    b->steps += bc_wanted(b, bcases[i].name);

  /* The header comes before the set-up, which allocates and fills several buffers of the
   * largest size (seconds at 1 GiB). */
  if (!b->o.json) {
    pm__copy_cfg_t cfg;
    pm__copy_cfg(&cfg);
    char bounce[sizeof((pm_option_info_t *)0)->value], mover[sizeof bounce], batch[sizeof bounce];
    printf(
        "pinmem bench copy: backend %s, %d timed runs per case (median); copy engine: "
        "chunk %zu KiB, %d threads, %d ring slots, staging from %zu KiB, bounce %s, mover %s, "
        "batch %s, H2D pieces %zu KiB (0 = off) into %d slots\n",
        pm_backend_name(), b->o.repeat, cfg.chunk / KIB, cfg.threads, cfg.slots,
        cfg.stage_min / KIB, bc_opt_value("copy_bounce", bounce, sizeof bounce),
        bc_opt_value("copy_memcpy", mover, sizeof mover),
        bc_opt_value("copy_batch", batch, sizeof batch), cfg.piece / KIB, cfg.piece_slots);
  }
  if (!b->o.json) {
    cli_host_note(false, "these figures");
    if (!b->cuda)
      printf(
          "default sizes stop at 64 MiB here; managed_prefetch and zerocopy_mapped measure GPU "
          "features: n/a.\n");
    printf(
        "ratio: against the plain copy of the same kind of host memory (pinned for wc, "
        "zero-copy and managed).\n\n");
  }
  char capsz[32];
  cli_progress(0, b->steps, "allocating and filling the buffers (%s each)",
               cli_fmt_bytes(cap, capsz, sizeof capsz));
  bc_bench_setup(b, cap, true);
  if (!b->o.json) {
    cli_progress_clear();
    bc_print_header();
  }
  static const char *dirs[] = {"h2d", "d2h", "bidir"};
  for (int d = 0; d < 3; d++) {
    for (int s = 0; s < b->o.nsizes; s++) {
      run_group(b, dirs[d], b->o.sizes[s]);
    }
    if (!b->o.json) printf("\n");
  }

  /* The host's own ceiling for staging, at the largest size of the run. */
  if (top >= 8 * MIB) {
    bc_run_movers(b, top);
    b->steps_done++;
    bc_run_contention(b, top);
    b->steps_done++;
    if (!b->o.json) printf("\n");
  }

  for (size_t i = 0; i < sizeof bcases / sizeof bcases[0]; i++)
    if (bc_wanted(b, bcases[i].name)) run_batch(b, &bcases[i], count, piece);
  cli_progress_clear();
  if (b->o.json) cli_host_note(true, "these figures");
  print_targets(b, count * piece);
  bc_bench_teardown(b);
  bool failed = b->failed;
  free(b);
  if (failed) {
    fprintf(stderr, "pinmem: some copies delivered wrong bytes (see VERIFY FAILED above)\n");
    return CLI_EXIT_FAILURE;
  }
  return 0;
}
