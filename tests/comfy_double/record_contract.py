"""Record the contract the test double is held to, from a real ComfyUI (not run by the tests).

    cd <ComfyUI> && <ComfyUI venv>/bin/python <pack>/tests/comfy_double/record_contract.py signatures
        -> contract/signatures.json: parameters (names, kinds, defaults) of every ComfyUI callable the pack and the
           double's core nodes use.
    <ComfyUI venv>/bin/python record_contract.py object_info http://127.0.0.1:8188
        -> contract/object_info.json: `/object_info` of the pack's nodes and of the core nodes the example workflows
           use, from a server that has the pack installed.
"""

from __future__ import annotations

import inspect
import json
import sys
import urllib.request
from pathlib import Path

CONTRACT = Path(__file__).resolve().parent / "contract"
PACK_NODES = ["H3StreamLoader", "H3StreamTextEncode", "H3StreamSampler", "H3StreamDecodeVideo",
              "H3StreamDecodeAudio", "H3StreamMemoryReport", "H3StreamUnload", "H3StreamLoRA",
              "H3StreamLatentToCore", "H3StreamLatentFromCore", "H3StreamModelLoader", "H3StreamGenerateRemote",
              "H3StreamReferences", "H3StreamEncodePrompt", "H3StreamAVSampler", "H3StreamReferenceMedia",
              "H3StreamGuide", "H3StreamLongVideo", "H3StreamExtend"]
CORE_NODES = ["EmptyImage", "CreateVideo", "SaveVideo", "SaveAudio", "SaveAudioAdvanced", "EmptyMiniMaxH3LatentAV",
              "LTXVSeparateAVLatent", "LTXVConcatAVLatent"]
# (module, dotted attribute) of every callable whose signature the double must share.
CALLABLES = [
    ("comfy_api.latest", "ComfyExtension.on_load"),
    ("comfy_api.latest", "ComfyExtension.get_node_list"),
    ("comfy_api.latest._io", "Custom"),
    ("comfy_api.latest._io", "Schema"),
    ("comfy_api.latest._io", "NodeOutput.__init__"),
    ("comfy_api.latest._io", "ComfyNode.define_schema"),
    ("comfy_api.latest._io", "ComfyNode.execute"),
    ("comfy_api.latest._io", "ComfyNode.validate_inputs"),
    ("comfy_api.latest._io", "ComfyNode.fingerprint_inputs"),
    ("comfy_api.latest._io", "Input.__init__"),
    ("comfy_api.latest._io", "WidgetInput.__init__"),
    ("comfy_api.latest._io", "Output.__init__"),
    ("comfy_api.latest._io", "Boolean.Input.__init__"),
    ("comfy_api.latest._io", "Int.Input.__init__"),
    ("comfy_api.latest._io", "Float.Input.__init__"),
    ("comfy_api.latest._io", "String.Input.__init__"),
    ("comfy_api.latest._io", "Combo.Input.__init__"),
    ("comfy_api.latest._io", "DynamicCombo.Input.__init__"),
    ("comfy_api.latest._io", "DynamicCombo.Option.__init__"),
    ("comfy_api.latest._io", "Image.Input.__init__"),
    ("comfy_api.latest._io", "Image.Output.__init__"),
    ("comfy_api.latest._io", "Audio.Input.__init__"),
    ("comfy_api.latest._io", "Audio.Output.__init__"),
    ("comfy_api.latest._io", "Video.Input.__init__"),
    ("comfy_api.latest._io", "Video.Output.__init__"),
    ("comfy_api.latest._io", "AnyType.Input.__init__"),
    ("comfy_api.latest._io", "Latent.Input.__init__"),
    ("comfy_api.latest._io", "Latent.Output.__init__"),
    ("comfy_api.latest._io", "String.Output.__init__"),
    ("comfy_api.latest._io", "Float.Output.__init__"),
    ("comfy_api.latest._ui", "PreviewText.__init__"),
    ("comfy.nested_tensor", "NestedTensor.__init__"),
    ("comfy.nested_tensor", "NestedTensor.unbind"),
    ("comfy.utils", "ProgressBar.__init__"),
    ("comfy.utils", "ProgressBar.update_absolute"),
    ("comfy.utils", "ProgressBar.update"),
    ("comfy.cli_args", "LatentPreviewMethod.from_string"),
    ("comfy.model_management", "get_torch_device"),
    ("comfy.model_management", "free_memory"),
    ("comfy.model_management", "get_free_memory"),
    ("comfy.model_management", "soft_empty_cache"),
    ("comfy.model_management", "unload_all_models"),
    ("comfy.model_management", "throw_exception_if_processing_interrupted"),
    ("comfy.model_management", "interrupt_current_processing"),
    ("comfy.model_management", "processing_interrupted"),
    ("comfy.model_management", "loaded_models"),
    ("comfy.model_management", "cleanup_models"),
    # What ComfyUI's model management calls on an entry of `current_loaded_models` (the pack's H3LoadedComponent).
    ("comfy.model_management", "LoadedModel.model_memory"),
    ("comfy.model_management", "LoadedModel.model_loaded_memory"),
    ("comfy.model_management", "LoadedModel.model_offloaded_memory"),
    ("comfy.model_management", "LoadedModel.model_memory_required"),
    ("comfy.model_management", "LoadedModel.model_load"),
    ("comfy.model_management", "LoadedModel.model_unload"),
    ("comfy.model_management", "LoadedModel.model_use_more_vram"),
    ("comfy.model_management", "LoadedModel.should_reload_model"),
    ("comfy.model_management", "LoadedModel.is_dead"),
    ("folder_paths", "add_model_folder_path"),
    ("folder_paths", "get_folder_paths"),
    ("folder_paths", "get_filename_list"),
    ("folder_paths", "get_full_path"),
    ("folder_paths", "get_full_path_or_raise"),
    ("folder_paths", "get_output_directory"),
    ("folder_paths", "get_user_directory"),
    ("folder_paths", "get_temp_directory"),
    ("comfy_api.latest", "InputImpl.VideoFromFile.__init__"),
    ("server", "PromptServer.send_sync"),
    ("server", "PromptServer.send_progress_text"),
]
# Module-level values and classes that must exist with these properties.
VALUES = [("comfy.model_management", "InterruptProcessingException"), ("folder_paths", "models_dir"),
          ("comfy.cli_args", "LatentPreviewMethod"), ("comfy.cli_args", "args"),
          ("comfy.cli_args", "args.preview_method"), ("comfy.cli_args", "args.preview_size"),
          ("comfy_api.latest._io", "Hidden"), ("comfy.model_management", "current_loaded_models"),
          ("comfy.model_management", "TOTAL_PINNED_MEMORY"), ("comfy.model_management", "MAX_PINNED_MEMORY")]


