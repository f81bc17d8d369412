"""The CLI's long videos (`--seconds` beyond 15), prompt schedules (`--prompt-schedule`) and extensions
(`--extend clip.mp4`): the flags checked in their own words, the windows announced, the preflight per window with
the total time, then `pipeline.long_video.generate_long_video` writing one mp4."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

from ..errors import H3Error
from ..request.grid import FPS, MAX_FRAMES, MAX_SECONDS, align_num_frames
from ..request.windows import (MAX_LONG_SECONDS, OVERLAP_FRAMES, extension_frame_count, long_frame_count,
                               parse_prompt_schedule, plan_windows)


def is_long_run(args) -> bool:
    """A run of windows: past 15 s, an extension, or a prompt schedule."""
    return (getattr(args, "extend", None) is not None or getattr(args, "prompt_schedule", None) is not None
            or (args.seconds is not None and args.seconds > MAX_SECONDS)
            or (args.frames is not None and args.frames > MAX_FRAMES))


def long_run_frames(args, defaults, say, cli) -> int:
    """The frames to make: the whole video's (17n + 5), or with --extend the new frames after the clip (17k)."""
    if args.frames is not None and args.seconds is not None:
        raise cli.CliError("give --seconds or --frames, not both.")
    try:
        if args.extend is not None:
            if args.frames is not None:
                if args.frames < 1:
                    raise H3Error(f"--frames {args.frames}: must be at least 1.")
                frames = extension_frame_count(args.frames / FPS, "--frames")
                if frames != args.frames:
                    say(f"note: --frames {args.frames}: an extension adds a multiple of 17 frames; making {frames}.")
                return frames
            seconds = args.seconds if args.seconds is not None else defaults["seconds"]
            return extension_frame_count(seconds, "--seconds")
        if args.frames is not None:
            if args.frames < 1 or args.frames > MAX_LONG_SECONDS * FPS:
                raise H3Error(f"--frames {args.frames}: must be at least 1 and at most {int(MAX_LONG_SECONDS * FPS)} "
                              f"({MAX_LONG_SECONDS:g} s).")
            frames = align_num_frames(args.frames)
            if frames != args.frames:
                say(f"note: {args.frames} frames is off the 17n+5 grid the video VAE needs; rounding up to {frames}.")
            return frames
        seconds = args.seconds if args.seconds is not None else defaults["seconds"]
        return long_frame_count(seconds, "--seconds")
    except H3Error as exc:
        raise cli.CliError(str(exc)) from None


def check_long_arguments(args, say, cli):
    """(the template request, the frames to make, the clip to extend or None, the prompt schedule or None), every
    check done before any model loads."""
    if args.server:
        raise cli.CliError(f"{'--extend' if args.extend is not None else '--seconds / --prompt-schedule'}: a long video "
                         "or an extension is made window by window on this machine; a --server job makes one clip of "
                         "4 to 15 s. Drop --server, or ask for at most 15 s.")
    from ..request.media_files import have_pyav

    if not have_pyav():
        raise cli.CliError("a long video, a prompt schedule or --extend is written as one mp4 through PyAV, window by "
                           "window: pip install 'h3-stream[video]' (or pip install av).")
    defaults = cli.TINY_DEFAULTS if args.model is None else cli.MODEL_DEFAULTS
    frames = long_run_frames(args, defaults, say, cli)
    clip = None
    if args.extend is not None:
        if args.first_frame is not None or args.last_frame is not None:
            raise cli.CliError("--first-frame / --last-frame: with --extend the clip's last frames start the new part; "
                             "drop them.")
        from ..request.streamed_mp4 import ClipToExtend

        try:
            clip = ClipToExtend.read(args.extend, OVERLAP_FRAMES, "--extend")
        except H3Error as exc:
            raise cli.CliError(str(exc)) from None
        if args.size is not None and args.size.lower() != f"{clip.width}x{clip.height}":
            raise cli.CliError(f"--size {args.size}: an extension continues the clip at its own canvas, "
                             f"{clip.width}x{clip.height}; drop --size.")
        if not clip.has_audio:
            say(f"note: --extend {args.extend}: the clip has no audio track, so the new part is guided by its frames "
                "alone and the result's soundtrack is silent under the clip")
    # The request every window is made from (checked by the one-window rules: canvas, steps, seed, LoRAs, ...).
    template = copy.copy(args)
    template.seconds, template.frames = None, MAX_FRAMES
    if clip is not None:
        template.size = f"{clip.width}x{clip.height}"
    request = cli.check_arguments(template, say)
    request = request.replace(names=dataclasses.replace(request.names, num_frames="--seconds"))
    seconds = frames / FPS
    schedule = None
    if args.prompt_schedule is not None:
        try:
            schedule = parse_prompt_schedule(args.prompt_schedule, seconds, "--prompt-schedule")
        except H3Error as exc:
            raise cli.CliError(str(exc)) from None
        if args.prompt:
            say("note: --prompt-schedule gives every window its prompt; the positional prompt is not used")
    return request, frames, clip, schedule


