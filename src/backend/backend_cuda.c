/*
 * DESIGN: the cuda backend: src/backend/backend.h over the CUDA runtime (cudart, linked statically).
 *
 * - Handles are CUDA's own: a pm_stream_t is a cudaStream_t and a pm_event_t a cudaEvent_t, so
 *   streams of other CUDA libraries pass straight through, and the backend keeps no state of its
 *   own (no table, no lock): CUDA's per-thread current device is the only state, as it is for
 *   every other CUDA user in the process.
 * - Every CUDA return code is checked. A failure becomes a pm_status_t through one mapping
 *   (pm__cuda_fail, in kernels.cu so its launchers use it too) with the call, its arguments and
 *   CUDA's message in pm_last_error(); the runtime's last-error slot is cleared right away, so a
 *   non-sticky error of ours is not reported later to another library that checks
 *   cudaGetLastError. Sticky errors (a faulted context) cannot be cleared and keep failing every
 *   call, as they should.
 * - cudaErrorNotReady from a query is an answer (PM_NOT_READY), not a failure: no detail is set.
 * - Arguments are validated before any CUDA call, so bad input gets PM_ERR_INVALID with a clear
 *   message instead of whatever CUDA makes of it; outputs are written only on success.
 * - shutdown does nothing: cudaDeviceReset would pull the context from under other libraries
 *   in the process, and the driver cleans up at exit.
 */
#include <cuda_runtime_api.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#if !defined(PINMEM_HAVE_CUDA)
#error "backend_cuda.c is built only with PINMEM_HAVE_CUDA (the CMake build defines it)"
#endif
#include "kernels.h"

/* Longest time launch_busy accepts: far beyond any benchmark, far below uint64 nanoseconds. */
#define PM__BUSY_MAX_SECONDS 1.0e6

static inline cudaStream_t cu_stream(pm_stream_t s) {
  return (cudaStream_t)s;
}
static inline cudaEvent_t cu_event(pm_event_t e) {
  return (cudaEvent_t)e;
}

/* Errors are recorded by pm__cuda_fail (kernels.cu, the lowest file of this backend, so the
 * launchers there can use it without calling back up). */

/* Device-memory allocation failures also say how much memory the device has left. */
static pm_status_t device_oom_fail(cudaError_t e, const char *call, size_t bytes) {
  size_t free_b = 0, total_b = 0;
  (void)cudaGetLastError();
  if (e == cudaErrorMemoryAllocation && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) {
    int dev = -1;
    if (cudaGetDevice(&dev) != cudaSuccess) dev = -1;
    (void)cudaGetLastError();
    return pm__cuda_fail((int)e, PM_ERR_DEVICE_MEMORY,
                         "%s(%zu bytes) on device %d with %zu of %zu bytes free", call, bytes, dev,
                         free_b, total_b);
  }
  return pm__cuda_fail((int)e, PM_ERR_DEVICE_MEMORY, "%s(%zu bytes)", call, bytes);
}

/* 0 <= device < device count, else PM_ERR_INVALID (or the failure of cudaGetDeviceCount). */
static pm_status_t check_device(int device, const char *what) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaGetDeviceCount");
  if (device < 0 || device >= count)
    return pm__set_error(PM_ERR_INVALID, "%s: device %d out of range (%d CUDA device%s: 0..%d)",
                         what, device, count, count == 1 ? "" : "s", count - 1);
  return PM_OK;
}

/* ---- lifecycle and devices ---------------------------------------------------------------- */

/* pinmem's kernels load per device, once: with CUDA's lazy loading the first launch of a
 * kernel loads it, and that load can wait behind a stream that is blocked in a host function.
 * Loading when a device is first set through pinmem, or gets its first stream or allocation
 * from pinmem, keeps launches from waiting on other streams; the bit set makes the repeat a
 * load and a compare. */
static atomic_uint_fast64_t kernels_loaded;

static pm_status_t load_kernels(void) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    (void)cudaGetLastError();
    return PM_OK; /* the calling operation reports the device trouble itself */
  }
  uint_fast64_t bit = (uint_fast64_t)1 << dev;
  if (atomic_load_explicit(&kernels_loaded, memory_order_acquire) & bit) return PM_OK;
  pm_status_t st = pm__kernels_preload();
  if (st == PM_OK) atomic_fetch_or_explicit(&kernels_loaded, bit, memory_order_release);
  return st;
}

