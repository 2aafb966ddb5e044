"""DESIGN: batches built outside the loader's slots, delivered as the slots' batches are.

Two kinds of batch do not fit a slot of fixed-size rows: the output of a collate_fn of the
user's own (any structure, its shapes free to change from batch to batch), and a batch whose
samples' shapes differ from the first sample's (multi-scale training, buckets by length), which
the main process stacks itself (stack_rows, as default_collate). Both arrive in the main process
as a tree of tuples, lists and dicts with arrays (NumPy, torch CPU tensors) and other values at
the leaves. A Stager writes the array leaves of one batch into one block of pinned memory taken
from the default pool, sized in bytes for that batch (each leaf 256-aligned), and with device
batches copies the block to a device block of the same size on its own pinmem stream; each leaf
then becomes a pinmem.Buffer viewing its bytes (_pinmem._buffer_view), on the device or in the
pinned block, so the loop gets what a slot's batch gives (Buffers; torch tensors with
as_torch(), whose stream waits for the copy). Other leaves (str, numbers, None, objects, arrays of
dtypes DLPack lacks, tensors already on a device) stay as they are.

Memory: the pinned block goes back to the pool once its copy is done (the copy holds it until
then) and the pool hands it to the next batch that fits its size class, so blocks are reused
across batches, and a larger batch takes a larger block, within the pool's budget. Device
blocks are the Stager's: a block whose leaves are all gone (no view, no copy holds it) is
reused by the next batch it fits, after the stream its DLPack consumers named has passed the
point where they let go (an event recorded then; a block consumed on two streams is not reused);
a few idle ones are kept, the rest freed. Host batches (device='cpu') are the pinned block
itself, held by its leaves.

Threads: a loader with worker processes stages a collate_fn's output on the thread that receives
it from the worker (the side-leaves thread of _workers.py), as soon as it arrives: its copy is
queued ahead of delivery, within the prefetch depth, while earlier batches are consumed. That
thread makes the loader's device current first. Without workers, the main process collates and
stages at delivery, as DataLoader collates there.
"""

import threading

from . import _pinmem
from ._device import on_device

_ALIGN = 256  # each leaf's bytes start 256-aligned in the block, as a slot's fields do
_KEEP = 4     # idle device blocks a Stager keeps for the next batches


class Failed:
    """An exception met while staging a batch on the receiving thread, raised at its batch."""

    __slots__ = ("error",)

    def __init__(self, error):
        self.error = error


def unwrap(value):
    if isinstance(value, Failed):
        raise value.error
    return value


class Bits:
    """A stacked leaf of a dtype NumPy lacks (bfloat16, float8...): its bits and the name."""

    __slots__ = ("array", "name")

    def __init__(self, array, name):
        self.array, self.name = array, name


def _c_order(a):
    """a as a C-contiguous array, its shape kept (np.ascontiguousarray makes a 0-d array 1-d)."""
    import numpy as np
    return a if a.flags.c_contiguous else np.array(a, order="C")


def _host_leaf(x):
    """(C-contiguous NumPy array of the leaf's bytes, dtype name for the view) for an array
    leaf pinmem can deliver, else None (the leaf stays as it is)."""
    import numpy as np
    if type(x) is Bits:
        return _c_order(x.array), x.name
    if isinstance(x, np.ma.MaskedArray):
        # Its bytes alone would hand the masked elements out as valid: kept as it is, mask and
        # all, as torch's pin_memory keeps what it cannot pin.
        return None
    if type(x) is np.ndarray or isinstance(x, np.ndarray):
        a = x
        name = None
    else:
        t = type(x)
        if not (t.__module__.startswith("torch") and hasattr(x, "device") and
                hasattr(x, "detach")):
            return None
        if x.device.type != "cpu" or getattr(x, "is_sparse", False):
            return None
        from . import _workers
        bits = _workers.tensor_bits(x)
        if bits is not None:
            return _c_order(bits[0]), bits[1]
        try:
            a = x.detach().resolve_conj().resolve_neg().contiguous().numpy()
        except (TypeError, RuntimeError, AttributeError):
            return None
        name = None
    dt = a.dtype
    if dt.hasobject or dt.byteorder == ">" or dt.fields is not None or dt.kind in "OUSVMm":
        return None
    return _c_order(a), name or dt.str


def _walk(x, leaves):
    """The tree of x with each deliverable array leaf replaced by a ("leaf", k) marker and its
    host bytes appended to leaves; other values kept."""
    if isinstance(x, dict):
        return ("dict", type(x), [(k, _walk(v, leaves)) for k, v in x.items()])
    if isinstance(x, tuple) and hasattr(type(x), "_fields"):
        return ("namedtuple", type(x), [_walk(v, leaves) for v in x])
    if isinstance(x, (tuple, list)):
        return ("tuple" if isinstance(x, tuple) else "list", type(x),
                [_walk(v, leaves) for v in x])
    h = _host_leaf(x)
    if h is None:
        return ("value", x)
    leaves.append(h)
    return ("leaf", len(leaves) - 1)


