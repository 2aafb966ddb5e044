/*
 * DESIGN: the library's front door. It picks and starts the backend once (pm_init), tears
 * everything down again (pm_finalize), and wraps every public call that is a thin layer over the
 * backend: devices, streams, events, device memory, plain copies, managed memory, registration
 * and pointer queries. Each wrapper validates its arguments (and, through the registry, the
 * pointers it can know about) before the backend sees them, so bad input gets a status and a
 * message instead of a CUDA error or a crash of the host backend.
 *
 * The registry (registry.c) is the source of truth for what memory pinmem handed out or pinned:
 * device and managed allocations are added here, registrations too, pool segments by pool.c.
 * Release calls check the kind so that freeing memory with the wrong call is an error that names
 * the right call.
 *
 * Initialisation: the active backend is an atomic pointer, so the fast path of every call is one
 * acquire load. pm_init takes init_lock to start a backend once; a failed start leaves the
 * pointer NULL and a later call tries again. Backends must not call pm__backend() from init.
 *
 * Registration: a registration first reserves its range in the registry (marked "registering"),
 * so the overlap check and the claim are one atomic step before any backend call; then it
 * charges the default pool's budget, pins, and swaps in the final entry with its device address.
 * reg_lock serialises only the registry steps of pm_register/pm_unregister (the reservation and
 * the swap), never a backend call or a budget wait.
 *
 * Lock order: init_lock, then (inside backend init) whatever the backend takes. reg_lock ->
 * registry lock (a leaf). No lock of this file is held while calling the backend or the pool.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static const pm__backend_t *_Atomic active_backend;
/* Why pm_init took the backend it took (pm__backend_reason): written under init_lock before
 * active_backend is published, so a reader that saw the backend sees its reason. */
static char backend_reason[600];

static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;

/* Set in a forked child (fork.c) by the backend the parent had started: the host backend starts
 * afresh in the child without probing CUDA; after the cuda backend nothing may start. */
static bool fork_child_host, fork_child_cuda;
/* Private flag on a registry entry whose registration has not finished yet. */
#define PM__REG_PENDING (1u << 31)
#define PM__REGISTER_ALL (PM_REGISTER_MAPPED | PM_REGISTER_PORTABLE | PM_REGISTER_READ_ONLY)

/* ------------------------------------------------------------------------------------------ */
/* Library, backend                                                                            */
/* ------------------------------------------------------------------------------------------ */

