"""Sharding across processes, as torchrun runs a job: N = 3 processes (multiprocessing spawn),
each with RANK / WORLD_SIZE in its environment and its own pinmem.Loader over the same dataset,
on the host backend with three simulated devices and device = rank (PINMEM_DEVICE). Across
ranks every sample is delivered exactly once per epoch when 3 divides the sample count; when it
does not, the documented padding rule holds (the epoch's order is padded to a multiple of 3 by
repeating its first samples: with 50 samples, position 50 is position 0 again, so rank 2's last
sample is rank 0's first), and with drop_last every delivered sample is delivered once. Shuffle on and off, two
epochs (a new order each epoch when shuffling), an array dataset and a map-style Python dataset
read by worker processes.

Each rank returns what it delivered: the dataset index written into every sample, so the check
reads the data, not the loader's account of it.
"""
import multiprocessing as mp
import os
import sys

import numpy as np
import pytest

WORLD = 3
TIMEOUT = 120  # seconds for all ranks together: a hung rank fails the test


class Indexed:
    """A map-style dataset whose sample i is [i, 7i+1, ...] (never all zero)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.array([i, 7 * i + 1, 3 * i + 2, 11], dtype=np.int64)


def _rank_main(rank, kind, n, shuffle, drop_last, epochs, batch_size):
    """One rank: the dataset indices it delivered, one list per epoch."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), PINMEM_BACKEND="host",
                      PINMEM_HOST_DEVICES=str(WORLD), PINMEM_DEVICE=str(rank))
    import pinmem
    if kind == "array":
        data = np.stack([Indexed(n)[i] for i in range(n)])
        kw = {}
    else:
        data = Indexed(n)
        kw = dict(num_workers=2, worker_mode="process")
    loader = pinmem.Loader(data, batch_size=batch_size, shuffle=shuffle, seed=1234,
                           drop_last=drop_last, device="cpu", **kw)
    assert pinmem.current_device() == rank  # PINMEM_DEVICE made it current at pm_init
    out = []
    try:
        for _ in range(epochs):
            got = []
            for b in loader:
                a = np.array(b, copy=True).reshape(-1, 4)
                assert (a[:, 1] == 7 * a[:, 0] + 1).all(), "a sample's bytes were not its own"
                got.extend(int(i) for i in a[:, 0])
                b = None
            out.append(got)
    finally:
        loader.close()
    # Device delivery on device "cuda:<rank>" from a thread of device 0: the batches' bytes
    # are this rank's shard and the thread's device comes back unchanged.
    pinmem.set_device(0)
    dl = pinmem.Loader(np.stack([Indexed(n)[i] for i in range(n)]), batch_size=batch_size,
                       shuffle=shuffle, seed=1234, drop_last=drop_last, device=f"cuda:{rank}")
    try:
        assert pinmem.current_device() == 0
        got = []
        for b in dl:
            host = np.empty(b.shape, dtype=np.int64)
            pinmem.copy(host, b)
            got.extend(int(i) for i in host[:, 0])
            b = None
        assert got == out[0], "device delivery differs from host delivery"
    finally:
        dl.close()
    return out


def _rank_entry(q, rank, *args):
    try:
        q.put((rank, _rank_main(rank, *args), None))
    except BaseException as e:  # reported to the test, which fails with it
        q.put((rank, None, repr(e)))


def run_ranks(kind, n, shuffle, drop_last, epochs=2, batch_size=4):
    """Start the ranks as torchrun does (one process each, RANK / WORLD_SIZE per process), and
    collect what each delivered. Plain processes, not a Pool: a rank's Loader starts worker
    processes of its own, which a daemonic pool process may not."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_entry,
                         args=(q, r, kind, n, shuffle, drop_last, epochs, batch_size))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(WORLD):
            rank, out, err = q.get(timeout=TIMEOUT)
            assert err is None, f"rank {rank}: {err}"
            results[rank] = out
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    assert all(p.exitcode == 0 for p in procs)
    return [results[r] for r in range(WORLD)]


CASES = [(kind, shuffle) for kind in ("array", "python") for shuffle in (False, True)]


@pytest.mark.parametrize("kind,shuffle", CASES)
def test_every_sample_once_per_epoch(kind, shuffle):
    n = 48  # 3 divides it
    per_rank = run_ranks(kind, n, shuffle, drop_last=False)
    for epoch in range(2):
        got = [per_rank[r][epoch] for r in range(WORLD)]
        assert all(len(g) == n // WORLD for g in got)
        everything = sorted(i for g in got for i in g)
        assert everything == list(range(n)), f"epoch {epoch}: not every sample exactly once"
    if shuffle:
        assert per_rank[0][0] != per_rank[0][1], "the order did not change between epochs"
        assert per_rank[0][0] != sorted(per_rank[0][0]), "shuffle left the order as it was"
    else:  # rank r gets positions r, r + 3, ...
        for r in range(WORLD):
            assert per_rank[r][0] == list(range(r, n, WORLD))


@pytest.mark.parametrize("kind,shuffle", CASES)
def test_padding_when_world_does_not_divide(kind, shuffle):
    n = 50  # 50 = 3 * 16 + 2: padded to 51 with the epoch's first sample
    per_rank = run_ranks(kind, n, shuffle, drop_last=False, epochs=1)
    got = [per_rank[r][0] for r in range(WORLD)]
    assert all(len(g) == 17 for g in got), "every rank delivers the same number of samples"
    counts = np.bincount([i for g in got for i in g], minlength=n)
    assert (counts >= 1).all(), "a sample was never delivered"
    # The padded position 50 is the order's position 0 repeated; it falls to rank 50 % 3 = 2.
    assert counts.sum() == 51
    assert list(np.flatnonzero(counts == 2)) == [got[0][0]]
    assert got[2][-1] == got[0][0]


@pytest.mark.parametrize("shuffle", (False, True))
def test_drop_last_delivers_each_at_most_once(shuffle):
    n = 50  # cut to 48 = 16 per rank; batches of 5: three full batches per rank, one dropped
    per_rank = run_ranks("array", n, shuffle, drop_last=True, epochs=1, batch_size=5)
    got = [per_rank[r][0] for r in range(WORLD)]
    assert all(len(g) == 15 for g in got)
    every = [i for g in got for i in g]
    assert len(every) == len(set(every)) == 45


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
