/*
 * DESIGN: pinmem._pinmem, the CPython extension over libpinmem (linked in statically).
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
 * Copies. copy() turns each side into (pointer, bytes, holder): a Buffer, anything with the
 * buffer protocol, a __dlpack__ producer or a __cuda_array_interface__ object. A Completion owns
 * the fence and both holders and drops the holders once the fence completed. A Completion that is
 * dropped before that parks fence and holders on a pending list, which later calls sweep and exit
 * waits for: the memory of a copy in flight is never given back early.
 *
 * DLPack. dlpack.h 0.6 (Debian 12's libdlpack-dev) or newer: legacy "dltensor" capsules, and
 * with a 1.x header also "dltensor_versioned" ones for consumers that pass max_version >= (1, 0)
 * (they carry a read-only flag; NumPy makes arrays of legacy capsules read-only). Pinned
 * host memory is exported as kDLCPU although kDLCUDAHost names it more precisely: numpy.from_dlpack
 * accepts only kDLCPU, and to every consumer pinned memory is CPU memory it may read and write in
 * place. A consumer that wants the precise type asks for it with dl_device=(kDLCUDAHost, 0) (cuda
 * backend). Device memory is kDLCUDA under the cuda backend; under the host backend it is plain
 * host memory and exported as kDLCPU. A device Buffer remembers, in an event, the last pinmem work
 * that writes it (copy, fill, loader batch); __dlpack__(stream=s) makes stream s wait for that
 * event without blocking the caller, as the DLPack protocol asks of producers.
 *
 * Read-only memory (pin of bytes, a read-only array) is exported through the buffer protocol as
 * read-only; a legacy DLPack tensor cannot say "read-only", so __dlpack__ refuses it then (as
 * NumPy does) and exports it only as a versioned tensor with the read-only flag.
 *
 * Threads. Everything runs under the GIL except pinmem calls that may block or take long
 * (pinning, unpinning, waits, staged copies, stream destruction), which release it; whatever
 * they touch is kept alive by references taken before. DLPack deleters may run on any thread and
 * take the GIL. A fence is released only by the last thread that waited on it (Completion.busy).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <stdint.h>
#include <string.h>

#include <dlpack/dlpack.h>

#include "batch_layout.h"
#include "pinmem.h"

#if defined(DLPACK_MAJOR_VERSION) && DLPACK_MAJOR_VERSION >= 1
/* dlpack >= 1.0: versioned capsules for consumers that ask (max_version >= (1, 0)); they can
 * say read-only, and NumPy makes writable arrays of them. Legacy capsules for the others. */
#define PMPY_DLPACK_VERSIONED 1
#elif !defined(DLPACK_VERSION) || DLPACK_VERSION < 60
#error "pinmem needs dlpack.h 0.6 or newer (kDLCUDA, kDLCUDAHost); set PINMEM_DLPACK_INCLUDE_DIR"
#endif

/* kDLBool entered DLPack in 0.8; the value is fixed by the standard, so bool arrays round-trip
 * with consumers that know it even when built against the 0.6 header. */
#define PMPY_DL_BOOL 6

#define PMPY_MAX_NDIM 64

/* ------------------------------------------------------------------------------------------ */
/* Exceptions                                                                                  */
/* ------------------------------------------------------------------------------------------ */

#define PMPY_NSTATUS 32
static PyObject *g_error;                  /* pinmem.Error */
static PyObject *g_status_exc[PMPY_NSTATUS]; /* indexed by -status, for the errors */

static PyObject *exc_for(pm_status_t st) {
  if (st < 0 && -st < PMPY_NSTATUS && g_status_exc[-st]) return g_status_exc[-st];
  return g_error;
}

/* Raise the exception of `st` with `detail`: str(e) is "PM_ERR_X: <fixed message>: <detail>";
 * e.status is the name, e.code the number, e.message the detail. Returns NULL. */
static PyObject *raise_detail(pm_status_t st, const char *detail) {
  PyObject *cls = exc_for(st);
  PyObject *text = PyUnicode_FromFormat("%s: %s%s%s", pm_status_name(st), pm_strerror(st),
                                        detail && *detail ? ": " : "", detail ? detail : "");
  if (!text) return NULL;
  PyObject *exc = PyObject_CallOneArg(cls, text);
  Py_DECREF(text);
  if (!exc) return NULL;
  PyObject *name = PyUnicode_FromString(pm_status_name(st));
  PyObject *code = PyLong_FromLong((long)st);
  PyObject *msg = PyUnicode_FromString(detail ? detail : "");
  int bad = !name || !code || !msg || PyObject_SetAttrString(exc, "status", name) < 0 ||
            PyObject_SetAttrString(exc, "code", code) < 0 ||
            PyObject_SetAttrString(exc, "message", msg) < 0;
  Py_XDECREF(name);
  Py_XDECREF(code);
  Py_XDECREF(msg);
  if (bad) {
    Py_DECREF(exc);
    return NULL;
  }
  PyErr_SetObject(cls, exc);
  Py_DECREF(exc);
  return NULL;
}

/* After a failed pinmem call on this thread: pm_last_error() holds the detail. */
static PyObject *raise_status(pm_status_t st) { return raise_detail(st, pm_last_error()); }

/* A pinmem-style error found by this module itself. */
static PyObject *raise_fmt(pm_status_t st, const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  PyOS_vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return raise_detail(st, buf);
}

/* "PM_ERR_DOUBLE_FREE" -> "DoubleFreeError". */
static void exc_class_name(const char *status_name, char *out, size_t len) {
  const char *p = status_name + strlen("PM_ERR_");
  size_t n = 0;
  int up = 1;
  for (; *p && n + 6 < len; p++) {
    if (*p == '_') {
      up = 1;
      continue;
    }
    out[n++] = up ? *p : (char)(*p - 'A' + 'a');
    up = 0;
  }
  memcpy(out + n, "Error", 6);
}

static int init_exceptions(PyObject *m) {
  g_error = PyErr_NewExceptionWithDoc(
      "pinmem.Error",
      "Base of every pinmem error. Attributes: status (the status name, e.g. 'PM_ERR_BUDGET'), "
      "code (its number) and message (the detail: the failing call, the limit, the values).",
      NULL, NULL);
  if (!g_error || PyModule_AddObjectRef(m, "Error", g_error) < 0) return -1;
  static const struct {
    pm_status_t st;
  } all[] = {
#define PMPY_ST(name, value, msg) {name},
      PM_STATUS_MAP(PMPY_ST)
#undef PMPY_ST
  };
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
    pm_status_t st = all[i].st;
    if (st >= 0 || -st >= PMPY_NSTATUS) continue;
    char cls[64], qual[96], doc[160];
    exc_class_name(pm_status_name(st), cls, sizeof cls);
    snprintf(qual, sizeof qual, "pinmem.%s", cls);
    snprintf(doc, sizeof doc, "%s: %s.", pm_status_name(st), pm_strerror(st));
    /* A second, built-in base where one means the same, so `except ValueError` works too. */
    PyObject *extra = NULL;
    if (st == PM_ERR_INVALID || st == PM_ERR_CONFIG) extra = PyExc_ValueError;
    if (st == PM_ERR_NOMEM || st == PM_ERR_DEVICE_MEMORY) extra = PyExc_MemoryError;
    if (st == PM_ERR_TIMEOUT) extra = PyExc_TimeoutError;
    PyObject *bases = extra ? PyTuple_Pack(2, g_error, extra) : PyTuple_Pack(1, g_error);
    if (!bases) return -1;
    PyObject *e = PyErr_NewExceptionWithDoc(qual, doc, bases, NULL);
    Py_DECREF(bases);
    if (!e) return -1;
    g_status_exc[-st] = e;
    if (PyModule_AddObjectRef(m, cls, e) < 0) return -1;
  }
  /* The status codes as module constants (PM_OK, PM_ERR_STATE, ...), from the same X-macro as
   * the C status map, so Python code names a status instead of writing its number. */
#define PMPY_ST_CONST(name, value, msg) \
  if (PyModule_AddIntConstant(m, #name, (long)(value)) < 0) return -1;
  PM_STATUS_MAP(PMPY_ST_CONST)
#undef PMPY_ST_CONST
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Small helpers                                                                               */
/* ------------------------------------------------------------------------------------------ */

static int interp_finalizing(void) {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

static int is_cuda_backend(void) { return pm_backend_kind() == PM_BACKEND_CUDA; }

/* 1 if the int o is negative, 0 if not, -1 on error. */
static int long_negative(PyObject *o) {
  PyObject *zero = PyLong_FromLong(0);
  if (!zero) return -1;
  int r = PyObject_RichCompareBool(o, zero, Py_LT);
  Py_DECREF(zero);
  return r;
}

/* A size: an int, or a string such as "64K", "1.5M", "2G" (pm_parse_size). */
static int parse_size_obj(PyObject *o, size_t *out) {
  if (PyUnicode_Check(o)) {
    const char *s = PyUnicode_AsUTF8(o);
    if (!s) return -1;
    pm_status_t st = pm_parse_size(s, out);
    if (st != PM_OK) {
      raise_status(st);
      return -1;
    }
    return 0;
  }
  if (PyLong_Check(o)) {
    int neg = long_negative(o);
    if (neg) {
      if (neg > 0) raise_fmt(PM_ERR_INVALID, "a size cannot be negative");
      return -1;
    }
    size_t v = PyLong_AsSize_t(o);
    if (v == (size_t)-1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
  }
  PyErr_Format(PyExc_TypeError, "a size must be an int or a string like '64M', not %.100s",
               Py_TYPE(o)->tp_name);
  return -1;
}

/* *n *= factor, refused (PM_ERR_INVALID) when the product does not fit in memory's sizes. */
static int checked_mul(size_t *n, size_t factor) {
  if (factor && *n > (size_t)PY_SSIZE_T_MAX / factor) {
    raise_fmt(PM_ERR_INVALID, "the shape is too large for memory (its byte count overflows)");
    return -1;
  }
  *n *= factor;
  return 0;
}

/* Does a struct format hold Python object pointers ('O', also as a field of a record)? Their
 * bytes are references: copied or pinned as plain bytes they would be freed twice. Field names
 * (between colons) are skipped. */
static int format_has_objects(const char *f) {
  for (int in_name = 0; f && *f; f++) {
    if (*f == ':') in_name = !in_name;
    else if (!in_name && *f == 'O') return 1;
  }
  return 0;
}

/* Does `o` export Python object pointers through the buffer protocol? (A request with the
 * format; exporters that cannot describe theirs, e.g. NumPy's datetime64, hold none.) */
static int buffer_holds_objects(PyObject *o) {
  Py_buffer v;
  if (PyObject_GetBuffer(o, &v, PyBUF_RECORDS_RO) < 0) {
    PyErr_Clear();
    return 0;
  }
  int r = format_has_objects(v.format);
  PyBuffer_Release(&v);
  return r;
}

/* An address given as an int (pointers of other libraries: data_ptr(), stream handles). */
static int parse_address(PyObject *o, uintptr_t *out) {
  if (!PyLong_Check(o)) {
    PyErr_Format(PyExc_TypeError, "expected an int address, not %.100s", Py_TYPE(o)->tp_name);
    return -1;
  }
  int neg = long_negative(o);
  if (neg < 0) return -1;
  if (neg) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = (uintptr_t)(intptr_t)v;
    return 0;
  }
  unsigned long long v = PyLong_AsUnsignedLongLong(o);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
  *out = (uintptr_t)v;
  return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Dtypes                                                                                      */
/* ------------------------------------------------------------------------------------------ */

typedef struct pmpy_dtype {
  const char *name;   /* NumPy's name */
  const char *format; /* buffer-protocol (struct) format */
  char kind;          /* NumPy's kind letter */
  uint8_t code;       /* DLDataTypeCode */
  uint8_t bits;
} pmpy_dtype_t;

static const pmpy_dtype_t g_dtypes[] = {
    {"bool", "?", 'b', PMPY_DL_BOOL, 8},  {"int8", "b", 'i', kDLInt, 8},
    {"uint8", "B", 'u', kDLUInt, 8},      {"int16", "h", 'i', kDLInt, 16},
    {"uint16", "H", 'u', kDLUInt, 16},    {"int32", "i", 'i', kDLInt, 32},
    {"uint32", "I", 'u', kDLUInt, 32},    {"int64", "q", 'i', kDLInt, 64},
    {"uint64", "Q", 'u', kDLUInt, 64},    {"float16", "e", 'f', kDLFloat, 16},
    {"float32", "f", 'f', kDLFloat, 32},  {"float64", "d", 'f', kDLFloat, 64},
    {"complex64", "Zf", 'c', kDLComplex, 64}, {"complex128", "Zd", 'c', kDLComplex, 128},
};
#define PMPY_NDTYPES (sizeof g_dtypes / sizeof g_dtypes[0])

static const pmpy_dtype_t *dtype_by_kind(char kind, unsigned bytes) {
  for (size_t i = 0; i < PMPY_NDTYPES; i++)
    if (g_dtypes[i].kind == kind && g_dtypes[i].bits == bytes * 8) return &g_dtypes[i];
  return NULL;
}

static const pmpy_dtype_t *dtype_by_dl(DLDataType t) {
  if (t.lanes != 1) return NULL;
  for (size_t i = 0; i < PMPY_NDTYPES; i++)
    if (g_dtypes[i].code == t.code && g_dtypes[i].bits == t.bits) return &g_dtypes[i];
  return NULL;
}

static int little_endian(void) {
  const uint16_t one = 1;
  return *(const uint8_t *)&one == 1;
}

/* A struct format as a buffer exporter gives it ("f", "<d", "Zf", "=q") -> dtype, or NULL. */
static const pmpy_dtype_t *dtype_from_format(const char *f, Py_ssize_t itemsize) {
  if (!f) f = "B";
  if (*f == '@' || *f == '=' || (*f == '<' && little_endian()) || (*f == '>' && !little_endian()) ||
      (*f == '!' && !little_endian()))
    f++;
  int cplx = 0;
  if (*f == 'Z') {
    cplx = 1;
    f++;
  }
  if (!*f || f[1]) return NULL;
  char kind;
  unsigned bytes;
  switch (*f) {
    case '?': kind = 'b'; bytes = 1; break;
    case 'b': kind = 'i'; bytes = 1; break;
    case 'B': kind = 'u'; bytes = 1; break;
    case 'h': kind = 'i'; bytes = sizeof(short); break;
    case 'H': kind = 'u'; bytes = sizeof(short); break;
    case 'i': kind = 'i'; bytes = sizeof(int); break;
    case 'I': kind = 'u'; bytes = sizeof(int); break;
    case 'l': kind = 'i'; bytes = sizeof(long); break;
    case 'L': kind = 'u'; bytes = sizeof(long); break;
    case 'q': kind = 'i'; bytes = sizeof(long long); break;
    case 'Q': kind = 'u'; bytes = sizeof(long long); break;
    case 'n': kind = 'i'; bytes = sizeof(Py_ssize_t); break;
    case 'N': kind = 'u'; bytes = sizeof(size_t); break;
    case 'e': kind = 'f'; bytes = 2; break;
    case 'f': kind = 'f'; bytes = 4; break;
    case 'd': kind = 'f'; bytes = 8; break;
    default: return NULL;
  }
  if (cplx) {
    if (kind != 'f' || bytes < 4) return NULL;
    kind = 'c';
    bytes *= 2;
  }
  const pmpy_dtype_t *d = dtype_by_kind(kind, bytes);
  if (d && itemsize > 0 && (Py_ssize_t)(d->bits / 8) != itemsize) return NULL;
  return d;
}

/* A dtype given as text: a NumPy name ("float32"), a torch name ("torch.float32"), an array
 * interface type string ("<f4", "|u1", "f4") or a one-letter struct code ("f"). */
static const pmpy_dtype_t *dtype_from_text(const char *s) {
  static const struct {
    const char *alias, *name;
  } aliases[] = {{"bool_", "bool"},       {"half", "float16"},      {"single", "float32"},
                 {"double", "float64"},   {"float", "float64"},     {"int", "int64"},
                 {"long", "int64"},       {"short", "int16"},       {"byte", "int8"},
                 {"ubyte", "uint8"},      {"csingle", "complex64"}, {"cdouble", "complex128"},
                 {"complex", "complex128"}};
  if (!strncmp(s, "torch.", 6)) s += 6; /* str(torch.float32); torch's own names are canonical */
  for (size_t i = 0; i < PMPY_NDTYPES; i++)
    if (!strcmp(s, g_dtypes[i].name)) return &g_dtypes[i];
  for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++)
    if (!strcmp(s, aliases[i].alias)) return dtype_from_text(aliases[i].name);
  /* Array interface type strings. */
  const char *p = s;
  int swapped = 0;
  if (*p == '<' || *p == '>' || *p == '=' || *p == '|') {
    swapped = (*p == '<' && !little_endian()) || (*p == '>' && little_endian());
    p++;
  }
  if (*p && strchr("biufc", *p) && p[1] >= '1' && p[1] <= '9') {
    char *end;
    long bytes = strtol(p + 1, &end, 10);
    if (*end || bytes <= 0 || bytes > 16) return NULL;
    if (swapped && bytes > 1) return NULL;
    return dtype_by_kind(*p, (unsigned)bytes);
  }
  return NULL;
}

static const pmpy_dtype_t *parse_dtype(PyObject *o) {
  if (!PyUnicode_Check(o)) {
    PyErr_Format(PyExc_TypeError, "dtype must be a string here, not %.100s", Py_TYPE(o)->tp_name);
    return NULL;
  }
  const char *s = PyUnicode_AsUTF8(o);
  if (!s) return NULL;
  const pmpy_dtype_t *d = dtype_from_text(s);
  if (!d && strlen(s) == 1) d = dtype_from_format(s, 0); /* a one-letter struct code */
  if (!d) {
    raise_fmt(PM_ERR_INVALID,
              "unsupported dtype '%.60s' (supported: bool, int8..int64, uint8..uint64, float16, "
              "float32, float64, complex64, complex128)",
              s);
    return NULL;
  }
  return d;
}

/* ------------------------------------------------------------------------------------------ */
/* Streams                                                                                     */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
  PyObject_HEAD pm_stream_t stream;
  int live;
} StreamObject;

static PyTypeObject StreamType;

/* A stream argument: None (the default stream), a pinmem.Stream, an int handle (a cudaStream_t
 * under the cuda backend), or an object with .cuda_stream (torch.cuda.Stream) or .ptr (CuPy).
 * DLPack's 1 (legacy default) and 2 (per-thread default) stay themselves under the cuda backend,
 * where they are cudaStreamLegacy and cudaStreamPerThread; under the host backend they and 0 mean
 * the default stream. */
static int parse_stream(PyObject *o, pm_stream_t *out) {
  if (o == NULL || o == Py_None) {
    *out = NULL;
    return 0;
  }
  if (PyObject_TypeCheck(o, &StreamType)) {
    StreamObject *s = (StreamObject *)o;
    if (!s->live) {
      raise_fmt(PM_ERR_STATE, "the pinmem.Stream was closed");
      return -1;
    }
    *out = s->stream;
    return 0;
  }
  PyObject *h = NULL;
  if (PyLong_Check(o)) {
    h = Py_NewRef(o);
  } else if (PyObject_HasAttrString(o, "cuda_stream")) {
    h = PyObject_GetAttrString(o, "cuda_stream");
  } else if (PyObject_HasAttrString(o, "ptr")) {
    h = PyObject_GetAttrString(o, "ptr");
  } else {
    PyErr_Format(PyExc_TypeError,
                 "stream must be None, a pinmem.Stream, an int handle or an object with "
                 ".cuda_stream or .ptr, not %.100s",
                 Py_TYPE(o)->tp_name);
    return -1;
  }
  if (!h) return -1;
  uintptr_t v;
  int rc = parse_address(h, &v);
  Py_DECREF(h);
  if (rc < 0) return -1;
  if (v == 0 || ((v == 1 || v == 2) && !is_cuda_backend()))
    *out = NULL;
  else
    *out = (pm_stream_t)v;
  return 0;
}

static PyObject *Stream_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {NULL};
  if (!PyArg_ParseTupleAndKeywords(args, kw, ":Stream", kwlist)) return NULL;
  StreamObject *self = (StreamObject *)type->tp_alloc(type, 0);
  if (!self) return NULL;
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_stream_create(&self->stream);
  Py_END_ALLOW_THREADS if (st != PM_OK) {
    Py_DECREF(self);
    return raise_status(st);
  }
  self->live = 1;
  return (PyObject *)self;
}

static pm_status_t stream_close(StreamObject *self) {
  if (!self->live) return PM_OK;
  self->live = 0;
  pm_status_t st;
  pm_stream_t s = self->stream;
  Py_BEGIN_ALLOW_THREADS st = pm_stream_destroy(s);
  Py_END_ALLOW_THREADS return st;
}

static void Stream_dealloc(StreamObject *self) {
  (void)stream_close(self);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Stream_close(StreamObject *self, PyObject *unused) {
  pm_status_t st = stream_close(self);
  if (st != PM_OK) return raise_status(st);
  Py_RETURN_NONE;
}

static PyObject *Stream_synchronize(StreamObject *self, PyObject *unused) {
  if (!self->live) return raise_fmt(PM_ERR_STATE, "the pinmem.Stream was closed");
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_stream_synchronize(self->stream);
  Py_END_ALLOW_THREADS if (st != PM_OK) return raise_status(st);
  Py_RETURN_NONE;
}

static PyObject *Stream_query(StreamObject *self, PyObject *unused) {
  if (!self->live) return raise_fmt(PM_ERR_STATE, "the pinmem.Stream was closed");
  pm_status_t st = pm_stream_query(self->stream);
  if (st == PM_OK) Py_RETURN_TRUE;
  if (st == PM_NOT_READY) Py_RETURN_FALSE;
  return raise_status(st);
}

static PyObject *Stream_ptr(StreamObject *self, void *unused) {
  return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)self->stream);
}

