"""The step cache (DBCache over the H3 transformer): off and a threshold of 0 are bitwise the uncached loop; the hit /
miss decisions, the measured changes and the outputs equal cache-dit 1.5.3's own `CachedBlocks_Pattern_3_4_5` driving
the same blocks (the oracle); a streamed model neither materialises nor reads the blocks a hit skips."""

from __future__ import annotations

import pytest
import torch

import h3_core
from h3_core import ChunkingPolicy, Schedule, build_packed_layout
from h3_core.errors import H3Error
from h3_core.request.generation_request import GenerationRequest
from h3_core.models.step_cache import StepCacheRun
from h3_core.step_cache_settings import STEP_CACHE_PRESETS, StepCacheSettings, step_cache_settings
from offload_fixtures import SMALL, random_state, save_native

N = SMALL.num_layers
STEPS = 13  # 12 model calls
QUALITY = STEP_CACHE_PRESETS["quality"]  # Fn 1, Bn 0, threshold 0.04, warm-up 4, at most 1 in a row
WIDER = StepCacheSettings(first_blocks=2, last_blocks=1, threshold=0.08, warmup_steps=2, max_consecutive=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_native(random_state(SMALL, seed=21), SMALL, tmp_path_factory.mktemp("step_cache") / "native")


@pytest.fixture(scope="module")
def request_():
    g = torch.Generator().manual_seed(3)
    layout = build_packed_layout(torch.ones(6, dtype=torch.long), 3, 4, 6, 4, ())
    video = torch.randn(layout.video_indices.numel(), SMALL.video_patch_dim, generator=g)
    audio = torch.randn(8, SMALL.audio_in_channels, generator=g)
    text = torch.randn(6, SMALL.text_dim, generator=g)
    return text, layout, video, audio


def load(checkpoint, residency="resident", dtype=torch.float32):
    options = dict(residency="layerwise", prefetch=1) if residency == "layerwise" else {}
    return h3_core.load_dit(checkpoint, dtype=dtype, **options)


def sample(model, request_, **options):
    text, layout, video, audio = request_
    return h3_core.denoise(model, text, layout, Schedule.build(STEPS), video, audio, **options)


def same(a, b) -> bool:
    return torch.equal(a.video_rows, b.video_rows) and torch.equal(a.audio_rows, b.audio_rows)


# ---- off is the uncached path ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("residency", ["resident", "layerwise"])
def test_off_and_a_zero_threshold_are_bitwise_the_uncached_loop(checkpoint, request_, residency):
    model = load(checkpoint, residency)
    for chunking in (None, ChunkingPolicy(chunk_size=8)):
        plain = sample(model, request_, chunking=chunking)
        assert plain.step_cache is None
        assert same(plain, sample(model, request_, chunking=chunking, step_cache=step_cache_settings("off")))
        zero = sample(model, request_, chunking=chunking,
                      step_cache=StepCacheSettings(1, 0, 0.0, 0, -1))
        assert same(plain, zero) and zero.step_cache.hits == 0
        assert zero.step_cache.blocks_run == [N] * (STEPS - 1)


def test_the_request_default_is_off_and_presets_resolve():
    request = GenerationRequest("a fox", width=96, height=64, num_frames=5, steps=3)
    assert request.step_cache is None
    assert request.replace(step_cache="fast").step_cache == STEP_CACHE_PRESETS["fast"]
    assert request.replace(step_cache=" Quality ").step_cache == QUALITY
    custom = step_cache_settings("quality", threshold=0.1)
    assert custom.threshold == 0.1 and custom.first_blocks == 1 and custom.name == "custom"


# ---- cache-dit as the oracle ----------------------------------------------------------------------------------------


def cache_dit_run(checkpoint, request_, settings: StepCacheSettings, dtype=torch.float32):
    """The uncached loop with the block stack replaced by cache-dit's DBCache wrapper of the same blocks: cache-dit
    decides every hit and does the cached arithmetic. The blocks get the same arguments in every call (the AdaLN
    tables projected in each block: `precompute=False`)."""
    from cache_dit.caching.cache_blocks.pattern_3_4_5 import CachedBlocks_Pattern_3_4_5
    from cache_dit.caching.cache_contexts.cache_config import DBCacheConfig
    from cache_dit.caching.cache_contexts.cache_manager import CachedContextManager
    from cache_dit.caching.forward_pattern import ForwardPattern

    model = load(checkpoint, dtype=dtype)
    manager = CachedContextManager("h3-oracle")
    context = manager.new_context(name="h3", cache_config=DBCacheConfig(
        Fn_compute_blocks=settings.first_blocks, Bn_compute_blocks=settings.last_blocks,
        residual_diff_threshold=settings.threshold, max_warmup_steps=settings.warmup_steps,
        max_continuous_cached_steps=settings.max_consecutive, enable_separate_cfg=False))
    wrapper = CachedBlocks_Pattern_3_4_5(model.blocks, transformer=None, forward_pattern=ForwardPattern.Pattern_3,
                                         check_forward_pattern=False, cache_prefix="h3", cache_context="h3",
                                         context_manager=manager)
    model.blocks = torch.nn.ModuleList([wrapper])
    result = sample(model, request_, precompute=False)
    return result, context


@pytest.mark.parametrize("settings", [QUALITY, WIDER], ids=["quality", "F2B1"])
def test_decisions_changes_and_outputs_equal_cache_dit(checkpoint, request_, settings):
    oracle, context = cache_dit_run(checkpoint, request_, settings)
    model = load(checkpoint)
    ours = sample(model, request_, step_cache=settings)
    stats = ours.step_cache
    hits = [i for i, hit in enumerate(stats.decisions) if hit]
    assert hits == context.get_cached_steps()
    assert 0 < len(hits) < len(stats.decisions) - settings.warmup_steps  # both kinds of call after the warm-up
    measured = {str(i): change for i, change in enumerate(stats.changes) if change is not None}
    assert measured == {k: v for k, v in context.get_residual_diffs().items() if v >= 0}
    assert same(ours, oracle)
    # Precomputed AdaLN tables and the per-step projection give the same numbers with the cache too.
    assert same(ours, sample(model, request_, step_cache=settings, precompute=False))
    assert stats.blocks_run == [N - (N - settings.first_blocks - settings.last_blocks) * hit
                                for hit in stats.decisions]


def test_a_threshold_of_one_caches_every_call_the_rules_allow(checkpoint, request_):
    always = StepCacheSettings(1, 0, 1.0, 2, 1)
    oracle, context = cache_dit_run(checkpoint, request_, always)
    ours = sample(load(checkpoint), request_, step_cache=always)
    assert [i for i, hit in enumerate(ours.step_cache.decisions) if hit] == context.get_cached_steps() \
        == list(range(2, STEPS - 1, 2))  # warm-up 0, 1; then every other call
    assert same(ours, oracle)


# ---- streamed: skipped blocks are neither materialised nor read ------------------------------------------------------


def test_a_streamed_hit_neither_materialises_nor_reads_the_skipped_blocks(checkpoint, request_):
    resident = sample(load(checkpoint), request_, step_cache=WIDER)
    model = load(checkpoint, "layerwise")
    manager = model.block_residency
    store = manager.store
    acquired, read = [], []
    original_acquire, original_fill = manager.acquire, store._fill

    def acquire(index):
        acquired[-1].append(index)
        return original_acquire(index)

    def fill(unit, buffer):
        read.append(unit)
        return original_fill(unit, buffer)

    manager.acquire, store._fill = acquire, fill
    forward = model.forward

    def counted_forward(*args, **kwargs):
        acquired.append([])
        return forward(*args, **kwargs)

    model.forward = counted_forward
    streamed = sample(model, request_, step_cache=WIDER)
    assert same(streamed, resident)  # layerwise equals resident with the cache on
    stats = streamed.step_cache
    middle = set(range(WIDER.first_blocks, N - WIDER.last_blocks))
    # The AdaLN pass (precompute) acquires every block once; then one list per model call.
    calls = acquired[-len(stats.decisions):]
    for hit, blocks in zip(stats.decisions, calls):
        assert (not set(blocks) & middle) if hit else blocks == list(range(N))
    # Reads: at most every block of every call that ran it (a block read ahead for a guessed path that is still
    # needed is kept) plus one read ahead per call whose path was guessed wrong (guessed before the call, from the
    # last measured change); an uncached run reads N per call.
    needed = sum(stats.blocks_run) + N  # + the precompute's pass over every block
    assert stats.hits >= 3 and len(read) <= needed + len(stats.decisions)
    assert len(read) < N * (len(stats.decisions) + 1) - stats.hits * len(middle) / 2


# ---- bad settings -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset, overrides, words", [
    ("turbo", {}, "not a preset; use one of off, quality, fast"),
    ("quality", {"threshold": float("nan")}, "threshold must be a finite number"),
    ("quality", {"first_blocks": 0}, "first blocks (Fn) must be an integer >= 1"),
    ("quality", {"warmup_steps": -1}, "warm-up steps must be an integer >= 0"),
    ("quality", {"max_consecutive": True}, "most consecutive hits must be an integer >= -1"),
    ("quality", {"last_blocks": 1.5}, "last blocks (Bn) must be an integer >= 0"),
])
def test_bad_settings_are_one_clear_error(preset, overrides, words):
    with pytest.raises(H3Error, match=words.replace("(", r"\(").replace(")", r"\)")):
        step_cache_settings(preset, **overrides)


