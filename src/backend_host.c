/*
 * DESIGN: the host backend: the CPU plays the device, so the whole API and every test run on a
 * machine without a GPU. It models the cuda backend's ordering rules, not its speed.
 *
 * - Pinned memory is mlock'd memory: host_alloc is mmap + mlock, host_register mlocks the
 *   page-rounded range. Like a driver, the backend keeps a table of what it pinned; that table
 *   decides whether a copy touches pageable memory and answers host_device_pointer (every pinned
 *   range is "mapped", and the device address is the host address, as under CUDA's UVA).
 * - Device and managed memory are ordinary heap blocks listed in a second table; device memory
 *   is charged against the host_device_memory option (0 = unlimited).
 * - Each stream is a thread running a FIFO of ops in order. NULL is a default stream created on
 *   first use, independent of the others (as cudaStreamNonBlocking streams are of it).
 * - An event points at its latest "record", a refcounted completion object that the stream's
 *   worker completes (with a CLOCK_MONOTONIC timestamp). query, synchronize and wait_event take
 *   the record that is latest at the time of the call, so re-recording an event never changes
 *   what an earlier wait waits for, as in CUDA.
 * - A copy with a pageable host side blocks like CUDA's, and so does every host-to-host copy
 *   (CUDA documents those as fully synchronous): it queues a gate op; when the worker
 *   reaches the gate, the caller copies on its own thread while the worker holds, so the copy
 *   comes after the stream's earlier work and before its later work. Other copies are queued.
 *
 * Data structures: two sorted arrays of non-overlapping ranges (binary search) under mem_lock;
 * two sorted arrays of live stream and event handles under obj_lock, so a destroyed or foreign
 * handle is an error instead of a crash; per stream a mutex, a linked FIFO of ops and the
 * counters submitted/done (query: done == submitted; synchronize: wait until done reaches the
 * submitted count seen at the call).
 *
 * Invariants: ranges within a table never overlap. A stream is freed only after it left the
 * handle set, its worker drained the queue and exited, and no caller waits on it (users == 0);
 * a caller that found a handle in a set takes the object's lock before dropping obj_lock, so
 * destroy (which leaves the set first) cannot free it under that caller. A record is freed when
 * its last holder (event, queued op, waiter) lets go.
 *
 * Lock order: obj_lock -> stream.mu -> rec_lock (a stream's worker completes a record under its
 * stream.mu; event_record and stream_wait_event capture records under both). mem_lock is a leaf. No
 * lock is held while an op runs (user callbacks, sleeps, copies) or while mlock runs (a pending
 * table entry claims the range meanwhile). munlock of a range's first and last page runs under
 * mem_lock, because a neighbouring registration may share those pages and mlock does not nest; its
 * inside pages are unlocked without the lock.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define HB_BUSY_MAX_SECONDS 1.0e6 /* same bound as the cuda backend */
#define HB_DEVICE_ALIGN 256       /* cudaMalloc gives at least this */

/* ------------------------------------------------------------------------------------------ */
/* Range tables                                                                                */
/* ------------------------------------------------------------------------------------------ */

enum { R_PIN_ALLOC, R_PIN_REGISTER, R_DEVICE, R_MANAGED };

typedef struct hb_range {
  uintptr_t base;
  size_t size; /* R_PIN_ALLOC: page-rounded mapping; others: the bytes asked for */
  unsigned char kind;
  bool pending; /* registration whose mlock has not finished: not pinned yet */
} hb_range_t;

typedef struct hb_table {
  hb_range_t *v;
  size_t n, cap;
} hb_table_t;

static pthread_mutex_t mem_lock = PTHREAD_MUTEX_INITIALIZER;
static hb_table_t pinned_tbl; /* R_PIN_ALLOC, R_PIN_REGISTER */
static hb_table_t device_tbl; /* R_DEVICE, R_MANAGED */
static size_t device_used;    /* bytes of R_DEVICE ranges */
static size_t pinned_bytes;   /* page-rounded bytes this backend mlock'd (for messages) */

static const char *range_desc(unsigned kind) {
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
    return pm__set_error(PM_ERR_OVERLAP,
                         "[%p, +%zu) overlaps the %s [%p, +%zu) the host backend already holds",
                         (void *)r->base, r->size, range_desc(o->kind), (void *)o->base, o->size);
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

static pm_status_t host_alloc(size_t bytes, unsigned flags, void **ptr_out) {
  const unsigned known = PM_HOST_MAPPED | PM_HOST_WRITE_COMBINED | PM_HOST_PORTABLE;
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
  hb_range_t r = {(uintptr_t)p, len, R_PIN_ALLOC, false};
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
                         ptr, range_desc(r->kind), (void *)r->base, r->size);
  if (r->kind != kind)
    return pm__set_error(PM_ERR_WRONG_KIND, "%s(%p): the address starts a %s, use %s", fn, ptr,
                         range_desc(r->kind),
                         r->kind == R_PIN_ALLOC ? "host_free" : "host_unregister");
  *index_out = (size_t)i;
  return PM_OK;
}

