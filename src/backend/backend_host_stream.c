/*
 * DESIGN: the host backend's stream and event engine (the backend as a whole: backend_host.h;
 * its memory: backend_host_memory.c). The CPU plays the device, so the whole API and every test
 * run on a machine without a GPU. It models the cuda backend's ordering rules, not its speed.
 *
 * - Memory (pinned, device, managed) is backend_host_memory.c's: its tables say whether a copy
 *   touches pageable memory, and which spans are device memory.
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

#define HB_BUSY_MAX_SECONDS 1.0e6 /* same bound as the cuda backend */

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
/* Device and managed memory release                                                           */
/* ------------------------------------------------------------------------------------------ */

static pm_status_t device_synchronize(void);

static pm_status_t device_release(const char *fn, void *ptr) {
  if (!ptr) return pm__set_error(PM_ERR_INVALID, "%s: ptr is NULL", fn);
  /* cudaFree synchronizes the device before it returns memory: queued copies and kernels that
   * still use it finish first. Model that, so freeing after a failed or skipped stream
   * synchronize cannot pull memory out from under a stream's worker. */
  pm_status_t sync = device_synchronize();
  if (sync != PM_OK) return pm__wrap_error(sync, "%s(%p)", fn, ptr);
  return pm__hb_device_release(fn, ptr);
}

static pm_status_t device_free(void *dptr) {
  return device_release("device_free", dptr);
}

static pm_status_t managed_free(void *ptr) {
  return device_release("managed_free", ptr);
}

/* ------------------------------------------------------------------------------------------ */
/* Copies, memset, prefetch, busy, host functions                                              */
/* ------------------------------------------------------------------------------------------ */

static pm_status_t check_side(const char *fn, pm_copy_kind_t kind, const char *what,
                              const void *ptr, size_t bytes, const hb_side_t *sd, bool want_dev) {
  if (want_dev && !hb_in_dev(sd))
    return pm__set_error(PM_ERR_INVALID,
                         "%s: copy kind %s but the %s %p is not device memory of the host backend",
                         fn, pm__copy_kind_name(kind), what, ptr);
  if (!want_dev && sd->kind == PM__MEM_DEVICE)
    return pm__set_error(PM_ERR_INVALID, "%s: copy kind %s but the %s %p is device memory", fn,
                         pm__copy_kind_name(kind), what, ptr);
  if (hb_in_dev(sd) && !sd->fits)
    return pm__set_error(PM_ERR_INVALID,
                         "%s: the %s [%p, +%zu) runs past the end of its %s [%p, +%zu)", fn, what,
                         ptr, bytes, pm__hb_range_desc(sd->dev.kind), (void *)sd->dev.base, sd->dev.size);
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
  pm__hb_classify(dst, src, bytes, &d, &s);

  if (*kind == PM_COPY_DEFAULT)
    *kind =
        hb_in_dev(&s) ? (hb_in_dev(&d) ? PM_COPY_D2D : PM_COPY_D2H)
                      : (hb_in_dev(&d) ? PM_COPY_H2D : PM_COPY_H2H);
  bool dst_dev = *kind == PM_COPY_H2D || *kind == PM_COPY_D2D;
  bool src_dev = *kind == PM_COPY_D2H || *kind == PM_COPY_D2D;
  pm_status_t st = check_side(fn, *kind, "destination", dst, bytes, &d, dst_dev);
  if (st == PM_OK) st = check_side(fn, *kind, "source", src, bytes, &s, src_dev);
  if (st != PM_OK) return st;
  /* Managed memory is never pageable: the driver handles it on either side. */
  *blocking_out = *kind == PM_COPY_H2H || (!dst_dev && d.kind == PM__MEM_PAGEABLE) ||
                  (!src_dev && s.kind == PM__MEM_PAGEABLE);
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
  pm_status_t st = pm__hb_check_device_span(fn, "destination", dptr, bytes, -1);
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
  pm_status_t st = pm__hb_check_device_span(fn, "range", ptr, bytes, R_MANAGED);
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
  pm__hb_memory_shutdown();
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
    .device_count = pm__hb_device_count,
    .device_info = pm__hb_device_info,
    .set_device = pm__hb_set_device,
    .get_device = pm__hb_get_device,
    .device_synchronize = device_synchronize,
    .host_alloc = pm__hb_host_alloc,
    .host_free = pm__hb_host_free,
    .host_register = pm__hb_host_register,
    .host_unregister = pm__hb_host_unregister,
    .host_device_pointer = pm__hb_host_device_pointer,
    .device_alloc = pm__hb_device_alloc,
    .device_free = device_free,
    .device_memset_async = device_memset_async,
    .managed_alloc = pm__hb_managed_alloc,
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
    .pointer_kind = pm__hb_pointer_kind,
};

/* fork.c: in a forked child no stream worker runs and nothing is mlock'd (locks of memory are not
 * inherited), so the child starts with empty tables and creates its own streams; the parent's
 * streams, events and allocations are unknown to it (a call on one is an error, not a hang). */
static struct pm_stream_s *parent_default_stream; /* left behind, still reachable */

void pm__host_atfork(pm__fork_phase_t phase) {
  if (phase == PM__FORK_PREPARE) {
    pthread_mutex_lock(&obj_lock);
    pthread_mutex_lock(&rec_lock);
    pm__hb_memory_atfork(phase);
  } else if (phase == PM__FORK_PARENT) {
    pm__hb_memory_atfork(phase);
    pthread_mutex_unlock(&rec_lock);
    pthread_mutex_unlock(&obj_lock);
  } else {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t fresh_cv = PTHREAD_COND_INITIALIZER;
    obj_lock = fresh;
    rec_lock = fresh;
    rec_cv = fresh_cv;
    pm__hb_memory_atfork(phase);
    stream_set.n = 0;
    event_set.n = 0;
    parent_default_stream = default_stream;
    default_stream = NULL;
  }
}
