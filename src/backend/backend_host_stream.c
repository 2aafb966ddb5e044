/*
 * DESIGN: the host backend's stream and event engine (the backend as a whole: backend_host.h;
 * its memory: backend_host_memory.c). The CPU plays the device, so the whole API and every test
 * run on a machine without a GPU. It models the cuda backend's ordering rules, not its speed.
 *
 * - Memory (pinned, device, managed) is backend_host_memory.c's: its tables say whether a copy
 *   touches pageable memory, and which spans are device memory.
 * - Each stream is a thread running a FIFO of ops in order. NULL is the current device's default
 *   stream, created on first use, independent of the others (as cudaStreamNonBlocking streams
 *   are of it). A stream belongs to the device current at its creation; device_synchronize
 *   waits for the current device's streams only.
 * - An event points at its latest "record", a refcounted completion object that the stream's
 *   worker completes (with a CLOCK_MONOTONIC timestamp). query, synchronize and wait_event take
 *   the record that is latest at the time of the call, so re-recording an event never changes
 *   what an earlier wait waits for, as in CUDA.
 * - A copy with a pageable host side blocks like CUDA's, and so does every host-to-host copy
 *   (CUDA documents those as fully synchronous): it queues a gate op; when the worker
 *   reaches the gate, the caller copies on its own thread while the worker holds, so the copy
 *   comes after the stream's earlier work and before its later work. Other copies are queued.
 *
 * Data structures: two sorted arrays of live stream and event handles under obj_lock, so a
 * destroyed or foreign handle is an error instead of a crash; per stream a mutex, a linked FIFO
 * of ops and the counters submitted/done (query: done == submitted; synchronize: wait until
 * done reaches the submitted count seen at the call).
 *
 * Invariants: a stream is freed only after it left the handle set, its worker drained the queue
 * and exited, and no caller waits on it (users == 0);
 * a caller that found a handle in a set takes the object's lock before dropping obj_lock, so
 * destroy (which leaves the set first) cannot free it under that caller. A record is freed when
 * its last holder (event, queued op, waiter) lets go.
 *
 * Files: this one holds the engine (handle sets, the worker loop, queueing, streams, device
 * synchronize, lifecycle and fork); backend_host_event.c the events; backend_host_ops.c the work
 * queued on streams (copies, memset, prefetch, busy, host functions) and the backend table.
 * Calls go ops -> event -> stream and ops -> stream, never back; the shared types are in
 * backend_host.h. In the code the two global locks are pm__hb_obj_lock and pm__hb_rec_lock.
 *
 * Lock order: obj_lock -> stream.mu -> rec_lock (a stream's worker completes a record under its
 * stream.mu; event_record and stream_wait_event capture records under both); the memory file's
 * mem_lock comes after all of them and is a leaf. No lock is held while an op runs (user
 * callbacks, sleeps, copies).
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend_host.h"

/* ---- records, handle sets, the default stream (shared with the event and op files) ---------- */

pthread_mutex_t pm__hb_rec_lock = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t pm__hb_rec_cv = PTHREAD_COND_INITIALIZER; /* some record completed */

void pm__hb_rec_unref_locked(hb_rec_t *r) {
  if (r && --r->refs == 0) free(r);
}

pthread_mutex_t pm__hb_obj_lock = PTHREAD_MUTEX_INITIALIZER;
hb_set_t pm__hb_stream_set, pm__hb_event_set;
/* Per device, guarded by pm__hb_obj_lock; created on first use. */
static struct pm_stream_s *default_stream[PM__HB_MAX_DEVICES];

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

