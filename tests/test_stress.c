/*
 * Stress: 16 threads allocating, freeing, registering and copying (pm_copy_async and
 * pm_copy_batch_async on every path, plain async copies with stream-ordered frees) with random
 * sizes against small budgets, for a fixed time, on shared pools (one failing, one waiting when
 * exhausted), the default pool and short-lived private pools. Every copy that succeeds is
 * checked byte for byte; every failure must be an expected one (the budget) with a detail. A
 * second phase does the same with faults injected at random into every backend op (fault.c):
 * then any failure with a detail is fine, but no successful copy may deliver wrong bytes, and
 * when the threads stop everything must come back (pools empty and destroyable, registrations
 * gone). Runs under TSan in make test; counts are printed.
 *
 * Then loaders: 6 threads create loaders with random configurations (copies whole or in parts)
 * over a callback dataset and a .npy file, on the shared pools and the default one, take a
 * random number of batches (most loaders are destroyed mid-epoch, some with batches still held),
 * verify every row, and destroy them; again with faults in every backend op and in the file
 * reads.
 *
 * PINMEM_STRESS_SECONDS overrides the time per phase (default 2 s, 0.5 s with PINMEM_TEST_SMALL).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "internal.h"

#define THREADS 16
#define HELD_MAX 8
#define DEV_BYTES ((size_t)2 << 20)

enum {
  OP_ALLOC,
  OP_FREE,
  OP_REGISTER,
  OP_COPY_DIRECT,
  OP_COPY_STAGED,
  OP_COPY_BATCH,
  OP_COPY_SMALL,
  OP_ASYNC_FREE,
  OP_TRIM,
  OP_PRIVATE_POOL,
  OP_KINDS
};
static const char *op_names[OP_KINDS] = {"alloc",       "free",       "register",   "copy-direct",
                                         "copy-staged", "copy-batch", "copy-small", "async-free",
                                         "trim",        "pool-churn"};

static pm_pool_t *g_pools[2]; /* [0]: fail when exhausted, [1]: wait */
static atomic_bool g_stop;
static bool g_faults; /* phase 2 */
static bool g_small;

typedef struct worker {
  int id;
  uint64_t rng;
  pm_stream_t stream;
  char *dev;          /* this thread's device buffer */
  void *held[HELD_MAX];
  size_t held_n[HELD_MAX];
  int nheld;
  /* Memory a failed synchronize left possibly in use by queued work: freed after the phase. */
  void *graveyard[256];
  int ngrave;
  char *pageable, *pageable2; /* DEV_BYTES each */
  uint64_t ops[OP_KINDS], ok[OP_KINDS], failed[OP_KINDS], budget_refusals, bytes_verified;
  uint64_t wrong, unexpected;
  int cur_op;
  char first_unexpected[640];
  char first_wrong[256];
} worker_t;

/* Log-uniform size in [1, max]. */
static size_t rsize(worker_t *w, size_t max) {
  int bits = 0;
  while (((size_t)1 << (bits + 1)) <= max) bits++;
  size_t b = (size_t)1 << (pm_test_rand(&w->rng) % (unsigned)(bits + 1));
  size_t n = b + pm_test_rand(&w->rng) % b;
  return n > max ? max : n;
}

static void bury(worker_t *w, void *p);

/* After a failed copy, work may still be queued on this thread's stream for its buffers (a
 * fence wait that failed says nothing about the copy): wait for the stream, and when even that
 * fails, retire the buffers (freed after the phase) and take new ones. */
static void settle(worker_t *w) {
  if (pm_stream_synchronize(w->stream) == PM_OK) return;
  bury(w, w->dev);
  bury(w, w->pageable);
  bury(w, w->pageable2);
  w->dev = NULL;
  for (int i = 0; i < 100 && !w->dev; i++) {
    void *d = NULL;
    if (pm_device_alloc(DEV_BYTES, &d) == PM_OK) w->dev = d;
  }
  w->pageable = malloc(DEV_BYTES);
  w->pageable2 = malloc(DEV_BYTES);
  if (!w->pageable || !w->pageable2) abort();
}

/* A failure is expected when the budget refused, or (phase 2) when anything failed with a
 * detail; otherwise it is counted as unexpected with its text. */
static void failure(worker_t *w, int op, pm_status_t st) {
  w->failed[op]++;
  /* The detail is the failed call's: taken before settle(), whose own calls (a stream that a
   * fault left failed, then fresh allocations) set or clear this thread's last error. */
  char detail[sizeof w->first_unexpected];
  snprintf(detail, sizeof detail, "%s", pm_last_error());
  char cleared[256];
  snprintf(cleared, sizeof cleared, "%s", pm__cleared_error());
  if (op != OP_ALLOC && op != OP_FREE && op != OP_TRIM && op != OP_PRIVATE_POOL) settle(w);
  if (st == PM_ERR_BUDGET) {
    w->budget_refusals++;
    return;
  }
  bool ok = g_faults && detail[0] && st != PM_ERR_INVALID && st != PM_ERR_INTERNAL &&
            st != PM_ERR_NOT_FOUND && st != PM_ERR_DOUBLE_FREE && st != PM_ERR_WRONG_KIND;
  if (ok) return;
  if (w->unexpected++) return;
  /* A failure with no detail is a defect of its own: say what a clear on its way out took. */
  if (!detail[0]) snprintf(detail, sizeof detail, "(no detail) [last detail cleared on this "
                           "thread: %s]", cleared);
  snprintf(w->first_unexpected, sizeof w->first_unexpected, "%s: %s: %.400s", op_names[op],
           pm_status_name(st), detail);
}

