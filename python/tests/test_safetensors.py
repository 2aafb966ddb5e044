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
