/*
 * DESIGN: the copy engine's completion service and its event helpers: the bottom of the copy
 * layer, under staging (copy_stage.c) and fences (fence.c).
 *
 * Completion service: a queue of jobs served by detached threads that start on demand (one per
 * job waiting when none is idle, at most PM__CQ_MAX_THREADS) and exit after PM__CQ_IDLE_S idle.
 * A job is a node with its own run function (pm__cq_node_t), so this file knows nothing of what
 * it runs: fences post their completion (D2H copy-out, then the callback) and their free (the
 * last reference dropped inside a host function, where no backend call may run); the reaper
 * below posts itself. Host functions only post jobs; they never call the backend. User callbacks
 * run on a completion thread with no lock held.
 *
 * Events: pm__copy_wait_event polls (spins briefly, then sleeps with a growing interval), so
 * waiting threads need no blocking-sync event. pm__copy_reap_event destroys an event that may
 * still be pending once it completed: one reaper job polls all of them, so a stuck stream holds
 * one thread, not one per dropped event.
 *
 * Devices: a completion thread serves work of every device, so it enters the device of each job
 * (and the reaper that of each event) before the job's backend calls: the device of the thread
 * that made the fence or dropped the event, captured there (posts come from host functions, on
 * a thread of no particular device).
 *
 * Lock order: g_cq_mu and g_reap_mu are leaves: never held together, and neither is held across
 * a backend call or a job. fork.c takes both before fork() (pm__copy_atfork).
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include "copy_internal.h"

#define PM__CQ_MAX_THREADS 256
#define PM__CQ_IDLE_S 2
#define PM__SPIN_S 100e-6 /* event polling spins this long before it sleeps */

/* ---- completion service --------------------------------------------------------------------- */

typedef pm__cq_node_t cq_node_t;

static pthread_mutex_t g_cq_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cq_cv = PTHREAD_COND_INITIALIZER;
static cq_node_t *g_cq_head, *g_cq_tail;
static size_t g_cq_len;
static int g_cq_threads, g_cq_idle;
static bool g_cq_quit;                                         /* pm_finalize: idle threads go */
static pthread_cond_t g_cq_exit_cv = PTHREAD_COND_INITIALIZER; /* a completion thread left */

static void cq_run(cq_node_t *node) {
  node->run(node);
}

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
    pm__thread_enter(node->device);
    cq_run(node);
    pthread_mutex_lock(&g_cq_mu);
  }
}

/* Queue a job. Returns true once a completion thread will run it. If no completion thread can
 * be started at all: with `inline_ok` the caller runs the queue itself (a degraded mode that only
 * a thread-creation failure reaches) and true is returned; without it the job is taken back out
 * and false is returned (a D2H copy-out must run beside the caller, never inside it). */
bool pm__cq_post_ex(cq_node_t *node, void (*run)(cq_node_t *node), bool inline_ok) {
  node->next = NULL;
  node->run = run;
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

void pm__cq_post(cq_node_t *node, void (*run)(cq_node_t *node)) {
  (void)pm__cq_post_ex(node, run, true);
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
    pm_status_t st = pm__cb_event_query(event);
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
  int device; /* the event's device: entered before each query and the destroy */
} reap_node_t;

static pthread_mutex_t g_reap_mu = PTHREAD_MUTEX_INITIALIZER;
static reap_node_t *g_reap;
static bool g_reaper_on;
static cq_node_t g_reaper_node;
static void reaper_run(cq_node_t *node);

void pm__copy_reap_event(pm_event_t event) {
  if (!event) return;
  if (pm__cb_event_query(event) != PM_NOT_READY) {
    (void)pm__cb_event_destroy(event);
    return;
  }
  reap_node_t *r = malloc(sizeof *r);
  if (!r) {
    (void)pm__cb_event_synchronize(event);
    (void)pm__cb_event_destroy(event);
    return;
  }
  r->ev = event;
  r->device = pm__thread_device();
  pthread_mutex_lock(&g_reap_mu);
  r->next = g_reap;
  g_reap = r;
  bool start = !g_reaper_on;
  g_reaper_on = true;
  pthread_mutex_unlock(&g_reap_mu);
  if (start) {
    g_reaper_node.device = -1; /* the reaper enters each event's device itself */
    pm__cq_post(&g_reaper_node, reaper_run);
  }
}

/* One reaper at a time polls every pending event, so a stuck stream holds one thread, not one
 * per dropped event. */
static void reaper_run(cq_node_t *node) {
  (void)node;
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
      pm__thread_enter(r->device);
      if (pm__cb_event_query(r->ev) != PM_NOT_READY) {
        (void)pm__cb_event_destroy(r->ev);
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

bool pm__copy_quiesce(unsigned timeout_ms) {
  /* Polled, as jobs and the reaper hold no lock while they run: quiet once no job is queued,
   * every completion thread waits for one (a running job is not idle) and the reaper is off. */
  for (unsigned waited = 0;; waited++) {
    pthread_mutex_lock(&g_cq_mu);
    bool quiet = !g_cq_head && g_cq_idle == g_cq_threads;
    pthread_mutex_unlock(&g_cq_mu);
    pthread_mutex_lock(&g_reap_mu);
    quiet = quiet && !g_reaper_on;
    pthread_mutex_unlock(&g_reap_mu);
    if (quiet) return true;
    if (waited >= timeout_ms) return false;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
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
