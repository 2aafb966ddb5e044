/*
 * DESIGN: _DeviceCache, the device memory of an iterable loader's device batches (_iterable.py),
 * reused from batch to batch as the C loader reuses its ring of device slots: no cuMemAlloc and
 * no cuMemFree (which synchronizes the device) per batch once the loader runs.
 *
 * A batch takes one block through a lease (lease()): its leaves are DeviceBuffers (kind
 * 'external') at offsets of the block aligned to ALIGN bytes, and each holds the lease. When the
 * last of them goes (the user's batch, a DLPack tensor of it, a copy still reading it), the lease
 * dies and its block goes back on the free list, where a later batch takes it. So a batch stays
 * valid as long as anything holds it, as a map-style batch does.
 *
 * The rule that orders reuse: when a lease dies, the block may still be read on the device: by
 * the copy into it (on the loader's stream), or by the consumer's kernels on the stream that
 * DLPack named (__dlpack__(stream=s) made s wait for the copy, so s's work comes after it). The
 * lease records the block's `released` event on that consumer stream (the last one named, as a
 * map-style batch does), or on the loader's stream when none was named, and the next lease of the
 * block makes the loader's stream wait for that event before its copies are queued: the host
 * never blocks, and nothing is written into the block before the work queued before its release
 * is done. Work the user queues later on other streams without DLPack is the user's to order
 * (torch's caching allocator asks the same: record_stream). A copy by pinmem.copy holds the
 * buffer it reads, so the lease outlives it.
 *
 * Bounds: a block is allocated only when no free block fits the batch; one free block (the
 * smallest) is freed first, so the cache holds no more blocks than the most batches that were
 * alive at once (delivered and held, or with a copy in flight). A new block gets the size class
 * of the largest batch seen, so batches of varying shape settle on blocks that fit them all.
 * close() (the loader's close or death) frees the free blocks; a lease that dies after it frees
 * its own block, once its `released` event completed. Freeing a block waits for that event first.
 *
 * Threads: everything runs under the GIL; device allocation, freeing and event waits drop it, and
 * a block is off the free list (owned by the caller) while they run.
 */
#include "_pinmem.h"

#define ALIGN ((size_t)256) /* cudaMalloc's alignment: every leaf starts as a fresh allocation */

typedef struct {
  void *ptr; /* NULL: no block */
  size_t bytes;
  pm_event_t ready;    /* the last copy into the block: DLPack consumers wait for it */
  pm_event_t released; /* the block's last lease let go (the rule above) */
  int release_recorded;
} dblock_t;

typedef struct {
  PyObject_HEAD PyObject *stream_obj; /* the loader's pinmem.Stream: copies, and releases */
  dblock_t *free;
  Py_ssize_t nfree, cap;
  size_t max_need; /* bytes of the largest batch seen */
  int closed;
  int dl_type, dl_id; /* DLPack device of the leaves */
  unsigned long long allocations, frees, reuses;
  Py_ssize_t blocks, leased; /* blocks held (free or leased), blocks leased */
  size_t bytes;              /* device bytes held */
} DevCacheObject;

typedef struct {
  PyObject_HEAD DevCacheObject *cache;
  dblock_t block;
  uintptr_t release_stream; /* the last stream a DLPack consumer of a leaf named */
  int has_release_stream;
} LeaseObject;

/* Device memory held by every cache of the process (tests: back to zero once all are gone). */
static Py_ssize_t g_blocks;
static size_t g_bytes;

/* Up to the next of 4, 5, 6, 7 x 2^k (at most a quarter more), at least 4 KiB. */
static size_t size_class(size_t n) {
  if (n <= 4096) return 4096;
  if (n > SIZE_MAX / 2) return n; /* no class above it; the allocation says no */
  size_t p = 4096;
  while (p <= n / 2) p *= 2;
  size_t step = p / 4;
  return (n + step - 1) / step * step;
}

static pm_status_t block_new(size_t bytes, dblock_t *out) {
  dblock_t b = {NULL, bytes, NULL, NULL, 0};
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_device_alloc(bytes, &b.ptr);
  if (st == PM_OK) st = pm_event_create(PM_EVENT_DEFAULT, &b.ready);
  if (st == PM_OK) st = pm_event_create(PM_EVENT_DEFAULT, &b.released);
  if (st != PM_OK) {
    if (b.ready) pm_event_destroy(b.ready);
    if (b.ptr) pm_device_free(b.ptr);
  }
  Py_END_ALLOW_THREADS if (st != PM_OK) return st;
  *out = b;
  return PM_OK;
}

