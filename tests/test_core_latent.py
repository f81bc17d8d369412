"""Interop with ComfyUI core's MiniMax H3 AV latent: our latents -> core's LATENT -> ours, and core's latents into the
H3 decoders (h3_core.pipeline.core_latent and the H3StreamLatentToCore / H3StreamLatentFromCore nodes).

Core's shapes below were recorded from the real core (ComfyUI 0.33.0 with H3, comfy_extras/nodes_minimax_h3.py
`_empty_av_latent(width, height, length)`): (width, height, length) -> (pixel frames, video shape, audio shape). Core's
VAE Encode of a clip of F = 17n + 5 frames gives the same video shape (comfy/sd.py, the H3 video VAE's
`downscale_ratio`: (F - 5) // 17 * 5 + 2 latent frames, 16x spatial), its audio VAE Encode [1, 32, 2, ceil(L / 800)]
(comfy/ldm/minimax/audio_vae.py `MiniMaxH3AudioVAE.encode`).
"""

from __future__ import annotations

import json

import comfy_double
import pytest
import torch

from h3_core.errors import H3Error
from h3_core.pipeline import H3Pipeline, Latents
from h3_core.pipeline.core_latent import latents_from_core, latents_to_core
from h3_core.request.grid import LatentShape, audio_samples_for_frames
from h3_core.sources import resolve_model