static pm_status_t cuda_init(void) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return pm__set_error(PM_ERR_NO_DEVICE, "cudaGetDeviceCount: %s (%s)", cudaGetErrorString(e),
                         cudaGetErrorName(e));
  }
  if (count <= 0) {
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    return pm__set_error(PM_ERR_NO_DEVICE,
                         "cudaGetDeviceCount: no CUDA device visible (CUDA_VISIBLE_DEVICES=%s)",
                         vis ? vis : "(unset)");
  }
  /* Without option device, start nothing on any device: the caller's thread keeps its device,
   * and contexts come with the first real call on each (a context on GPU 0 in a process that
   * uses GPU 1 costs hundreds of MB there). The kernels of a device load with its context
   * (load_kernels). */
  pm_option_info_t dev_opt; /* given, or only the default (init.c decides the same way) */
  if (pm_option_get(PM__OPT_DEVICE, &dev_opt) != PM_OK || dev_opt.source == PM_OPTION_DEFAULT) {
    /* Still refuse a device no process may use (compute mode prohibited), as the context
     * creation below would: an attribute query creates no context. */
    int dev = 0, mode = 0;
    if (cudaGetDevice(&dev) == cudaSuccess &&
        cudaDeviceGetAttribute(&mode, cudaDevAttrComputeMode, dev) == cudaSuccess &&
        mode == cudaComputeModeProhibited)
      return pm__set_error(PM_ERR_NO_DEVICE, "CUDA device %d: compute mode is prohibited", dev);
    (void)cudaGetLastError();
    return PM_OK;
  }
  long want = pm__opt_int(PM__OPT_DEVICE);
  if (want < 0 || want >= count)
    return pm__set_error(PM_ERR_CONFIG,
                         "option device (PINMEM_DEVICE) is %ld, but there %s %d CUDA device%s "
                         "(0..%d)",
                         want, count == 1 ? "is" : "are", count, count == 1 ? "" : "s", count - 1);
  e = cudaSetDevice((int)want);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return pm__set_error(PM_ERR_NO_DEVICE, "cudaSetDevice(%ld): %s (%s)", want,
                         cudaGetErrorString(e), cudaGetErrorName(e));
  }
  /* Create the context now, so a device that cannot be used (exclusive mode taken, driver
   * trouble) fails pm_init rather than the first allocation. */
  e = cudaFree(NULL);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return pm__set_error(PM_ERR_NO_DEVICE,
                         "cudaFree(NULL) (context creation on device %ld): %s (%s)", want,
                         cudaGetErrorString(e), cudaGetErrorName(e));
  }
  return load_kernels();
}

static void cuda_shutdown(void) {}

static pm_status_t cuda_device_count(int *count_out) {
  if (!count_out) return pm__set_error(PM_ERR_INVALID, "device_count: count_out is NULL");
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaGetDeviceCount");
  *count_out = count;
  return PM_OK;
}

/* Attribute query as part of device_info: failure fails the call. */
#define PM__ATTR(dst, attr)                                                                       \
  do {                                                                                            \
    int v_ = 0;                                                                                   \
    cudaError_t e_ = cudaDeviceGetAttribute(&v_, (attr), device);                                 \
    if (e_ != cudaSuccess)                                                                        \
      return pm__cuda_fail((int)e_, PM_ERR_NOMEM, "cudaDeviceGetAttribute(%s, device %d)", #attr, \
                           device);                                                               \
    (dst) = v_;                                                                                   \
  } while (0)

