"""The torch GGUF decoder (h3_core/checkpoints/gguf_dequant.py) against gguf's NumPy `dequantize`, bit for bit."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from h3_core.checkpoints import gguf_dequant  # noqa: E402

T = gguf.GGMLQuantizationType
TYPES = sorted(gguf_dequant.BLOCK)

# The float16 scale fields of each block (byte offsets): random bytes there are made finite.
F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q2_K: (80, 82),
              T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_NL: (0,), T.IQ4_XS: (0,),
              T.TQ1_0: (52,), T.TQ2_0: (64,)}
# float16 edge values: 0, -0, the smallest subnormal, the smallest normal, 1, the largest finite (both signs).
F16_EDGES = np.array([0x0000, 0x8000, 0x0001, 0x0400, 0x3C00, 0x7BFF, 0xFBFF], dtype=np.uint16)


def _same_bits(ours: torch.Tensor, theirs: np.ndarray) -> None:
    assert ours.dtype == torch.float32 and tuple(ours.shape) == theirs.shape
    mismatch = ours.view(torch.int32).numpy() != theirs.astype(np.float32, copy=False).view(np.int32)
    assert not mismatch.any(), f"{mismatch.sum()} values differ, first at {np.argwhere(mismatch)[0]}"


def _random_blocks(qtype, n_blocks: int, rng) -> np.ndarray:
    """Random block bytes with finite scales: every code value occurs, plus all-0x00 / all-0xFF code bytes and
    edge-valued scales."""
    values, size = gguf_dequant.BLOCK[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    raw[0, :], raw[1, :] = 0x00, 0xFF
    if qtype in (T.F32, T.F16, T.BF16):  # plain floats: clear one exponent bit of every NaN / inf
        view = raw.view({T.F32: np.uint32, T.F16: np.uint16, T.BF16: np.uint16}[qtype])
        exp = {T.F32: 0x7F800000, T.F16: 0x7C00, T.BF16: 0x7F80}[qtype]
        low_bit = exp & -exp
        view[(view & exp) == exp] ^= view.dtype.type(low_bit)
        return raw
    for at in F16_FIELDS.get(qtype, ()):
        field = raw[:, at:at + 2].copy().view(np.uint16)
        field[(field & 0x7C00) == 0x7C00] &= np.uint16(0xFBFF)
        field[:len(F16_EDGES), 0] = F16_EDGES[:n_blocks]
        raw[:, at:at + 2] = field.view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: T(t).name)
def test_random_blocks_match_gguf(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = _random_blocks(qtype, 96, rng).reshape(8, -1)  # 8 rows of 12 blocks
    with np.errstate(over="ignore"):  # MXFP4's largest shared exponents make infinities (the same in both)
        want = gguf.quants.dequantize(raw, T(qtype))
    _same_bits(gguf_dequant.dequantize(torch.from_numpy(raw), qtype), want)


QUANTISABLE = [t for t in TYPES if T(t) in (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.TQ1_0,
                                             T.TQ2_0, T.MXFP4)]


@pytest.mark.parametrize("qtype", QUANTISABLE, ids=lambda t: T(t).name)
def test_gguf_quantised_values_match_gguf(qtype):
    """Bytes from gguf's own `quantize` of values with edges: zeros, constant rows, huge and tiny magnitudes."""
    rng = np.random.default_rng(100 + int(qtype))
    cols = 512
    x = rng.standard_normal((6, cols)).astype(np.float32)
    x[1] = 0.0
    x[2] = -3.0
    x[3] *= 2e3  # scales stay finite float16
    x[4] *= 1e-7
    x[5, ::7] = 0.0
    raw = gguf.quants.quantize(x, T(qtype))
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(6, -1)
    _same_bits(gguf_dequant.dequantize(torch.from_numpy(raw), qtype), gguf.quants.dequantize(raw, T(qtype)))


def test_rows_keep_their_leading_shape_and_strided_input():
    rng = np.random.default_rng(7)
    raw = _random_blocks(T.Q6_K, 12, rng).reshape(2, 3, -1)
    ours = gguf_dequant.dequantize(torch.from_numpy(raw), T.Q6_K)
    assert ours.shape == (2, 3, 2 * 256)
    wide = torch.zeros(2, 3, raw.shape[-1] + 5, dtype=torch.uint8)
    wide[..., 5:] = torch.from_numpy(raw)
    assert torch.equal(gguf_dequant.dequantize(wide[..., 5:], T.Q6_K), ours)  # a view that is not contiguous


