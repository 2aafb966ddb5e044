#!/usr/bin/env python3
"""DESIGN: a stand-alone probe of the request size of pinmem.dcp's chunk writes (a save from
tensors that are not pinned: each rank's file put together in 16 MiB pinned chunks, each chunk
written with one pinmem.write_ranges call), kept so the figure in _FileOut's comment can be
measured again. RANKS gloo ranks each save their shard of SIZE (bf16 tensors, as compare_dcp
makes them) with dcp.save and pinmem's writer, round by round, the order of the cases turned
every round, a fresh folder each time (fsync'd, as every save is):

  * default: the writer's own rule (for tensors that are not pinned: the chunk over
    WRITE_THREADS, one request a thread; for a pinned snapshot: GATHER_THREADS and MIDDLE_THREADS
    requests in flight);
  * 1m, 4m, 8m, whole: the chunk in requests of 1 MiB on WRITE_THREADS threads, of 4 MiB on 4, of
    8 MiB on 2, in one request;
  * with --pinned (a save of PinnedStager's snapshot, as async_save writes): t2, t4, t8, the
    gathered writes with 2, 4 or 8 requests in flight;
  * disk: no DCP: each rank writes its bytes to a file of its own in 16 MiB O_DIRECT requests,
    one at a time, and fsyncs it; every rank removes its previous file and syncs before a
    barrier, and the time is the span from the first rank's start to the last one's fsync
    (compare_dcp's measure of the disk);
  * disk-staggered: the same writes timed rank by rank: each rank removes its previous file and
    syncs after the barrier, and the time is the slowest rank's own, from its open to its
    fsync. Each rank's sync ends when it ends, so the writes may start apart, and a rank's own
    time may then leave out part of the others' load on the disk.

Rank 0 prints each case's GB/s (all ranks' bytes over the slowest rank's time) per round and
the median.

  PYTHONPATH=build-py/python python3 bench/probes/dcp_write_units.py --dir DIR \\
      [--ranks 2] [--size 1G] [--rounds 9] [--pinned]
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
from compare_checkpoint import Disk, make_checkpoint, parse_size  # noqa: E402  (bench/)

OUT = pdcp._FileOut
THREADS = OUT.WRITE_THREADS
MIB = 1 << 20
# case -> _FileOut attributes for its saves (None: the disk alone)
CASES = {"default": {},
         "1m": dict(write_unit=staticmethod(lambda: MIB), WRITE_THREADS=THREADS),
         "4m": dict(write_unit=staticmethod(lambda: 4 * MIB), WRITE_THREADS=4),
         "8m": dict(write_unit=staticmethod(lambda: 8 * MIB), WRITE_THREADS=2),
         "whole": dict(write_unit=staticmethod(lambda: OUT.CHUNK), WRITE_THREADS=1),
         "disk": None, "disk-staggered": None}
PINNED_CASES = {"default": {},
                "t2": dict(GATHER_THREADS=2, MIDDLE_THREADS=2),
                "t4": dict(GATHER_THREADS=4, MIDDLE_THREADS=4),
                "t8": dict(GATHER_THREADS=8, MIDDLE_THREADS=8),
                "disk": None, "disk-staggered": None}


def rank_main(rank, n, tmp, size, rounds, pinned):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29543")
    dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.set_num_threads(1)  # as torchrun sets it for several ranks a node
    shard = make_checkpoint(torch, size // n, "cpu")
    app = {"model": {f"rank{rank}.{k}": v for k, v in shard.items()}}
    mine = sum(t.numel() * t.element_size() for t in app["model"].values())
    cases = PINNED_CASES if pinned else CASES
    if pinned:
        stager = pdcp.PinnedStager()
        app = stager.stage(app)
    disks = {c: Disk(os.path.join(tmp, f"{c}.{rank}.bin"), mine)
             for c in ("disk", "disk-staggered")}
    spread = {c: [] for c in disks}  # per run: the ranks' starts, last minus first
    saved = {k: getattr(OUT, k) for c in cases.values() if c for k in c}
    names = list(cases)
    times = {c: [] for c in names}
    for rnd in range(rounds):
        for c in names if rnd % 2 == 0 else names[::-1]:
            for k, v in saved.items():
                setattr(OUT, k, v)
            for k, v in (cases[c] or {}).items():
                setattr(OUT, k, v)
            folder = os.path.join(tmp, "ckpt")
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
                os.sync()
            if c == "disk":
                disks[c].clear()
            dist.barrier()
            if c in disks:
                disk = disks[c]
                disk.write(clear=c != "disk")  # times itself from its open to its fsync
                mine_run = (disk.starts[-1], disk.writes[-1])
            else:
                t0 = time.perf_counter()
                dcp.save(app, storage_writer=pdcp.FileSystemWriter(folder))
                mine_run = (None, time.perf_counter() - t0)
            took = [None] * n
            dist.all_gather_object(took, mine_run)
            if c in disks:
                spread[c].append(max(t for t, _ in took) - min(t for t, _ in took))
            if c == "disk":
                took = [max(t + d for t, d in took) - min(t for t, _ in took)]
            else:
                took = [d for _, d in took]
            times[c].append(max(took))
    if rank == 0:
        report(times, n * mine, lambda c: f"  starts apart by up to {1e3 * max(spread[c]):.1f} ms"
               if c in spread else "")
    dist.destroy_process_group()


def report(times, nbytes, extra=lambda c: ""):
    """Each case's GB/s (nbytes over each round's time) by round and their median."""
    width = max(map(len, times))
    for c, secs in times.items():
        rates = [nbytes / s / 1e9 for s in secs]
        print(f"{c:{width}} GB/s by round {[round(r, 2) for r in rates]}  median "
              f"{statistics.median(rates):.2f}{extra(c)}", flush=True)


def arguments(doc, rounds):
    """The options both probes take."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="folder on the disk under test")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--size", default="1G", help="bytes in all ranks (default 1G)")
    ap.add_argument("--rounds", type=int, default=rounds)
    return ap


def main():
    ap = arguments(__doc__, 9)
    ap.add_argument("--pinned", action="store_true",
                    help="save PinnedStager's snapshot (async_save's write) instead of the tensors")
    args = ap.parse_args()
    print(f"dcp_write_units: {args.ranks} ranks, {args.size}, chunk {OUT.CHUNK >> 20} MiB, "
          f"{THREADS} threads a call, split unit {OUT.write_unit() / 2**20:.2f} MiB, "
          f"{'pinned snapshot' if args.pinned else 'tensors not pinned'}, {os.cpu_count()} CPUs",
          flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        mp.spawn(rank_main, args=(args.ranks, tmp, parse_size(args.size), args.rounds, args.pinned),
                 nprocs=args.ranks)


if __name__ == "__main__":
    main()
