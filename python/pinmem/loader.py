"""DESIGN: pinmem.Loader, the data loader's Python side.

The C loader (src/loader/) fills pinned batch slots on its threads and copies each slot to the
device; this module picks the C dataset for what the user passed (.npy files, arrays, a
map-style Python dataset read on threads or by worker processes, see _workers.py), shapes the
delivered slots into the sample's structure, and keeps the epoch, sampler and resume logic
around the C loader.
"""

import atexit as _atexit
import numbers as _numbers
import operator as _operator
import os as _os
import re as _re
import threading as _threading
from time import perf_counter as _perf_counter

from . import _pinmem
from . import _dtype_name
from ._args import int_arg as _int_arg
from . import _device
from . import _staging
from . import _workers
from ._pinmem import BusyError, Error, InvalidError  # noqa: F401

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


def _npy_descr(dtype):
    """dtype as a .npy header writes it ('<f4'): NumPy dtypes and names ('float32'), torch
    dtypes, Python's float; text NumPy does not know is passed on as given, for the header
    parser to judge."""
    text = _dtype_name(dtype)
    try:
        import numpy as np
        dt = np.dtype(text[6:] if text.startswith("torch.") else
                      dtype if hasattr(dtype, "fields") else text)
        d = np.lib.format.dtype_to_descr(dt)
    except (ImportError, TypeError, ValueError):
        return text
    if not isinstance(d, str):
        raise InvalidError(f"PM_ERR_INVALID: NpyDataset: dtype={dtype!r} is structured; dtype= "
                           "checks a plain dtype ('<f4'), and the files' own fields are read "
                           "from their headers: leave dtype=None")
    return d


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
        self.dtype = None if dtype is None else _npy_descr(dtype)

    def _open(self):
        return _pinmem._dataset_npy(self.paths, self.io, self.dtype)


class TokenDataset:
    """A raw file of uint16 (token_bytes=2) or uint32 tokens, such as nanoGPT's train.bin.
    Sample i is a window of seq_len + 1 tokens, delivered as (inputs, targets): targets are the
    inputs shifted by one. random=True draws new window starts every epoch from (seed, epoch)."""

    def __init__(self, path, seq_len, token_bytes=2, random=True, stride=0, windows=0, seed=0,
                 io="pread"):
        # Each checked by name: windows=-1 wrapped to 2**64-1 windows (an epoch without end),
        # 2**64 to 0 (the default), and a bad stride was reported as seq_len.
        seq_len = _int_arg("seq_len", seq_len, 1, (1 << 63) - 1)
        stride = _int_arg("stride", stride, 0, (1 << 63) - 1)
        windows = _int_arg("windows", windows, 0, (1 << 64) - 1)
        seed = _int_arg("seed", seed, -(1 << 63), (1 << 64) - 1) % (1 << 64)
        self.args = (_os.fspath(path), seq_len)
        self.kwargs = dict(token_bytes=token_bytes, random=random, stride=stride,
                           windows=windows, seed=seed, io=io)

    def _open(self):
        return _pinmem._dataset_tokens(*self.args, **self.kwargs)


def _as_array(a):
    """An in-memory C-contiguous NumPy array (shares memory where it can), and the name of the
    dtype its bits are when NumPy has no such type (bfloat16, float8: their bits as unsigned
    integers of the same size), else None."""
    import numpy
    from . import _workers
    if type(a).__module__.startswith("torch"):
        a = a.detach()
        if a.device.type != "cpu":
            raise InvalidError("PM_ERR_INVALID: pinmem.Loader reads CPU tensors; this one is on "
                               f"{a.device}")
        bits = _workers.tensor_bits(a)
        if bits is not None:  # bfloat16, float8...: their bits, and the dtype's name
            return _contiguous(numpy, bits[0]), bits[1]
        try:
            a = a.contiguous().numpy()
        except (TypeError, RuntimeError) as e:
            raise InvalidError(f"PM_ERR_INVALID: pinmem.Loader: a {a.dtype} tensor has no type "
                               f"pinmem can batch ({e}); convert it") from None
    elif not hasattr(type(a), "__array_interface__") and hasattr(type(a), "__dlpack__"):
        try:
            memoryview(a).release()
        except TypeError:
            a = numpy.from_dlpack(a)
    elif isinstance(a, numpy.ma.MaskedArray):
        raise _workers.masked_error("an array dataset")
    return _contiguous(numpy, a), None


def _contiguous(numpy, a):
    """a as a C-contiguous array, 0-d kept 0-d (ascontiguousarray makes it shape (1,), and a
    scalar became a dataset of one sample, which the caller refuses as DataLoader does)."""
    a = numpy.asarray(a)
    return a if a.ndim == 0 else numpy.ascontiguousarray(a)


def _descr_text(dtype, what):
    """NumPy's descr of a dtype as text ('<f4', '>i8', '<U10', "[('a', '<i4')]"), refusing
    dtypes without fixed-size bytes (objects: their bytes are pointers)."""
    import numpy
    if dtype.hasobject:
        raise InvalidError(f"PM_ERR_INVALID: {what} has dtype {dtype}, which holds Python "
                           "objects (pointers): pinmem.Loader delivers fixed-size numbers and "
                           "records only")
    if dtype.itemsize == 0:
        raise InvalidError(f"PM_ERR_INVALID: {what} has dtype {dtype}, which has no fixed size")
    d = numpy.lib.format.dtype_to_descr(dtype)
    return d if isinstance(d, str) else repr(d)


def _dtype_from_descr(text):
    """The NumPy dtype a field's descr text names (structured types as .npy headers write them)."""
    import numpy
    if text.startswith("["):
        import ast
        return numpy.lib.format.descr_to_dtype(ast.literal_eval(text))
    return numpy.dtype(text)


# The samples tried in turn for the structure of a Python dataset's samples: an exception in
# dataset[0] belongs to sample 0's batch (as in torch's DataLoader, the other batches come),
# so the structure is taken from the first of these samples that reads.
_DESCRIBE_TRIES = 16


def _first_that_reads(n, read, skip):
    """(i, read(i)) for the first i of the first _DESCRIBE_TRIES samples (of n) whose read does
    not raise; an exception skip(e) refuses is raised at once, and where every read raises, the
    first sample's exception."""
    first = None
    for i in range(min(n, _DESCRIBE_TRIES)):
        try:
            return i, read(i)
        except Exception as e:
            if not skip(e):
                raise
            first = e if first is None else first
    if first is None:
        raise InvalidError("PM_ERR_INVALID: the dataset is empty")
    raise first


def _sample(dataset, i):
    """dataset[i]; StopIteration out of it is an error naming the index."""
    try:
        return dataset[i]
    except StopIteration as e:
        raise _stop_iteration_error(i, e) from e


def _python_dataset(dataset, schema=None):
    """One C dataset over a map-style Python dataset read on pinmem's threads (through the
    GIL): dataset[i] is called once per sample, for all its fields, so random augmentation
    stays consistent across them (and once more for the first sample that reads, to learn the
    structure: _DESCRIBE_TRIES; schema: the structure a loader learned already).
    -> (C dataset, the samples' Schema)."""
    import numpy
    from . import _workers
    n = len(dataset)
    if n == 0:
        raise InvalidError("PM_ERR_INVALID: the dataset is empty")
    if schema is None:  # (else the structure a loader already learned)
        at, first = _first_that_reads(n, lambda i: _sample(dataset, i), lambda e: True)
        schema = _workers.describe(first, at)
    contiguous, checked = numpy.ascontiguousarray, _workers.checked_leaves
    # Non-array leaves (strings, objects), and once shapes vary every row's VRow, wait here,
    # by (batch, row), for their batch (epoch None: the store is cleared whenever a new C loader
    # starts reading).
    store = schema.store = _workers.SideStore()
    objs = bool(schema.objs)
    blank = None

    def fetch(i, batch=_workers.NO_ROW, row=0):
        nonlocal blank
        at = (batch, row)
        sample = _sample(dataset, i)
        try:
            leaves = checked(schema, sample, i, numpy)
        except _workers.ShapeDiffers:
            if not schema.varying:
                raise
            # The sample goes beside the slot whole; its row holds zeros.
            store.put(None, (i,), (_workers.VRow(None, _workers.off_leaves(sample, i, numpy)),),
                      at)
            if blank is None:
                blank = [numpy.zeros(shape, dt) for dt, shape in schema.slot_fields(numpy)]
            return blank
        if schema.varying:
            store.put(None, (i,), (_workers.VRow(schema.obj_values(leaves), None),), at)
        elif objs:
            store.put(None, (i,), (schema.obj_values(leaves),), at)
        return [contiguous(a) for a in schema.slot_values(leaves)]

    return _pinmem._dataset_python(fetch, n, schema.specs()), schema


class _FlatBatches:
    """A batch_sampler's batches as one run of indices: each batch `size` indices, but the last
    (pinmem.Loader fills batches of one size)."""

    def __init__(self, batch_sampler, size):
        self.batch_sampler, self.size = batch_sampler, size
        self._name = f"batch_sampler {type(batch_sampler).__name__}"

    def __len__(self):
        return len(self.batch_sampler) * self.size

    def __iter__(self):
        batches = [list(b) for b in self.batch_sampler]
        for k, b in enumerate(batches):
            if len(b) != self.size and not (k == len(batches) - 1 and 0 < len(b) < self.size):
                raise InvalidError(f"PM_ERR_INVALID: the {self._name} gave batch {k} of "
                                   f"{len(b)} indices: pinmem.Loader fills batches of its "
                                   f"batch_size ({self.size}), a shorter one only last; for "
                                   "batches of varying size keep torch's DataLoader")
        return (i for b in batches for i in b)


