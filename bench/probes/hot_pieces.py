"""Hot reads of one file piece by piece into device memory of each piece's own, as
safetensors.safe_open's get_tensor reads a checkpoint tensor by tensor, by the unit of reads
through the page cache (file_chunk), each pass right after a warm() pass as compare_checkpoint
times loads. Also the fixed cost of one small read. Usage: PYTHONPATH=build-py/python python3
bench/probes/hot_pieces.py DIR (a 3 GiB file is made there and removed)."""
import json, os, sys, time
import torch, pinmem
import hot_file
size = hot_file.SIZE
p = hot_file.make(sys.argv[1], "pieces.bin")
def timed(piece):
    hot_file.warm(p)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fd = os.open(p, os.O_RDONLY)
    try:
        for off in range(0, size, piece):
            dst = torch.empty(piece, dtype=torch.uint8, device="cuda")
            pinmem._pinmem._file_read(fd, off, piece, dst, torch.cuda.current_stream(), "auto").wait()
    finally:
        os.close(fd)
    torch.cuda.synchronize()
    return time.perf_counter() - t0
configs = [(c, piece) for c in ("4M", "2M", "1M", "512K") for piece in (32 << 20, 8 << 20, size)]
res = {}
for rnd in range(3):
    for i in range(len(configs)):
        chunk, piece = configs[(i + rnd) % len(configs)]
        pinmem.set_option("file_chunk", chunk)
        res.setdefault((chunk, piece), []).append(timed(piece))
    pinmem.trim()
pinmem.set_option("file_chunk", "4M")
for (chunk, piece), ts in sorted(res.items()):
    ts.sort()
    print(json.dumps(dict(probe="hot_pieces", chunk=chunk, piece=piece,
                          best_gbps=round(size / ts[0] / 1e9, 2),
                          median_gbps=round(size / ts[len(ts) // 2] / 1e9, 2))), flush=True)
# The fixed cost of a call: 1000 reads of 4 KiB into one device buffer.
dst = torch.empty(4096, dtype=torch.uint8, device="cuda")
fd = os.open(p, os.O_RDONLY)
s = torch.cuda.current_stream()
t0 = time.perf_counter()
for i in range(1000):
    pinmem._pinmem._file_read(fd, i * 4096, 4096, dst, s, "auto").wait()
print(json.dumps(dict(probe="hot_pieces", case="read_4k_call_us",
                      value=round((time.perf_counter() - t0) * 1e3, 1))), flush=True)
os.close(fd)
os.unlink(p)
