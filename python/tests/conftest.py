"""Shared fixtures for pinmem's Python tests.

The tests run on whatever backend pinmem picks (PINMEM_BACKEND=auto|cuda|host; `make
test-python` runs them on the host backend where no GPU is present). Data is never all zeros:
rng() gives seeded random data, so a copy that moved nothing cannot pass.
"""
import os

import numpy as np
import pytest

import pinmem

# Small sizes under PINMEM_TEST_SMALL (valgrind-style runs), as the C tests do.
SMALL = os.environ.get("PINMEM_TEST_SMALL") == "1"


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


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
