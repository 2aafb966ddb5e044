"""pinmem.safetensors.numpy: the safetensors package's `safetensors.numpy`, over pinmem.

DESIGN. The same names and arguments as the package's module (load_file, save_file, load, save,
safe_open), so that `from pinmem.safetensors.numpy import load_file` replaces `from
safetensors.numpy import load_file` unchanged, without torch. Arrays are read through pinmem
(safe_open with framework 'np': one read a tensor, each array in memory of its own) and saved
through pinmem.safetensors.save_file (atomic, fsync'd). Big-endian arrays are saved
little-endian and non-contiguous ones by their values, as the format wants them.
"""
import numpy as np

from . import (SafetensorError, SafetensorTypeError, _error, _from_bytes,  # noqa: F401
               _to_bytes, safe_open)
from . import save_file as _save_file

__all__ = ["load_file", "save_file", "load", "save", "safe_open", "SafetensorError"]


def load_file(filename, *, backend="mmap", io="auto", strict=True):
    """A dict of NumPy arrays from the safetensors file `filename`, as the package's load_file.
    backend: 'mmap' or 'pread' (both read through pinmem); io and strict: as
    pinmem.safetensors.load_file's."""
    with safe_open(filename, "np", backend=backend, io=io, strict=strict) as f:
        return f.get_tensors()


def _check(tensors):
    if not isinstance(tensors, dict):
        raise _error(SafetensorTypeError, "Expected a dict of [str, np.ndarray] but received "
                     f"{type(tensors)}")
    for k, v in tensors.items():
        if not isinstance(v, np.ndarray):
            raise _error(SafetensorTypeError, f"Key `{k}` is invalid, expected np.ndarray but "
                         f"received {type(v)}")


def save_file(tensors, filename, metadata=None):
    """Write `tensors` (a dict of names to NumPy arrays) to `filename` with optional metadata
    (str -> str), atomically, as the package's save_file."""
    _check(tensors)
    _save_file(tensors, filename, metadata)


def save(tensors, metadata=None):
    """The safetensors file of `tensors` as bytes, as the package's save."""
    _check(tensors)
    return _to_bytes(tensors, metadata)


def load(data, *, strict=True):
    """A dict of NumPy arrays, each with memory of its own, from the bytes of a safetensors
    file, as the package's load."""
    return _from_bytes(data, "np", strict)
