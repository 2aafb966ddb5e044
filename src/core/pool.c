/*
 * DESIGN: the pinned host memory pool, a caching allocator in the style of PyTorch's host
 * allocator, with three differences that matter for pinned memory: size classes waste at most
 * 12.5% (not power-of-two rounding), stream-ordered reuse polls every freed block on its own (one
 * slow stream never holds back blocks other streams freed), and a hard budget on pinned bytes.
 *
 * Data structure
 * - A segment is one backend allocation (cudaHostAlloc, or mmap + touch + register for large
 *   ones: pin.c; a memfd mapped MAP_SHARED + register for PM_HOST_SHARED: shared.c). It is
 *   entered in the process registry (kind PM_MEMORY_POOL, owner = pool), which
 *   is how pm_host_free finds the pool from a bare pointer.
 * - A segment is cut into blocks that tile it exactly, doubly linked in address order. Freeing a
 *   block coalesces it with free neighbours; taking a bigger free block splits off the remainder.
 *   Requests under 1 MiB get a 2 MiB segment that later small requests carve; larger ones get a
 *   segment of exactly their class (page rounded), so big memory is never held hostage.
 * - Free blocks sit in size bins (one bin per size class boundary, floor mapping; a bitmap of
 *   non-empty bins finds the smallest fitting bin in a few word scans), one bin set per flag
 *   combination: mapped, write-combined, portable and shared memory never mix.
 * - Allocated, pending and quarantined blocks are in a hash map keyed by start address (O(1)
 *   free / record_stream / usable_size). Free blocks are not: an unknown pointer is resolved by
 *   scanning the segment that holds it, which only error paths and interior-pointer queries do.
 * - A freed block with recorded streams gets one event per stream and waits on the pending list
 *   until all its events completed; then it is coalesced and binned like any free block.
 *
 * Invariants (under the pool lock)
 * - pinned = bytes of all segments + reservations in flight + registered (charged) bytes, and
 *   pinned <= budget at every moment: bytes are reserved before the backend call that pins them
 *   and released only after the call that unpins them returned.
 * - Every byte of a segment is in exactly one block; no two adjacent blocks are both FREE.
 * - A block is in exactly one of: bins (FREE), hash (IN_USE), hash + pending list or in flight
 *   to it (PENDING), hash (QUARANTINED: its stream could neither record nor synchronize).
 * - cached_bytes = sum of binned blocks; pending_bytes includes quarantined blocks.
 *
 * Threads and lock order: pool lock -> registry lock (the registry is a leaf). The default-pool
 * creation lock is separate and taken before a pool lock, never inside one. The backend (event
 * create/record/query/sync, host_alloc/free, register/unregister) is never called with the pool
 * lock held: the pending list is detached under the lock, queried outside and merged back, and
 * segments to release are unlinked under the lock and freed outside. Stats are read under the
 * lock.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"

#define PM__GRAN ((size_t)256)            /* minimum class granularity and alignment */
#define PM__SMALL_LIMIT ((size_t)1 << 20) /* requests below this share 2 MiB segments */
#define PM__SMALL_SEGMENT ((size_t)2 << 20)
#define PM__NBINS 448 /* covers every 64-bit size (max index 430) */
#define PM__BITMAP_WORDS (PM__NBINS / 64)
#define PM__NGROUPS 16 /* one bin set per PM_HOST_* flag combination */
#define PM__HOST_FLAGS (PM_HOST_MAPPED | PM_HOST_WRITE_COMBINED | PM_HOST_PORTABLE | PM_HOST_SHARED)
#define PM__INLINE_USES 4
#define PM__SPARE_BLOCKS_MAX 1024
#define PM__WAIT_SLICE_S 0.001

enum { PM__B_FREE = 0, PM__B_IN_USE, PM__B_PENDING, PM__B_QUARANTINED };

typedef struct pm__use {
  pm_stream_t stream;
  pm_event_t event; /* recorded at free (NULL until then, or if creating one failed) */
  bool done;        /* nothing left to wait for on this stream */
} pm__use_t;

typedef struct pm__segment pm__segment_t;
typedef struct pm__block pm__block_t;

struct pm__block {
  char *ptr;
  size_t size;      /* capacity */
  size_t requested; /* what the caller asked for, while in use */
  pm__segment_t *seg;
  pm__block_t *aprev, *anext; /* address order within the segment */
  pm__block_t *lprev, *lnext; /* bin list (FREE) or pending list (PENDING) */
  pm__block_t *hnext;         /* hash chain */
  int state;
  int bin;
  int nuses, cap_uses;
  pm__use_t *uses;
  pm__use_t inline_uses[PM__INLINE_USES];
};

struct pm__segment {
  char *base;
  size_t size;
  unsigned flags;
  bool fast; /* pinned by pm__fast_pin (else backend host_alloc) */
  void *dev_base;
  pm__block_t *first;
  pm__segment_t *prev, *next;
};

typedef struct pm__group {
  pm__block_t *bins[PM__NBINS];
  uint64_t bitmap[PM__BITMAP_WORDS];
} pm__group_t;

struct pm_pool_s {
  pthread_mutex_t lock;
  pthread_cond_t cv; /* budget released, block freed, poll/trim finished */
  const pm__backend_t *b;

  /* resolved configuration */
  size_t budget;
  bool budget_memlock; /* the automatic budget was cut to RLIMIT_MEMLOCK (host backend) */
  int policy;
  double wait_timeout_s;
  int pin_threads;
  size_t fast_pin_min;
  bool huge_pages;

  pm__group_t groups[PM__NGROUPS];
  pm__segment_t *segments;
  pm__block_t **hash;
  unsigned hash_bits;
  size_t hash_count;
  pm__block_t *pending;
  pm__block_t *spare; /* recycled block structs */
  size_t nspare;

  /* event cache: capacity always >= events_total, so returning an event never allocates */
  pm_event_t *events;
  size_t nevents, cap_events, events_total;

  int waiters;    /* threads in a timed wait on cv */
  int releasers;  /* threads outside the lock with pending blocks or segments detached */
  size_t freeing; /* frees between "pending" and "on the list" */
  size_t in_use_blocks;
  size_t quarantined;

  size_t pinned, peak, in_use, requested, cached, pending_bytes, registered;
  uint64_t nsegments, allocs, frees, cache_hits, backend_allocs, backend_frees;
  uint64_t budget_waits, budget_failures;
  double backend_alloc_s, backend_free_s;
};

/* ---- size classes and bins ---------------------------------------------------------------- */

static inline int floor_log2(size_t v) {
  return 63 - __builtin_clzll((unsigned long long)v);
}

