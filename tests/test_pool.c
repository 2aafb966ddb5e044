/*
 * The pinned memory pool: size classes, caching, split/coalesce, stream-ordered reuse (also out
 * of order), the budget and its policies, trim/reserve/set_budget, destroy, bad input, mapped
 * blocks, overhead, pointer queries, and the fast-pin and parallel-for helpers underneath.
 *
 * Streams are held busy with a host function that waits for a gate the test opens, so "the
 * stream is still busy" never depends on timing.
 */
#include <math.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "internal.h"

#define KiB ((size_t)1024)
#define MiB ((size_t)1024 * 1024)

static int g_small;   /* PINMEM_TEST_SMALL (valgrind run) or g_limited: smaller sizes */
static int g_limited; /* host backend under a low RLIMIT_MEMLOCK (8 MiB by default for users):
                       * every test keeps what it pins at once below 8 MiB */

static uint64_t rng_state = 0x2545F4914F6CDD1Dull;
static uint64_t rnd(void) {
  return pm_test_rand(&rng_state);
}
static size_t rnd_range(size_t lo, size_t hi) {
  return lo + (size_t)(rnd() % (hi - lo + 1));
}

static int g_verbose; /* PINMEM_TEST_VERBOSE=1: print the steps of the stream tests */
static void step(const char *what) {
  if (g_verbose) printf("   . %s\n", what);
}

