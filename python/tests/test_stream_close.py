"""pinmem.Stream.close() while calls on other threads hold the stream.

A call that takes a stream holds it until it returns, also while it runs with the GIL released;
close() refuses later calls at once and leaves the destroy to the last call holding it. The
window is forced, not hoped for: the call runs a Python hook of the test's (an nbytes or offset
whose __index__ is called after the call parsed its stream and before the work it queues), which
tells the main thread to close the stream and waits until it has. A close() that destroyed the
stream there would leave the call queueing on a destroyed stream (under CUDA a use-after-free;
the host backend refuses the handle). On the host backend the handle the stream had is checked
directly: still usable until the last call returns, refused after. One test closes the stream
while the call waits inside the C library, the GIL released (a ring-bounce copy held behind a
gate).
"""
import os
import threading

import numpy as np
import pytest

import pinmem
from conftest import Gate, random_bytes

N = 1 << 20
WAIT = 60  # seconds: only a broken test waits that long; every wait is for an event


def host_backend():
    return pinmem.backend() == "host"


class Hook:
    """An int (for nbytes, an offset) whose __index__ runs `then` once, inside the call that
    parses it (only the first time, should the call read it more than once)."""

    def __init__(self, value, then):
        self.value, self.then, self.ran = value, then, False

    def __index__(self):
        if not self.ran:
            self.ran = True
            self.then()
        return self.value


class CloseFromOtherThread:
    """The hook of a call on a worker thread: signal the main thread, which closes the stream,
    and wait for it (threading waits release the GIL) before the call goes on to its work."""

    def __init__(self):
        self.inside = threading.Event()
        self.closed = threading.Event()

    def __call__(self):
        self.inside.set()
        assert self.closed.wait(WAIT), "the main thread never closed the stream"


def run_in_thread(fn):
    out = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out["error"] = e

    t = threading.Thread(target=body)
    t.start()
    return t, out


def close_during(call, s, handle):
    """Run call() on a thread; close s from this one while the call holds it. On the host
    backend, check that the handle stays usable until the call returns and is destroyed after.
    Returns what call() returned."""
    hook = CloseFromOtherThread()
    t, out = run_in_thread(lambda: call(hook))
    try:
        assert hook.inside.wait(WAIT), out.get("error")
        s.close()
        if host_backend():
            # Closed for calls, not destroyed: the call on the other thread still holds it.
            a = np.arange(16, dtype=np.uint8)
            b = np.zeros(16, dtype=np.uint8)
            pinmem.copy(b, a, handle).wait()
            np.testing.assert_array_equal(b, a)
        with pytest.raises(pinmem.StateError, match="pinmem.Stream is closed"):
            pinmem.copy(np.zeros(4, np.uint8), np.ones(4, np.uint8), s)
    finally:
        hook.closed.set()
        t.join(WAIT)
    assert not t.is_alive()
    assert "error" not in out, repr(out.get("error"))
    assert s.closed
    if host_backend():
        # The call returned: it was the last holder and destroyed the stream.
        with pytest.raises(pinmem.InvalidError, match="destroyed"):
            pinmem.copy(np.zeros(4, np.uint8), np.ones(4, np.uint8), handle)
    return out["value"]


def later_calls_refused(s):
    with pytest.raises(pinmem.StateError, match="closed"):
        s.synchronize()
    with pytest.raises(pinmem.StateError, match="closed"):
        s.query()
    with pytest.raises(pinmem.StateError, match="closed"):
        s.ptr
    with pytest.raises(pinmem.StateError, match="closed"):
        pinmem.device_empty(4, "uint8").fill(1, s)
    s.close()  # idempotent


@pytest.mark.parametrize("path", ["direct", "staged"])
def test_close_while_a_copy_holds_the_stream(rng, path):
    data = random_bytes(rng, N)
    src = pinmem.empty(N, "uint8") if path == "direct" else data
    if path == "direct":
        np.asarray(src)[:] = data
    dev = pinmem.device_empty(N, "uint8")
    out = np.zeros(N, dtype=np.uint8)
    s = pinmem.Stream()
    handle = s.ptr

    def call(hook):
        c = pinmem.copy(dev, src, s, nbytes=Hook(N, hook), path=path)
        c.wait()
        return c

    c = close_during(call, s, handle)
    assert c.done() and c.path == path
    pinmem.copy(out, dev).wait()
    np.testing.assert_array_equal(out, data)
    later_calls_refused(s)


