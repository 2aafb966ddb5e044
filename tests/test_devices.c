/*
 * Several devices: on the host backend with simulated devices (option host_devices), every
 * piece of work a thread does for device 1 (a staged pageable copy, a pinned copy, a staged D2H
 * copy with its completion thread, pm_file_read_async into device memory, a loader, the
 * participants of pm__parallel_for) makes its backend calls on device 1 alone, and breaks none of
 * CUDA's multi-device rules, as the backend's per-device call records show; pm_init leaves the
 * thread's device alone unless option device is given; one pinned buffer feeds copies to two
 * devices; per-device memory limits; the records themselves catch what they must (a kernel on
 * another device's stream, an event recorded on another device's stream, a copy queued on the
 * wrong device's stream); a KV block store of device 1 swaps on device 1 whatever the calling
 * thread's device, and refuses another device's KV memory. On the cuda backend the portable-memory
 * test runs where two GPUs are; with fewer it is skipped, saying so.
 */
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <unistd.h>

#include "check.h"
#include "internal.h" /* pm__hb_device_*, pm__parallel_for */

static bool g_host; /* host backend: the call records exist */

/* ---- the call records ---- */

static void records_reset(void) {
  /* Events of earlier work are destroyed by the reaper once complete, a few ms later and on
   * their own device: that must not land among the calls counted from here on. */
  CHECK(pm__copy_quiesce(10000));
  pm__hb_device_counters_reset();
}

/* Work done for `dev` (while device 0 did nothing) made calls on `dev` and none elsewhere, and
 * broke no rule. */
#define CHECK_ONLY_ON(dev, what)                                                          \
  do {                                                                                    \
    char note_[256];                                                                      \
    pm__hb_last_mismatch(note_, sizeof note_);                                            \
    for (int d_ = 0; d_ < 3; d_++) {                                                      \
      if (d_ == (dev)) continue;                                                          \
      if (pm__hb_device_calls(d_) != 0)                                                   \
        fprintf(stderr, "%s: %llu calls on device %d\n", what,                            \
                (unsigned long long)pm__hb_device_calls(d_), d_);                         \
      CHECK_EQ_SIZE(pm__hb_device_calls(d_), 0);                                          \
    }                                                                                     \
    CHECK(pm__hb_device_calls(dev) > 0);                                                  \
    if (pm__hb_device_mismatches(-1)) fprintf(stderr, "%s: mismatch: %s\n", what, note_); \
    CHECK_EQ_SIZE(pm__hb_device_mismatches(-1), 0);                                       \
  } while (0)

/* Run fn on a new thread that first makes `device` current (the caller stays idle). */
typedef struct {
  int device;
  void (*fn)(void);
} on_thread_t;

static void *on_thread_main(void *arg) {
  on_thread_t *t = arg;
  CHECK_OK(pm_device_set(t->device));
  t->fn();
  return NULL;
}

static void run_on_device(int device, void (*fn)(void)) {
  on_thread_t t = {device, fn};
  pthread_t th;
  REQUIRE(pthread_create(&th, NULL, on_thread_main, &t) == 0);
  pthread_join(th, NULL);
}

/* ---- the work, each done by a thread of device 1 ---- */

#define BIG ((size_t)3 * 1024 * 1024 + 333) /* many 64 KiB chunks: every staging thread works */

static void staged_h2d(void) {
  char *src = malloc(BIG), *back = malloc(BIG);
  void *dev = NULL;
  pm_stream_t s = NULL;
  REQUIRE(src && back);
  pm_test_fill(src, BIG, 11);
  CHECK_OK(pm_stream_create(&s));
  CHECK_OK(pm_device_alloc(BIG, &dev));
  pm_copy_options_t o;
  pm_copy_options_init(&o);
  o.path = PM_PATH_STAGED;
  pm_fence_t f = NULL;
  CHECK_OK(pm_copy_async(dev, src, BIG, s, &o, &f));
  CHECK_OK(pm_fence_wait(f));
  pm_copy_path_t path = PM_PATH_AUTO;
  CHECK_OK(pm_fence_path(f, &path));
  CHECK_EQ_INT(path, PM_PATH_STAGED);
  CHECK_OK(pm_fence_release(f));
  CHECK_OK(pm_memcpy(back, dev, BIG, PM_COPY_D2H));
  CHECK(pm_test_fill_ok(back, BIG, 11));
  CHECK_OK(pm_device_free(dev));
  CHECK_OK(pm_stream_destroy(s));
  free(src);
  free(back);
}

static void pinned_h2d(void) {
  void *src = NULL, *dev = NULL;
  char *back = malloc(BIG);
  pm_stream_t s = NULL;
  REQUIRE(back);
  CHECK_OK(pm_host_alloc(NULL, BIG, 0, &src));
  pm_test_fill(src, BIG, 12);
  CHECK_OK(pm_stream_create(&s));
  CHECK_OK(pm_device_alloc(BIG, &dev));
  pm_fence_t f = NULL;
  CHECK_OK(pm_copy_async(dev, src, BIG, s, NULL, &f));
  CHECK_OK(pm_fence_wait(f));
  pm_copy_path_t path = PM_PATH_AUTO;
  CHECK_OK(pm_fence_path(f, &path));
  CHECK_EQ_INT(path, PM_PATH_DIRECT);
  CHECK_OK(pm_fence_release(f));
  CHECK_OK(pm_memcpy(back, dev, BIG, PM_COPY_D2H));
  CHECK(pm_test_fill_ok(back, BIG, 12));
  CHECK_OK(pm_device_free(dev));
  CHECK_OK(pm_host_free(src));
  CHECK_OK(pm_stream_destroy(s));
  free(back);
}

static atomic_int g_cb_device = -2; /* the current device inside a copy's callback */

static void record_cb_device(void *arg, pm_status_t status) {
  (void)arg;
  int d = -1;
  if (status == PM_OK && pm_device_get(&d) == PM_OK) atomic_store(&g_cb_device, d);
}

static void staged_d2h(void) {
  char *src = malloc(BIG), *dst = malloc(BIG);
  void *dev = NULL;
  pm_stream_t s = NULL;
  REQUIRE(src && dst);
  pm_test_fill(src, BIG, 13);
  memset(dst, 0, BIG);
  CHECK_OK(pm_stream_create(&s));
  CHECK_OK(pm_device_alloc(BIG, &dev));
  CHECK_OK(pm_memcpy(dev, src, BIG, PM_COPY_H2D));
  /* Queued behind a busy stream, the copy-out runs on a completion thread. */
  CHECK_OK(pm_launch_busy(s, 0.02));
  pm_copy_options_t o;
  pm_copy_options_init(&o);
  o.path = PM_PATH_STAGED;
  o.callback = record_cb_device;
  atomic_store(&g_cb_device, -2);
  pm_fence_t f = NULL;
  CHECK_OK(pm_copy_async(dst, dev, BIG, s, &o, &f));
  CHECK_OK(pm_fence_wait(f));
  CHECK_OK(pm_fence_release(f));
  CHECK(pm_test_fill_ok(dst, BIG, 13));
  CHECK_OK(pm_stream_synchronize(s));
  CHECK_OK(pm_device_free(dev));
  CHECK_OK(pm_stream_destroy(s));
  free(src);
  free(dst);
}

