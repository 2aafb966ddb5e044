/*
 * DESIGN: .npy files as a dataset: samples along axis 0, several files one after another.
 *
 * The format: "\x93NUMPY", a major and a minor version byte, the header length (uint16 little
 * endian for 1.0, uint32 for 2.0 and 3.0), then the header: the repr() of a Python dict with
 * exactly the keys 'descr', 'fortran_order' and 'shape' (latin-1 text, UTF-8 for 3.0), padded
 * with spaces and a newline; the array's bytes follow. The header is parsed here with a small
 * recursive-descent parser for the Python literals numpy writes (strings, integers with an
 * optional L, True/False, tuples, lists, dicts); nothing is evaluated.
 *
 * descr: a type string ("<f4", "|u1", ">i8", "|S10", "<U5", "|V16", "<M8[ns]", "|O") or, for
 * structured types, a list of (name, type[, shape]) tuples where type may be a list again.
 * Every fixed-size type is accepted (samples are moved as bytes); object types ('O'), anywhere,
 * are refused: their bytes are pointers of the process that wrote them. A structured type's
 * size is the sum of its fields (numpy writes padding as unnamed void fields).
 *
 * Everything is checked at open, before the first batch: magic, version, header length and
 * syntax, the three keys, Fortran order (refused when more than one dimension makes it differ
 * from C order), shape products that overflow 64 bits, zero-size samples, data shorter than the
 * shape (bytes after it are ignored, as numpy does), files whose sample shape or dtype differ,
 * and the dtype the caller asked for. A sample is then one pm__file_read at
 * data_offset + i * sample_bytes.
 *
 * No locks: the dataset is immutable after open (see dataset.c).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static const unsigned char npy_magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};

/* ---- preamble ----------------------------------------------------------------------------- */

pm_status_t pm__npy_preamble(const unsigned char *buf, size_t len, size_t *total_out) {
  if (len < 10 || memcmp(buf, npy_magic, sizeof npy_magic) != 0) {
    if (len >= 6 && memcmp(buf, npy_magic, sizeof npy_magic) != 0)
      return pm__set_error(PM_ERR_FORMAT,
                           "not a .npy file (bad magic: the file does not start "
                           "with \\x93NUMPY)");
    return pm__set_error(PM_ERR_FORMAT, "truncated .npy preamble (%zu bytes, need 10)", len);
  }
  int major = buf[6], minor = buf[7];
  size_t hlen, total;
  if (major == 1) {
    hlen = (size_t)buf[8] | (size_t)buf[9] << 8;
    total = 10 + hlen;
  } else if (major == 2 || major == 3) {
    if (len < 12)
      return pm__set_error(PM_ERR_FORMAT, "truncated .npy %d.%d preamble (%zu bytes, need 12)",
                           major, minor, len);
    hlen = (size_t)buf[8] | (size_t)buf[9] << 8 | (size_t)buf[10] << 16 | (size_t)buf[11] << 24;
    if (hlen > PM__NPY_HEADER_MAX)
      return pm__set_error(PM_ERR_FORMAT, ".npy header of %zu bytes is above the %u byte limit",
                           hlen, PM__NPY_HEADER_MAX);
    total = 12 + hlen;
  } else {
    return pm__set_error(PM_ERR_FORMAT,
                         "unsupported .npy format version %d.%d (known: 1.0, 2.0, "
                         "3.0)",
                         major, minor);
  }
  if (minor != 0)
    return pm__set_error(PM_ERR_FORMAT,
                         "unsupported .npy format version %d.%d (known: 1.0, 2.0, "
                         "3.0)",
                         major, minor);
  *total_out = total;
  return PM_OK;
}

/* ---- a parser for the Python literals of the header --------------------------------------- */

typedef struct lex {
  const char *p, *end;
  char why[200]; /* first error */
} lex_t;

PM__PRINTF(2, 3) static bool lfail(lex_t *l, const char *fmt, ...) {
  if (!l->why[0]) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(l->why, sizeof l->why, fmt, ap);
    va_end(ap);
  }
  return false;
}

/* The next few characters of the input for a message (the header is not NUL-terminated). */
typedef struct snip {
  char s[16];
} snip_t;

