"""Property-based tests of the Python glue, with NumPy as the oracle.

Generated dtypes (every NumPy kind, both byte orders, records, strings, datetimes, objects),
shapes (empty, single, large and overflowing) and layouts (C, Fortran, transposed, strided)
go through pinmem.empty, pinmem.pin, pinmem.copy and pinmem.Loader. What pinmem accepts must
round-trip exactly (the bytes NumPy has); what it refuses must raise one of pinmem's error
classes (or TypeError for a wrong kind of argument); nothing may crash.

Deterministic (derandomize) and bounded (max_examples) so the suite costs seconds in CI.
"""
import gc

import numpy as np
import pytest

import pinmem

hypothesis = pytest.importorskip(
    "hypothesis", reason="hypothesis is not installed (pip install hypothesis; `make test` "
    "installs it): the property-based tests of the Python glue did not run")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as npst  # noqa: E402

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# pinmem's element types: native byte order (or none), kinds b/i/u/f/c, these sizes.
SUPPORTED = {np.dtype(t) for t in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
                                   "uint32", "uint64", "float16", "float32", "float64",
                                   "complex64", "complex128")}


def dtypes():
    """Every kind NumPy has, in both byte orders where it has one."""
    return st.one_of(
        npst.boolean_dtypes(),
        npst.integer_dtypes(endianness="?"),
        npst.unsigned_integer_dtypes(endianness="?"),
        npst.floating_dtypes(endianness="?", sizes=(16, 32, 64, 128)),
        npst.complex_number_dtypes(endianness="?", sizes=(64, 128, 256)),
        npst.datetime64_dtypes(endianness="?"),
        npst.timedelta64_dtypes(endianness="?"),
        npst.byte_string_dtypes(endianness="?", min_len=1, max_len=6),
        npst.unicode_string_dtypes(endianness="?", min_len=1, max_len=6),
        npst.array_dtypes(subtype_strategy=npst.scalar_dtypes(), min_size=1, max_size=3),
        st.just(np.dtype("V5")),
        st.just(np.dtype(object)),
    )


def small_shapes():
    return npst.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6)


def huge_shapes():
    """Shapes whose byte count is beyond any budget, or beyond size_t."""
    return st.lists(st.sampled_from([1, 3, 2**31, 2**40, 2**62 + 1]), min_size=1,
                    max_size=4).filter(lambda s: max(s) > 3)


def filled(dtype, shape, seed):
    """A C-ordered array of `dtype` and `shape` holding seeded random bytes (never all zero)."""
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.random.default_rng(seed).integers(1, 256, size=n, dtype=np.uint8)
    if dtype.hasobject:
        return np.full(shape, None, dtype=dtype)  # random bytes would be bogus pointers
    return raw.view(dtype).reshape(shape) if n else np.empty(shape, dtype)


def laid_out(a, layout):
    """`a` (or a view of a copy of it) in one of several memory layouts."""
    if layout == "C":
        return a
    if layout == "F":
        return np.asfortranarray(a)
    if layout == "T":
        return a.T
    if layout == "step" and a.ndim:
        return np.repeat(a, 2, axis=0)[::2]
    if layout == "neg" and a.ndim:
        return a[::-1]
    return a


def numpy_exports(a):
    """Can NumPy describe the array through the buffer protocol (format included)?"""
    try:
        memoryview(a).release()
        return True
    except (ValueError, TypeError, BufferError):
        return False


def numpy_reads_back(a):
    """Does NumPy read its own buffer view of `a` back as `a`? Not always: some NumPy versions
    lose padding or field names in the format of record dtypes, or misread Fortran-ordered void
    arrays (np.asarray(memoryview(a)) differs from a). Where NumPy cannot, the oracle compares
    pinmem's view with NumPy's view field by field instead of reading it back."""
    try:
        got = np.asarray(memoryview(a))
        return got.shape == a.shape and got.tobytes() == a.tobytes()
    except (ValueError, TypeError, BufferError, RuntimeError):
        return False


def same_view(x, y):
    """The buffer-protocol description of x and y is the same (format, itemsize, shape, strides)."""
    mx, my = memoryview(x), memoryview(y)
    try:
        return (mx.format, mx.itemsize, mx.shape, mx.strides, mx.nbytes) == \
            (my.format, my.itemsize, my.shape, my.strides, my.nbytes)
    finally:
        mx.release()
        my.release()


