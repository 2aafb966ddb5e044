/*
 * DESIGN: the host backend's events (the engine: backend_host_stream.c). An event points at its
 * latest record, a refcounted completion object that a stream's worker completes when it
 * reaches the record op, with a CLOCK_MONOTONIC timestamp. query, synchronize and
 * stream_wait_event take the record that is latest at the time of the call, so re-recording an
 * event never changes what an earlier wait waits for, as in CUDA. Live events are a sorted
 * handle set under pm__hb_obj_lock, so a destroyed or foreign handle is an error, not a crash.
 * An event belongs to the device current at its creation (the mismatch rules it takes part in
 * are in backend_host_memory.c's DESIGN comment). Lock order as in the engine: obj_lock ->
 * stream.mu -> rec_lock.
 */
#include <pthread.h>
#include <stdlib.h>

#include "backend_host.h"

pm_status_t pm__hb_stream_wait_event(pm_stream_t h, pm_event_t ev) {
  pm__hb_count_call();
  static const char fn[] = "stream_wait_event";
  if (!ev) return pm__set_error(PM_ERR_INVALID, "%s: event is NULL", fn);
  hb_op_t *op = pm__hb_op_new(fn, OP_WAIT);
  if (!op) return PM_ERR_NOMEM;
  struct pm_stream_s *s = NULL;
  pm_status_t st = pm__hb_stream_find(fn, h, ev, op, &s);
  if (st != PM_OK) return st;
  /* Capture the record that is latest now; a never-recorded or completed one needs no wait. */
  pthread_mutex_lock(&pm__hb_rec_lock);
  hb_rec_t *r = ev->latest;
  if (r && !r->done)
    r->refs++;
  else
    r = NULL;
  pthread_mutex_unlock(&pm__hb_rec_lock);
  if (!r) {
    pthread_mutex_unlock(&pm__hb_obj_lock);
    free(op);
    return PM_OK;
  }
  op->u.rec = r;
  pm__hb_queue(s, op);
  return PM_OK;
}

pm_status_t pm__hb_event_create(unsigned flags, pm_event_t *event_out) {
  pm__hb_count_call();
  if (!event_out) return pm__set_error(PM_ERR_INVALID, "event_create: event_out is NULL");
  if (flags & ~(unsigned)PM_EVENT_TIMING)
    return pm__set_error(PM_ERR_INVALID, "event_create: unknown flags 0x%x",
                         flags & ~(unsigned)PM_EVENT_TIMING);
  struct pm_event_s *ev = calloc(1, sizeof *ev);
  if (!ev) return pm__set_error(PM_ERR_NOMEM, "event_create: out of memory");
  ev->flags = flags;
  ev->device = pm__hb_current();
  pm_status_t st = pm__hb_set_publish(&pm__hb_event_set, ev);
  if (st != PM_OK) {
    free(ev);
    return pm__wrap_error(st, "event_create");
  }
  *event_out = ev;
  return PM_OK;
}

pm_status_t pm__hb_event_destroy(pm_event_t ev) {
  pm__hb_count_call();
  pthread_mutex_lock(&pm__hb_obj_lock);
  pm_status_t st = pm__hb_event_lookup_locked("event_destroy", ev);
  if (st == PM_OK) {
    pm__hb_set_del(&pm__hb_event_set, ev);
    /* A pending record lives on in its op and in waits that captured it (CUDA too lets an
     * event with pending work be destroyed). */
    pthread_mutex_lock(&pm__hb_rec_lock);
    pm__hb_rec_unref_locked(ev->latest);
    pthread_mutex_unlock(&pm__hb_rec_lock);
  }
  pthread_mutex_unlock(&pm__hb_obj_lock);
  if (st == PM_OK) free(ev);
  return st;
}

