/*
 * DESIGN: pinmem._pinmem, the CPython extension over libpinmem (linked in statically), and the
 * private header its files share: the types more than one of them uses, and the functions and
 * type objects one file takes from another (prefix pmpy_, hidden: the module exports
 * PyInit__pinmem alone), each documented where it is defined. What a single file uses stays
 * static there.
 *
 * Objects. A Buffer (base type of PinnedBuffer and DeviceBuffer) owns one piece of memory: a
 * block of the default pool (empty), a registration of memory someone else owns (pin: the Buffer
 * also holds that object's buffer export or DLPack tensor, so the memory can neither move nor
 * vanish while it is pinned), or device memory (device_empty). Every consumer holds a strong
 * reference to the Buffer: a memoryview or NumPy array through the buffer protocol, a DLPack
 * tensor through its manager_ctx, a copy in flight through its Completion. So the memory is freed
 * or unpinned when the last of them lets go (Python's refcount), never earlier. `exports` counts
 * the live consumers so that an explicit release() can refuse (BusyError) while any exists.
 *
 * Threads. Everything runs under the GIL except pinmem calls that may block or take long
 * (pinning, unpinning, waits, staged copies, stream destruction), which release it; whatever
 * they touch is kept alive by references taken before, and a pinmem.Stream argument also by a
 * use that defers its close() (pmpy_stream_take). DLPack deleters may run on any thread and
 * take the GIL. A fence is released only by the last thread that waited on it (Completion.busy).
 *
 * Files, in the order of the layers (each uses only those above it):
 *   exceptions.c  pinmem.Error, one exception per status, the raise helpers
 *   helpers.c     small parsers and checks (sizes, addresses, overflow, object formats)
 *   dtypes.c      the element types and their names in NumPy, struct formats and DLPack
 *   streams.c     pinmem.Stream and the stream argument parser
 *   dlpack.c      Buffer.__dlpack__, a device buffer's ready event, importing DLPack tensors
 *   buffers.c     Buffer, PinnedBuffer, DeviceBuffer: descriptor, release, buffer protocol
 *   empty_pin.c   empty, device_empty, pin
 *   copy.c        copy and its Completion, parked copies
 *   files.c       file <-> memory transfers (read_file, write_file) with a Completion
 *   datasets.c    the dataset constructors and _Dataset
 *   procs.c       datasets read by worker processes (channels, claims, their errors)
 *   loader.c      _Loader and its batches (batch_layout.h describes their buffers)
 *   pool.c        the default pool, options, introspection
 *   blocks.c      the KV-cache block store's low level (_BlockStore, BlocksEvent)
 *   devcache.c    _DeviceCache: device blocks reused across an iterable loader's batches
 *   _pinmem.c     the module: types, functions of each file, exceptions, constants
 */
#ifndef PINMEM_PY_PINMEM_H
#define PINMEM_PY_PINMEM_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h> /* getpid: the process that made a Buffer */

#include <dlpack/dlpack.h>

#include "pinmem.h"

#if defined(DLPACK_MAJOR_VERSION) && DLPACK_MAJOR_VERSION >= 1
/* dlpack >= 1.0: versioned capsules for consumers that ask (max_version >= (1, 0)); they can
 * say read-only, and NumPy makes writable arrays of them. Legacy capsules for the others. */
#define PMPY_DLPACK_VERSIONED 1
#elif !defined(DLPACK_VERSION) || DLPACK_VERSION < 60
#error "pinmem needs dlpack.h 0.6 or newer (kDLCUDA, kDLCUDAHost); set PINMEM_DLPACK_INCLUDE_DIR"
#endif

#define PMPY_MAX_NDIM 64

#pragma GCC visibility push(hidden)

/* ---- exceptions.c ------------------------------------------------------------------------- */

PyObject *pmpy_raise_detail(pm_status_t st, const char *detail);
PyObject *pmpy_raise_status(pm_status_t st);
PyObject *pmpy_raise_fmt(pm_status_t st, const char *fmt, ...);
int pmpy_init_exceptions(PyObject *m);

/* ---- helpers.c ---------------------------------------------------------------------------- */

int pmpy_interp_finalizing(void);
int pmpy_is_cuda_backend(void);
int pmpy_parse_size_obj(PyObject *o, size_t *out);
int pmpy_checked_mul(size_t *n, size_t factor);
int pmpy_format_has_objects(const char *f);
int pmpy_buffer_holds_objects(PyObject *o);
int pmpy_parse_address(PyObject *o, uintptr_t *out);

/* ---- dtypes.c ----------------------------------------------------------------------------- */

typedef struct pmpy_dtype {
  const char *name;   /* NumPy's name */
  const char *format; /* buffer-protocol (struct) format */
  char kind;          /* NumPy's kind letter */
  uint8_t code;       /* DLDataTypeCode */
  uint8_t bits;
} pmpy_dtype_t;

