/*
 * DESIGN: the work the host backend queues on its streams (the engine: backend_host_stream.c):
 * copies, memset, managed prefetch, the batch-copy "kernel", the timed busy kernel and host
 * functions, plus device and managed frees (which synchronize the device first, as cudaFree
 * does) and the backend table that joins the memory half, the engine and the events. A copy
 * with a pageable host side, or host to host, blocks like CUDA's: it queues a gate op and copies
 * on the caller's thread while the stream's worker holds at the gate, so it comes after the
 * stream's earlier work and before its later work. Every other op is queued and runs on the
 * stream's worker. No lock is held while an op runs.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "backend_host.h"

#define HB_BUSY_MAX_SECONDS 1.0e6 /* same bound as the cuda backend */

/* ------------------------------------------------------------------------------------------ */
/* Device and managed memory release                                                           */
/* ------------------------------------------------------------------------------------------ */

static pm_status_t device_release(const char *fn, void *ptr) {
  if (!ptr) return pm__set_error(PM_ERR_INVALID, "%s: ptr is NULL", fn);
  /* cudaFree synchronizes the device before it returns memory: queued copies and kernels that
   * still use it finish first. Model that, so freeing after a failed or skipped stream
   * synchronize cannot pull memory out from under a stream's worker. */
  pm__hb_count_call();
  /* Every device's streams: the memory may be in use by streams of any device (peer copies). */
  pm_status_t sync = pm__hb_sync_streams(fn, -1);
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
    return pm__set_error(
        PM_ERR_INVALID, "%s: the %s [%p, +%zu) runs past the end of its %s [%p, +%zu)", fn, what,
        ptr, bytes, pm__hb_range_desc(sd->dev.kind), (void *)sd->dev.base, sd->dev.size);
  return PM_OK;
}

/* Validate a copy, resolve PM_COPY_DEFAULT, and say whether it blocks the caller: a pageable
 * host side, or host to host (synchronous with respect to the host in CUDA, pinned or not). */
static pm_status_t copy_prepare(const char *fn, void *dst, const void *src, size_t bytes,
                                pm_copy_kind_t *kind, bool *blocking_out, int stream_device) {
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
    *kind = hb_in_dev(&s) ? (hb_in_dev(&d) ? PM_COPY_D2D : PM_COPY_D2H)
                          : (hb_in_dev(&d) ? PM_COPY_H2D : PM_COPY_H2H);
  bool dst_dev = *kind == PM_COPY_H2D || *kind == PM_COPY_D2D;
  bool src_dev = *kind == PM_COPY_D2H || *kind == PM_COPY_D2D;
  pm_status_t st = check_side(fn, *kind, "destination", dst, bytes, &d, dst_dev);
  if (st == PM_OK) st = check_side(fn, *kind, "source", src, bytes, &s, src_dev);
  if (st != PM_OK) return st;
  /* Device memory of another device than the stream's moves through peer access or the host,
   * not the stream's own copy engine: under CUDA it runs, silently on the wrong device. */
  const hb_side_t *sides[2] = {&d, &s};
  for (int k = 0; k < 2; k++)
    if (stream_device >= 0 && sides[k]->kind == PM__MEM_DEVICE &&
        sides[k]->dev.device != stream_device)
      pm__hb_mismatch("%s: %s %p is memory of device %d, queued on a stream of device %d", fn,
                      k ? "source" : "destination", k ? src : (const void *)dst,
                      sides[k]->dev.device, stream_device);
    else if (stream_device >= 0 && sides[k]->kind == PM__MEM_PINNED && sides[k]->pin_device >= 0 &&
             sides[k]->pin_device != stream_device)
      pm__hb_mismatch(
          "%s: %s %p was pinned without PORTABLE for device %d, copied on a stream "
          "of device %d",
          fn, k ? "source" : "destination", k ? src : (const void *)dst, sides[k]->pin_device,
          stream_device);
  /* Managed memory is never pageable: the driver handles it on either side. */
  *blocking_out = *kind == PM_COPY_H2H || (!dst_dev && d.kind == PM__MEM_PAGEABLE) ||
                  (!src_dev && s.kind == PM__MEM_PAGEABLE);
  return PM_OK;
}

/* The blocking path: as with CUDA's driver, the caller blocks until the stream's earlier work is
 * done, the copy (done here, on the calling thread) is over, and later work may go on. */
