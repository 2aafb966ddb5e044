#!/usr/bin/env python3
"""DESIGN: a stand-alone probe of the request size of pinmem.dcp's chunk writes (a save from
tensors that are not pinned: each rank's file put together in 16 MiB pinned chunks, each chunk
written with one pinmem.write_ranges call), kept so the figure in _FileOut's comment can be
measured again. RANKS gloo ranks each save their shard of SIZE (bf16 tensors, as compare_dcp
makes them) with dcp.save and pinmem's writer, round by round, the order of the cases turned
every round, a fresh folder each time (fsync'd, as every save is):

  * 1m: the chunk in 1 MiB requests (pinmem's default file_write_chunk) on WRITE_THREADS threads;
  * split: the chunk over WRITE_THREADS, one request a thread (the writer's rule);
  * whole: the chunk in one request.

Rank 0 prints each case's GB/s (all ranks' bytes over the slowest rank's time) per round and
the median.

  PYTHONPATH=build-py/python python3 bench/probes/dcp_write_units.py --dir DIR \\
      [--ranks 2] [--size 1G] [--rounds 9]
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import pinmem.dcp as pdcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from compare_checkpoint import make_checkpoint, parse_size  # noqa: E402  (bench/)

OUT = pdcp._FileOut
THREADS = OUT.WRITE_THREADS
CASES = {"1m": (lambda: 1 << 20, THREADS), "split": (OUT.write_unit, THREADS),
         "whole": (lambda: OUT.CHUNK, 1)}


def rank_main(rank, n, tmp, size, rounds):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29543")
    dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.set_num_threads(1)  # as torchrun sets it for several ranks a node
    shard = make_checkpoint(torch, size // n, "cpu")
    app = {"model": {f"rank{rank}.{k}": v for k, v in shard.items()}}
    mine = sum(t.numel() * t.element_size() for t in app["model"].values())
    names = list(CASES)
    times = {c: [] for c in names}
    for rnd in range(rounds):
        for c in names if rnd % 2 == 0 else names[::-1]:
            unit, threads = CASES[c]
            OUT.write_unit = staticmethod(unit)
            OUT.WRITE_THREADS = threads
            folder = os.path.join(tmp, "ckpt")
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
                os.sync()
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save(app, storage_writer=pdcp.FileSystemWriter(folder))
            took = [None] * n
            dist.all_gather_object(took, time.perf_counter() - t0)
            times[c].append(max(took))
    if rank == 0:
        for c in names:
            rates = [n * mine / s / 1e9 for s in times[c]]
            print(f"{c:6} GB/s by round {[round(r, 2) for r in rates]}  median "
                  f"{statistics.median(rates):.2f}", flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="folder on the disk under test")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--size", default="1G", help="bytes in all ranks (default 1G)")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    print(f"dcp_write_units: {args.ranks} ranks, {args.size}, chunk {OUT.CHUNK >> 20} MiB, "
          f"{THREADS} threads a call, split unit {OUT.write_unit() / 2**20:.2f} MiB", flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        mp.spawn(rank_main, args=(args.ranks, tmp, parse_size(args.size), args.rounds),
                 nprocs=args.ranks)


if __name__ == "__main__":
    main()
