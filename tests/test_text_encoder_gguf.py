"""GGUF Qwen3-VL text encoders in the published llama.cpp layout (a `qwen3vl` language file and its `clip` /
`qwen3vl_merger` mmproj), against `transformers.Qwen3VLForConditionalGeneration` (tiny random config, fp32).

The files are written here by gguf's own `GGUFWriter`, with gguf's own `quantize` (Q8_0) or random valid K-quant
blocks (Q4_K / Q5_K / Q6_K: gguf has no K-quant quantiser), named from the reference's state dict through gguf's
own tables (`get_tensor_name_map`, `TENSOR_NAMES`) and the special cases of llama.cpp's `Qwen3VLVisionModel`
converter (the split patch embedding, `mm.0` / `mm.2` / `v.post_ln`, `v.deepstack.<vision layer>`), never through
`h3_core`'s name map. The reference runs on gguf's own dequantisation of the same files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from quant_fixtures import _random_k_blocks
from text_encoder_fixtures import IMAGE_PAD_ID, TINY_TEXT_CONFIG, TINY_VISION_CONFIG, reference_image_processor, \
    reference_states, relative_l2

from h3_core import load_text_encoder
from h3_core.checkpoints.text_encoder_gguf import gguf_kind, vision_missing
from h3_core.checkpoints.text_encoder_loader import resolve_text_encoder_checkpoint
from h3_core.errors import CheckpointError, H3Error
from h3_core.sources.tiny_default import write_tiny_tokenizer

gguf = pytest.importorskip("gguf")

STORED_LAYERS = 3  # the file holds one decoder layer more than is read, and output_norm / output
LAYER = 2
BOUND = 2e-2  # the bound at the output; what is measured is far below it (the same weights)
FORMATS = ["Q8_0", "Q4_K", "Q5_K", "Q6_K"]
PROMPT = "A red fox runs across a snowy field at dawn."
# Widths the K-quants accept: every quantised row a multiple of 256.
TEXT = {**TINY_TEXT_CONFIG, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": STORED_LAYERS,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [12, 10, 10],
                            "mrope_interleaved": True}}
VISION = {**TINY_VISION_CONFIG, "hidden_size": 256, "intermediate_size": 512, "num_heads": 4, "out_hidden_size": 256,
          "deepstack_visual_indexes": [0, 2]}
MEASURED: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def picture(width: int, height: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def make_reference(seed: int = 0):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=TEXT, vision_config=VISION)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim == 1 and "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif param.ndim == 1:
                param.copy_(0.1 * noise)
            elif "embed_tokens" in name or "pos_embed" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / param[0].numel() ** 0.5)
    return model


# ---- the published files, by gguf's tables and llama.cpp's converter rules ---------------------------------------------


def published(hf_key: str, value: torch.Tensor) -> list[tuple[str, str, torch.Tensor]]:
    """(file, GGUF name, tensor) of one reference tensor, as `convert_hf_to_gguf.py` names it."""
    names, tensor_type = gguf.TENSOR_NAMES, gguf.MODEL_TENSOR
    if hf_key.startswith("model.language_model.") or hf_key == "lm_head.weight":
        key = "model." + hf_key[len("model.language_model."):] if hf_key.startswith("model.") else hf_key
        name = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3VL, STORED_LAYERS).get_name(
            key, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_key
        return [("text", name, value)]
    key = "visual." + hf_key[len("model.visual."):]
    parts = key.split(".")
    if parts[1] == "deepstack_merger_list":
        kind = {"norm": tensor_type.V_DS_NORM, "linear_fc1": tensor_type.V_DS_FC1,
                "linear_fc2": tensor_type.V_DS_FC2}[parts[3]]
        bid = VISION["deepstack_visual_indexes"][int(parts[2])]  # the vision layer it taps
        return [("mmproj", names[kind].format(bid=bid) + "." + parts[4], value)]
    if parts[1] == "merger":
        if parts[2] == "norm":
            return [("mmproj", names[tensor_type.V_POST_NORM] + "." + parts[3], value)]
        bid = {"linear_fc1": 0, "linear_fc2": 2}[parts[2]]
        return [("mmproj", names[tensor_type.V_MMPROJ].format(bid=bid) + "." + parts[3], value)]
    if key == "visual.patch_embed.proj.weight":
        patch = names[tensor_type.V_ENC_EMBD_PATCH]
        return [("mmproj", patch + ".weight", value[:, :, 0]), ("mmproj", patch + ".weight.1", value[:, :, 1])]
    name = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, VISION["depth"]).get_name(
        key, try_suffixes=(".weight", ".bias"))
    assert name is not None, hf_key
    return [("mmproj", name, value)]


def _quantised(name: str, array: np.ndarray, fmt: str, seed: int):
    """(data, raw_dtype) as the published files store it: 2-D matrices quantised (not the patch or position
    embeddings, which llama.cpp keeps in float), the rest F32."""
    qtype = gguf.GGMLQuantizationType[fmt]
    if array.ndim != 2 or "patch_embd" in name or "position_embd" in name:
        return np.ascontiguousarray(array, dtype=np.float32), None
    if fmt in ("Q4_K", "Q5_K", "Q6_K"):
        return _random_k_blocks(qtype, array.shape, seed), qtype
    return gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), qtype), qtype


def write_files(reference, folder: Path, fmt: str, *, text_name: str = "Qwen3-VL-Tiny-Instruct-{fmt}.gguf",
                drop: tuple[str, ...] = (), mmproj: bool = True, arch: str = "qwen3vl"):
    """The language file (`arch`) and the mmproj, with gguf's writer, and the H3 tokenizer beside them; returns
    their paths and {reference key: [(file, GGUF name)]}."""
    folder.mkdir(parents=True, exist_ok=True)
    text_path = folder / text_name.format(fmt=fmt)
    mmproj_path = folder / f"mmproj-Qwen3-VL-Tiny-Instruct-{fmt}.gguf"
    writers = {"text": gguf.GGUFWriter(str(text_path), arch)}
    w = writers["text"]
    w.add_block_count(STORED_LAYERS)
    w.add_context_length(262144)
    w.add_embedding_length(TEXT["hidden_size"])
    w.add_feed_forward_length(TEXT["intermediate_size"])
    w.add_head_count(TEXT["num_attention_heads"])
    w.add_head_count_kv(TEXT["num_key_value_heads"])
    w.add_key_length(TEXT["head_dim"])
    w.add_value_length(TEXT["head_dim"])
    w.add_rope_freq_base(TEXT["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(TEXT["rms_norm_eps"])
    w.add_rope_dimension_sections([*TEXT["rope_parameters"]["mrope_section"], 0])
    w.add_num_deepstack_layers(len(VISION["deepstack_visual_indexes"]))
    if mmproj:
        writers["mmproj"] = m = gguf.GGUFWriter(str(mmproj_path), "clip")
        m.add_type(gguf.GGUFType.MMPROJ)
        m.add_clip_has_vision_encoder(True)
        m.add_vision_projection_dim(TEXT["hidden_size"])
        m.add_vision_image_size(int(VISION["num_position_embeddings"] ** 0.5) * VISION["patch_size"])
        m.add_vision_patch_size(VISION["patch_size"])
        m.add_vision_embedding_length(VISION["hidden_size"])
        m.add_vision_feed_forward_length(VISION["intermediate_size"])
        m.add_vision_block_count(VISION["depth"])
        m.add_vision_head_count(VISION["num_heads"])
        m.add_vision_image_mean([0.5, 0.5, 0.5])
        m.add_vision_image_std([0.5, 0.5, 0.5])
        m.add_clip_projector_type(gguf.VisionProjectorType.QWEN3VL)
        m.add_vision_use_gelu(True)
        m.add_vision_spatial_merge_size(VISION["spatial_merge_size"])
        m.add_vision_attention_layernorm_eps(TEXT["rms_norm_eps"])
        m.add_vision_is_deepstack_layers([i in VISION["deepstack_visual_indexes"] for i in range(VISION["depth"])])
    sources: dict[str, list[tuple[str, str]]] = {}
    for index, (hf_key, value) in enumerate(reference.state_dict().items()):
        for file, name, tensor in published(hf_key, value.detach().float()):
            sources.setdefault(hf_key, []).append((file, name))
            if name in drop or file not in writers:
                continue
            data, raw_dtype = _quantised(name, tensor.numpy(), fmt, index)
            writers[file].add_tensor(name, data, raw_dtype=raw_dtype)
    for writer in writers.values():
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    write_tiny_tokenizer(folder / "tokenizer.json")
    return text_path, (mmproj_path if mmproj else None), sources


def gguf_dequantised(paths, sources) -> dict[str, torch.Tensor]:
    """The reference's state dict rebuilt from gguf's own reader and `dequantize` of the files (fp32)."""
    stored = {}
    for path in paths:
        for t in gguf.GGUFReader(str(path)).tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            stored[t.name] = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).reshape(shape)
    state = {}
    for hf_key, places in sources.items():
        if all(name in stored for _, name in places):
            parts = [stored[name] for _, name in places]
            state[hf_key] = torch.stack(parts, dim=2) if len(parts) > 1 else parts[0]
    return state


def reference_on(reference, state):
    """A copy of the reference model holding `state` (gguf's dequantised weights)."""
    import copy

    model = copy.deepcopy(reference)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("model.visual.") for k in missing) or not missing, missing
    return model.eval()


