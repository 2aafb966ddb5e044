#!/usr/bin/env python3
"""Python datasets with worker processes: pinmem.Loader against torch's DataLoader.

Most training data is a map-style Python dataset: dataset[i] decodes, crops and flips one sample
in Python. This bench feeds two such datasets, the same dataset object for both loaders, to the
GPU and times them side by side:

  * jpeg - an ImageFolder of JPEGs the script writes into a temporary folder (default 3,000
           images of 500x375 in 4 classes, smooth colour fields with noise, quality 90, written
           with PIL), read by torchvision.datasets.ImageFolder with RandomResizedCrop(224),
           RandomHorizontalFlip and PILToTensor, batch 128. Without torchvision, a class of this
           script does the same work with PIL (open and decode the JPEG, random resized crop to
           224, flip, uint8 CHW array); the output says which one ran. Without PIL the case is
           reported as skipped, with the reason.
  * npy  - pre-decoded uint8 images N x 256 x 256 x 3 in a .npy opened with numpy memmap;
           dataset[i] takes a random 224x224 crop and a random horizontal flip in NumPy and
           returns (CHW uint8 contiguous array, int label), batch 256.

For each dataset and each num_workers (default 8 and 15):

  * torch  - DataLoader(dataset, batch_size, shuffle=True, num_workers=N, pin_memory=True,
             persistent_workers=True, drop_last=True), each batch moved with
             .to("cuda", non_blocking=True);
  * pinmem - pinmem.Loader(dataset, batch_size, shuffle=True, num_workers=N,
             persistent_workers=True, drop_last=True).as_torch(): batches arrive on the GPU.

Each run makes a new loader, takes --warmup batches (worker start-up and the first burst of
batches, not timed), then times --batches batches; both counts are rounded up to a multiple of
num_workers, so that the clock starts and stops between two rounds of the workers' batches (the
workers start together and deliver their batches in rounds at first). Every batch is consumed
on the device (the sum of its images, added to one device counter) and the clock stops after a
synchronisation. Reported per row, medians over --repeats runs: images/s, the main process's
CPU seconds per batch (getrusage(RUSAGE_SELF), user + system: the main process's threads,
torch's pin-memory thread included, its worker processes not; while pinmem's Python-dataset
workers are threads of the main process, their work counts there too), and pinmem/torch at the
same num_workers; for npy also pinmem over torch's best configuration. Each repeat is a round
over every num_workers, torch and pinmem back to back (torch first in even rounds, pinmem first
in odd ones), so the machine's drift hits both.

Before timing, --check N batches of pinmem.Loader (default 3) over the same files with the
augmentation off (jpeg: a resize to 224x224; npy: the centre crop, no flip) are compared with
dataset[i] for the indices each batch names: a loader that delivers wrong bytes fails the run
(exit status 1) instead of posting a figure, and so does a pinmem.Loader that raises (its
traceback is printed, torch's rows go on).

TARGET lines: jpeg pinmem >= 1.0x torch at each num_workers; npy pinmem's best configuration
>= 3x torch's best (>= 2.5x with --device cpu, where the batches' consumer, a sum on the CPU,
shares the cores with the workers: its own cost is printed beside as the consumer's ceiling).

pinmem.Loader keywords the installed package does not accept yet (persistent_workers,
worker_mode, multiprocessing_context) are left out, with a note; the rows say which worker mode
ran. Without numpy or torch (or, with --device cuda, without a CUDA device) the script says so
and exits 0. --device cpu runs everything on the host (no pinning in torch, pinmem batches in
host memory): a smoke test of the script, not a figure.

  bench/compare_workers.py [--datasets jpeg,npy] [--workers 8,15] [--repeats 2]
                           [--batches 60] [--warmup 0] [--check 3] [--images 3000]
                           [--image-size 500x375] [--classes 4] [--jpeg-batch 128]
                           [--npy-images 8192] [--npy-batch 256] [--worker-mode MODE]
                           [--mp-context NAME] [--settle 1] [--seed 1] [--data-dir DIR]
                           [--device cuda|cpu] [--quick] [--json]
"""
import argparse
import json
import os
import platform
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time

BENCH = "workers_vs_torch"
JPEG_TARGET = 1.0  # pinmem / torch at each num_workers
NPY_TARGET = 3.0   # pinmem's best / torch's best
NPY_TARGET_CPU = 2.5  # the same with --device cpu
CROP = 224


