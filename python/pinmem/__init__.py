"""pinmem: pinned (page-locked) host memory and fast host<->GPU copies, for NumPy, PyTorch and
CuPy users.

    import numpy as np, pinmem
    buf = pinmem.empty((1024, 1024), "float32")      # pinned, from pinmem's pool
    a = np.asarray(buf)                               # the same memory, no copy
    x = pinmem.pin(np.ones(1 << 20))                  # pin an existing array in place
    done = pinmem.copy(dst, src, stream=None)         # asynchronous; done.wait()

Buffers export the buffer protocol and DLPack (numpy.asarray, numpy.from_dlpack,
torch.from_dlpack see the same memory); the memory stays valid while any consumer holds it.
Errors are pinmem.Error subclasses carrying .status (e.g. 'PM_ERR_BUDGET') and .message.
"""

import atexit as _atexit
from time import perf_counter as _perf_counter

from . import _pinmem
from ._pinmem import (  # noqa: F401  (re-exported)
    Buffer,
    Completion,
    DeviceBuffer,
    Error,
    PinnedBuffer,
    Stream,
    backend,
    backend_info,
    budget,
    current_device,
    device_count,
    device_info,
    get_option,
    init,
    options,
    parse_size,
    pointer_info,
    reserve,
    reset_peak,
    set_budget,
    set_device,
    set_option,
    stats,
    synchronize,
    trim,
)

# One exception class per pinmem status: PM_ERR_BUDGET -> BudgetError, PM_ERR_NO_DEVICE ->
# NoDeviceError, ... (all subclasses of Error; InvalidError and ConfigError are also ValueErrors,
# NomemError and DeviceMemoryError MemoryErrors, TimeoutError the built-in TimeoutError).
globals().update({k: v for k, v in vars(_pinmem).items()
                  if isinstance(v, type) and issubclass(v, Error)})
# The status codes by name (PM_OK, PM_ERR_BUDGET, ...): what Error.code holds.
globals().update({k: v for k, v in vars(_pinmem).items()
                  if k.startswith("PM_") and isinstance(v, int)})

__version__ = _pinmem.version

_atexit.register(_pinmem._shutdown)


def _dtype_name(dtype):
    """A dtype as text the extension understands: NumPy dtypes and scalar types, torch dtypes,
    Python's float/int/bool, or a string ('float32', '<f4', 'f')."""
    if isinstance(dtype, str):
        return dtype
    text = getattr(dtype, "str", None)  # numpy.dtype: '<f4'
    if isinstance(text, str):
        return text
    if type(dtype).__module__ == "torch":  # torch.float32 -> 'torch.float32'
        return str(dtype)
    try:
        import numpy
    except ImportError:
        numpy = None
    if numpy is not None:
        try:
            return numpy.dtype(dtype).str
        except TypeError:
            pass
    builtin = {float: "float64", int: "int64", bool: "bool", complex: "complex128"}
    if dtype in builtin:
        return builtin[dtype]
    raise TypeError(f"pinmem: cannot interpret {dtype!r} as a dtype")


def empty(shape, dtype="float64", *, mapped=False, write_combined=False, portable=False):
    """A PinnedBuffer of the given shape and dtype from pinmem's pool (contents undefined).

    dtype: a NumPy dtype or name ('float32', '<f4'), a torch dtype, or float/int/bool.
    mapped: also map it for the device (kernels read it directly); write_combined: fast for the
    device to read, very slow for the CPU to read; portable: pinned for every device context.
    """
    return _pinmem.empty(shape, _dtype_name(dtype), mapped=mapped,
                         write_combined=write_combined, portable=portable)


def empty_like(array, **kwargs):
    """A PinnedBuffer with the shape and dtype of `array` (NumPy array, torch tensor, pinmem
    buffer, or any buffer-protocol object such as bytearray or memoryview)."""
    dtype = getattr(array, "dtype", None)
    shape = getattr(array, "shape", None)
    if dtype is None or shape is None:
        try:
            view = memoryview(array)
        except TypeError:
            raise TypeError(f"pinmem.empty_like: {type(array).__name__} is not an array, tensor "
                            "or buffer-protocol object") from None
        with view:
            dtype, shape = view.format, view.shape
    return empty(tuple(shape), dtype, **kwargs)


