/*
 * DESIGN: the module functions over the default pool (stats, budget, trim, reserve, peak), the
 * option table, and introspection: pointer_info, the backend, devices, synchronize, and the
 * status names and exceptions for the Python side; the CPUs the loader's worker processes run
 * on (NUMA placement, the library's rule from numa_place.c) and its test hook.
 */
#include "_pinmem.h"

#include "internal.h" /* pm__numa_cpus_for, pm__numa_test_override, pm__numa_state */

static int default_pool(pm_pool_t **pool) {
  pm_status_t st = pm_pool_default(pool);
  if (st != PM_OK) {
    pmpy_raise_status(st);
    return -1;
  }
  return 0;
}

static PyObject *py_stats(PyObject *mod, PyObject *unused) {
  pm_pool_t *pool;
  if (default_pool(&pool) < 0) return NULL;
  pm_pool_stats_t s;
  pm_status_t st = pm_pool_get_stats(pool, &s);
  if (st != PM_OK) return pmpy_raise_status(st);
  PyObject *d = Py_BuildValue(
      "{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:d,s:d,s:K}", "budget",
      (unsigned long long)s.budget, "pinned_bytes", (unsigned long long)s.pinned_bytes,
      "pinned_peak", (unsigned long long)s.pinned_peak, "in_use_bytes",
      (unsigned long long)s.in_use_bytes, "requested_bytes", (unsigned long long)s.requested_bytes,
      "cached_bytes", (unsigned long long)s.cached_bytes, "pending_bytes",
      (unsigned long long)s.pending_bytes, "registered_bytes",
      (unsigned long long)s.registered_bytes, "segments", (unsigned long long)s.segments, "allocs",
      (unsigned long long)s.allocs, "frees", (unsigned long long)s.frees, "cache_hits",
      (unsigned long long)s.cache_hits, "backend_allocs", (unsigned long long)s.backend_allocs,
      "backend_frees", (unsigned long long)s.backend_frees, "budget_waits",
      (unsigned long long)s.budget_waits, "budget_failures", (unsigned long long)s.budget_failures,
      "backend_alloc_seconds", s.backend_alloc_seconds, "backend_free_seconds",
      s.backend_free_seconds, "numa_bind_failures", (unsigned long long)s.numa_bind_failures);
  if (!d) return NULL;
  /* "numa": the pool's memory by the node it was pinned for (node -1: no placement asked). */
  pm_pool_node_stats_t ns[65];
  int n = 0;
  st = pm_pool_numa_stats(pool, ns, 65, &n);
  if (st != PM_OK) {
    Py_DECREF(d);
    return pmpy_raise_status(st);
  }
  PyObject *list = PyList_New(0);
  for (int i = 0; list && i < n && i < 65; i++) {
    PyObject *e = Py_BuildValue("{s:i,s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "node", ns[i].node,
                                "pinned_bytes", (unsigned long long)ns[i].pinned_bytes,
                                "unbound_bytes", (unsigned long long)ns[i].unbound_bytes,
                                "cached_bytes", (unsigned long long)ns[i].cached_bytes,
                                "in_use_bytes", (unsigned long long)ns[i].in_use_bytes, "blocks",
                                (unsigned long long)ns[i].blocks, "segments",
                                (unsigned long long)ns[i].segments, "bind_failures",
                                (unsigned long long)ns[i].bind_failures);
    if (!e || PyList_Append(list, e) < 0) Py_CLEAR(list);
    Py_XDECREF(e);
  }
  if (!list || PyDict_SetItemString(d, "numa", list) < 0) {
    Py_XDECREF(list);
    Py_DECREF(d);
    return NULL;
  }
  Py_DECREF(list);
  /* Whether binding can work in this process at all, and why the last one failed: a count of
   * failures alone does not tell a missing libnuma from a node the cpuset leaves out. */
  pm__numa_state_t ns_state;
  pm__numa_state(&ns_state);
  PyObject *why = PyUnicode_DecodeUTF8(ns_state.last_failure,
                                       (Py_ssize_t)strlen(ns_state.last_failure), "replace");
  if (!why || PyDict_SetItemString(d, "numa_last_failure", why) < 0 ||
      PyDict_SetItemString(d, "numa_libnuma", ns_state.libnuma ? Py_True : Py_False) < 0) {
    Py_XDECREF(why);
    Py_DECREF(d);
    return NULL;
  }
  Py_DECREF(why);
  return d;
}

