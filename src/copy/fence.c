/*
 * DESIGN: fences, the copy engine's completion objects (pm_fence_*), and the submission steps
 * that set one up (a copy with nothing to move; the gate of a staged D2H copy).
 *
 * A fence is a refcounted object: the user's handle (if fence_out was given), the engine's
 * reference while completion work is pending (a callback or a D2H copy-out), and the stream
 * gate's. Its event is recorded on the stream after everything the copy queued, so
 * pm_fence_stream_wait is one stream-wait-event. A staged D2H copy queues, behind its DMAs, a
 * host function (the gate) that returns once a completion thread copied the bytes out, and the
 * event comes after the gate: so the event, a stream synchronize and any later work on the
 * stream all mean "the bytes are in dst", and staged D2H copy-outs on one stream happen in
 * stream order. The gate starts only after every DMA it depends on, so it waits for CPU work
 * alone (as CUDA requires of host functions), and that work makes no backend call at all: a
 * backend call can wait behind another thread's synchronizing call (cudaFree) that waits for
 * the gate (copy_stage.c). The copy-out is in a completion thread's hands before the gate is
 * queued (pm__fence_submit_d2h_gate): otherwise a backend call of the submitter between the two
 * could wait behind such a synchronizing call and nobody would open the gate. Event calls on a
 * gated fence happen only after data_done. A fence with a callback or a copy-out is a "host"
 * fence with two steps under its mutex: data_done (every byte in place; the gate opens) and
 * finished (the callback returned too; without a callback, the same moment); pm_fence_query /
 * pm_fence_wait report finished. Live handles sit in handles.c's set, so a released or unknown
 * fence is an error, not a crash.
 *
 * Layer: above staging (copy_stage.c: the D2H copy-out) and the completion service
 * (completion.c); below path choice and submission (copy.c). Calls the backend contract only.
 *
 * Lock order: the handle set (handles.c) and each fence's mu are leaves: never held together,
 * and neither is held across a backend, pool or registry call or a user callback.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "copy_internal.h"

/* The completion service's jobs: a fence's node runs one of these. */
static void fence_complete(pm_fence_t f);
static pm_fence_t node_fence(pm__cq_node_t *node) {
  return (pm_fence_t)((char *)node - offsetof(struct pm_fence_s, node));
}
static void fence_complete_job(pm__cq_node_t *node) {
  fence_complete(node_fence(node));
}
static void fence_free_job(pm__cq_node_t *node) {
  pm__fence_free(node_fence(node));
}

void pm__fence_post(pm_fence_t f) {
  pm__cq_post(&f->node, fence_complete_job);
}

pm_status_t pm__fence_new(pm_copy_path_t path, bool with_event, const pm_copy_options_t *opt,
                          pm_fence_t *out) {
  pm_fence_t f = calloc(1, sizeof *f);
  if (!f) return pm__set_error(PM_ERR_NOMEM, "malloc of a fence failed");
  f->node.device = pm__thread_device(); /* its completion runs for the submitting thread's device */
  if (with_event) {
    pm_status_t st = pm__cb_event_create(PM_EVENT_DEFAULT, &f->event);
    if (st != PM_OK) {
      free(f);
      return pm__wrap_error(st, "fence event");
    }
  }
  atomic_init(&f->refs, 0);
  f->armed = true;
  f->path = path;
  f->cb = opt->callback;
  f->cb_arg = opt->callback_arg;
  pthread_mutex_init(&f->mu, NULL);
  pthread_cond_init(&f->cv, NULL);
  *out = f;
  return PM_OK;
}

void pm__fence_free(pm_fence_t f) {
  pm__copy_reap_event(f->event);
  pthread_mutex_destroy(&f->mu);
  pthread_cond_destroy(&f->cv);
  free(f);
}

void pm__fence_unref(pm_fence_t f, bool in_host_func) {
  if (atomic_fetch_sub_explicit(&f->refs, 1, memory_order_acq_rel) != 1) return;
  if (in_host_func)
    pm__cq_post(&f->node, fence_free_job); /* event calls are not allowed in a host function */
  else
    pm__fence_free(f);
}