size_t pm__size_class(size_t bytes) {
  /* Eight steps per power of two: for n in [2^k, 2^(k+1)) round up to a multiple of 2^(k-3), so
   * the waste is below 2^(k-3) <= n/8. Below 2 KiB the 256-byte floor takes over. 0 is given
   * the smallest class; a size whose class does not fit in size_t gives 0. */
  if (bytes <= 2048) return bytes == 0 ? PM__GRAN : pm__align_up(bytes, PM__GRAN);
  size_t g = (size_t)1 << (floor_log2(bytes) - 3);
  if (bytes > SIZE_MAX - (g - 1)) return 0;
  return pm__align_up(bytes, g);
}

/* Floor mapping of a size (a multiple of 256) to its bin: every block in bin i is at least the
 * class boundary that starts bin i, so a request rounded to a class fits any block of its bin. */
static inline int bin_index(size_t s) {
  if (s < 2048) return (int)(s / PM__GRAN) - 1;
  int k = floor_log2(s);
  int j = (int)((s >> (k - 3)) & 7);
  return 7 + (k - 11) * 8 + j;
}

static void bin_insert(pm_pool_t *p, pm__block_t *b) {
  pm__group_t *g = &p->groups[b->seg->flags & PM__HOST_FLAGS];
  int i = bin_index(b->size);
  b->bin = i;
  b->lprev = NULL;
  b->lnext = g->bins[i];
  if (b->lnext) b->lnext->lprev = b;
  g->bins[i] = b;
  g->bitmap[i >> 6] |= 1ull << (i & 63);
  p->cached += b->size;
}

static void bin_remove(pm_pool_t *p, pm__block_t *b) {
  pm__group_t *g = &p->groups[b->seg->flags & PM__HOST_FLAGS];
  if (b->lprev)
    b->lprev->lnext = b->lnext;
  else
    g->bins[b->bin] = b->lnext;
  if (b->lnext) b->lnext->lprev = b->lprev;
  if (!g->bins[b->bin]) g->bitmap[b->bin >> 6] &= ~(1ull << (b->bin & 63));
  b->lprev = b->lnext = NULL;
  p->cached -= b->size;
}

static pm__block_t *bin_find(pm__group_t *g, size_t need) {
  int i = bin_index(need);
  int w = i >> 6;
  uint64_t m = g->bitmap[w] & (~0ull << (i & 63));
  while (!m) {
    if (++w == PM__BITMAP_WORDS) return NULL;
    m = g->bitmap[w];
  }
  return g->bins[w * 64 + __builtin_ctzll(m)];
}

/* ---- block structs, hash ------------------------------------------------------------------ */

static void uses_reset(pm__block_t *b) {
  if (b->uses != b->inline_uses) free(b->uses);
  b->uses = b->inline_uses;
  b->cap_uses = PM__INLINE_USES;
  b->nuses = 0;
}

static pm__block_t *block_get(pm_pool_t *p) {
  pm__block_t *b = p->spare;
  if (b) {
    p->spare = b->lnext;
    p->nspare--;
  } else {
    b = malloc(sizeof *b);
    if (!b) return NULL;
  }
  memset(b, 0, sizeof *b);
  b->uses = b->inline_uses;
  b->cap_uses = PM__INLINE_USES;
  return b;
}

static void block_put(pm_pool_t *p, pm__block_t *b) {
  uses_reset(b);
  if (p->nspare >= PM__SPARE_BLOCKS_MAX) {
    free(b);
    return;
  }
  b->lnext = p->spare;
  p->spare = b;
  p->nspare++;
}

static inline size_t hash_slot(const pm_pool_t *p, const void *ptr) {
  uint64_t x = (uint64_t)((uintptr_t)ptr >> 8) * 0x9E3779B97F4A7C15ull;
  return (size_t)(x >> (64 - p->hash_bits));
}

static void hash_grow(pm_pool_t *p) {
  unsigned bits = p->hash_bits + 1;
  size_t cap = (size_t)1 << bits;
  pm__block_t **nh = calloc(cap, sizeof *nh);
  if (!nh) return; /* longer chains, still correct */
  pm__block_t **old = p->hash;
  size_t oldcap = (size_t)1 << p->hash_bits;
  p->hash = nh;
  p->hash_bits = bits;
  for (size_t i = 0; i < oldcap; i++) {
    for (pm__block_t *b = old[i], *n; b; b = n) {
      n = b->hnext;
      size_t s = hash_slot(p, b->ptr);
      b->hnext = nh[s];
      nh[s] = b;
    }
  }
  free(old);
}

static void hash_insert(pm_pool_t *p, pm__block_t *b) {
  if (p->hash_count >= ((size_t)1 << p->hash_bits) && p->hash_bits < 40) hash_grow(p);
  size_t s = hash_slot(p, b->ptr);
  b->hnext = p->hash[s];
  p->hash[s] = b;
  p->hash_count++;
}

static pm__block_t *hash_find(const pm_pool_t *p, const void *ptr) {
  for (pm__block_t *b = p->hash[hash_slot(p, ptr)]; b; b = b->hnext)
    if (b->ptr == ptr) return b;
  return NULL;
}

static void hash_remove(pm_pool_t *p, pm__block_t *b) {
  pm__block_t **pp = &p->hash[hash_slot(p, b->ptr)];
  while (*pp && *pp != b) pp = &(*pp)->hnext;
  if (*pp) {
    *pp = b->hnext;
    p->hash_count--;
  }
  b->hnext = NULL;
}

/* The block holding ptr (any state), *exact if ptr is its start; NULL if no segment holds it. */
static pm__block_t *locate_locked(pm_pool_t *p, const void *ptr, bool *exact) {
  pm__block_t *b = hash_find(p, ptr);
  if (b) {
    *exact = true;
    return b;
  }
  const char *c = ptr;
  for (pm__segment_t *s = p->segments; s; s = s->next) {
    if (c < s->base || c >= s->base + s->size) continue;
    for (b = s->first; b; b = b->anext) {
      if (c >= b->ptr && c < b->ptr + b->size) {
        *exact = (c == b->ptr);
        return b;
      }
    }
    return NULL;
  }
  return NULL;
}

/* ---- budget helpers ------------------------------------------------------------------------ */

static inline void wake_locked(pm_pool_t *p) {
  if (p->waiters) pthread_cond_broadcast(&p->cv);
}

static void wait_slice_locked(pm_pool_t *p, double seconds) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  if (seconds < 1e-6) seconds = 1e-6;
  long long ns = (long long)(seconds * 1e9) + ts.tv_nsec;
  ts.tv_sec += (time_t)(ns / 1000000000LL);
  ts.tv_nsec = (long)(ns % 1000000000LL);
  p->waiters++;
  pthread_cond_timedwait(&p->cv, &p->lock, &ts);
  p->waiters--;
}

static void reserve_locked(pm_pool_t *p, size_t bytes) {
  p->pinned += bytes;
  if (p->pinned > p->peak) p->peak = p->pinned;
}

