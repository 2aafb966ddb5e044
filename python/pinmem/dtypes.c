/*
 * DESIGN: the element types pinmem's buffers describe: the fixed-size numbers that NumPy, the
 * buffer protocol and DLPack all name, one row each (NumPy's name, struct format, kind letter,
 * DLPack code and bits). Every way a dtype arrives (a struct format from a buffer exporter, a
 * NumPy, torch or array-interface name, a DLPack type) ends at a row of the table, or at NULL
 * for a type without one.
 */
#include "_pinmem.h"

/* kDLBool entered DLPack in 0.8; the value is fixed by the standard, so bool arrays round-trip
 * with consumers that know it even when built against the 0.6 header. */
#define PMPY_DL_BOOL 6
/* Types NumPy lacks, by their DLPack codes (fixed by the standard; 0.6 headers lack the float8
 * names). Kind 'V': no NumPy or struct type, so the buffer protocol refuses them by format (see
 * buffers.c) and they travel by DLPack, bits intact. The format is the unsigned integer of the
 * same size, for raw views only. */
#define PMPY_DL_BFLOAT 4
#define PMPY_DL_COMPLEX 5
#define PMPY_DL_F8_E4M3FN 10
#define PMPY_DL_F8_E4M3FNUZ 11
#define PMPY_DL_F8_E5M2 12
#define PMPY_DL_F8_E5M2FNUZ 13
#define PMPY_DL_F8_E8M0FNU 14

static const pmpy_dtype_t g_dtypes[] = {
    {"bool", "?", 'b', PMPY_DL_BOOL, 8},  {"int8", "b", 'i', kDLInt, 8},
    {"uint8", "B", 'u', kDLUInt, 8},      {"int16", "h", 'i', kDLInt, 16},
    {"uint16", "H", 'u', kDLUInt, 16},    {"int32", "i", 'i', kDLInt, 32},
    {"uint32", "I", 'u', kDLUInt, 32},    {"int64", "q", 'i', kDLInt, 64},
    {"uint64", "Q", 'u', kDLUInt, 64},    {"float16", "e", 'f', kDLFloat, 16},
    {"float32", "f", 'f', kDLFloat, 32},  {"float64", "d", 'f', kDLFloat, 64},
    {"complex64", "Zf", 'c', kDLComplex, 64}, {"complex128", "Zd", 'c', kDLComplex, 128},
    {"bfloat16", "H", 'V', PMPY_DL_BFLOAT, 16},
    {"complex32", "I", 'V', PMPY_DL_COMPLEX, 32},
    {"float8_e4m3fn", "B", 'V', PMPY_DL_F8_E4M3FN, 8},
    {"float8_e4m3fnuz", "B", 'V', PMPY_DL_F8_E4M3FNUZ, 8},
    {"float8_e5m2", "B", 'V', PMPY_DL_F8_E5M2, 8},
    {"float8_e5m2fnuz", "B", 'V', PMPY_DL_F8_E5M2FNUZ, 8},
    {"float8_e8m0fnu", "B", 'V', PMPY_DL_F8_E8M0FNU, 8},
};
#define PMPY_NDTYPES (sizeof g_dtypes / sizeof g_dtypes[0])

static const pmpy_dtype_t *dtype_by_kind(char kind, unsigned bytes) {
  for (size_t i = 0; i < PMPY_NDTYPES; i++)
    if (g_dtypes[i].kind == kind && g_dtypes[i].bits == bytes * 8) return &g_dtypes[i];
  return NULL;
}

const pmpy_dtype_t *pmpy_dtype_by_dl(DLDataType t) {
  if (t.lanes != 1) return NULL;
  for (size_t i = 0; i < PMPY_NDTYPES; i++)
    if (g_dtypes[i].code == t.code && g_dtypes[i].bits == t.bits) return &g_dtypes[i];
  return NULL;
}

static int little_endian(void) {
  const uint16_t one = 1;
  return *(const uint8_t *)&one == 1;
}