static pm_status_t cuda_device_info(int device, pm_device_info_t *info_out) {
  if (!info_out) return pm__set_error(PM_ERR_INVALID, "device_info: info_out is NULL");
  pm_status_t st = check_device(device, "device_info");
  if (st != PM_OK) return st;

  pm_device_info_t info;
  memset(&info, 0, sizeof info);
  info.index = device;

  struct cudaDeviceProp prop;
  memset(&prop, 0, sizeof prop);
  cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaGetDeviceProperties(device %d)", device);
  memcpy(info.name, prop.name,
         sizeof info.name < sizeof prop.name ? sizeof info.name : sizeof prop.name);
  info.name[sizeof info.name - 1] = '\0';
  info.cc_major = prop.major;
  info.cc_minor = prop.minor;

  PM__ATTR(info.async_engines, cudaDevAttrAsyncEngineCount);
  PM__ATTR(info.can_map_host_memory, cudaDevAttrCanMapHostMemory);
  PM__ATTR(info.unified_addressing, cudaDevAttrUnifiedAddressing);
  PM__ATTR(info.managed_memory, cudaDevAttrManagedMemory);
  PM__ATTR(info.concurrent_managed_access, cudaDevAttrConcurrentManagedAccess);
  PM__ATTR(info.host_register_supported, cudaDevAttrHostRegisterSupported);
  PM__ATTR(info.host_register_read_only, cudaDevAttrHostRegisterReadOnlySupported);
  PM__ATTR(info.pageable_memory_access, cudaDevAttrPageableMemoryAccess);

  /* cudaMemGetInfo speaks of the current device: switch to `device` for it, then switch back. */
  int prev = 0;
  e = cudaGetDevice(&prev);
  if (e != cudaSuccess) return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaGetDevice");
  if (prev != device) {
    e = cudaSetDevice(device);
    if (e != cudaSuccess) return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaSetDevice(%d)", device);
  }
  size_t free_b = 0, total_b = 0;
  cudaError_t e_info = cudaMemGetInfo(&free_b, &total_b);
  if (e_info != cudaSuccess) (void)cudaGetLastError();
  if (prev != device) {
    e = cudaSetDevice(prev);
    if (e != cudaSuccess)
      return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaSetDevice(%d) (restoring the device)", prev);
  }
  if (e_info != cudaSuccess)
    return pm__cuda_fail((int)e_info, PM_ERR_NOMEM, "cudaMemGetInfo (device %d)", device);
  info.free_memory = free_b;
  info.total_memory = total_b;

  /* PCI address in sysfs form (lowercase hex, 4-digit domain); the PCIe link from sysfs. A
   * missing piece is "unknown" (-1, ""), never a failure: VMs and containers often hide it. */
  char raw[64];
  unsigned dom = 0, bus = 0, dev = 0, fn = 0;
  int have_id = 0;
  e = cudaDeviceGetPCIBusId(raw, (int)sizeof raw, device);
  if (e == cudaSuccess && sscanf(raw, "%x:%x:%x.%x", &dom, &bus, &dev, &fn) == 4) {
    have_id = 1;
  } else {
    if (e != cudaSuccess) (void)cudaGetLastError();
    if (prop.pciBusID >= 0 && prop.pciDeviceID >= 0 && prop.pciDomainID >= 0 &&
        (prop.pciBusID | prop.pciDeviceID | prop.pciDomainID) != 0) {
      dom = (unsigned)prop.pciDomainID;
      bus = (unsigned)prop.pciBusID;
      dev = (unsigned)prop.pciDeviceID;
      fn = 0;
      have_id = 1;
    }
  }
  info.pcie_gen = info.pcie_width = info.pcie_max_gen = info.pcie_max_width = -1;
  info.numa_node = -1;
  if (have_id) {
    snprintf(info.pci_bus_id, sizeof info.pci_bus_id, "%04x:%02x:%02x.%x", dom & 0xffffffu,
             bus & 0xffu, dev & 0x1fu, fn & 0x7u);
    info.pcie_gen = pm__pcie_sysfs_gen(info.pci_bus_id, "current_link_speed");
    info.pcie_max_gen = pm__pcie_sysfs_gen(info.pci_bus_id, "max_link_speed");
    info.pcie_width = pm__pcie_sysfs_int(info.pci_bus_id, "current_link_width", 1);
    info.pcie_max_width = pm__pcie_sysfs_int(info.pci_bus_id, "max_link_width", 1);
    info.numa_node = pm__pcie_sysfs_int(info.pci_bus_id, "numa_node", 0);
  }

  *info_out = info;
  return PM_OK;
}

static pm_status_t cuda_set_device(int device) {
  pm_status_t st = check_device(device, "set_device");
  if (st != PM_OK) return st;
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaSetDevice(%d)", device);
  return load_kernels();
}

static pm_status_t cuda_get_device(int *device_out) {
  if (!device_out) return pm__set_error(PM_ERR_INVALID, "get_device: device_out is NULL");
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaGetDevice");
  *device_out = dev;
  return PM_OK;
}

static pm_status_t cuda_device_synchronize(void) {
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) return pm__cuda_fail((int)e, PM_ERR_BACKEND, "cudaDeviceSynchronize");
  return PM_OK;
}

/* ---- pinned host memory ------------------------------------------------------------------- */

static pm_status_t cuda_host_alloc(size_t bytes, unsigned flags, void **ptr_out) {
  const unsigned known = PM_HOST_MAPPED | PM_HOST_WRITE_COMBINED | PM_HOST_PORTABLE;
  if (!ptr_out) return pm__set_error(PM_ERR_INVALID, "host_alloc: ptr_out is NULL");
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "host_alloc: size is 0");
  if (flags & ~known)
    return pm__set_error(PM_ERR_INVALID, "host_alloc: unknown flags 0x%x", flags & ~known);
  unsigned cflags = cudaHostAllocDefault;
  if (flags & PM_HOST_MAPPED) cflags |= cudaHostAllocMapped;
  if (flags & PM_HOST_WRITE_COMBINED) cflags |= cudaHostAllocWriteCombined;
  if (flags & PM_HOST_PORTABLE) cflags |= cudaHostAllocPortable;
  void *p = NULL;
  cudaError_t e = cudaHostAlloc(&p, bytes, cflags);
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaHostAlloc(%zu bytes, flags 0x%x)", bytes,
                         cflags);
  if (!p) return pm__set_error(PM_ERR_INTERNAL, "cudaHostAlloc(%zu bytes) returned NULL", bytes);
  *ptr_out = p;
  return PM_OK;
}