static pm_status_t start_backend(const pm__backend_t *b) {
  pm_status_t st = b->init();
  if (st != PM_OK) return st;
  long dev = pm__opt_int(PM__OPT_DEVICE);
  if (dev != 0) {
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
  pm__fork_watch();

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

const char *pm__backend_reason(void) {
  return atomic_load_explicit(&active_backend, memory_order_acquire) ? backend_reason : "";
}

pm_status_t pm_finalize(void) {
  /* The default pool first: it frees through the backend and removes its registry ranges.
   * init_lock is not held here because the pool calls pm__backend(). */
  pm__copy_shutdown(); /* drains the copy engine's queue, which may still free bounce blocks */
  pm_status_t st = pm__pool_default_destroy();
  if (st != PM_OK) return pm__wrap_error(st, "pm_finalize: destroying the default pool");
  pm__threadpool_shutdown();

  pthread_mutex_lock(&init_lock);
  const pm__backend_t *b = atomic_load_explicit(&active_backend, memory_order_relaxed);
  atomic_store_explicit(&active_backend, NULL, memory_order_release);
  /* Ranges the caller never released are forgotten: the contract is that nothing is in use. */
  pm__registry_clear();
  if (b) b->shutdown();
  pthread_mutex_unlock(&init_lock);
  return PM_OK;
}

void pm__api_atfork(pm__fork_phase_t phase) {
  if (phase == PM__FORK_PREPARE) {
    pthread_mutex_lock(&init_lock);
    pthread_mutex_lock(&reg_lock);
  } else if (phase == PM__FORK_PARENT) {
    pthread_mutex_unlock(&reg_lock);
    pthread_mutex_unlock(&init_lock);
  } else {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    init_lock = fresh;
    reg_lock = fresh;
    const pm__backend_t *b = atomic_load_explicit(&active_backend, memory_order_relaxed);
    if (b && b->kind == PM_BACKEND_CUDA) fork_child_cuda = true;
    if (b && b->kind == PM_BACKEND_HOST) fork_child_host = true;
    /* The backend starts again on first use (host), or never (cuda): its threads, streams and
     * tables of the parent are gone. */
    atomic_store_explicit(&active_backend, NULL, memory_order_relaxed);
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

/* ------------------------------------------------------------------------------------------ */
/* Helpers                                                                                     */
/* ------------------------------------------------------------------------------------------ */

#define PM__NULL_ARG(fn, name) pm__set_error(PM_ERR_INVALID, "%s: %s is NULL", fn, name)

static const char *kind_desc(pm_memory_kind_t k) {
  switch (k) {
    case PM_MEMORY_POOL:
      return "a pinned block from pm_host_alloc";
    case PM_MEMORY_REGISTERED:
      return "memory registered with pm_register";
    case PM_MEMORY_MANAGED:
      return "managed memory from pm_managed_alloc";
    case PM_MEMORY_DEVICE:
      return "device memory from pm_device_alloc";
    case PM_MEMORY_PAGEABLE:
      break;
  }
  return "pageable memory";
}

static const char *release_call(pm_memory_kind_t k) {
  switch (k) {
    case PM_MEMORY_POOL:
      return "pm_host_free";
    case PM_MEMORY_REGISTERED:
      return "pm_unregister";
    case PM_MEMORY_MANAGED:
      return "pm_managed_free";
    case PM_MEMORY_DEVICE:
      return "pm_device_free";
    case PM_MEMORY_PAGEABLE:
      break;
  }
  return "free";
}

/* The tracked range of `want` kind holding ptr. With `exact`, ptr must be its start. */
static pm_status_t lookup_kind(const char *fn, const void *ptr, pm_memory_kind_t want, bool exact,
                               pm__range_t *out) {
  pm__range_t r;
  if (!pm__registry_find(ptr, &r))
    return pm__set_error(PM_ERR_NOT_FOUND,
                         "%s(%p): not %s (memory pinmem does not track, or already released)", fn,
                         ptr, kind_desc(want));
  if (r.kind != want)
    return pm__set_error(PM_ERR_WRONG_KIND, "%s(%p): the address is %s; release it with %s", fn,
                         ptr, kind_desc(r.kind), release_call(r.kind));
  if (exact && r.base != (uintptr_t)ptr)
    return pm__set_error(PM_ERR_NOT_FOUND,
                         "%s(%p): the address lies %zu bytes inside %s [%p, +%zu), not at its "
                         "start",
                         fn, ptr, (size_t)((uintptr_t)ptr - r.base), kind_desc(r.kind),
                         (void *)r.base, r.size);
  *out = r;
  return PM_OK;
}

/* If ptr is in a tracked range, [ptr, ptr + bytes) must stay inside it. */
static pm_status_t check_span(const char *fn, const char *what, const void *ptr, size_t bytes,
                              pm__range_t *r, bool *known) {
  *known = pm__registry_find(ptr, r);
  if (!*known) return PM_OK;
  size_t room = r->base + r->size - (uintptr_t)ptr;
  if (bytes > room)
    return pm__set_error(PM_ERR_INVALID,
                         "%s: %zu bytes at %s %p overrun %s [%p, +%zu) (%zu bytes left)", fn, bytes,
                         what, ptr, kind_desc(r->kind), (void *)r->base, r->size, room);
  return PM_OK;
}

static pm_status_t check_device_index(const char *fn, const pm__backend_t *b, int device,
                                      bool allow_cpu) {
  if (allow_cpu && device == PM_CPU_DEVICE) return PM_OK;
  int count = 0;
  pm_status_t st = b->device_count(&count);
  if (st != PM_OK) return pm__wrap_error(st, "%s", fn);
  if (device < 0 || device >= count)
    return pm__set_error(PM_ERR_INVALID, "%s: device %d out of range (%s backend has %d)%s", fn,
                         device, b->name, count, allow_cpu ? "; PM_CPU_DEVICE is the host" : "");
  return PM_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Devices                                                                                     */
/* ------------------------------------------------------------------------------------------ */

pm_status_t pm_device_count(int *count_out) {
  if (!count_out) return PM__NULL_ARG("pm_device_count", "count_out");
  PM__BACKEND_OR_RETURN(b);
  return b->device_count(count_out);
}

pm_status_t pm_device_get_info(int device, pm_device_info_t *info_out) {
  if (!info_out) return PM__NULL_ARG("pm_device_get_info", "info_out");
  PM__BACKEND_OR_RETURN(b);
  pm_status_t st = check_device_index("pm_device_get_info", b, device, false);
  if (st != PM_OK) return st;
  return b->device_info(device, info_out);
}

pm_status_t pm_device_set(int device) {
  PM__BACKEND_OR_RETURN(b);
  pm_status_t st = check_device_index("pm_device_set", b, device, false);
  if (st != PM_OK) return st;
  return b->set_device(device);
}

pm_status_t pm_device_get(int *device_out) {
  if (!device_out) return PM__NULL_ARG("pm_device_get", "device_out");
  PM__BACKEND_OR_RETURN(b);
  return b->get_device(device_out);
}

pm_status_t pm_device_synchronize(void) {
  PM__BACKEND_OR_RETURN(b);
  return b->device_synchronize();
}

/* ------------------------------------------------------------------------------------------ */
/* Streams and events                                                                          */
/* ------------------------------------------------------------------------------------------ */

pm_status_t pm_stream_create(pm_stream_t *stream_out) {
  if (!stream_out) return PM__NULL_ARG("pm_stream_create", "stream_out");
  PM__BACKEND_OR_RETURN(b);
  return b->stream_create(stream_out);
}

pm_status_t pm_stream_destroy(pm_stream_t stream) {
  if (!stream)
    return pm__set_error(PM_ERR_INVALID,
                         "pm_stream_destroy: stream is NULL (the default stream is not destroyed)");
  PM__BACKEND_OR_RETURN(b);
  return b->stream_destroy(stream);
}

pm_status_t pm_stream_synchronize(pm_stream_t stream) {
  PM__BACKEND_OR_RETURN(b);
  return b->stream_synchronize(stream);
}

pm_status_t pm_stream_query(pm_stream_t stream) {
  PM__BACKEND_OR_RETURN(b);
  return b->stream_query(stream);
}

pm_status_t pm_stream_wait_event(pm_stream_t stream, pm_event_t event) {
  if (!event) return PM__NULL_ARG("pm_stream_wait_event", "event");
  PM__BACKEND_OR_RETURN(b);
  return b->stream_wait_event(stream, event);
}

pm_status_t pm_event_create(unsigned flags, pm_event_t *event_out) {
  if (!event_out) return PM__NULL_ARG("pm_event_create", "event_out");
  if (flags & ~(unsigned)PM_EVENT_TIMING)
    return pm__set_error(PM_ERR_INVALID, "pm_event_create: unknown flags 0x%x",
                         flags & ~(unsigned)PM_EVENT_TIMING);
  PM__BACKEND_OR_RETURN(b);
  return b->event_create(flags, event_out);
}

pm_status_t pm_event_destroy(pm_event_t event) {
  if (!event) return PM__NULL_ARG("pm_event_destroy", "event");
  PM__BACKEND_OR_RETURN(b);
  return b->event_destroy(event);
}

pm_status_t pm_event_record(pm_event_t event, pm_stream_t stream) {
  if (!event) return PM__NULL_ARG("pm_event_record", "event");
  PM__BACKEND_OR_RETURN(b);
  return b->event_record(event, stream);
}

pm_status_t pm_event_query(pm_event_t event) {
  if (!event) return PM__NULL_ARG("pm_event_query", "event");
  PM__BACKEND_OR_RETURN(b);
  return b->event_query(event);
}

pm_status_t pm_event_synchronize(pm_event_t event) {
  if (!event) return PM__NULL_ARG("pm_event_synchronize", "event");
  PM__BACKEND_OR_RETURN(b);
  return b->event_synchronize(event);
}

pm_status_t pm_event_elapsed(pm_event_t start, pm_event_t end, double *seconds_out) {
  if (!start) return PM__NULL_ARG("pm_event_elapsed", "start");
  if (!end) return PM__NULL_ARG("pm_event_elapsed", "end");
  if (!seconds_out) return PM__NULL_ARG("pm_event_elapsed", "seconds_out");
  PM__BACKEND_OR_RETURN(b);
  return b->event_elapsed(start, end, seconds_out);
}

pm_status_t pm_launch_busy(pm_stream_t stream, double seconds) {
  if (!(seconds >= 0) || !isfinite(seconds))
    return pm__set_error(PM_ERR_INVALID, "pm_launch_busy: seconds must be finite and >= 0, not %g",
                         seconds);
  PM__BACKEND_OR_RETURN(b);
  return b->launch_busy(stream, seconds);
}

pm_status_t pm_launch_host_func(pm_stream_t stream, void (*fn)(void *arg), void *arg) {
  if (!fn) return PM__NULL_ARG("pm_launch_host_func", "fn");
  PM__BACKEND_OR_RETURN(b);
  return b->launch_host_func(stream, fn, arg);
}

/* ------------------------------------------------------------------------------------------ */
/* Device memory and plain copies                                                              */
/* ------------------------------------------------------------------------------------------ */

pm_status_t pm_device_alloc(size_t bytes, void **dptr_out) {
  if (!dptr_out) return PM__NULL_ARG("pm_device_alloc", "dptr_out");
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "pm_device_alloc: bytes is 0");
  PM__BACKEND_OR_RETURN(b);
  void *p = NULL;
  pm_status_t st = b->device_alloc(bytes, &p);
  if (st != PM_OK) return pm__wrap_error(st, "pm_device_alloc(%zu bytes)", bytes);
  pm__range_t r = {(uintptr_t)p, bytes, PM_MEMORY_DEVICE, 0, NULL, NULL};
  st = pm__registry_add(&r);
  if (st != PM_OK) {
    b->device_free(p);
    return pm__wrap_error(st, "pm_device_alloc(%zu bytes)", bytes);
  }
  *dptr_out = p;
  return PM_OK;
}

pm_status_t pm_device_free(void *dptr) {
  if (!dptr) return PM_OK; /* as free() and cudaFree() */
  pm__range_t r;
  pm_status_t st = lookup_kind("pm_device_free", dptr, PM_MEMORY_DEVICE, true, &r);
  if (st != PM_OK) return st;
  PM__BACKEND_OR_RETURN(b);
  /* Removing first makes a concurrent double free fail cleanly instead of freeing twice. */
  st = pm__registry_remove(r.base, PM_MEMORY_DEVICE, NULL);
  if (st != PM_OK) return pm__wrap_error(st, "pm_device_free(%p)", dptr);
  st = b->device_free(dptr);
  if (st != PM_OK) {
    pm__registry_add(&r); /* still allocated: keep tracking it */
    return pm__wrap_error(st, "pm_device_free(%p)", dptr);
  }
  return PM_OK;
}

/* Where the device-side pointer of a memset/copy must live. */
static pm_status_t check_device_side(const char *fn, const char *what, const pm__backend_t *b,
                                     const void *ptr, size_t bytes) {
  pm__range_t r;
  bool known;
  pm_status_t st = check_span(fn, what, ptr, bytes, &r, &known);
  if (st != PM_OK) return st;
  if (known) {
    if (r.kind == PM_MEMORY_DEVICE || r.kind == PM_MEMORY_MANAGED) return PM_OK;
    return pm__set_error(PM_ERR_INVALID, "%s: %s %p is %s, not device memory", fn, what, ptr,
                         kind_desc(r.kind));
  }
  /* Not ours: device memory of another library (PyTorch, CuPy) is fine when the backend
   * recognises it. */
  if (b->pointer_kind(ptr) == PM__PTR_DEVICE) return PM_OK;
  return pm__set_error(PM_ERR_INVALID, "%s: %s %p is not device memory", fn, what, ptr);
}

pm_status_t pm_device_memset_async(void *dptr, int value, size_t bytes, pm_stream_t stream) {
  if (!dptr) return PM__NULL_ARG("pm_device_memset_async", "dptr");
  PM__BACKEND_OR_RETURN(b);
  pm_status_t st = check_device_side("pm_device_memset_async", "dptr", b, dptr, bytes);
  if (st != PM_OK) return st;
  if (bytes == 0) return PM_OK;
  return b->device_memset_async(dptr, value, bytes, stream);
}

/* 1: device side (device or managed), 0: host side, -1: unknown to the registry. */
static int tracked_side(const pm__range_t *r, bool known) {
  if (!known) return -1;
  if (r->kind == PM_MEMORY_DEVICE) return 1;
  /* Mapped pinned memory has a device address too (the same one under unified addressing), so
   * kernels and copies may use it from either side. */
  if ((r->kind == PM_MEMORY_POOL || r->kind == PM_MEMORY_REGISTERED) && !r->dev_base) return 0;
  return -1; /* managed and mapped memory are valid on both sides */
}


static pm_status_t check_copy(const char *fn, const pm__backend_t *b, void *dst, const void *src,
                              size_t bytes, pm_copy_kind_t *kind) {
  if (!dst) return PM__NULL_ARG(fn, "dst");
  if (!src) return PM__NULL_ARG(fn, "src");
  if ((unsigned)*kind > PM_COPY_H2H)
    return pm__set_error(PM_ERR_INVALID, "%s: unknown copy kind %d", fn, (int)*kind);
  pm__range_t rd, rs;
  bool kd, ks;
  pm_status_t st = check_span(fn, "dst", dst, bytes, &rd, &kd);
  if (st == PM_OK) st = check_span(fn, "src", src, bytes, &rs, &ks);
  if (st != PM_OK) return st;
  int dside = tracked_side(&rd, kd), sside = tracked_side(&rs, ks);

  if (*kind == PM_COPY_DEFAULT) {
    /* Inferred here for every backend, so the backend always gets an explicit direction.
     * Managed memory counts as device memory (the backend's pointer_kind says so too). */
    int dd = kd ? (rd.kind == PM_MEMORY_DEVICE || rd.kind == PM_MEMORY_MANAGED)
                : b->pointer_kind(dst) == PM__PTR_DEVICE;
    int sd = ks ? (rs.kind == PM_MEMORY_DEVICE || rs.kind == PM_MEMORY_MANAGED)
                : b->pointer_kind(src) == PM__PTR_DEVICE;
    *kind = dd ? (sd ? PM_COPY_D2D : PM_COPY_H2D) : (sd ? PM_COPY_D2H : PM_COPY_H2H);
    return PM_OK;
  }
  int want_d = (*kind == PM_COPY_H2D || *kind == PM_COPY_D2D);
  int want_s = (*kind == PM_COPY_D2H || *kind == PM_COPY_D2D);
  if (dside >= 0 && dside != want_d)
    return pm__set_error(PM_ERR_INVALID, "%s: copy kind %s but dst %p is %s", fn,
                         pm__copy_kind_name(*kind), dst, kind_desc(rd.kind));
  if (sside >= 0 && sside != want_s)
    return pm__set_error(PM_ERR_INVALID, "%s: copy kind %s but src %p is %s", fn,
                         pm__copy_kind_name(*kind), src, kind_desc(rs.kind));
  return PM_OK;
}

pm_status_t pm_memcpy_async(void *dst, const void *src, size_t bytes, pm_copy_kind_t kind,
                            pm_stream_t stream) {
  PM__BACKEND_OR_RETURN(b);
  pm_status_t st = check_copy("pm_memcpy_async", b, dst, src, bytes, &kind);
  if (st != PM_OK || bytes == 0) return st;
  return b->memcpy_async(dst, src, bytes, kind, stream);
}

/* The batch copy kernel's pieces: at most this many bytes each, so one thread block moves one
 * piece and the blocks of a launch share the work evenly whatever the item sizes. */
#define PM__BATCH_TILE ((size_t)64 << 10)
/* copy_batch=auto takes the kernel from this many items up, when they average at most
 * PM__BATCH_AUTO_MEAN bytes: many small pieces are where a DMA per piece loses the most. */
#define PM__BATCH_AUTO_MIN_ITEMS 64
#define PM__BATCH_AUTO_MEAN ((size_t)1 << 20)

static bool batch_wants_kernel(const pm__backend_t *b, size_t live, size_t total, bool kernel_ok) {
  if (!kernel_ok || live < 2 || !b->launch_batch_copy || !b->kernel_host_access) return false;
  long mode = pm__opt_int(PM__OPT_COPY_BATCH);
  if (mode == PM__BATCH_DMA) return false;
  if (mode == PM__BATCH_AUTO &&
      (live < PM__BATCH_AUTO_MIN_ITEMS || total / live > PM__BATCH_AUTO_MEAN))
    return false;
  return b->kernel_host_access() != 0;
}

/* The items as the kernel's pieces: each cut into tiles of at most PM__BATCH_TILE bytes. */
static pm_status_t batch_by_kernel(const pm__backend_t *b, const pm_copy_item_t *items,
                                   size_t count, pm_stream_t stream) {
  size_t n = 0;
  for (size_t i = 0; i < count; i++) n += (items[i].bytes + PM__BATCH_TILE - 1) / PM__BATCH_TILE;
  pm__copy_desc_t *d = malloc(n * sizeof *d);
  if (!d)
    return pm__set_error(PM_ERR_NOMEM, "pm_copy_batch_async: out of memory for %zu pieces", n);
  size_t k = 0;
  for (size_t i = 0; i < count; i++) {
    for (size_t off = 0; off < items[i].bytes; off += PM__BATCH_TILE) {
      d[k].src = (const char *)items[i].src + off;
      d[k].dst = (char *)items[i].dst + off;
      d[k].bytes = (uint64_t)PM__MIN(PM__BATCH_TILE, items[i].bytes - off);
      k++;
    }
  }
  pm_status_t st = b->launch_batch_copy(d, n, stream);
  free(d);
  return st;
}

pm_status_t pm__memcpy_batch_async(const pm_copy_item_t *items, size_t count, pm_copy_kind_t kind,
                                   pm_stream_t stream, bool kernel_ok) {
  PM__BACKEND_OR_RETURN(b);
  /* Every item is checked as pm_memcpy_async checks one, before anything is queued. */
  size_t live = 0, total = 0;
  for (size_t i = 0; i < count; i++) {
    pm_copy_kind_t k = kind;
    pm_status_t st =
        check_copy("pm_copy_batch_async", b, items[i].dst, items[i].src, items[i].bytes, &k);
    if (st != PM_OK) return pm__wrap_error(st, "item %zu", i);
    if (k == PM_COPY_H2H) kernel_ok = false;
    if (items[i].bytes) live++;
    total += items[i].bytes;
  }
  if (batch_wants_kernel(b, live, total, kernel_ok))
    return batch_by_kernel(b, items, count, stream);
  if (!b->memcpy_batch_async || live < 2) {
    for (size_t i = 0; i < count; i++) {
      if (!items[i].bytes) continue;
      pm_copy_kind_t k = kind;
      (void)check_copy("pm_copy_batch_async", b, items[i].dst, items[i].src, items[i].bytes, &k);
      pm_status_t st = b->memcpy_async(items[i].dst, items[i].src, items[i].bytes, k, stream);
      if (st != PM_OK) return st;
    }
    return PM_OK;
  }
  void **dsts = malloc(live * sizeof *dsts);
  const void **srcs = malloc(live * sizeof *srcs);
  size_t *sizes = malloc(live * sizeof *sizes);
  pm_status_t st = PM_OK;
  if (!dsts || !srcs || !sizes) {
    st = pm__set_error(PM_ERR_NOMEM, "pm_copy_batch_async: out of memory for %zu items", live);
  } else {
    size_t j = 0;
    for (size_t i = 0; i < count; i++) {
      if (!items[i].bytes) continue;
      dsts[j] = items[i].dst;
      srcs[j] = items[i].src;
      sizes[j] = items[i].bytes;
      j++;
    }
    st = b->memcpy_batch_async(dsts, srcs, sizes, live, stream);
  }
  free(dsts);
  free((void *)srcs);
  free(sizes);
  return st;
}

pm_status_t pm_memcpy(void *dst, const void *src, size_t bytes, pm_copy_kind_t kind) {
  PM__BACKEND_OR_RETURN(b);
  pm_status_t st = check_copy("pm_memcpy", b, dst, src, bytes, &kind);
  if (st != PM_OK || bytes == 0) return st;
  return b->memcpy_sync(dst, src, bytes, kind);
}

/* ------------------------------------------------------------------------------------------ */
/* Managed memory                                                                              */
/* ------------------------------------------------------------------------------------------ */

pm_status_t pm_managed_alloc(size_t bytes, void **ptr_out) {
  if (!ptr_out) return PM__NULL_ARG("pm_managed_alloc", "ptr_out");
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "pm_managed_alloc: bytes is 0");
  PM__BACKEND_OR_RETURN(b);
  void *p = NULL;
  pm_status_t st = b->managed_alloc(bytes, &p);
  if (st != PM_OK) return pm__wrap_error(st, "pm_managed_alloc(%zu bytes)", bytes);
  pm__range_t r = {(uintptr_t)p, bytes, PM_MEMORY_MANAGED, 0, NULL, NULL};
  st = pm__registry_add(&r);
  if (st != PM_OK) {
    b->managed_free(p);
    return pm__wrap_error(st, "pm_managed_alloc(%zu bytes)", bytes);
  }
  *ptr_out = p;
  return PM_OK;
}

pm_status_t pm_managed_free(void *ptr) {
  if (!ptr) return PM_OK; /* as free() and cudaFree() */
  pm__range_t r;
  pm_status_t st = lookup_kind("pm_managed_free", ptr, PM_MEMORY_MANAGED, true, &r);
  if (st != PM_OK) return st;
  PM__BACKEND_OR_RETURN(b);
  st = pm__registry_remove(r.base, PM_MEMORY_MANAGED, NULL);
  if (st != PM_OK) return pm__wrap_error(st, "pm_managed_free(%p)", ptr);
  st = b->managed_free(ptr);
  if (st != PM_OK) {
    pm__registry_add(&r);
    return pm__wrap_error(st, "pm_managed_free(%p)", ptr);
  }
  return PM_OK;
}

pm_status_t pm_managed_prefetch(const void *ptr, size_t bytes, int device, pm_stream_t stream) {
  static const char fn[] = "pm_managed_prefetch";
  if (!ptr) return PM__NULL_ARG(fn, "ptr");
  PM__BACKEND_OR_RETURN(b);
  pm_status_t st = check_device_index(fn, b, device, true);
  if (st != PM_OK) return st;
  pm__range_t r;
  bool known;
  st = check_span(fn, "ptr", ptr, bytes, &r, &known);
  if (st != PM_OK) return st;
  if (known && r.kind != PM_MEMORY_MANAGED)
    return pm__set_error(PM_ERR_WRONG_KIND, "%s(%p): the address is %s, not managed memory", fn,
                         ptr, kind_desc(r.kind));
  if (!known && b->pointer_kind(ptr) != PM__PTR_DEVICE)
    return pm__set_error(PM_ERR_NOT_FOUND, "%s(%p): not managed memory (use pm_managed_alloc)", fn,
                         ptr);
  if (bytes == 0) return PM_OK;
  return b->managed_prefetch(ptr, bytes, device, stream);
}

/* ------------------------------------------------------------------------------------------ */
/* Registration                                                                                */
/* ------------------------------------------------------------------------------------------ */

/* Drop a pending reservation made by pm_register. */
static void unreserve(uintptr_t base) {
  pthread_mutex_lock(&reg_lock);
  pm__registry_remove(base, PM_MEMORY_REGISTERED, NULL);
  pthread_mutex_unlock(&reg_lock);
}

pm_status_t pm_register(void *ptr, size_t bytes, unsigned flags) {
  static const char fn[] = "pm_register";
  if (!ptr) return PM__NULL_ARG(fn, "ptr");
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "%s(%p): bytes is 0", fn, ptr);
  if (flags & ~(unsigned)PM__REGISTER_ALL)
    return pm__set_error(PM_ERR_INVALID, "%s(%p): unknown flags 0x%x", fn, ptr,
                         flags & ~(unsigned)PM__REGISTER_ALL);
  if ((uintptr_t)ptr + bytes < (uintptr_t)ptr)
    return pm__set_error(PM_ERR_INVALID, "%s(%p, %zu): the range wraps the address space", fn, ptr,
                         bytes);
  PM__BACKEND_OR_RETURN(b);

  /* 1. Claim the range: the overlap check and the claim are one registry operation. */
  pm__range_t r = {(uintptr_t)ptr,          bytes, PM_MEMORY_REGISTERED,
                   flags | PM__REG_PENDING, NULL,  NULL};
  pthread_mutex_lock(&reg_lock);
  pm_status_t st = pm__registry_add(&r);
  pthread_mutex_unlock(&reg_lock);
  if (st != PM_OK) return pm__wrap_error(st, "%s(%p, %zu bytes)", fn, ptr, bytes);

  /* 2. Budget (may trim the pool's cache or wait, per the pool's policy). */
  pm_pool_t *pool = NULL;
  st = pm_pool_default(&pool);
  if (st != PM_OK) goto fail_reserved;
  st = pm__pool_charge(pool, bytes);
  if (st != PM_OK) goto fail_reserved;

  /* 3. Pin, and find the device address when mapped. */
  st = b->host_register(ptr, bytes, flags);
  if (st != PM_OK) goto fail_charged;
  void *dev = NULL;
  if (flags & PM_REGISTER_MAPPED) {
    st = b->host_device_pointer(ptr, &dev);
    if (st != PM_OK) goto fail_registered;
  }

  /* 4. Publish the final entry. The swap cannot fail: reg_lock keeps other registrations out of
   * the range and the array already has room for one entry. */
  pthread_mutex_lock(&reg_lock);
  pm__registry_remove(r.base, PM_MEMORY_REGISTERED, NULL);
  r.flags = flags;
  r.dev_base = dev;
  st = pm__registry_add(&r);
  pthread_mutex_unlock(&reg_lock);
  if (st != PM_OK) goto fail_registered_unlisted;
  return PM_OK;

fail_registered:
  unreserve(r.base);
fail_registered_unlisted:
  b->host_unregister(ptr, bytes);
  pm__pool_uncharge(pool, bytes);
  return pm__wrap_error(st, "%s(%p, %zu bytes)", fn, ptr, bytes);
fail_charged:
  pm__pool_uncharge(pool, bytes);
fail_reserved:
  unreserve(r.base);
  return pm__wrap_error(st, "%s(%p, %zu bytes)", fn, ptr, bytes);
}

pm_status_t pm_unregister(void *ptr) {
  static const char fn[] = "pm_unregister";
  if (!ptr) return PM__NULL_ARG(fn, "ptr");
  pm__range_t r;
  pthread_mutex_lock(&reg_lock);
  pm_status_t st = lookup_kind(fn, ptr, PM_MEMORY_REGISTERED, true, &r);
  if (st == PM_OK && (r.flags & PM__REG_PENDING))
    st = pm__set_error(PM_ERR_BUSY, "%s(%p): pm_register of this range has not returned yet", fn,
                       ptr);
  if (st == PM_OK) st = pm__registry_remove(r.base, PM_MEMORY_REGISTERED, NULL);
  pthread_mutex_unlock(&reg_lock);
  if (st != PM_OK) return st;

  const pm__backend_t *b = pm__backend();
  st = b ? b->host_unregister(ptr, r.size) : PM_ERR_NO_DEVICE;
  if (st != PM_OK) {
    pthread_mutex_lock(&reg_lock);
    pm__registry_add(&r); /* still pinned: keep it listed so the caller can retry */
    pthread_mutex_unlock(&reg_lock);
    return pm__wrap_error(st, "%s(%p)", fn, ptr);
  }
  pm_pool_t *pool = NULL;
  if (pm_pool_default(&pool) == PM_OK) pm__pool_uncharge(pool, r.size);
  return PM_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Pointer queries and pool-block calls                                                        */
/* ------------------------------------------------------------------------------------------ */

pm_status_t pm_pointer_query(const void *ptr, pm_pointer_info_t *info_out) {
  if (!info_out) return PM__NULL_ARG("pm_pointer_query", "info_out");
  pm_pointer_info_t info;
  memset(&info, 0, sizeof info);
  pm__range_t r;
  if (!ptr || !pm__registry_find(ptr, &r)) {
    info.kind = PM_MEMORY_PAGEABLE;
    *info_out = info;
    return PM_OK;
  }
  size_t off = (size_t)((uintptr_t)ptr - r.base);
  info.kind = r.kind;
  info.base = (void *)r.base;
  info.size = r.size;
  info.flags = r.flags & ~PM__REG_PENDING;
  info.in_use = 1;
  if (r.dev_base) info.device_ptr = (char *)r.dev_base + off;
  if (r.kind == PM_MEMORY_DEVICE || r.kind == PM_MEMORY_MANAGED) info.device_ptr = (void *)ptr;
  if (r.kind == PM_MEMORY_POOL) {
    info.pool = (pm_pool_t *)r.owner;
    info.in_use = 0;
    pm_status_t st = pm__pool_block_info((pm_pool_t *)r.owner, ptr, &info);
    if (st == PM_ERR_NOT_FOUND) {
      /* The segment was released between the registry lookup and this call: the address is no
       * longer pinned memory. */
      memset(&info, 0, sizeof info);
      info.kind = PM_MEMORY_PAGEABLE;
    } else if (st != PM_OK) {
      return pm__wrap_error(st, "pm_pointer_query(%p)", ptr);
    }
  }
  *info_out = info;
  return PM_OK;
}

pm_status_t pm_host_device_pointer(const void *ptr, void **dptr_out) {
  static const char fn[] = "pm_host_device_pointer";
  if (!ptr) return PM__NULL_ARG(fn, "ptr");
  if (!dptr_out) return PM__NULL_ARG(fn, "dptr_out");
  pm__range_t r;
  if (!pm__registry_find(ptr, &r))
    return pm__set_error(PM_ERR_INVALID,
                         "%s(%p): not pinned memory pinmem tracks (allocate it with "
                         "pm_host_alloc(PM_HOST_MAPPED) or pm_register(PM_REGISTER_MAPPED))",
                         fn, ptr);
  if (r.kind != PM_MEMORY_POOL && r.kind != PM_MEMORY_REGISTERED)
    return pm__set_error(PM_ERR_INVALID, "%s(%p): the address is %s, not mapped pinned memory", fn,
                         ptr, kind_desc(r.kind));
  if (!r.dev_base)
    return pm__set_error(PM_ERR_INVALID, "%s(%p): %s that is not mapped (use %s)", fn, ptr,
                         kind_desc(r.kind),
                         r.kind == PM_MEMORY_POOL ? "PM_HOST_MAPPED" : "PM_REGISTER_MAPPED");
  *dptr_out = (char *)r.dev_base + ((uintptr_t)ptr - r.base);
  return PM_OK;
}

pm_status_t pm_host_free(void *ptr) {
  if (!ptr) return PM_OK; /* as free() and cudaFreeHost() */
  pm__range_t r = {0};
  pm_status_t st = lookup_kind("pm_host_free", ptr, PM_MEMORY_POOL, false, &r);
  if (st != PM_OK) return st;
  return pm__pool_free((pm_pool_t *)r.owner, ptr);
}

pm_status_t pm_host_record_stream(void *ptr, pm_stream_t stream) {
  if (!ptr) return PM__NULL_ARG("pm_host_record_stream", "ptr");
  pm__range_t r = {0};
  pm_status_t st = lookup_kind("pm_host_record_stream", ptr, PM_MEMORY_POOL, false, &r);
  if (st != PM_OK) return st;
  /* The stream is used only at pm_host_free, where a bad one could no longer be reported to the
   * caller who made the mistake (the block would be quarantined). Ask the backend now: the host
   * backend knows its streams; CUDA answers a destroyed stream with an error. */
  PM__BACKEND_OR_RETURN(b);
  st = b->stream_query(stream);
  if (st != PM_OK && st != PM_NOT_READY)
    return pm__wrap_error(st, "pm_host_record_stream(%p, stream %p): not a usable stream", ptr,
                          (void *)stream);
  return pm__pool_record_stream((pm_pool_t *)r.owner, ptr, stream);
}

pm_status_t pm_host_usable_size(const void *ptr, size_t *bytes_out) {
  if (!ptr) return PM__NULL_ARG("pm_host_usable_size", "ptr");
  if (!bytes_out) return PM__NULL_ARG("pm_host_usable_size", "bytes_out");
  pm__range_t r = {0};
  pm_status_t st = lookup_kind("pm_host_usable_size", ptr, PM_MEMORY_POOL, false, &r);
  if (st != PM_OK) return st;
  return pm__pool_usable_size((pm_pool_t *)r.owner, ptr, bytes_out);
}