static void wrong(worker_t *w, const char *what) {
  if (!w->wrong++)
    snprintf(w->first_wrong, sizeof w->first_wrong, "%s: %s (last error: %s)",
             op_names[w->cur_op], what, pm_last_error());
}

static void verify(worker_t *w, const void *got, const void *want, size_t n) {
  if (memcmp(got, want, n) != 0) {
    size_t i = 0;
    while (((const char *)got)[i] == ((const char *)want)[i]) i++;
    char what[96];
    snprintf(what, sizeof what, "%zu bytes differ from byte %zu on", n, i);
    wrong(w, what);
  } else {
    w->bytes_verified += n;
  }
}

static void bury(worker_t *w, void *p) {
  if (!p) return;
  if (w->ngrave < 256)
    w->graveyard[w->ngrave++] = p;
  else
    (void)pm_stream_synchronize(w->stream); /* best effort: the phase keeps going */
}

static pm_status_t fence_done(pm_fence_t f) {
  pm_status_t st = pm_fence_wait(f);
  pm_fence_release(f);
  return st;
}

/* Pool memory from one of the shared pools or the default one. */
static pm_pool_t *pick_pool(worker_t *w) {
  uint64_t r = pm_test_rand(&w->rng) % 3;
  return r == 2 ? NULL : g_pools[r];
}

static void op_alloc(worker_t *w) {
  if (w->nheld == HELD_MAX) {
    w->ops[OP_ALLOC]--; /* nothing done: not an operation */
    return;
  }
  size_t n = rsize(w, (size_t)1 << 20);
  unsigned flags = (unsigned)(pm_test_rand(&w->rng) % 8) & (PM_HOST_MAPPED | PM_HOST_PORTABLE);
  void *p = NULL;
  pm_status_t st = pm_host_alloc(pick_pool(w), n, flags, &p);
  if (st != PM_OK) return failure(w, OP_ALLOC, st);
  memset(p, (int)(w->id + 1), n);
  w->held[w->nheld] = p;
  w->held_n[w->nheld++] = n;
  w->ok[OP_ALLOC]++;
}

static void op_free(worker_t *w) {
  if (!w->nheld) {
    w->ops[OP_FREE]--;
    return;
  }
  int i = (int)(pm_test_rand(&w->rng) % (uint64_t)w->nheld);
  void *p = w->held[i];
  size_t n = w->held_n[i];
  /* Nobody else wrote it. */
  unsigned char *b = p;
  if (b[0] != (unsigned char)(w->id + 1) || b[n - 1] != (unsigned char)(w->id + 1))
    wrong(w, "a held block was overwritten");
  w->held[i] = w->held[--w->nheld];
  w->held_n[i] = w->held_n[w->nheld];
  pm_status_t st = pm_host_free(p);
  if (st != PM_OK) return failure(w, OP_FREE, st);
  w->ok[OP_FREE]++;
}

static void op_register(worker_t *w) {
  size_t n = pm__align_up(rsize(w, (size_t)512 << 10), 4096);
  char *buf = NULL;
  if (posix_memalign((void **)&buf, 4096, n) != 0) return;
  pm_test_fill(buf, n, pm_test_rand(&w->rng));
  pm_status_t st = pm_register(buf, n, (pm_test_rand(&w->rng) & 1) ? PM_REGISTER_MAPPED : 0);
  if (st != PM_OK) {
    free(buf);
    return failure(w, OP_REGISTER, st);
  }
  pm_pointer_info_t info;
  if (pm_pointer_query(buf + n / 2, &info) != PM_OK || info.kind != PM_MEMORY_REGISTERED ||
      info.base != buf)
    wrong(w, "pm_pointer_query does not see the registration");
  /* A direct copy out of the registration and back. */
  size_t m = n < DEV_BYTES ? n : DEV_BYTES;
  pm_fence_t f = NULL;
  st = pm_copy_async(w->dev, buf, m, w->stream, NULL, &f);
  if (st == PM_OK) st = fence_done(f);
  if (st == PM_OK) {
    st = pm_memcpy(w->pageable, w->dev, m, PM_COPY_D2H);
    if (st == PM_OK) verify(w, w->pageable, buf, m);
  }
  if (st != PM_OK) failure(w, OP_REGISTER, st);
  if (st != PM_OK && pm_stream_synchronize(w->stream) != PM_OK) {
    /* The copy may still read buf: keep it registered until the phase is over. */
    bury(w, buf);
    return;
  }
  st = pm_unregister(buf);
  if (st != PM_OK) {
    failure(w, OP_REGISTER, st);
    bury(w, buf);
    return;
  }
  free(buf);
  w->ok[OP_REGISTER]++;
}

/* H2D from `src` then D2H into `dst`, both by the copy engine with the given options. */
static pm_status_t round_trip(worker_t *w, char *dst, const char *src, size_t n,
                              const pm_copy_options_t *o) {
  pm_fence_t f = NULL;
  pm_status_t st = pm_copy_async(w->dev, src, n, w->stream, o, &f);
  if (st == PM_OK) st = fence_done(f);
  if (st != PM_OK) return st;
  st = pm_copy_async(dst, w->dev, n, w->stream, o, &f);
  if (st == PM_OK) st = fence_done(f);
  return st;
}

