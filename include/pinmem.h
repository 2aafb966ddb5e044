/*
 * pinmem: page-locked ("pinned") host memory and fast host<->GPU data movement.
 *
 * This is the one public header. Every fallible call returns pm_status_t (PM_OK == 0, errors
 * negative); output arguments are written only on success; pm_last_error() gives the detail of
 * the last failure on the calling thread (the failing system or CUDA call, the limit, the path).
 *
 * Backends: "cuda" (the CUDA driver, loaded at run time) and "host" (the CPU plays the device, so
 * the whole API works on machines without a GPU). PINMEM_BACKEND=auto|cuda|host selects one; auto
 * takes cuda when a device is present, else falls back to host and refuses device memory, saying
 * why (pm_backend_info). All calls initialise the library on first use; pm_init() does it
 * explicitly.
 */
#ifndef PINMEM_H
#define PINMEM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define PM_API __attribute__((visibility("default")))
#else
#define PM_API
#endif

#define PINMEM_VERSION_MAJOR 0
#define PINMEM_VERSION_MINOR 1
#define PINMEM_VERSION_PATCH 0

/* ------------------------------------------------------------------------------------------ */
/* Status codes                                                                                */
/* ------------------------------------------------------------------------------------------ */

/** One table for every status: name, value, message. pm_strerror and pm_status_name come from
 *  it, so they cannot drift. PM_NOT_READY is positive: it is an answer, not an error. */
#define PM_STATUS_MAP(X)                                                                        \
  X(PM_OK, 0, "success")                                                                        \
  X(PM_NOT_READY, 1, "work not complete yet")                                                   \
  X(PM_ERR_INVALID, -1, "invalid argument")                                                     \
  X(PM_ERR_NOMEM, -2, "out of host memory")                                                     \
  X(PM_ERR_BUDGET, -3, "pinned-memory budget exhausted")                                        \
  X(PM_ERR_MEMLOCK, -4, "locked-memory limit (RLIMIT_MEMLOCK) too low")                         \
  X(PM_ERR_NO_DEVICE, -5, "no usable device")                                                   \
  X(PM_ERR_BACKEND, -6, "backend call failed")                                                  \
  X(PM_ERR_NOT_FOUND, -7, "address not known to pinmem")                                        \
  X(PM_ERR_OVERLAP, -8, "range overlaps memory pinmem already tracks")                          \
  X(PM_ERR_DOUBLE_FREE, -9, "memory already freed or unregistered")                             \
  X(PM_ERR_WRONG_KIND, -10, "call does not match how the memory was obtained")                  \
  X(PM_ERR_BUSY, -11, "object still in use")                                                    \
  X(PM_ERR_TIMEOUT, -12, "timed out")                                                           \
  X(PM_ERR_UNSUPPORTED, -13, "not supported by this backend or device")                         \
  X(PM_ERR_CONFIG, -14, "invalid configuration value")                                          \
  X(PM_ERR_IO, -15, "input/output error")                                                       \
  X(PM_ERR_FORMAT, -16, "malformed input data")                                                 \
  X(PM_ERR_STATE, -17, "object is not in a state that allows this call")                        \
  X(PM_ERR_DEVICE_MEMORY, -18, "out of device memory")                                          \
  X(PM_ERR_INTERNAL, -19, "internal error")

typedef enum pm_status {
#define PM__STATUS_ENUM(name, value, msg) name = value,
  PM_STATUS_MAP(PM__STATUS_ENUM)
#undef PM__STATUS_ENUM
} pm_status_t;

/** Fixed message for a status ("invalid argument"); never NULL. */
PM_API const char *pm_strerror(pm_status_t status);
/** Symbolic name of a status ("PM_ERR_INVALID"); never NULL. */
PM_API const char *pm_status_name(pm_status_t status);
/** Detail of the last failure on this thread ("cudaHostRegister(0x7f.., 1073741824): ..."), or
 *  "" if the thread has none. Valid until the thread's next pinmem call. */
PM_API const char *pm_last_error(void);
/** "0.1.0" */
PM_API const char *pm_version(void);

/* ------------------------------------------------------------------------------------------ */
/* Library, backend, devices                                                                   */
/* ------------------------------------------------------------------------------------------ */

/* The small enums below are each generated from one X-macro list, X(name, value, text), as the
 * status map is, so their name tables (pinmem's own and the tools') cannot miss a value. */
#define PM_BACKEND_KIND_MAP(X)                                                                  \
  X(PM_BACKEND_NONE, 0, "none") /* not initialised, or initialisation failed */                 \
  X(PM_BACKEND_CUDA, 1, "cuda")                                                                 \
  X(PM_BACKEND_HOST, 2, "host")

#define PM__ENUM_VALUE(name, value, ...) name = value,

typedef enum pm_backend_kind { PM_BACKEND_KIND_MAP(PM__ENUM_VALUE) } pm_backend_kind_t;

/** Select and start the backend (PINMEM_BACKEND / pm_option_set("backend")). Idempotent and
 *  thread-safe; every other call does it implicitly. PM_ERR_NO_DEVICE if "cuda" was asked for
 *  and no device is usable. */
/*  fork(): a child forked after pinmem was used starts afresh; nothing of the parent is claimed.
 *  - host backend: every call works in the child. Threads pinmem needs (streams, completion,
 *    staging, loader workers) start there on demand; the parent's registrations and pool blocks
 *    are not pinned in the child (mlock is not inherited) and pm_pointer_query says pageable.
 *  - the parent's pools, datasets, loaders and fences are foreign in the child: every call on one
 *    fails with PM_ERR_STATE, and its destroy only forgets it (returns PM_OK at once, frees and
 *    joins nothing). The parent's streams, events and device memory are unknown there
 *    (PM_ERR_INVALID / PM_ERR_NOT_FOUND).
 *  - cuda backend: the CUDA driver cannot be used in a forked child, so the child's first call
 *    that needs the backend fails at once with PM_ERR_STATE ("use the spawn or forkserver start
 *    method"); pinmem makes no CUDA call in such a child, pm_finalize included. The same holds
 *    after pm_finalize, and after any start that got as far as cuInit: the driver stays
 *    started in the parent (a fallback to the host backend stays a fallback in the child).
 *  A child that forks before any pinmem call, or never calls pinmem, is unaffected. */
PM_API pm_status_t pm_init(void);
/** Release the default pool and global state. Only for orderly shutdown (leak checkers); no
 *  other pinmem call may run concurrently, and no pinmem memory may be in use. */
PM_API pm_status_t pm_finalize(void);
PM_API pm_backend_kind_t pm_backend_kind(void);
/** "cuda", "host" or "none". */
PM_API const char *pm_backend_name(void);

/** Why the backend in force is the one it is, and what the CUDA driver offers (no silent CPU).
 *  With option backend auto (the default) pinmem takes cuda when the NVIDIA driver
 *  (libcuda.so.1, or the file PINMEM_CUDA_DRIVER names) loads, is CUDA 12.0 (r525) or newer and
 *  shows a device; else it falls back to the host backend, and then every request for device
 *  memory fails with PM_ERR_NO_DEVICE, the reason and how to simulate devices on purpose
 *  (PINMEM_BACKEND=host, which keeps the host backend's simulated devices). */
typedef struct pm_backend_info {
  pm_backend_kind_t kind; /* the backend in force (PM_BACKEND_NONE if none could start) */
  int requested;          /* what option backend asked: PM_BACKEND_CUDA, PM_BACKEND_HOST, or
                             PM_BACKEND_NONE for auto */
  int fallback;           /* 1: auto wanted cuda and fell back to host: no device memory */
  int cuda_compiled;      /* 1: this build has the cuda backend (every build unless
                             configured with -DPINMEM_CUDA=OFF) */
  int driver_version;     /* cuDriverGetVersion (12040 = 12.4); 0 where no driver loaded */
  int device_count;       /* devices of the backend in force */
  char reason[640];       /* "auto: a CUDA device is present", "auto: no NVIDIA driver found
                             (libcuda.so.1: ...)", "PINMEM_BACKEND=host", ... */
  char driver_library[256]; /* the driver library tried, "" if none */
  char driver_missing[256]; /* optional driver calls the driver lacks and what that costs */
  char kernels[512];        /* why pinmem's kernels are unavailable or limited, "" if fine */
} pm_backend_info_t;
/** Starts the backend if none is (pm_init) and describes it. PM_OK also when no backend could
 *  start (kind PM_BACKEND_NONE, reason says why); PM_ERR_INVALID for a NULL info_out. */
PM_API pm_status_t pm_backend_info(pm_backend_info_t *info_out);

typedef struct pm_device_info {
  int index;
  char name[256];
  int cc_major, cc_minor;           /* compute capability; 0.0 for the host backend */
  size_t total_memory, free_memory; /* device memory, bytes */
  char pci_bus_id[32];              /* "0000:3b:00.0", "" if unknown */
  int pcie_gen, pcie_width;         /* current PCIe link, -1 if unknown */
  int pcie_max_gen, pcie_max_width; /* best link the device supports, -1 if unknown */
  int numa_node;                    /* -1 if unknown */
  int async_engines;                /* copy engines that run beside kernels */
  int can_map_host_memory;          /* zero-copy mapped memory */
  int unified_addressing;
  int managed_memory, concurrent_managed_access;
  int host_register_supported, host_register_read_only;
  int pageable_memory_access; /* device can read pageable memory directly (HMM/ATS) */
} pm_device_info_t;

PM_API pm_status_t pm_device_count(int *count_out);
PM_API pm_status_t pm_device_get_info(int device, pm_device_info_t *info_out);
/** Current device of the calling thread (default 0). */
PM_API pm_status_t pm_device_set(int device);
PM_API pm_status_t pm_device_get(int *device_out);
PM_API pm_status_t pm_device_synchronize(void);

/* ------------------------------------------------------------------------------------------ */
/* Streams and events                                                                          */
/* ------------------------------------------------------------------------------------------ */

/** A stream: work submitted to it runs in order. NULL is the current device's default stream.
 *  With the cuda backend a pm_stream_t *is* a cudaStream_t (cast it either way), so streams of
 *  PyTorch or CuPy can be passed in. Streams pinmem creates do not synchronise with the legacy
 *  default stream (cudaStreamNonBlocking). */
