/*
 * DESIGN: the consumer's side of the loader (loader.c's DESIGN comment describes the whole
 * loader). pm_loader_next takes the batches in order: it waits until batch deliver_g's slot is
 * READY, marks it HELD, makes the plain copy of a pageable slot (pin_memory 0) on the caller's
 * thread and fills in the batch from the slot's field table. pm_batch_wait_stream and
 * pm_batch_release act on a delivered batch, also after its loader was destroyed (a release then
 * frees its slot, and the last one the loader). pm_loader_state and pm_loader_get_stats read the
 * position and the counters under mu.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "loader_internal.h"

/* ---- the consumer side -------------------------------------------------------------------- */

/* The plain copy of a pageable slot, on the consumer's thread (pin_memory 0). */
static pm_status_t pageable_copy(pm_loader_t *L, slot_t *s) {
  return pm__loader_queue_parts(L, s, 0, 1, "plain copy of a pageable batch");
}

/* Leave pm_loader_next with an error (mu held on entry, released here). */
static pm_status_t next_fail_locked(pm_loader_t *L, pm_status_t st, const char *fmt, ...)
    PM__PRINTF(3, 4);
static pm_status_t next_fail_locked(pm_loader_t *L, pm_status_t st, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  L->in_next = false;
  pthread_cond_broadcast(&L->ready_cv); /* pm_loader_destroy waits for in_next to clear */
  pthread_mutex_unlock(&L->mu);
  return pm__set_error(st, "pm_loader_next: %s", msg);
}

/* pm_loader_next waiting at most timeout_s (< 0: for as long as it takes); *late (when
 * timeout_s >= 0) set when the batch was not ready by then: PM_OK and nothing delivered. */
