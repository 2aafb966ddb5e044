"""pinmem.torch.offload_activations: gradients equal to training without offload.

Every test runs on CPU tensors standing in for device tensors (pinmem's host backend: the copies
run on pinmem streams, the same pack/unpack/prefetch/budget logic as on a GPU) and again on the
GPU when torch sees one and pinmem runs its cuda backend; each GPU variant skips saying why.
Gradients are compared exactly: offloading moves bytes, so it must not change one bit.
"""
import gc
import json
import os
import subprocess
import sys

import pytest

import pinmem
from conftest import skip_unless_torch, skip_unless_torch_cuda

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(params=["cpu", "cuda"])
def dev(request):
    """The device the model runs on: 'cpu' everywhere, 'cuda' where a GPU is there."""
    if request.param == "cuda":
        skip_unless_torch_cuda()
    else:
        skip_unless_torch()
    return request.param


def _torch():
    import torch
    return torch


def make_model(dev, d=64, heads=4, layers=2, vocab=97, dtype=None, seed=0):
    """A small GPT-like transformer: attention whose q, k, v are views of one projection (saved
    views of one storage), GELU MLP, layer norms, a head; exact on CPU and GPU alike (attention
    by matmul and softmax, no fused kernels with atomics)."""
    torch = _torch()
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (d // heads) ** -0.5
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(-1)
            y = (att @ v).transpose(1, 2).reshape(b, t, d)
            x = x + self.proj(y)
            return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

        def forward(self, idx, fail_at=None, checkpoint=None):
            x = self.emb(idx)
            for i, blk in enumerate(self.blocks):
                if i == fail_at:
                    raise RuntimeError("forward failed on purpose")
                if checkpoint is None:
                    x = blk(x)
                else:
                    x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=checkpoint)
            return self.head(self.ln(x))

    torch.manual_seed(seed)
    m = GPT().to(dev)
    if dtype is not None:
        m = m.to(dtype)
    return m


def batch(dev, b=4, t=32, vocab=97, seed=1):
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (b, t + 1), generator=g)
    return idx[:, :-1].to(dev), idx[:, 1:].to(dev)


def train_step(model, data, off=None, autocast=None, checkpoint=None, compiled=None):
    """One forward and backward; -> (loss, the gradients)."""
    torch = _torch()
    idx, tgt = data
    model.zero_grad(set_to_none=True)
    fwd = compiled if compiled is not None else model
    ctx = off if off is not None else _null()
    ac = torch.autocast(idx.device.type, dtype=autocast) if autocast else _null()
    with ctx, ac:
        logits = fwd(idx) if checkpoint is None else fwd(idx, checkpoint=checkpoint)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def assert_same(a, b):
    torch = _torch()
    (la, ga), (lb, gb) = a, b
    assert torch.equal(la, lb), (la, lb)
    assert len(ga) == len(gb)
    for x, y in zip(ga, gb):
        assert x.dtype == y.dtype and torch.equal(x, y), (x - y).abs().max()


def pool_in_use():
    gc.collect()
    return pinmem.stats()["in_use_bytes"]


def sync(dev, *offs):
    """Let every copy finish and what they held go back (on a GPU the host never waited)."""
    if dev.startswith("cuda"):
        _torch().cuda.synchronize()
        pinmem.synchronize()
    for off in offs:
        off.wait()


