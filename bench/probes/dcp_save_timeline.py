#!/usr/bin/env python3
"""DESIGN: a stand-alone probe of where a dcp.save through pinmem's writer spends its time,
beside the disk's own write of the same bytes, kept so that the part of a save that is not the
disk (DCP's planning and collectives, the writer's first chunk, the metadata) can be measured
again. RANKS gloo ranks each save their shard of SIZE (bf16 tensors from their own pageable
memory, as compare_dcp makes them; with --source snapshot, from PinnedStager's pinned snapshot
of them, as async_save's background write does) with dcp.save and pinmem.dcp.FileSystemWriter
into a fresh folder, and, in turns with it, write the same bytes with compare_checkpoint's Disk (16 MiB
O_DIRECT requests, one at a time, fsync'd; every rank removes its previous file and syncs before
a barrier). One save first, untimed, allocates the writer's pinned chunks (pinmem's pool keeps
them for the next), as a training run's saves after its first find them. Every save is timed
on each rank from its start, at these marks (ms):

  * plan: write_data is called (DCP has planned the save and gathered and scattered the plans);
  * first: the writer submits its first chunk (the file created, the first FIRST bytes copied
    into pinned memory and their CRC taken), or from a snapshot its first gathered group (its
    tensors' CRCs taken);
  * drained: the last write and the fsync of the data file are done (_FileOut.close returns);
  * written: write_data returns (the folder fsync'd);
  * end: dcp.save returns (the write results gathered, the coordinator's finish: the metadata
    written, fsync'd and renamed into place; the outcome broadcast).
The coordinator (rank 0) also marks its finish's start and end (finish, finished).

Rank 0 prints every round's marks per rank, then the medians over rounds of the slowest rank's
end (the save), of the disk's time, and of each stretch between marks, and how much of the save
is not the disk's: the save over the disk, and (plan + first + end - written) over the save.

  PYTHONPATH=build-py/python python3 bench/probes/dcp_save_timeline.py --dir DIR \\
      [--ranks 2] [--size 1G] [--rounds 9] [--source tensors|snapshot]
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import pinmem.dcp as pdcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from compare_checkpoint import Disk, make_checkpoint, parse_size  # noqa: E402  (bench/)

MARKS = ("plan", "first", "drained", "written", "end")
COORDINATOR_MARKS = ("finish", "finished")


def instrument(marks):
    """Wraps the writer's steps so that each records its mark (the first time it is reached,
    in ms from marks["t0"])."""
    out, writer = pdcp._FileOut, pdcp.FileSystemWriter

    def mark(name):
        if name not in marks:
            marks[name] = 1e3 * (time.perf_counter() - marks["t0"])

    submit, close, write_data, finish = out._submit, out.close, writer.write_data, writer.finish
    flush = out._flush_group

    def _submit(self):
        if self.buf is not None and self.fill:
            mark("first")
        submit(self)

    def _flush_group(self):
        if self.group:
            mark("first")
        flush(self)

    def _close(self, fsync):
        close(self, fsync)
        marks["drained"] = 1e3 * (time.perf_counter() - marks["t0"])

    def _write_data(self, plan, planner):
        mark("plan")
        r = write_data(self, plan, planner)
        mark("written")
        return r

    def _finish(self, *a, **k):
        mark("finish")
        r = finish(self, *a, **k)
        mark("finished")
        return r

    out._submit, out.close, writer.write_data, writer.finish = (_submit, _close, _write_data,
                                                                 _finish)
    out._flush_group = _flush_group


def rank_main(rank, world, args, store, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    shard = make_checkpoint(torch, parse_size(args.size) // world, "cpu")
    app = {"model": {f"rank{rank}.{k}": v for k, v in shard.items()}}
    mine = sum(t.numel() * t.element_size() for t in shard.values())
    disk = Disk(os.path.join(tmp, f"dd.{rank}.bin"), mine)
    if args.source == "snapshot":
        app = pdcp.PinnedStager().stage(app)
    marks = {}
    instrument(marks)
    folder = os.path.join(tmp, "ckpt")
    marks["t0"] = time.perf_counter()
    dcp.save(app, storage_writer=pdcp.FileSystemWriter(folder))  # the warm-up
    saves, disks = [], []
    for _ in range(args.rounds):
        disk.clear()
        dist.barrier()
        disk.write(clear=False)
        both = [None] * world
        dist.all_gather_object(both, (disk.starts[-1], disk.writes[-1]))
        disks.append(1e3 * (max(s + w for s, w in both) - min(s for s, _ in both)))
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
            os.sync()
        dist.barrier()
        marks.clear()
        marks["t0"] = time.perf_counter()
        dcp.save(app, storage_writer=pdcp.FileSystemWriter(folder))
        marks["end"] = 1e3 * (time.perf_counter() - marks["t0"])
        saves.append({k: marks.get(k) for k in MARKS + COORDINATOR_MARKS if k in marks})
    everyone = [None] * world
    dist.all_gather_object(everyone, saves)
    if rank == 0:
        report(args, world, mine, disks, everyone)
    dist.destroy_process_group()


def report(args, world, mine, disks, everyone):
    print(f"dcp_save_timeline: {world} ranks, {mine * world / 1e9:.2f} GB in all, pinmem "
          f"writer from the {args.source}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; marks in ms from each rank's dcp.save start")
    rows = []
    for i in range(args.rounds):
        per = [everyone[r][i] for r in range(world)]
        for r, m in enumerate(per):
            print(f"  round {i} rank {r}: " + "  ".join(f"{k} {m[k]:.1f}" for k in MARKS)
                  + "".join(f"  {k} {m[k]:.1f}" for k in COORDINATOR_MARKS if k in m)
                  + (f"  (disk alone {disks[i]:.1f})" if r == 0 else ""))
        slow = max(per, key=lambda m: m["end"])
        rows.append(dict(save=slow["end"], disk=disks[i],
                         plan=statistics.median(m["plan"] for m in per),
                         first=statistics.median(m["first"] - m["plan"] for m in per),
                         writing=statistics.median(m["drained"] - m["first"] for m in per),
                         dir_fsync=statistics.median(m["written"] - m["drained"] for m in per),
                         after=statistics.median(m["end"] - m["written"] for m in per),
                         finish=per[0]["finished"] - per[0]["finish"]))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print("medians over %d rounds (stretches: the median rank of each round):" % args.rounds)
    print("  save %.1f ms, the disk alone %.1f ms: the save at %.3fx the disk's rate"
          % (med["save"], med["disk"], med["disk"] / med["save"]))
    print("  plan %.1f, first chunk %.1f, writing %.1f, folder fsync %.1f, after write_data "
          "%.1f (of it the coordinator's finish %.1f)" % (
              med["plan"], med["first"], med["writing"], med["dir_fsync"], med["after"],
              med["finish"]))
    fixed = med["plan"] + med["first"] + med["after"]
    print("  not the disk's: plan + first chunk + after = %.1f ms, %.1f%% of the save"
          % (fixed, 100 * fixed / med["save"]))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="where the files go (default: a temporary "
                   "folder under the system's default)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--size", default="1G")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--source", choices=("tensors", "snapshot"), default="tensors")
    args = p.parse_args()
    if args.ranks < 1 or args.rounds < 1:
        p.error("--ranks and --rounds must be at least 1")
    tmp = tempfile.mkdtemp(prefix="pinmem-dcp-timeline.", dir=args.dir)
    try:
        mp.spawn(rank_main, args=(args.ranks, args, os.path.join(tmp, "store"), tmp),
                 nprocs=args.ranks)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