static pm_status_t loader_next(pm_loader_t *loader, pm_batch_t *batch_out, double timeout_s,
                               bool *late) {
  const char *fn = "pm_loader_next";
  pm_status_t st = pm__handle_check(loader, PM__HANDLE_LOADER, fn);
  if (st != PM_OK) return st;
  if (!batch_out) return pm__set_error(PM_ERR_INVALID, "%s: batch_out is NULL", fn);
  pm_loader_t *L = loader;
  double t0 = pm__now();

  pthread_mutex_lock(&L->mu);
  if (L->destroyed) {
    pthread_mutex_unlock(&L->mu);
    return pm__set_error(PM_ERR_INVALID, "%s: loader %p was already destroyed", fn, (void *)L);
  }
  if (L->in_next) {
    pthread_mutex_unlock(&L->mu);
    return pm__set_error(PM_ERR_BUSY, "%s: another thread is inside pm_loader_next", fn);
  }
  /* Taken before any wait: a second consumer gets PM_ERR_BUSY instead of the same batch. */
  L->in_next = true;
  uint64_t g = L->deliver_g;
  if (g >= L->end_g && g < L->err_g)
    return next_fail_locked(L, PM_ERR_STATE,
                            "end of data: all %llu epochs (%llu batches each) were delivered",
                            (unsigned long long)L->cfg.epochs,
                            (unsigned long long)L->sampler.batches);
  slot_t *s = &L->slots[g % (uint64_t)L->nslots];
  bool waited = false;
  double tw = 0;
  for (;;) {
    /* Destroyed by another thread while this call waited: leave before the loader goes. */
    if (L->stop) return next_fail_locked(L, PM_ERR_STATE, "the loader was destroyed");
    if (L->err_g <= g) return next_fail_locked(L, L->err, "%s", L->err_msg);
    if (s->state == SLOT_READY && s->seq == g) break;
    if (s->state == SLOT_HELD && s->seq < g) {
      /* Batch g reuses the slot of a batch the caller still holds: waiting would never end. */
      uint64_t old = s->seq;
      char why[256] = "";
      if (L->cfg.lease_slots) {
        /* The held batch keeps its memory (an orphan, freed by its release); the ring takes a
         * new slot from the pool. Allocation is backend work: outside mu. */
        pthread_mutex_unlock(&L->mu);
        slot_t fresh;
        pm_status_t ast = pm__loader_alloc_slot(L, &fresh);
        if (ast != PM_OK) snprintf(why, sizeof why, "%s", pm_last_error());
        orphan_t *o = ast == PM_OK ? malloc(sizeof *o) : NULL;
        pthread_mutex_lock(&L->mu);
        if (o && s->state == SLOT_HELD && s->seq == old && !L->stop) {
          o->s = *s;
          o->next = L->orphans;
          L->orphans = o;
          *s = fresh;
          pthread_cond_broadcast(&L->work_cv); /* workers may open it now */
          continue;
        }
        if (ast == PM_OK) {
          /* Released meanwhile (or no memory for the record): the ring slot is usable again
           * or the caller hears of it; the new slot goes back. */
          pthread_mutex_unlock(&L->mu);
          free(o);
          pm__loader_free_slot(L, &fresh);
          pthread_mutex_lock(&L->mu);
          if (o) continue;
          snprintf(why, sizeof why, "no memory for a lease record");
        } else {
          pthread_mutex_unlock(&L->mu);
          pm__loader_free_slot(L, &fresh);
          pthread_mutex_lock(&L->mu);
        }
      }
      if (why[0])
        return next_fail_locked(L, PM_ERR_BUSY,
                                "the next batch needs the slot of batch %llu of epoch %llu, which "
                                "the caller still holds, and no other slot could be taken: %s "
                                "(release batches, or raise the budget)",
                                (unsigned long long)(old % L->sampler.batches),
                                (unsigned long long)(old / L->sampler.batches), why);
      return next_fail_locked(L, PM_ERR_BUSY,
                              "the next batch needs the slot of batch %llu of epoch %llu, which "
                              "the caller still holds (%d slots: release batches in time, or "
                              "raise prefetch)",
                              (unsigned long long)(old % L->sampler.batches),
                              (unsigned long long)(old / L->sampler.batches), L->nslots);
    }
    if (!waited) tw = pm__now();
    waited = true;
    if (timeout_s < 0) {
      pthread_cond_wait(&L->ready_cv, &L->mu);
      continue;
    }
    double left = timeout_s - (pm__now() - t0);
    if (left <= 0) {
      /* Nothing changes: the next call waits for the same batch. Not a status: a loader's own
       * error can be PM_ERR_TIMEOUT (a worker process past its timeout). */
      L->st.stall_seconds += pm__now() - tw;
      L->in_next = false;
      pthread_cond_broadcast(&L->ready_cv); /* pm_loader_destroy waits for in_next to clear */
      pthread_mutex_unlock(&L->mu);
      *late = true;
      return PM_OK;
    }
    struct timespec ts; /* ready_cv waits on CLOCK_REALTIME, the default */
    clock_gettime(CLOCK_REALTIME, &ts);
    long long ns = (long long)(left * 1e9) + ts.tv_nsec;
    ts.tv_sec += (time_t)(ns / 1000000000LL);
    ts.tv_nsec = (long)(ns % 1000000000LL);
    pthread_cond_timedwait(&L->ready_cv, &L->mu, &ts);
  }
  double stall = waited ? pm__now() - tw : 0;
  s->state = SLOT_HELD;
  L->held++;
  L->deliver_g = g + 1;
  pthread_mutex_unlock(&L->mu);

  if (L->device && !L->pinned) {
    double tc = pm__now();
    st = pageable_copy(L, s);
    stall += pm__now() - tc;
    if (st != PM_OK) {
      char msg[sizeof L->err_msg];
      snprintf(msg, sizeof msg, "%s", pm_last_error());
      pthread_mutex_lock(&L->mu);
      /* Not delivered: the position stays at this batch, which now reports the error. */
      s->state = SLOT_READY;
      L->held--;
      L->deliver_g = g;
      L->in_next = false;
      pthread_cond_broadcast(&L->ready_cv);
      pm__loader_set_error_locked(L, g, st, msg, PM__NO_SAMPLE);
      pthread_mutex_unlock(&L->mu);
      return pm__set_error(st, "%s: %s", fn, msg);
    }
  }

  /* The slot's field table was filled at create; only the row count changes. */
  pm_batch_field_t *bf = s->bf;
  size_t rows = (size_t)s->rows;
  size_t bytes = 0;
  for (int k = 0; k < L->nfields; k++) {
    bf[k].bytes = rows * bf[k].bytes_per_sample;
    bf[k].shape[0] = rows;
    bytes += bf[k].bytes;
  }
  pm_batch_t b;
  memset(&b, 0, sizeof b);
  b.inputs = bf[0].data;
  b.host_inputs = bf[0].host;
  b.inputs_bytes = bf[0].bytes;
  if (L->nfields > 1) {
    b.targets = bf[1].data;
    b.host_targets = bf[1].host;
    b.targets_bytes = bf[1].bytes;
  }
  b.samples = rows;
  b.ndim = bf[0].ndim;
  memcpy(b.shape, bf[0].shape, sizeof(uint64_t) * (size_t)bf[0].ndim);
  b.dtype = L->finfo[0].dtype;
  b.itemsize = L->finfo[0].itemsize;
  b.epoch = g / L->sampler.batches;
  b.index = g % L->sampler.batches;
  b.indices = s->indices;
  b.event = L->device ? s->ev_done : NULL;
  b.nfields = L->nfields;
  b.fields = bf;
  b.internal.loader = L;
  b.internal.seq = g;
  b.internal.slot = (int)(g % (uint64_t)L->nslots);
  *batch_out = b;

  pthread_mutex_lock(&L->mu);
  L->in_next = false;
  pthread_cond_broadcast(&L->ready_cv);
  L->st.batches++;
  L->st.samples += s->rows;
  L->st.bytes += bytes;
  L->st.waits += waited;
  L->st.stall_seconds += stall;
  L->st.next_seconds += pm__now() - t0;
  pthread_mutex_unlock(&L->mu);
  return PM_OK;
}