static char g_file[600];

static void file_read_device(void) {
  const size_t n = BIG;
  char *want = malloc(n), *back = malloc(n);
  REQUIRE(want && back);
  pm_test_fill(want, n, 14);
  int fd = open(g_file, O_RDWR | O_CREAT | O_TRUNC, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(pwrite(fd, want, n, 0) == (ssize_t)n);
  void *dev = NULL;
  pm_stream_t s = NULL;
  CHECK_OK(pm_stream_create(&s));
  CHECK_OK(pm_device_alloc(n, &dev));
  pm_file_options_t o;
  pm_file_options_init(&o);
  o.io = PM_FILE_IO_BUFFERED;
  o.chunk = 64 * 1024;
  o.threads = 4;
  pm_fence_t f = NULL;
  CHECK_OK(pm_file_read_async(fd, 0, n, dev, s, &o, &f));
  CHECK_OK(pm_fence_wait(f));
  CHECK_OK(pm_fence_release(f));
  CHECK_OK(pm_memcpy(back, dev, n, PM_COPY_D2H));
  CHECK(memcmp(back, want, n) == 0);
  CHECK_OK(pm_device_free(dev));
  CHECK_OK(pm_stream_destroy(s));
  close(fd);
  unlink(g_file);
  free(want);
  free(back);
}

#define LD_SAMPLES 96
#define LD_BYTES 4100

static int ld_read(uint64_t index, void *dst, void *user) {
  (void)user;
  pm_test_fill(dst, LD_BYTES, 1000 + index);
  return 0;
}

static void loader_device(void) {
  pm_dataset_callbacks_t cb;
  memset(&cb, 0, sizeof cb);
  cb.samples = LD_SAMPLES;
  cb.sample_bytes = LD_BYTES;
  cb.read = ld_read;
  pm_dataset_t *ds = NULL;
  REQUIRE(pm_dataset_create(&cb, &ds) == PM_OK);
  pm_loader_config_t c;
  pm_loader_config_init(&c);
  c.batch_size = 8;
  c.workers = 3;
  c.shuffle = 1;
  c.rank = 0;
  c.world_size = 1;
  pm_loader_t *ld = NULL;
  REQUIRE(pm_loader_create(ds, &c, &ld) == PM_OK);
  pm_stream_t s = NULL;
  CHECK_OK(pm_stream_create(&s));
  char *back = malloc(8 * LD_BYTES);
  REQUIRE(back);
  int seen[LD_SAMPLES] = {0};
  pm_batch_t b;
  size_t batches = 0;
  while (pm_loader_next(ld, &b) == PM_OK) {
    CHECK_OK(pm_batch_wait_stream(&b, s));
    CHECK_OK(pm_memcpy_async(back, b.inputs, b.inputs_bytes, PM_COPY_D2H, s));
    CHECK_OK(pm_stream_synchronize(s));
    /* Which sample each row is: the fill's seed is found by trying (96 candidates). */
    for (size_t r = 0; r < b.samples; r++) {
      int found = -1;
      for (int i = 0; i < LD_SAMPLES && found < 0; i++)
        if (pm_test_fill_ok(back + r * LD_BYTES, LD_BYTES, 1000 + (uint64_t)i)) found = i;
      CHECK(found >= 0);
      if (found >= 0) seen[found]++;
    }
    CHECK_OK(pm_batch_release(&b, s));
    batches++;
  }
  CHECK_EQ_SIZE(batches, LD_SAMPLES / 8);
  for (int i = 0; i < LD_SAMPLES; i++) CHECK_EQ_INT(seen[i], 1);
  CHECK_OK(pm_loader_destroy(ld));
  CHECK_OK(pm_dataset_destroy(ds));
  CHECK_OK(pm_stream_destroy(s));
  free(back);
}

/* pm__parallel_for's participants work on the caller's device. Item 0 waits (up to 10 s) until
 * an item ran on another thread, so a helper surely took part. */
#define PF_ITEMS 16
typedef struct {
  int device[PF_ITEMS];
  pthread_t thread[PF_ITEMS];
  atomic_int others;
  pthread_t caller;
} pf_ctx_t;

static void pf_item(void *ctx, size_t i) {
  pf_ctx_t *c = ctx;
  c->thread[i] = pthread_self();
  if (!pthread_equal(pthread_self(), c->caller)) atomic_fetch_add(&c->others, 1);
  if (pm_device_get(&c->device[i]) != PM_OK) c->device[i] = -1;
  if (i == 0)
    for (int k = 0; k < 10000 && atomic_load(&c->others) == 0; k++) pm_test_sleep_ms(1);
}

static void parallel_for_device(void) {
  static pf_ctx_t c;
  memset(&c, 0, sizeof c);
  c.caller = pthread_self();
  pm__parallel_for(4, PF_ITEMS, pf_item, &c);
  CHECK(atomic_load(&c.others) > 0);
  for (int i = 0; i < PF_ITEMS; i++) CHECK_EQ_INT(c.device[i], 1);
  /* The helpers go back to the pool; a job of device 2 moves them there. */
  CHECK_OK(pm_device_set(2));
  memset(&c, 0, sizeof c);
  c.caller = pthread_self();
  pm__parallel_for(4, PF_ITEMS, pf_item, &c);
  for (int i = 0; i < PF_ITEMS; i++) CHECK_EQ_INT(c.device[i], 2);
  CHECK_OK(pm_device_set(1));
}

/* Ranks as threads: rank r of 3 on device r, each its own loader (device delivery) over one
 * dataset; every sample exactly once per epoch across ranks (48 samples), shuffled. Ranks 1 and
 * 2 run together while device 0 idles, then rank 0 alone (its rank and world from RANK and
 * WORLD_SIZE, as torchrun sets them): the records show each rank's work on its own device. */
#define RK_SAMPLES 48
static int g_rank_seen[3][2][RK_SAMPLES]; /* [rank][epoch][sample] */

/* The check macros count in globals: a rank thread counts its own failures instead, and the
 * main thread checks the counts after the join. */
static int g_rank_fail[3];
#define RK_CHECK(cond)                                                                   \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      fprintf(stderr, "%s:%d: rank %d: FAIL: %s: %s\n", __FILE__, __LINE__, rank, #cond, \
              pm_last_error());                                                          \
      g_rank_fail[rank]++;                                                               \
    }                                                                                    \
  } while (0)
#define RK_OK(expr) RK_CHECK((expr) == PM_OK)

