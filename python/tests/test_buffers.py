"""Pinned buffers: empty, pin, the buffer protocol, DLPack, lifetime."""
import array
import gc
import os
import sys
import weakref

import numpy as np
import pytest

import pinmem
from conftest import random_bytes, warnings_in_forked_child


def addr(a):
    return a.__array_interface__["data"][0]


DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_dtypes_round_trip_through_numpy(dtype, rng):
    b = pinmem.empty((3, 5), dtype)
    assert b.dtype == dtype and b.shape == (3, 5) and b.kind == "pool"
    assert b.nbytes == 15 * np.dtype(dtype).itemsize
    a = np.asarray(b)
    assert a.dtype == np.dtype(dtype) and a.shape == (3, 5)
    assert addr(a) == b.ptr
    src = (rng.random((3, 5)) * 100).astype(dtype)
    a[...] = src
    d = np.from_dlpack(b)
    assert d.dtype == np.dtype(dtype) and addr(d) == b.ptr
    np.testing.assert_array_equal(d, src)
    info = pinmem.pointer_info(b)
    assert info["kind"] == "pool" and info["in_use"]


@pytest.mark.parametrize("dtype", [np.float32, np.dtype("<i8"), "f4", "<u2", "|u1", float, int,
                                   bool, "double", "torch.float16", "d"])
def test_dtype_spellings(dtype):
    b = pinmem.empty(4, dtype)
    assert np.asarray(b).dtype == np.dtype(dtype.replace("torch.", "")
                                           if isinstance(dtype, str) else dtype)


@pytest.mark.parametrize("name,dtype", [("float", "float32"), ("int", "int32"),
                                        ("long", "int64"), ("double", "float64"),
                                        ("half", "float16"), ("short", "int16"),
                                        ("cfloat", "complex64"), ("cdouble", "complex128"),
                                        ("chalf", "complex32")])
def test_torch_names_as_text_mean_torch_types(name, dtype):
    # torch.float is float32 and torch.int int32: "torch.float" was NumPy's float, float64.
    assert pinmem.empty(4, f"torch.{name}").dtype == dtype
    numpy = {"float": "float64", "int": "int64", "long": "int64", "double": "float64",
             "half": "float16", "short": "int16"}
    if name in numpy:  # NumPy's meaning without the prefix
        assert pinmem.empty(4, name).dtype == numpy[name]


def test_numpy_aliases_are_not_torch_names():
    for text in ("torch.single", "torch.bool_", "torch.f4", "torch.complex", "torch.byte"):
        with pytest.raises(pinmem.InvalidError, match="unsupported dtype"):
            pinmem.empty(4, text)


def test_shapes_as_numpy_takes_them():
    # A NumPy array of dimensions has __index__ (for one element): it was taken as one size.
    assert pinmem.empty(np.array([2, 3]), "uint8").shape == (2, 3)
    assert pinmem.empty(np.array(3), "uint8").shape == (3,)
    assert pinmem.empty(np.int64(4), "uint8").shape == (4,)
    assert pinmem.device_empty(np.array([2, 2]), "uint8").shape == (2, 2)


def test_dlpack_arguments_of_the_wrong_kind_are_type_errors():
    b = pinmem.empty(4, "float32")
    for kw, what in (({"max_version": [1, 0]}, "max_version"), ({"max_version": 1}, "max_version"),
                     ({"dl_device": [1, 0]}, "dl_device"), ({"dl_device": (1,)}, "dl_device")):
        with pytest.raises(TypeError, match=f"{what} must be a"):  # was SystemError for a list
            b.__dlpack__(**kw)


def test_device_fill_takes_a_byte():
    d = pinmem.device_empty(8, "uint8")
    for v in (256, -129, 1 << 40, 1 << 70, True, 1.5, "1"):
        with pytest.raises(pinmem.InvalidError, match="value must be a byte"):
            d.fill(v)  # 256 filled zeros; 1 << 40 raised OverflowError
    out = np.zeros(8, np.uint8)
    for v, want in ((255, 255), (-1, 255), (-128, 128), (np.uint8(7), 7)):
        d.fill(v)
        pinmem.copy(out, d).wait()
        assert (out == want).all()


