"""torch.distributed.checkpoint (DCP) storage through pinmem: FileSystemWriter, FileSystemReader
and PinnedStager, drop-in for torch's.

DESIGN. The on-disk format is torch's own FileSystemWriter format, unchanged: per rank one
`.distcp` file holding each tensor as the bytes torch.save writes for it (a zip archive: a
pickle naming dtype, shape and strides, then the storage's bytes 64-byte aligned), each
BYTE_IO item as its raw bytes, and a pickled Metadata (`.metadata`) mapping every item to
(file, offset, length). torch's reader loads what this writer writes and the other way round;
DCP's planners do the resharding, so any world size loads any other.

Writing. The small parts of a tensor's archive (headers, pickle, central directory) come from
torch.save itself, run under torch.serialization.skip_data() against a writer that keeps the
bytes and only counts the data: the archive is then exactly torch's, less the data's CRC-32
(and the serialization id derived from the CRCs), which are computed here and patched in (when
torch's crc32 option is on, its default; with ISA-L's crc32 where the isal package is
installed, zlib's otherwise). Each data file is put together in order in pinned chunks of 16
MiB from pinmem's pool (headers, data, tails; a tensor's CRC computed on its copy there) and
each full chunk is written with one pinmem.write_ranges call (O_DIRECT, a request per I/O
thread) while the next is filled: the copy that pinmem makes into its slots anyway, made once
per chunk instead of per tensor. Tensors already in pinned memory (async_save's snapshot) are
not copied: they and the bytes between them are gathered and written 128 MiB at a time with
one pinmem.write_ranges call each, one call after the other. Device tensors are gathered so too,
and each group's are written by one pinmem.write_ranges(crc32=True) call: pinmem's threads copy
them into pinned slots, compute their CRC-32s there and write them, and their archives' tails
follow. An archive is placed so that its
data starts on a 4 KiB boundary of the file (the bytes between items are zeros that no item's
range covers). Small tensors (< 1 MiB) are put where they fall, their archives from the same
templates; torch.save itself writes only what has no template (a quantized tensor, a tensor
subclass, one whose bytes are not its storage's). The writer makes no torch call per tensor: it
reaches a tensor's bytes from its address (_raw), and its chunks are NumPy arrays. On
async_save's thread every torch call hands the interpreter lock to the training loop and waits
to take it back, a wait of the loop's each time.

Durability. Data files get names of their own per save (`__<rank>_<k>.<save>.distcp`), are
fsync'd with their folder before the plan is gathered, and a save's metadata is written to a
temporary, fsync'd and renamed over `.metadata` last: a save that fails, or a rank that dies
mid-write, leaves the previous checkpoint in that folder as it was and loadable, and no new
`.metadata`. A rank that fails removes the files it created; files no metadata names any more
(the previous save's, a failed save's) are removed by the coordinator after the rename, but not
those of another save into the folder still in flight in the process (_Saves: async_save's
thread executor lets saves overlap). The coordinator picks the save's tag, the same on every
rank, so that it knows every rank's files of a save in flight; of two overlapping saves the
folder keeps the one planned later.

Reading. Every file a rank needs is checked against the ranges the metadata gives before any
tensor is touched (a truncated or missing file raises, naming the file, with the destination
state dict as it was), and stays open until the load ends (up to HOLD files), pinmem's reads
going through that open file (their fd argument): a save into the folder that completes
meanwhile removes the files of the checkpoint being read, and the load still reads that
checkpoint whole. Each file is read with
one pinmem.read_ranges call: each tensor whose archive layout the metadata predicts
(torch.save's archive of a contiguous tensor of the stored chunk's dtype and shape) and whose
needed bytes are one range that is its destination's bytes (no resharding, or a cut along the
first dimension) is read straight into its destination
(device memory through pinmem's pinned ring), the archive's head into a pinned scratch beside it
and checked afterwards (another layout: that item is read again on its own); another predicted
tensor (resharding along other dimensions, a destination of another dtype or layout) has the
bytes from its first needed element to its last read into the scratch and copied from there;
other items whole into the scratch; the small holes between the pieces too, so that the file is
one stream. Where the scratch would pass 128 MiB: a file of which the load needs half the items'
bytes or more in spans of 64 to 128 MiB, each with one pinmem.read_file call into one of two
pinned buffers; other files item by item: a tensor's archive is parsed (local headers, pickle)
without torch.load, the bytes needed read straight into the destination where they are one range
of it, else the stored tensor is read into pinned memory and copied. An archive this code does
not know is loaded by torch.load. A load that fails has given its pinned memory back when it
raises.

Staging for dcp.async_save (PinnedStager; also FileSystemWriter.stage). The state dict's
tensors are copied into one pinned buffer from pinmem's pool (those of SMALL bytes or more on 4
KiB boundaries, smaller ones packed between them; within pinmem's budget; kept and reused by the
next save once nothing uses the previous snapshot), or, for device tensors with room on their
device (stage "auto"), into one scratch tensor per dtype there, queued on the current stream, as
save_file_async does; the background write then moves them to the file.
"""
import bisect as _bisect
import collections as _collections
import copy as _copy
import ctypes as _ctypes
import dataclasses as _dataclasses
import gc as _gc
import inspect as _inspect
import io as _io
import os as _os
import pickle as _pickle
import re as _re
import secrets as _secrets
import struct as _struct
import sys as _sys
import threading as _threading
import time as _time
import traceback as _traceback
import warnings as _warnings
import zlib as _zlib

import torch as _torch
from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint.planner import LoadItemType as _LoadItemType
from torch.distributed.checkpoint.planner import WriteItemType as _WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager as _AsyncStager
from torch.distributed.checkpoint.storage import WriteResult as _WriteResult
from torch.futures import Future as _Future

import pinmem as _pm
from pinmem._device import on_device as _on_device
from pinmem.torch import _flat_bytes as _bytes

try:  # ISA-L's CRC-32 (pip install isal): 5-7 times zlib's, the same values
    from isal.isal_zlib import crc32 as _crc32
except ImportError:
    _crc32 = _zlib.crc32

__all__ = ["FileSystemWriter", "FileSystemReader", "PinnedStager"]

_C_CRC = None  # whether pinmem's writes compute CRC-32s (zlib loaded): _c_crc()
_LATER = object()  # a CRC that the group's write computes (_FileOut._put_device)


def _c_crc():
    """Whether pinmem.write_ranges(crc32=True) works here (it needs zlib's libz.so.1, loaded at
    run time); asked once, with a write of no bytes."""
    global _C_CRC
    if _C_CRC is None:
        try:
            _pm.write_ranges(_os.devnull, [], crc32=True)
            _C_CRC = True
        except _pm.UnsupportedError:
            _C_CRC = False
    return _C_CRC


# A tensor of fewer bytes is put where it falls in the file, its data not aligned: no gap, no
# request of its own.
SMALL = 1 << 20
# A file of which a load needs this share of the items' bytes or more is read whole, in spans;
# below it (resharding that takes a part of each stored tensor), only the parts needed.
WANTED = 0.5
# An item of fewer bytes is read whole and parsed from its bytes; larger tensors' archives are
# predicted from the metadata, so their data can be read straight into their destinations.
PREDICT_MIN = 64 << 10
ALIGN = 4096
IOS = ("auto", "buffered", "direct")
STAGES = ("auto", "device", "host")
_DATA_FILE = _re.compile(r"^__\d+_\d+(?:\.([0-9a-f]+))?\.distcp$")  # group 1: the save's tag


def _check_io(io, who):
    if io not in IOS:
        _pm._pinmem._raise(_pm.PM_ERR_INVALID, f"{who}: io must be one of {', '.join(IOS)}, "
                           f"not {io!r}")


def _fsync_dir(path):
    fd = _os.open(path, _os.O_RDONLY | _os.O_DIRECTORY | _os.O_CLOEXEC)
    try:
        _os.fsync(fd)
    finally:
        _os.close(fd)


# ---- torch.save archives ---------------------------------------------------------------------

_M64 = (1 << 64) - 1


def _hash_combine(seed, value):
    # c10::hash_combine on 64-bit size_t: how torch folds the records' CRCs into the archive's
    # serialization id.
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _M64) + (seed >> 2)) & _M64)) & _M64


class _Counting:
    """A file-like torch.save writes to: keeps what it writes, only counts what it skips (the
    data under skip_data())."""

    def __init__(self):
        self.pos, self.parts = 0, []

    def write(self, b):
        b = bytes(b)
        self.parts.append((self.pos, b))
        self.pos += len(b)
        return len(b)

    def seek(self, off, whence=0):
        self.pos = off if whence == 0 else self.pos + off
        return self.pos

    def tell(self):
        return self.pos

    def flush(self):
        pass


def _central(d, base=0):
    """[(name, archive offset of its central entry, crc, local header offset)] of the zip
    archive whose central directory and end records are in d (d's first byte at archive offset
    base). Offsets past 4 GiB are read from the entries' zip64 extra fields."""
    eocd = d.rfind(b"PK\x05\x06")
    if eocd < 0:
        raise ValueError("no end of central directory")
    n = _struct.unpack_from("<H", d, eocd + 10)[0]
    cd = _struct.unpack_from("<I", d, eocd + 16)[0]
    if cd == 0xFFFFFFFF or n == 0xFFFF:
        loc = d.rfind(b"PK\x06\x07", 0, eocd)
        z = _struct.unpack_from("<Q", d, loc + 8)[0] - base
        n = _struct.unpack_from("<Q", d, z + 32)[0]
        cd = _struct.unpack_from("<Q", d, z + 48)[0]
    p = cd - base
    out = []
    for _ in range(n):
        if d[p:p + 4] != b"PK\x01\x02":
            raise ValueError("bad central directory entry")
        crc, csize, usize = _struct.unpack_from("<III", d, p + 16)
        nl, el, cl = _struct.unpack_from("<HHH", d, p + 28)
        off = _struct.unpack_from("<I", d, p + 42)[0]
        if off == 0xFFFFFFFF:
            # the zip64 extra field (id 1) holds, in this order, the 64-bit values of the
            # uncompressed size, the compressed size and the offset where the 32-bit field says so
            x, xe = p + 46 + nl, p + 46 + nl + el
            while x + 4 <= xe:
                hid, hl = _struct.unpack_from("<HH", d, x)
                if hid == 1:
                    q = x + 4 + 8 * ((usize == 0xFFFFFFFF) + (csize == 0xFFFFFFFF))
                    off = _struct.unpack_from("<Q", d, q)[0]
                    break
                x += 4 + hl
            else:
                raise ValueError("a central entry's offset is not in a zip64 extra field")
        out.append((d[p + 46:p + 46 + nl].decode("utf-8"), base + p, crc, off))
        p += 46 + nl + el + cl
    return out


class _Archive:
    """torch.save's bytes for one tensor of a given dtype, shape and strides, less its data:
    head (everything before the data, which starts 64-byte aligned) and tail (after it), and
    where the CRCs and the serialization id go once the data's CRC is known."""

    def __init__(self, proxy, nbytes, crc):
        w = _Counting()
        with _torch.serialization.skip_data():
            _save_as(proxy, w, crc)
        # The bytes torch.save wrote lie before and after the data it skipped (one stretch of
        # nbytes): two images, never one of the whole archive, which may be gigabytes.
        at, gap = 0, None
        for pos, b in w.parts:
            if pos > at:
                gap = (at, pos)
            at = max(at, pos + len(b))

        def image(lo, hi):
            img = bytearray(hi - lo)
            for pos, b in w.parts:
                a, e = max(pos, lo), min(pos + len(b), hi)
                if a < e:
                    img[a - lo:e - lo] = b[a - pos:e - pos]
            return img

        base = gap[1] if gap else 0
        head = image(0, gap[0] if gap else w.pos)
        after = image(base, w.pos)
        entries = _central(after, base)
        names = [e[0] for e in entries]
        data = next(e for e in entries if e[0].endswith("/data/0"))
        sid = next(e for e in entries if e[0].endswith("/.data/serialization_id"))
        h = data[3]
        nl, el = _struct.unpack_from("<HH", head, h + 26)
        self.start = h + 30 + nl + el
        end = self.start + nbytes
        if ((gap and gap != (self.start, end))
                or after[end - base:end - base + 4] != b"PK\x07\x08"):
            raise ValueError("torch.save's archive is not laid out as expected")
        self.head = bytes(head[:self.start])
        self.tail = bytearray(after[end - base:])
        self.nbytes = nbytes
        # positions in tail
        self.data_desc = 4
        self.data_cd = data[1] - end + 16
        h = sid[3] - end
        nl, el = _struct.unpack_from("<HH", self.tail, h + 26)
        self.sid_at = h + 30 + nl + el
        self.sid_desc = self.sid_at + 40 + 4
        self.sid_cd = sid[1] - end + 16
        # the CRCs folded into the id: every record's before the id, in order
        self.crcs = [e[2] for e in entries if e is not sid]
        self.data_k = names.index(data[0])

    def tail_for(self, crc):
        """The tail with the data's CRC (None: the archive's CRCs are off; as written)."""
        tail = bytearray(self.tail)
        if crc is None:
            return tail
        _struct.pack_into("<I", tail, self.data_desc, crc)
        _struct.pack_into("<I", tail, self.data_cd, crc)
        seed = 0
        for k, c in enumerate(self.crcs):
            seed = _hash_combine(seed, crc if k == self.data_k else c)
        sid = tail[self.sid_at:self.sid_at + 40]
        sid[20:] = b"%020d" % seed
        tail[self.sid_at:self.sid_at + 40] = sid
        scrc = _crc32(bytes(sid))
        _struct.pack_into("<I", tail, self.sid_desc, scrc)
        _struct.pack_into("<I", tail, self.sid_cd, scrc)
        return tail


