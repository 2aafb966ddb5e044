/*
 * `pinmem bench copy` and `pinmem bench overlap`: what pinned memory and pinmem's copy engine buy
 * for host<->device copies, side by side in one run.
 *
 * bench copy: for each size and for H2D, D2H and both at once (two streams), the plain backend
 * copy (cudaMemcpyAsync) from pageable, pinned and write-combined pinned memory, pinmem's
 * pm_copy_async from pageable memory (staged; also forced through the ring, and H2D through the
 * slab layout of copy_piece) and from pinned memory, a kernel reading mapped
 * (zero-copy) pinned memory, and managed-memory prefetch. Then 4096 x 64 KiB pieces in one
 * pm_copy_batch_async against a loop of plain copies.
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
 *
 * bench overlap: a copy of N bytes and a busy kernel as long as the pinned copy, the kernel
 * issued first (as a training step issues its compute before the next batch's copy): on one
 * stream, from pinned memory on two streams, from pageable memory with the plain copy on two
 * streams (it holds the calling thread), and with pinmem's staged copy on two streams. Each total is reported against
 * max(copy alone, kernel alone).
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
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
#define INNER_BYTES (64 * MIB) /* small copies repeat within a run up to this many bytes */
#define INNER_MAX 256
#define PAT_SEED 0x5DEECE66Dull

/* pinmem's targets (cuda backend). */
#define T_PINNED_RATIO 0.99
#define T_PINNED_MIN_BYTES (8 * MIB)
#define T_PAGEABLE_H2D_GBPS 50.0
#define T_PAGEABLE_H2D_RATIO 5.0
#define T_PAGEABLE_D2H_GBPS 45.0
#define T_BIDIR_GBPS 100.0
#define T_BATCH_GBPS 40.0
#define T_OVERLAP_RATIO 1.05

/* ---- argument parsing ------------------------------------------------------------------------ */

typedef struct bopts {
  bool json;
  size_t sizes[32];
  int nsizes;
  int repeat;
  size_t bytes;    /* overlap */
  char cases[512]; /* ",name,name," or empty: all */
} bopts_t;

static int usage(const char *cmd, const char *fmt, const char *arg) {
  fprintf(stderr, "pinmem: ");
  fprintf(stderr, fmt, arg);
  fprintf(stderr, "\nusage: pinmem bench %s\n", cmd);
  return CLI_EXIT_USAGE;
}

/* 0 ok, else the exit code. */
static int parse_args(const char *cmd, int argc, char **argv, bopts_t *o) {
  static const char *copy_usage = "copy [--json] [--sizes LIST] [--repeat N] [--cases LIST]";
  static const char *ov_usage = "overlap [--json] [--bytes SIZE] [--repeat N]";
  bool is_copy = strcmp(cmd, "copy") == 0;
  const char *u = is_copy ? copy_usage : ov_usage;
  memset(o, 0, sizeof *o);
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *val = NULL;
    const char *eq = strncmp(a, "--", 2) == 0 ? strchr(a, '=') : NULL;
    size_t nl = eq ? (size_t)(eq - a) : strlen(a);
    if (strcmp(a, "--json") == 0) {
      o->json = true;
      continue;
    }
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      printf("usage: pinmem bench %s\n", u);
      exit(0);
    }
    bool sizes = is_copy && nl == 7 && strncmp(a, "--sizes", 7) == 0;
    bool repeat = nl == 8 && strncmp(a, "--repeat", 8) == 0;
    bool bytes = !is_copy && nl == 7 && strncmp(a, "--bytes", 7) == 0;
    bool cases = is_copy && nl == 7 && strncmp(a, "--cases", 7) == 0;
    if (!sizes && !repeat && !bytes && !cases) return usage(u, "unknown argument '%s'", a);
    if (eq) {
      val = eq + 1;
    } else {
      if (i + 1 >= argc) return usage(u, "%s needs a value", a);
      val = argv[++i];
    }
    if (repeat) {
      char *end;
      long v = strtol(val, &end, 10);
      if (end == val || *end || v < 1 || v > 10000)
        return usage(u, "--repeat wants a whole number from 1 to 10000, not '%s'", val);
      o->repeat = (int)v;
    } else if (cases) {
      if (strlen(val) + 3 > sizeof o->cases) return usage(u, "--cases: list too long: '%s'", val);
      snprintf(o->cases, sizeof o->cases, ",%s,", val);
    } else if (bytes) {
      if (pm_parse_size(val, &o->bytes) != PM_OK || o->bytes == 0)
        return usage(u, "--bytes: bad size '%s'", val);
    } else {
      char *copy = cli_xstrdup(val), *save = NULL;
      for (char *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        size_t v;
        if (o->nsizes == 32 || pm_parse_size(t, &v) != PM_OK || v == 0) {
          free(copy);
          return usage(u, "--sizes: bad or too many sizes in '%s'", val);
        }
        o->sizes[o->nsizes++] = v;
      }
      free(copy);
      if (o->nsizes == 0) return usage(u, "--sizes: no sizes in '%s'", val);
    }
  }
  return 0;
}

/* ---- the byte pattern and its checks ----------------------------------------------------------
 */

/* Byte k of the pattern is byte k % 8 (little-endian) of pat_word(k / 8): any range of any
 * buffer can be checked against its absolute offset without a reference copy. */
static inline uint64_t pat_word(uint64_t i) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + PAT_SEED;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

static inline unsigned char pat_byte(uint64_t k) {
  return (unsigned char)(pat_word(k / 8) >> (8 * (k % 8)));
}

#define PAT_PIECE (16 * MIB)

typedef struct pat_job {
  char *p;
  const char *cp;
  size_t n;
  uint64_t at;       /* pattern offset of p[0] */
  atomic_ullong bad; /* first bad offset + 1, or 0 */
} pat_job_t;

static void pat_fill_piece(void *vctx, size_t i) {
  pat_job_t *j = vctx;
  size_t lo = i * PAT_PIECE, hi = PM__MIN(j->n, lo + PAT_PIECE);
  for (size_t k = lo; k < hi;) {
    uint64_t abs = j->at + k;
    if (abs % 8 == 0 && k + 8 <= hi) {
      uint64_t w = pat_word(abs / 8);
      memcpy(j->p + k, &w, 8);
      k += 8;
    } else {
      j->p[k] = (char)pat_byte(abs);
      k++;
    }
  }
}

