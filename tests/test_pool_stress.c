/*
 * The pool under 16 threads against a small budget: random sizes, frees in random order, stream
 * uses recorded on a few shared streams, while a checker thread keeps reading the stats. Asserts:
 * the budget is never exceeded at any observation; no block is handed out twice (each owner
 * stamps every 256-byte slot of its block and re-checks all of them before freeing); the
 * accounting adds up, and everything returns to the pool and then to the system at the end.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#include "check.h"
#include "internal.h"

#define KiB ((size_t)1024)
#define MiB ((size_t)1024 * 1024)
#define THREADS 16
#define STREAMS 4
#define HOLD 3

static pm_pool_t *g_pool;
static pm_stream_t g_streams[STREAMS];
static size_t g_budget;
static int g_iters;
static atomic_int g_running;

typedef struct worker {
  int id;
  uint64_t rng;
  /* results, read by main after join */
  uint64_t allocs, frees, budget_errors, other_errors, corrupt, recorded;
} worker_t;

/* A nonzero stamp unique to (owner, allocation, slot). */
static inline uint64_t stamp(int owner, uint64_t seq, size_t slot) {
  return ((uint64_t)(owner + 1) << 56) ^ (seq << 24) ^ (uint64_t)slot ^ 0x5A5A5A5A00000000ull;
}

/* Offset of the last word stamp_block writes past the 256-byte slots, or 0 if none: only when
 * it overlaps no slot stamp, so it catches blocks whose end is not a slot. */
static size_t tail_offset(size_t n) {
  if (n < 8) return 0;
  size_t last_slot = (n - 8) / 256 * 256;
  return n - 8 >= last_slot + 8 ? n - 8 : 0;
}

static void stamp_block(unsigned char *p, size_t n, int owner, uint64_t seq) {
  for (size_t off = 0, slot = 0; off + 8 <= n; off += 256, slot++) {
    uint64_t v = stamp(owner, seq, slot);
    memcpy(p + off, &v, 8);
  }
  size_t t = tail_offset(n);
  if (t) {
    uint64_t v = stamp(owner, seq, (size_t)-1);
    memcpy(p + t, &v, 8);
  }
}

static int check_block(const unsigned char *p, size_t n, int owner, uint64_t seq) {
  for (size_t off = 0, slot = 0; off + 8 <= n; off += 256, slot++) {
    uint64_t v;
    memcpy(&v, p + off, 8);
    if (v != stamp(owner, seq, slot)) return 0;
  }
  size_t t = tail_offset(n);
  if (t) {
    uint64_t v;
    memcpy(&v, p + t, 8);
    if (v != stamp(owner, seq, (size_t)-1)) return 0;
  }
  return 1;
}

typedef struct held {
  unsigned char *p;
  size_t n;
  uint64_t seq;
} held_t;

static size_t pick_size(worker_t *w) {
  uint64_t r = pm_test_rand(&w->rng) % 100;
  if (r < 70) return 1 + (size_t)(pm_test_rand(&w->rng) % (64 * KiB));
  if (r < 95) return 64 * KiB + (size_t)(pm_test_rand(&w->rng) % (960 * KiB));
  return MiB + (size_t)(pm_test_rand(&w->rng) % (2 * MiB));
}

static void release(worker_t *w, held_t *h) {
  if (!check_block(h->p, h->n, w->id, h->seq)) w->corrupt++;
  if (pm_host_free(h->p) == PM_OK)
    w->frees++;
  else
    w->other_errors++;
  h->p = NULL;
}

static void *worker_main(void *arg) {
  worker_t *w = arg;
  held_t held[HOLD] = {{0}};
  uint64_t seq = 0;
  for (int it = 0; it < g_iters; it++) {
    int slot = (int)(pm_test_rand(&w->rng) % HOLD);
    if (held[slot].p) {
      release(w, &held[slot]);
      continue;
    }
    size_t n = pick_size(w);
    void *p = NULL;
    pm_status_t st = pm_host_alloc(g_pool, n, PM_HOST_DEFAULT, &p);
    if (st == PM_ERR_BUDGET) {
      w->budget_errors++;
      /* Give memory back so the others (and this thread) make progress. */
      for (int k = 0; k < HOLD; k++)
        if (held[k].p) release(w, &held[k]);
      continue;
    }
    if (st != PM_OK) {
      w->other_errors++;
      continue;
    }
    w->allocs++;
    held[slot] = (held_t){p, n, ++seq};
    stamp_block(p, n, w->id, seq);
    if (pm_test_rand(&w->rng) % 4 == 0) {
      pm_stream_t s = g_streams[pm_test_rand(&w->rng) % STREAMS];
      if (pm_host_record_stream(p, s) == PM_OK)
        w->recorded++;
      else
        w->other_errors++;
      if (pm_test_rand(&w->rng) % 8 == 0 && pm_launch_busy(s, 0.0005) != PM_OK) w->other_errors++;
    }
  }
  for (int k = 0; k < HOLD; k++)
    if (held[k].p) release(w, &held[k]);
  return NULL;
}

typedef struct checker {
  uint64_t observations, over_budget, inconsistent, errors;
  size_t max_pinned;
} checker_t;