# ---------------------------------------------------------------------------------------------
# Datasets. Module level, so that worker processes started by spawn or forkserver can import
# them; nothing large is pickled (the memmap is opened in each process on first use).

class NpyCrops:
    """Pre-decoded uint8 images (N, 256, 256, 3) in a .npy, read through a memmap. augment: a
    random 224 crop and a random horizontal flip; otherwise the centre crop. Returns (CHW uint8
    contiguous array, int label)."""

    def __init__(self, path, classes, augment=True):
        import numpy as np
        self.path = path
        self.classes = classes
        self.augment = augment
        self.n, self.h, self.w = np.load(path, mmap_mode="r").shape[:3]
        self._arr = None
        self._pid = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_arr"] = state["_pid"] = None  # never pickle the mapped bytes
        return state

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import numpy as np
        if self._pid != os.getpid():
            self._arr = np.load(self.path, mmap_mode="r")
            self._pid = os.getpid()
        if self.augment:
            y = random.randrange(self.h - CROP + 1)
            x = random.randrange(self.w - CROP + 1)
            img = self._arr[i, y:y + CROP, x:x + CROP]
            if random.random() < 0.5:
                img = img[:, ::-1]
        else:
            y, x = (self.h - CROP) // 2, (self.w - CROP) // 2
            img = self._arr[i, y:y + CROP, x:x + CROP]
        return np.ascontiguousarray(img.transpose(2, 0, 1)), int(i % self.classes)


class PilImageFolder:
    """What torchvision.datasets.ImageFolder with RandomResizedCrop(224), RandomHorizontalFlip()
    and PILToTensor() does, in PIL and NumPy: root/CLASS/*.jpg, classes in sorted order; each
    sample is opened, decoded to RGB, cropped at a random area (8-100%) and aspect ratio
    (3/4-4/3) and resized to 224x224 (bilinear), flipped with probability 1/2 and returned as a
    uint8 CHW array with its class index. augment=False: the whole image resized to 224x224."""

    def __init__(self, root, augment=True):
        self.root = root
        self.augment = augment
        self.classes = sorted(d for d in os.listdir(root)
                              if os.path.isdir(os.path.join(root, d)))
        self.samples = []
        for k, c in enumerate(self.classes):
            for f in sorted(os.listdir(os.path.join(root, c))):
                self.samples.append((os.path.join(root, c, f), k))

    def __len__(self):
        return len(self.samples)

    @staticmethod
    def _crop_box(w, h):
        """torchvision's RandomResizedCrop.get_params with scale (0.08, 1), ratio (3/4, 4/3)."""
        import math
        area = w * h
        log_lo, log_hi = math.log(3 / 4), math.log(4 / 3)
        for _ in range(10):
            target = area * random.uniform(0.08, 1.0)
            ratio = math.exp(random.uniform(log_lo, log_hi))
            cw = int(round(math.sqrt(target * ratio)))
            ch = int(round(math.sqrt(target / ratio)))
            if 0 < cw <= w and 0 < ch <= h:
                x = random.randint(0, w - cw)
                y = random.randint(0, h - ch)
                return x, y, cw, ch
        r = w / h  # fallback: the centre crop at the nearest allowed ratio
        if r < 3 / 4:
            cw, ch = w, int(round(w / (3 / 4)))
        elif r > 4 / 3:
            ch, cw = h, int(round(h * (4 / 3)))
        else:
            cw, ch = w, h
        return (w - cw) // 2, (h - ch) // 2, cw, ch

    def __getitem__(self, i):
        import numpy as np
        from PIL import Image
        path, label = self.samples[i]
        with Image.open(path) as f:
            img = f.convert("RGB")
        if self.augment:
            x, y, cw, ch = self._crop_box(*img.size)
            img = img.resize((CROP, CROP), Image.BILINEAR, box=(x, y, x + cw, y + ch))
            if random.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
        else:
            img = img.resize((CROP, CROP), Image.BILINEAR)
        return np.ascontiguousarray(np.asarray(img).transpose(2, 0, 1)), label


