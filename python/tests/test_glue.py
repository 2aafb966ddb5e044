"""Misuse and odd inputs at the Python glue: every one gives correct data or a clear error,
never a crash or corrupted memory.

Memory-safety cases run in a child interpreter under PYTHONMALLOC=debug, whose allocator guards
every block with pad bytes and aborts on a write past one, so an overrun fails the test even
without valgrind (and a crash in the child cannot take pytest down with it).
"""
import ctypes
import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pinmem
from pinmem import _pinmem


def run_child(code, tmp_path, timeout=120):
    """Run `code` in a fresh interpreter with the debug allocator (or the PYTHONMALLOC in
    force: malloc under valgrind --trace-children=yes); -> its stdout."""
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    env.setdefault("PYTHONMALLOC", "debug")
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"child failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


# -- a .npy dtype with no pinmem element type, through pinmem.Loader ------------------------

UNCODED = {
    "f4_big_endian": "np.arange(1, 11, dtype='>f4')",
    "unicode": "np.array(['s%d' % i for i in range(10)], dtype='<U10')",
    "structured": "np.array([(i, i * 0.5) for i in range(10)], dtype=[('x', '<i4'), ('y', '<f8')])",
    "datetime64": "(np.arange(10) + 86400).astype('datetime64[s]')",
}


@pytest.mark.parametrize("name", sorted(UNCODED))
def test_loader_uncoded_npy_dtype_is_safe(name, tmp_path):
    """The batch of a 1-D .npy whose dtype pinmem has no code for used to be described as
    (n, itemsize) bytes in a descriptor sized for one dimension: a write past the heap block
    (valgrind: invalid write of size 8). Now the rows arrive exactly (as the dtype itself, or as
    their raw bytes) or the loader refuses the file with a pinmem error."""
    out = run_child(f"""
        import numpy as np, pinmem
        a = {UNCODED[name]}
        np.save("a.npy", a)
        rows = []
        try:
            with pinmem.Loader("a.npy", batch_size=4, device="cpu") as ld:
                for b in ld:
                    x = np.array(b)        # a copy, so the slot can go back
                    del b
                    if x.dtype == np.uint8:  # raw records: one row of itemsize bytes a sample
                        assert x.shape[1:] == (a.dtype.itemsize,), x.shape
                        rows.append(x.copy().view(a.dtype).reshape(-1))
                    else:                    # the dtype itself (perhaps in native byte order)
                        assert x.dtype.kind == a.dtype.kind, x.dtype
                        rows.append(x.astype(a.dtype))
        except pinmem.Error as e:
            assert str(e), "an empty message"
            print("refused", type(e).__name__)
        else:
            got = np.concatenate(rows).astype(a.dtype)
            assert got.dtype == a.dtype and got.tobytes() == a.tobytes(), (got, a)
            print("delivered", len(got))
        """, tmp_path)
    assert out.split()[0] in ("refused", "delivered"), out
    if out.startswith("delivered"):
        assert out.split()[1] == "10"


def test_buffer_descriptor_survives_every_ndim(tmp_path):
    """The descriptor holds shape and strides for any number of dimensions (0 to 64)."""
    run_child("""
        import numpy as np, pinmem
        for nd in (0, 1, 2, 3, 31, 64):
            shape = (1,) * nd
            b = pinmem.empty(shape, "int16")
            assert b.shape == shape and len(b.strides) == nd
            a = np.asarray(b); a[...] = 7
            assert a.shape == shape and int(a.sum()) == 7
            p = pinmem.pin(np.full(shape, 3, np.int32))
            assert p.shape == shape and np.asarray(p).sum() == 3
            del a, b, p
        print("ok")
        """, tmp_path)


# -- __cuda_array_interface__ and DLPack device memory ---------------------------------------

class CAI:
    """An object that says it is device memory (as CuPy and Numba arrays do)."""

    def __init__(self, ptr, shape, typestr="<f4", strides=None, readonly=False):
        self.__cuda_array_interface__ = dict(data=(ptr, readonly), shape=shape, typestr=typestr,
                                             strides=strides, version=3)


@pytest.fixture
def device_f4(rng):
    """16 float32 of device memory holding known values, and those values."""
    if pinmem.backend() != "host":
        pytest.skip("a bogus device pointer is only detectable where pinmem made every device "
                    "allocation (the host backend); CUDA checks its own")
    d = pinmem.device_empty(16, "float32")
    vals = rng.standard_normal(16).astype(np.float32)
    pinmem.copy(d, vals).wait()
    return d, vals


