/*
 * Files: pm_file_read_async / pm_file_write_async into and from device, pinned and pageable
 * memory, buffered and O_DIRECT, with odd sizes and offsets (every byte checked, and the bytes
 * around a written range checked untouched); every injected I/O error (EIO, ENOSPC, EINTR
 * retried, short transfers continued), the end of the file, bad arguments, a small pool's
 * budget, descriptors not leaked, fences and callbacks completing exactly once, and the
 * stream's earlier work ordered before the file's bytes.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "backend.h" /* launch_host_func: a gate on a stream */
#include "check.h"
#include "internal.h" /* pm__fault_*, pm__file_note, pm__io_refuse_direct */

#if defined(__SANITIZE_THREAD__)
#define PM_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PM_TSAN 1
#endif
#endif
#ifndef PM_TSAN
#define PM_TSAN 0
#endif

static bool g_small; /* valgrind (PINMEM_TEST_SMALL) or ThreadSanitizer: smaller ranges */
static char g_dir[512];
static char g_path[600];
static int g_fd = -1;           /* the test file, read-write */
static unsigned char *g_bytes;  /* what the file holds */
static size_t g_size;     /* the file's size now */
static size_t g_size_max; /* its usual size */
static size_t g_alloc;    /* bytes of g_bytes: the most file_reset_size may write */
static pm_stream_t g_s;
static bool g_direct_ok; /* the scratch directory's filesystem takes O_DIRECT */
static bool g_falloc_ok; /* and fallocate */

typedef enum { MEM_DEVICE, MEM_PINNED, MEM_PAGEABLE } mem_t;
static const char *mem_name[] = {"device", "pinned", "pageable"};

typedef struct buf {
  mem_t kind;
  char *alloc;
  char *p;
  size_t bytes;
} buf_t;

/* pageable buffers start `mis` bytes into their allocation, so their address agrees with no
 * file offset's alignment (the ring path of direct I/O for host memory). */
static void buf_make(buf_t *b, mem_t kind, size_t bytes, size_t mis) {
  memset(b, 0, sizeof *b);
  b->kind = kind;
  b->bytes = bytes;
  void *a = NULL;
  switch (kind) {
    case MEM_DEVICE:
      REQUIRE_OK(pm_device_alloc(bytes, &a));
      b->alloc = b->p = a;
      return;
    case MEM_PINNED:
      REQUIRE_OK(pm_host_alloc(NULL, bytes + mis, PM_HOST_DEFAULT, &a));
      break;
    case MEM_PAGEABLE:
      a = malloc(bytes + mis);
      REQUIRE(a != NULL);
      break;
  }
  b->alloc = a;
  b->p = b->alloc + mis;
}

static void buf_free(buf_t *b) {
  if (b->kind == MEM_DEVICE)
    CHECK_OK(pm_device_free(b->alloc));
  else if (b->kind == MEM_PINNED)
    CHECK_OK(pm_host_free(b->alloc));
  else
    free(b->alloc);
}

/* The buffer's bytes in host memory (a copy for device memory; free with free()). */
static unsigned char *buf_read(const buf_t *b) {
  unsigned char *h = malloc(b->bytes ? b->bytes : 1);
  REQUIRE(h != NULL);
  if (b->kind == MEM_DEVICE)
    REQUIRE_OK(pm_memcpy(h, b->p, b->bytes, PM_COPY_D2H));
  else
    memcpy(h, b->p, b->bytes);
  return h;
}

static void buf_fill(buf_t *b, uint64_t seed) {
  unsigned char *h = malloc(b->bytes);
  REQUIRE(h != NULL);
  pm_test_fill(h, b->bytes, seed);
  if (b->kind == MEM_DEVICE)
    REQUIRE_OK(pm_memcpy(b->p, h, b->bytes, PM_COPY_H2D));
  else
    memcpy(b->p, h, b->bytes);
  free(h);
}

/* CRC-32 (zlib's), bit by bit: the oracle for options->crc32, independent of zlib. */
static uint32_t crc32_ref(const unsigned char *p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; i++) {
    c ^= p[i];
    for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
  }
  return ~c;
}

static size_t first_diff(const unsigned char *a, const unsigned char *b, size_t n) {
  if (memcmp(a, b, n) == 0) return n;
  for (size_t i = 0; i < n; i++)
    if (a[i] != b[i]) return i;
  return n;
}

static void opts(pm_file_options_t *o, pm_file_io_t io, size_t chunk) {
  pm_file_options_init(o);
  o->io = io;
  o->chunk = chunk;
  o->threads = 3;
}

/* (Re)write the test file with `size` seeded bytes through plain pwrite. */
static void file_reset_size(uint64_t seed, size_t size) {
  REQUIRE(size <= g_alloc);
  g_size = size;
  pm_test_fill(g_bytes, g_size, seed);
  REQUIRE(ftruncate(g_fd, 0) == 0);
  size_t done = 0;
  while (done < g_size) {
    ssize_t r = pwrite(g_fd, g_bytes + done, g_size - done, (off_t)done);
    REQUIRE(r > 0);
    done += (size_t)r;
  }
}

static void file_reset(uint64_t seed) {
  file_reset_size(seed, g_size_max);
}

static unsigned char *file_contents(void) {
  unsigned char *h = malloc(g_size + 1);
  REQUIRE(h != NULL);
  size_t done = 0;
  while (done < g_size) {
    ssize_t r = pread(g_fd, h + done, g_size - done, (off_t)done);
    REQUIRE(r > 0);
    done += (size_t)r;
  }
  REQUIRE(pread(g_fd, h, 1, (off_t)g_size) == 0); /* no longer than it was */
  return h;
}

static int count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  int n = 0;
  while (readdir(d)) n++;
  closedir(d);
  return n;
}

/* pm_last_error() contains s (else it is printed). */
static bool has(const char *s) {
  bool ok = strstr(pm_last_error(), s) != NULL;
  if (!ok) fprintf(stderr, "    wanted '%s' in: %s\n", s, pm_last_error());
  return ok;
}

/* ---- round trips ---------------------------------------------------------------------------- */

static void read_case(size_t bytes, uint64_t off, pm_file_io_t io, mem_t kind, size_t chunk) {
  buf_t b;
  buf_make(&b, kind, bytes, 5);
  if (kind == MEM_DEVICE) CHECK_OK(pm_device_memset_async(b.p, 0xA5, bytes, g_s));
  pm_file_options_t o;
  opts(&o, io, chunk);
  pm_fence_t f = NULL;
  pm_status_t st = pm_file_read_async(g_fd, off, bytes, b.p, g_s, &o, &f);
  CHECK_OK(st);
  if (st == PM_OK) {
    CHECK_OK(pm_fence_wait(f));
    CHECK_OK(pm_fence_release(f));
    /* Direct was used where the filesystem allows it, else the note says why not. */
    if (io == PM_FILE_IO_DIRECT) CHECK((pm__file_note()[0] == '\0') == g_direct_ok);
    unsigned char *h = buf_read(&b);
    size_t d = first_diff(h, g_bytes + off, bytes);
    if (d != bytes)
      fprintf(stderr, "read %zu bytes at %llu, %s, %s, chunk %zu: first difference at %zu\n",
              bytes, (unsigned long long)off, pm__file_io_name(io), mem_name[kind], chunk, d);
    CHECK_EQ_SIZE(d, bytes);
    free(h);
  }
  buf_free(&b);
}

static void write_case(size_t bytes, uint64_t off, pm_file_io_t io, mem_t kind, size_t chunk,
                       uint64_t seed) {
  file_reset_size(seed + 1000, (size_t)off + bytes + 5000);
  buf_t b;
  buf_make(&b, kind, bytes, 3);
  buf_fill(&b, seed);
  unsigned char *want = malloc(bytes);
  REQUIRE(want != NULL);
  pm_test_fill(want, bytes, seed);
  pm_file_options_t o;
  opts(&o, io, chunk);
  o.fsync = (seed & 1) != 0;
  uint32_t crc = 0x12345678u;
  if (seed % 3 == 0) o.crc32 = &crc; /* and its CRC-32, every third case */
  pm_fence_t f = NULL;
  CHECK_OK(pm_file_write_async(g_fd, off, bytes, b.p, g_s, &o, &f));
  if (o.crc32) CHECK_EQ_INT(crc, crc32_ref(want, bytes));
  if (f) {
    CHECK_OK(pm_fence_query(f)); /* complete when the call returns */
    CHECK_OK(pm_fence_release(f));
  }
  unsigned char *h = file_contents();
  /* Before and after the range: the old bytes; the range: the new ones. */
  CHECK_EQ_SIZE(first_diff(h, g_bytes, off), off);
  CHECK_EQ_SIZE(first_diff(h + off, want, bytes), bytes);
  CHECK_EQ_SIZE(first_diff(h + off + bytes, g_bytes + off + bytes, g_size - off - bytes),
                g_size - off - bytes);
  free(h);
  free(want);
  buf_free(&b);
}

static void test_roundtrips(void) {
  size_t big = g_small ? ((size_t)1 << 20) + 3 : ((size_t)16 << 20) + 3;
  size_t sizes[] = {1, 4095, 4096, 4097, 65536 * 3 + 11, big};
  uint64_t offs[] = {0, 1, 4093, 8192};
  pm_file_io_t ios[] = {PM_FILE_IO_BUFFERED, PM_FILE_IO_DIRECT};
  file_reset(1);
  int n = 0;
  for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++)
    for (size_t oi = 0; oi < sizeof offs / sizeof *offs; oi++)
      for (int ii = 0; ii < 2; ii++)
        for (int m = 0; m < 3; m++) {
          if (g_small && sizes[si] == big && (m != MEM_DEVICE || oi != 2)) continue;
          /* Small chunks so a range takes many units and the ring wraps. */
          size_t chunk = sizes[si] == big && m == MEM_DEVICE && oi == 0 ? 0 : 65536;
          read_case(sizes[si], offs[oi], ios[ii], (mem_t)m, chunk);
          n++;
        }
  printf("  %d reads checked\n", n);
  n = 0;
  for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++)
    for (size_t oi = 0; oi < sizeof offs / sizeof *offs; oi++)
      for (int ii = 0; ii < 2; ii++)
        for (int m = 0; m < 3; m++) {
          if (sizes[si] == big && (m == MEM_PINNED || oi == 3 || (g_small && m != MEM_DEVICE)))
            continue;
          write_case(sizes[si], offs[oi], ios[ii], (mem_t)m, 65536, (uint64_t)(n + 7));
          n++;
        }
  printf("  %d writes checked\n", n);
  /* A write that grows the file. */
  file_reset(2);
  buf_t b;
  buf_make(&b, MEM_DEVICE, 70001, 0);
  buf_fill(&b, 77);
  pm_file_options_t o;
  opts(&o, PM_FILE_IO_DIRECT, 16384);
  CHECK_OK(pm_file_write_async(g_fd, g_size - 5, 70001, b.p, g_s, &o, NULL));
  unsigned char *want = malloc(70001);
  unsigned char *got = malloc(70001);
  REQUIRE(want && got);
  pm_test_fill(want, 70001, 77);
  CHECK_EQ_INT(pread(g_fd, got, 70001, (off_t)(g_size - 5)), 70001);
  CHECK_EQ_SIZE(first_diff(got, want, 70001), 70001);
  CHECK_EQ_INT(lseek(g_fd, 0, SEEK_END), (long long)(g_size - 5 + 70001));
  free(want);
  free(got);
  buf_free(&b);
  file_reset(1);
}

