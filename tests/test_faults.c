/*
 * Fault injection (src/backend/fault.c) through every public entry point that reaches the backend: the
 * pool (alloc, free, record_stream, trim, reserve), registration, device and managed memory,
 * plain copies, the copy engine on each path (direct, staged H2D/D2H through a whole bounce
 * block and through the ring, plain small pageable copies, batches, callbacks), streams, events
 * and device queries.
 *
 * Each scenario runs once to count its backend calls per op, then once per (op, k) with the
 * k-th call of that op failing (k <= K), then with every op failing at random rates. After each
 * run, with the faults disarmed, the scenario's leftovers are cleaned up and the state is
 * checked: every failing public call returned an error status with a detail; no call failed
 * without an injected fault; every call that succeeded moved the right bytes; callbacks ran
 * exactly once for each accepted copy and never for a refused one; pools report nothing in use,
 * their accounting adds up (pinned = cached + pending + registered) and they destroy cleanly;
 * the default pool's registered bytes and the registry are back to where they started; on the
 * host backend the process's locked memory is too. ASan/LSan and valgrind catch heap leaks; an
 * alarm catches hangs.
 *
 * Then the resource limits: a budget of a few MiB, RLIMIT_MEMLOCK set low (in a child that
 * drops root), too little simulated device memory; each gives a clear error at the right call,
 * and `pinmem info` shows the memlock limit.
 */
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "copy_internal.h" /* pm__stage_slab_count */
#include "internal.h"

static bool g_small, g_host;
static bool g_light; /* valgrind (PINMEM_TEST_SMALL) or ThreadSanitizer: fewer, smaller runs */

#if defined(__SANITIZE_THREAD__)
#define PM_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PM_TSAN 1
#endif
#endif
#ifndef PM_TSAN
#define PM_TSAN 0
#endif
static size_t g_page;

/* ---- tallies -------------------------------------------------------------------------------- */

typedef struct tally {
  uint64_t runs, ops, errors, errors_named, injected, surfaced, absorbed, verified;
  uint64_t by_status[32]; /* index: -status */
} tally_t;

static tally_t g_total;
static tally_t g_run; /* the current run */
static const char *g_scenario = "?";
static const char *g_mode = "?";

static pm_status_t tally_st(pm_status_t st, const char *expr, const char *file, int line) {
  g_run.ops++;
  if (st < 0) {
    g_run.errors++;
    if (-st < 32) g_run.by_status[-st]++;
    pm_test_checks++;
    if (!pm_last_error()[0])
      PM_TEST_FAIL_AT(file, line, "%s [%s, %s]: %s without a detail", expr, g_scenario, g_mode,
                      pm_status_name(st));
    if (strstr(pm_last_error(), "injected fault")) g_run.errors_named++;
    /* A fault is never the caller's fault: it must not read as bad input or a broken invariant. */
    pm_test_checks++;
    if (st == PM_ERR_INVALID || st == PM_ERR_INTERNAL || st == PM_ERR_DOUBLE_FREE ||
        st == PM_ERR_NOT_FOUND)
      PM_TEST_FAIL_AT(file, line, "%s [%s, %s]: %s", expr, g_scenario, g_mode,
                      pm_status_name(st));
  }
  return st;
}
#define T(expr) tally_st((expr), #expr, __FILE__, __LINE__)

/* pm_host_free consumes the block unless the pointer itself was bad: when the stream that used
 * it can neither record an event nor synchronize, it reports PM_ERR_BACKEND but the block is
 * freed (and kept out of use until the pool is destroyed). */
static bool host_free_consumed(pm_status_t st) {
  return st == PM_OK || (st != PM_ERR_INVALID && st != PM_ERR_NOT_FOUND &&
                         st != PM_ERR_DOUBLE_FREE && st != PM_ERR_WRONG_KIND);
}
#define HOST_FREE(c, p)                                      \
  do {                                                      \
    if (host_free_consumed(T(pm_host_free(p)))) DROP((c)->blocks, (p)); \
  } while (0)

/* A byte comparison that fails the test with the first differing offset. */
static bool same_bytes(const void *got, const void *want, size_t n, const char *what) {
  pm_test_checks++;
  if (memcmp(got, want, n) == 0) {
    g_run.verified++;
    return true;
  }
  size_t i = 0;
  while (((const unsigned char *)got)[i] == ((const unsigned char *)want)[i]) i++;
  PM_TEST_FAIL_AT(__FILE__, __LINE__, "[%s, %s] %s: byte %zu of %zu differs", g_scenario, g_mode,
                  what, i, n);
  return false;
}

/* ---- hang guard ------------------------------------------------------------------------------ */

static void on_alarm(int sig) {
  (void)sig;
  static const char msg[] = "test_faults: FAIL: a run hung (alarm); see the last scenario line\n";
  if (write(2, msg, sizeof msg - 1) < 0) _exit(3);
  _exit(3);
}

/* ---- locked memory (host backend) ------------------------------------------------------------ */

/* -1 where it cannot tell (no /proc, or a sanitizer runtime that makes mlock a no-op), and on
 * the cuda backend, whose pinned memory VmLck does not count. */
static long long vm_locked(void) {
  return g_host ? pm_test_vm_locked() : -1;
}

/* ---- what a scenario leaves behind ----------------------------------------------------------- */

typedef struct cb_rec {
  atomic_int calls;
  atomic_int status;
  bool accepted; /* the submitting call returned PM_OK */
} cb_rec_t;

static void cb_fn(void *arg, pm_status_t status) {
  cb_rec_t *r = arg;
  atomic_store(&r->status, (int)status);
  atomic_fetch_add(&r->calls, 1);
}

static void flag_fn(void *arg) {
  atomic_store((atomic_int *)arg, 1);
}

#define MAXN 16
typedef struct ctx {
  pm_pool_t *pools[MAXN];
  pm_stream_t streams[MAXN];
  pm_event_t events[MAXN];
  pm_fence_t fences[MAXN];
  void *blocks[MAXN];     /* pool blocks */
  void *devs[MAXN];       /* device memory */
  void *managed[MAXN];    /* managed memory */
  void *registered[MAXN]; /* registered (and malloc'd) */
  void *mallocs[MAXN];    /* plain heap memory */
  cb_rec_t cbs[MAXN];
  int ncbs;
  atomic_int flags[MAXN];
  int nflags;
} ctx_t;

#define KEEP(arr, p)                                       \
  do {                                                     \
    size_t i_;                                             \
    for (i_ = 0; i_ < MAXN && (arr)[i_]; i_++) {           \
    }                                                      \
    REQUIRE(i_ < MAXN);                                    \
    (arr)[i_] = (p);                                       \
  } while (0)

#define DROP(arr, p)                                       \
  do {                                                     \
    for (size_t i_ = 0; i_ < MAXN; i_++)                   \
      if ((arr)[i_] == (p)) (arr)[i_] = NULL;              \
  } while (0)

static void *xmalloc(ctx_t *c, size_t n) {
  void *p = NULL;
  REQUIRE(posix_memalign(&p, 4096, n) == 0);
  KEEP(c->mallocs, p);
  return p;
}

static cb_rec_t *new_cb(ctx_t *c) {
  REQUIRE(c->ncbs < MAXN);
  cb_rec_t *r = &c->cbs[c->ncbs++];
  atomic_init(&r->calls, 0);
  atomic_init(&r->status, 12345);
  r->accepted = false;
  return r;
}

static atomic_int *new_flag(ctx_t *c) {
  REQUIRE(c->nflags < MAXN);
  atomic_int *f = &c->flags[c->nflags++];
  atomic_init(f, 0);
  return f;
}

static pm_pool_t *new_pool(ctx_t *c, size_t budget) {
  pm_pool_config_t cfg;
  pm_pool_config_init(&cfg);
  cfg.budget = budget;
  cfg.fast_pin_min = (size_t)1 << 20; /* blocks of 1 MiB and up: mmap + touch + register */
  cfg.pin_threads = 2;
  cfg.exhaust_policy = PM_EXHAUST_FAIL;
  pm_pool_t *p = NULL;
  REQUIRE_OK(pm_pool_create(&cfg, &p)); /* no backend call */
  KEEP(c->pools, p);
  return p;
}

/* Everything still held, released with the faults disarmed: wait for the streams first, so no
 * queued work can touch memory being freed. Then the pools must be empty and consistent. */