LAYOUTS = st.sampled_from(["C", "F", "T", "step", "neg"])
PINMEM_ERRORS = (pinmem.Error, TypeError)


@pytest.fixture(autouse=True, scope="module")
def small_budget():
    """A budget far below the huge shapes, so they are refused without touching the memory."""
    old = pinmem.budget()
    gc.collect()  # buffers of earlier tests still held would keep the budget from shrinking
    pinmem.trim()
    pinmem.set_budget("256M")
    yield
    pinmem.trim()
    pinmem.set_budget(old)


# -- empty ----------------------------------------------------------------------------------

@SETTINGS
@given(dtype=dtypes(), shape=small_shapes(), seed=st.integers(0, 2**32 - 1))
def test_empty_matches_numpy(dtype, shape, seed):
    if dtype not in SUPPORTED:
        with pytest.raises(pinmem.InvalidError):
            pinmem.empty(shape, dtype)
        return
    b = pinmem.empty(shape, dtype)
    a = np.asarray(b)
    assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
    assert b.nbytes == a.nbytes and b.shape == shape and b.strides == a.strides
    want = filled(dtype, shape, seed)
    a[...] = want
    assert np.asarray(b).tobytes() == want.tobytes()
    assert np.from_dlpack(b).tobytes() == want.tobytes()
    del a, b


@SETTINGS
@given(dtype=st.sampled_from(sorted(SUPPORTED, key=str)), shape=huge_shapes())
def test_empty_huge_is_refused_cleanly(dtype, shape):
    with pytest.raises((pinmem.InvalidError, pinmem.BudgetError)) as e:
        pinmem.empty(shape, dtype)
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    if nbytes > 2**63 - 1:
        assert isinstance(e.value, pinmem.InvalidError)  # the byte count overflows
    else:
        assert isinstance(e.value, pinmem.BudgetError)


# -- pin ------------------------------------------------------------------------------------

@SETTINGS
@given(dtype=dtypes(), shape=small_shapes(), layout=LAYOUTS, seed=st.integers(0, 2**32 - 1))
# Cases NumPy 2.5 cannot read back from its own buffer view (found on the GPU machine's
# versions of NumPy and Hypothesis), kept so every version runs them.
@example(dtype=np.dtype([("f0", "<i2"), ("f7", "?")]), shape=(), layout="step", seed=87671)
@example(dtype=np.dtype([("\x00", "?")]), shape=(), layout="C", seed=0)
@example(dtype=np.dtype("V5"), shape=(2, 2), layout="F", seed=0)
def test_pin_matches_numpy(dtype, shape, layout, seed):
    a = laid_out(filled(dtype, shape, seed), layout)
    contiguous = a.flags.c_contiguous or a.flags.f_contiguous
    exportable = numpy_exports(a) and not dtype.hasobject
    try:
        b = pinmem.pin(a)
    except PINMEM_ERRORS as e:
        # Refused exactly when NumPy's own view of it has nothing to pin, or no layout or
        # element type pinmem can keep.
        assert a.nbytes == 0 or not contiguous or not exportable, (a.dtype, a.strides, e)
        assert isinstance(e, pinmem.InvalidError), e
        return
    assert a.nbytes and contiguous and exportable
    with b:
        assert b.nbytes == a.nbytes and b.kind == "registered"
        info = pinmem.pointer_info(b)
        assert info["kind"] == "registered"
        assert same_view(b, a)
        if numpy_reads_back(a):
            got = np.asarray(b)
            assert got.shape == a.shape and got.tobytes() == a.tobytes()
            del got
    assert pinmem.pointer_info(a.__array_interface__["data"][0])["kind"] == "pageable"


# -- copy -----------------------------------------------------------------------------------

@SETTINGS
@given(dtype=dtypes(), shape=small_shapes(), layout=LAYOUTS, seed=st.integers(0, 2**32 - 1),
       dst_kind=st.sampled_from(["numpy", "pinned", "device"]))