def test_every_type_gguf_dequantises_is_decoded_in_torch_or_named():
    """The grid-based IQ types are the only ones gguf dequantises that the torch decoder leaves to NumPy."""
    grid_types = {T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M}
    for t in T:
        size = gguf.GGML_QUANT_SIZES.get(t)
        if size is None or t in (T.F64, T.I8, T.I16, T.I32, T.I64):
            continue
        try:
            gguf.quants.dequantize(np.zeros((1, size[1]), dtype=np.uint8), t)
        except NotImplementedError:
            continue
        assert gguf_dequant.torch_decodes(t) or t in grid_types, t.name
        assert gguf_dequant.BLOCK.get(int(t), size) == size, t.name


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="34-byte blocks"):
        gguf_dequant.dequantize(torch.zeros(2, 33, dtype=torch.uint8), T.Q8_0)
    with pytest.raises(ValueError, match="uint8"):
        gguf_dequant.dequantize(torch.zeros(2, 34, dtype=torch.int8), T.Q8_0)


# --- where quantised payloads are decoded ---------------------------------------------------------------------------

def _gguf_weight(qtype, rows=4, cols=512):
    from h3_core.checkpoints.quantised import QuantisedWeight

    values, size = gguf_dequant.BLOCK[int(qtype)] if int(qtype) in gguf_dequant.BLOCK else gguf.GGML_QUANT_SIZES[qtype]
    return QuantisedWeight("x.gguf", f"gguf {T(qtype).name}", ("w",), (rows, cols // values * size), (rows, cols),
                           gguf_type=int(qtype)), (rows, cols // values * size)


@pytest.mark.parametrize("qtype", [t for t in TYPES if t not in (T.F32, T.F16, T.BF16)], ids=lambda t: T(t).name)
def test_gguf_weights_decode_where_their_blocks_are_without_a_host_trip(qtype, monkeypatch):
    """The census of copies: the blocks on the meta device, which nothing can copy out of (a trip through the host
    raises), and gguf's NumPy code disabled; the weight comes out on the blocks' device, in the compute dtype."""
    with pytest.raises(NotImplementedError):
        torch.empty(1, device="meta").cpu()

    def no_numpy(*_):
        raise AssertionError("decoded by gguf's NumPy code")

    monkeypatch.setattr(gguf.quants, "dequantize", no_numpy)
    q, stored = _gguf_weight(qtype)
    out = q.dequantise([torch.empty(stored, dtype=torch.uint8, device="meta")], torch.bfloat16, q.shape)
    assert (out.device.type, out.dtype, tuple(out.shape)) == ("meta", torch.bfloat16, q.shape)


def test_gguf_weight_in_the_compute_dtype_is_gguf_values_cast():
    q, stored = _gguf_weight(T.Q4_K)
    raw = _random_blocks(T.Q4_K, 8, np.random.default_rng(3)).reshape(stored)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, T.Q4_K)).to(torch.bfloat16)
    assert torch.equal(q.dequantise([torch.from_numpy(raw)], torch.bfloat16, q.shape).view(torch.int16),
                       expected.view(torch.int16))


def test_grid_types_still_decode_through_gguf_on_the_host():
    q, stored = _gguf_weight(T.IQ2_XXS)
    raw = np.zeros(stored, dtype=np.uint8)
    out = q.dequantise([torch.from_numpy(raw)], torch.float32, q.shape)
    assert torch.equal(out, torch.from_numpy(gguf.quants.dequantize(raw, T.IQ2_XXS)))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: T(t).name)
def test_a_weight_decoded_in_row_pieces_is_gguf_values_cast(qtype, monkeypatch):
    """Large weights decode a few rows at a time (the decoders' float32 temporaries of a whole token embedding took
    8.5 GB): pieces of 3 rows, the last one short, give gguf's values exactly."""
    from h3_core.checkpoints import quantised

    monkeypatch.setattr(quantised, "DECODE_CHUNK_VALUES", 3 * 512)
    q, stored = _gguf_weight(qtype, rows=10)
    raw = _random_blocks(qtype, stored[0] * stored[1] // gguf_dequant.BLOCK[int(qtype)][1],
                         np.random.default_rng(5)).reshape(stored)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).to(torch.bfloat16)
    assert torch.equal(q.dequantise([torch.from_numpy(raw)], torch.bfloat16, q.shape).view(torch.int16),
                       expected.view(torch.int16))