def test_cai_bogus_pointer_refused(device_f4, tmp_path):
    """Used to be read as host memory: a segfault. Now PM_ERR_INVALID naming the address."""
    out = np.zeros(4, np.float32)
    with pytest.raises(pinmem.InvalidError, match="no device memory there"):
        pinmem.copy(out, CAI(0xDEAD0000, (4,)))
    with pytest.raises(pinmem.InvalidError, match="no device memory there"):
        pinmem.copy(CAI(0xDEAD0000, (4,)), out)
    assert not out.any()
    # In a child too (a crash there would not take the test process with it): the copy from a
    # pointer pinmem never allocated is refused, naming the address, and nothing is written.
    out = run_child("""
        import numpy as np, pinmem
        class C: pass
        c = C(); c.__cuda_array_interface__ = dict(data=(0x10, False), shape=(4,),
                                                   typestr="<f4", version=3)
        dst = np.zeros(4, np.float32)
        try:
            pinmem.copy(dst, c).wait()
        except pinmem.InvalidError as e:
            print("refused", "no device memory there" in str(e), "0x10" in str(e), dst.any())
        else:
            print("copied")
        """, tmp_path)
    assert out.split() == ["refused", "True", "True", "False"], out


def test_cai_range_past_allocation_refused(device_f4):
    d, vals = device_f4
    out = np.zeros(16, np.float32)
    with pytest.raises(pinmem.InvalidError, match="runs past the end"):
        pinmem.copy(out, CAI(d.ptr + 8, (16,)))
    pinmem.copy(out[:4], CAI(d.ptr + 16, (4,))).wait()  # inside it: fine
    np.testing.assert_array_equal(out[:4], vals[4:8])


def test_cai_shape_overflow_refused(device_f4):
    """(2**62 + 1) * 4 * 4 bytes wrapped to 16 and the copy 'succeeded'."""
    d, _ = device_f4
    out = np.zeros(4, np.float32)
    with pytest.raises(pinmem.InvalidError, match="too large"):
        pinmem.copy(out, CAI(d.ptr, (2**62 + 1, 4)))
    with pytest.raises(pinmem.InvalidError, match="too large"):
        pinmem.copy(out, CAI(d.ptr, (2**31, 2**31, 2**31)))
    with pytest.raises(pinmem.InvalidError):
        pinmem.copy(out, CAI(d.ptr, (-1, 4)))
    with pytest.raises(pinmem.InvalidError):
        pinmem.copy(out, CAI(d.ptr, (4,), typestr="<f0"))
    assert not out.any()


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class HandmadeDL:
    """A DLPack producer whose tensor says whatever the test wants (data, device, shape)."""

    def __init__(self, data, device_type, shape, bits=32):
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.mt = _DLManagedTensor()
        t = self.mt.dl_tensor
        t.data, t.ndim, t.byte_offset = data, len(shape), 0
        t.device = _DLDevice(device_type, 0)
        t.dtype = _DLDataType(2, bits, 1)  # kDLFloat
        t.shape = self.shape
        self.device_type = device_type

    def __dlpack_device__(self):
        return (self.device_type, 0)

    def __dlpack__(self, stream=None, **kw):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self.mt), b"dltensor", None)


def test_dlpack_device_tensor_must_be_device_memory(device_f4):
    """A tensor that says kDLCUDA at an address pinmem never allocated is refused on the host
    backend (it would be read as host memory); one inside pinmem's device memory is copied."""
    d, vals = device_f4
    out = np.zeros(4, np.float32)
    with pytest.raises(pinmem.InvalidError, match="no device memory there"):
        pinmem.copy(out, HandmadeDL(0xDEAD0000, _pinmem.DLPACK_CUDA, (4,)))
    with pytest.raises(pinmem.InvalidError, match="runs past the end"):
        pinmem.copy(out, HandmadeDL(d.ptr + 32, _pinmem.DLPACK_CUDA, (16,)))
    with pytest.raises(pinmem.InvalidError, match="too large"):
        pinmem.copy(out, HandmadeDL(d.ptr, _pinmem.DLPACK_CUDA, (2**62 + 1, 4)))
    with pytest.raises(pinmem.InvalidError, match="negative"):
        pinmem.copy(out, HandmadeDL(d.ptr, _pinmem.DLPACK_CUDA, (-4,)))
    assert not out.any()
    pinmem.copy(out, HandmadeDL(d.ptr + 4, _pinmem.DLPACK_CUDA, (4,))).wait()
    np.testing.assert_array_equal(out, vals[1:5])


def test_dlpack_cpu_shape_overflow_refused():
    """The same checked byte count for CPU tensors (pin and copy)."""
    a = np.ones(4, np.float32)
    for obj in (HandmadeDL(a.ctypes.data, _pinmem.DLPACK_CPU, (2**62 + 1, 4)),
                HandmadeDL(a.ctypes.data, _pinmem.DLPACK_CPU, (2**40, 2**40))):
        with pytest.raises(pinmem.InvalidError, match="too large"):
            pinmem.copy(np.zeros(4, np.float32), obj)
        with pytest.raises(pinmem.InvalidError, match="too large"):
            pinmem.pin(obj)


