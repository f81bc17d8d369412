"""Long videos and extensions (issue 30): windows of at most 15 s, each after the first guided by the previous
window's last 22 frames and their soundtrack, cross-faded, streamed into one mp4; an extension copies the clip's
frames unchanged. The end-to-end runs use the tiny model with a lighter audio decoder (tests/long_video_fixtures.py:
the tiny model's own decoder takes about 20 s per 15 s window on a CPU) at a 64x32 canvas and 2 steps."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from long_video_fixtures import tinier_audio_model

from h3_core.errors import H3Error
from h3_core.request.generation_request import GenerationRequest
from h3_core.request.grid import FPS, MAX_FRAMES, is_aligned_num_frames
from h3_core.request.windows import (OVERLAP_FRAMES, audio_sample, crossfade, extension_frame_count,
                                     long_frame_count, parse_prompt_schedule, plan_windows, window_seed)

av = pytest.importorskip("av")

CANVAS = dict(width=64, height=32, steps=2)


# ---- the arithmetic -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seconds", [15.1, 16, 29.9, 45, 60, 61.3, 600])
def test_windows_cover_the_video_once_on_the_grid(seconds):
    total = long_frame_count(seconds)
    windows = plan_windows(total)
    assert total == math.ceil((round(seconds * FPS) - 5) / 17) * 17 + 5  # rounded up to 17n + 5, as a short clip
    assert windows[0].start == 0 and windows[0].overlap == 0
    assert all(w.overlap == OVERLAP_FRAMES for w in windows[1:])
    assert all(is_aligned_num_frames(w.num_frames) and w.num_frames <= MAX_FRAMES for w in windows)
    # each window starts where the previous one's overlap starts; the overlap is counted once
    assert all(b.start == a.end - OVERLAP_FRAMES for a, b in zip(windows, windows[1:]))
    assert windows[-1].end == total
    assert sum(w.num_frames - w.overlap for w in windows) == total
    # as few windows as fit, all full but the last two, which share the rest (no stub of a last window)
    assert len(windows) == 1 + math.ceil(max(0, total - MAX_FRAMES) / (MAX_FRAMES - OVERLAP_FRAMES))
    if len(windows) > 1:
        assert all(w.num_frames == MAX_FRAMES for w in windows[:-2])
        assert 0 <= windows[-2].num_frames - windows[-1].num_frames <= 17 and windows[-1].num_frames >= 8 * FPS


@pytest.mark.parametrize("seconds", [0.5, 5, 15, 30])
def test_extension_windows_are_all_guided_and_add_whole_chunks(seconds):
    new = extension_frame_count(seconds)
    assert new % 17 == 0 and new >= round(seconds * FPS)
    windows = plan_windows(new, guided_first=True)
    assert all(w.overlap == OVERLAP_FRAMES for w in windows)
    assert windows[0].start == -OVERLAP_FRAMES and windows[-1].end == new
    assert all(w.num_frames <= MAX_FRAMES and is_aligned_num_frames(w.num_frames) for w in windows)
    assert all(w.num_frames == MAX_FRAMES for w in windows[:-2])


def test_window_seeds_are_the_seed_first_then_distinct_and_repeatable():
    assert window_seed(42, 0) == 42
    seeds = [window_seed(42, i) for i in range(50)]
    assert len(set(seeds)) == 50 and all(0 <= s < 2**64 for s in seeds)
    assert seeds == [window_seed(42, i) for i in range(50)]
    assert window_seed(2**64 - 1, 3) < 2**64


def test_crossfade_passes_what_both_agree_on_and_moves_from_one_to_the_other():
    a = torch.rand(22, 4, 4, 3)
    assert torch.allclose(crossfade(a, a.clone(), dim=0), a)
    b = torch.zeros_like(a)
    faded = crossfade(torch.ones_like(a), b, dim=0)
    weights = faded[:, 0, 0, 0]
    assert torch.all(weights[1:] < weights[:-1])  # fades out
    assert weights[0] < 1 and weights[-1] > 0  # neither end repeats a window: the overlap is blended throughout


def test_prompt_schedule_parses_and_refuses_bad_times():
    schedule = parse_prompt_schedule("0: a beach at dawn; 15: noon\n30s: night", 45.0)
    assert schedule.entries == ((0.0, "a beach at dawn"), (15.0, "noon"), (30.0, "night"))
    assert [schedule.prompt_at(t) for t in (0, 14.9, 15, 44)] == ["a beach at dawn", "a beach at dawn", "noon",
                                                                   "night"]
    for text, words in [("a beach", "has no time"), ("x: a beach", "is not a time"), ("0: a; 5: b; 3: c", "increasing"), ("0: a; 50: b", "past the end"), ("1: a", "start it at 0"),
                        ("", "is empty"), ("0: a; -3: b", "0 or more")]:
        with pytest.raises(H3Error, match=words):
            parse_prompt_schedule(text, 45.0)


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), 601])
def test_durations_out_of_range_are_refused(seconds):
    with pytest.raises(H3Error, match="seconds"):
        long_frame_count(seconds)
    with pytest.raises(H3Error, match="seconds"):
        extension_frame_count(seconds)


class DriftingWindows:
    """A stand-in for the model in the stitching test only (the end-to-end tests run the tiny model): every window
    shows the same smooth global signal (a slow brightness wave, a 440 Hz tone) plus an offset of its own, as windows
    whose guide is followed closely but not exactly. A hard cut at a seam would jump by the offsets' difference."""

    def __init__(self, windows, offsets):
        self.windows, self.offsets, self.calls = windows, offsets, 0

    def generate(self, request, **kwargs):
        from h3_core.request.generation_result import GenerationResult

        window, offset = self.windows[self.calls], self.offsets[self.calls]
        self.calls += 1
        g = torch.arange(window.start, window.end, dtype=torch.float32)
        level = 0.5 + 0.3 * torch.sin(2 * math.pi * g / 96) + offset
        frames = level.view(-1, 1, 1, 1).expand(-1, request.height, request.width, 3).clone()
        n = math.ceil(window.num_frames * 32000 / FPS)
        t = (audio_sample(window.start) + torch.arange(n, dtype=torch.float64)) / 32000
        tone = (0.3 * torch.sin(2 * math.pi * 440 * t)).float() + offset
        return GenerationResult(frames, torch.stack([tone, tone]))


