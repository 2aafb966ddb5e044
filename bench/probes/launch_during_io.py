#!/usr/bin/env python3
"""DESIGN: a stand-alone probe that splits what a background write costs a launch-bound loop
on the same process, kept for the thread-executor paragraph of docs/dcp.md. The main thread
runs 40 tiny torch ops a step on the device (each a kernel launch, each letting go of the
interpreter lock and taking it back, as a GPU training loop's launches do) while one other
thread writes SIZE bytes with one pinmem.write_ranges call after another, in modes that add one
cost at a time:

  disk      pinned host memory to the file (O_DIRECT): the disk alone, no DMA
  dma       device memory to /dev/null through the page cache: the D2H DMAs into pinmem's
            slots and the I/O threads' waits for them (event queries), no disk
  dma+crc   as dma, with crc32=True: the CRCs on the I/O threads too
  full      device memory to the file (O_DIRECT) with CRCs: what the DCP writer's gathered
            device path asks of pinmem for each group

For each mode it prints the loop's steps per second against the loop alone (timed in turns
with the modes, ROUNDS rounds, medians), and the main thread's waits (voluntary context
switches: mostly the interpreter lock) and preemptions (involuntary ones: another thread took
its CPU) per second. A mode that slows the loop with no more waits or preemptions than the
loop alone points at the CUDA driver (the launches and the I/O threads' DMAs and event queries
share the process's context).

host-device (PINMEM_BACKEND=host, no GPU needed): the loop on the CPU and the host backend's
device memory, to check the probe itself; its figures say nothing of a GPU.

  PYTHONPATH=build-py/python python3 bench/probes/launch_during_io.py [cuda|host-device]
      [--size MIB] [--rounds N] [--dir DIR]
"""
import argparse
import os
import statistics
import tempfile
import threading
import time


def switches():
    """(voluntary, involuntary) context switches of the calling thread so far (Linux)."""
    out = [0, 0]
    try:
        with open("/proc/self/task/%d/status" % threading.get_native_id()) as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    out[0] = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    out[1] = int(line.split()[1])
    except OSError:
        pass
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("device", nargs="?", default="cuda", choices=("cuda", "host-device"))
    ap.add_argument("--size", type=int, default=512, help="MiB a write (default 512)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="folder on the disk under test")
    args = ap.parse_args()
    import torch
    import pinmem
    if args.device == "host-device" and pinmem.backend() != "host":
        raise SystemExit("launch_during_io: host-device needs PINMEM_BACKEND=host")
    dev = "cuda" if args.device == "cuda" else "cpu"
    n = args.size << 20
    src_dev = pinmem.device_empty(n, "uint8")
    src_host = pinmem.empty(n, "uint8")
    memoryview(src_host).cast("B")[:] = bytes([7]) * n
    pinmem.copy(src_dev, src_host).wait()
    folder = tempfile.mkdtemp(prefix="pinmem-launch.", dir=args.dir)
    path = os.path.join(folder, "out.bin")
    stream = torch.cuda.Stream() if dev == "cuda" else None
    a = torch.zeros(16, device=dev)
    b = torch.ones(16, device=dev)

    def step():
        for _ in range(40):
            a.add_(b)

    modes = {
        "disk": lambda: pinmem.write_ranges(path, [(0, src_host)], io="direct"),
        "dma": lambda: pinmem.write_ranges("/dev/null", [(0, src_dev)], io="buffered",
                                           stream=stream),
        "dma+crc": lambda: pinmem.write_ranges("/dev/null", [(0, src_dev)], io="buffered",
                                               stream=stream, crc32=True),
        "full": lambda: pinmem.write_ranges(path, [(0, src_dev)], io="direct", stream=stream,
                                            crc32=True),
    }

    def during(work):
        """The loop while work runs on a thread: (steps/s, waits/s, preemptions/s, work s)."""
        done = threading.Event()
        took = []

        def bg():
            t0 = time.perf_counter()
            work()
            took.append(time.perf_counter() - t0)
            done.set()
        th = threading.Thread(target=bg)
        s0, t0, steps = switches(), time.perf_counter(), 0
        th.start()
        while not done.is_set():
            step()
            steps += 1
        th.join()
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter() - t0
        s1 = switches()
        return steps / t, (s1[0] - s0[0]) / t, (s1[1] - s0[1]) / t, took[0]

    def alone(seconds):
        s0, t0, steps = switches(), time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            step()
            steps += 1
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter() - t0
        s1 = switches()
        return steps / t, (s1[0] - s0[0]) / t, (s1[1] - s0[1]) / t, seconds

    for _ in range(5):
        step()
    for work in modes.values():  # warm: pinmem's slots and threads, the file's blocks
        work()
    got = {k: [] for k in ["alone", *modes]}
    try:
        for _ in range(args.rounds):
            for name, work in modes.items():
                r = during(work)
                got[name].append(r)
                got["alone"].append(alone(r[3]))
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
        os.rmdir(folder)
    base = statistics.median(r[0] for r in got["alone"])
    print("launch_during_io: %s, %d MiB a write, pinmem %s backend, torch %s, %d CPUs, %d rounds"
          % (args.device, args.size, pinmem.backend(), torch.__version__, os.cpu_count(),
             args.rounds))
    for name, rs in got.items():
        med = [statistics.median(r[i] for r in rs) for i in range(4)]
        print("  %-8s loop %6.0f steps/s (%.2fx of alone), waits %6.0f/s, preemptions %6.0f/s%s"
              % (name, med[0], med[0] / base, med[1], med[2],
                 "" if name == "alone" else ", the write %.3f s (%.2f GB/s)"
                 % (med[3], n / med[3] / 1e9)))


if __name__ == "__main__":
    main()