bool pm__hb_set_has(const hb_set_t *s, const void *p) {
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

void pm__hb_set_del(hb_set_t *s, const void *p) {
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
      pthread_mutex_lock(&pm__hb_rec_lock);
      op->u.rec->done = true;
      op->u.rec->t_done = now;
      pthread_cond_broadcast(&pm__hb_rec_cv);
      pm__hb_rec_unref_locked(op->u.rec);
      pthread_mutex_unlock(&pm__hb_rec_lock);
      break;
    }
    case OP_WAIT:
      pthread_mutex_lock(&pm__hb_rec_lock);
      while (!op->u.rec->done) pthread_cond_wait(&pm__hb_rec_cv, &pm__hb_rec_lock);
      pm__hb_rec_unref_locked(op->u.rec);
      pthread_mutex_unlock(&pm__hb_rec_lock);
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
      /* Complete the event and count the op done in one step under s->mu (then pm__hb_rec_lock, the
       * order pm__hb_event_record uses): whoever sees the event complete sees the stream past it,
       * and whoever sees the stream synchronized sees the event complete, as CUDA guarantees. */
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
  s->device = pm__hb_current();
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

bool pm__hb_on_own_worker(const struct pm_stream_s *s) {
  return pthread_equal(pthread_self(), s->thread);
}

/* With pm__hb_obj_lock held: the stream behind a handle. NULL is the default stream, created here
 * on first use when `create` (otherwise *out is NULL while it does not exist yet). */
pm_status_t pm__hb_stream_lookup_locked(const char *fn, pm_stream_t h, bool create,
                                        struct pm_stream_s **out) {
  if (!h) {
    struct pm_stream_s **d = &default_stream[pm__hb_current()];
    if (!*d && create) {
      pm_status_t st = stream_new(d);
      if (st != PM_OK) return pm__wrap_error(st, "%s: creating the default stream", fn);
    }
    *out = *d;
    return PM_OK;
  }
  if (!pm__hb_set_has(&pm__hb_stream_set, h))
    return pm__set_error(PM_ERR_INVALID,
                         "%s: stream %p was destroyed (or was not created by the host backend)", fn,
                         (void *)h);
  *out = h;
  return PM_OK;
}

/* With pm__hb_obj_lock held: take the stream's lock, then drop pm__hb_obj_lock. */
void pm__hb_stream_enter(struct pm_stream_s *s) {
  pthread_mutex_lock(&s->mu);
  pthread_mutex_unlock(&pm__hb_obj_lock);
}

void pm__hb_enqueue_locked(struct pm_stream_s *s, hb_op_t *op) {
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

void pm__hb_user_leave_locked(struct pm_stream_s *s) {
  if (--s->users == 0 && s->closing) pthread_cond_broadcast(&s->cv_state);
}

pm_status_t pm__hb_set_publish(hb_set_t *set, const void *p) {
  pthread_mutex_lock(&pm__hb_obj_lock);
  pm_status_t st = set_add(set, p);
  pthread_mutex_unlock(&pm__hb_obj_lock);
  return st;
}

pm_status_t pm__hb_event_lookup_locked(const char *fn, pm_event_t ev) {
  if (!ev) return pm__set_error(PM_ERR_INVALID, "%s: event is NULL", fn);
  if (!pm__hb_set_has(&pm__hb_event_set, ev))
    return pm__set_error(PM_ERR_INVALID,
                         "%s: event %p was destroyed (or was not created by the host backend)", fn,
                         (void *)ev);
  return PM_OK;
}

pm_status_t pm__hb_stream_find(const char *fn, pm_stream_t h, pm_event_t ev, hb_op_t *op,
                               struct pm_stream_s **out) {
  pthread_mutex_lock(&pm__hb_obj_lock);
  pm_status_t st = ev ? pm__hb_event_lookup_locked(fn, ev) : PM_OK;
  if (st == PM_OK) st = pm__hb_stream_lookup_locked(fn, h, true, out);
  if (st != PM_OK) {
    pthread_mutex_unlock(&pm__hb_obj_lock);
    free(op);
  }
  return st;
}

void pm__hb_queue(struct pm_stream_s *s, hb_op_t *op) {
  pm__hb_stream_enter(s);
  pm__hb_enqueue_locked(s, op);
  pthread_mutex_unlock(&s->mu);
}

/* Queue op on the stream; on failure the op is freed. */
int pm__hb_stream_device(pm_stream_t h) {
  if (!h) return pm__hb_current();
  pthread_mutex_lock(&pm__hb_obj_lock);
  int dev = pm__hb_set_has(&pm__hb_stream_set, h) ? h->device : -1;
  pthread_mutex_unlock(&pm__hb_obj_lock);
  return dev;
}

pm_status_t pm__hb_submit(const char *fn, pm_stream_t h, hb_op_t *op) {
  struct pm_stream_s *s = NULL;
  pm_status_t st = pm__hb_stream_find(fn, h, NULL, op, &s);
  if (st != PM_OK) return st;
  pm__hb_queue(s, op);
  return PM_OK;
}

hb_op_t *pm__hb_op_new(const char *fn, hb_op_kind_t kind) {
  hb_op_t *op = calloc(1, sizeof *op);
  if (!op) {
    pm__set_error(PM_ERR_NOMEM, "%s: out of memory for a stream op", fn);
    return NULL;
  }
  op->kind = kind;
  return op;
}

pm_status_t pm__hb_stream_create(pm_stream_t *stream_out) {
  pm__hb_count_call();
  if (!stream_out) return pm__set_error(PM_ERR_INVALID, "stream_create: stream_out is NULL");
  struct pm_stream_s *s = NULL;
  pm_status_t st = stream_new(&s);
  if (st != PM_OK) return st;
  st = pm__hb_set_publish(&pm__hb_stream_set, s);
  if (st != PM_OK) {
    stream_free(s);
    return pm__wrap_error(st, "stream_create");
  }
  *stream_out = s;
  return PM_OK;
}

pm_status_t pm__hb_stream_destroy(pm_stream_t h) {
  pm__hb_count_call();
  if (!h) return pm__set_error(PM_ERR_INVALID, "stream_destroy: NULL is the default stream");
  pthread_mutex_lock(&pm__hb_obj_lock);
  struct pm_stream_s *s = NULL;
  pm_status_t st = pm__hb_stream_lookup_locked("stream_destroy", h, false, &s);
  if (st == PM_OK && pm__hb_on_own_worker(s))
    st = pm__set_error(PM_ERR_STATE,
                       "stream_destroy(%p): called from a host function running on that stream",
                       (void *)h);
  if (st == PM_OK) pm__hb_set_del(&pm__hb_stream_set, s);
  pthread_mutex_unlock(&pm__hb_obj_lock);
  if (st != PM_OK) return st;
  stream_free(s);
  return PM_OK;
}

pm_status_t pm__hb_stream_synchronize(pm_stream_t h) {
  pm__hb_count_call();
  struct pm_stream_s *s = NULL;
  pthread_mutex_lock(&pm__hb_obj_lock);
  pm_status_t st = pm__hb_stream_lookup_locked("stream_synchronize", h, false, &s);
  if (st == PM_OK && s && pm__hb_on_own_worker(s))
    st = pm__set_error(PM_ERR_STATE,
                       "stream_synchronize(%p): called from a host function "
                       "running on that stream (it would wait for itself)",
                       (void *)h);
  if (st != PM_OK || !s) {
    pthread_mutex_unlock(&pm__hb_obj_lock);
    return st;
  }
  pm__hb_stream_enter(s);
  s->users++;
  wait_done_locked(s, s->submitted);
  pm__hb_user_leave_locked(s);
  pthread_mutex_unlock(&s->mu);
  return PM_OK;
}

pm_status_t pm__hb_stream_query(pm_stream_t h) {
  pm__hb_count_call();
  struct pm_stream_s *s = NULL;
  pthread_mutex_lock(&pm__hb_obj_lock);
  pm_status_t st = pm__hb_stream_lookup_locked("stream_query", h, false, &s);
  if (st != PM_OK || !s) {
    pthread_mutex_unlock(&pm__hb_obj_lock);
    return st;
  }
  pm__hb_stream_enter(s);
  st = s->done == s->submitted ? PM_OK : PM_NOT_READY;
  pthread_mutex_unlock(&s->mu);
  return st;
}

/* ------------------------------------------------------------------------------------------ */
/* Lifecycle and devices                                                                       */
/* ------------------------------------------------------------------------------------------ */

pm_status_t pm__hb_init(void) {
  pm__hb_devices_start();
  return PM_OK; /* everything else starts lazily */
}

void pm__hb_shutdown(void) {
  struct pm_stream_s *s[PM__HB_MAX_DEVICES];
  pthread_mutex_lock(&pm__hb_obj_lock);
  for (int d = 0; d < PM__HB_MAX_DEVICES; d++) {
    s[d] = default_stream[d];
    default_stream[d] = NULL;
  }
  set_release_if_empty(&pm__hb_stream_set);
  set_release_if_empty(&pm__hb_event_set);
  pthread_mutex_unlock(&pm__hb_obj_lock);
  for (int d = 0; d < PM__HB_MAX_DEVICES; d++)
    if (s[d]) stream_free(s[d]);
  pm__hb_memory_shutdown();
}

pm_status_t pm__hb_device_synchronize(void) {
  pm__hb_count_call();
  return pm__hb_sync_streams("device_synchronize", pm__hb_current());
}

pm_status_t pm__hb_sync_streams(const char *fn, int device) {
  typedef struct {
    struct pm_stream_s *s;
    uint64_t target;
  } hb_wait_t;
  pthread_mutex_lock(&pm__hb_obj_lock);
  size_t cap = pm__hb_stream_set.n + PM__HB_MAX_DEVICES, n = 0;
  hb_wait_t *w = malloc(cap * sizeof *w);
  if (!w) {
    pthread_mutex_unlock(&pm__hb_obj_lock);
    return pm__set_error(PM_ERR_NOMEM, "%s: out of memory for %zu streams", fn, cap);
  }
  for (size_t i = 0; i < cap; i++) {
    struct pm_stream_s *s = i < pm__hb_stream_set.n ? (struct pm_stream_s *)pm__hb_stream_set.v[i]
                                                    : default_stream[i - pm__hb_stream_set.n];
    if (!s || (device >= 0 && s->device != device)) continue;
    if (pm__hb_on_own_worker(s)) {
      pthread_mutex_unlock(&pm__hb_obj_lock);
      free(w);
      return pm__set_error(PM_ERR_STATE,
                           "%s: called from a host function running on a stream (it would wait "
                           "for itself)",
                           fn);
    }
    w[n++].s = s;
  }
  /* Count ourselves as a user of every stream so none is freed while we wait on it. */
  for (size_t i = 0; i < n; i++) {
    struct pm_stream_s *s = w[i].s;
    pthread_mutex_lock(&s->mu);
    s->users++;
    w[i].target = s->submitted;
    pthread_mutex_unlock(&s->mu);
  }
  pthread_mutex_unlock(&pm__hb_obj_lock);
  for (size_t i = 0; i < n; i++) {
    pthread_mutex_lock(&w[i].s->mu);
    wait_done_locked(w[i].s, w[i].target);
    pm__hb_user_leave_locked(w[i].s);
    pthread_mutex_unlock(&w[i].s->mu);
  }
  free(w);
  return PM_OK;
}

/* fork.c: in a forked child no stream worker runs and nothing is mlock'd (locks of memory are not
 * inherited), so the child starts with empty tables and creates its own streams; the parent's
 * streams, events and allocations are unknown to it (a call on one is an error, not a hang). */
static struct pm_stream_s *parent_default_stream[PM__HB_MAX_DEVICES]; /* left behind, reachable */

void pm__host_atfork(pm__fork_phase_t phase) {
  if (phase == PM__FORK_PREPARE) {
    pthread_mutex_lock(&pm__hb_obj_lock);
    pthread_mutex_lock(&pm__hb_rec_lock);
    pm__hb_memory_atfork(phase);
  } else if (phase == PM__FORK_PARENT) {
    pm__hb_memory_atfork(phase);
    pthread_mutex_unlock(&pm__hb_rec_lock);
    pthread_mutex_unlock(&pm__hb_obj_lock);
  } else {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t fresh_cv = PTHREAD_COND_INITIALIZER;
    pm__hb_obj_lock = fresh;
    pm__hb_rec_lock = fresh;
    pm__hb_rec_cv = fresh_cv;
    pm__hb_memory_atfork(phase);
    pm__hb_stream_set.n = 0;
    pm__hb_event_set.n = 0;
    memcpy(parent_default_stream, default_stream, sizeof default_stream);
    memset(default_stream, 0, sizeof default_stream);
  }
}
