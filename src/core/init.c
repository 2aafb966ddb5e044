/*
 * DESIGN: which backend serves this process, picked and started once (pm_init), and the one
 * accessor every layer uses to reach it (pm__backend). It sits low, just above the backends and
 * config: the pool, the copy engine and the front door (api.c) call down to it; it calls nothing
 * above it.
 *
 * The active backend is an atomic pointer, so the fast path of every call is one acquire load.
 * pm_init takes init_lock to start a backend once; a failed start leaves the pointer NULL and a
 * later call tries again. Backends must not call pm__backend() from init. pm__backend_stop
 * (pm_finalize) takes it down again once the layers above have let go of it.
 *
 * pm_init makes a device current only when option device was given: otherwise each thread keeps
 * the device it has (a new thread's is 0, as CUDA's), so a process that works on device k alone
 * never touches device 0 (pm__device_option_given).
 *
 * Fork: in a forked child the backend of the parent is gone. The host backend starts afresh on
 * first use without probing CUDA; after the cuda backend nothing may start (fork_child_cuda).
 *
 * Lock order: init_lock, then (inside backend init) whatever the backend takes; registry lock
 * (a leaf) inside pm__backend_stop.
 */
#include <pthread.h>
#include <stdio.h>

#include "internal.h"

static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static const pm__backend_t *_Atomic active_backend;
static const pm__backend_t *_Atomic raw_backend; /* the same, without fault.c's forwarding */
/* Why pm_init took the backend it took (pm__backend_reason): written under init_lock before
 * active_backend is published, so a reader that saw the backend sees its reason. */
static char backend_reason[600];

/* Set in a forked child (pm__init_atfork) by the backend the parent had started: the host backend
 * starts afresh in the child without probing CUDA; after the cuda backend nothing may start. */
static bool fork_child_host, fork_child_cuda;

/* Was option device given (pm_option_set or PINMEM_DEVICE)? Only then does pm_init make a
 * device current: under CUDA 12 a set device gets a context at once, so a default of 0 would
 * put a context (hundreds of MB) on GPU 0 in every process of a job where rank k uses GPU k. */
bool pm__device_option_given(void) {
  pm_option_info_t info;
  return pm_option_get(PM__OPT_DEVICE, &info) == PM_OK && info.source != PM_OPTION_DEFAULT;
}

static pm_status_t start_backend(const pm__backend_t *b) {
  pm_status_t st = b->init();
  if (st != PM_OK) return st;
  if (pm__device_option_given()) {
    long dev = pm__opt_int(PM__OPT_DEVICE);
    int count = 0;
    st = b->device_count(&count);
    if (st == PM_OK && dev >= count)
      st = pm__set_error(PM_ERR_CONFIG, "option device is %ld but the %s backend has %d device%s",
                         dev, b->name, count, count == 1 ? "" : "s");
    if (st == PM_OK) st = b->set_device((int)dev);
    if (st != PM_OK) {
      b->shutdown();
      return st;
    }
  }
  return PM_OK;
}

static pm_status_t forked_after_cuda(void) {
  return pm__set_error(PM_ERR_STATE,
                       "pinmem was used by the parent before fork(); the CUDA driver cannot be "
                       "used in a forked child: use the spawn or forkserver start method "
                       "(multiprocessing.set_start_method('spawn')), or fork before using pinmem");
}

pm_status_t pm__backend_failed(void) {
  if (fork_child_cuda) return forked_after_cuda();
  return pm__wrap_error(PM_ERR_NO_DEVICE, "no backend");
}

