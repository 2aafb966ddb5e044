"""pinmem.safetensors against the format and the safetensors package: headers the format refuses
(each refused with an error naming the file), saves that would write an unloadable file, and
generated headers compared with the package's own parser (accept or refuse, and the data)."""
import json
import os
import struct

import numpy as np
import pytest

import pinmem
import pinmem.safetensors as pst


def raw_file(path, header, data=b""):
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def u8(begin, end):
    return {"dtype": "U8", "shape": [end - begin], "data_offsets": [begin, end]}


# Files the format forbids that the package refuses: each is a polyglot's way in (bytes no
# tensor owns) or a header two parsers could read two ways.
FORBIDDEN = {
    "gap": ({"a": u8(0, 4), "b": u8(6, 8)}, 8, "a gap of 2 bytes after 'a'"),
    "not at 0": ({"a": u8(3, 8)}, 8, "a gap of 3 bytes at the start of the data"),
    "trailing": ({"a": u8(0, 4)}, 9, "5 bytes after the last tensor"),
    "trailing, no tensor": ({}, 4, "4 bytes after the last tensor"),
    "empty inside": ({"a": u8(0, 8), "e": u8(3, 3)}, 8, r"'a' \[0, 8\) and 'e' \[3, 3\) overlap"),
    "two __metadata__": (b'{"__metadata__": {"k": "v"}, "a": {"dtype": "U8", "shape": [2], '
                         b'"data_offsets": [0, 2]}, "__metadata__": {"k": "w"}}', 2,
                         "__metadata__ appears more than once"),
    "two dtypes": (b'{"a": {"dtype": "U8", "dtype": "I8", "shape": [2], "data_offsets": [0, 2]}}',
                   2, "dtype appears more than once"),
}


def package():
    try:
        import safetensors.numpy as sn
    except ImportError:
        return None
    return sn


@pytest.mark.parametrize("case", sorted(FORBIDDEN))
def test_forbidden_layouts_refused_by_default(case, tmp_path):
    header, ndata, message = FORBIDDEN[case]
    path = raw_file(tmp_path / "bad.safetensors", header, bytes(range(1, ndata + 1)))
    with pytest.raises(pinmem.FormatError, match=message) as e:
        pst.load_file(path)
    assert "bad.safetensors" in str(e.value)
    with pytest.raises(pinmem.FormatError, match=message):
        pst.safe_open(path, "np")
    sn = package()
    if sn is not None:  # the package refuses each of them too
        with pytest.raises(Exception):
            sn.load_file(str(path))


@pytest.mark.parametrize("case", ["gap", "not at 0", "trailing"])
def test_strict_false_loads_gaps(case, tmp_path):
    """strict=False keeps loading the files other writers made with gaps, each tensor's bytes
    as written."""
    header, ndata, _ = FORBIDDEN[case]
    data = bytes(range(1, ndata + 1))
    path = raw_file(tmp_path / "gaps.safetensors", header, data)
    with pst.safe_open(path, "np", strict=False) as f:
        for name in f.keys():
            begin, end = header[name]["data_offsets"]
            assert f.get_tensor(name).tobytes() == data[begin:end]


