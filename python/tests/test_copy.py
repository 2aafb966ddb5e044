"""pinmem.copy, Completion and Stream on whatever backend is in force (host without a GPU)."""
import gc
import threading

import numpy as np
import pytest

import pinmem
from conftest import SMALL, Gate, random_bytes

SIZES = [1, 255, 4096, 65537, (1 << 20) + 3] + ([] if SMALL else [(3 << 20) + 17])


def round_trip(src_host, dst_host, n, stream=None, **kw):
    dev = pinmem.device_empty(n, "uint8")
    c1 = pinmem.copy(dev, src_host, stream, **kw)
    c2 = pinmem.copy(dst_host, dev, stream, **kw)
    c2.wait()
    assert c1.done() and c2.done()
    return c1, c2


@pytest.mark.parametrize("n", SIZES)
def test_pinned_round_trip(n, rng):
    src = pinmem.empty(n, "uint8")
    dst = pinmem.empty(n, "uint8")
    data = random_bytes(rng, n)
    np.asarray(src)[:] = data
    np.asarray(dst)[:] = ~data
    c1, c2 = round_trip(src, dst, n)
    np.testing.assert_array_equal(np.asarray(dst), data)
    assert c1.path == "direct" and c2.path == "direct"


@pytest.mark.parametrize("n", SIZES)
def test_pageable_round_trip(n, rng):
    data = random_bytes(rng, n)
    out = np.zeros(n, dtype=np.uint8)
    round_trip(data, out, n)
    np.testing.assert_array_equal(out, data)


def staged_size():
    """A pageable copy size the engine stages: just above copy_stage_min (odd on purpose)."""
    return pinmem.parse_size(pinmem.get_option("copy_stage_min")) + 4096 + 7


def test_pageable_large_is_staged(rng):
    n = staged_size()
    data = random_bytes(rng, n)
    out = np.zeros(n, dtype=np.uint8)
    c1, c2 = round_trip(data, out, n)
    np.testing.assert_array_equal(out, data)
    assert c1.path == "staged" and c2.path == "staged"


def test_pinned_numpy_array_is_direct(rng):
    x = rng.random(1 << 18)
    y = np.zeros_like(x)
    with pinmem.pin(x), pinmem.pin(y):
        c1, c2 = round_trip(x, y, x.nbytes)
        assert c1.path == "direct" and c2.path == "direct"
    np.testing.assert_array_equal(x, y)


def test_unaligned_and_typed(rng):
    x = rng.random(10001).astype(np.float32)
    src = pinmem.empty(x.shape, "float32")
    np.asarray(src)[:] = x
    dev = pinmem.device_empty(x.shape, "float32")
    pinmem.copy(dev, src).wait()
    raw = bytearray(x.nbytes + 3)
    view = memoryview(raw)[3:]  # an unaligned destination
    pinmem.copy(view, dev).wait()
    np.testing.assert_array_equal(np.frombuffer(view, dtype=np.float32), x)


def test_on_a_stream_and_wait_stream(rng):
    n = 1 << 20
    data = random_bytes(rng, n)
    src = pinmem.empty(n, "uint8")
    np.asarray(src)[:] = data
    dev = pinmem.device_empty(n, "uint8")
    out = pinmem.empty(n, "uint8")
    np.asarray(out)[:] = 0
    with pinmem.Stream() as s1, pinmem.Stream() as s2:
        assert s1.ptr != 0 and s1.cuda_stream == s1.ptr
        dev.fill(0x5A, stream=s1)
        s1.synchronize()
        with Gate(s1) as gate, Gate(s2, hold=False) as before:
            c1 = pinmem.copy(dev, src, s1)  # held behind the gate
            c1.wait_stream(s2)  # s2's later work waits for the H2D copy
            with Gate(s2, hold=False) as after:  # s2's own work, nothing to do with dev
                c2 = pinmem.copy(out, dev, s2)
                # s2 runs up to the wait... (The CUDA driver runs a context's host functions
                # on one thread, so there `before` waits behind the held gate; the bytes that
                # arrive in `out` show the order.)
                assert pinmem.backend() == "cuda" or before.reached(10)
                assert not after.reached(0.2)  # ...and no further while the gate holds c1
                assert not c1.done() and not c2.done() and not s2.query()
                assert gate.open()
                s2.synchronize()
                assert after.reached(0)
        assert s2.query()
        assert c2.done()
    np.testing.assert_array_equal(np.asarray(out), data)