static void pat_fill(void *p, size_t n, uint64_t at) {
  pat_job_t j = {.p = p, .n = n, .at = at};
  atomic_init(&j.bad, 0);
  pm__parallel_for(pm__cpu_count(), (n + PAT_PIECE - 1) / PAT_PIECE, pat_fill_piece, &j);
}

/* First offset in [lo, hi) of cp that differs from the pattern, or SIZE_MAX. */
static size_t pat_check_span(const char *cp, size_t lo, size_t hi, uint64_t at) {
  for (size_t k = lo; k < hi;) {
    uint64_t abs = at + k;
    if (abs % 8 == 0 && k + 8 <= hi) {
      uint64_t w;
      memcpy(&w, cp + k, 8);
      if (w != pat_word(abs / 8)) {
        for (size_t b = 0; b < 8; b++)
          if ((unsigned char)cp[k + b] != pat_byte(abs + b)) return k + b;
      }
      k += 8;
    } else {
      if ((unsigned char)cp[k] != pat_byte(abs)) return k;
      k++;
    }
  }
  return SIZE_MAX;
}

static void pat_check_piece(void *vctx, size_t i) {
  pat_job_t *j = vctx;
  size_t lo = i * PAT_PIECE, hi = PM__MIN(j->n, lo + PAT_PIECE);
  size_t at = pat_check_span(j->cp, lo, hi, j->at);
  if (at != SIZE_MAX) {
    unsigned long long want = 0, v = (unsigned long long)at + 1;
    while (!atomic_compare_exchange_weak(&j->bad, &want, v))
      if (want && want <= v) break;
  }
}

/* Check n bytes at cp against the pattern from offset `at`: all of them up to FULL_VERIFY_MAX,
 * else a sample. Returns "full" / "sampled", or NULL (and prints where) on a mismatch. */
static const char *pat_verify(const char *what, const void *cp, size_t n, uint64_t at) {
  pat_job_t j = {.cp = cp, .n = n, .at = at};
  atomic_init(&j.bad, 0);
  const char *method;
  if (n <= FULL_VERIFY_MAX) {
    pm__parallel_for(pm__cpu_count(), (n + PAT_PIECE - 1) / PAT_PIECE, pat_check_piece, &j);
    method = "full";
  } else {
    size_t edge = 64 * KIB;
    size_t bad = pat_check_span(cp, 0, edge, at);
    if (bad == SIZE_MAX) bad = pat_check_span(cp, n - edge, n, at);
    uint64_t x = 0x2545F4914F6CDD1Dull ^ n;
    for (int w = 0; w < 4096 && bad == SIZE_MAX; w++) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      size_t lo = (size_t)(x % (n - 4 * KIB));
      bad = pat_check_span(cp, lo, lo + 4 * KIB, at);
    }
    if (bad != SIZE_MAX) atomic_store(&j.bad, (unsigned long long)bad + 1);
    method = "sampled";
  }
  unsigned long long b = atomic_load(&j.bad);
  if (b) {
    size_t k = (size_t)(b - 1);
    fprintf(stderr, "pinmem: VERIFY FAILED: %s: byte %zu of %zu is 0x%02x, expected 0x%02x\n", what,
            k, n, ((const unsigned char *)cp)[k], pat_byte(at + k));
    return NULL;
  }
  return method;
}

/* ---- shared state -----------------------------------------------------------------------------
 */

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
} bench_t;

static const result_t *find_result(const bench_t *b, const char *name, const char *dir,
                                   size_t bytes) {
  for (int i = 0; i < b->nres; i++)
    if (!strcmp(b->res[i].name, name) && !strcmp(b->res[i].dir, dir) && b->res[i].bytes == bytes)
      return &b->res[i];
  return NULL;
}

static void add_result(bench_t *b, const char *name, const char *dir, size_t bytes, double gbps,
                       bool verified) {
  if (b->nres == (int)(sizeof b->res / sizeof b->res[0])) return;
  result_t *r = &b->res[b->nres++];
  snprintf(r->name, sizeof r->name, "%s", name);
  snprintf(r->dir, sizeof r->dir, "%s", dir);
  r->bytes = bytes;
  r->gbps = gbps;
  r->verified = verified;
}

static void sync_all(bench_t *b) {
  cli_check(pm_stream_synchronize(b->s1));
  cli_check(pm_stream_synchronize(b->s2));
}

static void *pinned(size_t n, unsigned flags) {
  void *p;
  cli_check(pm_host_alloc(NULL, n, flags, &p));
  return p;
}

static void *pageable(size_t n) {
  char *p = cli_xmalloc(n);
  memset(p, 0, n); /* fault the pages in now, not inside a timed run */
  return p;
}

static void *device(size_t n) {
  void *p;
  cli_check(pm_device_alloc(n, &p));
  return p;
}

static void bench_setup(bench_t *b, size_t cap, bool copy_bench) {
  b->cap = cap;
  cli_check(pm_stream_create(&b->s1));
  cli_check(pm_stream_create(&b->s2));
  cli_check(pm_event_create(PM_EVENT_TIMING, &b->e0));
  cli_check(pm_event_create(PM_EVENT_TIMING, &b->e1));
  cli_check(pm_event_create(PM_EVENT_DEFAULT, &b->ex));
  b->hsrc = pageable(cap);
  b->psrc = pinned(cap, PM_HOST_DEFAULT);
  b->vbuf = pinned(cap, PM_HOST_DEFAULT);
  b->d1 = device(cap);
  pat_fill(b->hsrc, cap, 0);
  pat_fill(b->psrc, cap, 0);
  if (!copy_bench) return;
  b->hdst = pageable(cap);
  b->pdst = pinned(cap, PM_HOST_DEFAULT);
  b->wsrc = pinned(cap, PM_HOST_WRITE_COMBINED);
  b->d2 = device(cap);
  b->man = NULL;
  pat_fill(b->wsrc, cap, 0);
  cli_check(pm_memcpy(b->d2, b->psrc, cap, PM_COPY_H2D));
  if (pm_managed_alloc(cap, (void **)&b->man) == PM_OK)
    pat_fill(b->man, cap, 0);
  else
    b->man = NULL;
#if defined(PINMEM_HAVE_CUDA)
  b->have_checksum = b->cuda;
#else
  b->have_checksum = b->cuda && pm__launch_checksum != NULL;
#endif
  if (b->have_checksum) {
    b->msrc = pinned(cap, PM_HOST_MAPPED);
    pat_fill(b->msrc, cap, 0);
    cli_check(pm_host_device_pointer(b->msrc, &b->msrc_dev));
    b->dres = device(sizeof(uint64_t));
  }
}

