/*
 * DESIGN: the block store's low level (pinmem._BlockStore, pinmem._BlocksEvent): pm_blocks_*
 * over plain numbers. Regions are (base address, block stride, bytes) tuples and ids are
 * buffers of 64-bit integers, so this file knows nothing of torch; python/pinmem/kv.py turns
 * tensors into regions, checks their dtype, shape and device, and picks torch's current stream.
 * A _BlocksEvent owns the event of one swap and destroys it once. Swaps, waits, alloc, create and
 * close release the GIL (pinning, a swap waiting for its chunk, event waits, alloc waiting for
 * swaps that still use freed blocks); the store is kept alive by the calling method's reference
 * meanwhile, and close() refuses to run while a call is inside (busy counter, GIL-protected).
 */
#include "_pinmem.h"

typedef struct {
  PyObject_HEAD pm_blocks_t *store;
  int busy;            /* calls inside with the GIL released */
  uint64_t num_blocks; /* fixed at creation: alloc checks a count against it */
} BlockStoreObject;

typedef struct {
  PyObject_HEAD pm_event_t event;
} BlocksEventObject;

static PyTypeObject BlocksEventType;

/* ---- _BlocksEvent ---------------------------------------------------------------------------- */

static void BlocksEvent_dealloc(BlocksEventObject *self) {
  if (self->event) (void)pm_event_destroy(self->event);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *BlocksEvent_wait(BlocksEventObject *self, PyObject *unused) {
  pm_status_t st;
  pm_event_t ev = self->event;
  Py_BEGIN_ALLOW_THREADS st = pm_event_synchronize(ev);
  Py_END_ALLOW_THREADS if (st != PM_OK) return pmpy_raise_status(st);
  Py_RETURN_NONE;
}

static PyObject *BlocksEvent_query(BlocksEventObject *self, PyObject *unused) {
  pm_status_t st = pm_event_query(self->event);
  if (st == PM_OK) Py_RETURN_TRUE;
  if (st == PM_NOT_READY) Py_RETURN_FALSE;
  return pmpy_raise_status(st);
}

static PyObject *BlocksEvent_wait_stream(BlocksEventObject *self, PyObject *arg) {
  pm_stream_t s;
  if (pmpy_stream_take(arg, &s) < 0) return NULL;
  pm_status_t st = pm_stream_wait_event(s, self->event);
  PyObject *result = st == PM_OK ? Py_NewRef(Py_None) : pmpy_raise_status(st);
  pmpy_stream_drop(arg);
  return result;
}

static PyMethodDef BlocksEvent_methods[] = {
    {"wait", (PyCFunction)BlocksEvent_wait, METH_NOARGS,
     "Block until the swap is done (its bytes are where they were sent)."},
    {"query", (PyCFunction)BlocksEvent_query, METH_NOARGS, "True once the swap is done."},
    {"wait_stream", (PyCFunction)BlocksEvent_wait_stream, METH_O,
     "Later work on the given stream waits for the swap; the caller does not."},
    {0}};

static PyTypeObject BlocksEventType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pinmem.BlocksEvent",
    .tp_basicsize = sizeof(BlocksEventObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Completion of one block store swap: wait(), query(), wait_stream(stream).",
    .tp_dealloc = (destructor)BlocksEvent_dealloc,
    .tp_methods = BlocksEvent_methods,
};

/* ---- _BlockStore ----------------------------------------------------------------------------- */

static int store_live(BlockStoreObject *self) {
  if (self->store) return 0;
  pmpy_raise_fmt(PM_ERR_STATE, "the block store was closed");
  return -1;
}

static PyObject *BlockStore_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"block_bytes", "num_blocks", "chunk_bytes", "device", "background",
                           "pin_threads", NULL};
  unsigned long long block_bytes, num_blocks, chunk = 0;
  int device = -1, background = 1, threads = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "KK|Kipi:_BlockStore", kwlist, &block_bytes,
                                   &num_blocks, &chunk, &device, &background, &threads))
    return NULL;
  pm_blocks_config_t c;
  pm_blocks_config_init(&c);
  c.block_bytes = (size_t)block_bytes;
  c.num_blocks = num_blocks;
  c.chunk_bytes = (size_t)chunk;
  c.device = device;
  c.background = background;
  c.pin_threads = threads;
  BlockStoreObject *self = (BlockStoreObject *)type->tp_alloc(type, 0);
  if (!self) return NULL;
  pm_status_t st;
  pm_blocks_t *s = NULL;
  Py_BEGIN_ALLOW_THREADS st = pm_blocks_create(&c, &s);
  Py_END_ALLOW_THREADS if (st != PM_OK) {
    Py_DECREF(self);
    return pmpy_raise_status(st);
  }
  self->store = s;
  self->num_blocks = c.num_blocks;
  return (PyObject *)self;
}

