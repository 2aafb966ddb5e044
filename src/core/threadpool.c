/*
 * DESIGN: a small pool of persistent worker threads for pm__parallel_for (first touch of newly
 * pinned memory today, the copy engine's memcpy fan-out later). Starting threads per call costs
 * tens of microseconds each and more in a KVM guest, so workers are created lazily, kept, and
 * sleep on a condition variable between jobs (no busy-waiting).
 *
 * Data structure: a FIFO of jobs. A job lives on its caller's stack; it holds the loop bounds, an
 * atomic "next index" every participant claims from, how many more helpers it wants, and how
 * many helpers are inside it. The caller always works on its own job too, so a job completes even
 * when every worker is busy elsewhere (or nested parallel_for calls come from a worker): callers
 * never wait for an idle worker, only for helpers that already joined.
 *
 * Device: a job carries its caller's current device, read once per call (pm__thread_device), and
 * every helper enters it (pm__thread_enter) before it runs items: items make backend calls
 * (registering, queueing copies), and a helper last used by a job of another device, or never
 * set at all (device 0), would make them on the wrong device.
 *
 * Invariants: a job is in the queue only while it wants helpers and its caller has not yet
 * finished claiming; the caller returns only after it unqueued the job and `active` fell to 0, so
 * no worker touches the job after that. Workers exist in [0, PM__TP_MAX].
 *
 * Lock order: tp_lock is a leaf; fn() always runs without it.
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>

#include "internal.h"

#define PM__TP_MAX 64

typedef struct pm__job {
  void (*fn)(void *ctx, size_t i);
  void *ctx;
  size_t n;
  int device;          /* the caller's current device (-1: no backend up) */
  atomic_size_t next;  /* next index to claim */
  int want;            /* helpers still wanted (guarded by tp_lock) */
  int active;          /* helpers inside the job (guarded by tp_lock) */
  bool queued;         /* guarded by tp_lock */
  pthread_cond_t done; /* signalled when active drops to 0 */
  struct pm__job *qnext;
} pm__job_t;

static pthread_mutex_t tp_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t tp_work = PTHREAD_COND_INITIALIZER;
static pm__job_t *tp_head, *tp_tail;
static pthread_t tp_threads[PM__TP_MAX];
static int tp_count;
static int tp_idle;
static bool tp_stop;

static void run_items(pm__job_t *job) {
  for (;;) {
    size_t i = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed);
    if (i >= job->n) break;
    job->fn(job->ctx, i);
  }
}

static void unqueue_locked(pm__job_t *job) {
  if (!job->queued) return;
  pm__job_t **pp = &tp_head;
  pm__job_t *prev = NULL;
  while (*pp && *pp != job) {
    prev = *pp;
    pp = &(*pp)->qnext;
  }
  if (*pp) {
    *pp = job->qnext;
    if (tp_tail == job) tp_tail = prev;
  }
  job->queued = false;
  job->qnext = NULL;
}

static void *worker_main(void *arg) {
  (void)arg;
  pthread_mutex_lock(&tp_lock);
  for (;;) {
    while (!tp_stop && !tp_head) {
      tp_idle++;
      pthread_cond_wait(&tp_work, &tp_lock);
      tp_idle--;
    }
    if (tp_stop) break;
    pm__job_t *job = tp_head;
    job->active++;
    if (--job->want <= 0) unqueue_locked(job);
    pthread_mutex_unlock(&tp_lock);

    pm__thread_enter(job->device);
    run_items(job);

    pthread_mutex_lock(&tp_lock);
    if (--job->active == 0) pthread_cond_signal(&job->done);
  }
  pthread_mutex_unlock(&tp_lock);
  return NULL;
}

/* Start workers until `want` exist (or creation fails: the job then runs on fewer threads,
 * which is slower but correct). Called with tp_lock held. */
static void ensure_workers_locked(int want) {
  if (want > PM__TP_MAX) want = PM__TP_MAX;
  while (tp_count < want) {
    /* Workers must not take the process's signals (the program may rely on a main thread
     * receiving SIGINT), so they start with every signal blocked. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&tp_threads[tp_count], NULL, worker_main, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) break;
    tp_count++;
  }
}

void pm__parallel_for(int threads, size_t n, void (*fn)(void *ctx, size_t i), void *ctx) {
  if (n == 0 || !fn) return;
  int helpers = threads - 1;
  if (helpers > PM__TP_MAX) helpers = PM__TP_MAX;
  if ((size_t)helpers > n - 1) helpers = (int)(n - 1);
  if (helpers <= 0) {
    for (size_t i = 0; i < n; i++) fn(ctx, i);
    return;
  }

  pm__job_t job;
  job.fn = fn;
  job.ctx = ctx;
  job.n = n;
  job.device = pm__thread_device();
  atomic_init(&job.next, 0);
  job.want = helpers;
  job.active = 0;
  job.queued = true;
  job.qnext = NULL;
  pthread_cond_init(&job.done, NULL);

  pthread_mutex_lock(&tp_lock);
  ensure_workers_locked(helpers);
  if (tp_tail)
    tp_tail->qnext = &job;
  else
    tp_head = &job;
  tp_tail = &job;
  /* Wake only as many sleepers as the job wants; busy workers pick it up when they finish. */
  int wake = PM__MIN(helpers, tp_idle);
  for (int k = 0; k < wake; k++) pthread_cond_signal(&tp_work);
  pthread_mutex_unlock(&tp_lock);

  run_items(&job);

  pthread_mutex_lock(&tp_lock);
  unqueue_locked(&job);
  while (job.active > 0) pthread_cond_wait(&job.done, &tp_lock);
  pthread_mutex_unlock(&tp_lock);
  pthread_cond_destroy(&job.done);
}

void pm__threadpool_shutdown(void) {
  pthread_mutex_lock(&tp_lock);
  tp_stop = true;
  pthread_cond_broadcast(&tp_work);
  int count = tp_count;
  pthread_mutex_unlock(&tp_lock);

  for (int i = 0; i < count; i++) pthread_join(tp_threads[i], NULL);

  pthread_mutex_lock(&tp_lock);
  tp_count = 0;
  tp_idle = 0;
  tp_stop = false; /* a later pm_init may use the pool again */
  pthread_mutex_unlock(&tp_lock);
}

/* fork.c: the workers are the parent's threads; in a child none exists, so the child starts with
 * none (and starts its own on its first parallel_for). Jobs queued by other threads of the parent
 * live on those threads' stacks: dropped. */
void pm__threadpool_atfork(pm__fork_phase_t phase) {
  if (phase == PM__FORK_PREPARE) {
    pthread_mutex_lock(&tp_lock);
  } else if (phase == PM__FORK_PARENT) {
    pthread_mutex_unlock(&tp_lock);
  } else {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t fresh_cv = PTHREAD_COND_INITIALIZER;
    tp_lock = fresh;
    tp_work = fresh_cv;
    tp_head = tp_tail = NULL;
    tp_count = 0;
    tp_idle = 0;
    tp_stop = false;
  }
}
