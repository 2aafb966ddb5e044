/*
 * DESIGN: fault injection at the backend contract. pm_init wraps the backend it chose in the
 * table below, which forwards every call to the real backend unless a fault is armed for that
 * operation; then the call fails, without doing anything, with the status the real backend
 * would give (PM_ERR_NOMEM for a pinned allocation, PM_ERR_DEVICE_MEMORY for device memory,
 * PM_ERR_BACKEND for a copy or an event...) and a detail that says "injected fault". So every
 * error path above the contract (pool, registry, copy engine, loader) can be driven from a test
 * or from the environment, on either backend, without touching their code.
 *
 * Arming: PINMEM_FAULT (read once, at the first pm_init) or pm__fault_set / pm__fault_configure
 * from tests. A spec is a comma list of op=VALUE and seed=S:
 *   op=N        fail the Nth call of op (counted from when it was armed), once
 *   op=N+       fail the Nth call and every later one (a device that is gone)
 *   op=rate:R   fail each call with probability R (0..1), decided by a hash of (seed, op, call
 *               number), so a single-threaded run is reproducible from its seed
 *   op=0        disarm op
 * op is one of the names in fault_ops[] or "all" (every op except the named-only ones: the
 * release calls and pool_record).
 * Release calls (host_free, host_unregister, device_free, managed_free, stream_destroy,
 * event_destroy) are only faulted when named: their fault leaves the object as it was (nothing
 * released), as a failing driver call does, so a caller that cannot retry leaks it by design.
 * File reads of the loader go through pm__fault_io(), op "io". pm_file_*_async's preads and
 * pwrites go through pm__fault_file(), ops "file_read" and "file_write", whose fault is an errno
 * (EIO by default; file_write=2:ENOSPC) or a short transfer (file_read=1:short); its
 * reservation of a range past the end, op "file_reserve", fails with ENOSPC by default. The pool's stream record on a
 * block goes through pm__fault_check, op "pool_record" (PM_ERR_NOMEM, as when no memory is left
 * for the record); it is named only, because with a failing stream_sync too the block is
 * quarantined and stays pinned until its pool is destroyed, by design. Op "corrupt" (named only)
 * is the one fault that is not an error: a memcpy_async or memcpy_sync it hits returns success
 * having copied the source shifted by one byte (src + 1 to dst, the last byte of dst left as it
 * was), so a benchmark's or a test's verifier can be shown to catch wrong data.
 *
 * Data: one record per op with relaxed atomic counters (calls, injected) and settings (nth,
 * sticky, threshold = rate * 2^64). g_active is false until something arms or counts; while it
 * is false a wrapped call costs one relaxed load and an indirect call. Counters run while
 * active, so "fail the Nth call" counts only calls made after arming.
 *
 * Threads: no locks; every field is an atomic. Arming while other threads make calls is allowed
 * (a call sees the old or the new setting). The forwarding tables are filled once per backend
 * kind, inside pm_init (under its init lock), before the table is published.
 */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "internal.h"

typedef struct fault_op_def {
  const char *name;
  pm_status_t status; /* what the real backend returns when this call fails */
  bool release;       /* not part of "all" */
} fault_op_def_t;

#define FAULT_OP_ROW(op, name, status, release) [op] = {name, status, release},
static const fault_op_def_t fault_ops[PM__FAULT_COUNT] = {PM__FAULT_OP_MAP(FAULT_OP_ROW)};
#undef FAULT_OP_ROW

typedef struct fault_state {
  _Atomic uint64_t calls, injected;
  _Atomic uint64_t nth;       /* 0: no Nth-call fault */
  _Atomic bool sticky;        /* fail every call from the Nth on */
  _Atomic uint64_t threshold; /* fail when hash < threshold; 0: no random faults */
} fault_state_t;

static fault_state_t g_state[PM__FAULT_COUNT];
static _Atomic bool g_active;
static _Atomic uint64_t g_seed = 0x5eed;
static const pm__backend_t *_Atomic g_real;
static bool g_env_loaded; /* only touched inside pm_init's lock */

/* ---- deciding ------------------------------------------------------------------------------ */

