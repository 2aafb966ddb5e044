#!/usr/bin/env python3
"""DESIGN: a stand-alone probe of the pinned memory PinnedStager's snapshot takes for an
optimizer's state dict: AdamW keeps a 0-d step and two moments for every parameter, so a model
of many small parameters (norms, biases) puts tens of thousands of tensors of a few bytes to a
few hundred into the snapshot beside a few large ones.

One process: a model of SMALL parameters of 16-63 floats and LARGE linear layers of 1024 x 1024
floats (4 MiB), one AdamW step, the state dict {"model", "optim"} staged by
PinnedStager(stage="host"). Printed: the tensors and their bytes, the snapshot's bytes
(stager.last["pinned"]), and what pinmem's pool handed out for it (stats(): requested_bytes, the
blocks' in_use_bytes). Checked: every snapshot tensor equals its source; the snapshot saved by
pinmem's writer and by torch's gives the same bytes for every item; torch's reader loads
pinmem's checkpoint back.

  PYTHONPATH=build-py/python python3 bench/probes/dcp_snapshot_pinned.py [--small 10000] \\
      [--large 4] [--dir DIR]
"""
import argparse
import gc
import os
import pickle
import shutil
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp

import pinmem
import pinmem.dcp as pdcp


def items(path):
    """{(fqn, offset): the item's bytes} of the checkpoint at path."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    out = {}
    for idx, info in md.storage_data.items():
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            out[(idx.fqn, tuple(idx.offset or ()))] = f.read(info.length)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", type=int, default=10000, help="small parameters")
    ap.add_argument("--large", type=int, default=4, help="linear layers of 4 MiB")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="folder for the checkpoints")
    a = ap.parse_args()
    warnings.filterwarnings("ignore", module="torch.distributed.checkpoint")
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.small = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(16 + i % 48)) for i in range(a.small)])
    model.large = torch.nn.ModuleList(
        [torch.nn.Linear(1024, 1024, bias=False) for _ in range(a.large)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    ts = list(sd["model"].values()) + [v for s in sd["optim"]["state"].values()
                                       for v in s.values() if isinstance(v, torch.Tensor)]
    data = sum(t.numel() * t.element_size() for t in ts)
    print(f"tensors {len(ts)} ({sum(t.dim() == 0 for t in ts)} 0-d), {data} bytes")
    gc.collect()
    pinmem.trim()
    s0 = pinmem.stats()
    st = pdcp.PinnedStager(stage="host")
    snap = st.stage(sd)
    s1 = pinmem.stats()
    print(f"snapshot {st.last['pinned']} bytes ({st.last['pinned'] / data:.2f}x the data); pool: "
          f"requested {s1['requested_bytes'] - s0['requested_bytes']}, "
          f"in use {s1['in_use_bytes'] - s0['in_use_bytes']}; "
          f"stage {st.last['seconds']:.3f} s")
    for k, v in sd["model"].items():
        assert torch.equal(snap["model"][k], v), k
    for pid, s in sd["optim"]["state"].items():
        for k, v in s.items():
            assert torch.equal(snap["optim"]["state"][pid][k], v), (pid, k)
    d = tempfile.mkdtemp(prefix="dcp-snapshot-pinned-", dir=a.dir)
    try:
        p, t = os.path.join(d, "pinmem"), os.path.join(d, "torch")
        dcp.save(snap, storage_writer=pdcp.FileSystemWriter(p), no_dist=True)
        dcp.save(snap, storage_writer=dcp.FileSystemWriter(t), no_dist=True)
        mine, theirs = items(p), items(t)
        assert mine.keys() == theirs.keys() and all(mine[k] == theirs[k] for k in mine)
        got = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}}
        dcp.load(got, storage_reader=dcp.FileSystemReader(p), no_dist=True)
        assert all(torch.equal(got["model"][k], v) for k, v in sd["model"].items())
        print(f"values equal; {len(mine)} items byte for byte torch's writer's; "
              "loaded by torch's reader")
    finally:
        shutil.rmtree(d)
    del snap
    st.close()


if __name__ == "__main__":
    main()
