/*
 * DESIGN: the cuda backend: src/backend/backend.h over the CUDA *driver* API, loaded at run time.
 *
 * - No toolkit at build time: libcuda.so.1 is opened with dlopen (PINMEM_CUDA_DRIVER names another
 *   file, for tests and unusual installs), cuInit, cuDriverGetVersion and cuGetProcAddress come
 *   from dlsym, and every other entry point from cuGetProcAddress at the version whose ABI
 *   cuda_driver.h declares (CUDA 12.0's for all but the optional cuMemcpyBatchAsync, 12.8's). So
 *   the backend is in every build, runs on every driver from r525 (CUDA 12.0) on, and what a
 *   driver lacks is reported (pm_backend_info, `pinmem info`), never fatal: a missing
 *   cuMemcpyBatchAsync means one copy per piece, PTX a driver cannot JIT means the DMA path.
 * - Contexts as the runtime keeps them: each device's primary context (cuDevicePrimaryCtxRetain,
 *   retained once and kept for the process), made current per thread. A thread with no current
 *   context gets device 0's, as a thread of the runtime does; a context someone else made current
 *   (torch, CuPy: also the primary one) is used as it is. So streams, events and pointers pass
 *   both ways between pinmem and those libraries.
 * - Handles are the driver's own: a pm_stream_t is a CUstream (= cudaStream_t), a pm_event_t a
 *   CUevent (= cudaEvent_t); NULL is the legacy default stream, as in a runtime program.
 * - Kernels: the PTX of kernels.cu (kernels_ptx.h, committed) is JIT-loaded once per device on
 *   first use and cached (cuModuleLoadDataEx); a failed load is remembered with its reason, and
 *   the kernel paths then answer "unsupported" (kernel_host_access 0: batches go by DMA).
 * - Every driver return code is checked and becomes a pm_status_t through one mapping (cu_fail)
 *   with the call, its arguments and the driver's own message (cuGetErrorString/cuGetErrorName).
 *   CUDA_ERROR_NOT_READY from a query is an answer (PM_NOT_READY), not a failure.
 * - Arguments are validated before any driver call; outputs are written only on success.
 * - shutdown does nothing: releasing primary contexts would pull them from under other libraries
 *   in the process, and the driver cleans up at exit.
 *
 * Lock order: drv_lock (the driver probe, taken by init only) and ctx_lock (primary contexts,
 * kernel modules) are leaves, never held together.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

#if !defined(PINMEM_HAVE_CUDA)
#error "backend_cuda.c is built only with PINMEM_HAVE_CUDA (the CMake build defines it)"
#endif
#include "cuda_driver.h"
#include "kernels.h"
#include "kernels_ptx.h"

/* Longest time launch_busy accepts: far beyond any benchmark, far below uint64 nanoseconds. */
#define PM__BUSY_MAX_SECONDS 1.0e6
/* Devices the context and kernel tables cover (more are refused by set_device with a message). */
#define PM__CUDA_MAX_DEVICES 64
/* The driver API version every required entry point is asked for: CUDA 12.0 (driver r525). */
#define PM__CUDA_MIN_VERSION 12000

/* ---- the driver: loaded once ---------------------------------------------------------------- */

typedef struct entry {
  const char *name; /* as cuGetProcAddress knows it (no _v2 suffix) */
  int version;      /* the ABI asked for: the one cuda_driver.h declares */
  void **slot;
  int optional;     /* 1: a driver may lack it; what we lose is said in `lost` */
  const char *lost;
} entry_t;

static struct {
  pm_cuInit_t Init;
  pm_cuDriverGetVersion_t DriverGetVersion;
  pm_cuGetErrorString_t GetErrorString;
  pm_cuGetErrorName_t GetErrorName;
  pm_cuDeviceGetCount_t DeviceGetCount;
  pm_cuDeviceGet_t DeviceGet;
  pm_cuDeviceGetName_t DeviceGetName;
  pm_cuDeviceGetAttribute_t DeviceGetAttribute;
  pm_cuDeviceGetPCIBusId_t DeviceGetPCIBusId;
  pm_cuDevicePrimaryCtxRetain_t DevicePrimaryCtxRetain;
  pm_cuCtxSetCurrent_t CtxSetCurrent;
  pm_cuCtxGetCurrent_t CtxGetCurrent;
  pm_cuCtxGetDevice_t CtxGetDevice;
  pm_cuCtxPushCurrent_t CtxPushCurrent; /* optional, with CtxPopCurrent and StreamGetCtx */
  pm_cuCtxPopCurrent_t CtxPopCurrent;
  pm_cuCtxSynchronize_t CtxSynchronize;
  pm_cuMemGetInfo_t MemGetInfo;
  pm_cuMemHostAlloc_t MemHostAlloc;
  pm_cuMemFreeHost_t MemFreeHost;
  pm_cuMemHostRegister_t MemHostRegister;
  pm_cuMemHostUnregister_t MemHostUnregister;
  pm_cuMemHostGetDevicePointer_t MemHostGetDevicePointer;
  pm_cuMemAlloc_t MemAlloc;
  pm_cuMemFree_t MemFree;
  pm_cuMemAllocManaged_t MemAllocManaged;
  pm_cuMemsetD8Async_t MemsetD8Async;
  pm_cuMemPrefetchAsync_v8000_t MemPrefetchAsync;
  pm_cuStreamCreate_t StreamCreate;
  pm_cuStreamDestroy_t StreamDestroy;
  pm_cuStreamSynchronize_t StreamSynchronize;
  pm_cuStreamQuery_t StreamQuery;
  pm_cuStreamWaitEvent_t StreamWaitEvent;
  pm_cuStreamGetCtx_t StreamGetCtx; /* optional */
  pm_cuEventCreate_t EventCreate;
  pm_cuEventDestroy_t EventDestroy;
  pm_cuEventRecord_t EventRecord;
  pm_cuEventQuery_t EventQuery;
  pm_cuEventSynchronize_t EventSynchronize;
  pm_cuEventElapsedTime_t EventElapsedTime;
  pm_cuMemcpyAsync_t MemcpyAsync;
  pm_cuMemcpyHtoDAsync_t MemcpyHtoDAsync;
  pm_cuMemcpyDtoHAsync_t MemcpyDtoHAsync;
  pm_cuMemcpyDtoDAsync_t MemcpyDtoDAsync;
  pm_cuLaunchHostFunc_t LaunchHostFunc;
  pm_cuPointerGetAttributes_t PointerGetAttributes;
  pm_cuModuleLoadDataEx_t ModuleLoadDataEx;
  pm_cuModuleGetFunction_t ModuleGetFunction;
  pm_cuFuncGetAttribute_t FuncGetAttribute;
  pm_cuLaunchKernel_t LaunchKernel;
  pm_cuMemcpyBatchAsync_v12080_t MemcpyBatchAsync; /* optional */
} drv;

#define E(n, v) {#n, v, (void **)&drv.n, 0, NULL}
#define E_CU(n, v) {"cu" #n, v, (void **)&drv.n, 0, NULL}
/* The versions are those of the ABI cuda_driver.h declares (docs/install.md lists them with the
 * driver that first has each); all are asked for at CUDA 12.0, where that ABI is the current one. */
static const entry_t entries[] = {
    E_CU(GetErrorString, 6000), E_CU(GetErrorName, 6000), E_CU(DeviceGetCount, 2000),
    E_CU(DeviceGet, 2000), E_CU(DeviceGetName, 2000), E_CU(DeviceGetAttribute, 2000),
    E_CU(DeviceGetPCIBusId, 4010), E_CU(DevicePrimaryCtxRetain, 7000), E_CU(CtxSetCurrent, 4000),
    E_CU(CtxGetCurrent, 4000), E_CU(CtxGetDevice, 2000), E_CU(CtxSynchronize, 2000),
    E_CU(MemGetInfo, 3020), E_CU(MemHostAlloc, 2020), E_CU(MemFreeHost, 2000),
    E_CU(MemHostRegister, 6050), E_CU(MemHostUnregister, 4000),
    E_CU(MemHostGetDevicePointer, 3020), E_CU(MemAlloc, 3020), E_CU(MemFree, 3020),
    E_CU(MemAllocManaged, 6000), E_CU(MemsetD8Async, 3020), E_CU(MemPrefetchAsync, 8000),
    E_CU(StreamCreate, 2000), E_CU(StreamDestroy, 4000), E_CU(StreamSynchronize, 2000),
    E_CU(StreamQuery, 2000), E_CU(StreamWaitEvent, 3020), E_CU(EventCreate, 2000),
    E_CU(EventDestroy, 4000), E_CU(EventRecord, 2000), E_CU(EventQuery, 2000),
    E_CU(EventSynchronize, 2000), E_CU(EventElapsedTime, 2000), E_CU(MemcpyAsync, 4000),
    E_CU(MemcpyHtoDAsync, 3020), E_CU(MemcpyDtoHAsync, 3020), E_CU(MemcpyDtoDAsync, 3020),
    E_CU(LaunchHostFunc, 10000), E_CU(PointerGetAttributes, 7000),
    E_CU(ModuleLoadDataEx, 2010), E_CU(ModuleGetFunction, 2000), E_CU(FuncGetAttribute, 2020),
    E_CU(LaunchKernel, 4000),
    {"cuMemcpyBatchAsync", 12080, (void **)&drv.MemcpyBatchAsync, 1,
     "cuMemcpyBatchAsync (CUDA 12.8, driver r570): batched copies go one copy at a time"},
    /* Every driver pinmem runs on has these three; optional all the same, as stream_device may
     * answer "cannot tell" (a stream of another device is then refused by the driver as it is
     * queued, part way, instead of by pinmem before anything is). */
    {"cuStreamGetCtx", 9020, (void **)&drv.StreamGetCtx, 1,
     "cuStreamGetCtx (CUDA 9.2): a stream of another device is refused part way"},
    {"cuCtxPushCurrent", 4000, (void **)&drv.CtxPushCurrent, 1,
     "cuCtxPushCurrent (CUDA 4.0): a stream of another device is refused part way"},
    {"cuCtxPopCurrent", 4000, (void **)&drv.CtxPopCurrent, 1,
     "cuCtxPopCurrent (CUDA 4.0): a stream of another device is refused part way"},
};
#undef E
#undef E_CU