static pm_status_t cuda_host_free(void *ptr, size_t bytes) {
  if (!ptr) return pm__set_error(PM_ERR_INVALID, "host_free: ptr is NULL");
  cudaError_t e = cudaFreeHost(ptr);
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaFreeHost(%p, %zu bytes)", ptr, bytes);
  return PM_OK;
}

static pm_status_t cuda_host_register(void *ptr, size_t bytes, unsigned flags) {
  const unsigned known = PM_REGISTER_MAPPED | PM_REGISTER_PORTABLE | PM_REGISTER_READ_ONLY;
  if (!ptr) return pm__set_error(PM_ERR_INVALID, "host_register: ptr is NULL");
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "host_register: size is 0");
  if (flags & ~known)
    return pm__set_error(PM_ERR_INVALID, "host_register: unknown flags 0x%x", flags & ~known);
  unsigned cflags = cudaHostRegisterDefault;
  if (flags & PM_REGISTER_MAPPED) cflags |= cudaHostRegisterMapped;
  if (flags & PM_REGISTER_PORTABLE) cflags |= cudaHostRegisterPortable;
  if (flags & PM_REGISTER_READ_ONLY) {
    int dev = 0, ro = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaGetDevice");
    e = cudaDeviceGetAttribute(&ro, cudaDevAttrHostRegisterReadOnlySupported, dev);
    if (e != cudaSuccess)
      return pm__cuda_fail((int)e, PM_ERR_NOMEM,
                           "cudaDeviceGetAttribute(cudaDevAttrHostRegisterReadOnlySupported, "
                           "device %d)",
                           dev);
    if (!ro)
      return pm__set_error(PM_ERR_UNSUPPORTED,
                           "host_register: device %d cannot map registered memory read-only "
                           "(cudaDevAttrHostRegisterReadOnlySupported is 0); register without "
                           "PM_REGISTER_READ_ONLY",
                           dev);
    cflags |= cudaHostRegisterReadOnly;
  }
  cudaError_t e = cudaHostRegister(ptr, bytes, cflags);
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaHostRegister(%p, %zu bytes, flags 0x%x)", ptr,
                         bytes, cflags);
  return PM_OK;
}

static pm_status_t cuda_host_unregister(void *ptr, size_t bytes) {
  if (!ptr) return pm__set_error(PM_ERR_INVALID, "host_unregister: ptr is NULL");
  cudaError_t e = cudaHostUnregister(ptr);
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaHostUnregister(%p, %zu bytes)", ptr, bytes);
  return PM_OK;
}

static pm_status_t cuda_host_device_pointer(void *host_ptr, void **dptr_out) {
  if (!host_ptr) return pm__set_error(PM_ERR_INVALID, "host_device_pointer: ptr is NULL");
  if (!dptr_out) return pm__set_error(PM_ERR_INVALID, "host_device_pointer: dptr_out is NULL");
  void *d = NULL;
  cudaError_t e = cudaHostGetDevicePointer(&d, host_ptr, 0);
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaHostGetDevicePointer(%p)", host_ptr);
  *dptr_out = d;
  return PM_OK;
}

/* ---- device and managed memory ------------------------------------------------------------ */

static pm_status_t cuda_device_alloc(size_t bytes, void **dptr_out) {
  if (!dptr_out) return pm__set_error(PM_ERR_INVALID, "device_alloc: dptr_out is NULL");
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "device_alloc: size is 0");
  void *d = NULL;
  cudaError_t e = cudaMalloc(&d, bytes);
  if (e != cudaSuccess) return device_oom_fail(e, "cudaMalloc", bytes);
  if (!d) return pm__set_error(PM_ERR_INTERNAL, "cudaMalloc(%zu bytes) returned NULL", bytes);
  pm_status_t st = load_kernels();
  if (st != PM_OK) {
    (void)cudaFree(d);
    return st;
  }
  *dptr_out = d;
  return PM_OK;
}

static pm_status_t cuda_device_free(void *dptr) {
  if (!dptr) return pm__set_error(PM_ERR_INVALID, "device_free: ptr is NULL");
  cudaError_t e = cudaFree(dptr);
  if (e != cudaSuccess) return pm__cuda_fail((int)e, PM_ERR_DEVICE_MEMORY, "cudaFree(%p)", dptr);
  return PM_OK;
}

