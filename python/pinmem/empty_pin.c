/*
 * DESIGN: where a Buffer's memory comes from: pinmem.empty (a block of the default pool),
 * device_empty (device memory of the current device) and pin (memory another object owns,
 * registered in place). A pinned Buffer holds the object, and its buffer export or DLPack
 * tensor, until it is unpinned: the memory can neither move nor vanish while pinned. A pin that
 * fails gives the export back and registers nothing. _buffer_view gives a Buffer over part of
 * another, holding it (the loader's batches staged in one block, one view per leaf).
 */
#include "_pinmem.h"

static PyObject *py_empty(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"shape", "dtype", "mapped", "write_combined", "portable", NULL};
  PyObject *shape, *dtype;
  int mapped = 0, wc = 0, portable = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|$ppp:empty", kwlist, &shape, &dtype, &mapped,
                                   &wc, &portable))
    return NULL;
  size_t nbytes;
  BufferObject *b = pmpy_buffer_shaped(&pmpy_PinnedBufferType, shape, dtype, &nbytes);
  if (!b) return NULL;
  unsigned flags = (mapped ? PM_HOST_MAPPED : 0) | (wc ? PM_HOST_WRITE_COMBINED : 0) |
                   (portable ? PM_HOST_PORTABLE : 0);
  void *p = NULL;
  pm_status_t st;
  size_t ask = nbytes ? nbytes : 1; /* an empty array still gets a distinct address */
  Py_BEGIN_ALLOW_THREADS st = pm_host_alloc(NULL, ask, flags, &p);
  Py_END_ALLOW_THREADS if (st != PM_OK) {
    Py_DECREF(b);
    return pmpy_raise_status(st);
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
  BufferObject *b = pmpy_buffer_shaped(&pmpy_DeviceBufferType, shape, dtype, &nbytes);
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
    return pmpy_raise_status(st);
  }
  b->kind = BUF_DEVICE;
  b->ptr = p;
  b->nbytes = nbytes;
  b->released = 0;
  b->readonly = 0;
  b->dl_device_type = pmpy_is_cuda_backend() ? kDLCUDA : kDLCPU;
  b->dl_device_id = pmpy_is_cuda_backend() ? dev : 0;
  return (PyObject *)b;
}


static int g_ro_register = -1; /* does device 0 take read-only registrations? (-1: not asked) */

