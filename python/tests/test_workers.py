"""pinmem.Loader's worker processes for map-style Python datasets (worker_mode="process").

What torch.utils.data.DataLoader users rely on, on the host backend with batches in host memory
(device='cpu'): start methods, sample structures, errors in and deaths of workers, the main
process dying, Ctrl-C, seeding, get_worker_info, persistent workers, samplers, resume, sharding,
refused keyword arguments, and that nothing leaks.

Samples carry their own dataset index (and often the pid of the process that read them) as
leaves, so every check reads what was delivered, not what the loader says it delivered.

Every test here starts processes, and a process that never answers must fail its test, not
stall the run: hang_guard raises in the test after its limit (SIGALRM), and if the main thread is
stuck where no signal handler runs, faulthandler prints every thread's stack and ends the run.
"""
import faulthandler
import functools
import gc
import multiprocessing as mp
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import pinmem
from conftest import skip_unless_torch

try:  # imported before the workers start, so they seed torch's generator too
    import torch
except ImportError:
    torch = None

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_LIMIT = 60  # seconds a test may take before it fails as hung
N = 200             # samples of the usual dataset: a few hundred, small arrays
BIG_N = 1300        # datasets whose faulty index (BAD) must not read as a line number
BAD = 1234          # (this file has fewer lines than that)


# ---- the hang guard ----------------------------------------------------------------------------

class HangError(Exception):
    pass


def limit(seconds):
    """A test's hang limit, when it is not DEFAULT_LIMIT."""
    def mark(fn):
        fn.hang_limit = seconds
        return fn
    return mark


@pytest.fixture(autouse=True)
def hang_guard(request):
    seconds = getattr(request.function, "hang_limit", DEFAULT_LIMIT)
    name = request.node.name

    def on_alarm(signum, frame):
        raise HangError(f"{name} did not finish within {seconds} s: a hang")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    faulthandler.dump_traceback_later(seconds + 30, exit=True)
    spawned_before = set(child_pids())
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, old)
        # A failed test may leave workers behind: end them so they do not disturb the next test.
        for pid in set(child_pids()) - spawned_before:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


# ---- processes, fds, memory --------------------------------------------------------------------

