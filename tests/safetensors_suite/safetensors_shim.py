"""pytest plugin: the safetensors package's own Python tests, run against pinmem.safetensors.

Loaded with `-p safetensors_shim` (run.sh). The real package is imported first, so that
pinmem.safetensors.SafetensorError can subclass its SafetensorError; then the names the tests
import from `safetensors`, `safetensors.torch` and `safetensors.numpy` are replaced by modules
holding pinmem's. A name pinmem does not offer (the low-level serialize, TensorSpec,
_safe_open_handle; other frameworks' modules) skips the test that reaches it, saying so, so that
the count of passing tests is the count of those that reach an API pinmem offers.
"""
import importlib
import sys
import types

import pytest

real = importlib.import_module("safetensors")  # before pinmem, which subclasses its error
import pinmem.safetensors as pst  # noqa: E402

try:
    ptorch = importlib.import_module("pinmem.safetensors.torch")
except ImportError as e:  # no torch, or a pinmem without the module
    ptorch = types.SimpleNamespace(why=str(e))
try:
    pnumpy = importlib.import_module("pinmem.safetensors.numpy")
except ImportError as e:
    pnumpy = types.SimpleNamespace(why=str(e))


class _Missing:
    """Stands in for a name pinmem lacks: calling it skips the test. (Attributes are left
    missing: pytest's collection looks some up on every name a test module holds.)"""

    def __init__(self, name):
        self.name = name

    def __call__(self, *args, **kwargs):
        pytest.skip(f"pinmem.safetensors offers no {self.name}")


class _NeverRaised(Exception):
    """SafetensorError where pinmem has none: nothing raises it, so tests expecting it fail."""


NAMES = {
    "safetensors": (["safe_open", "SafetensorError", "serialize", "serialize_file",
                     "deserialize", "TensorSpec", "_safe_open_handle", "__version__"],
                    [pst]),
    "safetensors.torch": (["load_file", "save_file", "load", "save", "save_model", "load_model",
                           "safe_open", "_find_shared_tensors", "_remove_duplicate_names",
                           "_is_complete", "_end_ptr", "storage_ptr", "storage_size"],
                          [ptorch, pst]),
    "safetensors.numpy": (["load_file", "save_file", "load", "save", "safe_open"],
                          [pnumpy, pst]),
}


def _module(name, names, sources):
    m = types.ModuleType(name, f"{name} routed to pinmem.safetensors by safetensors_shim")
    for n in names:
        value = next((getattr(s, n) for s in sources if hasattr(s, n)), None)
        if value is None:
            value = _NeverRaised if n == "SafetensorError" else _Missing(f"{name}.{n}")
        setattr(m, n, value)
    return m


mods = {name: _module(name, names, sources) for name, (names, sources) in NAMES.items()}
mods["safetensors"].__path__ = []  # a package, so `import safetensors.torch` finds the others
mods["safetensors"].torch = mods["safetensors.torch"]
mods["safetensors"].numpy = mods["safetensors.numpy"]
for key in [k for k in sys.modules if k == "safetensors" or k.startswith("safetensors.")]:
    del sys.modules[key]
sys.modules.update(mods)


def pytest_report_header(config):
    return [f"safetensors_shim: safetensors {real.__version__} suite against pinmem "
            f"{getattr(sys.modules.get('pinmem'), '__version__', '?')}"]


# Tests of the package's other frameworks' modules (safetensors.flax, .tensorflow, .mlx,
# .paddle): pinmem mirrors the torch and NumPy ones only.
OTHER_FRAMEWORKS = ("test_flax_comparison.py", "test_tf_comparison.py",
                    "test_mlx_comparison.py", "test_paddle_comparison.py")


def pytest_ignore_collect(collection_path, config):
    return collection_path.name in OTHER_FRAMEWORKS or None
