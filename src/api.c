/*
 * DESIGN: the library's front door, on top of every layer. It tears everything down again
 * (pm_finalize; init.c picks and starts the backend), and wraps every public call that is a thin
 * layer over the backend: devices, streams, events, device memory, plain copies, managed memory,
 * registration and pointer queries. Each wrapper validates its arguments (and, through the
 * registry, the pointers it can know about) before the backend sees them, so bad input gets a
 * status and a message instead of a CUDA error or a crash of the host backend.
 *
 * The registry (registry.c) is the source of truth for what memory pinmem handed out or pinned:
 * device and managed allocations are added here, registrations too, pool segments by pool.c.
 * Release calls check the kind so that freeing memory with the wrong call is an error that names
 * the right call.
 *
 * Registration: a registration first reserves its range in the registry (marked "registering"),
 * so the overlap check and the claim are one atomic step before any backend call; then it
 * charges the default pool's budget, pins, and swaps in the final entry with its device address.
 * reg_lock serialises only the registry steps of pm_register/pm_unregister (the reservation and
 * the swap), never a backend call or a budget wait.
 *
 * Lock order: reg_lock ->
 * registry lock (a leaf). No lock of this file is held while calling the backend or the pool.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;

#define PM__REGISTER_ALL (PM_REGISTER_MAPPED | PM_REGISTER_PORTABLE | PM_REGISTER_READ_ONLY)

/* ------------------------------------------------------------------------------------------ */
/* Library, backend                                                                            */
/* ------------------------------------------------------------------------------------------ */

pm_status_t pm_finalize(void) {
  /* The default pool first: it frees through the backend and removes its registry ranges.
   * init_lock is not held here because the pool calls pm__backend(). */
  pm__copy_shutdown(); /* drains the copy engine's queue, which may still free bounce blocks */
  pm_status_t st = pm__pool_default_destroy();
  if (st != PM_OK) return pm__wrap_error(st, "pm_finalize: destroying the default pool");
  pm__threadpool_shutdown();

  pm__backend_stop();
  return PM_OK;
}

