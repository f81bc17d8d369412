"""Quantised transformer checkpoints (issue 17): ComfyUI mixed-precision repacks and GGUF files, quantised by the
reference libraries' own quantisers (`quant_fixtures`), dequantise bit for bit as those libraries do, stream at
their quantised size and give velocities close to the bf16 model."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from h3_fixtures import packed_inputs, rel_l2
from offload_fixtures import same_outputs, save_comfy, save_diffusers, save_native
from quant_fixtures import (COMFY_FORMATS, COMFY_PREFIX, GGUF_FORMATS, QCFG, bf16_state, dequantised_twin,
                            gguf_reference, quantise_file, quantised_layer, reference_dequantised, save_comfy_quantised,
                            save_gguf)
from safetensors.torch import load_file, save_file

import h3_core
from h3_core.errors import CheckpointError
from h3_core.runtime import AsyncBackend, LayerwiseOffloadManager, SynchronousBackend

pytest.importorskip("comfy_kitchen")
pytest.importorskip("gguf")

# Relative L2 of the velocities against the bf16 model (fp32 compute), measured on this tiny random model and
# bounded with ~1.5x headroom: the precision of each format, not a promise about the released model's outputs.
VELOCITY_TOLERANCE = {"float8_e4m3fn": 0.05, "float8_e5m2": 0.1, "fp8_scaled": 0.05, "int8_tensorwise": 0.025,
                      "int8_rowwise": 0.015, "int8_convrot": 0.015, "nvfp4": 0.25, "nvfp4_awq": 0.25, "Q8_0": 0.01,
                      "F16": 1e-5, "BF16": 0.0}
# Q6_K / Q5_K / Q4_K blocks are random (gguf has no K-quant quantiser): checked bit for bit, not for velocities.
ALL_FORMATS = COMFY_FORMATS + GGUF_FORMATS


@pytest.fixture(scope="module")
def state():
    return bf16_state()


@pytest.fixture(scope="module")
def files(tmp_path_factory, state):
    """Every format's file (+ the comfy-kitchen tensors of the ComfyUI ones) and the bf16 original."""
    folder = tmp_path_factory.mktemp("quantised")
    out = {"bf16": save_comfy(state, folder / "bf16.safetensors")}
    kitchen = {}
    for fmt in COMFY_FORMATS:
        out[fmt], kitchen[fmt], _ = save_comfy_quantised(state, fmt, folder / f"{fmt}.safetensors")
    for fmt in GGUF_FORMATS:
        out[fmt] = save_gguf(state, fmt, folder / f"{fmt}.gguf")
    return out, kitchen


@pytest.fixture(scope="module")
def inputs():
    return packed_inputs(QCFG)


