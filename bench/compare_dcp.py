#!/usr/bin/env python3
"""torch.distributed.checkpoint (DCP) through pinmem.dcp beside torch's own FileSystemWriter and
FileSystemReader, same sharded state dict, same run.

--ranks processes (default 2) are spawned and joined in a process group (gloo; on cuda devices
the collectives still go through gloo, which async_save needs and which lets several ranks
share one GPU). Each rank holds its shard of the state dict: --size bytes in all (default 1G),
as bf16 tensors of 4096 rows made by compare_checkpoint's make_checkpoint, keyed by rank, on
--device (cpu, or cuda: rank r on device r mod the device count). Timed, with every rank at
once (the total GB/s is all ranks' bytes over the slowest rank's time; per rank, its bytes over
its own write_data / read_data):

  * the disk's own rate: compare_checkpoint's Disk (dd-like O_DIRECT writes and reads of a file
    of each rank's shard size, 16 MiB blocks, fsync'd), every rank at once (each rank's
    previous file removed and synced before a barrier; a write timed from the first rank's
    start to the last rank's fsync; each write and each read done twice: from and into one
    reused 16 MiB buffer, the verdicts' reference, and from and into memory of the shard's size
    (huge pages), printed beside), measured at the
    start and again right before each timed pinmem save and cold load. The virtual disk here
    moves from minute to minute by more than the 10% the targets allow, so each verdict is
    taken beside its runs: pinmem's best against the best of the disk runs right before them
    (as many as they, in the same minutes); each run's rate over the rate of the disk run right
    before it, and the disk's best over the whole run, are printed beside;
  * dcp.save with torch's FileSystemWriter and with pinmem.dcp.FileSystemWriter (fsync included;
    a fresh folder each time), the best of --repeat, after one untimed save each (a training
    run's saves after its first find their writer's buffers and threads made);
  * dcp.load, cold (the files' pages dropped as compare_checkpoint's drop_cache does), with
    torch's FileSystemReader and pinmem.dcp.FileSystemReader, the loaded tensors checked;
  * pinmem's writer again from async_save's pinned snapshot (the background write of an async
    save; on a GPU, device tensors go to the file through pinmem's pinned ring likewise);
  * dcp.async_save's return time with pinmem's writer (its PinnedStager, the snapshot buffer
    reused) and with torch's, beside the snapshot alone (the same writer's PinnedStager.stage:
    the copy into the same pinned buffer, or on a GPU the copy into a device scratch, waited
    for), the snapshot alone and pinmem's async_save run by run in turn (each figure the best
    run but the first, a run's time its slowest rank's);
  * a small training loop (an MLP, one thread per rank on the CPU; on GPUs one rank a device:
    ranks that share a GPU time-slice it), as many steps as an async
    save takes, timed without a save, while an async_save of the state dict is written with
    pinmem's writer and with torch's, and while the disk alone writes the same bytes (O_DIRECT,
    16 MiB blocks, fsync, on a thread: no DCP, no pinmem), in turn (at least 9 rounds): the
    median of the slowdowns in percent,
    their middle half (first to third quartile), each round's beside. The disk alone is what
    the I/O itself costs the loop on this machine, the floor under any writer's slowdown.
    thread_waits: the times the training thread waited over its steps (its voluntary context
    switches, the median of the rounds): waits for the interpreter lock, held by the save's
    threads, show here. thread_preemptions: the times the scheduler gave its CPU to another
    thread while it could run (involuntary switches): CPUs short, not the lock.
    --saves-per-loop K: each timed loop spans K saves (and K of the disk's writes) one after
    the other, K times the steps: the loop's own noise weighs less in each run.

TARGET lines (met / MISSED / UNDECIDED): save >= 0.9x the disk's O_DIRECT write; cold load >=
0.9x the disk's O_DIRECT read; async return <= 1.3x the snapshot alone; training slowdown < 5%
during an async save (met when the middle half of the pairs lies below 5%, MISSED when it lies
at or above, UNDECIDED when it straddles 5%, when the loop's own runs without a save, compared
with each other, spread over more than 5 points in their middle half, or when the median is a
speed-up of more than 5%); pinmem faster than
torch's writer and reader (the ratios printed). --train-only runs the training loop alone
(every mode of it, the disk alone included) and prints its TARGET line.

  bench/compare_dcp.py [--ranks 2] [--size 1G] [--device cpu|cuda] [--dir DIR] [--repeat 3]
                       [--crc32 torch|off] [--io auto|direct|buffered]
                       [--executor thread|process] [--plan-caching] [--saves-per-loop K]
                       [--device-copies gathered|pieces] [--stage auto|device|host]
                       [--switch-interval S]
                       [--no-train | --train-only] [--json]

Rows of saves and loads carry, per rank: the whole dcp.save / dcp.load (rank_seconds), DCP's own
part of it (dcp_own_seconds: planning, the collectives that gather plans and results, the
metadata; split into dcp_before_seconds, up to the storage layer's call, and dcp_after_seconds),
the storage layer's (storage_seconds: write_data / read_data), the CPU seconds (user +
system, all threads: on a machine of few cores the CPU a save needs, torch.save's CRC-32 of
every byte on by default, is what it competes with the ranks' training for), and for pinmem the
phases inside the storage layer (seconds): copy (into the pinned chunks, or out of the read
spans), crc, wait_disk (waiting for pinmem's writes or reads), fsync, items (items read one by
one), torch_save_small (the tensors torch.save writes whole: quantized, subclasses, or not
contiguous). The snapshot and async-return rows carry each run's time in ms (runs_ms: the
slowest rank's; the first run allocates the snapshot buffer and is left out of the figure) and
start_spread_ms, the most the ranks' starts of one run were apart; pinmem's
rows also pinned_alloc_ms (the longest a stage after the first waited for or allocated its
pinned buffer) and paired_snapshot_ratios (each return over the snapshot run right before it).
pinmem's save and load rows carry the disk runs right before their runs: paired_disk_gbps (their
best, the verdict's reference), paired_disk_runs_gbps (each, in turn), paired_disk_ratios (each
run over its own); the saves also paired_disk_from_* for the writes from memory of the shard's
size, the load paired_disk_into_* for the reads into it.

Human-readable lines go to stderr; with --json one JSON object per result goes to stdout.
"""
import argparse
import json
import multiprocessing as mp
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_checkpoint import (BLOCK, Disk, disk_memory, drop_cache,  # noqa: E402
                                huge_buffer, make_checkpoint, parse_size, say)