static void bench_teardown(bench_t *b) {
  sync_all(b);
  free(b->hsrc);
  free(b->hdst);
  pm_host_free(b->psrc);
  pm_host_free(b->pdst);
  pm_host_free(b->wsrc);
  pm_host_free(b->vbuf);
  pm_host_free(b->msrc);
  pm_device_free(b->d1);
  pm_device_free(b->d2);
  pm_device_free(b->dres);
  if (b->man) pm_managed_free(b->man);
  pm_event_destroy(b->e0);
  pm_event_destroy(b->e1);
  pm_event_destroy(b->ex);
  pm_stream_destroy(b->s1);
  pm_stream_destroy(b->s2);
}

/* ---- cases ------------------------------------------------------------------------------------
 */

typedef void (*op_fn)(bench_t *b, size_t n);
typedef const char *(*verify_fn)(bench_t *b, size_t n, const char *what);
typedef void (*prep_fn)(bench_t *b, size_t n);

static void h2d_plain(bench_t *b, size_t n, const void *src) {
  cli_check(pm_memcpy_async(b->d1, src, n, PM_COPY_H2D, b->s1));
}
static void d2h_plain(bench_t *b, size_t n, void *dst, pm_stream_t s) {
  cli_check(pm_memcpy_async(dst, b->d2, n, PM_COPY_D2H, s));
}

static void op_h2d_plain_pageable(bench_t *b, size_t n) {
  h2d_plain(b, n, b->hsrc);
}
static void op_h2d_plain_pinned(bench_t *b, size_t n) {
  h2d_plain(b, n, b->psrc);
}
static void op_h2d_plain_wc(bench_t *b, size_t n) {
  h2d_plain(b, n, b->wsrc);
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
  h2d_plain(b, n, b->hsrc);
}
static void op_bi_plain_pinned(bench_t *b, size_t n) {
  d2h_plain(b, n, b->pdst, b->s2);
  h2d_plain(b, n, b->psrc);
}
static void op_bi_pinmem_pageable(bench_t *b, size_t n) {
  cli_check(pm_copy_async(b->hdst, b->d2, n, b->s2, NULL, NULL));
  cli_check(pm_copy_async(b->d1, b->hsrc, n, b->s1, NULL, NULL));
}
static void op_bi_pinmem_pinned(bench_t *b, size_t n) {
  cli_check(pm_copy_async(b->pdst, b->d2, n, b->s2, NULL, NULL));
  cli_check(pm_copy_async(b->d1, b->psrc, n, b->s1, NULL, NULL));
}

static void clear_host(char *p, size_t n) {
  memset(p, 0, n);
}