void pm__api_atfork(pm__fork_phase_t phase) {
  if (phase == PM__FORK_PREPARE) {
    pthread_mutex_lock(&reg_lock);
  } else if (phase == PM__FORK_PARENT) {
    pthread_mutex_unlock(&reg_lock);
  } else {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    reg_lock = fresh;
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Helpers                                                                                     */
/* ------------------------------------------------------------------------------------------ */

#define PM__NULL_ARG(fn, name) pm__set_error(PM_ERR_INVALID, "%s: %s is NULL", fn, name)

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
    /* In a forked child the likeliest cause is a block of the parent's (its registry is the
     * parent's alone): say so rather than leave the user to guess. */
    return pm__set_error(PM_ERR_NOT_FOUND,
                         "%s(%p): not %s (memory pinmem does not track, or already released)%s",
                         fn, ptr, pm__memory_kind_desc(want),
                         pm__fork_generation() == 0
                             ? ""
                             : "; this process was forked from one that used pinmem, and the "
                               "parent's memory is not the child's to release (its copy here "
                               "goes when the child exits)");
  if (r.kind != want)
    return pm__set_error(PM_ERR_WRONG_KIND, "%s(%p): the address is %s; release it with %s", fn,
                         ptr, pm__memory_kind_desc(r.kind), release_call(r.kind));
  if (exact && r.base != (uintptr_t)ptr)
    return pm__set_error(PM_ERR_NOT_FOUND,
                         "%s(%p): the address lies %zu bytes inside %s [%p, +%zu), not at its "
                         "start",
                         fn, ptr, (size_t)((uintptr_t)ptr - r.base), pm__memory_kind_desc(r.kind),
                         (void *)r.base, r.size);
  *out = r;
  return PM_OK;
}

static pm_status_t check_device_index(const char *fn, const pm__backend_t *b, int device,
                                      bool allow_cpu) {
  if (allow_cpu && device == PM_CPU_DEVICE) return PM_OK;
  if (pm__backend_is_fallback()) {
    char call[96];
    snprintf(call, sizeof call, "%s(device %d)", fn, device);
    return pm__fallback_refuse(call);
  }
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
  if (pm__backend_is_fallback()) {
    /* auto fell back: no CUDA device, whatever the host backend simulates (pm_backend_info and
     * `pinmem info` count 0 too). */
    *count_out = 0;
    return PM_OK;
  }
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
  if (st == PM_OK) st = b->set_device(device);
  if (st == PM_OK) pm__devices_used_mark(device); /* pm__pool_devices_idle reaches it */
  return st;
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
  pm_status_t st = pm__check_span(fn, what, ptr, bytes, &r, &known);
  if (st != PM_OK) return st;
  if (known) {
    if (r.kind == PM_MEMORY_DEVICE || r.kind == PM_MEMORY_MANAGED) return PM_OK;
    return pm__set_error(PM_ERR_INVALID, "%s: %s %p is %s, not device memory", fn, what, ptr,
                         pm__memory_kind_desc(r.kind));
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
pm_status_t pm_memcpy_async(void *dst, const void *src, size_t bytes, pm_copy_kind_t kind,
                            pm_stream_t stream) {
  PM__BACKEND_OR_RETURN(b);
  pm_status_t st = pm__check_copy("pm_memcpy_async", b, dst, src, bytes, &kind);
  if (st != PM_OK || bytes == 0) return st;
  return b->memcpy_async(dst, src, bytes, kind, stream);
}

pm_status_t pm_memcpy(void *dst, const void *src, size_t bytes, pm_copy_kind_t kind) {
  PM__BACKEND_OR_RETURN(b);
  pm_status_t st = pm__check_copy("pm_memcpy", b, dst, src, bytes, &kind);
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
  st = pm__check_span(fn, "ptr", ptr, bytes, &r, &known);
  if (st != PM_OK) return st;
  if (known && r.kind != PM_MEMORY_MANAGED)
    return pm__set_error(PM_ERR_WRONG_KIND, "%s(%p): the address is %s, not managed memory", fn,
                         ptr, pm__memory_kind_desc(r.kind));
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

/* What a registration costs the budget: the whole pages it pins (mlock and the driver pin
 * pages, not bytes), so 100 bytes count as a page. Two registrations that share a page each
 * count it: the budget is a cap, and errs high. */
static size_t reg_charge(uintptr_t base, size_t bytes) {
  size_t page = pm__page_size();
  uintptr_t lo = base / page * page;
  return pm__align_up((size_t)(base - lo) + bytes, page);
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
  size_t charge = reg_charge(r.base, bytes);
  st = pm_pool_default(&pool);
  if (st != PM_OK) goto fail_reserved;
  st = pm__pool_charge(pool, charge);
  if (st != PM_OK) goto fail_reserved;

  /* 3. Pin, and find the device address when mapped. */
  /* Always PORTABLE: copies of any device's streams may use it as pinned memory. */
  st = b->host_register(ptr, bytes, flags | PM_REGISTER_PORTABLE);
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
  pm__pool_uncharge(pool, charge);
  return pm__wrap_error(st, "%s(%p, %zu bytes)", fn, ptr, bytes);
fail_charged:
  pm__pool_uncharge(pool, charge);
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
  if (pm_pool_default(&pool) == PM_OK) pm__pool_uncharge(pool, reg_charge(r.base, r.size));
  return PM_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Pointer queries and pool-block calls                                                        */
/* ------------------------------------------------------------------------------------------ */

pm_status_t pm_pointer_query(const void *ptr, pm_pointer_info_t *info_out) {
  if (!info_out) return PM__NULL_ARG("pm_pointer_query", "info_out");
  return pm__pointer_info(ptr, info_out);
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
                         ptr, pm__memory_kind_desc(r.kind));
  if (!r.dev_base)
    return pm__set_error(PM_ERR_INVALID, "%s(%p): %s that is not mapped (use %s)", fn, ptr,
                         pm__memory_kind_desc(r.kind),
                         r.kind == PM_MEMORY_POOL ? "PM_HOST_MAPPED" : "PM_REGISTER_MAPPED");
  /* The registry knows the segment; the block decides. A freed block (or the free rest of a
   * segment) is the pool's, not the caller's: a device address into it is a use after free, as
   * pm_host_usable_size and pm_host_shared_fd refuse it. */
  pm_pointer_info_t block;
  if (r.kind == PM_MEMORY_POOL &&
      (pm__pool_block_info((pm_pool_t *)r.owner, ptr, &block) != PM_OK || !block.in_use))
    return pm__set_error(PM_ERR_INVALID, "%s(%p): the pool block holding it was freed", fn, ptr);
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