typedef struct pm_stream_s *pm_stream_t;
/** An event (a cudaEvent_t under the cuda backend). */
typedef struct pm_event_s *pm_event_t;

enum { PM_EVENT_DEFAULT = 0, PM_EVENT_TIMING = 1u << 0 };

PM_API pm_status_t pm_stream_create(pm_stream_t *stream_out);
/** Waits for the stream's queued work, then destroys it. */
PM_API pm_status_t pm_stream_destroy(pm_stream_t stream);
PM_API pm_status_t pm_stream_synchronize(pm_stream_t stream);
/** PM_OK when all queued work is done, PM_NOT_READY otherwise. */
PM_API pm_status_t pm_stream_query(pm_stream_t stream);
/** Later work on `stream` waits until `event`'s last record completed (as captured now). */
PM_API pm_status_t pm_stream_wait_event(pm_stream_t stream, pm_event_t event);

PM_API pm_status_t pm_event_create(unsigned flags, pm_event_t *event_out);
PM_API pm_status_t pm_event_destroy(pm_event_t event);
PM_API pm_status_t pm_event_record(pm_event_t event, pm_stream_t stream);
/** PM_OK when the event's last record completed (or it was never recorded), PM_NOT_READY if not. */
PM_API pm_status_t pm_event_query(pm_event_t event);
PM_API pm_status_t pm_event_synchronize(pm_event_t event);
/** Seconds between two completed events created with PM_EVENT_TIMING. */
PM_API pm_status_t pm_event_elapsed(pm_event_t start, pm_event_t end, double *seconds_out);

/** Keep the stream busy for `seconds` (a spinning kernel on the GPU, a sleep on the host
 *  backend's stream thread): the stand-in for compute in benchmarks and tests. */
PM_API pm_status_t pm_launch_busy(pm_stream_t stream, double seconds);
/** Run fn(arg) on a library thread once all earlier work on `stream` is done; later work waits
 *  for it. fn must not call pinmem stream functions. If this call fails, fn never runs. */
PM_API pm_status_t pm_launch_host_func(pm_stream_t stream, void (*fn)(void *arg), void *arg);

/* ------------------------------------------------------------------------------------------ */
/* Device memory and plain copies                                                              */
/* ------------------------------------------------------------------------------------------ */

#define PM_COPY_KIND_MAP(X)                                                                     \
  X(PM_COPY_DEFAULT, 0, "DEFAULT") /* infer the direction from the pointers */                  \
  X(PM_COPY_H2D, 1, "H2D")                                                                      \
  X(PM_COPY_D2H, 2, "D2H")                                                                      \
  X(PM_COPY_D2D, 3, "D2D")                                                                      \
  X(PM_COPY_H2H, 4, "H2H")

typedef enum pm_copy_kind { PM_COPY_KIND_MAP(PM__ENUM_VALUE) } pm_copy_kind_t;

/** Device memory on the current device (host memory standing in for it on the host backend). */
PM_API pm_status_t pm_device_alloc(size_t bytes, void **dptr_out);
/** Free device memory from pm_device_alloc; NULL is PM_OK and does nothing, as free(NULL). */
PM_API pm_status_t pm_device_free(void *dptr);
/** Fill device memory with a byte value, ordered on `stream`. */
PM_API pm_status_t pm_device_memset_async(void *dptr, int value, size_t bytes, pm_stream_t stream);

/** One plain backend copy (cudaMemcpyAsync): no staging, no path choice. From or to pageable
 *  host memory it behaves as CUDA does: the caller blocks (H2D returns once the source was
 *  consumed, D2H once the data arrived). src and dst that share a byte: PM_ERR_INVALID (CUDA's
 *  result would be undefined). */
PM_API pm_status_t pm_memcpy_async(void *dst, const void *src, size_t bytes, pm_copy_kind_t kind,
                                   pm_stream_t stream);
/** Synchronous plain copy (cudaMemcpy). */
PM_API pm_status_t pm_memcpy(void *dst, const void *src, size_t bytes, pm_copy_kind_t kind);

/* ------------------------------------------------------------------------------------------ */
/* Pinned host memory pool                                                                     */
/* ------------------------------------------------------------------------------------------ */

/** Allocation flags (they mirror cudaHostAlloc's). */
enum {
  PM_HOST_DEFAULT = 0,
  PM_HOST_MAPPED = 1u << 0,         /* also give a device pointer: kernels read it directly */
  PM_HOST_WRITE_COMBINED = 1u << 1, /* fast for the device to read, very slow for the CPU to read */
  PM_HOST_PORTABLE = 1u << 2,       /* pinned for every device context, not just the current:
                                       pinmem sets it on every block anyway (docs/multi-gpu.md) */
  PM_HOST_SHARED = 1u << 3          /* memory another process can map (a memfd mapped MAP_SHARED,
                                       pinned and portable in this process): pm_host_shared_fd */
};

#define PM_EXHAUST_POLICY_MAP(X)                                                                \
  X(PM_EXHAUST_FAIL, 0, "fail") /* return PM_ERR_BUDGET at once (after trimming the cache) */   \
  X(PM_EXHAUST_WAIT, 1, "wait") /* wait up to wait_timeout_s for frees, then PM_ERR_BUDGET */

typedef enum pm_exhaust_policy { PM_EXHAUST_POLICY_MAP(PM__ENUM_VALUE) } pm_exhaust_policy_t;

typedef struct pm_pool_s pm_pool_t;

/** Fields left at the values pm_pool_config_init() gives take the option of the same name
 *  (pm_option_set, then PINMEM_<NAME>, then the default). */
typedef struct pm_pool_config {
  size_t budget;         /* hard cap on pinned bytes the pool holds (0: option "budget") */
  int exhaust_policy;    /* pm_exhaust_policy_t, or -1: option "budget_policy" */
  double wait_timeout_s; /* for PM_EXHAUST_WAIT; < 0: option "budget_timeout" */
  int pin_threads;       /* threads that first-touch new blocks (0: option "pin_threads") */
  size_t fast_pin_min;   /* blocks this large are pinned by mmap + parallel touch + register
                            instead of cudaHostAlloc (0: option "fast_pin_min") */
  int huge_pages;        /* 1: ask for transparent huge pages on fast-pinned blocks; -1: option */
} pm_pool_config_t;

PM_API void pm_pool_config_init(pm_pool_config_t *config);
PM_API pm_status_t pm_pool_create(const pm_pool_config_t *config, pm_pool_t **pool_out);
/** Releases all cached memory. PM_ERR_BUSY (and nothing is destroyed) while blocks are still
 *  allocated. Waits for the streams that freed blocks are still in use by. */
PM_API pm_status_t pm_pool_destroy(pm_pool_t *pool);
/** The process-wide pool used when NULL is passed as a pool (created on first use). */
PM_API pm_status_t pm_pool_default(pm_pool_t **pool_out);

/** Pinned host memory of at least `bytes`, aligned to 256 bytes (to the page when the block is
 *  a whole backend allocation). Served from the cache when a fitting block is free and every
 *  stream that used it has passed its free; otherwise pins new memory within the budget. Every
 *  block is portable (PM_HOST_PORTABLE whatever flags say): one block feeds copies to every
 *  device, whichever device was current when it was pinned. */
PM_API pm_status_t pm_host_alloc(pm_pool_t *pool, size_t bytes, unsigned flags, void **ptr_out);
/** Return a block to its pool (found from the pointer). Stream uses recorded with
 *  pm_host_record_stream gate its reuse; the call itself never blocks on them. NULL is PM_OK
 *  and does nothing, as free(NULL). A block already freed: PM_ERR_DOUBLE_FREE; an address
 *  inside a block, or in pool memory never handed out: PM_ERR_INVALID. */
PM_API pm_status_t pm_host_free(void *ptr);
/** Declare that work queued on `stream` uses the block holding ptr: the block is not reused
 *  until that work (as queued when the block is freed) has completed. */
PM_API pm_status_t pm_host_record_stream(void *ptr, pm_stream_t stream);
/** Usable size of the block that ptr starts. */
PM_API pm_status_t pm_host_usable_size(const void *ptr, size_t *bytes_out);

/** Release cached blocks whose stream uses are complete back to the system. If the backend
 * fails to release a segment, the error is returned; the pool no longer counts that segment
 * (its bytes are in *released_bytes_out too), so the budget cannot wedge on it. */
PM_API pm_status_t pm_pool_trim(pm_pool_t *pool, size_t *released_bytes_out);
/** Pin `bytes` now (one block, cached) so later allocations up to that size cost no pinning. */
PM_API pm_status_t pm_pool_reserve(pm_pool_t *pool, size_t bytes, unsigned flags);
/** Change the budget; lowering it below what is held trims the cache and fails with
 *  PM_ERR_BUSY if blocks in use still exceed it (the budget is then left unchanged). */
PM_API pm_status_t pm_pool_set_budget(pm_pool_t *pool, size_t budget);

typedef struct pm_pool_stats {
  size_t budget;
  size_t pinned_bytes;    /* held from the system: in use + cached + pending + registered */
  size_t pinned_peak;     /* high-water mark of pinned_bytes */
  size_t in_use_bytes;    /* capacity of blocks handed out */
  size_t requested_bytes; /* sum of the sizes asked for by live blocks */
  size_t cached_bytes;    /* free and ready for reuse */
  size_t pending_bytes;   /* freed, waiting for the streams that used them */
  size_t registered_bytes; /* pm_register'ed memory charged to this pool's budget, whole pages */
  uint64_t segments;       /* backend allocations held */
  uint64_t allocs, frees;
  uint64_t cache_hits;      /* allocations served without a backend call */
  uint64_t backend_allocs, backend_frees;
  uint64_t budget_waits, budget_failures;
  double backend_alloc_seconds, backend_free_seconds;
  /* Freed blocks kept out of use for good because device work that nothing could order may
   * still touch them (a stream that could be neither recorded nor synchronized): part of
   * pending_bytes, released when the pool is destroyed, after a device synchronize. */
  uint64_t quarantined_blocks;
  size_t quarantined_bytes;
  /* Segments pinned for a NUMA node (option numa) that could not be bound to it and were pinned
   * with the kernel's default policy instead (no libnuma, a node this process may not use):
   * pm_pool_numa_stats says which node; `pinmem info` says why. */
  uint64_t numa_bind_failures;
} pm_pool_stats_t;

