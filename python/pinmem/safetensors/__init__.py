"""Safetensors files <-> tensors through pinned memory: load_file, safe_open, save_file,
save_file_async; the package's modules in .torch and .numpy.

DESIGN. The format is the one the `safetensors` package writes: an 8-byte little-endian header
length N, N bytes of JSON (padded with spaces to a multiple of 8) mapping each tensor name to
{"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data that follows the
header) and an optional "__metadata__" of str -> str, then the data. Files either side writes
load on the other.

Loading validates the whole header first (every error names the file), then reads the data
region with one pinmem read into one buffer: device memory (torch.empty on the device; the read
goes through pinmem's pinned bounce slots and DMAs) or, for device="cpu", one pinned buffer. Each
tensor lies in that buffer, so the buffer lives while any tensor does, but each has a storage of
its own over just its bytes (_Pieces says why); a tensor whose offset is not a multiple of its
item size (files written by other tools may have them) is copied into its own aligned tensor.
safe_open reads one tensor, or the rows a slice needs, per call, into memory of its own.

Saving writes the header, then the tensors by falling item size so that each is aligned, to a
temporary name beside the target with pinmem writes and fsync, renames that over the target and
fsyncs the directory: a failed or interrupted save leaves the old file as it was and no
temporary behind. Where the bytes come from:
  * every tensor on one CUDA device, and half of its free memory holds them (stage "auto"; or
    stage "device"): they are copied on their stream into one scratch tensor on the device,
    which pinmem then writes through its ring of pinned slots (DMA into a slot, O_DIRECT from
    it), so a save needs the ring's slots and not a pinned copy of the whole file;
  * otherwise (stage "host", tensors on the CPU or on several devices, no room): one pinned
    buffer laid out as the file, device tensors DMA'd into it (on their stream, or from a
    scratch per device), written in place in two pieces, the first as soon as the DMAs into it
    are done (_write_pieces), so the disk starts while the copies go on.
The file a save replaces is held open across the rename and freed afterwards by a background
thread (_Releaser): freeing a large file's blocks (with the discards of a filesystem mounted
with `discard`) otherwise happens inside the rename and the directory's fsync, and cost a 3 GiB
save a third of its time on an ext4 virtual disk. save_file_async returns once the snapshot is
taken (the tensors may change from then on: a device scratch is a snapshot in stream order) and
writes on a background thread; the scratch or the pinned buffer is given back as soon as the
write is done.

What a load accepts is what the package accepts (test_safetensors.py compares generated headers
with its parser): by default (strict) the tensors must cover the data exactly, as the package
wants, so that no byte of a file is owned by no tensor. Errors are SafetensorError (_errors.py),
which is also the package's class and pinmem's. The modules torch.py and numpy.py mirror the
package's safetensors.torch and safetensors.numpy over these functions, with the package's
checks of what a save takes; this module's own save_file stays permissive (tied tensors each in
full, non-contiguous ones by their values).

torch is imported only when a torch tensor is made or given; NumPy arrays may be saved without
it (header checks need neither).
"""
import bisect as _bisect
import errno as _errno
import fcntl as _fcntl
import functools as _functools
import json as _json
import operator as _operator
import os as _os
import secrets as _secrets
import stat as _stat
import struct as _struct
import sys as _sys
import threading as _threading
import traceback as _traceback
import weakref as _weakref

import numpy as _np

import pinmem as _pm

from ._errors import (SafetensorError, SafetensorFormatError, SafetensorIndexError,  # noqa: F401
                      SafetensorInvalidError, SafetensorKeyError, SafetensorTypeError,
                      SafetensorUnsupportedError, SharedTensorsError, NoDataError)
from ._errors import error as _error
from ._errors import saving as _saving
from ._errors import fail as _fail

__all__ = ["load_file", "safe_open", "save_file", "save_file_async", "SaveHandle",
           "SafetensorError"]

# The largest header accepted (the safetensors package refuses larger ones too).
MAX_HEADER = 100_000_000
_U64 = (1 << 64) - 1

# safetensors dtype -> (torch dtype attribute or None, item size in bytes (1 for the types
# narrower than a byte), NumPy dtype or None), in the format's order of dtypes: a save writes
# tensors by falling rank in it (then by name), as the package does, so both write the same
# bytes. A torch without one of these (older versions) refuses it by name.
_DTYPES = {
    "BOOL": ("bool", 1, "|b1"),
    "F4": ("float4_e2m1fn_x2", 1, None),  # two 4-bit values a byte (torch: one _x2 element)
    "F6_E2M3": (None, 1, None),
    "F6_E3M2": (None, 1, None),
    "U8": ("uint8", 1, "|u1"),
    "I8": ("int8", 1, "|i1"),
    "F8_E5M2": ("float8_e5m2", 1, None),
    "F8_E4M3": ("float8_e4m3fn", 1, None),
    "F8_E8M0": ("float8_e8m0fnu", 1, None),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1, None),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1, None),
    "I16": ("int16", 2, "<i2"),
    "U16": ("uint16", 2, "<u2"),
    "F16": ("float16", 2, "<f2"),
    "BF16": ("bfloat16", 2, None),
    "I32": ("int32", 4, "<i4"),
    "U32": ("uint32", 4, "<u4"),
    "F32": ("float32", 4, "<f4"),
    "C64": ("complex64", 8, "<c8"),
    "F64": ("float64", 8, "<f8"),
    "I64": ("int64", 8, "<i8"),
    "U64": ("uint64", 8, "<u8"),
}
_RANK = {name: i for i, name in enumerate(_DTYPES)}
# Bits of one element, where that is not 8 times the item size.
_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def _nbytes(dtype, numel):
    """Bytes of numel elements of dtype, or None when they do not fill whole bytes."""
    bits = numel * _BITS.get(dtype, 8 * _DTYPES[dtype][1])
    return None if bits % 8 else bits // 8
_NUMPY_NAMES = {np_name: name for name, (_, _, np_name) in _DTYPES.items() if np_name}


def _torch():
    try:
        import torch
    except ImportError:
        raise ImportError("pinmem.safetensors: torch is needed to make tensors "
                          "(pip install torch)") from None
    return torch


def _device_kind(what, device):
    """'cpu' or 'cuda' for a device load_file and safe_open take: 'cpu', 'cuda', 'cuda:N', an
    int N >= 0 (CUDA device N) or a torch.device of either; the package's refusal (a
    SafetensorInvalidError, "device X is invalid") for what is no device, and an unsupported
    error naming the device type for another accelerator's."""
    if isinstance(device, str) and device == "cpu":
        return "cpu"
    if isinstance(device, int):
        if device < 0:
            raise _error(SafetensorInvalidError, f"device {device} is invalid")
        return "cuda"
    if not isinstance(device, str) and type(device).__name__ != "device":
        raise _error(SafetensorInvalidError, f"device {device} is invalid")
    torch = _torch()
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError, TypeError):
        raise _error(SafetensorInvalidError, f"device {device} is invalid") from None
    if kind in ("cpu", "cuda"):
        return kind
    if kind == "meta":
        raise _error(SafetensorInvalidError, f"device {device} is invalid")
    raise _error(SafetensorUnsupportedError, f"{what}: device {device!r}: pinmem.safetensors "
                 "loads into host memory ('cpu') or a CUDA device")


def _require_device(what, device):
    """A device of the kinds _device_kind takes; no silent CPU: a CUDA device asked for after
    auto fell back to the host backend is an error (torch CPU tensors in its place would fail
    far from the cause)."""
    if _device_kind(what, device) == "cpu":
        return
    info = _pm.backend_info()
    if info["fallback"]:
        reason = info["reason"][6:] if info["reason"].startswith("auto: ") else info["reason"]
        _pm._pinmem._raise(_pm.PM_ERR_NO_DEVICE,
                           f"{what}: device {device!r} asked for, but pinmem has no CUDA device: "
                           f"it fell back to the host backend ({reason}); to simulate devices on "
                           "purpose, set PINMEM_BACKEND=host")
    if info["backend"] == "host" and not _torch().cuda.is_available():
        # The host backend simulates devices for pinmem's own memory; torch tensors on a
        # device need torch's GPU, which it does not have (its own error would name the driver).
        _pm._pinmem._raise(_pm.PM_ERR_NO_DEVICE,
                           f"{what}: device {device!r} asked for, but torch has no CUDA device "
                           "(pinmem runs its host backend, PINMEM_BACKEND=host): load with "
                           "device='cpu'")


def _check_byteorder():
    if _sys.byteorder != "little":
        _fail(_pm.PM_ERR_UNSUPPORTED, "pinmem.safetensors: safetensors data is "
              "little-endian and this machine is not")


def _format_error(path, text):
    _fail(_pm.PM_ERR_FORMAT, f"{path!r}: {text}")


def _is_count(x):
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _U64


