/*
 * DESIGN: pinmem.copy and its Completion.
 *
 * Copies. copy() turns each side into (pointer, bytes, holder): a Buffer, anything with the
 * buffer protocol, a __dlpack__ producer or a __cuda_array_interface__ object. A Completion owns
 * the fence and both holders and drops the holders once the fence completed. A Completion that is
 * dropped before that parks fence and holders on a pending list, which later calls sweep and exit
 * waits for: the memory of a copy in flight is never given back early.
 */
#include <string.h>

#include "_pinmem.h"

/* What keeps one side of a copy alive until the copy is done (_pinmem.h). */
typedef pmpy_holder_t holder_t;

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
    if (b->shape[i] != 1 && pmpy_buf_strides(b)[i] != expect) return 0;
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
      pmpy_raise_status(st);
      return -1;
    }
  }
  /* No silent CPU: after auto fell back to the host backend, memory another library holds on a
   * GPU is out of pinmem's reach; say why rather than read it as host memory. */
  pm_backend_info_t bi;
  if (!pmpy_is_cuda_backend() && pm_backend_info(&bi) == PM_OK && bi.fallback) {
    pmpy_raise_fmt(PM_ERR_NO_DEVICE,
                   "%s is device memory, but pinmem has no CUDA device: it fell back to the host "
                   "backend (%s); to simulate devices on purpose, set PINMEM_BACKEND=host",
                   what, strncmp(bi.reason, "auto: ", 6) == 0 ? bi.reason + 6 : bi.reason);
    return -1;
  }
  pm_pointer_info_t info;
  pm_status_t st = pm_pointer_query(ptr, &info);
  if (st != PM_OK) {
    pmpy_raise_status(st);
    return -1;
  }
  if (info.kind == PM_MEMORY_PAGEABLE) {
    if (pmpy_is_cuda_backend()) return 0;
    pmpy_raise_fmt(PM_ERR_INVALID,
                   "%s says it is device memory at %p, but the host backend allocated no device "
                   "memory there",
                   what, ptr);
    return -1;
  }
  uintptr_t p = (uintptr_t)ptr, base = (uintptr_t)info.base;
  if (p < base || bytes > info.size - (p - base)) {
    pmpy_raise_fmt(PM_ERR_INVALID, "%s [%p, +%zu) runs past the end of its allocation [%p, +%zu)",
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
    pmpy_raise_fmt(PM_ERR_INVALID,
                   "%s has a malformed __cuda_array_interface__ (it needs data=(ptr, readonly), "
                   "a shape tuple and a typestr)",
                   what);
    return -1;
  }
  /* A mask says which elements are valid; a byte copy cannot honour it, and the protocol asks
   * a consumer that cannot to refuse the object. */
  PyObject *mask = PyDict_GetItemString(cai, "mask");
  if (mask && mask != Py_None) {
    pmpy_raise_fmt(PM_ERR_INVALID,
                   "%s has a mask in its __cuda_array_interface__; pinmem copies bytes and "
                   "cannot leave masked elements out",
                   what);
    return -1;
  }
  if (pmpy_parse_address(PyTuple_GET_ITEM(data, 0), addr) < 0) return -1;
  *ro = PyObject_IsTrue(PyTuple_GET_ITEM(data, 1));
  if (*ro < 0) return -1;
  /* typestr: byte order, kind letter, item size in bytes ("<f4", "|u1"). */
  char *end = NULL;
  long item = strlen(ts) >= 3 && strchr("<>|=", ts[0]) ? strtol(ts + 2, &end, 10) : 0;
  if (item <= 0 || item > 1024 || !end || *end) {
    pmpy_raise_fmt(PM_ERR_INVALID, "%s has a bad typestr '%.40s' in __cuda_array_interface__", what,
                   ts);
    return -1;
  }
  Py_ssize_t nd = PyTuple_GET_SIZE(shape);
  if (nd > PMPY_MAX_NDIM) {
    pmpy_raise_fmt(PM_ERR_INVALID, "%s has %zd dimensions; at most %d", what, nd, PMPY_MAX_NDIM);
    return -1;
  }
  Py_ssize_t dims[PMPY_MAX_NDIM];
  size_t n = (size_t)item;
  for (Py_ssize_t i = 0; i < nd; i++) {
    PyObject *d = PyTuple_GET_ITEM(shape, i);
    dims[i] = PyIndex_Check(d) ? PyNumber_AsSsize_t(d, NULL) : -1;
    if (dims[i] < 0) {
      PyErr_Clear();
      pmpy_raise_fmt(PM_ERR_INVALID, "%s has a negative or non-integer dimension in its shape",
                     what);
      return -1;
    }
    if (pmpy_checked_mul(&n, (size_t)dims[i]) < 0) return -1;
  }
  if (strides && strides != Py_None && n) {
    if (!PyTuple_Check(strides) || PyTuple_GET_SIZE(strides) != nd) {
      pmpy_raise_fmt(PM_ERR_INVALID, "%s has strides that do not match its shape", what);
      return -1;
    }
    Py_ssize_t expect = item;
    for (Py_ssize_t i = nd - 1; i >= 0; i--) {
      PyObject *si = PyTuple_GET_ITEM(strides, i);
      Py_ssize_t sv = PyIndex_Check(si) ? PyNumber_AsSsize_t(si, NULL) : -1;
      PyErr_Clear();
      if (dims[i] != 1 && sv != expect) {
        pmpy_raise_fmt(PM_ERR_INVALID, "%s is not contiguous", what);
        return -1;
      }
      expect *= dims[i];
    }
  }
  *bytes = n;
  return 0;
}