# Headers that made bare Python errors (RecursionError, TypeError) escape the parser.
MALFORMED = {
    "deep": (b'{"a": ' + b"[" * 100000 + b"]" * 100000 + b"}", "nested too deeply"),
    "deep 128": (b'{"a": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0], "z": '
                 + b"[" * 126 + b"]" * 126 + b"}}", "nested deeper than 127"),
    "dtype list": ({"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}},
                   r"unknown dtype \['F32'\]"),
    "dtype object": ({"a": {"dtype": {"x": 1}, "shape": [1], "data_offsets": [0, 4]}},
                     "unknown dtype"),
    "NaN": (b'{"a": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0], "z": NaN}}',
            "NaN is not JSON"),
    "huge number": (b'{"a": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0], "z": 1e999}}',
                    "out of range"),
    "lone surrogate": (b'{"a\\ud800": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}',
                       "lone surrogate"),
    "metadata list": ({"__metadata__": ["k", "v"]}, "__metadata__ must be an object"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_header_is_a_format_error(case, tmp_path):
    header, message = MALFORMED[case]
    path = raw_file(tmp_path / "bad.safetensors", header)
    for load in (pst.load_file, lambda p: pst.safe_open(p, "np")):
        with pytest.raises(pinmem.FormatError, match=message) as e:
            load(path)
        assert "bad.safetensors" in str(e.value)
    sn = package()
    if sn is not None:
        with pytest.raises(Exception):
            sn.load_file(str(path))


def test_repeated_tensor_name_as_the_package_reads_it(tmp_path):
    """A name given twice: every entry must be JSON of the right kinds, and the last one is the
    tensor (its sizes checked, the first's not), as the package reads it."""
    last = b'{"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}'
    for first, accepted in [(b'{"dtype": "I64", "shape": [0, 7], "data_offsets": [0, 8]}', True),
                            (b'{"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}', False),
                            (b'{"dtype": "U8", "shape": [18446744073709551616], '
                             b'"data_offsets": [0, 2]}', False)]:
        header = b'{"t": ' + first + b', "t": ' + last + b"}"
        path = raw_file(tmp_path / "twice.safetensors", header, b"\1\2")
        if accepted:
            with pst.safe_open(path, "np") as f:
                assert f.get_tensor("t").tobytes() == b"\1\2"
        else:
            with pytest.raises(pinmem.FormatError, match="tensor 't'"):
                pst.safe_open(path, "np")
        sn = package()
        if sn is not None:
            import safetensors
            if accepted:
                assert sn.load_file(str(path))["t"].tobytes() == b"\1\2"
            else:
                with pytest.raises(safetensors.SafetensorError):
                    sn.load_file(str(path))


def test_save_refuses_a_header_over_the_limit_and_keeps_the_old_file(tmp_path):
    """A header over 100,000,000 bytes (here from metadata) makes a file no reader loads: the
    save refuses before anything is written, and the file it would replace stays as it was."""
    path = tmp_path / "model.safetensors"
    good = {"w": np.arange(12, dtype=np.float32)}
    pst.save_file(good, path)
    before = path.read_bytes()
    huge = {"notes": "x" * pst.MAX_HEADER}
    for save in (pst.save_file, lambda t, p, m: pst.save_file_async(t, p, m).wait()):
        with pytest.raises(pinmem.FormatError, match="larger than the 100000000 bytes"):
            save(good, path, huge)
        assert path.read_bytes() == before
        assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]  # no temporary left
    np.testing.assert_array_equal(pst.safe_open(path, "np").get_tensor("w"), good["w"])
    # Just under the limit, the file saves and loads.
    fits = {"notes": "y" * (pst.MAX_HEADER - 200)}
    pst.save_file(good, path, fits)
    assert pst.safe_open(path, "np").metadata() == fits


# ---- parity with the package's modules -------------------------------------------------------

def test_errors_are_the_package_s_and_pinmem_s(tmp_path):
    """One except clause for either library catches pinmem.safetensors' errors."""
    path = raw_file(tmp_path / "bad.safetensors", {"a": u8(2, 4)}, b"\1\2\3\4")
    with pytest.raises(pst.SafetensorError) as e:
        pst.load_file(path)
    assert isinstance(e.value, pinmem.FormatError) and e.value.status == "PM_ERR_FORMAT"
    sn = package()
    if sn is not None:
        import safetensors
        assert issubclass(pst.SafetensorError, safetensors.SafetensorError)
        with pytest.raises(safetensors.SafetensorError):
            pst.safe_open(path, "np")
    good = raw_file(tmp_path / "good.safetensors", {"a": u8(0, 4)}, b"\1\2\3\4")
    with pst.safe_open(good, "np") as f:
        with pytest.raises(KeyError):
            f.get_tensor("zz")
        with pytest.raises(pst.SafetensorError, match="File does not contain tensor zz"):
            f.get_slice("zz")
    with pytest.raises(FileNotFoundError, match="^No such file or directory: .*missing$") as e:
        pst.safe_open(tmp_path / "missing", "np")
    assert e.value.errno == 2


def test_closed_file_answers_nothing(tmp_path):
    path = raw_file(tmp_path / "c.safetensors", {"__metadata__": {"k": "v"}, "a": u8(0, 4)},
                    b"\1\2\3\4")
    with pst.safe_open(path, "np") as f:
        assert f.keys() == ["a"] and f.metadata() == {"k": "v"} and len(f) == 1
        assert list(f.get_tensors()) == ["a"]
    for call in (f.keys, f.metadata, f.offset_keys, f.get_tensors, lambda: len(f),
                 lambda: f.get_tensor("a")):
        with pytest.raises(pst.SafetensorError, match="File is closed"):
            call()


def test_backend_keyword(tmp_path):
    path = raw_file(tmp_path / "b.safetensors", {"a": u8(0, 4)}, b"\1\2\3\4")
    for backend in ("mmap", "pread"):
        with pst.safe_open(path, "np", backend=backend) as f:
            assert f.get_tensor("a").tobytes() == b"\1\2\3\4"
    for call in (lambda: pst.safe_open(path, "np", backend="nope"),
                 lambda: pst.load_file(path, backend="nope")):
        with pytest.raises(pst.SafetensorError, match="backend 'nope' is invalid"):
            call()


def test_slices_refused_as_the_package_refuses(tmp_path):
    a = np.arange(50, dtype=np.float64).reshape(10, 5)
    path = tmp_path / "s.safetensors"
    pst.save_file({"a": a}, path)
    f = pst.safe_open(path, "np")
    s = f.get_slice("a")
    for index, want in [(slice(None, 20), "index 19 out of bounds for tensor dimension #0"),
                        ((slice(2, None), 20), "index 20 out of bounds for tensor dimension #1"),
                        ((slice(2, None), -6), "Invalid index -6 for dimension 1 of size 5"),
                        ([0, 1], "Non empty lists are not implemented"),
                        (slice(None, None, -1), "Slice step must be a positive integer"),
                        ((1, 2, 3), "more slicing indexes than dimensions"),
                        (None, "Unsupported slice index at position 0"),
                        (np.array([1, 2]), "Unsupported slice index at position 0"),
                        (np.array(1.0), "Unsupported slice index at position 0")]:
        with pytest.raises(pst.SafetensorError, match=want):
            s[index]
    # 0-d integer arrays are ints (anything with __index__), as the package takes them
    for index in [slice(None), (), slice(2, 7, 2), (slice(None), slice(1, 3)), -1, (3, -2),
                  (Ellipsis, 1), slice(-3, None), True, np.array(1), (np.int64(2), np.array(3))]:
        got = s[index]
        want = a[1] if index is True else a[index]
        np.testing.assert_array_equal(got, want, err_msg=repr(index))
    assert s[[]].shape == (0, 5)
    f.close()


def test_numpy_module_round_trip_and_bytes(tmp_path):
    from pinmem.safetensors import numpy as pnp
    arrays = {"b": np.array([True, False, True]), "i": np.arange(7, dtype=">i4"),
              "f": np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4)[:, ::2],
              "e": np.zeros((0, 3), np.int16)}
    data = pnp.save(arrays, metadata={"k": "v"})
    path = tmp_path / "n.safetensors"
    pnp.save_file(arrays, path, metadata={"k": "v"})
    assert path.read_bytes() == data
    for back in (pnp.load(data), pnp.load_file(path)):
        assert sorted(back) == sorted(arrays)
        for k, v in arrays.items():
            np.testing.assert_array_equal(back[k], v, err_msg=k)
            assert back[k].dtype == v.dtype.newbyteorder("=") or k == "i"
    sn = package()
    if sn is not None:
        ref = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
        assert sn.save(ref, metadata={"k": "v"}) == data  # byte for byte
        for meta in (None, {}):  # an empty __metadata__ is written, as the package writes it
            assert sn.save(ref, metadata=meta) == pnp.save(arrays, metadata=meta)
    with pytest.raises(ValueError, match="Expected a dict"):
        pnp.save([1])
    with pytest.raises(ValueError, match="Key `x` is invalid"):
        pnp.save({"x": [1]})


def test_small_tensors_read_one_by_one_take_little_memory(tmp_path):
    """An optimizer's 0-d steps read one at a time: each takes memory near its size, not a page
    of placement (20,000 tensors of 4 bytes took 92 MB of pinned memory)."""
    from pinmem.safetensors import numpy as pnp
    arrays = {f"state.{i}.step": np.array(float(i), np.float32) for i in range(5000)}
    arrays["w"] = np.arange(6, dtype=np.float64)  # 8-byte elements keep their alignment
    path = tmp_path / "s.safetensors"
    pnp.save_file(arrays, path)
    before = pinmem.stats()["in_use_bytes"]
    for fw in ("np", "pt") if _has_torch() else ("np",):
        with pst.safe_open(path, fw) as f:
            got = {k: f.get_tensor(k) for k in f.keys()}
        grown = pinmem.stats()["in_use_bytes"] - before
        assert grown < 5001 * 1024, f"{fw}: {grown} bytes of pinned memory for 20 KB of data"
        for k, v in arrays.items():
            g = np.asarray(got[k])
            assert g.dtype == v.dtype and g.shape == v.shape and np.array_equal(g, v), k
        del got
    back = pnp.load_file(path)
    assert all(np.array_equal(back[k], v) for k, v in arrays.items())


def test_save_to_long_names_and_bytes_paths(tmp_path, monkeypatch):
    """A name near the folder's limit (255 bytes) saves: the temporary beside it keeps what
    fits of the name. A bytes path is a path, as the loaders take it."""
    from pinmem.safetensors import numpy as pnp
    arrays = {"a": np.arange(4, dtype=np.float32)}
    for base in ("m" * 240 + ".safetensors", "\u00e9" * 120 + ".st", "x" * 255):
        path = tmp_path / base
        for save in (pnp.save_file, lambda a, p: pst.save_file_async(a, p).wait()):
            save(arrays, path)
            np.testing.assert_array_equal(pnp.load_file(path)["a"], arrays["a"])
            path.unlink()
            assert os.listdir(tmp_path) == [], "a temporary was left"
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    pnp.save_file(arrays, b"sub/model.st")
    pnp.save_file(arrays, os.fsencode(tmp_path / "sub" / "m2.st"))
    assert sorted(os.listdir(tmp_path / "sub")) == ["m2.st", "model.st"]
    np.testing.assert_array_equal(pnp.load_file(b"sub/model.st")["a"], arrays["a"])


def test_a_failed_save_leaves_no_cycle(tmp_path):
    """A save's error (a SafetensorError made from an OSError) holds no cycle with the frame
    that raised it: the save's frames, a device scratch among their locals, go with the error,
    not when the garbage collector runs."""
    import gc
    from pinmem.safetensors import numpy as pnp

    def fail():
        try:
            pnp.save_file({"a": np.ones(1000)}, tmp_path / "no" / "x.safetensors")
        except pst.SafetensorError as e:
            assert isinstance(e, FileNotFoundError)
    gc.collect()
    gc.disable()
    try:
        fail()
        assert gc.collect() == 0, "the failed save left objects only the collector frees"
    finally:
        gc.enable()


def _has_torch():
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


def torch_or_skip():
    from conftest import skip_unless_torch
    return skip_unless_torch()


def test_torch_module_refuses_as_the_package(tmp_path):
    torch = torch_or_skip()
    from pinmem.safetensors import torch as ptorch
    path = tmp_path / "t.safetensors"
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    cases = [({"a": a, "b": a[:1]}, RuntimeError, "share memory"),
             ({"t": a.t()}, ValueError, "non contiguous tensor: `t`"),
             ({"x": {"some": "thing"}}, ValueError, "Key `x` is invalid"),
             ("notadict", ValueError, "Expected a dict"),
             ({"m": torch.zeros(2, device="meta")}, NotImplementedError, "meta tensor"),
             ({"s": a.to_sparse()}, ValueError, "sparse tensors")]
    for tensors, cls, message in cases:
        for save in (lambda t: ptorch.save_file(t, path), ptorch.save):
            with pytest.raises(cls, match=message):
                save(tensors)
        assert not path.exists()
    # permissive=True: pinmem's way, each tensor written in full, made contiguous
    ptorch.save_file({"a": a, "b": a[:1], "t": a.t()}, path, permissive=True)
    back = ptorch.load_file(path)
    assert torch.equal(back["b"], a[:1]) and torch.equal(back["t"], a.t())
    # the top-level save_file stays permissive, as it was
    pst.save_file({"a": a, "b": a[:1]}, path)


def test_torch_module_bytes_match_the_package(tmp_path):
    torch = torch_or_skip()
    from pinmem.safetensors import torch as ptorch
    g = torch.Generator().manual_seed(3)
    tensors = {"w": torch.randn(4, 5, generator=g), "d": torch.randn(3, generator=g).double(),
               "i": torch.randint(-9, 9, (6,), generator=g), "u": torch.arange(5).to(torch.uint64),
               "h": torch.randn(7, generator=g).half(),
               "bf": torch.randn(3, generator=g).bfloat16(),
               "c": torch.randn(2, dtype=torch.complex64, generator=g),
               "f8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
               "b": torch.tensor([True, False]), "z": torch.zeros(0, 2)}
    if hasattr(torch, "float4_e2m1fn_x2"):
        tensors["f4"] = torch.randint(0, 255, (2, 3), dtype=torch.uint8,
                                      generator=g).view(torch.float4_e2m1fn_x2)
    data = ptorch.save(tensors, metadata={"m": "1"})
    try:
        import safetensors.torch as stt
    except ImportError:
        stt = None
    path = tmp_path / "t.safetensors"
    ptorch.save_file(tensors, path, metadata={"m": "1"})
    assert path.read_bytes() == data
    backs = [ptorch.load(data)]
    if stt is not None:
        assert stt.save(tensors, metadata={"m": "1"}) == data  # byte for byte, F4 included
        import safetensors
        with safetensors.safe_open(str(path), "pt") as theirs:  # (its load() lacks F4)
            backs.append(theirs.get_tensors())
    for back in backs:
        for k, v in tensors.items():
            assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
            assert torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)), k
    with pst.safe_open(path, "pt") as f:
        got = f.get_tensors()
    for k, v in tensors.items():
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