def test_import_pinmem_leaves_torch_alone():
    out = subprocess.run([sys.executable, "-c", "import sys, pinmem; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out


@pytest.mark.parametrize("prefetch", [0, 1, 4])
def test_grads_identical(dev, prefetch):
    model, data = make_model(dev), batch(dev)
    base = pool_in_use()
    ref = train_step(model, data)
    off = pinmem.torch.offload_activations(min_bytes=4096, prefetch=prefetch, device=dev)
    got = train_step(model, data, off)
    assert_same(ref, got)
    s = off.stats()
    assert s["offloaded_units"] > 4 and s["offloaded_bytes"] > 0
    # Every storage went out once and came back once; q, k, v share one.
    assert s["fetched_units"] == s["offloaded_units"]
    assert s["fetched_bytes"] == s["offloaded_bytes"]
    assert s["shared_tensors"] > 0
    assert s["kept_by_reason"]["parameter"] > 0
    assert s["hook_seconds"] > 0
    if prefetch == 0:
        assert s["prefetched_units"] == 0
    elif prefetch == 1:  # backward asks out of pack order now and then: those come on demand
        assert 0 < s["prefetched_units"] <= s["fetched_units"]
    else:  # two ahead cover this model's order: every storage was on its way before it was needed
        assert s["prefetched_units"] == s["fetched_units"], s
    sync(dev, off)
    assert off.stats()["live_units"] == 0
    assert pool_in_use() == base


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_grads_identical_half(dev, dtype):
    torch = _torch()
    dt = getattr(torch, dtype)
    model, data = make_model(dev, dtype=dt), batch(dev)
    ref = train_step(model, data)
    off = pinmem.torch.offload_activations(min_bytes=2048, device=dev)
    got = train_step(model, data, off)
    assert_same(ref, got)
    assert off.stats()["offloaded_units"] > 0


def test_grads_identical_autocast(dev):
    torch = _torch()
    model, data = make_model(dev), batch(dev)
    ref = train_step(model, data, autocast=torch.bfloat16)
    off = pinmem.torch.offload_activations(min_bytes=2048, device=dev)
    got = train_step(model, data, off, autocast=torch.bfloat16)
    assert_same(ref, got)
    assert off.stats()["offloaded_units"] > 0
    assert off.stats()["kept_by_reason"]["predicate"] == 0
    # The weights' bf16 copies are saved like activations; is_weight_cast keeps them.
    off = pinmem.torch.offload_activations(min_bytes=2048, device=dev,
                                           keep=pinmem.torch.is_weight_cast)
    got = train_step(model, data, off, autocast=torch.bfloat16)
    assert_same(ref, got)
    s = off.stats()
    assert s["kept_by_reason"]["predicate"] > 0 and s["offloaded_units"] > 0, s
    x = torch.randn(4, 4, device=dev, requires_grad=True)
    assert not pinmem.torch.is_weight_cast(x.to(torch.bfloat16) * 2)


@pytest.mark.parametrize("reentrant", [False, True])
def test_grads_identical_checkpoint(dev, reentrant):
    model, data = make_model(dev), batch(dev)
    ref = train_step(model, data, checkpoint=reentrant)
    off = pinmem.torch.offload_activations(min_bytes=1024, device=dev)
    got = train_step(model, data, off, checkpoint=reentrant)
    assert_same(ref, got)
    s = off.stats()
    if reentrant:  # each block's input is saved through the hooks and offloaded
        assert s["offloaded_units"] >= 2, s
    else:  # checkpoint saves through hooks of its own inside; the rest is ours
        assert s["offloaded_units"] >= 1, s


def test_grads_identical_compile_eager(dev):
    torch = _torch()
    if not hasattr(torch, "compile"):
        pytest.skip("this torch has no torch.compile")
    model, data = make_model(dev), batch(dev)
    ref = train_step(model, data)
    compiled = torch.compile(model, backend="eager")
    off = pinmem.torch.offload_activations(min_bytes=4096, device=dev)
    got = train_step(model, data, off, compiled=compiled)
    assert_same(ref, got)
    assert off.stats()["offloaded_units"] > 0


def test_budget_keeps_tensors_on_device(dev, budget_guard):
    model, data = make_model(dev), batch(dev)
    ref = train_step(model, data)
    probe = pinmem.torch.offload_activations(min_bytes=4096, device=dev)
    train_step(model, data, probe)
    total = probe.stats()["offloaded_bytes"]
    del probe
    sync(dev)
    gc.collect()
    pinmem.trim()
    base = pool_in_use()
    pinmem.set_budget(pinmem.stats()["pinned_bytes"] + total // 3)
    off = pinmem.torch.offload_activations(min_bytes=4096, device=dev)
    got = train_step(model, data, off)
    assert_same(ref, got)
    s = off.stats()
    assert s["kept_by_reason"]["budget"] > 0, s
    assert s["offloaded_units"] > 0, s
    assert 0 < s["offloaded_bytes"] <= total // 3 + 4096
    assert s["fetched_units"] == s["offloaded_units"]
    sync(dev, off)
    assert pool_in_use() == base


def test_no_pinned_memory_at_all(dev, budget_guard):
    model, data = make_model(dev), batch(dev)
    ref = train_step(model, data)
    gc.collect()
    pinmem.trim()
    pinmem.set_budget(pinmem.stats()["pinned_bytes"] + 1)  # no room for any block
    off = pinmem.torch.offload_activations(min_bytes=1, device=dev)
    got = train_step(model, data, off)
    assert_same(ref, got)
    s = off.stats()
    assert s["offloaded_units"] == 0 and s["kept_by_reason"]["budget"] > 0


@pytest.fixture
def budget_guard():
    old = pinmem.budget()
    yield
    gc.collect()
    pinmem.set_budget(old)


def test_exception_inside_forward_leaks_nothing(dev):
    model, data = make_model(dev, layers=3), batch(dev)
    base = pool_in_use()
    off = pinmem.torch.offload_activations(min_bytes=1024, device=dev)
    with pytest.raises(RuntimeError, match="on purpose"):
        with off:
            model(data[0], fail_at=2)
    s = off.stats()
    assert s["offloaded_units"] > 0  # two blocks went out before the failure
    sync(dev, off)
    gc.collect()
    assert off.stats()["live_units"] == 0
    assert pinmem._pinmem._pending_copies() == 0
    assert pool_in_use() == base
    # The same object still works afterwards.
    ref = train_step(model, data)
    assert_same(ref, train_step(model, data, off))
    sync(dev, off)
    assert pool_in_use() == base


def test_thousand_steps_pool_flat(dev):
    torch = _torch()
    model = make_model(dev, d=16, heads=2, layers=1, vocab=17)
    data = batch(dev, b=2, t=8, vocab=17)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    off = pinmem.torch.offload_activations(min_bytes=256, prefetch=2, device=dev)
    marks = {}
    for step in range(1000):
        _, grads = train_step(model, data, off)
        opt.step()
        if step in (9, 999):
            sync(dev, off)
            gc.collect()
            st = pinmem.stats()
            marks[step] = (st["in_use_bytes"], st["pinned_bytes"], st["segments"],
                           off.stats()["live_units"])
    assert marks[9] == marks[999], marks
    assert marks[999][3] == 0
    s = off.stats()
    assert s["offloaded_units"] >= 1000 and s["fetched_units"] == s["offloaded_units"]


def test_views_and_double_saves_move_once(dev):
    torch = _torch()
    x = torch.randn(64, 96, device=dev, requires_grad=True)
    w = torch.randn(96, 96, device=dev, requires_grad=True)

    class SaveTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a, a.t(), a)  # one storage, three saves, one transposed
            return a * 2

        @staticmethod
        def backward(ctx, g):
            a, at, a2 = ctx.saved_tensors
            assert torch.equal(at.t(), a) and torch.equal(a2, a)
            assert at.data_ptr() == a.data_ptr()  # views of one storage again
            return g * 2 + at.t() * 0

    def run(off):
        x.grad = w.grad = None
        with off or _null():
            h = (x @ w).relu()
            y = SaveTwice.apply(h).permute(1, 0) @ x  # a saved permuted (non-contiguous) tensor
            loss = y.square().sum()
        loss.backward()
        return loss.detach(), [x.grad.clone(), w.grad.clone()]

    ref = run(None)
    off = pinmem.torch.offload_activations(min_bytes=1024, device=dev)
    got = run(off)
    assert_same(ref, got)
    s = off.stats()
    assert s["shared_tensors"] >= 2
    assert s["offloaded_tensors"] == s["offloaded_units"] + s["shared_tensors"]


def _grads(params, step, off):
    for p in params:
        p.grad = None
    with off or _null():
        loss = step()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params]


def test_memory_shared_without_a_version_counter_moves_apart(dev):
    """Tensors over one storage with version counters of their own (unsafe_chunk's parts, as
    torch's CPU GRU and LSTM cells make; x.data) are not one unit: equal version numbers say
    nothing about bytes written in place between their saves."""
    torch = _torch()
    torch.manual_seed(0)
    x = torch.randn(64, 64, device=dev, requires_grad=True)

    def step(off):
        def fwd():
            a, b = (x * 1).unsafe_chunk(2, 1)  # one storage, two counters
            a.sigmoid_()                       # saves a at version 1
            if off is not None:
                off.wait()                     # its copy has taken the storage's bytes
            b.sigmoid_()                       # saves b, also at version 1, bytes changed
            return (a * 2).sum() + (b * 3).sum()
        return _grads([x], fwd, off)

    ref = step(None)
    off = pinmem.torch.offload_activations(min_bytes=1, device=dev)
    assert_same(ref, step(off))
    assert off.stats()["shared_tensors"] == 0
    seq = torch.randn(4, 10, 8, device=dev)
    for rnn, fwd in ((torch.nn.GRU(8, 16, batch_first=True), lambda m: m(seq)[0].sum()),
                     (torch.nn.LSTMCell(8, 16), lambda m: sum(h.sum() for h in m(seq[:, 0])))):
        rnn = rnn.to(dev)
        params = list(rnn.parameters())
        ref = _grads(params, lambda: fwd(rnn), None)
        assert_same(ref, _grads(params, lambda: fwd(rnn),
                                pinmem.torch.offload_activations(min_bytes=1, device=dev)))


def test_conjugate_and_negative_views_come_back_flagged(dev):
    """x.conj() and x.conj().imag share x's bytes and only flag them: the flags come back."""
    torch = _torch()
    torch.manual_seed(0)
    a = torch.randn(64, 64, dtype=torch.complex64, device=dev, requires_grad=True)
    w = torch.randn(64, 64, dtype=torch.complex64, device=dev, requires_grad=True)
    r = torch.randn(64, 64, device=dev, requires_grad=True)

    def fwd():
        h = a * 2
        return (h.conj() * w).abs().sum() + (h.conj().imag * r).sum()
    ref = _grads([a, w, r], fwd, None)
    off = pinmem.torch.offload_activations(min_bytes=1, device=dev)
    assert_same(ref, _grads([a, w, r], fwd, off))
    assert off.stats()["offloaded_units"] > 0


def test_nested_tensors_stay(dev):
    torch = _torch()
    a = torch.randn(3, 8, device=dev, requires_grad=True)
    b = torch.randn(5, 8, device=dev, requires_grad=True)

    def fwd():
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "nested tensors are a prototype"
            nt = torch.nested.as_nested_tensor([a * 1, b * 1])
        y = (nt * nt).relu()
        return torch.cat([t.sum().view(1) for t in y.unbind()]).sum()
    ref = _grads([a, b], fwd, None)
    off = pinmem.torch.offload_activations(min_bytes=1, device=dev)
    assert_same(ref, _grads([a, b], fwd, off))
    assert off.stats()["kept_by_reason"]["layout"] > 0


_WAIT_ONCE = """
import gc, json, sys, torch, pinmem, pinmem.torch
dev = sys.argv[1]
torch.manual_seed(0)
m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh())
                          for _ in range(12)]).to(dev)
x = torch.randn(64, 256, device=dev)  # each saved activation: 64 KiB
def grads(off):
    m.zero_grad(set_to_none=True)
    with off:
        loss = m(x).sum()
    loss.backward()
    return [p.grad.clone() for p in m.parameters()]
ref = grads(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
gc.collect()
pinmem.trim()
pinmem.set_budget(pinmem.stats()["pinned_bytes"] + 4 * 65536)
waits = pinmem.stats()["budget_waits"]
off = pinmem.torch.offload_activations(min_bytes=1, device=dev)
got = grads(off)
s = off.stats()
print(json.dumps(dict(same=all(torch.equal(a, b) for a, b in zip(ref, got)),
                      waited=pinmem.stats()["budget_waits"] - waits,
                      units=s["offloaded_units"], kept=s["kept_by_reason"]["budget"])))
"""


def test_full_pool_under_budget_policy_wait_is_waited_for_once(dev):
    """budget_policy=wait: a pack that finds the pool full waits budget_timeout; the next ones
    (nothing freed meanwhile) stay at once instead of each waiting again."""
    env = dict(os.environ, PINMEM_BUDGET_POLICY="wait", PINMEM_BUDGET_TIMEOUT="0.2")
    r = subprocess.run([sys.executable, "-c", _WAIT_ONCE, dev], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["same"] and out["units"] > 0 and out["kept"] >= 10, out
    assert out["waited"] == 1, out


_WAIT_UNLOCKED = """
import json, sys, threading, time, torch, pinmem, pinmem.torch
dev = sys.argv[1]
n = 16384  # float32: each saved storage 64 KiB
torch.manual_seed(0)
wa = torch.randn(n, device=dev, requires_grad=True)
s = torch.tanh(torch.randn(n, device=dev, requires_grad=True))  # saved by two threads below
off = pinmem.torch.offload_activations(min_bytes=1, device=dev, prefetch_on_exit=False)
pinmem.trim()
pinmem.set_budget(pinmem.stats()["pinned_bytes"] + 4 * 4 * n)
base = pinmem.stats()["in_use_bytes"]
# This thread's graph: four saved storages of its own, the whole budget.
with off:
    h = wa
    for _ in range(4):
        h = torch.tanh(h)  # saves its output
    loss = h.sum()
full = off.stats()["offloaded_units"]
room = pinmem.stats()["budget"] - pinmem.stats()["pinned_bytes"]
waits = pinmem.stats()["budget_waits"]
grads = {}
# Both packs end before either thread leaves the context: leaving it ends a forward pass, and a
# storage saved in an earlier pass is moved again, not shared.
packed = threading.Barrier(2)
def save_s(fn):
    with off:
        y = fn(s)  # sin and cos save their input, s: one storage for both threads
        packed.wait(timeout=120)
    (grads[fn.__name__],) = torch.autograd.grad(y.sum(), s)
threads = [threading.Thread(target=save_s, args=(fn,)) for fn in (torch.sin, torch.cos)]
for t in threads:
    t.start()
# Until both packs wait for pinned memory (or a thread ended without waiting: the verdict
# below says so), then this thread's backward frees its four blocks.
while pinmem.stats()["budget_waits"] - waits < 2 and all(t.is_alive() for t in threads):
    time.sleep(0.001)
waited = pinmem.stats()["budget_waits"] - waits
loss.backward()
del h, loss
for t in threads:
    t.join()
if dev == "cuda":
    torch.cuda.synchronize()
    pinmem.synchronize()
off.wait()
st = off.stats()
h = wa
for _ in range(4):
    h = torch.tanh(h)
(ref_a,) = torch.autograd.grad(h.sum(), wa)
(ref_sin,) = torch.autograd.grad(torch.sin(s).sum(), s)
(ref_cos,) = torch.autograd.grad(torch.cos(s).sum(), s)
same = sorted(grads) == ["cos", "sin"] and torch.equal(wa.grad, ref_a) and \
    torch.equal(grads["sin"], ref_sin) and torch.equal(grads["cos"], ref_cos)
print(json.dumps(dict(full=full, room=room, waited=waited, same=same,
                      kept=st["kept_by_reason"]["budget"], units=st["offloaded_units"],
                      tensors=st["offloaded_tensors"], shared=st["shared_tensors"],
                      fetched=st["fetched_units"], in_use=pinmem.stats()["in_use_bytes"] - base)))
"""


def test_pack_waits_for_the_pool_without_holding_the_lock(dev):
    """budget_policy=wait, one object shared by threads: a pack waiting for pinned memory must
    not hold the object's lock, or the backward whose unpacks would free that memory waited for
    it, budget_timeout long, and the pack kept its tensor though memory came free. Two threads
    wait to save one storage: once the blocks come back, one moves it and the other shares it
    (its own new block goes back). The budget_timeout is far longer than the test needs: the
    verdict is what was kept and moved, never how long it took."""
    env = dict(os.environ, PINMEM_BUDGET_POLICY="wait", PINMEM_BUDGET_TIMEOUT="30")
    r = subprocess.run([sys.executable, "-c", _WAIT_UNLOCKED, dev], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["full"] == 4 and out["room"] == 0, out  # the first graph holds the whole budget
    assert out["waited"] == 2, out  # both packs waited inside the pool before the backward
    assert out["same"] and out["kept"] == 0, out
    assert out["units"] == 5 and out["tensors"] == 6 and out["shared"] == 1, out
    assert out["fetched"] == 5 and out["in_use"] == 0, out


def test_small_view_of_large_storage_stays(dev):
    torch = _torch()
    big = torch.randn(256, 256, device=dev)
    w = torch.randn(4, 256, device=dev, requires_grad=True)
    off = pinmem.torch.offload_activations(min_bytes=64, device=dev)
    with off:
        y = (w * big[:4]).sum()  # big[:4] is 1/64 of its storage
    y.backward()
    assert torch.equal(w.grad, big[:4])
    assert off.stats()["kept_by_reason"]["sparse_view"] == 1
    # Once the whole storage is on its way, a small view of it shares it instead.
    w.grad = None
    off.reset_stats()
    scale = torch.ones((), device=dev, requires_grad=True)
    with off:
        y = (big * scale).sum() + (w * big[:4]).sum()  # mul saves all of big for scale's grad
    y.backward()
    assert torch.equal(w.grad, big[:4]) and torch.equal(scale.grad, big.sum())
    s = off.stats()
    assert s["kept_by_reason"]["sparse_view"] == 0 and s["shared_tensors"] == 1, s


def test_storage_shared_across_entries(dev):
    """One object entered around two layers: a tensor the first saves and the second saves again
    (the residual stream) moves once."""
    torch = _torch()
    x = torch.randn(32, 64, device=dev, requires_grad=True)
    w1 = torch.randn(64, 64, device=dev, requires_grad=True)
    w2 = torch.randn(64, 64, device=dev, requires_grad=True)

    def run(off):
        x.grad = w1.grad = w2.grad = None
        h = x * 1.5
        with off or _null():
            a = h.sin() @ w1  # sin saves h; mm saves sin(h)
        with off or _null():
            b = (h * a) @ w2  # mul saves h and a
        loss = b.square().sum()
        loss.backward()
        return loss.detach(), [x.grad.clone(), w1.grad.clone(), w2.grad.clone()]

    ref = run(None)
    off = pinmem.torch.offload_activations(min_bytes=1024, device=dev, prefetch_on_exit=False)
    assert_same(ref, run(off))
    s = off.stats()
    # h and sin(h) in the first entry, h again, a and h * a in the second: h moves once.
    assert s["offloaded_units"] == 4 and s["shared_tensors"] == 1, s


def test_a_later_forward_pass_moves_a_storage_again(dev):
    """A static input refilled outside autograd keeps its version counter; with the graph of the
    step before still alive, the next step's save joined that step's copy and trained on its
    old bytes. Saves join units of their own forward pass only."""
    torch = _torch()
    torch.manual_seed(0)
    w = torch.randn(64, 64, device=dev, requires_grad=True)
    x = torch.zeros(32, 64, device=dev)  # a static input buffer

    def run(off):
        kept = []
        for fill in (1.0, 2.0):
            x.data.fill_(fill)  # written outside autograd: x._version stays
            w.grad = None
            with off or _null():
                loss = (x @ w).square().sum()
            kept.append(loss)  # the step's graph stays alive (a list of losses)
        loss.backward()
        return loss.detach(), [w.grad.clone()]

    ref = run(None)
    assert x._version == 0
    off = pinmem.torch.offload_activations(min_bytes=1024, device=dev)
    assert_same(ref, run(off))
    # x and x @ w (square saves it) in each step; nothing joins the first step's units.
    assert off.stats()["offloaded_units"] == 4 and off.stats()["shared_tensors"] == 0


def test_keep_predicate(dev):
    model, data = make_model(dev), batch(dev)
    ref = train_step(model, data)
    off = pinmem.torch.offload_activations(min_bytes=1024, device=dev,
                                           keep=lambda t: t.dim() == 4)  # attention tensors
    got = train_step(model, data, off)
    assert_same(ref, got)
    s = off.stats()
    assert s["kept_by_reason"]["predicate"] > 0 and s["offloaded_units"] > 0


def test_paused_keeps_a_module_on_device(dev):
    torch = _torch()
    model, data = make_model(dev), batch(dev)
    ref = train_step(model, data)
    off = pinmem.torch.offload_activations(min_bytes=1024, device=dev)
    model.zero_grad(set_to_none=True)
    with off:
        x = model.emb(data[0])
        x = model.blocks[0](x)
        with off.paused():  # the second block's tensors stay
            x = model.blocks[1](x)
        logits = model.head(model.ln(x))
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), data[1].flatten())
    loss.backward()
    assert_same(ref, (loss.detach(), [p.grad.clone() for p in model.parameters()]))
    s = off.stats()
    assert s["kept_by_reason"]["paused"] > 0 and s["offloaded_units"] > 0


def test_double_backward_and_retain_graph(dev):
    torch = _torch()
    model, data = make_model(dev, layers=1), batch(dev)

    def penalty(off):
        model.zero_grad(set_to_none=True)
        with off or _null():
            x = model.emb(data[0]).detach().requires_grad_()
            h = model.blocks[0](x)
            loss = h.tanh().square().mean()
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        total = loss + gx.square().sum()
        total.backward()
        return total.detach(), [p.grad.clone() for p in model.blocks.parameters()]

    ref = penalty(None)
    off = pinmem.torch.offload_activations(min_bytes=1024, device=dev)
    assert_same(ref, penalty(off))
    assert off.stats()["offloaded_units"] > 0

    def twice(off):
        model.zero_grad(set_to_none=True)
        with off or _null():
            loss = model(data[0]).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    base = pool_in_use()
    ref = twice(None)
    off = pinmem.torch.offload_activations(min_bytes=1024, device=dev)
    assert_same(ref, twice(off))
    s = off.stats()
    assert s["fetched_units"] >= 2 * s["offloaded_units"] > 0  # each came back for both
    sync(dev, off)
    assert pool_in_use() == base


def test_second_backward_scans_a_bounded_part_of_the_units(dev):
    """A second backward over a retained graph unpacks units the first one used up. Each unpack
    looks back for units to prefetch; the look-back stays within `prefetch` units a step, not
    back to the first unit packed (which made a backward of N units O(N^2))."""
    torch = _torch()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64, device=dev) for _ in range(100)]
    x = torch.randn(32, 64, device=dev)
    off = pinmem.torch.offload_activations(min_bytes=1024, device=dev)
    with off:
        h = x
        for lin in layers:
            h = lin(h).tanh()
        loss = h.square().mean()
    n = len(off._order)
    assert n >= 100

    class Counting:
        looks = 0

        def __init__(self, ref):
            self.ref = ref

        def __call__(self):
            Counting.looks += 1
            return self.ref()
    off._order = [Counting(r) for r in off._order]
    loss.backward(retain_graph=True)
    first, Counting.looks = Counting.looks, 0
    loss.backward()
    second = Counting.looks
    bound = 2 * (off.prefetch + 1) * n
    assert first <= bound, (first, n)
    assert second <= bound, (second, n)  # back to the first unit each time: n * (n + 1) / 2
    s = off.stats()
    assert s["fetched_units"] >= 2 * s["offloaded_units"] > 0
    sync(dev, off)


