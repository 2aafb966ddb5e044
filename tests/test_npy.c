/*
 * .npy datasets: headers of versions 1.0, 2.0 and 3.0 as numpy writes them (and as Python 2
 * did), every kind of fixed-size dtype, structured dtypes, several files as one dataset, the
 * three read modes (pread, mmap, O_DIRECT and its fallback), and every malformed input the
 * issue names: bad magic, truncated preamble/header/data, unknown versions, Fortran order,
 * object dtypes (also inside records), shapes that overflow, wrong keys, mismatched files, the
 * wrong dtype. Sample bytes are checked against what was written; then a loader reads a file
 * end to end.
 */
#include <errno.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "internal.h"

static char g_dir[256];
static int g_files;

/* Write a .npy file: preamble of `major`.`minor`, the dict text padded to 64 bytes with a
 * newline, then `data`. hlen_override != 0 writes that header length instead. */
static const char *write_npy_ex(int major, int minor, const char *dict, const void *data,
                                size_t len, size_t hlen_override, size_t cut) {
  static char path[16][512];
  char *p = path[g_files % 16];
  snprintf(p, 512, "%s/f%d.npy", g_dir, g_files++);
  size_t pre = major == 1 ? 10 : 12;
  size_t dl = strlen(dict);
  size_t total = pm__align_up(pre + dl + 1, 64);
  size_t hlen = total - pre;
  unsigned char *buf = malloc(total + len);
  REQUIRE(buf != NULL);
  memcpy(buf, "\x93NUMPY", 6);
  buf[6] = (unsigned char)major;
  buf[7] = (unsigned char)minor;
  size_t hl = hlen_override ? hlen_override : hlen;
  buf[8] = (unsigned char)hl;
  buf[9] = (unsigned char)(hl >> 8);
  if (major != 1) {
    buf[10] = (unsigned char)(hl >> 16);
    buf[11] = (unsigned char)(hl >> 24);
  }
  memcpy(buf + pre, dict, dl);
  memset(buf + pre + dl, ' ', total - pre - dl);
  buf[total - 1] = '\n';
  if (len) memcpy(buf + total, data, len);
  size_t n = total + len;
  if (cut && cut < n) n = cut;
  FILE *f = fopen(p, "wb");
  REQUIRE(f != NULL);
  REQUIRE(fwrite(buf, 1, n, f) == n);
  fclose(f);
  free(buf);
  return p;
}

static const char *write_npy(int major, const char *dict, const void *data, size_t len) {
  return write_npy_ex(major, 0, dict, data, len, 0, 0);
}

static pm_status_t open1(const char *path, pm_io_mode_t io, pm_dataset_t **ds) {
  pm_npy_options_t o;
  pm_npy_options_init(&o);
  o.io = io;
  return pm_dataset_open_npy(&path, 1, &o, ds);
}

/* Every sample read back equals the bytes written. */
static void check_samples(pm_dataset_t *ds, const unsigned char *data, uint64_t n, size_t sb) {
  unsigned char *buf = malloc(sb + 1);
  REQUIRE(buf != NULL);
  int bad = 0;
  for (uint64_t i = 0; i < n; i++) {
    buf[sb] = 0xEE;
    memset(buf, 0, sb);
    if (pm_dataset_read_sample(ds, 0, i, buf, NULL) != PM_OK)
      bad++;
    else if (memcmp(buf, data + i * sb, sb) != 0 || buf[sb] != 0xEE)
      bad++;
  }
  CHECK_EQ_INT(bad, 0);
  free(buf);
}

