/*
 * DESIGN: the datasets a pinmem.Loader reads (the struct is in _pinmem.h): .npy and token files
 * (read by the C library), in-memory arrays (one per field, read without the GIL), a Python
 * fetch(index) function (called from the loader's worker threads, which take the GIL for it and
 * keep the exception each sample's fetch raised, by index, for next() to re-raise the one of the
 * sample whose read failed), and zips of these (their fields
 * side by side). Each field is described by a pm_field_t: dtypes pinmem has no code for travel
 * as records of their bytes, with NumPy's descr to rebuild them.
 */
#include "_pinmem.h"
#include "internal.h" /* pm__dataset_claim_get */

static void Dataset_dealloc(DatasetObject *self) {
  if (self->ds) {
    pm_dataset_t *ds = self->ds;
    self->ds = NULL;
    pm_status_t st = pm_dataset_destroy(ds);
    if (st != PM_OK &&
        PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "pinmem: destroying a dataset failed: %s: %s",
                         pm_status_name(st), pm_last_error()) < 0)
      PyErr_WriteUnraisable((PyObject *)self);
  }
  for (int i = 0; i < self->nviews; i++) PyBuffer_Release(&self->views[i]);
  Py_CLEAR(self->fetch);
  Py_CLEAR(self->errors);
  Py_CLEAR(self->parts);
  Py_CLEAR(self->select);
  if (self->procs) pmpy_procs_free(self->procs);
  self->procs = NULL;
  Py_TYPE(self)->tp_free((PyObject *)self);
}

DatasetObject *pmpy_dataset_new(void) {
  DatasetObject *d = PyObject_New(DatasetObject, &pmpy_DatasetType);
  if (!d) return NULL;
  d->ds = NULL;
  d->nviews = 0;
  d->nfields = 0;
  d->fetch = NULL;
  d->errors = NULL;
  d->parts = NULL;
  d->select = NULL;
  d->procs = NULL;
  return d;
}

/* The key of the lowest index in a dict of errors (borrowed); NULL if it is empty. */
static PyObject *lowest_key(PyObject *errors) {
  PyObject *k, *v, *best = NULL;
  Py_ssize_t pos = 0;
  unsigned long long bi = 0;
  while (PyDict_Next(errors, &pos, &k, &v)) {
    unsigned long long i = PyLong_AsUnsignedLongLong(k);
    if (!best || i < bi) {
      best = k;
      bi = i;
    }
  }
  return best;
}

/* The exception a Python dataset (or a part of a zip or select) raised reading sample `index`,
 * taken out; NULL if none. Worker-process datasets keep one error, of the earliest batch. */
PyObject *pmpy_dataset_take_error(DatasetObject *d, uint64_t index) {
  if (d->procs) {
    PyObject *e = pmpy_procs_take_error(d);
    if (e) return e;
  }
  if (d->errors && PyDict_GET_SIZE(d->errors) > 0) {
    PyObject *key = index == PMPY_ANY_SAMPLE ? Py_XNewRef(lowest_key(d->errors))
                                             : PyLong_FromUnsignedLongLong(index);
    PyObject *e = key ? PyDict_GetItemWithError(d->errors, key) : NULL;
    if (e) {
      Py_INCREF(e);
      if (PyDict_DelItem(d->errors, key) < 0) PyErr_Clear();
    }
    Py_XDECREF(key);
    if (PyErr_Occurred()) PyErr_Clear();
    if (e) return e;
  }
  if (d->parts) {
    uint64_t at = index;
    if (d->select && index != PMPY_ANY_SAMPLE) {
      /* A select's sample i is its base's sample select[i]. */
      const uint64_t *map = (const uint64_t *)PyBytes_AS_STRING(d->select);
      uint64_t n = (uint64_t)PyBytes_GET_SIZE(d->select) / 8;
      at = index < n ? map[index] : PMPY_ANY_SAMPLE;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(d->parts); i++) {
      PyObject *e = pmpy_dataset_take_error((DatasetObject *)PyTuple_GET_ITEM(d->parts, i), at);
      if (e) return e;
    }
  }
  return NULL;
}