/* Completion thread: finish the copy-out, open the gates, run the callback. */
static void fence_complete(pm_fence_t f) {
  pm_status_t st = PM_OK;
  char msg[sizeof f->msg] = "";
  if (f->job) {
    st = pm__stage_d2h_finish(f->job, msg, sizeof msg);
    f->job = NULL;
  } else if (f->event) {
    st = pm__cb_event_query(f->event);
    if (st == PM_NOT_READY) st = pm__copy_wait_event(f->event, 1000);
    if (st < 0)
      snprintf(msg, sizeof msg, "%s", pm_last_error());
    else
      st = PM_OK;
  }
  pthread_mutex_lock(&f->mu);
  f->status = st;
  memcpy(f->msg, msg, sizeof msg);
  f->data_done = true;
  void (*cb)(void *, pm_status_t) = f->cb;
  if (cb) {
    /* A staged D2H copy is armed by its submitter once the call is over; a failed call cancels
     * the callback (its caller got the error instead). Without a callback nothing waits. */
    while (!f->armed) pthread_cond_wait(&f->cv, &f->mu);
    if (f->cancelled) cb = NULL;
  }
  if (!cb) f->finished = true;
  pthread_cond_broadcast(&f->cv);
  pthread_mutex_unlock(&f->mu);
  if (cb) {
    cb(f->cb_arg, st);
    pthread_mutex_lock(&f->mu);
    f->finished = true;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
  }
  pm__fence_unref(f, false);
}

/* Host function behind a direct / staged-H2D copy with a callback: hand over to a thread. */
void pm__fence_notify(void *arg) {
  pm_fence_t f = arg;
  pm__fence_post(f);
}

/* Host function that holds a stream behind a staged D2H copy until its copy-out is done. */
static void fence_gate(void *arg) {
  pm_fence_t f = arg;
  pm__stage_d2h_dmas_done(f->gate_job); /* the stream got here: every DMA of the copy landed */
  pthread_mutex_lock(&f->mu);
  while (!f->data_done) pthread_cond_wait(&f->cv, &f->mu);
  pthread_mutex_unlock(&f->mu);
  pm__fence_unref(f, true);
}

/* ---- live fence handles (handles.c) ---------------------------------------------------- */

pm_status_t pm__fence_live_add(pm_fence_t f) {
  return pm__handle_add(f, PM__HANDLE_FENCE);
}
bool pm__fence_live_remove(pm_fence_t f) {
  return pm__handle_remove(f, PM__HANDLE_FENCE);
}

static pm_status_t fence_check(pm_fence_t f, const char *fn) {
  return pm__handle_check(f, PM__HANDLE_FENCE, fn);
}

/* ---- public fence calls --------------------------------------------------------------------- */

pm_status_t pm_fence_query(pm_fence_t fence) {
  pm_status_t st = fence_check(fence, "pm_fence_query");
  if (st != PM_OK) return st;
  if (fence->event) {
    st = pm__cb_event_query(fence->event);
    if (st != PM_OK) return st; /* PM_NOT_READY, or the stream's error */
  }
  if (!fence->host) return PM_OK;
  pthread_mutex_lock(&fence->mu);
  bool fin = fence->finished;
  st = fence->status;
  pthread_mutex_unlock(&fence->mu);
  if (!fin) return PM_NOT_READY;
  if (st != PM_OK) pm__set_error(st, "copy failed: %s", fence->msg);
  return st;
}

pm_status_t pm_fence_wait(pm_fence_t fence) {
  pm_status_t st = fence_check(fence, "pm_fence_wait");
  if (st != PM_OK) return st;
  if (fence->event) {
    st = pm__cb_event_synchronize(fence->event);
    if (st != PM_OK) return st;
  }
  if (!fence->host) return PM_OK;
  pthread_mutex_lock(&fence->mu);
  while (!fence->finished) pthread_cond_wait(&fence->cv, &fence->mu);
  st = fence->status;
  pthread_mutex_unlock(&fence->mu);
  if (st != PM_OK) pm__set_error(st, "copy failed: %s", fence->msg);
  return st;
}

/* The event follows everything the copy queued (for staged D2H: the gate that opens once the
 * bytes are in dst), so waiting for it is all a stream needs. It does not cover the callback. */
pm_status_t pm_fence_stream_wait(pm_fence_t fence, pm_stream_t stream) {
  pm_status_t st = fence_check(fence, "pm_fence_stream_wait");
  if (st != PM_OK) return st;
  if (!fence->event) return PM_OK;
  st = pm__cb_stream_wait_event(stream, fence->event);
  return st == PM_OK ? PM_OK : pm__wrap_error(st, "pm_fence_stream_wait");
}