PM_API pm_status_t pm_pool_get_stats(pm_pool_t *pool, pm_pool_stats_t *stats_out);

/** A pool's memory by the NUMA node it was pinned for (option numa). Node -1: no placement was
 *  asked (numa off, a single-node machine, a device whose node is unknown): the kernel's
 *  default policy. Blocks pinned for one node only ever serve requests for that node. */
typedef struct pm_pool_node_stats {
  int node;
  size_t pinned_bytes;    /* segments held for this node */
  size_t unbound_bytes;   /* of those, pinned with the default policy: binding failed */
  size_t cached_bytes;    /* free and ready for reuse by this node's requests */
  size_t in_use_bytes;    /* capacity of blocks handed out */
  uint64_t blocks;        /* blocks handed out */
  uint64_t segments;      /* backend allocations held */
  uint64_t bind_failures; /* segments for this node that could not be bound (since creation) */
} pm_pool_node_stats_t;

/** Per-node stats of `pool` (NULL: the default pool) into out[0..max): node -1 first, then
 *  every node the pool pinned or tried to pin for, ascending. *count_out gets the number of
 *  entries there are, which may exceed max (call again with more room); max 0 only counts. */
PM_API pm_status_t pm_pool_numa_stats(pm_pool_t *pool, pm_pool_node_stats_t *out, int max,
                                      int *count_out);
PM_API pm_status_t pm_pool_reset_peak(pm_pool_t *pool);

/* ------------------------------------------------------------------------------------------ */
/* Shared pinned memory                                                                        */
/* ------------------------------------------------------------------------------------------ */

/* A pool block allocated with PM_HOST_SHARED lives in a memfd (an unlinked file under /dev/shm
 * where memfd_create is missing) mapped MAP_SHARED and pinned (PORTABLE) in this process. Another
 * process that receives the fd (fork, SCM_RIGHTS, Python's pass_fds) maps the same pages with
 * pm_shared_map, or a plain mmap(MAP_SHARED), and what one side writes the other reads: workers
 * fill pinned slots that the parent copies to the device with one DMA. Shared blocks count
 * against the pool's budget like others and are cached apart: a freed shared block serves only
 * later shared allocations (docs/shared-memory.md). */

/** The memfd holding ptr (anywhere inside a PM_HOST_SHARED pool block that is allocated), ptr's
 *  offset in that memfd, and the bytes from ptr to the end of the block. The fd stays owned by
 *  pinmem (dup it to keep it; it is close-on-exec) and is valid until the block is freed; the
 *  memfd also holds the other shared blocks of the same pool segment. PM_ERR_INVALID for a NULL
 *  output, memory that is not shared, or a freed block. fd_out, offset_out and bytes_out are
 *  all required. */
PM_API pm_status_t pm_host_shared_fd(const void *ptr, int *fd_out, uint64_t *offset_out,
                                     size_t *bytes_out);

#define PM_SHARED_PIN 1u /* pm_shared_map: also pin the mapping in this process */

/** Map `bytes` at `offset` of a shared memfd received from another process (fork, SCM_RIGHTS,
 *  pass_fds) read-write and MAP_SHARED; *ptr_out is the byte at `offset` (offsets need not be
 *  page aligned). flags: 0, or PM_SHARED_PIN to also pin the mapping in this process (a
 *  pm_register(PM_REGISTER_PORTABLE) of [*ptr_out, +bytes), charged to the default pool's
 *  budget; copies from it then take the direct path). The fd may be closed after the call.
 *  PM_ERR_INVALID for fd < 0, an fd that is not a mappable file, bytes 0, a range beyond the
 *  file's size (fstat), unknown flags or a NULL ptr_out; the registration's status when
 *  PM_SHARED_PIN cannot pin. Release with pm_shared_unmap. */
PM_API pm_status_t pm_shared_map(int fd, uint64_t offset, size_t bytes, unsigned flags,
                                 void **ptr_out);
/** Undo pm_shared_map: unpin (when it was pinned and the caller has not pm_unregister'ed it
 *  since; a registration the caller made on the mapping's pages goes too) and unmap. ptr and bytes must be what pm_shared_map gave and was given:
 *  PM_ERR_NOT_FOUND for a pointer it did not return (or one already unmapped), PM_ERR_INVALID
 *  for other bytes. The memory of the other processes is untouched. */
PM_API pm_status_t pm_shared_unmap(void *ptr, size_t bytes);

/* ------------------------------------------------------------------------------------------ */
/* Managed (unified) memory                                                                    */
/* ------------------------------------------------------------------------------------------ */

#define PM_CPU_DEVICE (-1)

PM_API pm_status_t pm_managed_alloc(size_t bytes, void **ptr_out);
PM_API pm_status_t pm_managed_free(void *ptr);
/** Migrate [ptr, ptr+bytes) of managed memory to `device` (PM_CPU_DEVICE for the host),
 *  ordered on `stream`. */
PM_API pm_status_t pm_managed_prefetch(const void *ptr, size_t bytes, int device,
                                       pm_stream_t stream);

/* ------------------------------------------------------------------------------------------ */
/* Registration of existing memory and pointer queries                                         */
/* ------------------------------------------------------------------------------------------ */

enum {
  PM_REGISTER_DEFAULT = 0,
  PM_REGISTER_MAPPED = 1u << 0,
  PM_REGISTER_PORTABLE = 1u << 1,
  PM_REGISTER_READ_ONLY = 1u << 2 /* the device only reads it (where the device supports it) */
};

/** Page-lock memory the caller owns (cudaHostRegister; mlock on the host backend). Charged to
 *  the default pool's budget. PM_ERR_OVERLAP if any byte is already pinned by pinmem. Always
 *  registered PORTABLE (pinned for every device, as pool blocks are), whatever flags say. */
PM_API pm_status_t pm_register(void *ptr, size_t bytes, unsigned flags);
/** ptr must be the start of a registration. The caller's memory is untouched. */
PM_API pm_status_t pm_unregister(void *ptr);

/* X(name, value, text, what one tracked range of the kind is called in messages) */
#define PM_MEMORY_KIND_MAP(X)                                                                   \
  X(PM_MEMORY_PAGEABLE, 0, "pageable", "pageable") /* not known to pinmem: ordinary memory */   \
  X(PM_MEMORY_POOL, 1, "pool", "pool segment")     /* a pinned block from a pm_pool_t */        \
  X(PM_MEMORY_REGISTERED, 2, "registered", "registration")                                      \
  X(PM_MEMORY_MANAGED, 3, "managed", "managed allocation")                                      \
  X(PM_MEMORY_DEVICE, 4, "device", "device allocation") /* from pm_device_alloc */

typedef enum pm_memory_kind { PM_MEMORY_KIND_MAP(PM__ENUM_VALUE) } pm_memory_kind_t;

typedef struct pm_pointer_info {
  pm_memory_kind_t kind;
  void *base;        /* start of the block / registration / allocation holding the pointer */
  size_t size;       /* its size in bytes */
  unsigned flags;    /* PM_HOST_* for pool blocks (PM_HOST_PORTABLE in every one), the
                        PM_REGISTER_* given for registrations */
  void *device_ptr;  /* device address of the queried pointer itself, when mapped; else NULL */
  pm_pool_t *pool;   /* the owning pool for PM_MEMORY_POOL */
  int in_use;        /* pool blocks: 1 if allocated, 0 if freed (cached) */
} pm_pointer_info_t;

/** What is this address? O(log n) in the number of tracked ranges. Pageable memory is PM_OK
 *  with kind PM_MEMORY_PAGEABLE. */
PM_API pm_status_t pm_pointer_query(const void *ptr, pm_pointer_info_t *info_out);
/** Device pointer for an address in mapped pinned memory (an allocated pool block or a
 *  registration). PM_ERR_INVALID for memory that is not mapped, and for a freed block. */
PM_API pm_status_t pm_host_device_pointer(const void *ptr, void **dptr_out);

/* ------------------------------------------------------------------------------------------ */
/* Copy engine                                                                                 */
/* ------------------------------------------------------------------------------------------ */

/** Completion of a pm_copy_async / pm_copy_batch_async: it cannot be missed. A D2H result must
 *  not be read, and a pinned H2D source must not be changed, before the fence completed. */
typedef struct pm_fence_s *pm_fence_t;

#define PM_COPY_PATH_MAP(X)                                                                     \
  X(PM_PATH_AUTO, 0, "auto")     /* pick from the registry (default) */                         \
  X(PM_PATH_DIRECT, 1, "direct") /* one DMA from/to pinned, registered or device memory */      \
  X(PM_PATH_STAGED, 2, "staged") /* pageable memory through pinned bounce buffers */            \
  X(PM_PATH_REGISTER, 3, "register") /* reserved: PM_ERR_UNSUPPORTED (docs/copy-engine.md) */

typedef enum pm_copy_path { PM_COPY_PATH_MAP(PM__ENUM_VALUE) } pm_copy_path_t;

typedef struct pm_copy_options {
  pm_copy_kind_t kind; /* PM_COPY_DEFAULT: from the pointers */
  pm_copy_path_t path; /* PM_PATH_AUTO */
  pm_pool_t *pool;     /* bounce buffers come from here (NULL: default pool) */
  void (*callback)(void *arg, pm_status_t status); /* optional: runs once on completion, on a
                                                      library thread, never under a lock */
  void *callback_arg;
} pm_copy_options_t;

typedef struct pm_copy_item {
  void *dst;
  const void *src;
  size_t bytes;
} pm_copy_item_t;

PM_API void pm_copy_options_init(pm_copy_options_t *options);
/** Copy `bytes` from src to dst ordered on `stream` (after its earlier work; later work on the
 *  stream sees the result). options may be NULL. fence_out may be NULL (then completion is
 *  only observable through the stream or the callback). What the call blocks on, by path:
 *  direct: nothing. staged H2D from pageable memory: until the source has been read (it may be
 *  changed after the return), never on the stream's earlier work (copy_bounce=ring excepted).
 *  staged D2H into pageable memory: with copy_bounce=auto (the default) on an idle stream, until
 *  the bytes are in dst, as CUDA's pageable copy; behind queued work (or copy_bounce=whole),
 *  nothing: the fence completes once the bytes are in dst. */
