"""`python -m h3_core generate PROMPT ...`: one command from a prompt to an mp4 with 32 kHz stereo audio."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import re
import signal
import sys
from pathlib import Path

import torch

from ..components import COMPONENTS
from ..errors import H3Error
from ..planning.memory_plan import check_memory_budget_gib
from ..request.generation_request import AUDIO_SHIFT, VIDEO_SHIFT, GenerationRequest, RequestNames, frames_for_duration
from ..request.grid import FPS
from ..request.keyframes import check_image_file
from ..request.media_files import output_problem
from ..runtime.platform import device_problem
from ..settings import DTYPES, RESIDENCIES
from ..step_cache_settings import STEP_CACHE_OFF, STEP_CACHE_PRESETS, step_cache_settings
from .audio_warnings import print_audio_warnings
from .guide_flags import GUIDE_HELP, read_guide_files
from .progress import DownloadBar, ProgressBar, memory_report
from .step_cache_flags import STEP_CACHE_NUMBER_FLAGS, step_cache_flags_given

# Without --model the embedded tiny random model runs; these keep that check of an install under a minute on a CPU.
TINY_DEFAULTS = {"size": "96x64", "seconds": 1.0, "steps": 3}
MODEL_DEFAULTS = {"size": "1344x768", "seconds": 124 / FPS, "steps": 50}


class CliError(H3Error):
    pass


class Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so that every `finally` (model release, staging removal) runs."""


def _flagged(flag: str, check, value, *args):
    """Run an h3_core check with the flag's name in its message."""
    try:
        return check(value, *args, flag)
    except H3Error as exc:
        raise CliError(str(exc)) from None


# The request's fields as the flags name them (`--size` and the duration flag are filled in per run).
CLI_NAMES = RequestNames(prompt="the prompt", num_frames="--frames", steps="--steps", seed="--seed",
                         video_shift="--video-shift", audio_shift="--audio-shift", first_frame="--first-frame",
                         last_frame="--last-frame", reference_images="--ref-image", reference_videos="--ref-video",
                         reference_audios="--ref-audio", reference_image_size="--ref-image-size", loras="--lora",
                         server_lora="--server-lora", job_timeout="--job-timeout", step_cache="--step-cache",
                         guides="--guide")


def parse_size(text: str) -> tuple[int, int]:
    """`WIDTHxHEIGHT` -> (width, height); the canvas rule itself is the request's."""
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise CliError(f"--size {text!r}: write it as WIDTHxHEIGHT, e.g. 1344x768.") from None
    return width, height


def parse_lora(text: str) -> tuple[Path, float]:
    """`FILE[:STRENGTH]` -> (file, strength); the strength defaults to 1.0. A file whose own name has a colon (a
    Windows drive) is read whole when what follows the last colon is not a number and the whole name exists."""
    path, strength = text, 1.0
    head, colon, tail = text.rpartition(":")
    if colon:
        try:
            path, strength = head, float(tail)
        except ValueError:
            if not Path(text).expanduser().is_file():
                raise CliError(f"--lora {text}: strength {tail!r} is not a number; write FILE[:STRENGTH], e.g. "
                               "turbo.safetensors:0.8.") from None
        if not math.isfinite(strength):
            raise CliError(f"--lora {text}: strength must be a finite number, got {tail!r}.")
    file = Path(path).expanduser()
    if not path or not file.exists():  # a folder is read_lora's to explain
        raise CliError(f"--lora {text}: no such file {str(file)!r}.")
    return file, strength


def note_repeated_loras(loras, say) -> None:
    """A file given to --lora more than once is applied once per mention (as the library and a chain of LoRA nodes
    do, so the strengths add); the CLI says so, as a repeat there is more likely a slip than meant."""
    seen: dict = {}
    for path, strength in loras:
        try:
            stat = path.stat()
            seen.setdefault((stat.st_dev, stat.st_ino), []).append((path, strength))
        except OSError:
            continue  # read_lora says what is wrong with it
    for mentions in seen.values():
        if len(mentions) > 1:
            strengths = " + ".join(f"{strength:g}" for _, strength in mentions)
            total = sum(strength for _, strength in mentions)
            say(f"--lora {mentions[0][0]}: given {len(mentions)} times, so it is applied {len(mentions)} times "
                f"(strength {strengths} = {total:g}); give it once to apply it once")