/* Writes that end past the end of the file, from every memory and in both io modes: over the
 * old end, and after a gap (a hole, which must read as zeros). A direct one reserves its range
 * first (file.c, reserve()); the bytes before the range stay, the file ends where the range
 * does. Units smaller than the range so that several threads write at once, and the default
 * unit (option file_write_chunk). */
static void test_extend(void) {
  size_t bytes = g_small ? 200003 : ((size_t)3 << 20) + 5;
  size_t chunks[] = {65536, 0};
  pm_file_io_t ios[] = {PM_FILE_IO_BUFFERED, PM_FILE_IO_DIRECT};
  unsigned char *want = malloc(bytes);
  REQUIRE(want != NULL);
  int n = 0;
  for (int gap = 0; gap < 2; gap++)
    for (int ci = 0; ci < 2; ci++)
      for (int ii = 0; ii < 2; ii++)
        for (int m = 0; m < 3; m++) {
          size_t old = 50001;
          uint64_t off = gap ? old + 12345 : old - 777;
          file_reset_size((uint64_t)(60 + n), old);
          buf_t b;
          buf_make(&b, (mem_t)m, bytes, 3);
          buf_fill(&b, (uint64_t)(90 + n));
          pm_test_fill(want, bytes, (uint64_t)(90 + n));
          pm_file_options_t o;
          opts(&o, ios[ii], chunks[ci]);
          o.fsync = gap != 0;
          CHECK_OK(pm_file_write_async(g_fd, off, bytes, b.p, g_s, &o, NULL));
          CHECK_EQ_INT(lseek(g_fd, 0, SEEK_END), (long long)(off + bytes));
          g_size = (size_t)(off + bytes);
          unsigned char *h = file_contents();
          size_t keep = old < off ? old : (size_t)off;
          CHECK_EQ_SIZE(first_diff(h, g_bytes, keep), keep);
          for (size_t i = old; i < off; i++)
            if (h[i] != 0) {
              fprintf(stderr, "extend: byte %zu of the gap is %d, not 0\n", i, h[i]);
              CHECK(h[i] == 0);
              break;
            }
          size_t d = first_diff(h + off, want, bytes);
          if (d != bytes)
            fprintf(stderr, "extend %s, %s, chunk %zu, gap %d: first difference at %zu\n",
                    pm__file_io_name(ios[ii]), mem_name[m], chunks[ci], gap, d);
          CHECK_EQ_SIZE(d, bytes);
          free(h);
          buf_free(&b);
          n++;
        }
  printf("  %d extending writes checked\n", n);
  free(want);

  /* A write past the end that the file may not grow to (RLIMIT_FSIZE, SIGXFSZ ignored): the
   * reservation refuses it before a byte is written, where the filesystem has fallocate; else
   * the write itself fails at the limit. Either way a clear PM_ERR_IO. */
  file_reset_size(7, 8192);
  struct rlimit lim0, lim;
  REQUIRE(getrlimit(RLIMIT_FSIZE, &lim0) == 0);
  if (lim0.rlim_max != RLIM_INFINITY && lim0.rlim_max < ((rlim_t)1 << 20)) {
    printf("  RLIMIT_FSIZE hard limit %llu: the limit case is not run\n",
           (unsigned long long)lim0.rlim_max);
  } else {
    for (int m = 0; m < 3; m++) {
      file_reset_size(7, 8192);
      buf_t b;
      buf_make(&b, (mem_t)m, 300001, 0);
      buf_fill(&b, 8);
      pm_file_options_t o;
      opts(&o, PM_FILE_IO_DIRECT, 65536);
      void (*sig0)(int) = signal(SIGXFSZ, SIG_IGN);
      lim = lim0;
      lim.rlim_cur = 131072;
      REQUIRE(setrlimit(RLIMIT_FSIZE, &lim) == 0);
      pm_status_t st = pm_file_write_async(g_fd, 8192, 300001, b.p, g_s, &o, NULL);
      REQUIRE(setrlimit(RLIMIT_FSIZE, &lim0) == 0);
      signal(SIGXFSZ, sig0);
      CHECK_ERR_MSG(st, PM_ERR_IO);
      CHECK(has("File too large"));
      if (g_falloc_ok) {
        CHECK(has("fallocate(fd"));
        CHECK_EQ_INT(lseek(g_fd, 0, SEEK_END), 8192);
        unsigned char *h = file_contents();
        CHECK_EQ_SIZE(first_diff(h, g_bytes, 8192), 8192);
        free(h);
      }
      buf_free(&b);
    }
  }
  file_reset(1);
}

/* Offsets past 4 GiB, as in any checkpoint of a large model: writes and reads whose range
 * starts just below 2^32 and crosses it, and ranges at 5 * 2^32 + a few bytes, in both io
 * modes, from and into every memory, in units small enough that several cross the boundary.
 * The file is sparse (a few hundred KiB of blocks at most); reads check the bytes written and
 * the zeros of the holes next to them. */
static void test_far_offsets(void) {
  char path[700];
  snprintf(path, sizeof path, "%s/far.bin", g_dir);
  int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  const uint64_t four = (uint64_t)1 << 32;
  const uint64_t offs[] = {four - 70001, four + 4093, 5 * four + 7};
  const size_t bytes = 200003;
  struct rlimit fsize;
  REQUIRE(getrlimit(RLIMIT_FSIZE, &fsize) == 0);
  if (fsize.rlim_cur != RLIM_INFINITY && fsize.rlim_cur < (rlim_t)(6 * four)) {
    pm_test_skip("files past 4 GiB: RLIMIT_FSIZE is %llu", (unsigned long long)fsize.rlim_cur);
    close(fd);
    unlink(path);
    return;
  }
  if (ftruncate(fd, (off_t)(6 * four)) != 0) {
    pm_test_skip("files past 4 GiB: a sparse file of 24 GiB cannot be made in %s (%s)", g_dir,
                 strerror(errno));
    close(fd);
    unlink(path);
    return;
  }
  pm_file_io_t ios[] = {PM_FILE_IO_BUFFERED, PM_FILE_IO_DIRECT};
  unsigned char *want = malloc(bytes), *got = malloc(bytes + 2 * 4096);
  REQUIRE(want && got);
  int n = 0;
  for (size_t oi = 0; oi < sizeof offs / sizeof *offs; oi++)
    for (int ii = 0; ii < 2; ii++)
      for (int m = 0; m < 3; m++) {
        uint64_t off = offs[oi] + (uint64_t)(n % 3); /* and a different edge each time */
        uint64_t seed = 300 + (uint64_t)n;
        /* All holes again: the last case's bytes would lie beside this one's. */
        REQUIRE(ftruncate(fd, 0) == 0 && ftruncate(fd, (off_t)(6 * four)) == 0);
        buf_t b;
        buf_make(&b, (mem_t)m, bytes, 1);
        buf_fill(&b, seed);
        pm_test_fill(want, bytes, seed);
        pm_file_options_t o;
        opts(&o, ios[ii], 65536);
        CHECK_OK(pm_file_write_async(fd, off, bytes, b.p, g_s, &o, NULL));
        /* What the file holds there, read plainly, with a page of the hole either side. */
        size_t span = bytes + 2 * 4096;
        ssize_t r = pread(fd, got, span, (off_t)(off - 4096));
        CHECK_EQ_INT(r, (long long)span);
        size_t d = first_diff(got + 4096, want, bytes);
        if (d != bytes)
          fprintf(stderr, "far write at %llu, %s, %s: first difference at %zu\n",
                  (unsigned long long)off, pm__file_io_name(ios[ii]), mem_name[m], d);
        CHECK_EQ_SIZE(d, bytes);
        bool zeros = true;
        for (size_t i = 0; i < 4096; i++) zeros &= got[i] == 0 && got[4096 + bytes + i] == 0;
        CHECK(zeros);
        /* And back through pinmem, into another buffer of the same kind, in the other mode. */
        buf_t back;
        buf_make(&back, (mem_t)m, bytes + 8192, 3);
        opts(&o, ios[1 - ii], 65536);
        pm_fence_t f = NULL;
        CHECK_OK(pm_file_read_async(fd, off - 4096, bytes + 8192, back.p, g_s, &o, &f));
        if (f) {
          CHECK_OK(pm_fence_wait(f));
          CHECK_OK(pm_fence_release(f));
        }
        unsigned char *h = buf_read(&back);
        CHECK_EQ_SIZE(first_diff(h, got, span), span);
        free(h);
        buf_free(&back);
        buf_free(&b);
        /* The file keeps its sparse size: no write moved its end. */
        CHECK_EQ_INT(lseek(fd, 0, SEEK_END), (long long)(6 * four));
        n++;
      }
  printf("  %d writes and reads past 4 GiB checked\n", n);
  free(want);
  free(got);
  close(fd);
  CHECK(unlink(path) == 0);
}

/* ---- errors --------------------------------------------------------------------------------- */

/* Callbacks: those of the current case (g_cb_count), and of the whole run against the calls that
 * succeeded with one (checked once at the end, so a second call of a callback is seen however
 * late it comes). Waits use a condition variable, not sleeps. */
static pthread_mutex_t g_cb_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cb_cv = PTHREAD_COND_INITIALIZER;
static atomic_int g_cb_total, g_cb_expected;
static atomic_int g_cb_count;
static atomic_int g_cb_status;
static void count_cb(void *arg, pm_status_t st) {
  (void)arg;
  atomic_store(&g_cb_status, st);
  pthread_mutex_lock(&g_cb_mu);
  atomic_fetch_add(&g_cb_count, 1);
  atomic_fetch_add(&g_cb_total, 1);
  pthread_cond_broadcast(&g_cb_cv);
  pthread_mutex_unlock(&g_cb_mu);
}

/* Wait until `counter` reaches want (at most `ms`); its value then. */
static int cb_wait(atomic_int *counter, int want, int ms) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += ms / 1000;
  dl.tv_nsec += (long)(ms % 1000) * 1000000;
  if (dl.tv_nsec >= 1000000000) {
    dl.tv_sec++;
    dl.tv_nsec -= 1000000000;
  }
  pthread_mutex_lock(&g_cb_mu);
  while (atomic_load(counter) < want)
    if (pthread_cond_timedwait(&g_cb_cv, &g_cb_mu, &dl) != 0) break;
  int v = atomic_load(counter);
  pthread_mutex_unlock(&g_cb_mu);
  return v;
}

static void inject_case(pm__fault_op_t op, int err, const char *spec, mem_t kind,
                        pm_file_io_t io, pm_status_t want, const char *text) {
  file_reset_size(3, 400000);
  size_t bytes = 300001;
  buf_t b;
  buf_make(&b, kind, bytes, 1);
  bool write = op == PM__FAULT_FILE_WRITE;
  if (write) buf_fill(&b, 99);
  pm__fault_reset();
  if (spec) {
    REQUIRE_OK(pm__fault_configure(spec));
  } else {
    REQUIRE_OK(pm__fault_file_errno(op, err));
    REQUIRE_OK(pm__fault_set(op, 3, 0));
  }
  pm_file_options_t o;
  opts(&o, io, 65536);
  o.callback = count_cb;
  atomic_store(&g_cb_count, 0);
  pm_fence_t f = NULL;
  pm_status_t st = write ? pm_file_write_async(g_fd, 777, bytes, b.p, g_s, &o, &f)
                         : pm_file_read_async(g_fd, 777, bytes, b.p, g_s, &o, &f);
  pm__fault_counts_t fc;
  pm__fault_counts(&fc);
  pm__fault_reset();
  CHECK(fc.injected[op] >= 1);
  if (want == PM_OK) {
    CHECK_OK(st);
    if (st == PM_OK) {
      atomic_fetch_add(&g_cb_expected, 1);
      CHECK_OK(pm_fence_wait(f));
      CHECK_OK(pm_fence_release(f));
      CHECK_EQ_INT(atomic_load(&g_cb_count), 1);
      unsigned char *want_bytes = malloc(bytes);
      REQUIRE(want_bytes != NULL);
      if (write) {
        pm_test_fill(want_bytes, bytes, 99);
        unsigned char *h = file_contents();
        CHECK_EQ_SIZE(first_diff(h + 777, want_bytes, bytes), bytes);
        free(h);
      } else {
        unsigned char *h = buf_read(&b);
        CHECK_EQ_SIZE(first_diff(h, g_bytes + 777, bytes), bytes);
        free(h);
      }
      free(want_bytes);
    }
  } else {
    CHECK_ERR_MSG(st, want);
    CHECK(f == NULL);
    CHECK(has(text));
    CHECK(has(write ? "pwrite(fd " : "pread(fd "));
    CHECK(has("at offset"));
    CHECK(has("injected fault"));
    CHECK_OK(pm_stream_synchronize(g_s));
    CHECK_EQ_INT(atomic_load(&g_cb_count), 0); /* a failed call never calls back (and the
                                                   run's total at the end would show a late one) */
  }
  buf_free(&b);
}