/* One side of a copy -> pointer and size. */
static int resolve_memory(PyObject *o, int writable, pm_stream_t stream, const char *what,
                          holder_t *h, void **ptr, size_t *bytes) {
  memset(h, 0, sizeof *h);
  if (Buffer_Check(o)) {
    BufferObject *b = (BufferObject *)o;
    if (pmpy_buffer_check_live(b) < 0) return -1;
    if (writable && b->readonly) {
      pmpy_raise_fmt(PM_ERR_INVALID, "%s is read-only", what);
      return -1;
    }
    if (!buffer_is_c_contiguous(b)) {
      pmpy_raise_fmt(PM_ERR_INVALID,
                     "%s is not C-contiguous (memory pinned in Fortran order keeps that "
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
      /* Refused as a destination only (NumPy says ValueError, others BufferError): read-only. */
      if (writable &&
          (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_ValueError)) &&
          PyObject_GetBuffer(o, &h->view, PyBUF_C_CONTIGUOUS) == 0) {
        PyBuffer_Release(&h->view);
        PyErr_Clear();
        pmpy_raise_fmt(PM_ERR_INVALID, "%s is read-only", what);
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
          pmpy_raise_fmt(PM_ERR_INVALID,
                         "%s is not C-contiguous; pass numpy.ascontiguousarray(...) of it", what);
          return -1;
        }
      }
      PyErr_Clear();
      PyErr_Restore(et, ev, tb);
      return -1;
    }
    h->has_view = 1;
    h->obj = Py_NewRef(o);
    if (pmpy_buffer_holds_objects(o)) {
      holder_release(h);
      pmpy_raise_fmt(PM_ERR_INVALID,
                     "%s holds Python objects (dtype object); only plain data "
                     "can be copied",
                     what);
      return -1;
    }
    *ptr = h->view.buf;
    *bytes = (size_t)h->view.len;
    return 0;
  }
  if (PyObject_HasAttrString(o, "__dlpack__")) {
    DLManagedTensor *mt = pmpy_dl_import(o, stream, !writable, what);
    if (!mt) return -1;
    h->dl = mt;
    h->obj = Py_NewRef(o);
    if (pmpy_dl_compact_bytes(&mt->dl_tensor, bytes) < 0) {
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
      pmpy_raise_fmt(PM_ERR_INVALID, "%s is read-only", what);
      return -1;
    }
    if (check_device_side((void *)addr, *bytes, what) < 0) return -1;
    h->obj = Py_NewRef(o);
    *ptr = (void *)addr;
    return 0;
  }
  /* Only a missing attribute means "not this kind of memory": a property that raised says
   * what went wrong itself. */
  if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
  PyErr_Clear();
  PyErr_Format(PyExc_TypeError,
               "%s (%.100s) is not memory pinmem can copy: a pinmem buffer, an object with "
               "the buffer protocol, __dlpack__ or __cuda_array_interface__",
               what, Py_TYPE(o)->tp_name);
  return -1;
}

/* For files.c: one side resolved as copy resolves it; release with pmpy_holder_release. */
/* resolve_memory, and an address for an empty object that has none (torch's data_ptr() 0,
 * CuPy's (0, False)): 0 bytes touch no memory, but the C calls refuse NULL. A side of its own
 * for each direction, so that two such objects are not one range. */
static int resolve_side(PyObject *o, int writable, pm_stream_t stream, const char *what,
                        holder_t *h, void **ptr, size_t *bytes) {
  static char nothing[2];
  if (resolve_memory(o, writable, stream, what, h, ptr, bytes) < 0) return -1;
  if (*bytes == 0 && !*ptr) *ptr = &nothing[writable ? 0 : 1];
  return 0;
}

