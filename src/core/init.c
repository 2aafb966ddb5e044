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
 * No silent CPU: when auto falls back to the host backend (no driver, an old one, no device), the
 * host backend is installed through a copy of its table whose device and managed allocations,
 * and the device address of mapped pinned memory, fail with the reason (fallback_backend), so
 * nothing that asked for a device gets host memory in its place; PINMEM_BACKEND=host installs
 * the plain table and simulates devices on purpose.
 *
 * Fork: in a forked child the backend of the parent is gone. The host backend starts afresh on
 * first use without probing CUDA; after the cuda backend nothing may start (fork_child_cuda).
 *
 * Lock order: init_lock, then (inside backend init) whatever the backend takes; registry lock
 * (a leaf) inside pm__backend_stop.
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static const pm__backend_t *_Atomic active_backend;
static const pm__backend_t *_Atomic raw_backend; /* the same, without fault.c's forwarding */
/* Why pm_init took the backend it took (pm__backend_reason): written under init_lock before
 * active_backend is published, so a reader that saw the backend sees its reason. */
static char backend_reason[600];
/* Set with backend_reason: what option backend asked for, and whether auto fell back. */
static int backend_requested;
static bool backend_fallback;

/* The host backend as auto's fallback: device and managed memory refused, saying why. */
static pm__backend_t host_fallback;

static pm_status_t fallback_error(const char *call, const char *what) {
  return pm__set_error(PM_ERR_NO_DEVICE,
                       "%s: no CUDA device: pinmem fell back to the host backend (%s). %s, so "
                       "it is refused; to simulate devices on purpose, set PINMEM_BACKEND=host",
                       call, backend_reason + (strncmp(backend_reason, "auto: ", 6) ? 0 : 6), what);
}
bool pm__backend_is_fallback(void) {
  /* backend_fallback is written before active_backend is published (release). */
  return atomic_load_explicit(&active_backend, memory_order_acquire) && backend_fallback;
}
pm_status_t pm__fallback_refuse(const char *call) {
  return pm__backend_is_fallback()
             ? fallback_error(call, "A simulated device would stand in for a GPU")
             : PM_OK;
}
static pm_status_t gated_device_alloc(size_t bytes, void **dptr_out) {
  (void)dptr_out;
  char call[64];
  snprintf(call, sizeof call, "device_alloc(%zu bytes)", bytes);
  return fallback_error(call, "Device memory would be host memory in disguise");
}
static pm_status_t gated_managed_alloc(size_t bytes, void **ptr_out) {
  (void)ptr_out;
  char call[64];
  snprintf(call, sizeof call, "managed_alloc(%zu bytes)", bytes);
  return fallback_error(call, "Device memory would be host memory in disguise");
}
/* Mapped pinned memory (PM_HOST_MAPPED, PM_REGISTER_MAPPED) promises an address a GPU kernel
 * reads; the host backend's is the host address itself, which no real device has mapped (a GPU
 * that another library still drives would fault on it). */
static pm_status_t gated_host_device_pointer(void *host_ptr, void **dptr_out) {
  (void)dptr_out;
  char call[64];
  snprintf(call, sizeof call, "host_device_pointer(%p)", host_ptr);
  return fallback_error(call,
                        "A device address of mapped pinned memory would be a host address "
                        "that no GPU has mapped");
}
static const pm__backend_t *fallback_backend(void) {
  host_fallback = pm__backend_host;
  host_fallback.device_alloc = gated_device_alloc;
  host_fallback.managed_alloc = gated_managed_alloc;
  host_fallback.host_device_pointer = gated_host_device_pointer;
  return &host_fallback;
}

/* Set in a forked child (pm__init_atfork) by the backend the parent had started: the host backend
 * starts afresh in the child without probing CUDA; after the cuda backend nothing may start. */
static bool fork_child_host, fork_child_cuda;
/* The kind of the backend pm_finalize stopped last: a child forked after pm_finalize follows it as
 * it would follow a running one (the driver the parent started stays started). */
