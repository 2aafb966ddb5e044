#!/usr/bin/env python3
"""Which request pattern of pinmem.write_ranges keeps up with the disk: the same bytes written
from pinned memory in units of `chunk` bytes by `threads` I/O threads (O_DIRECT, fsync), beside
the disk's own write (compare_checkpoint's Disk: 16 MiB O_DIRECT requests one at a time, fsync),
by one writer and by two processes at once (as two DCP ranks write). The disk's write is timed
three times: from its own 16 MiB buffer (huge pages, as compare_checkpoint and compare_dcp
measure it), the same requests from the first 16 MiB of pinmem's pinned buffer, and from the
whole pinned buffer, each request from its own memory as a save's are (on a virtual disk the
host copies a reused buffer from its caches). Every write goes to a new
file on a quiet disk (the old one removed and synced first), and each round times the disk and
then every pattern in turn, so a pattern is compared with the disk run of its own round (a
virtual disk's rate moves from minute to minute). Per pattern: the median of the rounds' times
and of the ratios to the disk (above 1: faster than the disk's own write).

  python bench/write_pattern.py [--size 512M] [--rounds 5] [--dir /var/tmp] [--json]
"""
import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_checkpoint import BLOCK, Disk, parse_size  # noqa: E402

MIB = 1 << 20
# (chunk, threads): pinmem's default unit (1 MiB) with its threads, and larger units with fewer
PATTERNS = [(1 * MIB, 4), (8 * MIB, 4), (8 * MIB, 2), (16 * MIB, 2), (16 * MIB, 1), (32 * MIB, 2)]


def pm_write(pinmem, path, buf, chunk, threads):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.sync()
    t0 = time.perf_counter()
    pinmem.write_ranges(path, [(0, buf)], fsync=True, threads=threads, chunk=chunk)
    return time.perf_counter() - t0


def writer(rank, nbytes, rounds, folder, barrier, out):
    """One writer's times per round: [disk, disk from the pinned buffer's first block, disk
    from the whole pinned buffer, pattern 0, ...]."""
    import numpy as np
    import pinmem
    buf = pinmem.empty((nbytes,), "uint8")
    np.frombuffer(buf, np.uint8)[:] = np.random.default_rng(rank).integers(0, 255, nbytes,
                                                                           np.uint8)
    disk = Disk(os.path.join(folder, f"disk.{rank}"), nbytes)
    # the same requests, from the pinned buffer's first block
    from_pinned = Disk(os.path.join(folder, f"pinned.{rank}"), nbytes,
                       buf=memoryview(buf)[:BLOCK])
    times = []
    for _ in range(rounds):
        row = []
        barrier.wait()
        disk.write()
        if not disk.ok:
            raise SystemExit(f"write_pattern: the disk's O_DIRECT write failed in {folder}")
        row.append(disk.writes[-1])
        barrier.wait()
        from_pinned.write()
        row.append(from_pinned.writes[-1])
        barrier.wait()
        from_pinned.write(src=buf)
        row.append(from_pinned.writes_from[-1])
        for chunk, threads in PATTERNS:
            barrier.wait()
            row.append(pm_write(pinmem, os.path.join(folder, f"pm.{rank}"), buf, chunk, threads))
        times.append(row)
    disk.remove()
    from_pinned.remove()
    out.put((rank, times))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="512M", help="bytes each writer writes (default 512M)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="folder on the disk under test")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    nbytes = parse_size(a.size)
    if nbytes < BLOCK:
        raise SystemExit(f"write_pattern: --size must be at least {BLOCK >> 20} MiB (the disk's "
                         "requests are that large)")
    folder = tempfile.mkdtemp(prefix="pinmem-pattern.", dir=a.dir)
    say = (lambda *x: print(*x, file=sys.stderr, flush=True)) if a.json else print
    try:
        say(f"write_pattern: {nbytes / 1e9:.2f} GB per writer, {a.rounds} rounds, "
            f"{len(os.sched_getaffinity(0))} CPUs; files in {folder}")
        ctx = mp.get_context("spawn")
        for nw in (1, 2):
            barrier, out = ctx.Barrier(nw), ctx.Queue()
            procs = [ctx.Process(target=writer, args=(r, nbytes, a.rounds, folder, barrier, out))
                     for r in range(nw)]
            for p in procs:
                p.start()
            got = dict(out.get() for _ in procs)
            for p in procs:
                p.join()
            # a round's time: its slowest writer's (all bytes are in the files only then)
            rounds = [[max(got[r][i][k] for r in got) for k in range(3 + len(PATTERNS))]
                      for i in range(a.rounds)]
            disk = statistics.median(r[0] for r in rounds)
            say(f"  {nw} writer(s): the disk's own write {disk:.3f} s, "
                f"{nw * nbytes / disk / 1e9:.2f} GB/s (median of the rounds)")
            rows = [dict(bench="write_pattern", writers=nw, bytes=nw * nbytes, case="disk",
                         seconds=round(disk, 6), gbps=round(nw * nbytes / disk / 1e9, 3))]
            for k, (case, what) in enumerate((
                    ("disk_from_pinned", "the same requests from the pinned buffer's first "
                     "16 MiB"),
                    ("disk_from_pinned_whole", "the same requests from the whole pinned "
                     "buffer")), 1):
                t = statistics.median(r[k] for r in rounds)
                ratios = sorted(r[0] / r[k] for r in rounds)
                say(f"    {what}: {t:.3f} s, {nw * nbytes / t / 1e9:.2f} GB/s "
                    f"({statistics.median(ratios):.2f}x, {ratios[0]:.2f}x-{ratios[-1]:.2f}x)")
                rows.append(dict(bench="write_pattern", writers=nw, bytes=nw * nbytes,
                                 case=case, seconds=round(t, 6),
                                 gbps=round(nw * nbytes / t / 1e9, 3),
                                 disk_ratio=round(statistics.median(ratios), 3),
                                 disk_ratios=[round(x, 3) for x in ratios]))
            for k, (chunk, threads) in enumerate(PATTERNS, 3):
                t = statistics.median(r[k] for r in rounds)
                ratios = sorted(r[0] / r[k] for r in rounds)
                say(f"    chunk {chunk // MIB:>2} MiB, {threads} thread(s): {t:.3f} s, "
                    f"{nw * nbytes / t / 1e9:.2f} GB/s; against the disk of its round: median "
                    f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}x-{ratios[-1]:.2f}x)")
                rows.append(dict(bench="write_pattern", writers=nw, bytes=nw * nbytes,
                                 case="pinmem", chunk=chunk, threads=threads,
                                 seconds=round(t, 6), gbps=round(nw * nbytes / t / 1e9, 3),
                                 disk_ratio=round(statistics.median(ratios), 3),
                                 disk_ratios=[round(x, 3) for x in ratios]))
            if a.json:
                for row in rows:
                    print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