static void prep_d1(bench_t *b, size_t n) {
  cli_check(pm_device_memset_async(b->d1, 0, n, b->s1));
}
static void prep_hdst(bench_t *b, size_t n) {
  clear_host(b->hdst, n);
}
static void prep_pdst(bench_t *b, size_t n) {
  clear_host(b->pdst, n);
}
static void prep_bi_pageable(bench_t *b, size_t n) {
  prep_d1(b, n);
  prep_hdst(b, n);
}
static void prep_bi_pinned(bench_t *b, size_t n) {
  prep_d1(b, n);
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

static const char *v_d1(bench_t *b, size_t n, const char *what) {
  cli_check(pm_memcpy(b->vbuf, b->d1, n, PM_COPY_D2H));
  return pat_verify(what, b->vbuf, n, 0);
}
static const char *v_hdst(bench_t *b, size_t n, const char *what) {
  return pat_verify(what, b->hdst, n, 0);
}
static const char *v_pdst(bench_t *b, size_t n, const char *what) {
  return pat_verify(what, b->pdst, n, 0);
}
static const char *v_bi_pageable(bench_t *b, size_t n, const char *what) {
  const char *m = v_d1(b, n, what);
  return m && v_hdst(b, n, what) ? m : NULL;
}
static const char *v_bi_pinned(bench_t *b, size_t n, const char *what) {
  const char *m = v_d1(b, n, what);
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
  return pat_verify(what, b->man, n, 0);
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
    {"plain_pageable", "h2d", NULL, op_h2d_plain_pageable, prep_d1, v_d1, 0, false},
    {"plain_pinned", "h2d", NULL, op_h2d_plain_pinned, prep_d1, v_d1, 0, false},
    {"plain_wc_pinned", "h2d", "plain_pinned", op_h2d_plain_wc, prep_d1, v_d1, 0, false},
    {"pinmem_pageable", "h2d", "plain_pageable", op_h2d_pinmem_pageable, prep_d1, v_d1, 0, true},
    {"pinmem_pageable_ring", "h2d", "plain_pageable", op_h2d_pinmem_pageable_ring, prep_d1, v_d1, 0,
     true},
    {"pinmem_pageable_units", "h2d", "plain_pageable", op_h2d_pinmem_pageable_units, prep_d1, v_d1,
     0, true},
    {"pinmem_pinned", "h2d", "plain_pinned", op_h2d_pinmem_pinned, prep_d1, v_d1, 0, true},
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

static void fmt_gbps(double v, char *buf, size_t len) {
  if (isfinite(v))
    snprintf(buf, len, "%.2f", v);
  else
    snprintf(buf, len, "-");
}

#define ROW_FMT "%-5s  %-13s  %-22s  %9s  %8s  %-8s  %s\n"

static void print_header(void) {
  printf(ROW_FMT, "dir", "size", "case", "GB/s", "ratio", "path", "verified");
}

/* One row of the text table; `size` is the size column's label, a NAN ratio prints "-". */
static void text_row(const char *dir, const char *size, const char *name, double gbps,
                     double ratio, const char *path, bool ok, const char *method) {
  char g[32], ra[32];
  fmt_gbps(gbps, g, sizeof g);
  if (isfinite(ratio))
    snprintf(ra, sizeof ra, "%.2fx", ratio);
  else
    snprintf(ra, sizeof ra, "-");
  printf(ROW_FMT, dir, size, name, g, ra, path, ok ? method : "NO (FAILED)");
  fflush(stdout);
}

static bool wanted(const bench_t *b, const char *name) {
  if (!b->o.cases[0]) return true;
  char key[64];
  snprintf(key, sizeof key, ",%s,", name);
  return strstr(b->o.cases, key) != NULL;
}

/* The option's current value (keyword options), for the record of a run. */
static const char *opt_value(const char *name, char *buf, size_t len) {
  pm_option_info_t oi;
  snprintf(buf, len, "%s", pm_option_find(name, &oi) == PM_OK ? oi.value : "?");
  return buf;
}

/* The copy engine's configuration as it stands, in every row, so a result file says what it
 * measured (rows that force a layout or a batch mode say so in their case name). */
static void copy_cfg_json(cli_json_t *j) {
  pm__copy_cfg_t cfg;
  pm__copy_cfg(&cfg);
  char v[sizeof((pm_option_info_t *)0)->value];
  cli_json_uint(j, "copy_chunk", cfg.chunk);
  cli_json_int(j, "copy_slots", cfg.slots);
  cli_json_int(j, "copy_threads", cfg.threads);
  cli_json_uint(j, "copy_stage_min", cfg.stage_min);
  cli_json_str(j, "copy_bounce", opt_value("copy_bounce", v, sizeof v));
  cli_json_str(j, "copy_memcpy", opt_value("copy_memcpy", v, sizeof v));
  cli_json_str(j, "copy_batch", opt_value("copy_batch", v, sizeof v));
  cli_json_uint(j, "copy_piece", cfg.piece);
  cli_json_int(j, "copy_piece_slots", cfg.piece_slots);
}

/* The keys every bench copy row starts with; `verified` names the check ("full", "sampled",
 * "checksum") or is false. */
static void copy_row_json(cli_json_t *j, const char *name, const char *dir, size_t bytes,
                          double seconds, double gbps, bool ok, const char *method, double ratio,
                          const char *baseline) {
  cli_json_row(j, "copy", name, bytes, seconds, gbps);
  cli_json_str(j, "dir", dir);
  if (ok)
    cli_json_str(j, "verified", method);
  else
    cli_json_bool(j, "verified", false);
  cli_json_double(j, "ratio_vs_plain", ratio);
  cli_json_str(j, "baseline", baseline);
  copy_cfg_json(j);
}

/* Why a case cannot run here, or NULL. */
static const char *case_skip(const bench_t *b, const ccase_t *c) {
  if (c->need == 1 && !b->have_checksum)
    return b->cuda ? "the device checksum kernel is not in this build"
                   : "needs a device kernel (cuda backend)";
  if (c->need == 2 && !b->man) return "managed memory is not available here";
  return NULL;
}

static void report_skip(const bench_t *b, const ccase_t *c, size_t n, const char *skip) {
  char sz[32];
  cli_fmt_bytes(n, sz, sizeof sz);
  size_t moved = strcmp(c->dir, "bidir") == 0 ? 2 * n : n;
  if (b->o.json) {
    cli_json_t j;
    cli_json_row(&j, "copy", c->name, moved, NAN, NAN);
    cli_json_str(&j, "dir", c->dir);
    cli_json_bool(&j, "verified", false);
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

/* The end of a timed run begun with e0 recorded on s1: with two streams, s2's work joins s1
 * first; then e1 on s1, and the seconds between the two events once everything finished. */
static double end_timing(bench_t *b, bool two_streams) {
  if (two_streams) {
    cli_check(pm_event_record(b->ex, b->s2));
    cli_check(pm_stream_wait_event(b->s1, b->ex));
  }
  cli_check(pm_event_record(b->e1, b->s1));
  cli_check(pm_event_synchronize(b->e1));
  sync_all(b);
  double s;
  cli_check(pm_event_elapsed(b->e0, b->e1, &s));
  return s;
}

/* One run of a case: `inner` copies between two events, then the bytes verified. Returns the
 * seconds per copy. */
static double time_once(bench_t *b, case_runs_t *cr, size_t n) {
  const ccase_t *c = cr->c;
  bool bidir = strcmp(c->dir, "bidir") == 0;
  c->prep(b, n);
  sync_all(b);
  cli_check(pm_event_record(b->e0, b->s1));
  if (bidir) cli_check(pm_stream_wait_event(b->s2, b->e0));
  for (int k = 0; k < cr->inner; k++) c->op(b, n);
  double s = end_timing(b, bidir);
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
    const result_t *br = find_result(b, base, c->dir, moved);
    if (br && br->gbps > 0) ratio = gbps / br->gbps;
  }
  add_result(b, c->name, c->dir, moved, gbps, cr->ok);

  if (b->o.json) {
    cli_json_t j;
    copy_row_json(&j, c->name, c->dir, moved, med, gbps, cr->ok, cr->method, ratio, base);
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
    text_row(c->dir, sz, c->name, gbps, ratio, path, cr->ok, cr->method);
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
    if (strcmp(c->dir, dir) != 0 || !wanted(b, c->name)) continue;
    order[all++] = c;
    if (case_skip(b, c)) continue;
    case_runs_t *r = &cr[m++];
    r->c = c;
    r->t = cli_xmalloc(sizeof(double) * (size_t)runs);
    /* A managed prefetch moves the pages once: a second prefetch to where they already are
     * does nothing, so repeating it inside a run would time no-ops (and report more than the
     * link can carry). One prefetch per run, small sizes included. */
    r->inner = (n >= INNER_BYTES || c->need == 2)
                   ? 1
                   : (int)PM__MIN((size_t)INNER_MAX, INNER_BYTES / n);
    r->method = "full";
    r->ok = true;
    snprintf(r->what, sizeof r->what, "%s %s %s", c->dir, sz, c->name);
  }
  for (int i = 0; i < m; i++) (void)time_once(b, &cr[i], n); /* warm-up */
  for (int round = 0; round < runs; round++)
    for (int k = 0; k < m; k++) {
      case_runs_t *r = &cr[(k + round) % m];
      r->t[round] = time_once(b, r, n);
    }
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
    if (h2d)
      prep_d1(b, total);
    else
      clear_host(host, total);
    sync_all(b);
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
      if (!pat_verify(what, got + doff, piece, soff)) ok = false;
    }
    if (!ok) b->failed = true;
  }
  double med = cli_median(t, runs);
  free(t);
  double gbps = (double)total / med / 1e9;
  char base[40];
  snprintf(base, sizeof base, "%s", bc->name);
  char *us = strrchr(base, '_');
  if (us) strcpy(us, "_loop");
  double ratio = NAN;
  const result_t *br = find_result(b, base, bc->dir, total);
  if (br && bc->engine && br->gbps > 0) ratio = gbps / br->gbps;
  add_result(b, bc->name, bc->dir, total, gbps, ok);
  if (b->o.json) {
    cli_json_t j;
    copy_row_json(&j, bc->name, bc->dir, total, med, gbps, ok, method, ratio,
                  bc->engine ? base : NULL);
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
    text_row(bc->dir, label, bc->name, gbps, ratio, bc->engine ? "batch" : "loop", ok, method);
  }
  free(it);
  free(perm);
}

/* ---- the host's share: pageable -> pinned memcpy ------------------------------------------------
 */

/* A staged H2D copy can go no faster than its threads move pageable bytes into pinned memory.
 * These rows measure that alone (no device involved), once per byte mover of copy_memcpy, with
 * copy_threads threads in copy_chunk pieces, timed by the wall clock. */
typedef struct mv_job {
  char *dst;
  const char *src;
  size_t n, piece;
  int mode;
} mv_job_t;

static void mv_piece(void *vctx, size_t i) {
  const mv_job_t *j = vctx;
  size_t off = i * j->piece;
  pm__memcpy_mode(j->dst + off, j->src + off, PM__MIN(j->piece, j->n - off), j->mode);
}

static void run_movers(bench_t *b, size_t n) {
  static const struct {
    const char *name;
    int mode;
  } mv[] = {{"memcpy_libc", PM__MEMCPY_LIBC},
            {"memcpy_movsb", PM__MEMCPY_MOVSB},
            {"memcpy_stream", PM__MEMCPY_STREAM}};
  static const char *mode_names[] = {"libc", "movsb", "stream"};
  pm__copy_cfg_t cfg;
  pm__copy_cfg(&cfg);
  for (size_t m = 0; m < sizeof mv / sizeof mv[0]; m++) {
    if (!wanted(b, mv[m].name)) continue;
    mv_job_t job = {b->pdst, b->hsrc, n, cfg.chunk, mv[m].mode};
    size_t pieces = (n + cfg.chunk - 1) / cfg.chunk;
    int runs = b->o.repeat;
    double *t = cli_xmalloc(sizeof(double) * (size_t)runs);
    bool ok = true;
    const char *method = "full";
    char what[96];
    snprintf(what, sizeof what, "h2h %s", mv[m].name);
    for (int r = -1; r < runs; r++) {
      clear_host(b->pdst, n);
      double t0 = pm__now();
      pm__parallel_for(cfg.threads, pieces, mv_piece, &job);
      double dt = pm__now() - t0;
      if (r >= 0) t[r] = dt;
      const char *v = pat_verify(what, b->pdst, n, 0);
      if (!v)
        ok = false;
      else
        method = v;
    }
    if (!ok) b->failed = true;
    double med = cli_median(t, runs);
    free(t);
    double gbps = (double)n / med / 1e9;
    add_result(b, mv[m].name, "h2h", n, gbps, ok);
    const char *ran = mode_names[pm__memcpy_effective(mv[m].mode)];
    if (b->o.json) {
      cli_json_t j;
      copy_row_json(&j, mv[m].name, "h2h", n, med, gbps, ok, method, NAN, NULL);
      cli_json_str(&j, "path", "host");
      cli_json_str(&j, "mover_ran", ran);
      cli_json_str(&j, "timing", "wall");
      cli_json_int(&j, "runs", runs);
      cli_json_str(&j, "backend", pm_backend_name());
      cli_json_end(&j);
    } else {
      char sz[32];
      cli_fmt_bytes(n, sz, sizeof sz);
      text_row("h2h", sz, mv[m].name, gbps, NAN, ran, ok, method);
    }
  }
}

/* ---- the two halves of staging at once -----------------------------------------------------------
 */

/* A staged H2D copy runs its two halves at once: threads move pageable bytes into pinned memory
 * while the DMA engine reads earlier chunks out of pinned memory, through the same memory
 * controllers. These rows measure each half while the other runs: a plain DMA of pinned memory
 * (psrc -> d1, timed with events) while copy_threads threads run copy_memcpy's mover from
 * pageable to pinned memory (hsrc -> pdst, over and over), or only read the pageable source. The
 * host rate is counted over the DMA's timed runs only. Together with the rows of each half alone
 * (plain_pinned h2d, memcpy_*) they show the ceiling that sharing puts on staging on this
 * machine, whatever the staging code does. */
#define LOAD_STEP (256 * 1024)
#define LOAD_MIN_WINDOW 0.05 /* seconds of DMA under load at least, for the host's rate */
#define LOAD_MAX_RUNS 1000

typedef struct load {
  const char *src;
  char *dst; /* NULL: read the source only */
  size_t n, piece, pieces;
  int mode, threads;
  atomic_size_t next;    /* pieces claimed; piece = next % pieces */
  atomic_size_t moved;   /* bytes finished */
  atomic_int started;    /* tasks running */
  atomic_bool stop;
  atomic_uint_fast64_t sink; /* the read load's sums, so the reads cannot be dropped */
} load_t;

static uint64_t read_words(const char *p, size_t len) {
  const uint64_t *w = (const uint64_t *)(const void *)p;
  uint64_t a = 0, b = 0, c = 0, d = 0;
  size_t k = 0, words = len / 8;
  for (; k + 4 <= words; k += 4) {
    a += w[k];
    b ^= w[k + 1];
    c += w[k + 2];
    d ^= w[k + 3];
  }
  for (; k < words; k++) a += w[k];
  return a ^ b ^ c ^ d;
}

static void load_task(void *vctx, size_t task) {
  load_t *l = vctx;
  (void)task;
  uint64_t acc = 0;
  atomic_fetch_add(&l->started, 1);
  while (!atomic_load_explicit(&l->stop, memory_order_relaxed)) {
    size_t i = atomic_fetch_add_explicit(&l->next, 1, memory_order_relaxed) % l->pieces;
    size_t off = i * l->piece, end = off + PM__MIN(l->piece, l->n - off);
    /* Progress is counted every 256 KiB, so even a short DMA window sees some. */
    for (size_t at = off; at < end; at += LOAD_STEP) {
      size_t len = PM__MIN((size_t)LOAD_STEP, end - at);
      if (l->dst)
        pm__memcpy_mode(l->dst + at, l->src + at, len, l->mode);
      else
        acc += read_words(l->src + at, len);
      atomic_fetch_add_explicit(&l->moved, len, memory_order_relaxed);
    }
  }
  atomic_fetch_add(&l->sink, acc);
}

static void *load_main(void *vctx) {
  load_t *l = vctx;
  pm__parallel_for(l->threads, (size_t)l->threads, load_task, l);
  return NULL;
}

static void contention_row(bench_t *b, const char *name, const char *dir, size_t n, double secs,
                           bool ok, const char *method, const char *base, const char *load,
                           int threads, int runs, const char *timing) {
  double gbps = (double)n / secs / 1e9;
  const result_t *br = base ? find_result(b, base, dir, n) : NULL;
  double ratio = br && br->gbps > 0 ? gbps / br->gbps : NAN;
  const char *path = strcmp(dir, "h2d") ? "host" : "plain"; /* the DMA row is a plain copy */
  add_result(b, name, dir, n, gbps, ok);
  if (b->o.json) {
    cli_json_t j;
    copy_row_json(&j, name, dir, n, secs, gbps, ok, method, ratio, base);
    cli_json_str(&j, "path", path);
    cli_json_str(&j, "load", load);
    cli_json_int(&j, "load_threads", threads);
    cli_json_str(&j, "timing", timing);
    cli_json_int(&j, "runs", runs);
    cli_json_str(&j, "backend", pm_backend_name());
    cli_json_end(&j);
  } else {
    char sz[32];
    cli_fmt_bytes(n, sz, sizeof sz);
    text_row(dir, sz, name, gbps, ratio, path, ok, method);
  }
}

static void run_contention(bench_t *b, size_t n) {
  static const char *mover_rows[] = {"memcpy_libc", "memcpy_movsb", "memcpy_stream"};
  pm__copy_cfg_t cfg;
  pm__copy_cfg(&cfg);
  const char *mover_row = mover_rows[pm__memcpy_effective(pm__memcpy_for(cfg.mover, false))];
  for (int kind = 0; kind < 2; kind++) {
    bool copy = kind == 0;
    const char *dma_name = copy ? "dma_under_h2h" : "dma_under_read";
    const char *host_name = copy ? "h2h_under_dma" : "read_under_dma";
    if (!wanted(b, dma_name) && !wanted(b, host_name)) continue;
    load_t *l = cli_xmalloc(sizeof *l);
    memset(l, 0, sizeof *l);
    l->src = b->hsrc;
    l->dst = copy ? b->pdst : NULL;
    l->n = n;
    l->piece = cfg.chunk;
    l->pieces = (n + cfg.chunk - 1) / cfg.chunk;
    l->mode = pm__memcpy_for(cfg.mover, false); /* into a 1 GiB block, as a whole-copy bounce */
    l->threads = cfg.threads;
    atomic_init(&l->next, 0);
    atomic_init(&l->moved, 0);
    atomic_init(&l->started, 0);
    atomic_init(&l->stop, false);
    atomic_init(&l->sink, 0);
    if (copy) clear_host(b->pdst, n);
    pthread_t th;
    if (pthread_create(&th, NULL, load_main, l) != 0) {
      fprintf(stderr, "pinmem: cannot start the load thread for %s\n", dma_name);
      free(l);
      b->failed = true;
      return;
    }
    /* Time only with every load task running (the pool may take a moment to start them). */
    double give_up = pm__now() + 5.0;
    while (atomic_load(&l->started) < l->threads && pm__now() < give_up) sched_yield();
    int running = atomic_load(&l->started);
    /* At least --repeat timed DMAs, and more (small sizes) until the window is long enough for
     * the host's rate to mean something; every timed DMA is a sample of the DMA under load. */
    int cap = PM__MAX(b->o.repeat, LOAD_MAX_RUNS), runs = 0;
    double *t = cli_xmalloc(sizeof(double) * (size_t)cap);
    double host_s = 0;
    size_t host_bytes = 0;
    for (int r = -1; r < cap && (r < b->o.repeat || host_s < LOAD_MIN_WINDOW); r++) {
      prep_d1(b, n);
      sync_all(b);
      size_t m0 = atomic_load(&l->moved);
      double w0 = pm__now();
      cli_check(pm_event_record(b->e0, b->s1));
      h2d_plain(b, n, b->psrc);
      double s = end_timing(b, false);
      double w1 = pm__now();
      size_t m1 = atomic_load(&l->moved);
      if (r < 0) continue;
      t[runs++] = s;
      host_s += w1 - w0;
      host_bytes += m1 - m0;
    }
    atomic_store(&l->stop, true);
    pthread_join(th, NULL);
    char what[96];
    snprintf(what, sizeof what, "h2d %s", dma_name);
    const char *m = v_d1(b, n, what);
    bool dma_ok = m != NULL;
    /* Every claimed piece is finished once the load joined: check what was written. */
    bool host_ok = true;
    const char *hm = "none";
    if (copy) {
      size_t claimed = atomic_load(&l->next);
      size_t span = claimed >= l->pieces ? n : claimed * l->piece;
      snprintf(what, sizeof what, "h2h %s", host_name);
      hm = pat_verify(what, b->pdst, span, 0);
      host_ok = hm != NULL;
    }
    if (!dma_ok || !host_ok) b->failed = true;
    double med = cli_median(t, runs);
    char load[64];
    snprintf(load, sizeof load, copy ? "h2h %s" : "read", mover_row + strlen("memcpy_"));
    if (wanted(b, dma_name))
      contention_row(b, dma_name, "h2d", n, med, dma_ok, dma_ok ? m : "", "plain_pinned", load,
                     running, runs, "events");
    if (wanted(b, host_name)) {
      /* Seconds per n bytes at the rate the load kept during the DMAs (infinite if the load
       * made no progress at all: reported, and the run fails). */
      if (host_bytes == 0) {
        fprintf(stderr, "pinmem: %s: the load threads moved nothing in %.3f s of DMA\n",
                host_name, host_s);
        host_ok = false;
        b->failed = true;
      }
      double per_n = host_bytes ? host_s * (double)n / (double)host_bytes : INFINITY;
      contention_row(b, host_name, copy ? "h2h" : "read", n, per_n, host_ok, host_ok ? hm : "",
                     copy ? mover_row : NULL, "dma h2d", running, runs, "wall");
    }
    free(t);
    free(l);
  }
}

/* ---- targets -----------------------------------------------------------------------------------
 */

/* TARGET lines go with the table on stdout, or to stderr with --json (stdout stays JSON lines),
 * so the targets are in every run's output. */
static void target(const bench_t *b, const char *what, bool measured, bool met, const char *fig) {
  FILE *out = b->o.json ? stderr : stdout;
  if (!measured)
    fprintf(out, "TARGET %s: not measured in this run\n", what);
  else if (!b->cuda)
    fprintf(out, "TARGET %s: %s  (speed targets apply to the cuda backend only)\n", what, fig);
  else
    fprintf(out, "TARGET %s: %s  %s\n", what, fig, met ? "PASS" : "MISS");
}

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
      const result_t *p = find_result(b, "plain_pinned", r->dir, r->bytes);
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
    target(b, "pinmem from pinned >= 0.99x plain pinned at >= 8 MiB", any, met, fig);
  }
  {
    const result_t *r = find_result(b, "pinmem_pageable", "h2d", GIB);
    const result_t *p = find_result(b, "plain_pageable", "h2d", GIB);
    double q = r && p && p->gbps > 0 ? r->gbps / p->gbps : NAN;
    int len = snprintf(fig, sizeof fig, "%.1f GB/s, %.1fx plain pageable", r ? r->gbps : NAN, q);
    /* The ceiling the shared memory puts on staging here, when the run measured it. */
    const result_t *dl = find_result(b, "dma_under_h2h", "h2d", GIB);
    const result_t *hl = find_result(b, "h2h_under_dma", "h2h", GIB);
    if (dl && hl && len > 0 && (size_t)len < sizeof fig)
      snprintf(fig + len, sizeof fig - (size_t)len,
               "; both halves at once: DMA %.1f GB/s, host copy %.1f GB/s", dl->gbps, hl->gbps);
    target(b, "pageable H2D 1 GiB >= 50 GB/s and >= 5x plain pageable", r != NULL,
           r && r->verified && r->gbps >= T_PAGEABLE_H2D_GBPS && q >= T_PAGEABLE_H2D_RATIO, fig);
  }
  {
    const result_t *r = find_result(b, "pinmem_pageable", "d2h", GIB);
    snprintf(fig, sizeof fig, "%.1f GB/s", r ? r->gbps : NAN);
    target(b, "pageable D2H 1 GiB >= 45 GB/s", r != NULL,
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
    target(b, "bidirectional pinned >= 100 GB/s", best != NULL,
           best && best->verified && best->gbps >= T_BIDIR_GBPS, fig);
  }
  {
    const result_t *r = find_result(b, "batch_pinned_pinmem", "h2d", batch_total);
    const result_t *l = find_result(b, "batch_pinned_loop", "h2d", batch_total);
    const result_t *dm = find_result(b, "batch_pinned_dma", "h2d", batch_total);
    const result_t *kn = find_result(b, "batch_pinned_kernel", "h2d", batch_total);
    snprintf(fig, sizeof fig, "%.1f GB/s (dma %.1f, kernel %.1f; plain loop %.1f GB/s)",
             r ? r->gbps : NAN, dm ? dm->gbps : NAN, kn ? kn->gbps : NAN, l ? l->gbps : NAN);
    target(b, "batch 4096 x 64 KiB >= 40 GB/s", r != NULL && batch_total == 4096 * 64 * KIB,
           r && r->verified && r->gbps >= T_BATCH_GBPS, fig);
  }
}

