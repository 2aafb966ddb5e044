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
 * - NUMA (numa_place.c decides the node from option numa and the calling thread's current
 *   device, before the pool lock): a new segment for node n >= 0 is bound to prefer n before
 *   its first touch (pin.c, shared.c), or pinned by the backend's allocator with the thread
 *   preferring n around the call. It remembers n, and its blocks live in node n's own bin sets
 *   (made on the node's first request), so a block pinned for one node never serves another.
 *   A failed binding pins with the default policy; the segment keeps n (a request for n is
 *   served as well by it as by a new one) and counts as a bind failure and unbound bytes.
 *   Trim and the budget are pool-wide.
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
 *
 * Files: pool.c (this one: creating segments, the pool's life, allocation and the public cache,
 * budget and stats calls), pool_block.c (size classes, bins, the block map, coalescing),
 * pool_stream.c (stream-ordered frees, pending polls, quarantine), pool_budget.c (acquiring
 * budget, waiting, trimming, registrations' charge); pool_internal.h holds their types. Calls
 * go pool.c -> pool_budget.c -> pool_stream.c -> pool_block.c, never back.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pool_internal.h"

/* ---- segments ------------------------------------------------------------------------------ */

/* Every segment is PORTABLE, whatever the caller asked: pinned for every device's context, so
 * a block allocated while device 0 was current is still one DMA for a copy on device 1 (without
 * it CUDA treats the block as pageable there). Free under CUDA: the flag only widens where
 * the pages count as pinned. */
static unsigned register_flags(unsigned host_flags) {
  unsigned r = PM_REGISTER_PORTABLE;
  if (host_flags & PM_HOST_MAPPED) r |= PM_REGISTER_MAPPED;
  return r;
}

/* Pin a new segment of `size` bytes (the budget is already reserved). No lock held. */
static pm_status_t segment_create(pm_pool_t *p, size_t size, unsigned flags, int node,
                                  pm__segment_t **seg_out, double *seconds_out) {
  pm__segment_t *s = calloc(1, sizeof *s);
  pm__block_t *blk = calloc(1, sizeof *blk);
  if (!s || !blk) {
    free(s);
    free(blk);
    return pm__set_error(PM_ERR_NOMEM, "out of host memory for pool bookkeeping");
  }
  bool shared = (flags & PM_HOST_SHARED) != 0;
  bool fast = !shared && size >= p->fast_pin_min && !(flags & PM_HOST_WRITE_COMBINED) &&
              !atomic_load_explicit(&p->register_refused, memory_order_relaxed);
  void *base = NULL;
  bool bound = false;
  double t0 = pm__now();
  pm_status_t st = PM_OK;
  if (shared) {
    st = pm__shared_pin_node(p->b, size, register_flags(flags), p->pin_threads, node, &bound,
                             &base);
  } else if (fast) {
    st = pm__fast_pin_node(p->b, size, register_flags(flags), p->pin_threads, p->huge_pages, node,
                           &bound, &base);
    if (st == PM_ERR_UNSUPPORTED) {
      /* The driver pins no memory it did not allocate here (cuMemHostRegister unsupported), yet
       * its allocator pins: that serves this segment and the pool's later ones, instead of
       * failing every request from fast_pin_min up. */
      atomic_store_explicit(&p->register_refused, true, memory_order_relaxed);
      fast = false;
    }
  }
  if (!shared && !fast) {
    /* The backend's allocator touches the pages inside the call (cudaHostAlloc): the calling
     * thread's policy decides where they go, so it prefers the node for the call's length. */
    pm__numa_policy_t saved;
    bound = node >= 0 && pm__numa_prefer_begin(node, &saved);
    st = p->b->host_alloc(size, flags | PM_HOST_PORTABLE, &base);
    if (bound) pm__numa_prefer_end(&saved);
  }
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
  s->node = node;
  s->bound = node >= 0 && bound;
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
  /* The node's bin set exists (node_groups_locked ran before the reservation) and lives as long
   * as the pool. */
  s->group = pm__pool_group(p, s->node, s->flags);
  if (s->node >= 0 && !s->bound) {
    p->numa_bind_failures++;
    p->node_bind_failures[s->node]++;
  }
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
  pm_status_t st = segment_create(p, size, flags, a->node, &s, &secs);
  if (st != PM_OK && size > a->seg_min && (st == PM_ERR_MEMLOCK || st == PM_ERR_NOMEM)) {
    /* A small request asked for a shared 2 MiB segment; the system would not pin that much
     * (RLIMIT_MEMLOCK below the budget, or memory short). The request itself may still fit. */
    pthread_mutex_lock(&p->lock);
    unreserve_locked(p, size - a->seg_min);
    pthread_mutex_unlock(&p->lock);
    size = a->reserved = a->seg_min;
    st = segment_create(p, size, flags, a->node, &s, &secs);
  }
  pthread_mutex_lock(&p->lock);
  if (st != PM_OK) {
    unreserve_locked(p, size);
    return pm__wrap_error(st, "%s(%zu bytes): pinning a %zu-byte segment", a->what, a->bytes, size);
  }
  segment_install_locked(p, s, secs);
  if (a->use_bins) {
    pm__pool_carve_locked(p, s->first, a->need);
    pm__pool_mark_in_use_locked(p, s->first, a->bytes);
    a->block = s->first;
  } else {
    pm__pool_bin_insert(p, s->first);
  }
  return PM_OK;
}

/* The bin sets of `node` exist (made on its first request), so its segments can be binned. */
static pm_status_t node_groups_locked(pm_pool_t *p, int node, const char *what) {
  if (node < 0 || p->node_groups[node]) return PM_OK;
  p->node_groups[node] = calloc(PM__NGROUPS, sizeof *p->node_groups[node]);
  if (!p->node_groups[node])
    return pm__set_error(PM_ERR_NOMEM, "%s: out of host memory for node %d's bins", what, node);
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
                         "pm_pool_create: wait_timeout_s %g is not seconds from 0 to 1e9 (below "
                         "0: option budget_timeout)",
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
  while (p->releasers > 0) pm__pool_wait_slice_locked(p, PM__WAIT_SLICE_S);
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

  /* Quarantined blocks go back only once every device has passed all its queued work; when
   * that cannot be known, their segments stay pinned and mapped (leaked on purpose, never
   * reused) and only leave the registry. */
  bool keep_quarantined = p->quarantined && !pm__pool_devices_idle(p);
  for (pm__segment_t *s = p->segments, *sn; s; s = sn) {
    sn = s->next;
    if (keep_quarantined && pm__pool_segment_quarantined(s))
      (void)pm__registry_remove((uintptr_t)s->base, PM_MEMORY_POOL, NULL);
    else
      (void)pm__pool_segment_release(p, s);
    for (pm__block_t *b = s->first, *bn; b; b = bn) {
      bn = b->anext;
      for (int i = 0; i < b->nuses; i++)
        if (b->uses[i].event) (void)p->b->event_destroy(b->uses[i].event);
      pm__pool_uses_reset(b);
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
  for (int n = 0; n < PM__NUMA_MAX_NODES; n++) free(p->node_groups[n]);
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
  flags |= PM_HOST_PORTABLE; /* every block is: one flag group, not two of the same memory */
  st = resolve_pool(&pool, "pm_host_alloc");
  if (st != PM_OK) return st;
  size_t need = pm__size_class(bytes);
  size_t page = pm__page_size();
  if (need == 0 || need > SIZE_MAX - page)
    return pm__set_error(PM_ERR_INVALID, "pm_host_alloc: %zu bytes is too large", bytes);

  pm_pool_t *p = pool;
  /* Decided before the lock: it may read the topology or ask the backend for the device. */
  int node = pm__numa_node_current(p->b);
  pm__acquire_t a = {.what = "pm_host_alloc",
                     .use_bins = true,
                     .group = flags,
                     .node = node,
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
  st = node_groups_locked(p, node, "pm_host_alloc");
  if (st == PM_OK) st = pm__pool_acquire_locked(p, &a);
  if (st == PM_OK && !a.block) st = grow_locked(p, &a, flags);
  void *ptr = st == PM_OK ? a.block->ptr : NULL;
  pthread_mutex_unlock(&p->lock);
  if (st != PM_OK) return st;
  *ptr_out = ptr;
  return PM_OK;
}

/* ---- cache control, budget, stats ----------------------------------------------------------- */

pm_status_t pm_pool_trim(pm_pool_t *pool, size_t *released_bytes_out) {
  pm_status_t st = resolve_pool(&pool, "pm_pool_trim");
  if (st != PM_OK) return st;
  pthread_mutex_lock(&pool->lock);
  pm__pool_poll_pending_locked(pool);
  pm_status_t failed = PM_OK;
  size_t released = pm__pool_trim_locked(pool, &failed);
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
  /* As pm_host_alloc: a reservation made with or without PORTABLE serves both. */
  flags |= PM_HOST_PORTABLE;
  st = resolve_pool(&pool, "pm_pool_reserve");
  if (st != PM_OK) return st;
  size_t need = pm__size_class(bytes);
  size_t page = pm__page_size();
  if (need == 0 || need > SIZE_MAX - page)
    return pm__set_error(PM_ERR_INVALID, "pm_pool_reserve: %zu bytes is too large", bytes);
  int node = pm__numa_node_current(pool->b);
  pm__acquire_t a = {.what = "pm_pool_reserve",
                     .use_bins = false,
                     .group = flags,
                     .node = node,
                     .need = need,
                     .bytes = bytes,
                     .seg_pref = pm__align_up(need, page),
                     .seg_min = pm__align_up(need, page)};
  pthread_mutex_lock(&pool->lock);
  st = node_groups_locked(pool, node, "pm_pool_reserve");
  if (st == PM_OK) st = pm__pool_acquire_locked(pool, &a);
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
    pm__pool_poll_pending_locked(p);
    pm__pool_trim_locked(p, NULL);
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
  pm__pool_poll_pending_locked(p);
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
  s.quarantined_blocks = p->quarantined;
  s.quarantined_bytes = p->quarantined_bytes;
  s.numa_bind_failures = p->numa_bind_failures;
  pthread_mutex_unlock(&p->lock);
  *stats_out = s;
  return PM_OK;
}

pm_status_t pm_pool_numa_stats(pm_pool_t *pool, pm_pool_node_stats_t *out, int max,
                               int *count_out) {
  if (!count_out || max < 0 || (max > 0 && !out))
    return pm__set_error(PM_ERR_INVALID,
                         "pm_pool_numa_stats: count_out is required, and out with max > 0 "
                         "(max %d)",
                         max);
  pm_status_t st = resolve_pool(&pool, "pm_pool_numa_stats");
  if (st != PM_OK) return st;
  /* Index 0 is node -1 (no placement), index n + 1 node n. Walking the segments here keeps the
   * allocation path free of per-node counting; stats are not a hot call. */
  pm_pool_node_stats_t *all = calloc(PM__NUMA_MAX_NODES + 1, sizeof *all);
  if (!all) return pm__set_error(PM_ERR_NOMEM, "pm_pool_numa_stats: out of host memory");
  pm_pool_t *p = pool;
  pthread_mutex_lock(&p->lock);
  pm__pool_poll_pending_locked(p);
  for (pm__segment_t *s = p->segments; s; s = s->next) {
    pm_pool_node_stats_t *n = &all[s->node + 1];
    n->pinned_bytes += s->size;
    if (s->node >= 0 && !s->bound) n->unbound_bytes += s->size;
    n->segments++;
    for (pm__block_t *b = s->first; b; b = b->anext) {
      if (b->state == PM__B_FREE) {
        n->cached_bytes += b->size;
      } else if (b->state == PM__B_IN_USE) {
        n->in_use_bytes += b->size;
        n->blocks++;
      }
    }
  }
  bool used[PM__NUMA_MAX_NODES + 1] = {true};
  for (int i = 0; i < PM__NUMA_MAX_NODES; i++) {
    all[i + 1].bind_failures = p->node_bind_failures[i];
    used[i + 1] = p->node_groups[i] != NULL;
  }
  pthread_mutex_unlock(&p->lock);
  int count = 0;
  for (int i = 0; i <= PM__NUMA_MAX_NODES; i++) {
    pm_pool_node_stats_t *n = &all[i];
    n->node = i - 1;
    /* Node -1 always; another node once the pool pinned or tried to pin for it. */
    if (!used[i] && !n->segments && !n->bind_failures) continue;
    if (count < max) out[count] = *n;
    count++;
  }
  free(all);
  *count_out = count;
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