int pmpy_resolve_side(PyObject *o, int writable, pm_stream_t stream, const char *what,
                      pmpy_holder_t *h, void **ptr, size_t *bytes) {
  return resolve_side(o, writable, stream, what, h, ptr, bytes);
}

void pmpy_holder_release(pmpy_holder_t *h) {
  holder_release(h);
}

typedef struct {
  PyObject_HEAD pm_fence_t fence; /* NULL once released */
  holder_t hold[2];
  PyObject *stream_obj; /* a pinmem.Stream the copy runs on, kept from collection; close()
                         * may still destroy it: the fence does not need it */
  int busy;             /* threads inside pm_fence_wait */
  int finished;
  pm_status_t result;
  int path; /* pm_copy_path_t, -1 unknown */
  char error[512];
} CompletionObject;

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
  /* The path as soon as the copy is done, also while another thread still waits in
   * pm_fence_wait (the fence is released only by the last of them). */
  pm_copy_path_t path;
  if (c->fence && c->path < 0 && pm_fence_path(c->fence, &path) == PM_OK) c->path = (int)path;
  if (c->busy == 0 && c->fence) {
    pm_fence_release(c->fence);
    c->fence = NULL;
    holder_release(&c->hold[0]);
    holder_release(&c->hold[1]);
    Py_CLEAR(c->stream_obj);
  }
}

/* Release parked copies that are done; with `wait`, wait for all of them. */
void pmpy_pending_sweep(int wait) {
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

/* What a Completion holds is visible to the cycle collector: an object that keeps the
 * Completion of a copy into itself (`self.done = pinmem.copy(self, src)`) is a cycle through
 * it, and without this, unless waited for, the cycle and the memory it holds stayed for ever. A
 * Completion has no tp_clear: the other members of a cycle break it, and a copy still in flight
 * then parks its memory as for any dropped Completion. */
static int Completion_traverse(CompletionObject *self, visitproc visit, void *arg) {
  for (int i = 0; i < 2; i++) {
    Py_VISIT(self->hold[i].obj);
    if (self->hold[i].has_view) Py_VISIT(self->hold[i].view.obj);
  }
  Py_VISIT(self->stream_obj);
  return 0;
}

static void Completion_dealloc(CompletionObject *self) {
  PyObject_GC_UnTrack(self);
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
  return pmpy_raise_detail(c->result, c->error);
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
  if (pmpy_stream_take(arg, &s) < 0) return NULL;
  PyObject *result;
  if (self->finished) { /* complete: nothing to wait for */
    result = self->result != PM_OK ? completion_raise(self) : Py_NewRef(Py_None);
  } else {
    pm_status_t st = pm_fence_stream_wait(self->fence, s);
    result = st == PM_OK ? Py_NewRef(Py_None) : pmpy_raise_status(st);
  }
  pmpy_stream_drop(arg);
  return result;
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
     "'direct' or 'staged' once complete (None before).", NULL},
    {0}};

PyTypeObject pmpy_CompletionType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pinmem.Completion",
    .tp_basicsize = sizeof(CompletionObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)Completion_traverse,
    .tp_doc =
        "The completion of pinmem.copy, read_file or write_file. It keeps the memory of "
        "the transfer alive until it is done, even if it is dropped first.",
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
  if (!PyErr_Occurred())
    pmpy_raise_fmt(PM_ERR_INVALID,
                   "copy: path must be 'auto', 'direct', "
                   "'staged' or 'register'");
  return -1;
}

