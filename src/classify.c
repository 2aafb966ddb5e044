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

/* If ptr is in a tracked range, [ptr, ptr + bytes) must stay inside it. */
pm_status_t pm__check_span(const char *fn, const char *what, const void *ptr, size_t bytes,
                              pm__range_t *r, bool *known) {
  *known = pm__registry_find(ptr, r);
  if (!*known) return PM_OK;
  size_t room = r->base + r->size - (uintptr_t)ptr;
  if (bytes > room)
    return pm__set_error(PM_ERR_INVALID,
                         "%s: %zu bytes at %s %p overrun %s [%p, +%zu) (%zu bytes left)", fn, bytes,
                         what, ptr, pm__memory_kind_desc(r->kind), (void *)r->base, r->size, room);
  return PM_OK;
}

static int tracked_side(const pm__range_t *r, bool known) {
  if (!known) return -1;
  if (r->kind == PM_MEMORY_DEVICE) return 1;
  /* Mapped pinned memory has a device address too (the same one under unified addressing), so
   * kernels and copies may use it from either side. */
  if ((r->kind == PM_MEMORY_POOL || r->kind == PM_MEMORY_REGISTERED) && !r->dev_base) return 0;
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
  pm__range_t rd, rs;
  bool kd, ks;
  pm_status_t st = pm__check_span(fn, "dst", dst, bytes, &rd, &kd);
  if (st == PM_OK) st = pm__check_span(fn, "src", src, bytes, &rs, &ks);
  if (st != PM_OK) return st;
  int dside = tracked_side(&rd, kd), sside = tracked_side(&rs, ks);

  if (*kind == PM_COPY_DEFAULT) {
    /* Inferred here for every backend, so the backend always gets an explicit direction.
     * Managed memory counts as device memory (the backend's pointer_kind says so too). */
    int dd = kd ? (rd.kind == PM_MEMORY_DEVICE || rd.kind == PM_MEMORY_MANAGED)
                : b->pointer_kind(dst) == PM__PTR_DEVICE;
    int sd = ks ? (rs.kind == PM_MEMORY_DEVICE || rs.kind == PM_MEMORY_MANAGED)
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

