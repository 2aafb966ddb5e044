"""KV-cache offload for LLM serving: a pinned block store that takes torch tensors.

    import torch, pinmem
    # vLLM's paged layout: per layer [num_blocks, block_size, heads, head_dim], K and V apart
    caches = [torch.empty(1024, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
              for _ in range(2 * 32)]
    store = pinmem.KVBlockStore(caches, num_blocks=65536)
    host = store.alloc(len(ids))
    store.swap_out(ids, host).wait()      # device blocks `ids` -> host blocks `host`
    store.swap_in(other_ids, host)        # and back, ordered on torch's current stream

The arena is pinned in chunks in the background (low ids first, on the GPU's NUMA node, within
the default pool's budget); a swap moves every named block of every tensor in one call: small
pieces by pinmem's gather/scatter kernel, large ones by batched DMA (option blocks_kernel_max).
On the host backend the device is the CPU and the KV tensors must be pinmem device memory:
make them with kv_device_tensor().
"""

import ctypes as _ctypes

import pinmem as _pm
from . import _pinmem
from ._args import int_arg as _int_arg


def _torch():
    try:
        import torch
    except ImportError:
        raise ImportError("pinmem.KVBlockStore: torch is needed (pip install torch)") from None
    return torch


def _invalid(text):
    _pinmem._raise(_pm.PM_ERR_INVALID, text)


_ID_MAX = (1 << 63) - 1


def _count(v, what, lo=0):
    """An integer argument (a count, an id, a size) as an int in lo..2**63-1, by the rule and
    wording of every integer argument (_args.int_arg): floats, strings and bools are refused,
    not truncated (alloc(1.5) is a mistake, not 1; alloc(True) is one too)."""
    return _int_arg(what, v, lo, _ID_MAX)