def test_one_element_views_of_any_stride_save(tmp_path):
    """A tensor of one element may have any stride (x[::2] of two elements has stride 2):
    torch counts it contiguous, and its flat view keeps that stride. It saves as the package
    saves it, through the .torch module and pinmem's own save_file."""
    torch = torch_or_skip()
    import pinmem.safetensors
    from pinmem.safetensors import torch as ptorch
    tensors = {"a": torch.arange(4.0)[::2][:1],
               "b": torch.arange(6, dtype=torch.int32).view(3, 2)[:, 1][:1].view(1, 1)}
    assert tensors["a"].stride() == (2,) and tensors["b"].stride() == (2, 2)
    data = ptorch.save(tensors)
    try:
        import safetensors.torch as stt
        assert stt.save(tensors) == data
    except ImportError:
        pass
    for save in (ptorch.save_file, pinmem.safetensors.save_file):
        path = tmp_path / "t.safetensors"
        save(tensors, path)
        assert path.read_bytes() == data
        back = ptorch.load_file(path)
        for k, v in tensors.items():
            assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_save_model_and_load_model(tmp_path):
    torch = torch_or_skip()
    from pinmem.safetensors import torch as ptorch

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 3)
            self.b = self.a

    m = Tied()
    path = tmp_path / "m.safetensors"
    with pytest.raises(RuntimeError, match="share memory"):
        ptorch.save_file(m.state_dict(), path)
    ptorch.save_model(m, path)
    with pst.safe_open(path, "pt") as f:
        assert f.metadata() == {"b.weight": "a.weight", "b.bias": "a.bias"}
        assert f.keys() == ["a.bias", "a.weight"]
    m2 = Tied()
    missing, unexpected = ptorch.load_model(m2, path)
    assert not missing and not unexpected
    assert torch.equal(m2.b.weight, m.a.weight) and m2.a.weight is m2.b.weight
    other = torch.nn.Linear(4, 3)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        ptorch.load_model(other, path)