PM_API pm_status_t pm_copy_async(void *dst, const void *src, size_t bytes, pm_stream_t stream,
                                 const pm_copy_options_t *options, pm_fence_t *fence_out);
/** Many (dst, src, bytes) triples in one call; small pageable pieces are packed into one bounce
 *  buffer. Pinned, managed and device pieces go through one gather/scatter kernel or
 *  cudaMemcpyBatchAsync (option copy_batch). All items share one direction. Items run in no
 *  set order, and may run at once: an item's src and dst must not overlap (PM_ERR_INVALID), and
 *  where one item writes what another reads or writes, the result is undefined. */
PM_API pm_status_t pm_copy_batch_async(const pm_copy_item_t *items, size_t count,
                                       pm_stream_t stream, const pm_copy_options_t *options,
                                       pm_fence_t *fence_out);
/** One host buffer to the memory of `count` devices (1..64): bytes from src to dsts[i] on
 *  streams[i], a stream of device devices[i] (devices NULL: every stream is the current
 *  device's). Each destination's copy is queued with its device current, and the caller's
 *  current device is restored. Pinned (or managed) src: one DMA per destination, nothing
 *  blocks. Pageable src: read once (not once per device) into pinned slots, each slot DMA'd to
 *  every destination; the call returns once every DMA is done (it waits for the streams' earlier
 *  work too). fences_out (may be NULL): count fences, fences_out[i] for destination i.
 *  options->callback is refused (wait on the fences), kind must be DEFAULT or H2D.
 *  PM_ERR_INVALID for a NULL pointer, count out of range, a device index out of range, a
 *  destination that is not device memory, is memory of a device other than its devices[i] (where
 *  the backend can tell), or overlaps src or another destination, and for a stream of another
 *  device than devices[i] (the stream's context's device under CUDA; NULL, cudaStreamLegacy and
 *  cudaStreamPerThread are devices[i]'s default stream). On a failure part way, every DMA
 *  already queued is waited for, no fence is returned, and dsts may hold part of the data. */
PM_API pm_status_t pm_copy_broadcast_async(const void *src, size_t bytes, void *const *dsts,
                                           const pm_stream_t *streams, const int *devices,
                                           int count, const pm_copy_options_t *options,
                                           pm_fence_t *fences_out);
/** PM_OK once complete (or the copy's error), PM_NOT_READY before. */
PM_API pm_status_t pm_fence_query(pm_fence_t fence);
/** Block until complete; returns the copy's status. */
PM_API pm_status_t pm_fence_wait(pm_fence_t fence);
/** Later work on `stream` waits for the fence, without blocking the caller. */
PM_API pm_status_t pm_fence_stream_wait(pm_fence_t fence, pm_stream_t stream);
/** Drop the handle (the copy itself still completes). */
PM_API pm_status_t pm_fence_release(pm_fence_t fence);
/** Which path the last completed fence used (for benchmarks and tests). */
PM_API pm_status_t pm_fence_path(pm_fence_t fence, pm_copy_path_t *path_out);

/* ------------------------------------------------------------------------------------------ */
/* Files                                                                                       */
/* ------------------------------------------------------------------------------------------ */

/* File ranges read into, and written from, device or host memory through pinned bounce slots
 * and pinmem's threads (docs/files.md). */
#define PM_FILE_IO_MAP(X)                                                                       \
  X(PM_FILE_IO_AUTO, 0, "auto") /* ranges >= 64 MiB: direct writes; direct reads when most */ \
                                /* of the range is not in the page cache and no other */    \
                                /* process reads the file at the same moment */             \
  X(PM_FILE_IO_BUFFERED, 1, "buffered") /* pread / pwrite through the page cache */             \
  X(PM_FILE_IO_DIRECT, 2, "direct") /* O_DIRECT: aligned bounce slots; unaligned edges buffered */

typedef enum pm_file_io { PM_FILE_IO_MAP(PM__ENUM_VALUE) } pm_file_io_t;

/** Start from pm_file_options_init(); fields left at 0 take the defaults named here. */
typedef struct pm_file_options {
  pm_file_io_t io; /* PM_FILE_IO_AUTO. Where the filesystem refuses O_DIRECT, buffered I/O is
                      used instead */
  pm_pool_t *pool; /* bounce slots come from here (NULL: the default pool); budget respected */
  size_t chunk;    /* bytes per unit and bounce slot (0: option file_chunk, 2 MiB, for reads
                      through the page cache; file_direct_chunk, 1 MiB, for reads through
                      O_DIRECT; file_write_chunk, 1 MiB, for writes; rounded up to 4 KiB) */
  int threads;     /* I/O threads, the caller included, 0..256 (0: option file_threads,
                      else copy_threads) */
  int fsync;       /* writes: 1 = fdatasync before the fence completes */
  void (*callback)(void *arg, pm_status_t status); /* as pm_copy_options_t: runs once on
                                                      completion, on a library thread */
  void *callback_arg;
  uint32_t *crc32; /* writes: where not NULL, crc32[i] receives the CRC-32 of ranges[i]'s bytes
                      as written (zlib's, the one zip and torch.save record; 0 for a range of 0
                      bytes; the one-range calls: crc32[0]), computed by the threads that write
                      each unit, a device range's on its copy in the bounce slot. Needs zlib
                      (libz.so.1, loaded at run time; PINMEM_ZLIB names another file):
                      PM_ERR_UNSUPPORTED without it. ISA-L computes them where found
                      (libisal.so.2; PINMEM_ISAL names another file, 0: zlib alone). Set only
                      on success. Reads: PM_ERR_INVALID */
} pm_file_options_t;

PM_API void pm_file_options_init(pm_file_options_t *options);
/** Read `bytes` at `offset` of file `fd` into dst (device, pinned, managed or pageable host
 *  memory), ordered on `stream` like pm_copy_async. Threads pread chunks into pinned bounce
 *  slots and queue each slot's DMA as soon as it is full. Returns once every byte has been read
 *  from the file and every DMA is queued (dst is written in stream order; the fence completes
 *  when the DMAs are done). Host dst: after the stream's earlier work, read straight into dst
 *  (the call returns with the bytes in dst). A file shorter than offset + bytes: PM_ERR_IO
 *  naming where it ends; EINTR is retried; a short read is continued; EIO etc.: PM_ERR_IO with
 *  the errno text, offset and fd. fd < 0, dst NULL, offset + bytes past the largest file
 *  offset, bad options: PM_ERR_INVALID. bytes 0: a completed fence. options may be NULL,
 *  fence_out may be NULL. If the call fails, dst may have been partly written and the
 *  callback never runs. The caller's fd (its offset, its flags) is never changed. */
PM_API pm_status_t pm_file_read_async(int fd, uint64_t offset, size_t bytes, void *dst,
                                      pm_stream_t stream, const pm_file_options_t *options,
                                      pm_fence_t *fence_out);
/** Write `bytes` of src (device or host memory) at `offset` of fd: DMA into bounce slots after
 *  the stream's earlier work, threads pwrite each slot as it lands (host src: after the
 *  stream's earlier work, pwrite straight from src). Returns once the bytes are in the file
 *  (and, with options->fsync, on disk); the fence is then complete. ENOSPC, EIO etc.:
 *  PM_ERR_IO with the errno text, offset and fd (part of the range may have been written).
 *  The caller's fd is never changed (O_DIRECT goes through a second open of /proc/self/fd/N).
 *  With O_DIRECT the range's unaligned head and tail are written buffered after the aligned
 *  middle (io=auto takes O_DIRECT for writes of 64 MiB or more; docs/files.md). */
PM_API pm_status_t pm_file_write_async(int fd, uint64_t offset, size_t bytes, const void *src,
                                       pm_stream_t stream, const pm_file_options_t *options,
                                       pm_fence_t *fence_out);

/** One range of pm_file_readv_async / pm_file_writev_async: `bytes` at file `offset`, to or
 *  from `mem` (device, pinned, managed or pageable host memory; NULL only with bytes 0). */
typedef struct pm_file_range {
  uint64_t offset;
  size_t bytes;
  void *mem; /* reads: the destination; writes: the source (never written) */
} pm_file_range_t;

/** Read `count` ranges of fd, each into its own memory, in one call: one set of threads and
 *  one ring of bounce slots for all of them (the ring stays full from one range to the next),
 *  ranges that follow each other in the file read as one stream of units (a unit holding the
 *  end of one range and the start of the next is read once and split). Ranges may come in any
 *  order and may mix host and device memory; ranges of 0 bytes are skipped. As
 *  pm_file_read_async otherwise (stream order, the fence, io=auto decided on the ranges'
 *  total bytes and on the span from the first to the last). Checked before a byte is read:
 *  ranges NULL with count > 0, a NULL mem with bytes > 0, an offset + bytes past the largest
 *  file offset, two ranges that overlap in the file, two destinations that overlap in memory:
 *  PM_ERR_INVALID naming ranges[i]; a regular file that ends before a range does (truncated):
 *  PM_ERR_IO naming the range and the file's size, nothing read. A file cut shorter during the
 *  read: PM_ERR_IO as pm_file_read_async. count 0: a completed fence. If the call fails, the
 *  destinations may have been partly written and the callback never runs. */
PM_API pm_status_t pm_file_readv_async(int fd, const pm_file_range_t *ranges, size_t count,
                                       pm_stream_t stream, const pm_file_options_t *options,
                                       pm_fence_t *fence_out);
/** Write `count` ranges, each from its own memory, at their offsets of fd, in one call (the
 *  gather of pm_file_readv_async's scatter): ranges back to back in the file go as one stream
 *  of units, a unit holding bytes of several ranges gathered into a bounce slot first; the
 *  bytes between ranges that are not back to back are left as they were. As
 *  pm_file_write_async otherwise (returns once every byte is in the file; a range past the end
 *  reserves the span from the first range to the last; with O_DIRECT each stream's unaligned
 *  head and tail are written buffered after the direct middles). Checked before a byte is
 *  written as pm_file_readv_async's ranges (sources may overlap in memory). */
PM_API pm_status_t pm_file_writev_async(int fd, const pm_file_range_t *ranges, size_t count,
                                        pm_stream_t stream, const pm_file_options_t *options,
                                        pm_fence_t *fence_out);