def _params(model):
    return dict(model.named_parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", COMFY_FORMATS)
def test_comfy_formats_dequantise_bit_for_bit_as_comfy_kitchen(files, state, fmt, dtype):
    paths, kitchen = files
    params = _params(h3_core.load_dit(paths[fmt], dtype=dtype))
    assert set(kitchen[fmt]) == {n for n, v in state.items() if quantised_layer(n, v)}
    for name, qt in kitchen[fmt].items():
        expected = reference_dequantised(qt, dtype)
        if fmt == "nvfp4_awq":  # ComfyUI multiplies the input by pre_quant_scale: the weight's columns, here
            stored = load_file(paths[fmt])[f"{COMFY_PREFIX}{name[:-len('.weight')]}.pre_quant_scale"]
            expected = expected * stored.to(dtype)
        assert params[name].dtype == dtype and torch.equal(params[name], expected), name
    # Unquantised tensors of the same file (norms, biases, fp32 islands) load as they do from a bf16 file.
    plain = _params(h3_core.load_dit(paths["bf16"], dtype=dtype))
    for name in set(plain) - set(kitchen[fmt]):
        assert torch.equal(params[name], plain[name]), name


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_gguf_dequantises_bit_for_bit_as_the_gguf_package(files, fmt):
    paths, _ = files
    reference = gguf_reference(paths[fmt])
    params = _params(h3_core.load_dit(paths[fmt], dtype=torch.float32))
    assert set(reference) == set(params) - {"rope.inv_freq"}
    for name, expected in reference.items():
        assert torch.equal(params[name], expected), name


def test_dtype_none_dequantises_into_bf16_and_keeps_plain_tensors_as_stored(files, tmp_path):
    paths, _ = files
    key = f"{COMFY_PREFIX}video_patch_proj.weight"
    path = _rewrite(paths["int8_rowwise"], tmp_path / "island.safetensors",
                    lambda s: s.__setitem__(key, s[key].float()))  # an fp32 island, as the release stores it
    params = _params(h3_core.load_dit(path))
    assert params["blocks.0.attn.qkv_proj.weight"].dtype == torch.bfloat16
    assert params["blocks.0.norm1.weight"].dtype == torch.bfloat16
    assert params["video_patch_proj.weight"].dtype == torch.float32


@pytest.mark.parametrize("layout", ["native", "diffusers"])
@pytest.mark.parametrize("fmt", ["int8_rowwise", "nvfp4", "int8_convrot"])
def test_row_permutations_keep_per_row_scales_with_their_rows(tmp_path, state, layout, fmt):
    """Native files store the fused QKV per head interleaved and diffusers files store fc1 halves swapped and q, k,
    v apart: the quantised file (rows and their per-row scales in the stored order) loads exactly as the same
    layout holding comfy-kitchen's dequantisation of each stored tensor."""
    plain = tmp_path / "plain"
    (save_native if layout == "native" else save_diffusers)(state, QCFG, plain)
    stem = "model" if layout == "native" else "diffusion_pytorch_model"
    quantised, twin = shutil.copytree(plain, tmp_path / "quantised"), shutil.copytree(plain, tmp_path / "twin")
    kitchen = quantise_file(plain / f"{stem}.safetensors", quantised / f"{stem}.safetensors", fmt)
    assert any("qkv" in k or "to_q" in k for k in kitchen) and any("fc1" in k or "ff.net.0" in k for k in kitchen)
    dequantised_twin(plain / f"{stem}.safetensors", twin / f"{stem}.safetensors", kitchen)
    got = _params(h3_core.load_dit(quantised, dtype=torch.float32))
    expected = _params(h3_core.load_dit(twin, dtype=torch.float32))
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


@pytest.mark.parametrize("fmt", [f for f in ALL_FORMATS if f in VELOCITY_TOLERANCE])
def test_velocities_are_within_the_measured_tolerance_of_the_bf16_model(files, inputs, fmt):
    paths, _ = files
    with torch.no_grad():
        reference = h3_core.load_dit(paths["bf16"], dtype=torch.float32)(**inputs)
        got = h3_core.load_dit(paths[fmt], dtype=torch.float32)(**inputs)
    for a, b in zip(got, reference):
        assert torch.isfinite(a).all()
        assert rel_l2(a, b) <= VELOCITY_TOLERANCE[fmt], (fmt, rel_l2(a, b))


def _stored_block_bytes(path, block: int, plain_itemsize: int | None = None, state=None) -> int:
    """Bytes of block `block`'s tensors in the file, the AdaLN projection aside (a unit of its own), comfy_quant
    descriptions and unused input scales aside; `plain_itemsize`: count the tensors `state` holds unquantised
    (norms, biases) at that many bytes an element, as materialised, instead of as stored."""
    from h3_core.checkpoints.checkpoint import open_weights_file

    file = open_weights_file(path)
    prefix = COMFY_PREFIX if any(k.startswith(COMFY_PREFIX) for k in file.keys()) else ""
    total = 0
    for key in file.keys():
        name = key[len(prefix):]
        if not name.startswith(f"blocks.{block}.") or ".adaln_proj." in name or name.endswith(
                (".comfy_quant", ".input_scale")):
            continue
        plain = name in state and not quantised_layer(name, state[name]) if state is not None else False
        total += state[name].numel() * plain_itemsize if plain and plain_itemsize else file.nbytes(key)
    return total


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_layerwise_equals_resident_bitwise_and_streams_the_quantised_bytes(files, state, inputs, fmt):
    paths, _ = files
    with torch.no_grad():
        resident = h3_core.load_dit(paths[fmt], dtype=torch.float32)(**inputs)
        model = h3_core.load_dit(paths[fmt], dtype=torch.float32, residency="layerwise")
        streamed = model(**inputs)
    assert same_outputs(streamed, resident)
    manager = model.block_residency
    assert manager.store.kind == "staged_reads"
    blocks = [_stored_block_bytes(paths[fmt], i) for i in range(QCFG.num_layers)]
    if fmt in ("F16", "BF16"):  # plain tensors: read and cast to the compute dtype, as from safetensors
        assert manager.store.host_bytes == sum(blocks)
        return
    # The store holds the file's bytes, and a pass moves the quantised bytes of every block (its norms and
    # biases cast to the compute dtype, as from a plain file).
    assert manager.store.host_bytes == sum(blocks)
    moved = [_stored_block_bytes(paths[fmt], i, 4, state) for i in range(QCFG.num_layers)]
    assert manager.stats().last_pass.bytes_h2d == sum(moved)
    bf16 = [_stored_block_bytes(paths["bf16"], i) for i in range(QCFG.num_layers)]
    assert sum(blocks) < sum(bf16)


@pytest.mark.parametrize("store", ["pinned_slab", "held_tensors"])
@pytest.mark.parametrize("fmt", ["nvfp4", "int8_convrot", "Q8_0"])
def test_every_host_store_dequantises_the_same_numbers(files, inputs, fmt, store):
    """The slot backend's pinned slabs (CUDA's store, inline on the CPU) and held tensors (no read-ahead) carry the
    quantised payloads and dequantise them when a block is materialised, bit for bit as a resident load."""
    paths, _ = files
    with torch.no_grad():
        resident = h3_core.load_dit(paths[fmt], dtype=torch.float32)(**inputs)
        model = h3_core.load_dit(paths[fmt], dtype=torch.float32)
        recipes = [{n: model.weight_recipes[f"blocks.{i}.{n}"] for n, _ in block.named_parameters()}
                   for i, block in enumerate(model.blocks)]
        backend = AsyncBackend("cpu", read_ahead=None) if store == "pinned_slab" else SynchronousBackend(
            "cpu", read_ahead=None)
        all_resident = model.block_residency
        manager = model.block_residency = LayerwiseOffloadManager(backend).attach(model.blocks, recipes)
        assert manager.store.kind == store
        assert manager.store.host_bytes < sum(r.nbytes for unit in recipes for r in unit.values())
        assert same_outputs(model(**inputs), resident)
        manager.close()  # gives each parameter back its host tensor, dequantised on the host
        model.block_residency = all_resident
        assert same_outputs(model(**inputs), resident)


def test_memory_plan_counts_quantised_bytes(files):
    from h3_core.planning.phase_plans import _dit_estimate
    from h3_core.request.grid import LatentShape

    paths, _ = files
    shape = LatentShape.for_request(64, 64, 22)
    quantised, _, _ = _dit_estimate(paths["Q8_0"], shape, torch.bfloat16)
    plain, _, _ = _dit_estimate(paths["bf16"], shape, torch.bfloat16)
    blocks = [_stored_block_bytes(paths["Q8_0"], i) for i in range(QCFG.num_layers)]
    assert quantised.unit_sizes == tuple(blocks)  # the store, the ring and the slots hold the quantised blocks
    # One unit dequantised (bf16) beside them: the largest of the blocks and of the AdaLN projections.
    assert quantised.dequantised_unit_bytes == max(plain.unit_bytes, plain.companion_unit_bytes)
    assert quantised.companion_unit_bytes < plain.companion_unit_bytes
    assert quantised.total_bytes + quantised.dequantised_extra_bytes == plain.total_bytes  # resident: all of it


# ---- errors ----------------------------------------------------------------------------------------------------


def _rewrite(path, target, edit):
    state = load_file(path)
    edit(state)
    save_file(state, target)
    return target


def _quant_config(value: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(value).encode("utf-8")), dtype=torch.uint8)