static void *rank_main(void *arg) {
  int rank = (int)(intptr_t)arg;
  RK_OK(pm_device_set(rank));
  pm_dataset_callbacks_t cb;
  memset(&cb, 0, sizeof cb);
  cb.samples = RK_SAMPLES;
  cb.sample_bytes = LD_BYTES;
  cb.read = ld_read;
  pm_dataset_t *ds = NULL;
  if (pm_dataset_create(&cb, &ds) != PM_OK) {
    g_rank_fail[rank]++;
    return NULL;
  }
  pm_loader_config_t c;
  pm_loader_config_init(&c);
  c.batch_size = 4;
  c.workers = 2;
  c.shuffle = 1;
  c.seed = 99;
  c.epochs = 2;
  if (rank != 0) { /* rank 0 takes both from the environment */
    c.rank = rank;
    c.world_size = 3;
  }
  pm_loader_t *ld = NULL;
  if (pm_loader_create(ds, &c, &ld) != PM_OK) {
    g_rank_fail[rank]++;
    pm_dataset_destroy(ds);
    return NULL;
  }
  pm_stream_t s = NULL;
  RK_OK(pm_stream_create(&s));
  char *back = malloc(4 * LD_BYTES);
  if (!back) abort();
  pm_batch_t b;
  while (pm_loader_next(ld, &b) == PM_OK) {
    RK_OK(pm_batch_wait_stream(&b, s));
    RK_OK(pm_memcpy_async(back, b.inputs, b.inputs_bytes, PM_COPY_D2H, s));
    RK_OK(pm_stream_synchronize(s));
    for (size_t r = 0; r < b.samples; r++) {
      int found = -1;
      for (int i = 0; i < RK_SAMPLES && found < 0; i++)
        if (pm_test_fill_ok(back + r * LD_BYTES, LD_BYTES, 1000 + (uint64_t)i)) found = i;
      RK_CHECK(found >= 0 && b.epoch < 2);
      if (found >= 0 && b.epoch < 2) g_rank_seen[rank][b.epoch][found]++;
    }
    RK_OK(pm_batch_release(&b, s));
  }
  RK_OK(pm_loader_destroy(ld));
  RK_OK(pm_dataset_destroy(ds));
  RK_OK(pm_stream_destroy(s));
  free(back);
  return NULL;
}

static void settle(int device) {
  CHECK_OK(pm_device_set(device));
  CHECK_OK(pm_device_synchronize());
  CHECK_OK(pm_device_set(0));
}

static void test_ranks_on_their_devices(void) {
  memset(g_rank_seen, 0, sizeof g_rank_seen);
  memset(g_rank_fail, 0, sizeof g_rank_fail);
  records_reset();
  pthread_t th[3];
  for (int r = 1; r < 3; r++)
    REQUIRE(pthread_create(&th[r], NULL, rank_main, (void *)(intptr_t)r) == 0);
  for (int r = 1; r < 3; r++) pthread_join(th[r], NULL);
  settle(1);
  settle(2);
  CHECK_EQ_SIZE(pm__hb_device_calls(0), 0);
  CHECK(pm__hb_device_calls(1) > 0 && pm__hb_device_calls(2) > 0);
  CHECK_EQ_SIZE(pm__hb_device_mismatches(-1), 0);

  records_reset();
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "3", 1);
  REQUIRE(pthread_create(&th[0], NULL, rank_main, (void *)(intptr_t)0) == 0);
  pthread_join(th[0], NULL);
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  settle(0);
  CHECK(pm__hb_device_calls(0) > 0);
  CHECK_EQ_SIZE(pm__hb_device_calls(1), 0);
  CHECK_EQ_SIZE(pm__hb_device_calls(2), 0);
  CHECK_EQ_SIZE(pm__hb_device_mismatches(-1), 0);

  for (int r = 0; r < 3; r++) CHECK_EQ_INT(g_rank_fail[r], 0);
  for (int e = 0; e < 2; e++)
    for (int i = 0; i < RK_SAMPLES; i++) {
      int total = 0;
      for (int r = 0; r < 3; r++) total += g_rank_seen[r][e][i];
      CHECK_EQ_INT(total, 1);
    }
  /* Each rank had its share, and shuffling gave each a different one per epoch. */
  for (int r = 0; r < 3; r++) {
    int n0 = 0;
    bool same = true;
    for (int i = 0; i < RK_SAMPLES; i++) {
      n0 += g_rank_seen[r][0][i];
      same = same && g_rank_seen[r][0][i] == g_rank_seen[r][1][i];
    }
    CHECK_EQ_INT(n0, RK_SAMPLES / 3);
    CHECK(!same);
  }
  printf("ranks: 3 loaders on devices 0, 1, 2: every sample once per epoch, each on its device\n");
}

static void test_work_on_device1(void) {
  static const struct {
    const char *name;
    void (*fn)(void);
  } cases[] = {{"staged H2D", staged_h2d}, {"pinned H2D", pinned_h2d},
               {"staged D2H", staged_d2h}, {"file read", file_read_device},
               {"loader", loader_device},  {"parallel_for", parallel_for_device}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    records_reset();
    run_on_device(1, cases[k].fn);
    /* Completion and reaper threads may still finish up: nothing of theirs may land on 0. */
    CHECK_OK(pm_device_set(1));
    CHECK_OK(pm_device_synchronize());
    CHECK_OK(pm_device_set(0));
    if (cases[k].fn == parallel_for_device) {
      /* parallel_for's items make no counted calls; only the device switches matter. */
      CHECK_EQ_SIZE(pm__hb_device_calls(0), 0);
      CHECK_EQ_SIZE(pm__hb_device_mismatches(-1), 0);
    } else {
      CHECK_ONLY_ON(1, cases[k].name);
    }
    printf("device 1: %s: %llu calls on device 1, %llu on device 0\n", cases[k].name,
           (unsigned long long)pm__hb_device_calls(1), (unsigned long long)pm__hb_device_calls(0));
  }
  CHECK_EQ_INT(atomic_load(&g_cb_device), 1); /* the D2H callback ran on device 1 */
}

/* ---- pm_init and the thread's device ---- */

static void test_init_keeps_device(void) {
  /* The thread's device survives pm_finalize (it is the thread's, as in CUDA); pm_init without
   * option device keeps it and makes no call on any device. */
  CHECK_OK(pm_device_set(1));
  CHECK_OK(pm_finalize());
  records_reset();
  CHECK_OK(pm_init());
  int d = -1;
  CHECK_OK(pm_device_get(&d));
  CHECK_EQ_INT(d, 1);
  for (int k = 0; k < 3; k++) CHECK_EQ_SIZE(pm__hb_device_calls(k), 0);

  /* Option device given: pm_init makes it current. */
  CHECK_OK(pm_finalize());
  CHECK_OK(pm_option_set("device", "2"));
  CHECK_OK(pm_init());
  CHECK_OK(pm_device_get(&d));
  CHECK_EQ_INT(d, 2);
  CHECK_OK(pm_finalize());
  CHECK_OK(pm_option_set("device", NULL));
  CHECK_OK(pm_init());
  CHECK_OK(pm_device_get(&d));
  CHECK_EQ_INT(d, 2); /* still the thread's */
  CHECK_OK(pm_device_set(0));
}