def test_seams_are_cross_faded_over_the_overlap_not_cut_or_repeated(tmp_path):
    from h3_core.pipeline.long_video import generate_long_video

    total = long_frame_count(40)
    windows = plan_windows(total)
    offsets = [0.0, 0.08, -0.04][:len(windows)]
    assert len(windows) == 3
    generate_long_video(DriftingWindows(windows, offsets), GenerationRequest("a", **CANVAS), tmp_path / "o.mp4",
                        total_frames=total)
    frames, samples, *_ = read_video(tmp_path / "o.mp4")
    assert len(frames) == total
    level = frames.astype(np.float32).mean(axis=(1, 2, 3)) / 255
    step = np.abs(np.diff(level))
    inside = step.copy()
    for w in windows[1:]:
        inside[w.start - 1:w.start + OVERLAP_FRAMES] = np.nan
    wave_step = np.nanmax(inside)  # the windows' own largest frame-to-frame change
    for w, (before, after) in zip(windows[1:], zip(offsets, offsets[1:])):
        jump = abs(after - before)
        assert jump > 2 * wave_step  # what a hard cut here would show
        seam = step[w.start - 1:w.start + OVERLAP_FRAMES]
        # spread over the 22 frames: each step at most the wave's own plus 1/22 of the jump (+ the codec's rounding)
        assert seam.max() <= wave_step + jump / OVERLAP_FRAMES + 2 / 255, (seam.max(), wave_step)
        # the blend runs from one window to the other: its middle sits between them
        g = w.start + OVERLAP_FRAMES // 2
        wave = 0.5 + 0.3 * math.sin(2 * math.pi * g / 96)
        assert abs(level[g] - (wave + (before + after) / 2)) < jump / OVERLAP_FRAMES + 2 / 255
    mean = samples.mean(axis=0)
    for w, (before, after) in zip(windows[1:], zip(offsets, offsets[1:])):  # the tone's DC moves, never jumps
        lo, hi = audio_sample(w.start), audio_sample(w.start + OVERLAP_FRAMES)
        dc = np.convolve(mean[lo - 4000:hi + 4000], np.ones(800) / 800, mode="valid")  # 40 cycles of 440 Hz
        assert np.abs(np.diff(dc)).max() < abs(after - before) / 100


