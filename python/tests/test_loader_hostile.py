"""pinmem.Loader under hostile input: datasets with odd attributes, samplers that yield odd
things, arguments at and past their limits, workers whose errors are hard to report, and close()
or state calls from other threads. Each test reads what was delivered (rows carry their index),
on the host backend with batches in host memory.
"""
import gc
import math
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import pinmem
from conftest import skip_unless_torch, warnings_in_forked_child

try:
    import torch
except ImportError:
    torch = None


def rows(b):
    return np.asarray(b).reshape(len(np.asarray(b)), -1)


class Indexed:
    """Sample i: int64 [i, i, i] (its own index in every element)."""

    def __init__(self, n=24):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return np.full(3, i, dtype=np.int64)


def first_column(batches):
    return [int(r[0]) for b in batches for r in np.asarray(b)]


# ---- datasets told by what they are ---------------------------------------------------------

def test_tensor_dataset_subclass_goes_through_its_getitem():
    skip_unless_torch()

    class Doubled(torch.utils.data.TensorDataset):
        def __getitem__(self, i):
            x, = super().__getitem__(i)
            return x * 2

    ds = Doubled(torch.arange(12, dtype=torch.float32))
    for nw in (0, 2):
        with pinmem.Loader(ds, batch_size=4, device="cpu", num_workers=nw) as loader:
            got = [np.asarray(b).tolist() for b in loader]
        assert got == [[0., 2., 4., 6.], [8., 10., 12., 14.], [16., 18., 20., 22.]], nw
    # A plain TensorDataset is still read as arrays (on pinmem's threads, no workers).
    plain = torch.utils.data.TensorDataset(torch.arange(6), torch.arange(6) * 10)
    with pinmem.Loader(plain, batch_size=3, device="cpu", num_workers=2) as loader:
        got = [(np.asarray(a).tolist(), np.asarray(b).tolist()) for a, b in loader]
        assert loader.worker_pids() == []
    assert got == [([0, 1, 2], [0, 10, 20]), ([3, 4, 5], [30, 40, 50])]


class WithShape(Indexed):
    """A map-style dataset with a `shape` attribute (a sample-shape field), dict samples and an
    epoch counter that changes what __getitem__ returns."""
    shape = (3,)

    def __init__(self, n=8):
        super().__init__(n)
        self.calls = 0

    def __getitem__(self, i):
        self.calls += 1
        return {"x": super().__getitem__(i), "calls": np.int64(self.calls)}


def test_shape_attribute_does_not_make_a_dataset_an_array():
    ds = WithShape()
    with pinmem.Loader(ds, batch_size=4, device="cpu") as loader:
        first = [{k: np.asarray(v).copy() for k, v in b.items()} for b in loader]
        second = [{k: np.asarray(v).copy() for k, v in b.items()} for b in loader]
    assert [r.tolist() for b in first for r in b["x"][:, :1]] == [[i] for i in range(8)]
    # read again in the second epoch (not materialised once at construction)
    assert second[0]["calls"][0] > first[-1]["calls"][-1]


def test_arrays_by_what_they_are():
    a = np.arange(12, dtype=np.int32).reshape(6, 2)
    for arr in (a, memoryview(a), bytearray(a.tobytes())):
        with pinmem.Loader(arr, batch_size=3, device="cpu") as loader:
            got = b"".join(np.asarray(b).tobytes() for b in loader)
        assert got == a.tobytes()


# ---- samplers ------------------------------------------------------------------------------

@pytest.mark.parametrize("nw", [0, 2])
def test_batch_indices_are_the_samplers_dataset_indices(nw):
    order = [5, 3, 3, 63, 0, 17]
    source = Indexed(64) if nw else np.repeat(np.arange(64, dtype=np.int64)[:, None], 3, 1)
    with pinmem.Loader(source, batch_size=4, sampler=order, device="cpu",
                       num_workers=nw) as loader:
        got = [(list(b.indices), first_column([b[0]])) for b in loader.batches()]
    assert got == [([5, 3, 3, 63], [5, 3, 3, 63]), ([0, 17], [0, 17])]


@pytest.mark.parametrize("bad,pos", [([0, 1.9, 2], 1), ([0, 1, "3"], 2),
                                     ([np.float64(2.0)], 0), ([True, 1], 0)])
def test_sampler_non_integers_are_refused_by_position(bad, pos):
    loader = pinmem.Loader(Indexed(), batch_size=2, sampler=bad, device="cpu")
    with pytest.raises(pinmem.InvalidError, match=rf"sampler \(list\) yielded .* position {pos}"):
        next(iter(loader))  # the sampler is iterated at the epoch's start, as torch's
    loader.close()


