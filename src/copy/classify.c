/*
 * DESIGN: what a pointer is, asked in one place. The registry (registry.c) knows the memory
 * pinmem handed out or pinned (pool blocks, registrations, device and managed allocations); for
 * any other address the backend's pointer_kind says whether it is device memory or host memory
 * someone else pinned. The front door (api.c) and the copy engine (copy.c, copy_batch.c) both
 * classify through here, so a plain copy and an engine copy agree on every pointer.
 *
 * It sits in the copy layer's bottom: it calls the registry, the pool's block lookup and the
 * backend contract, nothing above them. No lock of its own.
 */
#include <string.h>

#include "internal.h"

const char *pm__memory_kind_desc(pm_memory_kind_t k) {
  switch (k) {
    case PM_MEMORY_POOL:
      return "a pinned block from pm_host_alloc";
    case PM_MEMORY_REGISTERED:
      return "memory registered with pm_register";
    case PM_MEMORY_MANAGED:
      return "managed memory from pm_managed_alloc";
    case PM_MEMORY_DEVICE:
      return "device memory from pm_device_alloc";
    case PM_MEMORY_PAGEABLE:
      break;
  }
  return "pageable memory";
}

pm_status_t pm__pointer_info(const void *ptr, pm_pointer_info_t *info_out) {
  pm_pointer_info_t info;
  memset(&info, 0, sizeof info);
  pm__range_t r;
  if (!ptr || !pm__registry_find(ptr, &r)) {
    info.kind = PM_MEMORY_PAGEABLE;
    *info_out = info;
    return PM_OK;
  }
  size_t off = (size_t)((uintptr_t)ptr - r.base);
  info.kind = r.kind;
  info.base = (void *)r.base;
  info.size = r.size;
  info.flags = r.flags & ~PM__REG_PENDING;
  info.in_use = 1;
  if (r.dev_base) info.device_ptr = (char *)r.dev_base + off;
  if (r.kind == PM_MEMORY_DEVICE || r.kind == PM_MEMORY_MANAGED) info.device_ptr = (void *)ptr;
  if (r.kind == PM_MEMORY_POOL) {
    info.pool = (pm_pool_t *)r.owner;
    info.in_use = 0;
    pm_status_t st = pm__pool_block_info((pm_pool_t *)r.owner, ptr, &info);
    if (st == PM_ERR_NOT_FOUND) {
      /* The segment was released between the registry lookup and this call: the address is no
       * longer pinned memory. */
      memset(&info, 0, sizeof info);
      info.kind = PM_MEMORY_PAGEABLE;
    } else if (st != PM_OK) {
      return pm__wrap_error(st, "pm_pointer_query(%p)", ptr);
    }
  }
  *info_out = info;
  return PM_OK;
}

/* If ptr is in a tracked range, [ptr, ptr + bytes) must stay inside it. The range is what
 * pm__pointer_info says: for pool memory the block, not the segment the registry holds (a copy
 * that ran past a block's end would write the next block, another caller's memory). */
pm_status_t pm__check_span(const char *fn, const char *what, const void *ptr, size_t bytes,
                           pm__range_t *r, bool *known) {
  pm_pointer_info_t info;
  pm_status_t st = pm__pointer_info(ptr, &info);
  if (st != PM_OK) return pm__wrap_error(st, "%s: %s", fn, what);
  *known = info.kind != PM_MEMORY_PAGEABLE;
  if (!*known) return PM_OK;
  if (info.kind == PM_MEMORY_POOL && !info.in_use)
    return pm__set_error(PM_ERR_STATE, "%s: %s %p lies in a pool block that was freed", fn, what,
                         ptr);
  uintptr_t base = (uintptr_t)info.base;
  *r = (pm__range_t){base, info.size, info.kind, info.flags, info.pool, NULL};
  /* device_ptr is the queried address's; device and managed memory are their own address */
  if (info.device_ptr && (info.kind == PM_MEMORY_POOL || info.kind == PM_MEMORY_REGISTERED))
    r->dev_base = (char *)info.device_ptr - ((uintptr_t)ptr - base);
  size_t room = r->base + r->size - (uintptr_t)ptr;
  if (bytes > room)
    return pm__set_error(PM_ERR_INVALID,
                         "%s: %zu bytes at %s %p overrun %s [%p, +%zu) (%zu bytes left)", fn, bytes,
                         what, ptr, pm__memory_kind_desc(r->kind), (void *)r->base, r->size, room);
  return PM_OK;
}