static pm_status_t host_free(void *ptr, size_t bytes) {
  (void)bytes; /* the table knows the mapping's length, as cudaFreeHost does */
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

static pm_status_t host_register(void *ptr, size_t bytes, unsigned flags) {
  const unsigned known = PM_REGISTER_MAPPED | PM_REGISTER_PORTABLE | PM_REGISTER_READ_ONLY;
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
  hb_range_t r = {base, bytes, R_PIN_REGISTER, true};
  pthread_mutex_lock(&mem_lock);
  const hb_range_t *dev = tbl_overlap(&device_tbl, base, bytes);
  pm_status_t st;
  if (dev)
    st = pm__set_error(PM_ERR_INVALID,
                       "host_register(%p, %zu bytes): overlaps the %s [%p, +%zu), which is not "
                       "host memory to page-lock",
                       ptr, bytes, range_desc(dev->kind), (void *)dev->base, dev->size);
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

  if (err == EPERM || err == ENOMEM || err == EAGAIN)
    return memlock_error("host_register: mlock", (void *)ps, pe - ps, err);
  return pm__set_error(PM_ERR_BACKEND, "host_register: mlock(%p, %zu bytes): %s", (void *)ps,
                       pe - ps, strerror(err));
}

static pm_status_t host_unregister(void *ptr, size_t bytes) {
  (void)bytes; /* cudaHostUnregister takes the start only; the table knows the length */
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

static pm_status_t host_device_pointer(void *host_ptr, void **dptr_out) {
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

static pm_status_t device_alloc(size_t bytes, void **dptr_out) {
  if (!dptr_out) return pm__set_error(PM_ERR_INVALID, "device_alloc: dptr_out is NULL");
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "device_alloc: size is 0");
  size_t limit = pm__opt_size(PM__OPT_HOST_DEVICE_MEMORY); /* read outside mem_lock */

  pthread_mutex_lock(&mem_lock);
  size_t used = device_used;
  bool over = limit && (bytes > limit || used > limit - bytes);
  if (!over) device_used += bytes; /* reserve before allocating: the limit holds under races */
  pthread_mutex_unlock(&mem_lock);
  if (over)
    return pm__set_error(PM_ERR_DEVICE_MEMORY,
                         "device_alloc(%zu bytes): the host backend simulates %zu bytes of device "
                         "memory (option host_device_memory / PINMEM_HOST_DEVICE_MEMORY) and %zu "
                         "are in use",
                         bytes, limit, used);

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
    hb_range_t r = {(uintptr_t)p, bytes, R_DEVICE, false};
    st = tbl_insert(&device_tbl, &r);
  }
  if (st != PM_OK) device_used -= bytes;
  pthread_mutex_unlock(&mem_lock);
  if (st != PM_OK) {
    free(p);
    return st;
  }
  *dptr_out = p;
  return PM_OK;
}

/* cudaFree releases device and managed memory alike; so do device_free and managed_free. */
static pm_status_t device_synchronize(void);

static pm_status_t device_release(const char *fn, void *ptr) {
  if (!ptr) return pm__set_error(PM_ERR_INVALID, "%s: ptr is NULL", fn);
  /* cudaFree synchronizes the device before it returns memory: queued copies and kernels that
   * still use it finish first. Model that, so freeing after a failed or skipped stream
   * synchronize cannot pull memory out from under a stream's worker. */
  pm_status_t sync = device_synchronize();
  if (sync != PM_OK) return pm__wrap_error(sync, "%s(%p)", fn, ptr);
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
                       range_desc(device_tbl.v[i].kind), (void *)device_tbl.v[i].base,
                       device_tbl.v[i].size);
  } else {
    if (device_tbl.v[i].kind == R_DEVICE) device_used -= device_tbl.v[i].size;
    tbl_remove_at(&device_tbl, (size_t)i);
  }
  pthread_mutex_unlock(&mem_lock);
  if (st == PM_OK) free(ptr);
  return st;
}

static pm_status_t device_free(void *dptr) {
  return device_release("device_free", dptr);
}

static pm_status_t managed_alloc(size_t bytes, void **ptr_out) {
  if (!ptr_out) return pm__set_error(PM_ERR_INVALID, "managed_alloc: ptr_out is NULL");
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "managed_alloc: size is 0");
  size_t pg = pm__page_size(); /* managed memory migrates by pages */
  void *p = bytes <= SIZE_MAX - pg ? aligned_alloc(pg, pm__align_up(bytes, pg)) : NULL;
  if (!p)
    return pm__set_error(PM_ERR_DEVICE_MEMORY, "managed_alloc: aligned_alloc(%zu bytes) failed",
                         bytes);
  hb_range_t r = {(uintptr_t)p, bytes, R_MANAGED, false};
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

static pm_status_t managed_free(void *ptr) {
  return device_release("managed_free", ptr);
}

/* As a driver answers it: the device table, then what this backend mlock'd (a registration
 * still pending is not pinned yet). */
