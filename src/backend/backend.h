/*
 * DESIGN: the backend contract. Everything above this file (pool, registry, copy engine,
 * loader, CLI) talks to a device only through one of these tables, so the same code and the
 * same tests run on the CUDA driver (backend_cuda.c) and on the host backend, where the CPU plays
 * the device.
 *
 * Rules every backend keeps:
 * - Each call returns pm_status_t and, on failure, records the detail with pm__set_error()
 *   (the failing call and its message). Outputs are written only on success.
 * - Streams run their work in submission order; an event completes when all work queued before
 *   its record on that stream is done; stream_wait_event captures the event's last record at the
 *   time of the call. A NULL stream is the device's default stream.
 * - Copies from or to pageable host memory block the caller as CUDA does: the stream's earlier
 *   work finishes, the copy happens, then the call returns. Copies that touch only pinned and
 *   device memory are queued and return at once.
 * - No backend call takes a lock of the layers above it, so they may call it without holding
 *   theirs (the pool never calls the backend under its lock).
 */
#ifndef PINMEM_BACKEND_H
#define PINMEM_BACKEND_H

#include "kernels.h" /* pm__copy_desc_t */
#include "pinmem.h"

/* pointer_kind's answers. */
enum { PM__PTR_OTHER = 0, PM__PTR_DEVICE = 1, PM__PTR_PINNED = 2 };

typedef struct pm__backend {
  const char *name;
  pm_backend_kind_t kind;

  /* Start the backend. PM_ERR_NO_DEVICE when it cannot run here (cuda without a device). */
  pm_status_t (*init)(void);
  void (*shutdown)(void);

  pm_status_t (*device_count)(int *count_out);
  pm_status_t (*device_info)(int device, pm_device_info_t *info_out);
  pm_status_t (*set_device)(int device);
  pm_status_t (*get_device)(int *device_out);
  pm_status_t (*device_synchronize)(void);
  /* Optional (NULL where a thread always has a device, as on the host backend): the calling
   * thread's device, or -1 where it has none yet (cuda: no current context, where get_device
   * answers 0 as CUDA's runtime does), and the way back to none. A call that makes another
   * device current for its work and gives the caller its own back (a block store's calls, a
   * broadcast) takes them: given device 0 back, a thread that had none would get GPU 0's
   * primary context, hundreds of MB there in a process that never used GPU 0. */
  pm_status_t (*bound_device)(int *device_out);
  pm_status_t (*unbind_device)(void);

  /* Pinned host memory allocated by the backend (cudaHostAlloc / mmap+mlock). flags: PM_HOST_*. */
  pm_status_t (*host_alloc)(size_t bytes, unsigned flags, void **ptr_out);
  pm_status_t (*host_free)(void *ptr, size_t bytes);
  /* Page-lock existing memory (cudaHostRegister / mlock). flags: PM_REGISTER_*. */
  pm_status_t (*host_register)(void *ptr, size_t bytes, unsigned flags);
  pm_status_t (*host_unregister)(void *ptr, size_t bytes);
  /* Device address of mapped pinned host memory (cudaHostGetDevicePointer). */
  pm_status_t (*host_device_pointer)(void *host_ptr, void **dptr_out);

  pm_status_t (*device_alloc)(size_t bytes, void **dptr_out);
  pm_status_t (*device_free)(void *dptr);
  pm_status_t (*device_memset_async)(void *dptr, int value, size_t bytes, pm_stream_t stream);

  pm_status_t (*managed_alloc)(size_t bytes, void **ptr_out);
  pm_status_t (*managed_free)(void *ptr);
  pm_status_t (*managed_prefetch)(const void *ptr, size_t bytes, int device, pm_stream_t stream);

  pm_status_t (*stream_create)(pm_stream_t *stream_out);
  pm_status_t (*stream_destroy)(pm_stream_t stream);
  pm_status_t (*stream_synchronize)(pm_stream_t stream);
  pm_status_t (*stream_query)(pm_stream_t stream); /* PM_OK or PM_NOT_READY */
  pm_status_t (*stream_wait_event)(pm_stream_t stream, pm_event_t event);

  pm_status_t (*event_create)(unsigned flags, pm_event_t *event_out);
  pm_status_t (*event_destroy)(pm_event_t event);
  pm_status_t (*event_record)(pm_event_t event, pm_stream_t stream);
  pm_status_t (*event_query)(pm_event_t event); /* PM_OK or PM_NOT_READY */
  pm_status_t (*event_synchronize)(pm_event_t event);
  pm_status_t (*event_elapsed)(pm_event_t start, pm_event_t end, double *seconds_out);

  /* kind is never PM_COPY_DEFAULT here except where the backend can infer it (cuda: UVA). */
  pm_status_t (*memcpy_async)(void *dst, const void *src, size_t bytes, pm_copy_kind_t kind,
                              pm_stream_t stream);
  pm_status_t (*memcpy_sync)(void *dst, const void *src, size_t bytes, pm_copy_kind_t kind);

  pm_status_t (*launch_busy)(pm_stream_t stream, double seconds);
  pm_status_t (*launch_host_func)(pm_stream_t stream, void (*fn)(void *), void *arg);

  /* What the backend knows of an address, whoever allocated it: PM__PTR_DEVICE (device or
   * managed memory: copy directions are inferred from it), PM__PTR_PINNED (page-locked host
   * memory, also when another library pinned it: cudaHostAlloc, cudaHostRegister, PyTorch's
   * pin_memory; the copy engine gives it one DMA instead of staging it) or PM__PTR_OTHER
   * (pageable memory, or nothing the backend knows). One cheap query (0.07-0.2 us on the H200). */
  int (*pointer_kind)(const void *ptr);
  /* Optional: the device whose memory ptr is (device memory, not managed), else -1 (managed
   * memory, which any device may reach; host memory; an address the backend does not know).
   * Callers that launch on one device's stream check memory given to them with it. */
  int (*pointer_device)(const void *ptr);
  /* Optional: the device a stream belongs to, else -1 (a stream the backend cannot tell). NULL,
   * and the cuda backend's CU_STREAM_LEGACY and CU_STREAM_PER_THREAD handles, name the default
   * stream of whichever device is current: the answer is the current device, so a caller checks
   * them with the device it will queue on current. Callers that queue for one device check the
   * streams given to them with it (pm__backend_stream_other_device). */
  int (*stream_device)(pm_stream_t stream);

  /* Optional (NULL where the backend has none): `count` copies, stream-ordered on `stream`, in
   * one call (cudaMemcpyBatchAsync); the direction of each follows from its pointers. Callers
   * fall back to a loop of memcpy_async. */
  pm_status_t (*memcpy_batch_async)(void *const *dsts, const void *const *srcs, const size_t *sizes,
                                    size_t count, pm_stream_t stream);

  /* Optional: copy desc[0..count) by the device itself (one kernel per 1024 pieces, cuda; a
   * stream op, host), stream-ordered on `stream`. desc is read during the call only. Every src
   * and dst must be addressable by the device where it is: device or managed memory, or pinned
   * host memory when kernel_host_access() says so. */
  pm_status_t (*launch_batch_copy)(const pm__copy_desc_t *desc, size_t count, pm_stream_t stream);
  /* Optional: 1 if kernels on the current device can use pinned host memory at its host address
   * (unified addressing and cudaDevAttrCanUseHostPointerForRegisteredMem), else 0. */
  int (*kernel_host_access)(void);
} pm__backend_t;