/* (A worker-process error is not kept here: _procs_reset forgets it.) */
void pmpy_dataset_clear_errors(DatasetObject *d) {
  if (d->errors) PyDict_Clear(d->errors);
  if (d->parts)
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(d->parts); i++)
      pmpy_dataset_clear_errors((DatasetObject *)PyTuple_GET_ITEM(d->parts, i));
}

static int parse_io(const char *io, pm_io_mode_t *out) {
  if (!io || !strcmp(io, "pread")) *out = PM_IO_PREAD;
  else if (!strcmp(io, "mmap")) *out = PM_IO_MMAP;
  else if (!strcmp(io, "direct")) *out = PM_IO_DIRECT;
  else {
    pmpy_raise_fmt(PM_ERR_INVALID, "io must be 'pread', 'mmap' or 'direct', not '%.40s'", io);
    return -1;
  }
  return 0;
}

static PyObject *py_dataset_npy(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"paths", "io", "dtype", NULL};
  PyObject *paths;
  const char *io = NULL, *dtype = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|zz:_dataset_npy", kwlist, &paths, &io, &dtype))
    return NULL;
  pm_npy_options_t opt;
  pm_npy_options_init(&opt);
  if (parse_io(io, &opt.io) < 0) return NULL;
  opt.dtype = dtype;
  PyObject *seq = pmpy_fast_tuple(paths, "paths must be a sequence of str");
  if (!seq) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  const char **p = PyMem_Calloc(n ? (size_t)n : 1, sizeof *p);
  if (!p) {
    Py_DECREF(seq);
    return PyErr_NoMemory();
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *it = PySequence_Fast_GET_ITEM(seq, i);
    p[i] = PyUnicode_Check(it) ? PyUnicode_AsUTF8(it) : NULL;
    if (!p[i]) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "paths must be str");
      PyMem_Free(p);
      Py_DECREF(seq);
      return NULL;
    }
  }
  DatasetObject *d = pmpy_dataset_new();
  pm_status_t st = PM_OK;
  if (d) {
    Py_BEGIN_ALLOW_THREADS st = pm_dataset_open_npy(p, (size_t)n, &opt, &d->ds);
    Py_END_ALLOW_THREADS
  }
  PyMem_Free(p);
  Py_DECREF(seq);
  if (!d) return NULL;
  if (st != PM_OK) {
    Py_DECREF(d);
    return pmpy_raise_status(st);
  }
  return (PyObject *)d;
}

static PyObject *py_dataset_tokens(PyObject *mod, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"path", "seq_len", "token_bytes", "random", "stride", "windows", "seed",
                           "io", NULL};
  const char *path, *io = NULL;
  Py_ssize_t seq_len, stride = 0;
  int token_bytes = 2, random = 1;
  unsigned long long windows = 0, seed = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "sn|ipnKKz:_dataset_tokens", kwlist, &path, &seq_len,
                                   &token_bytes, &random, &stride, &windows, &seed, &io))
    return NULL;
  if (seq_len <= 0 || stride < 0) return pmpy_raise_fmt(PM_ERR_INVALID, "seq_len must be > 0");
  pm_tokens_options_t opt;
  pm_tokens_options_init(&opt);
  opt.seq_len = (size_t)seq_len;
  opt.token_bytes = token_bytes;
  opt.random = random;
  opt.stride = (size_t)stride;
  opt.windows = windows;
  opt.seed = seed;
  if (parse_io(io, &opt.io) < 0) return NULL;
  DatasetObject *d = pmpy_dataset_new();
  if (!d) return NULL;
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_dataset_open_tokens(path, &opt, &d->ds);
  Py_END_ALLOW_THREADS if (st != PM_OK) {
    Py_DECREF(d);
    return pmpy_raise_status(st);
  }
  return (PyObject *)d;
}