def ours_to_hf(name: str) -> str:
    head, _, rest = name.partition(".")
    return ("model.language_model." if head == "language_model" else "model.visual.") + rest


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("gguf_te")
    reference = make_reference()
    return dict(root=root, reference=reference, files={})


def bf16_reference(setup):
    """The reference with its weights rounded to bf16 (the release's dtype), computing in fp32."""
    if "bf16" not in setup:
        import copy

        model = copy.deepcopy(setup["reference"])
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(torch.bfloat16).float())
        setup["bf16"] = model
    return setup["bf16"]


def files_of(setup, fmt: str):
    if fmt not in setup["files"]:
        text, mmproj, sources = write_files(setup["reference"], setup["root"] / fmt, fmt)
        state = gguf_dequantised([text, mmproj], sources)
        setup["files"][fmt] = dict(text=text, mmproj=mmproj, sources=sources, state=state,
                                   dequantised=reference_on(setup["reference"], state),
                                   encoder=load_text_encoder(text, layer=LAYER, dtype=torch.float32))
    return setup["files"][fmt]


def prompt_ids(encoder, prompt: str, images=()) -> tuple[list[int], list]:
    from h3_core.models.vision_tower import prepare_image

    prepared = [prepare_image(image, encoder.image_processor, index=i + 1) for i, image in enumerate(images)]
    presentation = encoder.tokenizer.present(prompt, [p.num_tokens for p in prepared])
    return presentation.token_ids, prepared


