/*
 * A stand-in for the NVIDIA driver library (libcuda.so.1) for the driver-choice tests
 * (test_driver.c, python/tests/test_backend_choice.py), which point pinmem at it with
 * PINMEM_CUDA_DRIVER. One source, variants by macro:
 *   STUB_VERSION      what cuDriverGetVersion reports (12040 = 12.4)
 *   STUB_INIT_RESULT  what cuInit returns (0, or 100 = CUDA_ERROR_NO_DEVICE)
 *   STUB_NO_GPA       define to leave out cuGetProcAddress (both spellings)
 * Through cuGetProcAddress it offers the error strings, cuDeviceGetCount (no device) and, for
 * every other name, a call that fails with CUDA_ERROR_NOT_SUPPORTED: a driver that loads and
 * starts but shows no device. It holds no state and allocates nothing.
 */
#include <stdint.h>
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
  *s = e == 100 ? "no CUDA-capable device is detected" : "stub driver: call not supported";
  return 0;
}
static int error_name(int e, const char **s) {
  *s = e == 100 ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_NOT_SUPPORTED";
  return 0;
}
static int device_get_count(int *count) {
  *count = 0;
  return 0;
}
static int not_supported(void) {
  return 801; /* CUDA_ERROR_NOT_SUPPORTED */
}

static int lookup(const char *symbol, void **pfn, int version) {
  if (version > STUB_VERSION) return 500; /* CUDA_ERROR_NOT_FOUND: newer than this driver */
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