static pm_dtype_t pm_dtype_of(const pmpy_dtype_t *dt) {
  for (int i = PM_DTYPE_BOOL; dt && i <= PM_DTYPE_COMPLEX128; i++)
    if (!strcmp(pm_dtype_name((pm_dtype_t)i), dt->name)) return (pm_dtype_t)i;
  return PM_DTYPE_OTHER;
}

/* A field spec from a dtype text (NumPy's descr: "<f4", ">f4", "<U10", "[('a', '<i4')]"), its
 * itemsize and the sample shape. Types without a code of their own travel as records of
 * itemsize bytes with their descr, which the Python side turns back into the real dtype. */
int pmpy_field_spec(int k, const char *descr, size_t itemsize, int ndim, const Py_ssize_t *shape,
                      pm_field_t *f) {
  memset(f, 0, sizeof *f);
  if (!descr || !descr[0] || strlen(descr) >= sizeof f->descr) {
    pmpy_raise_fmt(PM_ERR_INVALID, "field %d: dtype text '%.60s' is empty or too long", k,
                   descr ? descr : "");
    return -1;
  }
  const char *base = strchr("<>=|", descr[0]) ? descr + 1 : descr;
  if (base[0] == 'O' || strstr(descr, "'|O'") || strstr(descr, "'O'")) {
    pmpy_raise_fmt(PM_ERR_INVALID,
                   "field %d: dtype %.60s holds Python objects (pointers): pinmem.Loader delivers "
                   "fixed-size numbers and records only",
                   k, descr);
    return -1;
  }
  if (itemsize == 0) {
    pmpy_raise_fmt(PM_ERR_INVALID, "field %d: dtype %.60s has no fixed size (itemsize 0)", k,
                   descr);
    return -1;
  }
  if (ndim > PM_DATASET_MAX_DIMS) {
    pmpy_raise_fmt(PM_ERR_INVALID, "field %d: more than %d dimensions per sample", k,
                   PM_DATASET_MAX_DIMS);
    return -1;
  }
  const pmpy_dtype_t *dt = pmpy_dtype_from_text(descr);
  f->dtype = pm_dtype_of(dt);
  if (f->dtype != PM_DTYPE_OTHER && (size_t)(dt->bits / 8) != itemsize) f->dtype = PM_DTYPE_OTHER;
  f->itemsize = itemsize;
  f->ndim = ndim;
  for (int i = 0; i < ndim; i++) f->shape[i] = (uint64_t)shape[i];
  snprintf(f->descr, sizeof f->descr, "%s", descr);
  return 0;
}

/* d->ds: a callback dataset of n fields read by `read` with d as its user. -1 with the
 * exception set on failure. */
static int create_fields(DatasetObject *d, uint64_t samples, int n, const pm_field_t *f,
                         pm_fields_read_fn read) {
  d->nfields = n;
  pm_dataset_fields_callbacks_t cb;
  memset(&cb, 0, sizeof cb);
  cb.samples = samples;
  cb.nfields = n;
  cb.fields = f;
  cb.read = read;
  cb.user = d;
  pm_status_t st = pm_dataset_create_fields(&cb, &d->ds);
  if (st != PM_OK) {
    pmpy_raise_status(st);
    return -1;
  }
  return 0;
}

static int arrays_read(uint64_t index, void *const *dsts, void *user) {
  DatasetObject *d = user;
  for (int k = 0; k < d->nfields; k++)
    memcpy(dsts[k], (const char *)d->views[k].buf + index * d->fbytes[k], d->fbytes[k]);
  return 0;
}

/* One dataset over in-memory C-contiguous arrays: field k = samples along axis 0 of
 * arrays[k] (same length; any buffer, e.g. a uint8 view of a datetime array), described by
 * specs[k] = (sample shape, dtype text, itemsize). Read without the GIL. */
