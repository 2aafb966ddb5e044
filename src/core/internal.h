/*
 * Internal interfaces shared between pinmem's source files (pm__ prefix), grouped by the file
 * that defines them. Nothing here is installed or stable.
 */
#ifndef PINMEM_INTERNAL_H
#define PINMEM_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "pinmem.h"

#if defined(__GNUC__)
#define PM__PRINTF(fmt_idx, arg_idx) __attribute__((format(printf, fmt_idx, arg_idx)))
#else
#define PM__PRINTF(fmt_idx, arg_idx)
#endif

#define PM__MIN(a, b) ((a) < (b) ? (a) : (b))
#define PM__MAX(a, b) ((a) > (b) ? (a) : (b))

/* ---- status.c ---------------------------------------------------------------------------- */

/* Record `status` with a printf-style detail for pm_last_error() and return `status`, so a
 * failure path reads: return pm__set_error(PM_ERR_INVALID, "bytes is 0"); */
pm_status_t pm__set_error(pm_status_t status, const char *fmt, ...) PM__PRINTF(2, 3);
/* Prefix the current detail with more context ("pm_host_alloc: " + old detail), keep status. */
pm_status_t pm__wrap_error(pm_status_t status, const char *fmt, ...) PM__PRINTF(2, 3);
void pm__clear_error(void);
/* The detail the last pm__clear_error() on this thread removed ("" if none): for diagnostics. */
const char *pm__cleared_error(void);

/* ---- names.c ----------------------------------------------------------------------------- */

/* Names of enum values, generated from the X-macro lists (pinmem.h, below): a value added to a
 * list has its name. Out-of-range values give "?" (or the function's documented fallback). */
#define PM__NAME_CASE(name, value, text, ...) \
  case name:                                  \
    return text;
#define PM__SYMBOL_CASE(name, ...) \
  case name:                       \
    return #name;
/* Keyword tables ({word, value}) for the option parser, from the same lists. */
#define PM__KEYWORD_ROW(name, value, text, ...) {text, name},

const char *pm__backend_kind_name(pm_backend_kind_t kind); /* "none", "cuda", "host" */
const char *pm__copy_kind_name(pm_copy_kind_t kind);       /* "H2D" */
const char *pm__copy_kind_symbol(pm_copy_kind_t kind);     /* "PM_COPY_H2D" */
const char *pm__copy_path_name(pm_copy_path_t path);       /* "staged" */
const char *pm__memory_kind_name(pm_memory_kind_t kind);   /* "registered" */
const char *pm__exhaust_policy_name(pm_exhaust_policy_t policy);
const char *pm__io_mode_name(pm_io_mode_t io);              /* "pread", "mmap", "direct" */
const char *pm__file_io_name(pm_file_io_t io);              /* "auto", "buffered", "direct" */
const char *pm__delivery_name(pm_delivery_t delivery);      /* "device", "host" */
const char *pm__option_source_name(pm_option_source_t src); /* "default", "env", "set" */

/* ---- handles.c --------------------------------------------------------------------------- */

/* The live set of user-held handles: entered at create, removed at destroy, checked by every
 * public call, so a stale or foreign pointer gets PM_ERR_INVALID instead of a use after free. */
#define PM__HANDLE_KIND_MAP(X)                                                                  \
  X(PM__HANDLE_FENCE, 1, "fence")                                                               \
  X(PM__HANDLE_POOL, 2, "pool")                                                                 \
  X(PM__HANDLE_DATASET, 3, "dataset")                                                           \
  X(PM__HANDLE_LOADER, 4, "loader")                                                             \
  X(PM__HANDLE_BLOCKS, 5, "block store")

typedef enum pm__handle_kind { PM__HANDLE_KIND_MAP(PM__ENUM_VALUE) } pm__handle_kind_t;

pm_status_t pm__handle_add(const void *h, pm__handle_kind_t kind); /* PM_ERR_NOMEM only */
/* false when h was not in the set (already removed, or never added): the caller's double
 * destroy. Removes foreign handles too. */
bool pm__handle_remove(const void *h, pm__handle_kind_t kind);
/* In the set and made in this process (not before the latest fork). */
bool pm__handle_live(const void *h, pm__handle_kind_t kind);
/* In the set but made by the parent before the latest fork(): the object's threads and pinned
 * memory do not exist here. Its destroy must only forget it:
 *   if (pm__handle_foreign(h, K)) { (void)pm__handle_remove(h, K); return PM_OK; } */
bool pm__handle_foreign(const void *h, pm__handle_kind_t kind);
/* PM_OK; PM_ERR_INVALID with "<fn>: <kind> <h> is unknown or was already destroyed"; or
 * PM_ERR_STATE for a foreign handle (made before fork()). */
pm_status_t pm__handle_check(const void *h, pm__handle_kind_t kind, const char *fn);
void pm__handles_atfork_prepare(void); /* fork.c: take the lock before fork() */
void pm__handles_atfork_parent(void);  /* release it in the parent */
void pm__handles_atfork_child(void);   /* a fresh lock in a forked child */

/* ---- fork.c ------------------------------------------------------------------------------ */

/* How many fork()s separate this process from the one that loaded pinmem (0 in the original).
 * Kept by handles.c (a leaf); fork.c's handlers are installed at load and call down only. */
unsigned pm__fork_generation(void);
/* fork.c's handlers act only once pinmem was used (pm_init, the first handle): a process that
 * forks before touching pinmem forks as any process does. Arming is a flag in handles.c. */
void pm__fork_arm(void);
bool pm__fork_armed(void);
/* Each module's part: PREPARE takes its process-wide locks, PARENT releases them, CHILD gives it
 * fresh locks and drops what belongs to the parent's threads and pinned memory. */
typedef enum pm__fork_phase { PM__FORK_PREPARE, PM__FORK_PARENT, PM__FORK_CHILD } pm__fork_phase_t;
void pm__api_atfork(pm__fork_phase_t phase);
void pm__init_atfork(pm__fork_phase_t phase); /* init.c: init_lock, the backend of the parent */
void pm__pool_atfork(pm__fork_phase_t phase);
void pm__config_atfork(pm__fork_phase_t phase);
void pm__copy_atfork(pm__fork_phase_t phase);
void pm__threadpool_atfork(pm__fork_phase_t phase);
void pm__numa_atfork(pm__fork_phase_t phase); /* numa_place.c: a leaf lock */
void pm__host_atfork(pm__fork_phase_t phase); /* backend_host_stream.c */
void pm__registry_atfork(pm__fork_phase_t phase);
void pm__shared_atfork(pm__fork_phase_t phase);     /* core/shared.c */
void pm__shared_api_atfork(pm__fork_phase_t phase); /* shared_api.c */

/* ---- config.c ---------------------------------------------------------------------------- */