CORE_EMPTY_LATENTS = {
    (96, 64, 5): (5, (1, 24, 2, 4, 6), (1, 32, 2, 8)),
    (96, 64, 22): (22, (1, 24, 7, 4, 6), (1, 32, 2, 37)),
    (64, 96, 23): (39, (1, 24, 12, 6, 4), (1, 32, 2, 65)),
    (1344, 768, 124): (124, (1, 24, 37, 48, 84), (1, 32, 2, 207)),
}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The float32 bit patterns: tells -0.0 from 0.0 and keeps NaN payloads, unlike ==."""
    return tensor.contiguous().view(torch.int32)


def random_latents(width=96, height=64, num_frames=22, seed=0) -> Latents:
    shape = LatentShape.for_request(width, height, num_frames)
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(shape.video, generator=g) * 3
    audio = torch.randn(shape.audio, generator=g) * 3
    video.view(-1)[:4] = torch.tensor([-0.0, 1e-40, -1e-45, 1e38])  # signed zero, subnormals, a huge value
    return Latents(video, audio, shape)


# ---- h3_core ---------------------------------------------------------------------------------------------------


def test_round_trip_through_core_streams_is_bitwise_exact_and_shares_no_memory():
    ours = random_latents()
    video, audio = latents_to_core(ours)
    assert (video.shape, audio.shape) == ((1, 24, 7, 4, 6), (1, 32, 2, 37)) == CORE_EMPTY_LATENTS[(96, 64, 22)][1:]
    assert video.dtype == audio.dtype == torch.float32 and video.device.type == "cpu"
    back = latents_from_core((video, audio))
    assert torch.equal(bits(back.video), bits(ours.video)) and torch.equal(bits(back.audio), bits(ours.audio))
    assert back.shape == ours.shape
    # Core's nodes and ours each own their tensors: ComfyUI caches outputs, so an in-place edit must not travel.
    for a, b in ((video, ours.video), (back.video, video), (audio, ours.audio), (back.audio, audio)):
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()


@pytest.mark.parametrize("request_size", list(CORE_EMPTY_LATENTS))
def test_core_empty_latent_shapes_become_the_shape_our_sampler_makes(request_size):
    width, height, length = request_size
    frames, video_shape, audio_shape = CORE_EMPTY_LATENTS[request_size]
    ours = latents_from_core((torch.zeros(video_shape), torch.zeros(audio_shape)))
    assert ours.shape == LatentShape.for_request(width, height, frames)


def test_half_precision_core_latents_widen_exactly():
    ours = random_latents()
    half = latents_from_core((ours.video.to(torch.bfloat16), ours.audio.to(torch.float16)))
    assert half.video.dtype == half.audio.dtype == torch.float32
    assert torch.equal(half.video, ours.video.to(torch.bfloat16).float())
    assert torch.equal(half.audio, ours.audio.to(torch.float16).float())


VIDEO, AUDIO = CORE_EMPTY_LATENTS[(96, 64, 22)][1:]
BAD_STREAMS = [
    ("video only", (torch.zeros(VIDEO),), r"latent: expected a MiniMax H3 AV latent .* got 1 stream\(s\): "
                                           r"float32 \[1, 24, 7, 4, 6\]; .*Concat AV Latent"),
    ("three streams", (torch.zeros(VIDEO), torch.zeros(AUDIO), torch.zeros(AUDIO)), r"got 3 stream\(s\)"),
    ("another model's video", (torch.zeros(1, 16, 7, 4, 6), torch.zeros(AUDIO)),
     r"the video stream must be a float tensor \[1, 24, T, H/16, W/16\], got float32 \[1, 16, 7, 4, 6\]"),
    ("image latent", (torch.zeros(1, 24, 4, 6), torch.zeros(AUDIO)), r"video stream must be .*got float32 \[1, 24, 4, 6\]"),
    ("integer video", (torch.zeros(VIDEO, dtype=torch.int64), torch.zeros(AUDIO)), r"got int64 \[1, 24, 7, 4, 6\]"),
    ("mono audio", (torch.zeros(VIDEO), torch.zeros(1, 32, 1, 37)),
     r"the audio stream must be a float tensor \[1, 32, 2, Ta\], got float32 \[1, 32, 1, 37\]"),
    ("no tensor", (torch.zeros(VIDEO), None), r"audio stream must be .*got NoneType"),
    ("batch of two", (torch.zeros(2, *VIDEO[1:]), torch.zeros(2, *AUDIO[1:])),
     r"the video stream holds a batch of 2 latents .*make the latent with batch size 1"),
    ("off the frame grid", (torch.zeros(1, 24, 6, 4, 6), torch.zeros(AUDIO)),
     r"the video stream has 6 latent frames; H3 latents have 5n \+ 2"),
    ("audio of another length", (torch.zeros(VIDEO), torch.zeros(1, 32, 2, 36)),
     r"the audio stream has 36 latents but the video's 22 frames need 37"),
    ("NaN", (torch.zeros(VIDEO), torch.full(AUDIO, float("nan"))), r"the audio stream holds NaN or Inf values"),
]


@pytest.mark.parametrize("streams, message", [case[1:] for case in BAD_STREAMS], ids=[c[0] for c in BAD_STREAMS])
def test_a_latent_core_cannot_hand_us_gives_one_error_naming_the_stream_and_shape(streams, message):
    with pytest.raises(H3Error, match=message) as caught:
        latents_from_core(streams, source="latent")
    assert str(caught.value).startswith("latent: ") and "Traceback" not in str(caught.value)


def test_our_latents_are_checked_before_they_leave():
    ours = random_latents()
    with pytest.raises(H3Error, match="h3_latent: expected the latents of an H3 sampler, got dict"):
        latents_to_core({"samples": ours.video})
    wrong = Latents(ours.video, ours.audio, LatentShape.for_request(96, 64, 5))
    with pytest.raises(H3Error, match=r"h3_latent: its tensors .* do not match its recorded shape"):
        latents_to_core(wrong)


@pytest.fixture(scope="module")
def pipeline(tiny):
    return H3Pipeline(resolve_model(tiny))


@pytest.mark.parametrize("request_size", [(96, 64, 5), (96, 64, 22)])
def test_core_latents_decode_with_our_decoders(pipeline, request_size):
    """Core-shaped latents (values as a sampler leaves them) decode to the canvas, frame count and audio length core
    asked for, exactly as the same tensors decode as our own latents."""
    width, height, _ = request_size
    frames, video_shape, audio_shape = CORE_EMPTY_LATENTS[request_size]
    g = torch.Generator().manual_seed(5)
    video, audio = torch.randn(video_shape, generator=g), torch.randn(audio_shape, generator=g)
    ours = latents_from_core((video, audio))
    images, waveform = pipeline.decode(ours)
    assert images.shape == (frames, height, width, 3)
    # 800 samples per audio latent, cut to the video's length (5 frames: 8 latents give 6400 of 6667 samples)
    assert waveform.shape == (2, min(800 * audio_shape[-1], audio_samples_for_frames(frames)))
    direct = Latents(video, audio, LatentShape.for_request(width, height, frames))
    assert torch.equal(pipeline.decode_video(direct), images)
    assert torch.equal(pipeline.decode_audio(direct), waveform)


# ---- the nodes, through the ComfyUI double ------------------------------------------------------------------------


@pytest.fixture
def pack(tmp_path):
    comfy_double.install(tmp_path / "comfyui")
    return comfy_double.load_pack()


@pytest.mark.parametrize("node_id, module", [("EmptyMiniMaxH3LatentAV", "comfy_extras.nodes_minimax_h3"),
                                             ("LTXVSeparateAVLatent", "comfy_extras.nodes_lt"),
                                             ("LTXVConcatAVLatent", "comfy_extras.nodes_lt")])
def test_the_doubles_of_core_latent_nodes_match_the_recorded_schemas(pack, node_id, module):
    from comfy_api.latest._io import node_info
    from comfy_double.core_nodes import CORE_NODES

    recorded = json.loads((comfy_double.CONTRACT / "object_info.json").read_text())[node_id]
    ours = node_info(CORE_NODES[node_id], python_module=module)
    assert ours == {key: recorded[key] for key in ours}


def test_the_double_of_core_empty_latent_makes_the_recorded_shapes(pack):
    from comfy_double.core_nodes import CORE_NODES

    for (width, height, length), (_, video_shape, audio_shape) in CORE_EMPTY_LATENTS.items():
        samples = CORE_NODES["EmptyMiniMaxH3LatentAV"].execute(width=width, height=height, length=length)[0]["samples"]
        assert samples.is_nested and [tuple(t.shape) for t in samples.unbind()] == [video_shape, audio_shape]


TINY_LOADER = dict(source="tiny test model (embedded)", partition="FL2VA", transformer_residency="RESIDENT",
                   text_encoder_residency="RESIDENT", video_vae_residency="RESIDENT", audio_vae_residency="RESIDENT",
                   prefetch=-1, resident_blocks=0, chunk_size=0, memory_budget_mib=0, dtype="auto", device="cpu")


def prompt_from_core_latent(width=96, height=64, length=5) -> dict:
    """Core's Empty MiniMax H3 AV Latent -> H3 Latent from Core -> the H3 decoders -> Create Video -> Save Video."""
    return {
        "1": {"class_type": "H3StreamLoader", "inputs": TINY_LOADER},
        "2": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": width, "height": height, "length": length}},
        "3": {"class_type": "H3StreamLatentFromCore", "inputs": {"latent": ["2", 0]}},
        "4": {"class_type": "H3StreamDecodeVideo", "inputs": {"h3_model": ["1", 0], "h3_latent": ["3", 0]}},
        "5": {"class_type": "H3StreamDecodeAudio", "inputs": {"h3_model": ["1", 0], "h3_latent": ["3", 0]}},
        "6": {"class_type": "CreateVideo", "inputs": {"images": ["4", 0], "fps": ["4", 1], "audio": ["5", 0]}},
        "7": {"class_type": "SaveVideo", "inputs": {"video": ["6", 0], "filename_prefix": "h3/core", "format": "auto",
                                                    "codec": "auto"}},
    }