/* Count the call; true (and the call number in *call) when it must fail. */
static bool should_fail(pm__fault_op_t op, uint64_t *call) {
  if (!atomic_load_explicit(&g_active, memory_order_relaxed)) return false;
  fault_state_t *s = &g_state[op];
  uint64_t k = atomic_fetch_add_explicit(&s->calls, 1, memory_order_relaxed) + 1;
  uint64_t nth = atomic_load_explicit(&s->nth, memory_order_relaxed);
  bool hit =
      nth && (k == nth || (k > nth && atomic_load_explicit(&s->sticky, memory_order_relaxed)));
  if (!hit) {
    uint64_t th = atomic_load_explicit(&s->threshold, memory_order_relaxed);
    if (th) {
      uint64_t seed = atomic_load_explicit(&g_seed, memory_order_relaxed);
      hit = pm__mix64(seed ^ pm__mix64(((uint64_t)op << 56) ^ k)) < th;
    }
  }
  if (hit) atomic_fetch_add_explicit(&s->injected, 1, memory_order_relaxed);
  *call = k;
  return hit;
}

static pm_status_t injected(pm__fault_op_t op, uint64_t call, const char *what) {
  pm_status_t st = fault_ops[op].status;
  const pm__backend_t *real = atomic_load_explicit(&g_real, memory_order_acquire);
  /* The host backend's pinning is mlock, whose failure it reports as the memlock limit. */
  if (op == PM__FAULT_HOST_REGISTER && real && real->kind == PM_BACKEND_HOST) st = PM_ERR_MEMLOCK;
  return pm__set_error(st, "%s: injected fault (%s call %llu; PINMEM_FAULT or pm__fault_set)", what,
                       fault_ops[op].name, (unsigned long long)call);
}

/* What a file op's fault does (pm__fault_file_errno): an errno, or PM__FAULT_SHORT. A full
 * disk is what a reservation meets. */
#define FILE_ERRNO_DEFAULTS {EIO, EIO, ENOSPC}
static const int g_file_errno_default[3] = FILE_ERRNO_DEFAULTS;
static atomic_int g_file_errno[3] = FILE_ERRNO_DEFAULTS;

static int file_slot(pm__fault_op_t op) {
  return op == PM__FAULT_FILE_READ      ? 0
         : op == PM__FAULT_FILE_WRITE   ? 1
         : op == PM__FAULT_FILE_RESERVE ? 2
                                        : -1;
}

/* A fault the file op can have: an errno, or a short transfer (a reservation has none). */
static bool file_fault_ok(pm__fault_op_t op, int err) {
  return file_slot(op) >= 0 &&
         (err > 0 || (err == PM__FAULT_SHORT && op != PM__FAULT_FILE_RESERVE));
}

pm_status_t pm__fault_file_errno(pm__fault_op_t op, int err) {
  int k = file_slot(op);
  if (!file_fault_ok(op, err))
    return pm__set_error(PM_ERR_INVALID, "pm__fault_file_errno: op %d / errno %d", (int)op, err);
  atomic_store_explicit(&g_file_errno[k], err, memory_order_relaxed);
  return PM_OK;
}

int pm__fault_file(pm__fault_op_t op, size_t *len) {
  uint64_t call;
  int k = file_slot(op);
  if (k < 0 || !should_fail(op, &call)) return 0;
  int err = atomic_load_explicit(&g_file_errno[k], memory_order_relaxed);
  if (err == PM__FAULT_SHORT) {
    /* A short transfer: a part of what was asked, never nothing (0 means end of file). */
    if (*len > 1) *len /= 2;
    return 0;
  }
  (void)injected(op, call, fault_ops[op].name);
  return err;
}

bool pm__fault_io(const char *what) {
  uint64_t call;
  if (!should_fail(PM__FAULT_IO, &call)) return false;
  (void)injected(PM__FAULT_IO, call, what ? what : "read");
  return true;
}

pm_status_t pm__fault_check(pm__fault_op_t op, const char *what) {
  uint64_t call;
  if ((unsigned)op >= PM__FAULT_COUNT || !should_fail(op, &call)) return PM_OK;
  return injected(op, call, what);
}

/* ---- the forwarding table ------------------------------------------------------------------ */

static inline const pm__backend_t *real_backend(void) {
  return atomic_load_explicit(&g_real, memory_order_acquire);
}