static snip_t at(const lex_t *l) {
  snip_t r;
  size_t n = l->p < l->end ? (size_t)(l->end - l->p) : 0;
  if (n > 12) n = 12;
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)l->p[i];
    r.s[i] = c >= 0x20 && c < 0x7f ? (char)c : '?';
  }
  r.s[n] = '\0';
  return r;
}

static void skip_ws(lex_t *l) {
  while (l->p < l->end && (*l->p == ' ' || *l->p == '\t' || *l->p == '\n' || *l->p == '\r')) l->p++;
}

static bool peek(lex_t *l, char c) {
  skip_ws(l);
  return l->p < l->end && *l->p == c;
}

static bool expect(lex_t *l, char c) {
  skip_ws(l);
  if (l->p < l->end && *l->p == c) {
    l->p++;
    return true;
  }
  if (l->p >= l->end) return lfail(l, "header ends where '%c' was expected", c);
  return lfail(l, "'%c' expected at '%s'", c, at(l).s);
}

/* A quoted string (optional u/b prefix) into out (truncated to out_len - 1). */
static bool parse_string(lex_t *l, char *out, size_t out_len) {
  skip_ws(l);
  if (l->p < l->end && (*l->p == 'u' || *l->p == 'b') && l->p + 1 < l->end &&
      (l->p[1] == '\'' || l->p[1] == '"'))
    l->p++;
  if (l->p >= l->end || (*l->p != '\'' && *l->p != '"'))
    return lfail(l, "string expected at '%s'", at(l).s);
  char q = *l->p++;
  size_t n = 0;
  while (l->p < l->end && *l->p != q) {
    char c = *l->p++;
    if (c == '\\') {
      if (l->p >= l->end) break;
      c = *l->p++;
    }
    if (n + 1 < out_len) out[n++] = c;
  }
  if (l->p >= l->end) return lfail(l, "unterminated string");
  l->p++;
  if (out_len) out[n] = '\0';
  return true;
}

static bool parse_uint(lex_t *l, uint64_t *v) {
  skip_ws(l);
  if (l->p < l->end && *l->p == '-') return lfail(l, "negative number in the header");
  if (l->p >= l->end || *l->p < '0' || *l->p > '9')
    return lfail(l, "number expected at '%s'", at(l).s);
  uint64_t x = 0;
  while (l->p < l->end && *l->p >= '0' && *l->p <= '9') {
    unsigned d = (unsigned)(*l->p - '0');
    if (x > (UINT64_MAX - d) / 10) return lfail(l, "number in the header overflows 64 bits");
    x = x * 10 + d;
    l->p++;
  }
  if (l->p < l->end && (*l->p == 'L' || *l->p == 'l')) l->p++; /* Python 2 longs */
  *v = x;
  return true;
}

static bool parse_word(lex_t *l, const char *w) {
  skip_ws(l);
  size_t n = strlen(w);
  if ((size_t)(l->end - l->p) >= n && memcmp(l->p, w, n) == 0) {
    l->p += n;
    return true;
  }
  return false;
}

/* A tuple of integers "(3, 224, 224)", "(5,)", "()"; a bare integer counts as a 1-tuple
 * (numpy accepts that in sub-array shapes). */
static bool parse_shape(lex_t *l, uint64_t *dims, int max, int *ndim) {
  *ndim = 0;
  if (!peek(l, '(')) {
    uint64_t v;
    if (!parse_uint(l, &v)) return false;
    dims[0] = v;
    *ndim = 1;
    return true;
  }
  expect(l, '(');
  while (!peek(l, ')')) {
    uint64_t v;
    if (!parse_uint(l, &v)) return false;
    if (*ndim >= max) return lfail(l, "shape has more than %d dimensions", max);
    dims[(*ndim)++] = v;
    if (peek(l, ',')) {
      l->p++;
    } else if (!peek(l, ')')) {
      return lfail(l, "',' or ')' expected in a shape at '%s'", at(l).s);
    }
  }
  return expect(l, ')');
}

/* What a descr describes. */
typedef struct dt {
  size_t itemsize;
  pm_dtype_t code;
  char text[128]; /* normalised */
} dt_t;

