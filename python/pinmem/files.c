/*
 * DESIGN: file <-> memory transfers for pinmem.read_file / pinmem.write_file (__init__.py opens
 * and closes the file; these bindings take its descriptor).
 *
 * The memory side is resolved exactly as copy resolves it (pinmem buffers, buffer-protocol
 * objects, DLPack producers such as torch tensors on the CPU or the device,
 * __cuda_array_interface__ objects) and held by the returned Completion until the transfer is
 * done: pm_file_read_async returns with every byte read from the file but the device DMAs
 * possibly still queued, so the destination must outlive the call. The C calls block on disk
 * I/O, so the GIL is released around them; the holder keeps the memory in place meanwhile.
 */
#include "_pinmem.h"
#include "internal.h" /* pm__file_wrote, pm__crc32_use, pm__crc32_impl */

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static int parse_io(PyObject *o, const char *fn, pm_file_io_t *out) {
  static const char *const names[] = {
#define PMPY_FILE_IO_NAME(name, value, text) text,
      PM_FILE_IO_MAP(PMPY_FILE_IO_NAME)
#undef PMPY_FILE_IO_NAME
  };
  if (o == NULL || o == Py_None) {
    *out = PM_FILE_IO_AUTO;
    return 0;
  }
  const char *s = PyUnicode_Check(o) ? PyUnicode_AsUTF8(o) : NULL;
  for (int i = 0; s && i < (int)(sizeof names / sizeof names[0]); i++)
    if (!strcmp(s, names[i])) {
      *out = (pm_file_io_t)i;
      return 0;
    }
  if (!PyErr_Occurred())
    pmpy_raise_fmt(PM_ERR_INVALID, "%s: io must be 'auto', 'buffered' or 'direct'", fn);
  return -1;
}

static int parse_offset(PyObject *o, const char *fn, uint64_t *out) {
  /* As every integer argument (pinmem/_args.py): a bool is an int to Python but no offset
   * (offset=True read from byte 1), and a float names the argument rather than raising a bare
   * TypeError. */
  if (PyBool_Check(o)) {
    pmpy_raise_fmt(PM_ERR_INVALID, "%s: offset must be between 0 and 2**64 - 1, not %s", fn,
                   o == Py_True ? "True" : "False");
    return -1;
  }
  if (!PyIndex_Check(o)) {
    pmpy_raise_fmt(PM_ERR_INVALID, "%s: offset must be an integer, not %s", fn,
                   Py_TYPE(o)->tp_name);
    return -1;
  }
  PyObject *n = PyNumber_Index(o);
  if (!n) return -1;
  unsigned long long v = PyLong_AsUnsignedLongLong(n); /* OverflowError when negative */
  Py_DECREF(n);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) {
    PyErr_Clear();
    pmpy_raise_fmt(PM_ERR_INVALID, "%s: offset must be between 0 and 2**64 - 1", fn);
    return -1;
  }
  *out = (uint64_t)v;
  return 0;
}

/* write_file(truncate=True) once its bytes are in the file (pm_file_write_async returns with
 * every byte written): the file ends where they end, and what it held before `offset` reads as
 * zeros (a hole punched, else zeros written), as if it had been emptied first. OSError naming
 * the step when one fails, the file then emptied. */
static int cut_to_written(int fd, uint64_t offset, size_t n, off_t old_size, int fsync,
                          const char *fn) {
  const char *step = NULL;
  int err = 0;
  Py_BEGIN_ALLOW_THREADS;
  uint64_t stale = (uint64_t)old_size < offset ? (uint64_t)old_size : offset;
  if (stale > 0 &&
      fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, (off_t)stale) != 0) {
    static const char zeros[1 << 16];
    for (uint64_t at = 0; at < stale && !step;) {
      size_t k = stale - at < sizeof zeros ? (size_t)(stale - at) : sizeof zeros;
      ssize_t w = pwrite(fd, zeros, k, (off_t)at);
      if (w > 0)
        at += (uint64_t)w;
      else if (w < 0 && errno != EINTR)
        step = "zeroing the bytes before offset", err = errno;
    }
  }
  if (!step && ftruncate(fd, (off_t)(offset + n)) != 0) step = "ftruncate", err = errno;
  if (!step && fsync && fdatasync(fd) != 0) step = "fdatasync", err = errno;
  /* The file holds the new bytes between old ones: emptied, as a write failing midway leaves
   * it (file_transfer), rather than left to pass for the bytes asked for. */
  if (step) {
    int rc = ftruncate(fd, 0);
    (void)rc; /* at best: the step's error is the one raised */
  }
  Py_END_ALLOW_THREADS;
  if (!step) return 0;
  /* OSError(errno, text) picks the errno's subclass (PermissionError, ...); "N" fails cleanly
   * when the text could not be made. */
  PyObject *text = PyUnicode_FromFormat("%s: cutting the file to the bytes written (%s): %s", fn,
                                        step, strerror(err));
  PyObject *e = PyObject_CallFunction(PyExc_OSError, "iN", err, text);
  if (e) {
    PyErr_SetObject((PyObject *)Py_TYPE(e), e);
    Py_DECREF(e);
  }
  return -1;
}

