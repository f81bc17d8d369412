"""Reading the TAEH3 tiny decoder (`models/taeh3.py`) from a `taeh3` `.safetensors` in madebyollin/taehv's layout."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import CheckpointError, PickleCheckpointError
from ..models.taeh3 import LATENT_CHANNELS, TAEH3Decoder, TimeGrow
from .safetensors_io import PICKLE_SUFFIXES, SafetensorsFile


def load_taeh3(path, *, device="cpu", space_upscale=(True, True, True)) -> TAEH3Decoder:
    """The decoder of a `taeh3` `.safetensors` in taehv's layout, float32 on `device`. A pickle (`.pth`, taehv's
    release format) is refused without being opened, with how to get or make the `.safetensors`."""
    path = Path(path)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise PickleCheckpointError(
            f"{path}: '{path.suffix}' files are pickles, which can run code when loaded; h3-stream reads the TAEH3 "
            "previewer from .safetensors only. Download taeh3.safetensors (madebyollin/taehv, its safetensors/ "
            "folder) next to it, or convert this one once: python -c \"import torch, safetensors.torch as s; "
            f"s.save_file(torch.load('{path.name}', weights_only=True), '{path.stem}.safetensors')\"", path=path)
    model = TAEH3Decoder(space_upscale)
    wanted = {key: tensor.shape for key, tensor in model.state_dict().items()}
    reader = SafetensorsFile(path)
    if "decoder.0.weight" in reader and "decoder.1.weight" not in reader:
        raise CheckpointError(f"{path}: this is a TAEHV '_super' decoder (a 1x1 first layer); h3-stream previews run "
                              "the base taeh3 decoder. Use taeh3.safetensors.", path=path)
    state = {}
    for key, shape in wanted.items():
        if key not in reader:
            raise CheckpointError(f"{path}: tensor '{key}' is missing; this is not a TAEHV decoder in taehv's layout "
                                  "(expected taeh3.safetensors from madebyollin/taehv).", path=path)
        tensor = reader.tensor(key)
        if isinstance(model.decoder[int(key.split(".")[1])], TimeGrow) and tensor.shape[0] > shape[0]:
            tensor = tensor[-shape[0]:]  # trained with more time upscaling: keep the last frame's channels, as taehv
        if tuple(tensor.shape) != tuple(shape):
            channels = reader.shape("decoder.1.weight")[1] if "decoder.1.weight" in reader else "?"
            raise CheckpointError(
                f"{path}: tensor '{key}' is {list(tensor.shape)}, taeh3 needs {list(shape)}"
                + (f" (the file decodes {channels}-channel latents; H3's have {LATENT_CHANNELS}: it is the tiny "
                   "decoder of another model)" if channels != LATENT_CHANNELS else "") + ".", path=path)
        if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
            raise CheckpointError(f"{path}: tensor '{key}' is not finite floating point; download the file again.",
                                  path=path)
        state[key] = tensor.to(torch.float32)
    model.load_state_dict(state)
    return model.to(device).eval().requires_grad_(False)