/* A write past the end whose reservation fails as a filling disk's does (a part reserved, then
 * ENOSPC, EDQUOT or EFBIG), in both io modes: PM_ERR_IO naming fallocate and the fault, not a
 * byte written, and the file as long as it was (the part reserved given back); EINTR is
 * retried and the write goes on. */
static void reserve_faults(void) {
  pm_file_io_t ios[] = {PM_FILE_IO_BUFFERED, PM_FILE_IO_DIRECT};
  static const struct {
    const char *spec;
    const char *text;
  } cases[] = {{"file_reserve=1", "No space left"},
               {"file_reserve=1:EDQUOT", "quota"},
               {"file_reserve=1:EFBIG", "File too large"},
               {"file_reserve=1:EINTR", NULL}};
  const size_t old = 50001, bytes = 300001;
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
    for (int n = 0; n < 6; n++) {
      int m = n % 3;
      file_reset_size(11 + i, old);
      buf_t b;
      buf_make(&b, (mem_t)m, bytes, 3);
      buf_fill(&b, 12 + i);
      pm_file_options_t o;
      opts(&o, ios[n / 3], 65536);
      pm__fault_reset();
      REQUIRE_OK(pm__fault_configure(cases[i].spec));
      pm_status_t st = pm_file_write_async(g_fd, old - 777, bytes, b.p, g_s, &o, NULL);
      pm__fault_counts_t fc;
      pm__fault_counts(&fc);
      pm__fault_reset();
      CHECK_EQ_INT(fc.injected[PM__FAULT_FILE_RESERVE], 1);
      if (!cases[i].text) {
        CHECK_OK(st);
        CHECK_EQ_INT(lseek(g_fd, 0, SEEK_END), (long long)(old - 777 + bytes));
        unsigned char *want = malloc(bytes);
        REQUIRE(want != NULL);
        pm_test_fill(want, bytes, 12 + i);
        g_size = old - 777 + bytes;
        unsigned char *h = file_contents();
        CHECK_EQ_SIZE(first_diff(h + old - 777, want, bytes), bytes);
        free(h);
        free(want);
      } else {
        CHECK_ERR_MSG(st, PM_ERR_IO);
        CHECK(has("fallocate(fd"));
        CHECK(has(cases[i].text));
        CHECK(has("injected fault"));
        CHECK_EQ_INT(fc.calls[PM__FAULT_FILE_WRITE], 0); /* not a byte written */
        CHECK_EQ_INT(lseek(g_fd, 0, SEEK_END), (long long)old);
        unsigned char *h = file_contents();
        CHECK_EQ_SIZE(first_diff(h, g_bytes, old), old);
        free(h);
      }
      buf_free(&b);
    }
}

static void test_injected(void) {
  pm_file_io_t ios[] = {PM_FILE_IO_BUFFERED, PM_FILE_IO_DIRECT};
  for (int ii = 0; ii < 2; ii++)
    for (int m = 0; m < 3; m++) {
      pm_file_io_t io = ios[ii];
      mem_t k = (mem_t)m;
      inject_case(PM__FAULT_FILE_READ, EIO, NULL, k, io, PM_ERR_IO, "Input/output error");
      inject_case(PM__FAULT_FILE_WRITE, EIO, NULL, k, io, PM_ERR_IO, "Input/output error");
      inject_case(PM__FAULT_FILE_WRITE, ENOSPC, NULL, k, io, PM_ERR_IO, "No space left");
      inject_case(PM__FAULT_FILE_WRITE, 0, "file_write=2:ENOSPC", k, io, PM_ERR_IO,
                  "No space left");
      inject_case(PM__FAULT_FILE_READ, EINTR, NULL, k, io, PM_OK, NULL);
      inject_case(PM__FAULT_FILE_WRITE, EINTR, NULL, k, io, PM_OK, NULL);
      inject_case(PM__FAULT_FILE_READ, 0, "file_read=1+:short", k, io, PM_OK, NULL);
      inject_case(PM__FAULT_FILE_WRITE, 0, "file_write=1+:short", k, io, PM_OK, NULL);
    }
  /* A direct write's unaligned tail goes last (after every direct middle): its failure is the
   * call's, named with the tail's own offset. The write's calls are counted first. */
  {
    file_reset_size(3, 400000);
    buf_t b;
    buf_make(&b, MEM_DEVICE, 300001, 0);
    buf_fill(&b, 5);
    pm_file_options_t o;
    opts(&o, PM_FILE_IO_DIRECT, 65536);
    pm__fault_reset();
    REQUIRE_OK(pm__fault_set(PM__FAULT_FILE_WRITE, 0, 0));
    CHECK_OK(pm_file_write_async(g_fd, 777, 300001, b.p, g_s, &o, NULL));
    pm__fault_counts_t fc;
    pm__fault_counts(&fc);
    REQUIRE_OK(pm__fault_file_errno(PM__FAULT_FILE_WRITE, EIO));
    REQUIRE_OK(pm__fault_set(PM__FAULT_FILE_WRITE, fc.calls[PM__FAULT_FILE_WRITE], 0));
    CHECK_ERR_MSG(pm_file_write_async(g_fd, 777, 300001, b.p, g_s, &o, NULL), PM_ERR_IO);
    if (g_direct_ok) CHECK(has("1770 bytes at offset 299008"));
    CHECK(has("injected fault"));
    pm__fault_reset();
    buf_free(&b);
  }
  /* Specs that do not parse arm nothing. */
  CHECK_ST(pm__fault_configure("file_read=1:EWHAT"), PM_ERR_CONFIG);
  CHECK_ST(pm__fault_configure("memcpy=1:EIO"), PM_ERR_CONFIG);
  CHECK_ST(pm__fault_configure("file_reserve=1:short"), PM_ERR_CONFIG);
  CHECK_ST(pm__fault_file_errno(PM__FAULT_MEMCPY, EIO), PM_ERR_INVALID);
  CHECK_ST(pm__fault_file_errno(PM__FAULT_FILE_RESERVE, PM__FAULT_SHORT), PM_ERR_INVALID);
  pm__fault_reset();
  reserve_faults();
}

static void test_eof(void) {
  file_reset(4);
  pm_file_io_t ios[] = {PM_FILE_IO_BUFFERED, PM_FILE_IO_DIRECT};
  char want[64];
  snprintf(want, sizeof want, "ends at byte %zu", g_size);
  for (int ii = 0; ii < 2; ii++)
    for (int m = 0; m < 3; m++) {
      buf_t b;
      buf_make(&b, (mem_t)m, 200000, 0);
      pm_file_options_t o;
      opts(&o, ios[ii], 65536);
      pm_fence_t f = NULL;
      CHECK_ERR_MSG(pm_file_read_async(g_fd, g_size - 100000, 200000, b.p, g_s, &o, &f),
                    PM_ERR_IO);
      CHECK(f == NULL);
      CHECK(has(want));
      /* Wholly past the end. */
      CHECK_ERR_MSG(pm_file_read_async(g_fd, g_size + 4096, 10, b.p, g_s, &o, NULL), PM_ERR_IO);
      CHECK(has(want));
      /* Up to the last byte exactly: fine. */
      CHECK_OK(pm_file_read_async(g_fd, g_size - 200000, 200000, b.p, g_s, &o, NULL));
      CHECK_OK(pm_stream_synchronize(g_s));
      unsigned char *h = buf_read(&b);
      CHECK_EQ_SIZE(first_diff(h, g_bytes + g_size - 200000, 200000), 200000);
      free(h);
      buf_free(&b);
    }
}

static void test_bad_args(void) {
  file_reset(8);
  char buf[64];
  pm_fence_t f = NULL;
  CHECK_ERR_MSG(pm_file_read_async(-1, 0, 10, buf, g_s, NULL, &f), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_file_write_async(-3, 0, 10, buf, g_s, NULL, &f), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_file_read_async(g_fd, 0, 10, NULL, g_s, NULL, &f), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_file_write_async(g_fd, 0, 10, NULL, g_s, NULL, &f), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_file_read_async(g_fd, UINT64_MAX, 10, buf, g_s, NULL, &f), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_file_read_async(g_fd, (uint64_t)INT64_MAX - 5, 10, buf, g_s, NULL, &f),
                PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_file_write_async(g_fd, (uint64_t)INT64_MAX, 1, buf, g_s, NULL, &f),
                PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_file_read_async(g_fd, 0, SIZE_MAX, buf, g_s, NULL, &f), PM_ERR_INVALID);
  int closed = dup(g_fd);
  REQUIRE(closed >= 0);
  close(closed);
  CHECK_ERR_MSG(pm_file_read_async(closed, 0, 10, buf, g_s, NULL, &f), PM_ERR_INVALID);
  int ro = open(g_path, O_RDONLY | O_CLOEXEC);
  REQUIRE(ro >= 0);
  CHECK_ERR_MSG(pm_file_write_async(ro, 0, 10, buf, g_s, NULL, &f), PM_ERR_INVALID);
  CHECK(has("not open for writing"));
  close(ro);
  int ap = open(g_path, O_WRONLY | O_APPEND | O_CLOEXEC);
  REQUIRE(ap >= 0);
  CHECK_ERR_MSG(pm_file_write_async(ap, 0, 10, buf, g_s, NULL, &f), PM_ERR_INVALID);
  CHECK(has("O_APPEND"));
  CHECK_ERR_MSG(pm_file_read_async(ap, 0, 10, buf, g_s, NULL, &f), PM_ERR_INVALID);
  close(ap);
  pm_file_options_t o;
  pm_file_options_init(&o);
  o.io = (pm_file_io_t)7;
  CHECK_ERR_MSG(pm_file_read_async(g_fd, 0, 10, buf, g_s, &o, &f), PM_ERR_INVALID);
  pm_file_options_init(&o);
  o.threads = -2;
  CHECK_ERR_MSG(pm_file_write_async(g_fd, 0, 10, buf, g_s, &o, &f), PM_ERR_INVALID);
  CHECK(f == NULL);
  o.threads = 257; /* option file_threads' range; INT_MAX overflowed the slot count */
  CHECK_ERR_MSG(pm_file_read_async(g_fd, 0, 10, buf, g_s, &o, &f), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "0..256") != NULL);
  o.threads = INT_MAX;
  CHECK_ERR_MSG(pm_file_write_async(g_fd, 0, 10, buf, g_s, &o, &f), PM_ERR_INVALID);
  CHECK(f == NULL);
  pm_file_options_init(NULL); /* no crash */

  /* bytes 0: a completed fence, and the callback runs once. */
  pm_file_options_init(&o);
  o.callback = count_cb;
  atomic_store(&g_cb_count, 0);
  atomic_fetch_add(&g_cb_expected, 2);
  CHECK_OK(pm_file_read_async(g_fd, 0, 0, buf, g_s, &o, &f));
  CHECK_OK(pm_fence_wait(f));
  CHECK_OK(pm_fence_query(f));
  CHECK_OK(pm_fence_release(f));
  f = NULL;
  CHECK_OK(pm_file_write_async(g_fd, 12345, 0, buf, g_s, &o, &f));
  CHECK_OK(pm_fence_wait(f));
  CHECK_OK(pm_fence_release(f));
  CHECK_EQ_INT(atomic_load(&g_cb_count), 2);
  CHECK_EQ_INT(lseek(g_fd, 0, SEEK_END), (long long)g_size); /* nothing written */
}