static PyObject *py_budget(PyObject *mod, PyObject *unused) {
  pm_pool_t *pool;
  if (default_pool(&pool) < 0) return NULL;
  pm_pool_stats_t s;
  pm_status_t st = pm_pool_get_stats(pool, &s);
  if (st != PM_OK) return pmpy_raise_status(st);
  return PyLong_FromSize_t(s.budget);
}

static PyObject *py_set_budget(PyObject *mod, PyObject *arg) {
  size_t bytes;
  if (pmpy_parse_size_obj(arg, &bytes) < 0) return NULL;
  pm_pool_t *pool;
  if (default_pool(&pool) < 0) return NULL;
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_pool_set_budget(pool, bytes);
  Py_END_ALLOW_THREADS if (st != PM_OK) return pmpy_raise_status(st);
  Py_RETURN_NONE;
}

static PyObject *py_trim(PyObject *mod, PyObject *unused) {
  pmpy_pending_sweep(0);
  pm_pool_t *pool;
  if (default_pool(&pool) < 0) return NULL;
  size_t released = 0;
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_pool_trim(pool, &released);
  Py_END_ALLOW_THREADS if (st != PM_OK) return pmpy_raise_status(st);
  return PyLong_FromSize_t(released);
}

static PyObject *py_reserve(PyObject *mod, PyObject *arg) {
  size_t bytes;
  if (pmpy_parse_size_obj(arg, &bytes) < 0) return NULL;
  pm_pool_t *pool;
  if (default_pool(&pool) < 0) return NULL;
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_pool_reserve(pool, bytes, PM_HOST_DEFAULT);
  Py_END_ALLOW_THREADS if (st != PM_OK) return pmpy_raise_status(st);
  Py_RETURN_NONE;
}

static PyObject *py_reset_peak(PyObject *mod, PyObject *unused) {
  pm_pool_t *pool;
  if (default_pool(&pool) < 0) return NULL;
  pm_status_t st = pm_pool_reset_peak(pool);
  if (st != PM_OK) return pmpy_raise_status(st);
  Py_RETURN_NONE;
}

static const char *const g_source_names[] = {"default", "env", "set"};

static PyObject *option_dict(const pm_option_info_t *o) {
  return Py_BuildValue("{s:s,s:s,s:s,s:s,s:s}", "value", o->value, "default", o->default_value,
                       "env", o->env, "source",
                       (unsigned)o->source < 3 ? g_source_names[o->source] : "?", "doc", o->doc);
}

static PyObject *py_options(PyObject *mod, PyObject *unused) {
  PyObject *d = PyDict_New();
  if (!d) return NULL;
  int n = pm_option_count();
  for (int i = 0; i < n; i++) {
    pm_option_info_t o;
    pm_status_t st = pm_option_get(i, &o);
    if (st != PM_OK) {
      Py_DECREF(d);
      return pmpy_raise_status(st);
    }
    PyObject *v = option_dict(&o);
    if (!v || PyDict_SetItemString(d, o.name, v) < 0) {
      Py_XDECREF(v);
      Py_DECREF(d);
      return NULL;
    }
    Py_DECREF(v);
  }
  return d;
}

static PyObject *py_get_option(PyObject *mod, PyObject *arg) {
  const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
  if (!name) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "option name must be a string");
    return NULL;
  }
  pm_option_info_t o;
  pm_status_t st = pm_option_find(name, &o);
  if (st != PM_OK) return pmpy_raise_status(st);
  return PyUnicode_FromString(o.value);
}

static PyObject *py_set_option(PyObject *mod, PyObject *args) {
  const char *name;
  PyObject *value;
  if (!PyArg_ParseTuple(args, "sO:set_option", &name, &value)) return NULL;
  if (value == Py_None) { /* the explicit value dropped: the environment's or the default again */
    pm_status_t st = pm_option_set(name, NULL);
    if (st != PM_OK) return pmpy_raise_status(st);
    Py_RETURN_NONE;
  }
  PyObject *text = PyUnicode_Check(value) ? Py_NewRef(value)
                   : PyBool_Check(value)  ? PyUnicode_FromString(value == Py_True ? "1" : "0")
                                          : PyObject_Str(value);
  if (!text) return NULL;
  const char *v = PyUnicode_AsUTF8(text);
  if (!v) {
    Py_DECREF(text);
    return NULL;
  }
  pm_status_t st = pm_option_set(name, v);
  Py_DECREF(text);
  if (st != PM_OK) return pmpy_raise_status(st);
  Py_RETURN_NONE;
}

