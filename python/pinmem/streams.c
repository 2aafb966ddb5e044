/*
 * DESIGN: pinmem.Stream, a pinmem stream (a cudaStream_t under the cuda backend) that closes
 * once, waiting for its queued work; and the parser every stream argument goes through: None, a
 * pinmem.Stream, an int handle, or torch's and CuPy's stream objects. For the tests, a gate: a
 * host function that holds a stream until the test opens it (_stream_gate, below).
 *
 * Closing under a running call. Every call that takes a stream argument holds it from the parse
 * to its return (pmpy_stream_take .. pmpy_stream_drop), also while it runs with the GIL released:
 * a use (`uses`, counted under the GIL) and a strong reference, so the object cannot be collected
 * meanwhile either. close() marks the stream closed at once, so every later call is refused
 * (StateError "the pinmem.Stream is closed"), and destroys it only when no call holds it;
 * otherwise the last call to drop it destroys it, as it returns. close() never waits for another
 * thread's call: it may run on a thread that holds the GIL that call needs to finish, or inside a
 * callback of that very call (a __dlpack__ or __index__ the call runs), and waiting there would
 * deadlock. Handles taken out as ints (Stream.ptr, refused once closed) are not counted: whoever
 * passes one answers for its lifetime, as with torch's and CuPy's streams.
 */
#include "_pinmem.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

typedef struct {
  PyObject_HEAD pm_stream_t stream;
  int live;        /* not closed: calls may take it */
  int destroyed;   /* pm_stream_destroy was called (by close, the last drop or dealloc) */
  Py_ssize_t uses; /* calls holding it (pmpy_stream_take); under the GIL */
} StreamObject;

static PyObject *stream_closed_error(void) {
  return pmpy_raise_fmt(PM_ERR_STATE, "the pinmem.Stream is closed");
}

/* Destroy the handle (once), waiting for its queued work with the GIL released. */
static pm_status_t stream_destroy(StreamObject *self) {
  if (self->destroyed) return PM_OK;
  self->destroyed = 1;
  pm_status_t st;
  pm_stream_t s = self->stream;
  Py_BEGIN_ALLOW_THREADS st = pm_stream_destroy(s);
  Py_END_ALLOW_THREADS return st;
}

/* A stream argument: None (the default stream), a pinmem.Stream, an int handle (a cudaStream_t
 * under the cuda backend), or an object with .cuda_stream (torch.cuda.Stream) or .ptr (CuPy).
 * DLPack's 1 (legacy default) and 2 (per-thread default) stay themselves under the cuda backend,
 * where they are cudaStreamLegacy and cudaStreamPerThread; under the host backend they and 0 mean
 * the default stream. A pinmem.Stream is taken for the call: every successful take is paired
 * with one pmpy_stream_drop(o) of the same object, after the last use of *out. */
int pmpy_stream_take(PyObject *o, pm_stream_t *out) {
  if (o == NULL || o == Py_None) {
    *out = NULL;
    return 0;
  }
  if (PyObject_TypeCheck(o, &pmpy_StreamType)) {
    StreamObject *s = (StreamObject *)o;
    if (!s->live) {
      stream_closed_error();
      return -1;
    }
    s->uses++;
    Py_INCREF(o);
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

/* The end of a call's pmpy_stream_take(o): a stream closed meanwhile is destroyed by the last
 * call to let it go (waiting for its queued work, the GIL released). A failure of that destroy
 * has nobody to tell but the warnings: the call itself did what it was asked. Leaves a raised
 * exception as it was. */
void pmpy_stream_drop(PyObject *o) {
  if (o == NULL || !PyObject_TypeCheck(o, &pmpy_StreamType)) return;
  StreamObject *s = (StreamObject *)o;
  if (--s->uses == 0 && !s->live && !s->destroyed) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    pm_status_t st = stream_destroy(s);
    if (st != PM_OK && PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                                        "pinmem: destroying a closed pinmem.Stream failed: %s: %s",
                                        pm_status_name(st), pm_last_error()) < 0)
      PyErr_WriteUnraisable(o);
    PyErr_Restore(et, ev, tb);
  }
  Py_DECREF(o);
}