def test_bad_arguments():
    skip_unless_torch()
    import pinmem.torch as pt
    with pytest.raises(ValueError, match="min_bytes"):
        pt.offload_activations(min_bytes=0)
    with pytest.raises(ValueError, match="prefetch"):
        pt.offload_activations(prefetch=-1)
    with pytest.raises(TypeError, match="keep"):
        pt.offload_activations(keep=3)
    with pytest.raises(ValueError, match="device"):
        pt.offload_activations(device="xla")
    for ratio in (0.5, float("nan"), "4", True):
        with pytest.raises(ValueError, match="max_view_ratio must be a number >= 1"):
            pt.offload_activations(max_view_ratio=ratio)
    assert pt.offload_activations(max_view_ratio=float("inf")).max_view_ratio == float("inf")
    assert pt.offload_activations(min_bytes="2K").min_bytes == 2048


def test_bench_cpu_tiny():
    """The bench's logic (every case, its checks, its JSON) on a tiny CPU model."""
    skip_unless_torch()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "offload_activations.py"),
                          "--cpu", "--tiny", "--json"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    cases = {r["case"] for r in rows}
    assert {"none", "save_on_cpu", "per_tensor_stream", "pinmem"} <= cases, cases
    for r in rows:
        assert r["bench"] == "offload_activations"
        assert r["verified"] is True, r
        assert r["seconds"] > 0
        if r["case"] != "none":
            assert r["bytes"] > 0 and r["bytes_d2h"] > 0 and r["bytes_h2d"] > 0, r