static void test_versions(void) {
  unsigned char data[3 * 4 * 5];
  pm_test_fill(data, sizeof data, 1);
  for (int v = 1; v <= 3; v++) {
    const char *p = write_npy(v, "{'descr': '|u1', 'fortran_order': False, 'shape': (3, 4, 5), }",
                              data, sizeof data);
    pm_dataset_t *ds = NULL;
    REQUIRE_OK(open1(p, PM_IO_PREAD, &ds));
    pm_dataset_info_t in;
    CHECK_OK(pm_dataset_get_info(ds, &in));
    CHECK_EQ_SIZE(in.samples, 3);
    CHECK_EQ_SIZE(in.sample_bytes, 20);
    CHECK_EQ_INT(in.ndim, 2);
    CHECK_EQ_SIZE(in.shape[0], 4);
    CHECK_EQ_SIZE(in.shape[1], 5);
    CHECK_EQ_INT(in.dtype, PM_DTYPE_UINT8);
    CHECK_EQ_SIZE(in.itemsize, 1);
    CHECK(strcmp(in.descr, "|u1") == 0);
    CHECK_EQ_INT(in.files, 1);
    CHECK_EQ_SIZE(in.target_bytes, 0);
    check_samples(ds, data, 3, 20);
    CHECK_OK(pm_dataset_destroy(ds));
  }
  /* Python 2 style: u'' strings, long integers, double quotes, no trailing comma. */
  const char *p =
      write_npy(1, "{u\"descr\": u'<i2', u'fortran_order': False, 'shape': (6L, 5L)}", data, 60);
  pm_dataset_t *ds = NULL;
  REQUIRE_OK(open1(p, PM_IO_PREAD, &ds));
  pm_dataset_info_t in;
  CHECK_OK(pm_dataset_get_info(ds, &in));
  CHECK_EQ_SIZE(in.samples, 6);
  CHECK_EQ_SIZE(in.sample_bytes, 10);
  CHECK_EQ_INT(in.dtype, PM_DTYPE_INT16);
  check_samples(ds, data, 6, 10);
  CHECK_OK(pm_dataset_destroy(ds));
  /* A 1-d array: each sample is one scalar; Fortran order is the same layout then. */
  p = write_npy(1, "{'descr': '<f8', 'fortran_order': True, 'shape': (7,), }", data, 56);
  REQUIRE_OK(open1(p, PM_IO_PREAD, &ds));
  CHECK_OK(pm_dataset_get_info(ds, &in));
  CHECK_EQ_SIZE(in.samples, 7);
  CHECK_EQ_INT(in.ndim, 0);
  CHECK_EQ_INT(in.dtype, PM_DTYPE_FLOAT64);
  check_samples(ds, data, 7, 8);
  CHECK_OK(pm_dataset_destroy(ds));
  /* Bytes after the data are ignored, as numpy does. */
  p = write_npy(2, "{'descr': '<u4', 'fortran_order': False, 'shape': (2, 3), }", data, 30);
  REQUIRE_OK(open1(p, PM_IO_PREAD, &ds));
  CHECK_OK(pm_dataset_get_info(ds, &in));
  CHECK_EQ_SIZE(in.samples, 2);
  CHECK_EQ_INT(in.dtype, PM_DTYPE_UINT32);
  CHECK_OK(pm_dataset_destroy(ds));
}