# ---- generated headers against the package's parser -----------------------------------------

DTYPES = list(pst._DTYPES)


def pairs_json(x):
    """JSON text of x, where a list of (key, value) tuples tagged as Obj is an object (so that
    keys may repeat) and Raw is written as is."""
    if isinstance(x, Obj):
        return "{" + ",".join(json.dumps(k) + ":" + pairs_json(v) for k, v in x) + "}"
    if isinstance(x, Raw):
        return str(x)
    if isinstance(x, list):
        return "[" + ",".join(pairs_json(v) for v in x) + "]"
    return json.dumps(x)


class Obj(list):
    pass


class Raw(str):
    pass


def nbytes(dtype, shape):
    n = 1
    for d in shape:
        n *= d
    bits = n * pst._BITS.get(dtype, 8 * pst._DTYPES[dtype][1])
    return None if bits % 8 else bits // 8


def offsets_of(entry):
    """The data_offsets list of a generated entry, when it is still a pair of ints."""
    o = dict(entry or ()).get("data_offsets")
    return o if isinstance(o, list) and len(o) == 2 and all(type(x) is int for x in o) else None


def set_field(entry, key, value):
    """Set the first `key` of a generated entry (an Obj), or add it."""
    for i, (k, _) in enumerate(entry):
        if k == key:
            entry[i] = (key, value)
            return
    entry.append((key, value))