static pthread_mutex_t drv_lock = PTHREAD_MUTEX_INITIALIZER;
/* 0: not probed; 1: loaded and usable; -1: failed (probe_reason says why). Written under
 * drv_lock; read with acquire by the status query. */
static atomic_int probe_state;
static char probe_reason[512];
static char probe_library[256];
static char probe_missing[256]; /* optional entry points this driver lacks, and what that costs */
static atomic_int probe_version; /* cuDriverGetVersion's answer, 0 before it */
static atomic_int probe_pid;     /* the process whose probe started the driver */

static void fmt_version(int v, char *buf, size_t n) {
  snprintf(buf, n, "%d.%d", v / 1000, (v % 1000) / 10);
}

static const char *cu_str(pmCUresult e, int name) {
  const char *s = NULL;
  if (name && drv.GetErrorName && drv.GetErrorName(e, &s) == PM_CUDA_SUCCESS && s) return s;
  if (!name && drv.GetErrorString && drv.GetErrorString(e, &s) == PM_CUDA_SUCCESS && s) return s;
  if (!name) return "unknown CUDA error";
  /* Without the driver's names (cuGetErrorName missing), the number still tells the error. */
  static _Thread_local char num[32];
  snprintf(num, sizeof num, "CUresult %d", (int)e);
  return num;
}

/* What to do about a failure of cuInit or cuDriverGetVersion, for the probe's reason ("" when
 * the driver's own words are all there is to say). */
static const char *start_hint(pmCUresult e) {
  switch (e) {
    case PM_CUDA_ERROR_STUB_LIBRARY:
      return ": this is the CUDA toolkit's stub library (lib64/stubs, for linking only), not the "
             "driver; take its directory out of LD_LIBRARY_PATH, or install the NVIDIA driver";
    case PM_CUDA_ERROR_NOT_INITIALIZED:
      return ": the driver answers so in a process forked from one that had started CUDA; "
             "start workers with the spawn or forkserver method";
    case PM_CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
      return ": the driver library and the loaded nvidia kernel module differ in version "
             "(after a driver update: reboot, or reload the kernel module)";
    default:
      return "";
  }
}

/* An entry point at the ABI of `version`, or NULL with the driver's answer in *e_out and
 * *status_out. Asked at CUDA 12.0 (or the entry's own version when newer): the driver then hands
 * out the ABI of that release, which is what cuda_driver.h declares, also where a newer ABI of
 * the same name exists. */
static void *proc_address(pm_cuGetProcAddress_v12000_t gpa2, pm_cuGetProcAddress_v11030_t gpa1,
                          const char *name, int version, pmCUresult *e_out, int *status_out) {
  void *fn = NULL;
  int status = PM_CU_GET_PROC_ADDRESS_SUCCESS;
  int ask = version > PM__CUDA_MIN_VERSION ? version : PM__CUDA_MIN_VERSION;
  pmCUresult e = gpa2 ? gpa2(name, &fn, ask, PM_CU_GET_PROC_ADDRESS_DEFAULT, &status)
                      : gpa1(name, &fn, ask, PM_CU_GET_PROC_ADDRESS_DEFAULT);
  if (e_out) *e_out = e;
  if (status_out) *status_out = status;
  return e == PM_CUDA_SUCCESS && status == PM_CU_GET_PROC_ADDRESS_SUCCESS ? fn : NULL;
}

/* The probe, under drv_lock. On failure probe_reason says why, in words for a user. */
static int probe_locked(void) {
  const char *path = getenv("PINMEM_CUDA_DRIVER");
  if (!path || !*path) path = "libcuda.so.1";
  snprintf(probe_library, sizeof probe_library, "%s", path);
  /* RTLD_NODELETE: the driver stays mapped for the process (other libraries share it). */
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  if (!lib) {
    const char *why = dlerror();
    snprintf(probe_reason, sizeof probe_reason, "no NVIDIA driver found (%s)", why ? why : path);
    return -1;
  }
  drv.Init = (pm_cuInit_t)(uintptr_t)dlsym(lib, "cuInit");
  drv.DriverGetVersion = (pm_cuDriverGetVersion_t)(uintptr_t)dlsym(lib, "cuDriverGetVersion");
  if (!drv.Init || !drv.DriverGetVersion) {
    snprintf(probe_reason, sizeof probe_reason,
             "no NVIDIA driver found (%s has no cuInit/cuDriverGetVersion: not the CUDA driver)",
             path);
    return -1;
  }
  int version = 0;
  char vs[32], need[32];
  fmt_version(PM__CUDA_MIN_VERSION, need, sizeof need);
  pmCUresult ev = drv.DriverGetVersion(&version);
  if (ev != PM_CUDA_SUCCESS) {
    /* Not "too old (version 0.0)": the library did not answer (no error strings yet). */
    snprintf(probe_reason, sizeof probe_reason,
             "NVIDIA driver unusable (%s: cuDriverGetVersion failed with CUresult %d%s)", path,
             (int)ev, start_hint(ev));
    return -1;
  }
  atomic_store(&probe_version, version);
  fmt_version(version, vs, sizeof vs);
  if (version < PM__CUDA_MIN_VERSION) {
    snprintf(probe_reason, sizeof probe_reason,
             "NVIDIA driver too old (version %s, need %s: driver r525 or newer)", vs, need);
    return -1;
  }
  pm_cuGetProcAddress_v12000_t gpa2 =
      (pm_cuGetProcAddress_v12000_t)(uintptr_t)dlsym(lib, "cuGetProcAddress_v2");
  pm_cuGetProcAddress_v11030_t gpa1 =
      (pm_cuGetProcAddress_v11030_t)(uintptr_t)dlsym(lib, "cuGetProcAddress");
  if (!gpa2 && !gpa1) {
    snprintf(probe_reason, sizeof probe_reason,
             "NVIDIA driver unusable (version %s, but %s has no cuGetProcAddress)", vs, path);
    return -1;
  }
  /* The error strings first (cuInit's failure is told in the driver's words), then cuInit: a
   * driver without a device says so before anything else is asked of it. */
  *(void **)&drv.GetErrorString = proc_address(gpa2, gpa1, "cuGetErrorString", 6000, NULL, NULL);
  *(void **)&drv.GetErrorName = proc_address(gpa2, gpa1, "cuGetErrorName", 6000, NULL, NULL);
  pmCUresult e = drv.Init(0);
  if (e == PM_CUDA_ERROR_NO_DEVICE) {
    /* The driver shows no device when CUDA_VISIBLE_DEVICES names none it has ("", -1, junk). */
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    char vis_note[160] = "";
    if (vis)
      snprintf(vis_note, sizeof vis_note,
               "; CUDA_VISIBLE_DEVICES='%.64s' is set, and a process sees only the devices it "
               "names",
               vis);
    snprintf(probe_reason, sizeof probe_reason,
             "NVIDIA driver found (version %s) but no device: cuInit: %s (%s)%s", vs, cu_str(e, 0),
             cu_str(e, 1), vis_note);
    return -1;
  }
  if (e != PM_CUDA_SUCCESS) {
    snprintf(probe_reason, sizeof probe_reason,
             "NVIDIA driver found (version %s) but cuInit failed: %s (%s)%s", vs, cu_str(e, 0),
             cu_str(e, 1), start_hint(e));
    return -1;
  }
  probe_missing[0] = '\0';
  for (size_t i = 0; i < sizeof entries / sizeof entries[0]; i++) {
    const entry_t *en = &entries[i];
    int status = 0;
    void *fn = proc_address(gpa2, gpa1, en->name, en->version, &e, &status);
    *en->slot = fn;
    if (fn) continue;
    if (en->optional) {
      size_t used = strlen(probe_missing);
      snprintf(probe_missing + used, sizeof probe_missing - used, "%s%s", used ? "; " : "",
               en->lost);
      continue;
    }
    if (e != PM_CUDA_SUCCESS && e != PM_CUDA_ERROR_NOT_FOUND)
      /* The lookup itself failed: the driver may well have the call. */
      snprintf(probe_reason, sizeof probe_reason,
               "NVIDIA driver unusable (version %s: cuGetProcAddress(%s) failed: %s (%s))", vs,
               en->name, cu_str(e, 0), cu_str(e, 1));
    else
      snprintf(probe_reason, sizeof probe_reason,
               "NVIDIA driver unusable (version %s lacks %s, which CUDA %d.%d has: reinstall or "
               "update the NVIDIA driver)",
               vs, en->name, en->version / 1000, (en->version % 1000) / 10);
    return -1;
  }
  return 1;
}

/* Load and start the driver once; PM_ERR_NO_DEVICE with the reason when it cannot serve. */
static pm_status_t load_driver(void) {
  if (atomic_load_explicit(&probe_state, memory_order_acquire) == 1) return PM_OK;
  pthread_mutex_lock(&drv_lock);
  int st = atomic_load_explicit(&probe_state, memory_order_relaxed);
  if (st == 0) {
    st = probe_locked();
    atomic_store(&probe_pid, (int)getpid());
    atomic_store_explicit(&probe_state, st, memory_order_release);
  }
  pthread_mutex_unlock(&drv_lock);
  if (st == 1) return PM_OK;
  return pm__set_error(PM_ERR_NO_DEVICE, "%s", probe_reason);
}

/* ---- errors ------------------------------------------------------------------------------- */