def test_sampler_negative_and_past_the_end_are_refused():
    for bad in ([0, -1], [0, 24]):
        loader = pinmem.Loader(Indexed(), batch_size=2, sampler=bad, device="cpu")
        with pytest.raises(pinmem.InvalidError,
                           match=r"position 1: the dataset has indices 0\.\.23"):
            next(iter(loader))
        loader.close()


def test_sampler_integer_kinds_are_accepted():
    kinds = [np.int64(3), np.uint8(4), 5]
    if torch is not None:
        kinds.append(torch.tensor(6))
    with pinmem.Loader(Indexed(), batch_size=2, sampler=kinds, device="cpu") as loader:
        assert first_column(loader) == [3, 4, 5, 6][:len(kinds)]


class Growing:
    """A sampler whose length changes between epochs (curriculum learning)."""

    def __init__(self):
        self.sizes = [8, 24, 4]
        self.epoch = 0

    def __len__(self):
        return self.sizes[self.epoch % 3]

    def __iter__(self):
        n = len(self)
        self.epoch += 1
        return iter(range(n))


def test_sampler_whose_length_changes_between_epochs():
    s = Growing()
    with pinmem.Loader(Indexed(), batch_size=4, sampler=s, device="cpu") as loader:
        for want in (8, 24, 4):
            assert first_column(loader) == list(range(want))


def test_dataset_that_grows_between_epochs_with_fresh_workers():
    ds = Indexed(8)
    with pinmem.Loader(ds, batch_size=4, device="cpu", num_workers=2) as loader:
        assert first_column(loader) == list(range(8))
        ds.n = 12
        assert first_column(loader) == list(range(12))


# ---- errors from the dataset ----------------------------------------------------------------

class StopsAt(Indexed):
    def __getitem__(self, i):
        if i == 5:
            raise StopIteration
        return super().__getitem__(i)


@pytest.mark.parametrize("nw", [0, 2])
def test_stop_iteration_in_getitem_is_an_error_naming_the_index(nw):
    with pinmem.Loader(StopsAt(), batch_size=2, device="cpu", num_workers=nw) as loader:
        got = []
        with pytest.raises(RuntimeError, match=r"dataset\[5\] raised StopIteration"):
            for b in loader:
                got.append(first_column([b]))
        assert got == [[0, 1], [2, 3]]


class BadStr(Exception):
    def __str__(self):
        raise ValueError("no text")


class Raising(Indexed):
    def __init__(self, exc):
        super().__init__()
        self.exc = exc

    def __getitem__(self, i):
        if i == 7:
            raise self.exc()
        return super().__getitem__(i)


def huge_error():
    return ValueError("x" * 300_000)


@pytest.mark.parametrize("make,kind", [(BadStr, "BadStr"), (huge_error, "ValueError"),
                                       (KeyboardInterrupt, "KeyboardInterrupt")])
def test_worker_errors_that_were_lost_name_index_and_type(make, kind):
    with pinmem.Loader(Raising(make), batch_size=2, device="cpu", num_workers=2) as loader:
        with pytest.raises(Exception) as e:
            for _ in loader:
                pass
    text = str(e.value)
    assert kind in text and "dataset[7]" in text, text[:2000]
    assert "exited with code" not in text
    assert not isinstance(e.value, KeyboardInterrupt)
    if kind == "ValueError":
        assert isinstance(e.value, ValueError) and "more characters cut" in text
        assert len(text) < 100_000


def interrupting_init(worker_id):
    raise KeyboardInterrupt


def test_keyboard_interrupt_in_worker_init_fn_is_a_worker_error():
    with pytest.raises(pinmem.WorkerError, match="KeyboardInterrupt"):
        with pinmem.Loader(Indexed(), batch_size=2, device="cpu", num_workers=2,
                           worker_init_fn=interrupting_init) as loader:
            for _ in loader:
                pass


class HugeKeys(Indexed):
    def __getitem__(self, i):
        return {"k" * 200_000: super().__getitem__(i)}


def test_huge_dict_key_is_refused_by_name():
    with pinmem.Loader(HugeKeys(), batch_size=2, device="cpu", num_workers=1) as loader:
        with pytest.raises(pinmem.InvalidError, match="dict keys"):
            next(iter(loader))


