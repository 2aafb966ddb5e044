#!/usr/bin/env python3
"""DESIGN: a stand-alone probe of where dcp.async_save's return time goes with
pinmem.dcp.FileSystemWriter, kept so the async-return paragraph of docs/dcp.md can be measured
again. N gloo ranks (on a GPU they share the devices, rank r on device r mod the count) each hold
96 bf16 tensors (SIZE in all, every rank together), first as 96 top-level keys of the state dict,
then as {"model": those 96}. Six rounds of each; per round rank 0 prints:

  * snapshot: PinnedStager.stage alone, the device synchronized after it (what compare_dcp
    calls "the snapshot alone");
  * return: dcp.async_save's return, with inside it the writer's stage (the same snapshot,
    queued, not waited for) and torch's execute_save (it starts the save's thread; the caller
    gets the interpreter lock back once that thread lets go of it).

What is left of the return beyond those two is torch's own work around them (a logged call per
top-level key of the state dict, the executor's set-up).

Each round also prints where the return went: torch's part before the stage, the stage by
phase (PinnedStager.last), the time between it and execute_save, execute_save, the rest, and
Python's garbage collections in the call.

Then, with {"model": ...}, 90 async saves take turns between the writer with its hand-over
turned off (FileSystemWriter._hand_over: the save's thread sleeps a moment at its first
question to the writer, so the caller gets the interpreter lock back), the writer as it is, and
the writer as it is with Python's gc disabled during the call; rank 0 prints the median return
and execute_save of each (the first three saves left out).

EXECUTOR process: every async_save with torch's process executor (the save runs in a process
of its own, which the first save starts; torch's thread hands it each staged state dict,
pickled). The last part then takes turns between the snapshot's hand-over turned off
(pinmem.dcp._Staged: the thread that pickles the snapshot sleeps a moment first, so the caller
gets the interpreter lock back) and on, at Python's default switch interval (5 ms: how long a
thread that wants the interpreter lock waits before the holder is asked to let go), and on at
0.5 ms.

  PYTHONPATH=build-py/python python3 bench/probes/dcp_async_return.py cuda|cpu [RANKS] [SIZE_GIB]
      [thread|process]
"""
import gc
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import _async_process_executor as ape
from torch.distributed.checkpoint import _async_thread_executor as ate
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import pinmem.dcp as pdcp

T = {}