# ---- parity ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantised_weights_equal_gguf_bit_for_bit(setup, fmt):
    files = files_of(setup, fmt)
    encoder, state = files["encoder"], files["state"]
    names = [name for name, _ in encoder.named_parameters()]
    assert any(".layers.1." in n for n in names) and not any(".layers.2." in n for n in names)
    assert any(n.startswith("vision_tower.deepstack_merger_list.1.") for n in names)
    for name, param in encoder.named_parameters():
        expected = state[ours_to_hf(name)]
        assert param.dtype == torch.float32 and torch.equal(param.detach(), expected), name
    ckpt = resolve_text_encoder_checkpoint(files["text"], LAYER)
    assert ckpt.layout == "gguf" and ckpt.defaults["mmproj"] == files["mmproj"]
    assert ckpt.quantised["blk.0.attn_q.weight"].format == f"gguf {fmt}"
    assert ckpt.quantised["v.blk.0.attn_qkv.weight"].format == f"gguf {fmt}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_text_output_matches_the_reference_on_gguf_weights(setup, fmt):
    files = files_of(setup, fmt)
    states, tags = files["encoder"].encode(PROMPT)
    ids, _ = prompt_ids(files["encoder"], PROMPT)
    expected = reference_states(files["dequantised"], ids, LAYER)
    error = relative_l2(states, expected)
    assert states.shape == expected.shape and error <= BOUND
    assert error < 1e-4  # the same weights: only summation order differs
    if fmt == "Q8_0":  # gguf quantises Q8_0 itself: its error against the bf16 weights (fp32 compute)
        bf16 = bf16_reference(setup)
        MEASURED[fmt] = relative_l2(states, reference_states(bf16, ids, LAYER))
        rounding = relative_l2(reference_states(bf16, ids, LAYER), reference_states(setup["reference"], ids, LAYER))
        print(f"\nQ8_0 quantisation error at the encoder's output (relative L2 vs the bf16 weights, fp32 compute): "
              f"{MEASURED[fmt]:.3e}; bf16 rounding itself vs fp32: {rounding:.3e}")
        assert 0 < MEASURED[fmt] < BOUND


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K"])
def test_keyframe_output_matches_the_reference(setup, fmt):
    files = files_of(setup, fmt)
    encoder = files["encoder"]
    image = picture(96, 64, seed=1)
    states, tags = encoder.encode("a fox in the snow", images=[image])
    ids, _ = prompt_ids(encoder, "a fox in the snow", [image])
    processed = reference_image_processor()(images=[image], return_tensors="pt")
    expected = reference_states(files["dequantised"], ids, LAYER, processed["pixel_values"],
                                processed["image_grid_thw"])
    assert IMAGE_PAD_ID in ids and 0 in tags.tolist()
    assert relative_l2(states, expected) < 1e-4 <= BOUND
    if fmt == "Q8_0":
        unquantised = reference_states(bf16_reference(setup), ids, LAYER, processed["pixel_values"],
                                       processed["image_grid_thw"])
        print(f"\nQ8_0 quantisation error with a keyframe (relative L2 vs the bf16 weights, fp32 compute): "
              f"{relative_l2(states, unquantised):.3e}")