static void cleanup(ctx_t *c) {
  CHECK_OK(pm_device_synchronize());
  for (int i = 0; i < MAXN; i++)
    if (c->streams[i]) CHECK_OK(pm_stream_synchronize(c->streams[i]));
  for (int i = 0; i < MAXN; i++) {
    if (!c->fences[i]) continue;
    pm_status_t st = pm_fence_wait(c->fences[i]); /* the copy's status: any, but it returns */
    (void)st;
    CHECK_OK(pm_fence_release(c->fences[i]));
    c->fences[i] = NULL;
  }
  /* Callbacks: once for each accepted copy (with the copy's status), never for a refused one. */
  for (int i = 0; i < c->ncbs; i++) {
    cb_rec_t *r = &c->cbs[i];
    int want = r->accepted ? 1 : 0;
    for (int t = 0; t < 10000 && atomic_load(&r->calls) < want; t++) pm_test_sleep_ms(1);
    if (!want) pm_test_sleep_ms(1);
    pm_test_checks++;
    if (atomic_load(&r->calls) != want)
      PM_TEST_FAIL_AT(__FILE__, __LINE__, "[%s, %s] callback %d ran %d times, want %d",
                      g_scenario, g_mode, i, atomic_load(&r->calls), want);
  }
  for (int i = 0; i < MAXN; i++)
    if (c->events[i]) CHECK_OK(pm_event_destroy(c->events[i]));
  for (int i = 0; i < MAXN; i++)
    if (c->blocks[i]) CHECK_OK(pm_host_free(c->blocks[i]));
  for (int i = 0; i < MAXN; i++) {
    if (!c->registered[i]) continue;
    CHECK_OK(pm_unregister(c->registered[i]));
    free(c->registered[i]);
  }
  for (int i = 0; i < MAXN; i++) free(c->mallocs[i]);
  for (int i = 0; i < MAXN; i++)
    if (c->devs[i]) CHECK_OK(pm_device_free(c->devs[i]));
  for (int i = 0; i < MAXN; i++)
    if (c->managed[i]) CHECK_OK(pm_managed_free(c->managed[i]));
  for (int i = 0; i < MAXN; i++)
    if (c->streams[i]) CHECK_OK(pm_stream_destroy(c->streams[i]));
  for (int i = 0; i < MAXN; i++) {
    pm_pool_t *p = c->pools[i];
    if (!p) continue;
    pm_pool_stats_t s;
    CHECK_OK(pm_pool_get_stats(p, &s));
    pm_test_checks++;
    if (s.in_use_bytes || s.requested_bytes || s.allocs != s.frees ||
        s.pinned_bytes != s.cached_bytes + s.pending_bytes + s.registered_bytes ||
        s.pinned_bytes > s.budget)
      PM_TEST_FAIL_AT(__FILE__, __LINE__,
                      "[%s, %s] pool accounting: in use %zu, requested %zu, allocs %llu, frees "
                      "%llu, pinned %zu != cached %zu + pending %zu + registered %zu, budget %zu",
                      g_scenario, g_mode, s.in_use_bytes, s.requested_bytes,
                      (unsigned long long)s.allocs, (unsigned long long)s.frees, s.pinned_bytes,
                      s.cached_bytes, s.pending_bytes, s.registered_bytes, s.budget);
    CHECK_OK(pm_pool_destroy(p));
  }
  memset(c, 0, sizeof *c);
}

/* ---- scenarios: each runs with faults armed and checks what succeeded ---------------------- */

/* The block still holds what was written into it (no other block overlaps it). */
static void check_fill(const void *p, size_t n, uint64_t seed, const char *what) {
  char *want = malloc(n);
  REQUIRE(want != NULL);
  pm_test_fill(want, n, seed);
  same_bytes(p, want, n, what);
  free(want);
}

/* Pool: small and fast-pinned blocks, mapped flags, stream-ordered frees, reuse, reserve, trim. */
static void sc_pool(ctx_t *c, int run) {
  pm_pool_t *pool = new_pool(c, (size_t)32 << 20);
  pm_stream_t s = NULL;
  if (T(pm_stream_create(&s)) == PM_OK) KEEP(c->streams, s);
  size_t n1 = 1000 + (size_t)run % 7, n2 = ((size_t)3 << 20) + 77;
  void *a = NULL, *b = NULL;
  if (T(pm_host_alloc(pool, n1, PM_HOST_DEFAULT, &a)) == PM_OK) {
    KEEP(c->blocks, a);
    pm_test_fill(a, n1, 1);
  }
  if (T(pm_host_alloc(pool, n2, PM_HOST_MAPPED, &b)) == PM_OK) {
    KEEP(c->blocks, b);
    pm_test_fill(b, n2, 2);
    void *d = NULL;
    if (T(pm_host_device_pointer(b, &d)) == PM_OK) CHECK(d != NULL);
    if (s) {
      T(pm_host_record_stream(b, s));
      T(pm_launch_busy(s, 0.0002));
    }
    check_fill(b, n2, 2, "fast-pinned mapped pool block");
    HOST_FREE(c, b);
  }
  if (a && s) T(pm_host_record_stream(a, s));
  if (a) check_fill(a, n1, 1, "small pool block");
  if (a) HOST_FREE(c, a);
  /* Reuse after the stream passed the frees (event queries), or a new segment. */
  void *r = NULL;
  if (T(pm_host_alloc(pool, n2, PM_HOST_MAPPED, &r)) == PM_OK) {
    KEEP(c->blocks, r);
    pm_test_fill(r, n2, 3);
    if (a) check_fill(a, n1, 1, "small pool block after another allocation");
    HOST_FREE(c, r);
  }
  T(pm_pool_reserve(pool, (size_t)2 << 20, PM_HOST_PORTABLE));
  T(pm_pool_reserve(pool, 5000, PM_HOST_WRITE_COMBINED));
  size_t released = 0;
  T(pm_pool_trim(pool, &released));
  pm_pool_stats_t st;
  if (T(pm_pool_get_stats(pool, &st)) == PM_OK) CHECK_LE_SIZE(st.pinned_bytes, st.budget);
}

