"""pinmem.torch: activation offloading for PyTorch training.

    import pinmem.torch
    off = pinmem.torch.offload_activations(min_bytes="1M", prefetch=4)
    with off:
        loss = model(x).sum()
    loss.backward()
    print(off.stats())

DESIGN. A context manager over torch.autograd.graph.saved_tensors_hooks. Forward (pack): a saved
tensor worth moving is copied, asynchronously and on a side stream, into a block of pinmem's
pinned pool; autograd keeps only a small handle. Backward (unpack): the handle's bytes come back
on another side stream; each unpack also starts the copies of the next `prefetch` units backward
will ask for (reverse order of packing), so they arrive before they are needed.

The unit of offload is a storage, not a tensor: a saved tensor keeps its whole storage alive on the
device, and views of one storage (q, k and v split from one projection; a tensor saved twice, or
saved as itself and as its transpose) are moved once and come back as views of one storage again.
A unit dies when the last handle to it goes (autograd frees saved tensors after backward, or the
graph when forward raised): its pinned block goes back to the pool once its copies are done (the
copy's Completion holds the block until then), so nothing leaks and nothing is reused early.

Links. The bookkeeping above is the same for every device; a link does the four moves:
  _CudaLink  tensors on a GPU: copies by pinmem.copy on two torch side streams (the D2H stream
             waits for the compute stream, never the reverse except for the event a consumer waits
             on); the source's memory is kept from reuse by record_stream on the D2H stream; a
             prefetched tensor is allocated on the H2D stream and recorded on the compute stream.
  _HostLink  CPU tensors standing in for device tensors (pinmem's host backend, CI): copies on two
             pinmem.Streams (threads); the compute "stream" is the CPU itself, so a consumer waits
             on the host. The source is kept alive by the copy's Completion.
The pack/unpack/prefetch/budget logic never asks which link it drives, so the host backend tests
exercise it all.

Threads. Backward on a GPU runs the unpack hook on autograd's device thread while the main
thread may pack for another graph; one lock guards the bookkeeping (copies are submitted under it:
they only queue work). A pack asks the pool for its block outside the lock: under
budget_policy=wait that ask may wait for frees, which another thread's unpacks bring.
"""

import collections
import threading
import time
import weakref

import torch

from . import BudgetError, MemlockError, NoDeviceError, NomemError, Stream as _PmStream, \
    backend as _pm_backend, copy as _pm_copy, empty as _pm_empty, parse_size as _parse_size, \
    stats as _pm_stats

__all__ = ["offload_activations", "OffloadActivations", "is_weight_cast"]

_NO_PINNED = (BudgetError, NomemError, MemlockError)


# ------------------------------------------------------------------------------------------
# Links: the device-specific moves
# ------------------------------------------------------------------------------------------