/* Whether anything was written in [from, to) past a file's old end `from`: SEEK_DATA finds
 * written blocks, but the block holding `from` is data for the old bytes before it, so its part
 * past `from` is read and looked at (nonzero bytes; zeros written there read as the hole they
 * replace), through a second descriptor as write_file's is write-only. A filesystem without
 * SEEK_DATA says all is data, and a part that cannot be read counts as written: then the cut
 * spares the gap. */
static int gap_written(int fd, off_t from, uint64_t to, const struct stat *sb) {
  uint64_t blk =
      sb->st_blksize > 4096 && sb->st_blksize <= (1 << 20) ? (uint64_t)sb->st_blksize : 4096;
  uint64_t edge = ((uint64_t)from + blk - 1) / blk * blk;
  if (edge > to) edge = to;
  if (edge > (uint64_t)from) {
    size_t len = (size_t)(edge - (uint64_t)from);
    unsigned char *tail = malloc(len);
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    int rfd = tail ? open(path, O_RDONLY | O_CLOEXEC) : -1;
    ssize_t got = rfd >= 0 ? pread(rfd, tail, len, from) : -1;
    if (rfd >= 0) close(rfd);
    int written = got < 0;
    for (ssize_t i = 0; i < got && !written; i++) written = tail[i] != 0;
    free(tail);
    if (written) return 1;
  }
  if (edge >= to) return 0;
  off_t data = lseek(fd, (off_t)edge, SEEK_DATA);
  return data >= 0 && (uint64_t)data < to;
}

/* After a failed write_file, the file's length as it was (old_size, a regular file's), or with
 * `empty` (truncate, and the call had begun writing) none. What the call did not add itself is
 * never cut: another write of the file that completed meanwhile (a thread writing the next part
 * of the same file) would lose bytes it reported written. So nothing is cut once the file ends
 * past this call's range, and bytes past the old end in the gap before `offset` (which this
 * call never writes, and its reservation leaves a hole) are someone else's: the cut then stops
 * at `offset`. */
static void give_back(int fd, int empty, off_t old_size, uint64_t offset, size_t n) {
  struct stat sb;
  if (fstat(fd, &sb) != 0) return;
  off_t cut = old_size;
  if (empty) {
    cut = 0;
  } else if ((uint64_t)sb.st_size > offset + n) {
    return; /* another write has moved the end past this call's range */
  } else if ((uint64_t)old_size < offset && gap_written(fd, old_size, offset, &sb)) {
    cut = (off_t)offset;
  }
  if (sb.st_size > cut) {
    int rc = ftruncate(fd, cut);
    (void)rc; /* at best: the write's own error is the one raised */
  }
}

/* The shared body: resolve the memory, check nbytes against it, run the C call without the GIL,
 * hand back a Completion that holds the memory. The caller holds the stream (pmpy_stream_take)
 * around it. */
