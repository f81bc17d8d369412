"""H3StreamModelLoader: where the model is (each source shows only its own inputs) and the memory it may use (a
profile planned from the checkpoint headers, or every value by hand). Nothing is loaded here: the pipeline loads each
component when its phase first needs it."""

from __future__ import annotations

import logging

from comfy_api.latest import io

from . import comfy_runtime, model_sources
from .loader_inputs import model_loader_inputs
from .memory_settings import MemorySettings
from .sockets import H3Model, H3ModelHandle

log = logging.getLogger("h3_stream")


class H3StreamModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamModelLoader",
            display_name="H3 Loader",
            category="H3 Stream/loaders",
            description="Points at an H3 model and plans its memory: pick a memory profile (your GPU or Mac, or what "
                        "is free now) and the node shows, before anything loads, which components stream block by "
                        "block and what the weights need; or set every value by hand with custom. Loads nothing "
                        "until a node needs a component.",
            search_aliases=["minimax h3", "load h3", "h3 model", "layerwise offload", "memory profile"],
            inputs=model_loader_inputs(),
            outputs=[H3Model.Output(display_name="h3_model")],
            # The node that shows the preflight and a download's progress; the prompt, to name a value ComfyUI drops.
            hidden=[io.Hidden.unique_id, io.Hidden.prompt],
            # Its UI output (the preflight) is sent again on runs that take the loader from the cache.
            has_intermediate_output=True,
        )

    @classmethod
    def fingerprint_inputs(cls, source=None, **settings):
        chosen = dict(source or {})
        return model_sources.fingerprint(chosen.pop("source", None), **{k: v for k, v in chosen.items()
                                                                         if k != "partition" and k != "repo_id"})

    @classmethod
    def execute(cls, dtype: str, device: str, source: dict | None = None,
                memory_profile: dict | None = None) -> io.NodeOutput:
        from h3_core.errors import H3Error
        from h3_core.planning.memory_profiles import CUSTOM, PROFILES

        node_id = cls.hidden.unique_id
        # ComfyUI validates neither dynamic combo's own value: an unknown one (an API prompt's typo) reaches here as
        # a missing input, so it is named here, from the prompt as queued.
        for name, given, choices in (("source", source, model_sources.SOURCES),
                                     ("memory_profile", memory_profile, [*PROFILES, CUSTOM])):
            if given is None:
                raise H3Error(f"{name} {cls._queued(name)!r} is not one of {list(choices)}; choose one on H3 Loader.")
        chosen = dict(source)
        kind, partition = chosen.pop("source"), chosen.pop("partition", None) or "FL2VA"  # repack: the file decides
        torch_device = comfy_runtime.torch_device(device)
        sources = model_sources.resolve_sources(kind, partition, node_id=node_id,
                                                **{k: v for k, v in chosen.items() if v is not None})
        settings, preflight, details = MemorySettings.from_profile_widgets(memory_profile, sources, dtype=dtype,
                                                                           device=torch_device,
                                                                           free_bytes=comfy_runtime.free_bytes)
        log.info("%s\n%s", preflight, details)
        comfy_runtime.send_progress_text(node_id, preflight)
        # Also its UI output, which ComfyUI sends again while the loader is cached (has_intermediate_output).
        handle = H3ModelHandle.open(sources, settings, torch_device, f"H3 {partition} from {kind}", log.info)
        return io.NodeOutput(handle, ui={"h3_stream_preflight": [preflight]})

    @classmethod
    def _queued(cls, name: str):
        """The value the queued prompt gave this node's input `name` (None when there is none)."""
        node = (cls.hidden.prompt or {}).get(str(cls.hidden.unique_id), {})
        return node.get("inputs", {}).get(name)