/* Registration: pin a heap buffer in place, query it, copy through it, unregister. */
static void sc_register(ctx_t *c, int run) {
  size_t n = ((size_t)1 << 20) + 4096 * (size_t)(run % 3);
  char *buf = NULL;
  REQUIRE(posix_memalign((void **)&buf, 4096, n) == 0);
  pm_test_fill(buf, n, 10 + (uint64_t)run);
  if (T(pm_register(buf, n, PM_REGISTER_MAPPED)) != PM_OK) {
    /* Refused: nothing may remain of it. */
    pm_pointer_info_t info;
    CHECK_OK(pm_pointer_query(buf, &info));
    CHECK_EQ_INT(info.kind, PM_MEMORY_PAGEABLE);
    free(buf);
    return;
  }
  KEEP(c->registered, buf);
  pm_pointer_info_t info;
  CHECK_OK(pm_pointer_query(buf + 5, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_REGISTERED);
  void *dp = NULL;
  CHECK_OK(pm_host_device_pointer(buf, &dp)); /* from the registry, no backend call */
  void *d = NULL;
  if (T(pm_device_alloc(n, &d)) != PM_OK) return;
  KEEP(c->devs, d);
  char *back = xmalloc(c, n);
  if (T(pm_memcpy(d, buf, n, PM_COPY_H2D)) == PM_OK &&
      T(pm_memcpy(back, d, n, PM_COPY_D2H)) == PM_OK)
    same_bytes(back, buf, n, "registered -> device -> pageable");
  if (T(pm_unregister(buf)) == PM_OK) {
    DROP(c->registered, buf);
    free(buf);
  }
}

/* Device and managed memory, memset, plain async and sync copies on a stream. */
static void sc_device(ctx_t *c, int run) {
  size_t n = 300001 + (size_t)run;
  pm_pool_t *pool = new_pool(c, (size_t)8 << 20);
  pm_stream_t s = NULL;
  if (T(pm_stream_create(&s)) != PM_OK) return;
  KEEP(c->streams, s);
  void *d = NULL, *d2 = NULL, *h = NULL;
  if (T(pm_device_alloc(n, &d)) != PM_OK) return;
  KEEP(c->devs, d);
  if (T(pm_host_alloc(pool, n, PM_HOST_DEFAULT, &h)) != PM_OK) return;
  KEEP(c->blocks, h);
  char *want = xmalloc(c, n);
  memset(want, 0x5a, n);
  pm_test_fill(h, n, 20);
  /* After a failed synchronize, queued work may still write h and d: stop there (cleanup
   * waits for the stream with the faults off). */
  if (T(pm_device_memset_async(d, 0x5a, n, s)) != PM_OK ||
      T(pm_memcpy_async(h, d, n, PM_COPY_D2H, s)) != PM_OK ||
      T(pm_stream_synchronize(s)) != PM_OK)
    return;
  same_bytes(h, want, n, "memset -> D2H from pinned");
  pm_test_fill(want, n, 21);
  memcpy(h, want, n);
  char *back = xmalloc(c, n);
  if (T(pm_memcpy_async(d, h, n, PM_COPY_H2D, s)) == PM_OK && T(pm_device_alloc(n, &d2)) == PM_OK) {
    KEEP(c->devs, d2);
    /* pm_memcpy runs on the default stream, which does not wait for s: synchronize first. */
    if (T(pm_memcpy_async(d2, d, n, PM_COPY_D2D, s)) == PM_OK &&
        T(pm_stream_synchronize(s)) == PM_OK &&
        T(pm_memcpy(back, d2, n, PM_COPY_DEFAULT)) == PM_OK)
      same_bytes(back, want, n, "pinned H2D -> D2D -> pageable D2H");
  }
  void *m = NULL;
  if (T(pm_managed_alloc(n, &m)) == PM_OK) {
    KEEP(c->managed, m);
    memcpy(m, want, n);
    if (T(pm_managed_prefetch(m, n, 0, s)) == PM_OK &&
        T(pm_managed_prefetch(m, n, PM_CPU_DEVICE, s)) == PM_OK &&
        T(pm_stream_synchronize(s)) == PM_OK)
      same_bytes(m, want, n, "managed after prefetches");
  }
  /* The frees wait for cleanup: after a failed synchronize, queued work may still use them. */
}

typedef struct copy_case {
  const char *name;
  bool h2d;
  bool pinned_host; /* else pageable */
  pm_copy_path_t path;
  bool tiny_pool; /* bounce memory from a pool whose budget forces the ring */
  bool callback;
  bool batch;
} copy_case_t;

/* The copy engine: one copy there and back per case, verified when every step succeeded. */
static void copy_one(ctx_t *c, const copy_case_t *k, pm_pool_t *big, pm_pool_t *tiny,
                     pm_stream_t s, size_t n, uint64_t seed) {
  void *d = NULL;
  if (T(pm_device_alloc(n, &d)) != PM_OK) return;
  KEEP(c->devs, d);
  char *src = NULL, *dst = NULL;
  if (k->pinned_host) {
    void *a = NULL, *b = NULL;
    if (T(pm_host_alloc(big, n, PM_HOST_DEFAULT, &a)) != PM_OK) return;
    KEEP(c->blocks, a);
    if (T(pm_host_alloc(big, n, PM_HOST_DEFAULT, &b)) != PM_OK) return;
    KEEP(c->blocks, b);
    src = a;
    dst = b;
  } else {
    src = xmalloc(c, n);
    dst = xmalloc(c, n);
  }
  pm_test_fill(src, n, seed);
  pm_test_fill(dst, n, seed + 1);

  pm_copy_options_t o;
  pm_copy_options_init(&o);
  o.path = k->path;
  o.pool = k->tiny_pool ? tiny : big;
  cb_rec_t *cb1 = NULL, *cb2 = NULL;
  if (k->callback) {
    cb1 = new_cb(c);
    cb2 = new_cb(c);
  }
  /* there */
  pm_fence_t f = NULL;
  o.callback = cb1 ? cb_fn : NULL;
  o.callback_arg = cb1;
  pm_status_t st;
  if (k->batch) {
    pm_copy_item_t items[3] = {{d, src, n / 3}, {(char *)d + n / 3, src + n / 3, n / 3},
                               {(char *)d + 2 * (n / 3), src + 2 * (n / 3), n - 2 * (n / 3)}};
    st = T(pm_copy_batch_async(items, 3, s, &o, &f));
  } else {
    st = T(pm_copy_async(d, src, n, s, &o, &f));
  }
  if (cb1) cb1->accepted = st == PM_OK;
  if (st != PM_OK) return;
  KEEP(c->fences, f);
  if (T(pm_fence_wait(f)) != PM_OK) return;
  if (cb1 && atomic_load(&cb1->status) != PM_OK) return;
  /* back */
  pm_fence_t g = NULL;
  o.callback = cb2 ? cb_fn : NULL;
  o.callback_arg = cb2;
  st = T(pm_copy_async(dst, d, n, s, &o, &g));
  if (cb2) cb2->accepted = st == PM_OK;
  if (st != PM_OK) return;
  KEEP(c->fences, g);
  if (T(pm_fence_wait(g)) != PM_OK) return;
  if (cb2) {
    pm_test_checks++;
    if (atomic_load(&cb2->calls) != 1)
      PM_TEST_FAIL_AT(__FILE__, __LINE__, "[%s, %s] %s: callback not run when the fence completed",
                      g_scenario, g_mode, k->name);
    if (atomic_load(&cb2->status) != PM_OK) return;
  }
  same_bytes(dst, src, n, k->name);
}

static const copy_case_t copy_cases[] = {
    {"direct H2D/D2H (pinned)", true, true, PM_PATH_AUTO, false, false, false},
    {"staged (pageable, whole bounce block)", true, false, PM_PATH_STAGED, false, false, false},
    {"staged (pageable, ring)", true, false, PM_PATH_STAGED, true, false, false},
    {"staged with callbacks", true, false, PM_PATH_AUTO, false, true, false},
    {"plain small pageable", true, false, PM_PATH_AUTO, false, false, false},
    {"direct with callbacks", true, true, PM_PATH_DIRECT, false, true, false},
    {"batch staged", true, false, PM_PATH_AUTO, false, false, true},
};

static void sc_copy(ctx_t *c, int run) {
  pm_pool_t *big = new_pool(c, (size_t)32 << 20);
  pm_pool_t *tiny = new_pool(c, (size_t)512 << 10); /* a ring of 2 slots of 256 KiB */
  pm_stream_t s = NULL;
  if (T(pm_stream_create(&s)) != PM_OK) return;
  KEEP(c->streams, s);
  size_t big_n = (g_light ? (size_t)600 << 10 : (size_t)2 << 20) + 13;
  for (size_t i = 0; i < sizeof copy_cases / sizeof copy_cases[0]; i++) {
    const copy_case_t *k = &copy_cases[i];
    size_t n = strstr(k->name, "small") ? 4099 : big_n;
    copy_one(c, k, big, tiny, s, n + (size_t)run, 100 + i * 7 + (uint64_t)run);
  }
}

/* Streams and events: record, cross-stream wait, host function, queries, timing. */
static void sc_stream(ctx_t *c, int run) {
  (void)run;
  pm_stream_t s1 = NULL, s2 = NULL;
  pm_event_t e1 = NULL, e2 = NULL;
  if (T(pm_stream_create(&s1)) != PM_OK) return;
  KEEP(c->streams, s1);
  if (T(pm_stream_create(&s2)) != PM_OK) return;
  KEEP(c->streams, s2);
  if (T(pm_event_create(PM_EVENT_TIMING, &e1)) != PM_OK) return;
  KEEP(c->events, e1);
  if (T(pm_event_create(PM_EVENT_TIMING, &e2)) != PM_OK) return;
  KEEP(c->events, e2);
  atomic_int *flag = new_flag(c);
  bool rec1 = T(pm_event_record(e1, s1)) == PM_OK;
  T(pm_launch_busy(s1, 0.0005));
  bool rec2 = T(pm_event_record(e2, s1)) == PM_OK;
  T(pm_stream_wait_event(s2, e2));
  bool launched = T(pm_launch_host_func(s2, flag_fn, flag)) == PM_OK;
  if (T(pm_stream_synchronize(s2)) == PM_OK) {
    pm_test_checks++;
    if (atomic_load(flag) != (launched ? 1 : 0))
      PM_TEST_FAIL_AT(__FILE__, __LINE__, "[%s, %s] host function ran %d, launched %d",
                      g_scenario, g_mode, atomic_load(flag), launched);
  }
  if (T(pm_event_synchronize(e2)) == PM_OK) {
    pm_status_t q = T(pm_event_query(e2));
    CHECK(q == PM_OK || q < 0);
    double sec = -1;
    if (rec1 && rec2 && T(pm_event_synchronize(e1)) == PM_OK &&
        T(pm_event_elapsed(e1, e2, &sec)) == PM_OK)
      CHECK(sec >= 0);
  }
  if (T(pm_stream_synchronize(s1)) == PM_OK) {
    pm_status_t q = T(pm_stream_query(s1));
    CHECK(q == PM_OK || q < 0);
  }
}

/* Device queries. */
static void sc_devinfo(ctx_t *c, int run) {
  (void)c;
  (void)run;
  int n = 0, cur = -1;
  if (T(pm_device_count(&n)) == PM_OK) CHECK(n >= 1);
  pm_device_info_t info;
  if (T(pm_device_get_info(0, &info)) == PM_OK) CHECK(info.total_memory > 0);
  if (T(pm_device_get(&cur)) == PM_OK) CHECK_EQ_INT(cur, 0);
  T(pm_device_set(0));
  T(pm_device_synchronize());
}

/* ---- the driver --------------------------------------------------------------------------- */

typedef struct scenario {
  const char *name;
  void (*fn)(ctx_t *c, int run);
} scenario_t;

static const scenario_t scenarios[] = {
    {"pool", sc_pool},         {"register", sc_register}, {"device", sc_device},
    {"copy", sc_copy},         {"stream", sc_stream},     {"devinfo", sc_devinfo},
};

static size_t g_registry0;
static long long g_locked0;

static void baseline(void) {
  size_t rel;
  CHECK_OK(pm_pool_trim(NULL, &rel));
  g_registry0 = pm__registry_count();
  g_locked0 = vm_locked();
}

/* One run: arm, run the scenario, disarm, clean up, check the process state and tally. */
static void run_one(const scenario_t *sc, int run, const char *mode, pm__fault_op_t op,
                    uint64_t nth, double rate, uint64_t seed, pm__fault_counts_t *counts_out) {
  static ctx_t c;
  memset(&c, 0, sizeof c);
  memset(&g_run, 0, sizeof g_run);
  g_scenario = sc->name;
  g_mode = mode;
  if (getenv("PINMEM_TEST_VERBOSE")) {
    printf("    run %s [%s]\n", sc->name, mode);
    fflush(stdout);
  }
  alarm(g_small ? 300 : 60);
  pm__fault_reset();
  pm__fault_seed(seed);
  if (op != PM__FAULT_ALL || nth || rate > 0 || counts_out)
    REQUIRE_OK(pm__fault_set(op, nth, rate));
  sc->fn(&c, run);
  pm__fault_counts_t fc;
  pm__fault_counts(&fc);
  pm__fault_reset();
  cleanup(&c);
  alarm(0);
  if (counts_out) *counts_out = fc;

  /* No failure without a fault. */
  pm_test_checks++;
  if (g_run.errors && !fc.total_injected)
    PM_TEST_FAIL_AT(__FILE__, __LINE__, "[%s, %s] %llu calls failed with no fault injected",
                    sc->name, mode, (unsigned long long)g_run.errors);

  /* The process is back where it was. */
  pm_pool_stats_t ds;
  CHECK_OK(pm_pool_get_stats(NULL, &ds));
  CHECK_EQ_SIZE(ds.registered_bytes, 0);
  CHECK_EQ_SIZE(ds.in_use_bytes, 0);
  size_t rel;
  CHECK_OK(pm_pool_trim(NULL, &rel));
  pm_test_checks++;
  if (pm__registry_count() != g_registry0)
    PM_TEST_FAIL_AT(__FILE__, __LINE__, "[%s, %s] registry holds %zu ranges, %zu before",
                    sc->name, mode, pm__registry_count(), g_registry0);
  if (g_locked0 >= 0) {
    long long now = vm_locked();
    pm_test_checks++;
    if (now != g_locked0)
      PM_TEST_FAIL_AT(__FILE__, __LINE__, "[%s, %s] %lld bytes locked, %lld before", sc->name,
                      mode, now, g_locked0);
  }

  g_total.runs++;
  g_total.ops += g_run.ops;
  g_total.errors += g_run.errors;
  g_total.errors_named += g_run.errors_named;
  g_total.verified += g_run.verified;
  g_total.injected += fc.total_injected;
  if (fc.total_injected) {
    if (g_run.errors)
      g_total.surfaced++;
    else
      g_total.absorbed++;
  }
  for (int i = 0; i < 32; i++) g_total.by_status[i] += g_run.by_status[i];
}

/* Release calls are faulted only by test_release_faults: a failed release leaves the object in
 * place by design, which callers that cannot retry (pool trim, pool destroy) then leak. The
 * pool's stream record (pool_record) only by test_bounce_quarantine, which checks what its
 * failure leads to; wrong bytes (corrupt) only by test_corrupt, as no caller can see them. */
static bool is_release(int op) {
  return op == PM__FAULT_HOST_FREE || op == PM__FAULT_HOST_UNREGISTER ||
         op == PM__FAULT_DEVICE_FREE || op == PM__FAULT_MANAGED_FREE ||
         op == PM__FAULT_STREAM_DESTROY || op == PM__FAULT_EVENT_DESTROY ||
         op == PM__FAULT_POOL_RECORD || op == PM__FAULT_CORRUPT;
}

/* corrupt: the copy it hits succeeds with the source shifted by one byte (what a verifier must
 * catch), the next copy is right again, and "all" never includes it. */
static void test_corrupt(void) {
  const size_t n = 10007;
  unsigned char *src = malloc(n), *back = malloc(n);
  void *dev = NULL;
  REQUIRE(src && back);
  REQUIRE_OK(pm_device_alloc(n, &dev));
  pm_test_fill(src, n, 51);
  pm__fault_reset();
  CHECK_OK(pm__fault_configure("corrupt=1"));
  CHECK_OK(pm_memcpy(dev, src, n, PM_COPY_H2D)); /* success, and wrong */
  memset(back, 0, n);
  CHECK_OK(pm_memcpy(back, dev, n, PM_COPY_D2H));
  CHECK(!pm_test_fill_ok(back, n, 51));
  CHECK(memcmp(back, src + 1, n - 1) == 0); /* shifted by one byte, exactly */
  CHECK_OK(pm_memcpy(dev, src, n, PM_COPY_H2D)); /* the next copy is right */
  CHECK_OK(pm_memcpy(back, dev, n, PM_COPY_D2H));
  CHECK(pm_test_fill_ok(back, n, 51));
  pm__fault_reset();
  CHECK_OK(pm__fault_configure("all=1+"));
  CHECK(pm_memcpy(dev, src, n, PM_COPY_H2D) != PM_OK); /* an error, never wrong bytes */
  pm__fault_reset();
  CHECK_OK(pm_memcpy(dev, src, n, PM_COPY_H2D));
  CHECK_OK(pm_memcpy(back, dev, n, PM_COPY_D2H));
  CHECK(pm_test_fill_ok(back, n, 51));
  CHECK_OK(pm_device_free(dev));
  free(src);
  free(back);
}

static void sweep(const scenario_t *sc, int K, int rate_runs) {
  tally_t before = g_total;
  pm__fault_counts_t base;
  run_one(sc, 0, "count", PM__FAULT_ALL, 0, 0, 1, &base);
  int nth_runs = 0;
  for (int op = 0; op < PM__FAULT_COUNT; op++) {
    uint64_t n = is_release(op) ? 0 : base.calls[op];
    if (n > (uint64_t)K) n = (uint64_t)K;
    for (uint64_t k = 1; k <= n; k++) {
      char mode[64];
      snprintf(mode, sizeof mode, "%s=%llu", pm__fault_op_name((pm__fault_op_t)op),
               (unsigned long long)k);
      run_one(sc, (int)k, mode, (pm__fault_op_t)op, k, 0, 1, NULL);
      nth_runs++;
    }
  }
  static const double rates[] = {0.03, 0.1, 0.3};
  for (int i = 0; i < rate_runs; i++) {
    double r = rates[i % 3];
    char mode[64];
    snprintf(mode, sizeof mode, "all=rate:%g,seed=%d", r, i + 1);
    run_one(sc, i, mode, PM__FAULT_ALL, 0, r, (uint64_t)i + 1, NULL);
  }
  printf("  %-9s backend calls per clean run %4llu; runs %4d (nth %d, random %d); public calls "
         "%6llu; faults injected %5llu: surfaced as errors in %llu runs, absorbed in %llu; "
         "errors %llu (%llu naming the injected fault); byte checks passed %llu\n",
         sc->name, (unsigned long long)base.total_calls, nth_runs + rate_runs + 1, nth_runs,
         rate_runs, (unsigned long long)(g_total.ops - before.ops),
         (unsigned long long)(g_total.injected - before.injected),
         (unsigned long long)(g_total.surfaced - before.surfaced),
         (unsigned long long)(g_total.absorbed - before.absorbed),
         (unsigned long long)(g_total.errors - before.errors),
         (unsigned long long)(g_total.errors_named - before.errors_named),
         (unsigned long long)(g_total.verified - before.verified));
  fflush(stdout);
}

/* ---- release calls: a failed release leaves the object as it was, and a retry works --------- */

static void test_release_faults(void) {
  void *d = NULL;
  REQUIRE_OK(pm_device_alloc(4096, &d));
  REQUIRE_OK(pm__fault_set(PM__FAULT_DEVICE_FREE, 1, 0));
  CHECK_ERR_MSG(pm_device_free(d), PM_ERR_BACKEND);
  CHECK(strstr(pm_last_error(), "injected fault") != NULL);
  pm_pointer_info_t info;
  CHECK_OK(pm_pointer_query(d, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_DEVICE); /* still tracked */
  CHECK_OK(pm_device_free(d));
  CHECK_ST(pm_device_free(d), PM_ERR_NOT_FOUND);

  size_t n = 64 * 1024;
  char *buf = NULL;
  REQUIRE(posix_memalign((void **)&buf, 4096, n) == 0);
  REQUIRE_OK(pm_register(buf, n, 0));
  REQUIRE_OK(pm__fault_set(PM__FAULT_HOST_UNREGISTER, 1, 0));
  pm_status_t st = pm_unregister(buf);
  CHECK(st < 0 && strstr(pm_last_error(), "injected fault") != NULL);
  CHECK_OK(pm_pointer_query(buf, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_REGISTERED);
  pm_pool_stats_t ds;
  CHECK_OK(pm_pool_get_stats(NULL, &ds));
  CHECK_EQ_SIZE(ds.registered_bytes, n); /* still charged while still pinned */
  CHECK_OK(pm_unregister(buf));
  CHECK_OK(pm_pool_get_stats(NULL, &ds));
  CHECK_EQ_SIZE(ds.registered_bytes, 0);
  free(buf);

  pm_stream_t s = NULL;
  pm_event_t e = NULL;
  REQUIRE_OK(pm_stream_create(&s));
  REQUIRE_OK(pm_event_create(0, &e));
  REQUIRE_OK(pm__fault_configure("stream_destroy=1,event_destroy=1"));
  CHECK_ERR_MSG(pm_stream_destroy(s), PM_ERR_BACKEND);
  CHECK_ERR_MSG(pm_event_destroy(e), PM_ERR_BACKEND);
  CHECK_OK(pm_event_record(e, s)); /* both still work */
  CHECK_OK(pm_event_synchronize(e));
  CHECK_OK(pm_event_destroy(e));
  CHECK_OK(pm_stream_destroy(s));

  void *m = NULL;
  REQUIRE_OK(pm_managed_alloc(8192, &m));
  REQUIRE_OK(pm__fault_set(PM__FAULT_MANAGED_FREE, 1, 0));
  CHECK_ERR_MSG(pm_managed_free(m), PM_ERR_BACKEND);
  CHECK_OK(pm_managed_free(m));
  pm__fault_reset();

  /* A fast-pinned segment whose unregistration fails keeps its mapping (finding 3 of
   * docs/RELIABILITY.md): the pages stay locked either way, and an unmapped address still
   * registered with the backend would make the next segment mapped there fail to pin. So after
   * the failed trim, new segments of the same size pin fine. */
  if (g_light) { /* 3 x 8 MiB segments: too much for valgrind's and ThreadSanitizer's runs */
    pm_test_skip("a failed trim keeps its 8 MiB segments mapped: not in the small configurations");
    return;
  }
  const size_t MiB = (size_t)1 << 20;
  pm_pool_config_t cfg;
  pm_pool_config_init(&cfg);
  cfg.budget = 64 * MiB;
  cfg.fast_pin_min = 4 * MiB;
  pm_pool_t *p = NULL;
  REQUIRE_OK(pm_pool_create(&cfg, &p));
  void *seg = NULL, *again[2] = {NULL, NULL};
  REQUIRE_OK(pm_host_alloc(p, 8 * MiB, 0, &seg));
  CHECK_OK(pm_host_free(seg));
  REQUIRE_OK(pm__fault_set(PM__FAULT_HOST_UNREGISTER, 1, 0));
  size_t released = 0;
  st = pm_pool_trim(p, &released);
  printf("  trim with a failing unregistration: %s%s%s\n", pm_status_name(st), st ? ": " : "",
         st ? pm_last_error() : "");
  CHECK(st < 0 && strstr(pm_last_error(), "injected fault") && strstr(pm_last_error(), "trim"));
  CHECK_EQ_SIZE(released, 8 * MiB); /* no longer counted: the budget does not wedge */
  pm__fault_reset();
  for (int i = 0; i < 2; i++) {
    st = pm_host_alloc(p, 8 * MiB, 0, &again[i]);
    if (st != PM_OK) printf("  pin after it: %s: %s\n", pm_status_name(st), pm_last_error());
    CHECK_OK(st);
  }
  for (int i = 0; i < 2; i++)
    if (again[i]) CHECK_OK(pm_host_free(again[i]));
  CHECK_OK(pm_pool_destroy(p));
}

/* ---- regressions found by the sweeps ----------------------------------------------------- */

/* A staged D2H copy whose submission fails after some of its group signals (host functions
 * that touch the copy's job) were queued, on a stream that cannot be synchronized at that
 * moment: the job must outlive the queued host functions. The stream is held busy so that they
 * run only after the call returned. (Under ASan/TSan/valgrind a job freed too early shows as a
 * use after free in the host function.) */
static void test_staged_d2h_abort(void) {
  size_t n = (size_t)2 << 20; /* 8 groups of 256 KiB */
  void *d = NULL;
  char *dst = malloc(n);
  REQUIRE(dst != NULL);
  REQUIRE_OK(pm_device_alloc(n, &d));
  pm_stream_t s = NULL;
  REQUIRE_OK(pm_stream_create(&s));
  pm_copy_options_t o;
  pm_copy_options_init(&o);
  o.path = PM_PATH_STAGED;
  REQUIRE_OK(pm_launch_busy(s, 0.05));
  REQUIRE_OK(pm__fault_configure("launch=2,stream_sync=1"));
  pm_fence_t f = (pm_fence_t)0x1;
  pm_status_t st = pm_copy_async(dst, d, n, s, &o, &f);
  pm__fault_reset();
  CHECK(st < 0);
  CHECK(f == (pm_fence_t)0x1);
  CHECK(strstr(pm_last_error(), "injected fault") != NULL);
  CHECK_OK(pm_stream_synchronize(s)); /* the queued group signals run now */
  /* The bounce block goes back to the default pool once they ran (maybe on a library thread). */
  pm_pool_stats_t ps;
  for (int i = 0; i < 10000; i++) {
    CHECK_OK(pm_pool_get_stats(NULL, &ps));
    if (ps.in_use_bytes == 0) break;
    pm_test_sleep_ms(1);
  }
  CHECK_EQ_SIZE(ps.in_use_bytes, 0);
  CHECK_OK(pm_stream_destroy(s));
  CHECK_OK(pm_device_free(d));
  free(dst);
}

/* RELIABILITY finding 16: a staged H2D copy returns its whole-copy bounce block to the pool
 * while its DMAs may still run. With no memory for the pool's stream record (pool_record) and a
 * stream that cannot be synchronized (stream_sync), the block used to be freed at once, and the
 * next copy wrote into it under the running DMA. Now the pool quarantines it: counted in the
 * stats, never handed out again (nor freeable twice), and released when the pool is destroyed. */
static void test_bounce_quarantine(void) {
  size_t n = ((size_t)1 << 20) + 3 * 4096 + 7; /* odd size; its own segment (>= 1 MiB) */
  char *src = malloc(n), *back = malloc(n);
  REQUIRE(src != NULL && back != NULL);
  pm_test_fill(src, n, 16);
  void *d = NULL;
  REQUIRE_OK(pm_device_alloc(n, &d));
  pm_stream_t s = NULL;
  REQUIRE_OK(pm_stream_create(&s));
  pm_pool_t *pool = NULL;
  REQUIRE_OK(pm_pool_create(NULL, &pool));
  size_t registry0 = pm__registry_count();
  REQUIRE_OK(pm_option_set("copy_bounce", "whole"));

  /* The copy's bounce block is this block: the pool caches it and hands it out again. */
  void *bounce = NULL;
  REQUIRE_OK(pm_host_alloc(pool, n, PM_HOST_DEFAULT, &bounce));
  CHECK_OK(pm_host_free(bounce));

  pm_copy_options_t o;
  pm_copy_options_init(&o);
  o.path = PM_PATH_STAGED;
  o.pool = pool;
  REQUIRE_OK(pm__fault_configure("pool_record=1,stream_sync=1"));
  pm_status_t st = pm_copy_async(d, src, n, s, &o, NULL);
  pm__fault_counts_t fc;
  pm__fault_counts(&fc);
  pm__fault_reset();
  CHECK_OK(st);
  CHECK(fc.injected[PM__FAULT_POOL_RECORD] == 1);
  CHECK(fc.injected[PM__FAULT_STREAM_SYNC] == 1);

  pm_pool_stats_t ps;
  CHECK_OK(pm_pool_get_stats(pool, &ps));
  CHECK(ps.quarantined_blocks == 1);
  CHECK(ps.quarantined_bytes >= n);
  CHECK_EQ_SIZE(ps.in_use_bytes, 0);
  CHECK(ps.pending_bytes >= ps.quarantined_bytes);
  CHECK_EQ_SIZE(ps.pinned_bytes, ps.cached_bytes + ps.pending_bytes + ps.registered_bytes);
  pm_pointer_info_t info;
  CHECK_OK(pm_pointer_query(bounce, &info));
  CHECK(info.kind == PM_MEMORY_POOL && info.pool == pool && !info.in_use);
  CHECK_ERR_MSG(pm_host_free(bounce), PM_ERR_DOUBLE_FREE);

  /* Never handed out again: not by allocations of its size or smaller, nor after a trim. */
  size_t trimmed = 0;
  CHECK_OK(pm_pool_trim(pool, &trimmed));
  CHECK_OK(pm_pool_get_stats(pool, &ps));
  CHECK(ps.quarantined_blocks == 1 && ps.pinned_bytes >= ps.quarantined_bytes);
  void *blocks[8] = {NULL};
  for (int i = 0; i < 8; i++) {
    size_t want = i == 0 ? n : n >> i;
    REQUIRE_OK(pm_host_alloc(pool, want, PM_HOST_DEFAULT, &blocks[i]));
    const char *b = blocks[i], *q = bounce;
    pm_test_checks++;
    if (b + want > q && b < q + n)
      PM_TEST_FAIL_AT(__FILE__, __LINE__, "a %zu-byte block at %p overlaps the quarantined %p",
                      want, blocks[i], bounce);
  }
  for (int i = 0; i < 8; i++) CHECK_OK(pm_host_free(blocks[i]));

  /* The copy itself delivered its bytes. */
  CHECK_OK(pm_stream_synchronize(s));
  CHECK_OK(pm_memcpy(back, d, n, PM_COPY_D2H));
  CHECK(pm_test_fill_ok(back, n, 16));

  /* Destroy waits for the device and gives the quarantined memory back. */
  CHECK_OK(pm_pool_destroy(pool));
  pm_test_checks++;
  if (pm__registry_count() != registry0)
    PM_TEST_FAIL_AT(__FILE__, __LINE__, "registry holds %zu ranges after destroy, %zu before",
                    pm__registry_count(), registry0);
  CHECK_OK(pm_option_set("copy_bounce", NULL));
  CHECK_OK(pm_stream_destroy(s));
  CHECK_OK(pm_device_free(d));
  free(src);
  free(back);
}

/* ---- the spec parser and the hook API ------------------------------------------------------- */

static void test_spec(void) {
  pm__fault_counts_t fc;
  CHECK_ERR_MSG(pm__fault_configure("nosuchop=1"), PM_ERR_CONFIG);
  CHECK(strstr(pm_last_error(), "unknown op") && strstr(pm_last_error(), "host_alloc"));
  CHECK_ERR_MSG(pm__fault_configure("host_alloc"), PM_ERR_CONFIG);
  CHECK_ERR_MSG(pm__fault_configure("host_alloc=x"), PM_ERR_CONFIG);
  CHECK_ERR_MSG(pm__fault_configure("memcpy=rate:2"), PM_ERR_CONFIG);
  CHECK_ERR_MSG(pm__fault_configure("memcpy=rate:nan"), PM_ERR_CONFIG);
  CHECK_ERR_MSG(pm__fault_configure("seed=-1"), PM_ERR_CONFIG);
  CHECK_ERR_MSG(pm__fault_configure("host_alloc=1,bad"), PM_ERR_CONFIG);
  CHECK_ERR_MSG(pm__fault_set((pm__fault_op_t)PM__FAULT_COUNT, 1, 0), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm__fault_set(PM__FAULT_MEMCPY, 0, 1.5), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm__fault_configure(NULL), PM_ERR_INVALID);
  /* A bad spec arms nothing, not even its good items. */
  pm__fault_reset();
  CHECK_ST(pm__fault_configure("device_alloc=1,oops=2"), PM_ERR_CONFIG);
  void *d = NULL;
  CHECK_OK(pm_device_alloc(64, &d));
  CHECK_OK(pm_device_free(d));

  /* N: only the Nth call; N+: the Nth and all later ones; counts reset by arming. */
  CHECK_OK(pm__fault_configure(" device_alloc = 2 , event_create=2+ ,seed=9"));
  void *d1 = NULL, *d2 = NULL, *d3 = NULL;
  CHECK_OK(pm_device_alloc(64, &d1));
  CHECK_ERR_MSG(pm_device_alloc(64, &d2), PM_ERR_DEVICE_MEMORY);
  CHECK(strstr(pm_last_error(), "injected fault") && strstr(pm_last_error(), "device_alloc call 2"));
  CHECK(d2 == NULL); /* outputs only on success */
  CHECK_OK(pm_device_alloc(64, &d3));
  pm_event_t e[4] = {0};
  CHECK_OK(pm_event_create(0, &e[0]));
  CHECK_ERR_MSG(pm_event_create(0, &e[1]), PM_ERR_BACKEND);
  CHECK_ERR_MSG(pm_event_create(0, &e[2]), PM_ERR_BACKEND);
  pm__fault_counts(&fc);
  CHECK_EQ_INT(fc.calls[PM__FAULT_DEVICE_ALLOC], 3);
  CHECK_EQ_INT(fc.injected[PM__FAULT_DEVICE_ALLOC], 1);
  CHECK_EQ_INT(fc.calls[PM__FAULT_EVENT_CREATE], 3);
  CHECK_EQ_INT(fc.injected[PM__FAULT_EVENT_CREATE], 2);
  CHECK_EQ_INT(fc.total_injected, 3);
  pm__fault_reset();
  CHECK_OK(pm_event_create(0, &e[1]));
  pm__fault_counts(&fc);
  CHECK_EQ_INT(fc.total_calls, 0); /* disarmed: not even counted */
  CHECK_OK(pm_event_destroy(e[0]));
  CHECK_OK(pm_event_destroy(e[1]));
  CHECK_OK(pm_device_free(d1));
  CHECK_OK(pm_device_free(d3));

  /* rate: about the fraction asked for, and the same calls fail for the same seed. */
  int fails[2] = {0, 0};
  uint64_t pattern[2] = {0, 0};
  for (int rep = 0; rep < 2; rep++) {
    pm__fault_reset();
    CHECK_OK(pm__fault_configure("device_query=rate:0.25,seed=42"));
    for (int i = 0; i < 400; i++) {
      int cnt;
      if (pm_device_count(&cnt) != PM_OK) {
        fails[rep]++;
        if (i < 64) pattern[rep] |= 1ull << i;
      }
    }
  }
  pm__fault_reset();
  printf("  rate 0.25 over 400 calls: %d and %d failed (same pattern: %s)\n", fails[0], fails[1],
         pattern[0] == pattern[1] ? "yes" : "no");
  CHECK(fails[0] > 50 && fails[0] < 150);
  CHECK_EQ_INT(fails[0], fails[1]);
  CHECK(pattern[0] == pattern[1]);
  CHECK_OK(pm__fault_configure("all=rate:1"));
  int cnt;
  CHECK_ST(pm_device_count(&cnt), PM_ERR_BACKEND);
  d = NULL;
  CHECK_ERR_MSG(pm_device_alloc(64, &d), PM_ERR_DEVICE_MEMORY);
  pm__fault_reset();

  /* The loader's read hook. */
  CHECK(!pm__fault_io("x"));
  CHECK_OK(pm__fault_configure("io=2"));
  CHECK(!pm__fault_io("read a.npy"));
  CHECK(pm__fault_io("read b.npy"));
  CHECK(strstr(pm_last_error(), "read b.npy") && strstr(pm_last_error(), "injected fault"));
  CHECK(!pm__fault_io("read c.npy"));
  pm__fault_reset();
  CHECK_OK(pm__fault_set(PM__FAULT_IO, 0, 1.0));
  CHECK(pm__fault_io("read"));
  pm__fault_reset();
  CHECK(strcmp(pm__fault_op_name(PM__FAULT_ALL), "all") == 0);
  CHECK(strcmp(pm__fault_op_name(PM__FAULT_HOST_REGISTER), "host_register") == 0);
}

/* PINMEM_FAULT is read once per process, at the first pm_init: check it in fresh processes
 * (this program again, with an argument). A malformed spec stops pm_init with the reason; a good
 * one arms faults from the start. */
static int env_child(const char *which) {
  if (!strcmp(which, "env-bad")) {
    pm_status_t st = pm_init();
    int ok = st == PM_ERR_CONFIG && strstr(pm_last_error(), "PINMEM_FAULT") &&
             strstr(pm_last_error(), "unknown op");
    printf("    PINMEM_FAULT=%s: pm_init: %s: %s\n", getenv("PINMEM_FAULT"), pm_status_name(st),
           pm_last_error());
    return ok ? 0 : 1;
  }
  pm_status_t st = pm_init();
  if (st != PM_OK) return 2;
  void *a = NULL, *b = NULL;
  int bad = 0;
  bad += pm_device_alloc(64, &a) != PM_OK;
  st = pm_device_alloc(64, &b);
  bad += st != PM_ERR_DEVICE_MEMORY || !strstr(pm_last_error(), "injected fault");
  printf("    PINMEM_FAULT=%s: second pm_device_alloc: %s: %s\n", getenv("PINMEM_FAULT"),
         pm_status_name(st), pm_last_error());
  bad += pm_device_free(a) != PM_OK;
  pm__fault_counts_t fc;
  pm__fault_counts(&fc);
  bad += fc.calls[PM__FAULT_DEVICE_ALLOC] != 2 || fc.injected[PM__FAULT_DEVICE_ALLOC] != 1;
  bad += pm_finalize() != PM_OK;
  return bad ? 1 : 0;
}

static void test_env(const char *self) {
  static const struct {
    const char *arg, *spec;
  } cases[] = {{"env-bad", "host_alloc=1,frobnicate=2"}, {"env-good", "device_alloc=2,seed=3"}};
  for (int i = 0; i < 2; i++) {
    fflush(stdout);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      setenv("PINMEM_FAULT", cases[i].spec, 1);
      execl(self, self, cases[i].arg, (char *)NULL);
      _exit(127);
    }
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    pm_test_checks++;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
      PM_TEST_FAIL_AT(__FILE__, __LINE__, "PINMEM_FAULT=%s child: status 0x%x", cases[i].spec,
                      status);
  }
}

/* ---- resource limits ------------------------------------------------------------------------ */

static void test_budget_limits(void) {
  const size_t MiB = (size_t)1 << 20;
  pm_pool_config_t cfg;
  pm_pool_config_init(&cfg);
  cfg.budget = 4 * MiB;
  cfg.exhaust_policy = PM_EXHAUST_FAIL;
  pm_pool_t *p = NULL;
  REQUIRE_OK(pm_pool_create(&cfg, &p));
  void *a = NULL, *b = NULL, *x = (void *)0x1;
  CHECK_OK(pm_host_alloc(p, 3 * MiB, 0, &a));
  CHECK_ERR_MSG(pm_host_alloc(p, 2 * MiB, 0, &x), PM_ERR_BUDGET);
  CHECK(x == (void *)0x1);
  printf("  budget 4 MiB, 3 MiB held, 2 MiB more: %s\n", pm_last_error());
  CHECK(strstr(pm_last_error(), "4194304") != NULL); /* the budget, in the detail */
  CHECK_ERR_MSG(pm_host_alloc(p, 5 * MiB, 0, &x), PM_ERR_BUDGET); /* can never fit: at once */
  CHECK(strstr(pm_last_error(), "budget") != NULL);
  CHECK_OK(pm_host_free(a));
  CHECK_OK(pm_host_alloc(p, 2 * MiB, 0, &b)); /* the cache is trimmed to make room */
  CHECK_OK(pm_host_free(b));

  /* A staged copy whose pool cannot hold a whole bounce block uses the ring and still arrives;
   * one whose pool cannot hold even one slot is refused with the reason. */
  size_t n = (g_small ? 3 : 9) * MiB + 5;
  char *src = malloc(n), *dst = malloc(n);
  void *d = NULL;
  REQUIRE(src && dst);
  REQUIRE_OK(pm_device_alloc(n, &d));
  pm_test_fill(src, n, 77);
  pm_copy_options_t o;
  pm_copy_options_init(&o);
  o.pool = p;
  o.path = PM_PATH_STAGED;
  pm_fence_t f = NULL;
  CHECK_OK(pm_copy_async(d, src, n, NULL, &o, &f));
  if (f) {
    CHECK_OK(pm_fence_wait(f));
    CHECK_OK(pm_fence_release(f));
  }
  CHECK_OK(pm_copy_async(dst, d, n, NULL, &o, &f));
  if (f) {
    CHECK_OK(pm_fence_wait(f));
    CHECK_OK(pm_fence_release(f));
  }
  CHECK(memcmp(src, dst, n) == 0);
  pm_pool_stats_t s;
  CHECK_OK(pm_pool_get_stats(p, &s));
  CHECK_LE_SIZE(s.pinned_peak, 4 * MiB);
  CHECK_EQ_SIZE(s.in_use_bytes, 0);

  pm_pool_t *t = NULL;
  cfg.budget = 64 * 1024;
  REQUIRE_OK(pm_pool_create(&cfg, &t));
  o.pool = t;
  f = (pm_fence_t)0x1;
  CHECK_ERR_MSG(pm_copy_async(d, src, n, NULL, &o, &f), PM_ERR_BUDGET);
  printf("  staging through a 64 KiB budget: %s\n", pm_last_error());
  CHECK(f == (pm_fence_t)0x1);
  CHECK_OK(pm_device_synchronize());
  /* A copy smaller than a chunk needs a slot of its own size, not a whole copy_chunk: 5000
   * bytes arrive through the same 64 KiB budget. */
  memset(dst, 0, 5000);
  f = NULL;
  CHECK_OK(pm_copy_async(d, src, 5000, NULL, &o, &f));
  if (f) {
    CHECK_OK(pm_fence_wait(f));
    CHECK_OK(pm_fence_release(f));
  }
  CHECK_OK(pm_memcpy(dst, d, 5000, PM_COPY_D2H));
  CHECK(memcmp(src, dst, 5000) == 0);
  CHECK_OK(pm_pool_destroy(t));

  /* Waiting policy: the allocation waits up to the timeout, then fails and says so. */
  cfg.budget = 2 * MiB;
  cfg.exhaust_policy = PM_EXHAUST_WAIT;
  cfg.wait_timeout_s = 0.05;
  REQUIRE_OK(pm_pool_create(&cfg, &t));
  CHECK_OK(pm_host_alloc(t, 2 * MiB, 0, &a));
  CHECK_ERR_MSG(pm_host_alloc(t, 4096, 0, &x), PM_ERR_BUDGET);
  CHECK(strstr(pm_last_error(), "waited") != NULL);
  CHECK_OK(pm_host_free(a));
  CHECK_OK(pm_pool_destroy(t));

  /* Registration is charged to the default pool's budget. */
  pm_pool_stats_t ds;
  CHECK_OK(pm_pool_get_stats(NULL, &ds));
  size_t old_budget = ds.budget;
  size_t rel;
  CHECK_OK(pm_pool_trim(NULL, &rel));
  CHECK_OK(pm_pool_set_budget(NULL, 4 * MiB));
  char *big = NULL;
  REQUIRE(posix_memalign((void **)&big, 4096, 8 * MiB) == 0);
  CHECK_ERR_MSG(pm_register(big, 8 * MiB, 0), PM_ERR_BUDGET);
  CHECK(strstr(pm_last_error(), "pm_register") != NULL);
  pm_pointer_info_t info;
  CHECK_OK(pm_pointer_query(big, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_PAGEABLE); /* nothing left of the attempt */
  CHECK_OK(pm_register(big, 2 * MiB, 0));
  CHECK_OK(pm_unregister(big));
  CHECK_OK(pm_pool_set_budget(NULL, old_budget));
  free(big);

  CHECK_OK(pm_device_free(d));
  free(src);
  free(dst);
  CHECK_OK(pm_pool_destroy(p));
}

static void test_device_memory_limit(void) {
  if (!g_host) {
    printf("  simulated device memory: host backend only\n");
    return;
  }
  REQUIRE_OK(pm_option_set("host_device_memory", "1M"));
  void *a = NULL, *b = NULL, *x = (void *)0x1;
  CHECK_ERR_MSG(pm_device_alloc((size_t)2 << 20, &x), PM_ERR_DEVICE_MEMORY);
  printf("  host_device_memory 1M, 2 MiB asked: %s\n", pm_last_error());
  CHECK(strstr(pm_last_error(), "host_device_memory") != NULL);
  CHECK(strstr(pm_last_error(), "1048576") != NULL);
  CHECK(x == (void *)0x1);
  CHECK_OK(pm_device_alloc(512 << 10, &a));
  CHECK_ERR_MSG(pm_device_alloc(768 << 10, &b), PM_ERR_DEVICE_MEMORY);
  CHECK(strstr(pm_last_error(), "in use") != NULL);
  CHECK_OK(pm_device_free(a));
  CHECK_OK(pm_device_alloc(768 << 10, &b));
  CHECK_OK(pm_device_free(b));
  CHECK_OK(pm_option_set("host_device_memory", NULL));
}

#ifndef PINMEM_TEST_CLI
#define PINMEM_TEST_CLI ""
#endif

#define MEMLOCK_LIMIT ((size_t)256 * 1024)

/* The CLI the memlock child runs: the copy test_memlock_limit made where nobody may execute it,
 * else the build's own. */
static const char *memlock_cli(void) {
  const char *copy = getenv("PINMEM_TEST_MEMLOCK_CLI");
  return copy && copy[0] ? copy : PINMEM_TEST_CLI;
}

/* Copy src to dst with mode 0755 (a program the unprivileged user can run); false on failure. */
static bool copy_program(const char *src, const char *dst) {
  int in = open(src, O_RDONLY | O_CLOEXEC);
  if (in < 0) return false;
  int out = open(dst, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0755);
  bool ok = out >= 0;
  char buf[65536];
  ssize_t n;
  while (ok && (n = read(in, buf, sizeof buf)) != 0) {
    if (n < 0) {
      ok = false;
      break;
    }
    for (ssize_t done = 0; ok && done < n;) {
      ssize_t w = write(out, buf + done, (size_t)(n - done));
      ok = w > 0;
      done += w > 0 ? w : 0;
    }
  }
  close(in);
  if (out >= 0) ok = close(out) == 0 && ok;
  return ok && chmod(dst, 0755) == 0;
}

#define CHILD_CHECK(cond)                                                                  \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      bad++;                                                                               \
      printf("    child FAIL line %d: %s (%s)\n", __LINE__, #cond, pm_last_error());       \
    }                                                                                      \
  } while (0)

/* A fresh process (exec'd by test_memlock_limit) that cannot lock more than 256 KiB: pinmem
 * starts here, under the limit, as a user's program would. */
static int memlock_child(void) {
  const size_t lim = MEMLOCK_LIMIT, MiB = (size_t)1 << 20;
  int bad = 0;
  CHILD_CHECK(pm__memlock_limit() == lim);

  /* `pinmem info` shows the limit, its value and that it binds. The parent made sure this user
   * can run it (a copy where the build tree is closed to it). */
  const char *cli = memlock_cli();
  if (cli[0]) {
    CHILD_CHECK(access(cli, X_OK) == 0);
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "'%s' info 2>&1", cli);
    FILE *f = popen(cmd, "r");
    char out[16384];
    size_t got = f ? fread(out, 1, sizeof out - 1, f) : 0;
    out[got] = '\0';
    int rc = f ? pclose(f) : -1;
    CHILD_CHECK(rc == 0);
    const char *row = strstr(out, "RLIMIT_MEMLOCK");
    CHILD_CHECK(row != NULL);
    CHILD_CHECK(row && strstr(row, "262144") != NULL);
    CHILD_CHECK(row && strstr(row, "limited") != NULL);
    const char *eol = row ? strchr(row, '\n') : NULL;
    if (row) printf("    pinmem info: %.*s\n", (int)(eol ? eol - row : 80), row);
  }

  /* Sanitizer runtimes make mlock a no-op that never fails: the rest cannot fail there. */
  static char probe[2 * 256 * 1024];
  if (mlock(probe, sizeof probe) == 0) {
    fflush(stdout);
    return bad ? 1 : 78;
  }
  if (pm_init() != PM_OK) return 2;

  /* The default pool's automatic budget is capped at the limit, so what cannot be pinned is
   * refused by the budget, before any mlock. */
  pm_pool_stats_t ds;
  CHILD_CHECK(pm_pool_get_stats(NULL, &ds) == PM_OK && ds.budget == lim);
  void *x = (void *)0x1, *ok = NULL;
  pm_status_t st = pm_host_alloc(NULL, MiB, 0, &x);
  printf("    default pool, pm_host_alloc(1 MiB): %s: %s\n", pm_status_name(st), pm_last_error());
  CHILD_CHECK(st < 0 && strstr(pm_last_error(), "262144") && x == (void *)0x1);
  CHILD_CHECK(pm_host_alloc(NULL, 8192, 0, &ok) == PM_OK); /* within the limit it works */
  CHILD_CHECK(pm_host_free(ok) == PM_OK);

  /* Registration beyond the limit, charged to the same budget. */
  char *buf = mmap(NULL, MiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHILD_CHECK(buf != MAP_FAILED);
  st = pm_register(buf, MiB, 0);
  printf("    pm_register(1 MiB): %s: %s\n", pm_status_name(st), pm_last_error());
  CHILD_CHECK(st == PM_ERR_BUDGET || st == PM_ERR_MEMLOCK);
  CHILD_CHECK(pm_pool_get_stats(NULL, &ds) == PM_OK && ds.registered_bytes == 0);
  CHILD_CHECK(pm_register(buf, 64 * 1024, 0) == PM_OK);
  CHILD_CHECK(pm_unregister(buf) == PM_OK);
  munmap(buf, MiB);

  /* A pool whose explicit budget is above the limit: the backend's mlock fails and says why. */
  pm_pool_config_t cfg;
  pm_pool_config_init(&cfg);
  cfg.budget = 64 * MiB;
  pm_pool_t *p = NULL;
  CHILD_CHECK(pm_pool_create(&cfg, &p) == PM_OK);
  st = pm_host_alloc(p, MiB, 0, &x);
  printf("    pool with a 64 MiB budget, pm_host_alloc(1 MiB): %s: %s\n", pm_status_name(st),
         pm_last_error());
  CHILD_CHECK(st == PM_ERR_MEMLOCK);
  CHILD_CHECK(strstr(pm_last_error(), "RLIMIT_MEMLOCK") && strstr(pm_last_error(), "262144") &&
              strstr(pm_last_error(), "ulimit -l"));
  CHILD_CHECK(x == (void *)0x1);
  st = pm_host_alloc(p, 8 * MiB, 0, &x); /* fast-pinned: mmap + touch + register */
  CHILD_CHECK(st == PM_ERR_MEMLOCK);
  pm_pool_stats_t s;
  CHILD_CHECK(pm_pool_get_stats(p, &s) == PM_OK && s.pinned_bytes == 0 && s.segments == 0);
  /* A small request prefers a shared 2 MiB segment; when that cannot be pinned the pool pins
   * just what the request needs (finding 5 of docs/RELIABILITY.md), within the limit. */
  st = pm_host_alloc(p, 8192, 0, &x);
  printf("    same pool, pm_host_alloc(8 KiB): %s%s%s\n", pm_status_name(st),
         st ? ": " : "", st ? pm_last_error() : "");
  CHILD_CHECK(st == PM_OK);
  CHILD_CHECK(pm_pool_get_stats(p, &s) == PM_OK && s.pinned_bytes > 0 &&
              s.pinned_bytes <= 64 * 1024 && s.segments == 1);
  if (st == PM_OK) CHILD_CHECK(pm_host_free(x) == PM_OK);
  CHILD_CHECK(pm_pool_trim(p, NULL) == PM_OK);
  CHILD_CHECK(pm_pool_reserve(p, 128 * 1024, 0) == PM_OK);
  CHILD_CHECK(pm_pool_destroy(p) == PM_OK);
  CHILD_CHECK(pm_finalize() == PM_OK);
  fflush(stdout);
  return bad ? 1 : 0;
}

/* RLIMIT_MEMLOCK set low; root drops to nobody, losing CAP_IPC_LOCK, then runs this program
 * again (memlock_child) so pinmem starts under the limit. */
static void test_memlock_limit(const char *self) {
  if (!g_host) {
    printf("  RLIMIT_MEMLOCK: host backend only (cudaHostAlloc does not count against it)\n");
    return;
  }
  /* Root runs the child as nobody, who may not be able to reach the build tree (a checkout under
   * /root): copies of this program and of the CLI in a scratch folder open to all run instead. */
  char dir[512] = "", prog[600], cli[600];
  const char *run = self;
  if (geteuid() == 0 && pm_test_tmpdir(dir, sizeof dir, "memlock") && chmod(dir, 0755) == 0) {
    snprintf(prog, sizeof prog, "%s/test_faults", dir);
    snprintf(cli, sizeof cli, "%s/pinmem", dir);
    if (copy_program(self, prog)) run = prog;
    if (PINMEM_TEST_CLI[0] && copy_program(PINMEM_TEST_CLI, cli))
      setenv("PINMEM_TEST_MEMLOCK_CLI", cli, 1);
  }
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    if (!pm_test_limit_memlock(MEMLOCK_LIMIT)) _exit(PM_TEST_SKIP);
    if (access(run, X_OK) != 0 || (memlock_cli()[0] && access(memlock_cli(), X_OK) != 0))
      _exit(76); /* neither the build tree nor the scratch folder is open to nobody */
    execl(run, run, "memlock", (char *)NULL);
    _exit(127);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  unsetenv("PINMEM_TEST_MEMLOCK_CLI");
  if (dir[0]) pm_test_rmtree(dir);
  CHECK(WIFEXITED(status));
  int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (rc == 77) {
    pm_test_skip("RLIMIT_MEMLOCK check: could not drop the right to lock memory");
    return;
  }
  if (rc == 76) {
    pm_test_skip("RLIMIT_MEMLOCK check: the unprivileged user can execute neither %s nor a copy "
                 "under %s",
                 self, dir[0] ? dir : "TMPDIR (no scratch folder could be made)");
    return;
  }
  if (rc == 78) {
    pm_test_skip("RLIMIT_MEMLOCK allocation checks: mlock does not enforce the limit in this "
                 "build (sanitizers make it a no-op); the pinmem info check ran");
    return;
  }
  CHECK_EQ_INT(rc, 0);
}

int main(int argc, char **argv) {
  if (argc > 1) return strcmp(argv[1], "memlock") ? env_child(argv[1]) : memlock_child();
  pm_test_init();
  g_small = pm_test_small();
  g_light = g_small || PM_TSAN;
  g_host = pm_backend_kind() == PM_BACKEND_HOST;
  g_page = pm__page_size();
  signal(SIGALRM, on_alarm);
  /* Small chunks so staged copies of a few MiB take many units and the ring has 4 slots of
   * 256 KiB in a 1 MiB pool. */
  REQUIRE_OK(pm_option_set("copy_chunk", "256K"));
  REQUIRE_OK(pm_option_set("copy_stage_min", "64K"));
  REQUIRE_OK(pm_option_set("copy_threads", "2"));

  printf("fault spec and hooks\n");
  test_spec();
  test_env(strchr(argv[0], '/') ? argv[0] : "/proc/self/exe");
  printf("release calls\n");
  test_release_faults();
  printf("wrong bytes (corrupt)\n");
  test_corrupt();
  printf("regressions\n");
  test_staged_d2h_abort();
  test_bounce_quarantine();

  baseline();
  int K = g_small ? 3 : PM_TSAN ? 6 : 12;
  int rate_runs = g_small ? 3 : PM_TSAN ? 9 : 24;
  printf("faults at each of the first %d calls of every op, then %d runs at random rates:\n", K,
         rate_runs);
  for (size_t i = 0; i < sizeof scenarios / sizeof scenarios[0]; i++)
    sweep(&scenarios[i], K, rate_runs);
  /* The copy scenario again with ring slots filled in pieces by both threads (copy_piece). */
  REQUIRE_OK(pm_option_set("copy_piece", "64K"));
  unsigned long slabs = pm__stage_slab_count();
  sweep(&scenarios[3], K, rate_runs);
  CHECK(pm__stage_slab_count() > slabs);
  CHECK_OK(pm_option_set("copy_piece", NULL));
  printf("total: %llu runs, %llu public calls, %llu faults injected; runs with a fault: %llu "
         "surfaced as an error status, %llu absorbed with verified results; %llu error statuses "
         "(%llu naming the injected fault), %llu byte checks passed\n",
         (unsigned long long)g_total.runs, (unsigned long long)g_total.ops,
         (unsigned long long)g_total.injected, (unsigned long long)g_total.surfaced,
         (unsigned long long)g_total.absorbed, (unsigned long long)g_total.errors,
         (unsigned long long)g_total.errors_named, (unsigned long long)g_total.verified);
  printf("error statuses seen:");
  for (int i = 1; i < 32; i++)
    if (g_total.by_status[i])
      printf(" %s=%llu", pm_status_name((pm_status_t)-i), (unsigned long long)g_total.by_status[i]);
  printf("\n");
  CHECK(g_total.injected > 0);
  CHECK(g_total.verified > 0);

  printf("resource limits\n");
  test_budget_limits();
  test_device_memory_limit();
  test_memlock_limit(strchr(argv[0], '/') ? argv[0] : "/proc/self/exe");

  CHECK_OK(pm_option_set("copy_chunk", NULL));
  CHECK_OK(pm_option_set("copy_stage_min", NULL));
  CHECK_OK(pm_option_set("copy_threads", NULL));
  CHECK_OK(pm_finalize());
  return pm_test_finish("test_faults");
}
