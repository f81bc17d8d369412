"""LoRAs on the H3 transformer: every published format against diffusers' own LoRA loader (peft), in all three base
checkpoint layouts; layerwise == resident bitwise; strength 0 and removal give the base model back; bad files."""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch
from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin
from safetensors.torch import save_file

import h3_core
from h3_core import CheckpointError, LoraError
from h3_core.models.dit_config import H3DiTConfig
from h3_fixtures import packed_inputs, reference_model, rel_l2, save_comfy, save_diffusers, save_native

# 128-wide heads: diffusers reads a DiffSynth file's interleaved QKV with the released head width.
CONFIG = H3DiTConfig(num_layers=2, num_refiner_layers=1, hidden_size=64, num_attention_heads=2, attention_head_dim=128,
                     ffn_dim=96, in_channels=4, audio_in_channels=8, text_dim=48, freq_dim=32, time_embed_hidden_dim=64,
                     time_embed_dim=32, rope_freq_dim=16)  # = head_dim // 8, as a ComfyUI file implies
INNER = CONFIG.inner_dim
# (module, rows, columns): attention, MLP, AdaLN, the phase-scoped refiner and condition projection, a resident head.
TARGETS = (
    ("blocks.0.attn.qkv_proj", 3 * INNER, 64),
    ("blocks.1.attn.qkv_proj", 3 * INNER, 64),
    ("blocks.0.attn.out_proj", 64, INNER),
    ("blocks.1.mlp.fc1", 2 * 96, 64),
    ("blocks.0.mlp.fc2", 64, 96),
    ("blocks.1.adaln_proj.linear", 6 * 3 * 64, 32),
    ("token_refiner.blocks.0.attn.qkv_proj", 3 * INNER, 64),
    ("token_refiner.blocks.0.mlp.fc1", 2 * 96, 64),
    ("condition_proj", 64, 48),
    ("final_layer.video_out", 16, 64),
)
RANK = 4


class ReferencePipeline(MiniMaxH3LoraLoaderMixin):
    """The smallest holder of a transformer that diffusers' MiniMax-H3 LoRA loader accepts."""

    hf_device_map = None
    components: dict = {}

    def __init__(self, transformer):
        self.transformer = transformer


@pytest.fixture(scope="module")
def reference():
    return reference_model(CONFIG, seed=3)