static void test_dtypes(void) {
  static const struct {
    const char *descr;
    size_t itemsize;
    pm_dtype_t code;
    const char *norm;
  } cases[] = {
      {"'|b1'", 1, PM_DTYPE_BOOL, "|b1"},
      {"'|i1'", 1, PM_DTYPE_INT8, "|i1"},
      {"'<u2'", 2, PM_DTYPE_UINT16, "<u2"},
      {"'<i4'", 4, PM_DTYPE_INT32, "<i4"},
      {"'<i8'", 8, PM_DTYPE_INT64, "<i8"},
      {"'<u8'", 8, PM_DTYPE_UINT64, "<u8"},
      {"'<f2'", 2, PM_DTYPE_FLOAT16, "<f2"},
      {"'<f4'", 4, PM_DTYPE_FLOAT32, "<f4"},
      {"'<c8'", 8, PM_DTYPE_COMPLEX64, "<c8"},
      {"'<c16'", 16, PM_DTYPE_COMPLEX128, "<c16"},
      {"'>f8'", 8, PM_DTYPE_OTHER, ">f8"},
      {"'>u1'", 1, PM_DTYPE_UINT8, "|u1"},
      {"'|S7'", 7, PM_DTYPE_OTHER, "|S7"},
      {"'<U3'", 12, PM_DTYPE_OTHER, "<U3"},
      {"'|V16'", 16, PM_DTYPE_OTHER, "|V16"},
      {"'<M8[ns]'", 8, PM_DTYPE_OTHER, "<M8[ns]"},
      {"'<m8'", 8, PM_DTYPE_OTHER, "<m8"},
      {"'<f16'", 16, PM_DTYPE_OTHER, "<f16"},
      {"'=f4'", 4, PM_DTYPE_FLOAT32, "<f4"},
      {"[('a', '<f4'), ('b', '<i2', (3,))]", 10, PM_DTYPE_OTHER, NULL},
      {"[('x', [('p', '|u1'), ('q', '<u8')]), ('', '|V3'), (('title', 'y'), '<f8', (2, 2))]", 44,
       PM_DTYPE_OTHER, NULL},
  };
  unsigned char data[4 * 3 * 44];
  pm_test_fill(data, sizeof data, 2);
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    char dict[256];
    snprintf(dict, sizeof dict, "{'descr': %s, 'fortran_order': False, 'shape': (4, 3), }",
             cases[k].descr);
    const char *p = write_npy(1, dict, data, 4 * 3 * cases[k].itemsize);
    pm_dataset_t *ds = NULL;
    pm_status_t st = open1(p, PM_IO_PREAD, &ds);
    CHECK_OK(st);
    if (st != PM_OK) {
      printf("  dtype %s\n", cases[k].descr);
      continue;
    }
    pm_dataset_info_t in;
    CHECK_OK(pm_dataset_get_info(ds, &in));
    CHECK_EQ_SIZE(in.itemsize, cases[k].itemsize);
    CHECK_EQ_SIZE(in.sample_bytes, 3 * cases[k].itemsize);
    CHECK_EQ_INT(in.dtype, cases[k].code);
    if (cases[k].norm) CHECK(strcmp(in.descr, cases[k].norm) == 0);
    check_samples(ds, data, 4, 3 * cases[k].itemsize);
    CHECK_OK(pm_dataset_destroy(ds));
  }
}

/* A malformed file: PM_ERR_FORMAT (or want) with a detail containing `needle`. */
static void bad_file(const char *p, pm_status_t want, const char *needle) {
  pm_dataset_t *ds = (pm_dataset_t *)(uintptr_t)0x1;
  CHECK_ERR_MSG(open1(p, PM_IO_PREAD, &ds), want);
  CHECK(ds == (pm_dataset_t *)(uintptr_t)0x1); /* untouched */
  if (!strstr(pm_last_error(), needle)) {
    CHECK(strstr(pm_last_error(), needle) != NULL);
    printf("  wanted '%s' in: %s\n", needle, pm_last_error());
  }
}

static void bad_dict(const char *dict, const char *needle) {
  unsigned char data[4096];
  pm_test_fill(data, sizeof data, 3);
  bad_file(write_npy(1, dict, data, sizeof data), PM_ERR_FORMAT, needle);
}