def describe_windows(windows, frames: int, clip) -> str:
    lengths = sorted({w.num_frames for w in windows})
    lengths_text = " or ".join(f"{n} frames ({n / FPS:.1f} s)" for n in lengths)
    if clip is not None:
        return (f"extending {clip.path.name} ({clip.num_frames} frames, {clip.num_frames / FPS:.2f} s) by {frames} "
                f"frames ({frames / FPS:.2f} s) in {len(windows)} window{'s' * (len(windows) > 1)} of {lengths_text}"
                f"; each is guided by the {OVERLAP_FRAMES} frames before it and their soundtrack; the clip's frames "
                "are copied unchanged")
    if len(windows) == 1:
        return f"making {frames} frames ({frames / FPS:.2f} s) in one window"
    return (f"making {frames} frames ({frames / FPS:.2f} s, on the 17n+5 grid) in {len(windows)} windows of "
            f"{lengths_text}: H3 makes at most {MAX_SECONDS:g} s at a time, so each window after the first is guided "
            f"by the previous window's last {OVERLAP_FRAMES} frames and their soundtrack, cross-faded with them")


def generate_long(args, say, outputs: dict | None, cli):
    """`python -m h3_core generate` for a long video, a prompt schedule or an extension. `cli` is the CLI's module
    (its checks and errors, shared with a one-window run; passed in, as it imports this one)."""
    import torch

    from ..components import COMPONENTS
    from ..pipeline.long_video import generate_long_video, planned_guides
    from ..pipeline.pipeline import H3Pipeline
    from ..planning.phase_plans import plan_components
    from ..planning.request_estimate import describe_windowed_estimate
    from ..settings import DTYPES
    from ..sources.model_sources import canvas_rules
    from .audio_warnings import print_audio_warnings
    from .progress import ProgressBar, memory_report

    request, frames, clip, schedule = check_long_arguments(args, say, cli)
    windows = plan_windows(frames, guided_first=clip is not None)
    say(describe_windows(windows, frames, clip))
    if schedule is not None:
        starts = [max(0, w.start + w.overlap) / FPS for w in windows]
        used = {max(i for i, (at, _) in enumerate(schedule.entries) if at <= start + 1e-9) for start in starts}
        for i, (at, _) in enumerate(schedule.entries):
            if i not in used:
                say(f"note: --prompt-schedule: the prompt at {at:g} s starts no window (the windows' new frames start "
                    f"at {', '.join(f'{t:.2f}' for t in starts)} s), so it is not used")
    out = Path(args.out).expanduser()
    before = cli._identity(out)
    if outputs is not None:
        outputs.update(path=out, before=before)
    sources = cli.model_sources(args, say)
    residency = None if args.residency == "auto" else args.residency
    # Every window is an ordinary request: the memory plan and the large-request check are the longest window's.
    longest = request.replace(num_frames=max(w.num_frames for w in windows))
    references = longest.normalised_references(canvas_rules(sources))
    cli.check_large_request(args, sources, longest, residency, references)
    guides = planned_guides(request, windows)
    say(describe_windowed_estimate(sources, windows, device=args.device, width=request.width,
                                   height=request.height, steps=request.steps, dtype=DTYPES[args.dtype],
                                   chunk_size=args.chunk_size, loras=request.loras, keep=args.keep,
                                   residency=residency, references=references, keyframes=bool(request.anchors),
                                   step_cache=request.step_cache is not None, guides=guides))
    options = plan_components(sources, device=args.device, residency=args.residency, chunk_size=args.chunk_size,
                              memory_budget_gb=args.memory_budget, width=request.width, height=request.height,
                              num_frames=longest.num_frames, loras=request.loras, keep=args.keep,
                              steps=request.steps, dtype=DTYPES[args.dtype], keyframes=bool(request.anchors),
                              log=say, references=references, step_cache=request.step_cache is not None,
                              guides=guides)
    pipeline = H3Pipeline(sources, device=args.device, dtype=DTYPES[args.dtype], component_options=options,
                          log=say, **{f"keep_{name}": name in args.keep for name in COMPONENTS})
    bars: list = []

    def on_window(window, count):
        if bars:
            bars[-1].close()
        bars.append(ProgressBar(f"window {window.index + 1}/{count} sampling"))

    def progress(done, total):
        bars[-1](done, total)

    try:
        result = generate_long_video(pipeline, request, out, total_frames=None if clip else frames, extend=clip,
                                     new_frames=frames if clip else None, schedule=schedule,
                                     progress=progress, on_window=on_window)
    except H3Error as exc:
        raise cli.CliError(str(exc)) from None
    finally:
        if bars:
            bars[-1].close()
        pipeline.release_all()
    print_audio_warnings(result)
    replaced = " (replaced the file that was there)" if before is not None else ""
    say(f"wrote {result.path}{replaced}: {result.num_frames} frames ({result.seconds:.2f} s) at 24 fps with 32 kHz "
        f"stereo audio, {len(result.windows)} window{'s' * (len(result.windows) > 1)}")
    say(", ".join(f"{k} {v:.1f} s" for k, v in result.timings.items()))
    report = memory_report(torch.device(args.device))
    if report:
        say(report)
    return [result.path]
