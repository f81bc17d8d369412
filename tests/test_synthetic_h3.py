"""The synthetic real-size model writer (`benchmarks/synthetic_h3.py`): its released plans are what the loaders
expect, its reduced-width files load and run, and its memory stays bounded by the chunk, not the tensor."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import h3_core
from h3_core.checkpoints.audio_vae_loader import resolve_audio_vae_checkpoint
from h3_core.checkpoints.checkpoint import expected_shapes
from h3_core.checkpoints.dit_loader import resolve_dit_checkpoint, target_dtype
from h3_core.checkpoints.safetensors_io import SafetensorsFile
from h3_core.checkpoints.text_encoder_loader import resolve_text_encoder_checkpoint
from h3_core.checkpoints.video_vae_loader import resolve_video_vae_checkpoint
from h3_core.models.audio_vae import AudioVAEConfig
from h3_core.models.dit_config import H3DiTConfig
from h3_core.models.text_encoder import TextEncoderConfig
from h3_core.models.video_vae import VideoVAEConfig
from h3_fixtures import packed_inputs

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import synthetic_h3 as synth  # noqa: E402

TINY_DIT = dict(hidden_size=64, num_attention_heads=2, attention_head_dim=32, ffn_dim=96, text_dim=48, freq_dim=32,
                time_embed_hidden_dim=64, time_embed_dim=32, rope_freq_dim=4)
TINY_TEXT = {
    "text_config": dict(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, rope_scaling={"rope_type": "default", "mrope_section": [4, 2, 2],
                                                   "mrope_interleaved": True}),
    "vision_config": dict(hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=48,
                          num_position_embeddings=16),
}
# A single VAE file keeps the released levels, strides and 64-wide decoder heads; only the widths shrink.
TINY_VIDEO = dict(block_out_channels=(32,) * 6, layers_per_block=1, decoder_num_layers=2, decoder_num_heads=1,
                  decoder_head_dim=64, decoder_ffn_dim=96)
TINY_AUDIO = dict(encoder_dim=4, latent_dim=64, decoder_dim=128)


def stored(paths) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out = {}
    for path in paths:
        file = SafetensorsFile(path)
        out.update({k: (file.shape(k), file.dtype(k)) for k in file.keys()})
    return out


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())


# ---- (1) the released plans are what the loaders read ---------------------------------------------------------------


def test_released_dit_is_the_native_release_the_loader_reads(tmp_path):
    folder, config = synth.write_dit(tmp_path / "transformer", 50, values=False)
    assert config == H3DiTConfig()
    plan = {name: (shape, dtype) for name, shape, dtype in synth.plan_dit(config)}
    # The release (h3-model.md §7.1): 535 tensors, 522 bf16 + 13 fp32, 66,280,430,144 bytes in 13 shards.
    assert len(plan) == 535
    assert sum(d == torch.float32 for _, d in plan.values()) == 13
    assert sum(math.prod(s) * d.itemsize for s, d in plan.values()) == 66_280_430_144
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 66_280_430_144
    assert len(set(index["weight_map"].values())) == 13
    ckpt = resolve_dit_checkpoint(folder)  # the strict key / shape / dtype check over the 13 shards
    assert (ckpt.layout, ckpt.config) == ("native", config)
    assert expected_shapes(ckpt.specs) == {name: shape for name, (shape, _) in plan.items()}
    assert stored(ckpt.paths) == plan
    # The fp32 tensors are the loader's fp32 islands.
    assert {n for n, (_, d) in plan.items() if d == torch.float32} == {
        n for n in plan if target_dtype(n, torch.bfloat16, torch.bfloat16) == torch.float32}
    assert disk_bytes(tmp_path) < 4 << 20  # headers only: the data is a hole


def test_released_text_encoder_is_the_official_folder_the_loader_reads(tmp_path):
    folder, config = synth.write_text_encoder(tmp_path / "text_encoder", 64, values=False)
    assert config == TextEncoderConfig()  # Qwen3-VL-32B
    plan = {name: (shape, dtype) for name, shape, dtype in synth.plan_text_encoder(synth.text_encoder_raw_config(64))}
    assert {d for _, d in plan.values()} == {torch.bfloat16}
    assert 66e9 < sum(math.prod(s) * 2 for s, _ in plan.values()) < 67e9  # h3-components.md §2.1: ~66 GB bf16
    ckpt = resolve_text_encoder_checkpoint(folder, layer=50)
    assert ckpt.config == config and ckpt.layout == "official"
    read = expected_shapes(ckpt.specs)
    assert stored(ckpt.paths) == plan
    assert {n: s for n, (s, _) in plan.items() if n in read} == read
    # What is stored but never read: layers 50-63, the final norm and lm_head.
    assert set(plan) - set(read) == ckpt.allowed_extra
    assert {"lm_head.weight", "model.language_model.norm.weight",
            "model.language_model.layers.63.mlp.down_proj.weight"} <= ckpt.allowed_extra
    assert not any(".layers.49." in k for k in ckpt.allowed_extra)
    assert disk_bytes(tmp_path) < 8 << 20


@pytest.mark.parametrize("component", ["video", "audio"])
def test_released_vaes_are_the_comfy_files_the_loaders_read(tmp_path, component):
    if component == "video":
        path, config = synth.write_video_vae(tmp_path, values=False)
        ckpt, default, dtype, size = resolve_video_vae_checkpoint(path), VideoVAEConfig(), torch.float16, 5.21e9
        plan = synth.plan_video_vae(config)
    else:
        path, config = synth.write_audio_vae(tmp_path, values=False)
        ckpt, default, dtype, size = resolve_audio_vae_checkpoint(path), AudioVAEConfig(), torch.float32, 605e6
        plan = synth.plan_audio_vae(config)
    assert config == default and ckpt.config == default  # the shapes of the file read back as the released model
    assert ckpt.layout == "comfy"
    assert expected_shapes(ckpt.specs) == {name: shape for name, shape, _ in plan}
    assert {d for _, _, d in plan} == {dtype}
    assert stored([path]) == {name: (shape, d) for name, shape, d in plan}
    # h3-components.md §6.2: minimax_h3_video_vae_fp16 5.21 GB, minimax_h3_audio_vae_fp32 605 MB.
    assert abs(path.stat().st_size - size) < 0.005 * size
    assert disk_bytes(tmp_path) < 1 << 20


# ---- (2) reduced widths: the files load and run ---------------------------------------------------------------------


def test_tiny_dit_loads_and_runs(tmp_path):
    folder, config = synth.write_dit(tmp_path / "a", 2, refiner_blocks=1, config_overrides=TINY_DIT,
                                     chunk_bytes=4096, shard_bytes=200_000)
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    inputs = packed_inputs(config)
    for residency in ("resident", "layerwise"):
        model = h3_core.load_dit(folder, residency=residency)
        assert model.config == config and model.checkpoint_layout == "native"
        with torch.no_grad():
            video, audio = model(**inputs)
        assert torch.isfinite(video).all() and torch.isfinite(audio).all() and video.abs().max() > 0
    model = h3_core.load_dit(folder)
    assert model.blocks[0].attn.qkv_proj.weight.dtype == torch.bfloat16
    assert model.video_patch_proj.weight.dtype == torch.float32
    assert torch.equal(model.blocks[0].norm1.weight, torch.ones(64, dtype=torch.bfloat16))
    assert float(model.blocks[0].mlp.fc1.weight.float().std()) == pytest.approx(0.5 / 64 ** 0.5, rel=0.1)


def test_values_depend_on_the_seed_and_name_only(tmp_path):
    """Same seed: the same bytes whatever the piece size; another seed: other values. Readable by `safetensors`."""
    from safetensors import safe_open

    config = dict(config_overrides=TINY_DIT, shard_bytes=1 << 40)
    a, _ = synth.write_dit(tmp_path / "a", 1, chunk_bytes=1 << 20, **config)
    b, _ = synth.write_dit(tmp_path / "b", 1, chunk_bytes=24, **config)
    c, _ = synth.write_dit(tmp_path / "c", 1, chunk_bytes=1 << 20, seed=1, **config)
    data = {p: (p / "model.safetensors").read_bytes() for p in (a, b, c)}
    assert data[a] == data[b] and data[a] != data[c]
    with safe_open(str(a / "model.safetensors"), "pt") as f:
        qkv, out = f.get_tensor("blocks.0.attn.qkv_proj.weight"), f.get_tensor("blocks.0.attn.out_proj.weight")
        assert torch.equal(f.get_tensor("rope.inv_freq"), h3_core.load_dit(a).rope.inv_freq)
    assert qkv.shape[1] == out.shape[1]  # same fan-in, same scale: still each tensor its own window of the pool
    assert not torch.equal(qkv[: out.shape[0]], out)


def test_tiny_text_encoder_loads_and_runs(tmp_path):
    folder, config = synth.write_text_encoder(tmp_path / "text_encoder", 2, vision_layers=2, overrides=TINY_TEXT,
                                              lm_head=False, chunk_bytes=1 << 20)
    encoder = h3_core.load_text_encoder(folder, layer=2)
    assert encoder.config == config and encoder.vision_tower is not None
    states, tags = encoder.encode("A red fox runs across a snowy field.", images=[torch.rand(64, 64, 3)])
    assert states.shape == (tags.numel(), 48) and (tags == 0).any()
    assert torch.isfinite(states.float()).all()


def test_tiny_vaes_load_and_run(tmp_path):
    path, config = synth.write_video_vae(tmp_path, overrides=TINY_VIDEO, chunk_bytes=1 << 16)
    vae = h3_core.load_video_vae(path, tile_size=32, tile_min_overlap=16)
    assert vae.config == config
    g = torch.Generator().manual_seed(0)
    frames = vae.decode(torch.randn(1, 24, 2, 3, 3, generator=g))
    assert torch.isfinite(frames).all()
    assert torch.isfinite(vae.encode(torch.rand(1, 5, 32, 32, 3, generator=g))).all()

    path, config = synth.write_audio_vae(tmp_path, overrides=TINY_AUDIO, chunk_bytes=1 << 16)
    audio = h3_core.load_audio_vae(path)
    assert audio.config == config
    wave = audio.decode(torch.randn(1, 32, 2, 3, generator=g))
    assert wave.shape == (1, 2, 2400) and torch.isfinite(wave).all()
    assert torch.isfinite(audio.encode(0.5 * torch.randn(1, 2, 1600, generator=g))).all()


def test_latent_statistics_are_written_only_when_not_the_published_ones(tmp_path):
    path, _ = synth.write_audio_vae(tmp_path / "a", overrides=TINY_AUDIO)
    assert "latents_mean" not in SafetensorsFile(path)
    mean, std = tuple(0.1 * i for i in range(32)), tuple(1.0 + 0.01 * i for i in range(32))
    path, _ = synth.write_audio_vae(tmp_path / "b", overrides={**TINY_AUDIO, "latents_mean": mean, "latents_std": std})
    assert h3_core.load_audio_vae(path).config.latents_mean == pytest.approx(mean)


# ---- (3) memory bounded by the chunk, not the tensor ----------------------------------------------------------------


PEAK_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    import synthetic_h3 as synth

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    chunk = int(sys.argv[2])
    specs = synth.dit_specs(synth.dit_config(1, 0))  # one released block and the globals
    pieces = []
    write_all = synth._write_all
    synth._write_all = lambda fd, buffer: (pieces.append(len(buffer)), write_all(fd, buffer))
    open("/proc/self/clear_refs", "w").write("5")  # restart the peak-RSS count (VmHWM) here
    before = status("VmRSS")
    written = synth.write_safetensors("/dev/null", specs, chunk_bytes=chunk)
    print(json.dumps({"peak_growth": status("VmHWM") - before, "written": written, "largest_piece": max(pieces),
                      "pieces": sum(pieces), "largest_tensor": max(s.nbytes for s in specs)}))
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_writer_memory_is_bounded_by_the_chunk_not_the_tensor():
    chunk = 8 << 20
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(BENCHMARKS), str(chunk)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["largest_tensor"] > 500e6 and result["written"] > 1.4e9  # the AdaLN table: 520 MB
    assert result["pieces"] == result["written"]  # every byte went through the bounded writes
    assert result["largest_piece"] <= chunk
    # The float32 pool, its scaled copies (at most float32 each), a float32 and a bf16 piece, some slack for the
    # allocator; a writer that made a whole tensor would grow by >= 520 MB.
    bound = synth.POOL_ELEMENTS * 4 * (1 + synth.CACHED_POOLS) + 2 * chunk + (32 << 20)
    assert result["peak_growth"] < bound, result