static pm_status_t cuda_device_memset_async(void *dptr, int value, size_t bytes,
                                            pm_stream_t stream) {
  if (bytes == 0) return PM_OK;
  if (!dptr) return pm__set_error(PM_ERR_INVALID, "device_memset_async: ptr is NULL");
  cudaError_t e = cudaMemsetAsync(dptr, value, bytes, cu_stream(stream));
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_DEVICE_MEMORY, "cudaMemsetAsync(%p, %d, %zu, stream %p)",
                         dptr, value, bytes, (void *)stream);
  return PM_OK;
}

static pm_status_t cuda_managed_alloc(size_t bytes, void **ptr_out) {
  if (!ptr_out) return pm__set_error(PM_ERR_INVALID, "managed_alloc: ptr_out is NULL");
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "managed_alloc: size is 0");
  void *p = NULL;
  cudaError_t e = cudaMallocManaged(&p, bytes, cudaMemAttachGlobal);
  if (e != cudaSuccess) return device_oom_fail(e, "cudaMallocManaged", bytes);
  if (!p)
    return pm__set_error(PM_ERR_INTERNAL, "cudaMallocManaged(%zu bytes) returned NULL", bytes);
  *ptr_out = p;
  return PM_OK;
}

static pm_status_t cuda_managed_free(void *ptr) {
  if (!ptr) return pm__set_error(PM_ERR_INVALID, "managed_free: ptr is NULL");
  cudaError_t e = cudaFree(ptr);
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_DEVICE_MEMORY, "cudaFree(%p) (managed)", ptr);
  return PM_OK;
}

static pm_status_t cuda_managed_prefetch(const void *ptr, size_t bytes, int device,
                                         pm_stream_t stream) {
  if (bytes == 0) return PM_OK;
  if (!ptr) return pm__set_error(PM_ERR_INVALID, "managed_prefetch: ptr is NULL");
  /* Prefetching needs concurrent managed access on the device involved (for the CPU target:
   * the current device); without it CUDA answers a puzzling cudaErrorInvalidDevice. */
  int attr_dev = device;
  if (device == PM_CPU_DEVICE) {
    cudaError_t e = cudaGetDevice(&attr_dev);
    if (e != cudaSuccess) return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaGetDevice");
  } else {
    pm_status_t st = check_device(device, "managed_prefetch");
    if (st != PM_OK) return st;
  }
  int cma = 0;
  cudaError_t e = cudaDeviceGetAttribute(&cma, cudaDevAttrConcurrentManagedAccess, attr_dev);
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM,
                         "cudaDeviceGetAttribute(cudaDevAttrConcurrentManagedAccess, device %d)",
                         attr_dev);
  if (!cma)
    return pm__set_error(PM_ERR_UNSUPPORTED,
                         "managed_prefetch: device %d has no concurrent managed access "
                         "(cudaDevAttrConcurrentManagedAccess is 0), so managed memory cannot "
                         "be prefetched",
                         attr_dev);

  struct cudaMemLocation loc;
  memset(&loc, 0, sizeof loc);
  if (device == PM_CPU_DEVICE) {
    loc.type = cudaMemLocationTypeHost;
    loc.id = 0; /* ignored for the host */
  } else {
    loc.type = cudaMemLocationTypeDevice;
    loc.id = device;
  }
  e = cudaMemPrefetchAsync(ptr, bytes, loc, 0, cu_stream(stream));
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_DEVICE_MEMORY,
                         "cudaMemPrefetchAsync(%p, %zu, %s %d, stream %p)", ptr, bytes,
                         device == PM_CPU_DEVICE ? "host" : "device", device, (void *)stream);
  return PM_OK;
}

/* ---- streams and events ------------------------------------------------------------------- */

static pm_status_t cuda_stream_create(pm_stream_t *stream_out) {
  if (!stream_out) return pm__set_error(PM_ERR_INVALID, "stream_create: stream_out is NULL");
  cudaStream_t s = NULL;
  cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaStreamCreateWithFlags(cudaStreamNonBlocking)");
  pm_status_t st = load_kernels();
  if (st != PM_OK) {
    (void)cudaStreamDestroy(s);
    return st;
  }
  *stream_out = (pm_stream_t)s;
  return PM_OK;
}

