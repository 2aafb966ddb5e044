#!/usr/bin/env python3
"""DESIGN: a stand-alone probe of what pinmem.write_ranges(crc32=True) costs a write, kept so the
figures in docs/files.md ("CRC-32 of what is written") can be measured again. SIZE bytes of
device memory (on a machine without a GPU, the host backend's device memory: set
PINMEM_BACKEND=host) are written to one file in --dir, O_DIRECT, in pinmem's default units and
threads, with and without the CRCs, in turns, ROUNDS rounds; the CRC is checked against
zlib.crc32 of the bytes. Per case: the median GB/s and the median CPU seconds of the process
(user + system, all threads) a write. Beside them, one thread's CRC-32 of the same bytes: zlib's
(what pinmem's threads use) and ISA-L's (the isal package, what pinmem.dcp uses from Python,
where installed), the best of ROUNDS each.

  PYTHONPATH=build-py/python python3 bench/probes/write_crc.py [--dir DIR] [--size 256M]
      [--rounds 5] [--threads 0]
"""
import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
import zlib

import numpy as np

import pinmem


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="folder on the disk under test")
    ap.add_argument("--size", default="256M", help="bytes written (default 256M)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="the call's threads (0: pinmem's)")
    args = ap.parse_args()
    n = pinmem.parse_size(args.size)
    host = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    dev = pinmem.device_empty(n, "uint8")
    pinmem.copy(dev, host).wait()
    want = zlib.crc32(host)
    folder = tempfile.mkdtemp(prefix="write-crc-", dir=args.dir)
    path = os.path.join(folder, "f.bin")
    rate, cpu = {False: [], True: []}, {False: [], True: []}
    try:
        pinmem.write_ranges(path, [(0, dev)], io="direct")  # the file's blocks allocated
        for k in range(args.rounds):
            for crc in ((False, True) if k % 2 == 0 else (True, False)):
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                t0 = time.perf_counter()
                got = pinmem.write_ranges(path, [(0, dev)], io="direct", crc32=crc,
                                          threads=args.threads)
                dt = time.perf_counter() - t0
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                if crc and got != [want]:
                    sys.exit("write_crc: CRC %r, zlib says %08x" % (got, want))
                rate[crc].append(n / dt / 1e9)
                cpu[crc].append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
    finally:
        os.remove(path) if os.path.exists(path) else None
        os.rmdir(folder)
    print("write_crc: %s MiB from device memory, O_DIRECT, backend %s, %d CPUs, threads %s, "
          "%d rounds" % (n >> 20, pinmem.backend(), len(os.sched_getaffinity(0)),
                         args.threads or "pinmem's", args.rounds))
    for crc in (False, True):
        print("  crc32=%-5s %.2f GB/s (%s), CPU %.3f s a write" % (
            crc, statistics.median(rate[crc]), " ".join("%.2f" % r for r in rate[crc]),
            statistics.median(cpu[crc])))
    crcs = {"zlib": zlib.crc32}
    try:
        from isal.isal_zlib import crc32 as isal_crc32
        crcs["ISA-L"] = isal_crc32
    except ImportError:
        pass
    for name, fn in crcs.items():
        best = 0.0
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            if fn(host) != want:
                sys.exit("write_crc: %s's CRC differs from zlib's" % name)
            best = max(best, n / (time.perf_counter() - t0) / 1e9)
        print("  one thread's CRC-32, %-5s %.2f GB/s" % (name, best))


if __name__ == "__main__":
    main()