def lora_recommendations(loras, args, say) -> dict:
    """Each LoRA read and checked, with its strength, before any model loads; then the steps and shifts their
    metadata recommend that the user did not give (the first LoRA giving one wins), said in one line."""
    from ..checkpoints.lora_loader import check_strengths, read_lora

    flags = {"steps": ("steps", args.steps), "video_shift": ("video shift", args.video_shift),
             "audio_shift": ("audio shift", args.audio_shift)}
    chosen: dict = {}
    sources = []
    read = []
    try:
        for path, strength in loras:
            read.append((read_lora(path), strength))
        check_strengths(read)  # before any model loads
    except H3Error as exc:
        raise CliError(f"--lora: {exc}") from None
    for lora, _ in read:
        path, recommended = lora.path, lora.recommended
        for key, value in recommended.items():
            if key in flags and flags[key][1] is None and key not in chosen:
                chosen[key] = value
                if path.name not in sources:
                    sources.append(path.name)
    if chosen:
        described = ", ".join(f"{value:g} steps" if key == "steps" else f"{flags[key][0]} {value:g}"
                              for key, value in chosen.items())
        overrides = " / ".join(f"--{key.replace('_', '-')}" for key in chosen)
        say(f"using the LoRA's recommended {described} ({', '.join(sources)}); pass {overrides} to override")
    return chosen


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m h3_core", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    q = commands.add_parser("quantize", help="write a quantised copy of a transformer or text-encoder checkpoint "
                                             "(bf16, fp16 or fp32), streaming it a tensor at a time")
    q.add_argument("source", help="the transformer (a ComfyUI .safetensors file or a transformer folder) or, with "
                                  "--component text_encoder, the text encoder (its text_encoder/ folder, a partition "
                                  "or a ComfyUI text_encoders .safetensors file), bf16, fp16 or fp32")
    q.add_argument("target", help="the file to write: .safetensors for fp8 / int8 (ComfyUI mixed precision), .gguf "
                                  "for q8_0 / q6_k / q4_k (a text encoder's vision tower goes to mmproj-<name>.gguf "
                                  "beside it). Written under a temporary name and renamed when complete: an existing "
                                  "file is replaced only by a finished one")
    q.add_argument("--format", required=True, choices=["q8_0", "q6_k", "q4_k", "fp8", "int8"],
                   help="the quantisation")
    q.add_argument("--component", choices=["transformer", "text_encoder"], default="transformer",
                   help="what SRC is (default: transformer)")
    q.add_argument("--layer", type=int, help="text encoder only: keep decoder layers below this one (default 50, "
                                             "what H3 reads)")
    q.add_argument("--config", type=Path, metavar="FILE", help="text encoder only: the config.json of a single-file "
                   "text encoder that is not Qwen3-VL-32B (the ComfyUI repack carries none)")
    g = commands.add_parser("generate", help="generate a video with stereo audio from a prompt")
    g.add_argument("prompt", help="the text prompt (an empty string is allowed)")
    g.add_argument("--seconds", type=float, help="duration; rounded up to the 17n+5 frame grid at 24 fps. Beyond 15 s "
                        "the video is made in windows of at most 15 s, each guided by the end of the one before (up "
                        "to 600 s); with --extend, the seconds added")
    g.add_argument("--frames", type=int, help="frame count instead of --seconds; rounded up to 17n+5")
    g.add_argument("--size", help="WIDTHxHEIGHT, multiples of 32 (default 1344x768; 96x64 for the tiny model)")
    g.add_argument("--steps", type=int, help="sigma grid points including the final 0 (default 50; tiny: 3)")
    g.add_argument("--seed", type=int, default=42)
    g.add_argument("--model", help="H3 folder or Hugging Face repo id (default: the embedded tiny random model)")
    g.add_argument("--partition", choices=("fl2va", "ref2va"), default="fl2va")
    g.add_argument("--transformer", type=Path, metavar="FILE",
                   help="the transformer to use instead of the model's: a ComfyUI .safetensors (bf16, fp8, int8, "
                        "NVFP4) or a .gguf file, or a transformer folder")
    g.add_argument("--first-frame", type=Path, help="keyframe image for the first frame (FL2VA)")
    g.add_argument("--last-frame", type=Path, help="keyframe image for the last frame (FL2VA)")
    g.add_argument("--guide", action="append", default=[], metavar="FILE[@FRAME]", help=GUIDE_HELP)
    g.add_argument("--ref-image", action="append", default=[], type=Path, metavar="FILE",
                   help="a reference image (Ref2VA, with --partition ref2va); repeat for several, at most 9")
    g.add_argument("--ref-video", action="append", default=[], type=Path, metavar="FILE",
                   help="a reference video, its soundtrack used too (Ref2VA; needs PyAV); repeat, at most 3")
    g.add_argument("--ref-audio", action="append", default=[], type=Path, metavar="FILE",
                   help="a reference audio file, resampled to 32 kHz (Ref2VA; needs PyAV); repeat, at most 3. "
                        "References are read in the order images, videos, audios, each in command-line order")
    g.add_argument("--ref-image-size", choices=("reference", "max", "match"), default="reference",
                   help="reference image size: reference (2048-px short edge, as the reference pipeline), max "
                        "(down to it, never up) or match (down to the video's area)")
    g.add_argument("--residency", choices=("auto", *RESIDENCIES), default="auto",
                   help="every component: all weights on the device, or streamed block by block "
                        "(auto: layerwise on Apple MPS, resident elsewhere)")
    g.add_argument("--chunk-size", type=int, help="rows per chunk in attention and MLP of the transformer and text encoder "
                        "(default: fused)")
    g.add_argument("--memory-budget", type=float, help="GiB the run may use; chooses residency and chunk size and "
                        "prints what each phase holds (refused, naming the phase, when one does not fit)")
    g.add_argument("--keep", action="append", default=[], choices=COMPONENTS, metavar="COMPONENT",
                   help="keep this component loaded through every phase (repeat for several; one of "
                        f"{', '.join(COMPONENTS)}). By default each phase releases what it does not run: the video "
                        "VAE after the keyframes, the transformer before decoding; --keep video_vae saves reloading "
                        "it for the decode, and --memory-budget counts kept components in every phase")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    g.add_argument("--dtype", choices=tuple(DTYPES), default="auto", help="auto keeps the checkpoint's dtypes")
    g.add_argument("--lora", action="append", default=[], metavar="FILE[:STRENGTH]",
                   help="a LoRA for the transformer (strength default 1.0); repeat for several. Steps and shifts the "
                        "LoRA recommends are used unless given")
    g.add_argument("--video-shift", type=float, help="sigma shift of the video schedule (default 12)")
    g.add_argument("--audio-shift", type=float, help="sigma shift of the audio schedule (default 3)")
    g.add_argument("--step-cache", choices=tuple(STEP_CACHE_PRESETS), default=STEP_CACHE_OFF,
                   help="skip most of the transformer on steps where its first block barely changes (DBCache, as "
                        "cache-dit): off (default, the exact output), quality (SGLang's and vLLM-Omni's setting for "
                        "H3's quality=high: at most every other step), fast (more steps skipped, lower fidelity). "
                        "The hits are printed at the end")
    g.add_argument("--step-cache-threshold", type=float, metavar="R",
                   help="expert: the relative change of the first blocks' residual under which a step is skipped "
                        "(quality 0.04, fast 0.24; 0 never skips). Any --step-cache-* number turns the cache on, "
                        "starting from --step-cache (quality when off)")
    g.add_argument("--step-cache-blocks", metavar="F[,B]",
                   help="expert: blocks that always run, F first and B last (default 1,0)")
    g.add_argument("--step-cache-warmup", type=int, metavar="N", help="expert: steps that never skip (default 4)")
    g.add_argument("--step-cache-max-consecutive", type=int, metavar="N",
                   help="expert: skipped steps in a row before one runs every block (quality 1, fast 3; -1: no cap)")
    g.add_argument("--out", default="out.mp4",
                   help="the .mp4 to write (H.264 + AAC; without PyAV: STEM_frames/ PNGs and STEM.wav beside it). "
                        "Written under a temporary name and renamed when complete: an existing file is replaced "
                        "only by a finished video")
    g.add_argument("--preview", type=Path, metavar="FILE.png",
                   help="after every sampling step, write that step's preview to FILE.png (the first frame of the x0 "
                        "estimate through latent2rgb, at latent size: 1/16 of the canvas; or, with --preview-taeh3, "
                        "decoded by TAEH3 at up to 512 px), replaced whole each time: open it to decide whether to "
                        "cancel. Off by default, and then nothing is computed for it")
    g.add_argument("--preview-taeh3", type=Path, metavar="FILE",
                   help="with --preview: the TAEH3 tiny decoder's taeh3.safetensors (madebyollin/taehv) for a "
                        "decoded preview instead of latent2rgb")
    g.add_argument("--server", metavar="URL",
                   help="run on an SGLang diffusion or vLLM-Omni server serving H3 (its OpenAI-style videos API, "
                        "e.g. http://gpu-box:30010) instead of this machine; --model and the memory flags are then "
                        "ignored. The server makes 4 to 15 s at its own canvases (checked before sending). API key: "
                        "the H3_STREAM_API_KEY environment variable")
    g.add_argument("--backend", choices=("auto", "sglang", "vllm-omni"), default="auto",
                   help="with --server: the server's engine (auto: as its model card says)")
    g.add_argument("--job-timeout", type=float, default=None, metavar="SECONDS",
                   help="with --server: how long the job may take on the server before it is cancelled (default "
                        "7200)")
    g.add_argument("--server-lora", metavar="PATH[:STRENGTH]",
                   help="with --server: a LoRA file already on the server (its path there), applied to this request "
                        "(vLLM-Omni; an SGLang server's LoRA is set when it starts: sglang serve --lora-path)")
    # Long videos and extensions (h3_core/app/long_video_cli.py).
    g.add_argument("--prompt-schedule", metavar="\"0: PROMPT; 15: PROMPT\"",
                   help="a prompt per window of a long video: SECONDS: PROMPT entries separated by ';' (the first at "
                        "0); each window takes the prompt in force at its first new frame, in place of PROMPT")
    g.add_argument("--extend", type=Path, metavar="CLIP.mp4",
                   help="continue this 24 fps H.264 clip by --seconds: its last 22 frames and their soundtrack guide "
                        "the new part; the result (--out) is the clip, its frames copied unchanged, followed by the "
                        "new part, at the clip's canvas")
    g.add_argument("--yes-large", action="store_true",
                   help="run a request past the large-request thresholds (canvas over 1920x1088 pixels, more than "
                        "200 steps, or an estimated peak over this machine's memory), which is otherwise refused "
                        "with its memory and time estimate")
    return parser