static PyObject *py_parse_size(PyObject *mod, PyObject *arg) {
  size_t v;
  if (pmpy_parse_size_obj(arg, &v) < 0) return NULL;
  return PyLong_FromSize_t(v);
}

static PyObject *py_pointer_info(PyObject *mod, PyObject *arg) {
  static const char *const kinds[] = {"pageable", "pool", "registered", "managed", "device"};
  const void *p;
  if (Buffer_Check(arg)) {
    if (pmpy_buffer_check_live((BufferObject *)arg) < 0) return NULL;
    p = ((BufferObject *)arg)->ptr;
  } else if (PyLong_Check(arg)) {
    uintptr_t v;
    if (pmpy_parse_address(arg, &v) < 0) return NULL;
    p = (const void *)v;
  } else if (PyObject_CheckBuffer(arg)) {
    Py_buffer v;
    if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE) < 0) return NULL;
    p = v.buf;
    PyBuffer_Release(&v);
  } else {
    PyErr_Format(PyExc_TypeError, "pointer_info takes an int address, a pinmem buffer or a "
                                  "buffer-protocol object, not %.100s",
                 Py_TYPE(arg)->tp_name);
    return NULL;
  }
  pm_pointer_info_t info;
  pm_status_t st = pm_pointer_query(p, &info);
  if (st != PM_OK) return pmpy_raise_status(st);
  return Py_BuildValue(
      "{s:s,s:K,s:K,s:I,s:K,s:O}", "kind", (unsigned)info.kind < 5 ? kinds[info.kind] : "?", "base",
      (unsigned long long)(uintptr_t)info.base, "size", (unsigned long long)info.size, "flags",
      info.flags, "device_ptr", (unsigned long long)(uintptr_t)info.device_ptr, "in_use",
      info.in_use ? Py_True : Py_False);
}

/* _memory_device(addr) -> the device whose memory addr is (the backend's pointer_device), or -1:
 * host or managed memory, an address the backend does not know, a backend that cannot tell.
 * pm_pointer_info_t has no device; KVBlockStore asks this of tensors torch sees on the CPU (the
 * host backend's simulated device memory, from kv_device_tensor). */
static PyObject *py_memory_device(PyObject *mod, PyObject *arg) {
  uintptr_t v;
  if (pmpy_parse_address(arg, &v) < 0) return NULL;
  const pm__backend_t *b = pm__backend();
  if (!b) return pmpy_raise_status(pm__backend_failed());
  return PyLong_FromLong(b->pointer_device ? b->pointer_device((const void *)v) : -1);
}

/* _bound_device() -> the calling thread's device, or -1 where it has none yet (cuda: no
 * current context; current_device() answers 0 there, as CUDA's runtime does). With
 * _put_back_device, for Python code that makes another device current for its work and gives
 * the thread its own back: a thread that had none gets none back, not device 0 (whose context
 * it would get: hundreds of MB of GPU 0 in a process of another GPU). */
static PyObject *py_bound_device(PyObject *mod, PyObject *unused) {
  const pm__backend_t *b = pm__backend();
  if (!b) return pmpy_raise_status(pm__backend_failed());
  int binding = PM__DEVICE_NONE;
  pm_status_t st = pm__device_binding(pm__backend_raw(), &binding);
  if (st != PM_OK) return pmpy_raise_status(st);
  return PyLong_FromLong(binding >= 0 ? binding : -1);
}

/* _put_back_device(device): device >= 0 made current (set_device), -1: the thread left with
 * none (_bound_device). */
static PyObject *py_put_back_device(PyObject *mod, PyObject *arg) {
  long dev = PyLong_AsLong(arg);
  if (dev == -1 && PyErr_Occurred()) return NULL;
  if (dev < -1 || dev > INT_MAX)
    return pmpy_raise_status(
        pm__set_error(PM_ERR_INVALID, "_put_back_device: %ld is not -1 or a device", dev));
  if (dev >= 0) {
    pm_status_t st = pm_device_set((int)dev);
    if (st != PM_OK) return pmpy_raise_status(st);
  } else {
    const pm__backend_t *b = pm__backend();
    if (!b) return pmpy_raise_status(pm__backend_failed());
    pm__device_put_back(pm__backend_raw(), PM__DEVICE_NONE);
  }
  Py_RETURN_NONE;
}

