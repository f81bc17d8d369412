"""H3StreamLoRA: adds one LoRA (file from ComfyUI's `loras` folders, strength) to the H3 model it passes on. Chainable;
nothing is loaded or changed here: the sampler makes the transformer's LoRA set equal to the handle's."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import folder_paths
from comfy_api.latest import io, ui

from h3_core.errors import CheckpointError

from . import comfy_runtime
from .model_sources import is_inside
from .sockets import H3Model

# The key naming of LoRAs trained on H3 itself (`read_lora(...).format`): nothing converted, nothing to say.
NATIVE_FORMAT = "original module names"

LORAS = "loras"


def lora_choices() -> list[str]:
    return [name for name in folder_paths.get_filename_list(LORAS) if name.endswith((".safetensors", ".sft"))]


def lora_path(name: str) -> Path:
    """The file of a `lora_name` choice; never one outside the configured `loras` folders."""
    roots, found = folder_paths.get_folder_paths(LORAS), None
    if name and not os.path.isabs(name) and ".." not in Path(name).parts:
        try:
            found = folder_paths.get_full_path_or_raise(LORAS, name)
        except FileNotFoundError:
            pass
    if found is None or not any(is_inside(found, root) for root in roots):
        raise CheckpointError(f"lora_name: {name!r} is not in ComfyUI's '{LORAS}' folders {roots}; refresh the node "
                              "and pick a file that exists.", path=name)
    return Path(found)


class H3StreamLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="H3StreamLoRA",
            display_name="H3 LoRA Loader",
            category="H3 Stream/loaders",
            description="Adds a LoRA to the H3 transformer with a strength; chain several. Nothing reloads: the "
                        "sampler applies the set. Steps and shifts the LoRA recommends are shown here, not set.",
            search_aliases=["h3 lora", "turbo lora", "lora loader"],
            inputs=[
                H3Model.Input("h3_model"),
                io.Combo.Input("lora_name", options=lora_choices(),
                               tooltip="A LoRA file from ComfyUI's models/loras folders (safetensors)."),
                io.Float.Input("strength", default=1.0, min=-4.0, max=4.0, step=0.05,
                               tooltip="Scale of the LoRA's update; 0 leaves the model as it is."),
            ],
            outputs=[H3Model.Output(display_name="h3_model")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def fingerprint_inputs(cls, lora_name=None, **inputs):
        try:
            stat = lora_path(lora_name).stat()
        except (OSError, ValueError):
            return None
        return stat.st_size, stat.st_mtime_ns  # a changed file on disk runs the node again

    @classmethod
    def execute(cls, h3_model, lora_name, strength) -> io.NodeOutput:
        from h3_core import read_lora

        path = lora_path(lora_name)
        lora = read_lora(path)  # a bad file fails here, naming its key, before anything samples
        handle = dataclasses.replace(h3_model, loras=(*h3_model.loras, (path, float(strength))),
                                     description=f"{h3_model.description} + LoRA {lora_name} x{strength:g}")
        # The file's key naming matters only when it is not the model's own (then it was converted).
        converted = "" if lora.format == NATIVE_FORMAT else f", converted from {lora.format} names"
        text = f"LoRA {lora_name} at strength {strength:g}{converted}"
        if lora.recommended:
            text += "; recommends " + ", ".join(f"{key} {value:g}" for key, value in lora.recommended.items()) + \
                " (set them on the sampler)"
        comfy_runtime.send_progress_text(cls.hidden.unique_id, text)
        return io.NodeOutput(handle, ui=ui.PreviewText(text))
