#!/usr/bin/env python3
"""DESIGN: a stand-alone probe of durable checkpoint writes, kept so the figures in docs/files.md
("Replacing a large file") can be measured again. Two questions, on the disk under --dir:

  patterns   which write pattern is fastest on this disk: O_DIRECT pwrite of 3 GiB from an
             aligned buffer with T threads and C-byte writes, with and without fallocate first,
             fdatasync included, beside pinmem.write_file(fsync=True) with file_threads T
             and file_write_chunk C; each case starts on a quiet disk (files removed, sync, a
             pause), and the cases rotate within each round so drift does not favour one;
  replace    what a save over an existing file costs: pinmem.safetensors.save_file and
             save_file_async of device tensors (256 MiB and 3 GiB) to the same path again and
             again, with the time the background release of the replaced file took after it;
  order      whether the place in a sequence of writes matters: a dd-like O_DIRECT single
             stream, pinmem.write_file of a filled pinned buffer and pinmem.safetensors.save_file
             (stage "host") of 3 GiB of device tensors (its snapshot, its writes and the rename
             with the folder's fsync timed apart), each to a new file, in every order across rounds,
             with and without a pause before each; each case's GB/s by its place;
  layout     whether the way a file was written (dd-like, or write_file in 1 or 8 MiB units)
             changes how fast it reads back cold, dd-like and through pinmem.read_file;
  sources    whether the memory written from matters: 12 threads of 8 MiB O_DIRECT writes
             after fallocate from one reused 64 MiB block, from a 3 GiB pinned buffer, from a
             3 GiB pageable one, from a 112 MiB ring of either, from a 16 MiB pageable ring
             and through the whole 64 MiB block, beside pinmem.write_file from the pinned and
             the pageable buffer and from device memory (through its ring of pinned slots of
             8 MiB down to 512 KiB), and save_file
             with stage "host" (a pinned snapshot, in two pieces or one) and "device" (from a
             scratch on the device, through the slots), rotated within each round;
             --cases picks some;
  reads      which O_DIRECT read pattern reads a cold file fastest: a dd-like stream of 16 MiB
             reads, raw threaded preads (1, 4, 12 threads of 1, 8, 16 MiB), pinmem.read_file
             in 8 down to 1 MiB slots with the default and 4 threads, and
             safetensors.load_file, rotated within each round; --cases picks some, --bytes
             sets the file's size; with --pairs, the two cases named in --cases read one
             right after the other, their order swapped every round, each case's GB/s
             reported by its place (first or second), as compare_checkpoint measures the
             disk right before each pinmem cold load.

  PYTHONPATH=build-py/python python3 bench/probes/save_writes.py \
      patterns|replace|order|sources|layout|reads [--pairs] --dir DIR
One JSON line per case on stdout (GB/s of each round, and the median).
"""
import argparse
import ctypes
import json
import mmap
import os
import sys
import threading
import time

import numpy as np

import pinmem
import pinmem.safetensors as ps

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from compare_checkpoint import drop_cache, parse_size  # noqa: E402  (bench/, beside probes/)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def quiet(d):
    for f in os.listdir(d):
        os.unlink(os.path.join(d, f))
    os.sync()  # the journal commit with the removed files' discards, now
    time.sleep(0.3)