static PyObject *Stream_enter(PyObject *self, PyObject *unused) { return Py_NewRef(self); }
static PyObject *Stream_exit(StreamObject *self, PyObject *args) {
  return Stream_close(self, NULL);
}

static PyMethodDef Stream_methods[] = {
    {"synchronize", (PyCFunction)Stream_synchronize, METH_NOARGS,
     "Block until all work queued on the stream is done."},
    {"query", (PyCFunction)Stream_query, METH_NOARGS, "True when all queued work is done."},
    {"close", (PyCFunction)Stream_close, METH_NOARGS,
     "Wait for the queued work, then destroy the stream."},
    {"__enter__", (PyCFunction)Stream_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Stream_exit, METH_VARARGS, NULL},
    {0}};

static PyGetSetDef Stream_getset[] = {
    {"ptr", (getter)Stream_ptr, NULL, "The handle as an int (a cudaStream_t under cuda).", NULL},
    {"cuda_stream", (getter)Stream_ptr, NULL, "Same as ptr (torch.cuda.Stream's name).", NULL},
    {0}};

static PyTypeObject StreamType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pinmem.Stream",
    .tp_basicsize = sizeof(StreamObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Stream(): a pinmem stream (work on it runs in order; a cudaStream_t under the cuda "
              "backend, created non-blocking). Usable as a context manager (closes it).",
    .tp_new = Stream_new,
    .tp_dealloc = (destructor)Stream_dealloc,
    .tp_methods = Stream_methods,
    .tp_getset = Stream_getset,
};

/* ------------------------------------------------------------------------------------------ */
/* Buffers                                                                                     */
/* ------------------------------------------------------------------------------------------ */

typedef enum { BUF_POOL = 0, BUF_REGISTERED = 1, BUF_DEVICE = 2, BUF_EXTERNAL = 3 } buf_kind_t;
static const char *const g_kind_names[] = {"pool", "registered", "device", "external"};

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
  PyObject *weakrefs;
} BufferObject;

static PyTypeObject BufferType, PinnedBufferType, DeviceBufferType;

#define Buffer_Check(o) PyObject_TypeCheck((o), &BufferType)

/* The strides sit after room for ndim_cap dimensions, so changing ndim never moves them. */
static Py_ssize_t *buf_strides(BufferObject *b) { return b->shape + b->ndim_cap; }

/* Give the memory back (GIL held; drops it around slow calls). Errors are returned, with
 * pm_last_error() set; the buffer counts as released anyway (there is nothing to retry). */
static pm_status_t buffer_release_memory(BufferObject *b) {
  if (b->released) return PM_OK;
  b->released = 1;
  void *p = b->ptr;
  b->ptr = NULL;
  pm_status_t st = PM_OK;
  pm_event_t ev = b->ready_owned ? b->ready : NULL;
  b->ready = NULL;
  switch (b->kind) {
    case BUF_POOL:
      Py_BEGIN_ALLOW_THREADS st = pm_host_free(p);
      Py_END_ALLOW_THREADS break;
    case BUF_REGISTERED:
      if (p) {
        Py_BEGIN_ALLOW_THREADS st = pm_unregister(p);
        Py_END_ALLOW_THREADS
      }
      break;
    case BUF_DEVICE:
      Py_BEGIN_ALLOW_THREADS st = pm_device_free(p);
      Py_END_ALLOW_THREADS break;
    case BUF_EXTERNAL:
      if (b->on_release) b->on_release(b);
      b->on_release = NULL;
      break;
  }
  if (ev) {
    pm_status_t st2 = pm_event_destroy(ev);
    if (st == PM_OK) st = st2;
  }
  /* Now the registration is gone, let the owner of the memory have it back. */
  if (b->has_src_view) {
    PyBuffer_Release(&b->src_view);
    b->has_src_view = 0;
  }
  if (b->src_dl) {
    DLManagedTensor *dl = b->src_dl;
    b->src_dl = NULL;
    if (dl->deleter) dl->deleter(dl);
  }
  Py_CLEAR(b->keep);
  return st;
}

static void Buffer_dealloc(BufferObject *self) {
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
  if (self->weakrefs) PyObject_ClearWeakRefs((PyObject *)self);
  pm_status_t st = buffer_release_memory(self);
  if (st != PM_OK && st != PM_NOT_READY) {
    if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "pinmem: releasing a %s buffer failed: %s: %s",
                         g_kind_names[self->kind], pm_status_name(st), pm_last_error()) < 0)
      PyErr_WriteUnraisable((PyObject *)self);
  }
  Py_CLEAR(self->base);
  PyMem_Free(self->shape);
  PyMem_Free(self->format);
  PyErr_Restore(et, ev, tb);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Give the descriptor `ndim` dimensions, growing its shape/strides storage when it has room
 * for fewer: the only way ndim changes, so no writer can run past the arrays. Shape and strides
 * of the dimensions kept are kept; new ones are 0. */
static int buffer_set_ndim(BufferObject *b, int ndim) {
  if (ndim < 0 || ndim > PMPY_MAX_NDIM) {
    raise_fmt(PM_ERR_INVALID, "%d dimensions; at most %d", ndim, PMPY_MAX_NDIM);
    return -1;
  }
  if (ndim > b->ndim_cap || !b->shape) {
    int cap = ndim > 1 ? ndim : 1;
    Py_ssize_t *shape = PyMem_Calloc(2 * (size_t)cap, sizeof(Py_ssize_t));
    if (!shape) {
      PyErr_NoMemory();
      return -1;
    }
    if (b->shape) {
      int keep = b->ndim < ndim ? b->ndim : ndim;
      memcpy(shape, b->shape, (size_t)keep * sizeof *shape);
      memcpy(shape + cap, buf_strides(b), (size_t)keep * sizeof *shape);
      PyMem_Free(b->shape);
    }
    b->shape = shape;
    b->ndim_cap = cap;
  }
  b->ndim = ndim;
  return 0;
}

static BufferObject *buffer_alloc(PyTypeObject *type, int ndim) {
  BufferObject *b = (BufferObject *)type->tp_alloc(type, 0);
  if (!b) return NULL;
  b->released = 1; /* until memory is attached */
  b->dl_device_type = kDLCPU;
  if (buffer_set_ndim(b, ndim) < 0) {
    Py_DECREF(b);
    return NULL;
  }
  return b;
}

static int buffer_set_format(BufferObject *b, const char *format) {
  size_t n = strlen(format) + 1;
  b->format = PyMem_Malloc(n);
  if (!b->format) {
    PyErr_NoMemory();
    return -1;
  }
  memcpy(b->format, format, n);
  return 0;
}

/* Fill C-contiguous strides; returns the byte count, or -1 with an error on overflow. */
static int buffer_set_c_strides(BufferObject *b, size_t *nbytes_out) {
  size_t n = (size_t)b->itemsize;
  for (int i = b->ndim - 1; i >= 0; i--) {
    buf_strides(b)[i] = (Py_ssize_t)n;
    size_t d = (size_t)b->shape[i];
    if (d && n > (size_t)PY_SSIZE_T_MAX / d) {
      raise_fmt(PM_ERR_INVALID, "the shape is too large for memory");
      return -1;
    }
    n *= d;
  }
  *nbytes_out = n;
  return 0;
}

static int parse_shape(PyObject *o, Py_ssize_t *dims, int *ndim_out) {
  if (PyIndex_Check(o)) {
    dims[0] = PyNumber_AsSsize_t(o, PyExc_OverflowError);
    if (dims[0] == -1 && PyErr_Occurred()) return -1;
    *ndim_out = 1;
  } else {
    PyObject *seq = PySequence_Fast(o, "shape must be an int or a sequence of ints");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > PMPY_MAX_NDIM) {
      Py_DECREF(seq);
      raise_fmt(PM_ERR_INVALID, "shape has %zd dimensions; at most %d", n, PMPY_MAX_NDIM);
      return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject *it = PySequence_Fast_GET_ITEM(seq, i);
      if (!PyIndex_Check(it)) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_TypeError, "shape must be an int or a sequence of ints");
        return -1;
      }
      dims[i] = PyNumber_AsSsize_t(it, PyExc_OverflowError);
      if (dims[i] == -1 && PyErr_Occurred()) {
        Py_DECREF(seq);
        return -1;
      }
    }
    Py_DECREF(seq);
    *ndim_out = (int)n;
  }
  for (int i = 0; i < *ndim_out; i++)
    if (dims[i] < 0) {
      raise_fmt(PM_ERR_INVALID, "negative dimension %zd in shape", dims[i]);
      return -1;
    }
  return 0;
}

/* A new Buffer of `type` with shape and dtype set; no memory yet. */
static BufferObject *buffer_shaped(PyTypeObject *type, PyObject *shape_obj, PyObject *dtype_obj,
                                   size_t *nbytes_out) {
  Py_ssize_t dims[PMPY_MAX_NDIM];
  int ndim;
  if (parse_shape(shape_obj, dims, &ndim) < 0) return NULL;
  const pmpy_dtype_t *dt = parse_dtype(dtype_obj);
  if (!dt) return NULL;
  BufferObject *b = buffer_alloc(type, ndim);
  if (!b) return NULL;
  memcpy(b->shape, dims, (size_t)ndim * sizeof *dims);
  b->dtype = dt;
  b->itemsize = dt->bits / 8;
  if (buffer_set_format(b, dt->format) < 0 || buffer_set_c_strides(b, nbytes_out) < 0) {
    Py_DECREF(b);
    return NULL;
  }
  return b;
}

static int buffer_check_live(BufferObject *b) {
  if (b->released) {
    raise_fmt(PM_ERR_STATE, "the buffer was released");
    return -1;
  }
  return 0;
}

/* ---- buffer protocol ---------------------------------------------------------------------- */

static int Buffer_getbuffer(BufferObject *self, Py_buffer *view, int flags) {
  view->obj = NULL;
  if (self->released) {
    PyErr_SetString(PyExc_BufferError, "pinmem: the buffer was released");
    return -1;
  }
  if (!self->host_visible) {
    PyErr_SetString(PyExc_BufferError,
                    "pinmem: device memory has no CPU view; copy it into a PinnedBuffer, or use "
                    "DLPack");
    return -1;
  }
  if ((flags & PyBUF_WRITABLE) && self->readonly) {
    PyErr_SetString(PyExc_BufferError, "pinmem: the buffer is read-only");
    return -1;
  }
  view->buf = self->ptr;
  view->len = (Py_ssize_t)self->nbytes;
  view->readonly = self->readonly;
  view->itemsize = self->itemsize;
  view->format = (flags & PyBUF_FORMAT) ? self->format : NULL;
  view->ndim = self->ndim;
  view->suboffsets = NULL;
  view->internal = NULL;
  /* A request without strides takes the layout to be C-contiguous: check what we have. */
  view->shape = self->shape;
  view->strides = buf_strides(self);
  int c = PyBuffer_IsContiguous(view, 'C'), f = PyBuffer_IsContiguous(view, 'F');
  view->shape = (flags & PyBUF_ND) ? self->shape : NULL;
  view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? buf_strides(self) : NULL;
  const char *bad = NULL;
  if ((flags & PyBUF_STRIDES) != PyBUF_STRIDES && !c) bad = "C-contiguous";
  if ((flags & PyBUF_C_CONTIGUOUS) == PyBUF_C_CONTIGUOUS && !c) bad = "C-contiguous";
  if ((flags & PyBUF_F_CONTIGUOUS) == PyBUF_F_CONTIGUOUS && !f) bad = "Fortran-contiguous";
  if ((flags & PyBUF_ANY_CONTIGUOUS) == PyBUF_ANY_CONTIGUOUS && !c && !f) bad = "contiguous";
  if (bad) {
    PyErr_Format(PyExc_BufferError, "pinmem: the buffer is not %s", bad);
    return -1;
  }
  if (!(flags & PyBUF_ND)) {
    /* A simple (flat bytes) request. */
    view->ndim = 1;
    view->itemsize = 1;
  }
  view->obj = Py_NewRef(self);
  self->exports++;
  return 0;
}

static void Buffer_releasebuffer(BufferObject *self, Py_buffer *view) { self->exports--; }

static PyBufferProcs Buffer_as_buffer = {
    .bf_getbuffer = (getbufferproc)Buffer_getbuffer,
    .bf_releasebuffer = (releasebufferproc)Buffer_releasebuffer,
};

/* ---- DLPack export ------------------------------------------------------------------------ */

/* A consumer let go of an export: give the buffer its reference back. Deleters may run on any
 * thread, hence the GIL; after finalisation there is no interpreter to give it to: leak it. */
static void export_release_owner(PyObject *owner) {
  if (owner && Py_IsInitialized() && !interp_finalizing()) {
    PyGILState_STATE g = PyGILState_Ensure();
    ((BufferObject *)owner)->exports--;
    Py_DECREF(owner);
    PyGILState_Release(g);
  }
}

static void export_deleter(DLManagedTensor *mt) {
  if (!mt) return;
  export_release_owner(mt->manager_ctx);
  PyMem_RawFree(mt);
}

static void capsule_destructor(PyObject *cap) {
  /* Renamed "used_dltensor" by a consumer that took ownership; otherwise never consumed. */
  if (!PyCapsule_IsValid(cap, "dltensor")) return;
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
  DLManagedTensor *mt = PyCapsule_GetPointer(cap, "dltensor");
  if (mt && mt->deleter) mt->deleter(mt);
  PyErr_Restore(et, ev, tb);
}

#ifdef PMPY_DLPACK_VERSIONED
static void export_deleter_v(DLManagedTensorVersioned *mt) {
  if (!mt) return;
  export_release_owner(mt->manager_ctx);
  PyMem_RawFree(mt);
}

static void capsule_destructor_v(PyObject *cap) {
  if (!PyCapsule_IsValid(cap, "dltensor_versioned")) return;
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
  DLManagedTensorVersioned *mt = PyCapsule_GetPointer(cap, "dltensor_versioned");
  if (mt && mt->deleter) mt->deleter(mt);
  PyErr_Restore(et, ev, tb);
}
#endif

