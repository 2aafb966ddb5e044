"""pinmem.safetensors.torch: the safetensors package's `safetensors.torch`, over pinmem.

DESIGN. The same names and arguments as the package's module (load_file, save_file, load, save,
safe_open, save_model, load_model, and the storage helpers code written against it imports), so
that `from pinmem.safetensors.torch import load_file` replaces `from safetensors.torch import
load_file` unchanged; the files are the package's format byte for byte (both write tensors in
the same order). Reads and writes go through pinmem (pinned slots, O_DIRECT, device DMA: see
pinmem.safetensors). A save checks its input as the package does before anything is written:
a dict of dense torch tensors, none sharing memory with another (RuntimeError; save_model drops
the duplicates), each contiguous (ValueError). permissive=True keeps pinmem.safetensors'
behaviour instead: tensors that share memory are each written in full and non-contiguous ones
are made contiguous. Errors are pinmem.safetensors.SafetensorError (the package's too, when it
is installed) where the package raises its SafetensorError.
"""
import collections as _collections

import torch

from . import (SafetensorError, SafetensorInvalidError, SafetensorTypeError,  # noqa: F401
               SharedTensorsError, _error, _from_bytes, _to_bytes, safe_open)
from . import load_file as _load_file
from . import save_file as _save_file

__all__ = ["load_file", "save_file", "load", "save", "safe_open", "save_model", "load_model",
           "SafetensorError"]


def load_file(filename, device="cpu", *, backend="mmap", io="auto", strict=True):
    """A dict of the tensors of the safetensors file `filename` on `device` (a string, a
    torch.device or an index), as the package's load_file. backend: 'mmap' or 'pread' (both
    read through pinmem); io and strict: as pinmem.safetensors.load_file's."""
    return _load_file(filename, device, backend=backend, io=io, strict=strict)


def save_file(tensors, filename, metadata=None, *, permissive=False, stage="auto"):
    """Write `tensors` (a dict of names to torch tensors) to `filename` with optional metadata
    (str -> str), as the package's save_file, atomically (a failed save leaves the old file).
    The input is checked as the package checks it (permissive=False); permissive=True saves
    tensors that share memory, each in full, and non-contiguous ones made contiguous. stage: as
    pinmem.safetensors.save_file's."""
    if not permissive:
        _check_for_save(tensors)
    _save_file(tensors, filename, metadata, stage=stage)


def save(tensors, metadata=None, *, permissive=False):
    """The safetensors file of `tensors` as bytes, as the package's save."""
    if not permissive:
        _check_for_save(tensors)
    return _to_bytes(tensors, metadata)


def load(data, *, strict=True):
    """A dict of CPU tensors, each with memory of its own, from the bytes of a safetensors
    file, as the package's load."""
    return _from_bytes(data, "pt", strict)


def _check_for_save(tensors):
    """Refuse, in the package's words, what it refuses to save: not a dict, values that are not
    tensors, sparse tensors (ValueError), tensors that share memory (RuntimeError),
    non-contiguous tensors (ValueError)."""
    if not isinstance(tensors, dict):
        raise _error(SafetensorTypeError, "Expected a dict of [str, torch.Tensor] but received "
                     f"{type(tensors)}")
    sparse = []
    for k, v in tensors.items():
        if not isinstance(v, torch.Tensor):
            raise _error(SafetensorTypeError, f"Key `{k}` is invalid, expected torch.Tensor but "
                         f"received {type(v)}")
        if v.layout != torch.strided:
            sparse.append(k)
    if sparse:
        raise _error(SafetensorInvalidError, f"You are trying to save a sparse tensors: `{sparse}` "
                     "which this library does not support. You can make it a dense tensor before "
                     "saving with `.to_dense()` but be aware this might make a much larger file "
                     "than needed.")
    failing = [names for names in _find_shared_tensors(tensors) if len(names) > 1]
    if failing:
        raise _error(SharedTensorsError, f"Some tensors share memory, this will lead to duplicate "
                     f"memory on disk and potential differences when loading them again: "
                     f"{failing}. A potential way to correctly save your model is to use "
                     "`save_model` (pinmem.safetensors.torch.save_model), or save_file(..., "
                     "permissive=True) to write each in full.")
    for k, v in tensors.items():
        if not v.is_contiguous():
            raise _error(SafetensorInvalidError, f"You are trying to save a non contiguous tensor: "
                         f"`{k}` which is not allowed. It either means you are trying to save "
                         "tensors which are reference of each other in which case it's "
                         "recommended to save only the full tensors, and reslice at load time, or "
                         "simply call `.contiguous()` on your tensor to pack it before saving "
                         "(or save_file(..., permissive=True)).")


# ---- memory shared between tensors ---------------------------------------------------------

