"""Everything the nodes ask of the running ComfyUI: its device, its model management, progress bars, interruption,
websocket messages and its AV latent container. The only module of the pack that imports `comfy.*` or `server`.
"""

from __future__ import annotations

import logging
import weakref

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


def free_memory_for(handle, phases, plan) -> None:
    """Before a node runs `phases` (names of `plan`'s phases, one after the other): ask ComfyUI to unload its own
    models until what those phases really allocate on the device fits (the pipeline's `room_needed`: weights on
    the device, slots, the AdaLN slot, activations, from the request's memory plan), keeping the H3 components the
    phases run."""
    pipeline = handle.pipeline
    required = pipeline.room_needed(plan, phases)
    if required > 0:
        runs = dict(pipeline.PHASES + pipeline.REFERENCE_PHASES)
        keep = _registry(pipeline).entries(runs[name] for name in phases)
        model_management.free_memory(required, comfy_device(pipeline.device), keep_loaded=keep)


def comfy_device(device: torch.device) -> torch.device:
    """`device` as ComfyUI's model management names it (`cuda` is ComfyUI's `cuda:0` when that is its device), so
    that its per-device unloads find the H3 components."""
    from h3_core.runtime.platform import Platform

    from h3_core.errors import H3Error

    device = torch.device(device)
    own = torch.device(model_management.get_torch_device())
    try:
        same_kind = Platform.for_device(own).is_kind_of(device)
    except H3Error:  # ComfyUI computes on a device h3-stream does not run on (xpu, npu, ...)
        same_kind = False
    return own if device.index is None and same_kind else device


# ---- the H3 components in ComfyUI's model management -----------------------------------------------------------


class H3ComponentPatcher:
    """What ComfyUI's model management reads from a loaded model (`LoadedModel.model`, normally a ModelPatcher), for
    one H3 component of one pipeline. It holds the pipeline weakly: a model handle ComfyUI's cache drops is freed.
    `model` is the component while it is loaded (None after)."""

    parent = None  # no clone hierarchy
    is_multigpu_base_clone = False

    def __init__(self, pipeline, name: str, device: torch.device):
        import uuid

        self._pipeline = weakref.ref(pipeline)
        self.name = name
        self.load_device = device
        self.offload_device = torch.device("cpu")
        self.clone_base_uuid = uuid.uuid4()

    @property
    def pipeline(self):
        return self._pipeline()

    @property
    def model(self):
        pipeline = self._pipeline()
        return None if pipeline is None else pipeline.loaded_component(self.name)

    def is_dynamic(self) -> bool:
        return False  # ComfyUI's dynamic (aimdo) weight loading is not ours: never asked to evict pins one by one

    def is_clone(self, other) -> bool:
        return other is self

    def model_patches_models(self) -> list:
        return []

    def __repr__(self) -> str:
        return f"H3 {self.name} on {self.load_device}"