pm_status_t pm_init(void) {
  if (atomic_load_explicit(&active_backend, memory_order_acquire)) return PM_OK;
  pm__fork_arm();

  pthread_mutex_lock(&init_lock);
  if (atomic_load_explicit(&active_backend, memory_order_relaxed)) {
    pthread_mutex_unlock(&init_lock);
    return PM_OK;
  }
  if (fork_child_cuda) {
    pthread_mutex_unlock(&init_lock);
    return forked_after_cuda();
  }
  long want = fork_child_host ? PM_BACKEND_HOST : pm__opt_int(PM__OPT_BACKEND);
  const pm__backend_t *chosen = NULL;
  pm_status_t st = PM_OK;

  if (want == PM_BACKEND_CUDA) {
#ifdef PINMEM_HAVE_CUDA
    st = start_backend(&pm__backend_cuda);
    snprintf(backend_reason, sizeof backend_reason, "asked for (option backend)");
    if (st == PM_OK) {
      chosen = &pm__backend_cuda;
    } else if (st != PM_ERR_CONFIG) {
      st = pm__wrap_error(PM_ERR_NO_DEVICE, "pm_init: backend 'cuda' was asked for");
    }
#else
    st = pm__set_error(PM_ERR_NO_DEVICE,
                       "pm_init: backend 'cuda' was asked for (option backend / PINMEM_BACKEND) "
                       "but this pinmem was built without CUDA");
#endif
  } else {
#ifdef PINMEM_HAVE_CUDA
    if (want != PM_BACKEND_HOST) {
      /* auto: a machine without a usable GPU is normal; fall back to the host backend. */
      if (start_backend(&pm__backend_cuda) == PM_OK) {
        chosen = &pm__backend_cuda;
        snprintf(backend_reason, sizeof backend_reason, "auto: a CUDA device is present");
      } else {
        snprintf(backend_reason, sizeof backend_reason, "auto: cuda not available: %s",
                 pm_last_error());
      }
    }
#else
    if (want != PM_BACKEND_HOST)
      snprintf(backend_reason, sizeof backend_reason, "auto: this pinmem was built without CUDA");
#endif
    if (want == PM_BACKEND_HOST)
      snprintf(backend_reason, sizeof backend_reason, "asked for (option backend)");
    if (!chosen) {
      st = start_backend(&pm__backend_host);
      if (st == PM_OK)
        chosen = &pm__backend_host;
      else
        st = pm__wrap_error(st, "pm_init: starting the host backend");
    }
  }
  const pm__backend_t *started_raw = chosen;
  if (chosen) {
    /* Every call goes through fault.c's forwarding table (it injects nothing unless armed). */
    const pm__backend_t *started = chosen;
    st = pm__fault_wrap(&chosen);
    if (st != PM_OK) {
      started->shutdown();
      chosen = NULL;
    }
  }
  if (chosen) {
    pm__clear_error(); /* a failed cuda probe under auto is not this thread's error */
    atomic_store_explicit(&raw_backend, started_raw, memory_order_release);
    atomic_store_explicit(&active_backend, chosen, memory_order_release);
  }
  pthread_mutex_unlock(&init_lock);
  return chosen ? PM_OK : st;
}

const pm__backend_t *pm__backend(void) {
  const pm__backend_t *b = atomic_load_explicit(&active_backend, memory_order_acquire);
  if (b) return b;
  if (pm_init() != PM_OK) return NULL;
  return atomic_load_explicit(&active_backend, memory_order_acquire);
}

const pm__backend_t *pm__backend_raw(void) {
  if (!atomic_load_explicit(&active_backend, memory_order_acquire)) return NULL;
  return atomic_load_explicit(&raw_backend, memory_order_acquire);
}

const char *pm__backend_reason(void) {
  return atomic_load_explicit(&active_backend, memory_order_acquire) ? backend_reason : "";
}

/* pm_finalize's last step, after the pool and the copy engine let go of the backend.
 * Ranges the caller never released are forgotten: the contract is that nothing is in use. */
void pm__backend_stop(void) {
  pthread_mutex_lock(&init_lock);
  const pm__backend_t *b = atomic_load_explicit(&active_backend, memory_order_relaxed);
  atomic_store_explicit(&active_backend, NULL, memory_order_release);
  atomic_store_explicit(&raw_backend, NULL, memory_order_release);
  pm__registry_clear();
  if (b) b->shutdown();
  pthread_mutex_unlock(&init_lock);
}

void pm__init_atfork(pm__fork_phase_t phase) {
  if (phase == PM__FORK_PREPARE) {
    pthread_mutex_lock(&init_lock);
  } else if (phase == PM__FORK_PARENT) {
    pthread_mutex_unlock(&init_lock);
  } else {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    init_lock = fresh;
    const pm__backend_t *b = atomic_load_explicit(&active_backend, memory_order_relaxed);
    if (b && b->kind == PM_BACKEND_CUDA) fork_child_cuda = true;
    if (b && b->kind == PM_BACKEND_HOST) fork_child_host = true;
    /* The backend starts again on first use (host), or never (cuda): its threads, streams and
     * tables of the parent are gone. */
    atomic_store_explicit(&active_backend, NULL, memory_order_relaxed);
    atomic_store_explicit(&raw_backend, NULL, memory_order_relaxed);
  }
}

pm_backend_kind_t pm_backend_kind(void) {
  const pm__backend_t *b = atomic_load_explicit(&active_backend, memory_order_acquire);
  return b ? b->kind : PM_BACKEND_NONE;
}

const char *pm_backend_name(void) {
  const pm__backend_t *b = atomic_load_explicit(&active_backend, memory_order_acquire);
  return b ? b->name : "none";
}