/** Bytes the pm_file_* calls of this process moved, by path, since it started: what io=auto
 *  chose, for tests and benchmarks. direct_refused counts calls that wanted O_DIRECT and went
 *  buffered because the filesystem refused it. */
typedef struct pm_file_stats {
  uint64_t read_direct, read_buffered;   /* bytes read through O_DIRECT / the page cache */
  uint64_t write_direct, write_buffered; /* bytes written through O_DIRECT / the page cache */
  uint64_t direct_refused;
} pm_file_stats_t;
PM_API pm_status_t pm_file_get_stats(pm_file_stats_t *out);

/* ------------------------------------------------------------------------------------------ */
/* KV-cache block store                                                                        */
/* ------------------------------------------------------------------------------------------ */

/* A pinned host arena of N equal blocks for LLM serving's KV cache (docs/kv-blocks.md): block
 * ids from a free list, and swaps that move any number of blocks between the device's paged KV
 * tensors and the arena in one call, ordered on a stream, small pieces by a gather/scatter kernel
 * and large ones by batched DMA. The arena is pinned in chunks by a background thread, on the
 * device's NUMA node, charged to a pool's budget at its exact size; low block ids come first, so
 * the first blocks are usable at once and a swap that names a block whose chunk is not pinned
 * yet waits for that chunk.
 *
 *   pm_blocks_config_t c;  pm_blocks_config_init(&c);  c.block_bytes = 2 * L * 16 * H * D * 2;
 *   c.num_blocks = 65536;  pm_blocks_create(&c, &store);
 *   pm_blocks_alloc(store, n, host_ids);
 *   pm_blocks_swap_out(store, &layout, dev_ids, host_ids, n, stream, &ev);  // device -> arena
 *   pm_blocks_swap_in(store, &layout, dev_ids, host_ids, n, stream, &ev);   // arena -> device
 */
typedef struct pm_blocks_s pm_blocks_t;

/** Start from pm_blocks_config_init(); fields left at 0 take the defaults named here. */
typedef struct pm_blocks_config {
  size_t block_bytes;  /* bytes of one host block (required): every region of a layout, summed */
  uint64_t num_blocks; /* blocks in the arena (required) */
  size_t chunk_bytes;  /* bytes pinned per registration, rounded down to whole blocks (at least
                          one): 0 = option blocks_chunk (1 GiB) */
  pm_pool_t *pool;     /* the budget the arena is charged to (NULL: the default pool) */
  int device;          /* the device whose KV tensors the store serves, and whose NUMA node the
                          arena is pinned on (config_init: -1 = the current device) */
  int background;      /* 1 (config_init): pin the chunks after the first on a background thread;
                          0: pm_blocks_create pins the whole arena before it returns */
  int pin_threads;     /* threads that first-touch a chunk (0: option pin_threads) */
} pm_blocks_config_t;

/** One region of a KV layout: one contiguous piece of every block, in the device tensor and in
 *  the host block. A per-layer tensor [num_blocks, block_size, heads, head_dim] is one region
 *  (block_stride = bytes = block_size * heads * head_dim * itemsize); K and V apart are two
 *  regions per layer; K and V stacked as [2, num_blocks, ...] are two regions (V's base is K's
 *  + num_blocks * block_stride), stacked as [num_blocks, 2, ...] one region of both halves. */
typedef struct pm_kv_region {
  void *base;          /* device address of device block 0 of the region */
  size_t block_stride; /* bytes from one device block to the next (>= bytes) */
  size_t bytes;        /* bytes of one block in the region */
} pm_kv_region_t;

/** Where blocks lie on the device. Host block h holds regions[0]'s bytes of its device block,
 *  then regions[1]'s, ... (one layout for every call on a store: the bytes must sum to the
 *  store's block_bytes, else PM_ERR_INVALID). */
typedef struct pm_kv_layout {
  int nregions;                  /* 1..PM_KV_MAX_REGIONS */
  const pm_kv_region_t *regions; /* read during the call only */
  uint64_t device_blocks;        /* blocks of each device region: device ids must be below */
  int device;                    /* the device the tensors live on (-1: the store's) */
} pm_kv_layout_t;

#define PM_KV_MAX_REGIONS 4096 /* e.g. 2048 layers with K and V apart */

PM_API void pm_blocks_config_init(pm_blocks_config_t *config);
/** Charge the arena (num_blocks * block_bytes, rounded up to the page per chunk) to the pool's
 *  budget (PM_ERR_BUDGET when it does not fit), pin its first chunk (at most 64 MiB of blocks,
 *  so the call returns quickly whatever the arena), and start pinning the rest (background 1) or
 *  pin it all (background 0). PM_ERR_INVALID for a bad config. */
PM_API pm_status_t pm_blocks_create(const pm_blocks_config_t *config, pm_blocks_t **blocks_out);
/** Stop the background pinning, wait for the device's queued work (swaps may still read or write
 *  the arena), unpin, uncharge. No other call on the store may run at the same time; a second
 *  destroy, or any call after it, is PM_ERR_INVALID. */
PM_API pm_status_t pm_blocks_destroy(pm_blocks_t *blocks);
/** Take `count` free block ids (lowest first when the arena is fresh) into ids_out. PM_ERR_NOMEM
 *  naming what is free when fewer than count are: then nothing is taken. Blocks freed while a
 *  swap still used them are handed out only once every swap that named them completed: idle
 *  blocks go first, and when they are too few the call blocks until enough of those swaps
 *  completed (only swaps that name freed blocks; an unrelated swap on another stream is not
 *  waited for). A swap whose completion the device cannot report quarantines the blocks it
 *  named (pm_blocks_get_free); when only those would make up the count, the device's status,
 *  naming the swap. A wait that cannot make the store's device current fails with the device's
 *  status, naming the wait (nothing taken). */
PM_API pm_status_t pm_blocks_alloc(pm_blocks_t *blocks, size_t count, uint64_t *ids_out);
/** Give ids back. PM_ERR_INVALID (nothing freed) for an id out of range, not allocated, or named
 *  twice. A block may be freed while a swap that names it is still queued or running (a swap_in
 *  reading it, a swap_out writing it): pm_blocks_alloc does not hand it out again until that
 *  swap completed, so the next owner's swaps never race it. Never blocks. */
PM_API pm_status_t pm_blocks_free(pm_blocks_t *blocks, const uint64_t *ids, size_t count);
/** Host address of block `id` (allocated or not); waits until its chunk is pinned. */
PM_API pm_status_t pm_blocks_ptr(pm_blocks_t *blocks, uint64_t id, void **ptr_out);
/** Block until the first `count` blocks are pinned (count 0 or >= num_blocks: all); the pinning
 *  error when a chunk could not be pinned. */
PM_API pm_status_t pm_blocks_wait_ready(pm_blocks_t *blocks, uint64_t count);

/** Copy device block device_ids[i] of every region of `layout` into host block host_ids[i], for
 *  i < count, ordered on `stream`. Host ids must be allocated and distinct; device ids below
 *  layout->device_blocks. event_out (may be NULL): a new event recorded after the copies, which
 *  the caller waits on and destroys (pm_event_destroy); the host blocks hold the data once it
 *  completed. PM_ERR_INVALID, before anything is queued, for a bad id (naming it and its
 *  position), a repeated host id, a layout that does not match the store or is not device memory,
 *  or tensors on another device, and for a stream of another device (the stream's context's
 *  device under CUDA). `stream` is a stream of the store's device; the call makes that
 *  device current while it queues (its kernel and event are that device's) and gives the calling
 *  thread its own device back. */
PM_API pm_status_t pm_blocks_swap_out(pm_blocks_t *blocks, const pm_kv_layout_t *layout,
                                      const uint64_t *device_ids, const uint64_t *host_ids,
                                      size_t count, pm_stream_t stream, pm_event_t *event_out);
/** The other way: host block host_ids[i] into device block device_ids[i]. Device ids must be
 *  distinct (host ids may repeat); otherwise as pm_blocks_swap_out. */
PM_API pm_status_t pm_blocks_swap_in(pm_blocks_t *blocks, const pm_kv_layout_t *layout,
                                     const uint64_t *device_ids, const uint64_t *host_ids,
                                     size_t count, pm_stream_t stream, pm_event_t *event_out);

typedef struct pm_blocks_stats {
  size_t block_bytes;
  uint64_t num_blocks;
  uint64_t free_blocks;         /* idle: alloc takes this many without waiting (pm_blocks_get_free) */
  uint64_t ready_blocks;        /* pinned and usable */
  size_t arena_bytes;           /* pinned (or being pinned) for the arena and charged */
  size_t chunk_bytes;
  uint64_t chunks, chunks_ready;
  int numa_node;                /* node the arena was pinned for (-1: none asked) */
  double first_ready_seconds;   /* pm_blocks_create's start to the first chunk pinned */
  double all_ready_seconds;     /* to the whole arena pinned (0 until then) */
  size_t kernel_max;            /* pieces up to this size go by the kernel (0: never) */
  int kernel_max_calibrated;    /* 1: measured on this device, 0: from option blocks_kernel_max */
  uint64_t swaps_out, swaps_in; /* calls */
  uint64_t blocks_out, blocks_in;
  uint64_t bytes_out, bytes_in;
  uint64_t pieces_kernel, pieces_dma; /* region pieces queued by each path */
  uint64_t transfers; /* copies queued after joining pieces that continue each other (ids
                         consecutive on both sides within a region and a host chunk) */
} pm_blocks_stats_t;

/** The store's figures. The first call on a device with option blocks_kernel_max auto runs the
 *  calibration, as the first swap does. Every other call may run from several threads at once. */
PM_API pm_status_t pm_blocks_get_stats(pm_blocks_t *blocks, pm_blocks_stats_t *stats_out);
/** The free blocks, from one reading (each block counted once), each pointer may be NULL:
 *  *idle_out, what pm_blocks_alloc takes without waiting (free_blocks of pm_blocks_get_stats);
 *  *waiting_out, blocks freed while a swap not known complete still named them, which alloc
 *  hands out once those swaps completed (waiting for them when idle blocks are too few: alloc
 *  can give idle + waiting); *quarantined_out, blocks a swap whose completion cannot be known
 *  named (its event failed on the device): never handed out again, until the store is destroyed.
 *  Counts what the store knows after asking, without waiting, which swaps completed. */