def test_first_and_last_blocks_must_leave_blocks_to_skip():
    with pytest.raises(H3Error, match="4 first \\+ 2 last blocks always run, which leaves none of this transformer's 6"):
        StepCacheRun(StepCacheSettings(4, 2, 0.1, 0, -1), N)


def test_a_request_with_a_bad_step_cache_names_the_field():
    with pytest.raises(H3Error, match="step_cache 'medium' is not a preset"):
        GenerationRequest("a fox", width=96, height=64, num_frames=5, steps=3, step_cache="medium")
    with pytest.raises(H3Error, match="step_cache 3: give a preset name"):
        GenerationRequest("a fox", width=96, height=64, num_frames=5, steps=3, step_cache=3)


# ---- interrupted -------------------------------------------------------------------------------------------------


class Stop(Exception):
    pass


@pytest.mark.parametrize("residency", ["resident", "layerwise"])
def test_a_cancelled_cached_run_leaves_the_model_usable(checkpoint, request_, residency):
    model = load(checkpoint, residency)
    expected = sample(model, request_, step_cache=QUALITY)
    checks = 0

    def check_interrupt():
        nonlocal checks
        checks += 1
        if checks == 60:  # inside a later call, past the warm-up
            raise Stop

    with pytest.raises(Stop):
        sample(model, request_, step_cache=QUALITY, check_interrupt=check_interrupt)
    again = sample(model, request_, step_cache=QUALITY)
    assert same(again, expected) and again.step_cache.decisions == expected.step_cache.decisions