def test_a_prompt_decodes_core_empty_latent_with_the_h3_decoders(pack):
    from comfy_double.core_nodes import CORE_NODES, SAVED
    from comfy_double.executor import PromptExecutor

    SAVED.clear()
    PromptExecutor({**pack, **CORE_NODES}).run(prompt_from_core_latent(length=5))
    (saved,) = SAVED
    assert saved["images"].shape == (5, 64, 96, 3) and saved["frame_rate"] == 24
    assert saved["audio"]["waveform"].shape == (1, 2, 800 * 8)  # core's 8 audio latents of 5 frames


def test_a_latent_link_into_an_h3_decoder_is_refused_at_validation(pack):
    from comfy_double.core_nodes import CORE_NODES
    from comfy_double.executor import PromptError, PromptExecutor

    prompt = prompt_from_core_latent()
    prompt["4"]["inputs"]["h3_latent"] = ["2", 0]
    with pytest.raises(PromptError, match="h3_latent: received LATENT, expects H3_LATENT") as caught:
        PromptExecutor({**pack, **CORE_NODES}).validate(prompt)
    assert [node for node, _ in caught.value.errors] == ["4"]


def test_nodes_round_trip_a_sampled_latent_exactly(pack):
    from comfy_double.executor import run_node

    handle = run_node(pack["H3StreamLoader"], "1", **TINY_LOADER)[0]
    cond = run_node(pack["H3StreamTextEncode"], "2", h3_model=handle, prompt="A fox in the snow.", width=96,
                    height=64)[0]
    sampled = run_node(pack["H3StreamSampler"], "3", h3_model=handle, h3_cond=cond, width=96, height=64, seconds=1.0,
                       frames=5, steps=2, seed=7, video_shift=12.0, audio_shift=3.0, chunk_size=0)[0]
    (core,) = run_node(pack["H3StreamLatentToCore"], "4", h3_latent=sampled)
    assert set(core) == {"samples"} and core["samples"].is_nested
    video, audio = core["samples"].unbind()
    assert (tuple(video.shape), tuple(audio.shape)) == CORE_EMPTY_LATENTS[(96, 64, 5)][1:]
    (back,) = run_node(pack["H3StreamLatentFromCore"], "5", latent=core)
    assert torch.equal(bits(back.video), bits(sampled.video)) and torch.equal(bits(back.audio), bits(sampled.audio))
    assert back.shape == sampled.shape