def device_empty(shape, dtype="float64"):
    """A DeviceBuffer: device memory of the current device (host memory standing in for it on
    the host backend). It has no CPU view; fill it with pinmem.copy, read it through DLPack."""
    return _pinmem.device_empty(shape, _dtype_name(dtype))


def pin(obj, *, mapped=False, portable=False):
    """Pin the memory of `obj` in place and return a PinnedBuffer over it.

    obj: anything with the buffer protocol (NumPy array, bytearray, memoryview, bytes: read-only
    memory is registered read-only) or a CPU tensor with __dlpack__ (torch). The memory must be
    contiguous. It stays pinned, and obj stays alive, while the PinnedBuffer or any consumer of it
    exists; then it is unpinned. Copies from pinned memory run at the link's full speed and do not
    block the caller. A torch tensor is held through an alias of its own (tensor.detach()), so a
    later t.set_(...) leaves the pinned memory alive; t.resize_() to a larger size moves the
    storage's memory away from under the pin, and is not to be done while it is pinned.
    """
    if type(obj).__module__.startswith("torch") and hasattr(obj, "detach"):
        obj = obj.detach()
    return _pinmem.pin(obj, mapped=mapped, portable=portable)


def copy(dst, src, stream=None, *, nbytes=None, path=None):
    """Copy src into dst asynchronously on `stream`; return a Completion.

    dst, src: pinmem buffers, objects with the buffer protocol (NumPy arrays, pinned or not),
    DLPack producers (torch tensors, CPU or CUDA) or __cuda_array_interface__ objects; both
    C-contiguous. nbytes: bytes to copy (default: all of src; dst must be large enough).
    stream: None (the default stream), a pinmem.Stream, an int handle, a torch.cuda.Stream or a
    CuPy stream. path: None or 'auto' (the default: pinmem picks), 'direct' or 'staged'
    ('register', registering the source in place, is reserved and refused as unsupported).

    Pinned sources copy by DMA without blocking; pageable ones are staged through pinned
    buffers. Read a device-to-host result only after Completion.wait() (or done() is True); make
    another library's stream wait with Completion.wait_stream(stream). Both sides are kept alive
    until the copy is done, even if the Completion is dropped.
    """
    return _pinmem.copy(dst, src, stream, nbytes=nbytes, path=path)


# ------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------

import contextlib as _contextlib
import os as _os

from ._args import int_arg as _int_arg


def _file_error(fn, path, err):
    """err (a pinmem.Error) again, its message naming the file."""
    message = err.message
    if message.startswith(fn + ": "):
        message = message[len(fn) + 2:]
    try:
        _pinmem._raise(err.code, f"{fn}({path!r}): {message}")
    except Error as named:
        raise named from None


_READ = _os.O_RDONLY | _os.O_CLOEXEC
# Not O_TRUNC: write_file's extension cuts the file to the bytes written only once they are in
# it, so a call that fails before writing leaves an existing file as it was.
_WRITE = _os.O_WRONLY | _os.O_CREAT | _os.O_CLOEXEC


@_contextlib.contextmanager
def _opened(fn, path, flags, fd=None):
    """A descriptor of `path` for a call of fn: fd when given (left open), else `path` opened
    with flags and closed afterwards; a pinmem.Error inside raised again naming `path`. A file
    this call created (O_CREAT) is removed again when the call fails: a failed write leaves no
    empty file behind."""
    own = fd is None
    if not own:
        fd = _int_arg("fd", fd, 0, (1 << 31) - 1, fn=fn)
    created = False
    if own and flags & _os.O_CREAT:
        try:
            fd = _os.open(path, flags | _os.O_EXCL, 0o666)
            created = True
        except FileExistsError:
            pass
    if own and not created:
        fd = _os.open(path, flags, 0o666)
    try:
        yield fd
    except BaseException as e:
        if created:
            _remove_if_same(path, fd)
        if isinstance(e, Error):
            _file_error(fn, path, e)
        raise
    finally:
        if own:
            _os.close(fd)


