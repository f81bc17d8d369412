"""The sampling loop's step-invariant precompute: the refined text and every block's AdaLN tables, computed once per `denoise`.

The oracle is the same loop without it (`precompute=False`, the per-step computation): on the CPU the
outputs must be bitwise equal, resident and layerwise, fused and chunked, float32 and bf16 (fp32 islands, bf16
residual), with and without a LoRA on the AdaLN projections and the text refiner. A census of the weights
materialised inside the loop shows that the cached loop never fetches an AdaLN projection or the refiner.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import h3_core
from h3_core import ChunkingPolicy, Schedule, build_packed_layout, row_timesteps
from offload_fixtures import SMALL, random_state, save_native

N = SMALL.num_layers
ADALN_OUT = 18 * SMALL.hidden_size
STEPS = 5  # grid points: 4 model calls
# (module, rows, columns): two blocks' AdaLN projections, one block's attention, the refiner, the condition projection.
LORA_TARGETS = (
    ("blocks.0.adaln_proj.linear", ADALN_OUT, SMALL.time_embed_dim),
    ("blocks.4.adaln_proj.linear", ADALN_OUT, SMALL.time_embed_dim),
    ("blocks.1.attn.qkv_proj", 3 * SMALL.inner_dim, SMALL.hidden_size),
    ("token_refiner.blocks.0.mlp.fc1", 2 * SMALL.ffn_dim, SMALL.hidden_size),
    ("condition_proj", SMALL.hidden_size, SMALL.text_dim),
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_native(random_state(SMALL, seed=21), SMALL, tmp_path_factory.mktemp("precompute") / "native")


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    g = torch.Generator().manual_seed(8)
    state = {}
    for module, rows, cols in LORA_TARGETS:
        state[f"{module}.lora_A.weight"] = torch.randn(4, cols, generator=g) / cols ** 0.5
        state[f"{module}.lora_B.weight"] = torch.randn(rows, 4, generator=g) * 0.3
    path = tmp_path_factory.mktemp("precompute_lora") / "adaln.safetensors"
    save_file(state, str(path))
    return path


@pytest.fixture(scope="module")
def request_():
    """An FL2VA-shaped request (two keyframe anchors: condition rows at 0.999, so up to 3 distinct timesteps)."""
    g = torch.Generator().manual_seed(3)
    layout = build_packed_layout(torch.ones(6, dtype=torch.long), 3, 4, 6, 4, ("first", "last"))
    video = torch.randn(layout.video_indices.numel(), SMALL.video_patch_dim, generator=g)
    audio = torch.randn(8, SMALL.audio_in_channels, generator=g)
    text = torch.randn(6, SMALL.text_dim, generator=g)
    return text, layout, video, audio


def load(checkpoint, residency, dtype, lora=None):
    options = dict(residency="layerwise", prefetch=1, resident_blocks=1) if residency == "layerwise" else {}
    return h3_core.load_dit(checkpoint, dtype=dtype, loras=[(lora, 0.7)] if lora else None, **options)


def sample(model, request_, **options):
    text, layout, video, audio = request_
    return h3_core.denoise(model, text, layout, Schedule.build(STEPS), video, audio,
                           num_condition_video_rows=layout.num_condition_video_rows, **options)


def same(a, b) -> bool:
    return torch.equal(a.video_rows, b.video_rows) and torch.equal(a.audio_rows, b.audio_rows)


def calls(layout):
    """(distinct timesteps [M], index of every row) of each model call."""
    schedule = Schedule.build(STEPS)
    return [row_timesteps(layout, float(tv), float(ta)) for tv, ta in zip(schedule.video_timesteps,
                                                                          schedule.audio_timesteps)]


def call_timesteps(layout):
    return [timestep for timestep, _ in calls(layout)]


# ---- bitwise neutrality -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_cached_loop_is_bitwise_the_per_step_loop(checkpoint, lora, request_, dtype, with_lora):
    chunked = ChunkingPolicy(chunk_size=8)
    results = {}
    for residency in ("resident", "layerwise"):
        model = load(checkpoint, residency, dtype, lora if with_lora else None)
        for name, chunking in (("fused", None), ("chunked", chunked)):
            cached = sample(model, request_, chunking=chunking)
            per_step = sample(model, request_, chunking=chunking, precompute=False)
            assert cached.precomputed_bytes > 0 and per_step.precomputed_bytes == 0
            assert same(cached, per_step), (residency, name)
            results[residency, name] = cached
        model.close()
    # Layerwise streaming (AdaLN projections apart) is bitwise the resident model, cached or not.
    for name in ("fused", "chunked"):
        assert same(results["layerwise", name], results["resident", name])
    assert not same(results["resident", "fused"], sample(load(checkpoint, "resident", dtype,
                                                              None if with_lora else lora), request_))


def test_the_cache_follows_a_lora_change_on_the_adaln_projections(checkpoint, lora, request_):
    """Built per `denoise` call: a LoRA set or removed between runs is in the next run's tables."""
    for residency in ("resident", "layerwise"):
        model = load(checkpoint, residency, torch.float32)
        base = sample(model, request_)
        h3_core.set_loras(model, [(lora, 0.7)])
        with_lora = sample(model, request_)
        assert same(with_lora, sample(model, request_, precompute=False))
        assert not same(with_lora, base)
        h3_core.set_loras(model, [])
        assert same(sample(model, request_), base)
        model.close()


