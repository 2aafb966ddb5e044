/*
 * DESIGN: the copy engine: pm_copy_async, pm_copy_batch_async and their fences.
 *
 * Path choice. The registry says what each host pointer is (pm_pointer_query); for an address
 * it does not track, the backend (pointer_kind: device memory of another allocator, or host
 * memory another library pinned). Pinned, registered or managed host memory, whoever pinned it,
 * and device memory take the direct path: one pm_memcpy_async on the caller's stream and
 * nothing else, unless a fence or a callback was asked for (then one event, plus one host
 * function for a callback). Pageable host memory of at least copy_stage_min bytes
 * is staged (copy_stage.c); smaller pageable copies take the plain backend copy, whose fixed
 * costs are lower than staging's. options->path forces a path.
 *
 * What each path blocks on: direct: nothing. Staged H2D: until the source was read (it may be
 * changed after the return), never on the stream's earlier work (ring, chosen by copy_bounce or
 * forced by the budget: the call also waits for reused slots' DMAs, hence for the stream).
 * Staged D2H through the whole block (copy_bounce=whole, or auto behind queued work): nothing;
 * a completion thread copies the bytes out once their DMAs land, and the stream's later work
 * waits for that. Through the ring (ring, or auto on an idle stream, the default): the whole
 * copy happens inside the call, which returns with the bytes in dst. Plain pageable copies
 * block as the backend's own copy does.
 *
 * Fences. A fence is a refcounted object: the user's handle (if fence_out was given), the
 * engine's reference while completion work is pending (a callback or a D2H copy-out), and the
 * stream gate's. Its event is recorded on the stream after everything the copy queued, so
 * pm_fence_stream_wait is one stream-wait-event. A staged D2H copy queues, behind its DMAs, a
 * host function (the gate) that returns once a completion thread copied the bytes out, and the
 * event comes after the gate: so the event, a stream synchronize and any later work on the
 * stream all mean "the bytes are in dst", and staged D2H copy-outs on one stream happen in
 * stream order. The gate starts only after every DMA it depends on, so it waits for CPU work
 * alone (as CUDA requires of host functions), and that work makes no backend call at all: a
 * backend call can wait behind another thread's synchronizing call (cudaFree) that waits for
 * the gate (copy_stage.c). The copy-out is in a completion thread's hands before the gate is
 * queued (submit_d2h_gate): otherwise a backend call of the submitter between the two could wait
 * behind such a synchronizing call and nobody would open the gate. Event calls on a gated fence
 * happen only after data_done. A fence with a callback or a copy-out is a "host" fence with
 * two steps under its mutex: data_done (every byte in place; the gate opens) and finished (the
 * callback returned too; without a callback, the same moment); pm_fence_query/pm_fence_wait
 * report finished. Live handles sit in a hash set, so a released or unknown fence is an error,
 * not a crash.
 *
 * Completion service: a queue served by detached threads that start on demand (one per job
 * waiting when none is idle, at most PM__CQ_MAX_THREADS) and exit after PM__CQ_IDLE_S idle.
 * Jobs: complete a fence (D2H copy-out, then the callback), free a fence whose last reference
 * was dropped inside a host function (no backend call may run there), and reap events that were
 * dropped while pending. Host functions only post jobs; they never call the backend. User
 * callbacks run on a completion thread with no lock held.
 *
 * Lock order: the handle set (handles.c), g_cq_mu, g_reap_mu and each fence's mu are leaves: no two are ever
 * held together, and none is held across a backend, pool or registry call or a user callback.
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include "copy_internal.h"

#define PM__CQ_MAX_THREADS 256
#define PM__CQ_IDLE_S 2
#define PM__SPIN_S 100e-6 /* event polling spins this long before it sleeps */

/* ---- options -------------------------------------------------------------------------------- */

/* The defaults and ranges are the option table's (config.c): 4 MiB chunks, 32 slots,
 * min(12, cores) threads, 8 MiB: staging loses to the plain pageable copy at 1 MiB and wins
 * from 8 MiB, and with slots filled in pieces 12 threads do as well as 16 while leaving cores
 * to the driver and the caller (the figures are in docs/performance.md). A lookup is an atomic
 * load of the cached value, cheap next to even a small copy's DMA. */
void pm__copy_cfg(pm__copy_cfg_t *cfg) {
  size_t chunk = pm__opt_size(PM__OPT_COPY_CHUNK);
  long slots = pm__opt_int(PM__OPT_COPY_SLOTS);
  if (chunk < 4096) chunk = 4096;
  cfg->chunk = chunk;
  cfg->slots = (int)slots;
  cfg->threads = (int)pm__opt_int(PM__OPT_COPY_THREADS);
  cfg->stage_min = pm__opt_size(PM__OPT_COPY_STAGE_MIN);
  cfg->bounce = (int)pm__opt_int(PM__OPT_COPY_BOUNCE);
  cfg->mover = (int)pm__opt_int(PM__OPT_COPY_MEMCPY);
  cfg->ramp = pm__opt_int(PM__OPT_COPY_RAMP) != 0;
  size_t piece = pm__opt_size(PM__OPT_COPY_PIECE);
  if (piece && piece < 4096) piece = 4096;
  cfg->piece = piece < chunk ? piece : 0; /* a piece as large as a slot is the plain ring */
  long piece_slots = pm__opt_int(PM__OPT_COPY_PIECE_SLOTS);
  cfg->piece_slots = piece_slots > 0 ? (int)piece_slots : (int)slots;
}