def _remove_if_same(path, fd):
    """Remove `path` if it still names the file open as fd (not one put there since)."""
    try:
        a, b = _os.fstat(fd), _os.stat(path)
        if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
            _os.unlink(path)
    except OSError:
        pass


def read_file(path, dst, offset=0, *, nbytes=None, io="auto", stream=None, fd=None):
    """Read nbytes (default: the size of dst) at `offset` of the file at `path` into dst;
    return a Completion.

    dst: a pinmem buffer (pinned or DeviceBuffer), a NumPy array, a torch tensor (CPU or CUDA),
    anything with DLPack or the buffer protocol; C-contiguous. io: 'auto' (from 64 MiB up,
    O_DIRECT when most of the range is not in the page cache; docs/files.md), 'buffered' or
    'direct'. stream: as for copy(); the device writes are ordered on it. The call returns
    once every byte has been read from the file (the file is closed again); for device memory
    the DMAs may still be in flight until the Completion is done. A file shorter than offset +
    nbytes raises IoError naming where it ends.
    fd: an open, readable descriptor of the file at `path` to read through instead of opening
    `path` (left open; a file since removed or replaced there is still the one read); errors
    still name `path`.
    """
    path = _os.fspath(path)
    with _opened("read_file", path, _READ, fd) as f:
        return _pinmem._file_read(f, offset, nbytes, dst, stream, io)


def write_file(path, src, offset=0, *, nbytes=None, io="auto", stream=None, fsync=False,
               truncate=True):
    """Write nbytes (default: all) of src at `offset` of the file at `path`; return a Completion
    (already complete: the call returns once the bytes are in the file).

    The file is created if missing and, with truncate=True (default), holds the bytes written
    alone (zeros before `offset`), as if emptied first; it is cut to them once they are written,
    so a call that fails before writing leaves an existing file as it was (and a file it
    created is removed again); one that fails midway leaves it empty, never at its old length
    with part of the new bytes in it. With truncate=False the rest of an
    existing file stays. src: as read_file's dst (device memory is
    DMA'd into pinned bounce slots and written from there). fsync=True: on disk (fdatasync)
    before the call returns. io: 'auto' (O_DIRECT from 64 MiB up, the unaligned edges
    buffered), 'buffered' or 'direct'. stream: as for read_file.
    """
    path = _os.fspath(path)
    with _opened("write_file", path, _WRITE) as f:
        return _pinmem._file_write(f, offset, nbytes, src, stream, io, bool(fsync),
                                   bool(truncate))


def read_ranges(path, ranges, *, io="auto", stream=None, threads=0, chunk=None, fd=None):
    """Read many ranges of the file at `path`, each into its own destination, in one call.

    ranges: a sequence of (offset, dst) or (offset, dst, nbytes) (nbytes default: the size of
    dst); dst as read_file's (host or device memory, mixed freely). One pipeline of pinmem's
    threads and pinned slots reads them all, ranges back to back in the file as one stream
    (pm_file_readv_async; docs/files.md). Two ranges that overlap in the file or two
    destinations that overlap in memory raise InvalidError, a file shorter than a range raises
    IoError naming the range and where the file ends, before anything is read. Returns once
    every byte is in place (device writes included). io, stream: as read_file's. threads: the
    call's I/O threads, the caller included (0: the option file_threads, else copy_threads).
    chunk: the bytes of each read and of its pinned slot, a size ("8M") rounded up to 4 KiB
    (None: the options file_chunk and file_direct_chunk); larger units cost fewer system calls
    and interrupts per byte, smaller ones spread over more threads. fd: as read_file's.
    """
    path = _os.fspath(path)
    threads = _int_arg("threads", threads, 0, 256, fn="read_ranges")
    with _opened("read_ranges", path, _READ, fd) as f:
        _pinmem._file_readv(f, ranges, stream, io, threads, chunk)


