"""The H3 Guide node against the comfy test double: its schema (a chainable H3_GUIDES socket, core IMAGE / VIDEO / AUDIO,
a `frame` widget that counts from the end when negative), what each combination of inputs makes (h3_core's `Guide`:
image, clip, audio, clip with soundtrack; audio at 32 kHz stereo), the errors only the node can tell, in its words,
and the guides reaching the request through H3 Text Encode.

Where guides go in the packed sequence and their checks against the video (past the end, overlaps) are h3_core's
(tests/test_guides*.py); what the remote engines make of guides is tests/test_remote_sglang.py's and
tests/test_remote_vllm_omni.py's."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from test_nodes import DURATION, H, W, encode, load, pack, run  # noqa: F401  (pack: the fixture)

from h3_core.errors import H3Error


class CoreVideo:
    """Core's VIDEO as nodes receive it (VideoFromComponents): the components come from `get_components()`."""

    def __init__(self, components):
        self.components = components

    def get_components(self):
        return self.components


def video(frames=22, rate=Fraction(24), sound_rate=44100):
    from comfy_double.core_nodes import VideoComponents

    g = torch.Generator().manual_seed(frames)
    audio = (None if sound_rate is None else
             {"waveform": 0.1 * torch.randn(1, 2, sound_rate, generator=g), "sample_rate": sound_rate})
    return CoreVideo(VideoComponents(torch.rand(frames, 40, 72, 3, generator=g), audio, rate))


def image(batch=1, seed=0):
    return torch.rand(batch, H, W, 3, generator=torch.Generator().manual_seed(seed))


def mono(seconds=0.5, rate=32000):
    return {"waveform": 0.1 * torch.randn(1, 1, int(rate * seconds), generator=torch.Generator().manual_seed(9)),
            "sample_rate": rate}


def guide(pack, node_id="7", **inputs):
    (guides,) = run(pack["H3StreamGuide"], node_id, **{"frame": 0, **inputs})
    return guides


# ---- schema ------------------------------------------------------------------------------------------------------


def test_the_guide_node_is_chainable_and_takes_core_media(pack):
    from comfy_api.latest._io import node_info

    info = node_info(pack["H3StreamGuide"])
    assert info["display_name"] == "H3 Guide" and info["category"] == "H3 Stream/conditioning"
    assert info["input_order"]["required"] == ["frame"]
    assert info["input_order"]["optional"] == ["h3_guides", "image", "video", "audio"]
    optional = info["input"]["optional"]
    assert [optional[name][0] for name in ("h3_guides", "image", "video", "audio")] == \
        ["H3_GUIDES", "IMAGE", "VIDEO", "AUDIO"]
    frame = info["input"]["required"]["frame"]
    assert frame[0] == "INT" and frame[1]["default"] == 0 and frame[1]["min"] < 0 < frame[1]["max"]
    assert "count from the end" in frame[1]["tooltip"] and "-1 is the last frame" in frame[1]["tooltip"]
    assert info["output"] == ["H3_GUIDES"] and info["output_name"] == ["h3_guides"]


@pytest.mark.parametrize("node_id", ["H3StreamEncodePrompt", "H3StreamGenerateRemote"])
def test_the_request_nodes_take_guides_as_their_last_optional_input(pack, node_id):
    from comfy_api.latest._io import node_info

    info = node_info(pack[node_id])
    assert info["input_order"]["optional"][-1] == "h3_guides"
    assert info["input"]["optional"]["h3_guides"][0] == "H3_GUIDES"


# ---- what the inputs make ----------------------------------------------------------------------------------------


def test_one_image_is_an_image_guide_named_after_the_node(pack):
    picture = image()
    (made,) = guide(pack, node_id="12", frame=40, image=picture)
    assert made.kind == "image" and made.frame == 40 and made.audio is None
    assert torch.equal(made.frames, picture) and made.label == "H3 Guide #12 (frame 40)"


def test_guides_chain_in_order_and_the_upstream_list_is_left_as_it_was(pack):
    first = guide(pack, node_id="3", frame=0, image=image(seed=1))
    second = guide(pack, node_id="4", frame=-1, image=image(seed=2), h3_guides=first)
    third = guide(pack, node_id="5", frame=-22, video=video(sound_rate=None), h3_guides=second)
    assert len(first) == 1 and len(second) == 2 and second[0] is first[0]
    assert [g.label for g in third] == ["H3 Guide #3 (frame 0)", "H3 Guide #4 (frame -1)", "H3 Guide #5 (frame -22)"]
    assert [g.kind for g in third] == ["image", "image", "video"] and [g.frame for g in third] == [0, -1, -22]


