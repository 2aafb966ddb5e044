"""pinmem.Loader beside torch.utils.data.DataLoader: the habits of DataLoader users, run side by
side on the same dataset and arguments (host backend, batches in host memory), each comparing
the samples delivered. Differences that remain are refused with a message naming the argument.
"""
import numpy as np
import re

import pytest

import pinmem

torch = pytest.importorskip(
    "torch", reason="torch is not installed (pip install torch; CI installs the CPU build): the "
    "side-by-side comparisons with DataLoader did not run")
from torch.utils.data import DataLoader  # noqa: E402


class Indexed(torch.utils.data.Dataset):
    """Sample i: (float32 [i, i], int64 i)."""

    def __init__(self, n=20, fail_at=None):
        self.n, self.fail_at = n, fail_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise KeyError(f"sample {i} is broken")
        if not 0 <= i < self.n:
            raise IndexError(i)
        return np.full(2, i, dtype=np.float32), i


def labels(batch):
    return [int(v) for v in np.asarray(batch[1])]


def run(loader, stop_after=None):
    """The labels of one loop over loader (stopping after stop_after batches)."""
    out = []
    for k, b in enumerate(loader):
        out.append(labels(b))
        if stop_after is not None and k + 1 >= stop_after:
            break
    return out


def both(**kw):
    ds = kw.pop("dataset", None) or Indexed()
    return DataLoader(ds, **kw), pinmem.Loader(ds, device="cpu", **kw)


@pytest.mark.parametrize("nw", [0, 2])
def test_a_loop_after_break_is_a_new_epoch(nw):
    t, p = both(batch_size=4, num_workers=nw)
    with p:
        for loader in (t, p):
            assert run(loader, stop_after=2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert run(t) == run(p) == [list(range(k, k + 4)) for k in range(0, 20, 4)]


def test_peeking_with_next_iter_gives_the_first_batch_each_time():
    t, p = both(batch_size=5)
    with p:
        for _ in range(3):
            assert labels(next(iter(t))) == labels(next(iter(p))) == [0, 1, 2, 3, 4]


def test_shuffle_follows_torch_manual_seed():
    ds = Indexed()
    orders = []
    for _ in range(2):
        torch.manual_seed(1234)
        with pinmem.Loader(ds, batch_size=20, shuffle=True, device="cpu") as p:
            orders.append((run(p), run(p)))
    assert orders[0] == orders[1]  # the same torch seed, the same epochs
    assert orders[0][0] != orders[0][1]  # and each epoch reshuffled
    torch.manual_seed(99)
    with pinmem.Loader(ds, batch_size=20, shuffle=True, device="cpu") as p:
        assert run(p) != orders[0][0]


def test_set_epoch_on_the_loaders_sampler_is_honoured():
    ds = Indexed()
    make = lambda: torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=1, seed=5)  # noqa
    t = DataLoader(ds, batch_size=4, sampler=make())
    with pinmem.Loader(ds, batch_size=4, sampler=make(), device="cpu") as p:
        for epoch in range(3):
            t.sampler.set_epoch(epoch)
            p.sampler.set_epoch(epoch)
            assert run(p) == run(t)
            assert len(p) == len(t)


@pytest.mark.parametrize("nw", [0, 2])
def test_an_error_in_getitem_is_raised_at_its_batch_and_the_next_batch_follows(nw):
    results = []
    for make in (DataLoader, lambda *a, **k: pinmem.Loader(*a, device="cpu", **k)):
        loader = make(Indexed(fail_at=9), batch_size=4, num_workers=nw)
        it = iter(loader)
        got = [labels(next(it)), labels(next(it))]
        with pytest.raises(KeyError, match="sample 9 is broken"):
            next(it)
        got += [labels(b) for b in it]
        results.append(got)
        if isinstance(loader, pinmem.Loader):
            loader.close()
    assert results[0] == results[1] == [[0, 1, 2, 3], [4, 5, 6, 7], [12, 13, 14, 15],
                                        [16, 17, 18, 19]]


def test_attributes_users_read_are_dataloaders():
    ds = Indexed()
    kw = dict(batch_size=3, num_workers=2, drop_last=True, timeout=5, prefetch_factor=3,
              persistent_workers=True, pin_memory=True)
    t = DataLoader(ds, **kw)
    with pinmem.Loader(ds, device="cpu", **kw) as p:
        for name in ("dataset", "batch_size", "num_workers", "drop_last", "timeout",
                     "prefetch_factor", "persistent_workers", "pin_memory", "generator",
                     "collate_fn" if False else "worker_init_fn"):
            assert getattr(p, name) == getattr(t, name), name
        assert p.batch_sampler is None and p.sampler is None and p.collate_fn is None
        assert len(p) == len(t) == 6