const pmpy_dtype_t *pmpy_dtype_by_dl(DLDataType t);
const pmpy_dtype_t *pmpy_dtype_from_format(const char *f, Py_ssize_t itemsize);
const pmpy_dtype_t *pmpy_dtype_from_text(const char *s);
const pmpy_dtype_t *pmpy_parse_dtype(PyObject *o);

/* ---- streams.c ---------------------------------------------------------------------------- */

extern PyTypeObject pmpy_StreamType;
/* A stream argument, held for the call (a pinmem.Stream cannot be destroyed under it): each
 * successful take is paired with a drop of the same object after the last use of the handle,
 * also on the error paths. */
int pmpy_stream_take(PyObject *o, pm_stream_t *out);
void pmpy_stream_drop(PyObject *o);

/* ---- buffers.c ---------------------------------------------------------------------------- */

typedef enum { BUF_POOL = 0, BUF_REGISTERED = 1, BUF_DEVICE = 2, BUF_EXTERNAL = 3 } buf_kind_t;
extern const char *const pmpy_kind_names[];

typedef struct BufferObject {
  PyObject_HEAD void *ptr; /* NULL once released */
  size_t nbytes;           /* bytes of the array (may be 0) */
  int kind;                /* buf_kind_t */
  int readonly;
  int released;
  int ndim;
  int ndim_cap;        /* dimensions `shape` has room for (>= ndim, >= 1) */
  Py_ssize_t itemsize;
  Py_ssize_t *shape;   /* ndim_cap entries, then ndim_cap strides (bytes); PyMem */
  char *format;        /* struct format for the buffer protocol; PyMem */
  const pmpy_dtype_t *dtype; /* NULL when the format has no DLPack equivalent */
  int dl_device_type, dl_device_id;
  Py_ssize_t exports;  /* live consumers: buffer views, DLPack tensors, copies in flight */
  /* pin(): what keeps the pinned memory in place */
  PyObject *base;          /* the pinned object (or None) */
  Py_buffer src_view;      /* its buffer export, when pinned through the buffer protocol */
  int has_src_view;
  DLManagedTensor *src_dl; /* its DLPack tensor, when pinned through __dlpack__ */
  int host_visible;         /* the CPU may read it (buffer protocol) */
  /* device memory: the last pinmem write, for DLPack stream semantics */
  pm_event_t ready;
  int ready_recorded;
  int ready_owned; /* ours to destroy (not a loader's batch event) */
  /* external memory (a loader's batch): `keep` owns it; on_release runs when this view goes */
  PyObject *keep;
  void (*on_release)(struct BufferObject *self);
  uintptr_t consumer_stream; /* the last stream a DLPack consumer named (device memory) */
  int has_consumer_stream;
  /* device memory reused once its views are gone (_buffer_view, _buffer_reuse): recorded on
   * the consumer stream each view's DLPack consumer named, as that view went */
  pm_event_t views_gone;
  uintptr_t views_gone_stream;
  int views_gone_recorded;
  int reuse_unsafe; /* views consumed on two streams, or an event failed: never reused */
  PyObject *weakrefs;
  long pid; /* the process that made it: in a forked child, dropping it only forgets the memory */
} BufferObject;

extern PyTypeObject pmpy_BufferType, pmpy_PinnedBufferType, pmpy_DeviceBufferType;

#define Buffer_Check(o) PyObject_TypeCheck((o), &pmpy_BufferType)

/* The strides sit after room for ndim_cap dimensions, so changing ndim never moves them. */
static inline Py_ssize_t *pmpy_buf_strides(BufferObject *b) { return b->shape + b->ndim_cap; }

/* PySequence_Fast, but always a tuple: a list is copied first, so Python code that runs while the
 * items are read (an __index__, a __dlpack__, a buffer export) cannot shrink it under the loop;
 * the tuple holds every item. msg: the TypeError's text when o is no sequence. */
static inline PyObject *pmpy_fast_tuple(PyObject *o, const char *msg) {
  PyObject *seq = PySequence_Fast(o, msg);
  if (!seq || PyTuple_CheckExact(seq)) return seq;
  PyObject *t = PySequence_Tuple(seq);
  Py_DECREF(seq);
  return t;
}

pm_status_t pmpy_buffer_release_memory(BufferObject *b);
int pmpy_buffer_set_ndim(BufferObject *b, int ndim);
BufferObject *pmpy_buffer_alloc(PyTypeObject *type, int ndim);
int pmpy_buffer_set_format(BufferObject *b, const char *format);
int pmpy_buffer_set_c_strides(BufferObject *b, size_t *nbytes_out);
int pmpy_parse_shape(PyObject *o, Py_ssize_t *dims, int *ndim_out);
BufferObject *pmpy_buffer_shaped(PyTypeObject *type, PyObject *shape_obj, PyObject *dtype_obj,
                                 size_t *nbytes_out);
int pmpy_buffer_check_live(BufferObject *b);

/* ---- dlpack.c ----------------------------------------------------------------------------- */

