"""Chunked streamed DiT forward: same numbers as the fused forward, bounded temporaries, no extra linear work,
chunk size from a memory budget, the MPS caps that bind every chunk size (and the nodes' chunk_size widgets), the
between-chunks hook, and option errors.

Bitwise claims and the CPU BLAS: MKL picks different sgemm kernels for calls with fewer than about 12 rows (1-3 rows
on one thread, any count below 12 that is not a multiple of 4 on two), so a 1- or 7-row chunk of a linear layer can
differ from the same rows of the full-sequence GEMM in the last bit. The MLP and head tests therefore check the
chunking itself bitwise for every chunk size with a row-invariant linear (`exact_linear`), and the real GEMMs bitwise
for chunks of >= 12 rows (64, T, T + 5) and within 1e-6 for 1 and 7.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import h3_core
from h3_core.runtime import (FUSED, ChunkingBackend, Platform, ChunkingError, ChunkingPolicy, EveryNChunks, RowChunks,
                              chunk_rows_for_budget, projection_elements_per_row)
from h3_core.runtime.chunking import ChunkSizeClamped
from h3_core.models.dit_config import NUM_MODALITIES, H3DiTConfig
from h3_fixtures import TINY, cast_like_release, packed_inputs, reference_model, rel_l2, save_comfy

# text 9 (2 keyframe vision rows), 2 keyframes + 5 target frames of 4 x 5 patches, 13 audio latents per channel:
# T = 9 + 40 + 26 + 100 = 175 rows; 175 = 2 * 64 + 47 and 140 video rows = 2 * 64 + 12, so no 64-row GEMM is short.
LAYOUT = dict(text_len=9, latent_frames=5, latent_hw=(8, 10), audio_latents=13)
ROWS = 175
CHUNK_SIZES = (1, 7, 64, ROWS, ROWS + 5)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Hundreds of tiny per-chunk ops: on a loaded 2-core machine every OpenMP fork/join waits for a time slice.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chunked")
    fp32 = save_comfy(reference_model(TINY, seed=11), TINY, folder / "tiny_fp32.safetensors")
    bf16 = save_comfy(cast_like_release(reference_model(TINY, seed=11)), TINY, folder / "tiny_bf16.safetensors")
    return {"fp32": fp32, "bf16": bf16}


@pytest.fixture(scope="module")
def model(checkpoints):
    return h3_core.load_dit(checkpoints["fp32"])


@pytest.fixture(scope="module")
def inputs():
    inp = packed_inputs(TINY, **LAYOUT)
    assert inp["position_ids"].shape[0] == ROWS
    tags = set(inp["token_tags"].tolist())
    assert tags == {0, 1, 2}  # video / keyframe-vision, text and audio rows all present
    return inp


@pytest.fixture(scope="module")
def fused_output(model, inputs):
    model.configure_chunking()
    with torch.no_grad():
        return model(**inputs)


# Without the CPU's 768-row floor on attention query chunks, so that small query chunks run on CPU too.
ANY_QUERY_ROWS = ChunkingBackend("any query rows")


def run(model, inputs, chunk_size, backend=None):
    model.chunking = ChunkingPolicy(chunk_size, backend=backend)
    try:
        with torch.no_grad():
            return model(**inputs)
    finally:
        model.chunking = ChunkingPolicy()


def block_inputs(model, inputs, batch=1, seed=5):
    """Inputs of one TransformerBlock: a random residual stream, the AdaLN input, row indices, RoPE."""
    g = torch.Generator().manual_seed(seed)
    rows = inputs["position_ids"].shape[0]
    x = torch.randn(batch, rows, TINY.hidden_size, generator=g)
    time_act = model.embed_time(inputs["timestep"])
    adaln_index = inputs["timestep_indices"] * NUM_MODALITIES + inputs["token_tags"].clamp(min=0)
    return x, time_act, adaln_index, model.rope(inputs["position_ids"])


def exact_linear(x, weight, bias=None):
    """A linear layer whose every output element is computed the same way whatever the number of rows."""
    out = (x.unsqueeze(-2) * weight).sum(-1)
    return out if bias is None else out + bias


# ---- the fused path is the reference implementation's forward -----------------------------------------------------


def test_fused_path_is_bitwise_the_reference(checkpoints, inputs, fused_output):
    reference = reference_model(TINY, seed=11)
    with torch.no_grad():
        expected = reference(**inputs, return_dict=False)
    assert torch.equal(fused_output[0], expected[0]) and torch.equal(fused_output[1], expected[1])


# ---- whole model ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", (None, ANY_QUERY_ROWS), ids=("device-backend", "any-query-rows"))
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_chunked_forward_matches_fused_fp32(model, inputs, fused_output, chunk_size, backend):
    video, audio = run(model, inputs, chunk_size, backend)
    assert rel_l2(video, fused_output[0]) <= 1e-6
    assert rel_l2(audio, fused_output[1]) <= 1e-6
    if chunk_size >= ROWS:  # one chunk is the fused path
        assert torch.equal(video, fused_output[0]) and torch.equal(audio, fused_output[1])


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_chunked_bf16_close_to_fp32(checkpoints, inputs, fused_output, chunk_size):
    model_bf16 = h3_core.load_dit(checkpoints["bf16"])
    model_bf16.chunking = ChunkingPolicy(chunk_size, backend=ANY_QUERY_ROWS)
    assert model_bf16.residual_dtype == torch.bfloat16
    with torch.no_grad():
        video, audio = model_bf16(**inputs)
    assert rel_l2(video, fused_output[0]) <= 1e-2
    assert rel_l2(audio, fused_output[1]) <= 1e-2


def test_batch_of_two_matches_fused(model):
    inp = packed_inputs(TINY, batch=2, **LAYOUT)
    fused = run(model, inp, None)
    video, audio = run(model, inp, 64, ANY_QUERY_ROWS)
    assert rel_l2(video, fused[0]) <= 1e-6 and rel_l2(audio, fused[1]) <= 1e-6
    video, audio = run(model, inp, 64)  # CPU: one 175-row query chunk, MLP and heads in 64-row chunks
    assert torch.equal(video, fused[0]) and torch.equal(audio, fused[1])


# ---- the MLP and the heads: bitwise ---------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_mlp_chunking_is_bitwise(model, inputs, monkeypatch, chunk_size):
    block = model.blocks[0]
    x, time_act, adaln_index, _ = block_inputs(model, inputs, batch=2)
    modulation = block.modulation(time_act)
    with torch.no_grad():
        fused = block.mlp_residual_(x.clone(), modulation, adaln_index, FUSED)
        chunked = block.mlp_residual_(x.clone(), modulation, adaln_index, RowChunks(chunk_size))
        if chunk_size >= 12:
            assert torch.equal(chunked, fused)
        else:  # MKL's short-GEMM kernels, see the module docstring
            assert rel_l2(chunked, fused) <= 1e-6
        monkeypatch.setattr(F, "linear", exact_linear)
        fused_exact = block.mlp_residual_(x.clone(), modulation, adaln_index, FUSED)
        chunked_exact = block.mlp_residual_(x.clone(), modulation, adaln_index, RowChunks(chunk_size))
    assert torch.equal(chunked_exact, fused_exact)
    assert rel_l2(fused_exact, fused) <= 1e-6  # the exact linear is a linear layer, not something else


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_heads_chunking_is_bitwise(model, inputs, monkeypatch, chunk_size):
    x, time_act, _, _ = block_inputs(model, inputs, batch=2)
    args = (x, time_act, inputs["timestep_indices"], inputs["video_indices"], inputs["audio_indices"])
    with torch.no_grad():
        fused = model.final_layer(*args, FUSED)
        chunked = model.final_layer(*args, RowChunks(chunk_size))
        for got, want in zip(chunked, fused):
            if chunk_size >= 12:
                assert torch.equal(got, want)
            else:
                assert rel_l2(got, want) <= 1e-6
        monkeypatch.setattr(F, "linear", exact_linear)
        fused_exact = model.final_layer(*args, FUSED)
        chunked_exact = model.final_layer(*args, RowChunks(chunk_size))
    for got, want in zip(chunked_exact, fused_exact):
        assert torch.equal(got, want)


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_attention_chunking_within_1e6(model, inputs, chunk_size):
    block = model.blocks[1]
    x, time_act, adaln_index, rope = block_inputs(model, inputs)
    modulation = block.modulation(time_act)
    with torch.no_grad():
        fused = block.attention_residual(x, modulation, adaln_index, rope, FUSED)
        chunked = block.attention_residual(x, modulation, adaln_index, rope, RowChunks(chunk_size))
        # Against the residual-free attention output too, so the residual cannot hide an attention error.
        assert rel_l2(chunked - x, fused - x) <= 1e-6
        refiner_attn = model.token_refiner.blocks[0].attn
        plain = refiner_attn(x, rope)
        assert rel_l2(refiner_attn(x, rope, RowChunks(chunk_size)), plain) <= 1e-6


def test_block_leaves_its_input_untouched(model, inputs):
    x, time_act, adaln_index, rope = block_inputs(model, inputs)
    before = x.clone()
    with torch.no_grad():
        model.blocks[0](x, time_act, adaln_index, rope, RowChunks(7))
    assert torch.equal(x, before)


# ---- no extra linear work -------------------------------------------------------------------------------------------


def linear_flops(model, inputs, chunk_size):
    model.chunking = ChunkingPolicy(chunk_size, backend=ANY_QUERY_ROWS)
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(**inputs)
    finally:
        model.chunking = ChunkingPolicy()
    counts = counter.get_flop_counts()["Global"]
    return sum(v for op, v in counts.items() if op.__name__.split(".")[0] in ("mm", "addmm", "bmm", "baddbmm"))


@pytest.mark.parametrize("chunk_size", (7, 64))
def test_chunked_does_no_more_linear_work(model, inputs, chunk_size):
    fused = linear_flops(model, inputs, None)
    chunked = linear_flops(model, inputs, chunk_size)
    assert chunked <= fused
    # The counter sees every block GEMM: QKV, out_proj, fc1, fc2 over all rows (a second QKV pass would add 3/7 of
    # the attention projections and fail the check above).
    c = TINY
    block_gemm = 2 * ROWS * c.hidden_size * (3 * c.inner_dim + c.inner_dim + 3 * c.ffn_dim)
    assert fused >= c.num_layers * block_gemm


# ---- bounded temporaries --------------------------------------------------------------------------------------------


class LargestTemporary(TorchDispatchMode):
    """Largest non-view op result, not counting plain allocations (the preallocated buffers), and those buffers."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.buffers = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        # A result sharing an input's storage is a view or an in-place write, not a new temporary.
        inputs = {a.untyped_storage().data_ptr() for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in inputs:
                continue
            if name in ("empty", "new_empty", "empty_like"):
                self.buffers.append(tuple(t.shape))
            else:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("chunk_size", (7, 64))
def test_chunked_block_temporaries_scale_with_the_chunk(model, inputs, chunk_size):
    block = model.blocks[0]
    x, time_act, adaln_index, rope = block_inputs(model, inputs)
    c = TINY
    widest = max(2 * c.ffn_dim, 2 * c.inner_dim, c.hidden_size)
    with torch.no_grad():
        with LargestTemporary() as fused:
            block(x, time_act, adaln_index, rope, FUSED)
        with LargestTemporary() as chunked:
            block(x, time_act, adaln_index, rope, RowChunks(chunk_size))
    assert fused.largest >= ROWS * 2 * c.ffn_dim  # the fused fc1 output: the check can see a full-length temporary
    modulation_table = 3 * NUM_MODALITIES * 6 * c.hidden_size  # [3M, 6 hidden] with M = 3 distinct timesteps
    assert chunked.largest <= max(chunk_size * widest, modulation_table)
    # The only full-length buffers: K, V and the block output.
    assert sorted(chunked.buffers) == sorted([(1, ROWS, c.num_attention_heads, c.attention_head_dim)] * 2
                                             + [(1, ROWS, c.hidden_size)])


# ---- chunk size from a memory budget ----------------------------------------------------------------------------


H3 = H3DiTConfig()  # the released 33B shapes
CPU, CUDA, MPS = (Platform(d).chunking for d in ("cpu", "cuda", "mps"))


def test_no_budget_means_fused_except_where_the_backend_forbids_it():
    assert chunk_rows_for_budget(48_768, H3, element_bytes=2, memory_budget=None, backend=CPU) is None
    assert chunk_rows_for_budget(48_768, H3, element_bytes=2, memory_budget=None, backend=CUDA) is None
    # MPS: 56 heads x 48,768 key rows x 2 bytes = 5.46 MB of scores per query row; 4 GiB / that = 786 -> 768 rows.
    assert chunk_rows_for_budget(48_768, H3, element_bytes=2, memory_budget=None, backend=MPS) == 768
    # At 12,000 rows the 4 GiB buffer limit allows 3195 rows (3136 after rounding); no 2048 cap below 12,288 rows.
    assert chunk_rows_for_budget(12_000, H3, element_bytes=2, memory_budget=None, backend=MPS) == 3136
    # Above 12,288 rows at most 2048 query rows even where the buffer limit would allow more (fewer heads here).
    narrow = H3DiTConfig(num_attention_heads=8, attention_head_dim=128, hidden_size=1024, time_embed_hidden_dim=1024)
    assert chunk_rows_for_budget(12_400, narrow, element_bytes=2, memory_budget=None, backend=MPS) == 2048
    assert chunk_rows_for_budget(12_288, narrow, element_bytes=2, memory_budget=None, backend=MPS) is None
    assert chunk_rows_for_budget(4_000, H3, element_bytes=2, memory_budget=None, backend=MPS) is None


def test_budget_sizes_are_the_largest_multiple_of_64_that_fits():
    per_row = 2 * projection_elements_per_row(H3)
    for rows_fitting in (64, 200, 1000, 4097):
        budget = rows_fitting * per_row
        size = chunk_rows_for_budget(48_768, H3, element_bytes=2, memory_budget=budget, backend=CUDA)
        assert size % 64 == 0 and size * per_row <= budget < (size + 64) * per_row
    # Batch 2 doubles every row's bytes.
    assert chunk_rows_for_budget(48_768, H3, batch=2, element_bytes=2, memory_budget=1000 * per_row,
                                 backend=CUDA) == 448
    # Too small a budget is clamped to 64 rows; a budget covering the whole sequence is the fused path.
    assert chunk_rows_for_budget(48_768, H3, element_bytes=2, memory_budget=1, backend=CUDA) == 64
    assert chunk_rows_for_budget(1000, H3, element_bytes=2, memory_budget=1000 * per_row, backend=CUDA) is None
    assert chunk_rows_for_budget(40, H3, element_bytes=2, memory_budget=1, backend=CUDA) is None


def test_materialised_scores_bound_the_query_rows():
    scores_per_row = 56 * 48_768 * 2  # heads x key rows x bf16
    size = chunk_rows_for_budget(48_768, H3, element_bytes=2, memory_budget=128 * scores_per_row, backend=MPS)
    assert size == 128  # the spec's 128 rows ~ 0.65 GiB of scores
    # The same budget on a fused-kernel backend is bounded by the projections only.
    assert chunk_rows_for_budget(48_768, H3, element_bytes=2, memory_budget=128 * scores_per_row,
                                 backend=CUDA) > 2048


def test_explicit_chunk_size_wins():
    policy = ChunkingPolicy(chunk_size=100, memory_budget=1, backend=MPS)
    assert policy.plan(48_768, H3, batch=1, dtype=torch.bfloat16, device="cpu").size == 100
    policy = ChunkingPolicy(memory_budget=1000 * 2 * projection_elements_per_row(H3))
    assert policy.plan(48_768, H3, batch=1, dtype=torch.bfloat16, device="cpu").size == 960
    assert policy.plan(48_768, H3, batch=1, dtype=torch.float32, device="cpu").size == 448
    # Without a budget the CPU only bounds the rows of a chunk (32,768: an interrupt lands between chunks).
    assert ChunkingPolicy().plan(48_768, H3, batch=1, dtype=torch.bfloat16, device="cpu").size == 32_768
    assert ChunkingPolicy().plan(48_768, H3, batch=1, dtype=torch.bfloat16, device="mps").size == 768


def test_cpu_attention_queries_run_in_calls_of_at_least_768_rows():
    # ATen's CPU flash attention is ~14 % slower per query row below 768 query rows (smaller query tiles). Where a
    # call would then do more than the CPU's max_attention_work, that bound wins (tests/test_cancel_latency.py).
    cpu = ChunkingBackend("cpu", min_query_rows=CPU.min_query_rows)
    chunks = ChunkingPolicy(chunk_size=256, backend=cpu).plan(12_432, H3, batch=1, dtype=torch.float32, device="cpu")
    assert (chunks.size, chunks.query_size) == (256, 768)
    assert list(chunks.query_ranges(2000)) == [(0, 768), (768, 1536), (1536, 2000)]
    chunks = ChunkingPolicy(chunk_size=1024, backend=cpu).plan(12_432, H3, batch=1, dtype=torch.float32, device="cpu")
    assert chunks.query_size == 1024
    for device in ("cuda", "mps"):
        chunks = ChunkingPolicy(chunk_size=256).plan(12_432, H3, batch=1, dtype=torch.float32, device=device)
        assert chunks.query_size == 256
    assert ChunkingPolicy(backend=cpu).plan(12_432, H3, batch=1, dtype=torch.float32, device="cpu").query_size is None


def test_memory_budget_option_chunks_the_forward(checkpoints, inputs, fused_output):
    per_row = 4 * projection_elements_per_row(TINY)
    model = h3_core.load_dit(checkpoints["fp32"], memory_budget=100 * per_row)
    assert model.chunking.plan(ROWS, TINY, batch=1, dtype=torch.float32, device="cpu").size == 64
    calls = []
    model.configure_chunking(memory_budget=100 * per_row, between_chunks=lambda: calls.append(1))
    with torch.no_grad():
        video, audio = model(**inputs)
    assert calls  # it did run chunked
    assert rel_l2(video, fused_output[0]) <= 1e-6 and rel_l2(audio, fused_output[1]) <= 1e-6


# ---- the between-chunks hook ---------------------------------------------------------------------------------------


def test_between_chunks_hook_runs_after_every_chunk(model, inputs):
    calls = []
    model.configure_chunking(chunk_size=64, between_chunks=lambda: calls.append(1))
    model.chunking.backend = ANY_QUERY_ROWS
    try:
        with torch.no_grad():
            model(**inputs)
        chunked_calls = len(calls)
        calls.clear()
        model.configure_chunking()  # keeps the hook, fused: one chunk, nothing between
        with torch.no_grad():
            model(**inputs)
    finally:
        model.chunking = ChunkingPolicy()
    def chunks(rows):  # a loop over <= 64 rows is one chunk: nothing between
        return math.ceil(rows / 64) if rows > 64 else 0

    per_block = 3 * chunks(ROWS)  # keys/values, queries, MLP
    heads = chunks(inputs["video_indices"].numel()) + chunks(inputs["audio_indices"].numel())
    assert per_block == 9 and heads == 3
    assert chunked_calls == TINY.num_layers * per_block + heads
    assert calls == []


def test_every_n_chunks():
    reclaimed = []
    hook = EveryNChunks(3, lambda: reclaimed.append(1))
    for _ in range(10):
        hook()
    assert len(reclaimed) == 3
    with pytest.raises(ChunkingError, match="every"):
        EveryNChunks(0, lambda: None)


def test_row_chunks_ranges():
    assert list(RowChunks(64).ranges(150)) == [(0, 64), (64, 128), (128, 150)]
    assert list(RowChunks(None).ranges(150)) == [(0, 150)]
    assert list(RowChunks(200).ranges(150)) == [(0, 150)]
    assert list(RowChunks(4).ranges(0)) == [(0, 0)]
    assert list(RowChunks(64, query_size=100).query_ranges(150)) == [(0, 100), (100, 150)]
    assert list(RowChunks(64).query_ranges(150)) == [(0, 64), (64, 128), (128, 150)]


# ---- options and errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, named", [
    ({"chunk_size": 0}, "chunk_size"), ({"chunk_size": -64}, "chunk_size"), ({"chunk_size": "256"}, "chunk_size"),
    ({"chunk_size": True}, "chunk_size"), ({"memory_budget": 0}, "memory_budget"),
    ({"memory_budget": 1.5e9}, "memory_budget"),
])
def test_bad_options_raise_one_error_naming_the_value(tmp_path, options, named):
    # Checked before the checkpoint is opened: the missing file does not mask the option error.
    with pytest.raises(ChunkingError, match=named) as info:
        h3_core.load_dit(tmp_path / "missing.safetensors", **options)
    assert repr(next(iter(options.values()))) in str(info.value)
    assert isinstance(info.value, h3_core.H3Error)