ROW = {"bench": "dcp"}
PAIRS = 9  # (without, with) pairs of the training loop, at least


class Ranks:
    """This rank's view of the group: barriers, and one value from every rank."""

    def __init__(self, dist, rank, world):
        self.dist, self.rank, self.world = dist, rank, world

    def barrier(self):
        self.dist.barrier()

    def gather(self, value):
        out = [None] * self.world
        self.dist.all_gather_object(out, value)
        return out


def timed_io(cls, method):
    """cls with `method` (write_data / read_data) timing itself into .io_seconds."""
    class Timed(cls):
        pass

    def wrapped(self, *a, **k):
        t0 = self.io_began = time.perf_counter()
        out = getattr(cls, method)(self, *a, **k)
        self.io_seconds = time.perf_counter() - t0
        return out
    setattr(Timed, method, wrapped)
    return Timed


def _switches(field):
    """This thread's count of context switches of the kind field names (Linux; None elsewhere)."""
    try:
        with open("/proc/self/task/%d/status" % threading.get_native_id()) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def thread_waits():
    """This thread's voluntary context switches so far (Linux; None elsewhere): each is a wait,
    in a training loop on the CPU or launching GPU kernels mostly one for the interpreter lock,
    held by another thread of the process."""
    return _switches("voluntary_ctxt_switches")


def thread_preemptions():
    """This thread's involuntary context switches so far (Linux; None elsewhere): each time the
    scheduler gave its CPU to another thread while it could run."""
    return _switches("nonvoluntary_ctxt_switches")