static PyObject *py_dataset_arrays(PyObject *mod, PyObject *args) {
  PyObject *arrays, *specs;
  if (!PyArg_ParseTuple(args, "OO:_dataset_arrays", &arrays, &specs)) return NULL;
  PyObject *seq = pmpy_fast_tuple(arrays, "arrays must be a sequence");
  if (!seq) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n < 1 || n > PM_MAX_FIELDS || PySequence_Size(specs) != n) {
    Py_DECREF(seq);
    if (PyErr_Occurred()) return NULL;
    return pmpy_raise_fmt(PM_ERR_INVALID, "a dataset has 1..%d arrays (fields), one spec each",
                          PM_MAX_FIELDS);
  }
  DatasetObject *d = pmpy_dataset_new();
  if (!d) {
    Py_DECREF(seq);
    return NULL;
  }
  pm_field_t f[PM_MAX_FIELDS];
  for (Py_ssize_t k = 0; k < n; k++) {
    Py_buffer *v = &d->views[k];
    if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, k), v, PyBUF_C_CONTIGUOUS) < 0)
      goto fail;
    d->nviews++;
    if (v->ndim < 1 || v->shape[0] == 0) {
      pmpy_raise_fmt(PM_ERR_INVALID,
                     "field %zd: an array dataset needs at least one sample along axis 0", k);
      goto fail;
    }
    if (v->shape[0] != d->views[0].shape[0]) {
      pmpy_raise_fmt(PM_ERR_INVALID,
                     "the arrays of a dataset need the same length (field 0 has %zd, field %zd "
                     "has %zd)",
                     d->views[0].shape[0], k, v->shape[0]);
      goto fail;
    }
    PyObject *spec = PySequence_GetItem(specs, k), *shape;
    const char *descr;
    Py_ssize_t itemsize, dims[PMPY_MAX_NDIM];
    int ndim, ok = spec &&
                   PyArg_ParseTuple(spec, "Osn:_dataset_arrays spec", &shape, &descr, &itemsize) &&
                   pmpy_parse_shape(shape, dims, &ndim) == 0 &&
                   pmpy_field_spec((int)k, descr, (size_t)(itemsize > 0 ? itemsize : 0), ndim, dims,
                              &f[k]) == 0;
    Py_XDECREF(spec); /* descr lives in the caller's specs */
    if (!ok) goto fail;
    d->fbytes[k] = (size_t)(v->len / v->shape[0]);
    size_t want = f[k].itemsize;
    for (int i = 0; i < ndim; i++) want *= (size_t)dims[i];
    if (d->fbytes[k] != want || want == 0) {
      pmpy_raise_fmt(PM_ERR_INVALID, "field %zd: samples of %zu bytes, the spec says %zu", k,
                     d->fbytes[k], want);
      goto fail;
    }
  }
  if (create_fields(d, (uint64_t)d->views[0].shape[0], (int)n, f, arrays_read) < 0) goto fail;
  Py_DECREF(seq);
  return (PyObject *)d;
fail:
  Py_DECREF(seq);
  Py_DECREF(d);
  return NULL;
}

/* Exceptions a Python dataset keeps at most (one per sample; a loader's threads stop at its
 * first error, so a few are in flight at once). */
#define PMPY_MAX_KEPT_ERRORS 1024