pm_status_t pm_loader_next(pm_loader_t *loader, pm_batch_t *batch_out) {
  bool late = false;
  return loader_next(loader, batch_out, -1, &late);
}

pm_status_t pm_loader_next_timed(pm_loader_t *loader, pm_batch_t *batch_out, double timeout_s,
                                 int *ready_out) {
  if (!ready_out) return pm__set_error(PM_ERR_INVALID, "pm_loader_next_timed: ready_out is NULL");
  *ready_out = 0;
  if (!(timeout_s >= 0)) /* NaN too */
    return pm__set_error(PM_ERR_INVALID, "pm_loader_next_timed: timeout_s %g is not >= 0",
                         timeout_s);
  bool late = false;
  pm_status_t st = loader_next(loader, batch_out, timeout_s, &late);
  *ready_out = st == PM_OK && !late;
  return st;
}

/* The slot of a delivered batch, or an error. The batch's loader may be destroyed already (its
 * held slots live on until released), so only the handle is checked here. */
static pm_status_t batch_slot(const char *fn, const pm_batch_t *b, slot_t **s_out) {
  if (!b) return pm__set_error(PM_ERR_INVALID, "%s: batch is NULL", fn);
  pm_loader_t *L = b->internal.loader;
  if (!L)
    return pm__set_error(PM_ERR_INVALID,
                         "%s: the batch was released already (or never "
                         "delivered)",
                         fn);
  pm_status_t st = pm__handle_check(L, PM__HANDLE_LOADER, fn);
  if (st != PM_OK) return st;
  if (b->internal.slot < 0 || b->internal.slot >= L->nslots)
    return pm__set_error(PM_ERR_INVALID, "%s: the batch is corrupt (slot %d)", fn,
                         b->internal.slot);
  *s_out = &L->slots[b->internal.slot];
  return PM_OK;
}

/* The slot a delivered batch holds: its ring slot, or the orphan that kept it when the ring
 * took a new slot (lease_slots). Called with mu held. */
static slot_t *held_slot_locked(pm_loader_t *L, slot_t *ring, uint64_t seq) {
  if (ring->seq == seq && (ring->state == SLOT_HELD || ring->state == SLOT_RELEASING)) return ring;
  for (orphan_t *o = L->orphans; o; o = o->next)
    if (o->s.seq == seq) return &o->s;
  return ring;
}

/* Unlink and return the orphan record of slot s, or NULL for a ring slot. Called with mu. */
static orphan_t *take_orphan_locked(pm_loader_t *L, slot_t *s) {
  for (orphan_t **p = &L->orphans; *p; p = &(*p)->next)
    if (&(*p)->s == s) {
      orphan_t *o = *p;
      *p = o->next;
      return o;
    }
  return NULL;
}

pm_status_t pm_batch_wait_stream(const pm_batch_t *batch, pm_stream_t stream) {
  const char *fn = "pm_batch_wait_stream";
  slot_t *s = NULL;
  pm_status_t st = batch_slot(fn, batch, &s);
  if (st != PM_OK) return st;
  (void)s;
  if (!batch->event) return PM_OK; /* host delivery: the data is in place already */
  st = pm_stream_wait_event(stream, batch->event);
  if (st != PM_OK) return pm__wrap_error(st, "%s", fn);
  return PM_OK;
}