@pytest.mark.parametrize("min_bytes", [1 << 30, 64])  # everything kept; everything offloaded
def test_graph_dropped_without_backward_frees_its_tensors(dev, min_bytes):
    """A saved output handed back as itself from the pack hook holds its own grad_fn: a cycle
    through autograd's C++ objects that Python's collector cannot see."""
    torch = _torch()
    import weakref
    x = torch.randn(64, 64, device=dev, requires_grad=True)
    off = pinmem.torch.offload_activations(min_bytes=min_bytes, device=dev)
    enabled = gc.isenabled()
    gc.disable()
    try:
        with off:
            y = x.exp()  # exp saves its output
            z = y.sin()
        ref = weakref.ref(y)
        del y, z
        assert ref() is None
    finally:
        if enabled:
            gc.enable()
    s = off.stats()
    assert (s["kept_tensors"] if min_bytes > 64 else s["offloaded_tensors"]) == 2


def test_cuda_needs_the_cuda_backend():
    skip_unless_torch()
    if pinmem.backend() == "cuda":
        pytest.skip("pinmem runs its cuda backend here: device='cuda' is allowed")
    with pytest.raises(pinmem.NoDeviceError, match="backend"):
        pinmem.torch.offload_activations(device="cuda")


def test_second_gpu_while_first_is_current():
    """A rank's model on its own device, here cuda:1 while cuda:0 stays current: the copies and
    waits run on that device's streams."""
    torch = skip_unless_torch_cuda()
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU: the second-device case needs two")
    model, data = make_model("cuda:1"), batch("cuda:1")
    ref = train_step(model, data)
    off = pinmem.torch.offload_activations(min_bytes=4096, device="cuda")
    got = train_step(model, data, off)
    assert_same(ref, got)
    assert off.stats()["offloaded_units"] > 0 and torch.cuda.current_device() == 0