/* Make `stream` wait for the buffer's last pinmem write (device buffers). */
static int buffer_order_before(BufferObject *b, pm_stream_t stream) {
  if (!b->ready || !b->ready_recorded) return 0;
  pm_status_t st = pm_stream_wait_event(stream, b->ready);
  if (st != PM_OK) {
    raise_status(st);
    return -1;
  }
  return 0;
}

/* After pinmem queued work on `stream` that writes the buffer. */
static int buffer_record_write(BufferObject *b, pm_stream_t stream) {
  if (b->kind != BUF_DEVICE && b->kind != BUF_EXTERNAL) return 0;
  pm_status_t st = PM_OK;
  if (!b->ready) {
    st = pm_event_create(PM_EVENT_DEFAULT, &b->ready);
    if (st == PM_OK) b->ready_owned = 1;
  }
  if (st == PM_OK) st = pm_event_record(b->ready, stream);
  if (st != PM_OK) {
    raise_status(st);
    return -1;
  }
  b->ready_recorded = 1;
  return 0;
}

static PyObject *Buffer_dlpack(BufferObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
  PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O$OOO:__dlpack__", kwlist, &stream, &max_version,
                                   &dl_device, &copy))
    return NULL;
  if (self->released) {
    PyErr_SetString(PyExc_BufferError, "pinmem: the buffer was released");
    return NULL;
  }
  if (copy != Py_None && PyObject_IsTrue(copy)) {
    PyErr_SetString(PyExc_BufferError, "pinmem: buffers are exported in place; copy=True is "
                                       "not supported");
    return NULL;
  }
  int versioned = 0;
  if (max_version != Py_None) {
    int major, minor;
    if (!PyArg_ParseTuple(max_version, "ii;max_version must be a (major, minor) tuple", &major,
                          &minor))
      return NULL;
#ifdef PMPY_DLPACK_VERSIONED
    versioned = major >= 1;
#endif
  }
  if (self->readonly && !versioned) {
    PyErr_SetString(PyExc_BufferError,
                    "pinmem: cannot export a read-only buffer as a legacy DLPack tensor (it "
                    "cannot say read-only); use the buffer protocol");
    return NULL;
  }
  if (!self->dtype) {
    PyErr_Format(PyExc_BufferError, "pinmem: the format '%s' has no DLPack data type",
                 self->format);
    return NULL;
  }
  int dev_type = self->dl_device_type, dev_id = self->dl_device_id;
  if (dl_device != Py_None) {
    int t, id;
    if (!PyArg_ParseTuple(dl_device, "ii;dl_device must be a (type, id) tuple", &t, &id))
      return NULL;
    int host_side = self->dl_device_type == kDLCPU;
    if (t == dev_type && id == dev_id) {
      /* as is */
    } else if (host_side && t == kDLCUDAHost && is_cuda_backend()) {
      dev_type = kDLCUDAHost; /* pinned memory, named precisely at the consumer's request */
      dev_id = id;
    } else {
      PyErr_Format(PyExc_BufferError, "pinmem: the buffer lives on DLPack device (%d, %d), not "
                                      "(%d, %d), and is not copied",
                   self->dl_device_type, self->dl_device_id, t, id);
      return NULL;
    }
  }
  if (dev_type == kDLCUDA && stream != Py_None) {
    uintptr_t v;
    if (parse_address(stream, &v) < 0) return NULL;
    if (v != (uintptr_t)-1) {
      /* The consumer's stream waits for the buffer's last write; the caller never blocks. */
      if (v == 0) {
        PyErr_SetString(PyExc_ValueError, "pinmem: stream 0 is ambiguous in DLPack; pass 1 "
                                          "(legacy default) or 2 (per-thread default)");
        return NULL;
      }
      if (buffer_order_before(self, (pm_stream_t)v) < 0) return NULL;
      self->consumer_stream = v;
      self->has_consumer_stream = 1;
    }
  } else if (dev_type == kDLCUDA) {
    /* No stream: the legacy default stream, per the DLPack protocol. */
    if (buffer_order_before(self, (pm_stream_t)(uintptr_t)1) < 0) return NULL;
    self->consumer_stream = 1;
    self->has_consumer_stream = 1;
  } else if (self->ready_recorded) {
    /* Host-backend device memory read by the CPU: the write must be done first. */
    pm_status_t st;
    pm_event_t ev = self->ready;
    Py_BEGIN_ALLOW_THREADS st = pm_event_synchronize(ev);
    Py_END_ALLOW_THREADS if (st != PM_OK) return raise_status(st);
  }

  int nd = self->ndim;
  for (int i = 0; i < nd; i++)
    if (buf_strides(self)[i] % self->itemsize) {
      PyErr_SetString(PyExc_BufferError, "pinmem: strides are not a multiple of the item size");
      return NULL;
    }
  /* One allocation: the managed tensor, then shape and strides. */
  size_t head = sizeof(DLManagedTensor);
#ifdef PMPY_DLPACK_VERSIONED
  if (versioned) head = sizeof(DLManagedTensorVersioned);
#endif
  head = (head + 7) & ~(size_t)7;
  void *mem = PyMem_RawCalloc(1, head + 2 * (size_t)(nd ? nd : 1) * sizeof(int64_t));
  if (!mem) return PyErr_NoMemory();
  int64_t *dims = (int64_t *)((char *)mem + head);
  DLTensor *t;
#ifdef PMPY_DLPACK_VERSIONED
  if (versioned) {
    DLManagedTensorVersioned *mv = mem;
    mv->version.major = DLPACK_MAJOR_VERSION;
    mv->version.minor = DLPACK_MINOR_VERSION;
    mv->manager_ctx = self;
    mv->deleter = export_deleter_v;
    mv->flags = self->readonly ? DLPACK_FLAG_BITMASK_READ_ONLY : 0;
    t = &mv->dl_tensor;
  } else
#endif
  {
    DLManagedTensor *mt = mem;
    mt->manager_ctx = self;
    mt->deleter = export_deleter;
    t = &mt->dl_tensor;
  }
  for (int i = 0; i < nd; i++) {
    dims[i] = self->shape[i];
    dims[nd + i] = buf_strides(self)[i] / self->itemsize;
  }
  t->data = self->ptr;
  t->device.device_type = (DLDeviceType)dev_type;
  t->device.device_id = dev_id;
  t->ndim = nd;
  t->dtype.code = self->dtype->code;
  t->dtype.bits = self->dtype->bits;
  t->dtype.lanes = 1;
  t->shape = dims;
  t->strides = dims + nd;
  t->byte_offset = 0;
  PyObject *cap;
#ifdef PMPY_DLPACK_VERSIONED
  if (versioned)
    cap = PyCapsule_New(mem, "dltensor_versioned", capsule_destructor_v);
  else
#endif
    cap = PyCapsule_New(mem, "dltensor", capsule_destructor);
  if (!cap) {
    PyMem_RawFree(mem);
    return NULL;
  }
  Py_INCREF(self);
  self->exports++;
  return cap;
}

static PyObject *Buffer_dlpack_device(BufferObject *self, PyObject *unused) {
  return Py_BuildValue("(ii)", self->dl_device_type, self->dl_device_id);
}

/* ---- methods and properties --------------------------------------------------------------- */

static PyObject *Buffer_release(BufferObject *self, PyObject *unused) {
  if (self->released) Py_RETURN_NONE;
  if (self->exports > 0)
    return raise_fmt(PM_ERR_BUSY,
                     "release: the buffer still has %zd consumer(s) (memoryviews, arrays, DLPack "
                     "tensors or copies in flight); it is released when the last one lets go",
                     self->exports);
  pm_status_t st = buffer_release_memory(self);
  if (st != PM_OK) return raise_status(st);
  Py_RETURN_NONE;
}

static PyObject *Buffer_enter(PyObject *self, PyObject *unused) { return Py_NewRef(self); }
static PyObject *Buffer_exit(BufferObject *self, PyObject *args) {
  return Buffer_release(self, NULL);
}

/* numpy.asarray(buffer): NumPy takes host memory through the buffer protocol before it asks
 * __array__, so this runs for memory the CPU cannot read (or when NumPy insists): refuse that
 * plainly instead of letting NumPy wrap the object in a 0-d object array. */
static PyObject *Buffer_array(BufferObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"dtype", "copy", NULL};
  PyObject *dtype = Py_None, *copy = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|OO:__array__", kwlist, &dtype, &copy)) return NULL;
  if (self->released) {
    PyErr_SetString(PyExc_BufferError, "pinmem: the buffer was released");
    return NULL;
  }
  if (!self->host_visible) {
    PyErr_SetString(PyExc_TypeError,
                    "pinmem: device memory is not readable by the CPU; copy it to host memory "
                    "first (pinmem.copy into a pinmem.empty buffer or a NumPy array, then "
                    "Completion.wait()), or hand it to a device library through DLPack");
    return NULL;
  }
  PyObject *np = PyImport_ImportModule("numpy");
  if (!np) return NULL;
  PyObject *mv = PyMemoryView_FromObject((PyObject *)self);
  PyObject *r = NULL;
  if (mv) {
    int want_copy = copy != Py_None && PyObject_IsTrue(copy) == 1;
    r = PyObject_CallMethod(np, want_copy ? "array" : "asarray", "OO", mv, dtype);
  }
  Py_XDECREF(mv);
  Py_DECREF(np);
  return r;
}

static PyObject *Buffer_get_ptr(BufferObject *self, void *unused) {
  return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)self->ptr);
}
static PyObject *Buffer_get_nbytes(BufferObject *self, void *unused) {
  return PyLong_FromSize_t(self->nbytes);
}
static PyObject *Buffer_get_shape(BufferObject *self, void *unused) {
  PyObject *t = PyTuple_New(self->ndim);
  if (!t) return NULL;
  for (int i = 0; i < self->ndim; i++) {
    PyObject *v = PyLong_FromSsize_t(self->shape[i]);
    if (!v) {
      Py_DECREF(t);
      return NULL;
    }
    PyTuple_SET_ITEM(t, i, v);
  }
  return t;
}
static PyObject *Buffer_get_strides(BufferObject *self, void *unused) {
  PyObject *t = PyTuple_New(self->ndim);
  if (!t) return NULL;
  for (int i = 0; i < self->ndim; i++) {
    PyObject *v = PyLong_FromSsize_t(buf_strides(self)[i]);
    if (!v) {
      Py_DECREF(t);
      return NULL;
    }
    PyTuple_SET_ITEM(t, i, v);
  }
  return t;
}
static PyObject *Buffer_get_dtype(BufferObject *self, void *unused) {
  if (!self->dtype) Py_RETURN_NONE;
  return PyUnicode_FromString(self->dtype->name);
}
static PyObject *Buffer_get_format(BufferObject *self, void *unused) {
  return PyUnicode_FromString(self->format ? self->format : "B");
}
static PyObject *Buffer_get_itemsize(BufferObject *self, void *unused) {
  return PyLong_FromSsize_t(self->itemsize);
}
static PyObject *Buffer_get_ndim(BufferObject *self, void *unused) {
  return PyLong_FromLong(self->ndim);
}
static PyObject *Buffer_get_readonly(BufferObject *self, void *unused) {
  return PyBool_FromLong(self->readonly);
}
static PyObject *Buffer_get_released(BufferObject *self, void *unused) {
  return PyBool_FromLong(self->released);
}
static PyObject *Buffer_get_kind(BufferObject *self, void *unused) {
  return PyUnicode_FromString(g_kind_names[self->kind]);
}
static PyObject *Buffer_get_base(BufferObject *self, void *unused) {
  return Py_NewRef(self->base ? self->base : Py_None);
}
static PyObject *Buffer_get_exports(BufferObject *self, void *unused) {
  return PyLong_FromSsize_t(self->exports);
}

static PyObject *Buffer_repr(BufferObject *self) {
  PyObject *shape = Buffer_get_shape(self, NULL);
  if (!shape) return NULL;
  PyObject *r = PyUnicode_FromFormat(
      "%s(shape=%R, dtype=%s, nbytes=%zu, kind='%s', ptr=%p%s)", Py_TYPE(self)->tp_name, shape,
      self->dtype ? self->dtype->name : (self->format ? self->format : "?"), self->nbytes,
      g_kind_names[self->kind], self->ptr, self->released ? ", released" : "");
  Py_DECREF(shape);
  return r;
}

static PyMethodDef Buffer_methods[] = {
    {"release", (PyCFunction)Buffer_release, METH_NOARGS,
     "Free (or unpin) the memory now. BusyError while consumers (memoryviews, arrays, DLPack "
     "tensors, copies in flight) still use it. Without this call the memory goes back when the "
     "buffer and its last consumer are gone."},
    {"__enter__", (PyCFunction)Buffer_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Buffer_exit, METH_VARARGS, NULL},
    {"__dlpack__", (PyCFunction)(void (*)(void))Buffer_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(stream=None, *, max_version=None, dl_device=None, copy=None): a DLPack capsule "
     "over the memory (no copy). For device memory, `stream` (the consumer's) is made to wait "
     "for pinmem's last write; the caller does not block."},
    {"__dlpack_device__", (PyCFunction)Buffer_dlpack_device, METH_NOARGS,
     "(device_type, device_id) as DLPack numbers them."},
    {"__array__", (PyCFunction)(void (*)(void))Buffer_array, METH_VARARGS | METH_KEYWORDS,
     "__array__(dtype=None, copy=None): a NumPy array over host memory; TypeError for device "
     "memory, which must be copied to the host first."},
    {0}};

static PyGetSetDef Buffer_getset[] = {
    {"ptr", (getter)Buffer_get_ptr, NULL, "Address of the first byte (0 once released).", NULL},
    {"nbytes", (getter)Buffer_get_nbytes, NULL, "Size in bytes.", NULL},
    {"shape", (getter)Buffer_get_shape, NULL, "Shape (tuple).", NULL},
    {"strides", (getter)Buffer_get_strides, NULL, "Strides in bytes (tuple).", NULL},
    {"dtype", (getter)Buffer_get_dtype, NULL, "NumPy name of the element type, or None.", NULL},
    {"format", (getter)Buffer_get_format, NULL, "Buffer-protocol format string.", NULL},
    {"itemsize", (getter)Buffer_get_itemsize, NULL, "Bytes per element.", NULL},
    {"ndim", (getter)Buffer_get_ndim, NULL, "Number of dimensions.", NULL},
    {"readonly", (getter)Buffer_get_readonly, NULL, "True for read-only pinned memory.", NULL},
    {"released", (getter)Buffer_get_released, NULL, "True once the memory was given back.", NULL},
    {"kind", (getter)Buffer_get_kind, NULL,
     "'pool' (pinmem.empty), 'registered' (pinmem.pin), 'device', or 'external' (loader).", NULL},
    {"base", (getter)Buffer_get_base, NULL, "The object pinned in place (pin), else None.", NULL},
    {"exports", (getter)Buffer_get_exports, NULL,
     "Live consumers: buffer views, DLPack tensors, copies in flight.", NULL},
    {0}};

static PyTypeObject BufferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pinmem.Buffer",
    .tp_basicsize = sizeof(BufferObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Memory owned by pinmem (base of PinnedBuffer and DeviceBuffer).",
    .tp_dealloc = (destructor)Buffer_dealloc,
    .tp_repr = (reprfunc)Buffer_repr,
    .tp_as_buffer = &Buffer_as_buffer,
    .tp_methods = Buffer_methods,
    .tp_getset = Buffer_getset,
    .tp_weaklistoffset = offsetof(BufferObject, weakrefs),
};

static PyTypeObject PinnedBufferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pinmem.PinnedBuffer",
    .tp_basicsize = sizeof(BufferObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pinned (page-locked) host memory: a block of pinmem's pool (pinmem.empty) or memory "
              "pinned in place (pinmem.pin). Exports the buffer protocol (numpy.asarray, "
              "memoryview) and DLPack (numpy.from_dlpack, torch.from_dlpack) without copying; "
              "the memory stays valid while any of them holds it.",
    .tp_base = &BufferType,
};

/* ---- device buffers ----------------------------------------------------------------------- */

static PyObject *DeviceBuffer_fill(BufferObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"value", "stream", NULL};
  int value;
  PyObject *stream_obj = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "i|O:fill", kwlist, &value, &stream_obj)) return NULL;
  if (buffer_check_live(self) < 0) return NULL;
  pm_stream_t stream;
  if (parse_stream(stream_obj, &stream) < 0) return NULL;
  if (self->nbytes == 0) Py_RETURN_NONE;
  pm_status_t st = pm_device_memset_async(self->ptr, value, self->nbytes, stream);
  if (st != PM_OK) return raise_status(st);
  if (buffer_record_write(self, stream) < 0) return NULL;
  Py_RETURN_NONE;
}

static PyMethodDef DeviceBuffer_methods[] = {
    {"fill", (PyCFunction)(void (*)(void))DeviceBuffer_fill, METH_VARARGS | METH_KEYWORDS,
     "fill(value, stream=None): set every byte to value, ordered on stream."},
    {0}};

static PyTypeObject DeviceBufferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pinmem.DeviceBuffer",
    .tp_basicsize = sizeof(BufferObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Device memory from pinmem (pinmem.device_empty). No CPU view; exports DLPack "
              "(kDLCUDA under the cuda backend) with stream ordering.",
    .tp_base = &BufferType,
    .tp_methods = DeviceBuffer_methods,
};

/* ------------------------------------------------------------------------------------------ */
/* empty / device_empty / pin                                                                  */
/* ------------------------------------------------------------------------------------------ */

