/*
 * DESIGN: the byte mover of staged copies (option copy_memcpy).
 *
 * A staged copy of pageable memory moves every byte twice through host DRAM: a thread copies it
 * into pinned bounce memory, then the DMA engine reads it from there. How the thread stores its
 * bytes decides how much DRAM traffic that costs, and the staged rate can follow the host's
 * memory bandwidth rather than the link (docs/performance.md). Three movers:
 *
 * - libc: the C library's memcpy. Its strategy changes with size and CPU (ordinary stores, which
 *   first read each destination line for ownership; or non-temporal stores for large copies).
 * - movsb: `rep movsb`. On CPUs with fast strings (ERMS) the microcode writes whole lines
 *   without reading them first and keeps them in the cache, where the DMA read can find them.
 * - stream: AVX2 loads and non-temporal (streaming) stores: no read for ownership, no cache
 *   pollution; the DMA engine then reads from DRAM.
 *
 * - auto: per step. Into the ring of an H2D copy, movsb, so the bytes stay in the cache for
 *   the DMA engine instead of taking a second pass through DRAM, where the host's writes slow
 *   the DMA's reads (bench copy's dma_under_h2h rows). That pays off only with a ring small
 *   enough for the cache, filled in pieces (copy_piece), not with a 128 MiB ring of whole
 *   chunks (docs/performance.md). Everywhere else (a whole-copy bounce block, D2H
 *   copy-out into the caller's memory) stream: those bytes are not read again soon.
 *
 * Which wins is a measurement (bench/gpu_sweep.sh, docs/performance.md). A mode the CPU
 * cannot run falls back to libc (pm__memcpy_effective says which ran). The result is always
 * the same bytes: the tests run every mode over odd sizes and alignments.
 *
 * Threads: no locks and no shared state but the CPU-feature answer, a relaxed atomic that every
 * thread computes alike; a mover touches only the caller's two buffers.
 */
#include <stdint.h>
#include <string.h>

#include "internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PM__X86_64 1
#include <immintrin.h>
#endif

#if PM__X86_64
static void copy_movsb(void *dst, const void *src, size_t n) {
  __asm__ volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
}

/* 128 bytes per step: four 32-byte loads, four streaming stores to a 32-byte aligned dst. */
__attribute__((target("avx2"))) static void copy_stream(void *dst, const void *src, size_t n) {
  char *d = dst;
  const char *s = src;
  size_t head = (32 - ((uintptr_t)d & 31)) & 31;
  if (head > n) head = n;
  memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  for (; n >= 128; n -= 128, d += 128, s += 128) {
    __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)s);
    __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)(s + 32));
    __m256i c = _mm256_loadu_si256((const __m256i *)(const void *)(s + 64));
    __m256i e = _mm256_loadu_si256((const __m256i *)(const void *)(s + 96));
    _mm256_stream_si256((__m256i *)(void *)d, a);
    _mm256_stream_si256((__m256i *)(void *)(d + 32), b);
    _mm256_stream_si256((__m256i *)(void *)(d + 64), c);
    _mm256_stream_si256((__m256i *)(void *)(d + 96), e);
  }
  /* Streaming stores are weakly ordered: fence them before anyone (a DMA queued next, another
   * thread) may read the bytes. */
  _mm_sfence();
  memcpy(d, s, n);
}

static int have_avx2(void) {
  static int cached = -1; /* benign race: every thread computes the same value */
  int v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
  if (v < 0) {
    __builtin_cpu_init();
    v = __builtin_cpu_supports("avx2") ? 1 : 0;
    __atomic_store_n(&cached, v, __ATOMIC_RELAXED);
  }
  return v;
}
#endif

int pm__memcpy_for(int mode, bool into_ring) {
  if (mode != PM__MEMCPY_AUTO) return mode;
  return into_ring ? PM__MEMCPY_MOVSB : PM__MEMCPY_STREAM;
}

int pm__memcpy_effective(int mode) {
  if (mode == PM__MEMCPY_AUTO) mode = PM__MEMCPY_STREAM;
#if PM__X86_64
  if (mode == PM__MEMCPY_MOVSB) return PM__MEMCPY_MOVSB;
  if (mode == PM__MEMCPY_STREAM && have_avx2()) return PM__MEMCPY_STREAM;
#endif
  (void)mode;
  return PM__MEMCPY_LIBC;
}

void pm__memcpy_mode(void *dst, const void *src, size_t n, int mode) {
  if (n == 0) return;
#if PM__X86_64
  switch (pm__memcpy_effective(mode)) {
    case PM__MEMCPY_MOVSB:
      copy_movsb(dst, src, n);
      return;
    case PM__MEMCPY_STREAM:
      copy_stream(dst, src, n);
      return;
    default:
      break;
  }
#endif
  (void)mode;
  memcpy(dst, src, n);
}