def hypothesis_or_skip():
    return pytest.importorskip(
        "hypothesis", reason="hypothesis is not installed (pip install hypothesis; `make test` "
        "installs it): the generated safetensors headers did not run")


def files():
    """(file bytes, what was done to it): a valid file from the format's grammar (tensors of
    every dtype, shapes with zeros and scalars, metadata or none, any order in the header and
    in the data), then zero to three mutations of its header, layout or length."""
    from hypothesis import strategies as st

    names = st.text(alphabet="ab._\u00e9\u4e2d", min_size=1, max_size=4)
    shape = st.lists(st.integers(0, 4), max_size=3)
    tensor = st.tuples(names, st.sampled_from(DTYPES), shape)
    mutation = st.sampled_from(["offset", "dtype", "shape", "trailing", "truncate", "dup_meta",
                                "meta_value", "deep", "dup_field", "header_len", "flip",
                                "drop_field", "nan", "dup_name", "gap", "huge_dim", "null_meta",
                                "offsets_len", "entry_null"])

    @st.composite
    def build(draw):
        tensors = {}
        for name, dtype, dims in draw(st.lists(tensor, max_size=5)):
            if nbytes(dtype, dims) is not None:
                tensors[name] = (dtype, dims)
        order = draw(st.permutations(sorted(tensors)))
        data, offsets, at = b"", {}, 0
        for name in order:
            n = nbytes(*tensors[name])
            offsets[name] = [at, at + n]
            data += bytes((at + i * 7 + 1) % 251 for i in range(n))
            at += n
        header = Obj()
        meta = draw(st.sampled_from([None, {}, {"k": "v"}, {"a": "1", "b": "\u00e9"}]))
        if meta is not None:
            header.append(("__metadata__", Obj(meta.items())))
        entries = {}
        for name in draw(st.permutations(order)):
            dtype, dims = tensors[name]
            entries[name] = Obj([("dtype", dtype), ("shape", list(dims)),
                                 ("data_offsets", offsets[name])])
            header.append((name, entries[name]))
        done = []
        tail = b""
        length_delta = 0
        for m in draw(st.lists(mutation, max_size=3)):
            some = draw(st.sampled_from(sorted(entries))) if entries else None
            if m == "offset" and offsets_of(entries.get(some)):
                field = offsets_of(entries[some])
                field[draw(st.integers(0, 1))] += draw(st.sampled_from([-3, -1, 1, 2, 8]))
            elif m == "dtype" and some:
                new = draw(st.sampled_from(DTYPES + ["Q7", "f32", "", None, 5, ["F32"]]))
                set_field(entries[some], "dtype", new)
            elif m == "shape" and some:
                new = draw(st.sampled_from([[-1], [1.0], ["2"], [2**64], 3, None, [0, 2**40],
                                            [2**40, 2**40, 0]]))
                set_field(entries[some], "shape", new)
            elif m == "trailing":
                tail += b"\x07" * draw(st.integers(1, 9))
            elif m == "truncate":
                tail = b"-truncate-" + bytes([draw(st.integers(1, 9))])
            elif m == "dup_meta":
                header.append(("__metadata__", Obj([("x", "y")])))
            elif m == "meta_value":
                header.insert(0, ("__metadata__", Obj([("k", draw(st.sampled_from([1, None,
                                                                                   ["v"]])))])))
            elif m == "deep" and some:
                d = draw(st.sampled_from([1, 100, 125, 126, 127, 200]))
                entries[some].append(("z", Raw("[" * d + "]" * d)))
            elif m == "dup_field" and some:
                entries[some].append(("dtype", draw(st.sampled_from(DTYPES))))
            elif m == "header_len":
                length_delta = draw(st.sampled_from([-8, -1, 1, 8, 1 << 40]))
            elif m == "flip":
                done.append(("flip", draw(st.integers(0, 1 << 16)), draw(st.integers(0, 255))))
                continue
            elif m == "drop_field" and some and entries[some]:
                del entries[some][draw(st.integers(0, len(entries[some]) - 1))]
            elif m == "nan" and some:
                entries[some].append(("q", Raw(draw(st.sampled_from(["NaN", "1e999", "-0",
                                                                     "1E2", "\"\\ud800\""])))))
            elif m == "dup_name" and some:
                header.append((some, Obj(entries[some])))
            elif m == "gap" and offsets_of(entries.get(some)):
                at = offsets_of(entries[some])[0]  # 4 bytes no tensor owns, before this one
                for e in entries.values():
                    o = offsets_of(e)
                    if o and o[0] >= at:
                        o[0] += 4
                        o[1] += 4
                data = data[:at] + b"\x05" * 4 + data[at:]
            elif m == "huge_dim" and some:
                set_field(entries[some], "shape", [2**63, 2])
            elif m == "null_meta":
                header.insert(0, ("__metadata__", None))
            elif m == "offsets_len" and some:
                set_field(entries[some], "data_offsets", [0, 1, 2])
            elif m == "entry_null" and some:
                header.append(("n", None))
            done.append(m)
        text = pairs_json(header).encode()
        text += b" " * (-len(text) % 8)
        for d in done:
            if isinstance(d, tuple):
                _, at, value = d
                text = text[:at % len(text)] + bytes([value]) + text[at % len(text) + 1:]
        raw = struct.pack("<Q", max(0, len(text) + length_delta)) + text + data
        if tail.startswith(b"-truncate-"):
            raw = raw[:max(0, len(raw) - tail[-1])]
        else:
            raw += tail
        return raw, done

    return build()