/* A struct format as a buffer exporter gives it ("f", "<d", "Zf", "=q") -> dtype, or NULL. */
const pmpy_dtype_t *pmpy_dtype_from_format(const char *f, Py_ssize_t itemsize) {
  if (!f) f = "B";
  if (*f == '@' || *f == '=' || (*f == '<' && little_endian()) || (*f == '>' && !little_endian()) ||
      (*f == '!' && !little_endian()))
    f++;
  int cplx = 0;
  if (*f == 'Z') {
    cplx = 1;
    f++;
  }
  if (!*f || f[1]) return NULL;
  char kind;
  unsigned bytes;
  switch (*f) {
    case '?': kind = 'b'; bytes = 1; break;
    case 'b': kind = 'i'; bytes = 1; break;
    case 'B': kind = 'u'; bytes = 1; break;
    case 'h': kind = 'i'; bytes = sizeof(short); break;
    case 'H': kind = 'u'; bytes = sizeof(short); break;
    case 'i': kind = 'i'; bytes = sizeof(int); break;
    case 'I': kind = 'u'; bytes = sizeof(int); break;
    case 'l': kind = 'i'; bytes = sizeof(long); break;
    case 'L': kind = 'u'; bytes = sizeof(long); break;
    case 'q': kind = 'i'; bytes = sizeof(long long); break;
    case 'Q': kind = 'u'; bytes = sizeof(long long); break;
    case 'n': kind = 'i'; bytes = sizeof(Py_ssize_t); break;
    case 'N': kind = 'u'; bytes = sizeof(size_t); break;
    case 'e': kind = 'f'; bytes = 2; break;
    case 'f': kind = 'f'; bytes = 4; break;
    case 'd': kind = 'f'; bytes = 8; break;
    default: return NULL;
  }
  if (cplx) {
    if (kind != 'f' || bytes < 4) return NULL;
    kind = 'c';
    bytes *= 2;
  }
  const pmpy_dtype_t *d = dtype_by_kind(kind, bytes);
  if (d && itemsize > 0 && (Py_ssize_t)(d->bits / 8) != itemsize) return NULL;
  return d;
}

/* A dtype given as text: a NumPy name ("float32"), a torch name ("torch.float32"), an array
 * interface type string ("<f4", "|u1", "f4") or a one-letter struct code ("f"). */
const pmpy_dtype_t *pmpy_dtype_from_text(const char *s) {
  static const struct {
    const char *alias, *name;
  } aliases[] = {{"bool_", "bool"},       {"half", "float16"},      {"single", "float32"},
                 {"double", "float64"},   {"float", "float64"},     {"int", "int64"},
                 {"long", "int64"},       {"short", "int16"},       {"byte", "int8"},
                 {"ubyte", "uint8"},      {"csingle", "complex64"}, {"cdouble", "complex128"},
                 {"complex", "complex128"}, {"chalf", "complex32"}};
  /* torch's short names mean other types than NumPy's: torch.float is float32 and torch.int
   * int32, where NumPy's float and int are 64-bit. */
  static const struct {
    const char *alias, *name;
  } torch_aliases[] = {{"float", "float32"},    {"double", "float64"},     {"half", "float16"},
                       {"int", "int32"},        {"long", "int64"},         {"short", "int16"},
                       {"cfloat", "complex64"}, {"cdouble", "complex128"}, {"chalf", "complex32"}};
  if (!strncmp(s, "torch.", 6)) {
    /* str(torch.float32) and the other attributes of torch that name a dtype; nothing else
     * (NumPy's aliases and type strings are not torch's). */
    s += 6;
    for (size_t i = 0; i < PMPY_NDTYPES; i++)
      if (!strcmp(s, g_dtypes[i].name)) return &g_dtypes[i];
    for (size_t i = 0; i < sizeof torch_aliases / sizeof torch_aliases[0]; i++)
      if (!strcmp(s, torch_aliases[i].alias)) return pmpy_dtype_from_text(torch_aliases[i].name);
    return NULL;
  }
  for (size_t i = 0; i < PMPY_NDTYPES; i++)
    if (!strcmp(s, g_dtypes[i].name)) return &g_dtypes[i];
  for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++)
    if (!strcmp(s, aliases[i].alias)) return pmpy_dtype_from_text(aliases[i].name);
  /* Array interface type strings. */
  const char *p = s;
  int swapped = 0;
  if (*p == '<' || *p == '>' || *p == '=' || *p == '|') {
    swapped = (*p == '<' && !little_endian()) || (*p == '>' && little_endian());
    p++;
  }
  if (*p && strchr("biufc", *p) && p[1] >= '1' && p[1] <= '9') {
    char *end;
    long bytes = strtol(p + 1, &end, 10);
    if (*end || bytes <= 0 || bytes > 16) return NULL;
    if (swapped && bytes > 1) return NULL;
    return dtype_by_kind(*p, (unsigned)bytes);
  }
  return NULL;
}

const pmpy_dtype_t *pmpy_parse_dtype(PyObject *o) {
  if (!PyUnicode_Check(o)) {
    PyErr_Format(PyExc_TypeError, "dtype must be a string here, not %.100s", Py_TYPE(o)->tp_name);
    return NULL;
  }
  const char *s = PyUnicode_AsUTF8(o);
  if (!s) return NULL;
  const pmpy_dtype_t *d = pmpy_dtype_from_text(s);
  if (!d && strlen(s) == 1) d = pmpy_dtype_from_format(s, 0); /* a one-letter struct code */
  if (!d) {
    pmpy_raise_fmt(
        PM_ERR_INVALID,
        "unsupported dtype '%.60s' (supported: bool, int8..int64, uint8..uint64, float16, "
        "float32, float64, complex64, complex128, and for DLPack only: bfloat16, complex32, "
        "float8_e4m3fn, float8_e4m3fnuz, float8_e5m2, float8_e5m2fnuz, float8_e8m0fnu)",
        s);
    return NULL;
  }
  return d;
}
