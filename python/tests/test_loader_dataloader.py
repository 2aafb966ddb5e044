"""pinmem.Loader beside torch.utils.data.DataLoader: the habits of DataLoader users, run side by
side on the same dataset and arguments (host backend, batches in host memory), each comparing
the samples delivered. Differences that remain are refused with a message naming the argument.
"""
import numpy as np
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
    with pytest.raises(pinmem.InvalidError, match="collate_fn"):
        pinmem.Loader(Indexed(), collate_fn=lambda xs: xs)
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


class Empty(Indexed):
    def __getitem__(self, i):
        return np.zeros((0, 3), np.float32), i


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(4))


def test_what_pinmem_cannot_batch_is_refused_by_name():
    with pytest.raises(pinmem.InvalidError, match="IterableDataset is not supported"):
        pinmem.Loader(Stream(), batch_size=2)
    for nw in (0, 1):
        with pinmem.Loader(Empty(), batch_size=2, device="cpu", num_workers=nw) as loader:
            with pytest.raises(pinmem.InvalidError, match=r"field \[0\]: an empty array"):
                next(iter(loader))
    with pytest.raises(pinmem.InvalidError, match="samples are empty"):
        pinmem.Loader(np.zeros((4, 0)), batch_size=2)


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