typedef enum pm__opt {
  PM__OPT_BACKEND,            /* auto|cuda|host */
  PM__OPT_DEVICE,             /* int, default device */
  PM__OPT_BUDGET,             /* size or "auto" -> pm__opt_size returns 0 for auto */
  PM__OPT_BUDGET_POLICY,      /* fail|wait -> pm__opt_int returns pm_exhaust_policy_t */
  PM__OPT_BUDGET_TIMEOUT,     /* seconds (double) */
  PM__OPT_PIN_THREADS,        /* int, 0 = auto (min(16, cores)) -> pm__opt_int returns resolved */
  PM__OPT_FAST_PIN_MIN,       /* size */
  PM__OPT_HUGE_PAGES,         /* 0|1 */
  PM__OPT_HOST_DEVICE_MEMORY, /* size: device memory the host backend simulates */
  PM__OPT_COPY_CHUNK,         /* size: staging chunk (copy.c) */
  PM__OPT_COPY_SLOTS,         /* int: bounce-buffer ring depth (copy.c) */
  PM__OPT_COPY_THREADS,       /* int: staging memcpy threads, 0 = auto -> resolved (copy.c) */
  PM__OPT_COPY_STAGE_MIN,     /* size: pageable copies below this use the plain backend copy */
  PM__OPT_LOADER_WORKERS,     /* int: loader reader threads, 0 = auto -> resolved (loader.c) */
  PM__OPT_LOADER_PREFETCH,    /* int: loader batch slots (loader.c) */
  PM__OPT_COPY_BOUNCE,        /* whole|ring|auto -> pm__copy_bounce_t (copy_stage.c) */
  PM__OPT_COPY_MEMCPY,        /* libc|movsb|stream -> pm__copy_memcpy_t (memcpy.c) */
  PM__OPT_COPY_BATCH,         /* dma|kernel|auto -> pm__copy_batch_t (api.c) */
  PM__OPT_COPY_RAMP,          /* 0|1: growing first units of an H2D staging (copy_stage.c) */
  PM__OPT_COPY_PIECE,         /* size: ring slots filled by all threads in pieces; 0 = off */
  PM__OPT_COPY_PIECE_SLOTS,   /* int: ring depth of the copy_piece layout; 0 = copy_slots */
  PM__OPT_LOADER_PIECE,       /* size: a loader slot's copy in parts of this size; 0 = whole */
  PM__OPT_NUMA,               /* auto|off|N -> pm__opt_int: PM__NUMA_AUTO, PM__NUMA_OFF or N */
  PM__OPT_NUMA_THREADS,       /* 0|1: pinmem's threads run on CPUs of the device's node */
  PM__OPT_HOST_DEVICES,       /* int 1..16: devices the host backend simulates */
  PM__OPT_FILE_CHUNK,         /* size: bounce slot of pm_file_* calls that leave options->chunk 0 */
  PM__OPT_FILE_WRITE_CHUNK,   /* size: the same for writes; 0 = file_chunk */
  PM__OPT_FILE_DIRECT_CHUNK,  /* size: the same for reads through O_DIRECT; 0 = file_chunk */
  PM__OPT_FILE_THREADS,       /* int: I/O threads of pm_file_* calls; 0 = copy_threads */
  PM__OPT_FILE_SLOTS,         /* int: bounce slots of a pm_file_* ring; 0 = pm__file_slots */
  PM__OPT_FILE_PART,          /* size: a read slot's H2D DMA queued in parts of this size; 0 = off */
  PM__OPT_BLOCKS_KERNEL_MAX,  /* size or auto (PM__BLOCKS_CUTOFF_AUTO): block store path cut-off */
  PM__OPT_BLOCKS_CHUNK,       /* size: bytes a block store pins per registration */
  PM__OPT_LOADER_PROCESS_DEPTH, /* int 1..8: loader threads per worker process (Python loader) */
  PM__OPT_LOADER_PROCESS_CLAIM, /* int 1..4096: rows per claim sent to a worker process */
  PM__OPT_COUNT
} pm__opt_t;

/* blocks_kernel_max's "auto": calibrate the cut-off on first use on each device. */
#define PM__BLOCKS_CUTOFF_AUTO SIZE_MAX

/* Limits the option table and the matching arguments (pm_loader_config_t) share. */
#define PM__MAX_SLOTS 4096          /* copy_slots, copy_piece_slots, loader_prefetch */
#define PM__LOADER_MAX_WORKERS 256  /* loader_workers */
#define PM__COPY_MAX_THREADS 256    /* copy_threads */

/* The value in force, parsed once and cached (an atomic load after the first lookup): an
 * explicit pm_option_set value, else PINMEM_<NAME>, else the table's default. Thread counts
 * with an auto setting come back resolved (never 0). The environment is read at the first
 * lookup after a change: pm__opt_reload forgets every cached value (tests that setenv). */
size_t pm__opt_size(pm__opt_t opt);
long pm__opt_int(pm__opt_t opt);
double pm__opt_double(pm__opt_t opt);
void pm__opt_reload(void);
/* Current value as text (for enum-like options such as backend). Thread-safe copy into buf. */
void pm__opt_text(pm__opt_t opt, char *buf, size_t len);
/* Why an environment value of opt was ignored ("PINMEM_BACKEND='gpu' ignored: ..."), or "" when
 * none was (the default is in force only because the variable did not parse). */
void pm__opt_ignored(pm__opt_t opt, char *buf, size_t len);

/* pm_parse_size's parser with its reason as an out parameter: false with why ("negative", "not a
 * number", "unexpected 'Q'", "not a whole number of bytes", "too large"; short, without the
 * text) when `text` is not a size. The CLI words its own messages from it. */
bool pm__size_parse(const char *text, size_t *bytes_out, char *why, size_t n);
/* The sizes pm_parse_size's messages give as examples. */
#define PM__SIZE_EXAMPLES "4096, 64K, 1.5M, 2G, 1T"

/* Values of the copy_bounce option: how staged H2D copies use pinned bounce memory. */
#define PM__COPY_BOUNCE_MAP(X)                                                                  \
  X(PM__BOUNCE_WHOLE, 0, "whole") /* one pool block the size of the copy (ring if refused) */   \
  X(PM__BOUNCE_RING, 1, "ring")   /* always the ring of copy_slots chunk buffers */             \
  X(PM__BOUNCE_AUTO, 2, "auto")   /* the ring when the stream is idle, else a whole-copy block */

typedef enum pm__copy_bounce { PM__COPY_BOUNCE_MAP(PM__ENUM_VALUE) } pm__copy_bounce_t;

/* Values of the copy_memcpy option: how staging threads move bytes to and from bounce memory. */
#define PM__COPY_MEMCPY_MAP(X)                                                                  \
  X(PM__MEMCPY_LIBC, 0, "libc")     /* the C library's memcpy */                                \
  X(PM__MEMCPY_MOVSB, 1, "movsb")   /* x86-64 rep movsb (fast strings); libc elsewhere */        \
  X(PM__MEMCPY_STREAM, 2, "stream") /* x86-64 AVX2 non-temporal stores; libc without AVX2 */    \
  X(PM__MEMCPY_AUTO, 3, "auto") /* per step: movsb into the ring of an H2D copy, else stream */

typedef enum pm__copy_memcpy { PM__COPY_MEMCPY_MAP(PM__ENUM_VALUE) } pm__copy_memcpy_t;

