"""The embedded tiny default: a random-weight H3 stack small enough to run on a laptop CPU in seconds.

It exists to check an install end to end (CLI, pipeline, ComfyUI nodes) without downloading 130 GB; its output is
noise. On first use it is generated deterministically (fixed seeds) into a cache folder in real file layouts — a
ComfyUI `models/` tree: `diffusion_models/`, `text_encoders/` (an official Qwen3-VL folder with its tokenizer), `vae/`
— and it is then loaded through the same loaders as real weights. `loras/` holds a tiny random "turbo" LoRA for its
transformer (original key names, rank 4, metadata recommending 8 sampling steps) for the LoRA surfaces' checks.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

from ..errors import H3Error
from ..models.dit_config import H3DiTConfig
from ..models.tokenizer import H3_EXTRA_FIRST_ID, H3_EXTRA_TOKENS

TINY_VERSION = "tiny-v2"  # v2: the audio decoder's output scaled into range (v1 clipped 85 % of its samples)
TEXT_ENCODER_LAYER = 2
TINY_AUDIO_OUTPUT_SCALE = 0.02

# Qwen's special tokens start at 151643; H3 adds 7 at 151669-151675. The tiny vocabulary keeps those ids.
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)
QWEN_FIRST_SPECIAL_ID = 151643
QWEN_VOCAB_SIZE = 151936
QWEN_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                      r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TOKENIZER_CORPUS = (
    "A red fox runs across a snowy field at dawn, its breath visible in the cold air.",
    "Picture 1: a quiet harbour with fishing boats. Picture 2: the same harbour at night.",
    "The singer whispers the lyrics while a piano plays softly in the background.",
    "Close-up of waves crashing on black volcanic rocks; seagulls cry overhead.",
    "Ein Hund läuft über die Wiese. Le chat dort sur le canapé. 日本語のテキストも少し。",
    "Numbers 0123456789 and punctuation: (brackets), [lists], {braces} & symbols!",
)

TINY_DIT = H3DiTConfig(
    num_layers=2, num_refiner_layers=1, hidden_size=64, num_attention_heads=2, attention_head_dim=32, ffn_dim=128,
    in_channels=24, audio_in_channels=32, text_dim=32, freq_dim=32, time_embed_hidden_dim=64, time_embed_dim=32,
    rope_freq_dim=4,
)


def write_tiny_tokenizer(path: Path, *, with_h3_tokens: bool = True) -> Path:
    """A Qwen-style byte-level BPE `tokenizer.json` (trained on a few sentences) with the special tokens at their
    real ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(list(TOKENIZER_CORPUS) * 4, trainer)
    data = json.loads(tokenizer.to_str())
    specials = {t: QWEN_FIRST_SPECIAL_ID + i for i, t in enumerate(QWEN_SPECIAL_TOKENS)}
    if with_h3_tokens:
        specials.update({t: H3_EXTRA_FIRST_ID + i for i, t in enumerate(H3_EXTRA_TOKENS)})
    # The BPE vocabulary stops near 600; listing the specials in it too pins them to their real ids.
    data["model"]["vocab"].update(specials)
    data["added_tokens"] = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}
        for t, i in specials.items()
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return path


def cache_root() -> Path:
    """`$H3_STREAM_CACHE`, else `$XDG_CACHE_HOME/h3-stream`, else `~/.cache/h3-stream`."""
    return _cache_root_and_setting()[0]


def _cache_root_and_setting() -> tuple[Path, str]:
    """The cache folder and the setting that chose it, as an error message names it."""
    if os.environ.get("H3_STREAM_CACHE"):
        return Path(os.environ["H3_STREAM_CACHE"]).expanduser(), "$H3_STREAM_CACHE"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "h3-stream", "$XDG_CACHE_HOME"
    return Path.home() / ".cache" / "h3-stream", "the default cache folder (~/.cache/h3-stream)"


def _cache_error(root: Path, setting: str, why: str) -> H3Error:
    fix = ("set H3_STREAM_CACHE to a folder you can write, or unset it" if setting.startswith("$")
           else "give a folder you can write")
    return H3Error(f"{setting} {str(root)!r}: {why}, so the tiny default model cannot be written there; {fix}.")


