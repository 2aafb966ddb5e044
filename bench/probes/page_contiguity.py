#!/usr/bin/env python3
"""DESIGN: a stand-alone probe of how much the memory an O_DIRECT request comes from (or lands
in) moves a disk's rate. An O_DIRECT request is cut into one scatter-gather segment per
physically contiguous run of its pages, and a virtual disk (virtio: 254 segments a request here)
pays per segment and per request: 4 KiB pages scattered by a fragmented free list cut a 16 MiB
request into some 4,096 segments, 2 MiB huge pages into 8.

For each kind of 16 MiB buffer it prints the physically contiguous runs of its pages (read from
/proc/self/pagemap; the frame numbers need root, else "n/a") and the disk's rate writing
--size bytes into a new file in 16 MiB O_DIRECT requests, one at a time, fsync'd, and reading
them back the same way, the kinds taking turns round by round (median of --rounds):

  * shared: anonymous shared memory, as Python's mmap.mmap(-1, n) gives (compare_checkpoint's
    Disk writes from such a buffer);
  * private: anonymous private memory in 4 KiB pages (malloc's, and torch's CPU tensors');
  * huge: anonymous private memory with MADV_HUGEPAGE (transparent huge pages where the kernel
    offers them, as pinmem's pool asks for its blocks of fast_pin_min or more).

  sudo python3 bench/probes/page_contiguity.py --dir /var/tmp [--size 512M] [--rounds 4]
"""
import argparse
import ctypes
import mmap
import os
import statistics
import struct
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from compare_checkpoint import parse_size  # noqa: E402  (bench/)

BLOCK = 16 << 20
HUGE = 2 << 20
KINDS = ("shared", "private", "huge")


def buffer(kind):
    """(memoryview of BLOCK bytes of that kind, filled, its address, the mapping kept alive)"""
    if kind == "shared":
        m = mmap.mmap(-1, BLOCK)
        view = memoryview(m)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    else:
        m = mmap.mmap(-1, BLOCK + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        at = -base % HUGE  # huge pages need 2 MiB-aligned virtual addresses
        view = memoryview(m)[at:at + BLOCK]
        addr = base + at
        if kind == "huge" and hasattr(mmap, "MADV_HUGEPAGE"):
            m.madvise(mmap.MADV_HUGEPAGE, at, BLOCK)
    pattern = os.urandom(1 << 16)
    for i in range(0, BLOCK, 1 << 16):  # first touch: the pages are allocated here
        view[i:i + (1 << 16)] = pattern
    return view, addr, m


def runs(addr, n):
    """Physically contiguous runs of pages over [addr, addr + n), or None where this process
    cannot read frame numbers (they read as 0 without CAP_SYS_ADMIN)."""
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(addr // page * 8)
            raw = f.read(n // page * 8)
    except OSError:
        return None
    frames = [v & ((1 << 55) - 1) for v in struct.unpack(f"{len(raw) // 8}Q", raw)]
    if not any(frames):
        return None
    return 1 + sum(1 for a, b in zip(frames, frames[1:]) if b != a + 1)


def write(path, view, total):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.sync()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        t0 = time.perf_counter()
        for off in range(0, total, BLOCK):
            os.pwritev(fd, [view], off)
        os.fsync(fd)
        return total / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def read(path, view, total):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t0 = time.perf_counter()
        for off in range(0, total, BLOCK):
            os.preadv(fd, [view], off)
        return total / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="a folder on the disk under test")
    p.add_argument("--size", default="512M", help="bytes each write and read moves")
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args()
    total = parse_size(a.size) // BLOCK * BLOCK
    if total < BLOCK or a.rounds < 1:
        p.error(f"--size must be at least {BLOCK >> 20} MiB and --rounds at least 1")
    bufs = {k: buffer(k) for k in KINDS}
    fd, path = tempfile.mkstemp(prefix="pinmem-contiguity.", dir=a.dir)
    os.close(fd)
    rates = {k: ([], []) for k in KINDS}
    try:
        for _ in range(a.rounds):
            for k in KINDS:
                w = write(path, bufs[k][0], total)
                r = read(path, bufs[k][0], total)
                rates[k][0].append(w)
                rates[k][1].append(r)
    except OSError as e:
        raise SystemExit(f"page_contiguity: O_DIRECT I/O in {a.dir or 'the temporary folder'} "
                         f"failed: {e}")
    finally:
        os.unlink(path)
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    mode = open(thp).read().strip() if os.path.exists(thp) else "n/a"
    print(f"page_contiguity: {total >> 20} MiB in 16 MiB O_DIRECT requests, one at a time, "
          f"{a.rounds} rounds, median GB/s; transparent huge pages: {mode}; "
          f"{os.cpu_count()} CPUs")
    for k in KINDS:
        n = runs(bufs[k][1], BLOCK)
        print("  %-8s contiguous runs in 16 MiB: %-5s write %.2f (%s)  read %.2f (%s)" % (
            k, "n/a" if n is None else n, statistics.median(rates[k][0]),
            ", ".join("%.2f" % x for x in rates[k][0]), statistics.median(rates[k][1]),
            ", ".join("%.2f" % x for x in rates[k][1])))


if __name__ == "__main__":
    main()
