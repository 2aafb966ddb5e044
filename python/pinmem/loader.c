/*
 * DESIGN: pinmem._Loader over pm_loader_t, and its batches. next() wraps one C batch in a
 * _Batch, and gives each field a Buffer over it (kind 'external', described by batch_layout.h),
 * which holds the _Batch: when the last of them goes, the batch goes back to the loader, ordered
 * after the stream a DLPack consumer named. Also the resume state (packed and unpacked) and
 * stats().
 */
#include "_pinmem.h"

#include "batch_layout.h"

#include <unistd.h>

typedef struct {
  PyObject_HEAD pm_loader_t *loader; /* NULL once closed */
  DatasetObject *dataset;
  Py_ssize_t held; /* batches delivered and not given back yet */
  int device;      /* batches in device memory */
  int dev_index;
  int unbatched; /* batches of one sample, delivered without the batch axis (batch_size=None) */
  pid_t pid;     /* the process that made it: a forked child's copies of its batches are not its */
} LoaderObject;

/* One delivered batch. Its buffers (one per field) hold it; when the last of them goes, the
 * batch goes back to the loader, ordered after the consumer stream DLPack named. This works
 * after the loader was closed too: pm_batch_release then frees the batch's slot. */
typedef struct {
  PyObject_HEAD pm_batch_t b;
  LoaderObject *loader;
  uintptr_t release_stream;
} BatchObject;

static PyObject *g_batch_class; /* pinmem.Batch (a tuple subclass), set by _set_batch_class */
static PyObject *g_str_epoch, *g_str_index, *g_str_indices;