static pm_status_t map_cu_error(pmCUresult e, pm_status_t oom_status) {
  switch (e) {
    case PM_CUDA_SUCCESS:
      return PM_OK;
    case PM_CUDA_ERROR_NOT_READY:
      return PM_NOT_READY;
    case PM_CUDA_ERROR_OUT_OF_MEMORY:
      return oom_status;
    case PM_CUDA_ERROR_NO_DEVICE:
    case PM_CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
      return PM_ERR_NO_DEVICE;
    case PM_CUDA_ERROR_INVALID_VALUE:
    case PM_CUDA_ERROR_INVALID_DEVICE:
    case PM_CUDA_ERROR_INVALID_HANDLE:
    case PM_CUDA_ERROR_INVALID_CONTEXT:
      return PM_ERR_INVALID;
    case PM_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
      return PM_ERR_OVERLAP;
    case PM_CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED:
      return PM_ERR_NOT_FOUND;
    case PM_CUDA_ERROR_NOT_SUPPORTED:
      return PM_ERR_UNSUPPORTED;
    default:
      return PM_ERR_BACKEND;
  }
}

/* Record a failed driver call. `oom_status` is what CUDA_ERROR_OUT_OF_MEMORY means for this call
 * (PM_ERR_NOMEM or PM_ERR_DEVICE_MEMORY). The detail reads "<call>: <message> (<error name>)". */
static pm_status_t cu_fail(pmCUresult e, pm_status_t oom_status, const char *call_fmt, ...)
    PM__PRINTF(3, 4);
static pm_status_t cu_fail(pmCUresult e, pm_status_t oom_status, const char *call_fmt, ...) {
  char call[512];
  va_list ap;
  va_start(ap, call_fmt);
  vsnprintf(call, sizeof call, call_fmt, ap);
  va_end(ap);
  pm_status_t st = map_cu_error(e, oom_status);
  /* Queries handle NOT_READY themselves; anywhere else it is a failure. And a call that
   * succeeded is a bug in the caller, never a success to report. */
  if (st == PM_NOT_READY) st = PM_ERR_BACKEND;
  if (st == PM_OK) st = PM_ERR_INTERNAL;
  return pm__set_error(st, "%s: %s (%s)", call, cu_str(e, 0), cu_str(e, 1));
}

static inline pmCUstream cu_stream(pm_stream_t s) {
  return (pmCUstream)(void *)s;
}
static inline pmCUevent cu_event(pm_event_t e) {
  return (pmCUevent)(void *)e;
}
static inline pmCUdeviceptr dptr_of(const void *p) {
  return (pmCUdeviceptr)(uintptr_t)p;
}

/* ---- contexts ------------------------------------------------------------------------------ */

static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static pmCUcontext _Atomic primary_ctx[PM__CUDA_MAX_DEVICES];

static pm_status_t check_device(int device, const char *what) {
  int count = 0;
  pmCUresult e = drv.DeviceGetCount(&count);
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_NOMEM, "cuDeviceGetCount");
  if (device < 0 || device >= count)
    return pm__set_error(PM_ERR_INVALID, "%s: device %d out of range (%d CUDA device%s: 0..%d)",
                         what, device, count, count == 1 ? "" : "s", count - 1);
  if (device >= PM__CUDA_MAX_DEVICES)
    return pm__set_error(PM_ERR_UNSUPPORTED, "%s: device %d: pinmem serves devices 0..%d", what,
                         device, PM__CUDA_MAX_DEVICES - 1);
  return PM_OK;
}

/* The device's primary context, retained on first use and kept (as the runtime keeps it). */
static pm_status_t primary_of(int device, pmCUcontext *out) {
  pmCUcontext c = atomic_load_explicit(&primary_ctx[device], memory_order_acquire);
  if (c) {
    *out = c;
    return PM_OK;
  }
  pthread_mutex_lock(&ctx_lock);
  c = atomic_load_explicit(&primary_ctx[device], memory_order_relaxed);
  pmCUresult e = PM_CUDA_SUCCESS;
  if (!c) {
    pmCUdevice dev = 0;
    e = drv.DeviceGet(&dev, device);
    if (e == PM_CUDA_SUCCESS) e = drv.DevicePrimaryCtxRetain(&c, dev);
    if (e == PM_CUDA_SUCCESS) atomic_store_explicit(&primary_ctx[device], c, memory_order_release);
  }
  pthread_mutex_unlock(&ctx_lock);
  if (e != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_NOMEM, "cuDevicePrimaryCtxRetain(device %d)", device);
  *out = c;
  return PM_OK;
}

/* A context current on this thread: the one it has, else device 0's primary context (a runtime
 * thread that never chose a device works on device 0). One TLS read when there is one. */
static pm_status_t ensure_ctx(void) {
  pmCUcontext c = NULL;
  pmCUresult e = drv.CtxGetCurrent(&c);
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_NOMEM, "cuCtxGetCurrent");
  if (c) return PM_OK;
  pm_status_t st = primary_of(0, &c);
  if (st != PM_OK) return st;
  e = drv.CtxSetCurrent(c);
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_NOMEM, "cuCtxSetCurrent(device 0)");
  return PM_OK;
}

/* For a release (a free, an unregistration) on a thread with no current context, which any
 * thread may make (an object's last reference goes where it goes, a garbage collector's thread
 * included): a primary context pinmem already holds, the lowest device's, made current for the
 * call and taken back after (*borrowed: give_back_ctx), so that the release makes no context on
 * a device the process did not use and leaves the thread with none, as it came. Under unified
 * addressing a release needs a context, not its memory's own (device 0's served every release
 * here before). Device 0's (ensure_ctx, left current) only where pinmem holds none yet. */
static pm_status_t borrow_ctx(bool *borrowed) {
  *borrowed = false;
  pmCUcontext c = NULL;
  pmCUresult e = drv.CtxGetCurrent(&c);
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_NOMEM, "cuCtxGetCurrent");
  if (c) return PM_OK;
  for (int d = 0; d < PM__CUDA_MAX_DEVICES; d++) {
    c = atomic_load_explicit(&primary_ctx[d], memory_order_acquire);
    if (!c) continue;
    e = drv.CtxSetCurrent(c);
    if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_NOMEM, "cuCtxSetCurrent(device %d)", d);
    *borrowed = true;
    return PM_OK;
  }
  return ensure_ctx();
}

static void give_back_ctx(bool borrowed) {
  if (borrowed) (void)drv.CtxSetCurrent(NULL);
}

/* The calling thread's device: its current context's, else 0 (without creating a context). */
static pm_status_t current_device(int *dev_out) {
  pmCUcontext c = NULL;
  pmCUresult e = drv.CtxGetCurrent(&c);
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_NOMEM, "cuCtxGetCurrent");
  if (!c) {
    *dev_out = 0;
    return PM_OK;
  }
  pmCUdevice d = 0;
  e = drv.CtxGetDevice(&d);
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_NOMEM, "cuCtxGetDevice");
  *dev_out = (int)d;
  return PM_OK;
}

static pm_status_t make_current(int device) {
  pmCUcontext c = NULL;
  pm_status_t st = primary_of(device, &c);
  if (st != PM_OK) return st;
  pmCUresult e = drv.CtxSetCurrent(c);
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_NOMEM, "cuCtxSetCurrent(device %d)", device);
  return PM_OK;
}

/* ---- kernels: PTX JIT-loaded once per device ------------------------------------------------ */

typedef struct kern {
  pmCUcontext ctx; /* the primary context the module lives in */
  pmCUfunction busy, checksum, batch_small, batch; /* batch: NULL without the large module */
} kern_t;

/* Per device: 0 not tried, 1 loaded, -1 failed. kernels_note holds the first failure's reason
 * (or what the optional module's absence costs), for pm_backend_info. */
static atomic_int kern_state[PM__CUDA_MAX_DEVICES];
static kern_t kern_tab[PM__CUDA_MAX_DEVICES];
static char kernels_note[512];