/* ---- the devices themselves ---- */

static void test_devices_basics(void) {
  int n = 0;
  CHECK_OK(pm_device_count(&n));
  CHECK_EQ_INT(n, 3);
  CHECK_ERR_MSG(pm_device_set(3), PM_ERR_INVALID);
  pm_device_info_t a, b;
  CHECK_OK(pm_device_get_info(0, &a));
  CHECK_OK(pm_device_get_info(2, &b));
  CHECK_EQ_INT(b.index, 2);
  CHECK(strcmp(a.name, b.name) != 0);
  CHECK(b.pci_bus_id[0] == '\0');

  /* Each device has its own memory limit (host_device_memory = 1M here). */
  void *p0 = NULL, *p1 = NULL, *extra = NULL;
  CHECK_OK(pm_device_set(0));
  CHECK_OK(pm_device_alloc(1 << 20, &p0));
  CHECK_OK(pm_device_get_info(0, &a));
  CHECK_EQ_SIZE(a.free_memory, 0);
  CHECK_OK(pm_device_set(1));
  CHECK_OK(pm_device_get_info(1, &b));
  CHECK_EQ_SIZE(b.free_memory, 1 << 20);
  CHECK_OK(pm_device_alloc(1 << 20, &p1));
  CHECK_ERR_MSG(pm_device_alloc(256, &extra), PM_ERR_DEVICE_MEMORY);
  CHECK(strstr(pm_last_error(), "device 1") != NULL);
  CHECK_OK(pm_device_free(p0)); /* memory of device 0, freed from device 1: as cudaFree */
  CHECK_OK(pm_device_set(0));
  CHECK_OK(pm_device_get_info(0, &a));
  CHECK_EQ_SIZE(a.free_memory, 1 << 20);
  CHECK_OK(pm_device_free(p1));
}

static void *get_device_main(void *arg) {
  int *out = arg;
  if (pm_device_get(out) != PM_OK) *out = -1;
  return NULL;
}

static void test_new_thread_device0(void) {
  CHECK_OK(pm_device_set(2));
  int seen = -1;
  pthread_t th;
  REQUIRE(pthread_create(&th, NULL, get_device_main, &seen) == 0);
  pthread_join(th, NULL);
  CHECK_EQ_INT(seen, 0);
  CHECK_OK(pm_device_set(0));
}

/* The records catch the rule breaks they are there for. */
static void test_records_catch(void) {
  pm_stream_t s0 = NULL, s1 = NULL;
  pm_event_t e0 = NULL;
  void *d1 = NULL;
  CHECK_OK(pm_device_set(1));
  CHECK_OK(pm_stream_create(&s1));
  CHECK_OK(pm_device_alloc(4096, &d1));
  CHECK_OK(pm_device_set(0));
  CHECK_OK(pm_stream_create(&s0));
  CHECK_OK(pm_event_create(PM_EVENT_DEFAULT, &e0));

  records_reset();
  CHECK_OK(pm_launch_busy(s1, 0)); /* a kernel on device 1's stream, device 0 current */
  CHECK_EQ_SIZE(pm__hb_device_mismatches(0), 1);
  CHECK_OK(pm_event_record(e0, s1)); /* event of device 0 on a stream of device 1 */
  CHECK_EQ_SIZE(pm__hb_device_mismatches(0), 2);
  char note[256];
  pm__hb_last_mismatch(note, sizeof note);
  CHECK(strstr(note, "event_record") != NULL);
  CHECK_OK(pm_device_memset_async(d1, 7, 4096, s0)); /* device 1's memory on device 0's stream */
  CHECK_EQ_SIZE(pm__hb_device_mismatches(0), 3);
  /* Allowed across devices: querying or waiting for an event, a stream waiting on an event. */
  CHECK_OK(pm_event_synchronize(e0));
  CHECK_OK(pm_stream_wait_event(s1, e0));
  CHECK_OK(pm_stream_synchronize(s1));
  CHECK_EQ_SIZE(pm__hb_device_mismatches(-1), 3);
  CHECK(pm__hb_device_calls(0) > 0);
  CHECK_EQ_SIZE(pm__hb_device_calls(1), 0);

  CHECK_OK(pm_stream_synchronize(s0));
  CHECK_OK(pm_event_destroy(e0));
  CHECK_OK(pm_stream_destroy(s0));
  CHECK_OK(pm_device_set(1));
  CHECK_OK(pm_stream_destroy(s1));
  CHECK_OK(pm_device_free(d1));
  CHECK_OK(pm_device_set(0));
  records_reset();
}

/* ---- broadcast: one host buffer to three devices ---- */

/* A host function that holds its stream until a memcpy fault was injected, or until the test
 * lets it go (*arg), whichever comes first. */
static void hold_until_fault(void *arg) {
  atomic_bool *let_go = arg;
  for (;;) {
    pm__fault_counts_t fc;
    pm__fault_counts(&fc);
    if (fc.injected[PM__FAULT_MEMCPY] || atomic_load(let_go)) return;
    sched_yield();
  }
}

static void bcast_setup(pm_stream_t *s, void **dev, size_t n) {
  for (int d = 0; d < 3; d++) {
    CHECK_OK(pm_device_set(d));
    CHECK_OK(pm_stream_create(&s[d]));
    CHECK_OK(pm_device_alloc(n, &dev[d]));
    CHECK_OK(pm_device_memset_async(dev[d], 0, n, s[d]));
    CHECK_OK(pm_stream_synchronize(s[d]));
  }
  CHECK_OK(pm_device_set(0));
}

static void bcast_check_and_free(pm_stream_t *s, void **dev, size_t n, uint64_t seed) {
  char *back = malloc(n);
  REQUIRE(back);
  for (int d = 0; d < 3; d++) {
    CHECK_OK(pm_device_set(d));
    memset(back, 0, n);
    CHECK_OK(pm_memcpy(back, dev[d], n, PM_COPY_D2H));
    if (seed) CHECK(pm_test_fill_ok(back, n, seed));
    CHECK_OK(pm_device_free(dev[d]));
    CHECK_OK(pm_stream_destroy(s[d]));
  }
  CHECK_OK(pm_device_set(0));
  free(back);
}

