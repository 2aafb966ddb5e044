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
import shutil
import statistics
import struct
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from compare_checkpoint import BLOCK, Disk, huge_buffer, parse_size  # noqa: E402  (bench/)

KINDS = ("shared", "private", "huge")


def buffer(kind):
    """(memoryview of BLOCK bytes of that kind, filled, its address, the mapping kept alive)"""
    if kind == "huge":
        view, m = huge_buffer(BLOCK)
    else:
        flags = mmap.MAP_SHARED if kind == "shared" else mmap.MAP_PRIVATE
        m = mmap.mmap(-1, BLOCK, flags=flags | mmap.MAP_ANONYMOUS)
        view = memoryview(m)
    view[:] = os.urandom(1 << 16) * (BLOCK >> 16)  # first touch: the pages are allocated here
    return view, ctypes.addressof(ctypes.c_char.from_buffer(view)), m


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
    folder = tempfile.mkdtemp(prefix="pinmem-contiguity.", dir=a.dir)
    disks = {k: Disk(os.path.join(folder, k), total, buf=bufs[k][0]) for k in KINDS}
    rates = {k: ([], []) for k in KINDS}
    try:
        for _ in range(a.rounds):
            for k, d in disks.items():
                d.write()
                d.read()
                if not d.ok:
                    raise SystemExit(f"page_contiguity: O_DIRECT I/O in {folder} failed")
                rates[k][0].append(total / d.writes[-1] / 1e9)
                rates[k][1].append(total / d.reads[-1] / 1e9)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
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
