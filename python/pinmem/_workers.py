"""DESIGN: worker processes for map-style Python datasets.

A pinmem.Loader over a Python dataset with num_workers > 0 starts that many processes (the
start method is multiprocessing's, or the loader's multiprocessing_context). Each is paired with
one of the C loader's worker threads through a SOCK_SEQPACKET socket pair: the thread sends a
claim (the dataset indices of a run of consecutive rows of a batch slot, and where each field's
rows are: a memfd key and an offset), the process calls dataset[i] for each index and writes
every leaf of the sample straight into its row of the slot, a pinned memory block it has mapped
(the memfd arrives once per block, by SCM_RIGHTS), then answers with one short reply. So no
sample byte crosses a pipe or is touched by the main process, which only queues the DMA of the
slot: torch's DataLoader instead pickles each batch through shared memory (copy 1) and copies it
again into pinned memory in the main process (copy 2, under the GIL).

What has no bytes for a slot travels beside it, on a second (stream) socket per worker: a
sample's non-array leaves (str, bytes, None, objects), and with a collate_fn of the user's own
(claims are then whole batches) the collate_fn's output, which for device batches the
receiving thread stages at once (_staging.py: pinned block, copy queued to the device). The
worker sends a claim's frame before its reply, a thread of the main process files the frames by
(epoch, batch, row), which a claim's request carries after its indices (an index read twice in
an epoch is two rows), and each batch takes its own as it is delivered. Empty arrays (a
zero-size dimension) take no slot bytes: the main process makes them per batch. Once a sample's
shapes differ from the first sample's (Schema.varying, set by the loader when that first
happens), every row sends a VRow: its non-array leaves, or, for a sample that differs, all its
leaves, which the main process stacks into its batch (_staging.py); its slot row stays unwritten.

The claims go to the threads, hence to the processes, in a fixed order (the C loader's
ordered_workers), and each process seeds its generators from (seed, worker id) as torch's
workers do: a run's batches, random augmentation included, are the same on every run.

Faults: an exception in dataset[i] travels back as a reply (type, message, traceback text) and
is raised in the main process at that batch; a process that dies shows as end-of-file on its
socket (the C thread sees it at once and the loader fails the batch with the exit code or
signal); a process whose parent died sees end-of-file on its socket and exits; workers ignore
SIGINT, so Ctrl-C reaches only the main program. Workers never touch CUDA or pinmem's library.

NUMA: the main process asks the library once per pool for the CPUs its own threads use for the
loader's device (_pinmem._numa_worker_cpus: the device's node's CPUs within those the process
was allowed; None on one node, with numa=off or numa_threads=0, or delivery to the CPU) and each
worker moves onto them first thing, before worker_init_fn, so an affinity the user sets there
wins. A worker that cannot (EINVAL: none of those CPUs in its cpuset) goes on where it is and
says why in its SCHEMA reply; the loader's stats() count such workers (worker_numa_refused).

Messages (little-endian):
  request  = magic u32, kind u32, epoch u64, n u64, nfields u32, nnew u32, tag u64,
             nfields x (key u64, offset u64, row_bytes u64), nnew x key u64, n x index u64;
             the nnew memfds are attached (SCM_RIGHTS) in the order of their keys.
  reply    = magic u32, status i32, index u64, tag u64 (the request's), then a payload (pickle)
             for status != 0, for DESCRIBE, and for SCHEMA (None, or why the worker kept its CPU
             affinity). The main process checks the tag: a reply that answers another request
             is an error, never rows taken as written.
  side     = length u64, then pickle((epoch, [key per row or batch], [values])), on the stream.
"""

import io
import os
import pickle
import signal
import socket
import struct
import sys
import traceback

from collections.abc import Mapping as _Mapping

from ._pinmem import InvalidError as _InvalidError

REQ = struct.Struct("<IIQQIIQ")
FIELD = struct.Struct("<QQQ")
REP = struct.Struct("<IiQQ")
REP_TAG = struct.Struct("<Q")  # REP's last field
MAGIC_REQ = 0x51524D50  # "PMRQ"
MAGIC_REP = 0x50524D50  # "PMRP"
KIND_ROWS, KIND_DESCRIBE, KIND_SCHEMA = 1, 2, 3
ST_OK, ST_EXC, ST_INVALID, ST_INIT = 0, 1, 2, 3
MAX_MSG = 1 << 20
# Every message a worker sends stays far below the smallest socket send buffer (a SOCK_SEQPACKET
# message larger than it fails to send at all): error texts and tracebacks are cut to fit.
MAX_REPLY = 48 << 10
MAX_TEXT = 16 << 10
MAX_FDS = 64
SIDE = struct.Struct("<Q")  # the length of one frame of non-array leaves (a stream socket)

def _rng_states():
    """The random streams a dataset's __getitem__ draws from (Python's, NumPy's and torch's,
    where imported), to put back after a read that is not a sample's delivery."""
    import random
    out = [(random.setstate, random.getstate())]
    np_mod = sys.modules.get("numpy")
    if np_mod is not None:
        out.append((np_mod.random.set_state, np_mod.random.get_state()))
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None and hasattr(torch_mod, "get_rng_state"):
        out.append((torch_mod.set_rng_state, torch_mod.get_rng_state()))
    return out


def _rng_restore(states):
    for put, state in states:
        put(state)


# ---- sample structure ------------------------------------------------------------------------


class ShapeDiffers(_InvalidError):
    """A sample with the first sample's structure whose leaf has another shape or dtype. The
    loader takes it as the sign that shapes vary between batches (Schema.varying)."""


class VRow:
    """A row's value beside the slot once shapes vary: its non-array leaves (objs, in leaf
    order) when its sample went into the slot, or every leaf of a sample that differs from the
    first one (off: [(value, kind)] as _flatten gives them), which the main process stacks."""

    def __init__(self, objs, off):
        self.objs, self.off = objs, off


def off_leaves(sample, index, np):
    """Every leaf of a sample that differs from the first sample: [(value, kind)]."""
    leaves, paths = [], []
    _flatten(sample, np, index, leaves, paths)
    return leaves


_MARK = []


def _mark():
    """[a 0-d uint8 one]: the slot value of a row whose sample has nothing for the slot."""
    if not _MARK:
        import numpy
        _MARK.append(numpy.ones((), numpy.uint8))
    return _MARK