static pm_status_t store_close(BlockStoreObject *self) {
  pm_blocks_t *s = self->store;
  if (!s) return PM_OK;
  self->store = NULL;
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_blocks_destroy(s);
  Py_END_ALLOW_THREADS return st;
}

static void BlockStore_dealloc(BlockStoreObject *self) {
  (void)store_close(self);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *BlockStore_close(BlockStoreObject *self, PyObject *unused) {
  if (self->busy)
    return pmpy_raise_fmt(PM_ERR_BUSY, "the block store is in use by another thread's call");
  pm_status_t st = store_close(self);
  if (st != PM_OK) return pmpy_raise_status(st);
  Py_RETURN_NONE;
}

/* A buffer of 64-bit ids (C-contiguous, itemsize 8). */
static int get_ids(PyObject *o, Py_buffer *v, const char *what) {
  if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
  if (v->itemsize != 8 || v->len % 8) {
    PyBuffer_Release(v);
    pmpy_raise_fmt(PM_ERR_INVALID, "%s must hold 64-bit integers (itemsize 8), not itemsize %zd",
                   what, v->itemsize);
    return -1;
  }
  return 0;
}

static PyObject *BlockStore_alloc(BlockStoreObject *self, PyObject *arg) {
  if (store_live(self) < 0) return NULL;
  Py_ssize_t n = PyLong_AsSsize_t(arg);
  if (n < 0) {
    if (!PyErr_Occurred()) pmpy_raise_fmt(PM_ERR_INVALID, "alloc: count %zd is negative", n);
    return NULL;
  }
  /* More than the store has: its own refusal (it writes nothing), before the ids' buffer is
   * asked of the system (n * 8 bytes, which may not even be a size). num_blocks is fixed, so
   * no free elsewhere can make such an n fit. */
  if ((uint64_t)n > self->num_blocks) {
    uint64_t none;
    return pmpy_raise_status(pm_blocks_alloc(self->store, (size_t)n, &none));
  }
  PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
  if (!out) return NULL;
  /* The GIL goes: alloc may wait for swaps that still use freed blocks. */
  pm_status_t st;
  pm_blocks_t *s = self->store;
  uint64_t *ids = (uint64_t *)PyBytes_AS_STRING(out);
  self->busy++;
  Py_BEGIN_ALLOW_THREADS st = pm_blocks_alloc(s, (size_t)n, ids);
  Py_END_ALLOW_THREADS self->busy--;
  if (st != PM_OK) {
    Py_DECREF(out);
    return pmpy_raise_status(st);
  }
  return out;
}

static PyObject *BlockStore_free(BlockStoreObject *self, PyObject *arg) {
  if (store_live(self) < 0) return NULL;
  Py_buffer v;
  if (get_ids(arg, &v, "ids") < 0) return NULL;
  pm_status_t st = pm_blocks_free(self->store, (const uint64_t *)v.buf, (size_t)v.len / 8);
  PyBuffer_Release(&v);
  if (st != PM_OK) return pmpy_raise_status(st);
  Py_RETURN_NONE;
}

static PyObject *BlockStore_ptr(BlockStoreObject *self, PyObject *arg) {
  if (store_live(self) < 0) return NULL;
  unsigned long long id = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return NULL;
  void *p = NULL;
  pm_status_t st;
  pm_blocks_t *s = self->store;
  self->busy++;
  Py_BEGIN_ALLOW_THREADS st = pm_blocks_ptr(s, id, &p);
  Py_END_ALLOW_THREADS self->busy--;
  if (st != PM_OK) return pmpy_raise_status(st);
  return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)p);
}