static pm_status_t copy_blocking(const char *fn, void *dst, const void *src, size_t bytes,
                                 pm_stream_t h) {
  hb_op_t *op = pm__hb_op_new(fn, OP_GATE);
  if (!op) return PM_ERR_NOMEM;
  struct pm_stream_s *s = NULL;
  pm_status_t st = pm__hb_stream_find(fn, h, NULL, op, &s);
  if (st != PM_OK) return st;
  if (pm__hb_on_own_worker(s)) {
    pthread_mutex_unlock(&pm__hb_obj_lock);
    free(op);
    return pm__set_error(PM_ERR_STATE,
                         "%s: a blocking copy (pageable memory or host to host), called from a "
                         "host function running on the same stream (it would wait for itself)",
                         fn);
  }
  pm__hb_stream_enter(s);
  pm__hb_enqueue_locked(s, op);
  s->users++;
  while (!op->u.gate.reached) pthread_cond_wait(&s->cv_state, &s->mu);
  pthread_mutex_unlock(&s->mu);

  memmove(dst, src, bytes);

  pthread_mutex_lock(&s->mu);
  op->u.gate.released = true; /* the worker frees op from here on */
  pthread_cond_signal(&s->cv_work);
  pm__hb_user_leave_locked(s);
  pthread_mutex_unlock(&s->mu);
  return PM_OK;
}

static pm_status_t memcpy_async(void *dst, const void *src, size_t bytes, pm_copy_kind_t kind,
                                pm_stream_t stream) {
  static const char fn[] = "memcpy_async";
  if ((unsigned)kind > PM_COPY_H2H)
    return pm__set_error(PM_ERR_INVALID, "%s: unknown copy kind %d", fn, (int)kind);
  pm__hb_count_call();
  if (bytes == 0) return PM_OK; /* as cudaMemcpyAsync */
  bool blocking = true;
  pm_status_t st =
      copy_prepare(fn, dst, src, bytes, &kind, &blocking, pm__hb_stream_device(stream));
  if (st != PM_OK) return st;
  if (blocking) return copy_blocking(fn, dst, src, bytes, stream);
  hb_op_t *op = pm__hb_op_new(fn, OP_COPY);
  if (!op) return PM_ERR_NOMEM;
  op->u.copy.dst = dst;
  op->u.copy.src = src;
  op->u.copy.bytes = bytes;
  return pm__hb_submit(fn, stream, op);
}

static pm_status_t memcpy_sync(void *dst, const void *src, size_t bytes, pm_copy_kind_t kind) {
  pm__hb_count_call();
  if ((unsigned)kind > PM_COPY_H2H)
    return pm__set_error(PM_ERR_INVALID, "memcpy_sync: unknown copy kind %d", (int)kind);
  if (bytes == 0) return PM_OK;
  pm_status_t st = memcpy_async(dst, src, bytes, kind, NULL);
  if (st != PM_OK) return pm__wrap_error(st, "memcpy_sync");
  return pm__hb_stream_synchronize(NULL);
}

static pm_status_t device_memset_async(void *dptr, int value, size_t bytes, pm_stream_t stream) {
  static const char fn[] = "device_memset_async";
  pm__hb_count_call();
  if (!dptr) return pm__set_error(PM_ERR_INVALID, "%s: ptr is NULL", fn);
  if (bytes == 0) return PM_OK;
  pm_status_t st = pm__hb_check_device_span(fn, "destination", dptr, bytes, -1);
  if (st != PM_OK) return st;
  hb_side_t d, unused;
  pm__hb_classify(dptr, dptr, bytes, &d, &unused);
  int sdev = pm__hb_stream_device(stream);
  if (d.kind == PM__MEM_DEVICE && sdev >= 0 && d.dev.device != sdev)
    pm__hb_mismatch("%s: %p is memory of device %d, set on a stream of device %d", fn, dptr,
                    d.dev.device, sdev);
  hb_op_t *op = pm__hb_op_new(fn, OP_MEMSET);
  if (!op) return PM_ERR_NOMEM;
  op->u.set.dst = dptr;
  op->u.set.value = value;
  op->u.set.bytes = bytes;
  return pm__hb_submit(fn, stream, op);
}

static pm_status_t managed_prefetch(const void *ptr, size_t bytes, int device, pm_stream_t stream) {
  static const char fn[] = "managed_prefetch";
  pm__hb_count_call();
  if (!ptr) return pm__set_error(PM_ERR_INVALID, "%s: ptr is NULL", fn);
  if (device != PM_CPU_DEVICE && pm__hb_check_device(fn, device) != PM_OK)
    return pm__wrap_error(PM_ERR_INVALID, "(PM_CPU_DEVICE is the host)");
  pm_status_t st = pm__hb_check_device_span(fn, "range", ptr, bytes, R_MANAGED);
  if (st != PM_OK || bytes == 0) return st;
  hb_op_t *op = pm__hb_op_new(fn, OP_PREFETCH);
  if (!op) return PM_ERR_NOMEM;
  return pm__hb_submit(fn, stream, op);
}

/* A kernel launch fails under CUDA on a stream that is not the current device's. */
static void check_launch_device(const char *fn, pm_stream_t stream) {
  int sdev = pm__hb_stream_device(stream), cur = pm__hb_current();
  if (sdev >= 0 && sdev != cur)
    pm__hb_mismatch("%s: stream %p of device %d while device %d is current", fn, (void *)stream,
                    sdev, cur);
}

