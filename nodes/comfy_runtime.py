"""Everything the nodes ask of the running ComfyUI: its device, its model management, progress bars, interruption,
websocket messages and its AV latent container. The only module of the pack that imports `comfy.*` or `server`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

import comfy.model_management as model_management
import comfy.nested_tensor
import comfy.utils

DEVICES = ("auto", "cpu", "cuda", "mps")
MEMORY_EVENT = "h3_stream.memory"
log = logging.getLogger("h3_stream")


def torch_device(choice: str) -> torch.device:
    """`auto` is the device ComfyUI itself computes on (so `--cpu` is honoured)."""
    if choice == "auto":
        return torch.device(model_management.get_torch_device())
    return torch.device(choice)


def device_error(choice: str) -> str | None:
    """Why the loader's `device` choice cannot run here (a combo value ComfyUI does not check for the loader, which
    validates it itself), in the widget's words; None when it can. `auto` is ComfyUI's own device."""
    from h3_core.runtime.platform import device_problem

    if choice not in DEVICES:
        return f"device {choice!r} is not one of {list(DEVICES)}."
    if choice == "auto":
        return None
    problem = device_problem(choice)
    return f"device {choice!r}: {problem}; choose auto or cpu." if problem else None


def available_devices() -> list[str]:
    """The device choices this machine can run (auto first): ComfyUI then refuses any other at validation, one
    error on the device input."""
    from h3_core.runtime.platform import device_problem

    candidates = ["cpu", "cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()) if i > 0), "mps"]
    return ["auto", *(choice for choice in candidates if device_problem(choice) is None)]


def free_bytes(device: torch.device) -> int:
    """What ComfyUI says is free on `device` now (host memory for the CPU)."""
    return int(model_management.get_free_memory(device))


def files_bytes(path) -> int:
    """Bytes of the safetensors files of one component (a single file or a folder)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*.safetensors"))
    return 0


def free_memory_for(paths_by_component: dict, settings, device: torch.device) -> None:
    """Ask ComfyUI to unload its own models until the resident components of the next phase fit.

    Offloaded components keep their blocks in host memory, so only resident ones are counted."""
    required = sum(files_bytes(path) for name, path in paths_by_component.items() if not settings.offloaded(name))
    if required > 0:
        model_management.free_memory(required, device)


def av_latent(video: torch.Tensor, audio: torch.Tensor) -> dict:
    """Core's AV `LATENT`: its video and audio streams in one `NestedTensor` (what core's H3 latent nodes make)."""
    return {"samples": comfy.nested_tensor.NestedTensor((video, audio))}


def latent_streams(latent) -> tuple:
    """The tensors of a core `LATENT`: both streams of an AV latent, else its one tensor (or whatever it holds)."""
    samples = latent.get("samples") if isinstance(latent, dict) else latent
    if getattr(samples, "is_nested", False):
        return tuple(samples.unbind())
    return (samples,)


def soft_empty_cache() -> None:
    """Between phases: give cached device blocks back (MPS and CUDA; a no-op in CPU mode)."""
    model_management.soft_empty_cache()


def unload_comfy_models() -> None:
    model_management.unload_all_models()


def check_interrupt() -> None:
    """Raises ComfyUI's InterruptProcessingException when the user pressed Cancel."""
    model_management.throw_exception_if_processing_interrupted()


def progress_bar(total: int, node_id=None):
    return comfy.utils.ProgressBar(total, node_id=node_id)


def _prompt_server():
    try:
        from server import PromptServer
    except ImportError:  # not inside a ComfyUI server
        return None
    return getattr(PromptServer, "instance", None)


def _client_of_the_prompt(instance):
    """The websocket client that queued the running prompt, as ComfyUI addresses its own execution messages; None
    when nobody is to be told (no server, or an API prompt queued without a client_id): never every tab."""
    return getattr(instance, "client_id", None) if instance is not None else None


def send_memory_report(node_id, report: dict, summary: str) -> None:
    """Feed the web extension's memory badge (`MEMORY_EVENT`) and the node's progress text. Headless runs have no
    listener; the summary is logged either way."""
    log.info("h3-stream node %s: %s", node_id, summary)
    instance = _prompt_server()
    client = _client_of_the_prompt(instance)
    if client is not None:
        instance.send_sync(MEMORY_EVENT, {"node": str(node_id), **report}, client)
        if node_id is not None:
            instance.send_progress_text(summary, node_id, client)


def send_progress_text(node_id, text: str) -> None:
    """The text shown under a node (every frontend renderer shows it); logged for headless runs."""
    log.info("h3-stream node %s: %s", node_id, text)
    instance = _prompt_server()
    client = _client_of_the_prompt(instance)
    if client is not None and node_id is not None:
        instance.send_progress_text(text, node_id, client)