#define FAULT_CHECK(op, what)                                      \
  do {                                                             \
    uint64_t call_;                                                \
    if (should_fail(op, &call_)) return injected(op, call_, what); \
  } while (0)

static pm_status_t f_init(void) {
  return real_backend()->init();
}
static void f_shutdown(void) {
  real_backend()->shutdown();
}

static pm_status_t f_device_count(int *count_out) {
  FAULT_CHECK(PM__FAULT_DEVICE_QUERY, "device_count");
  return real_backend()->device_count(count_out);
}
static pm_status_t f_device_info(int device, pm_device_info_t *info_out) {
  FAULT_CHECK(PM__FAULT_DEVICE_QUERY, "device_info");
  return real_backend()->device_info(device, info_out);
}
static pm_status_t f_set_device(int device) {
  FAULT_CHECK(PM__FAULT_DEVICE_QUERY, "set_device");
  return real_backend()->set_device(device);
}
static pm_status_t f_get_device(int *device_out) {
  FAULT_CHECK(PM__FAULT_DEVICE_QUERY, "get_device");
  return real_backend()->get_device(device_out);
}
static pm_status_t f_bound_device(int *device_out) {
  FAULT_CHECK(PM__FAULT_DEVICE_QUERY, "bound_device");
  return real_backend()->bound_device(device_out);
}
/* Not injected: giving a thread back the no-device state it had is bookkeeping. */
static pm_status_t f_unbind_device(void) {
  return real_backend()->unbind_device();
}
static pm_status_t f_device_synchronize(void) {
  FAULT_CHECK(PM__FAULT_STREAM_SYNC, "device_synchronize");
  return real_backend()->device_synchronize();
}

static pm_status_t f_host_alloc(size_t bytes, unsigned flags, void **ptr_out) {
  FAULT_CHECK(PM__FAULT_HOST_ALLOC, "host_alloc");
  return real_backend()->host_alloc(bytes, flags, ptr_out);
}
static pm_status_t f_host_free(void *ptr, size_t bytes) {
  FAULT_CHECK(PM__FAULT_HOST_FREE, "host_free");
  return real_backend()->host_free(ptr, bytes);
}
static pm_status_t f_host_register(void *ptr, size_t bytes, unsigned flags) {
  FAULT_CHECK(PM__FAULT_HOST_REGISTER, "host_register");
  return real_backend()->host_register(ptr, bytes, flags);
}
static pm_status_t f_host_unregister(void *ptr, size_t bytes) {
  FAULT_CHECK(PM__FAULT_HOST_UNREGISTER, "host_unregister");
  return real_backend()->host_unregister(ptr, bytes);
}
static pm_status_t f_host_device_pointer(void *host_ptr, void **dptr_out) {
  FAULT_CHECK(PM__FAULT_HOST_DEVICE_POINTER, "host_device_pointer");
  return real_backend()->host_device_pointer(host_ptr, dptr_out);
}

static pm_status_t f_device_alloc(size_t bytes, void **dptr_out) {
  FAULT_CHECK(PM__FAULT_DEVICE_ALLOC, "device_alloc");
  return real_backend()->device_alloc(bytes, dptr_out);
}
static pm_status_t f_device_free(void *dptr) {
  FAULT_CHECK(PM__FAULT_DEVICE_FREE, "device_free");
  return real_backend()->device_free(dptr);
}
static pm_status_t f_device_memset_async(void *dptr, int value, size_t bytes, pm_stream_t stream) {
  FAULT_CHECK(PM__FAULT_MEMSET, "device_memset_async");
  return real_backend()->device_memset_async(dptr, value, bytes, stream);
}

static pm_status_t f_managed_alloc(size_t bytes, void **ptr_out) {
  FAULT_CHECK(PM__FAULT_MANAGED_ALLOC, "managed_alloc");
  return real_backend()->managed_alloc(bytes, ptr_out);
}
static pm_status_t f_managed_free(void *ptr) {
  FAULT_CHECK(PM__FAULT_MANAGED_FREE, "managed_free");
  return real_backend()->managed_free(ptr);
}
static pm_status_t f_managed_prefetch(const void *ptr, size_t bytes, int device,
                                      pm_stream_t stream) {
  FAULT_CHECK(PM__FAULT_PREFETCH, "managed_prefetch");
  return real_backend()->managed_prefetch(ptr, bytes, device, stream);
}

