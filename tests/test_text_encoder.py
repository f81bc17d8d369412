"""Parity of H3's text encoder with `transformers.Qwen3VLForConditionalGeneration` (tiny random config, fp32), its
three checkpoint layouts, the "upper layers are never read" guarantee, and the loader's errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from text_encoder_fixtures import (IMAGE_PAD_ID, TINY_TEXT_CONFIG, comfy_state, reference_config,
                                   reference_image_processor, reference_model, reference_states, relative_l2,
                                   write_comfy, write_official, write_partition)

from h3_core import load_text_encoder
from h3_core.checkpoints.safetensors_io import SafetensorsFile
from h3_core.errors import CheckpointError, H3Error, PickleCheckpointError
from h3_core.models.vision_tower import ImageProcessorConfig, fit_to_patch_grid, prepare_image
from h3_core.runtime.file_reads import FileReader

LAYER = 4  # of 6: the model holds more layers than the conditioning reads, as the real 50 of 64 do
TOLERANCE = 1e-5
PROMPTS = {
    "plain": "A red fox runs across a snowy field at dawn, its breath visible in the cold air.",
    "empty": "",
    "h3_tokens": "<|caption_start|>A dog barks.<|caption_end|> <d>scene</d><|cutoff|><|lyrics_start|>la la"
                 "<|lyrics_end|>",
}


def picture(width: int, height: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny models gain nothing from intra-op threads, and on a busy 2-core runner OpenMP oversubscription makes each
    # forward ~100x slower; restored after this module.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("text_encoder")
    reference = reference_model(num_layers=6, seed=0)
    official = write_official(reference, root / "official")
    partition = write_partition(reference, root / "FL2VA")
    comfy = write_comfy(reference, root / "comfy" / "qwen3vl_tiny.safetensors", keep_layers=LAYER)
    config_json = root / "tiny_config.json"
    config_json.write_text(json.dumps(reference.config.to_dict()))
    tokenizer = official / "tokenizer" / "tokenizer.json"
    encoder = load_text_encoder(official, layer=LAYER)
    return dict(root=root, reference=reference, official=official, partition=partition, comfy=comfy,
                config_json=config_json, tokenizer=tokenizer, encoder=encoder)


def reference_ids(tokenizer_path, prompt):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_path)).encode(prompt, add_special_tokens=False).ids


# ---- parity ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PROMPTS)
def test_text_parity(setup, name):
    prompt = PROMPTS[name]
    states, tags = setup["encoder"].encode(prompt)
    ids = reference_ids(setup["tokenizer"], prompt) or [151643]  # the empty prompt is one <|endoftext|>
    expected = reference_states(setup["reference"], ids, LAYER)
    assert states.shape == expected.shape == (len(ids), TINY_TEXT_CONFIG["hidden_size"])
    assert relative_l2(states, expected) <= TOLERANCE
    assert tags.tolist() == [1] * len(ids)
    if name == "h3_tokens":
        assert {151669, 151670, 151671, 151672, 151673, 151674, 151675} <= set(ids)


@pytest.mark.parametrize("layer", [1, 3])
def test_text_parity_at_other_layers(setup, layer):
    encoder = load_text_encoder(setup["official"], layer=layer)
    assert len(encoder.language_model.layers) == layer
    states, _ = encoder.encode(PROMPTS["plain"])
    expected = reference_states(setup["reference"], reference_ids(setup["tokenizer"], PROMPTS["plain"]), layer)
    assert relative_l2(states, expected) <= TOLERANCE


def _reference_keyframe_run(setup, prompt, images, layer):
    """diffusers' own FL2VA text-encoder step (`MiniMaxH3FL2VATextEncoderStep`) on the reference model: it builds
    the presentation (a `"<Picture i>: "` label and a vision block per keyframe, then the prompt) and the per-row tags
    itself, and returns `hidden_states[layer]`. Its components as the diffusers pipeline loads them: the tokenizer
    from the release's tokenizer.json, the Qwen2-VL image processor. The processor is transformers' Qwen3VLProcessor
    with only what the step reads (its image processor and pad-token ids): its constructor also builds a video
    processor, which needs torchvision."""
    from types import SimpleNamespace

    from diffusers.modular_pipelines import PipelineState
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3FL2VATextEncoderStep
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MINIMAX_H3_TEXT_TAG, MINIMAX_H3_VIDEO_TAG
    from transformers import Qwen2TokenizerFast, Qwen3VLProcessor

    tokenizer = Qwen2TokenizerFast(tokenizer_file=str(setup["tokenizer"]))
    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    processor.image_processor = reference_image_processor()
    processor.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    processor.video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    components = SimpleNamespace(tokenizer=tokenizer, processor=processor, text_encoder=setup["reference"],
                                 text_encoder_layer=layer, text_tag=MINIMAX_H3_TEXT_TAG, video_tag=MINIMAX_H3_VIDEO_TAG,
                                 _execution_device=torch.device("cpu"))
    state = PipelineState()
    state.set("prompt", prompt)
    state.set("keyframes", list(images))
    MiniMaxH3FL2VATextEncoderStep()(components, state)
    return state.get("prompt_embeds")[0], state.get("text_token_tags")


def _reference_token_ids(setup, prompt, images, monkeypatch) -> list[int]:
    """The token ids of the presentation diffusers' FL2VA step hands to the conditioner."""
    from diffusers.modular_pipelines.minimax_h3 import encoders

    seen = []
    conditioner = encoders.get_qwen3vl_prompt_embeds
    monkeypatch.setattr(encoders, "get_qwen3vl_prompt_embeds",
                        lambda encoder, processor, token_ids, *a, **k: (seen.append(list(token_ids)),
                                                                       conditioner(encoder, processor, token_ids, *a,
                                                                                   **k))[1])
    _reference_keyframe_run(setup, prompt, images, 1)
    return seen[0]