PM_API pm_status_t pm_blocks_get_free(pm_blocks_t *blocks, uint64_t *idle_out,
                                      uint64_t *waiting_out, uint64_t *quarantined_out);

/* ------------------------------------------------------------------------------------------ */
/* Data loader                                                                                 */
/* ------------------------------------------------------------------------------------------ */

/* A dataset is a numbered set of fixed-size samples; a loader delivers them in batches. Worker
 * threads read each sample straight into its place in a pinned batch slot (no collate copy), a
 * copy stage moves each filled slot to a device buffer on the loader's own stream, and
 * pm_loader_next() hands out batches in order, while later ones are being read and copied:
 * DataLoader(pin_memory=True) + .to(device, non_blocking=True), without the second copy.
 *
 *   pm_dataset_t *ds;  pm_loader_t *ld;  pm_batch_t b;
 *   pm_dataset_open_npy(paths, 1, NULL, &ds);
 *   pm_loader_config_t c;  pm_loader_config_init(&c);  c.batch_size = 256;  c.shuffle = 1;
 *   pm_loader_create(ds, &c, &ld);
 *   while (pm_loader_next(ld, &b) == PM_OK) {      // PM_ERR_STATE once every epoch is delivered
 *     pm_batch_wait_stream(&b, s);                 // s waits for the batch's copy, not the host
 *     train_step(b.inputs, b.shape, s);
 *     pm_batch_release(&b, s);                     // the buffers come back once s is past here
 *   }
 *   pm_loader_destroy(ld);  pm_dataset_destroy(ds);
 *
 * Several fields (images and labels, X.npy and Y.npy): one dataset of n fields, from
 * pm_dataset_zip or pm_dataset_create_fields; each batch then has b.nfields arrays,
 * b.fields[k].data, all in one slot behind one event (b.inputs / b.targets are fields 0 and 1).
 * A reader with a high cost per call (a worker process) writes runs of rows:
 * pm_dataset_create_rows. pm_dataset_select views a dataset through a list of indices.
 */

#define PM_DATASET_MAX_DIMS 32 /* dimensions of one sample (numpy allows 32 in all) */

/** Element types. Types without a code of their own (big-endian numbers, strings, structured
 *  records, datetimes) are PM_DTYPE_OTHER: fixed-size records of `itemsize` bytes, see descr. */
#define PM_DTYPE_MAP(X)                                                                         \
  X(PM_DTYPE_OTHER, 0, "other")                                                                 \
  X(PM_DTYPE_BOOL, 1, "bool")                                                                   \
  X(PM_DTYPE_INT8, 2, "int8")                                                                   \
  X(PM_DTYPE_UINT8, 3, "uint8")                                                                 \
  X(PM_DTYPE_INT16, 4, "int16")                                                                 \
  X(PM_DTYPE_UINT16, 5, "uint16")                                                               \
  X(PM_DTYPE_INT32, 6, "int32")                                                                 \
  X(PM_DTYPE_UINT32, 7, "uint32")                                                               \
  X(PM_DTYPE_INT64, 8, "int64")                                                                 \
  X(PM_DTYPE_UINT64, 9, "uint64")                                                               \
  X(PM_DTYPE_FLOAT16, 10, "float16")                                                            \
  X(PM_DTYPE_FLOAT32, 11, "float32")                                                            \
  X(PM_DTYPE_FLOAT64, 12, "float64")                                                            \
  X(PM_DTYPE_COMPLEX64, 13, "complex64")                                                        \
  X(PM_DTYPE_COMPLEX128, 14, "complex128")

typedef enum pm_dtype { PM_DTYPE_MAP(PM__ENUM_VALUE) } pm_dtype_t;

/** "uint8", "float32", ..., "other"; never NULL. */
PM_API const char *pm_dtype_name(pm_dtype_t dtype);

/** How file datasets read samples. */
/*  PM_IO_DIRECT: bypass the page cache (datasets larger than RAM). Reads that are 4 KiB-aligned
 *  in the file and in the slot go straight into pinned memory, others through a small aligned
 *  buffer. Where the filesystem refuses O_DIRECT, buffered pread is used and
 *  pm_dataset_info_t.note says why. */
#define PM_IO_MODE_MAP(X)                                                                       \
  X(PM_IO_PREAD, 0, "pread") /* pread(2) from the worker threads (default) */                   \
  X(PM_IO_MMAP, 1, "mmap")   /* map the files and copy from the mapping */                      \
  X(PM_IO_DIRECT, 2, "direct") /* O_DIRECT, see above */

typedef enum pm_io_mode { PM_IO_MODE_MAP(PM__ENUM_VALUE) } pm_io_mode_t;

typedef struct pm_dataset_s pm_dataset_t;

typedef struct pm_dataset_info {
  uint64_t samples;      /* samples in the dataset (token datasets: windows per epoch) */
  size_t sample_bytes;   /* bytes of one sample (token datasets: of its inputs) */
  size_t target_bytes;   /* token datasets: bytes of one sample's targets; 0 otherwise */
  int ndim;              /* dimensions of one sample (0: a scalar) */
  uint64_t shape[PM_DATASET_MAX_DIMS];
  pm_dtype_t dtype;
  size_t itemsize;       /* bytes of one element */
  char descr[128];       /* numpy dtype text, byte order made explicit: "|u1", "<f4", "<u2" */
  int files;             /* files behind the dataset (0 for callback datasets) */
  pm_io_mode_t io;       /* the read mode in force */
  char note[256];        /* why the mode in force differs from the one asked for, or "" */
  uint64_t tokens;       /* token datasets: tokens in the file; 0 otherwise */
  int fields;            /* fields of a sample (see pm_field_t): 1, 2 for token datasets
                            (inputs, targets), n for zipped and multi-field datasets. The fields
                            above (sample_bytes, shape, dtype...) describe field 0, target_bytes
                            field 1 */
} pm_dataset_info_t;

typedef struct pm_npy_options {
  pm_io_mode_t io;   /* PM_IO_PREAD */
  const char *dtype; /* NULL: any; else every file must have this dtype ("<f4", "u1", "|u1":
                        no byte order means native), or PM_ERR_FORMAT */
} pm_npy_options_t;

PM_API void pm_npy_options_init(pm_npy_options_t *options);
/** One dataset from one or more .npy files (format versions 1.0, 2.0 and 3.0, C order, any
 *  fixed-size dtype), samples along axis 0, the files' samples one after another. Every file
 *  must have the same sample shape and dtype. Everything is checked here, before the first
 *  batch: PM_ERR_IO for a file that cannot be opened or read, PM_ERR_FORMAT with the reason for
 *  a bad magic or header, Fortran order (more than one dimension), object dtypes (also inside
 *  structured ones), a shape that overflows, data shorter than the shape, mismatched files or
 *  the wrong dtype. options may be NULL. */
PM_API pm_status_t pm_dataset_open_npy(const char *const *paths, size_t npaths,
                                       const pm_npy_options_t *options,
                                       pm_dataset_t **dataset_out);

typedef struct pm_tokens_options {
  size_t seq_len;   /* tokens of a sample's inputs (required); a window holds seq_len + 1 */
  int token_bytes;  /* 2: uint16 (default), 4: uint32 */
  int random;       /* 1 (default): window starts drawn from (seed, epoch, index): new ones every
                       epoch, as nanoGPT's get_batch; 0: windows at fixed strided offsets */
  size_t stride;    /* strided windows: tokens between two starts (0: seq_len) */
  uint64_t windows; /* random windows: samples per epoch (0: (tokens - 1) / seq_len) */
  uint64_t seed;
  pm_io_mode_t io;
} pm_tokens_options_t;

PM_API void pm_tokens_options_init(pm_tokens_options_t *options);
/** A raw file of little-endian uint16 or uint32 tokens (nanoGPT's train.bin). Sample i is a
 *  window of seq_len + 1 tokens, delivered as inputs (its first seq_len tokens) and targets
 *  (its last seq_len: the inputs shifted by one). PM_ERR_FORMAT when the file size is not a
 *  whole number of tokens or the file holds fewer than seq_len + 1. */
PM_API pm_status_t pm_dataset_open_tokens(const char *path, const pm_tokens_options_t *options,
                                          pm_dataset_t **dataset_out);

typedef struct pm_dataset_callbacks {
  uint64_t samples;
  size_t sample_bytes;
  /** Write sample `index` (its sample_bytes bytes) to dst: a place in a pinned batch slot.
   *  Called from several worker threads at once. Return 0 on success; a negative pm_status_t
   *  is reported as it is, any other non-zero value as PM_ERR_IO. */
  int (*read)(uint64_t index, void *dst, void *user);
  void *user;
  void (*destroy)(void *user); /* optional: called by pm_dataset_destroy */
  pm_dtype_t dtype;            /* PM_DTYPE_OTHER: raw bytes (itemsize 1) */
  int ndim;                    /* 0: shape [sample_bytes / itemsize] */
  uint64_t shape[PM_DATASET_MAX_DIMS];
} pm_dataset_callbacks_t;

/** A dataset whose samples come from a callback, e.g. a decoder writing straight into the
 *  pinned slot. The struct is copied. */
PM_API pm_status_t pm_dataset_create(const pm_dataset_callbacks_t *callbacks,
                                     pm_dataset_t **dataset_out);

/* Fields. A sample may have several fields (an image and its label, token inputs and targets):
 * one loader then reads every field of a sample into one slot per batch, copies the slot with
 * one copy and delivers one pm_batch_t with an array per field (pm_batch_t.fields). Datasets of
 * several fields come from pm_dataset_open_tokens (inputs, targets), pm_dataset_zip (the fields
 * of several datasets side by side) and pm_dataset_create_fields (one callback writing every
 * field of a sample in one call). */

#define PM_MAX_FIELDS 16 /* fields of one sample */

/** One field of a sample. */
typedef struct pm_field {
  size_t bytes;      /* bytes of this field of one sample (0 in a spec: itemsize * prod(shape)) */
  pm_dtype_t dtype;  /* PM_DTYPE_OTHER: fixed-size records of `itemsize` bytes, see descr */
  size_t itemsize;   /* bytes of one element (0 in a spec: from dtype; required for OTHER) */
  int ndim;          /* dimensions of the field of one sample; 0: a scalar (a label) */
  uint64_t shape[PM_DATASET_MAX_DIMS];
  char descr[128];   /* numpy dtype text ("<f4", ">f4", "<U10", "<M8[s]", "[('a','<i4')]"); ""
                        in a spec: from dtype. Carried through to the batch unchanged, so a
                        consumer (NumPy) can rebuild dtypes pinmem has no code for */
} pm_field_t;