pm_status_t pm__hb_event_record(pm_event_t ev, pm_stream_t h) {
  pm__hb_count_call();
  static const char fn[] = "event_record";
  if (!ev) return pm__set_error(PM_ERR_INVALID, "%s: event is NULL", fn);
  hb_op_t *op = pm__hb_op_new(fn, OP_RECORD);
  hb_rec_t *r = calloc(1, sizeof *r);
  if (!op || !r) {
    free(op);
    free(r);
    return pm__set_error(PM_ERR_NOMEM, "%s: out of memory", fn);
  }
  r->refs = 2; /* the event and the op */
  op->u.rec = r;
  struct pm_stream_s *s = NULL;
  pm_status_t st = pm__hb_stream_find(fn, h, ev, op, &s);
  if (st != PM_OK) {
    free(r);
    return st;
  }
  /* cudaEventRecord fails when the event and the stream belong to different devices. */
  if (ev->device != s->device)
    pm__hb_mismatch("%s: event %p of device %d recorded on stream %p of device %d", fn, (void *)ev,
                    ev->device, (void *)h, s->device);
  pthread_mutex_lock(&pm__hb_rec_lock);
  pm__hb_rec_unref_locked(ev->latest);
  ev->latest = r;
  pthread_mutex_unlock(&pm__hb_rec_lock);
  pm__hb_queue(s, op);
  return PM_OK;
}

pm_status_t pm__hb_event_query(pm_event_t ev) {
  pm__hb_count_call();
  pthread_mutex_lock(&pm__hb_obj_lock);
  pm_status_t st = pm__hb_event_lookup_locked("event_query", ev);
  if (st == PM_OK) {
    pthread_mutex_lock(&pm__hb_rec_lock);
    st = !ev->latest || ev->latest->done ? PM_OK : PM_NOT_READY;
    pthread_mutex_unlock(&pm__hb_rec_lock);
  }
  pthread_mutex_unlock(&pm__hb_obj_lock);
  return st;
}

pm_status_t pm__hb_event_synchronize(pm_event_t ev) {
  pm__hb_count_call();
  pthread_mutex_lock(&pm__hb_obj_lock);
  pm_status_t st = pm__hb_event_lookup_locked("event_synchronize", ev);
  if (st != PM_OK) {
    pthread_mutex_unlock(&pm__hb_obj_lock);
    return st;
  }
  pthread_mutex_lock(&pm__hb_rec_lock);
  hb_rec_t *r = ev->latest;
  if (r) r->refs++;
  pthread_mutex_unlock(&pm__hb_obj_lock); /* the event may go now; the reference keeps the record */
  if (r) {
    while (!r->done) pthread_cond_wait(&pm__hb_rec_cv, &pm__hb_rec_lock);
    pm__hb_rec_unref_locked(r);
  }
  pthread_mutex_unlock(&pm__hb_rec_lock);
  return PM_OK;
}

pm_status_t pm__hb_event_elapsed(pm_event_t start, pm_event_t end, double *seconds_out) {
  pm__hb_count_call();
  static const char fn[] = "event_elapsed";
  if (!start || !end) return pm__set_error(PM_ERR_INVALID, "%s: event is NULL", fn);
  if (!seconds_out) return pm__set_error(PM_ERR_INVALID, "%s: seconds_out is NULL", fn);
  pthread_mutex_lock(&pm__hb_obj_lock);
  pm_status_t st = pm__hb_event_lookup_locked(fn, start);
  if (st == PM_OK) st = pm__hb_event_lookup_locked(fn, end);
  if (st != PM_OK) {
    pthread_mutex_unlock(&pm__hb_obj_lock);
    return st;
  }
  /* cudaEventElapsedTime fails for events of two devices. */
  if (start->device != end->device)
    pm__hb_mismatch("%s: events %p of device %d and %p of device %d", fn, (void *)start,
                    start->device, (void *)end, end->device);
  double dt = 0;
  pthread_mutex_lock(&pm__hb_rec_lock);
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
  pthread_mutex_unlock(&pm__hb_rec_lock);
  pthread_mutex_unlock(&pm__hb_obj_lock);
  if (st == PM_OK) *seconds_out = dt;
  return st;
}