static PyObject *file_transfer(int write, int fd, PyObject *offset_obj, PyObject *nbytes_obj,
                               PyObject *mem, PyObject *stream_obj, pm_stream_t stream,
                               PyObject *io_obj, int fsync, int truncate) {
  const char *fn = write ? "write_file" : "read_file";
  const char *what = write ? "write_file: src" : "read_file: dst";
  pmpy_pending_sweep(0);
  if (fd < 0) return pmpy_raise_fmt(PM_ERR_INVALID, "%s: fd %d is not a file descriptor", fn, fd);
  uint64_t offset;
  pm_file_io_t io;
  if (parse_offset(offset_obj, fn, &offset) < 0 || parse_io(io_obj, fn, &io) < 0) return NULL;
  pmpy_holder_t h;
  void *ptr;
  size_t have, n;
  if (pmpy_resolve_side(mem, !write, stream, what, &h, &ptr, &have) < 0) return NULL;
  if (nbytes_obj == Py_None) {
    n = have;
  } else {
    if (pmpy_parse_size_obj(nbytes_obj, &n) < 0) goto fail;
    if (n > have) {
      pmpy_raise_fmt(PM_ERR_INVALID, "%s: nbytes=%zu but %s has only %zu bytes", fn, n,
                     write ? "src" : "dst", have);
      goto fail;
    }
  }
  if (offset > UINT64_MAX - n) {
    pmpy_raise_fmt(PM_ERR_INVALID, "%s: offset %llu + %zu bytes overflows", fn,
                   (unsigned long long)offset, n);
    goto fail;
  }
  if (h.buf && pmpy_buffer_order_before(h.buf, stream) < 0) goto fail;

  /* truncate: the file is to hold the written bytes alone (zeros before offset). It is cut to
   * that only once every byte is written: a call that fails (a bad offset, the pinned budget,
   * a full disk, EFBIG) leaves an existing file as it was, its length too. Only a regular file
   * has a length (as O_TRUNC, which a device or a pipe ignores). */
  off_t old_size = -1;
  if (write) {
    struct stat sb;
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = fstat(fd, &sb);
    Py_END_ALLOW_THREADS;
    if (rc == 0 && S_ISREG(sb.st_mode)) old_size = sb.st_size;
  }
  pm_file_options_t opt;
  pm_file_options_init(&opt);
  opt.io = io;
  opt.fsync = fsync;
  pm_fence_t fence = NULL;
  pm_status_t st;
  Py_BEGIN_ALLOW_THREADS;
  st = write ? pm_file_write_async(fd, offset, n, ptr, stream, &opt, &fence)
             : pm_file_read_async(fd, offset, n, ptr, stream, &opt, &fence);
  Py_END_ALLOW_THREADS;
  if (st != PM_OK) {
    pmpy_raise_status(st);
    if (old_size >= 0) {
      /* A write that failed before its first byte (the budget, a full disk at the
       * reservation) gives the length back: an existing file ends where it ended. One that
       * failed while writing (an I/O error midway, fdatasync) has overwritten part of the old
       * bytes: with truncate the file is emptied, as O_TRUNC would have left it, where its old
       * length with part of the new bytes in it would pass for a whole file (a checkpoint
       * saved over one of the same size). Without truncate the range is undefined, as the C
       * call says. */
      Py_BEGIN_ALLOW_THREADS;
      give_back(fd, truncate && pm__file_wrote(), old_size, offset, n);
      Py_END_ALLOW_THREADS;
    }
    goto fail;
  }
  if (truncate && old_size >= 0 && cut_to_written(fd, offset, n, old_size, fsync, fn) < 0)
    goto fail;
  BufferObject *written = write ? NULL : h.buf;
  PyObject *c = pmpy_completion_new(fence, &h, stream_obj);
  if (!c) return NULL;
  /* A device buffer read into: DLPack consumers wait for this write (the Completion holds it). */
  if (written && pmpy_buffer_record_write(written, stream) < 0) {
    Py_DECREF(c);
    return NULL;
  }
  return c;

fail:
  pmpy_holder_release(&h);
  return NULL;
}

static PyObject *py_file_read(PyObject *mod, PyObject *args) {
  int fd;
  PyObject *offset, *nbytes, *dst, *stream, *io;
  if (!PyArg_ParseTuple(args, "iOOOOO:_file_read", &fd, &offset, &nbytes, &dst, &stream, &io))
    return NULL;
  pm_stream_t s;
  if (pmpy_stream_take(stream, &s) < 0) return NULL;
  PyObject *r = file_transfer(0, fd, offset, nbytes, dst, stream, s, io, 0, 0);
  pmpy_stream_drop(stream);
  return r;
}

