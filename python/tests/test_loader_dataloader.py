"""pinmem.Loader beside torch.utils.data.DataLoader: the habits of DataLoader users, run side by
side on the same dataset and arguments (host backend, batches in host memory), each comparing
the samples delivered. Differences that remain are refused with a message naming the argument.
"""
import numpy as np
import re
import sys
import threading

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
    ds = kw.pop("dataset") if "dataset" in kw else Indexed()
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


def init_fails_in_worker_0(worker_id):
    if worker_id == 0:
        raise ValueError("worker 0 could not open its shard")


def test_worker_init_fn_failing_in_one_worker_raises_for_the_batches():
    """The structure is learned from a worker whose worker_init_fn did not raise: every batch
    of the epoch raises worker 0's error (before, the first did and the epoch ended, its other
    batches lost without a word)."""
    loader = pinmem.Loader(Indexed(8), batch_size=2, device="cpu", num_workers=2,
                           worker_init_fn=init_fails_in_worker_0)
    it, errors = iter(loader), 0
    for _ in range(10):
        try:
            next(it)
        except StopIteration:
            break
        except ValueError as e:
            assert "could not open its shard" in str(e)
            errors += 1
    assert errors == 4
    loader.close()


class RandomDraws(torch.utils.data.Dataset):
    """Each sample with draws from the worker's torch, NumPy and Python streams."""

    def __len__(self):
        return 20

    def __getitem__(self, i):
        import random
        return (torch.tensor([i, torch.utils.data.get_worker_info().id]), torch.rand(()),
                np.random.rand(), random.random())


def test_augmentation_draws_as_dataloader_with_one_worker_per_batch():
    """Batches of up to a claim (8 rows) are read by one worker in DataLoader's turn; each
    worker's streams are seeded as DataLoader's, and the look at sample 0 that learns the
    structure draws nothing from worker 0's: every sample's random numbers are DataLoader's."""
    def rows(cls, **kw):
        g = torch.Generator()
        g.manual_seed(123)
        ld = cls(RandomDraws(), batch_size=4, num_workers=2, generator=g, **kw)
        out = [(int(a), int(w), float(x), float(y), float(z)) for ix, t, n, r in ld
               for (a, w), x, y, z in zip(ix, t, n, r)]
        return out
    assert rows(pinmem.Loader, device="cpu") == rows(DataLoader)


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


class Captions(Indexed):
    """Strings alone: file names and captions for a collate step further on (each batch's
    first caption is a string, or default_collate would refuse the None)."""

    def __getitem__(self, i):
        return {"path": f"img{i}.jpg", "caption": None if i % 3 else f"caption {i}"}


class Names(Indexed):
    def __getitem__(self, i):
        return f"name{i}"


class NoLeaves(Indexed):
    def __getitem__(self, i):
        return ()


@pytest.mark.parametrize("nw", [0, 2])
@pytest.mark.parametrize("batch_size", [3, None])
def test_samples_with_nothing_to_pin_arrive_as_dataloader_gives_them(nw, batch_size):
    """Strings alone, or arrays with no elements: nothing for the slot, and still the batches
    DataLoader gives (each row's slot holds one byte; the values travel beside it)."""
    for ds in (Captions(7), Names(7), AllEmpty(7)):
        t, p = both(dataset=ds, batch_size=batch_size, num_workers=nw)
        with p:
            for _ in range(2):
                got, want = list(p), list(t)
                assert len(got) == len(want) == len(p)
                for g, w in zip(got, want):
                    if isinstance(w, torch.Tensor):
                        assert g.shape == w.shape and g.dtype == w.dtype
                    else:
                        assert g == w
            with pytest.raises(pinmem.InvalidError, match="these samples have none"):
                next(iter(p.batches()))


def test_what_pinmem_cannot_batch_is_refused_by_name():
    with pinmem.Loader(Stream(), batch_size=2, device="cpu") as loader:  # a stream: batched
        assert [np.asarray(b).tolist() for b in loader] == \
            [b.tolist() for b in DataLoader(Stream(), batch_size=2)]
    for nw in (0, 1):  # a sample with no leaf at all
        with pinmem.Loader(NoLeaves(), batch_size=2, device="cpu", num_workers=nw) as loader:
            with pytest.raises(pinmem.InvalidError, match="holds nothing to batch"):
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
        it = iter(p.as_torch())
        with pytest.raises(pinmem.InvalidError, match=r"field \[0\] has shape \(2,\) dtype "
                           r"float16 at dataset index 3 and .*dtype bfloat16 at dataset index 0"):
            next(it)
        x, y = next(it)  # the batch after it, as DataLoader
        assert x.dtype == torch.bfloat16 and y.tolist() == [4, 5, 6, 7]


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


# -- Epochs without a batch: DataLoader yields nothing for them and goes on -------------------

EMPTY_EPOCHS = {
    "empty dataset": lambda: dict(dataset=Indexed(0), batch_size=4),
    "empty dataset, shuffled": lambda: dict(dataset=Indexed(0), batch_size=4,
                                            sampler=torch.utils.data.SequentialSampler([])),
    "empty TensorDataset": lambda: dict(
        dataset=torch.utils.data.TensorDataset(torch.zeros(0, 3), torch.zeros(0)), batch_size=2),
    "drop_last, fewer samples than a batch": lambda: dict(dataset=Indexed(3), batch_size=4,
                                                          drop_last=True),
    "a sampler that yields nothing": lambda: dict(sampler=[], batch_size=4),
    "a batch_sampler that yields nothing": lambda: dict(
        batch_sampler=torch.utils.data.BatchSampler([], 3, False)),
    "empty dataset, collate_fn": lambda: dict(dataset=Indexed(0), batch_size=2,
                                              collate_fn=lambda samples: samples),
}


@pytest.mark.parametrize("nw", [0, 2])
@pytest.mark.parametrize("case", sorted(EMPTY_EPOCHS))
def test_epochs_without_a_batch_yield_nothing_as_in_dataloader(case, nw):
    t, p = both(num_workers=nw, **EMPTY_EPOCHS[case]())
    with p:
        assert len(p) == len(t) == 0
        for epoch in range(3):  # each loop is one more epoch, with nothing in it
            assert run(p) == run(t) == []
            assert p.state_dict()["epoch"] == epoch + 1 and p.state_dict()["batch"] == 0
        with pytest.raises(StopIteration):
            next(iter(p.as_torch()))
        stats = p.stats()
        assert stats["batches"] == 0 and stats["batches_per_epoch"] == 0


