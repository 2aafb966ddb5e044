#!/usr/bin/env python3
"""DESIGN: a stand-alone probe of what pinmem.write_ranges(crc32=True) costs a write, kept so the
figures in docs/files.md ("CRC-32 of what is written") can be measured again. SIZE bytes of
device memory (on a machine without a GPU, the host backend's device memory: set
PINMEM_BACKEND=host) are written to one file in --dir, O_DIRECT, in pinmem's default units and
threads (or --threads, --chunk), --procs processes at once (each its own file and memory, as
ranks), ROUNDS rounds. Each round writes without CRCs, with zlib's CRCs (PINMEM_ISAL=0) and with
ISA-L's (what pinmem finds: libisal.so.2, or the isal package's), in an order that rotates from
round to round. Which CRC pinmem computes is fixed once a process, so every case of a round
runs in processes of its own; the CRCs are checked against zlib.crc32 of the bytes. Per case:
the median GB/s (all processes' bytes over the slowest one's write) and the median CPU seconds
of a process (user + system, all threads) a write. Beside them, one thread's CRC-32 of the same
bytes: zlib's and ISA-L's (the isal package), the best of ROUNDS each.

  PYTHONPATH=build-py/python python3 bench/probes/write_crc.py [--dir DIR] [--size 256M]
      [--rounds 5] [--threads 0] [--chunk 0] [--procs 1]
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

import numpy as np

import pinmem

CASES = ("none", "zlib", "isal")


def child(args):
    """One case's write in this process: prints its JSON (seconds, CPU, the CRC's maker)."""
    n = pinmem.parse_size(args.size)
    host = np.random.default_rng(args.seed).integers(0, 256, n, dtype=np.uint8)
    dev = pinmem.device_empty(n, "uint8")
    pinmem.copy(dev, host).wait()
    crc = args.child != "none"
    impl = pinmem.crc32_implementation() if crc else None
    if crc and ("ISA-L" in (impl or "")) != (args.child == "isal"):
        sys.exit("write_crc: case %s, but pinmem's CRC is %s" % (args.child, impl))
    kw = dict(io="direct", threads=args.threads, chunk=args.chunk or None)
    pinmem.write_ranges(args.path, [(0, dev)], **kw)  # the file's blocks allocated
    print("ready", flush=True)
    sys.stdin.readline()  # every process of the case starts together
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    got = pinmem.write_ranges(args.path, [(0, dev)], crc32=crc, **kw)
    dt = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    if crc and got != [zlib.crc32(host)]:
        sys.exit("write_crc: CRC %r, zlib says %08x" % (got, zlib.crc32(host)))
    print(json.dumps(dict(seconds=dt, impl=impl,
                          cpu=r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)))


def run_case(case, args, folder):
    """The case's write in --procs processes at once: (GB/s, median CPU seconds, impl)."""
    env = dict(os.environ)
    if case == "zlib":
        env["PINMEM_ISAL"] = "0"
    procs = []
    for p in range(args.procs):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--size", args.size,
               "--threads", str(args.threads), "--chunk", str(args.chunk), "--seed", str(p),
               "--path", os.path.join(folder, "f%d.bin" % p)]
        procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True))
    for pr in procs:
        if pr.stdout.readline().strip() != "ready":
            sys.exit("write_crc: a %s writer failed" % case)
    for pr in procs:
        pr.stdin.write("go\n")
        pr.stdin.flush()
    outs = []
    for pr in procs:
        out, _ = pr.communicate(timeout=600)
        if pr.returncode:
            sys.exit("write_crc: a %s writer failed" % case)
        outs.append(json.loads(out.strip().splitlines()[-1]))
    n = pinmem.parse_size(args.size)
    return (n * args.procs / max(o["seconds"] for o in outs) / 1e9,
            statistics.median(o["cpu"] for o in outs), outs[0]["impl"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="folder on the disk under test")
    ap.add_argument("--size", default="256M", help="bytes written by each process (default 256M)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="the call's threads (0: pinmem's)")
    ap.add_argument("--chunk", default="0", help="the call's unit (0: pinmem's option)")
    ap.add_argument("--procs", type=int, default=1, help="writers at once (default 1)")
    ap.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.chunk = pinmem.parse_size(args.chunk) if args.chunk not in ("0", "") else 0
    if args.child:
        return child(args)
    folder = tempfile.mkdtemp(prefix="write-crc-", dir=args.dir)
    rate = {c: [] for c in CASES}
    cpu = {c: [] for c in CASES}
    impls = {}
    try:
        for k in range(args.rounds):
            for case in CASES[k % 3:] + CASES[:k % 3]:
                g, c, impl = run_case(case, args, folder)
                rate[case].append(g)
                cpu[case].append(c)
                impls[case] = impl
    finally:
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)
    n = pinmem.parse_size(args.size)
    print("write_crc: %d x %s MiB from device memory, O_DIRECT, backend %s, %d CPUs, threads %s, "
          "unit %s, %d rounds" % (args.procs, n >> 20, pinmem.backend(),
                                  len(os.sched_getaffinity(0)), args.threads or "pinmem's",
                                  args.chunk or "pinmem's", args.rounds))
    for case in CASES:
        if case == "isal" and "ISA-L" not in (impls.get(case) or ""):
            print("  %-24s not measured: no ISA-L here (%s)" % ("crc32, ISA-L", impls.get(case)))
            continue
        what = {"none": "no CRCs", "zlib": "crc32, zlib", "isal": "crc32, ISA-L"}[case]
        print("  %-14s %.2f GB/s (%s), CPU %.3f s a write a process%s" % (
            what, statistics.median(rate[case]), " ".join("%.2f" % r for r in rate[case]),
            statistics.median(cpu[case]), "" if case == "none" else "  [%s]" % impls[case]))
    host = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    want = zlib.crc32(host)
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
    sys.exit(main())