def _save_as(obj, w, crc):
    """torch.save(obj, w) with every record's CRC-32 on or off as crc says: torch.save's own
    writer and serializer, given crc (torch.save passes its global crc32 option, which a writer's
    crc32= must not change under other threads' saves). Where this torch lacks them, torch.save
    itself (the records then follow the global option)."""
    try:
        writer = _torch._C.PyTorchFileWriter(w, bool(crc), _alignment_bytes())
        save = _torch.serialization._save
    except (AttributeError, TypeError):  # pragma: no cover  (another torch's internals)
        _torch.save(obj, w)
        return
    save(obj, writer, _pickle, _torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()


def _alignment_bytes():
    get = getattr(_torch.serialization, "_get_storage_alignment", None)
    return 64 if get is None else get()


_ARCHIVES = {}
_ARCHIVES_LOCK = _threading.Lock()


def _archive(dtype, size, stride, nbytes, crc=None):
    # Every record's CRC follows crc (None: torch's crc32 option), and where the data starts
    # torch's storage alignment: part of the key
    crc = _crc_on() if crc is None else bool(crc)
    key = (dtype, tuple(size), tuple(stride), crc, _alignment())
    with _ARCHIVES_LOCK:
        a = _ARCHIVES.get(key)
    if a is None:
        # An uninitialized CPU tensor stands in for the data: skip_data never reads it.
        a = _Archive(_torch.empty_strided(size, stride, dtype=dtype), nbytes, crc)
        with _ARCHIVES_LOCK:
            if len(_ARCHIVES) > 4096:
                _ARCHIVES.clear()
            _ARCHIVES[key] = a
    return a


try:  # torch.save's options (storage_alignment), read at each archive: they change at run time
    from torch.utils import serialization as _serialization
except ImportError:  # pragma: no cover  (a torch without them)
    _serialization = None


def _alignment():
    try:
        return _serialization.config.save.storage_alignment
    except AttributeError:
        return None


def _crc_on():
    get = getattr(_torch.serialization, "get_crc32_options", None)
    return True if get is None else bool(get())


def _subclass(t):
    """Whether t is a tensor subclass (other than Parameter): pickled by torch.save with its
    class and its own state, its values where its class keeps them, not necessarily in memory
    of its own shape (a wrapper of other tensors, as quantized and float8 training keep
    weights)."""
    return type(t) not in (_torch.Tensor, _torch.nn.Parameter)


def _source(t):
    """(tensor torch.save would store, its bytes (_raw) or None when it must be copied first).
    torch's writer stores tensor.cpu(), cloned when its storage holds more than its bytes:
    contiguous then, or with its own strides when dense. A conjugate or negative view is stored
    with the bit applied (its values as read), not as a flag over its memory. torch.save writes
    a subclass (_subclass) whole. No torch call on the common path (a plain contiguous tensor
    on the CPU or a CUDA device): _raw says why."""
    if t.is_quantized or _subclass(t):
        return t.detach(), None
    if t.is_conj():
        t = t.detach().resolve_conj()
    if t.is_neg():
        t = t.detach().resolve_neg()
    if t.is_contiguous() and t.numel():
        raw = _raw(t)
        if raw is not None:
            return t, raw
    return t.detach(), None


def _raw(t):
    """The bytes of t (contiguous, not empty) as a writer's piece: a memoryview over them on
    the CPU, a _DeviceBytes on a CUDA device (None on another device), made from its address
    without a torch call. Each torch call a writer thread makes (a view, a detach) lets go of
    the interpreter lock and takes it back; with a training loop on another thread, each is a
    wait of that loop's (compare_dcp's thread_waits): about five per tensor, more than DCP's own
    calls of a save of 96 tensors. The caller keeps t alive while the piece is in use."""
    n = t.numel() * t.element_size()
    kind = t.device.type
    if kind == "cpu":
        return memoryview((_ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")
    if kind == "cuda":
        return _DeviceBytes(t.data_ptr(), n, t)
    return None


def _copy_back(dst, raw, stream):
    """raw's bytes (a _DeviceBytes) copied into host memory dst on stream and waited for, with
    their device current, the calling thread's own given back after (_device: none, for a
    thread that had none, as async_save's own)."""
    with _on_device(_pm._pinmem._memory_device(raw.ptr)):
        _pm.copy(dst, raw, stream).wait()


class _DeviceBytes:
    """Bytes of device memory as pinmem.copy takes them (__cuda_array_interface__, read-only,
    no stream: the writer orders its copies itself, _stream_for), holding their tensor;
    sliced as bytes."""

    __slots__ = ("__cuda_array_interface__", "ptr", "nbytes", "owner")

    def __init__(self, ptr, nbytes, owner):
        self.ptr, self.nbytes, self.owner = ptr, nbytes, owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, True), "version": 3}

    def __len__(self):
        return self.nbytes

    def __getitem__(self, s):
        start, stop, step = s.indices(self.nbytes)
        if step != 1:
            raise ValueError("_DeviceBytes: only contiguous slices")
        return _DeviceBytes(self.ptr + start, max(0, stop - start), self.owner)


# ---- writing ------------------------------------------------------------------------------------

# pinmem's I/O threads a file call takes when neither it nor the options say (copy_threads'
# auto: min(12, usable CPUs)), as at import
_IO_THREADS = min(12, len(_os.sched_getaffinity(0)))


def _pinned_pages(n):
    """(PinnedBuffer of n + 4 KiB from pinmem's pool, the offset of its first 4 KiB boundary):
    a pool block is 256-byte aligned (a cached block split for a smaller one starts anywhere on
    that grid), and O_DIRECT moves bytes in place only from memory aligned as the file is.
    pinmem.BudgetError as pinmem.empty."""
    buf = _pm.empty(n + ALIGN, "uint8")
    return buf, -buf.ptr % ALIGN


class _FileOut:
    """One data file of a save, written as its image: every byte (gaps, archive heads, data,
    tails, small tensors, BYTE_IO items) is put in order into pinned chunks of CHUNK bytes from
    pinmem's pool, and each full chunk is written with one pinmem call (O_DIRECT: chunks start
    on 4 KiB boundaries of the file) by WRITERS threads while the next chunk is filled. A
    tensor's CRC-32 is computed on its copy in the chunk, so its archive's tail follows at once.
    Tensors already in pinned host memory (async_save's snapshot) are not copied: from the first
    one on, the file is gathered (the tensors where they are, the bytes between them in small
    buffers of their own) and written GROUP bytes at a time, one group after the other: the
    tensors' 4 KiB-aligned middles from their own memory in requests of up to MIDDLE_CHUNK, then
    the rest (each tensor's last partial page and the bytes up to the next tensor) through the
    page cache (_write_group). The first chunk and the first group are smaller (FIRST). Written
    one pinmem call per tensor instead, 2 ranks' files of 5.3 MiB tensors went to this machine's
    disk at 2.24-2.50 GB/s from a pinned snapshot (each tensor's data, then the few KiB between
    it and the next, apart), through the chunks at 2.56-2.71, the disk's own rate (16 MiB
    chunks, 4 buffers, 2 writers: 2.65-2.68)."""

    CHUNK = 16 << 20
    BUFFERS = 4
    WRITERS = 2
    # A chunk's pinmem call: pinmem's default threads (copy_threads: min(12, usable CPUs)), each
    # writing one request of the chunk (write_unit). 2 ranks' 1 GiB saves from the tensors, 9
    # rounds on a 2-CPU virtual machine (bench/probes/dcp_write_units.py): median 2.95 GB/s in
    # two 8 MiB requests a chunk, 2.60 in the default 1 MiB units (16 requests of about 0.1 ms
    # of CPU each), 3.01 in one 16 MiB request. On 12 or more CPUs the unit stays near 1 MiB,
    # the size pinmem's file defaults were chosen at on the GPU machines.
    WRITE_THREADS = _IO_THREADS
    PINNED_DIRECT = True  # off: pinned tensors too are copied into the chunks
    # Device tensors gathered, copied and CRC'd by pinmem's threads (_put_device); off, or
    # without zlib for pinmem's CRCs: copied into the chunks, piece by piece (put_data)
    DEVICE_GATHER = True
    # Bytes of one gathered write; they go one call after the other (one thread), the file one
    # stream in order: 2 ranks' snapshots of 96 tensors of 21 MiB went to this machine's disk at
    # 1.72-2.32 GB/s in calls of 256 MiB two at a time, at 2.18-2.52 in calls of 64 or 128 MiB
    # one at a time, against 1.33-2.31 for the disk's own stream over the same minutes (load
    # average 4-7 from other work).
    GROUP = 128 << 20
    # The first chunk's bytes and the first group's; each later one twice the one before, up to
    # CHUNK and GROUP. The disk waits for the first one: 16 MiB copied and CRC'd, or a 128 MiB
    # group's CRCs, kept it idle for 5 and 13 ms of a 480 ms save (2 ranks, 1 GiB, 2 CPUs:
    # bench/probes/dcp_save_timeline.py).
    FIRST = 2 << 20
    # I/O threads of one gathered write: as many requests in flight as the chunks' WRITERS calls
    # keep with pinmem's default threads a call (copy_threads: min(12, usable CPUs))
    GATHER_THREADS = WRITERS * _IO_THREADS
    # The tensors' aligned middles: requests of up to MIDDLE_CHUNK, MIDDLE_THREADS in flight
    MIDDLE_CHUNK = 8 << 20
    MIDDLE_THREADS = GATHER_THREADS

    def __init__(self, path, name, io, crc, phases, stream_for):
        self.path, self.name, self.crc, self.phases = path, name, crc, phases
        # device tensor -> the CUDA stream its bytes are copied to the host on
        # (FileSystemWriter._stream_for)
        self.stream_for = stream_for
        self.io = "direct" if io == "auto" else io
        self.fd = _os.open(path, _os.O_WRONLY | _os.O_CREAT | _os.O_EXCL | _os.O_CLOEXEC, 0o666)
        self.pos = 0           # bytes put so far: the file's length once written
        self.cstart = 0        # file offset of the current chunk's first byte (4 KiB aligned until
                               # a gathered part ends elsewhere)
        self.buf = None
        self.fill = 0
        self.cap = min(self.FIRST, self.CHUNK)  # bytes the current chunk takes before its write
        self.free, self.made = [], 0
        self.jobs = _collections.deque()  # (Future, chunk or None) in submission order
        self.results = []
        # Gathering (from the first pinned tensor on): [(file offset, tensor or bytearray)] not
        # yet submitted, its bytes, and the bytearray that collects the bytes put since the
        # last tensor (None: none yet).
        self.group = None
        self.group_bytes = 0
        self.group_cap = min(self.FIRST, self.GROUP)  # bytes the current group takes
        self.small = None
        import concurrent.futures
        self.pool = concurrent.futures.ThreadPoolExecutor(self.WRITERS, "pinmem-dcp-write")
        self.gather = concurrent.futures.ThreadPoolExecutor(1, "pinmem-dcp-gather")

    @classmethod
    def write_unit(cls):
        """Bytes of each request of a chunk's write: the chunk over WRITE_THREADS, in 4 KiB."""
        per = -(-cls.CHUNK // cls.WRITE_THREADS)
        return -(-per // 4096) * 4096

    def _time(self, phase, t0):
        now = _time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - t0
        return now

    def _chunk(self):
        if self.buf is not None:
            return
        t0 = _time.perf_counter()
        while not self.free and self.made >= self.BUFFERS:
            fut, buf = self.jobs.popleft()
            fut.result()
            if buf is not None:
                self.free.append(buf)
        t0 = self._time("wait_disk", t0)
        if self.free:
            self.buf = self.free.pop()
        else:
            # NumPy arrays, not tensors: a torch call on this thread is a wait of the training
            # loop's (_raw)
            import numpy
            try:
                whole, at = _pinned_pages(self.CHUNK)
                self.buf = numpy.frombuffer(whole, numpy.uint8)[at:at + self.CHUNK]
            except _pm.BudgetError:
                self.buf = numpy.empty(self.CHUNK, numpy.uint8)
            self.made += 1
            self._time("alloc", t0)
        self.fill = 0

    def _submit(self):
        """Writes the current chunk's bytes at its place in the file."""
        if self.buf is None or not self.fill:
            return
        buf, n, at = self.buf, self.fill, self.cstart
        if _pm.pointer_info(buf.ctypes.data)["kind"] in ("pool", "registered"):
            kw = dict(io=self.io, threads=self.WRITE_THREADS, chunk=self.write_unit())
        else:
            # A pageable chunk (the budget held no pinned one): through the page cache, which
            # needs no pinned bounce slot (one of write_unit() bytes is more than such a
            # budget holds).
            kw = dict(io="buffered", threads=self.WRITE_THREADS)
        self.jobs.append((self.pool.submit(_pm.write_ranges, self.path, [(at, buf, n)],
                                           fd=self.fd, **kw), buf))
        self.buf = None
        self.cstart += n
        self.fill = 0
        self.cap = min(self.CHUNK, 2 * self.cap)

    def put(self, b):
        mv = memoryview(b).cast("B")
        if self.group is not None:  # gathering: kept beside, written with the tensors
            if self.small is None:
                self.small = bytearray()
                self.group.append((self.pos, self.small, None))
            self.small += mv
            self.pos += len(mv)
            self.group_bytes += len(mv)
            return
        while mv:
            self._chunk()
            n = min(len(mv), self.cap - self.fill)
            self.buf[self.fill:self.fill + n] = mv[:n]
            self.fill += n
            self.pos += n
            mv = mv[n:]
            if self.fill == self.cap:
                self._submit()

    def put_data(self, t, raw):
        """The bytes of t (raw: _raw(t), host or device memory); their CRC-32 (None when the
        writer's CRCs are off)."""
        n = len(raw)
        device = isinstance(raw, _DeviceBytes)
        if device and self.DEVICE_GATHER and (not self.crc or _c_crc()):
            return self._put_device(t, raw)
        if (self.PINNED_DIRECT and not device and self.io == "direct"
                and _pm.pointer_info(t.data_ptr())["kind"] in ("pool", "registered")):
            return self._put_pinned(t, raw)
        if self.group is not None:  # back to the chunks, from here on
            self._flush_group()
            self.group = None
            self.cstart = self.pos
        crc = 0 if self.crc else None
        stream = self.stream_for(t) if device else None
        at = 0
        while at < n:
            self._chunk()
            m = min(n - at, self.cap - self.fill)
            t0 = _time.perf_counter()
            dst = self.buf[self.fill:self.fill + m]
            if not device:
                dst[:] = raw[at:at + m]
            else:  # a DMA into the pinned chunk
                _copy_back(dst, raw[at:at + m], stream)
            t0 = self._time("copy", t0)
            if crc is not None:
                crc = _crc32(self.buf[self.fill:self.fill + m], crc)
                self._time("crc", t0)
            self.fill += m
            self.pos += m
            at += m
            if self.fill == self.cap:
                self._submit()
        return crc

    def _put_pinned(self, t, raw):
        """t's bytes (raw, pinned) gathered where they are, their CRC-32 computed beside the
        writes. The group holds t until they are written."""
        self._gather((self.pos, raw, t), len(raw))
        crc = None
        if self.crc:
            t0 = _time.perf_counter()
            crc = _crc32(raw)
            self._time("crc", t0)
        if self.group_bytes >= self.group_cap:
            self._flush_group()
        return crc

    def _put_device(self, t, raw):
        """t's bytes (raw, device memory) gathered where they are, as _put_pinned's; the group's
        write copies them through pinmem's pinned slots and computes their CRC-32 there (one
        pinmem call for all of a group's device tensors: _write_group). Their CRC is known only
        then, so the archive's tail goes in as a placeholder that _write_group fills in before
        it writes it (add_tensor: _LATER). The group is flushed once the tail is in
        (add_tensor), never between the data and its tail."""
        # [file offset, bytes, tensor, its stream, (the tail's bytearray, offset, archive)]
        self._gather([self.pos, raw, t, self.stream_for(t), None], len(raw))
        return _LATER if self.crc else None

    def _gather(self, entry, n):
        """entry, a tensor's n bytes at self.pos, added to the group (begun here, the chunk's
        bytes so far written first); the bytes put after it go in a small piece of their
        own."""
        if self.group is None:
            self._submit()
            self.group = []
        self.small = None
        self.group.append(entry)
        self.pos += n
        self.group_bytes += n

    def _flush_group(self):
        """The gathered pieces written on the one thread of gathered writes, behind the earlier
        ones (_write_group)."""
        if self.group:
            self.jobs.append((self.gather.submit(self._write_group, self.group), None))
            self.group_cap = min(self.GROUP, 2 * self.group_cap)
        self.group, self.group_bytes, self.small = [], 0, None

    def _write_group(self, group):
        """The middles (one pinmem.write_ranges call in units of MIDDLE_CHUNK), then the rest
        (in the default units); _split_group says why. Written beside each other on two
        threads instead, the rates on this machine's disk stayed within its noise. Pieces of
        the rest under SMALL bytes (a tensor's last partial page, the archive bytes between two
        tensors: a few KiB each) go through the page cache, and the file's fsync writes them
        out together: one direct write each, they waited for the disk one after the other (2
        ranks' 96 tensors each: 20-35 ms of a 500 ms save, 1.6-1.8 ms buffered, the fsync 2-10
        ms longer; a variant of bench/probes/dcp_save_timeline.py)."""
        self._write_device(group)
        middles, rest = self._split_group(group)
        if middles:
            _pm.write_ranges(self.path, middles, io=self.io, threads=self.MIDDLE_THREADS,
                             chunk=self.MIDDLE_CHUNK, fd=self.fd)
        small, large = [], []
        for r in rest:
            (small if len(r[1]) < SMALL else large).append(r)
        if small:
            _pm.write_ranges(self.path, small, io="buffered", threads=1, fd=self.fd)
        if large:
            _pm.write_ranges(self.path, large, io=self.io, threads=self.GATHER_THREADS,
                             fd=self.fd)

    def _write_device(self, group):
        """The group's device tensors, one pinmem.write_ranges call per stream: each unit copied
        into a pinned slot, its CRC-32 computed there and written, by pinmem's threads with the
        interpreter lock let go once for all of them. Then the tails that wait for those CRCs
        are filled in (the bytes between the tensors are written after this)."""
        by_stream = {}
        for item in group:
            if isinstance(item[1], _DeviceBytes):
                by_stream.setdefault(id(item[3]), []).append(item)
        for items in by_stream.values():
            # This thread (the writer's own) works for the tensors' device, as pinmem's calls
            # take the calling thread's: on device 0, a new thread's, the slots' events of
            # another device's copies would be device 0's.
            dev = _pm._pinmem._memory_device(items[0][1].ptr)
            if dev >= 0 and dev != _pm._pinmem._bound_device():
                _pm.set_device(dev)
            crcs = _pm.write_ranges(self.path, [(it[0], it[1]) for it in items], io=self.io,
                                    stream=items[0][3], fd=self.fd, crc32=bool(self.crc))
            for it, crc in zip(items, crcs or ()):
                small, at, arch = it[4]
                tail = arch.tail_for(crc)
                small[at:at + len(tail)] = tail

    @staticmethod
    def _split_group(group):
        """A group's pieces, (file offset, bytes, their tensor or None for bytes of the
        writer's own) -> ranges (file offset, bytes): (each tensor's 4 KiB-aligned middle,
        written in place in units of MIDDLE_CHUNK: one request per tensor up to that size; the
        rest: the tensors' last partial pages and the bytes between tensors, back to back, each
        run 4 KiB-aligned at both ends: _write_group's page cache, or pinmem's slots for a
        piece of SMALL bytes or more). One call over everything in 1 MiB units cost the CPU a
        request per MiB (about 0.1 ms each on a 2-CPU virtual machine: bench/dcp_train_cpu.py),
        and a larger unit for all of it gathers more of each tensor through the slots, where
        units span two pieces."""
        middles, rest = [], []
        for off, src, t, *_ in group:
            if isinstance(src, _DeviceBytes):  # _write_device's
                continue
            n, m = len(src), 0
            if t is not None and off % ALIGN == 0 and t.data_ptr() % ALIGN == 0:
                m = n // ALIGN * ALIGN
            if m:
                middles.append((off, src[:m]))
            if m < n:
                rest.append((off + m, src[m:] if m else src))
        return middles, rest

    def add_bytes(self, item, data):
        b = data.getbuffer() if isinstance(data, _io.BytesIO) else memoryview(data)
        at = self.pos
        self.put(b)
        self.results.append(_result(item, self.name, at, self.pos - at))

    def add_tensor(self, item, t):
        t, raw = _source(t)
        nbytes = t.numel() * t.element_size()
        if raw is None:
            self._add_saved(item, t)
            return
        a = _archive(t.dtype, t.shape, t.stride(), nbytes, self.crc)
        if nbytes < SMALL:
            # Where it falls, its bytes put with the rest: no gap to align a few KiB (an
            # optimizer's steps, a norm's weights), and no torch.save of each (0.13 ms a tensor
            # on a 2-CPU machine, the whole storage layer's time for a state dict of 1536
            # tensors of 10 KiB).
            at = self.pos
            self.put(a.head)
            crc = self.put_small(t, raw)
        else:
            # the data on a 4 KiB boundary of the file: the zeros before the archive are no
            # item's
            self.put(bytes(-(self.pos + len(a.head)) % ALIGN))
            at = self.pos
            self.put(a.head)
            crc = self.put_data(t, raw)
        if crc is _LATER:  # a placeholder, filled in by _write_device
            entry = self.group[-1]
            self.put(a.tail)
            entry[4] = (self.small, len(self.small) - len(a.tail), a)
        else:
            self.put(a.tail_for(crc))
        self.results.append(_result(item, self.name, at, self.pos - at))
        if self.group and self.group_bytes >= self.group_cap:
            self._flush_group()

    def _to_host(self, t):
        """t.cpu(): t itself on the host; from a CUDA device, copied on the writer's stream
        (stream_for) and waited for."""
        if t.device.type != "cuda":
            return t.cpu()
        with _torch.cuda.stream(self.stream_for(t)):
            return t.cpu()

    def put_small(self, t, raw):
        """The bytes of t (raw: _raw(t), fewer than SMALL, host or device memory) put as the
        bytes around them are; their CRC-32 (None when the writer's CRCs are off)."""
        t0 = _time.perf_counter()
        if isinstance(raw, _DeviceBytes):
            b = bytearray(len(raw))
            _copy_back(b, raw, self.stream_for(t))
            t0 = self._time("copy", t0)
        else:
            b = raw
        crc = None
        if self.crc:
            crc = _crc32(b)
            self._time("crc", t0)
        self.put(b)
        return crc

    def _add_saved(self, item, t):
        t0 = _time.perf_counter()
        c = self._to_host(t.detach())
        if c.untyped_storage().size() != c.numel() * c.element_size():
            c = c.clone()
        b = _io.BytesIO()
        _save_as(c, b, self.crc)
        self._time("torch_save_small", t0)
        at = self.pos
        self.put(b.getbuffer())
        self.results.append(_result(item, self.name, at, self.pos - at))

    def close(self, fsync):
        """Every write waited for (also after a failure, so that none runs on), fsync; the
        first error raised."""
        first = None
        t0 = _time.perf_counter()
        try:
            try:
                if self.group is not None:
                    self._flush_group()
                else:
                    self._submit()
            except BaseException as e:
                first = e
            while self.jobs:
                fut, _ = self.jobs.popleft()
                try:
                    fut.result()
                except BaseException as e:
                    if first is None:
                        first = e
            self.pool.shutdown()
            self.gather.shutdown()
            t0 = self._time("wait_disk", t0)
            if first is not None:
                raise first
            if fsync:
                _os.fsync(self.fd)
                self._time("fsync", t0)
        finally:
            self.free, self.buf = [], None
            _os.close(self.fd)


def _result(item, name, offset, length):
    return _WriteResult(index=item.index, size_in_bytes=length,
                        storage_data=_fs._StorageInfo(name, offset, length))


_HAND_OVER_S = 0.0002  # FileSystemWriter._hand_over's and _Staged's sleep


class _Staged(dict):
    """PinnedStager.stage's snapshot when the state dict is a dict: a dict that, pickled on a
    thread other than the one that staged it, first sleeps a moment (once), and unpickles as a
    plain dict. async_save's process executor starts a thread that pickles the snapshot for the
    save's process (device tensors as CUDA IPC handles) while async_save is still returning; a
    thread running Python holds the interpreter lock, and the caller waits for it up to
    sys.getswitchinterval() (5 ms by default), as FileSystemWriter._hand_over says for the
    thread executor. Sleeping hands the lock over, so async_save returns and the pickling goes
    on beside the training loop."""

    def __init__(self, items):
        super().__init__(items)
        self._staged_on = _threading.get_ident()

    def __reduce_ex__(self, protocol):
        on = self.__dict__.pop("_staged_on", None)
        if on is not None and on != _threading.get_ident():
            _time.sleep(_HAND_OVER_S)
        return dict, (), None, None, iter(self.items())


_LET_GO_S = 0.1  # PinnedStager: the longest wait for a written snapshot's last holders


# The tag of the save being planned on this thread, as the coordinator chose it: set where the
# coordinator tags the plans (prepare_global_plan) and where a rank unpickles its part of them
# (DCP scatters the plans), cleared when the rank plans its next save (prepare_local_plan). A
# planner that caches plans (DefaultSavePlanner(enable_plan_caching=True)) gives write_data the
# first save's plan, tag included; the save's own tag comes from here.
_PLANNED = _threading.local()


@_dataclasses.dataclass
class _SavePrefix(_fs._StoragePrefix):
    """A rank's part of a save's plan: torch's file-name prefix, and the save's tag, one for
    all ranks (chosen by the coordinator), which names every data file of the save."""
    tag: str = ""

    def __setstate__(self, state):
        self.__dict__.update(state)
        _PLANNED.tag = self.tag


def _save_code():
    try:
        from torch.distributed.checkpoint import state_dict_saver
        return _inspect.unwrap(state_dict_saver._save_state_dict).__code__
    except (ImportError, AttributeError):
        return None


_SAVE_CODE = _save_code()  # the code of DCP's save (every rank, every executor runs it)


def _saving(thread):
    """Whether thread is inside DCP's save now (its stack holds _save_state_dict's frame);
    where this torch has no such function, whether the thread is alive."""
    if not thread.is_alive():
        return False
    if _SAVE_CODE is None:
        return True
    f = _sys._current_frames().get(thread.ident)
    while f is not None:
        if f.f_code is _SAVE_CODE:
            return True
        f = f.f_back
    return False


class _Saves:
    """The saves into each folder in flight in this process, for the coordinator's cleanup and
    its metadata. Two saves into one folder can overlap: async_save's thread executor starts a
    thread per save, and nothing makes the caller wait for the previous future. A save's data
    files are never removed while it writes them, and a save that finishes after a newer one
    into the same folder does not put its older metadata over the newer checkpoint.

    The coordinator registers a save (folder, tag, its thread) when it plans it and ends it in
    finish. A save that failed on the way (on any rank) never reaches finish: it is in flight
    while its thread is inside DCP's save (_saving), so its files go with the next save's
    cleanup once the exception has left DCP, whatever the thread does next. Another process
    writing into the same folder at the same moment is not seen here."""

    _lock = _threading.Lock()
    _seq = 0
    _flight = {}    # folder -> {tag: (seq, thread)}
    _finished = {}  # folder -> the seq of the newest save whose metadata is in place

    @classmethod
    def begin(cls, folder, tag):
        me = _threading.current_thread()
        with cls._lock:
            cls._seq += 1
            saves = cls._flight.setdefault(folder, {})
            for t, (_, th) in list(saves.items()):
                if th is me or not _saving(th):
                    del saves[t]
            saves[tag] = (cls._seq, me)
            return cls._seq

    @classmethod
    def in_flight(cls, folder, tag):
        """The tags of the other saves into folder still running."""
        with cls._lock:
            return {t for t, (_, th) in cls._flight.get(folder, {}).items()
                    if t != tag and _saving(th)}

    @classmethod
    def finish(cls, folder, tag, seq, install):
        """install() (the metadata put in place) unless a newer save into folder has done so
        already; ends the save either way. Whether it installed."""
        with cls._lock:
            try:
                if cls._finished.get(folder, 0) > seq:
                    return False
                install()
                cls._finished[folder] = seq
                return True
            finally:
                saves = cls._flight.get(folder)
                if saves is not None:
                    saves.pop(tag, None)
                    if not saves:
                        # No save into folder in flight: none needs its record (each step of a
                        # training run may save into a folder of its own, and the records
                        # would pile up for as long as the process runs).
                        del cls._flight[folder]
                        cls._finished.pop(folder, None)


class _PerSave:
    """A writer's attribute that each save sets up in its reset (the folder: checkpoint_id;
    the save's id): read on the thread of a save, that save's value; elsewhere, and in a save
    that set none, the last one set. async_save's thread executor runs each save on a thread
    of its own, and a writer kept for every save (for its stager's buffer) may start the next
    save, into another folder, while the last one still writes: an attribute of the writer
    alone would send the earlier save's remaining files and its metadata to the later one's
    folder."""

    def __set_name__(self, owner, name):
        self.name, self.shared = name, "_shared_" + name

    @staticmethod
    def _mine(obj):
        """This thread's save's values (None: no save has begun on this thread)."""
        return getattr(obj.__dict__.get("_tls"), "per_save", None)

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        mine = self._mine(obj)
        if mine is not None and self.name in mine:
            return mine[self.name]
        try:
            return obj.__dict__[self.shared]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, obj, value):
        obj.__dict__[self.shared] = value
        mine = self._mine(obj)
        if mine is not None:
            mine[self.name] = value


class FileSystemWriter(_fs.FileSystemWriter):
    """torch.distributed.checkpoint's FileSystemWriter, writing through pinmem: same arguments,
    same files (torch's FileSystemReader reads them), plus

    io: 'auto' (the default) and 'direct' write the files in 16 MiB chunks with O_DIRECT
    (pinmem.write_file's io='direct'), 'buffered' through the page cache.
    crc32: store each tensor's CRC-32 in its archive, as torch.save does (None, the default:
    follow torch.serialization.get_crc32_options(), on unless turned off there).
    stage: how dcp.async_save snapshots device tensors when this writer is its stager
    (PinnedStager's stage).

    Each save writes data files of its own names and renames the metadata into place last, so
    the checkpoint the folder held before stays whole until the new one is complete. A writer
    pickles without its stager (async_save's process executor sends it to a process of its
    own, which stages nothing).
    Extensions (_extensions) and the safetensors serialization format are written by torch's
    own code."""

    def __init__(self, path, single_file_per_rank=True, sync_files=True, thread_count=1,
                 per_thread_copy_ahead=10_000_000, cache_staged_state_dict=False,
                 overwrite=True, _extensions=None,
                 serialization_format=_fs.SerializationFormat.TORCH_SAVE, *, io="auto",
                 crc32=None, stage="auto"):
        self._tls = _threading.local()  # the save in flight on this thread (_PerSave, finish)
        super().__init__(path, single_file_per_rank=single_file_per_rank,
                         sync_files=sync_files, thread_count=thread_count,
                         per_thread_copy_ahead=per_thread_copy_ahead,
                         cache_staged_state_dict=cache_staged_state_dict, overwrite=overwrite,
                         _extensions=_extensions, serialization_format=serialization_format)
        _check_io(io, "pinmem.dcp.FileSystemWriter")
        self.io = io
        self.crc32 = crc32
        self._stager = PinnedStager(stage=stage)
        self._staged_on = None  # the thread of a stage() whose save has not started yet
        self._streams = {}  # device -> this writer's CUDA stream for its device-to-host copies
        self.phases = {}  # seconds of this rank's last write_data by phase

    def __getstate__(self):
        # async_save's process executor sends the writer to a process of its own. The stager
        # (its pinned buffer, its lock), the CUDA streams and the thread of the last stage stay
        # here; the copy there gets a stager of its own mode (stage runs here, not there).
        state = self.__dict__.copy()
        state.update(_stager=None, _streams={}, _staged_on=None,
                     _stage_mode=self._stager.stage_mode)
        state.pop("_tls", None)
        return state

    def __setstate__(self, state):
        mode = state.pop("_stage_mode", "auto")
        self.__dict__.update(state)
        self._stager = PinnedStager(stage=mode)
        self._tls = _threading.local()

    path = _PerSave()
    save_id = _PerSave()

    def reset(self, checkpoint_id=None):
        # Every save begins here, on its own thread: its folder is the one checkpoint_id names,
        # else the writer's (the last one set), and its id a new one (_PerSave).
        self._tls.per_save = {}
        super().reset(checkpoint_id)

    def _torch_path(self):
        return (self.serialization_format != _fs.SerializationFormat.TORCH_SAVE
                or len(self.transforms.extensions) > 0)

    def stage(self, state_dict):
        """dcp.async_save's snapshot: PinnedStager.stage."""
        staged = self._stager.stage(state_dict)
        self._staged_on = _threading.get_ident()
        return staged

    def _hand_over(self):
        """Once after a stage, on another thread (the one async_save has just started for the
        save): sleep a moment. async_save's caller then waits for the interpreter lock while
        this thread runs Python, up to sys.getswitchinterval() (5 ms by default): on a GPU
        that wait was as long as the device snapshot itself. Sleeping hands the lock over, so
        async_save returns and the training loop goes on while this thread plans and writes."""
        staged_on = self._staged_on
        if staged_on is not None and staged_on != _threading.get_ident():
            self._staged_on = None
            _time.sleep(_HAND_OVER_S)

    @property
    def checkpoint_id(self):
        # The first thing DCP's save asks its writer, before planning; storage_meta(), which
        # every save calls first in its planning, asks it too.
        self._hand_over()
        return super().checkpoint_id

    def synchronize_staging(self):
        pass

    def prepare_local_plan(self, plan):
        _PLANNED.tag = None  # a new save: no tag from the coordinator yet
        return super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans):
        # The coordinator names the save: one tag for every rank's data files, registered as in
        # flight in this folder until finish (_Saves).
        plans = super().prepare_global_plan(plans)
        if self._torch_path():
            return plans
        tag = _secrets.token_hex(6)
        folder = _os.path.realpath(_os.fspath(self.path))
        self._tls.save = (folder, tag, _Saves.begin(folder, tag))
        _PLANNED.tag = tag
        # Files of saves that failed (on another rank, or at the metadata) go before this save
        # writes: their space may be what it needs (a disk that was full for a moment).
        per_rank = not self.use_collectives and self.rank is not None
        own = _named_by(self._get_metadata_path(self.rank if per_rank else None))
        if not per_rank and own is not None:
            # A checkpoint saved here without collectives (__<rank>.metadata, which DCP's load
            # reads where no .metadata is) stays whole until this save's metadata is in place.
            ranks = _named_by_rank_metadata(folder)
            own = None if ranks is None else own | ranks
        self._sweep(folder, folder, tag, own)
        return [_dataclasses.replace(p, storage_data=_SavePrefix(p.storage_data.prefix, tag))
                if type(p.storage_data) is _fs._StoragePrefix else p for p in plans]

    def close(self):
        self._stager.close()

    def write_data(self, plan, planner):
        try:
            return self._write_own(plan, planner)
        finally:
            # the snapshot (when this save was staged) is no longer needed by this save
            self._stager._written = True

    def _stream_for(self, synced):
        """The chooser of the CUDA stream a save's device-to-host copies go on: this writer's
        own stream on the tensor's device, made to wait, once per storage, for the bytes to be
        ready: for the writer's stager's device scratch the event recorded after its copy (the
        copy was queued on the stream current where stage ran), and for every tensor the
        current stream of the thread that saves. Not the current stream itself: on
        async_save's thread that is the device's default stream, where each copy would wait
        for every kernel the training loop had queued so far, and the loop's next kernels for
        the copy."""
        def stream_for(t):
            dev = t.device
            side = self._streams.get(dev)
            if side is None:
                side = self._streams[dev] = _torch.cuda.Stream(device=dev)
            key = t.untyped_storage().data_ptr()
            if key not in synced:
                synced.add(key)
                ev = self._stager.ready_event(t)
                if ev is not None:
                    side.wait_event(ev)
                side.wait_stream(_torch.cuda.current_stream(dev))
            return side
        return stream_for

    def _write_own(self, plan, planner):
        # not _write_data: torch's writer has a method of that name, which its own write_data
        # (extensions, safetensors) calls
        if self._torch_path():
            return super().write_data(plan, planner)
        prefix = plan.storage_data.prefix
        # names of this save's own, the same tag on every rank (prepare_global_plan; _PLANNED
        # where the planner gave back a cached plan, which holds an earlier save's tag)
        tag = (getattr(_PLANNED, "tag", None) or getattr(plan.storage_data, "tag", "")
               or _secrets.token_hex(6))
        if self.single_file_per_rank:
            buckets = [b for b in _fs._split_by_size_and_type(self.thread_count, plan.items)
                       if b]
        else:
            buckets = [[item] for item in plan.items]
        crc = _crc_on() if self.crc32 is None else bool(self.crc32)
        folder = _os.fspath(self.path)
        made, results = [], []
        self.phases = phases = {}
        stream_for = self._stream_for(set())
        try:
            for k, items in enumerate(buckets):
                name = f"{prefix}{k}.{tag}{_fs.DEFAULT_SUFFIX}"
                path = _os.path.join(folder, name)
                out = _FileOut(path, name, self.io, crc, phases, stream_for)
                made.append(path)
                try:
                    for item in items:
                        if item.type == _WriteItemType.BYTE_IO:
                            out.add_bytes(item, planner.resolve_data(item))
                    for item in items:
                        if item.type != _WriteItemType.BYTE_IO:
                            out.add_tensor(item, planner.resolve_data(item))
                finally:
                    out.close(self.sync_files)
                results += out.results
            if self.sync_files:
                t0 = _time.perf_counter()
                _fsync_dir(folder)
                phases["fsync"] = phases.get("fsync", 0.0) + _time.perf_counter() - t0
        except BaseException:
            for p in made:
                try:
                    _os.unlink(p)
                except OSError:
                    pass
            raise
        fut = _Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata, results):
        if self._torch_path():
            return super().finish(metadata, results)
        metadata.version = _fs.CURRENT_DCP_VERSION
        storage = {}
        for wr_list in results:
            storage.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        folder = _os.fspath(self.path)
        per_rank = not self.use_collectives and self.rank is not None
        final = _os.fspath(self._get_metadata_path(self.rank if per_rank else None))
        tmp = f"{final}.tmp-{_os.getpid()}-{_secrets.token_hex(4)}"

        def install():
            try:
                with open(tmp, "wb") as f:
                    _pickle.dump(metadata, f)
                    f.flush()
                    if self.sync_files:
                        _os.fsync(f.fileno())
                _os.replace(tmp, final)  # atomic: the old metadata until this, the new after
            except BaseException:
                try:
                    _os.unlink(tmp)
                except OSError:
                    pass
                raise
            _remove_stale_tmps(final)
            if self.sync_files:
                _fsync_dir(folder)

        key = _os.path.realpath(folder)
        save = getattr(self._tls, "save", None)
        self._tls.save = None
        if save is None or save[0] != key:  # not planned here (another driver of DCP)
            save = (key, "", _Saves.begin(key, ""))
        _, tag, seq = save
        mine = {s.relative_path for s in storage.values()}
        try:
            installed = _Saves.finish(key, tag, seq, install)
        except BaseException:
            # The metadata could not be put in place (a full disk): the folder keeps the
            # checkpoint it had, and this save's files go (every rank's: their names are here).
            for name in mine:
                try:
                    _os.unlink(_os.path.join(folder, name))
                except OSError:
                    pass
            raise
        if not installed:
            # A save into this folder planned after this one has put its metadata in place:
            # the folder keeps that newer checkpoint, and this save's files go.
            for name in mine:
                try:
                    _os.unlink(_os.path.join(folder, name))
                except OSError:
                    pass
            _warnings.warn(f"pinmem.dcp: a newer save into {folder!r} finished before this "
                           "one, which overlapped it: the folder keeps the newer checkpoint "
                           "and this save's files were removed (wait for an async_save's "
                           "future before the next save into the same folder)",
                           RuntimeWarning, stacklevel=2)
            return
        self._sweep(folder, key, tag, mine)

    def _sweep(self, folder, key, tag, own):
        """Remove the data files of earlier and failed saves: those the coordinator's metadata
        (own: the names it holds; None where it cannot be read, then nothing goes) does not
        name, and not those of the saves in flight. Without collectives every rank is its own
        coordinator, with metadata of its own (__<rank>.metadata) naming its own files
        (__<rank>_*): this rank's files go, not those a checkpoint saved with collectives
        (.metadata) names."""
        if own is None:
            return
        busy = _Saves.in_flight(key, tag)
        if self.use_collectives or self.rank is None:
            _remove_unnamed(folder, own, busy)
            return
        shared = _named_by(self._get_metadata_path(None))
        if shared is not None:
            _remove_unnamed(folder, own | shared, busy, prefix=f"__{self.rank}_")