class EveryOtherEpoch(torch.utils.data.Sampler):
    """Indices 5, 2, 7 in odd epochs and none in even ones (set_epoch), as a sampler over a
    shard that some epochs leave empty."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return iter([5, 2, 7] if self.epoch % 2 else [])

    def __len__(self):
        return 3 if self.epoch % 2 else 0


@pytest.mark.parametrize("nw", [0, 2])
def test_a_sampler_with_empty_epochs_between_full_ones(nw):
    t = DataLoader(Indexed(), batch_size=2, sampler=EveryOtherEpoch(), num_workers=nw)
    with pinmem.Loader(Indexed(), batch_size=2, sampler=EveryOtherEpoch(), num_workers=nw,
                       device="cpu") as p:
        for epoch in range(5):
            t.sampler.set_epoch(epoch)
            p.sampler.set_epoch(epoch)
            assert len(p) == len(t)
            got = run(p, stop_after=1 if epoch == 3 else None)  # a break ends epoch 3 early
            assert got == run(t, stop_after=1 if epoch == 3 else None)
            assert got == ([] if epoch % 2 == 0 else [[5, 2]] if epoch == 3 else [[5, 2], [7]])
            assert p.epoch == epoch + 1 or epoch == 3
        state = p.state_dict()
    assert state["epoch"] == 5 and state["batch"] == 0
    # A state saved at an empty epoch resumes there: that loop is empty, the next one is not.
    with pinmem.Loader(Indexed(), batch_size=2, sampler=EveryOtherEpoch(), num_workers=nw,
                       device="cpu") as q:
        q.sampler.set_epoch(4)
        q.load_state_dict(dict(state, epoch=4))
        assert run(q) == [] and q.epoch == 5
        q.sampler.set_epoch(5)
        assert run(q) == [[5, 2], [7]] and q.epoch == 6
        with pytest.raises(pinmem.InvalidError, match=r"resume state batch 1, an epoch has 0 "
                                                      r"\(no batch"):
            q.sampler.set_epoch(6)
            q.load_state_dict(dict(state, epoch=6, batch=1, samples=3))
        # A refused state leaves the loader where it was: at epoch 6, whose order the sampler
        # gives when it begins.
        assert q.epoch == 6 and run(q) == []
        q.sampler.set_epoch(7)
        assert run(q) == [[5, 2], [7]] and q.epoch == 8


class Broken(Indexed):
    """Sample 2 raises."""

    def __getitem__(self, i):
        if i == 2:
            raise KeyError(f"sample {i} is broken")
        return super().__getitem__(i)


def rest(it):
    out = []
    while True:
        try:
            out.append(labels(next(it)))
        except StopIteration:
            return out
        except KeyError:
            out.append("KeyError")


@pytest.mark.parametrize("nw", [0, 2])
def test_resuming_around_failed_batches_epoch_ends_and_refusals(nw):
    # A state saved right after a batch failed names the batch after it.
    with pinmem.Loader(Broken(6), batch_size=2, num_workers=nw, device="cpu") as a:
        it = iter(a)
        next(it)
        with pytest.raises(KeyError):
            next(it)
        state = a.state_dict()
        assert (state["epoch"], state["batch"]) == (0, 2) and rest(it) == [[4, 5]]
    with pinmem.Loader(Broken(6), batch_size=2, num_workers=nw, device="cpu") as b:
        b.load_state_dict(state)
        assert rest(iter(b)) == [[4, 5]]
    # A state saved after the last of epochs=N resumes with nothing left.
    with pinmem.Loader(Indexed(4), batch_size=2, num_workers=nw, epochs=1, sampler=[0, 1, 2, 3],
                       device="cpu") as a:
        assert run(a) == [[0, 1], [2, 3]]
        state = a.state_dict()
    with pinmem.Loader(Indexed(4), batch_size=2, num_workers=nw, epochs=1, sampler=[0, 1, 2, 3],
                       device="cpu") as b:
        b.load_state_dict(state)
        assert run(b) == [] and run(b) == []
    # A refused state leaves the epoch in progress going on (new workers per epoch too).
    with pinmem.Loader(Indexed(6), batch_size=2, num_workers=nw, device="cpu") as a:
        it = iter(a)
        next(it)
        with pytest.raises(pinmem.InvalidError, match="resume state batch 99, an epoch has 3"):
            a.load_state_dict(dict(a.state_dict(), epoch=2, batch=99))
        assert rest(it) == [[2, 3], [4, 5]]


class Flaky(torch.utils.data.Sampler):
    """Orders [[0..3], [], [5, 6]] by epoch; its __iter__ raises once, in epoch 1, when asked."""

    def __init__(self, fail=False):
        self.epoch, self.fail = 0, fail

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        if self.fail and self.epoch == 1:
            self.fail = False
            raise OSError("index file unavailable")
        return iter([[0, 1, 2, 3], [], [5, 6]][self.epoch % 3])

    def __len__(self):
        return len([[0, 1, 2, 3], [], [5, 6]][self.epoch % 3])


@pytest.mark.parametrize("nw", [0, 2])
def test_sampler_lengths_that_change_and_an_epoch_that_fails_to_open(nw):
    states = []
    with pinmem.Loader(Indexed(), batch_size=2, sampler=Flaky(), num_workers=nw,
                       device="cpu") as a:
        for epoch in range(3):
            a.sampler.set_epoch(epoch)
            states.append(a.state_dict())
            run(a)
    for st, want in zip(states, ([[0, 1], [2, 3]], [], [[5, 6]])):  # 4, 0, 2 samples
        with pinmem.Loader(Indexed(), batch_size=2, sampler=Flaky(), num_workers=nw,
                           device="cpu") as b:
            b.sampler.set_epoch(st["epoch"])
            b.load_state_dict(st)
            assert run(b) == want
    # The sampler raises as epoch 1 opens: that loop raises it, and the next loop goes on.
    t = DataLoader(Indexed(), batch_size=2, sampler=Flaky(fail=True), num_workers=nw)
    with pinmem.Loader(Indexed(), batch_size=2, sampler=Flaky(fail=True), num_workers=nw,
                       device="cpu") as p:
        for loader in (t, p):
            got = []
            for epoch in range(3):
                loader.sampler.set_epoch(epoch)
                try:
                    got.append(run(loader))
                except OSError as e:
                    got.append(str(e))
            assert got == [[[0, 1], [2, 3]], "index file unavailable", [[5, 6]]]


class Growing(torch.utils.data.Dataset):
    """Its length is lens[epoch] (a replay buffer that grows, a curriculum that changes)."""

    def __init__(self, lens):
        self.lens, self.epoch = lens, 0

    def __len__(self):
        return self.lens[self.epoch]

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(i)
        return torch.tensor([i])


@pytest.mark.parametrize("nw", [0, 2])
@pytest.mark.parametrize("lens", [(3, 0, 5), (0, 3, 2)])
def test_a_dataset_whose_length_changes_between_epochs(nw, lens):
    got = []
    for make in (DataLoader, lambda *a, **k: pinmem.Loader(*a, device="cpu", **k)):
        ds = Growing(lens)
        loader = make(ds, batch_size=2, num_workers=nw)
        epochs = []
        for epoch in range(3):
            ds.epoch = epoch
            epochs.append([b.flatten().tolist() for b in loader])
        got.append(epochs)
        if isinstance(loader, pinmem.Loader):
            loader.close()
    assert got[0] == got[1]


def test_an_array_dataset_takes_its_samplers_order_at_the_first_use():
    x = torch.arange(10)
    make = lambda: torch.utils.data.DistributedSampler(x, num_replicas=2, rank=0, seed=3)  # noqa
    t = DataLoader(torch.utils.data.TensorDataset(x), batch_size=2, sampler=make())
    with pinmem.Loader(torch.utils.data.TensorDataset(x), batch_size=2, sampler=make(),
                       device="cpu") as p:
        for loader in (t, p):
            loader.sampler.set_epoch(1)  # after the loader was made, as training loops do
        assert [b[0].tolist() for b in p] == [b[0].tolist() for b in t]


@pytest.mark.parametrize("nw", [0, 2])
def test_the_first_epoch_opens_at_the_first_batch(nw):
    """len() or state_dict() before the loop take nothing from the first epoch: its length and
    its sampler's order are those at the first batch, as DataLoader takes them at iter()."""
    for sampler in (False, True):
        got = []
        for make in (DataLoader, lambda *a, **k: pinmem.Loader(*a, device="cpu", **k)):
            ds = Growing((4, 8))
            kw = dict(sampler=torch.utils.data.SequentialSampler(ds)) if sampler else {}
            loader = make(ds, batch_size=4, num_workers=nw, **kw)
            assert len(loader) == 1
            ds.epoch = 1  # 8 samples from here on
            assert len(loader) == 2
            got.append([b.flatten().tolist() for b in loader])
            if isinstance(loader, pinmem.Loader):
                loader.close()
        assert got[0] == got[1] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("nw", [0, 2])
