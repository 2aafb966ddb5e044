"""pinmem.read_file / write_file and pinmem.safetensors, on whatever backend is in force (host
without a GPU). Files are checked byte for byte against what Python's own file I/O sees; the
safetensors files against the `safetensors` package, both ways. Injected I/O errors run in a
child interpreter (PINMEM_FAULT is read once, at the first pm_init) with a timeout."""
import errno
import fcntl
import gc
import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import pinmem
from conftest import SMALL, random_bytes, skip_unless_torch

# Odd sizes around O_DIRECT's 4 KiB alignment and past the bounce slots (file_chunk 2 MiB,
# file_direct_chunk and file_write_chunk 1 MiB).
SIZES = [1, 4095, 4097, 65537, (1 << 20) + 3] + ([] if SMALL else [(17 << 20) + 5])
OFFSETS = [0, 1, 4096, 12345]
IOS = ["buffered", "direct", "auto"]


def open_fds():
    """The descriptors open now, without the one the listing itself used (closed by the time
    it is checked; counting it made the numbers shift whenever another fd was open)."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            os.fstat(int(name))
        except OSError:
            continue
        out.add(name)
    return out


_backend_started = []


def start_backend():
    """The backend's own descriptors (the CUDA driver opens its device files and event fds on
    first use, and keeps them) are opened once, before any test counts descriptors."""
    if not _backend_started:
        pinmem.init()
        d = pinmem.device_empty((4096,), "uint8")
        pinmem.copy(d, pinmem.empty((4096,), "uint8")).wait()
        del d
        try:  # torch's CUDA runtime opens descriptors of its own at its first use, and keeps them
            import torch
            if torch.cuda.is_available():
                torch.ones(1, device="cuda").cpu()
        except ImportError:
            pass
        _backend_started.append(True)


@pytest.fixture
def no_fd_leak():
    start_backend()
    gc.collect()
    before = open_fds()
    yield
    gc.collect()
    # Files replaced by saves are freed by a background thread: its descriptors go once idle.
    assert pinmem.safetensors._releaser.wait_idle(timeout=60)
    # A leak stays; a descriptor another thread holds for a moment (the interpreter's, a
    # library's) goes: look again for up to 2 s before calling it a leak.
    deadline = time.monotonic() + 2
    leaked = open_fds() - before
    while leaked and time.monotonic() < deadline:
        time.sleep(0.05)
        leaked = open_fds() - before
    assert not leaked, "file descriptors left open: %s" % sorted(
        (fd, os.path.realpath("/proc/self/fd/" + fd)) for fd in leaked)


def skip_unless_safetensors():
    try:
        import safetensors  # noqa: F401
    except ImportError:
        pytest.skip("the safetensors package is not installed (pip install safetensors; "
                    "tools/deps.sh installs it): round-trips against it not tested here")


def run_child(code, tmp_path, env_extra, timeout=120):
    env = dict(os.environ, PYTHONFAULTHANDLER="1", **env_extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"child failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


def write_background(path, rng, n):
    """A file of n random bytes (what a write at an offset must leave around its range)."""
    data = random_bytes(rng, n)
    with open(path, "wb") as f:
        f.write(data.tobytes())
    return data


# ---- read_file / write_file --------------------------------------------------------------

def make_dst(kind, n):
    """(destination, function giving its bytes as a NumPy array)."""
    if kind == "numpy":
        a = np.zeros(n, np.uint8)
        return a, lambda: a
    if kind == "pinned":
        b = pinmem.empty(n, "uint8")
        np.asarray(b)[:] = 0
        return b, lambda: np.asarray(b)
    d = pinmem.device_empty(n, "uint8")

    def back():
        out = np.zeros(n, np.uint8)
        pinmem.copy(out, d).wait()
        return out
    return d, back


def make_src(kind, data):
    if kind == "numpy":
        return data
    if kind == "pinned":
        b = pinmem.empty(data.size, "uint8")
        np.asarray(b)[:] = data
        return b
    d = pinmem.device_empty(data.size, "uint8")
    pinmem.copy(d, data).wait()
    return d


@pytest.mark.parametrize("io", IOS)
@pytest.mark.parametrize("kind", ["numpy", "pinned", "device"])
@pytest.mark.parametrize("n", SIZES)
def test_write_then_read_round_trip(n, kind, io, tmp_path, rng, no_fd_leak):
    offset = OFFSETS[(n + len(kind) + len(io)) % len(OFFSETS)]
    path = tmp_path / "f.bin"
    around = write_background(path, rng, offset + n + 4099)
    data = random_bytes(rng, n)
    c = pinmem.write_file(path, make_src(kind, data), offset, io=io, truncate=False)
    assert isinstance(c, pinmem.Completion) and c.done()
    raw = np.fromfile(path, np.uint8)
    assert raw.size == around.size  # truncate=False: the file keeps its length
    np.testing.assert_array_equal(raw[offset:offset + n], data)
    np.testing.assert_array_equal(raw[:offset], around[:offset])
    np.testing.assert_array_equal(raw[offset + n:], around[offset + n:])

    dst, contents = make_dst(kind, n)
    c = pinmem.read_file(path, dst, offset, io=io)
    c.wait()
    assert c.done()
    np.testing.assert_array_equal(contents(), data)


@pytest.mark.parametrize("io", IOS)
@pytest.mark.parametrize("kind", ["numpy", "pinned", "device"])
def test_offsets_past_4_gib(kind, io, tmp_path, rng, no_fd_leak):
    """Ranges that cross 2^32 and that start past it (a large model's checkpoint), in a sparse
    file: the bytes land where asked, the holes beside them stay zero, the file keeps its size
    and reads back the same through pinmem."""
    path = tmp_path / "far.bin"
    size = 6 << 32
    try:
        with open(path, "wb") as f:
            f.truncate(size)
    except OSError as e:
        pytest.skip(f"no sparse file of 24 GiB in {tmp_path}: {e}")
    n = 300_001
    for offset in ((1 << 32) - 100_003, (5 << 32) + 4099):
        data = random_bytes(rng, n)
        pinmem.write_file(path, make_src(kind, data), offset, io=io, truncate=False)
        assert os.path.getsize(path) == size
        with open(path, "rb") as f:
            f.seek(offset - 4096)
            around = np.frombuffer(f.read(n + 8192), np.uint8)
        np.testing.assert_array_equal(around[4096:4096 + n], data)
        assert not around[:4096].any() and not around[4096 + n:].any()
        dst, contents = make_dst(kind, n + 8192)
        pinmem.read_file(path, dst, offset - 4096, io=io).wait()
        np.testing.assert_array_equal(contents(), around)


@pytest.mark.parametrize("io", IOS)
@pytest.mark.parametrize("offset", OFFSETS)
def test_read_part_of_dst(offset, io, tmp_path, rng):
    n = 3 * 4096 + 11
    file = write_background(tmp_path / "f.bin", rng, offset + n)
    dst = pinmem.empty(n + 100, "uint8")
    np.asarray(dst)[:] = 7
    pinmem.read_file(tmp_path / "f.bin", dst, offset, nbytes=n, io=io).wait()
    np.testing.assert_array_equal(np.asarray(dst)[:n], file[offset:])
    assert (np.asarray(dst)[n:] == 7).all()  # past nbytes: untouched


def test_write_truncates_by_default(tmp_path, rng):
    path = tmp_path / "f.bin"
    write_background(path, rng, 100000)
    data = random_bytes(rng, 333)
    pinmem.write_file(path, data, 10, fsync=True).wait()
    raw = np.fromfile(path, np.uint8)
    assert raw.size == 343
    assert not raw[:10].any()  # the hole before the offset reads as zeros
    np.testing.assert_array_equal(raw[10:], data)


def test_bad_write_leaves_file(tmp_path, rng):
    """A write refused for its arguments does not empty the file first."""
    path = tmp_path / "f.bin"
    before = write_background(path, rng, 5000)
    for kw in ({"nbytes": 64}, {"io": "fast"}, {"offset": -1}):
        with pytest.raises(pinmem.InvalidError):
            pinmem.write_file(path, np.zeros(32, np.uint8), **kw)
    with pytest.raises(TypeError):
        pinmem.write_file(path, [1, 2, 3])
    np.testing.assert_array_equal(np.fromfile(path, np.uint8), before)


def test_failed_write_leaves_file(tmp_path, rng):
    """A write that fails inside the C call (an offset past the largest file offset, a range
    the filesystem cannot hold, the pinned budget spent while a device source is staged) leaves
    an existing file as it was, its bytes and its length: it is cut to the bytes written only
    once they are in it."""
    path = tmp_path / "f.bin"
    before = write_background(path, rng, 5000)
    for offset, cls in ((1 << 63, pinmem.InvalidError), (1 << 62, pinmem.Error)):
        with pytest.raises(cls):
            pinmem.write_file(path, np.ones(10, np.uint8), offset=offset)
        np.testing.assert_array_equal(np.fromfile(path, np.uint8), before)
    src = pinmem.device_empty(1 << 20, "u1")
    budget = pinmem.budget()
    gc.collect()
    pinmem.trim()
    pinmem.set_budget(4096)
    try:
        with pytest.raises(pinmem.BudgetError):
            pinmem.write_file(path, src)
    finally:
        pinmem.set_budget(budget)
    np.testing.assert_array_equal(np.fromfile(path, np.uint8), before)
    src.release()


def test_write_failing_midway_leaves_no_whole_looking_file(tmp_path):
    """write_file (truncate=True) over a file of the same size that fails after its first
    bytes are in (an I/O error at the second 1 MiB unit) leaves the file empty, as O_TRUNC
    would have, not at its old length holding part of the new bytes and part of the old ones
    (a reader would take that for a whole file). A failure before the first byte (the
    reservation of a range past the end) still leaves the file as it was."""
    out = run_child("""
        import os, numpy as np, pinmem
        for io in ("buffered", "direct"):
            with open("f.bin", "wb") as f:
                f.write(b"\\x11" * (3 << 20))
            try:
                pinmem.write_file("f.bin", np.full(3 << 20, 0xAA, np.uint8), io=io)
                print("written", io)
            except pinmem.IoError as e:
                print("IoError", io, os.path.getsize("f.bin"), "pwrite" in str(e))
        # truncate=False past the end (a gap before the range): the length given back
        with open("f.bin", "wb") as f:
            f.write(b"\\x11" * 5000)
        try:
            pinmem.write_file("f.bin", np.ones(3 << 20, np.uint8), 1 << 16, truncate=False)
        except pinmem.IoError as e:
            print("IoError", open("f.bin", "rb").read() == b"\\x11" * 5000)
        """, tmp_path, {"PINMEM_FAULT": "file_write=2+"})
    assert out.splitlines() == ["IoError buffered 0 True", "IoError direct 0 True",
                                "IoError True"], out
    out = run_child("""
        import os, numpy as np, pinmem
        with open("f.bin", "wb") as f:
            f.write(b"\\x11" * 5000)
        try:
            pinmem.write_file("f.bin", np.full(1 << 20, 0xAA, np.uint8), 4096)
        except pinmem.IoError as e:
            print("IoError", "fallocate" in str(e), open("f.bin", "rb").read() == b"\\x11" * 5000)
        """, tmp_path, {"PINMEM_FAULT": "file_reserve=1"})
    assert out.splitlines() == ["IoError True True"], out


@pytest.mark.parametrize("at", [8192, 2 << 20], ids=["gap_before_its_range", "past_its_end"])
def test_failed_write_keeps_what_another_write_put_past_the_old_end(at, tmp_path):
    """A write_file past the end that fails gives the length back, but only what it added
    itself: another thread's write that completed meanwhile, in the gap before its range or
    past its end, stays in the file. The failing write is held on its stream (a gate) after
    reserving its range, the other one runs, then the failing one's first pwrite fails
    (file_write=2; the other write's one pwrite is the first). The old code cut the file to
    its old length, and the other call's bytes, reported written, were gone."""
    out = run_child(f"""
        import os, threading, time, numpy as np, pinmem
        from pinmem import _pinmem
        with open("f.bin", "wb") as f:
            f.write(b"\\x11" * 5000)
        s = pinmem.Stream()
        gate = _pinmem._stream_gate(s, True)
        failed = []
        def failing():
            try:
                pinmem.write_file("f.bin", np.full(1 << 20, 0xAA, np.uint8), 1 << 16,
                                  truncate=False, stream=s, io="buffered")
            except pinmem.IoError as e:
                failed.append(str(e))
        t = threading.Thread(target=failing)
        t.start()
        deadline = time.monotonic() + 60
        while os.path.getsize("f.bin") != (1 << 16) + (1 << 20):  # its reservation
            assert time.monotonic() < deadline, "no reservation"
            time.sleep(0.001)
        pinmem.write_file("f.bin", np.full(100, 0xBB, np.uint8), {at}, truncate=False)
        _pinmem._gate_open(gate)
        t.join()
        raw = open("f.bin", "rb").read()
        print(len(failed), "pwrite" in failed[0], raw[:5000] == b"\\x11" * 5000,
              raw[{at}:{at} + 100] == b"\\xbb" * 100)
        """, tmp_path, {"PINMEM_FAULT": "file_write=2"})
    assert out.splitlines() == ["1 True True True"], out


def test_read_through_an_o_direct_descriptor(tmp_path, rng):
    """fd= opened with O_DIRECT (as a loader that opens its checkpoints so does): every io mode
    reads any offset and length into memory of any alignment. pinmem's buffered reads and a
    direct read's unaligned edges went through that descriptor and failed with EINVAL."""
    path = tmp_path / "f.bin"
    data = write_background(path, rng, 3 << 20)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as e:
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT: {e}")
    try:
        for io in ("buffered", "direct", "auto"):
            for off, n in ((0, 4096), (1, 100), (4095, 5000), (12345, 1 << 20)):
                dst = np.zeros(n + 1, np.uint8)[1:]  # not 4 KiB aligned
                pinmem.read_file(path, dst, off, io=io, fd=fd).wait()
                np.testing.assert_array_equal(dst, data[off:off + n])
                dst[:] = 0
                pinmem.read_ranges(path, [(off, dst)], io=io, fd=fd)
                np.testing.assert_array_equal(dst, data[off:off + n])
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT  # the caller's flags stay
    finally:
        os.close(fd)


def test_failed_write_creates_no_file(tmp_path):
    """A write that fails leaves no file where there was none (write_file and write_ranges
    create the file they write); one that works keeps the file it created."""
    new = tmp_path / "new.bin"
    for call in (lambda: pinmem.write_file(new, np.ones(10, np.uint8), offset=1 << 63),
                 lambda: pinmem.write_file(new, object()),
                 lambda: pinmem.write_ranges(new, [(0, np.ones(8, np.uint8)), (4, b"1234")])):
        with pytest.raises((pinmem.Error, TypeError)):
            call()
        assert not new.exists()
    pinmem.write_file(new, np.ones(10, np.uint8))
    assert new.read_bytes() == b"\x01" * 10


def test_an_exception_while_the_ranges_are_read_goes_through(tmp_path):
    """A generator of ranges that raises, or a sequence whose __len__ fails, raised InvalidError
    "ranges must be a sequence" (KeyboardInterrupt too); its own exception comes through now, and
    only what is no sequence at all is refused as such."""
    path = tmp_path / "r.bin"
    path.write_bytes(bytes(range(256)))

    def ranges():
        yield (0, bytearray(4))
        raise KeyError("made by the generator")

    class Broken:
        def __len__(self):
            raise KeyboardInterrupt

        def __getitem__(self, i):
            raise IndexError

    for call in (pinmem.read_ranges, pinmem.write_ranges):
        with pytest.raises(KeyError, match="made by the generator"):
            call(path, ranges())
        with pytest.raises(KeyboardInterrupt):
            call(path, Broken())
        with pytest.raises(pinmem.InvalidError, match="ranges must be a sequence"):
            call(path, 5)
    assert path.read_bytes() == bytes(range(256))
    new = tmp_path / "new.bin"
    with pytest.raises(KeyError):
        pinmem.write_ranges(new, ranges())
    assert not new.exists()


def test_ranges_list_changed_during_the_call(tmp_path):
    """Python code that runs while a list of ranges is read (an offset's __index__, a source's
    __dlpack__) and empties the list: the call works on the ranges it was given (they are
    taken first), never on freed items. In a child process, so that a crash is a failure."""
    script = textwrap.dedent(f"""
        import numpy as np, pinmem
        path = {str(tmp_path / "r.bin")!r}
        open(path, "wb").write(bytes(range(256)) * 16)
        ranges = []
        class Off:
            def __index__(self):
                ranges.clear()
                return 16
        dst = [bytearray(10) for _ in range(10)]
        ranges += [(0, dst[0]), (Off(), dst[1])] + [(100 * i + 100, dst[i]) for i in range(2, 10)]
        pinmem.read_ranges(path, ranges)
        data = open(path, "rb").read()
        assert bytes(dst[1]) == data[16:26] and bytes(dst[9]) == data[1000:1010]
        class Src:
            def __init__(self):
                self.a = np.full(10, 7, np.uint8)
            def __dlpack__(self, *args, **kwargs):
                ranges.clear()
                return self.a.__dlpack__(*args, **kwargs)
            def __dlpack_device__(self):
                return self.a.__dlpack_device__()
        ranges += [(0, b"a" * 10), (16, Src())] + [(100 * i + 100, b"b" * 10) for i in range(8)]
        pinmem.write_ranges(path, ranges)
        raw = open(path, "rb").read()
        assert raw[16:26] == bytes([7] * 10) and raw[800:810] == b"b" * 10
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode, out.stderr)


@pytest.mark.parametrize("io", IOS)
def test_write_to_a_device_file(io, rng, no_fd_leak):
    """A device has no length to empty: write_file("/dev/null", ...) writes like any file (as
    O_TRUNC would), in every io mode, and fsync=True says the device cannot sync."""
    if not os.access("/dev/null", os.W_OK):
        pytest.skip("/dev/null is not writable here")
    data = random_bytes(rng, 70 << 20)  # past the 64 MiB where auto goes direct
    for n in (5, data.size):
        assert pinmem.write_file("/dev/null", data, nbytes=n, io=io).done()
    with pytest.raises(pinmem.IoError, match=r"/dev/null.*fdatasync"):
        pinmem.write_file("/dev/null", data, nbytes=5, io=io, fsync=True)


def test_write_creates_file_and_nbytes(tmp_path, rng):
    path = tmp_path / "new.bin"
    data = random_bytes(rng, 5000)
    pinmem.write_file(str(path), data, nbytes=4097)
    np.testing.assert_array_equal(np.fromfile(path, np.uint8), data[:4097])


def test_write_from_bytes_and_memoryview(tmp_path, rng):
    data = random_bytes(rng, 999).tobytes()
    pinmem.write_file(tmp_path / "a", data)
    pinmem.write_file(tmp_path / "b", memoryview(data)[3:])
    assert (tmp_path / "a").read_bytes() == data
    assert (tmp_path / "b").read_bytes() == data[3:]


def test_read_units_by_option(tmp_path, rng):
    """file_chunk (page-cache reads) and file_direct_chunk (O_DIRECT reads), set apart and to 0
    (= file_chunk), read an odd range into device memory byte for byte in every io mode; a bad
    value is refused and changes nothing."""
    n, off = 300001, 4093
    data = write_background(tmp_path / "f.bin", rng, off + n)
    try:
        for chunk, direct in (("64K", "20000"), ("48K", "0"), ("20000", "128K")):
            pinmem.set_option("file_chunk", chunk)
            pinmem.set_option("file_direct_chunk", direct)
            for io in IOS:
                d, contents = make_dst("device", n)
                pinmem.read_file(tmp_path / "f.bin", d, off, io=io).wait()
                np.testing.assert_array_equal(contents(), data[off:], err_msg="%s/%s %s" % (
                    chunk, direct, io))
        with pytest.raises(pinmem.ConfigError):
            pinmem.set_option("file_direct_chunk", "lots")
        assert pinmem.get_option("file_direct_chunk") == "128K"
    finally:
        for k in ("file_chunk", "file_direct_chunk"):
            pinmem.set_option(k, None)


def test_read_with_stream(tmp_path, rng):
    data = write_background(tmp_path / "f.bin", rng, 70001)
    s = pinmem.Stream()
    d = pinmem.device_empty(70001, "uint8")
    c = pinmem.read_file(tmp_path / "f.bin", d, stream=s)
    c.wait_stream(s)
    out = np.zeros(70001, np.uint8)
    pinmem.copy(out, d, s).wait()
    np.testing.assert_array_equal(out, data)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        pinmem.read_file(tmp_path / "nope.bin", np.zeros(4, np.uint8))


def test_dst_too_small(tmp_path, rng, no_fd_leak):
    write_background(tmp_path / "f.bin", rng, 100)
    with pytest.raises(pinmem.InvalidError, match=r"f\.bin.*nbytes=64 but dst has only 32"):
        pinmem.read_file(tmp_path / "f.bin", np.zeros(32, np.uint8), nbytes=64)
    with pytest.raises(pinmem.InvalidError, match=r"nbytes=64 but src has only 32"):
        pinmem.write_file(tmp_path / "g.bin", np.zeros(32, np.uint8), nbytes=64)


@pytest.mark.parametrize("io", IOS)
def test_range_past_end(io, tmp_path, rng, no_fd_leak):
    write_background(tmp_path / "f.bin", rng, 10000)
    dst = np.zeros(5000, np.uint8)
    with pytest.raises(pinmem.IoError, match=r"read_file\('.*f\.bin'\).*ends at byte 10000") as e:
        pinmem.read_file(tmp_path / "f.bin", dst, 6000, io=io)
    assert e.value.status == "PM_ERR_IO"
    with pytest.raises(pinmem.IoError, match="ends at byte 10000"):
        pinmem.read_file(tmp_path / "f.bin", pinmem.device_empty(1, "uint8"), 10000, io=io)


def test_bad_arguments(tmp_path, rng, no_fd_leak):
    write_background(tmp_path / "f.bin", rng, 100)
    with pytest.raises(pinmem.InvalidError, match="io must be"):
        pinmem.read_file(tmp_path / "f.bin", np.zeros(4, np.uint8), io="fast")
    with pytest.raises(pinmem.InvalidError, match="offset"):
        pinmem.read_file(tmp_path / "f.bin", np.zeros(4, np.uint8), -1)
    with pytest.raises(pinmem.InvalidError, match="dst is read-only"):
        pinmem.read_file(tmp_path / "f.bin", b"1234")
    for call in (lambda: pinmem.read_file(tmp_path / "f.bin", np.zeros(4), nbytes=1 << 70),
                 lambda: pinmem.copy(np.zeros(4), np.ones(4), nbytes=1 << 70),
                 lambda: pinmem.set_budget(1 << 70)):
        with pytest.raises(pinmem.InvalidError, match="below 2"):  # not a bare OverflowError
            call()
    frozen = np.zeros(4, np.uint8)
    frozen.flags.writeable = False  # NumPy refuses a writable view with ValueError
    for call in (lambda: pinmem.read_file(tmp_path / "f.bin", frozen),
                 lambda: pinmem.copy(frozen, np.ones(4, np.uint8))):
        with pytest.raises(pinmem.InvalidError, match="dst is read-only"):
            call()
    with pytest.raises(TypeError, match="not memory pinmem can copy"):
        pinmem.read_file(tmp_path / "f.bin", [0, 1, 2])
    with pytest.raises(pinmem.InvalidError, match="not C-contiguous"):
        pinmem.read_file(tmp_path / "f.bin", np.zeros((4, 4), np.uint8)[:, ::2])
    with pytest.raises(IsADirectoryError):
        pinmem.write_file(tmp_path, np.zeros(4, np.uint8))
    with pytest.raises(pinmem.InvalidError, match="not a file descriptor"):
        pinmem._pinmem._file_read(-1, 0, None, np.zeros(4, np.uint8), None, "auto")


def test_zero_bytes(tmp_path, rng):
    """Zero bytes read or written: a completed Completion, no byte moved (pinmem's counters),
    the destination untouched and the file unchanged; one byte more is the read's usual error."""
    s0 = file_stats()
    pinmem.write_file(tmp_path / "e", np.zeros(0, np.uint8)).wait()
    assert (tmp_path / "e").stat().st_size == 0
    c = pinmem.read_file(tmp_path / "e", np.zeros(0, np.uint8))
    assert c.done()
    c.wait()
    data = random_bytes(rng, 8)
    dst = data.copy()
    for offset in (0, 100):  # at and past the end of the file: nothing to read either way
        c = pinmem.read_file(tmp_path / "e", dst, offset, nbytes=0)
        assert c.done()
        np.testing.assert_array_equal(dst, data)
    (tmp_path / "f").write_bytes(data.tobytes())
    pinmem.write_file(tmp_path / "f", random_bytes(rng, 8), 3, nbytes=0, truncate=False).wait()
    assert (tmp_path / "f").read_bytes() == data.tobytes()
    s1 = file_stats()
    moved = ("read_direct", "read_buffered", "write_direct", "write_buffered")
    assert {k: s1[k] - s0[k] for k in moved} == dict.fromkeys(moved, 0)
    with pytest.raises(pinmem.IoError, match="ends at byte 0"):
        pinmem.read_file(tmp_path / "e", dst, nbytes=1)
    np.testing.assert_array_equal(dst, data)


# ---- read_ranges / write_ranges ----------------------------------------------------------

# (offset, bytes): three back to back (one stream), gaps, odd sizes, one range of 0 bytes.
RANGES = [(70000, 61072), (131072, 1), (131073, 200001), (4096, 4096), (9000, 0),
          (340000, 3), (340003, 70000), (1, 4095), (700001, 12345)]


@pytest.mark.parametrize("io", IOS)
def test_read_ranges_scatters_into_mixed_memory(io, tmp_path, rng, no_fd_leak):
    path = tmp_path / "f.bin"
    data = write_background(path, rng, 800000)
    kinds = ["numpy", "pinned", "device"]
    dsts = [make_dst(kinds[i % 3], n) for i, (_, n) in enumerate(RANGES)]
    order = [5, 2, 8, 0, 4, 3, 7, 1, 6]  # any order
    assert pinmem.read_ranges(path, [(RANGES[k][0], dsts[k][0]) for k in order], io=io) is None
    for (off, n), (_, contents) in zip(RANGES, dsts):
        np.testing.assert_array_equal(contents(), data[off:off + n])
    # nbytes: part of a destination, the rest untouched
    a = np.full(100, 7, np.uint8)
    pinmem.read_ranges(path, [(10, a, 50), (60, memoryview(bytearray(5)))], io=io, threads=1)
    np.testing.assert_array_equal(a[:50], data[10:60])
    assert (a[50:] == 7).all()


@pytest.mark.parametrize("io", IOS)
def test_write_ranges_gathers_and_keeps_the_gaps(io, tmp_path, rng, no_fd_leak):
    path = tmp_path / "f.bin"
    old = write_background(path, rng, 800000)
    want = old.copy()
    kinds = ["numpy", "pinned", "device"]
    ranges = []
    for i, (off, n) in enumerate(RANGES):
        d = random_bytes(rng, n)
        want[off:off + n] = d
        ranges.append((off, make_src(kinds[i % 3], d)))
    assert pinmem.write_ranges(path, ranges[::-1], io=io, fsync=True) is None
    np.testing.assert_array_equal(np.fromfile(path, np.uint8), want)
    # past the end: the file grows to the last range's end, the gap before it reads as zeros
    tail = random_bytes(rng, 5000)
    pinmem.write_ranges(path, [(900000, tail), (800000 - 10, b"0123456789")], io=io)
    raw = np.fromfile(path, np.uint8)
    assert raw.size == 905000
    assert bytes(raw[800000 - 10:800000]) == b"0123456789"
    assert not raw[800000:900000].any()
    np.testing.assert_array_equal(raw[900000:], tail)


@pytest.mark.parametrize("io", IOS)
def test_write_ranges_through_a_descriptor(io, tmp_path, rng, no_fd_leak):
    """write_ranges(fd=): the bytes go through the caller's descriptor, which stays open with
    its offset unchanged, also when a call fails; a read-only or O_APPEND descriptor is refused
    by name, and nothing is written."""
    path = tmp_path / "f.bin"
    want = write_background(path, rng, 600000).copy()
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.lseek(fd, 17, os.SEEK_SET)
        ranges = []
        for i, (off, n) in enumerate(RANGES[:4]):
            d = random_bytes(rng, n)
            want[off:off + n] = d
            ranges.append((off, make_src(("numpy", "pinned")[i % 2], d)))
        assert pinmem.write_ranges(path, ranges, io=io, fd=fd) is None
        np.testing.assert_array_equal(np.fromfile(path, np.uint8), want)
        with pytest.raises(pinmem.InvalidError, match="overlap"):
            pinmem.write_ranges(path, [(0, b"12345678"), (4, b"1234")], io=io, fd=fd)
        assert os.lseek(fd, 0, os.SEEK_CUR) == 17  # open, where the caller left it
        np.testing.assert_array_equal(np.fromfile(path, np.uint8), want)
    finally:
        os.close(fd)
    for flags, what in ((os.O_RDONLY, "not open for writing"), (os.O_WRONLY | os.O_APPEND,
                                                               "O_APPEND")):
        fd = os.open(path, flags | os.O_CLOEXEC)
        try:
            with pytest.raises(pinmem.InvalidError, match=what) as e:
                pinmem.write_ranges(path, [(0, b"x" * 10)], io=io, fd=fd)
            assert str(path) in str(e.value)
        finally:
            os.close(fd)
    np.testing.assert_array_equal(np.fromfile(path, np.uint8), want)


@pytest.mark.parametrize("io", IOS)
@pytest.mark.parametrize("chunk", [4096, "12K", None])
def test_write_ranges_crc32_of_each_range(io, chunk, tmp_path, rng, no_fd_leak):
    """write_ranges(crc32=True): each range's CRC-32 as zlib computes it, in the order given,
    from host and device memory, over ranges that share units and ranges of many units; a range
    of 0 bytes has 0."""
    import zlib
    path = tmp_path / "f.bin"
    want = write_background(path, rng, 800000).copy()
    kinds = ["numpy", "pinned", "device"]
    ranges, crcs = [], []
    for i, (off, n) in enumerate(RANGES[::-1]):
        d = random_bytes(rng, n)
        want[off:off + n] = d
        ranges.append((off, make_src(kinds[i % 3], d)))
        crcs.append(zlib.crc32(d))
    assert pinmem.write_ranges(path, ranges, io=io, chunk=chunk, crc32=True) == crcs
    assert 0 in crcs  # the range of 0 bytes
    np.testing.assert_array_equal(np.fromfile(path, np.uint8), want)
    # nbytes: the CRC of the bytes written, not of the whole source
    d = random_bytes(rng, 10000)
    assert pinmem.write_ranges(path, [(5, d, 777)], io=io, crc32=True) == [zlib.crc32(d[:777])]


_CRC_IMPL_CODE = textwrap.dedent("""
    import os, sys, zlib
    import numpy as np
    import pinmem
    path = sys.argv[1]
    rng = np.random.default_rng(1)
    data = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (3 << 20, 70001, 0)]
    dev = pinmem.device_empty(len(data[0]), "uint8")
    pinmem.copy(dev, np.frombuffer(data[0], np.uint8)).wait()
    pin = pinmem.empty(len(data[1]), "uint8")
    np.asarray(pin)[:] = np.frombuffer(data[1], np.uint8)
    ranges = [(0, dev), (len(data[0]) + 5, pin), (9 << 20, data[2])]
    try:
        got = pinmem.write_ranges(path, ranges, crc32=True, chunk="1M")
        print("crcs:", got == [zlib.crc32(d) for d in data])
    except pinmem.UnsupportedError as e:
        print("refused:", e)
        print("size:", os.path.getsize(path) if os.path.exists(path) else None)
    print("impl:", pinmem.crc32_implementation())
""")


@pytest.mark.parametrize("setting", ["zlib", "found", "missing", "not-isal"])
def test_write_ranges_crc32_implementation(setting, tmp_path):
    """The CRC-32s of write_ranges come from ISA-L where found (here the isal package's
    crc32_gzip_refl) and from zlib with PINMEM_ISAL=0, the same values either way, from device,
    pinned and host memory; a PINMEM_ISAL naming a file that is not there, or one without ISA-L's
    function, refuses crc32=True naming PINMEM_ISAL and the file, before anything is written."""
    env = dict(os.environ)
    env.pop("PINMEM_ISAL", None)
    if setting == "found":
        pytest.importorskip("isal")  # one of the test packages (tools/deps.sh)
    else:
        env["PINMEM_ISAL"] = {"zlib": "0", "missing": str(tmp_path / "no-libisal.so"),
                              "not-isal": "libz.so.1"}[setting]
    out = subprocess.run([sys.executable, "-c", _CRC_IMPL_CODE, str(tmp_path / "f.bin")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    if setting in ("zlib", "found"):
        assert lines[0] == "crcs: True", out.stdout
        impl = lines[1]
        if setting == "zlib":  # even with the isal package there: PINMEM_ISAL=0 is obeyed
            assert impl.startswith("impl: zlib ("), out.stdout
        else:
            assert impl.startswith("impl: ISA-L ("), out.stdout
        return
    assert lines[0].startswith("refused:") and "PINMEM_ISAL=" in lines[0], out.stdout
    what = "no-libisal.so" if setting == "missing" else "has no crc32_gzip_refl"
    assert what in lines[0], out.stdout
    assert lines[1] in ("size: None", "size: 0"), out.stdout
    assert lines[2] == "impl: None", out.stdout


def test_write_ranges_crc32_without_zlib(tmp_path):
    """Without zlib (PINMEM_ZLIB naming a file that is not there), crc32=True is refused with
    UnsupportedError naming the file, before anything is written; writes without it work."""
    code = textwrap.dedent("""
        import sys, pinmem
        path = sys.argv[1]
        try:
            pinmem.write_ranges(path, [(0, b"abc")], crc32=True)
        except pinmem.UnsupportedError as e:
            print("refused:", e)
        import os
        print("size:", os.path.getsize(path) if os.path.exists(path) else None)
        pinmem.write_ranges(path, [(0, b"abc")])
        print("size:", os.path.getsize(path))
    """)
    env = dict(os.environ, PINMEM_ZLIB=str(tmp_path / "no-libz.so"))
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "f.bin")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("refused:") and "no-libz.so" in lines[0], out.stdout
    assert "PINMEM_ZLIB" in lines[0]
    assert lines[1] in ("size: None", "size: 0")
    assert lines[2] == "size: 3"


@pytest.mark.parametrize("chunk", [4096, "12K", "3M", None])
def test_ranges_in_units_of_a_chunk_of_ones_own(chunk, tmp_path, rng, no_fd_leak):
    # Units smaller and larger than the ranges, and not dividing them: the same bytes.
    path = tmp_path / "f.bin"
    old = write_background(path, rng, 800000)
    want = old.copy()
    ranges = []
    for i, (off, n) in enumerate(RANGES):
        d = random_bytes(rng, n)
        want[off:off + n] = d
        ranges.append((off, make_src(["numpy", "pinned", "device"][i % 3], d)))
    pinmem.write_ranges(path, ranges, io="direct", chunk=chunk, threads=2)
    np.testing.assert_array_equal(np.fromfile(path, np.uint8), want)
    dsts = [make_dst("pinned", n) for _, n in RANGES]
    pinmem.read_ranges(path, [(off, d) for (off, _), (d, _) in zip(RANGES, dsts)], io="direct",
                       chunk=chunk)
    for (off, n), (_, contents) in zip(RANGES, dsts):
        np.testing.assert_array_equal(contents(), want[off:off + n])


def test_ranges_when_other_buffers_hold_the_budget(tmp_path, rng, no_fd_leak):
    # Pinned buffers held elsewhere (a checkpoint's kept snapshot) take the whole budget, which
    # could hold a bounce slot: the slots a call needs are ordinary memory then, and reads and
    # writes through them (host memory not aligned as the file is) move every byte.
    path = tmp_path / "f.bin"
    n = (3 << 20) + 1234
    want = write_background(path, rng, n)
    old = pinmem.budget()
    gc.collect()
    pinmem.trim()
    held = []
    try:
        pinmem.set_budget("8M")
        with pytest.raises(pinmem.BudgetError):
            while True:
                held.append(pinmem.empty(1 << 20, "uint8"))
        a = np.zeros(n + 1, np.uint8)[1:]
        pinmem.read_ranges(path, [(0, a)], io="direct")
        np.testing.assert_array_equal(a, want)
        b = random_bytes(rng, n + 1)[1:]
        pinmem.write_ranges(path, [(0, b)], io="direct")
        np.testing.assert_array_equal(np.fromfile(path, np.uint8), b)
    finally:
        del held[:]
        gc.collect()
        pinmem.set_budget(old)


def test_a_ranges_chunk_is_the_unit_it_asks_for(tmp_path, rng, no_fd_leak):
    # Within a budget of 8 MiB the default 1 MiB units fit and a 64 MiB unit does not: the
    # call's chunk reaches the C call (device memory's bounce slots), and a bad one is refused
    # by name. Host memory's slots are only memcpy scratch: past the budget they are ordinary
    # memory, and the bytes still move.
    path = tmp_path / "f.bin"
    write_background(path, rng, 10000)
    want = np.fromfile(path, np.uint8, 4096)
    # never 4 KiB-aligned (an aligned one would be read in place, through no bounce slot)
    a = np.zeros(4097, np.uint8)[1:]
    d = pinmem.device_empty(4096, "uint8")
    old = pinmem.budget()
    gc.collect()  # buffers of earlier tests still held would keep the budget from shrinking
    pinmem.trim()
    try:
        pinmem.set_budget("8M")
        pinmem.read_ranges(path, [(0, a)], io="direct")
        pinmem.read_ranges(path, [(0, d)], io="direct")
        with pytest.raises(pinmem.BudgetError, match="cannot hold one .*bounce slot"):
            pinmem.read_ranges(path, [(0, d)], io="direct", chunk="64M")
        with pytest.raises(pinmem.BudgetError, match="cannot hold one .*bounce slot"):
            pinmem.write_ranges(path, [(0, d)], io="direct", chunk="64M")
        a[:] = 0
        peak = pinmem.stats()["pinned_peak"]
        pinmem.read_ranges(path, [(0, a)], io="direct", chunk="64M")
        assert np.array_equal(a, want)
        pinmem.write_ranges(path, [(8192, a)], io="direct", chunk="64M")
        assert np.array_equal(np.fromfile(path, np.uint8, 4096, offset=8192), want)
        assert pinmem.stats()["pinned_peak"] == peak
    finally:
        pinmem.set_budget(old)
    with pytest.raises(pinmem.InvalidError, match="chunk must be at most 1 GiB"):
        pinmem.write_ranges(path, [(0, a)], chunk="2G")
    with pytest.raises(pinmem.InvalidError, match="negative"):
        pinmem.read_ranges(path, [(0, a)], chunk=-1)
    with pytest.raises(TypeError, match="a size must be an integer or a string"):
        pinmem.read_ranges(path, [(0, a)], chunk=1.5)
    with pytest.raises(pinmem.Error):
        pinmem.read_ranges(path, [(0, a)], chunk="lots")


def test_ranges_refused_before_anything_moves(tmp_path, rng, no_fd_leak):
    path = tmp_path / "f.bin"
    data = write_background(path, rng, 10000)
    a = np.full(8192, 9, np.uint8)
    dev, dev_bytes = make_dst("device", 100)
    pinmem.copy(dev, np.zeros(100, np.uint8)).wait()
    with pytest.raises(pinmem.InvalidError, match=r"read_ranges\('.*f\.bin'\).*ranges\[0\] "
                       r"\(bytes \[0, 100\) of the file\) and ranges\[1\] \(\[50, 60\)\) "
                       "overlap in the file"):
        pinmem.read_ranges(path, [(0, a[:100]), (50, a[200:210])])
    with pytest.raises(pinmem.InvalidError, match="overlap in memory"):
        pinmem.read_ranges(path, [(0, a[:100]), (4096, a[50:150])])
    with pytest.raises(pinmem.IoError, match=r"ends at byte 10000 \(its size\), before "
                       r"ranges\[2\] \(bytes \[9990, 10010\).*nothing was read"):
        pinmem.read_ranges(path, [(0, a[:100]), (200, dev), (9990, a[4096:4116])])
    assert (a == 9).all() and not dev_bytes().any()  # nothing was read
    with pytest.raises(pinmem.InvalidError, match=r"ranges\[1\] must be a tuple"):
        pinmem.read_ranges(path, [(0, a[:10]), a])
    with pytest.raises(pinmem.InvalidError,
                       match=r"ranges\[0\]: nbytes=20 but its dst has only 10"):
        pinmem.read_ranges(path, [(0, a[:10], 20)])
    with pytest.raises(pinmem.InvalidError, match=r"ranges\[0\].*offset"):
        pinmem.read_ranges(path, [(-1, a[:10])])
    with pytest.raises(pinmem.InvalidError, match=r"ranges\[0\] is read-only"):
        pinmem.read_ranges(path, [(0, b"1234")])
    with pytest.raises(pinmem.InvalidError, match="sequence"):
        pinmem.read_ranges(path, 5)
    with pytest.raises(pinmem.InvalidError, match="threads must be 0"):
        pinmem.read_ranges(path, [(0, a[:10])], threads=-1)
    # floats were truncated by int(), and past C's int an OverflowError escaped
    for bad, what in ((1.5, "must be an integer"), (1 << 40, "must be 0..256"),
                      (True, "must be 0..256")):
        with pytest.raises(pinmem.InvalidError, match=f"threads {what}"):
            pinmem.read_ranges(path, [(0, a[:10])], threads=bad)
        with pytest.raises(pinmem.InvalidError, match=f"threads {what}"):
            pinmem.write_ranges(path, [(0, a[:10])], threads=bad)
    for bad in (1 << 40, -1):
        with pytest.raises(pinmem.InvalidError, match="fd must be 0"):
            pinmem.read_file(path, a[:10], fd=bad)
    spare = np.zeros(10, np.uint8)
    pinmem.read_ranges(path, [(0, spare)], threads=np.int64(2))  # a NumPy integer is one
    assert spare.tobytes() == open(path, "rb").read(10)
    with pytest.raises(pinmem.InvalidError, match="overlap in the file"):
        pinmem.write_ranges(path, [(0, a[:100]), (99, a[:2])])
    np.testing.assert_array_equal(np.fromfile(path, np.uint8), data)  # nothing written
    # the same source twice is fine for writes; an empty list is a no-op
    pinmem.write_ranges(path, [(0, a[:100]), (5000, a[:100])])
    raw = np.fromfile(path, np.uint8)
    assert (raw[:100] == 9).all() and (raw[5000:5100] == 9).all()
    pinmem.read_ranges(path, [])
    pinmem.write_ranges(path, [])
    assert path.stat().st_size == 10000


def test_offsets_are_integers_never_bools_or_floats(tmp_path):
    """offset=True read from byte 1 and wrote there (a bool is an int to Python), and a float
    offset raised a bare TypeError naming no argument; both are InvalidError naming the
    offset, in every file call. NumPy integers are offsets."""
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(64)))
    a = np.zeros(4, np.uint8)
    calls = (lambda v: pinmem.read_file(path, a, v),
             lambda v: pinmem.write_file(path, a, v, truncate=False),
             lambda v: pinmem.read_ranges(path, [(v, a)]),
             lambda v: pinmem.write_ranges(path, [(v, a)]))
    for call in calls:
        for bad, what in ((True, r"2\*\*64 - 1, not True"), (np.bool_(False), "integer, not"),
                          (1.0, "integer, not float"), ("4", "integer, not str")):
            with pytest.raises(pinmem.InvalidError, match="offset must be .*" + what):
                call(bad)
    assert path.read_bytes() == bytes(range(64))  # nothing written
    pinmem.read_file(path, a, np.int64(8)).wait()
    assert a.tobytes() == bytes(range(8, 12))


def test_integer_arguments_of_file_calls_and_the_loader_say_the_same(tmp_path):
    # One check serves both (pinmem/_args.py): the file calls said "must be an integer, not
    # float" and the loader "must be an int, not 1.5", each leaving out half of what was wrong.
    path = str(tmp_path / "f.bin")
    open(path, "wb").write(bytes(64))
    a = np.zeros(10, np.uint8)
    for call in (lambda v: pinmem.read_ranges(path, [(0, a)], threads=v),
                 lambda v: pinmem.Loader(np.zeros(4), num_workers=v, device="cpu")):
        with pytest.raises(pinmem.InvalidError, match=r"must be an integer, not float 1\.5$"):
            call(1.5)
        # a bool is refused naming the range the argument takes
        with pytest.raises(pinmem.InvalidError, match=r"must be (0\.\.256|>= 0), not True$"):
            call(True)
        with pytest.raises(pinmem.InvalidError, match=r"must be (0\.\.256|>= 0), not -1$"):
            call(-1)


def test_read_ranges_into_torch_tensors(tmp_path, rng):
    torch = skip_unless_torch()
    path = tmp_path / "f.bin"
    data = write_background(path, rng, 300000)
    t = torch.zeros(1000, dtype=torch.float32)
    u = torch.zeros(7, dtype=torch.uint8)
    pinmem.read_ranges(path, [(4096, t), (4096 + 4000, u)])
    assert t.numpy().view(np.uint8).tobytes() == data[4096:8096].tobytes()
    assert u.numpy().tobytes() == data[8096:8103].tobytes()


def test_torch_cpu_tensor_dst(tmp_path, rng):
    torch = skip_unless_torch()
    data = write_background(tmp_path / "f.bin", rng, 4 * 1001)
    t = torch.zeros(1001, dtype=torch.float32)
    pinmem.read_file(tmp_path / "f.bin", t).wait()
    np.testing.assert_array_equal(t.numpy().view(np.uint8), data)
    pinmem.write_file(tmp_path / "g.bin", t).wait()
    assert (tmp_path / "g.bin").read_bytes() == data.tobytes()


@pytest.mark.parametrize("fault,err", [("file_read=1", "EIO|Input/output"),
                                       ("file_read=1:short", None),
                                       ("file_read=1:EINTR", None)])
def test_read_faults(fault, err, tmp_path, rng):
    """An I/O error is an IoError naming the file; a short read or EINTR is continued."""
    data = write_background(tmp_path / "f.bin", rng, 3 << 20)
    np.save(tmp_path / "want.npy", data)
    out = run_child(f"""
        import numpy as np, pinmem
        want = np.load("want.npy")
        for io in ("buffered", "direct"):
            for kind in ("numpy", "device"):
                dst = np.zeros(want.size, np.uint8) if kind == "numpy" else \\
                    pinmem.device_empty(want.size, "uint8")
                try:
                    pinmem.read_file("f.bin", dst, io=io).wait()
                except pinmem.IoError as e:
                    print("IoError", io, kind, str(e))
                    continue
                out = dst if kind == "numpy" else np.zeros(want.size, np.uint8)
                if kind == "device":
                    pinmem.copy(out, dst).wait()
                print("ok", io, kind, bool((out == want).all()))
        """, tmp_path, {"PINMEM_FAULT": fault})
    lines = out.splitlines()
    if err is None:
        assert all(line.endswith("True") for line in lines) and lines, out
    else:
        # The first read fails (the fault fires once); it names the file and the errno.
        assert lines[0].startswith("IoError buffered numpy"), out
        assert "read_file('f.bin')" in lines[0], out
        assert any(w in lines[0] for w in err.split("|")), out
        assert all(line.endswith("True") for line in lines[1:]), out


def test_write_enospc(tmp_path, rng):
    data = random_bytes(rng, 3 << 20)
    np.save(tmp_path / "data.npy", data)
    out = run_child("""
        import numpy as np, pinmem
        data = np.load("data.npy")
        try:
            pinmem.write_file("f.bin", data, io="buffered")
        except pinmem.IoError as e:
            print("IoError", str(e))
        """, tmp_path, {"PINMEM_FAULT": "file_write=1:ENOSPC"})
    assert out.startswith("IoError") and "write_file('f.bin')" in out, out
    assert "No space left" in out or "ENOSPC" in out, out


def test_no_fd_leak_many_calls(tmp_path, rng, no_fd_leak):
    write_background(tmp_path / "f.bin", rng, 1000)
    for _ in range(200):
        pinmem.read_file(tmp_path / "f.bin", np.zeros(1000, np.uint8)).wait()
        pinmem.write_file(tmp_path / "g.bin", np.zeros(10, np.uint8))
        with pytest.raises(pinmem.IoError):
            pinmem.read_file(tmp_path / "f.bin", np.zeros(2000, np.uint8))


# ---- safetensors: headers ----------------------------------------------------------------

def raw_file(path, header, data=b"", length=None, pad=True):
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    n = len(text) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + text + data)
    return path


BAD_HEADERS = {
    "short": (lambda p: p.write_bytes(b"\x01\x02\x03"), "3 bytes long: not a safetensors"),
    "length": (lambda p: raw_file(p, {}, length=1 << 40), "header length 1099511627776 runs "
               "past the end of the file"),
    "json": (lambda p: raw_file(p, b'{"a": [1, 2'), "the header is not valid JSON"),
    "utf8": (lambda p: raw_file(p, b'{"\xff": 1}'), "the header is not valid JSON"),
    "not object": (lambda p: raw_file(p, [1, 2]), "the header is JSON list, not an object"),
    "entry": (lambda p: raw_file(p, {"x": 3}), "tensor 'x': its entry is not an object"),
    "dtype": (lambda p: raw_file(p, {"x": {"dtype": "Q7", "shape": [1],
                                           "data_offsets": [0, 1]}}, b"\0"),
              "tensor 'x': unknown dtype 'Q7'"),
    "shape": (lambda p: raw_file(p, {"x": {"dtype": "U8", "shape": [-1],
                                           "data_offsets": [0, 1]}}, b"\0"),
              r"tensor 'x': shape \[-1\] is not a list"),
    "offsets type": (lambda p: raw_file(p, {"x": {"dtype": "U8", "shape": [1],
                                                  "data_offsets": [0]}}, b"\0"),
                     "data_offsets .* is not a pair"),
    "backwards": (lambda p: raw_file(p, {"x": {"dtype": "U8", "shape": [0],
                                               "data_offsets": [2, 1]}}, b"\0\0"),
                  r"data_offsets \[2, 1\] end before"),
    "past end": (lambda p: raw_file(p, {"x": {"dtype": "F32", "shape": [4],
                                              "data_offsets": [0, 16]}}, b"\0" * 15),
                 r"run past the end of the data \(15 bytes"),
    "size": (lambda p: raw_file(p, {"x": {"dtype": "F32", "shape": [2, 2],
                                          "data_offsets": [0, 12]}}, b"\0" * 16),
             r"F32 of shape \[2, 2\] takes 16 bytes but its data_offsets \[0, 12\] hold 12"),
    "overlap": (lambda p: raw_file(p, {"a": {"dtype": "U8", "shape": [8],
                                             "data_offsets": [0, 8]},
                                       "b": {"dtype": "I32", "shape": [2],
                                             "data_offsets": [4, 12]}}, b"\0" * 12),
                r"tensors 'a' \[0, 8\) and 'b' \[4, 12\) overlap"),
    "metadata": (lambda p: raw_file(p, {"__metadata__": {"k": 1}}),
                 "__metadata__ must be an object of strings"),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_bad_header_refused(case, tmp_path, no_fd_leak):
    make, message = BAD_HEADERS[case]
    path = tmp_path / "bad.safetensors"
    make(path)
    with pytest.raises(pinmem.FormatError, match=message) as e:
        pinmem.safetensors.load_file(path)
    assert "bad.safetensors" in str(e.value) and e.value.status == "PM_ERR_FORMAT"


# ---- safetensors: round trips against the package ----------------------------------------

def numpy_tensors(rng):
    """One array of every NumPy dtype safetensors stores, odd shapes, a 0-d and empty ones."""
    out = {}
    for name in ["bool", "uint8", "int8", "int16", "uint16", "float16", "int32", "uint32",
                 "float32", "int64", "uint64", "float64", "complex64"]:
        dt = np.dtype(name)
        shape = (3, 5, 7) if dt.itemsize < 4 else (13,)
        raw = random_bytes(rng, int(np.prod(shape)) * dt.itemsize)
        a = raw.view(dt).reshape(shape) if name != "bool" else (raw % 2).astype(bool).reshape(shape)
        out["w." + name] = a
    out["scalar"] = np.array(2.5, np.float32)
    out["empty"] = np.zeros((0, 3), np.int16)
    out["empty2"] = np.zeros((4, 0), np.float64)
    return out


def test_ours_loads_with_safetensors_numpy(tmp_path, rng, no_fd_leak):
    skip_unless_safetensors()
    import safetensors
    import safetensors.numpy
    arrays = numpy_tensors(rng)
    path = tmp_path / "ours.safetensors"
    pinmem.safetensors.save_file(arrays, path, metadata={"step": "12", "ünï": "cödé"})
    back = safetensors.numpy.load_file(str(path))
    assert back.keys() == arrays.keys()
    for k, a in arrays.items():
        assert back[k].dtype == a.dtype and back[k].shape == a.shape, k
        np.testing.assert_array_equal(back[k], a, err_msg=k)
    with safetensors.safe_open(str(path), "np") as f:
        assert f.metadata() == {"step": "12", "ünï": "cödé"}
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert header_len % 8 == 0  # padded as the package pads it


def test_theirs_read_by_our_parser(tmp_path, rng, no_fd_leak):
    """Files the package writes (from NumPy) parse, and the one read lands every tensor's bytes
    where the header says: checked without torch."""
    skip_unless_safetensors()
    import safetensors.numpy
    arrays = numpy_tensors(rng)
    path = str(tmp_path / "theirs.safetensors")
    safetensors.numpy.save_file(arrays, path, metadata={"a": "b"})
    buf = []
    alloc = _pinned_into(buf)
    entries, data = pinmem.safetensors._read(path, lambda e: None, alloc)
    assert {e[0] for e in entries} == arrays.keys()
    for name, dtype, shape, begin, end in entries:
        a = arrays[name]
        assert shape == a.shape and pinmem.safetensors._DTYPES[dtype][2] == a.dtype.str, name
        np.testing.assert_array_equal(data[begin:end], np.ascontiguousarray(a).view(np.uint8)
                                      .reshape(-1), err_msg=name)


def torch_tensors(torch, rng):
    """A tensor of every dtype torch has that the safetensors package stores; 0-d and empty
    ones of each; a non-contiguous one."""
    from safetensors.torch import _TYPES
    out = {}
    for st_name, dt in _TYPES.items():
        if dt is None or st_name not in pinmem.safetensors._DTYPES:
            continue
        item = torch.empty(0, dtype=dt).element_size()
        raw = torch.from_numpy(random_bytes(rng, 6 * 5 * item))
        if dt == torch.bool:
            raw = raw % 2
        t = raw.view(dt).reshape(6, 5)
        out[st_name] = t
        out[st_name + ".0d"] = raw[:item].clone().view(dt).reshape(())
        out[st_name + ".empty"] = torch.empty(0, 5, dtype=dt)
    out["transposed"] = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    return out


def same(torch, a, b):
    """Same dtype, shape and bytes (float8 and friends have no equality of their own)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


def test_torch_round_trips_both_ways(tmp_path, rng, no_fd_leak):
    skip_unless_safetensors()
    torch = skip_unless_torch()
    import safetensors.torch
    tensors = torch_tensors(torch, rng)
    assert {"F32", "BF16", "F16", "F8_E4M3", "F8_E5M2", "BOOL", "I64"} <= tensors.keys()
    ours = tmp_path / "ours.safetensors"
    pinmem.safetensors.save_file(tensors, ours, metadata={"format": "pt"})
    back = safetensors.torch.load_file(str(ours))
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert same(torch, back[k], t), k

    theirs = str(tmp_path / "theirs.safetensors")
    safetensors.torch.save_file({k: t.contiguous() for k, t in tensors.items()}, theirs)
    loaded = pinmem.safetensors.load_file(theirs)
    assert loaded.keys() == tensors.keys()
    for k, t in tensors.items():
        assert loaded[k].device.type == "cpu" and same(torch, loaded[k], t), k
    # Views of one buffer: changing one tensor leaves the others as they were.
    loaded["F32"].zero_()
    assert same(torch, loaded["F32.0d"], tensors["F32.0d"])


def test_load_unaligned_offsets(tmp_path, rng):
    """Another writer may put a tensor at an offset that is not a multiple of its item size:
    such a tensor is copied into an aligned one; the aligned ones stay views. (The gap before
    'd' is refused by default, as the package refuses it, and loads with strict=False.)"""
    torch = skip_unless_torch()
    x = random_bytes(rng, 3)
    f = rng.random(5).astype(np.float32)
    d = rng.random(2)
    path = raw_file(tmp_path / "odd.safetensors", {
        "x": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "f": {"dtype": "F32", "shape": [5], "data_offsets": [3, 23]},
        "d": {"dtype": "F64", "shape": [2], "data_offsets": [24, 40]}},
        x.tobytes() + f.tobytes() + b"\0" + d.tobytes())
    with pytest.raises(pinmem.FormatError, match="a gap of 1 bytes after 'f'"):
        pinmem.safetensors.load_file(path)
    out = pinmem.safetensors.load_file(path, strict=False)
    np.testing.assert_array_equal(out["x"].numpy(), x)
    np.testing.assert_array_equal(out["f"].numpy(), f)
    np.testing.assert_array_equal(out["d"].numpy(), d)
    assert out["f"].data_ptr() % 4 == 0
    assert out["d"].data_ptr() - out["x"].data_ptr() == 24  # a view of the one buffer


def test_load_to_cuda(tmp_path, rng):
    from conftest import skip_unless_torch_cuda
    torch = skip_unless_torch_cuda()
    tensors = {"a": torch.randn(1000, 33), "b": torch.arange(17, dtype=torch.int64)}
    pinmem.safetensors.save_file({k: v.cuda() for k, v in tensors.items()}, tmp_path / "g")
    out = pinmem.safetensors.load_file(tmp_path / "g", device="cuda")
    for k, t in tensors.items():
        assert out[k].device.type == "cuda" and torch.equal(out[k].cpu(), t)


def torch_device(torch, where):
    """torch.device(where), with the index a tensor made there reports ('cuda:0')."""
    if where == "cuda":
        from conftest import skip_unless_torch_cuda
        skip_unless_torch_cuda()
    return torch.empty(0, device=where).device


@pytest.mark.parametrize("where", ["cpu", "cuda"])
def test_loaded_tensors_have_storages_of_their_own(where, tmp_path, no_fd_leak):
    """Each loaded tensor lies in the one buffer of the read, but with a storage over just its
    bytes: torch.save of one tensor writes that tensor, and tools that look for tied weights
    by storage (safetensors' save_model) see none."""
    import io
    torch = skip_unless_torch()
    dev = torch_device(torch, where)
    tensors = {"w%d" % i: torch.randn(64, 32) for i in range(8)}
    tensors["b"] = torch.randn(32)
    tensors["h"] = torch.randn(16).to(torch.bfloat16)
    pinmem.safetensors.save_file(tensors, tmp_path / "m.safetensors")
    out = pinmem.safetensors.load_file(tmp_path / "m.safetensors", device=dev)
    ptrs = set()
    for k, t in out.items():
        assert t.device == dev and torch.equal(t.cpu(), tensors[k]), k
        storage = t.untyped_storage()
        assert storage.nbytes() == t.numel() * t.element_size(), k
        assert storage.data_ptr() == t.data_ptr(), k
        ptrs.add(storage.data_ptr())
    assert len(ptrs) == len(out)
    one = io.BytesIO()
    torch.save(out["w3"], one)
    alone = io.BytesIO()
    torch.save(tensors["w3"].clone(), alone)
    assert len(one.getvalue()) < len(alone.getvalue()) + 4096
    # The memory lives while any tensor does.
    keep = out["w5"]
    del out
    gc.collect()
    assert torch.equal(keep.cpu(), tensors["w5"])
    try:
        import safetensors.torch
    except ImportError:
        return
    model = torch.nn.Linear(32, 64).to(dev)
    loaded = pinmem.safetensors.load_file(tmp_path / "m.safetensors", device=dev)
    model.load_state_dict({"weight": loaded["w0"], "bias": torch.zeros(64, device=dev)},
                          assign=True)
    safetensors.torch.save_model(model, str(tmp_path / "model.safetensors"))
    back = safetensors.torch.load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(back["weight"], tensors["w0"])


# get_slice indexes checked against the safetensors package (and torch/NumPy indexing).
SLICES = [0, -1, 3, slice(1, 4), slice(None, None, 2), slice(1, None, 3), slice(5, 2),
          slice(-2, None), (slice(None), slice(2, 5)), (2, 3), (slice(1, 3), 0), (-1, -1),
          Ellipsis, (Ellipsis, 1), ()]


def package_slice(g, name, index):
    """The package's get_slice(name)[index], or None where it fails (0.8.0 raises SystemError
    for an empty slice such as [5:2]): torch's or NumPy's own indexing judges those."""
    try:
        return g.get_slice(name)[index]
    except Exception:
        return None


def check_safe_open(f, g, names, equal):
    """Our safe_open f against the package's g: names, metadata, each tensor and slice."""
    assert f.keys() == g.keys() == sorted(names)
    assert f.metadata() == g.metadata()
    assert len(f) == len(names) and all(k in f for k in names) and "nope" not in f
    for k in g.keys():
        assert equal(f.get_tensor(k), g.get_tensor(k)), k
        s, t = f.get_slice(k), g.get_slice(k)
        assert s.get_shape() == t.get_shape() and s.get_dtype() == t.get_dtype(), k


@pytest.mark.parametrize("writer", ["ours", "theirs"])
def test_safe_open_numpy_matches_the_package(writer, tmp_path, rng, no_fd_leak):
    skip_unless_safetensors()
    import safetensors
    import safetensors.numpy
    arrays = numpy_tensors(rng)
    arrays["rows"] = rng.random((7, 6)).astype(np.float32)
    path = str(tmp_path / "f.safetensors")
    save = pinmem.safetensors.save_file if writer == "ours" else safetensors.numpy.save_file
    save(arrays, path, metadata={"epoch": "3"})

    def equal(a, b):  # bytes: the random floats hold NaNs
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()

    with pinmem.safetensors.safe_open(path, "np") as f, safetensors.safe_open(path, "np") as g:
        check_safe_open(f, g, arrays, equal)
        order = f.offset_keys()
        assert sorted(order) == f.keys()
        with open(path, "rb") as raw:
            n = struct.unpack("<Q", raw.read(8))[0]
            header = json.loads(raw.read(n))
        header.pop("__metadata__", None)
        assert order == sorted(header, key=lambda k: header[k]["data_offsets"])
        for index in SLICES:
            a = f.get_slice("rows")[index]
            assert isinstance(a, np.ndarray), index
            assert equal(a, arrays["rows"][index]), index
            theirs = package_slice(g, "rows", index)
            assert theirs is None or equal(a, np.asarray(theirs)), index
        one = f.get_tensor("rows")
        one[:] = 0  # memory of its own: the next read is not changed by it
        assert equal(f.get_tensor("rows"), arrays["rows"])


@pytest.mark.parametrize("where", ["cpu", "cuda"])
def test_safe_open_torch_matches_the_package(where, tmp_path, rng, no_fd_leak):
    skip_unless_safetensors()
    torch = skip_unless_torch()
    dev = torch_device(torch, where)
    import safetensors
    import safetensors.torch
    tensors = torch_tensors(torch, rng)
    tensors["rows"] = torch.randn(9, 5, 4)
    path = str(tmp_path / "t.safetensors")
    pinmem.safetensors.save_file(tensors, path, metadata={"format": "pt"})
    with pinmem.safetensors.safe_open(path, framework="pt", device=where) as f, \
            safetensors.safe_open(path, framework="pt", device=where) as g:
        check_safe_open(f, g, tensors, lambda a, b: a.device == dev and same(torch, a, b))
        for index in SLICES:
            a = f.get_slice("rows")[index]
            b = package_slice(g, "rows", index)
            assert a.device == dev and (b is None or torch.equal(a, b)), index
            assert torch.equal(a.cpu(), tensors["rows"][index]), index
            assert a.is_contiguous(), index
            assert a.untyped_storage().nbytes() == a.numel() * a.element_size(), index
        t = f.get_tensor("BF16")
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_safe_open_reads_only_what_it_is_asked(tmp_path, file_reads, no_fd_leak):
    """get_tensor reads that tensor's bytes, get_slice the rows its first index needs; opening
    reads only the header."""
    a = np.arange(10 * 8, dtype=np.float64).reshape(10, 8)
    b = np.arange(5, dtype=np.int32)
    path = tmp_path / "r.safetensors"
    pinmem.safetensors.save_file({"a": a, "b": b}, path)
    reads = file_reads
    with pinmem.safetensors.safe_open(path, "np") as f:
        start = f._start
        begin = f._entries["a"][3]
        assert reads == []
        np.testing.assert_array_equal(f.get_tensor("b"), b)
        assert reads == [(start + f._entries["b"][3], b.nbytes)]
        del reads[:]
        np.testing.assert_array_equal(f.get_slice("a")[3:6, 1], a[3:6, 1])
        assert reads == [(start + begin + 3 * 64, 3 * 64)]
        del reads[:]
        np.testing.assert_array_equal(f.get_slice("a")[-1], a[-1])
        assert reads == [(start + begin + 9 * 64, 64)]
        del reads[:]
        np.testing.assert_array_equal(f.get_slice("a")[2:9:3], a[2:9:3])  # rows 2, 5, 8
        assert reads == [(start + begin + 2 * 64, 7 * 64)]
        del reads[:]
        assert f.get_slice("a")[7:2].shape == (0, 8) and reads == []


def test_safe_open_close_while_other_threads_read(tmp_path, rng, no_fd_leak):
    """close() from one thread while others read: each read gives the right bytes or says the
    file is closed, none fails on a closed (or reused) descriptor, and the descriptor is
    closed once the last read ends."""
    arrays = {"t%d" % i: random_bytes(rng, (256 << 10) + i) for i in range(8)}
    path = tmp_path / "c.safetensors"
    pinmem.safetensors.save_file(arrays, path)
    for _ in range(5):
        f = pinmem.safetensors.safe_open(path, "np")
        outcomes, started = [], threading.Barrier(5)

        def reader(k):
            started.wait()
            for i in range(40):
                name = "t%d" % ((k + i) % 8)
                try:
                    got = f.get_tensor(name)
                except pinmem.InvalidError as e:
                    outcomes.append(("closed", "is closed" in str(e)))
                    return
                outcomes.append(("read", np.array_equal(got, arrays[name])))

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        started.wait()
        time.sleep(0.002)
        f.close()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert outcomes and all(ok for _, ok in outcomes), outcomes
        assert f._busy == 0 and f._closing is None


def test_safe_open_errors(tmp_path, no_fd_leak):
    path = tmp_path / "e.safetensors"
    pinmem.safetensors.save_file({"x": np.zeros((3, 2), np.float32)}, path)
    f = pinmem.safetensors.safe_open(path, "np")
    with pytest.raises(KeyError, match="'nope'.*e.safetensors"):
        f.get_tensor("nope")
    with pytest.raises(KeyError, match="'nope'"):
        f.get_slice("nope")
    with pytest.raises(IndexError, match="index 3 out of bounds for tensor dimension #0 of size 3"):
        f.get_slice("x")[3]
    with pytest.raises(IndexError, match="Invalid index -4 for dimension 0 of size 3"):
        f.get_slice("x")[-4]
    s = f.get_slice("x")
    assert len(s) == 3 and "x" in repr(s) and "F32" in repr(s)
    f.close()
    f.close()
    assert "closed" in repr(f)
    with pytest.raises(pinmem.InvalidError, match="is closed"):
        f.get_tensor("x")
    # a slice holds the file as the package's does: it still reads once the file is closed, and
    # the descriptor is closed with the last slice
    assert s[0].tolist() == [0.0, 0.0] and s[1:].shape == (2, 2)
    fds = len(os.listdir("/proc/self/fd"))
    del s
    assert len(os.listdir("/proc/self/fd")) == fds - 1
    for kwargs, match in [({"framework": "tf"}, "framework must be one of"),
                          ({"framework": "np", "device": "cuda"}, "device must be 'cpu'"),
                          ({"io": "fast"}, "io must be one of")]:
        with pytest.raises(pinmem.InvalidError, match=match):
            pinmem.safetensors.safe_open(path, **kwargs)
    with pytest.raises(FileNotFoundError):
        pinmem.safetensors.safe_open(tmp_path / "missing", "np")
    (tmp_path / "bad").write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(pinmem.FormatError, match="bad.*header length"):
        pinmem.safetensors.safe_open(tmp_path / "bad", "np")
    raw_file(tmp_path / "bf", {"h": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}},
             b"\0" * 4)
    with pinmem.safetensors.safe_open(tmp_path / "bf", "np") as g:
        assert g.keys() == ["h"] and g.get_slice("h").get_dtype() == "BF16"
        with pytest.raises(pinmem.UnsupportedError, match="'h' is BF16, which NumPy has no"):
            g.get_tensor("h")


def test_save_refuses_bad_input(tmp_path):
    with pytest.raises(TypeError, match="dict"):
        pinmem.safetensors.save_file([np.zeros(1)], tmp_path / "x")
    with pytest.raises(TypeError, match="metadata"):
        pinmem.safetensors.save_file({"a": np.zeros(1)}, tmp_path / "x", metadata={"k": 1})
    with pytest.raises(TypeError, match="complex128"):
        pinmem.safetensors.save_file({"a": np.zeros(1, np.complex128)}, tmp_path / "x")
    with pytest.raises(TypeError, match="list"):
        pinmem.safetensors.save_file({"a": [1, 2]}, tmp_path / "x")
    with pytest.raises(ValueError, match="__metadata__"):
        pinmem.safetensors.save_file({"__metadata__": np.zeros(1)}, tmp_path / "x")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("budget", [None, "1M"])
def test_save_from_host_memory_needs_no_pinned_copy_of_the_file(budget, tmp_path):
    """save_file of host arrays writes them straight from their memory through pinmem's slots:
    the process's pinned peak stays far under the file's 48 MiB, and the file is the bytes
    pinmem.safetensors.numpy.save gives. Under a budget that cannot hold one slot the save
    still succeeds, through the page cache, pinning nothing."""
    code = textwrap.dedent("""
        import sys, numpy as np, pinmem, pinmem.safetensors, pinmem.safetensors.numpy as psn
        rng = np.random.default_rng(3)
        arrays = {f"a{i}": rng.random((1 << 20) // 8 * 3) for i in range(16)}  # 48 MiB
        arrays["odd"] = np.arange(37, dtype=np.int16)  # the data then ends off a page
        pinmem.safetensors.save_file(arrays, sys.argv[1])
        with open(sys.argv[1], "rb") as f:
            assert f.read() == psn.save(arrays), "not the package's bytes"
        print(pinmem.stats()["pinned_peak"])
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    if budget:
        env["PINMEM_BUDGET"] = budget
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.safetensors")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    peak = int(out.stdout.split()[-1])
    assert peak < (16 << 20), f"pinned peak {peak} bytes for a 48 MiB file"
    if budget:
        assert peak == 0, peak


def test_save_big_endian_and_strided_arrays(tmp_path, rng):
    a = np.arange(10, dtype=">i4")
    b = np.arange(24, dtype=np.float64).reshape(4, 6)[:, ::2]
    pinmem.safetensors.save_file({"a": a, "b": b}, tmp_path / "x")
    skip_unless_safetensors()
    import safetensors.numpy
    back = safetensors.numpy.load_file(str(tmp_path / "x"))
    np.testing.assert_array_equal(back["a"], a)
    np.testing.assert_array_equal(back["b"], b)


# ---- safetensors: failed saves leave the old file ----------------------------------------

def old_file(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    pinmem.safetensors.save_file({"w": np.arange(1000, dtype=np.float32)}, path)
    os.chmod(path, 0o640)
    return path, path.read_bytes()


def assert_untouched(tmp_path, path, before):
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name], "a temporary was left"


@pytest.mark.parametrize("stage", ["host memory", "pinned snapshot"])
def test_failed_write_midway_leaves_old_file(stage, tmp_path, monkeypatch, rng, no_fd_leak):
    """A write that fails after part of the file is on disk leaves the old file as it was and
    no temporary: from the arrays' own memory (write_ranges) and from a pinned snapshot
    (write_file, as save_file_async writes)."""
    path, before = old_file(tmp_path)
    real_file, real_ranges = pinmem.write_file, pinmem.write_ranges
    seen = []

    def fail(p):
        raise OSError(errno.ENOSPC, "No space left on device (simulated)", p)

    def half_then_fail(p, src, *args, **kw):
        seen.append(p)
        real_file(p, src, nbytes=memoryview(src).nbytes // 2)  # part of the file is on disk...
        fail(p)

    def half_the_ranges_then_fail(p, ranges, **kw):
        seen.append(p)
        real_ranges(p, ranges[:len(ranges) // 2 + 1])
        fail(p)

    monkeypatch.setattr(pinmem, "write_file", half_then_fail)
    monkeypatch.setattr(pinmem, "write_ranges", half_the_ranges_then_fail)
    with pytest.raises(OSError, match="simulated"):
        if stage == "host memory":
            pinmem.safetensors.save_file({"w": rng.random(100000), "v": rng.random(10)}, path)
        else:
            pinmem.safetensors.save_file_async({"w": rng.random(100000)}, path).wait(60)
    assert seen and os.path.dirname(seen[0]) == str(tmp_path) and ".tmp-" in seen[0]
    assert_untouched(tmp_path, path, before)


def test_failed_rename_leaves_no_temporary(tmp_path, monkeypatch):
    path, before = old_file(tmp_path)

    def refuse(src, dst):
        raise PermissionError(errno.EACCES, "rename refused (simulated)", dst)

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(PermissionError, match="simulated"):
        pinmem.safetensors.save_file({"w": np.zeros(3)}, path)
    assert_untouched(tmp_path, path, before)


@pytest.mark.parametrize("save", ["save_file", "save_file_async"])
def test_save_to_a_place_it_cannot_write_fails_at_the_call(save, tmp_path, monkeypatch,
                                                          no_fd_leak):
    """A missing folder, a file standing where a folder should be, or the name of a directory:
    the call itself raises (save_file_async too, not its wait()), naming the target, before
    any tensor is copied, and leaves nothing behind."""
    (tmp_path / "plain").write_bytes(b"x")
    (tmp_path / "dir").mkdir()
    copied = []
    real = pinmem.safetensors._plan
    monkeypatch.setattr(pinmem.safetensors, "_plan", lambda *a: copied.append(a) or real(*a))
    cases = [(tmp_path / "no" / "x.safetensors", FileNotFoundError, "cannot create"),
             (tmp_path / "plain" / "x.safetensors", NotADirectoryError, "cannot create"),
             (tmp_path / "dir", IsADirectoryError, "cannot save over a directory")]
    for target, error, text in cases:
        with pytest.raises(error, match=text) as e:
            getattr(pinmem.safetensors, save)({"w": np.zeros(3)}, target)
        assert e.value.filename == str(target)
        # also a SafetensorError (the package's too, where it is installed), as its save raises
        assert isinstance(e.value, pinmem.safetensors.SafetensorError)
        assert e.value.errno in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR)
    assert copied == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "plain"]
    assert list((tmp_path / "dir").iterdir()) == []


def test_enospc_leaves_old_file(tmp_path):
    """A real write error (injected ENOSPC in pinmem's pwrite) through save_file."""
    path, before = old_file(tmp_path)
    out = run_child("""
        import numpy as np, pinmem
        try:
            pinmem.safetensors.save_file({"w": np.ones(1 << 20)}, "ckpt.safetensors")
        except pinmem.IoError as e:
            print("IoError", isinstance(e, pinmem.safetensors.SafetensorError), e)
        """, tmp_path, {"PINMEM_FAULT": "file_write=1:ENOSPC"})
    # also a SafetensorError, as the package's save raises
    assert out.startswith("IoError True") and "ckpt.safetensors.tmp-" in out, out
    assert_untouched(tmp_path, path, before)


def test_full_disk_at_the_reservation_leaves_old_file(tmp_path):
    """A save writes past the end of its temporary, which reserves that range first; a disk
    that fills up during the reservation (injected: a part reserved, then ENOSPC) fails the
    save with IoError naming fallocate, and leaves the old file and no temporary. write_file
    past the end of a file leaves it as long as it was."""
    path, before = old_file(tmp_path)
    out = run_child("""
        import numpy as np, os, pinmem
        try:
            pinmem.safetensors.save_file({"w": np.ones(9 << 20)}, "ckpt.safetensors")
            print("SAVED")
        except pinmem.IoError as e:
            print("IoError", e)
        with open("other.bin", "wb") as f:
            f.write(b"x" * 5000)
        try:
            pinmem.write_file("other.bin", np.ones(1 << 20), 4096, io="direct", truncate=False)
        except pinmem.IoError as e:
            print("IoError", e)
        print("size", os.path.getsize("other.bin"))
        os.unlink("other.bin")
        """, tmp_path, {"PINMEM_FAULT": "file_reserve=1+"})
    first, second, size = out.splitlines()
    for line in (first, second):
        assert line.startswith("IoError") and "fallocate(fd" in line, out
        assert "No space left" in line and "injected fault" in line, out
    assert "ckpt.safetensors.tmp-" in first, out
    assert size == "size 5000", out
    assert_untouched(tmp_path, path, before)


@pytest.mark.parametrize("save", ["save_file", "save_file_async"])
def test_save_is_durable_and_keeps_mode(save, tmp_path, monkeypatch):
    """The data is fsync'd before the rename and the directory after it; the old file's
    permissions carry over."""
    path, _ = old_file(tmp_path)
    calls = []
    real_write, real_fsync, real_replace = pinmem.write_file, os.fsync, os.replace
    real_ranges = pinmem.write_ranges
    monkeypatch.setattr(pinmem, "write_file",
                        lambda *a, **kw: calls.append(("write", kw.get("fsync"))) or
                        real_write(*a, **kw))
    # save_file writes host arrays straight from their memory, in one write_ranges call
    monkeypatch.setattr(pinmem, "write_ranges",
                        lambda *a, **kw: calls.append(("write", kw.get("fsync"))) or
                        real_ranges(*a, **kw))
    monkeypatch.setattr(os, "replace", lambda a, b: calls.append(("rename",)) or real_replace(a, b))
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(
        ("fsync", os.path.realpath(f"/proc/self/fd/{fd}"))) or real_fsync(fd))
    h = getattr(pinmem.safetensors, save)({"w": np.ones(7)}, path)
    if h is not None:
        h.wait(timeout=60)
    assert calls == [("write", True), ("rename",), ("fsync", str(tmp_path))]
    assert os.stat(path).st_mode & 0o777 == 0o640


def _leases_work(tmp_path):
    """Whether this kernel grants a write lease on a file only this process has open."""
    import fcntl
    probe = tmp_path / "lease-probe"
    probe.write_bytes(b"x")
    fd = os.open(probe, os.O_RDWR)
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


def _truncations(monkeypatch):
    """The paths the release thread truncates (the inodes it frees itself)."""
    seen = []
    real = os.ftruncate
    monkeypatch.setattr(os, "ftruncate", lambda fd, n: seen.append(
        (os.fstat(fd).st_ino, n)) or real(fd, n))
    return seen


@pytest.mark.parametrize("save", ["save_file", "save_file_async"])
def test_replaced_file_is_freed_in_the_background(save, tmp_path, monkeypatch, no_fd_leak):
    """The file a save replaces is held across the rename and freed (truncated, as its only
    holder) by the release thread, which then closes it."""
    path, _ = old_file(tmp_path)
    ino = os.stat(path).st_ino
    seen = _truncations(monkeypatch)
    h = getattr(pinmem.safetensors, save)({"w": np.ones(5000)}, path)
    if h is not None:
        h.wait(timeout=60)
    assert pinmem.safetensors._releaser.wait_idle(timeout=60)
    # Where the kernel grants no write leases at all (leases-enable 0, some sandboxes), the
    # release only closes the file: the kernel frees it then, as after a plain rename.
    assert seen == ([(ino, 0)] if _leases_work(tmp_path) else [])
    assert os.stat(path).st_ino != ino
    pinmem.safetensors.save_file({"w": np.ones(5000)}, tmp_path / "fresh")  # replaces nothing
    assert path.read_bytes() == (tmp_path / "fresh").read_bytes()


@pytest.mark.parametrize("holder", ["fd", "mmap", "hard link"])
def test_replaced_file_stays_whole_for_its_other_users(holder, tmp_path, monkeypatch, no_fd_leak):
    """A replaced file that another open file, a mapping or a second name still reaches keeps
    every byte: the release thread only closes its own descriptor."""
    import mmap
    path, old = old_file(tmp_path)
    seen = _truncations(monkeypatch)
    fd = os.open(path, os.O_RDONLY)
    m = None
    if holder == "mmap":
        m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        os.close(fd)  # only the mapping keeps it open
        fd = None
    elif holder == "hard link":
        os.link(path, tmp_path / "other-name")
        os.close(fd)
        fd = None
    try:
        pinmem.safetensors.save_file({"w": np.zeros(3)}, path)
        assert pinmem.safetensors._releaser.wait_idle(timeout=60)
        assert seen == []
        if holder == "fd":
            assert os.pread(fd, len(old) + 1, 0) == old
        elif holder == "mmap":
            assert m[:] == old
        else:
            assert (tmp_path / "other-name").read_bytes() == old
    finally:
        if m is not None:
            m.close()
        if fd is not None:
            os.close(fd)


def test_replaced_file_not_writable_is_closed(tmp_path, monkeypatch, no_fd_leak):
    """An old file this process may only read is still replaced, and only closed."""
    if os.geteuid() == 0:
        pytest.skip("root may open any file for writing")
    path, _ = old_file(tmp_path)
    os.chmod(path, 0o440)
    seen = _truncations(monkeypatch)
    pinmem.safetensors.save_file({"w": np.zeros(3)}, path)
    assert pinmem.safetensors._releaser.wait_idle(timeout=60)
    assert seen == []
    assert os.stat(path).st_mode & 0o777 == 0o440


def test_failed_save_closes_the_held_file(tmp_path, monkeypatch, no_fd_leak):
    """A rename that fails leaves the old file as it was, and no descriptor on it."""
    path, old = old_file(tmp_path)

    def refuse(a, b):
        raise OSError(errno.EXDEV, "injected rename failure")
    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="injected"):
        pinmem.safetensors.save_file({"w": np.zeros(3)}, path)
    assert_untouched(tmp_path, path, old)


def test_release_after_fork_leaves_no_descriptor_in_the_child(tmp_path, no_fd_leak):
    """A child forked while a replaced file waits for release does not keep it open."""
    path, _ = old_file(tmp_path)
    rel = pinmem.safetensors._releaser
    fd = os.open(path, os.O_RDONLY)
    with rel._cv:  # a descriptor queued, the thread kept from taking it until after the fork
        rel._fds.append(fd)
        pid = os.fork()
        if pid == 0:
            os._exit(0 if not rel._fds and rel._thread is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with rel._cv:
        if rel._thread is None:
            rel._fds.remove(fd)
            os.close(fd)
        else:
            rel._cv.notify_all()
    assert rel.wait_idle(timeout=60)


class _FakeCopy:
    """Stands for a DMA into the snapshot still running: wait() fills its bytes (so a piece
    written before its wait would show zeros) and records the order."""

    def __init__(self, buf, begin, end, log):
        self.buf, self.begin, self.end, self.log = buf, begin, end, log

    def wait(self):
        np.asarray(self.buf)[self.begin:self.end] = np.arange(self.begin, self.end) % 251
        self.log.append(("wait", self.begin))


@pytest.mark.parametrize("total,cut_at", [(3 * 4096 + 17, 4096), ((1 << 20) + 5, 1 << 16),
                                          (40000, 0), (5 * 4096, 8 << 20)])
def test_save_pieces_start_after_their_own_copies(total, cut_at, tmp_path, monkeypatch,
                                                  no_fd_leak):
    """With DMAs still running, the first piece is written once the copies into it are done and
    the rest once all are; the file is whole either way. cut_at 0 or past the end: one write."""
    import pinmem.safetensors as ps
    monkeypatch.setattr(ps, "FIRST_PIECE", cut_at)
    buf = pinmem.empty(total, "uint8")
    log = []
    bounds = [0, 100, 4096 - 3, 4096 + 9, total // 2, total]
    copies = [(b, e, _FakeCopy(buf, b, e, log)) for b, e in zip(bounds, bounds[1:]) if b < e]
    real = pinmem.write_file

    def write(path, src, offset=0, **kw):
        log.append(("write", offset, len(memoryview(src).cast("B")), bool(kw.get("fsync"))))
        return real(path, src, offset, **kw)
    monkeypatch.setattr(pinmem, "write_file", write)
    ps._write_pieces(str(tmp_path / "f"), buf, copies)
    want = (np.arange(total) % 251).astype(np.uint8).tobytes()
    assert (tmp_path / "f").read_bytes() == want
    cut = max(cut_at, total // 16) // 4096 * 4096
    writes = [e for e in log if e[0] == "write"]
    if 0 < cut < total:
        assert writes == [("write", 0, cut, False), ("write", cut, total - cut, True)]
        first = log.index(writes[0])
        waited_before = {e[1] for e in log[:first] if e[0] == "wait"}
        assert waited_before == {b for b, _, _ in copies if b < cut}
        assert len([e for e in log if e[0] == "wait"]) == len(copies)
    else:
        assert writes == [("write", 0, total, True)]
        assert log.index(writes[0]) == len(copies)  # after every wait
    buf.release()


@pytest.mark.parametrize("n", [1, 4096, (1 << 20) + 3] + ([] if SMALL else [(65 << 20) + 12345]))
def test_write_device_after_a_header(n, tmp_path, rng, no_fd_leak):
    """The data written from device memory (through the pinned slots; O_DIRECT from 64 MiB)
    right after a header whose length is not a multiple of 4 KiB: byte for byte, durable."""
    head = random_bytes(rng, 8 * 613).tobytes()
    data = random_bytes(rng, n)
    d = pinmem.device_empty((n,), "uint8")
    pinmem.copy(d, data).wait()
    path = tmp_path / "f"
    pinmem.safetensors._write_device(str(path), head, d, None)
    got = path.read_bytes()
    assert got[:len(head)] == head and got[len(head):] == data.tobytes()


# ---- safetensors: save_file_async --------------------------------------------------------

def test_save_async_snapshot_and_done(tmp_path, rng, no_fd_leak):
    skip_unless_safetensors()
    import safetensors.numpy
    arrays = {"a": rng.random((300, 301)), "b": np.arange(9, dtype=np.int8)}
    want = {k: v.copy() for k, v in arrays.items()}
    before = pinmem.stats()["in_use_bytes"]
    h = pinmem.safetensors.save_file_async(arrays, tmp_path / "a.safetensors",
                                           metadata={"k": "v"})
    arrays["a"][:] = -1  # after the snapshot: not in the file
    h.wait(timeout=60)
    assert h.done() and h.exception() is None and "done" in repr(h)
    back = safetensors.numpy.load_file(str(tmp_path / "a.safetensors"))
    for k in want:
        np.testing.assert_array_equal(back[k], want[k])
    assert pinmem.stats()["in_use_bytes"] == before  # the pinned snapshot went back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]


def test_save_async_failure(tmp_path, monkeypatch):
    path, before = old_file(tmp_path)

    def fail(p, *a, **kw):
        raise OSError(errno.EIO, "disk gone (simulated)", p)

    monkeypatch.setattr(pinmem, "write_file", fail)
    h = pinmem.safetensors.save_file_async({"w": np.zeros(5)}, path)
    err = h.exception(timeout=60)
    assert isinstance(err, OSError) and "simulated" in str(err) and h.done()
    with pytest.raises(OSError, match="simulated"):
        h.wait(timeout=60)
    assert "failed" in repr(h)
    assert_untouched(tmp_path, path, before)


def test_failed_async_write_keeps_no_scratch_alive(tmp_path, no_fd_leak):
    """A failed background write gives its scratch back although the handle, and the error with
    its traceback, are kept (the traceback's frames would otherwise hold it)."""
    import functools
    import weakref

    class Scratch:  # stands for the device scratch a save writes from
        pass

    def write(tmp, flat):
        with open(tmp, "wb") as f:
            f.write(b"part")
        raise OSError(errno.EIO, "disk gone (simulated)", tmp)

    path, before = old_file(tmp_path)
    scratch = Scratch()
    gone = weakref.ref(scratch)
    h = pinmem.safetensors.SaveHandle(*pinmem.safetensors._target(path), "device")
    h._thread = threading.Thread(target=h._run, args=(None, (), [scratch],
                                                      functools.partial(write, flat=scratch)))
    del scratch
    h._thread.start()
    err = h.exception(timeout=60)
    h._thread.join()
    assert isinstance(err, OSError) and "simulated" in str(err)
    assert err.__traceback__ is not None  # kept, with its lines
    gc.collect()
    assert gone() is None, "the scratch outlived the failed save"
    assert_untouched(tmp_path, path, before)


def test_save_tensors_that_share_memory(tmp_path):
    """Tied weights (one array under two names) and overlapping views are each written in full;
    every name loads as its own array with the safetensors package, and (with torch) as its own
    tensor here. NumPy arrays save without torch, so this runs wherever safetensors is."""
    skip_unless_safetensors()
    import safetensors.numpy
    base = np.arange(24, dtype=np.float32)
    arrays = {"embed": base, "head": base, "low": base[:16].reshape(4, 4), "high": base[8:]}
    want = {k: v.copy() for k, v in arrays.items()}
    path = tmp_path / "tied.safetensors"
    pinmem.safetensors.save_file(arrays, path)
    back = safetensors.numpy.load_file(str(path))
    assert sorted(back) == sorted(want)
    for k in want:
        assert back[k].dtype == want[k].dtype and back[k].shape == want[k].shape, k
        np.testing.assert_array_equal(back[k], want[k], err_msg=k)
    try:
        import torch  # noqa: F401  (load_file returns torch tensors)
    except ImportError:
        return
    mine = pinmem.safetensors.load_file(path)
    for k in want:
        np.testing.assert_array_equal(mine[k].numpy(), want[k], err_msg=k)
    mine["embed"].fill_(-1)
    np.testing.assert_array_equal(mine["head"].numpy(), want["head"],
                                  err_msg="two names loaded as one tensor")


def test_save_async_torch(tmp_path, rng):
    skip_unless_safetensors()
    torch = skip_unless_torch()
    import safetensors.torch
    t = {"w": torch.randn(64, 65, dtype=torch.bfloat16), "s": torch.tensor(3)}
    want = {k: v.clone() for k, v in t.items()}
    handles = [pinmem.safetensors.save_file_async(t, tmp_path / f"{i}.st") for i in range(4)]
    t["w"].fill_(0)
    for h in handles:
        h.wait(timeout=60)
    for i in range(4):
        back = safetensors.torch.load_file(str(tmp_path / f"{i}.st"))
        assert all(same(torch, back[k], want[k]) for k in want)


def test_save_async_bad_stage(tmp_path, no_fd_leak):
    before = pinmem.stats()["in_use_bytes"]
    with pytest.raises(ValueError, match="stage must be one of auto, device, host"):
        pinmem.safetensors.save_file_async({"w": np.zeros(3)}, tmp_path / "x", stage="gpu")
    assert pinmem.stats()["in_use_bytes"] == before and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stage", ["auto", "device", "host"])
def test_save_async_arrays_stage_on_the_host(stage, tmp_path, rng, no_fd_leak):
    """Arrays have no device: every stage copies them before the call returns."""
    skip_unless_safetensors()
    import safetensors.numpy
    a = rng.random((70, 33))
    want = a.copy()
    h = pinmem.safetensors.save_file_async({"a": a}, tmp_path / "a", stage=stage)
    a[:] = 0
    h.wait(timeout=60)
    assert h.staged == "host"
    np.testing.assert_array_equal(safetensors.numpy.load_file(str(tmp_path / "a"))["a"], want)


def cuda_state(torch, rng, with_cpu=True):
    """Device tensors of several dtypes and sizes (two past 1 MiB), a non-contiguous one, a 0-d
    one, an empty one, and (with_cpu) a CPU tensor among them: without it, every tensor is on
    one device and the saves write from a scratch on it."""
    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(1 << 30)))
    out = {
        "big.f32": torch.randn(1 << 19, device="cuda", generator=g) + 0,  # 2 MiB
        "big.bf16": torch.randn(3 << 19, device="cuda", generator=g).bfloat16(),  # 3 MiB
        "small.i64": torch.arange(1001, device="cuda"),
        "odd.u8": torch.randint(0, 255, (4097,), dtype=torch.uint8, device="cuda", generator=g),
        "t.f16": torch.randn(33, 65, device="cuda", generator=g).half().t(),
        "zero.d": torch.tensor(2.5, device="cuda"),
        "none": torch.empty(0, 3, device="cuda"),
    }
    if with_cpu:
        out["cpu.f32"] = torch.randn(50, generator=torch.Generator().manual_seed(1))
    return out


@pytest.mark.parametrize("stage", ["device", "auto", "host"])
@pytest.mark.parametrize("piece,with_cpu", [(64 << 20, True), (1 << 20, True), (64 << 20, False)])
def test_save_async_cuda_snapshot_is_taken_at_the_call(stage, piece, with_cpu, tmp_path, rng,
                                                       monkeypatch, no_fd_leak):
    """Whatever the stage, work queued after the call (on the tensors' stream, the host's for
    CPU tensors) does not reach the file, which holds the values at the call, byte for byte.
    piece 1 MiB: the copies from the scratch are cut into several DMAs. Without a CPU tensor
    the file is written from the device scratch through pinned slots."""
    from conftest import skip_unless_torch_cuda
    skip_unless_safetensors()
    torch = skip_unless_torch_cuda()
    import safetensors.torch
    monkeypatch.setattr(pinmem.safetensors, "FIRST_PIECE", piece)
    state = cuda_state(torch, rng, with_cpu)
    want = {k: v.clone() for k, v in state.items()}
    torch.cuda.synchronize()
    pinned = pinmem.stats()["in_use_bytes"]
    used = torch.cuda.memory_allocated()
    h = pinmem.safetensors.save_file_async(state, tmp_path / "s", stage=stage)
    for t in state.values():
        t.zero_() if t.dtype != torch.bool else t.fill_(False)
    assert h.staged == ("host" if stage == "host" else "device")
    h.wait(timeout=60)
    back = safetensors.torch.load_file(str(tmp_path / "s"))
    assert sorted(back) == sorted(want)
    for k in want:
        assert same(torch, back[k], want[k].cpu()), k
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == used  # the scratch went back
    assert pinmem.stats()["in_use_bytes"] == pinned


@pytest.mark.parametrize("stage", ["device", "auto", "host"])
def test_save_file_cuda_every_stage(stage, tmp_path, rng, no_fd_leak):
    """save_file of tensors all on the device (written from a scratch on it, or from a pinned
    snapshot with "host") loads back byte for byte with the safetensors package; the scratch
    and the snapshot are given back."""
    from conftest import skip_unless_torch_cuda
    skip_unless_safetensors()
    torch = skip_unless_torch_cuda()
    import safetensors.torch
    state = cuda_state(torch, rng, with_cpu=False)
    torch.cuda.synchronize()
    pinned = pinmem.stats()["in_use_bytes"]
    used = torch.cuda.memory_allocated()
    pinmem.safetensors.save_file(state, tmp_path / "s", metadata={"step": "7"}, stage=stage)
    back = safetensors.torch.load_file(str(tmp_path / "s"))
    assert sorted(back) == sorted(state)
    for k in state:
        assert same(torch, back[k], state[k].cpu()), k
    assert torch.cuda.memory_allocated() == used
    assert pinmem.stats()["in_use_bytes"] == pinned
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


@pytest.mark.parametrize("save", ["save_file", "save_file_async"])
def test_failed_device_write_leaves_old_file(save, tmp_path, monkeypatch, no_fd_leak):
    """The data write from the device scratch fails: the old file stays, no temporary is left,
    the scratch goes back."""
    from conftest import skip_unless_torch_cuda
    torch = skip_unless_torch_cuda()
    path, before = old_file(tmp_path)
    real = pinmem.write_file

    def write(p, src, offset=0, **kw):
        if offset:  # the data, after the header
            real(p, np.zeros(100, np.uint8), offset, truncate=False)  # a part written
            raise OSError(errno.EIO, "disk gone (simulated)", p)
        return real(p, src, offset, **kw)

    w = torch.randn(1 << 20, device="cuda")
    torch.cuda.synchronize()
    used = torch.cuda.memory_allocated()
    monkeypatch.setattr(pinmem, "write_file", write)
    with pytest.raises(OSError, match="simulated"):
        h = getattr(pinmem.safetensors, save)({"w": w}, path, stage="device")
        if h is not None:
            assert h.staged == "device"
            h.wait(timeout=60)
    assert_untouched(tmp_path, path, before)
    assert torch.cuda.memory_allocated() == used


def test_save_async_device_stage_on_a_side_stream_of_the_caller(tmp_path, rng, no_fd_leak):
    """Tensors made and changed on the caller's own stream: the scratch copy is ordered on it."""
    from conftest import skip_unless_torch_cuda
    torch = skip_unless_torch_cuda()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        w = torch.full((1 << 20,), 7.0, device="cuda")
        torch.cuda._sleep(20_000_000)  # the values are still being made when save is called
        w.add_(1)
        h = pinmem.safetensors.save_file_async({"w": w}, tmp_path / "w", stage="device")
        w.add_(1)
    h.wait(timeout=60)
    out = pinmem.safetensors.load_file(tmp_path / "w")["w"]
    assert torch.equal(out, torch.full((1 << 20,), 8.0))


def test_save_async_auto_without_room_copies_to_the_host(tmp_path, rng, monkeypatch, no_fd_leak):
    from conftest import skip_unless_torch_cuda
    torch = skip_unless_torch_cuda()
    monkeypatch.setattr(pinmem.safetensors, "_device_room", lambda torch, dev: 0)
    w = torch.randn(1000, device="cuda")
    want = w.cpu()
    h = pinmem.safetensors.save_file_async({"w": w}, tmp_path / "w")
    w.zero_()
    h.wait(timeout=60)
    assert h.staged == "host"
    assert torch.equal(pinmem.safetensors.load_file(tmp_path / "w")["w"], want)


@pytest.mark.parametrize("stage", ["device", "auto"])
def test_save_async_scratch_out_of_memory(stage, tmp_path, monkeypatch, no_fd_leak):
    """No room for the scratch: "device" raises torch's error and leaves nothing behind, "auto"
    copies to the host instead."""
    from conftest import skip_unless_torch_cuda
    torch = skip_unless_torch_cuda()
    w = torch.randn(1000, device="cuda")
    want = w.cpu()
    real_empty = torch.empty

    def empty(*a, **kw):
        if kw.get("dtype") is torch.uint8 and str(kw.get("device", "")).startswith("cuda"):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_empty(*a, **kw)

    pinned = pinmem.stats()["in_use_bytes"]
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", empty)
        m.setattr(pinmem.safetensors, "_device_room", lambda torch, dev: 1 << 40)
        if stage == "device":
            with pytest.raises(torch.cuda.OutOfMemoryError, match="simulated"):
                pinmem.safetensors.save_file_async({"w": w}, tmp_path / "w", stage=stage)
            assert list(tmp_path.iterdir()) == []
            assert pinmem.stats()["in_use_bytes"] == pinned
            return
        h = pinmem.safetensors.save_file_async({"w": w}, tmp_path / "w", stage=stage)
    w.zero_()
    h.wait(timeout=60)
    assert h.staged == "host"
    assert torch.equal(pinmem.safetensors.load_file(tmp_path / "w")["w"], want)


def test_save_lazy_views(tmp_path):
    """A conjugate or negative view is saved as the values it shows, not its storage."""
    torch = skip_unless_torch()
    z = torch.randn(4, dtype=torch.complex64)
    t = {"conj": z.conj(), "neg": torch._neg_view(z) if hasattr(torch, "_neg_view") else -z}
    pinmem.safetensors.save_file(t, tmp_path / "v")
    out = pinmem.safetensors.load_file(tmp_path / "v")
    assert torch.equal(out["conj"], z.conj().resolve_conj())
    assert torch.equal(out["neg"], -z)


def test_read_write_torch_cuda_tensor(tmp_path, rng):
    from conftest import skip_unless_torch_cuda
    torch = skip_unless_torch_cuda()
    n = (5 << 20) + 3
    data = write_background(tmp_path / "f.bin", rng, n + 7)
    d = torch.zeros(n, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    for io in IOS:
        pinmem.read_file(tmp_path / "f.bin", d, 7, io=io, stream=s).wait()
        assert torch.equal(d.cpu(), torch.from_numpy(data[7:]))
        pinmem.write_file(tmp_path / "g.bin", d, io=io, stream=s).wait()
        assert (tmp_path / "g.bin").read_bytes() == data[7:].tobytes()


def _pinned_into(bufs):
    """An alloc for pinmem.safetensors._read: a pinned buffer of the n bytes asked for (placed
    nowhere in particular), kept in bufs."""
    def alloc(n, at):
        b = pinmem.empty(n, "uint8")
        bufs.append(b)
        return b, np.asarray(b), None
    return alloc


def file_stats():
    return pinmem._pinmem._file_stats()


def drop_pages(path):
    """The file's pages out of the page cache, where the filesystem lets them go (tmpfs keeps
    them); the file must be synced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident(path):
    """The fraction of the file's pages in the page cache (mincore over a read-only mapping)."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        vec = ctypes.create_string_buffer(pages)
        try:
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw) / pages


def test_load_file_bad_io(tmp_path):
    with pytest.raises(pinmem.InvalidError, match="io must be one of auto, buffered, direct"):
        pinmem.safetensors.load_file(tmp_path / "missing.safetensors", io="fast")


@pytest.mark.parametrize("io", IOS)
def test_load_file_io(io, tmp_path, rng, no_fd_leak):
    """load_file(io=...) reads the data as asked: 'buffered' through the page cache (what
    several processes loading one file share), 'direct' through O_DIRECT (where the filesystem
    takes it), 'auto' direct for a cold file of 64 MiB or more. Counted by pinmem's byte
    counters, through the reader load_file uses (torch is not needed for it)."""
    arrays = {"a": random_bytes(rng, (64 << 20) + 5), "b": random_bytes(rng, 4099)}
    path = tmp_path / "m.safetensors"
    pinmem.safetensors.save_file(arrays, path)
    used = sum(a.nbytes for a in arrays.values())
    bufs = []
    alloc = _pinned_into(bufs)

    def load():
        drop_pages(path)
        cached = resident(path)
        s0 = file_stats()
        entries, data = pinmem.safetensors._read(str(path), lambda e: None, alloc, io)
        s1 = file_stats()
        return entries, data, {k: s1[k] - s0[k] for k in s1}, cached

    entries, data, d, cached = load()
    assert d["read_direct"] + d["read_buffered"] == used
    if io == "buffered" or d["direct_refused"]:
        assert d["read_direct"] == 0
    elif io == "direct":
        assert d["read_direct"] >= used - 2 * 4096  # all but the unaligned edges
    elif cached < 0.1:
        # auto on a cold file of 64 MiB or more: direct (all but the unaligned edges)
        assert d["read_direct"] >= used - 2 * 4096, (cached, d)
    elif cached > 0.9:
        # auto on a file the page cache kept (tmpfs keeps every page): through the cache
        assert d["read_direct"] == 0, (cached, d)
    else:
        pytest.skip(f"auto's choice: the page cache kept {cached:.0%} of the file after "
                    "POSIX_FADV_DONTNEED, neither cold nor resident")
    for name, _, _, begin, end in entries:
        np.testing.assert_array_equal(data[begin:end], arrays[name])


@pytest.mark.parametrize("io", IOS)
def test_load_file_io_torch(io, tmp_path, rng, monkeypatch, no_fd_leak):
    """load_file hands io to its reader, and the tensors are the file's in every mode."""
    torch = skip_unless_torch()
    arrays = {"a": random_bytes(rng, (1 << 20) + 5), "b": random_bytes(rng, 4099)}
    path = tmp_path / "m.safetensors"
    pinmem.safetensors.save_file(arrays, path)
    real, seen = pinmem.safetensors._read, []

    def read(p, c, a, i, *rest, **kw):
        seen.append(i)
        return real(p, c, a, i, *rest, **kw)
    monkeypatch.setattr(pinmem.safetensors, "_read", read)
    out = pinmem.safetensors.load_file(path, io=io)
    assert seen == [io]
    for k, a in arrays.items():
        np.testing.assert_array_equal(out[k].numpy(), a)
    del out, torch


def _unpadded(path, arrays):
    """A safetensors file of arrays whose header is not padded to 8 bytes (as the format's
    writers pad it; its readers do not insist), so its data starts off the 8-byte grid."""
    header, at = {}, 0
    for k, a in arrays.items():
        header[k] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [at, at + a.nbytes]}
        at += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((3 - len(raw)) % 8)  # 8 + len(raw) is 3 past the grid
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(a.tobytes() for a in arrays.values()))


@pytest.mark.parametrize("padded", [True, False])
def test_host_loads_read_in_place(padded, tmp_path, rng, no_fd_leak):
    """A load into host memory places that memory as the file's bytes lie (the same offset
    modulo 4 KiB), so that O_DIRECT reads into it in place: the pool gives load_file's buffer
    (or one per get_tensor) and no pinned slot for a copy. A header off the 8-byte grid would
    leave elements misaligned so: the buffer starts on a page instead (read through the slots)
    and every tensor is still aligned and exact."""
    torch = skip_unless_torch()
    arrays = {"a": rng.standard_normal((3 << 20) // 4 + 5).astype(np.float32),
              "b": rng.standard_normal(1027).astype(np.float32)}
    path = tmp_path / "m.safetensors"
    if padded:
        pinmem.safetensors.save_file(arrays, path)
    else:
        _unpadded(path, arrays)
    with open(path, "rb") as f:
        start = 8 + struct.unpack("<Q", f.read(8))[0]
    assert (start % 8 == 0) == padded and start % 4096

    def allocs(load):
        s0 = pinmem.stats()["allocs"]
        out = load()
        for k, a in arrays.items():
            got = out[k] if isinstance(out[k], np.ndarray) else out[k].numpy()
            np.testing.assert_array_equal(got, a)
            assert got.ctypes.data % 4 == 0, k
        return pinmem.stats()["allocs"] - s0

    n = allocs(lambda: pinmem.safetensors.load_file(path, io="direct"))
    assert n == 1 if padded else n > 1
    with pinmem.safetensors.safe_open(path, "pt", io="direct") as f:
        n = allocs(lambda: {k: f.get_tensor(k) for k in arrays})
    assert n == 2 if padded else n > 2, n
    with pinmem.safetensors.safe_open(path, "np", io="direct") as f:
        n = allocs(lambda: {k: f.get_tensor(k) for k in arrays})
    assert n == 0 if padded else n > 0
    del torch


def test_load_cuts_pieces_only_between_tensors():
    """_cuts: pieces cover the data region in order, each but the last at least as large as
    asked (the first PIECE_FIRST, then twice the one before, up to PIECE_MAX), and no tensor
    crosses a cut, also where tensors overlap in their spans' order or leave gaps."""
    st = pinmem.safetensors
    mib = 1 << 20
    assert st._cuts([("a", "U8", [8], 0, 8)], 8) == [(0, 8)]  # under PIECES_MIN: one piece
    sizes = [mib * k for k in (1, 3, 20, 5, 40, 300, 7, 60, 2)] * 4
    entries, at = [], 0
    for i, n in enumerate(sizes):
        entries.append((f"t{i}", "U8", [n], at, at + n))
        at += n + (4096 if i % 5 == 0 else 0)  # gaps (strict=False files have them)
    cuts = st._cuts(entries[::-1], at)  # in any header order
    assert cuts[0][0] == 0 and cuts[-1][1] == at
    assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
    want = st.PIECE_FIRST
    for b, e in cuts[:-1]:
        assert e - b >= want, (b, e, want)
        want = min(2 * want, st.PIECE_MAX)
    for _, _, _, b, e in entries:
        assert any(cb <= b and e <= ce for cb, ce in cuts), (b, e)
    assert len(cuts) > 4


def test_host_load_in_pieces_allocated_beside_the_reads(tmp_path, rng, monkeypatch, no_fd_leak):
    """load_file(device='cpu') of a region of PIECES_MIN bytes or more: a buffer per piece,
    allocated on a thread of their own while the reads run on the caller's (a piece read as
    soon as its buffer is there; where the pool has them all at once, one read), every tensor
    exact and in memory of its own; a read that fails raises, naming the file, and every
    piece's memory goes back to the pool."""
    torch = skip_unless_torch()
    st = pinmem.safetensors
    monkeypatch.setattr(st, "PIECES_MIN", 1 << 20)
    monkeypatch.setattr(st, "PIECE_FIRST", 256 << 10)
    monkeypatch.setattr(st, "PIECE_MAX", 1 << 20)
    arrays = {f"t{i}": rng.standard_normal(n).astype(np.float32)
              for i, n in enumerate([70_000, 1, 300_000, 5_000, 400_000, 90_000, 0, 33])}
    path = tmp_path / "m.safetensors"
    st.save_file(arrays, path)
    pieces = len(st._cuts(st._parse_header(path.read_bytes(), str(path))[1],
                          sum(a.nbytes for a in arrays.values())))
    assert pieces > 2
    threads, reads = set(), []
    real_alloc, real_read = st._alloc, st._read_ranges

    def slow_alloc(*a):  # as a first load's allocations are: slower than the reads
        threads.add(threading.current_thread().name)
        time.sleep(0.05)
        return real_alloc(*a)

    def read(fd, ranges, *rest):
        reads.append((ranges, threading.current_thread().name))
        return real_read(fd, ranges, *rest)
    monkeypatch.setattr(st, "_alloc", slow_alloc)
    monkeypatch.setattr(st, "_read_ranges", read)

    def load():
        reads.clear()
        out = st.load_file(path)
        assert {name for _, name in reads} == {threading.current_thread().name}
        assert sum(len(r) for r, _ in reads) == pieces
        for k, a in arrays.items():
            np.testing.assert_array_equal(out[k].numpy(), a)
            assert out[k].untyped_storage().nbytes() == a.nbytes, k
        return len(reads)

    assert load() == pieces  # each piece read once its buffer came
    assert threads == {"pinmem-load-alloc_0"}
    gc.collect()
    base = pinmem.stats()["in_use_bytes"]

    def fail_second(fd, ranges, *rest):
        if reads:
            raise pinmem.IoError("injected")
        return read(fd, ranges, *rest)
    monkeypatch.setattr(st, "_read_ranges", fail_second)
    with pytest.raises(pinmem.IoError, match="injected"):
        st.load_file(path)
    gc.collect()
    assert pinmem.stats()["in_use_bytes"] == base
    del torch


def test_checkpoint_goes_direct_and_round_trips(tmp_path, rng, no_fd_leak):
    """A checkpoint of 64 MiB or more is written through O_DIRECT (io='auto'; only the range's
    unaligned tail through the page cache) and, once out of the page cache, read back through
    it; where the filesystem refuses O_DIRECT both go buffered and are counted as refused.
    Asserted from pinmem's byte counters, not from timing; the file still round-trips."""
    arrays = {f"t{i}": random_bytes(rng, (16 << 20) + 8 * i + 3).view(np.uint8)
              for i in range(4)}
    arrays["f32"] = rng.standard_normal(1001).astype(np.float32)
    total = sum(a.nbytes for a in arrays.values())
    path = tmp_path / "big.safetensors"
    s0 = file_stats()
    pinmem.safetensors.save_file(arrays, path)
    s1 = file_stats()
    size = path.stat().st_size
    written = s1["write_direct"] - s0["write_direct"] + s1["write_buffered"] - s0["write_buffered"]
    assert written == size and size > total
    if s1["direct_refused"] > s0["direct_refused"]:
        assert s1["write_direct"] == s0["write_direct"]
    else:
        assert s1["write_buffered"] - s0["write_buffered"] == size % 4096
    drop_pages(path)  # cold: synced by the save
    buf = []
    alloc = _pinned_into(buf)
    s2 = file_stats()
    entries, data = pinmem.safetensors._read(str(path), lambda e: None, alloc)
    s3 = file_stats()
    moved = s3["read_direct"] - s2["read_direct"] + s3["read_buffered"] - s2["read_buffered"]
    assert moved >= total
    if s3["direct_refused"] == s2["direct_refused"] and s1["direct_refused"] == s0["direct_refused"]:
        # Direct unless the page cache kept the file (tmpfs does): then all buffered.
        direct = s3["read_direct"] - s2["read_direct"]
        assert direct >= moved - 2 * 4096 or direct == 0
    for name, dtype, shape, begin, end in entries:
        np.testing.assert_array_equal(data[begin:end], arrays[name].view(np.uint8).reshape(-1),
                                      err_msg=name)
    try:
        import safetensors.numpy
    except ImportError:
        return  # the package's side is covered where it is installed
    back = safetensors.numpy.load_file(str(path))
    assert back.keys() == arrays.keys()
    for k, a in arrays.items():
        np.testing.assert_array_equal(back[k], a, err_msg=k)


@pytest.mark.parametrize("io", IOS)
def test_reads_through_a_given_fd(tmp_path, rng, io, no_fd_leak):
    """read_file and read_ranges given fd read the file open there, also once it has been
    replaced at path, and leave fd open; their errors still name path."""
    path = tmp_path / "f.bin"
    n = (1 << 20) + 4096 * 3 + 5
    old = write_background(path, rng, n)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.unlink(path)
        write_background(path, rng, 100)  # another file at path now, shorter
        a = np.zeros(n - 7, np.uint8)
        pinmem.read_file(path, a, 7, io=io, fd=fd).wait()
        assert (a == old[7:]).all()
        b, c = np.zeros(4096, np.uint8), np.zeros(n - 9000, np.uint8)
        pinmem.read_ranges(path, [(100, b), (9000, c)], io=io, fd=fd)
        assert (b == old[100:4196]).all() and (c == old[9000:]).all()
        os.fstat(fd)  # still open
        with pytest.raises(pinmem.IoError, match=r"read_file\('.*f\.bin'\)"):
            pinmem.read_file(path, np.zeros(16, np.uint8), n - 8, io=io, fd=fd).wait()
        with pytest.raises(pinmem.IoError, match=r"read_ranges\('.*f\.bin'\)"):
            pinmem.read_ranges(path, [(n - 8, np.zeros(16, np.uint8))], io=io, fd=fd)
    finally:
        os.close(fd)