def test_several_images_are_a_clip(pack):
    (made,) = guide(pack, image=image(batch=22))
    assert made.kind == "video" and made.frames.shape == (22, H, W, 3)


def test_a_video_brings_its_soundtrack_resampled_to_32_khz_stereo(pack):
    from h3_core.request.references import normalise_audio

    clip = video(frames=22, sound_rate=44100)
    (made,) = guide(pack, frame=10, video=clip)
    components = clip.get_components()
    assert made.kind == "video_audio" and torch.equal(made.frames, components.images)
    assert made.sample_rate == 32000 and made.audio.shape[0] == 2
    expected = normalise_audio(components.audio["waveform"][0], 44100, "x", max_seconds=60)
    assert made.audio.shape[1] == expected.shape[1] and abs(made.audio.shape[1] - 32000) < 100
    assert torch.equal(made.audio, expected)


def test_a_silent_video_is_a_clip_and_an_audio_alone_is_an_audio_guide(pack):
    (silent,) = guide(pack, video=video(sound_rate=None))
    assert silent.kind == "video" and silent.audio is None
    sound = mono(0.5)
    (heard,) = guide(pack, frame=30, audio=sound)
    assert heard.kind == "audio" and heard.frames is None and heard.audio.shape == (2, 16000)
    assert torch.equal(heard.audio[0], sound["waveform"][0, 0]) and torch.equal(heard.audio[1], heard.audio[0])


def test_an_audio_with_an_image_or_a_video_is_their_soundtrack(pack):
    sound = mono(0.5)
    (still,) = guide(pack, image=image(), audio=sound)
    assert still.kind == "video_audio" and still.frames.shape[0] == 1 and still.audio.shape == (2, 16000)
    (dubbed,) = guide(pack, video=video(sound_rate=44100), audio=sound)  # replaces the clip's own soundtrack
    assert dubbed.kind == "video_audio" and torch.equal(dubbed.audio[0], sound["waveform"][0, 0])


# ---- the node's own errors, in its words -------------------------------------------------------------------------


def test_a_guide_with_nothing_connected_is_one_error_naming_the_node(pack):
    with pytest.raises(H3Error, match=r"^H3 Guide #7 \(frame 5\): connect an image, a video or an audio to anchor "
                                      r"\(it has none\)\.$"):
        guide(pack, frame=5)


def test_an_image_and_a_video_together_are_refused(pack):
    with pytest.raises(H3Error, match=r"^H3 Guide #7 \(frame 0\): connect an image or a video, not both"):
        guide(pack, image=image(), video=video())


def test_a_video_not_at_24_fps_is_refused_saying_how_to_convert_it(pack):
    with pytest.raises(H3Error) as caught:
        guide(pack, video=video(rate=Fraction(30)))
    message = str(caught.value)
    assert message.startswith("H3 Guide #7 (frame 0): video: the clip is at 30 fps and H3 makes 24 fps")
    assert "ffmpeg -i IN -r 24 OUT.mp4" in message and "connect its frames to image" in message
    assert "\n" not in message
    with pytest.raises(H3Error, match=r"the clip is at 25 fps"):
        guide(pack, video=video(rate=Fraction(25)))


def test_a_video_at_23_976_fps_is_taken_as_24_with_a_note(pack):
    import server

    messages = server.PromptServer.instance.messages
    (made,) = guide(pack, video=video(rate=Fraction(24000, 1001)))
    assert made.kind == "video_audio" and made.frames.shape[0] == 22
    texts = [data for event, data, _ in messages if event == "progress_text"]
    assert texts == [{"text": "video at 23.976 fps placed one frame per output frame at 24 fps (0.1 % faster).",
                      "node": "7"}]
    messages.clear()
    guide(pack, video=video(rate=Fraction(24)))
    assert not [data for event, data, _ in messages if event == "progress_text"]


def test_a_batch_of_audios_is_refused(pack):
    sound = mono(0.5)
    sound["waveform"] = sound["waveform"].expand(2, -1, -1)
    with pytest.raises(H3Error, match=r"^H3 Guide #7 \(frame 0\): audio: a batch of 2 waveforms; connect one\.$"):
        guide(pack, audio=sound)


# ---- into the request ----------------------------------------------------------------------------------------------


def test_h3_text_encode_puts_the_chained_guides_in_the_request(pack):
    handle = load(pack)
    guides = guide(pack, node_id="4", frame=-1, image=image(seed=2), h3_guides=guide(pack, node_id="3", frame=0,
                                                                                     image=image(seed=1)))
    cond = encode(pack, handle, h3_guides=guides)
    assert [g.label for g in cond.request.guides] == ["H3 Guide #3 (frame 0)", "H3 Guide #4 (frame -1)"]
    assert encode(pack, handle).request.guides == ()
