"""The video and audio VAEs under the residency manager, on the CPU used as the device.

The oracle is the resident path of the same loader on the same file, so decodes and encodes must match bit for bit.
The checkpoints are tiny random VAEs built from h3_core's own modules and written in real layouts that make the
recipes work at materialisation: the video VAE as a ComfyUI fp16 file (upcast to float32, per-head interleaved QKV
de-interleaved), the audio VAE as a native folder with weight-norm pairs (folded). No reference library is imported.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import h3_core
from h3_core.runtime import AdmissionError
from h3_core.models.audio_vae import WEIGHT_NORM_MODULES, AudioVAE, AudioVAEConfig
from h3_core.runtime import AllResident, PhaseScopedWeights, Residency, ResidencyError
from h3_core.checkpoints.safetensors_io import SafetensorsFile
from h3_core.models.video_vae import VideoVAE, VideoVAEConfig
from residency_probe import UnitProbe, is_materialised

VIDEO_BLOCKS = 4
HEADS, HEAD_DIM = 2, 64  # a ComfyUI file implies 64-wide heads; two of them make the QKV interleave matter
AUDIO_STAGES = 7  # the released decoder rates (5, 5, 2, 2, 2, 2, 2)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny tensors: a second intra-op thread only adds barrier waits (costly when the CPUs are shared).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def randomize(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name or name.endswith(("scale1", "scale2")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
            elif p.ndim == 1:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(torch.randn(p.shape, generator=generator) / p[0].numel() ** 0.5)


def latent_stats(channels, seed):
    generator = torch.Generator().manual_seed(seed)
    return (tuple((0.1 * torch.randn(channels, generator=generator)).tolist()),
            tuple((0.8 + 0.4 * torch.rand(channels, generator=generator)).tolist()))


@pytest.fixture(scope="module")
def video_file(tmp_path_factory):
    """A ComfyUI-layout fp16 video VAE: native names, per-head interleaved QKV rows, latent statistics inside."""
    mean, std = latent_stats(24, seed=1)
    config = VideoVAEConfig(block_out_channels=(32,) * 6, layers_per_block=1, decoder_num_layers=VIDEO_BLOCKS,
                            decoder_num_heads=HEADS, decoder_head_dim=HEAD_DIM, decoder_ffn_dim=96,
                            latents_mean=mean, latents_std=std)
    model = VideoVAE(config)
    randomize(model, seed=2)
    state = {}
    for name, tensor in model.state_dict().items():
        if ".attn.to_qkv." in name:  # logical [q; k; v] -> stored [head0: q k v, head1: q k v]
            rest = tensor.shape[1:]
            tensor = tensor.reshape(3, HEADS, HEAD_DIM, *rest).transpose(0, 1).reshape(tensor.shape)
        state[name] = tensor.half().contiguous()
    state["latents_mean"], state["latents_std"] = torch.tensor(mean), torch.tensor(std)
    path = tmp_path_factory.mktemp("video_vae") / "minimax_h3_video_vae_fp16.safetensors"
    save_file(state, str(path))
    return path


@pytest.fixture(scope="module")
def audio_folder(tmp_path_factory):
    """A native audio_vae/ folder: weight-normed convolutions stored as `weight_g` / `weight_v` pairs."""
    mean, std = latent_stats(32, seed=3)
    config = AudioVAEConfig(encoder_dim=4, latent_dim=64, decoder_dim=256, latents_mean=mean, latents_std=std)
    model = AudioVAE(config)
    randomize(model, seed=4)
    normed = {name for name, m in model.named_modules() if isinstance(m, WEIGHT_NORM_MODULES)}
    generator = torch.Generator().manual_seed(5)
    state = {}
    for name, tensor in model.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        if owner in normed and leaf == "weight":
            state[f"{owner}.weight_v"] = tensor
            gain = 0.5 + torch.rand(tensor.shape[0], *([1] * (tensor.ndim - 1)), generator=generator)
            state[f"{owner}.weight_g"] = gain
        else:
            state[name] = tensor
    folder = tmp_path_factory.mktemp("audio") / "audio_vae"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"latents_mean": list(mean), "latents_std": list(std)}))
    return folder


VIDEO_OPTIONS = dict(tile_size=32, tile_min_overlap=16)  # a 48 x 48 px canvas decodes as 2 x 2 tiles


@pytest.fixture(scope="module")
def video_inputs():
    generator = torch.Generator().manual_seed(6)
    return {"latent": torch.randn(1, 24, 12, 3, 3, generator=generator),
            "frames": torch.rand(1, 5, 32, 32, 3, generator=generator)}


@pytest.fixture(scope="module")
def audio_inputs():
    generator = torch.Generator().manual_seed(7)
    return {"latent": torch.randn(1, 32, 2, 3, generator=generator),
            "waveform": 0.5 * torch.randn(1, 2, 1600, generator=generator)}


@pytest.fixture(scope="module")
def video_reference(video_file, video_inputs):
    vae = h3_core.load_video_vae(video_file, **VIDEO_OPTIONS)
    return {"decode": vae.decode(video_inputs["latent"]), "encode": vae.encode(video_inputs["frames"])}


@pytest.fixture(scope="module")
def audio_reference(audio_folder, audio_inputs):
    vae = h3_core.load_audio_vae(audio_folder)
    return {"decode": vae.decode(audio_inputs["latent"]), "encode": vae.encode(audio_inputs["waveform"])}


def video_block_parameters(vae, index):
    return list(vae.decoder.transformer_blocks[index].parameters())


def audio_stage_parameters(vae, index):
    decoder = vae.decoder
    blocks = decoder.resblocks[index * decoder.num_kernels:(index + 1) * decoder.num_kernels]
    return [*decoder.ups[index].parameters(), *blocks.parameters()]


def video_phase_parameters(vae):
    return [*vae.encoder.parameters(), *vae.quant_conv.parameters()]


def audio_phase_parameters(vae):
    return [*vae.encoder.parameters(), *vae.pre_block.parameters(), *vae.mean_proj.parameters(),
            *vae.logs_proj.parameters()]


def decoder_passes_per_decode(vae, latent):
    """How many decoder forwards one decode makes (clips x tiles for the video VAE), counted by a hook."""
    calls = []
    handle = vae.decoder.register_forward_pre_hook(lambda m, a: calls.append(1))
    vae.decode(latent)
    handle.remove()
    return len(calls)


# ---- exactness and the residency bound ---------------------------------------------------------------------------


@pytest.mark.parametrize("resident_blocks", [None, [1]])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_video_layerwise_equals_resident_bitwise_with_bounded_residency(video_file, video_inputs, video_reference,
                                                                        prefetch, resident_blocks):
    vae = h3_core.load_video_vae(video_file, residency="layerwise", prefetch=prefetch,
                                 resident_blocks=resident_blocks, **VIDEO_OPTIONS)
    manager = vae.decoder.block_residency
    assert manager.residency is Residency.LAYERWISE_OFFLOAD
    resident = set(resident_blocks or ())
    passes = decoder_passes_per_decode(vae, video_inputs["latent"])
    assert passes == 8  # two clips of 2 x 2 tiles: every tile is one pass over the blocks
    probe = UnitProbe(manager, vae.decoder.transformer_blocks, lambda i: video_block_parameters(vae, i),
                      video_phase_parameters(vae))
    for _ in range(2):
        assert torch.equal(vae.decode(video_inputs["latent"]), video_reference["decode"])
        assert torch.equal(vae.encode(video_inputs["frames"]), video_reference["encode"])
        stats = manager.stats().last_pass
        assert stats.peak_streamed_blocks == min(prefetch + 1, VIDEO_BLOCKS - len(resident))
        assert stats.loads == VIDEO_BLOCKS - len(resident) and not stats.aborted
    probe.check(prefetch, resident, passes=2 * passes)
    assert {i for i in range(VIDEO_BLOCKS) if is_materialised(video_block_parameters(vae, i))} == resident
    assert vae.weight_phases.materialised() == () and not is_materialised(video_phase_parameters(vae))


@pytest.mark.parametrize("resident_blocks", [None, 2])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_audio_layerwise_equals_resident_bitwise_with_bounded_residency(audio_folder, audio_inputs, audio_reference,
                                                                        prefetch, resident_blocks):
    vae = h3_core.load_audio_vae(audio_folder, residency="layerwise", prefetch=prefetch,
                                 resident_blocks=resident_blocks)
    manager = vae.decoder.block_residency
    assert manager.num_blocks == AUDIO_STAGES
    resident = set(range(resident_blocks or 0))
    probe = UnitProbe(manager, [up[0] for up in vae.decoder.ups], lambda i: audio_stage_parameters(vae, i),
                      audio_phase_parameters(vae))
    for _ in range(2):
        assert torch.equal(vae.decode(audio_inputs["latent"]), audio_reference["decode"])
        assert torch.equal(vae.encode(audio_inputs["waveform"]), audio_reference["encode"])
        stats = manager.stats().last_pass
        assert stats.peak_streamed_blocks == min(prefetch + 1, AUDIO_STAGES - len(resident))
        assert stats.loads == AUDIO_STAGES - len(resident)
    probe.check(prefetch, resident, passes=2)
    assert {i for i in range(AUDIO_STAGES) if is_materialised(audio_stage_parameters(vae, i))} == resident
    assert vae.weight_phases.materialised() == () and not is_materialised(audio_phase_parameters(vae))


# ---- host stores and recipes ---------------------------------------------------------------------------------------


def test_video_store_is_the_fp16_memory_map_upcast_when_a_block_is_materialised(video_file, video_inputs):
    vae = h3_core.load_video_vae(video_file, residency="layerwise", **VIDEO_OPTIONS)
    manager = vae.decoder.block_residency
    file = SafetensorsFile(video_file)
    block_keys = [k for k in file.keys() if k.startswith("decoder.transformer_blocks.")]
    stats = manager.stats()
    assert stats.store == "staged_reads" and stats.pinned_bytes == 0
    # The store reads the file's fp16 bytes; a materialised block is float32, twice as large.
    assert stats.host_store_bytes == sum(file.nbytes(k) for k in block_keys)
    assert sum(manager.store.unit_bytes(i) for i in range(VIDEO_BLOCKS)) == 2 * stats.host_store_bytes
    seen = []
    vae.decoder.transformer_blocks[2].register_forward_pre_hook(
        lambda m, a: seen.append((m.attn.to_qkv.weight.dtype, m.attn.to_qkv.weight.clone())))
    vae.decode(video_inputs["latent"][:, :, :1])
    resident = h3_core.load_video_vae(video_file, **VIDEO_OPTIONS)
    dtype, qkv = seen[0]
    assert dtype == torch.float32
    assert torch.equal(qkv, resident.decoder.transformer_blocks[2].attn.to_qkv.weight)  # de-interleaved rows
    stored = file.tensor("decoder.transformer_blocks.2.attn.to_qkv.weight").float()
    assert not torch.equal(qkv, stored)  # the file's order differs: the combine ran at materialisation
    # The other decoder weights stay resident; the encoder is phase-scoped.
    assert is_materialised(vae.decoder.x_embedder.parameters()) and is_materialised([vae.decoder.register_tokens])
    assert not is_materialised(video_phase_parameters(vae))


def test_audio_weight_norm_pairs_are_folded_when_a_stage_is_materialised(audio_folder, audio_inputs):
    vae = h3_core.load_audio_vae(audio_folder, residency="layerwise")
    resident = h3_core.load_audio_vae(audio_folder)
    file = SafetensorsFile(audio_folder / "model.safetensors")
    stage_keys = [k for k in file.keys() if k.startswith(("decoder.ups.", "decoder.resblocks."))
                  and not k.endswith(".filter")]
    manager = vae.decoder.block_residency
    assert manager.stats().host_store_bytes == sum(file.nbytes(k) for k in stage_keys)
    seen = []
    vae.decoder.ups[0][0].register_forward_pre_hook(lambda m, a: seen.append(m.weight.clone()))
    vae.decode(audio_inputs["latent"])
    assert torch.equal(seen[0], resident.decoder.ups[0][0].weight)
    assert not torch.equal(seen[0], file.tensor("decoder.ups.0.0.weight_v"))  # folded, not the raw direction
    # Buffers are never streamed: the resampling filters stay where the loader put them.
    for (name, buffer), (_, expected) in zip(vae.decoder.named_buffers(), resident.decoder.named_buffers()):
        assert torch.equal(buffer, expected), name
    assert is_materialised(vae.decoder.conv_pre.parameters()) and is_materialised(vae.decoder.conv_post.parameters())


# ---- exception safety, close() -----------------------------------------------------------------------------------


def fail_once(message):
    failures = []

    def hook(module, args):
        if not failures:
            failures.append(1)
            raise RuntimeError(message)

    return hook


def test_an_exception_inside_a_video_block_leaves_the_vae_usable(video_file, video_inputs, video_reference):
    vae = h3_core.load_video_vae(video_file, residency="layerwise", prefetch=1, resident_blocks=[0],
                                 **VIDEO_OPTIONS)
    manager = vae.decoder.block_residency
    handle = vae.decoder.transformer_blocks[2].register_forward_pre_hook(fail_once("boom in block 2"))
    with pytest.raises(RuntimeError, match="boom in block 2"):
        vae.decode(video_inputs["latent"])
    assert manager.stats().last_pass.aborted and manager.materialised_streamed() == []
    assert {i for i in range(VIDEO_BLOCKS) if is_materialised(video_block_parameters(vae, i))} == {0}
    handle.remove()
    handle = vae.encoder.down[3].register_forward_pre_hook(fail_once("boom in the encoder"))
    with pytest.raises(RuntimeError, match="boom in the encoder"):
        vae.encode(video_inputs["frames"])
    assert vae.weight_phases.materialised() == ()
    handle.remove()
    for _ in range(2):
        assert torch.equal(vae.decode(video_inputs["latent"]), video_reference["decode"])
        assert torch.equal(vae.encode(video_inputs["frames"]), video_reference["encode"])
    assert not manager.stats().last_pass.aborted


def test_an_exception_inside_an_audio_stage_leaves_the_vae_usable(audio_folder, audio_inputs, audio_reference):
    vae = h3_core.load_audio_vae(audio_folder, residency="layerwise", prefetch=1)
    manager = vae.decoder.block_residency
    # Inside stage 3, after its upsampler ran: the stage is acquired and the next one prefetched.
    handle = vae.decoder.resblocks[3 * vae.decoder.num_kernels + 1].register_forward_pre_hook(
        fail_once("boom in stage 3"))
    with pytest.raises(RuntimeError, match="boom in stage 3"):
        vae.decode(audio_inputs["latent"])
    assert manager.stats().last_pass.aborted and manager.materialised_streamed() == []
    assert not any(is_materialised(audio_stage_parameters(vae, i)) for i in range(AUDIO_STAGES))
    handle.remove()
    for _ in range(2):
        assert torch.equal(vae.decode(audio_inputs["latent"]), audio_reference["decode"])
    assert not manager.stats().last_pass.aborted


@pytest.mark.parametrize("kind", ["video", "audio"])
def test_close_gives_every_parameter_its_host_tensor_back(kind, video_file, audio_folder, video_inputs,
                                                          audio_inputs, video_reference, audio_reference):
    if kind == "video":
        vae = h3_core.load_video_vae(video_file, residency="layerwise", prefetch=1, **VIDEO_OPTIONS)
        inputs, reference, units = video_inputs, video_reference, VIDEO_BLOCKS
    else:
        vae = h3_core.load_audio_vae(audio_folder, residency="layerwise", prefetch=1, resident_blocks=[5])
        inputs, reference, units = audio_inputs, audio_reference, AUDIO_STAGES
    params = dict(vae.named_parameters())
    vae.decode(inputs["latent"])
    vae.close()
    assert isinstance(vae.decoder.block_residency, AllResident) and vae.decoder.block_residency.num_blocks == units
    assert isinstance(vae.weight_phases, PhaseScopedWeights) and vae.weight_phases.names == ()
    after = dict(vae.named_parameters())
    assert after.keys() == params.keys() and all(after[n] is p for n, p in params.items())
    assert all(p.dtype == torch.float32 and p.numel() > 1 for p in after.values())
    assert torch.equal(vae.decode(inputs["latent"]), reference["decode"])
    second = "frames" if kind == "video" else "waveform"
    assert torch.equal(vae.encode(inputs[second]), reference["encode"])
    vae.close()  # idempotent


# ---- settings and admission ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["video", "audio"])
@pytest.mark.parametrize("options, message", [
    (dict(residency="streamed"), "residency 'streamed' is not one of"),
    (dict(residency="layerwise", prefetch=1.5), "prefetch=1.5 must be an integer >= 0"),
    (dict(residency="layerwise", resident_blocks=99), "resident_blocks=99 must be between 0"),
    (dict(residency="layerwise", resident_blocks=[-1, 12]), "resident_blocks lists 12"),
])
def test_bad_residency_settings_raise_one_error_naming_the_value(kind, video_file, audio_folder, options, message):
    load = (lambda: h3_core.load_video_vae(video_file, **options)) if kind == "video" else \
        (lambda: h3_core.load_audio_vae(audio_folder, **options))
    with pytest.raises(ResidencyError, match=message) as info:
        load()
    assert isinstance(info.value, h3_core.H3Error)


@pytest.mark.parametrize("component, load", [("video_vae", h3_core.load_video_vae),
                                             ("audio_vae", h3_core.load_audio_vae)])
def test_mps_admission_refuses_a_resident_vae_before_reading_anything(tmp_path, component, load):
    for options in ({}, {"residency": Residency.RESIDENT}):
        with pytest.raises(AdmissionError) as info:
            load(tmp_path / "missing", device="mps", **options)
        assert info.value.violations == [(component, info.value.violations[0][1], "set residency='layerwise'")]
        assert str(info.value).startswith(f"MPS admission refused 1 setting(s) of {component}:")
        assert f"{component}: is resident" in str(info.value) and "fix: set residency='layerwise'" in str(info.value)
    # Layerwise is admitted: the next thing checked is the (missing) path.
    with pytest.raises(h3_core.CheckpointError, match="no such file or folder"):
        load(tmp_path / "missing", device="mps", residency="layerwise")


@pytest.mark.parametrize("fmt", ["int8_convrot", "float8_e4m3fn"])
def test_quantised_video_vae_dequantises_as_comfy_kitchen_and_streams_exactly(video_file, video_inputs, tmp_path,
                                                                            fmt):
    """A ComfyUI quantised video VAE (its decoder's transformer matrices, as in the int8 ConvRot repack, with the
    QKV rows and their per-row scales stored per head interleaved): each weight equals comfy-kitchen's
    dequantisation (in float32, de-interleaved), and layerwise decodes bit for bit as resident."""
    pytest.importorskip("comfy_kitchen")
    from safetensors.torch import load_file

    from quant_fixtures import kitchen_quantise, reference_dequantised

    state = load_file(str(video_file))
    kitchen = {}
    for key in [k for k, v in state.items() if ".transformer_blocks." in k and v.ndim == 2
                and k.endswith(".weight")]:
        qt, config = kitchen_quantise(state[key].to(torch.bfloat16), fmt, convrot_group=16)
        state.update(qt.state_dict(key))
        state[key[: -len(".weight")] + ".comfy_quant"] = torch.tensor(list(json.dumps(config).encode()),
                                                                      dtype=torch.uint8)
        kitchen[key] = qt
    assert any(".attn.to_qkv." in k for k in kitchen)
    path = tmp_path / f"minimax_h3_video_vae_{fmt}.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    resident = h3_core.load_video_vae(path, **VIDEO_OPTIONS)
    params = dict(resident.named_parameters())
    for key, qt in kitchen.items():
        expected = reference_dequantised(qt, torch.float32)
        if ".attn.to_qkv." in key:  # stored [head0: q k v, ...] -> the logical [q; k; v] the model holds
            expected = expected.reshape(HEADS, 3, HEAD_DIM, -1).transpose(0, 1).reshape(expected.shape)
        assert torch.equal(params[key], expected), key
    streamed = h3_core.load_video_vae(path, residency="layerwise", **VIDEO_OPTIONS)
    assert torch.equal(streamed.decode(video_inputs["latent"]), resident.decode(video_inputs["latent"]))