def _sampler_order(sampler, n):
    """The sampler's indices for one epoch as an array('Q'): ints (Python, NumPy, 0-d integer
    tensors) in 0..n-1; anything else refused naming the sampler and the position."""
    import array
    order = array.array("Q")
    name = getattr(sampler, "_name", type(sampler).__name__)
    for k, i in enumerate(sampler):
        if isinstance(i, bool) or not hasattr(type(i), "__index__"):
            raise InvalidError(f"PM_ERR_INVALID: the sampler ({name}) yielded {i!r} "
                               f"({type(i).__name__}) at position {k}: indices are ints")
        try:
            v = _operator.index(i)
        except TypeError:
            raise InvalidError(f"PM_ERR_INVALID: the sampler ({name}) yielded {i!r} at position "
                               f"{k}: indices are ints") from None
        if not 0 <= v < n:
            has = f"has indices 0..{n - 1}" if n else "is empty"
            raise InvalidError(f"PM_ERR_INVALID: the sampler ({name}) yielded {v} at position "
                               f"{k}: the dataset {has}")
        order.append(v)
    return order


def _stop_iteration_error(index, e):
    """StopIteration out of dataset[i] would end the caller's loop quietly (PEP 479's case)."""
    return RuntimeError(f"dataset[{index}] raised StopIteration ({e!r}): a dataset's __getitem__ "
                        "must not raise StopIteration; raise IndexError past the end")


# pm_loader_state_t's magic (PM_LOADER_STATE_MAGIC, "PML1") and the keys of the C loader's stats.
_STATE_MAGIC = 0x314C4D50
_STATS_KEYS = ("batches_per_epoch", "samples_per_epoch", "workers", "prefetch", "slot_bytes",
               "batches", "samples", "bytes", "waits", "stall_seconds", "next_seconds",
               "read_seconds", "collate_seconds", "copy_seconds", "device_bytes", "host_bytes",
               "held")


def _epoch_batches(samples, cfg):
    """(batches one rank gets per epoch, rank, world size) for a C loader configured by cfg
    over `samples` samples, 0 batches included (which the C loader cannot express:
    _NoBatches). pm_loader_plan: the C loader's own reading of RANK / WORLD_SIZE and its own
    arithmetic, with its refusals."""
    p = _pinmem._loader_plan(samples, batch_size=cfg["batch_size"], drop_last=cfg["drop_last"],
                             rank=cfg["rank"], world_size=cfg["world_size"])
    return p["batches_per_epoch"], p["rank"], p["world_size"]


def _config_fields(cfg, epoch, batch, samples, rank, world):
    """The fields of the state a C loader configured by cfg would have at (epoch, batch)."""
    flags = int(cfg["shuffle"]) | int(cfg["drop_last"]) << 1
    return dict(magic=_STATE_MAGIC, flags=flags, epoch=epoch, batch=batch, seed=cfg["seed"],
                samples=samples, batch_size=cfg["batch_size"], rank=rank, world_size=world)


class _EpochEnd:
    """What _NoBatches.next() gives at the end of an epoch without a batch."""


class _NoBatches:
    """Stands in for the C loader while its epochs have no batch: an empty dataset, a sampler
    (or batch_sampler) that yields nothing, drop_last with fewer samples than a batch. The C
    loader counts its position in batches (epoch * batches_per_epoch + batch), so it cannot
    hold such an epoch; DataLoader yields nothing for it and goes on. next() ends the epoch it
    stands at (_EpochEnd), and gives None once every epoch is over, as the C loader does.

    Two more roles, where the epoch it stands at is still to be opened (next() gives None: the
    loader opens it, per-epoch mode): `pending`, a loader not iterated yet (its first epoch's
    sampler order and dataset length are taken at the first next(), after the program's
    set_epoch, as DataLoader takes them at iter()); `retry`, an epoch whose opening raised: the
    loop that saw the exception ends at its next next(), and the next loop (armed by
    Loader._begin_epoch) opens the epoch again."""

    def __init__(self, fields, epochs, pending=False, retry=False):
        self._fields = dict(fields, batch=0)
        self._epochs = epochs  # 0: no end
        self.pending = pending
        self.retry = retry

    def next(self):
        if self.retry:
            self.retry = False
            return _EpochEnd  # (the loop that saw the opening fail ends; the epoch stays)
        if self.pending or self._epochs and self._fields["epoch"] >= self._epochs:
            return None
        self._fields["epoch"] += 1
        return _EpochEnd

    def state(self):
        return _pinmem._loader_state_pack(**self._fields)

    def stats(self):
        out = dict.fromkeys(_STATS_KEYS, 0)
        out.update((k, 0.0) for k in _STATS_KEYS if k.endswith("_seconds"))
        return out

    def close(self):
        pass


def _is_iterable_dataset(dataset):
    """A torch.utils.data.IterableDataset (by its class, without importing torch)."""
    return any(c.__name__ == "IterableDataset" and c.__module__.startswith("torch.utils.data")
               for c in type(dataset).__mro__)


def _has_no_samples(dataset):
    """Whether DataLoader would find no sample in `dataset`: a map-style dataset, an array, a
    TensorDataset or a tuple of arrays, of length 0. Files and pinmem's own datasets are opened
    as they are (an empty .npy file is refused)."""
    if isinstance(dataset, (NpyDataset, TokenDataset)) or _is_path(dataset):
        return False
    tensors = _tensor_dataset_fields(dataset)
    parts = tensors if tensors is not None else dataset if isinstance(dataset, tuple) else None
    if parts and all(_is_array(a) for a in parts):
        return all(tuple(getattr(a, "shape", (1,)))[:1] == (0,) for a in parts)
    if _is_array(dataset):
        return tuple(getattr(dataset, "shape", (1,)))[:1] == (0,)
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        return len(dataset) == 0
    return False


def _is_path(x):
    return isinstance(x, (str, _os.PathLike))


def _is_torch_tensor(x):
    t = type(x)
    return t.__module__.startswith("torch") and any(
        c.__name__ == "Tensor" and c.__module__.startswith("torch") for c in t.__mro__)


def _is_array(x):
    """An array by what it is (the buffer protocol, __array_interface__, __dlpack__, a torch
    tensor), never by duck attributes such as `shape`, which datasets have too."""
    if isinstance(x, (bytes, bytearray, memoryview)) or _is_torch_tensor(x):
        return True
    t = type(x)
    if hasattr(t, "__array_interface__") or hasattr(t, "__dlpack__"):
        return True
    try:
        memoryview(x).release()
    except TypeError:
        return False
    return True


def _tensor_dataset_fields(dataset):
    """The tensors of a torch TensorDataset that reads them as TensorDataset does (its own
    __getitem__), else None: a subclass with its own __getitem__ (a transform) goes through it."""
    t = type(dataset)
    base = next((c for c in t.__mro__ if c.__name__ == "TensorDataset" and
                 c.__module__.startswith("torch.utils.data")), None)
    if base is None or t.__getitem__ is not base.__getitem__:
        return None
    tensors = getattr(dataset, "tensors", None)
    if isinstance(tensors, (list, tuple)) and len(tensors) > 0 and \
            all(_is_array(a) for a in tensors):
        return tuple(tensors)
    return None


def _open_arrays(arrays):
    arrays, names = zip(*[_as_array(a) for a in arrays])
    if any(a.ndim > 0 and len(a) > 0 and a.size == 0 for a in arrays):
        raise InvalidError("PM_ERR_INVALID: an array dataset's samples are empty (shape "
                           f"{[a.shape for a in arrays]}): a batch row needs at least one "
                           "element per field")
    if any(a.ndim == 0 for a in arrays):
        raise InvalidError("PM_ERR_INVALID: a 0-d array has no sample axis; an array dataset "
                           "holds its samples along axis 0 (DataLoader refuses it too)")
    if any(len(a) == 0 for a in arrays):
        raise InvalidError("PM_ERR_INVALID: an array dataset needs at least one sample along "
                           "axis 0")
    n = {len(a) for a in arrays}
    if len(n) != 1:
        raise InvalidError("PM_ERR_INVALID: the arrays of a dataset need the same length "
                           f"(got {sorted(n)})")
    import numpy
    specs = [(a.shape[1:], name or _descr_text(a.dtype, f"field {k}"), a.dtype.itemsize)
             for k, (a, name) in enumerate(zip(arrays, names))]
    # Samples travel as bytes (NumPy cannot export every dtype through the buffer protocol:
    # datetimes); the spec says what they are.
    rows = [a.reshape(len(a), -1).view(numpy.uint8) for a in arrays]
    return _pinmem._dataset_arrays(rows, specs)


def _open_part(x, io):
    """One element of a tuple dataset: a path, an NpyDataset/TokenDataset or an array."""
    if isinstance(x, (NpyDataset, TokenDataset)):
        return x._open()
    if _is_path(x):
        return NpyDataset(x, io=io or "pread")._open()
    if _is_array(x):
        return _open_arrays([x])
    raise TypeError(f"pinmem.Loader: a tuple dataset holds arrays, .npy paths, NpyDataset or "
                    f"TokenDataset objects, not {type(x).__name__}")


def _is_torch_data(dataset):
    """Is `dataset` torch's: an instance of a torch.utils.data class (Dataset and its subclasses,
    TensorDataset, Subset, ...), a torch tensor, or a tuple of fields holding one."""
    def torchy(obj):
        return any(c.__module__.split(".")[0] == "torch" for c in type(obj).__mro__)
    if isinstance(dataset, tuple):
        return any(torchy(f) for f in dataset)
    return torchy(dataset)