static PyObject *py_file_write(PyObject *mod, PyObject *args) {
  int fd, fsync, truncate = 0;
  PyObject *offset, *nbytes, *src, *stream, *io;
  if (!PyArg_ParseTuple(args, "iOOOOOp|p:_file_write", &fd, &offset, &nbytes, &src, &stream, &io,
                        &fsync, &truncate))
    return NULL;
  pm_stream_t s;
  if (pmpy_stream_take(stream, &s) < 0) return NULL;
  PyObject *r = file_transfer(1, fd, offset, nbytes, src, stream, s, io, fsync, truncate);
  pmpy_stream_drop(stream);
  return r;
}

/* The list calls: ranges is a sequence of (offset, obj) or (offset, obj, nbytes); every obj is
 * resolved (and held) first, the C call runs without the GIL, and for device memory the call
 * waits for its DMAs before the holders let go: the list's objects are many, a Completion holds
 * two, so these calls return once every byte is in place. The caller holds the stream. crc
 * (writes): return each range's CRC-32 as written (pm_file_options_t.crc32), a list in the
 * ranges' order, computed by the call's threads: a caller gets the copy, the CRC and the write
 * of device memory with one release of the interpreter lock. */
static PyObject *file_transfer_list(int write, int fd, PyObject *ranges_obj, pm_stream_t stream,
                                    PyObject *io_obj, int fsync, int threads,
                                    PyObject *chunk_obj, int crc) {
  const char *fn = write ? "write_ranges" : "read_ranges";
  pmpy_pending_sweep(0);
  if (fd < 0) return pmpy_raise_fmt(PM_ERR_INVALID, "%s: fd %d is not a file descriptor", fn, fd);
  pm_file_io_t io;
  if (parse_io(io_obj, fn, &io) < 0) return NULL;
  if (threads < 0 || threads > 256)
    return pmpy_raise_fmt(PM_ERR_INVALID, "%s: threads must be 0 (the default) to 256, not %d",
                          fn, threads);
  /* chunk: the unit of each read or write and its bounce slot (None or 0: the options'). A
   * larger unit costs fewer system calls and interrupts per byte: a write in the background of
   * other work takes less of the CPUs it shares (docs/files.md). */
  size_t chunk = 0;
  if (chunk_obj && chunk_obj != Py_None) {
    if (pmpy_parse_size_obj(chunk_obj, &chunk) < 0) return NULL;
    if (chunk > ((size_t)1 << 30))
      return pmpy_raise_fmt(PM_ERR_INVALID, "%s: chunk must be at most 1 GiB, not %zu bytes",
                            fn, chunk);
  }
  /* Only an object that is no sequence at all is refused as such: an exception of its own (a
   * generator that raises, a __len__ that fails, KeyboardInterrupt) goes through as it is. */
  int iterable = PySequence_Check(ranges_obj) || Py_TYPE(ranges_obj)->tp_iter != NULL;
  PyObject *seq = pmpy_fast_tuple(ranges_obj, "ranges must be a sequence");
  if (!seq) {
    if (iterable || !PyErr_ExceptionMatches(PyExc_TypeError)) return NULL;
    PyErr_Clear();
    return pmpy_raise_fmt(PM_ERR_INVALID,
                          "%s: ranges must be a sequence of (offset, %s) or (offset, %s, nbytes)",
                          fn, write ? "src" : "dst", write ? "src" : "dst");
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  pmpy_holder_t *h = PyMem_Calloc((size_t)(n ? n : 1), sizeof *h);
  pm_file_range_t *r = PyMem_Calloc((size_t)(n ? n : 1), sizeof *r);
  uint32_t *crcs = crc ? PyMem_Calloc((size_t)(n ? n : 1), sizeof *crcs) : NULL;
  Py_ssize_t held = 0;
  PyObject *result = NULL;
  if (!h || !r || (crc && !crcs)) {
    PyErr_NoMemory();
    goto done;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
    Py_ssize_t k = PyTuple_Check(item) ? PyTuple_GET_SIZE(item) : -1;
    if (k != 2 && k != 3) {
      pmpy_raise_fmt(PM_ERR_INVALID,
                     "%s: ranges[%zd] must be a tuple (offset, %s) or (offset, %s, nbytes)", fn,
                     i, write ? "src" : "dst", write ? "src" : "dst");
      goto done;
    }
    char what[64];
    snprintf(what, sizeof what, "%s: ranges[%zd]", fn, i);
    if (parse_offset(PyTuple_GET_ITEM(item, 0), what, &r[i].offset) < 0) goto done;
    void *ptr;
    size_t have;
    if (pmpy_resolve_side(PyTuple_GET_ITEM(item, 1), !write, stream, what, &h[i], &ptr, &have) < 0)
      goto done;
    held = i + 1;
    r[i].mem = ptr;
    r[i].bytes = have;
    if (k == 3 && PyTuple_GET_ITEM(item, 2) != Py_None) {
      size_t want;
      if (pmpy_parse_size_obj(PyTuple_GET_ITEM(item, 2), &want) < 0) goto done;
      if (want > have) {
        pmpy_raise_fmt(PM_ERR_INVALID, "%s: nbytes=%zu but its %s has only %zu bytes", what,
                       want, write ? "src" : "dst", have);
        goto done;
      }
      r[i].bytes = want;
    }
    if (h[i].buf && pmpy_buffer_order_before(h[i].buf, stream) < 0) goto done;
  }
  pm_file_options_t opt;
  pm_file_options_init(&opt);
  opt.io = io;
  opt.fsync = fsync;
  opt.threads = threads;
  opt.chunk = chunk;
  opt.crc32 = crcs;
  pm_fence_t fence = NULL;
  pm_status_t st, wst = PM_OK;
  Py_BEGIN_ALLOW_THREADS;
  st = write ? pm_file_writev_async(fd, r, (size_t)n, stream, &opt, &fence)
             : pm_file_readv_async(fd, r, (size_t)n, stream, &opt, &fence);
  if (st == PM_OK && fence) {
    wst = pm_fence_wait(fence);
    pm_fence_release(fence);
  }
  Py_END_ALLOW_THREADS;
  if (st == PM_OK) st = wst;
  if (st != PM_OK) {
    pmpy_raise_status(st);
    goto done;
  }
  if (!crc) {
    result = Py_NewRef(Py_None);
    goto done;
  }
  result = PyList_New(n);
  for (Py_ssize_t i = 0; result && i < n; i++) {
    PyObject *v = PyLong_FromUnsignedLong(crcs[i]);
    if (!v) Py_CLEAR(result);
    else PyList_SET_ITEM(result, i, v);
  }
done:
  for (Py_ssize_t i = 0; i < held; i++) pmpy_holder_release(&h[i]);
  PyMem_Free(h);
  PyMem_Free(r);
  PyMem_Free(crcs);
  Py_DECREF(seq);
  return result;
}

static PyObject *py_file_readv(PyObject *mod, PyObject *args) {
  int fd, threads = 0;
  PyObject *ranges, *stream, *io, *chunk = Py_None;
  if (!PyArg_ParseTuple(args, "iOOO|iO:_file_readv", &fd, &ranges, &stream, &io, &threads,
                        &chunk))
    return NULL;
  pm_stream_t s;
  if (pmpy_stream_take(stream, &s) < 0) return NULL;
  PyObject *r = file_transfer_list(0, fd, ranges, s, io, 0, threads, chunk, 0);
  pmpy_stream_drop(stream);
  return r;
}

static PyObject *py_file_writev(PyObject *mod, PyObject *args) {
  int fd, fsync, threads = 0, crc = 0;
  PyObject *ranges, *stream, *io, *chunk = Py_None;
  if (!PyArg_ParseTuple(args, "iOOOp|iOp:_file_writev", &fd, &ranges, &stream, &io, &fsync,
                        &threads, &chunk, &crc))
    return NULL;
  pm_stream_t s;
  if (pmpy_stream_take(stream, &s) < 0) return NULL;
  PyObject *r = file_transfer_list(1, fd, ranges, s, io, fsync, threads, chunk, crc);
  pmpy_stream_drop(stream);
  return r;
}

/* _raise(code, detail): raise the exception of a status as the extension itself does (str(e),
 * .status, .code, .message), for errors the pure-Python parts find (a bad safetensors header). */
static PyObject *py_raise(PyObject *mod, PyObject *args) {
  int code;
  const char *detail;
  if (!PyArg_ParseTuple(args, "is:_raise", &code, &detail)) return NULL;
  if (code >= 0) return pmpy_raise_fmt(PM_ERR_INVALID, "_raise: %d is not an error status", code);
  return pmpy_raise_detail((pm_status_t)code, detail);
}

/* _file_stats() -> dict: pm_file_get_stats, the bytes file reads and writes moved through
 * O_DIRECT and through the page cache since the process started (what io='auto' chose). */
static PyObject *py_file_stats(PyObject *mod, PyObject *noargs) {
  (void)mod;
  (void)noargs;
  pm_file_stats_t st;
  pm_status_t rc = pm_file_get_stats(&st);
  if (rc != PM_OK) return pmpy_raise_detail(rc, pm_last_error());
  return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K}", "read_direct",
                       (unsigned long long)st.read_direct, "read_buffered",
                       (unsigned long long)st.read_buffered, "write_direct",
                       (unsigned long long)st.write_direct, "write_buffered",
                       (unsigned long long)st.write_buffered, "direct_refused",
                       (unsigned long long)st.direct_refused);
}