static pmCUresult load_module(const char *ptx, pmCUmodule *m, char *log, size_t log_size) {
  int opts[2] = {PM_CU_JIT_ERROR_LOG_BUFFER, PM_CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void *vals[2] = {log, (void *)(uintptr_t)log_size};
  log[0] = '\0';
  return drv.ModuleLoadDataEx(m, ptx, 2, opts, vals);
}

static pmCUresult get_fn(pmCUmodule m, const char *name, pmCUfunction *f) {
  pmCUresult e = drv.ModuleGetFunction(f, m, name);
  int v = 0; /* asking an attribute loads the function now, also under CUDA_MODULE_LOADING=LAZY */
  if (e == PM_CUDA_SUCCESS)
    e = drv.FuncGetAttribute(&v, PM_CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, *f);
  return e;
}

/* Under ctx_lock, with the device's primary context current. */
static int load_kernels_locked(int device, pmCUcontext ctx) {
  char log[384];
  pmCUmodule m = NULL;
  kern_t k;
  memset(&k, 0, sizeof k);
  k.ctx = ctx;
  pmCUresult e = load_module(pm__kernels_ptx, &m, log, sizeof log);
  const char *what = "cuModuleLoadDataEx";
  if (e == PM_CUDA_SUCCESS && (e = get_fn(m, "pm_busy_kernel", &k.busy)) != PM_CUDA_SUCCESS)
    what = "pm_busy_kernel";
  if (e == PM_CUDA_SUCCESS &&
      (e = get_fn(m, "pm_checksum_kernel", &k.checksum)) != PM_CUDA_SUCCESS)
    what = "pm_checksum_kernel";
  if (e == PM_CUDA_SUCCESS &&
      (e = get_fn(m, "pm_batch_copy_kernel_small", &k.batch_small)) != PM_CUDA_SUCCESS)
    what = "pm_batch_copy_kernel_small";
  if (e != PM_CUDA_SUCCESS) {
    if (!kernels_note[0])
      snprintf(kernels_note, sizeof kernels_note,
               "device %d: %s (pinmem's kernels, PTX ISA %s): %s (%s)%s%s: batches go by DMA, "
               "launch_busy and checksums are unavailable",
               device, what, PM__KERNELS_PTX_ISA, cu_str(e, 0), cu_str(e, 1), log[0] ? ": " : "",
               log);
    return -1;
  }
  pmCUmodule big = NULL;
  pmCUresult eb = load_module(pm__kernels_ptx_large, &big, log, sizeof log);
  if (eb == PM_CUDA_SUCCESS) eb = get_fn(big, "pm_batch_copy_kernel", &k.batch);
  if (eb != PM_CUDA_SUCCESS) {
    k.batch = NULL;
    if (!kernels_note[0])
      snprintf(kernels_note, sizeof kernels_note,
               "device %d: the batch copy kernel of %d pieces a launch needs PTX ISA %s: %s (%s); "
               "%d pieces a launch instead",
               device, PM__BATCH_DESCS_PER_LAUNCH, PM__KERNELS_PTX_LARGE_ISA, cu_str(eb, 0),
               cu_str(eb, 1), PM__BATCH_DESCS_SMALL);
  }
  kern_tab[device] = k;
  return 1;
}

/* The kernels of the current context's device, loading them on first use. NULL when they cannot
 * be had (the reason is in kernels_note and, for the caller, in pm_last_error). With CUDA's lazy
 * loading a first launch would load a kernel itself and could wait behind a stream blocked in a
 * host function; loading eagerly here, when a device is set or gets its first stream or
 * allocation through pinmem, keeps launches from waiting on other streams. */
static const kern_t *kernels(void) {
  int dev = 0;
  if (ensure_ctx() != PM_OK || current_device(&dev) != PM_OK) return NULL;
  if (dev < 0 || dev >= PM__CUDA_MAX_DEVICES) {
    pm__set_error(PM_ERR_UNSUPPORTED, "pinmem's kernels: device %d out of the table", dev);
    return NULL;
  }
  int s = atomic_load_explicit(&kern_state[dev], memory_order_acquire);
  if (s == 0) {
    pmCUcontext ctx = NULL;
    if (primary_of(dev, &ctx) != PM_OK) return NULL;
    pthread_mutex_lock(&ctx_lock);
    s = atomic_load_explicit(&kern_state[dev], memory_order_relaxed);
    if (s == 0) {
      s = load_kernels_locked(dev, ctx);
      atomic_store_explicit(&kern_state[dev], s, memory_order_release);
    }
    pthread_mutex_unlock(&ctx_lock);
  }
  if (s != 1) {
    pm__set_error(PM_ERR_UNSUPPORTED, "pinmem's kernels cannot run here: %s", kernels_note);
    return NULL;
  }
  const kern_t *k = &kern_tab[dev];
  pmCUcontext cur = NULL;
  if (drv.CtxGetCurrent(&cur) != PM_CUDA_SUCCESS || cur != k->ctx) {
    pm__set_error(PM_ERR_UNSUPPORTED,
                  "pinmem's kernels run in device %d's primary context, and another context is "
                  "current on this thread",
                  dev);
    return NULL;
  }
  return k;
}

/* Preload for the current device; a failure is remembered, never the caller's failure. */
static void preload_kernels(void) {
  (void)kernels();
  pm__clear_error();
}

int pm__cuda_driver_started(void) {
  return atomic_load_explicit(&probe_state, memory_order_acquire) == 1;
}

void pm__cuda_status(pm__cuda_status_t *out) {
  memset(out, 0, sizeof *out);
  out->compiled = 1;
  out->driver_version = atomic_load(&probe_version);
  int ps = atomic_load_explicit(&probe_state, memory_order_acquire);
  if (ps == 0) return;
  snprintf(out->library, sizeof out->library, "%s", probe_library);
  if (ps != 1) return;
  snprintf(out->missing, sizeof out->missing, "%s", probe_missing);
  /* In a child forked after the probe, no driver call (the driver refuses them there) and not
   * ctx_lock, which a parent's thread may have held at the fork (a context or the kernels' JIT
   * under way): the child would wait for it forever. */
  if (getpid() != atomic_load(&probe_pid)) return;
  int count = 0;
  if (drv.DeviceGetCount(&count) == PM_CUDA_SUCCESS) out->device_count = count;
  pthread_mutex_lock(&ctx_lock);
  snprintf(out->kernels, sizeof out->kernels, "%s", kernels_note);
  pthread_mutex_unlock(&ctx_lock);
}

/* ---- lifecycle and devices ---------------------------------------------------------------- */

static pm_status_t cuda_init(void) {
  pm_status_t st = load_driver();
  if (st != PM_OK) return st;
  int count = 0;
  pmCUresult e = drv.DeviceGetCount(&count);
  char vs[32];
  fmt_version(atomic_load(&probe_version), vs, sizeof vs);
  if (e != PM_CUDA_SUCCESS)
    return pm__set_error(PM_ERR_NO_DEVICE, "NVIDIA driver found (version %s) but cuDeviceGetCount "
                         "failed: %s (%s)", vs, cu_str(e, 0), cu_str(e, 1));
  if (count <= 0) {
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    return pm__set_error(PM_ERR_NO_DEVICE,
                         "NVIDIA driver found (version %s) but no device (CUDA_VISIBLE_DEVICES=%s)",
                         vs, vis ? vis : "(unset)");
  }
  /* Without option device, start nothing on any device: the caller's thread keeps its device,
   * and contexts come with the first real call on each (a context on GPU 0 in a process that
   * uses GPU 1 costs hundreds of MB there). The kernels of a device load with its context. */
  pm_option_info_t dev_opt; /* given, or only the default (init.c decides the same way) */
  if (pm_option_get(PM__OPT_DEVICE, &dev_opt) != PM_OK || dev_opt.source == PM_OPTION_DEFAULT) {
    /* Still refuse a device no process may use (compute mode prohibited), as the context
     * creation would: an attribute query creates no context. */
    int dev = 0, mode = 0;
    if (current_device(&dev) == PM_OK &&
        drv.DeviceGetAttribute(&mode, PM_CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, dev) ==
            PM_CUDA_SUCCESS &&
        mode == PM_CU_COMPUTEMODE_PROHIBITED)
      return pm__set_error(PM_ERR_NO_DEVICE, "CUDA device %d: compute mode is prohibited", dev);
    pm__clear_error();
    return PM_OK;
  }
  long want = pm__opt_int(PM__OPT_DEVICE);
  if (want < 0 || want >= count)
    return pm__set_error(PM_ERR_CONFIG,
                         "option device (PINMEM_DEVICE) is %ld, but there %s %d CUDA device%s "
                         "(0..%d)",
                         want, count == 1 ? "is" : "are", count, count == 1 ? "" : "s", count - 1);
  /* Retaining the primary context creates it now, so a device that cannot be used (exclusive
   * mode taken, driver trouble) fails pm_init rather than the first allocation. */
  st = check_device((int)want, "init");
  if (st == PM_OK) st = make_current((int)want);
  if (st != PM_OK)
    return pm__wrap_error(PM_ERR_NO_DEVICE, "context creation on device %ld", want);
  preload_kernels();
  return PM_OK;
}

static void cuda_shutdown(void) {}

static pm_status_t cuda_device_count(int *count_out) {
  if (!count_out) return pm__set_error(PM_ERR_INVALID, "device_count: count_out is NULL");
  int count = 0;
  pmCUresult e = drv.DeviceGetCount(&count);
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_NOMEM, "cuDeviceGetCount");
  *count_out = count;
  return PM_OK;
}

