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

/* ---- config.c ---------------------------------------------------------------------------- */

typedef enum pm__opt {
  PM__OPT_BACKEND,        /* auto|cuda|host */
  PM__OPT_DEVICE,         /* int, default device */
  PM__OPT_BUDGET,         /* size or "auto" -> pm__opt_size returns 0 for auto */
  PM__OPT_BUDGET_POLICY,  /* fail|wait -> pm__opt_int returns pm_exhaust_policy_t */
  PM__OPT_BUDGET_TIMEOUT, /* seconds (double) */
  PM__OPT_PIN_THREADS,    /* int, 0 = auto (min(16, cores)) -> pm__opt_int returns resolved */
  PM__OPT_FAST_PIN_MIN,   /* size */
  PM__OPT_HUGE_PAGES,     /* 0|1 */
  PM__OPT_HOST_DEVICE_MEMORY, /* size: device memory the host backend simulates */
  PM__OPT_COPY_CHUNK,     /* size: staging chunk (copy.c) */
  PM__OPT_COPY_SLOTS,     /* int: bounce-buffer ring depth (copy.c) */
  PM__OPT_COPY_THREADS,   /* int: staging memcpy threads, 0 = auto (copy.c) */
  PM__OPT_COPY_STAGE_MIN, /* size: pageable copies below this use the plain backend copy */
  PM__OPT_COUNT
} pm__opt_t;

size_t pm__opt_size(pm__opt_t opt);
long pm__opt_int(pm__opt_t opt);
double pm__opt_double(pm__opt_t opt);
/* Current value as text (for enum-like options such as backend). Thread-safe copy into buf. */
void pm__opt_text(pm__opt_t opt, char *buf, size_t len);

/* ---- sysinfo.c --------------------------------------------------------------------------- */

double pm__now(void);              /* monotonic seconds */
size_t pm__page_size(void);
size_t pm__physical_memory(void);  /* bytes of RAM */
int pm__cpu_count(void);           /* online CPUs */
/* RLIMIT_MEMLOCK soft limit in bytes; SIZE_MAX when unlimited or when the process has
 * CAP_IPC_LOCK (root), which makes the limit irrelevant to mlock. */
size_t pm__memlock_limit(void);
size_t pm__memlock_rlimit_raw(void); /* the soft limit itself, SIZE_MAX if RLIM_INFINITY */
bool pm__has_cap_ipc_lock(void);
/* Round up to a multiple of `align` (a power of two). */
static inline size_t pm__align_up(size_t v, size_t align) { return (v + align - 1) & ~(align - 1); }

/* ---- api.c ------------------------------------------------------------------------------- */

/* The active backend, initialising on first use. NULL (and pm__set_error) if none could start. */
const pm__backend_t *pm__backend(void);
/* Shorthand used at the top of public calls: */
#define PM__BACKEND_OR_RETURN(b)                                                                \
  const pm__backend_t *b = pm__backend();                                                       \
  if (!b) return pm__wrap_error(PM_ERR_NO_DEVICE, "no backend")

/* ---- registry.c -------------------------------------------------------------------------- */

/* One tracked range of memory. */
typedef struct pm__range {
  uintptr_t base;
  size_t size;
  pm_memory_kind_t kind;
  unsigned flags;
  void *owner;     /* pm_pool_t* for pool segments, NULL otherwise */
  void *dev_base;  /* device address of base when mapped, else NULL */
} pm__range_t;

/* Add a range; PM_ERR_OVERLAP (with both ranges in the detail) if any byte is tracked. */
pm_status_t pm__registry_add(const pm__range_t *range);
/* Remove the range that starts exactly at base and has this kind. PM_ERR_NOT_FOUND otherwise
 * (PM_ERR_WRONG_KIND if a range of another kind starts there). *removed_out may be NULL. */
pm_status_t pm__registry_remove(uintptr_t base, pm_memory_kind_t kind, pm__range_t *removed_out);
/* Range containing ptr: true and *out filled, or false. */
bool pm__registry_find(const void *ptr, pm__range_t *out);
size_t pm__registry_count(void);
void pm__registry_clear(void); /* pm_finalize only */

/* ---- pool.c ------------------------------------------------------------------------------ */

/* Charge / uncharge bytes that are pinned outside the pool (registrations) to its budget.
 * Charging trims the cache first when needed and then follows the pool's exhaust policy. */
pm_status_t pm__pool_charge(pm_pool_t *pool, size_t bytes);
void pm__pool_uncharge(pm_pool_t *pool, size_t bytes);
/* For pm_pointer_query on a pool segment: the block holding ptr. */
pm_status_t pm__pool_block_info(pm_pool_t *pool, const void *ptr, pm_pointer_info_t *info);
/* Free a block; called by pm_host_free after the registry named the owning pool. */
pm_status_t pm__pool_free(pm_pool_t *pool, void *ptr);
pm_status_t pm__pool_record_stream(pm_pool_t *pool, void *ptr, pm_stream_t stream);
pm_status_t pm__pool_usable_size(pm_pool_t *pool, const void *ptr, size_t *bytes_out);
/* Size class: the capacity a request of `bytes` is rounded up to. At most 12.5% more for
 * requests >= 1 MiB; multiples of 256 bytes. */
size_t pm__size_class(size_t bytes);
/* Destroy the default pool (pm_finalize). */
pm_status_t pm__pool_default_destroy(void);

/* ---- pin.c ------------------------------------------------------------------------------- */

/* Fast cold pinning: mmap (2 MiB aligned, MADV_HUGEPAGE if huge_pages), first touch from
 * `threads` threads, then backend host_register. *ptr_out is page aligned. */
pm_status_t pm__fast_pin(const pm__backend_t *b, size_t bytes, unsigned register_flags,
                         int threads, bool huge_pages, void **ptr_out);
pm_status_t pm__fast_unpin(const pm__backend_t *b, void *ptr, size_t bytes);

/* ---- threadpool.c ------------------------------------------------------------------------ */

/* Run fn(ctx, i) for i in [0, n) on up to `threads` threads (the caller is one of them) and
 * return when all are done. Workers persist between calls; calls from several threads at once
 * are allowed (they share the workers). */
void pm__parallel_for(int threads, size_t n, void (*fn)(void *ctx, size_t i), void *ctx);
void pm__threadpool_shutdown(void); /* pm_finalize only */

#endif /* PINMEM_INTERNAL_H */
