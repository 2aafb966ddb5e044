/*
 * DESIGN: the dataset object shared by the kinds (npy files, token files, callbacks), the
 * callback kind itself, and file reading for the file kinds.
 *
 * A dataset is immutable after it was opened: its info, a read function and the kind's private
 * part. Reads come from many worker threads (of several loaders) at once, so they use only
 * pread, a read-only mapping or the caller's scratch buffer: no shared mutable state, no locks.
 * `users` counts the loaders that hold the dataset, so destroying it under a loader is an error
 * instead of a use after free.
 *
 * File reads by mode:
 * - pread: a loop of pread(2) straight into the destination (a place in a pinned slot).
 * - mmap: a read-only shared mapping of the whole file, memcpy from it. Touching a page of a file
 *   truncated after it was mapped raises SIGBUS, so each read first asks the file's size
 *   (fstat) and refuses with PM_ERR_IO what the file no longer holds. A truncation between that
 *   check and the memcpy still raises SIGBUS; pread has no such window, which is one reason
 *   pread is the default.
 * - O_DIRECT: the page cache is bypassed, so the offset, the length and the memory address must
 *   all be multiples of the logical block size (4 KiB covers every device). The part of a read
 *   whose destination has the same alignment as its file offset goes straight into the
 *   destination; the unaligned head and tail (or the whole read, when the two alignments differ)
 *   go through the thread's aligned scratch buffer. Where the filesystem refuses O_DIRECT (open
 *   or a probe read fails with EINVAL), the file uses buffered pread and the dataset's note says
 *   why; a later EINVAL falls back for that read.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

#define DIRECT_ALIGN ((size_t)4096)
#define DIRECT_CHUNK ((size_t)1 << 20) /* scratch buffer of one thread */
#define PREAD_MAX ((size_t)1 << 30)    /* Linux caps one read at 2 GiB - 4 KiB */

atomic_int pm__io_refuse_direct;

/* ---- files ------------------------------------------------------------------------------- */

void pm__scratch_free(pm__scratch_t *s) {
  free(s->buf);
  s->buf = NULL;
  s->cap = 0;
}

static pm_status_t scratch_get(pm__scratch_t *s) {
  if (s->buf) return PM_OK;
  void *p = NULL;
  if (posix_memalign(&p, DIRECT_ALIGN, DIRECT_CHUNK) != 0)
    return pm__set_error(PM_ERR_NOMEM, "O_DIRECT scratch buffer of %zu bytes", DIRECT_CHUNK);
  s->buf = p;
  s->cap = DIRECT_CHUNK;
  return PM_OK;
}