def cpu_seconds():
    """User + system CPU seconds of this process so far (all its threads)."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def sync(torch, device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def rank_main(rank, world, args, store, tmp):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import pinmem
    import pinmem.dcp as pdcp

    # each save into a folder that holds a checkpoint says so; these do on purpose
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    torch.set_num_threads(1)  # the ranks share the machine's cores, as one per core
    pdcp._FileOut.DEVICE_GATHER = args.device_copies == "gathered"
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.crc32 == "off":  # torch.save's CRCs off, for torch's writer and pinmem's alike
        torch.serialization.set_crc32_options(False)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    g = Ranks(dist, rank, world)
    device = args.device
    if device.startswith("cuda"):
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    total = parse_size(args.size)
    shard = make_checkpoint(torch, total // world, device)
    sd = {f"rank{rank}.{k}": v for k, v in shard.items()}
    # What DCP is given, shaped as a training script's {"model": model.state_dict(), ...}: torch's
    # save and async_save spend about 0.1 ms per top-level key (a logged call each), so a flat
    # dict of these 96 tensors added 3 ms of torch's own to each async_save return on 2 CPUs.
    app = {"model": sd}
    # every async_save below, pinmem's and torch's, with the executor asked for
    async_kw = {}
    if args.executor == "process":
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        # its process joins a group of its own at MASTER_ADDR, as torchrun sets it
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        async_kw["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
    # --plan-caching: each writer's async_saves get one planner kept across them, caching
    # plans. torch keeps cached plans per planner class name, so each writer has a class of its
    # own: a plan names the files of the writer that made it.
    planners = {}
    if args.plan_caching:
        from torch.distributed.checkpoint import DefaultSavePlanner
        for kind in ("pinmem", "torch"):
            cls = type(f"{kind.title()}CachingPlanner", (DefaultSavePlanner,), {})
            planners[kind] = cls(enable_plan_caching=True)

    def akw(kind):
        """The keywords of an async_save through the writer of kind (pinmem or torch)."""
        return dict(async_kw, **({"planner": planners[kind]} if planners else {}))
    mine = sum(t.numel() * t.element_size() for t in sd.values())
    allb = sum(g.gather(mine))
    lead = rank == 0
    rows = []

    def report(case, seconds, nbytes, **extra):
        r = dict(ROW, case=case, device=args.device, ranks=world, bytes=nbytes,
                 crc32=torch.serialization.get_crc32_options(),
                 seconds=round(seconds, 6),
                 gbps=round(nbytes / seconds / 1e9, 3) if seconds > 0 else None, **extra)
        rows.append(r)
        if lead:
            say("  %-30s %8.3f s %8.3f GB/s%s" % (case, seconds, r["gbps"] or 0, "".join(
                "  %s=%s" % kv for kv in extra.items())))
            if args.json:
                print(json.dumps(r), flush=True)
        return r

    if lead:
        say("compare_dcp: %d ranks, %.2f GB in all (%d tensors of %s per rank), device %s, "
            "pinmem %s backend, torch %s, crc32 %s (pinmem's threads: %s), %s executor%s, "
            "device copies %s, stage %s, switch interval %g s, %d CPUs, load average %.1f; "
            "files in %s" % (
                world, allb / 1e9, len(sd), next(iter(sd.values())).dtype, args.device,
                pinmem.backend(), torch.__version__, torch.serialization.get_crc32_options(),
                pinmem.crc32_implementation(),
                args.executor, ", plan caching" if planners else "", args.device_copies,
                args.stage, sys.getswitchinterval(), os.cpu_count(),
                os.getloadavg()[0], tmp))
        if args.json:
            print(json.dumps(dict(ROW, case="setup", device=args.device, ranks=world,
                                  bytes=allb, tensors_per_rank=len(sd), cpus=os.cpu_count(),
                                  loadavg=os.getloadavg()[0], torch=torch.__version__,
                                  pinmem_backend=pinmem.backend(),
                                  crc32=torch.serialization.get_crc32_options(),
                                  crc32_impl=pdcp._crc32.__module__,
                                  crc32_threads_impl=pinmem.crc32_implementation(),
                                  executor=args.executor,
                                  device_copies=args.device_copies, stage=args.stage,
                                  switch_interval=sys.getswitchinterval(),
                                  plan_caching=bool(planners))), flush=True)

    if args.train_only:
        train = train_during_save(torch, dcp, pdcp, g, app, device, tmp, args.repeat, report,
                                  allb, akw, args.saves_per_loop, args.stage)
        if lead:
            say_targets([train_target(train)], args)
        g.barrier()
        dist.destroy_process_group()
        return rows

    # --- the disk, every rank at once -------------------------------------------------------
    disk = Disk(os.path.join(tmp, f"dd.{rank}.bin"), mine)
    dw, dr = [], []

    # Memory of the shard's size (huge pages, as the disk's own buffer and pinmem's snapshot):
    # the disk's writes from it and reads into it, each request from or into its own place,
    # beside the verdicts' reused 16 MiB buffer. A save or a load cannot reuse one hot buffer,
    # and on a virtual disk the host copies a reused one from its caches: this one wrote 2.29
    # GB/s from one 16 MiB buffer, 1.99 from 512 MiB in turn (bench/write_pattern.py says the
    # same of pinmem's pinned buffer).
    dwf, dri = [], []
    into, _into_map = huge_buffer(disk.blocks * BLOCK)
    for i in range(disk.blocks):
        into[i * BLOCK:(i + 1) * BLOCK] = disk.buf

    spreads = []  # per disk write: the ranks' start times, last minus first

    def disk_write():
        # Every rank clears (unlink, sync) before the barrier, so the writes start together; the
        # time is the span from the first rank's start to the last one's fsync, as a save's is
        # the slowest rank's from the barrier on. Then the same from memory of the shard's size.
        for src, times in ((None, dw), (into, dwf)):
            disk.clear()
            g.barrier()
            disk.write(clear=False, src=src)
            s = g.gather((disk.starts[-1], (disk.writes if src is None else disk.writes_from)[-1])
                         if disk.ok else None)
            if all(x is not None for x in s):
                times.append(max(t + d for t, d in s) - min(t for t, _ in s))
                if src is None:
                    spreads.append(max(t for t, _ in s) - min(t for t, _ in s))

    def disk_read():
        g.barrier()
        disk.read()
        s = g.gather(disk.reads[-1] if disk.ok else None)
        if all(x is not None for x in s):
            dr.append(max(s))
        g.barrier()
        disk.read(into=into)
        s = g.gather(disk.reads_into[-1] if disk.ok else None)
        if all(x is not None for x in s):
            dri.append(max(s))

    disk_write()
    disk_read()
    if lead:
        say("  the disk's rate measured from and into a buffer %s" % disk_memory(disk))

    # --- saves --------------------------------------------------------------------------------
    writers = {"torch": timed_io(dcp.FileSystemWriter, "write_data"),
               "pinmem": timed_io(pdcp.FileSystemWriter, "write_data")}
    kw = {"pinmem": {"io": args.io}, "torch": {}}
    saves = {"torch": [], "pinmem": []}
    folders = {k: os.path.join(tmp, k) for k in writers}

    def save(kind):
        if lead:
            shutil.rmtree(folders[kind], ignore_errors=True)
            os.sync()
        g.barrier()
        w = writers[kind](folders[kind], **kw[kind])
        sync(torch, device)
        c0 = cpu_seconds()
        t0 = time.perf_counter()
        dcp.save(app, storage_writer=w)
        wall = time.perf_counter() - t0
        s = g.gather((wall, w.io_seconds, cpu_seconds() - c0, getattr(w, "phases", None),
                      w.io_began - t0))
        saves[kind].append(run_of(s))

    # untimed, as a training run's first save (pinmem's pinned chunks are made, then kept)
    for kind in ("torch", "pinmem"):
        save(kind)
        saves[kind].clear()
    for _ in range(args.repeat):
        save("torch")
        disk_write()
        save("pinmem")

    # --- cold loads ---------------------------------------------------------------------------
    readers = {"torch": timed_io(dcp.FileSystemReader, "read_data"),
               "pinmem": timed_io(pdcp.FileSystemReader, "read_data")}
    loads = {"torch": [], "pinmem": []}
    dest = {k: torch.empty_like(v) for k, v in sd.items()}
    verified = {}

    def load(kind):
        folder = folders[kind]
        for v in dest.values():
            v.fill_(0)
        g.barrier()
        if lead:
            how = None
            for name in os.listdir(folder):
                how = drop_cache(os.path.join(folder, name))
            load.how = how
        g.barrier()
        r = readers[kind](folder, **kw[kind])
        c0 = cpu_seconds()
        t0 = time.perf_counter()
        dcp.load({"model": dest}, storage_reader=r)
        sync(torch, device)
        wall = time.perf_counter() - t0
        c = cpu_seconds() - c0
        ok = all(torch.equal(dest[k], sd[k]) for k in sd)
        s = g.gather((wall, r.io_seconds, c, getattr(r, "phases", None), r.io_began - t0, ok))
        loads[kind].append(run_of(s))
        verified[kind] = all(x[5] for x in s)

    load.how = None
    for _ in range(args.repeat):
        load("torch")
        disk_read()
        load("pinmem")

    def best(runs):
        return min(runs, key=lambda r: r["wall"])

    per = lambda io_s: [round(mine_b / s / 1e9, 3) for mine_b, s in zip(g.gather(mine), io_s)]

    def paired(disk, runs):
        """Each run's rate over the rate of the disk run right before it (the disk's rate
        drifts from minute to minute here), sorted; None where a disk run is missing."""
        if len(disk) != len(runs):
            return None
        return sorted(round(d / r["wall"], 3) for d, r in zip(disk, runs))

    def beside(disk, runs, name="paired_disk_ratios"):
        """The disk runs right before runs: the verdict's reference (their best, GB/s), their
        rates in order, and each run against its own."""
        if len(disk) != len(runs):
            return {}
        return {name: paired(disk, runs),
                name.replace("ratios", "gbps"): round(allb / min(disk) / 1e9, 3),
                name.replace("ratios", "runs_gbps"): [round(allb / d / 1e9, 3) for d in disk]}

    results = {}
    if dw:
        results["disk_read"] = report("disk_odirect_read", min(dr), allb, runs=len(dr))
        if dri:
            results["disk_read_into"] = report("disk_odirect_read_to_memory", min(dri), allb,
                                               runs=len(dri))
    for kind in ("torch", "pinmem"):
        b = best(saves[kind])
        extra = dict(beside(dw[1:1 + args.repeat], saves[kind]),
                     **beside(dwf[1:1 + args.repeat], saves[kind], "paired_disk_from_ratios")) \
            if kind == "pinmem" else {}
        results[f"{kind}_save"] = report(f"{kind}_save", b["wall"], allb,
                                         per_rank_gbps=per(b["io"]), **phase_fields(b),
                                         verified=True, **extra)
    for kind in ("torch", "pinmem"):
        b = best(loads[kind])
        extra = dict(beside(dr[1:], loads[kind]),
                     **beside(dri[1:], loads[kind], "paired_disk_into_ratios")) \
            if kind == "pinmem" else {}
        results[f"{kind}_load"] = report(f"{kind}_load_cold", b["wall"], allb,
                                         per_rank_gbps=per(b["io"]), **phase_fields(b), **extra,
                                         verified=verified[kind], dropped=load.how)

    del dest  # room for the snapshots below, at sizes near the machine's memory

    # --- async_save ---------------------------------------------------------------------------
    stager = pdcp.PinnedStager()
    # The background write of an async save: pinmem's writer from the pinned snapshot (no copy
    # into its slots: the bytes are pinned and 4 KiB aligned), beside the save above from the
    # tensors' own (pageable) memory.
    staged = stager.stage(app)
    snap_saves = []
    for _ in range(args.repeat):
        disk_write()
        if lead:
            shutil.rmtree(folders["pinmem"], ignore_errors=True)
            os.sync()
        g.barrier()
        w = writers["pinmem"](folders["pinmem"], **kw["pinmem"])
        t0 = time.perf_counter()
        c0 = cpu_seconds()
        dcp.save(staged, storage_writer=w)
        s = g.gather((time.perf_counter() - t0, w.io_seconds, cpu_seconds() - c0, w.phases,
                      w.io_began - t0))
        snap_saves.append(run_of(s))
    del staged
    b = best(snap_saves)
    results["pinmem_save_pinned"] = report("pinmem_save_from_snapshot", b["wall"], allb,
                                           per_rank_gbps=per(b["io"]), **phase_fields(b),
                                           **beside(dw[1 + args.repeat:], snap_saves),
                                           **beside(dwf[1 + args.repeat:], snap_saves,
                                                    "paired_disk_from_ratios"))
    if dw:  # the disk's best, with the runs beside these saves
        results["disk_write"] = report("disk_odirect_write", min(dw), allb, runs=len(dw),
                                       start_spread_ms=round(1e3 * max(spreads), 1))
    if dwf:
        results["disk_write_from"] = report("disk_odirect_write_from_memory", min(dwf), allb,
                                            runs=len(dwf))
    stager.close()

    def alloc_s(writer):  # the stage's wait for, or allocation of, its pinned buffer
        return writer._stager.last.get("phases", {}).get("pinned_alloc", 0.0)

    def snapshot_once(writer, starts, allocs):
        """The snapshot alone (on a GPU, the device copy waited for), by the stager of the
        writer whose async_save is timed next: the same copy into the same buffer."""
        g.barrier()
        sync(torch, device)
        t0, w0 = time.perf_counter(), time.time()
        staged = writer._stager.stage(app)
        sync(torch, device)
        took = time.perf_counter() - t0
        del staged
        starts.append(w0)
        allocs.append(alloc_s(writer))
        return took

    def async_once(kind, writer, starts, allocs=None):
        g.barrier()
        t0, w0 = time.perf_counter(), time.time()
        fut = dcp.async_save(app, storage_writer=writer, **akw(kind))
        ret = time.perf_counter() - t0
        fut.result()
        starts.append(w0)
        if allocs is not None:
            allocs.append(alloc_s(writer))
        return max(g.gather(ret))

    # The snapshot alone and pinmem's async_save take turns, run by run: this machine's copy
    # rate drifts by more than the target's margin over the seconds between two blocks of runs.
    # The first of each allocates the buffer and is left out of the figures.
    w = pdcp.FileSystemWriter(os.path.join(tmp, "async-pinmem"), stage=args.stage)
    snaps, snap_starts, snap_allocs, runs, starts, allocs = [], [], [], [], [], []
    for _ in range(args.repeat + 1):
        snaps.append(snapshot_once(w, snap_starts, snap_allocs))
        runs.append(async_once("pinmem", w, starts, allocs))
    w.close()
    by_rank = g.gather((snaps, snap_starts, snap_allocs, allocs))
    snap_runs = [max(r[0][i] for r in by_rank) for i in range(len(snaps))]  # the slowest rank's
    # The best run but the first, each run's time the slowest rank's: the statistic of the
    # return's figure below, so that the target's ratio compares like with like. (Each rank's
    # best, then the slowest of those, is lower: on one GPU that 4 ranks share, the ranks' best
    # runs fall in different runs, and that figure came out 0.6 to 0.9 ms under the best run's
    # own, about 1.4 ms against 2.1 to 2.4, on an H100 with 4 ranks and 2 GiB.)
    snap = min(snap_runs[1:])
    results["snapshot"] = report(
        "snapshot_alone", snap, allb, staged=args.device,
        runs_ms=[round(1e3 * x, 2) for x in snap_runs],
        start_spread_ms=spread_ms([r[1] for r in by_rank]),
        pinned_alloc_ms=round(1e3 * max(max(r[2][1:], default=0.0) for r in by_rank), 2))
    ret = {"pinmem": min(runs[1:])}
    results["pinmem_async"] = report(
        "pinmem_async_return", ret["pinmem"], allb, runs_ms=[round(1e3 * x, 2) for x in runs],
        start_spread_ms=spread_ms(g.gather(starts)),
        pinned_alloc_ms=round(1e3 * max(max(r[3][1:], default=0.0) for r in by_rank), 2),
        paired_snapshot_ratios=sorted(round(a / b, 2) for a, b in zip(runs[1:], snap_runs[1:])))
    w = dcp.FileSystemWriter(os.path.join(tmp, "async-torch"))
    starts = []
    runs = [async_once("torch", w, starts) for _ in range(args.repeat + 1)]
    ret["torch"] = min(runs[1:])
    results["torch_async"] = report("torch_async_return", ret["torch"], allb,
                                    runs_ms=[round(1e3 * x, 2) for x in runs],
                                    start_spread_ms=spread_ms(g.gather(starts)))

    # --- training loop during an async save ---------------------------------------------------
    train = None
    if not args.no_train:
        train = train_during_save(torch, dcp, pdcp, g, app, device, tmp, args.repeat, report,
                                  allb, akw, args.saves_per_loop, args.stage)

    if lead:
        targets(results, train, args)
    g.barrier()
    dist.destroy_process_group()
    return rows


def spread_ms(by_rank):
    """The largest gap, over the runs, between the ranks' start times (wall clock, one list a
    rank): how far apart the ranks began the same run."""
    return round(1e3 * max(max(r[i] for r in by_rank) - min(r[i] for r in by_rank)
                           for i in range(len(by_rank[0]))), 1)


def run_of(s):
    """One timed save or load from every rank's (wall, io seconds, CPU seconds, phases, the
    seconds before the storage layer's call, ...)."""
    return {"wall": max(x[0] for x in s), "walls": [x[0] for x in s], "io": [x[1] for x in s],
            "cpu": [x[2] for x in s], "phases": [x[3] for x in s], "before": [x[4] for x in s]}


