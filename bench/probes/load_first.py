#!/usr/bin/env python3
"""DESIGN: a stand-alone probe of pinmem.safetensors.load_file(device="cpu") as a process's
first load meets it. load_file reads into pinned memory, so that a later .to("cuda") runs at
the link's rate; the first call of a process has no pinned memory to reuse and allocates it
(cudaHostAlloc on a GPU machine, locked huge pages on the host backend). Each case runs in a
process of its own, the file's pages dropped right before the timed load, the order of the cases
turned every round:

  * disk     the disk's own O_DIRECT read of as many bytes (compare_checkpoint's Disk), the
             reference;
  * first    load_file(device="cpu") as the process's first pinmem call: its pinned memory
             allocated in pieces while the earlier pieces are read (pinmem.safetensors._read);
  * whole    as first, into one buffer allocated before the read (PIECES_MIN past the file);
  * later    load_file after one load of the file in that process (its pinned memory reused);
  * paged    as later, with the buffer on a page boundary instead of placed at the data's file
             offset modulo 4 KiB (pinmem.safetensors._placed): O_DIRECT then reads through
             pinmem's pinned slots and copies, where placed memory takes the bytes in place;
  * package  the safetensors package's load_file (where it is installed).

Each case's GB/s per round, the medians, and each median over the disk's.

  PYTHONPATH=build-py/python python3 bench/probes/load_first.py --dir DIR [--size 1G]
      [--rounds 4] [--cases first,whole,...]
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from compare_checkpoint import Disk, drop_cache, median_lines, parse_size  # noqa: E402  (bench/)

CASES = ("disk", "first", "whole", "later", "paged", "package")


def one(case, path):
    """Seconds of one cold load of path by `case`, in this process (torch imported first, and
    its CUDA initialized where there is a GPU: neither is part of a load)."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.init()  # a PyTorch program's CUDA is up before it loads its weights
    if case == "package":
        from safetensors.torch import load_file
    else:
        import pinmem.safetensors as ps
        load_file = ps.load_file
        if case == "whole":
            ps.PIECES_MIN = 1 << 62
        if case == "paged":
            ps._placed = lambda whole, n, at, align: whole[-whole.ctypes.data % 4096:][:n]
    if case in ("later", "paged"):
        load_file(path)
    drop_cache(path)
    t0 = time.perf_counter()
    tensors = load_file(path)
    dt = time.perf_counter() - t0
    del tensors
    return dt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="folder on the disk under test")
    ap.add_argument("--size", default="1G")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cases", default=",".join(CASES), help="which, comma-separated (disk is "
                    "always run: the reference)")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--file", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case:
        print(one(a.case, a.file))
        return 0
    import torch
    import pinmem.safetensors as ps
    cases = ["disk"] + [c for c in a.cases.split(",") if c in CASES and c != "disk"]
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        cases = [c for c in cases if c != "package"]
    with tempfile.TemporaryDirectory(prefix="pinmem-load-first.", dir=a.dir) as tmp:
        path = os.path.join(tmp, "x.safetensors")
        per = 4096 * 1024 * 2
        ps.save_file({f"t{i}": torch.randn(4096, 1024).to(torch.bfloat16)
                      for i in range(max(1, parse_size(a.size) // per))}, path)
        n = os.path.getsize(path)
        disk = Disk(os.path.join(tmp, "disk"), n)
        disk.write()
        rates = {c: [] for c in cases}
        how = None
        for r in range(a.rounds):
            for case in cases[r % len(cases):] + cases[:r % len(cases)]:
                if case == "disk":
                    disk.read()
                    rates[case].append(n / disk.reads[-1] / 1e9)
                    continue
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", case,
                                      "--file", path], check=True, capture_output=True,
                                     text=True).stdout
                rates[case].append(n / float(out.split()[-1]) / 1e9)
            how = how or drop_cache(path)
    print(f"load_first: {n / 1e9:.2f} GB file, device cpu, {a.rounds} rounds, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, pages dropped by {how}")
    print("\n".join(median_lines(rates)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
