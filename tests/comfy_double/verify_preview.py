"""Hold the pack's latent2rgb previews to ComfyUI core's own previewer, in a real ComfyUI (not run by the tests).

    cd <ComfyUI> && <ComfyUI venv>/bin/python <pack>/tests/comfy_double/verify_preview.py [record]

Without an argument: core's `latent_preview.Latent2RGBPreviewer`, built from core's `MiniMaxH3Video` latent format
(`comfy/latent_formats.py`), and the pack's `h3_core.pipeline.preview` give the same picture, pixel for pixel, for
random H3 latents of several sizes (`[1, 24, T, h, w]`, as core's sampler hands x0 to its previewer), and the pack's
factors are core's numbers. `record` also writes contract/core_latent2rgb.json: core's factors, one latent and core's
picture of it, with the ComfyUI commit they came from (`git -C <ComfyUI> rev-parse HEAD`, or COMFYUI_COMMIT), for
the tests (tests/test_preview.py) to hold the pack to without ComfyUI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PACK_ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).resolve().parent / "contract" / "core_latent2rgb.json"


def core_previewer():
    sys.path.insert(0, str(Path.cwd()))
    import comfy.options

    comfy.options.enable_args_parsing()
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.latent_formats
    import latent_preview

    fmt = comfy.latent_formats.MiniMaxH3Video
    return fmt, latent_preview.Latent2RGBPreviewer(fmt.latent_rgb_factors, fmt.latent_rgb_factors_bias)


def comfy_commit() -> str:
    if os.environ.get("COMFYUI_COMMIT"):
        return os.environ["COMFYUI_COMMIT"]
    return subprocess.run(["git", "-C", str(Path.cwd()), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def main() -> None:
    import numpy as np
    import torch

    record = sys.argv[1:] == ["record"]
    fmt, previewer = core_previewer()
    sys.path.insert(0, str(PACK_ROOT))
    from h3_core.pipeline.preview import VIDEO_RGB_BIAS, VIDEO_RGB_FACTORS, StepEstimate, latent_to_rgb
    from h3_core.pipeline.layout import patchify

    assert [list(row) for row in VIDEO_RGB_FACTORS] == fmt.latent_rgb_factors, "factors differ from core's"
    assert list(VIDEO_RGB_BIAS) == fmt.latent_rgb_factors_bias, "bias differs from core's"
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for frames, height, width, scale in ((2, 4, 6, 1.0), (7, 24, 40, 2.5), (12, 48, 84, 4.0), (2, 2, 2, 8.0)):
        x0 = torch.randn(1, 24, frames, height, width, generator=generator) * scale
        core = np.asarray(previewer.decode_latent_to_preview(x0.clone()))
        ours = latent_to_rgb(x0[0, :, 0]).numpy()
        # and through the sampler's rows, as the node renders it
        estimate = StepEstimate(1, 1, patchify(x0)[0], torch.zeros(8, 32), (24, frames, height, width), (1, 2, 2))
        via_rows = latent_to_rgb(estimate.video_latent(1)[0, :, 0]).numpy()
        assert core.shape == ours.shape == (height, width, 3), (core.shape, ours.shape)
        assert np.array_equal(core, ours), f"{x0.shape}: {np.abs(core.astype(int) - ours).max()} levels apart"
        assert np.array_equal(core, via_rows)
        checked += 1
    print(f"latent2rgb: the pack's picture is core's, pixel for pixel, for {checked} latents")
    if record:
        latent = (torch.randn(24, 5, 7, generator=generator) * 2.0).tolist()
        x0 = torch.tensor(latent, dtype=torch.float32)[None, :, None]
        picture = np.asarray(previewer.decode_latent_to_preview(x0)).tolist()
        FIXTURE.write_text(json.dumps({
            "source": "ComfyUI core comfy/latent_formats.py MiniMaxH3Video and latent_preview.py "
                      "Latent2RGBPreviewer.decode_latent_to_preview, recorded by tests/comfy_double/verify_preview.py",
            "comfyui_commit": comfy_commit(), "latent_rgb_factors": fmt.latent_rgb_factors,
            "latent_rgb_factors_bias": fmt.latent_rgb_factors_bias,
            "latent_frame": latent, "core_picture": picture}) + "\n")
        print(f"wrote {FIXTURE}")


if __name__ == "__main__":
    main()
