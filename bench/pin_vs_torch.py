#!/usr/bin/env python3
"""pinmem.pin(tensor) beside tensor.pin_memory(), side by side in one run, as JSON lines.

    python3 bench/pin_vs_torch.py [--size 1G] [--repeat 5] [--out FILE]

Both cases start from the same kind of tensor: ordinary (pageable) CPU memory, already written,
of --size bytes. pinmem.pin page-locks it in place (registration); tensor.pin_memory() allocates
pinned memory from torch's caching host allocator and copies the tensor into it. Each run is
cold: pinmem unpins after the run, and torch's host cache is emptied between runs (where torch
has torch._C._host_emptyCache; otherwise only torch's first run is cold, and the row says so).
The cases alternate, in rotated order, and each figure is the median of --repeat runs. Every
run is verified: the pinned memory must hold the tensor's bytes (checked in full) and 1 MiB of it
must survive a copy to the device and back. The target row: pinmem.pin of 1 GiB at most a third
of torch's time. Without torch (or without CUDA) the pinmem rows are still measured and the
torch rows say why they are missing.
"""
import argparse
import json
import statistics
import sys
import time

import numpy as np

import pinmem


def emit(row, out):
    line = json.dumps(row)
    print(line)
    if out:
        out.write(line + "\n")
        out.flush()


def verify_device_round_trip(buf_like, nbytes):
    """1 MiB of the pinned memory to the device and back through pinmem.copy."""
    n = min(nbytes, 1 << 20)
    dev = pinmem.device_empty(n, "uint8")
    back = np.zeros(n, dtype=np.uint8)
    src = memoryview(buf_like).cast("B")[:n]
    pinmem.copy(dev, src).wait()
    pinmem.copy(back, dev).wait()
    return bytes(back) == bytes(src)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1G", help="bytes per tensor (K/M/G suffixes)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", help="also append the JSON lines to this file")
    args = ap.parse_args()
    nbytes = pinmem.parse_size(args.size)
    out = open(args.out, "a") if args.out else None

    torch, why_not = None, None
    try:
        import torch
        if not torch.cuda.is_available():
            why_not = "torch sees no CUDA device (tensor.pin_memory needs one)"
    except ImportError:
        why_not = "torch is not installed"
    empty_cache = getattr(getattr(torch, "_C", None), "_host_emptyCache", None) if torch else None

    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 256, size=1 << 20, dtype=np.uint8)

    def fresh():
        a = np.empty(nbytes, dtype=np.uint8)
        reps = nbytes // pattern.size
        a[:reps * pattern.size].reshape(reps, -1)[:] = pattern  # written: pages exist
        a[reps * pattern.size:] = pattern[:nbytes - reps * pattern.size]
        return a

    def run_pinmem():
        a = fresh()
        t = torch.from_numpy(a) if torch is not None else a
        t0 = time.perf_counter()
        p = pinmem.pin(t)
        dt = time.perf_counter() - t0
        ok = (pinmem.pointer_info(p)["kind"] == "registered"
              and np.array_equal(np.asarray(p).reshape(-1), a)
              and verify_device_round_trip(p, nbytes))
        p.release()
        return dt, ok

    def run_torch():
        if empty_cache:
            empty_cache()
        a = fresh()
        t = torch.from_numpy(a)
        t0 = time.perf_counter()
        pt = t.pin_memory()
        dt = time.perf_counter() - t0
        ok = bool(pt.is_pinned()) and torch.equal(pt, t)
        ok = ok and verify_device_round_trip(pt.numpy(), nbytes)
        del pt
        return dt, ok

    cases = {"pinmem.pin": run_pinmem}
    if torch is not None and why_not is None:
        cases["torch.pin_memory"] = run_torch
    times = {c: [] for c in cases}
    verified = {c: True for c in cases}
    names = list(cases)
    for r in range(args.repeat):
        for k in range(len(names)):
            c = names[(r + k) % len(names)]
            dt, ok = cases[c]()
            times[c].append(dt)
            verified[c] &= ok

    med = {c: statistics.median(v) for c, v in times.items()}
    base = med.get("torch.pin_memory")
    for c in names:
        row = {"bench": "pin_vs_torch", "case": c, "bytes": nbytes, "seconds": med[c],
               "gbps": nbytes / med[c] / 1e9, "verified": verified[c],
               "backend": pinmem.backend(), "runs": len(times[c]),
               "min_seconds": min(times[c]), "max_seconds": max(times[c]),
               "ratio_vs_torch": (med[c] / base) if base else None,
               "baseline": "torch.pin_memory" if base else None}
        if c == "torch.pin_memory":
            row["torch_version"] = torch.__version__
            row["cold_every_run"] = empty_cache is not None
        if c == "pinmem.pin":
            row["target"] = "seconds <= torch.pin_memory / 3 (1 GiB)"
            row["target_applies"] = bool(base) and nbytes >= 1 << 30 and \
                pinmem.backend() == "cuda"
            row["target_met"] = (med[c] * 3 <= base) if base else None
        emit(row, out)
    if why_not:
        emit({"bench": "pin_vs_torch", "case": "torch.pin_memory", "bytes": nbytes,
              "seconds": None, "gbps": None, "verified": None, "skipped": why_not}, out)
    if not all(verified.values()):
        print("pin_vs_torch: data did not verify", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
