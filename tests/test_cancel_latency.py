"""Cancel is seen within a fraction of a second at any request size: the caller's interrupt check runs between the row
chunks and attention query calls of the transformer (which the CPU bounds in work), the text encoder's layers and row
chunks, the vision blocks, the video decoder's tiles and frames, the encoders' levels and the audio decoder's blocks;
an interrupted run leaves every model as it was, so the next run gives the clean run's output.

No timings here (benchmarks/cancel_latency.py measures them): each test raises from the interrupt check at a point
inside a loop and checks that the work stopped right there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from h3_core.models.dit_config import H3DiTConfig
from h3_core.pipeline import H3Pipeline
from h3_core.pipeline.pipeline import Latents
from h3_core.request.generation_request import GenerationRequest
from h3_core.runtime import ChunkingBackend, ChunkingPolicy, Platform
from h3_core.sources import resolve_model
from h3_core.sources.tiny_default import TINY_DIT


class Stop(Exception):
    pass


class Cancel:
    """An interrupt check that counts its calls and raises `Stop` from call `at` on, or once `when()` is true."""

    def __init__(self, at: int | None = None, when=None):
        self.at, self.when, self.calls = at, when, 0

    def __call__(self) -> None:
        self.calls += 1
        if (self.at is not None and self.calls >= self.at) or (self.when is not None and self.when()):
            raise Stop()


def finished(module) -> list:
    """A list that gets one entry per finished forward of `module` (and the hook's handle, to remove it)."""
    calls = []
    calls.append(module.register_forward_hook(lambda *args: calls.append(1)))
    return calls


def count(calls: list) -> int:
    return len(calls) - 1


def streamed_clean(model) -> bool:
    """No streamed block of `model` is left materialised (the block loop's `finally` released them)."""
    residency = model.block_residency
    assert type(residency).__name__ != "AllResident"  # the tests stream, so that there is something to release
    return residency.materialised_streamed() == []


# ---- the transformer ----------------------------------------------------------------------------------------------


def test_a_large_request_on_the_cpu_runs_in_short_calls():
    """1920x1088, 15 s on the tiny model is 219,506 packed rows: one fused attention call over them took 5 minutes on
    2 CPU cores, and a cancel waited for it. The CPU now splits the query pass into calls of at most
    `max_attention_work` and the rows into chunks of at most `max_chunk_rows`; small requests and GPUs are as before."""
    shape = GenerationRequest("a fox", width=1920, height=1088, num_frames=362).shape
    rows = shape.latent_frames * shape.latent_height * shape.latent_width // 4 + 2 * shape.audio_latents + 20
    assert rows == 219_506
    cpu = Platform("cpu").chunking
    chunks = ChunkingPolicy().plan(rows, TINY_DIT, batch=1, dtype=torch.float32, device="cpu")
    # The work bound allows 256 query rows; the CPU's 768-row minimum of efficient calls wins (about a second a call).
    assert 256 * rows * TINY_DIT.inner_dim <= cpu.max_attention_work < 320 * rows * TINY_DIT.inner_dim
    assert (chunks.size, chunks.query_size) == (32_768, cpu.min_query_rows) == (32_768, 768)
    calls = list(chunks.query_ranges(rows))
    assert len(calls) == 286 and calls[-1] == (218_880, 219_506)  # 286 calls, where one call was all of them
    # The released widths: 768-row calls too (64-row ones cost 50 % more per row), not one call over all rows.
    assert ChunkingPolicy().plan(12_432, H3DiTConfig(), batch=1, dtype=torch.bfloat16, device="cpu").query_size == 768
    # The tiny default request (96x64, 1 s) and every request on CUDA: one fused call, as before.
    small = ChunkingPolicy().plan(1_000, TINY_DIT, batch=1, dtype=torch.float32, device="cpu")
    assert (small.size, small.query_size) == (None, None)
    cuda = ChunkingPolicy().plan(rows, TINY_DIT, batch=1, dtype=torch.float32, device="cuda")
    assert (cuda.size, cuda.query_size) == (None, None)


# Short calls at the tiny test sizes: 64-row attention query calls, 64-row chunks.
SHORT_CALLS = ChunkingBackend("cpu, short calls", min_query_rows=1, max_attention_work=1, max_chunk_rows=64)
REQUEST = dict(width=256, height=256, num_frames=5, steps=3, seed=5)


@pytest.fixture(scope="module")
def fl2va(tiny):
    """A pipeline keeping every component, each streamed layerwise (the text encoder with 4 rows per chunk)."""
    pipe = H3Pipeline(resolve_model(tiny), keep_text_encoder=True, keep_transformer=True, keep_video_vae=True,
                      keep_audio_vae=True,
                      component_options={"transformer": {"residency": "layerwise", "prefetch": 1},
                                         "text_encoder": {"residency": "layerwise", "chunk_size": 4},
                                         "video_vae": {"residency": "layerwise"},
                                         "audio_vae": {"residency": "layerwise"}})
    yield pipe
    pipe.release_all()


def counted(monkeypatch, owner, name: str) -> list:
    """Count the calls of `owner.name` (a method or a module's forward) in a list."""
    calls, real = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    return calls


# Block 0's loops over row chunks: pass 1 (keys and values), the attention query calls, the MLP.
BLOCK_LOOPS = {"keys and values": ("attn", "project_keys_values"), "attention queries": ("attn", "attend"),
               "MLP": ("mlp", "forward")}


def test_an_interrupt_lands_between_the_calls_of_every_row_loop_and_the_next_run_is_unchanged(fl2va, monkeypatch):
    pipe = fl2va
    cond = pipe.encode_prompt("a red fox in the snow", **REQUEST)
    fused = pipe.sample(cond)
    dit = pipe.component("transformer")
    policy = dit.chunking = ChunkingPolicy(backend=SHORT_CALLS)
    try:
        loops = {name: counted(monkeypatch, getattr(dit.blocks[0], part), method)
                 for name, (part, method) in BLOCK_LOOPS.items()}
        clean = pipe.sample(cond)
        # Splitting the queries and chunking the rows does not change a number.
        assert torch.equal(clean.video, fused.video) and torch.equal(clean.audio, fused.audio)
        assert all(len(calls) >= 2 * 3 for calls in loops.values())  # 2 steps, 3 or more calls a step
        for name, calls in loops.items():
            for other in loops.values():
                other.clear()
            with pytest.raises(Stop):  # cancel pressed during the second call of this loop in block 0, step 1
                pipe.sample(cond, check_interrupt=Cancel(when=lambda: len(calls) == 2))
            assert len(calls) == 2, name  # the third never started
            assert streamed_clean(dit) and dit.weight_phases.materialised() == (), name
        assert dit.chunking is policy and policy.check_interrupt is None  # the check was only the runs'
        monkeypatch.undo()
        again = pipe.sample(cond)
        assert torch.equal(again.video, clean.video) and torch.equal(again.audio, clean.audio)
    finally:
        dit.chunking = ChunkingPolicy()


# ---- the text encoder -----------------------------------------------------------------------------------------------


def picture(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_an_interrupt_stops_the_text_encoder_between_layers_row_chunks_and_vision_blocks(fl2va, monkeypatch):
    pipe = fl2va  # the encoder streamed layerwise, 4 rows per chunk, kept
    prompt = GenerationRequest("A red fox runs across a snowy field at dawn.", **REQUEST)
    keyframe = GenerationRequest("A red fox runs across a snowy field at dawn.", first_frame=picture(256, 256, 1),
                                 **REQUEST)
    clean = {request: pipe.encode_prompt(request).states for request in (prompt, keyframe)}
    encoder = pipe.component("text_encoder")
    layers = encoder.language_model.layers
    mlp = counted(monkeypatch, layers[0].mlp, "forward")
    second_layer = counted(monkeypatch, layers[1], "forward")
    second_vision_block = counted(monkeypatch, encoder.vision_tower.blocks[1], "forward")
    first_layer = counted(monkeypatch, layers[0], "forward")
    cases = (("between row chunks", prompt, lambda: len(mlp) == 2, mlp, 2),
             ("between layers", prompt, lambda: len(first_layer) == 1, second_layer, 0),
             ("between vision blocks", keyframe, lambda: False, second_vision_block, 0))
    for name, request, when, calls, expected in cases:
        for counter in (mlp, second_layer, second_vision_block, first_layer):
            counter.clear()
        cancel = Cancel(at=2, when=when) if name == "between vision blocks" else Cancel(when=when)
        with pytest.raises(Stop):
            pipe.encode_prompt(request, check_interrupt=cancel)
        assert len(calls) == expected, name  # the work after the check never started
        assert streamed_clean(encoder.language_model) and encoder.weight_phases.materialised() == (), name
    monkeypatch.undo()
    for request, states in clean.items():
        assert torch.equal(pipe.encode_prompt(request).states, states)


def test_an_interrupted_text_encode_releases_the_encoder_as_a_finished_one_does(tiny):
    pipe = H3Pipeline(resolve_model(tiny))  # the text encoder is not kept
    clean = pipe.encode_prompt("a red fox", **REQUEST).states
    with pytest.raises(Stop):
        pipe.encode_prompt("a red fox", check_interrupt=Cancel(at=1), **REQUEST)
    assert pipe.loaded == ()
    assert torch.equal(pipe.encode_prompt("a red fox", **REQUEST).states, clean)


# ---- the VAEs -------------------------------------------------------------------------------------------------------


def random_latents(width: int, height: int, num_frames: int, seed: int = 3) -> Latents:
    shape = GenerationRequest("", width=width, height=height, num_frames=num_frames).shape
    g = torch.Generator().manual_seed(seed)
    return Latents(torch.randn(shape.video, generator=g), torch.randn((1, 32, 2, shape.audio_latents), generator=g),
                   shape)


def test_an_interrupt_stops_the_video_decoder_between_tiles_and_between_frames(fl2va):
    pipe = fl2va
    latents = random_latents(512, 256, 22)  # 3 tiles of 256 px a clip, 2 clips
    clean = pipe.decode_video(latents)
    vae = pipe.component("video_vae")
    tiles = finished(vae.decoder)
    tiles_per_clip = 3
    # The tiny decoder has one block: one check before each tile, then one before each frame a clip gives.
    for at, decoded in ((2, 1), (tiles_per_clip + 2, tiles_per_clip)):
        tiles[1:] = []
        with pytest.raises(Stop):
            pipe.decode_video(latents, check_interrupt=Cancel(at=at))
        assert count(tiles) == decoded  # stopped at the second tile / the second frame of the first clip
        assert streamed_clean(vae.decoder)
    tiles[0].remove()
    assert torch.equal(pipe.decode_video(latents), clean)


def test_an_interrupt_stops_the_audio_decoder_inside_its_blocks(fl2va):
    pipe = fl2va
    latents = random_latents(96, 64, 22)
    clean = pipe.decode_audio(latents)
    vae = pipe.component("audio_vae")
    second_stage = finished(vae.decoder.ups[1][0])
    first_block = finished(vae.decoder.resblocks[0])
    with pytest.raises(Stop):  # before stage 0, then after each of block 0's dilations: its second
        pipe.decode_audio(latents, check_interrupt=Cancel(at=3))
    assert count(first_block) == 0 and count(second_stage) == 0
    assert streamed_clean(vae.decoder)
    second_stage[0].remove(), first_block[0].remove()
    assert torch.equal(pipe.decode_audio(latents), clean)


def test_an_interrupt_stops_the_keyframe_encoder_between_levels_before_the_transformer_loads(tiny):
    pipe = H3Pipeline(resolve_model(tiny), keep_text_encoder=True, keep_video_vae=True)
    cond = pipe.encode_prompt("a red fox", first_frame=picture(256, 256, 2), **REQUEST)
    clean = pipe.encode_keyframes(cond)
    vae = pipe.component("video_vae")
    levels = [finished(level) for level in vae.encoder.down]
    first_block, first_downsample = finished(vae.encoder.down[0].block[0]), finished(vae.encoder.down[0].downsample)
    # A check before each block and each downsampling of a level: the second is before level 0's downsampling,
    # the third before level 1.
    for at, blocks, downsamples, finished_levels in ((2, 1, 0, 0), (3, 1, 1, 1)):
        for counter in (*levels, first_block, first_downsample):
            counter[1:] = []
        with pytest.raises(Stop):
            pipe.sample(cond, check_interrupt=Cancel(at=at))
        assert (count(first_block), count(first_downsample)) == (blocks, downsamples)
        assert [count(level) for level in levels] == [1] * finished_levels + [0] * (len(levels) - finished_levels)
        assert "transformer" not in pipe.loaded
    for counter in (*levels, first_block, first_downsample):
        counter[0].remove()
    again = pipe.encode_keyframes(cond)
    assert all(torch.equal(a, b) for a, b in zip(again, clean))
    pipe.release_all()


def test_an_interrupt_stops_the_reference_encoders(tiny):
    pipe = H3Pipeline(resolve_model(tiny, partition="ref2va"), keep_text_encoder=True)
    g = torch.Generator().manual_seed(4)
    cond = pipe.encode_prompt("a fox sings", width=64, height=96, num_frames=22, steps=3,
                              reference_videos=[(torch.rand(14, 64, 64, 3, generator=g),
                                                 0.1 * torch.randn(2, 40000, generator=g))])
    clean_visual, clean_audio = pipe.encode_reference_latents(cond)
    for encoder in ("video_vae", "audio_vae"):  # cancel as soon as this encoder runs
        cancel = Cancel(when=lambda: encoder in pipe.loaded)
        with pytest.raises(Stop):
            pipe.sample(cond, check_interrupt=cancel)
        assert "transformer" not in pipe.loaded
    visual, audio = pipe.encode_reference_latents(cond)
    assert all(torch.equal(a, b) for a, b in zip(visual + audio, clean_visual + clean_audio))
    pipe.release_all()


# ---- the nodes: ComfyUI's Cancel ----------------------------------------------------------------------------------


@pytest.fixture
def pack(tmp_path):
    import comfy_double

    comfy_double.install(tmp_path / "comfyui")
    return comfy_double.load_pack()


def run_node(pack, node_id: str, name: str, **inputs):
    from comfy_double.executor import run_node as run

    return run(pack[name], node_id, **inputs)


def test_cancel_reaches_the_text_encode_and_decode_nodes_inside_their_loops(pack):
    """ComfyUI's interrupt check (`throw_exception_if_processing_interrupted`) is called inside the text encoder's
    and both decoders' loops, not only when their phase starts (the double counts the checks and raises the flag
    at the given one); the next run of each node gives the clean output."""
    import comfy.model_management as mm

    handle = run_node(pack, "1", "H3StreamLoader", source="tiny test model (embedded)", partition="FL2VA",
                      transformer_residency="LAYERWISE_OFFLOAD", text_encoder_residency="RESIDENT",
                      video_vae_residency="RESIDENT", audio_vae_residency="RESIDENT", prefetch=-1,
                      resident_blocks=0, chunk_size=0, memory_budget_mib=0, dtype="auto", device="cpu")[0]
    prompt = dict(h3_model=handle, prompt="A fox in the snow.", width=96, height=64, seconds=1.0, frames=5)
    cond, = run_node(pack, "2", "H3StreamEncodePrompt", **prompt)
    latents, = run_node(pack, "3", "H3StreamAVSampler", h3_model=handle, h3_cond=cond, steps=3, seed=7,
                        video_shift=12.0, audio_shift=3.0, chunk_size=0)
    frames, _ = run_node(pack, "4", "H3StreamDecodeVideo", h3_model=handle, h3_latent=latents)
    audio, = run_node(pack, "5", "H3StreamDecodeAudio", h3_model=handle, h3_latent=latents)
    # The first check is the phase's, before it starts; the second is inside the loop (before the first layer, the
    # first tile, after the audio decoder's first block).
    for node_id, name, inputs in (("2", "H3StreamEncodePrompt", prompt),
                                  ("4", "H3StreamDecodeVideo", dict(h3_model=handle, h3_latent=latents)),
                                  ("5", "H3StreamDecodeAudio", dict(h3_model=handle, h3_latent=latents))):
        mm.state.checks, mm.state.interrupt_at_check = 0, 2
        with pytest.raises(mm.InterruptProcessingException):
            run_node(pack, node_id, name, **inputs)
        assert mm.state.checks == 2, name
    assert torch.equal(run_node(pack, "2", "H3StreamEncodePrompt", **prompt)[0].states, cond.states)
    assert torch.equal(run_node(pack, "4", "H3StreamDecodeVideo", h3_model=handle, h3_latent=latents)[0], frames)
    again, = run_node(pack, "5", "H3StreamDecodeAudio", h3_model=handle, h3_latent=latents)
    assert torch.equal(again["waveform"], audio["waveform"])
    handle.pipeline.release_all()