/* _host_mismatches(reset=False) -> (count, the last in words): the host backend's count of calls
 * that broke CUDA's multi-device rules (backend_host_memory.c), for tests of which device a
 * thread works for; reset=True zeroes the counters after reading them. */
static PyObject *py_host_mismatches(PyObject *mod, PyObject *args) {
  int reset = 0;
  if (!PyArg_ParseTuple(args, "|p:_host_mismatches", &reset)) return NULL;
  char note[256];
  pm__hb_last_mismatch(note, sizeof note);
  unsigned long long n = (unsigned long long)pm__hb_device_mismatches(-1);
  if (reset) pm__hb_device_counters_reset();
  return Py_BuildValue("(Ks)", n, note);
}

static PyObject *py_init(PyObject *mod, PyObject *unused) {
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_init();
  Py_END_ALLOW_THREADS if (st != PM_OK) return pmpy_raise_status(st);
  return PyUnicode_FromString(pm_backend_name());
}

static PyObject *py_backend(PyObject *mod, PyObject *unused) {
  if (pm_backend_kind() == PM_BACKEND_NONE) {
    pm_status_t st;
    Py_BEGIN_ALLOW_THREADS st = pm_init();
    Py_END_ALLOW_THREADS if (st != PM_OK) return pmpy_raise_status(st);
  }
  return PyUnicode_FromString(pm_backend_name());
}

/* backend_info(): why the backend in force is the one it is (pm_backend_info). */
static PyObject *py_backend_info(PyObject *mod, PyObject *unused) {
  pm_backend_info_t bi;
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_backend_info(&bi);
  Py_END_ALLOW_THREADS if (st != PM_OK) return pmpy_raise_status(st);
  const char *req = bi.requested == PM_BACKEND_CUDA   ? "cuda"
                    : bi.requested == PM_BACKEND_HOST ? "host"
                                                      : "auto";
  PyObject *drv;
  if (bi.driver_version)
    drv = Py_BuildValue("(ii)", bi.driver_version / 1000, (bi.driver_version % 1000) / 10);
  else
    drv = Py_NewRef(Py_None);
  if (!drv) return NULL;
  return Py_BuildValue("{s:s,s:s,s:O,s:s,s:N,s:i,s:O,s:s,s:s,s:s}", "backend",
                       bi.kind == PM_BACKEND_CUDA   ? "cuda"
                       : bi.kind == PM_BACKEND_HOST ? "host"
                                                    : "none",
                       "requested", req, "fallback", bi.fallback ? Py_True : Py_False, "reason",
                       bi.reason, "driver_version", drv, "devices", bi.device_count,
                       "cuda_compiled", bi.cuda_compiled ? Py_True : Py_False, "driver_library",
                       bi.driver_library, "driver_missing", bi.driver_missing, "kernels",
                       bi.kernels);
}

static PyObject *py_device_count(PyObject *mod, PyObject *unused) {
  int n = 0;
  pm_status_t st = pm_device_count(&n);
  if (st != PM_OK) return pmpy_raise_status(st);
  return PyLong_FromLong(n);
}

static PyObject *py_device_info(PyObject *mod, PyObject *args) {
  int dev = 0;
  if (!PyArg_ParseTuple(args, "|i:device_info", &dev)) return NULL;
  pm_device_info_t d;
  pm_status_t st = pm_device_get_info(dev, &d);
  if (st != PM_OK) return pmpy_raise_status(st);
  return Py_BuildValue(
      "{s:i,s:s,s:(ii),s:K,s:K,s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:O,s:O,s:O,s:O,s:O,s:O}", "index",
      d.index, "name", d.name, "compute_capability", d.cc_major, d.cc_minor, "total_memory",
      (unsigned long long)d.total_memory, "free_memory", (unsigned long long)d.free_memory,
      "pci_bus_id", d.pci_bus_id, "pcie_gen", d.pcie_gen, "pcie_width", d.pcie_width,
      "pcie_max_gen", d.pcie_max_gen, "pcie_max_width", d.pcie_max_width, "numa_node", d.numa_node,
      "async_engines", d.async_engines, "can_map_host_memory",
      d.can_map_host_memory ? Py_True : Py_False, "unified_addressing",
      d.unified_addressing ? Py_True : Py_False, "managed_memory",
      d.managed_memory ? Py_True : Py_False, "concurrent_managed_access",
      d.concurrent_managed_access ? Py_True : Py_False, "host_register_supported",
      d.host_register_supported ? Py_True : Py_False, "host_register_read_only",
      d.host_register_read_only ? Py_True : Py_False);
}

