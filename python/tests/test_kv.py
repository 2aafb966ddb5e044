"""pinmem.KVBlockStore: KV-cache blocks between torch tensors and the pinned arena, in every layout
servers use, byte for byte; bad ids, dtypes, shapes and devices raise InvalidError naming the
argument. Runs on the backend pinmem picks (the host backend in CI: KV tensors from
kv_device_tensor); needs torch (skipped with the reason without it)."""
import threading

import pytest

import pinmem
from conftest import SMALL, Gate, skip_unless_torch


def make_caches(torch, n, shape, layout, dtype, seed):
    """The KV tensors of `n` layers in one of the layouts, filled with seeded random values."""
    g = torch.Generator().manual_seed(seed)
    blocks = shape[0]
    if layout == "apart":
        shapes = [shape] * (2 * n)
    elif layout == "stacked_outer":
        shapes = [(2,) + shape] * n
    elif layout == "stacked_inner":
        shapes = [(blocks, 2) + shape[1:]] * n
    else:  # one tensor a layer
        shapes = [shape] * n
    caches = []
    for s in shapes:
        t = pinmem.kv_device_tensor(s, dtype)
        t.copy_(torch.randn(s, generator=g).to(dtype))
        caches.append(t)
    if caches[0].is_cuda:
        torch.cuda.synchronize()  # swaps on pinmem's own streams are not ordered after the fill
    return caches