def write_ranges(path, ranges, *, io="auto", stream=None, fsync=False, threads=0, chunk=None,
                 fd=None, crc32=False):
    """Write many ranges of the file at `path`, each from its own source, in one call.

    ranges: a sequence of (offset, src) or (offset, src, nbytes); src as write_file's. The file
    is created if missing and never emptied: the bytes between ranges stay as they were (zeros
    past its old end). Ranges back to back in the file go as one stream, bytes of several
    sources gathered into pinned slots (pm_file_writev_async; docs/files.md). Ranges that
    overlap in the file raise InvalidError before anything is written. Returns once every byte
    is in the file (fsync=True: on disk). io, stream: as write_file's; threads: as
    read_ranges'; chunk: the bytes of each write (None: the option file_write_chunk), as
    read_ranges'. A write in the background of CPU work takes less of the CPUs with a larger
    chunk and few threads (docs/files.md, "Lists of ranges"). fd: an open, writable descriptor
    of the file at `path` (not O_APPEND) to write through instead of opening it, left open;
    errors still name `path`. A writer that makes many calls on one file saves an open and a
    close each.
    crc32=True: return each range's CRC-32 (zlib.crc32's, as zip and torch.save record it), a
    list in the order of ranges (0 for a range of 0 bytes), computed by pinmem's threads on the
    bytes as they are written (device memory: on its copy in the pinned slot), so the copy, the
    CRC and the write take one call. Needs zlib's libz.so.1 (loaded at run time; PINMEM_ZLIB
    names another file): UnsupportedError without it. ISA-L computes them where found (several
    times zlib's speed): libisal.so.2, or the isal package (pip install isal); PINMEM_ISAL names
    another file, or 0 for zlib alone. crc32_implementation() says which. Else returns None.
    """
    path = _os.fspath(path)
    threads = _int_arg("threads", threads, 0, 256, fn="write_ranges")
    if crc32:
        _isal_from_package()
    with _opened("write_ranges", path, _WRITE, fd) as f:
        return _pinmem._file_writev(f, ranges, stream, io, bool(fsync), threads, chunk,
                                    bool(crc32))


_ISAL_ASKED = False


def _isal_from_package():
    """Once a process: where the isal package is installed and no ISA-L library was found,
    pinmem's CRC-32s use the crc32_gzip_refl its extension module exports (the same CRC as
    zlib's, checked before use)."""
    global _ISAL_ASKED
    if _ISAL_ASKED:
        return
    _ISAL_ASKED = True
    try:
        from isal import isal_zlib
    except ImportError:
        return
    _pinmem._crc32_use(isal_zlib.__file__)


def crc32_implementation():
    """What computes the CRC-32s of write_ranges(crc32=True): 'ISA-L (file)' or 'zlib (file)';
    None where zlib does not load (those writes raise UnsupportedError)."""
    _isal_from_package()
    return _pinmem._crc32_impl()


# ------------------------------------------------------------------------------------------
# Data loader (pinmem/loader.py)
# ------------------------------------------------------------------------------------------

from .loader import (  # noqa: E402,F401  (re-exported)
    Batch,
    Loader,
    NpyDataset,
    TokenDataset,
    get_worker_info,
)
from ._workers import WorkerError  # noqa: E402  (re-exported)
from . import safetensors  # noqa: E402,F401  (pinmem.safetensors; imports torch only when used)
# (pinmem.kv; imports torch only when used)
from .kv import KVBlockStore, kv_device_tensor  # noqa: E402,F401


def __getattr__(name):  # pinmem.torch loads on first use: importing pinmem never imports torch
    if name == "torch":
        import importlib
        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'pinmem' has no attribute {name!r}")
