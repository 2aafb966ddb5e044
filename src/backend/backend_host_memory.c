/*
 * DESIGN: the host backend's memory (the backend as a whole: backend_host.h). The CPU plays the
 * device; this file holds what a driver keeps about memory, and the "device" itself.
 *
 * - Pinned memory is mlock'd memory: host_alloc is mmap + mlock, host_register mlocks the
 *   page-rounded range. Like a driver, the backend keeps a table of what it pinned; that table
 *   decides whether a copy touches pageable memory (pm__hb_classify) and answers
 *   host_device_pointer (every pinned range is "mapped", and the device address is the host
 *   address, as under CUDA's UVA).
 * - Device and managed memory are ordinary heap blocks listed in a second table; device memory
 *   belongs to the device current at its allocation and is charged against that device's own
 *   host_device_memory (0 = unlimited); device_info reports each device's total and use.
 * - Devices: option host_devices (read at backend start) simulates 1..16 of them. The current
 *   device is thread-local and a new thread starts on device 0, as under CUDA; set_device
 *   validates. Streams, events and device memory belong to the device current at their creation.
 * - Call records, for tests (pm__hb_device_calls): a counter per device of the calls made while
 *   it was current, for every call that needs a context under CUDA (allocations and frees of
 *   every kind, host registration, streams, events, copies, memset, prefetch, launches, device
 *   synchronize; not device_count/info, set/get_device, pointer_kind/device,
 *   kernel_host_access), and a counter of mismatches, following CUDA's documented multi-device
 *   rules:
 *     - a kernel launch (busy, batch copy) on a stream of another device than the current one
 *       fails under CUDA;
 *     - event_record of an event on a stream of another device fails; event_elapsed of events
 *       of two devices fails;
 *     - a copy or memset whose device memory belongs to another device than the stream's runs,
 *       but through peer access or the host instead of the stream's own copy engine (silently
 *       the wrong device);
 *     - a copy from or to memory pinned without PORTABLE while another device was current is
 *       a pageable copy for the stream's device (pinned for one context only): it runs, but
 *       staged by the driver and synchronously, not as the DMA it looks like.
 *   Not mismatches, as CUDA allows them: event query and synchronize, and stream_wait_event,
 *   across devices; a copy queued on a stream of another device than the current one. The host
 *   backend counts these and carries on (so a test sees every one); it does not fail them.
 *
 * Data structures: two sorted arrays of non-overlapping ranges (binary search) under mem_lock.
 *
 * Invariants: ranges within a table never overlap; a registration whose mlock has not finished
 * is listed as pending (it claims the range, but is not pinned yet).
 *
 * Lock order: mem_lock is a leaf (the stream engine's locks come before it). It is not held
 * while mlock runs (a pending table entry claims the range meanwhile). munlock of a range's
 * first and last page runs under mem_lock, because a neighbouring registration may share those
 * pages and mlock does not nest; its inside pages are unlocked without the lock.
 */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend_host.h"

#define HB_DEVICE_ALIGN 256 /* cudaMalloc gives at least this */

/* ------------------------------------------------------------------------------------------ */
/* Devices and their call records                                                             */
/* ------------------------------------------------------------------------------------------ */

static atomic_int hb_ndev = 1;   /* host_devices, read at backend start */
static _Thread_local int hb_cur; /* this thread's current device (0 for a new thread) */
static atomic_uint_fast64_t hb_calls[PM__HB_MAX_DEVICES], hb_mismatches[PM__HB_MAX_DEVICES];
static pthread_mutex_t hb_note_lock = PTHREAD_MUTEX_INITIALIZER; /* a leaf */
static char hb_note[256]; /* the last mismatch, for a test's failure message */

void pm__hb_devices_start(void) {
  long n = pm__opt_int(PM__OPT_HOST_DEVICES);
  if (n < 1) n = 1;
  if (n > PM__HB_MAX_DEVICES) n = PM__HB_MAX_DEVICES;
  atomic_store(&hb_ndev, (int)n);
}

int pm__hb_current(void) {
  return hb_cur;
}

void pm__hb_count_call(void) {
  atomic_fetch_add_explicit(&hb_calls[hb_cur], 1, memory_order_relaxed);
}

void pm__hb_mismatch(const char *fmt, ...) {
  atomic_fetch_add_explicit(&hb_mismatches[hb_cur], 1, memory_order_relaxed);
  va_list ap;
  va_start(ap, fmt);
  pthread_mutex_lock(&hb_note_lock);
  vsnprintf(hb_note, sizeof hb_note, fmt, ap);
  pthread_mutex_unlock(&hb_note_lock);
  va_end(ap);
}