static void test_bad(void) {
  unsigned char data[256];
  pm_test_fill(data, sizeof data, 4);
  const char *ok = "{'descr': '|u1', 'fortran_order': False, 'shape': (4, 8), }";
  char path[512];

  /* Bad magic, an empty file, short preambles, unknown versions. */
  const char *p = write_npy(1, ok, data, 32);
  FILE *f = fopen(p, "r+b");
  REQUIRE(f != NULL);
  fputc('X', f);
  fclose(f);
  bad_file(p, PM_ERR_FORMAT, "magic");
  snprintf(path, sizeof path, "%s/empty.npy", g_dir);
  f = fopen(path, "wb");
  REQUIRE(f != NULL);
  fclose(f);
  bad_file(path, PM_ERR_FORMAT, "truncated");
  bad_file(write_npy_ex(1, 0, ok, data, 32, 0, 8), PM_ERR_FORMAT, "truncated");
  bad_file(write_npy_ex(2, 0, ok, data, 32, 0, 11), PM_ERR_FORMAT, "truncated");
  bad_file(write_npy_ex(4, 0, ok, data, 32, 0, 0), PM_ERR_FORMAT, "version 4.0");
  bad_file(write_npy_ex(1, 1, ok, data, 32, 0, 0), PM_ERR_FORMAT, "version 1.1");
  /* Truncated header: cut inside it, or a length pointing past the end of the file. */
  bad_file(write_npy_ex(1, 0, ok, data, 32, 0, 40), PM_ERR_FORMAT, "truncated .npy header");
  bad_file(write_npy_ex(1, 0, ok, data, 0, 60000, 0), PM_ERR_FORMAT, "truncated .npy header");
  bad_file(write_npy_ex(2, 0, ok, data, 32, (size_t)64 << 20, 0), PM_ERR_FORMAT, "limit");
  /* Truncated data. */
  bad_file(write_npy(1, ok, data, 31), PM_ERR_FORMAT, "truncated data");
  bad_file(write_npy(3, "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000, 3), }",
                     data, 256),
           PM_ERR_FORMAT, "truncated data");

  /* Headers. */
  bad_dict("{'descr': '|u1', 'fortran_order': True, 'shape': (4, 8), }", "Fortran");
  bad_dict("{'descr': '|O', 'fortran_order': False, 'shape': (4,), }", "object");
  bad_dict("{'descr': '<O8', 'fortran_order': False, 'shape': (4,), }", "object");
  bad_dict("{'descr': [('a', '<f4'), ('b', '|O')], 'fortran_order': False, 'shape': (4,), }",
           "object");
  bad_dict("{'descr': [('a', [('c', '|O')])], 'fortran_order': False, 'shape': (4,), }", "object");
  bad_dict("{'descr': '<q7', 'fortran_order': False, 'shape': (4,), }", "unknown dtype");
  bad_dict("{'descr': '<f3', 'fortran_order': False, 'shape': (4,), }", "unknown dtype");
  bad_dict("{'descr': '|S0', 'fortran_order': False, 'shape': (4,), }", "size 0");
  bad_dict(
      "{'descr': '|u1', 'fortran_order': False, 'shape': (4294967296, 4294967296, "
      "4294967296), }",
      "overflows");
  bad_dict("{'descr': '<u8', 'fortran_order': False, 'shape': (2, 2305843009213693952), }",
           "overflows");
  bad_dict("{'descr': '|u1', 'fortran_order': False, 'shape': (99999999999999999999, 1), }",
           "overflows");
  bad_dict("{'descr': '|u1', 'fortran_order': False, 'shape': (4, -8), }", "negative");
  bad_dict("{'descr': '|u1', 'fortran_order': False, 'shape': (), }", "0-dimensional");
  bad_dict("{'descr': '|u1', 'fortran_order': False, 'shape': (4, 0), }", "0 bytes");
  bad_dict("{'descr': '|u1', 'fortran_order': False, 'shape': 4, }", "not a tuple");
  bad_dict("{'descr': '|u1', 'shape': (4, 8), }", "fortran_order");
  bad_dict("{'descr': '|u1', 'fortran_order': False, 'shape': (4, 8), 'extra': 1}", "extra");
  bad_dict("{'descr': '|u1', 'descr': '|u1', 'fortran_order': False, 'shape': (4,)}", "repeated");
  bad_dict("{'descr': '|u1', 'fortran_order': Maybe, 'shape': (4, 8), }", "True or False");
  bad_dict("{'descr': '|u1', 'fortran_order': False, 'shape': (4, 8), } junk", "after");
  bad_dict("{'descr': '|u1', 'fortran_order': False, 'shape': (4, 8)", "expected");
  bad_dict("{'descr': '|u1, 'fortran_order': False, 'shape': (4, 8)}", "bad .npy header");
  bad_dict("{'descr': '|u1', 'fortran_order': False, 'shape': (4 8)}", "expected");
  bad_dict("[1, 2]", "expected");
  bad_dict("", "expected");
  bad_dict("{'descr': '|u1', 'fortran_order': False, 'shape': (0, 8), }", "no samples");
  /* More dimensions than a sample may have. */
  char dict[512] = "{'descr': '|u1', 'fortran_order': False, 'shape': (1";
  for (int i = 0; i < PM_DATASET_MAX_DIMS + 1; i++) strcat(dict, ", 1");
  strcat(dict, "), }");
  bad_dict(dict, "dimensions");

  /* Missing files and directories. */
  snprintf(path, sizeof path, "%s/missing.npy", g_dir);
  bad_file(path, PM_ERR_IO, "missing.npy");
  bad_file(g_dir, PM_ERR_IO, "not a regular file");

  /* Direct parser calls on buffers. */
  pm__npy_header_t h;
  CHECK_ERR_MSG(pm__npy_parse((const unsigned char *)"\x93NUMPY", 6, &h), PM_ERR_FORMAT);
  size_t total = 0;
  CHECK_OK(pm__npy_preamble((const unsigned char *)"\x93NUMPY\x01\x00\x76\x00", 10, &total));
  CHECK_EQ_SIZE(total, 128);
  char norm[64];
  CHECK_OK(pm__npy_normalize_descr("u1", norm, sizeof norm));
  CHECK(strcmp(norm, "|u1") == 0);
  CHECK_OK(pm__npy_normalize_descr("f4", norm, sizeof norm));
  CHECK(strcmp(norm, "<f4") == 0);
  CHECK_ERR_MSG(pm__npy_normalize_descr("float32", norm, sizeof norm), PM_ERR_INVALID);

  /* Arguments. */
  pm_dataset_t *ds;
  CHECK_ERR_MSG(pm_dataset_open_npy(NULL, 1, NULL, &ds), PM_ERR_INVALID);
  const char *paths[1] = {NULL};
  CHECK_ERR_MSG(pm_dataset_open_npy(paths, 1, NULL, &ds), PM_ERR_INVALID);
  paths[0] = p;
  CHECK_ERR_MSG(pm_dataset_open_npy(paths, 0, NULL, &ds), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_dataset_open_npy(paths, 1, NULL, NULL), PM_ERR_INVALID);
  pm_npy_options_t o;
  pm_npy_options_init(&o);
  o.io = (pm_io_mode_t)7;
  CHECK_ERR_MSG(pm_dataset_open_npy(paths, 1, &o, &ds), PM_ERR_INVALID);
}

