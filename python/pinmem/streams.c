/*
 * DESIGN: pinmem.Stream, a pinmem stream (a cudaStream_t under the cuda backend) that closes
 * once, waiting for its queued work; and the parser every stream argument goes through: None, a
 * pinmem.Stream, an int handle, or torch's and CuPy's stream objects.
 */
#include "_pinmem.h"

typedef struct {
  PyObject_HEAD pm_stream_t stream;
  int live;
} StreamObject;

/* A stream argument: None (the default stream), a pinmem.Stream, an int handle (a cudaStream_t
 * under the cuda backend), or an object with .cuda_stream (torch.cuda.Stream) or .ptr (CuPy).
 * DLPack's 1 (legacy default) and 2 (per-thread default) stay themselves under the cuda backend,
 * where they are cudaStreamLegacy and cudaStreamPerThread; under the host backend they and 0 mean
 * the default stream. */
int pmpy_parse_stream(PyObject *o, pm_stream_t *out) {
  if (o == NULL || o == Py_None) {
    *out = NULL;
    return 0;
  }
  if (PyObject_TypeCheck(o, &pmpy_StreamType)) {
    StreamObject *s = (StreamObject *)o;
    if (!s->live) {
      pmpy_raise_fmt(PM_ERR_STATE, "the pinmem.Stream was closed");
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
  int rc = pmpy_parse_address(h, &v);
  Py_DECREF(h);
  if (rc < 0) return -1;
  if (v == 0 || ((v == 1 || v == 2) && !pmpy_is_cuda_backend()))
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
    return pmpy_raise_status(st);
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
  if (st != PM_OK) return pmpy_raise_status(st);
  Py_RETURN_NONE;
}

static PyObject *Stream_synchronize(StreamObject *self, PyObject *unused) {
  if (!self->live) return pmpy_raise_fmt(PM_ERR_STATE, "the pinmem.Stream was closed");
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_stream_synchronize(self->stream);
  Py_END_ALLOW_THREADS if (st != PM_OK) return pmpy_raise_status(st);
  Py_RETURN_NONE;
}

static PyObject *Stream_query(StreamObject *self, PyObject *unused) {
  if (!self->live) return pmpy_raise_fmt(PM_ERR_STATE, "the pinmem.Stream was closed");
  pm_status_t st = pm_stream_query(self->stream);
  if (st == PM_OK) Py_RETURN_TRUE;
  if (st == PM_NOT_READY) Py_RETURN_FALSE;
  return pmpy_raise_status(st);
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

PyTypeObject pmpy_StreamType = {
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
