/*
 * How the backend is chosen, on machines whose NVIDIA driver is missing, too old, incomplete or
 * shows no device: stand-in driver libraries (stub_cuda.c, built beside this test) are loaded
 * through PINMEM_CUDA_DRIVER, each case in a child process of its own (the driver is probed once
 * per process). Auto must fall back to the host backend with the right reason, never crash;
 * device and managed memory must then be refused, saying why and naming PINMEM_BACKEND=host;
 * PINMEM_BACKEND=cuda must fail pm_init with the reason; PINMEM_BACKEND=host must simulate
 * devices as ever. Needs no GPU: it runs the same everywhere.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "internal.h"

#define CHECK_HAS(str, sub)                                                                \
  do {                                                                                     \
    pm_test_checks++;                                                                      \
    if (!strstr((str), (sub)))                                                             \
      PM_TEST_FAIL_AT(__FILE__, __LINE__, "\"%s\" does not contain \"%s\"", (str), (sub)); \
  } while (0)

#if defined(PINMEM_HAVE_CUDA)
static char stub_path[512];
static const char *stub(const char *variant) {
  snprintf(stub_path, sizeof stub_path, "%s/libstub_cuda_%s.so", PINMEM_STUB_DIR, variant);
  return stub_path;
}
#endif

/* Run fn in a forked child; the child's failed checks make its exit status non-zero. */
static int forked(void (*fn)(void)) {
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) {
    pm_test_failures = 0; /* the child's own: an earlier failed case does not fail it */
    fn();
    fflush(stdout);
    _exit(pm_test_failures ? 1 : 0);
  }
  int status = 0;
  CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
  return status;
}