static PyObject *BlockStore_wait_ready(BlockStoreObject *self, PyObject *args) {
  unsigned long long count = 0;
  if (!PyArg_ParseTuple(args, "|K:wait_ready", &count)) return NULL;
  if (store_live(self) < 0) return NULL;
  pm_status_t st;
  pm_blocks_t *s = self->store;
  self->busy++;
  Py_BEGIN_ALLOW_THREADS st = pm_blocks_wait_ready(s, count);
  Py_END_ALLOW_THREADS self->busy--;
  if (st != PM_OK) return pmpy_raise_status(st);
  Py_RETURN_NONE;
}

/* swap(out, regions, device_blocks, device, device_ids, host_ids, stream) -> _BlocksEvent */
static PyObject *BlockStore_swap(BlockStoreObject *self, PyObject *args) {
  int out, device;
  PyObject *regions, *dev_obj, *host_obj, *stream_obj;
  unsigned long long device_blocks;
  if (!PyArg_ParseTuple(args, "pOKiOOO:swap", &out, &regions, &device_blocks, &device, &dev_obj,
                        &host_obj, &stream_obj))
    return NULL;
  if (store_live(self) < 0) return NULL;
  pm_stream_t stream;
  if (pmpy_stream_take(stream_obj, &stream) < 0) return NULL;
  PyObject *result = NULL;
  pm_kv_region_t *r = NULL;
  int views = 0;
  Py_buffer dv, hv;
  PyObject *seq = pmpy_fast_tuple(regions, "regions must be a sequence of (base, stride, bytes)");
  if (!seq) goto done;
  Py_ssize_t nr = PySequence_Fast_GET_SIZE(seq);
  if (nr < 1 || nr > PM_KV_MAX_REGIONS) {
    Py_DECREF(seq);
    pmpy_raise_fmt(PM_ERR_INVALID, "swap: %zd regions (1..%d)", nr, PM_KV_MAX_REGIONS);
    goto done;
  }
  r = PyMem_Calloc((size_t)nr, sizeof *r);
  if (!r) {
    Py_DECREF(seq);
    PyErr_NoMemory();
    goto done;
  }
  for (Py_ssize_t i = 0; i < nr; i++) {
    unsigned long long base, stride, bytes;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KKK;a region is (base, stride, bytes)",
                          &base, &stride, &bytes)) {
      Py_DECREF(seq);
      goto done;
    }
    r[i] = (pm_kv_region_t){(void *)(uintptr_t)base, (size_t)stride, (size_t)bytes};
  }
  Py_DECREF(seq);
  if (get_ids(dev_obj, &dv, "device_ids") < 0) goto done;
  views = 1;
  if (get_ids(host_obj, &hv, "host_ids") < 0) goto done;
  views = 2;
  if (dv.len != hv.len) {
    pmpy_raise_fmt(PM_ERR_INVALID, "swap: %zd device ids but %zd host ids", dv.len / 8,
                   hv.len / 8);
    goto done;
  }
  BlocksEventObject *ev = PyObject_New(BlocksEventObject, &BlocksEventType);
  if (!ev) goto done;
  ev->event = NULL;
  pm_kv_layout_t L = {(int)nr, r, device_blocks, device};
  pm_blocks_t *s = self->store;
  pm_status_t st;
  size_t n = (size_t)dv.len / 8;
  self->busy++;
  Py_BEGIN_ALLOW_THREADS st =
      out ? pm_blocks_swap_out(s, &L, dv.buf, hv.buf, n, stream, &ev->event)
          : pm_blocks_swap_in(s, &L, dv.buf, hv.buf, n, stream, &ev->event);
  Py_END_ALLOW_THREADS self->busy--;
  if (st != PM_OK) {
    Py_DECREF(ev);
    pmpy_raise_status(st);
    goto done;
  }
  result = (PyObject *)ev;
done:
  if (views > 1) PyBuffer_Release(&hv);
  if (views > 0) PyBuffer_Release(&dv);
  PyMem_Free(r);
  pmpy_stream_drop(stream_obj);
  return result;
}