static void Batch_dealloc(BatchObject *self) {
  /* In a forked child, a batch the parent held (the child's copy of it, dropped there or
   * collected with the parent's garbage) belongs to the parent's loader: the slot is the
   * parent's to give back, and the child has nothing to release. It is only forgotten, as
   * pm_loader_destroy forgets the parent's loader in a child, with no warning from a process
   * that did nothing wrong. */
  if (self->loader && self->loader->pid != getpid()) {
    self->loader->held--;
    Py_CLEAR(self->loader);
  }
  if (self->loader) {
    pm_stream_t s = NULL;
    uintptr_t v = self->release_stream;
    if (v && v != (uintptr_t)-1 && (pmpy_is_cuda_backend() || v > 2)) s = (pm_stream_t)v;
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

PyTypeObject pmpy_BatchType = {
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
  const pmpy_dtype_t *dt = pmpy_dtype_from_text(f->info->descr);
  if (dt && (size_t)(dt->bits / 8) != f->info->itemsize) dt = NULL;
  /* batch_size=None: the one sample's arrays, without the batch axis (odd dtypes stay flat bytes,
   * viewed by the Python side) */
  int drop = batch->loader->unbatched && dt && batch->b.samples == 1;
  int ndim = dt ? f->ndim - drop : 1;
  BufferObject *buf = pmpy_buffer_alloc(&pmpy_BufferType, ndim);
  if (!buf) return NULL;
  /* The descriptor (shape, strides) comes from batch_layout.h, which the .npy fuzz target
   * drives too. */
  pmpy_layout_t lay;
  const char *why = NULL;
  if (pmpy_batch_layout(dt ? dt->bits / 8 : 0, f->ndim, f->shape, batch->b.samples, f->bytes, 0,
                        &lay, &why) < 0) {
    Py_DECREF(buf);
    pmpy_raise_fmt(PM_ERR_INTERNAL, "a loader batch cannot be described: %s", why);
    return NULL;
  }
  if (pmpy_buffer_set_ndim(buf, lay.ndim - drop) < 0 ||
      pmpy_buffer_set_format(buf, dt ? dt->format : "B") < 0) {
    Py_DECREF(buf);
    return NULL;
  }
  buf->dtype = dt;
  buf->itemsize = (Py_ssize_t)lay.itemsize;
  for (int i = drop; i < lay.ndim; i++) {
    buf->shape[i - drop] = (Py_ssize_t)lay.shape[i];
    pmpy_buf_strides(buf)[i - drop] = (Py_ssize_t)lay.strides[i];
  }
  buf->kind = BUF_EXTERNAL;
  buf->ptr = f->data;
  buf->nbytes = f->bytes;
  buf->released = 0;
  buf->host_visible = !batch->loader->device;
  if (batch->loader->device) {
    buf->dl_device_type = pmpy_is_cuda_backend() ? kDLCUDA : kDLCPU;
    buf->dl_device_id = pmpy_is_cuda_backend() ? batch->loader->dev_index : 0;
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
                           "device",     "epochs",     "resume",  "shared_slots",
                           "ordered_workers", "claim_rows", "lease_slots", "unbatched", NULL};
  PyObject *dataset, *resume = Py_None;
  Py_ssize_t batch_size;
  int workers = 0, prefetch = 0, shuffle = 0, drop_last = 0, rank = -1, world = -1, pin = 1,
      device = 1, shared = 0, ordered = 0, lease = 0, unbatched = 0;
  unsigned long long seed = 0, epochs = 0, claim = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O!n|$iipKpiippKOppKpp:_Loader", kwlist,
                                   &pmpy_DatasetType, &dataset, &batch_size, &workers, &prefetch,
                                   &shuffle, &seed, &drop_last, &rank, &world, &pin, &device,
                                   &epochs, &resume, &shared, &ordered, &claim, &lease,
                                   &unbatched))
    return NULL;
  if (batch_size <= 0) return pmpy_raise_fmt(PM_ERR_INVALID, "batch_size must be > 0");
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
  c.shared_slots = shared;
  c.ordered_workers = ordered;
  c.claim_rows = claim;
  c.lease_slots = lease;
  pm_loader_state_t state;
  if (resume != Py_None) {
    Py_buffer v;
    if (PyObject_GetBuffer(resume, &v, PyBUF_SIMPLE) < 0) return NULL;
    int ok = v.len == (Py_ssize_t)sizeof state;
    if (ok) memcpy(&state, v.buf, sizeof state);
    PyBuffer_Release(&v);
    if (!ok)
      return pmpy_raise_fmt(PM_ERR_INVALID, "resume state must be %zu bytes (from state())",
                            sizeof state);
    c.resume = &state;
  }
  LoaderObject *self = (LoaderObject *)type->tp_alloc(type, 0);
  if (!self) return NULL;
  self->dataset = (DatasetObject *)Py_NewRef(dataset);
  self->device = device;
  self->unbatched = unbatched;
  self->pid = getpid();
  pm_status_t st;
  pm_dataset_t *ds = self->dataset->ds;
  Py_BEGIN_ALLOW_THREADS st = pm_loader_create(ds, &c, &self->loader);
  if (st == PM_OK && device) st = pm_device_get(&self->dev_index);
  Py_END_ALLOW_THREADS if (st != PM_OK) {
    Py_DECREF(self);
    return pmpy_raise_status(st);
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
    pmpy_raise_fmt(PM_ERR_STATE, "the loader was closed");
    return -1;
  }
  return 0;
}

static PyObject *Loader_close(LoaderObject *self, PyObject *unused) {
  pm_status_t st = loader_destroy(self);
  if (st != PM_OK) return pmpy_raise_status(st);
  Py_RETURN_NONE;
}

/* next() -> a pinmem.Batch (one buffer per field; attributes epoch, index, _indices), or None
 * once every epoch was delivered. */
