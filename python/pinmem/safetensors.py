"""Safetensors files <-> tensors through pinned memory: load_file, save_file, save_file_async.

DESIGN. The format is the one the `safetensors` package writes: an 8-byte little-endian header
length N, N bytes of JSON (padded with spaces to a multiple of 8) mapping each tensor name to
{"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data that follows the
header) and an optional "__metadata__" of str -> str, then the data. Files either side writes
load on the other.

Loading validates the whole header first (every error names the file), then reads the data
region with one pinmem read into one buffer: device memory (torch.empty on the device; the read
goes through pinmem's pinned bounce slots and DMAs) or, for device="cpu", one pinned buffer. Each
tensor is a view of that buffer, so the buffer lives while any tensor does; a tensor whose
offset is not a multiple of its item size (files written by other tools may have them) is
copied into its own aligned tensor, as views must be aligned.

Saving snapshots every tensor into one pinned buffer laid out as the file (header, then the
tensors by falling item size so that each is aligned), by DMA for device tensors, then writes it
with pinmem writes and fsync to a temporary name beside the target, renames that over the target
and fsyncs the directory: a failed or interrupted save leaves the old file as it was and no
temporary behind. save_file writes a first piece as soon as the DMAs into it are done and the
rest after (_write_pieces), so the disk starts while the copies go on. The file a save replaces
is held open across the rename and freed afterwards by a background thread (_Releaser): freeing
a large file's blocks (with the discards of a filesystem mounted with `discard`) otherwise
happens inside the rename and the directory's fsync, and cost a 3 GiB save a third of its time
on an ext4 virtual disk. save_file_async returns once the snapshot is taken (the tensors may
change from then on) and writes on a background thread; the pinned snapshot goes back to the
pool as soon as the write is done.

torch is imported only when a torch tensor is made or given; NumPy arrays may be saved without
it (header checks need neither).
"""
import fcntl as _fcntl
import json as _json
import os as _os
import secrets as _secrets
import stat as _stat
import struct as _struct
import sys as _sys
import threading as _threading

import numpy as _np

import pinmem as _pm

__all__ = ["load_file", "save_file", "save_file_async", "SaveHandle"]

# The largest header accepted (the safetensors package refuses larger ones too).
MAX_HEADER = 100_000_000

# safetensors dtype -> (torch dtype attribute, item size, NumPy dtype or None). Only whole-byte
# types: views need them. A torch without one of these (older versions) refuses it by name.
_DTYPES = {
    "BOOL": ("bool", 1, "|b1"),
    "U8": ("uint8", 1, "|u1"),
    "I8": ("int8", 1, "|i1"),
    "F8_E4M3": ("float8_e4m3fn", 1, None),
    "F8_E5M2": ("float8_e5m2", 1, None),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1, None),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1, None),
    "F8_E8M0": ("float8_e8m0fnu", 1, None),
    "I16": ("int16", 2, "<i2"),
    "U16": ("uint16", 2, "<u2"),
    "F16": ("float16", 2, "<f2"),
    "BF16": ("bfloat16", 2, None),
    "I32": ("int32", 4, "<i4"),
    "U32": ("uint32", 4, "<u4"),
    "F32": ("float32", 4, "<f4"),
    "I64": ("int64", 8, "<i8"),
    "U64": ("uint64", 8, "<u8"),
    "F64": ("float64", 8, "<f8"),
    "C64": ("complex64", 8, "<c8"),
}
_NUMPY_NAMES = {np_name: name for name, (_, _, np_name) in _DTYPES.items() if np_name}


def _torch():
    try:
        import torch
    except ImportError:
        raise ImportError("pinmem.safetensors: torch is needed to make tensors "
                          "(pip install torch)") from None
    return torch


def _check_byteorder():
    if _sys.byteorder != "little":
        _pm._pinmem._raise(_pm.PM_ERR_UNSUPPORTED, "pinmem.safetensors: safetensors data is "
                           "little-endian and this machine is not")


def _format_error(path, text):
    _pm._pinmem._raise(_pm.PM_ERR_FORMAT, f"{path!r}: {text}")


def _is_count(x):
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _read_exactly(fd, n, offset, path):
    parts = []
    while n:
        b = _os.pread(fd, n, offset)
        if not b:
            _format_error(path, f"the file ends at byte {offset}, inside its header")
        parts.append(b)
        n -= len(b)
        offset += len(b)
    return b"".join(parts)