def test_keyframe_parity(setup):
    image = picture(130, 90, seed=1)
    states, tags = setup["encoder"].encode("a fox in the snow", images=[image])
    expected, expected_tags = _reference_keyframe_run(setup, "a fox in the snow", [image], LAYER)
    assert states.shape == expected.shape
    assert relative_l2(states, expected) <= TOLERANCE
    # Tags: label and prompt text, the whole vision block (start, pads, end) video, row for row as diffusers has them.
    assert tags.tolist() == expected_tags.tolist() and 0 in expected_tags.tolist()
    # The preprocessing equals the released processor's.
    processed = reference_image_processor()(images=[image], return_tensors="pt")
    prepared = prepare_image(image, setup["encoder"].image_processor)
    assert prepared.grid == tuple(processed["image_grid_thw"][0].tolist())
    assert torch.allclose(prepared.patches, processed["pixel_values"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("layer", [1, 2, LAYER])
def test_two_keyframe_parity(setup, layer):
    # Layer 1 and 2 read the stream between deep-stack injections: before, as the reference records it.
    images = [picture(300, 200, seed=2), picture(64, 250, seed=3)]
    encoder = setup["encoder"] if layer == LAYER else load_text_encoder(setup["official"], layer=layer)
    states, tags = encoder.encode("then it runs away", images=images)
    expected, expected_tags = _reference_keyframe_run(setup, "then it runs away", images, layer)
    assert relative_l2(states, expected) <= TOLERANCE
    assert tags.tolist() == expected_tags.tolist()


def test_keyframe_token_order_is_diffusers(setup, monkeypatch):
    """Labels, vision blocks and prompt in diffusers' order, token for token (the tokenizer's `present`)."""
    images = [picture(300, 200, seed=2), picture(64, 250, seed=3)]
    encoder = setup["encoder"]
    counts = [prepare_image(image, encoder.image_processor).num_tokens for image in images]
    ours = list(encoder.tokenizer.present("then it runs away", counts).token_ids)
    assert ours == _reference_token_ids(setup, "then it runs away", images, monkeypatch)


def test_image_input_types_agree(setup):
    encoder = setup["encoder"]
    image = picture(96, 160, seed=4)
    pixels = np.array(image)
    comfy_batch = torch.from_numpy(pixels).float().div(255)[None]  # ComfyUI IMAGE [1, H, W, C] in [0, 1]
    expected, _ = encoder.encode("x", images=[image])
    for variant in (pixels, comfy_batch, comfy_batch[0], [comfy_batch]):
        states, _ = encoder.encode("x", images=variant if isinstance(variant, list) else [variant])
        assert torch.equal(states, expected)
    two, tags = encoder.encode("x", images=torch.cat([comfy_batch, comfy_batch]))  # a batch is two keyframes
    assert int((tags == 0).sum()) == 2 * (int((encoder.encode("x", images=[image])[1] == 0).sum()))


def test_bf16_follows_the_reference(setup):
    encoder = load_text_encoder(setup["official"], layer=LAYER, dtype=torch.bfloat16)
    from transformers import Qwen3VLForConditionalGeneration

    # Loaded the way the reference pipeline loads it (its RoPE tables stay float32).
    reference = Qwen3VLForConditionalGeneration.from_pretrained(setup["official"] / "text_encoder",
                                                                dtype=torch.bfloat16).eval()
    states, _ = encoder.encode(PROMPTS["plain"])
    assert states.dtype == torch.bfloat16
    expected = reference_states(reference, reference_ids(setup["tokenizer"], PROMPTS["plain"]), LAYER)
    fp32 = reference_states(setup["reference"], reference_ids(setup["tokenizer"], PROMPTS["plain"]), LAYER)
    # Same bf16 roundings as the reference: far closer to it than either is to fp32.
    assert relative_l2(states, expected) <= 0.1 * relative_l2(expected, fp32)


def test_smart_resize_matches_the_reference():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    config = ImageProcessorConfig()
    for height, width in [(90, 130), (1, 150), (768, 1344), (5000, 4000), (31, 33), (1080, 1920), (48, 48)]:
        assert fit_to_patch_grid(height, width, 32, config.min_pixels, config.max_pixels) == smart_resize(
            height, width, 32, config.min_pixels, config.max_pixels)
    with pytest.raises(H3Error, match="aspect ratio"):
        fit_to_patch_grid(1, 300, 32, config.min_pixels, config.max_pixels)


# Qwen3-VL-32B-Instruct's config.json as released (transformers 4.57 dialect: rope_theta + rope_scaling).
RELEASED_CONFIG = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "image_token_id": 151655,
    "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 5120, "intermediate_size": 25600, "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text", "num_attention_heads": 64, "num_hidden_layers": 64, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                                                 "rope_type": "default"},
        "rope_theta": 5000000, "vocab_size": 151936,
    },
    "vision_config": {
        "deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
        "in_channels": 3, "intermediate_size": 4304, "model_type": "qwen3_vl", "num_heads": 16,
        "num_position_embeddings": 2304, "out_hidden_size": 5120, "patch_size": 16, "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}


def test_defaults_are_the_released_model():
    from transformers import Qwen3VLConfig

    from h3_core.models.text_encoder import TextEncoder, TextEncoderConfig

    ours = TextEncoderConfig.from_hf_dict(RELEASED_CONFIG)
    assert ours == TextEncoderConfig()  # what a ComfyUI single file (no config) assumes
    theirs = Qwen3VLConfig(**RELEASED_CONFIG)  # transformers reads the same file the same way
    text = theirs.text_config
    assert (ours.language.rope_theta, list(ours.language.mrope_section)) == (
        text.rope_parameters["rope_theta"], text.rope_parameters["mrope_section"])
    assert (ours.language.num_key_value_heads, ours.language.head_dim, ours.language.rms_norm_eps) == (
        text.num_key_value_heads, text.head_dim, text.rms_norm_eps)
    assert ours.vision.rope_theta == theirs.vision_config.rope_parameters["rope_theta"]
    with torch.device("meta"):
        model = TextEncoder(ours, 50)
    assert len(model.language_model.layers) == 50
    # 50 of 64 layers + embeddings: about 25.2B parameters, 50.4 GB in bf16 (the ComfyUI repack's size).
    language = sum(p.numel() for p in model.language_model.parameters())
    assert language == 151936 * 5120 + 50 * (2 * 5120 + 2 * 128 + 5120 * (8192 + 2 * 1024) + 8192 * 5120
                                             + 3 * 5120 * 25600)


def test_released_sizes_are_read_from_comfy_shapes():
    """The ComfyUI repack has no config: the released 32B sizes must come back from its tensor shapes alone."""
    from dataclasses import replace

    from h3_core.checkpoints.text_encoder_loader import _config_from_shapes
    from h3_core.models.text_encoder import TextEncoder, TextEncoderConfig

    with torch.device("meta"):
        model = TextEncoder(TextEncoderConfig(), 50)
    shapes = {}
    for name, param in model.named_parameters():
        key = name.replace("language_model.", "model.", 1).replace("vision_tower.", "visual.", 1)
        shapes[key] = tuple(param.shape)

    class Header(dict):  # only shapes are consulted
        def shape(self, key):
            return self[key]

    header = Header(shapes)
    derived = _config_from_shapes(Path("repack.safetensors"), {k: header for k in shapes}, "model.", "visual.", 50)
    expected = TextEncoderConfig()
    assert derived == replace(expected, language=replace(expected.language, num_hidden_layers=50))


# ---- layouts ---------------------------------------------------------------------------------------------------------


def test_layouts_agree(setup):
    image = picture(120, 100, seed=5)
    expected = setup["encoder"].encode("a quiet harbour", images=[image])[0]
    sources = {
        "official": (setup["official"] / "text_encoder", {}),
        "partition": (setup["partition"], {}),
        "comfy": (setup["comfy"], dict(tokenizer=setup["tokenizer"], config=setup["config_json"])),
    }
    for layout, (source, kwargs) in sources.items():
        encoder = load_text_encoder(source, layer=LAYER, **kwargs)
        assert encoder.checkpoint_layout == layout
        states, _ = encoder.encode("a quiet harbour", images=[image])
        assert torch.equal(states, expected), layout


def test_combined_comfy_checkpoint_prefix(setup, tmp_path):
    # A ComfyUI combined checkpoint nests the encoder under `text_encoders.qwen3vl_32b.transformer.`.
    state = {"text_encoders.qwen3vl_32b.transformer." + k: v for k, v in
             comfy_state(setup["reference"], keep_layers=LAYER + 1).items()}
    path = tmp_path / "combined.safetensors"
    save_file(state, str(path))
    encoder = _load_comfy(setup, path)
    assert torch.equal(encoder.encode(PROMPTS["plain"])[0], setup["encoder"].encode(PROMPTS["plain"])[0])


def test_comfy_single_file_reads_the_sizes_from_shapes(setup, tmp_path):
    # Without config= the fixed settings are Qwen3-VL-32B's; the tiny model's RoPE sections cannot fit them.
    with pytest.raises(CheckpointError, match="[Pp]ass config=") as info:
        load_text_encoder(setup["comfy"], tokenizer=setup["tokenizer"], layer=LAYER)
    assert info.value.path == setup["comfy"]
    # Beside the file, the tokenizer is found on its own.
    (setup["comfy"].parent / "tokenizer.json").write_bytes(setup["tokenizer"].read_bytes())
    try:
        encoder = load_text_encoder(setup["comfy"], layer=LAYER, config=setup["config_json"])
        assert encoder.tokenizer.path == setup["comfy"].parent / "tokenizer.json"
    finally:
        (setup["comfy"].parent / "tokenizer.json").unlink()


def test_upper_layers_are_never_read(setup, monkeypatch):
    read = []
    original = SafetensorsFile.tensor

    def spy(self, key):
        read.append(key)
        return original(self, key)

    monkeypatch.setattr(SafetensorsFile, "tensor", spy)
    encoder = load_text_encoder(setup["official"], layer=LAYER)
    encoder.encode(PROMPTS["plain"], images=[picture(64, 64, seed=6)])
    state_keys = set(setup["reference"].state_dict())
    needed = {k for k in state_keys if k.startswith("model.visual.") or k == "model.language_model.embed_tokens.weight"
              or any(k.startswith(f"model.language_model.layers.{i}.") for i in range(LAYER))}
    assert sorted(read) == sorted(needed)
    never = state_keys - needed
    assert any(k.startswith("model.language_model.layers.5.") for k in never) and "lm_head.weight" in never
    assert "model.language_model.norm.weight" in never
    # Resident weights are read into the process's own memory (never views of the memory map), as stored.
    key = "model.language_model.layers.0.mlp.up_proj.weight"
    owner = next(f for f in map(SafetensorsFile, encoder.checkpoint_files) if key in f)
    weight = encoder.language_model.layers[0].mlp.up_proj.weight
    assert weight.untyped_storage().nbytes() == weight.nbytes and torch.equal(weight, owner.tensor(key))


def mapped_resident_bytes(path: Path) -> int:
    """Bytes of `path` that are resident in this process's page tables (the Rss of its memory mappings)."""
    target, total, current = str(path.resolve()), 0, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                current = head[5] if len(head) > 5 else None
            elif head[0] == "Rss:" and current == target:
                total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the mapping's Rss from /proc/self/smaps")
def test_upper_layers_are_never_read_or_paged_in(setup, tmp_path, monkeypatch):
    """A ComfyUI-style file with 9 layers read at layer=1: the loader reads the used weights explicitly and nothing
    of the 8 unused layers; no page of the memory map is touched."""
    intermediate, layers = 4096, 9
    config = reference_config(num_layers=layers, vision=False).to_dict()
    config["text_config"]["intermediate_size"] = intermediate
    del config["vision_config"]  # a text-only file
    hidden = TINY_TEXT_CONFIG["hidden_size"]
    state = {"model.embed_tokens.weight": torch.randn(TINY_TEXT_CONFIG["vocab_size"], hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": torch.ones(hidden), p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": torch.randn(64, hidden) / 8,
            p + "self_attn.k_proj.weight": torch.randn(32, hidden) / 8,
            p + "self_attn.v_proj.weight": torch.randn(32, hidden) / 8,
            p + "self_attn.o_proj.weight": torch.randn(hidden, 64) / 8,
            p + "self_attn.q_norm.weight": torch.ones(16), p + "self_attn.k_norm.weight": torch.ones(16),
            p + "mlp.gate_proj.weight": torch.full((intermediate, hidden), 0.01),
            p + "mlp.up_proj.weight": torch.full((intermediate, hidden), 0.01),
            p + "mlp.down_proj.weight": torch.full((hidden, intermediate), 0.01),
        })
    path = tmp_path / "layers.safetensors"
    save_file(state, str(path))
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))
    layer_bytes = sum(v.numel() * 4 for k, v in state.items() if k.startswith("model.layers.0."))
    unused_bytes = (layers - 1) * layer_bytes

    read = []
    real_read_into = FileReader.read_into

    def counting(self, segment, target, start=0):
        read.append(target.numel() * target.element_size())
        return real_read_into(self, segment, target, start)

    monkeypatch.setattr(FileReader, "read_into", counting)
    encoder = load_text_encoder(path, tokenizer=setup["tokenizer"], config=config_path, layer=1)
    states, _ = encoder.encode("a red fox runs across a snowy field")
    assert torch.isfinite(states).all()
    assert mapped_resident_bytes(path) < 256 * 1024  # the memory map's pages are never touched
    embed_bytes = state["model.embed_tokens.weight"].numel() * 4
    # The used layer and the embedding are read whole, nothing of the unused layers (8 x 3.1 MB).
    assert sum(read) == embed_bytes + layer_bytes, (sum(read), embed_bytes, layer_bytes, unused_bytes)