def timed(cls, name, key):
    """Replace cls.name with a wrapper that keeps its last duration in T[key], and when it
    began and ended in T[key + "_at"]."""
    orig = getattr(cls, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            t1 = time.perf_counter()
            T[key] = t1 - t0
            T[key + "_at"] = (t0, t1)

    setattr(cls, name, wrapper)


GC = []  # (generation, seconds) of each collection since the list was last cleared
_gc_t0 = [0.0]


def _gc_watch(phase, info):
    if phase == "start":
        _gc_t0[0] = time.perf_counter()
    else:
        GC.append((info["generation"], time.perf_counter() - _gc_t0[0]))


def parts(t0, t_end, stager):
    """Where one async_save's return went, in ms: before the stage (torch's logging, the state
    dict's Stateful objects), the stage by phase, between it and execute_save, execute_save,
    after it; and the collections of Python's gc in that time."""
    s0, s1 = T["stage_at"]
    e0, e1 = T["exec_at"]
    ph = " ".join(f"{k} {v * 1e3:.2f}" for k, v in stager.last.get("phases", {}).items()
                  if v >= 5e-6)
    gcs = ", ".join(f"gen{g} {x * 1e3:.2f}" for g, x in GC) or "none"
    return (f"before {(s0 - t0) * 1e3:.2f}, stage {(s1 - s0) * 1e3:.2f} [{ph}], between "
            f"{(e0 - s1) * 1e3:.2f}, execute_save {(e1 - e0) * 1e3:.2f}, after "
            f"{(t_end - e1) * 1e3:.2f}; gc {gcs}")


timed(ate._ThreadBasedAsyncCheckpointExecutor, "execute_save", "exec")
timed(ape._ProcessBasedAsyncCheckpointExecutor, "execute_save", "exec")
timed(pdcp.FileSystemWriter, "stage", "stage")
gc.callbacks.append(_gc_watch)


def sync(dev):
    if dev != "cpu":
        torch.cuda.synchronize()


class _NoHandOver(pdcp.FileSystemWriter):
    def _hand_over(self):
        pass


class _SnapshotNoHandOver(pdcp._Staged):
    """The stage's snapshot without its hand-over when pickled on another thread."""

    def __reduce_ex__(self, protocol):
        self.__dict__.pop("_staged_on", None)
        return dict, (), None, None, iter(self.items())


def rank_main(rank, n, tmp, total, flat, dev, executor):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29536")
    dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.set_num_threads(1)  # as torchrun sets it for several ranks a node (OMP_NUM_THREADS=1)
    if dev == "cuda":
        dev = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(dev)
    per = max(1, total // n // 96 // 2)  # bf16 elements per tensor
    sd = {f"r{rank}.t{i}": torch.randn(per, dtype=torch.bfloat16, device=dev) for i in range(96)}
    app = sd if flat else {"model": sd}
    kw = ({} if executor == "thread" else
          {"async_checkpointer_type": AsyncCheckpointerType.PROCESS})
    writer = pdcp.FileSystemWriter(os.path.join(tmp, f"flat{flat}"))
    stager = pdcp.PinnedStager()
    for _ in range(6):
        dist.barrier()
        sync(dev)
        t0 = time.perf_counter()
        staged = stager.stage(app)
        queued = time.perf_counter() - t0
        sync(dev)
        snap = time.perf_counter() - t0
        del staged
        sph = " ".join(f"{k} {v * 1e3:.2f}" for k, v in stager.last["phases"].items()
                       if v >= 5e-6)
        dist.barrier()
        GC.clear()
        t0 = time.perf_counter()
        fut = dcp.async_save(app, storage_writer=writer, **kw)
        t_end = time.perf_counter()
        ret = t_end - t0
        why = parts(t0, t_end, writer._stager)
        fut.result()
        if rank == 0:
            print(f"{'96 top-level keys' if flat else 'model: 96 keys'}: snapshot "
                  f"{snap * 1e3:.2f} ms (stage {queued * 1e3:.2f} [{sph}]), return "
                  f"{ret * 1e3:.2f} ms (stage {T['stage'] * 1e3:.2f}, execute_save "
                  f"{T['exec'] * 1e3:.2f})\n    {why}", flush=True)
    writer.close()
    stager.close()
    if not flat and executor == "process":
        w = pdcp.FileSystemWriter(os.path.join(tmp, "switch"))
        default = sys.getswitchinterval()
        staged_cls = pdcp._Staged
        runs = ([], [], [])
        for i in range(90):
            dist.barrier()
            k = i % 3
            if k == 0:
                pdcp._Staged = _SnapshotNoHandOver
            sys.setswitchinterval(0.0005 if k == 2 else default)
            t0 = time.perf_counter()
            fut = dcp.async_save(app, storage_writer=w, **kw)
            ret = time.perf_counter() - t0
            sys.setswitchinterval(default)
            pdcp._Staged = staged_cls
            fut.result()
            if i >= 3:
                runs[k].append((ret, T["exec"]))
        w.close()
        if rank == 0:
            for name, r in zip((f"snapshot hand-over off, switch interval {default * 1e3:g} ms",
                                f"snapshot hand-over on, switch interval {default * 1e3:g} ms",
                                "snapshot hand-over on, switch interval 0.5 ms"), runs):
                print(f"model: 96 keys, process executor, {name}: median return "
                      f"{statistics.median(x[0] for x in r) * 1e3:.2f} ms, execute_save "
                      f"{statistics.median(x[1] for x in r) * 1e3:.2f} ms ({len(r)} saves)",
                      flush=True)
    elif not flat:
        writers = [_NoHandOver(os.path.join(tmp, "off")), pdcp.FileSystemWriter(
            os.path.join(tmp, "on"))]
        writers.append(writers[1])
        runs = ([], [], [])
        for i in range(90):
            dist.barrier()
            k = i % 3
            if k == 2:
                gc.disable()
            t0 = time.perf_counter()
            fut = dcp.async_save(app, storage_writer=writers[k])
            ret = time.perf_counter() - t0
            gc.enable()
            fut.result()
            if i >= 3:
                runs[k].append((ret, T["exec"]))
        for w in writers[:2]:
            w.close()
        if rank == 0:
            for name, r in zip(("hand-over off", "hand-over on", "hand-over on, gc off"), runs):
                print(f"model: 96 keys, {name}: median return "
                      f"{statistics.median(x[0] for x in r) * 1e3:.2f} ms, execute_save "
                      f"{statistics.median(x[1] for x in r) * 1e3:.2f} ms ({len(r)} saves)",
                      flush=True)
    dist.destroy_process_group()


def main():
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    ranks = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    total = int(float(sys.argv[3]) * 2**30) if len(sys.argv) > 3 else 2**30
    executor = sys.argv[4] if len(sys.argv) > 4 else "thread"
    if dev not in ("cpu", "cuda"):
        sys.exit("dcp_async_return.py: the device is cpu or cuda")
    if executor not in ("thread", "process"):
        sys.exit("dcp_async_return.py: the executor is thread or process")
    with tempfile.TemporaryDirectory(dir=os.getcwd()) as tmp:
        for flat in (True, False):
            mp.spawn(rank_main, args=(ranks, tmp, total, flat, dev, executor), nprocs=ranks)


if __name__ == "__main__":
    main()
