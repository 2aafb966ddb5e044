"""Where a hot load_file loses against the C bench: DMA alignment, the read's file offset,
how the file came into the page cache, and load_file's own overhead. Usage:
PYTHONPATH=build-py/python python3 bench/probes/hot_align.py DIR (files made there, removed)."""
import json, os, sys, time
import torch, pinmem, pinmem.safetensors as ps
D = sys.argv[1]
GB = 1 << 30
dev = torch.device("cuda")
def best(fn, n=5):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    return min(ts), sorted(ts)[len(ts) // 2]
def out(**kw):
    print(json.dumps(kw), flush=True)
# 1. DMA: pinned -> device, relative alignments
n = 1 * GB
h = torch.empty(n + 8192, dtype=torch.uint8).pin_memory()
d = torch.empty(n + 8192, dtype=torch.uint8, device=dev)
for ho, do in [(0, 0), (8, 8), (0, 8), (8, 0), (0, 4088), (4088, 0), (64, 0), (0, 64)]:
    b, m = best(lambda: d[do:do + n].copy_(h[ho:ho + n], non_blocking=True))
    out(probe="dma", host_off=ho, dev_off=do, best_gbps=round(n / b / 1e9, 2), median_gbps=round(n / m / 1e9, 2))
del h, d
# 2. files: buffered write vs O_DIRECT write then warmed by reads
size = 3 * GB
buf = torch.randint(0, 255, (size + (2 << 20),), dtype=torch.uint8)
pb = buf.numpy()
p_buf = os.path.join(D, "w_buffered.bin"); p_dir = os.path.join(D, "w_direct.bin")
pinmem.write_file(p_buf, pb, io="buffered").wait()
pinmem.write_file(p_dir, pb, io="direct", fsync=True).wait()
def warm(p):
    with open(p, "rb") as f:
        while f.read(16 << 20):
            pass
warm(p_dir)
dst = torch.empty(size + 8192, dtype=torch.uint8, device=dev)
for name, p in [("buffered_write", p_buf), ("direct_write_then_read", p_dir)]:
    for off in (0, 8, 4088, 1 << 20):
        b, m = best(lambda: pinmem.read_file(p, dst[:size], off, io="buffered").wait())
        out(probe="read_file_hot", file=name, offset=off, best_gbps=round(size / b / 1e9, 2), median_gbps=round(size / m / 1e9, 2))
    # warm() before each run, as compare_checkpoint does
    def wr():
        warm(p)
        torch.cuda.synchronize(); t0 = time.perf_counter(); pinmem.read_file(p, dst[:size], 8, io="buffered").wait(); torch.cuda.synchronize()
        return time.perf_counter() - t0
    ts = sorted(wr() for _ in range(5))
    out(probe="read_file_hot_after_warm", file=name, offset=8, best_gbps=round(size / ts[0] / 1e9, 2), median_gbps=round(size / ts[2] / 1e9, 2))
del dst
os.unlink(p_buf); os.unlink(p_dir)
# 3. load_file vs read_file of its data region (96 x 32 MiB bf16)
ts = {f"w{i}": torch.randn(4096, 4096, dtype=torch.bfloat16, device=dev) for i in range(96)}
p = os.path.join(D, "ck.safetensors")
ps.save_file(ts, p)
del ts
warm(p)
with open(p, "rb") as f:
    hl = int.from_bytes(f.read(8), "little")
start, total = 8 + hl, os.path.getsize(p) - 8 - hl
b, m = best(lambda: ps.load_file(p, device="cuda"))
out(probe="load_file_hot", start=start, best_gbps=round(total / b / 1e9, 2), median_gbps=round(total / m / 1e9, 2))
dst = torch.empty(total, dtype=torch.uint8, device=dev)
b, m = best(lambda: pinmem.read_file(p, dst, start).wait())
out(probe="read_file_region_hot", best_gbps=round(total / b / 1e9, 2), median_gbps=round(total / m / 1e9, 2))
b, m = best(lambda: pinmem.read_file(p, dst[:total - (4096 - start % 4096)], start + (4096 - start % 4096)).wait())
out(probe="read_file_region_aligned_hot", best_gbps=round(total / b / 1e9, 2), median_gbps=round(total / m / 1e9, 2))
os.unlink(p)
