/*
 * Private to the copy benchmarks (`pinmem bench copy` and `pinmem bench overlap`): the state
 * they share and the pieces more than one of their files uses. The files, by job:
 *
 *   bench_copy_common.c  options and --help, the byte pattern and its checks, buffers and
 *                        streams, the rows' text and JSON output, TARGET lines
 *   bench_copy.c         bench copy: the case table, the timed rounds, the batch rows, targets
 *   bench_movers.c       bench copy's host rows: the byte movers alone, and each half of
 *                        staging while the other runs (contention)
 *   bench_overlap.c      bench overlap
 *   bench_devices.c      bench copy --devices: several devices alone and all at once
 *
 * bc_: the copy benchmarks' shared functions (the CLI's own shared pieces are cli_, cli.h).
 */
#ifndef PINMEM_TOOLS_BENCH_COPY_H
#define PINMEM_TOOLS_BENCH_COPY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cli.h"
#include "copy_internal.h"
#include "kernels.h"

#if !defined(PINMEM_HAVE_CUDA)
/* The tool is not compiled with PINMEM_HAVE_CUDA; in cuda builds of the library this launcher
 * is linked in with the backend (kernels.cu). */
pm_status_t pm__launch_checksum(const void *dptr, size_t bytes, uint64_t *dresult,
                                struct CUstream_st *stream) __attribute__((weak));
#endif

#define KIB ((size_t)1 << 10)
#define MIB ((size_t)1 << 20)
#define GIB ((size_t)1 << 30)
#define FULL_VERIFY_MAX (256 * MIB)

/* ---- options (bench_copy_common.c) --------------------------------------------------------- */

typedef struct bopts {
  bool json, quiet;
  size_t sizes[32];
  int nsizes;
  int repeat;
  char cases[512]; /* ",name,name," or empty: all */
} bopts_t;

/* ---- shared state -------------------------------------------------------------------------- */

typedef struct result {
  char name[40];
  char dir[8];
  size_t bytes;
  double gbps;
  bool verified;
} result_t;

typedef struct bench {
  bopts_t o;
  bool cuda;
  bool have_checksum;
  size_t cap; /* buffer size */
  pm_stream_t s1, s2;
  pm_event_t e0, e1, ex;
  char *hsrc, *hdst;               /* pageable, pre-faulted */
  char *psrc, *pdst, *wsrc, *vbuf; /* pinned (pool) */
  char *msrc;                      /* mapped pinned */
  void *msrc_dev;
  char *d1, *d2;     /* device: d1 destination, d2 source (holds the pattern) */
  char *man;         /* managed */
  uint64_t *dres;    /* device word for the checksum kernel */
  uint64_t want_sum; /* host checksum of msrc[0, sum_bytes) */
  size_t sum_bytes;
  bool failed;
  result_t res[512];
  int nres;
  unsigned long long steps, steps_done; /* progress: groups of rows */
} bench_t;

/* ---- bench_copy_common.c ------------------------------------------------------------------- */

/* Shared start of both benchmarks: parse the options, start pinmem, fill the defaults. Returns
 * 0 with *out set, or the exit code (usage errors, out of memory). */
int bc_bench_begin(const char *name, int argc, char **argv, bench_t **out);
/* The buffers (cap bytes each; bench copy's destinations too when copy_bench), streams and
 * events, the sources filled with the pattern. */
void bc_bench_setup(bench_t *b, size_t cap, bool copy_bench);
void bc_bench_teardown(bench_t *b);

/* Check n bytes at cp against the pattern from offset `at`: all of them up to FULL_VERIFY_MAX,
 * else a sample. Returns "full" / "sampled", or NULL (and prints where) on a mismatch. */
const char *bc_pat_verify(const char *what, const void *cp, size_t n, uint64_t at);

const result_t *bc_find_result(const bench_t *b, const char *name, const char *dir, size_t bytes);
void bc_add_result(bench_t *b, const char *name, const char *dir, size_t bytes, double gbps,
                   bool verified);
void bc_sync_all(bench_t *b);
/* Pieces of the cases that several rows share: the plain H2D copy of n bytes from src into d1
 * on s1, clearing a host buffer or d1 (on s1) before a run, checking d1 after it. */
void bc_h2d_plain(bench_t *b, size_t n, const void *src);
void bc_clear_host(char *p, size_t n);
void bc_prep_d1(bench_t *b, size_t n);
const char *bc_v_d1(bench_t *b, size_t n, const char *what);
/* The end of a timed run begun with e0 recorded on s1: with two streams, s2's work joins s1
 * first; then e1 on s1, and the seconds between the two events once everything finished. */
double bc_end_timing(bench_t *b, bool two_streams);

/* The text table's row format and header. */
#define ROW_FMT "%-5s  %-13s  %-22s  %9s  %8s  %-8s  %s\n"
void bc_print_header(void);
/* One row of the text table; `size` is the size column's label, a NAN ratio prints "-". A case
 * that is not applicable on this backend prints "n/a" for its speed and ratio. */
void bc_text_row(const char *dir, const char *size, const char *name, double gbps, double ratio,
                 const char *path, bool ok, const char *method, bool applicable);
/* Whether --cases picked this row (all rows without --cases). */
bool bc_wanted(const bench_t *b, const char *name);
/* The option's current value (keyword options), for the record of a run. */
const char *bc_opt_value(const char *name, char *buf, size_t len);
/* The keys every bench copy row starts with (bench_copy_common.c says what each means). */
void bc_copy_row_json(cli_json_t *j, const char *name, const char *dir, size_t bytes,
                      double seconds, double gbps, bool ok, const char *method, double ratio,
                      const char *baseline, bool applicable);
/* One TARGET line: with the table on stdout, or on stderr with --json. */
void bc_target(const bench_t *b, const char *what, bool measured, bool met, const char *fig);

/* ---- bench_copy.c -------------------------------------------------------------------------- */

/* Every row name --cases can pick, in the table's order (the case table, the byte movers, the
 * contention rows, the batch rows). */
int bc_case_names(const char **out, int max);

/* ---- bench_movers.c ------------------------------------------------------------------------ */

extern const char *const bc_mover_names[3];
extern const char *const bc_contention_names[4];
/* The host's share of staging at the size n: the byte movers alone (rows memcpy_*), then each
 * half of staging while the other runs (the contention rows). */
void bc_run_movers(bench_t *b, size_t n);
void bc_run_contention(bench_t *b, size_t n);

/* ---- bench_devices.c ----------------------------------------------------------------------- */

/* `bench copy --devices LIST|all`: each device alone and all at once (bench_devices.c). */
int bc_bench_devices(const char *list, bool json, size_t bytes, int repeat);

#endif /* PINMEM_TOOLS_BENCH_COPY_H */
