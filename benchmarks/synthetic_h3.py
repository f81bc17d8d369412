"""Synthetic H3 checkpoints at the released sizes, written at disk speed without holding a component in memory.

    python benchmarks/synthetic_h3.py dit --blocks 24 --out /tmp/h3-synth      # 24 released blocks (~33 GB)
    python benchmarks/synthetic_h3.py all --blocks 50 --layers 64 --out /tmp/h3-synth
    python benchmarks/synthetic_h3.py dit --blocks 50 --plan                  # the plan's size, nothing written

Each component is written in a layout its h3_core loader reads, with the released shapes and dtypes:

* `write_dit`: the native release folder (`config.json` `MiniMaxH3DiTModel`, `model-000NN-of-000MM.safetensors`
  shards of at most 5 GiB + `model.safetensors.index.json`); bf16 with the fp32 islands of `h3-model.md` §7.1
  (patch projections, time MLP, output heads, `rope.inv_freq`). 50 blocks are the released 535 tensors,
  66,280,430,144 bytes.
* `write_text_encoder`: the official Qwen3-VL folder (`config.json`, `model*.safetensors` + index,
  `model.language_model.*`, `model.visual.*`, `lm_head.weight`; bf16) at Qwen3-VL-32B widths, with the tiny
  default's tokenizer (the real vocabulary ids of the specials) and the released image-processor settings.
* `write_video_vae` / `write_audio_vae`: the ComfyUI single files (`minimax_h3_video_vae_fp16.safetensors`,
  `minimax_h3_audio_vae_fp32.safetensors`; native names, weight norm folded) at the released widths.

Each writer computes the safetensors header from the shapes, writes it, then each tensor's bytes in pieces of at
most `chunk_bytes` (64 MiB): the values of a tensor are a window of one seeded pool of normal values (`POOL_ELEMENTS`,
odd, so rows never line up with it), started at an offset drawn from the tensor's name and scaled by 0.5 / sqrt(fan_in)
(norm weights 1, biases 0, exact values where the model needs them: `rope.inv_freq`, the audio resampling filters).
The values depend only on the seed and the tensor's name, not on the piece size. The memory held is the pool (4M
values), a few scaled copies of it and two pieces, whatever the checkpoint's size; large tensors are copied from a
scaled copy with no arithmetic, so the speed is the disk's. The QKV / SwiGLU row permutations of the released
layouts are immaterial for such values: the files have the released names, shapes and dtypes.

`write_dit_gguf` / `write_text_encoder_gguf` write the quantised layouts small machines run (the DiT as one Q8_0
`.gguf` as `h3_core quantize` writes it; Qwen3-VL as a published llama.cpp `qwen3vl` Q4_K file + Q8_0 mmproj) by
gguf's own writer, each tensor a window of a pool of valid blocks scaled per tensor (`QuantisedBlocks`).

`values=False` writes the headers only (the data stays a hole of the right length: sparse files, no disk used), for
checking a released-size plan against the loaders. `plan_*` return `[(name, shape, dtype)]` without writing anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import stat
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from h3_core.models.audio_vae import PUBLISHED_LATENTS_MEAN as AUDIO_MEAN  # noqa: E402
from h3_core.models.audio_vae import PUBLISHED_LATENTS_STD as AUDIO_STD
from h3_core.models.audio_vae import RESAMPLE_RATIO, RESAMPLE_TAPS, AudioVAE, AudioVAEConfig, resampling_filter
from h3_core.models.dit import H3DiT, RotaryEmbedding3D  # noqa: E402
from h3_core.models.dit_config import H3DiTConfig  # noqa: E402
from h3_core.models.text_encoder import TextEncoder, TextEncoderConfig  # noqa: E402
from h3_core.models.video_vae import PUBLISHED_LATENTS_MEAN as VIDEO_MEAN  # noqa: E402
from h3_core.models.video_vae import PUBLISHED_LATENTS_STD as VIDEO_STD
from h3_core.models.video_vae import VideoVAE, VideoVAEConfig

CHUNK_BYTES = 64 << 20  # the most one write (and the one temporary it needs) covers
POOL_ELEMENTS = (1 << 22) + 9  # the normal values every tensor is a window of (odd: never a multiple of a row width)
CACHED_POOLS = 6  # scaled copies of the pool kept for the large tensors (a DiT block has 4 distinct scales)
SHARD_BYTES = 5 << 30  # the native DiT release: 13 shards for 66.3 GB
# The released DiT's float32 tensors (`h3-model.md` §7.1); everything else is bf16.
DIT_FP32 = ("video_patch_proj.", "audio_patch_proj.", "time_embedder.", "final_layer.video_out.",
            "final_layer.audio_out.", "rope.inv_freq")
VIDEO_VAE_FILE = "minimax_h3_video_vae_fp16.safetensors"
AUDIO_VAE_FILE = "minimax_h3_audio_vae_fp32.safetensors"
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


# ---- tensor plans ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor and how its values are made: `fill` "normal" (std `scale`), "constant" (`scale` everywhere)
    or "exact" (`value()`, a small tensor)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: str = "normal"
    scale: float = 0.0
    value: Callable[[], torch.Tensor] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def entry(self) -> tuple[str, tuple[int, ...], torch.dtype]:
        return self.name, self.shape, self.dtype


def _spec(name: str, shape, dtype: torch.dtype) -> TensorSpec:
    """Values that keep activations in range: 1 for norm weights, 0 for other vectors (biases, log-scale Snake
    parameters), N(0, (0.5 / sqrt(fan_in))^2) for matrices and kernels."""
    shape = tuple(int(s) for s in shape)
    owner, _, leaf = name.rpartition(".")
    if len(shape) == 1:
        return TensorSpec(name, shape, dtype, "constant", 1.0 if "norm" in owner and leaf == "weight" else 0.0)
    return TensorSpec(name, shape, dtype, "normal", 0.5 / math.prod(shape[1:]) ** 0.5)


def entries(specs: Iterable[TensorSpec]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [s.entry() for s in specs]


def dit_config(blocks: int, refiner_blocks: int = 2, overrides: Mapping | None = None) -> H3DiTConfig:
    """The released DiT widths (`H3DiTConfig` defaults) with `blocks` blocks, changed by `overrides`."""
    return H3DiTConfig(**{"num_layers": blocks, "num_refiner_layers": refiner_blocks, **(overrides or {})})


def dit_specs(config: H3DiTConfig) -> list[TensorSpec]:
    """The native release's tensors (their names are the model's), bf16 but for the fp32 islands."""
    with torch.device("meta"):
        model = H3DiT(config)
    specs = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        dtype = torch.float32 if name.startswith(DIT_FP32) else torch.bfloat16
        if name == "rope.inv_freq":
            c = config
            specs.append(TensorSpec(name, tuple(tensor.shape), dtype, "exact",
                                    value=lambda: RotaryEmbedding3D.frequencies(c.rope_freq_dim, c.rope_theta)))
        else:
            specs.append(_spec(name, tensor.shape, dtype))
    return specs


def plan_dit(config: H3DiTConfig) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return entries(dit_specs(config))


QWEN3_VL_32B = {  # Qwen3-VL-32B-Instruct's config.json (the fields a loader reads, and the bookkeeping ones)
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "qwen3_vl_text", "vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 25600,
        "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False, "max_position_embeddings": 262144,
        "rope_theta": 5000000, "bos_token_id": 151643, "eos_token_id": 151645,
        "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
    },
    "vision_config": {
        "model_type": "qwen3_vl", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
        "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
        "out_hidden_size": 5120, "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
        "hidden_act": "gelu_pytorch_tanh",
    },
}
PREPROCESSOR_CONFIG = {  # Qwen3-VL's preprocessor_config.json
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}


def text_encoder_raw_config(layers: int, vision_layers: int = 27, overrides: Mapping | None = None) -> dict:
    """Qwen3-VL-32B's config.json with `layers` decoder layers and `vision_layers` vision blocks (0: no vision
    tower); `overrides` {"text_config": {...}, "vision_config": {...}, other top-level keys} update it."""
    raw = json.loads(json.dumps(QWEN3_VL_32B))
    raw["text_config"]["num_hidden_layers"] = layers
    vision = raw["vision_config"]
    vision["depth"] = vision_layers
    vision["deepstack_visual_indexes"] = [i for i in (8, 16, 24) if i < vision_layers] or [vision_layers - 1]
    for key, value in (overrides or {}).items():
        if key in ("text_config", "vision_config") and isinstance(value, Mapping):
            raw[key].update(value)
        else:
            raw[key] = value
    if vision_layers < 1:
        del raw["vision_config"]
    return raw


def text_encoder_specs(raw: Mapping, *, lm_head: bool = True) -> list[TensorSpec]:
    """The official Qwen3-VL folder's tensors (bf16): every decoder layer the config names, the final norm and, with
    `lm_head`, the output head (H3 never reads those two)."""
    config = TextEncoderConfig.from_hf_dict(raw)
    language = config.language
    with torch.device("meta"):
        model = TextEncoder(config, language.num_hidden_layers)
    prefixes = {"language_model": "model.language_model.", "vision_tower": "model.visual."}
    specs = []
    for name, tensor in model.named_parameters():
        ours, _, rest = name.partition(".")
        specs.append(_spec(prefixes[ours] + rest, tensor.shape, torch.bfloat16))
    specs.append(_spec("model.language_model.norm.weight", (language.hidden_size,), torch.bfloat16))
    if lm_head:
        specs.append(_spec("lm_head.weight", (language.vocab_size, language.hidden_size), torch.bfloat16))
    return specs


def plan_text_encoder(raw: Mapping, *, lm_head: bool = True) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return entries(text_encoder_specs(raw, lm_head=lm_head))


def _stats_specs(config, published: tuple) -> list[TensorSpec]:
    """`latents_mean` / `latents_std` buffers, only when they differ from the published constants the loaders use
    for a file without them."""
    if (tuple(config.latents_mean), tuple(config.latents_std)) == tuple(tuple(p) for p in published):
        return []
    return [TensorSpec(key, (len(values),), torch.float32, "exact", value=lambda v=values: torch.tensor(v))
            for key, values in (("latents_mean", config.latents_mean), ("latents_std", config.latents_std))]


def video_vae_specs(config: VideoVAEConfig, dtype: torch.dtype = torch.float16) -> list[TensorSpec]:
    """The ComfyUI video VAE file: native names, fp16."""
    with torch.device("meta"):
        model = VideoVAE(config)
    specs = []
    for name, tensor in model.state_dict().items():
        if name.endswith((".scale1", ".scale2")):  # the decoder blocks' residual scales
            specs.append(TensorSpec(name, tuple(tensor.shape), dtype, "constant", 0.5))
        else:
            specs.append(_spec(name, tensor.shape, dtype))
    return specs + _stats_specs(config, (VIDEO_MEAN, VIDEO_STD))


def plan_video_vae(config: VideoVAEConfig) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return entries(video_vae_specs(config))


def audio_vae_specs(config: AudioVAEConfig) -> list[TensorSpec]:
    """The ComfyUI audio VAE file: native names, weight norm folded, fp32, the resampling filters exact."""
    with torch.device("meta"):
        model = AudioVAE(config)
    specs = []
    for name, tensor in model.state_dict().items():
        shape = tuple(tensor.shape)
        if name.endswith(".filter"):  # every resampler of the decoder: x2, 12 Kaiser-sinc taps
            specs.append(TensorSpec(name, shape, torch.float32, "exact",
                                    value=lambda: resampling_filter(RESAMPLE_RATIO, RESAMPLE_TAPS).cpu()))
        elif name.endswith(".alpha") and len(shape) == 3:  # encoder Snake alpha (linear scale): 1
            specs.append(TensorSpec(name, shape, torch.float32, "constant", 1.0))
        else:
            specs.append(_spec(name, shape, torch.float32))
    return specs + _stats_specs(config, (AUDIO_MEAN, AUDIO_STD))


def plan_audio_vae(config: AudioVAEConfig) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return entries(audio_vae_specs(config))


# ---- streaming safetensors writer ----------------------------------------------------------------------------------


class ValueSource:
    """The values of every tensor: element i of tensor `name` is `dtype(normal[(offset(name) + i) % POOL_ELEMENTS] *
    scale)`, `normal` one seeded pool of float32 normal values.

    Large tensors are written straight from a copy of the pool already scaled and cast (the last `CACHED_POOLS`
    (dtype, scale) pairs are kept), so writing them costs no arithmetic; smaller ones are computed piece by piece.
    Held: the pool, those copies and two work pieces of at most `chunk_bytes` each, whatever the checkpoint's size.
    """

    def __init__(self, seed: int, chunk_bytes: int):
        if chunk_bytes < 8:
            raise ValueError(f"chunk_bytes must be at least 8, got {chunk_bytes}.")
        self.seed = int(seed)
        self.chunk_bytes = int(chunk_bytes)
        self._normal: torch.Tensor | None = None
        self._scaled: OrderedDict[tuple[torch.dtype, float], torch.Tensor] = OrderedDict()
        self._work: dict[torch.dtype, torch.Tensor] = {}

    @property
    def normal(self) -> torch.Tensor:
        if self._normal is None:
            self._normal = torch.randn(POOL_ELEMENTS, generator=torch.Generator().manual_seed(self.seed))
        return self._normal

    def work(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._work:
            self._work[dtype] = torch.empty(min(POOL_ELEMENTS, max(1, self.chunk_bytes // dtype.itemsize)),
                                            dtype=dtype)
        return self._work[dtype]

    def offset(self, name: str) -> int:
        digest = hashlib.blake2b(f"{self.seed}/{name}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % POOL_ELEMENTS

    def _fill(self, out: torch.Tensor, start: int, scale: float) -> torch.Tensor:
        """`out[:] = dtype(normal[start:start + len(out)] * scale)`, through float32 work pieces."""
        if out.dtype == torch.float32:
            return torch.mul(self.normal[start:start + out.numel()], scale, out=out)
        work = self.work(torch.float32)
        for a in range(0, out.numel(), work.numel()):
            n = min(work.numel(), out.numel() - a)
            out[a:a + n].copy_(torch.mul(self.normal[start + a:start + a + n], scale, out=work[:n]))
        return out

    def scaled_pool(self, dtype: torch.dtype, scale: float) -> torch.Tensor:
        key = (dtype, scale)
        if key in self._scaled:
            self._scaled.move_to_end(key)
        else:
            if len(self._scaled) >= CACHED_POOLS:
                self._scaled.popitem(last=False)
            self._scaled[key] = self._fill(torch.empty(POOL_ELEMENTS, dtype=dtype), 0, scale)
        return self._scaled[key]

    def pieces(self, spec: TensorSpec):
        """The tensor's bytes as buffers of at most `chunk_bytes` (each valid until the next one is produced)."""
        if spec.fill == "exact":
            value = spec.value().to(spec.dtype).contiguous()
            if tuple(value.shape) != spec.shape:
                raise ValueError(f"{spec.name}: exact value has shape {tuple(value.shape)}, expected {spec.shape}.")
            flat = value.reshape(-1).view(torch.uint8)
            for start in range(0, flat.numel(), self.chunk_bytes):
                yield memoryview(flat[start:start + self.chunk_bytes].numpy())
            return
        if spec.fill == "constant":
            filled = self.work(spec.dtype)
            filled = filled[:min(spec.numel, filled.numel())].fill_(spec.scale)
            remaining = spec.numel
            while remaining:
                n = min(remaining, filled.numel())
                yield memoryview(filled[:n].view(torch.uint8).numpy())
                remaining -= n
            return
        if spec.fill != "normal":
            raise ValueError(f"{spec.name}: unknown fill {spec.fill!r}.")
        large = spec.numel >= POOL_ELEMENTS // 2
        pool = self.scaled_pool(spec.dtype, spec.scale) if large else None
        work = self.work(spec.dtype)
        step = max(1, self.chunk_bytes // spec.dtype.itemsize)
        position, remaining = self.offset(spec.name), spec.numel
        while remaining:
            n = min(remaining, step, work.numel(), POOL_ELEMENTS - position)
            piece = pool[position:position + n] if large else self._fill(work[:n], position, spec.scale)
            yield memoryview(piece.view(torch.uint8).numpy())
            remaining -= n
            position = (position + n) % POOL_ELEMENTS


def _write_all(fd: int, buffer: memoryview) -> None:
    while len(buffer):
        buffer = buffer[os.write(fd, buffer):]


def safetensors_header(specs: list[TensorSpec], metadata: Mapping[str, str] | None = None) -> tuple[bytes, list]:
    """The header bytes (length prefix included, padded to 8) and the specs in their stored order: widest dtype first,
    so every tensor starts at a multiple of its element size."""
    ordered = sorted(specs, key=lambda s: -s.dtype.itemsize)
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for spec in ordered:
        if spec.name in header:
            raise ValueError(f"tensor {spec.name!r} appears twice.")
        header[spec.name] = {"dtype": _SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, ordered


def write_safetensors(path: str | os.PathLike, specs: list[TensorSpec], *, seed: int = 0,
                      chunk_bytes: int = CHUNK_BYTES, values: bool = True, sync: bool = True,
                      source: ValueSource | None = None) -> int:
    """Write `specs` to `path` as one safetensors file, streaming; returns the bytes written (the file size).

    `values=False` writes only the header and leaves the data a hole (a sparse file of the full size). `sync` waits
    for the data to reach the disk (regular files only). `path` may be a device such as /dev/null.
    """
    header, ordered = safetensors_header(specs)
    source = source or ValueSource(seed, chunk_bytes)
    total = len(header) + sum(s.nbytes for s in ordered)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        _write_all(fd, memoryview(header))
        if not values:
            if regular:
                os.ftruncate(fd, total)
            return total
        for spec in ordered:
            for piece in source.pieces(spec):
                _write_all(fd, piece)
        if sync and regular:
            os.fsync(fd)
    finally:
        os.close(fd)
    return total


def write_sharded(folder: Path, stem: str, specs: list[TensorSpec], *, shard_bytes: int = SHARD_BYTES,
                  seed: int = 0, chunk_bytes: int = CHUNK_BYTES, values: bool = True, sync: bool = True) -> list[Path]:
    """`<stem>.safetensors`, or `<stem>-000NN-of-000MM.safetensors` shards of at most `shard_bytes` of tensor data
    (a larger tensor alone) plus `<stem>.safetensors.index.json`, as Hugging Face writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    source = ValueSource(seed, chunk_bytes)
    if len(shards) == 1:
        names = [f"{stem}.safetensors"]
    else:
        names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        write_safetensors(folder / name, shard, values=values, sync=sync, source=source)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                 "weight_map": {s.name: name for name, shard in zip(names, shards) for s in shard}}
        (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return [folder / name for name in names]


# ---- the components ------------------------------------------------------------------------------------------------


def write_dit(folder: str | os.PathLike, blocks: int, *, refiner_blocks: int = 2, seed: int = 0,
              config_overrides: Mapping | None = None, shard_bytes: int = SHARD_BYTES,
              chunk_bytes: int = CHUNK_BYTES, values: bool = True, sync: bool = True) -> tuple[Path, H3DiTConfig]:
    """The DiT as a native release `transformer/` folder at `folder`; returns (folder, config), for
    `load_dit(folder)`. `config_overrides` are `H3DiTConfig` fields (reduced widths)."""
    folder = Path(folder)
    config = dit_config(blocks, refiner_blocks, config_overrides)
    write_sharded(folder, "model", dit_specs(config), shard_bytes=shard_bytes, seed=seed, chunk_bytes=chunk_bytes,
                  values=values, sync=sync)
    (folder / "config.json").write_text(json.dumps(config.to_native_dict(), indent=2))
    return folder, config


def write_text_encoder(folder: str | os.PathLike, layers: int, *, vision_layers: int = 27, seed: int = 0,
                       overrides: Mapping | None = None, lm_head: bool = True, shard_bytes: int = SHARD_BYTES,
                       chunk_bytes: int = CHUNK_BYTES, values: bool = True,
                       sync: bool = True) -> tuple[Path, TextEncoderConfig]:
    """The Qwen3-VL text encoder as an official `text_encoder/` folder at `folder` (config.json, shards + index,
    tokenizer.json, preprocessor_config.json); returns (folder, config) — `load_text_encoder(folder, layer=layers)`
    (H3 reads layer 50 of the 64)."""
    from h3_core.sources.tiny_default import write_tiny_tokenizer

    folder = Path(folder)
    raw = text_encoder_raw_config(layers, vision_layers, overrides)
    write_sharded(folder, "model", text_encoder_specs(raw, lm_head=lm_head), shard_bytes=shard_bytes, seed=seed,
                  chunk_bytes=chunk_bytes, values=values, sync=sync)
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    write_tiny_tokenizer(folder / "tokenizer.json")
    return folder, TextEncoderConfig.from_hf_dict(raw)


def write_video_vae(folder: str | os.PathLike, *, seed: int = 0, overrides: Mapping | None = None,
                    chunk_bytes: int = CHUNK_BYTES, values: bool = True,
                    sync: bool = True) -> tuple[Path, VideoVAEConfig]:
    """The ComfyUI video VAE file (fp16) in `folder`; returns (file, config) — `load_video_vae(file)`. `overrides`
    are `VideoVAEConfig` fields; a single file keeps the released levels, strides and 64-wide heads."""
    config = dataclasses.replace(VideoVAEConfig(), **(overrides or {}))
    path = Path(folder) / VIDEO_VAE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(path, video_vae_specs(config), seed=seed, chunk_bytes=chunk_bytes, values=values, sync=sync)
    return path, config


def write_audio_vae(folder: str | os.PathLike, *, seed: int = 0, overrides: Mapping | None = None,
                    chunk_bytes: int = CHUNK_BYTES, values: bool = True,
                    sync: bool = True) -> tuple[Path, AudioVAEConfig]:
    """The ComfyUI audio VAE file (fp32, weight norm folded) in `folder`; returns (file, config) —
    `load_audio_vae(file)`. `overrides` are `AudioVAEConfig` fields (widths; a single file keeps the released
    rates)."""
    config = dataclasses.replace(AudioVAEConfig(), **(overrides or {}))
    path = Path(folder) / AUDIO_VAE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(path, audio_vae_specs(config), seed=seed, chunk_bytes=chunk_bytes, values=values, sync=sync)
    return path, config


# ---- GGUF files: quantised blocks at disk speed ----------------------------------------------------------------------

GGUF_BLOCK_POOL = 1 << 22  # values of the pool the quantised blocks are made from (a whole number of 256-blocks)


class QuantisedBlocks:
    """A pool of ggml blocks of one type, made once from the seeded normal values, and copies of it with every block's
    scale fields multiplied by a tensor's scale: the blocks of `normal * scale` up to fp16 rounding, since Q8_0 and
    this Q4_K encoding are linear in their scales. A tensor's bytes are a window of such a copy, started at a block
    drawn from its name, so writing costs no quantisation.

    Q8_0 blocks come from gguf's own quantiser. gguf cannot quantise K-quants, so Q4_K blocks are a valid symmetric
    encoding written here: every sub-block's 6-bit scale and min 63 (the 12 scale bytes all 0xFF), d = amax / (63 *
    7.5), dmin = 7.5 d, so a value is 63 d (q - 7.5) with q = round(x / (63 d) + 7.5) in 0..15; the pool is checked
    against gguf's `dequantize` when it is made (the bytes are what gguf reads)."""

    def __init__(self, qtype, source: ValueSource):
        import gguf
        import numpy as np

        self.qtype = qtype
        self.block_values, self.block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        normal = source.normal[:GGUF_BLOCK_POOL].numpy().astype(np.float32)
        types = gguf.GGMLQuantizationType
        if qtype == types.Q8_0:
            raw = gguf.quants.quantize(normal.reshape(-1, 32), types.Q8_0).reshape(-1, 34)
            self.scale_fields = ((0, 2),)  # d
        elif qtype == types.Q4_K:
            raw = self._q4_k(normal)
            self.scale_fields = ((0, 2), (2, 4))  # d, dmin
        else:
            raise ValueError(f"no synthetic pool for {qtype!r}")
        decoded = gguf.quants.dequantize(raw.reshape(-1), qtype).reshape(-1)
        error = float(np.sqrt(np.mean((decoded - normal) ** 2)))
        if not error < 0.15:  # Q4_K with 16 levels over +-amax: about 0.1 of a unit normal
            raise AssertionError(f"synthetic {qtype.name} pool decodes with RMS error {error:.3f}")
        self.raw = raw
        self.blocks = raw.shape[0]
        self._scaled: OrderedDict[float, object] = OrderedDict()

    @staticmethod
    def _q4_k(values):
        import numpy as np

        x = values.reshape(-1, 256)
        amax = np.abs(x).max(axis=1, keepdims=True)
        d = (amax / (63 * 7.5)).astype(np.float16)
        step = 63 * d.astype(np.float32)
        q = np.clip(np.rint(x / np.where(step > 0, step, 1) + 7.5), 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)
        qs = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(-1, 128)
        out = np.empty((x.shape[0], 144), dtype=np.uint8)
        out[:, 0:2] = d.view(np.uint8)
        out[:, 2:4] = (d.astype(np.float32) * 7.5).astype(np.float16).view(np.uint8)
        out[:, 4:16] = 0xFF
        out[:, 16:] = qs
        return out

    def scaled(self, scale: float):
        import numpy as np

        if scale in self._scaled:
            self._scaled.move_to_end(scale)
            return self._scaled[scale]
        if len(self._scaled) >= CACHED_POOLS:
            self._scaled.popitem(last=False)
        copy = self.raw.copy()
        for a, b in self.scale_fields:
            field = np.ascontiguousarray(copy[:, a:b]).view(np.float16)
            copy[:, a:b] = (field.astype(np.float32) * scale).astype(np.float16).view(np.uint8)
        self._scaled[scale] = copy
        return copy

    def tensor_bytes(self, name: str, shape: tuple[int, ...], scale: float, source: ValueSource):
        """The stored bytes of a tensor of logical `shape` (rows of `shape[-1]` values), as [rows, bytes per row]."""
        import numpy as np

        count = math.prod(shape) // self.block_values
        pool = self.scaled(scale)
        start = source.offset(name) % self.blocks
        index = (start + np.arange(count)) % self.blocks
        return pool[index].reshape(math.prod(shape[:-1]), -1)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its name there, logical (torch-order) shape, ggml type and values (`spec`, whose
    dtype is ignored for quantised types)."""

    name: str
    shape: tuple[int, ...]
    qtype: object
    spec: TensorSpec


def gguf_quantisable(shape: tuple[int, ...], qtype) -> bool:
    import gguf

    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return len(shape) == 2 and shape[-1] % block == 0


def write_gguf(path: str | os.PathLike, arch: str, tensors: list[GGUFTensor], metadata=(), *, seed: int = 0,
               sync: bool = True, values: bool = True) -> int:
    """One GGUF file by gguf's own writer: the metadata (`[(key, value, GGUFValueType)]`), the tensor infos, then
    each tensor's data; returns the file size. Plain tensors are F32 / F16 / BF16 from `ValueSource`, quantised ones
    windows of `QuantisedBlocks`. Held: the pools and one tensor's bytes. `values=False` writes the header only and
    leaves the data a hole of its full length (a sparse file, for plans)."""
    import gguf
    import numpy as np

    types = gguf.GGMLQuantizationType
    source = ValueSource(seed, CHUNK_BYTES)
    pools: dict = {}
    plain = {types.F32: (torch.float32, np.float32), types.F16: (torch.float16, np.float16),
             types.BF16: (torch.bfloat16, np.uint16)}
    writer = gguf.GGUFWriter(str(path), arch)
    try:
        for key, value, value_type in metadata:
            if key == "general.architecture":
                continue
            if value_type == gguf.GGUFValueType.ARRAY:
                writer.add_array(key, value)
            else:
                writer.add_key_value(key, value, value_type)
        for t in tensors:
            if t.qtype in plain:
                nbytes = math.prod(t.shape) * plain[t.qtype][0].itemsize
                writer.add_tensor_info(t.name, t.shape, np.dtype(plain[t.qtype][1]), nbytes,
                                       raw_dtype=t.qtype if t.qtype == types.BF16 else None)
            else:
                block, size = gguf.GGML_QUANT_SIZES[t.qtype]
                rows = math.prod(t.shape[:-1])
                writer.add_tensor_info(t.name, (rows, t.shape[-1] // block * size), np.dtype(np.uint8),
                                       rows * t.shape[-1] // block * size, raw_dtype=t.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        if not values:
            alignment = writer.data_alignment
            pad = lambda n: -(-n // alignment) * alignment  # noqa: E731
            writer.fout[0].flush()
            total = pad(writer.fout[0].tell()) + sum(pad(info.nbytes) for info in writer.tensors[0].values())
            writer.close()
            os.truncate(path, total)
            return total
        for t in tensors:
            if t.qtype in plain:
                spec = dataclasses.replace(t.spec, dtype=plain[t.qtype][0], shape=t.shape)
                data = b"".join(bytes(piece) for piece in source.pieces(spec))
                array = np.frombuffer(data, dtype=plain[t.qtype][1]).reshape(t.shape)
            else:
                if t.qtype not in pools:
                    pools[t.qtype] = QuantisedBlocks(t.qtype, source)
                array = pools[t.qtype].tensor_bytes(t.name, t.shape, t.spec.scale, source)
            writer.write_tensor_data(array)
            del array
        writer.close()
        if sync:
            with open(path, "rb+") as handle:
                os.fsync(handle.fileno())
    finally:
        writer.close()
    return Path(path).stat().st_size


def write_dit_gguf(path: str | os.PathLike, blocks: int, *, refiner_blocks: int = 2, seed: int = 0,
                   config_overrides: Mapping | None = None, sync: bool = True,
                   values: bool = True) -> tuple[Path, H3DiTConfig]:
    """The DiT as one Q8_0 `.gguf` as `python -m h3_core quantize` writes it (ComfyUI-GGUF naming: the state-dict
    keys, arch `minimax_h3`): the 2-D matrices of the blocks and the refiner Q8_0, every other tensor as the release
    stores it (bf16, the fp32 islands)."""
    import gguf

    types = gguf.GGMLQuantizationType
    config = dit_config(blocks, refiner_blocks, config_overrides)
    tensors = []
    for spec in dit_specs(config):
        quantised = (spec.name.startswith(("blocks.", "token_refiner.blocks.")) and spec.name.endswith(".weight")
                     and gguf_quantisable(spec.shape, types.Q8_0))
        qtype = types.Q8_0 if quantised else (types.F32 if spec.dtype == torch.float32 else types.BF16)
        tensors.append(GGUFTensor(spec.name, spec.shape, qtype, spec))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(path, "minimax_h3", tensors, seed=seed, sync=sync, values=values)
    return path, config


def write_text_encoder_gguf(path: str | os.PathLike, mmproj: str | os.PathLike | None, layers: int, *,
                            vision_layers: int = 27, seed: int = 0, overrides: Mapping | None = None,
                            sync: bool = True, values: bool = True) -> tuple[Path, TextEncoderConfig]:
    """Qwen3-VL-32B in the published llama.cpp layout (`h3_core.checkpoints.text_encoder_gguf`): the language file
    at `path` (`qwen3vl`, decoder layers 0 .. `layers` - 1; matrices and the token embedding Q4_K, or Q8_0 / F16
    where a row does not fit 256-value blocks; norms F32) and, unless `mmproj` is None, the vision tower at `mmproj`
    (`clip`; matrices Q8_0 where a row fits 32-value blocks, else F16; the patch and position embeddings F16,
    never quantised, as llama.cpp keeps them), with H3's tokenizer.json beside them; returns (path, config)."""
    import gguf

    from h3_core.checkpoints.text_encoder_gguf import (MMPROJ_ARCH, MMPROJ_FILE, TEXT_ARCH, mmproj_metadata,
                                                       published_tensors, text_metadata)
    from h3_core.models.vision_tower import ImageProcessorConfig
    from h3_core.sources.tiny_default import write_tiny_tokenizer

    types = gguf.GGMLQuantizationType
    raw = text_encoder_raw_config(layers, vision_layers if mmproj is not None else 0, overrides)
    config = TextEncoderConfig.from_hf_dict(raw)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[GGUFTensor]] = {"text": [], MMPROJ_FILE: []}
    for t in published_tensors(config, layers):
        spec = _spec(t.sources[0], t.shape, torch.bfloat16)
        if len(t.shape) == 1:
            qtype = types.F32
        elif t.file == "text" and gguf_quantisable(t.shape, types.Q4_K):
            qtype = types.Q4_K
        elif t.name.startswith(("v.patch_embd", "v.position_embd")) or not gguf_quantisable(t.shape, types.Q8_0):
            qtype = types.F16
        else:
            qtype = types.Q8_0
        files[t.file].append(GGUFTensor(t.name, t.shape, qtype, dataclasses.replace(spec, name=t.name)))
    write_gguf(path, TEXT_ARCH, files["text"], text_metadata(config, layers), seed=seed, sync=sync, values=values)
    if mmproj is not None:
        write_gguf(Path(mmproj), MMPROJ_ARCH, files[MMPROJ_FILE], mmproj_metadata(config, ImageProcessorConfig()),
                   seed=seed, sync=sync, values=values)
    write_tiny_tokenizer(path.parent / "tokenizer.json")
    return path, config