class H3LoadedComponent:
    """One loaded H3 component as an entry of ComfyUI's `current_loaded_models`: the calls ComfyUI's `free_memory`,
    `unload_all_models`, `cleanup_models` and `loaded_models` make on a `LoadedModel`. Its size is what the
    component holds on ComfyUI's device (for a CPU run, host memory), measured when it loads and after each phase;
    unloading it releases the component in the pipeline (weights, slots, host stores, pinned buffers), which loads
    it again when a node next needs it. Never `currently_used`: ComfyUI's own loaders never reload it."""

    def __init__(self, patcher: H3ComponentPatcher, nbytes: int):
        self._patcher = patcher
        self.device = patcher.load_device
        self.nbytes = int(nbytes)
        self.currently_used = False
        self.model_finalizer = None
        self.unloading = False

    @property
    def model(self) -> H3ComponentPatcher:
        return self._patcher

    def real_model(self):
        """The pipeline (None once it is gone: ComfyUI's `cleanup_models` then drops the entry)."""
        return self._patcher.pipeline

    def model_memory(self) -> int:
        return self.nbytes

    def model_loaded_memory(self) -> int:
        return self.nbytes

    def model_offloaded_memory(self) -> int:
        return 0

    def model_memory_required(self, device) -> int:
        return 0 if device == self.device else self.nbytes

    def model_load(self, lowvram_model_memory=0, force_patch_weights=False):
        return self._patcher.model  # never partially loaded: the pipeline loads it when a node needs it

    def model_use_more_vram(self, extra_memory, force_patch_weights=False) -> int:
        return 0

    def should_reload_model(self, force_patch_weights=False) -> bool:
        return False

    def model_unload(self, memory_to_free=None, unpatch_weights=True) -> bool:
        """Release the whole component (partial unloads are not offered); True when it is gone, False when its
        pipeline is running on another thread (ComfyUI then keeps the entry)."""
        pipeline = self._patcher.pipeline
        if pipeline is None:
            return True
        self.unloading = True  # ComfyUI pops this entry itself when True is returned
        try:
            released = pipeline.try_release(self._patcher.name)
        finally:
            self.unloading = False
        if released:
            from h3_core.runtime.platform import Platform

            Platform.for_device(pipeline.device).trim_host_heap()  # CPU: the freed weights go back to the system
            log.info("h3-stream: ComfyUI unloaded %s (%.1f MiB)", self._patcher, self.nbytes / 2**20)
        return released

    def is_dead(self) -> bool:
        return False

    def __eq__(self, other) -> bool:
        return other is self

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<H3LoadedComponent {self._patcher}, {self.nbytes / 2**20:.1f} MiB>"


class _Registry:
    """The entries of one pipeline's loaded components in ComfyUI's `current_loaded_models`, following the pipeline
    (its load / release listener): added when a component loads, removed when the pipeline releases it (or when
    ComfyUI unloads it, by ComfyUI), dropped with the pipeline."""

    def __init__(self, pipeline):
        self.device = comfy_device(pipeline.device)
        self._pipeline = weakref.ref(pipeline)
        self._entries: dict[str, H3LoadedComponent] = {}
        pipeline.add_listener(self._changed)
        weakref.finalize(pipeline, _forget_entries, self._entries).atexit = False

    def _changed(self, name: str, loaded: bool) -> None:
        pipeline = self._pipeline()
        if loaded and pipeline is not None:
            entry = H3LoadedComponent(H3ComponentPatcher(pipeline, name, self.device), self._bytes(pipeline, name))
            self._entries[name] = entry
            model_management.current_loaded_models.insert(0, entry)
            return
        entry = self._entries.pop(name, None)
        if entry is not None and not entry.unloading:
            _remove(entry)

    @staticmethod
    def _bytes(pipeline, name: str) -> int:
        """What the component holds on ComfyUI's device (the CPU: all of it, host memory is the device's)."""
        held = pipeline.held_memory(name)
        return 0 if held is None else held.device_bytes

    def refresh(self) -> None:
        """Measure the loaded components again (after a phase: slots and rings are allocated during the first
        pass)."""
        pipeline = self._pipeline()
        if pipeline is None:
            return
        for name, entry in list(self._entries.items()):
            entry.nbytes = self._bytes(pipeline, name)

    def entries(self, names=None) -> list[H3LoadedComponent]:
        wanted = set(self._entries) if names is None else set(names)
        return [entry for name, entry in self._entries.items() if name in wanted]


def _remove(entry) -> None:
    loaded = model_management.current_loaded_models
    for i in range(len(loaded) - 1, -1, -1):
        if loaded[i] is entry:
            loaded.pop(i)


def _forget_entries(entries: dict) -> None:
    for entry in list(entries.values()):
        _remove(entry)
    entries.clear()


_REGISTRIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _registry(pipeline) -> _Registry:
    registry = _REGISTRIES.get(pipeline)
    if registry is None:
        registry = _REGISTRIES[pipeline] = _Registry(pipeline)
    return registry


def register_pipeline(pipeline) -> None:
    """Make ComfyUI's model management know the pipeline's components (see `H3LoadedComponent`) and share the
    process's pin budget with ComfyUI's pinned memory. Idempotent."""
    _registry(pipeline)
    share_pin_budget()