static bool mul_ok(uint64_t a, uint64_t b, uint64_t *out) {
  if (a && b > UINT64_MAX / a) return false;
  *out = a * b;
  return true;
}

/* A type string such as "<f4". */
static bool parse_type_string(lex_t *l, const char *s, dt_t *d) {
  const char *t = s;
  char order = '\0';
  if (*t == '<' || *t == '>' || *t == '|' || *t == '=') order = *t++;
  if (order == '=') order = (__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__) ? '<' : '>';
  char kind = *t ? *t++ : '\0';
  if (kind == 'O')
    return lfail(l,
                 "object dtype '%s' is not supported (it holds Python pointers, "
                 "not data): save a fixed-size dtype",
                 s);
  uint64_t size = 0;
  bool have_size = false;
  while (*t >= '0' && *t <= '9') {
    unsigned dg = (unsigned)(*t - '0');
    if (size > (UINT64_MAX - dg) / 10) return lfail(l, "dtype '%s': size overflows", s);
    size = size * 10 + dg;
    t++;
    have_size = true;
  }
  bool datetime = (kind == 'M' || kind == 'm');
  if (datetime && *t == '[') {
    while (*t && *t != ']') t++;
    if (*t == ']') t++;
  }
  if (*t) return lfail(l, "unknown dtype '%s'", s);
  d->code = PM_DTYPE_OTHER;
  switch (kind) {
    case 'b':
      if (!have_size) size = 1;
      if (size != 1) return lfail(l, "unknown dtype '%s'", s);
      d->code = PM_DTYPE_BOOL;
      break;
    case 'i':
    case 'u': {
      if (size != 1 && size != 2 && size != 4 && size != 8)
        return lfail(l, "unknown dtype '%s'", s);
      static const pm_dtype_t si[] = {PM_DTYPE_INT8, PM_DTYPE_INT16, PM_DTYPE_INT32,
                                      PM_DTYPE_INT64};
      static const pm_dtype_t su[] = {PM_DTYPE_UINT8, PM_DTYPE_UINT16, PM_DTYPE_UINT32,
                                      PM_DTYPE_UINT64};
      int k = size == 1 ? 0 : size == 2 ? 1 : size == 4 ? 2 : 3;
      d->code = kind == 'i' ? si[k] : su[k];
      break;
    }
    case 'f':
      if (size == 2)
        d->code = PM_DTYPE_FLOAT16;
      else if (size == 4)
        d->code = PM_DTYPE_FLOAT32;
      else if (size == 8)
        d->code = PM_DTYPE_FLOAT64;
      else if (size != 12 && size != 16) /* long double */
        return lfail(l, "unknown dtype '%s'", s);
      break;
    case 'c':
      if (size == 8)
        d->code = PM_DTYPE_COMPLEX64;
      else if (size == 16)
        d->code = PM_DTYPE_COMPLEX128;
      else if (size != 24 && size != 32)
        return lfail(l, "unknown dtype '%s'", s);
      break;
    case 'S':
    case 'a':
    case 'V':
      if (!have_size) return lfail(l, "dtype '%s' has no size", s);
      break;
    case 'U':
      if (!have_size) return lfail(l, "dtype '%s' has no size", s);
      if (!mul_ok(size, 4, &size)) return lfail(l, "dtype '%s': size overflows", s);
      break;
    case 'M':
    case 'm':
      if (have_size && size != 8) return lfail(l, "unknown dtype '%s'", s);
      size = 8;
      break;
    default:
      return lfail(l, "unknown dtype '%s'", s);
  }
  if (size == 0) return lfail(l, "dtype '%s' has size 0", s);
  if (size > (uint64_t)SIZE_MAX / 2) return lfail(l, "dtype '%s': size too large", s);
  /* Byte order is meaningless for one-byte numbers and for bytes/void: '|' as numpy writes. */
  bool orderless = size == 1 || kind == 'S' || kind == 'a' || kind == 'V' || kind == 'b';
  if (orderless)
    order = '|';
  else if (!order || order == '|')
    order = (__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__) ? '<' : '>';
  if (order == ((__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__) ? '>' : '<') && size > 1)
    d->code = PM_DTYPE_OTHER; /* foreign byte order: bytes as they are */
  const char *body = s + (s[0] == '<' || s[0] == '>' || s[0] == '|' || s[0] == '=');
  if (kind == 'a')
    snprintf(d->text, sizeof d->text, "|S%llu", (unsigned long long)size);
  else if (kind == 'b' && !have_size)
    snprintf(d->text, sizeof d->text, "|b1");
  else
    snprintf(d->text, sizeof d->text, "%c%s", order, body);
  d->itemsize = (size_t)size;
  return true;
}