static void op_copy_direct(worker_t *w) {
  size_t n = rsize(w, DEV_BYTES / 2);
  pm_pool_t *pool = pick_pool(w);
  void *a = NULL, *b = NULL;
  pm_status_t st = pm_host_alloc(pool, n, 0, &a);
  if (st != PM_OK) return failure(w, OP_COPY_DIRECT, st);
  st = pm_host_alloc(pool, n, 0, &b);
  if (st != PM_OK) {
    pm_host_free(a);
    return failure(w, OP_COPY_DIRECT, st);
  }
  pm_test_fill(a, n, pm_test_rand(&w->rng));
  st = round_trip(w, b, a, n, NULL);
  if (st == PM_OK) {
    verify(w, b, a, n);
    w->ok[OP_COPY_DIRECT]++;
  } else {
    failure(w, OP_COPY_DIRECT, st);
    if (pm_stream_synchronize(w->stream) != PM_OK) {
      bury(w, a);
      bury(w, b);
      return;
    }
  }
  pm_host_free(a);
  pm_host_free(b);
}

static void op_copy_staged(worker_t *w) {
  size_t n = rsize(w, DEV_BYTES);
  size_t off = pm_test_rand(&w->rng) % 64;
  if (n + off > DEV_BYTES) n = DEV_BYTES - off;
  pm_copy_options_t o;
  pm_copy_options_init(&o);
  o.path = (pm_test_rand(&w->rng) & 1) ? PM_PATH_STAGED : PM_PATH_AUTO;
  o.pool = pick_pool(w);
  pm_test_fill(w->pageable + off, n, pm_test_rand(&w->rng));
  pm_status_t st = round_trip(w, w->pageable2 + off, w->pageable + off, n, &o);
  if (st != PM_OK) return failure(w, OP_COPY_STAGED, st);
  verify(w, w->pageable2 + off, w->pageable + off, n);
  w->ok[OP_COPY_STAGED]++;
}

static void op_copy_batch(worker_t *w) {
  pm_copy_item_t items[8];
  size_t k = 1 + pm_test_rand(&w->rng) % 8, off = 0;
  for (size_t i = 0; i < k; i++) {
    size_t n = 1 + rsize(w, DEV_BYTES / 16);
    items[i].dst = w->dev + off;
    items[i].src = w->pageable + off;
    items[i].bytes = n;
    off += n + pm_test_rand(&w->rng) % 100;
  }
  pm_test_fill(w->pageable, off, pm_test_rand(&w->rng));
  pm_copy_options_t o;
  pm_copy_options_init(&o);
  o.pool = pick_pool(w);
  pm_fence_t f = NULL;
  pm_status_t st = pm_copy_batch_async(items, k, w->stream, &o, &f);
  if (st == PM_OK) st = fence_done(f);
  if (st == PM_OK) {
    for (size_t i = 0; i < k; i++) {
      items[i].dst = w->pageable2 + ((char *)items[i].dst - w->dev);
      items[i].src = w->dev + ((const char *)items[i].src - w->pageable);
    }
    st = pm_copy_batch_async(items, k, w->stream, &o, &f);
    if (st == PM_OK) st = fence_done(f);
  }
  if (st != PM_OK) return failure(w, OP_COPY_BATCH, st);
  for (size_t i = 0; i < k; i++)
    verify(w, items[i].dst, w->pageable + ((const char *)items[i].src - w->dev), items[i].bytes);
  w->ok[OP_COPY_BATCH]++;
}

/* Small pageable copies take the plain backend copy; with a callback and no fence. */
static void cb_count(void *arg, pm_status_t st) {
  (void)st;
  atomic_fetch_add((atomic_int *)arg, 1);
}

static void op_copy_small(worker_t *w) {
  size_t n = rsize(w, 4096);
  atomic_int calls;
  atomic_init(&calls, 0);
  pm_copy_options_t o;
  pm_copy_options_init(&o);
  o.callback = cb_count;
  o.callback_arg = &calls;
  pm_test_fill(w->pageable, n, pm_test_rand(&w->rng));
  pm_status_t st = pm_copy_async(w->dev, w->pageable, n, w->stream, &o, NULL);
  if (st == PM_OK) {
    /* Without a fence the callback is the completion: wait for it (it runs exactly once). */
    for (int i = 0; i < 20000 && atomic_load(&calls) == 0; i++) {
      struct timespec ts = {0, 100000};
      nanosleep(&ts, NULL);
    }
    if (atomic_load(&calls) != 1) wrong(w, "callback did not run exactly once");
    st = pm_memcpy(w->pageable2, w->dev, n, PM_COPY_D2H);
    if (st == PM_OK) verify(w, w->pageable2, w->pageable, n);
  } else if (atomic_load(&calls) != 0) {
    wrong(w, "a refused copy's callback ran");
  }
  if (st != PM_OK) return failure(w, OP_COPY_SMALL, st);
  w->ok[OP_COPY_SMALL]++;
}