int pmpy_buffer_order_before(BufferObject *b, pm_stream_t stream);
int pmpy_buffer_record_write(BufferObject *b, pm_stream_t stream);
PyObject *pmpy_Buffer_dlpack(BufferObject *self, PyObject *args, PyObject *kw);
PyObject *pmpy_Buffer_dlpack_device(BufferObject *self, PyObject *unused);
int pmpy_dl_device_of(PyObject *o, int *type, int *id);
DLManagedTensor *pmpy_dl_import(PyObject *o, pm_stream_t stream, int resolve,
                                 const char *what);
int pmpy_dl_compact_bytes(const DLTensor *t, size_t *bytes_out);

/* ---- copy.c ------------------------------------------------------------------------------- */

/* What keeps one side of a copy (or file transfer) alive until it is done. */
typedef struct pmpy_holder {
  PyObject *obj;       /* strong reference */
  BufferObject *buf;   /* obj is a Buffer: its exports count this copy */
  Py_buffer view;
  int has_view;
  DLManagedTensor *dl; /* imported through DLPack: ours to delete */
} pmpy_holder_t;

extern PyTypeObject pmpy_CompletionType;
void pmpy_pending_sweep(int wait);
int pmpy_resolve_side(PyObject *o, int writable, pm_stream_t stream, const char *what,
                      pmpy_holder_t *h, void **ptr, size_t *bytes);
void pmpy_holder_release(pmpy_holder_t *h);
PyObject *pmpy_completion_new(pm_fence_t fence, pmpy_holder_t *hold, PyObject *stream_obj);

/* ---- datasets.c --------------------------------------------------------------------------- */

/* A pm_dataset_t plus what its samples come from: .npy or token files (the C library reads
 * them), in-memory arrays (one per field, read without the GIL), a Python fetch(index) function
 * returning every field of a sample (called once per sample from the loader's worker threads,
 * which take the GIL for it), or a zip of such datasets (the fields side by side). */
typedef struct {
  PyObject_HEAD pm_dataset_t *ds;
  int nviews;      /* array datasets: the arrays, exported for the dataset's life */
  Py_buffer views[PM_MAX_FIELDS];
  int nfields;
  size_t fbytes[PM_MAX_FIELDS]; /* bytes of field k of one sample */
  PyObject *fetch; /* Python datasets: fetch(index) -> a sequence of nfields buffers */
  /* Python datasets: {sample index: (type, value, traceback)}, the first exception the fetch of
   * each sample raised (several reader threads fail at once; next() re-raises the one of the
   * sample whose read failed); NULL until one is raised. */
  PyObject *errors;
  PyObject *parts;  /* zips and selects: the datasets used (kept alive with this one) */
  PyObject *select; /* selects: bytes of the uint64 indices into parts[0] (to map an index) */
  struct pmpy_procs *procs; /* worker-process datasets: the channels (procs.c) */
} DatasetObject;

extern PyTypeObject pmpy_DatasetType;
/* The exception the read of sample `index` raised (PMPY_ANY_SAMPLE: the lowest index's), taken
 * out; NULL if none. */
#define PMPY_ANY_SAMPLE UINT64_MAX
PyObject *pmpy_dataset_take_error(DatasetObject *d, uint64_t index);
/* Forget every exception d (and its parts) keep. */
void pmpy_dataset_clear_errors(DatasetObject *d);
DatasetObject *pmpy_dataset_new(void);
int pmpy_field_spec(int k, const char *descr, size_t itemsize, int ndim, const Py_ssize_t *shape,
                    pm_field_t *f);
int pmpy_parse_spec(PyObject *spec, int k, pm_field_t *f, size_t *bytes_out);

/* ---- procs.c ------------------------------------------------------------------------------ */

struct pmpy_procs;
void pmpy_procs_free(struct pmpy_procs *p);
/* The error a worker process reported (or its death, a timeout), as the (type, value,
 * traceback) triple datasets keep; NULL if none. Needs the GIL. */
PyObject *pmpy_procs_take_error(DatasetObject *d);
extern PyMethodDef pmpy_procs_functions[];

/* ---- loader.c ----------------------------------------------------------------------------- */

extern PyTypeObject pmpy_LoaderType, pmpy_BatchType;

/* ---- the module functions of each file, added by _pinmem.c -------------------------------- */

extern PyMethodDef pmpy_empty_pin_functions[];
extern PyMethodDef pmpy_copy_functions[];
extern PyMethodDef pmpy_files_functions[];
extern PyMethodDef pmpy_pool_functions[];
extern PyMethodDef pmpy_datasets_functions[];
extern PyMethodDef pmpy_loader_functions[];
extern PyMethodDef pmpy_streams_functions[];

/* ---- blocks.c ---------------------------------------------------------------------------- */

/* Ready _BlockStore and BlocksEvent and add them to the module. */
int pmpy_blocks_add_types(PyObject *m);

/* ---- devcache.c -------------------------------------------------------------------------- */

/* Ready _DeviceCache and add it and its functions to the module. */
int pmpy_devcache_add(PyObject *m);

#pragma GCC visibility pop

#endif /* PINMEM_PY_PINMEM_H */