static pm_status_t cuda_stream_destroy(pm_stream_t stream) {
  if (!stream) return pm__set_error(PM_ERR_INVALID, "stream_destroy: NULL is the default stream");
  /* The contract waits for the queued work (cudaStreamDestroy alone would return at once).
   * The stream is destroyed even if that work failed, so it never leaks. */
  cudaError_t es = cudaStreamSynchronize(cu_stream(stream));
  if (es != cudaSuccess) (void)cudaGetLastError();
  cudaError_t e = cudaStreamDestroy(cu_stream(stream));
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaStreamDestroy(%p)", (void *)stream);
  if (es != cudaSuccess)
    return pm__cuda_fail((int)es, PM_ERR_NOMEM,
                         "cudaStreamSynchronize(%p) (before destroying it; it was destroyed)",
                         (void *)stream);
  return PM_OK;
}

static pm_status_t cuda_stream_synchronize(pm_stream_t stream) {
  cudaError_t e = cudaStreamSynchronize(cu_stream(stream));
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaStreamSynchronize(%p)", (void *)stream);
  return PM_OK;
}

static pm_status_t cuda_stream_query(pm_stream_t stream) {
  cudaError_t e = cudaStreamQuery(cu_stream(stream));
  if (e == cudaSuccess) return PM_OK;
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return PM_NOT_READY;
  }
  return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaStreamQuery(%p)", (void *)stream);
}

static pm_status_t cuda_stream_wait_event(pm_stream_t stream, pm_event_t event) {
  if (!event) return pm__set_error(PM_ERR_INVALID, "stream_wait_event: event is NULL");
  cudaError_t e = cudaStreamWaitEvent(cu_stream(stream), cu_event(event), 0);
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaStreamWaitEvent(stream %p, event %p)",
                         (void *)stream, (void *)event);
  return PM_OK;
}

static pm_status_t cuda_event_create(unsigned flags, pm_event_t *event_out) {
  if (!event_out) return pm__set_error(PM_ERR_INVALID, "event_create: event_out is NULL");
  if (flags & ~(unsigned)PM_EVENT_TIMING)
    return pm__set_error(PM_ERR_INVALID, "event_create: unknown flags 0x%x",
                         flags & ~(unsigned)PM_EVENT_TIMING);
  unsigned cflags = (flags & PM_EVENT_TIMING) ? cudaEventDefault : cudaEventDisableTiming;
  cudaEvent_t ev = NULL;
  cudaError_t e = cudaEventCreateWithFlags(&ev, cflags);
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaEventCreateWithFlags(0x%x)", cflags);
  *event_out = (pm_event_t)ev;
  return PM_OK;
}

static pm_status_t cuda_event_destroy(pm_event_t event) {
  if (!event) return pm__set_error(PM_ERR_INVALID, "event_destroy: event is NULL");
  cudaError_t e = cudaEventDestroy(cu_event(event));
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaEventDestroy(%p)", (void *)event);
  return PM_OK;
}

static pm_status_t cuda_event_record(pm_event_t event, pm_stream_t stream) {
  if (!event) return pm__set_error(PM_ERR_INVALID, "event_record: event is NULL");
  cudaError_t e = cudaEventRecord(cu_event(event), cu_stream(stream));
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaEventRecord(event %p, stream %p)",
                         (void *)event, (void *)stream);
  return PM_OK;
}

static pm_status_t cuda_event_query(pm_event_t event) {
  if (!event) return pm__set_error(PM_ERR_INVALID, "event_query: event is NULL");
  cudaError_t e = cudaEventQuery(cu_event(event));
  if (e == cudaSuccess) return PM_OK;
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return PM_NOT_READY;
  }
  return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaEventQuery(%p)", (void *)event);
}

static pm_status_t cuda_event_synchronize(pm_event_t event) {
  if (!event) return pm__set_error(PM_ERR_INVALID, "event_synchronize: event is NULL");
  cudaError_t e = cudaEventSynchronize(cu_event(event));
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaEventSynchronize(%p)", (void *)event);
  return PM_OK;
}

static pm_status_t cuda_event_elapsed(pm_event_t start, pm_event_t end, double *seconds_out) {
  if (!start || !end) return pm__set_error(PM_ERR_INVALID, "event_elapsed: event is NULL");
  if (!seconds_out) return pm__set_error(PM_ERR_INVALID, "event_elapsed: seconds_out is NULL");
  float ms = 0.0f;
  cudaError_t e = cudaEventElapsedTime(&ms, cu_event(start), cu_event(end));
  if (e == cudaErrorNotReady) {
    /* Not a query: there is no time to give yet, so it is a state error, not PM_NOT_READY
     * (which callers may take for success and read *seconds_out). */
    (void)cudaGetLastError();
    return pm__set_error(PM_ERR_STATE,
                         "cudaEventElapsedTime(%p, %p): %s (%s): an event has not completed yet",
                         (void *)start, (void *)end, cudaGetErrorString(e), cudaGetErrorName(e));
  }
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM,
                         "cudaEventElapsedTime(%p, %p) (both events need PM_EVENT_TIMING and a "
                         "completed record)",
                         (void *)start, (void *)end);
  *seconds_out = (double)ms / 1000.0;
  return PM_OK;
}