def _build(t, values):
    kind = t[0]
    if kind == "value":
        return t[1]
    if kind == "leaf":
        return values[t[1]]
    if kind == "dict":
        items = [(k, _build(c, values)) for k, c in t[2]]
        try:
            return t[1](items)
        except Exception:
            return dict(items)
    items = [_build(c, values) for c in t[2]]
    if kind == "namedtuple":
        return t[1](*items)
    if t[1] in (tuple, list):
        return t[1](items)
    try:
        return t[1](items)
    except Exception:
        return tuple(items) if kind == "tuple" else items


def convert(x, fn):
    """x with every pinmem.Buffer in it replaced by fn(buffer) (as_torch: torch.from_dlpack)."""
    if isinstance(x, _pinmem.Buffer):
        return fn(x)
    if isinstance(x, dict):
        items = [(k, convert(v, fn)) for k, v in x.items()]
        try:
            return type(x)(items)
        except Exception:
            return dict(items)
    if isinstance(x, tuple) and hasattr(type(x), "_fields"):
        return type(x)(*[convert(v, fn) for v in x])
    if isinstance(x, (tuple, list)):
        items = [convert(v, fn) for v in x]
        if type(x) in (tuple, list):
            return type(x)(items)
        try:
            return type(x)(items)
        except Exception:
            return tuple(items) if isinstance(x, tuple) else items
    return x