static pm_status_t f_stream_create(pm_stream_t *stream_out) {
  FAULT_CHECK(PM__FAULT_STREAM_CREATE, "stream_create");
  return real_backend()->stream_create(stream_out);
}
static pm_status_t f_stream_destroy(pm_stream_t stream) {
  FAULT_CHECK(PM__FAULT_STREAM_DESTROY, "stream_destroy");
  return real_backend()->stream_destroy(stream);
}
static pm_status_t f_stream_synchronize(pm_stream_t stream) {
  FAULT_CHECK(PM__FAULT_STREAM_SYNC, "stream_synchronize");
  return real_backend()->stream_synchronize(stream);
}
static pm_status_t f_stream_query(pm_stream_t stream) {
  FAULT_CHECK(PM__FAULT_STREAM_QUERY, "stream_query");
  return real_backend()->stream_query(stream);
}
static pm_status_t f_stream_wait_event(pm_stream_t stream, pm_event_t event) {
  FAULT_CHECK(PM__FAULT_STREAM_WAIT_EVENT, "stream_wait_event");
  return real_backend()->stream_wait_event(stream, event);
}

static pm_status_t f_event_create(unsigned flags, pm_event_t *event_out) {
  FAULT_CHECK(PM__FAULT_EVENT_CREATE, "event_create");
  return real_backend()->event_create(flags, event_out);
}
static pm_status_t f_event_destroy(pm_event_t event) {
  FAULT_CHECK(PM__FAULT_EVENT_DESTROY, "event_destroy");
  return real_backend()->event_destroy(event);
}
static pm_status_t f_event_record(pm_event_t event, pm_stream_t stream) {
  FAULT_CHECK(PM__FAULT_EVENT_RECORD, "event_record");
  return real_backend()->event_record(event, stream);
}
static pm_status_t f_event_query(pm_event_t event) {
  FAULT_CHECK(PM__FAULT_EVENT_QUERY, "event_query");
  return real_backend()->event_query(event);
}
static pm_status_t f_event_synchronize(pm_event_t event) {
  FAULT_CHECK(PM__FAULT_EVENT_SYNC, "event_synchronize");
  return real_backend()->event_synchronize(event);
}
static pm_status_t f_event_elapsed(pm_event_t start, pm_event_t end, double *seconds_out) {
  FAULT_CHECK(PM__FAULT_EVENT_ELAPSED, "event_elapsed");
  return real_backend()->event_elapsed(start, end, seconds_out);
}

/* Op "corrupt": whether this copy moves the wrong bytes; then *src and *bytes are the shifted
 * copy's (nothing at all for a 1-byte copy, which leaves dst as it was). */
static bool corrupt(const void **src, size_t *bytes) {
  uint64_t call;
  if (!should_fail(PM__FAULT_CORRUPT, &call) || *bytes == 0) return false;
  *src = (const char *)*src + 1;
  *bytes -= 1;
  return true;
}

static pm_status_t f_memcpy_async(void *dst, const void *src, size_t bytes, pm_copy_kind_t kind,
                                  pm_stream_t stream) {
  FAULT_CHECK(PM__FAULT_MEMCPY, "memcpy_async");
  if (corrupt(&src, &bytes) && bytes == 0) return PM_OK;
  return real_backend()->memcpy_async(dst, src, bytes, kind, stream);
}
static pm_status_t f_memcpy_sync(void *dst, const void *src, size_t bytes, pm_copy_kind_t kind) {
  FAULT_CHECK(PM__FAULT_MEMCPY, "memcpy_sync");
  if (corrupt(&src, &bytes) && bytes == 0) return PM_OK;
  return real_backend()->memcpy_sync(dst, src, bytes, kind);
}

static pm_status_t f_launch_busy(pm_stream_t stream, double seconds) {
  FAULT_CHECK(PM__FAULT_LAUNCH, "launch_busy");
  return real_backend()->launch_busy(stream, seconds);
}
static pm_status_t f_launch_host_func(pm_stream_t stream, void (*fn)(void *), void *arg) {
  FAULT_CHECK(PM__FAULT_LAUNCH, "launch_host_func");
  return real_backend()->launch_host_func(stream, fn, arg);
}

