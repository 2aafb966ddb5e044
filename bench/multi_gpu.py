#!/usr/bin/env python3
"""One process per GPU, as torchrun runs a job: pinmem.Loader per rank, alone and together.

Each rank uses device LOCAL_RANK (made current through PINMEM_DEVICE before pinmem starts) and
runs one epoch of a pinmem.Loader (batches delivered to the device) over a synthetic array
dataset, sharded by RANK / WORLD_SIZE. Measured, in GB/s of batch bytes delivered:

  * each rank alone (the others wait at a barrier), then every rank at once; per rank the
    ratio together / alone (the host's memory bandwidth and the loader's CPU work are shared:
    a ratio well under 1 with the GPUs idle says the host is the limit);
  * which GPUs each rank's process holds memory on (nvidia-smi --query-compute-apps), while
    every rank still holds its loader: rank k must hold memory on GPU k only (the classic
    failure: every rank also holds a context on GPU 0).

  torchrun --nproc-per-node N bench/multi_gpu.py [--samples 4096] [--sample-bytes 256K]
                                                 [--batch 64] [--json]
  python bench/multi_gpu.py --nproc N [...]     (starts the N processes itself)

What cannot be measured here is said in words and in the JSON ("unmeasured"), and the exit
status is still 0: one GPU (no "together" and no cross-GPU check), fewer GPUs than ranks,
no nvidia-smi, or the host backend (PINMEM_BACKEND=host PINMEM_HOST_DEVICES=N, a smoke test of
the script: simulated devices hold no GPU memory). nvidia-smi numbers GPUs by their physical
index: with CUDA_VISIBLE_DEVICES set, the check maps LOCAL_RANK through it.
"""
import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time

import numpy as np


