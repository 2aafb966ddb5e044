"""Hot reads into device memory by slot size and slots in flight, back to back and right after
a warm() pass as compare_checkpoint times them (the slots then cold in the CPU caches).
Usage: PYTHONPATH=build-py/python python3 bench/probes/hot_slots.py DIR (a 3 GiB file is made
there and removed). 14 slots is threads + 2 at the default 12 threads (the rows of
nvidia-h200-2026-12-04r-hot-slots.jsonl call it "threads+2")."""
import json, os, sys, time
import torch, pinmem
import hot_file
size = hot_file.SIZE
p = hot_file.make(sys.argv[1], "h.bin")
dst = torch.empty(size, dtype=torch.uint8, device="cuda")
def warm():
    hot_file.warm(p)
def timed(pre):
    pre()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pinmem.read_file(p, dst, io="buffered").wait()
    torch.cuda.synchronize()
    return time.perf_counter() - t0
configs = [(c, s) for c in ("2M", "4M", "8M") for s in (14, 24, 48)]
res = {}
for rnd in range(4):
    for i in range(len(configs)):
        chunk, slots = configs[(i + rnd) % len(configs)]
        pinmem.set_option("file_chunk", chunk)
        pinmem.set_option("file_slots", str(slots))
        timed(lambda: None)
        for pre_name, pre in (("back_to_back", lambda: None), ("after_warm", warm)):
            res.setdefault((chunk, slots, pre_name), []).append(timed(pre))
    pinmem.trim()
for (chunk, slots, pre_name), ts in sorted(res.items()):
    ts.sort()
    print(json.dumps(dict(probe="hot_slots", chunk=chunk, slots=slots, before=pre_name,
                          best_gbps=round(size / ts[0] / 1e9, 2),
                          median_gbps=round(size / ts[len(ts) // 2] / 1e9, 2))), flush=True)
os.unlink(p)