static pm_status_t f_memcpy_batch_async(void *const *dsts, const void *const *srcs,
                                        const size_t *sizes, size_t count, pm_stream_t stream) {
  FAULT_CHECK(PM__FAULT_MEMCPY, "memcpy_batch_async");
  return real_backend()->memcpy_batch_async(dsts, srcs, sizes, count, stream);
}

static pm_status_t f_launch_batch_copy(const pm__copy_desc_t *desc, size_t count,
                                       pm_stream_t stream) {
  FAULT_CHECK(PM__FAULT_LAUNCH, "launch_batch_copy");
  return real_backend()->launch_batch_copy(desc, count, stream);
}

/* Not fallible: a plain question about an address. */
static int f_pointer_kind(const void *ptr) {
  return real_backend()->pointer_kind(ptr);
}
static int f_pointer_device(const void *ptr) {
  return real_backend()->pointer_device(ptr);
}
static int f_stream_device(pm_stream_t stream) {
  return real_backend()->stream_device(stream);
}
/* Nor this one, about the device. */
static int f_kernel_host_access(void) {
  return real_backend()->kernel_host_access();
}

/* One table per backend kind, filled once: name and kind are the real backend's, so nothing
 * above the contract can tell the wrapper from the backend. */
static pm__backend_t g_tables[3];

#define FWD(field) t->field = real->field ? f_##field : NULL

pm_status_t pm__fault_wrap(const pm__backend_t **backend) {
  if (!backend || !*backend) return pm__set_error(PM_ERR_INTERNAL, "pm__fault_wrap: no backend");
  const pm__backend_t *real = *backend;
  if (!g_env_loaded) {
    const char *spec = getenv("PINMEM_FAULT");
    if (spec && *spec) {
      pm_status_t st = pm__fault_configure(spec);
      if (st != PM_OK) return pm__wrap_error(st, "PINMEM_FAULT");
    }
    g_env_loaded = true;
  }
  if ((unsigned)real->kind >= 3) return pm__set_error(PM_ERR_INTERNAL, "pm__fault_wrap: bad kind");
  pm__backend_t *t = &g_tables[real->kind];
  if (!t->name) {
    t->kind = real->kind;
    FWD(init);
    FWD(shutdown);
    FWD(device_count);
    FWD(device_info);
    FWD(set_device);
    FWD(get_device);
    FWD(bound_device);
    FWD(unbind_device);
    FWD(device_synchronize);
    FWD(host_alloc);
    FWD(host_free);
    FWD(host_register);
    FWD(host_unregister);
    FWD(host_device_pointer);
    FWD(device_alloc);
    FWD(device_free);
    FWD(device_memset_async);
    FWD(managed_alloc);
    FWD(managed_free);
    FWD(managed_prefetch);
    FWD(stream_create);
    FWD(stream_destroy);
    FWD(stream_synchronize);
    FWD(stream_query);
    FWD(stream_wait_event);
    FWD(event_create);
    FWD(event_destroy);
    FWD(event_record);
    FWD(event_query);
    FWD(event_synchronize);
    FWD(event_elapsed);
    FWD(memcpy_async);
    FWD(memcpy_sync);
    FWD(launch_busy);
    FWD(launch_host_func);
    FWD(pointer_kind);
    FWD(pointer_device);
    FWD(stream_device);
    FWD(memcpy_batch_async);
    FWD(launch_batch_copy);
    FWD(kernel_host_access);
    t->name = real->name; /* last: it marks the table as filled */
  }
  atomic_store_explicit(&g_real, real, memory_order_release);
  *backend = t;
  return PM_OK;
}

/* ---- arming -------------------------------------------------------------------------------- */

const char *pm__fault_op_name(pm__fault_op_t op) {
  if (op == PM__FAULT_ALL) return "all";
  if ((unsigned)op >= PM__FAULT_COUNT) return "?";
  return fault_ops[op].name;
}