static PyObject *py_empty(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"shape", "dtype", "mapped", "write_combined", "portable", NULL};
  PyObject *shape, *dtype;
  int mapped = 0, wc = 0, portable = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|$ppp:empty", kwlist, &shape, &dtype, &mapped,
                                   &wc, &portable))
    return NULL;
  size_t nbytes;
  BufferObject *b = buffer_shaped(&PinnedBufferType, shape, dtype, &nbytes);
  if (!b) return NULL;
  unsigned flags = (mapped ? PM_HOST_MAPPED : 0) | (wc ? PM_HOST_WRITE_COMBINED : 0) |
                   (portable ? PM_HOST_PORTABLE : 0);
  void *p = NULL;
  pm_status_t st;
  size_t ask = nbytes ? nbytes : 1; /* an empty array still gets a distinct address */
  Py_BEGIN_ALLOW_THREADS st = pm_host_alloc(NULL, ask, flags, &p);
  Py_END_ALLOW_THREADS if (st != PM_OK) {
    Py_DECREF(b);
    return raise_status(st);
  }
  b->kind = BUF_POOL;
  b->host_visible = 1;
  b->ptr = p;
  b->nbytes = nbytes;
  b->released = 0;
  return (PyObject *)b;
}

static PyObject *py_device_empty(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"shape", "dtype", NULL};
  PyObject *shape, *dtype;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OO:device_empty", kwlist, &shape, &dtype))
    return NULL;
  size_t nbytes;
  BufferObject *b = buffer_shaped(&DeviceBufferType, shape, dtype, &nbytes);
  if (!b) return NULL;
  void *p = NULL;
  int dev = 0;
  pm_status_t st;
  size_t ask = nbytes ? nbytes : 1;
  Py_BEGIN_ALLOW_THREADS st = pm_device_alloc(ask, &p);
  if (st == PM_OK) st = pm_device_get(&dev);
  Py_END_ALLOW_THREADS if (st != PM_OK) {
    if (p) pm_device_free(p);
    Py_DECREF(b);
    return raise_status(st);
  }
  b->kind = BUF_DEVICE;
  b->ptr = p;
  b->nbytes = nbytes;
  b->released = 0;
  b->readonly = 0;
  b->dl_device_type = is_cuda_backend() ? kDLCUDA : kDLCPU;
  b->dl_device_id = is_cuda_backend() ? dev : 0;
  return (PyObject *)b;
}

/* ---- importing other libraries' memory through DLPack ------------------------------------- */

/* obj.__dlpack_device__() -> (type, id). */
static int dl_device_of(PyObject *o, int *type, int *id) {
  PyObject *d = PyObject_CallMethod(o, "__dlpack_device__", NULL);
  if (!d) return -1;
  int ok = PyTuple_Check(d) && PyTuple_GET_SIZE(d) == 2 &&
           PyArg_ParseTuple(d, "ii;__dlpack_device__ must return (type, id)", type, id);
  if (!ok) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError,
                 "%.100s.__dlpack_device__() must return a (device_type, device_id) tuple of "
                 "ints, not %.200R",
                 Py_TYPE(o)->tp_name, d);
  }
  Py_DECREF(d);
  return ok ? 0 : -1;
}

/* Take the DLPack tensor of `o` (consuming the capsule, so it is ours to delete). CUDA producers
 * are asked to order their work before `stream`. */
static DLManagedTensor *dl_import(PyObject *o, pm_stream_t stream) {
  int type, id;
  if (dl_device_of(o, &type, &id) < 0) return NULL;
  PyObject *cap;
  if (type == kDLCUDA || type == kDLCUDAManaged) {
    uintptr_t s = stream ? (uintptr_t)stream : 1; /* 1: the legacy default stream */
    PyObject *kw = Py_BuildValue("{s:K}", "stream", (unsigned long long)s);
    if (!kw) return NULL;
    PyObject *meth = PyObject_GetAttrString(o, "__dlpack__");
    if (!meth) {
      Py_DECREF(kw);
      return NULL;
    }
    PyObject *empty = PyTuple_New(0);
    cap = empty ? PyObject_Call(meth, empty, kw) : NULL;
    Py_XDECREF(empty);
    Py_DECREF(meth);
    Py_DECREF(kw);
  } else {
    cap = PyObject_CallMethod(o, "__dlpack__", NULL);
  }
  if (!cap) return NULL;
  if (!PyCapsule_IsValid(cap, "dltensor")) {
    const char *name = PyCapsule_CheckExact(cap) ? PyCapsule_GetName(cap) : NULL;
    PyErr_Clear();
    if (PyCapsule_CheckExact(cap))
      PyErr_Format(PyExc_TypeError,
                   "%.100s.__dlpack__() returned a capsule named '%.60s', not an unused "
                   "'dltensor' capsule",
                   Py_TYPE(o)->tp_name, name ? name : "(null)");
    else
      PyErr_Format(PyExc_TypeError,
                   "%.100s.__dlpack__() must return a 'dltensor' PyCapsule, not %.100s",
                   Py_TYPE(o)->tp_name, Py_TYPE(cap)->tp_name);
    Py_DECREF(cap);
    return NULL;
  }
  DLManagedTensor *mt = PyCapsule_GetPointer(cap, "dltensor");
  if (!mt) {
    Py_DECREF(cap);
    return NULL;
  }
  if (PyCapsule_SetName(cap, "used_dltensor") < 0) {
    Py_DECREF(cap);
    return NULL;
  }
  Py_DECREF(cap);
  return mt;
}

/* Bytes of a compact row-major DLTensor, or -1 (with an error) when it is not compact. */
static int dl_compact_bytes(const DLTensor *t, size_t *bytes_out) {
  if (t->ndim < 0 || t->ndim > PMPY_MAX_NDIM || (t->ndim > 0 && !t->shape)) {
    raise_fmt(PM_ERR_INVALID, "the DLPack tensor has a bad ndim %d (or no shape)", t->ndim);
    return -1;
  }
  size_t item = ((size_t)t->dtype.bits * t->dtype.lanes + 7) / 8;
  size_t n = item;
  for (int i = 0; i < t->ndim; i++) {
    if (t->shape[i] < 0) {
      raise_fmt(PM_ERR_INVALID, "the DLPack tensor has a negative dimension %lld",
                (long long)t->shape[i]);
      return -1;
    }
    if (checked_mul(&n, (size_t)t->shape[i]) < 0) return -1;
  }
  n = item ? n / item : 0; /* elements */
  if (t->strides && n) {
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
      if (t->shape[i] != 1 && t->strides[i] != expect) {
        raise_fmt(PM_ERR_INVALID, "the tensor is not contiguous (row-major); call "
                                  ".contiguous() first");
        return -1;
      }
      expect *= t->shape[i];
    }
  }
  *bytes_out = n * item; /* no overflow: checked above */
  return 0;
}

static int g_ro_register = -1; /* does device 0 take read-only registrations? (-1: not asked) */

static PyObject *py_pin(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"obj", "mapped", "portable", NULL};
  PyObject *obj;
  int mapped = 0, portable = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$pp:pin", kwlist, &obj, &mapped, &portable))
    return NULL;
  if (Buffer_Check(obj))
    return raise_fmt(PM_ERR_OVERLAP, "pin: the object is already pinmem memory (%s)",
                     g_kind_names[((BufferObject *)obj)->kind]);

  BufferObject *b = NULL;
  void *data = NULL;
  size_t bytes = 0;
  if (PyObject_CheckBuffer(obj)) {
    Py_buffer v;
    int readonly = 0;
    if (PyObject_GetBuffer(obj, &v, PyBUF_RECORDS) < 0) {
      PyErr_Clear();
      if (PyObject_GetBuffer(obj, &v, PyBUF_RECORDS_RO) < 0) {
        /* The exporter cannot describe its memory (NumPy: datetime64): say so as pinmem. */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyObject *text = ev ? PyObject_Str(ev) : NULL;
        const char *msg = text ? PyUnicode_AsUTF8(text) : NULL;
        if (!msg) PyErr_Clear();
        raise_fmt(PM_ERR_INVALID, "pin: %.100s does not export its memory: %.200s",
                  Py_TYPE(obj)->tp_name, msg ? msg : "?");
        Py_XDECREF(text);
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        return NULL;
      }
      readonly = 1;
    }
    if (format_has_objects(v.format)) {
      PyBuffer_Release(&v);
      return raise_fmt(PM_ERR_INVALID, "pin: the array holds Python objects (dtype object); "
                                       "only plain data can be pinned");
    }
    readonly |= v.readonly;
    if (!PyBuffer_IsContiguous(&v, 'A')) {
      PyBuffer_Release(&v);
      return raise_fmt(PM_ERR_INVALID, "pin: the buffer is not contiguous");
    }
    b = buffer_alloc(&PinnedBufferType, v.ndim);
    if (!b) {
      PyBuffer_Release(&v);
      return NULL;
    }
    b->src_view = v;
    b->has_src_view = 1;
    b->readonly = readonly;
    b->itemsize = v.itemsize;
    if (buffer_set_format(b, v.format ? v.format : "B") < 0) goto fail;
    b->dtype = dtype_from_format(v.format, v.itemsize);
    for (int i = 0; i < v.ndim; i++) {
      b->shape[i] = v.shape ? v.shape[i] : v.len / v.itemsize;
      buf_strides(b)[i] = v.strides ? v.strides[i] : v.itemsize;
    }
    if (!v.strides && v.ndim > 0) {
      size_t dummy;
      if (buffer_set_c_strides(b, &dummy) < 0) goto fail;
    }
    data = v.buf;
    bytes = (size_t)v.len;
  } else if (PyObject_HasAttrString(obj, "__dlpack__")) {
    int type, id;
    if (dl_device_of(obj, &type, &id) < 0) return NULL;
    if (type != kDLCPU)
      return raise_fmt(PM_ERR_WRONG_KIND,
                       "pin: the object lives on DLPack device (%d, %d); only CPU memory can be "
                       "pinned",
                       type, id);
    DLManagedTensor *mt = dl_import(obj, NULL);
    if (!mt) return NULL;
    const DLTensor *t = &mt->dl_tensor;
    if (t->ndim < 0 || t->ndim > PMPY_MAX_NDIM || dl_compact_bytes(t, &bytes) < 0) {
      if (!PyErr_Occurred()) raise_fmt(PM_ERR_INVALID, "pin: bad ndim %d", t->ndim);
      if (mt->deleter) mt->deleter(mt);
      return NULL;
    }
    b = buffer_alloc(&PinnedBufferType, t->ndim);
    if (!b) {
      if (mt->deleter) mt->deleter(mt);
      return NULL;
    }
    b->src_dl = mt;
    b->dtype = dtype_by_dl(t->dtype);
    b->itemsize = ((Py_ssize_t)t->dtype.bits * t->dtype.lanes + 7) / 8;
    if (buffer_set_format(b, b->dtype ? b->dtype->format : "B") < 0) goto fail;
    if (!b->dtype) {
      /* Unknown element type: export it as bytes, shape (nbytes,). */
      b->itemsize = 1;
      if (buffer_set_ndim(b, 1) < 0) goto fail;
      b->shape[0] = (Py_ssize_t)bytes;
    } else {
      for (int i = 0; i < t->ndim; i++) b->shape[i] = (Py_ssize_t)t->shape[i];
    }
    size_t dummy;
    if (buffer_set_c_strides(b, &dummy) < 0) goto fail;
    data = (char *)t->data + t->byte_offset;
  } else {
    PyErr_Format(PyExc_TypeError,
                 "pin: %.100s has neither the buffer protocol nor __dlpack__ (NumPy arrays, "
                 "bytearray, memoryview, torch CPU tensors can be pinned)",
                 Py_TYPE(obj)->tp_name);
    return NULL;
  }

  b->base = Py_NewRef(obj);
  b->kind = BUF_REGISTERED;
  b->host_visible = 1;
  b->nbytes = bytes;
  if (bytes == 0) {
    raise_fmt(PM_ERR_INVALID, "pin: the object has 0 bytes; there is nothing to pin");
    goto fail;
  }
  unsigned flags = (mapped ? PM_REGISTER_MAPPED : 0) | (portable ? PM_REGISTER_PORTABLE : 0);
  if (b->readonly) {
    /* The device only reads it; ask for that where the device can say so (read-only pages of a
     * file mapping need it under CUDA). */
    if (g_ro_register < 0) {
      pm_device_info_t info;
      g_ro_register = pm_device_get_info(0, &info) == PM_OK && info.host_register_read_only;
    }
    if (g_ro_register) flags |= PM_REGISTER_READ_ONLY;
  }
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_register(data, bytes, flags);
  Py_END_ALLOW_THREADS if (st != PM_OK) {
    raise_status(st);
    goto fail;
  }
  b->ptr = data;
  b->released = 0;
  return (PyObject *)b;

fail:
  /* Not registered: only the source export goes back. */
  b->ptr = NULL;
  b->kind = BUF_REGISTERED;
  b->released = 0;
  {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    buffer_release_memory(b);
    Py_DECREF(b);
    PyErr_Restore(et, ev, tb);
  }
  return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* Copies and completions                                                                      */
/* ------------------------------------------------------------------------------------------ */

/* What keeps one side of a copy alive until the copy is done. */
typedef struct holder {
  PyObject *obj;       /* strong reference */
  BufferObject *buf;   /* obj is a Buffer: its exports count this copy */
  Py_buffer view;
  int has_view;
  DLManagedTensor *dl; /* imported through DLPack: ours to delete */
} holder_t;

static void holder_release(holder_t *h) {
  if (h->has_view) {
    PyBuffer_Release(&h->view);
    h->has_view = 0;
  }
  if (h->dl) {
    DLManagedTensor *dl = h->dl;
    h->dl = NULL;
    if (dl->deleter) dl->deleter(dl);
  }
  if (h->buf) {
    h->buf->exports--;
    h->buf = NULL;
  }
  Py_CLEAR(h->obj);
}

/* Is the buffer's layout C order (what a byte copy assumes)? Size-1 and empty arrays are. */
static int buffer_is_c_contiguous(BufferObject *b) {
  if (b->nbytes == 0) return 1;
  Py_ssize_t expect = b->itemsize;
  for (int i = b->ndim - 1; i >= 0; i--) {
    if (b->shape[i] != 1 && buf_strides(b)[i] != expect) return 0;
    expect *= b->shape[i];
  }
  return 1;
}

/* Memory another library says is on the device (__cuda_array_interface__, a non-CPU DLPack
 * tensor). The host backend made every device allocation there is, so [ptr, ptr + bytes) must
 * lie in one of them: a bogus pointer would otherwise be read or written as host memory. Under
 * cuda, device memory of other allocators is unknown to pinmem (CUDA checks it); ranges pinmem
 * does know are held to their ends all the same. */
static int check_device_side(const void *ptr, size_t bytes, const char *what) {
  if (bytes == 0) return 0;
  if (pm_backend_kind() == PM_BACKEND_NONE) {
    pm_status_t st;
    Py_BEGIN_ALLOW_THREADS st = pm_init();
    Py_END_ALLOW_THREADS if (st != PM_OK) {
      raise_status(st);
      return -1;
    }
  }
  pm_pointer_info_t info;
  pm_status_t st = pm_pointer_query(ptr, &info);
  if (st != PM_OK) {
    raise_status(st);
    return -1;
  }
  if (info.kind == PM_MEMORY_PAGEABLE) {
    if (is_cuda_backend()) return 0;
    raise_fmt(PM_ERR_INVALID,
              "copy: %s says it is device memory at %p, but the host backend allocated no device "
              "memory there",
              what, ptr);
    return -1;
  }
  uintptr_t p = (uintptr_t)ptr, base = (uintptr_t)info.base;
  if (p < base || bytes > info.size - (p - base)) {
    raise_fmt(PM_ERR_INVALID, "copy: %s [%p, +%zu) runs past the end of its allocation [%p, +%zu)",
              what, ptr, bytes, info.base, info.size);
    return -1;
  }
  return 0;
}

/* A __cuda_array_interface__ dict -> address, read-only flag and byte count (checked: a shape
 * whose product overflows is refused, not wrapped). Only C-contiguous layouts. */
static int cai_extent(PyObject *cai, const char *what, uintptr_t *addr, int *ro, size_t *bytes) {
  PyObject *data = PyDict_Check(cai) ? PyDict_GetItemString(cai, "data") : NULL;
  PyObject *shape = PyDict_Check(cai) ? PyDict_GetItemString(cai, "shape") : NULL;
  PyObject *typestr = PyDict_Check(cai) ? PyDict_GetItemString(cai, "typestr") : NULL;
  PyObject *strides = PyDict_Check(cai) ? PyDict_GetItemString(cai, "strides") : NULL;
  const char *ts = typestr && PyUnicode_Check(typestr) ? PyUnicode_AsUTF8(typestr) : NULL;
  if (!data || !PyTuple_Check(data) || PyTuple_GET_SIZE(data) != 2 || !shape ||
      !PyTuple_Check(shape) || !ts) {
    PyErr_Clear();
    raise_fmt(PM_ERR_INVALID,
              "copy: %s has a malformed __cuda_array_interface__ (it needs data=(ptr, readonly), "
              "a shape tuple and a typestr)",
              what);
    return -1;
  }
  if (parse_address(PyTuple_GET_ITEM(data, 0), addr) < 0) return -1;
  *ro = PyObject_IsTrue(PyTuple_GET_ITEM(data, 1));
  if (*ro < 0) return -1;
  /* typestr: byte order, kind letter, item size in bytes ("<f4", "|u1"). */
  char *end = NULL;
  long item = strlen(ts) >= 3 && strchr("<>|=", ts[0]) ? strtol(ts + 2, &end, 10) : 0;
  if (item <= 0 || item > 1024 || !end || *end) {
    raise_fmt(PM_ERR_INVALID, "copy: %s has a bad typestr '%.40s' in __cuda_array_interface__",
              what, ts);
    return -1;
  }
  Py_ssize_t nd = PyTuple_GET_SIZE(shape);
  if (nd > PMPY_MAX_NDIM) {
    raise_fmt(PM_ERR_INVALID, "copy: %s has %zd dimensions; at most %d", what, nd, PMPY_MAX_NDIM);
    return -1;
  }
  Py_ssize_t dims[PMPY_MAX_NDIM];
  size_t n = (size_t)item;
  for (Py_ssize_t i = 0; i < nd; i++) {
    PyObject *d = PyTuple_GET_ITEM(shape, i);
    dims[i] = PyIndex_Check(d) ? PyNumber_AsSsize_t(d, NULL) : -1;
    if (dims[i] < 0) {
      PyErr_Clear();
      raise_fmt(PM_ERR_INVALID, "copy: %s has a negative or non-integer dimension in its shape",
                what);
      return -1;
    }
    if (checked_mul(&n, (size_t)dims[i]) < 0) return -1;
  }
  if (strides && strides != Py_None && n) {
    if (!PyTuple_Check(strides) || PyTuple_GET_SIZE(strides) != nd) {
      raise_fmt(PM_ERR_INVALID, "copy: %s has strides that do not match its shape", what);
      return -1;
    }
    Py_ssize_t expect = item;
    for (Py_ssize_t i = nd - 1; i >= 0; i--) {
      PyObject *si = PyTuple_GET_ITEM(strides, i);
      Py_ssize_t sv = PyIndex_Check(si) ? PyNumber_AsSsize_t(si, NULL) : -1;
      PyErr_Clear();
      if (dims[i] != 1 && sv != expect) {
        raise_fmt(PM_ERR_INVALID, "copy: %s is not contiguous", what);
        return -1;
      }
      expect *= dims[i];
    }
  }
  *bytes = n;
  return 0;
}