/* A worker thread reads one sample of a Python dataset: one fetch call for all its fields. */
static int python_read(uint64_t index, void *const *dsts, void *user) {
  DatasetObject *d = user;
  if (!Py_IsInitialized() || pmpy_interp_finalizing()) return PM_ERR_STATE;
  PyGILState_STATE g = PyGILState_Ensure();
  int rc = 0;
  /* The row it fills (batch, row): the non-array leaves of a sample are filed by it, so that an
   * index read twice in an epoch gives each row its own read's leaves. */
  uint64_t batch, row;
  pm__dataset_claim_get(&batch, &row);
  PyObject *item = PyObject_CallFunction(d->fetch, "KKK", (unsigned long long)index,
                                         (unsigned long long)batch, (unsigned long long)row);
  PyObject *seq = item ? pmpy_fast_tuple(item, "fetch must return a sequence of arrays") : NULL;
  if (seq && PySequence_Fast_GET_SIZE(seq) != d->nfields) {
    PyErr_Format(PyExc_ValueError, "pinmem.Loader: sample %llu has %zd fields, the first had %d",
                 (unsigned long long)index, PySequence_Fast_GET_SIZE(seq), d->nfields);
    rc = PM_ERR_FORMAT;
  }
  for (int k = 0; seq && !rc && k < d->nfields; k++) {
    Py_buffer v;
    if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, k), &v, PyBUF_C_CONTIGUOUS) < 0) break;
    if ((size_t)v.len == d->fbytes[k]) {
      memcpy(dsts[k], v.buf, d->fbytes[k]);
    } else {
      PyErr_Format(PyExc_ValueError,
                   "pinmem.Loader: sample %llu, field %d has %zd bytes, but the first sample "
                   "had %zu (every sample must have the same shape and dtype)",
                   (unsigned long long)index, k, v.len, d->fbytes[k]);
      rc = PM_ERR_FORMAT;
    }
    PyBuffer_Release(&v);
  }
  Py_XDECREF(seq);
  Py_XDECREF(item);
  if (PyErr_Occurred()) {
    if (!rc) rc = PM_ERR_IO;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyErr_NormalizeException(&et, &ev, &tb);
    /* Kept per sample: threads that read ahead fail too, and next() must raise the exception of
     * the sample whose read failed, not whichever was stored first. Bounded: past that many
     * (a loader whose errors nobody takes), later ones are dropped. */
    if (!d->errors) d->errors = PyDict_New();
    PyObject *key = d->errors ? PyLong_FromUnsignedLongLong(index) : NULL;
    if (key && PyDict_GET_SIZE(d->errors) < PMPY_MAX_KEPT_ERRORS &&
        !PyDict_Contains(d->errors, key)) {
      PyObject *e =
          Py_BuildValue("(OOO)", et ? et : Py_None, ev ? ev : Py_None, tb ? tb : Py_None);
      if (e) PyDict_SetItem(d->errors, key, e);
      Py_XDECREF(e);
    }
    Py_XDECREF(key);
    Py_XDECREF(et);
    Py_XDECREF(ev);
    Py_XDECREF(tb);
    PyErr_Clear();
  }
  PyGILState_Release(g);
  return rc;
}

/* One spec (sample shape, dtype text, itemsize) of field k into *f, and the bytes of the
 * field of one sample. */
int pmpy_parse_spec(PyObject *spec, int k, pm_field_t *f, size_t *bytes_out) {
  PyObject *shape;
  const char *descr;
  Py_ssize_t itemsize, dims[PMPY_MAX_NDIM];
  int ndim;
  if (!PyArg_ParseTuple(spec, "Osn:dataset spec", &shape, &descr, &itemsize) ||
      pmpy_parse_shape(shape, dims, &ndim) < 0 ||
      pmpy_field_spec(k, descr, (size_t)(itemsize > 0 ? itemsize : 0), ndim, dims, f) < 0)
    return -1;
  size_t bytes = f->itemsize;
  for (int i = 0; i < ndim; i++) bytes *= (size_t)dims[i];
  *bytes_out = bytes;
  return 0;
}

/* _dataset_python(fetch, samples, specs): specs = [(sample shape, dtype text, itemsize)], one
 * per field; fetch(i, batch, row) returns the fields of sample i (C-contiguous, checked by the
 * caller) read for that row of that batch (UINT64_MAX for both outside a loader's read). */