# ---- arguments ------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,name", [(dict(batch_size=2.7), "batch_size"),
                                     (dict(seed=1.5), "seed"), (dict(epochs=1.5), "epochs"),
                                     (dict(num_workers=1.0), "num_workers"),
                                     (dict(timeout=float("nan")), "timeout"),
                                     (dict(timeout=-1), "timeout"),
                                     (dict(device="cuda: 1"), "device"),
                                     (dict(device="cuda:+2"), "device"),
                                     (dict(device=-1), "device"),
                                     (dict(prefetch_factor=0), "prefetch_factor")])
def test_bad_arguments_are_refused_by_name(kw, name):
    with pytest.raises(pinmem.InvalidError, match=rf"\b{name}(=\S+)? must be"):
        pinmem.Loader(np.arange(8), **kw)


@pytest.mark.parametrize("t", [math.inf, 1e12])
def test_extreme_timeouts_are_no_limit(t):
    with pinmem.Loader(Indexed(), batch_size=4, device="cpu", num_workers=1,
                       timeout=t) as loader:
        assert first_column(loader) == list(range(24))
        assert loader._timeout == 0


def test_negative_seed_is_accepted_and_reproducible():
    def run():
        with pinmem.Loader(Indexed(), batch_size=4, device="cpu", num_workers=2, shuffle=True,
                           seed=-1) as loader:
            return first_column(loader)
    a = run()
    assert sorted(a) == list(range(24)) and a == run()


def test_too_many_workers_refused_before_any_process_starts():
    before = len(mp.active_children())
    with pytest.raises(pinmem.InvalidError, match=r"num_workers=130 .* 128 worker processes"):
        pinmem.Loader(Indexed(), batch_size=2, device="cpu", num_workers=130)
    assert len(mp.active_children()) == before


def test_device_forms():
    assert pinmem.loader._device_arg(0) == (True, 0)
    assert pinmem.loader._device_arg("cuda:3") == (True, 3)
    assert pinmem.loader._device_arg("cpu") == (False, None)
    if torch is not None:
        assert pinmem.loader._device_arg(torch.device("cuda", 1)) == (True, 1)
        assert pinmem.loader._device_arg(torch.device("cpu")) == (False, None)
        with pinmem.Loader(np.arange(4), batch_size=2, device=torch.device("cpu")) as loader:
            assert [np.asarray(b).tolist() for b in loader] == [[0, 1], [2, 3]]


def test_environment_values_never_break_import():
    env = dict(os.environ, PINMEM_PROCESS_DEPTH="two", PINMEM_PROCESS_CLAIM="99999999999999")
    out = subprocess.run([sys.executable, "-c",
                          "import pinmem; print(pinmem.get_option('process_depth'));"
                          "print(pinmem.get_option('process_claim'));"
                          "print(pinmem.loader._PROCESS_DEPTH, pinmem.loader._PROCESS_CLAIM)"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "PINMEM_PROCESS_DEPTH='two' ignored" in lines[0], lines
    assert "ignored" in lines[1], lines
    assert lines[2] == "2 8"


# ---- state ----------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value", [("epoch", 2**64 + 3), ("batch", 1.5), ("batch", -1),
                                       ("seed", "0")])
def test_impossible_state_is_refused_and_the_loader_goes_on(key, value):
    with pinmem.Loader(np.arange(8), batch_size=2, device="cpu") as loader:
        state = dict(loader.state_dict(), **{key: value})
        with pytest.raises(pinmem.InvalidError, match=rf"state_dict\['{key}'\] must be"):
            loader.load_state_dict(state)
        assert [np.asarray(b).tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]


class Sticks(Indexed):
    """Index 9 hangs for a long time, in worker processes only."""

    def __init__(self):
        super().__init__(40)
        self.owner = os.getpid()

    def __getitem__(self, i):
        if i == 9 and os.getpid() != self.owner:
            time.sleep(60)
        return super().__getitem__(i)


def test_stuck_worker_at_load_state_dict_honours_timeout_and_keeps_its_error():
    loader = pinmem.Loader(Sticks(), batch_size=2, device="cpu", num_workers=2, timeout=2)
    it = iter(loader)
    assert first_column([next(it)]) == [0, 1]
    state = loader.state_dict()
    time.sleep(0.5)  # the workers have claimed index 9 by now
    t0 = time.monotonic()
    with pytest.raises(pinmem.WorkerError, match="within 2 s"):
        loader.load_state_dict(state)
    assert time.monotonic() - t0 < 30  # (the drain used to wait 60 s)
    with pytest.raises(pinmem.WorkerError, match="earlier error"):
        next(iter(loader))
    loader.close()
    with pytest.raises(pinmem.StateError):
        len(loader)