static void *checker_main(void *arg) {
  checker_t *c = arg;
  while (atomic_load(&g_running)) {
    pm_pool_stats_t s;
    if (pm_pool_get_stats(g_pool, &s) != PM_OK) {
      c->errors++;
      continue;
    }
    c->observations++;
    if (s.pinned_bytes > s.budget || s.pinned_bytes > g_budget) c->over_budget++;
    if (s.in_use_bytes + s.cached_bytes + s.pending_bytes + s.registered_bytes > s.pinned_bytes)
      c->inconsistent++;
    if (s.pinned_peak > g_budget) c->over_budget++;
    if (s.pinned_bytes > c->max_pinned) c->max_pinned = s.pinned_bytes;
    sched_yield(); /* observe often, but do not starve the workers of the pool lock */
  }
  return NULL;
}

int main(void) {
  pm_test_init();
  int is_small = pm_test_small();
  g_iters = is_small ? 40 : 1500;
  g_budget = 24 * MiB;
  if (pm_backend_kind() == PM_BACKEND_HOST && pm__memlock_limit() < 64 * MiB) {
    /* The host backend pins with mlock: stay under a user's RLIMIT_MEMLOCK (8 MiB). */
    g_budget = 6 * MiB;
    printf("note: RLIMIT_MEMLOCK allows %zu bytes: budget %zu\n", pm__memlock_limit(), g_budget);
  } else if (is_small) {
    g_budget = 8 * MiB; /* fewer iterations: keep the budget tight enough to be reached */
  }

  pm_pool_config_t c;
  pm_pool_config_init(&c);
  c.budget = g_budget;
  c.exhaust_policy = PM_EXHAUST_WAIT;
  c.wait_timeout_s = 0.02;
  c.fast_pin_min = 2 * MiB; /* both pinning paths take part */
  c.pin_threads = 2;
  REQUIRE_OK(pm_pool_create(&c, &g_pool));
  for (int i = 0; i < STREAMS; i++) REQUIRE_OK(pm_stream_create(&g_streams[i]));

  atomic_store(&g_running, 1);
  checker_t chk = {0};
  pthread_t checker;
  REQUIRE(pthread_create(&checker, NULL, checker_main, &chk) == 0);
  worker_t w[THREADS];
  pthread_t t[THREADS];
  for (int i = 0; i < THREADS; i++) {
    memset(&w[i], 0, sizeof w[i]);
    w[i].id = i;
    w[i].rng = 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1);
    REQUIRE(pthread_create(&t[i], NULL, worker_main, &w[i]) == 0);
  }
  for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
  atomic_store(&g_running, 0);
  pthread_join(checker, NULL);

  uint64_t allocs = 0, frees = 0, budget_errors = 0, other = 0, corrupt = 0, recorded = 0;
  for (int i = 0; i < THREADS; i++) {
    allocs += w[i].allocs;
    frees += w[i].frees;
    budget_errors += w[i].budget_errors;
    other += w[i].other_errors;
    corrupt += w[i].corrupt;
    recorded += w[i].recorded;
  }
  pm_pool_stats_t s;
  CHECK_OK(pm_pool_get_stats(g_pool, &s));
  printf(
      "stress: %llu allocs, %llu frees, %llu budget waits, %llu budget refusals, %llu stream "
      "uses, %llu segments pinned, %llu stats observations (max pinned %zu of %zu)\n",
      (unsigned long long)allocs, (unsigned long long)frees, (unsigned long long)s.budget_waits,
      (unsigned long long)budget_errors, (unsigned long long)recorded,
      (unsigned long long)s.backend_allocs, (unsigned long long)chk.observations, chk.max_pinned,
      g_budget);
  CHECK(allocs > 0);
  CHECK_EQ_INT(allocs, frees);
  CHECK_EQ_INT(corrupt, 0);
  CHECK_EQ_INT(other, 0);
  CHECK(chk.observations > 0);
  CHECK_EQ_INT(chk.over_budget, 0);
  CHECK_EQ_INT(chk.inconsistent, 0);
  CHECK_EQ_INT(chk.errors, 0);

  for (int i = 0; i < STREAMS; i++) CHECK_OK(pm_stream_synchronize(g_streams[i]));
  CHECK_OK(pm_pool_get_stats(g_pool, &s));
  CHECK_EQ_INT(s.allocs, allocs);
  CHECK_EQ_INT(s.frees, frees);
  CHECK_EQ_INT(s.budget_failures, budget_errors);
  CHECK_EQ_SIZE(s.in_use_bytes, 0);
  CHECK_EQ_SIZE(s.requested_bytes, 0);
  CHECK_EQ_SIZE(s.pending_bytes, 0);
  CHECK_EQ_SIZE(s.cached_bytes, s.pinned_bytes); /* all of it back in the cache */
  CHECK_LE_SIZE(s.pinned_peak, g_budget);
  CHECK_EQ_INT(s.cache_hits + s.backend_allocs, s.allocs);
  size_t released = 0;
  CHECK_OK(pm_pool_trim(g_pool, &released));
  CHECK_EQ_SIZE(released, s.pinned_bytes);
  CHECK_OK(pm_pool_get_stats(g_pool, &s));
  CHECK_EQ_SIZE(s.pinned_bytes, 0);
  CHECK_EQ_INT(s.segments, 0);
  CHECK_EQ_INT(s.backend_allocs, s.backend_frees);

  for (int i = 0; i < STREAMS; i++) CHECK_OK(pm_stream_destroy(g_streams[i]));
  CHECK_OK(pm_pool_destroy(g_pool));
  CHECK_OK(pm_finalize());
  return pm_test_finish("test_pool_stress");
}
