"""Keyframes (FL2VA first / last frame): any image form the user has -> PIL images fitted to the canvas."""

from __future__ import annotations

import os

import torch

from ..errors import H3Error


def _to_pil(image):
    from PIL import Image
    import numpy as np

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (str, os.PathLike)):
        try:
            with Image.open(image) as opened:
                return opened.convert("RGB")
        except (OSError, ValueError) as exc:
            raise H3Error(f"{image}: cannot read the keyframe image ({exc}).") from None
    if isinstance(image, torch.Tensor):
        tensor = image[0] if image.ndim == 4 else image
        if tensor.ndim != 3 or tensor.shape[-1] not in (3, 4):
            raise H3Error(f"keyframe tensor must be [H, W, 3] (or ComfyUI [1, H, W, 3]) in [0, 1], got shape "
                          f"{tuple(image.shape)}.")
        if not torch.isfinite(tensor).all():
            raise H3Error("keyframe image contains NaN or Inf values.")
        array = (tensor[..., :3].float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
        return Image.fromarray(array)
    if isinstance(image, np.ndarray):
        return _to_pil(torch.from_numpy(image.astype("float32") / (255.0 if image.dtype == np.uint8 else 1.0)))
    raise H3Error(f"unsupported keyframe type {type(image).__name__}; give a PIL image, a path or an [H, W, 3] tensor.")


def prepare_keyframes(images, width: int, height: int) -> list:
    """Fit keyframes to the canvas as the released model saw them (LANCZOS): the first is stretched, the second is
    scaled to cover the canvas (rounded) and centre-cropped."""
    from PIL import Image

    prepared = []
    for index, image in enumerate(images):
        image = _to_pil(image)
        if image.size == (width, height):
            prepared.append(image)
        elif index == 0:
            prepared.append(image.resize((width, height), Image.Resampling.LANCZOS))
        else:
            scale = max(width / image.size[0], height / image.size[1])
            size = (max(width, round(image.size[0] * scale)), max(height, round(image.size[1] * scale)))
            left, top = max(0, (size[0] - width) // 2), max(0, (size[1] - height) // 2)
            prepared.append(image.resize(size, Image.Resampling.LANCZOS).crop((left, top, left + width, top + height)))
    return prepared


def pil_to_frames(image) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)[None, None]  # [1, 1, H, W, 3]