def _write_jpegs(job):
    """Write some of the images (a pool task): smooth colour fields (a coarse random grid,
    upscaled) with noise, so the files compress about as photographs do."""
    import numpy as np
    from PIL import Image
    paths, (w, h), seed = job
    rng = np.random.default_rng(seed)
    for p in paths:
        coarse = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
        base = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC), dtype=np.int16)
        noise = rng.normal(0.0, 12.0, size=(h, w, 3))
        img = np.clip(base + noise, 0, 255).astype(np.uint8)
        Image.fromarray(img).save(p, quality=90)
    return sum(os.path.getsize(p) for p in paths)


def make_jpegs(root, images, size, classes, seed):
    """-> mean file size in bytes."""
    import multiprocessing
    paths = []
    for k in range(classes):
        os.makedirs(os.path.join(root, "class%02d" % k), exist_ok=True)
    for i in range(images):
        paths.append(os.path.join(root, "class%02d" % (i % classes), "img%06d.jpg" % i))
    chunk = 100
    jobs = [(paths[i:i + chunk], size, seed * 1000003 + i) for i in range(0, len(paths), chunk)]
    procs = min(len(jobs), os.cpu_count() or 1)
    if procs > 1:
        with multiprocessing.get_context("fork").Pool(procs) as pool:
            total = sum(pool.map(_write_jpegs, jobs))
    else:
        total = sum(map(_write_jpegs, jobs))
    return total / max(1, images)


def make_npy(np, path, n, seed):
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(n, 256, 256, 3))
    rng = np.random.default_rng(seed)
    for i in range(0, n, 256):
        m = min(256, n - i)
        arr[i:i + m] = rng.integers(0, 256, size=(m, 256, 256, 3), dtype=np.uint8)
    arr.flush()
    del arr


def warm(root):
    """Read every file once, so the first loader timed does not read from the disk."""
    for d, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                while fh.read(1 << 24):
                    pass


# ---------------------------------------------------------------------------------------------
# Loaders

class PinmemFactory:
    """Makes pinmem.Loader objects with the keywords a DataLoader user passes. Keywords the
    installed pinmem does not accept yet are left out, once, with a note."""

    def __init__(self, pinmem, say, device, seed, worker_mode, mp_context):
        self.pinmem = pinmem
        self.say = say
        self.device = device
        self.seed = seed
        self.optional = {"persistent_workers": True}
        if worker_mode:
            self.optional["worker_mode"] = worker_mode
        if mp_context:
            self.optional["multiprocessing_context"] = mp_context
        self.dropped = []

    def make(self, dataset, batch, workers):
        kw = dict(batch_size=batch, shuffle=True, num_workers=workers, drop_last=True,
                  seed=self.seed, device=self.device)
        kw.update((k, v) for k, v in self.optional.items() if k not in self.dropped)
        while True:
            try:
                return self.pinmem.Loader(dataset, **kw)
            except TypeError as e:
                name = next((k for k in self.optional if k in kw and repr(k) in str(e)), None)
                if name is None:
                    raise
                del kw[name]
                self.dropped.append(name)
                self.say("note: this pinmem.Loader does not accept %s=%r yet (%s): left out" %
                         (name, self.optional[name], e))

    def worker_mode(self, loader):
        """The worker mode a loader runs, as far as it can be told."""
        mode = getattr(loader, "worker_mode", None)
        if mode:
            return str(mode)
        import inspect
        try:
            # (__init__: Loader.__new__ takes *args, **kwargs, which hides the keywords)
            params = inspect.signature(self.pinmem.Loader.__init__).parameters
        except (TypeError, ValueError):
            params = {}
        if "worker_mode" in self.dropped or "worker_mode" not in params:
            return "thread"  # before process workers, Python datasets ran on threads
        return self.optional.get("worker_mode", "process")  # the default for Python datasets


def torch_batches(torch, dl, device):
    """DataLoader batches moved to the device, epoch after epoch."""
    on_gpu = device == "cuda"
    while True:
        for x, y in dl:
            if on_gpu:
                x = x.to("cuda", non_blocking=True)
                y = y.to("cuda", non_blocking=True)
            yield x, y


def pinmem_batches(loader):
    while True:
        for x, y in loader.as_torch():
            yield x, y