pm_status_t pm_batch_release(pm_batch_t *batch, pm_stream_t stream) {
  const char *fn = "pm_batch_release";
  slot_t *s = NULL;
  pm_status_t st = batch_slot(fn, batch, &s);
  if (st != PM_OK) return st;
  pm_loader_t *L = batch->internal.loader;

  pthread_mutex_lock(&L->mu);
  s = held_slot_locked(L, s, batch->internal.seq);
  if (s->state != SLOT_HELD || s->seq != batch->internal.seq) {
    pthread_mutex_unlock(&L->mu);
    return pm__set_error(PM_ERR_INVALID,
                         "%s: batch %llu of epoch %llu is not held (released "
                         "already?)",
                         fn, (unsigned long long)batch->index, (unsigned long long)batch->epoch);
  }
  s->state = SLOT_RELEASING;
  bool gone = L->destroyed;
  pthread_mutex_unlock(&L->mu);

  double copy_t = 0;
  if (L->device) {
    st = pm_event_record(s->ev_release, stream);
    if (st == PM_OK) {
      s->release_pending = true;
    } else if (gone) {
      /* Nothing can retry for a destroyed loader: wait for the stream itself instead (a
       * stream that fails that is broken, its work ended), then free the slot below. */
      (void)pm_stream_synchronize(stream);
    } else {
      pthread_mutex_lock(&L->mu);
      s->state = SLOT_HELD; /* still the caller's: it may retry or destroy the loader */
      pthread_mutex_unlock(&L->mu);
      return pm__wrap_error(st, "%s: recording the release on the consumer's stream", fn);
    }
    if (s->copy_pending && pm_event_query(s->ev_done) == PM_OK) {
      pm__loader_add_copy_time(L, s, &copy_t);
      s->copy_pending = false;
    }
  }
  pthread_mutex_lock(&L->mu);
  orphan_t *orphan = take_orphan_locked(L, s);
  if (L->destroyed || orphan) {
    /* The loader is gone, or the ring replaced this slot: free it (once the stream is past
     * it), and a destroyed loader with its last slot. held drops only after the free, so the
     * loader outlives it. */
    s->state = SLOT_GONE;
    if (orphan) L->st.copy_seconds += copy_t;
    pthread_mutex_unlock(&L->mu);
    pm__loader_free_slot(L, s);
    free(orphan);
    pthread_mutex_lock(&L->mu);
    L->held--;
    bool last = L->held == 0 && L->torn_down;
    pthread_mutex_unlock(&L->mu);
    memset(batch, 0, sizeof *batch);
    if (last) pm__loader_free(L);
    return PM_OK;
  }
  s->state = SLOT_FREE;
  L->held--;
  L->st.copy_seconds += copy_t;
  pthread_cond_broadcast(&L->work_cv);
  pthread_mutex_unlock(&L->mu);
  memset(batch, 0, sizeof *batch);
  return PM_OK;
}

pm_status_t pm_loader_error_sample(pm_loader_t *loader, uint64_t *index_out) {
  const char *fn = "pm_loader_error_sample";
  pm_status_t st = pm__loader_check(fn, loader);
  if (st != PM_OK) return st;
  if (!index_out) return pm__set_error(PM_ERR_INVALID, "%s: index_out is NULL", fn);
  pthread_mutex_lock(&loader->mu);
  bool failed = loader->err_g != UINT64_MAX;
  uint64_t i = loader->err_sample;
  pthread_mutex_unlock(&loader->mu);
  if (!failed) return pm__set_error(PM_ERR_STATE, "%s: no batch of the loader failed", fn);
  if (i == PM__NO_SAMPLE)
    return pm__set_error(PM_ERR_STATE,
                         "%s: the loader's error is not the read of one known sample "
                         "(a copy, a slot, or a read of several rows in one call failed)",
                         fn);
  *index_out = i;
  return PM_OK;
}

pm_status_t pm_loader_state(pm_loader_t *loader, pm_loader_state_t *state_out) {
  pm_status_t st = pm__loader_check("pm_loader_state", loader);
  if (st != PM_OK) return st;
  if (!state_out) return pm__set_error(PM_ERR_INVALID, "pm_loader_state: state_out is NULL");
  const pm__sampler_t *s = &loader->sampler;
  pm_loader_state_t r;
  memset(&r, 0, sizeof r);
  pthread_mutex_lock(&loader->mu);
  uint64_t g = loader->deliver_g;
  pthread_mutex_unlock(&loader->mu);
  r.magic = PM_LOADER_STATE_MAGIC;
  r.flags = (s->shuffle ? 1u : 0u) | (s->drop_last ? 2u : 0u);
  r.epoch = g / s->batches;
  r.batch = g % s->batches;
  r.seed = s->seed;
  r.samples = s->n;
  r.batch_size = s->batch;
  r.rank = s->rank;
  r.world_size = s->world;
  *state_out = r;
  return PM_OK;
}

pm_status_t pm_loader_get_stats(pm_loader_t *loader, pm_loader_stats_t *stats_out) {
  pm_status_t st = pm__loader_check("pm_loader_get_stats", loader);
  if (st != PM_OK) return st;
  if (!stats_out) return pm__set_error(PM_ERR_INVALID, "pm_loader_get_stats: stats_out is NULL");
  pthread_mutex_lock(&loader->mu);
  *stats_out = loader->st;
  pthread_mutex_unlock(&loader->mu);
  return PM_OK;
}
