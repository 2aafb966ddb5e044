/*
 * A stand-in for the NVIDIA driver library (libcuda.so.1) for the driver-choice tests
 * (test_driver.c, python/tests/test_backend_choice.py), which point pinmem at it with
 * PINMEM_CUDA_DRIVER. One source, variants by macro:
 *   STUB_VERSION      what cuDriverGetVersion reports (12040 = 12.4)
 *   STUB_INIT_RESULT  what cuInit returns (0, or 100 = CUDA_ERROR_NO_DEVICE)
 *   STUB_NO_GPA       define to leave out cuGetProcAddress (both spellings)
 *   STUB_FAKE_DEVICE  define for one pretend device (below)
 * Through cuGetProcAddress it offers the error strings, cuDeviceGetCount (no device) and, for
 * every other name, a call that fails with CUDA_ERROR_NOT_SUPPORTED: a driver that loads and
 * starts but shows no device.
 *
 * STUB_CUDA_FAIL, read from the environment at each call, makes named entry points fail, so one
 * library expresses the ways a real driver refuses mid-way: "name:code,..." where the name is
 * cuInit, cuDriverGetVersion, cuGetProcAddress (every lookup then fails) or any name looked up
 * through it, and the code is the CUresult the call returns; code -1 leaves the name out of
 * cuGetProcAddress (CUDA_ERROR_NOT_FOUND, as a driver without that entry point answers).
 *
 * STUB_FAKE_DEVICE: pretend devices (one, or STUB_CUDA_DEVICES of them, at most 8) whose "device
 * memory" is malloc'd host memory, with synchronous copies and streams and events that are
 * always complete, and a JIT that refuses every PTX. It lets the cuda backend's own plumbing
 * (primary contexts, the probe, pm_backend_info, the kernels' fallback) run where there is no
 * GPU; of CUDA's semantics it keeps only what says which device a thing belongs to: a primary
 * context per device, a per-thread stack of current contexts (cuCtxSetCurrent replaces its top,
 * cuCtxPushCurrent / cuCtxPopCurrent push and pop), streams and events of the context current at
 * their creation (cuStreamGetCtx), and cuPointerGetAttributes answering the memory type and
 * device of the memory it allocated; stub_current_device() says which context a thread has.
 * STUB_CUDA_HOST_REGISTER set: cuMemHostRegister pins (else
 * it answers CUDA_ERROR_NOT_SUPPORTED, as a platform without host registration).
 */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#define STUB_API __attribute__((visibility("default")))

/* 1 and the code when STUB_CUDA_FAIL names `name`. */
static int fail_code(const char *name, int *code) {
  const char *p = getenv("STUB_CUDA_FAIL");
  size_t n = strlen(name);
  while (p && *p) {
    const char *end = strchr(p, ',');
    if (!end) end = p + strlen(p);
    const char *colon = memchr(p, ':', (size_t)(end - p));
    if (colon && (size_t)(colon - p) == n && strncmp(p, name, n) == 0) {
      *code = atoi(colon + 1);
      return 1;
    }
    p = *end ? end + 1 : end;
  }
  return 0;
}

STUB_API int cuDriverGetVersion(int *v) {
  int code = 0;
  if (fail_code("cuDriverGetVersion", &code)) return code;
  *v = STUB_VERSION;
  return 0;
}
/* The process that started the driver: as the real driver, a forked child of it gets
 * CUDA_ERROR_NOT_INITIALIZED from cuInit and cuDeviceGetCount (the stub checks those two). */
static pid_t started_pid;
static int forked_child(void) {
  return started_pid && getpid() != started_pid;
}

STUB_API int cuInit(unsigned flags) {
  (void)flags;
  int code = 0;
  if (fail_code("cuInit", &code)) return code;
  if (forked_child()) return 3;
  if (STUB_INIT_RESULT == 0) started_pid = getpid();
  return STUB_INIT_RESULT;
}

