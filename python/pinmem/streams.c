/*
 * DESIGN: pinmem.Stream, a pinmem stream (a cudaStream_t under the cuda backend) that closes
 * once, waiting for its queued work; and the parser every stream argument goes through: None, a
 * pinmem.Stream, an int handle, or torch's and CuPy's stream objects. For the tests, a gate: a
 * host function that holds a stream until the test opens it (_stream_gate, below).
 */
#include "_pinmem.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

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

/* ---- test gates ------------------------------------------------------------------------------
 * _stream_gate(stream, hold=True) queues a host function on the stream that marks the gate
 * reached and, when hold is set, blocks the stream there until _gate_open: the Python tests force
 * the ordering they name (work queued behind the gate cannot have run, work ordered after it
 * must wait) as the C tests do with pm_launch_host_func. A gate nobody opens lets go by itself
 * after GATE_LIMIT_S, so a failing test cannot hang the stream for ever; _gate_open says whether
 * it still held. The gate is freed by whichever of the host function and _gate_open is last. */
#define GATE_LIMIT_S 120

typedef struct gate {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int hold, reached, opened, timed_out, refs;
} gate_t;

static void gate_unref(gate_t *g) {
  pthread_mutex_lock(&g->mu);
  int last = --g->refs == 0;
  pthread_mutex_unlock(&g->mu);
  if (last) {
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
    free(g);
  }
}

static void gate_fn(void *arg) {
  gate_t *g = arg;
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += GATE_LIMIT_S;
  pthread_mutex_lock(&g->mu);
  g->reached = 1;
  pthread_cond_broadcast(&g->cv);
  while (g->hold && !g->opened && !g->timed_out)
    if (pthread_cond_timedwait(&g->cv, &g->mu, &until) == ETIMEDOUT) g->timed_out = 1;
  pthread_mutex_unlock(&g->mu);
  gate_unref(g);
}

static gate_t *gate_of(PyObject *h) {
  uintptr_t v;
  if (pmpy_parse_address(h, &v) < 0) return NULL;
  if (!v) PyErr_SetString(PyExc_ValueError, "not a gate");
  return (gate_t *)v;
}

static PyObject *py_stream_gate(PyObject *mod, PyObject *args) {
  PyObject *so;
  int hold = 1;
  if (!PyArg_ParseTuple(args, "O|p:_stream_gate", &so, &hold)) return NULL;
  pm_stream_t s;
  if (pmpy_parse_stream(so, &s) < 0) return NULL;
  gate_t *g = calloc(1, sizeof *g);
  if (!g) return PyErr_NoMemory();
  pthread_mutex_init(&g->mu, NULL);
  pthread_cond_init(&g->cv, NULL);
  g->hold = hold;
  g->refs = 2; /* the host function and _gate_open */
  pm_status_t st = pm_launch_host_func(s, gate_fn, g);
  if (st != PM_OK) {
    g->refs = 1;
    gate_unref(g);
    return pmpy_raise_status(st);
  }
  return PyLong_FromVoidPtr(g);
}

/* _gate_reached(gate, timeout): whether the stream got to the gate within timeout seconds. */
static PyObject *py_gate_reached(PyObject *mod, PyObject *args) {
  PyObject *h;
  double timeout;
  if (!PyArg_ParseTuple(args, "Od:_gate_reached", &h, &timeout)) return NULL;
  gate_t *g = gate_of(h);
  if (!g) return NULL;
  int reached;
  Py_BEGIN_ALLOW_THREADS struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  double whole = timeout > 0 ? (double)(long long)timeout : 0;
  until.tv_sec += (time_t)whole;
  until.tv_nsec += timeout > 0 ? (long)((timeout - whole) * 1e9) : 0;
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec++;
    until.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&g->mu);
  while (!g->reached && pthread_cond_timedwait(&g->cv, &g->mu, &until) != ETIMEDOUT) {
  }
  reached = g->reached;
  pthread_mutex_unlock(&g->mu);
  Py_END_ALLOW_THREADS return PyBool_FromLong(reached);
}

/* _gate_open(gate): let the stream go on; True when the gate was still holding it (or not yet
 * reached), False when it had let go by itself. The handle is gone afterwards. */
static PyObject *py_gate_open(PyObject *mod, PyObject *h) {
  gate_t *g = gate_of(h);
  if (!g) return NULL;
  pthread_mutex_lock(&g->mu);
  g->opened = 1;
  int held = !g->timed_out;
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
  gate_unref(g);
  return PyBool_FromLong(held);
}

PyMethodDef pmpy_streams_functions[] = {
    {"_stream_gate", py_stream_gate, METH_VARARGS,
     "_stream_gate(stream, hold=True) -> gate: a host function on stream (tests)."},
    {"_gate_reached", py_gate_reached, METH_VARARGS,
     "_gate_reached(gate, timeout) -> bool: the stream got to the gate (tests)."},
    {"_gate_open", py_gate_open, METH_O, "_gate_open(gate) -> bool: let the stream go (tests)."},
    {0}};