static void test_broadcast(void) {
  const int devs[3] = {0, 1, 2};
  const size_t sizes[] = {1, 4097, (size_t)1 << 20, ((size_t)1 << 20) * 3 + 17};
  for (size_t z = 0; z < sizeof sizes / sizeof sizes[0]; z++) {
    for (int pinned = 0; pinned < 2; pinned++) {
      size_t n = sizes[z];
      pm_stream_t s[3];
      void *dev[3];
      bcast_setup(s, dev, n);
      void *src = NULL;
      char *pageable = NULL;
      if (pinned) {
        CHECK_OK(pm_host_alloc(NULL, n, 0, &src));
      } else {
        pageable = malloc(n + 1);
        REQUIRE(pageable);
        src = pageable + 1; /* unaligned */
      }
      pm_test_fill(src, n, 31 + z);
      records_reset();
      CHECK_OK(pm_device_set(2)); /* the caller's device comes back afterwards */
      pm_fence_t f[3] = {NULL, NULL, NULL};
      CHECK_OK(pm_copy_broadcast_async(src, n, dev, s, devs, 3, NULL, f));
      int d = -1;
      CHECK_OK(pm_device_get(&d));
      CHECK_EQ_INT(d, 2);
      for (int i = 0; i < 3; i++) {
        CHECK(f[i] != NULL);
        CHECK_OK(pm_fence_wait(f[i]));
        pm_copy_path_t path = PM_PATH_AUTO;
        CHECK_OK(pm_fence_path(f[i], &path));
        CHECK_EQ_INT(path, pinned ? PM_PATH_DIRECT : PM_PATH_STAGED);
        CHECK_OK(pm_fence_release(f[i]));
      }
      /* Every device did its own part, and nothing broke CUDA's rules. */
      for (int k = 0; k < 3; k++) CHECK(pm__hb_device_calls(k) > 0);
      char note[256];
      pm__hb_last_mismatch(note, sizeof note);
      if (pm__hb_device_mismatches(-1)) fprintf(stderr, "broadcast: %s\n", note);
      CHECK_EQ_SIZE(pm__hb_device_mismatches(-1), 0);
      CHECK_OK(pm_device_set(0));
      bcast_check_and_free(s, dev, n, 31 + z);
      if (pinned)
        CHECK_OK(pm_host_free(src));
      else
        free(pageable);
    }
  }
  printf("broadcast: pinned and pageable sources to devices 0, 1, 2, bytes checked\n");

  /* Errors: nothing is queued, the caller's device stays. */
  const size_t n = 300000;
  pm_stream_t s[3];
  void *dev[3];
  bcast_setup(s, dev, n);
  char *src = malloc(n);
  REQUIRE(src);
  pm_test_fill(src, n, 41);
  pm_fence_t f[3] = {NULL, NULL, NULL};
  CHECK_ERR_MSG(pm_copy_broadcast_async(NULL, n, dev, s, devs, 3, NULL, f), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_copy_broadcast_async(src, n, NULL, s, devs, 3, NULL, f), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_copy_broadcast_async(src, n, dev, s, devs, 0, NULL, f), PM_ERR_INVALID);
  const int bad_devs[3] = {0, 3, 1};
  CHECK_ERR_MSG(pm_copy_broadcast_async(src, n, dev, s, bad_devs, 3, NULL, f), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "devices[1]") != NULL);
  void *host_dst[3] = {dev[0], src, dev[2]};
  char *other = malloc(n);
  REQUIRE(other);
  host_dst[1] = other;
  CHECK_ERR_MSG(pm_copy_broadcast_async(src, n, host_dst, s, devs, 3, NULL, f), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "dsts[1]") != NULL && strstr(pm_last_error(), "not device"));
  free(other);
  /* Destinations that share bytes: two concurrent writes there, refused. */
  void *same_dst[3] = {dev[0], dev[1], (char *)dev[0] + 100};
  const int same_devs[3] = {0, 1, 0};
  pm_stream_t same_s[3] = {s[0], s[1], s[0]};
  CHECK_ERR_MSG(pm_copy_broadcast_async(src, n - 100, same_dst, same_s, same_devs, 3, NULL, f),
                PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "dsts[0] and dsts[2] overlap") != NULL);
  /* A destination of another device than its devices[i] (or, with devices NULL, than the
   * caller's): refused before anything is queued, naming both, pinned source or pageable. */
  void *pinned_src = NULL;
  CHECK_OK(pm_host_alloc(NULL, n, 0, &pinned_src));
  const int swapped[3] = {0, 2, 1};
  pm_stream_t swapped_s[3] = {s[0], s[2], s[1]}, null_s[2] = {NULL, NULL};
  for (int p = 0; p < 2; p++) {
    const void *from = p ? pinned_src : (const void *)src;
    records_reset();
    CHECK_ERR_MSG(pm_copy_broadcast_async(from, n, dev, swapped_s, swapped, 3, NULL, f),
                  PM_ERR_INVALID);
    CHECK(strstr(pm_last_error(), "dsts[1]") && strstr(pm_last_error(), "memory of device 1") &&
          strstr(pm_last_error(), "goes to device 2"));
    void *two[2] = {dev[1], dev[2]};
    CHECK_ERR_MSG(pm_copy_broadcast_async(from, n, two, null_s, NULL, 2, NULL, f), PM_ERR_INVALID);
    CHECK(strstr(pm_last_error(), "dsts[0]") && strstr(pm_last_error(), "caller's device"));
    CHECK(f[0] == NULL && f[1] == NULL && f[2] == NULL);
    CHECK_EQ_SIZE(pm__hb_device_calls(1) + pm__hb_device_calls(2), 0);
    CHECK_EQ_SIZE(pm__hb_device_mismatches(-1), 0);
    int cur = -1;
    CHECK_OK(pm_device_get(&cur));
    CHECK_EQ_INT(cur, 0);
  }
  /* A stream of another device than its destination's: refused alike (the driver would refuse
   * the event record part way, after other DMAs were queued). NULL streams are each device's
   * default stream, and work. */
  for (int p = 0; p < 2; p++) {
    const void *from = p ? pinned_src : (const void *)src;
    pm_stream_t wrong[3] = {s[0], s[2], s[1]};
    records_reset();
    CHECK_ERR_MSG(pm_copy_broadcast_async(from, n, dev, wrong, devs, 3, NULL, f), PM_ERR_INVALID);
    CHECK(strstr(pm_last_error(), "streams[1] is a stream of device 2") &&
          strstr(pm_last_error(), "goes to device 1"));
    CHECK(f[0] == NULL && f[1] == NULL && f[2] == NULL);
    CHECK_EQ_SIZE(pm__hb_device_calls(1) + pm__hb_device_calls(2), 0);
    CHECK_EQ_SIZE(pm__hb_device_mismatches(-1), 0);
    pm_stream_t defaults[3] = {NULL, NULL, NULL};
    CHECK_OK(pm_copy_broadcast_async(from, n, dev, defaults, devs, 3, NULL, f));
    for (int i = 0; i < 3; i++) {
      CHECK_OK(pm_fence_wait(f[i]));
      CHECK_OK(pm_fence_release(f[i]));
      f[i] = NULL;
    }
    CHECK_EQ_SIZE(pm__hb_device_mismatches(-1), 0);
  }
  CHECK_OK(pm_host_free(pinned_src));
  pm_copy_options_t o;
  pm_copy_options_init(&o);
  o.callback = record_cb_device;
  CHECK_ERR_MSG(pm_copy_broadcast_async(src, n, dev, s, devs, 3, &o, f), PM_ERR_INVALID);
  CHECK(f[0] == NULL && f[1] == NULL && f[2] == NULL);

  /* A DMA that fails part way (the fifth of the call's copies): an error, no fence, every
   * queued DMA waited for; the next broadcast works. */
  CHECK_OK(pm_option_set("copy_chunk", "64K"));
  CHECK_OK(pm__fault_set(PM__FAULT_MEMCPY, 5, 0));
  CHECK_ERR_MSG(pm_copy_broadcast_async(src, n, dev, s, devs, 3, NULL, f), PM_ERR_BACKEND);
  CHECK(strstr(pm_last_error(), "pm_copy_broadcast_async") != NULL);
  CHECK(f[0] == NULL && f[1] == NULL && f[2] == NULL);
  pm__fault_reset();
  for (int d = 0; d < 3; d++) CHECK_OK(pm_stream_query(s[d]));

  /* The same with a pinned source (one DMA per destination): destination 0's DMA, held on its
   * stream until destination 1's fails, is complete when the error returns (src may then be
   * freed or refilled). */
  void *pinned = NULL;
  CHECK_OK(pm_host_alloc(NULL, n, 0, &pinned));
  pm_test_fill(pinned, n, 43);
  atomic_bool let_go = false;
  CHECK_OK(pm_launch_host_func(s[0], hold_until_fault, &let_go));
  CHECK_OK(pm__fault_set(PM__FAULT_MEMCPY, 2, 0));
  CHECK_ERR_MSG(pm_copy_broadcast_async(pinned, n, dev, s, devs, 3, NULL, f), PM_ERR_BACKEND);
  CHECK(strstr(pm_last_error(), "destination 1") != NULL);
  CHECK_OK(pm_stream_query(s[0]));
  atomic_store(&let_go, true);
  CHECK_OK(pm_stream_synchronize(s[0])); /* so that a failure above does not fail the rest */
  CHECK(f[0] == NULL && f[1] == NULL && f[2] == NULL);
  pm__fault_reset();
  int cur = -1;
  CHECK_OK(pm_device_get(&cur));
  CHECK_EQ_INT(cur, 0);
  {
    char *back = malloc(n);
    REQUIRE(back);
    CHECK_OK(pm_memcpy(back, dev[0], n, PM_COPY_D2H));
    CHECK(pm_test_fill_ok(back, n, 43));
    free(back);
  }
  CHECK_OK(pm_host_free(pinned));
  CHECK_OK(pm_copy_broadcast_async(src, n, dev, s, devs, 3, NULL, NULL));
  for (int d = 0; d < 3; d++) {
    CHECK_OK(pm_device_set(d));
    CHECK_OK(pm_stream_synchronize(s[d]));
  }
  CHECK_OK(pm_device_set(0));
  bcast_check_and_free(s, dev, n, 41);
  free(src);
}

