"""The LoRA surfaces outside the core: the pipeline's `sample(loras=)` and options, the CLI's `--lora`, the tiny
turbo LoRA. (The nodes and the turbo example workflow: tests/test_nodes.py, tests/test_workflows.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import h3_core
from h3_core.app import cli
from h3_core.checkpoints.lora_loader import LoraFold
from h3_core.pipeline import H3Pipeline
from h3_core.pipeline import pipeline as pipeline_module
from h3_core.planning.phase_plans import plan_components
from h3_core.sources import resolve_model
from h3_core.sources.tiny_default import TINY_LORA, TINY_VERSION, ensure_tiny_lora, ensure_tiny_model, write_tiny_lora

SHAPE = h3_core.LatentShape.for_request(64, 32, 5)


@pytest.fixture(scope="module")
def lora(tiny):
    return tiny / "loras" / TINY_LORA


def retuned(tmp_path, **metadata) -> Path:
    """The tiny LoRA's tensors with other metadata."""
    from safetensors.torch import load_file

    path = tmp_path / f"retuned_{len(metadata)}.safetensors"
    save_file(load_file(write_tiny_lora(tmp_path / "base.safetensors")), str(path),
              metadata={k: str(v) for k, v in metadata.items()})
    return path


# ---- the tiny turbo LoRA ------------------------------------------------------------------------------------------


def test_tiny_lora_is_deterministic_original_format_and_recommends_8_sampling_steps(tiny, lora, tmp_path):
    assert lora.read_bytes() == write_tiny_lora(tmp_path / "again.safetensors").read_bytes()
    read = h3_core.read_lora(lora)
    assert read.format == "original module names" and read.recommended == {"steps": 9}
    assert sorted(read.updates) == [f"blocks.{i}.attn.{m}.weight" for i in (0, 1) for m in ("out_proj", "qkv_proj")]
    # Written on its own (the ComfyUI pack does at start-up) it does not stop the model being generated after it.
    fresh = tmp_path / "fresh"
    assert ensure_tiny_lora(fresh).read_bytes() == lora.read_bytes()
    model = ensure_tiny_model(fresh)
    assert (model / "model_index.json").is_file() and (model / "diffusion_models").is_dir()
    assert sorted(p.name for p in fresh.iterdir()) == [TINY_VERSION]  # no staging folder left behind


# ---- pipeline -----------------------------------------------------------------------------------------------------


def test_sample_makes_the_transformer_lora_set_equal_to_the_call_s(tiny, lora, monkeypatch):
    calls = []
    real = pipeline_module.set_loras
    monkeypatch.setattr(pipeline_module, "set_loras", lambda model, loras: calls.append(loras) or real(model, loras))
    pipe = H3Pipeline(resolve_model(tiny), keep_text_encoder=True)
    cond = pipe.encode_prompt("a fox", width=64, height=32)
    run = lambda **kw: pipe.sample(cond, num_frames=SHAPE.num_frames, steps=3, seed=1, **kw)  # noqa: E731
    base = run()
    with_lora = run(loras=[(str(lora), 1.0)])
    dit = pipe.component("transformer")
    assert dit.loras == ((lora, 1.0),) and len(calls) == 1
    summary = pipe.residency_summary("transformer")  # what the node telemetry reports
    assert summary.lora_files == 1 and summary.lora_bytes_moved > 0 and summary.lora_fold_peak_bytes > 0
    assert torch.equal(run(loras=[(lora, 1.0)]).video, with_lora.video) and len(calls) == 1  # already equal: no call
    assert torch.equal(run().video, with_lora.video) and len(calls) == 1  # None keeps the set
    assert not torch.equal(with_lora.video, base.video)
    assert torch.equal(run(loras=()).video, base.video) and dit.loras == () and len(calls) == 2
    with pytest.raises(h3_core.H3Error, match="loras: the strength of .* must be a finite number"):
        run(loras=[(lora, float("nan"))])
    pipe.release_all()