/* Free a block the caller took off every list, after the work its release ordered. */
static pm_status_t block_free(DevCacheObject *c, dblock_t *b) {
  dblock_t d = *b;
  memset(b, 0, sizeof *b);
  pm_status_t st = PM_OK, st2;
  Py_BEGIN_ALLOW_THREADS if (d.release_recorded) st = pm_event_synchronize(d.released);
  st2 = pm_device_free(d.ptr);
  if (st == PM_OK) st = st2;
  pm_event_destroy(d.ready);
  pm_event_destroy(d.released);
  Py_END_ALLOW_THREADS c->frees++;
  c->blocks--;
  c->bytes -= d.bytes;
  g_blocks--;
  g_bytes -= d.bytes;
  return st;
}

static void warn_status(PyObject *who, const char *what, pm_status_t st) {
  if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "pinmem: %s failed: %s: %s", what,
                       pm_status_name(st), pm_last_error()) < 0)
    PyErr_WriteUnraisable(who);
}

/* ---- leases ------------------------------------------------------------------------------- */

static void Lease_dealloc(LeaseObject *self) {
  DevCacheObject *c = self->cache;
  if (c && self->block.ptr) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    /* The release goes on the consumer's stream (it waited for the copy), else the loader's. */
    pm_stream_t s = NULL;
    PyObject *taken = NULL; /* the loader's stream, when taken here */
    int have = 0;
    uintptr_t v = self->release_stream;
    if (self->has_release_stream && v && v != (uintptr_t)-1 &&
        (pmpy_is_cuda_backend() || v > 2)) {
      s = (pm_stream_t)v;
      have = 1;
    } else if (pmpy_stream_take(c->stream_obj, &s) == 0) {
      taken = c->stream_obj;
      have = 1;
    } else {
      PyErr_Clear(); /* closed: its destroy waits for all of its work */
    }
    pm_status_t st = PM_OK;
    self->block.release_recorded = 0;
    if (have) {
      st = pm_event_record(self->block.released, s);
      if (st == PM_OK) {
        self->block.release_recorded = 1;
      } else {
        warn_status((PyObject *)self, "recording a device batch's release", st);
        /* Then nothing queued before the release can still run. */
        Py_BEGIN_ALLOW_THREADS(void) pm_stream_synchronize(s);
        Py_END_ALLOW_THREADS
      }
      pmpy_stream_drop(taken);
    }
    c->leased--;
    int kept = 0;
    if (!c->closed) {
      if (c->nfree == c->cap) {
        Py_ssize_t cap = c->cap ? 2 * c->cap : 4;
        dblock_t *grown = PyMem_Realloc(c->free, (size_t)cap * sizeof *grown);
        if (grown) {
          c->free = grown;
          c->cap = cap;
        }
      }
      if (c->nfree < c->cap) {
        c->free[c->nfree++] = self->block;
        memset(&self->block, 0, sizeof self->block);
        kept = 1;
      }
    }
    if (!kept) {
      st = block_free(c, &self->block);
      if (st != PM_OK) warn_status((PyObject *)self, "freeing a device batch's memory", st);
    }
    PyErr_Restore(et, ev, tb);
  }
  Py_CLEAR(self->cache);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject LeaseType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pinmem._DeviceLease",
    .tp_basicsize = sizeof(LeaseObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One device batch's block of a _DeviceCache; its leaves hold it.",
    .tp_dealloc = (destructor)Lease_dealloc,
};

/* A leaf goes: the stream its DLPack consumer named is where the block's release is ordered. */
static void leaf_released(BufferObject *b) {
  LeaseObject *l = (LeaseObject *)b->keep;
  if (l && b->has_consumer_stream) {
    l->release_stream = b->consumer_stream;
    l->has_release_stream = 1;
  }
}

/* ---- the cache ---------------------------------------------------------------------------- */