# ---- end to end on the tiny model ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tinier(tiny, tmp_path_factory):
    return tinier_audio_model(tiny, tmp_path_factory.mktemp("tinier") / "model")


@pytest.fixture(scope="module")
def pipeline(tinier):
    from h3_core.pipeline import H3Pipeline
    from h3_core.sources.model_sources import resolve_model

    # Kept loaded: the windows of a run (and the tests of this module) then skip reloading the components.
    return H3Pipeline(resolve_model(tinier), keep_text_encoder=True, keep_transformer=True, keep_video_vae=True,
                      keep_audio_vae=True)


class RecordingPipeline:
    """The real pipeline, with each window's request and result recorded on their way."""

    def __init__(self, pipeline):
        self.pipeline, self.calls = pipeline, []

    def generate(self, request, **kwargs):
        result = self.pipeline.generate(request, **kwargs)
        self.calls.append((request, result))
        return result


def read_video(path):
    with av.open(str(path)) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        rate, sample_rate, channels = video.average_rate, audio.rate, audio.channels
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    with av.open(str(path)) as container:
        samples = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)
    return frames, samples, rate, sample_rate, channels


def neighbour_differences(frames: np.ndarray) -> np.ndarray:
    return np.abs(np.diff(frames.astype(np.float32) / 255, axis=0)).mean(axis=(1, 2, 3))


def assert_seams_within_the_windows_range(frames, samples, seams, overlap=OVERLAP_FRAMES):
    """At each seam (the frames and samples from the last one before the overlap to the first after it), the
    frame-to-frame and sample-to-sample differences stay within the range of the windows' own neighbouring
    differences (everything away from the seams)."""
    video = neighbour_differences(frames)
    sound = np.abs(np.diff(samples, axis=1)).max(axis=0)
    seam_frames = np.zeros(len(video), bool)
    seam_samples = np.zeros(len(sound), bool)
    for start in seams:
        seam_frames[max(0, start - 1):start + overlap] = True
        seam_samples[max(0, audio_sample(start) - 1024):audio_sample(start + overlap) + 1024] = True
    inside, at_seams = video[~seam_frames], video[seam_frames]
    assert at_seams.max() <= inside.max() + 1e-6, (at_seams.max(), inside.max())
    inside, at_seams = sound[~seam_samples[:len(sound)]], sound[seam_samples[:len(sound)]]
    assert at_seams.max() <= inside.max() + 1e-6, (at_seams.max(), inside.max())


def test_a_45_second_video_is_one_mp4_of_the_right_length_with_smooth_seams(pipeline, tmp_path):
    from h3_core.pipeline.long_video import generate_long_video

    recording = RecordingPipeline(pipeline)
    seen = []
    total = long_frame_count(45)
    out = tmp_path / "long.mp4"
    result = generate_long_video(recording, GenerationRequest("a beach", seed=7, **CANVAS), out,
                                 total_frames=total, on_window=lambda w, n: seen.append((w.index, n)))
    frames, samples, rate, sample_rate, channels = read_video(out)
    assert len(frames) == total == 1093 and result.num_frames == total
    assert rate == FPS and sample_rate == 32000 and channels == 2
    assert abs(samples.shape[1] - math.ceil(total * 32000 / FPS)) <= 1024  # the AAC encoder's last block
    windows = result.windows
    assert seen == [(i, len(windows)) for i in range(len(windows))] and len(windows) == 4
    assert [r.num_frames for r, _ in recording.calls] == [w.num_frames for w in windows]
    assert [r.seed for r, _ in recording.calls] == [window_seed(7, i) for i in range(4)]
    assert_seams_within_the_windows_range(frames, samples, [w.start for w in windows[1:]])
    assert [p.name for p in tmp_path.iterdir()] == ["long.mp4"]  # no staging file left


