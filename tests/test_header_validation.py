"""Safetensors headers are validated as strictly as the `safetensors` library validates them.

Each bad header is tried on the reference (`safetensors.safe_open`), which must refuse it, and on ours, which must
refuse it with one `CheckpointError` naming the file, the key at fault and what is wrong.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import h3_core
from h3_core.checkpoints.safetensors_io import MAX_HEADER_BYTES, SafetensorsFile
from h3_core.errors import CheckpointError
from h3_fixtures import TINY, reference_model, save_comfy

A = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
B = {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}


def write(path, header_text: str, data_size: int):
    raw = header_text.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data_size))
    return path


def entry(**changes):
    return json.dumps({**A, **changes})


def header(**tensors) -> str:
    return json.dumps(tensors)


# (case, header text, data bytes, fragments of our message, key named by the error or None)
BAD_HEADERS = [
    ("alias", header(a=A, b={**B, "data_offsets": [0, 8]}), 16,
     ["tensor 'b' (data_offsets [0, 8]) uses the same bytes as tensor 'a'"], "b"),
    ("alias-no-spare-bytes", header(a=A, b={**B, "data_offsets": [0, 8]}), 8,
     ["tensor 'b' (data_offsets [0, 8]) uses the same bytes as tensor 'a'"], "b"),
    ("overlap", header(a={**A, "shape": [3], "data_offsets": [0, 12]}, b={**B, "data_offsets": [4, 12]}), 12,
     ["tensor 'b' (data_offsets [4, 12]) uses bytes that overlap tensor 'a' (data_offsets [0, 12])"], "b"),
    ("hole", header(a=A, b={**B, "data_offsets": [12, 20]}), 20,
     ["tensor 'b' starts at byte 12", "bytes 8-12 belong to no tensor"], "b"),
    ("trailing-bytes", header(a=A, b=B), 20, ["the tensors end at byte 16 of the data section but the file holds 20"],
     None),
    ("repeated-key", '{"a":%s,"a":%s}' % (json.dumps(A), json.dumps(B)), 16, ["names 'a' twice"], "a"),
    ("float-shape", '{"a":%s}' % entry(shape=[2.0]), 8, ["tensor 'a': invalid shape [2.0]"], "a"),
    ("bool-shape", '{"a":%s}' % entry(shape=[True, True]), 4, ["tensor 'a': invalid shape [True, True]"], "a"),
    ("negative-shape", '{"a":%s}' % entry(shape=[-2]), 8, ["tensor 'a': invalid shape [-2]"], "a"),
    ("float-offset", '{"a":%s}' % entry(data_offsets=[0, 8.0]), 8, ["tensor 'a': invalid data_offsets [0, 8.0]"],
     "a"),
    ("three-offsets", '{"a":%s}' % entry(data_offsets=[0, 8, 8]), 8, ["invalid data_offsets [0, 8, 8]"], "a"),
    ("end-before-begin", '{"a":%s}' % entry(data_offsets=[8, 0]), 8, ["invalid data_offsets [8, 0]"], "a"),
    ("bytes-not-numel-times-itemsize", '{"a":%s}' % entry(shape=[3]), 8,
     ["shape [3] of F32 needs 12 bytes but its offsets span 8"], "a"),
    ("size-overflow", '{"a":%s}' % entry(shape=[2 ** 62, 8]), 8, ["needs 147573952589676412928 bytes"], "a"),
    ("offset-past-u64", '{"a":%s}' % entry(data_offsets=[2 ** 64, 2 ** 64 + 8]), 8, ["the file is truncated"], "a"),
    ("missing-field", '{"a":{"dtype":"F32","shape":[2]}}', 8, ["lacks dtype, shape or data_offsets"], "a"),
    ("unknown-dtype", '{"a":%s}' % entry(dtype="Q4"), 8, ["unknown dtype 'Q4'"], "a"),
    ("metadata-int-value", json.dumps({"__metadata__": {"x": 1}, "a": A}), 8,
     ["'__metadata__' must map strings to strings, got {'x': 1}"], "__metadata__"),
    ("metadata-nested", json.dumps({"__metadata__": {"x": {"y": "z"}}, "a": A}), 8,
     ["'__metadata__' must map strings to strings"], "__metadata__"),
    ("metadata-list", json.dumps({"__metadata__": [1], "a": A}), 8, ["'__metadata__' must map strings to strings"],
     "__metadata__"),
    ("nested-200-in-an-entry", '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":%s1%s}}' % ("[" * 200,
                                                                                                    "]" * 200), 8,
     ["nested more than 128 levels deep"], None),
    ("nested-100000", "[" * 100_000 + "]" * 100_000, 8, ["nested more than 128 levels deep"], None),
    ("not-an-object", "[1, 2]", 8, ["is not a JSON object"], None),
    ("not-json", '{"a": ', 8, ["is not valid JSON"], None),
]


@pytest.mark.parametrize("case,text,data_size,fragments,key", BAD_HEADERS, ids=[c[0] for c in BAD_HEADERS])
def test_bad_header_is_refused_like_the_safetensors_library(tmp_path, case, text, data_size, fragments, key):
    path = write(tmp_path / f"{case}.safetensors", text, data_size)
    with pytest.raises(Exception):  # the reference refuses it (SafetensorError)
        with safe_open(str(path), "pt") as reference:
            for name in reference.keys():
                reference.get_tensor(name)
    with pytest.raises(CheckpointError) as info:
        SafetensorsFile(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    for fragment in fragments:
        assert fragment in message, message
    assert info.value.key == key
    assert info.value.path == path


# Headers the library accepts: so do we (same keys, same values).
GOOD_HEADERS = [
    ("tensors-listed-out-of-offset-order", header(b=B, a=A), 16),
    ("null-metadata", json.dumps({"__metadata__": None, "a": A}), 8),
    ("unknown-entry-field", '{"a":%s}' % entry(extra=[1, 2]), 8),
    ("scalar-and-empty", header(s={"dtype": "F32", "shape": [], "data_offsets": [0, 4]},
                                e={"dtype": "F16", "shape": [0, 3], "data_offsets": [4, 4]}), 4),
    ("no-tensors", "{}", 0),
]


@pytest.mark.parametrize("case,text,data_size", GOOD_HEADERS, ids=[c[0] for c in GOOD_HEADERS])
def test_headers_the_library_accepts_are_read_the_same(tmp_path, case, text, data_size):
    path = write(tmp_path / f"{case}.safetensors", text, data_size)
    ours = SafetensorsFile(path)
    with safe_open(str(path), "pt") as reference:
        assert sorted(ours.keys()) == sorted(reference.keys())
        for name in reference.keys():
            expected = reference.get_tensor(name)
            assert ours.shape(name) == tuple(expected.shape) and ours.dtype(name) == expected.dtype
            assert torch.equal(ours.tensor(name), expected)


def test_repeated_identical_entry_is_refused_although_the_library_keeps_one(tmp_path):
    """The library silently keeps one of two identical entries; a repeated key is refused here either way."""
    path = write(tmp_path / "twice.safetensors", '{"a":%s,"a":%s}' % (json.dumps(A), json.dumps(A)), 8)
    with pytest.raises(CheckpointError, match="names 'a' twice"):
        SafetensorsFile(path)


def test_header_over_the_100_mb_limit(tmp_path):
    """A header length over the library's 100,000,000-byte cap, in a (sparse) file long enough to hold it."""
    path = tmp_path / "huge_header.safetensors"
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        handle.truncate(8 + MAX_HEADER_BYTES + 16)
    with pytest.raises(Exception):
        safe_open(str(path), "pt")
    with pytest.raises(CheckpointError) as info:
        SafetensorsFile(path)
    assert str(info.value) == (f"{path}: the safetensors header claims {MAX_HEADER_BYTES + 1} bytes, more than the "
                               f"{MAX_HEADER_BYTES} the safetensors format allows; the file is corrupt or not a "
                               "safetensors file.")


def test_packed_quantised_dtype_is_refused_by_name(tmp_path):
    path = write(tmp_path / "f4.safetensors", '{"w":{"dtype":"F4","shape":[16],"data_offsets":[0,8]}}', 8)
    with safe_open(str(path), "pt") as reference:  # the library knows F4
        assert reference.keys() == ["w"]
    with pytest.raises(CheckpointError) as info:
        SafetensorsFile(path)
    assert "tensor 'w' has dtype F4, a packed quantised format; quantised checkpoints are not supported yet" in \
        str(info.value)


def _rewrite_header(path, edit):
    """Rewrite the JSON header of `path` in place with `edit(header)`; the data section is kept byte for byte."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    parsed = json.loads(raw[8:8 + length])
    edit(parsed)
    text = json.dumps(parsed).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])


def test_aliased_transformer_tensor_is_refused_at_load(tmp_path):
    """A transformer whose header points one norm weight at another's bytes loaded before and ran with the wrong
    weights; now load_dit refuses it, naming the file and both tensors."""
    path = save_comfy(reference_model(TINY, seed=1), TINY, tmp_path / "aliased.safetensors")
    _rewrite_header(path, lambda h: h["blocks.1.norm1.weight"].update(
        data_offsets=h["blocks.0.norm1.weight"]["data_offsets"]))
    with pytest.raises(Exception):  # the reference refuses it too
        load_file(path)
    with pytest.raises(CheckpointError) as info:
        h3_core.load_dit(path)
    message = str(info.value)
    assert message.startswith(f"{path}: tensor 'blocks.")
    assert "uses the same bytes as tensor 'blocks.0.norm1.weight'" in message or \
        "uses the same bytes as tensor 'blocks.1.norm1.weight'" in message, message