static pm_backend_kind_t stopped_kind = PM_BACKEND_NONE;

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
  /* auto's fallback has no device to make current: option device (a launcher's rank) names a
   * CUDA device, and the fallback refuses device requests with its reason whatever the index. */
  if (pm__device_option_given() && b != &host_fallback) {
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

/* An environment value of option backend that does not parse leaves auto in force (config.c);
 * the reason for the choice says so first ("PINMEM_BACKEND='gpu' ignored: not auto, cuda or host;
 * "), so a typo is seen where the choice is explained, not only in the option table. */
static void ignored_backend_note(char *buf, size_t n) {
  char why[128]; /* an option's text is at most 128 bytes */
  pm__opt_ignored(PM__OPT_BACKEND, why, sizeof why);
  snprintf(buf, n, "%s%s", why, why[0] ? "; " : "");
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
  /* A child forked from a process that fell back keeps falling back (and keeps its reason). */
  bool fallback = fork_child_host && backend_fallback;
  if (!fork_child_host) backend_requested = (int)want;

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
                       "but this pinmem was built without the cuda backend (-DPINMEM_CUDA=OFF)");
#endif
  } else {
    if (want != PM_BACKEND_HOST) {
      char note[160];
      ignored_backend_note(note, sizeof note);
#ifdef PINMEM_HAVE_CUDA
      /* auto: a machine without a usable GPU is normal; fall back to the host backend, and
       * say why wherever someone asks for a device. */
      if (start_backend(&pm__backend_cuda) == PM_OK) {
        chosen = &pm__backend_cuda;
        snprintf(backend_reason, sizeof backend_reason, "auto: %sa CUDA device is present", note);
      } else {
        snprintf(backend_reason, sizeof backend_reason, "auto: %s%s", note, pm_last_error());
        fallback = true;
      }
#else
      snprintf(backend_reason, sizeof backend_reason,
               "auto: %sthis pinmem was built without the cuda backend (-DPINMEM_CUDA=OFF)", note);
      fallback = true;
#endif
    } else if (!fork_child_host || !backend_fallback) {
      snprintf(backend_reason, sizeof backend_reason, "asked for (option backend)");
    }
    if (!chosen) {
      const pm__backend_t *host = fallback ? fallback_backend() : &pm__backend_host;
      st = start_backend(host);
      if (st == PM_OK)
        chosen = host;
      else
        st = pm__wrap_error(st, "pm_init: starting the host backend");
    }
  }
  backend_fallback = chosen && fallback;
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
  if (b) {
    stopped_kind = b->kind;
    b->shutdown();
  }
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
    pm_backend_kind_t kind = b ? b->kind : stopped_kind;
    /* Once the parent started the driver (a cuda backend, running or stopped, or a cuda start
     * that failed after cuInit), the child's driver calls would fail with
     * CUDA_ERROR_NOT_INITIALIZED: it is told why instead. */
    bool started = false;
#ifdef PINMEM_HAVE_CUDA
    started = pm__cuda_driver_started();
#endif
    if (kind == PM_BACKEND_CUDA || (kind != PM_BACKEND_HOST && started)) fork_child_cuda = true;
    if (kind == PM_BACKEND_HOST) fork_child_host = true;
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

pm_status_t pm_backend_info(pm_backend_info_t *info_out) {
  if (!info_out) return pm__set_error(PM_ERR_INVALID, "pm_backend_info: info_out is NULL");
  pm_backend_info_t info;
  memset(&info, 0, sizeof info);
  pm_status_t st = pm_init();
  char start_error[512];
  snprintf(start_error, sizeof start_error, "%s", st == PM_OK ? "" : pm_last_error());
  pthread_mutex_lock(&init_lock);
  const pm__backend_t *b = atomic_load_explicit(&raw_backend, memory_order_acquire);
  info.kind = b ? b->kind : PM_BACKEND_NONE;
  info.requested = backend_requested;
  info.fallback = b && backend_fallback;
  snprintf(info.reason, sizeof info.reason, "%s", b ? backend_reason : start_error);
  pthread_mutex_unlock(&init_lock);
  if (b && !info.fallback) { /* the fallback's simulated devices are not on offer */
    int count = 0;
    if (b->device_count(&count) == PM_OK) info.device_count = count;
  }
#ifdef PINMEM_HAVE_CUDA
  pm__cuda_status_t cs;
  pm__cuda_status(&cs);
  info.cuda_compiled = cs.compiled;
  info.driver_version = cs.driver_version;
  snprintf(info.driver_library, sizeof info.driver_library, "%s", cs.library);
  snprintf(info.driver_missing, sizeof info.driver_missing, "%s", cs.missing);
  snprintf(info.kernels, sizeof info.kernels, "%s", cs.kernels);
#endif
  pm__clear_error();
  *info_out = info;
  return PM_OK;
}