# ---- errors ----------------------------------------------------------------------------------------------------------


def _comfy_variant(setup, tmp_path, edit) -> Path:
    state = comfy_state(setup["reference"], keep_layers=LAYER)
    edit(state)
    path = tmp_path / "variant.safetensors"
    save_file(state, str(path))
    return path


def _load_comfy(setup, path, layer=LAYER):
    return load_text_encoder(path, tokenizer=setup["tokenizer"], config=setup["config_json"], layer=layer)


def test_missing_key(setup, tmp_path):
    path = _comfy_variant(setup, tmp_path, lambda s: s.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="missing key 'model.layers.2.mlp.up_proj.weight'") as info:
        _load_comfy(setup, path)
    assert info.value.key == "model.layers.2.mlp.up_proj.weight" and info.value.path == path


def test_wrong_shape(setup, tmp_path):
    path = _comfy_variant(setup, tmp_path, lambda s: s.update({"visual.pos_embed.weight": torch.zeros(25, 32)}))
    with pytest.raises(CheckpointError, match=r"'vision_config.num_position_embeddings' is 16 but the weights hold 25: "
                                              r"'visual.pos_embed.weight' has shape \[25, 32\]"):
        _load_comfy(setup, path)


def test_unexpected_key(setup, tmp_path):
    path = _comfy_variant(setup, tmp_path, lambda s: s.update({"model.layers.0.self_attn.extra.weight": torch.ones(2)}))
    with pytest.raises(CheckpointError, match="unexpected key 'model.layers.0.self_attn.extra.weight'") as info:
        _load_comfy(setup, path)
    assert info.value.key == "model.layers.0.self_attn.extra.weight"


