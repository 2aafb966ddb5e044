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
 * starts but shows no device. It holds no state and allocates nothing.
 *
 * STUB_FAKE_DEVICE: one device whose "device memory" is malloc'd host memory, with synchronous
 * copies and streams and events that are always complete, and a JIT that refuses every PTX. It
 * lets the cuda backend's own plumbing (primary contexts, the probe, pm_backend_info, the
 * kernels' fallback) run where there is no GPU; it says nothing of CUDA's semantics.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define STUB_API __attribute__((visibility("default")))

STUB_API int cuDriverGetVersion(int *v) {
  *v = STUB_VERSION;
  return 0;
}
STUB_API int cuInit(unsigned flags) {
  (void)flags;
  return STUB_INIT_RESULT;
}

#if !defined(STUB_NO_GPA)
static int error_string(int e, const char **s) {
  *s = e == 100   ? "no CUDA-capable device is detected"
       : e == 218 ? "a PTX JIT compilation failed"
                  : "stub driver: call not supported";
  return 0;
}
static int error_name(int e, const char **s) {
  *s = e == 100 ? "CUDA_ERROR_NO_DEVICE" : e == 218 ? "CUDA_ERROR_INVALID_PTX" : "CUDA_ERROR_NOT_SUPPORTED";
  return 0;
}
static int device_get_count(int *count) {
#if defined(STUB_FAKE_DEVICE)
  *count = 1;
#else
  *count = 0;
#endif
  return 0;
}
static int not_supported(void) {
  return 801; /* CUDA_ERROR_NOT_SUPPORTED */
}

#if defined(STUB_FAKE_DEVICE)
static int the_ctx;
static __thread void *current;
static int ok(void) {
  return 0;
}
static int device_get(int *d, int ordinal) {
  if (ordinal != 0) return 101;
  *d = 0;
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
static int primary_ctx_retain(void **ctx, int dev) {
  (void)dev;
  *ctx = &the_ctx;
  return 0;
}
static int ctx_set_current(void *ctx) {
  current = ctx;
  return 0;
}
static int ctx_get_current(void **ctx) {
  *ctx = current;
  return 0;
}
static int ctx_get_device(int *d) {
  if (!current) return 201;
  *d = 0;
  return 0;
}
static int mem_get_info(size_t *f, size_t *t) {
  *f = (size_t)1 << 30;
  *t = (size_t)2 << 30;
  return 0;
}
static int mem_alloc(unsigned long long *d, size_t n) {
  if (!current) return 201;
  void *p = malloc(n);
  if (!p) return 2;
  *d = (unsigned long long)(uintptr_t)p;
  return 0;
}
static int mem_free(unsigned long long d) {
  free((void *)(uintptr_t)d);
  return 0;
}
static int mem_host_alloc(void **p, size_t n, unsigned flags) {
  (void)flags;
  if (!current) return 201;
  *p = malloc(n);
  return *p ? 0 : 2;
}
static int mem_free_host(void *p) {
  free(p);
  return 0;
}
static int copy(unsigned long long dst, unsigned long long src, size_t n, void *s) {
  (void)s;
  memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
  return 0;
}
static int handle_create(void **h, unsigned flags) {
  (void)flags;
  if (!current) return 201;
  *h = malloc(1);
  return *h ? 0 : 2;
}
static int handle_destroy(void *h) {
  free(h);
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
static int pointer_attributes(unsigned n, int *attrs, void **data, unsigned long long p) {
  (void)attrs;
  (void)p;
  for (unsigned i = 0; i < n; i++) *(unsigned *)data[i] = 0; /* unknown: pageable */
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
    {"cuCtxSynchronize", (void *)(uintptr_t)ok},
    {"cuMemGetInfo", (void *)(uintptr_t)mem_get_info},
    {"cuMemAlloc", (void *)(uintptr_t)mem_alloc},
    {"cuMemFree", (void *)(uintptr_t)mem_free},
    {"cuMemHostAlloc", (void *)(uintptr_t)mem_host_alloc},
    {"cuMemFreeHost", (void *)(uintptr_t)mem_free_host},
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
  if (status) *status = e ? 2 : 0; /* CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT */
  return e;
}
STUB_API int cuGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags) {
  (void)flags;
  return lookup(symbol, pfn, version);
}
#endif