/* ---- lists of ranges: pm_file_readv_async / pm_file_writev_async ------------------------------ */

/* The ranges of one case: back to back runs (one stream), gaps, odd sizes, ranges around unit
 * boundaries, a range of 0 bytes (NULL memory), in the caller's shuffled order; each range's
 * memory of its own kind (device, pinned, pageable in turn, pageable ones 5 bytes off). */
enum { NR = 10 };
static const struct {
  uint64_t off;
  size_t bytes;
} g_rl[NR] = {{70000, 65536 - 4464}, /* ends on a 64 KiB unit boundary, next follows */
              {131072, 1},
              {131073, 200001}, /* three back to back: one stream */
              {4096, 4096},     /* a gap before and after */
              {9000, 0},        /* skipped */
              {340000, 3},
              {340003, 70000},
              {500000, 65536 * 2}, /* whole units */
              {1, 4095},
              {700001, 12345}};
static const int g_order[NR] = {7, 2, 9, 0, 4, 3, 8, 5, 1, 6}; /* the order given */

static void ranges_make(buf_t *b, pm_file_range_t *r, uint64_t seed) {
  for (int i = 0; i < NR; i++) {
    int k = g_order[i];
    buf_make(&b[i], (mem_t)((i + (int)seed) % 3), g_rl[k].bytes ? g_rl[k].bytes : 1, 5);
    r[i] = (pm_file_range_t){.offset = g_rl[k].off, .bytes = g_rl[k].bytes,
                             .mem = g_rl[k].bytes ? b[i].p : NULL};
  }
}

static void ranges_free(buf_t *b) {
  for (int i = 0; i < NR; i++) buf_free(&b[i]);
}

static void readv_case(pm_file_io_t io, size_t chunk, uint64_t seed) {
  buf_t b[NR];
  pm_file_range_t r[NR];
  ranges_make(b, r, seed);
  for (int i = 0; i < NR; i++) buf_fill(&b[i], seed + (uint64_t)i); /* not the file's bytes */
  pm_file_options_t o;
  opts(&o, io, chunk);
  pm_fence_t f = NULL;
  pm_status_t st = pm_file_readv_async(g_fd, r, NR, g_s, &o, &f);
  CHECK_OK(st);
  if (st == PM_OK) {
    CHECK_OK(pm_fence_wait(f));
    CHECK_OK(pm_fence_release(f));
    if (io == PM_FILE_IO_DIRECT) CHECK((pm__file_note()[0] == '\0') == g_direct_ok);
    for (int i = 0; i < NR; i++) {
      unsigned char *h = buf_read(&b[i]);
      size_t d = first_diff(h, g_bytes + r[i].offset, r[i].bytes);
      if (d != r[i].bytes)
        fprintf(stderr, "readv %s chunk %zu: ranges[%d] (%zu bytes at %llu, %s): first "
                "difference at %zu\n", pm__file_io_name(io), chunk, i, r[i].bytes,
                (unsigned long long)r[i].offset, mem_name[b[i].kind], d);
      CHECK_EQ_SIZE(d, r[i].bytes);
      free(h);
    }
  }
  ranges_free(b);
}

static void writev_case(pm_file_io_t io, size_t chunk, uint64_t seed, bool past_end) {
  /* past_end: the file ends inside the ranges, so the call reserves the span first. */
  file_reset_size(seed + 500, past_end ? 300000 : 900000);
  buf_t b[NR];
  pm_file_range_t r[NR];
  ranges_make(b, r, seed);
  unsigned char *want = malloc(900000);
  REQUIRE(want != NULL);
  memcpy(want, g_bytes, g_size);
  if (past_end) memset(want + g_size, 0, 900000 - g_size); /* gaps past the old end: zeros */
  size_t end = 0;
  for (int i = 0; i < NR; i++) {
    buf_fill(&b[i], seed + 10 + (uint64_t)i);
    unsigned char *h = buf_read(&b[i]);
    memcpy(want + r[i].offset, h, r[i].bytes);
    free(h);
    if (r[i].offset + r[i].bytes > end) end = (size_t)(r[i].offset + r[i].bytes);
  }
  pm_file_options_t o;
  opts(&o, io, chunk);
  o.fsync = (seed & 1) != 0;
  /* Each range's CRC-32, in the caller's order (ranges of 0 bytes: 0), whatever units it
   * spans and shares with its neighbours. */
  uint32_t crcs[NR];
  for (int i = 0; i < NR; i++) crcs[i] = 0xDEADBEEFu;
  o.crc32 = crcs;
  pm_fence_t f = NULL;
  CHECK_OK(pm_file_writev_async(g_fd, r, NR, g_s, &o, &f));
  for (int i = 0; i < NR; i++) {
    uint32_t ref = crc32_ref(want + r[i].offset, r[i].bytes);
    if (crcs[i] != ref)
      fprintf(stderr, "writev %s chunk %zu: ranges[%d] (%zu bytes at %llu, %s): CRC %08x, "
              "wanted %08x\n", pm__file_io_name(io), chunk, i, r[i].bytes,
              (unsigned long long)r[i].offset, mem_name[b[i].kind], crcs[i], ref);
    CHECK_EQ_INT(crcs[i], ref);
  }
  if (f) {
    CHECK_OK(pm_fence_query(f));
    CHECK_OK(pm_fence_release(f));
  }
  if (past_end) g_size = end;
  unsigned char *h = file_contents();
  size_t d = first_diff(h, want, g_size);
  if (d != g_size)
    fprintf(stderr, "writev %s chunk %zu%s: first difference at byte %zu of the file\n",
            pm__file_io_name(io), chunk, past_end ? " past the end" : "", d);
  CHECK_EQ_SIZE(d, g_size);
  free(h);
  free(want);
  ranges_free(b);
}

static void test_ranges(void) {
  pm_file_io_t ios[] = {PM_FILE_IO_BUFFERED, PM_FILE_IO_DIRECT};
  size_t chunks[] = {65536, 16384, 0};
  file_reset(21);
  REQUIRE(g_size > 900000);
  int n = 0;
  for (int ii = 0; ii < 2; ii++)
    for (int ci = 0; ci < 3; ci++)
      for (uint64_t seed = 0; seed < 3; seed++, n++) readv_case(ios[ii], chunks[ci], seed);
  printf("  %d scattered reads checked\n", n);
  n = 0;
  for (int ii = 0; ii < 2; ii++)
    for (int ci = 0; ci < 3; ci++)
      for (uint64_t seed = 0; seed < 3; seed++, n++)
        writev_case(ios[ii], chunks[ci], seed, seed == 2);
  printf("  %d gathered writes checked\n", n);
  file_reset(22);

  /* Bad lists: refused before a byte moves (the destination keeps its bytes). */
  unsigned char a[8192], c[64];
  memset(a, 0x5A, sizeof a);
  pm_fence_t f = NULL;
  pm_file_range_t one = {.offset = 0, .bytes = 100, .mem = a};
  CHECK_ERR_MSG(pm_file_readv_async(g_fd, NULL, 1, g_s, NULL, &f), PM_ERR_INVALID);
  CHECK(has("ranges is NULL"));
  CHECK_ERR_MSG(pm_file_writev_async(g_fd, NULL, 2, g_s, NULL, &f), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_file_readv_async(-1, &one, 1, g_s, NULL, &f), PM_ERR_INVALID);
  pm_file_range_t nul[2] = {one, {.offset = 200, .bytes = 5, .mem = NULL}};
  CHECK_ERR_MSG(pm_file_readv_async(g_fd, nul, 2, g_s, NULL, &f), PM_ERR_INVALID);
  CHECK(has("ranges[1].mem is NULL"));
  CHECK_ERR_MSG(pm_file_writev_async(g_fd, nul, 2, g_s, NULL, &f), PM_ERR_INVALID);
  pm_file_range_t far[2] = {one, {.offset = (uint64_t)INT64_MAX - 2, .bytes = 5, .mem = c}};
  CHECK_ERR_MSG(pm_file_readv_async(g_fd, far, 2, g_s, NULL, &f), PM_ERR_INVALID);
  CHECK(has("past the largest file offset"));
  /* Overlaps in the file, whatever the order given. */
  pm_file_range_t ov[3] = {{.offset = 5000, .bytes = 10, .mem = c},
                           {.offset = 0, .bytes = 100, .mem = a},
                           {.offset = 99, .bytes = 2, .mem = a + 1000}};
  CHECK_ERR_MSG(pm_file_readv_async(g_fd, ov, 3, g_s, NULL, &f), PM_ERR_INVALID);
  CHECK(has("ranges[1] (bytes [0, 100) of the file) and ranges[2] ([99, 101)) overlap in the "
            "file"));
  CHECK_ERR_MSG(pm_file_writev_async(g_fd, ov, 3, g_s, NULL, &f), PM_ERR_INVALID);
  CHECK(has("overlap in the file"));
  /* Two reads into one byte of memory: refused; two writes from one byte: fine. */
  pm_file_range_t om[2] = {{.offset = 0, .bytes = 100, .mem = a},
                           {.offset = 4096, .bytes = 100, .mem = a + 99}};
  CHECK_ERR_MSG(pm_file_readv_async(g_fd, om, 2, g_s, NULL, &f), PM_ERR_INVALID);
  CHECK(has("overlap in memory"));
  CHECK(f == NULL);
  for (size_t i = 0; i < sizeof a; i++)
    if (a[i] != 0x5A) {
      CHECK(!"a refused read wrote its destination");
      break;
    }
  pm_test_fill(a, 200, 99);
  CHECK_OK(pm_file_writev_async(g_fd, om, 2, g_s, NULL, NULL));
  unsigned char back[100];
  CHECK_EQ_INT(pread(g_fd, back, 100, 4096), 100);
  CHECK_EQ_SIZE(first_diff(back, a + 99, 100), 100);
  file_reset(22);
  /* A file shorter than the ranges (truncated): PM_ERR_IO naming the range and where the file
   * ends, before a byte is read (no destination touched, device memory included). */
  memset(a, 0x5A, sizeof a);
  buf_t dev;
  buf_make(&dev, MEM_DEVICE, 4096, 0);
  CHECK_OK(pm_device_memset_async(dev.p, 0x33, 4096, g_s));
  CHECK_OK(pm_stream_synchronize(g_s));
  pm_file_range_t sh[3] = {{.offset = 0, .bytes = 4096, .mem = dev.p},
                           {.offset = g_size - 10, .bytes = 20, .mem = a},
                           {.offset = 8192, .bytes = 4096, .mem = a + 4096}};
  char want[160];
  snprintf(want, sizeof want, "ends at byte %zu (its size), before ranges[1] (bytes [%zu, %zu)",
           g_size, g_size - 10, g_size + 10);
  CHECK_ERR_MSG(pm_file_readv_async(g_fd, sh, 3, g_s, NULL, &f), PM_ERR_IO);
  CHECK(has(want));
  CHECK(has("nothing was read"));
  CHECK(f == NULL);
  bool kept = true;
  for (size_t i = 0; i < sizeof a; i++) kept &= a[i] == 0x5A;
  unsigned char *h = buf_read(&dev);
  for (size_t i = 0; i < 4096; i++) kept &= h[i] == 0x33;
  free(h);
  CHECK(kept);
  /* Up to the last byte exactly: fine. */
  sh[1].offset = g_size - 20;
  CHECK_OK(pm_file_readv_async(g_fd, sh, 3, g_s, NULL, NULL));
  CHECK_OK(pm_stream_synchronize(g_s));
  CHECK_EQ_SIZE(first_diff(a, g_bytes + g_size - 20, 20), 20);
  buf_free(&dev);
  /* An I/O error in the middle of a list: the call's, through the ring and in place. */
  for (int ii = 0; ii < 2; ii++) {
    buf_t b[NR];
    pm_file_range_t r[NR];
    ranges_make(b, r, (uint64_t)ii);
    for (int i = 0; i < NR; i++) buf_fill(&b[i], 40 + (uint64_t)i); /* the write's sources */
    pm_file_options_t o;
    opts(&o, ios[ii], 65536);
    pm__fault_reset();
    REQUIRE_OK(pm__fault_configure("file_read=4:EIO"));
    CHECK_ERR_MSG(pm_file_readv_async(g_fd, r, NR, g_s, &o, &f), PM_ERR_IO);
    CHECK(has("Input/output error"));
    REQUIRE_OK(pm__fault_configure("file_write=3:ENOSPC"));
    uint32_t crcs[NR];
    for (int i = 0; i < NR; i++) crcs[i] = 0xDEADBEEFu;
    o.crc32 = crcs;
    CHECK_ERR_MSG(pm_file_writev_async(g_fd, r, NR, g_s, &o, &f), PM_ERR_IO);
    CHECK(has("No space left"));
    for (int i = 0; i < NR; i++) CHECK_EQ_INT(crcs[i], 0xDEADBEEFu); /* set only on success */
    o.crc32 = NULL;
    pm__fault_reset();
    CHECK_OK(pm_stream_synchronize(g_s));
    ranges_free(b);
  }
  file_reset(22);
  /* count 0 (and only empty ranges): a completed fence, the callback once, nothing written. */
  pm_file_options_t o;
  pm_file_options_init(&o);
  o.callback = count_cb;
  atomic_store(&g_cb_count, 0);
  atomic_fetch_add(&g_cb_expected, 2);
  CHECK_OK(pm_file_readv_async(g_fd, NULL, 0, g_s, &o, &f));
  CHECK_OK(pm_fence_wait(f));
  CHECK_OK(pm_fence_release(f));
  pm_file_range_t empty = {.offset = (uint64_t)g_size + 100, .bytes = 0, .mem = NULL};
  CHECK_OK(pm_file_writev_async(g_fd, &empty, 1, g_s, &o, &f));
  CHECK_OK(pm_fence_release(f));
  CHECK_EQ_INT(cb_wait(&g_cb_count, 2, 200), 2);
  CHECK_EQ_INT(lseek(g_fd, 0, SEEK_END), (long long)g_size);
  /* CRCs are for writes: a read that asks for them is refused, nothing read. */
  uint32_t crc = 7;
  pm_file_options_init(&o);
  o.crc32 = &crc;
  memset(a, 0x5A, sizeof a);
  CHECK_ERR_MSG(pm_file_readv_async(g_fd, &one, 1, g_s, &o, &f), PM_ERR_INVALID);
  CHECK(has("options->crc32 is for writes"));
  CHECK_ERR_MSG(pm_file_read_async(g_fd, 0, 100, a, g_s, &o, &f), PM_ERR_INVALID);
  CHECK(a[0] == 0x5A && crc == 7);
  /* Only ranges of 0 bytes: every CRC is 0. */
  CHECK_OK(pm_file_writev_async(g_fd, &empty, 1, g_s, &o, NULL));
  CHECK_EQ_INT(crc, 0);
}