class _DeviceSpan:
    """Device bytes as pinmem.copy takes them, without a reference to the tensor (whose memory
    record_stream guards instead, so autograd can free it the moment it is done with it)."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (nbytes,),
                                         "typestr": "|u1", "version": 3}


class _HostLink:
    """CPU tensors standing in for device tensors, moved on pinmem streams."""

    def __init__(self, device):
        self.device = device
        self.d2h = _PmStream()
        self.h2d = _PmStream()
        self.stall = []  # host seconds each late consume waited

    def start_d2h(self, block, t, storage):
        # The Completion holds the storage (through DLPack) until the copy is done.
        return _pm_copy(block, _storage_bytes(t), self.d2h)

    def start_h2d(self, block, nbytes, d2h):
        d2h.wait_stream(self.h2d)  # the bytes must have arrived on the host first
        dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return dst, _pm_copy(dst, block, self.h2d, nbytes=nbytes)

    def consume(self, dst, done):
        """The compute side waits for the fetch of dst; -> True if it had to (late)."""
        if done.done():
            return False
        t0 = time.perf_counter()
        done.wait()
        self.stall.append(time.perf_counter() - t0)
        return True

    def stall_seconds(self):
        """Seconds waited since the last call."""
        seconds, self.stall = float(sum(self.stall)), []
        return seconds


class _CudaLink:
    """Tensors on one GPU, moved by pinmem.copy on two torch side streams."""

    def __init__(self, device):
        self.device = device
        self.d2h = torch.cuda.Stream(device=device)
        self.h2d = torch.cuda.Stream(device=device)
        self.stall = []  # (event, event) around each late wait of the compute stream

    def start_d2h(self, block, t, storage):
        compute = torch.cuda.current_stream(self.device)
        self.d2h.wait_stream(compute)  # the copy reads what the compute stream wrote
        with torch.cuda.device(self.device):
            done = _pm_copy(block, _DeviceSpan(storage.data_ptr(), storage.nbytes()), self.d2h)
        # The allocator reuses the storage's memory only after the copy (queued on d2h) ran.
        t.record_stream(self.d2h)
        return done

    def start_h2d(self, block, nbytes, d2h):
        with torch.cuda.device(self.device), torch.cuda.stream(self.h2d):
            d2h.wait_stream(self.h2d)
            dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            done = _pm_copy(_DeviceSpan(dst.data_ptr(), nbytes), block, self.h2d, nbytes=nbytes)
        return dst, done

    def consume(self, dst, done):
        compute = torch.cuda.current_stream(self.device)
        late = not done.done()
        if late:  # time the compute stream's wait with events (read in stats())
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record(compute)
            done.wait_stream(compute)
            e1.record(compute)
            self.stall.append((e0, e1))
        else:
            done.wait_stream(compute)
        # dst was allocated on the h2d stream; the compute stream uses it from now on.
        dst.record_stream(compute)
        return late

    def stall_seconds(self):
        """Seconds the compute stream waited, of the waits it has passed since the last call."""
        seconds, pending = 0.0, []
        for e0, e1 in self.stall:
            if e1.query():
                seconds += e0.elapsed_time(e1) / 1000.0
            else:
                pending.append((e0, e1))
        self.stall = pending
        return seconds


# ------------------------------------------------------------------------------------------
# Units and handles
# ------------------------------------------------------------------------------------------

class _Unit:
    """One storage's bytes in a pinned block, and its copy back while one is under way."""

    __slots__ = ("link", "block", "nbytes", "d2h", "index", "fetch", "held", "left",
                 "handles", "alive", "spent", "__weakref__")

    def __init__(self, link, block, nbytes, d2h):
        self.link = link
        self.block = block
        self.nbytes = nbytes
        self.d2h = d2h          # Completion of the copy to the host
        self.index = -1         # position in the owner's pack order
        self.fetch = None       # (device uint8 tensor, Completion): a copy back under way
        # Back on the device: held until each handle was unpacked once (q, k and v of one
        # storage are unpacked by different nodes), then only watched through `alive`, a weakref
        # to a view handed to autograd (retain_graph's next backward reuses it if still there).
        self.held = None
        self.left = 0
        self.handles = 0
        self.alive = None
        self.spent = False      # every handle was unpacked: prefetch passes it by


def _check_version(counter, saved):
    """Raise autograd's own error when a saved tensor (whose version counter `counter` shares)
    was modified in place after it was saved. Autograd skips its version check for tensors that
    went through saved-tensor hooks, so without this an in-place op after the save
    (y = x.exp(); y.add_(1)) gave gradients of the new values, or of whichever values a copy
    still queued read, where plain autograd raises."""
    now = counter._version
    if now == saved.version:
        return
    if type(saved) is _Kept:  # a nested tensor has no single size
        what = f"{saved.t.dtype} {'nested' if saved.t.is_nested else list(saved.t.shape)}"
    else:
        what = f"{saved.dtype} {list(saved.size)}"
    raise RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{what}] is at version {now}; expected version {saved.version} instead (a "
        f"tensor saved under pinmem.torch.offload_activations; autograd raises the same without "
        f"it)")