class Schema:
    """How a sample is built: a tree of tuples, lists, dicts and named tuples whose leaves are
    arrays (NumPy, torch CPU tensors, Python numbers), and each leaf's dtype and shape. Batches
    are rebuilt in this shape, each leaf batched along a new first axis (default_collate)."""

    # Shapes vary between batches (set once a sample differs from the first): every row then
    # has a VRow beside the slot, and a sample that differs travels there whole.
    varying = False

    def __init__(self, tree, leaves, paths):
        self.tree = tree        # ("leaf", k) | ("tuple"|"list", [...]) | ("dict", [(key, t)])
        self.leaves = leaves    # [(numpy dtype, shape, kind)]
        #   kind: array|tensor|int|float|bool|obj|bits:<dtype name>
        #   (bits: a torch dtype NumPy lacks, its bits in an unsigned int)
        self.paths = paths      # ["[0]", "['image']", ...] names for messages
        self.ref = _shape_tree(tree)
        # Leaves with no elements (a zero-size dimension) have no bytes for the slot: the slot
        # holds the others (`slot`: their leaf numbers, in field order) and the main process
        # makes the empty ones per batch (`make_empty`).
        self.slot = [k for k, (_, shape, kind) in enumerate(leaves)
                     if kind != "obj" and 0 not in shape]
        self.empty = len(self.slot) != len(leaves)
        # A sample with nothing for the slot (strings alone, empty arrays): the slot holds one
        # byte per row, set when the row is read (the C loader's rows need bytes), and the batch
        # is built from the leaves beside it.
        self.mark = not self.slot
        # Leaves that are no arrays (str, bytes, None, any object) travel beside the slot, per
        # row, and arrive as lists, as default_collate keeps strings.
        self.objs = [k for k, (_, _, kind) in enumerate(leaves) if kind == "obj"]
        # default_collate gives the strings of a leaf inside a tuple, list or named tuple as a
        # tuple (the transposed batch), inside a dict as a list.
        self.obj_tuple = set()
        _in_sequence(tree, False, self.obj_tuple)
        # The common shapes (one leaf; a tuple, list or dict of leaves) get a fast check per
        # sample; anything else, or a sample that fails it, takes the full walk (which also
        # writes the error message).
        self.flat = None
        if tree[0] == "leaf":
            self.flat = ("leaf", None)
        elif tree[0] in ("tuple", "list") and all(c[0] == "leaf" for c in tree[1]):
            self.flat = (tree[0], len(tree[1]))
        elif tree[0] == "dict" and all(c[0] == "leaf" for _, c in tree[1]):
            self.flat = ("dict", tuple(k for k, _ in tree[1]))

    def fast_leaves(self, sample, np):
        """The leaves of a sample of the common shapes when every one matches exactly (numbers
        as they are: NumPy converts them on assignment), else None."""
        kind, arg = self.flat
        if kind == "leaf":
            vals = (sample,)
        elif kind == "dict":
            if type(sample) is not dict or len(sample) != len(arg):
                return None
            try:
                vals = [sample[k] for k in arg]
            except KeyError:
                return None
        else:
            if type(sample) is not (tuple if kind == "tuple" else list) or len(sample) != arg:
                return None
            vals = sample
        out = []
        for v, (dt, shape, k) in zip(vals, self.leaves):
            t = type(v)
            if t is np.ndarray:  # the common case first (an obj leaf's dt is None: no match)
                if v.dtype != dt or v.shape != shape or k[0] == "b" and k != "bool":
                    return None
            elif k == "obj":
                pass
            elif k == "int" and t is int or k == "float" and t is float or \
                    k == "bool" and t is bool:
                pass
            elif k[0] == "b" and k != "bool":  # "bits:<name>": bfloat16, float8...
                if getattr(v, "device", None) is None or v.device.type != "cpu" or \
                        str(v.dtype) != "torch." + k[5:]:
                    return None
                v = tensor_bits(v)[0]
                if v.shape != shape:
                    return None
            elif k == "tensor" and getattr(v, "device", None) is not None:
                if v.device.type != "cpu":
                    return None
                try:
                    v = v.detach().numpy()
                except (TypeError, RuntimeError):
                    return None
                if v.dtype != dt or v.shape != shape:
                    return None
            else:
                return None
            out.append(v)
        return out

    def specs(self):
        """(sample shape, dtype text, itemsize) per slot field, for the C dataset."""
        if self.mark:
            return [((), "|u1", 1)]
        return [(shape, k[5:] if k.startswith("bits:") else dt.str, dt.itemsize)
                for dt, shape, k in (self.leaves[j] for j in self.slot)]

    def slot_fields(self, np):
        """(NumPy dtype, sample shape) per slot field (a torch dtype NumPy lacks: its bits)."""
        if self.mark:
            return [(np.dtype(np.uint8), ())]
        return [self.leaves[j][:2] for j in self.slot]

    def obj_values(self, leaves):
        """The non-array leaves of a sample, in leaf order."""
        return [leaves[k] for k in self.objs]

    def slot_values(self, leaves):
        """The leaves that go into the slot, in field order."""
        if self.mark:
            return _mark()
        return [leaves[k] for k in self.slot] if self.empty else leaves

    def rebuild(self, values, unbatched=False, objs=None, rows=None):
        """The batch's structure around the slot fields' values (in field order), the empty
        leaves made here as default_collate would stack them: (rows, *shape), of the other
        fields' kind (torch tensors on their device, else NumPy arrays; torch tensors for dtypes
        NumPy lacks)."""
        if self.empty:
            values = self._with_empty(values, unbatched, objs, rows)
        return _rebuild(self.tree, values)

    def _with_empty(self, values, unbatched, objs, nrows=None):
        """objs: per row, its non-array leaves (in leaf order). values: the slot's, the mark's
        alone where the sample has nothing for the slot, or none (iterable datasets, which say
        how many rows: nrows)."""
        first = values[0] if values else None
        rows = () if unbatched else \
            (first.shape[0] if first is not None else nrows if nrows is not None else len(objs),)
        torch = sys.modules.get("torch")
        # Without a slot value (an iterable batch of strings and empty arrays) the samples'
        # own leaves tell: torch tensors give torch tensors.
        on_torch = type(first).__module__.startswith("torch") if first is not None else \
            any(kind == "tensor" for _, _, kind in self.leaves)
        out, it, j = [], iter(() if self.mark else values), 0
        for k, (dt, shape, kind) in enumerate(self.leaves):
            if kind == "obj":
                col = [row[j] for row in objs]
                out.append(objs[0][j] if unbatched else
                           tuple(col) if k in self.obj_tuple else col)
                j += 1
                continue
            if 0 not in shape:
                out.append(next(it))
                continue
            if kind.startswith("bits:") or on_torch:
                if torch is None:
                    import torch
                tdt = getattr(torch, kind[5:]) if kind.startswith("bits:") else \
                    torch.from_numpy(__import__("numpy").empty(0, dt)).dtype
                out.append(torch.empty(rows + shape, dtype=tdt,
                                       device=first.device if first is not None and on_torch
                                       else "cpu"))
            else:
                import numpy as np
                out.append(np.empty(rows + shape, dt))
        return out

    def is_single(self):
        return self.tree[0] == "leaf"