static PyObject *Loader_next(LoaderObject *self, PyObject *unused) {
  if (loader_check(self) < 0) return NULL;
  if (!g_batch_class) return pmpy_raise_fmt(PM_ERR_STATE, "the batch class is not set");
  BatchObject *batch = PyObject_New(BatchObject, &pmpy_BatchType);
  if (!batch) return NULL;
  batch->loader = NULL;
  batch->release_stream = 0;
  pm_status_t st;
  pm_loader_t *l = self->loader;
  /* In slices, so that Ctrl-C (and any signal handler) runs while a slow read holds the batch:
   * a wait without end in C would outlast the interpreter's signals. */
  for (;;) {
    int ready = 0;
    Py_BEGIN_ALLOW_THREADS st = pm_loader_next_timed(l, &batch->b, 0.1, &ready);
    Py_END_ALLOW_THREADS if (st != PM_OK || ready) break;
    if (PyErr_CheckSignals() < 0) {
      Py_DECREF(batch);
      return NULL;
    }
    if (self->loader != l) { /* closed by a handler or another thread meanwhile */
      Py_DECREF(batch);
      return pmpy_raise_fmt(PM_ERR_STATE, "the loader was closed");
    }
  }
  if (st != PM_OK) {
    Py_DECREF(batch);
    if (st == PM_ERR_STATE) Py_RETURN_NONE; /* every epoch was delivered */
    /* pinmem's error first: pm_loader_error_sample below may set the last error. */
    pmpy_raise_status(st);
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyErr_NormalizeException(&et, &ev, &tb);
    /* The exception of the sample whose read failed: other threads reading ahead may have met
     * (and kept) exceptions of later samples first. PMPY_ANY_SAMPLE when the loader does not
     * know one sample (a read of several rows failed as a whole): the lowest index's. */
    uint64_t bad = PMPY_ANY_SAMPLE;
    if (pm_loader_error_sample(l, &bad) != PM_OK) bad = PMPY_ANY_SAMPLE;
    PyObject *e = pmpy_dataset_take_error(self->dataset, bad);
    if (!e) {
      PyErr_Restore(et, ev, tb);
      return NULL;
    }
    /* A Python dataset raised: re-raise that, chained to pinmem's error. */
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
  if (st != PM_OK) return pmpy_raise_status(st);
  return PyBytes_FromStringAndSize((const char *)&s, sizeof s);
}

static PyObject *py_loader_state_fields(PyObject *mod, PyObject *arg) {
  Py_buffer v;
  if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE) < 0) return NULL;
  pm_loader_state_t s;
  int ok = v.len == (Py_ssize_t)sizeof s;
  if (ok) memcpy(&s, v.buf, sizeof s);
  PyBuffer_Release(&v);
  if (!ok) return pmpy_raise_fmt(PM_ERR_INVALID, "a loader state has %zu bytes", sizeof s);
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

/* pm_loader_plan for the fields of a Loader's config that decide an epoch's batches. */
static PyObject *py_loader_plan(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"samples", "batch_size", "drop_last", "rank", "world_size", NULL};
  unsigned long long samples, bs;
  pm_loader_config_t c;
  pm_loader_config_init(&c); /* the fields a plan reads are all given; pm_loader_plan checks */
  if (!PyArg_ParseTupleAndKeywords(args, kw, "K$Kpii:_loader_plan", kwlist, &samples, &bs,
                                   &c.drop_last, &c.rank, &c.world_size))
    return NULL;
  c.batch_size = (size_t)bs;
  pm_loader_plan_t p;
  pm_status_t st = pm_loader_plan(&c, samples, &p);
  if (st != PM_OK) return pmpy_raise_status(st);
  return Py_BuildValue("{s:i,s:i,s:K,s:K}", "rank", (int)p.rank, "world_size", (int)p.world_size,
                       "samples_per_epoch", (unsigned long long)p.samples_per_epoch,
                       "batches_per_epoch", (unsigned long long)p.batches_per_epoch);
}

static PyObject *Loader_stats(LoaderObject *self, PyObject *unused) {
  if (loader_check(self) < 0) return NULL;
  pm_loader_stats_t s;
  pm_status_t st = pm_loader_get_stats(self->loader, &s);
  if (st != PM_OK) return pmpy_raise_status(st);
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

PyTypeObject pmpy_LoaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pinmem._Loader",
    .tp_basicsize = sizeof(LoaderObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The C loader (see pinmem.Loader).",
    .tp_new = Loader_new,
    .tp_dealloc = (destructor)Loader_dealloc,
    .tp_methods = Loader_methods,
};

PyMethodDef pmpy_loader_functions[] = {
    {"_set_batch_class", py_set_batch_class, METH_O, "_set_batch_class(cls): pinmem.Batch"},
    {"_loader_state_fields", py_loader_state_fields, METH_O, NULL},
    {"_loader_plan", (PyCFunction)(void (*)(void))py_loader_plan, METH_VARARGS | METH_KEYWORDS,
     NULL},
    {"_loader_state_pack", (PyCFunction)(void (*)(void))py_loader_state_pack,
     METH_VARARGS | METH_KEYWORDS, NULL},
    {0}};