def test_a_forward_with_the_plan_equals_the_plain_forward(checkpoint, request_):
    model = load(checkpoint, "layerwise", torch.bfloat16)
    text, layout, video, audio = request_
    timesteps = call_timesteps(layout)
    plan = model.adaln_plan(timesteps + timesteps[:1])  # a repeated call shares its rows
    assert len(plan.keys) == len(timesteps)
    kwargs = layout.model_kwargs()
    states = text[None]
    refined = model.refine_text(states)
    with torch.no_grad():
        for t, index in calls(layout):
            plain = model(video[None], audio[None], states, t, index, **kwargs)
            cached = model(video[None], audio[None], states, t, index, **kwargs, refined_text=refined,
                           modulation=plan.call(t))
            assert all(torch.equal(a, b) for a, b in zip(plain, cached))
        with pytest.raises(ValueError, match="modulation holds the tables of"):
            model(video[None], audio[None], states, t[:1], index.clamp(max=0), **kwargs, modulation=plan.call(t))
        with pytest.raises(ValueError, match="refined_text must be"):
            model(video[None], audio[None], states, t, index, **kwargs, refined_text=refined[:, :3])
    with pytest.raises(h3_core.H3Error, match="no call with timesteps"):
        plan.call(torch.tensor([0.123]))
    model.close()


# ---- the census: what the loop materialises -------------------------------------------------------------------------


class Census:
    """Names of the weights each materialisation binds, split at the first model call (the start of the loop)."""

    def __init__(self, model):
        self.before, self.inside = [], []
        self.in_loop = False
        model.set_weight_transform(self.record)
        model.register_forward_pre_hook(lambda module, args: setattr(self, "in_loop", True))

    def record(self, tensors):
        (self.inside if self.in_loop else self.before).extend(tensors)

    @staticmethod
    def count(names, part: str) -> int:
        return sum(part in name for name in names)


@pytest.mark.parametrize("precompute", [True, False], ids=["cached", "per_step"])
def test_the_cached_loop_materialises_no_adaln_projection_and_no_refiner(checkpoint, request_, precompute):
    model = h3_core.load_dit(checkpoint, residency="layerwise", prefetch=1, resident_blocks=1)
    census = Census(model)
    result = sample(model, request_, precompute=precompute)
    calls = Schedule.build(STEPS).num_model_calls
    streamed_bodies = N - 1  # block 0 stays on the device; every AdaLN projection is streamed
    body_weights = len([n for n, _ in model.blocks[1].named_parameters() if not n.startswith("adaln_proj.")])
    text_weights = (len(list(model.token_refiner.parameters())) + len(list(model.condition_proj.parameters())))
    if precompute:
        # Before the loop: each AdaLN projection once (weight + bias) and the refiner once; in it, neither.
        assert Census.count(census.before, ".adaln_proj.") == 2 * N
        assert Census.count(census.before, "token_refiner.") + Census.count(census.before, "condition_proj.") \
            == text_weights
        assert Census.count(census.inside, "adaln_proj") == 0
        assert Census.count(census.inside, "token_refiner") == Census.count(census.inside, "condition_proj") == 0
        assert model.adaln_residency.stats().passes == 1
    else:
        assert Census.count(census.before, "adaln_proj") == Census.count(census.before, "token_refiner") == 0
        assert Census.count(census.inside, ".adaln_proj.") == 2 * N * calls
        assert Census.count(census.inside, "token_refiner.") + Census.count(census.inside, "condition_proj.") \
            == text_weights * calls
        assert model.adaln_residency.stats().passes == calls
    # The block bodies are streamed at every step either way.
    assert len(census.inside) - Census.count(census.inside, "adaln_proj") - Census.count(
        census.inside, "token_refiner") - Census.count(census.inside, "condition_proj") \
        == body_weights * streamed_bodies * calls
    assert torch.isfinite(result.video_rows).all()
    model.close()


# ---- the host bytes of the tables ---------------------------------------------------------------------------------


def test_the_plan_host_bytes_are_reported_and_bounded(checkpoint, request_):
    text, layout, video, audio = request_
    timesteps = call_timesteps(layout)
    distinct_rows = sum(t.numel() for t in dict((tuple(t.tolist()), t) for t in timesteps).values())
    assert 2 <= max(t.numel() for t in timesteps) <= 3  # condition rows held at 0.999: M = 3 once noisy
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        model = load(checkpoint, "resident", dtype)
        expected = N * distinct_rows * ADALN_OUT * size
        assert model.adaln_plan_bytes(timesteps) == expected
        plan = model.adaln_plan(timesteps)
        assert plan.host_bytes == expected
        assert all(table.device == torch.device("cpu") and table.dtype == dtype for table in plan.tables)
        assert sample(model, request_).precomputed_bytes == expected
        # At most (calls x 4 timesteps) rows per block: a bound known before any weight is read.
        assert expected <= N * len(timesteps) * 4 * ADALN_OUT * size