class CollateSchema:
    """The layout of a loader with a collate_fn of its own: one byte per row in the slot (set
    once the row's claim, a whole batch, is done); the collate_fn's output travels beside."""

    collate = True
    objs = ()
    varying = False
    varying = False

    def __init__(self, unbatched):
        self.unbatched = unbatched

    def specs(self):
        return [((), "|u1", 1)]

    def is_single(self):
        return True


def _serve_collated(dataset, collate, unbatched, maps, fields, indices, np, wid, epoch, side):
    """One claim (a whole batch): its samples, collate_fn on them, the output sent beside the
    slot, then the rows marked done."""
    key, off, _ = fields[0]
    samples = []
    for i in indices:
        try:
            samples.append(dataset[i])
        except BaseException as e:
            return _pack_error(ST_EXC, i, wid, e, "dataset")
    try:
        out = collate(samples[0] if unbatched else samples)
    except BaseException as e:
        return _pack_error(ST_EXC, indices[0], wid, e, "collate_fn")
    try:
        data = dumps((epoch, [tuple(indices)], [out], None))
    except BaseException as e:
        return _pack_error(ST_EXC, indices[0], wid, e, "collate_fn")
    try:
        side.sendall(SIDE.pack(len(data)) + data)
    except OSError as e:
        return _pack_error(ST_EXC, indices[0], wid, e, "collate_fn")
    np.ndarray((len(indices),), np.uint8, buffer=maps[key], offset=off)[:] = 1
    return REP.pack(MAGIC_REP, ST_OK, 0, 0)


def _in_sequence(t, seq, out):
    """The leaf numbers of t whose parent is a tuple, list or named tuple, added to out."""
    if t[0] == "leaf":
        if seq:
            out.add(t[1])
    elif t[0] == "dict":
        for _, c in t[1]:
            _in_sequence(c, False, out)
    else:
        for c in t[1]:
            _in_sequence(c, True, out)


def _rebuild(t, values):
    kind = t[0]
    if kind == "leaf":
        return values[t[1]]
    if kind == "dict":
        d = {k: _rebuild(c, values) for k, c in t[1]}
        return _as_type(t[2], d) if len(t) > 2 else d
    items = [_rebuild(c, values) for c in t[1]]
    if kind == "namedtuple":
        return t[2](*items)
    if len(t) > 2:  # a list subclass
        return _as_type(t[2], items)
    return items  # tuples and lists alike, as torch's default_collate


def masked_error(what):
    """The loader's refusal of a NumPy masked array: a batch holds the array's bytes and has no
    place for the mask, so delivering it would hand the masked elements out as valid (as
    pinmem.copy refuses a __cuda_array_interface__ with a mask)."""
    return _invalid(f"{what} is a NumPy masked array; the loader delivers an array's bytes and "
                    "cannot leave masked elements out: give a.filled(value), or the data and "
                    "numpy.ma.getmaskarray(a) as two fields")


def _leaf(v, np, path, index):
    """A leaf as a NumPy array and its kind, or an InvalidError naming what is wrong."""
    if isinstance(v, np.ma.MaskedArray):
        # Batched or not (batch_size=None): either way the mask would be lost unseen.
        raise masked_error(f"dataset index {index}, field {path}")
    if isinstance(v, np.ndarray):
        # A subclass (np.matrix) as its plain array, as default_collate's torch.as_tensor
        # takes it: np.stack of matrices fails.
        return (v if type(v) is np.ndarray else np.asarray(v)), "array"
    if isinstance(v, (str, bytes)):  # np.str_ and np.bytes_ too: strings, as DataLoader keeps them
        return v, "obj"
    if isinstance(v, bool):
        return np.asarray(v, dtype=np.bool_), "bool"
    if isinstance(v, int):
        return np.asarray(v, dtype=np.int64), "int"
    if isinstance(v, float):
        return np.asarray(v, dtype=np.float64), "float"
    if isinstance(v, np.generic):
        return np.asarray(v), "array"
    mod = type(v).__module__ or ""
    if mod.startswith("torch") and hasattr(v, "device") and hasattr(v, "numpy"):
        if v.device.type != "cpu":
            raise _invalid(f"dataset index {index}, field {path}: a tensor on {v.device}; worker "
                           "samples must be CPU tensors (the loader moves the batch)")
        bits = tensor_bits(v)
        if bits is not None:
            return bits[0], "bits:" + bits[1]
        try:
            # A conjugate or negative view (x.conj(), its .imag) as the values it shows.
            return v.detach().resolve_conj().resolve_neg().numpy(), "tensor"
        except (TypeError, RuntimeError) as e:
            raise _invalid(f"dataset index {index}, field {path}: a {v.dtype} tensor has no "
                           f"type pinmem can batch ({e}); convert it in the dataset") from None
    return v, "obj"  # str, bytes, None, any object: delivered beside the batch, as a list


# torch dtypes NumPy lacks but DLPack carries (pinmem's dtype table has them): samples of these
# travel as their bits (an unsigned integer of the same size) and batches are described by name.
BITS_DTYPES = ("bfloat16", "complex32", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
               "float8_e5m2fnuz", "float8_e8m0fnu")


class _Pickler(pickle.Pickler):
    """pickle's Pickler, but a CPU tensor of an unsigned type torch's own pickling cannot load
    again (uint16, uint32, uint64: "UntypedStorage has no attribute dtype" at load, torch 2.15)
    travels as its NumPy array, rebuilt by torch.from_numpy."""

    def reducer_override(self, obj):
        if type(obj).__name__ != "Tensor":
            return NotImplemented
        torch = sys.modules.get("torch")
        if torch is None or type(obj) is not torch.Tensor or obj.device.type != "cpu" or \
                obj.dtype not in _unsigned(torch):
            return NotImplemented
        return _from_numpy, (obj.detach().resolve_conj().numpy(),)


def _unsigned(torch):
    return tuple(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n))


def _from_numpy(a):
    import torch
    return torch.from_numpy(a)


def dumps(obj):
    """pickle.dumps for what a worker sends: unsigned CPU tensors too (_Pickler)."""
    f = io.BytesIO()
    _Pickler(f, pickle.HIGHEST_PROTOCOL).dump(obj)
    return f.getvalue()