def test_layerwise_equals_resident_bit_for_bit(setup):
    files = files_of(setup, "Q4_K")
    layerwise = load_text_encoder(files["text"], layer=LAYER, dtype=torch.float32, residency="layerwise")
    image = picture(64, 64, seed=2)
    for images in ((), [image]):
        expected = files["encoder"].encode(PROMPT, images=images)[0]
        assert torch.equal(layerwise.encode(PROMPT, images=images)[0], expected)
    layerwise.close()


# ---- without an mmproj -----------------------------------------------------------------------------------------------


def test_text_only_without_an_mmproj(setup, tmp_path):
    files = files_of(setup, "Q8_0")
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(files["text"], alone / "qwen3vl-lang.gguf")
    shutil.copy(files["text"].parent / "tokenizer.json", alone / "tokenizer.json")
    message = vision_missing(alone / "qwen3vl-lang.gguf")
    assert "qwen3vl-lang.gguf" in message and "mmproj" in message
    assert vision_missing(files["text"]) is None
    encoder = load_text_encoder(alone / "qwen3vl-lang.gguf", layer=LAYER, dtype=torch.float32)
    assert encoder.vision_tower is None
    assert torch.equal(encoder.encode(PROMPT)[0], files["encoder"].encode(PROMPT)[0])
    for call in (lambda: encoder.encode("x", images=[picture(64, 64, 3)]),
                 lambda: encoder.encode_references("x", [("image", picture(64, 64, 3))])):
        with pytest.raises(H3Error) as caught:
            call()
        text = str(caught.value)
        assert "qwen3vl-lang.gguf" in text and "mmproj-*.gguf" in text and "same folder" in text
    # vision=False reads text only even with the mmproj beside it
    assert load_text_encoder(files["text"], layer=LAYER, vision=False).vision_tower is None


def test_the_mmproj_named_like_the_language_file_is_chosen(setup, tmp_path):
    files = files_of(setup, "Q8_0")
    folder = tmp_path / "two"
    folder.mkdir()
    shutil.copy(files["text"], folder / "Qwen3-VL-Tiny-Q8_0.gguf")
    shutil.copy(files["mmproj"], folder / "mmproj-Other-Model-F16.gguf")
    shutil.copy(files["mmproj"], folder / "mmproj-Qwen3-VL-Tiny-F16.gguf")
    ckpt = resolve_text_encoder_checkpoint(folder / "Qwen3-VL-Tiny-Q8_0.gguf", LAYER)
    assert ckpt.defaults["mmproj"] == folder / "mmproj-Qwen3-VL-Tiny-F16.gguf"
    explicit = resolve_text_encoder_checkpoint(folder / "Qwen3-VL-Tiny-Q8_0.gguf", LAYER,
                                               vision=folder / "mmproj-Other-Model-F16.gguf")
    assert explicit.defaults["mmproj"] == folder / "mmproj-Other-Model-F16.gguf"


# ---- errors ----------------------------------------------------------------------------------------------------------


def test_an_mmproj_is_not_a_text_encoder(setup):
    files = files_of(setup, "Q8_0")
    assert (gguf_kind(files["text"]), gguf_kind(files["mmproj"])) == ("text", "mmproj")
    with pytest.raises(CheckpointError) as caught:
        resolve_text_encoder_checkpoint(files["mmproj"], LAYER)
    assert "vision projector" in str(caught.value) and "'qwen3vl'" in str(caught.value)


def test_another_architecture_is_refused(setup, tmp_path):
    text, _, _ = write_files(setup["reference"], tmp_path / "llama", "Q8_0", mmproj=False, arch="llama")
    assert gguf_kind(text) == "other"
    with pytest.raises(CheckpointError) as caught:
        load_text_encoder(text, layer=LAYER)
    assert "'llama'" in str(caught.value) and "'qwen3vl'" in str(caught.value)


def test_missing_layers(setup):
    files = files_of(setup, "Q8_0")
    with pytest.raises(CheckpointError) as caught:
        load_text_encoder(files["text"], layer=STORED_LAYERS + 1)
    assert f"holds {STORED_LAYERS} decoder layers" in str(caught.value)
    assert f"layer={STORED_LAYERS + 1}" in str(caught.value)


@pytest.mark.parametrize("dropped", ["blk.1.ffn_up.weight", "v.deepstack.2.fc1.weight"])
def test_missing_tensor(setup, tmp_path, dropped):
    text, mmproj, _ = write_files(setup["reference"], tmp_path / "holes", "Q8_0", drop=(dropped,))
    with pytest.raises(CheckpointError) as caught:
        load_text_encoder(text, layer=LAYER)
    owner = mmproj if dropped.startswith("v.") else text
    assert f"missing tensor '{dropped}'" in str(caught.value) and str(owner) in str(caught.value)


def test_tensors_past_the_layer_are_ignored(setup):
    files = files_of(setup, "Q8_0")
    ckpt = resolve_text_encoder_checkpoint(files["text"], LAYER)
    assert {"output_norm.weight", "output.weight", "blk.2.attn_q.weight"} <= ckpt.allowed_extra
    assert not any(k.startswith("blk.2.") for spec in ckpt.specs for k in spec.keys)


# ---- planning --------------------------------------------------------------------------------------------------------


def test_the_plan_counts_the_stored_bytes(setup):
    from h3_core.planning.phase_plans import _text_encoder_estimate

    files = files_of(setup, "Q4_K")
    reader = gguf.GGUFReader(str(files["text"]))
    stored = {t.name: int(t.n_bytes) for t in reader.tensors}
    estimate = _text_encoder_estimate(files["text"], LAYER)
    per_layer = [sum(n for k, n in stored.items() if k.startswith(f"blk.{i}.")) for i in range(LAYER)]
    assert list(estimate.unit_sizes) == per_layer
    bf16 = sum(2 * p.numel() for n, p in files["encoder"].named_parameters() if ".layers." in n)
    assert sum(per_layer) < bf16 / 3  # Q4_K: 4.5 bits per weight of the matrices


# ---- the writing interface (the quantiser's) and the surfaces ----------------------------------------------------------


def test_published_names_are_gguf_and_llama_cpp_names(setup):
    """`published_tensors` (what the quantiser writes) names every tensor as the converter above does from gguf's
    tables, with the same logical values (the patch embedding split included)."""
    from h3_core.checkpoints.text_encoder_gguf import published_tensors
    from h3_core.models.text_encoder import TextEncoderConfig

    reference = setup["reference"]
    config = TextEncoderConfig.from_hf_dict(reference.config.to_dict())
    state = reference.state_dict()
    expected = {}
    for hf_key, value in state.items():
        for file, name, tensor in published(hf_key, value):
            expected[(file, name)] = tensor
    ours = {}
    for t in published_tensors(config, STORED_LAYERS):
        ours[(t.file, t.name)] = t.make(*[state[ours_to_hf(s)] for s in t.sources])
        assert tuple(ours[(t.file, t.name)].shape) == t.shape
    assert set(expected) - set(ours) == {("text", "output_norm.weight"), ("text", "output.weight")}
    assert set(ours) <= set(expected)
    for key, tensor in ours.items():
        assert torch.equal(tensor, expected[key]), key


