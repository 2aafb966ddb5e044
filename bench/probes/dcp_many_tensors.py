#!/usr/bin/env python3
"""DESIGN: a stand-alone probe of a state dict shaped as a model's and its optimizer's are: many
tensors, most of them small. compare_dcp saves 96 large tensors a rank; a model's checkpoint
also holds, per layer, norm weights of a few KiB and, with Adam, two state tensors per weight
and a 0-d step each. Per tensor costs (DCP's planning, an archive's head and tail, a request)
then weigh as much as the bytes.

RANKS gloo ranks each hold LAYERS layers of 4 square and 2 rectangular weights of width HIDDEN
(bf16) and 2 norm weights, each with Adam's exp_avg and exp_avg_sq (fp32) and step (0-d), on
DEVICE (cpu, or cuda: rank r on device r mod the device count), and, round by round (the order of the cases turned every round, a fresh folder each time):

  * torch: dcp.save with torch's FileSystemWriter, dcp.load with its FileSystemReader, cold;
  * pinmem: the same with pinmem.dcp's writer and reader;
  * pinmem-saved: pinmem.dcp's writer with every tensor under pinmem.dcp.SMALL bytes written by
    torch.save one by one (as torch's writer does) instead of from its shape's archive
    template, and pinmem's reader.

Every load is checked against the state dict. Rank 0 prints each case's save and load seconds
per round (the slowest rank's) and the best.

  PYTHONPATH=build-py/python python3 bench/probes/dcp_many_tensors.py --dir DIR \\
      [--ranks 2] [--layers 48] [--hidden 64] [--rounds 5] [--device cpu|cuda]
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import pinmem.dcp as pdcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from compare_checkpoint import drop_cache  # noqa: E402  (bench/)

CASES = ("torch", "pinmem", "pinmem-saved")


def state_dict(rank, layers, hidden, device):
    g = torch.Generator().manual_seed(rank)
    h = hidden
    shapes = {"q": (h, h), "k": (h, h), "v": (h, h), "o": (h, h), "up": (2 * h, h),
              "down": (h, 2 * h), "norm1": (h,), "norm2": (h,)}
    sd = {}
    for layer in range(layers):
        for name, shape in shapes.items():
            key = f"r{rank}.layers.{layer}.{name}"
            sd["model." + key] = torch.randn(shape, generator=g).to(torch.bfloat16)
            sd["optim." + key + ".exp_avg"] = torch.randn(shape, generator=g)
            sd["optim." + key + ".exp_avg_sq"] = torch.rand(shape, generator=g)
            sd["optim." + key + ".step"] = torch.tensor(float(layer + 1))
    return {k: v.to(device) for k, v in sd.items()}


def _saved_small(add_tensor):
    """_FileOut.add_tensor with the tensors under SMALL bytes given to torch.save one by one."""
    def add(self, item, t):
        src, flat = pdcp._source(t)
        if flat is not None and src.numel() * src.element_size() < pdcp.SMALL:
            return self._add_saved(item, src)
        return add_tensor(self, item, t)
    return add


def rank_main(rank, n, tmp, layers, hidden, rounds, device):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29547")
    dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.set_num_threads(1)  # as torchrun sets it for several ranks a node
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    sd = state_dict(rank, layers, hidden, device)
    mine = sum(t.numel() * t.element_size() for t in sd.values())
    add_tensor = pdcp._FileOut.add_tensor
    times = {c: [] for c in CASES}

    def one(case, path):
        writer = (dcp.FileSystemWriter if case == "torch" else pdcp.FileSystemWriter)(path)
        reader = (dcp.FileSystemReader if case == "torch" else pdcp.FileSystemReader)(path)
        pdcp._FileOut.add_tensor = _saved_small(add_tensor) if case == "pinmem-saved" \
            else add_tensor
        try:
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save(sd, storage_writer=writer)
            save_s = time.perf_counter() - t0
        finally:
            pdcp._FileOut.add_tensor = add_tensor
        dist.barrier()
        if rank == 0:
            for f in os.listdir(path):
                drop_cache(os.path.join(path, f))
        dist.barrier()
        got = {k: torch.zeros_like(v) for k, v in sd.items()}
        t0 = time.perf_counter()
        dcp.load(got, storage_reader=reader)
        load_s = time.perf_counter() - t0
        bad = [k for k, v in sd.items() if not torch.equal(got[k], v)]
        if bad:
            raise AssertionError(f"{case}: {len(bad)} tensors loaded wrong, {bad[0]} first")
        return _slowest((save_s, load_s))

    for r in range(rounds + 1):  # round 0 warms every case up, untimed
        for case in CASES[r % len(CASES):] + CASES[:r % len(CASES)]:
            path = os.path.join(tmp, f"{case}-{r}")
            res = one(case, path)
            if r:
                times[case].append(res)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
    if rank == 0:
        print(f"dcp_many_tensors: {n} ranks, {len(sd)} tensors a rank ({layers} layers, hidden "
              f"{hidden}), {mine / 2**20:.1f} MiB a rank, device {device.split(':')[0]}, "
              f"{rounds} rounds, torch "
              f"{torch.__version__}")
        for case, rs in times.items():
            print(f"  {case:13s} save best {min(s for s, _ in rs):.3f} s  load best "
                  f"{min(ld for _, ld in rs):.3f} s  rounds (save, load) "
                  f"{[(round(s, 3), round(ld, 3)) for s, ld in rs]}")
    dist.destroy_process_group()


def _slowest(pair):
    """(the slowest rank's save seconds, the slowest rank's load seconds)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, pair)
    return max(p[0] for p in out), max(p[1] for p in out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="folder on the disk under test")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="pinmem-many.", dir=a.dir)
    try:
        mp.spawn(rank_main, args=(a.ranks, tmp, a.layers, a.hidden, a.rounds, a.device), nprocs=a.ranks)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
