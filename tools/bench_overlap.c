/*
 * `pinmem bench overlap`: does a copy run under a kernel?
 *
 * A copy of N bytes and a busy kernel as long as the pinned copy, the kernel
 * issued first (as a training step issues its compute before the next batch's copy): on one
 * stream, from pinned memory on two streams, from pageable memory with the plain copy on two
 * streams (it holds the calling thread), and with pinmem's staged copy on two streams. Each total
 * is reported against max(copy alone, kernel alone).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_copy_common.h"

/* pinmem's target (cuda backend). */
#define T_OVERLAP_RATIO 1.05

/* ---- pinmem bench overlap
 * ------------------------------------------------------------------------ */

typedef enum { OV_PINNED, OV_PAGEABLE, OV_STAGED } ov_copy_t;

static void ov_copy(bench_t *b, ov_copy_t kind, size_t n, pm_stream_t s) {
  if (kind == OV_PINNED)
    cli_check(pm_copy_async(b->d1, b->psrc, n, s, NULL, NULL));
  else if (kind == OV_PAGEABLE)
    cli_check(pm_memcpy_async(b->d1, b->hsrc, n, PM_COPY_H2D, s));
  else
    cli_check(pm_copy_async(b->d1, b->hsrc, n, s, NULL, NULL));
}

/* Seconds from e0 (on s1) to the end of the work issued by fn on s1 and s2. */
typedef struct ov_run {
  bool copy;
  ov_copy_t kind;
  bool kernel;
  bool two_streams;
} ov_run_t;

static double ov_time(bench_t *b, const ov_run_t *r, size_t n, double kernel_s, bool *ok,
                      const char *what) {
  cli_check(pm_device_memset_async(b->d1, 0, n, b->s1));
  bc_sync_all(b);
  cli_check(pm_event_record(b->e0, b->s1));
  cli_check(pm_stream_wait_event(b->s2, b->e0));
  /* The kernel is issued first, as a training step issues its compute before the next batch's
   * copy: a kernel launch returns at once, while a copy from pageable memory (plain or staged)
   * holds the calling thread, so issued the other way round the kernel could only start after
   * the copy's host work and no pageable row could overlap at all. */
  if (r->kernel) cli_check(pm_launch_busy(r->two_streams ? b->s2 : b->s1, kernel_s));
  if (r->copy) ov_copy(b, r->kind, n, b->s1);
  double s = bc_end_timing(b, true);
  if (r->copy) {
    cli_check(pm_memcpy(b->vbuf, b->d1, n, PM_COPY_D2H));
    if (!bc_pat_verify(what, b->vbuf, n, 0)) {
      *ok = false;
      b->failed = true;
    }
  }
  return s;
}

static double ov_median(bench_t *b, const ov_run_t *r, size_t n, double kernel_s, bool *ok,
                        const char *what) {
  int runs = b->o.repeat;
  double *t = cli_xmalloc(sizeof(double) * (size_t)runs);
  cli_progress(b->steps_done, b->steps, "%s, warm-up", what);
  (void)ov_time(b, r, n, kernel_s, ok, what); /* warm-up */
  for (int i = 0; i < runs; i++) {
    cli_progress(b->steps_done, b->steps, "%s, run %d/%d", what, i + 1, runs);
    t[i] = ov_time(b, r, n, kernel_s, ok, what);
  }
  b->steps_done++;
  double m = cli_median(t, runs);
  free(t);
  return m;
}

