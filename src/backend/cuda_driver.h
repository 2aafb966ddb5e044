/*
 * DESIGN: the few types, constants and entry-point signatures of the CUDA driver API (libcuda)
 * that backend_cuda.c uses, declared here so the cuda backend builds with a C compiler alone.
 *
 * Why a private header and not a build requirement from PyPI (nvidia-cuda-runtime or
 * cuda-bindings ship cuda.h): those packages are a toolkit's worth of headers (1.1 MB of cuda.h
 * alone) for some forty declarations, they would tie `pip install .` and the plain CMake build to
 * a network fetch, and a header of a newer toolkit names the *newest* ABI of each call
 * (cuMemPrefetchAsync, cuMemcpyBatchAsync and cuCtxSynchronize changed in CUDA 13), while pinmem
 * must call the ABI of the version it asks cuGetProcAddress for. The driver's ABI is stable by
 * NVIDIA's rules: a symbol requested at a given version keeps that signature in every later driver,
 * and enum values never change. So each signature below is the one the driver documents for the
 * version in its comment (the version passed to cuGetProcAddress in backend_cuda.c), and each
 * value is the documented one. No name here collides with cuda.h's (all carry a pm prefix), so a
 * test may compare them with a toolkit's header where one exists.
 */
#ifndef PINMEM_CUDA_DRIVER_H
#define PINMEM_CUDA_DRIVER_H

#include <stddef.h>
#include <stdint.h>

/* ---- handles and scalar types ------------------------------------------------------------ */
typedef int pmCUresult;                 /* CUresult (an enum: int-sized on every ABI we target) */
typedef int pmCUdevice;                 /* CUdevice_v1 */
typedef unsigned long long pmCUdeviceptr; /* CUdeviceptr_v2 (64-bit since CUDA 3.2) */
typedef struct CUctx_st *pmCUcontext;
typedef struct CUstream_st *pmCUstream; /* the same struct tag as cudaStream_t: pointers pass as is */
typedef struct CUevent_st *pmCUevent;
typedef struct CUmod_st *pmCUmodule;
typedef struct CUfunc_st *pmCUfunction;
typedef void (*pmCUhostFn)(void *user_data);

/* ---- CUresult values we name ------------------------------------------------------------- */
enum {
  PM_CUDA_SUCCESS = 0,
  PM_CUDA_ERROR_INVALID_VALUE = 1,
  PM_CUDA_ERROR_OUT_OF_MEMORY = 2,
  PM_CUDA_ERROR_NOT_INITIALIZED = 3,
  PM_CUDA_ERROR_STUB_LIBRARY = 34,
  PM_CUDA_ERROR_NO_DEVICE = 100,
  PM_CUDA_ERROR_INVALID_DEVICE = 101,
  PM_CUDA_ERROR_INVALID_CONTEXT = 201,
  PM_CUDA_ERROR_INVALID_HANDLE = 400,
  PM_CUDA_ERROR_NOT_FOUND = 500,
  PM_CUDA_ERROR_NOT_READY = 600,
  PM_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
  PM_CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
  PM_CUDA_ERROR_NOT_SUPPORTED = 801,
  PM_CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803,
};

/* ---- flags and attributes ------------------------------------------------------------------ */
enum { PM_CU_STREAM_NON_BLOCKING = 0x1 };
/* The handles CU_STREAM_LEGACY and CU_STREAM_PER_THREAD (cudaStreamLegacy, cudaStreamPerThread):
 * the current context's default streams, as NULL is; cuda.h defines them as pointer casts. */
enum { PM_CU_STREAM_LEGACY = 0x1, PM_CU_STREAM_PER_THREAD = 0x2 };
enum { PM_CU_EVENT_DEFAULT = 0x0, PM_CU_EVENT_DISABLE_TIMING = 0x2 };
enum { PM_CU_MEMHOSTALLOC_PORTABLE = 0x1, PM_CU_MEMHOSTALLOC_DEVICEMAP = 0x2,
       PM_CU_MEMHOSTALLOC_WRITECOMBINED = 0x4 };
enum { PM_CU_MEMHOSTREGISTER_PORTABLE = 0x1, PM_CU_MEMHOSTREGISTER_DEVICEMAP = 0x2,
       PM_CU_MEMHOSTREGISTER_READ_ONLY = 0x8 };
enum { PM_CU_MEM_ATTACH_GLOBAL = 0x1 };
#define PM_CU_DEVICE_CPU ((pmCUdevice)-1) /* cuMemPrefetchAsync (v8000): the host as target */

/* CUdevice_attribute */
enum {
  PM_CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY = 19,
  PM_CU_DEVICE_ATTRIBUTE_COMPUTE_MODE = 20,
  PM_CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33,
  PM_CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34,
  PM_CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT = 40,
  PM_CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41,
  PM_CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = 50,
  PM_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
  PM_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
  PM_CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY = 83,
  PM_CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS = 88,
  PM_CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS = 89,
  PM_CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91,
  PM_CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED = 99,
  PM_CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED = 113,
};
enum { PM_CU_COMPUTEMODE_PROHIBITED = 2 };