/* Attribute query as part of device_info: failure fails the call. */
#define PM__ATTR(dst, attr)                                                                   \
  do {                                                                                        \
    int v_ = 0;                                                                               \
    pmCUresult e_ = drv.DeviceGetAttribute(&v_, (attr), device);                              \
    if (e_ != PM_CUDA_SUCCESS)                                                                \
      return cu_fail(e_, PM_ERR_NOMEM, "cuDeviceGetAttribute(%s, device %d)", #attr, device); \
    (dst) = v_;                                                                               \
  } while (0)

static pm_status_t cuda_device_info(int device, pm_device_info_t *info_out) {
  if (!info_out) return pm__set_error(PM_ERR_INVALID, "device_info: info_out is NULL");
  pm_status_t st = check_device(device, "device_info");
  if (st != PM_OK) return st;

  pm_device_info_t info;
  memset(&info, 0, sizeof info);
  info.index = device;
  pmCUresult e = drv.DeviceGetName(info.name, (int)sizeof info.name, device);
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_NOMEM, "cuDeviceGetName(device %d)", device);
  info.name[sizeof info.name - 1] = '\0';
  PM__ATTR(info.cc_major, PM_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
  PM__ATTR(info.cc_minor, PM_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  PM__ATTR(info.async_engines, PM_CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT);
  PM__ATTR(info.can_map_host_memory, PM_CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY);
  PM__ATTR(info.unified_addressing, PM_CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING);
  PM__ATTR(info.managed_memory, PM_CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY);
  PM__ATTR(info.concurrent_managed_access, PM_CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS);
  PM__ATTR(info.host_register_supported, PM_CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED);
  PM__ATTR(info.host_register_read_only, PM_CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED);
  PM__ATTR(info.pageable_memory_access, PM_CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS);

  /* cuMemGetInfo speaks of the current context: make the device's primary context current for
   * it, then put back whatever context the thread had (none included). */
  pmCUcontext prev = NULL;
  e = drv.CtxGetCurrent(&prev);
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_NOMEM, "cuCtxGetCurrent");
  pmCUcontext ctx = NULL;
  st = primary_of(device, &ctx);
  if (st != PM_OK) return st;
  if (ctx != prev && (e = drv.CtxSetCurrent(ctx)) != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_NOMEM, "cuCtxSetCurrent(device %d)", device);
  size_t free_b = 0, total_b = 0;
  pmCUresult e_info = drv.MemGetInfo(&free_b, &total_b);
  if (ctx != prev && (e = drv.CtxSetCurrent(prev)) != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_NOMEM, "cuCtxSetCurrent (restoring the context)");
  if (e_info != PM_CUDA_SUCCESS)
    return cu_fail(e_info, PM_ERR_NOMEM, "cuMemGetInfo (device %d)", device);
  info.free_memory = free_b;
  info.total_memory = total_b;

  /* PCI address in sysfs form (lowercase hex, 4-digit domain); the PCIe link from sysfs. A
   * missing piece is "unknown" (-1, ""), never a failure: VMs and containers often hide it. */
  char raw[64];
  unsigned dom = 0, bus = 0, dev = 0, fn = 0;
  int have_id = 0;
  e = drv.DeviceGetPCIBusId(raw, (int)sizeof raw, device);
  if (e == PM_CUDA_SUCCESS && sscanf(raw, "%x:%x:%x.%x", &dom, &bus, &dev, &fn) == 4) {
    have_id = 1;
  } else {
    int pbus = -1, pdev = -1, pdom = -1;
    if (drv.DeviceGetAttribute(&pbus, PM_CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, device) ==
            PM_CUDA_SUCCESS &&
        drv.DeviceGetAttribute(&pdev, PM_CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, device) ==
            PM_CUDA_SUCCESS &&
        drv.DeviceGetAttribute(&pdom, PM_CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, device) ==
            PM_CUDA_SUCCESS &&
        pbus >= 0 && pdev >= 0 && pdom >= 0 && (pbus | pdev | pdom) != 0) {
      dom = (unsigned)pdom;
      bus = (unsigned)pbus;
      dev = (unsigned)pdev;
      fn = 0;
      have_id = 1;
    }
  }
  info.pcie_gen = info.pcie_width = info.pcie_max_gen = info.pcie_max_width = -1;
  info.numa_node = -1;
  if (have_id) {
    snprintf(info.pci_bus_id, sizeof info.pci_bus_id, "%04x:%02x:%02x.%x", dom & 0xffffffu,
             bus & 0xffu, dev & 0x1fu, fn & 0x7u);
    info.pcie_gen = pm__pcie_sysfs_gen(info.pci_bus_id, "current_link_speed");
    info.pcie_max_gen = pm__pcie_sysfs_gen(info.pci_bus_id, "max_link_speed");
    info.pcie_width = pm__pcie_sysfs_int(info.pci_bus_id, "current_link_width", 1);
    info.pcie_max_width = pm__pcie_sysfs_int(info.pci_bus_id, "max_link_width", 1);
    info.numa_node = pm__pcie_sysfs_int(info.pci_bus_id, "numa_node", 0);
  }

  *info_out = info;
  return PM_OK;
}

static pm_status_t cuda_set_device(int device) {
  pm_status_t st = check_device(device, "set_device");
  if (st == PM_OK) st = make_current(device);
  if (st != PM_OK) return st;
  preload_kernels();
  return PM_OK;
}

static pm_status_t cuda_get_device(int *device_out) {
  if (!device_out) return pm__set_error(PM_ERR_INVALID, "get_device: device_out is NULL");
  int dev = 0;
  pm_status_t st = current_device(&dev);
  if (st != PM_OK) return st;
  *device_out = dev;
  return PM_OK;
}

static pm_status_t cuda_bound_device(int *device_out) {
  if (!device_out) return pm__set_error(PM_ERR_INVALID, "bound_device: device_out is NULL");
  pmCUcontext c = NULL;
  pmCUresult e = drv.CtxGetCurrent(&c);
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_NOMEM, "cuCtxGetCurrent");
  if (!c) {
    *device_out = -1;
    return PM_OK;
  }
  return cuda_get_device(device_out);
}

static pm_status_t cuda_unbind_device(void) {
  /* NULL pops the thread's current context: none current again, as before the call that
   * made one current. */
  pmCUresult e = drv.CtxSetCurrent(NULL);
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_NOMEM, "cuCtxSetCurrent(NULL)");
  return PM_OK;
}

static pm_status_t cuda_device_synchronize(void) {
  pm_status_t st = ensure_ctx();
  if (st != PM_OK) return st;
  pmCUresult e = drv.CtxSynchronize();
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_BACKEND, "cuCtxSynchronize");
  return PM_OK;
}

/* Device-memory allocation failures also say how much memory the device has left. */
static pm_status_t device_oom_fail(pmCUresult e, const char *call, size_t bytes) {
  size_t free_b = 0, total_b = 0;
  if (e == PM_CUDA_ERROR_OUT_OF_MEMORY && drv.MemGetInfo(&free_b, &total_b) == PM_CUDA_SUCCESS) {
    int dev = -1;
    if (current_device(&dev) != PM_OK) dev = -1;
    return cu_fail(e, PM_ERR_DEVICE_MEMORY, "%s(%zu bytes) on device %d with %zu of %zu bytes free",
                   call, bytes, dev, free_b, total_b);
  }
  return cu_fail(e, PM_ERR_DEVICE_MEMORY, "%s(%zu bytes)", call, bytes);
}

/* ---- pinned host memory ------------------------------------------------------------------- */

static pm_status_t cuda_host_alloc(size_t bytes, unsigned flags, void **ptr_out) {
  const unsigned known = PM_HOST_MAPPED | PM_HOST_WRITE_COMBINED | PM_HOST_PORTABLE;
  if (!ptr_out) return pm__set_error(PM_ERR_INVALID, "host_alloc: ptr_out is NULL");
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "host_alloc: size is 0");
  if (flags & ~known)
    return pm__set_error(PM_ERR_INVALID, "host_alloc: unknown flags 0x%x", flags & ~known);
  unsigned cflags = 0;
  if (flags & PM_HOST_MAPPED) cflags |= PM_CU_MEMHOSTALLOC_DEVICEMAP;
  if (flags & PM_HOST_WRITE_COMBINED) cflags |= PM_CU_MEMHOSTALLOC_WRITECOMBINED;
  if (flags & PM_HOST_PORTABLE) cflags |= PM_CU_MEMHOSTALLOC_PORTABLE;
  pm_status_t st = ensure_ctx();
  if (st != PM_OK) return st;
  void *p = NULL;
  pmCUresult e = drv.MemHostAlloc(&p, bytes, cflags);
  if (e != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_NOMEM, "cuMemHostAlloc(%zu bytes, flags 0x%x)", bytes, cflags);
  if (!p) return pm__set_error(PM_ERR_INTERNAL, "cuMemHostAlloc(%zu bytes) returned NULL", bytes);
  *ptr_out = p;
  return PM_OK;
}

static pm_status_t cuda_host_free(void *ptr, size_t bytes) {
  if (!ptr) return pm__set_error(PM_ERR_INVALID, "host_free: ptr is NULL");
  bool borrowed;
  pm_status_t st = borrow_ctx(&borrowed);
  if (st != PM_OK) return st;
  pmCUresult e = drv.MemFreeHost(ptr);
  give_back_ctx(borrowed);
  if (e != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_NOMEM, "cuMemFreeHost(%p, %zu bytes)", ptr, bytes);
  return PM_OK;
}

static pm_status_t cuda_host_register(void *ptr, size_t bytes, unsigned flags) {
  const unsigned known = PM_REGISTER_MAPPED | PM_REGISTER_PORTABLE | PM_REGISTER_READ_ONLY;
  if (!ptr) return pm__set_error(PM_ERR_INVALID, "host_register: ptr is NULL");
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "host_register: size is 0");
  if (flags & ~known)
    return pm__set_error(PM_ERR_INVALID, "host_register: unknown flags 0x%x", flags & ~known);
  pm_status_t st = ensure_ctx();
  if (st != PM_OK) return st;
  unsigned cflags = 0;
  if (flags & PM_REGISTER_MAPPED) cflags |= PM_CU_MEMHOSTREGISTER_DEVICEMAP;
  if (flags & PM_REGISTER_PORTABLE) cflags |= PM_CU_MEMHOSTREGISTER_PORTABLE;
  if (flags & PM_REGISTER_READ_ONLY) {
    int dev = 0, ro = 0;
    st = current_device(&dev);
    if (st != PM_OK) return st;
    pmCUresult e =
        drv.DeviceGetAttribute(&ro, PM_CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, dev);
    if (e != PM_CUDA_SUCCESS)
      return cu_fail(e, PM_ERR_NOMEM,
                     "cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, "
                     "device %d)",
                     dev);
    if (!ro)
      return pm__set_error(PM_ERR_UNSUPPORTED,
                           "host_register: device %d cannot map registered memory read-only "
                           "(CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED is 0); register "
                           "without PM_REGISTER_READ_ONLY",
                           dev);
    cflags |= PM_CU_MEMHOSTREGISTER_READ_ONLY;
  }
  pmCUresult e = drv.MemHostRegister(ptr, bytes, cflags);
  if (e != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_NOMEM, "cuMemHostRegister(%p, %zu bytes, flags 0x%x)", ptr, bytes,
                   cflags);
  return PM_OK;
}

static pm_status_t cuda_host_unregister(void *ptr, size_t bytes) {
  if (!ptr) return pm__set_error(PM_ERR_INVALID, "host_unregister: ptr is NULL");
  bool borrowed;
  pm_status_t st = borrow_ctx(&borrowed);
  if (st != PM_OK) return st;
  pmCUresult e = drv.MemHostUnregister(ptr);
  give_back_ctx(borrowed);
  if (e != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_NOMEM, "cuMemHostUnregister(%p, %zu bytes)", ptr, bytes);
  return PM_OK;
}

static pm_status_t cuda_host_device_pointer(void *host_ptr, void **dptr_out) {
  if (!host_ptr) return pm__set_error(PM_ERR_INVALID, "host_device_pointer: ptr is NULL");
  if (!dptr_out) return pm__set_error(PM_ERR_INVALID, "host_device_pointer: dptr_out is NULL");
  pm_status_t st = ensure_ctx();
  if (st != PM_OK) return st;
  pmCUdeviceptr d = 0;
  pmCUresult e = drv.MemHostGetDevicePointer(&d, host_ptr, 0);
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_NOMEM, "cuMemHostGetDevicePointer(%p)", host_ptr);
  *dptr_out = (void *)(uintptr_t)d;
  return PM_OK;
}

