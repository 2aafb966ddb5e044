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

Then, with {"model": ...}, 60 async saves alternate between the writer as it is and the writer
with its hand-over turned off (FileSystemWriter._hand_over: the save's thread sleeps a moment
at its first question to the writer, so the caller gets the interpreter lock back); rank 0
prints the median return and execute_save of each (the first two saves left out).

  PYTHONPATH=build-py/python python3 bench/probes/dcp_async_return.py cuda|cpu [RANKS] [SIZE_GIB]
"""
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import _async_thread_executor as ate

import pinmem.dcp as pdcp

T = {}


def timed(cls, name, key):
    """Replace cls.name with a wrapper that keeps its last duration in T[key]."""
    orig = getattr(cls, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            T[key] = time.perf_counter() - t0

    setattr(cls, name, wrapper)


timed(ate._ThreadBasedAsyncCheckpointExecutor, "execute_save", "exec")
timed(pdcp.FileSystemWriter, "stage", "stage")


def sync(dev):
    if dev != "cpu":
        torch.cuda.synchronize()


class _NoHandOver(pdcp.FileSystemWriter):
    def _hand_over(self):
        pass


def rank_main(rank, n, tmp, total, flat, dev):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29536")
    dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.set_num_threads(1)  # as torchrun sets it for several ranks a node (OMP_NUM_THREADS=1)
    if dev == "cuda":
        dev = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(dev)
    per = max(1, total // n // 96 // 2)  # bf16 elements per tensor
    sd = {f"r{rank}.t{i}": torch.randn(per, dtype=torch.bfloat16, device=dev) for i in range(96)}
    app = sd if flat else {"model": sd}
    writer = pdcp.FileSystemWriter(os.path.join(tmp, f"flat{flat}"))
    stager = pdcp.PinnedStager()
    for _ in range(6):
        dist.barrier()
        sync(dev)
        t0 = time.perf_counter()
        staged = stager.stage(app)
        sync(dev)
        snap = time.perf_counter() - t0
        del staged
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(app, storage_writer=writer)
        ret = time.perf_counter() - t0
        fut.result()
        if rank == 0:
            print(f"{'96 top-level keys' if flat else 'model: 96 keys'}: snapshot "
                  f"{snap * 1e3:.2f} ms, return {ret * 1e3:.2f} ms (stage {T['stage'] * 1e3:.2f}, "
                  f"execute_save {T['exec'] * 1e3:.2f})", flush=True)
    writer.close()
    stager.close()
    if not flat:
        writers = [_NoHandOver(os.path.join(tmp, "off")), pdcp.FileSystemWriter(
            os.path.join(tmp, "on"))]
        runs = ([], [])
        for i in range(60):
            dist.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save(app, storage_writer=writers[i % 2])
            ret = time.perf_counter() - t0
            fut.result()
            if i >= 2:
                runs[i % 2].append((ret, T["exec"]))
        for w in writers:
            w.close()
        if rank == 0:
            for name, r in zip(("hand-over off", "hand-over on"), runs):
                print(f"model: 96 keys, {name}: median return "
                      f"{statistics.median(x[0] for x in r) * 1e3:.2f} ms, execute_save "
                      f"{statistics.median(x[1] for x in r) * 1e3:.2f} ms ({len(r)} saves)",
                      flush=True)
    dist.destroy_process_group()


def main():
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    ranks = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    total = int(float(sys.argv[3]) * 2**30) if len(sys.argv) > 3 else 2**30
    if dev not in ("cpu", "cuda"):
        sys.exit("dcp_async_return.py: the device is cpu or cuda")
    with tempfile.TemporaryDirectory(dir=os.getcwd()) as tmp:
        for flat in (True, False):
            mp.spawn(rank_main, args=(ranks, tmp, total, flat, dev), nprocs=ranks)


if __name__ == "__main__":
    main()