uint64_t pm__hb_device_calls(int device) {
  if (device < 0 || device >= PM__HB_MAX_DEVICES) return 0;
  return (uint64_t)atomic_load_explicit(&hb_calls[device], memory_order_relaxed);
}

uint64_t pm__hb_device_mismatches(int device) {
  uint64_t n = 0;
  for (int d = 0; d < PM__HB_MAX_DEVICES; d++)
    if (device < 0 || d == device)
      n += (uint64_t)atomic_load_explicit(&hb_mismatches[d], memory_order_relaxed);
  return n;
}

void pm__hb_device_counters_reset(void) {
  for (int d = 0; d < PM__HB_MAX_DEVICES; d++) {
    atomic_store_explicit(&hb_calls[d], 0, memory_order_relaxed);
    atomic_store_explicit(&hb_mismatches[d], 0, memory_order_relaxed);
  }
  pthread_mutex_lock(&hb_note_lock);
  hb_note[0] = '\0';
  pthread_mutex_unlock(&hb_note_lock);
}

void pm__hb_last_mismatch(char *buf, size_t len) {
  if (!buf || !len) return;
  pthread_mutex_lock(&hb_note_lock);
  snprintf(buf, len, "%s", hb_note);
  pthread_mutex_unlock(&hb_note_lock);
}

/* ------------------------------------------------------------------------------------------ */
/* Range tables                                                                                */
/* ------------------------------------------------------------------------------------------ */

typedef struct hb_table {
  hb_range_t *v;
  size_t n, cap;
} hb_table_t;

static pthread_mutex_t mem_lock = PTHREAD_MUTEX_INITIALIZER;
static hb_table_t pinned_tbl; /* R_PIN_ALLOC, R_PIN_REGISTER */
static hb_table_t device_tbl; /* R_DEVICE, R_MANAGED */
static size_t device_used[PM__HB_MAX_DEVICES]; /* bytes of R_DEVICE ranges, per device */
static size_t pinned_bytes;   /* page-rounded bytes this backend mlock'd (for messages) */

const char *pm__hb_range_desc(unsigned kind) {
  switch (kind) {
    case R_PIN_ALLOC:
      return "pinned allocation";
    case R_PIN_REGISTER:
      return "registration";
    case R_DEVICE:
      return "device allocation";
    default:
      return "managed allocation";
  }
}

