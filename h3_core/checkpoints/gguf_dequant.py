"""GGUF dequantisation in torch, on whatever device the raw blocks are.

gguf's own `dequantize` is NumPy: on an accelerator every block would go device -> host -> device at every load.
These functions read the same block layouts (ggml's, as the `gguf` package documents them) with torch ops only,
and compute in float32 with the same operations in the same order as gguf 0.19's NumPy code, so the values are
bit for bit gguf's (tests/test_gguf_dequant.py checks every type against it). The input is the raw bytes as
`GGUFFile.tensor` gives them: uint8, one row of blocks per logical row; the output is float32, each row's bytes
replaced by its values.

Types without a torch decoder here (`torch_decodes(t)` is False: the grid-based IQ1 / IQ2 / IQ3 types) are decoded
by gguf's NumPy code on the host (`quantised._gguf_dequantise`).
"""

from __future__ import annotations

from typing import Callable

import torch

QK_K = 256  # the K-quants' super-block

# ggml type numbers (gguf.GGMLQuantizationType): fixed by the file format.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
IQ4_NL, IQ4_XS, BF16, TQ1_0, TQ2_0, MXFP4, NVFP4 = 20, 23, 30, 34, 35, 39, 40

# (values per block, bytes per block)
BLOCK = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22),
         Q5_1: (32, 24), Q8_0: (32, 34), Q2_K: (QK_K, 84), Q3_K: (QK_K, 110), Q4_K: (QK_K, 144),
         Q5_K: (QK_K, 176), Q6_K: (QK_K, 210), IQ4_NL: (32, 18), IQ4_XS: (QK_K, 136), TQ1_0: (QK_K, 54),
         TQ2_0: (QK_K, 66), MXFP4: (32, 17), NVFP4: (64, 36)}

_E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # MXFP4 / NVFP4 codes, x2
_IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def torch_decodes(qtype: int) -> bool:
    """Whether ggml type `qtype` has a torch decoder here."""
    return int(qtype) in _DECODERS


