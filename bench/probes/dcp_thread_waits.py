#!/usr/bin/env python3
"""DESIGN: a stand-alone probe of how often an async_save's threads make the training thread
wait for the interpreter lock, kept so the thread-executor paragraph of docs/dcp.md can be
measured again. One gloo rank holds 96 float32 tensors (SIZE in all) on the CPU or a CUDA
device; the main thread runs a launch-bound loop (40 tiny torch ops a step on its device, each
letting go of the interpreter lock and taking it back, as a GPU training loop's launches do)
while dcp.async_save (torch's thread executor) writes the state dict through pinmem's writer and
through torch's, in turns. Per save it prints the main thread's waits (its voluntary context
switches over the save: each is a wait, mostly for the interpreter lock that a thread of the
save holds), the save's seconds and the loop's steps per second during the save, against the
loop alone (no waits there). The medians of ROUNDS saves each.

Each torch call a save's thread makes (a view, a detach) lets go of the lock and takes it back:
with the loop running, that is a wait of the loop's. DCP's own part (planning, the collectives,
the metadata) is measured with every tensor's bytes left out (WRITER nodata: pinmem's writer,
its add_tensor only recording where the item would go): what no storage layer can remove.

host-device (PINMEM_BACKEND=host, no GPU needed): the tensors are on the CPU, and pinmem's writer
reaches the bytes of each one of 1 MiB or more as a CUDA tensor's (_DeviceBytes), in device
memory of pinmem's host backend (copied there at the first save; later saves write those bytes),
so its device path runs: gathered (pinmem: one write_ranges call a group, the CRCs computed by
pinmem's threads) and piece by piece (pinmem-chunks: DEVICE_GATHER off, each 16 MiB piece copied,
waited for and CRC'd from Python). The hand-overs of the interpreter lock are the device path's;
the copies are the host backend's memcpy, not DMAs.

  PYTHONPATH=build-py/python python3 bench/probes/dcp_thread_waits.py [cpu|cuda|host-device]
      [SIZE_MIB] [ROUNDS]
"""
import os
import statistics
import sys
import tempfile
import time
import shutil
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from compare_dcp import thread_waits as waits  # noqa: E402


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    size = int(sys.argv[2] if len(sys.argv) > 2 else 256) << 20
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import pinmem
    import pinmem.dcp as pdcp
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    dist.init_process_group("gloo", rank=0, world_size=1)
    n = 96
    stand_in = device == "host-device"
    if stand_in:
        device = "cpu"
        if pinmem.backend() != "host":
            sys.exit("dcp_thread_waits: host-device needs PINMEM_BACKEND=host")
        on_device, host_raw = {}, pdcp._raw

        def device_raw(t):
            nb = t.numel() * t.element_size()
            if nb < pdcp.SMALL:
                return host_raw(t)
            d = on_device.get((t.data_ptr(), nb))
            if d is None:
                d = on_device[(t.data_ptr(), nb)] = pinmem.device_empty(nb, "uint8")
                pinmem.copy(d, host_raw(t)).wait()
            return pdcp._DeviceBytes(d.ptr, nb, d)
        pdcp._raw = device_raw
        pdcp.FileSystemWriter._stream_for = lambda self, synced: (lambda t: None)
    sd = {"model": {f"w{i}": torch.randn(size // n // 4, device=device) for i in range(n)}}
    a = torch.zeros(16, device=device)
    b = torch.ones(16, device=device)

    def step():
        for _ in range(40):
            a.add_(b)

    def during(writer):
        fut = dcp.async_save(sd, storage_writer=writer)
        w0, t0, steps = waits(), time.perf_counter(), 0
        while not fut.done():
            step()
            steps += 1
        fut.result()
        t = time.perf_counter() - t0
        return waits() - w0, t, steps / t

    def alone(seconds):
        w0, t0, steps = waits(), time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            step()
            steps += 1
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return waits() - w0, steps / (time.perf_counter() - t0)

    tmp = tempfile.mkdtemp(prefix="pinmem-waits.", dir=os.environ.get("TMPDIR"))
    real_add = pdcp._FileOut.add_tensor

    def nodata(self, item, t):
        self.results.append(pdcp._result(item, self.name, self.pos, 0))

    writers = {
        "pinmem": pdcp.FileSystemWriter(os.path.join(tmp, "pinmem")),
        "torch": dcp.FileSystemWriter(os.path.join(tmp, "torch")),
        "nodata": pdcp.FileSystemWriter(os.path.join(tmp, "nodata")),
    }
    if stand_in or device.startswith("cuda"):
        writers["pinmem-chunks"] = pdcp.FileSystemWriter(os.path.join(tmp, "chunks"))
    print("dcp_thread_waits: %s, %d tensors, %.0f MiB, pinmem %s backend, torch %s, %d CPUs, "
          "thread executor" % ("host-device" if stand_in else device, n, size / 2**20,
                               pinmem.backend(), torch.__version__, os.cpu_count()), flush=True)
    got = {k: [] for k in writers}
    try:
        for k in range(rounds + 1):  # the first round warms each writer up, left out
            for name, w in writers.items():
                pdcp._FileOut.add_tensor = nodata if name == "nodata" else real_add
                pdcp._FileOut.DEVICE_GATHER = name != "pinmem-chunks"
                r = during(w)
                if k:
                    got[name].append(r)
        pdcp._FileOut.add_tensor = real_add
        base = alone(statistics.median(r[1] for r in got["pinmem"]))
        print("  loop alone: %d waits, %.0f steps/s" % base)
        for name, rs in got.items():
            print("  %-13s waits per save %5d (%s), save %.3f s, loop %.0f steps/s during it" % (
                name, statistics.median(r[0] for r in rs), " ".join(str(r[0]) for r in rs),
                statistics.median(r[1] for r in rs), statistics.median(r[2] for r in rs)))
    finally:
        pdcp._FileOut.add_tensor = real_add
        for w in writers.values():
            if hasattr(w, "close"):
                w.close()
        dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
