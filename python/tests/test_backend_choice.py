"""Which backend pinmem takes, and why (pinmem.backend_info), on machines whose NVIDIA driver is
missing, too old or shows no device: no silent CPU.

Each case runs in a child Python with PINMEM_BACKEND unset (auto) and PINMEM_CUDA_DRIVER pointing
at a stand-in driver (tests/stub_cuda.c, compiled here with the C compiler) or at no file. Auto
must fall back to the host backend and say why; every request for device memory must then fail
with NoDeviceError giving that reason and naming PINMEM_BACKEND=host; PINMEM_BACKEND=host must
keep simulating devices.
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import pinmem

HERE = os.path.dirname(os.path.abspath(__file__))
STUB_SRC = os.path.join(HERE, "..", "..", "tests", "stub_cuda.c")
STUBS = {  # variant: (defines, reason part, driver version)
    "nodevice": (["STUB_VERSION=12040", "STUB_INIT_RESULT=100"],
                 "NVIDIA driver found (version 12.4) but no device: cuInit: no CUDA-capable "
                 "device is detected (CUDA_ERROR_NO_DEVICE)", (12, 4)),
    "old": (["STUB_VERSION=11080", "STUB_INIT_RESULT=0"],
            "NVIDIA driver too old (version 11.8, need 12.0", (11, 8)),
    "nogpa": (["STUB_VERSION=12000", "STUB_INIT_RESULT=0", "STUB_NO_GPA=1"],
              "has no cuGetProcAddress", (12, 0)),
}

# One pretend device (stub_cuda.c's STUB_FAKE_DEVICE): it pins with cuMemHostAlloc, and answers
# cuMemHostRegister with CUDA_ERROR_NOT_SUPPORTED, as a platform without host registration.
FAKE = ["STUB_VERSION=12040", "STUB_INIT_RESULT=0", "STUB_FAKE_DEVICE=1"]


def _cuda_compiled():
    return pinmem.backend_info()["cuda_compiled"]


@pytest.fixture(scope="module")
def stub_dir(tmp_path_factory):
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler to build the stand-in driver libraries (tests/stub_cuda.c)")
    if not os.path.exists(STUB_SRC):
        pytest.skip("tests/stub_cuda.c is not here (an installed package without the sources)")
    out = tmp_path_factory.mktemp("stub_drivers")
    for name, (defs, _, _) in {**STUBS, "fake": (FAKE, None, None)}.items():
        subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out / f"libcuda_{name}.so"),
                        *[f"-D{d}" for d in defs], STUB_SRC], check=True)
    return out


# The child: report backend_info, then try every way of asking for device memory.
CHILD = textwrap.dedent("""
    import json, os, sys, tempfile
    import numpy as np
    import pinmem
    out = {"info": pinmem.backend_info(), "errors": {}, "device_count": pinmem.device_count()}
    def attempt(name, fn):
        try:
            fn()
            out["errors"][name] = None
        except Exception as e:  # noqa: BLE001  (any failure is reported, typed)
            out["errors"][name] = [type(e).__name__, str(e)]
    attempt("device_empty", lambda: pinmem.device_empty(16, "float32"))
    attempt("empty_mapped", lambda: pinmem.empty(16, "float32", mapped=True))
    attempt("device_info", lambda: pinmem.device_info(0))
    attempt("set_device", lambda: pinmem.set_device(0))
    data = np.arange(64, dtype=np.float32).reshape(16, 4)
    attempt("loader_cuda", lambda: next(iter(pinmem.Loader(data, batch_size=4, device="cuda"))))
    def load():
        from pinmem import safetensors
        path = os.path.join(tempfile.mkdtemp(), "t.safetensors")
        hdr = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
        with open(path, "wb") as f:
            f.write(len(hdr).to_bytes(8, "little") + hdr + np.ones(4, np.float32).tobytes())
        safetensors.load_file(path, device="cuda")
    attempt("load_file_cuda", load)
    class FakeCuda:  # memory a library says is on a GPU (what a torch CUDA tensor exports)
        def __init__(self, addr):
            self.__cuda_array_interface__ = {"shape": (64,), "typestr": "|u1",
                                             "data": (addr, False), "version": 3}
    host = pinmem.empty(64, "uint8")
    attempt("copy_into_cuda", lambda: pinmem.copy(FakeCuda(0x7f0000000000), host).wait())
    # Host memory is no device memory: pinned buffers still work.
    a = np.asarray(pinmem.empty(8, "float32")); a[:] = 3
    out["pinned_ok"] = bool((a == 3).all())
    print("RESULT " + json.dumps(out))