/* The calling thread's current device, as CUDA's (torch.cuda.set_device sets the same). */
static PyObject *py_set_device(PyObject *mod, PyObject *args) {
  int dev = 0;
  if (!PyArg_ParseTuple(args, "i:set_device", &dev)) return NULL;
  pm_status_t st = pm_device_set(dev);
  if (st != PM_OK) return pmpy_raise_status(st);
  Py_RETURN_NONE;
}

static PyObject *py_current_device(PyObject *mod, PyObject *unused) {
  int dev = 0;
  pm_status_t st = pm_device_get(&dev);
  if (st != PM_OK) return pmpy_raise_status(st);
  return PyLong_FromLong(dev);
}

static PyObject *py_synchronize(PyObject *mod, PyObject *unused) {
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS st = pm_device_synchronize();
  Py_END_ALLOW_THREADS if (st != PM_OK) return pmpy_raise_status(st);
  pmpy_pending_sweep(0);
  Py_RETURN_NONE;
}

static PyObject *py_status_name(PyObject *mod, PyObject *arg) {
  long v = PyLong_AsLong(arg);
  if (v == -1 && PyErr_Occurred()) return NULL;
  return PyUnicode_FromString(pm_status_name((pm_status_t)v));
}

static PyObject *py_raise_status(PyObject *mod, PyObject *args) {
  int st;
  const char *detail = "";
  if (!PyArg_ParseTuple(args, "i|s:_raise", &st, &detail)) return NULL;
  return pmpy_raise_detail((pm_status_t)st, detail);
}

/* The sorted CPU ids a loader worker process for `device` runs on, or None (nothing to do:
 * numa_threads=0, numa=off, one node, device -1, no node or no allowed CPU on it). */
static PyObject *py_numa_worker_cpus(PyObject *mod, PyObject *arg) {
  long device = PyLong_AsLong(arg);
  if (device == -1 && PyErr_Occurred()) return NULL;
  if (device < -1 || device > INT_MAX) Py_RETURN_NONE; /* no such device: no node */
  pm__cpus_t cpus;
  int have;
  /* May read sysfs and ask the backend for the device's PCI location. */
  Py_BEGIN_ALLOW_THREADS;
  have = pm__numa_cpus_for((int)device, &cpus);
  Py_END_ALLOW_THREADS;
  if (!have) Py_RETURN_NONE;
  PyObject *list = PyList_New(0);
  if (!list) return NULL;
  for (int c = 0; c < PM__CPUS_MAX; c++) {
    if (!pm__cpus_has(&cpus, c)) continue;
    PyObject *v = PyLong_FromLong(c);
    if (!v || PyList_Append(list, v) < 0) {
      Py_XDECREF(v);
      Py_DECREF(list);
      return NULL;
    }
    Py_DECREF(v);
  }
  return list;
}

/* Test hook: the NUMA topology read under `root` (a fake sysfs tree), device k at bus_ids[k];
 * root None: back to the real machine. */
static PyObject *py_numa_test_override(PyObject *mod, PyObject *args) {
  PyObject *root_obj, *ids_obj = Py_None;
  if (!PyArg_ParseTuple(args, "O|O:_numa_test_override", &root_obj, &ids_obj)) return NULL;
  if (root_obj == Py_None) {
    pm__numa_test_override(NULL, NULL, 0);
    Py_RETURN_NONE;
  }
  PyObject *root_bytes = NULL, *seq = NULL;
  const char *ids[PM__NUMA_MAX_DEVICES];
  if (!PyUnicode_FSConverter(root_obj, &root_bytes)) return NULL;
  Py_ssize_t n = 0;
  if (ids_obj != Py_None) {
    seq = pmpy_fast_tuple(ids_obj, "_numa_test_override: bus_ids must be a sequence of str");
    if (!seq) goto fail;
    n = PySequence_Fast_GET_SIZE(seq);
    if (n > PM__NUMA_MAX_DEVICES) {
      pmpy_raise_fmt(PM_ERR_INVALID, "_numa_test_override: at most %d bus ids",
                     PM__NUMA_MAX_DEVICES);
      goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
      ids[i] = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i));
      if (!ids[i]) goto fail;
    }
  }
  pm__numa_test_override(PyBytes_AS_STRING(root_bytes), ids, (int)n);
  Py_XDECREF(seq);
  Py_DECREF(root_bytes);
  Py_RETURN_NONE;