pm_status_t pm_fence_release(pm_fence_t fence) {
  if (!fence) return pm__set_error(PM_ERR_INVALID, "pm_fence_release: fence is NULL");
  if (!pm__fence_live_remove(fence))
    return pm__set_error(PM_ERR_INVALID,
                         "pm_fence_release: fence %p is unknown or was already released",
                         (void *)fence);
  pm__fence_unref(fence, false);
  return PM_OK;
}

pm_status_t pm_fence_path(pm_fence_t fence, pm_copy_path_t *path_out) {
  pm_status_t st = fence_check(fence, "pm_fence_path");
  if (st != PM_OK) return st;
  if (!path_out) return pm__set_error(PM_ERR_INVALID, "pm_fence_path: path_out is NULL");
  *path_out = fence->path;
  return PM_OK;
}

/* ---- fence set-up steps of a submission ---------------------------------------------------- */

/* A copy with nothing to move: the fence is complete at once; the callback still runs once. */
pm_status_t pm__fence_submit_empty(const pm_copy_options_t *opt, pm_fence_t *fence_out) {
  if (!fence_out && !opt->callback) return PM_OK;
  pm_fence_t f;
  pm_status_t st = pm__fence_new(PM_PATH_DIRECT, false, opt, &f);
  if (st != PM_OK) return st;
  f->data_done = true;
  f->finished = !f->cb;
  f->host = f->cb != NULL;
  atomic_init(&f->refs, (fence_out ? 1 : 0) + (f->host ? 1 : 0));
  if (fence_out) {
    st = pm__fence_live_add(f);
    if (st != PM_OK) {
      pm__fence_free(f);
      return st;
    }
  }
  if (f->host) pm__fence_post(f);
  if (fence_out) *fence_out = f;
  return PM_OK;
}

/* A staged D2H copy whose DMAs are queued: hand the copy-out to a completion thread, then queue
 * the gate and the fence's event. The order matters. The gate blocks the stream (and, under
 * CUDA, the one thread that runs every host function) until the copy-out is done, so the
 * copy-out must already be in a completion thread's hands when the gate is queued: a backend
 * call made by this thread after the gate (the event record) can wait behind another thread's
 * synchronizing call (cudaFree), which waits for the gate. Were the copy-out posted only after
 * that call, nothing could ever open the gate. On a failure after the post, this thread lets
 * the copy-out finish (it never touches dst once the call returned) and returns the error. */
pm_status_t pm__fence_submit_d2h_gate(pm_fence_t f, pm__d2h_job_t *job, pm_stream_t stream,
                                      pm_fence_t *fence_out) {
  atomic_fetch_add(&f->refs, 1); /* this call's own, so f outlives the waits below */
  f->armed = false;
  if (!pm__cq_post_ex(&f->node, fence_complete_job, false)) {
    pm__set_error(PM_ERR_NOMEM, "staged D2H copy: no completion thread could be started");
    pm__stage_d2h_abort(job, stream); /* nothing was copied out: dst is untouched */
    if (fence_out) pm__fence_live_remove(f);
    pm__fence_free(f);
    return PM_ERR_NOMEM;
  }
  pm_status_t st = pm__cb_launch_host_func(stream, fence_gate, f);
  if (st != PM_OK) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", pm_last_error());
    atomic_fetch_sub(&f->refs, 1); /* no gate will run */
    /* Every DMA and group signal is queued: once the stream passed them the copy-out can end.
     * If even that wait fails, the copy-out skips what it has not copied yet. */
    if (pm__cb_stream_synchronize(stream) != PM_OK) pm__stage_d2h_discard(job);
    pm__stage_d2h_dmas_done(job);
    st = pm__set_error(st, "%s", msg);
  } else {
    st = pm__cb_event_record(f->event, stream);
  }
  pthread_mutex_lock(&f->mu);
  f->armed = true;
  f->cancelled = st != PM_OK;
  pthread_cond_broadcast(&f->cv);
  if (st != PM_OK) /* the copy-out must be over before the caller may reuse dst */
    while (!f->data_done) pthread_cond_wait(&f->cv, &f->mu);
  pthread_mutex_unlock(&f->mu);
  if (st != PM_OK) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", pm_last_error());
    if (fence_out && pm__fence_live_remove(f)) pm__fence_unref(f, false); /* no handle */
    pm__fence_unref(f, false);
    return pm__set_error(st, "%s", msg);
  }
  pm__fence_unref(f, false);
  if (fence_out) *fence_out = f;
  return PM_OK;
}