/* Values of the copy_batch option: how the direct pieces of a batch move. */
#define PM__COPY_BATCH_MAP(X)                                                                   \
  X(PM__BATCH_DMA, 0, "dma") /* the copy engines: cudaMemcpyBatchAsync, else a copy per piece */ \
  X(PM__BATCH_KERNEL, 1, "kernel") /* one kernel that reads and writes the pieces in place */   \
  X(PM__BATCH_AUTO, 2, "auto")     /* the kernel for many small pieces, else dma */

typedef enum pm__copy_batch { PM__COPY_BATCH_MAP(PM__ENUM_VALUE) } pm__copy_batch_t;

/* ---- memcpy.c ------------------------------------------------------------------------------ */

/* Copy n bytes as copy_memcpy says (the value from pm__copy_cfg). */
void pm__memcpy_mode(void *dst, const void *src, size_t n, int mode);
/* The mode that will really run for `mode` on this CPU (a missing feature falls back to libc;
 * auto must be resolved by pm__memcpy_for first, else it runs as stream). */
int pm__memcpy_effective(int mode);
/* The mover for one staging step under copy_memcpy = `mode`: an explicit mode stands; auto
 * takes movsb for bytes the DMA engine reads again soon from a cache-sized buffer (H2D into the
 * ring) and stream for everything else. */
int pm__memcpy_for(int mode, bool into_ring);

/* ---- sysinfo.c --------------------------------------------------------------------------- */

double pm__now(void); /* monotonic seconds */
size_t pm__page_size(void);
size_t pm__physical_memory(void); /* bytes of RAM */
int pm__cpu_count(void);          /* online CPUs */
/* RLIMIT_MEMLOCK soft limit in bytes; SIZE_MAX when unlimited or when the process has
 * CAP_IPC_LOCK (root), which makes the limit irrelevant to mlock. */
size_t pm__memlock_limit(void);
size_t pm__memlock_rlimit_raw(void); /* the soft limit itself, SIZE_MAX if RLIM_INFINITY */
bool pm__has_cap_ipc_lock(void);
/* Round up to a multiple of `align` (a power of two). */
static inline size_t pm__align_up(size_t v, size_t align) {
  return (v + align - 1) & ~(align - 1);
}
/* Whether [a, a + n) and [b, b + n) share a byte (without the wrap of a + n). */
static inline bool pm__ranges_overlap(const void *a, const void *b, size_t n) {
  uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
  return n && (x >= y ? x - y : y - x) < n;
}
/* Units of `d` bytes that cover `n` (d > 0), without the wrap of (n + d - 1) / d. */
static inline size_t pm__div_up(size_t n, size_t d) {
  return n / d + (n % d != 0);
}

/* /sys/bus/pci/devices/<bus_id>/<attr> of a PCI device: a decimal integer >= min_valid
 * ("current_link_width"), or a link speed as a PCIe generation ("32.0 GT/s PCIe" -> 5); -1
 * when the file is missing or says anything else. */
int pm__pcie_sysfs_int(const char *bus_id, const char *attr, int min_valid);
int pm__pcie_sysfs_gen(const char *bus_id, const char *attr);

/* ---- numa.c: topology from sysfs ----------------------------------------------------------- */

#define PM__CPUS_MAX 1024 /* CPU ids at or above are rejected by the parser */
#define PM__NUMA_MAX_NODES 64
#define PM__NUMA_MAX_DEVICES 64

/* A set of CPU ids, as a bit mask. */
typedef struct pm__cpus {
  uint64_t bits[PM__CPUS_MAX / 64];
} pm__cpus_t;

/* Parse a kernel cpulist ("0-3,8,10-11", trailing newline allowed, "" = empty set) into
 * *out. PM_ERR_FORMAT with the offending text in pm_last_error() on bad input (a reversed
 * range, a stray character, an id >= PM__CPUS_MAX); *out is set only on success. */
pm_status_t pm__cpulist_parse(const char *text, pm__cpus_t *out);
/* Write the set back as a cpulist ("0-3,8"); "" for the empty set; truncated to len. */
void pm__cpulist_format(const pm__cpus_t *cpus, char *buf, size_t len);
int pm__cpus_count(const pm__cpus_t *cpus);
bool pm__cpus_has(const pm__cpus_t *cpus, int cpu);

typedef struct pm__numa_node {
  int id;          /* N of /sys/devices/system/node/nodeN */
  bool cpus_known; /* cpulist read and parsed */
  pm__cpus_t cpus;
  bool mem_known;             /* meminfo read with both MemTotal and MemFree */
  size_t mem_total, mem_free; /* bytes */
} pm__numa_node_t;

typedef struct pm__numa_device {
  char pci_bus_id[32]; /* as asked for, lowercased; "" = the device has no PCI location */
  int node;            /* numa_node; -1 unknown (file missing, unreadable, or the kernel's -1) */
  bool cpus_known;     /* local_cpulist read and parsed */
  pm__cpus_t cpus;
} pm__numa_device_t;

typedef struct pm__topology {
  int node_count; /* nodes found; 0 when the node directory is missing (no NUMA support) */
  pm__numa_node_t nodes[PM__NUMA_MAX_NODES]; /* ascending id */
  bool multi_node;                           /* more than one node */
  int device_count;
  pm__numa_device_t devices[PM__NUMA_MAX_DEVICES];
  /* What could not be read, "; "-separated ("node1/cpulist: malformed '0-x'"); "" if all. */
  char problems[512];
} pm__topology_t;

/* Read the NUMA topology under `sysfs_root` (NULL = "/sys"; tests pass a fake tree): every
 * node's CPUs and memory, and for each of the n PCI bus ids its node and local CPUs. Missing
 * or malformed files do not fail the call: the part is marked unknown and named in
 * out->problems. PM_ERR_INVALID for a NULL out, n < 0 or n > PM__NUMA_MAX_DEVICES, NULL ids
 * with n > 0. No locks, no caching (the caller owns *out, ~21 KiB: heap or a large stack). */
pm_status_t pm__topology_read(const char *sysfs_root, const char *const *bus_ids, int n,
                              pm__topology_t *out);

/* numa option values other than a node number. */
#define PM__NUMA_AUTO (-1)
#define PM__NUMA_OFF (-2)

/* ---- numa_place.c: placing memory and threads (state read lazily, process-wide) ---------- */

/* Called by each pinmem thread before it works for `device` (-1: no device): keeps the
 * thread on CPUs of the device's NUMA node when option numa_threads allows it (the node's CPUs
 * within those the process was allowed at first use); device -1, or no node, puts a thread that
 * was moved back on those CPUs. Cheap when nothing changes (a thread-local compare). */
void pm__numa_thread_follow(int device);
/* The CPUs pm__numa_thread_follow(device) would put a thread on, for work that sets its own
 * affinity (the Python loader's worker processes): 1 and *out = the node's CPUs within those
 * the process was allowed at first use, when numa_threads=1, `device` has a node with known
 * CPUs and that set is not empty; 0 (*out empty) when there is nothing to do. */
int pm__numa_cpus_for(int device, pm__cpus_t *out);
/* The node to place memory for `device` under option numa: off -> -1; N -> N; auto -> the
 * device's node on a machine with more than one node, else -1 (also for device -1). */
int pm__numa_node_for(int device);
/* pm__numa_node_for(the calling thread's current device on b). Asks b only where it matters
 * (numa=auto on a multi-node machine); b may be NULL (then auto gives -1). */
