/*
 * The copy engine: pm_copy_async / pm_copy_batch_async and fences, on every path (direct from
 * pinned, registered and managed memory, staged from pageable memory, plain small pageable
 * copies, forced paths) and direction, with odd sizes, unaligned pointers and chunk boundaries.
 * Every transfer is checked byte for byte (and the bytes around it for stray writes); ordering
 * properties are checked deterministically by holding a stream with a host function.
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
#include "copy_internal.h" /* pm__stage_slab_count: which staging layout ran */
#include "internal.h"      /* pm__memcpy_mode: the staging byte movers, tested directly too */

static bool g_small;
static size_t g_chunk = (size_t)4 << 20; /* the staging chunk in force */
static size_t g_stage_min = (size_t)1 << 20;
static size_t g_page;

/* ---- helpers -------------------------------------------------------------------------------- */

static uint64_t g_rng = 0x243F6A8885A308D3ull;
static uint64_t rnd(void) {
  return pm_test_rand(&g_rng);
}

/* MEM_FOREIGN: pinned by the backend directly, as cudaHostAlloc from PyTorch or CuPy would be:
 * page-locked, yet unknown to pinmem's registry. */
typedef enum { MEM_PAGEABLE, MEM_POOL, MEM_REGISTERED, MEM_MANAGED, MEM_FOREIGN } mem_t;
static const char *mem_name[] = {"pageable", "pool", "registered", "managed", "foreign pinned"};

typedef struct hbuf {
  mem_t kind;
  char *alloc;
  size_t size;
  char *p; /* alloc + offset */
} hbuf_t;

static void hbuf_make(hbuf_t *h, mem_t kind, size_t bytes, size_t off) {
  memset(h, 0, sizeof *h);
  h->kind = kind;
  h->size = bytes + off + 64;
  void *a = NULL;
  switch (kind) {
    case MEM_PAGEABLE:
      a = malloc(h->size);
      REQUIRE(a != NULL);
      break;
    case MEM_POOL:
      REQUIRE_OK(pm_host_alloc(NULL, h->size, PM_HOST_DEFAULT, &a));
      break;
    case MEM_REGISTERED:
      h->size = (h->size + g_page - 1) / g_page * g_page;
      REQUIRE(posix_memalign(&a, g_page, h->size) == 0);
      REQUIRE_OK(pm_register(a, h->size, PM_REGISTER_DEFAULT));
      break;
    case MEM_MANAGED:
      REQUIRE_OK(pm_managed_alloc(h->size, &a));
      break;
    case MEM_FOREIGN:
      REQUIRE_OK(pm__backend()->host_alloc(h->size, 0, &a));
      break;
  }
  h->alloc = a;
  h->p = h->alloc + off;
}

static void hbuf_free(hbuf_t *h) {
  switch (h->kind) {
    case MEM_PAGEABLE:
      free(h->alloc);
      break;
    case MEM_POOL:
      CHECK_OK(pm_host_free(h->alloc));
      break;
    case MEM_REGISTERED:
      CHECK_OK(pm_unregister(h->alloc));
      free(h->alloc);
      break;
    case MEM_MANAGED:
      CHECK_OK(pm_managed_free(h->alloc));
      break;
    case MEM_FOREIGN:
      CHECK_OK(pm__backend()->host_free(h->alloc, h->size));
      break;
  }
  h->alloc = h->p = NULL;
}

/* A device buffer whose every byte holds a known pattern, so stray writes show. */
typedef struct dbuf {
  char *p;
  size_t size;
  uint64_t seed;
} dbuf_t;

static void dbuf_make(dbuf_t *d, size_t size, uint64_t seed) {
  d->size = size;
  d->seed = seed;
  void *p = NULL;
  REQUIRE_OK(pm_device_alloc(size, &p));
  d->p = p;
  char *tmp = malloc(size);
  REQUIRE(tmp != NULL);
  pm_test_fill(tmp, size, seed);
  REQUIRE_OK(pm_memcpy(d->p, tmp, size, PM_COPY_H2D));
  free(tmp);
}

static void dbuf_free(dbuf_t *d) {
  CHECK_OK(pm_device_free(d->p));
}

/* Read the whole device buffer with a plain synchronous copy (independent of the engine). */
static char *dbuf_read(const dbuf_t *d) {
  char *out = malloc(d->size);
  REQUIRE(out != NULL);
  CHECK_OK(pm_memcpy(out, d->p, d->size, PM_COPY_D2H));
  return out;
}

/* First differing offset, or -1. */
static long long first_diff(const void *a, const void *b, size_t n) {
  const unsigned char *x = a, *y = b;
  if (memcmp(x, y, n) == 0) return -1;
  for (size_t i = 0; i < n; i++)
    if (x[i] != y[i]) return (long long)i;
  return -1;
}

#define CHECK_BYTES(got, want, n, ...)                                                  \
  do {                                                                                  \
    long long at_ = first_diff((got), (want), (n));                                     \
    pm_test_checks++;                                                                   \
    if (at_ >= 0) {                                                                     \
      char ctx_[256];                                                                   \
      snprintf(ctx_, sizeof ctx_, __VA_ARGS__);                                         \
      PM_TEST_FAIL_AT(__FILE__, __LINE__, "%s: bytes differ at %lld of %zu", ctx_, at_, \
                      (size_t)(n));                                                     \
    }                                                                                   \
  } while (0)

/* Check that `buf` (filled with pm_test_fill(seed) over `size` bytes) still holds the pattern
 * outside [off, off + n). */
static void check_guards(const char *what, const char *buf, size_t size, uint64_t seed, size_t off,
                         size_t n) {
  char *ref = malloc(size);
  REQUIRE(ref != NULL);
  pm_test_fill(ref, size, seed);
  CHECK_BYTES(buf, ref, off, "%s: guard before", what);
  CHECK_BYTES(buf + off + n, ref + off + n, size - off - n, "%s: guard after", what);
  free(ref);
}

/* Callback bookkeeping: each copy gets its own counter. */
typedef struct cb_rec {
  atomic_int calls;
  atomic_int status;
  /* optional: bytes that must already be in place when the callback runs */
  const char *check_dst;
  const char *check_want;
  size_t check_n;
  atomic_int check_ok;
} cb_rec_t;

static void cb_count(void *arg, pm_status_t status) {
  cb_rec_t *r = arg;
  if (r->check_dst)
    atomic_store(&r->check_ok, memcmp(r->check_dst, r->check_want, r->check_n) == 0);
  atomic_store(&r->status, (int)status);
  atomic_fetch_add(&r->calls, 1);
}

static void cb_init(cb_rec_t *r) {
  memset(r, 0, sizeof *r);
  atomic_init(&r->calls, 0);
  atomic_init(&r->status, 12345);
  atomic_init(&r->check_ok, -1);
}

/* For callbacks without a fence: wait until it ran (or 20 s passed). */
static void cb_wait(cb_rec_t *r) {
  for (int i = 0; i < 20000 && atomic_load(&r->calls) == 0; i++) pm_test_sleep_ms(1);
}

/* A host function that holds a stream until the test opens it. A watchdog opens it after 30 s
 * so a wrongly blocking call fails the test instead of hanging it. */
typedef struct hold {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool open, forced, watchdog_stop;
  pthread_t watchdog;
} hold_t;

static void hold_fn(void *arg) {
  hold_t *h = arg;
  pthread_mutex_lock(&h->mu);
  while (!h->open) pthread_cond_wait(&h->cv, &h->mu);
  pthread_mutex_unlock(&h->mu);
}

static void *hold_watchdog(void *arg) {
  hold_t *h = arg;
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += 30;
  pthread_mutex_lock(&h->mu);
  while (!h->open && !h->watchdog_stop)
    if (pthread_cond_timedwait(&h->cv, &h->mu, &dl) != 0) break;
  if (!h->open) {
    h->forced = !h->watchdog_stop;
    h->open = true;
    pthread_cond_broadcast(&h->cv);
  }
  pthread_mutex_unlock(&h->mu);
  return NULL;
}

static void hold_start(hold_t *h, pm_stream_t s) {
  memset(h, 0, sizeof *h);
  pthread_mutex_init(&h->mu, NULL);
  pthread_cond_init(&h->cv, NULL);
  REQUIRE(pthread_create(&h->watchdog, NULL, hold_watchdog, h) == 0);
  REQUIRE_OK(pm_launch_host_func(s, hold_fn, h));
}

static void hold_open(hold_t *h) {
  pthread_mutex_lock(&h->mu);
  h->open = true;
  pthread_cond_broadcast(&h->cv);
  pthread_mutex_unlock(&h->mu);
}

/* Call after the held stream was synchronized (hold_fn has returned). */
static void hold_end(hold_t *h, const char *what) {
  pthread_mutex_lock(&h->mu);
  h->watchdog_stop = true;
  pthread_cond_broadcast(&h->cv);
  pthread_mutex_unlock(&h->mu);
  pthread_join(h->watchdog, NULL);
  if (h->forced) {
    pm_test_failures++;
    fprintf(stderr, "FAIL: %s: the call blocked on a held stream (watchdog released it)\n", what);
  }
  pthread_cond_destroy(&h->cv);
  pthread_mutex_destroy(&h->mu);
}

static pm_copy_path_t expect_path(mem_t host, size_t bytes, pm_copy_path_t force) {
  if (force != PM_PATH_AUTO) return force;
  return host == MEM_PAGEABLE && bytes >= g_stage_min ? PM_PATH_STAGED : PM_PATH_DIRECT;
}