def tensor_bits(t):
    """(a NumPy view of the bits of CPU tensor t, its dtype's name) for a dtype of BITS_DTYPES,
    else None."""
    name = str(t.dtype)
    if not name.startswith("torch.") or name[6:] not in BITS_DTYPES:
        return None
    torch = sys.modules["torch"]
    store = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.detach().contiguous().view(store).numpy(), name[6:]


def _invalid(msg):
    from . import InvalidError
    return InvalidError("PM_ERR_INVALID: pinmem.Loader: " + msg)


def _own_type(x, plain):
    """(type(x),) where a batch is made as that type (a dict or list subclass, a mapping such as
    UserDict: default_collate keeps the sample's container type), else (); a class that could
    not travel to the workers (a local one) is not kept."""
    cls = type(x)
    if cls is plain:
        return ()
    try:
        pickle.dumps(cls)
    except Exception:  # noqa: BLE001  (any class pickle refuses)
        return ()
    return (cls,)


def _as_type(cls, value):
    """value (a dict or list) as cls, as default_collate makes it: cls(value), else an empty
    cls filled (a defaultdict, its default_factory None), else value itself."""
    try:
        return cls(value)
    except Exception:  # noqa: BLE001
        pass
    try:
        out = cls()
        (out.update if isinstance(value, dict) else out.extend)(value)
        return out
    except Exception:  # noqa: BLE001
        return value


def _flatten(x, np, index, out, paths, path="", types=False):
    """The tree of x; its leaves appended to out (arrays), their names to paths. types: the
    container classes a batch is made as (_own_type), for the schema alone: a sample checked
    against it is compared by _shape_tree, which has none."""
    rest = (np, index, out, paths)
    if isinstance(x, dict) or not isinstance(x, (tuple, list)) and isinstance(x, _Mapping):
        # (the Mapping check last: UserDict, a tokenizer's BatchEncoding)
        return ("dict", [(k, _flatten(x[k], *rest, f"{path}[{k!r}]", types)) for k in x]) + \
            (_own_type(x, dict) if types else ())
    if isinstance(x, tuple) and hasattr(type(x), "_fields"):
        return ("namedtuple", [_flatten(c, *rest, f"{path}.{f}", types)
                               for f, c in zip(type(x)._fields, x)], type(x))
    if isinstance(x, (tuple, list)):
        kind = "list" if isinstance(x, list) else "tuple"
        return (kind, [_flatten(c, *rest, f"{path}[{i}]", types) for i, c in enumerate(x)]) + \
            (_own_type(x, list) if types and kind == "list" else ())
    a, kind = _leaf(x, np, path or "(the sample)", index)
    out.append((a, kind))
    paths.append(path or "(the sample)")
    return ("leaf", len(out) - 1)


def _shape_tree(t):
    """The tree without leaf indices, to compare structures."""
    if t[0] == "leaf":
        return "leaf"
    if t[0] == "dict":
        return ("dict", tuple((k, _shape_tree(c)) for k, c in t[1]))
    return (t[0], tuple(_shape_tree(c) for c in t[1]))


def describe(sample, index):
    """The Schema of one sample."""
    import numpy as np
    leaves, paths = [], []
    tree = _flatten(sample, np, index, leaves, paths, types=True)
    if not leaves:
        raise _invalid(f"dataset index {index}: the sample holds nothing to batch (an empty "
                       f"{type(sample).__name__})")
    slots = sum(kind != "obj" for _, kind in leaves)  # strings and objects travel beside
    if slots > 16:
        raise _invalid(f"dataset index {index}: the sample has {slots} arrays and numbers; a "
                       "batch holds at most 16 (pack some together in the dataset)")
    specs = []
    for (a, kind), p in zip(leaves, paths):
        if kind == "obj":
            specs.append((None, None, kind))
            continue
        dt = a.dtype
        if dt.hasobject or dt.itemsize == 0:
            raise _invalid(f"dataset index {index}, field {p}: dtype {dt} has no fixed-size "
                           "bytes")
        if dt.byteorder == ">" or dt.fields is not None or dt.kind in "OUSVMm":
            raise _invalid(f"dataset index {index}, field {p}: dtype {dt} is not a number "
                           "type a batch holds (nor a tensor's); return a native number type")
        specs.append((dt, tuple(a.shape), kind))
    return Schema(tree, specs, paths)


# ---- the worker process ----------------------------------------------------------------------


class WorkerInfo:
    """What a worker knows about itself (pinmem.get_worker_info())."""

    __slots__ = ("id", "num_workers", "seed", "dataset", "cpus")

    def __init__(self, id, num_workers, seed, dataset, cpus=None):
        self.id, self.num_workers, self.seed, self.dataset = id, num_workers, seed, dataset
        self.cpus = cpus  # the CPU ids NUMA placement put this worker on; None: left alone

    def __repr__(self):
        return (f"WorkerInfo(id={self.id}, num_workers={self.num_workers}, seed={self.seed}, "
                f"dataset={type(self.dataset).__name__})")


_worker_info = None


def get_worker_info():
    """In a worker process of a pinmem.Loader: its WorkerInfo (id, num_workers, seed, dataset,
    cpus); None in the main process."""
    return _worker_info


def _seed_all(seed, wid, base_seed):
    import random
    random.seed(seed)
    try:
        import numpy as np
        np.random.seed(np.random.SeedSequence([wid, base_seed]).generate_state(4))
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.manual_seed(seed)
        # As torch's own workers: one intra-op thread per worker process, or N processes each
        # running a pool of threads as large as the machine fight over the cores.
        torch.set_num_threads(1)


def _set_torch_worker_info(info):
    """torch.utils.data.get_worker_info() answers inside pinmem's workers too, for datasets
    that shard themselves with it. Only where torch is already imported (by fork, or by the
    dataset's unpickling): importing it for this alone would cost every worker seconds."""
    if "torch" not in sys.modules:
        return
    try:
        from torch.utils.data._utils import worker as tw
    except Exception:
        return
    try:
        tw._worker_info = tw.WorkerInfo(id=info.id, num_workers=info.num_workers,
                                        seed=info.seed, dataset=info.dataset)
    except Exception:
        pass


def _cut(text, limit):
    if len(text) <= limit:
        return text
    return text[:limit] + f"... [{len(text) - limit} more characters cut]"


def _safe_text(exc):
    """str(exc), or its repr when __str__ raises, or a note when both do."""
    for f in (str, repr):
        try:
            return f(exc)
        except BaseException:
            pass
    return f"<{type(exc).__qualname__} whose __str__ and __repr__ raise>"


