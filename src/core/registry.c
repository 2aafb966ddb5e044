/*
 * DESIGN: the process-wide registry of memory pinmem tracks: pool segments, registrations,
 * device and managed allocations. It answers "which tracked range holds this address?" for
 * pm_pointer_query, pm_host_free and copy-direction inference.
 *
 * Data structure: one array of pm__range_t sorted by base, grown by doubling. Lookups are a
 * binary search (O(log n)); add and remove shift the tail (O(n) memmove, but n is the number of
 * segments and registrations, small, and lookups are the hot path).
 *
 * Invariants: ranges are non-empty, do not wrap the address space and never overlap, so the
 * array is sorted by base and by end alike, and the only candidate holding an address is the
 * last range whose base is <= that address.
 *
 * Threads: a pthread rwlock, readers for lookups, a writer for add/remove. It is a leaf lock:
 * nothing (no allocation callback, no backend, no other pinmem lock) is called while holding it,
 * except realloc in add.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static pthread_rwlock_t reg_lock = PTHREAD_RWLOCK_INITIALIZER;
static pm__range_t *reg_ranges;
static size_t reg_count, reg_cap;

static const char *kind_name(pm_memory_kind_t kind) {
#define RANGE_CASE(name, value, text, range) \
  case name:                                 \
    return range;
  switch (kind) { PM_MEMORY_KIND_MAP(RANGE_CASE) }
#undef RANGE_CASE
  return "unknown";
}

/* Index of the first range with base > addr (0..reg_count). Caller holds the lock. */
static size_t upper_bound(uintptr_t addr) {
  size_t lo = 0, hi = reg_count;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (reg_ranges[mid].base <= addr)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* A range sharing a byte with [lo, hi), into *clash; *at gets upper_bound(lo). Caller holds the
 * lock. Ranges never overlap, so only the last range starting at or below lo and the first one
 * above it can. */
static bool overlap_locked(uintptr_t lo, uintptr_t hi, size_t *at, pm__range_t *clash) {
  size_t i = upper_bound(lo); /* ranges [0, i) start at or below lo */
  *at = i;
  if (i > 0 && reg_ranges[i - 1].base + reg_ranges[i - 1].size > lo) {
    *clash = reg_ranges[i - 1];
    return true;
  }
  if (i < reg_count && reg_ranges[i].base < hi) {
    *clash = reg_ranges[i];
    return true;
  }
  return false;
}

pm_status_t pm__registry_add(const pm__range_t *range) {
  if (!range || range->size == 0 || range->base + range->size < range->base)
    return pm__set_error(PM_ERR_INVALID, "registry: empty or wrapping range");
  uintptr_t lo = range->base, hi = range->base + range->size;
  pm__range_t clash;
  size_t i;

  pthread_rwlock_wrlock(&reg_lock);
  bool overlap = overlap_locked(lo, hi, &i, &clash);
  if (!overlap && reg_count == reg_cap) {
    size_t cap = reg_cap ? reg_cap * 2 : 64;
    pm__range_t *grown = realloc(reg_ranges, cap * sizeof *grown);
    if (!grown) {
      pthread_rwlock_unlock(&reg_lock);
      return pm__set_error(PM_ERR_NOMEM, "registry: realloc of %zu ranges failed", cap);
    }
    reg_ranges = grown;
    reg_cap = cap;
  }
  if (!overlap) {
    memmove(&reg_ranges[i + 1], &reg_ranges[i], (reg_count - i) * sizeof *reg_ranges);
    reg_ranges[i] = *range;
    reg_count++;
  }
  pthread_rwlock_unlock(&reg_lock);

  if (overlap)
    return pm__set_error(PM_ERR_OVERLAP,
                         "[%p, %p) (%zu bytes, %s) overlaps [%p, %p) (%zu bytes, %s) that "
                         "pinmem already tracks",
                         (void *)lo, (void *)hi, range->size, kind_name(range->kind),
                         (void *)clash.base, (void *)(clash.base + clash.size), clash.size,
                         kind_name(clash.kind));
  return PM_OK;
}

pm_status_t pm__registry_remove(uintptr_t base, pm_memory_kind_t kind, pm__range_t *removed_out) {
  pm__range_t found;
  pm_status_t st = PM_OK;

  pthread_rwlock_wrlock(&reg_lock);
  size_t i = upper_bound(base);
  if (i == 0 || reg_ranges[i - 1].base != base) {
    st = PM_ERR_NOT_FOUND;
  } else {
    found = reg_ranges[i - 1];
    if (found.kind != kind) {
      st = PM_ERR_WRONG_KIND;
    } else {
      memmove(&reg_ranges[i - 1], &reg_ranges[i], (reg_count - i) * sizeof *reg_ranges);
      reg_count--;
    }
  }
  pthread_rwlock_unlock(&reg_lock);

  if (st == PM_ERR_NOT_FOUND)
    return pm__set_error(st, "no %s starts at %p", kind_name(kind), (void *)base);
  if (st == PM_ERR_WRONG_KIND)
    return pm__set_error(st, "%p starts a %s (%zu bytes), not a %s", (void *)base,
                         kind_name(found.kind), found.size, kind_name(kind));
  if (removed_out) *removed_out = found;
  return PM_OK;
}

bool pm__registry_find(const void *ptr, pm__range_t *out) {
  uintptr_t addr = (uintptr_t)ptr;
  bool hit = false;
  pthread_rwlock_rdlock(&reg_lock);
  size_t i = upper_bound(addr);
  if (i > 0 && addr - reg_ranges[i - 1].base < reg_ranges[i - 1].size) {
    if (out) *out = reg_ranges[i - 1];
    hit = true;
  }
  pthread_rwlock_unlock(&reg_lock);
  return hit;
}

bool pm__registry_find_overlap(uintptr_t base, size_t size, pm__range_t *out) {
  size_t i;
  pm__range_t clash;
  pthread_rwlock_rdlock(&reg_lock);
  bool hit = size > 0 && overlap_locked(base, base + size, &i, &clash);
  pthread_rwlock_unlock(&reg_lock);
  if (hit && out) *out = clash;
  return hit;
}

size_t pm__registry_count(void) {
  pthread_rwlock_rdlock(&reg_lock);
  size_t n = reg_count;
  pthread_rwlock_unlock(&reg_lock);
  return n;
}

void pm__registry_clear(void) {
  pthread_rwlock_wrlock(&reg_lock);
  free(reg_ranges);
  reg_ranges = NULL;
  reg_count = reg_cap = 0;
  pthread_rwlock_unlock(&reg_lock);
}

/* fork.c: the parent's ranges are not the child's (mlock is not inherited, device memory is the
 * parent's), so a forked child starts with an empty registry. The array itself is left behind:
 * freeing it is safe too, but nothing in the child can still hold a pointer into it. */
void pm__registry_atfork(pm__fork_phase_t phase) {
  if (phase == PM__FORK_PREPARE) {
    pthread_rwlock_wrlock(&reg_lock);
  } else if (phase == PM__FORK_PARENT) {
    pthread_rwlock_unlock(&reg_lock);
  } else {
    pthread_rwlock_t fresh = PTHREAD_RWLOCK_INITIALIZER;
    reg_lock = fresh;
    free(reg_ranges);
    reg_ranges = NULL;
    reg_count = reg_cap = 0;
  }
}
