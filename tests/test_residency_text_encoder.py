"""The text encoder under the residency manager, on the CPU used as the device.

The oracle is the resident path of the same loader on the same file: the streamed path runs the same kernels on
copies of the same weights, so states must match bit for bit. The checkpoint is a tiny random Qwen3-VL encoder
(h3_core's own modules, written in the official Hugging Face layout in bf16), so no reference library is imported.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from residency_probe import MaterialisationCensus, UnitProbe, is_materialised
from safetensors.torch import save_file

import h3_core
from h3_core.checkpoints.safetensors_io import SafetensorsFile
from h3_core.models.text_encoder import TextEncoder, TextEncoderConfig
from h3_core.runtime import AdmissionError, AllResident, PhaseScopedWeights, Residency, ResidencyError
from h3_core.sources.tiny_default import write_tiny_tokenizer

LAYERS = 5
CONFIG = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "torch_dtype": "bfloat16",
    # The real vocabulary size: the H3 tokenizer's extra tokens sit at ids 151669-151675.
    "text_config": dict(vocab_size=151936, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
                        hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                                            "mrope_section": [4, 2, 2], "mrope_interleaved": True}),
    "vision_config": dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=16,
                          temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=32,
                          num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
                          hidden_act="gelu_pytorch_tanh"),
}
PROMPT = "A red fox runs across a snowy field at dawn."


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny matrices: a second intra-op thread only adds barrier waits (costly when the CPUs are shared).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An official-layout text_encoder/ folder (bf16 weights, as released) with its tokenizer."""
    folder = tmp_path_factory.mktemp("text_encoder")
    model = TextEncoder(TextEncoderConfig.from_hf_dict(CONFIG), LAYERS)
    generator = torch.Generator().manual_seed(0)
    state = {}
    for name, p in model.named_parameters():
        if p.ndim == 1:
            value = 1.0 + 0.1 * torch.randn(p.shape, generator=generator)
        else:
            value = torch.randn(p.shape, generator=generator) / p[0].numel() ** 0.5
        prefix = "model.language_model." if name.startswith("language_model.") else "model.visual."
        state[prefix + name.split(".", 1)[1]] = value.to(torch.bfloat16)
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(CONFIG))
    write_tiny_tokenizer(folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def image():
    from PIL import Image

    return Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 56, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def reference(folder, image):
    encoder = h3_core.load_text_encoder(folder, layer=LAYERS)
    return {"text": encoder.encode(PROMPT)[0], "image": encoder.encode(PROMPT, images=[image])[0]}


def layer_parameters(encoder, index):
    return list(encoder.language_model.layers[index].parameters())


def phase_parameters(encoder):
    return [*encoder.language_model.embed_tokens.parameters(), *encoder.vision_tower.parameters()]


# ---- exactness and the residency bound ---------------------------------------------------------------------------


@pytest.mark.parametrize("resident_blocks", [None, 2])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_layerwise_equals_resident_bitwise_with_bounded_residency(folder, image, reference, prefetch,
                                                                  resident_blocks):
    encoder = h3_core.load_text_encoder(folder, layer=LAYERS, residency="layerwise", prefetch=prefetch,
                                        resident_blocks=resident_blocks)
    manager = encoder.language_model.block_residency
    assert manager.residency is Residency.LAYERWISE_OFFLOAD
    resident = set(range(resident_blocks or 0))
    probe = UnitProbe(manager, encoder.language_model.layers, lambda i: layer_parameters(encoder, i),
                      phase_parameters(encoder))
    for _ in range(2):
        assert torch.equal(encoder.encode(PROMPT)[0], reference["text"])
        assert torch.equal(encoder.encode(PROMPT, images=[image])[0], reference["image"])
        stats = manager.stats().last_pass
        assert stats.peak_streamed_blocks == min(prefetch + 1, LAYERS - len(resident))
        assert stats.loads == LAYERS - len(resident) and not stats.aborted
    assert manager.stats().passes == 4
    probe.check(prefetch, resident, passes=4)
    # Between forwards only the resident layers are on the device; the phase weights were released.
    assert {i for i in range(LAYERS) if is_materialised(layer_parameters(encoder, i))} == resident
    assert encoder.weight_phases.materialised() == ()
    assert not is_materialised(encoder.language_model.embed_tokens.parameters())


def test_host_store_is_the_memory_map_and_phases_run_only_in_their_phase(folder, image):
    encoder = h3_core.load_text_encoder(folder, layer=LAYERS, residency="layerwise")
    file = SafetensorsFile(folder / "model.safetensors")
    layer_keys = [k for k in file.keys() if k.startswith("model.language_model.layers.")]
    stats = encoder.language_model.block_residency.stats()
    # Nothing copied at load: the store reads the file's own bf16 bytes for every layer when a pass needs them (its
    # staging buffers are allocated by the first pass).
    store = encoder.language_model.block_residency.store
    assert stats.store == "staged_reads" and stats.pinned_bytes == 0 and store.staging_bytes == 0
    assert stats.host_store_bytes == sum(file.nbytes(k) for k in layer_keys)
    assert stats.streamed_blocks == tuple(range(LAYERS)) and stats.slots == 1
    # One shared bf16 placeholder for every streamed layer and one for the phase weights.
    assert len({p.data_ptr() for i in range(LAYERS) for p in layer_parameters(encoder, i)}) == 1
    assert all(p.numel() == 1 and p.dtype == torch.bfloat16 for p in phase_parameters(encoder))
    assert encoder.dtype == torch.bfloat16 and encoder.device == torch.device("cpu")
    seen = []
    encoder.language_model.embed_tokens.register_forward_pre_hook(
        lambda m, a: seen.append(("embeddings", encoder.weight_phases.materialised())))
    encoder.vision_tower.register_forward_pre_hook(
        lambda m, a: seen.append(("vision", encoder.weight_phases.materialised())))
    encoder.encode(PROMPT, images=[image])
    assert seen == [("embeddings", ("embeddings",)), ("vision", ("vision",))]
    assert encoder.weight_phases.materialised() == ()
    phases = encoder.weight_phases.stats()
    assert phases.host_store_bytes == sum(file.nbytes(k) for k in file.keys() if k not in layer_keys)


def test_a_requested_dtype_is_cast_when_a_layer_is_materialised(folder, reference):
    resident = h3_core.load_text_encoder(folder, layer=LAYERS, dtype=torch.float32)
    streamed = h3_core.load_text_encoder(folder, layer=LAYERS, dtype=torch.float32, residency="layerwise",
                                         prefetch=1, resident_blocks=[3])
    expected = resident.encode(PROMPT)[0]
    assert expected.dtype == torch.float32 and not torch.equal(expected, reference["text"].float())
    census = MaterialisationCensus(streamed.language_model.block_residency.store)
    dtypes = []
    streamed.language_model.layers[1].register_forward_pre_hook(
        lambda m, a: dtypes.append({p.dtype for p in m.parameters()}))
    for _ in range(2):
        assert torch.equal(streamed.encode(PROMPT)[0], expected)
    assert dtypes == [{torch.float32}] * 2
    stats = streamed.language_model.block_residency.stats()
    # The store keeps the file's bf16 bytes; a materialised layer is float32, twice as large.
    assert stats.host_store_bytes * 2 == sum(streamed.language_model.block_residency.store.unit_bytes(i)
                                             for i in range(LAYERS))
    assert census.live() == set()


# ---- exception safety, close() -----------------------------------------------------------------------------------


def test_an_exception_inside_a_layer_leaves_the_encoder_usable(folder, image, reference):
    encoder = h3_core.load_text_encoder(folder, layer=LAYERS, residency="layerwise", prefetch=1, resident_blocks=1)
    manager = encoder.language_model.block_residency
    failures = []

    def fail_once(module, args):
        if not failures:
            failures.append(1)
            raise RuntimeError("boom in layer 3")

    handle = encoder.language_model.layers[3].register_forward_pre_hook(fail_once)
    with pytest.raises(RuntimeError, match="boom in layer 3"):
        encoder.encode(PROMPT, images=[image])
    assert manager.stats().last_pass.aborted
    assert manager.materialised_streamed() == []
    assert {i for i in range(LAYERS) if is_materialised(layer_parameters(encoder, i))} == {0}
    assert encoder.weight_phases.materialised() == ()
    for _ in range(2):
        assert torch.equal(encoder.encode(PROMPT, images=[image])[0], reference["image"])
        assert not manager.stats().last_pass.aborted
    handle.remove()


def test_an_exception_inside_a_phase_leaves_the_encoder_usable(folder, image, reference):
    encoder = h3_core.load_text_encoder(folder, layer=LAYERS, residency="layerwise")

    def fail(module, args):
        raise RuntimeError("boom in the vision tower")

    handle = encoder.vision_tower.blocks[1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="boom in the vision tower"):
        encoder.encode(PROMPT, images=[image])
    assert encoder.weight_phases.materialised() == ()
    assert encoder.language_model.block_residency.materialised_streamed() == []
    handle.remove()
    assert torch.equal(encoder.encode(PROMPT, images=[image])[0], reference["image"])


def test_close_gives_every_parameter_its_host_tensor_back(folder, image, reference):
    encoder = h3_core.load_text_encoder(folder, layer=LAYERS, residency="layerwise", prefetch=1)
    params = dict(encoder.named_parameters())
    encoder.encode(PROMPT)
    encoder.close()
    assert isinstance(encoder.language_model.block_residency, AllResident)
    assert isinstance(encoder.weight_phases, PhaseScopedWeights) and encoder.weight_phases.names == ()
    after = dict(encoder.named_parameters())
    assert after.keys() == params.keys() and all(after[n] is p for n, p in params.items())
    assert is_materialised(encoder.parameters())
    file = SafetensorsFile(folder / "model.safetensors")
    assert torch.equal(encoder.language_model.layers[2].mlp.up_proj.weight,
                       file.tensor("model.language_model.layers.2.mlp.up_proj.weight"))
    assert torch.equal(encoder.encode(PROMPT, images=[image])[0], reference["image"])
    encoder.close()  # idempotent
    h3_core.load_text_encoder(folder, layer=LAYERS).close()  # a resident encoder has nothing to release


# ---- settings and admission ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    (dict(residency="auto"), "residency 'auto' is not one of"),
    (dict(residency="layerwise", prefetch=-1), "prefetch=-1 must be an integer >= 0"),
    (dict(residency="layerwise", resident_blocks=LAYERS + 1), f"resident_blocks={LAYERS + 1} must be between 0"),
    (dict(residency="layerwise", resident_blocks=[0, 7]), "resident_blocks lists 7"),
])
def test_bad_residency_settings_raise_one_error_naming_the_value(folder, options, message):
    with pytest.raises(ResidencyError, match=message) as info:
        h3_core.load_text_encoder(folder, layer=LAYERS, **options)
    assert isinstance(info.value, h3_core.H3Error)


def test_mps_admission_refuses_a_resident_text_encoder_before_reading_anything(tmp_path):
    for options in ({}, {"residency": "resident"}):
        with pytest.raises(AdmissionError) as info:
            h3_core.load_text_encoder(tmp_path / "missing", device="mps", **options)
        assert info.value.violations == [("text_encoder", info.value.violations[0][1], "set residency='layerwise'")]
        assert str(info.value).startswith("MPS admission refused 1 setting(s) of text_encoder:")
        assert "text_encoder: is resident" in str(info.value) and "fix: set residency='layerwise'" in str(info.value)
    # Layerwise is admitted: the next thing checked is the (missing) path.
    with pytest.raises(h3_core.CheckpointError, match="no such file or folder"):
        h3_core.load_text_encoder(tmp_path / "missing", device="mps", residency="layerwise")
