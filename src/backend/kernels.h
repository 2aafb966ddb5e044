/*
 * DESIGN: the C-callable face of kernels.cu (the only device code in pinmem). This header pulls
 * in no CUDA header, so any file may include it: streams are passed as `struct CUstream_st *`,
 * which is exactly what cudaStream_t is (and what a pm_stream_t is under the cuda backend).
 * The launchers live in backend_cuda.c (the kernels run from PTX loaded through the driver).
 *
 * The checksum is defined here once, for the device kernel and for the host reference alike,
 * so a buffer can be hashed where it lies and compared with the bytes it came from:
 *   the bytes are read as little-endian 64-bit words w[i] at offsets 8*i from the start pointer
 *   (whatever its alignment), the last partial word padded with zero bytes;
 *   checksum = pm__checksum_mix(bytes, ~0) + sum_i pm__checksum_mix(w[i], i)   (mod 2^64).
 * The sum makes it independent of the order the device adds the terms in; mixing each word with
 * its index makes it sensitive to moved words, and zero words still contribute, so a buffer of
 * zeros never passes for a copy of real data.
 */
#ifndef PINMEM_KERNELS_H
#define PINMEM_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "pinmem.h"

#if defined(__CUDACC__)
#define PM__HOST_DEVICE __host__ __device__
#else
#define PM__HOST_DEVICE
#endif

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st; /* cudaStream_t is `struct CUstream_st *` */

/* One piece of a kernel-driven batch copy (backend op launch_batch_copy): every byte of
 * [src, src + bytes) goes to dst; both addresses must be usable in a kernel. */
typedef struct pm__copy_desc {
  const void *src;
  void *dst;
  uint64_t bytes;
} pm__copy_desc_t;

/* Descriptors per kernel launch: they travel as the kernel's parameters (a __grid_constant__
 * struct of about 24 KiB, within the 32 KiB that sm_70 and newer accept), so no descriptor
 * memory has to outlive the call. */
#define PM__BATCH_DESCS_PER_LAUNCH 1024

/* The batch copy kernel's one parameter, by value (the same layout in C and in the PTX). */
typedef struct pm__batch_params {
  unsigned count;
  pm__copy_desc_t d[PM__BATCH_DESCS_PER_LAUNCH];
} pm__batch_params_t;

/* The same for drivers whose JIT takes PTX ISA 8.0 at most (r525): 4 + 8 + 180 * 24 bytes stay
 * within the 4352 parameter bytes that PTX ISA before 8.1 allows. */
#define PM__BATCH_DESCS_SMALL 180
typedef struct pm__batch_params_small {
  unsigned count;
  pm__copy_desc_t d[PM__BATCH_DESCS_SMALL];
} pm__batch_params_small_t;

/* Launch geometry shared by kernels.cu (its __launch_bounds__) and the launchers. */
#define PM__CHECKSUM_THREADS 256 /* a multiple of the warp size (full-mask shuffles) */
#define PM__CHECKSUM_MAX_BLOCKS 4096
#define PM__BATCH_THREADS 256

/* splitmix64's finaliser over the word and its index: a cheap, well-mixed 64-bit function. */
PM__HOST_DEVICE static inline uint64_t pm__checksum_mix(uint64_t word, uint64_t index) {
  uint64_t x = word ^ (index * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull);
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

/* Host reference of the checksum (plain C; valid for any pointer alignment and size). */
static inline uint64_t pm__checksum_host(const void *ptr, size_t bytes) {
  const unsigned char *p = (const unsigned char *)ptr;
  size_t nfull = bytes / 8, rem = bytes % 8, i;
  uint64_t sum = pm__checksum_mix((uint64_t)bytes, ~(uint64_t)0);
  for (i = 0; i < nfull; i++) {
    uint64_t w = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(&w, p + 8 * i, 8); /* one unaligned load */
#else
    int k;
    for (k = 0; k < 8; k++) w |= (uint64_t)p[8 * i + (size_t)k] << (8 * k);
#endif
    sum += pm__checksum_mix(w, (uint64_t)i);
  }
  if (rem) {
    uint64_t w = 0;
    size_t k;
    for (k = 0; k < rem; k++) w |= (uint64_t)p[8 * nfull + k] << (8 * k);
    sum += pm__checksum_mix(w, (uint64_t)nfull);
  }
  return sum;
}

#if defined(PINMEM_HAVE_CUDA) && !defined(__CUDACC__)
/* backend_cuda.c. Queue the checksum of [dptr, dptr+bytes) (any device-readable memory: device,
 * managed, mapped pinned) on `stream`; the 64-bit result lands in *dresult (device-writable,
 * 8-byte aligned) when the stream reaches it. bytes may be 0. Fails (with pm_last_error detail)
 * before queueing anything, or with the launch error; PM_ERR_UNSUPPORTED when the kernels could
 * not be loaded on this device (pm_backend_info says why). */
pm_status_t pm__launch_checksum(const void *dptr, size_t bytes, uint64_t *dresult,
                                struct CUstream_st *stream);
#endif /* PINMEM_HAVE_CUDA */

#ifdef __cplusplus
}
#endif

#endif /* PINMEM_KERNELS_H */