static PyObject *py_pin(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"obj", "mapped", "portable", NULL};
  PyObject *obj;
  int mapped = 0, portable = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$pp:pin", kwlist, &obj, &mapped, &portable))
    return NULL;
  if (Buffer_Check(obj))
    return pmpy_raise_fmt(PM_ERR_OVERLAP, "pin: the object is already pinmem memory (%s)",
                          pmpy_kind_names[((BufferObject *)obj)->kind]);

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
        pmpy_raise_fmt(PM_ERR_INVALID, "pin: %.100s does not export its memory: %.200s",
                       Py_TYPE(obj)->tp_name, msg ? msg : "?");
        Py_XDECREF(text);
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        return NULL;
      }
      readonly = 1;
    }
    if (pmpy_format_has_objects(v.format)) {
      PyBuffer_Release(&v);
      return pmpy_raise_fmt(PM_ERR_INVALID,
                            "pin: the array holds Python objects (dtype object); "
                            "only plain data can be pinned");
    }
    readonly |= v.readonly;
    if (!PyBuffer_IsContiguous(&v, 'A')) {
      PyBuffer_Release(&v);
      return pmpy_raise_fmt(PM_ERR_INVALID, "pin: the buffer is not contiguous");
    }
    b = pmpy_buffer_alloc(&pmpy_PinnedBufferType, v.ndim);
    if (!b) {
      PyBuffer_Release(&v);
      return NULL;
    }
    b->src_view = v;
    b->has_src_view = 1;
    b->readonly = readonly;
    b->itemsize = v.itemsize;
    if (pmpy_buffer_set_format(b, v.format ? v.format : "B") < 0) goto fail;
    b->dtype = pmpy_dtype_from_format(v.format, v.itemsize);
    for (int i = 0; i < v.ndim; i++) {
      b->shape[i] = v.shape ? v.shape[i] : v.len / v.itemsize;
      pmpy_buf_strides(b)[i] = v.strides ? v.strides[i] : v.itemsize;
    }
    if (!v.strides && v.ndim > 0) {
      size_t dummy;
      if (pmpy_buffer_set_c_strides(b, &dummy) < 0) goto fail;
    }
    data = v.buf;
    bytes = (size_t)v.len;
  } else if (PyObject_HasAttrString(obj, "__dlpack__")) {
    int type, id;
    if (pmpy_dl_device_of(obj, &type, &id) < 0) return NULL;
    if (type != kDLCPU)
      return pmpy_raise_fmt(
          PM_ERR_WRONG_KIND,
          "pin: the object lives on DLPack device (%d, %d); only CPU memory can be "
          "pinned",
          type, id);
    DLManagedTensor *mt = pmpy_dl_import(obj, NULL, 0, "pin: the tensor");
    if (!mt) return NULL;
    const DLTensor *t = &mt->dl_tensor;
    if (t->ndim < 0 || t->ndim > PMPY_MAX_NDIM || pmpy_dl_compact_bytes(t, &bytes) < 0) {
      if (!PyErr_Occurred()) pmpy_raise_fmt(PM_ERR_INVALID, "pin: bad ndim %d", t->ndim);
      if (mt->deleter) mt->deleter(mt);
      return NULL;
    }
    b = pmpy_buffer_alloc(&pmpy_PinnedBufferType, t->ndim);
    if (!b) {
      if (mt->deleter) mt->deleter(mt);
      return NULL;
    }
    b->src_dl = mt;
    /* Types without a NumPy type (bfloat16, float8, complex32) keep their type and shape, as
     * pinmem.empty's do: torch.from_dlpack sees the tensor, and the buffer protocol refuses
     * them by name (an integer view would read as the wrong numbers). */
    b->dtype = pmpy_dtype_by_dl(t->dtype);
    b->itemsize = ((Py_ssize_t)t->dtype.bits * t->dtype.lanes + 7) / 8;
    if (pmpy_buffer_set_format(b, b->dtype ? b->dtype->format : "B") < 0) goto fail;
    if (!b->dtype) {
      /* Unknown element type: export it as bytes, shape (nbytes,). */
      b->itemsize = 1;
      if (pmpy_buffer_set_ndim(b, 1) < 0) goto fail;
      b->shape[0] = (Py_ssize_t)bytes;
    } else {
      for (int i = 0; i < t->ndim; i++) b->shape[i] = (Py_ssize_t)t->shape[i];
    }
    size_t dummy;
    if (pmpy_buffer_set_c_strides(b, &dummy) < 0) goto fail;
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
    pmpy_raise_fmt(PM_ERR_INVALID, "pin: the object has 0 bytes; there is nothing to pin");
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
    pmpy_raise_status(st);
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
    pmpy_buffer_release_memory(b);
    Py_DECREF(b);
    PyErr_Restore(et, ev, tb);
  }
  return NULL;
}

/* A view's base loses one consumer when the view goes. A device base remembers, in an event on
 * the stream the view's DLPack consumer named, the work queued up to now that may read it: a
 * reuse of the base (_buffer_reuse) waits for that. Views consumed on two different streams
 * make the base unsafe to reuse (one event holds one stream's point). */
static void view_released(BufferObject *view) {
  BufferObject *base = (BufferObject *)view->keep;
  if (!base) return;
  base->exports--;
  uintptr_t v = view->consumer_stream;
  if (base->kind != BUF_DEVICE || !view->has_consumer_stream || !v || v == (uintptr_t)-1 ||
      (!pmpy_is_cuda_backend() && v <= 2))
    return;
  if (base->views_gone_recorded && base->views_gone_stream != v) {
    base->reuse_unsafe = 1;
    return;
  }
  if ((!base->views_gone && pm_event_create(PM_EVENT_DEFAULT, &base->views_gone) != PM_OK) ||
      pm_event_record(base->views_gone, (pm_stream_t)v) != PM_OK) {
    base->reuse_unsafe = 1;
    return;
  }
  base->views_gone_stream = v;
  base->views_gone_recorded = 1;
}

