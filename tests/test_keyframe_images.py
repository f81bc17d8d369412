"""Keyframe images are decoded as they are meant to be seen, whatever mode PIL opens them in.

References: diffusers' `load_image` (EXIF orientation) with transformers' `convert_to_rgb` (transparency composited
onto white, the Qwen3-VL processor's rule) for every 8-bit mode; for 16-bit, 32-bit integer and float grey, PIL's
own pixel values (numpy) with the documented scaling (16-bit / 257, float x 255 clipped to [0, 1]).
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from h3_core.errors import H3Error
from h3_core.request.keyframes import prepare_keyframes

W, H = 40, 24


def _gradient():
    y, x = np.mgrid[0:H, 0:W]
    return np.stack([x * 255 // (W - 1), y * 255 // (H - 1), (x + y) * 255 // (W + H - 2)], -1).astype(np.uint8)


def _alpha():
    y, x = np.mgrid[0:H, 0:W]
    return ((x * 7 + y * 13) % 256).astype(np.uint8)


def reference(path) -> np.ndarray:
    from diffusers.utils import load_image
    from transformers.image_transforms import convert_to_rgb

    return np.asarray(load_image(str(path), convert_method=lambda im: convert_to_rgb(im, return_numpy=True)))


def ours(path) -> np.ndarray:
    return np.asarray(_ours_image(path))


def _ours_image(path):
    from PIL import ImageOps

    with Image.open(path) as opened:  # the canvas is the upright size, so nothing is resized
        width, height = ImageOps.exif_transpose(opened).size
    (image,) = prepare_keyframes([path], width, height)
    assert image.mode == "RGB"
    return image


def _rgb():
    return Image.fromarray(_gradient(), "RGB")


EIGHT_BIT = {
    "RGB": lambda: _rgb(),
    "L": lambda: _rgb().convert("L"),
    "1": lambda: _rgb().convert("L").point(lambda v: 255 if v > 100 else 0).convert("1"),
    "P": lambda: _rgb().convert("P", palette=Image.Palette.ADAPTIVE, colors=16),
    "P-transparency": lambda: _palette_with_transparency(),
    "LA": lambda: Image.merge("LA", (_rgb().convert("L"), Image.fromarray(_alpha()))),
    "RGBA": lambda: Image.merge("RGBA", (*_rgb().split(), Image.fromarray(_alpha()))),
    "CMYK": lambda: _rgb().convert("CMYK"),
}


def _palette_with_transparency():
    image = _rgb().convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    image.info["transparency"] = 3  # palette entry 3 is fully transparent
    return image


@pytest.mark.parametrize("mode", list(EIGHT_BIT))
def test_eight_bit_modes_match_the_reference(tmp_path, mode):
    image = EIGHT_BIT[mode]()
    path = tmp_path / f"{mode}.{'tiff' if mode == 'CMYK' else 'png'}"
    image.save(path)
    with Image.open(path) as check:
        assert check.mode == mode.split("-")[0]
    expected = reference(path)
    assert np.array_equal(ours(path), expected)
    if "A" in mode or "transparency" in mode:
        # Not what PIL's plain convert("RGB") gives (it drops the alpha, i.e. composites onto black).
        assert not np.array_equal(expected, np.asarray(Image.open(path).convert("RGB")))


def test_pil_image_given_directly_is_converted_the_same(tmp_path):
    image = EIGHT_BIT["RGBA"]()
    path = tmp_path / "rgba.png"
    image.save(path)
    (converted,) = prepare_keyframes([image], W, H)
    assert np.array_equal(np.asarray(converted), reference(path))


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_is_applied(tmp_path, orientation):
    """A phone portrait (EXIF Orientation 6 or 8) is stored sideways; diffusers' load_image turns it upright."""
    path = tmp_path / f"o{orientation}.png"
    exif = Image.Exif()
    exif[0x0112] = orientation
    _rgb().save(path, exif=exif)
    expected = reference(path)
    assert expected.shape[:2] == ((W, H) if orientation in (6, 8) else (H, W))
    assert np.array_equal(ours(path), expected)