/* Each case in a child of its own (fresh probe). */
static void in_child(const char *name, void (*fn)(void)) {
  int status = forked(fn);
  pm_test_checks++;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    PM_TEST_FAIL_AT(__FILE__, __LINE__, "case %s: child %s %d", name,
                    WIFEXITED(status) ? "exited with" : "died of signal",
                    WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
  else
    printf("  %s: ok\n", name);
}

/* Auto fell back: host backend, the reason, and device memory refused with it. */
static void expect_fallback(const char *reason_part, int driver_version) {
  CHECK_ST(pm_init(), PM_OK);
  CHECK_EQ_INT(pm_backend_kind(), PM_BACKEND_HOST);
  pm_backend_info_t bi;
  CHECK_ST(pm_backend_info(&bi), PM_OK);
  CHECK_EQ_INT(bi.kind, PM_BACKEND_HOST);
  CHECK_EQ_INT(bi.requested, PM_BACKEND_NONE);
  CHECK_EQ_INT(bi.fallback, 1);
  CHECK_EQ_INT(bi.driver_version, driver_version);
  CHECK_HAS(bi.reason, "auto: ");
  CHECK_HAS(bi.reason, reason_part);
#if defined(PINMEM_HAVE_CUDA)
  CHECK_EQ_INT(bi.cuda_compiled, 1);
#else
  CHECK_EQ_INT(bi.cuda_compiled, 0);
#endif
  /* The simulated devices are not on offer: none counted, none to ask about or make current. */
  int n = -1;
  CHECK_ST(pm_device_count(&n), PM_OK);
  CHECK_EQ_INT(n, 0);
  pm_device_info_t di;
  CHECK_ST(pm_device_get_info(0, &di), PM_ERR_NO_DEVICE);
  CHECK_HAS(pm_last_error(), reason_part);
  CHECK_ST(pm_device_set(0), PM_ERR_NO_DEVICE);
  CHECK_HAS(pm_last_error(), reason_part);
  void *d = NULL;
  CHECK_ST(pm_device_alloc(4096, &d), PM_ERR_NO_DEVICE);
  CHECK(d == NULL);
  CHECK_HAS(pm_last_error(), reason_part);
  CHECK_HAS(pm_last_error(), "PINMEM_BACKEND=host");
  CHECK_ST(pm_managed_alloc(4096, &d), PM_ERR_NO_DEVICE);
  CHECK_HAS(pm_last_error(), reason_part);
  /* Mapped pinned memory promises a device address (kernels read it there): no device maps it. */
  void *h = NULL;
  CHECK_ST(pm_host_alloc(NULL, 4096, PM_HOST_MAPPED, &h), PM_ERR_NO_DEVICE);
  CHECK(h == NULL);
  CHECK_HAS(pm_last_error(), reason_part);
  CHECK_HAS(pm_last_error(), "mapped pinned memory");
  static char page[8192] __attribute__((aligned(4096)));
  CHECK_ST(pm_register(page, 4096, PM_REGISTER_MAPPED), PM_ERR_NO_DEVICE);
  CHECK_HAS(pm_last_error(), reason_part);
  CHECK_ST(pm_register(page, 4096, 0), PM_OK); /* the failed attempt left nothing behind */
  CHECK_ST(pm_unregister(page), PM_OK);
  /* Pinned host memory is no device memory: it still works, and copies between host buffers. */
  CHECK_ST(pm_host_alloc(NULL, 4097, 0, &h), PM_OK);
  if (h) {
    char src[4097];
    pm_test_fill(src, sizeof src, 31);
    CHECK_ST(pm_memcpy(h, src, sizeof src, PM_COPY_H2H), PM_OK);
    CHECK(pm_test_fill_ok(h, sizeof src, 31));
    CHECK_ST(pm_host_free(h), PM_OK);
  }
  CHECK_ST(pm_finalize(), PM_OK);
}

#if defined(PINMEM_HAVE_CUDA)
static void case_missing(void) {
  setenv("PINMEM_CUDA_DRIVER", "/nonexistent/libcuda.so.1", 1);
  expect_fallback("no NVIDIA driver found (/nonexistent/libcuda.so.1", 0);
}
/* Option device names a CUDA device (a launcher sets it per rank): the fallback has none to make
 * current, and serves every rank alike instead of failing pm_init past the host's device 0. */
static void case_missing_device_option(void) {
  setenv("PINMEM_CUDA_DRIVER", "/nonexistent/libcuda.so.1", 1);
  setenv("PINMEM_DEVICE", "1", 1);
  expect_fallback("no NVIDIA driver found (/nonexistent/libcuda.so.1", 0);
}
/* A value of PINMEM_BACKEND that is no backend leaves auto in force, and the reason says so. */
static void case_missing_junk_backend(void) {
  setenv("PINMEM_CUDA_DRIVER", "/nonexistent/libcuda.so.1", 1);
  setenv("PINMEM_BACKEND", "gpu", 1);
  expect_fallback("PINMEM_BACKEND='gpu' ignored: not auto, cuda or host; no NVIDIA driver found",
                  0);
}
static void case_nodevice(void) {
  setenv("PINMEM_CUDA_DRIVER", stub("nodevice"), 1);
  expect_fallback(
      "NVIDIA driver found (version 12.4) but no device: cuInit: no CUDA-capable "
      "device is detected (CUDA_ERROR_NO_DEVICE)",
      12040);
}
static void case_zerodevices(void) {
  setenv("PINMEM_CUDA_DRIVER", stub("zerodevices"), 1);
  setenv("CUDA_VISIBLE_DEVICES", "", 1);
  expect_fallback("NVIDIA driver found (version 12.2) but no device (CUDA_VISIBLE_DEVICES=)",
                  12020);
}
static void case_old(void) {
  setenv("PINMEM_CUDA_DRIVER", stub("old"), 1);
  expect_fallback("NVIDIA driver too old (version 11.8, need 12.0", 11080);
}
static void case_nogpa(void) {
  setenv("PINMEM_CUDA_DRIVER", stub("nogpa"), 1);
  expect_fallback("has no cuGetProcAddress", 12000);
}
static void case_not_a_driver(void) {
  setenv("PINMEM_CUDA_DRIVER", "libc.so.6", 1);
  expect_fallback("no cuInit/cuDriverGetVersion: not the CUDA driver", 0);
}
/* A driver that refuses at start, told in words that say what to do (STUB_CUDA_FAIL makes the
 * stand-in's named calls fail with the given CUresult). */
static const struct {
  const char *name, *driver, *fail, *visible, *reason;
  int version;
} refusals[] = {
    {"the toolkit's stub library (cuDriverGetVersion fails)", "fake", "cuDriverGetVersion:34", NULL,
     "cuDriverGetVersion failed with CUresult 34: this is the CUDA toolkit's stub library", 0},
    {"driver library and kernel module of different versions", "fake", "cuInit:803", NULL,
     "cuInit failed: system has unsupported display driver / cuda driver combination "
     "(CUDA_ERROR_SYSTEM_DRIVER_MISMATCH): the driver library and the loaded nvidia kernel "
     "module differ",
     12040},
    {"cuInit answering as in a forked child", "fake", "cuInit:3", NULL,
     "(CUDA_ERROR_NOT_INITIALIZED): the driver answers so in a process forked", 12040},
    {"CUDA_VISIBLE_DEVICES=-1 (cuInit finds no device)", "nodevice", NULL, "-1",
     "(CUDA_ERROR_NO_DEVICE); CUDA_VISIBLE_DEVICES='-1' is set", 12040},
    {"cuGetProcAddress failing", "fake", "cuGetProcAddress:3", NULL,
     "cuGetProcAddress(cuGetErrorString) failed: unknown CUDA error (CUresult 3)", 12040},
    {"a required call missing", "fake", "cuMemHostRegister:-1", NULL,
     "lacks cuMemHostRegister, which CUDA 6.5 has: reinstall or update the NVIDIA driver", 12040},
};
static size_t refusal;
static void case_refusal(void) {
  setenv("PINMEM_CUDA_DRIVER", stub(refusals[refusal].driver), 1);
  if (refusals[refusal].fail) setenv("STUB_CUDA_FAIL", refusals[refusal].fail, 1);
  if (refusals[refusal].visible) setenv("CUDA_VISIBLE_DEVICES", refusals[refusal].visible, 1);
  expect_fallback(refusals[refusal].reason, refusals[refusal].version);
}

/* A pretend device (stub_cuda.c's STUB_FAKE_DEVICE): the backend's own plumbing where no GPU is:
 * the probe succeeds, contexts are made current, memory, streams and events go through the
 * driver table, and a JIT that refuses the PTX leaves the kernels unavailable with the reason
 * (batches on the DMA path) instead of failing anything else. */
static void case_fake_device(void) {
  setenv("PINMEM_CUDA_DRIVER", stub("fake"), 1);
  CHECK_ST(pm_init(), PM_OK);
  CHECK_EQ_INT(pm_backend_kind(), PM_BACKEND_CUDA);
  pm_backend_info_t bi;
  CHECK_ST(pm_backend_info(&bi), PM_OK);
  CHECK_EQ_INT(bi.fallback, 0);
  CHECK_EQ_INT(bi.device_count, 1);
  CHECK_EQ_INT(bi.driver_version, 12040);
  CHECK_HAS(bi.reason, "auto: a CUDA device is present");
  CHECK_HAS(bi.driver_missing, "cuMemcpyBatchAsync");
  pm_device_info_t di;
  CHECK_ST(pm_device_get_info(0, &di), PM_OK);
  CHECK(strcmp(di.name, "stub device") == 0);
  CHECK_EQ_INT(di.cc_major, 9);
  CHECK_EQ_SIZE(di.total_memory, (size_t)2 << 30);
  int dev = -1;
  CHECK_ST(pm_device_get(&dev), PM_OK);
  CHECK_EQ_INT(dev, 0);
  CHECK_ST(pm_device_set(1), PM_ERR_INVALID);
  void *d = NULL;
  CHECK_ST(pm_device_alloc(1000, &d), PM_OK);
  if (d) {
    char src[1000], back[1000];
    pm_test_fill(src, sizeof src, 5);
    CHECK_ST(pm_memcpy(d, src, sizeof src, PM_COPY_H2D), PM_OK);
    memset(back, 0, sizeof back);
    CHECK_ST(pm_memcpy(back, d, sizeof back, PM_COPY_D2H), PM_OK);
    CHECK(pm_test_fill_ok(back, sizeof back, 5));
    CHECK_ST(pm_device_free(d), PM_OK);
  }
  pm_stream_t s = NULL;
  pm_event_t e = NULL;
  CHECK_ST(pm_stream_create(&s), PM_OK);
  CHECK_ST(pm_event_create(PM_EVENT_DEFAULT, &e), PM_OK);
  CHECK_ST(pm_event_record(e, s), PM_OK);
  CHECK_ST(pm_event_synchronize(e), PM_OK);
  CHECK_ST(pm_stream_query(s), PM_OK);
  /* The stub's JIT refuses the PTX: kernels unavailable, with the reason, nothing else fails. */
  const pm__backend_t *b = pm__backend();
  CHECK(b != NULL);
  if (b) {
    CHECK_ST(b->launch_busy(s, 0.001), PM_ERR_UNSUPPORTED);
    CHECK_HAS(pm_last_error(), "stub JIT: no PTX here");
    CHECK_EQ_INT(b->kernel_host_access(), 0);
  }
  CHECK_ST(pm_backend_info(&bi), PM_OK);
  CHECK_HAS(bi.kernels, "cuModuleLoadDataEx");
  CHECK_HAS(bi.kernels, "CUDA_ERROR_INVALID_PTX");
  CHECK_HAS(bi.kernels, "batches go by DMA");
  CHECK_ST(pm_event_destroy(e), PM_OK);
  CHECK_ST(pm_stream_destroy(s), PM_OK);
  /* The stand-in cannot register host memory (cuMemHostRegister: CUDA_ERROR_NOT_SUPPORTED, as
   * on a platform without host registration): a request past fast_pin_min, whose segment would
   * be mmap + register, is pinned by the driver's allocator instead, twice. */
  void *big[2] = {NULL, NULL};
  for (int i = 0; i < 2; i++) {
    CHECK_ST(pm_host_alloc(NULL, (size_t)16 << 20, 0, &big[i]), PM_OK);
    if (big[i]) {
      memset(big[i], 0x5a + i, (size_t)16 << 20);
      pm_pointer_info_t pi;
      CHECK_ST(pm_pointer_query(big[i], &pi), PM_OK);
      CHECK_EQ_INT(pi.kind, PM_MEMORY_POOL);
    }
  }
  CHECK(big[0] && big[1] && ((char *)big[0])[(16 << 20) - 1] == 0x5a);
  for (int i = 0; i < 2; i++) CHECK_ST(pm_host_free(big[i]), PM_OK);
  /* Memory the caller owns has no other way to be pinned: refused, naming the call. */
  static char page[4096] __attribute__((aligned(4096)));
  CHECK_ST(pm_register(page, sizeof page, 0), PM_ERR_UNSUPPORTED);
  CHECK_HAS(pm_last_error(), "cuMemHostRegister");
  CHECK_ST(pm_finalize(), PM_OK);
}

/* A block store of four 1 KiB blocks on `device`, pinned at once (no pinning thread). */
static pm_blocks_config_t small_store(int device) {
  pm_blocks_config_t c;
  pm_blocks_config_init(&c);
  c.block_bytes = 1024;
  c.num_blocks = 4;
  c.background = 0;
  c.device = device;
  return c;
}

/* Two pretend devices (STUB_CUDA_DEVICES=2): the cuda backend tells which device a stream
 * belongs to (its context's), so a broadcast or a block-store swap whose stream is another
 * device's than its memory's is refused before anything is queued, naming both devices. */
static void case_two_devices(void) {
  setenv("PINMEM_CUDA_DRIVER", stub("fake"), 1);
  setenv("STUB_CUDA_DEVICES", "2", 1);
  setenv("STUB_CUDA_HOST_REGISTER", "1", 1); /* the block store's arena is registered */
  CHECK_ST(pm_init(), PM_OK);
  CHECK_EQ_INT(pm_backend_kind(), PM_BACKEND_CUDA);
  int n = 0;
  CHECK_ST(pm_device_count(&n), PM_OK);
  CHECK_EQ_INT(n, 2);
  void *d[2] = {NULL, NULL};
  pm_stream_t s[2] = {NULL, NULL};
  for (int i = 0; i < 2; i++) {
    CHECK_ST(pm_device_set(i), PM_OK);
    CHECK_ST(pm_device_alloc(4096, &d[i]), PM_OK);
    CHECK_ST(pm_stream_create(&s[i]), PM_OK);
  }
  CHECK_ST(pm_device_set(0), PM_OK);
  if (!d[0] || !d[1] || !s[0] || !s[1]) return;
  const pm__backend_t *b = pm__backend();
  CHECK(b && b->stream_device);
  if (b && b->stream_device) {
    CHECK_EQ_INT(b->stream_device(s[0]), 0);
    CHECK_EQ_INT(b->stream_device(s[1]), 1); /* another context than the current one */
    /* NULL and the legacy and per-thread handles: the current device's default stream. */
    CHECK_EQ_INT(b->stream_device(NULL), 0);
    CHECK_EQ_INT(b->stream_device((pm_stream_t)1), 0);
    CHECK_EQ_INT(b->stream_device((pm_stream_t)2), 0);
    CHECK_ST(pm_device_set(1), PM_OK);
    CHECK_EQ_INT(b->stream_device((pm_stream_t)2), 1);
    CHECK_EQ_INT(b->stream_device(s[0]), 0);
    CHECK_ST(pm_device_set(0), PM_OK);
    /* The query left the thread's context as it was. */
    int dev = -1;
    CHECK_ST(pm_device_get(&dev), PM_OK);
    CHECK_EQ_INT(dev, 0);
  }
  char *src = NULL;
  CHECK_ST(pm_host_alloc(NULL, 4096, 0, (void **)&src), PM_OK);
  if (!src) return;
  pm_test_fill(src, 4096, 9);
  /* Device 1's stream for device 0's memory: refused, naming both, nothing written. */
  memset(d[0], 0, 4096);
  int dev0 = 0;
  pm_fence_t f[2] = {NULL, NULL};
  CHECK_ST(pm_copy_broadcast_async(src, 4096, &d[0], &s[1], &dev0, 1, NULL, f), PM_ERR_INVALID);
  CHECK_HAS(pm_last_error(), "streams[0] is a stream of device 1, but its copy goes to device 0");
  CHECK(f[0] == NULL);
  CHECK(((char *)d[0])[0] == 0 && ((char *)d[0])[4095] == 0);
  /* Each destination's own stream, or the legacy handle (each device's default stream when its
   * copy is queued): taken. */
  int devs[2] = {0, 1};
  pm_stream_t legacy[2] = {(pm_stream_t)1, (pm_stream_t)1};
  for (int round = 0; round < 2; round++) {
    CHECK_ST(pm_copy_broadcast_async(src, 4096, d, round ? legacy : s, devs, 2, NULL, f), PM_OK);
    for (int i = 0; i < 2; i++)
      if (f[i]) {
        CHECK_ST(pm_fence_wait(f[i]), PM_OK);
        CHECK_ST(pm_fence_release(f[i]), PM_OK);
        CHECK(pm_test_fill_ok(d[i], 4096, 9));
        memset(d[i], 0, 4096);
        f[i] = NULL;
      }
  }
  int dev = -1;
  CHECK_ST(pm_device_get(&dev), PM_OK);
  CHECK_EQ_INT(dev, 0);
  /* A block store of device 0 swapping on device 1's stream: refused, naming both. */
  pm_blocks_config_t c = small_store(0);
  pm_blocks_t *store = NULL;
  CHECK_ST(pm_blocks_create(&c, &store), PM_OK);
  if (store) {
    uint64_t host = 0, devb = 1;
    CHECK_ST(pm_blocks_alloc(store, 1, &host), PM_OK);
    pm_kv_region_t r = {d[0], 1024, 1024};
    pm_kv_layout_t L = {1, &r, 4, -1};
    CHECK_ST(pm_blocks_swap_out(store, &L, &devb, &host, 1, s[1], NULL), PM_ERR_INVALID);
    CHECK_HAS(pm_last_error(), "is a stream of device 1, the store serves device 0");
    CHECK_ST(pm_blocks_swap_out(store, &L, &devb, &host, 1, s[0], NULL), PM_OK);
    CHECK_ST(pm_blocks_destroy(store), PM_OK);
  }
  CHECK_ST(pm_host_free(src), PM_OK);
  for (int i = 0; i < 2; i++) {
    CHECK_ST(pm_stream_destroy(s[i]), PM_OK);
    CHECK_ST(pm_device_free(d[i]), PM_OK);
  }
  CHECK_ST(pm_finalize(), PM_OK);
}

/* A thread that never chose a device (no current context) and calls a broadcast to device 1 or
 * a block store of device 1 is left with no current context, as it came: given device 0 back,
 * it would have gotten GPU 0's primary context (hundreds of MB there, in a rank on GPU 1). A
 * thread on device 1 keeps device 1. */
static int (*current_of_stub)(void);
static void *calls_for_device_1(void *arg) {
  void **bufs = arg; /* pinned source, device 1's buffer, device 1's stream */
  int *out = bufs[3];
  out[0] = current_of_stub(); /* a new thread: none */
  int dev1 = 1;
  pm_fence_t f = NULL;
  out[1] = pm_copy_broadcast_async(bufs[0], 4096, &bufs[1], (pm_stream_t *)&bufs[2], &dev1, 1,
                                   NULL, &f) == PM_OK && pm_fence_wait(f) == PM_OK &&
           pm_fence_release(f) == PM_OK;
  out[2] = current_of_stub();
  /* without fences_out: the call releases them, then gives none back */
  if (pm_copy_broadcast_async(bufs[0], 4096, &bufs[1], (pm_stream_t *)&bufs[2], &dev1, 1, NULL,
                              NULL) == PM_OK)
    out[9] = current_of_stub();
  pm_blocks_config_t c = small_store(1);
  pm_blocks_t *store = NULL;
  uint64_t host = 0, devb = 0;
  pm_kv_region_t r = {bufs[1], 1024, 1024};
  pm_kv_layout_t L = {1, &r, 4, -1};
  out[3] = pm_blocks_create(&c, &store) == PM_OK;
  out[4] = current_of_stub();
  if (store) {
    out[5] = pm_blocks_alloc(store, 1, &host) == PM_OK &&
             pm_blocks_swap_out(store, &L, &devb, &host, 1, (pm_stream_t)bufs[2], NULL) ==
                 PM_OK;
    out[6] = current_of_stub();
    out[7] = pm_blocks_destroy(store) == PM_OK;
    out[8] = current_of_stub();
  }
  return NULL;
}
static void case_thread_without_device(void) {
  setenv("PINMEM_CUDA_DRIVER", stub("fake"), 1);
  setenv("STUB_CUDA_DEVICES", "2", 1);
  setenv("STUB_CUDA_HOST_REGISTER", "1", 1);
  CHECK_ST(pm_init(), PM_OK);
  CHECK_EQ_INT(pm_backend_kind(), PM_BACKEND_CUDA);
  void *lib = dlopen(stub("fake"), RTLD_NOW | RTLD_NOLOAD);
  current_of_stub = lib ? (int (*)(void))(uintptr_t)dlsym(lib, "stub_current_device") : NULL;
  CHECK(current_of_stub != NULL);
  if (!current_of_stub) return;
  void *src = NULL, *d1 = NULL;
  pm_stream_t s1 = NULL;
  CHECK_ST(pm_device_set(1), PM_OK);
  CHECK_ST(pm_device_alloc(4096, &d1), PM_OK);
  CHECK_ST(pm_stream_create(&s1), PM_OK);
  CHECK_ST(pm_host_alloc(NULL, 4096, 0, &src), PM_OK);
  if (!src || !d1 || !s1) return;
  pm_test_fill(src, 4096, 5);
  int out[10];
  for (int k = 0; k < 10; k++) out[k] = -7;
  void *bufs[4] = {src, d1, s1, out};
  pthread_t t;
  CHECK(pthread_create(&t, NULL, calls_for_device_1, bufs) == 0);
  CHECK(pthread_join(t, NULL) == 0);
  CHECK_EQ_INT(out[0], -1);
  CHECK_EQ_INT(out[1], 1); /* the broadcast ran */
  CHECK(pm_test_fill_ok(d1, 4096, 5));
  CHECK_EQ_INT(out[2], -1); /* and left the thread with no context */
  CHECK_EQ_INT(out[9], -1); /* also where it released the fences itself */
  CHECK_EQ_INT(out[3], 1);  /* the store of device 1 made */
  CHECK_EQ_INT(out[4], -1);
  CHECK_EQ_INT(out[5], 1); /* an allocation and a swap */
  CHECK_EQ_INT(out[6], -1);
  CHECK_EQ_INT(out[7], 1); /* destroyed */
  CHECK_EQ_INT(out[8], -1);
  /* This thread chose device 1 and keeps it through both. */
  pm_fence_t f = NULL;
  int dev1 = 1;
  CHECK_ST(pm_copy_broadcast_async(src, 4096, &d1, &s1, &dev1, 1, NULL, &f), PM_OK);
  if (f) {
    CHECK_ST(pm_fence_wait(f), PM_OK);
    CHECK_ST(pm_fence_release(f), PM_OK);
  }
  CHECK_EQ_INT(current_of_stub(), 1);
  CHECK_ST(pm_device_set(0), PM_OK);
  pm_blocks_config_t c = small_store(1);
  pm_blocks_t *store = NULL;
  CHECK_ST(pm_blocks_create(&c, &store), PM_OK);
  CHECK_EQ_INT(current_of_stub(), 0); /* device 0's caller gets device 0 back */
  if (store) CHECK_ST(pm_blocks_destroy(store), PM_OK);
  CHECK_EQ_INT(current_of_stub(), 0);
  CHECK_ST(pm_host_free(src), PM_OK);
  CHECK_ST(pm_device_set(1), PM_OK);
  CHECK_ST(pm_stream_destroy(s1), PM_OK);
  CHECK_ST(pm_device_free(d1), PM_OK);
  CHECK_ST(pm_finalize(), PM_OK);
}

/* fn in a forked child of the case's process; its failed checks fail the case. */
static void in_fork(void (*fn)(void)) {
  int status = forked(fn);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}
static void refused_after_cuda(void) {
  CHECK_ST(pm_init(), PM_ERR_STATE);
  CHECK_HAS(pm_last_error(), "used by the parent before fork()");
  void *h = NULL;
  CHECK_ST(pm_host_alloc(NULL, 64, 0, &h), PM_ERR_STATE);
}
static void host_after_fallback(void) {
  CHECK_ST(pm_init(), PM_OK);
  CHECK_EQ_INT(pm_backend_kind(), PM_BACKEND_HOST);
  void *d = NULL;
  CHECK_ST(pm_device_alloc(64, &d), PM_ERR_NO_DEVICE);
  CHECK_HAS(pm_last_error(), "but no device (CUDA_VISIBLE_DEVICES=");
}
/* The driver stays started in a process once cuInit succeeded, pm_finalize or not: a child forked
 * after pm_finalize of the cuda backend is refused as one forked while it ran (the stand-in
 * driver answers its calls there with CUDA_ERROR_NOT_INITIALIZED, as the real one). A child of a
 * process that fell back after cuInit (no device) keeps the fallback, before and after
 * pm_finalize. */
static void case_fork_after_finalize(void) {
  setenv("PINMEM_CUDA_DRIVER", stub("fake"), 1);
  CHECK_ST(pm_init(), PM_OK);
  CHECK_EQ_INT(pm_backend_kind(), PM_BACKEND_CUDA);
  in_fork(refused_after_cuda);
  CHECK_ST(pm_finalize(), PM_OK);
  in_fork(refused_after_cuda);
  CHECK_ST(pm_init(), PM_OK); /* the parent itself starts again */
  CHECK_EQ_INT(pm_backend_kind(), PM_BACKEND_CUDA);
  CHECK_ST(pm_finalize(), PM_OK);
}
static void case_fork_after_fallback(void) {
  setenv("PINMEM_CUDA_DRIVER", stub("zerodevices"), 1);
  setenv("CUDA_VISIBLE_DEVICES", "", 1);
  CHECK_ST(pm_init(), PM_OK);
  CHECK_EQ_INT(pm_backend_kind(), PM_BACKEND_HOST);
  in_fork(host_after_fallback);
  CHECK_ST(pm_finalize(), PM_OK);
  in_fork(host_after_fallback);
}

/* Threads that start pinmem at once, each asking at once for what a process asks first: one
 * probe, one backend, the same answer for all (TSan checks the publication). */
static void *first_calls(void *arg) {
  int *ok = arg;
  pm_backend_info_t bi;
  void *d = NULL, *h = NULL;
  *ok = pm_backend_info(&bi) == PM_OK && bi.kind == PM_BACKEND_CUDA && bi.device_count == 1 &&
        pm_device_alloc(256, &d) == PM_OK && pm_host_alloc(NULL, 256, 0, &h) == PM_OK &&
        pm_device_free(d) == PM_OK && pm_host_free(h) == PM_OK;
  return NULL;
}
static void case_threads_start(void) {
  setenv("PINMEM_CUDA_DRIVER", stub("fake"), 1);
  enum { N = 4 };
  pthread_t t[N];
  int ok[N] = {0};
  for (int i = 0; i < N; i++) CHECK(pthread_create(&t[i], NULL, first_calls, &ok[i]) == 0);
  for (int i = 0; i < N; i++) {
    CHECK(pthread_join(t[i], NULL) == 0);
    CHECK(ok[i]);
  }
  CHECK_ST(pm_finalize(), PM_OK);
  /* and again, after pm_finalize: the driver stays loaded, the backend starts anew */
  for (int i = 0; i < N; i++) CHECK(pthread_create(&t[i], NULL, first_calls, &ok[i]) == 0);
  for (int i = 0; i < N; i++) {
    CHECK(pthread_join(t[i], NULL) == 0);
    CHECK(ok[i]);
  }
  CHECK_ST(pm_finalize(), PM_OK);
}

/* A child forked while a thread of the parent creates a context (pinmem's context lock held, as
 * during a context's creation or the kernels' JIT) asks which backend it has: it is told
 * (PM_ERR_STATE's reason, the driver's version), and neither calls the driver nor waits for that
 * lock, which no thread of the child will ever release. */
static void *first_device_alloc(void *arg) {
  void *d = NULL;
  *(pm_status_t *)arg = pm_device_alloc(64, &d);
  if (d) pm_device_free(d);
  return NULL;
}
static void child_asks_backend(void) {
  alarm(30); /* waiting for the parent's lock would never end: a signal fails the case */
  pm_backend_info_t bi;
  CHECK_ST(pm_backend_info(&bi), PM_OK);
  CHECK_EQ_INT(bi.kind, PM_BACKEND_NONE);
  CHECK_HAS(bi.reason, "used by the parent before fork()");
  CHECK_EQ_INT(bi.driver_version, 12040);
}
static void case_fork_during_context(void) {
  setenv("PINMEM_CUDA_DRIVER", stub("fake"), 1);
  setenv("STUB_CUDA_HOLD_RETAIN", "1", 1);
  CHECK_ST(pm_init(), PM_OK); /* loads the stand-in; no context yet (option device not given) */
  void *lib = dlopen(stub("fake"), RTLD_NOW | RTLD_NOLOAD);
  _Atomic int *entered = lib ? dlsym(lib, "stub_retain_entered") : NULL;
  _Atomic int *release = lib ? dlsym(lib, "stub_retain_release") : NULL;
  CHECK(entered && release);
  if (!entered || !release) return;
  pthread_t t;
  pm_status_t st = PM_ERR_INTERNAL;
  CHECK(pthread_create(&t, NULL, first_device_alloc, &st) == 0);
  while (!*entered) sched_yield(); /* the thread is inside the context creation */
  in_fork(child_asks_backend);
  *release = 1;
  CHECK(pthread_join(t, NULL) == 0);
  CHECK_ST(st, PM_OK);
  CHECK_ST(pm_finalize(), PM_OK);
}

/* Asked for by name, cuda that cannot start fails pm_init, with the same reason. */
static void case_cuda_asked(void) {
  setenv("PINMEM_CUDA_DRIVER", stub("nodevice"), 1);
  setenv("PINMEM_BACKEND", "cuda", 1);
  CHECK_ST(pm_init(), PM_ERR_NO_DEVICE);
  CHECK_HAS(pm_last_error(), "backend 'cuda' was asked for");
  CHECK_HAS(pm_last_error(), "CUDA_ERROR_NO_DEVICE");
  pm_backend_info_t bi;
  CHECK_ST(pm_backend_info(&bi), PM_OK);
  CHECK_EQ_INT(bi.kind, PM_BACKEND_NONE);
  CHECK_EQ_INT(bi.requested, PM_BACKEND_CUDA);
  CHECK_EQ_INT(bi.fallback, 0);
  CHECK_HAS(bi.reason, "CUDA_ERROR_NO_DEVICE");
  void *d = NULL;
  CHECK_ST(pm_device_alloc(64, &d), PM_ERR_NO_DEVICE);
}
#endif

/* Chosen on purpose, the host backend simulates devices whatever the driver. */
static void case_host_asked(void) {
#if defined(PINMEM_HAVE_CUDA)
  setenv("PINMEM_CUDA_DRIVER", "/nonexistent/libcuda.so.1", 1);
#endif
  setenv("PINMEM_BACKEND", "host", 1);
  CHECK_ST(pm_init(), PM_OK);
  pm_backend_info_t bi;
  CHECK_ST(pm_backend_info(&bi), PM_OK);
  CHECK_EQ_INT(bi.kind, PM_BACKEND_HOST);
  CHECK_EQ_INT(bi.requested, PM_BACKEND_HOST);
  CHECK_EQ_INT(bi.fallback, 0);
  CHECK(bi.device_count >= 1);
  void *d = NULL;
  CHECK_ST(pm_device_alloc(4096, &d), PM_OK);
  if (d) {
    char src[100], back[100];
    pm_test_fill(src, sizeof src, 7);
    CHECK_ST(pm_memcpy(d, src, sizeof src, PM_COPY_H2D), PM_OK);
    CHECK_ST(pm_memcpy(back, d, sizeof back, PM_COPY_D2H), PM_OK);
    CHECK(pm_test_fill_ok(back, sizeof back, 7));
    CHECK_ST(pm_device_free(d), PM_OK);
  }
  CHECK_ST(pm_finalize(), PM_OK);
}

#if !defined(PINMEM_HAVE_CUDA)
static void case_compiled_out(void) {
  expect_fallback("built without the cuda backend", 0);
}
#endif

int main(void) {
  /* Every case sets what it needs; nothing of the caller's environment leaks in. */
  unsetenv("PINMEM_BACKEND");
  unsetenv("PINMEM_DEVICE");
  unsetenv("STUB_CUDA_FAIL");
  unsetenv("CUDA_VISIBLE_DEVICES");
  unsetenv("STUB_CUDA_DEVICES");
  unsetenv("STUB_CUDA_HOST_REGISTER");
#if defined(PINMEM_HAVE_CUDA)
  in_child("no driver library", case_missing);
  in_child("no driver library, PINMEM_DEVICE=1", case_missing_device_option);
  in_child("no driver library, PINMEM_BACKEND=gpu", case_missing_junk_backend);
  in_child("driver without a device (cuInit fails)", case_nodevice);
  in_child("driver showing no device", case_zerodevices);
  in_child("driver too old", case_old);
  in_child("driver without cuGetProcAddress", case_nogpa);
  in_child("a library that is not the driver", case_not_a_driver);
  in_child("PINMEM_BACKEND=cuda without a usable driver", case_cuda_asked);
  for (refusal = 0; refusal < sizeof refusals / sizeof refusals[0]; refusal++)
    in_child(refusals[refusal].name, case_refusal);
  in_child("a pretend device", case_fake_device);
  in_child("two pretend devices: streams of each", case_two_devices);
  in_child("a thread with no device keeps none", case_thread_without_device);
  in_child("threads starting pinmem at once", case_threads_start);
  in_child("fork after pm_finalize of the cuda backend", case_fork_after_finalize);
  in_child("fork while a context is being made", case_fork_during_context);
  in_child("fork after a fallback that started the driver", case_fork_after_fallback);
#else
  in_child("cuda backend compiled out", case_compiled_out);
#endif
  in_child("PINMEM_BACKEND=host", case_host_asked);
  return pm_test_finish("test_driver");
}
