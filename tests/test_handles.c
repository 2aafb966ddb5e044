/*
 * Stale and foreign handles: a second destroy of a pool or a dataset, and every call on one
 * after its destroy, is PM_ERR_INVALID with a message (they were a heap use-after-free: run under
 * ASan by make test-asan). Also: pm_host_record_stream refuses a stream that does not exist when
 * it is called, not later at pm_host_free.
 */
#include "check.h"

static int read_sample(uint64_t index, void *dst, void *user) {
  (void)user;
  pm_test_fill(dst, 64, index + 1);
  return 0;
}

static void test_pool(void) {
  pm_pool_t *pool = NULL;
  REQUIRE_OK(pm_pool_create(NULL, &pool));
  void *p = NULL;
  CHECK_OK(pm_host_alloc(pool, 100, 0, &p));
  CHECK_OK(pm_host_free(p));
  CHECK_OK(pm_pool_destroy(pool));

  /* The pool is gone: every call that takes it says so instead of reading freed memory. */
  CHECK_ERR_MSG(pm_pool_destroy(pool), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "already destroyed") != NULL);
  CHECK_ERR_MSG(pm_host_alloc(pool, 100, 0, &p), PM_ERR_INVALID);
  size_t released = 0;
  CHECK_ERR_MSG(pm_pool_trim(pool, &released), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_pool_reserve(pool, 4096, 0), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_pool_set_budget(pool, 1 << 20), PM_ERR_INVALID);
  pm_pool_stats_t st;
  CHECK_ERR_MSG(pm_pool_get_stats(pool, &st), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_pool_reset_peak(pool), PM_ERR_INVALID);

  /* A pointer that never was a pool. */
  int not_a_pool;
  CHECK_ERR_MSG(pm_pool_destroy((pm_pool_t *)&not_a_pool), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_host_alloc((pm_pool_t *)&not_a_pool, 100, 0, &p), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_pool_destroy(NULL), PM_ERR_INVALID);

  /* A new pool (perhaps at the same address) is live; the old handle stays dead only if the
   * address differs, which is the caller's lookout, as with any allocator. */
  pm_pool_t *again = NULL;
  CHECK_OK(pm_pool_create(NULL, &again));
  pm_pool_t *def = NULL;
  CHECK_OK(pm_pool_default(&def));
  CHECK_ERR_MSG(pm_pool_destroy(def), PM_ERR_INVALID); /* released by pm_finalize */
  CHECK_OK(pm_pool_destroy(again));
}

static void test_dataset(void) {
  pm_dataset_callbacks_t cb;
  memset(&cb, 0, sizeof cb);
  cb.samples = 10;
  cb.sample_bytes = 64;
  cb.read = read_sample;
  pm_dataset_t *ds = NULL;
  REQUIRE_OK(pm_dataset_create(&cb, &ds));
  unsigned char buf[64], want[64];
  CHECK_OK(pm_dataset_read_sample(ds, 0, 3, buf, NULL));
  pm_test_fill(want, 64, 4);
  CHECK(memcmp(buf, want, 64) == 0);
  CHECK_OK(pm_dataset_destroy(ds));

  CHECK_ERR_MSG(pm_dataset_destroy(ds), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "already destroyed") != NULL);
  pm_dataset_info_t info;
  CHECK_ERR_MSG(pm_dataset_get_info(ds, &info), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_dataset_read_sample(ds, 0, 3, buf, NULL), PM_ERR_INVALID);
  int not_a_dataset;
  CHECK_ERR_MSG(pm_dataset_destroy((pm_dataset_t *)&not_a_dataset), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_dataset_get_info((pm_dataset_t *)&not_a_dataset, &info), PM_ERR_INVALID);
}

static void test_record_stream(void) {
  void *p = NULL;
  REQUIRE_OK(pm_host_alloc(NULL, 1000, 0, &p));
  pm_stream_t s = NULL;
  REQUIRE_OK(pm_stream_create(&s));
  CHECK_OK(pm_host_record_stream(p, s));
  CHECK_OK(pm_host_record_stream(p, NULL)); /* the default stream */
  pm_stream_t dead = NULL;
  REQUIRE_OK(pm_stream_create(&dead));
  REQUIRE_OK(pm_stream_destroy(dead));
  if (pm_backend_kind() == PM_BACKEND_HOST) {
    /* The host backend knows every stream it made: a destroyed or made-up one is refused now. */
    CHECK_ERR_MSG(pm_host_record_stream(p, dead), PM_ERR_INVALID);
    CHECK(strstr(pm_last_error(), "pm_host_record_stream") != NULL);
    int bogus;
    CHECK_ERR_MSG(pm_host_record_stream(p, (pm_stream_t)&bogus), PM_ERR_INVALID);
  }
  /* ... so the free that follows is clean. */
  CHECK_OK(pm_host_free(p));
  CHECK_OK(pm_stream_synchronize(s));
  CHECK_OK(pm_stream_destroy(s));
}

int main(void) {
  pm_test_init();
  test_pool();
  test_dataset();
  test_record_stream();
  CHECK_OK(pm_finalize());
  return pm_test_finish("test_handles");
}