/* One side of a copy -> pointer and size. */
static int resolve_side(PyObject *o, int writable, pm_stream_t stream, const char *what,
                        holder_t *h, void **ptr, size_t *bytes) {
  memset(h, 0, sizeof *h);
  if (Buffer_Check(o)) {
    BufferObject *b = (BufferObject *)o;
    if (buffer_check_live(b) < 0) return -1;
    if (writable && b->readonly) {
      raise_fmt(PM_ERR_INVALID, "copy: %s is read-only", what);
      return -1;
    }
    if (!buffer_is_c_contiguous(b)) {
      raise_fmt(PM_ERR_INVALID,
                "copy: %s is not C-contiguous (memory pinned in Fortran order keeps that "
                "layout; copy bytes in C order, e.g. from numpy.ascontiguousarray)",
                what);
      return -1;
    }
    h->obj = Py_NewRef(o);
    h->buf = b;
    b->exports++;
    *ptr = b->ptr;
    *bytes = b->nbytes;
    return 0;
  }
  if (PyObject_CheckBuffer(o)) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, &h->view, flags) < 0) {
      if (writable && PyErr_ExceptionMatches(PyExc_BufferError) &&
          PyObject_GetBuffer(o, &h->view, PyBUF_C_CONTIGUOUS) == 0) {
        PyBuffer_Release(&h->view);
        PyErr_Clear();
        raise_fmt(PM_ERR_INVALID, "copy: %s is read-only", what);
        return -1;
      }
      /* Refused for its layout (NumPy says ValueError, others BufferError): say so as pinmem. */
      PyObject *et, *ev, *tb;
      PyErr_Fetch(&et, &ev, &tb);
      Py_buffer any;
      if (PyObject_GetBuffer(o, &any, PyBUF_STRIDES) == 0) {
        int c = PyBuffer_IsContiguous(&any, 'C');
        PyBuffer_Release(&any);
        if (!c) {
          Py_XDECREF(et);
          Py_XDECREF(ev);
          Py_XDECREF(tb);
          raise_fmt(PM_ERR_INVALID,
                    "copy: %s is not C-contiguous; pass numpy.ascontiguousarray(...) of it",
                    what);
          return -1;
        }
      }
      PyErr_Clear();
      PyErr_Restore(et, ev, tb);
      return -1;
    }
    h->has_view = 1;
    h->obj = Py_NewRef(o);
    if (buffer_holds_objects(o)) {
      holder_release(h);
      raise_fmt(PM_ERR_INVALID, "copy: %s holds Python objects (dtype object); only plain data "
                                "can be copied",
                what);
      return -1;
    }
    *ptr = h->view.buf;
    *bytes = (size_t)h->view.len;
    return 0;
  }
  if (PyObject_HasAttrString(o, "__dlpack__")) {
    DLManagedTensor *mt = dl_import(o, stream);
    if (!mt) return -1;
    h->dl = mt;
    h->obj = Py_NewRef(o);
    if (dl_compact_bytes(&mt->dl_tensor, bytes) < 0) {
      holder_release(h);
      return -1;
    }
    *ptr = (char *)mt->dl_tensor.data + mt->dl_tensor.byte_offset;
    int dt = mt->dl_tensor.device.device_type;
    if (dt != kDLCPU && dt != kDLCUDAHost && check_device_side(*ptr, *bytes, what) < 0) {
      holder_release(h);
      return -1;
    }
    return 0;
  }
  PyObject *cai = PyObject_GetAttrString(o, "__cuda_array_interface__");
  if (cai) {
    uintptr_t addr;
    int ro;
    int rc = cai_extent(cai, what, &addr, &ro, bytes);
    Py_DECREF(cai);
    if (rc < 0) return -1;
    if (writable && ro) {
      raise_fmt(PM_ERR_INVALID, "copy: %s is read-only", what);
      return -1;
    }
    if (check_device_side((void *)addr, *bytes, what) < 0) return -1;
    h->obj = Py_NewRef(o);
    *ptr = (void *)addr;
    return 0;
  }
  PyErr_Clear();
  PyErr_Format(PyExc_TypeError,
               "copy: %s (%.100s) is not memory pinmem can copy: a pinmem buffer, an object with "
               "the buffer protocol, __dlpack__ or __cuda_array_interface__",
               what, Py_TYPE(o)->tp_name);
  return -1;
}

typedef struct {
  PyObject_HEAD pm_fence_t fence; /* NULL once released */
  holder_t hold[2];
  PyObject *stream_obj; /* a pinmem.Stream the copy runs on, kept open */
  int busy;             /* threads inside pm_fence_wait */
  int finished;
  pm_status_t result;
  int path; /* pm_copy_path_t, -1 unknown */
  char error[512];
} CompletionObject;

static PyTypeObject CompletionType;

/* A parked copy whose Completion was dropped before it finished. */
typedef struct pending {
  struct pending *next;
  pm_fence_t fence;
  holder_t hold[2];
  PyObject *stream_obj;
} pending_t;

static pending_t *g_pending;

static void completion_finish(CompletionObject *c, pm_status_t st) {
  if (!c->finished) {
    c->finished = 1;
    c->result = st;
    if (st != PM_OK) snprintf(c->error, sizeof c->error, "%s", pm_last_error());
  }
  if (c->busy == 0 && c->fence) {
    pm_copy_path_t path;
    if (pm_fence_path(c->fence, &path) == PM_OK) c->path = (int)path;
    pm_fence_release(c->fence);
    c->fence = NULL;
    holder_release(&c->hold[0]);
    holder_release(&c->hold[1]);
    Py_CLEAR(c->stream_obj);
  }
}

/* Release parked copies that are done; with `wait`, wait for all of them. */
static void pending_sweep(int wait) {
  while (g_pending) {
    pending_t *list = g_pending, *keep = NULL;
    g_pending = NULL;
    while (list) {
      pending_t *p = list;
      list = p->next;
      pm_status_t st;
      if (wait) {
        Py_BEGIN_ALLOW_THREADS st = pm_fence_wait(p->fence);
        Py_END_ALLOW_THREADS
      } else {
        st = pm_fence_query(p->fence);
      }
      if (st == PM_NOT_READY) {
        p->next = keep;
        keep = p;
        continue;
      }
      pm_fence_release(p->fence);
      holder_release(&p->hold[0]);
      holder_release(&p->hold[1]);
      Py_CLEAR(p->stream_obj);
      PyMem_Free(p);
    }
    if (keep) {
      pending_t **tail = &keep;
      while (*tail) tail = &(*tail)->next;
      *tail = g_pending;
      g_pending = keep;
      if (!wait) break;
    }
  }
}

static void Completion_dealloc(CompletionObject *self) {
  if (self->fence) {
    pm_status_t st = self->finished ? self->result : pm_fence_query(self->fence);
    if (st == PM_NOT_READY) {
      pending_t *p = PyMem_Malloc(sizeof *p);
      if (p) {
        p->fence = self->fence;
        p->hold[0] = self->hold[0];
        p->hold[1] = self->hold[1];
        p->stream_obj = self->stream_obj;
        p->next = g_pending;
        g_pending = p;
        self->fence = NULL;
        self->stream_obj = NULL;
        memset(self->hold, 0, sizeof self->hold);
      } else {
        /* No memory to park it: wait here rather than free memory under a copy. */
        pm_fence_t f = self->fence;
        Py_BEGIN_ALLOW_THREADS st = pm_fence_wait(f);
        Py_END_ALLOW_THREADS
      }
    }
    if (self->fence) completion_finish(self, st);
  }
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *completion_raise(CompletionObject *c) {
  return raise_detail(c->result, c->error);
}

static PyObject *Completion_wait(CompletionObject *self, PyObject *unused) {
  if (!self->finished) {
    pm_fence_t f = self->fence;
    pm_status_t st;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS st = pm_fence_wait(f);
    Py_END_ALLOW_THREADS self->busy--;
    completion_finish(self, st);
  } else if (self->fence) {
    completion_finish(self, self->result);
  }
  if (self->result != PM_OK) return completion_raise(self);
  Py_RETURN_NONE;
}

static PyObject *Completion_done(CompletionObject *self, PyObject *unused) {
  if (!self->finished) {
    pm_status_t st = pm_fence_query(self->fence);
    if (st == PM_NOT_READY) Py_RETURN_FALSE;
    completion_finish(self, st);
  }
  if (self->result != PM_OK) return completion_raise(self);
  Py_RETURN_TRUE;
}

static PyObject *Completion_wait_stream(CompletionObject *self, PyObject *arg) {
  pm_stream_t s;
  if (parse_stream(arg, &s) < 0) return NULL;
  if (self->finished) {
    if (self->result != PM_OK) return completion_raise(self);
    Py_RETURN_NONE; /* complete: nothing to wait for */
  }
  pm_status_t st = pm_fence_stream_wait(self->fence, s);
  if (st != PM_OK) return raise_status(st);
  Py_RETURN_NONE;
}

static PyObject *Completion_get_path(CompletionObject *self, void *unused) {
  static const char *const names[] = {"auto", "direct", "staged", "register"};
  if (!self->finished) Py_RETURN_NONE; /* known once the copy completed */
  if (self->fence) completion_finish(self, self->result);
  if (self->path < 0 || self->path > 3) Py_RETURN_NONE;
  return PyUnicode_FromString(names[self->path]);
}

static PyObject *Completion_repr(CompletionObject *self) {
  return PyUnicode_FromFormat("pinmem.Completion(%s)",
                              !self->finished ? "pending"
                              : self->result == PM_OK ? "done"
                                                      : pm_status_name(self->result));
}

static PyMethodDef Completion_methods[] = {
    {"wait", (PyCFunction)Completion_wait, METH_NOARGS,
     "Block until the copy completed (the GIL is released meanwhile); raise its error if it "
     "failed. A device-to-host result may be read only after this (or done() is True)."},
    {"done", (PyCFunction)Completion_done, METH_NOARGS,
     "True once the copy completed; never blocks."},
    {"wait_stream", (PyCFunction)Completion_wait_stream, METH_O,
     "wait_stream(stream): later work on stream (a pinmem.Stream, an int handle, a "
     "torch.cuda.Stream or a CuPy stream) waits for this copy; the caller does not block."},
    {0}};

static PyGetSetDef Completion_getset[] = {
    {"path", (getter)Completion_get_path, NULL,
     "'direct', 'staged' or 'register' once complete (None before).", NULL},
    {0}};

static PyTypeObject CompletionType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pinmem.Completion",
    .tp_basicsize = sizeof(CompletionObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The completion of pinmem.copy. It keeps both sides of the copy alive until the "
              "copy is done, even if it is dropped first.",
    .tp_dealloc = (destructor)Completion_dealloc,
    .tp_repr = (reprfunc)Completion_repr,
    .tp_methods = Completion_methods,
    .tp_getset = Completion_getset,
};

static int parse_path(PyObject *o, pm_copy_path_t *out) {
  static const char *const names[] = {"auto", "direct", "staged", "register"};
  if (o == NULL || o == Py_None) {
    *out = PM_PATH_AUTO;
    return 0;
  }
  const char *s = PyUnicode_Check(o) ? PyUnicode_AsUTF8(o) : NULL;
  for (int i = 0; s && i < 4; i++)
    if (!strcmp(s, names[i])) {
      *out = (pm_copy_path_t)i;
      return 0;
    }
  if (!PyErr_Occurred()) raise_fmt(PM_ERR_INVALID, "copy: path must be 'auto', 'direct', "
                                                   "'staged' or 'register'");
  return -1;
}

static PyObject *py_copy(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"dst", "src", "stream", "nbytes", "path", NULL};
  PyObject *dst, *src, *stream_obj = Py_None, *nbytes_obj = Py_None, *path_obj = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|O$OO:copy", kwlist, &dst, &src, &stream_obj,
                                   &nbytes_obj, &path_obj))
    return NULL;
  pending_sweep(0);
  pm_stream_t stream;
  pm_copy_path_t path;
  if (parse_stream(stream_obj, &stream) < 0 || parse_path(path_obj, &path) < 0) return NULL;
  CompletionObject *c = PyObject_New(CompletionObject, &CompletionType);
  if (!c) return NULL;
  c->fence = NULL;
  memset(c->hold, 0, sizeof c->hold);
  c->stream_obj = NULL;
  c->busy = 0;
  c->finished = 1; /* until a fence exists */
  c->result = PM_OK;
  c->path = -1;
  c->error[0] = 0;

  void *dptr, *sptr;
  size_t dbytes, sbytes, n;
  if (resolve_side(dst, 1, stream, "dst", &c->hold[0], &dptr, &dbytes) < 0) goto fail;
  if (resolve_side(src, 0, stream, "src", &c->hold[1], &sptr, &sbytes) < 0) goto fail;
  if (nbytes_obj != Py_None) {
    if (parse_size_obj(nbytes_obj, &n) < 0) goto fail;
    if (n > sbytes || n > dbytes) {
      raise_fmt(PM_ERR_INVALID, "copy: nbytes=%zu but src has %zu bytes and dst %zu", n, sbytes,
                dbytes);
      goto fail;
    }
  } else {
    n = sbytes;
    if (n > dbytes) {
      raise_fmt(PM_ERR_INVALID, "copy: src has %zu bytes but dst only %zu", sbytes, dbytes);
      goto fail;
    }
  }
  if (c->hold[0].buf && buffer_order_before(c->hold[0].buf, stream) < 0) goto fail;
  if (c->hold[1].buf && buffer_order_before(c->hold[1].buf, stream) < 0) goto fail;

  pm_copy_options_t opt;
  pm_copy_options_init(&opt);
  opt.path = path;
  pm_fence_t fence = NULL;
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_copy_async(dptr, sptr, n, stream, &opt, &fence);
  Py_END_ALLOW_THREADS if (st != PM_OK) {
    raise_status(st);
    goto fail;
  }
  c->fence = fence;
  c->finished = 0;
  if (PyObject_TypeCheck(stream_obj, &StreamType)) c->stream_obj = Py_NewRef(stream_obj);
  if (c->hold[0].buf && buffer_record_write(c->hold[0].buf, stream) < 0) {
    /* The copy is queued; the Completion still guards it. */
    Py_DECREF(c);
    return NULL;
  }
  return (PyObject *)c;

fail:
  holder_release(&c->hold[0]);
  holder_release(&c->hold[1]);
  Py_DECREF(c);
  return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* Datasets and the loader                                                                     */
/* ------------------------------------------------------------------------------------------ */

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
  PyObject *error; /* the first exception a fetch raised: (type, value, traceback) */
  PyObject *parts; /* zips: the datasets zipped (kept alive with the zip) */
} DatasetObject;

static PyTypeObject DatasetType;

static void Dataset_dealloc(DatasetObject *self) {
  if (self->ds) {
    pm_dataset_t *ds = self->ds;
    self->ds = NULL;
    pm_status_t st = pm_dataset_destroy(ds);
    if (st != PM_OK &&
        PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "pinmem: destroying a dataset failed: %s: %s",
                         pm_status_name(st), pm_last_error()) < 0)
      PyErr_WriteUnraisable((PyObject *)self);
  }
  for (int i = 0; i < self->nviews; i++) PyBuffer_Release(&self->views[i]);
  Py_CLEAR(self->fetch);
  Py_CLEAR(self->error);
  Py_CLEAR(self->parts);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static DatasetObject *dataset_new(void) {
  DatasetObject *d = PyObject_New(DatasetObject, &DatasetType);
  if (!d) return NULL;
  d->ds = NULL;
  d->nviews = 0;
  d->nfields = 0;
  d->fetch = NULL;
  d->error = NULL;
  d->parts = NULL;
  return d;
}

/* The exception a Python dataset (or a zipped part of one) raised, taken out; NULL if none. */
static PyObject *dataset_take_error(DatasetObject *d) {
  if (d->error) {
    PyObject *e = d->error;
    d->error = NULL;
    return e;
  }
  if (d->parts)
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(d->parts); i++) {
      PyObject *e = dataset_take_error((DatasetObject *)PyTuple_GET_ITEM(d->parts, i));
      if (e) return e;
    }
  return NULL;
}

static int parse_io(const char *io, pm_io_mode_t *out) {
  if (!io || !strcmp(io, "pread")) *out = PM_IO_PREAD;
  else if (!strcmp(io, "mmap")) *out = PM_IO_MMAP;
  else if (!strcmp(io, "direct")) *out = PM_IO_DIRECT;
  else {
    raise_fmt(PM_ERR_INVALID, "io must be 'pread', 'mmap' or 'direct', not '%.40s'", io);
    return -1;
  }
  return 0;
}