static int tracked_side(const pm__range_t *r, bool known) {
  if (!known) return -1;
  pm__mem_t k = pm__range_mem(r);
  if (k == PM__MEM_DEVICE) return 1;
  /* Mapped pinned memory has a device address too (the same one under unified addressing), so
   * kernels and copies may use it from either side. */
  if ((k == PM__MEM_PINNED || k == PM__MEM_PINNED_RO) && !r->dev_base) return 0;
  return -1; /* managed and mapped memory are valid on both sides */
}

static const char *copy_kind_name(pm_copy_kind_t k) {
  static const char *names[] = {"DEFAULT", "H2D", "D2H", "D2D", "H2H"};
  return (unsigned)k < 5 ? names[k] : "?";
}

pm_status_t pm__check_copy(const char *fn, const pm__backend_t *b, void *dst, const void *src,
                           size_t bytes, pm_copy_kind_t *kind) {
  if (!dst) return pm__set_error(PM_ERR_INVALID, "%s: dst is NULL", fn);
  if (!src) return pm__set_error(PM_ERR_INVALID, "%s: src is NULL", fn);
  if ((unsigned)*kind > PM_COPY_H2H)
    return pm__set_error(PM_ERR_INVALID, "%s: unknown copy kind %d", fn, (int)*kind);
  /* cudaMemcpy's result for ranges that share bytes is undefined (the host backend's memmove
   * would hide that): refused, as pm_copy_async refuses them. */
  if (pm__ranges_overlap(dst, src, bytes))
    return pm__set_error(PM_ERR_INVALID, "%s: src [%p, +%zu) and dst [%p, +%zu) overlap", fn, src,
                         bytes, dst, bytes);
  pm__range_t rd, rs;
  bool kd, ks;
  pm_status_t st = pm__check_span(fn, "dst", dst, bytes, &rd, &kd);
  if (st == PM_OK) st = pm__check_span(fn, "src", src, bytes, &rs, &ks);
  if (st != PM_OK) return st;
  int dside = tracked_side(&rd, kd), sside = tracked_side(&rs, ks);

  if (*kind == PM_COPY_DEFAULT) {
    /* Inferred here for every backend, so the backend always gets an explicit direction.
     * Managed memory counts as device memory (the backend's pointer_kind says so too). */
    int dd = kd ? (pm__range_mem(&rd) == PM__MEM_DEVICE || pm__range_mem(&rd) == PM__MEM_MANAGED)
                : b->pointer_kind(dst) == PM__PTR_DEVICE;
    int sd = ks ? (pm__range_mem(&rs) == PM__MEM_DEVICE || pm__range_mem(&rs) == PM__MEM_MANAGED)
                : b->pointer_kind(src) == PM__PTR_DEVICE;
    *kind = dd ? (sd ? PM_COPY_D2D : PM_COPY_H2D) : (sd ? PM_COPY_D2H : PM_COPY_H2H);
    return PM_OK;
  }
  int want_d = (*kind == PM_COPY_H2D || *kind == PM_COPY_D2D);
  int want_s = (*kind == PM_COPY_D2H || *kind == PM_COPY_D2D);
  if (dside >= 0 && dside != want_d)
    return pm__set_error(PM_ERR_INVALID, "%s: copy kind %s but dst %p is %s", fn,
                         copy_kind_name(*kind), dst, pm__memory_kind_desc(rd.kind));
  if (sside >= 0 && sside != want_s)
    return pm__set_error(PM_ERR_INVALID, "%s: copy kind %s but src %p is %s", fn,
                         copy_kind_name(*kind), src, pm__memory_kind_desc(rs.kind));
  return PM_OK;
}

/* ---- one vocabulary of memory kinds --------------------------------------------------------- */

