"""pinmem.Loader on whatever backend is in force (the host backend without a GPU)."""
import gc

import re

import numpy as np
import pytest

import pinmem
from conftest import SMALL


def host(a):
    """A batch array's contents as a NumPy array (copied out through pinmem)."""
    out = np.empty(a.shape, dtype=a.dtype)
    pinmem.copy(out, a).wait()
    return out


@pytest.fixture
def xy(rng):
    n = 1000 if not SMALL else 200
    X = rng.random((n, 3, 4), dtype=np.float32)
    Y = rng.integers(0, 1 << 40, size=n, dtype=np.int64)
    return X, Y


def epoch_of(loader):
    rows = []
    for b in loader.batches():
        x, y = host(b[0]), host(b[1])
        idx = np.frombuffer(b.indices, dtype=np.uint64).astype(np.int64)
        rows.append((b.epoch, b.index, idx, x, y))
    return rows


def test_array_dataset_in_order(xy):
    X, Y = xy
    loader = pinmem.Loader((X, Y), batch_size=64)
    assert len(loader) == -(-len(X) // 64)
    rows = epoch_of(loader)
    assert [r[1] for r in rows] == list(range(len(loader)))
    idx = np.concatenate([r[2] for r in rows])
    np.testing.assert_array_equal(idx, np.arange(len(X)))
    np.testing.assert_array_equal(np.concatenate([r[3] for r in rows]), X)
    np.testing.assert_array_equal(np.concatenate([r[4] for r in rows]), Y)
    assert rows[-1][3].shape[0] == len(X) % 64 or len(X) % 64 == 0
    assert rows[0][3].shape == (64, 3, 4) and rows[0][4].shape == (64,)


def test_shuffle_is_a_permutation_per_epoch_and_seeded(xy):
    X, Y = xy
    loader = pinmem.Loader((X, Y), batch_size=50, shuffle=True, seed=7, num_workers=2)
    e0 = epoch_of(loader)
    e1 = epoch_of(loader)
    assert {r[0] for r in e0} == {0} and {r[0] for r in e1} == {1}
    o0 = np.concatenate([r[2] for r in e0])
    o1 = np.concatenate([r[2] for r in e1])
    assert sorted(o0) == list(range(len(X))) and sorted(o1) == list(range(len(X)))
    assert not np.array_equal(o0, o1) and not np.array_equal(o0, np.arange(len(X)))
    for r in e0:
        np.testing.assert_array_equal(r[3], X[r[2]])
        np.testing.assert_array_equal(r[4], Y[r[2]])
    again = pinmem.Loader((X, Y), batch_size=50, shuffle=True, seed=7)
    np.testing.assert_array_equal(np.concatenate([r[2] for r in epoch_of(again)]), o0)
    other = pinmem.Loader((X, Y), batch_size=50, shuffle=True, seed=8)
    assert not np.array_equal(np.concatenate([r[2] for r in epoch_of(other)]), o0)


def test_drop_last_and_epochs(xy):
    X, Y = xy
    bs = len(X) * 3 // 10
    loader = pinmem.Loader((X, Y), batch_size=bs, drop_last=True, epochs=2)
    assert len(loader) == len(X) // bs
    n = 0
    for x, y in loader:
        assert x.shape[0] == bs
        n += 1
    for x, y in loader:
        n += 1
    assert n == 2 * (len(X) // bs)
    assert list(loader) == []  # both epochs delivered


def test_single_array_yields_arrays(rng):
    X = rng.integers(0, 255, size=(100, 16), dtype=np.uint8)
    loader = pinmem.Loader(X, batch_size=32)
    got = [host(x) for x in loader]
    np.testing.assert_array_equal(np.concatenate(got), X)


def test_host_delivery_is_zero_copy_pinned(xy):
    X, Y = xy
    loader = pinmem.Loader((X, Y), batch_size=100, device="cpu")
    assert loader.device == "cpu"
    n = 0
    for b in loader.batches():
        a = np.asarray(b[0])  # host memory: the buffer protocol works, no copy
        assert a.__array_interface__["data"][0] == b[0].ptr
        assert pinmem.pointer_info(b[0].ptr)["kind"] == "pool"
        idx = np.frombuffer(b.indices, dtype=np.uint64).astype(np.int64)
        np.testing.assert_array_equal(a, X[idx])
        np.testing.assert_array_equal(np.from_dlpack(b[1]), Y[idx])
        n += len(idx)
    assert n == len(X)


def test_state_dict_resume(xy):
    X, Y = xy
    kw = dict(batch_size=len(X) // 14, shuffle=True, seed=3)
    ref = pinmem.Loader((X, Y), **kw)
    full = epoch_of(ref) + epoch_of(ref)
    loader = pinmem.Loader((X, Y), **kw)
    it = loader.batches()
    for _ in range(5):
        b = next(it)
    del b
    it.close()
    gc.collect()
    state = loader.state_dict()
    assert state["epoch"] == 0 and state["batch"] == 5
    loader.close()
    resumed = pinmem.Loader((X, Y), **kw)
    resumed.load_state_dict(state)
    rest = epoch_of(resumed) + epoch_of(resumed)
    assert len(rest) == len(full) - 5
    for a, b in zip(rest, full[5:]):
        assert a[:2] == b[:2]
        np.testing.assert_array_equal(a[2], b[2])
        np.testing.assert_array_equal(a[3], b[3])
    bad = dict(state, seed=4)
    with pytest.raises(pinmem.InvalidError):
        resumed.load_state_dict(bad)


def test_iterators_hold_no_batch(xy):
    """An epoch iterator keeps no reference to the batch it returned (a generator would, and on
    Python 3.12 even after close()), so dropping the batch gives its slot back at once."""
    import weakref
    X, Y = xy
    loader = pinmem.Loader((X, Y), batch_size=100)
    it = loader.batches()
    b = next(it)
    ref = weakref.ref(b[0])
    del b
    assert ref() is None
    b = next(it)
    it.close()
    with pytest.raises(StopIteration):
        next(it)
    del b
    loader.close()  # no batch alive: no BusyError
    plain = pinmem.Loader(X, batch_size=100)
    it = iter(plain)
    ref = weakref.ref(next(it))
    assert ref() is None
    assert 1 + sum(1 for _ in it) == len(plain)
    plain.close()


def test_held_batches_stay_valid_and_busy_only_past_the_budget(rng):
    # As torch: any number of batches may be held (list(loader), the last epoch's x, y); the
    # ring takes new slots from the pool for the ones held.
    X = rng.random((64, 8))
    loader = pinmem.Loader(X, batch_size=4, prefetch_factor=2, num_workers=1, device="cpu")
    assert loader.stats()["prefetch"] == 2
    held = list(loader)
    assert len(held) == 16
    np.testing.assert_array_equal(np.concatenate([host(b) for b in held]), X)
    again = list(loader)  # a second epoch while the first is still held
    np.testing.assert_array_equal(np.concatenate([host(b) for b in again]), X)
    np.testing.assert_array_equal(np.concatenate([host(b) for b in held]), X)
    del held, again
    gc.collect()
    assert loader.stats()["held"] == 0
    loader.close()
    # Past the budget: BusyError naming what is held, and what to do. (Slots of 2 MiB, so each
    # new one needs new pinned memory rather than room in a segment already pinned.)
    X = rng.random((32, 65536))
    loader = pinmem.Loader(X, batch_size=4, prefetch_factor=2, num_workers=1, device="cpu")
    budget = pinmem.budget()
    pinmem.trim()
    pinmem.set_budget(max(pinmem.stats()["pinned_bytes"], 1))
    try:
        held = []
        with pytest.raises(pinmem.BusyError) as e:
            for b in loader.batches():
                held.append(b)
        assert e.value.status == "PM_ERR_BUSY"
        assert "still holds" in str(e.value) and "budget" in str(e.value), str(e.value)
        assert len(held) >= 1
    finally:
        pinmem.set_budget(budget)
    held.clear()
    del b
    gc.collect()
    assert loader.stats()["held"] == 0
    rest = [host(x) for x in loader]  # a new loop is a new epoch, as torch's
    np.testing.assert_array_equal(np.concatenate(rest), X)
    loader.close()


def test_batch_outlives_loader_object(rng):
    X = rng.random((40, 5))
    loader = pinmem.Loader(X, batch_size=10)
    x = next(iter(loader))
    del loader
    gc.collect()
    np.testing.assert_array_equal(host(x), X[:10])  # the C loader lives while its batch does


def test_npy_files(tmp_path, rng):
    a = rng.random((30, 6), dtype=np.float32)
    b = rng.random((20, 6), dtype=np.float32)
    pa, pb = tmp_path / "a.npy", tmp_path / "b.npy"
    np.save(pa, a)
    np.save(pb, b)
    loader = pinmem.Loader([pa, pb], batch_size=16)
    got = np.concatenate([host(x) for x in loader])
    np.testing.assert_array_equal(got, np.concatenate([a, b]))
    mm = pinmem.Loader(pinmem.NpyDataset(str(pa), io="mmap"), batch_size=7)
    np.testing.assert_array_equal(np.concatenate([host(x) for x in mm]), a)
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"not a numpy file at all")
    with pytest.raises(pinmem.FormatError) as e:
        pinmem.Loader(bad, batch_size=4)
    assert e.value.status == "PM_ERR_FORMAT"
    with pytest.raises(pinmem.IoError):
        pinmem.Loader(tmp_path / "missing.npy", batch_size=4)


def test_token_dataset(tmp_path, rng):
    tokens = rng.integers(0, 50000, size=5000, dtype=np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    loader = pinmem.Loader(pinmem.TokenDataset(path, seq_len=32, random=False), batch_size=8)
    n = 0
    for x, y in loader:
        xi, yi = host(x), host(y)
        assert xi.shape == (8, 32) or xi.shape[0] < 8
        np.testing.assert_array_equal(xi[:, 1:], yi[:, :-1])  # targets: inputs shifted by one
        for row in xi:
            start = int(np.flatnonzero((tokens[:-32] == row[0]))[0])
            assert start >= 0
        n += len(xi)
    assert n == (5000 - 1) // 32


def test_token_dataset_arguments_are_checked_by_name(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    # windows=-1 wrapped to 2**64-1 windows (an epoch without end), 2**64 to 0 (the default),
    # and a negative stride was reported as seq_len.
    for kw, what in ((dict(windows=-1), "windows"), (dict(windows=1 << 64), "windows"),
                     (dict(windows=1.5), "windows"), (dict(stride=-1), "stride"),
                     (dict(stride=1 << 63), "stride"), (dict(seq_len=0), "seq_len")):
        with pytest.raises(pinmem.InvalidError, match=f"{what} must be"):
            pinmem.TokenDataset(path, **({"seq_len": 8} | kw))
    with pinmem.Loader(pinmem.TokenDataset(path, 8, windows=np.uint64(5), seed=-1),
                       batch_size=1, device="cpu") as loader:
        assert len(loader) == 5


def test_npy_dtype_names_and_long_structured_dtypes(tmp_path):
    np.save(tmp_path / "f.npy", np.arange(12, dtype=np.float32).reshape(6, 2))
    for dt in ("float32", np.float32, np.dtype("<f4"), "f4", "<f4"):
        with pinmem.Loader(pinmem.NpyDataset(tmp_path / "f.npy", dtype=dt), batch_size=3,
                           device="cpu") as loader:  # 'float32' was an "unknown dtype"
            assert len(loader) == 2
    with pytest.raises(pinmem.FormatError, match="expected <i4"):
        pinmem.Loader(pinmem.NpyDataset(tmp_path / "f.npy", dtype="int32"), device="cpu")
    # A structured dtype whose text passes 127 characters was cut there: two files of
    # different fields compared equal (the second's int32 read as float32).
    names = [f"field_with_a_rather_long_name_{k}" for k in range(5)]
    a = np.zeros(3, [(n, "<f4") for n in names])
    b = np.zeros(2, [(n, "<f4") for n in names[:-1]] + [(names[-1], "<i4")])
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    for paths in ([tmp_path / "a.npy"], [tmp_path / "a.npy", tmp_path / "b.npy"]):
        with pytest.raises(pinmem.FormatError, match="structured dtype of more than 127"):
            pinmem.Loader(pinmem.NpyDataset(paths), batch_size=5, device="cpu")


def test_a_0d_array_is_not_a_dataset():
    torch = pytest.importorskip("torch")
    for a in (np.array(3.0), torch.tensor(3.0), (np.array(1), np.array(2))):
        with pytest.raises(pinmem.InvalidError, match="0-d array has no sample axis"):
            pinmem.Loader(a, batch_size=2, device="cpu")  # was one batch of shape (1,)


class MapDataset:
    def __init__(self, X, Y, fail_at=None):
        self.X, self.Y, self.fail_at = X, Y, fail_at

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        if i == self.fail_at:
            raise KeyError(f"sample {i} is broken")
        return self.X[i].tolist(), int(self.Y[i])


def test_python_map_dataset(rng):
    X = rng.random((90, 4))
    Y = rng.integers(0, 10, size=90)
    loader = pinmem.Loader(MapDataset(X, Y), batch_size=20, shuffle=True, seed=1)
    seen = []
    # A sample ([4 floats], int) is batched as default_collate does: a list of 4 columns
    # (float64) and the labels (int64); batches() gives the 5 arrays flat.
    for b in loader.batches():
        idx = np.frombuffer(b.indices, dtype=np.uint64).astype(np.int64)
        assert len(b) == 5
        for k in range(4):
            np.testing.assert_array_equal(host(b[k]), X[idx, k])
        np.testing.assert_array_equal(host(b[4]), Y[idx])
        assert host(b[4]).shape == (len(idx),) and host(b[4]).dtype == np.int64
        seen.extend(idx)
    assert sorted(seen) == list(range(90))
    cols, labels = next(iter(pinmem.Loader(MapDataset(X, Y), batch_size=20, device="cpu")))
    assert isinstance(cols, list) and len(cols) == 4
    np.testing.assert_array_equal(np.asarray(cols[2]), X[:20, 2])
    np.testing.assert_array_equal(np.asarray(labels), Y[:20])


def test_python_dataset_error_propagates(rng):
    X = rng.random((40, 4))
    loader = pinmem.Loader(MapDataset(X, np.zeros(40), fail_at=25), batch_size=10)
    it = iter(loader)
    first = [next(it), next(it)]  # batches before the broken one still arrive
    assert len(first) == 2
    with pytest.raises(KeyError) as e:
        for _ in range(3):
            next(it)
    assert "sample 25 is broken" in str(e.value)
    assert isinstance(e.value.__cause__, pinmem.Error)
    # As torch: the next next() gives the batch after the broken one, and the epoch ends there.
    last = next(it)
    np.testing.assert_array_equal(np.stack([host(a) for a in last[0]], axis=1), X[30:40])
    with pytest.raises(StopIteration):
        next(it)


def test_bad_arguments(rng):
    X = rng.random((10, 2))
    with pytest.raises(pinmem.InvalidError):
        pinmem.Loader(X, batch_size=0)
    with pytest.raises(pinmem.InvalidError):
        pinmem.Loader(X, batch_size=2, device="tpu")
    with pytest.raises(TypeError):
        pinmem.Loader(object(), batch_size=2)
    with pytest.raises(pinmem.InvalidError):
        pinmem.Loader((X, X[:5]), batch_size=2)


def test_copy_from_batch_orders_after_its_copy(rng):
    X = rng.random((256, 64))
    loader = pinmem.Loader(X, batch_size=128, prefetch_factor=2)
    s = pinmem.Stream()
    out = pinmem.empty((128, 64), "float64")
    for i, x in enumerate(loader):
        pinmem.copy(out, x, s).wait()
        np.testing.assert_array_equal(np.asarray(out), X[i * 128:(i + 1) * 128])


def test_training_loop_learns_numpy(rng):
    """Logistic regression fed by the loader: the loss must fall well below its start."""
    n, d = 2000 if not SMALL else 400, 10
    w_true = rng.normal(size=d)
    X = rng.normal(size=(n, d)).astype(np.float32)
    Y = (X @ w_true > 0).astype(np.float32)
    loader = pinmem.Loader((X, Y), batch_size=100, shuffle=True, seed=0)
    w = np.zeros(d)

    def loss(w):
        p = 1 / (1 + np.exp(-(X @ w)))
        return -np.mean(Y * np.log(p + 1e-9) + (1 - Y) * np.log(1 - p + 1e-9))
    start = loss(w)
    for epoch in range(5):
        for x, y in loader:
            xb, yb = host(x).astype(np.float64), host(y)
            p = 1 / (1 + np.exp(-(xb @ w)))
            w -= 0.5 * xb.T @ (p - yb) / len(yb)
    assert loss(w) < 0.5 * start
    assert loader.epoch == 5


# ---- one loader for all fields, and what a user can get wrong ----------------------------------

def test_tuple_of_npy_paths_is_one_loader_of_fields(tmp_path, rng):
    X = rng.random((50, 3, 2), dtype=np.float32)
    Y = rng.integers(0, 9, size=50, dtype=np.int16)
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "Y.npy", Y)
    loader = pinmem.Loader((tmp_path / "X.npy", tmp_path / "Y.npy"), batch_size=16,
                           shuffle=True, seed=3)
    st = loader.stats()
    assert st["fields"] == 2
    # One slot per batch holds both fields (X rows, 256-aligned, then Y rows).
    assert st["slot_bytes"] >= 16 * (24 + 2)
    n = 0
    for b in loader.batches():
        idx = np.frombuffer(b.indices, dtype=np.uint64).astype(np.int64)
        np.testing.assert_array_equal(host(b[0]), X[idx])
        np.testing.assert_array_equal(host(b[1]), Y[idx])
        n += len(idx)
    assert n == 50
    loader.close()


class RandomAugmented:
    """x and y come from one random draw per call; counts the calls."""

    def __init__(self, n):
        import threading
        self.n, self.calls = n, 0
        self.rng = np.random.default_rng(5)
        self.lock = threading.Lock()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with self.lock:
            self.calls += 1
            draw = int(self.rng.integers(0, 1 << 30))
        return np.full(4, draw, dtype=np.int64), np.int64(draw), np.int64(i)


def test_map_dataset_is_called_once_per_sample(rng):
    n = 300 if not SMALL else 60
    ds = RandomAugmented(n)
    # Threads: the calls are counted in this process (worker processes count their own).
    loader = pinmem.Loader(ds, batch_size=32, shuffle=True, seed=2, num_workers=3,
                           device="cpu", epochs=1, worker_mode="thread")
    rows = 0
    for x, y, i in loader:
        x, y, i = np.asarray(x), np.asarray(y), np.asarray(i)
        assert (x == y[:, None]).all()  # every field of a row from the same call
        rows += len(y)
    assert rows == n
    assert ds.calls == n + 1  # once per sample, and once for sample 0 to learn the fields
    loader.close()


def test_two_threads_in_next(rng):
    import threading

    class Slow:
        def __len__(self):
            return 64

        def __getitem__(self, i):
            import time
            time.sleep(0.002)
            return np.full(3, i, dtype=np.int32)

    for _ in range(3 if SMALL else 8):
        loader = pinmem.Loader(Slow(), batch_size=8, num_workers=1, device="cpu")
        out = []

        def take():
            try:
                out.append(loader._next())
            except pinmem.Error as e:
                out.append(e)
        threads = [threading.Thread(target=take, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a consumer hung in next()"
        got = [b for b in out if isinstance(b, pinmem.Batch)]
        busy = [e for e in out if isinstance(e, pinmem.BusyError)]
        assert len(got) + len(busy) == 2 and got
        assert len({b.index for b in got}) == len(got)  # never the same batch twice
        for b in got:  # each batch holds the rows its indices name, and they are its own
            assert list(b.indices) == list(range(8 * b.index, 8 * b.index + 8))
            np.testing.assert_array_equal(np.asarray(b[0]),
                                          np.repeat(np.asarray(b.indices, np.int32)[:, None], 3,
                                                    axis=1))
        del got, out
        loader.close()


def test_a_batch_whose_samples_differ_is_refused_and_the_next_batch_follows():
    class Drifting:
        def __len__(self):
            return 20

        def __getitem__(self, i):
            x = np.arange(3) if i < 13 else np.arange(3) + 0.5  # int64, then float64
            return x, np.int64(i)
    with pinmem.Loader(Drifting(), batch_size=5, device="cpu") as loader:
        it = iter(loader)
        assert [np.asarray(next(it)[1]).tolist() for _ in range(2)] == [list(range(5)),
                                                                        list(range(5, 10))]
        with pytest.raises(pinmem.InvalidError) as e:  # batch 2: rows 10-12 int64, 13-14 float64
            next(it)
        msg = str(e.value)
        assert isinstance(e.value, RuntimeError)
        assert re.search(r"field \[0\] has shape \(3,\) dtype float64 at dataset index 1[34] "
                         r"and shape \(3,\) dtype int64 at dataset index 1[0-2]", msg), msg
        x, y = next(it)  # batch 3: every sample float64, as the batch stacks them
        assert np.asarray(x).dtype == np.float64 and np.asarray(y).tolist() == [15, 16, 17, 18, 19]
        np.testing.assert_array_equal(np.asarray(x), np.arange(3) + 0.5 + np.zeros((5, 1)))

    class Reshaped(Drifting):
        def __getitem__(self, i):
            return np.zeros((2, 2) if i == 7 else (4,), np.float32), np.int64(i)
    with pytest.raises(pinmem.InvalidError) as e:
        for _ in pinmem.Loader(Reshaped(), batch_size=5, device="cpu"):
            pass
    assert "index 7" in str(e.value) and "(2, 2)" in str(e.value)


def test_object_and_sizeless_dtypes_are_refused():
    objs = np.array([object() for _ in range(8)], dtype=object)
    with pytest.raises(pinmem.InvalidError) as e:
        pinmem.Loader(objs, batch_size=2)
    assert "object" in str(e.value)
    with pytest.raises(pinmem.InvalidError):
        pinmem.Loader((np.zeros(8), objs), batch_size=2)

    class Objects:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.array([None, i], dtype=object)
    loader = pinmem.Loader(Objects(), batch_size=2)  # a Python dataset: read when iterated
    with pytest.raises(pinmem.InvalidError):
        next(iter(loader))
    loader.close()


MASKED = np.ma.masked_array(np.arange(12, dtype=np.float32).reshape(4, 3),
                            mask=np.eye(4, 3, dtype=bool))


class MaskedSamples:
    """Sample i: row i of MASKED, a masked array (alone, or as field "x" of a dict)."""

    def __init__(self, in_dict=False):
        self.in_dict = in_dict

    def __len__(self):
        return len(MASKED)

    def __getitem__(self, i):
        return {"x": MASKED[i]} if self.in_dict else MASKED[i]


@pytest.mark.parametrize("nw", [0, 2])
@pytest.mark.parametrize("batch_size", [None, 2])
def test_masked_arrays_are_refused_batched_or_not(nw, batch_size):
    # A batch holds the arrays' bytes, with no place for the mask: the masked elements came out
    # as valid values, unseen (with batch_size=None too). Refused, whatever the batching.
    with pytest.raises(pinmem.InvalidError, match="masked array.*cannot leave masked elements"):
        pinmem.Loader(MASKED, batch_size=batch_size, num_workers=nw, device="cpu")
    for in_dict in (False, True):
        with pinmem.Loader(MaskedSamples(in_dict), batch_size=batch_size, num_workers=nw,
                           device="cpu") as loader:
            with pytest.raises(pinmem.InvalidError,
                               match=r"index 0, field .*masked array.*cannot leave masked"):
                next(iter(loader))
    # A collate_fn's masked array arrives as it is, mask and all (not its bytes alone).
    collate = (lambda x: x) if batch_size is None else np.ma.stack
    with pinmem.Loader(MaskedSamples(), batch_size=batch_size, num_workers=nw, device="cpu",
                       collate_fn=collate) as loader:
        got = list(loader)
    want = [MASKED[i] for i in range(4)] if batch_size is None else [MASKED[:2], MASKED[2:]]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert isinstance(g, np.ma.MaskedArray)
        assert np.array_equal(np.ma.getmaskarray(g), np.ma.getmaskarray(w))
        assert np.array_equal(g.data, w.data)


@pytest.mark.parametrize("dtype", [">f4", "<U10", "<M8[s]", [("a", "<i4"), ("b", ">f8")]])
def test_dtypes_without_a_code_keep_their_dtype(tmp_path, rng, dtype):
    dt = np.dtype(dtype)
    raw = rng.integers(0, 1000, size=40)
    if dt.kind == "U":
        a = np.array([f"s{v}" for v in raw], dtype=dt)
    elif dt.names:
        a = np.zeros(40, dtype=dt)
        a["a"], a["b"] = raw, raw / 7
    else:
        a = raw.astype(dt)
    np.save(tmp_path / "a.npy", a)
    for source in (tmp_path / "a.npy", (a, raw)):
        loader = pinmem.Loader(source, batch_size=16, device="cpu", shuffle=True, seed=1)
        n = 0
        for b in loader.batches():
            got = b[0]
            idx = np.frombuffer(b.indices, dtype=np.uint64).astype(np.int64)
            assert isinstance(got, np.ndarray) and got.dtype == dt and got.shape == (len(idx),)
            np.testing.assert_array_equal(got, a[idx])
            n += len(idx)
        assert n == 40
        loader.close()
        with pytest.raises(pinmem.InvalidError) as e:
            pinmem.Loader(source, batch_size=16)  # to the device: no DLPack type for it
        assert "device='cpu'" in str(e.value)


class _Rows:
    """A Python dataset over an array (the loader reads it each epoch, not as an array)."""

    def __init__(self, x):
        self.x = x

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i]


@pytest.mark.parametrize("python_dataset", [False, True])
def test_rank_and_world_size_are_checked(rng, monkeypatch, python_dataset):
    X = rng.random((16, 2))
    ds = _Rows(X) if python_dataset else X

    def first(**kw):  # a Python dataset's first epoch opens at the first batch
        loader = pinmem.Loader(ds, batch_size=4, device="cpu", **kw)
        try:
            return loader, next(iter(loader))
        except BaseException:
            loader.close()
            raise
    for kw in (dict(rank=-5), dict(world_size=0), dict(world_size=-1), dict(rank=1.5)):
        with pytest.raises(pinmem.InvalidError):
            first(**kw)
    with pytest.raises(pinmem.InvalidError, match="rank 2 is not in 0..1"):
        first(rank=2, world_size=2)
    monkeypatch.setenv("WORLD_SIZE", "0")
    with pytest.raises(pinmem.ConfigError, match="WORLD_SIZE='0'"):
        first()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "-5")
    with pytest.raises(pinmem.ConfigError, match="RANK='-5'"):
        first()
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(pinmem.InvalidError, match="rank 2 is not in 0..1"):
        first()
    monkeypatch.setenv("RANK", "1")
    loader, b = first()
    assert loader.state_dict()["rank"] == 1 and loader.state_dict()["world_size"] == 2
    np.testing.assert_array_equal(np.asarray(b), X[[1, 3, 5, 7]])  # rank 1 of 2: odd indices
    assert len(loader) == 2
    loader.close()


def test_refused_state_leaves_the_loader_working(xy):
    X, Y = xy
    loader = pinmem.Loader((X, Y), batch_size=50, shuffle=True, seed=7)
    other = pinmem.Loader((X, Y), batch_size=50, shuffle=True, seed=8)
    foreign = other.state_dict()
    other.close()
    it = loader.batches()
    held = next(it)  # a batch alive through the refused load
    want = loader.state_dict()
    with pytest.raises(pinmem.InvalidError) as e:
        loader.load_state_dict(foreign)
    assert "seed" in str(e.value)
    assert loader.state_dict() == want and len(loader) == len(X) // 50
    b = next(it)  # the iterator goes on where it was
    assert b.index == 1
    idx = np.frombuffer(b.indices, dtype=np.uint64).astype(np.int64)
    np.testing.assert_array_equal(host(b[1]), Y[idx])
    np.testing.assert_array_equal(host(held[0]),
                                  X[np.frombuffer(held.indices, dtype=np.uint64).astype(np.int64)])
    # A valid state with a batch held: the loader moves there.
    loader.load_state_dict(dict(want, batch=3))
    assert next(iter(loader.batches())).index == 3
    del b, held
    loader.close()
    for op in (len, iter, lambda ld: ld._next(), lambda ld: ld.state_dict(),
               lambda ld: ld.load_state_dict(want), lambda ld: ld.stats()):
        with pytest.raises(pinmem.StateError) as e:
            op(loader)
        assert "closed" in str(e.value)
    loader.close()  # twice: harmless


def test_a_state_of_another_configuration_names_the_field():
    # A state past the other loader's last batch was refused as "resume state batch 2, an
    # epoch has 2" (or "flags 0 vs 2"), naming neither drop_last nor shuffle.
    x = np.arange(10, dtype=np.float32)
    with pinmem.Loader(x, batch_size=4, device="cpu") as a:
        it = iter(a)
        next(it), next(it)
        st = a.state_dict()
    for kw, field in ((dict(drop_last=True), "drop_last 0, this loader has 1"),
                      (dict(shuffle=True, seed=1), "shuffle 0, this loader has 1")):
        with pinmem.Loader(x, batch_size=4, device="cpu", **kw) as b:
            with pytest.raises(pinmem.InvalidError, match=f"saved with {field}"):
                b.load_state_dict(st)


def test_close_with_batches_alive_returns_memory(xy):
    X, Y = xy
    gc.collect()
    before = pinmem.stats()["in_use_bytes"]
    loader = pinmem.Loader((X, Y), batch_size=100, shuffle=True, prefetch_factor=2,
                           num_workers=2)
    assert pinmem.stats()["in_use_bytes"] > before
    for x, y in loader:  # as a training loop with .as_torch() does
        break
    it = loader.batches()
    z = next(it)
    loader.close()  # no BusyError: x, y and z are alive
    assert host(y).shape == (100,) and host(x).shape == (100, 3, 4)  # still valid after close
    idx = np.frombuffer(z.indices, dtype=np.uint64).astype(np.int64)
    np.testing.assert_array_equal(host(z[0]), X[idx])  # still valid after close
    assert pinmem.stats()["in_use_bytes"] > before
    del x, y
    gc.collect()
    assert pinmem.stats()["in_use_bytes"] > before  # z still holds its slot
    del z, it
    gc.collect()
    assert pinmem.stats()["in_use_bytes"] == before
    with pinmem.Loader((X, Y), batch_size=100) as ld:
        kept = next(iter(ld))
    del kept
    gc.collect()
    assert pinmem.stats()["in_use_bytes"] == before


# ---- where a training loop's time goes ---------------------------------------------------------

def test_stats_account_for_time_outside_next(xy):
    """stats() splits the iterators' time into the library's next(), the conversion of the
    arrays and Python's glue; a slow conversion shows as conversion, not as next() or glue."""
    import time
    X, Y = xy
    loader = pinmem.Loader((X, Y), batch_size=100, epochs=2)
    st = loader.stats()
    assert st["conversion_seconds"] == st["iteration_seconds"] == st["glue_seconds"] == 0.0
    for x, y in loader:  # plain iteration converts nothing
        host(x), host(y)
    del x, y  # the last batch's slot goes back
    st = loader.stats()
    assert st["conversion_seconds"] == 0.0
    assert st["iteration_seconds"] >= st["next_seconds"] > 0
    assert st["glue_seconds"] == pytest.approx(st["iteration_seconds"] - st["next_seconds"])

    calls = []

    def slow_convert(a):  # as torch.from_dlpack in as_torch(), with a known cost
        calls.append(a.shape)  # (not the array: it would hold the batch's slot)
        time.sleep(0.002)
        return host(a)

    before = loader.stats()
    it = pinmem.loader._EpochIterator(loader, "torch", slow_convert)  # what as_torch() returns
    rows = sum(len(x) for x, y in it)
    assert rows == len(X) and len(calls) == 2 * len(loader)
    st = loader.stats()
    conv = st["conversion_seconds"]
    assert conv >= 0.002 * len(calls)  # each conversion slept that long, at least
    assert st["iteration_seconds"] - before["iteration_seconds"] >= conv + \
        (st["next_seconds"] - before["next_seconds"])
    assert st["glue_seconds"] == pytest.approx(
        st["iteration_seconds"] - st["next_seconds"] - conv)
    assert st["batches"] == 2 * len(loader)

    # A new position starts the counters again, the library's and these.
    loader.load_state_dict(loader.state_dict() | {"epoch": 0, "batch": 0})
    st = loader.stats()
    assert st["batches"] == 0 and st["iteration_seconds"] == st["conversion_seconds"] == 0.0
    loader.close()