/** Field `field` of a dataset (0 <= field < info.fields). PM_ERR_INVALID out of range. */
PM_API pm_status_t pm_dataset_get_field(const pm_dataset_t *dataset, int field,
                                        pm_field_t *field_out);

/** Write every field of sample `index`: dsts[k] receives field k (fields[k].bytes bytes), each
 *  a place in a pinned batch slot. Called from several worker threads at once, once per
 *  sample (random augmentation therefore stays consistent across the fields). Return as
 *  pm_dataset_callbacks_t.read. */
typedef int (*pm_fields_read_fn)(uint64_t index, void *const *dsts, void *user);

typedef struct pm_dataset_fields_callbacks {
  uint64_t samples;
  int nfields;              /* 1..PM_MAX_FIELDS */
  const pm_field_t *fields; /* nfields specs (copied) */
  pm_fields_read_fn read;
  void *user;
  void (*destroy)(void *user); /* optional: called by pm_dataset_destroy */
} pm_dataset_fields_callbacks_t;

/** A callback dataset of several fields. Each spec is checked: bytes == itemsize * prod(shape)
 *  (bytes 0: computed), itemsize > 0 (PM_DTYPE_OTHER needs it), a descr that fits. The struct
 *  and the specs are copied. */
PM_API pm_status_t pm_dataset_create_fields(const pm_dataset_fields_callbacks_t *callbacks,
                                            pm_dataset_t **dataset_out);

/** One dataset whose sample i is sample i of each of `datasets`, their fields side by side in
 *  order (X and Y .npy files; a token dataset and a weight per window...). PM_ERR_INVALID unless
 *  every dataset has the same number of samples and the fields total at most PM_MAX_FIELDS.
 *  The zip uses the datasets (pm_dataset_destroy of one of them is PM_ERR_BUSY until the zip is
 *  destroyed); for a token dataset, epoch-dependent windows stay as they are. */
PM_API pm_status_t pm_dataset_zip(pm_dataset_t *const *datasets, size_t n,
                                  pm_dataset_t **dataset_out);

/* Rows datasets: a callback that writes a run of rows (every field of n samples) in one call,
 * for readers whose cost per call is high: worker processes reached over a socket, a remote
 * store, a batched decoder. A loader calls it once per claim of rows (pm_loader_config_t.
 * claim_rows), the claim's rows consecutive in the slot. */

/** What one read_rows call writes. */
typedef struct pm_rows_request {
  uint64_t epoch;
  uint64_t n;                 /* rows to write (>= 1) */
  const uint64_t *indices;    /* n dataset indices (valid during the call) */
  void *const *dsts;          /* per field k: where row 0 goes; row r of field k is at
                                 (char *)dsts[k] + r * fields[k].bytes */
  int worker;                 /* the loader worker calling (0..workers-1); -1 outside a loader */
  uint64_t batch;             /* the loader's batch of these rows (epoch * batches per epoch +
                                 batch), UINT64_MAX outside a loader */
  uint64_t row;               /* the first row's place in that batch: (batch, row) orders the
                                 claims, so the failures of several can be told apart */
} pm_rows_request_t;

/** Write every field of request->n samples. Called from several worker threads at once (each
 *  with its own rows). Return as pm_dataset_callbacks_t.read (0 ok, a negative pm_status_t as
 *  it is, any other non-zero value: PM_ERR_IO); a failure fails the batch of those rows. */
typedef int (*pm_rows_read_fn)(const pm_rows_request_t *request, void *user);

typedef struct pm_dataset_rows_callbacks {
  uint64_t samples;
  int nfields;              /* 1..PM_MAX_FIELDS */
  const pm_field_t *fields; /* nfields specs (copied; checked as pm_dataset_create_fields) */
  pm_rows_read_fn read_rows;
  void *user;
  void (*destroy)(void *user); /* optional: called by pm_dataset_destroy */
} pm_dataset_rows_callbacks_t;

/** A callback dataset that reads runs of rows. pm_dataset_read_fields and
 *  pm_dataset_read_sample call read_rows with n = 1 and worker -1; a zip of it reads one sample
 *  per call (worker: the loader worker, or -1). The struct and the specs are copied;
 *  PM_ERR_INVALID for a bad spec, samples 0 or read_rows NULL. */
PM_API pm_status_t pm_dataset_create_rows(const pm_dataset_rows_callbacks_t *callbacks,
                                          pm_dataset_t **dataset_out);

/** Sample i of the result is sample indices[i] of base (a subset, a reordering, repeats allowed:
 *  what a sampler yields), with base's fields. indices (n >= 1 of them, each below base's
 *  sample count: else PM_ERR_INVALID naming the position and value) are copied. base is busy
 *  (pm_dataset_destroy: PM_ERR_BUSY) until the result is destroyed. A select over a rows
 *  dataset reads a run of rows with one read_rows call on base, with the indices mapped. */
PM_API pm_status_t pm_dataset_select(pm_dataset_t *base, const uint64_t *indices, uint64_t n,
                                     pm_dataset_t **dataset_out);

/** Read every field of one sample into ordinary memory (dsts[k]: fields[k].bytes bytes; a NULL
 *  entry skips that field). What a loader delivers for it in `epoch`. */
PM_API pm_status_t pm_dataset_read_fields(pm_dataset_t *dataset, uint64_t epoch, uint64_t index,
                                          void *const *dsts);
/** PM_ERR_BUSY while a loader still uses the dataset. */
PM_API pm_status_t pm_dataset_destroy(pm_dataset_t *dataset);
PM_API pm_status_t pm_dataset_get_info(const pm_dataset_t *dataset, pm_dataset_info_t *info_out);
/** Read one sample into ordinary memory (what a loader delivers for it in `epoch`; the epoch
 *  matters only for random token windows). targets_dst: field 1 of a dataset of several fields
 *  (token targets; may be NULL); other fields: pm_dataset_read_fields. */
PM_API pm_status_t pm_dataset_read_sample(pm_dataset_t *dataset, uint64_t epoch, uint64_t index,
                                          void *dst, void *targets_dst);

typedef struct pm_loader_s pm_loader_t;

#define PM_DELIVERY_MAP(X)                                                                      \
  X(PM_DELIVER_DEVICE, 0, "device") /* batches in device buffers (default) */                   \
  X(PM_DELIVER_HOST, 1, "host") /* batches in the host slots: no device buffers, no copies */

typedef enum pm_delivery { PM_DELIVERY_MAP(PM__ENUM_VALUE) } pm_delivery_t;

/** Where a loader stands: saved with pm_loader_state, given back through
 *  pm_loader_config_t.resume so a job continues exactly where it stopped. Plain fixed-width
 *  fields: it may be written to a checkpoint as bytes. */
typedef struct pm_loader_state {
  uint32_t magic;     /* PM_LOADER_STATE_MAGIC */
  uint32_t flags;     /* bit 0 shuffle, bit 1 drop_last */
  uint64_t epoch;     /* epoch of the next batch to deliver */
  uint64_t batch;     /* its index within that epoch */
  uint64_t seed;      /* what the position means: a resume with other values is refused */
  uint64_t samples;
  uint64_t batch_size;
  int32_t rank, world_size;
} pm_loader_state_t;

#define PM_LOADER_STATE_MAGIC 0x314c4d50u /* "PML1" */

/** Start from pm_loader_config_init(); fields left at 0 take the defaults named here. */
typedef struct pm_loader_config {
  size_t batch_size;  /* samples per batch (required) */
  int workers;        /* reader threads (0: option loader_workers) */
  int prefetch;       /* batch slots in the ring: batches read and copied ahead (0: option
                         loader_prefetch) */
  int shuffle;        /* 1: a new permutation every epoch, a function of (seed, epoch) */
  uint64_t seed;
  int drop_last;      /* 1: deliver no partial batch and no padding (below) */
  int rank;           /* -1 (config_init): from RANK, else 0; below -1: PM_ERR_INVALID */
  int world_size;     /* -1 (config_init) or 0: from WORLD_SIZE, else 1; below -1:
                         PM_ERR_INVALID. RANK / WORLD_SIZE that are not integers in range are
                         PM_ERR_CONFIG */
  int pin_memory;     /* 1 (config_init): pinned slots, async copies. 0: pageable slots and a
                         plain copy inside pm_loader_next (the consumer waits for it), to
                         compare */
  pm_delivery_t delivery;
  uint64_t epochs;    /* epochs to deliver (config_init: 1); 0: no end */
  pm_pool_t *pool;    /* pinned slots come from here (NULL: the default pool) */
  size_t slot_bytes;  /* 0: a slot is exactly one batch; else the slot size, and a batch that
                         does not fit is refused (PM_ERR_INVALID) */
  const pm_loader_state_t *resume; /* NULL: epoch 0, batch 0 */
  int shared_slots;   /* 1: the host slots are PM_HOST_SHARED blocks, so other processes can
                         map them and write batches in place (pm_host_shared_fd on a batch's
                         host pointers); needs pin_memory 1 (PM_ERR_INVALID otherwise) */
  int ordered_workers; /* 1: the k-th claim of rows since the loader started goes to worker
                          k % workers (a worker waits for its turn), so which worker reads which
                          rows is a function of the configuration alone: per-worker random
                          state gives the same batches on every run. 0: first come */
  uint64_t claim_rows; /* rows a worker takes at a time (one read_rows call for a rows dataset);
                          0: automatic (a batch over 2 x workers, within a copy part); larger
                          than the batch: the batch */
  int lease_slots;     /* 1: when the next batch needs a slot the caller still holds, the held
                          batch keeps that slot's memory (freed by its pm_batch_release, once the
                          release stream is past it) and the ring takes a new slot from the
                          pool; PM_ERR_BUSY only when the pool's budget refuses it. 0: PM_ERR_BUSY
                          at once (the slots are a fixed ring) */
} pm_loader_config_t;