/* ---- device and managed memory ------------------------------------------------------------ */

static pm_status_t cuda_device_alloc(size_t bytes, void **dptr_out) {
  if (!dptr_out) return pm__set_error(PM_ERR_INVALID, "device_alloc: dptr_out is NULL");
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "device_alloc: size is 0");
  pm_status_t st = ensure_ctx();
  if (st != PM_OK) return st;
  pmCUdeviceptr d = 0;
  pmCUresult e = drv.MemAlloc(&d, bytes);
  if (e != PM_CUDA_SUCCESS) return device_oom_fail(e, "cuMemAlloc", bytes);
  if (!d) return pm__set_error(PM_ERR_INTERNAL, "cuMemAlloc(%zu bytes) returned 0", bytes);
  preload_kernels();
  *dptr_out = (void *)(uintptr_t)d;
  return PM_OK;
}

static pm_status_t cuda_device_free(void *dptr) {
  if (!dptr) return pm__set_error(PM_ERR_INVALID, "device_free: ptr is NULL");
  bool borrowed;
  pm_status_t st = borrow_ctx(&borrowed);
  if (st != PM_OK) return st;
  pmCUresult e = drv.MemFree(dptr_of(dptr));
  give_back_ctx(borrowed);
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_DEVICE_MEMORY, "cuMemFree(%p)", dptr);
  return PM_OK;
}

static pm_status_t cuda_device_memset_async(void *dptr, int value, size_t bytes,
                                            pm_stream_t stream) {
  if (bytes == 0) return PM_OK;
  if (!dptr) return pm__set_error(PM_ERR_INVALID, "device_memset_async: ptr is NULL");
  pm_status_t st = ensure_ctx();
  if (st != PM_OK) return st;
  /* cudaMemsetAsync's int value is used as an unsigned char, as here. */
  pmCUresult e = drv.MemsetD8Async(dptr_of(dptr), (unsigned char)value, bytes, cu_stream(stream));
  if (e != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_DEVICE_MEMORY, "cuMemsetD8Async(%p, %d, %zu, stream %p)", dptr, value,
                   bytes, (void *)stream);
  return PM_OK;
}

static pm_status_t cuda_managed_alloc(size_t bytes, void **ptr_out) {
  if (!ptr_out) return pm__set_error(PM_ERR_INVALID, "managed_alloc: ptr_out is NULL");
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "managed_alloc: size is 0");
  pm_status_t st = ensure_ctx();
  if (st != PM_OK) return st;
  pmCUdeviceptr p = 0;
  pmCUresult e = drv.MemAllocManaged(&p, bytes, PM_CU_MEM_ATTACH_GLOBAL);
  if (e != PM_CUDA_SUCCESS) return device_oom_fail(e, "cuMemAllocManaged", bytes);
  if (!p) return pm__set_error(PM_ERR_INTERNAL, "cuMemAllocManaged(%zu bytes) returned 0", bytes);
  *ptr_out = (void *)(uintptr_t)p;
  return PM_OK;
}

static pm_status_t cuda_managed_free(void *ptr) {
  if (!ptr) return pm__set_error(PM_ERR_INVALID, "managed_free: ptr is NULL");
  bool borrowed;
  pm_status_t st = borrow_ctx(&borrowed);
  if (st != PM_OK) return st;
  pmCUresult e = drv.MemFree(dptr_of(ptr));
  give_back_ctx(borrowed);
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_DEVICE_MEMORY, "cuMemFree(%p) (managed)", ptr);
  return PM_OK;
}

static pm_status_t cuda_managed_prefetch(const void *ptr, size_t bytes, int device,
                                         pm_stream_t stream) {
  if (bytes == 0) return PM_OK;
  if (!ptr) return pm__set_error(PM_ERR_INVALID, "managed_prefetch: ptr is NULL");
  pm_status_t st = ensure_ctx();
  if (st != PM_OK) return st;
  /* Prefetching needs concurrent managed access on the device involved (for the CPU target:
   * the current device); without it the driver answers a puzzling invalid-device error. */
  int attr_dev = device;
  if (device == PM_CPU_DEVICE) {
    st = current_device(&attr_dev);
    if (st != PM_OK) return st;
  } else {
    st = check_device(device, "managed_prefetch");
    if (st != PM_OK) return st;
  }
  int cma = 0;
  pmCUresult e =
      drv.DeviceGetAttribute(&cma, PM_CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, attr_dev);
  if (e != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_NOMEM,
                   "cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, device %d)",
                   attr_dev);
  if (!cma)
    return pm__set_error(PM_ERR_UNSUPPORTED,
                         "managed_prefetch: device %d has no concurrent managed access "
                         "(CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS is 0), so managed memory "
                         "cannot be prefetched",
                         attr_dev);
  /* The CUDA 8.0 ABI (a device ordinal, CU_DEVICE_CPU for the host), which every driver keeps;
   * CUDA 12.2 added a CUmemLocation form that CUDA 13's headers made the default. */
  pmCUdevice target = device == PM_CPU_DEVICE ? PM_CU_DEVICE_CPU : (pmCUdevice)device;
  e = drv.MemPrefetchAsync(dptr_of(ptr), bytes, target, cu_stream(stream));
  if (e != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_DEVICE_MEMORY, "cuMemPrefetchAsync(%p, %zu, %s %d, stream %p)", ptr,
                   bytes, device == PM_CPU_DEVICE ? "host" : "device", device, (void *)stream);
  return PM_OK;
}

/* ---- streams and events ------------------------------------------------------------------- */

/* Calls on the NULL stream need a current context; calls on a handle carry theirs. */
static pm_status_t ctx_for(pm_stream_t stream) {
  return stream ? PM_OK : ensure_ctx();
}

static pm_status_t cuda_stream_create(pm_stream_t *stream_out) {
  if (!stream_out) return pm__set_error(PM_ERR_INVALID, "stream_create: stream_out is NULL");
  pm_status_t st = ensure_ctx();
  if (st != PM_OK) return st;
  pmCUstream s = NULL;
  pmCUresult e = drv.StreamCreate(&s, PM_CU_STREAM_NON_BLOCKING);
  if (e != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_NOMEM, "cuStreamCreate(CU_STREAM_NON_BLOCKING)");
  preload_kernels();
  *stream_out = (pm_stream_t)(void *)s;
  return PM_OK;
}

static pm_status_t cuda_stream_destroy(pm_stream_t stream) {
  if (!stream) return pm__set_error(PM_ERR_INVALID, "stream_destroy: NULL is the default stream");
  /* The contract waits for the queued work (cuStreamDestroy alone would return at once).
   * The stream is destroyed even if that work failed, so it never leaks. */
  pmCUresult es = drv.StreamSynchronize(cu_stream(stream));
  pmCUresult e = drv.StreamDestroy(cu_stream(stream));
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_NOMEM, "cuStreamDestroy(%p)", (void *)stream);
  if (es != PM_CUDA_SUCCESS)
    return cu_fail(es, PM_ERR_NOMEM,
                   "cuStreamSynchronize(%p) (before destroying it; it was destroyed)",
                   (void *)stream);
  return PM_OK;
}

static pm_status_t cuda_stream_synchronize(pm_stream_t stream) {
  pm_status_t st = ctx_for(stream);
  if (st != PM_OK) return st;
  pmCUresult e = drv.StreamSynchronize(cu_stream(stream));
  if (e != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_NOMEM, "cuStreamSynchronize(%p)", (void *)stream);
  return PM_OK;
}

static pm_status_t cuda_stream_query(pm_stream_t stream) {
  pm_status_t st = ctx_for(stream);
  if (st != PM_OK) return st;
  pmCUresult e = drv.StreamQuery(cu_stream(stream));
  if (e == PM_CUDA_SUCCESS) return PM_OK;
  if (e == PM_CUDA_ERROR_NOT_READY) return PM_NOT_READY;
  return cu_fail(e, PM_ERR_NOMEM, "cuStreamQuery(%p)", (void *)stream);
}

static pm_status_t cuda_stream_wait_event(pm_stream_t stream, pm_event_t event) {
  if (!event) return pm__set_error(PM_ERR_INVALID, "stream_wait_event: event is NULL");
  pm_status_t st = ctx_for(stream);
  if (st != PM_OK) return st;
  pmCUresult e = drv.StreamWaitEvent(cu_stream(stream), cu_event(event), 0);
  if (e != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_NOMEM, "cuStreamWaitEvent(stream %p, event %p)", (void *)stream,
                   (void *)event);
  return PM_OK;
}

static pm_status_t cuda_event_create(unsigned flags, pm_event_t *event_out) {
  if (!event_out) return pm__set_error(PM_ERR_INVALID, "event_create: event_out is NULL");
  if (flags & ~(unsigned)PM_EVENT_TIMING)
    return pm__set_error(PM_ERR_INVALID, "event_create: unknown flags 0x%x",
                         flags & ~(unsigned)PM_EVENT_TIMING);
  pm_status_t st = ensure_ctx();
  if (st != PM_OK) return st;
  unsigned cflags = (flags & PM_EVENT_TIMING) ? PM_CU_EVENT_DEFAULT : PM_CU_EVENT_DISABLE_TIMING;
  pmCUevent ev = NULL;
  pmCUresult e = drv.EventCreate(&ev, cflags);
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_NOMEM, "cuEventCreate(0x%x)", cflags);
  *event_out = (pm_event_t)(void *)ev;
  return PM_OK;
}

static pm_status_t cuda_event_destroy(pm_event_t event) {
  if (!event) return pm__set_error(PM_ERR_INVALID, "event_destroy: event is NULL");
  pmCUresult e = drv.EventDestroy(cu_event(event));
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_NOMEM, "cuEventDestroy(%p)", (void *)event);
  return PM_OK;
}

