/*
 * DESIGN: pinmem.Buffer and its subtypes PinnedBuffer and DeviceBuffer (the struct is in
 * _pinmem.h): the descriptor (shape, strides, format, dtype), giving the memory back by its
 * kind, the buffer protocol, and the methods and properties. Where the memory comes from is
 * empty_pin.c's (and loader.c's, for batches); the DLPack export is dlpack.c's.
 *
 * Invariants: `shape` has room for ndim_cap dimensions, then ndim_cap strides, and ndim changes
 * only through pmpy_buffer_set_ndim. A Buffer is born released (no memory yet) until its maker
 * attaches memory; pmpy_buffer_release_memory gives that back once and leaves ptr NULL.
 */
#include "_pinmem.h"

const char *const pmpy_kind_names[] = {"pool", "registered", "device", "external"};

/* Give the memory back (GIL held; drops it around slow calls). Errors are returned, with
 * pm_last_error() set; the buffer counts as released anyway (there is nothing to retry). */
static pm_status_t release_memory(BufferObject *b, int forget) {
  if (b->released) return PM_OK;
  b->released = 1;
  void *p = b->ptr;
  b->ptr = NULL;
  pm_status_t st = PM_OK;
  pm_event_t ev = b->ready_owned ? b->ready : NULL;
  b->ready = NULL;
  if (forget) {
    /* A forked child's copy of its parent's buffer: the memory, its registration and its events
     * are the parent's to give back (the library refuses them here), so only the references go. */
    b->views_gone = NULL;
    ev = NULL;
  }
  if (b->views_gone) {
    pm_event_destroy(b->views_gone);
    b->views_gone = NULL;
  }
  switch (forget && b->kind != BUF_EXTERNAL ? -1 : b->kind) {
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
pm_status_t pmpy_buffer_release_memory(BufferObject *b) {
  return release_memory(b, 0);
}

/* Dropped in a process other than its maker's (a fork child that collects the parent's
 * garbage): forgotten without a word, as the loader's batches are; an explicit release() there
 * still reports what the library says. */
static int buffer_foreign(const BufferObject *b) {
  return b->pid != (long)getpid();
}

/* The objects a buffer holds are visible to the cycle collector: an object that holds its own
 * pin (`arr.pinned = pinmem.pin(arr)`, an attribute of an ndarray or bytearray subclass) is a
 * cycle through the buffer, and without this its memory stayed pinned for ever. */
static int Buffer_traverse(BufferObject *self, visitproc visit, void *arg) {
  Py_VISIT(self->base);
  if (self->has_src_view) Py_VISIT(self->src_view.obj);
  Py_VISIT(self->keep);
  return 0;
}

/* Breaking a cycle: the memory goes back as release() gives it back, which drops the pinned
 * object, unless a consumer still uses it (then another member of the cycle breaks it, and the
 * memory goes back with the buffer, as always). */
static int Buffer_clear(BufferObject *self) {
  if (self->exports > 0) return 0;
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
  (void)release_memory(self, buffer_foreign(self)); /* nobody to report an error to */
  Py_CLEAR(self->base);
  PyErr_Restore(et, ev, tb);
  return 0;
}

static void Buffer_dealloc(BufferObject *self) {
  PyObject_GC_UnTrack(self);
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
  if (self->weakrefs) PyObject_ClearWeakRefs((PyObject *)self);
  pm_status_t st = release_memory(self, buffer_foreign(self));
  if (st != PM_OK && st != PM_NOT_READY) {
    if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "pinmem: releasing a %s buffer failed: %s: %s",
                         pmpy_kind_names[self->kind], pm_status_name(st), pm_last_error()) < 0)
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
int pmpy_buffer_set_ndim(BufferObject *b, int ndim) {
  if (ndim < 0 || ndim > PMPY_MAX_NDIM) {
    pmpy_raise_fmt(PM_ERR_INVALID, "%d dimensions; at most %d", ndim, PMPY_MAX_NDIM);
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
      memcpy(shape + cap, pmpy_buf_strides(b), (size_t)keep * sizeof *shape);
      PyMem_Free(b->shape);
    }
    b->shape = shape;
    b->ndim_cap = cap;
  }
  b->ndim = ndim;
  return 0;
}

BufferObject *pmpy_buffer_alloc(PyTypeObject *type, int ndim) {
  BufferObject *b = (BufferObject *)type->tp_alloc(type, 0);
  if (!b) return NULL;
  b->released = 1; /* until memory is attached */
  b->pid = (long)getpid();
  b->dl_device_type = kDLCPU;
  if (pmpy_buffer_set_ndim(b, ndim) < 0) {
    Py_DECREF(b);
    return NULL;
  }
  return b;
}

int pmpy_buffer_set_format(BufferObject *b, const char *format) {
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
int pmpy_buffer_set_c_strides(BufferObject *b, size_t *nbytes_out) {
  size_t n = (size_t)b->itemsize;
  for (int i = b->ndim - 1; i >= 0; i--) {
    pmpy_buf_strides(b)[i] = (Py_ssize_t)n;
    size_t d = (size_t)b->shape[i];
    if (d && n > (size_t)PY_SSIZE_T_MAX / d) {
      pmpy_raise_fmt(PM_ERR_INVALID, "the shape is too large for memory");
      return -1;
    }
    n *= d;
  }
  *nbytes_out = n;
  return 0;
}

/* One dimension of a shape; one past Py_ssize_t is the caller's mistake (InvalidError, as a
 * negative one), not an OverflowError from deep inside. */
static int shape_dim(PyObject *it, Py_ssize_t *out) {
  Py_ssize_t d = PyNumber_AsSsize_t(it, NULL); /* NULL: clamped, not raised */
  if (d == -1 && PyErr_Occurred()) return -1;
  if (d == PY_SSIZE_T_MAX || d == PY_SSIZE_T_MIN) {
    PyObject *v = PyNumber_Index(it);
    if (!v) return -1;
    PyObject *r = PyObject_Repr(v);
    Py_DECREF(v);
    if (!r) return -1;
    pmpy_raise_fmt(PM_ERR_INVALID, d < 0 ? "negative dimension %.40s in shape"
                                         : "dimension %.40s in shape is too large for memory",
                   PyUnicode_AsUTF8(r));
    Py_DECREF(r);
    return -1;
  }
  *out = d;
  return 0;
}

int pmpy_parse_shape(PyObject *o, Py_ssize_t *dims, int *ndim_out) {
  /* An int, or a sequence of them. A NumPy array of dimensions has __index__ too (it works
   * for one element), so anything with a length is a sequence, as numpy.empty takes it. */
  int one = PyIndex_Check(o);
  if (one && PySequence_Check(o)) {
    if (PyObject_Length(o) >= 0)
      one = 0;
    else
      PyErr_Clear(); /* a 0-d array: one dimension */
  }
  if (one) {
    if (shape_dim(o, &dims[0]) < 0) return -1;
    *ndim_out = 1;
  } else {
    PyObject *seq = pmpy_fast_tuple(o, "shape must be an int or a sequence of ints");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > PMPY_MAX_NDIM) {
      Py_DECREF(seq);
      pmpy_raise_fmt(PM_ERR_INVALID, "shape has %zd dimensions; at most %d", n, PMPY_MAX_NDIM);
      return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject *it = PySequence_Fast_GET_ITEM(seq, i);
      if (!PyIndex_Check(it)) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_TypeError, "shape must be an int or a sequence of ints");
        return -1;
      }
      if (shape_dim(it, &dims[i]) < 0) {
        Py_DECREF(seq);
        return -1;
      }
    }
    Py_DECREF(seq);
    *ndim_out = (int)n;
  }
  for (int i = 0; i < *ndim_out; i++)
    if (dims[i] < 0) {
      pmpy_raise_fmt(PM_ERR_INVALID, "negative dimension %zd in shape", dims[i]);
      return -1;
    }
  return 0;
}