/* Plain async copy out of a pool block, record_stream, free at once: the block must not be
 * handed out again (to this or another thread) before the copy is done. */
static void op_async_free(worker_t *w) {
  size_t n = rsize(w, DEV_BYTES / 2);
  pm_pool_t *pool = pick_pool(w);
  void *a = NULL;
  pm_status_t st = pm_host_alloc(pool, n, 0, &a);
  if (st != PM_OK) return failure(w, OP_ASYNC_FREE, st);
  char *want = malloc(n);
  if (!want) {
    pm_host_free(a);
    return;
  }
  pm_test_fill(a, n, pm_test_rand(&w->rng));
  memcpy(want, a, n);
  st = pm_launch_busy(w->stream, 0.0001);
  if (st == PM_OK) st = pm_memcpy_async(w->dev, a, n, PM_COPY_H2D, w->stream);
  if (st == PM_OK) st = pm_host_record_stream(a, w->stream);
  if (st != PM_OK) {
    failure(w, OP_ASYNC_FREE, st);
    if (pm_stream_synchronize(w->stream) != PM_OK) {
      bury(w, a);
      free(want);
      return;
    }
  }
  pm_status_t fst = pm_host_free(a);
  if (fst != PM_OK) failure(w, OP_ASYNC_FREE, fst);
  if (st == PM_OK) {
    /* pm_memcpy runs on the default stream, which does not wait for this one */
    st = pm_stream_synchronize(w->stream);
    if (st == PM_OK) st = pm_memcpy(w->pageable2, w->dev, n, PM_COPY_D2H);
    if (st == PM_OK) {
      verify(w, w->pageable2, want, n);
      w->ok[OP_ASYNC_FREE]++;
    } else {
      failure(w, OP_ASYNC_FREE, st);
    }
  }
  free(want);
}

static void op_trim(worker_t *w) {
  size_t rel = 0;
  pm_status_t st = pm_pool_trim(pick_pool(w), &rel);
  if (st != PM_OK) return failure(w, OP_TRIM, st);
  w->ok[OP_TRIM]++;
}

static void op_private_pool(worker_t *w) {
  pm_pool_config_t c;
  pm_pool_config_init(&c);
  c.budget = (size_t)2 << 20;
  c.fast_pin_min = (size_t)1 << 20;
  pm_pool_t *p = NULL;
  pm_status_t st = pm_pool_create(&c, &p);
  if (st != PM_OK) return failure(w, OP_PRIVATE_POOL, st);
  void *a[4] = {0};
  for (int i = 0; i < 4; i++) {
    st = pm_host_alloc(p, rsize(w, (size_t)1 << 20), 0, &a[i]);
    if (st != PM_OK && st != PM_ERR_BUDGET) failure(w, OP_PRIVATE_POOL, st);
  }
  for (int i = 0; i < 4; i++)
    if (a[i]) pm_host_free(a[i]);
  st = pm_pool_destroy(p);
  if (st != PM_OK) {
    /* Only a broken stream could keep a private pool busy, and none was used. */
    w->unexpected++;
    snprintf(w->first_unexpected, sizeof w->first_unexpected, "pool-churn destroy: %s: %s",
             pm_status_name(st), pm_last_error());
    return;
  }
  w->ok[OP_PRIVATE_POOL]++;
}

static void *worker_main(void *arg) {
  worker_t *w = arg;
  static const int weights[OP_KINDS] = {20, 18, 8, 10, 10, 6, 6, 8, 2, 2};
  int total = 0;
  for (int i = 0; i < OP_KINDS; i++) total += weights[i];
  while (!atomic_load_explicit(&g_stop, memory_order_relaxed)) {
    int r = (int)(pm_test_rand(&w->rng) % (uint64_t)total), op = 0;
    while (r >= weights[op]) r -= weights[op++];
    if (!w->dev && op != OP_ALLOC && op != OP_FREE && op != OP_TRIM && op != OP_PRIVATE_POOL)
      continue; /* no device buffer left (its allocations kept failing) */
    w->ops[op]++;
    w->cur_op = op;
    switch (op) {
      case OP_ALLOC: op_alloc(w); break;
      case OP_FREE: op_free(w); break;
      case OP_REGISTER: op_register(w); break;
      case OP_COPY_DIRECT: op_copy_direct(w); break;
      case OP_COPY_STAGED: op_copy_staged(w); break;
      case OP_COPY_BATCH: op_copy_batch(w); break;
      case OP_COPY_SMALL: op_copy_small(w); break;
      case OP_ASYNC_FREE: op_async_free(w); break;
      case OP_TRIM: op_trim(w); break;
      case OP_PRIVATE_POOL: op_private_pool(w); break;
    }
  }
  return NULL;
}

static void sleep_s(double s) {
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  nanosleep(&ts, NULL);
}

/* Free what a worker still holds, after the faults are off and its stream is idle. */
static void worker_drain(worker_t *w) {
  CHECK_OK(pm_stream_synchronize(w->stream));
  for (int i = 0; i < w->nheld; i++) CHECK_OK(pm_host_free(w->held[i]));
  w->nheld = 0;
  for (int i = 0; i < w->ngrave; i++) {
    pm_pointer_info_t info;
    void *p = w->graveyard[i];
    CHECK_OK(pm_pointer_query(p, &info));
    if (info.kind == PM_MEMORY_REGISTERED) {
      CHECK_OK(pm_unregister(p));
      free(p);
    } else if (info.kind == PM_MEMORY_DEVICE) {
      CHECK_OK(pm_device_free(p));
    } else if (info.kind == PM_MEMORY_POOL) {
      pm_status_t st = pm_host_free(p);
      /* pm_host_free consumed it even if it reported a stream error at the time */
      CHECK(st == PM_OK || st == PM_ERR_DOUBLE_FREE);
    } else {
      free(p);
    }
  }
  w->ngrave = 0;
}

