"""pinmem.Loader over a torch IterableDataset, side by side with torch.utils.data.DataLoader on
the same dataset and arguments (host backend): the same batches in the same order where torch's
order is deterministic (workers taken in turn), the same errors, the same refusals.
"""
import gc
import os
import signal

import numpy as np
import pytest

import pinmem

torch = pytest.importorskip(
    "torch", reason="torch is not installed (pip install torch; CI installs the CPU build): the "
    "side-by-side comparisons with DataLoader did not run")
from torch.utils.data import DataLoader, IterableDataset, get_worker_info  # noqa: E402

# torch warns when num_workers exceeds the CPUs it counts; these tests run 3 workers anywhere.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


class Stream(IterableDataset):
    """Samples (float32 [i, i + 0.5], int64 i) for i in 0..n-1; each worker takes every
    num_workers-th sample from its id (the usual sharding in __iter__)."""

    def __init__(self, n=10):
        self.n = n

    def _mine(self):
        info = get_worker_info()
        return range(self.n) if info is None else range(info.id, self.n, info.num_workers)

    def __iter__(self):
        for i in self._mine():
            yield np.array([i, i + 0.5], np.float32), i


class Sized(Stream):
    def __len__(self):
        return self.n


def host(x):
    """A batch leaf (pinmem buffer, host or device, or a torch tensor) as a NumPy array."""
    if isinstance(x, torch.Tensor):
        return x.cpu().numpy().copy()
    if isinstance(x, pinmem.DeviceBuffer):  # copied out through pinmem (any backend)
        out = np.empty(x.shape, x.dtype)
        pinmem.copy(out, x).wait()
        return out
    return np.asarray(x).copy()


def skip_unless_torch_reads_the_device():
    if pinmem.backend() == "cuda" and not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device: device batches as torch tensors need one")