def test_a_resumed_random_sampler_is_iterated_once(nw):
    """load_state_dict takes the epoch's order from the sampler once: a RandomSampler given the
    generator state of that epoch's start resumes the same order."""
    g = torch.Generator().manual_seed(426)
    with pinmem.Loader(Indexed(10), batch_size=2, num_workers=nw, device="cpu",
                       sampler=torch.utils.data.RandomSampler(range(10), generator=g)) as a:
        run(a)
        start = g.get_state()
        it = iter(a)
        next(it), next(it)
        state = a.state_dict()
        rest = run(it)
    g2 = torch.Generator()
    g2.set_state(start)
    with pinmem.Loader(Indexed(10), batch_size=2, num_workers=nw, device="cpu",
                       sampler=torch.utils.data.RandomSampler(range(10), generator=g2)) as b:
        b.load_state_dict(state)
        assert run(b) == rest and len(rest) == 3


class Raising(torch.utils.data.Sampler):
    def __iter__(self):
        raise ValueError("no index file")

    def __len__(self):
        return 4


@pytest.mark.parametrize("nw", [0, 2])
def test_a_sampler_that_raises_ends_its_loop(nw):
    with pinmem.Loader(Indexed(), batch_size=2, sampler=Raising(), num_workers=nw,
                       device="cpu") as p:
        for _ in range(2):  # each loop: the error once, then the loop ends
            it = iter(p)
            with pytest.raises(ValueError, match="no index file"):
                next(it)
            with pytest.raises(StopIteration):
                next(it)


def test_a_refused_batches_leaves_the_epoch():
    with pinmem.Loader(Names(6), batch_size=2, shuffle=True, seed=7, device="cpu") as p:
        with pytest.raises(pinmem.InvalidError, match="these samples have none"):
            next(iter(p.batches()))
        assert p.state_dict()["epoch"] == 0
        first = list(p)
    with pinmem.Loader(Names(6), batch_size=2, shuffle=True, seed=7, device="cpu") as q:
        assert list(q) == first  # the same epoch 0 order


def test_a_shrunk_epoch_keeps_the_structure_learned():
    """Sample 0 raises, 1 and 2 read; the next epoch has sample 0 alone: its batch raises and
    the epoch ends, as DataLoader's, rather than the structure being sought again."""
    class Shrinks(Growing):
        def __getitem__(self, i):
            if i == 0:
                raise KeyError("sample 0 is broken")
            return super().__getitem__(i)
    for kw in (dict(batch_size=3), dict(batch_size=3, drop_last=True)):
        got = []
        for make in (DataLoader, lambda *a, **k: pinmem.Loader(*a, device="cpu", **k)):
            ds = Shrinks((3, 1))
            loader = make(ds, **kw)
            epochs = []
            for epoch in range(2):
                ds.epoch = epoch
                it, out = iter(loader), []
                while len(out) < 4:
                    try:
                        out.append(next(it).flatten().tolist())
                    except KeyError:
                        out.append("KeyError")
                    except StopIteration:
                        break
                epochs.append(out)
            got.append(epochs)
            if isinstance(loader, pinmem.Loader):
                loader.close()
        assert got[0] == got[1]


class PerEpoch(torch.utils.data.Dataset):
    """Sample i of epoch e is 100 * e + i; lens[e] samples; __len__ raises where lens[e] is
    None (an index file that is not there yet)."""

    def __init__(self, lens):
        self.lens, self.epoch = lens, 0

    def __len__(self):
        n = self.lens[self.epoch]
        if n is None:
            raise OSError("index file unavailable")
        return n

    def __getitem__(self, i):
        return torch.tensor([100 * self.epoch + i])


def flat(loader):
    return [b.flatten().tolist() for b in loader]


@pytest.mark.parametrize("nw", [0, 2])
def test_states_of_other_epochs_into_the_same_loader(nw):
    kw = dict(batch_size=2, num_workers=nw, device="cpu")
    ds = PerEpoch([4, 6, 4])
    with pinmem.Loader(ds, **kw) as p:
        it = iter(p)
        next(it)
        saved = p.state_dict()  # (0, 1) of an epoch of 4 samples
        assert flat(it) == [[2, 3]]
        for epoch in (1, 2):
            ds.epoch = epoch
            assert len(flat(p)) == ds.lens[epoch] // 2
        ds.epoch = 0  # the dataset as it was; workers that do not persist start again
        p.load_state_dict(saved)
        assert flat(p) == [[2, 3]]
        p.load_state_dict(dict(saved, batch=0))
        assert flat(p) == [[0, 1], [2, 3]]
    # Saved between epochs whose lengths differ (7, then 5): a fresh loader resumes there.
    ds = PerEpoch([7, 5])
    with pinmem.Loader(ds, **kw) as p:
        flat(p)
        between = p.state_dict()
        ds.epoch = 1
        rest = flat(p)
    ds = PerEpoch([7, 5])
    ds.epoch = 1
    with pinmem.Loader(ds, **kw) as q:
        q.load_state_dict(between)
        assert flat(q) == rest == [[100, 101], [102, 103], [104]]


@pytest.mark.parametrize("persistent", [False, True])
def test_a_refused_state_leaves_the_workers_and_the_epoch(persistent):
    with pinmem.Loader(Indexed(6), batch_size=2, sampler=[0, 1, 2, 3], num_workers=2,
                       persistent_workers=persistent, device="cpu") as p:
        it = iter(p)
        next(it)
        with pytest.raises(pinmem.InvalidError, match="resume state batch 9, an epoch has 2"):
            p.load_state_dict(dict(p.state_dict(), epoch=1, batch=9))
        assert run(it) == [[2, 3]]
        assert run(p) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("nw", [0, 2])
def test_a_first_epoch_whose_length_raises_ends_its_loop(nw):
    ds = PerEpoch([None, 4])
    with pinmem.Loader(ds, batch_size=2, num_workers=nw, device="cpu") as p:
        it = iter(p)
        with pytest.raises(OSError, match="index file unavailable"):
            next(it)
        with pytest.raises(StopIteration):
            next(it)
        ds.epoch = 1
        assert flat(p) == [[100, 101], [102, 103]]
    with pytest.raises(pinmem.StateError):
        p.worker_pids()


class FailsOnce(torch.utils.data.Sampler):
    def __init__(self):
        self.fail = True

    def __len__(self):
        return 3

    def __iter__(self):
        if self.fail:
            raise ValueError("the sampler fails this epoch")
        return iter([0, 1, 2])