def _version_probe(t, version):
    """A tensor that shares t's version counter but not its memory: an in-place op on t, or on
    any view of its base, moves the probe's version, even after t itself is gone (a module's
    `out = relu(h); out += x` leaves nothing of `out` for the user to hold). set_ bumps the
    counter it shares, so the version is put back: the pack hook must not change it. The conj
    and neg flags go first (set_ on a flagged tensor resizes through a copy, with a warning)."""
    probe = t.detach()
    torch._C._set_conj(probe, False)
    torch._C._set_neg(probe, False)
    probe.set_(torch.empty(0, dtype=torch.uint8, device=t.device).untyped_storage())
    try:
        torch._C._autograd._unsafe_set_version_counter((probe,), (version,))
    except TypeError:  # older torch takes one tensor and one version
        torch._C._autograd._unsafe_set_version_counter(probe, version)
    return probe


class _Kept:
    """What autograd holds for a tensor left in place: the tensor (detached, sharing its version
    counter) and its version when saved, checked on unpack."""

    __slots__ = ("t", "version")

    def __init__(self, t):
        # Detached: a saved output handed back as itself would hold its own grad_fn, a cycle
        # that outlives a graph dropped without backward (autograd rewires it on unpack).
        self.t = t.detach()
        self.version = t._version


class _Saved:
    """What autograd holds for an offloaded tensor: its unit, how to view it, and its version
    counter (through a tensor without memory) with the version it had when saved."""

    __slots__ = ("unit", "dtype", "size", "stride", "offset", "conj", "neg", "version",
                 "probe")

    def __init__(self, unit, t):
        self.unit = unit
        unit.handles += 1
        self.version = t._version
        self.probe = _version_probe(t, self.version)
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        # A lazy x.conj() or its .imag shares x's bytes and only flags them: the flags are part
        # of what the tensor means, and come back with the view.
        self.conj = t.is_conj()
        self.neg = t.is_neg()


