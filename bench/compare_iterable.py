#!/usr/bin/env python3
"""A torch IterableDataset to the GPU: pinmem.Loader against torch's DataLoader.

The dataset streams samples (uint8 C x H x W images, default 3 x 224 x 224, and an int64 label)
cut from one pre-made array, each worker taking every num_workers-th sample (the usual sharding
in __iter__), so the stream costs little and the loaders' own work shows. For each num_workers
(default 4 and 8), side by side in one run:

  * torch  - DataLoader(dataset, batch_size, num_workers=N, pin_memory=True,
             persistent_workers=True), each batch moved with .to("cuda", non_blocking=True);
  * pinmem - pinmem.Loader(dataset, batch_size, num_workers=N, persistent_workers=True):
             batches arrive on the GPU as torch tensors, their device memory reused from batch
             to batch (stats()["device_allocations"] is printed: it stays at the batches alive
             at once, never one per batch).

Each run makes a new loader, takes --warmup batches (not timed), then times --batches batches;
every batch is consumed on the device (the sum of its images added to one device counter) and the
clock stops after a synchronisation. Reported per row: medians over --repeats of batches/s,
images/s and GB/s of image bytes, and pinmem/torch at the same num_workers. Before timing, the
first --check batches of both loaders are compared byte for byte (both keep torch's round-robin
order): a mismatch fails the run (exit status 1) instead of posting a figure.

Without numpy or torch, or with --device cuda and no CUDA device, the script says so and exits
0. --device cpu runs on the host (torch without pinning, pinmem with device="cpu", or with
PINMEM_BACKEND=host its simulated device): a smoke test of the script, not a figure.

  bench/compare_iterable.py [--workers 4,8] [--batch 256] [--batches 60] [--warmup 10]
                            [--repeats 3] [--check 3] [--samples 4096] [--shape 3x224x224]
                            [--device cuda|cpu] [--json]
"""
import argparse
import json
import statistics
import sys
import time


def make_dataset(torch, np, samples, shape):
    class Images(torch.utils.data.IterableDataset):
        def __init__(self):
            rng = np.random.default_rng(1)
            self.images = rng.integers(0, 256, (samples,) + shape, dtype=np.uint8)

        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            ids = range(samples) if info is None else \
                range(info.id, samples, info.num_workers)
            for i in ids:
                yield self.images[i], i

    return Images()


def torch_loader(torch, ds, batch, workers, device):
    return torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=workers,
                                       pin_memory=device == "cuda",
                                       persistent_workers=workers > 0)


def pinmem_loader(pinmem, ds, batch, workers, device):
    # --device cpu under PINMEM_BACKEND=host: device batches in the simulated device's memory,
    # which the CPU reads: the smoke test runs pinmem's device path too.
    simulated = pinmem.backend() == "host"
    return pinmem.Loader(ds, batch_size=batch, num_workers=workers,
                         persistent_workers=workers > 0,
                         device=None if device == "cuda" or simulated else "cpu")


def batches(loader, device, is_torch):
    for x, y in loader:
        if is_torch and device == "cuda":
            x, y = x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True)
        yield x, y


def timed(torch, loader, device, is_torch, warmup, count):
    total = torch.zeros((), dtype=torch.int64, device=device)
    it = batches(loader, device, is_torch)
    for _ in range(warmup):
        x, _ = next(it)
        total += x.sum()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(count):
        x, _ = next(it)
        total += x.sum()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def check(torch, pinmem, ds, args, workers):
    t = torch_loader(torch, ds, args.batch, workers, args.device)
    with pinmem_loader(pinmem, ds, args.batch, workers, args.device) as p:
        for k, (a, b) in enumerate(zip(batches(t, args.device, True),
                                       batches(p, args.device, False))):
            if k >= args.check:
                break
            for u, v in zip(a, b):
                if not torch.equal(u.cpu(), v.cpu()):
                    return False
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="4,8")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check", type=int, default=3)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--shape", default="3x224x224")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--json", action="store_true", help="one JSON object per row on stdout")
    args = ap.parse_args()
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    try:
        import numpy as np
        import torch
        import pinmem
    except ImportError as e:
        say(f"compare_iterable: skipped: {e}")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        say("compare_iterable: skipped: torch sees no CUDA device (--device cpu for a smoke test)")
        return 0
    shape = tuple(int(d) for d in args.shape.split("x"))
    ds = make_dataset(torch, np, args.samples, shape)
    image_bytes = args.batch * int(np.prod(shape))
    need = args.warmup + args.batches
    if need * args.batch > args.samples:
        say(f"compare_iterable: --samples {args.samples} is fewer than (warmup + batches) x batch;"
            f" raise it")
        return 2
    status = 0
    for workers in [int(w) for w in args.workers.split(",")]:
        verified = check(torch, pinmem, ds, args, workers)
        if not verified:
            say(f"compare_iterable: workers={workers}: pinmem's batches differ from torch's")
            status = 1
            continue
        secs = {"torch": [], "pinmem": []}
        allocations = None
        for r in range(args.repeats):
            order = ("torch", "pinmem") if r % 2 == 0 else ("pinmem", "torch")
            for name in order:
                if name == "torch":
                    dl = torch_loader(torch, ds, args.batch, workers, args.device)
                    secs[name].append(timed(torch, dl, args.device, True, args.warmup,
                                            args.batches))
                    del dl
                else:
                    with pinmem_loader(pinmem, ds, args.batch, workers, args.device) as p:
                        secs[name].append(timed(torch, p, args.device, False, args.warmup,
                                                args.batches))
                        allocations = p.stats()["device_allocations"]
        rate = {k: args.batches / statistics.median(v) for k, v in secs.items()}
        for name in ("torch", "pinmem"):
            s = statistics.median(secs[name])
            row = {"bench": "compare_iterable", "case": f"{name}-w{workers}",
                   "bytes": image_bytes * args.batches, "seconds": s,
                   "gbps": image_bytes * args.batches / s / 1e9, "verified": verified,
                   "batches_per_s": rate[name], "images_per_s": rate[name] * args.batch,
                   "device": args.device}
            if name == "pinmem":
                row["ratio_vs_torch"] = rate["pinmem"] / rate["torch"]
                row["device_allocations"] = allocations
            if args.json:
                print(json.dumps(row), flush=True)
            say(f"workers={workers} {name:6s} {rate[name]:8.1f} batches/s "
                f"{rate[name] * args.batch:10.0f} images/s {row['gbps']:6.2f} GB/s" +
                (f"  x{row['ratio_vs_torch']:.2f} torch, device_allocations={allocations}"
                 if name == "pinmem" else ""))
    return status


if __name__ == "__main__":
    sys.exit(main())