static void unreserve_locked(pm_pool_t *p, size_t bytes) {
  p->pinned = bytes <= p->pinned ? p->pinned - bytes : 0;
  wake_locked(p);
}

/* ---- freeing blocks, pending polls, trim ----------------------------------------------------- */

/* A block whose last use is over becomes free: leave the hash, merge with free neighbours, bin. */
static void make_free_locked(pm_pool_t *p, pm__block_t *b) {
  hash_remove(p, b);
  uses_reset(b);
  b->state = PM__B_FREE;
  b->requested = 0;
  pm__block_t *prev = b->aprev, *next = b->anext;
  if (prev && prev->state == PM__B_FREE) {
    bin_remove(p, prev);
    prev->size += b->size;
    prev->anext = next;
    if (next) next->aprev = prev;
    block_put(p, b);
    b = prev;
  }
  if (next && next->state == PM__B_FREE) {
    bin_remove(p, next);
    b->size += next->size;
    b->anext = next->anext;
    if (b->anext) b->anext->aprev = b;
    block_put(p, next);
  }
  bin_insert(p, b);
}

/* Events of a block go back to the cache (capacity was reserved when they were counted). */
static void return_events_locked(pm_pool_t *p, pm__block_t *b) {
  for (int i = 0; i < b->nuses; i++) {
    if (b->uses[i].event) {
      p->events[p->nevents++] = b->uses[i].event;
      b->uses[i].event = NULL;
    }
  }
}

/* Poll every pending block independently, outside the lock. Returns true if any became free.
 * Called with the lock held; drops and retakes it. */
static bool poll_pending_locked(pm_pool_t *p) {
  if (!p->pending) return false;
  pm__block_t *list = p->pending;
  p->pending = NULL;
  p->releasers++;
  pthread_mutex_unlock(&p->lock);

  const pm__backend_t *be = p->b;
  pm__block_t *ready = NULL, *waiting = NULL, *broken = NULL;
  for (pm__block_t *b = list, *next; b; b = next) {
    next = b->lnext;
    int verdict = 1; /* 1 ready, 0 not yet, -1 broken */
    for (int i = 0; i < b->nuses && verdict == 1; i++) {
      pm__use_t *u = &b->uses[i];
      if (u->done) continue;
      pm_status_t st = be->event_query(u->event);
      if (st == PM_OK)
        u->done = true;
      else if (st == PM_NOT_READY)
        verdict = 0;
      else
        verdict = -1; /* the device can no longer tell: never hand this memory out again */
    }
    pm__block_t **to = verdict == 1 ? &ready : verdict == 0 ? &waiting : &broken;
    b->lnext = *to;
    *to = b;
  }

  pthread_mutex_lock(&p->lock);
  p->releasers--;
  bool any = ready != NULL;
  for (pm__block_t *b = ready, *next; b; b = next) {
    next = b->lnext;
    return_events_locked(p, b);
    p->pending_bytes -= b->size;
    make_free_locked(p, b);
  }
  for (pm__block_t *b = waiting, *next; b; b = next) {
    next = b->lnext;
    b->lprev = NULL;
    b->lnext = p->pending;
    if (p->pending) p->pending->lprev = b;
    p->pending = b;
  }
  for (pm__block_t *b = broken, *next; b; b = next) {
    next = b->lnext;
    b->lnext = b->lprev = NULL;
    b->state = PM__B_QUARANTINED;
    p->quarantined++;
  }
  wake_locked(p);
  return any;
}

static pm_status_t segment_release(pm_pool_t *p, pm__segment_t *s) {
  pm_status_t st = pm__registry_remove((uintptr_t)s->base, PM_MEMORY_POOL, NULL);
  pm_status_t st2;
  if (s->flags & PM_HOST_SHARED)
    st2 = pm__shared_unpin(p->b, s->base, s->size);
  else
    st2 = s->fast ? pm__fast_unpin(p->b, s->base, s->size) : p->b->host_free(s->base, s->size);
  return st2 != PM_OK ? st2 : st;
}

static void segment_unlink_locked(pm_pool_t *p, pm__segment_t *s) {
  if (s->prev)
    s->prev->next = s->next;
  else
    p->segments = s->next;
  if (s->next) s->next->prev = s->prev;
  s->prev = s->next = NULL;
}

/* Release every segment that is one free block. Returns the bytes given back. Called with the
 * lock held; drops it around the backend calls. The bytes stay charged until those returned.
 * *failed (may be NULL) gets the first failed release's status, its detail in pm_last_error. */
static size_t trim_locked(pm_pool_t *p, pm_status_t *failed) {
  pm__segment_t *list = NULL;
  for (pm__segment_t *s = p->segments, *next; s; s = next) {
    next = s->next;
    pm__block_t *f = s->first;
    if (f->state != PM__B_FREE || f->size != s->size) continue;
    bin_remove(p, f);
    segment_unlink_locked(p, s);
    p->nsegments--;
    s->next = list;
    list = s;
  }
  if (!list) return 0;
  p->releasers++;
  pthread_mutex_unlock(&p->lock);

  size_t released = 0;
  uint64_t count = 0;
  double t0 = pm__now();
  for (pm__segment_t *s = list, *next; s; s = next) {
    next = s->next;
    /* A failed unpin cannot be retried usefully (the backend already reported the memory as
     * gone or broken); the pool stops counting it either way so the budget does not wedge, and
     * pm_pool_trim reports it. */
    pm_status_t st = segment_release(p, s);
    if (st != PM_OK && failed && *failed == PM_OK) {
      *failed = pm__wrap_error(st, "releasing a %zu-byte segment at %p (the pool no longer "
                                   "counts it)",
                               s->size, (void *)s->base);
    }
    released += s->size;
    count++;
    free(s->first);
    free(s);
  }
  double dt = pm__now() - t0;

  pthread_mutex_lock(&p->lock);
  p->releasers--;
  p->backend_frees += count;
  p->backend_free_s += dt;
  unreserve_locked(p, released);
  return released;
}

/* ---- acquiring a block or budget ------------------------------------------------------------- */

typedef struct pm__acquire {
  const char *what;
  bool use_bins;
  unsigned group;
  size_t need;        /* class size, for the bins */
  size_t bytes;       /* what the caller asked for */
  size_t seg_pref;    /* preferred new segment */
  size_t seg_min;     /* smallest new segment that serves the request */
  pm__block_t *block; /* out: a cached block, now in use */
  size_t reserved;    /* out: bytes reserved for a new segment */
} pm__acquire_t;

static void carve_locked(pm_pool_t *p, pm__block_t *b, size_t need) {
  if (b->size - need < PM__GRAN) return;
  pm__block_t *r = block_get(p);
  if (!r) return; /* no memory for the struct: hand out the whole block */
  r->ptr = b->ptr + need;
  r->size = b->size - need;
  r->seg = b->seg;
  r->state = PM__B_FREE;
  r->aprev = b;
  r->anext = b->anext;
  if (r->anext) r->anext->aprev = r;
  b->anext = r;
  b->size = need;
  bin_insert(p, r);
}