def parse_step_cache(args, say):
    """--step-cache and its expert numbers -> `StepCacheSettings` (None: off), in the flags' words."""
    first = last = None
    if args.step_cache_blocks is not None:
        parts = args.step_cache_blocks.split(",")
        try:
            if len(parts) > 2:
                raise ValueError
            first, last = int(parts[0]), int(parts[1]) if len(parts) == 2 else 0
        except ValueError:
            raise CliError(f"--step-cache-blocks {args.step_cache_blocks!r}: give F or F,B (the first and last blocks "
                           "that always run), e.g. 1 or 2,1.") from None
    overrides = dict(first_blocks=first, last_blocks=last, threshold=args.step_cache_threshold,
                     warmup_steps=args.step_cache_warmup, max_consecutive=args.step_cache_max_consecutive)
    given = [flag for flag in step_cache_flags_given(args) if flag != "--step-cache"]
    labels = {field: flag for flag, _, fields in STEP_CACHE_NUMBER_FLAGS for field in fields}
    labels.update(first_blocks="--step-cache-blocks F", last_blocks="--step-cache-blocks B")
    try:
        settings = step_cache_settings(args.step_cache, name="--step-cache", labels=labels, **overrides)
    except H3Error as exc:
        raise CliError(str(exc)) from None
    if given and settings is not None:
        base = args.step_cache if args.step_cache != STEP_CACHE_OFF else "quality"
        say(f"step cache: {base} with {', '.join(given)} ({settings.describe()})")
    return settings