/* ---- fences, callbacks, ordering -------------------------------------------------------------- */

static void test_completion(void) {
  file_reset_size(5, 1100000);
  size_t bytes = 1000003;
  for (int m = 0; m < 3; m++) {
    buf_t b;
    buf_make(&b, (mem_t)m, bytes, 0);
    pm_file_options_t o;
    opts(&o, PM_FILE_IO_BUFFERED, 65536);
    o.callback = count_cb;
    o.callback_arg = &b;
    for (int rep = 0; rep < 3; rep++) {
      atomic_store(&g_cb_count, 0);
      atomic_store(&g_cb_status, -100);
      pm_fence_t f = NULL;
      /* Callback with and without a fence handle. */
      CHECK_OK(pm_file_read_async(g_fd, 11, bytes, b.p, g_s, &o, rep == 1 ? NULL : &f));
      if (f) {
        CHECK_OK(pm_fence_wait(f));
        CHECK_OK(pm_fence_release(f));
      }
      CHECK_OK(pm_stream_synchronize(g_s));
      atomic_fetch_add(&g_cb_expected, 1);
      CHECK_EQ_INT(cb_wait(&g_cb_count, 1, 10000), 1);
      CHECK_EQ_INT(atomic_load(&g_cb_status), PM_OK);
      atomic_store(&g_cb_count, 0);
      f = NULL;
      CHECK_OK(pm_file_write_async(g_fd, 5, bytes, b.p, g_s, &o, rep == 2 ? NULL : &f));
      if (f) {
        CHECK_OK(pm_fence_wait(f));
        CHECK_OK(pm_fence_release(f));
      }
      atomic_fetch_add(&g_cb_expected, 1);
      CHECK_EQ_INT(cb_wait(&g_cb_count, 1, 10000), 1);
      file_reset_size(5, 1100000);
    }
    buf_free(&b);
  }

  /* The stream's earlier work comes first. Device dst: a memset queued behind busy work must not
   * land over the file's bytes. Host dst: a D2H copy queued behind busy work must not either. */
  size_t n = 300000;
  buf_t d, h;
  buf_make(&d, MEM_DEVICE, n, 0);
  buf_make(&h, MEM_PINNED, n, 0);
  pm_file_options_t o;
  opts(&o, PM_FILE_IO_BUFFERED, 65536);
  CHECK_OK(pm_launch_busy(g_s, 0.05));
  CHECK_OK(pm_device_memset_async(d.p, 0x11, n, g_s));
  pm_fence_t f = NULL;
  CHECK_OK(pm_file_read_async(g_fd, 100, n, d.p, g_s, &o, &f));
  CHECK_OK(pm_fence_wait(f));
  CHECK_OK(pm_fence_release(f));
  unsigned char *got = buf_read(&d);
  CHECK_EQ_SIZE(first_diff(got, g_bytes + 100, n), n);
  free(got);
  CHECK_OK(pm_device_memset_async(d.p, 0x22, n, g_s));
  CHECK_OK(pm_launch_busy(g_s, 0.05));
  CHECK_OK(pm_memcpy_async(h.p, d.p, n, PM_COPY_D2H, g_s));
  CHECK_OK(pm_file_read_async(g_fd, 200, n, h.p, g_s, &o, NULL));
  CHECK_OK(pm_stream_synchronize(g_s));
  CHECK_EQ_SIZE(first_diff((unsigned char *)h.p, g_bytes + 200, n), n);
  /* Device src for a write: the memset queued before it is what gets written. */
  CHECK_OK(pm_launch_busy(g_s, 0.05));
  CHECK_OK(pm_device_memset_async(d.p, 0x5A, n, g_s));
  CHECK_OK(pm_file_write_async(g_fd, 0, n, d.p, g_s, &o, NULL));
  unsigned char *fc = file_contents();
  size_t bad = n;
  for (size_t i = 0; i < n; i++)
    if (fc[i] != 0x5A) {
      bad = i;
      break;
    }
  CHECK_EQ_SIZE(bad, n);
  free(fc);
  buf_free(&d);
  buf_free(&h);
  file_reset_size(5, 1100000);
}

/* ---- budget, refused O_DIRECT, descriptors ---------------------------------------------------- */

static void test_budget(void) {
  file_reset(6);
  size_t chunk = 65536;
  size_t slot = pm__size_class(chunk + 4096);
  pm_pool_config_t pc;
  pm_pool_config_init(&pc);
  pc.budget = 2 * slot;
  pc.exhaust_policy = PM_EXHAUST_FAIL;
  pm_pool_t *pool = NULL;
  REQUIRE_OK(pm_pool_create(&pc, &pool));
  buf_t d;
  size_t n = 1000001;
  buf_make(&d, MEM_DEVICE, n, 0);
  pm_file_options_t o;
  opts(&o, PM_FILE_IO_DIRECT, chunk);
  o.pool = pool;
  o.threads = 4; /* wants 6 slots; the budget allows 2 */
  pm_fence_t f = NULL;
  CHECK_OK(pm_file_read_async(g_fd, 3, n, d.p, g_s, &o, &f));
  CHECK_OK(pm_fence_wait(f));
  CHECK_OK(pm_fence_release(f));
  unsigned char *got = buf_read(&d);
  CHECK_EQ_SIZE(first_diff(got, g_bytes + 3, n), n);
  free(got);
  CHECK_OK(pm_file_write_async(g_fd, 4097, n, d.p, g_s, &o, NULL));
  unsigned char *fc = file_contents();
  CHECK_EQ_SIZE(first_diff(fc + 4097, g_bytes + 3, n), n);
  free(fc);
  pm_pool_stats_t ps;
  CHECK_OK(pm_pool_get_stats(pool, &ps));
  CHECK_LE_SIZE(ps.pinned_peak, pc.budget);
  CHECK(ps.allocs >= 2);
  CHECK_EQ_SIZE(ps.in_use_bytes, 0);
  /* A slot larger than the whole budget: a clear PM_ERR_BUDGET for device memory. */
  o.chunk = 4 * slot;
  CHECK_ERR_MSG(pm_file_read_async(g_fd, 0, n, d.p, g_s, &o, NULL), PM_ERR_BUDGET);
  CHECK(has("budget"));
  CHECK_OK(pm_stream_synchronize(g_s));
  /* Host memory O_DIRECT cannot reach in place (not aligned as the file is): its slots are only
   * memcpy scratch, so they are ordinary memory, pinning nothing, and the bytes move. */
  {
    unsigned char *raw = malloc(n + 2), *h = raw + 1; /* offset 3 in the file: not aligned */
    REQUIRE(raw);
    CHECK_OK(pm_pool_get_stats(pool, &ps));
    size_t peak0 = ps.pinned_peak;
    unsigned char *now = file_contents();
    CHECK_OK(pm_file_read_async(g_fd, 3, n, h, g_s, &o, NULL));
    CHECK_EQ_SIZE(first_diff(h, now + 3, n), n);
    free(now);
    CHECK(strstr(pm__file_note(), "cannot hold one") != NULL);
    CHECK(strstr(pm__file_note(), "slots of pageable memory") != NULL);
    memset(h, 0x5a, n);
    CHECK_OK(pm_file_write_async(g_fd, 4097, n, h, g_s, &o, NULL));
    unsigned char *fw = file_contents();
    bool same = true;
    for (size_t i = 0; i < n && same; i++) same = fw[4097 + i] == 0x5a;
    CHECK(same);
    free(fw);
    CHECK_OK(pm_pool_get_stats(pool, &ps));
    CHECK_EQ_SIZE(ps.pinned_peak, peak0);
    CHECK_EQ_SIZE(ps.in_use_bytes, 0);
    free(raw);
  }
  /* Other buffers hold the whole budget, which could hold a slot: the slots are ordinary
   * memory (DMAs from and to pageable memory) and every byte still moves. */
  o.chunk = chunk;
  void *held[2] = {NULL, NULL};
  REQUIRE_OK(pm_host_alloc(pool, chunk + 4096, PM_HOST_DEFAULT, &held[0]));
  REQUIRE_OK(pm_host_alloc(pool, chunk + 4096, PM_HOST_DEFAULT, &held[1]));
  CHECK_OK(pm_pool_get_stats(pool, &ps));
  CHECK_EQ_SIZE(ps.in_use_bytes, pc.budget);
  buf_free(&d);
  buf_make(&d, MEM_DEVICE, n, 0);
  unsigned char *was = file_contents();
  f = NULL;
  CHECK_OK(pm_file_read_async(g_fd, 5, n, d.p, g_s, &o, &f));
  CHECK_OK(pm_fence_wait(f));
  CHECK_OK(pm_fence_release(f));
  got = buf_read(&d);
  CHECK_EQ_SIZE(first_diff(got, was + 5, n), n);
  free(got);
  CHECK_OK(pm_file_write_async(g_fd, 8191, n, d.p, g_s, &o, NULL));
  fc = file_contents();
  CHECK_EQ_SIZE(first_diff(fc + 8191, was + 5, n), n);
  free(fc);
  free(was);
  CHECK_OK(pm_pool_get_stats(pool, &ps));
  CHECK_LE_SIZE(ps.pinned_peak, pc.budget);
  CHECK_OK(pm_host_free(held[0]));
  CHECK_OK(pm_host_free(held[1]));
  CHECK_OK(pm_stream_synchronize(g_s));
  buf_free(&d);
  CHECK_OK(pm_pool_destroy(pool));
}

