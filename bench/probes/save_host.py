#!/usr/bin/env python3
"""DESIGN: a stand-alone probe of pinmem.safetensors.save_file from host memory (CPU tensors),
kept so the figure in _write_host's comment can be measured again. SIZE bytes of bf16 CPU
tensors (4096x1024 each) are saved to --dir, round by round, the order of the cases turned every
round, the target removed and the file system synced before each:

  * disk       the disk's own O_DIRECT write of as many bytes (compare_checkpoint's Disk: 16 MiB
               blocks from one reused buffer, fsync), the reference;
  * direct     save_file as it is: every tensor in host memory, so the bytes go straight from
               the tensors through pinmem's pinned slots (one write_ranges call);
  * snapshot   the save through a pinned snapshot of the whole file instead (the tensors copied
               into it, then written from it: the path device tensors with stage "host" take);
  * cold       the snapshot path right after pinmem.trim(): its pinned memory allocated anew,
               as a process's first save, or one of a new size, finds it.

Each case's GB/s per round, the medians, and each median over the disk's.

  PYTHONPATH=build-py/python python3 bench/probes/save_host.py --dir DIR [--size 1G]
      [--rounds 6]
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

import pinmem
import pinmem.safetensors as ps

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from compare_checkpoint import Disk, median_lines, parse_size  # noqa: E402  (bench/)

CASES = ("disk", "direct", "snapshot", "cold")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="folder on the disk under test")
    ap.add_argument("--size", default="1G")
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    per = 4096 * 1024 * 2
    sd = {f"t{i}": torch.randn(4096, 1024).to(torch.bfloat16)
          for i in range(max(1, parse_size(a.size) // per))}
    n = sum(t.numel() * t.element_size() for t in sd.values())
    tmp = tempfile.mkdtemp(prefix="pinmem-save-host.", dir=a.dir)
    target = os.path.join(tmp, "x.safetensors")
    disk = Disk(os.path.join(tmp, "disk"), n)

    def save(case):
        if case == "direct":
            ps.save_file(sd, target)
            return
        if case == "cold":
            pinmem.trim()
        path, t = ps._target(target)
        ps._write_saved(path, t, *ps._planned(sd, None, "auto", "host", t, from_host=False))

    try:
        save("direct")
        save("snapshot")
        rates = {c: [] for c in CASES}
        for r in range(a.rounds):
            for case in CASES[r % len(CASES):] + CASES[:r % len(CASES)]:
                try:
                    os.unlink(target)
                except FileNotFoundError:
                    pass
                os.sync()
                if case == "disk":
                    disk.write()
                    rates[case].append(n / disk.writes[-1] / 1e9)
                    continue
                t0 = time.perf_counter()
                save(case)
                rates[case].append(n / (time.perf_counter() - t0) / 1e9)
        print(f"save_host: {n / 1e9:.2f} GB of CPU tensors ({len(sd)}), {a.rounds} rounds, "
              f"{os.cpu_count()} CPUs, torch {torch.__version__}")
        print("\n".join(median_lines(rates)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