def test_close_while_a_file_write_and_read_hold_the_stream(rng, tmp_path):
    data = random_bytes(rng, N)
    dev = pinmem.device_empty(N, "uint8")
    pinmem.copy(dev, data).wait()
    path = os.fspath(tmp_path / "f.bin")

    s = pinmem.Stream()
    handle = s.ptr
    close_during(lambda hook: pinmem.write_file(path, dev, nbytes=Hook(N, hook), stream=s).wait(),
                 s, handle)
    with open(path, "rb") as f:
        assert f.read() == data.tobytes()

    back = pinmem.device_empty(N, "uint8")
    s = pinmem.Stream()
    handle = s.ptr
    close_during(lambda hook: pinmem.read_file(path, back, nbytes=Hook(N, hook), stream=s).wait(),
                 s, handle)
    out = np.zeros(N, dtype=np.uint8)
    pinmem.copy(out, back).wait()
    np.testing.assert_array_equal(out, data)
    later_calls_refused(s)


def test_close_while_range_lists_hold_the_stream(rng, tmp_path):
    half = N // 2
    data = random_bytes(rng, N)
    path = os.fspath(tmp_path / "r.bin")
    s = pinmem.Stream()
    handle = s.ptr
    close_during(lambda hook: pinmem.write_ranges(
        path, [(0, data[:half]), (Hook(half, hook), data[half:])], stream=s), s, handle)
    with open(path, "rb") as f:
        assert f.read() == data.tobytes()

    devs = [pinmem.device_empty(half, "uint8") for _ in range(2)]
    s = pinmem.Stream()
    handle = s.ptr
    close_during(lambda hook: pinmem.read_ranges(
        path, [(0, devs[0]), (Hook(half, hook), devs[1])], stream=s), s, handle)
    for k, d in enumerate(devs):
        out = np.zeros(half, dtype=np.uint8)
        pinmem.copy(out, d).wait()
        np.testing.assert_array_equal(out, data[k * half:(k + 1) * half])
    later_calls_refused(s)


def test_close_from_inside_the_call_itself(rng):
    """close() from a hook the call runs, on the call's own thread: waiting there for the call
    to let go would never end; it returns, and the call finishes on the stream."""
    data = random_bytes(rng, N)
    dev = pinmem.device_empty(N, "uint8")
    out = np.zeros(N, dtype=np.uint8)
    s = pinmem.Stream()
    c = pinmem.copy(dev, data, s, nbytes=Hook(N, s.close))
    c.wait()
    assert s.closed
    pinmem.copy(out, dev).wait()
    np.testing.assert_array_equal(out, data)
    later_calls_refused(s)


def test_with_block_exit_while_another_thread_holds_the_stream(rng):
    data = random_bytes(rng, N)
    dev = pinmem.device_empty(N, "uint8")
    hook = CloseFromOtherThread()
    with pinmem.Stream() as s:
        t, out = run_in_thread(lambda: pinmem.copy(dev, data, s, nbytes=Hook(N, hook)).wait())
        try:
            assert hook.inside.wait(WAIT)
        except BaseException:
            hook.closed.set()
            raise
    hook.closed.set()  # __exit__ closed the stream, under the copy
    t.join(WAIT)
    assert not t.is_alive() and "error" not in out, repr(out.get("error"))
    assert s.closed
    back = np.zeros(N, dtype=np.uint8)
    pinmem.copy(back, dev).wait()
    np.testing.assert_array_equal(back, data)