static PyObject *DevCache_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"stream", NULL};
  PyObject *stream;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O!:_DeviceCache", kwlist, &pmpy_StreamType,
                                   &stream))
    return NULL;
  int dev = 0;
  pm_status_t st = pm_device_get(&dev);
  if (st != PM_OK) return pmpy_raise_status(st);
  DevCacheObject *self = (DevCacheObject *)type->tp_alloc(type, 0);
  if (!self) return NULL;
  self->stream_obj = Py_NewRef(stream);
  self->dl_type = pmpy_is_cuda_backend() ? kDLCUDA : kDLCPU;
  self->dl_id = pmpy_is_cuda_backend() ? dev : 0;
  return (PyObject *)self;
}

/* Free every free block; the first failure is returned (the others are still tried). */
static pm_status_t cache_drop_free(DevCacheObject *self) {
  pm_status_t first = PM_OK;
  while (self->nfree > 0) {
    dblock_t b = self->free[--self->nfree];
    pm_status_t st = block_free(self, &b);
    if (st != PM_OK && first == PM_OK) first = st;
  }
  return first;
}

static void DevCache_dealloc(DevCacheObject *self) {
  /* Leases hold the cache: none is alive here. */
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
  self->closed = 1;
  pm_status_t st = cache_drop_free(self);
  if (st != PM_OK) warn_status((PyObject *)self, "freeing an iterable loader's device memory", st);
  PyErr_Restore(et, ev, tb);
  PyMem_Free(self->free);
  Py_CLEAR(self->stream_obj);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Take the best-fitting free block for `need` bytes, or allocate one (after freeing the
 * smallest free block: the cache never grows past the most batches alive at once; and all of
 * them when the device has no room for the new one). */
static int cache_take(DevCacheObject *self, size_t need, dblock_t *out) {
  Py_ssize_t best = -1, smallest = -1;
  for (Py_ssize_t i = 0; i < self->nfree; i++) {
    size_t n = self->free[i].bytes;
    if (n >= need && (best < 0 || n < self->free[best].bytes)) best = i;
    if (smallest < 0 || n < self->free[smallest].bytes) smallest = i;
  }
  if (best >= 0) {
    *out = self->free[best];
    self->free[best] = self->free[--self->nfree];
    self->reuses++;
    return 0;
  }
  if (smallest >= 0) {
    dblock_t b = self->free[smallest];
    self->free[smallest] = self->free[--self->nfree];
    pm_status_t st = block_free(self, &b);
    if (st != PM_OK) {
      pmpy_raise_status(st);
      return -1;
    }
  }
  if (need > self->max_need) self->max_need = need;
  pm_status_t st = block_new(size_class(self->max_need), out);
  if (st != PM_OK && self->nfree > 0) {
    /* Out of device memory with free blocks too small to use: give them all back, try again. */
    pm_status_t st2 = cache_drop_free(self);
    if (st2 == PM_OK) st = block_new(size_class(self->max_need), out);
  }
  if (st != PM_OK) {
    pmpy_raise_status(st);
    return -1;
  }
  self->allocations++;
  self->blocks++;
  self->bytes += out->bytes;
  g_blocks++;
  g_bytes += out->bytes;
  return 0;
}

/* A device leaf like pinned source `src` (shape, dtype, C order), no memory yet. */
static BufferObject *leaf_like(BufferObject *src) {
  BufferObject *b = pmpy_buffer_alloc(&pmpy_DeviceBufferType, src->ndim);
  if (!b) return NULL;
  memcpy(b->shape, src->shape, (size_t)src->ndim * sizeof *b->shape);
  b->dtype = src->dtype;
  b->itemsize = src->itemsize;
  size_t nbytes;
  if (pmpy_buffer_set_format(b, src->format) < 0 || pmpy_buffer_set_c_strides(b, &nbytes) < 0) {
    Py_DECREF(b);
    return NULL;
  }
  b->nbytes = nbytes;
  return b;
}

/* After a failure part way through a batch's copies: those queued read the sources, which the
 * caller is about to drop, and write the block, which goes back: let them finish first. */
static void drain(pm_stream_t stream) {
  PyObject *et, *ev, *tb;
  PyErr_Fetch(&et, &ev, &tb);
  Py_BEGIN_ALLOW_THREADS(void) pm_stream_synchronize(stream);
  Py_END_ALLOW_THREADS PyErr_Restore(et, ev, tb);
}

/* batch's body; the caller holds the stream (pmpy_stream_take) around it. */
static PyObject *devcache_batch_on(DevCacheObject *self, PyObject *srcs, pm_stream_t stream) {
  /* Batches whose copies completed (and that nobody holds) go back first: their pinned
   * sources to the pool, their blocks to the free list. */
  pmpy_pending_sweep(0);
  PyObject *keep = PySequence_Tuple(srcs); /* the sources, held until the copies are done */
  if (!keep) return NULL;
  Py_ssize_t n = PyTuple_GET_SIZE(keep);
  PyObject *out = PyList_New(n);
  size_t *offs = PyMem_Calloc((size_t)(n ? n : 1), sizeof *offs);
  LeaseObject *lease = NULL;
  int queued = 0;
  if (!out || !offs) {
    if (!PyErr_Occurred()) PyErr_NoMemory();
    goto fail;
  }
  size_t need = 0;
  for (Py_ssize_t k = 0; k < n; k++) {
    PyObject *o = PyTuple_GET_ITEM(keep, k);
    if (!PyObject_TypeCheck(o, &pmpy_PinnedBufferType) ||
        pmpy_buffer_check_live((BufferObject *)o) < 0) {
      if (!PyErr_Occurred())
        PyErr_Format(PyExc_TypeError, "batch takes live pinmem.PinnedBuffers, not %.100s",
                     Py_TYPE(o)->tp_name);
      goto fail;
    }
    BufferObject *b = leaf_like((BufferObject *)o);
    if (!b) goto fail;
    PyList_SET_ITEM(out, k, (PyObject *)b);
    /* Every leaf gets at least one aligned unit: a distinct address, never the block's end. */
    size_t room = ((b->nbytes ? b->nbytes : 1) + ALIGN - 1) / ALIGN * ALIGN;
    if (room < b->nbytes || need > SIZE_MAX - room) {
      pmpy_raise_fmt(PM_ERR_INVALID, "a device batch is too large for memory");
      goto fail;
    }
    offs[k] = need;
    need += room;
  }
  lease = PyObject_New(LeaseObject, &LeaseType);
  if (!lease) goto fail;
  lease->cache = (DevCacheObject *)Py_NewRef(self);
  memset(&lease->block, 0, sizeof lease->block);
  lease->release_stream = 0;
  lease->has_release_stream = 0;
  if (cache_take(self, need ? need : ALIGN, &lease->block) < 0) goto fail;
  self->leased++;
  pm_status_t st = PM_OK;
  if (lease->block.release_recorded) {
    /* The rule: this batch's copies, queued next on this stream, wait for the block's release. */
    st = pm_stream_wait_event(stream, lease->block.released);
    if (st != PM_OK) goto fail_st; /* the block goes back to the free list as it was */
  }
  for (Py_ssize_t k = 0; k < n; k++) {
    BufferObject *b = (BufferObject *)PyList_GET_ITEM(out, k);
    b->kind = BUF_EXTERNAL;
    b->ptr = (char *)lease->block.ptr + offs[k];
    b->host_visible = 0;
    b->dl_device_type = self->dl_type;
    b->dl_device_id = self->dl_id;
    b->ready = lease->block.ready; /* one event for the leaves: recorded after all copies */
    b->ready_owned = 0;
    b->keep = Py_NewRef(lease);
    b->on_release = leaf_released;
    b->released = 0;
  }
  /* The copies: direct DMA from the pool's pinned memory (a source that is not pinned is an
   * error, never a silent staged copy); they run in order on the stream, so the last one's fence
   * completes after all of them. */
  pm_copy_options_t opt;
  pm_copy_options_init(&opt);
  opt.path = PM_PATH_DIRECT;
  pm_fence_t fence = NULL;
  Py_ssize_t last = -1;
  for (Py_ssize_t k = 0; k < n; k++)
    if (((BufferObject *)PyList_GET_ITEM(out, k))->nbytes) last = k;
  for (Py_ssize_t k = 0; k <= last; k++) {
    BufferObject *d = (BufferObject *)PyList_GET_ITEM(out, k);
    BufferObject *s = (BufferObject *)PyTuple_GET_ITEM(keep, k);
    if (!d->nbytes) continue;
    st = pm_copy_async(d->ptr, s->ptr, d->nbytes, stream, &opt, k == last ? &fence : NULL);
    if (st != PM_OK) goto fail_st;
    queued = 1;
  }
  st = pm_event_record(lease->block.ready, stream);
  if (st != PM_OK) goto fail_st;
  for (Py_ssize_t k = 0; k < n; k++) ((BufferObject *)PyList_GET_ITEM(out, k))->ready_recorded = 1;
  if (fence) {
    /* A Completion holds the sources until the copies are done (parked once dropped, swept
     * above). It does not hold the leaves: a dropped batch's block may go back while its
     * copies run, since its release is ordered after them on the stream. */
    pmpy_holder_t h;
    memset(&h, 0, sizeof h);
    h.obj = keep;
    keep = NULL;
    Py_XDECREF(pmpy_completion_new(fence, &h, self->stream_obj));
    if (PyErr_Occurred()) PyErr_Clear(); /* it waited for the copies instead */
  }
  Py_XDECREF(keep);
  Py_DECREF(lease);
  PyMem_Free(offs);
  return out;

fail_st:
  pmpy_raise_status(st);
fail:
  if (queued) drain(stream);
  Py_XDECREF(lease);
  Py_XDECREF(out);
  PyMem_Free(offs);
  Py_XDECREF(keep);
  return NULL;
}

static PyObject *DevCache_batch(DevCacheObject *self, PyObject *srcs) {
  if (self->closed) return pmpy_raise_fmt(PM_ERR_STATE, "the loader's device memory was freed");
  /* The take holds a reference: `so` stays valid whatever the body does to self. */
  PyObject *so = self->stream_obj;
  pm_stream_t stream;
  if (pmpy_stream_take(so, &stream) < 0) return NULL;
  PyObject *out = devcache_batch_on(self, srcs, stream);
  pmpy_stream_drop(so);
  return out;
}

static PyObject *DevCache_close(DevCacheObject *self, PyObject *unused) {
  self->closed = 1;
  pm_status_t st = cache_drop_free(self);
  if (st != PM_OK) return pmpy_raise_status(st);
  Py_RETURN_NONE;
}

static PyObject *DevCache_stats(DevCacheObject *self, PyObject *unused) {
  return Py_BuildValue("{s:K,s:K,s:K,s:n,s:n,s:n}", "allocations", self->allocations, "frees",
                       self->frees, "reuses", self->reuses, "blocks", self->blocks, "leased",
                       self->leased, "bytes", (Py_ssize_t)self->bytes);
}

static PyMethodDef DevCache_methods[] = {
    {"batch", (PyCFunction)DevCache_batch, METH_O,
     "batch(pinned_buffers) -> DeviceBuffers over one block, copies of the buffers queued on the "
     "loader's stream after the block's last release; the block comes back when the last of "
     "them goes"},
    {"close", (PyCFunction)DevCache_close, METH_NOARGS,
     "close(): free the free blocks; blocks still leased are freed when they come back"},
    {"stats", (PyCFunction)DevCache_stats, METH_NOARGS,
     "stats() -> dict: allocations, frees, reuses, blocks, leased, bytes"},
    {0}};

static PyTypeObject DevCacheType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pinmem._DeviceCache",
    .tp_basicsize = sizeof(DevCacheObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "_DeviceCache(stream): device blocks reused across an iterable loader's batches.",
    .tp_new = DevCache_new,
    .tp_dealloc = (destructor)DevCache_dealloc,
    .tp_methods = DevCache_methods,
};

static PyObject *py_device_cache_totals(PyObject *mod, PyObject *unused) {
  return Py_BuildValue("{s:n,s:n}", "blocks", g_blocks, "bytes", (Py_ssize_t)g_bytes);
}

static PyMethodDef devcache_functions[] = {
    {"_device_cache_totals", py_device_cache_totals, METH_NOARGS,
     "_device_cache_totals() -> dict: blocks and bytes every _DeviceCache holds (tests)"},
    {0}};

int pmpy_devcache_add(PyObject *m) {
  if (PyType_Ready(&LeaseType) < 0 || PyType_Ready(&DevCacheType) < 0) return -1;
  if (PyModule_AddObjectRef(m, "_DeviceCache", (PyObject *)&DevCacheType) < 0) return -1;
  return PyModule_AddFunctions(m, devcache_functions);
}
