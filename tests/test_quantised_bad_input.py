"""Quantised checkpoints and `python -m h3_core quantize` under bad input (issue 28).

Quantised files are made by the reference libraries (comfy-kitchen's quantisers, gguf's writer, `quant_fixtures`),
then one tensor, config or header field is damaged with the same libraries (safetensors, gguf's reader in r+ mode).
Each damage must be one `CheckpointError` naming the file and tensor when the file is opened: before, scales that are
0, negative, NaN, 1e30, int32 or of the wrong shape loaded and ran (or failed inside the first forward), and a GGUF
tensor whose type does not match its bytes read its neighbour's. `quantize` must work from every source dtype, name
a corrupt source, write atomically (nothing partial on a failure, a full disk or an interrupt; an existing target
replaced only by a complete file, and said so) and end every failure in one `error:` line."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import no_posix
import pytest
import torch
from cli_fixtures import default_sigint
from h3_fixtures import packed_inputs
from offload_fixtures import random_state, save_comfy
from quant_fixtures import COMFY_PREFIX, QCFG, bf16_state, comfy_quantised_state, reference_dequantised, save_gguf
from safetensors.torch import save_file

import h3_core
from h3_core.app import cli
from h3_core.errors import CheckpointError

pytest.importorskip("comfy_kitchen")
pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[1]
LAYER = COMFY_PREFIX + "blocks.0.mlp.fc2"  # a 256 x 256 block matrix
CORRUPT = ("the file is corrupt: download it again, or quantise the bf16 release yourself (python -m h3_core "
           "quantize).")


@pytest.fixture(scope="module")
def state():
    return bf16_state()


@pytest.fixture(scope="module")
def comfy_tensors(state):
    """Every ComfyUI format's file tensors, quantised by comfy-kitchen."""
    formats = ("float8_e4m3fn", "float8_e5m2", "fp8_scaled", "int8_tensorwise", "int8_rowwise", "int8_convrot",
               "nvfp4", "nvfp4_awq")
    return {fmt: comfy_quantised_state(state, fmt)[0] for fmt in formats}


def _scalar(value, dtype=torch.float32):
    return lambda stored: torch.tensor(value, dtype=dtype)


def _scaled(factor):
    return lambda stored: stored * factor


def _one_row(value):
    return lambda stored: stored.clone().index_fill_(0, torch.tensor([3]), value)


def _config(**config):
    return lambda stored: torch.tensor(list(json.dumps(config).encode("utf-8")), dtype=torch.uint8)


E4M3_NAN, E4M3_MINUS_ONE = 0x7F, 0xB8  # E4M3 bit patterns


def _block_scale_bits(bits):
    return lambda stored: stored.view(torch.uint8).clone().index_fill_(0, torch.tensor([5]), bits).view(
        torch.float8_e4m3fn)