static pm_status_t cuda_event_record(pm_event_t event, pm_stream_t stream) {
  if (!event) return pm__set_error(PM_ERR_INVALID, "event_record: event is NULL");
  pm_status_t st = ctx_for(stream);
  if (st != PM_OK) return st;
  pmCUresult e = drv.EventRecord(cu_event(event), cu_stream(stream));
  if (e != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_NOMEM, "cuEventRecord(event %p, stream %p)", (void *)event,
                   (void *)stream);
  return PM_OK;
}

static pm_status_t cuda_event_query(pm_event_t event) {
  if (!event) return pm__set_error(PM_ERR_INVALID, "event_query: event is NULL");
  pmCUresult e = drv.EventQuery(cu_event(event));
  if (e == PM_CUDA_SUCCESS) return PM_OK;
  if (e == PM_CUDA_ERROR_NOT_READY) return PM_NOT_READY;
  return cu_fail(e, PM_ERR_NOMEM, "cuEventQuery(%p)", (void *)event);
}

static pm_status_t cuda_event_synchronize(pm_event_t event) {
  if (!event) return pm__set_error(PM_ERR_INVALID, "event_synchronize: event is NULL");
  pmCUresult e = drv.EventSynchronize(cu_event(event));
  if (e != PM_CUDA_SUCCESS) return cu_fail(e, PM_ERR_NOMEM, "cuEventSynchronize(%p)", (void *)event);
  return PM_OK;
}

static pm_status_t cuda_event_elapsed(pm_event_t start, pm_event_t end, double *seconds_out) {
  if (!start || !end) return pm__set_error(PM_ERR_INVALID, "event_elapsed: event is NULL");
  if (!seconds_out) return pm__set_error(PM_ERR_INVALID, "event_elapsed: seconds_out is NULL");
  float ms = 0.0f;
  pmCUresult e = drv.EventElapsedTime(&ms, cu_event(start), cu_event(end));
  if (e == PM_CUDA_ERROR_NOT_READY) {
    /* Not a query: there is no time to give yet, so it is a state error, not PM_NOT_READY
     * (which callers may take for success and read *seconds_out). */
    return pm__set_error(PM_ERR_STATE,
                         "cuEventElapsedTime(%p, %p): %s (%s): an event has not completed yet",
                         (void *)start, (void *)end, cu_str(e, 0), cu_str(e, 1));
  }
  if (e != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_NOMEM,
                   "cuEventElapsedTime(%p, %p) (both events need PM_EVENT_TIMING and a completed "
                   "record)",
                   (void *)start, (void *)end);
  *seconds_out = (double)ms / 1000.0;
  return PM_OK;
}

/* ---- copies, kernels, host functions ------------------------------------------------------ */

static const char *kind_call(pm_copy_kind_t kind) {
  switch (kind) {
    case PM_COPY_H2D:
      return "cuMemcpyHtoDAsync";
    case PM_COPY_D2H:
      return "cuMemcpyDtoHAsync";
    case PM_COPY_D2D:
      return "cuMemcpyDtoDAsync";
    case PM_COPY_H2H:
    case PM_COPY_DEFAULT:
      return "cuMemcpyAsync";
  }
  return NULL;
}

/* The runtime's cudaMemcpyAsync, kind by kind: the typed driver copy for an explicit direction,
 * the unified one (direction inferred from the pointers: UVA) for default and host to host. */
static pm_status_t cuda_memcpy_async(void *dst, const void *src, size_t bytes, pm_copy_kind_t kind,
                                     pm_stream_t stream) {
  const char *call = kind_call(kind);
  if (!call) return pm__set_error(PM_ERR_INVALID, "memcpy_async: unknown copy kind %d", (int)kind);
  if (bytes == 0) return PM_OK;
  if (!dst || !src)
    return pm__set_error(PM_ERR_INVALID, "memcpy_async: %s pointer is NULL",
                         dst ? "source" : "destination");
  pm_status_t st = ensure_ctx();
  if (st != PM_OK) return st;
  pmCUstream s = cu_stream(stream);
  pmCUresult e;
  switch (kind) {
    case PM_COPY_H2D:
      e = drv.MemcpyHtoDAsync(dptr_of(dst), src, bytes, s);
      break;
    case PM_COPY_D2H:
      e = drv.MemcpyDtoHAsync(dst, dptr_of(src), bytes, s);
      break;
    case PM_COPY_D2D:
      e = drv.MemcpyDtoDAsync(dptr_of(dst), dptr_of(src), bytes, s);
      break;
    default:
      e = drv.MemcpyAsync(dptr_of(dst), dptr_of(src), bytes, s);
      break;
  }
  if (e != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_NOMEM, "%s(%p, %p, %zu, stream %p)", call, dst, src, bytes,
                   (void *)stream);
  return PM_OK;
}

/* cuMemcpyBatchAsync: one driver call for many copies, which the driver may spread over the
 * copy engines; a loop of single copies pays a launch per piece (17.5 GB/s for 64 KiB pieces
 * on an H200, against 40 in one batch). It refuses the legacy NULL stream: loop there, and on
 * drivers before CUDA 12.8, which lack it (pm_backend_info says so). */
static pm_status_t cuda_memcpy_batch_async(void *const *dsts, const void *const *srcs,
                                           const size_t *sizes, size_t count, pm_stream_t stream) {
  if (count == 0) return PM_OK;
  if (!dsts || !srcs || !sizes)
    return pm__set_error(PM_ERR_INVALID, "memcpy_batch_async: NULL array");
  if (!stream || count == 1 || !drv.MemcpyBatchAsync) {
    for (size_t i = 0; i < count; i++) {
      pm_status_t st = cuda_memcpy_async(dsts[i], srcs[i], sizes[i], PM_COPY_DEFAULT, stream);
      if (st != PM_OK) return st;
    }
    return PM_OK;
  }
  pm_status_t st = ensure_ctx();
  if (st != PM_OK) return st;
  pmCUmemcpyAttributes attr;
  memset(&attr, 0, sizeof attr);
  attr.srcAccessOrder = PM_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM; /* after earlier work, as one copy */
  size_t first = 0, fail_idx = 0;
  /* A pointer and a CUdeviceptr are both 64 bits here; the driver only reads the arrays. */
  _Static_assert(sizeof(void *) == sizeof(pmCUdeviceptr), "64-bit pointers");
  pmCUresult e = drv.MemcpyBatchAsync((pmCUdeviceptr *)(uintptr_t)dsts,
                                      (pmCUdeviceptr *)(uintptr_t)srcs, (size_t *)(uintptr_t)sizes,
                                      count, &attr, &first, 1, &fail_idx, cu_stream(stream));
  if (e != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_NOMEM, "cuMemcpyBatchAsync(%zu copies, stream %p)", count,
                   (void *)stream);
  return PM_OK;
}

static pm_status_t cuda_memcpy_sync(void *dst, const void *src, size_t bytes, pm_copy_kind_t kind) {
  if (!kind_call(kind))
    return pm__set_error(PM_ERR_INVALID, "memcpy_sync: unknown copy kind %d", (int)kind);
  if (bytes == 0) return PM_OK;
  if (!dst || !src)
    return pm__set_error(PM_ERR_INVALID, "memcpy_sync: %s pointer is NULL",
                         dst ? "source" : "destination");
  /* cudaMemcpy: ordered on the legacy default stream, returning once the bytes have arrived
   * (pm_memcpy promises that, also for a pageable source the driver stages). */
  pm_status_t st = cuda_memcpy_async(dst, src, bytes, kind, NULL);
  if (st != PM_OK) return st;
  pmCUresult e = drv.StreamSynchronize(NULL);
  if (e != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_BACKEND, "cuStreamSynchronize(NULL) after the copy (%p, %p, %zu)",
                   dst, src, bytes);
  return PM_OK;
}

static pm_status_t launch(pmCUfunction f, unsigned grid, unsigned block, pm_stream_t stream,
                          void **args, pm_status_t oom_status, const char *what) {
  pmCUresult e = drv.LaunchKernel(f, grid, 1, 1, block, 1, 1, 0, cu_stream(stream), args, NULL);
  if (e != PM_CUDA_SUCCESS)
    return cu_fail(e, oom_status, "cuLaunchKernel(%s, %ux%u, stream %p)", what, grid, block,
                   (void *)stream);
  return PM_OK;
}

static pm_status_t cuda_launch_batch_copy(const pm__copy_desc_t *desc, size_t count,
                                          pm_stream_t stream) {
  if (count == 0) return PM_OK;
  if (!desc) return pm__set_error(PM_ERR_INVALID, "launch_batch_copy: NULL descriptors");
  const kern_t *k = kernels();
  if (!k) return pm__wrap_error(PM_ERR_UNSUPPORTED, "launch_batch_copy");
  /* On the heap (24 KiB is much for a caller thread's stack); cuLaunchKernel copies the
   * parameters before it returns, so one buffer serves every launch of this call. */
  const size_t per = k->batch ? PM__BATCH_DESCS_PER_LAUNCH : PM__BATCH_DESCS_SMALL;
  pm__batch_params_t *params = malloc(sizeof *params);
  if (!params) return pm__set_error(PM_ERR_NOMEM, "launch_batch_copy: out of host memory");
  /* The small kernel's parameter has the same head (count, then the descriptors). */
  _Static_assert(offsetof(pm__batch_params_t, d) == offsetof(pm__batch_params_small_t, d),
                 "one layout for both batch kernels");
  pm_status_t st = PM_OK;
  for (size_t done = 0; done < count && st == PM_OK;) {
    unsigned n = (unsigned)(count - done < per ? count - done : per);
    params->count = n;
    memcpy(params->d, desc + done, n * sizeof *desc);
    void *args[] = {params};
    st = launch(k->batch ? k->batch : k->batch_small, n, PM__BATCH_THREADS, stream, args,
                PM_ERR_BACKEND, "batch copy kernel");
    if (st != PM_OK)
      st = pm__wrap_error(st, "launch_batch_copy: %u pieces from %zu of %zu", n, done, count);
    done += n;
  }
  free(params);
  return st;
}