static PyObject *py_dataset_npy(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"paths", "io", "dtype", NULL};
  PyObject *paths;
  const char *io = NULL, *dtype = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|zz:_dataset_npy", kwlist, &paths, &io, &dtype))
    return NULL;
  pm_npy_options_t opt;
  pm_npy_options_init(&opt);
  if (parse_io(io, &opt.io) < 0) return NULL;
  opt.dtype = dtype;
  PyObject *seq = PySequence_Fast(paths, "paths must be a sequence of str");
  if (!seq) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  const char **p = PyMem_Calloc(n ? (size_t)n : 1, sizeof *p);
  if (!p) {
    Py_DECREF(seq);
    return PyErr_NoMemory();
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *it = PySequence_Fast_GET_ITEM(seq, i);
    p[i] = PyUnicode_Check(it) ? PyUnicode_AsUTF8(it) : NULL;
    if (!p[i]) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "paths must be str");
      PyMem_Free(p);
      Py_DECREF(seq);
      return NULL;
    }
  }
  DatasetObject *d = dataset_new();
  pm_status_t st = PM_OK;
  if (d) {
    Py_BEGIN_ALLOW_THREADS st = pm_dataset_open_npy(p, (size_t)n, &opt, &d->ds);
    Py_END_ALLOW_THREADS
  }
  PyMem_Free(p);
  Py_DECREF(seq);
  if (!d) return NULL;
  if (st != PM_OK) {
    Py_DECREF(d);
    return raise_status(st);
  }
  return (PyObject *)d;
}

static PyObject *py_dataset_tokens(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"path", "seq_len", "token_bytes", "random", "stride", "windows", "seed",
                           "io", NULL};
  const char *path, *io = NULL;
  Py_ssize_t seq_len, stride = 0;
  int token_bytes = 2, random = 1;
  unsigned long long windows = 0, seed = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "sn|ipnKKz:_dataset_tokens", kwlist, &path, &seq_len,
                                   &token_bytes, &random, &stride, &windows, &seed, &io))
    return NULL;
  if (seq_len <= 0 || stride < 0) return raise_fmt(PM_ERR_INVALID, "seq_len must be > 0");
  pm_tokens_options_t opt;
  pm_tokens_options_init(&opt);
  opt.seq_len = (size_t)seq_len;
  opt.token_bytes = token_bytes;
  opt.random = random;
  opt.stride = (size_t)stride;
  opt.windows = windows;
  opt.seed = seed;
  if (parse_io(io, &opt.io) < 0) return NULL;
  DatasetObject *d = dataset_new();
  if (!d) return NULL;
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_dataset_open_tokens(path, &opt, &d->ds);
  Py_END_ALLOW_THREADS if (st != PM_OK) {
    Py_DECREF(d);
    return raise_status(st);
  }
  return (PyObject *)d;
}

static pm_dtype_t pm_dtype_of(const pmpy_dtype_t *dt) {
  for (int i = PM_DTYPE_BOOL; dt && i <= PM_DTYPE_COMPLEX128; i++)
    if (!strcmp(pm_dtype_name((pm_dtype_t)i), dt->name)) return (pm_dtype_t)i;
  return PM_DTYPE_OTHER;
}

/* A field spec from a dtype text (NumPy's descr: "<f4", ">f4", "<U10", "[('a', '<i4')]"), its
 * itemsize and the sample shape. Types without a code of their own travel as records of
 * itemsize bytes with their descr, which the Python side turns back into the real dtype. */
static int field_spec(int k, const char *descr, size_t itemsize, int ndim, const Py_ssize_t *shape,
                      pm_field_t *f) {
  memset(f, 0, sizeof *f);
  if (!descr || !descr[0] || strlen(descr) >= sizeof f->descr) {
    raise_fmt(PM_ERR_INVALID, "field %d: dtype text '%.60s' is empty or too long", k,
              descr ? descr : "");
    return -1;
  }
  const char *base = strchr("<>=|", descr[0]) ? descr + 1 : descr;
  if (base[0] == 'O' || strstr(descr, "'|O'") || strstr(descr, "'O'")) {
    raise_fmt(PM_ERR_INVALID,
              "field %d: dtype %.60s holds Python objects (pointers): pinmem.Loader delivers "
              "fixed-size numbers and records only",
              k, descr);
    return -1;
  }
  if (itemsize == 0) {
    raise_fmt(PM_ERR_INVALID, "field %d: dtype %.60s has no fixed size (itemsize 0)", k, descr);
    return -1;
  }
  if (ndim > PM_DATASET_MAX_DIMS) {
    raise_fmt(PM_ERR_INVALID, "field %d: more than %d dimensions per sample", k,
              PM_DATASET_MAX_DIMS);
    return -1;
  }
  const pmpy_dtype_t *dt = dtype_from_text(descr);
  f->dtype = pm_dtype_of(dt);
  if (f->dtype != PM_DTYPE_OTHER && (size_t)(dt->bits / 8) != itemsize) f->dtype = PM_DTYPE_OTHER;
  f->itemsize = itemsize;
  f->ndim = ndim;
  for (int i = 0; i < ndim; i++) f->shape[i] = (uint64_t)shape[i];
  snprintf(f->descr, sizeof f->descr, "%s", descr);
  return 0;
}

static int arrays_read(uint64_t index, void *const *dsts, void *user) {
  DatasetObject *d = user;
  for (int k = 0; k < d->nfields; k++)
    memcpy(dsts[k], (const char *)d->views[k].buf + index * d->fbytes[k], d->fbytes[k]);
  return 0;
}

/* One dataset over in-memory C-contiguous arrays: field k = samples along axis 0 of
 * arrays[k] (same length; any buffer, e.g. a uint8 view of a datetime array), described by
 * specs[k] = (sample shape, dtype text, itemsize). Read without the GIL. */
static PyObject *py_dataset_arrays(PyObject *mod, PyObject *args) {
  PyObject *arrays, *specs;
  if (!PyArg_ParseTuple(args, "OO:_dataset_arrays", &arrays, &specs)) return NULL;
  PyObject *seq = PySequence_Fast(arrays, "arrays must be a sequence");
  if (!seq) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n < 1 || n > PM_MAX_FIELDS || PySequence_Size(specs) != n) {
    Py_DECREF(seq);
    if (PyErr_Occurred()) return NULL;
    return raise_fmt(PM_ERR_INVALID, "a dataset has 1..%d arrays (fields), one spec each",
                     PM_MAX_FIELDS);
  }
  DatasetObject *d = dataset_new();
  if (!d) {
    Py_DECREF(seq);
    return NULL;
  }
  pm_field_t f[PM_MAX_FIELDS];
  for (Py_ssize_t k = 0; k < n; k++) {
    Py_buffer *v = &d->views[k];
    if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, k), v, PyBUF_C_CONTIGUOUS) < 0)
      goto fail;
    d->nviews++;
    if (v->ndim < 1 || v->shape[0] == 0) {
      raise_fmt(PM_ERR_INVALID,
                "field %zd: an array dataset needs at least one sample along axis 0", k);
      goto fail;
    }
    if (v->shape[0] != d->views[0].shape[0]) {
      raise_fmt(PM_ERR_INVALID,
                "the arrays of a dataset need the same length (field 0 has %zd, field %zd "
                "has %zd)",
                d->views[0].shape[0], k, v->shape[0]);
      goto fail;
    }
    PyObject *spec = PySequence_GetItem(specs, k), *shape;
    const char *descr;
    Py_ssize_t itemsize, dims[PMPY_MAX_NDIM];
    int ndim, ok = spec && PyArg_ParseTuple(spec, "Osn:_dataset_arrays spec", &shape, &descr,
                                            &itemsize) &&
                   parse_shape(shape, dims, &ndim) == 0 &&
                   field_spec((int)k, descr, (size_t)(itemsize > 0 ? itemsize : 0), ndim, dims,
                              &f[k]) == 0;
    Py_XDECREF(spec); /* descr lives in the caller's specs */
    if (!ok) goto fail;
    d->fbytes[k] = (size_t)(v->len / v->shape[0]);
    size_t want = f[k].itemsize;
    for (int i = 0; i < ndim; i++) want *= (size_t)dims[i];
    if (d->fbytes[k] != want || want == 0) {
      raise_fmt(PM_ERR_INVALID, "field %zd: samples of %zu bytes, the spec says %zu", k,
                d->fbytes[k], want);
      goto fail;
    }
  }
  d->nfields = (int)n;
  pm_dataset_fields_callbacks_t cb;
  memset(&cb, 0, sizeof cb);
  cb.samples = (uint64_t)d->views[0].shape[0];
  cb.nfields = (int)n;
  cb.fields = f;
  cb.read = arrays_read;
  cb.user = d;
  pm_status_t st = pm_dataset_create_fields(&cb, &d->ds);
  if (st != PM_OK) {
    raise_status(st);
    goto fail;
  }
  Py_DECREF(seq);
  return (PyObject *)d;
fail:
  Py_DECREF(seq);
  Py_DECREF(d);
  return NULL;
}

/* A worker thread reads one sample of a Python dataset: one fetch call for all its fields. */
static int python_read(uint64_t index, void *const *dsts, void *user) {
  DatasetObject *d = user;
  if (!Py_IsInitialized() || interp_finalizing()) return PM_ERR_STATE;
  PyGILState_STATE g = PyGILState_Ensure();
  int rc = 0;
  PyObject *item = PyObject_CallFunction(d->fetch, "K", (unsigned long long)index);
  PyObject *seq = item ? PySequence_Fast(item, "fetch must return a sequence of arrays") : NULL;
  if (seq && PySequence_Fast_GET_SIZE(seq) != d->nfields) {
    PyErr_Format(PyExc_ValueError, "pinmem.Loader: sample %llu has %zd fields, the first had %d",
                 (unsigned long long)index, PySequence_Fast_GET_SIZE(seq), d->nfields);
    rc = PM_ERR_FORMAT;
  }
  for (int k = 0; seq && !rc && k < d->nfields; k++) {
    Py_buffer v;
    if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, k), &v, PyBUF_C_CONTIGUOUS) < 0) break;
    if ((size_t)v.len == d->fbytes[k]) {
      memcpy(dsts[k], v.buf, d->fbytes[k]);
    } else {
      PyErr_Format(PyExc_ValueError,
                   "pinmem.Loader: sample %llu, field %d has %zd bytes, but the first sample "
                   "had %zu (every sample must have the same shape and dtype)",
                   (unsigned long long)index, k, v.len, d->fbytes[k]);
      rc = PM_ERR_FORMAT;
    }
    PyBuffer_Release(&v);
  }
  Py_XDECREF(seq);
  Py_XDECREF(item);
  if (PyErr_Occurred()) {
    if (!rc) rc = PM_ERR_IO;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyErr_NormalizeException(&et, &ev, &tb);
    if (!d->error)
      d->error = Py_BuildValue("(OOO)", et ? et : Py_None, ev ? ev : Py_None, tb ? tb : Py_None);
    Py_XDECREF(et);
    Py_XDECREF(ev);
    Py_XDECREF(tb);
    PyErr_Clear();
  }
  PyGILState_Release(g);
  return rc;
}

/* _dataset_python(fetch, samples, specs): specs = [(sample shape, dtype text, itemsize)], one
 * per field; fetch(i) returns the fields of sample i (C-contiguous, checked by the caller). */
static PyObject *py_dataset_python(PyObject *mod, PyObject *args) {
  PyObject *fetch, *specs;
  unsigned long long samples;
  if (!PyArg_ParseTuple(args, "OKO:_dataset_python", &fetch, &samples, &specs)) return NULL;
  PyObject *seq = PySequence_Fast(specs, "specs must be a sequence");
  if (!seq) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n < 1 || n > PM_MAX_FIELDS) {
    Py_DECREF(seq);
    return raise_fmt(PM_ERR_INVALID, "a sample has 1..%d fields, not %zd", PM_MAX_FIELDS, n);
  }
  pm_field_t f[PM_MAX_FIELDS];
  DatasetObject *d = dataset_new();
  if (!d) {
    Py_DECREF(seq);
    return NULL;
  }
  for (Py_ssize_t k = 0; k < n; k++) {
    PyObject *shape;
    const char *descr;
    Py_ssize_t itemsize;
    Py_ssize_t dims[PMPY_MAX_NDIM];
    int ndim;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, k), "Osn:_dataset_python spec", &shape,
                          &descr, &itemsize) ||
        parse_shape(shape, dims, &ndim) < 0 ||
        field_spec((int)k, descr, (size_t)(itemsize > 0 ? itemsize : 0), ndim, dims, &f[k]) < 0)
      goto fail;
    size_t bytes = f[k].itemsize;
    for (int i = 0; i < ndim; i++) bytes *= (size_t)dims[i];
    d->fbytes[k] = bytes;
  }
  d->nfields = (int)n;
  d->fetch = Py_NewRef(fetch);
  pm_dataset_fields_callbacks_t cb;
  memset(&cb, 0, sizeof cb);
  cb.samples = samples;
  cb.nfields = (int)n;
  cb.fields = f;
  cb.read = python_read;
  cb.user = d;
  pm_status_t st = pm_dataset_create_fields(&cb, &d->ds);
  if (st != PM_OK) {
    raise_status(st);
    goto fail;
  }
  Py_DECREF(seq);
  return (PyObject *)d;
fail:
  Py_DECREF(seq);
  Py_DECREF(d);
  return NULL;
}

/* _dataset_zip(datasets): one dataset with the fields of each, side by side. */
static PyObject *py_dataset_zip(PyObject *mod, PyObject *arg) {
  PyObject *parts = PySequence_Tuple(arg);
  if (!parts) return NULL;
  Py_ssize_t n = PyTuple_GET_SIZE(parts);
  pm_dataset_t *ds[PM_MAX_FIELDS];
  if (n < 1 || n > PM_MAX_FIELDS) {
    Py_DECREF(parts);
    return raise_fmt(PM_ERR_INVALID, "a zip of 1..%d datasets, not %zd", PM_MAX_FIELDS, n);
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *o = PyTuple_GET_ITEM(parts, i);
    if (!PyObject_TypeCheck(o, &DatasetType)) {
      Py_DECREF(parts);
      return PyErr_Format(PyExc_TypeError, "_dataset_zip takes pinmem datasets, not %.100s",
                          Py_TYPE(o)->tp_name);
    }
    ds[i] = ((DatasetObject *)o)->ds;
  }
  DatasetObject *d = dataset_new();
  if (!d) {
    Py_DECREF(parts);
    return NULL;
  }
  d->parts = parts;
  pm_status_t st = pm_dataset_zip(ds, (size_t)n, &d->ds);
  if (st != PM_OK) {
    Py_DECREF(d);
    return raise_status(st);
  }
  return (PyObject *)d;
}

/* fields() -> [{"descr", "shape", "itemsize", "bytes", "dtype", "native"}]: native is False for
 * dtypes pinmem's buffers cannot express (delivered as raw bytes, rebuilt from descr). */
static PyObject *Dataset_fields(DatasetObject *self, PyObject *unused) {
  pm_dataset_info_t in;
  pm_status_t st = pm_dataset_get_info(self->ds, &in);
  if (st != PM_OK) return raise_status(st);
  PyObject *out = PyList_New(0);
  for (int k = 0; out && k < in.fields; k++) {
    pm_field_t f;
    st = pm_dataset_get_field(self->ds, k, &f);
    if (st != PM_OK) {
      Py_DECREF(out);
      return raise_status(st);
    }
    PyObject *shape = PyTuple_New(f.ndim);
    if (!shape) {
      Py_DECREF(out);
      return NULL;
    }
    for (int i = 0; i < f.ndim; i++)
      PyTuple_SET_ITEM(shape, i, PyLong_FromUnsignedLongLong(f.shape[i]));
    PyObject *e = Py_BuildValue("{s:s,s:N,s:n,s:n,s:s,s:O}", "descr", f.descr, "shape", shape,
                                "itemsize", (Py_ssize_t)f.itemsize, "bytes", (Py_ssize_t)f.bytes,
                                "dtype", pm_dtype_name(f.dtype), "native",
                                dtype_from_text(f.descr) ? Py_True : Py_False);
    if (!e || PyList_Append(out, e) < 0) Py_CLEAR(out);
    Py_XDECREF(e);
  }
  return out;
}

static PyObject *Dataset_info(DatasetObject *self, PyObject *unused) {
  pm_dataset_info_t in;
  pm_status_t st = pm_dataset_get_info(self->ds, &in);
  if (st != PM_OK) return raise_status(st);
  PyObject *shape = PyTuple_New(in.ndim);
  if (!shape) return NULL;
  for (int i = 0; i < in.ndim; i++)
    PyTuple_SET_ITEM(shape, i, PyLong_FromUnsignedLongLong(in.shape[i]));
  static const char *const ios[] = {"pread", "mmap", "direct"};
  return Py_BuildValue("{s:K,s:n,s:n,s:N,s:s,s:n,s:s,s:i,s:s,s:s,s:K}", "samples",
                       (unsigned long long)in.samples, "sample_bytes", (Py_ssize_t)in.sample_bytes,
                       "target_bytes", (Py_ssize_t)in.target_bytes, "shape", shape, "dtype",
                       pm_dtype_name(in.dtype), "itemsize", (Py_ssize_t)in.itemsize, "descr",
                       in.descr, "files", in.files, "io",
                       (unsigned)in.io < 3 ? ios[in.io] : "?", "note", in.note, "tokens",
                       (unsigned long long)in.tokens);
}

