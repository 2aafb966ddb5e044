/*
 * DESIGN: the pool's budget (see pool.c for the whole pool). pm__pool_acquire_locked serves a
 * request from the bins or reserves budget for a new segment; when the budget is short it polls
 * pending frees, trims the cache (pm__pool_trim_locked: every segment that is one free block is
 * unpinned, outside the lock, its bytes still charged until the unpin returned), waits for
 * threads that hold detached blocks or segments, and then fails or waits by the exhaust policy.
 * Registrations charge the same budget (pm__pool_charge / pm__pool_uncharge). Invariant:
 * pinned <= budget at every moment, bytes reserved before the backend call that pins them.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "pool_internal.h"

/* ---- waiting and trimming ------------------------------------------------------------------- */

void pm__pool_wait_slice_locked(pm_pool_t *p, double seconds) {
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

/* Release every segment that is one free block. Returns the bytes given back. Called with the
 * lock held; drops it around the backend calls. The bytes stay charged until those returned.
 * *failed (may be NULL) gets the first failed release's status, its detail in pm_last_error. */
size_t pm__pool_trim_locked(pm_pool_t *p, pm_status_t *failed) {
  pm__segment_t *list = NULL;
  for (pm__segment_t *s = p->segments, *next; s; s = next) {
    next = s->next;
    pm__block_t *f = s->first;
    if (f->state != PM__B_FREE || f->size != s->size) continue;
    pm__pool_bin_remove(p, f);
    pm__pool_segment_unlink_locked(p, s);
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
    pm_status_t st = pm__pool_segment_release(p, s);
    if (st != PM_OK && failed && *failed == PM_OK) {
      *failed = pm__wrap_error(st,
                               "releasing a %zu-byte segment at %p (the pool no longer "
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
pm_status_t pm__pool_acquire_locked(pm_pool_t *p, pm__acquire_t *a) {
  bool polled = false, trimmed = false, waited = false;
  double deadline = 0;
  for (;;) {
    if (a->use_bins) {
      pm__group_t *g = pm__pool_group(p, a->node, a->group);
      pm__block_t *b = g ? pm__pool_bin_find(g, a->need) : NULL;
      if (b) {
        pm__pool_bin_remove(p, b);
        pm__pool_carve_locked(p, b, a->need);
        pm__pool_mark_in_use_locked(p, b, a->bytes);
        p->cache_hits++;
        a->block = b;
        return PM_OK;
      }
      /* A miss looks at finished frees before pinning anything new. */
      if (!polled && p->pending) {
        polled = true;
        pm__pool_poll_pending_locked(p);
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
      pm__pool_poll_pending_locked(p);
      continue;
    }
    if (!trimmed) {
      trimmed = true;
      if (pm__pool_trim_locked(p, NULL) > 0) continue;
    }
    if (p->releasers > 0) {
      /* Another thread holds detached blocks or segments that may free budget: let it finish. */
      pm__pool_wait_slice_locked(p, PM__WAIT_SLICE_S);
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
    pm__pool_wait_slice_locked(p, PM__MIN(PM__WAIT_SLICE_S, deadline - now));
    polled = trimmed = false;
  }
}

/* ---- registrations ------------------------------------------------------------------------- */

pm_status_t pm__pool_charge(pm_pool_t *pool, size_t bytes) {
  return pm__pool_charge_for(pool, bytes, "pm_register");
}

pm_status_t pm__pool_charge_for(pm_pool_t *pool, size_t bytes, const char *what) {
  if (!pool) return pm__set_error(PM_ERR_INVALID, "pm__pool_charge: pool is NULL");
  if (bytes == 0) return PM_OK;
  pm__acquire_t a = {.what = what,
                     .use_bins = false,
                     .node = -1,
                     .bytes = bytes,
                     .seg_pref = bytes,
                     .seg_min = bytes};
  pthread_mutex_lock(&pool->lock);
  pm_status_t st = pm__pool_acquire_locked(pool, &a);
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
