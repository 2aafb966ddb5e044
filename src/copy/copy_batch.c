/*
 * DESIGN: plain backend copies of many items (pm_copy_batch_async's direct items, and
 * pm_memcpy_async's batch twin): every item is validated as pm_memcpy_async validates one,
 * before anything is queued; then the items go to the batch copy kernel (copy_batch option:
 * many small pieces in one launch, tiles of at most PM__BATCH_TILE bytes), to the backend's batch
 * copy call where it has one, or to one backend copy each.
 *
 * Part of the copy engine: it calls classify.c, the option table and the backend contract,
 * never the public front door. No lock of its own; the descriptor arrays live for the call only.
 */
#include <stdlib.h>

#include "internal.h"

/* The batch copy kernel's pieces: at most this many bytes each, so one thread block moves one
 * piece and the blocks of a launch share the work evenly whatever the item sizes. */
#define PM__BATCH_TILE ((size_t)64 << 10)
/* copy_batch=auto takes the kernel from this many items up, when they average at most
 * PM__BATCH_AUTO_MEAN bytes: many small pieces are where a DMA per piece loses the most. */
#define PM__BATCH_AUTO_MIN_ITEMS 64
#define PM__BATCH_AUTO_MEAN ((size_t)1 << 20)

static bool batch_wants_kernel(const pm__backend_t *b, size_t live, size_t total, bool kernel_ok) {
  if (!kernel_ok || live < 2 || !b->launch_batch_copy || !b->kernel_host_access) return false;
  long mode = pm__opt_int(PM__OPT_COPY_BATCH);
  if (mode == PM__BATCH_DMA) return false;
  if (mode == PM__BATCH_AUTO &&
      (live < PM__BATCH_AUTO_MIN_ITEMS || total / live > PM__BATCH_AUTO_MEAN))
    return false;
  return b->kernel_host_access() != 0;
}

/* The items as the kernel's pieces: each cut into tiles of at most PM__BATCH_TILE bytes. */
static pm_status_t batch_by_kernel(const pm__backend_t *b, const pm_copy_item_t *items,
                                   size_t count, pm_stream_t stream) {
  size_t n = 0;
  for (size_t i = 0; i < count; i++) n += (items[i].bytes + PM__BATCH_TILE - 1) / PM__BATCH_TILE;
  pm__copy_desc_t *d = malloc(n * sizeof *d);
  if (!d)
    return pm__set_error(PM_ERR_NOMEM, "pm_copy_batch_async: out of memory for %zu pieces", n);
  size_t k = 0;
  for (size_t i = 0; i < count; i++) {
    for (size_t off = 0; off < items[i].bytes; off += PM__BATCH_TILE) {
      d[k].src = (const char *)items[i].src + off;
      d[k].dst = (char *)items[i].dst + off;
      d[k].bytes = (uint64_t)PM__MIN(PM__BATCH_TILE, items[i].bytes - off);
      k++;
    }
  }
  pm_status_t st = b->launch_batch_copy(d, n, stream);
  free(d);
  return st;
}

pm_status_t pm__memcpy_batch_async(const pm_copy_item_t *items, size_t count, pm_copy_kind_t kind,
                                   pm_stream_t stream, bool kernel_ok) {
  PM__BACKEND_OR_RETURN(b);
  /* Every item is checked as pm_memcpy_async checks one, before anything is queued. */
  size_t live = 0, total = 0;
  for (size_t i = 0; i < count; i++) {
    pm_copy_kind_t k = kind;
    pm_status_t st =
        pm__check_copy("pm_copy_batch_async", b, items[i].dst, items[i].src, items[i].bytes, &k);
    if (st != PM_OK) return pm__wrap_error(st, "item %zu", i);
    if (k == PM_COPY_H2H) kernel_ok = false;
    if (items[i].bytes) live++;
    total += items[i].bytes;
  }
  if (batch_wants_kernel(b, live, total, kernel_ok))
    return batch_by_kernel(b, items, count, stream);
  if (!b->memcpy_batch_async || live < 2) {
    for (size_t i = 0; i < count; i++) {
      if (!items[i].bytes) continue;
      pm_copy_kind_t k = kind;
      (void)pm__check_copy("pm_copy_batch_async", b, items[i].dst, items[i].src, items[i].bytes,
                           &k);
      pm_status_t st = b->memcpy_async(items[i].dst, items[i].src, items[i].bytes, k, stream);
      if (st != PM_OK) return st;
    }
    return PM_OK;
  }
  void **dsts = malloc(live * sizeof *dsts);
  const void **srcs = malloc(live * sizeof *srcs);
  size_t *sizes = malloc(live * sizeof *sizes);
  pm_status_t st = PM_OK;
  if (!dsts || !srcs || !sizes) {
    st = pm__set_error(PM_ERR_NOMEM, "pm_copy_batch_async: out of memory for %zu items", live);
  } else {
    size_t j = 0;
    for (size_t i = 0; i < count; i++) {
      if (!items[i].bytes) continue;
      dsts[j] = items[i].dst;
      srcs[j] = items[i].src;
      sizes[j] = items[i].bytes;
      j++;
    }
    st = b->memcpy_batch_async(dsts, srcs, sizes, live, stream);
  }
  free(dsts);
  free((void *)srcs);
  free(sizes);
  return st;
}