def timed_run(torch, batches, warmup, count, device):
    """Consume warmup batches, then time count batches; each batch's images are summed on the
    device into one counter (so the batch is really used), synchronised at the end.
    -> (seconds, main-process CPU seconds, checksum)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    acc = torch.zeros((), dtype=torch.int64, device=device)
    for _ in range(warmup):
        x, y = next(batches)
        acc += x.sum()
        del x, y
    sync()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for _ in range(count):
        x, y = next(batches)
        acc += x.sum()
        del x, y
    sync()
    t1 = time.perf_counter()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return t1 - t0, cpu, int(acc.item())


def run_torch(torch, dataset, batch, workers, args, warmup, count):
    from torch.utils.data import DataLoader
    time.sleep(args.settle)
    g = torch.Generator()
    g.manual_seed(args.seed)
    kw = {}
    if args.mp_context and workers > 0:
        kw["multiprocessing_context"] = args.mp_context
    dl = DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers,
                    pin_memory=args.device == "cuda", persistent_workers=workers > 0,
                    drop_last=True, generator=g, **kw)
    it = torch_batches(torch, dl, args.device)
    try:
        return timed_run(torch, it, warmup, count, args.device)
    finally:
        it.close()
        del it, dl  # stops the workers before the next run starts


def run_pinmem(torch, factory, dataset, batch, workers, args, warmup, count):
    # The pause comes before the loader exists: its workers start filling slots at once, and
    # batches filled during a pause would reach the clock for free.
    time.sleep(args.settle)
    loader = factory.make(dataset, batch, workers)
    mode = factory.worker_mode(loader)
    it = pinmem_batches(loader)
    try:
        secs, cpu, acc = timed_run(torch, it, warmup, count, args.device)
    finally:
        it.close()
        del it
        loader.close()
    return secs, cpu, acc, mode


def as_numpy(np, torch, x):
    if isinstance(x, torch.Tensor):
        return x.cpu().numpy()
    return np.asarray(x)


def check(np, torch, factory, dataset, batch, workers, nbatches):
    """The first nbatches batches of a pinmem.Loader over dataset (augmentation off) against
    dataset[i] for the indices each batch names. -> (ok, message)."""
    try:
        loader = factory.make(dataset, batch, workers)
    except Exception as e:  # noqa: BLE001 - reported, and the run fails
        return False, "pinmem.Loader(...) raised %s: %s" % (type(e).__name__, e)
    try:
        it = loader.batches()
        for k in range(nbatches):
            b = next(it)
            idx = getattr(b, "indices", None)
            if idx is None or len(b) != 2:
                return False, ("batch %d has no indices or not 2 fields (%s): nothing to check "
                               "against" % (k, type(b).__name__))
            idx = [int(i) for i in idx]
            got = [as_numpy(np, torch, torch.from_dlpack(a)) for a in b]
            del b
            want_x = np.stack([as_numpy(np, torch, dataset[i][0]) for i in idx])
            want_y = np.array([dataset[i][1] for i in idx], dtype=np.int64)
            if got[0].shape != want_x.shape or got[0].dtype != want_x.dtype:
                return False, ("batch %d: images %s %s, the dataset gives %s %s" %
                               (k, got[0].shape, got[0].dtype, want_x.shape, want_x.dtype))
            if not np.array_equal(got[0], want_x):
                bad = int(np.argmax([not np.array_equal(g, w) for g, w in zip(got[0], want_x)]))
                return False, ("batch %d: the images differ from dataset[i] (first at row %d, "
                               "index %d)" % (k, bad, idx[bad]))
            if not np.array_equal(got[1].astype(np.int64), want_y):
                return False, "batch %d: the labels differ from dataset[i]" % k
        return True, "%d batches of %d equal dataset[i] for their indices" % (nbatches, batch)
    except Exception as e:  # noqa: BLE001 - reported, and the run fails
        return False, "reading a batch raised %s: %s" % (type(e).__name__, e)
    finally:
        loader.close()


# ---------------------------------------------------------------------------------------------

def parse_size(text):
    w, _, h = text.lower().partition("x")
    return int(w), int(h)


def round_up(n, m):
    m = max(1, m)
    return -(-max(n, 1) // m) * m


def main():
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="What each row measures, and the targets: see the opening comment of this "
               "script and docs/performance.md.")
    ap.add_argument("--datasets", default="jpeg,npy", help="which cases (default jpeg,npy)")
    ap.add_argument("--workers", default="8,15", help="num_workers values (default 8,15)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs per configuration, torch and pinmem alternating (default 2)")
    ap.add_argument("--batches", type=int, default=60,
                    help="timed batches per run, rounded up to a multiple of num_workers "
                         "(default 60)")
    ap.add_argument("--warmup", type=int, default=0,
                    help="untimed batches first, rounded up to a multiple of num_workers "
                         "(default 0: one per worker)")
    ap.add_argument("--check", type=int, default=3, metavar="N",
                    help="batches of pinmem.Loader compared with dataset[i] before timing, "
                         "augmentation off (default 3; 0: no check)")
    ap.add_argument("--images", type=int, default=3000, help="JPEG images (default 3000)")
    ap.add_argument("--image-size", default="500x375", help="JPEG size WxH (default 500x375)")
    ap.add_argument("--classes", type=int, default=4, help="classes (default 4)")
    ap.add_argument("--jpeg-batch", type=int, default=128, help="JPEG batch size (default 128)")
    ap.add_argument("--npy-images", type=int, default=8192,
                    help="pre-decoded 256x256x3 images (default 8192: 1.6 GB)")
    ap.add_argument("--npy-batch", type=int, default=256,
                    help="pre-decoded batch size (default 256)")
    ap.add_argument("--worker-mode", default=None,
                    help="pinmem.Loader worker_mode (default: the loader's own default)")
    ap.add_argument("--mp-context", default=None,
                    help="multiprocessing start method for both loaders (fork, spawn, "
                         "forkserver; default: each loader's default)")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds of quiet before each run (default 1)")
    ap.add_argument("--seed", type=int, default=1,
                    help="the data written, the shuffle orders and pinmem's seed (default 1)")
    ap.add_argument("--data-dir", help="where to write the datasets (default: a temporary "
                                       "folder, removed afterwards)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default); cpu: a smoke test of the script, no GPU")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny smoke run: 64 JPEGs, 256 pre-decoded images, 2 workers, small "
                         "batches, one repeat")
    ap.add_argument("--json", action="store_true",
                    help="JSON lines on stdout (the table and notes go to stderr)")
    if ap.parse_known_args()[0].quick:  # new defaults; options given still win
        ap.set_defaults(images=64, npy_images=256, jpeg_batch=8, npy_batch=16, workers="2",
                        repeats=1, batches=4, warmup=2, check=1, settle=0.0)
    args = ap.parse_args()
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else \
        (lambda *a: print(*a, flush=True))
    emit = (lambda row: print(json.dumps(row), flush=True)) if args.json else (lambda row: None)

    try:
        import numpy as np
        import torch
    except ImportError as e:
        say("compare_workers: skipped: needs numpy and torch (%s); nothing measured" % e)
        return 0
    if args.device == "cpu":
        global NPY_TARGET
        NPY_TARGET = NPY_TARGET_CPU
    if args.device == "cuda" and not torch.cuda.is_available():
        say("compare_workers: skipped: torch sees no CUDA device (torch %s, CUDA build %s); "
            "--device cpu runs the script on the host" % (torch.__version__, torch.version.cuda))
        return 0
    import pinmem

    workers = [int(w) for w in args.workers.split(",") if w.strip()]
    cases = [c.strip() for c in args.datasets.split(",") if c.strip()]
    for c in cases:
        if c not in ("jpeg", "npy"):
            ap.error("unknown dataset %r (jpeg, npy)" % c)
    factory = PinmemFactory(pinmem, say, args.device, args.seed, args.worker_mode,
                            args.mp_context)
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    machine = {"bench": BENCH, "case": "machine", "device": args.device,
               "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
               "cpu_count": os.cpu_count(), "cpus_usable": affinity,
               "cpu_model": platform.processor() or None, "python": platform.python_version(),
               "numpy": np.__version__, "torch": torch.__version__,
               "pinmem": getattr(pinmem, "__version__", None)}
    try:
        with open("/proc/cpuinfo") as f:
            machine["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f
                                         if ln.startswith("model name")), machine["cpu_model"])
    except OSError:
        pass
    emit(machine)
    say("compare_workers: %s, %d CPUs (%d usable), torch %s, pinmem %s; workers %s, %d "
        "repeats" % (machine["gpu"] or "no GPU (--device cpu: a smoke test, not a figure)",
                     machine["cpu_count"], affinity, torch.__version__, machine["pinmem"],
                     ",".join(map(str, workers)), args.repeats))

    tmp = args.data_dir or tempfile.mkdtemp(prefix="pinmem-workers.")
    os.makedirs(tmp, exist_ok=True)
    failed, errors = False, []
    try:
        for case in cases:
            built = build_case(case, np, args, tmp, say)
            if "skipped" in built:
                say("%s: skipped: %s" % (case, built["skipped"]))
                say("TARGET %s: not measured  MISS" % target_text(case))
                emit({"bench": BENCH, "case": case, "skipped": built["skipped"]})
                emit({"bench": BENCH, "case": "TARGET_" + case, "target": target_text(case),
                      "value": None, "met": False, "measured": False,
                      "reason": built["skipped"]})
                continue
            say("%s: %s; batch %d" % (case, built["what"], built["batch"]))
            verified, why = None, "no check (--check 0)"
            if args.check > 0:
                verified, why = check(np, torch, factory, built["plain"], built["batch"],
                                      workers[0], args.check)
                say("  check (augmentation off, %d workers): %s: %s" %
                    (workers[0], "ok" if verified else "FAILED", why))
                emit({"bench": BENCH, "case": case + "_check", "verified": verified,
                      "detail": why, "workers": workers[0], "batches": args.check})
                if not verified:
                    failed = True
            case_rows = measure(case, built, torch, factory, workers, args, verified, say,
                                verified is False, errors)
            targets = case_targets(case, case_rows, built, say)
            for r in case_rows + targets:
                emit(r)
        for e in errors:
            emit({"bench": BENCH, "case": "error", "error": e})
    finally:
        if not args.data_dir:
            shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed or errors else 0


def build_case(case, np, args, tmp, say):
    """Write the dataset of a case. -> dict: the augmented dataset ('data'), the same without
    augmentation ('plain'), batch, a description and fields for the rows; or {'skipped': why}."""
    if case == "npy":
        path = os.path.join(tmp, "images256.npy")
        if not os.path.exists(path):
            say("npy: writing %d uint8 images 256x256x3 (%.2f GB) to %s" %
                (args.npy_images, args.npy_images * 196608 / 1e9, path))
            make_npy(np, path, args.npy_images, args.seed)
        warm(path)
        data = NpyCrops(path, args.classes)  # len(data): the file's, where --data-dir had one
        return {"data": data, "batch": args.npy_batch,
                "plain": NpyCrops(path, args.classes, augment=False),
                "what": "%d pre-decoded %dx%dx3 uint8 images (numpy memmap), random 224 crop "
                        "+ flip in NumPy" % (len(data), data.h, data.w),
                "fields": {"dataset_images": len(data), "reader": "NpyCrops (memmap)"}}
    try:
        import PIL.Image  # the module the datasets use, not only the package
    except ImportError as e:
        return {"skipped": "PIL is not installed (%s): pip install pillow" % e}
    root = os.path.join(tmp, "jpeg")
    w, h = parse_size(args.image_size)
    if not os.path.isdir(root):
        say("jpeg: writing %d JPEGs %dx%d in %d classes to %s" %
            (args.images, w, h, args.classes, root))
        mean = make_jpegs(root, args.images, (w, h), args.classes, args.seed)
    else:
        files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
        mean = sum(os.path.getsize(f) for f in files) / max(1, len(files))
    warm(root)
    try:
        import torchvision
        from torchvision import transforms as T
        from torchvision.datasets import ImageFolder
        data = ImageFolder(root, transform=T.Compose([
            T.RandomResizedCrop(CROP), T.RandomHorizontalFlip(), T.PILToTensor()]))
        plain = ImageFolder(root, transform=T.Compose([T.Resize((CROP, CROP)), T.PILToTensor()]))
        reader = "torchvision.datasets.ImageFolder (torchvision %s)" % torchvision.__version__
    except ImportError as e:
        data, plain = PilImageFolder(root), PilImageFolder(root, augment=False)
        reader = "PilImageFolder of this script (torchvision not importable: %s)" % e
    return {"data": data, "plain": plain, "batch": args.jpeg_batch,
            "what": "%d JPEGs %dx%d (mean %.0f KB), %s, RandomResizedCrop(224) + flip + "
                    "uint8 CHW, Pillow %s" % (len(data), w, h, mean / 1e3, reader,
                                              PIL.__version__),
            "fields": {"dataset_images": len(data), "reader": reader,
                       "jpeg_mean_bytes": round(mean), "pillow": PIL.__version__}}


def consumer_ceiling(torch, built, args, say):
    """--device cpu: the batches' consumer alone (timed_run over one batch made in advance, no
    loader), in images/s. On the CPU it shares the cores with the workers, so no loader can pass
    it, and the ratio of two loaders is bounded by it."""
    import itertools
    from torch.utils.data import DataLoader
    batch = built["batch"]
    one = next(iter(DataLoader(built["data"], batch_size=batch)))
    count = max(args.batches, 8)
    secs, _, _ = timed_run(torch, itertools.repeat(one), 2, count, "cpu")
    rate = count * batch / secs
    say("  consumer alone (the loop's sum of each batch, no loader): %8.0f images/s: the most any "
        "loader can deliver here" % rate)
    return rate


def measure(case, built, torch, factory, workers, args, verified, say, skip_pinmem, errors):
    """Time every configuration of a case; -> rows. A pinmem run that raises is reported (in
    errors, and on the console with its traceback) and ends pinmem's runs for the case."""
    import traceback
    batch = built["batch"]
    runs = {}
    for rep in range(args.repeats):  # rounds over every configuration: drift hits them all
        for w in workers:
            warmup = round_up(args.warmup or w, w)
            count = round_up(args.batches, w)
            order = ("torch", "pinmem") if rep % 2 == 0 else ("pinmem", "torch")
            for impl in order:
                if impl == "pinmem" and skip_pinmem:
                    continue
                if impl == "torch":
                    secs, cpu, _ = run_torch(torch, built["data"], batch, w, args, warmup, count)
                    mode = None
                else:
                    try:
                        secs, cpu, _, mode = run_pinmem(torch, factory, built["data"], batch,
                                                        w, args, warmup, count)
                    except Exception as e:  # noqa: BLE001 - reported, and the run fails
                        say(traceback.format_exc().rstrip())
                        errors.append("%s, pinmem, %d workers: %s: %s" %
                                      (case, w, type(e).__name__, e))
                        say("  pinmem %2d workers, run %d FAILED: %s" % (w, rep + 1, errors[-1]))
                        skip_pinmem = True
                        continue
                r = runs.setdefault((impl, w), {"seconds": [], "cpu": [], "mode": mode,
                                                "warmup": warmup, "count": count})
                r["seconds"].append(secs)
                r["cpu"].append(cpu)
                say("  %-6s %2d workers, run %d: %8.0f images/s, main-process CPU %.4f s/batch"
                    % (impl, w, rep + 1, count * batch / secs, cpu / count))
    ceiling = consumer_ceiling(torch, built, args, say) if args.device == "cpu" else None
    rows = []
    for (impl, w), r in runs.items():
        secs = statistics.median(r["seconds"])
        row = {"bench": BENCH, "case": "%s_%s_w%d" % (case, impl, w), "dataset": case,
               "impl": impl, "workers": w, "batch": batch, "device": args.device,
               "warmup_batches": r["warmup"], "batches": r["count"], "repeats": len(r["seconds"]),
               "seconds": secs, "images_per_s": r["count"] * batch / secs,
               "images_per_s_runs": [r["count"] * batch / s for s in r["seconds"]],
               "cpu_s_per_batch": statistics.median(r["cpu"]) / r["count"],
               "cpu_s_per_batch_runs": [c / r["count"] for c in r["cpu"]],
               "verified": verified if impl == "pinmem" else None,
               "verify_method": "first_batches" if impl == "pinmem" and verified is not None
               else "none"}
        if impl == "pinmem":
            row["worker_mode"] = r["mode"]
            row["keywords_left_out"] = list(factory.dropped)
        else:
            row["pin_memory"] = args.device == "cuda"
        row.update(built["fields"])
        if ceiling is not None:
            row["consumer_images_per_s"] = ceiling
        rows.append(row)
    by = {(r["impl"], r["workers"]): r for r in rows}
    torch_rows = [r for r in rows if r["impl"] == "torch"]
    best = max(torch_rows, key=lambda r: r["images_per_s"]) if torch_rows else None
    for r in rows:
        t = by.get(("torch", r["workers"]))
        r["ratio_vs_torch"] = r["images_per_s"] / t["images_per_s"] if t else None
        if case == "npy":
            r["ratio_vs_best_torch"] = r["images_per_s"] / best["images_per_s"] if best else None
            r["best_torch"] = best["case"] if best else None
    rows.sort(key=lambda r: (r["workers"], r["impl"] != "torch"))
    say("")
    say("  %-20s %11s %9s %15s %9s%s" % ("configuration", "images/s", "ratio", "CPU s/batch",
                                          "mode", "   vs best torch" if case == "npy" else ""))
    for r in rows:
        ratio = r["ratio_vs_torch"]
        extra = ""
        if case == "npy":
            extra = "   %.2fx" % r["ratio_vs_best_torch"] if r["ratio_vs_best_torch"] else "   -"
        say("  %-20s %11.0f %9s %15.4f %9s%s" % (
            r["case"], r["images_per_s"], ("%.2fx" % ratio) if r["impl"] == "pinmem" and ratio
            else "", r["cpu_s_per_batch"], r.get("worker_mode") or "", extra))
    if any(r.get("worker_mode") == "thread" for r in rows):
        say("  (pinmem's workers ran as threads of the main process: its CPU time includes "
            "their work)")
    say("")
    return rows


