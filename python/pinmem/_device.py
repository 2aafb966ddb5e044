"""DESIGN: which device the calling thread works on, for pinmem's Python code that makes another
device current for a piece of work (the loader's staging and cuda:k loaders, the DCP writer's
copies back) and gives the thread its own back after. A thread that had none (cuda: no current
context, where current_device() answers 0 as CUDA's runtime does) gets none back, never device
0, whose context it would get: hundreds of MB of GPU 0 in a process of another GPU
(docs/multi-gpu.md).
"""
import contextlib

from . import _pinmem


@contextlib.contextmanager
def on_device(device):
    """`device` current on the calling thread inside the block (None or -1: left as it is), the
    thread's own given back after."""
    prev = _pinmem._bound_device() if device is not None and device >= 0 else device
    if prev == device:
        yield
        return
    _pinmem.set_device(device)
    try:
        yield
    finally:
        _pinmem._put_back_device(prev)
