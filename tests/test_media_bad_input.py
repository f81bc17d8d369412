"""Reference and keyframe media under bad input (issue 28): audio of many channels, absurd sample rates, clips too
short to resample, long files, folders given as files. Each is one `H3Error` naming the flag and file (the CLI: one
`error:` line, exit code 2), or is read as the reference libraries read it. Audio files are written with soundfile
(no channel positions: a WAV without a channel mask) or PyAV (named layouts: 5.1, 7.1), never with h3-stream."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from h3_core.errors import H3Error
from h3_core.request.references import normalise_audio, normalise_video
from h3_core.sources.reference_files import read_audio_file, read_video_file
from test_cli_reliability import one_error_line

av = pytest.importorskip("av")
soundfile = pytest.importorskip("soundfile")


def write_layout_wav(path, layout: str, channels: np.ndarray, rate: int = 48000):
    """A float WAV whose header names `layout` (PyAV writes the channel mask); `channels` [C, N]."""
    with av.open(str(path), "w", format="wav") as container:
        stream = container.add_stream("pcm_f32le", rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(channels.T.reshape(1, -1), dtype=np.float32),
                                           format="flt", layout=layout)
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return path


def tone(samples: int, rate: int, hz: float = 440.0, amplitude: float = 0.3) -> np.ndarray:
    return (amplitude * np.sin(2 * np.pi * hz * np.arange(samples) / rate)).astype(np.float32)


def wav_with_rate(path, rate: int):
    """A 16-bit stereo WAV whose header says `rate` (written at 32 kHz, the two rate fields patched): what a
    corrupt header or a mislabelled file looks like."""
    import struct

    soundfile.write(str(path), np.zeros((3200, 2), np.float32), 32000, subtype="PCM_16")
    data = bytearray(path.read_bytes())
    fmt = data.find(b"fmt ")
    data[fmt + 12:fmt + 16] = struct.pack("<I", rate)
    data[fmt + 16:fmt + 20] = struct.pack("<I", rate * 4)
    path.write_bytes(bytes(data))
    return path


# ---- channels ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("channels", [3, 6, 8, 12])
def test_many_channels_without_positions_are_one_error_not_a_crash(tmp_path, channels):
    """Before: 8 channels killed the process (SIGSEGV in PyAV's planar `to_ndarray`), 3 / 6 / 12 were 'must be mono
    or stereo' after decoding."""
    path = tmp_path / f"ch{channels}.wav"
    soundfile.write(str(path), np.tile(tone(4800, 48000)[:, None], (1, channels)), 48000, subtype="FLOAT")
    with pytest.raises(H3Error) as caught:
        read_audio_file(path)
    assert str(caught.value) == (
        f"--ref-audio {path}: the audio has {channels} channels without speaker positions (the file does not say "
        "which is left and which right), and H3 takes mono or stereo. Mix it down to stereo first, e.g. in an audio "
        "editor.")


def test_named_surround_layouts_are_mixed_down_to_stereo_as_itu_bs775_says(tmp_path):
    """5.1 to stereo (ITU-R BS.775, ffmpeg -ac 2): L = FL + FC/sqrt2 + BL/sqrt2, R likewise; the LFE is dropped.
    Each speaker alone, as a constant, shows its coefficient on each side."""
    speakers = ["FL", "FR", "FC", "LFE", "BL", "BR"]
    expected = {"FL": (1, 0), "FR": (0, 1), "FC": (1 / math.sqrt(2), 1 / math.sqrt(2)), "LFE": (0, 0),
                "BL": (1 / math.sqrt(2), 0), "BR": (0, 1 / math.sqrt(2))}
    for index, speaker in enumerate(speakers):
        channels = np.zeros((6, 4800), np.float32)
        channels[index] = 0.5
        waveform, rate = read_audio_file(write_layout_wav(tmp_path / f"{speaker}.wav", "5.1", channels))
        assert rate == 48000 and waveform.shape == (2, 4800)
        assert waveform[:, 100].tolist() == pytest.approx([0.5 * c for c in expected[speaker]], abs=1e-6), speaker


def test_a_7_1_file_is_read_without_crashing(tmp_path):
    """7.1 is 8 channels: the count that crashed PyAV's planar path. Its front pair comes through as it is."""
    channels = np.zeros((8, 9600), np.float32)
    channels[0], channels[1] = tone(9600, 48000), tone(9600, 48000, 660)
    waveform, _ = read_audio_file(write_layout_wav(tmp_path / "7.1.wav", "7.1", channels))
    assert waveform.shape == (2, 9600)
    assert torch.allclose(waveform, torch.from_numpy(channels[:2]), atol=1e-6)


@pytest.mark.parametrize("subtype", ["PCM_U8", "PCM_16", "PCM_24", "PCM_32", "FLOAT", "DOUBLE"])
@pytest.mark.parametrize("channels", [1, 2])
def test_wav_sample_formats_read_as_soundfile_reads_them(tmp_path, subtype, channels):
    """The packed-float decode gives soundfile's values (the reference reader) for every WAV sample format."""
    path = tmp_path / f"{subtype}.wav"
    source = np.stack([tone(3200, 32000), tone(3200, 32000, 660, 0.5)], axis=1)[:, :channels]
    soundfile.write(str(path), source, 32000, subtype=subtype)
    reference, _ = soundfile.read(str(path), dtype="float32", always_2d=True)
    waveform, rate = read_audio_file(path)
    assert rate == 32000 and waveform.shape == (channels, 3200)
    assert torch.allclose(waveform, torch.from_numpy(reference.T.copy()), atol=1e-7)


def test_a_tensor_of_many_channels_says_to_mix_it_down():
    with pytest.raises(H3Error, match=r"^ref_audio_1: audio must be mono or stereo \[channels, samples\], got shape "
                                      r"\(6, 800\)\. Mix more channels down to stereo first \(a tensor does not say "
                                      r"which is left and which right\)\.$"):
        normalise_audio(torch.zeros(1, 6, 800), 32000, "ref_audio_1", 5.0)


# ---- sample rates -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [1, 4000, 7999, 384001, 10**9])
def test_a_sample_rate_outside_8k_to_384k_is_one_error(rate):
    """Before: 1 Hz gave no samples after resampling (a numpy traceback), 1 GHz the same."""
    with pytest.raises(H3Error) as caught:
        normalise_audio(torch.zeros(2, 8000), rate, "reference_audios[0]", 5.0)
    assert str(caught.value) == (
        f"reference_audios[0]: the audio is at {rate:,} Hz; H3 reads audio at 8,000 to 384,000 Hz, resampled to "
        "32,000 Hz. Check that it is audio, and resample it to 32000 Hz first (ffmpeg -i IN -ar 32000 OUT.wav).")


@pytest.mark.parametrize("rate", [8000, 384000])
def test_the_bounds_themselves_are_read(rate):
    waveform = normalise_audio(torch.from_numpy(np.stack([tone(rate, rate)] * 2)), rate, "x", 5.0)
    assert waveform.shape[0] == 2 and abs(waveform.shape[1] - 32000) < 64


@pytest.mark.parametrize("rate", [1, 10**9])
def test_a_file_whose_header_says_an_absurd_rate_is_refused_before_decoding(tmp_path, rate):
    path = wav_with_rate(tmp_path / f"r{rate}.wav", rate)
    with pytest.raises(H3Error, match=rf"^--ref-audio {path}: the audio is at {rate:,} Hz; H3 reads audio at 8,000 "
                                      "to 384,000 Hz"):
        read_audio_file(path)


def test_audio_too_short_to_resample_is_one_error():
    """Before: libswresample gave nothing for 5 samples at 44.1 kHz, and numpy's concatenate raised."""
    with pytest.raises(H3Error, match=r"^reference_audios\[0\]: the audio is 5 samples \(0\.11 ms\) at 44,100 Hz, "
                                      r"too short to resample to 32,000 Hz; give a longer clip"):
        normalise_audio(torch.full((2, 5), 0.1), 44100, "reference_audios[0]", 5.0)


# ---- long files: only what the request uses is decoded --------------------------------------------------------


def test_a_long_audio_file_is_decoded_only_as_far_as_the_request_uses(tmp_path):
    path = tmp_path / "long.wav"
    soundfile.write(str(path), np.stack([tone(48000 * 20, 48000)] * 2, axis=1), 48000, subtype="PCM_16")
    whole, _ = read_audio_file(path)
    cut, rate = read_audio_file(path, max_seconds=1.5)
    assert rate == 48000 and cut.shape == (2, 72000)
    assert torch.equal(cut, whole[:, :72000])
    assert torch.equal(normalise_audio(cut, rate, "x", 1.5), normalise_audio(whole, rate, "x", 1.5))


def test_a_long_video_is_decoded_only_as_far_as_the_request_uses(tmp_path):
    from test_ref2va_cli import write_clip

    path = write_clip(tmp_path / "long.mp4", frames=90, rate=30)
    whole, fps, whole_audio, audio_rate = read_video_file(path)
    frames, fps_cut, audio, rate = read_video_file(path, max_seconds=22 / 24)
    assert fps_cut == fps == 30 and frames.shape[0] == math.ceil(22 / 24 * 30) + 1 < whole.shape[0]
    assert np.array_equal(normalise_video(frames, fps, "v", 22), normalise_video(whole, fps, "v", 22))
    assert rate == audio_rate and audio.shape[1] == math.ceil(22 / 24 * rate)
    assert torch.equal(audio, whole_audio[:, :audio.shape[1]])


def test_the_cli_decodes_only_the_requested_duration(media_files, run_cli, tmp_path, monkeypatch):
    from h3_core.sources import reference_files

    asked = []
    real = reference_files.read_audio_file
    monkeypatch.setattr(reference_files, "read_audio_file",
                        lambda path, flag="--ref-audio", max_seconds=None: asked.append(max_seconds) or real(
                            path, flag, max_seconds))
    done = run_cli(["generate", "x", "--partition", "ref2va", "--ref-image", str(media_files / "subject.png"),
                    "--ref-audio", str(media_files / "voice.wav"), "--frames", "22", "--steps", "1", "--out",
                    str(tmp_path / "x.mp4")], tmp_path)
    assert asked == [22 / 24]
    assert one_error_line(done).startswith("error: --steps 1: ")  # refused once the references were read


# ---- the CLI: one line each ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def media_files(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("bad_media")
    Image.new("RGB", (96, 64), (200, 10, 10)).save(root / "subject.png")
    soundfile.write(str(root / "voice.wav"), np.stack([tone(24000, 48000)] * 2, axis=1), 48000)
    soundfile.write(str(root / "ch8.wav"), np.tile(tone(4800, 48000)[:, None], (1, 8)), 48000, subtype="FLOAT")
    wav_with_rate(root / "r1.wav", 1)
    soundfile.write(str(root / "blip.wav"), np.full((5, 2), 0.1, np.float32), 44100)
    (root / "folder").mkdir()
    return root


@pytest.mark.parametrize("flags,message", [
    pytest.param(lambda m: ["--ref-image", str(m / "subject.png"), "--ref-audio", str(m / "ch8.wav")],
                 "error: --ref-audio {m}/ch8.wav: the audio has 8 channels without speaker positions (the file does "
                 "not say which is left and which right), and H3 takes mono or stereo. Mix it down to stereo first, "
                 "e.g. in an audio editor.\n", id="8-channels"),
    pytest.param(lambda m: ["--ref-image", str(m / "subject.png"), "--ref-audio", str(m / "r1.wav")],
                 "error: --ref-audio {m}/r1.wav: the audio is at 1 Hz; H3 reads audio at 8,000 to 384,000 Hz, "
                 "resampled to 32,000 Hz. Check that it is audio, and resample it to 32000 Hz first (ffmpeg -i IN "
                 "-ar 32000 OUT.wav).\n", id="1-hz"),
    pytest.param(lambda m: ["--ref-image", str(m / "subject.png"), "--ref-audio", str(m / "blip.wav")],
                 "error: --ref-audio {m}/blip.wav: the audio is 5 samples (0.11 ms) at 44,100 Hz, too short to "
                 "resample to 32,000 Hz; give a longer clip (a reference is normally seconds long).\n",
                 id="5-samples"),
    pytest.param(lambda m: ["--ref-image", str(m / "folder")],
                 "error: --ref-image {m}/folder: is a folder; give an image file inside it.\n", id="image-folder"),
])
def test_bad_reference_media_is_one_error_line(media_files, run_cli, tmp_path, flags, message):
    done = run_cli(["generate", "a fox", "--partition", "ref2va", "--out", str(tmp_path / "x.mp4"),
                    *flags(media_files)], tmp_path)
    assert one_error_line(done) == message.format(m=media_files)


def test_a_folder_as_a_keyframe_is_named_a_folder(media_files, run_cli, tmp_path):
    """Before: 'no such image file' (the CLI's --first-frame, and the Python API's first_frame=)."""
    from h3_core.request.keyframes import open_keyframe

    done = run_cli(["generate", "a fox", "--first-frame", str(media_files / "folder"), "--out",
                    str(tmp_path / "x.mp4")], tmp_path)
    assert one_error_line(done) == f"error: --first-frame {media_files / 'folder'}: is a folder; give an image file " \
                                   "inside it.\n"
    with pytest.raises(H3Error, match=rf"^{media_files / 'folder'}: is a folder; give the keyframe image file inside "
                                      "it\\.$"):
        open_keyframe(media_files / "folder")


@pytest.mark.parametrize("reader,flag", [(read_audio_file, "--ref-audio"), (read_video_file, "--ref-video")])
def test_a_folder_given_to_the_readers_is_named_a_folder(media_files, reader, flag):
    with pytest.raises(H3Error, match=rf"^{flag} {media_files / 'folder'}: is a folder; give a file inside it\.$"):
        reader(media_files / "folder")