static void test_refused_direct(void) {
  file_reset(7);
  atomic_store(&pm__io_refuse_direct, 1);
  for (int m = 0; m < 3; m++) {
    buf_t b;
    buf_make(&b, (mem_t)m, 100003, 0);
    pm_file_options_t o;
    opts(&o, PM_FILE_IO_DIRECT, 65536);
    CHECK_OK(pm_file_read_async(g_fd, 4093, 100003, b.p, g_s, &o, NULL));
    CHECK(strstr(pm__file_note(), "O_DIRECT refused") != NULL);
    CHECK_OK(pm_stream_synchronize(g_s));
    unsigned char *h = buf_read(&b);
    CHECK_EQ_SIZE(first_diff(h, g_bytes + 4093, 100003), 100003);
    free(h);
    buf_free(&b);
  }
  atomic_store(&pm__io_refuse_direct, 0);
  /* io=auto on a small range: buffered, no note. */
  buf_t b;
  buf_make(&b, MEM_DEVICE, 5000, 0);
  CHECK_OK(pm_file_read_async(g_fd, 1, 5000, b.p, g_s, NULL, NULL));
  CHECK(pm__file_note()[0] == '\0');
  CHECK_OK(pm_stream_synchronize(g_s));
  unsigned char *h = buf_read(&b);
  CHECK_EQ_SIZE(first_diff(h, g_bytes + 1, 5000), 5000);
  free(h);
  buf_free(&b);
}

/* A caller's descriptor opened with O_DIRECT: pread and pwrite of any offset, length and
 * address through it fail (EINVAL), so buffered transfers and a direct call's unaligned edges go
 * through a second descriptor of the file without it; they failed with "Invalid argument". Every
 * io mode, every kind of memory, odd offsets and lengths; the caller's flags stay as they were. */
/* A read into device memory that fails after queueing DMAs returns once they are done: it gives
 * no fence, so nothing else would tell the caller when dst stops changing (a caching allocator
 * could hand dst to someone else, whose bytes the late DMAs would overwrite). The stream is held
 * by a gate that an opener lets go when the call synchronizes it; the third of four preads
 * fails, after two units' DMAs were queued behind the gate. (A failed write from device memory
 * settles the same way, but a write waits for each unit's D2H DMA before its pwrite, so a
 * gate cannot hold one across the failure.) */
static void test_failed_read_settles_its_dmas(void) {
  const size_t unit = 65536, bytes = 4 * unit;
  file_reset_size(29, bytes);
  buf_t b;
  buf_make(&b, MEM_DEVICE, bytes, 0);
  pm_test_gate_t g;
  pm_test_gate_init(&g);
  REQUIRE_OK(pm_launch_host_func(g_s, pm_test_gate_wait, &g));
  pm__fault_reset();
  REQUIRE_OK(pm__fault_file_errno(PM__FAULT_FILE_READ, EIO));
  REQUIRE_OK(pm__fault_set(PM__FAULT_FILE_READ, 3, 0));
  REQUIRE_OK(pm__fault_set(PM__FAULT_STREAM_SYNC, 0, 0)); /* counted for the opener */
  pm_test_opener_t opener;
  int ops[] = {PM__FAULT_STREAM_SYNC};
  pm_test_opener_start(&opener, &g, ops, 1);
  pm_file_options_t o;
  opts(&o, PM_FILE_IO_BUFFERED, unit);
  o.threads = 1;
  CHECK_ST(pm_file_read_async(g_fd, 0, bytes, b.p, g_s, &o, NULL), PM_ERR_IO);
  CHECK(strstr(pm_last_error(), "pread") != NULL);
  /* Nothing of the call is left on the stream when it returns. */
  CHECK_ST(pm_stream_query(g_s), PM_OK);
  bool opened = pm_test_opener_stop(&opener);
  CHECK(opened); /* the call itself let the gate go */
  if (!opened) pm_test_gate_open(&g);
  pm__fault_reset();
  CHECK_OK(pm_stream_synchronize(g_s));
  pm_test_gate_destroy(&g);
  unsigned char *h = buf_read(&b); /* the two units read before the failure are in dst */
  CHECK_EQ_SIZE(first_diff(h, g_bytes, 2 * unit), 2 * unit);
  free(h);
  buf_free(&b);
}

static void test_caller_direct_fd(void) {
  if (!g_direct_ok) return; /* the filesystem refuses O_DIRECT: no such descriptor to test */
  file_reset(11);
  int dfd = open(g_path, O_RDWR | O_DIRECT | O_CLOEXEC);
  REQUIRE(dfd >= 0);
  pm_file_io_t ios[] = {PM_FILE_IO_BUFFERED, PM_FILE_IO_DIRECT, PM_FILE_IO_AUTO};
  size_t bytes = 100003;
  for (int i = 0; i < 3; i++)
    for (int m = 0; m < 3; m++) {
      buf_t b;
      buf_make(&b, (mem_t)m, bytes, 5);
      pm_file_options_t o;
      opts(&o, ios[i], 65536);
      uint64_t off = 4093 + 4096 * (uint64_t)m;
      CHECK_OK(pm_file_read_async(dfd, off, bytes, b.p, g_s, &o, NULL));
      CHECK_OK(pm_stream_synchronize(g_s));
      unsigned char *h = buf_read(&b);
      CHECK_EQ_SIZE(first_diff(h, g_bytes + off, bytes), bytes);
      free(h);
      uint64_t seed = 200 + 3 * (uint64_t)i + (uint64_t)m, woff = 200001;
      buf_fill(&b, seed);
      CHECK_OK(pm_file_write_async(dfd, woff, bytes, b.p, g_s, &o, NULL));
      pm_test_fill(g_bytes + woff, bytes, seed);
      h = file_contents();
      CHECK_EQ_SIZE(first_diff(h, g_bytes, g_size), g_size);
      free(h);
      buf_free(&b);
    }
  CHECK((fcntl(dfd, F_GETFL) & O_DIRECT) != 0);
  close(dfd);
}

/* ---- io=auto and the file_* options ---------------------------------------------------------- */

/* The test's own view: the fraction of the file's pages in the page cache (every page). */
static double resident_now(void) {
  long pg = sysconf(_SC_PAGESIZE);
  REQUIRE(pg > 0);
  void *m = mmap(NULL, g_size, PROT_READ, MAP_SHARED, g_fd, 0);
  REQUIRE(m != MAP_FAILED);
  size_t np = (g_size + (size_t)pg - 1) / (size_t)pg, in = 0;
  unsigned char *v = malloc(np);
  REQUIRE(v != NULL);
  REQUIRE(mincore(m, g_size, v) == 0);
  for (size_t i = 0; i < np; i++) in += v[i] & 1;
  free(v);
  munmap(m, g_size);
  return (double)in / (double)np;
}

/* Out of the page cache where the filesystem lets it go (tmpfs keeps every page). */
static void drop_cache(void) {
  REQUIRE(fdatasync(g_fd) == 0);
  REQUIRE(posix_fadvise(g_fd, 0, 0, POSIX_FADV_DONTNEED) == 0);
}

static pm_file_stats_t stats_now(void) {
  pm_file_stats_t s;
  REQUIRE_OK(pm_file_get_stats(&s));
  return s;
}

/* io=auto reads n bytes at off into a fresh buffer of `kind`; checks the bytes and returns how
 * many went through O_DIRECT (and the rest buffered: together exactly n). */
static uint64_t auto_read(mem_t kind, uint64_t off, size_t n) {
  buf_t b;
  buf_make(&b, kind, n, 0);
  pm_file_stats_t s0 = stats_now();
  CHECK_OK(pm_file_read_async(g_fd, off, n, b.p, g_s, NULL, NULL)); /* options NULL: auto */
  CHECK_OK(pm_stream_synchronize(g_s));
  pm_file_stats_t s1 = stats_now();
  uint64_t d = s1.read_direct - s0.read_direct, bu = s1.read_buffered - s0.read_buffered;
  CHECK_EQ_SIZE((size_t)(d + bu), n);
  unsigned char *h = buf_read(&b);
  CHECK_EQ_SIZE(first_diff(h, g_bytes + off, n), n);
  free(h);
  buf_free(&b);
  return d;
}

/* A reader's mark of [off, off + n): an OFD read lock on that range moved up by
 * PM__FILE_READER_MARKS, as file.c's reader_mark() takes it. */
static struct flock mark_of(short type, uint64_t off, size_t n) {
  struct flock l = {.l_type = type, .l_whence = SEEK_SET,
                    .l_start = (off_t)(PM__FILE_READER_MARKS + off), .l_len = (off_t)n};
  return l;
}

/* A cold auto read into device memory that went direct, held after its first units (its DMAs
 * queued behind a gate on its stream, so the ring's slots cannot be reused); another reader's
 * mark appears; the gate opens: the rest goes buffered, with the note, and every byte is right. */
typedef struct mid_read {
  void *dst;
  size_t n;
  pm_stream_t s;
  pm_status_t st;
  char note[256];
} mid_read_t;

static void *mid_read_main(void *arg) {
  mid_read_t *r = arg;
  pm_file_options_t o;
  pm_file_options_init(&o); /* io auto */
  o.chunk = 65536;
  o.threads = 2;
  r->st = pm_file_read_async(g_fd, 4093, r->n, r->dst, r->s, &o, NULL);
  snprintf(r->note, sizeof r->note, "%s", pm__file_note());
  return NULL;
}