def parse_size(text):
    text = str(text).strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def args_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=0,
                   help="start this many ranks here (without torchrun)")
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--sample-bytes", default="256K")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=0, help="loader workers (0: pinmem's default)")
    p.add_argument("--json", action="store_true", help="JSON lines on stdout")
    return p


# ---- the group: barriers and gathering, through torch.distributed (torchrun) or a pipe ------

class SpawnGroup:
    def __init__(self, rank, world, barrier, queue):
        self.rank, self.world, self._b, self._q = rank, world, barrier, queue

    def barrier(self):
        self._b.wait(timeout=600)

    def gather(self, obj):
        """Every rank's obj, on rank 0 (None elsewhere): through the parent's queue."""
        self._q.put((self.rank, obj))
        return None


class TorchGroup:
    def __init__(self):
        import torch.distributed as dist
        self._d = dist
        dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def barrier(self):
        self._d.barrier()

    def gather(self, obj):
        out = [None] * self.world
        self._d.all_gather_object(out, obj)
        return out if self.rank == 0 else None


# ---- one rank ------------------------------------------------------------------------------

def gpu_memory_by_pid():
    """{pid: set of GPU indices it holds memory on}, or a sentence saying why not."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return "nvidia-smi not found"
    try:
        gpus = subprocess.run([smi, "--query-gpu=index,uuid", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60, check=True).stdout
        apps = subprocess.run([smi, "--query-compute-apps=pid,used_memory,gpu_uuid",
                               "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60, check=True).stdout
    except (subprocess.SubprocessError, OSError) as e:
        return f"nvidia-smi failed: {e}"
    index = {}
    for line in gpus.strip().splitlines():
        i, uuid = [x.strip() for x in line.split(",", 1)]
        index[uuid] = int(i)
    held = {}
    for line in apps.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) >= 3 and parts[0].isdigit():
            held.setdefault(int(parts[0]), set()).add(index.get(parts[2], -1))
    return held


def physical_gpu(local_rank):
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not vis:
        return local_rank
    ids = [x.strip() for x in vis.split(",")]
    return int(ids[local_rank]) if local_rank < len(ids) and ids[local_rank].isdigit() else None


def run_epoch(pinmem, X, a, rank, world):
    loader = pinmem.Loader(X, batch_size=a.batch, rank=rank, world_size=world,
                           num_workers=a.workers, seed=1)
    t0 = time.perf_counter()
    nbytes = 0
    for b in loader:
        nbytes += b.nbytes if hasattr(b, "nbytes") else a.batch * X.shape[1]
        b = None
    pinmem.synchronize()
    dt = time.perf_counter() - t0
    return loader, nbytes, dt


def rank_main(rank, world, local_rank, a, group):
    os.environ["PINMEM_DEVICE"] = str(local_rank)  # pm_init makes it current: nothing on GPU 0
    import pinmem
    out = {"rank": rank, "device": local_rank, "pid": os.getpid()}
    try:
        pinmem.init()
    except pinmem.Error as e:  # a device that is not there: said, not measured
        out.update(backend=None, devices=None, error=str(e))
    else:
        out.update(backend=pinmem.backend(), devices=pinmem.device_count())
        if local_rank >= out["devices"]:
            out["error"] = f"device {local_rank} does not exist ({out['devices']} device(s))"
    backend = out["backend"]
    if "error" in out:
        for _ in range(world + 3):  # as many barriers as a rank that measures
            group.barrier()
        return group.gather(out)
    sb = parse_size(a.sample_bytes)
    rng = np.random.default_rng(rank)
    X = rng.integers(1, 255, size=(a.samples, sb), dtype=np.uint8)
    # Alone: one rank at a time.
    for k in range(world):
        group.barrier()
        if k == rank:
            loader, nbytes, dt = run_epoch(pinmem, X, a, rank, world)
            loader.close()
            out["alone"] = {"bytes": nbytes, "seconds": dt}
    group.barrier()
    loader, nbytes, dt = run_epoch(pinmem, X, a, rank, world)
    out["together"] = {"bytes": nbytes, "seconds": dt}
    group.barrier()  # every rank still holds its loader (and its contexts) here
    if rank == 0:
        out["gpu_memory"] = ("host backend: simulated devices hold no GPU memory"
                             if backend != "cuda" else gpu_memory_by_pid())
    group.barrier()
    loader.close()
    return group.gather(out)


def report(results, a, world):
    rows, unmeasured = [], []
    res = sorted(results, key=lambda r: r["rank"])
    errors = [r for r in res if "error" in r]
    for r in errors:
        unmeasured.append(f"rank {r['rank']}: {r['error']}")
    if errors:
        have = [r["devices"] for r in res if r.get("devices") is not None]
        unmeasured.append(f"{world} ranks need {world} devices; this machine has "
                          f"{have[0] if have else 'fewer'}: those ranks measured nothing")
    ok = [r for r in res if "error" not in r]
    for r in ok:
        al, tg = r["alone"], r["together"]
        ga = al["bytes"] / al["seconds"] / 1e9
        gt = tg["bytes"] / tg["seconds"] / 1e9
        rows.append({"bench": "multi_gpu", "case": "loader_alone", "rank": r["rank"],
                     "device": r["device"], "bytes": al["bytes"], "seconds": al["seconds"],
                     "gbps": ga, "verified": None})
        rows.append({"bench": "multi_gpu", "case": "loader_together", "rank": r["rank"],
                     "device": r["device"], "bytes": tg["bytes"], "seconds": tg["seconds"],
                     "gbps": gt, "verified": None,
                     "ratio": gt / ga if world > 1 else None})
    if world == 1:
        unmeasured.append("one GPU: no 'together' beside another rank and no cross-GPU memory "
                          "check; the loader_together row is the same rank again")
    mem = ok[0].get("gpu_memory") if ok else None
    if isinstance(mem, str):
        unmeasured.append("GPU memory per process: " + mem)
    elif isinstance(mem, dict) and world > 1:
        for r in ok:
            want = physical_gpu(r["device"])
            held = sorted(mem.get(r["pid"], set()))
            good = held == [want]
            rows.append({"bench": "multi_gpu", "case": "gpu_memory_check", "rank": r["rank"],
                         "device": r["device"], "pid": r["pid"], "gpus_with_memory": held,
                         "want": [want], "verified": good, "bytes": 0, "seconds": None,
                         "gbps": None})
    summary = {"bench": "multi_gpu", "case": "summary", "world_size": world,
               "backend": ok[0]["backend"] if ok else None, "unmeasured": unmeasured,
               "bytes": 0, "seconds": None, "gbps": None, "verified": None}
    rows.append(summary)
    for row in rows:
        if a.json:
            print(json.dumps(row), flush=True)
        else:
            print(" ".join(f"{k}={v}" for k, v in row.items() if k != "bench"), file=sys.stderr)
    for u in unmeasured:
        print("not measured: " + u, file=sys.stderr)
    bad = [r for r in rows if r["case"] == "gpu_memory_check" and not r["verified"]]
    return 1 if bad else 0


def spawn_entry(rank, world, a, barrier, queue):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    try:
        rank_main(rank, world, rank, a, SpawnGroup(rank, world, barrier, queue))
    except BaseException as e:
        queue.put((rank, {"rank": rank, "device": rank, "error": repr(e), "devices": 0,
                          "pid": os.getpid(), "backend": None}))
        raise


def run_spawned(a, n):
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=spawn_entry, args=(r, n, a, barrier, queue)) for r in range(n)]
    for p in procs:
        p.start()
    results = {}
    while len(results) < n:
        rank, obj = queue.get(timeout=3600)
        results.setdefault(rank, obj)
    for p in procs:
        p.join(timeout=120)
    return report(list(results.values()), a, n)


def main():
    a = args_parser().parse_args()
    if a.nproc:
        return run_spawned(a, a.nproc)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        group = TorchGroup()
        local = int(os.environ.get("LOCAL_RANK", group.rank))
        res = rank_main(group.rank, group.world, local, a, group)
        return report(res, a, group.world) if group.rank == 0 else 0
    return run_spawned(a, 1)  # neither: one rank, started here


if __name__ == "__main__":
    sys.exit(main())