def _grey16():
    y, x = np.mgrid[0:H, 0:W]
    return ((x * 1601 + y * 977) % 65536).astype(np.uint16)


HIGH_DEPTH = {
    # mode: (how to write it, documented scaling from PIL's own pixel values to 8 bits)
    "I;16": (lambda p: Image.fromarray(_grey16()).save(p.with_suffix(".png")), ".png",
             lambda v: v.astype(np.float64) / 257),
    "I;16B": (lambda p: Image.frombytes("I;16B", (W, H), _grey16().astype(">u2").tobytes()).save(p.with_suffix(".tiff")), ".tiff",
              lambda v: v.astype(np.float64) / 257),
    "I": (lambda p: Image.fromarray(_grey16().astype(np.int32) * 2 - 30000).save(p.with_suffix(".tiff")),
          ".tiff", lambda v: np.clip(v.astype(np.float64), 0, 65535) / 257),
    "F": (lambda p: Image.fromarray((_grey16() / 50000.0 - 0.1).astype(np.float32)).save(
        p.with_suffix(".tiff")), ".tiff", lambda v: np.clip(v.astype(np.float64), 0, 1) * 255),
}


@pytest.mark.parametrize("mode", list(HIGH_DEPTH))
def test_high_bit_depth_grey_is_scaled_not_clipped(tmp_path, mode):
    write, suffix, scale = HIGH_DEPTH[mode]
    write(tmp_path / "grey")
    path = (tmp_path / "grey").with_suffix(suffix)
    with Image.open(path) as opened:
        assert opened.mode == mode
        expected_grey = np.round(scale(np.asarray(opened))).astype(np.uint8)
    got = ours(path)
    assert np.array_equal(got, np.repeat(expected_grey[..., None], 3, axis=-1))
    # PIL's plain conversion loses the picture (all white, or all black): a real spread of grey levels remains here.
    assert len(np.unique(got)) > 50


def _png_with_declared_size(path, width, height):
    """A valid PNG signature + IHDR claiming `width` x `height`, with a token IDAT: PIL reads the size from the
    header, so nothing of that size is ever allocated."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 16))
                     + chunk(b"IEND", b""))
    return path


def test_twenty_thousand_square_keyframe_is_refused(tmp_path):
    path = _png_with_declared_size(tmp_path / "huge.png", 20000, 20000)
    with pytest.raises(H3Error) as info:
        prepare_keyframes([path], 64, 64)
    assert str(info.value) == (
        f"{path}: the keyframe image has 400,000,000 pixels, more than PIL's limit of {Image.MAX_IMAGE_PIXELS:,} "
        "(PIL.Image.MAX_IMAGE_PIXELS, its guard against decompression bombs). It is resized to the video canvas "
        "anyway: downscale it first, e.g. to the video size.")


def test_image_between_the_warning_and_the_error_limit_is_refused_too(tmp_path, monkeypatch):
    """PIL only warns between MAX_IMAGE_PIXELS and twice that; the keyframe is refused there as well."""
    path = tmp_path / "big.png"
    _rgb().save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", W * H - 10)
    with pytest.raises(H3Error, match=f"has {W * H:,} pixels, more than PIL's limit of {W * H - 10:,}"):
        prepare_keyframes([path], W, H)


@pytest.mark.parametrize("case", ["text", "truncated-png", "empty"])
def test_unreadable_keyframe(tmp_path, case):
    path = tmp_path / f"{case}.png"
    if case == "text":
        path.write_text("not an image")
    elif case == "truncated-png":
        _rgb().save(path)
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
    else:
        path.write_bytes(b"")
    with pytest.raises(H3Error) as info:
        prepare_keyframes([path], W, H)
    message = str(info.value)
    assert message.startswith(f"{path}: cannot read the keyframe image (")
    assert message.endswith("it is not an image file PIL can decode, or it is truncated. Save it again as PNG or "
                            "JPEG.")


def test_missing_keyframe_file(tmp_path):
    with pytest.raises(H3Error) as info:
        prepare_keyframes([tmp_path / "nope.png"], W, H)
    assert str(info.value) == f"{tmp_path / 'nope.png'}: no such keyframe image file."