""")


def run_child(driver, backend=None, device=None):
    env = dict(os.environ)
    env.pop("PINMEM_BACKEND", None)
    env.pop("PINMEM_DEVICE", None)
    env["PINMEM_CUDA_DRIVER"] = driver
    if device is not None:
        env["PINMEM_DEVICE"] = device
    if backend:
        env["PINMEM_BACKEND"] = backend
    p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, f"child failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, p.stdout + p.stderr
    return json.loads(line[-1][7:])


def check_fallback(res, reason_part, version):
    info = res["info"]
    assert info["backend"] == "host"
    assert info["requested"] == "auto"
    assert info["fallback"] is True
    assert info["cuda_compiled"] is True
    assert info["reason"].startswith("auto: ")
    assert reason_part in info["reason"]
    assert info["driver_version"] == (list(version) if version else None)
    assert info["devices"] == 0
    assert res["device_count"] == 0
    for name, err in res["errors"].items():
        assert err is not None, f"{name} was served under the fallback"
        cls, msg = err
        assert cls == "NoDeviceError", (name, err)
        assert reason_part in msg, (name, msg)
        assert "PINMEM_BACKEND=host" in msg, (name, msg)
    assert res["pinned_ok"]


def test_build_has_cuda_backend():
    # Every build has the cuda backend (it needs no toolkit); -DPINMEM_CUDA=OFF is the exception.
    assert _cuda_compiled(), pinmem.backend_info()


def test_no_driver_library():
    if not _cuda_compiled():
        pytest.skip("this build has no cuda backend (-DPINMEM_CUDA=OFF)")
    res = run_child("/nonexistent/libcuda.so.1")
    check_fallback(res, "no NVIDIA driver found (/nonexistent/libcuda.so.1", None)


def test_no_driver_with_device_option():
    # A launcher's PINMEM_DEVICE=1 names a CUDA device: the fallback serves as with 0.
    if not _cuda_compiled():
        pytest.skip("this build has no cuda backend (-DPINMEM_CUDA=OFF)")
    res = run_child("/nonexistent/libcuda.so.1", device="1")
    check_fallback(res, "no NVIDIA driver found (/nonexistent/libcuda.so.1", None)


@pytest.mark.parametrize("variant", sorted(STUBS))
def test_unusable_driver(stub_dir, variant):
    if not _cuda_compiled():
        pytest.skip("this build has no cuda backend (-DPINMEM_CUDA=OFF)")
    _, reason, version = STUBS[variant]
    res = run_child(str(stub_dir / f"libcuda_{variant}.so"))
    check_fallback(res, reason, version)


def test_host_chosen_simulates_devices():
    res = run_child("/nonexistent/libcuda.so.1", backend="host")
    info = res["info"]
    assert info["backend"] == "host" and info["requested"] == "host"
    assert info["fallback"] is False
    assert info["devices"] >= 1
    assert res["errors"]["device_empty"] is None
    assert res["errors"]["empty_mapped"] is None
    assert res["errors"]["device_info"] is None and res["errors"]["set_device"] is None
    assert res["device_count"] >= 1
    assert res["errors"]["loader_cuda"] is None


def test_cuda_asked_without_driver():
    if not _cuda_compiled():
        pytest.skip("this build has no cuda backend (-DPINMEM_CUDA=OFF)")
    env = dict(os.environ, PINMEM_BACKEND="cuda", PINMEM_CUDA_DRIVER="/nonexistent/libcuda.so.1")
    p = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import pinmem
        print(pinmem.backend_info()["backend"])
        try:
            pinmem.device_empty(4, "float32")
        except pinmem.NoDeviceError as e:
            print("refused:", e)
        """)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "none"
    assert lines[1].startswith("refused:") and "no NVIDIA driver found" in lines[1], lines