/* Index of the first range whose base is above addr. */
static size_t tbl_upper(const hb_table_t *t, uintptr_t addr) {
  size_t lo = 0, hi = t->n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (t->v[mid].base <= addr)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* Index of the range containing addr, or -1. */
static long tbl_find(const hb_table_t *t, uintptr_t addr) {
  size_t i = tbl_upper(t, addr);
  if (i == 0) return -1;
  const hb_range_t *r = &t->v[i - 1];
  return addr - r->base < r->size ? (long)(i - 1) : -1;
}

/* First range overlapping [base, base+size), or NULL. */
static const hb_range_t *tbl_overlap(const hb_table_t *t, uintptr_t base, size_t size) {
  size_t i = tbl_upper(t, base);
  if (i > 0 && t->v[i - 1].base + t->v[i - 1].size > base) return &t->v[i - 1];
  if (i < t->n && t->v[i].base < base + size) return &t->v[i];
  return NULL;
}

static pm_status_t tbl_insert(hb_table_t *t, const hb_range_t *r) {
  const hb_range_t *o = tbl_overlap(t, r->base, r->size);
  if (o)
    return pm__set_error(
        PM_ERR_OVERLAP, "[%p, +%zu) overlaps the %s [%p, +%zu) the host backend already holds",
        (void *)r->base, r->size, pm__hb_range_desc(o->kind), (void *)o->base, o->size);
  if (t->n == t->cap) {
    size_t cap = t->cap ? t->cap * 2 : 16;
    hb_range_t *v = realloc(t->v, cap * sizeof *v);
    if (!v)
      return pm__set_error(PM_ERR_NOMEM, "growing the host backend's range table to %zu entries",
                           cap);
    t->v = v;
    t->cap = cap;
  }
  size_t i = tbl_upper(t, r->base);
  memmove(&t->v[i + 1], &t->v[i], (t->n - i) * sizeof *t->v);
  t->v[i] = *r;
  t->n++;
  return PM_OK;
}

static void tbl_remove_at(hb_table_t *t, size_t i) {
  memmove(&t->v[i], &t->v[i + 1], (t->n - i - 1) * sizeof *t->v);
  t->n--;
}

static void tbl_release(hb_table_t *t) {
  free(t->v);
  t->v = NULL;
  t->n = t->cap = 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Pinned host memory                                                                          */
/* ------------------------------------------------------------------------------------------ */

static pm_status_t memlock_error(const char *call, const void *p, size_t len, int err) {
  pthread_mutex_lock(&mem_lock);
  size_t held = pinned_bytes;
  pthread_mutex_unlock(&mem_lock);
  size_t lim = pm__memlock_rlimit_raw();
  char limit[64];
  if (lim == SIZE_MAX)
    snprintf(limit, sizeof limit, "unlimited");
  else
    snprintf(limit, sizeof limit, "%zu bytes (%zu KiB)", lim, lim / 1024);
  return pm__set_error(PM_ERR_MEMLOCK,
                       "%s(%p, %zu bytes) failed: %s; RLIMIT_MEMLOCK is %s and the host backend "
                       "already holds %zu bytes locked; raise it with `ulimit -l` or lower "
                       "PINMEM_BUDGET",
                       call, p, len, strerror(err), limit, held);
}

/* With mem_lock held, after the range [base, base+size) left pinned_tbl at index i: munlock
 * its first/last page unless a neighbouring range still shares it (mlock does not nest), and
 * return in *lo and *hi the inside pages, which no other range can touch, to unlock unlocked. */
static void unlock_edges_locked(uintptr_t base, size_t size, size_t i, uintptr_t *lo,
                                uintptr_t *hi) {
  size_t pg = pm__page_size();
  uintptr_t ps = base & ~(uintptr_t)(pg - 1), pe = pm__align_up(base + size, pg);
  bool first_shared = i > 0 && pinned_tbl.v[i - 1].base + pinned_tbl.v[i - 1].size > ps;
  bool last_shared = i < pinned_tbl.n && pinned_tbl.v[i].base < pe;
  *lo = *hi = 0;
  if (pe - ps == pg) {
    if (!first_shared && !last_shared) munlock((void *)ps, pg);
    return;
  }
  if (!first_shared) munlock((void *)ps, pg);
  if (!last_shared) munlock((void *)(pe - pg), pg);
  *lo = ps + pg;
  *hi = pe - pg;
}

pm_status_t pm__hb_host_alloc(size_t bytes, unsigned flags, void **ptr_out) {
  const unsigned known = PM_HOST_MAPPED | PM_HOST_WRITE_COMBINED | PM_HOST_PORTABLE;
  pm__hb_count_call();
  if (!ptr_out) return pm__set_error(PM_ERR_INVALID, "host_alloc: ptr_out is NULL");
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "host_alloc: size is 0");
  if (flags & ~known)
    return pm__set_error(PM_ERR_INVALID, "host_alloc: unknown flags 0x%x", flags & ~known);
  size_t pg = pm__page_size();
  if (bytes > SIZE_MAX - pg)
    return pm__set_error(PM_ERR_NOMEM, "host_alloc(%zu bytes): larger than the address space",
                         bytes);
  size_t len = pm__align_up(bytes, pg);
  void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    return pm__set_error(err == ENOMEM ? PM_ERR_NOMEM : PM_ERR_BACKEND,
                         "host_alloc: mmap(%zu bytes): %s", len, strerror(err));
  }
  if (mlock(p, len) != 0) {
    int err = errno;
    munmap(p, len);
    if (err == EPERM || err == ENOMEM || err == EAGAIN) return memlock_error("mlock", p, len, err);
    return pm__set_error(PM_ERR_BACKEND, "host_alloc: mlock(%p, %zu bytes): %s", p, len,
                         strerror(err));
  }
  /* Without PORTABLE, CUDA pins for the current device's context alone. */
  hb_range_t r = {(uintptr_t)p, len, R_PIN_ALLOC, false,
                  (signed char)(flags & PM_HOST_PORTABLE ? -1 : hb_cur)};
  pthread_mutex_lock(&mem_lock);
  pm_status_t st = tbl_insert(&pinned_tbl, &r);
  if (st == PM_OK) pinned_bytes += len;
  pthread_mutex_unlock(&mem_lock);
  if (st != PM_OK) {
    munlock(p, len);
    munmap(p, len);
    return pm__wrap_error(st, "host_alloc(%zu bytes)", bytes);
  }
  *ptr_out = p;
  return PM_OK;
}