/* The sample as a loader delivers it in `epoch`: (inputs bytes, targets bytes or None). */
static PyObject *Dataset_read_sample(DatasetObject *self, PyObject *args) {
  unsigned long long index, epoch = 0;
  if (!PyArg_ParseTuple(args, "K|K:read_sample", &index, &epoch)) return NULL;
  pm_dataset_info_t in;
  pm_status_t st = pm_dataset_get_info(self->ds, &in);
  if (st != PM_OK) return raise_status(st);
  PyObject *x = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)in.sample_bytes);
  PyObject *y = in.target_bytes ? PyBytes_FromStringAndSize(NULL, (Py_ssize_t)in.target_bytes)
                                : Py_NewRef(Py_None);
  if (!x || !y) {
    Py_XDECREF(x);
    Py_XDECREF(y);
    return NULL;
  }
  char *xp = PyBytes_AS_STRING(x);
  char *yp = in.target_bytes ? PyBytes_AS_STRING(y) : NULL;
  Py_BEGIN_ALLOW_THREADS st = pm_dataset_read_sample(self->ds, epoch, index, xp, yp);
  Py_END_ALLOW_THREADS if (st != PM_OK) {
    Py_DECREF(x);
    Py_DECREF(y);
    if (self->error) {
      PyErr_Restore(Py_NewRef(PyTuple_GET_ITEM(self->error, 0)),
                    Py_NewRef(PyTuple_GET_ITEM(self->error, 1)),
                    PyTuple_GET_ITEM(self->error, 2) == Py_None
                        ? NULL
                        : Py_NewRef(PyTuple_GET_ITEM(self->error, 2)));
      Py_CLEAR(self->error);
      return NULL;
    }
    return raise_status(st);
  }
  return Py_BuildValue("(NN)", x, y);
}

static PyMethodDef Dataset_methods[] = {
    {"info", (PyCFunction)Dataset_info, METH_NOARGS, "info() -> dict"},
    {"read_sample", (PyCFunction)Dataset_read_sample, METH_VARARGS,
     "read_sample(index, epoch=0) -> (inputs bytes, targets bytes or None)"},
    {"fields", (PyCFunction)Dataset_fields, METH_NOARGS,
     "fields() -> [dict(descr, shape, itemsize, bytes, dtype, native)], one per field"},
    {0}};

static PyTypeObject DatasetType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pinmem._Dataset",
    .tp_basicsize = sizeof(DatasetObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A pinmem dataset (made by pinmem.Loader's helpers).",
    .tp_dealloc = (destructor)Dataset_dealloc,
    .tp_methods = Dataset_methods,
};

typedef struct {
  PyObject_HEAD pm_loader_t *loader; /* NULL once closed */
  DatasetObject *dataset;
  Py_ssize_t held; /* batches delivered and not given back yet */
  int device;      /* batches in device memory */
  int dev_index;
} LoaderObject;

/* One delivered batch. Its buffers (one per field) hold it; when the last of them goes, the
 * batch goes back to the loader, ordered after the consumer stream DLPack named. This works
 * after the loader was closed too: pm_batch_release then frees the batch's slot. */
typedef struct {
  PyObject_HEAD pm_batch_t b;
  LoaderObject *loader;
  uintptr_t release_stream;
} BatchObject;

static PyTypeObject LoaderType, BatchType;
static PyObject *g_batch_class; /* pinmem.Batch (a tuple subclass), set by _set_batch_class */
static PyObject *g_str_epoch, *g_str_index, *g_str_indices;

static void Batch_dealloc(BatchObject *self) {
  if (self->loader) {
    pm_stream_t s = NULL;
    uintptr_t v = self->release_stream;
    if (v && v != (uintptr_t)-1 && (is_cuda_backend() || v > 2)) s = (pm_stream_t)v;
    pm_status_t st = pm_batch_release(&self->b, s);
    if (st != PM_OK &&
        PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "pinmem: giving a batch back failed: %s: %s",
                         pm_status_name(st), pm_last_error()) < 0)
      PyErr_WriteUnraisable((PyObject *)self);
    self->loader->held--;
    Py_CLEAR(self->loader);
  }
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pinmem._Batch",
    .tp_basicsize = sizeof(BatchObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Batch_dealloc,
};

static void batch_buffer_released(BufferObject *b) {
  BatchObject *batch = (BatchObject *)b->keep;
  if (batch && b->has_consumer_stream) batch->release_stream = b->consumer_stream;
}

/* A buffer over field k of a batch: its dtype and shape, or (a dtype pinmem's buffers cannot
 * express: big-endian, strings, records, datetimes) its bytes, flat, for the Python side to
 * view with the field's real dtype. */
static BufferObject *batch_buffer(BatchObject *batch, int k) {
  const pm_batch_field_t *f = &batch->b.fields[k];
  const pmpy_dtype_t *dt = dtype_from_text(f->info->descr);
  if (dt && (size_t)(dt->bits / 8) != f->info->itemsize) dt = NULL;
  int ndim = dt ? f->ndim : 1;
  BufferObject *buf = buffer_alloc(&BufferType, ndim);
  if (!buf) return NULL;
  /* The descriptor (shape, strides) comes from batch_layout.h, which the .npy fuzz target
   * drives too. */
  pmpy_layout_t lay;
  const char *why = NULL;
  if (pmpy_batch_layout(dt ? dt->bits / 8 : 0, f->ndim, f->shape, batch->b.samples, f->bytes, 0,
                        &lay, &why) < 0) {
    Py_DECREF(buf);
    raise_fmt(PM_ERR_INTERNAL, "a loader batch cannot be described: %s", why);
    return NULL;
  }
  if (buffer_set_ndim(buf, lay.ndim) < 0 || buffer_set_format(buf, dt ? dt->format : "B") < 0) {
    Py_DECREF(buf);
    return NULL;
  }
  buf->dtype = dt;
  buf->itemsize = (Py_ssize_t)lay.itemsize;
  for (int i = 0; i < lay.ndim; i++) {
    buf->shape[i] = (Py_ssize_t)lay.shape[i];
    buf_strides(buf)[i] = (Py_ssize_t)lay.strides[i];
  }
  buf->kind = BUF_EXTERNAL;
  buf->ptr = f->data;
  buf->nbytes = f->bytes;
  buf->released = 0;
  buf->host_visible = !batch->loader->device;
  if (batch->loader->device) {
    buf->dl_device_type = is_cuda_backend() ? kDLCUDA : kDLCPU;
    buf->dl_device_id = is_cuda_backend() ? batch->loader->dev_index : 0;
    buf->ready = batch->b.event;
    buf->ready_recorded = batch->b.event != NULL;
    buf->ready_owned = 0;
  }
  buf->keep = Py_NewRef(batch);
  buf->on_release = batch_buffer_released;
  return buf;
}

static PyObject *py_set_batch_class(PyObject *mod, PyObject *cls) {
  if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &PyTuple_Type))
    return PyErr_Format(PyExc_TypeError, "the batch class must be a tuple subclass");
  Py_XSETREF(g_batch_class, Py_NewRef(cls));
  if (!g_str_epoch) g_str_epoch = PyUnicode_InternFromString("epoch");
  if (!g_str_index) g_str_index = PyUnicode_InternFromString("index");
  if (!g_str_indices) g_str_indices = PyUnicode_InternFromString("_indices");
  if (!g_str_epoch || !g_str_index || !g_str_indices) return NULL;
  Py_RETURN_NONE;
}

static PyObject *Loader_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"dataset",    "batch_size", "workers", "prefetch", "shuffle",
                           "seed",       "drop_last",  "rank",    "world_size", "pin_memory",
                           "device",     "epochs",     "resume",  NULL};
  PyObject *dataset, *resume = Py_None;
  Py_ssize_t batch_size;
  int workers = 0, prefetch = 0, shuffle = 0, drop_last = 0, rank = -1, world = -1, pin = 1,
      device = 1;
  unsigned long long seed = 0, epochs = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O!n|$iipKpiippKO:_Loader", kwlist, &DatasetType,
                                   &dataset, &batch_size, &workers, &prefetch, &shuffle, &seed,
                                   &drop_last, &rank, &world, &pin, &device, &epochs, &resume))
    return NULL;
  if (batch_size <= 0) return raise_fmt(PM_ERR_INVALID, "batch_size must be > 0");
  pm_loader_config_t c;
  pm_loader_config_init(&c);
  c.batch_size = (size_t)batch_size;
  c.workers = workers;
  c.prefetch = prefetch;
  c.shuffle = shuffle;
  c.seed = seed;
  c.drop_last = drop_last;
  c.rank = rank;
  c.world_size = world;
  c.pin_memory = pin;
  c.delivery = device ? PM_DELIVER_DEVICE : PM_DELIVER_HOST;
  c.epochs = epochs;
  pm_loader_state_t state;
  if (resume != Py_None) {
    Py_buffer v;
    if (PyObject_GetBuffer(resume, &v, PyBUF_SIMPLE) < 0) return NULL;
    int ok = v.len == (Py_ssize_t)sizeof state;
    if (ok) memcpy(&state, v.buf, sizeof state);
    PyBuffer_Release(&v);
    if (!ok)
      return raise_fmt(PM_ERR_INVALID, "resume state must be %zu bytes (from state())",
                       sizeof state);
    c.resume = &state;
  }
  LoaderObject *self = (LoaderObject *)type->tp_alloc(type, 0);
  if (!self) return NULL;
  self->dataset = (DatasetObject *)Py_NewRef(dataset);
  self->device = device;
  pm_status_t st;
  pm_dataset_t *ds = self->dataset->ds;
  Py_BEGIN_ALLOW_THREADS st = pm_loader_create(ds, &c, &self->loader);
  if (st == PM_OK && device) st = pm_device_get(&self->dev_index);
  Py_END_ALLOW_THREADS if (st != PM_OK) {
    Py_DECREF(self);
    return raise_status(st);
  }
  return (PyObject *)self;
}

/* Stops the workers and frees the slots nobody holds; a batch still alive frees its own slot
 * when it goes (pm_loader_destroy allows held batches). */
static pm_status_t loader_destroy(LoaderObject *self) {
  if (!self->loader) return PM_OK;
  pm_loader_t *l = self->loader;
  self->loader = NULL;
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_loader_destroy(l);
  Py_END_ALLOW_THREADS return st;
}

static void Loader_dealloc(LoaderObject *self) {
  /* Batches hold the loader, so none is alive here. */
  pm_status_t st = loader_destroy(self);
  if (st != PM_OK &&
      PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "pinmem: destroying a loader failed: %s: %s",
                       pm_status_name(st), pm_last_error()) < 0)
    PyErr_WriteUnraisable((PyObject *)self);
  Py_CLEAR(self->dataset);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static int loader_check(LoaderObject *self) {
  if (!self->loader) {
    raise_fmt(PM_ERR_STATE, "the loader was closed");
    return -1;
  }
  return 0;
}

static PyObject *Loader_close(LoaderObject *self, PyObject *unused) {
  pm_status_t st = loader_destroy(self);
  if (st != PM_OK) return raise_status(st);
  Py_RETURN_NONE;
}

/* next() -> a pinmem.Batch (one buffer per field; attributes epoch, index, _indices), or None
 * once every epoch was delivered. */
static PyObject *Loader_next(LoaderObject *self, PyObject *unused) {
  if (loader_check(self) < 0) return NULL;
  if (!g_batch_class) return raise_fmt(PM_ERR_STATE, "the batch class is not set");
  BatchObject *batch = PyObject_New(BatchObject, &BatchType);
  if (!batch) return NULL;
  batch->loader = NULL;
  batch->release_stream = 0;
  pm_status_t st;
  pm_loader_t *l = self->loader;
  Py_BEGIN_ALLOW_THREADS st = pm_loader_next(l, &batch->b);
  Py_END_ALLOW_THREADS if (st != PM_OK) {
    Py_DECREF(batch);
    if (st == PM_ERR_STATE) Py_RETURN_NONE; /* every epoch was delivered */
    PyObject *e = dataset_take_error(self->dataset);
    if (e) {
      /* A Python dataset raised: re-raise that, chained to pinmem's error. */
      raise_status(st);
      PyObject *et, *ev, *tb;
      PyErr_Fetch(&et, &ev, &tb);
      PyErr_NormalizeException(&et, &ev, &tb);
      Py_XDECREF(et);
      Py_XDECREF(tb);
      PyObject *err = PyTuple_GET_ITEM(e, 1);
      if (ev && err != Py_None) PyException_SetCause(err, ev);
      else
        Py_XDECREF(ev);
      PyErr_SetObject(PyTuple_GET_ITEM(e, 0), err);
      Py_DECREF(e);
      return NULL;
    }
    return raise_status(st);
  }
  batch->loader = (LoaderObject *)Py_NewRef(self);
  self->held++;
  const pm_batch_t *pb = &batch->b;
  PyObject *r = NULL, *arrays = PyTuple_New(pb->nfields), *idx = NULL, *epoch = NULL,
           *index = NULL;
  for (int k = 0; arrays && k < pb->nfields; k++) {
    PyObject *x = (PyObject *)batch_buffer(batch, k);
    if (!x) Py_CLEAR(arrays);
    else
      PyTuple_SET_ITEM(arrays, k, x);
  }
  if (arrays) {
    PyObject *a = PyTuple_Pack(1, arrays);
    r = a ? PyTuple_Type.tp_new((PyTypeObject *)g_batch_class, a, NULL) : NULL;
    Py_XDECREF(a);
  }
  if (r) {
    idx = PyBytes_FromStringAndSize((const char *)pb->indices,
                                    (Py_ssize_t)(pb->samples * sizeof(uint64_t)));
    epoch = PyLong_FromUnsignedLongLong(pb->epoch);
    index = PyLong_FromUnsignedLongLong(pb->index);
    if (!idx || !epoch || !index || PyObject_SetAttr(r, g_str_epoch, epoch) < 0 ||
        PyObject_SetAttr(r, g_str_index, index) < 0 || PyObject_SetAttr(r, g_str_indices, idx) < 0)
      Py_CLEAR(r);
  }
  Py_XDECREF(arrays);
  Py_XDECREF(idx);
  Py_XDECREF(epoch);
  Py_XDECREF(index);
  Py_DECREF(batch); /* the buffers hold it now */
  return r;
}

static PyObject *Loader_state(LoaderObject *self, PyObject *unused) {
  if (loader_check(self) < 0) return NULL;
  pm_loader_state_t s;
  pm_status_t st = pm_loader_state(self->loader, &s);
  if (st != PM_OK) return raise_status(st);
  return PyBytes_FromStringAndSize((const char *)&s, sizeof s);
}

static PyObject *py_loader_state_fields(PyObject *mod, PyObject *arg) {
  Py_buffer v;
  if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE) < 0) return NULL;
  pm_loader_state_t s;
  int ok = v.len == (Py_ssize_t)sizeof s;
  if (ok) memcpy(&s, v.buf, sizeof s);
  PyBuffer_Release(&v);
  if (!ok) return raise_fmt(PM_ERR_INVALID, "a loader state has %zu bytes", sizeof s);
  return Py_BuildValue("{s:I,s:I,s:K,s:K,s:K,s:K,s:K,s:i,s:i}", "magic", s.magic, "flags",
                       s.flags, "epoch", (unsigned long long)s.epoch, "batch",
                       (unsigned long long)s.batch, "seed", (unsigned long long)s.seed, "samples",
                       (unsigned long long)s.samples, "batch_size",
                       (unsigned long long)s.batch_size, "rank", (int)s.rank, "world_size",
                       (int)s.world_size);
}

static PyObject *py_loader_state_pack(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"magic", "flags", "epoch", "batch", "seed", "samples", "batch_size",
                           "rank", "world_size", NULL};
  pm_loader_state_t s;
  memset(&s, 0, sizeof s);
  unsigned int magic, flags;
  unsigned long long epoch, batch, seed, samples, bs;
  int rank, world;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "$IIKKKKKii:_loader_state_pack", kwlist, &magic,
                                   &flags, &epoch, &batch, &seed, &samples, &bs, &rank, &world))
    return NULL;
  s.magic = magic;
  s.flags = flags;
  s.epoch = epoch;
  s.batch = batch;
  s.seed = seed;
  s.samples = samples;
  s.batch_size = bs;
  s.rank = rank;
  s.world_size = world;
  return PyBytes_FromStringAndSize((const char *)&s, sizeof s);
}

static PyObject *Loader_stats(LoaderObject *self, PyObject *unused) {
  if (loader_check(self) < 0) return NULL;
  pm_loader_stats_t s;
  pm_status_t st = pm_loader_get_stats(self->loader, &s);
  if (st != PM_OK) return raise_status(st);
  return Py_BuildValue(
      "{s:K,s:K,s:i,s:i,s:n,s:K,s:K,s:K,s:K,s:d,s:d,s:d,s:d,s:d,s:n,s:n,s:n}",
      "batches_per_epoch", (unsigned long long)s.batches_per_epoch, "samples_per_epoch",
      (unsigned long long)s.samples_per_epoch, "workers", s.workers, "prefetch", s.prefetch,
      "slot_bytes", (Py_ssize_t)s.slot_bytes, "batches", (unsigned long long)s.batches, "samples",
      (unsigned long long)s.samples, "bytes", (unsigned long long)s.bytes, "waits",
      (unsigned long long)s.waits, "stall_seconds", s.stall_seconds, "next_seconds",
      s.next_seconds, "read_seconds", s.read_seconds, "collate_seconds", s.collate_seconds,
      "copy_seconds", s.copy_seconds, "device_bytes", (Py_ssize_t)s.device_bytes, "host_bytes",
      (Py_ssize_t)s.host_bytes, "held", self->held);
}

static PyMethodDef Loader_methods[] = {
    {"next", (PyCFunction)Loader_next, METH_NOARGS,
     "next() -> a pinmem.Batch (one buffer per field), or None at the end"},
    {"state", (PyCFunction)Loader_state, METH_NOARGS, "state() -> bytes (pm_loader_state_t)"},
    {"stats", (PyCFunction)Loader_stats, METH_NOARGS, "stats() -> dict"},
    {"close", (PyCFunction)Loader_close, METH_NOARGS,
     "close(): stop the workers, free the slots (a held batch frees its own when it goes)"},
    {0}};

