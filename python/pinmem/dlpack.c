/*
 * DESIGN: DLPack, both ways: Buffer.__dlpack__ and __dlpack_device__, the event a device buffer
 * keeps of pinmem's last write to it, and taking other libraries' tensors in (pin, copy).
 *
 * dlpack.h 0.6 (Debian 12's libdlpack-dev) or newer: legacy "dltensor" capsules, and
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
 */
#include "_pinmem.h"

/* ---- DLPack export ------------------------------------------------------------------------ */

/* A consumer let go of an export: give the buffer its reference back. Deleters may run on any
 * thread, hence the GIL; after finalisation there is no interpreter to give it to: leak it. */
static void export_release_owner(PyObject *owner) {
  if (owner && Py_IsInitialized() && !pmpy_interp_finalizing()) {
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
int pmpy_buffer_order_before(BufferObject *b, pm_stream_t stream) {
  if (!b->ready || !b->ready_recorded) return 0;
  pm_status_t st = pm_stream_wait_event(stream, b->ready);
  if (st != PM_OK) {
    pmpy_raise_status(st);
    return -1;
  }
  return 0;
}

/* After pinmem queued work on `stream` that writes the buffer. */
int pmpy_buffer_record_write(BufferObject *b, pm_stream_t stream) {
  if (b->kind != BUF_DEVICE && b->kind != BUF_EXTERNAL) return 0;
  pm_status_t st = PM_OK;
  if (!b->ready) {
    st = pm_event_create(PM_EVENT_DEFAULT, &b->ready);
    if (st == PM_OK) b->ready_owned = 1;
  }
  if (st == PM_OK) st = pm_event_record(b->ready, stream);
  if (st != PM_OK) {
    pmpy_raise_status(st);
    return -1;
  }
  b->ready_recorded = 1;
  return 0;
}

/* A tuple of two ints, else TypeError with `what` (a list or an int too, where PyArg_ParseTuple
 * alone raised SystemError). */
static int int_pair(PyObject *o, const char *what, int *a, int *b) {
  if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 2) {
    PyErr_Format(PyExc_TypeError, "%s, not %.200R", what, o);
    return 0;
  }
  char fmt[160];
  snprintf(fmt, sizeof fmt, "ii;%s", what);
  return PyArg_ParseTuple(o, fmt, a, b);
}

PyObject *pmpy_Buffer_dlpack(BufferObject *self, PyObject *args, PyObject *kw) {
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
    if (!int_pair(max_version, "max_version must be a (major, minor) tuple", &major, &minor))
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
    if (!int_pair(dl_device, "dl_device must be a (type, id) tuple", &t, &id)) return NULL;
    int host_side = self->dl_device_type == kDLCPU;
    if (t == dev_type && id == dev_id) {
      /* as is */
    } else if (host_side && t == kDLCUDAHost && pmpy_is_cuda_backend()) {
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
    if (pmpy_parse_address(stream, &v) < 0) return NULL;
    if (v != (uintptr_t)-1) {
      /* The consumer's stream waits for the buffer's last write; the caller never blocks. */
      if (v == 0) {
        PyErr_SetString(PyExc_ValueError, "pinmem: stream 0 is ambiguous in DLPack; pass 1 "
                                          "(legacy default) or 2 (per-thread default)");
        return NULL;
      }
      if (pmpy_buffer_order_before(self, (pm_stream_t)v) < 0) return NULL;
      self->consumer_stream = v;
      self->has_consumer_stream = 1;
    }
  } else if (dev_type == kDLCUDA) {
    /* No stream: the legacy default stream, per the DLPack protocol. */
    if (pmpy_buffer_order_before(self, (pm_stream_t)(uintptr_t)1) < 0) return NULL;
    self->consumer_stream = 1;
    self->has_consumer_stream = 1;
  } else if (self->ready_recorded) {
    /* Host-backend device memory read by the CPU: the write must be done first. */
    pm_status_t st;
    pm_event_t ev = self->ready;
    Py_BEGIN_ALLOW_THREADS st = pm_event_synchronize(ev);
    Py_END_ALLOW_THREADS if (st != PM_OK) return pmpy_raise_status(st);
  }

  int nd = self->ndim;
  for (int i = 0; i < nd; i++)
    if (pmpy_buf_strides(self)[i] % self->itemsize) {
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
    dims[nd + i] = pmpy_buf_strides(self)[i] / self->itemsize;
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

PyObject *pmpy_Buffer_dlpack_device(BufferObject *self, PyObject *unused) {
  return Py_BuildValue("(ii)", self->dl_device_type, self->dl_device_id);
}

/* ---- importing other libraries' memory through DLPack ------------------------------------- */

/* obj.__dlpack_device__() -> (type, id). */
int pmpy_dl_device_of(PyObject *o, int *type, int *id) {
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

static DLManagedTensor *dl_import_plain(PyObject *o, pm_stream_t stream);

/* 1 when o.<method>() (torch's is_neg / is_conj) says a lazy bit is set, 0 when it is not or o
 * has no such method, -1 on error. */
static int lazy_bit(PyObject *o, const char *method) {
  PyObject *m = PyObject_GetAttrString(o, method);
  if (!m) {
    PyErr_Clear();
    return 0;
  }
  PyObject *r = PyCallable_Check(m) ? PyObject_CallNoArgs(m) : Py_NewRef(Py_False);
  Py_DECREF(m);
  if (!r) return -1;
  int set = PyObject_IsTrue(r);
  Py_DECREF(r);
  return set;
}

/* Whether o.requires_grad is True (a torch tensor in autograd); false where o has none. */
static int requires_grad(PyObject *o) {
  PyObject *r = PyObject_GetAttrString(o, "requires_grad");
  if (!r) {
    PyErr_Clear();
    return 0;
  }
  int set = r == Py_True;
  Py_DECREF(r);
  return set;
}

/* A torch tensor with its negative or conjugate bit set is a lazy view: its memory holds the
 * values before the negation (conjugation), and torch's __dlpack__ exports that memory without
 * the bit, so the bytes moved would carry the wrong sign. A source (resolve set) is taken as
 * o.resolve_conj().resolve_neg(), a compact copy with the values it shows, which the DLPack
 * tensor then keeps alive; a destination, or memory to pin in place, is refused as .numpy()
 * refuses it, since no copy can stand in for it. New reference to what to export, or NULL. */
static PyObject *resolve_lazy_bits(PyObject *o, int resolve, const char *what) {
  int neg = lazy_bit(o, "is_neg");
  int conj = neg < 0 ? 0 : lazy_bit(o, "is_conj");
  if (neg < 0 || conj < 0) return NULL;
  if (!neg && !conj) return Py_NewRef(o);
  if (!resolve)
    return pmpy_raise_fmt(PM_ERR_INVALID,
                          "%s has its %s bit set (a lazy %s view, whose memory holds the values "
                          "before it): its DLPack export would drop the bit; use a plain tensor "
                          "(.resolve_%s() makes one, a copy)",
                          what, neg ? "negative" : "conjugate", neg ? "negated" : "conjugated",
                          neg ? "neg" : "conj");
  PyObject *c = PyObject_CallMethod(o, "resolve_conj", NULL);
  if (!c) return NULL;
  PyObject *r = PyObject_CallMethod(c, "resolve_neg", NULL);
  Py_DECREF(c);
  return r;
}

/* Take the DLPack tensor of `o` (consuming the capsule, so it is ours to delete). CUDA producers
 * are asked to order their work before `stream`. resolve: o is only read (a copy's source), so a
 * lazy negated or conjugated view is exported as the values it shows; 0 refuses one, naming
 * `what`. */
DLManagedTensor *pmpy_dl_import(PyObject *o, pm_stream_t stream, int resolve, const char *what) {
  PyObject *plain = resolve_lazy_bits(o, resolve, what);
  if (!plain) return NULL;
  /* A tensor that requires grad (a model's parameter) goes as its .detach(), the same memory:
   * torch's __dlpack__ refuses it, and pinmem's copies and file transfers run outside autograd,
   * as load_state_dict writes parameters. */
  if (requires_grad(plain)) {
    PyObject *d = PyObject_CallMethod(plain, "detach", NULL);
    Py_DECREF(plain);
    if (!d) return NULL;
    plain = d;
  }
  DLManagedTensor *mt = dl_import_plain(plain, stream);
  Py_DECREF(plain);
  return mt;
}

static DLManagedTensor *dl_import_plain(PyObject *o, pm_stream_t stream) {
  int type, id;
  if (pmpy_dl_device_of(o, &type, &id) < 0) return NULL;
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

/* Bytes of a compact row-major DLTensor, or -1 (with an error) when it is not compact. Elements
 * narrower than a byte (int4, float4: bits * lanes < 8) are packed, as DLPack lays them out, so
 * 8 elements of 4 bits are 4 bytes, not 8: a byte count per element would pin and copy past the
 * tensor's memory. */
int pmpy_dl_compact_bytes(const DLTensor *t, size_t *bytes_out) {
  if (t->ndim < 0 || t->ndim > PMPY_MAX_NDIM || (t->ndim > 0 && !t->shape)) {
    pmpy_raise_fmt(PM_ERR_INVALID, "the DLPack tensor has a bad ndim %d (or no shape)", t->ndim);
    return -1;
  }
  size_t bits = (size_t)t->dtype.bits * t->dtype.lanes; /* an element's */
  size_t n = 1;                                         /* elements */
  for (int i = 0; i < t->ndim; i++) {
    if (t->shape[i] < 0) {
      pmpy_raise_fmt(PM_ERR_INVALID, "the DLPack tensor has a negative dimension %lld",
                     (long long)t->shape[i]);
      return -1;
    }
    if (pmpy_checked_mul(&n, (size_t)t->shape[i]) < 0) return -1;
  }
  size_t total_bits = n;
  if (pmpy_checked_mul(&total_bits, bits) < 0) return -1;
  if (t->strides && n) {
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
      if (t->shape[i] != 1 && t->strides[i] != expect) {
        pmpy_raise_fmt(PM_ERR_INVALID,
                       "the tensor is not contiguous (row-major); call "
                       ".contiguous() first");
        return -1;
      }
      expect *= t->shape[i];
    }
  }
  *bytes_out = total_bits / 8 + (total_bits % 8 != 0);
  return 0;
}
