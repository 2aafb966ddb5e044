"""NUMA placement of pinmem.Loader's worker processes (worker_mode="process").

The workers run on the CPUs pinmem's own threads use for the loader's device: its NUMA node's
CPUs within those the main process may use. On this one-node machine that is nothing to do, so
the placement is checked against a fake sysfs tree (_pinmem._numa_test_override, as
tests/test_numa.c does in C): two nodes, the host backend's device 0 on node 0, which owns one
CPU the process may use. (Node 0, not 1: the loader's pinned slots are bound to the device's
node too, and binding to a node this machine lacks would count a failure in the process-wide
stats that test_pool.py checks.) Each sample carries the CPU set its worker ran on
(os.sched_getaffinity(0) in dataset[i]), so the checks read what the workers did, not what the
loader says. Every test starts processes: hang_guard (test_workers.py) fails a hang.
"""
import functools
import os

import numpy as np
import pytest

import pinmem
from pinmem import _pinmem
from test_workers import hang_guard  # noqa: F401  (autouse: a hang fails the test)

N = 64
BUS0, BUS1 = "0000:3b:00.0", "0000:af:00.0"


def cpu_mask(cpus):
    """A CPU set as a bit mask (ids below 63; the sets here are small)."""
    return sum(1 << c for c in cpus if c < 63)


class Affinity:
    """Sample i: (i, the CPU mask of the process that read it, WorkerInfo.cpus as a mask or -1,
    its pid)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        info = pinmem.get_worker_info()
        placed = -1 if info is None or info.cpus is None else cpu_mask(info.cpus)
        return (np.int64(i), np.int64(cpu_mask(os.sched_getaffinity(0))), np.int64(placed),
                np.int64(os.getpid()))


def read_all(loader):
    """Every sample's leaves as NumPy columns (batches on the device copied out)."""
    cols = [[] for _ in range(4)]
    for b in loader:
        for k in range(4):
            a = b[k]
            if not isinstance(a, np.ndarray):
                out = np.empty(a.shape, dtype=a.dtype)
                pinmem.copy(out, a).wait()
                a = out
            cols[k].append(a.copy())
        b = None
    return [np.concatenate(c) for c in cols]


def check_every_sample(cols):
    assert sorted(cols[0].tolist()) == list(range(N))
    assert os.getpid() not in set(cols[3].tolist()), "samples were read in the main process"


def put(root, rel, text):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


@pytest.fixture
def options():
    """Options set by a test go back to what they were (the library is process-wide)."""
    saved = {k: pinmem.get_option(k) for k in ("numa", "numa_threads")}
    yield
    for k, v in saved.items():
        pinmem.set_option(k, v)