def test_stream_handles_as_ints(rng):
    n = 4096
    data = random_bytes(rng, n)
    s = pinmem.Stream()
    out = np.zeros(n, dtype=np.uint8)
    dev = pinmem.device_empty(n, "uint8")
    pinmem.copy(dev, data, s.ptr).wait()

    class Like:  # torch.cuda.Stream-style and CuPy-style stream objects
        def __init__(self, h, attr):
            setattr(self, attr, h)
    pinmem.copy(out, dev, Like(s.ptr, "cuda_stream")).wait()
    np.testing.assert_array_equal(out, data)
    out[:] = 0
    pinmem.copy(out, dev, Like(s.ptr, "ptr")).wait()
    np.testing.assert_array_equal(out, data)
    s.close()
    with pytest.raises(pinmem.StateError):
        pinmem.copy(out, dev, s)
    with pytest.raises(TypeError):
        pinmem.copy(out, dev, "stream")
    with pytest.raises(pinmem.InvalidError, match="below 2\\*\\*64"):
        pinmem.copy(out, dev, 1 << 64)  # was a bare OverflowError


def test_dropped_completion_keeps_memory_alive(rng):
    """Drop the Completion and the buffers right after submitting: the copy still lands."""
    n = 2 << 20
    data = random_bytes(rng, n)
    out = pinmem.empty(n, "uint8")
    view = np.asarray(out)
    view[:] = 0
    s = pinmem.Stream()
    for _ in range(4):
        src = pinmem.empty(n, "uint8")
        np.asarray(src)[:] = data
        dev = pinmem.device_empty(n, "uint8")
        pinmem.copy(dev, src, s)
        pinmem.copy(out, dev, s)
        del src, dev  # only the parked copies hold them now
        gc.collect()
    s.synchronize()
    np.testing.assert_array_equal(view, data)
    assert pinmem._pinmem._pending_copies() == 0


class _Staged:
    """Pinned memory that exports itself by DLPack and keeps the Completion of its last
    transfer: the object and its Completion are a reference cycle."""

    def __init__(self, data):
        self.buf = pinmem.empty(len(data), "uint8")
        np.asarray(self.buf)[:] = data

    def __dlpack__(self, *args, **kwargs):
        return self.buf.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.buf.__dlpack_device__()


def test_an_object_holding_the_completion_of_its_copy_is_collected(rng):
    """A Completion never waited for, held by the object it copied from, was a cycle the
    collector could not see: the object and its pinned memory stayed for ever. Collected now,
    and a copy still in flight keeps its memory until it is done."""
    n = 1 << 20
    data = random_bytes(rng, n)
    dev = pinmem.device_empty(n, "uint8")
    gc.collect()
    before = pinmem.stats()["in_use_bytes"]
    done = _Staged(data)
    done.done = pinmem.copy(dev, done)
    done.done.wait()
    with pinmem.Stream() as s, Gate(s) as gate:
        flight = _Staged(data[::-1])
        flight.done = pinmem.copy(dev, flight, s)
        del done, flight
        gc.collect()
        assert pinmem.stats()["in_use_bytes"] >= before + n  # held by the copy in flight
        assert gate.open()
    pinmem.synchronize()
    pinmem._pinmem._pending_copies()  # parked copies that are done let go
    assert pinmem.stats()["in_use_bytes"] == before
    out = np.zeros(n, dtype=np.uint8)
    pinmem.copy(out, dev).wait()
    np.testing.assert_array_equal(out, data[::-1])


def test_completion_holds_buffer_busy(rng):
    """While a copy is in flight (held behind a gate) its buffers cannot be released; once it
    completed they can, and the bytes arrived."""
    n = 1 << 20
    data = random_bytes(rng, n)
    src = pinmem.empty(n, "uint8")
    np.asarray(src)[:] = data
    dev = pinmem.device_empty(n, "uint8")
    with pinmem.Stream() as s, Gate(s) as gate:
        c = pinmem.copy(dev, src, s)
        for b in (src, dev):
            with pytest.raises(pinmem.BusyError, match="in flight"):
                b.release()
            assert not b.released
        assert not c.done()
        assert gate.open()
        c.wait()
    src.release()  # done: nothing holds it any more
    assert src.released
    out = np.zeros(n, dtype=np.uint8)
    pinmem.copy(out, dev).wait()
    np.testing.assert_array_equal(out, data)
    dev.release()
    assert dev.released


def test_nbytes_and_size_checks(rng):
    data = random_bytes(rng, 1000)
    small = np.zeros(10, dtype=np.uint8)
    with pytest.raises(pinmem.InvalidError):
        pinmem.copy(small, data)
    pinmem.copy(small, data, nbytes=10).wait()
    np.testing.assert_array_equal(small, data[:10])
    with pytest.raises(pinmem.InvalidError):
        pinmem.copy(small, data, nbytes=11)
    with pytest.raises(pinmem.InvalidError):
        pinmem.copy(bytes(10), data, nbytes=5)  # read-only destination
    with pytest.raises(TypeError):
        pinmem.copy(small, object())
    with pytest.raises(pinmem.InvalidError):
        pinmem.copy(small, data, nbytes=4, path="sideways")
    c = pinmem.copy(small, data, nbytes=0)
    c.wait()
    assert c.done()
    # Sizes computed with NumPy or torch are integers too (they raised TypeError); a bool is not.
    small[:] = 0
    pinmem.copy(small, data, nbytes=np.int64(4)).wait()
    np.testing.assert_array_equal(small[:4], data[:4])
    assert not small[4:].any()
    assert pinmem.parse_size(np.uint64(1 << 20)) == 1 << 20
    with pytest.raises(TypeError, match="not bool"):
        pinmem.copy(small, data, nbytes=True)
    with pytest.raises(pinmem.InvalidError, match="negative"):
        pinmem.copy(small, data, nbytes=np.int64(-1))