def test_the_loop_after_a_failed_opening_has_new_workers():
    """Workers that do not persist start again for the loop after an epoch failed to open:
    they see the dataset as the program left it, as DataLoader's new iterator does."""
    got = []
    for make in (DataLoader, lambda *a, **k: pinmem.Loader(*a, device="cpu", **k)):
        ds, sampler = PerEpoch([3, 3]), FailsOnce()
        loader = make(ds, batch_size=3, sampler=sampler, num_workers=2)
        out = []
        for loop in range(2):
            try:
                out.append(flat(loader))
            except ValueError as e:
                out.append(str(e))
            ds.epoch, sampler.fail = 1, False
        got.append(out)
        if isinstance(loader, pinmem.Loader):
            loader.close()
    assert got[0] == got[1] == ["the sampler fails this epoch", [[100, 101, 102]]]


def test_epochs_end_after_the_last_one_without_a_batch():
    with pinmem.Loader(np.zeros((3, 2), np.float32), batch_size=4, drop_last=True, epochs=2,
                       device="cpu") as p:
        assert len(p) == 0
        assert [run(p) for _ in range(4)] == [[]] * 4
        assert p.state_dict()["epoch"] == 2


def test_a_sampler_index_into_an_empty_dataset_is_refused_by_name():
    with pinmem.Loader(Indexed(0), batch_size=2, sampler=[0], device="cpu") as p:
        with pytest.raises(pinmem.InvalidError, match="yielded 0 at position 0: the dataset is "
                                                      "empty"):
            next(iter(p))


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