/* Find the non-pending pinned range starting exactly at ptr with `kind`; on a mismatch, an error
 * that says what ptr is instead. mem_lock held. */
static pm_status_t find_pinned_start_locked(const char *fn, const void *ptr, unsigned kind,
                                            size_t *index_out) {
  long i = tbl_find(&pinned_tbl, (uintptr_t)ptr);
  if (i < 0 || pinned_tbl.v[i].pending)
    return pm__set_error(PM_ERR_NOT_FOUND,
                         "%s(%p): not memory the host backend pinned (never pinned, or already "
                         "released)",
                         fn, ptr);
  const hb_range_t *r = &pinned_tbl.v[i];
  if (r->base != (uintptr_t)ptr)
    return pm__set_error(PM_ERR_INVALID, "%s(%p): inside the %s [%p, +%zu); pass its start", fn,
                         ptr, pm__hb_range_desc(r->kind), (void *)r->base, r->size);
  if (r->kind != kind)
    return pm__set_error(PM_ERR_WRONG_KIND, "%s(%p): the address starts a %s, use %s", fn, ptr,
                         pm__hb_range_desc(r->kind),
                         r->kind == R_PIN_ALLOC ? "host_free" : "host_unregister");
  *index_out = (size_t)i;
  return PM_OK;
}

pm_status_t pm__hb_host_free(void *ptr, size_t bytes) {
  (void)bytes; /* the table knows the mapping's length, as cudaFreeHost does */
  pm__hb_count_call();
  if (!ptr) return pm__set_error(PM_ERR_INVALID, "host_free: ptr is NULL");
  size_t i;
  pthread_mutex_lock(&mem_lock);
  pm_status_t st = find_pinned_start_locked("host_free", ptr, R_PIN_ALLOC, &i);
  size_t len = 0;
  if (st == PM_OK) {
    len = pinned_tbl.v[i].size;
    tbl_remove_at(&pinned_tbl, i);
    pinned_bytes -= len;
  }
  pthread_mutex_unlock(&mem_lock);
  if (st != PM_OK) return st;
  /* The whole mapping is ours (no other range can share its pages), so no edge care. */
  munlock(ptr, len);
  if (munmap(ptr, len) != 0)
    return pm__set_error(PM_ERR_BACKEND, "host_free: munmap(%p, %zu bytes): %s", ptr, len,
                         strerror(errno));
  return PM_OK;
}

/* Is every page of [ps, pe) mapped? mincore, not msync: it reads nothing in the range, so
 * memory checkers do not object to the bytes around the caller's buffer. */
static bool range_mapped(uintptr_t ps, uintptr_t pe, size_t pg) {
  unsigned char vec[4096];
  while (ps < pe) {
    size_t chunk = PM__MIN((size_t)(pe - ps), sizeof vec * pg);
    if (mincore((void *)ps, chunk, vec) != 0 && errno == ENOMEM) return false;
    ps += chunk;
  }
  return true;
}

/* Does [ps, pe) hold a mapping with no access (PROT_NONE: a guard page, memory reserved but not
 * committed)? mlock fails on one with ENOMEM, the errno of a low RLIMIT_MEMLOCK, so the failure
 * is told apart here, on the error path only (it reads /proc/self/maps). */
static bool range_has_no_access(uintptr_t ps, uintptr_t pe) {
  FILE *f = fopen("/proc/self/maps", "re");
  if (!f) return false;
  char line[512];
  bool found = false;
  while (!found && fgets(line, sizeof line, f)) {
    unsigned long lo, hi;
    char perms[5];
    if (sscanf(line, "%lx-%lx %4s", &lo, &hi, perms) == 3 && lo < pe && hi > ps)
      found = perms[0] == '-' && perms[1] == '-' && perms[2] == '-';
  }
  fclose(f);
  return found;
}