def test_component_options_loras_reach_load_dit_and_survive_the_memory_plan(tiny, lora):
    sources = resolve_model(tiny)
    size = dict(width=64, height=32, num_frames=5)
    for budget in (None, 4.0):
        options = plan_components(sources, memory_budget_gb=budget, loras=[(lora, 0.5)], **size)
        assert options["transformer"]["loras"] == [(lora, 0.5)], budget
    assert "loras" not in plan_components(sources, memory_budget_gb=4.0, **size)["transformer"]
    pipe = H3Pipeline(sources, component_options={"transformer": {"loras": [(lora, 0.5)]}})
    assert pipe.component("transformer").loras == ((lora, 0.5),)
    pipe.release_all()


# ---- CLI ----------------------------------------------------------------------------------------------------------


def test_parse_lora(lora, tmp_path):
    assert cli.parse_lora(str(lora)) == (lora, 1.0)
    assert cli.parse_lora(f"{lora}:0.75") == (lora, 0.75)
    assert cli.parse_lora(f"{lora}:-1.5") == (lora, -1.5)
    colon = tmp_path / "C:odd.safetensors"  # a colon in the name, nothing number-like after it
    colon.write_bytes(lora.read_bytes())
    assert cli.parse_lora(str(colon)) == (colon, 1.0)
    for text, message in ((f"{lora}:strong", "strength 'strong' is not a number; write FILE[:STRENGTH]"),
                          (f"{lora}:nan", "strength must be a finite number"),
                          ("missing.safetensors", "no such file"), ("missing.safetensors:0.5", "no such file"),
                          (":0.5", "no such file")):
        with pytest.raises(cli.CliError, match=re.escape(message)):
            cli.parse_lora(text)


@pytest.fixture
def recorded(tiny_cache, monkeypatch):
    """The CLI in this process on the tiny model; what reached load_dit and the pipeline's generate."""
    monkeypatch.setenv("H3_STREAM_CACHE", str(tiny_cache))
    seen = {}
    real_load, real_generate = pipeline_module.load_dit, H3Pipeline.generate

    def load(*args, **kwargs):
        seen["load_dit"] = kwargs
        return real_load(*args, **kwargs)

    def generate(self, request, **kwargs):
        seen["generate"] = {name: getattr(request, name) for name in ("steps", "video_shift", "audio_shift", "loras")}
        return real_generate(self, request, **kwargs)

    monkeypatch.setattr(pipeline_module, "load_dit", load)
    monkeypatch.setattr(H3Pipeline, "generate", generate)
    return seen


def generate(tmp_path, *extra) -> list[str]:
    return ["generate", "a fox", "--frames", "5", "--size", "64x32", "--out", str(tmp_path / "o.mp4"), *extra]


def test_cli_lora_uses_its_recommended_steps_and_says_so(tiny, lora, tmp_path, recorded, capsys):
    assert cli.main(generate(tmp_path, "--lora", f"{lora}:0.8")) == 0
    out = capsys.readouterr().out
    assert f"using the LoRA's recommended 9 steps ({TINY_LORA}); pass --steps to override" in out
    assert "8 model calls" in out and f"LoRA {TINY_LORA} x0.8" in out
    assert recorded["load_dit"]["loras"] == [(lora, 0.8)] and recorded["generate"]["steps"] == 9
    assert (recorded["generate"]["video_shift"], recorded["generate"]["audio_shift"]) == (12.0, 3.0)


def test_cli_flags_given_win_over_the_lora_and_shifts_are_recommended_too(tiny, lora, tmp_path, recorded, capsys):
    assert cli.main(generate(tmp_path, "--lora", str(lora), "--steps", "3", "--memory-budget", "4")) == 0
    out = capsys.readouterr().out
    assert "recommended" not in out and "2 model calls" in out
    assert recorded["load_dit"]["loras"] == [(lora, 1.0)]  # kept by the memory plan
    shifted = retuned(tmp_path, video_shift=5, audio_shift=2)
    assert h3_core.read_lora(shifted).recommended == {"video_shift": 5.0, "audio_shift": 2.0}
    assert cli.main(generate(tmp_path, "--lora", str(lora), "--lora", str(shifted), "--audio-shift", "1",
                             "--steps", "2")) == 0
    out = capsys.readouterr().out
    assert f"using the LoRA's recommended video shift 5 ({shifted.name}); pass --video-shift to override" in out
    assert (recorded["generate"]["video_shift"], recorded["generate"]["audio_shift"]) == (5.0, 1.0)
    assert recorded["load_dit"]["loras"] == [(lora, 1.0), (shifted, 1.0)]