def refresh_registered(pipeline) -> None:
    _registry(pipeline).refresh()


def registered(pipeline) -> list:
    """The pipeline's entries in ComfyUI's model management now (for reports and tests)."""
    return _registry(pipeline).entries()


class ComfyPinLedger:
    """ComfyUI's pinned-memory ledger as h3_core's `PinLedger`: its limit (`MAX_PINNED_MEMORY`, <= 0 when pinned
    memory is off: `--disable-pinned-memory`, or a device ComfyUI does not pin for) and its count of pinned bytes
    (`TOTAL_PINNED_MEMORY`), to which the pack's own pins are added, so that ComfyUI's pins and ours stay within
    ComfyUI's one limit and each side sees the other's."""

    def limit_bytes(self) -> int:
        return int(getattr(model_management, "MAX_PINNED_MEMORY", 0))

    def pinned_bytes(self) -> int:
        return int(getattr(model_management, "TOTAL_PINNED_MEMORY", 0))

    def add(self, nbytes: int) -> None:
        model_management.TOTAL_PINNED_MEMORY = max(0, self.pinned_bytes() + int(nbytes))


def share_pin_budget() -> None:
    """h3_core's one pin budget (40 % of RAM) also within ComfyUI's pinned-memory limit, counted in ComfyUI's total
    (only where this ComfyUI keeps such a ledger)."""
    from h3_core.runtime.host_store import PinBudget

    if not hasattr(model_management, "TOTAL_PINNED_MEMORY") or not hasattr(model_management, "MAX_PINNED_MEMORY"):
        return
    budget = PinBudget.shared()
    if not isinstance(budget.ledger, ComfyPinLedger):
        budget.share_with(ComfyPinLedger())


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


# ---- live previews --------------------------------------------------------------------------------------------------

# Core's rule for a tiny decoder in models/vae_approx (latent_preview.get_previewer): the first file whose name starts
# with the latent format's decoder name. H3's is taeh3 (madebyollin/taehv's name; core's MiniMaxH3Video names none).
TAEH3_NAME = "taeh3"
_SAID_ONCE: set = set()


def preview_method() -> str:
    """The preview method of this run: `none`, `latent2rgb` or `taesd`, as ComfyUI has it now (its --preview-method,
    or the frontend's per-prompt choice, which ComfyUI's executor puts in the same setting for the prompt it runs).
    `auto` is latent2rgb, as in core."""
    from comfy.cli_args import args

    method = getattr(args.preview_method, "value", args.preview_method)
    return "latent2rgb" if method == "auto" else str(method)


def preview_size() -> int:
    """The long side ComfyUI shows previews at (--preview-size)."""
    from comfy.cli_args import args

    return int(getattr(args, "preview_size", 512))


def taeh3_file() -> tuple[str | None, str | None]:
    """(the TAEH3 `.safetensors` in models/vae_approx, else None; the name of a `taeh3*` pickle found there
    instead, else None)."""
    import folder_paths

    names = [name for name in folder_paths.get_filename_list("vae_approx")
             if name.rsplit("/", 1)[-1].startswith(TAEH3_NAME)]
    safetensors = next((name for name in names if name.lower().endswith((".safetensors", ".sft"))), None)
    if safetensors is not None:
        return folder_paths.get_full_path("vae_approx", safetensors), None
    return None, (names[0] if names else None)


def _say(node_id, text: str, *, key: str) -> None:
    """A preview notice: on the node's text each run, in the log once per process."""
    if key not in _SAID_ONCE:
        _SAID_ONCE.add(key)
        log.warning("h3-stream: %s", text)
    instance = _prompt_server()
    client = _client_of_the_prompt(instance)
    if client is not None and node_id is not None:
        instance.send_progress_text(text, node_id, client)