static bool parse_descr(lex_t *l, dt_t *d, int depth);

/* [(name, type[, shape]), ...] */
static bool parse_struct(lex_t *l, dt_t *d, int depth) {
  if (depth > 16) return lfail(l, "structured dtype nested too deeply");
  expect(l, '[');
  const char *src = l->p - 1;
  uint64_t total = 0;
  int fields = 0;
  while (!peek(l, ']')) {
    if (!expect(l, '(')) return false;
    char name[64];
    if (peek(l, '(')) { /* (title, name) */
      l->p++;
      if (!parse_string(l, name, sizeof name) || !expect(l, ',') ||
          !parse_string(l, name, sizeof name) || !expect(l, ')'))
        return false;
    } else if (!parse_string(l, name, sizeof name)) {
      return false;
    }
    if (!expect(l, ',')) return false;
    dt_t f;
    if (!parse_descr(l, &f, depth + 1)) return false;
    uint64_t n = f.itemsize;
    if (peek(l, ',')) {
      l->p++;
      if (!peek(l, ')')) {
        uint64_t dims[PM_DATASET_MAX_DIMS];
        int nd;
        if (!parse_shape(l, dims, PM_DATASET_MAX_DIMS, &nd)) return false;
        for (int i = 0; i < nd; i++)
          if (!mul_ok(n, dims[i], &n)) return lfail(l, "structured dtype size overflows");
      }
    }
    if (!expect(l, ')')) return false;
    if (total > UINT64_MAX - n) return lfail(l, "structured dtype size overflows");
    total += n;
    fields++;
    if (peek(l, ','))
      l->p++;
    else if (!peek(l, ']'))
      return lfail(l, "',' or ']' expected in a structured dtype at '%s'", at(l).s);
  }
  if (!expect(l, ']')) return false;
  if (fields == 0) return lfail(l, "structured dtype without fields");
  if (total == 0) return lfail(l, "structured dtype of size 0");
  if (total > (uint64_t)SIZE_MAX / 2) return lfail(l, "structured dtype too large");
  d->itemsize = (size_t)total;
  d->code = PM_DTYPE_OTHER;
  /* The source text without white space: files compare equal when their fields do. Whole or
   * not at all: a text cut short made two files of different fields compare equal, and gave
   * a descr nobody could parse. */
  size_t n = 0;
  for (const char *c = src; c < l->p; c++) {
    if (*c == ' ' || *c == '\n' || *c == '\t') continue;
    if (n + 1 >= sizeof d->text)
      return lfail(l,
                   "structured dtype of more than %zu characters (without spaces): not supported",
                   sizeof d->text - 1);
    d->text[n++] = *c;
  }
  d->text[n] = '\0';
  return true;
}

static bool parse_descr(lex_t *l, dt_t *d, int depth) {
  if (peek(l, '[')) return parse_struct(l, d, depth);
  char s[64];
  if (!parse_string(l, s, sizeof s)) return false;
  return parse_type_string(l, s, d);
}