/* _buffer_reuse(base, stream) -> bool: whether device buffer base may be written again (no view
 * or copy holds it); if so, `stream` first waits for the work its views' consumers queued. */
static PyObject *py_buffer_reuse(PyObject *mod, PyObject *args) {
  PyObject *base_obj, *stream_obj;
  if (!PyArg_ParseTuple(args, "O!O:_buffer_reuse", &pmpy_BufferType, &base_obj, &stream_obj))
    return NULL;
  BufferObject *b = (BufferObject *)base_obj;
  pm_stream_t s;
  if (pmpy_stream_take(stream_obj, &s) < 0) return NULL;
  PyObject *result = Py_False;
  if (!(b->released || b->exports || b->reuse_unsafe || b->kind != BUF_DEVICE)) {
    result = Py_True;
    if (b->views_gone_recorded) {
      pm_status_t st = pm_stream_wait_event(s, b->views_gone);
      if (st != PM_OK) {
        result = pmpy_raise_status(st);
      } else {
        b->views_gone_recorded = 0;
        b->views_gone_stream = 0;
      }
    }
  }
  pmpy_stream_drop(stream_obj);
  return Py_XNewRef(result);
}

/* _buffer_view(base, offset, shape, dtype): a Buffer over bytes [offset, offset + nbytes) of
 * base, which it holds (and counts as a consumer) until it goes. A device base's views share
 * its ready event: DLPack consumers of a view wait for pinmem's last write to the base. The
 * loader hands out the leaves of a batch staged in one block this way (collated.py). */
static PyObject *py_buffer_view(PyObject *mod, PyObject *args) {
  PyObject *base_obj, *shape, *dtype;
  Py_ssize_t offset;
  if (!PyArg_ParseTuple(args, "O!nOO:_buffer_view", &pmpy_BufferType, &base_obj, &offset, &shape,
                        &dtype))
    return NULL;
  BufferObject *base = (BufferObject *)base_obj;
  if (pmpy_buffer_check_live(base) < 0) return NULL;
  size_t nbytes;
  BufferObject *b = pmpy_buffer_shaped(&pmpy_BufferType, shape, dtype, &nbytes);
  if (!b) return NULL;
  if (offset < 0 || (size_t)offset > base->nbytes || nbytes > base->nbytes - (size_t)offset) {
    Py_DECREF(b);
    return pmpy_raise_fmt(PM_ERR_INVALID, "_buffer_view: %zu bytes at offset %zd do not fit in "
                          "the base's %zu", nbytes, offset, base->nbytes);
  }
  b->kind = BUF_EXTERNAL;
  b->ptr = (char *)base->ptr + offset;
  b->nbytes = nbytes;
  b->released = 0;
  b->readonly = base->readonly;
  b->host_visible = base->host_visible;
  b->dl_device_type = base->dl_device_type;
  b->dl_device_id = base->dl_device_id;
  b->ready = base->ready;
  b->ready_recorded = base->ready_recorded;
  b->ready_owned = 0;
  b->keep = Py_NewRef(base_obj);
  b->on_release = view_released;
  base->exports++;
  return (PyObject *)b;
}

PyMethodDef pmpy_empty_pin_functions[] = {
    {"empty", (PyCFunction)(void (*)(void))py_empty, METH_VARARGS | METH_KEYWORDS,
     "empty(shape, dtype, *, mapped=False, write_combined=False, portable=False) -> PinnedBuffer"},
    {"device_empty", (PyCFunction)(void (*)(void))py_device_empty, METH_VARARGS | METH_KEYWORDS,
     "device_empty(shape, dtype) -> DeviceBuffer (device memory of the current device)"},
    {"pin", (PyCFunction)(void (*)(void))py_pin, METH_VARARGS | METH_KEYWORDS,
     "pin(obj, *, mapped=False, portable=False) -> PinnedBuffer over obj's memory, pinned in place"},
    {"_buffer_view", py_buffer_view, METH_VARARGS,
     "_buffer_view(base, offset, shape, dtype) -> Buffer over part of base (loader batches)"},
    {"_buffer_reuse", py_buffer_reuse, METH_VARARGS,
     "_buffer_reuse(base, stream) -> bool: device memory free of views, stream ordered after "
     "their consumers"},
    {0}};