pm_status_t pm__file_open(pm__file_t *f, const char *path, pm_io_mode_t io, char *note,
                          size_t note_len) {
  memset(f, 0, sizeof *f);
  f->fd = f->dfd = -1;
  if ((unsigned)io > PM_IO_DIRECT)
    return pm__set_error(PM_ERR_INVALID, "unknown I/O mode %d", (int)io);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return pm__set_error(PM_ERR_IO, "open(%s): %s", path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int e = errno;
    close(fd);
    return pm__set_error(PM_ERR_IO, "fstat(%s): %s", path, strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return pm__set_error(PM_ERR_IO, "%s is not a regular file", path);
  }
  size_t plen = strlen(path) + 1;
  f->path = malloc(plen);
  if (!f->path) {
    close(fd);
    return pm__set_error(PM_ERR_NOMEM, "file name of %zu bytes", plen);
  }
  memcpy(f->path, path, plen);
  f->fd = fd;
  f->size = (uint64_t)st.st_size;
  f->io = PM_IO_PREAD;

  if (io == PM_IO_MMAP && f->size > 0) {
    if (f->size > (uint64_t)SIZE_MAX) {
      pm__file_close(f);
      return pm__set_error(PM_ERR_IO, "%s is too large to map", path);
    }
    void *m = mmap(NULL, (size_t)f->size, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
      int e = errno;
      pm__file_close(f);
      return pm__set_error(PM_ERR_IO, "mmap(%s, %llu bytes): %s", path,
                           (unsigned long long)st.st_size, strerror(e));
    }
    f->map = m;
    f->io = PM_IO_MMAP;
  } else if (io == PM_IO_MMAP) {
    f->io = PM_IO_MMAP; /* an empty file has nothing to map or read */
  } else if (io == PM_IO_DIRECT) {
    int e = 0;
    int dfd = atomic_load(&pm__io_refuse_direct) ? (errno = EINVAL, -1)
                                                 : open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
    const char *what = "open";
    if (dfd < 0) {
      e = errno;
    } else {
      /* Some filesystems accept the open and refuse the reads: probe one block. */
      void *probe = NULL;
      if (posix_memalign(&probe, DIRECT_ALIGN, DIRECT_ALIGN) != 0) {
        close(dfd);
        pm__file_close(f);
        return pm__set_error(PM_ERR_NOMEM, "O_DIRECT probe buffer");
      }
      ssize_t n;
      do n = pread(dfd, probe, DIRECT_ALIGN, 0);
      while (n < 0 && errno == EINTR);
      if (n < 0) {
        e = errno;
        what = "pread";
        close(dfd);
        dfd = -1;
      }
      free(probe);
    }
    if (dfd >= 0) {
      f->dfd = dfd;
      f->io = PM_IO_DIRECT;
    } else if (e == EINVAL || e == EOPNOTSUPP) {
      if (note && note_len && !note[0])
        snprintf(note, note_len,
                 "O_DIRECT refused by the filesystem of %.120s (%s: %s): buffered pread is used",
                 path, what, strerror(e));
    } else {
      pm__file_close(f);
      return pm__set_error(PM_ERR_IO, "%s(%s, O_DIRECT): %s", what, path, strerror(e));
    }
  }
  return PM_OK;
}

void pm__file_close(pm__file_t *f) {
  if (f->map) munmap((void *)f->map, (size_t)f->size);
  if (f->dfd >= 0) close(f->dfd);
  if (f->fd >= 0) close(f->fd);
  free(f->path);
  memset(f, 0, sizeof *f);
  f->fd = f->dfd = -1;
}

/* 0 on success, else errno (ENODATA: end of file before len bytes). */
static int pread_full(int fd, void *dst, size_t len, uint64_t off) {
  char *p = dst;
  while (len) {
    ssize_t n = pread(fd, p, PM__MIN(len, PREAD_MAX), (off_t)off);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return ENODATA;
    p += n;
    off += (uint64_t)n;
    len -= (size_t)n;
  }
  return 0;
}

static pm_status_t read_error(const pm__file_t *f, const char *how, uint64_t off, size_t len,
                              int e) {
  if (e == ENODATA)
    return pm__set_error(PM_ERR_IO,
                         "%s(%s, %zu bytes at %llu): end of file (the file has %llu bytes: "
                         "truncated?)",
                         how, f->path, len, (unsigned long long)off, (unsigned long long)f->size);
  return pm__set_error(PM_ERR_IO, "%s(%s, %zu bytes at %llu): %s", how, f->path, len,
                       (unsigned long long)off, strerror(e));
}

/* Bytes [off, off+len) through the scratch buffer with aligned O_DIRECT reads. */
static int direct_bounce(pm__file_t *f, uint64_t off, char *dst, size_t len, pm__scratch_t *s) {
  uint64_t end = off + len;
  uint64_t a = off & ~(uint64_t)(DIRECT_ALIGN - 1);
  while (a < end) {
    size_t want = (size_t)PM__MIN((uint64_t)s->cap, pm__align_up((size_t)(end - a), DIRECT_ALIGN));
    ssize_t n;
    do n = pread(f->dfd, s->buf, want, (off_t)a);
    while (n < 0 && errno == EINTR);
    if (n < 0) return errno;
    if (n == 0) return ENODATA;
    uint64_t lo = PM__MAX(a, off), hi = PM__MIN(a + (uint64_t)n, end);
    if (hi > lo) memcpy(dst + (lo - off), (char *)s->buf + (lo - a), (size_t)(hi - lo));
    if ((size_t)n % DIRECT_ALIGN && a + (uint64_t)n < end) return ENODATA; /* end of file */
    a += (uint64_t)n;
  }
  return 0;
}

static int direct_read(pm__file_t *f, uint64_t off, char *dst, size_t len, pm__scratch_t *s) {
  uint64_t end = off + len;
  uint64_t mid_lo = pm__align_up((size_t)off, DIRECT_ALIGN);
  uint64_t mid_hi = end & ~(uint64_t)(DIRECT_ALIGN - 1);
  bool congruent = (((uintptr_t)dst - (uintptr_t)off) & (DIRECT_ALIGN - 1)) == 0;
  if (!congruent || mid_hi <= mid_lo) return direct_bounce(f, off, dst, len, s);
  int e = 0;
  if (mid_lo > off) e = direct_bounce(f, off, dst, (size_t)(mid_lo - off), s);
  if (!e) e = pread_full(f->dfd, dst + (mid_lo - off), (size_t)(mid_hi - mid_lo), mid_lo);
  if (!e && end > mid_hi)
    e = direct_bounce(f, mid_hi, dst + (mid_hi - off), (size_t)(end - mid_hi), s);
  return e;
}

pm_status_t pm__file_read(pm__file_t *f, uint64_t off, void *dst, size_t len,
                          pm__scratch_t *scratch) {
  if (len == 0) return PM_OK;
  if (pm__fault_io(f->path))
    return pm__wrap_error(PM_ERR_IO, "reading %zu bytes at %llu", len, (unsigned long long)off);
  if (f->map) {
    if (off > f->size || len > f->size - off) return read_error(f, "read", off, len, ENODATA);
    /* Touching a mapped page past the file's current end raises SIGBUS, which would kill the
     * process: ask the file's size first and refuse a read the file no longer holds. A
     * truncation between this check and the copy still raises SIGBUS (the window is one
     * memcpy); io=pread has no such window. */
    struct stat stt;
    if (fstat(f->fd, &stt) != 0) return read_error(f, "fstat", off, len, errno);
    if ((uint64_t)stt.st_size < off + len)
      return pm__set_error(PM_ERR_IO,
                           "read(%s, %zu bytes at %llu): the file shrank to %llu bytes after it "
                           "was mapped (%llu bytes at open); reading the mapping would raise "
                           "SIGBUS",
                           f->path, len, (unsigned long long)off,
                           (unsigned long long)stt.st_size, (unsigned long long)f->size);
    memcpy(dst, f->map + off, len);
    return PM_OK;
  }
  if (f->dfd >= 0) {
    pm_status_t st = scratch_get(scratch);
    if (st != PM_OK) return st;
    int e = direct_read(f, off, dst, len, scratch);
    if (e == 0) return PM_OK;
    if (e != EINVAL) return read_error(f, "pread(O_DIRECT)", off, len, e);
    /* refused for this read after all: the buffered descriptor below */
  }
  int e = pread_full(f->fd, dst, len, off);
  return e ? read_error(f, "pread", off, len, e) : PM_OK;
}

/* ---- the dataset object ------------------------------------------------------------------ */

pm_status_t pm__dataset_alloc(int nfiles, pm_dataset_t **ds_out) {
  pm_dataset_t *ds = calloc(1, sizeof *ds);
  if (!ds) return pm__set_error(PM_ERR_NOMEM, "dataset object");
  if (nfiles > 0) {
    ds->files = calloc((size_t)nfiles, sizeof *ds->files);
    if (!ds->files) {
      free(ds);
      return pm__set_error(PM_ERR_NOMEM, "dataset file table for %d files", nfiles);
    }
    for (int i = 0; i < nfiles; i++) ds->files[i].fd = ds->files[i].dfd = -1;
  }
  ds->nfiles = nfiles;
  atomic_init(&ds->users, 0);
  /* Live from here, so that every pm_dataset_* call and the loader can check it (handles.c). */
  pm_status_t st = pm__handle_add(ds, PM__HANDLE_DATASET);
  if (st != PM_OK) {
    free(ds->files);
    free(ds);
    return st;
  }
  *ds_out = ds;
  return PM_OK;
}

void pm__dataset_free(pm_dataset_t *ds) {
  if (!ds) return;
  (void)pm__handle_remove(ds, PM__HANDLE_DATASET);
  if (ds->destroy_impl) ds->destroy_impl(ds);
  for (int i = 0; i < ds->nfiles; i++) pm__file_close(&ds->files[i]);
  free(ds->files);
  free(ds);
}

pm_status_t pm_dataset_destroy(pm_dataset_t *dataset) {
  if (pm__handle_foreign(dataset, PM__HANDLE_DATASET)) {
    /* The parent's dataset, in a forked child: forgotten (its callbacks belong to the parent's
     * objects and its loaders are the parent's too). */
    (void)pm__handle_remove(dataset, PM__HANDLE_DATASET);
    return PM_OK;
  }
  pm_status_t st = pm__handle_check(dataset, PM__HANDLE_DATASET, "pm_dataset_destroy");
  if (st != PM_OK) return st;
  int users = atomic_load(&dataset->users);
  if (users > 0)
    return pm__set_error(PM_ERR_BUSY,
                         "pm_dataset_destroy: %d user%s (loaders, zips, selects) still hold%s "
                         "the dataset: destroy %s first",
                         users, users == 1 ? "" : "s", users == 1 ? "s" : "",
                         users == 1 ? "it" : "them");
  pm__dataset_free(dataset);
  return PM_OK;
}

pm_status_t pm_dataset_get_info(const pm_dataset_t *dataset, pm_dataset_info_t *info_out) {
  pm_status_t st = pm__handle_check(dataset, PM__HANDLE_DATASET, "pm_dataset_get_info");
  if (st != PM_OK) return st;
  if (!dataset || !info_out)
    return pm__set_error(PM_ERR_INVALID, "pm_dataset_get_info: %s is NULL",
                         !dataset ? "dataset" : "info_out");
  *info_out = dataset->info;
  return PM_OK;
}

pm_status_t pm_dataset_read_sample(pm_dataset_t *dataset, uint64_t epoch, uint64_t index, void *dst,
                                   void *targets_dst) {
  pm_status_t st = pm__handle_check(dataset, PM__HANDLE_DATASET, "pm_dataset_read_sample");
  if (st != PM_OK) return st;
  if (!dataset || !dst)
    return pm__set_error(PM_ERR_INVALID, "pm_dataset_read_sample: %s is NULL",
                         !dataset ? "dataset" : "dst");
  if (index >= dataset->info.samples)
    return pm__set_error(PM_ERR_INVALID,
                         "pm_dataset_read_sample: index %llu out of range (%llu samples)",
                         (unsigned long long)index, (unsigned long long)dataset->info.samples);
  void *tmp = NULL;
  if (dataset->info.target_bytes && !targets_dst) {
    tmp = malloc(dataset->info.target_bytes);
    if (!tmp) return pm__set_error(PM_ERR_NOMEM, "pm_dataset_read_sample: targets buffer");
    targets_dst = tmp;
  }
  pm__scratch_t scratch = {NULL, 0};
  st = dataset->read(dataset, epoch, index, dst, targets_dst, &scratch);
  pm__scratch_free(&scratch);
  free(tmp);
  return st;
}

/* ---- callback datasets ------------------------------------------------------------------- */

static pm_status_t cb_read(pm_dataset_t *ds, uint64_t epoch, uint64_t index, void *dst, void *tdst,
                           pm__scratch_t *scratch) {
  (void)epoch;
  (void)tdst;
  (void)scratch;
  const pm_dataset_callbacks_t *cb = ds->impl;
  return pm__dataset_cb_status(cb->read(index, dst, cb->user), index);
}

pm_status_t pm__dataset_cb_status(int rc, uint64_t index) {
  if (rc == 0) return PM_OK;
  pm_status_t st = PM_ERR_IO;
  if (rc < 0 && strcmp(pm_status_name((pm_status_t)rc), "PM_STATUS_UNKNOWN") != 0)
    st = (pm_status_t)rc;
  return pm__set_error(st, "dataset read callback failed for sample %llu (returned %d)",
                       (unsigned long long)index, rc);
}

static void cb_destroy(pm_dataset_t *ds) {
  pm_dataset_callbacks_t *cb = ds->impl;
  if (cb && cb->destroy) cb->destroy(cb->user); /* not under any lock */
  free(cb);
}

static size_t dtype_itemsize(pm_dtype_t t) {
  switch (t) {
    case PM_DTYPE_BOOL:
    case PM_DTYPE_INT8:
    case PM_DTYPE_UINT8:
    case PM_DTYPE_OTHER:
      return 1;
    case PM_DTYPE_INT16:
    case PM_DTYPE_UINT16:
    case PM_DTYPE_FLOAT16:
      return 2;
    case PM_DTYPE_INT32:
    case PM_DTYPE_UINT32:
    case PM_DTYPE_FLOAT32:
      return 4;
    case PM_DTYPE_INT64:
    case PM_DTYPE_UINT64:
    case PM_DTYPE_FLOAT64:
    case PM_DTYPE_COMPLEX64:
      return 8;
    case PM_DTYPE_COMPLEX128:
      return 16;
  }
  return 0;
}

static const char *dtype_descr(pm_dtype_t t) {
  static const char *d[] = {"|V1", "|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4",
                            "<i8", "<u8", "<f2", "<f4", "<f8", "<c8", "<c16"};
  return (unsigned)t < sizeof d / sizeof d[0] ? d[t] : "|V1";
}

pm_status_t pm_dataset_create(const pm_dataset_callbacks_t *callbacks, pm_dataset_t **dataset_out) {
  const char *fn = "pm_dataset_create";
  if (!callbacks || !dataset_out)
    return pm__set_error(PM_ERR_INVALID, "%s: %s is NULL", fn,
                         !callbacks ? "callbacks" : "dataset_out");
  const pm_dataset_callbacks_t *c = callbacks;
  if (!c->read) return pm__set_error(PM_ERR_INVALID, "%s: read callback is NULL", fn);
  if (c->samples == 0) return pm__set_error(PM_ERR_INVALID, "%s: samples is 0", fn);
  if (c->sample_bytes == 0) return pm__set_error(PM_ERR_INVALID, "%s: sample_bytes is 0", fn);
  size_t item = dtype_itemsize(c->dtype);
  if (item == 0) return pm__set_error(PM_ERR_INVALID, "%s: unknown dtype %d", fn, (int)c->dtype);
  if (c->ndim < 0 || c->ndim > PM_DATASET_MAX_DIMS)
    return pm__set_error(PM_ERR_INVALID, "%s: ndim %d is not in 0..%d", fn, c->ndim,
                         PM_DATASET_MAX_DIMS);
  if (c->ndim == 0 && c->sample_bytes % item)
    return pm__set_error(PM_ERR_INVALID, "%s: sample_bytes %zu is not a multiple of %s's %zu", fn,
                         c->sample_bytes, pm_dtype_name(c->dtype), item);
  if (c->ndim > 0) {
    uint64_t prod = item;
    for (int i = 0; i < c->ndim; i++) {
      if (c->shape[i] && prod > UINT64_MAX / c->shape[i])
        return pm__set_error(PM_ERR_INVALID, "%s: shape overflows", fn);
      prod *= c->shape[i];
    }
    if (prod != c->sample_bytes)
      return pm__set_error(PM_ERR_INVALID,
                           "%s: shape and dtype give %llu bytes per sample, sample_bytes is %zu",
                           fn, (unsigned long long)prod, c->sample_bytes);
  }
  pm_dataset_t *ds = NULL;
  pm_status_t st = pm__dataset_alloc(0, &ds);
  if (st != PM_OK) return st;
  pm_dataset_callbacks_t *copy = malloc(sizeof *copy);
  if (!copy) {
    pm__dataset_free(ds);
    return pm__set_error(PM_ERR_NOMEM, "%s: callbacks copy", fn);
  }
  *copy = *c;
  ds->impl = copy;
  ds->read = cb_read;
  ds->destroy_impl = cb_destroy;
  pm_dataset_info_t *in = &ds->info;
  in->samples = c->samples;
  in->sample_bytes = c->sample_bytes;
  in->dtype = c->dtype;
  in->itemsize = item;
  if (c->ndim > 0) {
    in->ndim = c->ndim;
    memcpy(in->shape, c->shape, sizeof(uint64_t) * (size_t)c->ndim);
  } else {
    in->ndim = 1;
    in->shape[0] = c->sample_bytes / item;
  }
  snprintf(in->descr, sizeof in->descr, "%s", dtype_descr(c->dtype));
  in->io = PM_IO_PREAD;
  in->fields = 1;
  *dataset_out = ds;
  return PM_OK;
}

/* For dataset_fields.c: the element size and numpy text of a dtype code. */
size_t pm__dtype_itemsize(pm_dtype_t dtype) { return dtype_itemsize(dtype); }
const char *pm__dtype_descr(pm_dtype_t dtype) { return dtype_descr(dtype); }