/* CUpointer_attribute and CUmemorytype */
enum {
  PM_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
  PM_CU_POINTER_ATTRIBUTE_IS_MANAGED = 8,
  PM_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
};
enum { PM_CU_MEMORYTYPE_HOST = 1, PM_CU_MEMORYTYPE_DEVICE = 2, PM_CU_MEMORYTYPE_ARRAY = 3,
       PM_CU_MEMORYTYPE_UNIFIED = 4 };

/* CUjit_option: the error log of a failed PTX load */
enum { PM_CU_JIT_ERROR_LOG_BUFFER = 5, PM_CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6 };

/* CUfunction_attribute: asking one loads the function (eagerly, even under lazy loading) */
enum { PM_CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0 };

/* cuGetProcAddress (v12000): flags and the symbol status */
enum { PM_CU_GET_PROC_ADDRESS_DEFAULT = 0 };
enum { PM_CU_GET_PROC_ADDRESS_SUCCESS = 0, PM_CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
       PM_CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2 };

/* cuMemcpyBatchAsync (v12080): CUmemLocation_v1 and CUmemcpyAttributes_v1 */
typedef struct pmCUmemLocation {
  int type; /* CUmemLocationType: 0 invalid (no hint), 1 device, 2 host */
  int id;
} pmCUmemLocation;
typedef struct pmCUmemcpyAttributes {
  int srcAccessOrder; /* CUmemcpySrcAccessOrder */
  pmCUmemLocation srcLocHint;
  pmCUmemLocation dstLocHint;
  unsigned int flags;
} pmCUmemcpyAttributes;
enum { PM_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1 };

/* ---- entry points (the version asked of cuGetProcAddress in a comment) ---------------------- */
/* Found by dlsym, before anything else: */
typedef pmCUresult (*pm_cuGetProcAddress_v12000_t)(const char *symbol, void **pfn, int version,
                                                   uint64_t flags, int *symbol_status);
typedef pmCUresult (*pm_cuGetProcAddress_v11030_t)(const char *symbol, void **pfn, int version,
                                                   uint64_t flags);
typedef pmCUresult (*pm_cuDriverGetVersion_t)(int *version);             /* 2020 */
typedef pmCUresult (*pm_cuInit_t)(unsigned int flags);                    /* 2000 */
/* Through cuGetProcAddress: */
typedef pmCUresult (*pm_cuGetErrorString_t)(pmCUresult e, const char **str); /* 6000 */
typedef pmCUresult (*pm_cuGetErrorName_t)(pmCUresult e, const char **str);   /* 6000 */
typedef pmCUresult (*pm_cuDeviceGetCount_t)(int *count);                      /* 2000 */
typedef pmCUresult (*pm_cuDeviceGet_t)(pmCUdevice *dev, int ordinal);         /* 2000 */
typedef pmCUresult (*pm_cuDeviceGetName_t)(char *name, int len, pmCUdevice dev); /* 2000 */
typedef pmCUresult (*pm_cuDeviceGetAttribute_t)(int *v, int attr, pmCUdevice dev); /* 2000 */
typedef pmCUresult (*pm_cuDeviceGetPCIBusId_t)(char *id, int len, pmCUdevice dev); /* 4010 */
typedef pmCUresult (*pm_cuDevicePrimaryCtxRetain_t)(pmCUcontext *ctx, pmCUdevice dev); /* 7000 */
typedef pmCUresult (*pm_cuCtxSetCurrent_t)(pmCUcontext ctx);                  /* 4000 */
typedef pmCUresult (*pm_cuCtxGetCurrent_t)(pmCUcontext *ctx);                 /* 4000 */
typedef pmCUresult (*pm_cuCtxGetDevice_t)(pmCUdevice *dev);                   /* 2000 */
typedef pmCUresult (*pm_cuCtxPushCurrent_t)(pmCUcontext ctx);             /* 4000 (_v2) */
typedef pmCUresult (*pm_cuCtxPopCurrent_t)(pmCUcontext *ctx);             /* 4000 (_v2) */
typedef pmCUresult (*pm_cuCtxSynchronize_t)(void);                            /* 2000 */
typedef pmCUresult (*pm_cuMemGetInfo_t)(size_t *free_b, size_t *total_b);     /* 3020 (_v2) */
typedef pmCUresult (*pm_cuMemHostAlloc_t)(void **p, size_t bytes, unsigned int flags); /* 2020 */
typedef pmCUresult (*pm_cuMemFreeHost_t)(void *p);                            /* 2000 */
typedef pmCUresult (*pm_cuMemHostRegister_t)(void *p, size_t bytes, unsigned int flags); /* 6050 */
typedef pmCUresult (*pm_cuMemHostUnregister_t)(void *p);                      /* 4000 */
typedef pmCUresult (*pm_cuMemHostGetDevicePointer_t)(pmCUdeviceptr *d, void *p,
                                                     unsigned int flags);    /* 3020 (_v2) */
