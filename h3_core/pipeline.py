"""End-to-end generation: prompt (+ keyframes) -> text encoder -> packed sampling loop -> video and audio VAEs.

Components are loaded lazily, one phase at a time, and the text encoder is released before sampling unless asked to
stay, so peak memory is that of the largest phase rather than the sum of all four components.
"""

from __future__ import annotations

import gc
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .errors import CheckpointError, H3Error
from .layout import (AUDIO_SAMPLE_RATE, FPS, LatentShape, build_packed_layout, patchify,
                     rows_to_audio, unpatchify)
from .sampler import (AUDIO_SHIFT, VIDEO_SHIFT, Schedule, denoise, initial_noise, noise_condition,
                      non_finite_error)

PARTITIONS = ("fl2va", "ref2va")
# Prompt tokens accepted; the released model saw a few hundred. Far longer prompts only cost memory and time.
MAX_PROMPT_TOKENS = 4096
DEFAULT_TEXT_ENCODER_LAYER = 50
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


# ---- where the weights are ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSources:
    """The four components (a folder or a single file each) and the tokenizer, as `h3_core.load_*` take them."""

    transformer: Path
    text_encoder: Path
    video_vae: Path
    audio_vae: Path
    tokenizer: Path | None = None
    text_encoder_layer: int = DEFAULT_TEXT_ENCODER_LAYER
    root: Path | None = None

    def replace(self, **changes) -> "ModelSources":
        values = {k: getattr(self, k) for k in self.__dataclass_fields__}
        values.update({k: Path(v) if isinstance(v, (str, os.PathLike)) and k != "text_encoder_layer" else v
                       for k, v in changes.items() if v is not None})
        return ModelSources(**values)


def is_repo_id(text: str) -> bool:
    return bool(_REPO_ID.match(text)) and ".." not in text


def _minimax_block(folder: Path) -> dict:
    index = folder / "model_index.json"
    if not index.is_file():
        return {}
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{index}: cannot read JSON ({exc}).", path=index) from None
    block = data.get("_minimax_h3") if isinstance(data, dict) else None
    return block if isinstance(block, dict) else {}


def _first_existing(folder: Path, names) -> Path | None:
    for name in names:
        if (folder / name).exists():
            return folder / name
    return None


def _comfy_file(folder: Path, pattern: str, what: str, exclude=("pruned", "int8", "fp8", "nvfp4")) -> Path:
    """The first file (or folder, for text encoders in the official layout) matching `pattern`, skipping quantised
    and pruned variants, which h3-stream does not run."""
    candidates = sorted(p for p in folder.glob(pattern) if not any(x in p.name for x in exclude)
                        and (p.suffix == ".safetensors" or p.is_dir()))
    if not candidates:
        raise CheckpointError(f"{folder}: no {what} file matching '{pattern}'. Put the ComfyUI repack file there or "
                              "point at an official / partition folder instead.", path=folder)
    return candidates[0]


