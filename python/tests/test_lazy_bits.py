"""Torch tensors with the negative or conjugate bit set (lazy views: the memory holds the values
before the negation or conjugation) through copy, write_file, read_file and pin. torch's
__dlpack__ drops the bit, so pinmem resolves a source to the values it shows and refuses a
destination or memory to pin in place, as Tensor.numpy() refuses it."""
import numpy as np
import pytest

import pinmem
from conftest import skip_unless_torch


def lazy_sources(torch):
    """(name, lazy tensor, the plain tensor of the values it shows); never all zeros."""
    x = torch.arange(1, 25, dtype=torch.float32).reshape(4, 6)
    z = torch.complex(torch.arange(1.0, 13.0), torch.arange(-5.0, 7.0)).reshape(3, 4)
    one = torch.complex(torch.tensor([1.5]), torch.tensor([2.5]))
    out = [("neg_view", x._neg_view(), -x),
           ("conj", z.conj(), torch.complex(z.real, -z.imag)),
           # the imaginary part of a conjugate view is a negated view; compact for one element
           ("conj_imag", one.conj().imag, torch.tensor([-2.5]))]
    for name, lazy, plain in out:
        assert lazy.is_neg() or lazy.is_conj(), name
        assert lazy.is_contiguous(), name
        assert torch.equal(lazy.resolve_conj().resolve_neg(), plain), name
    return out


def test_copy_from_a_lazy_view_gives_the_values_it_shows():
    torch = skip_unless_torch()
    for name, lazy, plain in lazy_sources(torch):
        dst = np.zeros(plain.shape, plain.numpy().dtype)
        pinmem.copy(dst, lazy).wait()
        np.testing.assert_array_equal(dst, plain.numpy(), err_msg=name)
        pinned = pinmem.empty(tuple(plain.shape), plain.dtype)
        pinmem.copy(pinned, lazy).wait()
        np.testing.assert_array_equal(np.asarray(pinned), plain.numpy(), err_msg=name)
        assert lazy.is_neg() or lazy.is_conj()  # the caller's tensor is left as it was


def test_write_file_from_a_lazy_view_writes_the_values_it_shows(tmp_path):
    torch = skip_unless_torch()
    for name, lazy, plain in lazy_sources(torch):
        path = tmp_path / f"{name}.bin"
        pinmem.write_file(path, lazy).wait()
        assert path.read_bytes() == plain.numpy().tobytes(), name


def test_lazy_view_as_destination_or_pinned_is_refused(tmp_path):
    torch = skip_unless_torch()
    for name, lazy, plain in lazy_sources(torch):
        src = plain.numpy().copy()
        before = lazy.resolve_conj().resolve_neg().clone()
        bit = "negative" if lazy.is_neg() else "conjugate"
        with pytest.raises(pinmem.InvalidError, match=f"dst has its {bit} bit set"):
            pinmem.copy(lazy, src)
        path = tmp_path / f"{name}.bin"
        path.write_bytes(src.tobytes())
        with pytest.raises(pinmem.InvalidError, match=f"{bit} bit set") as e:
            pinmem.read_file(path, lazy)
        assert f"{name}.bin" in str(e.value)
        with pytest.raises(pinmem.InvalidError, match=f"pin: the tensor has its {bit} bit"):
            pinmem.pin(lazy)
        assert torch.equal(lazy.resolve_conj().resolve_neg(), before), name  # left untouched


def test_plain_tensors_still_move_in_place(tmp_path):
    torch = skip_unless_torch()
    x = torch.arange(1, 9, dtype=torch.float32)
    path = tmp_path / "x.bin"
    path.write_bytes((-x).numpy().tobytes())
    dst = torch.zeros(8)
    pinmem.read_file(path, dst).wait()
    assert torch.equal(dst, -x)
    p = pinmem.pin(x)
    assert p.ptr == x.data_ptr()  # pinned in place, not a resolved copy
    p.release()


def test_cuda_lazy_views():
    """The same on the device: a CUDA source is resolved on its stream, a CUDA destination is
    refused."""
    from conftest import skip_unless_torch_cuda
    torch = skip_unless_torch_cuda()
    x = torch.arange(1, 4097, dtype=torch.float32, device="cuda")
    dst = np.zeros(4096, np.float32)
    pinmem.copy(dst, x._neg_view(), torch.cuda.current_stream()).wait()
    np.testing.assert_array_equal(dst, -np.arange(1, 4097, dtype=np.float32))
    z = torch.complex(x, -x).conj()
    out = np.zeros(4096, np.complex64)
    pinmem.copy(out, z).wait()
    np.testing.assert_array_equal(out, (x + 1j * x).cpu().numpy())
    with pytest.raises(pinmem.InvalidError, match="dst has its negative bit set"):
        pinmem.copy(x._neg_view(), np.ones(4096, np.float32))