def _read_exactly(fd, n, offset, path):
    if isinstance(fd, (bytes, bytearray, memoryview)):  # a file in memory (load)
        if offset + n > len(fd):
            _format_error(path, f"the file ends at byte {len(fd)}, inside its header")
        return bytes(fd[offset:offset + n])
    parts = []
    while n:
        b = _os.pread(fd, n, offset)
        if not b:
            _format_error(path, f"the file ends at byte {offset}, inside its header")
        parts.append(b)
        n -= len(b)
        offset += len(b)
    return b"".join(parts)


class _Pairs(list):
    """A JSON object as the list of its (key, value) pairs, in file order: duplicates kept, so
    that the checks below can refuse the ones the format refuses."""


class _Refused(Exception):
    """Raised inside the JSON parser for what the format's parser refuses too."""


def _finite(text):
    x = float(text)
    if x in (float("inf"), float("-inf")):
        raise _Refused(f"the number {text} is out of range")
    return x


def _integer(text):
    """An integer of the header as the package's parser reads it: beyond 64 bits it is a double
    (refused past a double's range), and -0 is the double -0.0 (so not a count)."""
    if text == "-0":
        return -0.0
    if len(text.lstrip("-")) > 309:  # more digits than the largest double has
        raise _Refused(f"the number {text[:20]}... is out of range")
    x = int(text)
    try:
        float(x)
    except OverflowError:
        raise _Refused(f"the number {text[:20]}... is out of range") from None
    return x


def _constant(name):
    raise _Refused(f"{name} is not JSON")


def _load_json(raw, path):
    """The header's JSON as nested _Pairs, or FormatError naming `path`. Refused as the
    package's parser refuses them: invalid UTF-8, NaN and Infinity, numbers out of a double's
    range (integers too), lone surrogates, nesting deeper than 127. -0 reads as a double, as
    there, so it is no count."""
    try:
        text = raw.decode("utf-8")
        header = _json.loads(text, object_pairs_hook=_Pairs, parse_constant=_constant,
                             parse_float=_finite, parse_int=_integer)
    except _Refused as e:
        _format_error(path, f"the header is not valid JSON ({e})")
    except RecursionError:
        _format_error(path, "the header is not valid JSON (nested too deeply)")
    except (UnicodeDecodeError, ValueError) as e:
        _format_error(path, f"the header is not valid JSON ({e})")
    if "\\u" in text:  # an escape may make a lone surrogate, which UTF-8 cannot hold
        try:
            _json.dumps(header, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            _format_error(path, "the header is not valid JSON (a lone surrogate escape)")
        except RecursionError:
            _format_error(path, "the header is not valid JSON (nested too deeply)")
    if _depth(header) > 127:
        _format_error(path, "the header is not valid JSON (nested deeper than 127)")
    return header


def _depth(x):
    """Nesting depth of parsed JSON (the package's parser refuses 128), without recursion."""
    deepest, todo = 0, [(x, 1)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, _Pairs):
            x = [v for _, v in x]
        elif not isinstance(x, list):
            continue
        deepest = max(deepest, d)
        todo.extend((v, d + 1) for v in x)
    return deepest


def _parse_header(fd, path, strict=True):
    """(metadata, [(name, dtype, shape, begin, end)], data start, data bytes used) of the open
    safetensors file fd (or of a whole file in memory: bytes); FormatError naming `path` and
    the reason when it is malformed.

    strict (the default) refuses, as the safetensors package does, files whose tensors do not
    cover the data exactly (a gap between two, data not starting at 0, bytes after the last):
    such bytes would be read by no one, and let one file be two formats at once. strict=False
    accepts them and refuses only tensors that overlap."""
    size = len(fd) if isinstance(fd, (bytes, bytearray, memoryview)) else _os.fstat(fd).st_size
    if size < 8:
        _format_error(path, f"{size} bytes long: not a safetensors file (it starts with an "
                      "8-byte header length)")
    (n,) = _struct.unpack("<Q", _read_exactly(fd, 8, 0, path))
    if n > size - 8:
        _format_error(path, f"header length {n} runs past the end of the file ({size} bytes): "
                      "not a safetensors file, or truncated")
    if n > MAX_HEADER:
        _format_error(path, f"header length {n} is larger than the {MAX_HEADER} bytes allowed")
    header = _load_json(_read_exactly(fd, n, 8, path), path)
    if not isinstance(header, _Pairs):
        kind = "object" if isinstance(header, dict) else "list" if isinstance(header, list) \
            else type(header).__name__
        _format_error(path, f"the header is JSON {kind}, not an object")
    metas = [info for k, info in header if k == "__metadata__"]
    if len(metas) > 1:
        _format_error(path, "__metadata__ appears more than once")
    metadata = None
    if metas and metas[0] is not None:
        if not (isinstance(metas[0], _Pairs) and all(isinstance(v, str) for _, v in metas[0])):
            _format_error(path, "__metadata__ must be an object of strings to strings")
        metadata = dict(metas[0])
    data_len = size - 8 - n
    parsed = {}
    # Every entry is checked as JSON of the right kinds, a repeated name's too; the last entry
    # of a name is the one that counts and has its sizes and offsets checked, as in the package.
    for name, info in ((k, info) for k, info in header if k != "__metadata__"):
        if not isinstance(info, _Pairs):
            _format_error(path, f"tensor {name!r}: its entry is not an object")
        fields = {}
        for k, v in info:
            if k in fields and k in ("dtype", "shape", "data_offsets"):
                _format_error(path, f"tensor {name!r}: {k} appears more than once")
            fields[k] = v
        dtype, shape, offsets = (fields.get(k) for k in ("dtype", "shape", "data_offsets"))
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            _format_error(path, f"tensor {name!r}: unknown dtype {dtype!r} (known: "
                          f"{', '.join(_DTYPES)})")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            _format_error(path, f"tensor {name!r}: shape {shape!r} is not a list of "
                          "non-negative 64-bit integers")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_count(o) for o in offsets)):
            _format_error(path, f"tensor {name!r}: data_offsets {offsets!r} is not a pair of "
                          "non-negative 64-bit integers")
        parsed[name] = (dtype, shape, offsets)
    entries = {}
    for name, (dtype, shape, offsets) in parsed.items():
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
            if numel > _U64:  # the package counts in 64 bits, left to right
                _format_error(path, f"tensor {name!r}: the element count of shape {shape} "
                              "overflows 64 bits")
        if numel * _BITS.get(dtype, 8 * _DTYPES[dtype][1]) > _U64:
            _format_error(path, f"tensor {name!r}: the bits of shape {shape} overflow 64 bits")
        need = _nbytes(dtype, numel)
        if need is None:
            _format_error(path, f"tensor {name!r}: {dtype} of shape {shape} does not fill whole "
                          "bytes")
        if end - begin != need:
            _format_error(path, f"tensor {name!r}: {dtype} of shape {shape} takes {need} bytes "
                          f"but its data_offsets [{begin}, {end}] hold {end - begin}")
        entries[name] = (name, dtype, tuple(shape), begin, end)
    entries = list(entries.values())
    last = None
    for e in sorted(entries, key=lambda e: (e[3], e[4])):
        at = 0 if last is None else last[4]
        if e[3] < at and (strict or e[4] > e[3]):
            _format_error(path, f"tensors {last[0]!r} [{last[3]}, {last[4]}) and {e[0]!r} "
                          f"[{e[3]}, {e[4]}) overlap")
        if strict and e[3] > at:
            where = (f"after {last[0]!r} [{last[3]}, {last[4]})" if last is not None
                     else "at the start of the data")
            _format_error(path, f"a gap of {e[3] - at} bytes {where}: the next tensor, "
                          f"{e[0]!r}, starts at {e[3]} (strict=False accepts gaps)")
        if e[4] > e[3]:
            last = e
    used = max((e[4] for e in entries), default=0)
    if strict and used != data_len:
        _format_error(path, f"{data_len - used} bytes after the last tensor, which ends at "
                      f"{used} of the {data_len} bytes of data (strict=False accepts them)")
    return metadata, entries, 8 + n, used


IOS = ("auto", "buffered", "direct")