const char *pm__mem_name(pm__mem_t k) {
  switch (k) {
    case PM__MEM_PAGEABLE:
      return "pageable host";
    case PM__MEM_PINNED:
      return "pinned host";
    case PM__MEM_PINNED_RO:
      return "read-only registered host";
    case PM__MEM_PINNED_OTHER:
      return "pinned host (pinned outside pinmem)";
    case PM__MEM_PINNED_PART:
      return "host, pinned outside pinmem in part";
    case PM__MEM_MANAGED:
      return "managed";
    case PM__MEM_DEVICE:
      return "device";
  }
  return "?";
}

pm__mem_t pm__range_mem(const pm__range_t *r) {
  switch (r->kind) {
    case PM_MEMORY_POOL:
      return PM__MEM_PINNED;
    case PM_MEMORY_REGISTERED:
      return (r->flags & PM_REGISTER_READ_ONLY) ? PM__MEM_PINNED_RO : PM__MEM_PINNED;
    case PM_MEMORY_MANAGED:
      return PM__MEM_MANAGED;
    case PM_MEMORY_DEVICE:
      return PM__MEM_DEVICE;
    case PM_MEMORY_PAGEABLE:
      break;
  }
  return PM__MEM_PAGEABLE;
}

/* An address the registry does not track, as the backend sees it. Pinned memory of another
 * library takes the direct path when the copy's last byte is pinned too (the backend gives no
 * extent; a second query is cheap: docs/performance.md, small copies); a range running on past
 * it is staged. */
static pm__mem_t foreign_side(const pm__backend_t *b, const void *p, size_t bytes) {
  int k = b->pointer_kind(p);
  if (k == PM__PTR_DEVICE) return PM__MEM_DEVICE;
  if (k != PM__PTR_PINNED) return PM__MEM_PAGEABLE;
  if (bytes > 1 && b->pointer_kind((const char *)p + bytes - 1) != PM__PTR_PINNED)
    return PM__MEM_PINNED_PART;
  return PM__MEM_PINNED_OTHER;
}

pm_status_t pm__classify(const pm__backend_t *b, const void *p, size_t bytes, const char *name,
                         pm__mem_t *kind_out, uintptr_t *base_out, size_t *size_out) {
  uintptr_t a = (uintptr_t)p;
  pm_pointer_info_t info = {0}; /* filled on success; zeroed so no path reads it unset */
  pm_status_t st = pm__pointer_info(p, &info);
  if (st != PM_OK) return pm__wrap_error(st, "%s %p", name, p);
  pm__mem_t k;
  switch (info.kind) {
    case PM_MEMORY_PAGEABLE:
      /* Device memory of other allocators, and host memory other libraries pinned, are unknown
       * to the registry; the backend knows them. */
      *kind_out = foreign_side(b, p, bytes);
      *base_out = 0;
      *size_out = 0;
      return PM_OK;
    case PM_MEMORY_POOL:
      if (!info.in_use)
        return pm__set_error(PM_ERR_STATE, "%s %p lies in a pool block that was freed", name, p);
      k = PM__MEM_PINNED;
      break;
    case PM_MEMORY_REGISTERED:
      k = (info.flags & PM_REGISTER_READ_ONLY) ? PM__MEM_PINNED_RO : PM__MEM_PINNED;
      break;
    case PM_MEMORY_MANAGED:
      k = PM__MEM_MANAGED;
      break;
    case PM_MEMORY_DEVICE:
      k = PM__MEM_DEVICE;
      break;
    default:
      return pm__set_error(PM_ERR_INTERNAL, "%s %p: unknown memory kind %d", name, p,
                           (int)info.kind);
  }
  uintptr_t base = (uintptr_t)info.base;
  if (info.size && (a < base || a - base > info.size || bytes > info.size - (a - base)))
    return pm__set_error(PM_ERR_INVALID,
                         "%s range [%p, +%zu bytes) runs past the end of its %s memory "
                         "(%p, %zu bytes)",
                         name, p, bytes, pm__mem_name(k), info.base, info.size);
  *kind_out = k;
  *base_out = base;
  *size_out = info.size;
  return PM_OK;
}
