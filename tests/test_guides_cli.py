"""The CLI's --guide FILE[@FRAME] (repeatable: an image, a video with or without its soundtrack, an audio file): a run
on the tiny model with its notes, and each bad guide's one `error:` line in the flag's words."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from h3_core.app.guide_flags import parse_guide, read_guide
from h3_core.errors import H3Error

av = pytest.importorskip("av")

from test_ref2va_cli import write_clip  # noqa: E402  (needs PyAV)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    import soundfile

    root = tmp_path_factory.mktemp("guide_media")
    Image.new("RGB", (120, 80), (200, 10, 10)).save(root / "red.png")
    write_clip(root / "sound.mp4", frames=24, rate=24)  # 24 frames at 24 fps, 1 s of tone
    write_clip(root / "fast.mp4", frames=30, rate=30, sound=False)
    soundfile.write(root / "voice.wav", (np.random.default_rng(0).standard_normal(12000) * 0.1).astype("float32"),
                    48000)
    soundfile.write(root / "long.wav", (np.random.default_rng(0).standard_normal(96000) * 0.1).astype("float32"),
                    48000)
    return root


def test_parse_guide():
    assert parse_guide("clip.mp4@40")[1] == 40 and parse_guide("a.png@-1") == (parse_guide("a.png")[0], -1)
    assert parse_guide("clip.mp4")[1] == 0
    with pytest.raises(H3Error, match="the frame after @ must be a whole number"):
        parse_guide("clip.mp4@end")


def test_each_file_kind_becomes_its_guide(media):
    image = read_guide(f"{media / 'red.png'}@-1", 39)
    assert image.kind == "image" and image.frame == -1 and image.frames.shape == (1, 80, 120, 3)
    clip = read_guide(f"{media / 'sound.mp4'}@5", 39)
    assert clip.kind == "video_audio" and clip.frames.shape[0] == 24
    # the soundtrack of the 22 frames kept (22/24 s at its 44.1 kHz)
    assert clip.audio.shape[1] == int(np.ceil(22 / 24 * clip.sample_rate))
    notes = []
    fast = read_guide(str(media / "fast.mp4"), 39, notes.append)
    assert fast.kind == "video" and fast.frames.shape[0] == 24 and "30 fps; taken at 24 fps" in notes[0]
    voice = read_guide(f"{media / 'voice.wav'}@10", 39)
    assert voice.kind == "audio" and voice.sample_rate == 48000 and voice.frames is None


def test_a_run_with_three_guides_writes_the_video_and_notes_the_crop(media, run_cli, tmp_path):
    out = tmp_path / "guided.mp4"
    done = run_cli(["generate", "a red boat", "--size", "64x96", "--frames", "39", "--steps", "2",
                    "--guide", f"{media / 'sound.mp4'}@0", "--guide", f"{media / 'red.png'}@-1",
                    "--guide", f"{media / 'voice.wav'}@26", "--out", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr
    assert out.is_file()
    assert f"note: --guide {media / 'sound.mp4'}@0: a clip of 24 frames is cropped to its first 22" in done.stdout


@pytest.mark.parametrize("flags, message", [
    (lambda m: ["--guide", f"{m / 'sound.mp4'}@30"],
     "error: --guide {m}/sound.mp4@30: a clip of 22 frames at frame 30 runs past the end of the video (39 frames"),
    (lambda m: ["--guide", f"{m / 'red.png'}@39"],
     "error: --guide {m}/red.png@39: frame 39 is outside the video's 39 frames"),
    (lambda m: ["--guide", f"{m / 'long.wav'}@0"],
     "error: --guide {m}/long.wav@0: its audio is 2.00 s but the video has 1.62 s left from frame 0"),
    (lambda m: ["--guide", f"{m / 'red.png'}@3", "--guide", f"{m / 'fast.mp4'}@0"],
     "error: --guide {m}/red.png@3 overlaps --guide {m}/fast.mp4@0: --guide {m}/fast.mp4@0 holds frames 0-21"),
    (lambda m: ["--guide", f"{m / 'red.png'}", "--first-frame", str(m / "red.png")],
     "error: --guide {m}/red.png overlaps --first-frame: --first-frame holds frame 0"),
    (lambda m: ["--guide", f"{m / 'missing.mp4'}@4"], "error: --guide {m}/missing.mp4@4: no such file."),
    (lambda m: ["--guide", f"{m / 'voice.wav'}@x"], "error: --guide {m}/voice.wav@x: the frame after @ must be"),
])
def test_bad_guides_get_one_error_line_in_the_flags_words(media, run_cli, tmp_path, flags, message):
    done = run_cli(["generate", "x", "--size", "64x96", "--frames", "39", *flags(media), "--out", "o.mp4"], tmp_path)
    assert done.returncode == 2, done.stdout
    assert message.format(m=media) in done.stderr, done.stderr
    assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr
