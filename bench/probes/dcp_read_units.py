#!/usr/bin/env python3
"""DESIGN: a stand-alone probe of the read size of pinmem.dcp's cold loads (each rank's file read
with one pinmem.read_ranges call), kept so the choice of FileSystemReader.READ_CHUNK can be
measured again. RANKS gloo ranks each save their shard of SIZE (bf16 tensors, as compare_dcp
makes them) once with pinmem's writer, then load it cold (the files' pages dropped first)
round by round, the order of the cases turned every round:

  * rule: the reader's own choice (FileSystemReader.read_shape());
  * options: pinmem's option file_direct_chunk for O_DIRECT reads (1 MiB);
  * 4m, 8m, 16m: reads of 4, 8 or 16 MiB (FileSystemReader.READ_CHUNK);
  * t2-8m, t3-8m, t4-4m, t4-8m, t6-8m, t3-16m, t8-2m, t1-16m, t2-1m, t4-1m, t4-2m: reads of 8
    MiB on 2, 3, 4 or 6 I/O threads, of 4 MiB on 4, of 16 MiB on 3, of 2 MiB on 8, of 16 MiB on
    one, of 1 MiB on 2 or 4, of 2 MiB on 4 (FileSystemReader.READ_THREADS): more reads in
    flight while other threads copy out of the slots, or one at a time as the disk's own;
  * replay, replay-t2: the pinmem.read_ranges call of the reader's own choice (that of a first
    untimed load, its destinations the same), timed outside dcp.load; the same in 8 MiB reads
    on 2 threads;
  * aligned: the reader's own choice into destinations of pages of their own (mmap); their
    first byte is page-aligned, the tensor's bytes in the file are not, so these too are read
    through pinmem's slots and copied out;
  * inplace, inplace-8m: destinations whose address is the tensor's file offset modulo 4 KiB,
    which O_DIRECT reads in place wherever a read holds bytes of that tensor alone; in pinmem's
    1 MiB reads (most reads inside one tensor) and in the reader's own (8 MiB here: most reads
    hold the end of one tensor and the start of the next, and go through the slots);
  * torch: torch's own FileSystemReader;
  * disk: no DCP: each rank reads a file of its own, written by compare_checkpoint's Disk, in
    16 MiB O_DIRECT requests, one at a time (compare_dcp's measure of the disk's read);
  * disk-ckpt: the same reads of the rank's checkpoint data file (as pinmem's writer laid it
    out on the disk).

Rank 0 prints each case's GB/s (all ranks' bytes over the slowest rank's time) per round and
the median; every load is checked against the tensors saved.

  PYTHONPATH=build-py/python python3 bench/probes/dcp_read_units.py --dir DIR \\
      [--ranks 2] [--size 1G] [--rounds 7] [--cases rule,aligned,disk]
"""
import mmap
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import pinmem.dcp as pdcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from compare_checkpoint import Disk, drop_cache, make_checkpoint, parse_size  # noqa: E402
from dcp_write_units import arguments, report  # noqa: E402  (bench/probes/)

MIB = 1 << 20
# case -> (FileSystemReader.READ_CHUNK, READ_THREADS)
CASES = {"rule": (None, None), "options": (0, None), "4m": (4 * MIB, None), "8m": (8 * MIB, None),
         "16m": (16 * MIB, None), "t2-8m": (8 * MIB, 2), "t3-8m": (8 * MIB, 3),
         "t4-4m": (4 * MIB, 4), "t4-8m": (8 * MIB, 4), "t6-8m": (8 * MIB, 6),
         "t3-16m": (16 * MIB, 3), "t8-2m": (2 * MIB, 8), "t1-16m": (16 * MIB, 1),
         "t2-1m": (MIB, 2), "t4-1m": (MIB, 4), "t4-2m": (2 * MIB, 4),
         "aligned": (None, None), "inplace": (0, None), "inplace-8m": (None, None),
         "replay": None, "replay-t2": None, "torch": None, "disk": None, "disk-ckpt": None}


def read_direct(path, buf):
    """Seconds to read the file at path in len(buf) O_DIRECT requests, one at a time."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t0 = time.perf_counter()
        at = 0
        while True:
            got = os.preadv(fd, [buf], at)
            at += got
            if got < len(buf):
                return time.perf_counter() - t0
    finally:
        os.close(fd)


def rank_main(rank, n, tmp, size, rounds, names):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29547")
    dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.set_num_threads(1)  # as torchrun sets it for several ranks a node
    shard = make_checkpoint(torch, size // n, "cpu")
    sd = {f"rank{rank}.{k}": v for k, v in shard.items()}
    mine = sum(t.numel() * t.element_size() for t in sd.values())
    folder = os.path.join(tmp, "ckpt")
    dcp.save({"model": sd}, storage_writer=pdcp.FileSystemWriter(folder))
    disk = Disk(os.path.join(tmp, f"disk.{rank}.bin"), mine)
    disk.write()
    names_now = sorted(os.listdir(folder))
    mine_file = [f for f in names_now if f.startswith(f"__{rank}_")][0]
    empty = {k: torch.empty_like(v) for k, v in sd.items()}
    # each tensor in pages of its own
    aligned = {k: torch.frombuffer(mmap.mmap(-1, v.numel() * v.element_size()),
                                   dtype=v.dtype).view(v.shape) for k, v in sd.items()}
    # each tensor in pages of its own, starting where its bytes start in the file modulo 4 KiB
    md = dcp.FileSystemReader(folder).read_metadata()
    inplace = {}
    for idx, info in md.storage_data.items():
        k = idx.fqn.split(".", 1)[1]  # "model.<key>"
        if k not in sd:
            continue
        with open(os.path.join(folder, info.relative_path), "rb") as f:
            f.seek(info.offset)
            head = f.read(4096)
        data_at = pdcp._parse_head(head, info.offset, info.length)[4]
        v = sd[k]
        nbytes = v.numel() * v.element_size()
        inplace[k] = torch.frombuffer(mmap.mmap(-1, nbytes + 4096), dtype=torch.uint8,
                                      count=nbytes, offset=data_at % 4096).view(v.dtype).view(
                                          v.shape)
    assert set(inplace) == set(sd), "dcp_read_units: the metadata does not name every tensor"
    # the reader's own read_ranges call, caught in an untimed load, for the replay cases
    calls = []
    real = pdcp._pm.read_ranges

    def catch(path, plan, **kw):
        # replayed by path: the load's open file (fd) is closed by then
        calls.append((path, plan, {k: v for k, v in kw.items() if k != "fd"}))
        return real(path, plan, **kw)

    pdcp._pm.read_ranges = catch
    try:
        dcp.load({"model": empty}, storage_reader=pdcp.FileSystemReader(folder))
    finally:
        pdcp._pm.read_ranges = real
    assert len(calls) == 1, f"dcp_read_units: {len(calls)} read_ranges calls, not one"
    times = {c: [] for c in names}
    for rnd in range(rounds):
        for c in names if rnd % 2 == 0 else names[::-1]:
            dest = {"aligned": aligned, "inplace": inplace, "inplace-8m": inplace}.get(c, empty)
            for v in dest.values():
                v.fill_(0)
            dist.barrier()
            if rank == 0:
                for name in os.listdir(folder):
                    drop_cache(os.path.join(folder, name))
            dist.barrier()
            if c == "disk":
                disk.read()  # O_DIRECT: no pages to drop; times itself
                spent = disk.reads[-1]
            elif c in ("replay", "replay-t2"):
                path, plan, kw = calls[0]
                if c == "replay-t2":
                    kw = dict(kw, chunk=8 * MIB, threads=2)
                t0 = time.perf_counter()
                pdcp._pm.read_ranges(path, plan, **kw)
                spent = time.perf_counter() - t0
                if not all(torch.equal(empty[k], sd[k]) for k in sd):
                    raise SystemExit(f"dcp_read_units: case {c} read other bytes")
            elif c == "disk-ckpt":
                spent = read_direct(os.path.join(folder, mine_file), disk.buf)
            else:
                if c == "torch":
                    reader = dcp.FileSystemReader(folder)
                else:
                    reader = pdcp.FileSystemReader(folder)
                    # on the class: read_shape() is a class method, which an instance's own
                    # attributes would not reach
                    cls = pdcp.FileSystemReader
                    kept = cls.READ_CHUNK, cls.READ_THREADS
                    cls.READ_CHUNK, cls.READ_THREADS = CASES[c]
                t0 = time.perf_counter()
                try:
                    dcp.load({"model": dest}, storage_reader=reader)
                finally:
                    if c != "torch":
                        cls.READ_CHUNK, cls.READ_THREADS = kept
                spent = time.perf_counter() - t0
                if not all(torch.equal(dest[k], sd[k]) for k in sd):
                    raise SystemExit(f"dcp_read_units: case {c} loaded other bytes")
            took = [None] * n
            dist.all_gather_object(took, spent)
            times[c].append(max(took))
    if rank == 0:
        report(times, n * mine)
    dist.destroy_process_group()


def main():
    ap = arguments(__doc__, 7)
    ap.add_argument("--cases", default=",".join(CASES),
                    help="the cases to run, comma-separated (default: all)")
    args = ap.parse_args()
    names = args.cases.split(",")
    for c in names:
        if c not in CASES:
            ap.error(f"unknown case {c!r} (cases: {', '.join(CASES)})")
    unit, threads = pdcp.FileSystemReader.read_shape()
    print(f"dcp_read_units: {args.ranks} ranks, {args.size}, {os.cpu_count()} CPUs, the rule's "
          f"reads {'of %.2f MiB' % (unit / MIB) if unit else 'as the options'} on "
          f"{threads or 'the options'} threads", flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        mp.spawn(rank_main, args=(args.ranks, tmp, parse_size(args.size), args.rounds, names),
                 nprocs=args.ranks)


if __name__ == "__main__":
    main()