/* ---- copies, kernels, host functions ------------------------------------------------------ */

static int to_cuda_kind(pm_copy_kind_t kind, enum cudaMemcpyKind *out) {
  switch (kind) {
    case PM_COPY_DEFAULT:
      *out = cudaMemcpyDefault;
      return 0;
    case PM_COPY_H2D:
      *out = cudaMemcpyHostToDevice;
      return 0;
    case PM_COPY_D2H:
      *out = cudaMemcpyDeviceToHost;
      return 0;
    case PM_COPY_D2D:
      *out = cudaMemcpyDeviceToDevice;
      return 0;
    case PM_COPY_H2H:
      *out = cudaMemcpyHostToHost;
      return 0;
  }
  return -1;
}

static const char *kind_name(enum cudaMemcpyKind k) {
  switch (k) {
    case cudaMemcpyHostToHost:
      return "cudaMemcpyHostToHost";
    case cudaMemcpyHostToDevice:
      return "cudaMemcpyHostToDevice";
    case cudaMemcpyDeviceToHost:
      return "cudaMemcpyDeviceToHost";
    case cudaMemcpyDeviceToDevice:
      return "cudaMemcpyDeviceToDevice";
    case cudaMemcpyDefault:
      return "cudaMemcpyDefault";
  }
  return "?";
}

static pm_status_t cuda_memcpy_async(void *dst, const void *src, size_t bytes, pm_copy_kind_t kind,
                                     pm_stream_t stream) {
  enum cudaMemcpyKind ck = cudaMemcpyDefault;
  if (to_cuda_kind(kind, &ck) != 0)
    return pm__set_error(PM_ERR_INVALID, "memcpy_async: unknown copy kind %d", (int)kind);
  if (bytes == 0) return PM_OK;
  if (!dst || !src)
    return pm__set_error(PM_ERR_INVALID, "memcpy_async: %s pointer is NULL",
                         dst ? "source" : "destination");
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, ck, cu_stream(stream));
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaMemcpyAsync(%p, %p, %zu, %s, stream %p)", dst,
                         src, bytes, kind_name(ck), (void *)stream);
  return PM_OK;
}

/* cudaMemcpyBatchAsync: one driver call for many copies, which the driver may spread over the
 * copy engines; a loop of cudaMemcpyAsync pays a launch per piece (17.5 GB/s for 64 KiB pieces
 * on an H200, against 40 in one batch). It refuses the legacy NULL stream: loop there. */
static pm_status_t cuda_memcpy_batch_async(void *const *dsts, const void *const *srcs,
                                           const size_t *sizes, size_t count, pm_stream_t stream) {
  if (count == 0) return PM_OK;
  if (!dsts || !srcs || !sizes)
    return pm__set_error(PM_ERR_INVALID, "memcpy_batch_async: NULL array");
  if (!stream || count == 1) {
    for (size_t i = 0; i < count; i++) {
      pm_status_t st = cuda_memcpy_async(dsts[i], srcs[i], sizes[i], PM_COPY_DEFAULT, stream);
      if (st != PM_OK) return st;
    }
    return PM_OK;
  }
  struct cudaMemcpyAttributes attr;
  memset(&attr, 0, sizeof attr);
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream; /* as cudaMemcpyAsync: after earlier work */
  size_t first = 0;
  cudaError_t e =
      cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attr, &first, 1, cu_stream(stream));
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaMemcpyBatchAsync(%zu copies, stream %p)", count,
                         (void *)stream);
  return PM_OK;
}

static pm_status_t cuda_memcpy_sync(void *dst, const void *src, size_t bytes, pm_copy_kind_t kind) {
  enum cudaMemcpyKind ck = cudaMemcpyDefault;
  if (to_cuda_kind(kind, &ck) != 0)
    return pm__set_error(PM_ERR_INVALID, "memcpy_sync: unknown copy kind %d", (int)kind);
  if (bytes == 0) return PM_OK;
  if (!dst || !src)
    return pm__set_error(PM_ERR_INVALID, "memcpy_sync: %s pointer is NULL",
                         dst ? "source" : "destination");
  cudaError_t e = cudaMemcpy(dst, src, bytes, ck);
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaMemcpy(%p, %p, %zu, %s)", dst, src, bytes,
                         kind_name(ck));
  /* cudaMemcpy from pageable memory may return once the source sits in the driver's staging
   * buffer; pm_memcpy promises the bytes have arrived. */
  e = cudaStreamSynchronize(NULL);
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_BACKEND, "cudaStreamSynchronize after cudaMemcpy");
  return PM_OK;
}