static void msleep(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static pm_pool_t *make_pool(size_t budget, int policy, double timeout) {
  pm_pool_config_t c;
  pm_pool_config_init(&c);
  c.budget = budget;
  c.exhaust_policy = policy;
  c.wait_timeout_s = timeout;
  c.fast_pin_min = 4 * MiB;
  c.pin_threads = 4;
  pm_pool_t *p = NULL;
  REQUIRE_OK(pm_pool_create(&c, &p));
  return p;
}

static pm_pool_stats_t stats(pm_pool_t *p) {
  pm_pool_stats_t s;
  memset(&s, 0, sizeof s);
  CHECK_OK(pm_pool_get_stats(p, &s));
  return s;
}

/* ---- size classes ------------------------------------------------------------------------ */

static void test_size_class(void) {
  int bad = 0;
  size_t prev = 0;
  size_t top = g_small ? 3 * MiB : 8 * MiB;
  for (size_t n = 1; n <= top; n++) {
    size_t c = pm__size_class(n);
    int ok = c >= n && c % 256 == 0 && c >= prev && pm__size_class(c) == c;
    if (n >= MiB) ok = ok && (c - n) * 8 <= n;
    if (!ok && bad++ < 5) CHECK(ok && "size class bound");
    prev = c;
  }
  CHECK_EQ_INT(bad, 0);
  for (int i = 0; i < 200000; i++) {
    size_t n = (size_t)(rnd() >> (rnd() % 62 + 2));
    if (n == 0) n = 1;
    size_t c = pm__size_class(n);
    int ok = c >= n && c % 256 == 0;
    if (n >= MiB) ok = ok && (c - n) <= n / 8;
    if (!ok && bad++ < 5) CHECK(ok && "random size class bound");
  }
  CHECK_EQ_INT(bad, 0);
  /* Not power-of-two rounding: a request just above a power of two costs 12.5% at most. */
  CHECK_EQ_SIZE(pm__size_class(MiB + 1), MiB + 128 * KiB);
  CHECK_EQ_SIZE(pm__size_class(1), 256);
  CHECK_EQ_SIZE(pm__size_class(257), 512);
  CHECK_EQ_SIZE(pm__size_class(SIZE_MAX), 0); /* no class fits */
}

/* ---- basic allocation ---------------------------------------------------------------------- */

static void test_alloc_rw(void) {
  pm_pool_t *pool = make_pool(256 * MiB, PM_EXHAUST_FAIL, -1);
  size_t sizes[] = {1, 255, 256, 257, 4095, 100000, MiB + 3, 4 * MiB + 17};
  enum { N = sizeof sizes / sizeof sizes[0] };
  void *ptr[N];
  for (int i = 0; i < N; i++) {
    REQUIRE_OK(pm_host_alloc(pool, sizes[i], PM_HOST_DEFAULT, &ptr[i]));
    CHECK(((uintptr_t)ptr[i] & 255) == 0);
    pm_test_fill(ptr[i], sizes[i], 100 + i);
    size_t us = 0;
    CHECK_OK(pm_host_usable_size(ptr[i], &us));
    CHECK(us >= sizes[i]);
    CHECK_EQ_SIZE(us, pm__size_class(sizes[i]));
  }
  /* Large blocks are whole segments: page aligned. */
  CHECK(((uintptr_t)ptr[7] & (pm__page_size() - 1)) == 0);
  for (int i = 0; i < N; i++) CHECK(pm_test_fill_ok(ptr[i], sizes[i], 100 + i));
  pm_pool_stats_t s = stats(pool);
  size_t req = 0;
  for (int i = 0; i < N; i++) req += sizes[i];
  CHECK_EQ_SIZE(s.requested_bytes, req);
  CHECK_EQ_INT(s.allocs, N);
  CHECK(s.pinned_bytes >= s.in_use_bytes + s.cached_bytes);
  CHECK(s.backend_alloc_seconds > 0);
  for (int i = 0; i < N; i++) CHECK_OK(pm_host_free(ptr[i]));
  s = stats(pool);
  CHECK_EQ_SIZE(s.in_use_bytes, 0);
  CHECK_EQ_SIZE(s.requested_bytes, 0);
  CHECK_EQ_SIZE(s.cached_bytes, s.pinned_bytes);
  CHECK_EQ_INT(s.frees, N);
  CHECK_OK(pm_pool_destroy(pool));
}

static void test_cache_reuse(void) {
  pm_pool_t *pool = make_pool(64 * MiB, PM_EXHAUST_FAIL, -1);
  void *p = NULL, *q = NULL;
  REQUIRE_OK(pm_host_alloc(pool, 100000, 0, &p));
  pm_test_fill(p, 100000, 1);
  CHECK_OK(pm_host_free(p));
  pm_pool_stats_t s0 = stats(pool);
  for (int i = 0; i < 100; i++) {
    REQUIRE_OK(pm_host_alloc(pool, 100000, 0, &q));
    CHECK(q == p); /* the same block, straight from its bin */
    pm_test_fill(q, 100000, 2 + i);
    CHECK(pm_test_fill_ok(q, 100000, 2 + i));
    CHECK_OK(pm_host_free(q));
  }
  pm_pool_stats_t s1 = stats(pool);
  CHECK_EQ_INT(s1.backend_allocs, s0.backend_allocs);
  CHECK_EQ_INT(s1.cache_hits, s0.cache_hits + 100);
  CHECK_EQ_SIZE(s1.pinned_bytes, s0.pinned_bytes);
  CHECK_OK(pm_pool_destroy(pool));
}

static void test_split_coalesce(void) {
  size_t big = g_small ? 6 * MiB : 64 * MiB;
  pm_pool_t *pool = make_pool(big + 8 * MiB, PM_EXHAUST_FAIL, -1);
  CHECK_OK(pm_pool_reserve(pool, big, 0));
  pm_pool_stats_t s0 = stats(pool);
  CHECK_EQ_INT(s0.segments, 1);
  CHECK_EQ_INT(s0.backend_allocs, 1);
  CHECK_EQ_SIZE(s0.cached_bytes, big);
  CHECK_EQ_SIZE(s0.in_use_bytes, 0);

  enum { N = 200 };
  void *ptr[N];
  size_t size[N];
  size_t total = 0;
  for (int i = 0; i < N; i++) {
    size[i] = rnd_range(1, g_small ? 16 * KiB : 128 * KiB);
    REQUIRE_OK(pm_host_alloc(pool, size[i], 0, &ptr[i]));
    pm_test_fill(ptr[i], size[i], 1000 + i);
    total += pm__size_class(size[i]);
  }
  pm_pool_stats_t s1 = stats(pool);
  CHECK_EQ_INT(s1.backend_allocs, 1); /* all carved from the reserved segment */
  CHECK_EQ_INT(s1.segments, 1);
  CHECK_EQ_SIZE(s1.in_use_bytes, total);
  CHECK_EQ_SIZE(s1.in_use_bytes + s1.cached_bytes, big);
  /* No two blocks overlap: every pattern survived every later allocation's fill. */
  int intact = 1;
  for (int i = 0; i < N; i++) intact &= pm_test_fill_ok(ptr[i], size[i], 1000 + i);
  CHECK(intact);
  /* Free in a shuffled order so coalescing meets free neighbours on both sides. */
  int order[N];
  for (int i = 0; i < N; i++) order[i] = i;
  for (int i = N - 1; i > 0; i--) {
    int j = (int)(rnd() % (uint64_t)(i + 1));
    int t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  for (int i = 0; i < N; i++) CHECK_OK(pm_host_free(ptr[order[i]]));
  pm_pool_stats_t s2 = stats(pool);
  CHECK_EQ_SIZE(s2.cached_bytes, big);
  CHECK_EQ_SIZE(s2.in_use_bytes, 0);
  /* One free block again: the whole reservation is served without pinning anything. */
  void *whole = NULL;
  CHECK_OK(pm_host_alloc(pool, big, 0, &whole));
  pm_pool_stats_t s3 = stats(pool);
  CHECK_EQ_INT(s3.backend_allocs, 1);
  CHECK_EQ_SIZE(s3.in_use_bytes, big);
  CHECK_EQ_SIZE(s3.cached_bytes, 0);
  if (whole) {
    pm_test_fill(whole, big, 77);
    CHECK(pm_test_fill_ok(whole, big, 77));
    CHECK_OK(pm_host_free(whole));
  }
  CHECK_OK(pm_pool_destroy(pool));
}

/* ---- stream-ordered reuse ---------------------------------------------------------------- */

static void test_stream_reuse(void) {
  pm_pool_t *pool = make_pool(64 * MiB, PM_EXHAUST_FAIL, -1);
  pm_stream_t s = NULL;
  REQUIRE_OK(pm_stream_create(&s));
  pm_test_gate_t g;
  pm_test_gate_init(&g);
  const size_t n = 64 * KiB;

  void *p = NULL, *q = NULL, *r = NULL;
  REQUIRE_OK(pm_host_alloc(pool, n, 0, &p));
  pm_test_fill(p, n, 5);
  CHECK_OK(pm_host_record_stream(p, s));
  CHECK_OK(pm_host_record_stream(p, s)); /* once per stream is enough */
  CHECK_OK(pm_launch_host_func(s, pm_test_gate_wait, &g));
  step("gate closed");
  CHECK_OK(pm_launch_busy(s, 0.2));
  step("busy queued");
  CHECK_OK(pm_host_free(p));
  step("freed");
  CHECK_ST(pm_host_free(p), PM_ERR_DOUBLE_FREE); /* pending counts as freed */

  CHECK_OK(pm_host_alloc(pool, n, 0, &q));
  step("allocated again");
  CHECK(q != p); /* p's stream is still busy */
  pm_pool_stats_t s1 = stats(pool);
  CHECK_EQ_SIZE(s1.pending_bytes, pm__size_class(n));
  pm_pointer_info_t info;
  CHECK_OK(pm_pointer_query(p, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_POOL);
  CHECK_EQ_INT(info.in_use, 0);

  step("queried");
  pm_test_gate_open(&g);
  CHECK_OK(pm_stream_synchronize(s));
  step("synchronized");
  pm_pool_stats_t s2 = stats(pool); /* polls the pending block */
  CHECK_EQ_SIZE(s2.pending_bytes, 0);
  CHECK_OK(pm_host_alloc(pool, n, 0, &r));
  CHECK(r == p); /* its stream has passed the free: the block is back in its bin */
  CHECK_OK(pm_host_free(q));
  CHECK_OK(pm_host_free(r));

  /* A block used by two streams waits for both. */
  pm_test_gate_t g2;
  pm_test_gate_init(&g2);
  pm_stream_t s2s = NULL;
  REQUIRE_OK(pm_stream_create(&s2s));
  REQUIRE_OK(pm_host_alloc(pool, 3 * MiB, 0, &p));
  CHECK_OK(pm_host_record_stream(p, s));
  CHECK_OK(pm_host_record_stream((char *)p + 4096, s2s)); /* interior pointers name the block */
  CHECK_OK(pm_launch_host_func(s2s, pm_test_gate_wait, &g2));
  CHECK_OK(pm_host_free(p));
  CHECK_OK(pm_stream_synchronize(s));
  CHECK_EQ_SIZE(stats(pool).pending_bytes, 3 * MiB);
  pm_test_gate_open(&g2);
  CHECK_OK(pm_stream_synchronize(s2s));
  CHECK_EQ_SIZE(stats(pool).pending_bytes, 0);

  /* record_stream on a freed block is refused. */
  CHECK_ERR_MSG(pm_host_record_stream(p, s), PM_ERR_INVALID);

  CHECK_OK(pm_stream_destroy(s2s));
  CHECK_OK(pm_stream_destroy(s));
  pm_test_gate_destroy(&g2);
  pm_test_gate_destroy(&g);
  CHECK_OK(pm_pool_destroy(pool));
}

static void test_out_of_order(void) {
  pm_pool_t *pool = make_pool(64 * MiB, PM_EXHAUST_FAIL, -1);
  pm_stream_t slow = NULL, fast = NULL;
  REQUIRE_OK(pm_stream_create(&slow));
  REQUIRE_OK(pm_stream_create(&fast));
  pm_test_gate_t g, gf;
  pm_test_gate_init(&g);
  pm_test_gate_init(&gf);
  /* >= 1 MiB: each block is a whole segment, so no other free block can answer the request. */
  const size_t n = 2 * MiB;
  void *a = NULL, *b = NULL, *c = NULL;
  REQUIRE_OK(pm_host_alloc(pool, n, 0, &a));
  REQUIRE_OK(pm_host_alloc(pool, n, 0, &b));
  pm_test_fill(a, n, 11);
  pm_test_fill(b, n, 12);
  CHECK_OK(pm_host_record_stream(a, slow));
  CHECK_OK(pm_host_record_stream(b, fast));
  /* Gates, not kernels, hold both streams. compute-sanitizer, when a stream is synchronized,
   * waits for every kernel launched since its last report; a kernel anywhere behind the slow
   * gate, or on the fast stream, hung the synchronization of the fast stream below (on the H200,
   * under memcheck and racecheck alike). */
  CHECK_OK(pm_launch_host_func(fast, pm_test_gate_wait, &gf));
  CHECK_OK(pm_launch_host_func(slow, pm_test_gate_wait, &g));
  step("streams loaded");
  CHECK_OK(pm_host_free(a)); /* freed first, on the slow stream */
  CHECK_OK(pm_host_free(b));
  step("freed");
  CHECK_EQ_SIZE(stats(pool).pending_bytes, 2 * n); /* both streams are held */
  pm_test_gate_open(&gf);
  CHECK_OK(pm_stream_synchronize(fast));
  step("fast stream synchronized");

  pm_pool_stats_t s0 = stats(pool);
  CHECK_OK(pm_host_alloc(pool, n, 0, &c));
  CHECK(c == b); /* b is reused while a, freed earlier, still waits */
  pm_pool_stats_t s1 = stats(pool);
  CHECK_EQ_INT(s1.backend_allocs, s0.backend_allocs);
  CHECK_EQ_SIZE(s1.pending_bytes, n);

  pm_test_gate_open(&g);
  CHECK_OK(pm_stream_synchronize(slow));
  CHECK_EQ_SIZE(stats(pool).pending_bytes, 0);
  CHECK_OK(pm_host_free(c));
  CHECK_OK(pm_stream_destroy(slow));
  CHECK_OK(pm_stream_destroy(fast));
  pm_test_gate_destroy(&gf);
  pm_test_gate_destroy(&g);
  CHECK_OK(pm_pool_destroy(pool));
}

/* A pool can be destroyed while freed blocks still wait for their stream: it waits. */
static void test_destroy_waits_pending(void) {
  pm_pool_t *pool = make_pool(16 * MiB, PM_EXHAUST_FAIL, -1);
  pm_stream_t s = NULL;
  REQUIRE_OK(pm_stream_create(&s));
  void *p = NULL;
  REQUIRE_OK(pm_host_alloc(pool, 8 * KiB, 0, &p));
  CHECK_OK(pm_host_record_stream(p, s));
  CHECK_OK(pm_launch_busy(s, 0.05));
  CHECK_OK(pm_host_free(p));
  CHECK_OK(pm_pool_destroy(pool));
  CHECK_OK(pm_stream_query(s));
  CHECK_OK(pm_stream_destroy(s));
}

/* ---- budget ------------------------------------------------------------------------------ */

static void test_budget_fail(void) {
  pm_pool_t *pool = make_pool(4 * MiB, PM_EXHAUST_FAIL, -1);
  void *a = NULL, *b = NULL;
  REQUIRE_OK(pm_host_alloc(pool, 3 * MiB, 0, &a));
  CHECK_ERR_MSG(pm_host_alloc(pool, 2 * MiB, 0, &b), PM_ERR_BUDGET);
  CHECK(strstr(pm_last_error(), "budget") != NULL);
  pm_pool_stats_t s = stats(pool);
  CHECK_EQ_INT(s.budget_failures, 1);
  CHECK_LE_SIZE(s.pinned_bytes, 4 * MiB);
  CHECK_EQ_SIZE(s.budget, 4 * MiB);
  /* Larger than the whole budget: a budget error at once (as pm_register says it). */
  CHECK_ERR_MSG(pm_host_alloc(pool, 5 * MiB, 0, &b), PM_ERR_BUDGET);
  /* Freed but cached (and too small to serve 4 MiB): the cache is trimmed before failing, so
   * this succeeds. */
  CHECK_OK(pm_host_free(a));
  CHECK_OK(pm_host_alloc(pool, 4 * MiB, 0, &b));
  s = stats(pool);
  CHECK_EQ_INT(s.backend_frees, 1);
  CHECK_EQ_SIZE(s.pinned_bytes, 4 * MiB);
  CHECK_EQ_INT(s.budget_failures, 1);
  /* The class of a request below the budget can still exceed it: fails without waiting. */
  CHECK_OK(pm_host_free(b));
  CHECK_OK(pm_pool_set_budget(pool, 4 * MiB + 100));
  CHECK_ERR_MSG(pm_host_alloc(pool, 4 * MiB + 50, 0, &b), PM_ERR_BUDGET);
  CHECK_OK(pm_pool_destroy(pool));
}

typedef struct delayed_free {
  pm_pool_t *pool;
  void *ptr;
  pm_status_t st;
} delayed_free_t;

/* Frees d->ptr once the pool counts a waiting allocation (not after a fixed sleep: a preempted
 * allocating thread would come after the free and never wait). At most 60 s, the waiter's own
 * timeout being 30 s, so an allocation that never waits fails the test instead of hanging it. */
static void *delayed_free_main(void *arg) {
  delayed_free_t *d = arg;
  pm_pool_stats_t s = {0};
  for (int i = 0; i < 60000 && pm_pool_get_stats(d->pool, &s) == PM_OK && s.budget_waits == 0; i++)
    msleep(1);
  d->st = pm_host_free(d->ptr);
  return NULL;
}

static void test_budget_wait(void) {
  pm_pool_t *pool = make_pool(4 * MiB, PM_EXHAUST_WAIT, 30.0);
  void *a = NULL, *b = NULL;
  REQUIRE_OK(pm_host_alloc(pool, 3 * MiB, 0, &a));
  pm_test_fill(a, 3 * MiB, 3);
  delayed_free_t d = {pool, a, PM_ERR_INTERNAL};
  pthread_t t;
  REQUIRE(pthread_create(&t, NULL, delayed_free_main, &d) == 0);
  CHECK_OK(pm_host_alloc(pool, 2 * MiB, 0, &b)); /* waits for the other thread's free */
  pthread_join(t, NULL);
  CHECK_OK(d.st);
  pm_pool_stats_t s = stats(pool);
  CHECK_EQ_INT(s.budget_waits, 1);
  CHECK_EQ_INT(s.budget_failures, 0);
  CHECK_LE_SIZE(s.pinned_bytes, 4 * MiB);
  if (b) {
    pm_test_fill(b, 2 * MiB, 4);
    CHECK(pm_test_fill_ok(b, 2 * MiB, 4));
  }
  CHECK_OK(pm_host_free(b));
  CHECK_OK(pm_pool_destroy(pool));
}

static void test_wait_timeout(void) {
  pm_pool_t *pool = make_pool(4 * MiB, PM_EXHAUST_WAIT, 0.2);
  void *a = NULL, *b = NULL;
  REQUIRE_OK(pm_host_alloc(pool, 3 * MiB, 0, &a));
  CHECK_ERR_MSG(pm_host_alloc(pool, 2 * MiB, 0, &b), PM_ERR_BUDGET);
  CHECK(strstr(pm_last_error(), "waited") != NULL);
  pm_pool_stats_t s = stats(pool);
  CHECK_EQ_INT(s.budget_waits, 1);
  CHECK_EQ_INT(s.budget_failures, 1);
  CHECK_OK(pm_host_free(a));
  CHECK_OK(pm_pool_destroy(pool));
}

static void test_trim(void) {
  pm_pool_t *pool = make_pool(64 * MiB, PM_EXHAUST_FAIL, -1);
  size_t sizes[] = {300, 70 * KiB, MiB, 4 * MiB};
  void *p[4];
  for (int i = 0; i < 4; i++) REQUIRE_OK(pm_host_alloc(pool, sizes[i], 0, &p[i]));
  size_t released = 1;
  CHECK_OK(pm_pool_trim(pool, &released));
  CHECK_EQ_SIZE(released, 0); /* everything is in use */
  for (int i = 0; i < 4; i++) CHECK_OK(pm_host_free(p[i]));
  pm_pool_stats_t s0 = stats(pool);
  CHECK(s0.segments >= 2);
  CHECK(s0.cached_bytes > 0);
  CHECK_OK(pm_pool_trim(pool, &released));
  CHECK_EQ_SIZE(released, s0.pinned_bytes);
  pm_pool_stats_t s1 = stats(pool);
  CHECK_EQ_INT(s1.segments, 0);
  CHECK_EQ_SIZE(s1.pinned_bytes, 0);
  CHECK_EQ_SIZE(s1.cached_bytes, 0);
  CHECK_EQ_INT(s1.backend_frees, s1.backend_allocs);
  CHECK_EQ_SIZE(s1.pinned_peak, s0.pinned_peak);
  CHECK_OK(pm_pool_reset_peak(pool));
  CHECK_EQ_SIZE(stats(pool).pinned_peak, 0);
  CHECK_OK(pm_pool_trim(pool, NULL));
  CHECK_OK(pm_pool_destroy(pool));
}

static void test_reserve(void) {
  pm_pool_t *pool = make_pool(64 * MiB, PM_EXHAUST_FAIL, -1);
  CHECK_OK(pm_pool_reserve(pool, 3 * MiB + 1, PM_HOST_PORTABLE));
  pm_pool_stats_t s0 = stats(pool);
  CHECK_EQ_SIZE(s0.cached_bytes, pm__size_class(3 * MiB + 1));
  void *p = NULL;
  /* Every block is portable, so PM_HOST_PORTABLE or not is one flag group: the reservation
   * serves a request without it (a second segment was pinned, the reserved one left idle). */
  CHECK_OK(pm_host_alloc(pool, 3 * MiB + 1, 0, &p));
  CHECK_EQ_INT(stats(pool).backend_allocs, 1);
  pm_pointer_info_t info;
  CHECK_OK(pm_pointer_query(p, &info));
  CHECK_EQ_INT(info.flags, PM_HOST_PORTABLE);
  CHECK_OK(pm_host_free(p));
  CHECK_OK(pm_host_alloc(pool, 3 * MiB + 1, PM_HOST_PORTABLE, &p));
  CHECK_EQ_INT(stats(pool).backend_allocs, 1);
  CHECK_OK(pm_host_free(p));
  /* Another flag group is not served from it. */
  CHECK_OK(pm_host_alloc(pool, 3 * MiB + 1, PM_HOST_MAPPED, &p));
  CHECK_EQ_INT(stats(pool).backend_allocs, 2);
  CHECK_OK(pm_host_free(p));
  CHECK_ERR_MSG(pm_pool_reserve(pool, 0, 0), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_pool_reserve(pool, MiB, 0x40), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_pool_reserve(pool, 128 * MiB, 0), PM_ERR_BUDGET);
  CHECK_OK(pm_pool_destroy(pool));
}

static void test_set_budget(void) {
  pm_pool_t *pool = make_pool(8 * MiB, PM_EXHAUST_FAIL, -1);
  void *a = NULL, *b = NULL;
  REQUIRE_OK(pm_host_alloc(pool, 3 * MiB, 0, &a));
  REQUIRE_OK(pm_host_alloc(pool, 2 * MiB, 0, &b));
  CHECK_OK(pm_host_free(b));                   /* cached */
  CHECK_OK(pm_pool_set_budget(pool, 4 * MiB)); /* trims the cached 2 MiB */
  pm_pool_stats_t s = stats(pool);
  CHECK_EQ_SIZE(s.budget, 4 * MiB);
  CHECK_EQ_SIZE(s.pinned_bytes, 3 * MiB);
  CHECK_ERR_MSG(pm_pool_set_budget(pool, 2 * MiB), PM_ERR_BUSY);
  CHECK_EQ_SIZE(stats(pool).budget, 4 * MiB); /* unchanged */
  CHECK_ERR_MSG(pm_pool_set_budget(pool, 0), PM_ERR_INVALID);
  CHECK_OK(pm_pool_set_budget(pool, 16 * MiB));
  CHECK_OK(pm_host_alloc(pool, 4 * MiB + 512 * KiB, 0, &b)); /* above the old budget */
  CHECK_OK(pm_host_free(b));
  CHECK_OK(pm_host_free(a));
  CHECK_OK(pm_pool_destroy(pool));
}

/* ---- lifecycle and bad input ---------------------------------------------------------------- */

static void test_destroy_busy(void) {
  pm_pool_t *pool = make_pool(16 * MiB, PM_EXHAUST_FAIL, -1);
  void *p = NULL;
  REQUIRE_OK(pm_host_alloc(pool, 1000, 0, &p));
  CHECK_ERR_MSG(pm_pool_destroy(pool), PM_ERR_BUSY);
  CHECK_OK(pm_host_free(p));
  CHECK_OK(pm_pool_destroy(pool));
  CHECK_ERR_MSG(pm_pool_destroy(NULL), PM_ERR_INVALID);
}

static void test_bad_input(void) {
  pm_pool_t *pool = make_pool(16 * MiB, PM_EXHAUST_FAIL, -1);
  void *p = NULL, *q = NULL;
  CHECK_ERR_MSG(pm_host_alloc(pool, 0, 0, &p), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_host_alloc(pool, 64, 0x100, &p), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_host_alloc(pool, 64, 0, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_host_alloc(pool, 17 * MiB, 0, &p), PM_ERR_BUDGET);
  CHECK_ERR_MSG(pm_host_alloc(pool, SIZE_MAX, 0, &p), PM_ERR_INVALID);
  CHECK(p == NULL); /* outputs untouched on failure */

  /* Double free: a block carved from a shared segment... */
  REQUIRE_OK(pm_host_alloc(pool, 4096, 0, &p));
  REQUIRE_OK(pm_host_alloc(pool, 4096, 0, &q));
  CHECK_OK(pm_host_free(p));
  CHECK_ERR_MSG(pm_host_free(p), PM_ERR_DOUBLE_FREE);
  /* ...and a whole-segment block. */
  void *big = NULL;
  REQUIRE_OK(pm_host_alloc(pool, 2 * MiB, 0, &big));
  CHECK_OK(pm_host_free(big));
  CHECK_ERR_MSG(pm_host_free(big), PM_ERR_DOUBLE_FREE);

  /* Interior pointer of a live block. */
  CHECK_ERR_MSG(pm_host_free((char *)q + 256), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "not the start of a block") != NULL);
  size_t us = 0;
  CHECK_ERR_MSG(pm_host_usable_size((char *)q + 256, &us), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_host_usable_size(p, &us), PM_ERR_INVALID); /* freed */

  /* The rest of q's segment past every block handed out was never allocated: freeing an address
   * there (the start of that free rest, or inside it) is a bad pointer, not a double free. */
  REQUIRE_OK(pm_host_usable_size(q, &us));
  char *rest = (char *)q + us;
  CHECK_ERR_MSG(pm_host_free(rest), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "not allocated by pm_host_alloc") != NULL);
  CHECK(strstr(pm_last_error(), "double") == NULL && strstr(pm_last_error(), "freed") == NULL);
  CHECK_ERR_MSG(pm_host_free(rest + 4096 + 256), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "not allocated by pm_host_alloc") != NULL);
  /* The other calls that take a block's address say the same of it. */
  size_t rest_size = 0;
  CHECK_ERR_MSG(pm_host_usable_size(rest, &rest_size), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "not allocated by pm_host_alloc") != NULL);
  CHECK_ERR_MSG(pm_host_record_stream(rest, NULL), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "not allocated by pm_host_alloc") != NULL);
  CHECK_OK(pm_host_free(q));
  /* With q freed the whole segment is one free block, from p: p and q are double frees still,
   * the rest past them is still memory never handed out. */
  CHECK_ERR_MSG(pm_host_free(p), PM_ERR_DOUBLE_FREE);
  CHECK_ERR_MSG(pm_host_free(q), PM_ERR_DOUBLE_FREE);
  CHECK_ERR_MSG(pm_host_free(rest), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "not allocated by pm_host_alloc") != NULL);

  /* Not pinmem memory at all. */
  int local = 1;
  CHECK(pm_host_free(&local) != PM_OK);

  /* Bad configurations. */
  pm_pool_config_t c;
  pm_pool_config_init(&c);
  CHECK_EQ_SIZE(c.budget, 0);
  CHECK_EQ_INT(c.exhaust_policy, -1);
  CHECK(c.wait_timeout_s < 0);
  CHECK_EQ_INT(c.pin_threads, 0);
  CHECK_EQ_SIZE(c.fast_pin_min, 0);
  CHECK_EQ_INT(c.huge_pages, -1);
  pm_pool_t *bad = NULL;
  c.exhaust_policy = 7;
  CHECK_ERR_MSG(pm_pool_create(&c, &bad), PM_ERR_INVALID);
  pm_pool_config_init(&c);
  c.pin_threads = -2;
  CHECK_ERR_MSG(pm_pool_create(&c, &bad), PM_ERR_INVALID);
  pm_pool_config_init(&c);
  c.huge_pages = 3;
  CHECK_ERR_MSG(pm_pool_create(&c, &bad), PM_ERR_INVALID);
  /* Past the limit (infinity is no "wait for ever"): the message gives the range, not "not a
   * number of seconds" for numbers. */
  const double timeouts[] = {INFINITY, 2e9, NAN};
  for (size_t i = 0; i < sizeof timeouts / sizeof timeouts[0]; i++) {
    pm_pool_config_init(&c);
    c.wait_timeout_s = timeouts[i];
    CHECK_ERR_MSG(pm_pool_create(&c, &bad), PM_ERR_INVALID);
    CHECK(strstr(pm_last_error(), "from 0 to 1e9") != NULL);
  }
  CHECK_ERR_MSG(pm_pool_create(NULL, NULL), PM_ERR_INVALID);
  CHECK(bad == NULL);
  CHECK_ERR_MSG(pm_pool_get_stats(pool, NULL), PM_ERR_INVALID);
  CHECK_OK(pm_pool_destroy(pool));
}

