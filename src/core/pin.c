/*
 * DESIGN: fast cold pinning. cudaHostAlloc of a large block is slow because the driver faults
 * in and locks the pages one thread at a time (docs/performance.md, cold pinning). Here the
 * pool instead maps anonymous memory, asks for transparent huge pages (512x fewer page faults),
 * faults it in from several threads at once (pm__parallel_for), and only then registers it with
 * the backend (cudaHostRegister / mlock), which is quick on memory that is already present.
 *
 * The mapping starts on a 2 MiB boundary (over-map by 2 MiB and trim both ends) so the kernel
 * can back it with huge pages from the first byte, and the touch work is cut into 2 MiB-aligned
 * pieces so no two threads fault the same huge page.
 *
 * NUMA: with a node asked for, the mapping is bound to prefer it (numa_place.c) before the touch,
 * so the touching threads, wherever they run, fault the pages in on that node.
 *
 * Invariants: on success the range [ptr, ptr + align_up(bytes, page)) is mapped, present and
 * registered; pm__fast_unpin undoes exactly that. No locks are held here.
 */
#include <errno.h>
#include <string.h>
#include <sys/mman.h>

#include "internal.h"

#define PM__HUGE (2u * 1024 * 1024)
#define PM__TOUCH_STRIDE 4096u

typedef struct pm__touch_ctx {
  char *base;
  size_t size;
} pm__touch_ctx_t;

static void touch_piece(void *vctx, size_t i) {
  const pm__touch_ctx_t *c = vctx;
  size_t start = i * PM__HUGE;
  size_t end = PM__MIN(start + PM__HUGE, c->size);
  /* One write per 4 KiB page: it faults in the page whatever its size (with THP the first
   * write maps the whole huge page and the rest are cheap). Writing zero keeps the memory as
   * the mmap contract promises it. */
  volatile char *p = (volatile char *)c->base;
  for (size_t off = start; off < end; off += PM__TOUCH_STRIDE) p[off] = 0;
}

pm_status_t pm__fast_pin(const pm__backend_t *b, size_t bytes, unsigned register_flags, int threads,
                         bool huge_pages, void **ptr_out) {
  bool bound;
  return pm__fast_pin_node(b, bytes, register_flags, threads, huge_pages, -1, &bound, ptr_out);
}

pm_status_t pm__fast_pin_node(const pm__backend_t *b, size_t bytes, unsigned register_flags,
                              int threads, bool huge_pages, int node, bool *bound_out,
                              void **ptr_out) {
  *bound_out = false;
  if (!b || !ptr_out) return pm__set_error(PM_ERR_INVALID, "pm__fast_pin: NULL argument");
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "pm__fast_pin: bytes is 0");
  size_t page = pm__page_size();
  if (bytes > SIZE_MAX - PM__HUGE - page)
    return pm__set_error(PM_ERR_INVALID, "pm__fast_pin: %zu bytes is too large", bytes);
  size_t size = pm__align_up(bytes, page);
  size_t map_len = size + PM__HUGE;

  void *raw = mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    int e = errno;
    return pm__set_error(PM_ERR_NOMEM, "mmap(%zu bytes) for pinned memory failed: %s", map_len,
                         strerror(e));
  }
  uintptr_t r = (uintptr_t)raw;
  uintptr_t start = pm__align_up(r, PM__HUGE);
  size_t head = start - r;
  size_t tail = map_len - head - size;
  if (head) munmap(raw, head);
  if (tail) munmap((void *)(start + size), tail);
  char *base = (char *)start;

  /* Failure only means no huge pages (THP off or not built in): the touch still works. */
  if (huge_pages) (void)madvise(base, size, MADV_HUGEPAGE);
  /* The policy must be on the mapping before the first touch places the pages; a refusal is
   * counted by numa_place.c and the memory is pinned where the kernel puts it. */
  bool bound = node >= 0 && pm__numa_bind(base, size, node);

  pm__touch_ctx_t ctx = {base, size};
  size_t pieces = (size + PM__HUGE - 1) / PM__HUGE;
  pm__parallel_for(threads < 1 ? 1 : threads, pieces, touch_piece, &ctx);

  pm_status_t st = b->host_register(base, size, register_flags);
  if (st != PM_OK) {
    munmap(base, size);
    return pm__wrap_error(st, "pinning %zu bytes (mmap + touch + register)", size);
  }
  *bound_out = bound;
  *ptr_out = base;
  return PM_OK;
}

pm_status_t pm__fast_unpin(const pm__backend_t *b, void *ptr, size_t bytes) {
  if (!b || !ptr || bytes == 0)
    return pm__set_error(PM_ERR_INVALID, "pm__fast_unpin: NULL pointer or 0 bytes");
  size_t size = pm__align_up(bytes, pm__page_size());
  pm_status_t st = b->host_unregister(ptr, size);
  if (st != PM_OK) {
    /* Keep the mapping. The backend may still hold the registration, and with it the pages
     * (they stay locked whatever we do); unmapped, the address range could be handed to a later
     * mmap of ours, whose registration would then fail as overlapping. Leaking the range is
     * the lesser harm, and the error says so. */
    return pm__wrap_error(st, "unpinning %p (%zu bytes): the range stays mapped and is not reused",
                          ptr, size);
  }
  if (munmap(ptr, size) != 0) {
    int e = errno;
    st = pm__set_error(PM_ERR_INVALID, "munmap(%p, %zu) failed: %s", ptr, size, strerror(e));
  }
  return st;
}
