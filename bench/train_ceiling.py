#!/usr/bin/env python3
"""How close does a data loader get a training loop to its ceiling?

The ceiling is the same training loop fed from data that is already on the GPU: whatever a
loader adds on top (host work in next(), waits for data, conversions, copies that do not overlap)
shows up as a fraction below 1.0. The loop: a small conv net on 3x224x224 uint8 images with int64
labels, batch 256 by default, bf16 autocast, SGD; the images are normalised on the GPU, as a real
pipeline would. Three feeds, same data, same model, same number of steps, interleaved rounds:

  * gpu     - the whole dataset in device memory; each step gathers a shuffled batch there
  * torch   - torch.utils.data.DataLoader(TensorDataset(X, Y), shuffle=True, pin_memory=True,
              num_workers=W, persistent_workers=True) + .to("cuda", non_blocking=True)
  * pinmem  - pinmem.Loader((X, Y), batch_size, shuffle=True).as_torch()
  * pinmem_w4, pinmem_host (with --variants): the same loader with 4 worker threads; and with
              device='cpu' (pinned host batches) moved by .to("cuda", non_blocking=True), to
              place a gap between the loader's reads, its copy and the hand-over to torch

Each round times `--steps` steps after `--warmup` steps, between two device synchronisations;
the figure per feed is the median over `--rounds` rounds, reported as images/s and as a
fraction of the gpu feed. For pinmem the loader's own stats() are printed beside it (time in
next(), waits for a batch), so any remaining gap can be placed. Needs torch with CUDA and
numpy; without them it says so and exits 0.

  bench/train_ceiling.py [--samples 4096] [--batch 256] [--steps 60] [--warmup 10]
                         [--rounds 3] [--workers 8] [--settle 1] [--variants] [--json]

TARGET: pinmem >= 0.98 of the gpu feed.
"""
import argparse
import json
import statistics
import sys
import time

TARGET = 0.98


def build_model(torch):
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))


