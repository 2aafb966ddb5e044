#!/usr/bin/env python3
"""DESIGN: a stand-alone probe of several processes reading one cold file at the same moment (the
ranks of a node loading one checkpoint), kept so the table in docs/files.md ("io modes", readers
of one file) can be measured again. For each round and io mode (auto, buffered, direct, rotated
within the round), the file's pages are dropped (fsync, fadvise DONTNEED and, where the
process may, /proc/sys/vm/drop_caches), N child processes each pin a buffer as large as the file
and report ready, then all start pinmem.read_file together and each times its own read. One JSON
line per round and mode: each reader's seconds and its bytes through O_DIRECT and through the
page cache.

  PYTHONPATH=build-py/python python3 bench/probes/shared_reads.py --dir DIR \\
      [--bytes 1G] [--readers 1,4] [--rounds 4]
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from compare_checkpoint import drop_cache, parse_size  # noqa: E402  (bench/, beside probes/)


def child(path, io, start_fd, ready_fd):
    import pinmem
    size = os.path.getsize(path)
    dst = pinmem.empty(size, "uint8")
    np.asarray(dst)[::4096] = 1  # pinned and touched before the clock starts
    os.write(ready_fd, b"r")
    os.read(start_fd, 1)  # all start together
    s0 = pinmem._pinmem._file_stats()
    t0 = time.perf_counter()
    pinmem.read_file(path, dst, io=io).wait()
    dt = time.perf_counter() - t0
    s1 = pinmem._pinmem._file_stats()
    print(json.dumps(dict(seconds=round(dt, 4),
                          direct=s1["read_direct"] - s0["read_direct"],
                          buffered=s1["read_buffered"] - s0["read_buffered"])))


def round_of(path, io, n):
    how = drop_cache(path)
    start_r, start_w = os.pipe()
    ready_r, ready_w = os.pipe()
    kids = [subprocess.Popen([sys.executable, __file__, "--child", path, io, str(start_r),
                              str(ready_w)], stdout=subprocess.PIPE, text=True,
                             pass_fds=(start_r, ready_w)) for _ in range(n)]
    for _ in range(n):
        os.read(ready_r, 1)
    os.write(start_w, b"s" * n)
    out = [json.loads(k.communicate()[0]) for k in kids]
    for fd in (start_r, start_w, ready_r, ready_w):
        os.close(fd)
    if any(k.returncode for k in kids):
        raise SystemExit(f"a reader failed ({io}, {n} readers)")
    return how, out


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True, help="a folder on the disk under test")
    ap.add_argument("--bytes", default="1G", help="the file's size (K, M, G suffixes)")
    ap.add_argument("--readers", default="1,4", help="comma-separated reader counts")
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    size = parse_size(a.bytes)
    path = os.path.join(a.dir, "shared_reads.bin")
    with open(path, "wb") as f:
        for _ in range(0, size, 1 << 24):
            f.write(os.urandom(min(1 << 24, size - f.tell())))
    modes = ["auto", "buffered", "direct"]
    try:
        for r in range(a.rounds):
            for n in (int(x) for x in a.readers.split(",")):
                for io in modes[r % 3:] + modes[:r % 3]:
                    how, out = round_of(path, io, n)
                    print(json.dumps(dict(bench="shared_reads", round=r, io=io, readers=n,
                                          bytes=size, cache=how,
                                          slowest_seconds=max(o["seconds"] for o in out),
                                          each=out)), flush=True)
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