def resolve_model(model: str | os.PathLike, *, partition: str = "fl2va", offline: bool | None = None,
                  cache_dir: str | os.PathLike | None = None, hub_only: bool = False) -> ModelSources:
    """Find the four components of an H3 download.

    `model` is an official diffusers folder (`transformer/`, `text_encoder/`, `vae/`, `audio_vae/`, `tokenizer/`), an
    original release folder or one of its partitions (`FL2VA/`, `Ref2VA/`: `transformer/`, `video_vae/`,
    `audio_vae/`, `text_encoder/`), a ComfyUI `models/` folder (`diffusion_models/`, `text_encoders/`, `vae/`), or a
    Hugging Face repo id, of which only the needed folders are downloaded (offline mode is respected).
    `hub_only=True` accepts a repo id only, never a local path (for inputs that must not reach arbitrary folders).
    """
    if partition not in PARTITIONS:
        raise H3Error(f"partition must be one of {PARTITIONS}, got {partition!r}.")
    if hub_only:
        if not is_repo_id(str(model)):
            raise H3Error(f"{model!r} is not a Hugging Face repo id ('owner/name', letters, digits, '.', '_', '-'); "
                          "local folders go in ComfyUI's models/h3 folder instead.")
        return resolve_model(_download(str(model), partition, offline, cache_dir), partition=partition)
    path = Path(model).expanduser()
    if not path.exists():
        text = str(model)
        if not is_repo_id(text):
            raise CheckpointError(f"{text}: no such folder, and not a Hugging Face repo id ('owner/name').",
                                  path=path)
        path = _download(text, partition, offline, cache_dir)
    if path.is_file():
        raise CheckpointError(f"{path}: a single file holds one component; give the folder of the whole model (or "
                              "pass the component files separately).", path=path)
    block = _minimax_block(path)
    layer = int(block.get("text_encoder_layer", DEFAULT_TEXT_ENCODER_LAYER))
    transformer_name = "transformer" if partition == "fl2va" else "transformer_ref"
    if (path / "vae").is_dir() and (path / "audio_vae").is_dir() and (path / transformer_name).is_dir():
        return ModelSources(path / transformer_name, path / "text_encoder", path / "vae", path / "audio_vae",
                            _first_existing(path, ["tokenizer", "processor"]), layer, path)
    partition_dir = _first_existing(path, ["FL2VA", "fl2va"] if partition == "fl2va" else ["Ref2VA", "ref2va"])
    if partition_dir is not None and not (path / "video_vae").is_dir():
        return resolve_model(partition_dir, partition=partition, offline=offline)
    if (path / "video_vae").is_dir() and (path / "transformer").is_dir():
        return ModelSources(path / "transformer", path / "text_encoder", path / "video_vae", path / "audio_vae",
                            _first_existing(path, ["tokenizer", "processor"]), layer, path)
    if (path / "diffusion_models").is_dir() and (path / "vae").is_dir():
        te_folder = path / "text_encoders"
        return ModelSources(
            _comfy_file(path / "diffusion_models", f"minimax_h3*{partition}*.safetensors", "H3 transformer"),
            _comfy_file(te_folder, "qwen3vl*minimax_h3*", "H3 text encoder"),
            _comfy_file(path / "vae", "minimax_h3_video_vae*.safetensors", "H3 video VAE"),
            _comfy_file(path / "vae", "minimax_h3_audio_vae*.safetensors", "H3 audio VAE"),
            _first_existing(te_folder, ["tokenizer.json", "tokenizer"]), layer, path)
    raise CheckpointError(
        f"{path}: not an H3 model folder. Expected an official diffusers folder (transformer/, text_encoder/, vae/, "
        "audio_vae/), an original release folder (FL2VA/ or Ref2VA/ with transformer/, video_vae/, audio_vae/, "
        "text_encoder/), or a ComfyUI models folder (diffusion_models/, text_encoders/, vae/).",
        path=path,
    )


def _download(repo_id: str, partition: str, offline: bool | None, cache_dir) -> Path:
    from huggingface_hub import snapshot_download

    transformer = "transformer" if partition == "fl2va" else "transformer_ref"
    patterns = ["model_index.json"] + [f"{name}/*" for name in
                                       (transformer, "text_encoder", "tokenizer", "processor", "vae", "audio_vae")]
    if offline is None:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    try:
        folder = snapshot_download(repo_id, allow_patterns=patterns, local_files_only=bool(offline),
                                   cache_dir=cache_dir)
    except Exception as exc:  # the hub raises many types; one message says what to do
        raise CheckpointError(
            f"{repo_id}: could not get the model from Hugging Face ({type(exc).__name__}: {exc}). "
            + ("Offline mode is on and it is not in the local cache; download it first or unset HF_HUB_OFFLINE."
               if offline else "Check the repo id and your network, or download it and pass the folder."),
            path=repo_id,
        ) from None
    return Path(folder)


def _safetensors_files(source: Path) -> list[Path]:
    source = Path(source)
    return [source] if source.is_file() else sorted(source.rglob("*.safetensors"))