def test_unsupported_comfy_format_names_the_tensor_and_the_format(files, tmp_path):
    paths, _ = files
    key = f"{COMFY_PREFIX}blocks.1.mlp.fc2"
    path = _rewrite(paths["float8_e4m3fn"], tmp_path / "mx.safetensors",
                    lambda s: s.__setitem__(f"{key}.comfy_quant", _quant_config({"format": "mxfp8"})))
    with pytest.raises(CheckpointError) as info:
        h3_core.load_dit(path)
    assert str(info.value).startswith(f"{path}: tensor '{key}.weight' is quantised as 'mxfp8', which h3-stream "
                                      "cannot dequantise (supported: float8_e4m3fn, float8_e5m2, int8_tensorwise, "
                                      "nvfp4, int8 ConvRot, fp8 scaled, GGUF).")
    assert info.value.key == f"{key}.weight"


def test_missing_scale_names_the_missing_key(files, tmp_path):
    paths, _ = files
    key = f"{COMFY_PREFIX}blocks.0.attn.out_proj"
    path = _rewrite(paths["nvfp4"], tmp_path / "noscale.safetensors", lambda s: s.pop(f"{key}.weight_scale_2"))
    with pytest.raises(CheckpointError) as info:
        h3_core.load_dit(path)
    assert str(info.value) == (f"{path}: tensor '{key}.weight' is quantised as 'nvfp4' but its "
                               f"'{key}.weight_scale_2' is missing; the file is incomplete or corrupt.")