# (format, the tensor damaged (suffix of LAYER), how, the key the error names (suffix), what the message says)
SCALE_CASES = {
    # per-tensor fp8 scale: [] expected
    "fp8-zero": ("float8_e4m3fn", "weight_scale", _scalar(0.0), "weight_scale",
                 "holds 0; a scale is a finite number above 0"),
    "fp8-negative": ("float8_e4m3fn", "weight_scale", _scalar(-0.01), "weight_scale",
                     "holds -0.01; a scale is a finite number above 0"),
    "fp8-nan": ("float8_e4m3fn", "weight_scale", _scalar(float("nan")), "weight_scale", "holds nan; a scale is"),
    "fp8-inf": ("float8_e4m3fn", "weight_scale", _scalar(float("inf")), "weight_scale", "holds inf; a scale is"),
    "fp8-1e30": ("float8_e4m3fn", "weight_scale", _scalar(1e30), "weight_scale",
                 "holds 1e+30, which makes weights up to 4.48e+32 (448 x the scale), past 65504, the fp16 range"),
    "fp8-int32": ("float8_e4m3fn", "weight_scale", _scalar(1, torch.int32), "weight_scale",
                  "has dtype int32; expected float32, bfloat16, float16 or float64"),
    "fp8-row-shaped": ("float8_e4m3fn", "weight_scale", lambda s: torch.full((1, 256), 0.01), "weight_scale",
                       "has shape [1, 256]; expected [] (one value for the tensor)"),
    "fp8-vector": ("float8_e4m3fn", "weight_scale", lambda s: torch.full((256,), 0.01), "weight_scale",
                   "has shape [256]; expected [] (one value for the tensor)"),
    "fp8-wrong-length": ("float8_e4m3fn", "weight_scale", lambda s: torch.full((255, 1), 0.01), "weight_scale",
                         "has shape [255, 1]; expected []"),
    "fp8-two-values": ("float8_e4m3fn", "weight_scale", lambda s: torch.full((2,), 0.01), "weight_scale",
                       "has shape [2]; expected []"),
    "e5m2-past-its-range": ("float8_e5m2", "weight_scale", _scalar(2.0), "weight_scale",
                            "holds 2, which makes weights up to 1.147e+05 (57344 x the scale)"),
    "fp8-scaled-zero": ("fp8_scaled", "scale_weight", _scalar(0.0), "scale_weight", "holds 0; a scale is"),
    "fp8-scaled-nan": ("fp8_scaled", "scale_weight", _scalar(float("nan")), "scale_weight", "holds nan; a scale is"),
    "fp8-scaled-row-shaped": ("fp8_scaled", "scale_weight", lambda s: torch.full((1, 256), 0.01), "scale_weight",
                              "has shape [1, 256]; expected []"),
    # int8: [] or [rows, 1]
    "int8-negative": ("int8_tensorwise", "weight_scale", _scaled(-1), "weight_scale", "a scale is a finite number"),
    "int8-1e30": ("int8_tensorwise", "weight_scale", _scalar(1e30), "weight_scale",
                  "(128 x the scale), past 65504"),
    "int8-row-zero": ("int8_rowwise", "weight_scale", _one_row(0.0), "weight_scale",
                      "holds 0 (row 3); a scale is a finite number above 0"),
    "int8-row-negative": ("int8_rowwise", "weight_scale", _one_row(-0.5), "weight_scale", "holds -0.5 (row 3)"),
    "int8-row-nan": ("int8_rowwise", "weight_scale", _one_row(float("nan")), "weight_scale", "holds nan (row 3)"),
    "int8-row-inf": ("int8_rowwise", "weight_scale", _one_row(float("inf")), "weight_scale", "holds inf (row 3)"),
    "int8-row-1e30": ("int8_rowwise", "weight_scale", _one_row(1e30), "weight_scale", "holds 1e+30 (row 3), which"),
    "int8-rows-as-vector": ("int8_rowwise", "weight_scale", lambda s: s.reshape(-1), "weight_scale",
                            "has shape [256]; expected [] (one value for the tensor) or [256, 1] (one per row)"),
    "int8-rows-as-columns": ("int8_rowwise", "weight_scale", lambda s: s.reshape(1, -1), "weight_scale",
                             "has shape [1, 256]; expected [] (one value for the tensor) or [256, 1]"),
    "int8-rows-wrong-length": ("int8_rowwise", "weight_scale", lambda s: s[:-1], "weight_scale",
                               "has shape [255, 1]; expected [] (one value for the tensor) or [256, 1]"),
    "int8-rows-int32": ("int8_rowwise", "weight_scale", lambda s: (s * 1e4).to(torch.int32), "weight_scale",
                        "has dtype int32; expected float32"),
    "int8-rows-fp8": ("int8_rowwise", "weight_scale", lambda s: s.to(torch.float8_e4m3fn), "weight_scale",
                      "has dtype float8_e4m3fn; expected float32"),
    "convrot-wrong-length": ("int8_convrot", "weight_scale", lambda s: s[:-1], "weight_scale",
                             "has shape [255, 1]; expected"),
    "convrot-negative": ("int8_convrot", "weight_scale", _scaled(-1), "weight_scale", "a scale is a finite number"),
    # NVFP4: E4M3 block scales [roundup(rows, 128), roundup(cols / 16, 4)], per-tensor weight_scale_2, AWQ [cols]
    "nvfp4-blocks-fp32": ("nvfp4", "weight_scale", lambda s: s.float(), "weight_scale",
                          "has dtype float32; expected float8_e4m3fn or uint8"),
    "nvfp4-blocks-short": ("nvfp4", "weight_scale", lambda s: s[:-1], "weight_scale",
                           "has shape [255, 16]; expected [256, 16] (one scale per 16 weights, in cuBLAS's tiled "
                           "layout)"),
    "nvfp4-blocks-too-many": ("nvfp4", "weight_scale", lambda s: torch.cat([s, s[:128]]), "weight_scale",
                              "has shape [384, 16]; expected [256, 16] (one scale per 16 weights"),
    "nvfp4-blocks-nan": ("nvfp4", "weight_scale", _block_scale_bits(E4M3_NAN), "weight_scale",
                         "holds nan at [5, 0] of the tiled layout; a block scale is finite and not negative"),
    "nvfp4-blocks-negative": ("nvfp4", "weight_scale", _block_scale_bits(E4M3_MINUS_ONE), "weight_scale",
                              "holds -1 at [5, 0] of the tiled layout; a block scale"),
    "nvfp4-tensor-zero": ("nvfp4", "weight_scale_2", _scaled(0), "weight_scale_2", "holds 0; a scale is"),
    "nvfp4-tensor-nan": ("nvfp4", "weight_scale_2", _scalar(float("nan")), "weight_scale_2", "holds nan; a scale"),
    "nvfp4-tensor-1e30": ("nvfp4", "weight_scale_2", _scalar(1e30), "weight_scale_2",
                          "holds 1e+30, which makes weights up to 2.688e+33 (2688 x the scale)"),
    "nvfp4-tensor-vector": ("nvfp4", "weight_scale_2", lambda s: s.reshape(1).repeat(16), "weight_scale_2",
                            "has shape [16]; expected []"),
    "nvfp4-tensor-int32": ("nvfp4", "weight_scale_2", _scalar(1, torch.int32), "weight_scale_2",
                           "has dtype int32; expected float32"),
    "awq-column-shaped": ("nvfp4_awq", "pre_quant_scale", lambda s: s.reshape(-1, 1), "pre_quant_scale",
                          "has shape [256, 1]; expected one value per column of the weight ([256] for its 256"),
    "awq-negative": ("nvfp4_awq", "pre_quant_scale", _scaled(-1), "pre_quant_scale",
                     "a smoothing factor is a finite number above 0 and at most 65504"),
    "awq-nan": ("nvfp4_awq", "pre_quant_scale", _scaled(float("nan")), "pre_quant_scale", "holds nan (column 0)"),
    "awq-int32": ("nvfp4_awq", "pre_quant_scale", lambda s: s.to(torch.int32), "pre_quant_scale",
                  "has dtype int32; expected float32"),
    "awq-one-short": ("nvfp4_awq", "pre_quant_scale", lambda s: s[:-1], "weight",
                      "(nvfp4) is stored as [256, 128], which does not hold the [256, 256] expected"),
    # the weight itself in another dtype than its format's
    "fp8-weight-bf16": ("float8_e4m3fn", "weight", lambda w: w.to(torch.bfloat16), "weight",
                        "is quantised as 'float8_e4m3fn' but is stored as bfloat16 [256, 256]; float8_e4m3fn weights "
                        "are 2-D float8_e4m3fn or uint8"),
    "e4m3-weight-as-e5m2": ("float8_e4m3fn", "weight", lambda w: w.view(torch.float8_e5m2), "weight",
                            "but is stored as float8_e5m2 [256, 256]"),
    "int8-weight-uint8": ("int8_tensorwise", "weight", lambda w: w.view(torch.uint8), "weight",
                          "is quantised as 'int8_tensorwise' but is stored as uint8 [256, 256]"),
    "nvfp4-weight-int8": ("nvfp4", "weight", lambda w: w.view(torch.int8), "weight",
                          "is quantised as 'nvfp4' but is stored as int8 [256, 128]; nvfp4 weights are 2-D uint8"),
    # ConvRot's group size, a quantisation parameter in the config
    "convrot-group-8": ("int8_convrot", "comfy_quant",
                        _config(format="int8_tensorwise", convrot=True, convrot_groupsize=8), "comfy_quant",
                        "has convrot_groupsize 8; expected a power of 4;"),
    "convrot-group-1024": ("int8_convrot", "comfy_quant",
                           _config(format="int8_tensorwise", convrot=True, convrot_groupsize=1024), "comfy_quant",
                           "has convrot_groupsize 1024; expected a power of 4 that divides the 256 columns"),
    "convrot-group-2**40": ("int8_convrot", "comfy_quant",
                            _config(format="int8_tensorwise", convrot=True, convrot_groupsize=2**40), "comfy_quant",
                            f"has convrot_groupsize {2**40}; expected a power of 4 that divides"),
    "convrot-not-a-bool": ("int8_convrot", "comfy_quant",
                           _config(format="int8_tensorwise", convrot="yes", convrot_groupsize=64), "comfy_quant",
                           "has convrot 'yes'; expected true or false"),
}