class Trainer:
    """One model and optimiser shared by every feed, so each feed runs the same kernels."""

    def __init__(self, torch):
        self.torch = torch
        self.model = build_model(torch).cuda().to(memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.mean = torch.tensor([0.485, 0.456, 0.406], device="cuda").view(1, 3, 1, 1) * 255
        self.std = torch.tensor([0.229, 0.224, 0.225], device="cuda").view(1, 3, 1, 1) * 255
        self.loss_fn = torch.nn.CrossEntropyLoss()

    def step(self, x, y):
        torch = self.torch
        x = ((x.float() - self.mean) / self.std).contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = self.loss_fn(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


def timed(torch, trainer, batches, warmup, steps, settle):
    """Seconds for `steps` steps after `warmup` steps, taken from the iterator `batches`.

    Each round first waits `settle` seconds: torch's DataLoader goes on working after its own
    round ends (its pin-memory thread pins the batches its workers prefetched, 38 MB each), and
    that work would otherwise land in the next feed's round (seen on the H200: single rounds
    60-100% slower, only in the feed timed right after torch's)."""
    time.sleep(settle)
    it = iter(batches)
    for _ in range(warmup):
        trainer.step(*next(it))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.step(*next(it))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def gpu_feed(torch, Xg, Yg, batch):
    n = Xg.shape[0]
    while True:
        perm = torch.randperm(n, device="cuda")
        for i in range(0, n - batch + 1, batch):
            idx = perm[i:i + batch]
            yield Xg[idx], Yg[idx]


def torch_feed(torch, loader):
    while True:
        for x, y in loader:
            yield x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True)


def pinmem_feed(loader):
    while True:
        for x, y in loader.as_torch():
            yield x, y


def pinmem_host_feed(torch, loader):
    while True:
        for x, y in loader.as_torch():
            yield x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=8, help="torch DataLoader workers")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds of quiet before each timed round (default 1)")
    ap.add_argument("--variants", action="store_true",
                    help="also pinmem with 4 workers, and with host batches + .to()")
    ap.add_argument("--json", action="store_true", help="JSON lines on stdout")
    args = ap.parse_args()
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print

    try:
        import numpy as np
        import torch
    except ImportError as e:
        say(f"train_ceiling: needs numpy and torch ({e}); nothing measured")
        return 0
    if not torch.cuda.is_available():
        say("train_ceiling: no CUDA device visible to torch; nothing measured")
        return 0
    import pinmem
    from torch.utils.data import DataLoader, TensorDataset

    rng = np.random.default_rng(1)
    X = rng.integers(0, 256, size=(args.samples, 3, 224, 224), dtype=np.uint8)
    Y = rng.integers(0, 10, size=(args.samples,), dtype=np.int64)
    Xg, Yg = torch.from_numpy(X).cuda(), torch.from_numpy(Y).cuda()
    trainer = Trainer(torch)

    tl = DataLoader(TensorDataset(torch.from_numpy(X), torch.from_numpy(Y)), batch_size=args.batch,
                    shuffle=True, drop_last=True, num_workers=args.workers, pin_memory=True,
                    persistent_workers=args.workers > 0)
    pl = pinmem.Loader((X, Y), batch_size=args.batch, shuffle=True, drop_last=True, seed=1)
    # The bytes pinmem delivers are checked once, before timing: one batch against the rows
    # its indices name (the same check for torch's feed is its own business: it is the baseline).
    b = next(iter(pl.batches()))
    idx = torch.from_numpy(np.frombuffer(b.indices, dtype=np.uint64).astype(np.int64))
    xb, yb = (torch.from_dlpack(a) for a in b)
    ok = (torch.equal(xb.cpu(), torch.from_numpy(X)[idx]) and
          torch.equal(yb.cpu(), torch.from_numpy(Y)[idx]))
    del b, xb, yb
    if not ok:
        say("train_ceiling: pinmem.Loader delivered bytes that differ from the dataset's rows")
        return 1
    feeds = {"gpu": gpu_feed(torch, Xg, Yg, args.batch), "torch": torch_feed(torch, tl)}
    extra = []
    if args.variants:
        p4 = pinmem.Loader((X, Y), batch_size=args.batch, shuffle=True, drop_last=True, seed=1,
                           num_workers=4)
        ph = pinmem.Loader((X, Y), batch_size=args.batch, shuffle=True, drop_last=True, seed=1,
                           device="cpu")
        extra = [p4, ph]
        feeds["pinmem_w4"] = pinmem_feed(p4)
        feeds["pinmem_host"] = pinmem_host_feed(torch, ph)
    feeds["pinmem"] = pinmem_feed(pl)  # last: the TARGET row
    say(f"train_ceiling: {args.samples} images 3x224x224 uint8, batch {args.batch}, "
        f"{args.steps} steps x {args.rounds} rounds, torch workers {args.workers}, "
        f"{torch.cuda.get_device_name()}")

    secs = {k: [] for k in feeds}
    stats_before = pl.stats()
    for r in range(args.rounds):
        for name, feed in feeds.items():
            secs[name].append(timed(torch, trainer, feed, args.warmup, args.steps, args.settle))
    stats_after = pl.stats()

    imgs = args.steps * args.batch
    med = {k: statistics.median(v) for k, v in secs.items()}
    rows = []
    for name in feeds:
        rows.append({"bench": "train_ceiling", "case": name, "batch": args.batch,
                     "steps": args.steps, "rounds": args.rounds, "seconds": med[name],
                     "images_per_s": imgs / med[name], "fraction_of_gpu": med["gpu"] / med[name],
                     "round_seconds": secs[name], "verified": name == "pinmem",
                     "workers": args.workers if name == "torch" else None,
                     "verify_method": "first_batch" if name == "pinmem" else "none"})
    delta = {k: stats_after[k] - stats_before[k] for k in stats_after
             if isinstance(stats_after.get(k), (int, float)) and k in stats_before}
    rows[-1]["loader_stats_delta"] = delta
    for row in rows:
        say("  %-11s %9.0f images/s  %.3f of the gpu feed  (rounds: %s s)" % (
            row["case"], row["images_per_s"], row["fraction_of_gpu"],
            ", ".join("%.3f" % t for t in row["round_seconds"])))
        if args.json:
            print(json.dumps(row), flush=True)
    say("  pinmem loader stats over the timed rounds (warm-up steps included): " +
        ", ".join(f"{k}={v:.4g}" for k, v in sorted(delta.items())))
    frac = rows[-1]["fraction_of_gpu"]
    line = {"bench": "train_ceiling", "case": "TARGET", "target": "pinmem >= 0.98 of the gpu feed",
            "value": frac, "met": frac >= TARGET, "verified": False}
    say("TARGET pinmem >= %.2f of the gpu feed: %.3f (%s)" % (TARGET, frac,
                                                           "met" if line["met"] else "NOT met"))
    if args.json:
        print(json.dumps(line), flush=True)
    pl.close()
    for ld in extra:
        ld.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
