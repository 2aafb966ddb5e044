#!/usr/bin/env python3
"""DESIGN: a stand-alone probe of durable checkpoint writes, kept so the figures in docs/files.md
("Replacing a large file") can be measured again. Two questions, on the disk under --dir:

  patterns   which write pattern is fastest on this disk: O_DIRECT pwrite of 3 GiB from an
             aligned buffer with T threads and C-byte writes, with and without fallocate first,
             fdatasync included, beside pinmem.write_file(fsync=True) with file_threads T and
             file_chunk C; each case starts on a quiet disk (files removed, sync, a pause), and
             the cases rotate within each round so drift does not favour one;
  replace    what a save over an existing file costs: pinmem.safetensors.save_file and
             save_file_async of device tensors (256 MiB and 3 GiB) to the same path again and
             again, with the time the background release of the replaced file took after it.

  PYTHONPATH=build-py/python python3 bench/probes/save_writes.py patterns|replace --dir DIR
One JSON line per case on stdout (GB/s of each round, and the median).
"""
import argparse
import ctypes
import json
import mmap
import os
import threading
import time

import numpy as np

import pinmem
import pinmem.safetensors as ps

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def quiet(d):
    for f in os.listdir(d):
        os.unlink(os.path.join(d, f))
    os.sync()  # the journal commit with the removed files' discards, now
    time.sleep(0.3)


def raw_write(d, total, threads, chunk, falloc, block):
    fd = os.open(os.path.join(d, "raw.bin"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    t0 = time.perf_counter()
    if falloc and _libc.fallocate(fd, 0, 0, total) != 0:
        raise OSError(ctypes.get_errno(), "fallocate")
    n, nxt, lock = -(-total // chunk), [0], threading.Lock()

    def writer():
        while True:
            with lock:
                k = nxt[0]
                nxt[0] += 1
            if k >= n:
                return
            os.pwrite(fd, block[:min(chunk, total - k * chunk)], k * chunk)
    ts = [threading.Thread(target=writer) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    os.fdatasync(fd)
    seconds = time.perf_counter() - t0
    os.close(fd)
    return seconds


def patterns(d, rounds):
    total = 3 << 30
    block = mmap.mmap(-1, 64 << 20)
    block.write(os.urandom(1 << 20) * 64)
    block = memoryview(block)
    src = pinmem.empty(total, "uint8")
    np.asarray(src)[:] = 7
    mib = 1 << 20
    cases = [("raw", 1, 16 * mib, 0), ("raw", 12, 8 * mib, 1), ("raw", 4, 8 * mib, 1),
             ("raw", 2, 16 * mib, 1), ("raw", 12, 8 * mib, 0), ("raw", 2, 8 * mib, 0),
             ("pinmem", 12, 8 * mib, 1), ("pinmem", 4, 8 * mib, 1), ("pinmem", 2, 16 * mib, 1),
             ("pinmem", 1, 16 * mib, 1)]
    out = {c: [] for c in cases}
    for _ in range(rounds):
        for c in cases:
            quiet(d)
            kind, threads, chunk, falloc = c
            if kind == "raw":
                s = raw_write(d, total, threads, chunk, falloc, block)
            else:
                pinmem.set_option("file_threads", str(threads))
                pinmem.set_option("file_chunk", str(chunk))
                t0 = time.perf_counter()
                pinmem.write_file(os.path.join(d, "pm.bin"), src, fsync=True).wait()
                s = time.perf_counter() - t0
            out[c].append(round(total / s / 1e9, 3))
    quiet(d)
    for (kind, threads, chunk, falloc), v in out.items():
        print(json.dumps(dict(bench="save_writes", case="pattern", kind=kind, threads=threads,
                              chunk_mib=chunk // mib, fallocate=bool(falloc), bytes=total,
                              gbps=v, median=sorted(v)[len(v) // 2])), flush=True)


def replace(d, rounds):
    import torch
    for total in (256 << 20, 3 << 30):
        n = 96 if total > (1 << 30) else 8
        t = {"l%02d" % i: torch.randn(4096, total // n // 2 // 4096, dtype=torch.bfloat16,
                                      device="cuda") for i in range(n)}
        path = os.path.join(d, "ckpt.safetensors")
        for mode in ("save_file", "save_file_async"):
            for r in range(rounds):
                ps._releaser.wait_idle()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                h = getattr(ps, mode)(t, path)
                t1 = time.perf_counter()
                if h is not None:
                    h.wait()
                t2 = time.perf_counter()
                ps._releaser.wait_idle()
                t3 = time.perf_counter()
                print(json.dumps(dict(bench="save_writes", case="replace", mode=mode,
                                      bytes=total, replaced=r > 0 or mode != "save_file",
                                      returned_s=round(t1 - t0, 4), durable_s=round(t2 - t0, 4),
                                      gbps=round(total / (t2 - t0) / 1e9, 3),
                                      release_after_s=round(t3 - t2, 4))), flush=True)
        del t
    quiet(d)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["patterns", "replace"])
    ap.add_argument("--dir", required=True, help="an empty folder on the disk under test")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    (patterns if a.what == "patterns" else replace)(a.dir, a.rounds)


if __name__ == "__main__":
    main()