def _is_python_dataset(dataset):
    """A map-style Python dataset (dataset[i], len(dataset)) rather than arrays or files."""
    if isinstance(dataset, (NpyDataset, TokenDataset, tuple)) or _is_path(dataset) or \
            _is_array(dataset):
        return False
    if isinstance(dataset, list) and dataset and all(_is_path(p) for p in dataset):
        return False
    if _tensor_dataset_fields(dataset) is not None:
        return False
    return hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")


def _open_dataset(dataset, io):
    """-> (one C dataset holding every field; whether batches are tuples)."""
    if isinstance(dataset, NpyDataset):
        return dataset._open(), False
    if isinstance(dataset, TokenDataset):
        return dataset._open(), True
    if _is_path(dataset):
        return NpyDataset(dataset, io=io or "pread")._open(), False
    if isinstance(dataset, list) and dataset and all(_is_path(p) for p in dataset):
        return NpyDataset(dataset, io=io or "pread")._open(), False  # files one after another
    tensors = _tensor_dataset_fields(dataset)  # torch.utils.data.TensorDataset
    if tensors is not None:
        dataset = tensors
    if isinstance(dataset, tuple) and dataset:
        if all(_is_array(a) for a in dataset):
            return _open_arrays(dataset), True  # one dataset, read without the GIL
        return _pinmem._dataset_zip([_open_part(x, io) for x in dataset]), True
    if _is_array(dataset):
        return _open_arrays([dataset]), False
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        return _python_dataset(dataset)  # (dataset, Schema)
    raise TypeError("pinmem.Loader: the dataset must be .npy path(s), an NpyDataset or "
                    "TokenDataset, an array or tuple of arrays (NumPy, torch CPU tensors, "
                    "TensorDataset), a tuple of .npy paths (one field each), or a map-style "
                    "dataset with __getitem__ and __len__")


_MAX_LOADER_THREADS = 256  # the C loader's limit on its worker threads (PM__LOADER_MAX_WORKERS)
# Timeouts from here up mean no limit (the C side counts milliseconds in an int).
_TIMEOUT_NO_LIMIT = 2e6
_CUDA_DEVICE = _re.compile(r"cuda(?::([0-9]+))?\Z", _re.ASCII)


def _timeout_arg(timeout):
    """Seconds as a float; 0 (no limit) for inf and for limits of _TIMEOUT_NO_LIMIT and more."""
    if isinstance(timeout, bool) or not isinstance(timeout, _numbers.Real):
        raise InvalidError(f"PM_ERR_INVALID: timeout must be a number of seconds >= 0 (0: no "
                           f"limit), not {timeout!r}")
    t = float(timeout)
    if t != t or t < 0:
        raise InvalidError(f"PM_ERR_INVALID: timeout must be a number of seconds >= 0 (0 or inf:"
                           f" no limit), not {timeout!r}")
    return 0.0 if t >= _TIMEOUT_NO_LIMIT else t


def _device_arg(device):
    """-> (batches on the device, device index or None) for None, 'cuda', 'cuda:k', 'cpu', an
    int k (cuda:k) or a torch.device."""
    if type(device).__module__ == "torch" and type(device).__name__ == "device":
        kind, index = device.type, device.index
        if kind == "cpu":
            return False, None
        if kind == "cuda":
            return True, index
        device = str(device)
    elif not isinstance(device, (str, bool)) and device is not None and \
            hasattr(type(device), "__index__"):
        k = _operator.index(device)
        if k < 0:
            raise InvalidError(f"PM_ERR_INVALID: device={k} must be >= 0 (a device index)")
        return True, k
    if device in (None, "cuda", "device"):
        return True, None
    if device in ("cpu", "host"):
        return False, None
    m = _CUDA_DEVICE.match(device) if isinstance(device, str) else None
    if m is None:
        raise InvalidError(f"PM_ERR_INVALID: device must be None, 'cuda', 'cuda:<index>', 'cpu', "
                           f"an int or a torch.device, not {device!r}")
    return True, int(m.group(1))


class Batch(tuple):
    """The arrays of one batch, one per field (token datasets: inputs, targets), each a
    pinmem.Buffer exporting DLPack: on the device by default (kDLCUDA, with stream ordering:
    torch.from_dlpack / __dlpack__(stream=s) makes s wait for the batch's copy, nobody blocks),
    or in host memory (device='cpu'). Attributes: epoch, index (within the epoch) and indices
    (the dataset index of each row). All fields come from one slot of the loader, copied by one
    copy; the slot goes back to the loader once every array and every DLPack tensor made from
    it is gone (after the work queued on the consumer's stream), also after the loader was
    closed."""

    @property
    def indices(self):
        """The dataset index of each row (with a sampler: the index the sampler gave)."""
        import array
        a = array.array("Q")
        a.frombytes(self._indices)
        order = self.__dict__.get("_order")
        if order is not None:  # rows of a selection: position k in the sampler's order
            a = array.array("Q", [order[k] for k in a])
        return a


_pinmem._set_batch_class(Batch)


class _EpochIterator:
    """The batches of one epoch. An iterator object rather than a generator: a generator keeps
    the batch it last yielded in its frame, and on some Python versions (3.12) even close()
    does not let it go, which would keep the batch's slot from the loader. This object holds
    nothing between calls: the caller owns each batch outright."""

    __slots__ = ("_loader", "_mode", "_convert", "_done", "_begun", "_token")

    def __init__(self, loader, mode, convert=None):
        self._loader = loader
        self._mode = mode
        self._convert = convert
        if loader._closed:
            _closed()
        self._done = False
        self._begun = False  # the epoch begins at the first next(), where its errors belong
        self._token = None  # which loop over the loader this is (a newer one overtakes it)

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        loader = self._loader
        t0 = _perf_counter()
        try:
            if not self._begun:
                # As torch: each iterator is a new epoch (a loop after a `break` starts the
                # next one). One whose start raises ends there, as a DataLoader iterator whose
                # start raised; the next loop tries again.
                self._begun = True
                try:
                    if self._mode == "batch":
                        loader._check()  # (started: the samples' structure is known)
                        if getattr(loader._schema, "mark", False):
                            raise InvalidError(
                                "PM_ERR_INVALID: batches() gives the slot's arrays, and these "
                                "samples have none (strings, objects or empty arrays alone): "
                                "iterate the loader")
                    more = loader._begin_epoch()
                except BaseException:
                    self._done = True
                    raise
                loader._loops += 1
                self._token = loader._loops
                if not more:
                    self._done = True
                    raise StopIteration
            elif self._token != loader._loops:
                self._done = True
                _overtaken()
            try:
                b = loader._next()
            except WorkerError as e:
                # A worker that died or ran past `timeout` (not the dataset's own exception,
                # after which the next batch follows): the C loader keeps that error, so each
                # later next() would raise it at once, without end. The loop ends with it; the
                # next loop starts the next epoch on new workers.
                if not getattr(e, "from_dataset", False):
                    self._done = True
                raise
            if b is None:
                self._done = True
                raise StopIteration
            if b.index + 1 >= loader._bpe:
                self._done = True  # the epoch ends with this batch
            if loader._collate is not None:
                return loader._collated(b, self._convert if self._mode == "torch" else None)
            objs = loader._side_rows(b)  # taken in every mode, or they would pile up
            if loader._schema is not None and loader._schema.varying:
                objs, offs = _staging.split_rows(objs)
                if offs is not None:  # samples beside the slot: stacked here
                    where = (b.epoch, b.index, list(b.indices))
                    del b  # the slot goes back (its rows were not written), errors or not
                    return loader._stacked(*where, offs, self._mode, self._convert)
            if self._mode == "batch":
                return b
            if self._mode == "torch":
                t1 = _perf_counter()
                t = tuple(map(self._convert, b))
                del b
                loader._conversion_s += _perf_counter() - t1
                return loader._shape(t, objs)
            return loader._shape(b, objs)
        finally:
            # Everything the loop waited for here, so stats() can tell next() from the rest.
            loader._iteration_s += _perf_counter() - t0

    def close(self):
        """Stop early (as generator.close() does); the next iterator starts the next epoch."""
        self._done = True


# The fields of a state_dict and their ranges (those of pm_loader_state_t).
_U32, _U64, _I32 = (0, (1 << 32) - 1), (0, (1 << 64) - 1), (-(1 << 31), (1 << 31) - 1)
_STATE_KEYS = dict(magic=_U32, flags=_U32, epoch=_U64, batch=_U64, seed=_U64, samples=_U64,
                   batch_size=_U64, rank=_I32, world_size=_I32)


def _closed():
    _pinmem._raise(_pinmem.PM_ERR_STATE, "the loader was closed")


def _overtaken():
    # DataLoader's iterators are independent epochs; this loader delivers one epoch at a time,
    # so an older loop cannot go on once a newer one began (it ended quietly, or took the new
    # epoch's batches and never ended).
    _pinmem._raise(_pinmem.PM_ERR_STATE,
                   "another loop over this loader began a new epoch while this one ran (each "
                   "iter(loader) starts the next epoch: to look at a batch inside a loop, keep "
                   "the one the loop gave)")


def _closed_error():
    try:
        _closed()
    except Error as e:
        return e