def parallel(n, threads, work):
    """work(k) for k in 0..n-1, each taken by the next free one of `threads` threads."""
    nxt, lock = [0], threading.Lock()

    def worker():
        while True:
            with lock:
                k = nxt[0]
                nxt[0] += 1
            if k >= n:
                return
            work(k)
    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def raw_write(d, total, threads, chunk, falloc, block, slide=False):
    fd = os.open(os.path.join(d, "raw.bin"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    t0 = time.perf_counter()
    if falloc and _libc.fallocate(fd, 0, 0, total) != 0:
        raise OSError(ctypes.get_errno(), "fallocate")

    def write(k):
        # slide: through the block in turn (a whole file's bytes, or a ring reused), else
        # always its start
        at = (k * chunk) % len(block) if slide else 0
        os.pwrite(fd, block[at:at + min(chunk, total - k * chunk)], k * chunk)
    parallel(-(-total // chunk), threads, write)
    os.fdatasync(fd)
    seconds = time.perf_counter() - t0
    os.close(fd)
    return seconds


def patterns(d, rounds):
    total = 3 << 30
    block = mmap.mmap(-1, 64 << 20)
    block.write(os.urandom(1 << 20) * 64)
    block = memoryview(block)
    src = pinmem.empty(total, "uint8")
    np.asarray(src)[:] = 7
    mib = 1 << 20
    cases = [("raw", 1, 16 * mib, 0), ("raw", 12, 8 * mib, 1), ("raw", 4, 8 * mib, 1),
             ("raw", 2, 16 * mib, 1), ("raw", 12, 8 * mib, 0), ("raw", 2, 8 * mib, 0),
             ("pinmem", 12, 8 * mib, 1), ("pinmem", 4, 8 * mib, 1), ("pinmem", 2, 16 * mib, 1),
             ("pinmem", 1, 16 * mib, 1)]
    out = {c: [] for c in cases}
    for _ in range(rounds):
        for c in cases:
            quiet(d)
            kind, threads, chunk, falloc = c
            if kind == "raw":
                s = raw_write(d, total, threads, chunk, falloc, block)
            else:
                pinmem.set_option("file_threads", str(threads))
                pinmem.set_option("file_write_chunk", str(chunk))
                t0 = time.perf_counter()
                pinmem.write_file(os.path.join(d, "pm.bin"), src, fsync=True).wait()
                s = time.perf_counter() - t0
            out[c].append(round(total / s / 1e9, 3))
    quiet(d)
    for (kind, threads, chunk, falloc), v in out.items():
        print(json.dumps(dict(bench="save_writes", case="pattern", kind=kind, threads=threads,
                              chunk_mib=chunk // mib, fallocate=bool(falloc), bytes=total,
                              gbps=v, median=sorted(v)[len(v) // 2])), flush=True)


def replace(d, rounds):
    import torch
    for total in (256 << 20, 3 << 30):
        n = 96 if total > (1 << 30) else 8
        t = {"l%02d" % i: torch.randn(4096, total // n // 2 // 4096, dtype=torch.bfloat16,
                                      device="cuda") for i in range(n)}
        path = os.path.join(d, "ckpt.safetensors")
        for mode in ("save_file", "save_file_async"):
            for r in range(rounds):
                ps._releaser.wait_idle()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                h = getattr(ps, mode)(t, path)
                t1 = time.perf_counter()
                if h is not None:
                    h.wait()
                t2 = time.perf_counter()
                ps._releaser.wait_idle()
                t3 = time.perf_counter()
                print(json.dumps(dict(bench="save_writes", case="replace", mode=mode,
                                      bytes=total, replaced=r > 0 or mode != "save_file",
                                      returned_s=round(t1 - t0, 4), durable_s=round(t2 - t0, 4),
                                      gbps=round(total / (t2 - t0) / 1e9, 3),
                                      release_after_s=round(t3 - t2, 4))), flush=True)
        del t
    quiet(d)


def dd_write(path, total, block):
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    for k in range(-(-total // len(block))):
        os.pwrite(fd, block, k * len(block))
    os.fsync(fd)
    os.close(fd)
    return {"total_s": time.perf_counter() - t0}


def timed_save(t, path):
    """save_file (stage "host") with its parts timed: the snapshot (up to the return of its
    copies), the two pieces written and fsync'd, and the rest (hold, rename, the folder's fsync)."""
    parts = {}
    snap, pieces = ps._snapshot, ps._write_pieces

    def timed(name, fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                parts[name] = time.perf_counter() - t0
        return run
    ps._snapshot, ps._write_pieces = timed("snapshot_s", snap), timed("pieces_s", pieces)
    try:
        t0 = time.perf_counter()
        ps.save_file(t, path, stage="host")
        parts["total_s"] = time.perf_counter() - t0
    finally:
        ps._snapshot, ps._write_pieces = snap, pieces
    parts["after_s"] = parts["total_s"] - parts["snapshot_s"] - parts["pieces_s"]
    return parts


def buffers(total, block_mib):
    """3 GiB of bf16 device tensors in 96 (a checkpoint), a page-aligned block of random bytes
    and a filled pinned buffer of `total` bytes."""
    import torch
    t = {"l%02d" % i: torch.randn(4096, total // 96 // 2 // 4096, dtype=torch.bfloat16,
                                  device="cuda") for i in range(96)}
    block = mmap.mmap(-1, block_mib << 20)
    block.write(os.urandom(1 << 20) * block_mib)
    pinned = pinmem.empty(total, "uint8")
    np.asarray(pinned)[:] = 7
    return t, block, pinned


def options(fn, **opts):
    """fn run with these pinmem options set, then the ones before again."""
    def run(*args):
        before = {k: pinmem.get_option(k) for k in opts}
        for k, v in opts.items():
            pinmem.set_option(k, v)
        try:
            return fn(*args)
        finally:
            for k, v in before.items():
                pinmem.set_option(k, v)
    return run


def order(d, rounds):
    total = 3 << 30
    t, block, src = buffers(total, 16)

    def pm_write(path):
        t0 = time.perf_counter()
        pinmem.write_file(path, src, fsync=True).wait()
        return {"total_s": time.perf_counter() - t0}
    cases = {"dd": lambda p: dd_write(p, total, block), "write_file": pm_write,
             "save_file": lambda p: timed_save(t, p)}
    names = list(cases)
    ps.save_file(t, os.path.join(d, "warm.safetensors"), stage="host")  # the pool's snapshot
    for r in range(rounds):
        pause = r % 2 == 1
        seq = names[r % 3:] + names[:r % 3]
        if (r // 3) % 2:
            seq.reverse()
        quiet(d)
        for place, name in enumerate(seq):
            if pause:
                quiet(d)
            else:
                os.sync()
            parts = cases[name](os.path.join(d, name + ".bin"))
            print(json.dumps(dict(bench="save_writes", case="order", write=name, round=r,
                                  place=place, pause=pause, bytes=total,
                                  gbps=round(total / parts["total_s"] / 1e9, 3),
                                  **{k: round(v, 4) for k, v in parts.items()})), flush=True)
    quiet(d)


def sources(d, rounds, only=None):
    import torch
    total, mib = 3 << 30, 1 << 20
    t, block, pinned = buffers(total, 64)
    pageable = mmap.mmap(-1, total)  # page-aligned, as O_DIRECT wants
    np.frombuffer(pageable, np.uint8)[:] = 7
    dev = torch.full((total,), 7, dtype=torch.uint8, device="cuda")
    pinmem.set_option("file_threads", "12")

    # The cases without a size in their name write in 8 MiB units (as before file_write_chunk
    # existed), so their figures compare with earlier results.
    def pm_write(src, chunk="8M", **opts):
        def run(path):
            t0 = time.perf_counter()
            pinmem.write_file(path, src, fsync=True).wait()
            return time.perf_counter() - t0
        return options(run, file_write_chunk=chunk, **opts)

    def save(piece, stage, chunk="8M"):
        def run(path):
            old = ps.FIRST_PIECE
            ps.FIRST_PIECE = piece
            try:
                t0 = time.perf_counter()
                ps.save_file(t, path, stage=stage)
                return time.perf_counter() - t0
            finally:
                ps.FIRST_PIECE = old
        return options(run, file_write_chunk=chunk)
    cases = {
        "raw_block": lambda p: raw_write(d, total, 12, 8 * mib, 1, memoryview(block)),
        "raw_pinned": lambda p: raw_write(d, total, 12, 8 * mib, 1, memoryview(pinned), True),
        "raw_pageable": lambda p: raw_write(d, total, 12, 8 * mib, 1, memoryview(pageable),
                                            True),
        # A ring the size of write_file's slots (14 x 8 MiB), pinned or not: size or pinning?
        "raw_pinned_ring": lambda p: raw_write(d, total, 12, 8 * mib, 1,
                                               memoryview(pinned)[:112 * mib], True),
        "raw_pageable_ring": lambda p: raw_write(d, total, 12, 8 * mib, 1,
                                                 memoryview(pageable)[:112 * mib], True),
        # How much memory the writes cycle through, pageable: 8 MiB (raw_block), 16 MiB,
        # 64 MiB: does a small, reused source explain raw_block's lead?
        "raw_pageable_ring16": lambda p: raw_write(d, total, 12, 8 * mib, 1,
                                                   memoryview(pageable)[:16 * mib], True),
        "raw_block_slide": lambda p: raw_write(d, total, 12, 8 * mib, 1, memoryview(block),
                                               True),
        "write_file_pinned": pm_write(pinned),
        "write_file_pageable": pm_write(np.frombuffer(pageable, np.uint8)),
        "write_file_device": pm_write(dev),
        # Smaller slots, so the ring write_file cycles through is 56, 28, 14 or 7 MiB, not 112;
        # and fewer threads with small slots
        "write_file_device_4m": pm_write(dev, "4M"),
        "write_file_device_2m": pm_write(dev, "2M"),
        "write_file_device_1m": pm_write(dev, "1M"),
        "write_file_device_512k": pm_write(dev, "512K"),
        "write_file_device_1m_t4": pm_write(dev, "1M", file_threads="4"),
        "write_file_pinned_1m": pm_write(pinned, "1M"),
        "save_file_host_two_pieces": save(64 << 20, "host"),
        "save_file_host_one_piece": save(1 << 62, "host"),
        "save_file_device": save(64 << 20, "device"),
        "save_file_device_2m": save(64 << 20, "device", "2M"),
        "save_file_device_1m": save(64 << 20, "device", "1M"),
    }
    names = [n for n in cases if not only or n in only]
    out = {n: [] for n in names}
    ps.save_file(t, os.path.join(d, "warm.safetensors"), stage="host")  # the pool's snapshot
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            quiet(d)
            out[name].append(round(total / cases[name](os.path.join(d, "out.bin")) / 1e9, 3))
    quiet(d)
    for name, v in out.items():
        print(json.dumps(dict(bench="save_writes", case="source", write=name, bytes=total,
                              gbps=v, median=sorted(v)[len(v) // 2])), flush=True)


def layout(d, rounds):
    """Whether the way a file was written changes how fast it reads back cold: 3 GiB written
    dd-like (one stream of 16 MiB O_DIRECT writes) and by pinmem.write_file from device memory
    in 1 MiB and in 8 MiB units (a reserved range), each then read cold dd-like (16 MiB O_DIRECT
    reads, one stream) and by pinmem.read_file into device memory; with filefrag's extent
    count."""
    import subprocess
    import torch
    total, mib = 3 << 30, 1 << 20
    dev = torch.full((total,), 7, dtype=torch.uint8, device="cuda")
    block = mmap.mmap(-1, 16 * mib)
    block.write(os.urandom(mib) * 16)
    quiet(d)
    files = {"dd": os.path.join(d, "dd.bin"), "pinmem_1m": os.path.join(d, "p1.bin"),
             "pinmem_8m": os.path.join(d, "p8.bin")}
    dd_write(files["dd"], total, block)
    for name, chunk in (("pinmem_1m", "1M"), ("pinmem_8m", "8M")):
        pinmem.set_option("file_write_chunk", chunk)
        pinmem.write_file(files[name], dev, fsync=True).wait()
    pinmem.set_option("file_write_chunk", "1M")
    os.sync()

    def dd_read(path):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        t0 = time.perf_counter()
        for k in range(total // len(block)):
            os.preadv(fd, [block], k * len(block))
        os.close(fd)
        return time.perf_counter() - t0

    def pm_read(path):
        t0 = time.perf_counter()
        pinmem.read_file(path, dev).wait()
        return time.perf_counter() - t0
    out = {(f, r): [] for f in files for r in ("dd_read", "pinmem_read")}
    for k in range(rounds):
        for f in files:
            for r, fn in (("dd_read", dd_read), ("pinmem_read", pm_read))[::1 - 2 * (k % 2)]:
                drop_cache(files[f])
                out[(f, r)].append(round(total / fn(files[f]) / 1e9, 3))
    for (f, r), v in out.items():
        try:
            frag = subprocess.run(["filefrag", files[f]], capture_output=True, text=True,
                                  timeout=30).stdout.strip().rsplit(": ", 1)[-1]
        except (OSError, subprocess.SubprocessError):
            frag = None
        print(json.dumps(dict(bench="save_writes", case="layout", written=f, read=r,
                              bytes=total, extents=frag, gbps=v,
                              median=sorted(v)[len(v) // 2])), flush=True)
    quiet(d)


def reads(d, rounds, only=None, total=3 << 30, pairs=False):
    """Which O_DIRECT read pattern reads a cold file fastest on this disk: one file of `total`
    bytes (written dd-like), read cold (fadvise + drop_caches before each read) by
      dd           one stream of 16 MiB reads (the disk row of compare_checkpoint and of
                   `pinmem bench file`),
      raw_T_C      T threads of C-byte O_DIRECT preads into one reused block (the disk's own
                   answer to parallel requests, without pinmem),
      read_file_C_tT  pinmem.read_file(io="direct") into device memory (torch, where a CUDA
                   device is; else a pinned buffer) in C-byte slots with T threads (T 0: the
                   option's default, copy_threads),
      load_file    pinmem.safetensors.load_file of a safetensors file of the same bytes, io
                   "auto" and the default options (what compare_checkpoint's cold row times),
    the cases rotating within each round. One JSON line per case: GB/s of every round and
    the median."""
    mib = 1 << 20
    block = mmap.mmap(-1, 16 * mib)
    block.write(os.urandom(mib) * 16)
    quiet(d)
    path = os.path.join(d, "cold.bin")
    dd_write(path, total, block)
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:  # then neither the device nor load_file: read_file into pinned memory
        cuda = False
    if cuda:
        dst = torch.empty(total, dtype=torch.uint8, device="cuda")
        st = {"w": torch.zeros(total // 2, dtype=torch.bfloat16, device="cuda")}
    else:
        dst = pinmem.empty(total, "uint8")
        st = {"w": np.zeros(total // 2, np.uint16)}  # (as bytes: the file's layout is the same)
    st_path = os.path.join(d, "cold.safetensors")
    ps.save_file(st, st_path)
    del st

    def dd_read(p):
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
        try:
            t0 = time.perf_counter()
            for k in range(total // len(block)):
                os.preadv(fd, [block], k * len(block))
            return time.perf_counter() - t0
        finally:
            os.close(fd)

    def raw_read(threads, chunk):
        def run(p):
            fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
            buf = memoryview(block)[:chunk]  # shared: only the disk's rate is asked
            try:
                t0 = time.perf_counter()
                parallel(-(-total // chunk), threads, lambda k: os.preadv(
                    fd, [buf[:min(chunk, total - k * chunk)]], k * chunk))
                return time.perf_counter() - t0
            finally:
                os.close(fd)
        return run

    def pm_read(chunk, threads):
        def run(p):
            t0 = time.perf_counter()
            pinmem.read_file(p, dst, io="direct").wait()
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - t0
        # io "direct": the unit is file_direct_chunk's (file_chunk's for a read that O_DIRECT
        # is refused; the row's name then says less than it seems)
        return options(run, file_direct_chunk=chunk, file_threads=str(threads))

    def load(p):
        t0 = time.perf_counter()
        out = ps.load_file(st_path, device="cuda" if cuda else "cpu")
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        del out
        return dt
    cases = {"dd": dd_read}
    for threads in (1, 4, 12):
        for c in (1, 8, 16):
            cases[f"raw_{threads}_{c}m"] = raw_read(threads, c * mib)
    for c in ("8M", "4M", "2M", "1M"):
        for threads in (0, 4):
            cases[f"read_file_{c.lower()}_t{threads}"] = pm_read(c, threads)
    if "torch" in sys.modules:  # load_file makes torch tensors
        cases["load_file"] = load
    names = [n for n in cases if not only or n in only]
    if pairs and len(names) != 2:
        raise SystemExit("--pairs: name two cases in --cases (e.g. dd,load_file)")
    out = {n: [] for n in names} if not pairs else \
        {f"{n}_{p}": [] for n in names for p in ("first", "second")}
    for r in range(rounds):
        k = r % len(names)
        for place, name in enumerate(names[k:] + names[:k]):
            how = drop_cache(st_path if name == "load_file" else path)
            key = name if not pairs else f"{name}_{('first', 'second')[place]}"
            out[key].append(round(total / cases[name](path) / 1e9, 3))
    for name, v in out.items():
        print(json.dumps(dict(bench="save_writes", case="cold_read", read=name, bytes=total,
                              cache=how, target="cuda" if cuda else "pinned host", gbps=v,
                              median=sorted(v)[len(v) // 2])), flush=True)
    quiet(d)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["patterns", "replace", "order", "sources", "layout",
                                     "reads"])
    ap.add_argument("--dir", required=True, help="an empty folder on the disk under test")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default="", help="sources, reads: a comma-separated subset")
    ap.add_argument("--bytes", default="3G", help="reads: the file's size (default 3G)")
    ap.add_argument("--pairs", action="store_true", help="reads: the two --cases in pairs, "
                    "their order swapped every round, reported by place")
    a = ap.parse_args()
    only = [c for c in a.cases.split(",") if c]
    if a.what == "sources":
        sources(a.dir, a.rounds, only)
    elif a.what == "reads":
        reads(a.dir, a.rounds, only, parse_size(a.bytes), a.pairs)
    else:
        {"patterns": patterns, "replace": replace, "order": order,
         "layout": layout}[a.what](a.dir, a.rounds)


if __name__ == "__main__":
    main()