_MP_SERVICES = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def proc_state(pid):
    """The state letter of a process ('R', 'S', 'Z'...), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat[stat.rindex(")") + 2]


def alive(pid):
    """Running: a zombie has exited (an orphan's zombie may wait for a PID 1 that never reaps)."""
    return proc_state(pid) not in (None, "Z")


def child_pids(parent=None):
    """Pids of the children of parent (this process), without multiprocessing's own service
    processes (resource tracker, fork server), which live for the whole run by design."""
    parent = os.getpid() if parent is None else parent
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            if int(stat[stat.rindex(")") + 2:].split()[1]) != parent:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        if not any(h in cmdline for h in _MP_SERVICES):
            out.append(int(entry))
    return out


def fd_table():
    """{fd: what it points at} of this process."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:
            pass  # the listing's own fd, closed already
    return out


def used_by_another_process(path):
    """Whether a process other than this one has path open or mapped."""
    me = str(os.getpid())
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or entry == me:
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                if path in f.read():
                    return True
            for fd in os.listdir(f"/proc/{entry}/fd"):
                if os.readlink(f"/proc/{entry}/fd/{fd}") == path:
                    return True
        except OSError:  # gone, or not ours to read
            continue
    return False


def resources():
    """What a loader could leak, measured after cached pinned memory went back."""
    gc.collect()
    pinmem.trim()
    mp.active_children()  # reaps multiprocessing's finished children
    return dict(fds=fd_table(), children=set(child_pids()),
                mp_children={p.pid for p in mp.active_children()},
                shm=set(os.listdir("/dev/shm")), in_use=pinmem.stats()["in_use_bytes"])


def assert_nothing_left(before, worker_pids):
    after = resources()
    new_fds = {fd: t for fd, t in after["fds"].items() if before["fds"].get(fd) != t}
    assert not new_fds, f"fds left open: {new_fds}"
    assert after["children"] <= before["children"], \
        f"child processes left: {sorted(after['children'] - before['children'])}"
    assert after["mp_children"] <= before["mp_children"], \
        f"multiprocessing children left: {sorted(after['mp_children'] - before['mp_children'])}"
    left = [p for p in worker_pids if alive(p)]
    assert not left, f"worker processes still running: {left}"
    new_shm = after["shm"] - before["shm"]
    if new_shm:  # other programs on this machine make names too: a name one of them has open
        time.sleep(0.2)  # or mapped, or that goes at once, is not one this loader left behind
        new_shm = {n for n in new_shm & set(os.listdir("/dev/shm"))
                   if not used_by_another_process(f"/dev/shm/{n}")}
    assert not new_shm, f"/dev/shm entries left: {sorted(new_shm)}"
    assert after["in_use"] == before["in_use"], \
        f"pool in-use bytes {after['in_use']}, before the loader {before['in_use']}"


_warm = set()


def warm_up(context):
    """Run one loader of the context to its end first: what multiprocessing and pinmem start
    once per process (the fork server, the resource tracker, the pool) is not a leak."""
    if context in _warm:
        return
    with pinmem.Loader(Tagged(40), batch_size=8, num_workers=2, device="cpu",
                       multiprocessing_context=context) as loader:
        take(loader)
    _warm.add(context)


def script_env():
    """The environment of a child interpreter that imports this module and pinmem."""
    env = dict(os.environ)
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(pinmem.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(
        [TESTS_DIR, pkg] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


# ---- batches -----------------------------------------------------------------------------------

def to_numpy(b):
    """A batch copied out of its slot, with its structure: tuples stay tuples (a Batch too),
    lists lists, dicts dicts; each array becomes a NumPy copy."""
    if isinstance(b, dict):
        return {k: to_numpy(v) for k, v in b.items()}
    if isinstance(b, list):
        return [to_numpy(v) for v in b]
    if isinstance(b, tuple):
        return tuple(to_numpy(v) for v in b)
    return np.array(b, copy=True)


def take(loader, count=None, into=None):
    """Up to count batches (None: to the end of the epoch) as NumPy copies. No batch stays
    referenced here, also when next() raises (the traceback keeps this frame), so slots go back.
    into: a list the batches are appended to as they come (kept when next() raises)."""
    out = [] if into is None else into
    it = iter(loader)
    while count is None or len(out) < count:
        try:
            b = next(it)
        except StopIteration:
            break
        out.append(to_numpy(b))
        b = None
    return out


def image_of(i):
    """The image of sample i (of every i in an array of indices)."""
    i = np.asarray(i)
    return (np.arange(6, dtype=np.float32).reshape(2, 3) + np.float32(10) *
            i.astype(np.float32)[..., None, None])


def check_tagged(batches, order):
    """Tagged batches deliver exactly the samples `order` names, in that order."""
    idx = np.concatenate([b[1] for b in batches] or [np.zeros(0, np.int64)])
    assert idx.tolist() == list(order)
    np.testing.assert_array_equal(np.concatenate([b[0] for b in batches]), image_of(idx))
    return idx


def pids_of(batches, leaf=2):
    """The pids in the leaf of batches that says which process read each sample."""
    return {p for b in batches for p in b[leaf].tolist()}


def message_of(exc):
    """All the text an exception carries: str() (a KeyError's str() is its argument's repr),
    its arguments as they are, and notes."""
    parts = [str(exc)] + [str(a) for a in exc.args] + list(getattr(exc, "__notes__", ()))
    return "\n".join(parts)


# ---- datasets (module level: spawn and forkserver workers import them) -------------------------

class Tagged:
    """Sample i: (image float32 (2, 3) from i, label int64 i, pid of the process that read it)."""

    def __init__(self, n=N):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return image_of(i), np.int64(i), np.int64(os.getpid())


def stack_images(samples):
    """A collate_fn of one's own: the images stacked, the labels as a list of ints."""
    return np.stack([s[0] for s in samples]), [int(s[1]) for s in samples]


class Dicts(Tagged):
    def __getitem__(self, i):
        return {"image": image_of(i), "label": np.int64(i), "weight": np.float32(i / 4)}


class Nested(Tagged):
    """A tuple holding a dict, which holds a list."""

    def __getitem__(self, i):
        return (image_of(i),
                {"label": np.int64(i), "parts": [np.full(2, i, np.int16), np.uint8(i % 200)]})


class Scalars(Tagged):
    """Python numbers only (int, float, bool; the last the reading process's pid), whatever
    integer type the index has."""

    def __getitem__(self, i):
        i = int(i)
        return i, i / 4, i % 3 == 0, os.getpid()


class Single(Tagged):
    """One array: (i, 2 i, pid of the process that read it)."""

    def __getitem__(self, i):
        return np.array([i, 2 * i, os.getpid()], dtype=np.int32)


class Tensors(Tagged):
    def __getitem__(self, i):
        import torch
        return torch.arange(4, dtype=torch.float32) + i, torch.tensor(i)


class Reshaped(Tagged):
    """Sample BAD's image is (3, 2): every other is (2, 3)."""

    def __init__(self, n=BIG_N, as_dict=True):
        super().__init__(n)
        self.as_dict = as_dict

    def __getitem__(self, i):
        image = np.zeros((3, 2) if i == BAD else (2, 3), np.float32)
        pid = np.int64(os.getpid())
        return {"image": image, "label": np.int64(i), "pid": pid} if self.as_dict else \
            (image, np.int64(i), pid)


class Captioned(Tagged):
    def __getitem__(self, i):
        return {"image": image_of(i), "caption": f"sample {i}"}


class FailingAt(Tagged):
    """dataset[BAD] raises a KeyError whose own message does not name the index."""

    def __init__(self):
        super().__init__(BIG_N)

    def __getitem__(self, i):
        if i == BAD:
            raise KeyError("missing label")
        return image_of(i), np.int64(i), np.int64(os.getpid())


FAILING_LINE = 'raise KeyError("missing label")'


class KilledAt(Tagged):
    """The worker that reads sample `at` notes its worker id and pid in `note`, then SIGKILLs
    itself (as the OOM killer would). Never in the process that made the dataset."""

    def __init__(self, at, note, n=N):
        super().__init__(n)
        self.at, self.note, self.owner = at, note, os.getpid()

    def __getitem__(self, i):
        if i == self.at and os.getpid() != self.owner:
            info = pinmem.get_worker_info()
            with open(self.note, "w") as f:
                f.write(f"{info.id} {os.getpid()}")
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


class SleepsAt(Tagged):
    def __init__(self, at, seconds):
        super().__init__(N)
        self.at, self.seconds, self.owner = at, seconds, os.getpid()

    def __getitem__(self, i):
        if i == self.at and os.getpid() != self.owner:
            time.sleep(self.seconds)
        return super().__getitem__(i)


class Slow(Tagged):
    """A few milliseconds per sample: the loader is always busy."""

    def __getitem__(self, i):
        time.sleep(0.002)
        return super().__getitem__(i)


_INIT_PIDS = set()  # the processes where worker_init_fn ran (each worker's own copy)


def note_init(directory, worker_id):
    """worker_init_fn: one file per call, naming the worker id it was given, the process and
    what get_worker_info() says there."""
    _INIT_PIDS.add(os.getpid())
    info = pinmem.get_worker_info()
    name = f"{worker_id} {os.getpid()} {info.id} {info.num_workers} {time.monotonic_ns()}"
    open(os.path.join(directory, name), "w").close()


class InfoProbe(Tagged):
    """What get_worker_info() says while a sample is read (-1 and False where it says None: the
    loader may read a sample in the main process to learn the fields; none is delivered)."""

    def __getitem__(self, i):
        info = pinmem.get_worker_info()
        if info is None:
            return (np.int64(i), np.int64(-1), np.int64(-1), np.int64(-1), np.int64(os.getpid()),
                    False, False)
        return (np.int64(i), np.int64(info.id), np.int64(info.num_workers),
                np.int64(info.seed % (1 << 62)), np.int64(os.getpid()), info.dataset is self,
                os.getpid() in _INIT_PIDS)


class Augmented(Tagged):
    """Random augmentation from the generators a worker seeds: random, NumPy's global one and
    torch's (when torch is installed)."""

    def __getitem__(self, i):
        r = random.random()
        a = np.random.random(3)
        t = torch.rand(2).numpy() if torch is not None else np.zeros(2, np.float32)
        return np.int64(i), np.float64(r), a, t


class CountingSampler:
    """A sampler object (not a list): each iteration yields another order, with repeats and
    without most indices, as a weighted sampler does; len() is its length."""

    def __init__(self, n, length):
        self.n, self.length, self.iterations = n, length, 0

    def order(self, k):
        return [(j * 7 + 3 * k) % 40 for j in range(self.length)]

    def __iter__(self):
        k, self.iterations = self.iterations, self.iterations + 1
        return iter(self.order(k))

    def __len__(self):
        return self.length


# ---- start methods and sample structures -------------------------------------------------------

@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver", "fork-object"])
def test_start_methods_deliver_every_sample(context):
    # A name, or a context object as torch takes it.
    ctx = mp.get_context("fork") if context == "fork-object" else context
    loader = pinmem.Loader(Tagged(), batch_size=32, num_workers=2, device="cpu",
                           multiprocessing_context=ctx)
    assert len(loader) == -(-N // 32)
    raw = next(iter(loader))
    assert isinstance(raw, list) and len(raw) == 3  # tuple samples: a list, as default_collate
    assert np.asarray(raw[0]).shape == (32, 2, 3) and np.asarray(raw[0]).dtype == np.float32
    assert np.asarray(raw[1]).dtype == np.int64
    raw = None
    batches = take(loader)  # a new iterator: a whole new epoch, as torch's
    check_tagged(batches, range(N))
    pids = pids_of(batches)
    assert os.getpid() not in pids, "samples were read in the main process, not in workers"
    assert 1 <= len(pids) <= 2
    loader.close()


def test_dict_samples_give_dict_batches():
    with pinmem.Loader(Dicts(), batch_size=16, num_workers=2, device="cpu") as loader:
        raw = next(iter(loader))
        assert isinstance(raw, dict) and list(raw) == ["image", "label", "weight"]
        raw = None
        batches = take(loader)  # a new iterator: a whole new epoch
    assert all(isinstance(b, dict) and list(b) == ["image", "label", "weight"] for b in batches)
    idx = np.concatenate([b["label"] for b in batches])
    assert idx.tolist() == list(range(N))
    np.testing.assert_array_equal(np.concatenate([b["image"] for b in batches]), image_of(idx))
    w = np.concatenate([b["weight"] for b in batches])
    assert w.dtype == np.float32
    np.testing.assert_array_equal(w, idx.astype(np.float32) / 4)


def test_nested_samples_keep_their_structure():
    with pinmem.Loader(Nested(), batch_size=16, num_workers=2, device="cpu") as loader:
        batches = take(loader)
    n = 0
    for b in batches:
        assert isinstance(b, list) and len(b) == 2  # tuple samples: a list, as default_collate
        image, rest = b
        assert isinstance(rest, dict) and list(rest) == ["label", "parts"]
        assert isinstance(rest["parts"], list) and len(rest["parts"]) == 2
        idx = rest["label"]
        assert idx.tolist() == list(range(n, n + len(idx)))
        np.testing.assert_array_equal(image, image_of(idx))
        a, s = rest["parts"]
        assert a.dtype == np.int16 and a.shape == (len(idx), 2)
        np.testing.assert_array_equal(a, np.repeat(idx[:, None], 2, axis=1))
        assert s.dtype == np.uint8 and s.shape == (len(idx),)
        np.testing.assert_array_equal(s, idx % 200)
        n += len(idx)
    assert n == N


def test_python_numbers_become_int64_float64_bool():
    with pinmem.Loader(Scalars(), batch_size=32, num_workers=2, device="cpu") as loader:
        batches = take(loader)
    i = np.concatenate([b[0] for b in batches])
    f = np.concatenate([b[1] for b in batches])
    t = np.concatenate([b[2] for b in batches])
    assert (i.dtype, f.dtype, t.dtype) == (np.int64, np.float64, np.bool_)
    assert batches[0][0].shape == (32,)
    np.testing.assert_array_equal(i, np.arange(N))
    np.testing.assert_array_equal(f, np.arange(N) / 4)
    np.testing.assert_array_equal(t, np.arange(N) % 3 == 0)
    assert os.getpid() not in pids_of(batches, 3)


def test_single_array_sample_gives_array_batch():
    with pinmem.Loader(Single(), batch_size=32, num_workers=2, device="cpu") as loader:
        raw = next(iter(loader))
        assert not isinstance(raw, (tuple, list, dict)), type(raw)
        assert np.asarray(raw).shape == (32, 3) and np.asarray(raw).dtype == np.int32
        raw = None
        batches = take(loader)  # a new iterator: a whole new epoch
    got = np.concatenate(batches)
    i = np.arange(N, dtype=np.int32)
    np.testing.assert_array_equal(got[:, :2], np.stack([i, 2 * i], axis=1))
    assert os.getpid() not in got[:, 2]


def test_torch_cpu_tensor_samples():
    skip_unless_torch()
    with pinmem.Loader(Tensors(), batch_size=32, num_workers=2, device="cpu") as loader:
        batches = take(loader)
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    assert x.dtype == np.float32 and y.dtype == np.int64
    np.testing.assert_array_equal(y, np.arange(N))
    np.testing.assert_array_equal(x, np.arange(4, dtype=np.float32) + np.arange(N)[:, None])


# ---- what a sample may not be ------------------------------------------------------------------

@pytest.mark.parametrize("as_dict", [True, False], ids=["dict", "tuple"])
def test_sample_of_another_shape_names_index_field_and_shapes(as_dict):
    got = []
    with pytest.raises(pinmem.InvalidError) as e:
        with pinmem.Loader(Reshaped(as_dict=as_dict), batch_size=100, num_workers=2,
                           device="cpu") as loader:
            take(loader, into=got)
    msg = message_of(e.value)
    assert re.search(rf"\b{BAD}\b", msg), msg
    assert "(2, 3)" in msg and "(3, 2)" in msg, msg
    if as_dict:
        assert "image" in msg, msg
    else:
        assert re.search(r"\[0\]|field 0", msg), msg
    assert len(got) <= BAD // 100  # no batch with the odd sample in it was delivered
    pids = {p for b in got for p in (b["pid"] if as_dict else b[2]).tolist()}
    assert os.getpid() not in pids  # read by worker processes


@pytest.mark.parametrize("persistent", [False, True])
def test_str_leaves_arrive_as_lists_in_row_order(persistent):
    """Captions travel beside the slot and are matched to their rows: shuffled, over epochs,
    after a loop that stopped early (its prefetched rows' captions are never delivered)."""
    with pinmem.Loader(Captioned(), batch_size=8, num_workers=2, device="cpu", shuffle=True,
                       seed=4, persistent_workers=persistent) as loader:
        for b in iter(loader):  # a loop stopped early
            break
        for _ in range(2):
            seen = []
            for b in loader.batches():
                pass  # batches() gives the slot's arrays alone
            for b in loader:
                img = np.asarray(b["image"])
                idx = np.rint((img[:, 0, 0]) / 10).astype(int)
                assert b["caption"] == [f"sample {i}" for i in idx]
                seen += idx.tolist()
            assert sorted(seen) == list(range(N))


# ---- faults ------------------------------------------------------------------------------------

def test_exception_in_a_worker_is_raised_at_its_batch():
    loader = pinmem.Loader(FailingAt(), batch_size=100, num_workers=2, device="cpu")
    got = []
    with pytest.raises(KeyError) as e:
        take(loader, into=got)
    check_tagged(got, range(BAD // 100 * 100))  # every batch before the broken one arrived
    assert os.getpid() not in pids_of(got)
    msg = message_of(e.value)
    assert "missing label" in msg, msg
    assert re.search(r"worker process \d+", msg), msg
    assert re.search(rf"\b{BAD}\b", msg), msg  # the index: the loader's, not the dataset's text
    assert "__getitem__" in msg and FAILING_LINE in msg, msg  # the worker's traceback
    # As torch: the next loop is a new epoch, which fails at the same index again.
    again = []
    with pytest.raises(KeyError):
        take(loader, into=again)
    check_tagged(again, range(BAD // 100 * 100))
    loader.close()


@limit(20)
def test_killed_worker_raises_worker_error(tmp_path):
    assert issubclass(pinmem.WorkerError, RuntimeError)
    note = tmp_path / "killed"
    loader = pinmem.Loader(KilledAt(90, str(note)), batch_size=10, num_workers=2, device="cpu")
    got = []
    with pytest.raises(pinmem.WorkerError) as e:  # not a hang: hang_guard fails that
        take(loader, into=got)
    wid, pid = note.read_text().split()
    msg = message_of(e.value)
    assert re.search(rf"worker (process )?{wid}\b", msg), msg
    assert re.search(rf"\b{pid}\b", msg), msg
    assert re.search(r"SIGKILL|signal 9\b", msg), msg
    assert len(got) <= 9  # sample 90 is in batch 9
    check_tagged(got, range(10 * len(got)))  # what came before the death was right
    loader.close()


@limit(40)
def test_timeout_raises_worker_error():
    # Only index 30 is slow (20 s, against a limit of 2 s): batches 0-2 arrive whole and right,
    # and the timeout names the claim holding index 30; a spurious early timeout fails here.
    loader = pinmem.Loader(SleepsAt(30, 20.0), batch_size=10, num_workers=2, device="cpu",
                           timeout=2.0)
    got = []
    with pytest.raises(pinmem.WorkerError) as e:
        take(loader, into=got)
    msg = message_of(e.value)
    assert "timeout=2 s" in msg, msg
    assert re.search(r"dataset indices \[[^\]]*\b30\b", msg), msg
    assert len(got) == 3
    check_tagged(got, range(30))
    loader.close()



@limit(40)
def test_a_worker_still_busy_after_the_drain_is_stopped_before_its_slots_are_freed():
    # Index 30 takes 8 s against a timeout of 1 s: batch 3's wait times out and that loop ends.
    # The next epoch first drains the replies owed, within the timeout; the sleeping process
    # cannot answer. It would write sample 30's rows into slots whose memory the pool hands
    # out again: it must be gone before they are freed. The epoch then goes on with new
    # workers (per-epoch workers: DataLoader starts new ones for each loop too).
    loader = pinmem.Loader(SleepsAt(30, 8.0), batch_size=10, num_workers=2, device="cpu",
                           timeout=1.0)
    got = []
    with pytest.raises(pinmem.WorkerError, match="timeout=1 s"):
        take(loader, into=got)
    check_tagged(got, range(10 * len(got)))
    pids = loader.worker_pids()
    assert len(pids) == 2 and all(alive(p) for p in pids)  # one of them still sleeping
    t0 = time.monotonic()
    again = []
    with pytest.raises(pinmem.WorkerError, match="timeout=1 s"):  # index 30 sleeps again
        take(loader, into=again)
    assert not [p for p in pids if alive(p)], "a worker outlived the slots it writes into"
    assert time.monotonic() - t0 < 6  # the drain's 1 s, the stop and 1 s, not the 8 s sleep
    check_tagged(again, range(10 * len(again)))  # the next epoch, on new workers
    assert len(again) == len(got) and not set(loader.worker_pids()) & set(pids)
    loader.close()

def answer_first_claim_twice(worker_id):
    """worker_init_fn: this worker sends its reply to its first claim twice, so the reply to its
    second claim is, by position, the first one's (what a claim sent after the loader had
    counted its replies leaves for the next loader)."""
    from pinmem import _workers
    send, sent = _workers._send, []

    def twice(sock, data):
        ok = send(sock, data)
        if _workers.REP.unpack_from(data, 0)[3] > 0 and not sent:  # a claim's reply (tag > 0)
            sent.append(1)
            send(sock, data)
        return ok

    _workers._send = twice


@limit(40)
def test_a_reply_to_another_claim_fails_the_batch_never_delivers_its_rows():
    # The second claim reads the first claim's duplicate reply before its process has written
    # its rows: taken by position, its batch would be copied unwritten. The reply's tag says
    # whose it is, so that batch fails, naming the cause, and what came before it is right.
    # (batch_size 8: one claim per batch)
    with pinmem.Loader(Tagged(80), batch_size=8, num_workers=1, device="cpu",
                       worker_init_fn=answer_first_claim_twice) as loader:
        got = []
        with pytest.raises(pinmem.WorkerError, match=r"worker process 0: its answers are out of "
                           r"order \(request 2 was answered by the reply to request 1\)"):
            take(loader, into=got)
        assert len(got) == 1
        check_tagged(got, range(8))

MAIN_DIES = textwrap.dedent("""
    import os, signal, sys
    import numpy as np, pinmem
    from test_workers import Tagged, child_pids
    context, how = sys.argv[1], sys.argv[2]
    loader = pinmem.Loader(Tagged(96), batch_size=8, num_workers=2, device="cpu",
                           persistent_workers=True, multiprocessing_context=context)
    pids = set()
    for b in loader:
        pids.update(np.asarray(b[2]).tolist())
    b = None
    it = iter(loader)
    b = next(it)  # the next epoch is under way: workers fill slots
    print("PIDS", *sorted(pids | set(child_pids())), flush=True)
    if how == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("context,how", [("fork", "exit"), ("fork", "kill"), ("spawn", "kill")])
def test_workers_exit_when_the_main_process_dies(tmp_path, context, how):
    # Output to files, not pipes: workers that outlive the script would hold a pipe open.
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.run([sys.executable, "-c", MAIN_DIES, context, how], env=script_env(),
                              stdout=o, stderr=e, timeout=40)
    report = f"stdout:\n{out.read_text()}\nstderr:\n{err.read_text()}"
    assert proc.returncode == (3 if how == "exit" else -signal.SIGKILL), report
    line = [ln for ln in out.read_text().splitlines() if ln.startswith("PIDS")]
    assert line, report
    pids = [int(p) for p in line[0].split()[1:]]
    assert len(pids) >= 2, pids
    try:
        deadline = time.monotonic() + 5
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in pids if alive(p)], "workers outlived the main process"
    finally:
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_worker_init_fn_runs_once_per_worker(tmp_path, context):
    init = functools.partial(note_init, str(tmp_path))
    with pinmem.Loader(InfoProbe(), batch_size=10, num_workers=3, device="cpu",
                       worker_init_fn=init, multiprocessing_context=context) as loader:
        batches = take(loader)
    calls = [name.split() for name in os.listdir(tmp_path)]
    assert sorted(int(c[0]) for c in calls) == [0, 1, 2], calls
    assert len({c[1] for c in calls}) == 3 and str(os.getpid()) not in {c[1] for c in calls}
    for worker_id, _pid, info_id, info_workers, _t in calls:
        assert info_id == worker_id and info_workers == "3"  # get_worker_info() there too
    ran_init = np.concatenate([b[6] for b in batches])
    assert ran_init.all(), "a sample was read before its worker's worker_init_fn"
    by_pid = {c[1]: c[0] for c in calls}
    ids, pids = np.concatenate([b[1] for b in batches]), np.concatenate([b[4] for b in batches])
    for w, p in zip(ids.tolist(), pids.tolist()):
        assert by_pid[str(p)] == str(w)  # the id init was given is the worker's id


def test_get_worker_info():
    assert pinmem.get_worker_info() is None
    with pinmem.Loader(InfoProbe(), batch_size=10, num_workers=3, device="cpu", seed=1234,
                       shuffle=True) as loader:
        take(loader, 3)
        assert pinmem.get_worker_info() is None  # with workers running, still None here
        batches = take(loader)  # a new iterator: a whole new epoch
    assert pinmem.get_worker_info() is None
    idx = np.concatenate([b[0] for b in batches])
    assert sorted(idx.tolist()) == list(range(N))
    ids, workers, seeds, pids, same = (np.concatenate([b[k] for b in batches]) for k in range(1, 6))
    assert set(ids.tolist()) <= {0, 1, 2} and (workers == 3).all() and same.all()
    per_worker = {}
    for w, s, p in zip(ids.tolist(), seeds.tolist(), pids.tolist()):
        assert per_worker.setdefault(w, (s, p)) == (s, p)  # one seed and one process per id
    assert len(per_worker) == 3  # every worker read samples (claims go round the workers)
    assert len({s for s, _ in per_worker.values()}) == 3, per_worker  # seeds differ per worker


# ---- seeds, epochs, samplers, resume, ranks ----------------------------------------------------

def augmented_epochs(seed, epochs=3):
    with pinmem.Loader(Augmented(120), batch_size=10, shuffle=True, seed=seed, num_workers=3,
                       device="cpu") as loader:
        return [take(loader) for _ in range(epochs)]


def test_same_seed_same_batches_with_random_augmentation():
    a, b = augmented_epochs(7), augmented_epochs(7)
    for ea, eb in zip(a, b):
        assert len(ea) == len(eb) == 12
        for ba, bb in zip(ea, eb):
            for x, y in zip(ba, bb):
                np.testing.assert_array_equal(x, y)
    for epoch in a:
        assert sorted(np.concatenate([b[0] for b in epoch]).tolist()) == list(range(120))
        r = np.concatenate([b[1] for b in epoch])
        assert len(set(r.tolist())) == len(r), "two workers drew the same random numbers"
        assert len({tuple(row) for row in np.concatenate([b[2] for b in epoch]).tolist()}) == 120
    # Another seed: another order and other draws (seed 100 + w shares no stream with 7 + w).
    c = augmented_epochs(100, epochs=1)[0]
    assert not np.array_equal(np.concatenate([x[0] for x in c]),
                              np.concatenate([x[0] for x in a[0]]))
    assert not set(np.concatenate([x[1] for x in c]).tolist()) & \
        set(np.concatenate([x[1] for x in a[0]]).tolist())


@pytest.mark.parametrize("persistent", [True, False])
def test_persistent_workers(persistent):
    loader = pinmem.Loader(Tagged(96), batch_size=8, num_workers=2, device="cpu",
                           persistent_workers=persistent)
    epochs = []
    for _ in range(3):
        batches = take(loader)
        check_tagged(batches, range(96))
        epochs.append(pids_of(batches))
        assert os.getpid() not in epochs[-1]
    if persistent:
        assert len(set().union(*epochs)) <= 2, epochs  # the same processes every epoch
        assert all(alive(p) for p in epochs[0])  # and alive between epochs
    else:
        for prev, cur in zip(epochs, epochs[1:]):
            assert not prev & cur, epochs  # new processes each epoch
    loader.close()


def test_sampler_list_with_repeats_is_the_order():
    order = [5, 3, 3, 0, 199, 5, 42, 42, 42, 7] * 5 + [1, 2, 3]
    loader = pinmem.Loader(Tagged(), batch_size=8, sampler=order, num_workers=2, device="cpu")
    assert len(loader) == -(-len(order) // 8)
    for _ in range(2):
        check_tagged(take(loader), order)
    loader.close()


def test_sampler_object_is_iterated_each_epoch():
    sampler = CountingSampler(N, 45)
    loader = pinmem.Loader(Tagged(), batch_size=8, sampler=sampler, num_workers=2, device="cpu")
    assert len(loader) == 6
    for k in range(3):
        check_tagged(take(loader), sampler.order(k))
    loader.close()


def test_shuffle_with_a_sampler_is_refused():
    with pytest.raises(pinmem.InvalidError) as e:
        pinmem.Loader(Tagged(), batch_size=8, shuffle=True, sampler=list(range(N)),
                      num_workers=2, device="cpu")
    assert "sampler" in str(e.value) and "shuffle" in str(e.value)


def test_state_dict_resume_mid_epoch():
    kw = dict(batch_size=10, shuffle=True, seed=3, num_workers=2, device="cpu")
    with pinmem.Loader(Tagged(), **kw) as ref:
        full = take(ref) + take(ref)
    loader = pinmem.Loader(Tagged(), **kw)
    head = take(loader, 5)
    state = loader.state_dict()
    assert state["epoch"] == 0 and state["batch"] == 5
    loader.close()
    check_tagged(head, np.concatenate([b[1] for b in full[:5]]).tolist())
    with pinmem.Loader(Tagged(), **kw) as resumed:
        resumed.load_state_dict(state)
        rest = take(resumed) + take(resumed)
    assert len(rest) == len(full) - 5
    check_tagged(rest, np.concatenate([b[1] for b in full[5:]]).tolist())
    assert os.getpid() not in pids_of(full) | pids_of(rest)  # read by worker processes


def test_ranks_deliver_each_index_exactly_once():
    n, world = 240, 3
    per_epoch = [[], []]
    for rank in range(world):
        with pinmem.Loader(Tagged(n), batch_size=16, shuffle=True, seed=5, num_workers=2,
                           device="cpu", rank=rank, world_size=world) as loader:
            for e in range(2):
                batches = take(loader)
                assert os.getpid() not in pids_of(batches)
                per_epoch[e].append(np.concatenate([b[1] for b in batches]))
    for epoch in per_epoch:
        assert all(len(r) == n // world for r in epoch)
        assert sorted(np.concatenate(epoch).tolist()) == list(range(n))
    assert not np.array_equal(per_epoch[0][0], per_epoch[1][0])  # reshuffled per epoch


# ---- keyword arguments -------------------------------------------------------------------------

def test_dataloader_positional_order():
    # DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, ...)
    with pinmem.Loader(Tagged(), 20, False, None, None, 2, None, True, False, 0,
                       device="cpu") as loader:
        batches = take(loader)
    check_tagged(batches, range(N))
    assert len(batches) == N // 20 and os.getpid() not in pids_of(batches)


def test_refused_keyword_arguments_name_themselves():
    with pytest.raises(pinmem.InvalidError) as e:
        pinmem.Loader(Tagged(), batch_sampler=[[0, 1], [2, 3]], num_workers=2, device="cpu")
    assert "batch_sampler" in str(e.value)
    # A collate_fn of your own with device batches: its arrays arrive on the device, the rest
    # as it returned it.
    with pinmem.Loader(Tagged(), batch_size=8, collate_fn=stack_images, num_workers=2) as loader:
        images, labels = next(iter(loader))
        assert isinstance(images, pinmem.Buffer) and images.shape == (8, 2, 3)
        host = pinmem.empty(images.shape, images.dtype)
        pinmem.copy(host, images).wait()
        np.testing.assert_array_equal(np.asarray(host), image_of(np.arange(8)))
        assert labels == list(range(8))
    # What DataLoader users pass and pinmem honours is accepted.
    with pinmem.Loader(Tagged(), batch_size=8, collate_fn=None, num_workers=2, device="cpu",
                       pin_memory=True, timeout=0, generator=None, prefetch_factor=2,
                       persistent_workers=False, pin_memory_device="", in_order=False) as loader:
        check_tagged(take(loader), range(N))


def test_thread_mode_still_works():
    with pinmem.Loader(Tagged(), batch_size=16, num_workers=2, device="cpu",
                       worker_mode="thread") as loader:
        batches = take(loader)
    check_tagged(batches, range(N))
    assert pids_of(batches) == {os.getpid()}  # threads of this process


def test_no_workers_reads_in_the_main_process():
    with pinmem.Loader(Dicts(), batch_size=16, num_workers=0, device="cpu") as loader:
        batches = take(loader)
    assert all(isinstance(b, dict) for b in batches)
    assert np.concatenate([b["label"] for b in batches]).tolist() == list(range(N))


# ---- nothing leaks -----------------------------------------------------------------------------

@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_no_leaks_after_close(context):
    warm_up(context)
    before = resources()
    loader = pinmem.Loader(Tagged(), batch_size=16, num_workers=2, device="cpu",
                           persistent_workers=True, multiprocessing_context=context)
    batches = take(loader) + take(loader, 3)  # an epoch, and stopped inside the next
    pids = pids_of(batches)
    loader.close()
    assert_nothing_left(before, pids)


def test_no_leaks_after_a_worker_exception():
    warm_up("fork")
    before = resources()
    loader = pinmem.Loader(FailingAt(), batch_size=100, num_workers=2, device="cpu",
                           multiprocessing_context="fork")
    got = []
    with pytest.raises(KeyError):
        take(loader, into=got)
    loader.close()
    assert_nothing_left(before, pids_of(got))


@limit(20)
def test_no_leaks_after_a_killed_worker(tmp_path):
    warm_up("fork")
    before = resources()
    note = tmp_path / "killed"
    loader = pinmem.Loader(KilledAt(90, str(note)), batch_size=10, num_workers=2, device="cpu",
                           multiprocessing_context="fork")
    got = []
    with pytest.raises(pinmem.WorkerError):
        take(loader, into=got)
    loader.close()
    killed = int(note.read_text().split()[1])
    assert_nothing_left(before, pids_of(got) | {killed})


CTRL_C = textwrap.dedent("""
    import faulthandler, signal
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it hangs, if it does
    # Ctrl-C raises KeyboardInterrupt here even when this was started with SIGINT ignored (a
    # command run in the background of a shell script is): Python keeps an inherited SIG_IGN.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import multiprocessing as mp
    import numpy as np, pinmem
    from test_workers import Slow, child_pids
    loader = pinmem.Loader(Slow(), batch_size=8, num_workers=2, device="cpu",
                           persistent_workers=True)
    pids, n = set(), 0
    try:
        while True:  # epochs until interrupted
            for b in loader:
                pids.update(np.asarray(b[2]).tolist())
                b = None
                n += 1
                if n == 6:
                    print("READY", *sorted(pids | set(child_pids())), flush=True)
    except KeyboardInterrupt:
        loader.close()
        print("CLOSED", len(mp.active_children()) + len(child_pids()), flush=True)
        raise
""")


def test_ctrl_c_stops_cleanly(tmp_path):
    # Output to files, not pipes: workers that outlive the script would hold a pipe open.
    out, err = tmp_path / "out", tmp_path / "err"
    pids = []
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-c", CTRL_C], env=script_env(), stdout=o,
                                stderr=e, start_new_session=True)  # its own process group
    try:
        while not out.read_text().startswith("READY"):  # hang_guard ends a wait that never ends
            assert proc.poll() is None, f"stdout:\n{out.read_text()}\nstderr:\n{err.read_text()}"
            time.sleep(0.05)
        pids = [int(p) for p in out.read_text().splitlines()[0].split()[1:]]
        assert len(pids) >= 2, pids
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group gets it
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            import shutil
            # Where the program and its workers are: C stacks (gdb, where there is one) and
            # Python stacks (faulthandler, inherited by the forked workers, to err).
            for p in [proc.pid] + pids:
                if shutil.which("gdb") and alive(p):
                    with open(tmp_path / f"gdb-{p}", "w") as g:
                        subprocess.run(["gdb", "-p", str(p), "-batch", "-ex",
                                        "thread apply all bt"], stdout=g, stderr=subprocess.STDOUT)
                if alive(p):
                    os.kill(p, signal.SIGUSR1)
                    time.sleep(0.5)
            raise AssertionError(f"Ctrl-C did not stop the program within 30 s\n"
                                 f"stdout:\n{out.read_text()}\nstderr:\n{err.read_text()}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        survivors = [p for p in pids if alive(p)]
        for p in survivors:
            os.kill(p, signal.SIGKILL)
    report = f"stdout:\n{out.read_text()}\nstderr:\n{err.read_text()}"
    assert proc.returncode != 0, report
    assert "CLOSED 0" in out.read_text(), report
    # One traceback, the main process's KeyboardInterrupt: none from workers.
    assert err.read_text().count("Traceback") == 1 and "KeyboardInterrupt" in err.read_text(), \
        report
    assert not survivors, f"workers outlived Ctrl-C: {survivors}"


class _Cycle:
    """Garbage with a __del__ (a torch DataLoader iterator left in a cycle, say)."""

    def __init__(self, path):
        self.me, self.path = self, path

    def __del__(self):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


class _Collects:
    def __len__(self):
        return 4

    def __getitem__(self, i):
        gc.collect()  # as any allocation in the worker may, even inside an import
        return np.zeros(2)


def test_the_parents_garbage_is_not_collected_in_workers(tmp_path):
    """A __del__ of the parent's uncollected garbage run in a forked worker, from inside an
    import, breaks importlib's module lock there (Python 3.11) and kills the worker."""
    note = tmp_path / "deleted"
    gc.disable()
    try:
        _Cycle(str(note))
        with pinmem.Loader(_Collects(), batch_size=1, num_workers=2, device="cpu",
                           multiprocessing_context="fork") as p:
            assert len(list(p)) == 4
    finally:
        gc.enable()
    gc.collect()
    assert note.read_text().split() == [str(os.getpid())]  # once, here