def test_bare_fp8_weight_without_its_scale_is_refused(files, tmp_path):
    paths, _ = files
    key = f"{COMFY_PREFIX}blocks.0.mlp.fc2.weight"
    path = _rewrite(paths["bf16"], tmp_path / "bare.safetensors",
                    lambda s: s.__setitem__(key, s[key].to(torch.float8_e4m3fn)))
    with pytest.raises(CheckpointError) as info:
        h3_core.load_dit(path)
    assert str(info.value).startswith(f"{path}: tensor '{key}' has dtype float8_e4m3fn; H3 transformer weights must "
                                      "be bf16, fp16 or fp32; another dtype is read only as a quantised layer in a "
                                      "ComfyUI format")


def test_unsupported_gguf_type_names_the_tensor_and_the_type(tmp_path, state):
    import gguf
    import numpy as np

    path = tmp_path / "q8_1.gguf"
    writer = gguf.GGUFWriter(str(path), "minimax_h3")
    for name, value in state.items():
        if name == "rope.inv_freq":
            continue
        if name == "blocks.0.mlp.fc2.weight":  # Q8_1, which gguf's dequantize does not implement
            rows, cols = value.shape
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
            writer.add_tensor(name, np.zeros((rows, cols // block * size), dtype=np.uint8),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            writer.add_tensor(name, value.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError) as info:
        h3_core.load_dit(path)
    assert str(info.value).startswith(f"{path}: tensor 'blocks.0.mlp.fc2.weight' has GGUF type Q8_1, which the gguf "
                                      "package cannot dequantise")


def test_corrupt_gguf_file_is_one_clear_error(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(CheckpointError) as info:
        h3_core.load_dit(path)
    assert str(info.value).startswith(f"{path}: cannot read it as a GGUF file (")


@pytest.mark.parametrize("fmt, module", [("int8_rowwise", "comfy_kitchen"), ("Q8_0", "gguf")])
def test_missing_quant_extra_is_named(files, monkeypatch, fmt, module):
    paths, _ = files
    for name in list(sys.modules):
        if name == module or name.startswith(module + "."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    with pytest.raises(CheckpointError) as info:
        h3_core.load_dit(paths[fmt])
    assert "pip install 'h3-stream[quant]'" in str(info.value)
    assert str(info.value).startswith(f"{paths[fmt]}: ")


# ---- python -m h3_core quantize -------------------------------------------------------------------------------------

QUANTIZE_OUTPUT = {"fp8": "out.safetensors", "int8": "out.safetensors", "q8_0": "out.gguf", "q6_k": "out.gguf",
                   "q4_k": "out.gguf"}
# q6_k / q4_k: measured 0.026 / 0.086 on this tiny random model (~1.5x headroom; per weight 0.018 / 0.072,
# test_kquants.py)
QUANTIZE_TOLERANCE = {"fp8": 0.05, "int8": 0.015, "q8_0": 0.01, "q6_k": 0.04, "q4_k": 0.13}


def _reference_quantise(value: torch.Tensor, fmt: str) -> torch.Tensor:
    """The reference libraries' quantise-then-dequantise of one weight, in fp32."""
    if fmt in ("q8_0", "q6_k", "q4_k"):
        import gguf

        if fmt in ("q6_k", "q4_k"):  # gguf cannot make K-quants: our bytes, gguf's decoder (tests/test_kquants.py)
            from h3_core.checkpoints.kquants import quantize_q4_k, quantize_q6_k

            qtype = gguf.GGMLQuantizationType[fmt.upper()]
            blocks = (quantize_q4_k if fmt == "q4_k" else quantize_q6_k)(value).numpy()
        else:
            qtype = gguf.GGMLQuantizationType.Q8_0
            blocks = gguf.quants.quantize(value.float().numpy(), qtype)
        return torch.from_numpy(gguf.quants.dequantize(blocks, qtype)).reshape(value.shape)
    from comfy_kitchen.tensor import QuantizedTensor

    if fmt == "fp8":
        qt = QuantizedTensor.from_float(value.float(), "TensorCoreFP8Layout", dtype=torch.float8_e4m3fn)
    else:
        qt = QuantizedTensor.from_float(value.float(), "TensorWiseINT8Layout", per_channel=True)
    return reference_dequantised(qt, torch.float32)


@pytest.mark.parametrize("fmt", ["fp8", "int8", "q8_0", "q6_k", "q4_k"])
def test_quantize_round_trip(files, state, inputs, tmp_path, monkeypatch, fmt, capsys):
    import weakref

    from h3_core.app.cli import main
    from h3_core.runtime.host_store import HostTensor

    paths, _ = files
    made, alive_at_call = [], []
    original = HostTensor.private_value

    def tracked(self, reader):  # how many parameters read before are still alive when the next is read
        alive_at_call.append(sum(ref() is not None for ref in made))
        value = original(self, reader)
        made.append(weakref.ref(value))
        return value

    monkeypatch.setattr(HostTensor, "private_value", tracked)
    target = tmp_path / QUANTIZE_OUTPUT[fmt]
    assert main(["quantize", str(paths["bf16"]), str(target), "--format", fmt]) == 0
    monkeypatch.setattr(HostTensor, "private_value", original)
    assert f"wrote {target}" in capsys.readouterr().out
    assert max(alive_at_call) == 0 and len(made) == len(state) - 1  # one parameter at a time (rope recomputed)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")) == []  # no staging left
    if fmt not in ("q8_0", "q6_k", "q4_k"):  # the safetensors library reads the file as written
        from safetensors.torch import load_file as reference_load

        stored = reference_load(target)
        assert stored[f"{COMFY_PREFIX}blocks.0.mlp.fc2.weight"].dtype == (torch.float8_e4m3fn if fmt == "fp8"
                                                                          else torch.int8)
        assert json.loads(bytes(stored[f"{COMFY_PREFIX}blocks.0.mlp.fc2.comfy_quant"].tolist()))["format"] == (
            "float8_e4m3fn" if fmt == "fp8" else "int8_tensorwise")
        # ComfyUI's model detection reads the RoPE table's length (tests/comfy_double/verify_quantized.py loads the
        # written files with core's UNETLoader): it is written as the release ships it, in fp32.
        assert torch.equal(stored[f"{COMFY_PREFIX}rope.inv_freq"], state["rope.inv_freq"].float())
    params = _params(h3_core.load_dit(target, dtype=torch.float32))
    for name, value in state.items():
        if name == "rope.inv_freq":
            continue
        expected = _reference_quantise(value, fmt) if quantised_layer(name, value) else value.float()
        assert torch.equal(params[name], expected), name
    with torch.no_grad():
        reference = h3_core.load_dit(paths["bf16"], dtype=torch.float32)(**inputs)
        got = h3_core.load_dit(target, dtype=torch.float32)(**inputs)
    assert all(rel_l2(a, b) <= QUANTIZE_TOLERANCE[fmt] for a, b in zip(got, reference))


@pytest.mark.parametrize("argv, message", [
    (["SRC", "{tmp}/out.safetensors", "--format", "q8_0"], "{tmp}/out.safetensors: a q8_0 file is written as .gguf; "
                                                           "name the output 'out.gguf'."),
    (["SRC", "{tmp}/missing/out.gguf", "--format", "q8_0"], "{tmp}/missing/out.gguf: the folder {tmp}/missing does "
                                                            "not exist; create it first."),
    (["QUANTISED", "{tmp}/out.gguf", "--format", "q8_0"], "QUANTISED: is already quantised ("),
])
def test_quantize_refuses_bad_arguments_with_one_message(files, tmp_path, capsys, argv, message):
    from h3_core.app.cli import main

    paths, _ = files
    names = {"SRC": str(paths["bf16"]), "QUANTISED": str(paths["int8_rowwise"]), "{tmp}": str(tmp_path)}

    def fill(text):
        for key, value in names.items():
            text = text.replace(key, value)
        return text

    assert main(["quantize"] + [fill(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + fill(message)) and "Traceback" not in err
    assert not any(tmp_path.iterdir())


def test_quantise_api_names_an_unknown_format(files, tmp_path):
    from h3_core.checkpoints.quantiser import quantise_checkpoint
    from h3_core.errors import H3Error

    paths, _ = files
    with pytest.raises(H3Error) as info:
        quantise_checkpoint(paths["bf16"], tmp_path / "out.gguf", "q5_k")
    assert str(info.value) == ("format='q5_k' is not a quantisation h3-stream writes; use one of fp8, int8, q8_0, "
                               "q6_k, q4_k.")