pm_status_t pm__hb_host_register(void *ptr, size_t bytes, unsigned flags) {
  const unsigned known = PM_REGISTER_MAPPED | PM_REGISTER_PORTABLE | PM_REGISTER_READ_ONLY;
  pm__hb_count_call();
  if (!ptr) return pm__set_error(PM_ERR_INVALID, "host_register: ptr is NULL");
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "host_register: size is 0");
  if (flags & ~known)
    return pm__set_error(PM_ERR_INVALID, "host_register: unknown flags 0x%x", flags & ~known);
  uintptr_t base = (uintptr_t)ptr;
  size_t pg = pm__page_size();
  if (base + bytes < base || base + bytes > UINTPTR_MAX - pg)
    return pm__set_error(PM_ERR_INVALID, "host_register(%p, %zu bytes): the range wraps", ptr,
                         bytes);

  uintptr_t ps = base & ~(uintptr_t)(pg - 1), pe = pm__align_up(base + bytes, pg);
  /* mlock reports unmapped memory as ENOMEM, the errno of a low RLIMIT_MEMLOCK (and sanitizer
   * runtimes make mlock a no-op), so unmapped memory is told apart first. */
  if (!range_mapped(ps, pe, pg))
    return pm__set_error(PM_ERR_INVALID,
                         "host_register(%p, %zu bytes): part of the range is not mapped memory",
                         ptr, bytes);

  /* Claim the range first (pending), so the overlap check and the claim are one step and the
   * slow mlock runs without the lock. */
  hb_range_t r = {base, bytes, R_PIN_REGISTER, true,
                  (signed char)(flags & PM_REGISTER_PORTABLE ? -1 : hb_cur)};
  pthread_mutex_lock(&mem_lock);
  const hb_range_t *dev = tbl_overlap(&device_tbl, base, bytes);
  pm_status_t st;
  if (dev)
    st = pm__set_error(PM_ERR_INVALID,
                       "host_register(%p, %zu bytes): overlaps the %s [%p, +%zu), which is not "
                       "host memory to page-lock",
                       ptr, bytes, pm__hb_range_desc(dev->kind), (void *)dev->base, dev->size);
  else
    st = tbl_insert(&pinned_tbl, &r);
  pthread_mutex_unlock(&mem_lock);
  if (st != PM_OK) return dev ? st : pm__wrap_error(st, "host_register(%p, %zu bytes)", ptr, bytes);

  int rc = mlock((void *)ps, pe - ps);
  int err = errno;

  pthread_mutex_lock(&mem_lock);
  long i = tbl_find(&pinned_tbl, base);
  if (i < 0 || pinned_tbl.v[i].base != base || !pinned_tbl.v[i].pending) {
    /* Only this call clears or removes its pending entry: unreachable. */
    pthread_mutex_unlock(&mem_lock);
    return pm__set_error(PM_ERR_INTERNAL, "host_register(%p): pending entry vanished", ptr);
  }
  if (rc == 0) {
    pinned_tbl.v[i].pending = false;
    pinned_bytes += pe - ps;
    pthread_mutex_unlock(&mem_lock);
    return PM_OK;
  }
  uintptr_t lo, hi;
  tbl_remove_at(&pinned_tbl, (size_t)i);
  unlock_edges_locked(base, bytes, (size_t)i, &lo, &hi);
  pthread_mutex_unlock(&mem_lock);
  if (hi > lo) munlock((void *)lo, hi - lo); /* mlock may have locked part of the range */

  if (err == ENOMEM && range_has_no_access(ps, pe))
    return pm__set_error(PM_ERR_INVALID,
                         "host_register(%p, %zu bytes): part of the range is mapped without access "
                         "(PROT_NONE), which cannot be pinned",
                         ptr, bytes);
  if (err == EPERM || err == ENOMEM || err == EAGAIN)
    return memlock_error("host_register: mlock", (void *)ps, pe - ps, err);
  return pm__set_error(PM_ERR_BACKEND, "host_register: mlock(%p, %zu bytes): %s", (void *)ps,
                       pe - ps, strerror(err));
}

pm_status_t pm__hb_host_unregister(void *ptr, size_t bytes) {
  (void)bytes; /* cudaHostUnregister takes the start only; the table knows the length */
  pm__hb_count_call();
  if (!ptr) return pm__set_error(PM_ERR_INVALID, "host_unregister: ptr is NULL");
  size_t i;
  uintptr_t lo = 0, hi = 0;
  pthread_mutex_lock(&mem_lock);
  pm_status_t st = find_pinned_start_locked("host_unregister", ptr, R_PIN_REGISTER, &i);
  if (st == PM_OK) {
    hb_range_t r = pinned_tbl.v[i];
    size_t pg = pm__page_size();
    tbl_remove_at(&pinned_tbl, i);
    pinned_bytes -= pm__align_up(r.base + r.size, pg) - (r.base & ~(uintptr_t)(pg - 1));
    unlock_edges_locked(r.base, r.size, i, &lo, &hi);
  }
  pthread_mutex_unlock(&mem_lock);
  if (st != PM_OK) return st;
  if (hi > lo) munlock((void *)lo, hi - lo);
  return PM_OK;
}

