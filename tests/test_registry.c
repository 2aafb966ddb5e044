/* The registry of tracked ranges (directly, then through pm_register / pm_unregister /
 * pm_pointer_query / pm_host_device_pointer), and registered memory used for real copies. */
#include <pthread.h>
#include <unistd.h>

#include "check.h"
#include "internal.h"

/* Fake addresses for the direct tests: the registry never dereferences them, and nothing real
 * that pinmem tracks lives this high in a test process. */
#define FAKE ((uintptr_t)0x6a0000000000ull)

static pm__range_t mk(uintptr_t base, size_t size, pm_memory_kind_t kind) {
  pm__range_t r = {base, size, kind, 0, NULL, NULL};
  return r;
}

static void test_basic(void) {
  size_t n0 = pm__registry_count();
  pm__range_t a = mk(FAKE + 0x1000, 0x1000, PM_MEMORY_REGISTERED);
  a.flags = PM_REGISTER_MAPPED;
  a.dev_base = (void *)(uintptr_t)0xd000;
  CHECK_OK(pm__registry_add(&a));
  CHECK_EQ_SIZE(pm__registry_count(), n0 + 1);

  pm__range_t got;
  CHECK(pm__registry_find((void *)(FAKE + 0x1000), &got));
  CHECK_EQ_SIZE(got.base, a.base);
  CHECK_EQ_SIZE(got.size, a.size);
  CHECK_EQ_INT(got.kind, PM_MEMORY_REGISTERED);
  CHECK_EQ_INT(got.flags, PM_REGISTER_MAPPED);
  CHECK(got.dev_base == a.dev_base);
  CHECK(pm__registry_find((void *)(FAKE + 0x1fff), &got));  /* last byte */
  CHECK(!pm__registry_find((void *)(FAKE + 0x2000), &got)); /* one past the end */
  CHECK(!pm__registry_find((void *)(FAKE + 0xfff), &got));  /* one before */
  CHECK(pm__registry_find((void *)(FAKE + 0x1800), NULL));

  /* overlap at each edge, containment both ways, and exact duplicates */
  const struct {
    uintptr_t base;
    size_t size;
  } clash[] = {{FAKE + 0x0800, 0x0801}, /* ends on a's first byte */
               {FAKE + 0x1fff, 0x10},   /* starts on a's last byte */
               {FAKE + 0x1000, 0x1000}, /* the same */
               {FAKE + 0x1100, 0x10},   /* inside */
               {FAKE + 0x0000, 0x4000}, /* around */
               {FAKE + 0x1000, 1},      {FAKE + 0x1fff, 1}};
  for (size_t i = 0; i < sizeof clash / sizeof clash[0]; i++) {
    pm__range_t c = mk(clash[i].base, clash[i].size, PM_MEMORY_DEVICE);
    CHECK_ERR_MSG(pm__registry_add(&c), PM_ERR_OVERLAP);
    /* the detail names both ranges */
    char abuf[32], cbuf[32];
    snprintf(abuf, sizeof abuf, "%p", (void *)a.base);
    snprintf(cbuf, sizeof cbuf, "%p", (void *)c.base);
    CHECK(strstr(pm_last_error(), abuf) != NULL);
    CHECK(strstr(pm_last_error(), cbuf) != NULL);
    CHECK(strstr(pm_last_error(), "registration") != NULL);
    CHECK(strstr(pm_last_error(), "device") != NULL);
  }
  CHECK_EQ_SIZE(pm__registry_count(), n0 + 1);

  /* adjacency on both sides is fine */
  pm__range_t left = mk(FAKE + 0x0800, 0x800, PM_MEMORY_DEVICE);
  pm__range_t right = mk(FAKE + 0x2000, 0x10, PM_MEMORY_MANAGED);
  CHECK_OK(pm__registry_add(&left));
  CHECK_OK(pm__registry_add(&right));
  CHECK(pm__registry_find((void *)(FAKE + 0xfff), &got) && got.kind == PM_MEMORY_DEVICE);
  CHECK(pm__registry_find((void *)(FAKE + 0x2000), &got) && got.kind == PM_MEMORY_MANAGED);
  CHECK(pm__registry_find((void *)(FAKE + 0x1000), &got) && got.kind == PM_MEMORY_REGISTERED);

  /* bad ranges */
  pm__range_t empty = mk(FAKE + 0x9000, 0, PM_MEMORY_DEVICE);
  CHECK_ERR_MSG(pm__registry_add(&empty), PM_ERR_INVALID);
  pm__range_t wrap = mk(UINTPTR_MAX - 10, 100, PM_MEMORY_DEVICE);
  CHECK_ERR_MSG(pm__registry_add(&wrap), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm__registry_add(NULL), PM_ERR_INVALID);

  /* remove: exact base and kind */
  CHECK_ERR_MSG(pm__registry_remove(a.base, PM_MEMORY_POOL, NULL), PM_ERR_WRONG_KIND);
  CHECK_ERR_MSG(pm__registry_remove(a.base + 1, PM_MEMORY_REGISTERED, NULL), PM_ERR_NOT_FOUND);
  CHECK_ERR_MSG(pm__registry_remove(FAKE + 0x50000, PM_MEMORY_REGISTERED, NULL), PM_ERR_NOT_FOUND);
  pm__range_t removed;
  memset(&removed, 0, sizeof removed);
  CHECK_OK(pm__registry_remove(a.base, PM_MEMORY_REGISTERED, &removed));
  CHECK_EQ_SIZE(removed.size, a.size);
  CHECK(removed.dev_base == a.dev_base);
  CHECK(!pm__registry_find((void *)(FAKE + 0x1000), &got));
  CHECK_ERR_MSG(pm__registry_remove(a.base, PM_MEMORY_REGISTERED, NULL), PM_ERR_NOT_FOUND);
  /* the hole can be filled again */
  CHECK_OK(pm__registry_add(&a));
  CHECK_OK(pm__registry_remove(a.base, PM_MEMORY_REGISTERED, NULL));
  CHECK_OK(pm__registry_remove(left.base, PM_MEMORY_DEVICE, NULL));
  CHECK_OK(pm__registry_remove(right.base, PM_MEMORY_MANAGED, NULL));
  CHECK_EQ_SIZE(pm__registry_count(), n0);
}