static PyObject *BlockStore_stats(BlockStoreObject *self, PyObject *unused) {
  if (store_live(self) < 0) return NULL;
  pm_blocks_stats_t s;
  pm_status_t st;
  pm_blocks_t *b = self->store;
  self->busy++;
  /* The first call may run the calibration: device work, waited for. */
  uint64_t idle = 0, waiting = 0, quarantined = 0;
  /* The three free counts from one reading (free_blocks with them), after the other figures. */
  Py_BEGIN_ALLOW_THREADS st = pm_blocks_get_stats(b, &s);
  if (st == PM_OK) st = pm_blocks_get_free(b, &idle, &waiting, &quarantined);
  Py_END_ALLOW_THREADS self->busy--;
  if (st != PM_OK) return pmpy_raise_status(st);
  return Py_BuildValue(
      "{sKsKsKsKsKsKsKsKsKsKsisdsdsKsOsKsKsKsKsKsKsKsKsK}", "block_bytes",
      (unsigned long long)s.block_bytes, "num_blocks", (unsigned long long)s.num_blocks,
      "free_blocks", (unsigned long long)idle, "waiting_blocks", (unsigned long long)waiting,
      "quarantined_blocks", (unsigned long long)quarantined, "ready_blocks",
      (unsigned long long)s.ready_blocks, "arena_bytes", (unsigned long long)s.arena_bytes,
      "chunk_bytes", (unsigned long long)s.chunk_bytes, "chunks", (unsigned long long)s.chunks,
      "chunks_ready", (unsigned long long)s.chunks_ready, "numa_node", s.numa_node,
      "first_ready_seconds", s.first_ready_seconds, "all_ready_seconds", s.all_ready_seconds,
      "kernel_max", (unsigned long long)s.kernel_max, "kernel_max_calibrated",
      s.kernel_max_calibrated ? Py_True : Py_False, "swaps_out", (unsigned long long)s.swaps_out,
      "swaps_in", (unsigned long long)s.swaps_in, "blocks_out", (unsigned long long)s.blocks_out,
      "blocks_in", (unsigned long long)s.blocks_in, "bytes_out", (unsigned long long)s.bytes_out,
      "bytes_in", (unsigned long long)s.bytes_in, "pieces_kernel",
      (unsigned long long)s.pieces_kernel, "pieces_dma", (unsigned long long)s.pieces_dma,
      "transfers", (unsigned long long)s.transfers);
}

static PyMethodDef BlockStore_methods[] = {
    {"close", (PyCFunction)BlockStore_close, METH_NOARGS,
     "Wait for the device's queued work, unpin the arena."},
    {"alloc", (PyCFunction)BlockStore_alloc, METH_O, "alloc(n) -> bytes of n uint64 ids."},
    {"free", (PyCFunction)BlockStore_free, METH_O, "free(ids: buffer of uint64)."},
    {"ptr", (PyCFunction)BlockStore_ptr, METH_O, "Host address of a block (waits for its chunk)."},
    {"wait_ready", (PyCFunction)BlockStore_wait_ready, METH_VARARGS,
     "wait_ready(count=0): block until the first count blocks (0: all) are pinned."},
    {"swap", (PyCFunction)BlockStore_swap, METH_VARARGS,
     "swap(out, regions, device_blocks, device, device_ids, host_ids, stream) -> BlocksEvent."},
    {"stats", (PyCFunction)BlockStore_stats, METH_NOARGS, "The store's pm_blocks_stats_t."},
    {0}};

static PyTypeObject BlockStoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pinmem._BlockStore",
    .tp_basicsize = sizeof(BlockStoreObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "_BlockStore(block_bytes, num_blocks, chunk_bytes=0, device=-1, background=True, "
              "pin_threads=0): pm_blocks_* over plain numbers (pinmem.KVBlockStore wraps it).",
    .tp_new = BlockStore_new,
    .tp_dealloc = (destructor)BlockStore_dealloc,
    .tp_methods = BlockStore_methods,
};

int pmpy_blocks_add_types(PyObject *m) {
  if (PyType_Ready(&BlockStoreType) < 0 || PyType_Ready(&BlocksEventType) < 0) return -1;
  if (PyModule_AddObjectRef(m, "_BlockStore", (PyObject *)&BlockStoreType) < 0) return -1;
  return PyModule_AddObjectRef(m, "BlocksEvent", (PyObject *)&BlocksEventType);
}