def _randomize(module: nn.Module, seed: int) -> None:
    """Seeded weights that keep activations in range: 1 +- 0.1 for norm scales, N(0, 1/fan_in) for the rest."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            leaf = name.rsplit(".", 1)[-1]
            if param.ndim == 1 and ("norm" in name or leaf in ("weight", "alpha", "beta", "scale")):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif param.ndim == 1:
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))
            else:
                fan_in = param[0].numel()
                param.copy_(torch.randn(param.shape, generator=generator) / fan_in ** 0.5)


def _save(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(path))


TINY_REF2VA_FILE = "diffusion_models/minimax_h3_tiny_ref2va_fp32.safetensors"


def _write_dit(root: Path) -> None:
    from ..models.dit import H3DiT

    model = H3DiT(TINY_DIT)
    _randomize(model, seed=1)
    # ComfyUI repack layout: native names, QKV already in logical order; config read from the shapes.
    _save(model.state_dict(), root / "diffusion_models" / "minimax_h3_tiny_fl2va_fp32.safetensors")
    _write_ref2va_dit(root)


def _write_ref2va_dit(root: Path) -> None:
    """The Ref2VA partition's transformer: the same architecture, its own weights (`--partition ref2va`)."""
    from ..models.dit import H3DiT

    model = H3DiT(TINY_DIT)
    _randomize(model, seed=3)
    _save(model.state_dict(), root / TINY_REF2VA_FILE)


def _text_encoder_configs():
    text = dict(vocab_size=QWEN_VOCAB_SIZE, hidden_size=TINY_DIT.text_dim, intermediate_size=64,
                num_hidden_layers=TEXT_ENCODER_LAYER, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                rms_norm_eps=1e-6, hidden_act="silu",
                rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [4, 2, 2],
                                 "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=16,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=TINY_DIT.text_dim,
                  num_position_embeddings=16, deepstack_visual_indexes=[0], hidden_act="gelu_pytorch_tanh")
    return {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
            "text_config": text, "vision_config": vision, "torch_dtype": "float32"}