# ---- command line --------------------------------------------------------------------------------------------------


def _component_specs(name: str, args) -> list[TensorSpec]:
    if name == "transformer":
        return dit_specs(dit_config(args.blocks, args.refiner_blocks))
    if name == "text_encoder":
        return text_encoder_specs(text_encoder_raw_config(args.layers, args.vision_layers))
    if name == "video_vae":
        return video_vae_specs(VideoVAEConfig())
    return audio_vae_specs(AudioVAEConfig())


def _write_component(name: str, out: Path, args) -> Path:
    common = dict(seed=args.seed, chunk_bytes=args.chunk_mib << 20, sync=not args.no_sync)
    if name == "transformer":
        return write_dit(out / name, args.blocks, refiner_blocks=args.refiner_blocks, **common)[0]
    if name == "text_encoder":
        return write_text_encoder(out / name, args.layers, vision_layers=args.vision_layers, **common)[0]
    if name == "video_vae":
        return write_video_vae(out / "vae", **common)[0]
    return write_audio_vae(out / "vae", **common)[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("component", choices=("dit", "text_encoder", "video_vae", "audio_vae", "all"))
    parser.add_argument("--out", type=Path, help="folder to write into (one sub-folder per component)")
    parser.add_argument("--blocks", type=int, default=50, help="DiT blocks (released: 50)")
    parser.add_argument("--refiner-blocks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=64, help="text-encoder decoder layers (released: 64)")
    parser.add_argument("--vision-layers", type=int, default=27)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk-mib", type=int, default=CHUNK_BYTES >> 20)
    parser.add_argument("--no-sync", action="store_true", help="do not fsync (time the page cache, not the disk)")
    parser.add_argument("--plan", action="store_true", help="print the plan's size; write nothing")
    parser.add_argument("--delete", action="store_true", help="delete what was written after measuring")
    args = parser.parse_args(argv)
    names = (["transformer", "text_encoder", "video_vae", "audio_vae"] if args.component == "all" else
             ["transformer" if args.component == "dit" else args.component])
    if args.plan:
        for name in names:
            specs = _component_specs(name, args)
            fp32 = sum(s.dtype == torch.float32 for s in specs)
            print(f"{name}: {len(specs)} tensors ({fp32} fp32), {sum(s.nbytes for s in specs):,} bytes")
        return
    if args.out is None:
        parser.error("--out is required unless --plan is given")
    torch.set_num_threads(1)  # memory-bound copies: more threads only contend (and spin) on a busy machine
    grand, grand_seconds = 0, 0.0
    try:
        for name in names:
            start = time.perf_counter()
            path = _write_component(name, args.out, args)
            seconds = time.perf_counter() - start
            files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
            written = sum(f.stat().st_size for f in files)
            grand, grand_seconds = grand + written, grand_seconds + seconds
            print(f"{name}: {written:,} bytes in {len(files)} file(s) -> {path}  {seconds:.1f} s  "
                  f"{written / seconds / 1e9:.2f} GB/s{'' if args.no_sync else ' (fsync included)'}")
        if len(names) > 1:
            print(f"total: {grand:,} bytes  {grand_seconds:.1f} s  {grand / grand_seconds / 1e9:.2f} GB/s")
    finally:
        if args.delete:
            for name in ("transformer", "text_encoder", "vae"):
                shutil.rmtree(args.out / name, ignore_errors=True)
            if args.out.is_dir() and not any(args.out.iterdir()):
                args.out.rmdir()


if __name__ == "__main__":
    main()