static void phase(const char *name, double seconds, bool faults) {
  static worker_t workers[THREADS];
  pthread_t tids[THREADS];
  for (int i = 0; i < THREADS; i++) {
    worker_t *w = &workers[i];
    memset(w, 0, sizeof *w);
    w->id = i;
    w->rng = 0x1234 + (uint64_t)i * 7919 + (faults ? 1000003 : 0);
    REQUIRE_OK(pm_stream_create(&w->stream));
    void *d = NULL;
    REQUIRE_OK(pm_device_alloc(DEV_BYTES, &d));
    w->dev = d;
    w->pageable = malloc(DEV_BYTES);
    w->pageable2 = malloc(DEV_BYTES);
    REQUIRE(w->pageable && w->pageable2);
  }
  g_faults = faults;
  atomic_store(&g_stop, false);
  if (faults) {
    pm__fault_seed(7);
    REQUIRE_OK(pm__fault_set(PM__FAULT_ALL, 0, 0.01));
  }
  for (int i = 0; i < THREADS; i++)
    REQUIRE(pthread_create(&tids[i], NULL, worker_main, &workers[i]) == 0);
  sleep_s(seconds);
  atomic_store(&g_stop, true);
  for (int i = 0; i < THREADS; i++) pthread_join(tids[i], NULL);
  pm__fault_counts_t fc;
  pm__fault_counts(&fc);
  pm__fault_reset();

  uint64_t ops[OP_KINDS] = {0}, ok[OP_KINDS] = {0}, failed[OP_KINDS] = {0};
  uint64_t refusals = 0, bytes = 0, wrong = 0, unexpected = 0, all = 0;
  for (int i = 0; i < THREADS; i++) {
    worker_t *w = &workers[i];
    for (int k = 0; k < OP_KINDS; k++) {
      ops[k] += w->ops[k];
      ok[k] += w->ok[k];
      failed[k] += w->failed[k];
      all += w->ops[k];
    }
    refusals += w->budget_refusals;
    bytes += w->bytes_verified;
    wrong += w->wrong;
    unexpected += w->unexpected;
    if (w->unexpected) printf("  thread %d: unexpected failure: %s\n", i, w->first_unexpected);
    if (w->wrong) printf("  thread %d: WRONG: %s\n", i, w->first_wrong);
  }
  printf("%s: %d threads, %.2f s: %llu operations (", name, THREADS, seconds,
         (unsigned long long)all);
  for (int k = 0; k < OP_KINDS; k++)
    printf("%s%s %llu ok of %llu", k ? ", " : "", op_names[k], (unsigned long long)ok[k],
           (unsigned long long)ops[k]);
  printf("); %llu failed, %llu of them budget refusals; %.1f MiB verified, %llu wrong\n",
         (unsigned long long)(failed[0] + failed[1] + failed[2] + failed[3] + failed[4] +
                              failed[5] + failed[6] + failed[7] + failed[8] + failed[9]),
         (unsigned long long)refusals, (double)bytes / (1 << 20), (unsigned long long)wrong);
  if (faults)
    printf("  faults: %llu backend calls, %llu injected; caught as error statuses or absorbed, "
           "%llu unexpected\n",
           (unsigned long long)fc.total_calls, (unsigned long long)fc.total_injected,
           (unsigned long long)unexpected);
  fflush(stdout);
  CHECK_EQ_INT(wrong, 0);
  CHECK_EQ_INT(unexpected, 0);
  CHECK(ok[OP_ALLOC] + ok[OP_COPY_STAGED] + ok[OP_COPY_DIRECT] > 0); /* it did run */
  if (faults) CHECK(fc.total_injected > 0);

  for (int i = 0; i < THREADS; i++) {
    worker_t *w = &workers[i];
    worker_drain(w);
    CHECK_OK(pm_stream_destroy(w->stream));
    if (w->dev) CHECK_OK(pm_device_free(w->dev));
    free(w->pageable);
    free(w->pageable2);
  }
  /* Everything came back. */
  for (int i = 0; i < 3; i++) {
    pm_pool_t *p = i < 2 ? g_pools[i] : NULL;
    pm_pool_stats_t s;
    CHECK_OK(pm_pool_get_stats(p, &s));
    CHECK_EQ_SIZE(s.in_use_bytes, 0);
    CHECK_EQ_SIZE(s.registered_bytes, 0);
    CHECK_EQ_SIZE(s.pinned_bytes, s.cached_bytes + s.pending_bytes);
    CHECK_LE_SIZE(s.pinned_peak, s.budget);
    CHECK_EQ_INT(s.allocs, s.frees);
  }
}

/* ---- loaders: created and destroyed mid-epoch, concurrently, on shared pools ---------------- */