static void mark_in_use_locked(pm_pool_t *p, pm__block_t *b, size_t bytes) {
  b->state = PM__B_IN_USE;
  b->requested = bytes;
  hash_insert(p, b);
  p->in_use += b->size;
  p->requested += bytes;
  p->in_use_blocks++;
  p->allocs++;
}

static pm_status_t exhausted(pm_pool_t *p, const pm__acquire_t *a, const char *why) {
  p->budget_failures++;
  return pm__set_error(PM_ERR_BUDGET,
                       "%s: pinned-memory budget exhausted%s: asked for %zu bytes (%zu to pin), "
                       "budget %zu, held %zu (in use %zu, cached %zu, pending %zu, registered "
                       "%zu; %zu blocks quarantined after stream errors)",
                       a->what, why, a->bytes, a->seg_min, p->budget, p->pinned, p->in_use,
                       p->cached, p->pending_bytes, p->registered, p->quarantined);
}

/* Serve `a` from the bins, or reserve budget for a new segment: poll pending blocks, trim the
 * cache, then follow the exhaust policy. Called with the lock held; may drop it. */
static pm_status_t acquire_locked(pm_pool_t *p, pm__acquire_t *a) {
  bool polled = false, trimmed = false, waited = false;
  double deadline = 0;
  for (;;) {
    if (a->use_bins) {
      pm__block_t *b = bin_find(&p->groups[a->group], a->need);
      if (b) {
        bin_remove(p, b);
        carve_locked(p, b, a->need);
        mark_in_use_locked(p, b, a->bytes);
        p->cache_hits++;
        a->block = b;
        return PM_OK;
      }
      /* A miss looks at finished frees before pinning anything new. */
      if (!polled && p->pending) {
        polled = true;
        poll_pending_locked(p);
        continue;
      }
    }
    size_t avail = p->pinned < p->budget ? p->budget - p->pinned : 0;
    if (a->seg_pref <= avail || a->seg_min <= avail) {
      a->reserved = a->seg_pref <= avail ? a->seg_pref : a->seg_min;
      reserve_locked(p, a->reserved);
      return PM_OK;
    }
    if (a->seg_min > p->budget) return exhausted(p, a, " (more than the whole budget)");
    if (!polled && p->pending) {
      polled = true;
      poll_pending_locked(p);
      continue;
    }
    if (!trimmed) {
      trimmed = true;
      if (trim_locked(p, NULL) > 0) continue;
    }
    if (p->releasers > 0) {
      /* Another thread holds detached blocks or segments that may free budget: let it finish. */
      wait_slice_locked(p, PM__WAIT_SLICE_S);
      continue;
    }
    if (p->policy != PM_EXHAUST_WAIT) return exhausted(p, a, "");
    double now = pm__now();
    if (!waited) {
      waited = true;
      p->budget_waits++;
      deadline = now + p->wait_timeout_s;
    }
    if (now >= deadline) {
      char why[96];
      snprintf(why, sizeof why, " (waited %.3f s for frees)", p->wait_timeout_s);
      return exhausted(p, a, why);
    }
    wait_slice_locked(p, PM__MIN(PM__WAIT_SLICE_S, deadline - now));
    polled = trimmed = false;
  }
}

/* ---- segments ------------------------------------------------------------------------------ */

static unsigned register_flags(unsigned host_flags) {
  unsigned r = PM_REGISTER_DEFAULT;
  if (host_flags & PM_HOST_MAPPED) r |= PM_REGISTER_MAPPED;
  if (host_flags & PM_HOST_PORTABLE) r |= PM_REGISTER_PORTABLE;
  return r;
}

/* Pin a new segment of `size` bytes (the budget is already reserved). No lock held. */
static pm_status_t segment_create(pm_pool_t *p, size_t size, unsigned flags,
                                  pm__segment_t **seg_out, double *seconds_out) {
  pm__segment_t *s = calloc(1, sizeof *s);
  pm__block_t *blk = calloc(1, sizeof *blk);
  if (!s || !blk) {
    free(s);
    free(blk);
    return pm__set_error(PM_ERR_NOMEM, "out of host memory for pool bookkeeping");
  }
  bool shared = (flags & PM_HOST_SHARED) != 0;
  bool fast = !shared && size >= p->fast_pin_min && !(flags & PM_HOST_WRITE_COMBINED);
  void *base = NULL;
  double t0 = pm__now();
  pm_status_t st =
      shared ? pm__shared_pin(p->b, size, register_flags(flags), p->pin_threads, &base)
      : fast ? pm__fast_pin(p->b, size, register_flags(flags), p->pin_threads, p->huge_pages, &base)
             : p->b->host_alloc(size, flags, &base);
  *seconds_out = pm__now() - t0;
  if (st != PM_OK) goto fail_structs;

  void *dev = NULL;
  if (flags & PM_HOST_MAPPED) {
    st = p->b->host_device_pointer(base, &dev);
    if (st != PM_OK) goto fail_memory;
  }
  pm__range_t r = {.base = (uintptr_t)base,
                   .size = size,
                   .kind = PM_MEMORY_POOL,
                   .flags = flags,
                   .owner = p,
                   .dev_base = dev};
  st = pm__registry_add(&r);
  if (st != PM_OK) goto fail_memory;

  s->base = base;
  s->size = size;
  s->flags = flags;
  s->fast = fast;
  s->dev_base = dev;
  s->first = blk;
  blk->ptr = base;
  blk->size = size;
  blk->seg = s;
  blk->state = PM__B_FREE;
  blk->uses = blk->inline_uses;
  blk->cap_uses = PM__INLINE_USES;
  *seg_out = s;
  return PM_OK;

fail_memory:
  if (shared)
    (void)pm__shared_unpin(p->b, base, size);
  else if (fast)
    (void)pm__fast_unpin(p->b, base, size);
  else
    (void)p->b->host_free(base, size);
fail_structs:
  free(s);
  free(blk);
  return st;
}

static void segment_install_locked(pm_pool_t *p, pm__segment_t *s, double seconds) {
  s->prev = NULL;
  s->next = p->segments;
  if (p->segments) p->segments->prev = s;
  p->segments = s;
  p->nsegments++;
  p->backend_allocs++;
  p->backend_alloc_s += seconds;
}

/* Reserve in `a`, then pin a new segment outside the lock and install it. On return the lock
 * is held. With a->use_bins the first a->need bytes are handed out (a->block); else the whole
 * segment is binned. */