/* ---- mapped memory, pointer queries, overhead ------------------------------------------------ */

static void test_mapped(void) {
  pm_pool_t *pool = make_pool(32 * MiB, PM_EXHAUST_FAIL, -1);
  const size_t n = 200 * KiB + 13;
  void *p = NULL, *dp = NULL, *dev = NULL;
  REQUIRE_OK(pm_host_alloc(pool, n, PM_HOST_MAPPED, &p));
  CHECK_OK(pm_host_device_pointer(p, &dp));
  CHECK(dp != NULL);
  pm_pointer_info_t info;
  CHECK_OK(pm_pointer_query((char *)p + 100, &info));
  CHECK(info.device_ptr == (char *)dp + 100);
  CHECK_EQ_INT(info.flags, PM_HOST_MAPPED | PM_HOST_PORTABLE);

  pm_test_fill(p, n, 21);
  REQUIRE_OK(pm_device_alloc(n, &dev));
  unsigned char *back = malloc(n);
  REQUIRE(back != NULL);
  /* The block through its device address is a valid copy source (direction inferred: with
   * unified addressing the device address may equal the host address). */
  CHECK_OK(pm_memcpy(dev, dp, n, PM_COPY_DEFAULT));
  CHECK_OK(pm_memcpy(back, dev, n, PM_COPY_D2H));
  CHECK(pm_test_fill_ok(back, n, 21));
  free(back);
  CHECK_OK(pm_device_free(dev));

  /* A large (fast-pinned) mapped block too. */
  void *big = NULL, *dbig = NULL;
  CHECK_OK(pm_host_alloc(pool, 4 * MiB, PM_HOST_MAPPED, &big));
  CHECK_OK(pm_host_device_pointer((char *)big + MiB, &dbig));
  CHECK(dbig != NULL);
  CHECK_OK(pm_host_free(big));

  /* Unmapped blocks have no device address. */
  void *plain = NULL;
  REQUIRE_OK(pm_host_alloc(pool, 1000, 0, &plain));
  CHECK(plain != p);
  CHECK_ERR_MSG(pm_host_device_pointer(plain, &dp), PM_ERR_INVALID);
  CHECK_OK(pm_host_free(plain));
  /* Past the block, in the free rest of its segment, and the block once freed: the pool's
   * memory, not the caller's, so no device address (it was given, a use after free). */
  size_t usable = 0;
  CHECK_OK(pm_host_usable_size(p, &usable));
  CHECK_ERR_MSG(pm_host_device_pointer((char *)p + usable + 4096, &dp), PM_ERR_INVALID);
  CHECK_OK(pm_host_free(p));
  dp = NULL;
  CHECK_ERR_MSG(pm_host_device_pointer(p, &dp), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "freed") != NULL);
  CHECK(dp == NULL);
  CHECK_OK(pm_pool_destroy(pool));
}

