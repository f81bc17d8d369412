"""Our Q4_K and Q6_K quantisers (`h3_core.checkpoints.kquants`, gguf 0.19 has none) against gguf's own decoder: the
bytes are ggml's block_q4_K / block_q6_K layouts (gguf's `dequantize` reads them back into the source within each
type's error), and our torch decoder reads them bit for bit as gguf does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from h3_core.checkpoints import gguf_dequant
from h3_core.checkpoints.kquants import Q4_K_BYTES, Q6_K_BYTES, QK_K, q4_k_suits, quantize_q4_k, quantize_q6_k

gguf = pytest.importorskip("gguf")
Q4_K = gguf.GGMLQuantizationType.Q4_K
# Relative RMS error of Q4_K on normal rows, measured 0.0718 (64 x 4096 values, seed 0); gguf's own Q4_1 (the same
# 4-bit affine codes on 32 values, with an fp16 scale and min per block and no search) gives 0.078 on them, and a
# uniform 16-level grid over a sub-block's expected range (about 4.1 sigma for 32 normals) 4.1 / 15 / sqrt(12) =
# 0.079: the search must beat both.
Q4_K_RELATIVE_RMS = 0.074
# Q6_K on the same rows: measured 0.0177 (gguf's Q5_1 0.038, Q8_0 0.0053).
Q6_K_RELATIVE_RMS = 0.019
Q6_K = gguf.GGMLQuantizationType.Q6_K
QUANTISERS = {"Q4_K": (quantize_q4_k, Q4_K, gguf_dequant.Q4_K), "Q6_K": (quantize_q6_k, Q6_K, gguf_dequant.Q6_K)}


def reference(blocks: torch.Tensor, shape, qtype=Q4_K) -> torch.Tensor:
    """gguf's NumPy decoder of our bytes."""
    return torch.from_numpy(np.array(gguf.quants.dequantize(blocks.numpy(), qtype))).reshape(shape)


def relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).pow(2).mean().sqrt() / want.double().pow(2).mean().sqrt())


@pytest.mark.parametrize("name, size", [("Q4_K", Q4_K_BYTES), ("Q6_K", Q6_K_BYTES)])
def test_layout_and_size_are_ggml_blocks(name, size):
    quantise, qtype, _ = QUANTISERS[name]
    assert gguf.GGML_QUANT_SIZES[qtype] == (QK_K, size)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    blocks = quantise(x)
    assert blocks.dtype == torch.uint8 and blocks.shape == (3, 2 * size)
    assert reference(blocks, x.shape, qtype).shape == x.shape


def test_q6_k_normal_rows_come_back_within_its_error_and_better_than_gguf_q5_1():
    x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0))
    error = relative_rms(reference(quantize_q6_k(x), x.shape, Q6_K), x)
    q5_1 = gguf.GGMLQuantizationType.Q5_1
    theirs = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), q5_1), q5_1))
    # one more bit than Q5_1: below half its error
    assert 0.01 < error <= Q6_K_RELATIVE_RMS and error < relative_rms(theirs, x) / 2, error


def test_normal_rows_come_back_within_q4_k_error_and_better_than_gguf_q4_1():
    x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0))
    error = relative_rms(reference(quantize_q4_k(x), x.shape), x)
    q4_1 = gguf.GGMLQuantizationType.Q4_1
    theirs = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), q4_1), q4_1))
    assert 0.05 < error <= Q4_K_RELATIVE_RMS < relative_rms(theirs, x), error


@pytest.mark.parametrize("make", [
    lambda g: torch.randn(8, 768, generator=g) * 0.02,  # a trained weight's scale
    lambda g: torch.rand(8, 256, generator=g) + 0.5,  # all positive: the min stays 0
    lambda g: -torch.rand(8, 256, generator=g),  # all negative
    lambda g: torch.randn(8, 256, generator=g) * torch.logspace(-4, 2, 8)[:, None],  # rows of very different scales
    lambda g: torch.randn(2, 4, 512, generator=g),  # 3-D: rows are the last dimension
], ids=["small", "positive", "negative", "scales", "3d"])
@pytest.mark.parametrize("name", list(QUANTISERS))
def test_our_decoder_reads_the_bytes_bit_for_bit_as_gguf(make, name):
    quantise, qtype, ours = QUANTISERS[name]
    x = make(torch.Generator().manual_seed(2))
    blocks = quantise(x)
    want = reference(blocks.reshape(-1, blocks.shape[-1]), (-1, x.shape[-1]), qtype).reshape(x.shape)
    assert torch.equal(gguf_dequant.dequantize(blocks, ours), want)
    assert relative_rms(want, x) < (0.1 if name == "Q4_K" else 0.025)


@pytest.mark.parametrize("name", list(QUANTISERS))
def test_zero_and_constant_blocks_are_exact(name):
    quantise, qtype, _ = QUANTISERS[name]
    x = torch.zeros(2, 512)
    x[1, 256:] = -3.0  # a constant negative super-block: all its values are the min
    got = reference(quantise(x), x.shape, qtype)
    assert torch.equal(got[0], torch.zeros(512)) and torch.equal(got[1, :256], torch.zeros(256))
    assert torch.allclose(got[1, 256:], x[1, 256:], rtol=1e-3)


@pytest.mark.parametrize("name", list(QUANTISERS))
def test_bf16_input_quantises_its_values(name):
    quantise = QUANTISERS[name][0]
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert torch.equal(quantise(x), quantise(x.float()))


@pytest.mark.parametrize("shape", [(4, 64), (4, 300), (256,), (0,)])
def test_rows_that_are_not_whole_super_blocks_are_refused(shape):
    assert q4_k_suits(shape) is (shape == (256,))
    if shape == (256,):
        return
    for quantise, name in ((quantize_q4_k, "Q4_K"), (quantize_q6_k, "Q6_K")):
        with pytest.raises(ValueError, match=f"{name} needs rows of a multiple of 256 values"):
            quantise(torch.zeros(shape))