def test_dlpack_packed_sub_byte_elements_are_sized_packed():
    """DLPack packs elements narrower than a byte: 8 of 4 bits are 4 bytes, 7 of them 4 too.
    Sized a byte per element, pin registered (and exported) twice the tensor's memory and copy
    read past it."""
    a = np.arange(16, dtype=np.uint8)
    for n in (8, 7):
        with pinmem.pin(HandmadeDL(a.ctypes.data, _pinmem.DLPACK_CPU, (n,), bits=4)) as p:
            assert p.nbytes == 4
            assert bytes(memoryview(p)) == bytes(range(4))
        out = np.zeros(4, np.uint8)
        pinmem.copy(out, HandmadeDL(a.ctypes.data, _pinmem.DLPACK_CPU, (n,), bits=4)).wait()
        np.testing.assert_array_equal(out, np.arange(4, dtype=np.uint8))
    with pytest.raises(pinmem.InvalidError, match="src has 4 bytes but dst only 3"):
        pinmem.copy(np.zeros(3, np.uint8),
                    HandmadeDL(a.ctypes.data, _pinmem.DLPACK_CPU, (2, 4), bits=4))


class BadDL:
    def __init__(self, device, capsule):
        self.device, self.capsule = device, capsule

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None, **kw):
        return self.capsule


@pytest.mark.parametrize("device,capsule,match", [
    ("cpu", None, r"__dlpack_device__\(\) must return a \(device_type, device_id\)"),
    ((1,), None, r"__dlpack_device__\(\) must return"),
    ((1, "0"), None, r"__dlpack_device__\(\) must return"),
    ((1, 0), 5, r"__dlpack__\(\) must return a 'dltensor' PyCapsule, not int"),
    ((1, 0), "x", r"must return a 'dltensor' PyCapsule, not str"),
])
def test_dlpack_producer_wrong_types(device, capsule, match):
    """Used to surface CPython internals (SystemError: new style getargs format; ValueError:
    PyCapsule_GetPointer called with invalid PyCapsule object)."""
    o = BadDL(device, capsule)
    with pytest.raises(TypeError, match=match):
        pinmem.pin(o)
    with pytest.raises(TypeError, match=match):
        pinmem.copy(np.zeros(4), o)


def test_dlpack_used_capsule_refused():
    a = np.arange(4.0)
    cap = a.__dlpack__()
    np.from_dlpack(BadDL((1, 0), cap))  # consumes it: renamed used_dltensor
    with pytest.raises(TypeError, match="used_dltensor"):
        pinmem.copy(np.zeros(4), BadDL((1, 0), cap))


# -- layouts: pin of a Fortran-ordered array ----------------------------------------------------

def test_pin_fortran_keeps_layout_and_copy_refuses_it(rng):
    """pin() of a Fortran array was accepted and pinmem.copy of the pinned buffer moved its
    bytes as if C-ordered (a transposed result), while copy of the array itself is refused."""
    a = np.asfortranarray(rng.standard_normal((3, 5)).astype(np.float32))
    b = pinmem.pin(a)
    np.testing.assert_array_equal(np.asarray(b), a)          # the view is right
    np.testing.assert_array_equal(np.from_dlpack(b), a)
    dst = np.zeros((3, 5), np.float32)
    with pytest.raises(pinmem.InvalidError, match="not C-contiguous"):
        pinmem.copy(dst, b)
    with pytest.raises(pinmem.InvalidError, match="not C-contiguous"):
        pinmem.copy(b, np.ones((3, 5), np.float32))
    with pytest.raises(pinmem.InvalidError, match="not C-contiguous"):
        pinmem.copy(dst, a)                                  # same class as for the buffer
    assert not dst.any()
    # What is accepted copies exactly as NumPy says.
    c = pinmem.pin(np.ascontiguousarray(a))
    pinmem.copy(dst, c).wait()
    np.testing.assert_array_equal(dst, a)


def test_copy_strided_source_refused_as_pinmem_error():
    a = np.arange(20.0)[::2]
    with pytest.raises(pinmem.InvalidError, match="not C-contiguous"):
        pinmem.copy(np.zeros(10), a)


# -- smaller glue items ------------------------------------------------------------------------