def test_bad_dtype_and_shape():
    with pytest.raises(pinmem.InvalidError) as e:
        pinmem.empty(4, "float128x")
    assert e.value.status == "PM_ERR_INVALID"
    assert isinstance(e.value, ValueError)
    with pytest.raises(pinmem.InvalidError):
        pinmem.empty((2, -1), "uint8")
    with pytest.raises(TypeError):
        pinmem.empty((2, "x"), "uint8")
    with pytest.raises(pinmem.InvalidError):
        pinmem.empty((1 << 62, 1 << 62), "uint8")
    # A dimension past Py_ssize_t is the same mistake, not a bare OverflowError.
    for shape, what in ((1 << 70, "dimension 1180591620717411303424 in shape is too large"),
                        ((2, 1 << 63), "dimension 9223372036854775808 in shape is too large"),
                        ((-(1 << 70), 2), "negative dimension -1180591620717411303424")):
        for make in (pinmem.empty, pinmem.device_empty):
            with pytest.raises(pinmem.InvalidError, match=what):
                make(shape, "uint8")


def test_writes_visible_both_ways(rng):
    b = pinmem.empty(4096, "uint8")
    a = np.asarray(b)
    m = memoryview(b)
    d = np.from_dlpack(b)
    data = random_bytes(rng, 4096)
    a[:] = data
    assert bytes(m) == data.tobytes()
    np.testing.assert_array_equal(d, data)
    m[9] = 0x5A
    assert a[9] == 0x5A and d[9] == 0x5A
    # NumPy marks arrays from legacy (pre-1.0) DLPack capsules read-only; with a DLPack >= 1.0
    # header pinmem exports versioned capsules and the array is writable.
    assert d.flags.writeable == bool(pinmem._pinmem.DLPACK_VERSIONED)
    if d.flags.writeable:
        d[7] = data[7] ^ 0xFF
        assert m[7] == data[7] ^ 0xFF and a[7] == data[7] ^ 0xFF


def test_memoryview_shape_and_format():
    b = pinmem.empty((2, 3, 4), "float32")
    m = memoryview(b)
    assert m.shape == (2, 3, 4) and m.format == "f" and m.itemsize == 4 and not m.readonly
    assert m.nbytes == b.nbytes == 96 and m.c_contiguous
    assert b.strides == (48, 16, 4)
    flat = m.cast("B")
    assert flat.nbytes == 96


def test_empty_zero_size():
    b = pinmem.empty((0, 4), "float32")
    assert b.nbytes == 0
    a = np.asarray(b)
    assert a.shape == (0, 4)
    assert np.from_dlpack(b).shape == (0, 4)


def test_dlpack_device_is_cpu():
    b = pinmem.empty(8, "uint8")
    assert b.__dlpack_device__() == (pinmem._pinmem.DLPACK_CPU, 0)
    with pytest.raises(BufferError):
        b.__dlpack__(copy=True)