@pytest.mark.parametrize("device", [torch.device("cpu"), "cpu"])
def test_device_as_torch_device(device):
    with pinmem.Loader(Indexed(), batch_size=10, device=device) as p:
        assert run(p) == [list(range(10)), list(range(10, 20))]
        assert p.device == "cpu"


@pytest.mark.parametrize("nw", [0, 2])
def test_tuple_samples_collate_to_lists(nw):
    t, p = both(batch_size=4, num_workers=nw)
    with p:
        tb, pb = next(iter(t)), next(iter(p))
        assert type(tb) is type(pb) is list and len(tb) == len(pb) == 2
        np.testing.assert_array_equal(np.asarray(pb[0]), tb[0].numpy())
    tensors = torch.utils.data.TensorDataset(torch.arange(6), torch.arange(6) * 2)
    t, p = both(dataset=tensors, batch_size=3)
    with p:
        tb, pb = next(iter(t)), next(iter(p))
        assert type(tb) is type(pb) is list


def test_tuple_samples_and_refusals_name_the_argument():
    with pytest.raises(pinmem.InvalidError, match="batch_sampler: .* batch_size attribute"):
        pinmem.Loader(Indexed(), batch_sampler=[[0, 1]])
    with pytest.raises(pinmem.InvalidError, match="mutually exclusive"):
        pinmem.Loader(Indexed(), batch_size=4,
                      batch_sampler=torch.utils.data.BatchSampler(range(20), 4, False))
    with pytest.raises(pinmem.InvalidError, match="collate_fn of your own: .* pass device='cpu'"):
        pinmem.Loader(Indexed(), collate_fn=lambda xs: xs)  # batches for the device
    with pytest.raises(pinmem.InvalidError, match="batch_size=None option is mutually"):
        pinmem.Loader(Indexed(), batch_size=None, drop_last=True)


class Counting(Indexed):
    """Counts its reads (in the main process: num_workers=0) and can be changed after the
    loader was made."""

    def __init__(self, n=20, fail_at=None):
        super().__init__(n, fail_at)
        self.reads = 0
        self.offset = 0

    def __getitem__(self, i):
        self.reads += 1
        x, y = super().__getitem__(i)
        return x + self.offset, y


def test_nothing_is_read_before_the_loop_and_changes_before_it_are_seen():
    ds = Counting()
    loader = pinmem.Loader(ds, batch_size=5, device="cpu")
    assert ds.reads == 0
    ds.offset = 100  # made after Loader(...), before the loop: seen, as with DataLoader
    with loader:
        first = next(iter(loader))
        assert np.asarray(first[0])[0].tolist() == [100.0, 100.0]


def test_the_next_epoch_is_not_read_before_the_code_between_epochs():
    ds = Counting()
    with pinmem.Loader(ds, batch_size=5, device="cpu") as loader:
        assert sum(len(b) for b in run(loader)) == 20
        reads = ds.reads
        ds.offset = 7  # the code between epochs changes the dataset
        assert ds.reads == reads  # nothing of the next epoch was read meanwhile
        assert [float(v) for v in np.asarray(next(iter(loader))[0])[:, 0]] == [7, 8, 9, 10, 11]


@pytest.mark.parametrize("nw", [0, 2])
def test_an_error_at_index_0_surfaces_from_iteration(nw):
    loader = pinmem.Loader(Indexed(fail_at=0), batch_size=4, device="cpu", num_workers=nw)
    with pytest.raises(KeyError, match="sample 0 is broken"):
        next(iter(loader))
    loader.close()


def failing_init(worker_id):
    raise ValueError(f"init of worker {worker_id} failed")


def test_worker_init_fn_error_surfaces_from_iteration():
    loader = pinmem.Loader(Indexed(), batch_size=4, device="cpu", num_workers=2,
                           worker_init_fn=failing_init)
    assert loader.worker_pids() == []  # workers start at the first iteration
    with pytest.raises(ValueError, match="init of worker 0 failed"):
        next(iter(loader))
    loader.close()


def test_workers_start_at_the_first_iteration_and_persist():
    with pinmem.Loader(Indexed(), batch_size=4, device="cpu", num_workers=2,
                       persistent_workers=True) as loader:
        assert loader.worker_pids() == []
        run(loader)
        pids = loader.worker_pids()
        assert len(pids) == 2
        run(loader)
        assert loader.worker_pids() == pids