# ---- keyframes ---------------------------------------------------------------------------------------------------


def _to_pil(image):
    from PIL import Image
    import numpy as np

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (str, os.PathLike)):
        try:
            with Image.open(image) as opened:
                return opened.convert("RGB")
        except (OSError, ValueError) as exc:
            raise H3Error(f"{image}: cannot read the keyframe image ({exc}).") from None
    if isinstance(image, torch.Tensor):
        tensor = image[0] if image.ndim == 4 else image
        if tensor.ndim != 3 or tensor.shape[-1] not in (3, 4):
            raise H3Error(f"keyframe tensor must be [H, W, 3] (or ComfyUI [1, H, W, 3]) in [0, 1], got shape "
                          f"{tuple(image.shape)}.")
        if not torch.isfinite(tensor).all():
            raise H3Error("keyframe image contains NaN or Inf values.")
        array = (tensor[..., :3].float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
        return Image.fromarray(array)
    if isinstance(image, np.ndarray):
        return _to_pil(torch.from_numpy(image.astype("float32") / (255.0 if image.dtype == np.uint8 else 1.0)))
    raise H3Error(f"unsupported keyframe type {type(image).__name__}; give a PIL image, a path or an [H, W, 3] tensor.")


def prepare_keyframes(images, width: int, height: int) -> list:
    """Fit keyframes to the canvas as the released model saw them (LANCZOS): the first is stretched, the second is
    scaled to cover the canvas (rounded) and centre-cropped."""
    from PIL import Image

    prepared = []
    for index, image in enumerate(images):
        image = _to_pil(image)
        if image.size == (width, height):
            prepared.append(image)
        elif index == 0:
            prepared.append(image.resize((width, height), Image.Resampling.LANCZOS))
        else:
            scale = max(width / image.size[0], height / image.size[1])
            size = (max(width, round(image.size[0] * scale)), max(height, round(image.size[1] * scale)))
            left, top = max(0, (size[0] - width) // 2), max(0, (size[1] - height) // 2)
            prepared.append(image.resize(size, Image.Resampling.LANCZOS).crop((left, top, left + width, top + height)))
    return prepared


def _pil_to_frames(image) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)[None, None]  # [1, 1, H, W, 3]


# ---- the pipeline ---------------------------------------------------------------------------------------------------


@dataclass
class Conditioning:
    """What the text encoder produced for one request, plus the keyframes it saw."""

    states: torch.Tensor  # [L, text_dim]
    tags: torch.Tensor  # [L]
    keyframes: list = field(default_factory=list)  # prepared PIL images, in packed order
    anchors: tuple[str, ...] = ()


@dataclass
class Latents:
    video: torch.Tensor  # [1, 24, T, H/16, W/16], normalised
    audio: torch.Tensor  # [1, 32, 2, Ta], normalised
    shape: LatentShape


@dataclass
class GenerationResult:
    frames: torch.Tensor  # [F, H, W, 3] float in [0, 1]
    waveform: torch.Tensor  # [2, N] float at 32 kHz, trimmed to the video length
    fps: int = FPS
    sample_rate: int = AUDIO_SAMPLE_RATE
    timings: dict = field(default_factory=dict)


class H3Pipeline:
    """Holds the model sources and the memory settings; loads each component when its phase needs it.

    `component_options` maps a component name ("transformer", "text_encoder", "video_vae", "audio_vae") to extra
    keyword arguments of its loader (residency, chunk size, ...). `keep_text_encoder=False` releases the text
    encoder after each prompt.
    """

    COMPONENTS = ("text_encoder", "transformer", "video_vae", "audio_vae")

    def __init__(self, sources: ModelSources, *, device="cpu", dtype: torch.dtype | None = None,
                 component_options: dict | None = None, keep_text_encoder: bool = False,
                 log: Callable[[str], None] | None = None):
        self.sources = sources
        self.device = torch.device(device)
        self.dtype = dtype
        self.component_options = {k: dict(v) for k, v in (component_options or {}).items()}
        unknown = set(self.component_options) - set(self.COMPONENTS)
        if unknown:
            raise H3Error(f"unknown component(s) {sorted(unknown)} in component_options; use {self.COMPONENTS}.")
        self.keep_text_encoder = keep_text_encoder
        self.log = log or (lambda message: None)
        self._loaded: dict[str, object] = {}

    # -- components ----------------------------------------------------------------------------------------------

    def component(self, name: str):
        if name in self._loaded:
            return self._loaded[name]
        import h3_core

        options = dict(self.component_options.get(name, {}))
        started = time.perf_counter()
        if name == "text_encoder":
            loaded = h3_core.load_text_encoder(self.sources.text_encoder, tokenizer=self.sources.tokenizer,
                                               layer=self.sources.text_encoder_layer, device=self.device,
                                               dtype=self.dtype, **options)
        elif name == "transformer":
            loaded = h3_core.load_dit(self.sources.transformer, device=self.device, dtype=self.dtype, **options)
        elif name == "video_vae":
            loaded = h3_core.load_video_vae(self.sources.video_vae, device=self.device, **options)
        elif name == "audio_vae":
            loaded = h3_core.load_audio_vae(self.sources.audio_vae, device=self.device, **options)
        else:
            raise H3Error(f"unknown component {name!r}; use one of {self.COMPONENTS}.")
        self.log(f"loaded {name} in {time.perf_counter() - started:.1f} s")
        self._loaded[name] = loaded
        return loaded

    def release(self, name: str) -> None:
        """Drop a component (its memory maps and device copies go with it)."""
        component = self._loaded.pop(name, None)
        if component is not None:
            close = getattr(component, "close", None)
            if callable(close):
                close()
            del component
            gc.collect()

    def release_all(self) -> None:
        for name in list(self._loaded):
            self.release(name)

    # -- phases --------------------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str, *, width: int, height: int, first_frame=None,
                      last_frame=None) -> Conditioning:
        if not isinstance(prompt, str):
            raise H3Error(f"prompt must be a string, got {type(prompt).__name__}.")
        anchors = tuple(a for a, image in (("first", first_frame), ("last", last_frame)) if image is not None)
        keyframes = prepare_keyframes([i for i in (first_frame, last_frame) if i is not None], width, height)
        encoder = self.component("text_encoder")
        tokens = len(encoder.tokenizer.tokenize(prompt))
        if tokens > MAX_PROMPT_TOKENS:
            raise H3Error(f"the prompt is {tokens} tokens ({len(prompt)} characters); at most {MAX_PROMPT_TOKENS} are "
                          "accepted (H3 was trained on prompts of a few hundred tokens). Shorten it.")
        states, tags = encoder.encode(prompt, keyframes)
        if not self.keep_text_encoder:
            self.release("text_encoder")
        if not torch.isfinite(states).all():
            raise non_finite_error("the text encoder", _safetensors_files(self.sources.text_encoder), "its output")
        return Conditioning(states.detach(), tags.detach(), keyframes, anchors)

    def sample(self, cond: Conditioning, shape: LatentShape, *, steps: int, seed: int,
               video_shift: float = VIDEO_SHIFT, audio_shift: float = AUDIO_SHIFT, progress=None,
               check_interrupt=None) -> Latents:
        schedule = Schedule.build(steps, video_shift, audio_shift)
        condition_latents = []
        if cond.keyframes:
            vae = self.component("video_vae")
            condition_latents = [vae.encode(_pil_to_frames(image).to(self.device)).float().cpu()
                                 for image in cond.keyframes]
        dit = self.component("transformer")
        config = dit.config
        if cond.states.shape[-1] != config.text_dim:
            raise H3Error(f"the text encoder gives {cond.states.shape[-1]}-wide states but the transformer expects "
                          f"{config.text_dim}; the two checkpoints do not belong together.")
        layout = build_packed_layout(cond.tags, shape.latent_frames, shape.latent_height, shape.latent_width,
                                     shape.audio_latents, cond.anchors, config.patch_size)
        noises, video_noise, audio_noise = initial_noise(
            shape.video, 2 * shape.audio_latents, shape.audio_latent_channels, seed,
            [c.shape for c in condition_latents])
        condition_rows = [patchify(noise_condition(c, n), config.patch_size)[0]
                          for c, n in zip(condition_latents, noises)]
        video_rows = torch.cat(condition_rows + [patchify(video_noise, config.patch_size)[0]])
        result = denoise(dit, cond.states, layout, schedule, video_rows, audio_noise,
                         num_condition_video_rows=layout.num_condition_video_rows, progress=progress,
                         check_interrupt=check_interrupt)
        video = unpatchify(result.video_rows[None].cpu(), shape.video[1:], config.patch_size)
        audio = rows_to_audio(result.audio_rows[None].cpu())
        return Latents(video, audio, shape)

    def decode(self, latents: Latents) -> tuple[torch.Tensor, torch.Tensor]:
        frames = self.component("video_vae").decode(latents.video.to(self.device))[0].float().cpu()
        if not torch.isfinite(frames).all():
            raise non_finite_error("the video VAE", _safetensors_files(self.sources.video_vae), "decoding")
        waveform = self.component("audio_vae").decode(latents.audio.to(self.device))[0].float().cpu()
        if not torch.isfinite(waveform).all():
            raise non_finite_error("the audio VAE", _safetensors_files(self.sources.audio_vae), "decoding")
        from .media import audio_samples_for_frames

        return frames, waveform[:, : audio_samples_for_frames(frames.shape[0])]

    def generate(self, prompt: str, *, width: int, height: int, num_frames: int, steps: int, seed: int,
                 first_frame=None, last_frame=None, video_shift: float = VIDEO_SHIFT,
                 audio_shift: float = AUDIO_SHIFT, progress=None, check_interrupt=None) -> GenerationResult:
        shape = LatentShape.for_request(width, height, num_frames)
        timings = {}
        started = time.perf_counter()
        cond = self.encode_prompt(prompt, width=width, height=height, first_frame=first_frame,
                                  last_frame=last_frame)
        timings["text_encoder"] = time.perf_counter() - started
        started = time.perf_counter()
        latents = self.sample(cond, shape, steps=steps, seed=seed, video_shift=video_shift, audio_shift=audio_shift,
                              progress=progress, check_interrupt=check_interrupt)
        timings["sampling"] = time.perf_counter() - started
        started = time.perf_counter()
        frames, waveform = self.decode(latents)
        timings["decode"] = time.perf_counter() - started
        return GenerationResult(frames, waveform, timings=timings)


