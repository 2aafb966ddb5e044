/*
 * DESIGN: pinmem's device code, behind the C launchers declared in kernels.h.
 *
 * - busy kernel: one thread spins on %globaltimer (the GPU's nanosecond clock) for a requested
 *   time. It stands in for compute in tests and benchmarks: it occupies its stream for a known
 *   time while using almost nothing of the GPU, so copies on other streams can overlap it.
 * - checksum kernel: hashes bytes where they lie (definition and host reference in kernels.h).
 *   Each thread sums the terms of a grid-stride set of words, a warp adds its threads' sums with
 *   shuffles, and one atomicAdd per warp folds them into the result; addition mod 2^64 is
 *   commutative, so the result does not depend on the scheduling.
 * - batch copy kernel: many pieces in one launch, one thread block each, reading and writing
 *   wherever the pointers lead (device memory, or pinned host memory through PCIe): a gather or
 *   scatter that costs one launch per 1024 pieces instead of one DMA setup per piece.
 *
 * Launches go through cudaLaunchKernel, whose return code is the launch's own status (rather
 * than whatever cudaGetLastError holds from earlier calls).
 */
/* nvcc generates a host stub for each kernel that caches the kernel handle in a function-local
 * static with a dynamic initialiser; thread-safe initialisation of it needs the C++ runtime
 * (__cxa_guard_*, the personality routine), and pinmem links as C: libstdc++ is on neither its
 * link line nor its users'. The stubs only run for <<<>>> launches, which pinmem never makes (it
 * launches by cudaLaunchKernel), so their statics need no guard. The pragma survives into the
 * host compilation, unlike a #define (nvcc re-preprocesses the stubs); nvcc's front end does not
 * know it, hence the diagnostic suppression. Nothing else here may need the C++ runtime (no new,
 * exceptions, iostream, function-local statics). A CMake-level alternative would be
 * -Xcompiler=-fno-threadsafe-statics for this file. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma nv_diag_suppress 1675
#pragma GCC optimize("no-threadsafe-statics")
#pragma nv_diag_default 1675
#endif

#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

/* status.c (internal.h is C: it includes <stdatomic.h>, which C++ compilers need not accept). */
extern "C" pm_status_t pm__set_error(pm_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

namespace {

constexpr unsigned kChecksumThreads = 256; /* a multiple of the warp size (full-mask shuffles) */
constexpr unsigned kChecksumMaxBlocks = 4096;

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void busy_kernel(uint64_t ns) {
  const uint64_t start = globaltimer_ns();
  /* Unsigned difference: a timer that stepped backwards ends the spin instead of hanging it. */
  while (globaltimer_ns() - start < ns) {
    __nanosleep(200); /* leave the SM's issue slots to real work */
  }
}

__device__ __forceinline__ uint64_t load_le_bytes(const unsigned char *p, unsigned n) {
  uint64_t w = 0;
  for (unsigned k = 0; k < n; k++) w |= (uint64_t)p[k] << (8 * k);
  return w;
}

__global__ void __launch_bounds__(kChecksumThreads)
    checksum_kernel(const unsigned char *__restrict__ p, size_t bytes,
                    unsigned long long *__restrict__ out) {
  const size_t nfull = bytes / 8;
  const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  uint64_t acc = 0;

  if (((uintptr_t)p & 7u) == 0) {
    const uint64_t *__restrict__ w = reinterpret_cast<const uint64_t *>(p);
    for (size_t i = tid; i < nfull; i += stride) acc += pm__checksum_mix(w[i], (uint64_t)i);
  } else {
    for (size_t i = tid; i < nfull; i += stride)
      acc += pm__checksum_mix(load_le_bytes(p + 8 * i, 8), (uint64_t)i);
  }
  if (tid == 0) {
    const unsigned rem = (unsigned)(bytes % 8);
    if (rem) acc += pm__checksum_mix(load_le_bytes(p + 8 * nfull, rem), (uint64_t)nfull);
    acc += pm__checksum_mix((uint64_t)bytes, ~(uint64_t)0);
  }

  /* Every thread of the block reaches this point (no early return), so the full mask holds. */
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
  if ((threadIdx.x & 31u) == 0) atomicAdd(out, (unsigned long long)acc);
}

}  // namespace

/* ---- batch copy ------------------------------------------------------------------------------ */

constexpr int kBatchThreads = 256;

struct BatchParams {
  unsigned count;
  pm__copy_desc_t d[PM__BATCH_DESCS_PER_LAUNCH];
};

/* ---- error mapping (shared with backend_cuda.c) ---------------------------------------- */

static pm_status_t map_cuda_error(cudaError_t e, pm_status_t oom_status) {
  switch (e) {
    case cudaSuccess:
      return PM_OK;
    case cudaErrorNotReady:
      return PM_NOT_READY;
    case cudaErrorMemoryAllocation:
      return oom_status;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return PM_ERR_NO_DEVICE;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidMemcpyDirection:
      return PM_ERR_INVALID;
    case cudaErrorHostMemoryAlreadyRegistered:
      return PM_ERR_OVERLAP;
    case cudaErrorHostMemoryNotRegistered:
      return PM_ERR_NOT_FOUND;
    case cudaErrorNotSupported:
      return PM_ERR_UNSUPPORTED;
    default:
      return PM_ERR_BACKEND;
  }
}

extern "C" pm_status_t pm__cuda_fail(int cuda_error, pm_status_t oom_status, const char *call_fmt,
                                      ...) {
  cudaError_t e = (cudaError_t)cuda_error;
  char call[512];
  va_list ap;
  va_start(ap, call_fmt);
  vsnprintf(call, sizeof call, call_fmt, ap);
  va_end(ap);
  (void)cudaGetLastError();
  pm_status_t st = map_cuda_error(e, oom_status);
  /* Queries handle cudaErrorNotReady themselves; anywhere else it is a failure. And a call
   * with cudaSuccess is a bug in the caller, never a success to report. */
  if (st == PM_NOT_READY) st = PM_ERR_BACKEND;
  if (st == PM_OK) st = PM_ERR_INTERNAL;
  return pm__set_error(st, "%s: %s (%s)", call, cudaGetErrorString(e), cudaGetErrorName(e));
}

static_assert(sizeof(BatchParams) <= 32000, "kernel parameters are limited to 32 KiB");

/* One block per piece. Pieces whose source and destination share their alignment modulo 16 are
 * copied in 16-byte words (4 loads in flight per thread before the stores, so each SM keeps
 * enough reads outstanding to cover the latency of reading host memory over PCIe); the rest byte
 * by byte. __grid_constant__ keeps the descriptors in the parameter bank: indexing them needs no
 * per-thread copy of the whole array. */
__global__ void __launch_bounds__(kBatchThreads)
    batch_copy_kernel(const __grid_constant__ BatchParams p) {
  for (unsigned i = blockIdx.x; i < p.count; i += gridDim.x) {
    const unsigned char *s = static_cast<const unsigned char *>(p.d[i].src);
    unsigned char *t = static_cast<unsigned char *>(p.d[i].dst);
    size_t n = (size_t)p.d[i].bytes;
    const size_t tid = threadIdx.x, step = blockDim.x;
    size_t head = (16 - ((uintptr_t)t & 15u)) & 15u;
    if (head > n) head = n;
    if ((((uintptr_t)s + head) & 15u) != 0) head = n; /* alignments differ: bytes only */
    for (size_t k = tid; k < head; k += step) t[k] = s[k];
    const uint4 *sv = reinterpret_cast<const uint4 *>(s + head);
    uint4 *tv = reinterpret_cast<uint4 *>(t + head);
    const size_t nv = (n - head) / 16;
    size_t j = tid;
    for (; j + 3 * step < nv; j += 4 * step) {
      uint4 a = sv[j], b = sv[j + step], c = sv[j + 2 * step], e = sv[j + 3 * step];
      tv[j] = a;
      tv[j + step] = b;
      tv[j + 2 * step] = c;
      tv[j + 3 * step] = e;
    }
    for (; j < nv; j += step) tv[j] = sv[j];
    for (size_t k = head + nv * 16 + tid; k < n; k += step) t[k] = s[k];
  }
}

extern "C" pm_status_t pm__launch_batch_copy(const pm__copy_desc_t *desc, size_t count,
                                             struct CUstream_st *stream) {
  if (count && !desc)
    return pm__set_error(PM_ERR_INVALID, "pm__launch_batch_copy: NULL descriptors");
  if (count == 0) return PM_OK;
  /* On the heap (24 KiB is much for a caller thread's stack); cudaLaunchKernel copies the
   * parameters before it returns, so one buffer serves every launch of this call. */
  BatchParams *params = static_cast<BatchParams *>(malloc(sizeof(BatchParams)));
  if (!params)
    return pm__set_error(PM_ERR_NOMEM, "pm__launch_batch_copy: out of host memory");
  pm_status_t st = PM_OK;
  for (size_t done = 0; done < count && st == PM_OK;) {
    unsigned n = (unsigned)(count - done < PM__BATCH_DESCS_PER_LAUNCH ? count - done
                                                                      : PM__BATCH_DESCS_PER_LAUNCH);
    params->count = n;
    memcpy(params->d, desc + done, n * sizeof *desc);
    void *args[] = {params};
    cudaError_t e = cudaLaunchKernel(reinterpret_cast<const void *>(&batch_copy_kernel), dim3(n),
                                     dim3(kBatchThreads), args, 0, stream);
    if (e != cudaSuccess)
      st = pm__cuda_fail((int)e, PM_ERR_BACKEND,
                         "cudaLaunchKernel(batch copy kernel, %u pieces from %zu of %zu, stream "
                         "%p)",
                         n, done, count, (void *)stream);
    done += n;
  }
  free(params);
  return st;
}

extern "C" pm_status_t pm__kernels_preload(void) {
  struct cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, (const void *)busy_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, (const void *)checksum_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, (const void *)batch_copy_kernel);
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_BACKEND,
                         "cudaFuncGetAttributes (loading pinmem's kernels)");
  return PM_OK;
}