static uint64_t rng_state = 88172645463325252ull;
static uint64_t rnd(void) {
  return pm_test_rand(&rng_state);
}

/* Many ranges added and removed in random order; every lookup agrees with a linear scan. */
static void test_many(void) {
  size_t n = pm_test_small() ? 300 : 3000;
  size_t n0 = pm__registry_count();
  pm__range_t *r = calloc(n, sizeof *r);
  size_t *order = calloc(n, sizeof *order);
  REQUIRE(r && order);
  uintptr_t at = FAKE + 0x100000000ull;
  for (size_t i = 0; i < n; i++) {
    size_t gap = (size_t)(rnd() % 3) * 64; /* some ranges touch, some do not */
    size_t size = 1 + (size_t)(rnd() % 5000);
    r[i] = mk(at + gap, size, (pm_memory_kind_t)(1 + rnd() % 4));
    at += gap + size;
    order[i] = i;
  }
  for (size_t i = n - 1; i > 0; i--) {
    size_t j = (size_t)(rnd() % (i + 1)), t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  for (size_t i = 0; i < n; i++) CHECK_OK(pm__registry_add(&r[order[i]]));
  CHECK_EQ_SIZE(pm__registry_count(), n0 + n);
  /* a copy of every range again must overlap */
  int refused = 0;
  for (size_t i = 0; i < n; i += 7) refused += pm__registry_add(&r[i]) == PM_ERR_OVERLAP;
  CHECK_EQ_INT(refused, (n + 6) / 7);

  uintptr_t lo = r[0].base - 100, hi = at + 100;
  int bad = 0;
  for (int probe = 0; probe < 5000; probe++) {
    uintptr_t p = lo + (uintptr_t)(rnd() % (hi - lo));
    long want = -1;
    for (size_t i = 0; i < n; i++)
      if (p >= r[i].base && p < r[i].base + r[i].size) want = (long)i;
    pm__range_t got;
    bool hit = pm__registry_find((void *)p, &got);
    if (hit != (want >= 0) || (hit && (got.base != r[want].base || got.kind != r[want].kind)))
      bad++;
    if (pm_test_small() && probe > 1000) break;
  }
  CHECK_EQ_INT(bad, 0);
  for (size_t i = 0; i < n; i++) {
    CHECK(pm__registry_find((void *)r[i].base, NULL));
    CHECK(pm__registry_find((void *)(r[i].base + r[i].size - 1), NULL));
  }
  /* remove half in random order, check the rest is intact, then the other half */
  for (size_t i = 0; i < n / 2; i++) {
    pm__range_t *x = &r[order[i]];
    CHECK_OK(pm__registry_remove(x->base, x->kind, NULL));
    CHECK(!pm__registry_find((void *)x->base, NULL));
  }
  for (size_t i = n / 2; i < n; i++) CHECK(pm__registry_find((void *)r[order[i]].base, NULL));
  for (size_t i = n / 2; i < n; i++)
    CHECK_OK(pm__registry_remove(r[order[i]].base, r[order[i]].kind, NULL));
  CHECK_EQ_SIZE(pm__registry_count(), n0);
  free(r);
  free(order);
}

/* ---- through the public API ---- */

static size_t page(void) {
  return (size_t)sysconf(_SC_PAGESIZE);
}

static size_t registered_bytes(void) {
  pm_pool_t *pool;
  pm_pool_stats_t s;
  if (pm_pool_default(&pool) != PM_OK || pm_pool_get_stats(pool, &s) != PM_OK) return (size_t)-1;
  return s.registered_bytes;
}

static void test_register_api(void) {
  size_t n = 16 * page();
  char *buf = aligned_alloc(page(), n);
  char *other = malloc(4096);
  REQUIRE(buf && other);
  pm_test_fill(buf, n, 1);
  size_t reg0 = registered_bytes();

  pm_pointer_info_t info;
  CHECK_OK(pm_pointer_query(buf, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_PAGEABLE);

  CHECK_OK(pm_register(buf, n, PM_REGISTER_DEFAULT));
  CHECK_EQ_SIZE(registered_bytes(), reg0 + n);
  memset(&info, 0xff, sizeof info);
  CHECK_OK(pm_pointer_query(buf + 123, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_REGISTERED);
  CHECK(info.base == buf);
  CHECK_EQ_SIZE(info.size, n);
  CHECK_EQ_INT(info.flags, PM_REGISTER_DEFAULT);
  CHECK(info.device_ptr == NULL);
  CHECK(info.pool == NULL);
  CHECK_OK(pm_pointer_query(buf + n - 1, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_REGISTERED);
  CHECK_OK(pm_pointer_query(buf + n, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_PAGEABLE);
  CHECK_OK(pm_pointer_query(buf - 1, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_PAGEABLE);

  /* double and overlapping registrations, refused before any pinning */
  CHECK_ERR_MSG(pm_register(buf, n, 0), PM_ERR_OVERLAP);
  CHECK(strstr(pm_last_error(), "pm_register") != NULL);
  CHECK_ERR_MSG(pm_register(buf + page(), page(), 0), PM_ERR_OVERLAP);
  CHECK_ERR_MSG(pm_register(buf + n - 1, 1, 0), PM_ERR_OVERLAP);
  CHECK_EQ_SIZE(registered_bytes(), reg0 + n); /* nothing was charged for them */
  CHECK_OK(pm_pointer_query(buf, &info));
  CHECK(info.kind == PM_MEMORY_REGISTERED && info.base == buf && info.size == n);

  /* wrong release calls */
  CHECK_ERR_MSG(pm_host_free(buf), PM_ERR_WRONG_KIND);
  CHECK(strstr(pm_last_error(), "pm_unregister") != NULL);
  CHECK_ERR_MSG(pm_host_usable_size(buf, &(size_t){0}), PM_ERR_WRONG_KIND);
  CHECK_ERR_MSG(pm_host_record_stream(buf, NULL), PM_ERR_WRONG_KIND);
  CHECK_ERR_MSG(pm_device_free(buf), PM_ERR_WRONG_KIND);
  CHECK_ERR_MSG(pm_managed_free(buf), PM_ERR_WRONG_KIND);
  CHECK_ERR_MSG(pm_unregister(buf + 1), PM_ERR_NOT_FOUND); /* not the start */
  CHECK_ERR_MSG(pm_unregister(other), PM_ERR_NOT_FOUND);
  CHECK_ERR_MSG(pm_host_free(other), PM_ERR_NOT_FOUND);

  /* bad input */
  CHECK_ERR_MSG(pm_register(NULL, n, 0), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_register(other, 0, 0), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_register(other, 4096, 0x80), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_register((void *)(UINTPTR_MAX - 100), 4096, 0), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_unregister(NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_pointer_query(buf, NULL), PM_ERR_INVALID);
  CHECK_OK(pm_pointer_query(NULL, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_PAGEABLE);

  /* the caller's memory is untouched by register and unregister */
  CHECK_OK(pm_unregister(buf));
  char *check = malloc(n);
  REQUIRE(check);
  pm_test_fill(check, n, 1);
  CHECK(memcmp(buf, check, n) == 0);
  free(check);
  CHECK_EQ_SIZE(registered_bytes(), reg0);
  CHECK_ERR_MSG(pm_unregister(buf), PM_ERR_NOT_FOUND); /* twice */
  CHECK_OK(pm_pointer_query(buf, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_PAGEABLE);

  /* adjacent registrations are fine; registering it again after unregistering too */
  CHECK_OK(pm_register(buf, n / 2, 0));
  CHECK_OK(pm_register(buf + n / 2, n / 2, PM_REGISTER_PORTABLE));
  CHECK_OK(pm_pointer_query(buf + n / 2, &info));
  CHECK(info.base == buf + n / 2 && info.flags == PM_REGISTER_PORTABLE);
  CHECK_OK(pm_unregister(buf + n / 2));
  CHECK_OK(pm_unregister(buf));
  CHECK_EQ_SIZE(registered_bytes(), reg0);
  free(buf);
  free(other);
}

static void test_device_and_mapped(void) {
  pm_device_info_t dinfo;
  REQUIRE_OK(pm_device_get_info(0, &dinfo));
  size_t n = 8 * page();

  /* device memory is known too, and cannot be registered */
  void *d = NULL;
  REQUIRE_OK(pm_device_alloc(n, &d));
  pm_pointer_info_t info;
  CHECK_OK(pm_pointer_query((char *)d + 5, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_DEVICE);
  CHECK(info.base == d);
  CHECK_EQ_SIZE(info.size, n);
  CHECK_ERR_MSG(pm_register(d, n, 0), PM_ERR_OVERLAP);
  void *dp;
  CHECK_ERR_MSG(pm_host_device_pointer(d, &dp), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_unregister(d), PM_ERR_WRONG_KIND);
  CHECK(strstr(pm_last_error(), "pm_device_free") != NULL);
  CHECK_OK(pm_device_free(d));

  char *buf = aligned_alloc(page(), n);
  REQUIRE(buf);
  pm_test_fill(buf, n, 2);
  CHECK_ERR_MSG(pm_host_device_pointer(buf, &dp), PM_ERR_INVALID); /* pageable */
  CHECK_OK(pm_register(buf, n, 0));
  CHECK_ERR_MSG(pm_host_device_pointer(buf, &dp), PM_ERR_INVALID); /* not mapped */
  CHECK(strstr(pm_last_error(), "PM_REGISTER_MAPPED") != NULL);
  CHECK_OK(pm_unregister(buf));

  if (!dinfo.can_map_host_memory) {
    pm_test_skip("mapped registration: device 0 cannot map host memory");
  } else {
    CHECK_OK(pm_register(buf, n, PM_REGISTER_MAPPED));
    void *d0 = NULL, *d1 = NULL;
    CHECK_OK(pm_host_device_pointer(buf, &d0));
    CHECK_OK(pm_host_device_pointer(buf + 777, &d1));
    CHECK(d0 != NULL);
    CHECK((char *)d1 - (char *)d0 == 777);
    CHECK_OK(pm_pointer_query(buf + 777, &info));
    CHECK_EQ_INT(info.kind, PM_MEMORY_REGISTERED);
    CHECK_EQ_INT(info.flags, PM_REGISTER_MAPPED);
    CHECK(info.device_ptr == d1);
    CHECK_ERR_MSG(pm_host_device_pointer(buf, NULL), PM_ERR_INVALID);
    CHECK_ERR_MSG(pm_host_device_pointer(NULL, &d0), PM_ERR_INVALID);
    CHECK_OK(pm_unregister(buf));
    CHECK_ERR_MSG(pm_host_device_pointer(buf, &d0), PM_ERR_INVALID);
  }
  free(buf);
}

/* Registered memory is pinned memory: a copy to the device and back, async on a stream, with
 * odd sizes and offsets. */
static void test_pinned_copy(void) {
  size_t n = 32 * page();
  char *src = aligned_alloc(page(), n), *dst = aligned_alloc(page(), n);
  REQUIRE(src && dst);
  pm_test_fill(src, n, 3);
  memset(dst, 0x5a, n);
  CHECK_OK(pm_register(src, n, 0));
  CHECK_OK(pm_register(dst, n, 0));
  void *d = NULL;
  REQUIRE_OK(pm_device_alloc(n, &d));
  pm_stream_t s = NULL;
  REQUIRE_OK(pm_stream_create(&s));

  const size_t cases[][2] = {{0, 1}, {1, 4095}, {3, 65537}, {0, 32 * 4096}};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    size_t off = cases[c][0], len = cases[c][1];
    if (off + len > n) continue;
    memset(dst, 0x5a, n);
    pm_test_fill(src, n, 100 + c);
    CHECK_OK(pm_memcpy_async((char *)d + off, src + off, len, PM_COPY_H2D, s));
    CHECK_OK(pm_memcpy_async(dst + off, (char *)d + off, len, PM_COPY_D2H, s));
    CHECK_OK(pm_stream_synchronize(s));
    CHECK(memcmp(dst + off, src + off, len) == 0);
    CHECK(off == 0 || (unsigned char)dst[off - 1] == 0x5a);
    if (off + len < n) CHECK((unsigned char)dst[off + len] == 0x5a);
  }
  /* the direction inferred from the registry */
  pm_test_fill(src, n, 7);
  memset(dst, 0, n);
  CHECK_OK(pm_memcpy_async(d, src, n, PM_COPY_DEFAULT, s));
  CHECK_OK(pm_memcpy_async(dst, d, n, PM_COPY_DEFAULT, s));
  CHECK_OK(pm_stream_synchronize(s));
  CHECK(memcmp(dst, src, n) == 0);
  /* kinds that contradict what the registry knows, and overruns */
  CHECK_ERR_MSG(pm_memcpy_async(src, d, 16, PM_COPY_H2D, s), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_memcpy_async(d, src, n + 1, PM_COPY_H2D, s), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_memcpy_async(d, src + 1, n, PM_COPY_H2D, s), PM_ERR_INVALID);

  CHECK_OK(pm_stream_destroy(s));
  CHECK_OK(pm_device_free(d));
  CHECK_OK(pm_unregister(src));
  CHECK_OK(pm_unregister(dst));
  free(src);
  free(dst);
}

/* Registrations, queries and unregistrations from several threads (for TSan). The CHECK
 * counters are not thread-safe, so workers count their own failures. */
typedef struct {
  char *mem;
  int failures;
} worker_t;

static void *reg_worker(void *arg) {
  worker_t *w = arg;
  size_t n = 4 * page();
  int iters = pm_test_small() ? 10 : 50;
  for (int i = 0; i < iters; i++) {
    pm_pointer_info_t info;
    if (pm_register(w->mem, n, 0) != PM_OK) w->failures++;
    if (pm_pointer_query(w->mem + n / 2, &info) != PM_OK || info.kind != PM_MEMORY_REGISTERED ||
        info.base != w->mem || info.size != n)
      w->failures++;
    if (pm_register(w->mem + page(), page(), 0) != PM_ERR_OVERLAP) w->failures++;
    if (pm_unregister(w->mem) != PM_OK) w->failures++;
  }
  return NULL;
}

static void test_threads(void) {
  enum { T = 4 };
  pthread_t t[T];
  worker_t w[T];
  size_t reg0 = registered_bytes();
  for (int i = 0; i < T; i++) {
    w[i].mem = aligned_alloc(page(), 4 * page());
    w[i].failures = 0;
    REQUIRE(w[i].mem);
    REQUIRE(pthread_create(&t[i], NULL, reg_worker, &w[i]) == 0);
  }
  for (int i = 0; i < T; i++) pthread_join(t[i], NULL);
  for (int i = 0; i < T; i++) {
    CHECK_EQ_INT(w[i].failures, 0);
    free(w[i].mem);
  }
  CHECK_EQ_SIZE(registered_bytes(), reg0);
}

int main(void) {
  pm_test_init();
  test_basic();
  test_many();
  test_register_api();
  test_device_and_mapped();
  test_pinned_copy();
  test_threads();
  CHECK_OK(pm_finalize());
  return pm_test_finish("test_registry");
}
