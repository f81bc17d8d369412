"""The CLI under bad input: one `error: ...` line and exit code 2, before any model is resolved or loaded; the
large-request preflight; the options the memory planner must see; the limits the CLI and the nodes share."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

from h3_core.app import cli
from h3_core.errors import H3Error
from h3_core.pipeline import H3Pipeline
from h3_core.planning.request_estimate import estimate_request, large_request_reasons
from h3_core.request.generation_request import check_prompt, check_seed, check_shift
from h3_core.request.grid import MAX_FRAMES, MAX_SECONDS

ROOT = Path(__file__).resolve().parents[1]


def one_error_line(done) -> str:
    """The run failed with exit code 2, one `error: ...` line on stderr, no traceback and no model loaded."""
    stderr, stdout = done.stderr, done.stdout
    assert done.returncode == 2, (stdout, stderr)
    assert stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    assert "Traceback" not in stderr and "loaded " not in stdout and "sampling [" not in stderr, (stdout, stderr)
    return stderr


NOT_A_GPU = "this PyTorch build has no CUDA support"


@pytest.mark.parametrize("args,message", [
    (["--device", "cuda"], f"--device cuda: {NOT_A_GPU}"),
    (["--device", "cuda:7"], f"--device cuda:7: {NOT_A_GPU}"),
    (["--device", "mps"], "--device mps: Apple MPS is not available here"),
    (["--device", "foo"], "--device foo: not a device; use cpu, cuda, cuda:N or mps."),
    (["--out", "."], "--out '.': is a folder; give a file name inside it, e.g. out.mp4."),
    (["--out", "/dev/full/x.mp4"], "--out '/dev/full/x.mp4': /dev/full is not a folder."),
    (["--out", "/proc/x.mp4"], "--out '/proc/x.mp4': cannot write in /proc ("),
    (["--out", ""], "--out '': is empty; give a file name ending in .mp4, e.g. out.mp4."),
    (["--out", "x.mkv"], "--out 'x.mkv': h3-stream writes .mp4 files (H.264 + AAC; without PyAV, x_frames/ PNGs and "
                         "x.wav beside it), not '.mkv'; name it x.mp4."),
    (["--out", "clip"], "not 'files without a suffix'; name it clip.mp4."),
    (["--seed", str(2**64)], f"--seed {2**64}: must be a whole number from 0 to 2**64 - 1 ({2**64 - 1})."),
    (["--seed", "-1"], "--seed -1: must be a whole number from 0 to 2**64 - 1"),
    (["--memory-budget", "inf"], "--memory-budget inf: must be a finite number of GiB above 0 and at most 1,048,576, "
                                 "e.g. 24."),
    (["--memory-budget", "1e300"], "--memory-budget 1e+300: must be a finite number of GiB above 0 and at most"),
    (["--memory-budget", "nan"], "--memory-budget nan: must be a finite number of GiB above 0"),
    (["--memory-budget", "-4"], "--memory-budget -4.0: must be a finite number of GiB above 0"),
    (["--size", "8192x64"], "--size 8192x64: width 8192 is past the 4096-pixel limit"),
    (["--size", "64x1000000000"], "--size 64x1000000000: height 1000000000 is past the 4096-pixel limit"),
    # Past 15 s a video is made in windows (README "Long videos"), up to 600 s.
    (["--frames", "100000"], "--frames 100000: must be at least 1 and at most 14400 (600 s)."),
    (["--video-shift", "inf"], "--video-shift inf: must be a finite number above 0"),
    (["--video-shift", "1e308"], "--video-shift 1e+308: must be a finite number above 0 and at most 100 (the released "
                                 "model uses 12 for video and 3 for audio)."),
    (["--audio-shift", "101"], "--audio-shift 101.0: must be a finite number above 0 and at most 100"),
    (["--video-shift", "nan"], "--video-shift nan: must be a finite number above 0"),
    (["--audio-shift", "0"], "--audio-shift 0.0: must be a finite number above 0"),
    (["--chunk-size", "0"], "--chunk-size 0: must be at least 1"),
])
def test_bad_flags_give_one_line_before_any_model(args, message, tiny, run_cli, tmp_path):
    assert message in one_error_line(run_cli(["generate", "x", *args], tmp_path))


def test_undecodable_prompt_bytes_give_one_line(tiny, run_cli, tmp_path):
    # Python hands argv bytes that are not UTF-8 to the program as lone surrogates (PEP 383): os.fsdecode is that
    # decoding, so this is the string `python -m h3_core generate $'a fox \xff\xfe'` sees in a UTF-8 locale.
    done = run_cli(["generate", os.fsdecode(b"a fox \xff\xfe")], tmp_path)
    assert one_error_line(done) == ("error: the prompt: character 6 is byte 0xff, which is not UTF-8; check the "
                                    "terminal's encoding (locale) and give the prompt as UTF-8 text.\n")


def test_python_api_prompt_with_a_lone_surrogate(tiny):
    from h3_core.sources import resolve_model

    pipe = H3Pipeline(resolve_model(tiny))
    with pytest.raises(H3Error, match=r"^prompt: character 2 is a lone surrogate U\+D800, which is not a character; "
                                      r"give the prompt as UTF-8 text\.$"):
        pipe.encode_prompt("ab\ud800", width=64, height=64)
    assert pipe.loaded == ()  # refused before the text encoder loads


def test_keyframe_that_pil_cannot_open(tiny, run_cli, tmp_path):
    (tmp_path / "not_an_image.png").write_bytes(b"this is text")
    done = run_cli(["generate", "x", "--first-frame", "not_an_image.png"], tmp_path)
    assert "error: --first-frame not_an_image.png: PIL cannot open it as an image (cannot identify image file" in \
        one_error_line(done)


@pytest.mark.parametrize("cache,message", [
    ("a_file", "error: $H3_STREAM_CACHE '{cache}': is a file, not a folder, so the tiny default model cannot be "
               "written there; set H3_STREAM_CACHE to a folder you can write, or unset it.\n"),
    ("a_file/below", "error: $H3_STREAM_CACHE '{cache}': cannot be written (Not a directory), so the tiny default "
                     "model cannot be written there; set H3_STREAM_CACHE to a folder you can write, or unset it.\n"),
    ("/proc", "error: $H3_STREAM_CACHE '/proc': cannot be written ("),
    ("/sys", "error: $H3_STREAM_CACHE '/sys': cannot be written ("),
])
def test_unusable_cache_folder_names_the_variable(cache, message, run_cli, tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    cache = cache if cache.startswith("/") else str(tmp_path / cache)
    stderr = one_error_line(run_cli(["generate", "x"], tmp_path, H3_STREAM_CACHE=cache))
    assert stderr.startswith(message.format(cache=cache)), stderr


# ---- every check that needs no model runs before any model is resolved or loaded ---------------------------------


@pytest.mark.parametrize("args", [
    ["--seed", "-5"], ["--steps", "1"], ["--video-shift", "0"], ["--size", "100x64"], ["--frames", "0"],
    ["--out", "clip.avi"], ["--device", "cuda"], ["--first-frame", "missing.png"], ["--memory-budget", "inf"],
])
def test_checks_run_before_the_model_is_resolved(args, monkeypatch, capsys, tmp_path):
    from h3_core.sources import model_sources as sources
    from h3_core.sources import tiny_default

    touched = []
    monkeypatch.setattr(tiny_default, "ensure_tiny_model", lambda *a, **k: touched.append("tiny model"))
    monkeypatch.setattr(sources, "resolve_model", lambda *a, **k: touched.append("resolve"))
    monkeypatch.setattr(H3Pipeline, "component", lambda self, name: touched.append(name))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["generate", "x", *args]) == 2
    assert touched == []
    assert capsys.readouterr().err.startswith("error: --")


# ---- large requests ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args,reason", [
    (["--size", "4096x4096"], "--size 4096x4096 is 16.8 megapixels, past the 2.1-megapixel (1920x1088) threshold."),
    (["--steps", "100000"], "--steps 100000 is past the 200-step threshold."),
])
def test_large_requests_are_refused_with_their_estimate(args, reason, tiny, run_cli, tmp_path):
    stderr = one_error_line(run_cli(["generate", "x", *args], tmp_path))
    assert stderr.startswith(f"error: this is a large request: {reason} Estimated peak memory "), stderr
    assert "of transformer work over" in stderr and "Both are rough estimates" in stderr
    assert stderr.endswith("Pass --yes-large to run it anyway, or use a smaller --size, fewer --steps or fewer "
                           "--seconds.\n")


def test_yes_large_runs_a_large_request(tiny, monkeypatch, capsys, tmp_path):
    """With --yes-large the request goes on to the models (stopped here at the first load), saying its estimate."""
    monkeypatch.setenv("H3_STREAM_CACHE", str(tiny.parent))

    def stop(self, name):
        raise KeyboardInterrupt

    monkeypatch.setattr(H3Pipeline, "component", stop)
    out = tmp_path / "big.mp4"
    assert cli.main(["generate", "x", "--steps", "201", "--size", "64x32", "--frames", "5", "--out", str(out),
                     "--yes-large"]) == 130
    err = capsys.readouterr().err
    assert err.startswith("large request (--steps 201 is past the 200-step threshold), run because of --yes-large: "
                          "Estimated peak memory ")
    assert err.endswith("interrupted; nothing was written\n")


def test_the_estimate_follows_the_request(tiny):
    from h3_core.sources import resolve_model

    sources = resolve_model(tiny)
    small = estimate_request(sources, device="cpu", width=96, height=64, num_frames=39, steps=3)
    big = estimate_request(sources, device="cpu", width=4096, height=4096, num_frames=39, steps=3)
    steps = estimate_request(sources, device="cpu", width=96, height=64, num_frames=39, steps=301)
    assert big.peak_bytes > small.peak_bytes and big.transformer_flops > 1000 * small.transformer_flops
    assert steps.model_calls == 300 and steps.transformer_flops == pytest.approx(150 * small.transformer_flops)
    assert large_request_reasons(96, 64, 3, small, memory_bytes=10 * 2**30) == []
    assert large_request_reasons(96, 64, 3, small, memory_bytes=small.peak_bytes - 1) == [
        f"the estimated peak memory {_gib(small.peak_bytes)} is more than this machine's "
        f"{_gib(small.peak_bytes - 1)}"]


def _gib(n):
    from h3_core.planning.memory_plan import format_bytes

    return format_bytes(n)


# ---- the progress bar's line ends before an error ------------------------------------------------------------------


def test_error_after_progress_starts_on_its_own_line(tiny, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("H3_STREAM_CACHE", str(tiny.parent))

    def fails_mid_sampling(self, prompt, *, progress, **kwargs):
        progress(0, 4)
        progress(1, 4)
        raise H3Error("the transformer produced NaN/Inf at step 2.")

    monkeypatch.setattr(H3Pipeline, "generate", fails_mid_sampling)
    assert cli.main(["generate", "x", "--out", str(tmp_path / "o.mp4")]) == 2
    lines = capsys.readouterr().err.split("\n")
    assert lines[-2] == "error: the transformer produced NaN/Inf at step 2."
    assert lines[-3].startswith("\rsampling [") and " 0/4 " in lines[-3] and lines[-3].rstrip().endswith("left")


# ---- options the memory planner must see ---------------------------------------------------------------------------


def plan_options(tiny, **kwargs):
    from h3_core.planning.phase_plans import plan_components
    from h3_core.sources import resolve_model

    logged = []
    options = plan_components(resolve_model(tiny), width=96, height=64, num_frames=39, log=logged.append, **kwargs)
    return options, "\n".join(logged)


def test_memory_budget_keeps_the_text_encoders_chunk_size(tiny):
    options, _ = plan_options(tiny, memory_budget_gb=100, chunk_size=256)
    assert options["text_encoder"]["chunk_size"] == 256 and options["transformer"]["chunk_size"] == 256
    options, _ = plan_options(tiny, chunk_size=256)
    assert options["text_encoder"]["chunk_size"] == 256 and options["transformer"]["chunk_size"] == 256


def test_memory_budget_plans_at_the_runs_dtype_and_residency(tiny):
    def transformer_weights(described):
        line = next(line for line in described.splitlines() if line.strip().startswith("transformer "))
        return line.split("weights")[1].split("activations")[0].strip()

    _, fp32 = plan_options(tiny, memory_budget_gb=100, dtype=torch.float32)
    _, bf16 = plan_options(tiny, memory_budget_gb=100, dtype=torch.bfloat16)
    # The tiny transformer is stored in float32: planned in bf16 its matrices take half the bytes (norms and
    # modulation tables stay float32).
    assert (transformer_weights(fp32), transformer_weights(bf16)) == ("0.9 MiB", "0.5 MiB")
    options, _ = plan_options(tiny, memory_budget_gb=100, residency="layerwise")
    assert {name: opts.get("residency") for name, opts in options.items()} == {
        "text_encoder": "layerwise", "transformer": "layerwise", "video_vae": "layerwise",
        "audio_vae": "layerwise"}


def test_cli_passes_dtype_to_the_planner(tiny, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("H3_STREAM_CACHE", str(tiny.parent))
    monkeypatch.setattr(H3Pipeline, "generate", lambda self, *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    seen = {}
    for dtype in ("fp32", "bf16"):
        assert cli.main(["generate", "x", "--memory-budget", "100", "--dtype", dtype, "--out",
                         str(tmp_path / "o.mp4")]) == 130
        seen[dtype] = next(line for line in capsys.readouterr().out.splitlines()
                           if line.strip().startswith("transformer ")).split("activations")[0]
    assert "0.9 MiB" in seen["fp32"] and "0.5 MiB" in seen["bf16"]


def test_the_plan_assumes_the_backends_prefetch(tiny):
    from h3_core.planning.phase_plans import plan_for_budget
    from h3_core.runtime.offload_backends import AsyncBackend, OffloadBackend
    from h3_core.sources import resolve_model

    sources = resolve_model(tiny)
    for device, backend in (("cuda", AsyncBackend), ("cpu", OffloadBackend)):
        plan = plan_for_budget(sources, device=device, budget_bytes=100 * 2**30, width=96, height=64,
                               num_frames=39, residency="layerwise")
        assert {c.name: c.prefetch for c in plan.components} == dict.fromkeys(
            ("text_encoder", "transformer", "video_vae", "audio_vae"), backend.default_prefetch)
    assert AsyncBackend.default_prefetch == 1


def test_memory_sizes_are_said_in_gib():
    parser = cli.build_parser()
    generate = next(a for a in parser._subparsers._group_actions[0].choices["generate"]._actions
                    if a.dest == "memory_budget")
    assert generate.help.startswith("GiB the run may use")
    sources = list((ROOT / "h3_core").rglob("*.py")) + list((ROOT / "nodes").rglob("*.py"))
    import re

    # "GB" only where 1e9-byte units are meant (throughput in GB/s, download sizes in a docstring), and in the
    # memory profiles' names, the machines as they are sold ("24 GB GPU", "64 GB Mac": their memory is GiB).
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sources
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\bGB\b(?!/s)", line) and "130 GB" not in line
             and not re.search(r"\d+ GB (GPU|Mac)\b", line)]
    assert found == []


# ---- the same limits in the CLI, the Python API and the nodes ----------------------------------------------------


def test_api_checks_name_the_argument(tiny):
    from h3_core.sources import resolve_model

    pipe = H3Pipeline(resolve_model(tiny))
    request = dict(width=64, height=64, num_frames=5, steps=3, seed=1)
    for changes, message in (({"seed": 2**64}, f"seed {2**64}: must be a whole number from 0 to 2**64 - 1"),
                             ({"seed": -1}, "seed -1: must be a whole number"),
                             ({"steps": 1}, "steps 1: must be at least 2"),
                             ({"video_shift": float("inf")}, "video_shift inf: must be a finite number above 0"),
                             ({"audio_shift": 0.0}, "audio_shift 0.0: must be a finite number above 0"),
                             ({"width": 8192}, "width 8192 is past the 4096-pixel limit")):
        with pytest.raises(H3Error) as caught:
            pipe.generate("x", **{**request, **changes})
        assert str(caught.value).startswith(message)
    assert pipe.loaded == ()
    assert check_seed(2**64 - 1) == 2**64 - 1 and check_shift(0.1, "video_shift") == 0.1
    assert check_prompt("") == ""


@pytest.fixture
def pack(tmp_path):
    import comfy_double

    comfy_double.install(tmp_path / "comfyui")
    return comfy_double.load_pack()


def test_nodes_and_cli_share_the_duration_limit(pack):
    from comfy_api.latest._io import node_info

    inputs = node_info(pack["H3StreamEncodePrompt"])["input"]["required"]
    assert inputs["seconds"][1]["max"] == MAX_SECONDS == 15.0
    assert inputs["frames"][1]["max"] == MAX_FRAMES == 362
    encoder = pack["H3StreamEncodePrompt"]
    assert encoder.validate_inputs(362) is True
    # seconds past 15 is ComfyUI's own widget-maximum error (on seconds alone); a frame count is checked here.
    assert encoder.validate_inputs(379) == "frames 379 is 15.8 s of video; H3 generates at most 15 s (362 frames)."
    # The CLI refuses what the widgets refuse.
    with pytest.raises(cli.CliError, match="at most 15"):
        cli.resolve_frames(cli.build_parser().parse_args(["generate", "x", "--seconds", "15.1"]), {}, print)
    with pytest.raises(cli.CliError, match=r"\(362 frames\)"):
        cli.resolve_frames(cli.build_parser().parse_args(["generate", "x", "--frames", "379"]), {}, print)


def test_sampler_shift_widgets_cannot_hold_zero(pack):
    from comfy_api.latest._io import node_info
    from comfy_double.core_nodes import CORE_NODES
    from comfy_double.executor import PromptError, PromptExecutor

    inputs = node_info(pack["H3StreamAVSampler"])["input"]["required"]
    for name in ("video_shift", "audio_shift"):
        assert inputs[name][1]["min"] == 0.1
        check_shift(inputs[name][1]["min"], name)  # the smallest value the widget takes runs
    prompt = json.loads((ROOT / "example_workflows" / "api" / "H3 - Text to Video and Audio.json").read_text())
    prompt["3"]["inputs"]["video_shift"] = 0.0
    with pytest.raises(PromptError, match=r"video_shift: 0.0 is smaller than min 0.1"):
        PromptExecutor({**pack, **CORE_NODES}).validate(prompt)


def test_sampler_shift_error_at_run_time_names_the_widget(pack):
    from comfy_double.executor import run_node

    from h3_core.pipeline import Conditioning
    from h3_core.request.generation_request import GenerationRequest

    # A linked 0 (a widget cannot hold it): refused by the request before anything runs.
    cond = Conditioning(torch.zeros(1, 8), torch.zeros(1), request=GenerationRequest("x", width=96, height=64,
                                                                                       num_frames=5))
    with pytest.raises(H3Error, match=r"^audio_shift 0.0: must be a finite number above 0"):
        run_node(pack["H3StreamAVSampler"], "3", h3_model=SimpleNamespace(loras=()), h3_cond=cond, steps=3, seed=7,
                 video_shift=12.0, audio_shift=0.0, chunk_size=0)


def test_device_problems_on_a_machine_with_two_gpus(monkeypatch):
    """The index and driver cases, with torch's CUDA queries answering as a two-GPU machine would."""
    from h3_core.runtime.platform import device_problem

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device_problem("cuda") is None and device_problem("cuda:1") is None
    assert device_problem("cuda:7") == "there is no GPU 7: this machine has 2 (cuda:0 to cuda:1)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_problem("cuda") == ("PyTorch has CUDA support but finds no usable GPU (driver, "
                                      "CUDA_VISIBLE_DEVICES?)")
    assert device_problem("cpu") is None and device_problem("cpu:1") == ("the CPU is one device (cpu or cpu:0), "
                                                                         "not cpu:1")
    assert device_problem("meta") == "h3-stream runs on cpu, cuda, cuda:N or mps, not on 'meta' devices"