typedef pmCUresult (*pm_cuMemAlloc_t)(pmCUdeviceptr *d, size_t bytes);        /* 3020 (_v2) */
typedef pmCUresult (*pm_cuMemFree_t)(pmCUdeviceptr d);                        /* 3020 (_v2) */
typedef pmCUresult (*pm_cuMemAllocManaged_t)(pmCUdeviceptr *d, size_t bytes,
                                             unsigned int flags);            /* 6000 */
typedef pmCUresult (*pm_cuMemsetD8Async_t)(pmCUdeviceptr d, unsigned char v, size_t n,
                                           pmCUstream s);                    /* 3020 */
typedef pmCUresult (*pm_cuMemPrefetchAsync_v8000_t)(pmCUdeviceptr d, size_t n, pmCUdevice dst,
                                                    pmCUstream s);          /* 8000 */
typedef pmCUresult (*pm_cuStreamCreate_t)(pmCUstream *s, unsigned int flags); /* 2000 */
typedef pmCUresult (*pm_cuStreamDestroy_t)(pmCUstream s);                     /* 4000 (_v2) */
typedef pmCUresult (*pm_cuStreamSynchronize_t)(pmCUstream s);                 /* 2000 */
typedef pmCUresult (*pm_cuStreamQuery_t)(pmCUstream s);                       /* 2000 */
typedef pmCUresult (*pm_cuStreamGetCtx_t)(pmCUstream s, pmCUcontext *ctx);    /* 9020 */
typedef pmCUresult (*pm_cuStreamWaitEvent_t)(pmCUstream s, pmCUevent e, unsigned int f); /* 3020 */
typedef pmCUresult (*pm_cuEventCreate_t)(pmCUevent *e, unsigned int flags);   /* 2000 */
typedef pmCUresult (*pm_cuEventDestroy_t)(pmCUevent e);                       /* 4000 (_v2) */
typedef pmCUresult (*pm_cuEventRecord_t)(pmCUevent e, pmCUstream s);          /* 2000 */
typedef pmCUresult (*pm_cuEventQuery_t)(pmCUevent e);                         /* 2000 */
typedef pmCUresult (*pm_cuEventSynchronize_t)(pmCUevent e);                   /* 2000 */
typedef pmCUresult (*pm_cuEventElapsedTime_t)(float *ms, pmCUevent a, pmCUevent b); /* 2000 */
typedef pmCUresult (*pm_cuMemcpyAsync_t)(pmCUdeviceptr dst, pmCUdeviceptr src, size_t n,
                                         pmCUstream s);                      /* 4000 */
typedef pmCUresult (*pm_cuMemcpyHtoDAsync_t)(pmCUdeviceptr dst, const void *src, size_t n,
                                             pmCUstream s);                  /* 3020 (_v2) */
typedef pmCUresult (*pm_cuMemcpyDtoHAsync_t)(void *dst, pmCUdeviceptr src, size_t n,
                                             pmCUstream s);                  /* 3020 (_v2) */
typedef pmCUresult (*pm_cuMemcpyDtoDAsync_t)(pmCUdeviceptr dst, pmCUdeviceptr src, size_t n,
                                             pmCUstream s);                  /* 3020 (_v2) */
typedef pmCUresult (*pm_cuLaunchHostFunc_t)(pmCUstream s, pmCUhostFn fn, void *arg); /* 10000 */
typedef pmCUresult (*pm_cuPointerGetAttributes_t)(unsigned int n, int *attrs, void **data,
                                                  pmCUdeviceptr p);          /* 7000 */
typedef pmCUresult (*pm_cuModuleLoadDataEx_t)(pmCUmodule *m, const void *image, unsigned int n,
                                              int *options, void **values);  /* 2010 */
typedef pmCUresult (*pm_cuModuleGetFunction_t)(pmCUfunction *f, pmCUmodule m,
                                               const char *name);            /* 2000 */
typedef pmCUresult (*pm_cuFuncGetAttribute_t)(int *v, int attr, pmCUfunction f); /* 2020 */
typedef pmCUresult (*pm_cuLaunchKernel_t)(pmCUfunction f, unsigned int gx, unsigned int gy,
                                          unsigned int gz, unsigned int bx, unsigned int by,
                                          unsigned int bz, unsigned int shmem, pmCUstream s,
                                          void **params, void **extra);      /* 4000 */
/* Optional (a driver may lack it): */
typedef pmCUresult (*pm_cuMemcpyBatchAsync_v12080_t)(pmCUdeviceptr *dsts, pmCUdeviceptr *srcs,
                                                     size_t *sizes, size_t count,
                                                     pmCUmemcpyAttributes *attrs,
                                                     size_t *attr_idxs, size_t num_attrs,
                                                     size_t *fail_idx, pmCUstream s); /* 12080 */

#endif /* PINMEM_CUDA_DRIVER_H */