pm_status_t pm__hb_host_device_pointer(void *host_ptr, void **dptr_out) {
  pm__hb_count_call();
  if (!host_ptr) return pm__set_error(PM_ERR_INVALID, "host_device_pointer: ptr is NULL");
  if (!dptr_out) return pm__set_error(PM_ERR_INVALID, "host_device_pointer: dptr_out is NULL");
  pthread_mutex_lock(&mem_lock);
  long i = tbl_find(&pinned_tbl, (uintptr_t)host_ptr);
  bool ok = i >= 0 && !pinned_tbl.v[i].pending;
  pthread_mutex_unlock(&mem_lock);
  if (!ok)
    return pm__set_error(PM_ERR_INVALID,
                         "host_device_pointer(%p): not in memory the host backend pinned "
                         "(host_alloc or host_register)",
                         host_ptr);
  *dptr_out = host_ptr; /* one address space, as with CUDA's unified addressing */
  return PM_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Device and managed memory                                                                   */
/* ------------------------------------------------------------------------------------------ */

static size_t device_total(void) {
  size_t opt = pm__opt_size(PM__OPT_HOST_DEVICE_MEMORY);
  return opt ? opt : pm__physical_memory();
}

pm_status_t pm__hb_device_alloc(size_t bytes, void **dptr_out) {
  pm__hb_count_call();
  if (!dptr_out) return pm__set_error(PM_ERR_INVALID, "device_alloc: dptr_out is NULL");
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "device_alloc: size is 0");
  size_t limit = pm__opt_size(PM__OPT_HOST_DEVICE_MEMORY); /* read outside mem_lock */
  const int dev = hb_cur;

  pthread_mutex_lock(&mem_lock);
  size_t used = device_used[dev];
  bool over = limit && (bytes > limit || used > limit - bytes);
  if (!over) device_used[dev] += bytes; /* reserve before allocating: the limit holds under races */
  pthread_mutex_unlock(&mem_lock);
  if (over)
    return pm__set_error(PM_ERR_DEVICE_MEMORY,
                         "device_alloc(%zu bytes): the host backend simulates %zu bytes of device "
                         "memory per device (option host_device_memory / "
                         "PINMEM_HOST_DEVICE_MEMORY) and %zu are in use on device %d",
                         bytes, limit, used, dev);

  void *p = bytes <= SIZE_MAX - HB_DEVICE_ALIGN
                ? aligned_alloc(HB_DEVICE_ALIGN, pm__align_up(bytes, HB_DEVICE_ALIGN))
                : NULL;
  pm_status_t st = PM_OK;
  if (!p)
    st = pm__set_error(PM_ERR_DEVICE_MEMORY,
                       "device_alloc: aligned_alloc(%zu bytes) for simulated device memory failed",
                       bytes);
  pthread_mutex_lock(&mem_lock);
  if (p) {
    hb_range_t r = {(uintptr_t)p, bytes, R_DEVICE, false, (signed char)dev};
    st = tbl_insert(&device_tbl, &r);
  }
  if (st != PM_OK) device_used[dev] -= bytes;
  pthread_mutex_unlock(&mem_lock);
  if (st != PM_OK) {
    free(p);
    return st;
  }
  *dptr_out = p;
  return PM_OK;
}

/* cudaFree releases device and managed memory alike; so do device_free and managed_free, which
 * synchronize the device first (backend_host_stream.c) and then come here. */
pm_status_t pm__hb_device_release(const char *fn, void *ptr) {
  pthread_mutex_lock(&mem_lock);
  long i = tbl_find(&device_tbl, (uintptr_t)ptr);
  pm_status_t st = PM_OK;
  if (i < 0) {
    st = pm__set_error(PM_ERR_NOT_FOUND,
                       "%s(%p): not device or managed memory of the host backend (never "
                       "allocated, or already freed)",
                       fn, ptr);
  } else if (device_tbl.v[i].base != (uintptr_t)ptr) {
    st = pm__set_error(PM_ERR_INVALID, "%s(%p): inside the %s [%p, +%zu); pass its start", fn, ptr,
                       pm__hb_range_desc(device_tbl.v[i].kind), (void *)device_tbl.v[i].base,
                       device_tbl.v[i].size);
  } else {
    const hb_range_t *r = &device_tbl.v[i];
    if (r->kind == R_DEVICE) device_used[r->device] -= r->size;
    tbl_remove_at(&device_tbl, (size_t)i);
  }
  pthread_mutex_unlock(&mem_lock);
  if (st == PM_OK) free(ptr);
  return st;
}