def write_with_interface(encoder_source, folder: Path, *, mmproj: bool, layer: int) -> Path:
    """A GGUF pair written with `published_tensors` / `text_metadata` / `mmproj_metadata` (F32) from a loaded
    encoder: what the quantiser does."""
    from h3_core.checkpoints.text_encoder_gguf import (MMPROJ_ARCH, TEXT_ARCH, add_metadata, mmproj_metadata,
                                                        published_tensors, text_metadata)
    from h3_core.models.vision_tower import ImageProcessorConfig

    encoder = load_text_encoder(encoder_source, layer=layer, dtype=torch.float32)
    ours = dict(encoder.named_parameters())
    folder.mkdir(parents=True, exist_ok=True)
    text_path = folder / "tiny-qwen3vl-F32.gguf"
    files = [("text", TEXT_ARCH, text_path, text_metadata(encoder.config, layer))]
    if mmproj:
        files.append(("mmproj", MMPROJ_ARCH, folder / "mmproj-tiny-qwen3vl-F32.gguf",
                      mmproj_metadata(encoder.config, ImageProcessorConfig())))
    tensors = published_tensors(encoder.config, layer)
    for file, arch, path, metadata in files:
        writer = gguf.GGUFWriter(str(path), arch)
        add_metadata(writer, metadata)
        for t in tensors:
            if t.file == file:
                writer.add_tensor(t.name, t.make(*[ours[s].detach() for s in t.sources]).numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    write_tiny_tokenizer(folder / "tokenizer.json")
    return text_path


def test_files_written_with_the_interface_load_and_match_the_pipeline(tiny, tmp_path):
    """The tiny default model's text encoder written as GGUF by the interface: the encoder on it equals the one on
    the official folder bit for bit (text and keyframe); in a pipeline without the mmproj, a keyframe is refused
    before the text encoder loads, and a text prompt encodes."""
    from h3_core.pipeline.pipeline import H3Pipeline
    from h3_core.sources import resolve_model

    sources = resolve_model(tiny)
    layer = sources.text_encoder_layer
    official = load_text_encoder(sources.text_encoder, tokenizer=sources.tokenizer, layer=layer, dtype=torch.float32)
    both = write_with_interface(sources.text_encoder, tmp_path / "both", mmproj=True, layer=layer)
    alone = write_with_interface(sources.text_encoder, tmp_path / "alone", mmproj=False, layer=layer)
    encoder = load_text_encoder(both, layer=layer, dtype=torch.float32)
    image = picture(64, 96, seed=4)
    for images in ((), [image]):
        assert torch.equal(encoder.encode(PROMPT, images=images)[0], official.encode(PROMPT, images=images)[0])
    pipe = H3Pipeline(sources.replace(text_encoder=alone))
    try:
        with pytest.raises(H3Error) as caught:
            pipe.encode_prompt(PROMPT, first_frame=image, width=64, height=64, num_frames=5)
        assert "tiny-qwen3vl-F32.gguf" in str(caught.value) and "mmproj" in str(caught.value)
        assert "text_encoder" not in pipe.loaded
        cond = pipe.encode_prompt(PROMPT, width=64, height=64, num_frames=5)
        assert cond.states.shape[-1] == official.config.language.hidden_size
    finally:
        pipe.release_all()


def test_comfy_models_folder_finds_a_gguf_text_encoder(setup, tmp_path):
    """A ComfyUI models folder whose text_encoders/ holds a published GGUF pair (any names): the language file is
    the text encoder, never the mmproj."""
    from h3_core.sources.model_sources import _comfy_text_encoder

    files = files_of(setup, "Q8_0")
    folder = tmp_path / "text_encoders"
    folder.mkdir()
    shutil.copy(files["mmproj"], folder / "a-mmproj.gguf")  # first by name, and still not chosen
    shutil.copy(files["text"], folder / "b-language.gguf")
    assert _comfy_text_encoder(folder) == folder / "b-language.gguf"


def test_the_loader_node_lists_language_files_not_mmproj(setup, tmp_path):
    import comfy_double

    files = files_of(setup, "Q8_0")
    comfy_double.install(tmp_path / "comfyui")
    comfy_double.load_pack()
    import folder_paths
    model_sources = comfy_double.pack_module("nodes.model_sources")
    folder = Path(folder_paths.models_dir) / "text_encoders"
    shutil.copy(files["text"], folder / "Qwen3-VL-32B-Instruct-Q4_K_M.gguf")
    shutil.copy(files["mmproj"], folder / "mmproj-Qwen3-VL-32B-Instruct-F16.gguf")
    (folder / "minimax_h3_fl2va_Q8_0.gguf").write_bytes(b"")  # not a GGUF text encoder
    choices = model_sources.text_encoder_choices()
    assert "Qwen3-VL-32B-Instruct-Q4_K_M.gguf" in choices
    assert not any("mmproj" in c or "minimax_h3_fl2va" in c for c in choices)


def test_a_published_tokenizer_section_is_stepped_over_exactly(tmp_path):
    """A published language file carries llama.cpp's tokenizer (151k tokens, types, merges): opening it reads the
    same tensors at the same offsets as gguf's own reader, without decoding every token (seconds per open)."""
    import time

    from h3_core.checkpoints.gguf_io import GGUFFile

    path = tmp_path / "with-tokenizer.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3vl")
    writer.add_embedding_length(256)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"tok{i}" for i in range(30000)])  # 151936 in the real files
    writer.add_token_types([1] * 30000)
    writer.add_token_merges([f"a{i} b{i}" for i in range(10000)])
    writer.add_rope_dimension_sections([12, 10, 10, 0])
    writer.add_tensor("token_embd.weight", np.arange(8 * 256, dtype=np.float32).reshape(8, 256))
    writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(np.ones((256, 256), np.float32),
                                                                   gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    started = time.perf_counter()
    ours = GGUFFile(path)
    elapsed = time.perf_counter() - started
    started = time.perf_counter()
    theirs = gguf.GGUFReader(str(path))
    assert elapsed < (time.perf_counter() - started) / 3  # 0.14 s against 8.6 s at the real size here
    assert ours.metadata["qwen3vl.rope.dimension_sections"] == [12, 10, 10, 0]
    assert ours.metadata["qwen3vl.embedding_length"] == 256
    assert not any(k.startswith("tokenizer.") for k in ours.metadata)
    for t in theirs.tensors:
        assert ours._entries[t.name][2] == t.data_offset and ours.nbytes(t.name) == t.n_bytes
    assert torch.equal(ours.tensor("token_embd.weight"), torch.arange(8 * 256, dtype=torch.float32).reshape(8, 256))


def test_gguf_of_the_other_components_are_told_apart(setup, tmp_path):
    """A DiT GGUF (ComfyUI-GGUF names) given as the text encoder, and the Qwen3-VL language file given as the
    transformer: one error each, saying which loader the file belongs to."""
    from h3_core.checkpoints.dit_loader import resolve_dit_checkpoint

    dit = tmp_path / "minimax_h3_fl2va_Q8_0.gguf"
    writer = gguf.GGUFWriter(str(dit), "minimax_h3")
    writer.add_tensor("blocks.0.attn.qkv_proj.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_kind(dit) == "other"
    with pytest.raises(CheckpointError) as caught:
        load_text_encoder(dit, layer=LAYER)
    assert "'minimax_h3'" in str(caught.value) and "load_dit" in str(caught.value)
    with pytest.raises(CheckpointError) as caught:
        resolve_dit_checkpoint(files_of(setup, "Q8_0")["text"])
    assert "Qwen3-VL text encoder" in str(caught.value)


def test_a_fused_qkv_file_is_refused_naming_the_tensor(tmp_path):
    path = tmp_path / "fused.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3vl")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.add_tensor("blk.0.attn_qkv.weight", np.zeros((96, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="'blk.0.attn_qkv.weight' is a fused tensor"):
        resolve_text_encoder_checkpoint(path, LAYER)
