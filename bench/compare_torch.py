#!/usr/bin/env python3
"""pinmem's data loader against torch.utils.data.DataLoader, side by side, on one GPU.

The same .npy dataset (default: a synthetic file of 3x224x224 uint8 images, 150 KB each, written
to a temporary folder and removed afterwards) and the same batch size go through

  * torch DataLoader(shuffle=True, num_workers=0/4/8, pin_memory=False/True), each batch moved
    with .to("cuda", non_blocking=True): the usual recipe; samples come out of np.load(mmap_mode="r")
    as new arrays, as a decoder would produce them;
  * `pinmem bench loader --data FILE` (run as a subprocess, its --json lines read back): worker
    threads read straight into pinned batch slots, a copy stream moves them to the device.

Both are timed the same way: the clock starts once the first batch is on the device (worker
start-up excluded, that batch not counted) and stops after a final synchronisation; GB/s is the
bytes delivered to the device over that time. The report shows each configuration, the ratio of
pinmem to the best torch configuration, and pinmem's target (pinmem >= 10x the best torch
configuration). Without torch, numpy or a CUDA device it says so and exits with status 0.

  bench/compare_torch.py [--data FILE.npy] [--batch 256] [--epochs 2] [--workers 0,4,8]
                         [--samples 8192] [--pinmem PATH] [--max-batches N] [--json]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

TARGET_RATIO = 10.0


def find_pinmem(explicit):
    if explicit:
        return explicit
    env = os.environ.get("PINMEM_BIN")
    if env:
        return env
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for d in ("build-gpu", "build", "build-release"):
        p = os.path.join(root, d, "pinmem")
        if os.access(p, os.X_OK):
            return p
    return shutil.which("pinmem")


def make_synthetic(np, path, samples, seed=1):
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(samples, 3, 224, 224))
    rng = np.random.default_rng(seed)
    step = 256
    for i in range(0, samples, step):
        m = min(step, samples - i)
        arr[i:i + m] = rng.integers(0, 256, size=(m, 3, 224, 224), dtype=np.uint8)
    arr.flush()
    del arr


def warm(path):
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def run_torch(np, torch, path, batch, epochs, workers, pin, max_batches, seed):
    from torch.utils.data import DataLoader, Dataset

    class NpyDataset(Dataset):
        def __init__(self, p):
            self.path = p
            self.arr = None
            self.n = np.load(p, mmap_mode="r").shape[0]

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            if self.arr is None:  # opened in each worker process
                self.arr = np.load(self.path, mmap_mode="r")
            return torch.from_numpy(np.array(self.arr[i]))

    g = torch.Generator()
    g.manual_seed(seed)
    dl = DataLoader(NpyDataset(path), batch_size=batch, shuffle=True, num_workers=workers,
                    pin_memory=pin, drop_last=False, generator=g,
                    persistent_workers=workers > 0)
    dev = torch.device("cuda")
    nbytes = 0
    batches = 0
    t0 = None
    first = True
    stop = False
    for _ in range(epochs):
        for x in dl:
            y = x.to(dev, non_blocking=True)
            if first:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                first = False
                continue
            nbytes += y.numel() * y.element_size()
            batches += 1
            if max_batches and batches >= max_batches:
                stop = True
                break
        if stop:
            break
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0 if t0 is not None else float("nan")
    del dl
    return {"bytes": nbytes, "seconds": secs, "batches": batches,
            "gbps": nbytes / secs / 1e9 if secs > 0 else float("nan"),
            "batches_per_s": batches / secs if secs > 0 else float("nan")}


def run_pinmem_python(np, torch, path, batch, epochs, seed):
    """pinmem.Loader driven from Python, as a training loop would use it: each batch becomes a
    torch tensor on the device (torch.from_dlpack; the current stream waits for the batch's copy,
    the host does not). Timed like the torch rows (every epoch, the first batch untimed). The
    first timed batch is kept (a device-side clone, so no slot stays held) and checked against
    the file after the clock stopped."""
    import pinmem
    arr = np.load(path, mmap_mode="r")
    loader = pinmem.Loader(path, batch_size=batch, shuffle=True, seed=seed, epochs=epochs)
    nbytes = batches = 0
    t0 = None
    kept = []
    for _ in range(epochs):
        for b in loader.batches():
            x = torch.from_dlpack(b[0])
            if t0 is None:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                continue
            nbytes += x.numel() * x.element_size()
            batches += 1
            if batches == 1:
                kept.append((x.clone(), bytes(b.indices)))
            del x, b
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0 if t0 is not None else float("nan")
    ok = True
    for x, ind in kept:
        idx = np.frombuffer(ind, dtype=np.uint64).astype(np.int64)
        ok &= bool(np.array_equal(x.cpu().numpy(), np.asarray(arr[idx])))
    loader.close()
    return {"bytes": nbytes, "seconds": secs, "batches": batches,
            "gbps": nbytes / secs / 1e9 if secs > 0 else float("nan"),
            "batches_per_s": batches / secs if secs > 0 else float("nan"),
            "verified": ok and len(kept) == 1, "workers": None, "pin_memory": True}


def run_pinmem(binary, path, batch, epochs):
    cmd = [binary, "bench", "loader", "--data", path, "--batch", str(batch), "--epochs",
           str(epochs), "--json"]
    env = dict(os.environ)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    rows = {}
    for line in p.stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("bench") == "loader":
            rows[r.get("case")] = r
    if p.returncode != 0 or not rows:
        sys.stderr.write(p.stderr[-4000:])
        raise SystemExit("compare_torch: `%s` failed (exit %d)" % (" ".join(cmd), p.returncode))
    return rows, cmd


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", help=".npy file (default: synthetic 3x224x224 uint8 images)")
    ap.add_argument("--samples", type=int, default=8192, help="synthetic images (default 8192)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", default="0,4,8", help="torch num_workers values (default 0,4,8)")
    ap.add_argument("--pinmem", help="the pinmem binary (default: build-gpu/ or build/ here, "
                                     "$PINMEM_BIN, or PATH)")
    ap.add_argument("--max-batches", type=int, default=0,
                    help="stop each torch configuration after this many timed batches (0: all)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    args = ap.parse_args()

    try:
        import numpy as np
    except ImportError:
        print("compare_torch: skipped: numpy is not installed (pip install numpy torch)")
        return 0
    try:
        import torch
    except ImportError:
        print("compare_torch: skipped: torch is not installed (pip install torch)")
        return 0
    if not torch.cuda.is_available():
        print("compare_torch: skipped: torch sees no CUDA device (torch %s, CUDA build %s)" %
              (torch.__version__, torch.version.cuda))
        return 0
    binary = find_pinmem(args.pinmem)
    if not binary or not os.access(binary, os.X_OK):
        print("compare_torch: no pinmem binary found: build it (make build) or pass --pinmem PATH",
              file=sys.stderr)
        return 1
    workers = [int(w) for w in args.workers.split(",") if w.strip()]

    tmp = None
    path = args.data
    try:
        if not path:
            tmp = tempfile.mkdtemp(prefix="pinmem-compare.")
            path = os.path.join(tmp, "images.npy")
            if not args.json:
                print("writing %d synthetic 3x224x224 uint8 images (%.2f GB) to %s" %
                      (args.samples, args.samples * 150528 / 1e9, path), flush=True)
            make_synthetic(np, path, args.samples, args.seed)
        warm(path)
        shape = np.load(path, mmap_mode="r").shape
        sample_bytes = int(np.prod(shape[1:])) * np.load(path, mmap_mode="r").dtype.itemsize
        dev = torch.cuda.get_device_name(0)
        if not args.json:
            print("device %s, torch %s; dataset %s: %d samples of %d bytes; batch %d, %d epochs, "
                  "shuffled" % (dev, torch.__version__, path, shape[0], sample_bytes, args.batch,
                                args.epochs), flush=True)

        results = []
        for w in workers:
            for pin in (False, True):
                name = "torch_workers%d_%s" % (w, "pinned" if pin else "pageable")
                if not args.json:
                    print("  running %s ..." % name, flush=True)
                r = run_torch(np, torch, path, args.batch, args.epochs, w, pin, args.max_batches,
                              args.seed)
                r.update(case=name, impl="torch", workers=w, pin_memory=pin)
                results.append(r)
        torch.cuda.empty_cache()

        if not args.json:
            print("  running pinmem bench loader ...", flush=True)
        rows, cmd = run_pinmem(binary, path, args.batch, args.epochs)
        for case in ("images_pinned", "images_pageable"):
            if case in rows:
                r = rows[case]
                results.append({"case": "pinmem_" + case.split("_", 1)[1], "impl": "pinmem",
                                "workers": r.get("workers"), "pin_memory": r.get("pin_memory"),
                                "bytes": r["bytes"], "seconds": r["seconds"], "gbps": r["gbps"],
                                "batches": r.get("batches"),
                                "batches_per_s": r.get("batches_per_s"),
                                "verified": r.get("verified"),
                                "stall_pct": r.get("stall_pct")})

        try:
            import pinmem  # noqa: F401
            have_py = True
        except ImportError as e:
            have_py = False
            sys.stderr.write("compare_torch: no pinmem Python package (%s): the pinmem_python "
                             "row is left out\n" % e)
        if have_py:
            if not args.json:
                print("  running pinmem.Loader from Python ...", flush=True)
            r = run_pinmem_python(np, torch, path, args.batch, args.epochs, args.seed)
            r.update(case="pinmem_python", impl="pinmem")
            results.append(r)

        torch_rows = [r for r in results if r["impl"] == "torch" and r["gbps"] == r["gbps"]]
        best = max(torch_rows, key=lambda r: r["gbps"]) if torch_rows else None
        for r in results:
            r["ratio_vs_best_torch"] = (r["gbps"] / best["gbps"]) if best and best["gbps"] > 0 \
                else None

        pm = next((r for r in results if r["case"] == "pinmem_pinned"), None)
        met = bool(pm and best and pm["ratio_vs_best_torch"] is not None and
                   pm["ratio_vs_best_torch"] >= TARGET_RATIO and pm.get("verified"))
        py = next((r for r in results if r["case"] == "pinmem_python"), None)
        met_py = bool(py and best and py["ratio_vs_best_torch"] is not None and
                      py["ratio_vs_best_torch"] >= TARGET_RATIO and py.get("verified"))
        if args.json:
            for r in results:
                out = {"bench": "loader_vs_torch", "case": r["case"], "bytes": r["bytes"],
                       "seconds": r["seconds"], "gbps": r["gbps"],
                       "verified": r.get("verified"), "backend": "cuda", "device": dev,
                       "impl": r["impl"], "workers": r["workers"], "pin_memory": r["pin_memory"],
                       "batch": args.batch, "sample_bytes": sample_bytes,
                       "batches": r.get("batches"), "batches_per_s": r.get("batches_per_s"),
                       "ratio_vs_best_torch": r["ratio_vs_best_torch"],
                       "baseline": best["case"] if best else None}
                print(json.dumps(out))
            print(json.dumps({"bench": "loader_vs_torch", "case": "target", "target":
                              "pinmem >= 10x the best torch DataLoader", "target_met": met,
                              "pinmem_command": " ".join(cmd)}))
            print(json.dumps({"bench": "loader_vs_torch", "case": "target_python", "target":
                              "pinmem.Loader from Python >= 10x the best torch DataLoader",
                              "target_met": met_py, "measured": py is not None}))
        else:
            print()
            print("  %-28s %9s %11s %15s" % ("configuration", "GB/s", "batches/s",
                                             "vs best torch"))
            for r in results:
                ratio = r["ratio_vs_best_torch"]
                print("  %-28s %9.2f %11.1f %15s" % (r["case"], r["gbps"], r["batches_per_s"] or 0,
                                                      ("%.2fx" % ratio) if ratio else "-"))
            print()
            if pm and best:
                print("TARGET pinmem >= 10x the best torch DataLoader configuration: %.1fx "
                      "(pinmem %.2f GB/s, best torch %s %.2f GB/s)  %s" %
                      (pm["ratio_vs_best_torch"], pm["gbps"], best["case"], best["gbps"],
                       "PASS" if met else "MISS"))
            else:
                print("TARGET pinmem >= 10x the best torch DataLoader configuration: not measured")
            if py and best:
                print("TARGET pinmem.Loader from Python >= 10x the best torch DataLoader: %.1fx "
                      "(%.2f GB/s, verified %s)  %s" % (py["ratio_vs_best_torch"], py["gbps"],
                                                         py["verified"], "PASS" if met_py else "MISS"))
            else:
                print("TARGET pinmem.Loader from Python >= 10x the best torch DataLoader: not "
                      "measured")
        return 0
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