def _pack_error(status, index, wid, exc, where):
    try:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except BaseException:  # a __str__ that raises inside the formatting
        tb = f"{type(exc).__qualname__}: {_safe_text(exc)}\n"
    # StopIteration out of dataset[i] would end the main process's loop quietly; KeyboardInterrupt
    # and other BaseExceptions would stop the main program as if its user pressed Ctrl-C: both
    # arrive as WorkerError naming them (the type is not sent).
    plain = isinstance(exc, Exception) and not isinstance(exc, StopIteration)
    payload = {"type": type(exc) if plain else None, "module": type(exc).__module__,
               "name": type(exc).__qualname__, "text": _cut(_safe_text(exc), MAX_TEXT),
               "tb": _cut(tb, MAX_TEXT), "worker": wid, "pid": os.getpid(), "index": index,
               "where": where}
    head = REP.pack(MAGIC_REP, status, index, 0)
    for drop in ((), ("type",), ("type", "tb", "text")):
        for k in drop:
            payload[k] = None if k == "type" else "(cut: too long to send)"
        try:
            data = head + pickle.dumps(payload)
        except BaseException:
            continue
        if len(data) <= MAX_REPLY:
            return data
    return head + pickle.dumps({k: (v if isinstance(v, (int, type(None))) else str(v)[:200])
                                for k, v in payload.items()})


def _place(cpus):
    """Move this process onto `cpus` (None: leave it). (the CPUs applied or None, why not)."""
    if cpus is None:
        return None, None
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:  # EINVAL: none of them in this process's cpuset; go on where it is
        return None, f"sched_setaffinity({sorted(cpus)}): {e.strerror or e}"
    return sorted(cpus), None


def worker_start(dataset, wid, nworkers, base_seed, close_fds, cpus):
    """What a worker process (map-style or iterable) does first, before worker_init_fn: ->
    (its WorkerInfo, also get_worker_info()'s and torch's; why placing it on `cpus` failed, or
    None)."""
    global _worker_info
    import gc
    # Objects inherited through fork are never collected here: a cycle the parent had not yet
    # freed (a torch DataLoader iterator, say) would otherwise run its __del__ in this process,
    # from inside whatever allocates, even an import, whose module lock then breaks (KeyError
    # in importlib on Python 3.11) and kills the worker.
    gc.freeze()
    placed, place_error = _place(cpus)  # first: a worker_init_fn's own affinity wins
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the main program
    for fd in close_fds:  # other workers' sockets inherited through fork
        try:
            os.close(fd)
        except OSError:
            pass
    seed = (base_seed + wid) % (1 << 64)  # torch.manual_seed takes 0..2**64-1
    _seed_all(seed, wid, base_seed)
    _worker_info = WorkerInfo(wid, nworkers, seed, dataset, placed)
    _set_torch_worker_info(_worker_info)
    return _worker_info, place_error


def worker_main(sock, dataset, wid, nworkers, base_seed, init_fn, close_fds, cpus=None,
                side=None, collate=None):
    """The body of worker process `wid`: serve claims until the socket closes."""
    _, place_error = worker_start(dataset, wid, nworkers, base_seed, close_fds, cpus)
    import numpy as np
    init_error = None
    if init_fn is not None:
        try:
            init_fn(wid)
        except BaseException as e:  # reported with the first claim
            init_error = e
    maps = {}  # memfd key -> mmap
    schema = None
    import mmap as _mmap
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, MAX_MSG, MAX_FDS)
        except (ConnectionError, OSError):
            break
        if not msg:
            break  # the main process closed the loader or died
        tag = 0
        try:
            magic, kind, epoch, n, nfields, nnew, tag = REQ.unpack_from(msg, 0)
            if magic != MAGIC_REQ:
                raise RuntimeError(f"bad request magic {magic:#x}")
            pos = REQ.size
            fields = [FIELD.unpack_from(msg, pos + k * FIELD.size) for k in range(nfields)]
            pos += nfields * FIELD.size
            keys = struct.unpack_from(f"<{nnew}Q", msg, pos)
            pos += 8 * nnew
            indices = struct.unpack_from(f"<{n}Q", msg, pos)
            # A claim of rows ends with its batch and first row (None for other requests).
            at = struct.unpack_from("<QQ", msg, pos + 8 * n) \
                if kind == KIND_ROWS and len(msg) >= pos + 8 * n + 16 else None
        except Exception as e:
            for fd in fds:
                os.close(fd)
            if not _send(sock, _tagged(_pack_error(ST_EXC, 0, wid, e, "request"), tag)):
                break
            continue
        for key, fd in zip(keys, fds):
            try:
                size = os.fstat(fd).st_size
                old = maps.pop(key, None)
                maps[key] = _mmap.mmap(fd, size, _mmap.MAP_SHARED,
                                       _mmap.PROT_READ | _mmap.PROT_WRITE)
                if old is not None:
                    try:
                        old.close()
                    except BufferError:
                        pass
            finally:
                os.close(fd)
        if init_error is not None:
            reply = _pack_error(ST_INIT, indices[0] if indices else 0, wid, init_error,
                                "worker_init_fn")
        elif kind == KIND_DESCRIBE:
            i = indices[0]
            rng = _rng_states()  # this look at a sample draws nothing from the worker's streams
            try:
                reply = REP.pack(MAGIC_REP, ST_OK, i, 0) + pickle.dumps(describe(dataset[i], i))
                if len(reply) > MAX_REPLY:
                    raise _invalid(f"dataset index {i}: the sample's structure (its dict keys "
                                   f"and types) takes {len(reply)} bytes, more than the "
                                   f"{MAX_REPLY} a worker message holds: use shorter dict keys")
            except BaseException as e:
                from . import InvalidError
                reply = _pack_error(ST_INVALID if isinstance(e, InvalidError) else ST_EXC, i,
                                    wid, e, "dataset")
            finally:
                _rng_restore(rng)
        elif kind == KIND_SCHEMA:
            schema = pickle.loads(msg[pos + 8 * n:])
            reply = REP.pack(MAGIC_REP, ST_OK, 0, 0) + pickle.dumps(place_error)
        elif getattr(schema, "collate", False):
            reply = _serve_collated(dataset, collate, schema.unbatched, maps, fields, indices,
                                    np, wid, epoch, side)
        else:
            reply = _serve_rows(dataset, schema, maps, fields, indices, np, wid, epoch, side,
                                at)
        if not _send(sock, _tagged(reply, tag)):
            break  # the loader is closing
    for m in maps.values():
        try:
            m.close()
        except BufferError:
            pass
    sock.close()