def test_pin_memory_false_with_workers_delivers_as_dataloader():
    t, p = both(batch_size=6, num_workers=2, pin_memory=False)
    with p:
        assert p.pin_memory is False
        assert run(p) == run(t)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(4))


class AllEmpty(Indexed):
    def __getitem__(self, i):
        return np.zeros((0, 3), np.float32)


def test_what_pinmem_cannot_batch_is_refused_by_name():
    with pinmem.Loader(Stream(), batch_size=2, device="cpu") as loader:  # a stream: batched
        assert [np.asarray(b).tolist() for b in loader] == \
            [b.tolist() for b in DataLoader(Stream(), batch_size=2)]
    for nw in (0, 1):  # no field with bytes: nothing to batch
        with pinmem.Loader(AllEmpty(), batch_size=2, device="cpu", num_workers=nw) as loader:
            with pytest.raises(pinmem.InvalidError, match="the sample has no array with elements"):
                next(iter(loader))
    with pytest.raises(pinmem.InvalidError, match="samples are empty"):
        pinmem.Loader(np.zeros((4, 0)), batch_size=2)


# Every torch dtype NumPy lacks that DLPack carries (float4_e2m1fn_x2, two values a byte, aside).
NO_NUMPY = [torch.bfloat16, torch.complex32, torch.float8_e4m3fn, torch.float8_e4m3fnuz,
            torch.float8_e5m2, torch.float8_e5m2fnuz, torch.float8_e8m0fnu]