def _parse_header(fd, path):
    """(metadata, [(name, dtype, shape, begin, end)], data start, data bytes used) of the open
    safetensors file fd; FormatError naming `path` and the reason when it is malformed."""
    size = _os.fstat(fd).st_size
    if size < 8:
        _format_error(path, f"{size} bytes long: not a safetensors file (it starts with an "
                      "8-byte header length)")
    (n,) = _struct.unpack("<Q", _read_exactly(fd, 8, 0, path))
    if n > size - 8:
        _format_error(path, f"header length {n} runs past the end of the file ({size} bytes): "
                      "not a safetensors file, or truncated")
    if n > MAX_HEADER:
        _format_error(path, f"header length {n} is larger than the {MAX_HEADER} bytes allowed")
    try:
        header = _json.loads(_read_exactly(fd, n, 8, path).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        _format_error(path, f"the header is not valid JSON ({e})")
    if not isinstance(header, dict):
        _format_error(path, f"the header is JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
            isinstance(metadata, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        _format_error(path, "__metadata__ must be an object of strings to strings")
    data_len = size - 8 - n
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict):
            _format_error(path, f"tensor {name!r}: its entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _DTYPES:
            _format_error(path, f"tensor {name!r}: unknown dtype {dtype!r} (known: "
                          f"{', '.join(_DTYPES)})")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            _format_error(path, f"tensor {name!r}: shape {shape!r} is not a list of "
                          "non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_count(o) for o in offsets)):
            _format_error(path, f"tensor {name!r}: data_offsets {offsets!r} is not a pair of "
                          "non-negative integers")
        begin, end = offsets
        if begin > end:
            _format_error(path, f"tensor {name!r}: data_offsets [{begin}, {end}] end before "
                          "they begin")
        if end > data_len:
            _format_error(path, f"tensor {name!r}: data_offsets [{begin}, {end}] run past the "
                          f"end of the data ({data_len} bytes after the header)")
        numel = 1
        for d in shape:
            numel *= d
        need = numel * _DTYPES[dtype][1]
        if end - begin != need:
            _format_error(path, f"tensor {name!r}: {dtype} of shape {shape} takes {need} bytes "
                          f"but its data_offsets [{begin}, {end}] hold {end - begin}")
        entries.append((name, dtype, tuple(shape), begin, end))
    last = None
    for e in sorted((e for e in entries if e[4] > e[3]), key=lambda e: (e[3], e[4])):
        if last is not None and e[3] < last[4]:
            _format_error(path, f"tensors {last[0]!r} [{last[3]}, {last[4]}) and {e[0]!r} "
                          f"[{e[3]}, {e[4]}) overlap")
        last = e
    used = max((e[4] for e in entries), default=0)
    return metadata, entries, 8 + n, used


def _read(path, check, alloc):
    """Parse the file at path, run check(entries), then read its data region with one pinmem
    read into the buffer alloc(nbytes) returns as (target for the read, data, stream).
    Returns (entries, data); data is None when no tensor has bytes."""
    fd = _os.open(path, _os.O_RDONLY | _os.O_CLOEXEC)
    try:
        _, entries, start, used = _parse_header(fd, path)
        check(entries)
        if not used:
            return entries, None
        target, data, stream = alloc(used)
        try:
            done = _pm._pinmem._file_read(fd, start, used, target, stream, "auto")
        except _pm.Error as e:
            _pm._file_error("load_file", path, e)
        done.wait()
        return entries, data
    finally:
        _os.close(fd)


def load_file(path, device="cpu"):
    """A dict of torch tensors from the safetensors file at `path`, on `device` ('cpu',
    'cuda', 'cuda:1', a torch.device or an index).

    The header is checked first (FormatError naming the file and what is wrong: a bad length,
    JSON, dtype, shape, offsets out of range or overlapping); then the data is read with one
    pinmem read into one buffer (pinned memory for 'cpu', device memory otherwise) and each
    tensor is a view of it, so the buffer is freed when the last tensor is.
    """
    _check_byteorder()
    path = _os.fspath(path)
    dtypes = {}

    def check(entries):
        torch = _torch()
        for name, dtype, *_ in entries:
            t = getattr(torch, _DTYPES[dtype][0], None)
            if t is None:
                _pm._pinmem._raise(_pm.PM_ERR_UNSUPPORTED, f"load_file({path!r}): tensor "
                                   f"{name!r} is {dtype}, which torch {torch.__version__} lacks")
            dtypes[name] = t

    def alloc(n):
        torch = _torch()
        dev = torch.device(device)
        if dev.type != "cpu":
            data = torch.empty(n, dtype=torch.uint8, device=dev)
            return data, data, torch.cuda.current_stream(dev) if dev.type == "cuda" else None
        try:
            pinned = _pm.empty(n, "uint8")
            return pinned, torch.from_dlpack(pinned), None
        except _pm.BudgetError:  # no pinned memory to spare: pageable will do
            data = torch.empty(n, dtype=torch.uint8)
            return data, data, None

    entries, data = _read(path, check, alloc)
    torch = _torch()
    dev = torch.device(device)
    out = {}
    for name, dtype, shape, begin, end in entries:
        if begin == end:
            out[name] = torch.empty(shape, dtype=dtypes[name], device=dev)
            continue
        piece = data[begin:end]
        if begin % _DTYPES[dtype][1]:
            piece = piece.clone()  # a view would be misaligned
        out[name] = piece.view(dtypes[name]).view(shape)
    return out


# ---- saving --------------------------------------------------------------------------------

def _source(name, t):
    """(safetensors dtype, shape, bytes, a C-contiguous byte view or None when empty, stream)
    of one tensor or array to save."""
    torch = _sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        if t.layout != torch.strided:
            raise ValueError(f"pinmem.safetensors: tensor {name!r} is {t.layout}; save dense "
                             "tensors (.to_dense())")
        dtype = next((k for k, (attr, _, _) in _DTYPES.items()
                      if getattr(torch, attr, None) == t.dtype), None)
        if dtype is None:
            raise TypeError(f"pinmem.safetensors: tensor {name!r} has dtype {t.dtype}, which "
                            "safetensors cannot store")
        t = t.detach().resolve_conj().resolve_neg()  # lazy conjugate views: their real bytes
        if not t.is_contiguous():
            t = t.contiguous()
        n = t.numel() * _DTYPES[dtype][1]
        view = t.reshape(-1).view(torch.uint8) if n else None
        stream = torch.cuda.current_stream(t.device) if t.device.type == "cuda" else None
        return dtype, tuple(t.shape), n, view, stream
    if isinstance(t, _np.ndarray):
        a = t
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        dtype = _NUMPY_NAMES.get(a.dtype.str.replace("=", "<"))
        if dtype is None:
            raise TypeError(f"pinmem.safetensors: array {name!r} has dtype {t.dtype}, which "
                            "safetensors cannot store")
        flat = _np.ascontiguousarray(a).reshape(-1)  # (ascontiguousarray makes 0-d arrays 1-d)
        return dtype, t.shape, flat.nbytes, flat.view(_np.uint8) if flat.nbytes else None, None
    raise TypeError(f"pinmem.safetensors: {name!r} is {type(t).__name__}; expected a torch "
                    "tensor or a NumPy array")


def _snapshot(tensors, metadata, wait=True):
    """The whole file in one buffer (pinned when the budget allows): header and every tensor's
    bytes, the device ones copied by DMA; returns once every copy is done. wait=False: returns
    (buffer, copies) at once, copies being (begin, end, Completion) of the DMAs still running,
    in file order (the host ones are done)."""
    _check_byteorder()
    if not isinstance(tensors, dict):
        raise TypeError(f"pinmem.safetensors: expected a dict of names to tensors, not "
                        f"{type(tensors).__name__}")
    if metadata is not None and not (
            isinstance(metadata, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise TypeError("pinmem.safetensors: metadata must be a dict of str to str")
    items = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"pinmem.safetensors: tensor names are strings, not {name!r}")
        if name == "__metadata__":
            raise ValueError("pinmem.safetensors: '__metadata__' cannot name a tensor")
        items.append((name,) + _source(name, t))
    # Falling item size, then name (as the safetensors package orders them): every tensor starts
    # aligned to its item size, the header length being a multiple of 8.
    items.sort(key=lambda it: (-_DTYPES[it[1]][1], it[0]))
    header = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape, n, _, _ in items:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = _json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    total = start + offset
    try:
        buf = _pm.empty(total, "uint8")
    except _pm.BudgetError:  # no pinned memory to spare: slower copies, same file
        buf = _np.empty(total, _np.uint8)
    try:
        host = _np.asarray(buf)
        host[:8] = _np.frombuffer(_struct.pack("<Q", len(text)), _np.uint8)
        host[8:start] = _np.frombuffer(text, _np.uint8)
        pending = []
        mv = memoryview(buf)
        pos = start
        for name, dtype, shape, n, view, stream in items:
            if n == 0:
                continue
            if isinstance(view, _np.ndarray) or view.device.type == "cpu":
                host[pos:pos + n] = view if isinstance(view, _np.ndarray) else view.numpy()
            else:
                pending.append((pos, pos + n, _pm.copy(mv[pos:pos + n], view, stream)))
            pos += n
        if not wait:
            return buf, pending
        for _, _, c in pending:
            c.wait()
        del mv, pending, host
    except BaseException:
        _free(buf)
        raise
    return buf


def _free(buf):
    """Give a pinned snapshot back to the pool now (not whenever the last reference goes)."""
    if isinstance(buf, _pm.PinnedBuffer):
        try:
            buf.release()
        except _pm.Error:  # still in use somewhere: freed with its last user
            pass


class _Releaser:
    """Frees the files saves have replaced, off the caller's path.

    A save holds the file it replaces open across the rename (_hold), so the rename only
    unlinks it; the last close would free its blocks, which on ext4 means the extent tree
    walked and, on a filesystem mounted with `discard`, every freed range discarded in the next
    journal commit, a cost that grows with the file (about 0.1 s for 256 MiB and up to 1 s for
    3 GiB on the ext4 virtual disk of an H200 machine: bench/results). This thread takes the
    held descriptors. When this process's descriptor is the only open file of the unlinked
    inode anywhere (a write lease is granted only then), the file is truncated and fdatasync'd
    here, so the freeing and its journal commit happen now, in the background, and not inside
    the next save's fsync; otherwise (someone still reads or maps it) it is just closed and the
    kernel frees it with its last user. Best effort: any error only closes the descriptor."""

    def __init__(self):
        self._cv = _threading.Condition()
        self._fds = []
        self._busy = False
        self._thread = None

    def put(self, fd):
        with self._cv:
            self._fds.append(fd)
            if self._thread is None:
                self._thread = _threading.Thread(target=self._run, name="pinmem-release",
                                                 daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def wait_idle(self, timeout=None):
        """True once every held file is released (tests, benchmarks)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._fds and not self._busy, timeout)

    def _run(self):
        while True:
            with self._cv:
                self._busy = False
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._fds)
                fd = self._fds.pop(0)
                self._busy = True
            _release(fd)

    def _after_fork_in_child(self):
        # The thread is not in the child; its copies of the descriptors are closed, so the
        # child holds no replaced file.
        for fd in self._fds:
            try:
                _os.close(fd)
            except OSError:
                pass
        self.__init__()


_releaser = _Releaser()
if hasattr(_os, "register_at_fork"):
    _os.register_at_fork(after_in_child=_releaser._after_fork_in_child)


def _hold(path):
    """A descriptor on the regular file at path (read-write where allowed, so that _release may
    truncate it), or None. O_NONBLOCK: never wait on a FIFO or on another process's lease."""
    flags = _os.O_NONBLOCK | _os.O_CLOEXEC | _os.O_NOFOLLOW
    for mode in (_os.O_RDWR, _os.O_RDONLY):
        try:
            fd = _os.open(path, mode | flags)
        except OSError:
            continue
        try:
            if _stat.S_ISREG(_os.fstat(fd).st_mode):
                return fd
        except OSError:
            pass
        _os.close(fd)
        return None
    return None


def _release(fd):
    try:
        st = _os.fstat(fd)
        if (st.st_nlink == 0 and st.st_size > 0
                and _fcntl.fcntl(fd, _fcntl.F_GETFL) & _os.O_ACCMODE == _os.O_RDWR):
            try:  # granted only while no other open file of the inode exists, anywhere
                _fcntl.fcntl(fd, _fcntl.F_SETLEASE, _fcntl.F_WRLCK)
            except OSError:
                return
            try:
                _os.ftruncate(fd, 0)
                _os.fdatasync(fd)
            finally:
                _fcntl.fcntl(fd, _fcntl.F_SETLEASE, _fcntl.F_UNLCK)
    except OSError:
        pass
    finally:
        _os.close(fd)


# A save whose DMAs are still running writes its first piece (at least this much, and a 16th of
# the file) as soon as the DMAs into it are done, and the rest after: the disk starts while the
# device-to-host copies go on (they run 25 times faster than this disk writes, so they are all
# done by the time the first piece is).
FIRST_PIECE = 64 << 20


def _write_pieces(tmp, buf, copies):
    """buf into the file tmp, fsync'd: in one write, or in two when DMAs into buf still run
    (copies: (begin, end, Completion) in file order), the first starting once the DMAs into its
    bytes are done. The cut is on a 4 KiB boundary, so both pieces stay whole for O_DIRECT."""
    with memoryview(buf).cast("B") as mv:
        total = len(mv)
        cut = max(FIRST_PIECE, total // 16)
        cut -= cut % 4096
        if not copies or not 0 < cut < total:
            for _, _, c in copies:
                c.wait()
            _pm.write_file(tmp, buf, fsync=True).wait()
            return
        rest = []
        for begin, _, c in copies:
            if begin < cut:
                c.wait()
            else:
                rest.append(c)
        _pm.write_file(tmp, mv[:cut]).wait()
        for c in rest:
            c.wait()
        _pm.write_file(tmp, mv[cut:], cut, fsync=True, truncate=False).wait()


def _write_durable(buf, path, copies=()):
    """buf as the file at path, atomically: a temporary beside it, fsync, rename, fsync of the
    directory. On any failure the temporary is removed and path is as it was. The file replaced
    is freed in the background (_Releaser). copies: DMAs into buf still running (_write_pieces);
    all are waited for before this returns, whatever happens."""
    if _os.path.islink(path):
        path = _os.path.realpath(path)  # replace what the link names, not the link
    tmp = f"{path}.tmp-{_os.getpid()}-{_secrets.token_hex(4)}"
    old = None
    try:
        _write_pieces(tmp, buf, list(copies))
        try:  # keep an existing file's permissions
            _os.chmod(tmp, _stat.S_IMODE(_os.stat(path).st_mode))
        except FileNotFoundError:
            pass
        old = _hold(path)
        _os.replace(tmp, path)
    except BaseException:
        for _, _, c in copies:  # no DMA may still write into buf once the caller frees it
            try:
                c.wait()
            except BaseException:
                pass
        if old is not None:
            _os.close(old)  # still linked: closing frees nothing
        try:
            _os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:
        dfd = _os.open(_os.path.dirname(_os.path.abspath(path)), _os.O_RDONLY | _os.O_DIRECTORY)
        try:
            _os.fsync(dfd)
        finally:
            _os.close(dfd)
    finally:
        if old is not None:
            _releaser.put(old)


def save_file(tensors, path, metadata=None):
    """Write `tensors` (a dict of names to torch tensors, CPU or device, or NumPy arrays) to the
    safetensors file at `path`, with optional `metadata` (str -> str). The tensors are copied
    into one pinned buffer (DMA for device tensors), which is written and fsync'd under a
    temporary name that is then renamed over `path`: on any error `path` is left as it was."""
    path = _os.fspath(path)
    buf, copies = _snapshot(tensors, metadata, wait=False)
    try:
        _write_durable(buf, path, copies)
    finally:
        del copies
        _free(buf)


class SaveHandle:
    """The background write of save_file_async: wait(timeout=None) blocks until the file is
    durable and raises the save's error, done() says whether it has finished, exception(
    timeout=None) waits and returns the error (or None)."""

    def __init__(self, path):
        self.path = path
        self._finished = _threading.Event()
        self._error = None
        self._thread = None

    def _run(self, buf):
        try:
            _write_durable(buf, self.path)
        except BaseException as e:  # handed to whoever waits
            self._error = e
        finally:
            _free(buf)
            self._finished.set()

    def done(self):
        return self._finished.is_set()

    def exception(self, timeout=None):
        if not self._finished.wait(timeout):
            raise TimeoutError(f"pinmem.safetensors: saving {self.path!r} has not finished "
                               f"after {timeout} s")
        return self._error

    def wait(self, timeout=None):
        error = self.exception(timeout)
        self._thread.join()
        if error is not None:
            raise error

    def __repr__(self):
        state = ("pending" if not self.done() else "failed" if self._error is not None
                 else "done")
        return f"<pinmem.safetensors.SaveHandle {self.path!r} {state}>"


def save_file_async(tensors, path, metadata=None):
    """save_file, returning once the tensors are snapshotted into pinned memory (they may be
    changed from then on); the file is written, fsync'd and renamed over `path` on a background
    thread. Returns a SaveHandle: wait() until durable (raising the save's error), done(),
    exception(). The interpreter waits for a save in flight before it exits."""
    path = _os.fspath(path)
    buf = _snapshot(tensors, metadata)
    handle = SaveHandle(path)
    handle._thread = _threading.Thread(target=handle._run, args=(buf,), name="pinmem-save")
    del buf
    handle._thread.start()
    return handle