static void test_multi(void) {
  unsigned char a[5 * 12], b[3 * 12], all[8 * 12];
  pm_test_fill(a, sizeof a, 5);
  pm_test_fill(b, sizeof b, 6);
  memcpy(all, a, sizeof a);
  memcpy(all + sizeof a, b, sizeof b);
  const char *pa =
      write_npy(1, "{'descr': '<u2', 'fortran_order': False, 'shape': (5, 2, 3), }", a, sizeof a);
  const char *pb =
      write_npy(2, "{'descr': '<u2', 'fortran_order': False, 'shape': (3, 2, 3), }", b, sizeof b);
  const char *pe =
      write_npy(3, "{'descr': '<u2', 'fortran_order': False, 'shape': (0, 2, 3), }", b, 0);
  const char *paths[3] = {pa, pe, pb};
  pm_dataset_t *ds = NULL;
  REQUIRE_OK(pm_dataset_open_npy(paths, 3, NULL, &ds));
  pm_dataset_info_t in;
  CHECK_OK(pm_dataset_get_info(ds, &in));
  CHECK_EQ_SIZE(in.samples, 8);
  CHECK_EQ_INT(in.files, 3);
  check_samples(ds, all, 8, 12);
  CHECK_OK(pm_dataset_destroy(ds));

  /* The dtype the caller expects. */
  pm_npy_options_t o;
  pm_npy_options_init(&o);
  o.dtype = "u2";
  REQUIRE_OK(pm_dataset_open_npy(paths, 3, &o, &ds));
  CHECK_OK(pm_dataset_destroy(ds));
  o.dtype = "<f2";
  CHECK_ERR_MSG(pm_dataset_open_npy(paths, 3, &o, &ds), PM_ERR_FORMAT);
  CHECK(strstr(pm_last_error(), "expected <f2") != NULL);
  o.dtype = "nonsense";
  CHECK_ERR_MSG(pm_dataset_open_npy(paths, 3, &o, &ds), PM_ERR_INVALID);

  /* Files that do not match. */
  const char *pc =
      write_npy(1, "{'descr': '<u2', 'fortran_order': False, 'shape': (3, 3, 2), }", b, sizeof b);
  const char *mism[2] = {pa, pc};
  CHECK_ERR_MSG(pm_dataset_open_npy(mism, 2, NULL, &ds), PM_ERR_FORMAT);
  CHECK(strstr(pm_last_error(), "(3, 2)") != NULL);
  const char *pd =
      write_npy(1, "{'descr': '<i2', 'fortran_order': False, 'shape': (3, 2, 3), }", b, sizeof b);
  mism[1] = pd;
  CHECK_ERR_MSG(pm_dataset_open_npy(mism, 2, NULL, &ds), PM_ERR_FORMAT);
  CHECK(strstr(pm_last_error(), "<i2") != NULL);
}

