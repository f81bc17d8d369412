"""`python -m h3_core generate ... --server URL`: the same request and the same mp4, made by an SGLang diffusion
server (h3_core.remote.RemoteEngine) instead of this machine."""

from __future__ import annotations

from ..errors import H3Error
from ..request.grid import FPS

# Flags that configure a local run only, with their defaults: given with --server, they are ignored and said so.
LOCAL_ONLY_FLAGS = (("--model", "model", None), ("--residency", "residency", "auto"),
                    ("--chunk-size", "chunk_size", None), ("--memory-budget", "memory_budget", None),
                    ("--keep", "keep", []), ("--device", "device", "cpu"), ("--dtype", "dtype", "auto"),
                    ("--yes-large", "yes_large", False))


def check_remote_flags(args) -> None:
    """What --server cannot take, refused before the other flags are read (a --lora file is not even opened)."""
    from ..remote.videos_client import check_server_url

    check_server_url(args.server, "--server")
    if args.lora:
        raise H3Error("--lora: a remote server applies its own LoRAs (start it with sglang serve --lora-path, or "
                      "use its /v1/set_lora endpoint); LoRA files on this machine are not sent. Drop --lora, or "
                      "drop --server to run locally.")


def generate_remote(args, request: dict, before, say, bar) -> list:
    """`bar` is the CLI's progress bar (it hears the server's percent)."""
    from ..remote import RemoteEngine
    from ..remote.videos_client import check_server_url

    url = check_server_url(args.server, "--server")
    ignored = [flag for flag, name, default in LOCAL_ONLY_FLAGS if getattr(args, name) != default]
    if ignored:
        say(f"note: {', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} ignored with --server: the server "
            "runs its own model with its own memory settings")
    engine = RemoteEngine(url, partition=args.partition, log=say)
    say(f"server {url}: {engine.describe_server()}")
    width, height, num_frames, steps = (request[k] for k in ("width", "height", "num_frames", "steps"))
    say(f"generating {num_frames} frames ({num_frames / FPS:.2f} s) at {width}x{height}, {steps - 1} model calls, "
        f"seed {args.seed}, on {url}")
    try:
        result = engine.generate(args.prompt, width=width, height=height, num_frames=num_frames, steps=steps,
                                 seed=args.seed, first_frame=args.first_frame, last_frame=args.last_frame,
                                 video_shift=request["video_shift"], audio_shift=request["audio_shift"],
                                 progress=bar)
    finally:
        bar.close()
    from ..request.media_files import write_outputs

    return write_outputs(request["out"], result, before, say)