#define LOADER_THREADS 6
#define SAMPLE_BYTES 1000
#define SAMPLES 3000

/* Sample i of the callback dataset is pm_test_fill(.., i + 1), of the .npy one i + 100001. */
static int cb_read(uint64_t index, void *dst, void *user) {
  (void)user;
  pm_test_fill(dst, SAMPLE_BYTES, index + 1);
  return 0;
}

static pm_dataset_t *g_ds[2]; /* callback, .npy file */
static char g_npy_path[64];

static void make_datasets(void) {
  pm_dataset_callbacks_t cb;
  memset(&cb, 0, sizeof cb);
  cb.samples = SAMPLES;
  cb.sample_bytes = SAMPLE_BYTES;
  cb.read = cb_read;
  REQUIRE_OK(pm_dataset_create(&cb, &g_ds[0]));

  snprintf(g_npy_path, sizeof g_npy_path, "/tmp/pinmem-stress-XXXXXX");
  int fd = mkstemp(g_npy_path);
  REQUIRE(fd >= 0);
  FILE *f = fdopen(fd, "wb");
  REQUIRE(f != NULL);
  char h[128];
  int n = snprintf(h, sizeof h, "{'descr': '|u1', 'fortran_order': False, 'shape': (%d, %d), }",
                   SAMPLES, SAMPLE_BYTES);
  int total = 10 + n + 1, pad = (64 - total % 64) % 64;
  unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  unsigned hlen = (unsigned)(n + pad + 1);
  pre[8] = (unsigned char)(hlen & 0xff);
  pre[9] = (unsigned char)(hlen >> 8);
  REQUIRE(fwrite(pre, 1, 10, f) == 10 && fwrite(h, 1, (size_t)n, f) == (size_t)n);
  for (int i = 0; i < pad; i++) fputc(' ', f);
  fputc('\n', f);
  unsigned char row[SAMPLE_BYTES];
  for (int i = 0; i < SAMPLES; i++) {
    pm_test_fill(row, SAMPLE_BYTES, (uint64_t)i + 100001);
    REQUIRE(fwrite(row, 1, SAMPLE_BYTES, f) == SAMPLE_BYTES);
  }
  REQUIRE(fclose(f) == 0);
  const char *paths[1] = {g_npy_path};
  REQUIRE_OK(pm_dataset_open_npy(paths, 1, NULL, &g_ds[1]));
}

typedef struct lworker {
  uint64_t rng;
  pm_stream_t stream;
  uint64_t created, create_failed, destroyed_mid_epoch, finished, batches, rows, wrong,
      next_failed, unexpected, held_at_destroy;
  char first_unexpected[256];
} lworker_t;

static void lfailure(lworker_t *w, const char *what, pm_status_t st) {
  if (st == PM_ERR_BUDGET) return;
  bool ok = g_faults && pm_last_error()[0] && st != PM_ERR_INVALID && st != PM_ERR_INTERNAL &&
            st != PM_ERR_NOT_FOUND && st != PM_ERR_DOUBLE_FREE;
  if (ok) return;
  if (!w->unexpected++)
    snprintf(w->first_unexpected, sizeof w->first_unexpected, "%s: %s: %s", what,
             pm_status_name(st), pm_last_error());
}

/* Every row of a batch is the sample its index names. */
static bool check_batch(lworker_t *w, const pm_batch_t *b, int dsi, char *scratch) {
  const unsigned char *rows = b->host_inputs;
  if (b->inputs != b->host_inputs) {
    /* device delivery: read the device buffer back once the batch's copy is done */
    if (pm_batch_wait_stream(b, w->stream) != PM_OK ||
        pm_stream_synchronize(w->stream) != PM_OK ||
        pm_memcpy(scratch, b->inputs, b->inputs_bytes, PM_COPY_D2H) != PM_OK)
      return false; /* (only with faults) */
    rows = (const unsigned char *)scratch;
  }
  unsigned char want[SAMPLE_BYTES];
  for (size_t r = 0; r < b->samples; r++) {
    pm_test_fill(want, SAMPLE_BYTES, b->indices[r] + (dsi ? 100001 : 1));
    if (memcmp(rows + r * SAMPLE_BYTES, want, SAMPLE_BYTES) != 0) {
      w->wrong++;
      return true;
    }
  }
  w->rows += b->samples;
  return true;
}

/* A release can fail on an injected fault (the batch is then still held): try again, since a
 * batch never given back keeps its slot (and the loader) for ever. */
static pm_status_t release_retry(pm_batch_t *b, pm_stream_t stream) {
  pm_status_t st;
  int tries = 0;
  do st = pm_batch_release(b, stream);
  while (st != PM_OK && st != PM_ERR_INVALID && ++tries < 1000);
  return st;
}