def test_completion_of_a_closed_stream(rng):
    """A Completion outlives its stream: close() waits for the queued copy, the Completion
    still answers; wait_stream on the closed stream is refused, clearly."""
    data = random_bytes(rng, N)
    pinned = pinmem.empty(N, "uint8")
    np.asarray(pinned)[:] = data
    dev = pinmem.device_empty(N, "uint8")
    s = pinmem.Stream()
    with Gate(s) as gate:
        c = pinmem.copy(dev, pinned, s)
        assert not c.done()  # queued behind the gate
        gate.open()
    s.close()
    assert c.done()
    c.wait()
    with pytest.raises(pinmem.StateError, match="closed"):
        c.wait_stream(s)
    c.wait_stream(None)
    out = np.zeros(N, dtype=np.uint8)
    pinmem.copy(out, dev).wait()
    np.testing.assert_array_equal(out, data)


def test_completion_of_a_stream_closed_under_its_call(rng):
    """The Completion of a call that was the last to hold a closed stream: waitable, and
    done."""
    data = random_bytes(rng, N)
    pinned = pinmem.empty(N, "uint8")
    np.asarray(pinned)[:] = data
    dev = pinmem.device_empty(N, "uint8")
    s = pinmem.Stream()
    c = close_during(lambda hook: pinmem.copy(dev, pinned, s, nbytes=Hook(N, hook)), s, s.ptr)
    c.wait()
    assert c.done()
    out = np.zeros(N, dtype=np.uint8)
    pinmem.copy(out, dev).wait()
    np.testing.assert_array_equal(out, data)


def test_many_threads_and_one_close(rng):
    """Several calls hold the stream when it is closed: each finishes, the last destroys it."""
    k = 4
    data = [random_bytes(rng, N) for _ in range(k)]
    devs = [pinmem.device_empty(N, "uint8") for _ in range(k)]
    s = pinmem.Stream()
    handle = s.ptr
    hooks = [CloseFromOtherThread() for _ in range(k)]
    threads = [run_in_thread(lambda i=i: pinmem.copy(devs[i], data[i], s,
                                                     nbytes=Hook(N, hooks[i])).wait())
               for i in range(k)]
    for h in hooks:
        assert h.inside.wait(WAIT)
    s.close()
    for i, (h, (t, out)) in enumerate(zip(hooks, threads)):
        if host_backend():
            pinmem.copy(np.zeros(4, np.uint8), np.ones(4, np.uint8), handle).wait()
        h.closed.set()
        t.join(WAIT)
        assert not t.is_alive() and "error" not in out, repr(out.get("error"))
    if host_backend():
        with pytest.raises(pinmem.InvalidError, match="destroyed"):
            pinmem.copy(np.zeros(4, np.uint8), np.ones(4, np.uint8), handle)
    for d, want in zip(devs, data):
        out = np.zeros(N, dtype=np.uint8)
        pinmem.copy(out, d).wait()
        np.testing.assert_array_equal(out, want)


def test_close_while_a_copy_waits_inside_the_library(rng):
    """copy_bounce=ring: a staged copy's call waits for the stream's earlier work, here a gate,
    with the GIL released; close() from the main thread returns at once (it never waits for a
    call), the gate opens, the copy lands, and the call's return destroys the stream."""
    data = random_bytes(rng, N)
    dev = pinmem.device_empty(N, "uint8")
    s = pinmem.Stream()
    inside = threading.Event()
    pinmem.set_option("copy_bounce", "ring")
    try:
        with Gate(s) as gate:
            t, out = run_in_thread(
                lambda: pinmem.copy(dev, data, s, nbytes=Hook(N, inside.set)).wait())
            assert inside.wait(WAIT)
            s.close()  # the copy holds the stream (parsed; most likely waiting for the gate)
            with pytest.raises(pinmem.StateError, match="closed"):
                s.synchronize()
            assert t.is_alive()  # the ring waits for the gate: the call cannot have returned
            assert gate.open()
            t.join(WAIT)
    finally:
        pinmem.set_option("copy_bounce", None)
    assert not t.is_alive() and "error" not in out, repr(out.get("error"))
    back = np.zeros(N, dtype=np.uint8)
    pinmem.copy(back, dev).wait()
    np.testing.assert_array_equal(back, data)