extern "C" pm_status_t pm__launch_busy_kernel(uint64_t ns, struct CUstream_st *stream) {
  void *args[] = {&ns};
  cudaError_t e = cudaLaunchKernel(reinterpret_cast<const void *>(&busy_kernel), dim3(1), dim3(1),
                                   args, 0, stream);
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_DEVICE_MEMORY,
                         "cudaLaunchKernel(busy kernel, 1x1, %llu ns, stream %p)",
                         (unsigned long long)ns, (void *)stream);
  return PM_OK;
}

extern "C" pm_status_t pm__launch_checksum(const void *dptr, size_t bytes, uint64_t *dresult,
                                           struct CUstream_st *stream) {
  if (!dresult || ((uintptr_t)dresult & 7u) != 0)
    return pm__set_error(PM_ERR_INVALID,
                         "pm__launch_checksum: result pointer %p is NULL or not 8-byte aligned",
                         (void *)dresult);
  if (!dptr && bytes > 0)
    return pm__set_error(PM_ERR_INVALID, "pm__launch_checksum: NULL data pointer for %zu bytes",
                         bytes);

  cudaError_t e = cudaMemsetAsync(dresult, 0, sizeof *dresult, stream);
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_DEVICE_MEMORY, "cudaMemsetAsync(%p, 0, 8, stream %p)",
                         (void *)dresult, (void *)stream);

  const size_t nwords = bytes / 8 + 1;
  size_t blocks = (nwords + kChecksumThreads - 1) / kChecksumThreads;
  if (blocks > kChecksumMaxBlocks) blocks = kChecksumMaxBlocks;
  if (blocks < 1) blocks = 1;

  const unsigned char *p = static_cast<const unsigned char *>(dptr);
  unsigned long long *out = reinterpret_cast<unsigned long long *>(dresult);
  void *args[] = {&p, &bytes, &out};
  e = cudaLaunchKernel(reinterpret_cast<const void *>(&checksum_kernel), dim3((unsigned)blocks),
                       dim3(kChecksumThreads), args, 0, stream);
  if (e != cudaSuccess)
    return pm__cuda_fail((int)e, PM_ERR_DEVICE_MEMORY,
                         "cudaLaunchKernel(checksum kernel, %zux%u, %p, %zu bytes, stream %p)",
                         blocks, kChecksumThreads, dptr, bytes, (void *)stream);
  return PM_OK;
}