static void loader_round(lworker_t *w, char *scratch) {
  int dsi = (int)(pm_test_rand(&w->rng) & 1);
  pm_loader_config_t c;
  pm_loader_config_init(&c);
  c.batch_size = 1 + pm_test_rand(&w->rng) % 64;
  c.workers = 1 + (int)(pm_test_rand(&w->rng) % 3);
  c.prefetch = 1 + (int)(pm_test_rand(&w->rng) % 4);
  c.shuffle = (int)(pm_test_rand(&w->rng) & 1);
  c.seed = pm_test_rand(&w->rng);
  c.drop_last = (int)(pm_test_rand(&w->rng) % 4 == 0);
  c.rank = 0;
  c.world_size = 1;
  c.delivery = (pm_test_rand(&w->rng) % 3 == 0) ? PM_DELIVER_HOST : PM_DELIVER_DEVICE;
  c.pin_memory = pm_test_rand(&w->rng) % 8 != 0;
  c.epochs = pm_test_rand(&w->rng) % 3; /* 0: no end */
  uint64_t pr = pm_test_rand(&w->rng) % 3;
  c.pool = pr == 2 ? NULL : g_pools[pr];
  /* The slot's copy whole, or in parts (cut inside rows), set just before the create (another
   * thread may set it in between: each loader still takes one of these). */
  static const char *pieces[] = {"0", "2500", "1", "4M"};
  (void)pm_option_set("loader_piece", pieces[pm_test_rand(&w->rng) % 4]);
  pm_loader_t *ld = NULL;
  pm_status_t st = pm_loader_create(g_ds[dsi], &c, &ld);
  if (st != PM_OK) {
    w->create_failed++;
    return lfailure(w, "pm_loader_create", st);
  }
  w->created++;
  uint64_t per_epoch = SAMPLES / c.batch_size + (SAMPLES % c.batch_size && !c.drop_last);
  uint64_t want = pm_test_rand(&w->rng) % (per_epoch + per_epoch / 2 + 2); /* often mid-epoch */
  pm_batch_t held[4];
  int nheld = 0;
  bool ended = false;
  for (uint64_t i = 0; i < want && !atomic_load_explicit(&g_stop, memory_order_relaxed); i++) {
    pm_batch_t b;
    st = pm_loader_next(ld, &b);
    if (st == PM_ERR_STATE) {
      ended = true;
      break;
    }
    if (st == PM_ERR_BUSY && nheld) {
      if ((st = release_retry(&held[--nheld], w->stream)) != PM_OK)
        lfailure(w, "pm_batch_release", st);
      continue;
    }
    if (st != PM_OK) {
      w->next_failed++;
      lfailure(w, "pm_loader_next", st);
      break;
    }
    w->batches++;
    check_batch(w, &b, dsi, scratch);
    if (nheld < 4 && pm_test_rand(&w->rng) % 4 == 0)
      held[nheld++] = b; /* keep it: released later, before or after the destroy */
    else if ((st = release_retry(&b, (pm_test_rand(&w->rng) & 1) ? w->stream : NULL)) != PM_OK)
      lfailure(w, "pm_batch_release", st);
  }
  if (pm_test_rand(&w->rng) & 1) {
    while (nheld)
      if ((st = release_retry(&held[--nheld], w->stream)) != PM_OK)
        lfailure(w, "pm_batch_release", st);
  }
  w->held_at_destroy += (uint64_t)nheld;
  if (ended)
    w->finished++;
  else
    w->destroyed_mid_epoch++;
  st = pm_loader_destroy(ld);
  if (st != PM_OK) {
    w->unexpected++;
    snprintf(w->first_unexpected, sizeof w->first_unexpected, "pm_loader_destroy: %s: %s",
             pm_status_name(st), pm_last_error());
  }
  /* Batches held over the destroy stay valid; each release frees its slot (the last one the
   * loader). */
  while (nheld) {
    pm_batch_t *b = &held[--nheld];
    check_batch(w, b, dsi, scratch);
    if ((st = release_retry(b, (pm_test_rand(&w->rng) & 1) ? w->stream : NULL)) != PM_OK) {
      w->unexpected++;
      snprintf(w->first_unexpected, sizeof w->first_unexpected,
               "pm_batch_release after destroy: %s: %s", pm_status_name(st), pm_last_error());
    }
  }
}

static void *lworker_main(void *arg) {
  lworker_t *w = arg;
  char *scratch = malloc(64 * SAMPLE_BYTES);
  if (!scratch) return NULL;
  while (!atomic_load_explicit(&g_stop, memory_order_relaxed)) loader_round(w, scratch);
  free(scratch);
  return NULL;
}

