"""PyTorch interop. CPU tests need torch; GPU tests need torch with CUDA and pinmem's cuda
backend. Each skips with the reason when that is missing (on a GPU machine with torch they run)."""
import gc

import numpy as np
import pytest

import pinmem
from conftest import Gate, skip_unless_torch, skip_unless_torch_cuda


def test_torch_from_dlpack_zero_copy(rng):
    torch = skip_unless_torch()
    b = pinmem.empty((8, 16), "float32")
    np.asarray(b)[:] = rng.random((8, 16), dtype=np.float32)
    t = torch.from_dlpack(b)
    assert t.data_ptr() == b.ptr and t.shape == (8, 16) and t.dtype == torch.float32
    assert t.device.type == "cpu"
    t[3, 4] = 42.0  # torch tensors are writable: visible through NumPy
    assert np.asarray(b)[3, 4] == 42.0
    del b
    gc.collect()
    assert float(t[3, 4]) == 42.0  # the tensor keeps the memory


def test_pin_torch_cpu_tensor_in_place(rng):
    torch = skip_unless_torch()
    t = torch.from_numpy(rng.random((256, 33)))
    p = pinmem.pin(t)
    assert p.ptr == t.data_ptr() and p.shape == (256, 33) and p.dtype == "float64"
    assert pinmem.pointer_info(t.data_ptr())["kind"] == "registered"
    v = torch.from_dlpack(p)
    assert v.data_ptr() == t.data_ptr()
    del v
    p.release()
    assert pinmem.pointer_info(t.data_ptr())["kind"] == "pageable"
    with pytest.raises(pinmem.InvalidError):
        pinmem.pin(t.t())  # not contiguous


def test_tensors_that_require_grad_are_copied_and_saved_as_their_data(tmp_path):
    torch = skip_unless_torch()
    # torch's __dlpack__ refuses them ("Can't export tensors that require gradient"): a model's
    # parameters could be pinned but not copied or written. They go as .detach(), as
    # load_state_dict writes parameters.
    w = torch.nn.Parameter(torch.arange(6, dtype=torch.float32))
    out = pinmem.empty(6, "float32")
    pinmem.copy(out, w).wait()
    np.testing.assert_array_equal(np.asarray(out), np.arange(6, dtype=np.float32))
    dst = torch.nn.Parameter(torch.zeros(6))
    pinmem.copy(dst, out).wait()
    assert torch.equal(dst.detach(), w.detach()) and dst.requires_grad
    path = str(tmp_path / "w.bin")
    pinmem.write_file(path, w)
    assert open(path, "rb").read() == w.detach().numpy().tobytes()
    back = torch.nn.Parameter(torch.zeros(6))
    pinmem.read_file(path, back)
    assert torch.equal(back.detach(), w.detach())


def test_pin_keeps_the_memory_when_the_tensor_is_set_elsewhere():
    """t.set_(other) after pin(t): the pinned memory stays alive and pinned (pin holds an alias
    of its own), readable through the buffer, until the buffer lets go."""
    torch = skip_unless_torch()
    t = torch.arange(1 << 20, dtype=torch.float32)
    start = pinmem.stats()["registered_bytes"]
    p = pinmem.pin(t)
    ptr, before = p.ptr, pinmem.stats()["registered_bytes"]
    assert before - start >= 4 << 20  # the pages the tensor's 4 MiB lie on
    t.set_(torch.zeros(1))
    gc.collect()
    a = np.asarray(p)
    assert a[1] == 1.0 and a[-1] == (1 << 20) - 1 and p.ptr == ptr
    assert pinmem.pointer_info(ptr)["kind"] == "registered"
    del a
    p.release()
    assert pinmem.stats()["registered_bytes"] == start


def test_pin_tensor_then_copy_to_cuda(rng):
    torch = skip_unless_torch_cuda()
    t = torch.from_numpy(rng.random(1 << 20).astype(np.float32))
    with pinmem.pin(t):
        d = torch.empty_like(t, device="cuda")
        s = torch.cuda.Stream()
        c = pinmem.copy(d, t, stream=s)  # torch stream handle through .cuda_stream
        c.wait_stream(torch.cuda.current_stream())
        assert torch.equal(d.cpu(), t)
        c.wait()
        assert c.path == "direct"
        back = torch.empty_like(t)
        with pinmem.pin(back):
            pinmem.copy(back, d).wait()
        assert torch.equal(back, t)