int pm__numa_node_current(const pm__backend_t *b);
/* Test hook: read the topology under sysfs_root instead of /sys, device k at bus_ids[k] (k < n;
 * other devices have no node). NULL root: back to the real machine. Drops what was read. */
void pm__numa_test_override(const char *sysfs_root, const char *const *bus_ids, int n);
/* Bind [addr, addr + len) (page aligned, not yet touched) to prefer `node` (MPOL_PREFERRED).
 * false when node < 0 or binding failed: the failure (no libnuma, a node the process may not
 * use, mbind's error) is counted and its reason kept for pm__numa_state; never an error. */
bool pm__numa_bind(void *addr, size_t len, int node);
/* The calling thread's memory policy, saved by pm__numa_prefer_begin. */
typedef struct pm__numa_policy {
  bool active;
  int mode;
  unsigned long mask[1024 / (8 * sizeof(unsigned long))];
} pm__numa_policy_t;
/* Make the calling thread prefer `node` for its new pages (around an allocator that touches
 * inside the call, such as cudaHostAlloc); pm__numa_prefer_end restores the saved policy.
 * false (nothing changed, failure counted as in pm__numa_bind) when it could not. */
bool pm__numa_prefer_begin(int node, pm__numa_policy_t *saved);
void pm__numa_prefer_end(pm__numa_policy_t *saved);
/* What placement does in this process, for `pinmem info`. */
typedef struct pm__numa_state {
  long mode;       /* PM__NUMA_AUTO, PM__NUMA_OFF or the node */
  bool threads;    /* option numa_threads */
  bool libnuma;    /* loaded and the kernel supports NUMA */
  char libnuma_why[200]; /* why not, "" when loaded */
  int node_count;
  bool multi_node;
  unsigned long long bind_ok, bind_failures;     /* ranges bound / refused, process-wide */
  unsigned long long threads_placed, threads_refused;
  char last_failure[256], last_thread_problem[256]; /* "" when none */
} pm__numa_state_t;
void pm__numa_state(pm__numa_state_t *out);

/* ---- thread_device.c: the device a thread works for ------------------------------------- */

/* The calling thread's current device (the backend's, without starting it), or -1 when no
 * backend is up. Captured by whoever hands work to another pinmem thread. */
int pm__thread_device(void);
/* Called by each pinmem thread before it works for `device` (-1: no device): makes it the
 * thread's current device when the backend is up and it is not already, then
 * pm__numa_thread_follow(device). Cheap when nothing changes (one get_device). */
void pm__thread_enter(int device);
/* Make `device` current on the calling thread (a user's thread that pinmem works on for several
 * devices in one call, and hands back on the caller's device): no NUMA placement. */
void pm__thread_set_device(int device);
/* A call that makes another device current for its work and then gives the caller its own
 * back: pm__device_binding reads the caller's (its device, or PM__DEVICE_NONE where the backend
 * says the thread has none: backend.h, bound_device) through b, and pm__device_put_back gives
 * it back (PM__DEVICE_KEEP: nothing was changed, nothing to give back). A thread that had no
 * device is left with none, not with device 0, whose context it would get. */
#define PM__DEVICE_KEEP (-1)
#define PM__DEVICE_NONE (-2)
pm_status_t pm__device_binding(const pm__backend_t *b, int *binding_out);
void pm__device_put_back(const pm__backend_t *b, int binding);
/* The devices this process used (bit d: device d entered, set or handed over), for calls that
 * must reach every device in use and no other (pm__pool_devices_idle). */
void pm__devices_used_mark(int device);
uint64_t pm__devices_used(void);

/* ---- the host backend's simulated devices (backend_host_memory.c), for tests ------------- */

#define PM__HB_MAX_DEVICES 16 /* option host_devices' upper bound */
/* Calls that need a context (see backend_host_memory.c) made while `device` was current. */
uint64_t pm__hb_device_calls(int device);
/* Calls that broke CUDA's multi-device rules, made while `device` was current (-1: all). */
uint64_t pm__hb_device_mismatches(int device);
void pm__hb_device_counters_reset(void);
/* The last mismatch in words ("" if none since the reset). */
void pm__hb_last_mismatch(char *buf, size_t len);
/* completion.c: true once the copy engine's completion threads and event reaper have nothing
 * left to do (work of earlier calls finished), false after timeout_ms; for tests that count
 * backend calls. */
bool pm__copy_quiesce(unsigned timeout_ms);

/* ---- api.c ------------------------------------------------------------------------------- */

/* The active backend, initialising on first use. NULL (and pm__set_error) if none could start. */
const pm__backend_t *pm__backend(void);
/* The started backend without fault injection's forwarding table, or NULL when none is up
 * (never starts one): for device bookkeeping (thread_device.c). */
const pm__backend_t *pm__backend_raw(void);
/* Option device was given (pm_option_set or PINMEM_DEVICE), not just its default: only then
 * does starting a backend make a device current (init.c). */
bool pm__device_option_given(void);
/* Why pm_init chose the backend in force, for `pinmem info` ("auto: no NVIDIA driver found
 * (...)", "auto: a CUDA device is present", "asked for (option backend)"); "" when none is
 * started. pm_backend_info gives it with the driver's state. */
const char *pm__backend_reason(void);
/* The backend in force is auto's fallback to the host backend (no usable CUDA device): its
 * simulated devices are not on offer. */
bool pm__backend_is_fallback(void);
/* PM_OK unless pm__backend_is_fallback(); then PM_ERR_NO_DEVICE with the reason, for `call` (the
 * public device calls refuse so). */
pm_status_t pm__fallback_refuse(const char *call);
/* Shorthand used at the top of public calls: */
#define PM__BACKEND_OR_RETURN(b)          \
  const pm__backend_t *b = pm__backend(); \
  if (!b) return pm__backend_failed()
/* The status of a failed pm__backend(): PM_ERR_STATE in a child forked after the cuda backend
 * started, else PM_ERR_NO_DEVICE with the start's detail. */
pm_status_t pm__backend_failed(void);
/* Take the backend down (pm_finalize, after the pool and the copy engine). */
void pm__backend_stop(void);

/* ---- copy_batch.c ---------------------------------------------------------------------------- */

/* Plain backend copies of many items, each validated as pm_memcpy_async validates one, queued
 * with the backend's batch call where it has one (else a loop). kernel_ok: every item joins
 * device, managed or pinned memory and none goes host to host, so the copy_batch option may
 * hand them to the batch copy kernel. */
pm_status_t pm__memcpy_batch_async(const pm_copy_item_t *items, size_t count, pm_copy_kind_t kind,
                                   pm_stream_t stream, bool kernel_ok);

/* ---- offload/blocks.c: the KV-cache block store ------------------------------------------ */

/* Test hook: the most a block store pins before pm_blocks_create returns (its first chunk;
 * 64 MiB), so tests of uneven chunks need not pin 64 MiB. */
extern atomic_size_t pm__blocks_first_bytes;

/* ---- registry.c -------------------------------------------------------------------------- */