/* A new Buffer of `type` with shape and dtype set; no memory yet. */
BufferObject *pmpy_buffer_shaped(PyTypeObject *type, PyObject *shape_obj, PyObject *dtype_obj,
                                 size_t *nbytes_out) {
  Py_ssize_t dims[PMPY_MAX_NDIM];
  int ndim;
  if (pmpy_parse_shape(shape_obj, dims, &ndim) < 0) return NULL;
  const pmpy_dtype_t *dt = pmpy_parse_dtype(dtype_obj);
  if (!dt) return NULL;
  BufferObject *b = pmpy_buffer_alloc(type, ndim);
  if (!b) return NULL;
  memcpy(b->shape, dims, (size_t)ndim * sizeof *dims);
  b->dtype = dt;
  b->itemsize = dt->bits / 8;
  if (pmpy_buffer_set_format(b, dt->format) < 0 || pmpy_buffer_set_c_strides(b, nbytes_out) < 0) {
    Py_DECREF(b);
    return NULL;
  }
  return b;
}

int pmpy_buffer_check_live(BufferObject *b) {
  if (b->released) {
    pmpy_raise_fmt(PM_ERR_STATE, "the buffer was released");
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
  if (self->dtype && self->dtype->kind == 'V' && (flags & PyBUF_ND)) {
    /* bfloat16, float8, complex32: no struct format names them, and an integer view would read
     * as the wrong numbers. */
    PyErr_Format(PyExc_BufferError,
                 "pinmem: %s has no buffer-protocol or NumPy type; use DLPack "
                 "(torch.from_dlpack(x); its .view(torch.int16) etc. for the raw bits)",
                 self->dtype->name);
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
  view->strides = pmpy_buf_strides(self);
  int c = PyBuffer_IsContiguous(view, 'C'), f = PyBuffer_IsContiguous(view, 'F');
  view->shape = (flags & PyBUF_ND) ? self->shape : NULL;
  view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? pmpy_buf_strides(self) : NULL;
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

/* ---- methods and properties --------------------------------------------------------------- */

static PyObject *Buffer_release(BufferObject *self, PyObject *unused) {
  if (self->released) Py_RETURN_NONE;
  if (self->exports > 0)
    return pmpy_raise_fmt(
        PM_ERR_BUSY,
        "release: the buffer still has %zd consumer(s) (memoryviews, arrays, DLPack "
        "tensors or copies in flight); it is released when the last one lets go",
        self->exports);
  pm_status_t st = pmpy_buffer_release_memory(self);
  if (st != PM_OK) return pmpy_raise_status(st);
  Py_RETURN_NONE;
}

static PyObject *Buffer_enter(PyObject *self, PyObject *unused) { return Py_NewRef(self); }

/* The end of a `with` block releases the buffer. While the block raises and a consumer still
 * holds the memory (a copy in flight, a tensor over it), that exception goes on, not a BusyError
 * in its place that no `except` of the caller expects: the memory goes back when the last
 * consumer lets go, as it does without `with`. */
static PyObject *Buffer_exit(BufferObject *self, PyObject *args) {
  int raising = PyTuple_GET_SIZE(args) > 0 && PyTuple_GET_ITEM(args, 0) != Py_None;
  if (raising && !self->released && self->exports > 0) Py_RETURN_NONE;
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
  if (self->dtype && self->dtype->kind == 'V') {
    PyErr_Format(PyExc_TypeError,
                 "pinmem: %s has no NumPy type; use torch.from_dlpack(x) (or as_torch() for a "
                 "loader's batches), and its .view(torch.uint%d) for the raw bits",
                 self->dtype->name, self->dtype->bits);
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
    PyObject *v = PyLong_FromSsize_t(pmpy_buf_strides(self)[i]);
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
  return PyUnicode_FromString(pmpy_kind_names[self->kind]);
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
      pmpy_kind_names[self->kind], self->ptr, self->released ? ", released" : "");
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
    {"__dlpack__", (PyCFunction)(void (*)(void))pmpy_Buffer_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(stream=None, *, max_version=None, dl_device=None, copy=None): a DLPack capsule "
     "over the memory (no copy). For device memory, `stream` (the consumer's) is made to wait "
     "for pinmem's last write; the caller does not block."},
    {"__dlpack_device__", (PyCFunction)pmpy_Buffer_dlpack_device, METH_NOARGS,
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

PyTypeObject pmpy_BufferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pinmem.Buffer",
    .tp_basicsize = sizeof(BufferObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Memory owned by pinmem (base of PinnedBuffer and DeviceBuffer).",
    .tp_dealloc = (destructor)Buffer_dealloc,
    .tp_traverse = (traverseproc)Buffer_traverse,
    .tp_clear = (inquiry)Buffer_clear,
    .tp_repr = (reprfunc)Buffer_repr,
    .tp_as_buffer = &Buffer_as_buffer,
    .tp_methods = Buffer_methods,
    .tp_getset = Buffer_getset,
    .tp_weaklistoffset = offsetof(BufferObject, weakrefs),
};

PyTypeObject pmpy_PinnedBufferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pinmem.PinnedBuffer",
    .tp_basicsize = sizeof(BufferObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)Buffer_traverse,
    .tp_clear = (inquiry)Buffer_clear,
    .tp_doc = "Pinned (page-locked) host memory: a block of pinmem's pool (pinmem.empty) or memory "
              "pinned in place (pinmem.pin). Exports the buffer protocol (numpy.asarray, "
              "memoryview) and DLPack (numpy.from_dlpack, torch.from_dlpack) without copying; "
              "the memory stays valid while any of them holds it.",
    .tp_base = &pmpy_BufferType,
};

/* ---- device buffers ----------------------------------------------------------------------- */

static PyObject *DeviceBuffer_fill(BufferObject *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"value", "stream", NULL};
  PyObject *value_obj, *stream_obj = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O:fill", kwlist, &value_obj, &stream_obj))
    return NULL;
  /* A byte, as memset takes it: 256 would fill zeros. */
  if (!PyIndex_Check(value_obj) || PyBool_Check(value_obj))
    return pmpy_raise_fmt(PM_ERR_INVALID, "fill: value must be a byte, -128..255, not %.100s",
                          Py_TYPE(value_obj)->tp_name);
  int over = 0;
  long long v = PyLong_AsLongLongAndOverflow(value_obj, &over);
  if (v == -1 && PyErr_Occurred()) return NULL;
  if (over)
    return pmpy_raise_fmt(PM_ERR_INVALID,
                          "fill: value must be a byte, -128..255, not an int of over 64 bits");
  if (v < -128 || v > 255)
    return pmpy_raise_fmt(PM_ERR_INVALID, "fill: value must be a byte, -128..255, not %lld", v);
  int value = (int)v;
  if (pmpy_buffer_check_live(self) < 0) return NULL;
  pm_stream_t stream;
  if (pmpy_stream_take(stream_obj, &stream) < 0) return NULL;
  int rc = 0;
  if (self->nbytes) {
    pm_status_t st = pm_device_memset_async(self->ptr, value, self->nbytes, stream);
    if (st != PM_OK) {
      pmpy_raise_status(st);
      rc = -1;
    } else {
      rc = pmpy_buffer_record_write(self, stream);
    }
  }
  pmpy_stream_drop(stream_obj);
  if (rc < 0) return NULL;
  Py_RETURN_NONE;
}

static PyMethodDef DeviceBuffer_methods[] = {
    {"fill", (PyCFunction)(void (*)(void))DeviceBuffer_fill, METH_VARARGS | METH_KEYWORDS,
     "fill(value, stream=None): set every byte to value, ordered on stream."},
    {0}};

PyTypeObject pmpy_DeviceBufferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pinmem.DeviceBuffer",
    .tp_basicsize = sizeof(BufferObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)Buffer_traverse,
    .tp_clear = (inquiry)Buffer_clear,
    .tp_doc = "Device memory from pinmem (pinmem.device_empty). No CPU view; exports DLPack "
              "(kDLCUDA under the cuda backend) with stream ordering.",
    .tp_base = &pmpy_BufferType,
    .tp_methods = DeviceBuffer_methods,
};