def _tagged(reply, tag):
    """reply naming its request: the request's tag in the reply's tag field (the replies are
    packed with 0 there; the main process checks it)."""
    out = bytearray(reply)
    REP_TAG.pack_into(out, REP.size - REP_TAG.size, tag)
    return out


def _send(sock, data):
    try:
        sock.send(data)
        return True
    except OSError:
        return False


def _serve_rows(dataset, schema, maps, fields, indices, np, wid, epoch=0, side=None, at=None):
    n = len(indices)
    views = []
    slot_fields = schema.slot_fields(np)
    for k, (key, off, row_bytes) in enumerate(fields):
        dt, shape = slot_fields[k]
        views.append(np.ndarray((n,) + shape, dtype=dt, buffer=maps[key], offset=off))
    varying = schema.varying
    rows = [] if schema.objs or varying else None
    for j, i in enumerate(indices):
        try:
            sample = dataset[i]
        except BaseException as e:  # KeyboardInterrupt, SystemExit too: reported, not lost
            return _pack_error(ST_EXC, i, wid, e, "dataset")
        try:
            leaves = schema.fast_leaves(sample, np) if schema.flat else None
            if leaves is None:
                leaves = checked_leaves(schema, sample, i, np)
            for k, a in enumerate(schema.slot_values(leaves) if schema.empty else leaves):
                views[k][j] = a
            if rows is not None:
                objs = schema.obj_values(leaves)
                rows.append(VRow(objs, None) if varying else objs)
        except ShapeDiffers as e:
            if not varying:
                return _pack_error(ST_INVALID, i, wid, e, "sample")
            try:  # the whole sample beside the slot; its row stays unwritten
                rows.append(VRow(None, off_leaves(sample, i, np)))
            except BaseException as e2:
                from . import InvalidError
                return _pack_error(ST_INVALID if isinstance(e2, InvalidError) else ST_EXC, i,
                                   wid, e2, "sample")
        except BaseException as e:
            from . import InvalidError
            st = ST_INVALID if isinstance(e, InvalidError) else ST_EXC
            return _pack_error(st, i, wid, e, "sample")
    if rows is not None:
        # Before the reply: once the loader has the rows, their non-array leaves are sent.
        try:
            data = dumps((epoch, list(indices), rows, at))
        except BaseException as e:
            bad = indices[0]
            for i, r in zip(indices, rows):  # name the row whose leaves cannot travel
                try:
                    dumps(r)
                except BaseException:
                    bad = i
                    break
            return _pack_error(ST_EXC, bad, wid, e, "sample")
        try:
            side.sendall(SIDE.pack(len(data)) + data)
        except OSError as e:
            return _pack_error(ST_EXC, indices[0], wid, e, "sample")
    return REP.pack(MAGIC_REP, ST_OK, 0, 0)


def checked_leaves(schema, sample, i, np):
    """The leaves of sample i (arrays), checked against the schema: the same structure, and
    each leaf the first sample's shape and dtype; an InvalidError naming what differs."""
    leaves, paths = [], []
    tree = _flatten(sample, np, i, leaves, paths)
    if _shape_tree(tree) != schema.ref:
        # Dicts with the first sample's keys in another order: taken in its order, as
        # default_collate takes the keys of a batch's first sample.
        ordered = _in_order(sample, schema.tree)
        if ordered is not sample:
            leaves, paths = [], []
            tree = _flatten(ordered, np, i, leaves, paths)
    if _shape_tree(tree) != schema.ref:
        raise _invalid(f"dataset index {i}: the sample's structure {_describe_tree(tree)} "
                       f"differs from the first sample's {_describe_tree(schema.tree)}")
    out = []
    for k, (a, kind) in enumerate(leaves):
        dt, shape, kind0 = schema.leaves[k]
        if kind0 == "obj":
            out.append(a if kind == "obj" else _as_given(a, kind))
            continue
        if kind == "obj":
            raise _invalid(f"dataset index {i}, field {paths[k]}: a {type(a).__name__}, but the "
                           f"first sample had an array of shape {shape} dtype {dt} (every "
                           "sample must match)")
        bits, bits0 = kind.startswith("bits:"), kind0.startswith("bits:")
        if a.shape != shape or a.dtype != dt or (bits or bits0) and kind != kind0:
            has = kind[5:] if bits else a.dtype
            had = kind0[5:] if bits0 else dt
            raise ShapeDiffers(f"PM_ERR_INVALID: pinmem.Loader: dataset index {i}, field "
                               f"{paths[k]}: shape {a.shape} dtype {has}, but the first sample "
                               f"had shape {shape} dtype {had}")
        out.append(a)
    return out


def _in_order(x, t):
    """x with each dict's keys in the order of tree t where it holds the same keys; x itself
    where nothing was reordered."""
    if t[0] == "dict" and isinstance(x, _Mapping):
        keys = [k for k, _ in t[1]]
        if len(keys) != len(x) or any(k not in x for k in keys):
            return x
        items = {k: _in_order(x[k], c) for k, c in t[1]}
        same = list(x) == keys and all(items[k] is x[k] for k in keys)
        return x if same else items
    if t[0] in ("list", "tuple", "namedtuple") and isinstance(x, (list, tuple)) and \
            len(x) == len(t[1]):
        items = [_in_order(c, ct) for c, ct in zip(x, t[1])]
        if all(a is b for a, b in zip(items, x)):
            return x
        if t[0] == "namedtuple":
            return type(x)(*items)
        return items if isinstance(x, list) else tuple(items)
    return x


def _as_given(a, kind):
    """A leaf _leaf converted, as the sample gave it, where the first sample held an object
    (its values are delivered one per row, as worker processes deliver them): numbers as
    Python numbers, tensors as tensors, arrays as arrays; copies, since a view of the
    dataset's memory in a batch would let a change to the batch reach the dataset."""
    if kind in ("int", "float", "bool"):
        return a.item()
    if kind == "tensor" or kind.startswith("bits:"):
        import torch
        t = torch.from_numpy(a.copy())
        return t.view(getattr(torch, kind[5:])) if kind.startswith("bits:") else t
    return a.copy()


def _describe_tree(t):
    if t[0] == "leaf":
        return "array"
    if t[0] == "dict":
        return "{" + ", ".join(f"{k!r}: {_describe_tree(c)}" for k, c in t[1]) + "}"
    inner = ", ".join(_describe_tree(c) for c in t[1])
    return f"[{inner}]" if t[0] == "list" else f"({inner})"


# ---- the main process's side -----------------------------------------------------------------


NO_ROW = (1 << 64) - 1  # the batch and row of a read outside a loader's claim