/* copy's body; the caller holds the stream (pmpy_stream_take) around it. */
static PyObject *copy_on(PyObject *dst, PyObject *src, PyObject *stream_obj, pm_stream_t stream,
                         PyObject *nbytes_obj, PyObject *path_obj) {
  pm_copy_path_t path;
  if (parse_path(path_obj, &path) < 0) return NULL;
  CompletionObject *c = PyObject_GC_New(CompletionObject, &pmpy_CompletionType);
  if (!c) return NULL;
  c->fence = NULL;
  memset(c->hold, 0, sizeof c->hold);
  c->stream_obj = NULL;
  c->busy = 0;
  c->finished = 1; /* until a fence exists */
  c->result = PM_OK;
  c->path = -1;
  c->error[0] = 0;
  PyObject_GC_Track(c);

  void *dptr, *sptr;
  size_t dbytes, sbytes, n;
  if (resolve_side(dst, 1, stream, "copy: dst", &c->hold[0], &dptr, &dbytes) < 0) goto fail;
  if (resolve_side(src, 0, stream, "copy: src", &c->hold[1], &sptr, &sbytes) < 0) goto fail;
  if (nbytes_obj != Py_None) {
    if (pmpy_parse_size_obj(nbytes_obj, &n) < 0) goto fail;
    if (n > sbytes || n > dbytes) {
      pmpy_raise_fmt(PM_ERR_INVALID, "copy: nbytes=%zu but src has %zu bytes and dst %zu", n,
                     sbytes, dbytes);
      goto fail;
    }
  } else {
    n = sbytes;
    if (n > dbytes) {
      pmpy_raise_fmt(PM_ERR_INVALID, "copy: src has %zu bytes but dst only %zu", sbytes, dbytes);
      goto fail;
    }
  }
  if (c->hold[0].buf && pmpy_buffer_order_before(c->hold[0].buf, stream) < 0) goto fail;
  if (c->hold[1].buf && pmpy_buffer_order_before(c->hold[1].buf, stream) < 0) goto fail;

  pm_copy_options_t opt;
  pm_copy_options_init(&opt);
  opt.path = path;
  pm_fence_t fence = NULL;
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_copy_async(dptr, sptr, n, stream, &opt, &fence);
  Py_END_ALLOW_THREADS if (st != PM_OK) {
    pmpy_raise_status(st);
    goto fail;
  }
  c->fence = fence;
  c->finished = 0;
  if (PyObject_TypeCheck(stream_obj, &pmpy_StreamType)) c->stream_obj = Py_NewRef(stream_obj);
  if (c->hold[0].buf && pmpy_buffer_record_write(c->hold[0].buf, stream) < 0) {
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

static PyObject *py_copy(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"dst", "src", "stream", "nbytes", "path", NULL};
  PyObject *dst, *src, *stream_obj = Py_None, *nbytes_obj = Py_None, *path_obj = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|O$OO:copy", kwlist, &dst, &src, &stream_obj,
                                   &nbytes_obj, &path_obj))
    return NULL;
  pmpy_pending_sweep(0);
  pm_stream_t stream;
  if (pmpy_stream_take(stream_obj, &stream) < 0) return NULL;
  PyObject *c = copy_on(dst, src, stream_obj, stream, nbytes_obj, path_obj);
  pmpy_stream_drop(stream_obj);
  return c;
}

/* A Completion for work another file queued (files.c): it takes over the fence and the holder
 * (*hold is emptied) and keeps a pinmem.Stream argument from collection, as copy's does. */
PyObject *pmpy_completion_new(pm_fence_t fence, pmpy_holder_t *hold, PyObject *stream_obj) {
  CompletionObject *c = PyObject_GC_New(CompletionObject, &pmpy_CompletionType);
  if (!c) { /* nothing may hold the memory now: let the work finish first */
    if (fence) {
      Py_BEGIN_ALLOW_THREADS pm_fence_wait(fence);
      Py_END_ALLOW_THREADS pm_fence_release(fence);
    }
    holder_release(hold);
    return NULL;
  }
  c->fence = fence;
  c->hold[0] = *hold;
  memset(hold, 0, sizeof *hold);
  memset(&c->hold[1], 0, sizeof c->hold[1]);
  c->stream_obj = PyObject_TypeCheck(stream_obj, &pmpy_StreamType) ? Py_NewRef(stream_obj) : NULL;
  c->busy = 0;
  c->finished = 0;
  c->result = PM_OK;
  c->path = -1;
  c->error[0] = 0;
  PyObject_GC_Track(c);
  if (!fence) completion_finish(c, PM_OK); /* nothing in flight */
  return (PyObject *)c;
}

static PyObject *py_pending_copies(PyObject *mod, PyObject *unused) {
  pmpy_pending_sweep(0);
  Py_ssize_t n = 0;
  for (pending_t *p = g_pending; p; p = p->next) n++;
  return PyLong_FromSsize_t(n);
}

static PyObject *py_shutdown(PyObject *mod, PyObject *unused) {
  pmpy_pending_sweep(1);
  Py_RETURN_NONE;
}

PyMethodDef pmpy_copy_functions[] = {
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_VARARGS | METH_KEYWORDS,
     "copy(dst, src, stream=None, *, nbytes=None, path=None) -> Completion"},
    {"_pending_copies", py_pending_copies, METH_NOARGS,
     "Copies in flight whose Completion was dropped (tests)."},
    {"_shutdown", py_shutdown, METH_NOARGS, "Wait for every copy in flight (atexit)."},
    {0}};