fail:
  Py_XDECREF(seq);
  Py_DECREF(root_bytes);
  return NULL;
}

PyMethodDef pmpy_pool_functions[] = {
    {"stats", py_stats, METH_NOARGS, "stats() -> dict: the default pool's statistics"},
    {"budget", py_budget, METH_NOARGS, "budget() -> int: the default pool's budget in bytes"},
    {"set_budget", py_set_budget, METH_O, "set_budget(size): change the default pool's budget"},
    {"trim", py_trim, METH_NOARGS, "trim() -> int: give cached pinned memory back; bytes released"},
    {"reserve", py_reserve, METH_O, "reserve(size): pin size bytes now, cached for later use"},
    {"reset_peak", py_reset_peak, METH_NOARGS, "reset_peak(): restart stats()['pinned_peak']"},
    {"options", py_options, METH_NOARGS,
     "options() -> {name: {value, default, env, source, doc}}: the option table in force"},
    {"get_option", py_get_option, METH_O, "get_option(name) -> str: the value in force"},
    {"set_option", py_set_option, METH_VARARGS,
     "set_option(name, value): set an option (wins over the environment); value None drops "
     "what set_option set (the environment's value or the default is in force again)"},
    {"parse_size", py_parse_size, METH_O, "parse_size('1.5M') -> 1572864"},
    {"pointer_info", py_pointer_info, METH_O,
     "pointer_info(addr_or_buffer) -> dict: what pinmem knows of the address"},
    {"init", py_init, METH_NOARGS, "init() -> backend name: start the library now"},
    {"backend", py_backend, METH_NOARGS, "backend() -> 'cuda' or 'host'"},
    {"backend_info", py_backend_info, METH_NOARGS,
     "backend_info() -> dict: backend ('cuda', 'host' or 'none'), requested ('auto', 'cuda' or "
     "'host'), fallback (auto fell back to host: device memory is refused), reason (why), "
     "driver_version ((major, minor) or None), devices, cuda_compiled, driver_library, "
     "driver_missing (optional driver calls it lacks), kernels (why pinmem's kernels are "
     "unavailable or limited; '' when fine)"},
    {"device_count", py_device_count, METH_NOARGS, "device_count() -> int"},
    {"device_info", py_device_info, METH_VARARGS, "device_info(device=0) -> dict"},
    {"synchronize", py_synchronize, METH_NOARGS, "synchronize(): wait for the current device"},
    {"set_device", py_set_device, METH_VARARGS,
     "set_device(index): make the device current on the calling thread"},
    {"current_device", py_current_device, METH_NOARGS,
     "current_device() -> the calling thread's current device"},
    {"_numa_worker_cpus", py_numa_worker_cpus, METH_O,
     "_numa_worker_cpus(device) -> sorted CPU ids for a loader worker process, or None"},
    {"_numa_test_override", py_numa_test_override, METH_VARARGS,
     "_numa_test_override(root, bus_ids): read NUMA topology under root (None: the real one)"},
    {"_host_mismatches", py_host_mismatches, METH_VARARGS,
     "_host_mismatches(reset=False) -> (count, last): the host backend's calls that broke "
     "CUDA's multi-device rules (tests)"},
    {"_bound_device", py_bound_device, METH_NOARGS,
     "_bound_device() -> the calling thread's device, or -1 where it has none yet"},
    {"_put_back_device", py_put_back_device, METH_O,
     "_put_back_device(device): device made current, or none for -1 (_bound_device's)"},
    {"_memory_device", py_memory_device, METH_O,
     "_memory_device(addr) -> the device whose memory addr is, or -1"},
    {"_status_name", py_status_name, METH_O, NULL},
    {"_raise", py_raise_status, METH_VARARGS, NULL},
    {0}};