/* ---- portable pinned memory: one buffer, two devices ---- */

static void test_portable_two_devices(void) {
  const size_t n = 1000003;
  void *src = NULL;
  CHECK_OK(pm_host_alloc(NULL, n, 0, &src)); /* allocated while device 0 is current */
  pm_test_fill(src, n, 21);
  pm_stream_t s[2] = {NULL, NULL};
  void *dev[2] = {NULL, NULL};
  pm_fence_t f[2] = {NULL, NULL};
  if (g_host) records_reset();
  for (int d = 0; d < 2; d++) {
    CHECK_OK(pm_device_set(d));
    CHECK_OK(pm_stream_create(&s[d]));
    CHECK_OK(pm_device_alloc(n, &dev[d]));
    CHECK_OK(pm_copy_async(dev[d], src, n, s[d], NULL, &f[d]));
    pm_copy_path_t path = PM_PATH_AUTO;
    CHECK_OK(pm_fence_wait(f[d]));
    CHECK_OK(pm_fence_path(f[d], &path));
    CHECK_EQ_INT(path, PM_PATH_DIRECT); /* a DMA from the pinned buffer on each device */
  }
  char *back = malloc(n);
  REQUIRE(back);
  for (int d = 0; d < 2; d++) {
    CHECK_OK(pm_device_set(d));
    memset(back, 0, n);
    CHECK_OK(pm_memcpy(back, dev[d], n, PM_COPY_D2H));
    CHECK(pm_test_fill_ok(back, n, 21));
    CHECK_OK(pm_fence_release(f[d]));
    CHECK_OK(pm_device_free(dev[d]));
    CHECK_OK(pm_stream_destroy(s[d]));
  }
  if (g_host) CHECK_EQ_SIZE(pm__hb_device_mismatches(-1), 0);
  CHECK_OK(pm_device_set(0));
  CHECK_OK(pm_host_free(src));
  free(back);
  printf("portable: one pinned buffer copied to devices 0 and 1, bytes checked\n");
}

/* ---- the KV block store of device 1, called from a thread on device 0 ---- */

/* A store of `device` with `num` blocks of `bb` bytes and `n` of them allocated into host. */
static pm_blocks_t *blocks_make(int device, size_t bb, uint64_t num, uint64_t *host, size_t n) {
  pm_blocks_config_t c;
  pm_blocks_config_init(&c);
  c.block_bytes = bb;
  c.num_blocks = num;
  c.device = device;
  pm_blocks_t *store = NULL;
  CHECK_OK(pm_blocks_create(&c, &store));
  REQUIRE(store);
  CHECK_OK(pm_blocks_alloc(store, n, host));
  return store;
}