@pytest.fixture
def fake_numa(tmp_path, options):
    """A fake multi-node machine: node 0 owns CPU `cpu` (one the process may use), node 1 the
    rest; device 0 on node 0, device 1 on node 2, whose only CPU (1000) is not allowed here.
    Yields cpu; the real topology comes back after the test."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two usable CPUs, to tell a placed worker from one left alone")
    cpu = allowed[-1]
    rest = ",".join(str(c) for c in allowed[:-1])
    root = str(tmp_path / "sys")
    for node, cpus in ((0, str(cpu)), (1, rest), (2, "1000")):
        put(root, f"devices/system/node/node{node}/cpulist", cpus + "\n")
        put(root, f"devices/system/node/node{node}/meminfo",
            f"Node {node} MemTotal: 1048576 kB\nNode {node} MemFree: 524288 kB\n")
    put(root, f"bus/pci/devices/{BUS0}/numa_node", "0\n")
    put(root, f"bus/pci/devices/{BUS1}/numa_node", "2\n")
    pinmem.set_option("numa", "auto")
    pinmem.set_option("numa_threads", "1")
    _pinmem._numa_test_override(root, [BUS0, BUS1])
    try:
        yield cpu
    finally:
        _pinmem._numa_test_override(None)


def test_one_node_machine_leaves_workers_where_they_are():
    try:
        nodes = [d for d in os.listdir("/sys/devices/system/node") if d.startswith("node")]
    except FileNotFoundError:  # a kernel without NUMA support: one node
        nodes = []
    if len(nodes) > 1:
        pytest.skip("this machine has more than one NUMA node")
    assert _pinmem._numa_worker_cpus(0) is None
    parent = cpu_mask(os.sched_getaffinity(0))
    with pinmem.Loader(Affinity(), batch_size=8, num_workers=2) as loader:
        cols = read_all(loader)
        st = loader.stats()
    check_every_sample(cols)
    assert set(cols[1].tolist()) == {parent}  # the parent's affinity, inherited
    assert set(cols[2].tolist()) == {-1}      # get_worker_info().cpus: not placed
    assert st["worker_numa_cpus"] is None and st["worker_numa_refused"] == 0


def test_fake_tree_cpus_for_each_device(fake_numa):
    cpu = fake_numa
    assert _pinmem._numa_worker_cpus(0) == [cpu]
    assert _pinmem._numa_worker_cpus(1) is None   # node 2: none of its CPUs is allowed
    assert _pinmem._numa_worker_cpus(2) is None   # no such device in the tree
    assert _pinmem._numa_worker_cpus(-1) is None  # delivery to the CPU
    pinmem.set_option("numa", "off")
    assert _pinmem._numa_worker_cpus(0) is None
    pinmem.set_option("numa", "0")                # a forced node: its CPUs, whatever device
    assert _pinmem._numa_worker_cpus(1) == [cpu]
    pinmem.set_option("numa", "auto")
    pinmem.set_option("numa_threads", "0")
    assert _pinmem._numa_worker_cpus(0) is None


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_workers_run_on_the_devices_node(fake_numa, context):
    cpu = fake_numa
    parent = os.sched_getaffinity(0)
    with pinmem.Loader(Affinity(), batch_size=8, num_workers=2,
                       multiprocessing_context=context) as loader:
        cols = read_all(loader)
        st = loader.stats()
    check_every_sample(cols)
    assert set(cols[1].tolist()) == {cpu_mask([cpu])}, [bin(m) for m in set(cols[1].tolist())]
    assert set(cols[2].tolist()) == {cpu_mask([cpu])}
    assert os.sched_getaffinity(0) == parent  # the main thread was not moved
    assert st["worker_numa_cpus"] == [cpu] and st["worker_numa_refused"] == 0
    assert st["worker_numa_problem"] == ""


@pytest.mark.parametrize("how", ["numa_threads=0", "numa=off", "device=cpu"])
def test_placement_turned_off_leaves_workers_alone(fake_numa, how):
    parent = cpu_mask(os.sched_getaffinity(0))
    kw = {}
    if how == "device=cpu":
        kw["device"] = "cpu"
    else:
        pinmem.set_option(*how.split("="))
    with pinmem.Loader(Affinity(), batch_size=8, num_workers=2, **kw) as loader:
        cols = read_all(loader)
        assert loader.stats()["worker_numa_cpus"] is None
    check_every_sample(cols)
    assert set(cols[1].tolist()) == {parent}
    assert set(cols[2].tolist()) == {-1}


def pin_to(cpu, worker_id):
    os.sched_setaffinity(0, {cpu})


def test_worker_init_fn_affinity_wins(fake_numa):
    cpu = fake_numa
    other = min(os.sched_getaffinity(0))
    with pinmem.Loader(Affinity(), batch_size=8, num_workers=2,
                       worker_init_fn=functools.partial(pin_to, other)) as loader:
        cols = read_all(loader)
    check_every_sample(cols)
    assert set(cols[1].tolist()) == {cpu_mask([other])}  # set after pinmem's placement
    assert set(cols[2].tolist()) == {cpu_mask([cpu])}    # what pinmem had applied


def test_refused_affinity_is_not_fatal_and_is_counted(monkeypatch):
    # A CPU no process can run on: sched_setaffinity fails with EINVAL, as for CPUs outside the
    # worker's cpuset. The workers go on where they are, and stats() says so.
    monkeypatch.setattr(_pinmem, "_numa_worker_cpus", lambda device: [4000])
    parent = cpu_mask(os.sched_getaffinity(0))
    with pinmem.Loader(Affinity(), batch_size=8, num_workers=2, device="cpu") as loader:
        cols = read_all(loader)
        st = loader.stats()
    check_every_sample(cols)
    assert set(cols[1].tolist()) == {parent}
    assert set(cols[2].tolist()) == {-1}
    assert st["worker_numa_cpus"] == [4000]
    assert st["worker_numa_refused"] == 2
    assert "sched_setaffinity([4000])" in st["worker_numa_problem"], st["worker_numa_problem"]