def test_wrong_path_is_an_error_with_status(rng):
    a = np.zeros(100, dtype=np.uint8)
    b = random_bytes(rng, 100)
    with pytest.raises(pinmem.InvalidError) as e:
        pinmem.copy(a, b, path="staged")  # host to host cannot be staged
    assert e.value.status == "PM_ERR_INVALID" and "pm_copy_async" in e.value.message


class RaisingInterface:
    """An object whose __cuda_array_interface__ property raises (a library's own check)."""

    @property
    def __cuda_array_interface__(self):
        raise KeyError("the tensor was freed")


def test_a_raising_array_interface_gives_its_own_error(tmp_path):
    dst = np.zeros(4, np.uint8)
    for call in (lambda: pinmem.copy(dst, RaisingInterface()),
                 lambda: pinmem.copy(RaisingInterface(), dst),
                 lambda: pinmem.write_file(tmp_path / "f.bin", RaisingInterface())):
        with pytest.raises(KeyError, match="the tensor was freed"):
            call()
    with pytest.raises(TypeError, match="not memory pinmem can copy"):  # no interface at all
        pinmem.copy(dst, object())
    assert not (tmp_path / "f.bin").exists()


def test_a_masked_cuda_array_interface_is_refused():
    dev = pinmem.device_empty(16, "uint8")

    class Masked:
        def __init__(self, mask):
            self.__cuda_array_interface__ = {"data": (dev.ptr, False), "shape": (16,),
                                             "typestr": "|u1", "version": 3, "mask": mask}
    out = np.zeros(16, np.uint8)
    # The protocol asks a consumer that cannot honour a mask to refuse it; it was ignored.
    with pytest.raises(pinmem.InvalidError, match="mask"):
        pinmem.copy(out, Masked(Masked(None)))
    pinmem.copy(out, Masked(None)).wait()  # mask None: no mask


def test_device_buffer_fill_and_dlpack_ordering(rng):
    dev = pinmem.device_empty((64, 16), "uint8")
    assert dev.kind == "device"
    with pytest.raises(BufferError):
        memoryview(dev)  # no CPU view
    s = pinmem.Stream()
    dev.fill(0xA5, stream=s)
    out = np.zeros((64, 16), dtype=np.uint8)
    pinmem.copy(out, dev, s).wait()
    assert (out == 0xA5).all()
    if pinmem.backend() == "host":
        # On the host backend device memory is host memory: DLPack exports it as CPU memory,
        # after the pending write is complete. The fill is held behind a gate that another
        # thread opens later: an export that did not wait would see the old bytes.
        with Gate(s) as gate:
            dev.fill(0x3C, stream=s)
            assert (out == 0xA5).all()
            opener = threading.Timer(0.3, gate.open)
            opener.start()
            a = np.from_dlpack(dev)
            assert a.shape == (64, 16) and (a == 0x3C).all()
            opener.join()
            assert gate.open()  # it held the fill until the timer opened it


def test_concurrent_waiters(rng):
    n = staged_size()
    data = random_bytes(rng, n)
    out = np.zeros(n, dtype=np.uint8)
    dev = pinmem.device_empty(n, "uint8")
    pinmem.copy(dev, data).wait()
    errors = []
    with pinmem.Stream() as s, Gate(s) as gate:
        c = pinmem.copy(out, dev, s)  # behind the gate: the waiters must block until it opens

        def waiter():
            try:
                c.wait()
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)
        threads = [threading.Thread(target=waiter) for _ in range(4)]
        for t in threads:
            t.start()
        threads[0].join(0.2)
        assert all(t.is_alive() for t in threads) and not c.done()
        assert gate.open()
        while not c.done():  # done here while the waiters may still be inside the wait:
            pass
        assert c.path == "staged"  # the path is known as soon as the copy is
        for t in threads:
            t.join()
    assert not errors and c.done() and c.path == "staged"
    np.testing.assert_array_equal(out, data)


def test_threads_copy_at_once(rng):
    n = 256 << 10
    results = {}

    def worker(k):
        r = np.random.default_rng(k)
        data = random_bytes(r, n)
        out = np.zeros(n, dtype=np.uint8)
        with pinmem.Stream() as s:
            for _ in range(3):
                dev = pinmem.device_empty(n, "uint8")
                pinmem.copy(dev, data, s)
                pinmem.copy(out, dev, s).wait()
        results[k] = np.array_equal(out, data)
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: True, 1: True, 2: True, 3: True}