@pytest.mark.parametrize("min_bytes", [1 << 30, 64])  # everything kept; everything offloaded
def test_in_place_change_after_save_raises_as_without_offload(dev, min_bytes):
    """Autograd skips its version check for tensors saved through hooks: the hooks must make it,
    or an in-place op after the save gives gradients of the new values (kept tensors), or of
    whichever values a queued copy read (offloaded ones), where plain autograd raises."""
    torch = _torch()

    def saved_output_changed(ctx):
        x = torch.randn(256, device=dev, requires_grad=True)
        with ctx:
            y = (x * 2).exp()  # exp saves its output
        y.mul_(3)
        return y.sum()

    def base_changed_through_a_view(ctx):
        x = torch.randn(256, device=dev, requires_grad=True)
        with ctx:
            y = x * 2
            v = y[8:]
            z = y.sin()  # sin saves its input y
        del y
        gc.collect()
        v.add_(1)  # y's version counter moves; only the view is left to the user
        return z.sum()

    for forward in (saved_output_changed, base_changed_through_a_view):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            forward(_null()).backward()
        off = pinmem.torch.offload_activations(min_bytes=min_bytes, device=dev)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            forward(off).backward()
        assert off.stats()["offloaded_tensors" if min_bytes == 64 else "kept_tensors"] > 0

    # A change before the save, and none after, is no error.
    x = torch.randn(256, device=dev, requires_grad=True)
    off = pinmem.torch.offload_activations(min_bytes=min_bytes, device=dev)
    with off:
        h = x * 2
        h.add_(1)
        out = h.exp().sum()
    out.backward()
    assert torch.equal(x.grad, 2 * (x.detach() * 2 + 1).exp())


def test_an_object_made_each_step_goes_with_its_graph(dev):
    """`with offload_activations(): ...` each step: the object must go when its graph does, by
    reference counting alone. Held in a cycle until a collection, each kept its pinmem streams
    (two threads each on the host backend) and, on a GPU, the pinned blocks of its last copies
    back, without bound under gc.disable()."""
    torch = _torch()
    import weakref
    x = torch.randn(64, 64, device=dev, requires_grad=True)
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(3):
            off = pinmem.torch.offload_activations(min_bytes=64, device=dev)
            with off:
                y = x.exp().sin().sum()
            assert off.stats()["offloaded_tensors"] == 2  # exp's output, saved by sin too
            ref = weakref.ref(off)
            del off
            assert ref() is not None  # the graph's unpack hooks hold it until backward
            y.backward()
            del y
            assert ref() is None
    finally:
        if enabled:
            gc.enable()
    (once,) = torch.autograd.grad(x.exp().sin().sum(), x)
    assert torch.equal(x.grad, 3 * once)  # 2 * once + once rounds as 3 * once does