def test_from_core_names_its_input_for_a_video_only_latent(pack):
    from comfy_double.executor import run_node

    with pytest.raises(H3Error, match=r"^latent: expected a MiniMax H3 AV latent .*got 1 stream\(s\): float32 "
                                      r"\[1, 24, 2, 4, 6\]; make it with Empty MiniMax H3 AV Latent"):
        run_node(pack["H3StreamLatentFromCore"], "5", latent={"samples": torch.zeros(1, 24, 2, 4, 6)})


def test_the_real_server_check_of_the_round_trip_saves_what_the_plain_example_saves(pack):
    """verify_server.py's core-latent prompt (sampler -> H3 Latent to Core -> Separate / Concat AV Latent -> H3 Latent
    from Core -> decoders), run in the double: the saved video and audio equal the plain example's bit for bit."""
    from comfy_double.core_nodes import CORE_NODES, SAVED
    from comfy_double.executor import PromptExecutor
    from comfy_double.verify_server import core_latent_prompt

    example = comfy_double.PACK_ROOT / "example_workflows" / "api" / "H3 - Text to Video and Audio.json"
    plain = json.loads(example.read_text())
    SAVED.clear()
    PromptExecutor({**pack, **CORE_NODES}).run(plain)
    PromptExecutor({**pack, **CORE_NODES}).run(core_latent_prompt())
    first, second = SAVED[: len(SAVED) // 2], SAVED[len(SAVED) // 2:]
    assert [s["node"] for s in first] == [s["node"] for s in second] and first
    for a, b in zip(first, second):
        assert b["prefix"] == "h3_stream/core_latent_round_trip"
        audio_a, audio_b = a["audio"]["waveform"], b["audio"]["waveform"]
        assert torch.equal(bits(audio_a), bits(audio_b))
        if a["node"] == "SaveVideo":
            assert torch.equal(bits(a["images"]), bits(b["images"]))