# ---- --transformer: a quantised or GGUF transformer file with the rest of the model --------------------------------


def test_the_cli_generates_with_a_gguf_transformer_file(tiny, run_cli, tmp_path):
    # Before: the README said the CLI loads GGUF transformers, but only `--model` folders were read, whose ComfyUI
    # layout takes .safetensors files only. The tiny model is fp32: its Q8_0 file runs at the default --dtype auto.
    from h3_core.checkpoints.quantiser import quantise_checkpoint

    gguf = quantise_checkpoint(tiny / "diffusion_models" / "minimax_h3_tiny_fl2va_fp32.safetensors",
                               tmp_path / "h3_q8_0.gguf", "q8_0")
    common = ["--seconds", "0.2", "--size", "64x64", "--steps", "2"]
    quantised = run_cli(["generate", "x", *common, "--transformer", str(gguf), "--out", "q.mp4"], tmp_path)
    assert quantised.returncode == 0, quantised.stderr
    assert f"transformer: {gguf} (--transformer)" in quantised.stdout
    plain = run_cli(["generate", "x", *common, "--out", "plain.mp4"], tmp_path)
    assert plain.returncode == 0, plain.stderr
    # Same seed, same everything else: only the transformer's weights differ (by the Q8_0 rounding).
    assert (tmp_path / "q.mp4").read_bytes() != (tmp_path / "plain.mp4").read_bytes()