static void loader_phase(const char *name, double seconds, bool faults) {
  static lworker_t ws[LOADER_THREADS];
  pthread_t tids[LOADER_THREADS];
  for (int i = 0; i < LOADER_THREADS; i++) {
    memset(&ws[i], 0, sizeof ws[i]);
    ws[i].rng = 0xabc + (uint64_t)i * 104729 + (faults ? 17 : 0);
    REQUIRE_OK(pm_stream_create(&ws[i].stream));
  }
  g_faults = faults;
  atomic_store(&g_stop, false);
  if (faults) {
    pm__fault_seed(11);
    REQUIRE_OK(pm__fault_set(PM__FAULT_ALL, 0, 0.005));
  }
  for (int i = 0; i < LOADER_THREADS; i++)
    REQUIRE(pthread_create(&tids[i], NULL, lworker_main, &ws[i]) == 0);
  sleep_s(seconds);
  atomic_store(&g_stop, true);
  for (int i = 0; i < LOADER_THREADS; i++) pthread_join(tids[i], NULL);
  pm__fault_counts_t fc;
  pm__fault_counts(&fc);
  pm__fault_reset();
  lworker_t t;
  memset(&t, 0, sizeof t);
  for (int i = 0; i < LOADER_THREADS; i++) {
    lworker_t *w = &ws[i];
    t.created += w->created;
    t.create_failed += w->create_failed;
    t.destroyed_mid_epoch += w->destroyed_mid_epoch;
    t.finished += w->finished;
    t.batches += w->batches;
    t.rows += w->rows;
    t.wrong += w->wrong;
    t.next_failed += w->next_failed;
    t.unexpected += w->unexpected;
    t.held_at_destroy += w->held_at_destroy;
    if (w->unexpected) printf("  loader thread %d: unexpected: %s\n", i, w->first_unexpected);
    CHECK_OK(pm_stream_synchronize(w->stream));
    CHECK_OK(pm_stream_destroy(w->stream));
  }
  printf("%s: %d threads, %.2f s: %llu loaders created (%llu refused), %llu destroyed "
         "mid-epoch (%llu batches still held), %llu ran to the end; %llu batches, %llu rows "
         "verified, %llu wrong; %llu pm_loader_next failures\n",
         name, LOADER_THREADS, seconds, (unsigned long long)t.created,
         (unsigned long long)t.create_failed, (unsigned long long)t.destroyed_mid_epoch,
         (unsigned long long)t.held_at_destroy, (unsigned long long)t.finished,
         (unsigned long long)t.batches, (unsigned long long)t.rows, (unsigned long long)t.wrong,
         (unsigned long long)t.next_failed);
  if (faults)
    printf("  faults: %llu backend calls and reads, %llu injected (%llu reads); %llu unexpected\n",
           (unsigned long long)fc.total_calls, (unsigned long long)fc.total_injected,
           (unsigned long long)fc.injected[PM__FAULT_IO], (unsigned long long)t.unexpected);
  fflush(stdout);
  CHECK_EQ_INT(t.wrong, 0);
  CHECK_EQ_INT(t.unexpected, 0);
  CHECK(t.created + t.create_failed > 0);
  for (int i = 0; i < 3; i++) {
    pm_pool_stats_t s;
    CHECK_OK(pm_pool_get_stats(i < 2 ? g_pools[i] : NULL, &s));
    CHECK_EQ_SIZE(s.in_use_bytes, 0); /* every slot came back */
    CHECK_EQ_INT(s.allocs, s.frees);
  }
}

int main(void) {
  pm_test_init();
  g_small = pm_test_small();
  double secs = g_small ? 0.5 : 2.0;
  const char *e = getenv("PINMEM_STRESS_SECONDS");
  if (e && atof(e) > 0) secs = atof(e);
  /* Small staging chunks and a low stage_min, so a few MiB of budget serve many copies at once
   * and the ring fallback happens. */
  REQUIRE_OK(pm_option_set("copy_chunk", "128K"));
  REQUIRE_OK(pm_option_set("copy_stage_min", "32K"));
  REQUIRE_OK(pm_option_set("copy_threads", "2"));

  pm_pool_config_t c;
  pm_pool_config_init(&c);
  c.budget = (size_t)8 << 20;
  c.exhaust_policy = PM_EXHAUST_FAIL;
  c.fast_pin_min = (size_t)1 << 20;
  c.pin_threads = 2;
  REQUIRE_OK(pm_pool_create(&c, &g_pools[0]));
  c.budget = (size_t)6 << 20;
  c.exhaust_policy = PM_EXHAUST_WAIT;
  c.wait_timeout_s = 0.02;
  REQUIRE_OK(pm_pool_create(&c, &g_pools[1]));
  pm_pool_stats_t ds;
  REQUIRE_OK(pm_pool_get_stats(NULL, &ds));
  size_t old_budget = ds.budget;
  REQUIRE_OK(pm_pool_set_budget(NULL, (size_t)16 << 20));

  phase("stress", secs, false);
  size_t rel;
  CHECK_OK(pm_pool_trim(NULL, &rel));
  CHECK_OK(pm_pool_trim(g_pools[0], &rel));
  CHECK_OK(pm_pool_trim(g_pools[1], &rel));
  CHECK_EQ_SIZE(pm__registry_count(), 0); /* no device memory, registration or segment left */
  phase("stress with faults (rate 0.01 on every backend op)", secs, true);
  make_datasets();
  loader_phase("loaders", secs, false);
  loader_phase("loaders with faults (rate 0.005 on every backend op and file read)", secs, true);
  CHECK_OK(pm_dataset_destroy(g_ds[0]));
  CHECK_OK(pm_dataset_destroy(g_ds[1]));
  unlink(g_npy_path);

  CHECK_OK(pm_pool_destroy(g_pools[0]));
  CHECK_OK(pm_pool_destroy(g_pools[1]));
  /* Blocks whose stream could not be queried stay quarantined in the default pool until
   * pm_finalize destroys it: BUSY there would mean a block still in use. */
  CHECK_OK(pm_pool_trim(NULL, &rel));
  CHECK_OK(pm_pool_set_budget(NULL, old_budget));
  CHECK_OK(pm_option_set("copy_chunk", NULL));
  CHECK_OK(pm_option_set("copy_stage_min", NULL));
  CHECK_OK(pm_option_set("copy_threads", NULL));
  CHECK_OK(pm_option_set("loader_piece", NULL));
  CHECK_OK(pm_finalize());
  return pm_test_finish("test_stress");
}