static void blocks_case(const char *cut) {
  const size_t bb = 4096;
  const uint64_t nd = 8;
  CHECK_OK(pm_option_set("blocks_kernel_max", cut));
  /* Everything of device 1 made with device 1 current, as a rank's setup does. */
  CHECK_OK(pm_device_set(1));
  void *kv = NULL;
  pm_stream_t s1 = NULL;
  CHECK_OK(pm_device_alloc(bb * nd, &kv));
  CHECK_OK(pm_stream_create(&s1));
  char *pat = malloc(bb * nd), *back = malloc(bb * nd);
  REQUIRE(pat && back);
  pm_test_fill(pat, bb * nd, 31);
  CHECK_OK(pm_memcpy(kv, pat, bb * nd, PM_COPY_H2D));
  uint64_t host[4];
  pm_blocks_t *store = blocks_make(1, bb, 16, host, 4);
  pm_kv_region_t r = {kv, bb, bb};
  pm_kv_layout_t L = {1, &r, nd, -1};
  uint64_t out_ids[4] = {6, 1, 4, 3}, in_ids[4] = {0, 2, 5, 7};

  /* The thread is on device 0 now: the swaps, their event and the calibration (auto) are still
   * device 1's, and the thread is back on device 0 after each call. */
  CHECK_OK(pm_device_set(0));
  records_reset();
  pm_event_t ev = NULL;
  CHECK_OK(pm_blocks_swap_out(store, &L, out_ids, host, 4, s1, &ev));
  CHECK_OK(pm_blocks_swap_in(store, &L, in_ids, host, 4, s1, NULL));
  pm_blocks_stats_t st;
  CHECK_OK(pm_blocks_get_stats(store, &st));
  int cur = -1;
  CHECK_OK(pm_device_get(&cur));
  CHECK_EQ_INT(cur, 0);
  CHECK_OK(pm_device_set(1)); /* the caller's own calls on the event and stream, on device 1 */
  CHECK_OK(pm_event_synchronize(ev));
  CHECK_OK(pm_event_destroy(ev));
  CHECK_OK(pm_stream_synchronize(s1));
  CHECK_OK(pm_device_set(0));
  CHECK_ONLY_ON(1, cut);
  CHECK_OK(pm_device_set(1));
  CHECK_OK(pm_memcpy(back, kv, bb * nd, PM_COPY_D2H));
  for (int i = 0; i < 4; i++) /* device block in_ids[i] now holds what out_ids[i] held */
    CHECK(memcmp(back + in_ids[i] * bb, pat + out_ids[i] * bb, bb) == 0);
  CHECK(memcmp(back + 1 * bb, pat + 1 * bb, bb) == 0); /* untouched blocks kept */
  CHECK_OK(pm_blocks_destroy(store));
  CHECK_OK(pm_stream_destroy(s1));
  CHECK_OK(pm_device_free(kv));
  CHECK_OK(pm_device_set(0));
  free(pat);
  free(back);
}

/* KV memory of `bytes` and a stream, both device 1's, made with device 1 current (left so). */
static void *kv_of_device1(size_t bytes, pm_stream_t *s1) {
  CHECK_OK(pm_device_set(1));
  void *kv = NULL;
  CHECK_OK(pm_device_alloc(bytes, &kv));
  CHECK_OK(pm_stream_create(s1));
  return kv;
}

/* Release them on device 1 and go back to device 0. */
static void kv_of_device1_free(void *kv, pm_stream_t s1) {
  CHECK_OK(pm_device_set(1));
  CHECK_OK(pm_stream_destroy(s1));
  CHECK_OK(pm_device_free(kv));
  CHECK_OK(pm_device_set(0));
}

/* The store learns which swaps completed (event queries) in free, the stats and alloc, and alloc
 * waits for them (event syncs): on the store's device too, whatever device the calling thread is
 * on. The swaps are held on their stream by a gate, so every poll finds them queued; alloc asks
 * for more blocks than are idle, and its wait lets the gate go (the opener). */
static void blocks_held_case(void) {
  const size_t bb = 4096;
  const uint64_t nd = 4;
  CHECK_OK(pm_option_set("blocks_kernel_max", "0"));
  pm_stream_t s1 = NULL;
  void *kv = kv_of_device1(bb * nd, &s1);
  uint64_t host[4];
  pm_blocks_t *store = blocks_make(1, bb, 4, host, 4);
  pm_kv_region_t r = {kv, bb, bb};
  pm_kv_layout_t L = {1, &r, nd, -1};
  uint64_t dev_ids[4] = {0, 1, 2, 3};
  pm_test_gate_t g;
  pm_test_gate_init(&g);
  CHECK_OK(pm_launch_host_func(s1, pm_test_gate_wait, &g));
  CHECK_OK(pm_blocks_swap_out(store, &L, dev_ids, host, 4, s1, NULL));

  CHECK_OK(pm_device_set(0));
  pm__fault_reset();
  REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_SYNC, 0, 0)); /* counted for the opener */
  pm_test_opener_t o;
  int ops[] = {PM__FAULT_EVENT_SYNC};
  pm_test_opener_start(&o, &g, ops, 1);
  records_reset();
  CHECK_OK(pm_blocks_free(store, host, 4)); /* polls: the swap is still queued */
  pm_blocks_stats_t st;
  CHECK_OK(pm_blocks_get_stats(store, &st)); /* polls again */
  CHECK_EQ_INT((int)st.free_blocks, 0);      /* all four wait for the swap */
  CHECK_OK(pm_blocks_alloc(store, 4, host)); /* waits for it: the opener lets it go */
  bool opened = pm_test_opener_stop(&o);
  CHECK(opened);
  if (!opened) pm_test_gate_open(&g);
  pm__fault_reset();
  int cur = -1;
  CHECK_OK(pm_device_get(&cur));
  CHECK_EQ_INT(cur, 0);
  CHECK_ONLY_ON(1, "held swaps");

  CHECK_OK(pm_device_set(1));
  CHECK_OK(pm_stream_synchronize(s1));
  pm_test_gate_destroy(&g);
  CHECK_OK(pm_blocks_destroy(store));
  kv_of_device1_free(kv, s1);
  CHECK_OK(pm_option_set("blocks_kernel_max", "auto"));
}

/* A store of device 1 made, used and destroyed by a thread on device 0 (a rank that names its
 * device in the config instead of making it current): the pinning of its arena (the first
 * chunk in the call, the others in the background), its swaps' events and the release of all
 * of it are calls on device 1, none on device 0. */
static void blocks_lifecycle_case(int background) {
  const size_t bb = 4096;
  const uint64_t nd = 4;
  CHECK_OK(pm_option_set("blocks_kernel_max", "0"));
  pm_stream_t s1 = NULL;
  void *kv = kv_of_device1(bb * nd, &s1);
  CHECK_OK(pm_device_set(0));
  records_reset();
  pm_blocks_config_t c;
  pm_blocks_config_init(&c);
  c.block_bytes = bb;
  c.num_blocks = 8;
  c.chunk_bytes = 2 * bb; /* four chunks */
  c.device = 1;
  c.background = background;
  pm_blocks_t *store = NULL;
  CHECK_OK(pm_blocks_create(&c, &store));
  REQUIRE(store);
  CHECK_OK(pm_blocks_wait_ready(store, 0));
  uint64_t host[4], dev_ids[4] = {0, 1, 2, 3};
  CHECK_OK(pm_blocks_alloc(store, 4, host));
  pm_kv_region_t r = {kv, bb, bb};
  pm_kv_layout_t L = {1, &r, nd, -1};
  CHECK_OK(pm_blocks_swap_out(store, &L, dev_ids, host, 4, s1, NULL));
  CHECK_OK(pm_blocks_free(store, host, 4));
  CHECK_OK(pm_blocks_destroy(store));
  int cur = -1;
  CHECK_OK(pm_device_get(&cur));
  CHECK_EQ_INT(cur, 0);
  CHECK_ONLY_ON(1, background ? "store made and destroyed from device 0 (background pinning)"
                              : "store made and destroyed from device 0");
  kv_of_device1_free(kv, s1);
  CHECK_OK(pm_option_set("blocks_kernel_max", "auto"));
}

