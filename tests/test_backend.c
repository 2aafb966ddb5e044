/* The backend contract (src/backend/backend.h), called through the active backend's table: stream
 * order, events, cross-stream waits, host functions, pageable copies that block and pinned copies
 * that do not, memory kinds and their errors, and many threads copying on many streams.
 *
 * The same bodies run on the host backend and on the cuda backend. Checks of the host backend's
 * own rules (its exact error codes, the simulated device-memory limit, mlock and RLIMIT_MEMLOCK,
 * bad handles) run only where it is the backend; on cuda a rejected call must still fail.
 *
 * "Not complete yet" states are made deterministic with a gate: a host function that holds its
 * stream until the test opens it. No check depends on timing.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend.h"
#include "check.h"
#include "internal.h"

static const pm__backend_t *B;
static bool is_host;
static bool small;

/* The exact status on the host backend; on cuda only that the call failed (its mapping of
 * CUDA's errors is its own business). */
#define CHECK_REJECT(expr, want)                                                \
  do {                                                                          \
    if (is_host) {                                                              \
      CHECK_ERR_MSG(expr, want);                                                \
    } else {                                                                    \
      pm_status_t rs_ = (expr);                                                 \
      pm_test_checks++;                                                         \
      if (rs_ >= 0)                                                             \
        PM_TEST_FAIL_AT(__FILE__, __LINE__, "%s: got %s, want an error", #expr, \
                        pm_status_name(rs_));                                   \
    }                                                                           \
  } while (0)

#define CHECK_MSG_HAS(text) CHECK(strstr(pm_last_error(), (text)) != NULL)

/* ---- helpers ------------------------------------------------------------------------------ */

static void set_flag(void *arg) {
  atomic_store((atomic_int *)arg, 1);
}

static void *pinned(size_t bytes) {
  void *p = NULL;
  REQUIRE_OK(B->host_alloc(bytes, 0, &p));
  return p;
}

static void *device(size_t bytes) {
  void *p = NULL;
  REQUIRE_OK(B->device_alloc(bytes, &p));
  return p;
}

static pm_stream_t new_stream(void) {
  pm_stream_t s = NULL;
  REQUIRE_OK(B->stream_create(&s));
  return s;
}

static pm_event_t new_event(unsigned flags) {
  pm_event_t e = NULL;
  REQUIRE_OK(B->event_create(flags, &e));
  return e;
}

/* ---- RLIMIT_MEMLOCK: in a child that cannot lock more than 64 KiB ------------------------- */

static void test_memlock_limit(void) {
  fflush(stdout);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    if (!pm_test_limit_memlock(64 * 1024)) _exit(PM_TEST_SKIP);
    /* Sanitizer runtimes replace mlock with a no-op that never fails. */
    char probe[2 * 65536];
    if (mlock(probe, sizeof probe) == 0) _exit(78);
    const pm__backend_t *h = &pm__backend_host;
    int bad = 0;
    void *p = NULL;
    pm_status_t st = h->host_alloc(1 << 20, 0, &p);
    printf("  memlock detail: %s\n", pm_last_error());
    bad += st != PM_ERR_MEMLOCK || p != NULL;
    bad += !strstr(pm_last_error(), "ulimit -l") || !strstr(pm_last_error(), "RLIMIT_MEMLOCK") ||
           !strstr(pm_last_error(), "65536") || !strstr(pm_last_error(), "PINMEM_BUDGET") ||
           !strstr(pm_last_error(), "1048576");
    size_t pg = pm__page_size();
    char *buf = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) _exit(2);
    bad += h->host_register(buf, 1 << 20, 0) != PM_ERR_MEMLOCK;
    bad += !strstr(pm_last_error(), "ulimit -l");
    /* within the limit it works, and the failed attempt left nothing behind */
    bad += h->host_register(buf + 3, pg, 0) != PM_OK;
    bad += h->host_unregister(buf + 3, pg) != PM_OK;
    bad += h->host_unregister(buf, 1 << 20) != PM_ERR_NOT_FOUND;
    fflush(stdout);
    pm_test_child_exit(bad ? 1 : 0);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status));
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
    pm_test_skip("RLIMIT_MEMLOCK check: could not drop the right to lock memory here");
    return;
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 78) {
    pm_test_skip("RLIMIT_MEMLOCK check: mlock does not enforce the limit in this build "
                 "(sanitizers make it a no-op)");
    return;
  }
  CHECK_EQ_INT(WEXITSTATUS(status), 0);
}

/* ---- pinned host memory and registration -------------------------------------------------- */