/* One tracked range of memory. */
typedef struct pm__range {
  uintptr_t base;
  size_t size;
  pm_memory_kind_t kind;
  unsigned flags;
  void *owner;    /* pm_pool_t* for pool segments, NULL otherwise */
  void *dev_base; /* device address of base when mapped, else NULL */
} pm__range_t;

/* Add a range; PM_ERR_OVERLAP (with both ranges in the detail) if any byte is tracked. */
pm_status_t pm__registry_add(const pm__range_t *range);
/* Remove the range that starts exactly at base and has this kind. PM_ERR_NOT_FOUND otherwise
 * (PM_ERR_WRONG_KIND if a range of another kind starts there). *removed_out may be NULL. */
pm_status_t pm__registry_remove(uintptr_t base, pm_memory_kind_t kind, pm__range_t *removed_out);
/* Range containing ptr: true and *out filled, or false. */
bool pm__registry_find(const void *ptr, pm__range_t *out);
/* A tracked range sharing a byte with [base, base + size), if any (the lowest, or the one holding
 * base). */
bool pm__registry_find_overlap(uintptr_t base, size_t size, pm__range_t *out);
size_t pm__registry_count(void);
void pm__registry_clear(void); /* pm_finalize only */

/* ---- classify.c: what a pointer is --------------------------------------------------------- */

/* Private flag on a registry entry whose registration has not finished yet (api.c). */
#define PM__REG_PENDING (1u << 31)
/* What a span of memory is, for the copy paths: the one vocabulary of memory kinds, used by the
 * copy engine, the plain copy checks (classify.c) and the host backend alike. */
typedef enum pm__mem {
  PM__MEM_PAGEABLE,
  PM__MEM_PINNED,    /* pinned by pinmem: a pool block or a registration */
  PM__MEM_PINNED_RO, /* registered with PM_REGISTER_READ_ONLY (the device may only read it) */
  /* Page-locked by another library (cudaHostAlloc, cudaHostRegister, PyTorch's pin_memory), as
   * the backend reports it: one DMA like pinmem's own, but never a kernel's (whether it is
   * mapped for kernels is not known). */
  PM__MEM_PINNED_OTHER,
  /* Starts in such memory and runs on past it. CUDA refuses a DMA over that range
   * (cudaErrorInvalidValue, seen on the H200), so it is staged whatever its size. */
  PM__MEM_PINNED_PART,
  PM__MEM_MANAGED,
  PM__MEM_DEVICE
} pm__mem_t;
const char *pm__mem_name(pm__mem_t k); /* "pinned host", ...: for messages */
/* The kind of a range the registry tracks (no backend call). */
pm__mem_t pm__range_mem(const pm__range_t *r);
/* Classify [p, p + bytes) once, for a copy: the registry (a pool block's state from its pool),
 * else the backend's pointer_kind. The tracked range comes back in base/size (size 0: not
 * tracked). On error the detail starts "<name> <p>" for the caller to prefix. */
pm_status_t pm__classify(const pm__backend_t *b, const void *p, size_t bytes, const char *name,
                         pm__mem_t *kind_out, uintptr_t *base_out, size_t *size_out);
/* pm_pointer_query without the argument check: the registry's entry (a pool block's state from
 * its pool), or PM_MEMORY_PAGEABLE for an address pinmem does not track. */
pm_status_t pm__pointer_info(const void *ptr, pm_pointer_info_t *info_out);
/* "a pinned block from pm_host_alloc", ...: for messages. */
const char *pm__memory_kind_desc(pm_memory_kind_t k);
/* If ptr is in a tracked range (then *known and *r say which; for pool memory, the block, which
 * must be in use), [ptr, ptr + bytes) must stay inside it. */
pm_status_t pm__check_span(const char *fn, const char *what, const void *ptr, size_t bytes,
                           pm__range_t *r, bool *known);
/* Validate one plain copy as pm_memcpy_async does; resolves PM_COPY_DEFAULT in *kind. */
pm_status_t pm__check_copy(const char *fn, const pm__backend_t *b, void *dst, const void *src,
                           size_t bytes, pm_copy_kind_t *kind);

/* ---- pool.c ------------------------------------------------------------------------------ */

/* Charge / uncharge bytes that are pinned outside the pool (registrations) to its budget.
 * Charging trims the cache first when needed and then follows the pool's exhaust policy. */
pm_status_t pm__pool_charge(pm_pool_t *pool, size_t bytes);
/* The same, with `what` naming the charge in a budget error ("block store arena"). */
pm_status_t pm__pool_charge_for(pm_pool_t *pool, size_t bytes, const char *what);
void pm__pool_uncharge(pm_pool_t *pool, size_t bytes);
/* For pm_pointer_query on a pool segment: the block holding ptr. */
pm_status_t pm__pool_block_info(pm_pool_t *pool, const void *ptr, pm_pointer_info_t *info);
/* Free a block; called by pm_host_free after the registry named the owning pool. */
pm_status_t pm__pool_free(pm_pool_t *pool, void *ptr);
pm_status_t pm__pool_record_stream(pm_pool_t *pool, void *ptr, pm_stream_t stream);
/* Free a block that queued device work may still read or write when nothing can order its reuse
 * (no record of the stream, and the stream could not be synchronized): the pool never hands it
 * out again and releases it only at destroy, after a device synchronize. */
pm_status_t pm__pool_quarantine(pm_pool_t *pool, void *ptr);
pm_status_t pm__pool_usable_size(pm_pool_t *pool, const void *ptr, size_t *bytes_out);
/* Size class: the capacity a request of `bytes` is rounded up to. At most 12.5% more for
 * requests >= 1 MiB; multiples of 256 bytes. */
size_t pm__size_class(size_t bytes);
/* Destroy the default pool (pm_finalize). */
pm_status_t pm__pool_default_destroy(void);

/* ---- pin.c ------------------------------------------------------------------------------- */

/* Fast cold pinning: mmap (2 MiB aligned, MADV_HUGEPAGE if huge_pages), first touch from
 * `threads` threads, then backend host_register. *ptr_out is page aligned. */
pm_status_t pm__fast_pin(const pm__backend_t *b, size_t bytes, unsigned register_flags, int threads,
                         bool huge_pages, void **ptr_out);
/* pm__fast_pin with the mapping bound to prefer `node` before the touch (node < 0: none);
 * *bound_out says whether binding took (a failure pins with the default policy). */
pm_status_t pm__fast_pin_node(const pm__backend_t *b, size_t bytes, unsigned register_flags,
                              int threads, bool huge_pages, int node, bool *bound_out,
                              void **ptr_out);
pm_status_t pm__fast_unpin(const pm__backend_t *b, void *ptr, size_t bytes);

/* ---- shared.c ---------------------------------------------------------------------------- */

/* The memory of a PM_HOST_SHARED pool segment: a memfd (or an unlinked file under /dev/shm)
 * sized to align_up(bytes, page), mapped MAP_SHARED, first-touched by `threads` threads and
 * registered with register_flags | PM_REGISTER_PORTABLE. *ptr_out is page aligned. */
pm_status_t pm__shared_pin(const pm__backend_t *b, size_t bytes, unsigned register_flags,
                           int threads, void **ptr_out);