def test_too_few_layers(setup):
    with pytest.raises(CheckpointError, match=f"holds {LAYER} decoder layers.*layer={LAYER + 1}"):
        _load_comfy(setup, setup["comfy"], layer=LAYER + 1)
    with pytest.raises(H3Error, match="positive integer"):
        _load_comfy(setup, setup["comfy"], layer=0)


def test_quantised_variants_are_refused(setup, tmp_path):
    # A scale with no ComfyUI description beside it is not a layer of a known format: an unknown key.
    scale = _comfy_variant(setup, tmp_path, lambda s: s.update({"model.layers.0.mlp.up_proj.weight_scale":
                                                                     torch.ones(1)}))
    with pytest.raises(CheckpointError, match="unexpected key 'model.layers.0.mlp.up_proj.weight_scale'") as info:
        _load_comfy(setup, scale)
    assert info.value.key == "model.layers.0.mlp.up_proj.weight_scale"
    int8 = _comfy_variant(setup, tmp_path, lambda s: s.update(
        {"model.layers.1.mlp.down_proj.weight": torch.zeros(64, 96, dtype=torch.int8)}))
    with pytest.raises(CheckpointError, match="dtype int8.*bf16, fp16 or fp32; another dtype is read only as a "
                                              "quantised layer in a ComfyUI format") as info:
        _load_comfy(setup, int8)
    assert info.value.key == "model.layers.1.mlp.down_proj.weight"
    bnb = _comfy_variant(setup, tmp_path, lambda s: s.update({"model.layers.0.mlp.up_proj.weight.absmax":
                                                                   torch.ones(1)}))
    with pytest.raises(CheckpointError, match="marks a bitsandbytes / GPTQ quantised text encoder") as info:
        _load_comfy(setup, bnb)
    assert info.value.key == "model.layers.0.mlp.up_proj.weight.absmax"