def test_each_window_after_the_first_receives_the_previous_windows_last_frames_and_soundtrack(pipeline, tmp_path):
    """The guide reaches the pipeline: each window's request carries, at frame 0, exactly the last 22 frames the
    previous window made and the samples under them (recorded on the way to the real pipeline)."""
    from h3_core.pipeline.long_video import generate_long_video

    recording = RecordingPipeline(pipeline)
    total = long_frame_count(17)
    generate_long_video(recording, GenerationRequest("a", seed=3, **CANVAS), tmp_path / "o.mp4", total_frames=total)
    (first, made), (second, _) = recording.calls
    assert first.guides == ()
    (guide,) = second.guides
    window = plan_windows(total)[1]
    assert guide.frame == 0 and guide.kind == "video_audio" and guide.sample_rate == 32000
    assert torch.equal(guide.frames, made.frames[-OVERLAP_FRAMES:])
    cut = audio_sample(window.start)
    assert guide.audio.shape == (2, math.ceil(OVERLAP_FRAMES * 32000 / FPS))
    assert torch.equal(guide.audio, made.waveform[:, cut:cut + guide.audio.shape[1]])


def test_the_pipeline_honours_the_overlap_guide(pipeline):
    from h3_core.request.guides import Guide

    request = GenerationRequest("a", num_frames=39, seed=5, **CANVAS)
    plain = pipeline.generate(request)
    guide = Guide(frame=0, frames=torch.rand(22, 32, 64, 3, generator=torch.Generator().manual_seed(1)))
    guided = pipeline.generate(request.replace(guides=(guide,)))
    assert not torch.equal(plain.frames, guided.frames)


def test_a_prompt_schedule_gives_each_window_its_prompt(pipeline, tmp_path):
    from h3_core.pipeline.long_video import generate_long_video

    recording = RecordingPipeline(pipeline)
    total = long_frame_count(17)
    schedule = parse_prompt_schedule("0: dawn; 8: noon; 12: dusk", total / FPS)
    generate_long_video(recording, GenerationRequest("unused", **CANVAS), tmp_path / "o.mp4", total_frames=total,
                        schedule=schedule)
    windows = plan_windows(total)
    assert windows[1].start / FPS > 8 and windows[1].start / FPS < 12
    assert [r.prompt for r, _ in recording.calls] == ["dawn", "noon"]


@pytest.fixture(scope="module")
def fifteen_second_clip(pipeline, tmp_path_factory):
    from h3_core.request.media_files import write_mp4

    result = pipeline.generate(GenerationRequest("the clip", num_frames=MAX_FRAMES, seed=11, **CANVAS))
    return write_mp4(tmp_path_factory.mktemp("clip") / "clip.mp4", result.frames, result.waveform)


def test_extending_a_15_second_clip_keeps_its_frames_bitwise_and_adds_the_new_part(pipeline, fifteen_second_clip,
                                                                                  tmp_path):
    from h3_core.pipeline.long_video import generate_long_video
    from h3_core.request.streamed_mp4 import ClipToExtend

    clip = ClipToExtend.read(fifteen_second_clip, OVERLAP_FRAMES)
    original, original_samples, *_ = read_video(fifteen_second_clip)
    assert clip.num_frames == len(original) == MAX_FRAMES
    assert np.array_equal((clip.last_frames * 255).round().byte().numpy(), original[-OVERLAP_FRAMES:])
    recording = RecordingPipeline(pipeline)
    new = extension_frame_count(5)
    out = tmp_path / "extended.mp4"
    result = generate_long_video(recording, GenerationRequest("more", seed=2, steps=2), out, extend=clip,
                                 new_frames=new)
    frames, samples, rate, sample_rate, channels = read_video(out)
    assert len(frames) == result.num_frames == MAX_FRAMES + new
    assert rate == FPS and sample_rate == 32000 and channels == 2
    assert np.array_equal(frames[:MAX_FRAMES], original)  # the clip's frames, as decoded, bitwise
    (request, made), = recording.calls
    assert (request.width, request.height) == (64, 32)  # the clip's canvas
    assert torch.equal(request.guides[0].frames, clip.last_frames)
    assert torch.equal(request.guides[0].audio, clip.last_audio[:, :request.guides[0].audio.shape[1]])
    assert_seams_within_the_windows_range(frames, samples, [MAX_FRAMES - OVERLAP_FRAMES])


