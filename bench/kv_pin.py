#!/usr/bin/env python3
"""A KV-cache arena's pinning time: pinmem.KVBlockStore beside torch's pinned allocation of the
same size, as JSON lines.

    python3 bench/kv_pin.py [--arena 64G] [--block 2M] [--repeat 3] [--out FILE]

Rows, each the median of --repeat cold runs:
  - pinmem_first_block: KVBlockStore(...) created and its first block usable (the arena is
    pinned in chunks in the background, low ids first);
  - pinmem_whole_arena: the same store, until wait_ready() says every chunk is pinned;
  - torch_empty_pinned: torch.empty(n, dtype=uint8, pin_memory=True) (cudaHostAlloc through
    torch's caching host allocator, emptied between runs where torch can);
  - torch_pin_memory: torch.empty(n, dtype=uint8).pin_memory() (a pageable tensor pinned by a
    copy into a new pinned block; the pageable tensor's first touch is outside the timing).
Every run checks its memory: the first and last block written and read back, and for pinmem a
swap of the last block to a device tensor and back. Targets (a 64 GiB arena on a GPU): first
blocks usable in < 0.1 s, the whole arena in <= 0.05 s/GiB. The torch rows need torch with
CUDA; without it they say why they are missing.
"""
import argparse
import json
import statistics
import sys
import time

import pinmem

T_FIRST_S, T_S_PER_GIB = 0.1, 0.05


def emit(row, out):
    line = json.dumps(row)
    print(line)
    if out:
        out.write(line + "\n")
        out.flush()


def pinmem_run(torch, arena, block):
    n = arena // block
    dev = pinmem.kv_device_tensor((2, block), torch.uint8)
    dev.fill_(7)
    t0 = time.perf_counter()
    store = pinmem.KVBlockStore([dev], n)
    host = store.alloc(n)
    store.read_block(host[0])[:1]  # waits for block 0's chunk
    first = time.perf_counter() - t0
    store.wait_ready()
    whole = time.perf_counter() - t0
    store.swap_out([0], [host[-1]]).wait()
    ok = store.read_block(host[-1]) == bytes([7]) * block
    dev.zero_()
    store.swap_in([1], [host[-1]]).wait()
    ok = ok and bool((dev[1] == 7).all()) and bool((dev[0] == 0).all())
    store.close()
    return first, whole, ok


def torch_run(torch, arena, block, how):
    if how == "torch_pin_memory":
        src = torch.empty(arena, dtype=torch.uint8)
        src[::4096] = 1  # first touch outside the timing
        t0 = time.perf_counter()
        t = src.pin_memory()
    else:
        t0 = time.perf_counter()
        t = torch.empty(arena, dtype=torch.uint8, pin_memory=True)
    s = time.perf_counter() - t0
    t[:block] = 3
    t[-block:] = 5
    ok = bool(t.is_pinned()) and int(t[0]) == 3 and int(t[-1]) == 5
    del t
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty:
        empty()
    return s, ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arena", default="64G", help="arena bytes (K/M/G suffixes)")
    ap.add_argument("--block", default="2M", help="block bytes")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", help="also append the JSON lines to this file")
    args = ap.parse_args()
    arena, block = pinmem.parse_size(args.arena), pinmem.parse_size(args.block)
    arena -= arena % block
    out = open(args.out, "a") if args.out else None
    import torch
    gib = arena / (1 << 30)
    base = {"bench": "kv_pin", "bytes": arena, "backend": pinmem.backend()}

    firsts, wholes, ok = [], [], True
    for _ in range(args.repeat):
        f, w, good = pinmem_run(torch, arena, block)
        firsts.append(f)
        wholes.append(w)
        ok = ok and good
    f, w = statistics.median(firsts), statistics.median(wholes)
    emit(dict(base, case="pinmem_first_block", seconds=f, gbps=block / f / 1e9, verified=ok), out)
    emit(dict(base, case="pinmem_whole_arena", seconds=w, gbps=arena / w / 1e9, verified=ok,
              seconds_per_gib=w / gib), out)

    if not torch.cuda.is_available():
        print("torch rows: torch sees no CUDA device (pinned allocation needs one)",
              file=sys.stderr)
    else:
        for how in ("torch_empty_pinned", "torch_pin_memory"):
            times, good = [], True
            for _ in range(args.repeat):
                s, g = torch_run(torch, arena, block, how)
                times.append(s)
                good = good and g
            s = statistics.median(times)
            emit(dict(base, case=how, seconds=s, gbps=arena / s / 1e9, verified=good,
                      seconds_per_gib=s / gib), out)
    on_gpu = pinmem.backend() == "cuda" and arena >= 64 << 30
    for what, fig, met in ((f"64 GiB arena first blocks < {T_FIRST_S} s", f"{f:.4f} s",
                            f < T_FIRST_S),
                           (f"64 GiB arena whole <= {T_S_PER_GIB} s/GiB", f"{w / gib:.4f} s/GiB",
                            w / gib <= T_S_PER_GIB)):
        verdict = ("met" if met else "MISSED") if on_gpu else "(applies to a 64 GiB arena on cuda)"
        print(f"TARGET {what}: {fig}  {verdict}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