def ours(raw, path):
    """('ok', {name: (dtype, shape, bytes)}) or ('refused', error) from pinmem.safetensors."""
    path.write_bytes(raw)
    try:
        with pst.safe_open(path, "np") as f:
            got = {}
            for name in f.keys():
                s = f.get_slice(name)
                got[name] = (s.get_dtype(), list(s.get_shape()))
        _, entries, start, _ = pst._parse_header(raw, str(path))
    except pst.SafetensorError as e:
        assert isinstance(e, pinmem.FormatError), repr(e)
        assert str(path) in str(e)
        return "refused", e
    assert sorted(got) == sorted(e[0] for e in entries)
    return "ok", {name: (dtype, list(shape), raw[start + b:start + e])
                  for name, dtype, shape, b, e in entries}


def theirs(raw):
    import safetensors
    try:
        out = safetensors.deserialize(raw)
    except safetensors.SafetensorError as e:
        return "refused", e
    return "ok", {name: (v["dtype"], list(v["shape"]), bytes(v["data"])) for name, v in out}


def test_generated_headers_as_the_package_reads_them(tmp_path):
    """Headers from the format's grammar, mutated: pinmem accepts exactly what the package
    accepts, gives the same tensors (dtype, shape, bytes) when both accept, and refuses with a
    FormatError naming the file (never a bare Python error)."""
    hypothesis_or_skip()
    pytest.importorskip("safetensors", reason="the safetensors package is not installed: "
                        "nothing to compare the generated headers with")
    from hypothesis import HealthCheck, given, settings

    path = tmp_path / "gen.safetensors"
    seen = {"ok": 0, "refused": 0}

    @settings(max_examples=400, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(files())
    def check(case):
        raw, done = case
        a, b = ours(raw, path), theirs(raw)
        assert a[0] == b[0], f"pinmem {a[0]} ({a[1]!r}), the package {b[0]} ({b[1]!r}); {done}"
        if a[0] == "ok":
            assert a[1] == b[1], done
        seen[a[0]] += 1

    check()
    assert seen["ok"] > 50 and seen["refused"] > 50, seen  # both sides were exercised


def test_random_slices_as_the_package_slices(tmp_path):
    """Seeded random indices (ints, slices with steps, ellipses) into tensors of 1-3 non-empty
    dimensions: pinmem's get_slice takes and refuses the same ones as the package's, with the
    same values."""
    import random
    try:
        import safetensors
        import safetensors.numpy as sn
    except ImportError:
        pytest.skip("the safetensors package is not installed: nothing to compare slices with")
    rng = random.Random(7)
    path = tmp_path / "s.safetensors"
    counts = {"ok": 0, "err": 0}
    for _ in range(30):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))
        a = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
        sn.save_file({"a": a}, str(path))
        with safetensors.safe_open(str(path), "np") as theirs, pst.safe_open(path, "np") as ours:
            want_slice, got_slice = theirs.get_slice("a"), ours.get_slice("a")
            for _ in range(20):
                index = []
                for _ in range(rng.randint(0, len(shape) + 1)):
                    k = rng.random()
                    if k < 0.3:
                        index.append(rng.randint(-6, 6))
                    elif k < 0.9:
                        lo = rng.choice([None, rng.randint(0, 6)])
                        hi = rng.choice([None, rng.randint(0, 6)])
                        if lo is not None and hi is not None and hi < lo:
                            lo, hi = hi, lo
                        index.append(slice(lo, hi, rng.choice([None, 1, 2, 3])))
                    elif Ellipsis not in index:
                        index.append(Ellipsis)
                index = tuple(index)
                try:
                    want = want_slice[index]
                except safetensors.SafetensorError:
                    with pytest.raises(pst.SafetensorError):
                        got_slice[index]
                    counts["err"] += 1
                    continue
                got = got_slice[index]
                assert got.shape == want.shape and np.array_equal(got, want), (shape, index)
                counts["ok"] += 1
    assert counts["ok"] > 100 and counts["err"] > 50, counts


def _random_torch_index(rng, shape, torch):
    """A random index of any form torch takes, or one it refuses: ints in and out of range,
    slices with any bounds and steps (0 and negative too), None, ..., bools, lists, 0-d and
    mask tensors, floats and strings."""
    def item(size):
        k = rng.random()
        if k < 0.25:
            return rng.randint(-size - 2, size + 2)
        if k < 0.6:
            return slice(rng.choice([None, rng.randint(-8, 8)]),
                         rng.choice([None, rng.randint(-8, 8)]),
                         rng.choice([None, 1, 2, 3, -1, 0]))
        if k < 0.67:
            return Ellipsis
        if k < 0.72:
            return None
        if k < 0.77:
            return rng.choice([True, False])
        if k < 0.85:
            return [rng.randint(-size, max(size - 1, 0)) for _ in range(rng.randint(0, 3))]
        if k < 0.9:
            return torch.tensor(rng.randint(0, max(size - 1, 0)))
        if k < 0.95 and size:
            return torch.tensor([rng.random() < 0.5 for _ in range(size)])
        return rng.choice([1.5, "a"])
    index = tuple(item(shape[i] if i < len(shape) else 3)
                  for i in range(rng.randint(0, len(shape) + 1)))
    return index[0] if len(index) == 1 and rng.random() < 0.3 else index