def target_text(case, workers=None):
    if case == "jpeg":
        return "JPEG pinmem >= %.1fx torch at %s" % (
            JPEG_TARGET, "each worker count" if workers is None else "%d workers" % workers)
    return "pre-decoded pinmem >= %gx torch's best configuration" % NPY_TARGET


def case_targets(case, rows, built, say):
    pm = [r for r in rows if r["impl"] == "pinmem"]
    out = []
    if case == "jpeg":
        ws = sorted({r["workers"] for r in rows})
        for w in ws:
            p = next((r for r in pm if r["workers"] == w), None)
            t = next((r for r in rows if r["impl"] == "torch" and r["workers"] == w), None)
            text = target_text(case, w)
            if p and t:
                met = p["ratio_vs_torch"] >= JPEG_TARGET and bool(p["verified"] in (True, None))
                say("TARGET %s: %.2fx (pinmem %.0f images/s, %.4f CPU s/batch; torch %.0f, "
                    "%.4f)%s  %s" % (text, p["ratio_vs_torch"], p["images_per_s"],
                                     p["cpu_s_per_batch"], t["images_per_s"],
                                     t["cpu_s_per_batch"], "" if p["verified"] else
                                     " (not checked)" if p["verified"] is None else "",
                                     "PASS" if met else "MISS"))
                out.append({"bench": BENCH, "case": "TARGET_jpeg_w%d" % w, "target": text,
                            "value": p["ratio_vs_torch"], "met": met, "measured": True,
                            "verified": p["verified"]})
            else:
                say("TARGET %s: not measured (the check or the run failed)  MISS" % text)
                out.append({"bench": BENCH, "case": "TARGET_jpeg_w%d" % w, "target": text,
                            "value": None, "met": False, "measured": False})
    else:
        text = target_text(case)
        best_pm = max(pm, key=lambda r: r["images_per_s"]) if pm else None
        if best_pm and best_pm.get("ratio_vs_best_torch"):
            v = best_pm["ratio_vs_best_torch"]
            met = v >= NPY_TARGET and bool(best_pm["verified"] in (True, None))
            say("TARGET %s: %.2fx (pinmem %s %.0f images/s, torch %s %.0f)%s  %s" % (
                text, v, best_pm["case"], best_pm["images_per_s"], best_pm["best_torch"],
                best_pm["images_per_s"] / v, "" if best_pm["verified"] else " (not checked)",
                "PASS" if met else "MISS"))
            out.append({"bench": BENCH, "case": "TARGET_npy", "target": text, "value": v,
                        "met": met, "measured": True, "verified": best_pm["verified"],
                        "pinmem": best_pm["case"], "torch": best_pm["best_torch"]})
        else:
            say("TARGET %s: not measured (the check or the run failed)  MISS" % text)
            out.append({"bench": BENCH, "case": "TARGET_npy", "target": text, "value": None,
                        "met": False, "measured": False})
    return out


if __name__ == "__main__":
    # Run from the module compare_workers rather than __main__, so that the datasets pickle by
    # a module name that any fresh interpreter a loader starts (spawn, forkserver, a worker
    # started as its own process) can import: this folder goes on its PYTHONPATH.
    _here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (_here, os.environ.get("PYTHONPATH")) if p)
    if _here not in sys.path:
        sys.path.insert(0, _here)
    import compare_workers
    sys.exit(compare_workers.main())