def resolve_frames(args, defaults, say) -> int:
    """--seconds or --frames (an off-grid --frames is rounded up, with a note) -> the frame count."""
    if args.frames is not None and args.seconds is not None:
        raise CliError("give --seconds or --frames, not both.")
    seconds = defaults.get("seconds") if args.seconds is None else args.seconds
    try:
        frames, note = frames_for_duration(seconds, args.frames, names=("--seconds", "--frames"), round_up=True)
    except H3Error as exc:
        raise CliError(str(exc)) from None
    if note:
        say(note)
    return frames


def check_preview_flags(args) -> None:
    """--preview names a writable .png on this machine; --preview-taeh3 an existing .safetensors, with --preview."""
    preview, taeh3 = getattr(args, "preview", None), getattr(args, "preview_taeh3", None)
    if taeh3 is not None and preview is None:
        raise CliError(f"--preview-taeh3 {taeh3}: decodes the previews that --preview writes; give --preview "
                       "FILE.png too, or drop it.")
    if preview is None:
        return
    if getattr(args, "server", None):
        raise CliError(f"--preview {preview}: previews come from the sampling loop on this machine; a --server job "
                       "has none. Drop --preview.")
    path = Path(preview).expanduser()
    if path.suffix.lower() != ".png":
        raise CliError(f"--preview {preview}: the preview is a PNG; name it {path.with_suffix('.png').name}.")
    if path.is_dir() or not path.parent.expanduser().resolve().is_dir():
        raise CliError(f"--preview {preview}: give a file name in an existing folder.")
    if taeh3 is not None:
        from ..checkpoints.taeh3_loader import load_taeh3

        taeh3 = Path(taeh3).expanduser()
        if not taeh3.is_file():
            raise CliError(f"--preview-taeh3 {taeh3}: no such file.")
        try:  # read (and a pickle refused unopened, with how to convert it) before any model loads
            load_taeh3(taeh3)
        except H3Error as exc:
            raise CliError(f"--preview-taeh3 {exc}") from None