static void test_blocks_on_device1(void) {
  blocks_case("1M"); /* every piece by the kernel */
  blocks_case("0");  /* every piece by DMA */
  blocks_case("auto");
  blocks_held_case();
  blocks_lifecycle_case(0);
  blocks_lifecycle_case(1);
  printf(
      "blocks: a store of device 1 swapped, freed, polled and waited for from a thread on "
      "device 0 (kernel, DMA, auto): every call on device 1\n");

  /* A store of device 0 given device 1's KV memory refuses it, whatever layout.device says,
   * before anything is queued. */
  CHECK_OK(pm_device_set(1));
  void *kv1 = NULL;
  CHECK_OK(pm_device_alloc(8192, &kv1));
  CHECK_OK(pm_device_set(0));
  pm_stream_t s0 = NULL;
  CHECK_OK(pm_stream_create(&s0));
  uint64_t host[2];
  pm_blocks_t *store = blocks_make(0, 4096, 4, host, 2);
  pm_kv_region_t r = {kv1, 4096, 4096};
  uint64_t dev[2] = {0, 1};
  static const char *const cuts[] = {"1M", "0"};
  for (int k = 0; k < 2; k++) {
    CHECK_OK(pm_option_set("blocks_kernel_max", cuts[k]));
    for (int d = -1; d <= 0; d++) {
      pm_kv_layout_t L = {1, &r, 2, d};
      records_reset();
      CHECK_ERR_MSG(pm_blocks_swap_out(store, &L, dev, host, 2, s0, NULL), PM_ERR_INVALID);
      CHECK(strstr(pm_last_error(), "is memory of device 1, the store serves device 0"));
      CHECK_ERR_MSG(pm_blocks_swap_in(store, &L, dev, host, 2, s0, NULL), PM_ERR_INVALID);
      CHECK(strstr(pm_last_error(), "is memory of device 1, the store serves device 0"));
      CHECK_EQ_SIZE(pm__hb_device_mismatches(-1), 0);
    }
  }
  CHECK_OK(pm_option_set("blocks_kernel_max", "auto"));
  CHECK_OK(pm_blocks_destroy(store));

  /* A store of device 1 given a stream of device 0 (with its own device's memory): refused
   * before anything is queued, whatever the path, event or not; the caller's device stays. */
  CHECK_OK(pm_device_set(1));
  store = blocks_make(1, 4096, 4, host, 2);
  CHECK_OK(pm_device_set(0));
  pm_kv_region_t r1 = {kv1, 4096, 4096};
  pm_kv_layout_t L1 = {1, &r1, 2, -1};
  for (int k = 0; k < 2; k++) {
    CHECK_OK(pm_option_set("blocks_kernel_max", cuts[k]));
    for (int with_event = 0; with_event < 2; with_event++) {
      pm_event_t ev = NULL;
      records_reset();
      CHECK_ERR_MSG(pm_blocks_swap_out(store, &L1, dev, host, 2, s0, with_event ? &ev : NULL),
                    PM_ERR_INVALID);
      CHECK(strstr(pm_last_error(), "is a stream of device 0, the store serves device 1"));
      CHECK_ERR_MSG(pm_blocks_swap_in(store, &L1, dev, host, 2, s0, with_event ? &ev : NULL),
                    PM_ERR_INVALID);
      CHECK(strstr(pm_last_error(), "is a stream of device 0, the store serves device 1"));
      CHECK(ev == NULL);
      CHECK_EQ_SIZE(pm__hb_device_calls(1), 0);
      CHECK_EQ_SIZE(pm__hb_device_mismatches(-1), 0);
      int cur = -1;
      CHECK_OK(pm_device_get(&cur));
      CHECK_EQ_INT(cur, 0);
    }
  }
  /* NULL is the store's device's default stream, from a thread on device 0. */
  records_reset();
  CHECK_OK(pm_blocks_swap_out(store, &L1, dev, host, 2, NULL, NULL));
  CHECK_OK(pm_device_set(1));
  CHECK_OK(pm_device_synchronize());
  CHECK_OK(pm_device_set(0));
  CHECK_EQ_SIZE(pm__hb_device_mismatches(-1), 0);
  CHECK_OK(pm_option_set("blocks_kernel_max", "auto"));
  CHECK_OK(pm_blocks_destroy(store));
  CHECK_OK(pm_stream_destroy(s0));
  CHECK_OK(pm_device_set(1));
  CHECK_OK(pm_device_free(kv1));
  CHECK_OK(pm_device_set(0));
  printf("blocks: device 1's KV memory refused by a store of device 0, naming both\n");
}

int main(void) {
  alarm(600); /* a hang fails the test instead of stalling CI */
  /* Before pm_init: three simulated devices with 1 MiB each; staging in small chunks on four
   * threads, so helpers take part in every staged copy. */
  CHECK_OK(pm_option_set("host_devices", "3"));
  CHECK_OK(pm_option_set("host_device_memory", "1M"));
  pm_test_init();
  g_host = pm_backend_kind() == PM_BACKEND_HOST;
  int n = 0;
  CHECK_OK(pm_device_count(&n));
  if (n < 2) {
    printf(
        "SKIP: these tests need 2 devices; the %s backend has %d (the host backend simulates "
        "them with host_devices)\n",
        pm_backend_name(), n);
    pm_finalize();
    return PM_TEST_SKIP;
  }
  if (!g_host) {
    test_portable_two_devices();
    pm_finalize();
    return pm_test_finish("test_devices");
  }
  CHECK_OK(pm_option_set("host_device_memory", "64M"));
  CHECK_OK(pm_option_set("copy_stage_min", "0"));
  CHECK_OK(pm_option_set("copy_chunk", "64K"));
  CHECK_OK(pm_option_set("copy_threads", "4"));
  char dir[512];
  REQUIRE(pm_test_tmpdir(dir, sizeof dir, "devices"));
  snprintf(g_file, sizeof g_file, "%s/data", dir);

  test_init_keeps_device();
  test_new_thread_device0();
  test_records_catch();
  test_portable_two_devices();
  test_broadcast();
  test_work_on_device1();
  test_ranks_on_their_devices();
  test_blocks_on_device1();
  CHECK_OK(pm_option_set("host_device_memory", "1M"));
  test_devices_basics();

  pm_test_rmtree(dir);
  CHECK_OK(pm_finalize());
  return pm_test_finish("test_devices");
}