def bits(t):
    """A tensor's bits, to compare dtypes whose values torch cannot compare (float8)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                 8: torch.int64}[t.element_size()])


class Typed(Indexed):
    """Sample i: one tensor of each dtype in NO_NUMPY, from distinct values, and the label."""

    def __getitem__(self, i):
        base = torch.arange(3, dtype=torch.float32) / 4 + i
        return [base.to(dt) if dt != torch.complex32 else torch.complex(base, -base).to(dt)
                for dt in NO_NUMPY] + [i]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("nw", [0, 2])
@pytest.mark.parametrize("batch_size", [4, None])
def test_dtypes_numpy_lacks_arrive_as_dataloader_gives_them(nw, batch_size):
    ds = Typed(10)
    t = list(DataLoader(ds, batch_size=batch_size, num_workers=nw))
    with pinmem.Loader(ds, batch_size=batch_size, num_workers=nw, device="cpu") as p:
        got = list(p.as_torch())
        assert len(got) == len(t)
        for pb, tb in zip(got, t):
            assert int(pb[-1].sum()) == int(torch.as_tensor(tb[-1]).sum())
            for x, y in zip(pb[:-1], tb[:-1]):
                assert x.dtype == y.dtype and x.shape == y.shape
                assert torch.equal(bits(x), bits(y))
        # Plain iteration over a torch dataset gives tensors, as DataLoader's loop expects.
        assert next(iter(p))[0].dtype == torch.bfloat16
    with pinmem.Loader(ds, batch_size=batch_size, num_workers=nw, device="cpu",
                       tensors=False) as p:
        plain = next(iter(p))[0]
        assert isinstance(plain, pinmem.Buffer) and plain.dtype == "bfloat16"
        with pytest.raises(TypeError, match="bfloat16 has no NumPy type"):
            np.asarray(plain)
        with pytest.raises(BufferError, match="bfloat16 has no buffer-protocol"):
            memoryview(plain)


def test_tensor_dataset_of_bfloat16_as_dataloader():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(13, 3, generator=g).to(torch.bfloat16)
    y = torch.randn(13, generator=g).to(torch.float8_e5m2)
    ds = torch.utils.data.TensorDataset(x, y)
    t = list(DataLoader(ds, batch_size=4))
    with pinmem.Loader(ds, batch_size=4, device="cpu") as p:
        got = list(p.as_torch())
    assert len(got) == len(t)
    for (px, py), (tx, ty) in zip(got, t):
        assert px.dtype == torch.bfloat16 and py.dtype == torch.float8_e5m2
        assert torch.equal(px, tx) and torch.equal(bits(py), bits(ty))


class Float4(Indexed):
    def __getitem__(self, i):
        return torch.zeros(2, dtype=torch.float4_e2m1fn_x2)


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="this torch has no float4")
def test_float4_is_refused_by_name():
    with pinmem.Loader(Float4(4), batch_size=2, device="cpu") as p:
        with pytest.raises(pinmem.InvalidError, match=r"a torch.float4_e2m1fn_x2 tensor has no "
                           "type pinmem can batch"):
            next(iter(p))
    x = torch.zeros(4, 2, dtype=torch.float4_e2m1fn_x2)
    with pytest.raises(pinmem.InvalidError, match="float4_e2m1fn_x2 tensor has no type"):
        pinmem.Loader(torch.utils.data.TensorDataset(x), batch_size=2, device="cpu")


class Mixed(Indexed):
    """A sample whose field changes dtype at index 3 (bfloat16 -> float16: the same bits size)."""

    def __getitem__(self, i):
        return torch.ones(2, dtype=torch.float16 if i == 3 else torch.bfloat16), i


@pytest.mark.parametrize("nw", [0, 1])
def test_a_sample_of_another_dtype_of_the_same_size_is_refused_by_name(nw):
    with pinmem.Loader(Mixed(8), batch_size=4, num_workers=nw, device="cpu") as p:
        with pytest.raises(pinmem.InvalidError, match=r"dataset index 3, field \[0\]: .*dtype "
                           r"float16, but the first sample had .*dtype bfloat16"):
            list(p)


class WithEmpty(Indexed):
    """Sample i: fields with a zero-size dimension beside ones with elements."""

    def __getitem__(self, i):
        return {"x": torch.full((3,), float(i)), "none": torch.zeros(0, 2),
                "bf": torch.empty(2, 0, dtype=torch.bfloat16),
                "np": np.zeros((0,), np.int32), "y": i}


@pytest.mark.parametrize("nw", [0, 2])
@pytest.mark.parametrize("batch_size", [4, None])
def test_empty_fields_arrive_as_dataloader_gives_them(nw, batch_size):
    ds = WithEmpty(10)
    t = list(DataLoader(ds, batch_size=batch_size, num_workers=nw))
    with pinmem.Loader(ds, batch_size=batch_size, num_workers=nw, device="cpu") as p:
        got = list(p.as_torch())
        assert len(got) == len(t)
        for pb, tb in zip(got, t):
            assert list(pb) == list(tb)
            for k in ("x", "none", "bf", "np"):
                tb[k] = torch.as_tensor(tb[k])  # numpy with batch_size=None
                assert pb[k].dtype == tb[k].dtype and pb[k].shape == tb[k].shape, k
                assert torch.equal(pb[k], tb[k])
        rows = () if batch_size is None else (4,)
        plain = next(iter(p))
        assert np.asarray(plain["none"]).shape == rows + (0, 2)
        assert np.asarray(plain["x"]).shape == rows + (3,)
        assert plain["bf"].dtype == torch.bfloat16 and plain["bf"].shape == rows + (2, 0)


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_sampler_as_dataloader(drop_last):
    ds = Indexed(22)

    def make():
        g = torch.Generator().manual_seed(3)
        return torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(ds, generator=g), 4,
                                             drop_last)
    t = DataLoader(ds, batch_sampler=make())
    with pinmem.Loader(ds, batch_sampler=make(), device="cpu") as p:
        assert p.batch_size is None and p.batch_sampler is not None and len(p) == len(t)
        for _ in range(2):  # the RandomSampler draws again each epoch, in both
            want = run(t)
            assert run(p) == want and len(want) == len(t)
        assert [list(b.indices) for b in p.batches()] == run(t)


class Uneven:
    batch_size = 3

    def __len__(self):
        return 2

    def __iter__(self):
        return iter([[0, 1], [2, 3, 4]])


def test_batch_sampler_of_uneven_batches_is_refused_by_name():
    with pinmem.Loader(Indexed(), batch_sampler=Uneven(), device="cpu") as p:
        with pytest.raises(pinmem.InvalidError, match="batch_sampler Uneven gave batch 0 of 2"):
            next(iter(p))


@pytest.mark.parametrize("nw", [0, 2])
def test_batch_size_none_gives_samples_without_a_batch_axis(nw):
    t, p = both(batch_size=None, num_workers=nw)
    with p:
        assert p.batch_size is None and len(p) == len(t) == 20
        for (tx, ty), (px, py) in zip(t, p.as_torch()):
            assert px.shape == tx.shape == (2,) and torch.equal(px, tx)
            assert py.shape == () and int(py) == ty
    ds = np.arange(12, dtype=np.int32).reshape(6, 2)  # arrays too
    with pinmem.Loader(ds, batch_size=None, device="cpu") as p:
        assert [np.asarray(x).tolist() for x in p] == ds.tolist()


class Named(Indexed):
    """Sample i: an array, a file name, a (caption, bytes) pair, None and an object."""

    def __getitem__(self, i):
        return {"x": np.full(2, i, np.float32), "name": f"img{i}.jpg",
                "cap": ("a" * (i % 5), b"%d" % i), "none": None, "obj": Box(i), "y": i}


class Box:
    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, Box) and other.v == self.v


def keep_objects(batch):
    """default_collate, keeping what it cannot batch (None, objects) as lists, as pinmem does."""
    out = {k: [s[k] for s in batch] for k in ("none", "obj")}
    rest = torch.utils.data.default_collate(
        [{k: v for k, v in s.items() if k not in out} for s in batch])
    return dict(rest, **out)


@pytest.mark.parametrize("nw", [0, 2])
@pytest.mark.parametrize("batch_size", [4, None])
def test_str_and_object_leaves_arrive_as_default_collate_gives_them(nw, batch_size):
    ds = Named(10)
    kw = {} if batch_size is None else {"collate_fn": keep_objects}
    g = torch.Generator().manual_seed(7)
    sampler = list(torch.utils.data.RandomSampler(ds, replacement=True, num_samples=14,
                                                   generator=g))  # indices drawn twice
    t = list(DataLoader(ds, batch_size=batch_size, num_workers=nw, sampler=sampler, **kw))
    with pinmem.Loader(ds, batch_size=batch_size, num_workers=nw, sampler=sampler,
                       device="cpu") as p:
        for _ in range(2):
            got = list(p.as_torch())
            assert len(got) == len(t)
            for pb, tb in zip(got, t):
                assert sorted(pb) == sorted(tb)
                for k in ("name", "cap", "none", "obj"):
                    assert pb[k] == tb[k], k
                assert torch.equal(pb["x"], torch.as_tensor(tb["x"]))


class Ragged(Indexed):
    """Sample i: a float32 run of length i % 4 + 1 (shapes vary), its name and its label."""

    def __getitem__(self, i):
        if i == self.fail_at:
            raise KeyError(f"sample {i} is broken")
        return torch.arange(i % 4 + 1, dtype=torch.float32) + i, f"s{i}", i


def pad(samples):
    """A collate_fn that pads to the batch's longest sample (the batches' shapes vary)."""
    xs, names, ys = zip(*samples)
    out = torch.zeros(len(xs), max(len(x) for x in xs))
    for k, x in enumerate(xs):
        out[k, :len(x)] = x
    if any(y == 13 for y in ys):
        raise ValueError("collate_fn refuses label 13")
    return {"x": out, "names": list(names), "y": torch.tensor(ys), "width": out.shape[1]}


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and sorted(a) == sorted(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


@pytest.mark.parametrize("nw, persistent", [(0, False), (2, False), (2, True)])
def test_collate_fn_runs_on_each_batch_as_in_dataloader(nw, persistent):
    ds = Ragged(13)
    t = list(DataLoader(ds, batch_size=3, num_workers=nw, collate_fn=pad))
    with pinmem.Loader(ds, batch_size=3, num_workers=nw, collate_fn=pad, device="cpu",
                       persistent_workers=persistent) as p:
        assert p.collate_fn is pad and len(p) == len(t) == 5
        for _ in range(2):
            got = list(p)
            assert len(got) == len(t) and all(same(a, b) for a, b in zip(got, t))
        assert {b["width"] for b in got} == {1, 3, 4}  # the shapes varied
        with pytest.raises(pinmem.InvalidError, match="batches.. gives the slot's arrays"):
            p.batches()
    # batch_size=None: collate_fn on each sample, as DataLoader.
    t = list(DataLoader(ds, batch_size=None, num_workers=nw, collate_fn=lambda s: s[1]))
    with pinmem.Loader(ds, batch_size=None, num_workers=nw, collate_fn=lambda s: s[1],
                       device="cpu") as p:
        assert list(p) == t == [f"s{i}" for i in range(13)]


@pytest.mark.parametrize("nw", [0, 2])
def test_errors_in_collate_fn_and_the_dataset_come_at_their_batch(nw):
    ds = Ragged(16, fail_at=4)
    with pinmem.Loader(ds, batch_size=3, num_workers=nw, collate_fn=pad, device="cpu") as p:
        it = iter(p)
        assert next(it)["y"].tolist() == [0, 1, 2]
        with pytest.raises(KeyError, match="sample 4 is broken"):
            next(it)
        assert next(it)["y"].tolist() == [6, 7, 8]
        assert next(it)["y"].tolist() == [9, 10, 11]
        with pytest.raises(ValueError, match="collate_fn refuses label 13"):
            next(it)
        assert next(it)["y"].tolist() == [15]


class TwoBroken(Indexed):
    """Two broken samples far apart: the second is not read before the first is raised (the
    slots hold 4 batches)."""

    def __getitem__(self, i):
        if i in (4, 40):
            raise KeyError(f"sample {i} is broken")
        return np.full(2, i, dtype=np.float32), i


@pytest.mark.parametrize("nw", [0, 2])
def test_each_error_names_its_own_sample(nw):
    """A second exception after the loader went on past a first is raised with its own text."""
    with pinmem.Loader(TwoBroken(48), batch_size=3, num_workers=nw, device="cpu",
                       prefetch_factor=1) as p:
        it = iter(p)
        got = []
        for b in range(16):
            if b in (1, 13):
                with pytest.raises(KeyError, match=f"sample {4 if b == 1 else 40} is broken"):
                    next(it)
            else:
                got += labels(next(it))
        assert got == [i for i in range(48) if i // 3 not in (1, 13)]


@pytest.mark.parametrize("nw", [0, 1])
def test_varying_shapes_without_collate_fn_are_refused_naming_what_to_do(nw):
    # The loader's threads read the batch's rows at once, so the first mismatch reported may be
    # any row of it after 0: the message must name that row and the shape it has.
    with pinmem.Loader(Ragged(8), batch_size=4, num_workers=nw, device="cpu") as p:
        with pytest.raises(pinmem.InvalidError, match=r"dataset index \d+, field \[0\]: "
                           r"shape \(\d+,\).*first sample had shape \(1,\).*"
                           r"collate_fn that pads") as e:
            next(iter(p))
    m = re.search(r"dataset index (\d+), field \[0\]: shape \((\d+),\)", str(e.value))
    index, length = int(m.group(1)), int(m.group(2))
    assert 1 <= index < 4 and length == index % 4 + 1


def test_plain_iteration_gives_tensors_for_torch_datasets_buffers_for_arrays():
    """The dataset alone decides what plain iteration gives: torch's datasets and tensors give
    torch tensors (a DataLoader loop runs unchanged), NumPy arrays give pinmem.Buffers, and
    tensors=True/False overrides either."""
    x = torch.arange(12.).reshape(6, 2)
    TensorDataset = torch.utils.data.TensorDataset
    cases = [(TensorDataset(x), torch.Tensor), (x, torch.Tensor), ((x, x.numpy()), torch.Tensor),
             (Indexed(6), torch.Tensor), (x.numpy(), pinmem.Buffer)]
    for ds, kind in cases:
        with pinmem.Loader(ds, batch_size=3, device="cpu") as p:
            b = next(iter(p))
            first = b[0] if isinstance(b, (list, tuple)) else b
            assert isinstance(first, kind), (type(ds), type(first))
            assert first.shape[0] == 3
    with pinmem.Loader(x.numpy(), batch_size=3, device="cpu", tensors=True) as p:
        b = next(iter(p))
        assert isinstance(b, torch.Tensor) and torch.equal(b, x[:3])
    with pinmem.Loader(TensorDataset(x), batch_size=3, device="cpu", tensors=False) as p:
        assert isinstance(next(iter(p))[0], pinmem.Buffer)
    with pytest.raises(pinmem.InvalidError, match="tensors must be None, True or False"):
        pinmem.Loader(x, batch_size=3, device="cpu", tensors="yes")


def test_one_random_sampler_gives_dataloaders_order_every_epoch():
    """pinmem's shuffle has its own order; a RandomSampler seeded alike gives DataLoader's, epoch
    after epoch (the sampler iterated again at each epoch's start, as DataLoader does)."""
    x = torch.arange(40.).reshape(20, 2)
    ds = torch.utils.data.TensorDataset(x)

    def sampler():
        return torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(7))
    t = DataLoader(ds, batch_size=5, sampler=sampler())
    with pinmem.Loader(ds, batch_size=5, device="cpu", sampler=sampler()) as p:
        for _ in range(3):
            want, got = [b[0] for b in t], [b[0] for b in p]
            assert len(want) == len(got) == 4
            assert all(torch.equal(a, b) for a, b in zip(want, got))