static void test_pointer_query(void) {
  pm_pool_t *pool = make_pool(32 * MiB, PM_EXHAUST_FAIL, -1);
  void *p = NULL;
  REQUIRE_OK(pm_host_alloc(pool, 10000, 0, &p));
  pm_pointer_info_t info;
  CHECK_OK(pm_pointer_query((char *)p + 5, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_POOL);
  CHECK(info.base == p);
  CHECK_EQ_SIZE(info.size, pm__size_class(10000));
  CHECK(info.pool == pool);
  CHECK_EQ_INT(info.in_use, 1);
  CHECK(info.device_ptr == NULL);
  CHECK_OK(pm_host_free(p));
  CHECK_OK(pm_pointer_query(p, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_POOL); /* still the pool's (cached) */
  CHECK_EQ_INT(info.in_use, 0);
  CHECK_OK(pm_pool_destroy(pool));
  CHECK_OK(pm_pointer_query(p, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_PAGEABLE); /* released with the pool */
}

static void test_overhead(void) {
  int n = g_limited ? 4 : g_small ? 8 : 24;
  size_t hi = g_limited ? MiB + 700 * KiB : g_small ? 3 * MiB : 9 * MiB;
  pm_pool_t *pool = make_pool((size_t)n * hi * 2, PM_EXHAUST_FAIL, -1);
  void **p = calloc((size_t)n, sizeof *p);
  REQUIRE(p != NULL);
  for (int i = 0; i < n; i++) CHECK_OK(pm_host_alloc(pool, rnd_range(MiB, hi), 0, &p[i]));
  pm_pool_stats_t s = stats(pool);
  double ratio = (double)s.pinned_bytes / (double)s.requested_bytes;
  printf("overhead: %zu pinned for %zu requested (%.4f)\n", s.pinned_bytes, s.requested_bytes,
         ratio);
  CHECK(ratio <= 1.125);
  for (int i = 0; i < n; i++) CHECK_OK(pm_host_free(p[i]));
  free(p);
  CHECK_OK(pm_pool_destroy(pool));
}

static void test_default_pool(void) {
  pm_pool_t *d1 = NULL, *d2 = NULL;
  REQUIRE_OK(pm_pool_default(&d1));
  REQUIRE_OK(pm_pool_default(&d2));
  CHECK(d1 == d2);
  void *p = NULL;
  CHECK_OK(pm_host_alloc(NULL, 12345, 0, &p));
  pm_pointer_info_t info;
  CHECK_OK(pm_pointer_query(p, &info));
  CHECK(info.pool == d1);
  pm_pool_stats_t s;
  CHECK_OK(pm_pool_get_stats(NULL, &s));
  CHECK(s.budget > 0);
  CHECK_EQ_SIZE(s.requested_bytes, 12345);
  CHECK_OK(pm_host_free(p));
  CHECK_ERR_MSG(pm_pool_destroy(d1), PM_ERR_INVALID);
  CHECK_OK(pm_pool_trim(NULL, NULL));
  CHECK_EQ_SIZE(stats(NULL).pinned_bytes, 0);
}

/* ---- the helpers underneath ------------------------------------------------------------------ */

typedef struct pf_ctx {
  _Atomic unsigned long long sum;
  unsigned char *hits;
} pf_ctx_t;

static void pf_item(void *vctx, size_t i) {
  pf_ctx_t *c = vctx;
  c->hits[i]++;
  atomic_fetch_add(&c->sum, i);
}

static void nested_item(void *vctx, size_t i) {
  pf_ctx_t *c = vctx;
  pf_ctx_t inner = {0, calloc(100, 1)};
  pm__parallel_for(4, 100, pf_item, &inner);
  int ok = atomic_load(&inner.sum) == 4950;
  for (int k = 0; k < 100; k++) ok &= inner.hits[k] == 1;
  free(inner.hits);
  c->hits[i] = (unsigned char)ok;
}

static void *pf_thread(void *arg) {
  int *ok = arg;
  pf_ctx_t c = {0, calloc(1000, 1)};
  for (int r = 0; r < 20; r++) {
    memset(c.hits, 0, 1000);
    atomic_store(&c.sum, 0);
    pm__parallel_for(8, 1000, pf_item, &c);
    int good = atomic_load(&c.sum) == 499500ull;
    for (int k = 0; k < 1000; k++) good &= c.hits[k] == 1;
    if (!good) *ok = 0;
  }
  free(c.hits);
  return NULL;
}

static void test_parallel_for(void) {
  pf_ctx_t c = {0, calloc(5000, 1)};
  pm__parallel_for(16, 5000, pf_item, &c);
  CHECK_EQ_INT(atomic_load(&c.sum), 5000ull * 4999 / 2);
  int once = 1;
  for (int i = 0; i < 5000; i++) once &= c.hits[i] == 1;
  CHECK(once);
  free(c.hits);
  /* Nested calls from inside items, and several callers at once, share the workers. */
  pf_ctx_t outer = {0, calloc(8, 1)};
  pm__parallel_for(8, 8, nested_item, &outer);
  int all = 1;
  for (int i = 0; i < 8; i++) all &= outer.hits[i] == 1;
  CHECK(all);
  free(outer.hits);
  pthread_t t[4];
  int ok[4] = {1, 1, 1, 1};
  for (int i = 0; i < 4; i++) REQUIRE(pthread_create(&t[i], NULL, pf_thread, &ok[i]) == 0);
  for (int i = 0; i < 4; i++) pthread_join(t[i], NULL);
  for (int i = 0; i < 4; i++) CHECK(ok[i]);
  /* threads <= 1 runs inline on the caller. */
  pf_ctx_t one = {0, calloc(3, 1)};
  pm__parallel_for(0, 3, pf_item, &one);
  CHECK_EQ_INT(atomic_load(&one.sum), 3);
  free(one.hits);
}

static void test_fast_pin(void) {
  const pm__backend_t *b = pm__backend();
  REQUIRE(b != NULL);
  size_t n = 6 * MiB + 5;
  void *p = NULL;
  CHECK_OK(pm__fast_pin(b, n, PM_REGISTER_DEFAULT, 4, true, &p));
  if (!p) return;
  CHECK(((uintptr_t)p & (2 * MiB - 1)) == 0);
  pm_test_fill(p, n, 31);
  CHECK(pm_test_fill_ok(p, n, 31));
  CHECK_OK(pm__fast_unpin(b, p, n));
  CHECK_ERR_MSG(pm__fast_pin(b, 0, 0, 4, true, &p), PM_ERR_INVALID);
}

static void nop(void *arg) {
  (void)arg;
}

/* First uses of the device machinery (loading the busy kernel, the host-function thread) happen
 * here, not while a test holds a stream blocked on a gate. */
static void warm_up(void) {
  if (getenv("PINMEM_TEST_NO_WARMUP")) return;
  pm_stream_t s = NULL;
  REQUIRE_OK(pm_stream_create(&s));
  REQUIRE_OK(pm_launch_busy(s, 0.0));
  REQUIRE_OK(pm_launch_host_func(s, nop, NULL));
  pm_event_t e = NULL;
  REQUIRE_OK(pm_event_create(PM_EVENT_DEFAULT, &e));
  REQUIRE_OK(pm_event_record(e, s));
  REQUIRE_OK(pm_event_synchronize(e));
  REQUIRE_OK(pm_event_destroy(e));
  REQUIRE_OK(pm_stream_destroy(s));
}

/* Name each test as it starts, so a hang or a crash shows where. */
#define RUN(fn)             \
  do {                      \
    printf("-- %s\n", #fn); \
    fn();                   \
  } while (0)

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  pm_test_init();
  const char *verbose = getenv("PINMEM_TEST_VERBOSE");
  g_verbose = verbose && verbose[0] == '1';
  warm_up();
  g_small = pm_test_small();
  if (pm_backend_kind() == PM_BACKEND_HOST && pm__memlock_limit() < 256 * MiB) {
    g_limited = g_small = 1;
    printf("note: RLIMIT_MEMLOCK allows %zu bytes: running with small sizes\n",
           pm__memlock_limit());
  }
  RUN(test_size_class);
  RUN(test_alloc_rw);
  RUN(test_cache_reuse);
  RUN(test_split_coalesce);
  RUN(test_stream_reuse);
  RUN(test_out_of_order);
  RUN(test_destroy_waits_pending);
  RUN(test_budget_fail);
  RUN(test_budget_wait);
  RUN(test_wait_timeout);
  RUN(test_trim);
  RUN(test_reserve);
  RUN(test_set_budget);
  RUN(test_destroy_busy);
  RUN(test_bad_input);
  RUN(test_mapped);
  RUN(test_pointer_query);
  RUN(test_overhead);
  RUN(test_default_pool);
  RUN(test_parallel_for);
  RUN(test_fast_pin);
  CHECK_OK(pm_finalize());
  return pm_test_finish("test_pool");
}