static pm_status_t grow_locked(pm_pool_t *p, pm__acquire_t *a, unsigned flags) {
  size_t size = a->reserved;
  pthread_mutex_unlock(&p->lock);
  pm__segment_t *s = NULL;
  double secs = 0;
  pm_status_t st = segment_create(p, size, flags, &s, &secs);
  if (st != PM_OK && size > a->seg_min && (st == PM_ERR_MEMLOCK || st == PM_ERR_NOMEM)) {
    /* A small request asked for a shared 2 MiB segment; the system would not pin that much
     * (RLIMIT_MEMLOCK below the budget, or memory short). The request itself may still fit. */
    pthread_mutex_lock(&p->lock);
    unreserve_locked(p, size - a->seg_min);
    pthread_mutex_unlock(&p->lock);
    size = a->reserved = a->seg_min;
    st = segment_create(p, size, flags, &s, &secs);
  }
  pthread_mutex_lock(&p->lock);
  if (st != PM_OK) {
    unreserve_locked(p, size);
    return pm__wrap_error(st, "%s(%zu bytes): pinning a %zu-byte segment", a->what, a->bytes, size);
  }
  segment_install_locked(p, s, secs);
  if (a->use_bins) {
    carve_locked(p, s->first, a->need);
    mark_in_use_locked(p, s->first, a->bytes);
    a->block = s->first;
  } else {
    bin_insert(p, s->first);
  }
  return PM_OK;
}

/* ---- configuration, creation, destruction ---------------------------------------------------- */

void pm_pool_config_init(pm_pool_config_t *config) {
  if (!config) return;
  memset(config, 0, sizeof *config);
  config->budget = 0;
  config->exhaust_policy = -1;
  config->wait_timeout_s = -1;
  config->pin_threads = 0;
  config->fast_pin_min = 0;
  config->huge_pages = -1;
}

static pthread_mutex_t default_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic(pm_pool_t *) default_pool;

pm_status_t pm_pool_create(const pm_pool_config_t *config, pm_pool_t **pool_out) {
  if (!pool_out) return pm__set_error(PM_ERR_INVALID, "pm_pool_create: pool_out is NULL");
  PM__BACKEND_OR_RETURN(be);
  pm_pool_config_t c;
  if (config)
    c = *config;
  else
    pm_pool_config_init(&c);
  if (c.exhaust_policy < -1 || c.exhaust_policy > PM_EXHAUST_WAIT)
    return pm__set_error(PM_ERR_INVALID, "pm_pool_create: exhaust_policy %d is not -1, 0 or 1",
                         c.exhaust_policy);
  if (isnan(c.wait_timeout_s) || c.wait_timeout_s > 1e9)
    return pm__set_error(PM_ERR_INVALID,
                         "pm_pool_create: wait_timeout_s %g is not a number of seconds",
                         c.wait_timeout_s);
  if (c.pin_threads < 0 || c.pin_threads > 1024)
    return pm__set_error(PM_ERR_INVALID, "pm_pool_create: pin_threads %d is not in 0..1024",
                         c.pin_threads);
  if (c.huge_pages < -1 || c.huge_pages > 1)
    return pm__set_error(PM_ERR_INVALID, "pm_pool_create: huge_pages %d is not -1, 0 or 1",
                         c.huge_pages);

  size_t budget = c.budget ? c.budget : pm__opt_size(PM__OPT_BUDGET);
  bool budget_memlock = false;
  if (budget == 0) { /* auto */
    size_t ram = pm__physical_memory();
    budget = ram ? ram / 2 : (size_t)1 << 30;
    if (be->kind == PM_BACKEND_HOST && pm__memlock_limit() < budget) {
      budget = pm__memlock_limit();
      budget_memlock = true;
    }
  }
  int policy = c.exhaust_policy >= 0 ? c.exhaust_policy : (int)pm__opt_int(PM__OPT_BUDGET_POLICY);
  double timeout =
      c.wait_timeout_s >= 0 ? c.wait_timeout_s : pm__opt_double(PM__OPT_BUDGET_TIMEOUT);
  /* The option table's values are in range, auto resolved (pin_threads never 0). */
  long threads = c.pin_threads > 0 ? c.pin_threads : pm__opt_int(PM__OPT_PIN_THREADS);
  size_t fast_min = c.fast_pin_min ? c.fast_pin_min : pm__opt_size(PM__OPT_FAST_PIN_MIN);
  int huge = c.huge_pages >= 0 ? c.huge_pages : (int)pm__opt_int(PM__OPT_HUGE_PAGES);

  pm_pool_t *p = calloc(1, sizeof *p);
  if (!p) return pm__set_error(PM_ERR_NOMEM, "pm_pool_create: out of host memory");
  p->hash_bits = 8;
  p->hash = calloc((size_t)1 << p->hash_bits, sizeof *p->hash);
  if (!p->hash) {
    free(p);
    return pm__set_error(PM_ERR_NOMEM, "pm_pool_create: out of host memory");
  }
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&p->cv, &ca);
  pthread_condattr_destroy(&ca);
  pthread_mutex_init(&p->lock, NULL);
  p->b = be;
  p->budget = budget;
  p->budget_memlock = budget_memlock;
  p->policy = policy == PM_EXHAUST_WAIT ? PM_EXHAUST_WAIT : PM_EXHAUST_FAIL;
  p->wait_timeout_s = timeout;
  p->pin_threads = (int)threads;
  p->fast_pin_min = fast_min;
  p->huge_pages = huge != 0;
  pm_status_t st = pm__handle_add(p, PM__HANDLE_POOL);
  if (st != PM_OK) {
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->cv);
    free(p->hash);
    free(p);
    return pm__wrap_error(st, "pm_pool_create");
  }
  *pool_out = p;
  return PM_OK;
}

static pm_status_t pool_destroy(pm_pool_t *p) {
  pthread_mutex_lock(&p->lock);
  if (p->in_use_blocks || p->freeing || p->registered) {
    pm_status_t st = pm__set_error(PM_ERR_BUSY,
                                   "pm_pool_destroy: %zu blocks (%zu bytes) still allocated, %zu "
                                   "registered bytes charged to the pool",
                                   p->in_use_blocks + p->freeing, p->in_use, p->registered);
    pthread_mutex_unlock(&p->lock);
    return st;
  }
  while (p->releasers > 0) wait_slice_locked(p, PM__WAIT_SLICE_S);
  pm__block_t *pending = p->pending;
  p->pending = NULL;
  pthread_mutex_unlock(&p->lock);
  /* From here the handle is dead: a second destroy, or any call, gets PM_ERR_INVALID. */
  (void)pm__handle_remove(p, PM__HANDLE_POOL);

  /* No other thread may use the pool now (the caller's contract), so from here on the lock
   * is not needed. Freed blocks may still be read or written by queued device work: wait. */
  for (pm__block_t *b = pending; b; b = b->lnext)
    for (int i = 0; i < b->nuses; i++)
      if (!b->uses[i].done && b->uses[i].event) (void)p->b->event_synchronize(b->uses[i].event);

  for (pm__segment_t *s = p->segments, *sn; s; s = sn) {
    sn = s->next;
    (void)segment_release(p, s);
    for (pm__block_t *b = s->first, *bn; b; b = bn) {
      bn = b->anext;
      for (int i = 0; i < b->nuses; i++)
        if (b->uses[i].event) (void)p->b->event_destroy(b->uses[i].event);
      uses_reset(b);
      free(b);
    }
    free(s);
  }
  for (size_t i = 0; i < p->nevents; i++) (void)p->b->event_destroy(p->events[i]);
  free(p->events);
  for (pm__block_t *b = p->spare, *n; b; b = n) {
    n = b->lnext;
    free(b);
  }
  free(p->hash);
  pthread_cond_destroy(&p->cv);
  pthread_mutex_destroy(&p->lock);
  free(p);
  return PM_OK;
}