pm_status_t pm__npy_parse(const unsigned char *buf, size_t len, pm__npy_header_t *out) {
  size_t total;
  pm_status_t st = pm__npy_preamble(buf, len, &total);
  if (st != PM_OK) return st;
  if (len < total)
    return pm__set_error(PM_ERR_FORMAT, "truncated .npy header (%zu of %zu bytes)", len, total);
  pm__npy_header_t h;
  memset(&h, 0, sizeof h);
  h.major = buf[6];
  h.minor = buf[7];
  h.data_offset = total;
  size_t start = h.major == 1 ? 10 : 12;

  lex_t l = {(const char *)buf + start, (const char *)buf + total, ""};
  bool have_descr = false, have_fo = false, have_shape = false;
  dt_t d;
  memset(&d, 0, sizeof d);
  bool ok = expect(&l, '{');
  while (ok && !peek(&l, '}')) {
    char key[32];
    if (!parse_string(&l, key, sizeof key) || !expect(&l, ':')) {
      ok = false;
      break;
    }
    if (!strcmp(key, "descr") && !have_descr) {
      ok = parse_descr(&l, &d, 0);
      have_descr = true;
    } else if (!strcmp(key, "fortran_order") && !have_fo) {
      if (parse_word(&l, "True"))
        h.fortran_order = true;
      else if (parse_word(&l, "False"))
        h.fortran_order = false;
      else
        ok = lfail(&l, "fortran_order is not True or False");
      have_fo = true;
    } else if (!strcmp(key, "shape") && !have_shape) {
      ok = peek(&l, '(') ? parse_shape(&l, h.shape, PM_DATASET_MAX_DIMS + 1, &h.ndim)
                         : lfail(&l, "shape is not a tuple");
      have_shape = true;
    } else {
      ok = lfail(&l, "unexpected or repeated key '%s' in the header", key);
    }
    if (ok && peek(&l, ','))
      l.p++;
    else if (ok && !peek(&l, '}'))
      ok = lfail(&l, "',' or '}' expected at '%s'", at(&l).s);
  }
  if (ok) ok = expect(&l, '}');
  if (ok) {
    skip_ws(&l);
    while (l.p < l.end && *l.p == '\0') l.p++; /* some writers pad with NULs */
    if (l.p != l.end) ok = lfail(&l, "text after the header dict: '%s'", at(&l).s);
  }
  if (ok && !(have_descr && have_fo && have_shape))
    ok = lfail(&l, "the header lacks the key '%s'",
               !have_descr ? "descr"
               : !have_fo  ? "fortran_order"
                           : "shape");
  if (!ok) return pm__set_error(PM_ERR_FORMAT, "bad .npy header: %s", l.why);

  if (h.ndim == 0)
    return pm__set_error(PM_ERR_FORMAT, "the array is 0-dimensional: it has no sample axis");
  if (h.fortran_order) {
    int big = 0;
    for (int i = 0; i < h.ndim; i++) big += h.shape[i] > 1;
    if (big > 1)
      return pm__set_error(PM_ERR_FORMAT,
                           "Fortran-order (column-major) arrays are not supported: save "
                           "np.ascontiguousarray(a) instead");
  }
  uint64_t sb = d.itemsize;
  for (int i = 1; i < h.ndim; i++)
    if (!mul_ok(sb, h.shape[i], &sb))
      return pm__set_error(PM_ERR_FORMAT, "the sample shape overflows 64 bits");
  if (sb == 0)
    return pm__set_error(PM_ERR_FORMAT, "samples have 0 bytes (a dimension of the shape is 0)");
  uint64_t data;
  if (!mul_ok(sb, h.shape[0], &data) || data > UINT64_MAX - total || sb > (uint64_t)SIZE_MAX / 2)
    return pm__set_error(PM_ERR_FORMAT, "the shape overflows 64 bits (%llu samples of %llu bytes)",
                         (unsigned long long)h.shape[0], (unsigned long long)sb);
  h.itemsize = d.itemsize;
  h.dtype = d.code;
  snprintf(h.descr, sizeof h.descr, "%s", d.text);
  h.count = h.shape[0];
  h.sample_bytes = (size_t)sb;
  h.data_bytes = data;
  *out = h;
  return PM_OK;
}

pm_status_t pm__npy_normalize_descr(const char *text, char *out, size_t out_len) {
  lex_t l = {text, text + strlen(text), ""};
  dt_t d;
  if (!parse_type_string(&l, text, &d))
    return pm__set_error(PM_ERR_INVALID, "dtype '%s': %s", text, l.why);
  snprintf(out, out_len, "%s", d.text);
  return PM_OK;
}

/* ---- the dataset ------------------------------------------------------------------------- */

typedef struct npy_impl {
  uint64_t *first;  /* first sample of each file, plus the total at [nfiles] */
  uint64_t *offset; /* data offset of each file */
  size_t sample_bytes;
} npy_impl_t;