def describe(function) -> list:
    """Parameters as [name, kind, default-or-None, has-default]; annotations are left out."""
    parameters = []
    for parameter in inspect.signature(function).parameters.values():
        has_default = parameter.default is not inspect.Parameter.empty
        default = parameter.default if has_default else None
        if has_default and not isinstance(default, (str, int, float, bool, type(None))):
            default = repr(default)
        parameters.append([parameter.name, parameter.kind.name, default, has_default])
    return parameters


def resolve(module_name: str, dotted: str):
    import importlib

    value = importlib.import_module(module_name)
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def record_signatures() -> dict:
    sys.path.insert(0, str(Path.cwd()))
    import comfy.options

    # Importing comfy.model_management picks a device; parse `--cpu` first as main.py would.
    comfy.options.enable_args_parsing()
    sys.argv = [sys.argv[0], "--cpu"]
    data = {"callables": {}, "values": {}}
    for module_name, dotted in CALLABLES:
        data["callables"][f"{module_name}:{dotted}"] = describe(resolve(module_name, dotted))
    for module_name, dotted in VALUES:
        value = resolve(module_name, dotted)
        if dotted in ("Hidden", "LatentPreviewMethod"):
            data["values"][f"{module_name}:{dotted}"] = {member.name: member.value for member in value}
        elif isinstance(value, type):
            data["values"][f"{module_name}:{dotted}"] = [base.__name__ for base in value.__mro__]
        else:
            data["values"][f"{module_name}:{dotted}"] = type(value).__name__
    return data


def record_object_info(url: str) -> dict:
    with urllib.request.urlopen(f"{url.rstrip('/')}/object_info", timeout=60) as response:
        info = json.load(response)
    missing = [name for name in PACK_NODES + CORE_NODES if name not in info]
    if missing:
        raise SystemExit(f"/object_info lacks {missing}: is the pack installed and did it import?")
    return {name: info[name] for name in PACK_NODES + CORE_NODES}


def main() -> None:
    what = sys.argv[1]
    if what == "signatures":
        data, target = record_signatures(), CONTRACT / "signatures.json"
    elif what == "object_info":
        data, target = record_object_info(sys.argv[2]), CONTRACT / "object_info.json"
    else:
        raise SystemExit(__doc__)
    target.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
