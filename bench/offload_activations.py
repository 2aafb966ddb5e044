#!/usr/bin/env python3
"""Activation offloading: one training step (forward and backward) of a GPT-2-medium-like model,
with the tensors autograd saves kept on the GPU or moved to pinned host memory and back.

Model: 24 layers, d=1024, 16 heads, sequence 1024, vocabulary 50257, batch 8, bf16 weights and
activations, attention by scaled_dot_product_attention (q, k, v split from one projection).
Cases, all in one run, each on the same model, batch and offloaded set:

  * none               nothing offloaded (the compute time, the peak to beat)
  * save_on_cpu        torch.autograd.graph.save_on_cpu(pin_memory=True)'s own pack and unpack
                       hooks (a pinned tensor per saved tensor, copied on the compute stream)
  * per_tensor_stream  a reference written like torchtune's OffloadActivations: a pinned tensor
                       per saved tensor (torch's caching host allocator), copies on one side
                       stream, the compute stream waiting on an event when backward needs one
  * pinmem             pinmem.torch.offload_activations (pool blocks, a side stream each way,
                       prefetch ahead in reverse pack order)

Offloaded sets (the tensors each case moves; parameters and tensors under 1 MiB always stay):
  * all     every saved tensor of at least 1 MiB
  * hidden  those of the first k layers, k the most whose bytes move within the forward pass's
            compute time at the measured link rate (backward has twice the time to bring them back)

Per case: step time (median of --repeat steps, device events), peak GPU memory
(max_memory_allocated), bytes moved each way, their rate over the step. Gradients are checked
against the none case: equal bit for bit on CPU; on a GPU within bf16 rounding of the reduction
order (fused attention's backward accumulates in a non-deterministic order).

TARGETS (judged on a GPU, printed met/MISSED):
  * hidden: pinmem step <= 1.05x none, and peak <= 0.6x none
  * all:    pinmem step <= 1.1x max(none's step, the bytes each way at 50 GB/s)
  * all:    pinmem >= 2x faster than save_on_cpu

  bench/offload_activations.py [--batch 8] [--seq 1024] [--layers 24] [--d 1024] [--repeat 5]
                               [--warmup 2] [--min-bytes 1M] [--prefetch 4] [--json]
                               [--cpu --tiny]   (CPU tensors, a tiny model: checks the logic only)
"""
import argparse
import json
import statistics
import sys
import time

BENCH = "offload_activations"
LINK_GBPS = 50.0


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--min-bytes", default="1M")
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--json", action="store_true", help="one JSON object per case and set")
    p.add_argument("--cpu", action="store_true", help="CPU tensors stand in for the GPU's")
    p.add_argument("--tiny", action="store_true", help="a tiny model (with --cpu: CI)")
    a = p.parse_args(argv)
    if a.tiny:
        a.batch, a.seq, a.layers, a.d, a.heads, a.vocab = 2, 32, 3, 64, 4, 97
        a.repeat, a.warmup, a.min_bytes = 2, 1, "1K"
    return a