@pytest.mark.parametrize("case", list(SCALE_CASES))
def test_a_damaged_scale_or_payload_is_one_error_naming_the_tensor(comfy_tensors, tmp_path, case):
    # Before: every case but the shape mismatches loaded, and ran (zero, sign-flipped, broadcast or NaN weights);
    # the shape mismatches, a wrong group size and fp8 per-row scales were tracebacks from inside the first forward.
    fmt, damaged, edit, faulted, message = SCALE_CASES[case]
    tensors = dict(comfy_tensors[fmt])
    tensors[f"{LAYER}.{damaged}"] = edit(tensors[f"{LAYER}.{damaged}"]).contiguous()
    path = tmp_path / "damaged.safetensors"
    save_file(tensors, path)
    with pytest.raises(CheckpointError) as info:
        h3_core.load_dit(path)
    text = str(info.value)
    assert text.startswith(f"{path}: ") and f"'{LAYER}.{faulted}'" in text, text
    assert message in text, text
    assert info.value.key == f"{LAYER}.{faulted}" and info.value.path == path
    if "does not hold" not in message:  # that one is the loader's shape check (the padding hides the length)
        assert text.endswith(CORRUPT), text


def test_scales_in_every_form_the_formats_allow_still_load(state, tmp_path):
    """What the checks must not refuse: a per-tensor scale stored as bf16 [1]; comfy-kitchen's per-row int8 of a
    matrix with an all-zero row (its scale floor, 1e-30); NVFP4 block scales in the uint8 container, or flat."""
    from comfy_kitchen.tensor import QuantizedTensor

    fp8, fp8_qt = comfy_quantised_state(state, "float8_e4m3fn")
    fp8[f"{LAYER}.weight_scale"] = fp8[f"{LAYER}.weight_scale"].to(torch.bfloat16).reshape(1)
    save_file(fp8, tmp_path / "fp8.safetensors")
    params = dict(h3_core.load_dit(tmp_path / "fp8.safetensors", dtype=torch.float32).named_parameters())
    qt = fp8_qt["blocks.0.mlp.fc2.weight"]
    expected = qt._qdata.float() * fp8[f"{LAYER}.weight_scale"].float()  # the stored bf16 scale, not the fp32 one
    assert torch.equal(params["blocks.0.mlp.fc2.weight"], expected)

    zero_row = state["blocks.0.mlp.fc2.weight"].clone()
    zero_row[7] = 0
    qt = QuantizedTensor.from_float(zero_row, "TensorWiseINT8Layout", per_channel=True)
    int8, _ = comfy_quantised_state(state, "int8_rowwise")
    int8.update({k: v.contiguous() for k, v in qt.state_dict(f"{LAYER}.weight").items()})
    assert float(int8[f"{LAYER}.weight_scale"][7]) == pytest.approx(1e-30)
    save_file(int8, tmp_path / "int8.safetensors")
    params = dict(h3_core.load_dit(tmp_path / "int8.safetensors", dtype=torch.float32).named_parameters())
    assert torch.equal(params["blocks.0.mlp.fc2.weight"], reference_dequantised(qt, torch.float32))

    nvfp4, nvfp4_qt = comfy_quantised_state(state, "nvfp4")
    nvfp4[f"{LAYER}.weight_scale"] = nvfp4[f"{LAYER}.weight_scale"].view(torch.uint8)
    other = COMFY_PREFIX + "blocks.1.mlp.fc2"  # flattened, as cuBLAS's flat layout (comfy-kitchen reshapes it)
    nvfp4[f"{other}.weight_scale"] = nvfp4[f"{other}.weight_scale"].reshape(-1)
    save_file(nvfp4, tmp_path / "nvfp4.safetensors")
    params = dict(h3_core.load_dit(tmp_path / "nvfp4.safetensors", dtype=torch.float32).named_parameters())
    for name in ("blocks.0.mlp.fc2.weight", "blocks.1.mlp.fc2.weight"):
        assert torch.equal(params[name], reference_dequantised(nvfp4_qt[name], torch.float32)), name