/* pm__shared_pin with the mapping bound to prefer `node` before the touch, as pm__fast_pin_node. */
pm_status_t pm__shared_pin_node(const pm__backend_t *b, size_t bytes, unsigned register_flags,
                                int threads, int node, bool *bound_out, void **ptr_out);
/* Unregister, unmap and close the file of a segment from pm__shared_pin. */
pm_status_t pm__shared_unpin(const pm__backend_t *b, void *ptr, size_t bytes);
/* The fd of the shared segment that starts at base (pinmem keeps it). PM_ERR_INTERNAL if none. */
pm_status_t pm__shared_segment_fd(const void *base, int *fd_out);
/* PM_ERR_INVALID (with fn in the detail) for PM_HOST_* flags that cannot be shared. */
pm_status_t pm__shared_check_flags(const char *fn, unsigned flags);
/* Test hooks: non-zero makes memfd_create fail as if it were missing (ENOSYS); the folder of the
 * fallback file ("/dev/shm"). */
extern atomic_int pm__shared_memfd_refused;
extern _Atomic(const char *) pm__shared_dir;

/* ---- threadpool.c ------------------------------------------------------------------------ */

/* Run fn(ctx, i) for i in [0, n) on up to `threads` threads (the caller is one of them) and
 * return when all are done. Workers persist between calls; calls from several threads at once
 * are allowed (they share the workers). */
void pm__parallel_for(int threads, size_t n, void (*fn)(void *ctx, size_t i), void *ctx);
void pm__threadpool_shutdown(void); /* pm_finalize only */

/* ---- copy.c ------------------------------------------------------------------------------ */

/* Let the copy engine's idle completion threads go now (pm_finalize only). */
void pm__copy_shutdown(void);

/* ---- crc32.c ------------------------------------------------------------------------------ */

/* zlib's CRC-32, loaded at run time (ISA-L's where found: crc32.c). pm__crc32_ready: PM_OK once
 * zlib is loaded, else PM_ERR_UNSUPPORTED with why in pm_last_error(); pm__crc32 and
 * pm__crc32_combine only after it said PM_OK. */
pm_status_t pm__crc32_ready(void);
/* Use ISA-L's crc32_gzip_refl from path, a library the process has loaded already, unless ISA-L
 * is in use or PINMEM_ISAL says otherwise; whether ISA-L is in use afterwards. */
bool pm__crc32_use(const char *path);
/* "ISA-L (file)" or "zlib (file)": what computes the CRCs; NULL where pm__crc32_ready fails. */
const char *pm__crc32_impl(void);
uint32_t pm__crc32(uint32_t crc, const void *p, size_t n);
/* The CRC of A then B from crc1 = CRC(A), crc2 = CRC(B) and B's length. */
uint32_t pm__crc32_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);

/* ---- fault.c ------------------------------------------------------------------------------ */

/* Fault injection at the backend contract (tests, PINMEM_FAULT; see fault.c for the spec). */
/* X(op, name, status the real backend returns when the call fails, named only?). Named-only ops
 * (the release calls, and pool_record) are not part of "all". */
#define PM__FAULT_OP_MAP(X)                                                                     \
  X(PM__FAULT_HOST_ALLOC, "host_alloc", PM_ERR_NOMEM, false)                                    \
  X(PM__FAULT_HOST_FREE, "host_free", PM_ERR_BACKEND, true)                                     \
  X(PM__FAULT_HOST_REGISTER, "host_register", PM_ERR_NOMEM, false)                              \
  X(PM__FAULT_HOST_UNREGISTER, "host_unregister", PM_ERR_BACKEND, true)                         \
  X(PM__FAULT_HOST_DEVICE_POINTER, "host_device_pointer", PM_ERR_BACKEND, false)                \
  X(PM__FAULT_DEVICE_ALLOC, "device_alloc", PM_ERR_DEVICE_MEMORY, false)                        \
  X(PM__FAULT_DEVICE_FREE, "device_free", PM_ERR_BACKEND, true)                                 \
  X(PM__FAULT_MANAGED_ALLOC, "managed_alloc", PM_ERR_DEVICE_MEMORY, false)                      \
  X(PM__FAULT_MANAGED_FREE, "managed_free", PM_ERR_BACKEND, true)                               \
  X(PM__FAULT_MEMCPY, "memcpy", PM_ERR_BACKEND, false) /* memcpy_async and memcpy_sync */       \
  X(PM__FAULT_MEMSET, "memset", PM_ERR_BACKEND, false)                                          \
  X(PM__FAULT_PREFETCH, "prefetch", PM_ERR_BACKEND, false)                                      \
  X(PM__FAULT_STREAM_CREATE, "stream_create", PM_ERR_BACKEND, false)                            \
  X(PM__FAULT_STREAM_DESTROY, "stream_destroy", PM_ERR_BACKEND, true)                           \
  X(PM__FAULT_STREAM_SYNC, "stream_sync", PM_ERR_BACKEND, false) /* and device_synchronize */   \
  X(PM__FAULT_STREAM_QUERY, "stream_query", PM_ERR_BACKEND, false)                              \
  X(PM__FAULT_STREAM_WAIT_EVENT, "stream_wait_event", PM_ERR_BACKEND, false)                    \
  X(PM__FAULT_EVENT_CREATE, "event_create", PM_ERR_BACKEND, false)                              \
  X(PM__FAULT_EVENT_DESTROY, "event_destroy", PM_ERR_BACKEND, true)                             \
  X(PM__FAULT_EVENT_RECORD, "event_record", PM_ERR_BACKEND, false)                              \
  X(PM__FAULT_EVENT_QUERY, "event_query", PM_ERR_BACKEND, false)                                \
  X(PM__FAULT_EVENT_SYNC, "event_sync", PM_ERR_BACKEND, false)                                  \
  X(PM__FAULT_EVENT_ELAPSED, "event_elapsed", PM_ERR_BACKEND, false)                            \
  /* launch_busy, launch_batch_copy and launch_host_func */                                     \
  X(PM__FAULT_LAUNCH, "launch", PM_ERR_BACKEND, false)                                          \
  /* device_count, device_info, set_device, get_device */                                       \
  X(PM__FAULT_DEVICE_QUERY, "device_query", PM_ERR_BACKEND, false)                              \
  X(PM__FAULT_IO, "io", PM_ERR_IO, false) /* the loader's file reads (pm__fault_io) */          \
  /* pm_file_read_async's preads and pm_file_write_async's pwrites (pm__fault_file) */          \
  X(PM__FAULT_FILE_READ, "file_read", PM_ERR_IO, false)                                         \
  X(PM__FAULT_FILE_WRITE, "file_write", PM_ERR_IO, false)                                       \
  /* pm_file_write_async's reservation of a range past the end (fallocate; ENOSPC by default) */ \
  X(PM__FAULT_FILE_RESERVE, "file_reserve", PM_ERR_IO, false)                                   \
  /* the pool's stream record on a block (pm__pool_record_stream: no memory for it) */          \
  X(PM__FAULT_POOL_RECORD, "pool_record", PM_ERR_NOMEM, true)                                  \
  /* memcpy_async and memcpy_sync that succeed with wrong bytes (named only): verifiers' check */ \
  X(PM__FAULT_CORRUPT, "corrupt", PM_OK, true)