def _side_key(epoch, i, at, j):
    """Where the j-th of a claim's rows is filed: by its (batch, row) where the claim says, so
    that an index read twice in an epoch (a sampler drawing with replacement) gives each row
    its own read's leaves, whichever read ends first; else by (epoch, dataset index)."""
    if at is None or at[0] == NO_ROW:
        return (epoch, i)
    return ("at", epoch, at[0], at[1] + j)


class SideStore:
    """Non-array leaves of rows read, until their batch takes them: by (epoch, batch, row)
    where the read knows its row (_side_key), else by (epoch, dataset index), a queue per key
    (values in the order read)."""

    def __init__(self):
        import threading
        self.cond = threading.Condition()
        self.rows = {}
        self.error = None
        # Shapes vary (Schema.varying): only VRows are filed; frames of rows read before the
        # loader learnt it (its run was stopped and started again) are dropped.
        self.varying = False
        # A collate_fn's output for device batches: staged (written into pinned memory, its
        # copy queued) by the thread that receives it, ahead of delivery (_staging.py).
        self.stage = None

    def put(self, epoch, indices, rows, at=None):
        with self.cond:
            for j, (i, r) in enumerate(zip(indices, rows)):
                if self.varying and type(r) is not VRow:
                    continue
                self.rows.setdefault(_side_key(epoch, i, at, j), []).append(r)
            self.cond.notify_all()

    def _stale(self, k, epoch, at):
        """Rows of batches never delivered (a loop that stopped early, a batch that failed):
        of earlier epochs, or of this epoch's earlier batches."""
        e = k[1] if k[0] == "at" else k[0]
        if e is not None and epoch is not None and e < epoch:
            return True
        return at is not None and k[0] == "at" and e == epoch and k[2] < at[0]

    def take(self, epoch, indices, timeout, at=None):
        """The rows of a delivered batch, in row order (at: its (batch, 0) where its rows were
        filed by row); values of earlier batches are dropped."""
        import time
        with self.cond:
            for k in [k for k in self.rows if self._stale(k, epoch, at)]:
                del self.rows[k]
            keys = [_side_key(epoch, i, at, j) for j, i in enumerate(indices)]
            want = {}
            for key in keys:
                want[key] = want.get(key, 0) + 1
            deadline = time.monotonic() + (timeout or 60.0)
            while any(len(self.rows.get(key, ())) < c for key, c in want.items()):
                if self.error is not None:
                    raise self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerError("pinmem.Loader: the non-array leaves (strings, objects) of "
                                      f"rows {list(indices)[:8]} of epoch {epoch} did not arrive")
                self.cond.wait(left)
            out = []
            for key in keys:
                q = self.rows[key]
                out.append(q.pop(0))
                if not q:
                    del self.rows[key]
            return out

    def clear(self):
        with self.cond:
            self.rows.clear()

    def set_varying(self):
        with self.cond:
            self.varying = True
            self.rows.clear()


def _drain(socks, store):
    """Read the workers' frames of non-array leaves into store until every socket ends."""
    import select
    bufs = {s.fileno(): bytearray() for s in socks}
    live = {s.fileno(): s for s in socks}
    while live:
        try:
            r, _, _ = select.select(list(live.values()), [], [])
        except (OSError, ValueError):
            break
        for s in r:
            try:
                data = s.recv(1 << 20)
            except OSError:
                data = b""
            fd = s.fileno() if data else None
            if not data:
                live = {k: v for k, v in live.items() if v is not s}
                continue
            buf = bufs[fd]
            buf += data
            while len(buf) >= SIDE.size:
                (n,) = SIDE.unpack_from(buf, 0)
                if len(buf) < SIDE.size + n:
                    break
                try:
                    epoch, indices, rows, at = pickle.loads(bytes(buf[SIDE.size:SIDE.size + n]))
                    if store.stage is not None:
                        rows = [store.stage(r) for r in rows]
                    store.put(epoch, indices, rows, at)
                except Exception as e:  # an object that cannot be unpickled here
                    with store.cond:
                        store.error = WorkerError("pinmem.Loader: a worker's non-array leaves "
                                                  f"cannot be read in the main process ({e!r})")
                        store.cond.notify_all()
                del buf[:SIDE.size + n]

_PARENT_ENDS = set()  # fds of every live pool's sockets: closed in forked workers


def _context(ctx):
    import multiprocessing as mp
    if ctx is None:
        return mp.get_context()
    if isinstance(ctx, str):
        if ctx not in mp.get_all_start_methods():
            raise _invalid(f"multiprocessing_context {ctx!r} is not one of "
                           f"{mp.get_all_start_methods()}")
        return mp.get_context(ctx)
    if hasattr(ctx, "Process") and hasattr(ctx, "get_start_method"):
        return ctx
    raise _invalid(f"multiprocessing_context must be None, a start method name or a "
                   f"multiprocessing context, not {ctx!r}")


class _KeyErrorMessage(str):
    """KeyError prints repr() of its argument; this text's repr is itself."""

    def __repr__(self):
        return str(self)


class WorkerError(RuntimeError):
    """A worker process of a pinmem.Loader died, timed out or failed outside the dataset."""