/* Asked per call (the current device may differ between calls and threads); an attribute query
 * is a lookup in the driver, well under a microsecond. 0 also where the kernels cannot be
 * loaded, so batches take the DMA path. */
static int cuda_kernel_host_access(void) {
  int dev = 0, uva = 0, host_ptr = 0;
  if (current_device(&dev) != PM_OK ||
      drv.DeviceGetAttribute(&uva, PM_CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, dev) !=
          PM_CUDA_SUCCESS ||
      drv.DeviceGetAttribute(&host_ptr,
                             PM_CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
                             dev) != PM_CUDA_SUCCESS || !kernels()) {
    pm__clear_error(); /* "no" is the answer */
    return 0;
  }
  return uva && host_ptr;
}

static pm_status_t cuda_launch_busy(pm_stream_t stream, double seconds) {
  /* !(x >= 0) also rejects NaN. */
  if (!(seconds >= 0.0) || seconds > PM__BUSY_MAX_SECONDS)
    return pm__set_error(PM_ERR_INVALID, "launch_busy: %g seconds is not in [0, %g]", seconds,
                         PM__BUSY_MAX_SECONDS);
  uint64_t ns = (uint64_t)(seconds * 1e9 + 0.5);
  const kern_t *k = kernels();
  if (!k) return pm__wrap_error(PM_ERR_UNSUPPORTED, "launch_busy");
  void *args[] = {&ns};
  return launch(k->busy, 1, 1, stream, args, PM_ERR_DEVICE_MEMORY, "busy kernel");
}

pm_status_t pm__launch_checksum(const void *dptr, size_t bytes, uint64_t *dresult,
                                struct CUstream_st *stream) {
  if (!dresult || ((uintptr_t)dresult & 7u) != 0)
    return pm__set_error(PM_ERR_INVALID,
                         "pm__launch_checksum: result pointer %p is NULL or not 8-byte aligned",
                         (void *)dresult);
  if (!dptr && bytes > 0)
    return pm__set_error(PM_ERR_INVALID, "pm__launch_checksum: NULL data pointer for %zu bytes",
                         bytes);
  if (atomic_load_explicit(&probe_state, memory_order_acquire) != 1)
    return pm__set_error(PM_ERR_STATE, "pm__launch_checksum: the cuda backend is not started");
  const kern_t *k = kernels();
  if (!k) return pm__wrap_error(PM_ERR_UNSUPPORTED, "pm__launch_checksum");
  pmCUresult e = drv.MemsetD8Async(dptr_of(dresult), 0, sizeof *dresult, stream);
  if (e != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_DEVICE_MEMORY, "cuMemsetD8Async(%p, 0, 8, stream %p)",
                   (void *)dresult, (void *)stream);
  const size_t nwords = bytes / 8 + 1;
  size_t blocks = (nwords + PM__CHECKSUM_THREADS - 1) / PM__CHECKSUM_THREADS;
  if (blocks > PM__CHECKSUM_MAX_BLOCKS) blocks = PM__CHECKSUM_MAX_BLOCKS;
  if (blocks < 1) blocks = 1;
  const unsigned char *p = dptr;
  unsigned long long *out = (unsigned long long *)dresult;
  void *args[] = {&p, &bytes, &out};
  return launch(k->checksum, (unsigned)blocks, PM__CHECKSUM_THREADS, (pm_stream_t)(void *)stream,
                args, PM_ERR_DEVICE_MEMORY, "checksum kernel");
}

static pm_status_t cuda_launch_host_func(pm_stream_t stream, void (*fn)(void *), void *arg) {
  if (!fn) return pm__set_error(PM_ERR_INVALID, "launch_host_func: fn is NULL");
  pm_status_t st = ctx_for(stream);
  if (st != PM_OK) return st;
  pmCUresult e = drv.LaunchHostFunc(cu_stream(stream), fn, arg);
  if (e != PM_CUDA_SUCCESS)
    return cu_fail(e, PM_ERR_NOMEM, "cuLaunchHostFunc(stream %p, fn, %p)", (void *)stream, arg);
  return PM_OK;
}

static int cuda_pointer_kind(const void *ptr) {
  if (!ptr) return PM__PTR_OTHER;
  /* cuPointerGetAttributes (unlike the singular call) answers zeros for memory the driver does
   * not know instead of failing, and needs no current context under UVA. */
  int attrs[2] = {PM_CU_POINTER_ATTRIBUTE_MEMORY_TYPE, PM_CU_POINTER_ATTRIBUTE_IS_MANAGED};
  unsigned int type = 0, managed = 0;
  void *data[2] = {&type, &managed};
  if (drv.PointerGetAttributes(2, attrs, data, dptr_of(ptr)) != PM_CUDA_SUCCESS)
    return PM__PTR_OTHER;
  if (managed || type == PM_CU_MEMORYTYPE_DEVICE || type == PM_CU_MEMORYTYPE_UNIFIED)
    return PM__PTR_DEVICE;
  /* CU_MEMORYTYPE_HOST: page-locked by cuMemHostAlloc or cuMemHostRegister (cudaHostAlloc,
   * cudaHostRegister, torch's pin_memory), whoever called it. */
  return type == PM_CU_MEMORYTYPE_HOST ? PM__PTR_PINNED : PM__PTR_OTHER;
}
static int cuda_pointer_device(const void *ptr) {
  if (!ptr) return -1;
  int attrs[3] = {PM_CU_POINTER_ATTRIBUTE_MEMORY_TYPE, PM_CU_POINTER_ATTRIBUTE_IS_MANAGED,
                  PM_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
  unsigned int type = 0, managed = 0;
  int ordinal = -1;
  void *data[3] = {&type, &managed, &ordinal};
  if (drv.PointerGetAttributes(3, attrs, data, dptr_of(ptr)) != PM_CUDA_SUCCESS) return -1;
  return type == PM_CU_MEMORYTYPE_DEVICE && !managed ? ordinal : -1;
}
/* The device of a stream: its context's. NULL and the handles CU_STREAM_LEGACY and
 * CU_STREAM_PER_THREAD name the default stream of whichever context is current (they have no
 * context of their own): the current device, as the host backend answers for NULL. -1 where the
 * driver cannot tell (a handle it does not know, a green context's stream, a driver without the
 * calls). Nothing is recorded in pm_last_error: "cannot tell" is an answer.
 *
 * cuStreamGetCtx and the context's device, not cuStreamGetDevice (CUDA 12.8): drivers refuse that
 * one inside a stream capture (torch's CUDA graphs) on some versions, and the refusal invalidates
 * the capture; a context lookup is accepted there. The context is pushed for cuCtxGetDevice (the
 * only call before CUDA 13 that names a context's device) and popped at once, so the thread's
 * own context stack is as it was. */
static int cuda_stream_device(pm_stream_t stream) {
  pmCUstream s = cu_stream(stream);
  pmCUcontext cur = NULL, ctx = NULL;
  pmCUdevice dev = -1;
  if (drv.CtxGetCurrent(&cur) != PM_CUDA_SUCCESS) return -1;
  if (!s || (uintptr_t)s == PM_CU_STREAM_LEGACY || (uintptr_t)s == PM_CU_STREAM_PER_THREAD) {
    if (!cur) return 0; /* the device a thread without a context works on (current_device) */
    return drv.CtxGetDevice(&dev) == PM_CUDA_SUCCESS ? (int)dev : -1;
  }
  if (!drv.StreamGetCtx || !drv.CtxPushCurrent || !drv.CtxPopCurrent) return -1;
  if (drv.StreamGetCtx(s, &ctx) != PM_CUDA_SUCCESS || !ctx) return -1;
  if (ctx == cur) return drv.CtxGetDevice(&dev) == PM_CUDA_SUCCESS ? (int)dev : -1;
  if (drv.CtxPushCurrent(ctx) != PM_CUDA_SUCCESS) return -1;
  pmCUresult e = drv.CtxGetDevice(&dev);
  pmCUcontext popped = NULL;
  (void)drv.CtxPopCurrent(&popped);
  return e == PM_CUDA_SUCCESS ? (int)dev : -1;
}

const pm__backend_t pm__backend_cuda = {
    .name = "cuda",
    .kind = PM_BACKEND_CUDA,
    .init = cuda_init,
    .shutdown = cuda_shutdown,
    .device_count = cuda_device_count,
    .device_info = cuda_device_info,
    .set_device = cuda_set_device,
    .get_device = cuda_get_device,
    .bound_device = cuda_bound_device,
    .unbind_device = cuda_unbind_device,
    .device_synchronize = cuda_device_synchronize,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .host_register = cuda_host_register,
    .host_unregister = cuda_host_unregister,
    .host_device_pointer = cuda_host_device_pointer,
    .device_alloc = cuda_device_alloc,
    .device_free = cuda_device_free,
    .device_memset_async = cuda_device_memset_async,
    .managed_alloc = cuda_managed_alloc,
    .managed_free = cuda_managed_free,
    .managed_prefetch = cuda_managed_prefetch,
    .stream_create = cuda_stream_create,
    .stream_destroy = cuda_stream_destroy,
    .stream_synchronize = cuda_stream_synchronize,
    .stream_query = cuda_stream_query,
    .stream_wait_event = cuda_stream_wait_event,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .event_query = cuda_event_query,
    .event_synchronize = cuda_event_synchronize,
    .event_elapsed = cuda_event_elapsed,
    .memcpy_async = cuda_memcpy_async,
    .memcpy_sync = cuda_memcpy_sync,
    .launch_busy = cuda_launch_busy,
    .launch_host_func = cuda_launch_host_func,
    .pointer_kind = cuda_pointer_kind,
    .pointer_device = cuda_pointer_device,
    .stream_device = cuda_stream_device,
    .memcpy_batch_async = cuda_memcpy_batch_async,
    .launch_batch_copy = cuda_launch_batch_copy,
    .kernel_host_access = cuda_kernel_host_access,
};