def test_copy_matches_numpy(dtype, shape, layout, seed, dst_kind):
    src = laid_out(filled(dtype, shape, seed), layout)
    n = src.nbytes
    if dst_kind == "numpy":
        dst = np.zeros(n, np.uint8)
    elif dst_kind == "pinned":
        dst = pinmem.empty(n, "uint8")
        np.asarray(dst)[:] = 0
    else:
        dst = pinmem.device_empty(n, "uint8")
    try:
        pinmem.copy(dst, src).wait()
    except PINMEM_ERRORS as e:
        assert not src.flags.c_contiguous or dtype.hasobject, (src.strides, e)
        assert isinstance(e, pinmem.InvalidError), e
        return
    assert src.flags.c_contiguous and not dtype.hasobject
    if dst_kind == "device":
        back = np.zeros(n, np.uint8)
        pinmem.copy(back, dst).wait()
        dst = back
    assert np.asarray(dst).tobytes() == src.tobytes()


@SETTINGS
@given(shape=huge_shapes(), typestr=st.sampled_from(["<f4", "|u1", "<c16", "<i8"]))
def test_copy_cuda_array_interface_huge_or_bogus(shape, typestr):
    """A __cuda_array_interface__ or DLPack shape past any memory: refused, not wrapped."""
    class CAI:
        __cuda_array_interface__ = dict(data=(0x1000, False), shape=tuple(shape),
                                        typestr=typestr, version=3)
    out = np.zeros(16, np.uint8)
    with pytest.raises(pinmem.InvalidError):
        pinmem.copy(out, CAI())
    assert not out.any()


# -- Loader over NumPy arrays -----------------------------------------------------------------

@SETTINGS
@given(dtype=dtypes(), sample_shape=npst.array_shapes(min_dims=0, max_dims=3, min_side=1,
                                                      max_side=4),
       n=st.integers(1, 40), batch_size=st.integers(1, 16), drop_last=st.booleans(),
       layout=LAYOUTS, seed=st.integers(0, 2**32 - 1))