/* Shared start of both benchmarks: parse the options, start pinmem, fill the defaults. Returns
 * 0 with *out set, or the exit code (usage errors, out of memory). */
static int bench_begin(const char *name, int argc, char **argv, bench_t **out) {
  bench_t *b = calloc(1, sizeof *b);
  if (!b) {
    fprintf(stderr, "pinmem: out of memory\n");
    return CLI_EXIT_FAILURE;
  }
  int rc = parse_args(name, argc, argv, &b->o);
  if (rc) {
    free(b);
    return rc;
  }
  cli_check(pm_init());
  b->cuda = pm_backend_kind() == PM_BACKEND_CUDA;
  if (!b->o.repeat) b->o.repeat = 5;
  *out = b;
  return 0;
}

/* ---- pinmem bench copy --------------------------------------------------------------------------
 */

int pm_cli_bench_copy(int argc, char **argv) {
  bench_t *b = NULL;
  int rc = bench_begin("copy", argc, argv, &b);
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
  bench_setup(b, cap, true);

  if (!b->o.json) {
    pm__copy_cfg_t cfg;
    pm__copy_cfg(&cfg);
    char bounce[sizeof((pm_option_info_t *)0)->value], mover[sizeof bounce], batch[sizeof bounce];
    printf(
        "pinmem bench copy: backend %s, %d timed runs per case (median); copy engine: "
        "chunk %zu KiB, %d threads, %d ring slots, staging from %zu KiB, bounce %s, mover %s, "
        "batch %s, H2D pieces %zu KiB (0 = off) into %d slots\n",
        pm_backend_name(), b->o.repeat, cfg.chunk / KIB, cfg.threads, cfg.slots,
        cfg.stage_min / KIB, opt_value("copy_bounce", bounce, sizeof bounce),
        opt_value("copy_memcpy", mover, sizeof mover),
        opt_value("copy_batch", batch, sizeof batch), cfg.piece / KIB, cfg.piece_slots);
    if (!b->cuda)
      printf(
          "host backend: the CPU plays the device, so these runs prove correctness, not "
          "speed; default sizes stop at 64 MiB.\n");
    printf(
        "ratio: against the plain copy of the same kind of host memory (pinned for wc, "
        "zero-copy and managed).\n\n");
    print_header();
  }
  static const char *dirs[] = {"h2d", "d2h", "bidir"};
  for (int d = 0; d < 3; d++) {
    for (int s = 0; s < b->o.nsizes; s++) {
      run_group(b, dirs[d], b->o.sizes[s]);
    }
    if (!b->o.json) printf("\n");
  }

  /* The host's own ceiling for staging, at the largest size of the run. */
  {
    size_t top = 0;
    for (int i = 0; i < b->o.nsizes; i++) top = PM__MAX(top, b->o.sizes[i]);
    if (top >= 8 * MIB) {
      run_movers(b, top);
      run_contention(b, top);
      if (!b->o.json) printf("\n");
    }
  }

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
  for (size_t i = 0; i < sizeof bcases / sizeof bcases[0]; i++)
    if (wanted(b, bcases[i].name)) run_batch(b, &bcases[i], count, piece);
  print_targets(b, count * piece);
  bench_teardown(b);
  bool failed = b->failed;
  free(b);
  if (failed) {
    fprintf(stderr, "pinmem: some copies delivered wrong bytes (see VERIFY FAILED above)\n");
    return CLI_EXIT_FAILURE;
  }
  return 0;
}

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
  sync_all(b);
  cli_check(pm_event_record(b->e0, b->s1));
  cli_check(pm_stream_wait_event(b->s2, b->e0));
  /* The kernel is issued first, as a training step issues its compute before the next batch's
   * copy: a kernel launch returns at once, while a copy from pageable memory (plain or staged)
   * holds the calling thread, so issued the other way round the kernel could only start after
   * the copy's host work and no pageable row could overlap at all. */
  if (r->kernel) cli_check(pm_launch_busy(r->two_streams ? b->s2 : b->s1, kernel_s));
  if (r->copy) ov_copy(b, r->kind, n, b->s1);
  double s = end_timing(b, true);
  if (r->copy) {
    cli_check(pm_memcpy(b->vbuf, b->d1, n, PM_COPY_D2H));
    if (!pat_verify(what, b->vbuf, n, 0)) {
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
  (void)ov_time(b, r, n, kernel_s, ok, what); /* warm-up */
  for (int i = 0; i < runs; i++) t[i] = ov_time(b, r, n, kernel_s, ok, what);
  double m = cli_median(t, runs);
  free(t);
  return m;
}

int pm_cli_bench_overlap(int argc, char **argv) {
  bench_t *b = NULL;
  int rc = bench_begin("overlap", argc, argv, &b);
  if (rc) return rc;
  size_t n = b->o.bytes ? b->o.bytes : (b->cuda ? 256 * MIB : 64 * MIB);
  bench_setup(b, n, false);

  bool ok = true;
  /* The copies alone, and a kernel as long as the pinned copy. */
  ov_run_t alone_pinned = {true, OV_PINNED, false, true},
           alone_pageable = {true, OV_PAGEABLE, false, true},
           alone_staged = {true, OV_STAGED, false, true};
  double t_pinned = ov_median(b, &alone_pinned, n, 0, &ok, "overlap: pinned copy");
  double t_pageable = ov_median(b, &alone_pageable, n, 0, &ok, "overlap: pageable copy");
  double t_staged = ov_median(b, &alone_staged, n, 0, &ok, "overlap: staged copy");
  double kernel_s = t_pinned;
  ov_run_t alone_kernel = {false, OV_PINNED, true, true};
  double t_kernel = ov_median(b, &alone_kernel, n, kernel_s, &ok, "overlap: kernel");

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
    printf(
        "pinmem bench overlap: backend %s, copy of %s H2D + a busy kernel of %.3f ms, copy "
        "issued first, median of %d runs\n",
        pm_backend_name(), sz, kernel_s * 1e3, b->o.repeat);
    if (!b->cuda)
      printf(
          "host backend: the kernel is a sleep on the stream's thread; this proves the "
          "ordering, not the speed.\n");
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
    snprintf(what, sizeof what, "overlap: %s", ov[i].name);
    double total = ov_median(b, &ov[i].run, n, kernel_s, &case_ok, what);
    double mx = PM__MAX(ov[i].copy_alone, t_kernel);
    double ratio = total / mx;
    if (!strcmp(ov[i].name, "pinned_two_streams")) pinned_ratio = case_ok ? ratio : NAN;
    ok = ok && case_ok;
    if (b->o.json) {
      cli_json_t j;
      cli_json_row(&j, "overlap", ov[i].name, n, total, (double)n / total / 1e9);
      if (case_ok)
        cli_json_str(&j, "verified", n <= FULL_VERIFY_MAX ? "full" : "sampled");
      else
        cli_json_bool(&j, "verified", false);
      cli_json_double(&j, "copy_seconds", ov[i].copy_alone);
      cli_json_double(&j, "kernel_seconds", t_kernel);
      cli_json_double(&j, "ratio_vs_max", ratio);
      cli_json_str(&j, "timing", "events");
      cli_json_int(&j, "runs", b->o.repeat);
      cli_json_str(&j, "backend", pm_backend_name());
      cli_json_end(&j);
    } else {
      printf("%-28s  %10.3f  %14.3f  %11.3fx  %s\n", ov[i].name, total * 1e3, mx * 1e3, ratio,
             case_ok ? (n <= FULL_VERIFY_MAX ? "full" : "sampled") : "NO (FAILED)");
    }
  }
  {
    char fig[96];
    snprintf(fig, sizeof fig, "%.3fx", pinned_ratio);
    fprintf(b->o.json ? stderr : stdout, "\n");
    target(b, "pinned copy + equal kernel on two streams <= 1.05x max(copy, kernel)", true,
           pinned_ratio <= T_OVERLAP_RATIO, fig);
  }
  bench_teardown(b);
  free(b);
  if (!ok) {
    fprintf(stderr, "pinmem: some copies delivered wrong bytes (see VERIFY FAILED above)\n");
    return CLI_EXIT_FAILURE;
  }
  return 0;
}
