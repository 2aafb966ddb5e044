/*
 * The host's rows of `pinmem bench copy`, at the largest size of a run (8 MiB or more): what the
 * CPU side of a staged copy can do on this machine, whatever the staging code does. The byte
 * movers alone (memcpy_libc, memcpy_movsb, memcpy_stream: pageable -> pinned, no device), and
 * the two halves of staging at once (dma_under_h2h, h2h_under_dma, dma_under_read,
 * read_under_dma): a plain DMA of pinned memory while threads copy or read pageable memory.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "bench_copy_common.h"

const char *const bc_mover_names[] = {"memcpy_libc", "memcpy_movsb", "memcpy_stream"};
const char *const bc_contention_names[] = {"dma_under_h2h", "h2h_under_dma", "dma_under_read",
                                           "read_under_dma"};

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

void bc_run_movers(bench_t *b, size_t n) {
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
    if (!bc_wanted(b, mv[m].name)) continue;
    mv_job_t job = {b->pdst, b->hsrc, n, cfg.chunk, mv[m].mode};
    size_t pieces = (n + cfg.chunk - 1) / cfg.chunk;
    int runs = b->o.repeat;
    double *t = cli_xmalloc(sizeof(double) * (size_t)runs);
    bool ok = true;
    const char *method = "full";
    char what[96];
    snprintf(what, sizeof what, "h2h %s", mv[m].name);
    for (int r = -1; r < runs; r++) {
      cli_progress(b->steps_done, b->steps, "h2h %s, run %d/%d", mv[m].name, r + 2, runs + 1);
      bc_clear_host(b->pdst, n);
      double t0 = pm__now();
      pm__parallel_for(cfg.threads, pieces, mv_piece, &job);
      double dt = pm__now() - t0;
      if (r >= 0) t[r] = dt;
      const char *v = bc_pat_verify(what, b->pdst, n, 0);
      if (!v)
        ok = false;
      else
        method = v;
    }
    if (!ok) b->failed = true;
    double med = cli_median(t, runs);
    free(t);
    double gbps = (double)n / med / 1e9;
    bc_add_result(b, mv[m].name, "h2h", n, gbps, ok);
    const char *ran = mode_names[pm__memcpy_effective(mv[m].mode)];
    if (b->o.json) {
      cli_json_t j;
      bc_copy_row_json(&j, mv[m].name, "h2h", n, med, gbps, ok, method, NAN, NULL, true);
      cli_json_str(&j, "path", "host");
      cli_json_str(&j, "mover_ran", ran);
      cli_json_str(&j, "timing", "wall");
      cli_json_int(&j, "runs", runs);
      cli_json_str(&j, "backend", pm_backend_name());
      cli_json_end(&j);
    } else {
      char sz[32];
      cli_fmt_bytes(n, sz, sizeof sz);
      bc_text_row("h2h", sz, mv[m].name, gbps, NAN, ran, ok, method, true);
    }
  }
}

/* ---- the two halves of staging at once
 * -----------------------------------------------------------
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
  atomic_size_t next;  /* pieces claimed; piece = next % pieces */
  atomic_size_t moved; /* bytes finished */
  atomic_int started;  /* tasks running */
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
  const result_t *br = base ? bc_find_result(b, base, dir, n) : NULL;
  double ratio = br && br->gbps > 0 ? gbps / br->gbps : NAN;
  const char *path = strcmp(dir, "h2d") ? "host" : "plain"; /* the DMA row is a plain copy */
  bc_add_result(b, name, dir, n, gbps, ok);
  if (b->o.json) {
    cli_json_t j;
    bc_copy_row_json(&j, name, dir, n, secs, gbps, ok, method, ratio, base, true);
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
    bc_text_row(dir, sz, name, gbps, ratio, path, ok, method, true);
  }
}

void bc_run_contention(bench_t *b, size_t n) {
  static const char *mover_rows[] = {"memcpy_libc", "memcpy_movsb", "memcpy_stream"};
  pm__copy_cfg_t cfg;
  pm__copy_cfg(&cfg);
  const char *mover_row = mover_rows[pm__memcpy_effective(pm__memcpy_for(cfg.mover, false))];
  for (int kind = 0; kind < 2; kind++) {
    bool copy = kind == 0;
    const char *dma_name = copy ? "dma_under_h2h" : "dma_under_read";
    const char *host_name = copy ? "h2h_under_dma" : "read_under_dma";
    if (!bc_wanted(b, dma_name) && !bc_wanted(b, host_name)) continue;
    cli_progress(b->steps_done, b->steps, "%s and %s", dma_name, host_name);
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
    if (copy) bc_clear_host(b->pdst, n);
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
      bc_prep_d1(b, n);
      bc_sync_all(b);
      size_t m0 = atomic_load(&l->moved);
      double w0 = pm__now();
      cli_check(pm_event_record(b->e0, b->s1));
      bc_h2d_plain(b, n, b->psrc);
      double s = bc_end_timing(b, false);
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
    const char *m = bc_v_d1(b, n, what);
    bool dma_ok = m != NULL;
    /* Every claimed piece is finished once the load joined: check what was written. */
    bool host_ok = true;
    const char *hm = "none";
    if (copy) {
      size_t claimed = atomic_load(&l->next);
      size_t span = claimed >= l->pieces ? n : claimed * l->piece;
      snprintf(what, sizeof what, "h2h %s", host_name);
      hm = bc_pat_verify(what, b->pdst, span, 0);
      host_ok = hm != NULL;
    }
    if (!dma_ok || !host_ok) b->failed = true;
    double med = cli_median(t, runs);
    char load[64];
    snprintf(load, sizeof load, copy ? "h2h %s" : "read", mover_row + strlen("memcpy_"));
    if (bc_wanted(b, dma_name))
      contention_row(b, dma_name, "h2d", n, med, dma_ok, dma_ok ? m : "", "plain_pinned", load,
                     running, runs, "events");
    if (bc_wanted(b, host_name)) {
      /* Seconds per n bytes at the rate the load kept during the DMAs (infinite if the load
       * made no progress at all: reported, and the run fails). */
      if (host_bytes == 0) {
        fprintf(stderr, "pinmem: %s: the load threads moved nothing in %.3f s of DMA\n", host_name,
                host_s);
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
