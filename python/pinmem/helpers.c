/*
 * DESIGN: small parsers and checks the other files share: a size (an int or "64M"), an address
 * (an int of another library: data_ptr(), stream handles), an overflow-checked product, whether
 * a struct format or a buffer holds Python object pointers (never copied or pinned as bytes),
 * and the state of the backend and of the interpreter.
 */
#include "_pinmem.h"

int pmpy_interp_finalizing(void) {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

int pmpy_is_cuda_backend(void) { return pm_backend_kind() == PM_BACKEND_CUDA; }

/* 1 if the int o is negative, 0 if not, -1 on error. */
static int long_negative(PyObject *o) {
  PyObject *zero = PyLong_FromLong(0);
  if (!zero) return -1;
  int r = PyObject_RichCompareBool(o, zero, Py_LT);
  Py_DECREF(zero);
  return r;
}

/* A size: an int, or a string such as "64K", "1.5M", "2G" (pm_parse_size). */
int pmpy_parse_size_obj(PyObject *o, size_t *out) {
  if (PyUnicode_Check(o)) {
    const char *s = PyUnicode_AsUTF8(o);
    if (!s) return -1;
    pm_status_t st = pm_parse_size(s, out);
    if (st != PM_OK) {
      pmpy_raise_status(st);
      return -1;
    }
    return 0;
  }
  /* Any integer that says it is one (__index__: NumPy's and torch's integer scalars, sizes
   * computed with NumPy), as offsets and shapes take; bool is not a size. */
  PyObject *idx = NULL;
  if (!PyLong_Check(o) && !PyBool_Check(o) && PyIndex_Check(o)) {
    idx = PyNumber_Index(o);
    if (!idx) return -1;
    int r = pmpy_parse_size_obj(idx, out);
    Py_DECREF(idx);
    return r;
  }
  if (PyLong_Check(o) && !PyBool_Check(o)) {
    int neg = long_negative(o);
    if (neg) {
      if (neg > 0) pmpy_raise_fmt(PM_ERR_INVALID, "a size cannot be negative");
      return -1;
    }
    size_t v = PyLong_AsSize_t(o);
    if (v == (size_t)-1 && PyErr_Occurred()) {
      if (PyErr_ExceptionMatches(PyExc_OverflowError)) { /* as a negative size: pinmem's words */
        PyErr_Clear();
        pmpy_raise_fmt(PM_ERR_INVALID, "a size must be below 2**64");
      }
      return -1;
    }
    *out = v;
    return 0;
  }
  PyErr_Format(PyExc_TypeError, "a size must be an integer or a string like '64M', not %.100s",
               Py_TYPE(o)->tp_name);
  return -1;
}

/* *n *= factor, refused (PM_ERR_INVALID) when the product does not fit in memory's sizes. */
int pmpy_checked_mul(size_t *n, size_t factor) {
  if (factor && *n > (size_t)PY_SSIZE_T_MAX / factor) {
    pmpy_raise_fmt(PM_ERR_INVALID, "the shape is too large for memory (its byte count overflows)");
    return -1;
  }
  *n *= factor;
  return 0;
}

/* Does a struct format hold Python object pointers ('O', also as a field of a record)? Their
 * bytes are references: copied or pinned as plain bytes they would be freed twice. Field names
 * (between colons) are skipped. */
int pmpy_format_has_objects(const char *f) {
  for (int in_name = 0; f && *f; f++) {
    if (*f == ':') in_name = !in_name;
    else if (!in_name && *f == 'O') return 1;
  }
  return 0;
}

/* Does `o` export Python object pointers through the buffer protocol? (A request with the
 * format; exporters that cannot describe theirs, e.g. NumPy's datetime64, hold none.) */
int pmpy_buffer_holds_objects(PyObject *o) {
  Py_buffer v;
  if (PyObject_GetBuffer(o, &v, PyBUF_RECORDS_RO) < 0) {
    PyErr_Clear();
    return 0;
  }
  int r = pmpy_format_has_objects(v.format);
  PyBuffer_Release(&v);
  return r;
}

/* An address given as an int (pointers of other libraries: data_ptr(), stream handles). */
int pmpy_parse_address(PyObject *o, uintptr_t *out) {
  if (!PyLong_Check(o)) {
    PyErr_Format(PyExc_TypeError, "expected an int address, not %.100s", Py_TYPE(o)->tp_name);
    return -1;
  }
  int neg = long_negative(o);
  if (neg < 0) return -1;
  if (neg) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = (uintptr_t)(intptr_t)v;
    return 0;
  }
  unsigned long long v = PyLong_AsUnsignedLongLong(o);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) {
    if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
      PyErr_Clear();
      pmpy_raise_fmt(PM_ERR_INVALID, "an address (or handle) must be below 2**64");
    }
    return -1;
  }
  *out = (uintptr_t)v;
  return 0;
}