pm_status_t pm__hb_managed_alloc(size_t bytes, void **ptr_out) {
  pm__hb_count_call();
  if (!ptr_out) return pm__set_error(PM_ERR_INVALID, "managed_alloc: ptr_out is NULL");
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "managed_alloc: size is 0");
  size_t pg = pm__page_size(); /* managed memory migrates by pages */
  void *p = bytes <= SIZE_MAX - pg ? aligned_alloc(pg, pm__align_up(bytes, pg)) : NULL;
  if (!p)
    return pm__set_error(PM_ERR_DEVICE_MEMORY, "managed_alloc: aligned_alloc(%zu bytes) failed",
                         bytes);
  hb_range_t r = {(uintptr_t)p, bytes, R_MANAGED, false, -1};
  pthread_mutex_lock(&mem_lock);
  pm_status_t st = tbl_insert(&device_tbl, &r);
  pthread_mutex_unlock(&mem_lock);
  if (st != PM_OK) {
    free(p);
    return st;
  }
  *ptr_out = p;
  return PM_OK;
}

/* As a driver answers it: the device table, then what this backend mlock'd (a registration
 * still pending is not pinned yet). */
int pm__hb_pointer_kind(const void *ptr) {
  if (!ptr) return PM__PTR_OTHER;
  int kind = PM__PTR_OTHER;
  pthread_mutex_lock(&mem_lock);
  if (tbl_find(&device_tbl, (uintptr_t)ptr) >= 0) {
    kind = PM__PTR_DEVICE;
  } else {
    long i = tbl_find(&pinned_tbl, (uintptr_t)ptr);
    if (i >= 0 && !pinned_tbl.v[i].pending) kind = PM__PTR_PINNED;
  }
  pthread_mutex_unlock(&mem_lock);
  return kind;
}

int pm__hb_pointer_device(const void *ptr) {
  if (!ptr) return -1;
  int dev = -1;
  pthread_mutex_lock(&mem_lock);
  long i = tbl_find(&device_tbl, (uintptr_t)ptr);
  if (i >= 0 && device_tbl.v[i].kind == R_DEVICE) dev = device_tbl.v[i].device;
  pthread_mutex_unlock(&mem_lock);
  return dev;
}

/* [ptr, ptr+bytes) must lie in one device-table range (of `kind`, or any kind if kind < 0). */
pm_status_t pm__hb_check_device_span(const char *fn, const char *what, const void *ptr,
                                     size_t bytes, int kind) {
  uintptr_t p = (uintptr_t)ptr;
  pthread_mutex_lock(&mem_lock);
  long i = tbl_find(&device_tbl, p);
  hb_range_t r = {0, 0, 0, false, -1};
  if (i >= 0) r = device_tbl.v[i];
  pthread_mutex_unlock(&mem_lock);
  if (i < 0 || (kind >= 0 && r.kind != kind))
    return pm__set_error(PM_ERR_INVALID, "%s: %s %p is not %s of the host backend", fn, what, ptr,
                         kind == R_MANAGED ? "managed memory" : "device memory");
  if (bytes > r.size - (p - r.base))
    return pm__set_error(PM_ERR_INVALID, "%s: %s [%p, +%zu) runs past the end of its %s [%p, +%zu)",
                         fn, what, ptr, bytes, pm__hb_range_desc(r.kind), (void *)r.base, r.size);
  return PM_OK;
}

static void classify_locked(const void *ptr, size_t bytes, hb_side_t *out) {
  uintptr_t p = (uintptr_t)ptr;
  memset(out, 0, sizeof *out);
  out->kind = PM__MEM_PAGEABLE;
  out->pin_device = -1;
  long i = tbl_find(&device_tbl, p);
  if (i >= 0) {
    out->dev = device_tbl.v[i];
    out->kind = out->dev.kind == R_DEVICE ? PM__MEM_DEVICE : PM__MEM_MANAGED;
    out->fits = bytes <= out->dev.size - (p - out->dev.base);
  }
  i = tbl_find(&pinned_tbl, p);
  if (i >= 0 && out->kind == PM__MEM_PAGEABLE) {
    const hb_range_t *r = &pinned_tbl.v[i];
    if (!r->pending && bytes <= r->size - (p - r->base)) {
      out->kind = PM__MEM_PINNED;
      out->pin_device = r->device;
    }
  }
}