class SlowIndexed(Indexed):
    def __getitem__(self, i):
        time.sleep(0.02)
        return super().__getitem__(i)


@pytest.mark.parametrize("nw,sampler", [(0, None), (0, list(range(400))), (2, None)])
def test_close_from_another_thread_while_iterating(nw, sampler):
    gc.collect()  # batches of earlier tests give their memory back first
    pinned0 = pinmem.stats()["in_use_bytes"]
    loader = pinmem.Loader(SlowIndexed(400), batch_size=4, device="cpu", num_workers=nw,
                           sampler=sampler)
    closer = threading.Timer(0.3, loader.close)
    closer.start()
    got = 0
    with pytest.raises(pinmem.StateError):
        for b in loader:
            got += 1
            b = None
    closer.join()
    assert got < 100  # it did not run to the end
    for call in (lambda: len(loader), lambda: iter(loader).__next__(), loader.state_dict,
                 lambda: loader.load_state_dict({})):
        with pytest.raises(pinmem.StateError):
            call()
    gc.collect()
    assert pinmem.stats()["in_use_bytes"] == pinned0


# ---- a worker stuck in a read ---------------------------------------------------------------

class _StuckAt9(Indexed):
    """Sample 9 takes a minute (a read from a peer that went away)."""

    def __getitem__(self, i):
        if i == 9:
            time.sleep(60)
        return super().__getitem__(i)


def test_ctrl_c_interrupts_a_wait_for_a_stuck_worker():
    """Ctrl-C (SIGINT) while next() waits for a batch a worker process is stuck reading raises
    KeyboardInterrupt at once, as DataLoader does; the wait in C ran until the read ended."""
    import signal
    ld = pinmem.Loader(_StuckAt9(32), batch_size=4, num_workers=2, device="cpu")
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in ld:
                pass
        assert time.monotonic() - t0 < 20, "the interrupt waited for the stuck read"
    finally:
        timer.cancel()
        ld.close()


class _SlowOnce(Indexed):
    """Sample 13 takes 3 s the first time any worker reads it (a flag file says so)."""

    def __init__(self, n, flag):
        super().__init__(n)
        self.flag = str(flag)

    def __getitem__(self, i):
        if i == 13 and not os.path.exists(self.flag):
            open(self.flag, "w").close()
            time.sleep(3)
        return super().__getitem__(i)


def test_a_worker_past_its_timeout_ends_the_loop_and_the_next_starts_afresh(tmp_path):
    """A worker past `timeout`: that next() raises, the loop ends there (before, every later
    next() raised the same error at once, without end), and the next loop reads every batch
    on new workers (before, the loader could not go on)."""
    ld = pinmem.Loader(_SlowOnce(32, tmp_path / "flag"), batch_size=4, num_workers=2,
                       timeout=1, device="cpu")
    try:
        it = iter(ld)
        got, errors = [], 0
        for _ in range(20):
            try:
                got.append(int(np.asarray(next(it))[0, 0]))
            except StopIteration:
                break
            except pinmem.WorkerError as e:
                errors += 1
                assert "timeout=1" in str(e), e
        assert errors == 1, errors
        assert got == [0, 4, 8], got
        assert first_column(ld) == list(range(32))
    finally:
        ld.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_dropping_the_parents_batches_is_quiet():
    """A child forked while the parent holds batches (a DataLoader's or multiprocessing's fork
    workers, which may collect the parent's garbage) drops its copies of them: they are the
    parent's to give back, so the child warns of nothing, and the parent's batches and loader
    go on."""
    X = np.arange(64, dtype=np.float32).reshape(32, 2)
    with pinmem.Loader(X, batch_size=4, device="cpu") as ld:
        held = list(ld)
        said = warnings_in_forked_child(held.clear)
        assert said == "", said
        assert [np.asarray(b)[0, 0] for b in held] == [8.0 * k for k in range(8)]
        assert [np.asarray(b)[0, 0] for b in ld] == [8.0 * k for k in range(8)]
    del held
    gc.collect()
    assert pinmem.stats()["in_use_bytes"] == 0


def test_a_datetime_field_is_refused_without_talk_of_a_device():
    """A dataset's datetime64 field has no tensor type: refused (torch's collate refuses it too),
    and the reason names the dtype, not a device the batch was never going to."""
    class D:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"t": np.datetime64("2020-01-01") + i, "x": np.float32(i)}

    with pytest.raises(pinmem.InvalidError) as e:
        list(pinmem.Loader(D(), batch_size=2, device="cpu"))
    assert "datetime64" in str(e.value) and "device" not in str(e.value), str(e.value)
