"""GGUF Q4_K quantisation in torch (gguf 0.19's Python package decodes K-quants but cannot make them).

The algorithm is llama.cpp's reference one for Q4_K without an importance matrix (`quantize_row_q4_K_ref`, as
`llama-quantize` runs it when no imatrix is given), written here vectorised over whole tensors: each row is cut into
256-value super-blocks of 8 sub-blocks of 32; each sub-block gets an affine `scale * q - min` (q in 0..15) chosen by
a weighted least-squares search over 21 candidate grid steps (weights `rms + |x|`, the min kept <= 0); the 8 scales
and 8 mins of a super-block are then coded in 6 bits against its fp16 `d = max scale / 63` and `dmin = max min / 63`,
and the codes are recomputed from those coded values. The byte layout is ggml's `block_q4_K` (144 bytes: d, dmin,
12 packed scale/min bytes, 128 bytes of nibbles), what `gguf.quants.dequantize` and `gguf_dequant` read.

The sums are made in another order than llama.cpp's scalar C and the candidates' errors in closed form, so a few
blocks may pick a neighbouring candidate: the bytes are a valid Q4_K of the same quality, not llama.cpp's byte for
byte (tests/test_kquants.py checks them against gguf's own decoder).
"""

from __future__ import annotations

import torch

QK_K = 256
SUB = 32  # values per sub-block
Q4_K_BYTES = 144
_NMAX = 15  # 4-bit codes
_CANDIDATES = 21  # llama.cpp's nstep = 20 (rmin -1, rdelta 0.1): steps 14.0, 14.1, ... 16.0
# Super-block values quantised per pass: bounds the scratch tensors (22 candidates' codes of each value), whatever
# the tensor's size, and keeps them in cache.
_CHUNK = 1 << 12


def q4_k_suits(shape: tuple[int, ...]) -> bool:
    """Whether a tensor of `shape` can be stored as Q4_K: rows (the last dimension) of whole super-blocks."""
    return len(shape) >= 1 and shape[-1] % QK_K == 0 and shape[-1] > 0


def quantize_q4_k(tensor: torch.Tensor) -> torch.Tensor:
    """The Q4_K blocks of `tensor` (any float dtype, last dimension a multiple of 256): uint8, shape
    `(*tensor.shape[:-1], tensor.shape[-1] // 256 * 144)`, one row of blocks per row, as GGUF stores it."""
    return _quantise_rows(tensor, "Q4_K", Q4_K_BYTES, _q4_k_blocks)