class Stager:
    """Stages batches for one loader: to_device (copy to the device) and the device index the
    loader works on (None: the device current when the Stager was made)."""

    def __init__(self, to_device, device_index):
        self.to_device = to_device
        self.device = device_index
        if to_device and device_index is None:
            self.device = _pinmem.current_device()
        self.stream = None
        self.inflight = []     # Completions of copies not seen done yet (they hold their blocks)
        self.blocks = []       # device blocks of earlier batches, reused once their leaves go
        self.lock = threading.Lock()
        self.batches = 0       # batches staged (stats)
        self.bytes = 0         # their bytes
        self.largest = 0       # the largest block asked for
        self.device_blocks = 0  # device blocks allocated (the others were reused)

    def stage(self, out):
        """out with its array leaves as pinmem Buffers (on the device, or pinned host memory)."""
        leaves = []
        tree = _walk(out, leaves)
        if not leaves:
            return out
        offsets, total = [], 0
        for a, _ in leaves:
            total = -(-total // _ALIGN) * _ALIGN
            offsets.append(total)
            total += a.nbytes
        import numpy as np
        with self.lock:
            # This thread's copy goes to the loader's device; the caller's is given back.
            with on_device(self.device if self.to_device else None):
                base = self._fill(leaves, offsets, total, np)
            self.batches += 1
            self.bytes += total
            self.largest = max(self.largest, total)
        views = [_pinmem._buffer_view(base, off, a.shape, name)
                 for (a, name), off in zip(leaves, offsets)]
        return _build(tree, views)

    def _fill(self, leaves, offsets, total, np):
        """The leaves written into a pinned block and (device batches) copied to a device block
        on this Stager's stream: the block the views will look into."""
        block = self._pinned(max(total, 1))
        flat = np.frombuffer(block, np.uint8)
        for (a, _), off in zip(leaves, offsets):
            if a.nbytes:
                flat[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
        del flat
        if self.to_device:
            if self.stream is None:
                self.stream = _pinmem.Stream()
            base = self._device_block(max(total, 1))
            # The copy holds the pinned block until it is done and seen so (here, at the
            # next batch, or at close()); then the block goes back to the pool for the next
            # batch that fits it. The views' DLPack consumers wait for the copy.
            self.inflight = [c for c in self.inflight if not c.done()]
            self.inflight.append(_pinmem.copy(base, block, self.stream, nbytes=total))
            del block
        else:
            base = block
        return base

    def _device_block(self, nbytes):
        """A device block of at least nbytes: the smallest one of an earlier batch that fits and
        whose leaves are all gone (this stream then waits for the work their consumers queued:
        _buffer_reuse), else a new one. Device memory is allocated and freed by the driver,
        which for a free waits for the whole device: reused blocks keep that off the loop."""
        fit = sorted((b for b in self.blocks if b.exports == 0 and b.nbytes >= nbytes),
                     key=lambda b: b.nbytes)
        got = None
        for b in fit:
            if _pinmem._buffer_reuse(b, self.stream):
                got = b
                break
            self.blocks.remove(b)  # consumed on two streams: not reused
        if got is None:
            got = _pinmem.device_empty((nbytes,), "uint8")
            self.device_blocks += 1
            self.blocks.append(got)
        # At most _KEEP idle blocks stay (the oldest go first); busy ones are never dropped here
        # (they are in the loop's hands, or staged ahead).
        idle = [x for x in self.blocks if x.exports == 0 and x is not got]
        for x in idle[:max(0, len(idle) - _KEEP)]:
            self.blocks.remove(x)
        return got

    def _pinned(self, nbytes):
        """A pinned block of nbytes from the default pool. At the budget, the copies still
        in flight are waited for (their blocks come back) and the request tried once more."""
        try:
            try:
                return _pinmem.empty((nbytes,), "uint8")
            except _pinmem.BudgetError:
                if not self.inflight:
                    raise
                for c in self.inflight:
                    c.wait()
                self.inflight = []  # their blocks go back
                return _pinmem.empty((nbytes,), "uint8")
        except _pinmem.BudgetError as e:
            _pinmem._raise(_pinmem.PM_ERR_BUDGET, f"{e.message}. pinmem.Loader: this batch, "
                           "built outside the slots (a collate_fn's output, or samples whose "
                           f"shapes differ from the first one's), needs {nbytes} bytes of pinned "
                           "memory on its way; raise the budget (pinmem.set_budget, "
                           "PINMEM_BUDGET) or make the batch smaller")

    def stage_safely(self, out):
        """stage(out), or a Failed holding the error (the receiving thread must go on)."""
        try:
            return self.stage(out)
        except BaseException as e:  # noqa: B902 - raised at its batch instead
            return Failed(e)

    def close(self):
        """Wait for the copies in flight (their pinned blocks go back to the pool) and let the
        idle device blocks go (those of batches still held go with them)."""
        with self.lock:
            inflight, self.inflight = self.inflight, []
            self.blocks = []
        for c in inflight:
            c.wait()


# ---- batches whose samples' shapes differ from the first sample's -----------------------------


class StackError(_pinmem.InvalidError, RuntimeError):
    """The samples of one batch do not stack (a shape or dtype differs): a RuntimeError, as
    default_collate's torch.stack raises, and an InvalidError, as pinmem's other refusals."""


def _describe(a, kind):
    return f"shape {tuple(a.shape)} dtype {kind[5:] if kind.startswith('bits:') else a.dtype}"


def _differ(a, kind, shape, dtype, kind0):
    """Leaf a (of kind) does not stack with one of shape, dtype and kind0 (as checked_leaves
    compares them: bits of a dtype NumPy lacks by their name)."""
    bits = kind.startswith("bits:") or kind0.startswith("bits:")
    return a.shape != shape or a.dtype != dtype or bits and kind != kind0


def split_rows(rows):
    """A batch's VRows -> (the rows' non-array leaves, None) when every sample went into the
    slot, else (None, per row its leaves beside the slot or None)."""
    if all(r.off is None for r in rows):
        return [r.objs for r in rows], None
    return None, [r.off for r in rows]


def stack_rows(schema, indices, offs, unbatched, where):
    """The batch of samples whose shapes differ from the first sample's, built as
    default_collate builds it (each array leaf stacked along a new first axis, the others as
    lists), or a StackError naming the field and two dataset indices that disagree. offs: per
    row its leaves [(value, kind)], None for a row in the slot (its sample has the first
    sample's shapes, which the others do not)."""
    import numpy as np

    def refuse(k, r0, d0, r1, d1):
        raise StackError(f"PM_ERR_INVALID: pinmem.Loader: {where}: stack expects each tensor to "
                         f"be equal size: field {schema.paths[k]} has {d0} at dataset index "
                         f"{indices[r0]} and {d1} at dataset index {indices[r1]} (the samples "
                         "of a batch must agree, as default_collate stacks them: resize in the "
                         "dataset, group samples of one shape with a batch_sampler, or give a "
                         "collate_fn that pads)")

    if any(o is None for o in offs):
        r_in = next(r for r, o in enumerate(offs) if o is None)
        r_off = next(r for r, o in enumerate(offs) if o is not None)
        for k, (dt, shape, kind0) in enumerate(schema.leaves):
            a, kind = offs[r_off][k]
            if kind0 != "obj" and _differ(a, kind, shape, dt, kind0):
                had = f"shape {shape} dtype {kind0[5:] if kind0.startswith('bits:') else dt}"
                refuse(k, r_off, _describe(a, kind), r_in, had)
        refuse(0, r_off, "a shape or dtype of its own", r_in, "the first sample's")  # (unreached)
    values = []
    for k, (_, _, kind0) in enumerate(schema.leaves):
        col = [o[k] for o in offs]
        if kind0 == "obj":
            vals = [v for v, _ in col]
            values.append(vals[0] if unbatched else
                          tuple(vals) if k in schema.obj_tuple else vals)
            continue
        a0, kind = col[0]
        for r, (a, kd) in enumerate(col[1:], 1):
            if _differ(a, kd, a0.shape, a0.dtype, kind):
                refuse(k, 0, _describe(a0, kind), r, _describe(a, kd))
        out = np.asarray(a0) if unbatched else np.stack([a for a, _ in col])
        values.append(Bits(out, kind[5:]) if kind.startswith("bits:") else out)
    from . import _workers
    return _workers._rebuild(schema.tree, values)