def step_previewer(device, node_id=None):
    """The previewer the user's preview method asks for (None: `none`): `taesd` is the TAEH3 decoder when its file is
    in models/vae_approx, else (said once) latent2rgb, as core falls back."""
    from h3_core.errors import H3Error
    from h3_core.pipeline.preview import Latent2RGBPreviewer, taeh3_previewer

    method = preview_method()
    if method == "none":
        return None
    if method == "taesd":
        path, pickle = taeh3_file()
        if path is not None:
            try:
                return taeh3_previewer(path, device=device, max_size=preview_size())
            except (H3Error, OSError) as error:
                _say(node_id, f"TAEH3 previews off, latent2rgb instead: {error}", key=f"bad {path}")
        elif pickle is not None:
            _say(node_id, f"TAEH3 previews off, latent2rgb instead: models/vae_approx/{pickle} is a pickle; "
                          "h3-stream reads taeh3.safetensors only (madebyollin/taehv, its safetensors/ folder).",
                 key=f"pickle {pickle}")
        else:
            _say(node_id, f"TAEH3 previews need models/vae_approx/{TAEH3_NAME}.safetensors (madebyollin/taehv); "
                          "none found, so the previews are latent2rgb.", key="no taeh3")
    return Latent2RGBPreviewer()


def preview_image(rgb: torch.Tensor) -> tuple:
    """A uint8 `[H, W, 3]` picture as ComfyUI's progress hook takes a preview: `("JPEG", PIL image, max size)`."""
    from PIL import Image

    return ("JPEG", Image.fromarray(rgb.numpy()), preview_size())


class SamplerProgress:
    """A sampler's progress bar with each step's preview (when the user's preview method asks for one): the image
    rendered from the step's x0 estimate goes out with that step's progress, through ComfyUI's own progress hook,
    which sends it to the client that queued the prompt only (with the node id where the client asked for preview
    metadata)."""

    def __init__(self, total: int, node_id, device):
        self.bar = progress_bar(total, node_id=node_id)
        self.node_id = node_id
        self.previewer = step_previewer(device, node_id)
        self._image = None

    @property
    def preview(self):
        """The pipeline's `preview` callback (None when previews are off: nothing is computed for them)."""
        return None if self.previewer is None else self._render

    def _render(self, estimate) -> None:
        if self.previewer is None:  # turned off by a failure earlier in this run
            return
        try:
            self._image = preview_image(self.previewer.render(estimate))
        except RuntimeError as error:  # e.g. the device out of memory for the TAEH3 decode: the run goes on
            _say(self.node_id, f"previews off for the rest of this run: {self.previewer.method} failed at step "
                               f"{estimate.step} ({str(error).splitlines()[0][:200]})", key=f"failed {error}")
            self.previewer = None

    def progress(self, step: int, total: int) -> None:
        image, self._image = self._image, None
        self.bar.update_absolute(step, total, image)


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


# ---- video files ----------------------------------------------------------------------------------------------------


def temp_video_path(prefix: str):
    """A new .mp4 path in ComfyUI's temp folder (emptied when ComfyUI starts): long videos are written there and
    handed on as a file-backed VIDEO."""
    import os
    import uuid
    from pathlib import Path

    import folder_paths

    folder = Path(folder_paths.get_temp_directory())
    os.makedirs(folder, exist_ok=True)
    return folder / f"{prefix}_{uuid.uuid4().hex[:12]}.mp4"


def video_file(video):
    """A core VIDEO as a file on disk: a file-backed one as it is (its packets are then copied bitwise), any other
    (from IMAGE frames, or in memory) saved once into the temp folder as Save Video would."""
    source = getattr(video, "get_stream_source", lambda: None)()
    trim = getattr(video, "get_active_trim_window", lambda: (0.0, 0.0))()
    if isinstance(source, str) and not any(trim):  # a trimmed one is saved: its file holds more than the VIDEO
        return source
    path = temp_video_path("h3_extend_source")
    video.save_to(str(path))
    return str(path)


def video_from_file(path):
    """Core's VIDEO backed by the file at `path` (Save Video copies its packets; nothing is decoded into memory)."""
    from comfy_api.latest import InputImpl

    return InputImpl.VideoFromFile(str(path))