@pytest.mark.parametrize("fmt", ["int8_convrot", "float8_e4m3fn", "nvfp4"])
def test_comfy_quantised_text_encoder_dequantises_as_comfy_kitchen(setup, tmp_path, fmt):
    """A ComfyUI quantised repack (int8 ConvRot, as `qwen3vl_32b_minimax_h3_int8_convrot`; fp8; NVFP4) loads with
    every quantised weight equal to comfy-kitchen's dequantisation, and streams exactly as it runs resident."""
    pytest.importorskip("comfy_kitchen")
    from quant_fixtures import kitchen_quantise, reference_dequantised

    state = comfy_state(setup["reference"], keep_layers=LAYER)
    kitchen = {}
    for key in [k for k, v in state.items() if k.startswith("model.layers.") and v.ndim == 2]:
        qt, config = kitchen_quantise(state[key].to(torch.bfloat16), fmt, convrot_group=16)
        layer = key[: -len(".weight")]
        state.update(qt.state_dict(key))
        state[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps(config).encode()), dtype=torch.uint8)
        kitchen[key] = qt
    path = tmp_path / "qwen3vl_tiny_int8_convrot.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    encoder = load_text_encoder(path, tokenizer=setup["tokenizer"], config=setup["config_json"], layer=LAYER,
                                dtype=torch.float32)
    params = dict(encoder.named_parameters())
    for key, qt in kitchen.items():
        name = next(n for n in params if n.endswith(key[len("model."):]))
        assert torch.equal(params[name], reference_dequantised(qt, torch.float32)), key
    streamed = load_text_encoder(path, tokenizer=setup["tokenizer"], config=setup["config_json"], layer=LAYER,
                                 dtype=torch.float32, residency="layerwise")
    with torch.no_grad():
        assert torch.equal(streamed.encode("a red fox")[0], encoder.encode("a red fox")[0])