def preview_writer(args, device):
    """The `preview` callback of a run with --preview (None without: the sampling loop then computes nothing for
    it): each step's picture, written to a temporary file beside FILE.png and renamed over it."""
    if getattr(args, "preview", None) is None:
        return None
    import os

    from PIL import Image

    from ..pipeline.preview import Latent2RGBPreviewer, taeh3_previewer

    if args.preview_taeh3 is not None:
        try:
            previewer = taeh3_previewer(Path(args.preview_taeh3).expanduser(), device=device, max_size=512)
        except H3Error as exc:
            raise CliError(f"--preview-taeh3 {exc}") from None
    else:
        previewer = Latent2RGBPreviewer()
    target = Path(args.preview).expanduser()
    partial = target.with_name(f".{target.name}.partial.png")

    def write(estimate) -> None:
        Image.fromarray(previewer.render(estimate).numpy()).save(partial)
        os.replace(partial, target)

    return write


def check_arguments(args, say) -> GenerationRequest:
    """Every check that needs no model, in the flags' words, before anything is resolved or loaded; the request's
    own rules are `GenerationRequest`'s (reference files are decoded here, normalised by the engine)."""
    tiny = args.model is None and not getattr(args, "server", None)
    defaults = TINY_DEFAULTS if tiny else MODEL_DEFAULTS
    problem = device_problem(args.device)
    if problem:
        raise CliError(f"--device {args.device}: {problem}.")
    problem = output_problem(args.out)
    if problem:
        raise CliError(f"--out {args.out!r}: {problem}.")
    check_preview_flags(args)
    size = args.size or defaults["size"]
    width, height = parse_size(size)
    num_frames = resolve_frames(args, defaults, say)
    if args.memory_budget is not None:
        _flagged("--memory-budget", check_memory_budget_gib, args.memory_budget)
    if args.chunk_size is not None and args.chunk_size < 1:
        raise CliError(f"--chunk-size {args.chunk_size}: must be at least 1 (rows per chunk).")
    for flag, path in (("--first-frame", args.first_frame), ("--last-frame", args.last_frame)):
        if path is not None:
            _flagged(flag, check_image_file, path)
    check_reference_flags(args)
    if args.transformer is not None:
        _existing(args.transformer, "--transformer")
    loras = [parse_lora(text) for text in args.lora]
    note_repeated_loras(loras, say)
    recommended = lora_recommendations(loras, args, say)
    chosen = {key: recommended.get(key, default) if getattr(args, key) is None else getattr(args, key)
              for key, default in (("steps", defaults["steps"]), ("video_shift", VIDEO_SHIFT),
                                   ("audio_shift", AUDIO_SHIFT))}
    names = dataclasses.replace(
        CLI_NAMES, width=f"--size {size}: width", height=f"--size {size}: height",
        num_frames="--frames" if args.frames is not None else "--seconds",
        **{key: f"the LoRA's recommended {key.replace('_', ' ')}" for key in chosen if key in recommended})
    try:
        return GenerationRequest(
            prompt=args.prompt, width=width, height=height, num_frames=num_frames, seed=args.seed, **chosen,
            first_frame=args.first_frame, last_frame=args.last_frame, loras=tuple(loras),
            step_cache=parse_step_cache(args, say), **read_reference_files(args, num_frames / FPS), names=names,
            guides=read_guide_files(getattr(args, "guide", ()), num_frames, say))
    except H3Error as exc:
        raise CliError(str(exc).replace("give the prompt as UTF-8 text", "check the terminal's encoding (locale) "
                                        "and give the prompt as UTF-8 text")) from None


