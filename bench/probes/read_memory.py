#!/usr/bin/env python3
"""DESIGN: a stand-alone probe of what the disk's read reference (compare_checkpoint's Disk:
16 MiB O_DIRECT reads one at a time into one reused buffer) leaves out of a load, kept so the
cold-load paragraph of docs/dcp.md can be measured again. PROCS processes each read a file of
their own of SIZE bytes at the same moment (a barrier before each case), round by round, the
order of the cases turned every round:

  * reuse: 16 MiB O_DIRECT reads one at a time into one reused buffer (the Disk reference);
  * spread: the same reads, each into its own place in memory of the file's size, touched
    first, as a load lands its bytes;
  * read_file, read_file_8m: pinmem.read_file of the whole file into that memory, O_DIRECT in
    place, in pinmem's 1 MiB reads and in 8 MiB reads;
  * ranges_8m, ranges_1m: pinmem.read_ranges of the file as a DCP load reads it: 96 torch CPU
    tensors back to back with 512 bytes before each (the archive heads) into buffers of their
    own, through pinmem's slots (a torch tensor's address is not its file offset modulo 4 KiB),
    in 8 MiB and in 1 MiB reads.

Prints each case's GB/s (all processes' bytes over the slowest one's time) by round and the
median.

  PYTHONPATH=build-py/python python3 bench/probes/read_memory.py --dir DIR [--size 512M]
      [--procs 2] [--rounds 7]
"""
import argparse
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from compare_checkpoint import BLOCK, Disk, parse_size  # noqa: E402  (bench/)

CASES = ("reuse", "spread", "read_file", "read_file_8m", "ranges_8m", "ranges_1m")


def worker(rank, path, size, rounds, barrier, queue):
    import numpy as np
    import torch

    import pinmem
    disk = Disk(path, size)
    disk.write()
    n = disk.blocks * BLOCK
    spread = mmap.mmap(-1, n)
    arr = np.frombuffer(spread, dtype=np.uint8)
    arr[:] = 0
    per = (n // 96) // 4096 * 4096
    ranges = []
    for i in range(96):
        ranges.append((i * per, torch.zeros(512, dtype=torch.uint8)))
        ranges.append((i * per + 512, torch.zeros(per - 512, dtype=torch.uint8)))
    ranged = 96 * per

    def reuse():
        disk.read()
        return disk.reads[-1]

    def spread_():
        disk.read(into=spread)
        return disk.reads_into[-1]

    def timed(f, *a, **k):
        t0 = time.perf_counter()
        f(*a, **k)
        return time.perf_counter() - t0

    cases = {
        "reuse": reuse, "spread": spread_,
        "read_file": lambda: timed(lambda: pinmem.read_file(disk.path, arr, 0, io="direct")
                                   .wait()),
        "read_file_8m": lambda: timed(pinmem.read_ranges, disk.path, [(0, arr)], io="direct",
                                      chunk="8M"),
        # ranges cover 96 * per bytes of the file; scaled to the file's size as the others are
        "ranges_8m": lambda: timed(pinmem.read_ranges, disk.path, ranges, io="direct",
                                   chunk="8M") * size / ranged,
        "ranges_1m": lambda: timed(pinmem.read_ranges, disk.path, ranges, io="direct") * size
        / ranged,
    }
    out = {c: [] for c in CASES}
    for r in range(rounds):
        for c in CASES if r % 2 == 0 else CASES[::-1]:
            barrier.wait()
            out[c].append(cases[c]())
    disk.remove()
    queue.put(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="folder on the disk under test")
    ap.add_argument("--size", default="512M", help="bytes of each process's file (default 512M)")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    size = parse_size(args.size)
    print(f"read_memory: {args.procs} processes, {args.size} each, {os.cpu_count()} CPUs",
          flush=True)
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(args.procs), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, os.path.join(args.dir, f"read_memory.{r}.bin"),
                                              size, args.rounds, barrier, queue))
             for r in range(args.procs)]
    for p in procs:
        p.start()
    res = [queue.get() for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            sys.exit(f"read_memory: a process exited with {p.exitcode}")
    for c in CASES:
        rates = [args.procs * size / max(t) / 1e9 for t in zip(*(r[c] for r in res))]
        print(f"{c:12} GB/s by round {[round(x, 2) for x in rates]}  median "
              f"{statistics.median(rates):.2f}", flush=True)


if __name__ == "__main__":
    main()