def plan_components(sources: ModelSources, *, device="cpu", residency: str = "auto", chunk_size: int | None = None,
                    memory_budget_gb: float | None = None, width: int, height: int, num_frames: int,
                    log: Callable[[str], None] | None = None) -> dict:
    """Loader options per component from the user's settings; with a memory budget, the preflight decides.

    `residency` applies to all four components: "resident", "layerwise", or "auto" (layerwise on Apple MPS, where the
    admission rules require it for every component; resident elsewhere).
    """
    if memory_budget_gb is not None:
        from .memory_plan import plan_for_budget

        if not memory_budget_gb > 0:
            raise H3Error(f"memory budget must be a positive number of GB, got {memory_budget_gb}.")
        plan = plan_for_budget(sources, device=device, budget_bytes=int(memory_budget_gb * 2**30), width=width,
                               height=height, num_frames=num_frames, chunk_size=chunk_size)
        if log:
            log(plan.describe())
        return plan.component_options
    if residency == "auto":
        residency = "layerwise" if torch.device(device).type == "mps" else "resident"
    options: dict = {name: ({"residency": residency} if residency != "resident" else {})
                     for name in H3Pipeline.COMPONENTS}
    if chunk_size is not None:  # rows per chunk of attention queries and MLP, in the transformer and text encoder
        options["transformer"]["chunk_size"] = chunk_size
        options["text_encoder"]["chunk_size"] = chunk_size
    return options