def _quantise_rows(tensor: torch.Tensor, name: str, block_bytes: int, blocks) -> torch.Tensor:
    """`blocks(x)` (float32 super-blocks (n, 256) -> their bytes (n, block_bytes)) over `tensor`'s rows, a few
    thousand super-blocks at a time, as GGUF stores them: one row of blocks per row."""
    if not q4_k_suits(tuple(tensor.shape)):
        raise ValueError(f"{name} needs rows of a multiple of {QK_K} values, got shape {tuple(tensor.shape)}")
    shape = tuple(tensor.shape)
    flat = tensor.detach().reshape(-1, QK_K)
    out = torch.empty((flat.shape[0], block_bytes), dtype=torch.uint8)
    per_chunk = max(1, _CHUNK // (QK_K // SUB))
    for start in range(0, flat.shape[0], per_chunk):
        out[start:start + per_chunk] = blocks(flat[start:start + per_chunk].to(device="cpu", dtype=torch.float32))
    return out.reshape(*shape[:-1], shape[-1] // QK_K * block_bytes)


def _sub_block_fits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's make_qkx2_quants(32, 15, x, rms + |x|, rmin=-1, rdelta=0.1, nstep=20) on every sub-block
    `x` (n, 32): the (scale, min) of `scale * q - min` each keeps, min >= 0. Only the two numbers are kept: the codes
    are recomputed from their 6-bit coded values."""
    weights = (x * x).mean(dim=1, keepdim=True).sqrt() + x.abs()
    low = x.amin(dim=1).clamp(max=0.0)
    span = x.amax(dim=1) - low
    flat = span == 0
    span = torch.where(flat, torch.ones_like(span), span)
    shifted = x - low[:, None]
    sum_w = weights.sum(dim=1)
    wx = weights * x
    sum_x = wx.sum(dim=1)
    sum_x2 = (wx * x).sum(dim=1)

    def error(scale, offset, sum_l, sum_l2, sum_xl):
        # sum w (scale q + offset - x)^2, expanded into the sums already made
        return (scale * scale * sum_l2 + 2 * scale * offset * sum_l + offset * offset * sum_w[:, None]
                - 2 * scale * sum_xl - 2 * offset * sum_x[:, None] + sum_x2[:, None])

    # Every candidate at once: column 0 is the plain grid 15 / span (kept with its own scale and min, not a fit),
    # columns 1-21 llama.cpp's steps (15 - 1 + 0.1 k) / span.
    steps = torch.tensor([float(_NMAX)] + [-1.0 + 0.1 * k + _NMAX for k in range(_CANDIDATES)], dtype=x.dtype)
    inverse = steps[None, :] / span[:, None]  # (n, 22)
    q = torch.round_(shifted[:, None, :] * inverse[:, :, None]).clamp_(0, _NMAX)  # (n, 22, 32)
    sums = torch.bmm(q, torch.stack([weights, wx], dim=2))  # (n, 22, 2): sum w q, sum w x q
    sum_l, sum_xl = sums[..., 0], sums[..., 1]
    sum_l2 = torch.bmm(q.mul_(q), weights[:, :, None])[..., 0]
    del q
    det = sum_w[:, None] * sum_l2 - sum_l * sum_l
    safe = torch.where(det > 0, det, torch.ones_like(det))
    scale = (sum_w[:, None] * sum_xl - sum_x[:, None] * sum_l) / safe
    offset = (sum_l2 * sum_x[:, None] - sum_l * sum_xl) / safe
    positive = offset > 0  # the min is kept <= 0: refit the scale alone
    scale = torch.where(positive, sum_xl / torch.where(sum_l2 > 0, sum_l2, torch.ones_like(sum_l2)), scale)
    offset = torch.where(positive, torch.zeros_like(offset), offset)
    scale[:, 0], offset[:, 0] = 1 / inverse[:, 0], low
    err = error(scale, offset, sum_l, sum_l2, sum_xl)
    err[:, 1:] = torch.where(det[:, 1:] > 0, err[:, 1:], torch.full_like(err[:, 1:], float("inf")))
    # the first strictly smallest, as llama.cpp's scan keeps a candidate only when it is better
    pick = err.argmin(dim=1, keepdim=True)
    best_scale, best_offset = scale.gather(1, pick)[:, 0], offset.gather(1, pick)[:, 0]
    best_scale = torch.where(flat, torch.zeros_like(best_scale), best_scale)
    return best_scale, -best_offset


def _six_bit(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 8) non-negative values -> their 6-bit codes against the fp16 step max / 63, and that step."""
    top = values.amax(dim=1).clamp(min=0.0)
    inverse = torch.where(top > 0, 63.0 / torch.where(top > 0, top, torch.ones_like(top)), torch.zeros_like(top))
    codes = torch.round(values * inverse[:, None]).clamp_(0, 63).to(torch.uint8)
    return codes, (top / 63.0).to(torch.float16)


def _q4_k_blocks(x: torch.Tensor) -> torch.Tensor:
    """(n, 256) float32 -> (n, 144) uint8 block_q4_K."""
    n = x.shape[0]
    sub = x.reshape(n * 8, SUB)
    scales, mins = _sub_block_fits(sub)
    ls, d = _six_bit(scales.reshape(n, 8))
    lm, dmin = _six_bit(mins.reshape(n, 8))
    step = d.to(torch.float32)[:, None] * ls.to(torch.float32)  # (n, 8), as the decoder forms them
    offset = dmin.to(torch.float32)[:, None] * lm.to(torch.float32)
    live = step != 0
    divisor = torch.where(live, step, torch.ones_like(step))[..., None]
    q = torch.round((x.reshape(n, 8, SUB) + offset[..., None]) / divisor)
    q = torch.where(live[..., None], q.clamp_(0, _NMAX), torch.zeros_like(q)).to(torch.uint8)  # (n, 8, 32)

    out = torch.empty((n, Q4_K_BYTES), dtype=torch.uint8)
    out[:, 0:2] = d.reshape(n, 1).view(torch.uint8)
    out[:, 2:4] = dmin.reshape(n, 1).view(torch.uint8)
    # scales: bytes 0-3 the low 6 bits of scales 0-3 (their top 2 bits: the high bits of scales 4-7), bytes 4-7 the
    # same for the mins, bytes 8-11 the low nibbles of scales 4-7 (low) and mins 4-7 (high)
    out[:, 4:8] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 8:12] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 12:16] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    # nibbles: each 32-byte run holds two sub-blocks, the first in the low nibbles, the second in the high ones
    pairs = q.reshape(n, 4, 2, SUB)
    out[:, 16:] = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128)
    return out


# ---- Q6_K ----------------------------------------------------------------------------------------------------

