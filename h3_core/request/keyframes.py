"""Keyframes (FL2VA first / last frame): any image form the user has -> PIL images fitted to the canvas."""

from __future__ import annotations

import os
import re
import struct
import warnings
from pathlib import Path

import torch

from ..errors import H3Error

WHITE = (255, 255, 255, 255)
# How high-bit-depth single-channel images map to 8 bits (PIL's own convert("RGB") clips them instead: a 16-bit grey
# PNG comes out all white, a float TIFF all black):
#   I;16 / I;16B / I;16L / I;16N (16-bit grey): value / 257, rounded (0..65535 -> 0..255);
#   I (32-bit integer; older Pillow opens 16-bit PNGs so): clipped to 0..65535, then as 16-bit;
#   F (32-bit float): clipped to 0..1 (the usual float-image range), times 255, rounded.
SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N")


def _high_depth_to_grey(image):
    import numpy as np
    from PIL import Image

    values = np.asarray(image)
    if image.mode == "F":
        scaled = np.clip(np.nan_to_num(values.astype(np.float64), nan=0.0), 0.0, 1.0) * 255.0
    else:
        scaled = np.clip(values.astype(np.float64), 0, 65535) / 257.0
    return Image.fromarray(np.round(scaled).astype(np.uint8), mode="L")


def to_rgb(image, source: str = "keyframe image"):
    """Any PIL image -> RGB as it is meant to be seen: EXIF orientation applied (phone photos), transparency
    composited onto white (as the vision tower's reference processor does), palette / CMYK / 1-bit / grey by PIL's
    own conversion, 16-bit and float grey scaled as above. `source` names the image in errors."""
    from PIL import Image, ImageOps

    image = ImageOps.exif_transpose(image)
    if image.mode in SIXTEEN_BIT_MODES or image.mode in ("I", "F"):
        image = _high_depth_to_grey(image)
    try:
        if "A" in image.getbands() or "a" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            return Image.alpha_composite(Image.new("RGBA", rgba.size, WHITE), rgba).convert("RGB")
        return image.convert("RGB")
    except ValueError as exc:  # a mode PIL cannot convert (LAB, HSV, ...)
        raise H3Error(f"{source}: PIL cannot convert its '{image.mode}' pixels to RGB ({exc}); save it as an RGB "
                      "PNG or JPEG.") from None


def open_keyframe(path, what: str = "keyframe image"):
    """Open and fully decode an image file as RGB; one H3Error naming the file when it is not a readable image or
    is larger than PIL's decompression-bomb limit. `what` names the image in the messages."""
    from PIL import Image

    if Path(path).is_dir():
        raise H3Error(f"{path}: is a folder; give the {what} file inside it.")
    if not Path(path).is_file():
        raise H3Error(f"{path}: no such {what} file.")
    try:
        with warnings.catch_warnings():
            # Past MAX_IMAGE_PIXELS PIL only warns (past twice that it refuses): refuse both, before decoding.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as opened:
                opened.load()
                return to_rgb(opened, str(path))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # PIL checks the size from the file's header, before decoding; its message gives the pixel count.
        found = re.search(r"\((\d+) pixels\)", str(exc))
        size = f"{int(found.group(1)):,} pixels" if found else "too many pixels"
        raise H3Error(f"{path}: the {what} has {size}, more than PIL's limit of {Image.MAX_IMAGE_PIXELS:,} "
                      "(PIL.Image.MAX_IMAGE_PIXELS, its guard against decompression bombs). It is resized to the "
                      "video canvas anyway: downscale it first, e.g. to the video size.") from None
    except (OSError, ValueError, SyntaxError, EOFError, struct.error) as exc:
        raise H3Error(f"{path}: cannot read the {what} ({exc}); it is not an image file PIL can decode, or "
                      "it is truncated. Save it again as PNG or JPEG.") from None


def _to_pil(image, what: str = "keyframe"):
    import numpy as np
    from PIL import Image

    if isinstance(image, Image.Image):
        return to_rgb(image)
    if isinstance(image, (str, os.PathLike)):
        return open_keyframe(image, f"{what} image")
    if isinstance(image, torch.Tensor):
        tensor = image[0] if image.ndim == 4 else image
        if tensor.ndim != 3 or tensor.shape[-1] not in (3, 4):
            raise H3Error(f"{what} tensor must be [H, W, 3] (or ComfyUI [1, H, W, 3]) in [0, 1], got shape "
                          f"{tuple(image.shape)}.")
        if not torch.isfinite(tensor).all():
            raise H3Error(f"{what} image contains NaN or Inf values.")
        array = (tensor[..., :3].float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
        return Image.fromarray(array)
    if isinstance(image, np.ndarray):
        return _to_pil(torch.from_numpy(image.astype("float32") / (255.0 if image.dtype == np.uint8 else 1.0)), what)
    raise H3Error(f"unsupported {what} type {type(image).__name__}; give a PIL image, a path or an [H, W, 3] "
                  "tensor.")


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


def check_image_file(path, name: str) -> Path:
    """The file exists and PIL can open it (its header; the keyframe code decodes it later)."""
    from PIL import Image

    path = Path(path)
    if path.is_dir():
        raise H3Error(f"{name} {path}: is a folder; give an image file inside it.")
    if not path.is_file():
        raise H3Error(f"{name} {path}: no such image file.")
    try:
        with Image.open(path) as image:
            image.size  # noqa: B018  (opening reads the header; a decompression bomb is refused here)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise H3Error(f"{name} {path}: PIL cannot open it as an image ({exc}).") from None
    return path