def test_budget_exceeded_is_budget_error_from_empty_and_pin():
    old = pinmem.budget()
    gc.collect()  # buffers of earlier tests still held would keep the budget from shrinking
    pinmem.trim()
    try:
        pinmem.set_budget("1M")
        with pytest.raises(pinmem.BudgetError) as e1:
            pinmem.empty(2 << 20, "uint8")
        with pytest.raises(pinmem.BudgetError) as e2:
            pinmem.pin(np.ones(2 << 20, np.uint8))
        assert e1.value.code == e2.value.code == pinmem.PM_ERR_BUDGET
    finally:
        pinmem.set_budget(old)


def test_empty_like_buffer_protocol_objects():
    b = pinmem.empty_like(bytearray(10))
    assert b.shape == (10,) and b.dtype == "uint8"
    m = pinmem.empty_like(memoryview(np.ones((2, 3), np.int16)))
    assert m.shape == (2, 3) and m.dtype == "int16"
    p = pinmem.empty_like(pinmem.empty((4, 2), "float32"))
    assert p.shape == (4, 2) and p.dtype == "float32"
    with pytest.raises(TypeError, match="empty_like"):
        pinmem.empty_like(object())


def test_asarray_of_device_memory_is_a_clear_error():
    d = pinmem.device_empty(8, "float32")
    with pytest.raises(TypeError, match="copy it to host memory first"):
        np.asarray(d)
    h = pinmem.empty(8, "float32")
    a = np.asarray(h)
    assert a.shape == (8,) and a.dtype == np.float32
    assert np.asarray(h, dtype=np.float64).dtype == np.float64
    assert np.array(h).ctypes.data != h.ptr  # np.array copies


def test_loader_workers_option_and_argument_agree(tmp_path):
    """PINMEM_LOADER_WORKERS=1024 was clamped to 256 while num_workers=1024 is refused."""
    with pytest.raises(pinmem.ConfigError, match="0..256"):
        pinmem.set_option("loader_workers", 1024)
    with pytest.raises(pinmem.InvalidError):
        pinmem.Loader(np.arange(8), num_workers=1024)
    env = dict(os.environ, PINMEM_LOADER_WORKERS="1024")
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    r = subprocess.run([sys.executable, "-c",
                        "import pinmem; print(pinmem.options()['loader_workers']['value'])"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "ignored" in r.stdout and "0..256" in r.stdout, r.stdout


def test_status_constants_match_exceptions():
    """The PM_ codes are exported by name, from the C status map."""
    assert pinmem.PM_OK == 0 and pinmem.PM_NOT_READY == 1
    for name in ("PM_ERR_INVALID", "PM_ERR_BUDGET", "PM_ERR_STATE", "PM_ERR_BUSY"):
        code = getattr(pinmem, name)
        assert _pinmem._status_name(code) == name
        with pytest.raises(pinmem.Error) as e:
            _pinmem._raise(code, "detail")
        assert e.value.code == code and e.value.status == name
    codes = [v for k, v in vars(pinmem).items() if k.startswith("PM_ERR_")]
    assert len(codes) == len(set(codes)) >= 15


def test_object_arrays_refused_by_pin_and_copy():
    """Their bytes are references: copied as bytes they would be freed twice."""
    objs = np.array([object(), "x", 3], dtype=object)
    rec = np.zeros(2, dtype=[("Olive", "<i4"), ("o", "O")])
    for a in (objs, rec):
        with pytest.raises(pinmem.InvalidError, match="Python objects"):
            pinmem.pin(a)
        with pytest.raises(pinmem.InvalidError, match="Python objects"):
            pinmem.copy(np.zeros(a.nbytes, np.uint8), a)
        with pytest.raises(pinmem.InvalidError, match="Python objects"):
            pinmem.copy(a, np.zeros(a.nbytes, np.uint8))
    # A field named with an O is not an object field.
    plain = np.zeros(2, dtype=[("Olive", "<i4")])
    with pinmem.pin(plain) as b:
        assert b.nbytes == 8


def test_unexportable_dtype_is_a_pinmem_error():
    """NumPy cannot describe datetime64 through the buffer protocol: pin said ValueError."""
    a = np.arange(4).astype("datetime64[s]")
    with pytest.raises(pinmem.InvalidError, match="does not export"):
        pinmem.pin(a)
    # The Loader carries the dtype through: host batches are datetime64 again; device batches
    # (DLPack has no datetime type) are refused.
    with pinmem.Loader(a, batch_size=4, device="cpu") as ld:
        got = next(iter(ld))
        assert got.dtype == a.dtype
        np.testing.assert_array_equal(got, a)
        del got
    with pytest.raises(pinmem.InvalidError, match="device='cpu'"):
        pinmem.Loader(a, batch_size=4)
    out = np.zeros(4, "datetime64[s]")
    pinmem.copy(out, a).wait()  # a plain byte copy needs no description
    np.testing.assert_array_equal(out, a)