/* The path of one H2D copy whose bytes must all arrive (a fence tells which path ran). */
static pm_copy_path_t h2d_path(const char *src, size_t bytes, pm_stream_t s, const char *what) {
  dbuf_t dev;
  dbuf_make(&dev, bytes, 77);
  pm_fence_t f = NULL;
  pm_copy_path_t path = (pm_copy_path_t)-1;
  CHECK_OK(pm_copy_async(dev.p, src, bytes, s, NULL, &f));
  if (f) {
    CHECK_OK(pm_fence_wait(f));
    CHECK_OK(pm_fence_path(f, &path));
    CHECK_OK(pm_fence_release(f));
  }
  char *d = dbuf_read(&dev);
  CHECK_BYTES(d, src, bytes, "%s", what);
  free(d);
  dbuf_free(&dev);
  return path;
}

/* Memory pinned outside pinmem (registered through the backend directly) is copied by one DMA
 * only while the whole range is pinned: a copy that starts in it and runs on into pageable
 * memory is staged, small or not (CUDA refuses one DMA over such a range), and its bytes arrive
 * either way. */
static void test_foreign_pinned(pm_stream_t s) {
  const pm__backend_t *b = pm__backend();
  size_t half = (g_stage_min + g_page - 1) / g_page * g_page * 2;
  char *buf = NULL;
  REQUIRE(posix_memalign((void **)&buf, g_page, 2 * half) == 0);
  pm_test_fill(buf, 2 * half, 3500);
  REQUIRE_OK(b->host_register(buf, half, 0));
  pm_pointer_info_t info;
  CHECK_OK(pm_pointer_query(buf, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_PAGEABLE); /* the registry does not know it */
  CHECK_EQ_INT(h2d_path(buf + 1, half - 1, s, "all pinned"), PM_PATH_DIRECT);
  CHECK_EQ_INT(h2d_path(buf + half - 4096, g_stage_min + 4096, s, "pinned, then pageable"),
               PM_PATH_STAGED);
  CHECK_EQ_INT(h2d_path(buf + half - 10, 20, s, "small, across the edge"), PM_PATH_STAGED);
  CHECK_EQ_INT(h2d_path(buf + half - 20, 20, s, "small, up to the edge"), PM_PATH_DIRECT);
  {
    /* The same in one batch: a piece inside, a piece across the edge, a piece past it. */
    dbuf_t dev;
    dbuf_make(&dev, 3 * 4096, 78);
    pm_copy_item_t it[3] = {{dev.p, buf + 100, 4096},
                            {dev.p + 4096, buf + half - 7, 4096},
                            {dev.p + 8192, buf + half + 5, 4096}};
    CHECK_OK(pm_copy_batch_async(it, 3, s, NULL, NULL));
    CHECK_OK(pm_stream_synchronize(s));
    char *d = dbuf_read(&dev);
    for (int i = 0; i < 3; i++)
      CHECK_BYTES(d + i * 4096, (const char *)it[i].src, 4096, "batch piece %d", i);
    free(d);
    dbuf_free(&dev);
  }
  CHECK_EQ_INT(h2d_path(buf + half, g_stage_min, s, "past the pinned part"), PM_PATH_STAGED);
  CHECK_OK(b->host_unregister(buf, half));
  CHECK_EQ_INT(h2d_path(buf, g_stage_min, s, "unregistered again"), PM_PATH_STAGED);
  free(buf);
}

/* ---- round trips ----------------------------------------------------------------------------- */

/* host(src_kind) -> device -> host(back_kind), each leg through pm_copy_async with a fence; the
 * device content is checked on its own too, and the bytes around each range. */
static void roundtrip(mem_t src_kind, mem_t back_kind, size_t bytes, size_t soff, size_t doff,
                      size_t boff, pm_stream_t s, pm_copy_path_t force, uint64_t seed) {
  char what[160];
  snprintf(what, sizeof what, "%s->dev->%s %zu bytes (offsets %zu/%zu/%zu, path %d)",
           mem_name[src_kind], mem_name[back_kind], bytes, soff, doff, boff, (int)force);
  hbuf_t src, back;
  hbuf_make(&src, src_kind, bytes, soff);
  hbuf_make(&back, back_kind, bytes, boff);
  pm_test_fill(src.alloc, src.size, seed);
  pm_test_fill(back.alloc, back.size, seed + 1);
  dbuf_t dev;
  dbuf_make(&dev, bytes + doff + 64, seed + 2);

  pm_copy_options_t o;
  pm_copy_options_init(&o);
  o.path = force;
  pm_fence_t f = NULL;
  pm_copy_path_t path = (pm_copy_path_t)-1;
  CHECK_OK(pm_copy_async(dev.p + doff, src.p, bytes, s, &o, &f));
  if (f) {
    CHECK_OK(pm_fence_wait(f));
    CHECK_OK(pm_fence_path(f, &path));
    CHECK_EQ_INT(path, expect_path(src_kind, bytes, force));
    CHECK_OK(pm_fence_release(f));
  }
  char *d = dbuf_read(&dev);
  CHECK_BYTES(d + doff, src.p, bytes, "%s: H2D", what);
  check_guards(what, d, dev.size, dev.seed, doff, bytes);
  free(d);

  f = NULL;
  CHECK_OK(pm_copy_async(back.p, dev.p + doff, bytes, s, &o, &f));
  if (f) {
    CHECK_OK(pm_fence_wait(f));
    CHECK_OK(pm_fence_path(f, &path));
    CHECK_EQ_INT(path, expect_path(back_kind, bytes, force));
    CHECK_OK(pm_fence_release(f));
  }
  CHECK_BYTES(back.p, src.p, bytes, "%s: D2H", what);
  check_guards(what, back.alloc, back.size, seed + 1, boff, bytes);
  dbuf_free(&dev);
  hbuf_free(&src);
  hbuf_free(&back);
}

static void test_roundtrips(pm_stream_t s) {
  const size_t c = g_chunk;
  size_t sizes[] = {1,
                    7,
                    255,
                    4097,
                    c - 1,
                    c,
                    c + 1,
                    2 * c,
                    3 * c + 17,
                    g_stage_min - 1,
                    g_stage_min,
                    g_stage_min + 3,
                    9 * c + 4093,
                    33 * c + 5};
  size_t nsizes = sizeof sizes / sizeof sizes[0];
  const size_t offs[][3] = {{0, 0, 0}, {1, 3, 5}, {7, 0, 4095}, {4093, 13, 1}};
  int cases = 0;
  for (size_t i = 0; i < nsizes; i++) {
    if (g_small && sizes[i] > 4 * c) continue;
    for (size_t k = 0; k < 4; k++) {
      if (g_small && k % 2) continue;
      /* pageable both ways, and pinned/registered on one leg, rotating */
      mem_t a = MEM_PAGEABLE, bk = MEM_PAGEABLE;
      if (k == 1) a = MEM_POOL;
      if (k == 2) bk = MEM_REGISTERED;
      if (k == 3) {
        a = MEM_REGISTERED;
        bk = MEM_POOL;
      }
      roundtrip(a, bk, sizes[i], offs[k][0], offs[k][1], offs[k][2], s, PM_PATH_AUTO,
                1000 + i * 10 + k);
      roundtrip(MEM_PAGEABLE, MEM_PAGEABLE, sizes[i], offs[k][0], offs[k][1], offs[k][2], s,
                PM_PATH_AUTO, 2000 + i * 10 + k);
      cases += 2;
    }
  }
  /* Forced paths: staging of pinned memory, and the plain copy of large pageable memory. */
  size_t fsizes[] = {1, c + 1, 5 * c + 77};
  for (size_t i = 0; i < 3; i++) {
    roundtrip(MEM_POOL, MEM_REGISTERED, fsizes[i], 3, 1, 2, s, PM_PATH_STAGED, 3000 + i);
    roundtrip(MEM_PAGEABLE, MEM_PAGEABLE, fsizes[i], 1, 2, 3, s, PM_PATH_STAGED, 3100 + i);
    roundtrip(MEM_PAGEABLE, MEM_PAGEABLE, fsizes[i], 5, 0, 1, s, PM_PATH_DIRECT, 3200 + i);
    cases += 3;
  }
  /* Managed memory takes the direct path both ways. */
  roundtrip(MEM_MANAGED, MEM_MANAGED, 3 * c + 9, 1, 2, 3, s, PM_PATH_AUTO, 3300);
  /* So does memory another library pinned, small or above copy_stage_min, either leg. */
  roundtrip(MEM_FOREIGN, MEM_PAGEABLE, g_stage_min + 4093, 1, 2, 3, s, PM_PATH_AUTO, 3400);
  roundtrip(MEM_PAGEABLE, MEM_FOREIGN, 3 * c + 17, 5, 0, 7, s, PM_PATH_AUTO, 3401);
  roundtrip(MEM_FOREIGN, MEM_FOREIGN, 77, 3, 1, 0, s, PM_PATH_AUTO, 3402);
  roundtrip(MEM_FOREIGN, MEM_POOL, 2 * g_stage_min, 0, 0, 0, s, PM_PATH_STAGED, 3403);
  cases += 5;
  /* Random sizes and offsets. */
  int nrand = g_small ? 4 : 24;
  for (int i = 0; i < nrand; i++) {
    size_t bytes = 1 + rnd() % (8 * c);
    mem_t a = (mem_t)(rnd() % 3), bk = (mem_t)(rnd() % 3);
    roundtrip(a, bk, bytes, rnd() % 64, rnd() % 64, rnd() % 64, s, PM_PATH_AUTO, 4000 + i);
    cases++;
  }
  printf("round trips: %d cases\n", cases + 1);
}

/* D2D and H2H. */
static void test_d2d_h2h(pm_stream_t s) {
  size_t n = 3 * g_chunk + 11;
  dbuf_t a, b;
  dbuf_make(&a, n + 64, 51);
  dbuf_make(&b, n + 64, 52);
  pm_fence_t f;
  CHECK_OK(pm_copy_async(b.p + 5, a.p + 3, n, s, NULL, &f));
  CHECK_OK(pm_fence_wait(f));
  CHECK_OK(pm_fence_release(f));
  char *ra = dbuf_read(&a), *rb = dbuf_read(&b);
  CHECK_BYTES(rb + 5, ra + 3, n, "D2D");
  check_guards("D2D", rb, b.size, b.seed, 5, n);
  free(ra);
  free(rb);
  dbuf_free(&a);
  dbuf_free(&b);

  mem_t kinds[][2] = {
      {MEM_PAGEABLE, MEM_PAGEABLE}, {MEM_POOL, MEM_POOL}, {MEM_PAGEABLE, MEM_REGISTERED}};
  for (int k = 0; k < 3; k++) {
    hbuf_t x, y;
    hbuf_make(&x, kinds[k][0], n, 1);
    hbuf_make(&y, kinds[k][1], n, 2);
    pm_test_fill(x.alloc, x.size, 60 + k);
    pm_test_fill(y.alloc, y.size, 70 + k);
    pm_copy_options_t o;
    pm_copy_options_init(&o);
    o.kind = k == 2 ? PM_COPY_H2H : PM_COPY_DEFAULT;
    pm_copy_path_t path;
    CHECK_OK(pm_copy_async(y.p, x.p, n, s, &o, &f));
    CHECK_OK(pm_fence_wait(f));
    CHECK_OK(pm_fence_path(f, &path));
    CHECK_EQ_INT(path, PM_PATH_DIRECT);
    CHECK_OK(pm_fence_release(f));
    CHECK_BYTES(y.p, x.p, n, "H2H %s->%s", mem_name[kinds[k][0]], mem_name[kinds[k][1]]);
    check_guards("H2H", y.alloc, y.size, 70 + k, 2, n);
    hbuf_free(&x);
    hbuf_free(&y);
  }
}

/* ---- ordering and completion ----------------------------------------------------------------- */

/* Staged H2D returns without waiting for the stream, and the source may change right away. */
static void test_h2d_source_reuse(pm_stream_t s) {
  size_t n = 12 * g_chunk + 5;
  hbuf_t src;
  hbuf_make(&src, MEM_PAGEABLE, n, 3);
  pm_test_fill(src.p, n, 81);
  char *want = malloc(n);
  REQUIRE(want != NULL);
  memcpy(want, src.p, n);
  dbuf_t dev;
  dbuf_make(&dev, n, 82);

  hold_t h;
  hold_start(&h, s);
  pm_fence_t f;
  cb_rec_t cb;
  cb_init(&cb);
  pm_copy_options_t o;
  pm_copy_options_init(&o);
  o.callback = cb_count;
  o.callback_arg = &cb;
  CHECK_OK(pm_copy_async(dev.p, src.p, n, s, &o, &f)); /* must not wait for the held stream */
  CHECK_ST(pm_fence_query(f), PM_NOT_READY);
  CHECK_EQ_INT(atomic_load(&cb.calls), 0);
  pm_test_fill(src.p, n, 83); /* the caller reuses its buffer at once */
  hold_open(&h);
  CHECK_OK(pm_fence_wait(f));
  CHECK_EQ_INT(atomic_load(&cb.calls), 1);
  CHECK_EQ_INT(atomic_load(&cb.status), PM_OK);
  pm_copy_path_t path;
  CHECK_OK(pm_fence_path(f, &path));
  CHECK_EQ_INT(path, PM_PATH_STAGED);
  CHECK_OK(pm_fence_release(f));
  CHECK_OK(pm_stream_synchronize(s));
  hold_end(&h, "staged H2D");
  char *d = dbuf_read(&dev);
  CHECK_BYTES(d, want, n, "staged H2D, source changed after the return");
  free(d);
  free(want);
  dbuf_free(&dev);
  hbuf_free(&src);
}

typedef struct probe {
  const char *dst, *want;
  size_t n;
  atomic_int ok;
} probe_t;

static void probe_fn(void *arg) {
  probe_t *p = arg;
  atomic_store(&p->ok, memcmp(p->dst, p->want, p->n) == 0);
}

/* Staged D2H: the call does not block; the fence, the callback and a stream made to wait for
 * the fence all see the bytes in dst, never earlier. */
static void test_d2h_completion(pm_stream_t s, pm_stream_t s2) {
  size_t n = 10 * g_chunk + 3;
  char *want = malloc(n);
  REQUIRE(want != NULL);
  pm_test_fill(want, n, 91);
  dbuf_t dev;
  dbuf_make(&dev, n + 16, 92);
  CHECK_OK(pm_memcpy(dev.p + 1, want, n, PM_COPY_H2D));
  hbuf_t dst;
  hbuf_make(&dst, MEM_PAGEABLE, n, 7);
  pm_test_fill(dst.alloc, dst.size, 93);
  char *before = malloc(n);
  REQUIRE(before != NULL);
  memcpy(before, dst.p, n);

  hold_t h;
  hold_start(&h, s);
  cb_rec_t cb;
  cb_init(&cb);
  cb.check_dst = dst.p;
  cb.check_want = want;
  cb.check_n = n;
  pm_copy_options_t o;
  pm_copy_options_init(&o);
  o.callback = cb_count;
  o.callback_arg = &cb;
  pm_fence_t f;
  CHECK_OK(pm_copy_async(dst.p, dev.p + 1, n, s, &o, &f));
  CHECK_ST(pm_fence_query(f), PM_NOT_READY);
  CHECK_BYTES(dst.p, before, n, "staged D2H: dst untouched while the stream is held");
  probe_t pr = {dst.p, want, n, 0};
  atomic_init(&pr.ok, -1);
  CHECK_OK(pm_fence_stream_wait(f, s2));
  CHECK_OK(pm_launch_host_func(s2, probe_fn, &pr));
  CHECK_ST(pm_stream_query(s2), PM_NOT_READY);
  hold_open(&h);
  CHECK_OK(pm_fence_wait(f));
  CHECK_BYTES(dst.p, want, n, "staged D2H after pm_fence_wait");
  check_guards("staged D2H", dst.alloc, dst.size, 93, 7, n);
  CHECK_EQ_INT(atomic_load(&cb.calls), 1);
  CHECK_EQ_INT(atomic_load(&cb.check_ok), 1);
  CHECK_EQ_INT(atomic_load(&cb.status), PM_OK);
  pm_copy_path_t path;
  CHECK_OK(pm_fence_path(f, &path));
  CHECK_EQ_INT(path, PM_PATH_STAGED);
  CHECK_OK(pm_fence_release(f));
  CHECK_OK(pm_stream_synchronize(s2));
  CHECK_EQ_INT(atomic_load(&pr.ok), 1);
  CHECK_OK(pm_stream_synchronize(s));
  hold_end(&h, "staged D2H");

  /* Neither fence nor callback: the stream itself waits until the bytes are in dst. */
  pm_test_fill(dst.alloc, dst.size, 94);
  hold_start(&h, s);
  CHECK_OK(pm_copy_async(dst.p, dev.p + 1, n, s, NULL, NULL));
  atomic_store(&pr.ok, -1);
  CHECK_OK(pm_launch_host_func(s, probe_fn, &pr));
  hold_open(&h);
  CHECK_OK(pm_stream_synchronize(s));
  hold_end(&h, "staged D2H without fence");
  CHECK_EQ_INT(atomic_load(&pr.ok), 1);
  CHECK_BYTES(dst.p, want, n, "staged D2H without fence, after pm_stream_synchronize");

  /* Released at once: the copy still completes (and frees everything). */
  pm_test_fill(dst.alloc, dst.size, 95);
  CHECK_OK(pm_copy_async(dst.p, dev.p + 1, n, s, NULL, &f));
  CHECK_OK(pm_fence_release(f));
  CHECK_OK(pm_copy_async(dst.p, dev.p + 1, n, s, NULL, &f)); /* same bytes again, waited */
  CHECK_OK(pm_fence_wait(f));
  CHECK_OK(pm_fence_release(f));
  CHECK_BYTES(dst.p, want, n, "staged D2H after an early release");

  /* Two staged D2H copies into one dst on one stream land in stream order: the later wins,
   * and its completion implies the earlier one's. */
  {
    char *other = malloc(n);
    REQUIRE(other != NULL);
    pm_test_fill(other, n, 96);
    dbuf_t dev2;
    dbuf_make(&dev2, n, 97);
    CHECK_OK(pm_memcpy(dev2.p, other, n, PM_COPY_H2D));
    for (int rep = 0; rep < (g_small ? 2 : 8); rep++) {
      pm_fence_t f1, f2;
      CHECK_OK(pm_copy_async(dst.p, rep % 2 ? dev2.p : dev.p + 1, n, s, NULL, &f1));
      CHECK_OK(pm_copy_async(dst.p, rep % 2 ? dev.p + 1 : dev2.p, n, s, NULL, &f2));
      CHECK_OK(pm_fence_wait(f2));
      CHECK_OK(pm_fence_query(f1));
      CHECK_BYTES(dst.p, rep % 2 ? want : other, n, "two staged D2H into one dst (%d)", rep);
      CHECK_OK(pm_fence_release(f1));
      CHECK_OK(pm_fence_release(f2));
    }
    dbuf_free(&dev2);
    free(other);
  }

  free(before);
  free(want);
  hbuf_free(&dst);
  dbuf_free(&dev);
}

/* Callbacks fire exactly once, with PM_OK, on every path, with and without a fence. */
static void test_callbacks(pm_stream_t s) {
  size_t sizes[] = {0, 100, 3 * g_chunk + 1};
  mem_t kinds[] = {MEM_PAGEABLE, MEM_POOL};
  dbuf_t dev;
  dbuf_make(&dev, 3 * g_chunk + 64, 101);
  for (int si = 0; si < 3; si++) {
    for (int ki = 0; ki < 2; ki++) {
      for (int dir = 0; dir < 2; dir++) {
        for (int with_fence = 0; with_fence < 2; with_fence++) {
          size_t n = sizes[si];
          hbuf_t hb;
          hbuf_make(&hb, kinds[ki], n, 1);
          pm_test_fill(hb.alloc, hb.size, 102 + (uint64_t)si);
          cb_rec_t cb;
          cb_init(&cb);
          pm_copy_options_t o;
          pm_copy_options_init(&o);
          o.callback = cb_count;
          o.callback_arg = &cb;
          pm_fence_t f = NULL;
          if (dir == 0)
            CHECK_OK(pm_copy_async(dev.p, hb.p, n, s, &o, with_fence ? &f : NULL));
          else
            CHECK_OK(pm_copy_async(hb.p, dev.p, n, s, &o, with_fence ? &f : NULL));
          if (f) {
            CHECK_OK(pm_fence_wait(f));
            CHECK_OK(pm_fence_query(f));
            CHECK_OK(pm_fence_release(f));
          } else {
            cb_wait(&cb);
          }
          CHECK_OK(pm_stream_synchronize(s));
          pm_test_sleep_ms(g_small ? 5 : 1); /* a second (wrong) call would come now */
          CHECK_EQ_INT(atomic_load(&cb.calls), 1);
          CHECK_EQ_INT(atomic_load(&cb.status), PM_OK);
          hbuf_free(&hb);
        }
      }
    }
  }
  dbuf_free(&dev);
}

/* A stream told to wait for an H2D fence sees the data. */
static void test_fence_stream_wait(pm_stream_t s, pm_stream_t s2) {
  size_t n = 6 * g_chunk + 9;
  hbuf_t src;
  hbuf_make(&src, MEM_PAGEABLE, n, 0);
  pm_test_fill(src.p, n, 111);
  dbuf_t a, b;
  dbuf_make(&a, n, 112);
  dbuf_make(&b, n, 113);
  hold_t h;
  hold_start(&h, s);
  pm_fence_t f;
  CHECK_OK(pm_copy_async(a.p, src.p, n, s, NULL, &f));
  CHECK_OK(pm_fence_stream_wait(f, s2));
  CHECK_OK(pm_memcpy_async(b.p, a.p, n, PM_COPY_D2D, s2)); /* ordered after the H2D */
  hold_open(&h);
  CHECK_OK(pm_stream_synchronize(s2));
  CHECK_OK(pm_fence_query(f));
  CHECK_OK(pm_fence_release(f));
  CHECK_OK(pm_stream_synchronize(s));
  hold_end(&h, "fence stream wait");
  char *rb = dbuf_read(&b);
  CHECK_BYTES(rb, src.p, n, "D2D ordered after a fence");
  free(rb);
  dbuf_free(&a);
  dbuf_free(&b);
  hbuf_free(&src);
}

/* ---- budget ---------------------------------------------------------------------------------- */

static void test_tiny_budget(pm_stream_t s) {
  pm_pool_config_t pc;
  pm_pool_config_init(&pc);
  pc.budget = 2 * g_chunk; /* room for two chunk-sized slots, never for a whole copy */
  pc.exhaust_policy = PM_EXHAUST_FAIL;
  pm_pool_t *pool;
  REQUIRE_OK(pm_pool_create(&pc, &pool));
  size_t n = 17 * g_chunk + 3;
  hbuf_t src, back;
  hbuf_make(&src, MEM_PAGEABLE, n, 1);
  hbuf_make(&back, MEM_PAGEABLE, n, 2);
  pm_test_fill(src.alloc, src.size, 121);
  pm_test_fill(back.alloc, back.size, 122);
  dbuf_t dev;
  dbuf_make(&dev, n + 8, 123);
  pm_copy_options_t o;
  pm_copy_options_init(&o);
  o.pool = pool;
  cb_rec_t cb;
  cb_init(&cb);
  o.callback = cb_count;
  o.callback_arg = &cb;
  pm_fence_t f;
  CHECK_OK(pm_copy_async(dev.p + 4, src.p, n, s, &o, &f));
  pm_test_fill(src.p, 16, 124); /* returned: the source was read */
  CHECK_OK(pm_fence_wait(f));
  CHECK_OK(pm_fence_release(f));
  CHECK_EQ_INT(atomic_load(&cb.calls), 1);
  char *d = dbuf_read(&dev);
  pm_test_fill(src.p, 16, 124);
  char *ref = malloc(src.size);
  REQUIRE(ref != NULL);
  pm_test_fill(ref, src.size, 121);
  CHECK_BYTES(d + 4, ref + 1, n, "H2D through a 2-slot ring");
  free(ref);
  free(d);

  cb_init(&cb);
  CHECK_OK(pm_copy_async(back.p, dev.p + 4, n, s, &o, &f));
  CHECK_OK(pm_fence_wait(f));
  CHECK_OK(pm_fence_release(f));
  CHECK_EQ_INT(atomic_load(&cb.calls), 1);
  d = dbuf_read(&dev);
  CHECK_BYTES(back.p, d + 4, n, "D2H through a 2-slot ring");
  check_guards("D2H ring", back.alloc, back.size, 122, 2, n);
  free(d);

  /* Batch through the ring too. */
  pm_copy_item_t items[3] = {{dev.p, src.p + 5, 3 * g_chunk},
                             {dev.p + 3 * g_chunk + 100, src.p + 7 * g_chunk, 2 * g_chunk + 1},
                             {dev.p + 6 * g_chunk, src.p + 1, 77}};
  pm_test_fill(src.alloc, src.size, 125);
  CHECK_OK(pm_copy_batch_async(items, 3, s, &o, &f));
  CHECK_OK(pm_fence_wait(f));
  CHECK_OK(pm_fence_release(f));
  d = dbuf_read(&dev);
  for (int i = 0; i < 3; i++)
    CHECK_BYTES(d + ((char *)items[i].dst - dev.p), items[i].src, items[i].bytes,
                "ring batch item %d", i);
  free(d);

  pm_pool_stats_t st;
  CHECK_OK(pm_pool_get_stats(pool, &st));
  CHECK_LE_SIZE(st.pinned_peak, pc.budget);
  CHECK_EQ_SIZE(st.in_use_bytes, 0);

  /* A budget that cannot hold even one slot: a clean PM_ERR_BUDGET, no callback, no leak. */
  pm_pool_t *none;
  pc.budget = g_chunk / 2;
  REQUIRE_OK(pm_pool_create(&pc, &none));
  o.pool = none;
  cb_init(&cb);
  f = NULL;
  CHECK_ERR_MSG(pm_copy_async(dev.p, src.p, n, s, &o, &f), PM_ERR_BUDGET);
  CHECK(f == NULL);
  CHECK_ERR_MSG(pm_copy_async(back.p, dev.p, n, s, &o, &f), PM_ERR_BUDGET);
  CHECK(f == NULL);
  CHECK_OK(pm_stream_synchronize(s));
  pm_test_sleep_ms(5);
  CHECK_EQ_INT(atomic_load(&cb.calls), 0);
  CHECK_OK(pm_pool_get_stats(none, &st));
  CHECK_EQ_SIZE(st.in_use_bytes, 0);

  CHECK_OK(pm_stream_synchronize(s));
  dbuf_free(&dev);
  hbuf_free(&src);
  hbuf_free(&back);
  CHECK_OK(pm_pool_destroy(none));
  CHECK_OK(pm_pool_destroy(pool));
}

/* ---- batches --------------------------------------------------------------------------------- */

/* Items: random lengths from `src` (at rising offsets with gaps) to `dst` slots in shuffled
 * order; returns the count. */
static size_t make_items(pm_copy_item_t *items, size_t max, char *dst, size_t dst_size, char *src,
                         size_t src_size, size_t max_len) {
  size_t n = 0, soff = 0;
  size_t slot = max_len + 32;
  size_t nslots = dst_size / slot;
  size_t *perm = malloc(nslots * sizeof *perm);
  REQUIRE(perm != NULL);
  for (size_t i = 0; i < nslots; i++) perm[i] = i;
  for (size_t i = nslots; i > 1; i--) {
    size_t j = rnd() % i, t = perm[i - 1];
    perm[i - 1] = perm[j];
    perm[j] = t;
  }
  while (n < max && n < nslots) {
    size_t len = 1 + rnd() % max_len;
    soff += rnd() % 40;
    if (soff + len > src_size) break;
    items[n].src = src + soff;
    items[n].dst = dst + perm[n] * slot + rnd() % 32;
    items[n].bytes = len;
    soff += len;
    n++;
  }
  free(perm);
  return n;
}

static void test_batches(pm_stream_t s) {
  size_t max = g_small ? 60 : 400;
  size_t dsize = max * 3200;
  pm_copy_item_t *items = calloc(max + 8, sizeof *items);
  REQUIRE(items != NULL);

  for (int kind = 0; kind < 3; kind++) { /* 0 pageable, 1 pool, 2 mixed */
    hbuf_t src;
    hbuf_make(&src, kind == 1 ? MEM_POOL : MEM_PAGEABLE, dsize, 3);
    pm_test_fill(src.alloc, src.size, 131 + (uint64_t)kind);
    dbuf_t dev;
    dbuf_make(&dev, dsize, 134);
    size_t n = make_items(items, max, dev.p, dev.size, src.p, dsize, 3000);
    hbuf_t pin;
    if (kind == 2) { /* every third item from pinned memory */
      hbuf_make(&pin, MEM_POOL, dsize, 0);
      pm_test_fill(pin.p, dsize, 135);
      for (size_t i = 0; i < n; i += 3) items[i].src = pin.p + ((const char *)items[i].src - src.p);
    }
    /* and one large item across several chunks */
    size_t big = 3 * g_chunk + 1;
    char *bigsrc = malloc(big);
    REQUIRE(bigsrc != NULL);
    pm_test_fill(bigsrc, big, 136);
    dbuf_t dbig;
    dbuf_make(&dbig, big, 137);
    items[n].dst = dbig.p;
    items[n].src = bigsrc;
    items[n].bytes = big;
    n++;
    items[n].dst = dev.p; /* empty items are skipped */
    items[n].src = bigsrc;
    items[n].bytes = 0;
    n++;

    cb_rec_t cb;
    cb_init(&cb);
    pm_copy_options_t o;
    pm_copy_options_init(&o);
    o.callback = cb_count;
    o.callback_arg = &cb;
    pm_fence_t f;
    CHECK_OK(pm_copy_batch_async(items, n, s, &o, &f));
    CHECK_OK(pm_fence_wait(f));
    pm_copy_path_t path;
    CHECK_OK(pm_fence_path(f, &path));
    CHECK_EQ_INT(path, PM_PATH_STAGED); /* the large pageable item is always staged */
    CHECK_OK(pm_fence_release(f));
    CHECK_EQ_INT(atomic_load(&cb.calls), 1);
    char *d = dbuf_read(&dev);
    for (size_t i = 0; i + 2 < n; i++)
      CHECK_BYTES(d + ((char *)items[i].dst - dev.p), items[i].src, items[i].bytes,
                  "H2D batch (%d) item %zu", kind, i);
    free(d);
    d = dbuf_read(&dbig);
    CHECK_BYTES(d, bigsrc, big, "H2D batch (%d) large item", kind);
    free(d);

    /* D2H: the items back, from device slots into a fresh host layout. */
    hbuf_t back;
    hbuf_make(&back, kind == 1 ? MEM_POOL : MEM_PAGEABLE, dsize, 1);
    pm_test_fill(back.alloc, back.size, 138);
    pm_copy_item_t *rev = calloc(n, sizeof *rev);
    REQUIRE(rev != NULL);
    size_t off = 0;
    for (size_t i = 0; i + 2 < n; i++) {
      rev[i].src = items[i].dst;
      rev[i].dst = back.p + off;
      rev[i].bytes = items[i].bytes;
      off += items[i].bytes + (i % 5); /* some adjacent, some not */
    }
    char *bigback = malloc(big);
    REQUIRE(bigback != NULL);
    rev[n - 2].src = dbig.p;
    rev[n - 2].dst = bigback;
    rev[n - 2].bytes = big;
    rev[n - 1] = rev[0];
    rev[n - 1].bytes = 0;
    cb_init(&cb);
    CHECK_OK(pm_copy_batch_async(rev, n, s, &o, &f));
    CHECK_OK(pm_fence_wait(f));
    CHECK_OK(pm_fence_release(f));
    CHECK_EQ_INT(atomic_load(&cb.calls), 1);
    for (size_t i = 0; i + 2 < n; i++)
      CHECK_BYTES(rev[i].dst, items[i].src, rev[i].bytes, "D2H batch (%d) item %zu", kind, i);
    CHECK_BYTES(bigback, bigsrc, big, "D2H batch (%d) large item", kind);
    free(rev);
    free(bigback);
    hbuf_free(&back);
    free(bigsrc);
    dbuf_free(&dbig);
    dbuf_free(&dev);
    if (kind == 2) hbuf_free(&pin);
    hbuf_free(&src);
  }

  /* Pinned pieces, adjacent runs (merged into one DMA) and scattered ones: direct path. */
  {
    size_t n = g_small ? 64 : 512, piece = 1000;
    hbuf_t src;
    hbuf_make(&src, MEM_POOL, n * piece, 0);
    pm_test_fill(src.p, n * piece, 141);
    dbuf_t dev;
    dbuf_make(&dev, 2 * n * piece, 142);
    size_t cnt = n < max ? n : max;
    for (size_t i = 0; i < cnt; i++) {
      items[i].src = src.p + i * piece;
      items[i].dst = dev.p + (i < cnt / 2 ? i * piece : n * piece + (cnt - 1 - i) * piece);
      items[i].bytes = piece;
    }
    pm_fence_t f;
    CHECK_OK(pm_copy_batch_async(items, cnt, s, NULL, &f));
    CHECK_OK(pm_fence_wait(f));
    pm_copy_path_t path;
    CHECK_OK(pm_fence_path(f, &path));
    CHECK_EQ_INT(path, PM_PATH_DIRECT);
    CHECK_OK(pm_fence_release(f));
    char *d = dbuf_read(&dev);
    for (size_t i = 0; i < cnt; i++)
      CHECK_BYTES(d + ((char *)items[i].dst - dev.p), items[i].src, piece, "pinned batch %zu", i);
    free(d);
    dbuf_free(&dev);
    hbuf_free(&src);
  }

  /* Nothing to copy: complete at once, the callback still runs once. */
  {
    cb_rec_t cb;
    cb_init(&cb);
    pm_copy_options_t o;
    pm_copy_options_init(&o);
    o.callback = cb_count;
    o.callback_arg = &cb;
    pm_fence_t f;
    CHECK_OK(pm_copy_batch_async(NULL, 0, s, &o, &f));
    CHECK_OK(pm_fence_wait(f));
    CHECK_OK(pm_fence_release(f));
    CHECK_EQ_INT(atomic_load(&cb.calls), 1);
    CHECK_EQ_INT(atomic_load(&cb.status), PM_OK);
  }
  free(items);
}

/* ---- errors ---------------------------------------------------------------------------------- */

static void test_errors(pm_stream_t s) {
  cb_rec_t cb;
  cb_init(&cb);
  pm_copy_options_t o;
  pm_copy_options_init(&o);
  o.callback = cb_count;
  o.callback_arg = &cb;
  char *host = malloc(4096);
  REQUIRE(host != NULL);
  pm_test_fill(host, 4096, 151);
  dbuf_t dev;
  dbuf_make(&dev, 4096, 152);
  pm_fence_t f = NULL;

  CHECK_ERR_MSG(pm_copy_async(NULL, host, 10, s, &o, &f), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_copy_async(dev.p, NULL, 10, s, &o, &f), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_copy_async(host + 10, host, 100, s, &o, &f), PM_ERR_INVALID); /* overlap */
  CHECK_ERR_MSG(pm_copy_async(host, host + 99, 100, s, &o, &f), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_copy_async(dev.p + 8, dev.p, 64, s, &o, &f), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_copy_async(dev.p, (char *)UINTPTR_MAX - 4, 100, s, &o, &f), PM_ERR_INVALID);
  /* past the end of a device allocation */
  CHECK_ERR_MSG(pm_copy_async(dev.p + 4000, host, 200, s, &o, &f), PM_ERR_INVALID);
  /* the kind contradicts the pointers */
  o.kind = PM_COPY_D2H;
  CHECK_ERR_MSG(pm_copy_async(dev.p, host, 10, s, &o, &f), PM_ERR_INVALID);
  o.kind = PM_COPY_H2D;
  CHECK_ERR_MSG(pm_copy_async(host + 2000, host, 10, s, &o, &f), PM_ERR_INVALID);
  o.kind = PM_COPY_H2H;
  CHECK_ERR_MSG(pm_copy_async(dev.p, host, 10, s, &o, &f), PM_ERR_INVALID);
  o.kind = PM_COPY_D2D;
  CHECK_ERR_MSG(pm_copy_async(host, dev.p, 10, s, &o, &f), PM_ERR_INVALID);
  o.kind = (pm_copy_kind_t)17;
  CHECK_ERR_MSG(pm_copy_async(dev.p, host, 10, s, &o, &f), PM_ERR_INVALID);
  o.kind = PM_COPY_DEFAULT;
  o.path = (pm_copy_path_t)9;
  CHECK_ERR_MSG(pm_copy_async(dev.p, host, 10, s, &o, &f), PM_ERR_INVALID);
  o.path = PM_PATH_REGISTER;
  CHECK_ERR_MSG(pm_copy_async(dev.p, host, 10, s, &o, &f), PM_ERR_UNSUPPORTED);
  o.path = PM_PATH_STAGED; /* staging needs a host and a device side */
  CHECK_ERR_MSG(pm_copy_async(host + 2000, host, 10, s, &o, &f), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_copy_async(dev.p + 2000, dev.p, 10, s, &o, &f), PM_ERR_INVALID);
  o.path = PM_PATH_AUTO;

  /* memory freed back to a pool */
  {
    pm_pool_t *pool;
    REQUIRE_OK(pm_pool_create(NULL, &pool));
    void *blk;
    REQUIRE_OK(pm_host_alloc(pool, 4096, 0, &blk));
    pm_test_fill(blk, 4096, 153);
    CHECK_OK(pm_host_free(blk));
    CHECK_ERR_MSG(pm_copy_async(dev.p, blk, 100, s, &o, &f), PM_ERR_STATE);
    CHECK_ERR_MSG(pm_copy_async(blk, dev.p, 100, s, &o, &f), PM_ERR_STATE);
    REQUIRE_OK(pm_host_alloc(pool, 1000, 0, &blk)); /* and past the end of a live block */
    size_t usable = 0;
    CHECK_OK(pm_host_usable_size(blk, &usable));
    CHECK_ERR_MSG(pm_copy_async(dev.p, blk, usable + 1, s, &o, &f), PM_ERR_INVALID);
    /* The plain copies bound a pool pointer by its block too, not by the segment around it:
     * a copy past the block's end would write the next block, another caller's memory. */
    char *next;
    REQUIRE_OK(pm_host_alloc(pool, 1000, 0, (void **)&next));
    char *far = malloc(4 * usable);
    REQUIRE(far != NULL);
    memset(far, 'X', 4 * usable);
    memset(next, 'B', 1000);
    CHECK_ERR_MSG(pm_memcpy(blk, far, 4 * usable, PM_COPY_H2H), PM_ERR_INVALID);
    CHECK_ERR_MSG(pm_memcpy_async(blk, far, usable + 1, PM_COPY_H2H, s), PM_ERR_INVALID);
    CHECK_ERR_MSG(pm_memcpy_async(dev.p, blk, usable + 1, PM_COPY_H2D, s), PM_ERR_INVALID);
    CHECK_ERR_MSG(pm_memcpy(far, next, 4 * usable, PM_COPY_H2H), PM_ERR_INVALID);
    int changed = 0;
    for (int i = 0; i < 1000; i++) changed += next[i] != 'B';
    CHECK_EQ_INT(changed, 0);
    CHECK_OK(pm_memcpy(blk, far, usable, PM_COPY_H2H)); /* the whole block is fine */
    CHECK_OK(pm_host_free(next));
    CHECK_ERR_MSG(pm_memcpy(next, far, 16, PM_COPY_H2H), PM_ERR_STATE); /* a freed block */
    free(far);
    CHECK_OK(pm_host_free(blk));
    CHECK_OK(pm_pool_destroy(pool));
  }

  /* batches */
  pm_copy_item_t it[3] = {{dev.p, host, 10}, {host + 100, dev.p + 100, 10}, {dev.p, host, 5}};
  CHECK_ERR_MSG(pm_copy_batch_async(NULL, 3, s, &o, &f), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_copy_batch_async(it, 2, s, &o, &f), PM_ERR_INVALID); /* two directions */
  it[1].dst = NULL;
  CHECK_ERR_MSG(pm_copy_batch_async(it, 2, s, &o, &f), PM_ERR_INVALID);
  it[1].dst = dev.p + 200;
  it[1].src = dev.p + 205; /* overlapping item */
  CHECK_ERR_MSG(pm_copy_batch_async(it, 2, s, &o, &f), PM_ERR_INVALID);
  o.path = PM_PATH_REGISTER;
  CHECK_ERR_MSG(pm_copy_batch_async(it, 1, s, &o, &f), PM_ERR_UNSUPPORTED);
  o.path = PM_PATH_AUTO;
  /* a count whose arrays cannot be sized: refused, not a short allocation written past */
  CHECK_ERR_MSG(pm_copy_batch_async(it, (size_t)1 << 61, s, &o, &f), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_copy_batch_async(it, SIZE_MAX, s, &o, &f), PM_ERR_INVALID);
  {
    /* Items that meet where two registrations meet are each valid; joined into one DMA they
     * would span both, so they stay two (the batch was refused as one 196-byte item). */
    char *m = aligned_alloc(g_page, 2 * g_page);
    REQUIRE(m != NULL);
    pm_test_fill(m, 2 * g_page, 77);
    REQUIRE_OK(pm_register(m, g_page, 0));
    REQUIRE_OK(pm_register(m + g_page, g_page, 0));
    pm_copy_item_t two[2] = {{dev.p + 1000, m + g_page - 96, 96}, {dev.p + 1096, m + g_page, 100}};
    CHECK_OK(pm_copy_batch_async(two, 2, s, NULL, NULL));
    CHECK_OK(pm_stream_synchronize(s));
    char back[196];
    CHECK_OK(pm_memcpy(back, dev.p + 1000, 196, PM_COPY_D2H));
    CHECK_BYTES(back, m + g_page - 96, 196, "batch across two registrations");
    CHECK_OK(pm_unregister(m));
    CHECK_OK(pm_unregister(m + g_page));
    free(m);
  }

  /* a destroyed stream: the host backend catches the stale handle (under CUDA it is UB) */
  if (pm_backend_kind() == PM_BACKEND_HOST) {
    pm_stream_t dead;
    REQUIRE_OK(pm_stream_create(&dead));
    REQUIRE_OK(pm_stream_destroy(dead));
    size_t n = 3 * g_chunk;
    char *big = malloc(n);
    REQUIRE(big != NULL);
    pm_test_fill(big, n, 154);
    dbuf_t dbig;
    dbuf_make(&dbig, n, 155);
    pm_pool_stats_t before, after;
    CHECK_OK(pm_pool_get_stats(NULL, &before));
    CHECK(pm_copy_async(dbig.p, big, n, dead, &o, &f) < 0);
    CHECK(pm_copy_async(big, dbig.p, n, dead, &o, &f) < 0);
    void *pin;
    REQUIRE_OK(pm_host_alloc(NULL, 4096, 0, &pin));
    CHECK(pm_copy_async(dbig.p, pin, 4096, dead, &o, &f) < 0);
    CHECK_OK(pm_host_free(pin));
    CHECK_OK(pm_pool_get_stats(NULL, &after));
    CHECK_EQ_SIZE(after.in_use_bytes, before.in_use_bytes);
    dbuf_free(&dbig);
    free(big);
  }

  /* fences */
  CHECK_ERR_MSG(pm_fence_query(NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_fence_wait(NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_fence_stream_wait(NULL, s), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_fence_release(NULL), PM_ERR_INVALID);
  pm_copy_path_t path;
  CHECK_ERR_MSG(pm_fence_path(NULL, &path), PM_ERR_INVALID);
  pm_fence_t g;
  CHECK_OK(pm_copy_async(dev.p, host, 64, s, NULL, &g));
  CHECK_ERR_MSG(pm_fence_path(g, NULL), PM_ERR_INVALID);
  CHECK_OK(pm_fence_wait(g));
  CHECK_OK(pm_fence_release(g));
  CHECK_ERR_MSG(pm_fence_release(g), PM_ERR_INVALID); /* twice */
  CHECK_ERR_MSG(pm_fence_query(g), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_fence_wait(g), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_fence_stream_wait(g, s), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_fence_release((pm_fence_t)(void *)host), PM_ERR_INVALID); /* never a fence */

  CHECK(f == NULL); /* no failed call wrote its output */
  CHECK_OK(pm_stream_synchronize(s));
  pm_test_sleep_ms(5);
  CHECK_EQ_INT(atomic_load(&cb.calls), 0); /* no failed submit ran its callback */
  pm_copy_options_init(NULL);              /* harmless */
  dbuf_free(&dev);
  free(host);
}

/* ---- threads --------------------------------------------------------------------------------- */

typedef struct worker {
  int id;
  int iters;
  int failures;
} worker_t;

static void *worker_main(void *arg) {
  worker_t *w = arg;
  pm_stream_t s;
  if (pm_stream_create(&s) != PM_OK) {
    w->failures++;
    return NULL;
  }
  uint64_t x = 0x9E3779B97F4A7C15ull * (uint64_t)(w->id + 1);
  for (int it = 0; it < w->iters; it++) {
    uint64_t r = pm_test_rand(&x);
    size_t n = 1 + r % (6 * g_chunk);
    bool pinned = (r >> 20) & 1;
    size_t off = (r >> 24) % 16;
    char *src = NULL, *back = malloc(n + 16);
    void *p = NULL;
    if (pinned) {
      if (pm_host_alloc(NULL, n + 16, 0, &p) != PM_OK) p = NULL;
      src = p;
    } else {
      src = malloc(n + 16);
    }
    void *dev = NULL;
    if (!src || !back || pm_device_alloc(n + 16, &dev) != PM_OK) {
      w->failures++;
      break;
    }
    pm_test_fill(src, n + 16, x);
    pm_test_fill(back, n + 16, x + 1);
    cb_rec_t cb;
    cb_init(&cb);
    pm_copy_options_t o;
    pm_copy_options_init(&o);
    o.callback = cb_count;
    o.callback_arg = &cb;
    pm_fence_t f1 = NULL, f2 = NULL;
    if (pm_copy_async((char *)dev + off, src + off, n, s, &o, &f1) != PM_OK) w->failures++;
    /* D2H ordered after the H2D on the same stream; its fence says when back is complete */
    if (pm_copy_async(back + 16 - off, (char *)dev + off, n, s, NULL, &f2) != PM_OK) w->failures++;
    if (f2 && pm_fence_wait(f2) != PM_OK) w->failures++;
    if (f1 && pm_fence_wait(f1) != PM_OK) w->failures++;
    if (memcmp(back + 16 - off, src + off, n) != 0) {
      fprintf(stderr, "FAIL: thread %d iteration %d: %zu bytes differ\n", w->id, it, n);
      w->failures++;
    }
    if (atomic_load(&cb.calls) != 1) w->failures++;
    if (f1) pm_fence_release(f1);
    if (f2) pm_fence_release(f2);
    pm_device_free(dev);
    free(back);
    if (pinned)
      pm_host_free(p);
    else
      free(src);
  }
  if (pm_stream_destroy(s) != PM_OK) w->failures++;
  return NULL;
}

static void test_threads(void) {
  int nthreads = g_small ? 2 : 4;
  worker_t w[4];
  pthread_t t[4];
  for (int i = 0; i < nthreads; i++) {
    w[i].id = i;
    w[i].iters = g_small ? 3 : 10;
    w[i].failures = 0;
    REQUIRE(pthread_create(&t[i], NULL, worker_main, &w[i]) == 0);
  }
  int fails = 0;
  for (int i = 0; i < nthreads; i++) {
    pthread_join(t[i], NULL);
    fails += w[i].failures;
  }
  CHECK_EQ_INT(fails, 0);
}

/* ---- batch copy kernel (copy_batch)
 * -------------------------------------------------------------- */

static void batch_check(const pm_copy_item_t *it, size_t n, const dbuf_t *dev, bool to_dev,
                        const char *what) {
  char *d = to_dev ? dbuf_read(dev) : NULL;
  for (size_t i = 0; i < n; i++) {
    const char *got = to_dev ? d + ((const char *)it[i].dst - dev->p) : (const char *)it[i].dst;
    CHECK_BYTES(got, it[i].src, it[i].bytes, "%s: item %zu (%zu bytes)", what, i, it[i].bytes);
  }
  free(d);
}

/* copy_batch=kernel|auto|dma give the same bytes for pinned, managed and device pieces of odd
 * sizes and alignments (alike and different modulo 16, one piece over several 64 KiB tiles); a
 * launch fault shows which way a batch went. */
static void test_batch_kernel(pm_stream_t s) {
  const size_t n = g_small ? 70 : 200, slot = 4096 + 64, big = 3 * (64u << 10) + 7;
  const size_t span = n * slot + big + 64;
  hbuf_t pin, man, back;
  hbuf_make(&pin, MEM_POOL, span, 5);
  hbuf_make(&man, MEM_MANAGED, span, 3);
  hbuf_make(&back, MEM_POOL, span, 1);
  pm_test_fill(pin.p, span, 300);
  dbuf_t dev;
  dbuf_make(&dev, span, 301);
  pm_copy_item_t *it = calloc(n + 1, sizeof *it), *rev = calloc(n + 1, sizeof *rev);
  pm_copy_item_t *back_chk = calloc(n + 1, sizeof *back_chk);
  REQUIRE(it && rev && back_chk);
  for (size_t i = 0; i < n; i++) {
    it[i].src = pin.p + i * slot + (i % 17);
    it[i].dst = dev.p + (n - 1 - i) * slot + (i % 5) * 16 + (i % 3);
    it[i].bytes = 1 + (i * 977) % 4096;
  }
  it[n].src = pin.p + n * slot + 16;
  it[n].dst = dev.p + n * slot + 48;
  it[n].bytes = big;
  static const char *modes[] = {"kernel", "auto", "dma"};
  for (int m = 0; m < 3; m++) {
    CHECK_OK(pm_option_set("copy_batch", modes[m]));
    CHECK_OK(pm_copy_batch_async(it, n + 1, s, NULL, NULL));
    CHECK_OK(pm_stream_synchronize(s));
    batch_check(it, n + 1, &dev, true, modes[m]);
    /* Back out: device -> pinned and device -> managed (the reverse layout). */
    for (size_t i = 0; i <= n; i++) {
      rev[i].src = it[i].dst;
      rev[i].dst = (m == 1 ? man.p : back.p) + ((const char *)it[i].src - pin.p);
      rev[i].bytes = it[i].bytes;
    }
    CHECK_OK(pm_copy_batch_async(rev, n + 1, s, NULL, NULL));
    CHECK_OK(pm_stream_synchronize(s));
    /* The host compares what came back with the pinned bytes that went out: rev's sources are
     * device memory, which only the host backend lets the CPU read. */
    for (size_t i = 0; i <= n; i++)
      back_chk[i] = (pm_copy_item_t){rev[i].dst, it[i].src, it[i].bytes};
    batch_check(back_chk, n + 1, NULL, false, modes[m]);
  }

  /* Which way went the batch: with the next launch set to fail, the kernel way fails (and says
   * so) while the dma way, and auto below 64 items, never launch anything. */
  CHECK_OK(pm_option_set("copy_batch", "kernel"));
  CHECK_OK(pm__fault_set(PM__FAULT_LAUNCH, 1, 0.0));
  CHECK_ST(pm_copy_batch_async(it, n + 1, s, NULL, NULL), PM_ERR_BACKEND);
  CHECK(strstr(pm_last_error(), "launch_batch_copy") != NULL);
  pm__fault_reset();
  CHECK_OK(pm_option_set("copy_batch", "dma"));
  CHECK_OK(pm__fault_set(PM__FAULT_LAUNCH, 1, 0.0));
  CHECK_OK(pm_copy_batch_async(it, n + 1, s, NULL, NULL));
  CHECK_OK(pm_option_set("copy_batch", "auto"));
  CHECK_OK(pm_copy_batch_async(it, 10, s, NULL, NULL)); /* too few pieces for the kernel */
  /* A pageable piece sent direct cannot be reached by a kernel: that batch goes by dma. */
  CHECK_OK(pm_option_set("copy_batch", "kernel"));
  char *pageable = malloc(4096);
  REQUIRE(pageable != NULL);
  pm_test_fill(pageable, 4096, 302);
  pm_copy_item_t mixed[2] = {{dev.p, pin.p, 1000}, {dev.p + 8192, pageable, 4096}};
  pm_copy_options_t o;
  pm_copy_options_init(&o);
  o.path = PM_PATH_DIRECT;
  CHECK_OK(pm_copy_batch_async(mixed, 2, s, &o, NULL));
  CHECK_OK(pm_stream_synchronize(s));
  pm__fault_reset();
  batch_check(mixed, 2, &dev, true, "pageable piece sent direct");

  /* Read-only registered memory: a kernel may read it (an H2D batch takes the kernel) but never
   * write it, so a D2H batch into it goes by dma (checked on the host backend, where a DMA into
   * it is allowed; the device would refuse either). */
  size_t ro_n = 64 * 1024;
  char *ro = NULL;
  REQUIRE(posix_memalign((void **)&ro, g_page, ro_n) == 0);
  pm_test_fill(ro, ro_n, 303);
  REQUIRE_OK(pm_register(ro, ro_n, PM_REGISTER_READ_ONLY));
  pm_copy_item_t ro_items[2] = {{dev.p, ro, 3000}, {dev.p + 4096, ro + 5000, 777}};
  CHECK_OK(pm__fault_set(PM__FAULT_LAUNCH, 1, 0.0));
  CHECK_ST(pm_copy_batch_async(ro_items, 2, s, NULL, NULL), PM_ERR_BACKEND);
  pm__fault_reset();
  CHECK_OK(pm_copy_batch_async(ro_items, 2, s, NULL, NULL));
  CHECK_OK(pm_stream_synchronize(s));
  batch_check(ro_items, 2, &dev, true, "read-only registered source");
  if (pm_backend_kind() == PM_BACKEND_HOST) {
    pm_copy_item_t into_ro[2] = {{ro, dev.p, 100}, {ro + 200, dev.p + 4096, 100}};
    CHECK_OK(pm__fault_set(PM__FAULT_LAUNCH, 1, 0.0));
    CHECK_OK(pm_copy_batch_async(into_ro, 2, s, NULL, NULL));
    CHECK_OK(pm_stream_synchronize(s));
    pm__fault_reset();
  }
  CHECK_OK(pm_unregister(ro));
  free(ro);
  CHECK_OK(pm_option_set("copy_batch", NULL));

  free(pageable);
  free(it);
  free(rev);
  free(back_chk);
  dbuf_free(&dev);
  hbuf_free(&pin);
  hbuf_free(&man);
  hbuf_free(&back);
}

/* ---- byte movers (copy_memcpy) --------------------------------------------------------------- */

/* Every mover copies exactly [dst, dst + n) from src, for every size class its loops have (the
 * unaligned head, whole 128-byte steps, the tail) and every alignment of both sides; the guard
 * bytes around dst stay untouched. Modes the CPU lacks fall back to libc, and say so. */
static void test_movers(void) {
  static const size_t sizes[] = {
      1, 2, 31, 32, 33, 127, 128, 129, 255, 256, 1000, 4095, 4096, 65536 + 77, (1u << 20) + 13};
  const size_t cap = (1u << 20) + 13 + 128;
  unsigned char *src = malloc(cap), *dst = malloc(cap + 64), *want = malloc(cap + 64);
  REQUIRE(src && dst && want);
  pm_test_fill(src, cap, 4242);
  for (int mode = PM__MEMCPY_LIBC; mode <= PM__MEMCPY_STREAM; mode++) {
    int eff = pm__memcpy_effective(mode);
    CHECK(eff == mode || eff == PM__MEMCPY_LIBC);
    printf("copy_memcpy mode %d runs as %d\n", mode, eff);
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
      for (size_t so = 0; so < 33; so += (sizes[k] > 4096 ? 11 : 1)) {
        for (size_t d0 = 0; d0 < 33; d0 += (sizes[k] > 4096 ? 16 : 3)) {
          size_t n = sizes[k];
          memset(dst, 0xA5, cap + 64);
          memset(want, 0xA5, cap + 64);
          memcpy(want + 16 + d0, src + so, n);
          pm__memcpy_mode(dst + 16 + d0, src + so, n, mode);
          pm_test_checks++;
          if (memcmp(dst, want, n + 16 + d0 + 16) != 0) {
            PM_TEST_FAIL_AT(__FILE__, __LINE__,
                            "mover %d: %zu bytes, src offset %zu, dst offset %zu", mode, n, so, d0);
            goto out;
          }
        }
      }
    }
    pm__memcpy_mode(dst, src, 0, mode); /* nothing to do, nothing touched */
  }
out:
  /* auto picks per step: movsb into the ring of an H2D copy, stream elsewhere; explicit modes
   * stand whatever the step. */
  CHECK(pm__memcpy_for(PM__MEMCPY_AUTO, true) == PM__MEMCPY_MOVSB);
  CHECK(pm__memcpy_for(PM__MEMCPY_AUTO, false) == PM__MEMCPY_STREAM);
  for (int mode = PM__MEMCPY_LIBC; mode <= PM__MEMCPY_STREAM; mode++)
    CHECK(pm__memcpy_for(mode, true) == mode && pm__memcpy_for(mode, false) == mode);
  CHECK_ST(pm_option_set("copy_memcpy", "quickly"), PM_ERR_CONFIG);
  free(src);
  free(dst);
  free(want);
}

/* ---- main ------------------------------------------------------------------------------------ */

/* pm__stage_piece_hook for the stalled-piece test: piece 0 of group 1 waits (at most 10 s)
 * until other pieces of group g_stall_target or later were copied. */
static pthread_mutex_t g_stall_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_stall_cv = PTHREAD_COND_INITIALIZER;
static size_t g_stall_target, g_stall_max;
static bool g_stall_seen;

static void stall_hook(size_t group, size_t piece) {
  pthread_mutex_lock(&g_stall_mu);
  if (group > g_stall_max) {
    g_stall_max = group;
    pthread_cond_broadcast(&g_stall_cv);
  }
  if (group == 1 && piece == 0) {
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += 10;
    while (g_stall_max < g_stall_target)
      if (pthread_cond_timedwait(&g_stall_cv, &g_stall_mu, &dl) != 0) break;
    g_stall_seen = g_stall_max >= g_stall_target;
  }
  pthread_mutex_unlock(&g_stall_mu);
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0); /* progress lines show where a hung run stopped */
  g_small = pm_test_small();
  g_page = (size_t)sysconf(_SC_PAGESIZE);
  /* Small chunks and threshold so the many-chunk paths run fast; more threads than cores so
   * the parallel staging is exercised here too. */
  CHECK_OK(pm_option_set("copy_chunk", "64K"));
  CHECK_OK(pm_option_set("copy_stage_min", "16K"));
  CHECK_OK(pm_option_set("copy_threads", "4"));
  pm_option_info_t oi;
  if (pm_option_find("copy_chunk", &oi) == PM_OK) pm_parse_size(oi.value, &g_chunk);
  if (pm_option_find("copy_stage_min", &oi) == PM_OK) pm_parse_size(oi.value, &g_stage_min);
  pm_test_init();
  printf("chunk %zu, stage_min %zu%s\n", g_chunk, g_stage_min, g_small ? ", small" : "");

  pm_stream_t s, s2;
  REQUIRE_OK(pm_stream_create(&s));
  REQUIRE_OK(pm_stream_create(&s2));

#define RUN(call)             \
  do {                        \
    printf("== %s\n", #call); \
    call;                     \
  } while (0)
  RUN(test_errors(s));
  RUN(test_roundtrips(s));
  RUN(test_foreign_pinned(s));
  RUN(test_d2d_h2h(s));
  RUN(test_h2d_source_reuse(s));
  RUN(test_d2h_completion(s, s2));
  RUN(test_callbacks(s));
  RUN(test_fence_stream_wait(s, s2));
  RUN(test_tiny_budget(s));
  RUN(test_batches(s));
  RUN(test_batch_kernel(s));
  RUN(test_threads());

  /* Every staging layout of copy_bounce gives the same bytes: the ring always, auto (the ring
   * on an idle stream, a whole-copy block behind queued work) and the whole block always. */
  static const char *modes[] = {"ring", "auto", "whole"};
  for (int m = 0; m < 3; m++) {
    CHECK_OK(pm_option_set("copy_bounce", modes[m]));
    roundtrip(MEM_PAGEABLE, MEM_PAGEABLE, 9 * g_chunk + 4093, 3, 5, 7, s, PM_PATH_AUTO, 9100 + m);
    CHECK_OK(pm_launch_busy(s, 0.02)); /* auto must take the whole block here */
    roundtrip(MEM_PAGEABLE, MEM_PAGEABLE, 3 * g_chunk + 17, 1, 0, 4095, s, PM_PATH_AUTO, 9200 + m);
  }
  CHECK_ST(pm_option_set("copy_bounce", "sideways"), PM_ERR_CONFIG);
  CHECK_OK(pm_option_set("copy_bounce", NULL));

  /* Staged copies give the same bytes with every byte mover, whole block and ring alike. */
  RUN(test_movers());
  static const char *movers[] = {"movsb", "stream", "libc", "auto"};
  for (int m = 0; m < 4; m++) {
    CHECK_OK(pm_option_set("copy_memcpy", movers[m]));
    roundtrip(MEM_PAGEABLE, MEM_PAGEABLE, 5 * g_chunk + 4093, 3, 5, 7, s, PM_PATH_AUTO, 9300 + m);
    CHECK_OK(pm_option_set("copy_bounce", "ring"));
    roundtrip(MEM_PAGEABLE, MEM_PAGEABLE, 3 * g_chunk + 129, 1, 31, 2, s, PM_PATH_AUTO, 9400 + m);
    CHECK_OK(pm_option_set("copy_bounce", NULL));
  }
  CHECK_OK(pm_option_set("copy_memcpy", NULL));

  /* Slots filled in pieces by all threads (copy_piece): one-segment H2D copies through the
   * ring, with a short last group, pieces that do not divide the chunk, a ring of one slot and
   * one of more slots than groups; each must take that layout and deliver every byte. */
  static const struct {
    const char *piece, *slots;
    size_t bytes, soff;
  } slab[] = {{"16K", "2", 9 * 65536 + 4093, 3},  {"20000", "3", 5 * 65536, 0},
              {"4K", "1", 2 * 65536 + 1, 1},      {"16K", "32", 65536 - 1, 5},
              {"32K", "4", 3 * 65536 + 32768, 7}, {"8K", "2", 17 * 65536 + 999, 4095}};
  CHECK_OK(pm_option_set("copy_bounce", "ring"));
  for (size_t k = 0; k < sizeof slab / sizeof slab[0]; k++) {
    CHECK_OK(pm_option_set("copy_piece", slab[k].piece));
    CHECK_OK(pm_option_set("copy_slots", slab[k].slots));
    CHECK_OK(pm_option_set("copy_memcpy", k % 2 ? "auto" : "stream"));
    if (slab[k].bytes < g_stage_min) continue;
    unsigned long before = pm__stage_slab_count();
    roundtrip(MEM_PAGEABLE, MEM_PAGEABLE, slab[k].bytes, slab[k].soff, 1, 2, s, PM_PATH_AUTO,
              9500 + k);
    CHECK(pm__stage_slab_count() == before + 1);
  }
  /* A stalled piece holds up its own group's slot only: while piece 0 of group 1 stalls, the
   * other threads take groups past the ring's width (with slots fixed per group they would all
   * wait at the first wrap), and every byte still arrives. The ring is copy_piece_slots deep
   * (with copy_slots' one slot the stalled group would hold the only one). */
  CHECK_OK(pm_option_set("copy_piece", "16K"));
  CHECK_OK(pm_option_set("copy_slots", "1"));
  CHECK_OK(pm_option_set("copy_piece_slots", "4"));
  g_stall_target = 1 + 4 + 3;
  g_stall_max = 0;
  g_stall_seen = false;
  pm__stage_piece_hook = stall_hook;
  roundtrip(MEM_PAGEABLE, MEM_PAGEABLE, 16 * g_chunk + 77, 1, 1, 1, s, PM_PATH_AUTO, 9550);
  pm__stage_piece_hook = NULL;
  CHECK(g_stall_seen);
  CHECK_OK(pm_option_set("copy_piece_slots", NULL));
  CHECK_ST(pm_option_set("copy_piece_slots", "-1"), PM_ERR_CONFIG);
  CHECK_ST(pm_option_set("copy_piece_slots", "4097"), PM_ERR_CONFIG);
  /* A piece as large as the chunk is refused (a piece is part of a slot); the default piece
   * (256K) above this chunk (64K) stages without pieces: the plain ring. */
  CHECK_ERR_MSG(pm_option_set("copy_piece", "64K"), PM_ERR_CONFIG);
  CHECK(strstr(pm_last_error(), "copy_chunk") != NULL);
  CHECK_OK(pm_option_set("copy_piece", NULL));
  unsigned long before = pm__stage_slab_count();
  roundtrip(MEM_PAGEABLE, MEM_PAGEABLE, 3 * g_chunk + 5, 0, 0, 0, s, PM_PATH_AUTO, 9600);
  CHECK(pm__stage_slab_count() == before);
  CHECK_ST(pm_option_set("copy_piece", "lots"), PM_ERR_CONFIG);
  CHECK_OK(pm_option_set("copy_piece", NULL));
  CHECK_OK(pm_option_set("copy_slots", NULL));
  CHECK_OK(pm_option_set("copy_memcpy", NULL));
  CHECK_OK(pm_option_set("copy_bounce", NULL));

  /* The default stream works too. */
  roundtrip(MEM_PAGEABLE, MEM_PAGEABLE, 2 * g_chunk + 1, 1, 1, 1, NULL, PM_PATH_AUTO, 9000);

  CHECK_OK(pm_stream_destroy(s));
  CHECK_OK(pm_stream_destroy(s2));
  pm_test_sleep_ms(20);    /* let the completion service drop the last events */
  CHECK_OK(pm_finalize()); /* fails with PM_ERR_BUSY if a bounce block leaked */
  return pm_test_finish("test_copy");
}