pm_status_t pm_pool_destroy(pm_pool_t *pool) {
  if (pm__handle_foreign(pool, PM__HANDLE_POOL)) {
    /* A pool of the parent, in a forked child: its memory is not pinned here and its events
     * belong to streams that do not exist; it is forgotten, and its memory left as it is. */
    (void)pm__handle_remove(pool, PM__HANDLE_POOL);
    return PM_OK;
  }
  pm_status_t st = pm__handle_check(pool, PM__HANDLE_POOL, "pm_pool_destroy");
  if (st != PM_OK) return st;
  if (pool == atomic_load_explicit(&default_pool, memory_order_acquire))
    return pm__set_error(PM_ERR_INVALID,
                         "pm_pool_destroy: the default pool is released by pm_finalize");
  return pool_destroy(pool);
}

pm_status_t pm_pool_default(pm_pool_t **pool_out) {
  if (!pool_out) return pm__set_error(PM_ERR_INVALID, "pm_pool_default: pool_out is NULL");
  pm_pool_t *p = atomic_load_explicit(&default_pool, memory_order_acquire);
  if (!p) {
    pthread_mutex_lock(&default_lock);
    p = atomic_load_explicit(&default_pool, memory_order_relaxed);
    if (!p) {
      pm_status_t st = pm_pool_create(NULL, &p);
      if (st != PM_OK) {
        pthread_mutex_unlock(&default_lock);
        return pm__wrap_error(st, "creating the default pool");
      }
      atomic_store_explicit(&default_pool, p, memory_order_release);
    }
    pthread_mutex_unlock(&default_lock);
  }
  *pool_out = p;
  return PM_OK;
}

pm_status_t pm__pool_default_destroy(void) {
  pthread_mutex_lock(&default_lock);
  pm_status_t st = PM_OK;
  pm_pool_t *p = atomic_load_explicit(&default_pool, memory_order_relaxed);
  if (p) {
    st = pool_destroy(p);
    if (st == PM_OK) atomic_store_explicit(&default_pool, NULL, memory_order_release);
  }
  pthread_mutex_unlock(&default_lock);
  return st;
}

static pm_status_t resolve_pool(pm_pool_t **pool, const char *what) {
  if (*pool) return pm__handle_check(*pool, PM__HANDLE_POOL, what);
  pm_status_t st = pm_pool_default(pool);
  return st == PM_OK ? st : pm__wrap_error(st, "%s", what);
}

/* ---- allocation and free ----------------------------------------------------------------- */

pm_status_t pm_host_alloc(pm_pool_t *pool, size_t bytes, unsigned flags, void **ptr_out) {
  if (!ptr_out) return pm__set_error(PM_ERR_INVALID, "pm_host_alloc: ptr_out is NULL");
  if (flags & ~(unsigned)PM__HOST_FLAGS)
    return pm__set_error(PM_ERR_INVALID, "pm_host_alloc: unknown flag bits 0x%x",
                         flags & ~(unsigned)PM__HOST_FLAGS);
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "pm_host_alloc: bytes is 0");
  pm_status_t st = pm__shared_check_flags("pm_host_alloc", flags);
  if (st != PM_OK) return st;
  st = resolve_pool(&pool, "pm_host_alloc");
  if (st != PM_OK) return st;
  size_t need = pm__size_class(bytes);
  size_t page = pm__page_size();
  if (need == 0 || need > SIZE_MAX - page)
    return pm__set_error(PM_ERR_INVALID, "pm_host_alloc: %zu bytes is too large", bytes);

  pm_pool_t *p = pool;
  pm__acquire_t a = {.what = "pm_host_alloc",
                     .use_bins = true,
                     .group = flags,
                     .need = need,
                     .bytes = bytes,
                     .seg_min = pm__align_up(need, page)};
  a.seg_pref = need < PM__SMALL_LIMIT ? PM__MAX(PM__SMALL_SEGMENT, a.seg_min) : a.seg_min;

  pthread_mutex_lock(&p->lock);
  if (bytes > p->budget) {
    size_t budget = p->budget;
    bool memlock = p->budget_memlock;
    pthread_mutex_unlock(&p->lock);
    return pm__set_error(PM_ERR_BUDGET,
                         "pm_host_alloc: %zu bytes is more than the pool's budget of %zu bytes%s",
                         bytes, budget,
                         memlock ? " (the automatic budget is capped by RLIMIT_MEMLOCK: raise it "
                                   "with `ulimit -l`, or set PINMEM_BUDGET within it)"
                                 : "");
  }
  st = acquire_locked(p, &a);
  if (st == PM_OK && !a.block) st = grow_locked(p, &a, flags);
  void *ptr = st == PM_OK ? a.block->ptr : NULL;
  pthread_mutex_unlock(&p->lock);
  if (st != PM_OK) return st;
  *ptr_out = ptr;
  return PM_OK;
}