def phase_fields(b):
    """Per rank: the whole call, DCP's own part of it (planning, the collectives that gather
    plans and results, the metadata: the call less write_data / read_data), the storage layer's
    part, its CPU seconds, and pinmem's phases inside the storage layer."""
    out = {"rank_seconds": [round(w, 3) for w in b["walls"]],
           "dcp_own_seconds": [round(w - i, 3) for w, i in zip(b["walls"], b["io"])],
           # DCP's own part before write_data / read_data (planning, its collectives), and after
           # (gathering the results, the metadata, the last collectives)
           "dcp_before_seconds": [round(x, 3) for x in b["before"]],
           "dcp_after_seconds": [round(w - i - x, 3)
                                 for w, i, x in zip(b["walls"], b["io"], b["before"])],
           "storage_seconds": [round(i, 3) for i in b["io"]],
           "cpu_seconds": [round(c, 3) for c in b["cpu"]]}
    if any(b["phases"]):
        # other: the storage layer's seconds outside the phases timed (torch.save of the
        # archives' heads, DCP's resolve_data / resolve_tensor / commit_tensor, Python)
        out["phases"] = [dict({k: round(v, 3) for k, v in sorted(p.items())},
                              other=round(i - sum(p.values()), 3)) if p else None
                         for p, i in zip(b["phases"], b["io"])]
    return out