def _remove_stale_tmps(final):
    """Temporaries of `final` left by saves killed between writing and renaming them
    (`<final>.tmp-<pid>-<hex>`): this process's (its installs run one at a time, so none is
    in flight now) and those of processes that no longer run here. A live process's are kept:
    it may be writing one."""
    folder, base = _os.path.split(final)
    try:
        names = _os.listdir(folder or ".")
    except OSError:
        return
    me = _os.getpid()
    tmp = _re.compile(_re.escape(base) + r"\.tmp-(\d+)-[0-9a-f]+")
    for name in names:
        m = tmp.fullmatch(name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid != me:
            try:
                _os.kill(pid, 0)
                continue  # alive
            except ProcessLookupError:
                pass
            except (PermissionError, OverflowError):
                continue  # alive (another user's), or not a pid of this machine
        try:
            _os.unlink(_os.path.join(folder, name))
        except OSError:
            pass


def _named_by(metadata_path):
    """The data files the metadata at metadata_path names (none where there is no such file);
    None where it cannot be read (then nothing is removed)."""
    try:
        with open(metadata_path, "rb") as f:
            md = _pickle.load(f)
        return {s.relative_path for s in md.storage_data.values()}
    except FileNotFoundError:
        return set()
    except Exception:  # noqa: BLE001  (any unreadable metadata: keep every file)
        return None


_RANK_METADATA = _re.compile(r"^__\d+\.metadata$")


def _named_by_rank_metadata(folder):
    """The data files that the folder's per-rank metadata (__<rank>.metadata: a checkpoint
    saved without collectives) name; None where one of them cannot be read."""
    try:
        names = _os.listdir(folder)
    except OSError:
        return set()
    named = set()
    for name in names:
        if _RANK_METADATA.match(name):
            got = _named_by(_os.path.join(folder, name))
            if got is None:
                return None
            named |= got
    return named


def _remove_unnamed(folder, keep, busy=(), prefix="__"):
    """Data files (names starting with prefix) of earlier or failed saves that the folder's
    metadata no longer names; not those of the saves in flight (tags in busy)."""
    try:
        names = _os.listdir(folder)
    except OSError:
        return
    for name in names:
        m = _DATA_FILE.match(name)
        if (m and name.startswith(prefix) and name not in keep
                and (m.group(1) or "") not in busy):
            try:
                _os.unlink(_os.path.join(folder, name))
            except OSError:
                pass


# ---- reading ------------------------------------------------------------------------------------

class _Meta(_pickle.Unpickler):
    """Unpickles a tensor archive's data.pkl into (dtype, storage numel, storage offset, size,
    stride) without making a tensor; anything else is refused (then torch.load reads it)."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if module == "torch" and name.endswith("Storage"):
            # the dtype by name: touching torch's typed storage classes warns
            return _torch.storage._get_dtype_from_pickle_storage_type(name)
        if (module, name) == ("collections", "OrderedDict"):
            return _collections.OrderedDict
        raise _pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        kind, dtype, key, _location, numel = pid
        if kind != "storage" or key != "0" or not isinstance(dtype, _torch.dtype):
            raise _pickle.UnpicklingError("not one storage")
        return ("storage", dtype, numel)


def _rebuild(storage, storage_offset, size, stride, requires_grad=False, hooks=None,
             metadata=None):
    if metadata:  # a flag over the stored values (conj, neg): torch.load applies it
        raise _pickle.UnpicklingError(f"tensor metadata {sorted(metadata)}")
    return ("tensor", storage, storage_offset, tuple(size), tuple(stride))


def _pread(fd, n, offset, path):
    b = _os.pread(fd, n, offset)
    while len(b) < n:
        more = _os.pread(fd, n - len(b), offset + len(b))
        if not more:
            raise EOFError(f"pinmem.dcp: {path!r} ends at byte {offset + len(b)}, inside an item "
                           f"that runs to byte {offset + n}")
        b += more
    return b


def _records(head):
    """{name after the archive's folder: (data start, data end)} of the records before the
    storage's, and the storage's data start, from the local headers at the start of an archive
    (torch.save writes each record with a data descriptor after it: PK\\x07\\x08, CRC, and
    its size, which must match); None where they are not laid out so."""
    recs, p = {}, 0
    while head[p:p + 4] == b"PK\x03\x04":
        nl, el = _struct.unpack_from("<HH", head, p + 26)
        name = bytes(head[p + 30:p + 30 + nl]).decode("utf-8").split("/", 1)[-1]
        d0 = p + 30 + nl + el
        if name == "data/0":
            return recs, d0
        q = head.find(b"PK\x07\x08", d0)
        while q >= 0 and (q + 16 > len(head)
                          or _struct.unpack_from("<I", head, q + 8)[0] != q - d0):
            q = head.find(b"PK\x07\x08", q + 1)
        if q < 0:
            return None
        recs[name] = (d0, q)
        p = q + 16
    return None


def _parse(fd, offset, length, path):
    """(dtype, size, stride, storage offset, absolute offset of the storage's bytes, numel of
    the storage, item size) of the torch.save archive at [offset, offset + length) of fd, or
    None when it is not one tensor archive this code knows. One read of the archive's first 4
    KiB: the records before the storage's data are small; the central directory at the end is
    not read (a read of its own per tensor cost a cold load a third of its time)."""
    return _parse_head(_pread(fd, min(length, 4096), offset, path), offset, length)


def _fits(size, stride, soff, numel):
    """Whether a tensor of size and stride from element soff lies within a storage of numel
    elements, as torch.load's rebuild checks. The readers view stored tensors in buffers that
    hold other items too, where as_strided checks nothing of the kind: an archive damaged there
    (a byte of its shape or strides) would give the bytes of its neighbours as its values."""
    if (len(size) != len(stride) or soff < 0 or any(d < 0 for d in size)
            or any(st < 0 for st in stride)):
        return False
    if not all(size):
        return True  # no element: torch.load takes any offset
    return soff + sum((d - 1) * st for d, st in zip(size, stride)) < numel


def _parse_head(head, offset, length):
    """_parse from the archive's first bytes (up to 4 KiB), already read."""
    try:
        found = _records(head)
        if found is None or "data.pkl" not in found[0]:
            return None
        recs, d0 = found
        p0, p1 = recs["data.pkl"]
        info = _Meta(_io.BytesIO(head[p0:p1])).load()
        kind, (skind, dtype, numel), soff, size, stride = info
        if kind != "tensor" or skind != "storage":
            return None
        itemsize = _torch.empty((), dtype=dtype).element_size()
        if d0 + numel * itemsize > length or not _fits(size, stride, soff, numel):
            return None
        return dtype, size, stride, soff, offset + d0, numel, itemsize
    except (ValueError, IndexError, KeyError, TypeError, AttributeError, _struct.error,
            _pickle.UnpicklingError, EOFError, UnicodeDecodeError):
        return None


def _one_range(meta, req):
    """(offset from the storage's first byte, length) of the bytes req needs when they are one
    range of the file: a contiguous tensor cut (at most) along its first dimension; else None."""
    dtype, size, stride, soff, data_at, numel, itemsize = meta
    offs, lens = list(req.storage_offsets), list(req.lengths)
    if (stride != _contiguous_strides(size) or len(size) < 1
            or not all(o == 0 and n == s for o, n, s in zip(offs[1:], lens[1:], size[1:]))):
        return None
    row = 1
    for s in size[1:]:
        row *= s
    return (soff + offs[0] * row) * itemsize, lens[0] * row * itemsize


def _first_element(meta, req):
    """The storage index of the first element req needs."""
    stride, soff = meta[2], meta[3]
    return soff + sum(o * st for o, st in zip(req.storage_offsets, stride))


def _bounds(meta, req):
    """[lo, hi): the bytes from the storage's first byte that hold every element req needs
    (from its first needed element to its last)."""
    itemsize, stride = meta[6], meta[2]
    first = _first_element(meta, req)
    if any(n == 0 for n in req.lengths):
        return first * itemsize, first * itemsize
    last = first + sum((n - 1) * st for n, st in zip(req.lengths, stride))
    return first * itemsize, (last + 1) * itemsize


def _plain(target, dtype):
    """Whether target's memory holds its values as dtype, one after the other (a plain tensor,
    not a subclass that keeps them elsewhere; contiguous, no conjugate or negative bit over
    them)."""
    return (not _subclass(target) and target.dtype == dtype and target.is_contiguous()
            and not target.is_conj() and not target.is_neg())


def _dense_for(target, dtype, req):
    """Whether req's bytes, as stored, are target's bytes."""
    return _plain(target, dtype) and tuple(target.shape) == tuple(req.lengths)


def _predict(planner, req, info):
    """_parse's answer for the archive of req's item as the checkpoint's metadata predicts it
    (torch.save's archive of a contiguous tensor of the stored chunk's dtype and shape: what
    both writers write), or None when the metadata does not say or the item's length does not
    match the prediction. _read_file checks the prediction against the head it reads."""
    try:
        idx = req.storage_index
        md = planner.metadata.state_dict_metadata[idx.fqn]
        chunk = next(c for c in md.chunks if tuple(c.offsets) == tuple(idx.offset))
        dtype = md.properties.dtype
        size = tuple(chunk.sizes)
    except (KeyError, AttributeError, StopIteration, TypeError):
        return None
    stride = _contiguous_strides(size)
    numel = 1
    for d in size:
        numel *= d
    itemsize = _torch.empty((), dtype=dtype).element_size()
    try:
        a = _archive(dtype, size, stride, numel * itemsize)
    except (ValueError, RuntimeError, StopIteration):
        return None
    if a.start + numel * itemsize + len(a.tail) != info.length or a.start > 4096:
        return None
    return dtype, size, stride, 0, info.offset + a.start, numel, itemsize


def _wanted(reqs, planner):
    """The share of the bytes of reqs' items (archives) that the load needs: below one half
    (a rank that loads part of each stored tensor), the items are read one by one."""
    md = getattr(getattr(planner, "metadata", None), "state_dict_metadata", None)
    total = wanted = 0
    for req, info in reqs:
        total += info.length
        share = 1.0
        if req.type != _LoadItemType.BYTE_IO and md is not None:
            try:
                idx = req.storage_index
                chunk = next(c for c in md[idx.fqn].chunks
                             if tuple(c.offsets) == tuple(idx.offset))
                need = have = 1
                for n, s in zip(req.lengths, chunk.sizes):
                    need, have = need * n, have * s
                share = need / have if have else 1.0
            except (KeyError, AttributeError, StopIteration, TypeError):
                share = 1.0
        wanted += share * info.length
    return wanted / total if total else 1.0


def _drop_locals(exc):
    """Clears the finished frames in the tracebacks of exc and of the exceptions it chains
    (__cause__, __context__): their locals go, the line numbers stay. A frame still running
    (the one handling exc) is left as it is."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        _traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]


def _open_files_limit():
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return soft if soft != resource.RLIM_INFINITY else 1 << 20
    except (ImportError, OSError, ValueError):
        return 1024


def _commit(planner, req, target):
    """planner.commit_tensor, after the tensor's version counter has moved on: pinmem wrote
    its bytes behind autograd's back, and a graph that saved the tensor before the load must
    see it changed (backward then refuses, as after torch's reader's copy_)."""
    _torch.autograd.graph.increment_version(target)
    planner.commit_tensor(req, target)


def _contiguous_strides(size):
    st, acc = [], 1
    for d in reversed(size):
        st.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(st))


class FileSystemReader(_fs.FileSystemReader):
    """torch.distributed.checkpoint's FileSystemReader, reading through pinmem: same argument
    (the checkpoint's folder), reads what torch's writer and pinmem.dcp.FileSystemWriter write.

    io: as pinmem.read_file's ('auto': O_DIRECT from 64 MiB when the file is not cached).
    Before any tensor is read, every file this rank needs is checked to hold the ranges the
    metadata gives: a truncated or missing file raises (naming it) with the destination as it
    was."""

    # bytes of a file read with one pinmem call, at most: a rank's file in tensors of a few MiB
    # read one call each ran at 1.32-1.91 GB/s cold here, in one call at 1.86-2.25. A span grows
    # to FULL bytes at least where the file allows: io='auto' reads O_DIRECT (when the range is
    # not cached) from 64 MiB up, and cold spans through the page cache read at 1.22-1.24 GB/s
    # here against 1.95-1.97 O_DIRECT (2 ranks, 64 MiB spans).
    SPAN = 128 << 20
    FULL = 64 << 20
    # _read_file: holes between the pieces a load needs (archive tails, the zeros before the
    # next 4 KiB-aligned archive) of up to this many bytes are read too, so that the file is one
    # stream for pinmem.read_ranges
    HOLE = 64 << 10
    # _read_file's pinmem.read_ranges call: bytes of each read. None: read_shape(); 0: pinmem's
    # options (file_direct_chunk, 1 MiB, O_DIRECT; file_chunk, 2 MiB, through the page cache).
    READ_CHUNK = None
    # and its I/O threads (None: read_shape(), pinmem's options file_threads, else copy_threads,
    # or MIN_READ_THREADS where the CPUs are fewer)
    READ_THREADS = None
    MIN_READ_THREADS = 4
    # read_data holds the files of a load open from their check to the end of the load when
    # they are this many or fewer (each an open file descriptor), and no more than a quarter of
    # the process's limit on open files (RLIMIT_NOFILE) allows
    HOLD = 256

    def __init__(self, path, _extension_registry=None, *, io="auto"):
        super().__init__(path, _extension_registry=_extension_registry)
        _check_io(io, "pinmem.dcp.FileSystemReader")
        self.io = io
        self.phases = {}  # seconds of this rank's last read_data by phase

    @classmethod
    def read_unit(cls):
        """Bytes of each read of a file's read_ranges call (read_shape()'s first); None: the
        options'."""
        return cls.read_shape()[0]

    @classmethod
    def read_shape(cls):
        """(bytes of each read, I/O threads) of a file's read_ranges call; None for either:
        pinmem's options (file_direct_chunk, 1 MiB by default / file_chunk; file_threads, else
        copy_threads). READ_CHUNK and READ_THREADS override it. The reads are the options'
        units; where no one set the threads (READ_THREADS, file_threads, copy_threads) and the
        CPUs are fewer than MIN_READ_THREADS, on MIN_READ_THREADS threads: the threads mostly
        wait for the disk, and while one copies a unit out of its slot into a torch tensor the
        others keep the disk busy. On a 2-CPU virtual machine (2 ranks, cold, medians of 5-7
        rounds, the cases in turns: bench/probes/dcp_read_units.py, bench/results/
        debian12-2core-2026-12-06-dcp-read-units-{1g,4g}-b.txt) 1 MiB units on 2 or 4 threads
        loaded at 2.82-2.99 GB/s, 2 MiB on 4 at 2.43-2.44, 4 MiB on 4 at 2.04, 8 MiB on 4 at
        2.01-2.05 and 16 MiB at 1.91, beside the disk's own 16 MiB reads at 2.38-2.44: this
        virtual disk takes at most 254 segments (4 KiB pages) a request, and larger reads reach
        it cut up. The GPU machines' loads met their disks' rate in 1 MiB units on 12 threads
        (docs/dcp.md)."""
        if cls.READ_CHUNK is not None:
            return cls.READ_CHUNK or None, cls.READ_THREADS
        if cls.READ_THREADS:
            return None, cls.READ_THREADS
        opts = _pm.options()
        set_by_user = any(opts[k]["source"] != "default" or opts[k]["value"] not in ("0", "")
                          for k in ("file_threads", "copy_threads"))
        if not set_by_user and _IO_THREADS < cls.MIN_READ_THREADS:
            return None, cls.MIN_READ_THREADS
        return None, None

    def read_data(self, plan, planner):
        folder = _os.fspath(self.path)
        per_file = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if getattr(info, "transform_descriptors", None):
                return super().read_data(plan, planner)
            per_file.setdefault(info.relative_path, []).append((req, info))
        # Every file is checked before anything is read, and held open from then on (up to
        # HOLD files): a save into the folder that completes during the load removes the files
        # of the checkpoint being read, and the load still reads them, through the open file.
        hold = len(per_file) <= min(self.HOLD, _open_files_limit() // 4)
        fds = {}
        try:
            for name, reqs in per_file.items():
                path = _os.path.join(folder, name)
                try:
                    if hold:
                        fds[path] = fd = _os.open(path, _os.O_RDONLY | _os.O_CLOEXEC)
                        size = _os.fstat(fd).st_size
                    else:
                        size = _os.stat(path).st_size
                except FileNotFoundError:
                    raise FileNotFoundError(
                        f"pinmem.dcp: the checkpoint's data file {path!r} is missing") from None
                end = max(info.offset + info.length for _, info in reqs)
                if end > size:
                    _pm._pinmem._raise(_pm.PM_ERR_IO, f"pinmem.dcp: {path!r} is {size} bytes "
                                       "long but the checkpoint's metadata places data up to "
                                       f"byte {end}: the file was truncated (nothing was "
                                       "loaded)")
            self.phases = phases = {}
            shape = self.read_shape()  # the option table is read once a load, not once a file
            for name, reqs in per_file.items():
                path = _os.path.join(folder, name)
                reqs = sorted(reqs, key=lambda r: r[1].offset)
                fd = fds.get(path)
                if fd is None:
                    fds[path] = fd = _os.open(path, _os.O_RDONLY | _os.O_CLOEXEC)
                if self._read_file(fd, path, reqs, planner, phases, shape):
                    pass
                elif _wanted(reqs, planner) >= WANTED:
                    self._read_spans(fd, path, reqs, planner, phases)
                else:  # a small part of each item (resharding): item by item
                    t0 = _time.perf_counter()
                    for req, info in reqs:
                        self._read_item(fd, path, req, info, planner)
                    phases["items"] = phases.get("items", 0.0) + _time.perf_counter() - t0
                if not hold:
                    _os.close(fds.pop(path))
        except BaseException as e:
            # The read's frames hold its pinned scratch (a file's heads and small items, up to
            # SPAN; two spans; a tensor read on its own), and the exception's traceback holds
            # the frames: DCP keeps the exception in its CheckpointException, so the pinned
            # memory stayed in use as long as the caller kept the error, and past that until the
            # next garbage collection (the frames and the error refer to each other). Their
            # locals dropped, it goes back to the pool as the load raises.
            _drop_locals(e)
            raise
        finally:
            for fd in fds.values():
                _os.close(fd)
        fut = _Future()
        fut.set_result(None)
        return fut

    def _read_item(self, fd, path, req, info, planner):
        if req.type == _LoadItemType.BYTE_IO:
            planner.load_bytes(req, _io.BytesIO(_pread(fd, info.length, info.offset, path)))
        else:
            self._read_tensor(fd, path, req, info, planner)

    def _read_file(self, fd, path, reqs, planner, phases, shape):
        """The items reqs needs of one file in one pinmem.read_ranges call; False (nothing read)
        where the scratch it needs would pass SPAN or the items overlap. A tensor whose stored
        layout the metadata predicts (torch.save's archive for its dtype and shape) and whose
        needed bytes are one range that is its destination's bytes is read straight into the
        destination, its archive's head into a pinned scratch beside it; another predicted
        tensor (resharding, a destination of another dtype or layout, or one whose memory an
        earlier destination of the call shares) its head and the bytes from its first needed
        element to its last into the scratch, then copied; every other
        item (BYTE_IO, a layout not predicted) whole into the scratch. The holes between the
        pieces, up to HOLE bytes each, are read too, so the file is one stream. Afterwards each
        head is parsed: a tensor whose archive is not the predicted one is read again on its own
        (_read_item). shape: the bytes of each read and the I/O threads (read_shape(), worked out
        once a load)."""
        t0 = _time.perf_counter()
        pieces = []  # (file offset, bytes, destination tensor or None, place in the scratch)
        done = []    # (req, info, kind, detail) in file order
        scratch = 0
        end = 0
        # memory the call reads into straight, by device: [(first byte, end)], sorted. Two
        # destinations may share memory (tied weights: one Parameter under two names); one
        # read_ranges call refuses destinations that overlap, so a later one goes through the
        # scratch and is copied into its place.
        taken = {}

        def claim(t, n):
            spans = taken.setdefault(t.device, [])
            a = t.data_ptr()
            k = _bisect.bisect(spans, (a, a + n))
            if (k and spans[k - 1][1] > a) or (k < len(spans) and spans[k][0] < a + n):
                return False
            spans.insert(k, (a, a + n))
            return True

        def take(n):  # a place in the scratch, 64-byte aligned as torch's archives are
            nonlocal scratch
            at = -(-scratch // 64) * 64
            scratch = at + n
            return at

        for req, info in reqs:
            if info.offset < end:  # items that overlap: not a file this writes
                return False
            end = info.offset + info.length
            # a small item is read whole into the scratch and parsed there: predicting its
            # archive (torch.save once for each shape) costs more than copying it
            guess = (None if req.type == _LoadItemType.BYTE_IO or info.length < PREDICT_MIN
                     else _predict(planner, req, info))
            target = one = None
            if guess is not None:
                target = planner.resolve_tensor(req).detach()
                one = _one_range(guess, req)
                if one is not None and (not one[1] or not _dense_for(target, guess[0], req)
                                        or not claim(target, one[1])):
                    one = None
            if guess is None:
                at = take(info.length)
                pieces.append((info.offset, info.length, None, at))
                done.append((req, info, "whole", at))
                continue
            data_at = guess[4]
            if one is None:  # the bytes from the first needed element to the last
                lo, hi = _bounds(guess, req)
                at = take(data_at - info.offset)
                pieces.append((info.offset, data_at - info.offset, None, at))
                part = take(hi - lo)
                if hi > lo:
                    pieces.append((data_at + lo, hi - lo, None, part))
                done.append((req, info, "part", (at, guess, target, part, hi - lo)))
                continue
            at = take(data_at - info.offset)
            pieces.append((info.offset, data_at - info.offset, None, at))
            done.append((req, info, "direct", (at, guess, target)))
            first, n = one
            pieces.append((data_at + first, n, _bytes(target), None))
        # holes of up to HOLE bytes read too (into the scratch): one stream
        ranges, at = [], None
        for off, n, dst, s_at in pieces:
            if at is not None and 0 < off - at <= self.HOLE:
                ranges.append((at, off - at, None, take(off - at)))
            ranges.append((off, n, dst, s_at))
            at = off + n
        if scratch > self.SPAN:
            return False
        buf = self._host(scratch)
        plan = [(off, buf[s_at:s_at + n] if dst is None else dst)
                for off, n, dst, s_at in ranges if n]
        devs = {d.device for _, d in plan if d.device.type == "cuda"}
        stream = _torch.cuda.current_stream(devs.pop()) if len(devs) == 1 else None
        t1 = _time.perf_counter()
        phases["plan"] = phases.get("plan", 0.0) + t1 - t0
        _pm.read_ranges(path, plan, io=self.io, stream=stream, threads=shape[1] or 0,
                        chunk=shape[0], fd=fd)
        t0 = _time.perf_counter()
        phases["wait_disk"] = phases.get("wait_disk", 0.0) + t0 - t1
        for req, info, kind, detail in done:
            if kind == "whole":
                self._from_span(path, buf[detail:detail + info.length], info.offset, req, info,
                                planner)
                continue
            at, guess, target = detail[:3]
            head = buf[at:at + min(guess[4] - info.offset, 4096)].numpy().tobytes()
            if _parse_head(head, info.offset, info.length) != guess:
                self._read_item(fd, path, req, info, planner)  # not the predicted archive
                continue
            if kind == "part":
                part, n = detail[3:]
                dtype, stride = guess[0], guess[2]
                # the first needed element at the piece's first byte
                src = buf[part:part + n].view(dtype)
                t = src.as_strided(tuple(req.lengths), stride, src.storage_offset())
                if target.size() != t.size():
                    raise ValueError(f"pinmem.dcp: {path!r}: item {req.storage_index} has shape "
                                     f"{tuple(t.size())}, its destination "
                                     f"{tuple(target.size())}")
                target.copy_(t)
            _commit(planner, req, target)
        phases["copy"] = phases.get("copy", 0.0) + _time.perf_counter() - t0
        return True

    def _read_spans(self, fd, path, reqs, planner, phases):
        """The file's items in spans of FULL to SPAN bytes, each read with one pinmem call into
        one of two pinned buffers (the next span's read runs while this one's items are copied
        to their destinations); an item larger than a span on its own, item by item (straight
        into its destination where one range of the file is one dense destination)."""
        spans = []  # [start (4 KiB aligned), end, [(req, info)]]
        for req, info in reqs:
            s, e = info.offset, info.offset + info.length
            if (spans and spans[-1][1] - spans[-1][0] < self.FULL
                    and e - spans[-1][0] <= self.SPAN):
                spans[-1][1] = max(spans[-1][1], e)
                spans[-1][2].append((req, info))
            else:
                spans.append([s - s % ALIGN, e, [(req, info)]])
        bufs = [None, None]

        def fetch(k):
            start, end, items = spans[k]
            if end - start > self.SPAN:
                return None
            if bufs[k % 2] is None:
                t0 = _time.perf_counter()
                bufs[k % 2] = self._host(self.SPAN)
                phases["alloc"] = phases.get("alloc", 0.0) + _time.perf_counter() - t0
            _pm.read_file(path, bufs[k % 2], start, nbytes=end - start, io=self.io,
                          fd=fd).wait()
            return bufs[k % 2]

        import concurrent.futures
        try:
            with concurrent.futures.ThreadPoolExecutor(1, "pinmem-dcp-read") as ex:
                fut = ex.submit(fetch, 0)
                for k, (start, end, items) in enumerate(spans):
                    t0 = _time.perf_counter()
                    buf = fut.result()
                    t1 = _time.perf_counter()
                    phases["wait_disk"] = phases.get("wait_disk", 0.0) + t1 - t0
                    t0 = t1
                    fut = ex.submit(fetch, k + 1) if k + 1 < len(spans) else None
                    if buf is None:
                        for req, info in items:
                            self._read_item(fd, path, req, info, planner)
                        phases["items"] = phases.get("items", 0.0) + _time.perf_counter() - t0
                        continue
                    for req, info in items:
                        self._from_span(path, buf, start, req, info, planner)
                    phases["copy"] = phases.get("copy", 0.0) + _time.perf_counter() - t0
        finally:
            # A failed load's traceback keeps fetch's frame, which keeps fetch and so its
            # closure: the buffers go back here, not when the error does (read_data).
            bufs.clear()

    def _from_span(self, path, buf, start, req, info, planner):
        lo = info.offset - start
        raw = buf[lo:lo + info.length]
        if req.type == _LoadItemType.BYTE_IO:
            planner.load_bytes(req, _io.BytesIO(raw.numpy().tobytes()))
            return
        target = planner.resolve_tensor(req).detach()
        meta = _parse_head(raw[:4096].numpy().tobytes(), info.offset, info.length)
        if meta is None:  # not an archive we parse: torch's own way
            t = _torch.load(_io.BytesIO(raw.numpy().tobytes()), map_location="cpu",
                            weights_only=True)
            t = _fs.narrow_tensor_by_index(t, req.storage_offsets, req.lengths)
        else:
            dtype, size, stride, soff, data_at, numel, itemsize = meta
            rel = data_at - start
            one = _one_range(meta, req)
            if one is not None and _dense_for(target, dtype, req):
                first, n = one
                if n:
                    _bytes(target).copy_(buf[rel + first:rel + first + n])
                _commit(planner, req, target)
                return
            src = buf[rel:rel + numel * itemsize]
            if src.storage_offset() % itemsize:  # torch's writer places archives at any byte
                src = src.clone()
            t = src.view(dtype)
            t = t.as_strided(size, stride, t.storage_offset() + soff)
            t = _fs.narrow_tensor_by_index(t, req.storage_offsets, req.lengths)
        if target.size() != t.size():
            raise ValueError(f"pinmem.dcp: {path!r}: item {req.storage_index} has shape "
                             f"{tuple(t.size())}, its destination {tuple(target.size())}")
        target.copy_(t)
        _commit(planner, req, target)

    def _read_tensor(self, fd, path, req, info, planner):
        target = planner.resolve_tensor(req).detach()
        meta = _parse(fd, info.offset, info.length, path)
        if meta is None:  # not an archive we parse: torch's own way
            b = _pread(fd, info.length, info.offset, path)
            t = _torch.load(_io.BytesIO(b), map_location="cpu", weights_only=True)
            t = _fs.narrow_tensor_by_index(t, req.storage_offsets, req.lengths)
        else:
            t = self._read_stored(fd, path, meta, req, target)
            if t is None:  # read straight into target
                _commit(planner, req, target)
                return
        if target.size() != t.size():
            raise ValueError(f"pinmem.dcp: {path!r}: item {req.storage_index} has shape "
                             f"{tuple(t.size())}, its destination {tuple(target.size())}")
        target.copy_(t)
        _commit(planner, req, target)

    def _read_stored(self, fd, path, meta, req, target):
        dtype, size, stride, soff, data_at, numel, itemsize = meta
        offs, lens = list(req.storage_offsets), list(req.lengths)
        one = _one_range(meta, req)
        if one is not None:
            first, n = one
            if _dense_for(target, dtype, req):
                if n:
                    stream = (_torch.cuda.current_stream(target.device)
                              if target.device.type == "cuda" else None)
                    _pm.read_file(path, _bytes(target), data_at + first, nbytes=n,
                                  io=self.io, stream=stream, fd=fd).wait()
                return None
            buf = self._host(n)
            if n:
                _pm.read_file(path, buf, data_at + first, nbytes=n, io=self.io,
                              fd=fd).wait()
            return buf.view(dtype).view(lens)
        if not size:  # a 0-d tensor
            if _plain(target, dtype):
                _pm.read_file(path, _bytes(target),
                              data_at + soff * itemsize, nbytes=itemsize, io=self.io,
                              fd=fd).wait()
                return None
        n = numel * itemsize
        buf = self._host(n)
        if n:
            _pm.read_file(path, buf, data_at, nbytes=n, io=self.io, fd=fd).wait()
        t = buf.view(dtype).as_strided(size, stride, soff)
        return _fs.narrow_tensor_by_index(t, offs, lens)

    @staticmethod
    def _host(n):
        """n bytes of host memory to read into: pinned from pinmem's pool, pageable when the
        budget is spent."""
        if n:
            try:
                return _torch.from_dlpack(_pm.empty(n, "uint8"))
            except _pm.BudgetError:
                pass
        return _torch.empty(n, dtype=_torch.uint8)


# ---- staging for async_save ---------------------------------------------------------------------

# One new 1-D tensor holding tensors of one dtype (two or more) one after another, and views of
# it shaped as they are: torch's own flattening (DDP buckets its gradients with it), one call for
# all of them.
_flatten_dense = _torch._utils._flatten_dense_tensors
_unflatten_dense = _torch._utils._unflatten_dense_tensors


def _flatten_bytes(ts, dev):
    """_flatten_dense for tensors of one dtype that torch.cat does not take: their bytes
    concatenated, the result seen as their dtype."""
    n = sum(t.numel() * t.element_size() for t in ts)
    flat = _torch.empty(n, dtype=_torch.uint8, device=dev)
    _torch.cat([_bytes(t.detach().contiguous()) for t in ts], out=flat)
    return flat.view(ts[0].dtype)


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
        return DTensor
    except ImportError:
        return None


# Plain recursive functions, not closures: a closure that calls itself is a reference cycle,
# which would keep the snapshot (and so the pinned buffer) alive until the next gc.
def _collect(v, DTensor, out):
    """The tensors of a state dict (DTensors' local shards), in order."""
    if DTensor is not None and isinstance(v, DTensor):
        out.append(v._local_tensor)
    elif isinstance(v, _torch.Tensor):
        out.append(v)
    elif isinstance(v, dict):
        for x in v.values():
            _collect(x, DTensor, out)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _collect(x, DTensor, out)


def _rebuild_sd(v, DTensor, staged):
    """The state dict v with each tensor replaced by its snapshot (staged: id -> snapshot) and
    every other value deep-copied."""
    if DTensor is not None and isinstance(v, DTensor):
        return DTensor(staged[id(v._local_tensor)], v._spec, requires_grad=False)
    if isinstance(v, _torch.Tensor):
        return staged[id(v)]
    if isinstance(v, dict):
        return {k: _rebuild_sd(x, DTensor, staged) for k, x in v.items()}
    if isinstance(v, list):
        return [_rebuild_sd(x, DTensor, staged) for x in v]
    if isinstance(v, tuple):
        return tuple(_rebuild_sd(x, DTensor, staged) for x in v)
    return _copy.deepcopy(v)


# PinnedStager packs a tensor of fewer than SMALL bytes (the writer copies it out with the bytes
# around it, never with O_DIRECT from where it is) on a boundary of PACK bytes, or of its element
# size when it is smaller: an optimizer's state holds a 0-d step counter for each parameter, and
# a page each made 10,000 of them 40 MiB of pinned memory for 40 KB of values.
PACK = 64


def _snapshot_places(ts):
    """([offset of each tensor in the snapshot's buffer], the buffer's bytes). A tensor of SMALL
    bytes or more starts on a 4 KiB boundary (the buffer does: _pinned_pages), so that the
    writer writes its middle with O_DIRECT from where it is (_FileOut._split_group); a smaller
    one on PACK bytes, or its element size where it takes fewer bytes, packed behind the one
    before it."""
    places, at = [], 0
    for t in ts:
        nb = t.numel() * t.element_size()
        align = ALIGN if nb >= SMALL else PACK if nb >= PACK else t.element_size()
        at = -(-at // align) * align
        places.append(at)
        at += nb
    return places, at


class PinnedStager(_AsyncStager):
    """An AsyncStager for dcp.async_save(..., async_stager=PinnedStager()) (and the stage of
    pinmem.dcp.FileSystemWriter): snapshots the state dict's tensors (plain tensors and DTensors'
    local shards) so that training may change them as soon as async_save returns.

    stage: "auto" (the default): device tensors are copied on their device, on the current
    stream, into one scratch tensor per dtype, when they fit in half of the device's free
    memory (the call returns once the copies are queued; the background write moves them to
    the file through pinmem's ring); otherwise, and for "host", every tensor is copied into one
    pinned buffer from pinmem's pool (device tensors by DMA, waited for). "device": the device
    scratch or torch's out-of-memory error. A tensor subclass other than Parameter is copied
    by its own clone(), as itself (to the host with "host"). The pinned buffer is the size of
    the snapshot (tensors of SMALL bytes or more 4 KiB aligned, for O_DIRECT; smaller ones
    packed: _snapshot_places), within pinmem's budget (pageable
    memory when the budget is spent), and kept for the next save, which reuses it once nothing
    holds the previous snapshot (once FileSystemWriter has written it, waiting up to _LET_GO_S
    for the thread that wrote it to let go); close() gives it back. Other values of the state
    dict are deep-copied."""

    _synchronize_after_execute = False

    def __init__(self, stage="auto"):
        if stage not in STAGES:
            raise ValueError(f"pinmem.dcp.PinnedStager: stage must be one of "
                             f"{', '.join(STAGES)}, not {stage!r}")
        self.stage_mode = stage
        # The kept pinned buffers, the last used first: [buffer, the snapshot's bytes in it,
        # where they start]. Two at most: a planner given to every save (as plan caching is
        # used) holds the last snapshot until the next save sets it up, after the next stage,
        # so the stages alternate between two.
        self._bufs = []
        self._lock = _threading.Lock()
        self._written = False  # the last snapshot's save is over (FileSystemWriter tells)
        self._ready = {}  # device -> (its scratch tensors' storage pointers, event after the copy)
        # What the last stage did: bytes, pinned, device, cloned (subclass tensors), reused, and
        # its seconds, with them by phase: find (the state dict's tensors), check (the device's
        # free memory), device_copy (the device scratch allocated, the copy queued), views (the
        # copies cut out of it), pinned_alloc and pinned_copy (the pinned buffer, the copies
        # waited for), rebuild (the snapshot's state dict), other.
        self.last = {}

    def _pinned(self, n):
        """(writable memoryview of n bytes, reused?) of a kept buffer of n bytes that no
        snapshot uses, else of a new one."""
        with self._lock:
            # Kept buffers of another size are dropped (freed with their snapshots' last
            # holders). A buffer is free when only its entry (and getrefcount's argument) holds
            # it: each snapshot holds it once, through its memoryview.
            self._bufs = [k for k in self._bufs if k[1] == n]
            free = lambda: next((k for k in self._bufs if _sys.getrefcount(k[0]) <= 2), None)
            got = free()
            if got is None and self._bufs:
                # DCP's save leaves its planner, which holds the snapshot, in a reference
                # cycle: collected here, not at some later gc.
                _gc.collect()
                got = free()
            if got is None and self._bufs and self._written:
                # The last snapshot's bytes are in their file, but the thread that wrote them
                # may not have let go yet: the executor async_save runs the save on completes
                # the future, then drops its arguments, and the caller's next async_save can
                # come in between. Waiting for that costs a millisecond or two; a stage into a
                # new buffer costs its allocation (512 MiB: 0.57-0.76 s against 0.05-0.08 s
                # into the kept one, on a 2-CPU machine).
                end = _time.monotonic() + _LET_GO_S
                while got is None and _time.monotonic() < end:
                    _time.sleep(0.001)
                    got = free()
                if got is None:
                    _gc.collect()
                    got = free()
            if got is not None:
                self._bufs.remove(got)
                self._bufs.insert(0, got)
                buf, _, at = got
                del got
                return memoryview(buf)[at:at + n], True
            del got
            try:
                buf, at = _pinned_pages(n)
            except _pm.BudgetError:
                return memoryview(bytearray(n)), False
            # the least recently used one, still held, goes with its last holder
            self._bufs = [[buf, n, at]] + self._bufs[:1]
            # one memoryview of buf, sliced: a single reference to it, as the count of holders
            # above expects
            return memoryview(buf)[at:at + n], False

    def stage(self, state_dict):
        clock = _time.perf_counter
        t0 = clock()
        DTensor = _dtensor_type()
        leaves = []
        _collect(state_dict, DTensor, leaves)
        staged = {}
        host, by_dev = [], {}
        cloned = 0
        for t in leaves:
            if id(t) in staged:
                continue
            staged[id(t)] = None
            if _subclass(t):
                # copied as itself, by its class's own clone (to the host for "host")
                src = t.detach()
                staged[id(t)] = (src.to("cpu", copy=True)
                                 if src.device.type == "cuda" and self.stage_mode == "host"
                                 else src.clone())
                cloned += 1
            elif t.device.type == "cuda" and self.stage_mode != "host":
                by_dev.setdefault(t.device, []).append(t)
            else:
                host.append(t)
        device_bytes = 0
        phases = {"check": 0.0, "device_copy": 0.0, "views": 0.0}
        t1 = clock()
        for dev, ts in by_dev.items():
            views = self._device_snapshot(dev, ts, phases)
            if views is None:
                host += ts
                continue
            for t, v in zip(ts, views):
                staged[id(t)] = v
                device_bytes += v.numel() * v.element_size()
        t2 = clock()
        places, total = _snapshot_places(host)
        reused = False
        if host:
            mem = None  # empty tensors alone take no buffer, but are staged all the same
            if total:
                mem, reused = self._pinned(total)
                self._written = False
            phases["pinned_alloc"] = clock() - t2
            t2 = clock()
            copies = []
            for t, at in zip(host, places):
                nb = t.numel() * t.element_size()
                # A storage of its own for each tensor, over its place in the buffer, not views
                # of one storage: torch's pickling for another process (async_save's process
                # executor) moves a CPU storage into shared memory, and two DTensors over one
                # storage crash it (torch 2.15).
                raw = _torch.frombuffer(mem[at:at + nb], dtype=_torch.uint8) if nb else \
                    _torch.empty(0, dtype=_torch.uint8)
                dst = raw.view(t.dtype).view(t.shape)
                if t.device.type == "cpu":
                    dst.copy_(t.detach())
                else:
                    src = t.detach().contiguous()
                    stream = _torch.cuda.current_stream(t.device) if t.device.type == \
                        "cuda" else None
                    if nb:
                        copies.append((_pm.copy(raw, _bytes(src), stream), src))
                staged[id(t)] = dst
            del mem
            for c, _ in copies:
                c.wait()
            phases["pinned_copy"] = clock() - t2
        t3 = clock()
        out = _rebuild_sd(state_dict, DTensor, staged)
        if type(out) is dict:
            out = _Staged(out)
        t4 = clock()
        phases.update(find=t1 - t0, rebuild=t4 - t3)
        phases["other"] = max(0.0, (t4 - t0) - sum(phases.values()))
        self.last = {"bytes": total + device_bytes, "pinned": total, "device": device_bytes,
                     "cloned": cloned, "reused": reused, "seconds": t4 - t0, "phases": phases}
        return out

    def _device_snapshot(self, dev, ts, phases):
        """Copies of the device tensors ts, on their device dev: one scratch tensor per dtype,
        each filled by one concatenation queued on the current stream, and the copies views of
        it. None when they do not fit (stage "auto": in half of the device's free memory, or
        the allocation fails). One call each to flatten and to cut up a group, not a few torch
        calls per tensor: on a GPU, where nothing waits for the copy, those per-tensor calls
        were most of async_save's return (1-2 ms for 96 tensors)."""
        clock = _time.perf_counter
        need = sum(t.numel() * t.element_size() for t in ts)
        if not need:
            return None
        if self.stage_mode == "auto":
            t0 = clock()
            free, _ = _torch.cuda.mem_get_info(dev)
            phases["check"] += clock() - t0
            if need > free // 2:
                return None
        oom = getattr(_torch, "OutOfMemoryError", None) or _torch.cuda.OutOfMemoryError
        groups = {}  # dtype -> indices into ts
        for i, t in enumerate(ts):
            groups.setdefault(t.dtype, []).append(i)
        views = [None] * len(ts)
        storages = set()
        t0 = clock()
        try:
            with _torch.no_grad(), _torch.cuda.device(dev):
                for idx in groups.values():
                    group = [ts[i] for i in idx]
                    if len(group) == 1:  # flattening one tensor would give a view, not a copy
                        flat = _torch.empty(group[0].numel(), dtype=group[0].dtype, device=dev)
                        flat.view(group[0].shape).copy_(group[0])
                    else:
                        try:
                            flat = _flatten_dense(group)
                        except oom:
                            raise
                        except (RuntimeError, NotImplementedError):
                            # a dtype torch's concatenation does not take on this device:
                            # concatenated as bytes, then seen as the dtype
                            flat = _flatten_bytes(group, dev)
                    storages.add(flat.untyped_storage().data_ptr())
                    t1 = clock()
                    phases["device_copy"] += t1 - t0
                    for i, v in zip(idx, _unflatten_dense(flat, group)):
                        t = ts[i]
                        # an empty tensor gets a storage of its own, of its own shape
                        views[i] = v if v.shape == t.shape else _torch.empty(
                            t.shape, dtype=t.dtype, device=dev)
                    t0 = clock()
                    phases["views"] += t0 - t1
                ev = _torch.cuda.Event()
                ev.record(_torch.cuda.current_stream(dev))
        except oom:
            if self.stage_mode == "auto":
                return None
            raise
        self._ready[dev] = (storages, ev)
        return views

    def ready_event(self, t):
        """The CUDA event after the copy into the device scratch t is a part of (None: t is no
        part of this stager's last scratch on its device)."""
        got = self._ready.get(t.device)
        if got is not None and t.untyped_storage().data_ptr() in got[0]:
            return got[1]
        return None

    def synchronize_staging(self):
        pass

    def close(self):
        with self._lock:
            bufs, self._bufs = self._bufs, []
        for buf, _, _ in bufs:
            try:
                buf.release()
            except _pm.Error:  # a snapshot still uses it: freed with its last user
                pass

