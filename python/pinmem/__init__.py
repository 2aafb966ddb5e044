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

from . import _pinmem
from ._pinmem import (  # noqa: F401  (re-exported)
    Buffer,
    Completion,
    DeviceBuffer,
    Error,
    PinnedBuffer,
    Stream,
    backend,
    budget,
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
    block the caller.
    """
    return _pinmem.pin(obj, mapped=mapped, portable=portable)


def copy(dst, src, stream=None, *, nbytes=None, path=None):
    """Copy src into dst asynchronously on `stream`; return a Completion.

    dst, src: pinmem buffers, objects with the buffer protocol (NumPy arrays, pinned or not),
    DLPack producers (torch tensors, CPU or CUDA) or __cuda_array_interface__ objects; both
    C-contiguous. nbytes: bytes to copy (default: all of src; dst must be large enough).
    stream: None (the default stream), a pinmem.Stream, an int handle, a torch.cuda.Stream or a
    CuPy stream. path: 'auto' (default), 'direct', 'staged' or 'register'.

    Pinned sources copy by DMA without blocking; pageable ones are staged through pinned
    buffers. Read a device-to-host result only after Completion.wait() (or done() is True); make
    another library's stream wait with Completion.wait_stream(stream). Both sides are kept alive
    until the copy is done, even if the Completion is dropped.
    """
    return _pinmem.copy(dst, src, stream, nbytes=nbytes, path=path)


# ------------------------------------------------------------------------------------------
# Data loader
# ------------------------------------------------------------------------------------------

import os as _os
import weakref as _weakref

_live_loaders = _weakref.WeakSet()


@_atexit.register
def _close_loaders():
    # Stop worker threads before the interpreter goes (Python datasets call into it).
    for loader in list(_live_loaders):
        try:
            loader.close()
        except Error:
            pass


class NpyDataset:
    """Samples along axis 0 of one or more .npy files (same sample shape and dtype), read by
    pinmem's worker threads straight into pinned batch slots.

    io: 'pread' (default), 'mmap', or 'direct' (O_DIRECT, for data larger than RAM).
    dtype: None (any) or the dtype every file must have ('<f4', 'u1').
    """

    def __init__(self, paths, io="pread", dtype=None):
        if isinstance(paths, (str, _os.PathLike)):
            paths = [paths]
        self.paths = [_os.fspath(p) for p in paths]
        self.io = io
        self.dtype = None if dtype is None else _dtype_name(dtype)

    def _open(self):
        return [_pinmem._dataset_npy(self.paths, self.io, self.dtype)]


class TokenDataset:
    """A raw file of uint16 (token_bytes=2) or uint32 tokens, such as nanoGPT's train.bin.
    Sample i is a window of seq_len + 1 tokens, delivered as (inputs, targets): targets are the
    inputs shifted by one. random=True draws new window starts every epoch from (seed, epoch)."""

    def __init__(self, path, seq_len, token_bytes=2, random=True, stride=0, windows=0, seed=0,
                 io="pread"):
        self.args = (_os.fspath(path), seq_len)
        self.kwargs = dict(token_bytes=token_bytes, random=random, stride=stride,
                           windows=windows, seed=seed, io=io)

    def _open(self):
        return [_pinmem._dataset_tokens(*self.args, **self.kwargs)]


def _as_array(a):
    """An in-memory C-contiguous array (shares memory where it can)."""
    if type(a).__module__.startswith("torch"):
        a = a.detach()
        if a.device.type != "cpu":
            raise InvalidError("PM_ERR_INVALID: pinmem.Loader reads CPU tensors; this one is on "
                               f"{a.device}")
        a = a.contiguous().numpy()
    try:
        m = memoryview(a)
        if m.c_contiguous and m.ndim >= 1:
            return a
    except TypeError:
        pass
    except ValueError as e:  # NumPy cannot describe it (datetime64, non-native long double)
        _pinmem._raise(_pinmem.PM_ERR_INVALID, f"pinmem.Loader cannot read this array: {e}")
    import numpy
    return numpy.ascontiguousarray(a)


def _python_fields(dataset):
    """Datasets for a map-style Python dataset (dataset[i], len(dataset)): one per field of a
    sample (tuple samples, e.g. (image, label)), read through the GIL by the worker threads."""
    import numpy
    n = len(dataset)
    if n == 0:
        raise InvalidError("PM_ERR_INVALID: the dataset is empty")
    first = dataset[0]
    tuple_sample = isinstance(first, (tuple, list))
    fields = list(first) if tuple_sample else [first]
    out = []
    for k, value in enumerate(fields):
        probe = numpy.asarray(value)
        dtype = probe.dtype
        if dtype == numpy.float64 and not isinstance(value, numpy.ndarray) and \
                type(value).__module__ != "torch" and probe.ndim == 0:
            dtype = numpy.dtype(numpy.float64)
        if dtype.kind not in "biufc":
            raise InvalidError(f"PM_ERR_INVALID: field {k} of the samples has dtype {dtype}, "
                               "which pinmem.Loader cannot deliver")

        def fetch(i, k=k, dtype=dtype):
            v = dataset[i]
            if tuple_sample:
                v = v[k]
            return numpy.ascontiguousarray(v, dtype=dtype)
        out.append(_pinmem._dataset_python(fetch, n, probe.shape, dtype.str))
    return out, tuple_sample


def _open_fields(dataset, io):
    """-> (list of C datasets, one per field; whether batches are tuples)."""
    if isinstance(dataset, (NpyDataset, TokenDataset)):
        return dataset._open(), isinstance(dataset, TokenDataset)
    if isinstance(dataset, (str, _os.PathLike)):
        return NpyDataset(dataset, io=io or "pread")._open(), False
    if isinstance(dataset, (list, tuple)) and dataset and \
            all(isinstance(p, (str, _os.PathLike)) for p in dataset):
        return NpyDataset(dataset, io=io or "pread")._open(), False
    tensors = getattr(dataset, "tensors", None)  # torch.utils.data.TensorDataset
    if isinstance(tensors, (list, tuple)) and len(tensors) > 0:
        dataset = tuple(tensors)
    if isinstance(dataset, tuple) and dataset and \
            all(hasattr(a, "shape") or hasattr(a, "__buffer__") for a in dataset):
        arrays = [_as_array(a) for a in dataset]
        n = {len(a) for a in arrays}
        if len(n) != 1:
            raise InvalidError("PM_ERR_INVALID: the arrays of a dataset need the same length "
                               f"(got {sorted(n)})")
        return [_pinmem._dataset_array(a) for a in arrays], True
    if hasattr(dataset, "shape") or isinstance(dataset, (bytes, bytearray, memoryview)):
        return [_pinmem._dataset_array(_as_array(dataset))], False
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        return _python_fields(dataset)
    raise TypeError("pinmem.Loader: the dataset must be .npy path(s), an NpyDataset or "
                    "TokenDataset, an array or tuple of arrays (NumPy, torch CPU tensors, "
                    "TensorDataset), or a map-style dataset with __getitem__ and __len__")


class Batch(tuple):
    """The arrays of one batch, one per field (token datasets: inputs, targets), each a
    pinmem.Buffer exporting DLPack: on the device by default (kDLCUDA, with stream ordering:
    torch.from_dlpack / __dlpack__(stream=s) makes s wait for the batch's copy, nobody blocks),
    or in host memory (device='cpu'). Attributes: epoch, index (within the epoch) and indices
    (the dataset index of each row). The slot goes back to the loader once every array and
    every DLPack tensor made from it is gone (after the work queued on the consumer's stream)."""

    def __new__(cls, arrays, epoch, index, indices):
        self = super().__new__(cls, arrays)
        self.epoch = epoch
        self.index = index
        self.indices = indices
        return self


class _EpochIterator:
    """The batches of one epoch. An iterator object rather than a generator: a generator keeps
    the batch it last yielded in its frame, and on some Python versions (3.12) even close()
    does not let it go, which would keep the batch's slot from the loader. This object holds
    nothing between calls: the caller owns each batch outright."""

    __slots__ = ("_loader", "_mode", "_convert", "_per_epoch", "_done")

    def __init__(self, loader, mode, convert=None):
        self._loader = loader
        self._mode = mode
        self._convert = convert
        self._per_epoch = len(loader)
        self._done = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        b = self._loader._next()
        if b is None:
            self._done = True
            raise StopIteration
        if b.index + 1 >= self._per_epoch:
            self._done = True  # the epoch ends with this batch
        if self._mode == "batch":
            return b
        if self._mode == "torch":
            t = tuple(self._convert(a) for a in b)
            del b
            return t if self._loader._tuple else t[0]
        return b if self._loader._tuple else b[0]

    def close(self):
        """Stop early (as generator.close() does); the loader keeps its position."""
        self._done = True


class Loader:
    """Batches of a dataset, read by worker threads straight into pinned slots and copied to the
    device while the previous batch computes: DataLoader(pin_memory=True) plus
    .to(device, non_blocking=True), without the second copy.

    dataset: .npy path(s) or an NpyDataset, a TokenDataset, an array or a tuple of arrays (NumPy
    arrays, torch CPU tensors, a TensorDataset: read without the GIL), or a map-style dataset
    (dataset[i] -> array or tuple of arrays, len(dataset); read through the GIL, slower).

    Knobs named as torch.utils.data's: batch_size, shuffle, num_workers (0: pinmem's option
    loader_workers; workers are threads), drop_last, prefetch_factor (slots = prefetch_factor *
    max(1, num_workers); None: option loader_prefetch), pin_memory (False: pageable slots and a
    blocking copy, to compare), seed (the shuffle order is a function of (seed, epoch)).
    Also: device (None/'cuda': batches on the current device; 'cpu': in host memory, no copy),
    epochs (None: no end), rank/world_size (sharding as DistributedSampler; default from RANK and
    WORLD_SIZE), io (for .npy paths).

    Iterating yields one epoch's batches, as a DataLoader does: an array for single-array
    datasets, else a Batch (tuple). batches() yields Batch objects with epoch/index/indices. A
    new iterator continues where the last one stopped. Keep at most `prefetch` batches alive at
    once (pinmem.BusyError otherwise): copy out what you need to keep.
    """

    def __init__(self, dataset, batch_size=1, shuffle=False, num_workers=0, drop_last=False,
                 prefetch_factor=None, pin_memory=True, seed=0, *, device=None, epochs=None,
                 rank=None, world_size=None, io=None):
        if device in (None, "cuda", "device") or (isinstance(device, str) and
                                                  device.startswith("cuda")):
            to_device = True
        elif device in ("cpu", "host"):
            to_device = False
        else:
            raise InvalidError(f"PM_ERR_INVALID: device must be None, 'cuda' or 'cpu', not "
                               f"{device!r}")
        self._fields, self._tuple = _open_fields(dataset, io)
        self._config = dict(
            batch_size=int(batch_size), workers=int(num_workers),
            prefetch=int(prefetch_factor) * max(1, int(num_workers)) if prefetch_factor else 0,
            shuffle=bool(shuffle), seed=int(seed), drop_last=bool(drop_last),
            rank=-1 if rank is None else int(rank),
            world_size=-1 if world_size is None else int(world_size),
            pin_memory=bool(pin_memory), device=to_device,
            epochs=0 if epochs is None else int(epochs))
        if epochs is not None and int(epochs) <= 0:
            raise InvalidError("PM_ERR_INVALID: epochs must be None or > 0")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.device = "cuda" if to_device else "cpu"
        self._loaders = []
        self._open(None)
        _live_loaders.add(self)

    def _open(self, resume):
        loaders = []
        try:
            for ds in self._fields:
                loaders.append(_pinmem._Loader(ds, resume=resume, **self._config))
        except BaseException:
            for ld in loaders:
                ld.close()
            raise
        self._loaders = loaders

    def _next(self):
        """The next Batch, or None once every epoch was delivered."""
        if not self._loaders:
            _pinmem._raise(-17, "the loader was closed")
        got = [ld.next() for ld in self._loaders]
        if any(g is None for g in got):
            return None
        first = got[0]
        arrays = []
        for x, y, epoch, index, _ in got:
            if (epoch, index) != (first[2], first[3]):
                _pinmem._raise(-19, "loader fields went out of step")
            arrays.append(x)
            if y is not None:
                arrays.append(y)
        import array as _array
        indices = _array.array("Q")
        indices.frombytes(first[4])
        return Batch(arrays, first[2], first[3], indices)

    def batches(self):
        """Batch objects of one epoch (from the current position to the end of its epoch)."""
        return _EpochIterator(self, "batch")

    def __iter__(self):
        return _EpochIterator(self, "plain")

    def as_torch(self):
        """Like iterating, but each array becomes a torch tensor (torch.from_dlpack: the
        current torch stream waits for the batch's copy, without blocking the host)."""
        import torch
        return _EpochIterator(self, "torch", torch.from_dlpack)

    def __len__(self):
        """Batches per epoch (on this rank)."""
        return self._loaders[0].stats()["batches_per_epoch"]

    @property
    def epoch(self):
        """The epoch of the next batch."""
        return self.state_dict()["epoch"]

    def state_dict(self):
        """Where the loader stands: the next batch it will deliver (plain ints: checkpoint it)."""
        if not self._loaders:
            _pinmem._raise(-17, "the loader was closed")
        return _pinmem._loader_state_fields(self._loaders[0].state())

    def load_state_dict(self, state):
        """Continue from a state_dict(): the next batch delivered is the one it names. The
        dataset, batch_size, shuffle, seed, drop_last and sharding must be the same."""
        packed = _pinmem._loader_state_pack(**{k: int(state[k]) for k in (
            "magic", "flags", "epoch", "batch", "seed", "samples", "batch_size", "rank",
            "world_size")})
        self.close()
        self._open(packed)

    def stats(self):
        """The loader's statistics (summed over the fields of tuple datasets)."""
        if not self._loaders:
            _pinmem._raise(-17, "the loader was closed")
        all_stats = [ld.stats() for ld in self._loaders]
        out = dict(all_stats[0])
        for s in all_stats[1:]:
            for k in ("bytes", "read_seconds", "collate_seconds", "copy_seconds",
                      "device_bytes", "host_bytes", "slot_bytes"):
                out[k] += s[k]
        out["fields"] = len(all_stats)
        return out

    def close(self):
        """Stop the workers and free the slots. BusyError while batches are still in use."""
        for ld in self._loaders:
            ld.close()
        self._loaders = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