static PyObject *Stream_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {NULL};
  if (!PyArg_ParseTupleAndKeywords(args, kw, ":Stream", kwlist)) return NULL;
  StreamObject *self = (StreamObject *)type->tp_alloc(type, 0);
  if (!self) return NULL;
  self->destroyed = 1; /* until there is a handle */
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_stream_create(&self->stream);
  Py_END_ALLOW_THREADS if (st != PM_OK) {
    Py_DECREF(self);
    return pmpy_raise_status(st);
  }
  self->destroyed = 0;
  self->live = 1;
  return (PyObject *)self;
}

/* No call holds the object here: each holds a reference (pmpy_stream_take). */
static void Stream_dealloc(StreamObject *self) {
  self->live = 0;
  (void)stream_destroy(self);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Closed at once for new calls; destroyed now, or by the last call still holding it. */
static PyObject *Stream_close(StreamObject *self, PyObject *unused) {
  if (!self->live) Py_RETURN_NONE;
  self->live = 0;
  if (self->uses > 0) Py_RETURN_NONE;
  pm_status_t st = stream_destroy(self);
  if (st != PM_OK) return pmpy_raise_status(st);
  Py_RETURN_NONE;
}

static PyObject *Stream_synchronize(StreamObject *self, PyObject *unused) {
  pm_stream_t s;
  if (pmpy_stream_take((PyObject *)self, &s) < 0) return NULL;
  /* An error is raised before the drop, whose destroy would overwrite pm_last_error(). */
  pm_status_t st;
  PyObject *result;
  Py_BEGIN_ALLOW_THREADS st = pm_stream_synchronize(s);
  Py_END_ALLOW_THREADS result = st == PM_OK ? Py_NewRef(Py_None) : pmpy_raise_status(st);
  pmpy_stream_drop((PyObject *)self);
  return result;
}

static PyObject *Stream_query(StreamObject *self, PyObject *unused) {
  if (!self->live) return stream_closed_error();
  pm_status_t st = pm_stream_query(self->stream);
  if (st == PM_OK) Py_RETURN_TRUE;
  if (st == PM_NOT_READY) Py_RETURN_FALSE;
  return pmpy_raise_status(st);
}

/* Refused once closed: the handle may be destroyed, or be at any moment. */
static PyObject *Stream_ptr(StreamObject *self, void *unused) {
  if (!self->live) return stream_closed_error();
  return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)self->stream);
}

static PyObject *Stream_get_closed(StreamObject *self, void *unused) {
  return PyBool_FromLong(!self->live);
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
     "Refuse later calls; wait for the queued work, then destroy the stream. While calls on "
     "other threads hold it, return at once: the last of them destroys it as it returns."},
    {"__enter__", (PyCFunction)Stream_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Stream_exit, METH_VARARGS, NULL},
    {0}};

static PyGetSetDef Stream_getset[] = {
    {"ptr", (getter)Stream_ptr, NULL, "The handle as an int (a cudaStream_t under cuda).", NULL},
    {"cuda_stream", (getter)Stream_ptr, NULL, "Same as ptr (torch.cuda.Stream's name).", NULL},
    {"closed", (getter)Stream_get_closed, NULL, "True once close() was called.", NULL},
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
  if (pmpy_stream_take(so, &s) < 0) return NULL;
  gate_t *g = calloc(1, sizeof *g);
  if (!g) {
    pmpy_stream_drop(so);
    return PyErr_NoMemory();
  }
  pthread_mutex_init(&g->mu, NULL);
  pthread_cond_init(&g->cv, NULL);
  g->hold = hold;
  g->refs = 2; /* the host function and _gate_open */
  pm_status_t st = pm_launch_host_func(s, gate_fn, g);
  pmpy_stream_drop(so);
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