class Pool:
    """The worker processes of one loader, their sockets, and what their errors mean."""

    def __init__(self, dataset, nworkers, ctx, base_seed, init_fn, cpus=None, collate=None):
        self.ctx = _context(ctx)
        self.method = self.ctx.get_start_method()
        self.nworkers = nworkers
        self.cpus = cpus            # NUMA placement of the workers (sorted CPU ids) or None
        self.numa_problems = {}     # worker -> why it kept its affinity (from its SCHEMA reply)
        self.socks, self.procs = [], []
        self.sides, self.store, self.drainer = [], SideStore(), None
        self.closed = self.stopped = False
        self.epoch = 0
        try:
            for w in range(nworkers):
                a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                sa, sb = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                _PARENT_ENDS.add(a.fileno())
                _PARENT_ENDS.add(sa.fileno())
                self.socks.append(a)
                self.sides.append(sa)
                close_fds = sorted(_PARENT_ENDS) if self.method == "fork" else []
                p = self.ctx.Process(target=worker_main, name=f"pinmem-worker-{w}",
                                     args=(b, dataset, w, nworkers, base_seed, init_fn,
                                           close_fds, cpus, sb, collate), daemon=True)
                try:
                    p.start()
                finally:
                    b.close()
                    sb.close()
                self.procs.append(p)
        except BaseException:
            self.close()
            raise

    def fds(self):
        return [s.fileno() for s in self.socks]

    def pids(self):
        return [p.pid for p in self.procs]

    def _exchange(self, w, msg, timeout):
        """Send one request to worker w, wait for its reply (None: the worker is gone)."""
        import select
        s = self.socks[w]
        try:
            s.send(msg)
            r, _, _ = select.select([s], [], [], timeout)
            if not r:
                raise WorkerError(f"pinmem.Loader: worker process {w} (pid "
                                  f"{self.procs[w].pid}) gave no answer within timeout={timeout} s")
            data = s.recv(MAX_MSG)
        except (ConnectionError, BrokenPipeError):
            return None
        if len(data) >= REP.size and REP.unpack_from(data, 0)[3] != 0:
            # The reply to a claim (tag > 0), not to this request (tag 0): a claim was answered
            # after the loader counted its replies. Its rows cannot be trusted, nor this order.
            raise WorkerError(f"pinmem.Loader: worker process {w} (pid {self.procs[w].pid}) "
                              "answered a request with the reply to an earlier claim: its "
                              "answers are out of order; close the loader and make a new one")
        return data or None

    def describe(self, index, timeout):
        """The Schema of dataset[index], computed by the first worker whose worker_init_fn
        did not fail (a worker that cannot start raises its error with its own claims, as
        DataLoader's; the others' batches still come)."""
        msg = REQ.pack(MAGIC_REQ, KIND_DESCRIBE, 0, 1, 0, 0, 0) + struct.pack("<Q", index)
        first = None
        for w in range(len(self.procs)):
            data = self._exchange(w, msg, timeout or None)
            if data is None:
                raise self.died(w, [index])
            magic, st, idx, _ = REP.unpack_from(data, 0)
            if st == ST_INIT:
                first = first or (st, w, data[REP.size:])
                continue
            break
        else:
            raise self.error(*first)
        if st != ST_OK:
            raise self.error(st, w, data[REP.size:])
        return pickle.loads(data[REP.size:])

    def set_schema(self, schema, timeout):
        if (schema.objs or getattr(schema, "collate", False) or schema.varying) and \
                self.drainer is None:
            import threading
            self.drainer = threading.Thread(target=_drain, args=(list(self.sides), self.store),
                                            name="pinmem-side-leaves", daemon=True)
            self.drainer.start()
        blob = pickle.dumps(schema)
        for w in range(self.nworkers):
            data = self._exchange(w, REQ.pack(MAGIC_REQ, KIND_SCHEMA, 0, 0, 0, 0, 0) + blob,
                                  timeout or None)
            if data is None:
                raise self.died(w, [])
            # An ST_INIT reply (worker_init_fn failed) is raised with the first claim, as before.
            if len(data) > REP.size and REP.unpack_from(data, 0)[1] == ST_OK:
                problem = pickle.loads(data[REP.size:])
                if problem:
                    self.numa_problems[w] = problem

    def died(self, w, indices):
        """The error for worker w having gone away."""
        p = self.procs[w]
        p.join(0.5)
        code = p.exitcode
        if code is None:
            how = "closed its socket but is still running"
        elif code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            how = f"was killed by {name}" + (" (out of memory?)" if -code == 9 else "")
        else:
            how = f"exited with code {code}"
        what = (f" while reading dataset indices {list(indices)[:8]}"
                f"{'...' if len(indices) > 8 else ''}" if indices else "")
        return WorkerError(f"pinmem.Loader: worker process {w} (pid {p.pid}) {how}{what}")

    def error(self, status, w, payload):
        """The exception to raise for a worker's error reply."""
        try:
            e = pickle.loads(payload)
        except Exception as x:
            return WorkerError(f"pinmem.Loader: worker process {w} sent an error that cannot be "
                               f"read ({x!r})")
        where = {"dataset": "in dataset[%d]" % e["index"],
                 "sample": "with the sample of dataset index %d" % e["index"],
                 "worker_init_fn": "in worker_init_fn",
                 "collate_fn": "in collate_fn"}.get(e["where"], e["where"])
        text = (f"Caught {e['name']} in pinmem worker process {e['worker']} (pid {e['pid']}) "
                f"{where}.\nOriginal traceback in the worker:\n{e['tb']}")
        if status == ST_INVALID:
            from . import InvalidError
            from ._staging import StackError
            cls = {"ShapeDiffers": ShapeDiffers, "StackError": StackError}.get(e.get("name"),
                                                                             InvalidError)
            return cls(e["text"] + f"\n(in worker process {e['worker']})")
        t = e.get("type")
        if e.get("name") == "StopIteration":
            return RuntimeError(f"dataset[{e['index']}] raised StopIteration in pinmem worker "
                                f"process {e['worker']}: a dataset's __getitem__ must not raise "
                                f"StopIteration; raise IndexError past the end.\n{text}")
        if isinstance(t, type) and issubclass(t, Exception):
            if t is KeyError:
                text = _KeyErrorMessage(text)  # KeyError shows repr(): keep the lines readable
            try:
                exc = t(text)
                str(exc)  # a type whose __str__ raises is not raised again: its text would be lost
                return exc
            except Exception:
                pass
        # An exception of the dataset (or its collate_fn) that cannot be raised again as itself:
        # still the batch's error, so the next batch follows, as torch's DataLoader goes on.
        err = WorkerError(text)
        err.from_dataset = e.get("where") in ("dataset", "sample", "collate_fn")
        return err

    def timeout_error(self, w, seconds, indices):
        p = self.procs[w]
        return WorkerError(f"pinmem.Loader: worker process {w} (pid {p.pid}) gave no rows within "
                           f"timeout={seconds:g} s (dataset indices {list(indices)}...): raise "
                           "timeout, or find what makes dataset[i] that slow")

    def plain_error(self, w, text):
        return WorkerError(f"pinmem.Loader: worker process {w}: {text}")

    def alive(self):
        return [p.is_alive() for p in self.procs]

    def stop(self, timeout=5.0):
        """End the workers: shut the sockets down (each process sees end-of-file once its
        current claim is done and exits), join them, terminate those that do not go. The
        sockets' fds stay open until close(), so no thread can reach a reused fd number."""
        if self.stopped:
            return
        self.stopped = True
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        import time
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(1.0)
            if p.is_alive():
                p.kill()
                p.join(1.0)

    def close(self):
        """Stop the workers (if not yet) and close the sockets."""
        self.stop()
        if self.closed:
            return
        self.closed = True
        if self.drainer is not None:  # the workers are gone: their side sockets ended
            self.drainer.join(5.0)
        for s in self.socks + self.sides:
            _PARENT_ENDS.discard(s.fileno())
            s.close()
        for p in self.procs:
            try:
                p.close()
            except ValueError:
                pass

    def __del__(self):
        try:
            self.stop(1.0)
            self.close()
        except Exception:
            pass