pm_status_t pm__pool_free(pm_pool_t *p, void *ptr) {
  if (!p || !ptr) return pm__set_error(PM_ERR_INVALID, "pm_host_free: NULL pool or pointer");
  const pm__backend_t *be = p->b;
  pthread_mutex_lock(&p->lock);
  bool exact = false;
  pm__block_t *b = locate_locked(p, ptr, &exact);
  pm_status_t st = PM_OK;
  if (!b)
    st = pm__set_error(PM_ERR_NOT_FOUND, "pm_host_free(%p): not in any segment of pool %p", ptr,
                       (void *)p);
  else if (b->state != PM__B_IN_USE)
    st = pm__set_error(
        PM_ERR_DOUBLE_FREE, "pm_host_free(%p): %s", ptr,
        exact ? "block already freed" : "inside a free block of the pool (already freed?)");
  else if (!exact)
    st = pm__set_error(PM_ERR_INVALID,
                       "pm_host_free(%p): not the start of a block (the block holding it starts "
                       "at %p, %zu bytes)",
                       ptr, (void *)b->ptr, b->size);
  if (st != PM_OK) {
    pthread_mutex_unlock(&p->lock);
    return st;
  }

  p->in_use -= b->size;
  p->requested -= b->requested;
  p->in_use_blocks--;
  p->frees++;
  if (b->nuses == 0) {
    make_free_locked(p, b);
    wake_locked(p);
    pthread_mutex_unlock(&p->lock);
    return PM_OK;
  }

  /* Stream-ordered: one event per stream that used the block, recorded outside the lock. Take
   * cached events now; reserve cache room for the ones we may create, so returning them later
   * never allocates under the lock. */
  b->state = PM__B_PENDING;
  p->pending_bytes += b->size;
  p->freeing++;
  int n = b->nuses;
  size_t fresh = 0;
  for (int i = 0; i < n; i++) {
    b->uses[i].done = false;
    b->uses[i].event = p->nevents ? p->events[--p->nevents] : NULL;
    if (!b->uses[i].event) fresh++;
  }
  bool may_create = true;
  if (fresh && p->events_total + fresh > p->cap_events) {
    size_t cap = PM__MAX(p->cap_events * 2, p->events_total + fresh + 16);
    pm_event_t *ne = realloc(p->events, cap * sizeof *ne);
    if (ne) {
      p->events = ne;
      p->cap_events = cap;
    } else {
      may_create = false; /* no room to keep new events: synchronize those streams instead */
    }
  }
  if (may_create) p->events_total += fresh;
  pthread_mutex_unlock(&p->lock);

  size_t not_created = 0;
  int recorded = 0;
  bool broken = false;
  pm_stream_t bad_stream = NULL;
  for (int i = 0; i < n; i++) {
    pm__use_t *u = &b->uses[i];
    if (!u->event && may_create) {
      pm_event_t ev = NULL;
      if (be->event_create(PM_EVENT_DEFAULT, &ev) == PM_OK)
        u->event = ev;
      else
        not_created++;
    }
    if (u->event && be->event_record(u->event, u->stream) == PM_OK) {
      recorded++;
      continue;
    }
    /* No event to order reuse on that stream (bad stream, or no resources): wait for the stream
     * instead; if even that fails, nothing tells when the memory is safe again. */
    u->done = true;
    if (be->stream_synchronize(u->stream) != PM_OK) {
      broken = true;
      bad_stream = u->stream;
    }
  }

  pthread_mutex_lock(&p->lock);
  p->freeing--;
  p->events_total -= not_created;
  if (broken) {
    b->state = PM__B_QUARANTINED;
    p->quarantined++;
    st = pm__set_error(PM_ERR_BACKEND,
                       "pm_host_free(%p): could neither record an event on stream %p nor "
                       "synchronize it; the block is freed but kept out of use until the pool "
                       "is destroyed",
                       ptr, (void *)bad_stream);
  } else if (recorded == 0) {
    return_events_locked(p, b);
    p->pending_bytes -= b->size;
    make_free_locked(p, b);
  } else {
    b->lprev = NULL;
    b->lnext = p->pending;
    if (p->pending) p->pending->lprev = b;
    p->pending = b;
  }
  wake_locked(p);
  pthread_mutex_unlock(&p->lock);
  return st;
}

pm_status_t pm__pool_record_stream(pm_pool_t *p, void *ptr, pm_stream_t stream) {
  if (!p || !ptr)
    return pm__set_error(PM_ERR_INVALID, "pm_host_record_stream: NULL pool or pointer");
  pthread_mutex_lock(&p->lock);
  bool exact = false;
  pm__block_t *b = locate_locked(p, ptr, &exact);
  pm_status_t st = PM_OK;
  if (!b)
    st = pm__set_error(PM_ERR_NOT_FOUND, "pm_host_record_stream(%p): not in pool %p", ptr,
                       (void *)p);
  else if (b->state != PM__B_IN_USE)
    st = pm__set_error(PM_ERR_INVALID, "pm_host_record_stream(%p): the block was freed", ptr);
  if (st == PM_OK) {
    for (int i = 0; i < b->nuses; i++)
      if (b->uses[i].stream == stream) goto out;
    if (b->nuses == b->cap_uses) {
      int cap = b->cap_uses * 2;
      pm__use_t *nu = malloc((size_t)cap * sizeof *nu);
      if (!nu) {
        st = pm__set_error(PM_ERR_NOMEM, "pm_host_record_stream: out of host memory");
        goto out;
      }
      memcpy(nu, b->uses, (size_t)b->nuses * sizeof *nu);
      if (b->uses != b->inline_uses) free(b->uses);
      b->uses = nu;
      b->cap_uses = cap;
    }
    b->uses[b->nuses++] = (pm__use_t){.stream = stream, .event = NULL, .done = false};
  }
out:
  pthread_mutex_unlock(&p->lock);
  return st;
}

pm_status_t pm__pool_usable_size(pm_pool_t *p, const void *ptr, size_t *bytes_out) {
  if (!p || !ptr || !bytes_out)
    return pm__set_error(PM_ERR_INVALID, "pm_host_usable_size: NULL argument");
  pthread_mutex_lock(&p->lock);
  bool exact = false;
  pm__block_t *b = locate_locked(p, ptr, &exact);
  pm_status_t st = PM_OK;
  size_t size = 0;
  if (!b)
    st = pm__set_error(PM_ERR_NOT_FOUND, "pm_host_usable_size(%p): not in pool %p", ptr, (void *)p);
  else if (b->state != PM__B_IN_USE)
    st = pm__set_error(PM_ERR_INVALID, "pm_host_usable_size(%p): the block was freed", ptr);
  else if (!exact)
    st = pm__set_error(PM_ERR_INVALID,
                       "pm_host_usable_size(%p): not the start of a block (it starts at %p)", ptr,
                       (void *)b->ptr);
  else
    size = b->size;
  pthread_mutex_unlock(&p->lock);
  if (st == PM_OK) *bytes_out = size;
  return st;
}

pm_status_t pm__pool_block_info(pm_pool_t *p, const void *ptr, pm_pointer_info_t *info) {
  if (!p || !info) return pm__set_error(PM_ERR_INVALID, "pm__pool_block_info: NULL argument");
  pthread_mutex_lock(&p->lock);
  bool exact = false;
  pm__block_t *b = locate_locked(p, ptr, &exact);
  if (!b) {
    pthread_mutex_unlock(&p->lock);
    return pm__set_error(PM_ERR_NOT_FOUND, "%p is not in pool %p", ptr, (void *)p);
  }
  pm_pointer_info_t r;
  memset(&r, 0, sizeof r);
  r.kind = PM_MEMORY_POOL;
  r.base = b->ptr;
  r.size = b->size;
  r.flags = b->seg->flags;
  r.device_ptr =
      b->seg->dev_base ? (char *)b->seg->dev_base + ((const char *)ptr - b->seg->base) : NULL;
  r.pool = p;
  r.in_use = b->state == PM__B_IN_USE;
  pthread_mutex_unlock(&p->lock);
  *info = r;
  return PM_OK;
}