# ---- the memory plan ------------------------------------------------------------------------------------------------


def test_the_plan_counts_the_cached_residuals(tiny):
    """The transformer's activations grow by the residuals the cache holds: four full-length residual-stream
    tensors (two kept across calls, two while a call decides and runs its middle blocks)."""
    from h3_core.planning.phase_plans import packed_rows_estimate, plan_for_budget
    from h3_core.request.grid import LatentShape
    from h3_core.sources.model_sources import resolve_model

    sources = resolve_model(tiny)
    request = dict(device="cpu", budget_bytes=1 << 40, width=96, height=64, num_frames=22, steps=9,
                   dtype=torch.float32)
    plain = plan_for_budget(sources, **request)
    cached = plan_for_budget(sources, **request, step_cache=True)
    rows = packed_rows_estimate(LatentShape.for_request(96, 64, 22))
    hidden = h3_core.load_dit(sources.transformer).config.hidden_size
    grown = cached.phase("sampling").total_bytes - plain.phase("sampling").total_bytes
    assert grown == 4 * rows * hidden * 4


def test_the_cache_holds_what_the_plan_counts(checkpoint, request_):
    """After a call: the two kept residuals are full-length residual-stream tensors, as the plan counts them."""
    text, layout, video, audio = request_
    model = load(checkpoint)
    run = StepCacheRun(QUALITY, N)
    rows = layout.num_rows
    # One call through the forward (a call that runs every block keeps both residuals).
    kwargs = {k: v for k, v in layout.model_kwargs().items()}
    timestep, indices = h3_core.row_timesteps(layout, 0.5, 0.5)
    with torch.no_grad():
        model(video[None], audio[None], text[None], timestep, indices, step_cache=run, **kwargs)
    assert run.held_bytes == 2 * rows * SMALL.hidden_size * 4


def test_the_bytes_read_per_call_add_up_to_every_byte_read(checkpoint, request_):
    model = load(checkpoint, "layerwise")
    before = model.block_residency.bytes_read
    result = sample(model, request_, step_cache=WIDER)
    stats = result.step_cache
    total = model.block_residency.bytes_read - before
    unit = model.block_residency.store.unit_bytes(3)  # a middle block's bytes
    # Every byte read during the calls is counted in one call (the precompute's pass streams the AdaLN projections
    # apart). The last call ends by reading the next pass's first blocks ahead, on the reader thread: those reads
    # may finish after the sampler's last count, and only those.
    after_last_call = total - sum(stats.bytes_read)
    assert after_last_call % unit == 0 and 0 <= after_last_call <= WIDER.first_blocks * unit, after_last_call
    # A cached call reads at most the blocks it runs, the next call's first and one block read ahead on a path
    # guessed wrong; a call that runs every block reads at least its middle ones.
    for hit, read in zip(stats.decisions, stats.bytes_read):
        if hit:
            assert read <= (WIDER.first_blocks + WIDER.last_blocks + 2) * unit
        else:
            assert read >= (N - WIDER.first_blocks - WIDER.last_blocks) * unit