def has_references(args) -> bool:
    return bool(args.ref_image or args.ref_video or args.ref_audio)


def check_reference_flags(args) -> None:
    """What the Ref2VA flags need beyond the request's rules: the Ref2VA partition, and files that exist."""
    if not has_references(args):
        return
    flags = ("--ref-image", "--ref-video", "--ref-audio")
    if args.partition != "ref2va":
        raise CliError(f"{' / '.join(f for f, v in zip(flags, (args.ref_image, args.ref_video, args.ref_audio)) if v)}"
                       ": references need the Ref2VA transformer; add --partition ref2va.")
    for path in args.ref_image:
        _flagged("--ref-image", check_image_file, path)
    for flag, paths in (("--ref-video", args.ref_video), ("--ref-audio", args.ref_audio)):
        for path in paths:
            _existing(path, flag, folder_allowed=False)


def _existing(path: Path, flag: str, *, folder_allowed: bool = True) -> Path:
    """The path a flag names, which must exist (and be a file, unless `folder_allowed`)."""
    path = Path(path).expanduser()
    if path.is_dir() and not folder_allowed:
        raise CliError(f"{flag} {path}: is a folder; give a file inside it.")
    if not path.exists():
        raise CliError(f"{flag} {path}: no such file{' or folder' if folder_allowed else ''}.")
    return path


def read_reference_files(args, seconds: float) -> dict:
    """The reference flags as request fields: images by path, videos and audios decoded (frames and soundtrack at
    their own rates, only the `seconds` the request uses), each labelled with its flag and file for errors."""
    from ..sources.reference_files import read_audio_file, read_video_file

    if not has_references(args):
        return {}
    flags = (("image", "--ref-image", args.ref_image), ("video", "--ref-video", args.ref_video),
             ("audio", "--ref-audio", args.ref_audio))
    from ..request.references import check_reference_counts

    try:  # the counts first: a tenth image is refused before any video is decoded
        check_reference_counts(len(args.ref_image), len(args.ref_video), len(args.ref_audio), CLI_NAMES.references)
    except H3Error as exc:
        raise CliError(str(exc)) from None
    videos = [(frames, waveform, fps, rate) for frames, fps, waveform, rate in
              (read_video_file(path, max_seconds=seconds) for path in args.ref_video)]
    return dict(reference_images=tuple(args.ref_image), reference_videos=tuple(videos),
                reference_audios=tuple(read_audio_file(path, max_seconds=seconds) for path in args.ref_audio),
                reference_image_size=args.ref_image_size,
                reference_labels=tuple(((kind, i), f"{flag} {path}") for kind, flag, paths in flags
                                       for i, path in enumerate(paths)))


