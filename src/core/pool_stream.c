/*
 * DESIGN: stream-ordered frees and quarantine (see pool.c for the whole pool). A block freed
 * after pm__pool_record_stream named the streams that used it is not reusable until each of
 * those streams passed the free: pm__pool_free records one event per stream (taken from the
 * pool's event cache, whose capacity is reserved under the lock so returning events never
 * allocates) and parks the block on the pending list; pm__pool_poll_pending_locked queries each
 * pending block on its own, outside the lock, and frees those whose events all completed. A
 * block whose streams can neither record an event nor be synchronized, or whose event can no
 * longer be queried, is QUARANTINED: it stays in the hash, counted in pending_bytes and in
 * `quarantined`, and is never handed out again; pool destroy releases it after a device-wide
 * synchronize (pool.c). The backend is never called with the pool lock held.
 */
#include <stdlib.h>
#include <string.h>

#include "pool_internal.h"

/* Events of a block go back to the cache (capacity was reserved when they were counted). */
static void return_events_locked(pm_pool_t *p, pm__block_t *b) {
  for (int i = 0; i < b->nuses; i++) {
    if (b->uses[i].event) {
      p->events[p->nevents++] = b->uses[i].event;
      b->uses[i].event = NULL;
    }
  }
}

/* The block will never be handed out again: its memory may still be read or written by device
 * work that nothing can order any more. It stays in the hash (a second free is a double free),
 * its bytes in pending_bytes, until pool destroy releases it after a device synchronize. */
static void quarantine_locked(pm_pool_t *p, pm__block_t *b) {
  b->lnext = b->lprev = NULL;
  b->state = PM__B_QUARANTINED;
  p->quarantined++;
  p->quarantined_bytes += b->size;
}

/* Poll every pending block independently, outside the lock. Returns true if any became free.
 * Called with the lock held; drops and retakes it. */
bool pm__pool_poll_pending_locked(pm_pool_t *p) {
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
    pm__pool_make_free_locked(p, b);
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
    quarantine_locked(p, b);
  }
  wake_locked(p);
  return any;
}

/* The in-use block that starts at ptr, taken out of the in-use counts (a free of it), or an
 * error naming `fn` with *b_out untouched. */
static pm_status_t take_in_use_locked(pm_pool_t *p, void *ptr, const char *fn,
                                      pm__block_t **b_out) {
  bool exact = false;
  pm__block_t *b = pm__pool_locate_locked(p, ptr, &exact);
  if (!b)
    return pm__set_error(PM_ERR_NOT_FOUND, "%s(%p): not in any segment of pool %p", fn, ptr,
                         (void *)p);
  /* Free memory past the segment's high-water mark was never handed out: the pointer did not
   * come from pm_host_alloc (a stray or computed address), which "double free" would hide. */
  if (pm__pool_never_handed(b, ptr))
    return pm__set_error(PM_ERR_INVALID,
                         "%s(%p): not allocated by pm_host_alloc (pool %p holds the address in "
                         "the part of a segment that was never handed out)",
                         fn, ptr, (void *)p);
  if (b->state != PM__B_IN_USE)
    return pm__set_error(
        PM_ERR_DOUBLE_FREE, "%s(%p): %s", fn, ptr,
        exact ? "block already freed" : "inside a free block of the pool (already freed?)");
  if (!exact)
    return pm__set_error(PM_ERR_INVALID,
                         "%s(%p): not the start of a block (the block holding it starts at %p, "
                         "%zu bytes)",
                         fn, ptr, (void *)b->ptr, b->size);
  p->in_use -= b->size;
  p->requested -= b->requested;
  p->in_use_blocks--;
  p->frees++;
  *b_out = b;
  return PM_OK;
}

pm_status_t pm__pool_free(pm_pool_t *p, void *ptr) {
  if (!p || !ptr) return pm__set_error(PM_ERR_INVALID, "pm_host_free: NULL pool or pointer");
  const pm__backend_t *be = p->b;
  pthread_mutex_lock(&p->lock);
  pm__block_t *b = NULL;
  pm_status_t st = take_in_use_locked(p, ptr, "pm_host_free", &b);
  if (st != PM_OK) {
    pthread_mutex_unlock(&p->lock);
    return st;
  }

  if (b->nuses == 0) {
    pm__pool_make_free_locked(p, b);
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
    quarantine_locked(p, b);
    st = pm__set_error(PM_ERR_BACKEND,
                       "pm_host_free(%p): could neither record an event on stream %p nor "
                       "synchronize it; the block is freed but kept out of use until the pool "
                       "is destroyed",
                       ptr, (void *)bad_stream);
  } else if (recorded == 0) {
    return_events_locked(p, b);
    p->pending_bytes -= b->size;
    pm__pool_make_free_locked(p, b);
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

pm_status_t pm__pool_quarantine(pm_pool_t *p, void *ptr) {
  if (!p || !ptr) return pm__set_error(PM_ERR_INVALID, "pm__pool_quarantine: NULL pool or pointer");
  pthread_mutex_lock(&p->lock);
  pm__block_t *b = NULL;
  pm_status_t st = take_in_use_locked(p, ptr, "pm__pool_quarantine", &b);
  if (st == PM_OK) {
    p->pending_bytes += b->size;
    quarantine_locked(p, b);
  }
  pthread_mutex_unlock(&p->lock);
  return st;
}

pm_status_t pm__pool_record_stream(pm_pool_t *p, void *ptr, pm_stream_t stream) {
  if (!p || !ptr)
    return pm__set_error(PM_ERR_INVALID, "pm_host_record_stream: NULL pool or pointer");
  /* Tests drive the path where no memory is left for the record (op pool_record). */
  pm_status_t fault = pm__fault_check(PM__FAULT_POOL_RECORD, "pm_host_record_stream");
  if (fault != PM_OK) return fault;
  pthread_mutex_lock(&p->lock);
  bool exact = false;
  pm__block_t *b = pm__pool_locate_locked(p, ptr, &exact);
  pm_status_t st = PM_OK;
  if (!b)
    st = pm__set_error(PM_ERR_NOT_FOUND, "pm_host_record_stream(%p): not in pool %p", ptr,
                       (void *)p);
  else if (pm__pool_never_handed(b, ptr))
    st = pm__set_error(PM_ERR_INVALID,
                       "pm_host_record_stream(%p): not allocated by pm_host_alloc (never handed "
                       "out)",
                       ptr);
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

/* ---- releasing quarantined memory at destroy ------------------------------------------------ */

bool pm__pool_devices_idle(pm_pool_t *p) {
  /* The stream that used a quarantined block is unknown by now (or broken), so every device this
   * process used waits for all its work, and no other device: a call on a device nobody used
   * would create a context there (thread_device.c keeps the set). The caller's current device
   * is among them (it may have been used outside pinmem) and is restored at the end. */
  const pm__backend_t *be = p->b;
  int n = 0, cur = 0;
  if (be->device_count(&n) != PM_OK || n < 1 || be->get_device(&cur) != PM_OK)
    return be->device_synchronize() == PM_OK;
  uint64_t used = pm__devices_used();
  bool idle = be->device_synchronize() == PM_OK;
  for (int d = 0; d < n && d < 64; d++) {
    if (d == cur || !(used >> d & 1)) continue;
    if (be->set_device(d) != PM_OK || be->device_synchronize() != PM_OK) idle = false;
  }
  (void)be->set_device(cur);
  return idle;
}

bool pm__pool_segment_quarantined(const pm__segment_t *s) {
  for (const pm__block_t *b = s->first; b; b = b->anext)
    if (b->state == PM__B_QUARANTINED) return true;
  return false;
}