static PyObject *py_dataset_python(PyObject *mod, PyObject *args) {
  PyObject *fetch, *specs;
  unsigned long long samples;
  if (!PyArg_ParseTuple(args, "OKO:_dataset_python", &fetch, &samples, &specs)) return NULL;
  PyObject *seq = pmpy_fast_tuple(specs, "specs must be a sequence");
  if (!seq) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n < 1 || n > PM_MAX_FIELDS) {
    Py_DECREF(seq);
    return pmpy_raise_fmt(PM_ERR_INVALID, "a sample has 1..%d fields, not %zd", PM_MAX_FIELDS, n);
  }
  pm_field_t f[PM_MAX_FIELDS];
  DatasetObject *d = pmpy_dataset_new();
  if (!d) {
    Py_DECREF(seq);
    return NULL;
  }
  for (Py_ssize_t k = 0; k < n; k++) {
    if (pmpy_parse_spec(PySequence_Fast_GET_ITEM(seq, k), (int)k, &f[k], &d->fbytes[k]) < 0)
      goto fail;
  }
  d->fetch = Py_NewRef(fetch);
  if (create_fields(d, samples, (int)n, f, python_read) < 0) goto fail;
  Py_DECREF(seq);
  return (PyObject *)d;
fail:
  Py_DECREF(seq);
  Py_DECREF(d);
  return NULL;
}

/* _dataset_zip(datasets): one dataset with the fields of each, side by side. */
static PyObject *py_dataset_zip(PyObject *mod, PyObject *arg) {
  PyObject *parts = PySequence_Tuple(arg);
  if (!parts) return NULL;
  Py_ssize_t n = PyTuple_GET_SIZE(parts);
  pm_dataset_t *ds[PM_MAX_FIELDS];
  if (n < 1 || n > PM_MAX_FIELDS) {
    Py_DECREF(parts);
    return pmpy_raise_fmt(PM_ERR_INVALID, "a zip of 1..%d datasets, not %zd", PM_MAX_FIELDS, n);
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *o = PyTuple_GET_ITEM(parts, i);
    if (!PyObject_TypeCheck(o, &pmpy_DatasetType)) {
      Py_DECREF(parts);
      return PyErr_Format(PyExc_TypeError, "_dataset_zip takes pinmem datasets, not %.100s",
                          Py_TYPE(o)->tp_name);
    }
    ds[i] = ((DatasetObject *)o)->ds;
  }
  DatasetObject *d = pmpy_dataset_new();
  if (!d) {
    Py_DECREF(parts);
    return NULL;
  }
  d->parts = parts;
  pm_status_t st = pm_dataset_zip(ds, (size_t)n, &d->ds);
  if (st != PM_OK) {
    Py_DECREF(d);
    return pmpy_raise_status(st);
  }
  return (PyObject *)d;
}

/* fields() -> [{"descr", "shape", "itemsize", "bytes", "dtype", "native"}]: native is False for
 * dtypes pinmem's buffers cannot express (delivered as raw bytes, rebuilt from descr). */
static PyObject *Dataset_fields(DatasetObject *self, PyObject *unused) {
  pm_dataset_info_t in;
  pm_status_t st = pm_dataset_get_info(self->ds, &in);
  if (st != PM_OK) return pmpy_raise_status(st);
  PyObject *out = PyList_New(0);
  for (int k = 0; out && k < in.fields; k++) {
    pm_field_t f;
    st = pm_dataset_get_field(self->ds, k, &f);
    if (st != PM_OK) {
      Py_DECREF(out);
      return pmpy_raise_status(st);
    }
    PyObject *shape = PyTuple_New(f.ndim);
    if (!shape) {
      Py_DECREF(out);
      return NULL;
    }
    for (int i = 0; i < f.ndim; i++)
      PyTuple_SET_ITEM(shape, i, PyLong_FromUnsignedLongLong(f.shape[i]));
    PyObject *e = Py_BuildValue("{s:s,s:N,s:n,s:n,s:s,s:O}", "descr", f.descr, "shape", shape,
                                "itemsize", (Py_ssize_t)f.itemsize, "bytes", (Py_ssize_t)f.bytes,
                                "dtype", pm_dtype_name(f.dtype), "native",
                                pmpy_dtype_from_text(f.descr) ? Py_True : Py_False);
    if (!e || PyList_Append(out, e) < 0) Py_CLEAR(out);
    Py_XDECREF(e);
  }
  return out;
}