/* One size: the copies alone, then beside the kernel; false when bytes arrived wrong. */
static bool overlap_at(bench_t *b, size_t n) {
  b->steps = 8; /* four cases alone, four together */
  b->steps_done = 0;
  bc_bench_setup(b, n, false);

  bool ok = true;
  /* The copies alone, and a kernel as long as the pinned copy. */
  ov_run_t alone_pinned = {true, OV_PINNED, false, true},
           alone_pageable = {true, OV_PAGEABLE, false, true},
           alone_staged = {true, OV_STAGED, false, true};
  double t_pinned = ov_median(b, &alone_pinned, n, 0, &ok, "pinned copy alone");
  double t_pageable = ov_median(b, &alone_pageable, n, 0, &ok, "pageable copy alone");
  double t_staged = ov_median(b, &alone_staged, n, 0, &ok, "staged copy alone");
  double kernel_s = t_pinned;
  ov_run_t alone_kernel = {false, OV_PINNED, true, true};
  double t_kernel = ov_median(b, &alone_kernel, n, kernel_s, &ok, "kernel alone");

  struct {
    const char *name;
    ov_run_t run;
    double copy_alone;
  } ov[] = {
      {"serial_one_stream", {true, OV_PINNED, true, false}, t_pinned},
      {"pinned_two_streams", {true, OV_PINNED, true, true}, t_pinned},
      {"pageable_plain_two_streams", {true, OV_PAGEABLE, true, true}, t_pageable},
      {"pageable_pinmem_two_streams", {true, OV_STAGED, true, true}, t_staged},
  };
  char sz[32];
  cli_fmt_bytes(n, sz, sizeof sz);
  if (!b->o.json) {
    cli_progress_clear();
    printf(
        "pinmem bench overlap: backend %s, copy of %s H2D + a busy kernel of %.3f ms, copy "
        "issued first, median of %d runs\n",
        pm_backend_name(), sz, kernel_s * 1e3, b->o.repeat);
    cli_host_note(false, "these figures");
    if (!b->cuda) printf("(the kernel is a sleep on the stream's thread: the ordering is real)\n");
    printf(
        "copy alone: pinned %.3f ms, pageable (plain) %.3f ms, pageable (pinmem) %.3f ms; "
        "kernel alone %.3f ms\n\n",
        t_pinned * 1e3, t_pageable * 1e3, t_staged * 1e3, t_kernel * 1e3);
    printf("%-28s  %10s  %14s  %12s  %s\n", "case", "total ms", "max(copy,kern)", "total/max",
           "verified");
  }
  double pinned_ratio = NAN;
  for (size_t i = 0; i < sizeof ov / sizeof ov[0]; i++) {
    bool case_ok = true;
    char what[96];
    snprintf(what, sizeof what, "%s", ov[i].name);
    double total = ov_median(b, &ov[i].run, n, kernel_s, &case_ok, what);
    double mx = PM__MAX(ov[i].copy_alone, t_kernel);
    double ratio = total / mx;
    if (!strcmp(ov[i].name, "pinned_two_streams")) pinned_ratio = case_ok ? ratio : NAN;
    ok = ok && case_ok;
    if (b->o.json) {
      cli_json_t j;
      cli_json_row(&j, "overlap", ov[i].name, n, total, (double)n / total / 1e9);
      cli_json_bool(&j, "verified", case_ok);
      cli_json_str(&j, "verify_method", n <= FULL_VERIFY_MAX ? "full" : "sampled");
      cli_json_double(&j, "copy_seconds", ov[i].copy_alone);
      cli_json_double(&j, "kernel_seconds", t_kernel);
      cli_json_double(&j, "ratio_vs_max", ratio);
      cli_json_str(&j, "timing", "events");
      cli_json_int(&j, "runs", b->o.repeat);
      cli_json_str(&j, "backend", pm_backend_name());
      cli_json_end(&j);
    } else {
      cli_progress_clear();
      printf("%-28s  %10.3f  %14.3f  %11.3fx  %s\n", ov[i].name, total * 1e3, mx * 1e3, ratio,
             case_ok ? (n <= FULL_VERIFY_MAX ? "full" : "sampled") : "NO (FAILED)");
    }
  }
  {
    char fig[96];
    snprintf(fig, sizeof fig, "%.3fx", pinned_ratio);
    cli_progress_clear();
    if (b->o.json) cli_host_note(true, "these figures");
    fprintf(b->o.json ? stderr : stdout, "\n");
    bc_target(b, "pinned copy + equal kernel on two streams <= 1.05x max(copy, kernel)", true,
              pinned_ratio <= T_OVERLAP_RATIO, fig);
  }
  bc_bench_teardown(b);
  return ok;
}

int pm_cli_bench_overlap(int argc, char **argv) {
  bench_t *b = NULL;
  int rc = bc_bench_begin("overlap", argc, argv, &b);
  if (rc) return rc;
  bool ok = true;
  if (!b->o.nsizes) {
    b->o.sizes[0] = b->cuda ? 256 * MIB : 64 * MIB;
    b->o.nsizes = 1;
  }
  bopts_t o = b->o;
  for (int i = 0; i < o.nsizes; i++) {
    /* Each size starts from a clean state: teardown frees the buffers but keeps the pointers. */
    memset(b, 0, sizeof *b);
    b->o = o;
    b->cuda = pm_backend_kind() == PM_BACKEND_CUDA;
    if (i && !o.json) printf("\n");
    ok = overlap_at(b, o.sizes[i]) && ok;
  }
  free(b);
  if (!ok) {
    fprintf(stderr, "pinmem: some copies delivered wrong bytes (see VERIFY FAILED above)\n");
    return CLI_EXIT_FAILURE;
  }
  return 0;
}
