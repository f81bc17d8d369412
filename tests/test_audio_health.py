"""Audio health (h3_core/request/audio_health.py): each bad waveform users report — NaN/Inf, a constant -1.0 or 0.0,
near-constant, DC offset, clipping, silence — gets its message; good audio (speech-like, music-like, the tiny model's
real decode) gets none. Surfaces: the pipeline raises before anything is returned, the CLI exits 2 with nothing
written (warnings: one stderr line each, the file written), the decode node raises (warnings in its progress text),
and a server's soundtrack (the videos-API stand-in sending a bad AAC track) is checked the same way.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from h3_fixtures import tiny_copy_with
from videos_api_server import FRAMES, HEIGHT, WIDTH, Behaviour, VideosApiServer, make_mp4

from h3_core.errors import H3Error
from h3_core.models.audio_vae import AudioVAE
from h3_core.pipeline import H3Pipeline
from h3_core.request.audio_health import ERROR, WARNING, AudioHealthError, check_audio, raise_audio_errors
from h3_core.sources import resolve_model

RATE = 32000
SECONDS = 5
N = RATE * SECONDS


def _time(n=N):
    return torch.arange(n, dtype=torch.float64) / RATE


def speech_like(n=N) -> torch.Tensor:
    """A voiced 140 Hz source with 20 harmonics falling off, syllables at 3 Hz and pauses, a little breath noise:
    about -28 dBFS RMS, as dialogue is mastered."""
    t = _time(n)
    g = torch.Generator().manual_seed(1)
    voice = sum((0.1 / k) * torch.sin(2 * math.pi * 140 * k * t + k) for k in range(1, 21))
    syllables = (0.5 + 0.5 * torch.sin(2 * math.pi * 3 * t)).clamp(min=0) * (torch.sin(2 * math.pi * 0.4 * t) > -0.3)
    mono = voice * syllables + 0.003 * torch.randn(n, generator=g, dtype=torch.float64)
    return torch.stack([mono, 0.8 * mono.roll(40)]).float()


def music_like(n=N) -> torch.Tensor:
    """A bass line, a chord, a hi-hat of noise bursts at 4 per second: about -16 dBFS RMS, peaks under 0.6."""
    t = _time(n)
    g = torch.Generator().manual_seed(2)
    bass = 0.2 * torch.sin(2 * math.pi * 55 * t) * (1 + 0.3 * torch.sin(2 * math.pi * 0.5 * t))
    chord = sum(0.06 * torch.sin(2 * math.pi * f * t) for f in (261.6, 329.6, 392.0))
    hats = 0.05 * torch.randn(n, generator=g, dtype=torch.float64) * ((t * 4) % 1 < 0.05)
    return torch.stack([bass + chord + hats, bass + 0.9 * chord + hats.roll(100)]).float()


def with_nan(w):
    w = w.clone()
    w[1, 1234] = float("nan")
    return w


def with_inf(w):
    w = w.clone()
    w[0, -1] = float("-inf")  # in the last samples, which the level statistics leave out: still found
    return w


def near_constant(n=N):
    g = torch.Generator().manual_seed(3)
    return torch.full((2, n), -0.98) + 2e-4 * torch.randn(2, n, generator=g)


def clipped(gain):
    return lambda: (music_like() * gain).clamp(-1.0, 1.0)


def silence(n=N):
    g = torch.Generator().manual_seed(4)
    return 3e-4 * torch.randn(2, n, generator=g)  # -70 dBFS hiss


BAD = {  # name: (waveform, symptom, severity, words of the likely cause)
    "nan": (lambda: with_nan(music_like()), "non-finite samples", ERROR, "1 NaN and 0 Inf"),
    "inf": (lambda: with_inf(music_like()), "non-finite samples", ERROR, "0 NaN and 1 Inf"),
    "constant -1.0": (lambda: torch.full((2, N), -1.0), "constant -1.0 waveform", ERROR, "saturated"),
    "constant +1.0": (lambda: torch.full((2, N), 1.0), "constant +1.0 waveform", ERROR, "saturated"),
    "constant 0.0": (lambda: torch.zeros(2, N), "constant 0.0 waveform", ERROR, "weights are zero or missing"),
    "constant 0.3": (lambda: torch.full((2, N), 0.3), "constant waveform", ERROR, "DC level only"),
    "one channel zero": (lambda: torch.stack([music_like()[0], torch.zeros(N)]), "constant 0.0 waveform", ERROR,
                         "the right channel"),
    "near-constant": (near_constant, "near-constant waveform", ERROR, "driven against its clamp"),
    "dc offset": (lambda: music_like() + 0.15, "DC offset", WARNING, "DC path"),
    "clipped a little": (clipped(3.0), "clipping", WARNING, "past full scale"),
    "clipped mostly": (clipped(20.0), "clipping", ERROR, "far outside its range"),
    "silence": (silence, "silence", WARNING, "-70"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_each_bad_waveform_gets_its_message(name):
    make, symptom, severity, words = BAD[name]
    findings = check_audio(make())
    assert [(f.symptom, f.severity) for f in findings] == [(symptom, severity)], [f.message for f in findings]
    assert words in findings[0].message and "Likely cause: " in findings[0].message
    if severity == ERROR:
        with pytest.raises(AudioHealthError, match=re.escape(f"the test audio failed its audio health check: {symptom}")):
            raise_audio_errors(findings, "the test audio")
    else:
        assert raise_audio_errors(findings) == findings


@pytest.mark.parametrize("make", [speech_like, music_like, lambda: music_like() * 0.05])
def test_good_audio_gets_no_message(make):
    assert check_audio(make()) == []


def test_a_clip_that_is_quiet_but_heard_is_not_silence():
    assert check_audio(speech_like() * 0.1) == []  # -48 dBFS: quiet dialogue, not silence


def test_a_server_soundtrack_names_the_server():
    finding, = check_audio(torch.full((2, N), -1.0), remote=True)
    assert "the server's audio VAE decoder saturated" in finding.message and "check the server's H3" in finding.fix


def test_a_waveform_that_is_not_channels_by_samples_is_refused():
    with pytest.raises(H3Error, match=r"expected a float tensor \[channels, samples\], got \(1, 2, 10\)"):
        check_audio(torch.zeros(1, 2, 10))


# ---- the pipeline (CLI and Python API) -------------------------------------------------------------------------------

REQUEST = dict(width=64, height=64, num_frames=5, steps=3, seed=5)


def test_the_tiny_models_real_decode_is_healthy(tiny):
    pipe = H3Pipeline(resolve_model(tiny))
    for seed in (0, 5):
        result = pipe.generate("A dog barks in the rain.", **{**REQUEST, "seed": seed, "num_frames": 22})
        assert check_audio(result.waveform) == [] and result.audio_warnings == ()


@pytest.mark.parametrize("value,symptom", [(0.0, "constant 0.0 waveform"), (1e4, "clipping: ")])
def test_a_broken_decoder_stops_the_run_before_anything_is_returned(tiny, tmp_path, value, symptom):
    """Real decodes of a broken file: the last convolution zeroed gives exact zeros, blown up it pins the waveform to
    the clamp (the tiny-v1 decoder's 85 % of clipped samples, made worse)."""
    root, path = tiny_copy_with(tiny, tmp_path, "vae/minimax_h3_audio_vae*.safetensors", "decoder.conv_post.weight",
                                value)
    with pytest.raises(AudioHealthError) as caught:
        H3Pipeline(resolve_model(root)).generate("x", **REQUEST)
    assert str(caught.value).startswith(f"the audio decoded by {path} failed its audio health check: {symptom}")


def fake_decode(monkeypatch, make):
    """The audio VAE's decode replaced by one giving `make(n)` for its latents (the waveform a broken decoder gives)."""

    def decode(self, latent, *, check_interrupt=None):
        return make(latent.shape[-1] * 800)[None].to(latent.device)

    monkeypatch.setattr(AudioVAE, "decode", decode)


def test_warnings_reach_the_result_and_the_log(tiny, monkeypatch):
    fake_decode(monkeypatch, lambda n: music_like(n) + 0.15)
    logged = []
    result = H3Pipeline(resolve_model(tiny), log=logged.append).generate("x", **REQUEST)
    assert [f.symptom for f in result.audio_warnings] == ["DC offset"]
    assert [line for line in logged if line.startswith("audio warning: DC offset: ")]


def test_the_cli_writes_nothing_on_an_error(run_cli, tmp_path, monkeypatch):
    fake_decode(monkeypatch, lambda n: torch.full((2, n), -1.0))
    out = tmp_path / "clip.mp4"
    run = run_cli(["generate", "A fox.", "--out", out], tmp_path)
    assert run.returncode == 2
    assert "failed its audio health check: constant -1.0 waveform: every channel holds one value" in run.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written, no frames folder, no wav


def test_the_cli_prints_each_warning_on_one_line_and_writes_the_file(run_cli, tmp_path, monkeypatch):
    fake_decode(monkeypatch, lambda n: (music_like(n) * 3.0).clamp(-1, 1) + 0.15)
    out = tmp_path / "clip.mp4"
    run = run_cli(["generate", "A fox.", "--out", out], tmp_path)
    assert run.returncode == 0, run.stderr
    warnings = [line for line in run.stderr.splitlines() if line.startswith("warning: audio warning: ")]
    assert [line.split(": ")[2] for line in warnings] == ["DC offset", "clipping"]
    assert any(tmp_path.iterdir())


# ---- the decode node ---------------------------------------------------------------------------------------------


@pytest.fixture
def pack(tmp_path):
    import comfy_double

    comfy_double.install(tmp_path / "comfyui")
    return comfy_double.load_pack()


def decode_node(pack):
    from comfy_double.executor import run_node

    loader = dict(source="tiny test model (embedded)", partition="FL2VA", transformer_residency="RESIDENT",
                  text_encoder_residency="RESIDENT", video_vae_residency="RESIDENT", audio_vae_residency="RESIDENT",
                  prefetch=-1, resident_blocks=0, chunk_size=0, memory_budget_mib=0, dtype="auto", device="cpu")
    handle = run_node(pack["H3StreamLoader"], "1", **loader)[0]
    cond = run_node(pack["H3StreamEncodePrompt"], "2", h3_model=handle, prompt="A fox.", width=64, height=64,
                    seconds=1.0, frames=5)[0]
    latents, = run_node(pack["H3StreamAVSampler"], "3", h3_model=handle, h3_cond=cond, steps=3, seed=7,
                        video_shift=12.0, audio_shift=3.0, chunk_size=0)
    return lambda: run_node(pack["H3StreamDecodeAudio"], "5", h3_model=handle, h3_latent=latents)


def node_texts(node):
    import server

    server.PromptServer.instance.client_id = "tab-a"
    return [data["text"] for event, data, _ in server.PromptServer.instance.messages
            if event == "progress_text" and data["node"] == node]


def test_the_decode_node_raises_the_error_and_shows_warnings(pack, monkeypatch):
    node_texts("5")
    decode = decode_node(pack)
    fake_decode(monkeypatch, lambda n: torch.zeros(2, n))
    with pytest.raises(AudioHealthError, match="constant 0.0 waveform: every channel is exactly silent"):
        decode()
    fake_decode(monkeypatch, silence)
    audio, = decode()
    assert audio["waveform"].shape[:2] == (1, 2)
    text = node_texts("5")[-1]
    warning, memory = text.split("\n")  # the warning first: the frontend shows the first line
    assert warning.startswith("audio warning: silence: the whole clip's RMS is -70") and \
        memory.startswith("audio decode: peak RAM")
    monkeypatch.undo()
    decode()  # the tiny model's own decode: the memory line only
    assert "audio warning" not in node_texts("5")[-1]


# ---- a server's soundtrack -------------------------------------------------------------------------------------


def remote(soundtrack):
    from h3_core.remote import RemoteEngine

    with VideosApiServer(Behaviour(mp4=make_mp4(soundtrack=soundtrack))) as server:
        engine = RemoteEngine(server.url, poll_interval=0.01, backoff=0.01, attempts=2)
        return engine.generate("x", width=WIDTH, height=HEIGHT, num_frames=FRAMES, steps=3, seed=7)


@pytest.mark.parametrize("soundtrack,symptom", [("constant-1", "near-constant waveform"),
                                                ("zeros", "constant 0.0 waveform")])
def test_a_bad_server_soundtrack_is_an_error_naming_the_server(soundtrack, symptom):
    """AAC turns a constant -1.0 into -0.95 with ramps at both ends: still found (near-constant)."""
    with pytest.raises(AudioHealthError) as caught:
        remote(soundtrack)
    message = str(caught.value)
    assert message.startswith("the soundtrack of the video of job ") and f"audio health check: {symptom}" in message
    assert "the server's" in message


@pytest.mark.parametrize("soundtrack,symptom", [("dc", "DC offset"), ("quiet", "silence")])
def test_a_usable_server_soundtrack_comes_with_its_warning(soundtrack, symptom):
    assert [f.symptom for f in remote(soundtrack).audio_warnings] == [symptom]


def test_the_remote_node_shows_the_warning(pack):
    from comfy_double.executor import run_node

    node_texts("9")
    with VideosApiServer(Behaviour(mp4=make_mp4(soundtrack="dc"))) as server:
        run_node(pack["H3StreamGenerateRemote"], "9", server_url=server.url, prompt="x", width=WIDTH, height=HEIGHT,
                 seconds=4.5, frames=FRAMES, steps=3, seed=7, video_shift=12.0, audio_shift=3.0)
    assert node_texts("9")[-1].startswith("audio warning: DC offset: the left and right channels sit off zero")
