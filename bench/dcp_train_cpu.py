#!/usr/bin/env python3
"""What a background checkpoint write costs a CPU training loop, and where that CPU goes: one
process, a small MLP trained on one thread, timed (wall and CPU) without a save and while each
of these runs on a thread of the same process, in turn (--rounds rounds, the order rotating):

  * pinmem     dcp.async_save with pinmem.dcp.FileSystemWriter (its PinnedStager snapshot)
  * torch      dcp.async_save with torch's FileSystemWriter (and torch's stager)
  * plan       dcp.async_save with pinmem's writer told to write no bytes (each item resolved,
               an empty result for it; the metadata written and fsync'd): DCP's own part of a
               save (planning, the metadata) and the writer's around it, without the data
  * write      pinmem.write_file of the same bytes from one pinned buffer (O_DIRECT), alone
  * crc        the CRC-32 of the same bytes in that buffer (the writer's crc32: ISA-L's where the
               isal package is installed), alone: the part of the save that torch.save's format
               asks for, on the CPU whatever the writer
  * disk       the disk alone: the same bytes in 16 MiB O_DIRECT writes and an fsync, one request
               at a time (compare_checkpoint's Disk), no pinmem

Run it held to one CPU (`taskset -c 0`) to see the loop and the write share a core, as each rank
of compare_dcp.py does on a machine whose cores the ranks' loops fill. Per mode: the loop's
median slowdown against the runs without a save, and the process's CPU seconds during the loop
beyond those of a run without a save (the CPU the background work took from the loop).

  taskset -c 0 python bench/dcp_train_cpu.py [--size 512M] [--rounds 7] [--crc32 torch|off]
                                             [--dir /var/tmp] [--json]
"""
import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_checkpoint import Disk, parse_size  # noqa: E402

MODES = ("none", "pinmem", "torch", "plan", "write", "crc", "disk")


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="512M", help="state dict bytes (default 512M)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--crc32", choices=("torch", "off"), default="torch")
    ap.add_argument("--dir", default=None, help="folder on the disk under test")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    import numpy
    import torch
    import torch.distributed.checkpoint as dcp
    import pinmem
    import pinmem.dcp as pdcp
    torch.set_num_threads(1)
    if a.crc32 == "off":
        torch.serialization.set_crc32_options(False)
    total = parse_size(a.size)
    per = 5 << 20  # tensors of 5 MiB, as compare_dcp's 1 GiB over 2 ranks
    sd = {f"t{i}": torch.randn(per // 2 // 1024, 1024).to(torch.bfloat16)
          for i in range(max(1, total // per))}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(64, 512)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    class NoBytes(pdcp.FileSystemWriter):
        """pinmem's writer, less the data: every item resolved as a save resolves it, none
        written."""

        def _write_own(self, plan, planner):
            from torch.distributed.checkpoint import filesystem as fs
            from torch.distributed.checkpoint.storage import WriteResult
            results = []
            for item in plan.items:
                planner.resolve_data(item)
                results.append(WriteResult(index=item.index, size_in_bytes=0,
                                           storage_data=fs._StorageInfo("none", 0, 0)))
            fut = torch.futures.Future()
            fut.set_result(results)
            return fut

    tmp = tempfile.mkdtemp(prefix="pinmem-dcp-train-", dir=a.dir)
    try:
        writer = pdcp.FileSystemWriter(os.path.join(tmp, "pinmem"))
        nwriter = NoBytes(os.path.join(tmp, "plan"))
        twriter = dcp.FileSystemWriter(os.path.join(tmp, "torch"))
        disk = Disk(os.path.join(tmp, "disk"), nbytes)
        disk.write()
        snap = pinmem.empty((nbytes,), "uint8")
        snap_np = numpy.asarray(snap)
        snap_np[:] = 1  # touched: the CRC reads memory, not the zero page
        for _ in range(20):
            step()
        dcp.async_save(sd, storage_writer=writer).result()  # warm: the snapshot buffer exists
        dcp.async_save(sd, storage_writer=twriter).result()
        dcp.async_save(sd, storage_writer=nwriter).result()
        t0 = time.perf_counter()
        dcp.async_save(sd, storage_writer=writer).result()
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        steps = max(20, int(save_s / ((time.perf_counter() - t0) / 20)))

        def pm_write():
            pinmem.write_file(os.path.join(tmp, "write"), snap, io="direct", fsync=True)

        def crc():  # tensor by tensor, as the writer's
            c = 0
            for at in range(0, nbytes, per):
                c = pdcp._crc32(snap_np[at:at + per], c)

        alone = {"write": pm_write, "crc": crc, "disk": disk.overwrite}  # on a thread, alone

        def loop(mode):
            fut = th = None
            if mode == "pinmem":
                fut = dcp.async_save(sd, storage_writer=writer)
            elif mode == "torch":
                fut = dcp.async_save(sd, storage_writer=twriter)
            elif mode == "plan":
                fut = dcp.async_save(sd, storage_writer=nwriter)
            elif mode in alone:
                th = threading.Thread(target=alone[mode])
                th.start()
            c0, t0 = cpu_seconds(), time.perf_counter()
            for _ in range(steps):
                step()
            t, c = time.perf_counter() - t0, cpu_seconds() - c0
            if fut is not None:
                fut.result()
            if th is not None:
                th.join()
            return t, c

        runs = {m: [] for m in MODES}
        for k in range(a.rounds):
            for m in MODES[k % len(MODES):] + MODES[:k % len(MODES)]:
                runs[m].append(loop(m))
        writer.close()
        nwriter.close()
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        base_t = [t for t, _ in runs["none"]]
        base_c = med([c for _, c in runs["none"]])
        print(f"dcp_train_cpu: {nbytes / 1e6:.0f} MB in {len(sd)} tensors, crc32 {a.crc32}, "
              f"{len(os.sched_getaffinity(0))} CPU(s) allowed, {steps} steps a loop "
              f"({med(base_t):.3f} s without a save)", file=sys.stderr)
        for m in MODES[1:]:
            r = sorted(t / b for (t, _), b in zip(runs[m], base_t))
            extra = med([c for _, c in runs[m]]) - base_c
            row = dict(bench="dcp_train_cpu", mode=m, bytes=nbytes, crc32=a.crc32,
                       cpus=len(os.sched_getaffinity(0)), steps=steps,
                       slowdown_pct=round(100 * (med(r) - 1), 2),
                       slowdowns_pct=[round(100 * (v - 1), 1) for v in r],
                       extra_cpu_seconds=round(extra, 4))
            print(f"  {m:7s} slowdown median {row['slowdown_pct']:6.1f}%  "
                  f"CPU taken from the loop {extra:.3f} s", file=sys.stderr)
            if a.json:
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