def build_model(torch, a, device, dtype):
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(a.d), nn.LayerNorm(a.d)
            self.qkv, self.proj = nn.Linear(a.d, 3 * a.d), nn.Linear(a.d, a.d)
            self.fc, self.out = nn.Linear(a.d, 4 * a.d), nn.Linear(4 * a.d, a.d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (z.view(b, t, a.heads, d // a.heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.pos = nn.Embedding(a.vocab, a.d), nn.Embedding(a.seq, a.d)
            self.blocks = nn.ModuleList(Block() for _ in range(a.layers))
            self.ln, self.head = nn.LayerNorm(a.d), nn.Linear(a.d, a.vocab, bias=False)

        def forward(self, idx, ctx, first_k):
            """ctx: the offloading context, entered around the first first_k blocks (all of
            the forward pass when first_k is None)."""
            whole = ctx if first_k is None else _Null()
            with whole:
                x = self.emb(idx) + self.pos.weight[: idx.shape[1]]
                for i, blk in enumerate(self.blocks):
                    if first_k is not None and i < first_k:
                        if hasattr(ctx, "prefetch_on_exit"):  # pinmem: only the last entry's
                            ctx.prefetch_on_exit = i == first_k - 1  # exit starts copies back
                        with ctx:
                            x = blk(x)
                    else:
                        x = blk(x)
                logits = self.head(self.ln(x))
                return F.cross_entropy(logits.flatten(0, 1).float(), idx.roll(-1, 1).flatten())

    torch.manual_seed(0)
    return GPT().to(device=device, dtype=dtype)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def offloadable(torch, device_type, min_bytes):
    """The rule every case uses to pick tensors (pinmem's own: big, on the device, no weight)."""
    def pick(t):
        if type(t) is not torch.Tensor or t.layout is not torch.strided:
            return False
        if t.device.type != device_type or t.numel() * t.element_size() < min_bytes:
            return False
        root = t if t._base is None else t._base
        return not (isinstance(root, torch.nn.Parameter) or (root.is_leaf and root.requires_grad))
    return pick


class Counted:
    """Bytes each way for the torch cases (pinmem counts its own)."""

    def __init__(self):
        self.d2h = self.h2d = 0


def save_on_cpu_case(torch, pick, counted):
    """save_on_cpu(pin_memory=True)'s own hooks, on the tensors `pick` selects."""
    inner = torch.autograd.graph.save_on_cpu(pin_memory=True)

    def pack(t):
        if not pick(t):
            return t
        counted.d2h += t.numel() * t.element_size()
        return ("cpu", inner.pack_hook(t))

    def unpack(p):
        if isinstance(p, tuple) and len(p) == 2 and p[0] == "cpu":
            t = inner.unpack_hook(p[1])
            counted.h2d += t.numel() * t.element_size()
            return t
        return p

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def per_tensor_stream_case(torch, pick, counted, cuda):
    """The reference: a pinned tensor per saved tensor and one side stream, as torchtune does."""
    stream = torch.cuda.Stream() if cuda else None

    def pack(t):
        if not pick(t):
            return t
        buf = torch.empty(t.size(), dtype=t.dtype, pin_memory=cuda)
        if cuda:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                buf.copy_(t, non_blocking=True)
            t.record_stream(stream)
        else:
            buf.copy_(t)
        counted.d2h += t.numel() * t.element_size()
        return ("cpu", buf, t.device)

    def unpack(p):
        if not (isinstance(p, tuple) and len(p) == 3 and p[0] == "cpu"):
            return p
        _, buf, device = p
        if cuda:
            with torch.cuda.stream(stream):
                t = buf.to(device, non_blocking=True)
            torch.cuda.current_stream().wait_stream(stream)
            t.record_stream(torch.cuda.current_stream())
        else:
            t = buf.clone()
        counted.h2d += t.numel() * t.element_size()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def run_case(torch, model, idx, make_ctx, first_k, a, cuda):
    """Warm up, then time --repeat steps; -> (median seconds, peak bytes, loss, grads, ctx)."""
    times, peak, ctx = [], 0, None
    for i in range(a.warmup + a.repeat):
        model.zero_grad(set_to_none=True)
        ctx, counted = make_ctx()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        else:
            t0 = time.perf_counter()
        loss = model(idx, ctx, first_k)
        loss.backward()
        if cuda:
            e1.record()
            torch.cuda.synchronize()
            seconds = e0.elapsed_time(e1) / 1000.0
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
        else:
            seconds = time.perf_counter() - t0
        if i >= a.warmup:
            times.append(seconds)
    grads = [p.grad.detach().clone() for p in model.parameters()]
    return statistics.median(times), peak, loss.detach(), grads, ctx, counted


def same_grads(torch, ref, got, exact):
    (lr, gr), (lg, gg) = ref, got
    if exact:
        return bool(torch.equal(lr, lg)) and all(torch.equal(x, y) for x, y in zip(gr, gg))
    ok = bool(torch.allclose(lr, lg, rtol=1e-3, atol=1e-3))
    for x, y in zip(gr, gg):
        x, y = x.float(), y.float()
        scale = x.abs().max().item() or 1.0
        ok = ok and (x - y).abs().max().item() <= 0.02 * scale
    return ok


def link_rate(torch, pinmem, cuda):
    """GB/s of one pinmem copy each way (256 MiB), the lower of the two."""
    if not cuda:
        return LINK_GBPS
    n = 256 << 20
    host = pinmem.empty((n,), "uint8")
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    rates = []
    for dst, src in ((host, dev), (dev, host)):
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pinmem.copy(dst, src).wait()
            dt = time.perf_counter() - t0
        rates.append(n / dt / 1e9)
    return min(rates)


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import torch
    except ImportError:
        print("offload_activations: torch is not installed; nothing measured")
        return 0
    import pinmem
    import pinmem.torch as pmt
    cuda = not a.cpu
    if cuda and not torch.cuda.is_available():
        print("offload_activations: torch sees no GPU (use --cpu --tiny to check the logic on "
              "CPU); nothing measured")
        return 0
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    min_bytes = pinmem.parse_size(a.min_bytes)
    model = build_model(torch, a, device, dtype)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(device)
    pick = offloadable(torch, device, min_bytes)

    def none_ctx():
        return _Null(), None

    def soc_ctx():
        c = Counted()
        return save_on_cpu_case(torch, pick, c), c

    def pts_ctx():
        c = Counted()
        return per_tensor_stream_case(torch, pick, c, cuda), c

    def pm_ctx(on_exit):
        return lambda: (pmt.offload_activations(min_bytes=min_bytes, prefetch=a.prefetch,
                                                device=device, prefetch_on_exit=on_exit), None)

    # The compute alone, and its forward part (the time D2H copies have to hide under).
    t_none, peak_none, *ref, _, _ = run_case(torch, model, idx, none_ctx, None, a, cuda)
    ref = tuple(ref)
    t_fwd = forward_seconds(torch, model, idx, a, cuda)
    rate = link_rate(torch, pinmem, cuda)
    # Bytes a layer's offload moves (pinmem's count over one step of all layers).
    probe = pmt.offload_activations(min_bytes=min_bytes, prefetch=a.prefetch, device=device,
                                    prefetch_on_exit=False)
    model.zero_grad(set_to_none=True)
    model(idx, probe, a.layers).backward()
    per_layer = probe.stats()["offloaded_bytes"] / max(1, a.layers)
    k = int(0.9 * rate * 1e9 * t_fwd // per_layer) if per_layer else a.layers
    k = max(1, min(a.layers, k))
    del probe

    rows = [dict(case="none", set="none", seconds=t_none, peak=peak_none, d2h=0, h2d=0,
                 verified=True)]
    for set_name, first_k in (("hidden", k), ("all", None)):
        # Entered around each of the first k layers, pinmem brings tensors back as it leaves
        # only after the last of them (backward needs the earlier layers' last).
        cases = (("save_on_cpu", soc_ctx), ("per_tensor_stream", pts_ctx),
                 ("pinmem", pm_ctx(first_k is None)))
        for name, make in cases:
            t, peak, loss, grads, ctx, counted = run_case(torch, model, idx, make, first_k, a,
                                                           cuda)
            if counted is None:
                s = ctx.stats()
                d2h, h2d = s["offloaded_bytes"], s["fetched_bytes"]
            else:
                d2h, h2d = counted.d2h, counted.h2d
            ok = same_grads(torch, ref, (loss, grads), exact=not cuda)
            rows.append(dict(case=name, set=set_name, seconds=t, peak=peak, d2h=d2h, h2d=h2d,
                             verified=ok, layers_offloaded=first_k or a.layers))
            if counted is None:
                rows[-1]["late_units"] = s["late_units"]
                rows[-1]["stall_seconds"] = s["stall_seconds"]
                rows[-1]["hook_seconds"] = s["hook_seconds"]
            del ctx
    report(a, rows, t_none, peak_none, t_fwd, rate, k, cuda)
    return 0 if all(r["verified"] for r in rows) else 1


def forward_seconds(torch, model, idx, a, cuda):
    times = []
    for _ in range(max(1, a.repeat)):
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(idx, _Null(), None)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del loss
    return statistics.median(times)


def report(a, rows, t_none, peak_none, t_fwd, rate, k, cuda):
    where = "GPU" if cuda else "CPU (--cpu: logic check, not a GPU figure)"
    print(f"# {BENCH}: {a.layers} layers, d={a.d}, seq {a.seq}, batch {a.batch} on {where}; "
          f"forward {t_fwd * 1e3:.2f} ms, link {rate:.1f} GB/s, hidden set = first {k} layers",
          file=sys.stderr if a.json else sys.stdout)
    by = {}
    for r in rows:
        moved = r["d2h"] + r["h2d"]
        by[(r["case"], r["set"])] = r
        out = {"bench": BENCH, "case": r["case"], "set": r["set"], "bytes": moved,
               "bytes_d2h": r["d2h"], "bytes_h2d": r["h2d"], "seconds": r["seconds"],
               "gbps": moved / r["seconds"] / 1e9 if r["seconds"] > 0 else 0.0,
               "verified": r["verified"], "peak_bytes": r["peak"],
               "step_ratio": r["seconds"] / t_none if t_none > 0 else None,
               "peak_ratio": r["peak"] / peak_none if peak_none else None,
               "device": "cuda" if cuda else "cpu"}
        for key in ("layers_offloaded", "late_units", "stall_seconds", "hook_seconds"):
            if key in r:
                out[key] = r[key]
        if a.json:
            print(json.dumps(out))
        else:
            print(f"{r['case']:>18} {r['set']:>6}  step {r['seconds'] * 1e3:9.2f} ms "
                  f"({out['step_ratio']:.3f}x)  peak {r['peak'] / 2**20:9.1f} MiB"
                  + (f" ({out['peak_ratio']:.3f}x)" if out["peak_ratio"] is not None else "")
                  + f"  d2h {r['d2h'] / 2**20:9.1f} MiB  h2d {r['h2d'] / 2**20:9.1f} MiB"
                  f"  {out['gbps']:6.1f} GB/s  verified={r['verified']}")
    say = sys.stderr if a.json else sys.stdout
    if not cuda:
        print("# targets are judged on a GPU only", file=say)
        return
    hid, all_ = by[("pinmem", "hidden")], by[("pinmem", "all")]
    soc = by[("save_on_cpu", "all")]
    transfer = max(all_["d2h"], all_["h2d"]) / (LINK_GBPS * 1e9)
    checks = [
        ("hidden: step <= 1.05x none", hid["seconds"] <= 1.05 * t_none,
         f"{hid['seconds'] / t_none:.3f}x"),
        ("hidden: peak <= 0.6x none", hid["peak"] <= 0.6 * peak_none,
         f"{hid['peak'] / peak_none:.3f}x"),
        ("all: step <= 1.1x max(compute, transfer at 50 GB/s)",
         all_["seconds"] <= 1.1 * max(t_none, transfer),
         f"{all_['seconds'] * 1e3:.2f} ms against {max(t_none, transfer) * 1e3:.2f} ms"),
        ("all: >= 2x faster than save_on_cpu", soc["seconds"] >= 2 * all_["seconds"],
         f"{soc['seconds'] / all_['seconds']:.2f}x"),
    ]
    for text, ok, value in checks:
        print(f"TARGET {text}: {value} {'met' if ok else 'MISSED'}", file=say)


if __name__ == "__main__":
    sys.exit(main())