@pytest.mark.parametrize("args,message", [
    (["--transformer", "missing.gguf"], "error: --transformer missing.gguf: no such file or folder.\n"),
    (["--partition", "ref2va", "--ref-audio", "."], "error: --ref-audio .: is a folder; give a file inside it.\n"),
    (["--partition", "ref2va", "--ref-video", "."], "error: --ref-video .: is a folder; give a file inside it.\n"),
])
def test_a_missing_or_folder_file_flag_is_one_line(args, message, tiny, run_cli, tmp_path):
    # Before: a folder given as --ref-audio / --ref-video was "no such file".
    assert one_error_line(run_cli(["generate", "x", *args], tmp_path)) == message


# ---- the server's API key: one line of printable ASCII, never shown ----------------------------------------------

SECRET = "sk-h3-secret"


@pytest.mark.parametrize("key,what", [(f"{SECRET}\n", "a line break at character 13 of 13"),
                                      (f"{SECRET}\r\nX-Injected: 1", "a line break at character 13 of 27"),
                                      (f"{SECRET} extra", "a space at character 13 of 18"),
                                      (f"{SECRET}ключ", "a character that is not printable ASCII at character 13")])
def test_an_api_key_no_header_can_carry_is_one_line_that_never_shows_it(key, what, run_cli, tmp_path):
    # Before: http.client's "Invalid header value b'Bearer sk-...'" traceback (the key in the log) or a
    # UnicodeEncodeError, after the flags were accepted. The server address is never contacted.
    done = run_cli(["generate", "x", "--server", "http://127.0.0.1:9"], tmp_path, H3_STREAM_API_KEY=key)
    stderr = one_error_line(done)
    assert stderr.startswith(f"error: $H3_STREAM_API_KEY: the API key holds {what}"), stderr
    assert SECRET not in stderr and SECRET not in done.stdout and "127.0.0.1:9" not in stderr


def test_an_api_key_argument_is_checked_the_same_way():
    from h3_core.remote import RemoteEngine

    with pytest.raises(H3Error, match=r"^api_key: the API key holds a line break at character 13") as info:
        RemoteEngine("http://127.0.0.1:9", api_key=f"{SECRET}\n")
    assert SECRET not in str(info.value)