def test_loader_batches_match_numpy(dtype, sample_shape, n, batch_size, drop_last, layout, seed):
    a = laid_out(filled(dtype, (n,) + sample_shape, seed), layout)
    n = a.shape[0]  # a transposed layout has its own samples
    try:
        loader = pinmem.Loader(a, batch_size=batch_size, drop_last=drop_last, num_workers=2,
                               device="cpu", epochs=1)
    except PINMEM_ERRORS as e:
        # Refused: what has no pinmem element type (no whole batch with drop_last yields
        # nothing, as DataLoader).
        assert dtype not in SUPPORTED, e
        assert isinstance(e, pinmem.InvalidError), e
        return
    rows = []
    try:
        with loader:
            for batch in loader:
                x = np.array(batch)  # a copy: the slot goes back
                del batch
                rows.append(x)
    except PINMEM_ERRORS as e:
        assert dtype not in SUPPORTED, e
        return
    full = n // batch_size * batch_size if drop_last else n
    want = np.ascontiguousarray(a)[:full]
    if not rows:
        assert full == 0
        return
    got = np.concatenate(rows)
    if got.dtype == np.uint8 and dtype != np.uint8:
        # Records pinmem has no element type for arrive as their bytes, a row per sample.
        assert got.shape == (full, want.nbytes // max(full, 1))
        assert got.tobytes() == want.tobytes()
    else:
        assert got.dtype.kind == dtype.kind
        assert got.shape == want.shape
        assert got.astype(dtype).tobytes() == want.tobytes()


# -- Loader over Python datasets: odd attributes, odd samplers, other threads -----------------

WORKER_SETTINGS = settings(SETTINGS, max_examples=12)

# Attributes that once made a dataset look like something else (an array, a TensorDataset).
ODD_ATTRIBUTES = {"shape": (3,), "dtype": "float32", "tensors": [np.zeros(3)], "ndim": 1,
                  "size": 5, "__array_priority__": 10, "T": None, "data": b"xyz",
                  "indices": [1, 2], "sampler": None, "batch_size": 7}


def tagged_dataset_class(attrs):
    """A map-style dataset class with `attrs` as class attributes; sample i is [i, 2i, 3i]
    through its own __getitem__ (so a loader that bypasses it delivers something else)."""
    def getitem(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return np.array([i, 2 * i, 3 * i], dtype=np.int64) + self.offset

    def init(self, n):
        self.n, self.offset = n, 1000
    return type("Odd", (), dict(attrs, __init__=init, __getitem__=getitem,
                                __len__=lambda self: self.n))


@WORKER_SETTINGS
@given(names=st.sets(st.sampled_from(sorted(ODD_ATTRIBUTES))), n=st.integers(1, 30),
       batch_size=st.integers(1, 8), workers=st.sampled_from([0, 0, 1, 2]))
def test_loader_odd_dataset_attributes_go_through_getitem(names, n, batch_size, workers):
    cls = tagged_dataset_class({k: ODD_ATTRIBUTES[k] for k in names})
    with pinmem.Loader(cls(n), batch_size=batch_size, device="cpu", num_workers=workers,
                       epochs=1) as loader:
        got = np.concatenate([np.array(b) for b in loader])
    want = np.arange(n)[:, None] * np.array([1, 2, 3]) + 1000
    np.testing.assert_array_equal(got, want)


def index_kinds():
    """Every kind of thing a sampler might yield, and whether it is a valid index of 0..9."""
    valid = st.integers(0, 9).flatmap(lambda i: st.sampled_from([
        i, np.int64(i), np.int32(i), np.uint8(i), np.intp(i)]))
    bad = st.one_of(
        st.integers(-(2**70), -1), st.integers(10, 2**70),
        st.floats(allow_nan=True), st.sampled_from([True, False, None, "3", b"3", 2.0,
                                                     np.float64(1.0), [1], (1,), 1 + 0j]))
    return st.one_of(valid.map(lambda v: (v, True)), bad.map(lambda v: (v, False)))


@WORKER_SETTINGS
@given(items=st.lists(index_kinds(), min_size=1, max_size=12), batch_size=st.integers(1, 4))
def test_loader_sampler_of_every_kind_of_index(items, batch_size):
    sampler = [v for v, _ in items]
    bad = [k for k, (_, ok) in enumerate(items) if not ok]
    cls = tagged_dataset_class({})
    loader = pinmem.Loader(cls(10), batch_size=batch_size, sampler=sampler, device="cpu",
                           epochs=1)
    try:
        got = [(list(b.indices), np.array(b[0])[:, 0].tolist()) for b in loader.batches()]
    except pinmem.InvalidError as e:  # the sampler is iterated at the epoch's start
        assert bad, e
        assert f"position {bad[0]}" in str(e), (str(e), bad)
        return
    finally:
        loader.close()
    assert not bad, (sampler, bad)
    order = [int(v) for v in sampler]
    assert [i for idx, _ in got for i in idx] == order
    assert [x - 1000 for _, xs in got for x in xs] == order


@WORKER_SETTINGS
@given(call=st.sampled_from(["close", "state_dict", "len", "stats", "load_state_dict"]),
       delay=st.floats(0, 0.05), workers=st.sampled_from([0, 2]))
def test_loader_calls_from_another_thread(call, delay, workers):
    import threading
    import time

    class Slow:
        def __len__(self):
            return 64

        def __getitem__(self, i):
            time.sleep(0.001)
            return np.full(2, i, dtype=np.int64)
    loader = pinmem.Loader(Slow(), batch_size=4, device="cpu", num_workers=workers, epochs=2)
    errors = []

    def other():
        time.sleep(delay)
        try:
            if call == "close":
                loader.close()
            elif call == "load_state_dict":
                loader.load_state_dict(loader.state_dict())
            else:
                getattr(loader, call)() if call != "len" else len(loader)
        except pinmem.Error as e:  # BusyError (two consumers) or StateError are fine
            errors.append(e)
    t = threading.Thread(target=other)
    t.start()
    seen = []
    try:
        for b in loader:
            rows = np.array(b)
            assert (rows[:, 0] == rows[:, 1]).all()
            seen.extend(rows[:, 0].tolist())
    except pinmem.Error as e:
        assert call in ("close", "load_state_dict"), e
    t.join(60)
    assert not t.is_alive()
    assert len(set(seen)) == len(seen) or call == "load_state_dict"  # no row twice in an epoch
    if call == "close":
        with pytest.raises(pinmem.StateError):
            len(loader)
    else:
        for e in errors:
            assert isinstance(e, (pinmem.BusyError, pinmem.StateError)), e
    loader.close()