static void set_one(int op, uint64_t nth, bool sticky, uint64_t threshold) {
  fault_state_t *s = &g_state[op];
  /* Disarm first, so a concurrent call never sees the new nth with the old count. */
  atomic_store_explicit(&s->nth, 0, memory_order_relaxed);
  atomic_store_explicit(&s->threshold, 0, memory_order_relaxed);
  atomic_store_explicit(&s->calls, 0, memory_order_relaxed);
  atomic_store_explicit(&s->injected, 0, memory_order_relaxed);
  atomic_store_explicit(&s->sticky, sticky, memory_order_relaxed);
  atomic_store_explicit(&s->threshold, threshold, memory_order_relaxed);
  atomic_store_explicit(&s->nth, nth, memory_order_relaxed);
}

static uint64_t rate_threshold(double rate) {
  if (rate <= 0) return 0;
  if (rate >= 1) return UINT64_MAX;
  return (uint64_t)(rate * 18446744073709551616.0); /* rate * 2^64, < 2^64 */
}

static pm_status_t arm(pm__fault_op_t op, uint64_t nth, bool sticky, double rate) {
  if (op != PM__FAULT_ALL && (unsigned)op >= PM__FAULT_COUNT)
    return pm__set_error(PM_ERR_INVALID, "pm__fault_set: unknown op %d", (int)op);
  if (!(rate >= 0 && rate <= 1))
    return pm__set_error(PM_ERR_INVALID, "pm__fault_set(%s): rate %g is not in 0..1",
                         pm__fault_op_name(op), rate);
  uint64_t th = rate_threshold(rate);
  for (int i = 0; i < PM__FAULT_COUNT; i++) {
    if (op == PM__FAULT_ALL ? !fault_ops[i].release : i == (int)op) set_one(i, nth, sticky, th);
  }
  atomic_store_explicit(&g_active, true, memory_order_relaxed);
  return PM_OK;
}

pm_status_t pm__fault_set(pm__fault_op_t op, uint64_t nth, double rate) {
  return arm(op, nth, false, rate);
}

void pm__fault_seed(uint64_t seed) {
  atomic_store_explicit(&g_seed, seed, memory_order_relaxed);
}

void pm__fault_reset(void) {
  atomic_store_explicit(&g_active, false, memory_order_relaxed);
  for (int i = 0; i < PM__FAULT_COUNT; i++) set_one(i, 0, false, 0);
  for (int k = 0; k < 3; k++)
    atomic_store_explicit(&g_file_errno[k], g_file_errno_default[k], memory_order_relaxed);
}

void pm__fault_counts(pm__fault_counts_t *out) {
  if (!out) return;
  memset(out, 0, sizeof *out);
  for (int i = 0; i < PM__FAULT_COUNT; i++) {
    out->calls[i] = atomic_load_explicit(&g_state[i].calls, memory_order_relaxed);
    out->injected[i] = atomic_load_explicit(&g_state[i].injected, memory_order_relaxed);
    /* corrupt counts the copies memcpy counted already: one call, not two */
    if (i != PM__FAULT_CORRUPT) out->total_calls += out->calls[i];
    out->total_injected += out->injected[i];
  }
}

/* ---- PINMEM_FAULT specs -------------------------------------------------------------------- */

static int find_op(const char *name, size_t len) {
  if (len == 3 && !strncasecmp(name, "all", 3)) return PM__FAULT_ALL;
  for (int i = 0; i < PM__FAULT_COUNT; i++)
    if (strlen(fault_ops[i].name) == len && !strncasecmp(name, fault_ops[i].name, len)) return i;
  return -2;
}

static pm_status_t spec_error(const char *spec, const char *item, size_t len, const char *why) {
  char names[512];
  size_t off = 0;
  for (int i = 0; i < PM__FAULT_COUNT && off < sizeof names; i++)
    off += (size_t)snprintf(names + off, sizeof names - off, "%s, ", fault_ops[i].name);
  return pm__set_error(PM_ERR_CONFIG,
                       "fault spec '%.200s': '%.*s': %s (want op=N, op=N+, op=rate:R or seed=S, "
                       "comma separated; ops: %sall)",
                       spec, (int)PM__MIN(len, 64), item, why, names);
}

static bool parse_u64(const char *p, const char *end, uint64_t *out) {
  if (p == end) return false;
  uint64_t v = 0;
  for (; p < end; p++) {
    if (!isdigit((unsigned char)*p)) return false;
    unsigned d = (unsigned)(*p - '0');
    if (v > (UINT64_MAX - d) / 10) return false;
    v = v * 10 + d;
  }
  *out = v;
  return true;
}