/* pread, mmap and O_DIRECT give the same bytes, for samples that straddle 4 KiB blocks, and
 * O_DIRECT falls back with a note where it is refused. */
static void test_io_modes(void) {
  const uint64_t n = 97;
  const size_t sb = 3 * 1531; /* odd: samples straddle blocks */
  unsigned char *data = malloc(n * sb);
  REQUIRE(data != NULL);
  pm_test_fill(data, n * sb, 7);
  const char *p = write_npy(1, "{'descr': '|u1', 'fortran_order': False, 'shape': (97, 3, 1531), }",
                            data, n * sb);
  for (int mode = 0; mode < 3; mode++) {
    pm_dataset_t *ds = NULL;
    REQUIRE_OK(open1(p, (pm_io_mode_t)mode, &ds));
    pm_dataset_info_t in;
    CHECK_OK(pm_dataset_get_info(ds, &in));
    CHECK_EQ_INT(in.io, mode);
    CHECK(in.note[0] == '\0');
    check_samples(ds, data, n, sb);
    CHECK_OK(pm_dataset_destroy(ds));
  }
  /* Samples aligned to 4 KiB in the file: O_DIRECT reads go straight into place. */
  unsigned char *d2 = malloc(8 * 8192);
  REQUIRE(d2 != NULL);
  pm_test_fill(d2, 8 * 8192, 8);
  char dict[4096 - 10];
  snprintf(dict, sizeof dict, "%s",
           "{'descr': '|u1', 'fortran_order': False, 'shape': (8, 8192), }");
  /* header padded to exactly 4096 bytes */
  size_t dl = strlen(dict);
  memset(dict + dl, ' ', sizeof dict - 1 - dl - 1);
  dict[sizeof dict - 2] = '\0';
  const char *pa = write_npy(1, dict, d2, 8 * 8192);
  pm_dataset_t *ds = NULL;
  REQUIRE_OK(open1(pa, PM_IO_DIRECT, &ds));
  check_samples(ds, d2, 8, 8192);
  void *aligned = NULL;
  REQUIRE(posix_memalign(&aligned, 4096, 8192) == 0);
  CHECK_OK(pm_dataset_read_sample(ds, 0, 5, aligned, NULL));
  CHECK(memcmp(aligned, d2 + 5 * 8192, 8192) == 0);
  free(aligned);
  CHECK_OK(pm_dataset_destroy(ds));
  free(d2);

  /* The filesystem refuses O_DIRECT: buffered reads, and the note says why. */
  atomic_store(&pm__io_refuse_direct, 1);
  REQUIRE_OK(open1(p, PM_IO_DIRECT, &ds));
  pm_dataset_info_t in;
  CHECK_OK(pm_dataset_get_info(ds, &in));
  CHECK_EQ_INT(in.io, PM_IO_PREAD);
  CHECK(strstr(in.note, "O_DIRECT") != NULL);
  check_samples(ds, data, n, sb);
  CHECK_OK(pm_dataset_destroy(ds));
  atomic_store(&pm__io_refuse_direct, 0);

  /* An injected I/O error names the file and the sample. */
  REQUIRE_OK(open1(p, PM_IO_PREAD, &ds));
  REQUIRE_OK(pm__fault_set(PM__FAULT_IO, 1, 0));
  unsigned char *buf = malloc(sb);
  REQUIRE(buf != NULL);
  CHECK_ERR_MSG(pm_dataset_read_sample(ds, 0, 3, buf, NULL), PM_ERR_IO);
  CHECK(strstr(pm_last_error(), "sample 3") != NULL);
  CHECK(strstr(pm_last_error(), ".npy") != NULL);
  CHECK_OK(pm_dataset_read_sample(ds, 0, 3, buf, NULL));
  pm__fault_reset();
  CHECK(memcmp(buf, data + 3 * sb, sb) == 0);
  free(buf);
  CHECK_OK(pm_dataset_destroy(ds));

  /* A file truncated after it was opened: a read error, not a short sample. */
  REQUIRE_OK(open1(p, PM_IO_PREAD, &ds));
  REQUIRE(truncate(p, 128 + 10 * (off_t)sb) == 0);
  buf = malloc(sb);
  REQUIRE(buf != NULL);
  CHECK_OK(pm_dataset_read_sample(ds, 0, 9, buf, NULL));
  CHECK_ERR_MSG(pm_dataset_read_sample(ds, 0, 50, buf, NULL), PM_ERR_IO);
  CHECK(strstr(pm_last_error(), "end of file") != NULL);
  free(buf);
  CHECK_OK(pm_dataset_destroy(ds));
  free(data);
}