static PyTypeObject LoaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pinmem._Loader",
    .tp_basicsize = sizeof(LoaderObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The C loader (see pinmem.Loader).",
    .tp_new = Loader_new,
    .tp_dealloc = (destructor)Loader_dealloc,
    .tp_methods = Loader_methods,
};

/* ------------------------------------------------------------------------------------------ */
/* Pool, options, introspection                                                                */
/* ------------------------------------------------------------------------------------------ */

static int default_pool(pm_pool_t **pool) {
  pm_status_t st = pm_pool_default(pool);
  if (st != PM_OK) {
    raise_status(st);
    return -1;
  }
  return 0;
}

static PyObject *py_stats(PyObject *mod, PyObject *unused) {
  pm_pool_t *pool;
  if (default_pool(&pool) < 0) return NULL;
  pm_pool_stats_t s;
  pm_status_t st = pm_pool_get_stats(pool, &s);
  if (st != PM_OK) return raise_status(st);
  return Py_BuildValue(
      "{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:d,s:d}", "budget",
      (Py_ssize_t)s.budget, "pinned_bytes", (Py_ssize_t)s.pinned_bytes, "pinned_peak",
      (Py_ssize_t)s.pinned_peak, "in_use_bytes", (Py_ssize_t)s.in_use_bytes, "requested_bytes",
      (Py_ssize_t)s.requested_bytes, "cached_bytes", (Py_ssize_t)s.cached_bytes, "pending_bytes",
      (Py_ssize_t)s.pending_bytes, "registered_bytes", (Py_ssize_t)s.registered_bytes, "segments",
      (unsigned long long)s.segments, "allocs", (unsigned long long)s.allocs, "frees",
      (unsigned long long)s.frees, "cache_hits", (unsigned long long)s.cache_hits,
      "backend_allocs", (unsigned long long)s.backend_allocs, "backend_frees",
      (unsigned long long)s.backend_frees, "budget_waits", (unsigned long long)s.budget_waits,
      "budget_failures", (unsigned long long)s.budget_failures, "backend_alloc_seconds",
      s.backend_alloc_seconds, "backend_free_seconds", s.backend_free_seconds);
}

static PyObject *py_budget(PyObject *mod, PyObject *unused) {
  pm_pool_t *pool;
  if (default_pool(&pool) < 0) return NULL;
  pm_pool_stats_t s;
  pm_status_t st = pm_pool_get_stats(pool, &s);
  if (st != PM_OK) return raise_status(st);
  return PyLong_FromSize_t(s.budget);
}

static PyObject *py_set_budget(PyObject *mod, PyObject *arg) {
  size_t bytes;
  if (parse_size_obj(arg, &bytes) < 0) return NULL;
  pm_pool_t *pool;
  if (default_pool(&pool) < 0) return NULL;
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_pool_set_budget(pool, bytes);
  Py_END_ALLOW_THREADS if (st != PM_OK) return raise_status(st);
  Py_RETURN_NONE;
}

static PyObject *py_trim(PyObject *mod, PyObject *unused) {
  pending_sweep(0);
  pm_pool_t *pool;
  if (default_pool(&pool) < 0) return NULL;
  size_t released = 0;
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_pool_trim(pool, &released);
  Py_END_ALLOW_THREADS if (st != PM_OK) return raise_status(st);
  return PyLong_FromSize_t(released);
}

static PyObject *py_reserve(PyObject *mod, PyObject *arg) {
  size_t bytes;
  if (parse_size_obj(arg, &bytes) < 0) return NULL;
  pm_pool_t *pool;
  if (default_pool(&pool) < 0) return NULL;
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_pool_reserve(pool, bytes, PM_HOST_DEFAULT);
  Py_END_ALLOW_THREADS if (st != PM_OK) return raise_status(st);
  Py_RETURN_NONE;
}

static PyObject *py_reset_peak(PyObject *mod, PyObject *unused) {
  pm_pool_t *pool;
  if (default_pool(&pool) < 0) return NULL;
  pm_status_t st = pm_pool_reset_peak(pool);
  if (st != PM_OK) return raise_status(st);
  Py_RETURN_NONE;
}

static const char *const g_source_names[] = {"default", "env", "set"};

static PyObject *option_dict(const pm_option_info_t *o) {
  return Py_BuildValue("{s:s,s:s,s:s,s:s,s:s}", "value", o->value, "default", o->default_value,
                       "env", o->env, "source",
                       (unsigned)o->source < 3 ? g_source_names[o->source] : "?", "doc", o->doc);
}

static PyObject *py_options(PyObject *mod, PyObject *unused) {
  PyObject *d = PyDict_New();
  if (!d) return NULL;
  int n = pm_option_count();
  for (int i = 0; i < n; i++) {
    pm_option_info_t o;
    pm_status_t st = pm_option_get(i, &o);
    if (st != PM_OK) {
      Py_DECREF(d);
      return raise_status(st);
    }
    PyObject *v = option_dict(&o);
    if (!v || PyDict_SetItemString(d, o.name, v) < 0) {
      Py_XDECREF(v);
      Py_DECREF(d);
      return NULL;
    }
    Py_DECREF(v);
  }
  return d;
}

static PyObject *py_get_option(PyObject *mod, PyObject *arg) {
  const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
  if (!name) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "option name must be a string");
    return NULL;
  }
  pm_option_info_t o;
  pm_status_t st = pm_option_find(name, &o);
  if (st != PM_OK) return raise_status(st);
  return PyUnicode_FromString(o.value);
}

static PyObject *py_set_option(PyObject *mod, PyObject *args) {
  const char *name;
  PyObject *value;
  if (!PyArg_ParseTuple(args, "sO:set_option", &name, &value)) return NULL;
  PyObject *text = PyUnicode_Check(value) ? Py_NewRef(value)
                   : PyBool_Check(value)  ? PyUnicode_FromString(value == Py_True ? "1" : "0")
                                          : PyObject_Str(value);
  if (!text) return NULL;
  const char *v = PyUnicode_AsUTF8(text);
  if (!v) {
    Py_DECREF(text);
    return NULL;
  }
  pm_status_t st = pm_option_set(name, v);
  Py_DECREF(text);
  if (st != PM_OK) return raise_status(st);
  Py_RETURN_NONE;
}

static PyObject *py_parse_size(PyObject *mod, PyObject *arg) {
  size_t v;
  if (parse_size_obj(arg, &v) < 0) return NULL;
  return PyLong_FromSize_t(v);
}

static PyObject *py_pointer_info(PyObject *mod, PyObject *arg) {
  static const char *const kinds[] = {"pageable", "pool", "registered", "managed", "device"};
  const void *p;
  if (Buffer_Check(arg)) {
    if (buffer_check_live((BufferObject *)arg) < 0) return NULL;
    p = ((BufferObject *)arg)->ptr;
  } else if (PyLong_Check(arg)) {
    uintptr_t v;
    if (parse_address(arg, &v) < 0) return NULL;
    p = (const void *)v;
  } else if (PyObject_CheckBuffer(arg)) {
    Py_buffer v;
    if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE) < 0) return NULL;
    p = v.buf;
    PyBuffer_Release(&v);
  } else {
    PyErr_Format(PyExc_TypeError, "pointer_info takes an int address, a pinmem buffer or a "
                                  "buffer-protocol object, not %.100s",
                 Py_TYPE(arg)->tp_name);
    return NULL;
  }
  pm_pointer_info_t info;
  pm_status_t st = pm_pointer_query(p, &info);
  if (st != PM_OK) return raise_status(st);
  return Py_BuildValue("{s:s,s:K,s:n,s:I,s:K,s:O}", "kind",
                       (unsigned)info.kind < 5 ? kinds[info.kind] : "?", "base",
                       (unsigned long long)(uintptr_t)info.base, "size", (Py_ssize_t)info.size,
                       "flags", info.flags, "device_ptr",
                       (unsigned long long)(uintptr_t)info.device_ptr, "in_use",
                       info.in_use ? Py_True : Py_False);
}

static PyObject *py_init(PyObject *mod, PyObject *unused) {
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_init();
  Py_END_ALLOW_THREADS if (st != PM_OK) return raise_status(st);
  return PyUnicode_FromString(pm_backend_name());
}

static PyObject *py_backend(PyObject *mod, PyObject *unused) {
  if (pm_backend_kind() == PM_BACKEND_NONE) {
    pm_status_t st;
    Py_BEGIN_ALLOW_THREADS st = pm_init();
    Py_END_ALLOW_THREADS if (st != PM_OK) return raise_status(st);
  }
  return PyUnicode_FromString(pm_backend_name());
}

static PyObject *py_device_count(PyObject *mod, PyObject *unused) {
  int n = 0;
  pm_status_t st = pm_device_count(&n);
  if (st != PM_OK) return raise_status(st);
  return PyLong_FromLong(n);
}

static PyObject *py_device_info(PyObject *mod, PyObject *args) {
  int dev = 0;
  if (!PyArg_ParseTuple(args, "|i:device_info", &dev)) return NULL;
  pm_device_info_t d;
  pm_status_t st = pm_device_get_info(dev, &d);
  if (st != PM_OK) return raise_status(st);
  return Py_BuildValue(
      "{s:i,s:s,s:(ii),s:n,s:n,s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:O,s:O,s:O,s:O,s:O,s:O}", "index",
      d.index, "name", d.name, "compute_capability", d.cc_major, d.cc_minor, "total_memory",
      (Py_ssize_t)d.total_memory, "free_memory", (Py_ssize_t)d.free_memory, "pci_bus_id",
      d.pci_bus_id, "pcie_gen", d.pcie_gen, "pcie_width", d.pcie_width, "pcie_max_gen",
      d.pcie_max_gen, "pcie_max_width", d.pcie_max_width, "numa_node", d.numa_node,
      "async_engines", d.async_engines, "can_map_host_memory",
      d.can_map_host_memory ? Py_True : Py_False, "unified_addressing",
      d.unified_addressing ? Py_True : Py_False, "managed_memory",
      d.managed_memory ? Py_True : Py_False, "concurrent_managed_access",
      d.concurrent_managed_access ? Py_True : Py_False, "host_register_supported",
      d.host_register_supported ? Py_True : Py_False, "host_register_read_only",
      d.host_register_read_only ? Py_True : Py_False);
}

static PyObject *py_synchronize(PyObject *mod, PyObject *unused) {
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_device_synchronize();
  Py_END_ALLOW_THREADS if (st != PM_OK) return raise_status(st);
  pending_sweep(0);
  Py_RETURN_NONE;
}

static PyObject *py_pending_copies(PyObject *mod, PyObject *unused) {
  pending_sweep(0);
  Py_ssize_t n = 0;
  for (pending_t *p = g_pending; p; p = p->next) n++;
  return PyLong_FromSsize_t(n);
}

static PyObject *py_shutdown(PyObject *mod, PyObject *unused) {
  pending_sweep(1);
  Py_RETURN_NONE;
}

static PyObject *py_status_name(PyObject *mod, PyObject *arg) {
  long v = PyLong_AsLong(arg);
  if (v == -1 && PyErr_Occurred()) return NULL;
  return PyUnicode_FromString(pm_status_name((pm_status_t)v));
}

static PyObject *py_raise_status(PyObject *mod, PyObject *args) {
  int st;
  const char *detail = "";
  if (!PyArg_ParseTuple(args, "i|s:_raise", &st, &detail)) return NULL;
  return raise_detail((pm_status_t)st, detail);
}

static PyMethodDef module_methods[] = {
    {"empty", (PyCFunction)(void (*)(void))py_empty, METH_VARARGS | METH_KEYWORDS,
     "empty(shape, dtype, *, mapped=False, write_combined=False, portable=False) -> PinnedBuffer"},
    {"device_empty", (PyCFunction)(void (*)(void))py_device_empty, METH_VARARGS | METH_KEYWORDS,
     "device_empty(shape, dtype) -> DeviceBuffer (device memory of the current device)"},
    {"pin", (PyCFunction)(void (*)(void))py_pin, METH_VARARGS | METH_KEYWORDS,
     "pin(obj, *, mapped=False, portable=False) -> PinnedBuffer over obj's memory, pinned in place"},
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_VARARGS | METH_KEYWORDS,
     "copy(dst, src, stream=None, *, nbytes=None, path=None) -> Completion"},
    {"stats", py_stats, METH_NOARGS, "stats() -> dict: the default pool's statistics"},
    {"budget", py_budget, METH_NOARGS, "budget() -> int: the default pool's budget in bytes"},
    {"set_budget", py_set_budget, METH_O, "set_budget(size): change the default pool's budget"},
    {"trim", py_trim, METH_NOARGS, "trim() -> int: give cached pinned memory back; bytes released"},
    {"reserve", py_reserve, METH_O, "reserve(size): pin size bytes now, cached for later use"},
    {"reset_peak", py_reset_peak, METH_NOARGS, "reset_peak(): restart stats()['pinned_peak']"},
    {"options", py_options, METH_NOARGS,
     "options() -> {name: {value, default, env, source, doc}}: the option table in force"},
    {"get_option", py_get_option, METH_O, "get_option(name) -> str: the value in force"},
    {"set_option", py_set_option, METH_VARARGS,
     "set_option(name, value): set an option (wins over the environment)"},
    {"parse_size", py_parse_size, METH_O, "parse_size('1.5M') -> 1572864"},
    {"pointer_info", py_pointer_info, METH_O,
     "pointer_info(addr_or_buffer) -> dict: what pinmem knows of the address"},
    {"init", py_init, METH_NOARGS, "init() -> backend name: start the library now"},
    {"backend", py_backend, METH_NOARGS, "backend() -> 'cuda' or 'host'"},
    {"device_count", py_device_count, METH_NOARGS, "device_count() -> int"},
    {"device_info", py_device_info, METH_VARARGS, "device_info(device=0) -> dict"},
    {"synchronize", py_synchronize, METH_NOARGS, "synchronize(): wait for the current device"},
    {"_pending_copies", py_pending_copies, METH_NOARGS,
     "Copies in flight whose Completion was dropped (tests)."},
    {"_shutdown", py_shutdown, METH_NOARGS, "Wait for every copy in flight (atexit)."},
    {"_dataset_npy", (PyCFunction)(void (*)(void))py_dataset_npy, METH_VARARGS | METH_KEYWORDS,
     "_dataset_npy(paths, io=None, dtype=None)"},
    {"_dataset_tokens", (PyCFunction)(void (*)(void))py_dataset_tokens,
     METH_VARARGS | METH_KEYWORDS,
     "_dataset_tokens(path, seq_len, token_bytes=2, random=True, stride=0, windows=0, seed=0, "
     "io=None)"},
    {"_dataset_arrays", py_dataset_arrays, METH_VARARGS,
     "_dataset_arrays(arrays, [(sample shape, dtype text, itemsize)]): field k from arrays[k]"},
    {"_dataset_python", py_dataset_python, METH_VARARGS,
     "_dataset_python(fetch, samples, [(sample shape, dtype text, itemsize)] per field)"},
    {"_dataset_zip", py_dataset_zip, METH_O, "_dataset_zip(datasets): their fields side by side"},
    {"_set_batch_class", py_set_batch_class, METH_O, "_set_batch_class(cls): pinmem.Batch"},
    {"_loader_state_fields", py_loader_state_fields, METH_O, NULL},
    {"_loader_state_pack", (PyCFunction)(void (*)(void))py_loader_state_pack,
     METH_VARARGS | METH_KEYWORDS, NULL},
    {"_status_name", py_status_name, METH_O, NULL},
    {"_raise", py_raise_status, METH_VARARGS, NULL},
    {0}};

/* ------------------------------------------------------------------------------------------ */
/* Module                                                                                      */
/* ------------------------------------------------------------------------------------------ */

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pinmem._pinmem",
    .m_doc = "pinmem's C extension: pinned host memory, copies and the data loader.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__pinmem(void);
PyMODINIT_FUNC PyInit__pinmem(void) {
  if (PyType_Ready(&StreamType) < 0 || PyType_Ready(&BufferType) < 0 ||
      PyType_Ready(&PinnedBufferType) < 0 || PyType_Ready(&DeviceBufferType) < 0 ||
      PyType_Ready(&CompletionType) < 0 || PyType_Ready(&DatasetType) < 0 ||
      PyType_Ready(&LoaderType) < 0 || PyType_Ready(&BatchType) < 0)
    return NULL;
  PyObject *m = PyModule_Create(&module_def);
  if (!m) return NULL;
  if (init_exceptions(m) < 0 || PyModule_AddType(m, &StreamType) < 0 ||
      PyModule_AddType(m, &BufferType) < 0 || PyModule_AddType(m, &PinnedBufferType) < 0 ||
      PyModule_AddType(m, &DeviceBufferType) < 0 || PyModule_AddType(m, &CompletionType) < 0 ||
      PyModule_AddObjectRef(m, "_Loader", (PyObject *)&LoaderType) < 0 ||
      PyModule_AddObjectRef(m, "_Dataset", (PyObject *)&DatasetType) < 0 ||
      PyModule_AddIntConstant(m, "_LOADER_STATE_MAGIC", (long)PM_LOADER_STATE_MAGIC) < 0 ||
      PyModule_AddStringConstant(m, "version", pm_version()) < 0 ||
      PyModule_AddIntConstant(m, "DLPACK_CPU", kDLCPU) < 0 ||
      PyModule_AddIntConstant(m, "DLPACK_CUDA", kDLCUDA) < 0 ||
      PyModule_AddIntConstant(m, "DLPACK_CUDA_HOST", kDLCUDAHost) < 0 ||
#ifdef PMPY_DLPACK_VERSIONED
      PyModule_AddIntConstant(m, "DLPACK_VERSIONED", 1) < 0) {
#else
      PyModule_AddIntConstant(m, "DLPACK_VERSIONED", 0) < 0) {
#endif
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