def test_other_checkpoints_are_refused(setup, tmp_path):
    dit = tmp_path / "dit.safetensors"
    save_file({"blocks.0.norm1.weight": torch.ones(4)}, str(dit))
    with pytest.raises(CheckpointError, match="not a Qwen3-VL text encoder.*load_dit"):
        load_text_encoder(dit, tokenizer=setup["tokenizer"])
    pickle = tmp_path / "model.bin"
    pickle.write_bytes(b"not opened")
    with pytest.raises(PickleCheckpointError, match="pickle"):
        load_text_encoder(pickle)
    with pytest.raises(CheckpointError, match="no such file or folder"):
        load_text_encoder(tmp_path / "absent")
    folder = tmp_path / "not_qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="not a Qwen3-VL model") as info:
        load_text_encoder(folder)
    assert info.value.path == folder / "config.json"
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        load_text_encoder(setup["official"], offload=True)


def test_tokenizer_must_be_found(setup, tmp_path):
    lonely = tmp_path / "lonely" / "te.safetensors"
    lonely.parent.mkdir()
    lonely.write_bytes(setup["comfy"].read_bytes())
    with pytest.raises(CheckpointError, match="no tokenizer.json beside the model.*tokenizer=") as info:
        load_text_encoder(lonely, config=setup["config_json"], layer=LAYER)
    assert info.value.path == lonely


def test_text_only_checkpoint(setup, tmp_path):
    def drop_vision(state):
        for key in [k for k in state if k.startswith("visual.")]:
            del state[key]

    path = _comfy_variant(setup, tmp_path, drop_vision)
    encoder = _load_comfy(setup, path)
    assert encoder.vision_tower is None
    states, _ = encoder.encode(PROMPTS["plain"])
    assert torch.equal(states, setup["encoder"].encode(PROMPTS["plain"])[0])
    with pytest.raises(H3Error, match="no vision tower"):
        encoder.encode("x", images=[picture(64, 64, seed=7)])


def test_bad_images(setup):
    encoder = setup["encoder"]
    with pytest.raises(H3Error, match="image 1: expected a PIL image"):
        encoder.encode("x", images=["not an image"])
    with pytest.raises(H3Error, match=r"image 2: an array image must be uint8"):
        encoder.encode("x", images=[picture(64, 64, seed=8), np.zeros((64, 64, 3), dtype=np.float64)])
