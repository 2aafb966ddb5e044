"""Shared fixtures for pinmem's Python tests.

The tests run on whatever backend pinmem picks (PINMEM_BACKEND=auto|cuda|host). Where auto
would fall back to the host backend (no usable GPU), they set PINMEM_BACKEND=host first: auto's
fallback refuses device memory (no silent CPU), and the tests simulate devices on purpose
(test_backend_choice.py checks the fallback itself, in child processes). Data is never all
zeros: rng() gives seeded random data, so a copy that moved nothing cannot pass.
"""
import os
import subprocess
import sys

import numpy as np
import pytest


def _simulate_devices_without_gpu():
    if os.environ.get("PINMEM_BACKEND"):
        return
    probe = subprocess.run([sys.executable, "-c",
                            "import pinmem; print(int(pinmem.backend_info()['fallback']))"],
                           capture_output=True, text=True)
    if probe.returncode == 0 and probe.stdout.strip() == "1":
        os.environ["PINMEM_BACKEND"] = "host"


_simulate_devices_without_gpu()
import pinmem  # noqa: E402  (after PINMEM_BACKEND is settled: pinmem reads it at start)

# Small sizes under PINMEM_TEST_SMALL (valgrind-style runs), as the C tests do.
SMALL = os.environ.get("PINMEM_TEST_SMALL") == "1"


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture
def file_reads(monkeypatch):
    """The (offset, nbytes) of every pinmem file read the test makes, in order."""
    reads = []
    real = pinmem._pinmem._file_read

    def spy(fd, offset, nbytes, dst, stream, io):
        reads.append((offset, nbytes))
        return real(fd, offset, nbytes, dst, stream, io)

    monkeypatch.setattr(pinmem._pinmem, "_file_read", spy)
    return reads


def random_bytes(rng, n):
    """n random bytes, never all zero."""
    a = rng.integers(0, 256, size=n, dtype=np.uint8)
    if n and not a.any():
        a[0] = 1
    return a


def torch_cuda():
    """torch, when it is importable and sees a CUDA device; else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def skip_unless_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("torch is not installed (pip install torch): torch interop not tested here")
    import torch
    return torch


def skip_unless_torch_cuda():
    torch = skip_unless_torch()
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device: GPU interop runs on a GPU machine")
    if pinmem.backend() != "cuda":
        pytest.skip("pinmem runs on the host backend (PINMEM_BACKEND=%s): GPU interop needs cuda"
                    % os.environ.get("PINMEM_BACKEND", "auto"))
    return torch


def warnings_in_forked_child(action):
    """Fork; in the child run action() and a garbage collection with every warning recorded
    (pytest's own capture hides a child's stderr), then exit. Returns the warnings, one
    "Category: message" line each ("" for none), once the child exited 0."""
    import gc
    import warnings
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            os.close(r)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                action()
                gc.collect()
            os.write(w, "".join(f"{x.category.__name__}: {x.message}\n"
                                for x in seen).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        said = f.read()  # until the child exits
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return said


class Gate:
    """A host function on `stream` that holds it until open() (the C tests' gate): work queued
    behind it cannot have run, and work ordered after that work must wait, so a test forces the
    ordering it names instead of hoping for a race. hold=False only marks the point the stream
    reached (reached()). Use as a context manager, so a failing test still lets the stream go."""

    def __init__(self, stream, hold=True):
        self._h = pinmem._pinmem._stream_gate(stream, hold)
        self._opened = None

    def reached(self, timeout=0.0):
        """Whether the stream got to the gate within timeout seconds."""
        return pinmem._pinmem._gate_reached(self._h, timeout)

    def open(self):
        """Let the stream go on; True when the gate was still holding it."""
        if self._opened is None:
            self._opened = pinmem._pinmem._gate_open(self._h)
        return self._opened

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.open()