def test_torch_slices_index_as_torch_does(tmp_path):
    """framework 'pt' with backend 'mmap' (the defaults): get_slice(name)[index] gives what
    torch's indexing of the whole tensor gives (slices clipped, lists, masks, None, bools),
    and where torch refuses an index, a SafetensorError of the same built-in class. The
    package's own slices of a mapped file do the same (compared where it is installed and
    slices so); backend 'pread' keeps the package's own rules."""
    torch = pytest.importorskip("torch")
    import random
    import warnings
    rng = random.Random(11)
    tensors = {"w": torch.arange(60.).reshape(3, 4, 5), "s": torch.tensor(3.),
               "e": torch.zeros(0, 3), "v": torch.arange(7, dtype=torch.int16)}
    path = tmp_path / "t.safetensors"
    pst.save_file(tensors, path)
    theirs = None
    try:
        import safetensors
        with safetensors.safe_open(str(path), "pt") as g:
            if tuple(g.get_slice("w")[0:20].shape) == (3, 4, 5):  # the package indexes as torch
                theirs = safetensors.safe_open(str(path), "pt")
    except (ImportError, Exception):
        theirs = None
    counts = {"ok": 0, "err": 0}
    with pst.safe_open(path, "pt") as f, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's warning for a list of lists as an index
        for name, t in tensors.items():
            s = f.get_slice(name)
            for _ in range(600):
                index = _random_torch_index(rng, list(t.shape), torch)
                try:
                    want = t[index]
                except (IndexError, TypeError, ValueError) as e:
                    with pytest.raises(pst.SafetensorError) as got:
                        s[index]
                    assert isinstance(got.value, type(e).__mro__[0]) or \
                        isinstance(got.value, (IndexError, TypeError, ValueError)), (index, e)
                    for cls in (IndexError, TypeError, ValueError):
                        assert isinstance(e, cls) <= isinstance(got.value, cls), (index, e)
                    counts["err"] += 1
                    continue
                got = s[index]
                assert got.dtype == want.dtype and got.shape == want.shape, (name, index)
                assert torch.equal(got, want) and got.is_contiguous(), (name, index)
                if theirs is not None:
                    assert torch.equal(theirs.get_slice(name)[index], want), (name, index)
                counts["ok"] += 1
    if theirs is not None:
        theirs.__exit__(None, None, None)
    assert counts["ok"] > 800 and counts["err"] > 400, counts
    with pst.safe_open(path, "pt", backend="pread") as f:
        with pytest.raises(pst.SafetensorError, match="out of bounds"):
            f.get_slice("w")[0:20]  # the package's own rules: not clipped


def test_torch_slices_read_only_the_rows_they_need(tmp_path, file_reads):
    """A leading int or slice reads only its rows, also with torch's forms after it; an index
    out of range or a step below 1 is refused without a read."""
    torch = pytest.importorskip("torch")
    t = torch.arange(80, dtype=torch.float64).reshape(10, 8)
    path = tmp_path / "r.safetensors"
    pst.save_file({"a": t}, path)
    reads = file_reads
    with pst.safe_open(path, "pt") as f:
        at = f._start + f._entries["a"][3]
        s = f.get_slice("a")
        for index, rows in [((3, [0, 2]), (3, 4)), ((slice(-3, None), None), (7, 10)),
                            (slice(2, 100, 3), (2, 9)), ((slice(4, 6), Ellipsis, 1), (4, 6))]:
            del reads[:]
            assert torch.equal(s[index], t[index]), index
            assert reads == [(at + rows[0] * 64, (rows[1] - rows[0]) * 64)], index
        del reads[:]
        for index, cls in [(10, IndexError), (slice(None, None, -1), ValueError),
                           ((slice(None, None, 0), 1, 1), IndexError)]:
            with pytest.raises(cls):
                s[index]
        assert reads == []