#define PM__FAULT_ENUM(op, ...) op,
typedef enum pm__fault_op {
  PM__FAULT_ALL = -1, /* every op except the release calls */
  PM__FAULT_OP_MAP(PM__FAULT_ENUM) PM__FAULT_COUNT
} pm__fault_op_t;
#undef PM__FAULT_ENUM

typedef struct pm__fault_counts {
  uint64_t calls[PM__FAULT_COUNT];    /* calls seen since the op was last armed or reset */
  uint64_t injected[PM__FAULT_COUNT]; /* of those, failed on purpose */
  uint64_t total_calls, total_injected;
} pm__fault_counts_t;

/* pm_init (api.c) passes the backend it started; *backend becomes the forwarding table that
 * injects faults. Reads PINMEM_FAULT at the first call: PM_ERR_CONFIG if it is malformed. */
pm_status_t pm__fault_wrap(const pm__backend_t **backend);
/* Arm op (or PM__FAULT_ALL): fail its nth call from now (0: none) and each call with
 * probability rate (0: none). Resets that op's counters. Counting starts with the first arming. */
pm_status_t pm__fault_set(pm__fault_op_t op, uint64_t nth, double rate);
/* Arm from a PINMEM_FAULT-style spec ("host_alloc=3,memcpy=rate:0.1,event_query=2+,seed=7").
 * PM_ERR_CONFIG (and nothing armed) if it does not parse. */
pm_status_t pm__fault_configure(const char *spec);
void pm__fault_seed(uint64_t seed);
/* Disarm everything and zero the counters; wrapped calls go straight through again. */
void pm__fault_reset(void);
void pm__fault_counts(pm__fault_counts_t *out);
const char *pm__fault_op_name(pm__fault_op_t op);
/* For file reads (loader): true when this read must fail; pm_last_error() then holds a detail
 * naming `what` and "injected fault", and the caller returns PM_ERR_IO. */
bool pm__fault_io(const char *what);
/* For pm_file_*_async's preads and pwrites (op PM__FAULT_FILE_READ or _WRITE), before each
 * system call of *len bytes: 0 to go ahead (a "short" fault lowers *len to a part of it, so the
 * call transfers less and the caller must continue), else the errno the call must fail with
 * (EIO unless pm__fault_file_errno chose another; EINTR must be retried). Op
 * PM__FAULT_FILE_RESERVE, before pm_file_write_async's fallocate: 0, or the errno it must end
 * with (ENOSPC by default) after reserving a part, as a filesystem that fills up midway does. */
int pm__fault_file(pm__fault_op_t op, size_t *len);
#define PM__FAULT_SHORT (-1) /* pm__fault_file_errno: a short transfer instead of an errno */
/* What an injected fault of the file op does: an errno (EIO, ENOSPC, EINTR...) or
 * PM__FAULT_SHORT (not for file_reserve). pm__fault_reset restores EIO (file_reserve: ENOSPC).
 * PM_ERR_INVALID for another op. In a PINMEM_FAULT spec: file_write=2:ENOSPC,
 * file_read=1:short, file_reserve=1:EDQUOT. */
pm_status_t pm__fault_file_errno(pm__fault_op_t op, int err);
/* For calls above the backend that take part in fault injection (pool_record): PM_OK, or the
 * op's status with a detail naming `what` and "injected fault". */
pm_status_t pm__fault_check(pm__fault_op_t op, const char *what);

/* ---- loader.c (with sampler.c, dataset.c, dataset_npy.c, dataset_tokens.c) ---------------- */

/* sampler.c: the order of one rank's samples in each epoch, computed per position (no arrays,
 * so a position can be found in O(1) for any epoch: workers and resume need no shared state). */
typedef struct pm__sampler {
  uint64_t n;     /* samples in the dataset */
  uint64_t batch; /* batch size */
  uint64_t seed;
  int rank, world;
  bool shuffle, drop_last;
  uint64_t per_rank; /* samples of one epoch on this rank (padding included) */
  uint64_t batches;  /* batches of one epoch on this rank */
} pm__sampler_t;

/* Samples and batches one rank gets per epoch of n samples, 0 included (world >= 1,
 * batch >= 1): the arithmetic of pm__sampler_init, which refuses the 0s. */
void pm__sampler_count(uint64_t n, uint64_t batch, bool drop_last, int world, uint64_t *per_rank,
                       uint64_t *batches);
/* PM_ERR_INVALID with the reason when the combination leaves this rank nothing to deliver. */
pm_status_t pm__sampler_init(pm__sampler_t *s, uint64_t n, uint64_t batch, bool shuffle,
                             uint64_t seed, bool drop_last, int rank, int world);
/* Rows of batch `b` of an epoch (b < batches). */
uint64_t pm__sampler_rows(const pm__sampler_t *s, uint64_t b);
/* Dataset index at position `pos` (< per_rank) of this rank's order in `epoch`. */
uint64_t pm__sampler_index(const pm__sampler_t *s, uint64_t epoch, uint64_t pos);
/* A bijection of [0, n) keyed by `key` (cycle-walking Feistel network); i < n. */
uint64_t pm__permute(uint64_t i, uint64_t n, uint64_t key);
uint64_t pm__mix64(uint64_t x); /* splitmix64 finaliser */

/* dataset.c: the dataset object, the callback dataset and file reading for the file kinds. */
typedef struct pm__scratch { /* one thread's aligned bounce buffer for O_DIRECT reads */
  void *buf;
  size_t cap;
} pm__scratch_t;
void pm__scratch_free(pm__scratch_t *s);

typedef struct pm__file {
  char *path;
  int fd;                   /* buffered reads (always open) */
  int dfd;                  /* O_DIRECT descriptor, or -1 */
  uint64_t size;            /* bytes at open */
  const unsigned char *map; /* PM_IO_MMAP: the whole file, or NULL */
  pm_io_mode_t io;          /* the mode in force */
} pm__file_t;

/* Open `path` for reads in mode `io`. Where O_DIRECT is refused the file falls back to
 * buffered pread and a sentence saying why is written to note (else note is left alone). */
pm_status_t pm__file_open(pm__file_t *f, const char *path, pm_io_mode_t io, char *note,
                          size_t note_len);
/* Exactly `len` bytes at `off` into dst, or PM_ERR_IO naming the file (short files too). */
pm_status_t pm__file_read(pm__file_t *f, uint64_t off, void *dst, size_t len,
                          pm__scratch_t *scratch);
void pm__file_close(pm__file_t *f);
/* Test hook: when non-zero, opening with O_DIRECT behaves as if the filesystem refused it. */
extern atomic_int pm__io_refuse_direct;
/* pm_file_*_async (src/io/file.c): why the last call on this thread used buffered I/O where
 * direct was asked for ("" if it did not); for tools and tests. */
const char *pm__file_note(void);
/* pm_file_write_async / pm_file_writev_async: whether the last call on this thread got as far
 * as writing (its checks, its reservation and its slots behind it), so that a failure may have
 * left part of its bytes in the file. write_file(truncate=True) empties such a file rather
 * than leave its old length with part of the new bytes in it (python/pinmem/files.c). */