def _read(path, check, alloc, io="auto", strict=True, pieces=False):
    """Parse the file at path, run check(entries), then read its data region with one pinmem
    read (io as read_file's) into the buffer alloc(nbytes, file offset) returns as (target for
    the read, data, stream). Returns (entries, data); data is None when no tensor has bytes.

    pieces (host memory): the region cut at tensor boundaries (_cuts) into pieces, each with
    its own buffer and read, and data [(first byte of the piece, its data)] in order. The
    buffers are allocated one after the other on a thread of their own while the earlier
    pieces are read: a process's first load allocates its pinned memory as the disk reads,
    not before it (figures at PIECE_FIRST; bench/probes/load_first.py). A later load of the
    file finds the same sizes in the pool."""
    fd = _open(path)
    try:
        _, entries, start, used = _parse_header(fd, path, strict)
        check(entries)
        if not used:
            return entries, ([] if pieces else None)
        cuts = _cuts(entries, used) if pieces else [(0, used)]
        if len(cuts) == 1:
            target, data, stream = alloc(used, start)
            _read_range(fd, start, used, target, stream, io, "load_file", path)
            return entries, [(0, data)] if pieces else data
        import concurrent.futures
        out = []
        with concurrent.futures.ThreadPoolExecutor(1, "pinmem-load-alloc") as ex:
            futs = [ex.submit(alloc, end - begin, start + begin) for begin, end in cuts]
            try:
                i = 0
                while i < len(cuts):
                    # the next piece's buffer, and those of the pieces after it that are
                    # ready too (all of them where the pool had the memory): one read
                    futs[i].result()
                    j = i + 1
                    while j < len(cuts) and futs[j].done():
                        j += 1
                    got = [(b, f.result()) for (b, _), f in zip(cuts[i:j], futs[i:j])]
                    _read_ranges(fd, [(start + b, r[0]) for b, r in got], io, "load_file", path)
                    out += [(b, r[1]) for b, r in got]
                    i = j
            except BaseException:
                for fut in futs:
                    fut.cancel()
                raise
        return entries, out
    finally:
        _os.close(fd)


# _read's pieces: the first of PIECE_FIRST bytes or more, each next one twice the one before up
# to PIECE_MAX (a piece ends where a tensor does, so one may be larger); data regions under
# PIECES_MIN bytes are one piece. Each allocation and read has its fixed cost: first loads on the
# 2-CPU VM (medians of 8, each in a process of its own as bench/probes/load_first.py runs them)
# of 1 GB ran at 1.92 GB/s with a first piece of 64 MiB, 1.88 of 16 MiB, 1.65 in one buffer; of
# 512 MB at 1.73, 1.55 and 1.55; of 256 MB at 1.46 against 1.40 in one; of 128 MB at 1.17
# against 1.23.
PIECE_FIRST = 64 << 20
PIECE_MAX = 256 << 20
PIECES_MIN = 256 << 20


def _cuts(entries, used):
    """[(begin, end)] of the data region's pieces, cut only where no tensor spans the cut."""
    if used < PIECES_MIN:
        return [(0, used)]
    spans = sorted((b, e) for *_, b, e in entries if e > b)
    cuts, begin, reach, want = [], 0, 0, PIECE_FIRST
    for b, e in spans:
        if b >= reach and b - begin >= want:  # no tensor crosses b
            cuts.append((begin, b))
            begin, want = b, min(2 * want, PIECE_MAX)
        reach = max(reach, e)
    cuts.append((begin, used))
    return cuts


def _read_ranges(fd, ranges, io, fn, path):
    """One pinmem read of [(offset, host target)] of fd; its errors name fn and the file."""
    try:
        _pm._pinmem._file_readv(fd, ranges, None, io, 0, None)
    except _pm.Error as e:
        _pm._file_error(fn, path, e)


def _read_range(fd, offset, n, target, stream, io, fn, path):
    """One pinmem read of n bytes at offset of fd into target, waited for; its errors name fn
    and the file."""
    try:
        _pm._pinmem._file_read(fd, offset, n, target, stream, io).wait()
    except _pm.Error as e:
        _pm._file_error(fn, path, e)


def _torch_dtype(torch, name, dtype, where):
    """The torch dtype of a tensor of safetensors `dtype`; UnsupportedError where this torch
    lacks it."""
    attr = _DTYPES[dtype][0]
    t = getattr(torch, attr, None) if attr else None
    if t is None:
        _fail(_pm.PM_ERR_UNSUPPORTED, f"{where}: tensor {name!r} is {dtype}, which torch "
              f"{torch.__version__} has no type for")
    return t


def _dtype_of_torch(torch, t):
    """The safetensors dtype of torch dtype t, or None."""
    return next((k for k, (attr, _, _) in _DTYPES.items()
                 if attr and getattr(torch, attr, None) == t), None)