void pm_copy_options_init(pm_copy_options_t *options) {
  if (!options) return;
  memset(options, 0, sizeof *options);
  options->kind = PM_COPY_DEFAULT;
  options->path = PM_PATH_AUTO;
}

/* ---- completion service --------------------------------------------------------------------- */

enum { CQ_FENCE = 1, CQ_FREE_FENCE, CQ_REAPER };

typedef struct cq_node {
  struct cq_node *next;
  int type;
  void *ptr;
} cq_node_t;

static pthread_mutex_t g_cq_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cq_cv = PTHREAD_COND_INITIALIZER;
static cq_node_t *g_cq_head, *g_cq_tail;
static size_t g_cq_len;
static int g_cq_threads, g_cq_idle;
static bool g_cq_quit;                                         /* pm_finalize: idle threads go */
static pthread_cond_t g_cq_exit_cv = PTHREAD_COND_INITIALIZER; /* a completion thread left */

static void cq_run(cq_node_t *node);

static cq_node_t *cq_pop_locked(void) {
  cq_node_t *node = g_cq_head;
  g_cq_head = node->next;
  if (!g_cq_head) g_cq_tail = NULL;
  g_cq_len--;
  return node;
}

static void *cq_main(void *arg) {
  (void)arg;
#if defined(__linux__) && defined(PR_SET_TIMERSLACK)
  /* Completion threads sleep in short steps while they poll events: keep the steps short. */
  (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
#endif
  pthread_mutex_lock(&g_cq_mu);
  for (;;) {
    if (!g_cq_head) {
      struct timespec deadline;
      clock_gettime(CLOCK_REALTIME, &deadline);
      deadline.tv_sec += PM__CQ_IDLE_S;
      int rc = 0;
      g_cq_idle++;
      while (!g_cq_head && rc != ETIMEDOUT && !g_cq_quit)
        rc = pthread_cond_timedwait(&g_cq_cv, &g_cq_mu, &deadline);
      g_cq_idle--;
      if (!g_cq_head) {
        g_cq_threads--;
        pthread_cond_broadcast(&g_cq_exit_cv);
        pthread_mutex_unlock(&g_cq_mu);
        return NULL;
      }
    }
    cq_node_t *node = cq_pop_locked();
    pthread_mutex_unlock(&g_cq_mu);
    cq_run(node);
    pthread_mutex_lock(&g_cq_mu);
  }
}

/* Queue a job. Returns true once a completion thread will run it. If no completion thread can
 * be started at all: with `inline_ok` the caller runs the queue itself (a degraded mode that only
 * a thread-creation failure reaches) and true is returned; without it the job is taken back out
 * and false is returned (a D2H copy-out must run beside the caller, never inside it). */
static bool cq_post_ex(cq_node_t *node, int type, void *ptr, bool inline_ok) {
  node->next = NULL;
  node->type = type;
  node->ptr = ptr;
  bool spawn = false;
  pthread_mutex_lock(&g_cq_mu);
  if (g_cq_tail)
    g_cq_tail->next = node;
  else
    g_cq_head = node;
  g_cq_tail = node;
  g_cq_len++;
  if (g_cq_len > (size_t)g_cq_idle && g_cq_threads < PM__CQ_MAX_THREADS) {
    g_cq_threads++;
    spawn = true;
  }
  pthread_cond_signal(&g_cq_cv);
  pthread_mutex_unlock(&g_cq_mu);
  if (!spawn) return true;

  pthread_attr_t attr;
  pthread_t tid;
  int rc = pthread_attr_init(&attr);
  if (rc == 0) {
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    rc = pthread_create(&tid, &attr, cq_main, NULL);
    pthread_attr_destroy(&attr);
  }
  if (rc == 0) return true;
  pthread_mutex_lock(&g_cq_mu);
  g_cq_threads--;
  bool alone = g_cq_threads == 0;
  if (alone && !inline_ok) {
    /* Take the node back out: nobody else can have popped it, as no thread runs. */
    cq_node_t **pp = &g_cq_head, *prev = NULL;
    while (*pp && *pp != node) {
      prev = *pp;
      pp = &(*pp)->next;
    }
    if (*pp) {
      *pp = node->next;
      if (g_cq_tail == node) g_cq_tail = prev;
      g_cq_len--;
    }
    pthread_mutex_unlock(&g_cq_mu);
    return false;
  }
  pthread_mutex_unlock(&g_cq_mu);
  while (alone) {
    pthread_mutex_lock(&g_cq_mu);
    cq_node_t *next = g_cq_head ? cq_pop_locked() : NULL;
    pthread_mutex_unlock(&g_cq_mu);
    if (!next) break;
    cq_run(next);
  }
  return true;
}

static void cq_post(cq_node_t *node, int type, void *ptr) {
  (void)cq_post_ex(node, type, ptr, true);
}

void pm__copy_shutdown(void) {
  /* Completion threads are detached and leave after a short idle time; at pm_finalize they go
   * at once, once the queue is empty, so leak checkers see no thread of ours still running. */
  pthread_mutex_lock(&g_cq_mu);
  g_cq_quit = true;
  pthread_cond_broadcast(&g_cq_cv);
  while (g_cq_threads > 0) pthread_cond_wait(&g_cq_exit_cv, &g_cq_mu);
  g_cq_quit = false;
  pthread_mutex_unlock(&g_cq_mu);
  /* The last ones have only their return left to run; give them that moment. */
  struct timespec ms = {0, 1000000};
  nanosleep(&ms, NULL);
}

/* ---- events --------------------------------------------------------------------------------- */

/* Poll first (a copy's next event is usually microseconds away, and a sleep costs at least the
 * kernel's timer slack, 50 us by default), then sleep with a growing interval. */
pm_status_t pm__copy_wait_event(pm_event_t event, unsigned max_sleep_us) {
  double spin_until = 0;
  unsigned us = 10;
  for (;;) {
    pm_status_t st = pm_event_query(event);
    if (st != PM_NOT_READY) return st;
    double now = pm__now();
    if (spin_until == 0) spin_until = now + PM__SPIN_S;
    if (now < spin_until) {
      sched_yield();
      continue;
    }
    struct timespec ts = {0, (long)us * 1000};
    nanosleep(&ts, NULL);
    us = us * 2 > max_sleep_us ? max_sleep_us : us * 2;
  }
}

typedef struct reap_node {
  struct reap_node *next;
  pm_event_t ev;
} reap_node_t;

static pthread_mutex_t g_reap_mu = PTHREAD_MUTEX_INITIALIZER;
static reap_node_t *g_reap;
static bool g_reaper_on;
static cq_node_t g_reaper_node;

void pm__copy_reap_event(pm_event_t event) {
  if (!event) return;
  if (pm_event_query(event) != PM_NOT_READY) {
    (void)pm_event_destroy(event);
    return;
  }
  reap_node_t *r = malloc(sizeof *r);
  if (!r) {
    (void)pm_event_synchronize(event);
    (void)pm_event_destroy(event);
    return;
  }
  r->ev = event;
  pthread_mutex_lock(&g_reap_mu);
  r->next = g_reap;
  g_reap = r;
  bool start = !g_reaper_on;
  g_reaper_on = true;
  pthread_mutex_unlock(&g_reap_mu);
  if (start) cq_post(&g_reaper_node, CQ_REAPER, NULL);
}

/* One reaper at a time polls every pending event, so a stuck stream holds one thread, not one
 * per dropped event. */
static void reaper_run(void) {
  unsigned us = 20;
  for (;;) {
    pthread_mutex_lock(&g_reap_mu);
    reap_node_t *list = g_reap;
    g_reap = NULL;
    if (!list) g_reaper_on = false;
    pthread_mutex_unlock(&g_reap_mu);
    if (!list) return;
    reap_node_t *keep = NULL, *keep_tail = NULL;
    while (list) {
      reap_node_t *r = list;
      list = r->next;
      if (pm_event_query(r->ev) != PM_NOT_READY) {
        (void)pm_event_destroy(r->ev);
        free(r);
      } else {
        r->next = keep;
        keep = r;
        if (!keep_tail) keep_tail = r;
      }
    }
    if (keep) {
      pthread_mutex_lock(&g_reap_mu);
      keep_tail->next = g_reap;
      g_reap = keep;
      pthread_mutex_unlock(&g_reap_mu);
      struct timespec ts = {0, (long)us * 1000};
      nanosleep(&ts, NULL);
      us = us * 2 > 2000 ? 2000 : us * 2;
    }
  }
}

/* fork.c: completion threads and the reaper are the parent's; in a child none runs, so the queue
 * (the parent's fences and copy-outs, foreign here) is dropped and new threads start on demand. */
static cq_node_t *parent_cq_head; /* left behind, still reachable */
static reap_node_t *parent_reap;

void pm__copy_atfork(pm__fork_phase_t phase) {
  if (phase == PM__FORK_PREPARE) {
    pthread_mutex_lock(&g_cq_mu);
    pthread_mutex_lock(&g_reap_mu);
  } else if (phase == PM__FORK_PARENT) {
    pthread_mutex_unlock(&g_reap_mu);
    pthread_mutex_unlock(&g_cq_mu);
  } else {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t fresh_cv = PTHREAD_COND_INITIALIZER;
    g_cq_mu = fresh;
    g_reap_mu = fresh;
    g_cq_cv = fresh_cv;
    g_cq_exit_cv = fresh_cv;
    parent_cq_head = g_cq_head;
    parent_reap = g_reap;
    g_cq_head = g_cq_tail = NULL;
    g_cq_len = 0;
    g_cq_threads = g_cq_idle = 0;
    g_cq_quit = false;
    g_reap = NULL; /* events of the parent's streams */
    g_reaper_on = false;
  }
}

/* ---- fences --------------------------------------------------------------------------------- */

struct pm_fence_s {
  atomic_int refs;
  pm_copy_path_t path;
  pm_event_t event;        /* recorded after the last DMA; NULL if nothing was queued */
  bool host;               /* completion also needs the completion service (callback, copy-out) */
  pm__d2h_job_t *job;      /* staged D2H copy-out, until the completion thread takes it */
  pm__d2h_job_t *gate_job; /* the same, for the gate (never cleared) */
  void (*cb)(void *arg, pm_status_t status);
  void *cb_arg;
  cq_node_t node;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool armed;     /* under mu: the submitting call is over (set at once unless staged D2H) */
  bool cancelled; /* under mu: that call failed, so no callback runs */
  bool data_done; /* under mu */
  bool finished;  /* under mu */
  pm_status_t status;
  char msg[256];
};

static pm_status_t fence_new(pm_copy_path_t path, bool with_event, const pm_copy_options_t *opt,
                             pm_fence_t *out) {
  pm_fence_t f = calloc(1, sizeof *f);
  if (!f) return pm__set_error(PM_ERR_NOMEM, "malloc of a fence failed");
  if (with_event) {
    pm_status_t st = pm_event_create(PM_EVENT_DEFAULT, &f->event);
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

static void fence_free(pm_fence_t f) {
  pm__copy_reap_event(f->event);
  pthread_mutex_destroy(&f->mu);
  pthread_cond_destroy(&f->cv);
  free(f);
}

static void fence_unref(pm_fence_t f, bool in_host_func) {
  if (atomic_fetch_sub_explicit(&f->refs, 1, memory_order_acq_rel) != 1) return;
  if (in_host_func)
    cq_post(&f->node, CQ_FREE_FENCE, f); /* event calls are not allowed in a host function */
  else
    fence_free(f);
}

/* Completion thread: finish the copy-out, open the gates, run the callback. */
static void fence_complete(pm_fence_t f) {
  pm_status_t st = PM_OK;
  char msg[sizeof f->msg] = "";
  if (f->job) {
    st = pm__stage_d2h_finish(f->job, msg, sizeof msg);
    f->job = NULL;
  } else if (f->event) {
    st = pm_event_query(f->event);
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
  fence_unref(f, false);
}

/* Host function behind a direct / staged-H2D copy with a callback: hand over to a thread. */
static void fence_notify(void *arg) {
  pm_fence_t f = arg;
  cq_post(&f->node, CQ_FENCE, f);
}

/* Host function that holds a stream behind a staged D2H copy until its copy-out is done. */
static void fence_gate(void *arg) {
  pm_fence_t f = arg;
  pm__stage_d2h_dmas_done(f->gate_job); /* the stream got here: every DMA of the copy landed */
  pthread_mutex_lock(&f->mu);
  while (!f->data_done) pthread_cond_wait(&f->cv, &f->mu);
  pthread_mutex_unlock(&f->mu);
  fence_unref(f, true);
}

static void cq_run(cq_node_t *node) {
  switch (node->type) {
    case CQ_FENCE:
      fence_complete(node->ptr);
      break;
    case CQ_FREE_FENCE:
      fence_free(node->ptr);
      break;
    case CQ_REAPER:
      reaper_run();
      break;
    default:
      break;
  }
}

/* ---- live fence handles (handles.c) ---------------------------------------------------- */

static pm_status_t live_add(pm_fence_t f) { return pm__handle_add(f, PM__HANDLE_FENCE); }
static bool live_remove(pm_fence_t f) { return pm__handle_remove(f, PM__HANDLE_FENCE); }

static pm_status_t fence_check(pm_fence_t f, const char *fn) {
  return pm__handle_check(f, PM__HANDLE_FENCE, fn);
}

/* ---- public fence calls --------------------------------------------------------------------- */

pm_status_t pm_fence_query(pm_fence_t fence) {
  pm_status_t st = fence_check(fence, "pm_fence_query");
  if (st != PM_OK) return st;
  if (fence->event) {
    st = pm_event_query(fence->event);
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
    st = pm_event_synchronize(fence->event);
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
  st = pm_stream_wait_event(stream, fence->event);
  return st == PM_OK ? PM_OK : pm__wrap_error(st, "pm_fence_stream_wait");
}

pm_status_t pm_fence_release(pm_fence_t fence) {
  if (!fence) return pm__set_error(PM_ERR_INVALID, "pm_fence_release: fence is NULL");
  if (!live_remove(fence))
    return pm__set_error(PM_ERR_INVALID,
                         "pm_fence_release: fence %p is unknown or was already released",
                         (void *)fence);
  fence_unref(fence, false);
  return PM_OK;
}

pm_status_t pm_fence_path(pm_fence_t fence, pm_copy_path_t *path_out) {
  pm_status_t st = fence_check(fence, "pm_fence_path");
  if (st != PM_OK) return st;
  if (!path_out) return pm__set_error(PM_ERR_INVALID, "pm_fence_path: path_out is NULL");
  *path_out = fence->path;
  return PM_OK;
}

/* ---- validation and classification ---------------------------------------------------------- */

/* Where an error happened: "pm_copy_async" or "pm_copy_batch_async: item 7". */
typedef struct where {
  const char *fn;
  size_t item; /* SIZE_MAX: not a batch */
} where_t;

static const char *where_str(where_t w, char *buf, size_t len) {
  if (w.item == SIZE_MAX)
    snprintf(buf, len, "%s", w.fn);
  else
    snprintf(buf, len, "%s: item %zu", w.fn, w.item);
  return buf;
}

/* SIDE_PINNED_RO: registered with PM_REGISTER_READ_ONLY (the device may only read it).
 * SIDE_PINNED_OTHER: page-locked by another library (cudaHostAlloc, cudaHostRegister, PyTorch's
 * pin_memory), as the backend reports it: one DMA like pinmem's own, but never a kernel's
 * (whether it is mapped for kernels is not known).
 * SIDE_PINNED_PART: starts in such memory and runs on past it. CUDA refuses a DMA over that
 * range (cudaErrorInvalidValue, seen on the H200), so it is staged whatever its size. */
typedef enum side_kind {
  SIDE_PAGEABLE,
  SIDE_PINNED,
  SIDE_PINNED_RO,
  SIDE_PINNED_OTHER,
  SIDE_PINNED_PART,
  SIDE_MANAGED,
  SIDE_DEVICE
} side_kind_t;

static const char *side_name(side_kind_t k) {
  switch (k) {
    case SIDE_PAGEABLE:
      return "pageable host";
    case SIDE_PINNED:
      return "pinned host";
    case SIDE_PINNED_RO:
      return "read-only registered host";
    case SIDE_PINNED_OTHER:
      return "pinned host (pinned outside pinmem)";
    case SIDE_PINNED_PART:
      return "host, pinned outside pinmem in part";
    case SIDE_MANAGED:
      return "managed";
    case SIDE_DEVICE:
      return "device";
  }
  return "?";
}


/* The last tracked range a lookup hit: consecutive batch items mostly fall in the same block. */
typedef struct qcache {
  bool valid;
  uintptr_t base;
  size_t size;
  side_kind_t kind;
} qcache_t;

/* An address the registry does not track, as the backend sees it. Pinned memory of another
 * library takes the direct path when the copy's last byte is pinned too (the backend gives no
 * extent; a second query is cheap: docs/performance.md, small copies); a range running on past
 * it is staged. */
static side_kind_t foreign_side(const pm__backend_t *b, const void *p, size_t bytes) {
  int k = b->pointer_kind(p);
  if (k == PM__PTR_DEVICE) return SIDE_DEVICE;
  if (k != PM__PTR_PINNED) return SIDE_PAGEABLE;
  if (bytes > 1 && b->pointer_kind((const char *)p + bytes - 1) != PM__PTR_PINNED)
    return SIDE_PINNED_PART;
  return SIDE_PINNED_OTHER;
}

static pm_status_t classify(const pm__backend_t *b, const void *p, size_t bytes, const char *name,
                            where_t w, qcache_t *cache, side_kind_t *out) {
  uintptr_t a = (uintptr_t)p;
  char wb[96];
  if (cache && cache->valid && a >= cache->base && a - cache->base <= cache->size &&
      bytes <= cache->size - (a - cache->base)) {
    *out = cache->kind;
    return PM_OK;
  }
  pm_pointer_info_t info;
  pm_status_t st = pm_pointer_query(p, &info);
  if (st != PM_OK) return pm__wrap_error(st, "%s: %s %p", where_str(w, wb, sizeof wb), name, p);
  side_kind_t k;
  switch (info.kind) {
    case PM_MEMORY_PAGEABLE:
      /* Device memory of other allocators, and host memory other libraries pinned, are unknown
       * to the registry; the backend knows them. */
      *out = foreign_side(b, p, bytes);
      return PM_OK;
    case PM_MEMORY_POOL:
      if (!info.in_use)
        return pm__set_error(PM_ERR_STATE, "%s: %s %p lies in a pool block that was freed",
                             where_str(w, wb, sizeof wb), name, p);
      k = SIDE_PINNED;
      break;
    case PM_MEMORY_REGISTERED:
      k = (info.flags & PM_REGISTER_READ_ONLY) ? SIDE_PINNED_RO : SIDE_PINNED;
      break;
    case PM_MEMORY_MANAGED:
      k = SIDE_MANAGED;
      break;
    case PM_MEMORY_DEVICE:
      k = SIDE_DEVICE;
      break;
    default:
      return pm__set_error(PM_ERR_INTERNAL, "%s: %s %p: unknown memory kind %d",
                           where_str(w, wb, sizeof wb), name, p, (int)info.kind);
  }
  uintptr_t base = (uintptr_t)info.base;
  if (info.size) {
    if (a < base || a - base > info.size || bytes > info.size - (a - base))
      return pm__set_error(PM_ERR_INVALID,
                           "%s: %s range [%p, +%zu bytes) runs past the end of its %s memory "
                           "(%p, %zu bytes)",
                           where_str(w, wb, sizeof wb), name, p, bytes, side_name(k), info.base,
                           info.size);
    if (cache) {
      cache->valid = true;
      cache->base = base;
      cache->size = info.size;
      cache->kind = k;
    }
  }
  *out = k;
  return PM_OK;
}

static bool can_host(side_kind_t k) {
  return k != SIDE_DEVICE;
}
static bool can_dev(side_kind_t k) {
  return k == SIDE_DEVICE || k == SIDE_MANAGED;
}
/* Memory a kernel can read (src) or write (dst) where it is (pinned host memory: where the
 * backend says so). Read-only registrations are never a kernel's destination: the device would
 * fault, where a DMA only fails. */
static bool can_kernel(side_kind_t k, bool write) {
  return k != SIDE_PAGEABLE && k != SIDE_PINNED_OTHER && k != SIDE_PINNED_PART &&
         !(write && k == SIDE_PINNED_RO);
}

static pm_status_t resolve_kind(pm_copy_kind_t asked, side_kind_t s, side_kind_t d, where_t w,
                                pm_copy_kind_t *out) {
  if (asked == PM_COPY_DEFAULT) {
    bool sd = s == SIDE_DEVICE, dd = d == SIDE_DEVICE;
    *out = sd ? (dd ? PM_COPY_D2D : PM_COPY_D2H) : (dd ? PM_COPY_H2D : PM_COPY_H2H);
    return PM_OK;
  }
  bool ok = false;
  switch (asked) {
    case PM_COPY_H2D:
      ok = can_host(s) && can_dev(d);
      break;
    case PM_COPY_D2H:
      ok = can_dev(s) && can_host(d);
      break;
    case PM_COPY_D2D:
      ok = can_dev(s) && can_dev(d);
      break;
    case PM_COPY_H2H:
      ok = can_host(s) && can_host(d);
      break;
    default:
      break;
  }
  if (!ok) {
    char wb[96];
    return pm__set_error(PM_ERR_INVALID,
                         "%s: kind %s contradicts the pointers: src is %s memory, "
                         "dst is %s memory",
                         where_str(w, wb, sizeof wb), pm__copy_kind_symbol(asked), side_name(s),
                         side_name(d));
  }
  *out = asked;
  return PM_OK;
}

/* NULL pointers, address wrap-around and overlapping ranges. */
static pm_status_t check_ranges(void *dst, const void *src, size_t bytes, where_t w) {
  char wb[96];
  if (!dst || !src)
    return pm__set_error(PM_ERR_INVALID, "%s: %s is NULL", where_str(w, wb, sizeof wb),
                         !dst ? "dst" : "src");
  uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
  if (bytes > UINTPTR_MAX - d || bytes > UINTPTR_MAX - s)
    return pm__set_error(PM_ERR_INVALID, "%s: %zu bytes from %p wraps the address space",
                         where_str(w, wb, sizeof wb), bytes, bytes > UINTPTR_MAX - d ? dst : src);
  if (d < s + bytes && s < d + bytes)
    return pm__set_error(PM_ERR_INVALID, "%s: src [%p, +%zu) and dst [%p, +%zu) overlap",
                         where_str(w, wb, sizeof wb), src, bytes, dst, bytes);
  return PM_OK;
}

static pm_status_t read_options(const pm_copy_options_t *options, const char *fn,
                                pm_copy_options_t *out) {
  if (!options) {
    pm_copy_options_init(out);
    return PM_OK;
  }
  if ((unsigned)options->kind > PM_COPY_H2H)
    return pm__set_error(PM_ERR_INVALID, "%s: options->kind %d is not a pm_copy_kind_t", fn,
                         (int)options->kind);
  if ((unsigned)options->path > PM_PATH_REGISTER)
    return pm__set_error(PM_ERR_INVALID, "%s: options->path %d is not a pm_copy_path_t", fn,
                         (int)options->path);
  if (options->path == PM_PATH_REGISTER)
    return pm__set_error(PM_ERR_UNSUPPORTED,
                         "%s: PM_PATH_REGISTER (register in place) is not supported: a cached "
                         "registration outlives a free of the buffer; use PM_PATH_AUTO or "
                         "PM_PATH_STAGED, or pm_register the buffer once",
                         fn);
  *out = *options;
  return PM_OK;
}

/* ---- submission ----------------------------------------------------------------------------- */

typedef pm_copy_item_t op_t; /* one plain backend copy */

static pm_status_t resolve_pool(pm_pool_t *pool, pm_pool_t **out) {
  if (pool) {
    *out = pool;
    return PM_OK;
  }
  pm_status_t st = pm_pool_default(out);
  return st == PM_OK ? PM_OK : pm__wrap_error(st, "default pool for bounce buffers");
}

/* A copy with nothing to move: the fence is complete at once; the callback still runs once. */
static pm_status_t submit_empty(const pm_copy_options_t *opt, pm_fence_t *fence_out) {
  if (!fence_out && !opt->callback) return PM_OK;
  pm_fence_t f;
  pm_status_t st = fence_new(PM_PATH_DIRECT, false, opt, &f);
  if (st != PM_OK) return st;
  f->data_done = true;
  f->finished = !f->cb;
  f->host = f->cb != NULL;
  atomic_init(&f->refs, (fence_out ? 1 : 0) + (f->host ? 1 : 0));
  if (fence_out) {
    st = live_add(f);
    if (st != PM_OK) {
      fence_free(f);
      return st;
    }
  }
  if (f->host) cq_post(&f->node, CQ_FENCE, f);
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
static pm_status_t submit_d2h_gate(pm_fence_t f, pm__d2h_job_t *job, pm_stream_t stream,
                                   pm_fence_t *fence_out) {
  atomic_fetch_add(&f->refs, 1); /* this call's own, so f outlives the waits below */
  f->armed = false;
  if (!cq_post_ex(&f->node, CQ_FENCE, f, false)) {
    pm__set_error(PM_ERR_NOMEM, "staged D2H copy: no completion thread could be started");
    pm__stage_d2h_abort(job, stream); /* nothing was copied out: dst is untouched */
    if (fence_out) live_remove(f);
    fence_free(f);
    return PM_ERR_NOMEM;
  }
  pm_status_t st = pm_launch_host_func(stream, fence_gate, f);
  if (st != PM_OK) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", pm_last_error());
    atomic_fetch_sub(&f->refs, 1); /* no gate will run */
    /* Every DMA and group signal is queued: once the stream passed them the copy-out can end.
     * If even that wait fails, the copy-out skips what it has not copied yet. */
    if (pm_stream_synchronize(stream) != PM_OK) pm__stage_d2h_discard(job);
    pm__stage_d2h_dmas_done(job);
    st = pm__set_error(st, "%s", msg);
  } else {
    st = pm_event_record(f->event, stream);
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
    if (fence_out && live_remove(f)) fence_unref(f, false); /* no handle */
    fence_unref(f, false);
    return pm__set_error(st, "%s", msg);
  }
  fence_unref(f, false);
  if (fence_out) *fence_out = f;
  return PM_OK;
}

/* Queue `direct` (plain backend copies) and stage `segs`, then set up the completion. */
static pm_status_t submit(pm_copy_kind_t kind, const op_t *direct, size_t ndirect, bool kernel_ok,
                          const pm__stage_seg_t *segs, size_t nsegs, pm_stream_t stream,
                          const pm_copy_options_t *opt, pm_fence_t *fence_out) {
  bool d2h_staged = nsegs && kind == PM_COPY_D2H;
  pm_fence_t f = NULL;
  pm__d2h_job_t *job = NULL;
  pm_status_t st = PM_OK;

  /* Everything that can fail without side effects comes before the first queued byte. */
  if (fence_out || opt->callback || d2h_staged) {
    st = fence_new(nsegs ? PM_PATH_STAGED : PM_PATH_DIRECT, true, opt, &f);
    if (st != PM_OK) return st;
    if (fence_out) {
      st = live_add(f);
      if (st != PM_OK) {
        fence_free(f);
        return st;
      }
    }
  }
  pm__stage_req_t req;
  if (nsegs) {
    memset(&req, 0, sizeof req);
    req.kind = kind;
    req.segs = segs;
    req.nsegs = nsegs;
    req.stream = stream;
    pm__copy_cfg(&req.cfg);
    st = resolve_pool(opt->pool, &req.pool);
    if (st != PM_OK) goto fail;
  }

  if (ndirect) {
    st = pm__memcpy_batch_async(direct, ndirect, kind, stream, kernel_ok);
    if (st != PM_OK) goto fail;
  }
  if (nsegs) {
    if (kind == PM_COPY_H2D)
      st = pm__stage_h2d(&req, NULL);
    else
      st = pm__stage_d2h_submit(&req, &job);
    if (st != PM_OK) goto fail;
  }
  if (!f) return PM_OK;

  /* The bytes are on their way: from here on, work handed to the stream must be seen through. */
  f->job = job;
  f->gate_job = job;
  f->host = job != NULL || f->cb != NULL;
  atomic_init(&f->refs, (fence_out ? 1 : 0) + (f->host ? 1 : 0) + (job ? 1 : 0));
  if (job) return submit_d2h_gate(f, job, stream, fence_out);
  st = pm_event_record(f->event, stream);
  if (st != PM_OK) goto fail;
  if (f->cb) {
    st = pm_launch_host_func(stream, fence_notify, f);
    if (st != PM_OK) goto fail;
  } else if (!fence_out) {
    fence_free(f); /* a D2H ring copy, done in the call, and nobody to tell */
    return PM_OK;
  }
  if (fence_out) *fence_out = f;
  return PM_OK;

fail : {
  char msg[512];
  snprintf(msg, sizeof msg, "%s", pm_last_error());
  if (f) {
    if (fence_out) live_remove(f);
    fence_free(f);
  }
  return pm__set_error(st, "%s", msg);
}
}

pm_status_t pm_copy_async(void *dst, const void *src, size_t bytes, pm_stream_t stream,
                          const pm_copy_options_t *options, pm_fence_t *fence_out) {
  where_t w = {"pm_copy_async", SIZE_MAX};
  pm_copy_options_t opt;
  pm_status_t st = read_options(options, w.fn, &opt);
  if (st != PM_OK) return st;
  st = check_ranges(dst, src, bytes, w);
  if (st != PM_OK) return st;
  PM__BACKEND_OR_RETURN(b);
  if (bytes == 0) return submit_empty(&opt, fence_out);

  side_kind_t s, d;
  st = classify(b, src, bytes, "src", w, NULL, &s);
  if (st != PM_OK) return st;
  st = classify(b, dst, bytes, "dst", w, NULL, &d);
  if (st != PM_OK) return st;
  pm_copy_kind_t kind;
  st = resolve_kind(opt.kind, s, d, w, &kind);
  if (st != PM_OK) return st;

  bool stage = false;
  if (kind == PM_COPY_H2D || kind == PM_COPY_D2H) {
    side_kind_t host = kind == PM_COPY_H2D ? s : d;
    if (opt.path == PM_PATH_STAGED) {
      stage = true;
    } else if (opt.path == PM_PATH_AUTO) {
      stage = host == SIDE_PINNED_PART ||
              (host == SIDE_PAGEABLE && bytes >= pm__opt_size(PM__OPT_COPY_STAGE_MIN));
    }
  } else if (opt.path == PM_PATH_STAGED) {
    return pm__set_error(PM_ERR_INVALID,
                         "pm_copy_async: PM_PATH_STAGED needs one host and one device side, not %s",
                         pm__copy_kind_symbol(kind));
  }

  if (stage) {
    pm__stage_seg_t seg;
    seg.host = kind == PM_COPY_H2D ? (char *)(uintptr_t)src : (char *)dst;
    seg.dev = kind == PM_COPY_H2D ? (char *)dst : (char *)(uintptr_t)src;
    seg.bytes = bytes;
    st = submit(kind, NULL, 0, false, &seg, 1, stream, &opt, fence_out);
  } else {
    op_t op = {dst, src, bytes};
    st = submit(kind, &op, 1, false, NULL, 0, stream, &opt, fence_out);
  }
  return st == PM_OK ? PM_OK : pm__wrap_error(st, "pm_copy_async");
}

pm_status_t pm_copy_batch_async(const pm_copy_item_t *items, size_t count, pm_stream_t stream,
                                const pm_copy_options_t *options, pm_fence_t *fence_out) {
  const char *fn = "pm_copy_batch_async";
  pm_copy_options_t opt;
  pm_status_t st = read_options(options, fn, &opt);
  if (st != PM_OK) return st;
  if (!items && count) return pm__set_error(PM_ERR_INVALID, "%s: items is NULL", fn);
  PM__BACKEND_OR_RETURN(b);

  op_t *ops = NULL;
  pm__stage_seg_t *segs = NULL;
  size_t nops = 0, nsegs = 0;
  pm_copy_kind_t kind = PM_COPY_DEFAULT;
  size_t first = SIZE_MAX;
  bool kernel_ok = true; /* every direct item between kernel-addressable memory */
  qcache_t sc = {0}, dc = {0};
  if (count) {
    ops = malloc(count * sizeof *ops);
    segs = malloc(count * sizeof *segs);
    if (!ops || !segs) {
      st = pm__set_error(PM_ERR_NOMEM, "%s: malloc for %zu items failed", fn, count);
      goto out;
    }
  }
  for (size_t i = 0; i < count; i++) {
    const pm_copy_item_t *it = &items[i];
    where_t w = {fn, i};
    st = check_ranges(it->dst, it->src, it->bytes, w);
    if (st != PM_OK) goto out;
    if (it->bytes == 0) continue;
    side_kind_t s, d;
    st = classify(b, it->src, it->bytes, "src", w, &sc, &s);
    if (st != PM_OK) goto out;
    st = classify(b, it->dst, it->bytes, "dst", w, &dc, &d);
    if (st != PM_OK) goto out;
    pm_copy_kind_t k;
    st = resolve_kind(opt.kind, s, d, w, &k);
    if (st == PM_OK && first != SIZE_MAX && k != kind) {
      /* Inferred differently, but managed memory may still serve the first item's direction. */
      pm_copy_kind_t k2;
      if (resolve_kind(kind, s, d, w, &k2) == PM_OK) {
        k = k2;
      } else {
        char wb[96];
        st = pm__set_error(PM_ERR_INVALID,
                           "%s: is %s (src %s, dst %s) but item %zu is %s; a batch has one "
                           "direction",
                           where_str(w, wb, sizeof wb), pm__copy_kind_symbol(k), side_name(s),
                           side_name(d), first, pm__copy_kind_symbol(kind));
      }
    }
    if (st != PM_OK) goto out;
    if (first == SIZE_MAX) {
      first = i;
      kind = k;
    }
    bool hd = kind == PM_COPY_H2D || kind == PM_COPY_D2H;
    side_kind_t host = kind == PM_COPY_H2D ? s : d;
    bool stage =
        hd && (opt.path == PM_PATH_STAGED ||
               (opt.path == PM_PATH_AUTO && (host == SIDE_PAGEABLE || host == SIDE_PINNED_PART)));
    if (!hd && opt.path == PM_PATH_STAGED) {
      char wb[96];
      st = pm__set_error(PM_ERR_INVALID,
                         "%s: PM_PATH_STAGED needs one host and one device side, "
                         "not %s",
                         where_str(w, wb, sizeof wb), pm__copy_kind_symbol(kind));
      goto out;
    }
    if (stage) {
      segs[nsegs].host = kind == PM_COPY_H2D ? (char *)(uintptr_t)it->src : (char *)it->dst;
      segs[nsegs].dev = kind == PM_COPY_H2D ? (char *)it->dst : (char *)(uintptr_t)it->src;
      segs[nsegs].bytes = it->bytes;
      nsegs++;
    } else {
      kernel_ok = kernel_ok && can_kernel(s, false) && can_kernel(d, true);
      if (nops && (const char *)ops[nops - 1].src + ops[nops - 1].bytes == it->src &&
          (char *)ops[nops - 1].dst + ops[nops - 1].bytes == it->dst) {
        ops[nops - 1].bytes += it->bytes; /* adjacent pieces: one DMA */
      } else {
        ops[nops].dst = it->dst;
        ops[nops].src = it->src;
        ops[nops].bytes = it->bytes;
        nops++;
      }
    }
  }
  if (nops == 0 && nsegs == 0)
    st = submit_empty(&opt, fence_out);
  else
    st = submit(kind, ops, nops, kernel_ok, segs, nsegs, stream, &opt, fence_out);
  if (st != PM_OK) st = pm__wrap_error(st, "%s", fn);
out:
  free(ops);
  free(segs);
  return st;
}