#if !defined(STUB_NO_GPA)
static const struct {
  int code;
  const char *name, *text;
} errors[] = {
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {34, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {218, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {304, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {803, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
     "system has unsupported display driver / cuda driver combination"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};
static int error_text(int e, const char **s, int name) {
  *s = name ? "CUDA_ERROR_NOT_SUPPORTED" : "stub driver: call not supported";
  for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
    if (errors[i].code == e) *s = name ? errors[i].name : errors[i].text;
  return 0;
}
static int error_string(int e, const char **s) {
  return error_text(e, s, 0);
}
static int error_name(int e, const char **s) {
  return error_text(e, s, 1);
}
/* Entry points STUB_CUDA_FAIL makes fail: each slot returns the code its name was given. */
static int failing_codes[8];
static int failing_used;
#define STUB_FAILING(i)          \
  static int failing_##i(void) { \
    return failing_codes[i];     \
  }
STUB_FAILING(0)
STUB_FAILING(1)
STUB_FAILING(2)
STUB_FAILING(3)
STUB_FAILING(4)
STUB_FAILING(5)
STUB_FAILING(6)
STUB_FAILING(7)
static int (*const failing[8])(void) = {failing_0, failing_1, failing_2, failing_3,
                                        failing_4, failing_5, failing_6, failing_7};
#if defined(STUB_FAKE_DEVICE)
enum { MAX_DEVICES = 8 };
static int fake_devices(void) {
  const char *v = getenv("STUB_CUDA_DEVICES");
  int n = v && *v ? atoi(v) : 1;
  return n < 1 ? 1 : n > MAX_DEVICES ? MAX_DEVICES : n;
}
#endif
static int device_get_count(int *count) {
  if (forked_child()) return 3;
#if defined(STUB_FAKE_DEVICE)
  *count = fake_devices();
#else
  *count = 0;
#endif
  return 0;
}
static int not_supported(void) {
  return 801; /* CUDA_ERROR_NOT_SUPPORTED */
}

#if defined(STUB_FAKE_DEVICE)
/* Device d's primary context is &the_ctx[d]. */
static int the_ctx[MAX_DEVICES];
static int ctx_device(const void *ctx) {
  return (int)((const int *)ctx - the_ctx);
}
/* The thread's context stack; its top is the current context. */
static __thread void *ctx_stack[16];
static __thread int ctx_depth;
static void *current_ctx(void) {
  return ctx_depth ? ctx_stack[ctx_depth - 1] : NULL;
}
/* The device of the calling thread's current context, -1 where it has none: what the tests
 * read of the state pinmem left a thread in (test_driver.c dlsyms it). */
STUB_API int stub_current_device(void) {
  return current_ctx() ? ctx_device(current_ctx()) : -1;
}
static int ok(void) {
  return 0;
}
static int device_get(int *d, int ordinal) {
  if (ordinal < 0 || ordinal >= fake_devices()) return 101;
  *d = ordinal;
  return 0;
}
static int device_get_name(char *name, int len, int dev) {
  (void)dev;
  strncpy(name, "stub device", (size_t)len);
  name[len - 1] = 0;
  return 0;
}
static int device_get_attribute(int *v, int attr, int dev) {
  (void)dev;
  *v = attr == 20 ? 0 : attr == 75 ? 9 : 1; /* compute mode default, cc 9.x, features on */
  return 0;
}
/* STUB_CUDA_HOLD_RETAIN set: cuDevicePrimaryCtxRetain waits, as a real context creation takes
 * its time, until the test (which dlopens this library too) sets stub_retain_release; it sets
 * stub_retain_entered first, so the test knows pinmem holds its context lock. */
STUB_API _Atomic int stub_retain_entered, stub_retain_release;
static int primary_ctx_retain(void **ctx, int dev) {
  if (dev < 0 || dev >= fake_devices()) return 101;
  if (getenv("STUB_CUDA_HOLD_RETAIN")) {
    stub_retain_entered = 1;
    while (!stub_retain_release) sched_yield();
  }
  *ctx = &the_ctx[dev];
  return 0;
}
static int ctx_set_current(void *ctx) {
  if (!ctx_depth) ctx_depth = 1;
  ctx_stack[ctx_depth - 1] = ctx;
  return 0;
}
static int ctx_get_current(void **ctx) {
  *ctx = current_ctx();
  return 0;
}
static int ctx_push_current(void *ctx) {
  if (!ctx) return 201;
  if (ctx_depth == (int)(sizeof ctx_stack / sizeof ctx_stack[0])) return 2;
  ctx_stack[ctx_depth++] = ctx;
  return 0;
}
static int ctx_pop_current(void **ctx) {
  if (!ctx_depth) return 201;
  void *top = ctx_stack[--ctx_depth];
  if (ctx) *ctx = top;
  return 0;
}
static int ctx_get_device(int *d) {
  if (!current_ctx()) return 201;
  *d = ctx_device(current_ctx());
  return 0;
}
static int mem_get_info(size_t *f, size_t *t) {
  *f = (size_t)1 << 30;
  *t = (size_t)2 << 30;
  return 0;
}
/* What the stub allocated, for cuPointerGetAttributes: [base, base + size) of a memory type
 * (1 host, 2 device) and a device. A short table: tests hold few allocations at once. */
static struct {
  uintptr_t base;
  size_t size;
  int type, dev;
} allocs[256];
static pthread_mutex_t allocs_lock = PTHREAD_MUTEX_INITIALIZER;
/* Record [p, p + n) as memory of the current context's device; 0, or 2 (out of memory) when
 * the table is full. */
static int allocs_add(void *p, size_t n, int type) {
  int e = 2;
  pthread_mutex_lock(&allocs_lock);
  for (size_t i = 0; i < sizeof allocs / sizeof allocs[0] && e; i++)
    if (!allocs[i].base) {
      allocs[i].base = (uintptr_t)p;
      allocs[i].size = n;
      allocs[i].type = type;
      allocs[i].dev = ctx_device(current_ctx());
      e = 0;
    }
  pthread_mutex_unlock(&allocs_lock);
  return e;
}
/* Forget the range that starts at p; 0, or 713 (CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED). */
static int allocs_remove(void *p) {
  int e = 713;
  pthread_mutex_lock(&allocs_lock);
  for (size_t i = 0; i < sizeof allocs / sizeof allocs[0] && e; i++)
    if (p && allocs[i].base == (uintptr_t)p) {
      allocs[i].base = 0;
      e = 0;
    }
  pthread_mutex_unlock(&allocs_lock);
  return e;
}
/* Past the table's size an allocation still succeeds, answered as pageable memory. */
static void *stub_alloc(size_t n, int type) {
  void *p = malloc(n ? n : 1);
  if (p) (void)allocs_add(p, n, type);
  return p;
}
static void stub_free(void *p) {
  (void)allocs_remove(p);
  free(p);
}
/* Host registration: CUDA_ERROR_NOT_SUPPORTED (a platform without it), or with
 * STUB_CUDA_HOST_REGISTER set the range is pinned memory from then on (mapped at its own
 * address, as under unified addressing). */
static int mem_host_register(void *p, size_t n, unsigned flags) {
  (void)flags;
  if (!getenv("STUB_CUDA_HOST_REGISTER")) return 801;
  if (!current_ctx()) return 201;
  return allocs_add(p, n, 1);
}
static int mem_host_unregister(void *p) {
  return allocs_remove(p);
}
static int mem_host_get_device_pointer(unsigned long long *d, void *p, unsigned flags) {
  (void)flags;
  *d = (unsigned long long)(uintptr_t)p;
  return 0;
}
static int mem_alloc(unsigned long long *d, size_t n) {
  if (!current_ctx()) return 201;
  void *p = stub_alloc(n, 2);
  if (!p) return 2;
  *d = (unsigned long long)(uintptr_t)p;
  return 0;
}
static int mem_free(unsigned long long d) {
  stub_free((void *)(uintptr_t)d);
  return 0;
}
static int mem_host_alloc(void **p, size_t n, unsigned flags) {
  (void)flags;
  if (!current_ctx()) return 201;
  *p = stub_alloc(n, 1);
  return *p ? 0 : 2;
}
static int mem_free_host(void *p) {
  stub_free(p);
  return 0;
}
static int copy(unsigned long long dst, unsigned long long src, size_t n, void *s) {
  (void)s;
  memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
  return 0;
}
/* Streams and events: the context current at their creation. */
static int handle_create(void **h, unsigned flags) {
  (void)flags;
  if (!current_ctx()) return 201;
  void **ctx = malloc(sizeof *ctx);
  if (!ctx) return 2;
  *ctx = current_ctx();
  *h = ctx;
  return 0;
}
static int handle_destroy(void *h) {
  free(h);
  return 0;
}
static int stream_get_ctx(void *s, void **ctx) {
  /* NULL, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD: the current context's default stream. */
  void *c = !s || (uintptr_t)s == 1 || (uintptr_t)s == 2 ? current_ctx() : *(void **)s;
  if (!c) return 201;
  *ctx = c;
  return 0;
}
static int elapsed(float *ms, void *a, void *b) {
  (void)a;
  (void)b;
  *ms = 0.0f;
  return 0;
}
static int host_func(void *s, void (*fn)(void *), void *arg) {
  (void)s;
  fn(arg);
  return 0;
}
/* CU_POINTER_ATTRIBUTE_MEMORY_TYPE (2), _IS_MANAGED (8), _DEVICE_ORDINAL (9); zeros for memory
 * the stub did not allocate (pageable), as the driver answers. */
static int pointer_attributes(unsigned n, int *attrs, void **data, unsigned long long p) {
  int type = 0, dev = -1;
  pthread_mutex_lock(&allocs_lock);
  for (size_t i = 0; i < sizeof allocs / sizeof allocs[0]; i++)
    if (allocs[i].base && p >= allocs[i].base && p - allocs[i].base < allocs[i].size) {
      type = allocs[i].type;
      dev = allocs[i].dev;
    }
  pthread_mutex_unlock(&allocs_lock);
  for (unsigned i = 0; i < n; i++) {
    if (attrs[i] == 9)
      *(int *)data[i] = type ? dev : -2;
    else
      *(unsigned *)data[i] = attrs[i] == 2 ? (unsigned)type : 0;
  }
  return 0;
}
static int module_load(void **m, const void *image, unsigned n, int *opts, void **vals) {
  (void)m;
  (void)image;
  for (unsigned i = 0; i < n; i++)
    if (opts[i] == 5) strncpy((char *)vals[i], "stub JIT: no PTX here", 64);
  return 218; /* CUDA_ERROR_INVALID_PTX */
}
static const struct {
  const char *name;
  void *fn;
} fake[] = {
    {"cuDeviceGet", (void *)(uintptr_t)device_get},
    {"cuDeviceGetName", (void *)(uintptr_t)device_get_name},
    {"cuDeviceGetAttribute", (void *)(uintptr_t)device_get_attribute},
    {"cuDevicePrimaryCtxRetain", (void *)(uintptr_t)primary_ctx_retain},
    {"cuCtxSetCurrent", (void *)(uintptr_t)ctx_set_current},
    {"cuCtxGetCurrent", (void *)(uintptr_t)ctx_get_current},
    {"cuCtxGetDevice", (void *)(uintptr_t)ctx_get_device},
    {"cuCtxPushCurrent", (void *)(uintptr_t)ctx_push_current},
    {"cuCtxPopCurrent", (void *)(uintptr_t)ctx_pop_current},
    {"cuStreamGetCtx", (void *)(uintptr_t)stream_get_ctx},
    {"cuCtxSynchronize", (void *)(uintptr_t)ok},
    {"cuMemGetInfo", (void *)(uintptr_t)mem_get_info},
    {"cuMemAlloc", (void *)(uintptr_t)mem_alloc},
    {"cuMemFree", (void *)(uintptr_t)mem_free},
    {"cuMemHostAlloc", (void *)(uintptr_t)mem_host_alloc},
    {"cuMemFreeHost", (void *)(uintptr_t)mem_free_host},
    {"cuMemHostRegister", (void *)(uintptr_t)mem_host_register},
    {"cuMemHostUnregister", (void *)(uintptr_t)mem_host_unregister},
    {"cuMemHostGetDevicePointer", (void *)(uintptr_t)mem_host_get_device_pointer},
    {"cuMemcpyAsync", (void *)(uintptr_t)copy},
    {"cuMemcpyHtoDAsync", (void *)(uintptr_t)copy},
    {"cuMemcpyDtoHAsync", (void *)(uintptr_t)copy},
    {"cuMemcpyDtoDAsync", (void *)(uintptr_t)copy},
    {"cuStreamCreate", (void *)(uintptr_t)handle_create},
    {"cuStreamDestroy", (void *)(uintptr_t)handle_destroy},
    {"cuStreamSynchronize", (void *)(uintptr_t)ok},
    {"cuStreamQuery", (void *)(uintptr_t)ok},
    {"cuStreamWaitEvent", (void *)(uintptr_t)ok},
    {"cuEventCreate", (void *)(uintptr_t)handle_create},
    {"cuEventDestroy", (void *)(uintptr_t)handle_destroy},
    {"cuEventRecord", (void *)(uintptr_t)ok},
    {"cuEventQuery", (void *)(uintptr_t)ok},
    {"cuEventSynchronize", (void *)(uintptr_t)ok},
    {"cuEventElapsedTime", (void *)(uintptr_t)elapsed},
    {"cuLaunchHostFunc", (void *)(uintptr_t)host_func},
    {"cuPointerGetAttributes", (void *)(uintptr_t)pointer_attributes},
    {"cuModuleLoadDataEx", (void *)(uintptr_t)module_load},
};
#endif

static int lookup(const char *symbol, void **pfn, int version) {
  if (version > STUB_VERSION) return 500; /* CUDA_ERROR_NOT_FOUND: newer than this driver */
  int code = 0;
  if (fail_code("cuGetProcAddress", &code)) return code;
  if (fail_code(symbol, &code)) {
    if (code == -1) return 500;
    int slot = -1;
    for (int i = 0; i < failing_used; i++)
      if (failing_codes[i] == code) slot = i;
    if (slot < 0 && failing_used < 8) failing_codes[slot = failing_used++] = code;
    if (slot >= 0) {
      *pfn = (void *)(uintptr_t)failing[slot];
      return 0;
    }
  }
#if defined(STUB_FAKE_DEVICE)
  for (size_t i = 0; i < sizeof fake / sizeof fake[0]; i++)
    if (strcmp(symbol, fake[i].name) == 0) {
      *pfn = fake[i].fn;
      return 0;
    }
#endif
  if (strcmp(symbol, "cuGetErrorString") == 0)
    *pfn = (void *)(uintptr_t)error_string;
  else if (strcmp(symbol, "cuGetErrorName") == 0)
    *pfn = (void *)(uintptr_t)error_name;
  else if (strcmp(symbol, "cuDeviceGetCount") == 0)
    *pfn = (void *)(uintptr_t)device_get_count;
  else
    *pfn = (void *)(uintptr_t)not_supported;
  return 0;
}
STUB_API int cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags,
                                 int *status) {
  (void)flags;
  int e = lookup(symbol, pfn, version);
  /* CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT for a newer version, else SYMBOL_NOT_FOUND */
  if (status) *status = !e ? 0 : version > STUB_VERSION ? 2 : 1;
  return e;
}
STUB_API int cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags) {
  (void)flags;
  return lookup(symbol, pfn, version);
}
#endif