static PyObject *Dataset_info(DatasetObject *self, PyObject *unused) {
  pm_dataset_info_t in;
  pm_status_t st = pm_dataset_get_info(self->ds, &in);
  if (st != PM_OK) return pmpy_raise_status(st);
  PyObject *shape = PyTuple_New(in.ndim);
  if (!shape) return NULL;
  for (int i = 0; i < in.ndim; i++)
    PyTuple_SET_ITEM(shape, i, PyLong_FromUnsignedLongLong(in.shape[i]));
  static const char *const ios[] = {"pread", "mmap", "direct"};
  return Py_BuildValue("{s:K,s:n,s:n,s:N,s:s,s:n,s:s,s:i,s:s,s:s,s:K}", "samples",
                       (unsigned long long)in.samples, "sample_bytes", (Py_ssize_t)in.sample_bytes,
                       "target_bytes", (Py_ssize_t)in.target_bytes, "shape", shape, "dtype",
                       pm_dtype_name(in.dtype), "itemsize", (Py_ssize_t)in.itemsize, "descr",
                       in.descr, "files", in.files, "io",
                       (unsigned)in.io < 3 ? ios[in.io] : "?", "note", in.note, "tokens",
                       (unsigned long long)in.tokens);
}

/* The sample as a loader delivers it in `epoch`: (inputs bytes, targets bytes or None). */
static PyObject *Dataset_read_sample(DatasetObject *self, PyObject *args) {
  unsigned long long index, epoch = 0;
  if (!PyArg_ParseTuple(args, "K|K:read_sample", &index, &epoch)) return NULL;
  pm_dataset_info_t in;
  pm_status_t st = pm_dataset_get_info(self->ds, &in);
  if (st != PM_OK) return pmpy_raise_status(st);
  PyObject *x = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)in.sample_bytes);
  PyObject *y = in.target_bytes ? PyBytes_FromStringAndSize(NULL, (Py_ssize_t)in.target_bytes)
                                : Py_NewRef(Py_None);
  if (!x || !y) {
    Py_XDECREF(x);
    Py_XDECREF(y);
    return NULL;
  }
  char *xp = PyBytes_AS_STRING(x);
  char *yp = in.target_bytes ? PyBytes_AS_STRING(y) : NULL;
  Py_BEGIN_ALLOW_THREADS st = pm_dataset_read_sample(self->ds, epoch, index, xp, yp);
  Py_END_ALLOW_THREADS if (st != PM_OK) {
    Py_DECREF(x);
    Py_DECREF(y);
    PyObject *e = pmpy_dataset_take_error(self, (uint64_t)index);
    if (e) {
      PyErr_Restore(Py_NewRef(PyTuple_GET_ITEM(e, 0)), Py_NewRef(PyTuple_GET_ITEM(e, 1)),
                    PyTuple_GET_ITEM(e, 2) == Py_None ? NULL : Py_NewRef(PyTuple_GET_ITEM(e, 2)));
      Py_DECREF(e);
      return NULL;
    }
    return pmpy_raise_status(st);
  }
  return Py_BuildValue("(NN)", x, y);
}

/* Forget an exception a read of a loader that is gone left behind: its threads read on past the
 * batch whose error was raised until they stopped, and the next loader over this dataset must
 * raise its own errors, not theirs. */
static PyObject *Dataset_clear_error(DatasetObject *self, PyObject *unused) {
  (void)unused;
  pmpy_dataset_clear_errors(self);
  Py_RETURN_NONE;
}

