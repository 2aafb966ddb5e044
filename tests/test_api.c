/* The library front door: init/finalize, backend and device queries, argument validation of every
 * thin wrapper, device memory round trips, streams and events, managed memory. */
#include <math.h>
#include <pthread.h>

#include "check.h"
#include "internal.h"

/* ---- init ---- */

static void *init_thread(void *arg) {
  (void)arg;
  return (void *)(intptr_t)pm_init();
}

static void test_init(void) {
  CHECK_OK(pm_init());
  CHECK_OK(pm_init());
  pthread_t t[4];
  for (int i = 0; i < 4; i++) REQUIRE(pthread_create(&t[i], NULL, init_thread, NULL) == 0);
  for (int i = 0; i < 4; i++) {
    void *ret;
    pthread_join(t[i], &ret);
    CHECK_ST((pm_status_t)(intptr_t)ret, PM_OK);
  }
  pm_backend_kind_t k = pm_backend_kind();
  const char *name = pm_backend_name();
  CHECK(k == PM_BACKEND_HOST || k == PM_BACKEND_CUDA);
  CHECK(strcmp(name, k == PM_BACKEND_HOST ? "host" : "cuda") == 0);
  const char *want = getenv("PINMEM_BACKEND");
  if (want && strcmp(want, "auto") != 0) CHECK(strcmp(name, want) == 0);
  CHECK(pm__backend() != NULL);
  CHECK(pm__backend()->kind == k);
}

/* ---- devices ---- */