def test_pin_numpy_in_place(rng):
    x = rng.random(10000)
    before = pinmem.stats()["registered_bytes"]
    p = pinmem.pin(x)
    assert p.kind == "registered" and p.base is x and p.ptr == addr(x)
    assert p.shape == x.shape and p.dtype == "float64" and not p.readonly
    # the budget counts the whole pages the pin holds, not the array's bytes
    page = os.sysconf("SC_PAGE_SIZE")
    pages = -(-(addr(x) + x.nbytes) // page) - addr(x) // page
    assert pinmem.stats()["registered_bytes"] == before + pages * page
    info = pinmem.pointer_info(x)
    assert info["kind"] == "registered" and info["base"] == addr(x) and info["size"] == x.nbytes
    v = np.asarray(p)
    assert addr(v) == addr(x)
    v[0] = -1.0
    assert x[0] == -1.0
    del v
    p.release()
    assert p.released and pinmem.pointer_info(x)["kind"] == "pageable"
    assert pinmem.stats()["registered_bytes"] == before


def test_pin_twice_overlaps(rng):
    x = rng.random(1000)
    p = pinmem.pin(x)
    with pytest.raises(pinmem.OverlapError) as e:
        pinmem.pin(x[10:20])
    assert e.value.status == "PM_ERR_OVERLAP" and e.value.message
    with pytest.raises(pinmem.OverlapError):
        pinmem.pin(p)
    p.release()
    pinmem.pin(x[10:20]).release()


def test_pin_read_only_buffers(rng):
    data = random_bytes(rng, 3000).tobytes()
    p = pinmem.pin(data)
    assert p.readonly and p.nbytes == 3000
    m = memoryview(p)
    assert m.readonly and bytes(m) == data
    if pinmem._pinmem.DLPACK_VERSIONED:
        d = np.from_dlpack(p)  # a versioned capsule says read-only
        assert not d.flags.writeable and d.tobytes() == data
        del d
    else:
        with pytest.raises(BufferError):
            np.from_dlpack(p)  # legacy DLPack cannot say read-only
    a = np.asarray(p)
    assert not a.flags.writeable
    x = np.arange(100, dtype=np.int32)
    x.flags.writeable = False
    q = pinmem.pin(x)
    assert q.readonly and np.asarray(q)[99] == 99


def test_pin_other_buffers(rng):
    ba = bytearray(random_bytes(rng, 5000).tobytes())
    p = pinmem.pin(ba)
    assert p.nbytes == 5000 and not p.readonly
    with pytest.raises(BufferError):
        ba.extend(b"x")  # pinned memory cannot move
    memoryview(p)[0] = 17
    assert ba[0] == 17
    p.release()
    ba.extend(b"x")
    arr = array.array("d", range(50))
    q = pinmem.pin(arr)
    assert q.dtype == "float64" and q.shape == (50,)
    assert np.asarray(q)[49] == 49.0


def test_pin_fortran_and_noncontiguous(rng):
    f = np.asfortranarray(rng.random((30, 40)))
    p = pinmem.pin(f)
    a = np.asarray(p)
    assert addr(a) == addr(f) and a.flags.f_contiguous
    np.testing.assert_array_equal(a, f)
    np.testing.assert_array_equal(np.from_dlpack(p), f)
    with pytest.raises(pinmem.InvalidError):
        pinmem.pin(rng.random((10, 10))[:, ::2])


def test_pin_errors():
    with pytest.raises(TypeError):
        pinmem.pin(object())
    with pytest.raises(pinmem.InvalidError) as e:
        pinmem.pin(np.zeros(0))
    assert "0 bytes" in e.value.message


def test_lifetime_numpy_view_outlives_buffer(rng):
    """Delete the PinnedBuffer while a NumPy view exists: the view stays valid and the memory
    stays pinned until the view goes."""
    b = pinmem.empty(1 << 16, "uint8")
    ptr = b.ptr
    a = np.asarray(b)
    data = random_bytes(rng, 1 << 16)
    a[:] = data
    del b
    gc.collect()
    info = pinmem.pointer_info(ptr)
    assert info["kind"] == "pool" and info["in_use"]
    np.testing.assert_array_equal(a, data)
    in_use = pinmem.stats()["in_use_bytes"]
    del a
    gc.collect()
    assert pinmem.pointer_info(ptr)["in_use"] is False
    assert pinmem.stats()["in_use_bytes"] < in_use


def test_lifetime_dlpack_outlives_buffer(rng):
    x = rng.random(2048)
    p = pinmem.pin(x)
    d = np.from_dlpack(p)
    assert p.exports == 1
    x5 = x[5]
    del p, x
    gc.collect()
    ptr = addr(d)
    assert pinmem.pointer_info(ptr)["kind"] == "registered"
    assert d[5] == x5
    del d
    gc.collect()
    assert pinmem.pointer_info(ptr)["kind"] == "pageable"


def test_unconsumed_capsule_releases():
    b = pinmem.empty(100, "uint8")
    cap = b.__dlpack__()
    assert b.exports == 1
    del cap
    assert b.exports == 0
    b.release()


def test_release_refused_while_exported():
    b = pinmem.empty(64, "int32")
    m = memoryview(b)
    with pytest.raises(pinmem.BusyError) as e:
        b.release()
    assert e.value.status == "PM_ERR_BUSY"
    m.release()
    b.release()
    assert b.released and b.ptr == 0
    b.release()  # idempotent
    with pytest.raises(BufferError):
        memoryview(b)
    with pytest.raises(pinmem.StateError):
        pinmem.pointer_info(b)


def test_context_manager():
    with pinmem.empty(10, "uint8") as b:
        ptr = b.ptr
        assert pinmem.pointer_info(ptr)["in_use"]
    assert b.released and pinmem.pointer_info(ptr)["in_use"] is False


def test_an_exception_in_a_with_block_is_not_replaced_while_consumers_remain():
    """A block that raises while a consumer holds the memory raises its own exception (it was a
    BusyError from __exit__); the memory goes back when the consumer lets go."""
    src = np.arange(1000, dtype=np.float32)
    with pytest.raises(KeyError):
        with pinmem.pin(src) as p:
            view = np.asarray(p)
            raise KeyError("inside")
    assert not p.released and p.exports == 1
    del view
    assert p.exports == 0
    p.release()
    with pytest.raises(KeyError):
        with pinmem.empty(10, "uint8") as b:
            raise KeyError("inside")
    assert b.released  # without consumers it is released as before
    with pytest.raises(pinmem.BusyError):  # a block that ends normally still says so
        with pinmem.empty(10, "uint8") as b:
            view = memoryview(b)


def test_buffers_cannot_be_built_directly():
    with pytest.raises(TypeError):
        pinmem.PinnedBuffer()


def test_refcounts_do_not_leak():
    b = pinmem.empty(16, "uint8")
    base = sys.getrefcount(b)
    for _ in range(100):
        np.from_dlpack(b)
        memoryview(b)
        np.asarray(b)
    gc.collect()
    assert sys.getrefcount(b) == base and b.exports == 0


def test_an_object_holding_its_own_pin_is_collected():
    """An object that keeps its pin as an attribute is a reference cycle through the buffer
    (the buffer holds the object): the cycle collector frees it, and the memory is unpinned."""
    class Bytes(bytearray):
        pass

    class Array(np.ndarray):
        pass

    gc.collect()
    before = pinmem.stats()["registered_bytes"]
    b = Bytes(1 << 20)
    b.pinned = pinmem.pin(b)
    a = np.ones(1 << 17).view(Array)
    a.pinned = pinmem.pin(a)
    a.view = memoryview(a.pinned)  # a consumer inside the cycle
    assert pinmem.stats()["registered_bytes"] >= before + (2 << 20)
    refs = [weakref.ref(b.pinned), weakref.ref(a.pinned)]
    del a, b
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert pinmem.stats()["registered_bytes"] == before


def test_empty_like():
    x = np.zeros((4, 7), dtype=np.int16)
    b = pinmem.empty_like(x)
    assert b.shape == (4, 7) and b.dtype == "int16"


def test_pool_reuse_and_stats():
    pinmem.trim()
    s0 = pinmem.stats()
    b = pinmem.empty(1 << 20, "uint8")
    s1 = pinmem.stats()
    assert s1["allocs"] == s0["allocs"] + 1 and s1["in_use_bytes"] >= 1 << 20
    b.release()
    c = pinmem.empty(1 << 20, "uint8")
    s2 = pinmem.stats()
    assert s2["cache_hits"] >= s1["cache_hits"] + 1
    c.release()
    assert pinmem.trim() >= 0


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("name", ["bfloat16", "complex32", "float8_e4m3fn", "float8_e4m3fnuz",
                                  "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"])
def test_dtypes_numpy_lacks_travel_by_dlpack(name):
    torch = pytest.importorskip("torch", reason="torch is not installed: no DLPack consumer of "
                                "these dtypes to check against")
    src = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4 + 1
    src = torch.complex(src, -src).to(torch.complex32) if name == "complex32" else \
        src.to(getattr(torch, name))
    b = pinmem.empty((2, 3), name)
    assert b.dtype == name and b.nbytes == src.numel() * src.element_size()
    t = torch.from_dlpack(b)
    assert t.dtype == src.dtype and t.shape == (2, 3)
    t.copy_(src)
    store = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[src.element_size()]
    assert torch.equal(torch.from_dlpack(b).view(store), src.view(store))
    with pytest.raises(TypeError, match=f"{name} has no NumPy type"):
        np.asarray(b)
    with pytest.raises(BufferError, match=f"{name} has no buffer-protocol"):
        memoryview(b)
    del t
    # pin() of such a tensor keeps its type and shape for DLPack, the same memory, and the
    # buffer protocol refuses it by name, as for empty()'s (it gave flat bytes, and no DLPack).
    with pinmem.pin(src) as p:
        assert p.dtype == name and p.shape == (2, 3) and p.nbytes == b.nbytes
        t = torch.from_dlpack(p)
        assert t.dtype == src.dtype and t.shape == src.shape and t.data_ptr() == src.data_ptr()
        assert torch.equal(t.view(store), src.view(store))
        with pytest.raises(BufferError, match=f"{name} has no buffer-protocol"):
            memoryview(p)
        del t


def test_a_view_of_part_of_a_buffer_holds_it_and_stays_inside_it(rng):
    """_buffer_view (the loader's staged batches: one view per leaf of one pinned or device
    block) sees the base's bytes at its offset, keeps the base alive and counts as its consumer,
    and refuses a range past the base's end."""
    from pinmem import _pinmem
    base = pinmem.empty((64,), "uint8")
    data = random_bytes(rng, 64)
    np.asarray(base)[:] = data
    v = _pinmem._buffer_view(base, 16, (3, 2), "<f4")
    assert v.shape == (3, 2) and v.dtype == "float32" and v.nbytes == 24
    np.testing.assert_array_equal(np.asarray(v).view(np.uint8).reshape(-1), data[16:40])
    assert base.exports == 1
    with pytest.raises(pinmem.BusyError):
        base.release()
    with pytest.raises(pinmem.InvalidError, match="do not fit"):
        _pinmem._buffer_view(base, 48, (5,), "<f4")
    with pytest.raises(pinmem.InvalidError, match="do not fit"):
        _pinmem._buffer_view(base, -1, (1,), "uint8")
    ref = base.ptr
    del base
    gc.collect()
    assert v.ptr == ref + 16  # the base lives on in its view
    np.testing.assert_array_equal(np.asarray(v).view(np.uint8).reshape(-1), data[16:40])
    del v


def test_device_memory_is_reusable_only_once_no_view_or_copy_holds_it(rng):
    """_buffer_reuse (the loader's staged device batches): False while a view of the block, or
    a copy into it, is alive; True once they are gone; never for host memory."""
    from pinmem import _pinmem
    s = pinmem.Stream()
    base = pinmem.device_empty((256,), "uint8")
    src = pinmem.empty((256,), "uint8")
    np.asarray(src)[:] = random_bytes(rng, 256)
    done = pinmem.copy(base, src, s)
    v = _pinmem._buffer_view(base, 0, (64,), "<f4")
    assert not _pinmem._buffer_reuse(base, s)
    done.wait()
    del done
    assert not _pinmem._buffer_reuse(base, s)  # the view still holds it
    back = np.empty(64, np.float32)
    pinmem.copy(back, v).wait()
    np.testing.assert_array_equal(back.view(np.uint8), np.asarray(src))
    del v
    assert _pinmem._buffer_reuse(base, s)
    assert not _pinmem._buffer_reuse(src, s)  # pinned host memory: not a device block
    s.close()


def test_a_forked_child_dropping_the_parents_buffers_is_quiet():
    """A fork child (a DataLoader's or multiprocessing's fork worker) that drops or collects its
    copies of the parent's buffers: pool, registered and device buffers and an iterable loader's
    batches are the parent's to give back, so the child warns of nothing, and the parent's
    buffers stay good."""
    torch_data = pytest.importorskip("torch.utils.data")

    class Rows(torch_data.IterableDataset):
        def __iter__(self):
            return iter(list(np.arange(400, dtype=np.float32).reshape(100, 4)))

    gc.collect()
    before = pinmem.stats()["in_use_bytes"]
    src = np.full(8192, 5, dtype=np.uint8)
    pool = pinmem.empty(4096, "uint8")
    np.asarray(pool)[:] = 7
    reg = pinmem.pin(src)
    dev = pinmem.device_empty(4096, "uint8")
    batches = list(pinmem.Loader(Rows(), batch_size=10, device="cpu"))
    held = [pinmem.empty(4096, "uint8"), pool, reg, dev, batches]
    said = warnings_in_forked_child(held.clear)
    assert said == "", said
    assert (np.asarray(reg) == 5).all() and (np.asarray(pool) == 7).all()
    assert [float(np.asarray(b)[0, 0]) for b in batches] == [40.0 * k for k in range(10)]
    del held, batches, pool, reg, dev
    gc.collect()
    assert pinmem.stats()["in_use_bytes"] == before