def _write_text_encoder(root: Path) -> None:
    from ..models.text_encoder import TextEncoder, TextEncoderConfig

    raw = _text_encoder_configs()
    model = TextEncoder(TextEncoderConfig.from_hf_dict(raw), TEXT_ENCODER_LAYER)
    _randomize(model, seed=2)
    folder = root / "text_encoders" / "qwen3vl_tiny_minimax_h3"
    # The official Hugging Face Qwen3-VL layout: config.json plus model.safetensors with its key names.
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("language_model."):
            state["model.language_model." + name[len("language_model."):]] = tensor
        elif name.startswith("vision_tower."):
            state["model.visual." + name[len("vision_tower."):]] = tensor
    _save(state, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    write_tiny_tokenizer(folder / "tokenizer.json")


def _interleave_qkv(tensor: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    rest = tensor.shape[1:]
    return tensor.reshape(3, heads, head_dim, *rest).transpose(0, 1).reshape(tensor.shape)


def _write_vaes(root: Path) -> None:
    from ..models.audio_vae import AudioVAE, AudioVAEConfig
    from ..models.video_vae import VideoVAE, VideoVAEConfig

    g = torch.Generator().manual_seed(3)
    stats = lambda n: (tuple((0.1 * torch.randn(n, generator=g)).tolist()),  # noqa: E731
                       tuple((0.8 + 0.4 * torch.rand(n, generator=g)).tolist()))
    # The single-file layouts do not carry a config: widths come from the shapes, the rest (strides, rates, head
    # width 64, 32 norm groups) is the released model's, so the tiny VAEs keep those.
    video_mean, video_std = stats(24)
    video_config = VideoVAEConfig(block_out_channels=(32,) * 6, layers_per_block=1, decoder_num_layers=1,
                                  decoder_num_heads=1, decoder_head_dim=64, decoder_ffn_dim=96,
                                  latents_mean=video_mean, latents_std=video_std)
    video = VideoVAE(video_config)
    _randomize(video, seed=4)
    state = dict(video.state_dict())
    for name in list(state):
        if ".attn.to_qkv." in name:  # ComfyUI keeps the native per-head interleaved QKV rows
            state[name] = _interleave_qkv(state[name], video_config.decoder_num_heads, video_config.decoder_head_dim)
    state["latents_mean"] = torch.tensor(video_mean)
    state["latents_std"] = torch.tensor(video_std)
    _save(state, root / "vae" / "minimax_h3_video_vae_tiny_fp32.safetensors")

    audio_mean, audio_std = stats(32)
    audio_config = AudioVAEConfig(encoder_dim=4, latent_dim=64, decoder_dim=128, latents_mean=audio_mean,
                                  latents_std=audio_std)
    audio = AudioVAE(audio_config)
    _randomize(audio, seed=5)
    with torch.no_grad():
        # Random weights leave the decoder's last convolution at about 4 RMS, so most samples would sit on its +-1
        # clamp (what a saturated real decoder does, and what the audio health check refuses); scaled, its noise is
        # about -19 dBFS RMS like real program audio, its peaks near 0.8, off the clamp.
        audio.decoder.conv_post.weight.mul_(TINY_AUDIO_OUTPUT_SCALE)
    state = dict(audio.state_dict())
    state["latents_mean"] = torch.tensor(audio_mean)
    state["latents_std"] = torch.tensor(audio_std)
    _save(state, root / "vae" / "minimax_h3_audio_vae_tiny_fp32.safetensors")


TINY_LORA = "h3_tiny_turbo_lora.safetensors"
TINY_LORA_RANK = 4
TINY_LORA_STEPS = 8


def write_tiny_lora(path: Path) -> Path:
    """A deterministic random rank-4 LoRA of the tiny transformer's attention projections, in the original / ComfyUI
    key format (`blocks.N.attn.qkv_proj.lora_A.weight` / `lora_B`), its `__metadata__` recommending 8 sampling steps like a
    few-step "turbo" LoRA. Its output is noise, as the model's."""
    generator = torch.Generator().manual_seed(6)
    c = TINY_DIT
    inner = c.num_attention_heads * c.attention_head_dim
    state = {}
    for i in range(c.num_layers):
        for module, rows, cols in (("qkv_proj", 3 * inner, c.hidden_size), ("out_proj", c.hidden_size, inner)):
            # up @ down has entries of about 0.05 / sqrt(fan_in): a tenth of the random weights it changes.
            state[f"blocks.{i}.attn.{module}.lora_A.weight"] = (
                torch.randn(TINY_LORA_RANK, cols, generator=generator) / cols ** 0.5)
            state[f"blocks.{i}.attn.{module}.lora_B.weight"] = (
                0.05 * torch.randn(rows, TINY_LORA_RANK, generator=generator) / TINY_LORA_RANK ** 0.5)
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    # One metadata entry: safetensors writes several in hash order, and the file must be the same bytes every time.
    save_file(state, str(path), metadata={"h3_stream.steps": str(TINY_LORA_STEPS)})
    return path


def _model_index() -> str:
    # The canvas rules scaled down with the model (the released 768-px short edge, 768 x 1344 area and 2048-px
    # reference images, / 12 and / 16), so that references stay tiny as the generated video does.
    return json.dumps({
        "_minimax_h3": {"schema_version": 1, "partition": "fl2va", "tiny_random": True,
                        "text_encoder_layer": TEXT_ENCODER_LAYER, "canvas_short_edge": 64,
                        "canvas_max_pixels": 64 * 112, "reference_image_short_edge": 128}}, indent=2)


def _add_ref2va(target: Path, root: Path, setting: str) -> None:
    """Bring a cache written before the Ref2VA transformer existed up to date: the transformer, the index with the
    canvas rules, the manifest (each file written aside, then renamed into place)."""
    staged = target / f".ref2va.{os.getpid()}.partial"
    try:
        _write_ref2va_dit(staged)
        (staged / "model_index.json").write_text(_model_index())
        os.replace(staged / TINY_REF2VA_FILE, target / TINY_REF2VA_FILE)
        os.replace(staged / "model_index.json", target / "model_index.json")
        shutil.rmtree(staged, ignore_errors=True)
        (staged.parent / f".{MANIFEST}.{os.getpid()}.partial").write_text(json.dumps(_manifest(target), indent=2))
        os.replace(staged.parent / f".{MANIFEST}.{os.getpid()}.partial", target / MANIFEST)
    except OSError as exc:
        raise _cache_error(root, setting, f"cannot be written ({exc.strerror or exc})") from None
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def write_tiny_model(root: Path) -> Path:
    """Write the whole tiny stack into `root` (a ComfyUI-style models folder)."""
    root.mkdir(parents=True, exist_ok=True)
    _write_dit(root)
    _write_text_encoder(root)
    _write_vaes(root)
    write_tiny_lora(root / "loras" / TINY_LORA)
    (root / MANIFEST).write_text(json.dumps(_manifest(root), indent=2))
    (root / "model_index.json").write_text(_model_index())
    return root


MANIFEST = "tiny_manifest.json"


def _manifest(root: Path) -> dict[str, int]:
    """Every file of a tiny model folder and its size (written with the model; checked on every use)."""
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def _damage(target: Path) -> str | None:
    """What is wrong with a complete-looking cached tiny model (a file missing or of the wrong size), or None."""
    try:
        expected = json.loads((target / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"its {MANIFEST} is missing or unreadable (an earlier h3-stream wrote none)"
    for name, size in expected.items():
        try:
            actual = (target / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} is {actual} bytes, expected {size}"
    return None


def _remove_dead_staging(root: Path) -> None:
    """Staging folders of first uses that were killed (`.tiny-v1-PID-*` of a process that is gone), and of older
    versions without a process id once they are an hour old."""
    import time

    from ..staged_files import process_alive

    try:
        entries = [e for e in root.iterdir() if e.name.startswith(f".{TINY_VERSION}-") and e.is_dir()]
    except OSError:
        return
    for entry in entries:
        owner = entry.name[len(TINY_VERSION) + 2:].split("-", 1)[0]
        try:
            stale = not process_alive(int(owner)) if owner.isdigit() else time.time() - entry.stat().st_mtime > 3600
        except OSError:
            continue
        if stale:
            shutil.rmtree(entry, ignore_errors=True)


def ensure_tiny_model(cache_dir: str | os.PathLike | None = None, log=None) -> Path:
    """The tiny model's folder, generated on first use (written to a staging folder, then renamed into place so an
    interrupted run never leaves half a model behind; the next use removes a killed run's staging folder). A cached
    model whose files are missing or of the wrong size is regenerated, with a one-line note to `log`."""
    if cache_dir:
        root, setting = Path(cache_dir).expanduser(), "cache_dir"
    else:
        root, setting = _cache_root_and_setting()
    target = root / TINY_VERSION
    if root.exists() and not root.is_dir():
        raise _cache_error(root, setting, "is a file, not a folder")
    _remove_dead_staging(root)
    damaged = None
    if (target / "model_index.json").is_file():
        damaged = _damage(target)
        if damaged is None:
            ensure_tiny_lora(root)  # a cache written before the LoRA existed
            if not (target / TINY_REF2VA_FILE).is_file():  # ... or before the Ref2VA transformer existed
                _add_ref2va(target, root, setting)
            return target
        if log:
            log(f"note: the cached tiny model in {target} is damaged ({damaged}); regenerating it")
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{TINY_VERSION}-{os.getpid()}-", dir=root))
    except OSError as exc:
        raise _cache_error(root, setting, f"cannot be written ({exc.strerror or exc})") from None
    if log and damaged is None:
        log(f"generating the tiny default model into {target} (first use only)")
    try:
        write_tiny_model(staging)
        if damaged is not None:  # move the damaged copy aside (its name marks it for removal), then swap
            aside = root / f".{TINY_VERSION}-{os.getpid()}-damaged"
            os.replace(target, aside)
            shutil.rmtree(aside, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            if (target / "model_index.json").is_file():
                pass  # a concurrent writer finished first
            elif target.is_dir():  # only the LoRA was written ahead (ensure_tiny_lora): move the rest in, index last
                for entry in sorted(staging.iterdir(), key=lambda p: p.name == "model_index.json"):
                    if not (target / entry.name).exists():
                        entry.rename(target / entry.name)
            else:
                raise
    except OSError as exc:
        raise _cache_error(root, setting, f"cannot be written ({exc.strerror or exc})") from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def ensure_tiny_lora(cache_dir: str | os.PathLike | None = None) -> Path:
    """The tiny turbo LoRA (`<tiny model folder>/loras/h3_tiny_turbo_lora.safetensors`), written on first use without
    the model (a few KB, no tokenizer training), so that ComfyUI can list it when it starts."""
    root = Path(cache_dir).expanduser() if cache_dir else cache_root()
    path = root / TINY_VERSION / "loras" / TINY_LORA
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{TINY_LORA}.{os.getpid()}.tmp")
        try:
            write_tiny_lora(staging)
            os.replace(staging, path)  # never half a file under the real name
        finally:
            staging.unlink(missing_ok=True)
    return path