/* ---- cache control, budget, stats ----------------------------------------------------------- */

pm_status_t pm_pool_trim(pm_pool_t *pool, size_t *released_bytes_out) {
  pm_status_t st = resolve_pool(&pool, "pm_pool_trim");
  if (st != PM_OK) return st;
  pthread_mutex_lock(&pool->lock);
  poll_pending_locked(pool);
  pm_status_t failed = PM_OK;
  size_t released = trim_locked(pool, &failed);
  pthread_mutex_unlock(&pool->lock);
  if (released_bytes_out) *released_bytes_out = released;
  return failed == PM_OK ? PM_OK : pm__wrap_error(failed, "pm_pool_trim");
}

pm_status_t pm_pool_reserve(pm_pool_t *pool, size_t bytes, unsigned flags) {
  if (flags & ~(unsigned)PM__HOST_FLAGS)
    return pm__set_error(PM_ERR_INVALID, "pm_pool_reserve: unknown flag bits 0x%x",
                         flags & ~(unsigned)PM__HOST_FLAGS);
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "pm_pool_reserve: bytes is 0");
  pm_status_t st = pm__shared_check_flags("pm_pool_reserve", flags);
  if (st != PM_OK) return st;
  st = resolve_pool(&pool, "pm_pool_reserve");
  if (st != PM_OK) return st;
  size_t need = pm__size_class(bytes);
  size_t page = pm__page_size();
  if (need == 0 || need > SIZE_MAX - page)
    return pm__set_error(PM_ERR_INVALID, "pm_pool_reserve: %zu bytes is too large", bytes);
  pm__acquire_t a = {.what = "pm_pool_reserve",
                     .use_bins = false,
                     .group = flags,
                     .need = need,
                     .bytes = bytes,
                     .seg_pref = pm__align_up(need, page),
                     .seg_min = pm__align_up(need, page)};
  pthread_mutex_lock(&pool->lock);
  st = acquire_locked(pool, &a);
  if (st == PM_OK) st = grow_locked(pool, &a, flags);
  pthread_mutex_unlock(&pool->lock);
  return st;
}

pm_status_t pm_pool_set_budget(pm_pool_t *pool, size_t budget) {
  if (budget == 0) return pm__set_error(PM_ERR_INVALID, "pm_pool_set_budget: budget is 0");
  pm_status_t st = resolve_pool(&pool, "pm_pool_set_budget");
  if (st != PM_OK) return st;
  pm_pool_t *p = pool;
  pthread_mutex_lock(&p->lock);
  if (p->pinned > budget) {
    poll_pending_locked(p);
    trim_locked(p, NULL);
  }
  if (p->pinned > budget) {
    st = pm__set_error(PM_ERR_BUSY,
                       "pm_pool_set_budget(%zu): %zu bytes still held after trimming (in use "
                       "%zu, cached %zu, pending %zu, registered %zu); budget left at %zu",
                       budget, p->pinned, p->in_use, p->cached, p->pending_bytes, p->registered,
                       p->budget);
  } else {
    p->budget = budget;
    p->budget_memlock = false;
    wake_locked(p);
  }
  pthread_mutex_unlock(&p->lock);
  return st;
}

pm_status_t pm_pool_get_stats(pm_pool_t *pool, pm_pool_stats_t *stats_out) {
  if (!stats_out) return pm__set_error(PM_ERR_INVALID, "pm_pool_get_stats: stats_out is NULL");
  pm_status_t st = resolve_pool(&pool, "pm_pool_get_stats");
  if (st != PM_OK) return st;
  pm_pool_t *p = pool;
  pm_pool_stats_t s;
  memset(&s, 0, sizeof s);
  pthread_mutex_lock(&p->lock);
  poll_pending_locked(p);
  s.budget = p->budget;
  s.pinned_bytes = p->pinned;
  s.pinned_peak = p->peak;
  s.in_use_bytes = p->in_use;
  s.requested_bytes = p->requested;
  s.cached_bytes = p->cached;
  s.pending_bytes = p->pending_bytes;
  s.registered_bytes = p->registered;
  s.segments = p->nsegments;
  s.allocs = p->allocs;
  s.frees = p->frees;
  s.cache_hits = p->cache_hits;
  s.backend_allocs = p->backend_allocs;
  s.backend_frees = p->backend_frees;
  s.budget_waits = p->budget_waits;
  s.budget_failures = p->budget_failures;
  s.backend_alloc_seconds = p->backend_alloc_s;
  s.backend_free_seconds = p->backend_free_s;
  pthread_mutex_unlock(&p->lock);
  *stats_out = s;
  return PM_OK;
}

pm_status_t pm_pool_reset_peak(pm_pool_t *pool) {
  pm_status_t st = resolve_pool(&pool, "pm_pool_reset_peak");
  if (st != PM_OK) return st;
  pthread_mutex_lock(&pool->lock);
  pool->peak = pool->pinned;
  pthread_mutex_unlock(&pool->lock);
  return PM_OK;
}

pm_status_t pm__pool_charge(pm_pool_t *pool, size_t bytes) {
  if (!pool) return pm__set_error(PM_ERR_INVALID, "pm__pool_charge: pool is NULL");
  if (bytes == 0) return PM_OK;
  pm__acquire_t a = {.what = "pm_register",
                     .use_bins = false,
                     .bytes = bytes,
                     .seg_pref = bytes,
                     .seg_min = bytes};
  pthread_mutex_lock(&pool->lock);
  pm_status_t st = acquire_locked(pool, &a);
  if (st == PM_OK) pool->registered += bytes;
  pthread_mutex_unlock(&pool->lock);
  return st;
}

void pm__pool_uncharge(pm_pool_t *pool, size_t bytes) {
  if (!pool || bytes == 0) return;
  pthread_mutex_lock(&pool->lock);
  size_t b = PM__MIN(bytes, pool->registered);
  pool->registered -= b;
  unreserve_locked(pool, b);
  pthread_mutex_unlock(&pool->lock);
}

/* fork.c: the parent's default pool holds memory that is not pinned in the child and events of
 * the parent's streams; the child leaves it behind (foreign, like every pool of the parent) and
 * makes its own on first use. */
static pm_pool_t *parent_default_pool; /* kept so leak checkers see it is still reachable */

void pm__pool_atfork(pm__fork_phase_t phase) {
  if (phase == PM__FORK_PREPARE) {
    pthread_mutex_lock(&default_lock);
  } else if (phase == PM__FORK_PARENT) {
    pthread_mutex_unlock(&default_lock);
  } else {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    default_lock = fresh;
    parent_default_pool = atomic_load_explicit(&default_pool, memory_order_relaxed);
    atomic_store_explicit(&default_pool, NULL, memory_order_relaxed);
  }
}