# ---- GGUF: each tensor's type and shape against its bytes --------------------------------------------------------

MATRIX, BIAS = "blocks.0.mlp.fc2.weight", "video_patch_proj.bias"  # Q8_0 [256, 256]; BF16 [256]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, state):
    return save_gguf(state, "Q8_0", tmp_path_factory.mktemp("gguf") / "q8_0.gguf")


def _set_type(name, qtype):
    def edit(tensors, order):
        import gguf

        tensors[name].field.parts[4][0] = int(gguf.GGMLQuantizationType[qtype])
    return edit


def _same_offset_as_previous(tensors, order):
    first, second = order[5], order[6]
    tensors[second.name].field.parts[5][0] = tensors[first.name].field.parts[5][0]


def _offset_plus_2(tensors, order):
    tensors[order[5].name].field.parts[5][0] += 2


def _dimension_doubled(tensors, order):
    tensors[BIAS].field.parts[3][0] *= 2


GGUF_CASES = {
    # (edit, the tensor the error names, what it says)
    "Q8_0-typed-Q4_0": (_set_type(MATRIX, "Q4_0"), MATRIX,
                        "is GGUF type Q4_0 with shape [256, 256], 36864 bytes at offset"),
    "Q8_0-typed-Q6_K": (_set_type(MATRIX, "Q6_K"), MATRIX, "is GGUF type Q6_K with shape [256, 256], 53760 bytes"),
    "Q8_0-typed-F16": (_set_type(MATRIX, "F16"), MATRIX, "is GGUF type F16 with shape [256, 256], 131072 bytes"),
    "Q8_0-typed-F32": (_set_type(MATRIX, "F32"), MATRIX, "262144 bytes at offset"),
    "BF16-typed-F32": (_set_type(BIAS, "F32"), BIAS, "is GGUF type F32 with shape [256], 1024 bytes at offset"),
    "BF16-typed-Q8_0": (_set_type(BIAS, "Q8_0"), BIAS, "is GGUF type Q8_0 with shape [256], 272 bytes"),
    "BF16-typed-I8": (_set_type(BIAS, "I8"), BIAS, "is GGUF type I8 with shape [256], 256 bytes"),
    "dimension-doubled": (_dimension_doubled, BIAS, "is GGUF type BF16 with shape [512], 1024 bytes"),
    "two-tensors-at-one-offset": (_same_offset_as_previous, None, "starts 0 bytes after its offset"),
    "misaligned-offset": (_offset_plus_2, None, "not at a multiple of the file's 32-byte alignment: its offset field "
                                                "is wrong; the file is corrupt. Download it again."),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_a_gguf_tensor_whose_type_or_shape_does_not_match_its_bytes_is_refused(gguf_file, tmp_path, case):
    # Before: the tensor was read from its offset with its header's type and shape: a neighbour's bytes, or part of
    # its own, loaded and ran (noise or NaN velocities), or failed in the first forward (F32 among BF16).
    import gguf

    edit, faulted, message = GGUF_CASES[case]
    path = Path(shutil.copy(gguf_file, tmp_path / "damaged.gguf"))
    reader = gguf.GGUFReader(path, "r+")
    tensors = {t.name: t for t in reader.tensors}
    edit(tensors, sorted(reader.tensors, key=lambda t: int(t.data_offset)))
    reader.data.flush()
    del reader, tensors
    with pytest.raises(CheckpointError) as info:
        h3_core.load_dit(path)
    text = str(info.value)
    assert text.startswith(f"{path}: tensor '{info.value.key}' is GGUF type "), text
    assert faulted is None or info.value.key == faulted
    assert message in text, text
    if "offset field" not in message:
        assert text.endswith(": its type or shape field does not match its data; the file is corrupt. Download it "
                             "again."), text


# ---- python -m h3_core quantize -----------------------------------------------------------------------------------

OUTPUT = {"fp8": "out.safetensors", "int8": "out.safetensors", "q8_0": "out.gguf", "q4_k": "out.gguf"}
OLD = b"an earlier quantised file"


@pytest.fixture(scope="module")
def bf16_source(tmp_path_factory, state):
    return save_comfy(state, tmp_path_factory.mktemp("source") / "h3_bf16.safetensors")


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("fmt", list(OUTPUT))
@pytest.mark.parametrize("source_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_files_quantised_from_every_source_dtype_run_at_the_default_dtype(tmp_path, source_dtype, fmt):
    # Before (the fp32 tiny model's case): the fp32 norms kept beside bf16 dequantised weights failed the first
    # matmul at --dtype auto ("expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16").
    from h3_core.checkpoints.quantiser import quantise_checkpoint

    source = save_comfy(random_state(QCFG, 3, source_dtype), tmp_path / "source.safetensors")
    target = quantise_checkpoint(source, tmp_path / OUTPUT[fmt], fmt)
    model = h3_core.load_dit(target)
    with torch.no_grad():
        outputs = model(**packed_inputs(QCFG))
    assert all(torch.isfinite(o).all() for o in outputs)


@pytest.mark.parametrize("fmt", list(OUTPUT))
def test_quantize_replaces_an_existing_target_and_says_so(bf16_source, tmp_path, capsys, fmt):
    # Before: the file there was overwritten without a word (generate says "replaced the file that was there").
    target = tmp_path / OUTPUT[fmt]
    target.write_bytes(OLD)
    assert cli.main(["quantize", str(bf16_source), str(target), "--format", fmt]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {target} (") and out.endswith(f" MiB, {fmt}; replaced the file that was there)\n")
    assert target.read_bytes() != OLD and names(tmp_path) == [target.name]
    h3_core.load_dit(target)


@pytest.mark.parametrize("kind", ["folder", "pipe"])
def test_quantize_to_a_folder_or_a_pipe_is_one_line(bf16_source, tmp_path, capsys, kind):
    # Before: a folder named out.gguf was an IsADirectoryError traceback after the whole model was quantised; a
    # pipe was replaced by the file.
    target = tmp_path / "out.gguf"
    target.mkdir() if kind == "folder" else os.mkfifo(target)
    assert cli.main(["quantize", str(bf16_source), str(target), "--format", "q8_0"]) == 2
    assert capsys.readouterr().err == (f"error: {target}: exists and is not a regular file (a folder, a device or a "
                                       "pipe); give a file name.\n")
    assert names(tmp_path) == ["out.gguf"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_quantize_into_a_folder_that_cannot_be_written_is_one_line_before_reading(bf16_source, capsys, monkeypatch):
    # Before: a FileNotFoundError traceback, after the source was opened.
    from h3_core.checkpoints import quantiser

    monkeypatch.setattr(quantiser, "resolve_dit_checkpoint", lambda source: pytest.fail("read the source"))
    assert cli.main(["quantize", str(bf16_source), "/proc/h3.gguf", "--format", "q8_0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: /proc/h3.gguf: cannot write in /proc (") and err.endswith(
        "); choose a folder you can write.\n") and err.count("\n") == 1


@pytest.mark.parametrize("fmt", ["fp8", "int8", "q8_0", "q4_k"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e5], ids=["nan", "inf", "1e5"])
def test_a_source_matrix_that_is_not_finite_or_too_large_is_named(state, tmp_path, fmt, bad):
    # Before: NaN / inf gave a file of NaN scales (or blocks) without a word; 1e5 a file whose scales its own loader
    # now refuses.
    from h3_core.checkpoints.quantiser import quantise_checkpoint

    damaged = dict(state)
    damaged["blocks.1.attn.out_proj.weight"] = damaged["blocks.1.attn.out_proj.weight"].clone()
    damaged["blocks.1.attn.out_proj.weight"][2, 3] = bad
    source = save_comfy(damaged, tmp_path / "source.safetensors")
    with pytest.raises(CheckpointError) as info:
        quantise_checkpoint(source, tmp_path / OUTPUT[fmt], fmt)
    stored = float(torch.tensor(bad, dtype=torch.bfloat16))  # 1e5 is 99840 in bf16
    what = f"values up to {stored:.4g}" if bad == 1e5 else "NaN or infinite values"
    assert str(info.value) == (f"{source}: tensor 'blocks.1.attn.out_proj.weight' holds {what}; a trained weight is "
                               "finite and far below 65504. The source checkpoint is corrupt: download it again.")
    assert names(tmp_path) == ["source.safetensors"]


@pytest.mark.parametrize("fmt", ["fp8", "int8", "q8_0", "q4_k"])
def test_an_all_zero_matrix_quantises_to_zeros(state, tmp_path, fmt):
    # Before (fp8): scale = amax / 448 = 0 and comfy-kitchen's quantiser computed 0 x (1 / 0): every weight NaN.
    from h3_core.checkpoints.quantiser import quantise_checkpoint

    zeroed = dict(state, **{"blocks.0.mlp.fc2.weight": torch.zeros_like(state["blocks.0.mlp.fc2.weight"])})
    source = save_comfy(zeroed, tmp_path / "source.safetensors")
    target = quantise_checkpoint(source, tmp_path / OUTPUT[fmt], fmt)
    params = dict(h3_core.load_dit(target, dtype=torch.float32).named_parameters())
    assert torch.equal(params["blocks.0.mlp.fc2.weight"], torch.zeros(256, 256))


@contextlib.contextmanager
def file_size_limit(limit: int):
    """This process's writes past `limit` bytes fail with EFBIG (SIGXFSZ ignored, as otherwise it kills the
    process); both are put back after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.parametrize("fmt, existing", [
    ("int8", True),
    # gguf's writer reports a short write without an errno: the limit is told apart by reading it, which a process
    # without `resource` (Windows, which has no file-size limit) cannot do
    pytest.param("q8_0", False, marks=pytest.mark.skipif(no_posix.enabled(), reason="RLIMIT_FSIZE is POSIX-only"))])
def test_the_file_size_limit_is_one_line_and_leaves_nothing(bf16_source, tmp_path, capsys, fmt, existing):
    # Before: an OSError traceback (EFBIG from the safetensors writer; NumPy's "8704 requested and 5184 written"
    # from gguf's), and no word of the limit.
    target = tmp_path / OUTPUT[fmt]
    if existing:
        target.write_bytes(OLD)
    with file_size_limit(65536):  # each output is about 4 MB
        code = cli.main(["quantize", str(bf16_source), str(target), "--format", fmt])
    err = capsys.readouterr().err
    assert code == 2, err
    # The safetensors writer's EFBIG; gguf's NumPy reports the short write without an errno.
    reason = "File too large" if fmt == "int8" else r"\d+ requested and \d+ written"
    kept = "; the file already there is unchanged" if existing else ""
    assert re.fullmatch(f"error: {re.escape(str(target))}: could not write the quantised file: {reason}, past the "
                        fr"process's file-size limit \(ulimit -f\)\. Nothing was written{kept}\.\n", err), err
    assert names(tmp_path) == ([target.name] if existing else [])
    if existing:
        assert target.read_bytes() == OLD


@pytest.mark.parametrize("stop, code, word", [(KeyboardInterrupt, 130, "interrupted"),
                                              (cli.Terminated, 143, "terminated")])
def test_a_stop_mid_write_leaves_no_partial_file_and_the_existing_target(bf16_source, tmp_path, capsys,
                                                                          monkeypatch, stop, code, word):
    # What Ctrl-C (KeyboardInterrupt) and SIGTERM (the CLI's Terminated) raise, at the third parameter read, when
    # the output exists under its staging name. Before: the message said only "nothing was written", not that the
    # file at the target is unchanged (generate's words).
    from h3_core.runtime.host_store import HostTensor

    target = tmp_path / "out.safetensors"
    target.write_bytes(OLD)
    original, staged = HostTensor.private_value, []

    def stops_at_the_third(self, reader):
        staged.append(names(tmp_path))
        if len(staged) == 3:
            raise stop
        return original(self, reader)

    monkeypatch.setattr(HostTensor, "private_value", stops_at_the_third)
    assert cli.main(["quantize", str(bf16_source), str(target), "--format", "int8"]) == code
    assert capsys.readouterr().err == f"{word}; nothing was written; {target} is unchanged\n"
    assert staged[-1] == [f".out.safetensors.{os.getpid()}.partial", "out.safetensors"]
    assert names(tmp_path) == [target.name] and target.read_bytes() == OLD


# A child quantising with the CLI that waits for a signal once three parameters are read.
CHILD = r"""
import sys, time
from h3_core.app import cli
from h3_core.runtime.host_store import HostTensor

original, reads = HostTensor.private_value, []

def waits_at_the_third(self, reader):
    reads.append(1)
    if len(reads) == 3:
        print("READY", flush=True)
        while True:
            time.sleep(0.05)
    return original(self, reader)

HostTensor.private_value = waits_at_the_third
sys.exit(cli.main(["quantize", *sys.argv[1:]]))
"""


def test_ctrl_c_stops_quantize_at_once_and_keeps_the_existing_target(bf16_source, tmp_path):
    # A real SIGINT in a child process (the signal path, and how soon it stops).
    target = tmp_path / "out.gguf"
    target.write_bytes(OLD)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(bf16_source), str(target), "--format", "q8_0"],
                             cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    watchdog = threading.Timer(300, child.kill)
    watchdog.start()
    try:
        assert child.stdout.readline().strip() == "READY", child.stderr.read()
        staged = [name for name in names(tmp_path) if name != target.name]
        child.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, stderr = child.communicate()
        stopped_after = time.monotonic() - sent
    finally:
        watchdog.cancel()
    assert staged == [f".out.gguf.{child.pid}.partial"]  # written under its staging name only
    assert child.returncode == 130 and stderr == f"interrupted; nothing was written; {target} is unchanged\n"
    assert stopped_after < 30
    assert names(tmp_path) == [target.name] and target.read_bytes() == OLD


def test_the_staging_file_of_a_killed_run_is_removed_by_the_next(bf16_source, tmp_path):
    from h3_core.checkpoints.quantiser import quantise_checkpoint

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f".out.gguf.{dead.pid}.partial").write_bytes(b"half a file")
    (tmp_path / f".out.gguf.{os.getpid()}x.partial").write_bytes(b"not ours")
    quantise_checkpoint(bf16_source, tmp_path / "out.gguf", "q8_0")
    assert names(tmp_path) == [f".out.gguf.{os.getpid()}x.partial", "out.gguf"]