def first_difference(got, want):
    """'' when every batch of got is the same as want's, else where and how the first differs
    (so a failure names the batch and the field, not only 'False')."""
    if len(got) != len(want):
        return f"{len(got)} batches, not {len(want)}"

    def walk(a, b, path):
        if same(a, b):
            return ""
        if isinstance(a, dict) and isinstance(b, dict) and sorted(a) == sorted(b):
            return next(w for w in (walk(a[k], b[k], f"{path}[{k!r}]") for k in a) if w)
        if isinstance(a, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
            return next(w for w in (walk(x, y, f"{path}[{k}]") for k, (x, y) in
                                    enumerate(zip(a, b))) if w)
        return f"{path}: got {a!r}, DataLoader gave {b!r}"

    return next((w for w in (walk(on_host(a), b, f"batch {k}") for k, (a, b) in
                             enumerate(zip(got, want))) if w), "")


def assert_same_batches(got, want, loader=None):
    """first_difference(got, want) is '', else a failure that says whether the difference
    lasts (it is compared again 0.5 s later: a batch read before its copy was done would have
    changed meanwhile) and the loader's stats."""
    diff = first_difference(got, want)
    if diff:
        import time
        time.sleep(0.5)
        again = first_difference(got, want)
        pytest.fail(f"{diff}; 0.5 s later: {again or 'no difference left'}"
                    + (f"; loader stats {loader.stats()}" if loader is not None else ""))


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


@pytest.mark.parametrize("device", ["cpu", None])
@pytest.mark.parametrize("nw", [0, 2])
def test_errors_in_collate_fn_and_the_dataset_come_at_their_batch(nw, device):
    ds = Ragged(16, fail_at=4)
    with pinmem.Loader(ds, batch_size=3, num_workers=nw, collate_fn=pad, device=device) as p:
        it = iter(p.as_torch())
        assert next(it)["y"].tolist() == [0, 1, 2]
        with pytest.raises(KeyError, match="sample 4 is broken"):
            next(it)
        assert next(it)["y"].tolist() == [6, 7, 8]
        assert next(it)["y"].tolist() == [9, 10, 11]
        with pytest.raises(ValueError, match="collate_fn refuses label 13"):
            next(it)
        assert next(it)["y"].tolist() == [15]


def on_host(x):
    """x with every tensor copied to host memory (from the device, where pinmem put it)."""
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, dict):
        return {k: on_host(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(on_host(v) for v in x)
    return x


def device_kind():
    """The DLPack device of a map-style device batch: where collated device batches must be."""
    with pinmem.Loader(Indexed(4), batch_size=2) as p:
        return next(iter(p))[0].__dlpack_device__()


def pad_more(samples):
    """pad, plus a NumPy leaf, a tuple and a bfloat16 tensor; batch 3 (labels 9..11) is 64x
    wider: a larger output later in the epoch."""
    out = pad(samples)
    ys = out["y"]
    wide = 64 if int(ys[0]) == 9 else 1
    x = out["x"].repeat(1, wide)
    return {"x": x, "names": out["names"], "y": ys, "width": x.shape[1],
            "pair": (ys.numpy() * 2, ys.to(torch.bfloat16) / 4), "none": None}


@pytest.mark.parametrize("nw", [0, 2])
def test_collate_fn_with_device_batches_gives_dataloaders_output_on_the_device(nw):
    ds = Ragged(13)
    t = list(DataLoader(ds, batch_size=3, num_workers=nw, collate_fn=pad_more))
    kind = device_kind()
    import gc
    gc.collect()
    before = pinmem.stats()["in_use_bytes"]
    with pinmem.Loader(ds, batch_size=3, num_workers=nw, collate_fn=pad_more,
                       tensors=False) as p:  # (plain iteration: pinmem.Buffers)
        assert p.device != "cpu"
        for _ in range(2):
            got = list(p.as_torch())
            assert len(got) == len(t) == 5
            for pb, tb in zip(got, t):
                assert sorted(pb) == sorted(tb)
                assert type(pb["pair"]) is tuple and len(pb["pair"]) == 2
                assert pb["names"] == tb["names"] and all(type(n) is str for n in pb["names"])
                assert pb["width"] == tb["width"] and type(pb["width"]) is int
                assert pb["none"] is None
                # Array leaves (NumPy ones too) arrive as tensors where the slots' batches are.
                tb = dict(tb, pair=(torch.as_tensor(tb["pair"][0]), tb["pair"][1]))
                assert same(on_host(pb), tb)
        assert {b["width"] for b in got} == {1, 3, 4, 64 * 4}  # the shapes varied, and grew
        st = p.stats()
        assert st["staged_batches"] == 10 and st["staged_largest_bytes"] >= 3 * 64 * 4 * 4
        plain = next(iter(p))
        assert isinstance(plain["x"], pinmem.Buffer) and plain["x"].shape == (3, 3)
        assert plain["x"].__dlpack_device__() == kind
        assert plain["pair"][1].dtype == "bfloat16"
        with pytest.raises(TypeError, match="device memory is not readable by the CPU"):
            np.asarray(plain["x"])  # device memory, as a slot's device batch
        assert plain["names"] == ["s0", "s1", "s2"]
    del got, plain, pb
    gc.collect()
    assert pinmem.stats()["in_use_bytes"] == before  # the pinned blocks went back


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
def test_shapes_that_differ_within_a_batch_are_refused_at_it_naming_the_rows(nw):
    # Each batch of Ragged mixes lengths 1..4: default_collate's torch.stack refuses each, and
    # so does pinmem, with torch's type (RuntimeError), naming the field and two rows.
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        next(iter(DataLoader(Ragged(8), batch_size=4)))
    with pinmem.Loader(Ragged(8), batch_size=4, num_workers=nw, device="cpu") as p:
        it = iter(p)
        for b in range(2):
            with pytest.raises(RuntimeError, match=r"batch \d of epoch 0: stack expects each "
                               r"tensor to be equal size: field \[0\] has shape \((\d+),\) .*at "
                               r"dataset index (\d+) and shape .* at dataset index (\d+)") as e:
                next(it)
            assert isinstance(e.value, pinmem.InvalidError)
            m = re.search(r"shape \((\d+),\) dtype float32 at dataset index (\d+)", str(e.value))
            length, index = int(m.group(1)), int(m.group(2))
            assert 4 * b <= index < 4 * b + 4 and length == index % 4 + 1
        with pytest.raises(StopIteration):
            next(it)


class Scales(Indexed):
    """Sample i: an image whose side changes every 4 samples (2, 3, 4: multi-scale training),
    a bfloat16 field of that length, a name and a label."""

    def __getitem__(self, i):
        s = 2 + (i // 4) % 3
        return {"img": torch.arange(s * s, dtype=torch.float32).reshape(s, s) + i,
                "bf": torch.full((s,), i / 4, dtype=torch.bfloat16), "name": f"n{i}", "y": i}


@pytest.mark.parametrize("nw, persistent", [(0, False), (2, False), (2, True)])
def test_shapes_that_vary_between_batches_arrive_as_dataloader_gives_them(nw, persistent):
    ds = Scales(24)
    t = list(DataLoader(ds, batch_size=4, num_workers=nw))
    kind = device_kind()
    import gc
    gc.collect()
    before = pinmem.stats()["in_use_bytes"]
    with pinmem.Loader(ds, batch_size=4, num_workers=nw, persistent_workers=persistent,
                       tensors=False) as p:  # (plain iteration: pinmem.Buffers)
        for _ in range(2):
            got = list(p.as_torch())
            assert len(got) == len(t) == 6
            assert_same_batches(got, t, p)
        assert [tuple(b["img"].shape) for b in got] == [(4, s, s) for s in (2, 3, 4) * 2]
        plain = list(p)
        assert all(isinstance(b["img"], pinmem.Buffer) for b in plain)
        assert plain[1]["img"].shape == (4, 3, 3) and plain[1]["bf"].dtype == "bfloat16"
        assert plain[1]["img"].__dlpack_device__() == plain[0]["img"].__dlpack_device__() == kind
        assert plain[1]["name"] == ["n4", "n5", "n6", "n7"]
        # The batches of the first sample's shape (0 and 3) came through the slots.
        st = p.stats()
        assert st["staged_batches"] == 3 * 4 and st["staged_largest_bytes"] >= 4 * 16 * 4
        it = iter(p.batches())  # flat Batch tuples: only the slots' batches have them
        assert list(next(it).indices) == [0, 1, 2, 3]
        with pytest.raises(pinmem.InvalidError, match=r"batch 1 of epoch 3: its samples' shapes "
                           r"differ from the first sample's, .*batches\(\) cannot give it"):
            next(it)
    del got, plain
    gc.collect()
    assert pinmem.stats()["in_use_bytes"] == before  # the pinned blocks and slots went back
    # batch_size=None: each sample alone (numbers as 0-d tensors, as pinmem gives them)
    t = list(DataLoader(ds, batch_size=None, num_workers=nw))
    with pinmem.Loader(ds, batch_size=None, num_workers=nw) as p:
        got = [on_host(b) for b in p.as_torch()]
    assert [int(b.pop("y")) for b in got] == [b.pop("y") for b in t] == list(range(24))
    assert all(same(pb, tb) for pb, tb in zip(got, t))


@pytest.mark.parametrize("nw", [0, 2])
def test_a_batch_sampler_that_buckets_by_length(nw):
    ds = Ragged(24)  # lengths i % 4 + 1
    by_length = sorted(range(24), key=lambda i: (i % 4, i))
    make = lambda: torch.utils.data.BatchSampler(by_length, 3, False)  # noqa: E731
    t = list(DataLoader(ds, batch_sampler=make(), num_workers=nw))
    with pinmem.Loader(ds, batch_sampler=make(), num_workers=nw) as p:
        got = list(p.as_torch())
    assert len(got) == len(t) == 8
    assert first_difference(got, t) == ""
    assert [b[0].shape[1] for b in got] == [1, 1, 2, 2, 3, 3, 4, 4]


class ScalesBroken(Scales):
    """Scales whose sample 13 raises (after the shapes began to vary: its batch is the fourth)."""

    def __getitem__(self, i):
        if i == 13:
            raise KeyError("sample 13 is broken")
        return super().__getitem__(i)


def side_by_side(ds, nw, failing, error, match, **kw):
    """One epoch of DataLoader and of pinmem.Loader (as_torch) over ds in batches of 4, each
    batch on the host; at the batch numbers in `failing`, next() must raise `error` (pinmem's
    with a text matching match(batch number, torch?) when that is not None). -> (torch's
    batches, pinmem's), the failed ones left out. kw: more arguments of both loaders."""
    results = []
    for make in (DataLoader, pinmem.Loader):
        loader = make(ds, batch_size=4, num_workers=nw, **kw)
        it = iter(loader.as_torch() if make is pinmem.Loader else loader)
        got = []
        for b in range(-(-len(ds) // 4)):
            if b in failing:
                with pytest.raises(error, match=match(b, make is DataLoader)):
                    next(it)
            else:
                got.append(on_host(next(it)))
        with pytest.raises(StopIteration):
            next(it)
        results.append(got)
        if make is pinmem.Loader:
            loader.close()
    return results


@pytest.mark.parametrize("nw", [0, 2])
def test_an_error_after_the_shapes_began_to_vary_is_its_own_and_the_next_batch_follows(nw):
    # The loader's threads read past the first sample that differs before the loader learns
    # of it; what they met there must not stand in for a later batch's own exception.
    t, p = side_by_side(ScalesBroken(24), nw, (3,), KeyError, lambda b, t: "sample 13 is broken")
    assert len(p) == 5 and all(same(a, b) for a, b in zip(t, p))


class LaterFailsFirst(Indexed):
    """Samples 5 (batch 1) and 9 (batch 2) raise. Read on pinmem's threads, sample 5 raises only
    once sample 9 has been fetched on another thread: the read-ahead batch's exception is the one
    kept first, while the loader's first failing batch is 1."""

    def __init__(self, n):
        super().__init__(n)
        self.nine_read = threading.Event()
        self.waited = False

    def __getitem__(self, i):
        if i == 0 and threading.current_thread() is threading.main_thread():
            self.nine_read.clear()  # a new loader (torch's read sample 9 in the main thread)
        if i == 9:
            self.nine_read.set()
            raise KeyError("sample 9 is broken")
        if i == 5:
            if threading.current_thread() is not threading.main_thread():
                self.waited = self.nine_read.wait(60)
            raise KeyError("sample 5 is broken")
        return super().__getitem__(i)


@pytest.mark.parametrize("sampler", [None, "reversed in each batch"])
def test_the_exception_raised_at_a_batch_is_its_own_sample_s_not_one_read_ahead(sampler):
    # Every reader thread keeps what its fetch raised; next() at batch 1 must raise sample 5's
    # exception (the sample whose read failed), not sample 9's, met first by a thread reading
    # ahead, and the batches after follow as torch's (batch 2 raises sample 9's own). With a
    # sampler, the loader's positions are not the dataset's indices (position 6 is sample 5).
    ds = LaterFailsFirst(16)
    kw = {} if sampler is None else dict(sampler=[4 * (k // 4) + 3 - k % 4 for k in range(16)])
    was = pinmem.options()["loader_workers"]["value"]
    interval = sys.getswitchinterval()
    pinmem.set_option("loader_workers", 4)  # readers enough to read ahead on any machine
    # The thread that read sample 9 keeps the GIL until its exception is stored: sample 5's
    # thread, woken by the event, cannot store its own first.
    sys.setswitchinterval(2.0)
    try:
        t, p = side_by_side(ds, 0, (1, 2), KeyError, lambda b, t: f"sample {4 * b + 1} is broken",
                            **kw)
    finally:
        sys.setswitchinterval(interval)
        pinmem.set_option("loader_workers", was)
    assert ds.waited, "sample 5 was never read while sample 9 was (one reader thread?)"
    assert len(p) == 2 and all(same(a, b) for a, b in zip(t, p))


class UnevenLengths(Indexed):
    """Batches of 4 whose lengths agree (batches 0, 2, 4) or not: batch 1 mixes the first
    sample's length with another, batch 3 two others."""

    LENGTHS = [2] * 4 + [3, 3, 2, 2] + [3] * 4 + [4, 4, 5, 5] + [2] * 4

    def __getitem__(self, i):
        return torch.arange(self.LENGTHS[i], dtype=torch.float32) + i, i


@pytest.mark.parametrize("nw", [0, 2])
def test_a_batch_whose_shapes_differ_is_refused_at_it_and_the_next_batch_follows(nw):
    def match(b, torch_side):
        if torch_side:  # (torch's workers raise another RuntimeError: their batch's shared
            # storage does not fit)
            return "stack expects each tensor to be equal size" if nw == 0 else None
        return (r"stack expects each tensor to be equal size: field \[0\] has shape \(3,\) .*at "
                r"dataset index 4 and shape \(2,\) .* at dataset index 6" if b == 1 else
                r"stack expects each tensor to be equal size: field \[0\] has shape \(4,\) .*at "
                r"dataset index 12 and shape \(5,\) .* at dataset index 14")
    t, p = side_by_side(UnevenLengths(20), nw, (1, 3), RuntimeError, match)
    assert [len(b[0][0]) for b in p] == [2, 3, 2]
    assert all(same(a, b) for a, b in zip(t, p))


STAGED_ON_DEVICE_1 = """
import numpy as np, pinmem

class Ds:
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return np.arange(i % 3 + 1, dtype=np.float32) + i

def pad(samples):  # a collate_fn of one's own: the batch padded to its longest sample
    out = np.zeros((len(samples), max(len(s) for s in samples)), np.float32)
    for k, s in enumerate(samples):
        out[k, :len(s)] = s
    return out

class Varying(Ds):  # shapes vary between batches: the batches of another shape are staged
    def __getitem__(self, i):
        return np.full(i // 4 + 1, i, np.float32)

pinmem.set_device(0)
for ds, kw in ((Ds(), dict(collate_fn=pad)), (Varying(), {})):
    for nw in (0, 2):
        with pinmem.Loader(ds, batch_size=4, num_workers=nw, device="cuda:1", **kw) as p:
            for k, b in enumerate(p):
                assert pinmem.current_device() == 0, "the caller's device changed"
                host = np.empty(b.shape, np.float32)
                pinmem.copy(host, b).wait()
                want = pad([ds[i] for i in range(4 * k, 4 * k + 4)])
                assert np.array_equal(host, want), (k, host, want)
            assert p.stats()["staged_batches"] == 3 if kw else 2
print("ok")
"""


def test_batches_staged_for_device_k_leave_the_callers_device_alone():
    """Staging copies on the loader's device (device='cuda:1') from a thread of device 0, also
    on the main thread (num_workers=0, and batches stacked there); the caller stays on 0."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, PINMEM_BACKEND="host", PINMEM_HOST_DEVICES="2")
    r = subprocess.run([sys.executable, "-c", STAGED_ON_DEVICE_1], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def too_big_at_4(samples):
    """A collate_fn whose batch of sample 4 is 16 MiB; the others 1 KiB."""
    n = 16 << 20 if samples[0][1] == 4 else 1024
    return torch.full((n,), samples[0][1], dtype=torch.uint8), [s[1] for s in samples]


@pytest.mark.parametrize("nw", [0, 2])
def test_a_collated_batch_over_the_pinned_budget_fails_alone_naming_its_bytes(nw):
    with pinmem.Loader(Indexed(12), batch_size=4, num_workers=nw, collate_fn=too_big_at_4) as p:
        it = iter(p.as_torch())
        x, y = next(it)  # the loader's slots are pinned now: the budget is set above them
        assert y == [0, 1, 2, 3] and x.shape == (1024,)
        del x
        old = pinmem.budget()
        pinmem.set_budget(pinmem.stats()["pinned_bytes"] + (8 << 20))
        try:
            with pytest.raises(pinmem.BudgetError, match=r"pinmem.Loader: this batch, built "
                               r"outside the slots .* needs 16777216 bytes of pinned memory"):
                next(it)
            x, y = next(it)
            assert y == [8, 9, 10, 11] and int(x.cpu()[0]) == 8
        finally:
            pinmem.set_budget(old)


def host_copy(buf):
    """A device (or host) Buffer's values, copied to host memory."""
    out = np.empty(buf.shape, buf.dtype)
    pinmem.copy(out, buf).wait()
    return out


@pytest.mark.parametrize("nw", [0, 2])
def test_collated_device_batches_reuse_device_blocks_only_once_let_go(nw):
    ds = Ragged(51)
    order = [i for i in range(51) if i // 3 != 4]  # (pad refuses label 13)
    want = [pad([ds[i] for i in order[k:k + 3]])["x"].numpy() for k in range(0, 48, 3)]
    with pinmem.Loader(ds, batch_size=3, num_workers=nw, collate_fn=pad, sampler=order,
                       tensors=False) as p:
        held = list(p)  # every batch held: each in a block of its own, never overwritten
        assert len({b["x"].ptr for b in held}) == 16 == p.stats()["staged_device_blocks"]
        assert all(np.array_equal(host_copy(b["x"]), w) for b, w in zip(held, want))
        del held
        ptrs = []
        for k, b in enumerate(p):  # each batch let go before the next: blocks come back
            assert np.array_equal(host_copy(b["x"]), want[k])
            ptrs.append(b["x"].ptr)
            del b
        # At most the batches staged ahead (prefetch) plus the one held took a new block.
        assert p.stats()["staged_device_blocks"] - 16 <= (8 if nw else 0)
        assert len(set(ptrs)) < 16


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


def test_a_reused_device_block_waits_for_the_stream_that_read_it():
    """GPU: each batch is read on a side stream kept busy (torch.cuda._sleep) and let go at
    once; the next batches reuse its device block, and their copies must wait for that stream,
    or the sums read overwritten bytes."""
    if pinmem.backend() != "cuda" or not torch.cuda.is_available():
        pytest.skip("needs the cuda backend and torch with CUDA: the reuse of a device block "
                    "waits on a stream torch reads it on, which the host backend has not")
    ds = Ragged(51)
    order = [i for i in range(51) if i // 3 != 4]  # (pad refuses label 13)
    want = [float(pad([ds[i] for i in order[k:k + 3]])["x"].sum()) for k in range(0, 48, 3)]
    side = torch.cuda.Stream()
    sums = []
    with pinmem.Loader(ds, batch_size=3, collate_fn=pad, sampler=order) as p:
        it = iter(p.as_torch())
        for _ in range(16):
            with torch.cuda.stream(side):
                b = next(it)  # DLPack names `side`: it waits for the batch's copy
                torch.cuda._sleep(20_000_000)  # the read comes late on `side`
                sums.append(b["x"].sum())
            del b  # let go while `side` has not read it yet
        torch.cuda.synchronize()
        assert p.stats()["staged_device_blocks"] < 16  # blocks were reused
    assert [float(s) for s in sums] == want


def outcomes(loader, epochs, most=30):
    """Per epoch, each next() of one loop: a batch's labels, or the name of what it raised
    (after `most` calls: "..."; a loader that raised on every call never ends its epoch)."""
    out = []
    for _ in range(epochs):
        got, it = [], iter(loader)
        while True:
            if len(got) == most:
                got.append("...")
                break
            try:
                got.append(labels(next(it)))
            except StopIteration:
                break
            except Exception as e:
                got.append(type(e).__name__)
        out.append(got)
    return out


class Rotating(torch.utils.data.Sampler):
    """0..n-1 rotated by 3 more at each epoch, each iter() counted: an order that moves, so a
    sampler asked twice in one epoch shows."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def __len__(self):
        return self.n

    def __iter__(self):
        k, self.calls = self.calls, self.calls + 1
        return iter([(j + 3 * k) % self.n for j in range(self.n)])


@pytest.mark.parametrize("nw", [0, 2])
def test_an_error_keeps_the_epochs_sampler_order(nw):
    """An exception in dataset[i] with a sampler: the batches after it follow in the order the
    sampler gave for the epoch (it is asked once an epoch, also when the epoch's last batch
    fails), as DataLoader."""
    results = []
    for make in (DataLoader, lambda *a, **k: pinmem.Loader(*a, device="cpu", **k)):
        sampler = Rotating(8)
        loader = make(Indexed(8, fail_at=5), batch_size=2, sampler=sampler, num_workers=nw)
        results.append((outcomes(loader, 3), sampler.calls))
        if isinstance(loader, pinmem.Loader):
            loader.close()
    assert results[0] == results[1]
    assert results[0][0][2][-1] == "KeyError" and results[0][1] == 3  # the 3rd epoch's last


@pytest.mark.parametrize("nw", [0, 1])
def test_an_error_in_sample_0_is_its_batchs_alone(nw):
    """dataset[0] raising fails sample 0's batch only; a sampler without 0 never meets it."""
    for kw in ({}, {"sampler": [1, 2]}):
        results = []
        for make in (DataLoader, lambda *a, **k: pinmem.Loader(*a, device="cpu", **k)):
            loader = make(Indexed(4, fail_at=0), batch_size=1, num_workers=nw, **kw)
            results.append((outcomes(loader, 2), len(loader)))
            if isinstance(loader, pinmem.Loader):
                loader.close()
        assert results[0] == results[1], kw
        assert results[0][0][0][0] == ("KeyError" if not kw else [1])


class NeedsTwo(Exception):
    def __init__(self, a, b):  # pickled as NeedsTwo(a): cannot be made again from its args
        super().__init__(a)


class Unrebuildable(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 4:
            raise NeedsTwo("x", 2)
        return np.full(2, i, dtype=np.float32), i


def test_an_exception_that_cannot_be_rebuilt_fails_its_batch_alone():
    """An exception the main process cannot rebuild arrives as WorkerError (a RuntimeError, as
    DataLoader's), and the next batch follows."""
    t = DataLoader(Unrebuildable(), batch_size=3, num_workers=1)
    with pinmem.Loader(Unrebuildable(), batch_size=3, num_workers=1, device="cpu") as p:
        got = outcomes(p, 2)
    assert got == [[[0, 1, 2], "WorkerError", [6, 7]]] * 2
    assert outcomes(t, 1) == [[[0, 1, 2], "RuntimeError", [6, 7]]]


class Scalars(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor(i, dtype=torch.uint8), torch.zeros(1 + i // 2)


@pytest.mark.parametrize("nw", [0, 1])
def test_0d_leaves_keep_their_shape_on_the_staged_paths(nw):
    """0-d tensors out of a collate_fn of one's own (device batches) and out of samples whose
    shapes vary (batch_size=None) keep shape (), as DataLoader gives them."""
    keep = lambda b: b  # noqa: E731
    want = [[x[0].shape for x in b] for b in DataLoader(Scalars(), batch_size=2, collate_fn=keep)]
    with pinmem.Loader(Scalars(), batch_size=2, collate_fn=keep, num_workers=nw) as p:
        got = [[tuple(x[0].shape) for x in b] for b in p]
    assert got == [[tuple(s) for s in b] for b in want] == [[(), ()], [(), ()]]
    with pinmem.Loader(Scalars(), batch_size=None, num_workers=nw) as p:
        assert [tuple(b[0].shape) for b in p] == [()] * 4


def collate_through(batch):
    return torch.utils.data.default_collate(batch)


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64"])
def test_unsigned_tensors_from_worker_processes(dtype):
    """torch's own pickling cannot load an unsigned tensor (uint16/32/64) again: such samples
    whose shapes vary between batches (sent pickled) and a collate_fn's tensors come from the
    worker processes all the same, as from DataLoader's."""
    dt = getattr(torch, dtype)

    class Growing(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.full((1 + i // 2,), i, dtype=dt)

    for kw in ({}, {"collate_fn": torch.utils.data.default_collate},
               {"collate_fn": collate_through}):
        want = [b.tolist() for b in DataLoader(Growing(), batch_size=2, num_workers=2, **kw)]
        with pinmem.Loader(Growing(), batch_size=2, num_workers=2, device="cpu", **kw) as p:
            got = list(p)
        assert [b.tolist() for b in got] == want and got[0].dtype == dt, kw


# ---- leaves and containers as default_collate takes them ---------------------------------------

_NAMES = np.array(["cat", "dog", "eel", "fox"])


class _Leaves(torch.utils.data.Dataset):
    """Samples whose leaves DataLoader batches and pinmem refused or changed: a NumPy string
    (np.str_, a str), a conjugate view, dicts whose keys come in another order, np.matrix."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        x = torch.tensor([1 + 1j * i, 2j])
        inner = {}
        if i % 2:
            inner["label"] = i
        inner["image"] = torch.full((2,), float(i))
        if not i % 2:
            inner["label"] = i
        return {"name": _NAMES[i], "z": x.conj() if i == 3 else x, "d": inner,
                "m": np.matrix([[i, 1], [2, 3]])}


class _LeavesStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return (_Leaves()[i] for i in range(4))


def _same_batches(a, b):
    assert type(a) is type(b) or isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), \
        (type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same_batches(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same_batches(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    else:
        assert a == b and type(a) is type(b), (a, b)


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("nw", [0, 1])
def test_numpy_strings_conjugate_views_key_order_and_matrices_as_dataloader(nw, stream):
    ds = _LeavesStream() if stream else _Leaves()
    want = list(DataLoader(ds, batch_size=2, num_workers=nw))
    with pinmem.Loader(ds, batch_size=2, num_workers=nw, device="cpu") as p:
        got = list(p)
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        _same_batches(g, w)
    assert got[1]["name"] == [np.str_("eel"), np.str_("fox")]
    assert got[1]["z"][1].tolist() == [1 - 3j, -2j]          # the conjugate's values
    assert got[1]["d"]["label"].tolist() == [2, 3]           # keys taken in the first's order


class _NamesAndNoBoxes(torch.utils.data.IterableDataset):
    def __iter__(self):
        return ((torch.zeros(0, 2), f"name{i}") for i in range(4))


@pytest.mark.parametrize("nw", [0, 1])
def test_a_stream_of_strings_and_empty_tensors_gives_tensors(nw):
    want = next(iter(DataLoader(_NamesAndNoBoxes(), batch_size=2, num_workers=nw)))
    with pinmem.Loader(_NamesAndNoBoxes(), batch_size=2, num_workers=nw, device="cpu") as p:
        got = next(iter(p))
    assert isinstance(got[0], torch.Tensor) and got[0].shape == want[0].shape == (2, 0, 2)
    assert list(got[1]) == list(want[1]) == ["name0", "name1"]


class _Meta17(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"image": torch.zeros(3), **{f"meta{k}": f"v{i}" for k in range(16)}}


class _Arrays17(_Meta17):
    def __getitem__(self, i):
        return [np.full(2, k + i) for k in range(17)]


class _MetaStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return (_Meta17()[i] for i in range(4))


@pytest.mark.parametrize("nw", [0, 1])
def test_strings_beside_the_arrays_are_not_counted_in_the_limit_of_16(nw):
    for ds in (_Meta17(), _MetaStream()):
        want = list(DataLoader(ds, batch_size=2, num_workers=nw))
        with pinmem.Loader(ds, batch_size=2, num_workers=nw, device="cpu") as p:
            got = list(p)
        assert len(got) == len(want) == 2
        for g, w in zip(got, want):
            assert list(g) == list(w) and torch.equal(g["image"], w["image"])
            assert all(g[f"meta{k}"] == w[f"meta{k}"] for k in range(16))
    with pinmem.Loader(_Arrays17(), batch_size=2, num_workers=nw, device="cpu") as p:
        with pytest.raises(pinmem.InvalidError, match="17 arrays and numbers; a batch holds"):
            next(iter(p))


class _Augmented(torch.utils.data.Dataset):
    """Random augmentation whose string describes the array of the same call."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        import random
        v = random.randrange(10**6)
        return np.full(2, v), f"aug{v}"


@pytest.mark.parametrize("nw", [0, 2])
def test_an_index_read_twice_keeps_each_rows_strings_with_its_arrays(nw):
    """A sampler that repeats indices (drawing with replacement): each row's string comes from
    the same read as its array, whichever of the index's reads finishes first."""
    sampler = [0, 1, 0, 1] * 8
    with pinmem.Loader(_Augmented(), batch_size=4, sampler=sampler, num_workers=nw,
                       device="cpu") as p:
        rows = [(int(x[0]), s) for _ in range(3) for b in p for x, s in zip(*b)]
    assert len(rows) == 96
    assert [r for r in rows if f"aug{r[0]}" != r[1]] == []


class _Row(list):
    """A list subclass a dataset returns."""


class _Containers(torch.utils.data.Dataset):
    def __init__(self, kind):
        self.kind = kind

    def __len__(self):
        return 4

    def __getitem__(self, i):
        import collections
        d = {"x": torch.full((2,), float(i)), "y": i}
        if self.kind == "row":
            return _Row(d.values())
        return {"ordered": collections.OrderedDict, "user": collections.UserDict}[self.kind](d)


@pytest.mark.parametrize("kind", ["ordered", "user", "row"])
@pytest.mark.parametrize("nw", [0, 1])
def test_container_types_are_kept_as_dataloader_keeps_them(kind, nw):
    """default_collate makes a batch of the sample's own container type: OrderedDict, a
    UserDict (a tokenizer's BatchEncoding is one), a list subclass."""
    want = list(DataLoader(_Containers(kind), batch_size=2, num_workers=nw))
    with pinmem.Loader(_Containers(kind), batch_size=2, num_workers=nw, device="cpu") as p:
        got = list(p)
    for g, w in zip(got, want):
        assert type(g) is type(w) and type(g).__name__ != "dict"
        gv = list(g.values()) if hasattr(g, "values") else list(g)
        wv = list(w.values()) if hasattr(w, "values") else list(w)
        assert all(torch.equal(a, b) for a, b in zip(gv, wv))


class _OptionalLabel(torch.utils.data.Dataset):
    """A label missing (None) for sample 0: that place holds objects, one per row."""

    def __init__(self):
        self.t = [torch.full((2,), float(i)) for i in range(4)]

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.zeros(2), (None if i == 0 else i), ("none" if i == 0 else self.t[i])


@pytest.mark.parametrize("nw", [0, 2])
def test_values_where_the_first_sample_held_an_object_arrive_as_given(nw):
    """Where the first sample held None or a string, later values arrive one per row as the
    dataset gave them (Python numbers, tensors), alike with threads and worker processes,
    and a tensor there is a copy: changing the batch leaves the dataset as it was."""
    ds = _OptionalLabel()
    with pinmem.Loader(ds, batch_size=2, num_workers=nw, device="cpu") as p:
        batches = list(p)
    assert [b[1] for b in batches] == [(None, 1), (2, 3)]
    assert all(type(v) is int for v in batches[1][1])
    t2, t3 = batches[1][2]
    assert isinstance(t2, torch.Tensor) and torch.equal(t2, torch.full((2,), 2.0))
    t2.fill_(-1)
    assert torch.equal(ds.t[2], torch.full((2,), 2.0))


@pytest.mark.parametrize("nw", [0, 2])
def test_a_loop_overtaken_by_a_newer_one_is_refused(nw):
    """DataLoader's iterators are independent epochs; pinmem's loader has one epoch at a time,
    so `next(iter(loader))` inside a loop begins the next epoch. The outer loop went on with the
    new epoch's batches and never ended (2, 3, 2, 3, ...): now it refuses, naming why."""
    with pinmem.Loader(Indexed(6), batch_size=2, num_workers=nw, device="cpu") as p:
        seen = []
        with pytest.raises(pinmem.StateError, match="another loop over this loader began"):
            for b in p:
                seen.append(labels(b))
                peek = next(iter(p))
                assert labels(peek) == [0, 1]
                del peek
        assert seen == [[0, 1]]
        assert run(p) == [[0, 1], [2, 3], [4, 5]]  # a new loop is a whole epoch
        it = iter(p)
        assert labels(next(it)) == [0, 1]
        assert run(p, stop_after=1) == [[0, 1]]  # a loop after `it` overtakes it
        with pytest.raises(pinmem.StateError):
            next(it)
        with pytest.raises(StopIteration):
            next(it)