def test_load_dit_chunk_size_option(checkpoints, inputs, fused_output):
    model = h3_core.load_dit(checkpoints["fp32"], chunk_size=64)
    assert model.chunking.chunk_size == 64
    with torch.no_grad():
        video, _ = model(**inputs)
    assert rel_l2(video, fused_output[0]) <= 1e-6
    with pytest.raises(ChunkingError, match="between_chunks"):
        model.configure_chunking(chunk_size=64, between_chunks=3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_chunked_matches_fused_on_cuda(checkpoints, inputs):
    model = h3_core.load_dit(checkpoints["fp32"], device="cuda")
    cuda_inputs = {k: v.cuda() for k, v in inputs.items()}
    fused = run(model, cuda_inputs, None)
    for chunk_size in (1, 7, 64):
        video, audio = run(model, cuda_inputs, chunk_size)
        assert rel_l2(video, fused[0]) <= 1e-5 and rel_l2(audio, fused[1]) <= 1e-5


# ---- one forward: fused and chunked run the same functions ----------------------------------------------------------


def test_fused_and_chunked_enter_the_same_attention_and_mlp_code(model, inputs, fused_output, monkeypatch):
    """Every block's attention (main blocks through their AdaLN wrapper, refiner blocks plain) enters
    `Attention.forward` once per forward whatever the chunking, and the MLP runs its chunk loop; only the row ranges
    differ. A second, fused-only branch anywhere would leave the counts of the fused run different."""
    from h3_core.models.dit import Attention, SwiGLU

    calls = {"attention": [], "mlp_rows": []}
    attention_forward, mlp_forward = Attention.forward, SwiGLU.forward

    def counting_attention(self, x, rope=None, chunks=FUSED, **hooks):
        calls["attention"].append((chunks.size, sorted(hooks)))
        return attention_forward(self, x, rope, chunks, **hooks)

    def counting_mlp(self, x):
        calls["mlp_rows"].append(x.shape[1])
        return mlp_forward(self, x)

    monkeypatch.setattr(Attention, "forward", counting_attention)
    monkeypatch.setattr(SwiGLU, "forward", counting_mlp)
    blocks, refiners = TINY.num_layers, TINY.num_refiner_layers
    text_rows = LAYOUT["text_len"]

    fused = run(model, inputs, None)
    assert calls["attention"] == [(None, [])] * refiners + [(None, ["finish", "prepare"])] * blocks
    assert calls["mlp_rows"] == [text_rows] * refiners + [ROWS] * blocks
    for key in calls:
        calls[key].clear()

    chunked = run(model, inputs, 64, ANY_QUERY_ROWS)
    assert calls["attention"] == [(None, [])] * refiners + [(64, ["finish", "prepare"])] * blocks
    assert calls["mlp_rows"] == [text_rows] * refiners + [64, 64, ROWS - 128] * blocks
    assert all(torch.equal(a, b) for a, b in zip(fused, fused_output))  # the counting wrappers change nothing
    assert all(rel_l2(a, b) <= 1e-6 for a, b in zip(chunked, fused_output))


# ---- the MPS chunk caps bind every chunk size -----------------------------------------------------------------------

GiB = 1 << 30


def mps_plan(rows, config=H3, **policy):
    return ChunkingPolicy(backend=MPS, **policy).plan(rows, config, batch=1, dtype=torch.bfloat16, device="cpu")


def score_bytes(query_rows, key_rows, config=H3):
    return config.num_attention_heads * query_rows * key_rows * 2  # MPS materialises [heads, q, k] in bf16


def test_an_explicit_chunk_size_is_clamped_to_the_mps_caps_with_a_warning():
    with pytest.warns(ChunkSizeClamped, match="chunk_size 8192 is above what mps allows for 48768 packed rows; "
                                              "using 768 rows per chunk"):
        chunks = mps_plan(48_768, chunk_size=8192)
    assert chunks.size == chunks.query_size == 768 and score_bytes(768, 48_768) <= 4 * GiB
    # Above 12,288 rows at most 2048 query rows, even where the 4 GiB buffer limit would allow more.
    narrow = H3DiTConfig(num_attention_heads=8, attention_head_dim=128, hidden_size=1024, time_embed_hidden_dim=1024)
    with pytest.warns(ChunkSizeClamped):
        assert mps_plan(12_400, narrow, chunk_size=4096).size == 2048
    # Sizes within the caps are kept as asked (no warning); the caps are MPS's, not CUDA's.
    assert mps_plan(48_768, chunk_size=512).size == 512
    cuda = ChunkingPolicy(chunk_size=8192, backend=Platform("cuda").chunking)
    assert cuda.plan(48_768, H3, batch=1, dtype=torch.bfloat16, device="cpu").size == 8192


def test_no_default_or_budget_derived_size_exceeds_the_mps_buffer_cap():
    # Two million rows: a 4 GiB score buffer holds 19 query rows, below the 64-row floor of budget-derived sizes.
    rows = 2_000_000
    for policy in ({}, {"memory_budget": 1}, {"memory_budget": 64 * GiB}):
        size = mps_plan(rows, **policy).size
        assert size is not None and score_bytes(size, rows) <= 4 * GiB, policy


def test_node_chunk_size_widgets_are_capped(tmp_path):
    import comfy_double

    comfy_double.install(tmp_path / "comfyui")
    pack = comfy_double.load_pack()
    for node_id in ("H3StreamLoader", "H3StreamSampler"):
        widget, = [i for i in pack[node_id].GET_SCHEMA().inputs if i.id == "chunk_size"]
        assert widget.max == 1 << 16, node_id
