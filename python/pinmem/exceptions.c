/*
 * DESIGN: pinmem's exceptions. pinmem.Error, and below it one class per error status
 * (PM_ERR_DOUBLE_FREE -> DoubleFreeError), made at import from the same X-macro as the C status
 * map, so the two cannot drift; a built-in second base where one means the same (ValueError,
 * MemoryError, TimeoutError). Also the status codes as module constants, and the raise helpers
 * every file uses: str(e) carries the status name, its fixed message and the detail.
 */
#include "_pinmem.h"

#define PMPY_NSTATUS 32
static PyObject *g_error;                  /* pinmem.Error */
static PyObject *g_status_exc[PMPY_NSTATUS]; /* indexed by -status, for the errors */

static PyObject *exc_for(pm_status_t st) {
  if (st < 0 && -st < PMPY_NSTATUS && g_status_exc[-st]) return g_status_exc[-st];
  return g_error;
}

/* Raise the exception of `st` with `detail`: str(e) is "PM_ERR_X: <fixed message>: <detail>";
 * e.status is the name, e.code the number, e.message the detail. Returns NULL. */
PyObject *pmpy_raise_detail(pm_status_t st, const char *detail) {
  PyObject *cls = exc_for(st);
  PyObject *text = PyUnicode_FromFormat("%s: %s%s%s", pm_status_name(st), pm_strerror(st),
                                        detail && *detail ? ": " : "", detail ? detail : "");
  if (!text) return NULL;
  PyObject *exc = PyObject_CallOneArg(cls, text);
  Py_DECREF(text);
  if (!exc) return NULL;
  PyObject *name = PyUnicode_FromString(pm_status_name(st));
  PyObject *code = PyLong_FromLong((long)st);
  PyObject *msg = PyUnicode_FromString(detail ? detail : "");
  int bad = !name || !code || !msg || PyObject_SetAttrString(exc, "status", name) < 0 ||
            PyObject_SetAttrString(exc, "code", code) < 0 ||
            PyObject_SetAttrString(exc, "message", msg) < 0;
  Py_XDECREF(name);
  Py_XDECREF(code);
  Py_XDECREF(msg);
  if (bad) {
    Py_DECREF(exc);
    return NULL;
  }
  PyErr_SetObject(cls, exc);
  Py_DECREF(exc);
  return NULL;
}

/* After a failed pinmem call on this thread: pm_last_error() holds the detail. */
PyObject *pmpy_raise_status(pm_status_t st) { return pmpy_raise_detail(st, pm_last_error()); }

/* A pinmem-style error found by this module itself. */
PyObject *pmpy_raise_fmt(pm_status_t st, const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  PyOS_vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return pmpy_raise_detail(st, buf);
}

/* "PM_ERR_DOUBLE_FREE" -> "DoubleFreeError". */
static void exc_class_name(const char *status_name, char *out, size_t len) {
  const char *p = status_name + strlen("PM_ERR_");
  size_t n = 0;
  int up = 1;
  for (; *p && n + 6 < len; p++) {
    if (*p == '_') {
      up = 1;
      continue;
    }
    out[n++] = up ? *p : (char)(*p - 'A' + 'a');
    up = 0;
  }
  memcpy(out + n, "Error", 6);
}

int pmpy_init_exceptions(PyObject *m) {
  g_error = PyErr_NewExceptionWithDoc(
      "pinmem.Error",
      "Base of every pinmem error. Attributes: status (the status name, e.g. 'PM_ERR_BUDGET'), "
      "code (its number) and message (the detail: the failing call, the limit, the values).",
      NULL, NULL);
  if (!g_error || PyModule_AddObjectRef(m, "Error", g_error) < 0) return -1;
  static const struct {
    pm_status_t st;
  } all[] = {
#define PMPY_ST(name, value, msg) {name},
      PM_STATUS_MAP(PMPY_ST)
#undef PMPY_ST
  };
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
    pm_status_t st = all[i].st;
    if (st >= 0 || -st >= PMPY_NSTATUS) continue;
    char cls[64], qual[96], doc[160];
    exc_class_name(pm_status_name(st), cls, sizeof cls);
    snprintf(qual, sizeof qual, "pinmem.%s", cls);
    snprintf(doc, sizeof doc, "%s: %s.", pm_status_name(st), pm_strerror(st));
    /* A second, built-in base where one means the same, so `except ValueError` works too. */
    PyObject *extra = NULL;
    if (st == PM_ERR_INVALID || st == PM_ERR_CONFIG) extra = PyExc_ValueError;
    if (st == PM_ERR_NOMEM || st == PM_ERR_DEVICE_MEMORY) extra = PyExc_MemoryError;
    if (st == PM_ERR_TIMEOUT) extra = PyExc_TimeoutError;
    PyObject *bases = extra ? PyTuple_Pack(2, g_error, extra) : PyTuple_Pack(1, g_error);
    if (!bases) return -1;
    PyObject *e = PyErr_NewExceptionWithDoc(qual, doc, bases, NULL);
    Py_DECREF(bases);
    if (!e) return -1;
    g_status_exc[-st] = e;
    if (PyModule_AddObjectRef(m, cls, e) < 0) return -1;
  }
  /* The status codes as module constants (PM_OK, PM_ERR_STATE, ...), from the same X-macro as
   * the C status map, so Python code names a status instead of writing its number. */
#define PMPY_ST_CONST(name, value, msg) \
  if (PyModule_AddIntConstant(m, #name, (long)(value)) < 0) return -1;
  PM_STATUS_MAP(PMPY_ST_CONST)
#undef PMPY_ST_CONST
  return 0;
}
