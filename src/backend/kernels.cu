/*
 * DESIGN: pinmem's device code. It is compiled to PTX (`make ptx`, tools/gen_ptx.py), and the
 * PTX is committed as src/backend/kernels_ptx.h, so no build needs nvcc: backend_cuda.c loads
 * that PTX through the driver's JIT on first use per context (cuModuleLoadDataEx) and launches
 * the kernels by name with cuLaunchKernel. The host_ptx test fails when the committed PTX and
 * this file disagree (byte for byte where the same nvcc release exists). The launch geometry lives in backend_cuda.c; the
 * constants both sides need (block sizes, descriptor counts) live in kernels.h.
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
 * Kernels are extern "C" so their PTX names are the plain names backend_cuda.c asks for.
 */
#include <stdint.h>

#include "kernels.h"

#if !defined(PM__PTX_LARGE_PARAMS)
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

extern "C" __global__ void pm_busy_kernel(uint64_t ns) {
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

extern "C" __global__ void __launch_bounds__(PM__CHECKSUM_THREADS)
    pm_checksum_kernel(const unsigned char *__restrict__ p, size_t bytes,
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
#endif /* !PM__PTX_LARGE_PARAMS */

/* One block per piece. Pieces whose source and destination share their alignment modulo 16 are
 * copied in 16-byte words (4 loads in flight per thread before the stores, so each SM keeps
 * enough reads outstanding to cover the latency of reading host memory over PCIe); the rest byte
 * by byte. __grid_constant__ keeps the descriptors in the parameter bank: indexing them needs no
 * per-thread copy of the whole array. */
__device__ __forceinline__ void copy_pieces(const pm__copy_desc_t *d, unsigned count) {
  for (unsigned i = blockIdx.x; i < count; i += gridDim.x) {
    const unsigned char *s = static_cast<const unsigned char *>(d[i].src);
    unsigned char *t = static_cast<unsigned char *>(d[i].dst);
    size_t n = (size_t)d[i].bytes;
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

#if defined(PM__PTX_LARGE_PARAMS)
/* Parameters above 4352 bytes need PTX ISA 8.1 (CUDA 12.1, driver r530): this kernel is the
 * module of its own (pm__kernels_ptx_large) that drivers from r530 on load. */
static_assert(sizeof(pm__batch_params_t) <= 32000, "kernel parameters are limited to 32 KiB");
extern "C" __global__ void __launch_bounds__(PM__BATCH_THREADS)
    pm_batch_copy_kernel(const __grid_constant__ pm__batch_params_t p) {
  copy_pieces(p.d, p.count);
}
#else
/* The same copy with parameters within the 4352 bytes every PTX ISA allows, for the r525
 * driver (CUDA 12.0), whose JIT takes PTX ISA 8.0 at most. */
static_assert(sizeof(pm__batch_params_small_t) <= 4352, "PTX ISA 8.0 allows 4352 parameter bytes");
extern "C" __global__ void __launch_bounds__(PM__BATCH_THREADS)
    pm_batch_copy_kernel_small(const __grid_constant__ pm__batch_params_small_t p) {
  copy_pieces(p.d, p.count);
}
#endif