def test_an_interrupted_run_leaves_no_output_and_the_old_file_untouched(pipeline, tmp_path):
    from h3_core.pipeline.long_video import generate_long_video

    out = tmp_path / "o.mp4"
    out.write_bytes(b"an earlier video")
    windows_started = []

    def check_interrupt():
        if len(windows_started) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate_long_video(pipeline, GenerationRequest("a", **CANVAS), out, total_frames=long_frame_count(17),
                            on_window=lambda w, n: windows_started.append(w.index), check_interrupt=check_interrupt)
    assert out.read_bytes() == b"an earlier video"
    assert [p.name for p in tmp_path.iterdir()] == ["o.mp4"]


def test_the_preflight_plans_each_window_and_sums_their_time(tinier):
    from h3_core.planning.request_estimate import describe_windowed_estimate, estimate_request, format_flops
    from h3_core.sources.model_sources import resolve_model

    sources = resolve_model(tinier)
    windows = plan_windows(long_frame_count(45))
    each = [estimate_request(sources, device="cpu", width=64, height=32, num_frames=w.num_frames, steps=2,
                             keyframes=bool(w.overlap)) for w in windows]
    text = describe_windowed_estimate(sources, windows, device="cpu", width=64, height=32, steps=2)
    assert text.startswith("preflight: 4 windows, each planned as its own request")
    assert format_flops(sum(e.transformer_flops for e in each)) + " of transformer work in all" in text
    longest = estimate_request(sources, device="cpu", width=64, height=32, num_frames=MAX_FRAMES, steps=2)
    assert max(e.peak_bytes for e in each) <= longest.peak_bytes  # no window is planned past a 15 s request


def test_a_guided_window_is_planned_with_its_overlap_guide(tinier):
    """The plan and the preflight of a long video count the overlap guide a guided window carries: its rows in the
    transformer, its clip encode and its soundtrack's encode."""
    from h3_core.pipeline.long_video import planned_guides
    from h3_core.planning.phase_plans import plan_for_budget
    from h3_core.planning.request_estimate import estimate_request
    from h3_core.sources.model_sources import resolve_model

    sources = resolve_model(tinier)
    request = GenerationRequest("a", width=64, height=32, steps=2)
    assert planned_guides(request, plan_windows(MAX_FRAMES)) == ()  # one window: nothing guides it
    guides = planned_guides(request, plan_windows(long_frame_count(45)))
    assert [(g.frame, g.num_frames, g.audio is not None) for g in guides] == [(0, OVERLAP_FRAMES, True)]
    plain, guided = (estimate_request(sources, device="cpu", width=64, height=32, num_frames=MAX_FRAMES, steps=2,
                                      guides=g) for g in ((), guides))
    assert guided.transformer_flops > plain.transformer_flops
    plan = plan_for_budget(sources, budget_bytes=1 << 62, width=64, height=32, num_frames=MAX_FRAMES, steps=2,
                           guides=guides)
    assert {"keyframe encode", "reference audio encode"} <= {phase.name for phase in plan.phases}


# ---- the CLI --------------------------------------------------------------------------------------------------------