static int pointer_kind(const void *ptr) {
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

/* [ptr, ptr+bytes) must lie in one device-table range (of `kind`, or any kind if kind < 0). */
static pm_status_t check_device_span(const char *fn, const char *what, const void *ptr,
                                     size_t bytes, int kind) {
  uintptr_t p = (uintptr_t)ptr;
  pthread_mutex_lock(&mem_lock);
  long i = tbl_find(&device_tbl, p);
  hb_range_t r = {0, 0, 0, false};
  if (i >= 0) r = device_tbl.v[i];
  pthread_mutex_unlock(&mem_lock);
  if (i < 0 || (kind >= 0 && r.kind != kind))
    return pm__set_error(PM_ERR_INVALID, "%s: %s %p is not %s of the host backend", fn, what, ptr,
                         kind == R_MANAGED ? "managed memory" : "device memory");
  if (bytes > r.size - (p - r.base))
    return pm__set_error(PM_ERR_INVALID, "%s: %s [%p, +%zu) runs past the end of its %s [%p, +%zu)",
                         fn, what, ptr, bytes, range_desc(r.kind), (void *)r.base, r.size);
  return PM_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Records, ops, streams, events                                                               */
/* ------------------------------------------------------------------------------------------ */

/* One record of an event. Every field is guarded by rec_lock. */
typedef struct hb_rec {
  int refs;
  bool done;
  double t_done; /* CLOCK_MONOTONIC seconds */
} hb_rec_t;

static pthread_mutex_t rec_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t rec_cv = PTHREAD_COND_INITIALIZER; /* some record completed */

static void rec_unref_locked(hb_rec_t *r) {
  if (r && --r->refs == 0) free(r);
}

typedef enum {
  OP_COPY,
  OP_MEMSET,
  OP_BUSY,
  OP_RECORD,
  OP_WAIT,
  OP_HOST_FUNC,
  OP_PREFETCH,
  OP_GATE,
  OP_BATCH
} hb_op_kind_t;

typedef struct hb_op {
  struct hb_op *next;
  hb_op_kind_t kind;
  union {
    struct {
      void *dst;
      const void *src;
      size_t bytes;
    } copy;
    struct {
      void *dst;
      int value;
      size_t bytes;
    } set;
    double seconds;
    hb_rec_t *rec; /* OP_RECORD, OP_WAIT: one reference held by the op */
    struct {
      void (*fn)(void *);
      void *arg;
    } func;
    struct {
      bool reached, released; /* guarded by the stream's mu */
    } gate;
    struct {
      const pm__copy_desc_t *desc; /* stored after the op, in the same allocation */
      size_t count;
    } batch;
  } u;
} hb_op_t;

struct pm_stream_s {
  pthread_mutex_t mu;
  pthread_cond_t cv_work;  /* to the worker: an op was queued, closing, a gate was released */
  pthread_cond_t cv_state; /* from the worker: an op finished, a gate was reached, users fell */
  hb_op_t *head, *tail;
  uint64_t submitted, done;
  int users;    /* callers waiting on this stream without obj_lock */
  bool closing; /* the worker exits once the queue is empty */
  pthread_t thread;
};

struct pm_event_s {
  unsigned flags;
  hb_rec_t *latest; /* guarded by rec_lock; NULL until the first record */
};

/* A sorted set of live handles. */
typedef struct hb_set {
  uintptr_t *v;
  size_t n, cap;
} hb_set_t;

static pthread_mutex_t obj_lock = PTHREAD_MUTEX_INITIALIZER;
static hb_set_t stream_set, event_set;
static struct pm_stream_s *default_stream; /* guarded by obj_lock; created on first use */

static size_t set_lower(const hb_set_t *s, uintptr_t x) {
  size_t lo = 0, hi = s->n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (s->v[mid] < x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

static bool set_has(const hb_set_t *s, const void *p) {
  size_t i = set_lower(s, (uintptr_t)p);
  return i < s->n && s->v[i] == (uintptr_t)p;
}

static pm_status_t set_add(hb_set_t *s, const void *p) {
  if (s->n == s->cap) {
    size_t cap = s->cap ? s->cap * 2 : 16;
    uintptr_t *v = realloc(s->v, cap * sizeof *v);
    if (!v) return pm__set_error(PM_ERR_NOMEM, "growing the host backend's handle table");
    s->v = v;
    s->cap = cap;
  }
  size_t i = set_lower(s, (uintptr_t)p);
  memmove(&s->v[i + 1], &s->v[i], (s->n - i) * sizeof *s->v);
  s->v[i] = (uintptr_t)p;
  s->n++;
  return PM_OK;
}

static void set_del(hb_set_t *s, const void *p) {
  size_t i = set_lower(s, (uintptr_t)p);
  if (i < s->n && s->v[i] == (uintptr_t)p) {
    memmove(&s->v[i], &s->v[i + 1], (s->n - i - 1) * sizeof *s->v);
    s->n--;
  }
}

static void set_release_if_empty(hb_set_t *s) {
  if (s->n) return; /* handles the caller never destroyed stay valid */
  free(s->v);
  s->v = NULL;
  s->cap = 0;
}

/* Sleep until `seconds` from now; never spins. */
static void sleep_for(double seconds) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  time_t whole = (time_t)seconds;
  long ns = (long)((seconds - (double)whole) * 1e9);
  t.tv_sec += whole;
  t.tv_nsec += ns;
  if (t.tv_nsec >= 1000000000L) {
    t.tv_sec++;
    t.tv_nsec -= 1000000000L;
  }
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL) == EINTR) {
  }
}

static void op_run(hb_op_t *op) {
  switch (op->kind) {
    case OP_COPY:
      memmove(op->u.copy.dst, op->u.copy.src, op->u.copy.bytes);
      break;
    case OP_MEMSET:
      memset(op->u.set.dst, op->u.set.value, op->u.set.bytes);
      break;
    case OP_BUSY:
      sleep_for(op->u.seconds);
      break;
    case OP_RECORD: {
      double now = pm__now();
      pthread_mutex_lock(&rec_lock);
      op->u.rec->done = true;
      op->u.rec->t_done = now;
      pthread_cond_broadcast(&rec_cv);
      rec_unref_locked(op->u.rec);
      pthread_mutex_unlock(&rec_lock);
      break;
    }
    case OP_WAIT:
      pthread_mutex_lock(&rec_lock);
      while (!op->u.rec->done) pthread_cond_wait(&rec_cv, &rec_lock);
      rec_unref_locked(op->u.rec);
      pthread_mutex_unlock(&rec_lock);
      break;
    case OP_HOST_FUNC:
      op->u.func.fn(op->u.func.arg);
      break;
    case OP_BATCH:
      for (size_t i = 0; i < op->u.batch.count; i++)
        memmove(op->u.batch.desc[i].dst, op->u.batch.desc[i].src,
                (size_t)op->u.batch.desc[i].bytes);
      break;
    case OP_PREFETCH: /* one memory: nothing moves, but it is ordered like the real thing */
    case OP_GATE:     /* handled by the worker loop */
      break;
  }
}

static void *stream_main(void *arg) {
  struct pm_stream_s *s = arg;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (!s->head && !s->closing) pthread_cond_wait(&s->cv_work, &s->mu);
    hb_op_t *op = s->head;
    if (!op) break; /* closing and drained */
    s->head = op->next;
    if (!s->head) s->tail = NULL;
    if (op->kind == OP_GATE) {
      /* The submitting thread copies now; hold the stream until it is done. */
      op->u.gate.reached = true;
      pthread_cond_broadcast(&s->cv_state);
      while (!op->u.gate.released) pthread_cond_wait(&s->cv_work, &s->mu);
      pthread_mutex_unlock(&s->mu);
    } else if (op->kind == OP_RECORD) {
      /* Complete the event and count the op done in one step under s->mu (then rec_lock, the
       * order event_record uses): whoever sees the event complete sees the stream past it, and
       * whoever sees the stream synchronized sees the event complete, as CUDA guarantees. */
      op_run(op);
      free(op);
      s->done++;
      if (s->users) pthread_cond_broadcast(&s->cv_state);
      continue;
    } else {
      pthread_mutex_unlock(&s->mu);
      op_run(op);
    }
    free(op);
    pthread_mutex_lock(&s->mu);
    s->done++;
    if (s->users) pthread_cond_broadcast(&s->cv_state);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

static pm_status_t stream_new(struct pm_stream_s **out) {
  struct pm_stream_s *s = calloc(1, sizeof *s);
  if (!s) return pm__set_error(PM_ERR_NOMEM, "stream_create: out of memory");
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv_work, NULL);
  pthread_cond_init(&s->cv_state, NULL);
  /* The worker takes no process signals: those belong to the application's threads. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int rc = pthread_create(&s->thread, NULL, stream_main, s);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc != 0) {
    pthread_cond_destroy(&s->cv_state);
    pthread_cond_destroy(&s->cv_work);
    pthread_mutex_destroy(&s->mu);
    free(s);
    return pm__set_error(rc == EAGAIN ? PM_ERR_NOMEM : PM_ERR_BACKEND,
                         "stream_create: pthread_create: %s", strerror(rc));
  }
  pthread_setname_np(s->thread, "pinmem-stream");
  *out = s;
  return PM_OK;
}

/* The stream has left every set: drain, join, wait out the last users, free. */
static void stream_free(struct pm_stream_s *s) {
  pthread_mutex_lock(&s->mu);
  s->closing = true;
  pthread_cond_signal(&s->cv_work);
  pthread_mutex_unlock(&s->mu);
  pthread_join(s->thread, NULL);
  pthread_mutex_lock(&s->mu);
  while (s->users) pthread_cond_wait(&s->cv_state, &s->mu);
  pthread_mutex_unlock(&s->mu);
  pthread_cond_destroy(&s->cv_state);
  pthread_cond_destroy(&s->cv_work);
  pthread_mutex_destroy(&s->mu);
  free(s);
}

static bool on_own_worker(const struct pm_stream_s *s) {
  return pthread_equal(pthread_self(), s->thread);
}

/* With obj_lock held: the stream behind a handle. NULL is the default stream, created here on
 * first use when `create` (otherwise *out is NULL while it does not exist yet). */
static pm_status_t stream_lookup_locked(const char *fn, pm_stream_t h, bool create,
                                        struct pm_stream_s **out) {
  if (!h) {
    if (!default_stream && create) {
      pm_status_t st = stream_new(&default_stream);
      if (st != PM_OK) return pm__wrap_error(st, "%s: creating the default stream", fn);
    }
    *out = default_stream;
    return PM_OK;
  }
  if (!set_has(&stream_set, h))
    return pm__set_error(PM_ERR_INVALID,
                         "%s: stream %p was destroyed (or was not created by the host backend)", fn,
                         (void *)h);
  *out = h;
  return PM_OK;
}

/* With obj_lock held: take the stream's lock, then drop obj_lock. */
static void stream_enter(struct pm_stream_s *s) {
  pthread_mutex_lock(&s->mu);
  pthread_mutex_unlock(&obj_lock);
}

static void enqueue_locked(struct pm_stream_s *s, hb_op_t *op) {
  op->next = NULL;
  if (s->tail)
    s->tail->next = op;
  else
    s->head = op;
  s->tail = op;
  s->submitted++;
  pthread_cond_signal(&s->cv_work);
}

/* With s->mu held and the caller counted in s->users: wait until `target` ops are done. */
static void wait_done_locked(struct pm_stream_s *s, uint64_t target) {
  while (s->done < target) pthread_cond_wait(&s->cv_state, &s->mu);
}

static void user_leave_locked(struct pm_stream_s *s) {
  if (--s->users == 0 && s->closing) pthread_cond_broadcast(&s->cv_state);
}

/* Queue op on the stream; on failure the op is freed. */
static pm_status_t submit(const char *fn, pm_stream_t h, hb_op_t *op) {
  struct pm_stream_s *s = NULL;
  pthread_mutex_lock(&obj_lock);
  pm_status_t st = stream_lookup_locked(fn, h, true, &s);
  if (st != PM_OK) {
    pthread_mutex_unlock(&obj_lock);
    free(op);
    return st;
  }
  stream_enter(s);
  enqueue_locked(s, op);
  pthread_mutex_unlock(&s->mu);
  return PM_OK;
}

static hb_op_t *op_new(const char *fn, hb_op_kind_t kind) {
  hb_op_t *op = calloc(1, sizeof *op);
  if (!op) {
    pm__set_error(PM_ERR_NOMEM, "%s: out of memory for a stream op", fn);
    return NULL;
  }
  op->kind = kind;
  return op;
}

static pm_status_t stream_create(pm_stream_t *stream_out) {
  if (!stream_out) return pm__set_error(PM_ERR_INVALID, "stream_create: stream_out is NULL");
  struct pm_stream_s *s = NULL;
  pm_status_t st = stream_new(&s);
  if (st != PM_OK) return st;
  pthread_mutex_lock(&obj_lock);
  st = set_add(&stream_set, s);
  pthread_mutex_unlock(&obj_lock);
  if (st != PM_OK) {
    stream_free(s);
    return pm__wrap_error(st, "stream_create");
  }
  *stream_out = s;
  return PM_OK;
}

static pm_status_t stream_destroy(pm_stream_t h) {
  if (!h) return pm__set_error(PM_ERR_INVALID, "stream_destroy: NULL is the default stream");
  pthread_mutex_lock(&obj_lock);
  struct pm_stream_s *s = NULL;
  pm_status_t st = stream_lookup_locked("stream_destroy", h, false, &s);
  if (st == PM_OK && on_own_worker(s))
    st = pm__set_error(PM_ERR_STATE,
                       "stream_destroy(%p): called from a host function running on that stream",
                       (void *)h);
  if (st == PM_OK) set_del(&stream_set, s);
  pthread_mutex_unlock(&obj_lock);
  if (st != PM_OK) return st;
  stream_free(s);
  return PM_OK;
}

static pm_status_t stream_synchronize(pm_stream_t h) {
  struct pm_stream_s *s = NULL;
  pthread_mutex_lock(&obj_lock);
  pm_status_t st = stream_lookup_locked("stream_synchronize", h, false, &s);
  if (st == PM_OK && s && on_own_worker(s))
    st = pm__set_error(PM_ERR_STATE,
                       "stream_synchronize(%p): called from a host function "
                       "running on that stream (it would wait for itself)",
                       (void *)h);
  if (st != PM_OK || !s) {
    pthread_mutex_unlock(&obj_lock);
    return st;
  }
  stream_enter(s);
  s->users++;
  wait_done_locked(s, s->submitted);
  user_leave_locked(s);
  pthread_mutex_unlock(&s->mu);
  return PM_OK;
}

static pm_status_t stream_query(pm_stream_t h) {
  struct pm_stream_s *s = NULL;
  pthread_mutex_lock(&obj_lock);
  pm_status_t st = stream_lookup_locked("stream_query", h, false, &s);
  if (st != PM_OK || !s) {
    pthread_mutex_unlock(&obj_lock);
    return st;
  }
  stream_enter(s);
  st = s->done == s->submitted ? PM_OK : PM_NOT_READY;
  pthread_mutex_unlock(&s->mu);
  return st;
}

/* With obj_lock held. */
static pm_status_t event_lookup_locked(const char *fn, pm_event_t ev) {
  if (!ev) return pm__set_error(PM_ERR_INVALID, "%s: event is NULL", fn);
  if (!set_has(&event_set, ev))
    return pm__set_error(PM_ERR_INVALID,
                         "%s: event %p was destroyed (or was not created by the host backend)", fn,
                         (void *)ev);
  return PM_OK;
}

static pm_status_t stream_wait_event(pm_stream_t h, pm_event_t ev) {
  static const char fn[] = "stream_wait_event";
  if (!ev) return pm__set_error(PM_ERR_INVALID, "%s: event is NULL", fn);
  hb_op_t *op = op_new(fn, OP_WAIT);
  if (!op) return PM_ERR_NOMEM;
  struct pm_stream_s *s = NULL;
  pthread_mutex_lock(&obj_lock);
  pm_status_t st = event_lookup_locked(fn, ev);
  if (st == PM_OK) st = stream_lookup_locked(fn, h, true, &s);
  if (st != PM_OK) {
    pthread_mutex_unlock(&obj_lock);
    free(op);
    return st;
  }
  /* Capture the record that is latest now; a never-recorded or completed one needs no wait. */
  pthread_mutex_lock(&rec_lock);
  hb_rec_t *r = ev->latest;
  if (r && !r->done)
    r->refs++;
  else
    r = NULL;
  pthread_mutex_unlock(&rec_lock);
  if (!r) {
    pthread_mutex_unlock(&obj_lock);
    free(op);
    return PM_OK;
  }
  op->u.rec = r;
  stream_enter(s);
  enqueue_locked(s, op);
  pthread_mutex_unlock(&s->mu);
  return PM_OK;
}

static pm_status_t event_create(unsigned flags, pm_event_t *event_out) {
  if (!event_out) return pm__set_error(PM_ERR_INVALID, "event_create: event_out is NULL");
  if (flags & ~(unsigned)PM_EVENT_TIMING)
    return pm__set_error(PM_ERR_INVALID, "event_create: unknown flags 0x%x",
                         flags & ~(unsigned)PM_EVENT_TIMING);
  struct pm_event_s *ev = calloc(1, sizeof *ev);
  if (!ev) return pm__set_error(PM_ERR_NOMEM, "event_create: out of memory");
  ev->flags = flags;
  pthread_mutex_lock(&obj_lock);
  pm_status_t st = set_add(&event_set, ev);
  pthread_mutex_unlock(&obj_lock);
  if (st != PM_OK) {
    free(ev);
    return pm__wrap_error(st, "event_create");
  }
  *event_out = ev;
  return PM_OK;
}

static pm_status_t event_destroy(pm_event_t ev) {
  pthread_mutex_lock(&obj_lock);
  pm_status_t st = event_lookup_locked("event_destroy", ev);
  if (st == PM_OK) {
    set_del(&event_set, ev);
    /* A pending record lives on in its op and in waits that captured it (CUDA too lets an
     * event with pending work be destroyed). */
    pthread_mutex_lock(&rec_lock);
    rec_unref_locked(ev->latest);
    pthread_mutex_unlock(&rec_lock);
  }
  pthread_mutex_unlock(&obj_lock);
  if (st == PM_OK) free(ev);
  return st;
}

static pm_status_t event_record(pm_event_t ev, pm_stream_t h) {
  static const char fn[] = "event_record";
  if (!ev) return pm__set_error(PM_ERR_INVALID, "%s: event is NULL", fn);
  hb_op_t *op = op_new(fn, OP_RECORD);
  hb_rec_t *r = calloc(1, sizeof *r);
  if (!op || !r) {
    free(op);
    free(r);
    return pm__set_error(PM_ERR_NOMEM, "%s: out of memory", fn);
  }
  r->refs = 2; /* the event and the op */
  op->u.rec = r;
  struct pm_stream_s *s = NULL;
  pthread_mutex_lock(&obj_lock);
  pm_status_t st = event_lookup_locked(fn, ev);
  if (st == PM_OK) st = stream_lookup_locked(fn, h, true, &s);
  if (st != PM_OK) {
    pthread_mutex_unlock(&obj_lock);
    free(op);
    free(r);
    return st;
  }
  pthread_mutex_lock(&rec_lock);
  rec_unref_locked(ev->latest);
  ev->latest = r;
  pthread_mutex_unlock(&rec_lock);
  stream_enter(s);
  enqueue_locked(s, op);
  pthread_mutex_unlock(&s->mu);
  return PM_OK;
}

static pm_status_t event_query(pm_event_t ev) {
  pthread_mutex_lock(&obj_lock);
  pm_status_t st = event_lookup_locked("event_query", ev);
  if (st == PM_OK) {
    pthread_mutex_lock(&rec_lock);
    st = !ev->latest || ev->latest->done ? PM_OK : PM_NOT_READY;
    pthread_mutex_unlock(&rec_lock);
  }
  pthread_mutex_unlock(&obj_lock);
  return st;
}

static pm_status_t event_synchronize(pm_event_t ev) {
  pthread_mutex_lock(&obj_lock);
  pm_status_t st = event_lookup_locked("event_synchronize", ev);
  if (st != PM_OK) {
    pthread_mutex_unlock(&obj_lock);
    return st;
  }
  pthread_mutex_lock(&rec_lock);
  hb_rec_t *r = ev->latest;
  if (r) r->refs++;
  pthread_mutex_unlock(&obj_lock); /* the event may go now; the reference keeps the record */
  if (r) {
    while (!r->done) pthread_cond_wait(&rec_cv, &rec_lock);
    rec_unref_locked(r);
  }
  pthread_mutex_unlock(&rec_lock);
  return PM_OK;
}

static pm_status_t event_elapsed(pm_event_t start, pm_event_t end, double *seconds_out) {
  static const char fn[] = "event_elapsed";
  if (!start || !end) return pm__set_error(PM_ERR_INVALID, "%s: event is NULL", fn);
  if (!seconds_out) return pm__set_error(PM_ERR_INVALID, "%s: seconds_out is NULL", fn);
  pthread_mutex_lock(&obj_lock);
  pm_status_t st = event_lookup_locked(fn, start);
  if (st == PM_OK) st = event_lookup_locked(fn, end);
  if (st != PM_OK) {
    pthread_mutex_unlock(&obj_lock);
    return st;
  }
  double dt = 0;
  pthread_mutex_lock(&rec_lock);
  const hb_rec_t *a = start->latest, *b = end->latest;
  /* The order and the statuses follow cudaEventElapsedTime and the cuda backend's mapping:
   * no timing or no record -> invalid handle; not complete -> a state error. */
  if (!(start->flags & PM_EVENT_TIMING) || !(end->flags & PM_EVENT_TIMING))
    st = pm__set_error(PM_ERR_INVALID, "%s(%p, %p): both events need PM_EVENT_TIMING", fn,
                       (void *)start, (void *)end);
  else if (!a || !b)
    st = pm__set_error(PM_ERR_INVALID, "%s(%p, %p): the %s event was never recorded", fn,
                       (void *)start, (void *)end, !a ? "start" : "end");
  else if (!a->done || !b->done)
    st = pm__set_error(PM_ERR_STATE, "%s(%p, %p): the %s event has not completed yet", fn,
                       (void *)start, (void *)end, !a->done ? "start" : "end");
  else
    dt = b->t_done - a->t_done;
  pthread_mutex_unlock(&rec_lock);
  pthread_mutex_unlock(&obj_lock);
  if (st == PM_OK) *seconds_out = dt;
  return st;
}

/* ------------------------------------------------------------------------------------------ */
/* Copies, memset, prefetch, busy, host functions                                              */
/* ------------------------------------------------------------------------------------------ */

typedef struct hb_side {
  bool in_dev;    /* in the device table (device or managed) */
  bool plain_dev; /* device memory proper (not managed) */
  bool fits;      /* the whole span lies in that allocation */
  bool pinned;    /* the whole span lies in one pinned range */
  hb_range_t dev;
} hb_side_t;

static void classify_locked(const void *ptr, size_t bytes, hb_side_t *out) {
  uintptr_t p = (uintptr_t)ptr;
  memset(out, 0, sizeof *out);
  long i = tbl_find(&device_tbl, p);
  if (i >= 0) {
    out->dev = device_tbl.v[i];
    out->in_dev = true;
    out->plain_dev = out->dev.kind == R_DEVICE;
    out->fits = bytes <= out->dev.size - (p - out->dev.base);
  }
  i = tbl_find(&pinned_tbl, p);
  if (i >= 0) {
    const hb_range_t *r = &pinned_tbl.v[i];
    out->pinned = !r->pending && bytes <= r->size - (p - r->base);
  }
}


static pm_status_t check_side(const char *fn, pm_copy_kind_t kind, const char *what,
                              const void *ptr, size_t bytes, const hb_side_t *sd, bool want_dev) {
  if (want_dev && !sd->in_dev)
    return pm__set_error(PM_ERR_INVALID,
                         "%s: copy kind %s but the %s %p is not device memory of the host backend",
                         fn, pm__copy_kind_name(kind), what, ptr);
  if (!want_dev && sd->plain_dev)
    return pm__set_error(PM_ERR_INVALID, "%s: copy kind %s but the %s %p is device memory", fn,
                         pm__copy_kind_name(kind), what, ptr);
  if (sd->in_dev && !sd->fits)
    return pm__set_error(PM_ERR_INVALID,
                         "%s: the %s [%p, +%zu) runs past the end of its %s [%p, +%zu)", fn, what,
                         ptr, bytes, range_desc(sd->dev.kind), (void *)sd->dev.base, sd->dev.size);
  return PM_OK;
}

/* Validate a copy, resolve PM_COPY_DEFAULT, and say whether it blocks the caller: a pageable
 * host side, or host to host (synchronous with respect to the host in CUDA, pinned or not). */
static pm_status_t copy_prepare(const char *fn, void *dst, const void *src, size_t bytes,
                                pm_copy_kind_t *kind, bool *blocking_out) {
  if ((unsigned)*kind > PM_COPY_H2H)
    return pm__set_error(PM_ERR_INVALID, "%s: unknown copy kind %d", fn, (int)*kind);
  if (!dst || !src)
    return pm__set_error(PM_ERR_INVALID, "%s: %s pointer is NULL", fn,
                         dst ? "source" : "destination");
  if ((uintptr_t)dst + bytes < (uintptr_t)dst || (uintptr_t)src + bytes < (uintptr_t)src)
    return pm__set_error(PM_ERR_INVALID, "%s: a %zu-byte span wraps the address space", fn, bytes);
  hb_side_t d, s;
  pthread_mutex_lock(&mem_lock);
  classify_locked(dst, bytes, &d);
  classify_locked(src, bytes, &s);
  pthread_mutex_unlock(&mem_lock);

  if (*kind == PM_COPY_DEFAULT)
    *kind =
        s.in_dev ? (d.in_dev ? PM_COPY_D2D : PM_COPY_D2H) : (d.in_dev ? PM_COPY_H2D : PM_COPY_H2H);
  bool dst_dev = *kind == PM_COPY_H2D || *kind == PM_COPY_D2D;
  bool src_dev = *kind == PM_COPY_D2H || *kind == PM_COPY_D2D;
  pm_status_t st = check_side(fn, *kind, "destination", dst, bytes, &d, dst_dev);
  if (st == PM_OK) st = check_side(fn, *kind, "source", src, bytes, &s, src_dev);
  if (st != PM_OK) return st;
  /* Managed memory is never pageable: the driver handles it on either side. */
  *blocking_out = *kind == PM_COPY_H2H || (!dst_dev && !d.pinned && !d.in_dev) ||
                  (!src_dev && !s.pinned && !s.in_dev);
  return PM_OK;
}

/* The blocking path: as with CUDA's driver, the caller blocks until the stream's earlier work is
 * done, the copy (done here, on the calling thread) is over, and later work may go on. */
static pm_status_t copy_blocking(const char *fn, void *dst, const void *src, size_t bytes,
                                 pm_stream_t h) {
  hb_op_t *op = op_new(fn, OP_GATE);
  if (!op) return PM_ERR_NOMEM;
  struct pm_stream_s *s = NULL;
  pthread_mutex_lock(&obj_lock);
  pm_status_t st = stream_lookup_locked(fn, h, true, &s);
  if (st == PM_OK && on_own_worker(s))
    st = pm__set_error(PM_ERR_STATE,
                       "%s: a blocking copy (pageable memory or host to host), called from a "
                       "host function running on the same stream (it would wait for itself)",
                       fn);
  if (st != PM_OK) {
    pthread_mutex_unlock(&obj_lock);
    free(op);
    return st;
  }
  stream_enter(s);
  enqueue_locked(s, op);
  s->users++;
  while (!op->u.gate.reached) pthread_cond_wait(&s->cv_state, &s->mu);
  pthread_mutex_unlock(&s->mu);

  memmove(dst, src, bytes);

  pthread_mutex_lock(&s->mu);
  op->u.gate.released = true; /* the worker frees op from here on */
  pthread_cond_signal(&s->cv_work);
  user_leave_locked(s);
  pthread_mutex_unlock(&s->mu);
  return PM_OK;
}

static pm_status_t memcpy_async(void *dst, const void *src, size_t bytes, pm_copy_kind_t kind,
                                pm_stream_t stream) {
  static const char fn[] = "memcpy_async";
  if ((unsigned)kind > PM_COPY_H2H)
    return pm__set_error(PM_ERR_INVALID, "%s: unknown copy kind %d", fn, (int)kind);
  if (bytes == 0) return PM_OK; /* as cudaMemcpyAsync */
  bool blocking = true;
  pm_status_t st = copy_prepare(fn, dst, src, bytes, &kind, &blocking);
  if (st != PM_OK) return st;
  if (blocking) return copy_blocking(fn, dst, src, bytes, stream);
  hb_op_t *op = op_new(fn, OP_COPY);
  if (!op) return PM_ERR_NOMEM;
  op->u.copy.dst = dst;
  op->u.copy.src = src;
  op->u.copy.bytes = bytes;
  return submit(fn, stream, op);
}

static pm_status_t memcpy_sync(void *dst, const void *src, size_t bytes, pm_copy_kind_t kind) {
  if ((unsigned)kind > PM_COPY_H2H)
    return pm__set_error(PM_ERR_INVALID, "memcpy_sync: unknown copy kind %d", (int)kind);
  if (bytes == 0) return PM_OK;
  pm_status_t st = memcpy_async(dst, src, bytes, kind, NULL);
  if (st != PM_OK) return pm__wrap_error(st, "memcpy_sync");
  return stream_synchronize(NULL);
}

static pm_status_t device_memset_async(void *dptr, int value, size_t bytes, pm_stream_t stream) {
  static const char fn[] = "device_memset_async";
  if (!dptr) return pm__set_error(PM_ERR_INVALID, "%s: ptr is NULL", fn);
  if (bytes == 0) return PM_OK;
  pm_status_t st = check_device_span(fn, "destination", dptr, bytes, -1);
  if (st != PM_OK) return st;
  hb_op_t *op = op_new(fn, OP_MEMSET);
  if (!op) return PM_ERR_NOMEM;
  op->u.set.dst = dptr;
  op->u.set.value = value;
  op->u.set.bytes = bytes;
  return submit(fn, stream, op);
}

static pm_status_t managed_prefetch(const void *ptr, size_t bytes, int device, pm_stream_t stream) {
  static const char fn[] = "managed_prefetch";
  if (!ptr) return pm__set_error(PM_ERR_INVALID, "%s: ptr is NULL", fn);
  if (device != 0 && device != PM_CPU_DEVICE)
    return pm__set_error(PM_ERR_INVALID,
                         "%s: device %d out of range (the host backend has device 0; "
                         "PM_CPU_DEVICE is the host)",
                         fn, device);
  pm_status_t st = check_device_span(fn, "range", ptr, bytes, R_MANAGED);
  if (st != PM_OK || bytes == 0) return st;
  hb_op_t *op = op_new(fn, OP_PREFETCH);
  if (!op) return PM_ERR_NOMEM;
  return submit(fn, stream, op);
}

/* The CPU plays the kernel: a stream op that copies every piece when the stream reaches it. The
 * pieces are checked now as a kernel's pointers would have to be valid: device or managed memory,
 * or pinned host memory (pageable memory is an error, as a kernel could not reach it). */
static pm_status_t launch_batch_copy(const pm__copy_desc_t *desc, size_t count,
                                     pm_stream_t stream) {
  static const char fn[] = "launch_batch_copy";
  if (count == 0) return PM_OK;
  if (!desc) return pm__set_error(PM_ERR_INVALID, "%s: desc is NULL", fn);
  if (count > (SIZE_MAX - sizeof(hb_op_t)) / sizeof *desc)
    return pm__set_error(PM_ERR_INVALID, "%s: %zu pieces", fn, count);
  for (size_t i = 0; i < count; i++) {
    pm_copy_kind_t kind = PM_COPY_DEFAULT;
    bool blocking = false;
    pm_status_t st =
        copy_prepare(fn, desc[i].dst, desc[i].src, (size_t)desc[i].bytes, &kind, &blocking);
    if (st != PM_OK) return pm__wrap_error(st, "piece %zu", i);
    if (blocking)
      return pm__set_error(PM_ERR_INVALID,
                           "%s: piece %zu (%p -> %p, %llu bytes) touches pageable host memory "
                           "or goes host to host: a kernel copies only device, managed and "
                           "pinned memory",
                           fn, i, desc[i].src, desc[i].dst, (unsigned long long)desc[i].bytes);
  }
  hb_op_t *op = calloc(1, sizeof *op + count * sizeof *desc);
  if (!op) return pm__set_error(PM_ERR_NOMEM, "%s: out of memory for %zu pieces", fn, count);
  op->kind = OP_BATCH;
  pm__copy_desc_t *copy = (pm__copy_desc_t *)(void *)(op + 1);
  memcpy(copy, desc, count * sizeof *desc);
  op->u.batch.desc = copy;
  op->u.batch.count = count;
  return submit(fn, stream, op);
}

static int kernel_host_access(void) {
  return 1; /* the "device" is the CPU: every pinned byte is at hand */
}

static pm_status_t launch_busy(pm_stream_t stream, double seconds) {
  if (!(seconds >= 0.0) || seconds > HB_BUSY_MAX_SECONDS) /* !(x >= 0) also rejects NaN */
    return pm__set_error(PM_ERR_INVALID, "launch_busy: %g seconds is not in [0, %g]", seconds,
                         HB_BUSY_MAX_SECONDS);
  hb_op_t *op = op_new("launch_busy", OP_BUSY);
  if (!op) return PM_ERR_NOMEM;
  op->u.seconds = seconds;
  return submit("launch_busy", stream, op);
}

static pm_status_t launch_host_func(pm_stream_t stream, void (*fn)(void *), void *arg) {
  if (!fn) return pm__set_error(PM_ERR_INVALID, "launch_host_func: fn is NULL");
  hb_op_t *op = op_new("launch_host_func", OP_HOST_FUNC);
  if (!op) return PM_ERR_NOMEM;
  op->u.func.fn = fn;
  op->u.func.arg = arg;
  return submit("launch_host_func", stream, op);
}

/* ------------------------------------------------------------------------------------------ */
/* Lifecycle and devices                                                                       */
/* ------------------------------------------------------------------------------------------ */

static pm_status_t hb_init(void) {
  return PM_OK; /* everything starts lazily */
}

static void hb_shutdown(void) {
  pthread_mutex_lock(&obj_lock);
  struct pm_stream_s *s = default_stream;
  default_stream = NULL;
  set_release_if_empty(&stream_set);
  set_release_if_empty(&event_set);
  pthread_mutex_unlock(&obj_lock);
  if (s) stream_free(s);

  /* Ranges the caller still holds stay listed, so they can still be released correctly. */
  pthread_mutex_lock(&mem_lock);
  if (!pinned_tbl.n) tbl_release(&pinned_tbl);
  if (!device_tbl.n) tbl_release(&device_tbl);
  pthread_mutex_unlock(&mem_lock);
}

static pm_status_t device_count(int *count_out) {
  if (!count_out) return pm__set_error(PM_ERR_INVALID, "device_count: count_out is NULL");
  *count_out = 1;
  return PM_OK;
}

static pm_status_t check_device_index(const char *fn, int device) {
  if (device != 0)
    return pm__set_error(PM_ERR_INVALID,
                         "%s: device %d out of range (the host backend has one "
                         "device: 0)",
                         fn, device);
  return PM_OK;
}

static pm_status_t device_info(int device, pm_device_info_t *info_out) {
  if (!info_out) return pm__set_error(PM_ERR_INVALID, "device_info: info_out is NULL");
  pm_status_t st = check_device_index("device_info", device);
  if (st != PM_OK) return st;
  pm_device_info_t d;
  memset(&d, 0, sizeof d);
  d.index = device;
  snprintf(d.name, sizeof d.name, "host (CPU plays the device)");
  d.cc_major = d.cc_minor = 0;
  d.total_memory = device_total();
  pthread_mutex_lock(&mem_lock);
  size_t used = device_used;
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

static pm_status_t set_device(int device) {
  return check_device_index("set_device", device);
}

static pm_status_t get_device(int *device_out) {
  if (!device_out) return pm__set_error(PM_ERR_INVALID, "get_device: device_out is NULL");
  *device_out = 0;
  return PM_OK;
}

static pm_status_t device_synchronize(void) {
  typedef struct {
    struct pm_stream_s *s;
    uint64_t target;
  } hb_wait_t;
  pthread_mutex_lock(&obj_lock);
  size_t n = stream_set.n + (default_stream ? 1 : 0);
  hb_wait_t *w = n ? malloc(n * sizeof *w) : NULL;
  if (n && !w) {
    pthread_mutex_unlock(&obj_lock);
    return pm__set_error(PM_ERR_NOMEM, "device_synchronize: out of memory for %zu streams", n);
  }
  for (size_t i = 0; i < n; i++) {
    struct pm_stream_s *s =
        i < stream_set.n ? (struct pm_stream_s *)stream_set.v[i] : default_stream;
    if (on_own_worker(s)) {
      pthread_mutex_unlock(&obj_lock);
      free(w);
      return pm__set_error(PM_ERR_STATE,
                           "device_synchronize: called from a host function running on a "
                           "stream (it would wait for itself)");
    }
  }
  /* Count ourselves as a user of every stream so none is freed while we wait on it. */
  for (size_t i = 0; i < n; i++) {
    struct pm_stream_s *s =
        i < stream_set.n ? (struct pm_stream_s *)stream_set.v[i] : default_stream;
    pthread_mutex_lock(&s->mu);
    s->users++;
    w[i].s = s;
    w[i].target = s->submitted;
    pthread_mutex_unlock(&s->mu);
  }
  pthread_mutex_unlock(&obj_lock);
  for (size_t i = 0; i < n; i++) {
    pthread_mutex_lock(&w[i].s->mu);
    wait_done_locked(w[i].s, w[i].target);
    user_leave_locked(w[i].s);
    pthread_mutex_unlock(&w[i].s->mu);
  }
  free(w);
  return PM_OK;
}

const pm__backend_t pm__backend_host = {
    .name = "host",
    .kind = PM_BACKEND_HOST,
    .init = hb_init,
    .shutdown = hb_shutdown,
    .device_count = device_count,
    .device_info = device_info,
    .set_device = set_device,
    .get_device = get_device,
    .device_synchronize = device_synchronize,
    .host_alloc = host_alloc,
    .host_free = host_free,
    .host_register = host_register,
    .host_unregister = host_unregister,
    .host_device_pointer = host_device_pointer,
    .device_alloc = device_alloc,
    .device_free = device_free,
    .device_memset_async = device_memset_async,
    .managed_alloc = managed_alloc,
    .managed_free = managed_free,
    .managed_prefetch = managed_prefetch,
    .stream_create = stream_create,
    .stream_destroy = stream_destroy,
    .stream_synchronize = stream_synchronize,
    .stream_query = stream_query,
    .stream_wait_event = stream_wait_event,
    .event_create = event_create,
    .event_destroy = event_destroy,
    .event_record = event_record,
    .event_query = event_query,
    .event_synchronize = event_synchronize,
    .event_elapsed = event_elapsed,
    .memcpy_async = memcpy_async,
    .memcpy_sync = memcpy_sync,
    .launch_busy = launch_busy,
    .launch_batch_copy = launch_batch_copy,
    .kernel_host_access = kernel_host_access,
    .launch_host_func = launch_host_func,
    .pointer_kind = pointer_kind,
};

/* fork.c: in a forked child no stream worker runs and nothing is mlock'd (locks of memory are not
 * inherited), so the child starts with empty tables and creates its own streams; the parent's
 * streams, events and allocations are unknown to it (a call on one is an error, not a hang). */
static struct pm_stream_s *parent_default_stream; /* left behind, still reachable */

void pm__host_atfork(pm__fork_phase_t phase) {
  if (phase == PM__FORK_PREPARE) {
    pthread_mutex_lock(&obj_lock);
    pthread_mutex_lock(&rec_lock);
    pthread_mutex_lock(&mem_lock);
  } else if (phase == PM__FORK_PARENT) {
    pthread_mutex_unlock(&mem_lock);
    pthread_mutex_unlock(&rec_lock);
    pthread_mutex_unlock(&obj_lock);
  } else {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t fresh_cv = PTHREAD_COND_INITIALIZER;
    obj_lock = fresh;
    rec_lock = fresh;
    mem_lock = fresh;
    rec_cv = fresh_cv;
    pinned_tbl.n = 0;
    device_tbl.n = 0;
    device_used = 0;
    pinned_bytes = 0;
    stream_set.n = 0;
    event_set.n = 0;
    parent_default_stream = default_stream;
    default_stream = NULL;
  }
}