bool pm__file_wrote(void);
/* An io=auto cold read of [off, off + n) marks [PM__FILE_READER_MARKS + off, ... + n) with an
 * OFD read lock while it runs, so that another reader of those bytes reads through the page
 * cache (file.c, reader_mark()). */
#define PM__FILE_READER_MARKS ((uint64_t)1 << 62)
/* Test hook: io=auto's smallest range (FILE_AUTO_MIN, 64 MiB, while 0), so tests of the
 * residency rule need not move 64 MiB. */
extern atomic_size_t pm__file_auto_min;
/* The unit of pm_file_* calls that leave options->chunk 0: for writes file_write_chunk; for
 * reads through O_DIRECT file_direct_chunk; for other reads file_chunk; file_chunk also where
 * the option named is 0 (tools/bench_file.c reports it). */
size_t pm__file_chunk(bool write, bool direct);
/* The bounce slots of a ring of `chunk`-byte units run by `threads` threads: the option
 * file_slots where set, else threads + 2, and for reads through the page cache (neither write
 * nor direct) more where they fit: up to 2 a thread, holding at most 96 MiB (file.c says
 * why). */
int pm__file_slots(size_t chunk, int threads, bool write, bool direct);

struct pm_dataset_s {
  pm_dataset_info_t info;
  /* Write sample `index` of `epoch` to dst (and its targets to tdst, token datasets) or return
   * a status with its detail set. Called from many threads at once. */
  pm_status_t (*read)(pm_dataset_t *ds, uint64_t epoch, uint64_t index, void *dst, void *tdst,
                      pm__scratch_t *scratch);
  void (*destroy_impl)(pm_dataset_t *ds); /* the kind's own parts (NULL: none) */
  /* Multi-field kinds (dataset_fields.c): every field of sample `index` to dsts[k] (a NULL
   * entry: skip that field), and the field table. NULL / 0 for the kinds whose fields follow
   * from info (one field, or inputs and targets): see pm__dataset_field. */
  pm_status_t (*read_fields)(pm_dataset_t *ds, uint64_t epoch, uint64_t index, void *const *dsts,
                             pm__scratch_t *scratch);
  pm_field_t *fields_tab;
  void *impl;
  pm__file_t *files;
  int nfiles;
  atomic_int users; /* loaders using the dataset: destroy refuses while > 0 */
  /* Rows kinds (dataset_rows.c): every field of n samples in one call, row r of field k at
   * dsts[k] + r * its bytes; `worker` is the loader worker calling, -1 outside a loader. NULL
   * for the kinds read one sample at a time. */
  pm_status_t (*read_rows)(pm_dataset_t *ds, uint64_t epoch, uint64_t n, const uint64_t *indices,
                           void *const *dsts, int worker);
};

/* A zeroed dataset with its files array for nfiles files (fds -1), or PM_ERR_NOMEM. */
pm_status_t pm__dataset_alloc(int nfiles, pm_dataset_t **ds_out);
void pm__dataset_free(pm_dataset_t *ds); /* closes the files, runs destroy_impl */
/* The status of a read callback's return code rc for sample `index` (detail set when not 0):
 * a pinmem status passes through, any other failure is PM_ERR_IO. */
pm_status_t pm__dataset_cb_status(int rc, uint64_t index);

size_t pm__dtype_itemsize(pm_dtype_t dtype); /* 0: not a dtype code; OTHER: 1 */
const char *pm__dtype_descr(pm_dtype_t dtype); /* "<f4"...; OTHER: "|V1" */

/* dataset_fields.c: fields of any dataset, multi-field callbacks and zips. */
int pm__dataset_nfields(const pm_dataset_t *ds);
void pm__dataset_field(const pm_dataset_t *ds, int k, pm_field_t *out); /* k < nfields */
/* Every field of one sample: dsts[k] for field k (NULL entries skipped; the single-field and
 * token kinds need dsts[0]). */
pm_status_t pm__dataset_read_fields(pm_dataset_t *ds, uint64_t epoch, uint64_t index,
                                    void *const *dsts, pm__scratch_t *scratch);

/* For dataset_rows.c: the checks and allocations of a callback dataset of several fields
 * (dataset_fields.c; the caller fills ds->impl, impl_bytes, and the read calls). */
pm_status_t pm__dataset_callback_new(const char *fn, const void *callbacks, bool have_read,
                                     const char *read_name, uint64_t samples, int nfields,
                                     const pm_field_t *fields, size_t impl_bytes,
                                     pm_dataset_t *const *dataset_out, pm_dataset_t **ds_out);

/* dataset_rows.c: rows datasets (pm_dataset_create_rows) and selects (pm_dataset_select).
 * Whether a dataset reads a run of rows in one call (a rows dataset, or a select over one). */
bool pm__dataset_reads_rows(const pm_dataset_t *ds);
/* n rows in one call: indices[r] to dsts[k] + r * field k's bytes (ds reads rows). */
pm_status_t pm__dataset_read_rows(pm_dataset_t *ds, uint64_t epoch, uint64_t n,
                                  const uint64_t *indices, void *const *dsts, int worker);
/* The loader worker index of this thread (set once by each worker at its start; -1 in every
 * other thread): what a rows dataset read one sample at a time (inside a zip) passes on. */
void pm__dataset_worker_set(int worker);
/* The loader batch and first row this thread reads now (set by a loader worker before each
 * read; UINT64_MAX elsewhere): what a rows dataset passes on as pm_rows_request_t.batch/row. */
void pm__dataset_claim_set(uint64_t batch, uint64_t row);
/* The (batch, row) of the sample the calling loader thread reads now (pm__dataset_claim_set);
 * UINT64_MAX for both outside a loader's read. */
void pm__dataset_claim_get(uint64_t *batch, uint64_t *row);

/* dataset_npy.c: the .npy header. */
typedef struct pm__npy_header {
  int major, minor;
  size_t data_offset; /* where the array's bytes start */
  bool fortran_order;
  int ndim; /* of the whole array */
  uint64_t shape[PM_DATASET_MAX_DIMS + 1];
  char descr[128]; /* normalised (explicit byte order); structured: compact text */
  size_t itemsize;
  pm_dtype_t dtype;
  uint64_t count;      /* shape[0] */
  size_t sample_bytes; /* itemsize * prod(shape[1:]) */
  uint64_t data_bytes; /* count * sample_bytes */
} pm__npy_header_t;

#define PM__NPY_PREAMBLE 12 /* magic, version and header length fit in this */
#define PM__NPY_HEADER_MAX (1u << 20)

/* From the first `len` bytes of a file: the total header size (the data offset). PM_ERR_FORMAT
 * for a bad magic, an unknown version or a header above PM__NPY_HEADER_MAX. */
pm_status_t pm__npy_preamble(const unsigned char *buf, size_t len, size_t *total_out);
/* Parse a whole header (buf holds at least the total from pm__npy_preamble). Every check that
 * needs no file size: PM_ERR_FORMAT with the reason. */
pm_status_t pm__npy_parse(const unsigned char *buf, size_t len, pm__npy_header_t *out);
/* A dtype text ("<f4", "u1", "|u1", "float32" is not one) in the normalised form of descr. */
pm_status_t pm__npy_normalize_descr(const char *text, char *out, size_t out_len);

#endif /* PINMEM_INTERNAL_H */