/* A loader over a real file, device delivery, shuffled, two epochs: every row checked. */
static void test_loader_file(void) {
  const uint64_t n = 150;
  const size_t sb = 2 * 5 * 7 * 4;
  unsigned char *data = malloc(n * sb);
  REQUIRE(data != NULL);
  pm_test_fill(data, n * sb, 9);
  const char *p = write_npy(
      1, "{'descr': '<f4', 'fortran_order': False, 'shape': (150, 2, 5, 7), }", data, n * sb);
  for (int io = 0; io < 3; io++) {
    pm_npy_options_t o;
    pm_npy_options_init(&o);
    o.io = (pm_io_mode_t)io;
    pm_dataset_t *ds = NULL;
    REQUIRE_OK(pm_dataset_open_npy(&p, 1, &o, &ds));
    pm_loader_config_t c;
    pm_loader_config_init(&c);
    c.batch_size = 16;
    c.workers = 2;
    c.shuffle = 1;
    c.seed = 5;
    c.epochs = 2;
    c.rank = 0;
    c.world_size = 1;
    pm_loader_t *ld;
    REQUIRE_OK(pm_loader_create(ds, &c, &ld));
    int *seen = calloc(n, sizeof *seen);
    unsigned char *back = malloc(16 * sb);
    REQUIRE(seen && back);
    pm_batch_t b;
    int bad = 0;
    while (pm_loader_next(ld, &b) == PM_OK) {
      CHECK_EQ_INT(b.ndim, 4);
      CHECK_EQ_SIZE(b.shape[1], 2);
      CHECK_EQ_SIZE(b.shape[3], 7);
      CHECK_EQ_INT(b.dtype, PM_DTYPE_FLOAT32);
      CHECK_OK(pm_event_synchronize(b.event));
      CHECK_OK(pm_memcpy(back, b.inputs, b.inputs_bytes, PM_COPY_D2H));
      for (size_t r = 0; r < b.samples; r++) {
        seen[b.indices[r]]++;
        if (memcmp(back + r * sb, data + b.indices[r] * sb, sb) != 0) bad++;
      }
      CHECK_OK(pm_batch_release(&b, NULL));
    }
    CHECK(strstr(pm_last_error(), "end of data") != NULL);
    CHECK_EQ_INT(bad, 0);
    int wrong = 0;
    for (uint64_t i = 0; i < n; i++) wrong += seen[i] != 2;
    CHECK_EQ_INT(wrong, 0);
    free(seen);
    free(back);
    CHECK_OK(pm_loader_destroy(ld));
    CHECK_OK(pm_dataset_destroy(ds));
  }
  /* An I/O error in the middle of an epoch reaches pm_loader_next. */
  pm_dataset_t *ds = NULL;
  REQUIRE_OK(pm_dataset_open_npy(&p, 1, NULL, &ds));
  pm_loader_config_t c;
  pm_loader_config_init(&c);
  c.batch_size = 10;
  c.workers = 1;
  c.prefetch = 2;
  c.rank = 0;
  c.world_size = 1;
  pm_loader_t *ld;
  REQUIRE_OK(pm__fault_set(PM__FAULT_IO, 45, 0));
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  pm_batch_t b;
  int ok = 0;
  pm_status_t st;
  while ((st = pm_loader_next(ld, &b)) == PM_OK) {
    CHECK_EQ_SIZE(b.samples, 10);
    ok++;
    CHECK_OK(pm_batch_release(&b, NULL));
  }
  pm__fault_reset();
  CHECK_ST(st, PM_ERR_IO);
  CHECK(strstr(pm_last_error(), "injected") != NULL);
  CHECK_EQ_INT(ok, 4); /* reads 1..44 are samples 0..43: batches 0-3 whole, batch 4 fails */
  CHECK_OK(pm_loader_destroy(ld));
  CHECK_OK(pm_dataset_destroy(ds));
  free(data);
}