def test_f4_slices_refused(tmp_path):
    """An F4 tensor's file shape counts 4-bit values and its torch shape bytes: an index in
    either unit would read wrong data in the other, so get_slice refuses to index it (the
    package fails too); get_tensor reads it."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    raw = torch.arange(1, 13, dtype=torch.uint8)
    path = tmp_path / "f4.safetensors"
    pst.save_file({"m": raw.view(torch.float4_e2m1fn_x2).reshape(3, 4),
                   "v": raw[:8].clone().view(torch.float4_e2m1fn_x2)}, path)
    for backend in ("mmap", "pread"):
        with pst.safe_open(path, "pt", backend=backend) as f:
            assert f.get_slice("v").get_shape() == [16]
            for name, index in [("v", slice(None)), ("v", slice(0, 16)),
                                ("m", (slice(None), slice(0, 2))), ("m", 0)]:
                with pytest.raises(pst.SafetensorError, match="F4"):
                    f.get_slice(name)[index]
            assert f.get_tensor("v").view(torch.uint8).tolist() == list(range(1, 9))


@pytest.mark.parametrize("number, ok", [("1" + "0" * 400, False), ("-1" + "0" * 400, False),
                                        ("1" + "0" * 5000, False), ("1" + "0" * 300, True),
                                        ("-0", True), ("18446744073709551616", True)])
def test_header_integers_read_as_the_package_reads_them(tmp_path, number, ok):
    """An integer beyond a double's range is refused, as the package refuses it, in a field
    no one reads too; -0 is a double there, so a count of -0 is refused, and one elsewhere
    taken."""
    def blob(offsets, extra):
        h = (b'{"a":{"dtype":"U8","shape":[2],"data_offsets":' + offsets + b',"x":' + extra +
             b'}}')
        h += b" " * (-len(h) % 8)
        return struct.pack("<Q", len(h)) + h + b"\1\2"
    from pinmem.safetensors import numpy as pnp
    data = blob(b"[0,2]", number.encode())
    if ok:
        assert pnp.load(data)["a"].tobytes() == b"\1\2"
    else:
        with pytest.raises(pst.SafetensorError, match="out of range"):
            pnp.load(data)
    with pytest.raises(pst.SafetensorError, match="data_offsets"):
        pnp.load(blob(b"[-0,2]", b"0"))
    try:
        import safetensors.numpy as sn
    except ImportError:
        return
    if ok:
        sn.load(data)
    else:
        with pytest.raises(Exception):
            sn.load(data)
    with pytest.raises(Exception):
        sn.load(blob(b"[-0,2]", b"0"))


def test_devices_that_are_none_refused_as_the_package(tmp_path):
    """What is no device is the package's "device X is invalid" (a SafetensorError), not a
    missing GPU; another accelerator's device is named as one pinmem does not load into."""
    torch = torch_or_skip()
    from pinmem.safetensors import torch as pt
    path = tmp_path / "d.safetensors"
    pt.save_file({"a": torch.arange(4.0)}, path)
    for dev in ("CPU", "meta", torch.device("meta"), -1, 1.5, "cuda:x", "npu"):
        for load in (lambda d: pt.load_file(path, device=d),
                     lambda d: pst.safe_open(path, "pt", device=d)):
            with pytest.raises(pst.SafetensorError, match=f"^device {dev} is invalid$"):
                load(dev)
    with pytest.raises(pst.SafetensorError, match="'mps'.*host memory .*or a CUDA device"):
        pt.load_file(path, device="mps")
    for dev in ("cpu", "cpu:0", torch.device("cpu"), None):
        assert torch.equal(pt.load_file(path, device=dev)["a"], torch.arange(4.0))


def test_device_none_and_empty_shapes_as_the_package(tmp_path):
    """device=None reads to the CPU, as the package's; a tensor without elements whose
    contiguous strides would overflow 64 bits ([0, 2**32, 2**32]) loads as the package loads
    it, not with torch.empty's error."""
    torch = pytest.importorskip("torch")
    from pinmem.safetensors import torch as ptt
    path = tmp_path / "n.safetensors"
    pst.save_file({"w": torch.arange(4.)}, path)
    assert ptt.load_file(path, device=None)["w"].device.type == "cpu"
    with pst.safe_open(path, "pt", device=None) as f:
        assert f.get_tensor("w").device.type == "cpu"
    path = raw_file(tmp_path / "z.safetensors",
                    {"a": {"dtype": "F32", "shape": [0, 2 ** 32, 2 ** 32], "data_offsets": [0, 0]}})
    for t in (ptt.load_file(path)["a"], pst.safe_open(path, "pt").get_tensor("a")):
        assert t.shape == (0, 2 ** 32, 2 ** 32) and t.numel() == 0


def test_safe_open_handle_reads_an_open_file(tmp_path):
    """_safe_open_handle (the package's name) reads through a descriptor of its own, so the
    file object may close first; an object without a descriptor is refused."""
    import io
    path = raw_file(tmp_path / "h.safetensors", {"a": u8(0, 4)}, b"\1\2\3\4")
    with open(path, "rb") as fobj:
        g = pst._safe_open_handle(fobj, framework="np")
    with g:
        assert g.keys() == ["a"] and g.get_tensor("a").tobytes() == b"\1\2\3\4"
        assert "h.safetensors" in repr(g)
    with pytest.raises(pst.SafetensorError, match="has no file descriptor"):
        pst._safe_open_handle(io.BytesIO(path.read_bytes()), framework="np")


def test_device_tensors_on_the_host_backend_need_torchs_gpu(tmp_path):
    """PINMEM_BACKEND=host simulates devices for pinmem's memory, not for torch: asked for
    device tensors where torch has no GPU, load_file and safe_open say so (NoDeviceError, the
    way out named), not torch's "no NVIDIA driver" from deep inside."""
    torch = pytest.importorskip("torch")
    if pinmem.backend() != "host" or torch.cuda.is_available():
        pytest.skip("needs the host backend and a torch without CUDA")
    path = tmp_path / "w.safetensors"
    from pinmem.safetensors import torch as pst_torch
    pst_torch.save_file({"w": torch.arange(4.0)}, path)
    for device in ("cuda", "cuda:0", torch.device("cuda"), 0):
        with pytest.raises(pinmem.NoDeviceError, match="device='cpu'"):
            pst.load_file(path, device=device)
        with pytest.raises(pinmem.NoDeviceError, match="device='cpu'"):
            pst.safe_open(path, framework="pt", device=device)
    assert torch.equal(pst.load_file(path, device="cpu")["w"], torch.arange(4.0))