def check_large_request(args, sources, request, residency, references=None) -> None:
    """Refuse a request past the large-request thresholds unless --yes-large, stating its estimates."""
    from ..planning.request_estimate import describe_estimate, estimate_request, large_request_reasons
    from ..runtime.file_reads import total_memory_bytes

    estimate = estimate_request(sources, device=args.device, width=request.width, height=request.height,
                                num_frames=request.num_frames, steps=request.steps, dtype=DTYPES[args.dtype],
                                chunk_size=args.chunk_size, loras=request.loras, keep=args.keep,
                                keyframes=bool(request.anchors), residency=residency, references=references,
                                step_cache=request.step_cache is not None, guides=request.placed_guides)
    memory = None if args.memory_budget is not None else total_memory_bytes()  # a budget is checked by the plan
    reasons = large_request_reasons(request.width, request.height, request.steps, estimate, memory,
                                    size_name="--size", steps_name="--steps")
    if reasons and not args.yes_large:
        raise CliError(f"this is a large request: {'; '.join(reasons)}. {describe_estimate(estimate)}. Pass "
                       "--yes-large to run it anyway, or use a smaller --size, fewer --steps or fewer --seconds.")
    if reasons:
        print(f"large request ({'; '.join(reasons)}), run because of --yes-large: {describe_estimate(estimate)}.",
              file=sys.stderr)


def _identity(path: Path):
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def model_sources(args, say):
    """The model the flags name (--model, --partition, --transformer), or the embedded tiny one without --model."""
    from ..sources.model_sources import resolve_model

    if args.model is None:
        from ..sources.tiny_default import ensure_tiny_model

        say("using the embedded tiny random model: it produces noise and only checks the install; "
            "pass --model for real weights")
        sources = resolve_model(ensure_tiny_model(log=say), partition=args.partition)
    else:
        sources = resolve_model(args.model, partition=args.partition, progress=DownloadBar())
    if args.transformer is not None:
        sources = sources.replace(transformer=_existing(args.transformer, "--transformer"))
        say(f"transformer: {sources.transformer} (--transformer)")
    return sources


def generate(args, say=print, outputs: dict | None = None) -> list[Path]:
    """Run `python -m h3_core generate`. `outputs` (filled in here) holds the --out path and its identity before the
    run, so that an interrupt can say truthfully whether anything was written."""
    from ..pipeline.pipeline import H3Pipeline
    from ..request.media_files import write_outputs

    if args.server:
        from .remote_cli import check_remote_flags

        check_remote_flags(args)
    elif args.job_timeout is not None:
        raise CliError(f"--job-timeout {args.job_timeout:g}: is for a server job; give --server URL too, or drop it.")
    elif args.backend != "auto" or args.server_lora:
        flag = f"--backend {args.backend}" if args.backend != "auto" else f"--server-lora {args.server_lora}"
        raise CliError(f"{flag}: is for a server; give --server URL too, or drop it (a LoRA file on this machine "
                       "goes with --lora)." if args.server_lora else f"{flag}: names a server's engine; give --server "
                       "URL too, or drop it.")
    from .long_video_cli import generate_long, is_long_run

    if is_long_run(args):
        return generate_long(args, say, outputs, sys.modules[__name__])
    request = check_arguments(args, say)
    out = Path(args.out).expanduser()
    before = _identity(out)
    if outputs is not None:
        outputs.update(path=out, before=before)
    if args.server:
        from .remote_cli import generate_remote

        return generate_remote(args, request, out, before, say, ProgressBar("remote job"))
    sources = model_sources(args, say)
    from ..planning.phase_plans import plan_components
    from ..sources.model_sources import canvas_rules

    residency = None if args.residency == "auto" else args.residency
    references = request.normalised_references(canvas_rules(sources))
    check_large_request(args, sources, request, residency, references)
    options = plan_components(sources, device=args.device, residency=args.residency, chunk_size=args.chunk_size,
                              memory_budget_gb=args.memory_budget, width=request.width, height=request.height,
                              num_frames=request.num_frames, loras=request.loras, keep=args.keep,
                              steps=request.steps, dtype=DTYPES[args.dtype], keyframes=bool(request.anchors),
                              log=say, references=references, step_cache=request.step_cache is not None,
                              guides=request.placed_guides)
    pipeline = H3Pipeline(sources, device=args.device, dtype=DTYPES[args.dtype], component_options=options,
                          log=say, **{f"keep_{name}": name in args.keep for name in COMPONENTS})
    say(f"generating {request.num_frames} frames ({request.seconds:.2f} s) at {request.width}x{request.height}, "
        f"{request.steps - 1} model calls, seed {request.seed}"
        + "".join(f", LoRA {Path(path).name} x{strength:g}" for path, strength in request.loras))
    bar = ProgressBar("sampling")

    def step_report(stats):
        bar.note = f", {stats.hits} of {len(stats.decisions)} steps cached"

    if request.step_cache is not None and request.steps - 1 <= request.step_cache.warmup_steps + 1:
        say(f"note: --step-cache {request.step_cache.name}: {request.steps - 1} model calls and "
            f"{request.step_cache.warmup_steps} warm-up steps leave no call it can skip; it runs every block")
    try:
        result = pipeline.generate(request, progress=bar, step_report=step_report,
                                   preview=preview_writer(args, pipeline.device))
    finally:
        bar.close()
        pipeline.release_all()
    if result.step_cache is not None:
        say(result.step_cache.summary())
    print_audio_warnings(result)
    written = write_outputs(out, result, before, say)
    report = memory_report(torch.device(args.device))
    if report:
        say(report)
    return written