class Loader:
    """Batches of a dataset, read by workers straight into pinned slots and copied to the device
    while the previous batch computes: DataLoader(pin_memory=True) plus
    .to(device, non_blocking=True), without the second copy.

    dataset: .npy path(s) (a list: files one after another) or an NpyDataset, a TokenDataset,
    an array, or a tuple of fields: arrays (NumPy arrays, torch CPU tensors, a TensorDataset),
    .npy paths, NpyDataset or TokenDataset objects (all read by pinmem's threads, without the
    GIL); or a map-style Python dataset (dataset[i], len(dataset)): with num_workers > 0 its
    samples are read by that many worker processes, each writing its samples straight into the
    shared pinned slot (worker_mode="process", the default; "thread" reads them on threads,
    through the GIL: for datasets that release it). A sample is an array, a CPU tensor, a number,
    or a tuple, list or dict of those (strings and other objects arrive as lists); batches have
    the sample's structure (default_collate's). Shapes may vary from batch to batch (a batch
    whose shapes differ from the first sample's is stacked in the main process and staged
    through pinned memory); within a batch they must agree (an error at that batch, a
    RuntimeError as default_collate's).

    The arguments are torch.utils.data.DataLoader's, in its order: batch_size, shuffle, sampler
    (any iterable of indices with len(): its order is the order delivered), batch_sampler,
    num_workers, collate_fn (your own: run in the workers on whole batches; its output keeps
    its structure, its arrays staged through pinned memory onto the device, or as it returns it
    with device='cpu'), pin_memory, drop_last, timeout, worker_init_fn,
    multiprocessing_context, generator, prefetch_factor (slots = prefetch_factor *
    max(1, num_workers)), persistent_workers. What pinmem cannot honour is refused, never
    ignored. A torch IterableDataset is iterated in the main process (num_workers=0) or by
    worker processes, each iterating its own copy (get_worker_info() shards it), whose batches
    are taken in turn as torch's DataLoader takes them; shuffle, sampler, batch_sampler and
    state_dict() are refused for it (_iterable.py). Also: seed (shuffle order and worker
    seeds; default: drawn from `generator`, else from torch's global generator where torch is
    imported, as DataLoader draws its base seed, else 0), device (None/'cuda': batches on the
    current device; 'cuda:k': on device k, whatever device is current; 'cpu': in host memory),
    epochs (None: no end), rank/world_size (sharding as DistributedSampler; None: from RANK
    and WORLD_SIZE), io (for .npy paths), worker_mode.

    Iterating yields one epoch's batches (tuple samples as lists, as default_collate), their
    arrays torch tensors for torch's datasets and tensors, pinmem.Buffers otherwise (tensors=
    True/False overrides);
    batches() yields flat Batch objects (one array per field) with epoch/index/indices. As
    torch's DataLoader, each new iterator is a new epoch (a loop after `break` starts the next
    one), except the first after construction or load_state_dict(), which starts where the
    loader stands; an exception in dataset[i] is raised at its batch and the next next() gives
    the batch after it. Keep at most `prefetch` batches alive at once while iterating
    (pinmem.BusyError otherwise). docs/pytorch.md has every argument and difference.
    close() (and `with`, and interpreter exit) never fails because batches are alive: it stops
    the workers, and each slot still held returns to the pool when its batch goes.
    """

    def __new__(cls, dataset=None, *args, **kwargs):
        # A torch IterableDataset has its own path (_iterable.py): a Loader subclass.
        if cls is Loader and _is_iterable_dataset(dataset):
            from ._iterable import IterableLoader
            cls = IterableLoader
        return super().__new__(cls)

    def __init__(self, dataset, batch_size=1, shuffle=False, sampler=None, batch_sampler=None,
                 num_workers=0, collate_fn=None, pin_memory=True, drop_last=False, timeout=0,
                 worker_init_fn=None, multiprocessing_context=None, generator=None, *,
                 prefetch_factor=None, persistent_workers=False, pin_memory_device="",
                 in_order=True, seed=None, device=None, epochs=None, rank=None,
                 world_size=None, io=None, worker_mode=None, tensors=None):
        self._c = None
        self._pool = None
        self._base = None
        self._stager = None  # batches staged outside the slots (_staging.py)
        self._closed = False
        self._order = None  # a sampler's indices for the epoch (Batch.indices maps through it)
        self._c_epoch = 0  # the epoch the C loader (or _NoBatches) was made for
        self._resume_pending = True  # the first iterator starts where the loader stands
        self._skip = None  # (epoch, batch) after a batch whose dataset read raised
        self._past_end = False  # every epoch was delivered
        self._failed = None  # the error that left the loader unusable (a stuck worker)
        # "cuda:k": the loader works on device k
        to_device, self._device_index = _device_arg(device)
        # batch_size=None (as torch): samples one at a time, without a batch axis: batches of
        # one whose arrays the extension delivers without their first axis.
        unbatched = batch_size is None and batch_sampler is None
        if unbatched:
            if drop_last:
                raise InvalidError("PM_ERR_INVALID: batch_size=None option is mutually "
                                   "exclusive with drop_last (as in torch's DataLoader)")
            batch_size = 1
        batch_size = _int_arg("batch_size", batch_size, 1)
        seed = _int_arg("seed", seed, -(1 << 63), (1 << 64) - 1, none_ok=True)
        epochs = _int_arg("epochs", epochs, 1, none_ok=True)
        if prefetch_factor is not None:
            prefetch_factor = _int_arg("prefetch_factor", prefetch_factor, 1)
        timeout = _timeout_arg(timeout)
        if pin_memory_device not in ("", None) and not str(pin_memory_device).startswith("cuda"):
            raise InvalidError(f"PM_ERR_INVALID: pin_memory_device={pin_memory_device!r}: pinmem "
                               "pins for CUDA devices; leave it '' (or 'cuda')")
        if any(c.__name__ == "IterableDataset" and c.__module__.startswith("torch.utils.data")
               for c in type(dataset).__mro__):
            raise InvalidError("PM_ERR_INVALID: an IterableDataset is not supported: "
                               "pinmem.Loader's workers claim rows by index, in a fixed order; "
                               "give it a map-style dataset (__getitem__ and __len__), or keep "
                               "torch's DataLoader for streams")
        user_batch_sampler = batch_sampler
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise InvalidError("PM_ERR_INVALID: batch_sampler option is mutually exclusive "
                                   "with batch_size, shuffle, sampler, and drop_last (as in "
                                   "torch's DataLoader)")
            b = getattr(batch_sampler, "batch_size", None)
            if isinstance(b, bool) or not isinstance(b, int) or b < 1 or \
                    not hasattr(batch_sampler, "__len__"):
                raise InvalidError("PM_ERR_INVALID: batch_sampler: pinmem.Loader fills batches "
                                   "of one size, so a batch_sampler needs len() and an int "
                                   "batch_size attribute (torch's BatchSampler has both); for "
                                   "batches of varying size keep torch's DataLoader")
            # Its batches, flattened, are a sampler's order cut every batch_size indices
            # (checked as each epoch starts: every batch that size, a shorter one only last).
            batch_size, sampler = b, _FlatBatches(batch_sampler, b)
        # A collate_fn of your own runs where torch runs it (in the worker process on the list
        # of a batch's samples, or in the main process with num_workers=0): claims are whole
        # batches, and the slot holds a byte per row (the rows read) while the output travels
        # beside it. Host batches get the output as it returns it; device batches get its
        # arrays staged through a pinned block onto the device (_staging.py).
        self._collate = None
        if collate_fn is not None and not _is_default_collate(collate_fn):
            if not callable(collate_fn):
                raise InvalidError(f"PM_ERR_INVALID: collate_fn must be callable, not "
                                   f"{type(collate_fn).__name__}")
            if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
                raise InvalidError("PM_ERR_INVALID: collate_fn of your own needs a map-style "
                                   "dataset (__getitem__ and __len__), whose samples it collates")
            self._collate = collate_fn
        if sampler is not None and shuffle:
            raise InvalidError("PM_ERR_INVALID: sampler and shuffle=True cannot go together "
                               "(as in torch's DataLoader): the sampler decides the order")
        if sampler is not None and not hasattr(sampler, "__len__"):
            raise InvalidError("PM_ERR_INVALID: the sampler needs len() (the batches of an epoch "
                               "are counted before it starts)")
        if worker_mode not in (None, "process", "thread"):
            raise InvalidError(f"PM_ERR_INVALID: worker_mode must be None, 'process' or "
                               f"'thread', not {worker_mode!r}")
        # None means "from the environment" (RANK, WORLD_SIZE, checked by the library); an
        # explicit value must be valid, never silently replaced by the environment's.
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
            raise InvalidError(f"PM_ERR_INVALID: rank must be None or an int >= 0, not {rank!r}")
        if world_size is not None and (not isinstance(world_size, int) or
                                       isinstance(world_size, bool) or world_size < 1):
            raise InvalidError("PM_ERR_INVALID: world_size must be None or an int >= 1, not "
                               f"{world_size!r}")
        if seed is None:
            seed = _seed_from(generator)
        seed %= 1 << 64  # as torch's generators: a negative seed is its 64-bit pattern
        nw = _int_arg("num_workers", num_workers, 0)
        python_ds = self._collate is not None or _is_python_dataset(dataset)
        procs = python_ds and nw > 0 and worker_mode in (None, "process")
        # Checked before any process starts: each worker process is served by _PROCESS_DEPTH
        # of the C loader's threads, which has at most 256.
        limit = _MAX_LOADER_THREADS // (_PROCESS_DEPTH if procs else 1)
        if nw > limit:
            raise InvalidError(f"PM_ERR_INVALID: num_workers={nw} is more than pinmem.Loader's "
                               f"{limit} " + (f"worker processes ({_MAX_LOADER_THREADS} loader "
                                              f"threads, {_PROCESS_DEPTH} per process: "
                                              "PINMEM_PROCESS_DEPTH)" if procs else
                                              "worker threads"))
        if worker_mode == "process" and not procs:
            raise InvalidError("PM_ERR_INVALID: worker_mode='process' needs a map-style Python "
                               "dataset and num_workers > 0 (arrays and files are read by "
                               "pinmem's threads, without the GIL)")
        self._schema = None
        self._timeout = timeout
        self._sampler = sampler
        self._persistent = bool(persistent_workers)
        self._epochs_total = epochs
        self._base_seed = seed
        self._mp = (dataset, nw, multiprocessing_context, worker_init_fn)
        self._to_device = to_device
        self._config = dict(
            batch_size=batch_size, workers=nw,
            prefetch=int(prefetch_factor) * max(1, nw) if prefetch_factor else 0,
            shuffle=bool(shuffle), seed=self._base_seed, drop_last=bool(drop_last),
            rank=-1 if rank is None else rank,
            world_size=-1 if world_size is None else world_size,
            # Worker processes write into shared slots, which are pinned whatever pin_memory
            # says (pinned host memory serves every use pageable memory does).
            pin_memory=bool(pin_memory) or procs, device=to_device,
            # A batch stays valid as long as it is held: when the ring needs its slot, the ring
            # takes another from the pool (within the budget) instead of refusing.
            lease_slots=True, unbatched=unbatched,
            epochs=0 if epochs is None else epochs)
        if procs:
            # One claim of rows per message; claims go to the workers in turn (reproducible),
            # _PROCESS_DEPTH loader threads per process so each has its next claim queued.
            self._config.update(workers=nw * _PROCESS_DEPTH, shared_slots=True,
                                ordered_workers=True,
                                claim_rows=batch_size if self._collate is not None else
                                max(1, min(_PROCESS_CLAIM, batch_size)))
        if sampler is not None:
            self._config.update(rank=0, world_size=1)  # the sampler shards, if anyone does
        # Per-epoch loaders: a sampler is iterated at the start of each epoch (after the
        # program's set_epoch), and workers that do not persist are started anew per epoch.
        # With num_workers=0 (a Python dataset read on threads), as torch reads in the loop:
        # nothing of the next epoch is read before the code between epochs has run.
        self._per_epoch = sampler is not None or (procs and not self._persistent) or \
            (python_ds and nw == 0)
        # The attributes torch's DataLoader users read (loader.sampler.set_epoch(e), ...): the
        # arguments as given. sampler is None when pinmem orders the samples itself (shuffle,
        # seed and rank/world_size decide the order); batch_sampler is always None (refused).
        self.dataset = dataset
        self._batch_sampler = user_batch_sampler
        self._unbatched = unbatched
        # (None with a batch_sampler or batch_size=None, as torch)
        self.batch_size = None if user_batch_sampler is not None or unbatched else batch_size
        self.sampler = sampler if user_batch_sampler is None else \
            getattr(user_batch_sampler, "sampler", None)
        self.batch_sampler = user_batch_sampler
        self.shuffle = bool(shuffle)
        self.num_workers = nw
        self.drop_last = bool(drop_last)
        self.collate_fn = collate_fn
        self.pin_memory = bool(pin_memory)
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.generator = generator
        self.persistent_workers = self._persistent
        self.prefetch_factor = prefetch_factor
        self.seed = self._base_seed
        if tensors not in (None, True, False):
            raise InvalidError(f"PM_ERR_INVALID: tensors must be None, True or False, not "
                               f"{tensors!r}")
        # What plain iteration gives: torch tensors for torch's datasets and tensors (a
        # DataLoader loop keeps working unchanged), pinmem.Buffers otherwise (NumPy users need
        # no torch). Decided by the dataset alone, never by what else the program imported.
        self._tensors = _is_torch_data(dataset) if tensors is None else tensors
        self.device = "cpu" if not to_device else \
            "cuda" if self._device_index is None else f"cuda:{self._device_index}"
        self._iteration_s = self._conversion_s = 0.0  # seconds, since create or load_state_dict
        self._loops = 0  # loops begun: an older loop's next() after a newer one began refuses
        self._procs, self._io = procs, io
        self._started = False
        self._start_lock = _threading.Lock()
        self._ds = None
        self._python_ds = python_ds
        if not python_ds:
            # Arrays and files (no Python code per sample): opened, checked and started now;
            # with a sampler, at the first use, after the program's set_epoch (the sampler's
            # order is the epoch's).
            self._open_base()
            if sampler is None:
                self._start()
        _live_loaders.add(self)

    # ---- the C loader of an epoch (per-epoch mode) or of every epoch ----

    def _open_base(self, epoch=0):
        """The C dataset of every field (worker processes started for a Python dataset, whose
        sample 0 gives the structure): at construction for arrays and files, at the first
        iteration for Python datasets (as torch's DataLoader reads nothing before)."""
        if _has_no_samples(self.dataset):
            # Nothing to read and no structure to learn: every epoch has no batch (_NoBatches).
            self._base = self._ds = None
            self._tuple, self._odd = False, []
            return
        if self._collate is not None:
            return self._open_collated(epoch)
        if self._procs:
            self._pool = self._start_pool(epoch)
            try:
                self._schema = self._describe_in_worker()
                self._pool.set_schema(self._schema, self._timeout)
                self._base = _pinmem._dataset_procs(self._pool, self._pool.fds(),
                                                    len(self.dataset), self._schema.specs(),
                                                    self._timeout, _PROCESS_DEPTH)
            except BaseException:
                self._pool.stop()
                self._pool.close()
                raise
            self._tuple = not self._schema.is_single()
        else:
            self._base, self._tuple = _open_dataset(self.dataset, self._io)
            if not isinstance(self._tuple, bool):  # a Python dataset: its Schema
                self._schema, self._tuple = self._tuple, not self._tuple.is_single()
        fields = self._base.fields()
        # Dtypes pinmem's buffers cannot express (big-endian, strings, records, datetimes)
        # arrive as bytes and are viewed here with their real dtype: in host memory only.
        self._odd = [(k, _dtype_from_descr(f["descr"]), f["shape"])
                     for k, f in enumerate(fields) if not f["native"]]
        if self._odd and self._to_device:
            k, dt, _ = self._odd[0]
            raise InvalidError(f"PM_ERR_INVALID: field {k} has dtype {dt} ({fields[k]['descr']}),"
                               " which has no DLPack type for the device: use device='cpu', or "
                               "store it as a native number type")
        self._ds = self._base

    def _describe_in_worker(self):
        """The Schema of the first of the dataset's first samples that reads (_DESCRIBE_TRIES),
        computed by worker 0; the first sample's exception where none reads."""
        # The dataset's own exceptions only are skipped: a refused structure or a worker that
        # died or timed out is the answer for every sample.
        def skip(e):
            return not isinstance(e, Error) and (not isinstance(e, WorkerError) or
                                                 getattr(e, "from_dataset", False))
        return _first_that_reads(len(self.dataset),
                                 lambda i: self._pool.describe(i, self._timeout), skip)[1]

    def _open_collated(self, epoch=0):
        """The C dataset of a loader with a collate_fn of its own: one byte per row (set when
        the row's claim is done), its worker processes (which collate whole batches) or, with
        num_workers=0, nothing more (the main process collates at delivery, as torch)."""
        import numpy
        from . import _workers
        self._schema = _workers.CollateSchema(self._unbatched)
        n = len(self.dataset)
        if n == 0:
            raise InvalidError("PM_ERR_INVALID: the dataset is empty")
        if self._to_device and self._stager is None:
            self._stager = _staging.Stager(True, self._device_index)
        if self._procs:
            self._pool = self._start_pool(epoch)
            try:
                self._pool.set_schema(self._schema, self._timeout)
                self._base = _pinmem._dataset_procs(self._pool, self._pool.fds(), n,
                                                    self._schema.specs(), self._timeout,
                                                    _PROCESS_DEPTH)
            except BaseException:
                self._pool.stop()
                self._pool.close()
                raise
        else:
            mark = numpy.ones((), numpy.uint8)
            self._base = _pinmem._dataset_python(lambda i, batch, row: [mark], n,
                                                 self._schema.specs())
        self._tuple, self._odd, self._ds = False, [], self._base

    def _collated(self, b, convert=None):
        """The collate_fn's output for batch b (its slot goes back at once); with device
        batches, its arrays on the device (convert: as_torch()'s conversion of each)."""
        indices = tuple(int(i) for i in b.indices)
        epoch = b.epoch
        del b
        if self._pool is not None:
            out = _staging.unwrap(self._pool.store.take(epoch, [indices], self._timeout)[0])
        else:
            samples = [_sample(self.dataset, i) for i in indices]
            out = self._collate(samples[0] if self._unbatched else samples)
            if self._stager is not None:
                out = self._stager.stage(out)
        if convert is not None and self._stager is not None:
            t0 = _perf_counter()
            out = _staging.convert(out, convert)
            self._conversion_s += _perf_counter() - t0
        return out

    def _start(self):
        """Open what the constructor left for the first use: the dataset (Python datasets)
        and the C loader, whose threads start reading. A failure leaves nothing running, and
        the next use tries again (as a new DataLoader iterator would)."""
        try:
            if self._base is None:
                self._open_base()
            if self._per_epoch:
                self._c = self._pending()
            else:
                self._open_epoch(0, 0)
        except BaseException:
            c, self._c = self._c, None
            pool, self._pool = self._pool, None
            try:
                if pool is not None and self._base is not None:
                    _pinmem._procs_cancel(self._base)
                if pool is not None:
                    pool.stop()
                if c is not None:
                    c.close()
            finally:
                if pool is not None:
                    pool.close()
                if self._procs or self._schema is not None:
                    self._base = self._ds = None
            raise
        self._started = True


    def _start_pool(self, epoch):
        from . import _workers
        dataset, nw, ctx, init_fn = self._mp
        seed = self._base_seed if epoch == 0 else _mix_seed(self._base_seed, epoch)
        # The workers run on the CPUs of the loader's device's NUMA node, as pinmem's threads.
        if not self._to_device:
            dev = -1
        elif self._device_index is not None:
            dev = self._device_index
        else:
            dev = _pinmem.current_device()
        cpus = _pinmem._numa_worker_cpus(dev)
        pool = _workers.Pool(dataset, nw, ctx, seed, init_fn, cpus, collate=self._collate)
        if self._stager is not None and self._collate is not None:
            pool.store.stage = self._stager.stage_safely  # staged as each output arrives
        pool.store.varying = self._schema is not None and self._schema.varying
        return pool

    def _on_device(self, make):
        """make() with the loader's device current (device="cuda:k"): its stream, buffers and
        threads belong to device k; the calling thread's own is given back (_device)."""
        with _device.on_device(self._device_index):
            return make()

    def _open_epoch(self, epoch, batch, resume=None, template=None, same_order=False):
        """Make self._c deliver from (epoch, batch): one loader for every epoch, or (per-epoch
        mode) a loader for this epoch alone. template: the fields of the last epoch's state, for
        an epoch that starts afresh (its sample count is this epoch's: a sampler's length and a
        dataset's may change between epochs, as torch allows)."""
        if self._closed:
            _closed()
        cfg = self._epoch_config(epoch)
        if self._per_epoch and not same_order:  # (same_order: the epoch's sampler order kept)
            # A Python dataset's length is read again at each epoch (as DataLoader reads it),
            # but with persistent workers (read once, when they start). The epoch's order and a
            # resume state are checked before anything changes: a refused state leaves the
            # loader as it was (its workers too).
            base_n = 0 if self._base is None else self._base.info()["samples"]
            n = len(self.dataset) if self._python_ds and not (self._procs and self._persistent) \
                else base_n
            order = None if self._sampler is None else _sampler_order(self._sampler, n)
            samples = n if order is None else len(order)
            if resume is not None:
                resume = self._fit_resume(resume, samples, cfg)
            if self._procs and not self._persistent and (
                    self._pool is None or self._pool.epoch != epoch or n != base_n):
                self._swap_pool(epoch)
            elif self._python_ds and not self._procs and n != base_n:
                if self._schema is None or self._collate is not None or \
                        _has_no_samples(self.dataset):
                    self._open_base(epoch)
                else:  # the structure learned stays (the first samples may now raise)
                    self._base, _ = _python_dataset(self.dataset, self._schema)
                    self._ds = self._base
            ds = self._base
            if order:
                ds = _pinmem._dataset_select(self._base, order)
            self._order = order
            self._ds = ds
        samples = len(self._order) if self._order is not None else \
            0 if self._ds is None else self._ds.info()["samples"]
        batches, rank, world = _epoch_batches(samples, cfg)
        if batches == 0:
            self._clear_side()
            self._c = self._no_batches(epoch, batch, resume, template, samples, cfg, rank,
                                       world)
            self._bpe, self._c_epoch = 0, epoch
            if self._pool is not None:
                self._pool.epoch = epoch
            return
        if template is not None:
            fields = dict(template, epoch=epoch, batch=batch, samples=samples)
            resume = _pinmem._loader_state_pack(**fields)
        self._clear_side()
        self._c = self._on_device(lambda: _pinmem._Loader(self._ds, resume=resume, **cfg))
        self._c_epoch = epoch  # the epoch the C loader was made for (its epochs: this one on)
        # Batches per epoch of the loader now delivering: the iterators end the epoch by it.
        self._bpe = self._c.stats()["batches_per_epoch"]
        if self._pool is not None:
            self._pool.epoch = epoch

    @staticmethod
    def _fit_resume(resume, samples, cfg):
        """Resume state `resume` checked against an epoch of `samples` samples (per-epoch mode,
        before anything is stopped): its batch must lie in the epoch; mid-epoch, its sample
        count must be the epoch's (else the order differs); at the epoch's start the count is
        the epoch's own, whatever it was when the state was saved (a length may change between
        epochs). -> the state to give the C loader."""
        fields = _pinmem._loader_state_fields(resume)
        batches = _epoch_batches(samples, cfg)[0]
        if fields["batch"] and fields["batch"] >= batches:
            raise InvalidError(f"PM_ERR_INVALID: resume state batch {fields['batch']}, an epoch "
                               f"has {batches}" + ("" if batches else
                                                   f" (no batch: {samples} samples, batch_size "
                                                   f"{cfg['batch_size']}, drop_last "
                                                   f"{cfg['drop_last']})"))
        if fields["batch"] and fields["samples"] != samples:
            raise InvalidError(f"PM_ERR_INVALID: the state was saved with samples "
                               f"{fields['samples']}, this epoch has {samples}: the order of the "
                               "samples would differ")
        return _pinmem._loader_state_pack(**dict(fields, samples=samples))

    @staticmethod
    def _no_batches(epoch, batch, resume, template, samples, cfg, rank, world):
        """A _NoBatches at (epoch, batch) for an epoch of `samples` samples that has no batch;
        its state has the fields a C loader's would have."""
        if resume is not None:
            fields = _pinmem._loader_state_fields(resume)
        elif template is not None:
            fields = dict(template, epoch=epoch, batch=batch, samples=samples)
        else:
            fields = _config_fields(cfg, epoch, batch, samples, rank, world)
        if fields["batch"] != 0:
            raise InvalidError(f"PM_ERR_INVALID: resume state batch {fields['batch']}, an epoch "
                               f"has no batch ({samples} samples, batch_size "
                               f"{cfg['batch_size']}, drop_last {cfg['drop_last']})")
        if cfg["epochs"] and fields["epoch"] > cfg["epochs"]:
            raise InvalidError(f"PM_ERR_INVALID: resume state epoch {fields['epoch']}, the "
                               f"loader has {cfg['epochs']}")
        return _NoBatches(fields, cfg["epochs"])

    def _retire(self, c, replace=False):
        """Destroy C loader c. Over worker processes, claims may still be out: cancel the
        waits, let the processes finish what they were given (drain) and only then free the
        slots they write into. replace: a new epoch opens next, which with per-epoch workers
        starts new ones, so workers that did not finish are stopped and replaced rather than
        the loader failed."""
        if isinstance(c, _NoBatches):
            return  # nothing was read
        if self._pool is not None and c is not None:
            _pinmem._procs_cancel(self._base)
            wait = self._timeout if self._timeout > 0 else 60.0
            ok = _pinmem._procs_drain(self._base, wait)
            if not ok:
                # A process that did not answer may still write its rows into the slots: it goes
                # before they are freed (the pool hands their memory out again), and the loader
                # with it (it cannot go on without its processes).
                alive = [w for w, a in enumerate(self._pool.alive()) if a]
                self._pool.stop(timeout=0)
            c.close()
            _pinmem._procs_reset(self._base)
            self._clear_error()
            if not ok and replace and not self._persistent:
                # Workers are per epoch: the stopped ones are replaced when the next epoch
                # opens, as DataLoader starts new workers for each iterator.
                self._pool.epoch = None
            elif not ok:
                self._failed = WorkerError(
                    f"pinmem.Loader: a worker process (of workers {alive}, which were running "
                    f"and are stopped now) did not finish its rows within {wait:g} s "
                    f"(timeout={self._timeout:g}) while the loader was stopping; the loader "
                    "cannot go on: close() it and make a new one (raise timeout, or find what "
                    "makes dataset[i] hang)")
                raise self._failed
        elif c is not None:
            c.close()
            self._clear_error()

    def _clear_error(self):
        """Forget what the reads of a stopped C loader raised past the batch whose error was
        raised: the next loader raises its own errors (a shape change read ahead would be
        raised in place of a later batch's exception)."""
        if self._ds is not None:
            self._ds._clear_error()

    def _swap_pool(self, epoch):
        """New worker processes for `epoch` (persistent_workers=False), over the dataset's
        length now: none while it is empty, and where the dataset had no sample before, the
        structure learned from its first sample that reads."""
        c, self._c = self._c, None
        self._retire(c)  # (already done at the end of an epoch)
        old, self._pool = self._pool, None
        if old is not None:
            old.stop()
            old.close()
        self._base = self._ds = None
        if self._schema is None:
            self._open_base(epoch)  # (nothing, while the dataset is empty)
            return
        if _has_no_samples(self.dataset):
            return
        self._pool = self._start_pool(epoch)
        self._pool.set_schema(self._schema, self._timeout)
        self._base = _pinmem._dataset_procs(self._pool, self._pool.fds(), len(self.dataset),
                                            self._schema.specs(), self._timeout, _PROCESS_DEPTH)
        self._ds = self._base

    def _clear_side(self):
        """Forget the non-array leaves of rows read on pinmem's threads and never delivered (a
        new C loader is about to read; the last one is gone)."""
        store = getattr(self._schema, "store", None)
        if store is not None:
            store.clear()

    def _side_rows(self, b):
        """The non-array leaves of batch b's rows (None when the samples have none)."""
        schema = self._schema
        if schema is None or not (schema.objs or schema.varying):
            return None
        # Filed by (batch, row): the C loader's batch number is epoch * batches per epoch +
        # index, of the C loader delivering now.
        at = (b.epoch * self._bpe + b.index, 0)
        if self._pool is not None:
            return self._pool.store.take(b.epoch, b.indices, self._timeout, at)
        return schema.store.take(None, b.indices, self._timeout, at)

    def _shape(self, values, objs=None):
        """A batch's arrays in the sample's structure."""
        if self._schema is not None:
            return self._schema.rebuild(values, self._unbatched, objs)
        # Fields of a tuple dataset as a list, as default_collate batches tuple samples.
        return list(values) if self._tuple else values[0]

    def _check(self, open_pending=False):
        """The C loader, or StateError (closed) / the error that stopped the loader.
        open_pending (next()): a first epoch still to open (_NoBatches.pending) opens now, once
        whatever the threads calling in."""
        if self._closed:
            _closed()
        if self._failed is not None:
            raise WorkerError(f"pinmem.Loader stopped after an earlier error: {self._failed}") \
                from self._failed
        if not self._started:
            with self._start_lock:  # two threads at the first use start it once
                if not self._started and not self._closed:
                    try:
                        self._start()
                    except BaseException as e:
                        # close() from another thread stops the workers the start is talking
                        # to: what the caller sees is the close, not the worker it cut off.
                        if self._closed:
                            raise _closed_error() from e
                        raise
        c = self._c
        if open_pending and isinstance(c, _NoBatches) and c.pending and not c.retry:
            with self._start_lock:
                c = self._c
                if isinstance(c, _NoBatches) and c.pending and not c.retry:
                    st = _pinmem._loader_state_fields(c.state())
                    if self._epochs_total is None or st["epoch"] < self._epochs_total:
                        self._c = None
                        try:
                            self._open_epoch(st["epoch"], 0, template=st)
                        except BaseException:
                            self._c = self._retry_epoch(st, st["epoch"])
                            raise
                c = self._c
        if c is None:
            _closed()
        return c

    def _begin_epoch(self):
        """Where a new iterator starts (False: every epoch was delivered). Right after the
        loader was made or given a state_dict, its position; at the start of an epoch, there;
        inside an epoch (an earlier loop stopped early), at the start of the next epoch, as
        torch's DataLoader starts a new epoch at each iter()."""
        c = self._check()
        if isinstance(c, _NoBatches) and c.retry:
            c.retry = False  # a new loop: the epoch that failed to open is opened again
        if self._resume_pending:
            self._resume_pending = False
            return True
        st = _pinmem._loader_state_fields(c.state())
        if st["batch"] == 0 and self._skip is None:
            return True
        return self._restart_at(st["epoch"] + 1, 0)

    def _restart_at(self, epoch, batch, same_order=False):
        """A new C loader delivering from (epoch, batch); False (and nothing changed) when that
        is past the last epoch. same_order: the same epoch goes on, in the order it was given
        (a sampler is not asked again, nor are new worker processes started)."""
        self._skip = None
        if self._epochs_total is not None and epoch >= self._epochs_total:
            self._past_end = True
            return False
        c, self._c = self._c, None
        st = _pinmem._loader_state_fields(c.state())
        self._retire(c, replace=not same_order)  # held batches keep their slots until they go
        try:
            self._open_epoch(epoch, batch, template=st, same_order=same_order)
        except BaseException as e:
            if self._per_epoch and batch == 0 and self._failed is None:
                self._c = self._retry_epoch(st, epoch)
            else:
                self._failed = e
            raise
        self._past_end = False
        return True

    def _retry_epoch(self, st, epoch):
        """Per-epoch mode, after `epoch` failed to open (its sampler or dataset raised): the
        loop that saw it ends, and the next loop opens the epoch again, as a new DataLoader
        iterator would."""
        if self._pool is not None and not self._persistent:
            self._pool.epoch = None  # its copy of the dataset is the failed loop's: new workers
        return _NoBatches(dict(st, epoch=epoch, batch=0), epoch, pending=True, retry=True)

    def _pending(self):
        """Per-epoch mode, before the first epoch opens: a stand-in at (0, 0) whose state has
        the fields of the C loader to come (the sample count as len() sees it now)."""
        cfg = self._epoch_config(0)
        _, rank, world = _epoch_batches(0, cfg)
        if self._sampler is not None:
            samples = len(self._sampler) if hasattr(self._sampler, "__len__") else 0
        else:
            samples = len(self.dataset) if self._python_ds else \
                0 if self._base is None else self._base.info()["samples"]
        self._bpe, self._c_epoch = 0, 0
        return _NoBatches(_config_fields(cfg, 0, 0, samples, rank, world), 0, pending=True)

    def _next(self):
        """The next Batch, or None once every epoch (or, after a batch that failed, the epoch)
        was delivered, and for an epoch that has no batch."""
        c = self._check(open_pending=True)
        if self._past_end:
            return None
        if self._skip is not None:
            # The batch before failed (an exception in the dataset): as torch, the next call
            # gives the batch after it.
            epoch, batch = self._skip
            if batch >= self._bpe:
                # The failed batch was the epoch's last: the next iterator starts the next
                # epoch (_begin_epoch), after the code between epochs (a sampler's set_epoch).
                return None
            self._restart_at(epoch, batch, same_order=True)
            c = self._c
        try:
            b = c.next()
        except BaseException as e:
            if self._closed:  # closed by another thread while this one waited
                raise _closed_error() from e
            if isinstance(e, _workers.ShapeDiffers) and self._schema is not None and \
                    not self._schema.varying:
                self._go_varying(c)
                return self._next()
            if not isinstance(e, (Error, WorkerError)) or isinstance(e, InvalidError) or \
                    getattr(e, "from_dataset", False):
                st = _pinmem._loader_state_fields(c.state())
                self._skip = (st["epoch"], st["batch"] + 1)
            if isinstance(e, BusyError) and "still holds" in e.message:
                # Say it in the user's terms; the batch stays next (nothing skipped).
                held = c.stats()["held"]
                _pinmem._raise(_pinmem.PM_ERR_BUSY, f"{e.message}. pinmem.Loader: {held} "
                               "batches are held and the pinned budget has no room for another "
                               "slot: let go of batches you no longer need (or copy them out: "
                               "x.clone(), numpy.array(x)), or raise the budget "
                               "(pinmem.set_budget, PINMEM_BUDGET)")
            raise
        if self._closed:
            b = None
            _closed()
        if b is _EpochEnd:
            return None  # an epoch without a batch: its loop ends at once
        if b is None and self._per_epoch:
            st = _pinmem._loader_state_fields(c.state())
            nxt = st["epoch"]
            if self._epochs_total is None or nxt < self._epochs_total:
                self._c = None
                self._retire(c, replace=True)
                try:
                    self._open_epoch(nxt, 0, template=st)
                except BaseException:
                    self._c = self._retry_epoch(st, nxt)
                    raise
                return self._next()  # (its errors handled as any batch's)
        if b is not None and self._order is not None:
            b._order = self._order
        if b is not None and self._odd:
            t0 = _perf_counter()
            b = self._view_odd(b)
            self._conversion_s += _perf_counter() - t0
        return b

    def _go_varying(self, c):
        """A sample's shapes differ from the first sample's (C loader c failed its batch): from
        that batch on, every row has a VRow beside the slot and a sample that differs travels
        there whole, its batch stacked in this process (_staging.py); a batch whose samples all
        have the first sample's shapes still comes through the slot. The C loader starts again
        at that batch, in the same order, with the workers told."""
        st = _pinmem._loader_state_fields(c.state())
        self._c = None
        try:
            self._retire(c)
            self._schema.varying = True
            if self._pool is not None:
                self._pool.store.set_varying()  # frames of the stopped run are dropped
                self._pool.set_schema(self._schema, self._timeout)
            self._open_epoch(st["epoch"], st["batch"], template=st, same_order=True)
        except BaseException as e:
            self._failed = e
            raise

    def _stacked(self, epoch, index, indices, offs, mode, convert):
        """The batch of the dataset indices given whose samples differ from the first sample's
        in shape: stacked here and staged through a pinned block (onto the device with device
        batches)."""
        where = f"batch {index} of epoch {epoch}"
        if mode == "batch":
            raise InvalidError(f"PM_ERR_INVALID: pinmem.Loader: {where}: its samples' shapes "
                               "differ from the first sample's, so it is not in a slot and "
                               "batches() cannot give it; iterate the loader (or as_torch())")
        out = _staging.stack_rows(self._schema, indices, offs, self._unbatched, where)
        if self._stager is None:
            self._stager = _staging.Stager(self._to_device, self._device_index)
        out = self._stager.stage(out)
        if mode == "torch":
            t0 = _perf_counter()
            out = _staging.convert(out, convert)
            self._conversion_s += _perf_counter() - t0
        return out

    def _view_odd(self, b):
        import numpy
        arrays = list(b)
        for k, dt, shape in self._odd:
            arrays[k] = numpy.frombuffer(arrays[k], dtype=dt).reshape(
                tuple(shape) if self._unbatched else (-1,) + tuple(shape))
        nb = tuple.__new__(Batch, arrays)
        nb.__dict__.update(b.__dict__)
        return nb

    def batches(self):
        """Batch objects of one epoch (from the current position to the end of its epoch)."""
        if self._collate is not None:
            raise InvalidError("PM_ERR_INVALID: batches() gives the slot's arrays, and with a "
                               "collate_fn of your own the batch is its output: iterate the "
                               "loader")
        return _EpochIterator(self, "batch")

    def __iter__(self):
        if self._tensors:
            return self.as_torch()
        return _EpochIterator(self, "plain")

    def as_torch(self):
        """Like iterating, but each array becomes a torch tensor (torch.from_dlpack: the
        current torch stream waits for the batch's copy, without blocking the host)."""
        import torch
        return _EpochIterator(self, "torch", torch.from_dlpack)

    def __len__(self):
        """Batches per epoch (on this rank); with a sampler, of the sampler's next epoch (its
        len() now, as torch's len(DataLoader))."""
        c = self._check()
        if self._batch_sampler is not None:
            return len(self._batch_sampler)
        if self._sampler is not None:
            n, bs = len(self._sampler), self._config["batch_size"]
            return n // bs if self._config["drop_last"] else -(-n // bs)
        return self._batches_per_epoch(c)

    def _batches_per_epoch(self, c):
        """Batches per epoch without a sampler: of the dataset's length now where each epoch
        reads it, else of C loader c."""
        if self._per_epoch and self._python_ds:
            return _epoch_batches(len(self.dataset), self._config)[0]
        return c.stats()["batches_per_epoch"]

    @property
    def epoch(self):
        """The epoch of the next batch."""
        return self.state_dict()["epoch"]

    def worker_pids(self):
        """The process ids of the worker processes (empty without process workers)."""
        if self._closed:
            _closed()
        return [] if self._pool is None else self._pool.pids()

    def state_dict(self):
        """Where the loader stands: the next batch it will deliver (plain ints: checkpoint it)."""
        st = _pinmem._loader_state_fields(self._check().state())
        if self._skip is not None:
            # The batch before failed: the next one delivered is the one after it.
            epoch, batch = self._skip
            st.update(epoch=epoch, batch=batch) if batch < self._bpe else \
                st.update(epoch=epoch + 1, batch=0)
        return st

    def load_state_dict(self, state):
        """Continue from a state_dict(): the next batch delivered is the one it names. The
        dataset, batch_size, shuffle, seed, drop_last and sharding must be the same (and a
        sampler must give the same order for that epoch). A state that does not fit is refused
        with the loader left as it was."""
        self._check()
        try:
            values = {k: _int_arg(f"state_dict[{k!r}]", state[k], lo, hi)
                      for k, (lo, hi) in _STATE_KEYS.items()}
        except (KeyError, TypeError) as e:
            raise InvalidError(f"PM_ERR_INVALID: not a loader state_dict ({e!r})") from None
        packed = _pinmem._loader_state_pack(**values)
        old = self._c.state()
        # Check what the library would refuse before anything is closed; the configuration
        # first, so a state of another configuration is refused naming the field that differs.
        cur = _pinmem._loader_state_fields(old)
        shuffle = cur["flags"] & 1
        # Where each epoch reads its length or order, the count is the target epoch's to check
        # (_fit_resume), not the current one's.
        count = () if self._per_epoch else ("samples",)
        saved = dict(values, shuffle=values["flags"] & 1, drop_last=values["flags"] >> 1 & 1)
        have = dict(cur, shuffle=shuffle, drop_last=cur["flags"] >> 1 & 1)
        for k in ("magic", "shuffle", "drop_last", "flags", "batch_size", "rank",
                  "world_size") + count + (("seed",) if shuffle else ()):
            if saved[k] != have[k]:
                raise InvalidError(f"PM_ERR_INVALID: the state was saved with {k} {saved[k]}, "
                                   f"this loader has {have[k]}: the order of the samples would "
                                   "differ")
        if self._sampler is None and values["batch"] > 0:
            # (the epoch's batches are known without a sampler: refused before any worker stops)
            bpe = self._batches_per_epoch(self._c)
            if values["batch"] >= bpe:
                raise InvalidError(f"PM_ERR_INVALID: resume state batch {values['batch']}, an "
                                   f"epoch has {bpe}")
        c, self._c = self._c, None
        # What _open_epoch changes, for a state it refuses (per-epoch mode: the epoch's order).
        kept = self._ds, self._order, self._bpe, self._c_epoch
        self._retire(c)  # batches still held keep their slots until they go (a stuck worker:
        # the error, kept in self._failed)
        try:
            self._open_epoch(values["epoch"], values["batch"], resume=packed)
        except BaseException:
            self._clear_side()
            self._ds, self._order, self._bpe, self._c_epoch = kept
            self._c = c if isinstance(c, _NoBatches) else self._on_device(
                lambda: _pinmem._Loader(self._ds, resume=old, **self._epoch_config(kept[3])))
            raise
        finally:
            self._iteration_s = self._conversion_s = 0.0  # as the library's counters
        self._resume_pending = True  # the next iterator starts here
        self._skip = None
        self._past_end = False

    def _epoch_config(self, epoch):
        """The C loader's configuration for a loader starting in `epoch` (per-epoch mode: that
        epoch alone)."""
        cfg = dict(self._config)
        if self._per_epoch:
            # (never past epochs=N: a state saved after the last epoch resumes with nothing)
            cfg["epochs"] = epoch + 1 if self._epochs_total is None else \
                min(epoch + 1, self._epochs_total)
        return cfg

    def stats(self):
        """The loader's statistics (since it was created or last given a state_dict): the
        library's counters (batches, stall_seconds: time next() waited for data, next_seconds:
        all time inside the library's next(), read/copy seconds...) and where the rest of a
        training loop's wait for its batches went: conversion_seconds (the batches' arrays made
        into the caller's type: as_torch()'s torch.from_dlpack, views of odd dtypes),
        iteration_seconds (all time inside the iterators' __next__: next(), conversion and the
        glue) and glue_seconds (iteration less next() and conversion: Python's own work per
        batch). With worker processes also `workers` ('process'), `worker_pids`,
        `worker_numa_cpus` (the CPU ids the workers were put on, the NUMA node of the loader's
        device; None: left where the scheduler puts them) and `worker_numa_refused` (workers that
        could not move there and run elsewhere, e.g. a cpuset without those CPUs; the first one's
        reason in `worker_numa_problem`, "" when none). `staged_batches` and `staged_bytes`: the
        batches built outside the slots (a collate_fn's output for the device; batches whose
        shapes differ from the first sample's) and their bytes, staged through pinned blocks;
        `staged_largest_bytes`: the largest of them; `staged_device_blocks`: the device blocks
        allocated for them (the others reused a block whose batch was let go)."""
        out = self._check().stats()
        out["fields"] = 0 if self._ds is None else len(self._ds.fields())
        out["conversion_seconds"] = self._conversion_s
        out["iteration_seconds"] = self._iteration_s
        out["glue_seconds"] = max(0.0, self._iteration_s - out["next_seconds"] -
                                  self._conversion_s)
        stager = self._stager
        out["staged_batches"] = 0 if stager is None else stager.batches
        out["staged_bytes"] = 0 if stager is None else stager.bytes
        out["staged_largest_bytes"] = 0 if stager is None else stager.largest
        out["staged_device_blocks"] = 0 if stager is None else stager.device_blocks
        out["workers"] = "process" if self._pool is not None else "thread"
        out["worker_pids"] = self.worker_pids()
        pool = self._pool
        out["worker_numa_cpus"] = None if pool is None else pool.cpus
        out["worker_numa_refused"] = 0 if pool is None else len(pool.numa_problems)
        out["worker_numa_problem"] = "" if pool is None or not pool.numa_problems else \
            pool.numa_problems[min(pool.numa_problems)]
        return out

    def close(self):
        """Stop the workers and free the slots. Never fails because batches are still alive:
        each of those returns its slot to the pool when it goes. Closing twice is harmless.
        Worker processes are stopped and joined (terminated if they do not go within 5 s)."""
        self._closed = True  # first: a thread inside next() sees it when its wait ends
        c, self._c = self._c, None
        pool, self._pool = self._pool, None
        if pool is not None and self._base is not None:
            _pinmem._procs_cancel(self._base)  # no thread waits for a worker any more
            pool.stop()  # the processes are gone: nothing writes into the slots any more
        try:
            if c is not None:
                c.close()
        finally:
            if pool is not None:
                pool.close()
                # The worker-process dataset holds an eventfd (and the sockets' numbers): let
                # it go now rather than when the Loader object goes.
                self._base = self._ds = None
            if self._stager is not None:
                self._stager.close()  # copies in flight done: their pinned blocks go back

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # A loader dropped without close(): its worker processes go with it, in the same
        # order as close() (cancel the waits, stop the processes, then free the slots).
        try:
            if getattr(self, "_pool", None) is not None:
                self.close()
        except Exception:
            pass