def block_of(caches, d, stacked_outer):
    """What a host block holds for device block d: every tensor's block, K before V."""
    import torch
    parts = []
    for t in caches:
        halves = (t[0], t[1]) if stacked_outer else (t,)
        for h in halves:
            parts.append(h[d].contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return b"".join(parts)


@pytest.mark.parametrize("layout", ["apart", "stacked_outer", "stacked_inner", "per_layer"])
@pytest.mark.parametrize("cut", ["0", "1G", "auto"])
def test_round_trip(layout, cut):
    torch = skip_unless_torch()
    old = pinmem.get_option("blocks_kernel_max")
    pinmem.set_option("blocks_kernel_max", cut)
    try:
        caches = make_caches(torch, 2, (10, 4, 3, 5), layout, torch.bfloat16, 7)
        ref = [t.clone() for t in caches]
        outer = layout == "stacked_outer"
        with pinmem.KVBlockStore(caches, 12, kv_stacked=outer) as store:
            assert store.block_bytes == len(block_of(caches, 0, outer))
            host = store.alloc(5)
            dev = torch.tensor([7, 2, 9, 0, 4])
            store.swap_out(dev, host).wait()
            for h, d in zip(host, dev.tolist()):
                assert store.read_block(h) == block_of(caches, d, outer)
            for t in caches:
                t.zero_()
            # Back into other device blocks: each lands where it was sent, nothing else changes.
            to = [1, 3, 5, 6, 8]
            ev = store.swap_in(to, host)
            ev.wait()
            assert ev.query()
            for t, r in zip(caches, ref):
                want = torch.zeros_like(r)
                bdim = 1 if outer else 0
                for d_from, d_to in zip(dev.tolist(), to):
                    want.select(bdim, d_to).copy_(r.select(bdim, d_from))
                assert torch.equal(t.view(torch.int16), want.view(torch.int16))
            st = store.stats()
            assert st["swaps_out"] == 1 and st["swaps_in"] == 1 and st["blocks_in"] == 5
            if cut == "0":
                assert st["pieces_kernel"] == 0
            if cut == "1G" and st["kernel_max"]:  # 0 where the kernel cannot reach pinned memory
                assert st["pieces_dma"] == 0
            store.free(host)
            st = store.stats()
            assert (st["free_blocks"], st["waiting_blocks"], st["quarantined_blocks"]) == (12, 0, 0)
    finally:
        pinmem.set_option("blocks_kernel_max", old)


def test_bad_input():
    torch = skip_unless_torch()
    caches = make_caches(torch, 1, (6, 2, 2, 8), "apart", torch.float16, 1)
    store = pinmem.KVBlockStore(caches, 4)
    host = store.alloc(2)
    with pytest.raises(pinmem.InvalidError, match=r"host_ids\[1\] = 4"):
        store.swap_out([0, 1], [host[0], 4])
    with pytest.raises(pinmem.InvalidError, match=r"device_ids\[0\] = 6"):
        store.swap_in([6], [host[0]])
    with pytest.raises(pinmem.InvalidError, match="distinct"):
        store.swap_out([0, 1], [host[0], host[0]])
    with pytest.raises(pinmem.InvalidError, match="distinct"):
        store.swap_in([2, 2], host)
    with pytest.raises(pinmem.InvalidError,
                       match=r"host_ids\[0\] must be 0\.\.9223372036854775807, not -1"):
        store.swap_out([0], [-1])
    with pytest.raises(pinmem.InvalidError, match="integers"):
        store.swap_out(torch.tensor([0.5]), [host[0]])
    with pytest.raises(pinmem.InvalidError, match="device_ids has 2 ids"):
        store.swap_out([0, 1], [host[0]])
    # Exhaustion: a MemoryError too.
    with pytest.raises(pinmem.NomemError, match="exhausted"):
        store.alloc(3)
    with pytest.raises(MemoryError):
        store.alloc(3)
    # Tensors that do not match the store: dtype, shape, count.
    other = make_caches(torch, 1, (6, 2, 2, 8), "apart", torch.float32, 2)
    with pytest.raises(pinmem.InvalidError, match="dtype torch.float32"):
        store.swap_out([0], [host[0]], kv_caches=other)
    other = make_caches(torch, 1, (6, 2, 2, 4), "apart", torch.float16, 2)
    with pytest.raises(pinmem.InvalidError, match="bytes a block"):
        store.swap_out([0], [host[0]], kv_caches=other)
    with pytest.raises(pinmem.InvalidError, match="dtype"):
        pinmem.KVBlockStore([caches[0], other[0].view(torch.int16)], 4)
    with pytest.raises(pinmem.InvalidError, match="does not match"):
        pinmem.KVBlockStore([caches[0], other[0]], 4)
    with pytest.raises(pinmem.InvalidError, match="not contiguous"):
        pinmem.KVBlockStore([caches[0].transpose(1, 2)], 4)
    with pytest.raises(pinmem.InvalidError, match="kv_stacked"):
        pinmem.KVBlockStore(caches, 4, kv_stacked=True)
    with pytest.raises(pinmem.InvalidError, match="no KV tensors"):
        pinmem.KVBlockStore([], 4)
    if pinmem.backend() == "host":
        # Ordinary CPU memory is not the host backend's device memory.
        with pytest.raises(pinmem.InvalidError, match="not device memory"):
            pinmem.KVBlockStore([torch.zeros(6, 2, 2, 8, dtype=torch.float16)], 4).swap_out(
                [0], [0])
    else:
        with pytest.raises(pinmem.InvalidError, match="on cpu"):
            pinmem.KVBlockStore([torch.zeros(6, 2, 2, 8, dtype=torch.float16)], 4)
    store.free(host)
    with pytest.raises(pinmem.InvalidError, match="not allocated"):
        store.free(host[:1])
    store.close()
    with pytest.raises(pinmem.StateError, match="closed"):
        store.alloc(1)


def test_two_threads_two_streams():
    torch = skip_unless_torch()
    caches = make_caches(torch, 2, (8, 4, 2, 16), "apart", torch.float16, 3)
    ref = [t.clone() for t in caches]
    store = pinmem.KVBlockStore(caches, 8)
    rounds = 3 if SMALL else 20
    errors = []

    def work(first):
        try:
            with pinmem.Stream() as s:
                host = store.alloc(4)
                ids = list(range(first, first + 4))
                for _ in range(rounds):
                    store.swap_out(ids, host, stream=s)
                    # Rotated by one on the way back, after the swap out on the same stream.
                    store.swap_in(ids[1:] + ids[:1], host, stream=s).wait()
                store.free(host)
        except Exception as e:  # noqa: BLE001  (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(f,)) for f in (0, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for t, r in zip(caches, ref):
        for g in (0, 4):
            for i in range(4):
                assert torch.equal(t[g + (i + rounds) % 4], r[g + i])
    store.close()


def test_free_while_a_swap_uses_the_blocks():
    """Host blocks freed while a swap_in still reads them (its stream held by a gate) go to
    another request only once it completed: alloc takes the idle blocks first, an alloc of every
    block waits (the GIL released, so the timer thread opens the gate) until the swap_in
    completed, and the new owner's swap_out into the re-allocated blocks neither changes what
    the swap_in read nor is overwritten. Whenever the timer fires, only the order is forced."""
    torch = skip_unless_torch()
    caches = make_caches(torch, 1, (8, 2, 2, 8), "apart", torch.float16, 5)
    ref = [t.clone() for t in caches]
    with pinmem.KVBlockStore(caches, 4, background=False) as store, \
            pinmem.Stream() as a, pinmem.Stream() as b:
        host = store.alloc(4)
        store.swap_out([0, 1, 2, 3], host).wait()
        with Gate(a) as gate:
            store.swap_in([4, 5], host[:2], stream=a)  # held: reads host[0], host[1] later
            store.free(host)  # no wait on the swap_in's event
            st = store.stats()  # idle, and freed but still read by the swap_in
            assert (st["free_blocks"], st["waiting_blocks"], st["quarantined_blocks"]) == (2, 2, 0)
            idle = store.alloc(2)
            assert sorted(idle) == sorted(host[2:])  # the idle blocks, at once
            store.free(idle)
            opener = threading.Timer(0.3, gate.open)
            opener.start()
            new = store.alloc(4)  # every block: waits for the swap_in
            assert sorted(new) == sorted(host)
            out_from = [6, 7, 2, 3]
            store.swap_out(out_from, new, stream=b).wait()
            opener.join()
        a.synchronize()
        for t, r in zip(caches, ref):
            assert torch.equal(t[4].view(torch.int16), r[0].view(torch.int16))
            assert torch.equal(t[5].view(torch.int16), r[1].view(torch.int16))
        for h, d in zip(new, out_from):
            assert store.read_block(h) == block_of(caches, d, False)


def test_background_pinning_races_first_swaps():
    torch = skip_unless_torch()
    caches = make_caches(torch, 1, (32, 16, 2, 64), "per_layer", torch.float16, 5)
    # One block a chunk: 31 chunks pinned by the background thread while the swaps start.
    store = pinmem.KVBlockStore(caches, 32, chunk_bytes=4096)
    host = store.alloc(32)
    assert host == list(range(32))
    store.swap_out(list(range(32)), host[::-1]).wait()
    for d, h in zip(range(32), host[::-1]):
        assert store.read_block(h) == block_of(caches, d, False)
    store.wait_ready()
    st = store.stats()
    assert st["chunks"] == 32 and st["chunks_ready"] == 32
    assert st["all_ready_seconds"] >= st["first_ready_seconds"] > 0
    store.close()


def test_example_kv_offload():
    """python/examples/kv_offload.py: attention outputs identical after the KV round trip."""
    skip_unless_torch()
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "..", "examples", "kv_offload.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "decode outputs identical" in r.stdout


def test_ids_as_tensors_arrays_and_lists():
    torch = skip_unless_torch()
    import numpy as np
    caches = make_caches(torch, 1, (6, 2, 2, 8), "per_layer", torch.float16, 4)
    with pinmem.KVBlockStore(caches, 6) as store:
        host = store.alloc(3)
        for dev in (torch.tensor([5, 0, 3], dtype=torch.int32), np.array([5, 0, 3], np.uint16),
                    [5, 0, 3]):
            store.swap_out(dev, np.array(host)).wait()
            for h, d in zip(host, [5, 0, 3]):
                assert store.read_block(h) == block_of(caches, d, False)
        with pytest.raises(pinmem.InvalidError,
                           match=r"device_ids\[1\] must be 0\.\.9223372036854775807, not -2"):
            store.swap_out(torch.tensor([1, -2, 0]), host)
        with pytest.raises(pinmem.InvalidError, match="integers, not float64"):
            store.swap_out(np.array([1.0, 2.0, 0.0]), host)
        with pytest.raises(pinmem.InvalidError, match=r"device_ids\[0\] must be 0\.\."
                           r"9223372036854775807, not 9223372036854775809"):
            store.swap_out(np.array([2**63 + 1], np.uint64), host[:1])


def test_ids_and_counts_are_integers_never_truncated():
    """A float or a string where an id or a count belongs is refused, not int()-ed: free([0.5])
    freed block 0, swap_out("01", ...) moved blocks 0 and 1."""
    torch = skip_unless_torch()
    caches = make_caches(torch, 1, (6, 2, 2, 8), "apart", torch.float16, 5)
    with pinmem.KVBlockStore(caches, 4) as store:
        host = store.alloc(2)
        before = [store.read_block(h) for h in host]
        calls = {r"ids\[0\] must be an integer, not float": lambda: store.free([0.5]),
                 r"device_ids\[0\] must be an integer, not float":
                     lambda: store.swap_out([0.7, 1.9], host),
                 "integers, not str": lambda: store.swap_out("01", host),
                 "host_id must be an integer": lambda: store.read_block(1.5),
                 r"host_id must be 0\.\.9223372036854775807, not -1":
                     lambda: store.read_block(-1),
                 "host_id must be 0..9223372036854775807, not True":
                     lambda: store.read_block(True),
                 "n must be 0..9223372036854775807, not True": lambda: store.alloc(True),
                 "n must be an integer": lambda: store.alloc(1.5),
                 "num_blocks must be an integer": lambda: pinmem.KVBlockStore(caches, 1.5),
                 "num_blocks must be 1..9223372036854775807, not -1":
                     lambda: pinmem.KVBlockStore(caches, -1),
                 "num_blocks must be 1..9223372036854775807, not 0":
                     lambda: pinmem.KVBlockStore(caches, 0),
                 "chunk_bytes must be 0..9223372036854775807, not -1":
                     lambda: pinmem.KVBlockStore(caches, 4, chunk_bytes=-1),
                 r"kv_caches\[0\]: a torch.Tensor is needed, not int":
                     lambda: pinmem.KVBlockStore([1, 2], 4),
                 "holds no device block": lambda: pinmem.KVBlockStore(
                     [pinmem.kv_device_tensor((0, 8), torch.float32)], 4)}
        if pinmem.backend() != "cuda":  # under cuda, torch.empty's own refusal
            calls[r"negative dimension -1 in shape \(-1, 3\)"] = (
                lambda: pinmem.kv_device_tensor((-1, 3), torch.float32))
        for match, call in calls.items():
            with pytest.raises(pinmem.InvalidError, match=match):
                call()
        # Past what the store has: its own refusal, before any buffer of that many ids.
        for n in (3, 2**59, 2**60, 2**63 - 1):
            with pytest.raises(pinmem.NomemError, match="exhausted"):
                store.alloc(n)
        assert store.stats()["free_blocks"] == 2  # nothing freed, nothing taken
        assert [store.read_block(h) for h in host] == before  # nothing moved


def test_low_level_store_without_torch(rng):
    """The extension's _BlockStore on pinmem device buffers (NumPy only, so CI without torch
    covers the binding): a swap out and back, byte for byte, and its errors."""
    import numpy as np
    from conftest import random_bytes
    pages, page = 6, 1000
    k, v = pinmem.device_empty(pages * page, "uint8"), pinmem.device_empty(pages * page, "uint8")
    ref_k, ref_v = random_bytes(rng, pages * page), random_bytes(rng, pages * page)
    pinmem.copy(k, ref_k).wait()
    pinmem.copy(v, ref_v).wait()
    regions = [(k.ptr, page, page), (v.ptr, page, page)]
    store = pinmem._pinmem._BlockStore(2 * page, 4)
    host = np.frombuffer(store.alloc(3), dtype=np.uint64)
    dev = np.array([4, 0, 2], dtype=np.int64)
    ev = store.swap(True, regions, pages, -1, dev, host, None)
    ev.wait()
    assert ev.query()
    import ctypes
    for h, d in zip(host.tolist(), dev.tolist()):
        got = ctypes.string_at(store.ptr(h), 2 * page)
        assert got == bytes(ref_k[d * page:][:page]) + bytes(ref_v[d * page:][:page])
    # Back into pages 1, 3, 5.
    store.swap(False, regions, pages, -1, np.array([1, 3, 5]), host, None).wait()
    back_k, back_v = np.zeros(pages * page, np.uint8), np.zeros(pages * page, np.uint8)
    pinmem.copy(back_k, k).wait()
    pinmem.copy(back_v, v).wait()
    def at(a, d):
        return bytes(a[d * page:(d + 1) * page])

    for d_from, d_to in zip(dev.tolist(), [1, 3, 5]):
        assert at(back_k, d_to) == at(ref_k, d_from) and at(back_v, d_to) == at(ref_v, d_from)
    with pytest.raises(pinmem.InvalidError, match="hold 1000 bytes"):
        store.swap(True, regions[:1], pages, -1, dev, host, None)
    with pytest.raises(pinmem.InvalidError, match="itemsize"):
        store.swap(True, regions, pages, -1, np.array([1], np.int32), host[:1], None)
    with pytest.raises(pinmem.InvalidError, match="2 device ids but 3 host ids"):
        store.swap(True, regions, pages, -1, dev[:2], host, None)
    with pytest.raises(pinmem.NomemError, match="exhausted"):
        store.alloc(2)
    store.free(host)
    store.close()
    with pytest.raises(pinmem.StateError, match="closed"):
        store.alloc(1)


# Under the host backend with two simulated devices: KV tensors made on device 1 are served by a
# store of device 1 whatever the constructing thread's device, and tensors of two devices are
# refused at once, naming both.
ON_DEVICE_1 = r"""
import torch, pinmem
pinmem.set_device(1)
caches = [pinmem.kv_device_tensor((6, 4, 8), torch.float32) for _ in range(2)]
for i, t in enumerate(caches):
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + 1000 * i)
ref = [t.clone() for t in caches]
pinmem.set_device(0)
with pinmem.KVBlockStore(caches, 4, background=False) as store:
    host = store.alloc(2)
    store.swap_out([3, 5], host).wait()
    for t in caches:
        t.zero_()
    store.swap_in([1, 2], host).wait()
    for t, r in zip(caches, ref):
        assert torch.equal(t[1], r[3]) and torch.equal(t[2], r[5]), "blocks moved wrong"
    assert pinmem.current_device() == 0
    pinmem.set_device(0)
    other = [pinmem.kv_device_tensor((6, 4, 8), torch.float32) for _ in range(2)]
    try:
        store.swap_out([0], host[:1], kv_caches=other)
        print("taken: kv_caches of device 0")
    except ValueError as e:
        print("refused:", e)
mixed = [pinmem.kv_device_tensor((6, 4, 8), torch.float32)]
pinmem.set_device(1)
mixed.append(pinmem.kv_device_tensor((6, 4, 8), torch.float32))
try:
    pinmem.KVBlockStore(mixed, 4)
    print("taken: tensors of devices 0 and 1")
except ValueError as e:
    print("refused:", e)
print("ok")
"""


def test_store_serves_the_tensors_device_and_refuses_two_devices():
    skip_unless_torch()
    import os
    import subprocess
    import sys
    env = dict(os.environ, PINMEM_BACKEND="host", PINMEM_HOST_DEVICES="2")
    env.pop("PINMEM_DEVICE", None)
    r = subprocess.run([sys.executable, "-c", ON_DEVICE_1], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[-1] == "ok", lines
    assert lines[0].startswith("refused:") and \
        "kv_caches: memory of device 0, the store serves device 1" in lines[0], lines
    assert lines[1].startswith("refused:") and "kv_caches[1]: memory of device 1, but " \
        "kv_caches[0] is memory of device 0: every KV tensor of a store is on one device" \
        in lines[1], lines