static void test_devices(void) {
  int count = -1;
  REQUIRE_OK(pm_device_count(&count));
  CHECK(count >= 1);
  for (int i = 0; i < count; i++) {
    pm_device_info_t info;
    memset(&info, 0x7f, sizeof info);
    REQUIRE_OK(pm_device_get_info(i, &info));
    CHECK_EQ_INT(info.index, i);
    CHECK(info.name[0] != '\0' && memchr(info.name, '\0', sizeof info.name) != NULL);
    CHECK(memchr(info.pci_bus_id, '\0', sizeof info.pci_bus_id) != NULL);
    CHECK(info.total_memory > 0);
    CHECK(info.free_memory <= info.total_memory);
    CHECK(info.cc_major >= 0 && info.cc_minor >= 0);
    if (pm_backend_kind() == PM_BACKEND_CUDA) CHECK(info.cc_major >= 3);
    CHECK(info.pcie_gen == -1 || (info.pcie_gen >= 1 && info.pcie_gen <= 8));
    CHECK(info.pcie_width == -1 || (info.pcie_width >= 1 && info.pcie_width <= 32));
    CHECK(info.pcie_max_gen == -1 || info.pcie_max_gen >= 1);
    CHECK(info.pcie_max_width == -1 || info.pcie_max_width >= 1);
    CHECK(info.numa_node >= -1);
    CHECK(info.async_engines >= 0 && info.async_engines <= 64);
    CHECK(info.can_map_host_memory == 0 || info.can_map_host_memory == 1);
    CHECK(info.unified_addressing == 0 || info.unified_addressing == 1);
    CHECK(info.managed_memory == 0 || info.managed_memory == 1);
    CHECK(info.concurrent_managed_access == 0 || info.concurrent_managed_access == 1);
    CHECK(info.host_register_supported == 0 || info.host_register_supported == 1);
    CHECK(info.host_register_read_only == 0 || info.host_register_read_only == 1);
    CHECK(info.pageable_memory_access == 0 || info.pageable_memory_access == 1);
    printf("device %d: %s, %zu MiB\n", i, info.name, info.total_memory >> 20);
  }
  pm_device_info_t info;
  CHECK_ERR_MSG(pm_device_get_info(-1, &info), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_device_get_info(count, &info), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_device_get_info(0, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_device_count(NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_device_get(NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_device_set(-1), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_device_set(count), PM_ERR_INVALID);
  int dev = -1;
  CHECK_OK(pm_device_get(&dev));
  CHECK_EQ_INT(dev, 0);
  CHECK_OK(pm_device_set(0));
  CHECK_OK(pm_device_get(&dev));
  CHECK_EQ_INT(dev, 0);
  CHECK_OK(pm_device_synchronize());
}

/* ---- every wrapper rejects bad input with a status and a message ---- */

static void noop(void *arg) {
  (void)arg;
}

static void test_bad_input(void) {
  void *p = NULL;
  pm_stream_t s = NULL;
  pm_event_t e = NULL;
  double secs;
  char host[64];
  size_t before = pm__registry_count();

  /* Overlapping src and dst: cudaMemcpy's result would be undefined (pm_copy_async refuses
   * them too). */
  {
    void *d = NULL;
    char h[2048];
    REQUIRE_OK(pm_device_alloc(4096, &d));
    CHECK_ERR_MSG(pm_memcpy((char *)d + 1, d, 1000, PM_COPY_D2D), PM_ERR_INVALID);
    CHECK(strstr(pm_last_error(), "overlap") != NULL);
    CHECK_ERR_MSG(pm_memcpy_async(d, (char *)d + 999, 1000, PM_COPY_DEFAULT, NULL), PM_ERR_INVALID);
    CHECK_ERR_MSG(pm_memcpy(h + 1, h, 1000, PM_COPY_H2H), PM_ERR_INVALID);
    CHECK_OK(pm_memcpy(h + 1000, h, 1000, PM_COPY_H2H)); /* touching, not sharing */
    CHECK_OK(pm_memcpy((char *)d + 1000, d, 1000, PM_COPY_D2D));
    CHECK_OK(pm_device_free(d));
  }
  CHECK_ERR_MSG(pm_stream_create(NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_stream_destroy(NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_stream_wait_event(NULL, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_event_create(0, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_event_create(0x100, &e), PM_ERR_INVALID);
  CHECK(e == NULL);
  CHECK_ERR_MSG(pm_event_destroy(NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_event_record(NULL, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_event_query(NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_event_synchronize(NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_event_elapsed(NULL, NULL, &secs), PM_ERR_INVALID);
  REQUIRE_OK(pm_event_create(PM_EVENT_TIMING, &e));
  CHECK_ERR_MSG(pm_event_elapsed(e, e, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_event_elapsed(e, NULL, &secs), PM_ERR_INVALID);
  CHECK_OK(pm_event_destroy(e));
  CHECK_ERR_MSG(pm_launch_busy(NULL, -1.0), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_launch_busy(NULL, NAN), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_launch_busy(NULL, INFINITY), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_launch_host_func(NULL, NULL, NULL), PM_ERR_INVALID);

  CHECK_ERR_MSG(pm_device_alloc(0, &p), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_device_alloc(16, NULL), PM_ERR_INVALID);
  CHECK(p == NULL);
  pm_status_t st = pm_device_alloc(SIZE_MAX / 2, &p); /* far more than any device has */
  CHECK(st < 0);
  CHECK(pm_last_error()[0] != '\0');
  CHECK(p == NULL);
  CHECK_ERR_MSG(pm_device_free(host), PM_ERR_NOT_FOUND);
  CHECK_OK(pm_device_free(NULL)); /* as free(NULL) */
  CHECK_ERR_MSG(pm_device_memset_async(NULL, 0, 16, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_device_memset_async(host, 0, 16, NULL), PM_ERR_INVALID); /* not device */

  CHECK_ERR_MSG(pm_memcpy(NULL, host, 16, PM_COPY_H2H), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_memcpy(host, NULL, 16, PM_COPY_H2H), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_memcpy(host, host + 32, 16, (pm_copy_kind_t)99), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_memcpy_async(NULL, host, 16, PM_COPY_H2D, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_memcpy_async(host, host, 16, (pm_copy_kind_t)-1, NULL), PM_ERR_INVALID);

  CHECK_ERR_MSG(pm_managed_alloc(0, &p), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_managed_alloc(16, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_managed_free(host), PM_ERR_NOT_FOUND);
  CHECK_OK(pm_managed_free(NULL));
  CHECK_ERR_MSG(pm_managed_prefetch(NULL, 16, 0, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_managed_prefetch(host, 16, 0, NULL), PM_ERR_NOT_FOUND);

  CHECK_ERR_MSG(pm_host_free(host), PM_ERR_NOT_FOUND);
  CHECK_OK(pm_host_free(NULL));
  CHECK_ERR_MSG(pm_host_record_stream(NULL, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_host_record_stream(host, NULL), PM_ERR_NOT_FOUND);
  CHECK_ERR_MSG(pm_host_usable_size(NULL, &(size_t){0}), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_host_usable_size(host, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_host_usable_size(host, &(size_t){0}), PM_ERR_NOT_FOUND);
  CHECK_ERR_MSG(pm_host_device_pointer(host, &p), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_host_device_pointer(host, NULL), PM_ERR_INVALID);

  /* valid no-ops */
  CHECK_OK(pm_stream_create(&s));
  CHECK_OK(pm_memcpy_async(host, host + 32, 0, PM_COPY_H2H, s));
  CHECK_OK(pm_launch_busy(s, 0.0));
  CHECK_OK(pm_launch_host_func(s, noop, NULL));
  CHECK_OK(pm_stream_synchronize(s));
  CHECK_OK(pm_stream_destroy(s));
  CHECK_EQ_SIZE(pm__registry_count(), before); /* nothing leaked into the registry */
}

/* ---- device memory ---- */

static void test_device_memory(void) {
  const size_t sizes[] = {1, 255, 4097, (1u << 20) + 3, pm_test_small() ? 65536 : (8u << 20) + 1};
  pm_stream_t s = NULL;
  REQUIRE_OK(pm_stream_create(&s));
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    size_t n = sizes[k];
    unsigned char *src = malloc(n + 1), *dst = malloc(n + 1);
    REQUIRE(src && dst);
    pm_test_fill(src, n + 1, 10 + k);
    void *d1 = NULL, *d2 = NULL;
    REQUIRE_OK(pm_device_alloc(n, &d1));
    REQUIRE_OK(pm_device_alloc(n, &d2));
    CHECK(d1 != NULL && d2 != NULL && d1 != d2);

    /* pageable H2D from an unaligned source, D2D, D2H, all ordered on s (a pm_memcpy H2D
     * would not order later work on s: like cudaMemcpy it may return before the DMA landed) */
    CHECK_OK(pm_memcpy_async(d1, src + 1, n, PM_COPY_H2D, s));
    CHECK_OK(pm_memcpy_async(d2, d1, n, PM_COPY_D2D, s));
    memset(dst, 0, n + 1);
    CHECK_OK(pm_memcpy_async(dst + 1, d2, n, PM_COPY_D2H, s)); /* pageable: returns done */
    CHECK_OK(pm_stream_synchronize(s));
    CHECK(memcmp(dst + 1, src + 1, n) == 0);

    /* memset a middle part on the stream, then read it all back */
    size_t lo = n / 4, len = n / 2;
    CHECK_OK(pm_device_memset_async((char *)d2 + lo, 0xA7, len, s));
    CHECK_OK(pm_memcpy_async(dst, d2, n, PM_COPY_D2H, s));
    CHECK_OK(pm_stream_synchronize(s));
    int bad = 0;
    for (size_t i = 0; i < n; i++) {
      unsigned char want = (i >= lo && i < lo + len) ? 0xA7 : src[1 + i];
      bad += dst[i] != want;
    }
    CHECK_EQ_INT(bad, 0);

    /* direction inferred from the pointers */
    pm_test_fill(src, n, 99 + k);
    CHECK_OK(pm_memcpy(d1, src, n, PM_COPY_DEFAULT));
    memset(dst, 0, n);
    CHECK_OK(pm_memcpy(dst, d1, n, PM_COPY_DEFAULT));
    CHECK(memcmp(dst, src, n) == 0);

    /* overruns and contradictory kinds are refused before the backend */
    CHECK_ERR_MSG(pm_memcpy(d1, src, n + 1, PM_COPY_H2D), PM_ERR_INVALID);
    CHECK_ERR_MSG(pm_memcpy((char *)d1 + 1, src, n, PM_COPY_H2D), PM_ERR_INVALID);
    CHECK_ERR_MSG(pm_device_memset_async(d1, 0, n + 1, s), PM_ERR_INVALID);
    CHECK_ERR_MSG(pm_memcpy(d1, d2, n, PM_COPY_H2D), PM_ERR_INVALID);
    CHECK_ERR_MSG(pm_memcpy(dst, d1, n, PM_COPY_H2D), PM_ERR_INVALID);
    CHECK_ERR_MSG(pm_memcpy(d2, d1, n, PM_COPY_H2H), PM_ERR_INVALID);

    /* release rules */
    if (n > 1) CHECK_ERR_MSG(pm_device_free((char *)d1 + 1), PM_ERR_NOT_FOUND);
    CHECK_ERR_MSG(pm_host_free(d1), PM_ERR_WRONG_KIND);
    CHECK(strstr(pm_last_error(), "pm_device_free") != NULL);
    CHECK_ERR_MSG(pm_managed_free(d1), PM_ERR_WRONG_KIND);
    CHECK_OK(pm_device_free(d1));
    CHECK_ERR_MSG(pm_device_free(d1), PM_ERR_NOT_FOUND); /* twice */
    CHECK_OK(pm_device_free(d2));
    free(src);
    free(dst);
  }
  CHECK_OK(pm_stream_destroy(s));
}

/* ---- streams and events ---- */

static void set_flag(void *arg) {
  *(int *)arg = 1;
}

static void test_streams(void) {
  pm_stream_t a = NULL, b = NULL;
  pm_event_t e0 = NULL, e1 = NULL, ev = NULL;
  REQUIRE_OK(pm_stream_create(&a));
  REQUIRE_OK(pm_stream_create(&b));
  CHECK(a != NULL && b != NULL && a != b);
  REQUIRE_OK(pm_event_create(PM_EVENT_TIMING, &e0));
  REQUIRE_OK(pm_event_create(PM_EVENT_TIMING, &e1));
  REQUIRE_OK(pm_event_create(PM_EVENT_DEFAULT, &ev));
  CHECK_OK(pm_event_query(ev)); /* never recorded: complete */

  CHECK_OK(pm_event_record(e0, a));
  CHECK_OK(pm_launch_busy(a, 0.02));
  CHECK_OK(pm_event_record(e1, a));
  /* b waits for a's work: a host function queued on b after the wait sees it finished */
  int flag = 0;
  CHECK_OK(pm_stream_wait_event(b, e1));
  CHECK_OK(pm_launch_host_func(b, set_flag, &flag));
  CHECK_OK(pm_event_record(ev, b));
  CHECK_OK(pm_event_synchronize(ev));
  CHECK_EQ_INT(flag, 1);
  CHECK_OK(pm_event_query(e1));
  CHECK_OK(pm_stream_synchronize(a));
  CHECK_OK(pm_stream_query(a));
  double secs = -1;
  CHECK_OK(pm_event_elapsed(e0, e1, &secs));
  CHECK(secs >= 0);
  /* an event without timing cannot be timed */
  CHECK(pm_event_elapsed(ev, e1, &secs) < 0);

  CHECK_OK(pm_stream_synchronize(NULL));
  CHECK_OK(pm_stream_query(NULL));
  CHECK_OK(pm_event_destroy(e0));
  CHECK_OK(pm_event_destroy(e1));
  CHECK_OK(pm_event_destroy(ev));
  CHECK_OK(pm_stream_destroy(a));
  CHECK_OK(pm_stream_destroy(b));
}

/* ---- managed memory ---- */

static void test_managed(void) {
  pm_device_info_t info;
  REQUIRE_OK(pm_device_get_info(0, &info));
  size_t n = pm_test_small() ? 65536 + 7 : (4u << 20) + 7;
  unsigned char *m = NULL;
  pm_status_t st = pm_managed_alloc(n, (void **)&m);
  if (!info.managed_memory) {
    pm_test_skip("managed memory checks: device 0 has no managed memory (the refusal, %s, checked)",
                 pm_status_name(st));
    CHECK(st != PM_OK);
    return;
  }
  REQUIRE_OK(st);
  pm_pointer_info_t pi;
  CHECK_OK(pm_pointer_query(m + 10, &pi));
  CHECK_EQ_INT(pi.kind, PM_MEMORY_MANAGED);
  CHECK(pi.base == m && pi.size == n);

  unsigned char *want = malloc(n);
  REQUIRE(want);
  pm_test_fill(want, n, 42);
  memcpy(m, want, n);
  pm_stream_t s = NULL;
  REQUIRE_OK(pm_stream_create(&s));
  CHECK_OK(pm_managed_prefetch(m, n, 0, s));
  /* the device sees it: copy it to device memory and back */
  void *d = NULL;
  REQUIRE_OK(pm_device_alloc(n, &d));
  CHECK_OK(pm_memcpy_async(d, m, n, PM_COPY_DEFAULT, s));
  CHECK_OK(pm_stream_synchronize(s));
  unsigned char *back = malloc(n);
  REQUIRE(back);
  CHECK_OK(pm_memcpy(back, d, n, PM_COPY_D2H));
  CHECK(memcmp(back, want, n) == 0);
  CHECK_OK(pm_managed_prefetch(m + 1, n - 1, PM_CPU_DEVICE, s));
  CHECK_OK(pm_stream_synchronize(s));
  CHECK(memcmp(m, want, n) == 0);

  CHECK_ERR_MSG(pm_managed_prefetch(m, n + 1, 0, s), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_managed_prefetch(m, n, 9999, s), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_managed_prefetch(d, n, 0, s), PM_ERR_WRONG_KIND);
  CHECK_ERR_MSG(pm_device_free(m), PM_ERR_WRONG_KIND);
  CHECK(strstr(pm_last_error(), "pm_managed_free") != NULL);
  CHECK_ERR_MSG(pm_managed_free(m + 1), PM_ERR_NOT_FOUND);
  CHECK_OK(pm_device_free(d));
  CHECK_OK(pm_stream_destroy(s));
  CHECK_OK(pm_managed_free(m));
  CHECK_ERR_MSG(pm_managed_free(m), PM_ERR_NOT_FOUND);
  free(want);
  free(back);
}

/* ---- the pool-block calls that route through the registry ---- */

static void test_pool_block_calls(void) {
  void *p = NULL;
  REQUIRE_OK(pm_host_alloc(NULL, 5000, PM_HOST_DEFAULT, &p));
  pm_test_fill(p, 5000, 77);
  size_t usable = 0;
  CHECK_OK(pm_host_usable_size(p, &usable));
  CHECK(usable >= 5000);
  pm_pointer_info_t info;
  CHECK_OK(pm_pointer_query((char *)p + 4999, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_POOL);
  CHECK(info.base == p);
  CHECK(info.pool != NULL);
  CHECK_EQ_INT(info.in_use, 1);

  /* the wrong release calls name the right one */
  CHECK_ERR_MSG(pm_unregister(p), PM_ERR_WRONG_KIND);
  CHECK(strstr(pm_last_error(), "pm_host_free") != NULL);
  CHECK_ERR_MSG(pm_device_free(p), PM_ERR_WRONG_KIND);
  CHECK_ERR_MSG(pm_managed_free(p), PM_ERR_WRONG_KIND);
  /* pinned already: it cannot be registered */
  CHECK_ERR_MSG(pm_register(p, 4096, 0), PM_ERR_OVERLAP);

  /* used by a copy on a stream, recorded, freed: the copy's bytes are right */
  pm_stream_t s = NULL;
  void *d = NULL;
  REQUIRE_OK(pm_stream_create(&s));
  REQUIRE_OK(pm_device_alloc(5000, &d));
  CHECK_OK(pm_memcpy_async(d, p, 5000, PM_COPY_DEFAULT, s));
  CHECK_OK(pm_host_record_stream(p, s));
  CHECK_OK(pm_host_free(p));
  CHECK_ST(pm_host_free(p), PM_ERR_DOUBLE_FREE);
  CHECK_OK(pm_stream_synchronize(s)); /* pm_memcpy below does not order after stream s */
  unsigned char back[5000], want[5000];
  pm_test_fill(want, sizeof want, 77);
  CHECK_OK(pm_memcpy(back, d, sizeof back, PM_COPY_D2H));
  CHECK(memcmp(back, want, sizeof want) == 0);
  CHECK_OK(pm_device_free(d));
  CHECK_OK(pm_stream_destroy(s));
}

/* ---- a registration costs the budget the pages it pins ---- */

static void test_register_charges_pages(void) {
  size_t page = pm__page_size();
  char *m = aligned_alloc(page, 4 * page);
  REQUIRE(m != NULL);
  pm_pool_stats_t s0, s1;
  REQUIRE_OK(pm_pool_get_stats(NULL, &s0));
  /* 100 bytes pin a page (they were charged 100); across a page boundary, two. */
  REQUIRE_OK(pm_register(m + 10, 100, 0));
  REQUIRE_OK(pm_pool_get_stats(NULL, &s1));
  CHECK_EQ_SIZE(s1.registered_bytes - s0.registered_bytes, page);
  REQUIRE_OK(pm_register(m + 2 * page - 50, 100, 0));
  REQUIRE_OK(pm_pool_get_stats(NULL, &s1));
  CHECK_EQ_SIZE(s1.registered_bytes - s0.registered_bytes, 3 * page);
  CHECK_OK(pm_unregister(m + 10));
  CHECK_OK(pm_unregister(m + 2 * page - 50));
  REQUIRE_OK(pm_pool_get_stats(NULL, &s1));
  CHECK_EQ_SIZE(s1.registered_bytes, s0.registered_bytes);
  CHECK_EQ_SIZE(s1.pinned_bytes, s0.pinned_bytes);
  free(m);
}

/* ---- finalize, then everything works again ---- */

static void test_finalize_reinit(void) {
  pm_backend_kind_t kind = pm_backend_kind();
  CHECK_OK(pm_finalize());
  CHECK_EQ_INT(pm_backend_kind(), PM_BACKEND_NONE);
  CHECK(strcmp(pm_backend_name(), "none") == 0);
  CHECK_EQ_SIZE(pm__registry_count(), 0);
  CHECK_OK(pm_finalize()); /* twice is harmless */

  /* a bad backend name is refused and changes nothing; then several threads race to init */
  CHECK_ERR_MSG(pm_option_set("backend", "quantum"), PM_ERR_CONFIG);
  pthread_t t[4];
  for (int i = 0; i < 4; i++) REQUIRE(pthread_create(&t[i], NULL, init_thread, NULL) == 0);
  for (int i = 0; i < 4; i++) {
    void *ret;
    pthread_join(t[i], &ret);
    CHECK_ST((pm_status_t)(intptr_t)ret, PM_OK);
  }
  CHECK_EQ_INT(pm_backend_kind(), kind);

  /* implicit init by any call after finalize */
  CHECK_OK(pm_finalize());
  void *d = NULL;
  CHECK_OK(pm_device_alloc(4096, &d));
  CHECK_EQ_INT(pm_backend_kind(), kind);
  unsigned char src[4096], dst[4096];
  pm_test_fill(src, sizeof src, 5);
  CHECK_OK(pm_memcpy(d, src, sizeof src, PM_COPY_H2D));
  CHECK_OK(pm_memcpy(dst, d, sizeof dst, PM_COPY_D2H));
  CHECK(memcmp(src, dst, sizeof src) == 0);
  CHECK_OK(pm_device_free(d));

  /* the host backend can always be selected explicitly */
  CHECK_OK(pm_finalize());
  CHECK_OK(pm_option_set("backend", "host"));
  CHECK_OK(pm_init());
  CHECK_EQ_INT(pm_backend_kind(), PM_BACKEND_HOST);
  CHECK_OK(pm_finalize());
  CHECK_OK(pm_option_set("backend", NULL));
  CHECK_OK(pm_init());
  CHECK_EQ_INT(pm_backend_kind(), kind);
  CHECK_OK(pm_finalize());
}

int main(void) {
  pm_test_init();
  test_init();
  test_devices();
  test_bad_input();
  test_device_memory();
  test_streams();
  test_managed();
  test_pool_block_calls();
  test_register_charges_pages();
  test_finalize_reinit();
  return pm_test_finish("test_api");
}