def test_torch_pinned_tensor_copies_by_one_dma(rng):
    # Pinned by torch, not by pinmem: above copy_stage_min (8 MiB) still one DMA each way,
    # not staged as pageable memory would be.
    torch = skip_unless_torch_cuda()
    n = 3 << 22  # 12 MiB of float32
    t = torch.from_numpy(rng.random(n // 4).astype(np.float32)).pin_memory()
    assert t.is_pinned()
    assert pinmem.pointer_info(t.data_ptr())["kind"] == "pageable"  # unknown to pinmem
    d = torch.empty_like(t, device="cuda")
    c = pinmem.copy(d, t)
    c.wait()
    assert c.path == "direct"
    assert torch.equal(d.cpu(), t)
    back = torch.empty_like(t).pin_memory()
    c = pinmem.copy(back, d)
    c.wait()
    assert c.path == "direct" and torch.equal(back, t)
    # A pageable tensor of the same size is staged.
    page = torch.empty_like(t)
    c = pinmem.copy(page, d)
    c.wait()
    assert c.path == "staged" and torch.equal(page, t)


def test_device_buffer_to_torch_with_stream_order(rng):
    torch = skip_unless_torch_cuda()
    n = 1 << 22
    src = pinmem.empty(n, "uint8")
    np.asarray(src)[:] = rng.integers(1, 255, size=n, dtype=np.uint8)
    dev = pinmem.device_empty(n, "uint8")
    s = pinmem.Stream()
    with Gate(s) as gate:
        pinmem.copy(dev, src, s)  # held behind the gate: torch's stream must wait on its own
        t = torch.from_dlpack(dev)
        assert t.device.type == "cuda" and t.data_ptr() == dev.ptr
        r = t.clone()  # queued on torch's stream, after the held copy
        assert not torch.cuda.current_stream().query()  # waiting for it, not done
        assert gate.open()
    assert torch.equal(r.cpu(), torch.from_numpy(np.asarray(src)))
    assert torch.equal(t.cpu(), torch.from_numpy(np.asarray(src)))


def _loader_vs_dataloader(torch, device):
    from torch.utils.data import DataLoader, TensorDataset
    g = np.random.default_rng(1)
    X = torch.from_numpy(g.random((1000, 12), dtype=np.float32))
    Y = torch.from_numpy(g.integers(0, 5, size=1000))
    loader = pinmem.Loader(TensorDataset(X, Y), batch_size=64, shuffle=True, seed=5,
                           device=device)
    order = []
    batches = []
    for b in loader.batches():
        order.extend(int(i) for i in b.indices)
        batches.append(tuple(torch.from_dlpack(a).cpu().clone() for a in b))
        del b
    # torch's DataLoader over the same data in the same (seeded) order: equal batches.
    ref = DataLoader(TensorDataset(X, Y), batch_size=64, sampler=order)
    n = 0
    for (x, y), (rx, ry) in zip(batches, ref):
        assert torch.equal(x, rx) and torch.equal(y, ry)
        n += 1
    assert n == len(loader) == len(ref)
    # Without shuffling both take the natural order.
    plain = pinmem.Loader((X, Y), batch_size=100, device=device)
    for (x, y), (rx, ry) in zip(plain.as_torch(), DataLoader(TensorDataset(X, Y),
                                                            batch_size=100)):
        assert torch.equal(x.cpu(), rx) and torch.equal(y.cpu(), ry)


def test_loader_matches_torch_dataloader_cpu():
    torch = skip_unless_torch()
    _loader_vs_dataloader(torch, "cpu")


def test_loader_matches_torch_dataloader_cuda():
    torch = skip_unless_torch_cuda()
    _loader_vs_dataloader(torch, "cuda")


def test_training_loop_learns_cuda():
    """A small MLP fed by pinmem.Loader on the GPU: the loss must fall."""
    torch = skip_unless_torch_cuda()
    torch.manual_seed(0)
    g = np.random.default_rng(0)
    X = g.normal(size=(4096, 20)).astype(np.float32)
    w = g.normal(size=(20,)).astype(np.float32)
    Y = (X @ w > 0).astype(np.int64)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 2)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = pinmem.Loader((X, Y), batch_size=128, shuffle=True, seed=0, num_workers=2)
    losses = []
    for epoch in range(5):
        total = 0.0
        for x, y in loader.as_torch():
            assert x.is_cuda and y.is_cuda
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss)
        losses.append(total / len(loader))
    assert losses[-1] < 0.5 * losses[0], losses
    s = loader.stats()
    assert s["batches"] >= 5 * len(loader) and s["copy_seconds"] > 0


def test_empty_tensors_without_an_address(tmp_path):
    """An empty torch tensor has data_ptr() 0 (so has an empty __cuda_array_interface__ object):
    copies, reads and writes of it move nothing and complete, as those of empty NumPy arrays."""
    torch = skip_unless_torch()
    assert torch.zeros(0).data_ptr() == 0
    for dst, src in ((torch.zeros(0), np.zeros(0, np.float32)),
                     (np.zeros(0, np.float32), torch.zeros(0)), (torch.zeros(0), torch.zeros(0))):
        c = pinmem.copy(dst, src)
        c.wait()
        assert c.done()

    class Empty:
        __cuda_array_interface__ = {"shape": (0,), "typestr": "|u1", "data": (0, False),
                                    "version": 3}

    pinmem.copy(Empty(), np.zeros(0, np.uint8)).wait()
    path = tmp_path / "e.bin"
    path.write_bytes(b"abc")
    pinmem.write_file(path, torch.zeros(0)).wait()
    assert path.read_bytes() == b""
    pinmem.read_file(path, torch.zeros(0)).wait()