def storage_ptr(tensor):
    """The address of the storage under `tensor` (0 where it has none: meta tensors)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return 0


def storage_size(tensor):
    """The bytes of the storage under `tensor` (its own bytes where it has no storage)."""
    try:
        return tensor.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):
        return tensor.nelement() * tensor.element_size()


def _end_ptr(tensor):
    """One past the last byte `tensor` reaches (its address when it is empty)."""
    if not tensor.nelement():
        return tensor.data_ptr()
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()) if s > 0)
    return tensor.data_ptr() + (last + 1) * tensor.element_size()


def _is_complete(tensor):
    """Whether `tensor` covers its whole storage from its first byte."""
    return (tensor.data_ptr() == storage_ptr(tensor)
            and tensor.nelement() * tensor.element_size() == storage_size(tensor))


def _find_shared_tensors(state_dict):
    """Names of tensors that share memory, as a list of sets, one per group (a tensor that
    shares with none is a group of its own), in the order of their first names; tensors on the
    meta device or without bytes are left out. Tensors of one storage whose bytes do not
    overlap are apart."""
    groups = _collections.OrderedDict()
    for name, t in state_dict.items():
        if t.device.type == "meta":
            continue
        ptr, size = storage_ptr(t), storage_size(t)
        if ptr and size:
            groups.setdefault((t.device, ptr, size), []).append(name)
    out = []
    for names in groups.values():
        if len(names) == 1:
            out.append(set(names))
            continue
        spans = sorted((state_dict[n].data_ptr(), _end_ptr(state_dict[n]), n) for n in names)
        reach = None
        for start, stop, name in spans:
            if reach is None or start >= reach:
                out.append({name})
                reach = stop
            else:
                out[-1].add(name)
                reach = max(reach, stop)
    return out


def _remove_duplicate_names(state_dict, *, preferred_names=None, discard_names=None):
    """{name kept: [names dropped]} for each group of tensors sharing memory: the kept one
    covers the whole storage (RuntimeError when none does), preferring preferred_names, then
    names not in discard_names, then the first by name."""
    preferred_names = set(preferred_names or ())
    discard_names = set(discard_names or ())
    to_remove = _collections.defaultdict(list)
    for shared in _find_shared_tensors(state_dict):
        complete = sorted(n for n in shared if _is_complete(state_dict[n]))
        if not complete:
            raise _error(SharedTensorsError, "Error while trying to find names to remove to save "
                         f"state dict, but found no suitable name to keep for saving amongst: "
                         f"{shared}. None is covering the entire storage. Refusing to save/load "
                         "the model since you could be storing much more memory than needed.")
        keep = complete[0]
        kept = [n for n in complete if n not in discard_names]
        if kept:
            keep = kept[0]
        chosen = [n for n in complete if n in preferred_names]
        if chosen:
            keep = chosen[0]
        for name in sorted(shared):
            if name != keep:
                to_remove[keep].append(name)
    return dict(to_remove)


def save_model(model, filename, metadata=None, force_contiguous=True):
    """Save `model`'s state_dict, dropping the names that share memory with a kept one (each
    dropped name is recorded in the metadata, naming the one kept), as the package's
    save_model. force_contiguous: make every tensor contiguous first."""
    state_dict = model.state_dict()
    for kept, dropped in _remove_duplicate_names(state_dict).items():
        for name in dropped:
            if metadata is None:
                metadata = {}
            metadata.setdefault(name, kept)
            del state_dict[name]
    if force_contiguous:
        state_dict = {k: v.contiguous() for k, v in state_dict.items()}
    try:
        save_file(state_dict, filename, metadata=metadata)
    except ValueError as e:
        raise _error(SafetensorInvalidError, str(e) + " Or use save_model(..., "
                     "force_contiguous=True), read the docs for potential caveats.") from None


def load_model(model, filename, strict=True, device="cpu", *, backend="mmap"):
    """Load the file into `model` (names the file does not hold because they share memory with
    one it holds are filled through that one), as the package's load_model. Returns (missing,
    unexpected) names; with strict, RuntimeError when either is not empty."""
    state_dict = load_file(filename, device=device, backend=backend)
    to_removes = _remove_duplicate_names(model.state_dict(), preferred_names=state_dict.keys())
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = set(missing)
    for dropped in to_removes.values():
        for name in dropped:
            if name in missing:
                missing.remove(name)
            else:
                unexpected.append(name)
    if strict and (missing or unexpected):
        error = f"Error(s) in loading state_dict for {model.__class__.__name__}:"
        if missing:
            error += "\n    Missing key(s) in state_dict: " + ", ".join(
                f'"{k}"' for k in sorted(missing))
        if unexpected:
            error += "\n    Unexpected key(s) in state_dict: " + ", ".join(
                f'"{k}"' for k in sorted(unexpected))
        raise RuntimeError(error)
    return missing, unexpected