static pm_status_t cuda_launch_batch_copy(const pm__copy_desc_t *desc, size_t count,
                                          pm_stream_t stream) {
  if (count == 0) return PM_OK;
  pm_status_t st = load_kernels();
  if (st != PM_OK) return st;
  return pm__launch_batch_copy(desc, count, (struct CUstream_st *)cu_stream(stream));
}

/* Asked per call (the current device may differ between calls and threads); a device attribute
 * query is a lookup in the runtime, well under a microsecond. */
static int cuda_kernel_host_access(void) {
  int dev = 0, uva = 0, host_ptr = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&uva, cudaDevAttrUnifiedAddressing, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&host_ptr, cudaDevAttrCanUseHostPointerForRegisteredMem, dev) !=
          cudaSuccess) {
    (void)cudaGetLastError(); /* "no" is the answer; leave no error behind for others */
    return 0;
  }
  return uva && host_ptr;
}

static pm_status_t cuda_launch_busy(pm_stream_t stream, double seconds) {
  /* !(x >= 0) also rejects NaN. */
  if (!(seconds >= 0.0) || seconds > PM__BUSY_MAX_SECONDS)
    return pm__set_error(PM_ERR_INVALID, "launch_busy: %g seconds is not in [0, %g]", seconds,
                         PM__BUSY_MAX_SECONDS);
  uint64_t ns = (uint64_t)(seconds * 1e9 + 0.5);
  pm_status_t st = load_kernels();
  if (st != PM_OK) return st;
  return pm__launch_busy_kernel(ns, (struct CUstream_st *)cu_stream(stream));
}

static pm_status_t cuda_launch_host_func(pm_stream_t stream, void (*fn)(void *), void *arg) {
  if (!fn) return pm__set_error(PM_ERR_INVALID, "launch_host_func: fn is NULL");
  cudaError_t e = cudaLaunchHostFunc(cu_stream(stream), fn, arg);
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_NOMEM, "cudaLaunchHostFunc(stream %p, fn, %p)",
                         (void *)stream, arg);
  return PM_OK;
}

static int cuda_pointer_kind(const void *ptr) {
  if (!ptr) return PM__PTR_OTHER;
  struct cudaPointerAttributes a;
  memset(&a, 0, sizeof a);
  cudaError_t e = cudaPointerGetAttributes(&a, ptr);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return PM__PTR_OTHER;
  }
  if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) return PM__PTR_DEVICE;
  /* cudaMemoryTypeHost: page-locked by cudaHostAlloc or cudaHostRegister, whoever called it. */
  return a.type == cudaMemoryTypeHost ? PM__PTR_PINNED : PM__PTR_OTHER;
}

const pm__backend_t pm__backend_cuda = {
    .name = "cuda",
    .kind = PM_BACKEND_CUDA,
    .init = cuda_init,
    .shutdown = cuda_shutdown,
    .device_count = cuda_device_count,
    .device_info = cuda_device_info,
    .set_device = cuda_set_device,
    .get_device = cuda_get_device,
    .device_synchronize = cuda_device_synchronize,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .host_register = cuda_host_register,
    .host_unregister = cuda_host_unregister,
    .host_device_pointer = cuda_host_device_pointer,
    .device_alloc = cuda_device_alloc,
    .device_free = cuda_device_free,
    .device_memset_async = cuda_device_memset_async,
    .managed_alloc = cuda_managed_alloc,
    .managed_free = cuda_managed_free,
    .managed_prefetch = cuda_managed_prefetch,
    .stream_create = cuda_stream_create,
    .stream_destroy = cuda_stream_destroy,
    .stream_synchronize = cuda_stream_synchronize,
    .stream_query = cuda_stream_query,
    .stream_wait_event = cuda_stream_wait_event,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .event_query = cuda_event_query,
    .event_synchronize = cuda_event_synchronize,
    .event_elapsed = cuda_event_elapsed,
    .memcpy_async = cuda_memcpy_async,
    .memcpy_sync = cuda_memcpy_sync,
    .launch_busy = cuda_launch_busy,
    .launch_host_func = cuda_launch_host_func,
    .pointer_kind = cuda_pointer_kind,
    .memcpy_batch_async = cuda_memcpy_batch_async,
    .launch_batch_copy = cuda_launch_batch_copy,
    .kernel_host_access = cuda_kernel_host_access,
};