static pm_status_t npy_read(pm_dataset_t *ds, uint64_t epoch, uint64_t index, void *dst, void *tdst,
                            pm__scratch_t *scratch) {
  (void)epoch;
  (void)tdst;
  const npy_impl_t *im = ds->impl;
  /* The file holding index: binary search over the prefix sums (usually one file). */
  int lo = 0, hi = ds->nfiles - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (im->first[mid] <= index)
      lo = mid;
    else
      hi = mid - 1;
  }
  uint64_t off = im->offset[lo] + (index - im->first[lo]) * im->sample_bytes;
  pm_status_t st = pm__file_read(&ds->files[lo], off, dst, im->sample_bytes, scratch);
  if (st != PM_OK) return pm__wrap_error(st, "sample %llu", (unsigned long long)index);
  return PM_OK;
}

static void npy_destroy(pm_dataset_t *ds) {
  npy_impl_t *im = ds->impl;
  if (!im) return;
  free(im->first);
  free(im->offset);
  free(im);
}

static void shape_text(const uint64_t *dims, int n, char *buf, size_t len) {
  size_t o = (size_t)snprintf(buf, len, "(");
  for (int i = 0; i < n && o < len; i++)
    o += (size_t)snprintf(buf + o, len - o, "%s%llu", i ? ", " : "", (unsigned long long)dims[i]);
  if (o < len) snprintf(buf + o, len - o, n == 1 ? ",)" : ")");
}

/* Read and check the header of one open file. */
static pm_status_t read_header(pm__file_t *f, pm__npy_header_t *h) {
  unsigned char pre[PM__NPY_PREAMBLE];
  size_t got = (size_t)PM__MIN(f->size, (uint64_t)sizeof pre);
  pm__scratch_t none = {NULL, 0};
  pm_status_t st;
  /* Headers are read with the buffered descriptor: they are small and unaligned. */
  int dfd = f->dfd;
  const unsigned char *map = f->map;
  f->dfd = -1;
  f->map = NULL;
  st = pm__file_read(f, 0, pre, got, &none);
  size_t total = 0;
  if (st == PM_OK) st = pm__npy_preamble(pre, got, &total);
  unsigned char *buf = NULL;
  if (st == PM_OK && f->size < total)
    st = pm__set_error(PM_ERR_FORMAT,
                       "truncated .npy header: the file has %llu bytes, the header "
                       "needs %zu",
                       (unsigned long long)f->size, total);
  if (st == PM_OK) {
    buf = malloc(total);
    if (!buf) st = pm__set_error(PM_ERR_NOMEM, "header buffer of %zu bytes", total);
  }
  if (st == PM_OK) st = pm__file_read(f, 0, buf, total, &none);
  if (st == PM_OK) st = pm__npy_parse(buf, total, h);
  free(buf);
  f->dfd = dfd;
  f->map = map;
  if (st != PM_OK) return st;
  if (f->size - h->data_offset < h->data_bytes)
    return pm__set_error(PM_ERR_FORMAT,
                         "truncated data: the shape needs %llu bytes after the header, the file "
                         "has %llu",
                         (unsigned long long)h->data_bytes,
                         (unsigned long long)(f->size - h->data_offset));
  return PM_OK;
}

void pm_npy_options_init(pm_npy_options_t *options) {
  if (!options) return;
  memset(options, 0, sizeof *options);
  options->io = PM_IO_PREAD;
}

