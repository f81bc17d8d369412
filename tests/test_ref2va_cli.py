"""The CLI's Ref2VA flags (--ref-image, --ref-video with its soundtrack, --ref-audio, --partition ref2va): a run on
the tiny model, and each bad reference's one `error:` line (exit code 2, nothing loaded)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from test_cli_reliability import one_error_line

av = pytest.importorskip("av")


def write_clip(path, frames=30, rate=30, sound=True, size=(96, 64)):
    """A small mp4 written with PyAV: frames of rising grey at `rate` fps, a 1 s 44.1 kHz stereo tone."""
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=rate)
        video.width, video.height, video.pix_fmt = size[0], size[1], "yuv420p"
        audio = None
        if sound:
            audio = container.add_stream("aac", rate=44100)
            audio.layout = "stereo"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((size[1], size[0], 3), i * 8 % 256, np.uint8), format="rgb24")
            for packet in video.encode(frame):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        if audio is not None:
            t = np.arange(44100) / 44100
            tone = (0.3 * np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 220 * t)])).astype(np.float32)
            for start in range(0, 44100, 1024):
                chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(tone[:, start:start + 1024]), format="fltp",
                                                   layout="stereo")
                chunk.sample_rate = 44100
                for packet in audio.encode(chunk):
                    container.mux(packet)
            for packet in audio.encode():
                container.mux(packet)
    return path


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    import soundfile

    root = tmp_path_factory.mktemp("ref_media")
    Image.new("RGB", (120, 80), (200, 10, 10)).save(root / "subject.png")
    write_clip(root / "motion.mp4")
    write_clip(root / "silent.mp4", frames=20, rate=24, sound=False)
    soundfile.write(root / "voice.wav", (np.random.default_rng(0).standard_normal(24000) * 0.1).astype("float32"),
                    48000)
    (root / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video")
    return root


def test_a_ref2va_run_writes_the_video(media, run_cli, tmp_path):
    out = tmp_path / "ref.mp4"
    done = run_cli(["generate", "a fox sings", "--partition", "ref2va", "--ref-image", str(media / "subject.png"),
                    "--ref-video", str(media / "motion.mp4"), "--ref-video", str(media / "silent.mp4"),
                    "--ref-audio", str(media / "voice.wav"), "--steps", "2", "--out", str(out)],
                   tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout
    with av.open(str(out)) as container:
        assert container.streams.video[0].frames == 39 and container.streams.audio


@pytest.mark.parametrize("flags,message", [
    (lambda m: ["--ref-image", str(m / "subject.png")], "error: --ref-image: references need the Ref2VA transformer; "
                                                        "add --partition ref2va.\n"),
    (lambda m: ["--partition", "ref2va"] + ["--ref-image", str(m / "subject.png")] * 10,
     "error: --ref-image: 10 image references given; H3 accepts at most 9. Drop 1 of them.\n"),
    (lambda m: ["--partition", "ref2va"] + ["--ref-video", str(m / "motion.mp4")] * 4,
     "error: --ref-video: 4 video references given; H3 accepts at most 3. Drop 1 of them.\n"),
    (lambda m: ["--partition", "ref2va", "--ref-image", str(m / "subject.png")] + ["--ref-audio",
                                                                                  str(m / "voice.wav")] * 4,
     "error: --ref-audio: 4 audio references given; H3 accepts at most 3. Drop 1 of them.\n"),
    (lambda m: ["--partition", "ref2va", "--ref-audio", str(m / "voice.wav")],
     "error: --ref-audio: an audio reference must come with at least one image or video reference (--ref-image / "
     "--ref-video); H3 does not condition on audio references alone.\n"),
    (lambda m: ["--partition", "ref2va", "--ref-video", str(m / "missing.mp4")],
     "--ref-video {m}/missing.mp4: no such file.\n"),
    (lambda m: ["--partition", "ref2va", "--ref-video", str(m / "broken.mp4")],
     "error: --ref-video {m}/broken.mp4: cannot read the video ("),
    (lambda m: ["--partition", "ref2va", "--ref-video", str(m / "voice.wav")],
     "error: --ref-video {m}/voice.wav: the file has no video stream; give a video (an audio file goes to "
     "--ref-audio).\n"),
    (lambda m: ["--partition", "ref2va", "--ref-image", str(m / "subject.png"), "--ref-audio", str(m / "broken.mp4")],
     "error: --ref-audio {m}/broken.mp4: cannot read the audio ("),
    (lambda m: ["--partition", "ref2va", "--ref-image", str(m / "voice.wav")],
     "error: --ref-image {m}/voice.wav: PIL cannot open it as an image"),
    (lambda m: ["--partition", "ref2va", "--ref-image", str(m / "subject.png"), "--first-frame",
                str(m / "subject.png")],
     "error: --first-frame / --last-frame cannot be combined with --ref-image / --ref-video / --ref-audio"),
])
def test_bad_reference_flags_get_one_error_line(media, run_cli, tmp_path, flags, message):
    done = run_cli(["generate", "a fox", "--out", str(tmp_path / "x.mp4"), *flags(media)], tmp_path)
    assert message.format(m=media) in one_error_line(done)


def test_a_video_reference_too_short_for_the_text_encoder(media, run_cli, tmp_path):
    short = write_clip(tmp_path / "short.mp4", frames=10, rate=24, sound=False)
    done = run_cli(["generate", "a fox", "--partition", "ref2va", "--ref-video", str(short), "--out",
                    str(tmp_path / "x.mp4")], tmp_path)
    assert f"error: --ref-video {short}: the video has 10 frames at 24 fps" in one_error_line(done)
