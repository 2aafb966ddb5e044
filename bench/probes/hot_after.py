"""Why a hot read right after warm() is slower than back to back: CPU caches or an idle GPU?
Each kind of read (into device memory, into one pinned buffer, the DMA alone) timed back to back
and after each kind of pause. Usage: PYTHONPATH=build-py/python python3 bench/probes/hot_after.py
DIR (a 3 GiB file is made there and removed)."""
import json, os, sys, time
import torch, pinmem
D = sys.argv[1]
GB = 1 << 30
size = 3 * GB
p = os.path.join(D, "h.bin")
pinmem.write_file(p, torch.randint(0, 255, (size,), dtype=torch.uint8).numpy(), io="buffered").wait()
dst = torch.empty(size, dtype=torch.uint8, device="cuda")
host = pinmem.empty(size, "uint8")
small_h = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
small_d = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
def warm():
    with open(p, "rb") as f:
        while f.read(16 << 20):
            pass
def cpu_churn():  # touch 1 GiB of anonymous memory: CPU caches flushed, GPU left idle
    a = bytearray(GB); a[::4096] = b"\1" * (GB // 4096)
PRE = {
    "back_to_back": lambda: None,
    "warm": warm,
    "sleep_0.5s": lambda: time.sleep(0.5),
    "sleep_2s": lambda: time.sleep(2),
    "cpu_churn": cpu_churn,
    "warm_then_dma": lambda: (warm(), small_d.copy_(small_h, non_blocking=True), torch.cuda.synchronize()),
    "warm_then_gpu_busy": lambda: (warm(), torch.cuda._sleep(50_000_000)),  # the GPU running a kernel meanwhile
}
def timed(kind, pre):
    pre()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if kind == "device":
        pinmem.read_file(p, dst).wait()
    elif kind == "host":
        pinmem.read_file(p, host).wait()
    else:
        dst.copy_(torch.from_dlpack(host), non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0
for rnd in range(1):
    for kind in ("device", "host", "dma_only"):
        for name, pre in PRE.items():
            if kind == "dma_only" and name == "warm_then_gpu_busy":
                continue
            timed(kind, lambda: None)
            ts = sorted(timed(kind, pre) for _ in range(4))
            print(json.dumps(dict(probe="hot_after", round=rnd, kind=kind, before=name,
                                  best_gbps=round(size / ts[0] / 1e9, 2),
                                  median_gbps=round(size / ts[2] / 1e9, 2))), flush=True)
os.unlink(p)