static void test_host_alloc(void) {
  const size_t n = 100003;
  long long lck0 = pm_test_vm_locked();
  void *p = NULL;
  REQUIRE_OK(B->host_alloc(n, PM_HOST_MAPPED, &p));
  CHECK(((uintptr_t)p & (pm__page_size() - 1)) == 0);
  pm_test_fill(p, n, 11);
  void *d = NULL;
  CHECK_OK(B->host_device_pointer((char *)p + 17, &d));
  CHECK(d != NULL);
  if (is_host) {
    CHECK(d == (char *)p + 17);
    long long lck1 = pm_test_vm_locked();
    if (lck0 >= 0 && lck1 >= 0) CHECK(lck1 - lck0 >= (long long)n); /* it really is mlock'd */
  }
  void *w = NULL;
  CHECK_OK(B->host_alloc(4096, PM_HOST_WRITE_COMBINED | PM_HOST_PORTABLE, &w));
  CHECK_OK(B->host_free(w, 4096));
  CHECK_OK(B->host_free(p, n));
  if (is_host) {
    long long lck2 = pm_test_vm_locked();
    if (lck0 >= 0 && lck2 >= 0) CHECK_EQ_INT(lck2, lck0);
  }

  if (!is_host) return;
  int local = 0;
  void *q = (void *)0x1;
  CHECK_ERR_MSG(B->host_free(p, n), PM_ERR_NOT_FOUND); /* double free */
  CHECK_ERR_MSG(B->host_free(&local, sizeof local), PM_ERR_NOT_FOUND);
  CHECK_ERR_MSG(B->host_free(NULL, 1), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->host_alloc(0, 0, &q), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->host_alloc(64, 0x80, &q), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->host_alloc(64, 0, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->host_alloc(SIZE_MAX - 10, 0, &q), PM_ERR_NOMEM);
  CHECK(q == (void *)0x1); /* outputs only on success */
  CHECK_ERR_MSG(B->host_device_pointer(&local, &q), PM_ERR_INVALID);
  CHECK(q == (void *)0x1);
  /* inside a block is not its start */
  REQUIRE_OK(B->host_alloc(8192, 0, &p));
  CHECK_ERR_MSG(B->host_free((char *)p + 8, 8192), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->host_unregister(p, 8192), PM_ERR_WRONG_KIND);
  CHECK_ERR_MSG(B->host_register((char *)p + 100, 10, 0), PM_ERR_OVERLAP);
  CHECK_OK(B->host_free(p, 8192));
}

static void test_register(void) {
  size_t pg = pm__page_size();
  char *buf = malloc(3 * pg + 200);
  REQUIRE(buf);
  char *ptr = buf + 7;
  size_t n = 2 * pg + 5;
  pm_test_fill(buf, 3 * pg + 200, 21);
  CHECK_OK(B->host_register(ptr, n, PM_REGISTER_MAPPED));
  void *d = NULL;
  CHECK_OK(B->host_device_pointer(ptr + 10, &d));
  CHECK(d != NULL);
  if (is_host) {
    CHECK(d == ptr + 10);
    CHECK_ERR_MSG(B->host_register(ptr + n - 1, 10, 0), PM_ERR_OVERLAP);
    CHECK_MSG_HAS("registration");
    CHECK_ERR_MSG(B->host_unregister(ptr + 1, 0), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->host_free(ptr, n), PM_ERR_WRONG_KIND);
    CHECK_ERR_MSG(B->host_register(ptr, 0, 0), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->host_register(NULL, 10, 0), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->host_register(ptr, 10, 0x100), PM_ERR_INVALID);
  }
  CHECK_OK(B->host_unregister(ptr, n));
  CHECK_REJECT(B->host_unregister(ptr, n), PM_ERR_NOT_FOUND); /* twice */
  free(buf);

  if (!is_host) return;
  /* Two registrations sharing one page (no byte in common): unregistering one must leave the
   * other pinned, and both are independent entries. */
  char *m = mmap(NULL, 2 * pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(m != MAP_FAILED);
  CHECK_OK(B->host_register(m + 100, 200, 0));
  CHECK_OK(B->host_register(m + 300, pg, PM_REGISTER_READ_ONLY));
  CHECK_OK(B->host_unregister(m + 100, 200));
  CHECK_OK(B->host_device_pointer(m + 400, &d));
  CHECK_ERR_MSG(B->host_device_pointer(m + 150, &d), PM_ERR_INVALID);
  CHECK_OK(B->host_unregister(m + 300, pg));
  munmap(m, 2 * pg);

  /* memory that is not mapped at all */
  char *gone = mmap(NULL, pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(gone != MAP_FAILED);
  munmap(gone, pg);
  CHECK_ERR_MSG(B->host_register(gone, pg, 0), PM_ERR_INVALID);
  CHECK_MSG_HAS("not mapped");
  CHECK_ERR_MSG(B->host_device_pointer(gone, &d), PM_ERR_INVALID);

  /* memory mapped without access (a guard page): mlock's ENOMEM is not a low RLIMIT_MEMLOCK,
   * which the message blamed ("raise it with ulimit -l" for 4 KiB far under the limit) */
  char *guard = mmap(NULL, 2 * pg, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(guard != MAP_FAILED);
  if (mlock(guard, pg) == 0) { /* sanitizer runtimes make mlock a no-op */
    munlock(guard, pg);
    pm_test_skip("mlock of PROT_NONE memory succeeds here (a sanitizer's no-op mlock)");
  } else {
    CHECK_ERR_MSG(B->host_register(guard + 10, pg, 0), PM_ERR_INVALID);
    CHECK_MSG_HAS("PROT_NONE");
    CHECK(strstr(pm_last_error(), "RLIMIT_MEMLOCK") == NULL);
  }
  munmap(guard, 2 * pg);

  /* device memory is not host memory to register */
  void *dv = device(4096);
  CHECK_ERR_MSG(B->host_register(dv, 4096, 0), PM_ERR_INVALID);
  CHECK_OK(B->device_free(dv));
}

/* ---- device and managed memory ------------------------------------------------------------ */

static void test_device_memory(void) {
  const size_t n = (small ? 65536 : 1 << 20) + 3;
  unsigned char *d = device(n);
  unsigned char *h = pinned(n);
  int local = 0;
  /* The three answers of pointer_kind, each end of each range. */
  REQUIRE(B->pointer_kind != NULL);
  CHECK_EQ_INT(B->pointer_kind(d), PM__PTR_DEVICE);
  CHECK_EQ_INT(B->pointer_kind(d + n - 1), PM__PTR_DEVICE);
  CHECK_EQ_INT(B->pointer_kind(h), PM__PTR_PINNED);
  CHECK_EQ_INT(B->pointer_kind(h + n - 1), PM__PTR_PINNED);
  CHECK_EQ_INT(B->pointer_kind(&local), PM__PTR_OTHER);
  CHECK_EQ_INT(B->pointer_kind(NULL), PM__PTR_OTHER);
  {
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    unsigned char *r = NULL;
    REQUIRE(posix_memalign((void **)&r, pg, 2 * pg) == 0);
    CHECK_EQ_INT(B->pointer_kind(r), PM__PTR_OTHER);
    CHECK_OK(B->host_register(r, pg, 0));
    CHECK_EQ_INT(B->pointer_kind(r), PM__PTR_PINNED);
    CHECK_EQ_INT(B->pointer_kind(r + pg - 1), PM__PTR_PINNED);
    CHECK_EQ_INT(B->pointer_kind(r + pg), PM__PTR_OTHER);
    CHECK_OK(B->host_unregister(r, pg));
    CHECK_EQ_INT(B->pointer_kind(r), PM__PTR_OTHER);
    free(r);
  }

  /* memset, then the bytes as seen through a copy back */
  CHECK_OK(B->device_memset_async(d, 0x5a, n, NULL));
  CHECK_OK(B->memcpy_sync(h, d, n, PM_COPY_D2H));
  size_t wrong = 0;
  for (size_t i = 0; i < n; i++) wrong += h[i] != 0x5a;
  CHECK_EQ_SIZE(wrong, 0);

  unsigned char *src = pinned(n);
  pm_test_fill(src, n, 31);
  CHECK_OK(B->memcpy_sync(d, src, n, PM_COPY_H2D));
  CHECK_OK(B->device_memset_async(d + 1000, 0x11, 77, NULL)); /* a piece in the middle */
  memset(src + 1000, 0x11, 77);
  CHECK_OK(B->memcpy_sync(h, d, n, PM_COPY_D2H));
  CHECK(memcmp(h, src, n) == 0);

  if (is_host) {
    void *q = (void *)0x1;
    CHECK_ERR_MSG(B->device_alloc(0, &q), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->device_alloc(16, NULL), PM_ERR_INVALID);
    CHECK(q == (void *)0x1);
    CHECK_ERR_MSG(B->device_free(NULL), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->device_free(&local), PM_ERR_NOT_FOUND);
    CHECK_ERR_MSG(B->device_free(d + 1), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->device_memset_async(d + 10, 1, n, NULL), PM_ERR_INVALID);
    CHECK_MSG_HAS("past the end");
    CHECK_ERR_MSG(B->device_memset_async(h, 1, 10, NULL), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->device_memset_async(NULL, 1, 10, NULL), PM_ERR_INVALID);
    CHECK_OK(B->device_memset_async(d, 1, 0, NULL)); /* nothing to do */
  }
  CHECK_OK(B->device_free(d));
  CHECK_REJECT(B->device_free(d), PM_ERR_NOT_FOUND); /* double free */
  CHECK(!is_host || B->pointer_kind(d) != PM__PTR_DEVICE);

  /* far more than any device has */
  void *huge = (void *)0x1;
  CHECK_REJECT(B->device_alloc((size_t)1 << 52, &huge), PM_ERR_DEVICE_MEMORY);
  CHECK(huge == (void *)0x1);

  CHECK_OK(B->host_free(h, n));
  CHECK_OK(B->host_free(src, n));
}

static void test_device_limit(void) {
  if (!is_host) return;
  const size_t MiB = 1 << 20;
  pm_option_info_t saved;
  REQUIRE_OK(pm_option_find("host_device_memory", &saved));
  REQUIRE_OK(pm_option_set("host_device_memory", "8M"));
  pm_device_info_t info;
  CHECK_OK(B->device_info(0, &info));
  CHECK_EQ_SIZE(info.total_memory, 8 * MiB);
  size_t free0 = info.free_memory;

  void *a = device(6 * MiB), *b = (void *)0x1;
  CHECK_OK(B->device_info(0, &info));
  CHECK_EQ_SIZE(info.free_memory, free0 - 6 * MiB);
  CHECK_ERR_MSG(B->device_alloc(3 * MiB, &b), PM_ERR_DEVICE_MEMORY);
  CHECK_MSG_HAS("host_device_memory");
  CHECK(b == (void *)0x1);
  CHECK_ERR_MSG(B->device_alloc(SIZE_MAX, &b), PM_ERR_DEVICE_MEMORY);
  /* managed memory is not charged */
  void *m = NULL;
  CHECK_OK(B->managed_alloc(4 * MiB, &m));
  CHECK_OK(B->device_free(a));
  CHECK_OK(B->device_alloc(3 * MiB, &b));
  CHECK_OK(B->device_alloc(5 * MiB, &a));
  CHECK_OK(B->device_free(b));
  CHECK_OK(B->device_free(a));
  CHECK_OK(B->managed_free(m));
  CHECK_OK(B->device_info(0, &info));
  CHECK_EQ_SIZE(info.free_memory, free0);
  REQUIRE_OK(pm_option_set("host_device_memory", saved.value));
}

static void test_managed(void) {
  const size_t n = (small ? 32768 : 300000) + 1;
  pm_stream_t s = new_stream();
  unsigned char *m = NULL;
  REQUIRE_OK(B->managed_alloc(n, (void **)&m));
  CHECK(B->pointer_kind(m) == PM__PTR_DEVICE);
  CHECK(B->pointer_kind(m + n - 1) == PM__PTR_DEVICE);
  pm_test_fill(m, n, 41);
  unsigned char *want = malloc(n);
  REQUIRE(want);
  pm_test_fill(want, n, 41);
  CHECK_OK(B->managed_prefetch(m, n, 0, s));
  CHECK_OK(B->managed_prefetch(m + 5, n - 5, PM_CPU_DEVICE, s));
  unsigned char *h = pinned(n);
  CHECK_OK(B->memcpy_async(h, m, n, PM_COPY_D2H, s));
  CHECK_OK(B->stream_synchronize(s));
  CHECK(memcmp(h, want, n) == 0);
  if (is_host) {
    CHECK_ERR_MSG(B->managed_prefetch(m, n + 1, 0, s), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->managed_prefetch(h, 10, 0, s), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->managed_prefetch(m, 10, 3, s), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->managed_prefetch(NULL, 10, 0, s), PM_ERR_INVALID);
    void *dv = device(64);
    CHECK_ERR_MSG(B->managed_prefetch(dv, 10, 0, s), PM_ERR_INVALID);
    CHECK_OK(B->device_free(dv));
  }
  CHECK_OK(B->managed_free(m));
  CHECK_REJECT(B->managed_free(m), PM_ERR_NOT_FOUND);
  CHECK_OK(B->host_free(h, n));
  CHECK_OK(B->stream_destroy(s));
  free(want);
}

/* ---- ordering ----------------------------------------------------------------------------- */

/* busy, then copies, then events: an event completes only after the copies before it. */
static void test_in_order(void) {
  enum { K = 4 };
  const size_t n = (small ? 20000 : 1 << 20) + 7;
  pm_stream_t s = new_stream();
  unsigned char *src = pinned(n);
  unsigned char *d = device(n);
  unsigned char *dst[K];
  pm_event_t ev[K];
  pm_test_fill(src, n, 51);
  CHECK_OK(B->memcpy_sync(d, src, n, PM_COPY_H2D));
  CHECK_OK(B->launch_busy(s, 0.2));
  for (int k = 0; k < K; k++) {
    dst[k] = pinned(n);
    memset(dst[k], 0xee, n);
    ev[k] = new_event(0);
    CHECK_OK(B->memcpy_async(dst[k], d, n, PM_COPY_D2H, s));
    CHECK_OK(B->event_record(ev[k], s));
  }
  /* The last event: no stream sync, so only the event's own guarantee is tested. */
  CHECK_OK(B->event_synchronize(ev[K - 1]));
  for (int k = 0; k < K; k++) {
    CHECK_OK(B->event_query(ev[k]));
    CHECK(memcmp(dst[k], src, n) == 0);
  }
  /* each event waits for its own copy only: verify with a fresh one on the first */
  CHECK_OK(B->launch_busy(s, 0.05));
  memset(dst[0], 0xee, n);
  CHECK_OK(B->memcpy_async(dst[0], d, n, PM_COPY_D2H, s));
  CHECK_OK(B->event_record(ev[0], s));
  CHECK_OK(B->event_synchronize(ev[0]));
  CHECK(memcmp(dst[0], src, n) == 0);
  for (int k = 0; k < K; k++) {
    CHECK_OK(B->event_destroy(ev[k]));
    CHECK_OK(B->host_free(dst[k], n));
  }
  CHECK_OK(B->stream_destroy(s));
  CHECK_OK(B->device_free(d));
  CHECK_OK(B->host_free(src, n));
}

static void test_cross_stream(void) {
  const size_t n = (small ? 10000 : 500000) + 3;
  pm_stream_t a = new_stream(), b = new_stream(), c = new_stream();
  pm_event_t ea = new_event(0), eb = new_event(0);
  unsigned char *src = pinned(n), *dst = pinned(n), *d = device(n);
  pm_test_fill(src, n, 61);
  memset(dst, 0xcc, n);
  pm_test_gate_t g;
  pm_test_gate_init(&g);

  /* a: [gate] H2D, record ea.   b: wait ea, D2H, record eb. */
  CHECK_OK(B->launch_host_func(a, pm_test_gate_wait, &g));
  CHECK_OK(B->memcpy_async(d, src, n, PM_COPY_H2D, a));
  CHECK_OK(B->event_record(ea, a));
  CHECK_OK(B->stream_wait_event(b, ea));
  CHECK_OK(B->memcpy_async(dst, d, n, PM_COPY_D2H, b));
  CHECK_OK(B->event_record(eb, b));
  CHECK_ST(B->event_query(ea), PM_NOT_READY);
  CHECK_ST(B->event_query(eb), PM_NOT_READY);
  CHECK_ST(B->stream_query(b), PM_NOT_READY);

  /* Re-recording ea on an idle stream completes ea at once, but b waits for the record it
   * captured, which is still behind the gate. */
  CHECK_OK(B->event_record(ea, c));
  CHECK_OK(B->event_synchronize(ea));
  CHECK_OK(B->event_query(ea));
  CHECK_ST(B->stream_query(b), PM_NOT_READY);
  CHECK_ST(B->event_query(eb), PM_NOT_READY);
  CHECK(dst[0] == 0xcc && dst[n - 1] == 0xcc); /* b's copy cannot have run */

  pm_test_gate_open(&g);
  CHECK_OK(B->event_synchronize(eb));
  CHECK(memcmp(dst, src, n) == 0);
  CHECK_OK(B->stream_synchronize(a));

  /* waiting on an event that was never recorded (or already completed) does not block */
  pm_event_t never = new_event(0);
  CHECK_OK(B->stream_wait_event(c, never));
  CHECK_OK(B->stream_wait_event(c, ea));
  CHECK_OK(B->stream_synchronize(c));
  CHECK_OK(B->stream_query(c));

  /* the default stream waits too */
  pm_test_gate_t g2;
  pm_test_gate_init(&g2);
  CHECK_OK(B->launch_host_func(a, pm_test_gate_wait, &g2));
  CHECK_OK(B->event_record(ea, a));
  CHECK_OK(B->stream_wait_event(NULL, ea));
  CHECK_OK(B->event_record(eb, NULL));
  CHECK_ST(B->event_query(eb), PM_NOT_READY);
  pm_test_gate_open(&g2);
  CHECK_OK(B->event_synchronize(eb));
  CHECK_OK(B->event_query(ea));

  CHECK_OK(B->event_destroy(never));
  CHECK_OK(B->event_destroy(ea));
  CHECK_OK(B->event_destroy(eb));
  CHECK_OK(B->stream_destroy(a));
  CHECK_OK(B->stream_destroy(b));
  CHECK_OK(B->stream_destroy(c));
  pm_test_gate_destroy(&g);
  pm_test_gate_destroy(&g2);
  CHECK_OK(B->device_free(d));
  CHECK_OK(B->host_free(src, n));
  CHECK_OK(B->host_free(dst, n));
}

static void test_event_query(void) {
  pm_stream_t s = new_stream();
  pm_event_t e = new_event(0);
  CHECK_OK(B->event_query(e)); /* never recorded */
  CHECK_OK(B->event_synchronize(e));
  pm_test_gate_t g;
  pm_test_gate_init(&g);
  CHECK_OK(B->launch_host_func(s, pm_test_gate_wait, &g));
  CHECK_OK(B->event_record(e, s));
  CHECK_ST(B->event_query(e), PM_NOT_READY);
  CHECK_ST(B->stream_query(s), PM_NOT_READY);
  pm_test_gate_open(&g);
  CHECK_OK(B->event_synchronize(e));
  CHECK_OK(B->event_query(e));
  CHECK_OK(B->stream_synchronize(s));
  CHECK_OK(B->stream_query(s));
  /* an event destroyed while its record is still queued */
  pm_test_gate_t g2;
  pm_test_gate_init(&g2);
  pm_event_t e2 = new_event(PM_EVENT_TIMING);
  CHECK_OK(B->launch_host_func(s, pm_test_gate_wait, &g2));
  CHECK_OK(B->event_record(e2, s));
  CHECK_OK(B->stream_wait_event(s, e2));
  CHECK_OK(B->event_destroy(e2));
  pm_test_gate_open(&g2);
  CHECK_OK(B->stream_synchronize(s));
  if (is_host) {
    CHECK_ERR_MSG(B->event_query(e2), PM_ERR_INVALID);
    CHECK_MSG_HAS("destroyed");
    CHECK_ERR_MSG(B->event_record(e2, s), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->event_destroy(e2), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->stream_wait_event(s, e2), PM_ERR_INVALID);
  }
  CHECK_ERR_MSG(B->event_query(NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->event_destroy(NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->event_create(0x40, &e2), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->event_create(0, NULL), PM_ERR_INVALID);
  CHECK_OK(B->event_destroy(e));
  CHECK_OK(B->stream_destroy(s));
  pm_test_gate_destroy(&g);
  pm_test_gate_destroy(&g2);
}

typedef struct hf_arg {
  int id;
  int *log;
  int *nlog;
  const unsigned char *got, *want;
  size_t bytes;
  int ok;
} hf_arg_t;

static void hf_log(void *arg) {
  hf_arg_t *a = arg;
  a->log[(*a->nlog)++] = a->id; /* only the stream's thread writes, in order */
  a->ok = memcmp(a->got, a->want, a->bytes) == 0;
}

/* Host functions run after the work queued before them, in order, one at a time. */
static void test_host_func_order(void) {
  enum { K = 8 };
  const size_t n = (small ? 4096 : 131072) + 5;
  pm_stream_t s = new_stream();
  unsigned char *src = pinned(K * n), *dst = pinned(K * n), *d = device(K * n);
  pm_test_fill(src, K * n, 71);
  memset(dst, 0, K * n);
  CHECK_OK(B->memcpy_sync(d, src, K * n, PM_COPY_H2D));
  int log[K], nlog = 0;
  hf_arg_t args[K];
  CHECK_OK(B->launch_busy(s, 0.05));
  for (int k = 0; k < K; k++) {
    args[k] = (hf_arg_t){k, log, &nlog, dst + k * n, src + k * n, n, 0};
    CHECK_OK(B->memcpy_async(dst + k * n, d + k * n, n, PM_COPY_D2H, s));
    CHECK_OK(B->launch_host_func(s, hf_log, &args[k]));
  }
  CHECK_OK(B->stream_synchronize(s));
  CHECK_EQ_INT(nlog, K);
  for (int k = 0; k < K; k++) {
    CHECK_EQ_INT(log[k], k);
    CHECK_EQ_INT(args[k].ok, 1);
  }
  CHECK_ERR_MSG(B->launch_host_func(s, NULL, NULL), PM_ERR_INVALID);
  CHECK_OK(B->stream_destroy(s));
  CHECK_OK(B->device_free(d));
  CHECK_OK(B->host_free(src, K * n));
  CHECK_OK(B->host_free(dst, K * n));
}

/* ---- pageable copies block, pinned copies do not ----------------------------------------- */

static void test_pageable_blocks(void) {
  const size_t n = (small ? 30000 : 1 << 20) + 9;
  pm_stream_t s = new_stream();
  unsigned char *src = pinned(n), *d = device(n);
  unsigned char *page = malloc(n), *want = malloc(n);
  REQUIRE(page && want);
  pm_test_fill(src, n, 81);
  CHECK_OK(B->memcpy_sync(d, src, n, PM_COPY_H2D));

  /* D2H into pageable memory: when the call returns, the earlier work is done and the bytes
   * are there, with no synchronisation of any kind. */
  atomic_int flag = 0;
  pm_event_t before = new_event(0);
  memset(page, 0, n);
  CHECK_OK(B->launch_busy(s, 0.2));
  CHECK_OK(B->launch_host_func(s, set_flag, &flag));
  CHECK_OK(B->event_record(before, s));
  CHECK_OK(B->memcpy_async(page, d, n, PM_COPY_D2H, s));
  CHECK_EQ_INT(atomic_load(&flag), 1);
  CHECK_OK(B->event_query(before));
  CHECK(memcmp(page, src, n) == 0);

  /* H2D from pageable memory: when the call returns the source was consumed, so the caller
   * may overwrite it at once. */
  pm_test_fill(page, n, 82);
  memcpy(want, page, n);
  CHECK_OK(B->launch_busy(s, 0.2));
  CHECK_OK(B->memcpy_async(d, page, n, PM_COPY_H2D, s));
  memset(page, 0x77, n);
  CHECK_OK(B->memcpy_async(src, d, n, PM_COPY_D2H, s));
  CHECK_OK(B->stream_synchronize(s));
  CHECK(memcmp(src, want, n) == 0);

  /* A pageable copy is still ordered before later work on its stream. */
  pm_test_fill(page, n, 83);
  memcpy(want, page, n);
  CHECK_OK(B->memcpy_async(d, page, n, PM_COPY_H2D, s));
  CHECK_OK(B->memcpy_async(src, d, n, PM_COPY_D2H, s));
  CHECK_OK(B->stream_synchronize(s));
  CHECK(memcmp(src, want, n) == 0);

  /* a pinned range that runs past its end into pageable memory counts as pageable */
  if (is_host) {
    pm_test_fill(src, n, 84);
    CHECK_OK(B->launch_busy(s, 0.05));
    atomic_store(&flag, 0);
    CHECK_OK(B->launch_host_func(s, set_flag, &flag));
    size_t span = pm__align_up(n, pm__page_size());
    char *m = mmap(NULL, 2 * span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(m != MAP_FAILED);
    CHECK_OK(B->host_register(m, span, 0));
    CHECK_OK(B->memcpy_async(m + span - 10, d, 100, PM_COPY_D2H, s));
    CHECK_EQ_INT(atomic_load(&flag), 1);
    CHECK(memcmp(m + span - 10, want, 100) == 0);
    CHECK_OK(B->host_unregister(m, span));
    munmap(m, 2 * span);
  }

  CHECK_OK(B->event_destroy(before));
  CHECK_OK(B->stream_destroy(s));
  CHECK_OK(B->device_free(d));
  CHECK_OK(B->host_free(src, n));
  free(page);
  free(want);
}

static void test_pinned_async(void) {
  const size_t n = (small ? 30000 : 1 << 20) + 11;
  pm_stream_t s = new_stream();
  unsigned char *src = pinned(n), *dst = pinned(n), *d = device(n);
  pm_test_fill(src, n, 91);
  memset(dst, 0xab, n);
  pm_test_gate_t g;
  pm_test_gate_init(&g);

  /* behind a gate: the calls return, nothing has run */
  CHECK_OK(B->launch_host_func(s, pm_test_gate_wait, &g));
  CHECK_OK(B->memcpy_async(d, src, n, PM_COPY_H2D, s));
  CHECK_ST(B->stream_query(s), PM_NOT_READY);
  CHECK_OK(B->memcpy_async(dst, d, n, PM_COPY_D2H, s));
  CHECK_ST(B->stream_query(s), PM_NOT_READY);
  CHECK(dst[0] == 0xab && dst[n / 2] == 0xab && dst[n - 1] == 0xab);
  pm_test_gate_open(&g);
  CHECK_OK(B->stream_synchronize(s));
  CHECK_OK(B->stream_query(s));
  CHECK(memcmp(dst, src, n) == 0);

  /* behind a busy op, as the brief of launch_busy promises */
  pm_test_fill(src, n, 92);
  CHECK_OK(B->launch_busy(s, 0.5));
  CHECK_OK(B->memcpy_async(d, src, n, PM_COPY_H2D, s));
  CHECK_ST(B->stream_query(s), PM_NOT_READY);
  CHECK_OK(B->memcpy_async(dst, d, n, PM_COPY_D2H, s));
  CHECK_OK(B->stream_synchronize(s));
  CHECK(memcmp(dst, src, n) == 0);

  /* D2D is queued too */
  pm_test_gate_t g2;
  pm_test_gate_init(&g2);
  unsigned char *d2 = device(n);
  pm_test_fill(src, n, 93);
  CHECK_OK(B->memcpy_sync(d, src, n, PM_COPY_H2D));
  CHECK_OK(B->launch_host_func(s, pm_test_gate_wait, &g2));
  CHECK_OK(B->memcpy_async(d2, d, n, PM_COPY_D2D, s));
  CHECK_ST(B->stream_query(s), PM_NOT_READY);
  pm_test_gate_open(&g2);
  CHECK_OK(B->stream_synchronize(s));
  memset(dst, 0, n);
  CHECK_OK(B->memcpy_sync(dst, d2, n, PM_COPY_D2H));
  CHECK(memcmp(dst, src, n) == 0);

  /* Host to host is synchronous with respect to the host even between pinned buffers (as CUDA
   * documents it): the bytes are there when the call returns. */
  atomic_int flag = 0;
  memset(dst, 0xab, n);
  CHECK_OK(B->launch_busy(s, 0.1));
  CHECK_OK(B->launch_host_func(s, set_flag, &flag));
  CHECK_OK(B->memcpy_async(dst, src, n, PM_COPY_H2H, s));
  CHECK(memcmp(dst, src, n) == 0);
  if (is_host) CHECK_EQ_INT(atomic_load(&flag), 1); /* and ordered after the earlier work */
  CHECK_OK(B->stream_synchronize(s));

  CHECK_OK(B->stream_destroy(s));
  pm_test_gate_destroy(&g);
  pm_test_gate_destroy(&g2);
  CHECK_OK(B->device_free(d));
  CHECK_OK(B->device_free(d2));
  CHECK_OK(B->host_free(src, n));
  CHECK_OK(B->host_free(dst, n));
}

/* Destroying a stream runs its queued work to the end first. */
static void test_destroy_with_work(void) {
  const size_t n = (small ? 20000 : 400000) + 13;
  pm_stream_t s = new_stream();
  unsigned char *src = pinned(n), *dst = pinned(n), *d = device(n);
  pm_test_fill(src, n, 101);
  memset(dst, 0, n);
  atomic_int flag = 0;
  CHECK_OK(B->launch_busy(s, 0.2));
  CHECK_OK(B->memcpy_async(d, src, n, PM_COPY_H2D, s));
  CHECK_OK(B->memcpy_async(dst, d, n, PM_COPY_D2H, s));
  CHECK_OK(B->launch_host_func(s, set_flag, &flag));
  CHECK_OK(B->stream_destroy(s));
  CHECK_EQ_INT(atomic_load(&flag), 1);
  CHECK(memcmp(dst, src, n) == 0);
  if (is_host) {
    CHECK_ERR_MSG(B->stream_query(s), PM_ERR_INVALID);
    CHECK_MSG_HAS("destroyed");
    CHECK_ERR_MSG(B->stream_synchronize(s), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->stream_destroy(s), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->launch_busy(s, 0.01), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->memcpy_async(dst, d, n, PM_COPY_D2H, s), PM_ERR_INVALID);
    unsigned char one[1];
    CHECK_ERR_MSG(B->memcpy_async(one, d, 1, PM_COPY_D2H, s), PM_ERR_INVALID); /* pageable */
  }
  CHECK_ERR_MSG(B->stream_destroy(NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->stream_create(NULL), PM_ERR_INVALID);
  CHECK_OK(B->device_free(d));
  CHECK_OK(B->host_free(src, n));
  CHECK_OK(B->host_free(dst, n));
}

/* ---- event timing ------------------------------------------------------------------------- */

static void test_elapsed(void) {
  pm_stream_t s = new_stream();
  pm_event_t t0 = new_event(PM_EVENT_TIMING), t1 = new_event(PM_EVENT_TIMING);
  pm_event_t plain = new_event(0);
  double sec = -42.0;
  /* never recorded */
  CHECK_ERR_MSG(B->event_elapsed(t0, t1, &sec), PM_ERR_INVALID);
  pm_test_gate_t g;
  pm_test_gate_init(&g);
  CHECK_OK(B->event_record(t0, s));
  CHECK_OK(B->launch_host_func(s, pm_test_gate_wait, &g));
  CHECK_OK(B->launch_busy(s, 0.01));
  CHECK_OK(B->event_record(t1, s));
  /* recorded, not complete: an error, and no time is written */
  CHECK_ERR_MSG(B->event_elapsed(t0, t1, &sec), PM_ERR_STATE);
  CHECK(sec == -42.0);
  pm_test_gate_open(&g);
  CHECK_OK(B->event_synchronize(t1));
  CHECK_OK(B->event_elapsed(t0, t1, &sec));
  CHECK(sec >= 0.0 && isfinite(sec));
  double back = 1.0;
  CHECK_OK(B->event_elapsed(t1, t0, &back));
  CHECK(back <= 0.0);
  /* an event without PM_EVENT_TIMING, even complete */
  CHECK_OK(B->event_record(plain, s));
  CHECK_OK(B->event_synchronize(plain));
  sec = -42.0;
  CHECK_ERR_MSG(B->event_elapsed(t0, plain, &sec), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->event_elapsed(plain, t1, &sec), PM_ERR_INVALID);
  CHECK(sec == -42.0);
  CHECK_ERR_MSG(B->event_elapsed(t0, t1, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->event_elapsed(NULL, t1, &sec), PM_ERR_INVALID);
  CHECK_OK(B->event_destroy(t0));
  CHECK_OK(B->event_destroy(t1));
  CHECK_OK(B->event_destroy(plain));
  CHECK_OK(B->stream_destroy(s));
  pm_test_gate_destroy(&g);
}

/* ---- copy validation and direction inference ---------------------------------------------- */

static void test_copy_checks(void) {
  const size_t n = 4099;
  unsigned char *h = pinned(n), *h2 = pinned(n), *d = device(n), *d2 = device(n);
  pm_test_fill(h, n, 111);

  /* PM_COPY_DEFAULT infers all four directions */
  CHECK_OK(B->memcpy_sync(d, h, n, PM_COPY_DEFAULT));
  CHECK_OK(B->memcpy_sync(d2, d, n, PM_COPY_DEFAULT));
  CHECK_OK(B->memcpy_sync(h2, d2, n, PM_COPY_DEFAULT));
  CHECK(memcmp(h2, h, n) == 0);
  unsigned char *p = malloc(n);
  REQUIRE(p);
  CHECK_OK(B->memcpy_sync(p, h2, n, PM_COPY_DEFAULT));
  CHECK(memcmp(p, h, n) == 0);
  CHECK_OK(B->memcpy_async(p + 1, d + 3, 1, PM_COPY_DEFAULT, NULL)); /* 1 byte, unaligned */
  CHECK(p[1] == h[3]);
  CHECK_OK(B->memcpy_async(NULL, NULL, 0, PM_COPY_H2D, NULL)); /* 0 bytes: nothing to do */
  CHECK_OK(B->memcpy_sync(NULL, NULL, 0, PM_COPY_D2H));

  CHECK_ERR_MSG(B->memcpy_async(d, h, n, (pm_copy_kind_t)99, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->memcpy_sync(d, h, n, (pm_copy_kind_t)-1), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->memcpy_async(NULL, h, n, PM_COPY_H2D, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->memcpy_async(d, NULL, n, PM_COPY_H2D, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->launch_busy(NULL, -1.0), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->launch_busy(NULL, NAN), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->launch_busy(NULL, 1e7), PM_ERR_INVALID);

  if (is_host) {
    /* a kind that contradicts the pointers */
    CHECK_ERR_MSG(B->memcpy_async(h2, h, n, PM_COPY_H2D, NULL), PM_ERR_INVALID);
    CHECK_MSG_HAS("not device memory");
    CHECK_ERR_MSG(B->memcpy_async(h2, h, n, PM_COPY_D2H, NULL), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->memcpy_async(d, h, n, PM_COPY_D2D, NULL), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->memcpy_async(d, h, n, PM_COPY_H2H, NULL), PM_ERR_INVALID);
    CHECK_MSG_HAS("is device memory");
    CHECK_ERR_MSG(B->memcpy_async(h, d, n, PM_COPY_H2D, NULL), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->memcpy_sync(p, d, n, PM_COPY_H2H), PM_ERR_INVALID);
    /* device spans that run past their allocation */
    CHECK_ERR_MSG(B->memcpy_async(d + n - 10, h, 20, PM_COPY_H2D, NULL), PM_ERR_INVALID);
    CHECK_MSG_HAS("past the end");
    CHECK_ERR_MSG(B->memcpy_async(h, d + 5, n, PM_COPY_D2H, NULL), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->memcpy_async(d, d2 + 1, n, PM_COPY_DEFAULT, NULL), PM_ERR_INVALID);
    CHECK_ERR_MSG(B->memcpy_sync(p, d + 1, n, PM_COPY_DEFAULT), PM_ERR_INVALID);
    /* nothing of that reached the memory */
    CHECK_OK(B->memcpy_sync(h2, d, n, PM_COPY_D2H));
    CHECK(memcmp(h2, h, n) == 0);
  }
  free(p);
  CHECK_OK(B->device_free(d));
  CHECK_OK(B->device_free(d2));
  CHECK_OK(B->host_free(h, n));
  CHECK_OK(B->host_free(h2, n));
}

static void test_devices(void) {
  int count = 0, dev = -1;
  CHECK_OK(B->device_count(&count));
  CHECK(count >= 1);
  CHECK_OK(B->get_device(&dev));
  CHECK(dev >= 0 && dev < count);
  CHECK_OK(B->set_device(dev));
  pm_device_info_t info;
  CHECK_OK(B->device_info(dev, &info));
  CHECK(info.total_memory > 0 && info.free_memory <= info.total_memory);
  CHECK(info.name[0] != '\0');
  CHECK_ERR_MSG(B->device_info(count, &info), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->set_device(count), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->set_device(-1), PM_ERR_INVALID);
  if (!is_host) return;
  CHECK_EQ_INT(count, 1);
  CHECK(strcmp(info.name, "host (CPU plays the device)") == 0);
  CHECK_EQ_INT(info.cc_major, 0);
  CHECK_EQ_INT(info.async_engines, 2);
  CHECK_EQ_INT(info.pcie_gen, -1);
  CHECK_EQ_INT(info.numa_node, -1);
  CHECK_EQ_INT(info.can_map_host_memory, 1);
  CHECK_EQ_INT(info.unified_addressing, 1);
  CHECK_EQ_INT(info.managed_memory, 1);
  CHECK_EQ_INT(info.concurrent_managed_access, 1);
  CHECK_EQ_INT(info.host_register_supported, 1);
  CHECK_EQ_INT(info.host_register_read_only, 1);
  CHECK_EQ_INT(info.pageable_memory_access, 0);
  CHECK_ERR_MSG(B->device_count(NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(B->device_info(0, NULL), PM_ERR_INVALID);
}

/* device_synchronize waits for the work queued on every stream, the default one included. */
static void test_device_synchronize(void) {
  enum { S = 3 };
  const size_t n = (small ? 8192 : 262144) + 1;
  pm_stream_t s[S];
  unsigned char *src = pinned(S * n), *dst = pinned(S * n), *d = device(S * n);
  atomic_int flags[S + 1];
  pm_test_fill(src, S * n, 121);
  memset(dst, 0, S * n);
  for (int i = 0; i < S; i++) {
    s[i] = new_stream();
    atomic_init(&flags[i], 0);
    CHECK_OK(B->launch_busy(s[i], 0.05 * (i + 1)));
    CHECK_OK(B->memcpy_async(d + i * n, src + i * n, n, PM_COPY_H2D, s[i]));
    CHECK_OK(B->memcpy_async(dst + i * n, d + i * n, n, PM_COPY_D2H, s[i]));
    CHECK_OK(B->launch_host_func(s[i], set_flag, &flags[i]));
  }
  atomic_init(&flags[S], 0);
  CHECK_OK(B->launch_busy(NULL, 0.05));
  CHECK_OK(B->launch_host_func(NULL, set_flag, &flags[S]));
  CHECK_OK(B->device_synchronize());
  for (int i = 0; i <= S; i++) CHECK_EQ_INT(atomic_load(&flags[i]), 1);
  for (int i = 0; i < S; i++) CHECK_OK(B->stream_query(s[i]));
  CHECK_OK(B->stream_query(NULL));
  CHECK(memcmp(dst, src, S * n) == 0);
  for (int i = 0; i < S; i++) CHECK_OK(B->stream_destroy(s[i]));
  CHECK_OK(B->device_free(d));
  CHECK_OK(B->host_free(src, S * n));
  CHECK_OK(B->host_free(dst, S * n));
}

/* ---- many threads on many streams ---------------------------------------------------------- */

enum { ST_STREAMS = 4, ST_THREADS = 4 };

typedef struct st_arg {
  int id;
  pm_stream_t *streams;
  int iters;
  size_t max;
  int failures; /* counted here: check.h's counters are not for threads */
  int mismatches;
  int copies;
} st_arg_t;

static void *stress_thread(void *p) {
  st_arg_t *a = p;
  const size_t slack = 64;
  size_t cap = a->max + slack;
  unsigned char *src = NULL, *dst = NULL, *d = NULL;
  unsigned char *page = malloc(cap);
  pm_event_t ev = NULL;
  if (!page || B->host_alloc(cap, 0, (void **)&src) != PM_OK ||
      B->host_alloc(cap, 0, (void **)&dst) != PM_OK ||
      B->device_alloc(2 * cap, (void **)&d) != PM_OK || B->event_create(0, &ev) != PM_OK) {
    a->failures++;
    return NULL;
  }
  uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(a->id + 1);
  for (int it = 0; it < a->iters; it++) {
    uint64_t r = pm_test_rand(&x);
    int si = (int)(r % (ST_STREAMS + 1));
    pm_stream_t s = si == ST_STREAMS ? NULL : a->streams[si]; /* the default stream too */
    size_t bytes = 1 + (size_t)(pm_test_rand(&x) % a->max);
    size_t os = pm_test_rand(&x) % slack, od = pm_test_rand(&x) % slack,
           oh = pm_test_rand(&x) % slack;
    int mode = (int)(pm_test_rand(&x) % 4);
    uint64_t seed = ((uint64_t)a->id << 32) | (uint64_t)it;
    pm_test_fill(src + os, bytes, seed);
    pm_status_t st = B->memcpy_async(d + od, src + os, bytes, PM_COPY_H2D, s);
    const unsigned char *out = NULL;
    if (st == PM_OK) switch (mode) {
        case 0: /* pinned D2H, then the stream */
          st = B->memcpy_async(dst + oh, d + od, bytes, PM_COPY_D2H, s);
          if (st == PM_OK) st = B->stream_synchronize(s);
          out = dst + oh;
          break;
        case 1: /* pageable D2H: blocks until the bytes are there */
          st = B->memcpy_async(page + oh, d + od, bytes, PM_COPY_D2H, s);
          out = page + oh;
          break;
        case 2: /* D2D into the other half, pinned D2H, then an event */
          st = B->memcpy_async(d + cap + oh, d + od, bytes, PM_COPY_D2D, s);
          if (st == PM_OK) st = B->memcpy_async(dst + oh, d + cap + oh, bytes, PM_COPY_D2H, s);
          if (st == PM_OK) st = B->event_record(ev, s);
          if (st == PM_OK) st = B->event_synchronize(ev);
          out = dst + oh;
          break;
        default: /* the synchronous copy (default stream: wait for s first, streams are
                  * independent of each other) */
          st = B->stream_synchronize(s);
          if (st == PM_OK) st = B->memcpy_sync(dst + oh, d + od, bytes, PM_COPY_D2H);
          out = dst + oh;
          break;
      }
    if (st != PM_OK) {
      a->failures++;
      fprintf(stderr, "stress thread %d iteration %d: %s: %s\n", a->id, it, pm_status_name(st),
              pm_last_error());
      break;
    }
    if (memcmp(out, src + os, bytes) != 0) a->mismatches++;
    a->copies++;
  }
  if (B->event_destroy(ev) != PM_OK) a->failures++;
  if (B->device_free(d) != PM_OK) a->failures++;
  if (B->host_free(src, cap) != PM_OK) a->failures++;
  if (B->host_free(dst, cap) != PM_OK) a->failures++;
  free(page);
  return NULL;
}

static void test_stress(void) {
  pm_stream_t streams[ST_STREAMS];
  for (int i = 0; i < ST_STREAMS; i++) streams[i] = new_stream();
  pthread_t th[ST_THREADS];
  st_arg_t args[ST_THREADS];
  for (int t = 0; t < ST_THREADS; t++) {
    args[t] = (st_arg_t){t, streams, small ? 30 : 300, small ? 4096 : 65536, 0, 0, 0};
    REQUIRE(pthread_create(&th[t], NULL, stress_thread, &args[t]) == 0);
  }
  int copies = 0;
  for (int t = 0; t < ST_THREADS; t++) {
    pthread_join(th[t], NULL);
    CHECK_EQ_INT(args[t].failures, 0);
    CHECK_EQ_INT(args[t].mismatches, 0);
    CHECK_EQ_INT(args[t].copies, args[t].iters);
    copies += args[t].copies;
  }
  for (int i = 0; i < ST_STREAMS; i++) CHECK_OK(B->stream_destroy(streams[i]));
  printf("stress: %d verified round trips on %d streams + default from %d threads\n", copies,
         ST_STREAMS, ST_THREADS);
}

int main(void) {
  small = pm_test_small();
  test_memlock_limit(); /* forks: before any thread exists */
  pm_test_init();
  B = pm__backend();
  REQUIRE(B != NULL);
  is_host = B->kind == PM_BACKEND_HOST;
  if (is_host) REQUIRE_OK(B->init()); /* idempotent: pm_init started it already */

  test_devices();
  test_host_alloc();
  test_register();
  test_device_memory();
  test_device_limit();
  test_managed();
  test_in_order();
  test_cross_stream();
  test_event_query();
  test_host_func_order();
  test_pageable_blocks();
  test_pinned_async();
  test_destroy_with_work();
  test_elapsed();
  test_copy_checks();
  test_device_synchronize();
  test_stress();

  CHECK_OK(pm_finalize());
  return pm_test_finish("test_backend");
}
