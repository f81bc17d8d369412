"""`python -m h3_core generate ... --server URL`: the same request and the same mp4, made by an SGLang diffusion or
vLLM-Omni server (h3_core.remote.RemoteEngine) instead of this machine."""

from __future__ import annotations

import math

from ..errors import H3Error
from .step_cache_flags import step_cache_flags_given

# Flags that configure a local run only, with their defaults: given with --server, they are ignored and said so.
LOCAL_ONLY_FLAGS = (("--model", "model", None), ("--transformer", "transformer", None),
                    ("--residency", "residency", "auto"),
                    ("--chunk-size", "chunk_size", None), ("--memory-budget", "memory_budget", None),
                    ("--keep", "keep", []), ("--device", "device", "cpu"), ("--dtype", "dtype", "auto"),
                    ("--yes-large", "yes_large", False))


def check_remote_flags(args) -> None:
    """What --server cannot take, refused before the other flags are read (a --lora file is not even opened)."""
    from ..remote.videos_client import check_server_url

    check_server_url(args.server, "--server")
    if args.lora:
        raise H3Error("--lora: LoRA files on this machine are not sent to a server; name one already on the "
                      "server with --server-lora PATH[:STRENGTH] (vLLM-Omni), or set it on the server (sglang serve "
                      "--lora-path, or its /v1/set_lora endpoint). Drop --lora, or drop --server to run locally.")
    cache_flags = step_cache_flags_given(args)
    if cache_flags:
        raise H3Error(f"{', '.join(cache_flags)}: a server runs its own step cache (SGLang and vLLM-Omni enable "
                      "Cache-DiT with quality=\"high\", which they accept only on the GPU deployments they audited), "
                      "so ours cannot be applied there. Drop it, or drop --server to run locally.")


def generate_remote(args, request, out, before, say, bar) -> list:
    """`request`: the checked `GenerationRequest`; `bar` is the CLI's progress bar (it hears the server's percent)."""
    from ..remote import RemoteEngine
    from ..remote.videos_client import check_server_url

    url = check_server_url(args.server, "--server")
    ignored = [flag for flag, name, default in LOCAL_ONLY_FLAGS if getattr(args, name) != default]
    if ignored:
        say(f"note: {', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} ignored with --server: the server "
            "runs its own model with its own memory settings")
    timeout = {}
    if args.job_timeout is not None:
        if not math.isfinite(args.job_timeout) or args.job_timeout <= 0:
            raise H3Error(f"--job-timeout {args.job_timeout:g}: must be a number of seconds above 0.")
        timeout = {"job_timeout": args.job_timeout}
    engine = RemoteEngine(url, partition=args.partition, backend=args.backend, log=say, **timeout)
    say(f"server {url}: {engine.describe_server()}")
    say(f"generating {request.num_frames} frames ({request.seconds:.2f} s) at {request.width}x{request.height}, "
        f"{request.steps - 1} model calls, seed {request.seed}, on {url}")
    try:
        result = engine.generate(request, progress=bar, server_lora=args.server_lora)
    finally:
        bar.close()
    from ..request.media_files import write_outputs
    from .audio_warnings import print_audio_warnings

    print_audio_warnings(result)
    return write_outputs(out, result, before, say)