/* io=mmap over a file truncated after it was opened: a clean PM_ERR_IO for the samples that are
 * gone (touching the mapping there would raise SIGBUS), the rest still read. */
static void test_mmap_truncated(void) {
  const uint64_t n = 64;
  const size_t sb = 4096;
  unsigned char *data = malloc(n * sb);
  REQUIRE(data != NULL);
  pm_test_fill(data, n * sb, 21);
  const char *p =
      write_npy(1, "{'descr': '|u1', 'fortran_order': False, 'shape': (64, 4096), }", data, n * sb);
  pm_dataset_t *ds = NULL;
  REQUIRE_OK(open1(p, PM_IO_MMAP, &ds));
  pm_dataset_info_t info;
  CHECK_OK(pm_dataset_get_info(ds, &info));
  CHECK_EQ_INT(info.io, PM_IO_MMAP);
  struct stat stt;
  REQUIRE(stat(p, &stt) == 0);
  size_t header = (size_t)stt.st_size - n * sb;
  REQUIRE(truncate(p, (off_t)(header + 8 * sb)) == 0); /* 8 samples left */
  unsigned char *buf = malloc(sb);
  REQUIRE(buf != NULL);
  CHECK_OK(pm_dataset_read_sample(ds, 0, 3, buf, NULL));
  CHECK(memcmp(buf, data + 3 * sb, sb) == 0);
  CHECK_ERR_MSG(pm_dataset_read_sample(ds, 0, 40, buf, NULL), PM_ERR_IO);
  CHECK(strstr(pm_last_error(), "shrank") != NULL);
  CHECK_ERR_MSG(pm_dataset_read_sample(ds, 0, 63, buf, NULL), PM_ERR_IO);

  /* A loader over it stops with the read's error instead of dying. */
  pm_loader_config_t c;
  pm_loader_config_init(&c);
  c.batch_size = 16;
  c.workers = 2;
  c.rank = 0;
  c.world_size = 1;
  pm_loader_t *ld = NULL;
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  pm_batch_t b;
  pm_status_t st;
  int ok = 0;
  while ((st = pm_loader_next(ld, &b)) == PM_OK) {
    ok++;
    CHECK_OK(pm_batch_release(&b, NULL));
  }
  CHECK_ST(st, PM_ERR_IO);
  CHECK_EQ_INT(ok, 0); /* the first batch already holds samples 8..15 */
  CHECK_OK(pm_loader_destroy(ld));
  CHECK_OK(pm_dataset_destroy(ds));
  free(buf);
  free(data);
}

int main(void) {
  pm_test_init();
  REQUIRE(pm_test_tmpdir(g_dir, sizeof g_dir, "npy"));
  test_versions();
  test_dtypes();
  test_bad();
  test_multi();
  test_io_modes();
  test_loader_file();
  test_mmap_truncated();
  pm_test_rmtree(g_dir);
  CHECK_OK(pm_finalize());
  return pm_test_finish("test_npy");
}