def _int_option(name, default):
    """An integer option of the library's table (its value in force: a malformed PINMEM_ value
    is ignored there and the reason shown by pinmem.options() and `pinmem info`, never fatal)."""
    try:
        return int(_pinmem.get_option(name).split()[0])
    except (Error, ValueError, IndexError):
        return default


# Loader threads per worker process (option process_depth, PINMEM_PROCESS_DEPTH): each
# process has its next claim of rows queued while it works on one, so strictly ordered claims
# never wait for the slowest process (see procs.c).
_PROCESS_DEPTH = _int_option("process_depth", 2)
# Rows per claim (process_claim, PINMEM_PROCESS_CLAIM; one message and one reply each):
# small enough that a batch spreads over the processes and its copy starts early, large enough
# that the messages cost nothing.
_PROCESS_CLAIM = _int_option("process_claim", 8)


def _is_default_collate(fn):
    mod = getattr(fn, "__module__", "") or ""
    return getattr(fn, "__name__", "") == "default_collate" and mod.startswith("torch.utils.data")


def _seed_from(generator):
    """A base seed as torch's DataLoader draws one: from `generator`, else from torch's default
    generator (so torch.manual_seed decides the shuffle) when the program uses torch (torch is
    imported: pinmem never imports it for NumPy users, a second or more); 0 otherwise."""
    import sys
    if generator is None and "torch" not in sys.modules:
        return 0
    import torch
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()) & \
        ((1 << 63) - 1)


def _mix_seed(seed, epoch):
    """The workers' base seed for an epoch when they are started anew each epoch."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + 1) & ((1 << 64) - 1)
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 29)) & ((1 << 62) - 1)


def get_worker_info():
    """Inside a worker process of a pinmem.Loader: its id, num_workers, seed and dataset (as
    torch.utils.data.get_worker_info()) and cpus (the CPU ids NUMA placement put it on; None:
    not moved); None in the main process."""
    from . import _workers
    return _workers.get_worker_info()


from ._workers import WorkerError  # noqa: E402,F401  (re-exported by pinmem)