/* _crc32_use(path) -> bool: CRC-32s of writes with ISA-L's crc32_gzip_refl from path, a library
 * this process has loaded (the isal package's extension module exports it), where ISA-L is not in
 * use yet and PINMEM_ISAL allows it; whether ISA-L is in use afterwards. */
static PyObject *py_crc32_use(PyObject *mod, PyObject *args) {
  (void)mod;
  const char *path;
  if (!PyArg_ParseTuple(args, "s:_crc32_use", &path)) return NULL;
  bool ok;
  Py_BEGIN_ALLOW_THREADS ok = pm__crc32_use(path);
  Py_END_ALLOW_THREADS return PyBool_FromLong(ok);
}

/* _crc32_impl() -> str or None: what computes the CRC-32s of writes, "ISA-L (file)" or "zlib
 * (file)"; None where neither loads (crc32=True is refused then). */
static PyObject *py_crc32_impl(PyObject *mod, PyObject *noargs) {
  (void)mod;
  (void)noargs;
  const char *s = pm__crc32_impl();
  if (!s) Py_RETURN_NONE;
  return PyUnicode_DecodeFSDefault(s);
}

PyMethodDef pmpy_files_functions[] = {
    {"_file_read", py_file_read, METH_VARARGS,
     "_file_read(fd, offset, nbytes, dst, stream, io) -> Completion: read nbytes (None: all of "
     "dst) at offset of fd into dst; io 'auto', 'buffered' or 'direct'."},
    {"_file_write", py_file_write, METH_VARARGS,
     "_file_write(fd, offset, nbytes, src, stream, io, fsync, truncate=False) -> Completion: "
     "write nbytes (None: all of src) of src at offset of fd; fsync: on disk before it "
     "completes; truncate: empty the file first, once the arguments are checked."},
    {"_file_readv", py_file_readv, METH_VARARGS,
     "_file_readv(fd, ranges, stream, io, threads=0, chunk=None) -> None: read each (offset, "
     "dst[, nbytes]) of ranges in one pm_file_readv_async call; returns once every byte is in "
     "place."},
    {"_file_writev", py_file_writev, METH_VARARGS,
     "_file_writev(fd, ranges, stream, io, fsync, threads=0, chunk=None, crc32=False) -> None, "
     "or with crc32 each range's CRC-32 (a list): write each (offset, src[, nbytes]) of ranges "
     "in one pm_file_writev_async call."},
    {"_raise", py_raise, METH_VARARGS, "_raise(code, detail): raise the error of a status."},
    {"_crc32_use", py_crc32_use, METH_VARARGS,
     "_crc32_use(path) -> bool: write CRC-32s with ISA-L's crc32_gzip_refl from path (a library "
     "already loaded) where ISA-L is not in use yet; whether ISA-L is in use afterwards."},
    {"_crc32_impl", py_crc32_impl, METH_NOARGS,
     "_crc32_impl() -> str or None: what computes the CRC-32s of writes: 'ISA-L (file)' or "
     "'zlib (file)'; None where neither loads."},
    {"_file_stats", py_file_stats, METH_NOARGS,
     "_file_stats() -> dict: bytes read and written through O_DIRECT and through the page "
     "cache since the process started (read_direct, read_buffered, write_direct, "
     "write_buffered), and direct_refused: calls whose O_DIRECT the filesystem refused."},
    {0}};