pm_status_t pm_dataset_open_npy(const char *const *paths, size_t npaths,
                                const pm_npy_options_t *options, pm_dataset_t **dataset_out) {
  const char *fn = "pm_dataset_open_npy";
  if (!paths || !dataset_out)
    return pm__set_error(PM_ERR_INVALID, "%s: %s is NULL", fn, !paths ? "paths" : "dataset_out");
  if (npaths == 0) return pm__set_error(PM_ERR_INVALID, "%s: no files", fn);
  if (npaths > 1000000) return pm__set_error(PM_ERR_INVALID, "%s: %zu files", fn, npaths);
  for (size_t i = 0; i < npaths; i++)
    if (!paths[i]) return pm__set_error(PM_ERR_INVALID, "%s: paths[%zu] is NULL", fn, i);
  pm_npy_options_t opt;
  pm_npy_options_init(&opt);
  if (options) opt = *options;
  if ((unsigned)opt.io > PM_IO_DIRECT)
    return pm__set_error(PM_ERR_INVALID, "%s: unknown io mode %d", fn, (int)opt.io);
  char want[128] = "";
  if (opt.dtype) {
    pm_status_t st = pm__npy_normalize_descr(opt.dtype, want, sizeof want);
    if (st != PM_OK) return pm__wrap_error(st, "%s", fn);
  }

  pm_dataset_t *ds = NULL;
  pm_status_t st = pm__dataset_alloc((int)npaths, &ds);
  if (st != PM_OK) return st;
  npy_impl_t *im = calloc(1, sizeof *im);
  if (im) {
    im->first = calloc(npaths + 1, sizeof *im->first);
    im->offset = calloc(npaths, sizeof *im->offset);
  }
  ds->impl = im;
  ds->destroy_impl = npy_destroy;
  if (!im || !im->first || !im->offset) {
    pm__dataset_free(ds);
    return pm__set_error(PM_ERR_NOMEM, "%s: tables for %zu files", fn, npaths);
  }
  pm_dataset_info_t *in = &ds->info;
  pm__npy_header_t h0;
  uint64_t total = 0;
  for (size_t i = 0; i < npaths; i++) {
    pm__npy_header_t h;
    st = pm__file_open(&ds->files[i], paths[i], opt.io, in->note, sizeof in->note);
    if (st == PM_OK) st = read_header(&ds->files[i], &h);
    if (st != PM_OK) {
      pm__dataset_free(ds);
      return pm__wrap_error(st, "%s(%s)", fn, paths[i]);
    }
    if (want[0] && strcmp(h.descr, want) != 0) {
      pm__dataset_free(ds);
      return pm__set_error(PM_ERR_FORMAT, "%s(%s): dtype %s, expected %s", fn, paths[i], h.descr,
                           want);
    }
    if (i == 0) {
      h0 = h;
    } else if (h.ndim != h0.ndim || strcmp(h.descr, h0.descr) != 0 ||
               memcmp(h.shape + 1, h0.shape + 1, sizeof(uint64_t) * (size_t)(h.ndim - 1)) != 0) {
      char a[160], b[160];
      shape_text(h.shape + 1, h.ndim - 1, a, sizeof a);
      shape_text(h0.shape + 1, h0.ndim - 1, b, sizeof b);
      pm__dataset_free(ds);
      return pm__set_error(PM_ERR_FORMAT,
                           "%s(%s): samples of shape %s and dtype %s differ from %s's %s and %s",
                           fn, paths[i], a, h.descr, paths[0], b, h0.descr);
    }
    if (total > UINT64_MAX - h.count) {
      pm__dataset_free(ds);
      return pm__set_error(PM_ERR_FORMAT, "%s: too many samples", fn);
    }
    im->first[i] = total;
    im->offset[i] = h.data_offset;
    total += h.count;
  }
  im->first[npaths] = total;
  im->sample_bytes = h0.sample_bytes;
  if (total == 0) {
    pm__dataset_free(ds);
    return pm__set_error(PM_ERR_FORMAT, "%s(%s%s): no samples (axis 0 has length 0)", fn, paths[0],
                         npaths > 1 ? ", ..." : "");
  }
  in->samples = total;
  in->sample_bytes = h0.sample_bytes;
  in->ndim = h0.ndim - 1;
  memcpy(in->shape, h0.shape + 1, sizeof(uint64_t) * (size_t)in->ndim);
  in->dtype = h0.dtype;
  in->itemsize = h0.itemsize;
  snprintf(in->descr, sizeof in->descr, "%s", h0.descr);
  in->files = (int)npaths;
  in->fields = 1;
  in->io = ds->files[0].io;
  for (size_t i = 0; i < npaths; i++)
    if (ds->files[i].io != in->io) in->io = PM_IO_PREAD; /* mixed: some fell back */
  ds->read = npy_read;
  *dataset_out = ds;
  return PM_OK;
}