static PyMethodDef Dataset_methods[] = {
    {"info", (PyCFunction)Dataset_info, METH_NOARGS, "info() -> dict"},
    {"_clear_error", (PyCFunction)Dataset_clear_error, METH_NOARGS,
     "_clear_error(): forget an exception a stopped loader's reads left behind"},
    {"read_sample", (PyCFunction)Dataset_read_sample, METH_VARARGS,
     "read_sample(index, epoch=0) -> (inputs bytes, targets bytes or None)"},
    {"fields", (PyCFunction)Dataset_fields, METH_NOARGS,
     "fields() -> [dict(descr, shape, itemsize, bytes, dtype, native)], one per field"},
    {0}};

PyTypeObject pmpy_DatasetType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pinmem._Dataset",
    .tp_basicsize = sizeof(DatasetObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A pinmem dataset (made by pinmem.Loader's helpers).",
    .tp_dealloc = (destructor)Dataset_dealloc,
    .tp_methods = Dataset_methods,
};

/* _dataset_select(base, indices): sample i is base's sample indices[i] (a buffer of uint64):
 * the order a sampler yields. */
static PyObject *py_dataset_select(PyObject *mod, PyObject *args) {
  PyObject *base, *indices;
  if (!PyArg_ParseTuple(args, "O!O:_dataset_select", &pmpy_DatasetType, &base, &indices))
    return NULL;
  Py_buffer v;
  if (PyObject_GetBuffer(indices, &v, PyBUF_C_CONTIGUOUS) < 0) return NULL;
  if (v.len % 8 || v.len == 0) {
    PyBuffer_Release(&v);
    return pmpy_raise_fmt(PM_ERR_INVALID, "a sampler gave no indices (or not uint64 ones)");
  }
  DatasetObject *d = pmpy_dataset_new();
  if (!d) {
    PyBuffer_Release(&v);
    return NULL;
  }
  DatasetObject *b = (DatasetObject *)base;
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st =
      pm_dataset_select(b->ds, (const uint64_t *)v.buf, (uint64_t)(v.len / 8), &d->ds);
  Py_END_ALLOW_THREADS if (st != PM_OK) {
    PyBuffer_Release(&v);
    Py_DECREF(d);
    return pmpy_raise_status(st);
  }
  d->nfields = b->nfields;
  memcpy(d->fbytes, b->fbytes, sizeof d->fbytes);
  d->parts = PyTuple_Pack(1, base);
  d->select = PyBytes_FromStringAndSize(v.buf, v.len);
  PyBuffer_Release(&v);
  if (!d->parts || !d->select) {
    Py_DECREF(d);
    return NULL;
  }
  return (PyObject *)d;
}

PyMethodDef pmpy_datasets_functions[] = {
    {"_dataset_select", py_dataset_select, METH_VARARGS,
     "_dataset_select(base, indices): sample i is base sample indices[i] (uint64 buffer)"},
    {"_dataset_npy", (PyCFunction)(void (*)(void))py_dataset_npy, METH_VARARGS | METH_KEYWORDS,
     "_dataset_npy(paths, io=None, dtype=None)"},
    {"_dataset_tokens", (PyCFunction)(void (*)(void))py_dataset_tokens,
     METH_VARARGS | METH_KEYWORDS,
     "_dataset_tokens(path, seq_len, token_bytes=2, random=True, stride=0, windows=0, seed=0, "
     "io=None)"},
    {"_dataset_arrays", py_dataset_arrays, METH_VARARGS,
     "_dataset_arrays(arrays, [(sample shape, dtype text, itemsize)]): field k from arrays[k]"},
    {"_dataset_python", py_dataset_python, METH_VARARGS,
     "_dataset_python(fetch, samples, [(sample shape, dtype text, itemsize)] per field)"},
    {"_dataset_zip", py_dataset_zip, METH_O, "_dataset_zip(datasets): their fields side by side"},
    {0}};