def kv_device_tensor(shape, dtype):
    """A torch tensor in device memory for KV caches: torch.empty on the current CUDA device
    under the cuda backend; under the host backend a CPU tensor over pinmem device memory (the
    host backend's stand-in for the GPU), which the block store accepts as device memory."""
    torch = _torch()
    if _pm.backend() == "cuda":
        return torch.empty(shape, dtype=dtype, device=f"cuda:{_pm.current_device()}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        if int(d) < 0:
            _invalid(f"kv_device_tensor: negative dimension {int(d)} in shape {tuple(shape)}")
        n *= int(d)
    raw = torch.from_dlpack(_pm.device_empty(n * itemsize, "uint8"))
    return raw.view(dtype).view(tuple(shape))


def _memory_device(t):
    """The device whose memory a tensor is: torch's index for a CUDA tensor; for a CPU tensor the
    backend's answer (under the host backend a kv_device_tensor is simulated device memory that
    torch sees on the CPU), -1 when it is no device's memory."""
    if t.device.type == "cuda":
        return _pm.current_device() if t.device.index is None else t.device.index
    return _pinmem._memory_device(t.data_ptr())


def _where(index):
    return f"memory of device {index}" if index >= 0 else "not device memory"


class _Spec:
    """What the tensors of a store are: their number, dtype, shape, device and regions; `index`
    is the device whose memory they are (-1: none's)."""

    def __init__(self, tensors, kv_stacked, what):
        torch = _torch()
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        try:
            tensors = list(tensors)
        except TypeError:
            _invalid(f"{what}: a torch.Tensor or a list of them is needed, not "
                     f"{type(tensors).__name__}")
        if not tensors:
            _invalid(f"{what}: no KV tensors given")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                _invalid(f"{what}[{i}]: a torch.Tensor is needed, not {type(t).__name__}")
        first = tensors[0]
        self.dtype, self.device = first.dtype, first.device
        bdim = 1 if kv_stacked else 0
        self.tensors, self.regions = tensors, []
        for i, t in enumerate(tensors):
            name = f"{what}[{i}]"
            if t.dtype != self.dtype:
                _invalid(f"{name}: dtype {t.dtype}, but {what}[0] is {self.dtype}: every KV "
                         "tensor of a store has one dtype")
            if t.device != self.device:
                _invalid(f"{name}: on {t.device}, but {what}[0] is on {self.device}: every KV "
                         "tensor of a store is on one device")
            # torch names one device for every CPU tensor: the host backend's simulated devices
            # are told apart by the memory itself.
            index = _memory_device(t)
            if i == 0:
                self.index = index
            elif index != self.index:
                _invalid(f"{name}: {_where(index)}, but {what}[0] is {_where(self.index)}: every "
                         "KV tensor of a store is on one device")
            if t.dim() < bdim + 2:
                _invalid(f"{name}: shape {tuple(t.shape)}: want "
                         + ("[2, num_blocks, block_size, ...]" if kv_stacked
                            else "[num_blocks, block_size, ...]"))
            if kv_stacked and t.shape[0] != 2:
                _invalid(f"{name}: shape {tuple(t.shape)}: kv_stacked wants K and V in front "
                         "([2, num_blocks, ...])")
            block = t[0] if kv_stacked else t
            if block.shape[0] == 0:
                _invalid(f"{name}: shape {tuple(t.shape)} holds no device block")
            if not block[0].is_contiguous():
                _invalid(f"{name}: one block (shape {tuple(block.shape[1:])}) is not contiguous "
                         f"in memory (strides {t.stride()})")
            if i == 0:
                self.device_blocks = int(block.shape[0])
                self.block_shape = tuple(block.shape[1:])
            elif int(block.shape[0]) != self.device_blocks or tuple(block.shape[1:]) != \
                    self.block_shape:
                _invalid(f"{name}: shape {tuple(t.shape)} does not match {what}[0]'s blocks "
                         f"({self.device_blocks} blocks of {self.block_shape})")
            item = t.element_size()
            halves = (t[0], t[1]) if kv_stacked else (t,)
            for h in halves:
                self.regions.append((h.data_ptr(), h.stride(0) * item, h[0].numel() * item))
        self.block_bytes = sum(r[2] for r in self.regions)
        self.cuda = self.device.type == "cuda"

    def check_like(self, other, what):
        if other.dtype != self.dtype:
            _invalid(f"{what}: dtype {other.dtype}, the store holds {self.dtype}")
        if other.device != self.device:
            _invalid(f"{what}: on {other.device}, the store serves {self.device}")
        if other.index != self.index:
            _invalid(f"{what}: {_where(other.index)}, the store serves device {self.index}")
        if (len(other.regions), other.block_bytes, other.block_shape) != \
                (len(self.regions), self.block_bytes, self.block_shape):
            _invalid(f"{what}: {len(other.tensors)} tensors of blocks {other.block_shape} "
                     f"({other.block_bytes} bytes a block), the store's are "
                     f"{len(self.tensors)} of {self.block_shape} ({self.block_bytes} bytes)")


def _ids(x, what):
    """Ids as a buffer of int64, each checked to be >= 0. Tensors and NumPy arrays of integers
    convert without a Python loop (thousands of ids a call)."""
    torch = _torch()
    if isinstance(x, (str, bytes, bytearray)):
        _invalid(f"{what}: block ids are integers, not {type(x).__name__} {x!r:.40}")
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            _invalid(f"{what}: block ids are integers, not {x.dtype}")
        if x.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            # Unsigned 16-64 bits: through NumPy, whose conversion checks the range.
            return _ids(x.detach().cpu().numpy(), what)
        x = x.detach().to("cpu", torch.int64).reshape(-1).contiguous()
        bad = (x < 0).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            _invalid(f"{what}[{i}] must be 0..{_ID_MAX}, not {int(x[i])}")
        return memoryview(x.numpy()) if _has_numpy() else _array_ids(x.tolist(), what)
    if type(x).__module__ == "numpy":
        import numpy
        if x.dtype.kind not in "iu":
            _invalid(f"{what}: block ids are integers, not {x.dtype}")
        if x.dtype.kind == "u" and x.size and int(x.max()) > _ID_MAX:
            flat = x.reshape(-1)
            i = int(numpy.argmax(flat > _ID_MAX))
            _invalid(f"{what}[{i}] must be 0..{_ID_MAX}, not {int(flat[i])}")
        return _ids(torch.from_numpy(numpy.ascontiguousarray(x, dtype=numpy.int64)), what)
    return _array_ids(x, what)


def _has_numpy():
    try:
        import numpy  # noqa: F401
    except ImportError:
        return False
    return True


def _array_ids(x, what):
    import array
    try:
        items = list(x)
    except TypeError:
        _invalid(f"{what}: block ids are a sequence of integers, not {type(x).__name__}")
    out = array.array("q", bytes(8 * len(items)))
    for i, v in enumerate(items):
        out[i] = _count(v, f"{what}[{i}]")
    return out


class KVBlockStore:
    """A pinned host arena of `num_blocks` blocks for the KV tensors `kv_caches`.

    kv_caches: a tensor or a list of tensors, all of one dtype, on one device, with the same
    block count and block shape. Each is [num_device_blocks, ...] with the block first (vLLM's
    per-layer [num_blocks, block_size, heads, head_dim]; K and V apart are two entries; K and V
    stacked as [num_blocks, 2, ...] is one), or, with kv_stacked=True, [2, num_device_blocks,
    ...] (K and V stacked in front). One host block holds one device block of every tensor.
    chunk_bytes: bytes pinned per registration (0: option blocks_chunk). background=False pins
    the whole arena before returning.
    """

    def __init__(self, kv_caches, num_blocks, *, kv_stacked=False, chunk_bytes=0,
                 background=True, pin_threads=0):
        self._kv_stacked = bool(kv_stacked)
        self._spec = _Spec(kv_caches, self._kv_stacked, "kv_caches")
        if self._spec.cuda:
            if _pm.backend() != "cuda":
                _invalid(f"kv_caches are on {self._spec.device}, but pinmem runs on the "
                         f"{_pm.backend()} backend")
        elif _pm.backend() == "cuda":
            _invalid(f"kv_caches are on {self._spec.device}: the store moves blocks between "
                     "a GPU and pinned memory (CPU tensors are host memory already)")
        # The tensors' device, not the calling thread's: the store's swaps, its NUMA node and
        # its default stream are that device's. -1 (not device memory: the first swap refuses
        # it, naming the region) leaves the choice to the current device.
        self._device = self._spec.index
        self._store = _pinmem._BlockStore(
            self._spec.block_bytes, _count(num_blocks, "num_blocks", 1),
            _count(chunk_bytes, "chunk_bytes"), self._device, bool(background),
            _count(pin_threads, "pin_threads"))

    @property
    def block_bytes(self):
        return self._spec.block_bytes

    @property
    def num_device_blocks(self):
        return self._spec.device_blocks

    def alloc(self, n):
        """n free host block ids (a list); NomemError when fewer are free. Blocks freed while a
        swap still used them come back only once every swap that named them completed: idle
        blocks go first, and when they are too few the call waits (GIL released) for those
        swaps (not for unrelated swaps on other streams). Blocks a swap whose completion the
        device cannot report named are never handed out again (stats' quarantined_blocks)."""
        raw = self._store.alloc(_count(n, "alloc: n"))
        return list(memoryview(raw).cast("Q"))

    def free(self, ids):
        """Give host block ids back. A swap that uses them may still be queued or running: the
        store hands them out again only once it completed (alloc waits for it if it must), so
        freeing needs no wait on the swap's event. Never blocks."""
        self._store.free(_ids(ids, "ids"))

    def _swap(self, out, device_ids, host_ids, kv_caches, stream):
        spec = self._spec
        if kv_caches is not None:
            spec = _Spec(kv_caches, self._kv_stacked, "kv_caches")
            self._spec.check_like(spec, "kv_caches")
        dev = _ids(device_ids, "device_ids")
        host = _ids(host_ids, "host_ids")
        if len(dev) != len(host):
            _invalid(f"device_ids has {len(dev)} ids, host_ids {len(host)}")
        if stream is None and spec.cuda:
            stream = _torch().cuda.current_stream(spec.device)
        return self._store.swap(out, spec.regions, spec.device_blocks,
                                self._device, dev, host, stream)

    def swap_out(self, device_ids, host_ids, *, kv_caches=None, stream=None):
        """Copy device block device_ids[i] of every KV tensor into host block host_ids[i], ordered
        on `stream` (default: torch's current stream of the tensors' device). Host ids must be
        allocated and distinct. Returns a BlocksEvent: wait() before reading the host blocks.
        kv_caches: other tensors of the same dtype, shapes and device (default: the store's)."""
        return self._swap(True, device_ids, host_ids, kv_caches, stream)

    def swap_in(self, device_ids, host_ids, *, kv_caches=None, stream=None):
        """Copy host block host_ids[i] into device block device_ids[i] of every KV tensor (device
        ids distinct). Later work on `stream` sees the blocks; returns a BlocksEvent."""
        return self._swap(False, device_ids, host_ids, kv_caches, stream)

    def read_block(self, host_id):
        """A copy of a host block's bytes (its regions in kv_caches order, K before V)."""
        return _ctypes.string_at(self._store.ptr(_count(host_id, "host_id")),
                                 self._spec.block_bytes)

    def wait_ready(self, count=0):
        """Block until the first `count` blocks (0: all) are pinned."""
        self._store.wait_ready(_count(count, "count"))

    def stats(self):
        """The store's figures (blocks free and ready, pinning times, the cut-off in force, swaps,
        bytes and pieces by path) as a dict. free_blocks: what alloc takes without waiting;
        waiting_blocks: freed, handed out once the swaps that still use them completed (alloc
        can give free_blocks + waiting_blocks); quarantined_blocks: freed, named by a swap whose
        completion cannot be known, never reused."""
        return self._store.stats()

    def close(self):
        """Wait for the device's queued work and unpin the arena."""
        self._store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