/** Sharding: with world_size W, rank r gets positions r, r+W, r+2W... of the epoch's order
 *  (permuted when shuffling), as torch's DistributedSampler. Unless drop_last, the order is
 *  padded to a multiple of W by repeating its first samples, so every rank gets the same
 *  number of samples and every sample is delivered at least once per epoch (exactly once when
 *  W divides the sample count); each rank's last batch may be partial. With drop_last the order
 *  is cut to a multiple of W instead and each rank drops its last partial batch: every
 *  delivered sample is delivered exactly once, some not at all. */
PM_API void pm_loader_config_init(pm_loader_config_t *config);
/** Starts the worker threads; the first batches are read at once. The dataset must outlive the
 *  loader. PM_ERR_INVALID for a bad config or a resume state that does not fit it, the pool's
 *  status when the slots cannot be pinned, PM_ERR_DEVICE_MEMORY for the device buffers. */
PM_API pm_status_t pm_loader_create(pm_dataset_t *dataset, const pm_loader_config_t *config,
                                    pm_loader_t **loader_out);
/** What pm_loader_create would make of `config` over `samples` samples, without making a
 *  loader (no dataset, no threads, no memory): the rank and world size it resolves (RANK and
 *  WORLD_SIZE where the config says -1) and what that rank gets per epoch. An epoch may have no
 *  batch here (0 samples, or drop_last leaving none), which pm_loader_create refuses: a caller
 *  that must tell an empty epoch from a bad config asks here first. PM_ERR_INVALID for a NULL
 *  argument, batch_size 0 or a rank outside the world; PM_ERR_CONFIG for a RANK or WORLD_SIZE
 *  that is not an integer in range; `out` is left untouched then. */
typedef struct pm_loader_plan {
  int32_t rank, world_size;
  uint64_t samples_per_epoch; /* this rank's, padding included (drop_last: cut) */
  uint64_t batches_per_epoch; /* 0: an epoch without a batch */
} pm_loader_plan_t;
PM_API pm_status_t pm_loader_plan(const pm_loader_config_t *config, uint64_t samples,
                                  pm_loader_plan_t *out);
/** Stops the workers at once (mid-epoch too) and frees the slots, buffers and threads; succeeds
 *  while batches are still held (as torch's DataLoader shuts down with tensors alive): a held
 *  batch stays valid until its pm_batch_release, which then frees its slot (the last one frees
 *  what is left of the loader). Every other call on a destroyed loader, and a second destroy,
 *  is PM_ERR_INVALID. No other call on the loader may run at the same time. */
PM_API pm_status_t pm_loader_destroy(pm_loader_t *loader);

/** One field of a batch: rows of the field, one per sample, in the slot. */
typedef struct pm_batch_field {
  void *data;             /* device buffer (PM_DELIVER_DEVICE) or the host slot (PM_DELIVER_HOST) */
  void *host;             /* the field in its host slot (pinned unless pin_memory is 0) */
  size_t bytes;           /* samples * bytes_per_sample */
  size_t bytes_per_sample;
  int ndim;               /* 1 + the field's dimensions */
  uint64_t shape[PM_DATASET_MAX_DIMS + 1]; /* [samples, the field's shape...] */
  const pm_field_t *info; /* dtype, itemsize, descr (the loader's copy, valid with the batch) */
} pm_batch_field_t;

/** One batch. Valid from pm_loader_next until pm_batch_release. inputs/targets (and their host_,
 *  _bytes, shape, dtype) are fields[0] and fields[1], kept for one- and two-field datasets. */
typedef struct pm_batch {
  void *inputs;         /* device buffer (PM_DELIVER_DEVICE) or the host slot (PM_DELIVER_HOST) */
  void *targets;        /* token datasets: the targets, else NULL */
  void *host_inputs;    /* the batch in its host slot (pinned unless pin_memory is 0) */
  void *host_targets;
  size_t inputs_bytes;  /* samples * sample_bytes */
  size_t targets_bytes; /* samples * target_bytes */
  size_t samples;       /* rows: batch_size, fewer only in a partial last batch of an epoch */
  int ndim;             /* 1 + the sample's dimensions */
  uint64_t shape[PM_DATASET_MAX_DIMS + 1]; /* [samples, sample shape...] (targets: the same) */
  pm_dtype_t dtype;
  size_t itemsize;
  uint64_t epoch;       /* epoch of this batch */
  uint64_t index;       /* its index within the epoch */
  const uint64_t *indices; /* the dataset index of each row (host memory) */
  pm_event_t event;     /* completes when the device buffer holds the batch (NULL when host) */
  int nfields;          /* fields of a sample (1 + targets for token datasets, n for zips) */
  const pm_batch_field_t *fields; /* nfields arrays, all behind one event (the loader's memory,
                                     valid until pm_batch_release) */
  struct {              /* the loader's bookkeeping: do not touch */
    pm_loader_t *loader;
    uint64_t seq;
    int slot;
  } internal;
} pm_batch_t;

/** The next batch, in order. Blocks until it has been read (a device copy may still run: wait
 *  for `event`, e.g. with pm_batch_wait_stream). PM_ERR_STATE once every epoch was delivered;
 *  PM_ERR_BUSY when the next batch needs a slot the caller still holds (batch i uses slot
 *  i mod prefetch: release batches in time; with lease_slots, only when the pool cannot give
 *  another slot), or while another thread is inside pm_loader_next
 *  of the same loader; a read error (PM_ERR_IO,
 *  PM_ERR_FORMAT, a callback's status) for the batch it happened in, after the complete batches
 *  before it, and again on every later call: never a short batch. */
PM_API pm_status_t pm_loader_next(pm_loader_t *loader, pm_batch_t *batch_out);
/** pm_loader_next waiting at most timeout_s seconds (>= 0) for the batch: *ready_out 1 and the
 *  batch, or PM_OK with *ready_out 0 when it is not ready by then, with nothing changed (the next
 *  call waits for the same batch), or pm_loader_next's errors (a loader's own error may be
 *  PM_ERR_TIMEOUT: a read past its time limit). For a caller that must stay responsive while a
 *  slow read runs (Python checks for Ctrl-C between calls). */
PM_API pm_status_t pm_loader_next_timed(pm_loader_t *loader, pm_batch_t *batch_out,
                                        double timeout_s, int *ready_out);
/** After pm_loader_next failed with a read error: the index, in the loader's dataset, of the
 *  sample whose read failed (for a pm_dataset_select, its position; the message names the
 *  index the read callback got), so that a binding can re-raise that sample's own error while
 *  other threads met errors of later samples. PM_ERR_STATE when no batch failed, or the error
 *  is not one known sample's (a copy or a slot failed; a read_rows call of several rows failed
 *  as a whole). */
PM_API pm_status_t pm_loader_error_sample(pm_loader_t *loader, uint64_t *index_out);
/** Later work on `stream` waits until the batch is in its device buffer (the host does not). */
PM_API pm_status_t pm_batch_wait_stream(const pm_batch_t *batch, pm_stream_t stream);
/** Give the batch back. Its buffers are reused only after the work queued on `stream` so far
 *  (the consumer's stream that reads the batch) has completed. Clears *batch. */
PM_API pm_status_t pm_batch_release(pm_batch_t *batch, pm_stream_t stream);
/** The position of the next batch pm_loader_next would deliver. */
PM_API pm_status_t pm_loader_state(pm_loader_t *loader, pm_loader_state_t *state_out);

typedef struct pm_loader_stats {
  uint64_t batches_per_epoch; /* on this rank */
  uint64_t samples_per_epoch; /* on this rank, padding included */
  int workers, prefetch;
  size_t slot_bytes;          /* bytes of one slot (and of one device buffer) */
  uint64_t batches;           /* delivered */
  uint64_t samples;
  uint64_t bytes;             /* inputs + targets delivered */
  uint64_t waits;             /* pm_loader_next calls that had to wait for their batch */
  double stall_seconds;       /* time pm_loader_next spent waiting for data (and, with
                                 pin_memory 0, in the plain copy) */
  double next_seconds;        /* all time inside pm_loader_next */
  double read_seconds;        /* worker time in dataset reads, summed over workers */
  double collate_seconds;     /* worker time preparing slots (indices, waiting for a slot's
                                 previous copy); samples are read in place, so no gathering */
  double copy_seconds;        /* device time of the batch copies (completed ones) */
  size_t device_bytes;        /* device memory held by the batch buffers */
  size_t host_bytes;          /* host memory held by the slots */
} pm_loader_stats_t;

PM_API pm_status_t pm_loader_get_stats(pm_loader_t *loader, pm_loader_stats_t *stats_out);

/* ------------------------------------------------------------------------------------------ */
/* Options                                                                                     */
/* ------------------------------------------------------------------------------------------ */

#define PM_OPTION_SOURCE_MAP(X)                                                                 \
  X(PM_OPTION_DEFAULT, 0, "default")                                                            \
  X(PM_OPTION_ENV, 1, "env") /* from PINMEM_<NAME> */                                           \
  X(PM_OPTION_SET, 2, "set") /* from pm_option_set */

typedef enum pm_option_source { PM_OPTION_SOURCE_MAP(PM__ENUM_VALUE) } pm_option_source_t;

typedef struct pm_option_info {
  const char *name;          /* "budget" */
  const char *env;           /* "PINMEM_BUDGET" */
  const char *default_value; /* as text */
  const char *doc;
  char value[128];           /* the value in force, as text */
  pm_option_source_t source;
} pm_option_info_t;

PM_API int pm_option_count(void);
PM_API pm_status_t pm_option_get(int index, pm_option_info_t *info_out);
PM_API pm_status_t pm_option_find(const char *name, pm_option_info_t *info_out);
/** Set an option explicitly (wins over the environment). Validated now: PM_ERR_CONFIG with the
 *  reason otherwise. Options read at init (backend) only take effect before pm_init. value NULL
 *  drops the explicit value: PINMEM_<NAME> or the default is in force again. */
PM_API pm_status_t pm_option_set(const char *name, const char *value);
/** "4096", "64K", "1.5M", "2G", "1T" (powers of 1024; an optional trailing B or iB). A fraction
 *  needs a suffix ("1.5" is PM_ERR_CONFIG: not a whole number of bytes) and rounds down to a
 *  byte with one ("1.1K" is 1126). */
PM_API pm_status_t pm_parse_size(const char *text, size_t *bytes_out);

#ifdef __cplusplus
}
#endif
#endif /* PINMEM_H */