/* Validate the whole spec before arming anything: a bad spec changes nothing. */
static pm_status_t spec_apply(const char *spec, bool apply) {
  const char *p = spec;
  while (*p) {
    while (*p == ',' || isspace((unsigned char)*p)) p++;
    if (!*p) break;
    const char *item = p;
    while (*p && *p != ',') p++;
    const char *end = p;
    while (end > item && isspace((unsigned char)end[-1])) end--;
    size_t len = (size_t)(end - item);
    const char *eq = memchr(item, '=', len);
    if (!eq) return spec_error(spec, item, len, "no '='");
    const char *val = eq + 1;
    const char *kend = eq;
    while (kend > item && isspace((unsigned char)kend[-1])) kend--;
    while (val < end && isspace((unsigned char)*val)) val++;
    if ((size_t)(kend - item) == 4 && !strncasecmp(item, "seed", 4)) {
      uint64_t seed;
      if (!parse_u64(val, end, &seed)) return spec_error(spec, item, len, "seed is not a number");
      if (apply) pm__fault_seed(seed);
      continue;
    }
    int op = find_op(item, (size_t)(kend - item));
    if (op == -2) return spec_error(spec, item, len, "unknown op");
    size_t vlen = (size_t)(end - val);
    if (vlen > 5 && !strncasecmp(val, "rate:", 5)) {
      char buf[64];
      if (vlen - 5 >= sizeof buf) return spec_error(spec, item, len, "rate too long");
      memcpy(buf, val + 5, vlen - 5);
      buf[vlen - 5] = '\0';
      for (char *c = buf; *c; c++)
        if (!isdigit((unsigned char)*c) && *c != '.' && *c != 'e' && *c != 'E' && *c != '-' &&
            *c != '+')
          return spec_error(spec, item, len, "rate is not a number");
      char *rend;
      errno = 0;
      double r = strtod(buf, &rend);
      if (*rend || errno || !(r >= 0 && r <= 1))
        return spec_error(spec, item, len, "rate is not a number in 0..1");
      if (apply) arm((pm__fault_op_t)op, 0, false, r);
      continue;
    }
    /* File ops take what the fault does after a colon: file_write=2:ENOSPC, file_read=1:short. */
    const char *colon = memchr(val, ':', vlen);
    int ferr = 0;
    if (colon) {
      if (file_slot((pm__fault_op_t)op) < 0)
        return spec_error(spec, item, len,
                          "only file_read, file_write and file_reserve take :ERRNO");
      static const struct {
        const char *name;
        int err;
      } errs[] = {{"EIO", EIO},       {"ENOSPC", ENOSPC}, {"EINTR", EINTR},
                  {"EDQUOT", EDQUOT}, {"EFBIG", EFBIG},   {"short", PM__FAULT_SHORT}};
      size_t elen = (size_t)(end - colon - 1);
      for (size_t e = 0; e < sizeof errs / sizeof errs[0]; e++)
        if (strlen(errs[e].name) == elen && !strncasecmp(colon + 1, errs[e].name, elen))
          ferr = errs[e].err;
      if (!ferr)
        return spec_error(spec, item, len, "not EIO, ENOSPC, EINTR, EDQUOT, EFBIG or short");
      if (!file_fault_ok((pm__fault_op_t)op, ferr))
        return spec_error(spec, item, len, "a reservation fails with an errno, not short");
      end = colon;
      vlen = (size_t)(end - val);
    }
    bool sticky = vlen > 0 && val[vlen - 1] == '+';
    uint64_t nth;
    if (!parse_u64(val, end - (sticky ? 1 : 0), &nth))
      return spec_error(spec, item, len, "not N, N+ or rate:R");
    if (apply) arm((pm__fault_op_t)op, nth, sticky, 0);
    if (apply && ferr) (void)pm__fault_file_errno((pm__fault_op_t)op, ferr);
  }
  return PM_OK;
}

pm_status_t pm__fault_configure(const char *spec) {
  if (!spec) return pm__set_error(PM_ERR_INVALID, "pm__fault_configure: spec is NULL");
  pm_status_t st = spec_apply(spec, false);
  if (st != PM_OK) return st;
  return spec_apply(spec, true);
}