def _what_was_written(outputs: dict) -> str:
    path = outputs.get("path")
    if path is not None and _identity(path) not in (None, outputs.get("before")):
        return f"{path} was written before it stopped"
    if path is not None and outputs.get("before") is not None:
        return f"nothing was written; {path} is unchanged"
    return "nothing was written"


def quantize(args, say=print, outputs: dict | None = None) -> Path:
    """Run `python -m h3_core quantize SRC DST --format F` (errors name the argument as the CLI spells it). As with
    generate's --out, a file already at DST is replaced only by a complete one, and the message says so; `outputs`
    (filled in here) lets an interrupt say that DST is unchanged."""
    from ..checkpoints.quantiser import quantise_checkpoint
    from ..checkpoints.text_encoder_quantiser import quantise_text_encoder

    component = getattr(args, "component", "transformer")
    options = {key: getattr(args, key, None) for key in ("layer", "config")}
    options = {key: value for key, value in options.items() if value is not None}
    if options and component != "text_encoder":
        raise CliError(f"--{next(iter(options))} applies to --component text_encoder only; leave it out for a "
                       "transformer.")
    target = Path(args.target).expanduser()
    before = _identity(target)
    if outputs is not None:
        outputs.update(path=target, before=before)
    try:
        if component == "text_encoder":
            written = quantise_text_encoder(args.source, target, args.format, **options)
        else:
            written = quantise_checkpoint(args.source, target, args.format)
    except H3Error as exc:
        message = re.sub(r"\b(format|layer|config)= ?", r"--\1 ", str(exc))
        for function, flag in (("quantise_checkpoint", "transformer"), ("quantise_text_encoder", "text_encoder")):
            message = message.replace(f"quantise it with {function} instead", f"quantise it with --component {flag}")
        raise CliError(message) from None
    replaced = "; replaced the file that was there" if before is not None else ""
    say(f"wrote {written} ({written.stat().st_size / 2**20:.1f} MiB, {args.format}{replaced})")
    if component == "text_encoder" and written.suffix == ".gguf":
        from ..checkpoints.text_encoder_quantiser import mmproj_path

        vision = mmproj_path(written)
        if vision.is_file():
            say(f"wrote {vision} ({vision.stat().st_size / 2**20:.1f} MiB: the vision tower, beside it)")
    return written


def _on_sigterm(signum, frame):
    raise Terminated


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    outputs: dict = {}
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: leave SIGTERM to whoever runs us
        previous = None
    try:
        if args.command == "generate":
            generate(args, outputs=outputs)
        elif args.command == "quantize":
            quantize(args, outputs=outputs)
        return 0
    except H3Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted; {_what_was_written(outputs)}", file=sys.stderr)
        return 130
    except Terminated:
        print(f"terminated; {_what_was_written(outputs)}", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        # Nothing is left to stop here: a Ctrl-C now would only turn the result above into a traceback.
        with _interrupts_held():
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _interrupts_held():
    """SIGINT ignored inside (in the main thread; elsewhere nothing to hold), then given back its handler."""
    try:
        held = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        held = None
    try:
        yield
    finally:
        if held is not None:
            signal.signal(signal.SIGINT, held)