def _flat_bytes(t):
    """The memory of t (contiguous) as flat uint8, exactly its bytes. Not t.view(-1): torch
    counts a tensor of one element contiguous whatever its strides (x[::2] of two elements has
    stride 2), its flat view keeps that stride, and view(uint8) refuses it."""
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def _storage_bytes(t):
    """A uint8 tensor over the whole storage of t (what keeping t holds on the device)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _view(storage_tensor, s):
    v = torch.empty(0, dtype=s.dtype, device=storage_tensor.device).set_(
        storage_tensor.untyped_storage(), s.offset, s.size, s.stride)
    if s.conj:
        v = v.conj()
    if s.neg:
        v = torch._neg_view(v)
    return v


_STAT_KEYS = ("offloaded_bytes", "offloaded_tensors", "offloaded_units", "shared_tensors",
              "prefetched_bytes", "prefetched_units", "fetched_bytes", "fetched_units",
              "late_units", "kept_bytes", "kept_tensors")
_KEEP_REASONS = ("small", "parameter", "predicate", "paused", "budget", "device", "layout",
                 "sparse_view")


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Offload tensors saved for backward to pinned host memory (see offload_activations)."""

    def __init__(self, min_bytes="1M", prefetch=4, keep=None, device=None, max_view_ratio=4,
                 prefetch_on_exit=True):
        if isinstance(min_bytes, str):
            min_bytes = _parse_size(min_bytes)
        if not isinstance(min_bytes, int) or isinstance(min_bytes, bool) or min_bytes < 1:
            raise ValueError(f"offload_activations: min_bytes must be a positive size, "
                             f"not {min_bytes!r}")
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise ValueError(f"offload_activations: prefetch must be an int >= 0, "
                             f"not {prefetch!r}")
        if keep is not None and not callable(keep):
            raise TypeError(f"offload_activations: keep must be callable(tensor) -> bool or "
                            f"None, not {type(keep).__name__}")
        # `not >= 1` refuses NaN too, which compares false with everything: it kept no view.
        if not isinstance(max_view_ratio, (int, float)) or isinstance(max_view_ratio, bool) or \
                not max_view_ratio >= 1:
            raise ValueError(f"offload_activations: max_view_ratio must be a number >= 1 "
                             f"(inf: keep no view), not {max_view_ratio!r}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = str(device)
        if device not in ("cuda", "cpu"):
            raise ValueError(f"offload_activations: device must be 'cuda' or 'cpu' (CPU tensors "
                             f"standing in for device tensors), not {device!r}")
        if device == "cuda" and _pm_backend() != "cuda":
            raise NoDeviceError(f"PM_ERR_NO_DEVICE: offload_activations(device='cuda'): pinmem "
                                f"runs its {_pm_backend()} backend, so it cannot copy GPU "
                                f"memory (PINMEM_BACKEND, `pinmem info` says why)")
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.keep = keep
        self.device_type = device
        self.max_view_ratio = max_view_ratio
        self.prefetch_on_exit = bool(prefetch_on_exit)
        self._lock = threading.RLock()
        self._links = {}
        self._order = []         # weakrefs to units in pack order
        # (device, data_ptr) -> (weakref unit, storage weakref, version, weakref root, forward)
        self._by_storage = {}
        # Forward passes so far: an exit with prefetch_on_exit (or one that raised) ends one.
        # Saves join a unit of their own pass only: between passes a static input refilled
        # outside autograd (pinmem.copy, x.data, another library through DLPack) keeps its
        # version, and a graph kept from the step before would lend its old bytes.
        self._forward = 0
        # Copies back the compute stream was told to wait for, still running as far as the host
        # knows: each holds its pinned block until done; polled and dropped as they finish.
        self._retired = collections.deque()
        self._full = None  # (bytes, _pool_marks()): the smallest block refused since a free
        self._stall_seconds = 0.0
        self.reset_stats()
        # No super().__init__: it would store the bound methods self._pack and self._unpack on
        # self, a cycle only Python's collector breaks. An object made for each step
        # (`with offload_activations(): ...`) then kept its pinmem streams (threads on the host
        # backend), and on a GPU the pinned blocks of its last copies back, until a collection,
        # never under gc.disable(). The properties below hand out fresh bound methods instead;
        # graphs still hold the object through the unpack hooks they keep, as they must.

    @property
    def pack_hook(self):
        return self._pack

    @property
    def unpack_hook(self):
        return self._unpack

    # -- statistics ------------------------------------------------------------------------

    def reset_stats(self):
        with self._lock:
            self._stats = dict.fromkeys(_STAT_KEYS, 0)
            self._kept = dict.fromkeys(_KEEP_REASONS, 0)
            self._kept_bytes = dict.fromkeys(_KEEP_REASONS, 0)
            self._stall_seconds = 0.0
            self._hook_seconds = 0.0
            for link in self._links.values():
                link.stall_seconds()

    def stats(self):
        """Counters since creation or reset_stats():
        offloaded_bytes/units: bytes and storages copied to pinned memory (offloaded_tensors: the
        saved tensors they hold; shared_tensors: saves that found their storage already moved);
        prefetched_bytes/units: copies back started ahead of use; fetched_bytes/units: all copies
        back; late_units: copies back not finished when backward needed them (the compute stream,
        or on CPU the host, waited); stall_seconds: how long it waited (GPU: timed by events);
        kept_tensors/bytes: saved tensors left where they were, by reason in kept_by_reason and
        kept_bytes_by_reason (small, parameter, predicate, paused: inside paused(), budget: no
        pinned memory left within
        the pool's budget, device: not on the offloaded device type, layout: sparse, quantized
        or a tensor subclass, sparse_view: a view holding a small part of a large storage);
        live_units and pinned_bytes: what is on the host now; hook_seconds: host time spent in
        the pack and unpack hooks (the work pinmem adds to the Python side of a step)."""
        with self._lock:
            out = dict(self._stats)
            for link in self._links.values():
                self._stall_seconds += link.stall_seconds()
            out["stall_seconds"] = self._stall_seconds
            out["hook_seconds"] = self._hook_seconds
            out["kept_by_reason"] = dict(self._kept)
            out["kept_bytes_by_reason"] = dict(self._kept_bytes)
            units = [u for u in (r() for r in self._order) if u is not None]
            out["live_units"] = len(units)
            out["pinned_bytes"] = sum(u.nbytes for u in units)
            return out

    def paused(self):
        """A context manager inside which saved tensors stay on the device (counted as
        'paused'), e.g. around a module whose tensors are not worth moving:
        `with off: ...; with off.paused(): head(x)`. It replaces these hooks while entered."""
        def keep(t):
            with self._lock:
                return self._kept_as("paused", t)
        return torch.autograd.graph.saved_tensors_hooks(keep, self._unpack)

    def wait(self):
        """Block until every copy started so far (to the host, and back) is done."""
        with self._lock:
            units = [u for u in (r() for r in self._order) if u is not None]
            retired, self._retired = list(self._retired), collections.deque()
        for u in units:
            u.d2h.wait()
            fetch = u.fetch  # read once: another thread's backward may clear it meanwhile
            if fetch is not None:
                fetch[1].wait()
        for done in retired:
            done.wait()

    # -- the context -----------------------------------------------------------------------

    def __exit__(self, *exc):
        super().__exit__(*exc)
        with self._lock:
            if exc[0] is None and self.prefetch_on_exit:
                # Backward asks first for what was saved last: start those copies back now.
                self._prefetch_before(len(self._order))
            if exc[0] is not None or self.prefetch_on_exit:
                self._forward += 1

    # -- pack ------------------------------------------------------------------------------

    def _why_keep(self, t):
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return "layout"
        if t.layout is not torch.strided or t.is_quantized or t.is_nested:
            return "layout"
        if t.device.type != self.device_type:
            return "device"
        if t.numel() * t.element_size() < self.min_bytes:
            return "small"
        # Weights stay resident anyway: moving them frees nothing. A leaf that requires grad
        # (or a view of one: weight.t()) is one; a view made under no_grad also looks like a
        # leaf, so a view is judged by its base.
        base = t._base
        root = t if base is None else base
        if isinstance(root, torch.nn.Parameter) or (root.is_leaf and root.requires_grad):
            return "parameter"
        if self.keep is not None and self.keep(t):
            return "predicate"
        return None

    def _kept_as(self, reason, t):
        n = t.numel() * t.element_size()
        s = self._stats
        s["kept_tensors"] += 1
        s["kept_bytes"] += n
        self._kept[reason] += 1
        self._kept_bytes[reason] += n
        return _Kept(t)

    def _link(self, device):
        link = self._links.get(device)
        if link is None:
            link = (_CudaLink if device.type == "cuda" else _HostLink)(device)
            self._links[device] = link
        return link

    def _pack(self, t):
        t0 = time.perf_counter()
        try:
            return self._pack_one(t)
        finally:
            self._hook_seconds += time.perf_counter() - t0

    def _pack_one(self, t):
        reason = self._why_keep(t)
        if reason is not None:
            with self._lock:
                return self._kept_as(reason, t)
        with torch.no_grad():
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            key = (t.device, storage.data_ptr())
            version = t._version
            root = t if t._base is None else t._base
            with self._lock:
                # The last copies back of the step before (no unpack came after them) let their
                # pinned blocks go here, in the next forward, rather than at a wait().
                self._poll_retired()
                saved = self._share(key, t, nbytes, version, root)
                if saved is not None:
                    return saved
                if nbytes > self.max_view_ratio * t.numel() * t.element_size():
                    return self._kept_as("sparse_view", t)
                # After a refusal, no block as large is asked of the pool until some block went
                # back to it (its frees counter moved) or its budget changed: in a forward pass
                # nothing else frees pinned memory, and under budget_policy=wait each ask would
                # wait budget_timeout again, once per tensor.
                if self._full is not None and nbytes >= self._full[0] and \
                        self._full[1] == _pool_marks():
                    return self._kept_as("budget", t)
            # Not under the lock: with budget_policy=wait the pool may wait here for frees, and
            # the frees that end the wait can be another thread's backward on this object, whose
            # unpacks take the lock (held, it waited budget_timeout and then kept the tensor).
            try:
                block = _pm_empty((nbytes,), "uint8")
            except _NO_PINNED:
                marks = _pool_marks()
                with self._lock:
                    if self._full is None or self._full[1] != marks or nbytes < self._full[0]:
                        self._full = (nbytes, marks)
                    return self._kept_as("budget", t)
            with self._lock:
                # Another thread may have saved this storage meanwhile: share its unit, and the
                # new block, never copied into, goes back to the pool.
                saved = self._share(key, t, nbytes, version, root)
                if saved is not None:
                    del block
                    return saved
                link = self._link(t.device)
                done = link.start_d2h(block, t, storage)
                unit = _Unit(link, block, nbytes, done)
                unit.index = len(self._order)
                self._order.append(weakref.ref(unit))
                self._by_storage[key] = (weakref.ref(unit), _storage_weakref(storage), version,
                                         weakref.ref(root), self._forward)
                s = self._stats
                s["offloaded_units"] += 1
                s["offloaded_tensors"] += 1
                s["offloaded_bytes"] += nbytes
                if len(self._order) >= 256 and len(self._order) % 256 == 0:
                    self._compact()
                return _Saved(unit, t)

    def _share(self, key, t, nbytes, version, root):
        """A handle on the unit already moving t's storage, or None. Called under the lock."""
        seen = self._by_storage.get(key)
        if seen is None:
            return None
        ref, sref, ver, rref, forward = seen
        unit = ref()
        # The same storage still alive and unchanged in this forward pass: its bytes are on
        # their way. Views of one base share its version counter, so an unchanged version proves
        # the bytes unchanged; tensors that only share memory (x.data, unsafe_chunk's parts, as
        # torch's CPU GRU and LSTM cells make) have counters of their own, whose equal numbers
        # prove nothing: those are moved apart.
        if unit is None or sref.expired() or ver != version or unit.nbytes != nbytes or \
                rref() is not root or forward != self._forward:
            return None
        self._stats["shared_tensors"] += 1
        self._stats["offloaded_tensors"] += 1
        return _Saved(unit, t)

    def _compact(self):
        """Drop dead units from the pack order (they were consumed or their graph freed) and
        storages gone from the map, or saved in an earlier forward pass (it lives across the
        entries of one pass: a residual saved by one layer and again by the next moves once)."""
        live = [u for u in (r() for r in self._order) if u is not None]
        for i, u in enumerate(live):
            u.index = i
        self._order = [weakref.ref(u) for u in live]
        for key in [k for k, (r, sref, _, _, forward) in self._by_storage.items()
                    if r() is None or sref.expired() or forward != self._forward]:
            del self._by_storage[key]

    # -- unpack ----------------------------------------------------------------------------

    def _poll_retired(self):
        while self._retired and self._retired[0].done():
            self._retired.popleft()

    def _start_fetch(self, unit, ahead):
        dst, done = unit.link.start_h2d(unit.block, unit.nbytes, unit.d2h)
        unit.fetch = (dst, done)
        s = self._stats
        s["fetched_units"] += 1
        s["fetched_bytes"] += unit.nbytes
        if ahead:
            s["prefetched_units"] += 1
            s["prefetched_bytes"] += unit.nbytes

    def _prefetch_before(self, index):
        """Start the copies back of up to `prefetch` units packed before `index` (the next
        that backward will need), counting those already under way. A unit an earlier backward
        used up (spent) counts too, without a copy: a second backward over a retained graph
        finds every unit spent, and looking past them went back to the first unit packed on
        every unpack, O(N^2) in the units. Its units come back when asked for; prefetching
        them instead would copy back, for a double backward (create_graph), units it may never
        ask for."""
        want = self.prefetch
        j = min(index, len(self._order)) - 1
        while want > 0 and j >= 0:
            u = self._order[j]()
            j -= 1
            if u is None:
                continue
            if u.fetch is None and not u.spent:
                if u.held is not None or (u.alive is not None and u.alive() is not None):
                    continue  # its bytes are still on the device
                self._start_fetch(u, ahead=True)
            want -= 1

    def _unpack(self, saved):
        if type(saved) is _Kept:
            _check_version(saved.t, saved)
            return saved.t
        _check_version(saved.probe, saved)
        t0 = time.perf_counter()
        try:
            return self._unpack_one(saved)
        finally:
            self._hook_seconds += time.perf_counter() - t0

    def _unpack_one(self, saved):
        unit = saved.unit
        with self._lock:
            if unit.held is not None:  # views of one storage come back as views of one again
                out = _view(unit.held, saved)
                unit.left -= 1
                if unit.left <= 0:
                    unit.held = None
                    unit.spent = True
                    unit.alive = weakref.ref(out)
                return out
            alive = unit.alive() if unit.alive is not None else None
            if alive is not None and unit.fetch is None:
                return _view(alive, saved)
            if unit.fetch is None:
                self._start_fetch(unit, ahead=False)
            dst, done = unit.fetch
            unit.fetch = None
            if unit.link.consume(dst, done):
                self._stats["late_units"] += 1
            self._poll_retired()
            if not done.done():
                self._retired.append(done)
            out = _view(dst, saved)
            unit.left = unit.handles - 1
            if unit.left > 0:
                unit.held = dst
            else:
                unit.spent = True
            unit.alive = weakref.ref(out)
            self._prefetch_before(unit.index)
            return out


def is_weight_cast(t):
    """True for a low-precision copy of a weight (what autocast saves for backward: a cast of a
    leaf that requires grad, or a view of one): a `keep` predicate for keeping those on the
    device, `offload_activations(keep=pinmem.torch.is_weight_cast)`."""
    root = t if t._base is None else t._base
    fn = root.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0":
        return False
    return any(n is not None and hasattr(n, "variable") for n, _ in fn.next_functions)


def _pool_marks():
    """What changes when the default pool may have room again: blocks freed, its budget."""
    st = _pm_stats()
    return st["frees"], st["budget"]


def _storage_weakref(storage):
    from torch.multiprocessing.reductions import StorageWeakRef
    return StorageWeakRef(storage)


def offload_activations(min_bytes="1M", prefetch=4, keep=None, device=None, max_view_ratio=4,
                        prefetch_on_exit=True):
    """A context manager that offloads the tensors autograd saves for backward inside it to
    pinmem's pinned pool, and brings them back ahead of backward's need.

    min_bytes: tensors smaller than this stay where they are (a size or text such as '1M').
    prefetch: how many offloaded storages to copy back ahead of the one backward asks for
        (0: each comes back only when asked for, and the compute stream waits for it).
    keep: callable(tensor) -> True to keep that saved tensor on the device (e.g. by shape).
        Parameters (nn.Parameter, leaves that require grad, and views of them) always stay.
    device: 'cuda' (default when torch sees a GPU) or 'cpu' (CPU tensors stand in for device
        tensors: pinmem's host backend, tests); tensors elsewhere stay where they are.
    max_view_ratio: a view whose storage is more than this many times its own bytes stays (moving
        the whole storage would cost more than it frees).
    prefetch_on_exit: leaving the context starts the copies back of the last `prefetch` storages
        (backward needs them first). Turn it off when the context wraps only some layers and is
        entered again later in the same forward pass.

    When the pool's budget (pinmem.set_budget) has no room, tensors stay on the device and are
    counted (stats()['kept_by_reason']['budget']); the call never fails for lack of pinned
    memory. The object may be entered many times (e.g. around chosen layers, or every step);
    its stats() add up over them.
    """
    return OffloadActivations(min_bytes=min_bytes, prefetch=prefetch, keep=keep, device=device,
                              max_view_ratio=max_view_ratio, prefetch_on_exit=prefetch_on_exit)