def train_during_save(torch, dcp, pdcp, g, sd, device, tmp, repeat, report, allb, akw,
                      saves_per_loop=1, stage="auto"):
    """Seconds of the same training steps without a save and while an async_save of sd is
    written (best of `repeat` each, in turn); the slowdown in percent. akw(kind): the keywords
    of an async_save through the writer of kind; stage: pinmem's writer's (PinnedStager's)."""
    torch.manual_seed(0)
    hidden, layers, batch = 512, 4, 64
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden, device=device)
                                  for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(batch, hidden, device=device)

    # Ranks that share a GPU (more ranks than devices) time-slice its engines: their kernels
    # take turns, so each rank's loop moves with the others' launches by more than the effect
    # measured (the loop alone spread over 5 to 32 points when 4 ranks trained on one GPU). A
    # machine of one GPU a rank never does that, so there only one rank a device trains (ranks
    # r < the device count: rank r is on device r mod the count), and every rank saves. On the
    # CPU every rank trains, one thread each: that is the sharing the target is about.
    trains = not device.startswith("cuda") or g.rank < torch.cuda.device_count()

    def step():
        if not trains:
            return
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    for _ in range(5):
        step()
    writer = pdcp.FileSystemWriter(os.path.join(tmp, "async-train"), stage=stage)
    dcp.async_save(sd, storage_writer=writer, **akw("pinmem")).result()  # warm: the buffer exists
    # As many steps as the save takes, measured once
    t0 = time.perf_counter()
    fut = dcp.async_save(sd, storage_writer=writer, **akw("pinmem"))
    fut.result()
    save_s = max(g.gather(time.perf_counter() - t0))
    t0 = time.perf_counter()
    for _ in range(10):
        step()
    sync(torch, device)
    per_step = max(g.gather((time.perf_counter() - t0) / 10))
    per_loop = max(1, saves_per_loop)
    steps = max(20, int(per_loop * save_s / per_step))
    training = sum(g.gather(int(trains)))  # ranks whose loop is timed

    # The disk alone: this rank's bytes written to a file of its own as the disk's own rate is
    # measured (O_DIRECT, 16 MiB blocks, fsync), on a thread of this process (pwritev releases
    # the GIL), with nothing of DCP or pinmem. What the loop loses then is the cost of the disk
    # I/O itself on this machine (the block layer, the virtual disk's interrupts and exits on
    # the same CPUs), the floor under any writer's slowdown.
    mine = sum(t.numel() * t.element_size() for t in sd["model"].values())
    disk = None
    if mine:
        disk = Disk(os.path.join(tmp, f"disk-alone-{g.rank}"), mine)
        disk.write()  # the file exists, its blocks allocated: the loop's writes overwrite them
        if not disk.ok:
            disk = None

    twriter = dcp.FileSystemWriter(os.path.join(tmp, "async-train-torch"))
    dcp.async_save(sd, storage_writer=twriter, **akw("torch")).result()  # warm, as pinmem's

    def loop(mode):
        """The steps timed during per_loop saves one after the other (each started once the
        one before is done; the time inside each later async_save call left out, as the first
        one's is), in mode: none, save (pinmem's), torch, disk. Every rank starts per_loop
        saves, its loop over or not: DCP's collectives pair them up."""
        g.barrier()
        saves, th = [], None
        who = {"save": (writer, "pinmem"), "torch": (twriter, "torch")}.get(mode)

        def start():
            t = time.perf_counter()
            saves.append(dcp.async_save(sd, storage_writer=who[0], **akw(who[1])))
            return time.perf_counter() - t

        t0 = time.perf_counter()
        if who is not None:
            start()
        elif mode == "disk":
            th = threading.Thread(target=lambda: [disk.overwrite() for _ in range(per_loop)])
            th.start()
        t1, w1, p1 = time.perf_counter(), thread_waits(), thread_preemptions()
        inside = 0.0
        for _ in range(steps):
            step()
            if saves and len(saves) < per_loop and saves[-1].done():
                saves[-1].result()
                inside += start()
        w2, p2 = thread_waits(), thread_preemptions()
        sync(torch, device)
        t = time.perf_counter() - t1 - inside
        if w1 is not None and w2 is not None:
            waits[mode].append(w2 - w1)
        if p1 is not None and p2 is not None:
            preempted[mode].append(p2 - p1)
        while saves and len(saves) < per_loop:
            saves[-1].result()
            start()
        for f in saves:
            f.result()
        if th is not None:
            th.join()
        return max(g.gather(t)), t1 - t0

    # Runs without a save, with one, and (where O_DIRECT works) with the disk alone, in turn; the
    # median of the ratios to the run without and their middle half: on a shared machine the
    # loop's own speed drifts by more than the effect from one round to the next, and the target
    # is judged on the middle half, not on the median alone. The order within a round rotates:
    # whatever bias the order has cancels out.
    modes = ["none", "save", "torch"] + (["disk"] if disk is not None else [])
    runs = {m: [] for m in modes}
    # the training thread's waits (thread_waits) over its steps, before the closing sync
    waits = {m: [] for m in modes}
    preempted = {m: [] for m in modes}  # and the times it was preempted (thread_preemptions)
    for k in range(max(PAIRS, repeat)):
        for m in modes[k % len(modes):] + modes[:k % len(modes)]:
            runs[m].append(loop(m)[0])
    writer.close()
    if disk is not None:
        disk.remove()
    base = runs["none"]
    pct = lambda r: round(100.0 * (r - 1), 2)

    def slowdowns(during, mode):
        ratios = sorted(d / b for b, d in zip(base, during))
        n = len(ratios)
        return dict(slowdown_pct=pct(ratios[n // 2]), slowdown_q1_pct=pct(ratios[n // 4]),
                    slowdown_q3_pct=pct(ratios[(3 * n) // 4]),
                    pair_slowdowns_pct=[round(100 * (r - 1), 1) for r in ratios],
                    **switch_fields(mode))

    def switch_fields(mode):
        """The medians of the training thread's waits and preemptions over mode's runs."""
        out = {}
        for key, got in (("thread_waits", waits[mode]), ("thread_preemptions", preempted[mode])):
            if got:
                out[key] = sorted(got)[len(got) // 2]
        return out

    # The loop's own noise: consecutive runs without a save, compared as the pairs are
    own = sorted(b1 / b0 for b0, b1 in zip(base, base[1:]))
    report("train_no_save", sorted(base)[len(base) // 2], 0, steps=steps,
           training_ranks=training, **switch_fields("none"))
    if disk is not None:
        during = runs["disk"]
        report("train_during_disk_alone", sorted(during)[len(during) // 2], allb * per_loop,
               steps=steps,
               **slowdowns(during, "disk"))
    during = runs["torch"]
    report("train_during_torch_async_save", sorted(during)[len(during) // 2], allb * per_loop,
           steps=steps,
           **slowdowns(during, "torch"))
    # What the save costs the loop beyond the disk's own time, round by round: each round's runs
    # with the save and with the disk alone less each other, over the same round's run without
    # a save.
    beyond = {}
    if disk is not None:
        b = sorted((sv - dk) / b0 for b0, sv, dk in zip(base, runs["save"], runs["disk"]))
        n = len(b)
        beyond = dict(beyond_disk_pct=pct(1 + b[n // 2]), beyond_disk_q1_pct=pct(1 + b[n // 4]),
                      beyond_disk_q3_pct=pct(1 + b[(3 * n) // 4]))
    during = runs["save"]
    out = report("train_during_async_save", sorted(during)[len(during) // 2], allb * per_loop,
                 steps=steps, saves_per_loop=per_loop, save_seconds=round(save_s, 3),
                 training_ranks=training, **slowdowns(during, "save"),
                 noise_q1_pct=pct(own[len(own) // 4]), noise_q3_pct=pct(own[(3 * len(own)) // 4]),
                 **beyond)
    if disk is not None:
        out["disk_alone"] = slowdowns(runs["disk"], "disk")
    out["torch_async"] = slowdowns(runs["torch"], "torch")
    return out


def targets(r, train, args):
    out = []
    ps, ts = r["pinmem_save"]["gbps"], r["torch_save"]["gbps"]
    pl, tl = r["pinmem_load"]["gbps"], r["torch_load"]["gbps"]
    def against(row, whole, what):
        """(the disk's rate the verdict takes: the best of the disk runs right before row's
        runs, else the run's best; the text)"""
        disk = row.get("paired_disk_gbps") or whole
        rate = row["gbps"]
        text = "%.3f GB/s, %.2fx the disk's %.3f" % (rate, rate / disk, disk)
        if row.get("paired_disk_gbps"):
            text += (" (the best of the disk %ss right before these runs: %s GB/s in turn; the "
                     "disk's best over the whole run %.3f, %.2fx)" % (
                         what, ", ".join("%.3f" % x for x in row["paired_disk_runs_gbps"]),
                         whole, rate / whole))
        p = row.get("paired_disk_ratios")
        if p:
            text += "; each run against the disk run right before it: %s" % (
                ", ".join("%.2fx" % x for x in p))
        return disk, text

    if "disk_write" in r:
        dwg, drg = r["disk_write"]["gbps"], r["disk_read"]["gbps"]
        def from_memory(row):
            # beside it, not judged: the disk's writes from memory of the shard's size
            d = row.get("paired_disk_from_gbps")
            return "" if not d else (
                "; beside it (not the verdict), the disk's write from memory of the shard's size "
                "right before these runs: %.3f GB/s at best, the save %.2fx of it, each run "
                "against the one right before it: %s" % (
                    d, row["gbps"] / d,
                    ", ".join("%.2fx" % x for x in row["paired_disk_from_ratios"])))

        disk, text = against(r["pinmem_save"], dwg, "write")
        out.append(("save >= 0.9x the disk's O_DIRECT write (from the tensors' pageable "
                    "memory)", text + from_memory(r["pinmem_save"]), ps >= 0.9 * disk))
        pp = r["pinmem_save_pinned"]["gbps"]
        disk, text = against(r["pinmem_save_pinned"], dwg, "write")
        out.append(("save >= 0.9x the disk's O_DIRECT write (from the pinned snapshot, as "
                    "async_save writes; device tensors take this path through the ring)",
                    text + from_memory(r["pinmem_save_pinned"]), pp >= 0.9 * disk))
        # The verdict is against the reads into one reused buffer; the reads into memory of
        # the shard's size are printed beside it, not judged.
        di = r.get("disk_read_into")
        into = "" if di is None else (
            "; beside it (not the verdict), the disk's read into memory of the shard's size: "
            "%.3f GB/s, the load %.2fx of it%s" % (
                di["gbps"], pl / di["gbps"],
                "" if not r["pinmem_load"].get("paired_disk_into_ratios") else
                ", each run against the one right before it: %s" % ", ".join(
                    "%.2fx" % x for x in r["pinmem_load"]["paired_disk_into_ratios"])))
        disk, text = against(r["pinmem_load"], drg, "read")
        out.append(("cold load >= 0.9x the disk's O_DIRECT read", text + into, pl >= 0.9 * disk))
    else:
        out.append(("save and cold load >= 0.9x the disk's rate", "not measured (no O_DIRECT "
                    "here)", None))
    a, s = r["pinmem_async"]["seconds"], r["snapshot"]["seconds"]
    pairs = r["pinmem_async"].get("paired_snapshot_ratios")
    out.append(("async return <= 1.3x the snapshot alone", "%.2fx (%.4f s vs %.4f s; torch's "
                "async_save returns in %.4f s)%s" % (
                    a / s, a, s, r["torch_async"]["seconds"],
                    "; each return against the snapshot run right before it: " +
                    ", ".join("%.2fx" % x for x in pairs) if pairs else ""),
                a <= 1.3 * s))
    if train is not None:
        out.append(train_target(train))
    out.append(("save faster than torch's FileSystemWriter", "%.2fx (%.3f vs %.3f GB/s)"
                % (ps / ts, ps, ts), ps > ts))
    out.append(("load faster than torch's FileSystemReader", "%.2fx (%.3f vs %.3f GB/s)"
                % (pl / tl, pl, tl), pl > tl))
    say_targets(out, args)


def train_target(train):
    """The training loop's TARGET: (name, value, met: True, False or "undecided")."""
    # met only when the pairs' middle half lies below 5%, MISSED when it lies at or above;
    # UNDECIDED when it straddles 5%, when the loop's own speed (runs without a save
    # compared with each other) moves by more than the 5 points the target allows, or when
    # the loop ran more than 5% faster with a save than without (a save takes CPU and
    # memory bandwidth from the loop, never gives them: something else moved the loop)
    q1, q3 = train["slowdown_q1_pct"], train["slowdown_q3_pct"]
    n1, n3 = train["noise_q1_pct"], train["noise_q3_pct"]
    noisy = n3 - n1 > 5 or train["slowdown_pct"] < -5
    # Beside it, what the disk alone costs the loop (the same bytes written O_DIRECT on a
    # thread, no DCP, no pinmem): the part of the slowdown no writer can remove here.
    d = train.get("disk_alone")
    alone = "" if d is None else ("; the disk alone (the same bytes, O_DIRECT, no DCP): "
                                  "median %.2f%%, middle half %.1f%% to %.1f%%" % (
                                      d["slowdown_pct"], d["slowdown_q1_pct"],
                                      d["slowdown_q3_pct"]))
    alone += "" if "beyond_disk_pct" not in train else (
        "; the save beyond the disk alone, round by round: median %.2f%%, middle half %.1f%% "
        "to %.1f%%" % (train["beyond_disk_pct"], train["beyond_disk_q1_pct"],
                       train["beyond_disk_q3_pct"]))
    d = train.get("torch_async")
    alone += "" if d is None else ("; torch's async_save: median %.2f%%, middle half %.1f%% "
                                   "to %.1f%%" % (d["slowdown_pct"], d["slowdown_q1_pct"],
                                                  d["slowdown_q3_pct"]))
    who = ("" if train["training_ranks"] == train["ranks"] else
           " (the loop of %d of the %d ranks, one a GPU; every rank saves)" % (
               train["training_ranks"], train["ranks"]))
    return ("training slowdown < 5% during an async save", "median %.2f%%, middle half of %d "
            "pairs %.1f%% to %.1f%%%s; the loop alone, middle half of its runs against each other "
            "%.1f%% to %.1f%%%s" % (train["slowdown_pct"], len(train["pair_slowdowns_pct"]), q1,
                                    q3, who, n1, n3, alone),
            "undecided" if noisy or q1 < 5 <= q3 else q3 < 5)


def say_targets(out, args):
    for name, value, met in out:
        verdict = ("not measured" if met is None else "UNDECIDED" if met == "undecided"
                   else "met" if met else "MISSED")
        say("TARGET %s: %s: %s" % (name, value, verdict))
        if args.json:
            print(json.dumps(dict(ROW, case="target", target=name, value=value, met=met,
                                  device=args.device)), flush=True)


def _entry(rank, world, args, store, tmp, q):
    try:
        rank_main(rank, world, args, store, tmp)
        q.put((rank, None))
    except BaseException:
        import traceback
        q.put((rank, traceback.format_exc()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2, help="processes (default 2)")
    ap.add_argument("--size", default="1G", help="state dict bytes, all ranks (default 1G)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--dir", default=None, help="folder on the disk under test")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each case (best kept)")
    ap.add_argument("--crc32", default="torch", choices=("torch", "off"),
                    help="torch.save's CRC-32s: torch's option as it is (default: on), or off "
                    "for both writers (torch.serialization.set_crc32_options(False))")
    ap.add_argument("--io", default="auto", choices=("auto", "direct", "buffered"),
                    help="io of pinmem's writer and reader (default auto)")
    ap.add_argument("--executor", default="thread", choices=("thread", "process"),
                    help="the executor of every async_save, pinmem's and torch's alike: torch's "
                         "thread (default) or process executor (the save in a process of its "
                         "own, the snapshot sent through shared memory)")
    ap.add_argument("--plan-caching", action="store_true",
                    help="every async_save of a writer (pinmem's, torch's) given one planner kept "
                         "across its saves, DefaultSavePlanner(enable_plan_caching=True): the "
                         "plans are made once, as a training loop's periodic saves can")
    ap.add_argument("--saves-per-loop", type=int, default=1, metavar="K",
                    help="each timed loop of the training target spans K async saves, one after "
                         "the other (and K of the disk's writes): K times the steps, less of "
                         "the loop's own noise in each run (default 1)")
    ap.add_argument("--stage", default="auto", choices=("auto", "device", "host"),
                    help="the snapshot of pinmem's async_saves (its writer's stage, PinnedStager): "
                         "auto (default: on the device where it fits), device, or host (one "
                         "pinned buffer; with the process executor the save's process then needs "
                         "no CUDA IPC)")
    ap.add_argument("--switch-interval", type=float, default=None, metavar="S",
                    help="sys.setswitchinterval(S) in every rank (Python's default: 0.005 s): how "
                         "long a thread that holds the interpreter lock keeps it from one that "
                         "waits")
    ap.add_argument("--device-copies", default="gathered", choices=("gathered", "pieces"),
                    help="how pinmem's writer takes device tensors to the file (dcp.save from the "
                         "tensors; async_save's snapshot is pinned host memory): gathered, one "
                         "pinmem call a group copying and CRC'ing in pinmem's threads (default), "
                         "or pieces, each 16 MiB piece copied, waited for and CRC'd from Python "
                         "(_FileOut.DEVICE_GATHER off)")
    loop = ap.add_mutually_exclusive_group()
    loop.add_argument("--no-train", action="store_true", help="skip the training loop")
    loop.add_argument("--train-only", action="store_true",
                      help="only the training loop during an async save, and its TARGET line")
    ap.add_argument("--json", action="store_true", help="one JSON object per result on stdout")
    args = ap.parse_args()
    try:
        import torch  # noqa: F401
        import pinmem.dcp  # noqa: F401
    except ImportError as e:
        say("compare_dcp: skipped: %s (pip install torch; PYTHONPATH to pinmem's build)" % e)
        return 0
    tmp = tempfile.mkdtemp(prefix="pinmem-dcp.", dir=args.dir)
    store = os.path.join(tmp, "store")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, args.ranks, args, store, tmp, q))
             for r in range(args.ranks)]
    try:
        for p in procs:
            p.start()
        failed = False
        for _ in procs:
            rank, err = q.get()
            if err:
                say("compare_dcp: rank %d failed:\n%s" % (rank, err))
                failed = True
        for p in procs:
            p.join()
        return 1 if failed else 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