/* The CPU plays the kernel: a stream op that copies every piece when the stream reaches it. The
 * pieces are checked now as a kernel's pointers would have to be valid: device or managed memory,
 * or pinned host memory (pageable memory is an error, as a kernel could not reach it). */
static pm_status_t launch_batch_copy(const pm__copy_desc_t *desc, size_t count,
                                     pm_stream_t stream) {
  static const char fn[] = "launch_batch_copy";
  pm__hb_count_call();
  if (count == 0) return PM_OK;
  if (!desc) return pm__set_error(PM_ERR_INVALID, "%s: desc is NULL", fn);
  if (count > (SIZE_MAX - sizeof(hb_op_t)) / sizeof *desc)
    return pm__set_error(PM_ERR_INVALID, "%s: %zu pieces", fn, count);
  for (size_t i = 0; i < count; i++) {
    pm_copy_kind_t kind = PM_COPY_DEFAULT;
    bool blocking = false;
    /* A kernel may touch any device's memory through peer access: no stream device check. */
    pm_status_t st =
        copy_prepare(fn, desc[i].dst, desc[i].src, (size_t)desc[i].bytes, &kind, &blocking, -1);
    if (st != PM_OK) return pm__wrap_error(st, "piece %zu", i);
    if (blocking)
      return pm__set_error(PM_ERR_INVALID,
                           "%s: piece %zu (%p -> %p, %llu bytes) touches pageable host memory "
                           "or goes host to host: a kernel copies only device, managed and "
                           "pinned memory",
                           fn, i, desc[i].src, desc[i].dst, (unsigned long long)desc[i].bytes);
  }
  check_launch_device(fn, stream);
  hb_op_t *op = calloc(1, sizeof *op + count * sizeof *desc);
  if (!op) return pm__set_error(PM_ERR_NOMEM, "%s: out of memory for %zu pieces", fn, count);
  op->kind = OP_BATCH;
  pm__copy_desc_t *copy = (pm__copy_desc_t *)(void *)(op + 1);
  memcpy(copy, desc, count * sizeof *desc);
  op->u.batch.desc = copy;
  op->u.batch.count = count;
  return pm__hb_submit(fn, stream, op);
}

static int kernel_host_access(void) {
  return 1; /* the "device" is the CPU: every pinned byte is at hand */
}

static pm_status_t launch_busy(pm_stream_t stream, double seconds) {
  pm__hb_count_call();
  if (!(seconds >= 0.0) || seconds > HB_BUSY_MAX_SECONDS) /* !(x >= 0) also rejects NaN */
    return pm__set_error(PM_ERR_INVALID, "launch_busy: %g seconds is not in [0, %g]", seconds,
                         HB_BUSY_MAX_SECONDS);
  check_launch_device("launch_busy", stream);
  hb_op_t *op = pm__hb_op_new("launch_busy", OP_BUSY);
  if (!op) return PM_ERR_NOMEM;
  op->u.seconds = seconds;
  return pm__hb_submit("launch_busy", stream, op);
}

static pm_status_t launch_host_func(pm_stream_t stream, void (*fn)(void *), void *arg) {
  pm__hb_count_call();
  if (!fn) return pm__set_error(PM_ERR_INVALID, "launch_host_func: fn is NULL");
  hb_op_t *op = pm__hb_op_new("launch_host_func", OP_HOST_FUNC);
  if (!op) return PM_ERR_NOMEM;
  op->u.func.fn = fn;
  op->u.func.arg = arg;
  return pm__hb_submit("launch_host_func", stream, op);
}

const pm__backend_t pm__backend_host = {
    .name = "host",
    .kind = PM_BACKEND_HOST,
    .init = pm__hb_init,
    .shutdown = pm__hb_shutdown,
    .device_count = pm__hb_device_count,
    .device_info = pm__hb_device_info,
    .set_device = pm__hb_set_device,
    .get_device = pm__hb_get_device,
    .device_synchronize = pm__hb_device_synchronize,
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
    .stream_create = pm__hb_stream_create,
    .stream_destroy = pm__hb_stream_destroy,
    .stream_synchronize = pm__hb_stream_synchronize,
    .stream_query = pm__hb_stream_query,
    .stream_wait_event = pm__hb_stream_wait_event,
    .event_create = pm__hb_event_create,
    .event_destroy = pm__hb_event_destroy,
    .event_record = pm__hb_event_record,
    .event_query = pm__hb_event_query,
    .event_synchronize = pm__hb_event_synchronize,
    .event_elapsed = pm__hb_event_elapsed,
    .memcpy_async = memcpy_async,
    .memcpy_sync = memcpy_sync,
    .launch_busy = launch_busy,
    .launch_batch_copy = launch_batch_copy,
    .kernel_host_access = kernel_host_access,
    .launch_host_func = launch_host_func,
    .pointer_kind = pm__hb_pointer_kind,
    .pointer_device = pm__hb_pointer_device,
    .stream_device = pm__hb_stream_device,
};