void pm__hb_classify(const void *dst, const void *src, size_t bytes, hb_side_t *d, hb_side_t *s) {
  pthread_mutex_lock(&mem_lock);
  classify_locked(dst, bytes, d);
  classify_locked(src, bytes, s);
  pthread_mutex_unlock(&mem_lock);
}

/* ------------------------------------------------------------------------------------------ */
/* The device                                                                                  */
/* ------------------------------------------------------------------------------------------ */

pm_status_t pm__hb_device_count(int *count_out) {
  if (!count_out) return pm__set_error(PM_ERR_INVALID, "device_count: count_out is NULL");
  *count_out = atomic_load(&hb_ndev);
  return PM_OK;
}

pm_status_t pm__hb_check_device(const char *fn, int device) {
  int n = atomic_load(&hb_ndev);
  if (device < 0 || device >= n)
    return pm__set_error(PM_ERR_INVALID,
                         "%s: device %d out of range (the host backend simulates %d device%s: "
                         "0..%d; option host_devices)",
                         fn, device, n, n == 1 ? "" : "s", n - 1);
  return PM_OK;
}

pm_status_t pm__hb_device_info(int device, pm_device_info_t *info_out) {
  if (!info_out) return pm__set_error(PM_ERR_INVALID, "device_info: info_out is NULL");
  pm_status_t st = pm__hb_check_device("device_info", device);
  if (st != PM_OK) return st;
  pm_device_info_t d;
  memset(&d, 0, sizeof d);
  d.index = device;
  if (atomic_load(&hb_ndev) == 1)
    snprintf(d.name, sizeof d.name, "host (CPU plays the device)");
  else
    snprintf(d.name, sizeof d.name, "host %d (CPU plays device %d)", device, device);
  d.cc_major = d.cc_minor = 0;
  d.total_memory = device_total();
  pthread_mutex_lock(&mem_lock);
  size_t used = device_used[device];
  pthread_mutex_unlock(&mem_lock);
  d.free_memory = d.total_memory > used ? d.total_memory - used : 0;
  d.pcie_gen = d.pcie_width = d.pcie_max_gen = d.pcie_max_width = -1;
  d.numa_node = -1;
  d.async_engines = 2;
  d.can_map_host_memory = 1;
  d.unified_addressing = 1;
  d.managed_memory = 1;
  d.concurrent_managed_access = 1;
  d.host_register_supported = 1;
  d.host_register_read_only = 1;
  d.pageable_memory_access = 0;
  *info_out = d;
  return PM_OK;
}

pm_status_t pm__hb_set_device(int device) {
  pm_status_t st = pm__hb_check_device("set_device", device);
  if (st == PM_OK) hb_cur = device;
  return st;
}

pm_status_t pm__hb_get_device(int *device_out) {
  if (!device_out) return pm__set_error(PM_ERR_INVALID, "get_device: device_out is NULL");
  *device_out = hb_cur;
  return PM_OK;
}

/* The engine's shutdown: ranges the caller still holds stay listed, so they can still be
 * released correctly. */
void pm__hb_memory_shutdown(void) {
  pthread_mutex_lock(&mem_lock);
  if (!pinned_tbl.n) tbl_release(&pinned_tbl);
  if (!device_tbl.n) tbl_release(&device_tbl);
  pthread_mutex_unlock(&mem_lock);
}

/* In a forked child nothing is mlock'd (locks of memory are not inherited): empty tables. Called
 * by pm__host_atfork after the engine's locks (mem_lock is last in the lock order). */
void pm__hb_memory_atfork(pm__fork_phase_t phase) {
  if (phase == PM__FORK_PREPARE) {
    pthread_mutex_lock(&mem_lock);
  } else if (phase == PM__FORK_PARENT) {
    pthread_mutex_unlock(&mem_lock);
  } else {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    mem_lock = fresh;
    pinned_tbl.n = 0;
    device_tbl.n = 0;
    memset(device_used, 0, sizeof device_used);
    pinned_bytes = 0;
  }
}