/* A device other than `device` that owns memory at `first` or `last` (both ends: a range may run
 * into another allocation), else -1: the same device, managed memory, or a backend that cannot
 * tell (no pointer_device). */
static inline int pm__backend_other_device(const pm__backend_t *b, const void *first,
                                           const void *last, int device) {
  if (!b->pointer_device) return -1;
  int d0 = b->pointer_device(first), d1 = b->pointer_device(last);
  return d0 >= 0 && d0 != device ? d0 : d1 >= 0 && d1 != device ? d1 : -1;
}
/* The device of `stream` when it is not `device`, else -1: the same device, NULL (the current
 * device's default stream), or a backend that cannot tell (no stream_device, or -1 from it).
 * Called with `device` current, so the handles that name the current device's default stream
 * answer `device`. */
static inline int pm__backend_stream_other_device(const pm__backend_t *b, pm_stream_t stream,
                                                  int device) {
  int d = stream && b->stream_device ? b->stream_device(stream) : -1;
  return d >= 0 && d != device ? d : -1;
}

/* backend_host_stream.c (the host backend; its memory: backend_host_memory.c) */
extern const pm__backend_t pm__backend_host;
/* backend_cuda.c (in every build unless configured with -DPINMEM_CUDA=OFF) */
extern const pm__backend_t pm__backend_cuda;

/* What the cuda backend's driver probe found, for pm_backend_info (zeros and empty strings where
 * nothing was probed). */
typedef struct pm__cuda_status {
  int compiled;        /* 1: the cuda backend is in this build */
  int driver_version;  /* cuDriverGetVersion (12040 = 12.4), 0 without a driver */
  int device_count;    /* devices the driver shows, once it started */
  char library[256];   /* the driver library opened (libcuda.so.1 or PINMEM_CUDA_DRIVER) */
  char missing[256];   /* optional driver calls this driver lacks, and what that costs */
  char kernels[512];   /* why pinmem's kernels could not load, or run in smaller launches */
} pm__cuda_status_t;
void pm__cuda_status(pm__cuda_status_t *out);
/* 1 once cuInit succeeded in this process: from then on a forked child may not call the driver
 * (it answers CUDA_ERROR_NOT_INITIALIZED there), whichever backend the parent kept. */
int pm__cuda_driver_started(void);

#endif /* PINMEM_BACKEND_H */