def write_clip(path: Path, *, fps=24, audio=True, frames=30, size=(64, 32), codec="libx264"):
    with av.open(str(path), "w", format="mp4") as container:
        video = container.add_stream(codec, rate=fps)
        video.width, video.height, video.pix_fmt = *size, "yuv420p"
        sound = None
        if audio:
            sound = container.add_stream("aac", rate=32000)
            sound.layout = "stereo"
        for i in range(frames):
            image = np.full((size[1], size[0], 3), i * 5 % 255, np.uint8)
            for packet in video.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        if sound is not None:
            block = av.AudioFrame.from_ndarray(np.zeros((2, 32000 * frames // fps), np.float32), format="fltp",
                                               layout="stereo")
            block.sample_rate = 32000
            for packet in [*sound.encode(block), *sound.encode()]:
                container.mux(packet)
    return path


@pytest.mark.parametrize("args, words", [
    (["--seconds", "601"], "at most 600"),
    (["--seconds", "0"], "more than 0"),
    (["--frames", "20000"], "at most 14400"),
    (["--seconds", "30", "--prompt-schedule", "0 a beach"], "has no time"),
    (["--seconds", "30", "--prompt-schedule", "0: a; 40: b"], "past the end"),
    (["--seconds", "30", "--prompt-schedule", "0: a; 10: b; 5: c"], "increasing"),
    (["--seconds", "30", "--server", "http://127.0.0.1:9"], "window by window on this machine"),
])
def test_cli_bad_long_video_flags_are_one_message_each(run_cli, tmp_path, args, words):
    run = run_cli(["generate", "a", "--size", "64x32", "--steps", "2", "--out", tmp_path / "o.mp4", *args], tmp_path)
    assert run.returncode == 2, run.stderr
    assert words in run.stderr and "Traceback" not in run.stderr
    assert run.stderr.count("error:") == 1
    assert not (tmp_path / "o.mp4").exists()


def test_cli_extend_refuses_another_frame_rate_a_missing_file_and_keyframes(run_cli, tmp_path):
    clip25 = write_clip(tmp_path / "c25.mp4", fps=25)
    for args, words in [(["--extend", clip25], "25 fps; H3 makes 24 fps"),
                        (["--extend", tmp_path / "missing.mp4"], "no such file"),
                        (["--extend", write_clip(tmp_path / "short.mp4", frames=10)], "at least 22 frames"),
                        (["--extend", write_clip(tmp_path / "odd.mp4", size=(80, 48))], "multiple of 32"),
                        (["--extend", write_clip(tmp_path / "c.mp4"), "--size", "96x64"], "own canvas"),
                        (["--extend", tmp_path / "c.mp4", "--first-frame", tmp_path / "x.png"], "drop them")]:
        run = run_cli(["generate", "a", "--steps", "2", "--seconds", "1", "--out", tmp_path / "o.mp4", *args],
                      tmp_path)
        assert run.returncode == 2, (args, run.stderr)
        assert words in run.stderr and "Traceback" not in run.stderr, (args, run.stderr)
        assert not (tmp_path / "o.mp4").exists()


def test_cli_extends_a_clip_without_audio_with_a_note(run_cli, tinier, tmp_path):
    clip = write_clip(tmp_path / "silent.mp4", audio=False, frames=39)
    run = run_cli(["generate", "more", "--model", tinier, "--steps", "2", "--extend", clip, "--seconds", "0.5",
                   "--out", tmp_path / "o.mp4"], tmp_path)
    assert run.returncode == 0, run.stderr
    printed = run.stdout + run.stderr
    assert "no audio track" in printed and "1 window" in printed
    frames, samples, rate, sample_rate, channels = read_video(tmp_path / "o.mp4")
    original = read_video_frames(clip)
    assert len(frames) == 39 + 17 and np.array_equal(frames[:39], original)
    assert rate == FPS and sample_rate == 32000 and channels == 2
    assert np.abs(samples[:, :audio_sample(39 - OVERLAP_FRAMES) - 2048]).max() == 0  # silent under the clip


def read_video_frames(path):
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def test_cli_long_video_says_how_many_windows(run_cli, tinier, tmp_path):
    run = run_cli(["generate", "a", "--model", tinier, "--size", "64x32", "--steps", "2", "--seconds", "16",
                   "--out", tmp_path / "o.mp4"], tmp_path)
    assert run.returncode == 0, run.stderr
    printed = run.stdout + run.stderr
    assert "in 2 windows" in printed and "guided by the previous window's last 22 frames" in printed
    assert "preflight: 2 windows" in printed
    assert len(read_video_frames(tmp_path / "o.mp4")) == long_frame_count(16)


def test_ctrl_c_in_the_middle_of_a_long_video_writes_nothing(tinier, tmp_path):
    """A real `python -m h3_core` child, Ctrl-C once the mp4 is being written (a window or more in): exit 130, the
    CLI says nothing was written, the file already at --out is unchanged and no staging file is left."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from cli_fixtures import default_sigint

    out = tmp_path / "o.mp4"
    out.write_bytes(b"an older video")
    root = Path(__file__).resolve().parents[1]
    child = subprocess.Popen([sys.executable, "-m", "h3_core", "generate", "a", "--model", str(tinier), "--size",
                              "64x32", "--steps", "2", "--seconds", "300", "--out", str(out)], cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": str(root)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        deadline = time.time() + 120
        while not any(p.name.endswith(".partial") and p.stat().st_size > 0 for p in tmp_path.iterdir()):
            assert child.poll() is None and time.time() < deadline, child.communicate()
            time.sleep(0.1)
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 130, err
    assert err.strip().splitlines()[-1] == f"interrupted; nothing was written; {out} is unchanged"
    assert out.read_bytes() == b"an older video"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.mp4"]