def dequantize(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """The float32 values of `raw` (uint8 ggml blocks, rows of whole blocks) of ggml type `qtype`, computed on
    `raw`'s device. Shape: `raw`'s with its last dimension counted in values instead of bytes."""
    qtype = int(qtype)
    values, size = BLOCK[qtype]
    if raw.dtype != torch.uint8 or raw.dim() == 0 or raw.shape[-1] % size:
        raise ValueError(f"ggml type {qtype}: expected uint8 rows of {size}-byte blocks, got {raw.dtype} "
                         f"{tuple(raw.shape)}")
    shape = (*raw.shape[:-1], raw.shape[-1] // size * values)
    blocks = raw.contiguous().reshape(-1, size)
    return _DECODERS[qtype](blocks).reshape(shape)


# --- pieces of the layouts -------------------------------------------------------------------------------------

def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian float16 at byte `at` of each block, as float32, shape (n, 1)."""
    if at % 2 == 0 and b.stride(-1) == 1 and b.shape[-1] % 2 == 0 and b.stride(0) % 2 == 0 \
            and b.storage_offset() % 2 == 0:  # every block size is even: a column view
        return b.view(torch.float16)[:, at // 2:at // 2 + 1].to(torch.float32)
    return b[:, at:at + 2].contiguous().view(torch.float16).to(torch.float32)


def _u16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian uint16 at byte `at` of each block, as int32, shape (n, 1)."""
    pair = b[:, at:at + 2].to(torch.int32)
    return pair[:, :1] | (pair[:, 1:] << 8)


def _u32(b: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian 32-bit word at byte `at` of each block, as int32 (bit 31 is the sign), shape (n, 1)."""
    return b[:, at:at + 4].contiguous().view(torch.int32)


def _fields(x: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """The `bits`-wide fields of `x` (n, m): each run of `group` bytes yields, for each field position in the byte
    (lowest first), `group` fields (ggml packs a sub-block's values across a run of bytes, one bit plane per
    position). The shifts are made on the device, so no constant is copied to it per block."""
    n = x.shape[0]
    shifts = torch.arange(0, 8, bits, dtype=x.dtype, device=x.device).reshape(1, 1, -1, 1)
    return ((x.reshape(n, -1, 1, group) >> shifts) & ((1 << bits) - 1)).reshape(n, -1)


def _nibbles(x: torch.Tensor, group: int) -> torch.Tensor:
    return _fields(x, group, 4)


_TABLES: dict[tuple, torch.Tensor] = {}


def _table(values, device: torch.device) -> torch.Tensor:
    """`values` as a float32 tensor on `device`, copied there once per process (not at every block)."""
    key = (values, str(device))
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(values, dtype=torch.float32).to(device)
    return _TABLES[key]


def _lookup(values, index: torch.Tensor) -> torch.Tensor:
    return _table(values, index.device)[index.long()]


def _bits32(word: torch.Tensor) -> torch.Tensor:
    """The 32 bits of each (n, 1) int32 word, bit 0 first, shape (n, 32) (an arithmetic shift keeps bit k)."""
    return (word >> torch.arange(32, dtype=torch.int32, device=word.device)) & 1


# --- the types ---------------------------------------------------------------------------------------------------

def _f32(b):
    return b.view(torch.float32)


def _f16_plain(b):
    return b.view(torch.float16).to(torch.float32)


def _bf16(b):
    return (b.view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _q4_0(b):
    return _f16(b, 0) * (_nibbles(b[:, 2:], 16).to(torch.int32) - 8).to(torch.float32)


def _q4_1(b):
    return _f16(b, 0) * _nibbles(b[:, 4:], 16).to(torch.float32) + _f16(b, 2)


def _q5(b, at: int) -> torch.Tensor:
    """Q5_0 / Q5_1 codes: 4 low bits from the nibbles after the 32-bit high-bit word at `at`."""
    high = _bits32(_u32(b, at))
    return _nibbles(b[:, at + 4:], 16).to(torch.int32) | (high << 4)


def _q5_0(b):
    return _f16(b, 0) * (_q5(b, 2) - 16).to(torch.float32)


def _q5_1(b):
    return _f16(b, 0) * _q5(b, 4).to(torch.float32) + _f16(b, 2)


def _q8_0(b):
    return b[:, 2:].view(torch.int8).to(torch.float32).mul_(_f16(b, 0))


def _q2_k(b):
    n = b.shape[0]
    scales = b[:, :16]
    dl = (_f16(b, 80) * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = _fields(b[:, 16:80], 32, 2).reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b):
    n = b.shape[0]
    low = _fields(b[:, 96:104], 8, 4)
    high = _fields(b[:, 104:108], 4, 2)
    scales = ((low | (high << 4)).to(torch.int32) - 32).to(torch.float32)
    dl = (_f16(b, 108) * scales).reshape(n, 16, 1)
    ql = _fields(b[:, 32:96], 32, 2).reshape(n, 16, 16).to(torch.int32)
    # the high bit subtracts 4 when it is clear
    qh = (_fields(b[:, :32], 32, 1).reshape(n, 16, 16) ^ 1).to(torch.int32)
    return (dl * (ql - (qh << 2)).to(torch.float32)).reshape(n, QK_K)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 12 scale bytes -> 8 six-bit scales and 8 six-bit mins per block."""
    # One copy first: byte ops on a few columns of the 144-byte-strided blocks ran about 20x slower than on these.
    s = s.contiguous()
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    low = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scale, low


def _k_affine(b, q: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: codes q (n, 8, 32) -> d * scale * q - dmin * min per sub-block (in place on the codes' float32
    copy: the same two roundings, one buffer instead of three)."""
    n = b.shape[0]
    scale, low = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * scale.to(torch.float32)).reshape(n, 8, 1)
    dm = (_f16(b, 2) * low.to(torch.float32)).reshape(n, 8, 1)
    return q.to(torch.float32).mul_(d).sub_(dm).reshape(n, QK_K)


def _q4_k(b):
    # Each 32-byte run holds a sub-block's codes in its low nibbles and the next sub-block's in its high ones.
    runs = b[:, 16:].contiguous().reshape(b.shape[0], 4, 1, 32)
    return _k_affine(b, torch.cat((runs & 0x0F, runs >> 4), dim=2).reshape(b.shape[0], 8, 32))


def _q5_k(b):
    n = b.shape[0]
    low = _nibbles(b[:, 48:], 32).reshape(n, 8, 32)
    high = _fields(b[:, 16:48], 32, 1).reshape(n, 8, 32)
    return _k_affine(b, low | (high << 4))


def _q6_k(b):
    n = b.shape[0]
    d = (_f16(b, 208) * b[:, 192:208].view(torch.int8).to(torch.float32)).reshape(n, 16, 1)
    low = _nibbles(b[:, :128], 64)
    high = _fields(b[:, 128:192], 32, 2)
    q = ((low | (high << 4)).to(torch.int32) - 32).reshape(n, 16, 16).to(torch.float32)
    return (d * q).reshape(n, QK_K)


def _iq4_nl(b):
    return _f16(b, 0) * _lookup(_IQ4_VALUES, _nibbles(b[:, 2:], 16))


def _iq4_xs(b):
    n = b.shape[0]
    low = b[:, 4:8].to(torch.int32)
    low = torch.stack([low & 0x0F, low >> 4], dim=-1).reshape(n, 8)  # each byte: its low nibble, then its high one
    high = (_u16(b, 2) >> torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)) & 3
    dl = (_f16(b, 0) * ((low | (high << 4)) - 32).to(torch.float32)).reshape(n, 8, 1)
    q = _lookup(_IQ4_VALUES, _nibbles(b[:, 8:], 16)).reshape(n, 8, 32)
    return (dl * q).reshape(n, QK_K)


def _tq1_0(b):
    # base-3 digits: byte * 3**k (mod 256) leaves digit k in the top bits; (x * 3) >> 8 reads it.
    n = b.shape[0]

    def digits(x, group, count):
        powers = (3 ** torch.arange(count, dtype=torch.int32, device=b.device)).reshape(1, 1, -1, 1)
        return ((x.to(torch.int32).reshape(n, -1, 1, group) * powers) & 0xFF).reshape(n, -1)

    q = torch.cat([digits(b[:, :32], 32, 5), digits(b[:, 32:48], 16, 5), digits(b[:, 48:52], 4, 4)], dim=-1)
    return _f16(b, 52) * (((q * 3) >> 8) - 1).to(torch.float32)


def _tq2_0(b):
    return _f16(b, 64) * (_fields(b[:, :64], 32, 2).to(torch.int32) - 1).to(torch.float32)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """MXFP4's shared exponent byte as the float32 2**(e - 128) (half the scale: the codes are doubled)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e.clamp(max=1), (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(b):
    return _e8m0_half(b[:, :1]) * _lookup(_E2M1_DOUBLED, _nibbles(b[:, 1:], 16))


def _ue4m3_half() -> tuple[float, ...]:
    """NVFP4's unsigned E4M3 scale bytes (the top bit ignored) as numbers, halved (the codes are doubled); 0 and
    0x7F read as 0. Every one is exact in float32."""
    def value(x: int) -> float:
        exp, man = (x >> 3) & 0x0F, x & 7
        if x in (0, 0x7F):
            return 0.0
        return (man * 2.0 ** -9 if exp == 0 else (1.0 + man / 8.0) * 2.0 ** (exp - 7)) * 0.5
    return tuple(value(x) for x in range(256))


_UE4M3_HALF = _ue4m3_half()


def _nvfp4(b):
    n = b.shape[0]
    d = _lookup(_UE4M3_HALF, b[:, :4]).reshape(n, 4, 1)
    qs = b[:, 4:].reshape(n, 4, 8)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # each 8-byte group: its low nibbles, then its high ones
    return (d * _lookup(_E2M1_DOUBLED, codes)).reshape(n, 64)


_DECODERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    F32: _f32, F16: _f16_plain, BF16: _bf16, Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q8_0: _q8_0,
    Q2_K: _q2_k, Q3_K: _q3_k, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k, IQ4_NL: _iq4_nl, IQ4_XS: _iq4_xs,
    TQ1_0: _tq1_0, TQ2_0: _tq2_0, MXFP4: _mxfp4, NVFP4: _nvfp4,
}