static void reader_comes_midway(int other, size_t n) {
  drop_cache();
  mid_read_t r = {.n = n};
  REQUIRE_OK(pm_device_alloc(n, &r.dst));
  REQUIRE_OK(pm_stream_create(&r.s));
  pm_test_gate_t gate;
  pm_test_gate_init(&gate);
  REQUIRE_OK(pm__backend()->launch_host_func(r.s, pm_test_gate_wait, &gate));
  pm_file_stats_t s0 = stats_now();
  pthread_t t;
  REQUIRE(pthread_create(&t, NULL, mid_read_main, &r) == 0);
  /* Until its first units are read direct (then it waits for its slots). */
  for (int i = 0; i < 2000 && stats_now().read_direct == s0.read_direct; i++) pm_test_sleep_ms(5);
  struct flock mark = mark_of(F_RDLCK, 4093, n);
  REQUIRE(fcntl(other, F_OFD_SETLK, &mark) == 0);
  pm_test_sleep_ms(30); /* the read looks for other readers every 20 ms at most */
  pm_test_gate_open(&gate);
  REQUIRE(pthread_join(t, NULL) == 0);
  CHECK_OK(r.st);
  CHECK_OK(pm_stream_synchronize(r.s));
  pm_file_stats_t s1 = stats_now();
  uint64_t d = s1.read_direct - s0.read_direct, bu = s1.read_buffered - s0.read_buffered;
  CHECK_EQ_SIZE((size_t)(d + bu), n);
  CHECK(d >= 65536 - 4096); /* its first units */
  CHECK(bu >= n / 2);       /* the rest, after the mark came */
  CHECK(strstr(r.note, "came") != NULL);
  unsigned char *h = malloc(n);
  REQUIRE(h != NULL);
  REQUIRE_OK(pm_memcpy(h, r.dst, n, PM_COPY_D2H));
  CHECK_EQ_SIZE(first_diff(h, g_bytes + 4093, n), n);
  free(h);
  mark.l_type = F_UNLCK;
  REQUIRE(fcntl(other, F_OFD_SETLK, &mark) == 0);
  pm_test_gate_destroy(&gate);
  CHECK_OK(pm_stream_destroy(r.s));
  CHECK_OK(pm_device_free(r.dst));
}

/* Another process reading the file cold at the same moment (its mark, held here by a second
 * descriptor, on a range that overlaps half of this read's): auto reads buffered, saying why,
 * and drops its own mark when the call ends. A reader of other bytes of the file, and a POSIX
 * lock of this process on the whole file, are not: auto goes direct. */
static void reader_marks(mem_t kind, size_t n) {
  drop_cache();
  if (!g_direct_ok) return; /* auto reads buffered anyway; main reported O_DIRECT skipped */
  if (resident_now() >= 0.5) {
    pm_test_skip("reader marks (memory kind %d, %zu bytes): the page cache keeps the file in %s, "
                 "so auto reads buffered anyway",
                 (int)kind, n, g_dir);
    return;
  }
  int other = open(g_path, O_RDONLY | O_CLOEXEC);
  REQUIRE(other >= 0);
  struct flock mark = mark_of(F_RDLCK, 4093 + n / 2, n);
  if (fcntl(other, F_OFD_SETLK, &mark) != 0) {
    pm_test_skip("reader marks: no OFD locks in %s (%s)", g_dir, strerror(errno));
    close(other);
    return;
  }
  CHECK_EQ_SIZE((size_t)auto_read(kind, 4093, n), 0);
  CHECK(strstr(pm__file_note(), "another reader") != NULL);
  /* The call left no mark of its own behind: only `other`'s is there. */
  struct flock probe = mark_of(F_WRLCK, 0, 4 * n);
  int self = open(g_path, O_RDONLY | O_CLOEXEC);
  REQUIRE(self >= 0);
  mark.l_type = F_UNLCK;
  REQUIRE(fcntl(other, F_OFD_SETLK, &mark) == 0);
  REQUIRE(fcntl(self, F_OFD_GETLK, &probe) == 0);
  CHECK(probe.l_type == F_UNLCK);
  /* Without the other reader: direct again. */
  drop_cache();
  CHECK(auto_read(kind, 4093, n) >= n - 8192);
  CHECK(pm__file_note()[0] == '\0');
  /* A reader of the bytes after this read's shares nothing with it: direct. */
  mark = mark_of(F_RDLCK, 4093 + n, n);
  REQUIRE(fcntl(other, F_OFD_SETLK, &mark) == 0);
  drop_cache();
  CHECK(auto_read(kind, 4093, n) >= n - 8192);
  CHECK(pm__file_note()[0] == '\0');
  mark.l_type = F_UNLCK;
  REQUIRE(fcntl(other, F_OFD_SETLK, &mark) == 0);
  /* A POSIX read lock over the whole file (a program guarding it while it reads) covers the
   * marks' range but is no reader's mark. */
  struct flock whole = {.l_type = F_RDLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 0};
  REQUIRE(fcntl(other, F_SETLK, &whole) == 0);
  drop_cache();
  CHECK(auto_read(kind, 4093, n) >= n - 8192);
  whole.l_type = F_UNLCK;
  REQUIRE(fcntl(other, F_SETLK, &whole) == 0);
  close(self);
  if (kind == MEM_DEVICE) reader_comes_midway(other, n);
  close(other);
}

/* The read system calls of one io=`io` read of 1 MiB at offset 0 into `kind` memory, one
 * thread, default chunk (options NULL but for io and threads), the bytes checked. */
static uint64_t read_calls(pm_file_io_t io, mem_t kind) {
  size_t n = (size_t)1 << 20;
  buf_t b;
  buf_make(&b, kind, n, 0);
  pm_file_options_t o;
  pm_file_options_init(&o);
  o.io = io;
  o.threads = 1;
  pm__fault_reset();
  REQUIRE_OK(pm__fault_set(PM__FAULT_FILE_READ, 0, 0)); /* counts, injects nothing */
  CHECK_OK(pm_file_read_async(g_fd, 0, n, b.p, g_s, &o, NULL));
  CHECK_OK(pm_stream_synchronize(g_s));
  pm__fault_counts_t fc;
  pm__fault_counts(&fc);
  pm__fault_reset();
  unsigned char *h = buf_read(&b);
  CHECK_EQ_SIZE(first_diff(h, g_bytes, n), n);
  free(h);
  buf_free(&b);
  return fc.calls[PM__FAULT_FILE_READ];
}

/* A read takes its unit from the way its bytes go: file_chunk through the page cache,
 * file_direct_chunk through O_DIRECT (io direct, or auto choosing it); a read that finds
 * another reader's mark goes buffered throughout, in file_chunk units. 256 KiB and 64 KiB
 * units make 4 and 16 reads of 1 MiB. */
static void units_by_way(void) {
  file_reset(13); /* the writes before left other bytes */
  REQUIRE(g_size >= ((size_t)1 << 20));
  REQUIRE_OK(pm_option_set("file_chunk", "256K"));
  REQUIRE_OK(pm_option_set("file_direct_chunk", "64K"));
  for (int m = 0; m < 3; m++) {
    CHECK_EQ_SIZE((size_t)read_calls(PM_FILE_IO_BUFFERED, (mem_t)m), 4);
    CHECK_EQ_SIZE((size_t)read_calls(PM_FILE_IO_DIRECT, (mem_t)m), g_direct_ok ? 16 : 4);
    drop_cache();
    bool cold = resident_now() < 0.5 && g_direct_ok;
    CHECK_EQ_SIZE((size_t)read_calls(PM_FILE_IO_AUTO, (mem_t)m), cold ? 16 : 4);
    CHECK(resident_now() < 0.9 || !cold); /* direct: the pages did not come back */
    free(file_contents());
    CHECK_EQ_SIZE((size_t)read_calls(PM_FILE_IO_AUTO, (mem_t)m), 4); /* resident */
    if (!cold) {
      printf("  no cold direct read here: auto's unit by its mark not tried\n");
      continue;
    }
    int other = open(g_path, O_RDONLY | O_CLOEXEC);
    REQUIRE(other >= 0);
    struct flock mark = mark_of(F_RDLCK, 0, (size_t)1 << 20);
    if (fcntl(other, F_OFD_SETLK, &mark) == 0) {
      drop_cache();
      CHECK_EQ_SIZE((size_t)read_calls(PM_FILE_IO_AUTO, (mem_t)m), 4);
      CHECK(strstr(pm__file_note(), "another reader") != NULL);
    }
    close(other);
  }
  REQUIRE_OK(pm_option_set("file_chunk", "2M"));
  REQUIRE_OK(pm_option_set("file_direct_chunk", "1M"));
}

static void test_auto(void) {
  /* The rule at a smaller scale (the 64 MiB floor is a constant; the hook lowers it). */
  size_t amin = 256 * 1024, n = g_small ? (size_t)1 << 20 : (size_t)8 << 20;
  atomic_store(&pm__file_auto_min, amin);
  file_reset(11);
  REQUIRE(g_size >= n + 4093);
  for (int m = 0; m < 3; m++) {
    /* Not resident: direct (the unaligned head and tail buffered). Where the pages stay
     * (tmpfs), buffered; where the filesystem refuses O_DIRECT, buffered with the note. */
    drop_cache();
    double res = resident_now();
    uint64_t d = auto_read((mem_t)m, 4093, n);
    if (res < 0.5 && g_direct_ok) {
      CHECK(d >= n - 8192);
      CHECK(pm__file_note()[0] == '\0');
    } else if (res < 0.5) {
      CHECK_EQ_SIZE((size_t)d, 0);
      CHECK(strstr(pm__file_note(), "refused") != NULL);
    } else {
      pm_test_skip("auto's direct read of a cold file (memory kind %d): the page cache kept the "
                   "file (%.0f%% resident), so auto reads buffered (checked instead)",
                   m, 100 * res);
      CHECK_EQ_SIZE((size_t)d, 0);
      CHECK(pm__file_note()[0] == '\0');
    }
    /* Resident (the whole file read through the cache): buffered, no note. */
    free(file_contents());
    CHECK(resident_now() > 0.9);
    CHECK_EQ_SIZE((size_t)auto_read((mem_t)m, 4093, n), 0);
    CHECK(pm__file_note()[0] == '\0');
    /* Half resident, the first half: the sampled probe sees about half; either choice is
     * right, and the bytes are. */
    drop_cache();
    CHECK(posix_fadvise(g_fd, 0, (off_t)(n / 2), POSIX_FADV_WILLNEED) == 0);
    (void)auto_read((mem_t)m, 0, n);
    /* Below the floor: buffered whatever the cache holds. */
    drop_cache();
    CHECK_EQ_SIZE((size_t)auto_read((mem_t)m, 1, amin - 1), 0);
    reader_marks((mem_t)m, n);
  }

  /* A range that passes the end of the file (the probe maps only what the file holds) and one
   * wholly past it (nothing to probe): the read's own error, for both states of the cache. */
  char want[64];
  snprintf(want, sizeof want, "ends at byte %zu", g_size);
  for (int cold = 0; cold < 2; cold++)
    for (int m = 0; m < 3; m++) {
      if (cold) drop_cache();
      buf_t b;
      buf_make(&b, (mem_t)m, amin + 5000, 0);
      CHECK_ERR_MSG(pm_file_read_async(g_fd, g_size - 1000, amin + 5000, b.p, g_s, NULL, NULL),
                    PM_ERR_IO);
      CHECK(has(want));
      CHECK_ERR_MSG(pm_file_read_async(g_fd, g_size + 8192, amin, b.p, g_s, NULL, NULL),
                    PM_ERR_IO);
      CHECK(has(want));
      CHECK_OK(pm_stream_synchronize(g_s));
      buf_free(&b);
    }

  /* Writes: direct from the floor up (edges buffered, written last), buffered below it; every
   * byte checked by write_case, with and without fsync. */
  int seed = 300;
  uint64_t offs[] = {0, 4093, 8192};
  size_t sizes[] = {amin - 1, amin, amin + 4097, n + 5};
  for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++)
    for (size_t oi = 0; oi < sizeof offs / sizeof *offs; oi++)
      for (int m = 0; m < 3; m++) {
        if (g_small && sizes[si] == n + 5 && m != MEM_DEVICE) continue;
        pm_file_stats_t s0 = stats_now();
        write_case(sizes[si], offs[oi], PM_FILE_IO_AUTO, (mem_t)m, 65536, (uint64_t)seed++);
        pm_file_stats_t s1 = stats_now();
        uint64_t d = s1.write_direct - s0.write_direct, bu = s1.write_buffered - s0.write_buffered;
        CHECK_EQ_SIZE((size_t)(d + bu), sizes[si]);
        if (sizes[si] < amin) {
          CHECK_EQ_SIZE((size_t)d, 0);
        } else if (g_direct_ok) {
          size_t head = (4096 - offs[oi] % 4096) % 4096;
          size_t tail = (offs[oi] + sizes[si]) % 4096;
          CHECK_EQ_SIZE((size_t)bu, head + tail);
          CHECK(pm__file_note()[0] == '\0');
        } else {
          CHECK_EQ_SIZE((size_t)d, 0);
          CHECK(strstr(pm__file_note(), "refused") != NULL);
        }
      }
  units_by_way();
  atomic_store(&pm__file_auto_min, 0);
  file_reset(1);
}