def test_cli_lora_errors_are_one_line(lora, tmp_path, tiny_cache, monkeypatch, capsys):
    monkeypatch.setenv("H3_STREAM_CACHE", str(tiny_cache))
    not_a_lora = tmp_path / "weights.safetensors"
    save_file({"blocks.0.attn.qkv_proj.weight": torch.zeros(2, 2)}, str(not_a_lora))
    for value, message in ((f"{lora}:x", f"error: --lora {lora}:x: strength 'x' is not a number"),
                           ("gone.safetensors", "error: --lora gone.safetensors: no such file"),
                           (str(not_a_lora), f"error: --lora: {not_a_lora}: key 'blocks.0.attn.qkv_proj.weight'")):
        assert cli.main(generate(tmp_path, "--lora", value)) == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and err.count("\n") == 1, err


def test_the_memory_plan_counts_the_lora_fold(tiny, lora):
    """With a budget, the preflight reads the LoRA against the transformer and adds its largest fold step's device
    bytes to the transformer phase (the factors themselves stay memory-mapped)."""
    sources = resolve_model(tiny)
    request = dict(budget_bytes=8 << 30, width=96, height=64, num_frames=39)
    base = h3_core.plan_for_budget(sources, **request)
    with_lora = h3_core.plan_for_budget(sources, loras=[(lora, 1.0)], **request)
    config = h3_core.resolve_dit_checkpoint(sources.transformer).config
    fold = LoraFold([(h3_core.read_lora(lora, config), 1.0)])
    dit = {c.name: c for c in base.components}["transformer"]
    dit_lora = {c.name: c for c in with_lora.components}["transformer"]
    assert dit_lora.activation_bytes - dit.activation_bytes == fold.peak_temporary_bytes(torch.bfloat16) > 0
    assert "LoRA file(s)" in with_lora.describe()
    with pytest.raises(h3_core.LoraError):
        h3_core.plan_for_budget(sources, loras=[(lora.parent / "missing.safetensors", 1.0)], **request)


def test_a_lora_file_replaced_on_disk_is_read_again(tiny, lora, tmp_path):
    """Same name and strength, new file (replaced by rename, as downloads and editors do): the next sample re-reads
    it instead of keeping the old factors."""
    import os

    from safetensors.torch import load_file

    path = tmp_path / "mine.safetensors"
    save_file(load_file(str(lora)), str(path))
    pipe = H3Pipeline(resolve_model(tiny), keep_text_encoder=True)
    cond = pipe.encode_prompt("a fox", width=64, height=32)
    first = pipe.sample(cond, num_frames=SHAPE.num_frames, steps=3, seed=1, loras=[(path, 1.0)])
    doubled = {k: v * 2 for k, v in load_file(str(path)).items()}
    save_file(doubled, str(tmp_path / "new.safetensors"))
    os.replace(tmp_path / "new.safetensors", path)
    second = pipe.sample(cond, num_frames=SHAPE.num_frames, steps=3, seed=1, loras=[(path, 1.0)])
    assert not torch.equal(first.video, second.video)
    fresh = H3Pipeline(resolve_model(tiny), keep_text_encoder=True)
    want = fresh.sample(fresh.encode_prompt("a fox", width=64, height=32), num_frames=SHAPE.num_frames, steps=3, seed=1, loras=[(path, 1.0)])
    assert torch.equal(second.video, want.video)
    pipe.release_all()
    fresh.release_all()