@pytest.fixture(scope="module")
def checkpoints(reference, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_base")
    return {
        "diffusers": save_diffusers(reference, root / "transformer"),
        "native": save_native(reference, CONFIG, root / "native"),
        "comfy": save_comfy(reference, CONFIG, root / "comfy.safetensors", prefix="model.diffusion_model."),
    }


@pytest.fixture(scope="module")
def inputs():
    return packed_inputs(CONFIG, text_len=6, latent_frames=2, latent_hw=(4, 4), audio_latents=3)


def factors(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(down [r, in], up [out, r]) per target module, in our logical row order ([q; k; v], [gate; up])."""
    g = torch.Generator().manual_seed(seed)
    return {m: (torch.randn(RANK, cols, generator=g) / cols ** 0.5, torch.randn(rows, RANK, generator=g) * 0.3)
            for m, rows, cols in TARGETS}


def interleave_qkv(up: torch.Tensor) -> torch.Tensor:
    """Logical `[q; k; v]` rows -> the raw checkpoint's per-head `[head0: q k v, head1: ...]` (what DiffSynth trains)."""
    heads, dim = CONFIG.num_attention_heads, CONFIG.attention_head_dim
    return up.reshape(3, heads, dim, -1).transpose(0, 1).reshape(3 * heads * dim, -1).contiguous()


def original_state(seed: int) -> dict[str, torch.Tensor]:
    state = {}
    for module, (down, up) in factors(seed).items():
        state[f"{module}.lora_A.weight"], state[f"{module}.lora_B.weight"] = down, up
    return state


def write_lora(path, fmt: str, seed: int):
    """One LoRA of random factors in the published format `fmt`; alphas chosen so that the scale is not 1."""
    base = factors(seed)
    state, metadata = {}, None
    if fmt in ("original", "ai-toolkit"):
        prefix = "diffusion_model." if fmt == "ai-toolkit" else ""
        state = {prefix + k: v for k, v in original_state(seed).items()}
    elif fmt == "metadata alpha":
        state, metadata = original_state(seed), {"alpha": "2"}
    elif fmt in ("kohya", "musubi"):
        for module, (down, up) in base.items():
            name = "lora_unet_" + module.replace(".", "_") if fmt == "musubi" else module
            state[f"{name}.lora_down.weight"], state[f"{name}.lora_up.weight"] = down, up
            state[f"{name}.alpha"] = torch.tensor(float(RANK) / 2)
    elif fmt == "DiffSynth":
        for module, (down, up) in base.items():
            up = interleave_qkv(up) if module.endswith("qkv_proj") else up
            state[f"{module}.lora_A.default.weight"], state[f"{module}.lora_B.default.weight"] = down, up
    elif fmt in ("diffusers", "peft dump"):
        from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_minimax_h3_lora_to_diffusers

        converted = _convert_non_diffusers_minimax_h3_lora_to_diffusers(original_state(seed))  # the reference's own
        if fmt == "peft dump":
            converted = {k.removeprefix("transformer.").replace(".lora_A.", ".lora_A.default.")
                         .replace(".lora_B.", ".lora_B.default."): v for k, v in converted.items()}
        state = converted
    elif fmt in ("peft metadata", "rsLoRA"):  # saved by diffusers itself, its peft LoraConfig in the metadata
        from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_minimax_h3_lora_to_diffusers
        from peft import LoraConfig

        layers = {k.removeprefix("transformer."): v
                  for k, v in _convert_non_diffusers_minimax_h3_lora_to_diffusers(original_state(seed)).items()}
        config = LoraConfig(r=RANK, lora_alpha=3 * RANK, use_rslora=fmt == "rsLoRA",
                            target_modules=sorted({k.rsplit(".lora_", 1)[0] for k in layers})).to_dict()
        ReferencePipeline.save_lora_weights(path.parent, weight_name=path.name, transformer_lora_layers=layers,
                                            transformer_lora_adapter_metadata=config)
        return path
    else:
        raise AssertionError(fmt)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata=metadata)
    return path


FORMATS = ("original", "ai-toolkit", "metadata alpha", "kohya", "musubi", "DiffSynth", "diffusers", "peft metadata",
           "rsLoRA", "peft dump")


def reference_output(reference, inputs, loras):
    model = copy.deepcopy(reference)
    pipe = ReferencePipeline(model)
    names = []
    for i, (path, _) in enumerate(loras):
        pipe.load_lora_weights(str(path), adapter_name=f"lora{i}")
        names.append(f"lora{i}")
    model.set_adapters(names, weights=[strength for _, strength in loras])
    with torch.no_grad():
        return model(**inputs, return_dict=False)


def our_output(source, inputs, loras, **options):
    model = h3_core.load_dit(source, loras=loras, **options)
    with torch.no_grad():
        return model(**inputs)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_matches_diffusers_in_every_base_layout(fmt, reference, checkpoints, inputs, tmp_path):
    path = write_lora(tmp_path / "lora.safetensors", fmt, seed=11)
    assert h3_core.read_lora(path, CONFIG).updates  # read and shape-checked
    want = reference_output(reference, inputs, [(path, 0.7)])
    with torch.no_grad():
        base = reference(**inputs, return_dict=False)
    assert rel_l2(want[0], base[0]) > 1e-2  # the LoRA changes the output
    for layout, source in checkpoints.items():
        got = our_output(source, inputs, [(path, 0.7)])
        for ours, theirs in zip(got, want):
            assert rel_l2(ours, theirs) <= 1e-5, (fmt, layout, rel_l2(ours, theirs))


@pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute")  # the reference's two adapters
def test_two_loras_compose_as_the_sum_of_their_deltas(reference, checkpoints, inputs, tmp_path):
    first = write_lora(tmp_path / "a.safetensors", "original", seed=1)
    second = write_lora(tmp_path / "b.safetensors", "kohya", seed=2)
    loras = [(first, 1.0), (second, -0.5)]
    want = reference_output(reference, inputs, loras)
    got = our_output(checkpoints["native"], inputs, loras)
    assert all(rel_l2(a, b) <= 1e-5 for a, b in zip(got, want))


def test_full_weight_diffs(reference, checkpoints, inputs, tmp_path):
    """`.diff` / `.diff_b` add to the weight and bias; the reference is diffusers' model with the same deltas added."""
    g = torch.Generator().manual_seed(5)
    diffs = {"blocks.0.mlp.fc2.diff": torch.randn(64, 96, generator=g) * 0.05,
             "final_layer.video_out.diff": torch.randn(16, 64, generator=g) * 0.05,
             "final_layer.video_out.diff_b": torch.randn(16, generator=g) * 0.05}
    path = tmp_path / "diff.safetensors"
    save_file(diffs, str(path))
    model = copy.deepcopy(reference)
    with torch.no_grad():
        model.transformer_blocks[0].ff.net[2].weight += diffs["blocks.0.mlp.fc2.diff"]
        model.proj_out.weight += diffs["final_layer.video_out.diff"]
        model.proj_out.bias += diffs["final_layer.video_out.diff_b"]
        want = model(**inputs, return_dict=False)
    assert h3_core.read_lora(path).format == "full-weight diff"
    for source in checkpoints.values():
        got = our_output(source, inputs, [(path, 1.0)])
        assert all(rel_l2(a, b) <= 1e-5 for a, b in zip(got, want))


def store_checksum(model) -> str:
    digest = hashlib.sha256()
    for name in sorted(model.weight_recipes):
        for source in model.weight_recipes[name].sources:
            digest.update(source.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("options", [{"residency": "layerwise"}, {"residency": "layerwise", "resident_blocks": 1},
                                     {"residency": "layerwise", "prefetch": 1}])
def test_layerwise_equals_resident_bitwise_and_leaves_the_store_untouched(checkpoints, inputs, tmp_path, options):
    path = write_lora(tmp_path / "lora.safetensors", "DiffSynth", seed=4)
    resident = our_output(checkpoints["native"], inputs, [(path, 0.8)])
    model = h3_core.load_dit(checkpoints["native"], loras=[(path, 0.8)], **options)
    before = store_checksum(model)
    for _ in range(2):  # the second pass folds into freshly loaded blocks again, not into already-folded ones
        with torch.no_grad():
            streamed = model(**inputs)
        assert all(torch.equal(a, b) for a, b in zip(streamed, resident))
    assert store_checksum(model) == before


@pytest.mark.parametrize("residency", ["resident", "layerwise"])
def test_strength_zero_and_removal_give_the_base_model_bitwise(checkpoints, inputs, tmp_path, residency):
    path = write_lora(tmp_path / "lora.safetensors", "original", seed=6)
    base = our_output(checkpoints["comfy"], inputs, [], residency=residency)
    assert all(torch.equal(a, b) for a, b in zip(our_output(checkpoints["comfy"], inputs, [(path, 0.0)],
                                                            residency=residency), base))
    model = h3_core.load_dit(checkpoints["comfy"], loras=[(path, 1.0)], residency=residency)
    with torch.no_grad():
        with_lora = model(**inputs)
    assert not torch.equal(with_lora[0], base[0])
    assert model.loras == ((path, 1.0),)
    h3_core.set_loras(model, [])
    with torch.no_grad():
        removed = model(**inputs)
    assert all(torch.equal(a, b) for a, b in zip(removed, base)) and model.loras == ()
    h3_core.set_loras(model, [(path, 1.0)])  # and back, without reloading
    with torch.no_grad():
        again = model(**inputs)
    assert all(torch.equal(a, b) for a, b in zip(again, with_lora))


def test_removing_a_lora_re_reads_the_resident_weight_as_loaded(checkpoints, tmp_path):
    """Removing a LoRA from a resident CPU model puts back exactly the loaded weight, read again from the file into
    the process's own memory (not a view of the memory map)."""
    path = write_lora(tmp_path / "lora.safetensors", "original", seed=7)
    plain = h3_core.load_dit(checkpoints["comfy"]).final_layer.video_out.weight
    model = h3_core.load_dit(checkpoints["comfy"], loras=[(path, 1.0)])
    h3_core.set_loras(model, [])
    weight = model.final_layer.video_out.weight
    assert torch.equal(weight, plain)
    assert weight.data_ptr() != model.weight_recipes["final_layer.video_out.weight"].sources[0].data_ptr()


def bad(tmp_path, state, name="bad.safetensors"):
    path = tmp_path / name
    save_file(state, str(path))
    return path


def test_bad_loras_are_one_clear_error_each(checkpoints, tmp_path):
    down, up = torch.zeros(RANK, 64), torch.zeros(3 * INNER, RANK)
    cases = [
        ({"blocks.7.attn.qkv_proj.lora_A.weight": down, "blocks.7.attn.qkv_proj.lora_B.weight": up},
         "blocks.7.attn.qkv_proj.weight', which the 2-block H3 transformer does not have"),
        ({"blocks.0.attn.qkv_proj.lora_A.weight": torch.zeros(RANK, 65), "blocks.0.attn.qkv_proj.lora_B.weight": up},
         r"the update of 'blocks.0.attn.qkv_proj.weight' has shapes .* the model needs up \[768, r\] and down \[r, 64\]"),
        ({"blocks.0.attn.qkv_proj.lora_A.weight": down}, "has no matching lora_B / lora_up tensor"),
        ({"blocks.0.attn.qkv_proj.lora_A.weight": down, "blocks.0.attn.qkv_proj.lora_B.weight": torch.zeros(9, 3)},
         "are not a rank-r pair"),
        ({"blocks.0.attn.qkv_proj.weight": up}, "is neither a LoRA pair"),
        ({"lora_unet_blocks_0_attn_qq.lora_down.weight": down, "lora_unet_blocks_0_attn_qq.lora_up.weight": up},
         "names no H3 transformer module"),
        ({"blocks.0.attn.qkv_proj.lora_A.weight": down, "blocks.0.attn.qkv_proj.lora_B.weight": up,
          "blocks.0.attn.qkv_proj.dora_scale": torch.ones(3 * INNER)}, "marks a DoRA"),
    ]
    for state, message in cases:
        path = bad(tmp_path, state)
        with pytest.raises(LoraError, match=message):
            h3_core.load_dit(checkpoints["comfy"], loras=[(path, 1.0)])
    pickle = tmp_path / "lora.pt"
    pickle.write_bytes(b"\x80\x04not really")
    with pytest.raises(CheckpointError, match="pickle"):
        h3_core.read_lora(pickle)
    with pytest.raises(LoraError, match="no such LoRA file"):
        h3_core.read_lora(tmp_path / "missing.safetensors")
    good = write_lora(tmp_path / "good.safetensors", "original", seed=1)
    with pytest.raises(LoraError, match="finite"):
        h3_core.load_dit(checkpoints["comfy"], loras=[(good, float("nan"))])
    with pytest.raises(LoraError, match=r"\(file, strength\) pairs"):
        h3_core.load_dit(checkpoints["comfy"], loras=[str(good)])


def test_any_format_can_be_inspected_without_the_model_but_only_folded_with_it(tmp_path):
    """The node and the CLI read a LoRA's format and settings before any model loads; DiffSynth's interleaved QKV
    can only be placed with the model's head count, so such a reading cannot be folded."""
    from h3_core.checkpoints.lora_loader import LoraFold

    for fmt in FORMATS:
        lora = h3_core.read_lora(write_lora(tmp_path / f"{fmt}.safetensors", fmt, seed=2))
        assert lora.updates and not lora.placed
    assert lora.format == "peft (diffusers names)"
    assert h3_core.read_lora(tmp_path / "DiffSynth.safetensors").format == "DiffSynth-Studio"
    with pytest.raises(LoraError, match="read without the model's config"):
        LoraFold([(lora, 1.0)])
    assert h3_core.read_lora(tmp_path / "DiffSynth.safetensors", CONFIG).placed


def test_recommended_settings_come_from_the_metadata(tmp_path):
    path = tmp_path / "turbo.safetensors"
    save_file(original_state(1), str(path), metadata={"steps": "8", "video_shift": "5.0"})
    lora = h3_core.read_lora(path)
    assert lora.recommended == {"steps": 9, "video_shift": 5.0} and lora.format == "original module names"  # 8 calls
    save_file(original_state(1), str(path), metadata={"steps": "eight"})
    with pytest.raises(LoraError, match="metadata 'steps' is 'eight'"):
        h3_core.read_lora(path)


def test_a_fold_in_steps_equals_one_fold(checkpoints, inputs, tmp_path, monkeypatch):
    """bf16 / fp16 weights are folded FOLD_ELEMENTS at a time (one addmm_ per step); small steps give the same
    model as one step."""
    from h3_core.checkpoints import lora_loader

    path = write_lora(tmp_path / "lora.safetensors", "diffusers", seed=8)  # with the fc1 half swap's row order
    whole = h3_core.load_dit(checkpoints["native"], loras=[(path, 1.0)], dtype=torch.bfloat16)
    monkeypatch.setattr(lora_loader, "FOLD_ELEMENTS", 7 * INNER)
    stepped = h3_core.load_dit(checkpoints["native"], loras=[(path, 1.0)], dtype=torch.bfloat16,
                               residency="layerwise")
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(stepped(**inputs), whole(**inputs)))
    fold = stepped.lora_fold
    assert fold.folds > 0 and fold.factor_bytes_moved > 0
    # The fold is in place: its temporaries are the factors of one step (out_proj: 7 rows of up, all of down, bf16)
    # and the float32 reads they are cast from (the down matrix is the larger: read, then cast beside it), or, into
    # float32 weights, the factors of one whole update (the AdaLN table's), read as they are.
    assert fold.peak_temporary_bytes(torch.bfloat16) == 2 * RANK * INNER + max(4 * RANK * INNER, (2 + 4) * 7 * RANK)
    assert fold.peak_temporary_bytes(torch.float32) == 4 * (6 * 3 * 64 * RANK + RANK * 32)