def _torch_shape(dtype, shape, where, name):
    """The torch shape of a tensor of `dtype` and file shape `shape`: F4's last dimension counts
    4-bit values, two to a torch float4_e2m1fn_x2 element."""
    if dtype != "F4":
        return shape
    if not shape or shape[-1] % 2:
        _fail(_pm.PM_ERR_UNSUPPORTED, f"{where}: tensor {name!r} is F4 of shape {list(shape)}: "
              "torch's float4_e2m1fn_x2 needs the last dimension even (two values an element)")
    return tuple(shape[:-1]) + (shape[-1] // 2,)


def load_file(path, device="cpu", *, backend="mmap", io="auto", strict=True):
    """A dict of torch tensors from the safetensors file at `path`, on `device` ('cpu',
    'cuda', 'cuda:1', a torch.device or an index).

    The header is checked first (FormatError naming the file and what is wrong: a bad length,
    JSON, dtype, shape, offsets out of range or overlapping); then the data is read with one
    pinmem read into one buffer of device memory, or for 'cpu' into pinned memory: from 256 MiB
    on in pieces cut between tensors, allocated while the earlier ones are read (_read). Each
    tensor lies in a buffer with a storage of its own over just its bytes (torch.save of one
    tensor writes that tensor alone), and a buffer is freed when the last of its tensors is.

    io: as read_file's. 'auto' reads a file of 64 MiB or more that is not in the page cache
    through O_DIRECT (the fastest cold load for one process), or through the page cache while
    other processes read the same file (ranks of one node), so that they share it. A direct
    read leaves nothing in the page cache: 'buffered' keeps the file there for a later load.

    backend: 'mmap' (the default) or 'pread', accepted as the package's are (a bad name is
    refused as there); pinmem reads the same way for both.

    strict: True (the default) refuses, as the safetensors package does, a file whose tensors
    leave bytes of the data unread (a gap between two, data not starting at 0, bytes after the
    last); False loads it (only overlapping tensors are refused).
    """
    _check_byteorder()
    path = _os.fspath(path)
    if device is None:  # as the package: the CPU
        device = "cpu"
    if io not in IOS:
        _fail(_pm.PM_ERR_INVALID, f"load_file({path!r}): io must be one of "
              f"{', '.join(IOS)}, not {io!r}")
    _check_backend(backend)
    _require_device(f"load_file({path!r})", device)
    dtypes = {}

    def check(entries):
        torch = _torch()
        for name, dtype, shape, *_ in entries:
            where = f"load_file({path!r})"
            dtypes[name] = (_torch_dtype(torch, name, dtype, where),
                            _torch_shape(dtype, shape, where, name))

    def alloc(n, at):
        torch = _torch()
        return _alloc(torch, torch.device(device), n, at)

    torch = _torch()
    dev = torch.device(device)
    entries, data = _read(path, check, alloc, io, strict, pieces=dev.type == "cpu")
    out = {}
    pieces = _Pieces(torch, data if dev.type == "cpu" else [(0, data)], dev)
    for name, dtype, _, begin, end in entries:
        t, shape = dtypes[name]
        if begin == end:
            out[name] = _empty(torch, shape, t, dev)
            continue
        piece = pieces.take(begin, end)
        if piece.data_ptr() % _DTYPES[dtype][1]:
            piece = piece.clone()  # a view would be misaligned
        out[name] = piece.view(t).view(shape)
    return out


def _empty(torch, shape, dtype, dev):
    """A tensor of shape with no elements. Through view, as the package makes it: torch.empty
    refuses a shape such as [0, 2**32, 2**32], whose contiguous strides overflow 64 bits."""
    return torch.empty(0, dtype=dtype, device=dev).view(shape)


def _alloc(torch, dev, n, at, align=8, place=True):
    """(read target, torch uint8 tensor of it, stream) for n bytes at file offset `at` read
    into `dev`: device memory there, or for the CPU pinned memory (pageable when the budget is
    spent) placed as the file's bytes are (_placed, for elements of `align` bytes), in a
    storage of exactly its n bytes."""
    if dev.type != "cpu":
        data = torch.empty(n, dtype=torch.uint8, device=dev)
        return data, data, torch.cuda.current_stream(dev) if dev.type == "cuda" else None
    data = torch.from_numpy(_host_buffer(n, at, align, place=place))  # the view holds it
    return data, data, None


_PAGE = 4096
# A tensor read on its own (safe_open) of fewer bytes, with io other than "direct", is not
# placed (_placed): io="auto" reads it through the page cache, where placement gains nothing,
# and a state dict of 20,000 0-d tensors (an optimizer's steps) took 92 MB of pinned memory
# for 80 KB of data, a page a tensor.
_PLACE_MIN = 1 << 20


def _host_buffer(n, at, align, pinned=True, place=True):
    """n bytes of host memory (a NumPy uint8 view), placed for bytes at file offset `at` of
    elements of `align` bytes (_placed) where `place`: pinned from pinmem's pool, or pageable
    (pinned=False, or when the budget is spent)."""
    extra = _PAGE - 1 if place else 0
    whole = None
    if pinned:
        try:
            whole = _np.asarray(_pm.empty(n + extra, "uint8"))
        except _pm.BudgetError:  # no pinned memory to spare: pageable will do
            pass
    if whole is None:
        whole = _np.empty(n + extra, _np.uint8)
    if not extra:
        return whole  # pinmem's blocks and NumPy's buffers hold any element's alignment
    return _placed(whole, n, at, align)


def _placed(whole, n, at, align):
    """The n bytes of NumPy uint8 array `whole` (n + _PAGE - 1 bytes or more) whose first byte
    lies at file offset `at` modulo the page: an O_DIRECT read then moves the file's bytes into
    them in place. Memory placed otherwise goes through pinmem's pinned slots and a copy (a 1 GB
    load on the 2-CPU VM: 1.81 GB/s placed, 1.57 on a page; bench/probes/load_first.py). Bytes
    of elements of `align` bytes at an offset off their grid (a header not padded as the format
    pads it) would be misaligned so: they start on a page instead, and are read through the
    slots."""
    lead = (at if at % align == 0 else 0) - whole.ctypes.data
    return whole[lead % _PAGE:lead % _PAGE + n]


class _DeviceSpan:
    """Bytes [begin, end) of a device tensor, offered to torch.as_tensor through the CUDA array
    interface, which makes a tensor with a storage of its own that holds this object (and so
    the whole buffer) alive."""

    __slots__ = ("whole", "__cuda_array_interface__")

    def __init__(self, whole, begin, end):
        self.whole = whole
        # version 2: no stream to wait for; the read was waited for before any tensor is made
        self.__cuda_array_interface__ = {"shape": (end - begin,), "typestr": "|u1",
                                         "data": (whole.data_ptr() + begin, False),
                                         "version": 2}


class _Pieces:
    """uint8 tensors for byte ranges of the read buffers [(first byte, buffer)] (one on a
    device; _read's pieces on the host), each with a storage of its own (exactly its bytes)
    over the same memory. A slice of a buffer would share the buffer's storage with every other
    tensor in it: torch.save of one tensor would then write the whole file's bytes, and tools
    that find tied weights by storage (safetensors' save_model, transformers' save_pretrained)
    would take every tensor for a tie of every other."""

    def __init__(self, torch, parts, dev):
        self.torch, self.dev = torch, dev
        self.starts = [b for b, _ in parts]
        self.parts = [d.numpy() if dev.type == "cpu" else d for _, d in parts]

    def take(self, begin, end):
        k = _bisect.bisect_right(self.starts, begin) - 1
        data, begin, end = self.parts[k], begin - self.starts[k], end - self.starts[k]
        if self.dev.type == "cpu":  # a NumPy view holds the buffer; from_numpy holds the view
            return self.torch.from_numpy(data[begin:end])
        if self.dev.type == "cuda":
            return self.torch.as_tensor(_DeviceSpan(data, begin, end), device=self.dev)
        return data[begin:end]  # other devices: a view of the buffer


FRAMEWORKS = {"pt": "pt", "torch": "pt", "pytorch": "pt", "np": "np", "numpy": "np"}
# The package's backend= names: how its bytes are served (a memory map, or pread). pinmem reads
# every tensor with its own reads into memory of the tensor's own either way, so both are
# accepted, and name the same thing.
BACKENDS = ("mmap", "pread")


def _check_backend(backend):
    if backend not in BACKENDS:
        raise _error(SafetensorInvalidError, f"backend {backend!r} is invalid (expected one of: "
                     f"{', '.join(map(repr, BACKENDS))})")


def _open(path):
    """A read descriptor on path. A missing file is FileNotFoundError whose text names it as
    the package's does ("No such file or directory: <path>")."""
    try:
        return _os.open(path, _os.O_RDONLY | _os.O_CLOEXEC)
    except FileNotFoundError:
        raise _NotFound(_errno.ENOENT, _os.strerror(_errno.ENOENT), path) from None


class _NotFound(FileNotFoundError):
    """FileNotFoundError (errno, strerror and filename set) whose text is the package's."""

    def __str__(self):
        return f"No such file or directory: {self.filename}"


class safe_open:
    """The safetensors file at `path`, opened to read tensors one at a time, as the
    `safetensors` package's safe_open: keys(), metadata(), get_tensor(name), get_slice(name).

    framework: 'pt' (torch tensors on `device`; None: 'cpu') or 'np' (NumPy arrays; device
    'cpu'). backend: 'mmap' (the default) or 'pread', accepted as the package's are; both read
    with pinmem. strict: as load_file's. The header is checked when the file is opened
    (FormatError naming the file). Each get_tensor is one pinmem read (io as read_file's) of
    that tensor's bytes into memory of its own: on the device, or pinned host memory for 'cpu'
    (pageable when the budget is spent; NumPy arrays are pageable); get_tensors() reads every
    tensor so. get_slice(name)[index] reads only the rows a leading int or slice needs, and
    indexes as the package does with the same arguments (_Slice). A context manager; close()
    (or leaving the `with`) closes the file: the tensors already read stay valid, every method
    raises SafetensorError after it, and slices already taken still read (the descriptor is
    closed with the last of them). load_file is faster for a whole file: one read.
    """

    def __init__(self, path, framework="pt", device="cpu", *, backend="mmap", io="auto",
                 strict=True, _handle=None):
        _check_byteorder()
        self._fd = None
        self._lock = _threading.Lock()
        self._busy = 0  # reads in flight: close() leaves the descriptor to the last of them
        self._closing = None
        self._path = path = str(path) if _handle is not None else _os.fspath(path)
        if framework not in FRAMEWORKS:
            _fail(_pm.PM_ERR_INVALID, f"safe_open({path!r}): framework must be "
                  f"one of {', '.join(FRAMEWORKS)}, not {framework!r}")
        if io not in IOS:
            _fail(_pm.PM_ERR_INVALID, f"safe_open({path!r}): io must be one of "
                  f"{', '.join(IOS)}, not {io!r}")
        _check_backend(backend)
        if device is None:  # as the package: the CPU
            device = "cpu"
        self._framework, self._io, self._backend = FRAMEWORKS[framework], io, backend
        if self._framework != "np":
            _require_device(f"safe_open({path!r})", device)
        if self._framework == "np":
            if device not in ("cpu", None):
                _fail(_pm.PM_ERR_INVALID, f"safe_open({path!r}): NumPy arrays "
                      f"live in host memory: device must be 'cpu', not {device!r}")
            self._device = None
        else:
            self._device = _torch().device(device)
        fd = _open(path) if _handle is None else _os.dup(_handle)
        try:
            self._metadata, entries, self._start, _ = _parse_header(fd, path, strict)
        except BaseException:
            _os.close(fd)
            raise
        self._fd = fd
        self._entries = {e[0]: e for e in entries}
        self._order = [e[0] for e in sorted(entries, key=lambda e: (e[3], e[4]))]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    def close(self):
        """Close the file (again: nothing). Tensors already read stay valid; reads other
        threads have in flight finish first (the last of them closes the descriptor), so no
        read can land on a descriptor number the process has since reused."""
        lock = getattr(self, "_lock", None)
        if lock is None:  # __init__ failed before anything was opened
            return
        with lock:
            fd, self._fd = self._fd, None
            if fd is None:
                return
            if self._busy:
                self._closing = fd
                return
        _os.close(fd)

    def _hold(self, name):
        """The descriptor, held for one read (_let_go gives it back)."""
        with self._lock:
            if self._fd is None:
                _fail(_pm.PM_ERR_INVALID, f"File is closed: get_tensor({name!r}): "
                      f"{self._path!r} is closed")
            self._busy += 1
            return self._fd

    def _let_go(self):
        with self._lock:
            self._busy -= 1
            fd = self._closing if not self._busy else None
            if fd is not None:
                self._closing = None
        if fd is not None:
            _os.close(fd)

    def __repr__(self):
        state = "closed" if self._fd is None else f"{len(self._entries)} tensors"
        return f"<pinmem.safetensors.safe_open {self._path!r}, {state}>"

    def _open_or_fail(self, fn):
        if self._fd is None:  # as the package: nothing is answered once the file is closed
            _fail(_pm.PM_ERR_INVALID, f"File is closed: {fn}: {self._path!r} is closed")

    def keys(self):
        """The tensors' names, sorted (as the safetensors package lists them)."""
        self._open_or_fail("keys()")
        return sorted(self._entries)

    def offset_keys(self):
        """The tensors' names in the order of their bytes in the file."""
        self._open_or_fail("offset_keys()")
        return list(self._order)

    def metadata(self):
        """The header's __metadata__ (a dict of str to str), or None."""
        self._open_or_fail("metadata()")
        return None if self._metadata is None else dict(self._metadata)

    def __contains__(self, name):
        self._open_or_fail("in")
        return name in self._entries

    def __len__(self):
        self._open_or_fail("len()")
        return len(self._entries)

    def _entry(self, name, fn):
        self._open_or_fail(f"{fn}({name!r})")
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise _error(SafetensorKeyError, f"File does not contain tensor {name}: "
                         f"{fn}({name!r}): no tensor of that name in {self._path!r}") from None

    def _dtype(self, name, dtype):
        if self._framework == "np":
            np_name = _DTYPES[dtype][2]
            if np_name is None:
                _fail(_pm.PM_ERR_UNSUPPORTED, f"{self._path!r}: tensor {name!r} "
                      f"is {dtype}, which NumPy has no type for (framework='pt' "
                      "reads it)")
            return _np.dtype(np_name)
        return _torch_dtype(_torch(), name, dtype, repr(self._path))

    def _read(self, name, dtype, shape, begin, end, fd=None):
        """The bytes [begin, end) of the data region as a tensor (array) of dtype and shape, in
        memory of its own; through fd where given (a slice's, held), else the file's."""
        t = self._dtype(name, dtype)
        n = end - begin
        place = self._io == "direct" or n >= _PLACE_MIN
        if self._framework == "np":
            out = _host_buffer(n, self._start + begin, _DTYPES[dtype][1], pinned=False,
                               place=place)
            target, stream = out, None
        else:
            torch = _torch()
            shape = _torch_shape(dtype, shape, repr(self._path), name)
            if not n:
                return _empty(torch, shape, t, self._device)
            target, out, stream = _alloc(torch, self._device, n, self._start + begin,
                                         _DTYPES[dtype][1], place)
        if n and fd is not None:
            _read_range(fd, self._start + begin, n, target, stream, self._io, "get_slice",
                        self._path)
        elif n:
            fd = self._hold(name)
            try:
                _read_range(fd, self._start + begin, n, target, stream, self._io, "get_tensor",
                            self._path)
            finally:
                self._let_go()
        return out.view(t).reshape(shape)

    def get_tensor(self, name):
        """The tensor `name`, read from the file (KeyError when there is none)."""
        _, dtype, shape, begin, end = self._entry(name, "get_tensor")
        return self._read(name, dtype, shape, begin, end)

    def get_tensors(self):
        """Every tensor, as a dict of names to tensors (arrays) in the order of their bytes in
        the file, each read into memory of its own."""
        self._open_or_fail("get_tensors()")
        return {name: self.get_tensor(name) for name in self._order}

    def get_slice(self, name):
        """A lazy view of tensor `name`: get_shape(), get_dtype(), and [index] reading only the
        rows a leading int or slice needs (KeyError when there is no such tensor)."""
        return _Slice(self, self._entry(name, "get_slice"))


def _show(index):
    """An index as the package writes it in its errors: [2:, 20]."""
    def one(x):
        if isinstance(x, slice):
            text = ("" if x.start is None else str(x.start)) + ":" + \
                ("" if x.stop is None else str(x.stop))
            return text + (f":{x.step}" if x.step not in (None, 1) else "")
        return "..." if x is Ellipsis else str(x)
    return "[" + ", ".join(one(x) for x in (index if isinstance(index, tuple) else (index,))) + "]"


def _checked_index(index, shape):
    """index as a tuple of ints and slices (start, stop, step > 0, all ints, within the shape),
    one per leading dimension, or the refusal the package makes, as a SafetensorError with its
    words: an int or a slice out of range (a slice is not clipped), a step of 0 or less, a
    non-empty list, anything else (None, a float, an array of more than one element). Any
    object with __index__ (a 0-d integer array or tensor) is an int. A negative slice bound
    counts from the end. An empty list (no rows) is taken too, as the package takes it."""
    shape = list(shape)
    if isinstance(index, list):
        if index:
            raise _error(SafetensorInvalidError, "Non empty lists are not implemented")
        if not shape:
            raise _error(SafetensorIndexError, f"Error during slicing [] with shape {shape}: "
                         "more slicing indexes than dimensions in tensor")
        return (slice(0, 0, 1),)
    items = index if isinstance(index, tuple) else (index,)
    if sum(1 for x in items if x is Ellipsis) > 1:
        raise _error(SafetensorIndexError, f"Error during slicing {_show(index)}: an index can "
                     "only have a single ellipsis ('...')")
    if any(x is Ellipsis for x in items):
        at = next(i for i, x in enumerate(items) if x is Ellipsis)
        fill = max(0, len(shape) - (len(items) - 1))
        items = items[:at] + (slice(None),) * fill + items[at + 1:]
    if len(items) > len(shape):
        raise _error(SafetensorIndexError, f"Error during slicing {_show(index)} with shape "
                     f"{shape}: more slicing indexes than dimensions in tensor")
    out = []
    for pos, (x, size) in enumerate(zip(items, shape)):
        if not isinstance(x, (int, _np.integer, slice, list, tuple)) and x is not None:
            try:  # a 0-d integer array or tensor: an index, as the package takes it
                x = _operator.index(x)
            except TypeError:
                pass

        def bound(i):
            return _error(SafetensorIndexError, f"Error during slicing {_show(index)} with shape "
                          f"{shape}: index {i} out of bounds for tensor dimension #{pos} of "
                          f"size {size}")
        if isinstance(x, (int, _np.integer)):  # bool too: the package takes True for 1
            k = int(x)
            if k < -size:
                raise _error(SafetensorIndexError, f"Invalid index {k} for dimension {pos} of "
                             f"size {size}")
            if k >= size:
                raise bound(k)
            out.append(k + size if k < 0 else k)
        elif isinstance(x, slice):
            try:
                step = 1 if x.step is None else _operator.index(x.step)
                start = 0 if x.start is None else _operator.index(x.start)
                stop = size if x.stop is None else _operator.index(x.stop)
            except TypeError:
                raise _error(SafetensorInvalidError, f"Unsupported slice index at position {pos}:"
                             " slice bounds must be integers") from None
            if step <= 0:
                raise _error(SafetensorInvalidError, f"Slice step must be a positive integer, "
                             f"got {step}")
            start = max(0, start + size) if start < 0 else start
            stop = max(0, stop + size) if stop < 0 else stop
            if stop > size:
                raise bound(stop - 1)
            if start >= size and size:
                raise bound(start)
            out.append(slice(start, stop, step))
        else:
            raise _error(SafetensorInvalidError, f"Unsupported slice index at position {pos}: "
                         "expected slice, int, or ellipsis")
    return tuple(out)


def _safe_open_handle(f, framework="pt", device="cpu", *, backend="mmap", io="auto", strict=True):
    """safe_open over a file object already open (a file of the local file system: its
    fileno()), as the package's _safe_open_handle. The file object may be closed afterwards:
    safe_open reads through a descriptor of its own."""
    try:
        handle = f.fileno()
    except (AttributeError, OSError, ValueError):
        raise _error(SafetensorInvalidError, f"_safe_open_handle: {f!r} has no file descriptor "
                     "(pinmem reads local files only)") from None
    return safe_open(getattr(f, "name", repr(f)), framework, device, backend=backend, io=io,
                     strict=strict, _handle=handle)


def _row_span(start, stop, step):
    """For rows start:stop:step (step > 0, in range): the rows [r0, r1) to read, and the slice
    that takes the same rows out of what was read."""
    last = start + (stop - start - 1) // step * step + 1 if stop > start else start
    return (start, last), slice(0, last - start, step)


class _Slice:
    """One tensor of a safe_open file, read when indexed.

    It holds the file's descriptor from get_slice on (as the package's slice holds its file):
    indexing still works after the safe_open is closed, and the descriptor is closed once the
    last slice is gone. framework 'pt' with backend 'mmap' (the defaults) indexes as torch
    indexes a tensor, as the package's slices of a mapped file do; 'np', or backend 'pread',
    takes the package's own slicing rules (_checked_index)."""

    def __init__(self, f, entry):
        self._f, self._entry = f, entry
        self._fd = f._hold(entry[0])
        _weakref.finalize(self, f._let_go)

    def get_shape(self):
        return list(self._entry[2])

    def get_dtype(self):
        return self._entry[1]

    def __len__(self):
        shape = self._entry[2]
        if not shape:
            raise TypeError("len() of a 0-d tensor")
        return shape[0]

    def __repr__(self):
        name, dtype, shape = self._entry[:3]
        return f"<pinmem.safetensors slice {name!r} {dtype} {list(shape)}>"

    def _rows(self, rows):
        """The rows [r0, r1) of the tensor, read."""
        name, dtype, shape, begin, end = self._entry
        row = (end - begin) // shape[0] if shape[0] else 0
        return self._f._read(name, dtype, (rows[1] - rows[0],) + tuple(shape[1:]),
                             begin + rows[0] * row, begin + rows[1] * row, fd=self._fd)

    def _whole(self):
        name, dtype, shape, begin, end = self._entry
        return self._f._read(name, dtype, shape, begin, end, fd=self._fd)

    def __getitem__(self, index):
        f = self._f
        name, dtype, shape = self._entry[:3]
        if dtype == "F4" and f._framework != "np":
            # The file counts 4-bit values, a torch element holds two: an index in either unit
            # would be wrong in the other (the package fails here too).
            raise _error(SafetensorUnsupportedError, f"get_slice({name!r}): tensor {name!r} is "
                         "F4 (float4_e2m1fn_x2), whose file shape counts 4-bit values and torch "
                         "shape bytes: slicing is not supported; get_tensor reads it whole")
        if f._framework == "pt" and f._backend == "mmap":
            return self._torch_index(index)
        index = _checked_index(index, shape)
        first = index[0] if index else None
        rows = None  # the rows [r0, r1) the first index needs
        if isinstance(first, int):
            rows, first = (first, first + 1), 0
        elif isinstance(first, slice):
            rows, first = _row_span(first.start, max(first.start, first.stop), first.step)
        if rows is None:  # anything else: the whole tensor, indexed as torch or NumPy does
            part = self._whole()
        else:
            part = self._rows(rows)
            index = (first,) + index[1:]
        return self._own(part, part[index])

    def _torch_index(self, index):
        """part[index] as torch indexes the whole tensor, reading only the rows a leading int or
        slice needs; torch's own errors, as SafetensorErrors of their built-in classes."""
        name, dtype, shape = self._entry[:3]
        items = index if isinstance(index, tuple) else (index,)
        first = items[0] if items else None
        rows, bad = None, False

        def plain(x):  # an int that torch takes as an int (a bool adds a dimension instead)
            return isinstance(x, (int, _np.integer)) and not isinstance(x, (bool, _np.bool_))

        if shape and plain(first):
            size, k = shape[0], int(first)
            bad = not -size <= k < size
            k = k + size if k < 0 else k
            rows, first = (k, k + 1), 0
        elif shape and isinstance(first, slice) and all(
                v is None or plain(v) for v in (first.start, first.stop, first.step)):
            bad = first.step is not None and first.step <= 0
            if not bad:
                rows, first = _row_span(*first.indices(shape[0]))  # clipped, as torch clips
        try:
            if bad:  # torch's error, in torch's order of checks, from a tensor without data
                torch = _torch()
                torch.empty(shape, dtype=self._f._dtype(name, dtype), device="meta")[index]
                raise IndexError(f"{_show(index)} is out of range for shape {list(shape)}")
            if rows is None:
                part = self._whole()
                out = part[index]
            else:
                part = self._rows(rows)
                out = part[(first,) + items[1:]] if isinstance(index, tuple) else part[first]
        except IndexError as e:
            raise _error(SafetensorIndexError, str(e)) from None
        except TypeError as e:
            raise _error(SafetensorTypeError, str(e)) from None
        except ValueError as e:
            raise _error(SafetensorInvalidError, str(e)) from None
        return self._own(part, out)

    def _own(self, part, out):
        """What comes back is compact and its own, as the package's: a view of part of what was
        read (a column, a step) is copied out."""
        if self._f._framework == "np":
            if not isinstance(out, _np.ndarray):  # a single element: a 0-d array, not a scalar
                return _np.array(out)
            return out if out.base is part.base and out.nbytes == part.nbytes else out.copy()
        if out.numel() == part.numel() and out.is_contiguous():
            return out
        return out.clone(memory_format=_torch().contiguous_format)


# ---- saving --------------------------------------------------------------------------------

def _source(name, t):
    """(safetensors dtype, shape, bytes, a C-contiguous byte view or None when empty, stream)
    of one tensor or array to save."""
    torch = _sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        if t.layout != torch.strided:
            raise _error(SafetensorInvalidError,
                         f"pinmem.safetensors: tensor {name!r} is {t.layout}; save dense "
                         "tensors (.to_dense())")
        if t.device.type == "meta":
            raise _error(NoDataError, f"pinmem.safetensors: tensor {name!r} is on the meta "
                         "device: Cannot copy out of meta tensor, it has no data")
        dtype = _dtype_of_torch(torch, t.dtype)
        if dtype is None:
            raise _error(SafetensorTypeError,
                         f"pinmem.safetensors: tensor {name!r} has dtype {t.dtype}, which "
                         "safetensors cannot store")
        t = t.detach().resolve_conj().resolve_neg()  # lazy conjugate views: their real bytes
        if not t.is_contiguous():
            t = t.contiguous()
        n = t.numel() * _DTYPES[dtype][1]
        from pinmem.torch import _flat_bytes
        view = _flat_bytes(t) if n else None
        stream = torch.cuda.current_stream(t.device) if t.device.type == "cuda" else None
        shape = tuple(t.shape)
        if dtype == "F4":  # the file counts 4-bit values: two a torch element
            if not shape:
                raise _error(SafetensorInvalidError, f"pinmem.safetensors: tensor {name!r} is a "
                             "0-d float4_e2m1fn_x2, whose two values have no shape in the file")
            shape = shape[:-1] + (2 * shape[-1],)
        return dtype, shape, n, view, stream
    if isinstance(t, _np.ndarray):
        a = t
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        dtype = _NUMPY_NAMES.get(a.dtype.str.replace("=", "<"))
        if dtype is None:
            raise _error(SafetensorTypeError,
                         f"pinmem.safetensors: array {name!r} has dtype {t.dtype}, which "
                         "safetensors cannot store")
        flat = _np.ascontiguousarray(a).reshape(-1)  # (ascontiguousarray makes 0-d arrays 1-d)
        return dtype, t.shape, flat.nbytes, flat.view(_np.uint8) if flat.nbytes else None, None
    raise _error(SafetensorTypeError,
                 f"pinmem.safetensors: {name!r} is {type(t).__name__}; expected a torch "
                 "tensor or a NumPy array")


# Device staging (stage "auto" or "device"). A device's tensors are first copied on the stream
# they are used on into one scratch buffer on that device (a device copy, some 40 times faster
# than the copy to the host); the file is written from there on a side stream, through pinmem's
# slots (_write_device) or, with tensors elsewhere too, through a pinned snapshot (_snapshot).
# save_file_async returns once that work is queued: work the caller queues later on the
# tensors' stream runs after the scratch copy, so it cannot change the snapshot, and the copies
# to the host run beside the caller's next kernels instead of in front of them. The scratch
# goes back to torch's caching allocator once the copies from it are done.
_SIDE_STREAMS = {}
_SIDE_LOCK = _threading.Lock()
STAGES = ("auto", "device", "host")


def _forget_side_streams():
    # A forked child has no CUDA context of its parent's: its streams are not the child's.
    global _SIDE_LOCK
    _SIDE_STREAMS.clear()
    _SIDE_LOCK = _threading.Lock()


if hasattr(_os, "register_at_fork"):
    _os.register_at_fork(after_in_child=_forget_side_streams)


def _side_stream(torch, dev):
    with _SIDE_LOCK:
        s = _SIDE_STREAMS.get(dev.index)
        if s is None:
            s = _SIDE_STREAMS[dev.index] = torch.cuda.Stream(device=dev)
        return s


def _device_room(torch, dev):
    """The most scratch memory stage "auto" takes on dev: half of what the driver has free.
    Memory torch's allocator keeps cached does not count: between two training steps it holds
    the activations the next step allocates again, while the save still writes."""
    free, _ = torch.cuda.mem_get_info(dev)
    return free // 2


def _device_scratch(torch, dev, views, stage):
    """(scratch, side): one uint8 device tensor holding views (byte views on dev) back to back,
    copied on dev's current stream, and dev's side stream ordered after that copy, for the
    copies out of it; None when stage "auto" finds too little room (then the caller copies
    straight to the host)."""
    need = sum(v.numel() for v in views)
    if stage == "auto" and need > _device_room(torch, dev):
        return None
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    try:
        flat = torch.empty(need, dtype=torch.uint8, device=dev)
    except oom:
        if stage == "auto":
            return None
        raise
    with torch.cuda.device(dev):
        torch.cat(views, out=flat)
    side = _side_stream(torch, dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    return flat, side


def _layout(tensors, metadata, stage):
    """(head, items): the file's first bytes (length and JSON header) and the tensors to write
    after them in file order, as (name, dtype, shape, bytes, byte view or None, stream)."""
    _check_byteorder()
    if stage not in STAGES:
        raise _error(SafetensorInvalidError, f"pinmem.safetensors: stage must be one of "
                     f"{', '.join(STAGES)}, not {stage!r}")
    if not isinstance(tensors, dict):
        raise _error(SafetensorTypeError, f"pinmem.safetensors: expected a dict of names to "
                     f"tensors, not {type(tensors).__name__}")
    if metadata is not None and not (
            isinstance(metadata, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise _error(SafetensorTypeError, "pinmem.safetensors: metadata must be a dict of str to "
                     "str")
    items = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise _error(SafetensorTypeError, f"pinmem.safetensors: tensor names are strings, "
                         f"not {name!r}")
        if name == "__metadata__":
            raise _error(SafetensorInvalidError, "pinmem.safetensors: '__metadata__' cannot name a "
                         "tensor")
        items.append((name,) + _source(name, t))
    # Falling rank in the format's order of dtypes (item sizes fall with it), then name, as the
    # safetensors package orders them: every tensor starts aligned to its item size, the header
    # length being a multiple of 8, and both write the same bytes.
    items.sort(key=lambda it: (-_RANK[it[1]], it[0]))
    header = {"__metadata__": metadata} if metadata is not None else {}  # {} too, as the package
    offset = 0
    for name, dtype, shape, n, _, _ in items:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = _json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER:
        # Checked before the target is touched: a file with a larger header is one that no
        # reader (this one, the package) loads, and it would replace a good one.
        _fail(_pm.PM_ERR_FORMAT, f"pinmem.safetensors: the header would be "
              f"{len(text)} bytes (metadata and tensor names), larger than the "
              f"{MAX_HEADER} bytes a safetensors file may have")
    return _struct.pack("<Q", len(text)) + text, items


def _one_device(items):
    """The device every tensor with bytes is on, when that is one CUDA device (else None)."""
    dev = None
    for _, _, _, n, view, _ in items:
        if not n:
            continue
        if isinstance(view, _np.ndarray) or view.device.type != "cuda":
            return None
        if dev is None:
            dev = view.device
        elif view.device != dev:
            return None
    return dev


def _on_device(items, stage):
    """For stage "device" / "auto" with every tensor on one CUDA device: (scratch, stream), the
    tensors' bytes copied back to back (file order) into one scratch tensor on that device on
    their stream, and a side stream ordered after that copy; else None. The file's data is then
    written straight from the scratch through pinmem's ring of pinned slots (_write_device): the
    disk writes from a few slots that the DMAs keep refilling, so a save needs the ring's pinned
    slots (threads + 2 of file_write_chunk) and not a pinned snapshot of the whole file. On an
    H200 machine's virtual disk a 3 GiB save wrote at 2.44 GB/s, against 2.62 for raw O_DIRECT
    writes from one reused block (bench/results/...-04h-write-sources.jsonl)."""
    if stage == "host":
        return None
    dev = _one_device(items)
    if dev is None:
        return None
    return _device_scratch(_torch(), dev, [view for _, _, _, n, view, _ in items if n], stage)


def _host_only(items):
    """Whether every tensor with bytes is in host memory (CPU tensors, NumPy arrays)."""
    return all(not n or isinstance(view, _np.ndarray) or view.device.type == "cpu"
               for _, _, _, n, view, _ in items)


def _write_host(tmp, head, items):
    """The temporary file as head then every tensor's bytes, fsync'd, written straight from
    the tensors' own memory: one pinmem.write_ranges call, the bytes gathered into pinmem's
    pinned slots as they go out (the slots reused, so the save needs no pinned copy of the
    whole file, and no copy comes before the first write). 1.07 GB of CPU tensors on a 2-CPU
    machine: 0.78x of the disk's own O_DIRECT write, against 0.70x through a pinned snapshot
    of the file and 0.62x through one allocated anew (bench/probes/save_host.py, medians of 6
    rounds). Where the budget cannot hold one slot, each range goes through the page cache."""
    ranges = [(0, head)]
    pos = len(head)
    for _, _, _, n, view, _ in items:
        if n:
            ranges.append((pos, view, n))
            pos += n
    try:
        _pm.write_ranges(tmp, ranges, fsync=True)
    except _pm.BudgetError:
        # one range at a time, buffered: no slot to gather sources into
        for k, (at, src, *n) in enumerate(ranges):
            _pm.write_file(tmp, src, at, nbytes=n[0] if n else None, io="buffered",
                           fsync=k == len(ranges) - 1, truncate=False).wait()


def _write_device(tmp, head, flat, stream):
    """The temporary file as head then flat (device memory) fsync'd: the small head buffered,
    the data through pinmem's ring (DMA into pinned slots on `stream`, O_DIRECT from them)."""
    _pm.write_file(tmp, head).wait()
    _pm.write_file(tmp, flat, len(head), stream=stream, fsync=True, truncate=False).wait()


def _snapshot(tensors, metadata, wait=True, stage="host", layout=None):
    """The whole file in one buffer (pinned when the budget allows): header and every tensor's
    bytes, the device ones copied by DMA; returns once every copy is done.

    wait=False: returns (buffer, copies, keep) at once, copies being (begin, end, Completion)
    of the DMAs still running, in file order (the host ones are done), keep what must live until
    they are done. stage "host": device tensors are DMA'd straight into the buffer on their
    current stream. "device" / "auto": through a scratch copy on their device (above); the
    straight DMAs ("auto" without room) are then waited for here, so that on return nothing but
    stream-ordered work still reads the caller's tensors. layout: _layout's result, if made."""
    head, items = layout or _layout(tensors, metadata, stage)
    start = len(head)
    total = start + sum(it[3] for it in items)
    try:
        buf = _pm.empty(total, "uint8")
    except _pm.BudgetError:  # no pinned memory to spare: slower copies, same file
        buf = _np.empty(total, _np.uint8)
    pending, direct, keep = [], [], []
    try:
        host = _np.asarray(buf)
        host[:start] = _np.frombuffer(head, _np.uint8)
        mv = memoryview(buf)
        on_device = {}  # device -> [(file position, byte view)]
        pos = start
        for name, dtype, shape, n, view, stream in items:
            if n == 0:
                continue
            if isinstance(view, _np.ndarray) or view.device.type == "cpu":
                host[pos:pos + n] = view if isinstance(view, _np.ndarray) else view.numpy()
            elif stage == "host":
                pending.append((pos, pos + n, _pm.copy(mv[pos:pos + n], view, stream)))
            else:
                on_device.setdefault(view.device, []).append((pos, view))
            pos += n
        for dev, parts in on_device.items():
            torch = _torch()
            staged = _device_scratch(torch, dev, [v for _, v in parts], stage)
            if staged is None:
                stream = torch.cuda.current_stream(dev)
                for p, v in parts:
                    direct.append((p, p + v.numel(), _pm.copy(mv[p:p + v.numel()], v, stream)))
                continue
            flat, side = staged
            keep.append(flat)
            # Runs of neighbours in the file are neighbours in the scratch too: one DMA per
            # run, cut into FIRST_PIECE chunks so that the first piece's write starts early.
            at = 0
            i = 0
            while i < len(parts):
                p, n = parts[i][0], parts[i][1].numel()
                i += 1
                while i < len(parts) and parts[i][0] == p + n:
                    n += parts[i][1].numel()
                    i += 1
                for c in range(0, n, FIRST_PIECE):
                    k = min(FIRST_PIECE, n - c)
                    pending.append((p + c, p + c + k,
                                    _pm.copy(mv[p + c:p + c + k], flat[at + c:at + c + k], side)))
                at += n
        _wait_copies(direct)
        pending.sort(key=lambda x: x[0])
        if not wait:
            return buf, pending, keep
        _wait_copies(pending)
        del mv, pending, host
    except BaseException:
        _wait_copies(pending + direct, quiet=True)
        _free(buf)
        raise
    return buf


def _wait_copies(copies, quiet=False):
    """Wait for every copy in copies ((begin, end, Completion)), even after one fails, so that
    none still writes into a buffer about to be freed; then raise the first failure (quiet:
    none, for callers already handling an error)."""
    first = None
    for _, _, c in copies:
        try:
            c.wait()
        except BaseException as e:
            if first is None:
                first = e
    if first is not None and not quiet:
        raise first


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


def _target(path):
    """(path, tmp): the file a save replaces (what a symlink names, not the link) and its
    temporary beside it, created empty now. A save to a place it cannot write (a missing or
    read-only folder, the name of a directory) so fails before any tensor is copied, and
    save_file_async fails in the call rather than in wait()."""
    path = _os.fsdecode(_os.fspath(path))  # bytes too, as the loaders take them
    if _os.path.islink(path):
        path = _os.path.realpath(path)
    if _os.path.isdir(path):
        raise IsADirectoryError(_errno.EISDIR, "pinmem.safetensors: cannot save over a "
                                "directory", path)
    folder, base = _os.path.split(path)
    suffix = f".tmp-{_os.getpid()}-{_secrets.token_hex(4)}"
    try:
        name_max = _os.pathconf(folder or ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    # A name near the folder's limit keeps what fits of it (the temporary is renamed anyway).
    cut = base
    while len(_os.fsencode(cut + suffix)) > name_max and len(cut) > 1:
        cut = cut[:-1]
    tmp = _os.path.join(folder, cut + suffix)
    try:
        _os.close(_os.open(tmp, _os.O_WRONLY | _os.O_CREAT | _os.O_EXCL | _os.O_CLOEXEC, 0o666))
    except OSError as e:
        raise type(e)(e.errno, f"pinmem.safetensors: cannot create the temporary {tmp!r} to "
                      f"save to ({e.strerror})", path) from None
    return path, tmp


def _unlink(tmp):
    try:
        _os.unlink(tmp)
    except FileNotFoundError:
        pass


def _write_durable(buf, path, tmp, copies=(), write=None):
    """buf as the file at path, atomically: written into tmp (from _target) beside it, fsync,
    rename, fsync of the directory. On any failure the temporary is removed and path is as it
    was. The file replaced is freed in the background (_Releaser). copies: DMAs into buf still
    running (_write_pieces); all are waited for before this returns, whatever happens. write:
    instead of buf, a function that writes and fsyncs the temporary it is given."""
    old = None
    try:
        if write is not None:
            write(tmp)
        else:
            _write_pieces(tmp, buf, list(copies))
        try:  # keep an existing file's permissions
            _os.chmod(tmp, _stat.S_IMODE(_os.stat(path).st_mode))
        except FileNotFoundError:
            pass
        old = _hold(path)
        _os.replace(tmp, path)
    except BaseException:
        _wait_copies(copies, quiet=True)  # the caller frees buf next
        if old is not None:
            _os.close(old)  # still linked: closing frees nothing
        _unlink(tmp)
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


def _plan(tensors, metadata, stage, snapshot_stage, from_host=False):
    """What a save writes, as _write_saved takes it: (buf, copies, keep, write). From a device
    scratch when _on_device finds one (write set, buf None); with from_host (a save that
    returns after its write), straight from the tensors when all are in host memory (write
    set, buf None); else from a pinned snapshot made with snapshot_stage (copies: its DMAs
    still running; keep: scratches they read)."""
    layout = _layout(tensors, metadata, stage)
    dev = _on_device(layout[1], stage)
    if dev is not None:
        flat, side = dev
        return None, [], [flat], _functools.partial(_write_device, head=layout[0], flat=flat,
                                                    stream=side)
    if from_host and _host_only(layout[1]):
        return None, [], [], _functools.partial(_write_host, head=layout[0], items=layout[1])
    buf, copies, keep = _snapshot(tensors, metadata, wait=False, stage=snapshot_stage,
                                  layout=layout)
    return buf, copies, keep, None


def _planned(tensors, metadata, stage, snapshot_stage, tmp, from_host=False):
    """_plan, removing the temporary if planning fails (a bad tensor, no memory)."""
    try:
        return _plan(tensors, metadata, stage, snapshot_stage, from_host)
    except BaseException:
        _unlink(tmp)
        raise


def _write_saved(path, tmp, buf, copies, keep, write):
    """_write_durable of a _plan, then everything it held given back: every copy (and with
    `write`, every DMA from the scratch) is done by then, whatever happened."""
    try:
        _write_durable(buf, path, tmp, copies, write)
    finally:
        del copies, write
        keep.clear()  # a scratch goes back to torch's cache only after the copies from it
        if buf is not None:
            _free(buf)


def _save_errors(fn):
    """A save's I/O errors (OSError, pinmem's IoError) raised as SafetensorErrors too
    (_errors.saving), so that code written for the package catches them."""
    @_functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (OSError, _pm.IoError) as e:
            new = _saving(e)
            if new is e:
                raise
            try:
                raise new.with_traceback(e.__traceback__) from e.__cause__
            finally:
                # Kept here, the error would hold its traceback and this frame each other: a
                # cycle, and the save's frames (a device scratch among their locals) would
                # outlive the error until the garbage collector runs.
                del new
    return wrapper


@_save_errors
def save_file(tensors, path, metadata=None, *, stage="auto"):
    """Write `tensors` (a dict of names to torch tensors, CPU or device, or NumPy arrays) to the
    safetensors file at `path`, with optional `metadata` (str -> str). The file is written and
    fsync'd under a temporary name that is then renamed over `path`: on any error `path` is
    left as it was.

    stage: "auto" (the default) or "device": when every tensor is on one CUDA device, their
    bytes are copied into one scratch tensor on it and written from there through pinmem's
    pinned slots ("auto" only when the scratch fits in half the device's free memory; "device"
    raises torch's out-of-memory error otherwise). When every tensor is in host memory (CPU
    tensors, NumPy arrays), their bytes are written straight from it through pinmem's pinned
    slots. "host", and any other case: the tensors are copied into one pinned buffer laid out
    as the file (DMA for device tensors) and written from it."""
    path, tmp = _target(path)
    _write_saved(path, tmp, *_planned(tensors, metadata, stage, "host", tmp, from_host=True))


class SaveHandle:
    """The background write of save_file_async: wait(timeout=None) blocks until the file is
    durable and raises the save's error, done() says whether it has finished, exception(
    timeout=None) waits and returns the error (or None). staged: "device" when device tensors
    went through a scratch copy on their device, "host" when they were copied straight into
    pinned memory (or there were none)."""

    def __init__(self, path, tmp, staged):
        self.path = path
        self._tmp = tmp
        self.staged = staged
        self._finished = _threading.Event()
        self._error = None
        self._thread = None

    def _run(self, buf, copies, keep, write=None):
        try:
            _write_saved(self.path, self._tmp, buf, copies, keep, write)
        except BaseException as e:  # handed to whoever waits
            # Its traceback would keep the finished frames' locals, the device scratch among
            # them, alive for as long as the handle or the error is kept.
            _traceback.clear_frames(e.__traceback__)
            self._error = _saving(e).with_traceback(e.__traceback__)
        finally:
            del buf, copies, keep, write  # (this frame stays in the traceback too)
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


@_save_errors
def save_file_async(tensors, path, metadata=None, *, stage="auto"):
    """save_file, returning once the snapshot is taken (the tensors may be changed from then
    on); the file is written, fsync'd and renamed over `path` on a background thread. Returns a
    SaveHandle: wait() until durable (raising the save's error), done(), exception().

    stage: how device tensors are snapshotted. "host": copied into pinned memory, the call
    returning once those copies are done. "device": copied on their device, on their current
    stream, into one scratch buffer of their size, the call returning as soon as the copies are
    queued (stream order keeps later work on that stream from changing the snapshot, as for any
    torch operation; work on other streams must be ordered after it as usual); the scratch is
    written from the device through pinmem's pinned slots when every tensor is on that one
    device (and copied into a pinned snapshot first otherwise), and is kept until then;
    torch's out-of-memory error if there is no room. "auto" (the default): "device" when the
    scratch fits in half of the device's free memory, otherwise "host". CPU tensors and arrays
    are copied before the call returns either way. The interpreter waits for a save in flight
    before it exits."""
    path, tmp = _target(path)
    buf, copies, keep, write = _planned(tensors, metadata, stage, stage, tmp)
    if not keep:  # nothing staged on a device: the copies read the caller's tensors
        try:
            _wait_copies(copies)
        except BaseException:
            _free(buf)
            _unlink(tmp)
            raise
        copies = []
    handle = SaveHandle(path, tmp, "device" if keep else "host")
    handle._thread = _threading.Thread(target=handle._run, args=(buf, copies, keep, write),
                                       name="pinmem-save")
    del buf, copies, keep, write
    handle._thread.start()
    return handle


# ---- files in memory (the package's load and save) -----------------------------------------

def _to_bytes(tensors, metadata):
    """The safetensors file of `tensors` and `metadata` as bytes, laid out as save_file lays
    it out (the package's save)."""
    head, items = _layout(tensors, metadata, "host")
    parts = [head]
    for _, _, _, n, view, _ in items:
        if not n:
            continue
        if isinstance(view, _np.ndarray):
            parts.append(view.tobytes())
        else:  # a torch byte view, on any device
            parts.append(view.cpu().numpy().tobytes())
    return b"".join(parts)


def _from_bytes(data, framework, strict=True):
    """{name: tensor or array} of the safetensors file held in `data` (bytes-like), each in
    memory of its own (the package's load)."""
    _check_byteorder()
    if isinstance(data, memoryview):
        data = data.cast("B") if data.c_contiguous else data.tobytes()
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _error(SafetensorTypeError, f"pinmem.safetensors: load takes the bytes of a file, "
                     f"not {type(data).__name__}")
    where = "<bytes>"
    _, entries, start, _ = _parse_header(data, where, strict)
    out = {}
    torch = _torch() if framework == "pt" else None
    for name, dtype, shape, begin, end in sorted(entries, key=lambda e: (e[3], e[4])):
        raw = bytearray(data[start + begin:start + end])
        if torch is None:
            np_name = _DTYPES[dtype][2]
            if np_name is None:
                _fail(_pm.PM_ERR_UNSUPPORTED, f"load: tensor {name!r} is {dtype}, which NumPy "
                      "has no type for (pinmem.safetensors.torch.load reads it)")
            out[name] = _np.frombuffer(raw, _np.dtype(np_name)).reshape(shape)
            continue
        t = _torch_dtype(torch, name, dtype, "load")
        tshape = _torch_shape(dtype, shape, "load", name)
        if not raw:
            out[name] = torch.empty(tshape, dtype=t)
        else:
            out[name] = torch.frombuffer(raw, dtype=torch.uint8).view(t).reshape(tshape)
    return out