def plain(batch):
    """A batch as nested lists / dicts of Python values, for comparing loaders."""
    if isinstance(batch, dict):
        return {k: plain(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not all(isinstance(v, str) for v in batch):
        return [plain(v) for v in batch]
    if isinstance(batch, (list, tuple)):
        return (type(batch).__name__, list(batch))  # strings: tuple or list, as torch gives
    if isinstance(batch, (str, int, float)):
        return batch
    return host(batch).tolist()


def epoch(loader, stop_after=None):
    out = []
    for k, b in enumerate(loader):
        out.append(plain(b))
        del b
        if stop_after is not None and k + 1 >= stop_after:
            break
    return out


def outcomes(loader):
    """One epoch as a list of batches and exception types (next() goes on after an error, as
    a loop that catches errors does), until StopIteration."""
    it, out = iter(loader), []
    for _ in range(100):
        try:
            out.append(plain(next(it)))
        except StopIteration:
            return out
        except Exception as e:
            out.append(type(e).__name__)
    raise AssertionError(f"no end after 100 batches: {out}")


def both(dataset, **kw):
    return DataLoader(dataset, **kw), pinmem.Loader(dataset, device="cpu", **kw)


@pytest.mark.parametrize("nw", [0, 1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sharded_stream_as_dataloader(nw, drop_last):
    t, p = both(Stream(10), batch_size=3, num_workers=nw, drop_last=drop_last)
    with p:
        want = epoch(t)
        assert epoch(p) == want
        assert epoch(p) == want  # a second epoch: the same stream again
    labels = sorted(v for b in want for v in b[1])
    if not drop_last:  # every sample once, whatever the sharding
        assert labels == list(range(10))


@pytest.mark.parametrize("nw", [0, 2])
def test_unbatched(nw):
    t, p = both(Stream(5), batch_size=None, num_workers=nw)
    with p:
        got = epoch(p)
        assert [g[0] for g in got] == [w[0] for w in epoch(t)]
        # torch's default_convert leaves an int an int; pinmem gives a 0-d array (as its
        # map-style batch_size=None does)
        assert [g[1] for g in got] == [w[1] for w in epoch(t)]
        assert len(got) == 5


class Records(IterableDataset):
    def __init__(self, kind, n=7):
        self.kind, self.n = kind, n

    def __iter__(self):
        info = get_worker_info()
        ids = range(self.n) if info is None else range(info.id, self.n, info.num_workers)
        for i in ids:
            x = np.arange(3, dtype=np.int32) + i
            if self.kind == "dict":
                yield {"x": x, "name": f"s{i}", "y": float(i), "flag": i % 2 == 0}
            else:
                yield x, f"s{i}", (i, np.full((2, 2), i, np.float64))


@pytest.mark.parametrize("kind", ["dict", "tuple"])
@pytest.mark.parametrize("nw", [0, 2])
def test_dict_tuple_and_str_samples(kind, nw):
    t, p = both(Records(kind), batch_size=2, num_workers=nw)
    with p:
        want = epoch(t)
        assert epoch(p) == want
    assert len(want) == 4


class Broken(IterableDataset):
    """A class iterator (it goes on after an error, as torch's fetcher calls next() again):
    sample `bad` of each worker's share raises KeyError."""

    def __init__(self, n=12, bad=4):
        self.n, self.bad = n, bad

    def __iter__(self):
        info = get_worker_info()
        self.ids = iter(range(self.n) if info is None else
                        range(info.id, self.n, info.num_workers))
        self.k = 0
        return self

    def __next__(self):
        i = next(self.ids)
        self.k += 1
        if self.k == self.bad:
            raise KeyError(f"sample {i} is broken")
        return np.full(2, i, np.int64), i


class DiesInGenerator(IterableDataset):
    def __iter__(self):
        for i in range(10):
            if i == 5:
                raise ValueError("the stream broke")
            yield np.full(2, i, np.int64)


@pytest.mark.parametrize("nw", [0, 2])
@pytest.mark.parametrize("ds", [Broken, DiesInGenerator])
def test_errors_in_the_iterator_as_dataloader(nw, ds):
    t, p = both(ds(), batch_size=2, num_workers=nw)
    with p:
        want = outcomes(t)
        assert "KeyError" in want or "ValueError" in want
        assert outcomes(p) == want


class IterRaises(IterableDataset):
    def __iter__(self):
        raise KeyError("the stream cannot open")


@pytest.mark.parametrize("nw", [0, 2])
def test_an_iter_that_raises_ends_its_loop(nw):
    # iter(dataset) was asked again at every next(): a loop that catches errors never ended.
    # DataLoader raises it once, from iter(); pinmem from the first next(), where its epoch
    # begins, and once from each worker's copy.
    t, p = both(IterRaises(), batch_size=2, num_workers=nw)
    with p:
        got = outcomes(p)
        assert set(got) == {"KeyError"} and len(got) == max(nw, 1)
    if nw == 0:
        with pytest.raises(KeyError):
            iter(t)


def test_an_iterdatapipe_with_workers_is_refused_not_repeated():
    from torch.utils.data.datapipes.iter import IterableWrapper
    dp = IterableWrapper(range(6)).sharding_filter()
    # DataLoader shards it by worker; pinmem gave every sample once per worker.
    with pytest.raises(pinmem.InvalidError, match="IterDataPipe with worker processes"):
        pinmem.Loader(dp, batch_size=2, num_workers=2, device="cpu")
    t, p = both(dp, batch_size=2)
    with p:
        assert epoch(p) == epoch(t) == [[0, 1], [2, 3], [4, 5]]


def test_error_keeps_its_type_and_names_the_worker():
    with pinmem.Loader(Broken(), batch_size=2, num_workers=2, device="cpu") as p:
        with pytest.raises(KeyError, match=r"(?s)worker process [01].*is broken"):
            for _ in p:
                pass
    with pinmem.Loader(Broken(), batch_size=2, device="cpu") as p:
        with pytest.raises(KeyError, match="is broken"):
            for _ in p:
                pass


def _offset_init(wid):
    get_worker_info().dataset.n += 100 * (wid + 1)


class Offset(IterableDataset):
    n = 0

    def __iter__(self):
        info = get_worker_info()
        yield np.array([self.n, info.id, info.num_workers], np.int64)
        yield np.array([self.n, info.id, info.num_workers], np.int64)


@pytest.mark.parametrize("nw", [1, 2])
def test_worker_init_fn_and_worker_info(nw):
    t, p = both(Offset(), batch_size=1, num_workers=nw, worker_init_fn=_offset_init)
    with p:
        want = epoch(t)
        assert epoch(p) == want
    assert {b[0][0] for b in want} == {100 * (w + 1) for w in range(nw)}


class Seeds(IterableDataset):
    def __iter__(self):
        info, mine = get_worker_info(), pinmem.get_worker_info()
        assert info.dataset is self and mine.dataset is self
        yield np.array([info.id, info.num_workers, info.seed, mine.id, mine.seed], np.int64)


def test_worker_seeds_follow_the_seed():
    with pinmem.Loader(Seeds(), batch_size=None, num_workers=3, seed=41, device="cpu") as p:
        got = [host(b).tolist() for b in p]
    assert got == [[w, 3, 41 + w, w, 41 + w] for w in range(3)]


class Calls(IterableDataset):
    """Each sample says how often __iter__ ran on this copy of the dataset."""

    def __init__(self):
        self.calls = 0

    def __iter__(self):
        self.calls += 1
        info = get_worker_info()
        for i in range(info.id, 6, info.num_workers):
            yield np.array([i, self.calls], np.int64)


@pytest.mark.parametrize("persistent", [False, True])
def test_persistent_workers_reiterate_their_copy(persistent):
    t, p = both(Calls(), batch_size=2, num_workers=2, persistent_workers=persistent)
    with p:
        for _ in range(2):
            want = epoch(t)
            assert epoch(p) == want
        pids = p.worker_pids()
        assert (len(pids) == 2) == persistent  # kept between epochs, or stopped at the end
    assert {row[1] for b in want for row in b} == {2 if persistent else 1}


@pytest.mark.parametrize("nw,persistent", [(0, False), (2, False), (2, True)])
def test_break_then_a_new_epoch(nw, persistent):
    t, p = both(Stream(12), batch_size=2, num_workers=nw, persistent_workers=persistent)
    with p:
        for loader in (t, p):
            assert epoch(loader, stop_after=1) == [[[[0, 0.5], [1, 1.5]], [0, 1]]] if nw == 0 \
                else epoch(loader, stop_after=1) == [[[[0, 0.5], [2, 2.5]], [0, 2]]]
        assert epoch(p) == epoch(t)
        it = iter(p)
        next(it)
        it2 = iter(p)  # a newer iterator starts the next epoch; the older one cannot go on
        assert len(list(it2)) == 6
        with pytest.raises(pinmem.StateError, match="another loop over this loader"):
            next(it)  # it ended quietly, the rest of its epoch lost
        assert list(it) == []


@pytest.mark.parametrize("nw", [0, 2])
def test_collate_fn_of_your_own(nw):
    def total(samples):
        return {"sum": sum(int(s[1]) for s in samples), "n": len(samples)}

    t, p = both(Stream(9), batch_size=4, num_workers=nw, collate_fn=total)
    with p:
        assert epoch(p) == epoch(t)


def stacked(samples):
    """A collate_fn of one's own: the arrays stacked, the labels as a tensor, a name kept."""
    return {"x": np.stack([s[0] for s in samples]), "y": torch.tensor([s[1] for s in samples]),
            "name": f"{len(samples)} samples"}


@pytest.mark.parametrize("nw", [0, 2])
def test_collate_fn_of_your_own_with_device_batches(nw):
    skip_unless_torch_reads_the_device()
    t = list(DataLoader(Stream(9), batch_size=4, num_workers=nw, collate_fn=stacked))
    with pinmem.Loader(Stream(9), batch_size=4, num_workers=nw, collate_fn=stacked) as p:
        got = list(p)  # torch tensors on the device, the output's structure kept
        assert len(got) == len(t) == 3
        for pb, tb in zip(got, t):
            assert sorted(pb) == sorted(tb) and pb["name"] == tb["name"]
            assert isinstance(pb["x"], torch.Tensor) and isinstance(pb["y"], torch.Tensor)
            assert np.array_equal(host(pb["x"]), tb["x"]) and host(pb["y"]).tolist() == \
                tb["y"].tolist()
    with pinmem.Loader(Stream(9), batch_size=4, collate_fn=stacked, tensors=False) as p:
        plain = next(iter(p))
        assert isinstance(plain["x"], pinmem.Buffer) and plain["x"].shape == (4, 2)


@pytest.mark.parametrize("nw", [0, 2])
def test_device_batches(nw):
    """On the host backend the device is simulated: batches are device buffers, copied there on
    the loader's stream, read through DLPack."""
    with pinmem.Loader(Stream(7), batch_size=3, num_workers=nw, tensors=False) as p:
        assert p.device.startswith("cuda")
        got = []
        for x, y in p:
            assert isinstance(x, pinmem.DeviceBuffer) and isinstance(y, pinmem.DeviceBuffer)
            with pytest.raises(TypeError):
                np.asarray(x)  # device memory: no CPU view
            got.append(host(y).tolist())
        ref = [b[1].tolist() for b in DataLoader(Stream(7), batch_size=3, num_workers=nw)]
        assert got == ref
        skip_unless_torch_reads_the_device()
        ts = [b for b in p.as_torch()]
        assert all(isinstance(b[0], torch.Tensor) for b in ts)
        assert [b[1].tolist() for b in ts] == ref


@pytest.mark.parametrize("nw", [0, 2])
@pytest.mark.parametrize("device", ["cpu", None])
def test_pool_bytes_go_back(nw, device):
    pinmem.synchronize()
    gc.collect()
    before = pinmem.stats()["in_use_bytes"]
    with pinmem.Loader(Records("dict", 9), batch_size=2, num_workers=nw, device=device,
                       tensors=False) as p:
        held = list(p)
        assert len(held) == 5
        if device == "cpu":
            assert pinmem.stats()["in_use_bytes"] > before  # the batches hold pinned memory
        else:  # device batches hold device memory; their pinned source goes after the copy
            pinmem.synchronize()
            assert pinmem.stats()["in_use_bytes"] == before
        x = None
        if device == "cpu":
            x = held[0]["x"]
            assert pinmem.pointer_info(x.ptr)["kind"] == "pool"
            np.testing.assert_array_equal(np.asarray(x), [[0, 1, 2], [1, 2, 3]] if nw == 0
                                          else [[0, 1, 2], [2, 3, 4]])
        for b in p:  # a loop that drops each batch holds no more than one
            del b
    del held
    x = None
    gc.collect()
    pinmem.synchronize()  # copies to the device hold their pinned source until done
    assert pinmem.stats()["in_use_bytes"] == before


# ---- device batches: blocks reused from batch to batch ---------------------------------------

def device_loader(dataset, **kw):
    """Device batches (the host backend simulates the device) beside torch's host batches."""
    kw.setdefault("tensors", False)
    return DataLoader(dataset, batch_size=kw["batch_size"], num_workers=kw.get("num_workers", 0)), \
        pinmem.Loader(dataset, **kw)


@pytest.mark.parametrize("nw", [1, 2])
@pytest.mark.parametrize("tensors", [False, True])
def test_device_batches_reuse_their_blocks(nw, tensors):
    """50 device batches allocate device memory for the batches alive at once (the one the loop
    holds and the one being made), not once per batch or per leaf, and every value is right."""
    if tensors:
        skip_unless_torch_reads_the_device()
    t, p = device_loader(Stream(100), batch_size=2, num_workers=nw, tensors=tensors)
    with p:
        want = epoch(t)
        assert epoch(p) == want
        s = p.stats()
        assert s["batches"] == 50
        assert s["device_allocations"] <= 3, s
        assert s["device_reuses"] >= 47 and s["device_reuses"] + s["device_allocations"] == 50
        assert s["device_blocks"] <= 3 and s["device_bytes"] > 0
        assert epoch(p) == want  # a second epoch takes the same blocks
        assert p.stats()["device_allocations"] == s["device_allocations"]
        assert p.stats()["device_blocks"] == s["device_blocks"]


@pytest.mark.parametrize("nw", [0, 2])
def test_held_device_batches_stay_intact(nw):
    """Batches held across many next() calls keep their own blocks (a held block is never
    reused): each has its values when read at the end; once dropped, their blocks serve the next
    epoch without new allocations."""
    t, p = device_loader(Stream(100), batch_size=2, num_workers=nw)
    with p:
        held = list(p)
        ptrs = {x.ptr for b in held for x in b}
        assert len(ptrs) == 100  # every leaf of every held batch has its own memory
        assert [plain(b) for b in held] == epoch(t)
        assert p.stats()["device_allocations"] == 50
        del held
        gc.collect()
        assert len(epoch(p)) == 50
        s = p.stats()
        assert s["device_allocations"] == 50 and s["device_reuses"] == 50
        assert s["device_blocks"] <= 50


class Varying(IterableDataset):
    """Batches of varying shape: each worker's k-th batch holds samples of 300 * (1 + k % 5)
    float32 (and int64 labels); n samples in all, so the last batches are short."""

    def __init__(self, n, batch):
        self.n, self.batch = n, batch

    def __iter__(self):
        info = get_worker_info()
        ids = range(self.n) if info is None else range(info.id, self.n, info.num_workers)
        for count, i in enumerate(ids):
            k = count // self.batch
            yield np.arange(300 * (1 + k % 5), dtype=np.float32) + i, i


@pytest.mark.parametrize("nw", [0, 2])
def test_device_batches_of_varying_shape(nw):
    """Shapes that change from batch to batch and a short last batch: the right values, and the
    cache settles on blocks that fit them all, never more blocks than batches alive at once."""
    t, p = device_loader(Varying(83, 4), batch_size=4, num_workers=nw)
    with p:
        want = epoch(t)
        assert len({len(b[0][0]) for b in want}) == 5 and len(want[-1][1]) < 4
        assert epoch(p) == want
        s = p.stats()
        assert s["device_blocks"] <= 3, s
        # Each growth of the largest batch (4 here, 5 sizes) replaces the free block at most
        # once per block alive (2): 2 to start, 8 while growing, then none.
        assert s["device_allocations"] <= 10, s
        assert epoch(p) == want
        assert p.stats()["device_allocations"] == s["device_allocations"]


def test_out_of_device_memory_gives_the_free_blocks_back_first(tmp_path):
    """A larger batch than every free block, and the device says no (an injected failure of
    the allocation): the cache frees all its free blocks and tries once more, so the batch comes
    (only an allocation failing with nothing left to free is raised)."""
    if pinmem.backend() != "host":
        pytest.skip("injects a device allocation failure through the host backend's fault table")
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent("""
        import numpy as np, pinmem
        from test_loader_iterable import Varying
        with pinmem.Loader(Varying(40, 4), batch_size=4, tensors=False) as p:
            it = iter(p)
            held = [next(it) for _ in range(3)]  # 3 blocks of 3 sizes (allocations 1-3)
            del held  # 3 free blocks, none fits the next batch: the 4th allocation fails
            x, y = next(it)
            out = np.empty(x.shape, np.float32)
            pinmem.copy(out, x).wait()
            want = np.stack([np.arange(1200, dtype=np.float32) + i for i in range(12, 16)])
            assert (out == want).all()
            s = p.stats()
            print(s["device_allocations"], s["device_blocks"])
    """)
    env = dict(os.environ, PINMEM_FAULT="device_alloc=4",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__)] +
                                          [q for q in sys.path if q]))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"child failed:\n{r.stdout}\n{r.stderr}"
    assert r.stdout.split() == ["4", "1"]  # the 4th try failed, the retry made the 4th block


def device_totals():
    return pinmem._pinmem._device_cache_totals()


@pytest.fixture
def no_foreign_collection():
    """The totals are the process's: no collection of another test's garbage mid-test."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("nw", [0, 2])
def test_device_and_pinned_bytes_go_back(nw, no_foreign_collection):
    """The cache holds what its batches hold; close() frees its free blocks, a batch held past
    close() frees its own when it goes, and a loader dropped without close() frees them too:
    pinned and device bytes come back to where they were."""
    pinmem.synchronize()
    gc.collect()
    pinned, dev = pinmem.stats()["in_use_bytes"], device_totals()
    p = pinmem.Loader(Stream(20), batch_size=2, num_workers=nw, tensors=False)
    held = [b for k, b in enumerate(p) if k < 3]  # three held, the rest dropped at once
    assert device_totals()["blocks"] - dev["blocks"] == p.stats()["device_blocks"] >= 3
    p.close()
    assert device_totals()["blocks"] - dev["blocks"] == 3  # only the held batches' blocks
    assert [host(b[1]).tolist() for b in held] == \
        [b[1].tolist() for k, b in enumerate(DataLoader(Stream(20), batch_size=2,
                                                         num_workers=nw)) if k < 3]
    del held
    gc.collect()
    pinmem.synchronize()
    assert device_totals() == dev
    assert pinmem.stats()["in_use_bytes"] == pinned

    p = pinmem.Loader(Stream(20), batch_size=2, num_workers=nw, tensors=False)
    it = iter(p)
    kept = next(it)
    next(it)
    assert device_totals()["blocks"] > dev["blocks"]
    del p, it  # dropped without close(): the free blocks go now, the held one with its batch
    gc.collect()
    assert device_totals()["blocks"] - dev["blocks"] == 1
    del kept
    gc.collect()
    pinmem.synchronize()
    assert device_totals() == dev
    assert pinmem.stats()["in_use_bytes"] == pinned


def test_a_block_is_not_reused_while_a_copy_reads_it():
    """A copy out of a device batch still queued (held back by a gate on its stream) holds the
    batch's block: the batches after it take other blocks, and the copy reads the batch's own
    values once it runs. After it, the block serves again."""
    from conftest import Gate
    p = pinmem.Loader(Stream(40), batch_size=2, tensors=False)
    with p, pinmem.Stream() as side:
        it = iter(p)
        x0, y0 = next(it)
        first = x0.ptr
        out = pinmem.empty(tuple(x0.shape), "float32")
        with Gate(side) as gate:
            c = pinmem.copy(out, x0, side)
            del x0, y0  # the batch is dropped; its block is still read by the copy
            for _ in range(6):
                x, y = next(it)
                assert x.ptr != first and y.ptr != first
                del x, y
            assert not c.done()
            gate.open()
            c.wait()
        np.testing.assert_array_equal(np.asarray(out), [[0, 0.5], [1, 1.5]])
        del c
        blocks = p.stats()["device_blocks"]
        reused = False
        for x, y in it:
            reused |= x.ptr == first
            del x, y
        assert reused and p.stats()["device_blocks"] == blocks == 2  # the copy's and one more


def test_reuse_waits_for_the_consumers_kernels_on_cuda():
    """GPU: the batches are read by kernels queued late on a side stream (after a sleep kernel)
    and dropped at once; the host runs ahead and later batches take the same blocks, but their
    copies wait for the side stream's reads, so every sum is its own batch's."""
    from conftest import skip_unless_torch_cuda
    skip_unless_torch_cuda()
    side = torch.cuda.Stream()
    sums = []
    with pinmem.Loader(Stream(64), batch_size=2) as p, torch.cuda.stream(side):
        for x, y in p:  # as_torch(): torch.from_dlpack names the current stream, `side`
            torch.cuda._sleep(1_000_000)  # the reads below run well after the host moved on
            sums.append(x.sum() + y.sum())
            del x, y
        allocations = p.stats()["device_allocations"]
    torch.cuda.synchronize()
    want = [float((8 * k + 3) + (4 * k + 1)) for k in range(32)]  # x: 2i + 0.5 each; y: i
    assert [float(s) for s in sums] == want
    assert allocations <= 3


def test_device_cache_refuses_what_it_cannot_copy():
    with pinmem.Stream() as s:
        cache = pinmem._pinmem._DeviceCache(s)
        with pytest.raises(TypeError, match="PinnedBuffer"):
            cache.batch([np.zeros(3)])
        with pytest.raises(TypeError):
            pinmem._pinmem._DeviceCache(None)
        src = pinmem.empty((4,), "int32")
        np.asarray(src)[:] = [5, 6, 7, 8]
        (d,) = cache.batch([src])
        assert isinstance(d, pinmem.DeviceBuffer) and d.shape == (4,)
        assert host(d).tolist() == [5, 6, 7, 8]
        cache.close()
        with pytest.raises(pinmem.StateError, match="freed"):
            cache.batch([src])
        assert cache.stats()["blocks"] == 1  # d's, freed when d goes
        del d
        assert cache.stats()["blocks"] == 0 and cache.stats()["frees"] == 1


def test_refusals_name_the_argument():
    ds = Stream()
    for kw, word in ((dict(shuffle=True), "shuffle"),
                     (dict(sampler=range(3)), "sampler"),
                     (dict(batch_sampler=[[0, 1]]), "batch_sampler"),
                     (dict(batch_size=None, drop_last=True), "drop_last")):
        with pytest.raises(ValueError):  # torch refuses these too
            DataLoader(ds, **kw)
        with pytest.raises(pinmem.InvalidError, match=word):
            pinmem.Loader(ds, **kw)
    for kw, word in ((dict(rank=0), "rank"), (dict(worker_mode="thread"), "worker_mode")):
        with pytest.raises(pinmem.InvalidError, match=word):  # pinmem's own arguments
            pinmem.Loader(ds, **kw)
    with pinmem.Loader(ds, device="cpu") as p:
        with pytest.raises(pinmem.InvalidError, match="state_dict"):
            p.state_dict()
        with pytest.raises(pinmem.InvalidError, match="load_state_dict"):
            p.load_state_dict({})
        with pytest.raises(pinmem.InvalidError, match="iterate the loader"):
            p.batches()


def test_len_as_dataloader():
    for kw in (dict(batch_size=3), dict(batch_size=3, drop_last=True), dict(batch_size=None)):
        t, p = both(Sized(10), **kw)
        with p:
            assert len(p) == len(t)
        t, p = both(Stream(10), **kw)
        with p:
            with pytest.raises(TypeError):
                len(t)
            with pytest.raises(TypeError):
                len(p)


class KillsItself(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        for i in range(6):
            if info.id == 1 and i == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            yield np.full(2, i, np.int64)


def test_a_worker_that_dies_raises_worker_error():
    with pinmem.Loader(KillsItself(), batch_size=2, num_workers=2, device="cpu") as p:
        got = []
        with pytest.raises(pinmem.WorkerError, match="worker process 1 .*SIGKILL"):
            for b in p:
                got.append(plain(b))
        assert got[0] == [[0, 0], [1, 1]]  # worker 0's first batch came before
        assert p.worker_pids() == []  # the others were stopped with it


class Hangs(IterableDataset):
    def __iter__(self):
        yield np.zeros(2)
        signal.pause()  # waits for a signal that never comes (the loader's stop ends it)


def test_timeout_and_close_stop_the_workers():
    # (2 s: room for the first batch on a loaded machine; the second never comes)
    p = pinmem.Loader(Hangs(), batch_size=1, num_workers=1, timeout=2, device="cpu")
    it = iter(p)
    next(it)
    with pytest.raises(pinmem.WorkerError, match="timeout=2 s"):
        next(it)
    with pinmem.Loader(Stream(100), batch_size=2, num_workers=2, device="cpu") as q:
        it = iter(q)
        next(it)
        pids = q.worker_pids()
        assert len(pids) == 2 and all(os.path.exists(f"/proc/{pid}") for pid in pids)
    assert q.worker_pids() == []
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    with pytest.raises(pinmem.StateError):
        next(it)
    p.close()


def test_loader_is_a_pinmem_loader():
    with pinmem.Loader(Stream(), device="cpu") as p:
        assert isinstance(p, pinmem.Loader)
        assert p.batch_size == 1 and p.sampler is None and p.num_workers == 0
        assert p.stats()["workers"] == "main"
        x, y = next(iter(p))  # a torch dataset: tensors, as a DataLoader loop expects
        assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
    with pinmem.Loader(Stream(), device="cpu", tensors=False) as p:
        assert isinstance(next(iter(p))[0], pinmem.Buffer)
    with pytest.raises(pinmem.InvalidError, match="tensors must be"):
        pinmem.Loader(Stream(), tensors="yes")


class Growing(IterableDataset):
    """Samples whose length grows every 2 samples: each batch of 2 has its own shape."""

    def __init__(self, step=2):
        self.step = step

    def __iter__(self):
        for i in range(6):
            yield np.full(i // self.step + 1, i, np.float32)


@pytest.mark.parametrize("nw", [0, 1])
def test_batches_may_differ_in_shape_their_samples_may_not(nw):
    t, p = both(Growing(), batch_size=2, num_workers=nw)
    with p:
        want = epoch(t)
        assert epoch(p) == want
    assert [len(b[0]) for b in want] == [1, 2, 3]
    t, p = both(Growing(step=1), batch_size=2, num_workers=nw)
    with p:
        with pytest.raises(RuntimeError):  # torch.stack refuses
            epoch(t)
        with pytest.raises(pinmem.InvalidError, match="sample 1, .*shape"):
            epoch(p)


class Halves(IterableDataset):
    def __iter__(self):
        for i in range(5):
            yield torch.full((2,), i + 0.5, dtype=torch.bfloat16), i


@pytest.mark.parametrize("nw", [0, 2])
@pytest.mark.parametrize("device", ["cpu", None])
def test_dtypes_numpy_lacks(nw, device):
    if device is None:
        skip_unless_torch_reads_the_device()
    t = DataLoader(Halves(), batch_size=2, num_workers=nw)
    with pinmem.Loader(Halves(), batch_size=2, num_workers=nw, device=device) as p:
        got = [(x.dtype, x.float().tolist(), y.tolist()) for x, y in p.as_torch()]
    assert got == [(x.dtype, x.float().tolist(), y.tolist()) for x, y in t]


def test_a_dropped_loader_stops_its_workers():
    p = pinmem.Loader(Stream(100), batch_size=2, num_workers=2, device="cpu",
                      persistent_workers=True)
    it = iter(p)
    batch = next(it)
    pids = p.worker_pids()
    assert len(pids) == 2
    del p, it  # no close(), no gc.collect(): nothing else holds the loader
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    assert plain(batch)[1] == [0, 2]  # the batch stays valid


def _fails_in_worker_1(wid):
    if wid == 1:
        raise OSError("no disk here")


def test_worker_init_fn_error_is_raised_once_and_the_worker_ends():
    """torch raises the error at the worker's first batch and then UnboundLocalError at each of
    its turns, without end; pinmem raises it once and goes on with the other workers."""
    want = [[[[0, 0.5], [2, 2.5]], [0, 2]], "OSError", [[[4, 4.5], [6, 6.5]], [4, 6]]]
    for persistent in (False, True):
        with pinmem.Loader(Stream(8), batch_size=2, num_workers=2, device="cpu",
                           worker_init_fn=_fails_in_worker_1,
                           persistent_workers=persistent) as p:
            assert outcomes(p) == want
            assert outcomes(p) == want  # each epoch says so again (the worker is not set up)


@pytest.mark.parametrize("nw", [0, 2])
def test_epochs_and_empty_streams(nw):
    with pinmem.Loader(Stream(8), batch_size=4, num_workers=nw, epochs=2, device="cpu") as p:
        assert p.epoch == 0
        assert [len(epoch(p)) for _ in range(3)] == [2, 2, 0]
        assert p.epoch == 2
    t, p = both(Stream(0), batch_size=2, num_workers=nw)
    with p:
        assert epoch(p) == epoch(t) == []


class Interrupts(IterableDataset):
    def __iter__(self):
        yield np.zeros(2)
        raise KeyboardInterrupt


def test_keyboard_interrupt_in_a_worker_is_a_worker_error():
    """Never a KeyboardInterrupt of the main program, which would look like the user's Ctrl-C."""
    with pinmem.Loader(Interrupts(), batch_size=1, num_workers=1, device="cpu") as p:
        it = iter(p)
        next(it)
        with pytest.raises(pinmem.WorkerError, match="KeyboardInterrupt"):
            next(it)


def test_close_from_another_thread_ends_a_waiting_next():
    import threading
    p = pinmem.Loader(Hangs(), batch_size=1, num_workers=1, device="cpu")
    it = iter(p)
    next(it)
    closer = threading.Timer(0.2, p.close)  # whether next() waits yet or not: StateError
    closer.start()
    with pytest.raises(pinmem.StateError):
        next(it)
    closer.join()  # (close() waits 5 s for the hung worker, as for any, then terminates it)
    assert p.worker_pids() == []


class Cycle:
    """Garbage with a __del__ (a torch DataLoader iterator left in a cycle, say)."""

    def __init__(self, path):
        self.me, self.path = self, path

    def __del__(self):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


class Collects(IterableDataset):
    def __iter__(self):
        gc.collect()  # as any allocation in the worker may, even inside an import
        yield np.zeros(2)


def test_the_parents_garbage_is_not_collected_in_workers(tmp_path):
    """A __del__ of the parent's uncollected garbage run in a forked worker, from inside an
    import, broke importlib's module lock there and killed the worker."""
    note = tmp_path / "deleted"
    gc.disable()
    try:
        Cycle(str(note))
        with pinmem.Loader(Collects(), batch_size=1, num_workers=2, device="cpu",
                           multiprocessing_context="fork") as p:
            assert len(epoch(p)) == 2
    finally:
        gc.enable()
    gc.collect()
    assert note.read_text().split() == [str(os.getpid())]  # once, here


class EmptyArrays(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([np.zeros((0, 2), np.float32)] * 3)


@pytest.mark.parametrize("nw", [0, 1])
def test_a_stream_of_empty_arrays_as_dataloader(nw):
    want = [tuple(b.shape) for b in DataLoader(EmptyArrays(), batch_size=2, num_workers=nw)]
    with pinmem.Loader(EmptyArrays(), batch_size=2, num_workers=nw, device="cpu") as p:
        assert [tuple(b.shape) for b in p] == want == [(2, 0, 2), (1, 0, 2)]


class Ragged(torch.utils.data.IterableDataset):
    def __iter__(self):
        return (np.ones(1 + i % 2) for i in range(4))


@pytest.mark.parametrize("nw", [0, 1])
def test_samples_that_do_not_stack_raise_a_runtime_error_as_dataloader(nw):
    with pytest.raises(RuntimeError):
        list(DataLoader(Ragged(), batch_size=2, num_workers=nw))
    with pinmem.Loader(Ragged(), batch_size=2, num_workers=nw, device="cpu") as p:
        with pytest.raises(RuntimeError, match="sample 1") as e:
            list(p)
        assert isinstance(e.value, pinmem.InvalidError)