def test_driver_without_host_registration(stub_dir):
    """Big pinned buffers still come (from the driver's allocator); a loader with worker
    processes, whose slots are shared memory that only registration pins, is refused naming the
    call, and without advice about sizes that would not help."""
    if not _cuda_compiled():
        pytest.skip("this build has no cuda backend (-DPINMEM_CUDA=OFF)")
    env = dict(os.environ, PINMEM_CUDA_DRIVER=str(stub_dir / "libcuda_fake.so"))
    env.pop("PINMEM_BACKEND", None)
    p = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import numpy as np, pinmem
        print(pinmem.backend())
        a = np.asarray(pinmem.empty(16 << 20, "uint8")); a[:] = 7
        print("big", int(a[-1]))
        class DS:
            def __len__(self): return 16
            def __getitem__(self, i): return np.full(4, i, np.float32)
        try:
            next(iter(pinmem.Loader(DS(), batch_size=4, num_workers=2, device="cpu")))
        except pinmem.UnsupportedError as e:
            print("refused:", e)
        """)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[:2] == ["cuda", "big 7"], lines
    assert lines[2].startswith("refused:") and "cuMemHostRegister" in lines[2], lines
    assert "lower prefetch" not in lines[2], lines


def test_thread_without_a_device_keeps_none(stub_dir):
    """A thread that never chose a device (no current context) and has pinmem work on device 1
    for it (a loader's staging, a loader of cuda:1, the DCP writer's copy back) is left with no
    current context, as it came: given device 0 back, it would get GPU 0's primary context
    (hundreds of MB there, in a process of another GPU). A thread on device 1 keeps it. Two
    pretend devices (stub_cuda.c); stub_current_device() tells the thread's context."""
    if not _cuda_compiled():
        pytest.skip("this build has no cuda backend (-DPINMEM_CUDA=OFF)")
    import importlib.util
    has_torch = importlib.util.find_spec("torch") is not None
    env = dict(os.environ, PINMEM_CUDA_DRIVER=str(stub_dir / "libcuda_fake.so"),
               STUB_CUDA_DEVICES="2", STUB_CUDA_HOST_REGISTER="1")
    env.pop("PINMEM_BACKEND", None)
    env.pop("PINMEM_DEVICE", None)
    p = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import ctypes, json, os, sys, threading
        import numpy as np, pinmem
        from pinmem import _staging
        cur = ctypes.CDLL(os.environ["PINMEM_CUDA_DRIVER"]).stub_current_device
        assert pinmem.backend() == "cuda" and pinmem.device_count() == 2
        pinmem.set_device(1)
        d = pinmem.device_empty(4096, "uint8")
        host = pinmem.empty(4096, "uint8")
        np.asarray(host)[:] = 9
        pinmem.copy(d, host).wait()
        out = {}
        def work():
            out["start"] = [cur(), pinmem._pinmem._bound_device(), pinmem.current_device()]
            _staging.Stager(True, 1).stage({"x": np.ones(8, np.float32)})
            out["stage"] = cur()
            data = np.arange(64, dtype=np.float32).reshape(16, 4)
            b = next(iter(pinmem.Loader(data, batch_size=4, device="cuda:1")))
            out["loader"] = cur()
            if sys.argv[1] == "torch":
                import pinmem.dcp as pdcp
                dst = bytearray(4096)
                pdcp._copy_back(dst, pdcp._DeviceBytes(d.ptr, 4096, d), None)
                out["dcp"] = [cur(), dst[0], dst[-1]]
            pinmem._pinmem._put_back_device(-1)
            out["none"] = cur()
        th = threading.Thread(target=work)
        th.start()
        th.join()
        out["main"] = cur()
        print("RESULT " + json.dumps(out))
        """), "torch" if has_torch else "-"], env=env, capture_output=True, text=True,
        timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, p.stdout + p.stderr
    out = json.loads(line[-1][7:])
    # none to begin with; current_device() answers 0 there, as CUDA's runtime does
    assert out["start"] == [-1, -1, 0], out
    assert out["stage"] == -1 and out["loader"] == -1 and out["none"] == -1, out
    if has_torch:
        assert out["dcp"] == [-1, 9, 9], out
    assert out["main"] == 1, out