/* The options file_chunk, file_direct_chunk, file_write_chunk, file_threads, file_slots and
 * file_part in every combination that matters: parts smaller than the slot (and not dividing
 * it), one slot, fewer slots than threads, a part as large as the slot (off), direct units
 * other than buffered ones, and 0 (= file_chunk). Reads byte for byte, both io modes. */
static void test_file_options(void) {
  file_reset(12);
  struct {
    const char *chunk, *threads, *slots, *part, *wchunk, *dchunk;
    size_t runit, wunit, dunit; /* the units buffered reads, writes and direct reads use */
  } set[] = {
      {"64K", "0", "0", "16K", "0", "0", 65536, 65536, 65536},
      {"64K", "2", "1", "20000", "48K", "20000", 65536, 49152, 20000},
      {"64K", "5", "2", "4K", "0", "128K", 65536, 65536, 131072},
      {"48K", "3", "0", "64K", "20000", "0", 49152, 20000, 49152},
      {"16M", "0", "0", "1M", "1M", "1M", (size_t)16 << 20, (size_t)1 << 20, (size_t)1 << 20},
  };
  size_t n = g_small ? ((size_t)1 << 20) + 3 : ((size_t)4 << 20) + 3;
  pm_file_io_t ios[] = {PM_FILE_IO_BUFFERED, PM_FILE_IO_DIRECT};
  for (size_t i = 0; i < sizeof set / sizeof *set; i++) {
    REQUIRE_OK(pm_option_set("file_chunk", set[i].chunk));
    REQUIRE_OK(pm_option_set("file_threads", set[i].threads));
    REQUIRE_OK(pm_option_set("file_slots", set[i].slots));
    REQUIRE_OK(pm_option_set("file_part", set[i].part));
    REQUIRE_OK(pm_option_set("file_write_chunk", set[i].wchunk));
    REQUIRE_OK(pm_option_set("file_direct_chunk", set[i].dchunk));
    CHECK_EQ_SIZE(pm__file_chunk(true, false), set[i].wunit);
    CHECK_EQ_SIZE(pm__file_chunk(true, true), set[i].wunit);
    CHECK_EQ_SIZE(pm__file_chunk(false, false), set[i].runit);
    CHECK_EQ_SIZE(pm__file_chunk(false, true), set[i].dunit);
    for (int ii = 0; ii < 2; ii++)
      for (int m = 0; m < 2; m++) {
        uint64_t off = i % 2 ? 4093 : 8192;
        file_reset(12 + i); /* write_case below leaves other bytes */
        buf_t b;
        buf_make(&b, (mem_t)m, n, 0);
        pm_file_options_t o;
        pm_file_options_init(&o); /* chunk and threads 0: the options */
        o.io = ios[ii];
        pm_fence_t f = NULL;
        CHECK_OK(pm_file_read_async(g_fd, off, n, b.p, g_s, &o, &f));
        if (f) {
          CHECK_OK(pm_fence_wait(f));
          CHECK_OK(pm_fence_release(f));
        }
        unsigned char *h = buf_read(&b);
        size_t d = first_diff(h, g_bytes + off, n);
        if (d != n)
          fprintf(stderr, "options %s/%s/%s/%s, %s, %s: first difference at %zu\n",
                  set[i].chunk, set[i].threads, set[i].slots, set[i].part,
                  pm__file_io_name(ios[ii]), mem_name[m], d);
        CHECK_EQ_SIZE(d, n);
        free(h);
        buf_free(&b);
        /* A write with the same options (file_part is for reads only). */
        write_case(n, off, ios[ii], (mem_t)m, 0, 40 + i);
      }
  }
  /* The ring's default size: threads + 2 slots, and for reads through the page cache up to 2
   * a thread while they hold at most 96 MiB; file_slots overrides every case. */
  REQUIRE_OK(pm_option_set("file_slots", "0"));
  CHECK_EQ_INT(pm__file_slots((size_t)4 << 20, 12, false, false), 24);
  CHECK_EQ_INT(pm__file_slots((size_t)8 << 20, 12, false, false), 14);
  CHECK_EQ_INT(pm__file_slots((size_t)5 << 20, 12, false, false), 20);
  CHECK_EQ_INT(pm__file_slots((size_t)64 << 10, 12, false, false), 24);
  CHECK_EQ_INT(pm__file_slots((size_t)4 << 20, 30, false, false), 32);
  CHECK_EQ_INT(pm__file_slots((size_t)4 << 20, 1, false, false), 3);
  CHECK_EQ_INT(pm__file_slots((size_t)1 << 20, 12, false, true), 14);
  CHECK_EQ_INT(pm__file_slots((size_t)1 << 20, 12, true, false), 14);
  CHECK_EQ_INT(pm__file_slots((size_t)1 << 20, 12, true, true), 14);
  REQUIRE_OK(pm_option_set("file_slots", "5"));
  CHECK_EQ_INT(pm__file_slots((size_t)4 << 20, 12, false, false), 5);
  CHECK_EQ_INT(pm__file_slots((size_t)1 << 20, 12, true, false), 5);
  CHECK_ST(pm_option_set("file_slots", "4097"), PM_ERR_CONFIG);
  CHECK_ST(pm_option_set("file_threads", "-1"), PM_ERR_CONFIG);
  CHECK_ST(pm_option_set("file_chunk", "0"), PM_ERR_CONFIG);
  CHECK_ST(pm_option_set("file_write_chunk", "lots"), PM_ERR_CONFIG);
  CHECK_ST(pm_option_set("file_direct_chunk", "-1M"), PM_ERR_CONFIG);
  REQUIRE_OK(pm_option_set("file_chunk", "2M"));
  REQUIRE_OK(pm_option_set("file_write_chunk", "1M"));
  REQUIRE_OK(pm_option_set("file_direct_chunk", "1M"));
  REQUIRE_OK(pm_option_set("file_threads", "0"));
  REQUIRE_OK(pm_option_set("file_slots", "0"));
  REQUIRE_OK(pm_option_set("file_part", "0"));
  file_reset(1);
}

/* Whether a file in dir takes an O_DIRECT write of one aligned block. */
static bool direct_works(const char *dir) {
  char path[600];
  snprintf(path, sizeof path, "%s/probe.bin", dir);
  int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
  bool ok = false;
  if (fd >= 0) {
    void *blk = NULL;
    if (posix_memalign(&blk, 4096, 4096) == 0) {
      memset(blk, 1, 4096);
      ok = pwrite(fd, blk, 4096, 0) == 4096;
      free(blk);
    }
    close(fd);
  }
  unlink(path);
  return ok;
}

/* The scratch folder: the first of TMPDIR (or /tmp), /var/tmp and the working folder whose
 * filesystem takes O_DIRECT (tmpfs before Linux 6.6 and some overlay filesystems refuse it), so
 * the direct cases run direct; else TMPDIR's, and the direct cases are reported skipped. */
static void pick_dir(void) {
  static const char *const others[] = {"/var/tmp", "."};
  REQUIRE(pm_test_tmpdir(g_dir, sizeof g_dir, "file"));
  g_direct_ok = direct_works(g_dir);
  for (size_t i = 0; !g_direct_ok && i < sizeof others / sizeof others[0]; i++) {
    char dir[512];
    int n = snprintf(dir, sizeof dir, "%s/pinmem-file.XXXXXX", others[i]);
    if (n <= 0 || (size_t)n >= sizeof dir || !mkdtemp(dir)) continue;
    if (direct_works(dir)) {
      pm_test_rmtree(g_dir);
      snprintf(g_dir, sizeof g_dir, "%s", dir);
      g_direct_ok = true;
    } else {
      pm_test_rmtree(dir);
    }
  }
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  g_small = pm_test_small() || PM_TSAN;
  pm_test_init();
  /* The CUDA driver opens its own descriptors with a device's first context, which pm_init
   * does not create: make it exist before counting, so only the test's own are compared. */
  {
    pm_stream_t warm;
    REQUIRE_OK(pm_stream_create(&warm));
    REQUIRE_OK(pm_stream_destroy(warm));
  }
  int fds0 = count_fds();
  pick_dir();
  snprintf(g_path, sizeof g_path, "%s/data.bin", g_dir);
  g_fd = open(g_path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  REQUIRE(g_fd >= 0);
  g_size_max = (g_small ? ((size_t)1 << 20) : ((size_t)16 << 20)) + 3 + 3 * 8192;
  /* test_completion's file is 1.1 MB whatever the mode. */
  g_alloc = PM__MAX(g_size_max, (size_t)2 << 20);
  g_bytes = malloc(g_alloc);
  REQUIRE(g_bytes != NULL);
  REQUIRE_OK(pm_stream_create(&g_s));
  printf("O_DIRECT in %s: %s\n", g_dir, g_direct_ok ? "works" : "refused");
  if (!g_direct_ok)
    pm_test_skip("the O_DIRECT cases run buffered (with pinmem's note): no scratch folder here "
                 "takes O_DIRECT (tried TMPDIR or /tmp, /var/tmp and the working folder)");
  g_falloc_ok = fallocate(g_fd, 0, 0, 4096) == 0;
  printf("fallocate in %s: %s\n", g_dir,
         g_falloc_ok ? "works" : "not supported (writes past the end are not reserved)");
  int fds1 = count_fds();

#define RUN(call)             \
  do {                        \
    printf("== %s\n", #call); \
    call;                     \
  } while (0)
  RUN(test_bad_args());
  RUN(test_roundtrips());
  RUN(test_extend());
  RUN(test_far_offsets());
  RUN(test_injected());
  RUN(test_eof());
  RUN(test_completion());
  RUN(test_budget());
  RUN(test_refused_direct());
  RUN(test_caller_direct_fd());
  RUN(test_failed_read_settles_its_dmas());
  RUN(test_auto());
  RUN(test_file_options());
  RUN(test_ranges());

  /* Every callback ran exactly once: none is missing, and none came twice (a late second call
   * would show within the wait). */
  CHECK_EQ_INT(cb_wait(&g_cb_total, atomic_load(&g_cb_expected) + 1, 200),
               atomic_load(&g_cb_expected));

  /* Every O_DIRECT descriptor was closed again (the stream and pool threads hold none). */
  CHECK_EQ_INT(count_fds(), fds1);
  CHECK_OK(pm_stream_destroy(g_s));
  close(g_fd);
  free(g_bytes);
  pm_test_rmtree(g_dir);
  CHECK_EQ_INT(count_fds(), fds0);
  CHECK_OK(pm_finalize());
  return pm_test_finish("test_file");
}