Q6_K_BYTES = 210
_Q6_NMAX = 32  # 6-bit codes -32..31
_Q6_STEPS = (0,) + tuple(k for k in range(-9, 10) if k)  # llama.cpp's make_qx_quants: the plain grid, then +-0.1 steps
_GROUP_MAX_EPS = 1e-15  # llama.cpp's: a sub-block (or super-block) below this is all zero


def quantize_q6_k(tensor: torch.Tensor) -> torch.Tensor:
    """The Q6_K blocks of `tensor` (last dimension a multiple of 256): uint8, 210 bytes per 256 values, as GGUF
    stores them. llama.cpp's reference recipe without an importance matrix (`quantize_row_q6_K_ref`): 16 sub-blocks of
    16 with a symmetric 6-bit grid whose step is searched (make_qx_quants, weights x^2), int8 sub-block scales against
    an fp16 super-block `d`."""
    return _quantise_rows(tensor, "Q6_K", Q6_K_BYTES, _q6_k_blocks)


def _signed_extreme(values: torch.Tensor) -> torch.Tensor:
    """Per row of `values`, the entry of largest magnitude (the first of equals), with its sign."""
    return values.gather(1, values.abs().argmax(dim=1, keepdim=True))[:, 0]


def _q6_sub_block_scales(x: torch.Tensor) -> torch.Tensor:
    """make_qx_quants(16, 32, x, rmse_type=1) on every sub-block `x` (n, 16): the signed scale it keeps."""
    extreme = _signed_extreme(x)
    live = extreme.abs() >= _GROUP_MAX_EPS
    safe = torch.where(live, extreme, torch.ones_like(extreme))
    steps = torch.tensor([-(_Q6_NMAX + 0.1 * k) for k in _Q6_STEPS], dtype=x.dtype)
    q = torch.round_(x[:, None, :] * (steps[None, :] / safe[:, None])[:, :, None]).clamp_(-_Q6_NMAX, _Q6_NMAX - 1)
    weights = x * x
    sum_lx = torch.bmm(q, (weights * x)[:, :, None])[..., 0]  # (n, 19)
    sum_l2 = torch.bmm(q.mul_(q), weights[:, :, None])[..., 0]
    positive = sum_l2 > 0
    safe_l2 = torch.where(positive, sum_l2, torch.ones_like(sum_l2))
    # the plain grid is kept unless a step is strictly better (sum_lx^2 / sum_l2, the error's reduction)
    merit = torch.where(positive, sum_lx * sum_lx / safe_l2, torch.zeros_like(sum_lx))
    pick = merit.argmax(dim=1, keepdim=True)
    scale = (sum_lx / safe_l2).gather(1, pick)[:, 0]
    scale = torch.where(positive.gather(1, pick)[:, 0], scale, torch.zeros_like(scale))
    return torch.where(live, scale, torch.zeros_like(scale))


def _q6_k_blocks(x: torch.Tensor) -> torch.Tensor:
    """(n, 256) float32 -> (n, 210) uint8 block_q6_K."""
    n = x.shape[0]
    scales = _q6_sub_block_scales(x.reshape(n * 16, 16)).reshape(n, 16)
    top = _signed_extreme(scales)
    live = top.abs() >= _GROUP_MAX_EPS
    inverse = -128.0 / torch.where(live, top, torch.ones_like(top))
    d = torch.where(live, 1 / inverse, torch.zeros_like(inverse)).to(torch.float16)
    codes = torch.round(scales * inverse[:, None]).clamp_(max=127)
    codes = torch.where(live[:, None], codes, torch.zeros_like(codes)).to(torch.int8)
    step = d.to(torch.float32)[:, None] * codes.to(torch.float32)  # (n, 16), as the decoder forms them
    nonzero = step != 0
    q = torch.round(x.reshape(n, 16, 16) / torch.where(nonzero, step, torch.ones_like(step))[..., None])
    q = torch.where(nonzero[..., None], q.clamp_(-32, 31), torch.zeros_like(q))
    q = (q + 32).to(torch.uint8).reshape(n, 2, 4, 32)  # halves of 128, quarters of 32

    out = torch.zeros((n, Q6_K_BYTES), dtype=torch.uint8)
    # low nibbles: per half, quarters 0 | 2 << 4, then quarters 1 | 3 << 4; high 2 bits: quarters 0-3 in one byte
    low = torch.cat([(q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4),
                     (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)], dim=2)
    high = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    out[:, :128] = low.reshape(n, 128)
    out[:, 128:192] = high.reshape(n, 64)
    out[:, 192:208] = codes.view(torch.uint8)
    out[:, 208:210] = d.reshape(n, 1).view(torch.uint8)
    return out
