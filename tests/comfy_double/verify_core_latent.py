"""Check the core-latent nodes against a real ComfyUI's own code, in this process (no server; not run by the tests).

    <ComfyUI venv>/bin/python -B verify_core_latent.py <ComfyUI folder>

With core's real `NestedTensor` and H3 nodes: our latents -> H3 Latent to Core -> core's Separate AV Latent and Concat
AV Latent -> H3 Latent from Core is bitwise exact; the LATENT passes the check core's Add Guide for MiniMax H3 makes;
core's Empty MiniMax H3 AV Latent of several sizes becomes the shape our sampler makes for that request; a video-only
latent is refused with one H3Error. Prints one line per check; exit status 1 if any fails.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PACK = Path(__file__).resolve().parents[2]


def import_comfyui(folder: str) -> None:
    """Make the ComfyUI checkout at `folder` importable, parsed as a `--cpu` run (also used by
    verify_guides_core.py)."""
    sys.dont_write_bytecode = True  # leave the ComfyUI folder as it was
    sys.path.insert(0, folder)
    import comfy.options

    comfy.options.enable_args_parsing()
    sys.argv = [sys.argv[0], "--cpu"]  # parsed when comfy.model_management is first imported


def load_comfyui(folder: str):
    import_comfyui(folder)
    spec = importlib.util.spec_from_file_location("h3_stream_pack", PACK / "__init__.py")
    pack = importlib.util.module_from_spec(spec)
    sys.modules["h3_stream_pack"] = pack
    spec.loader.exec_module(pack)
    pack.comfy_entrypoint()  # makes h3_core importable, as ComfyUI's loader would


def main() -> int:
    load_comfyui(sys.argv[1])
    import comfy_extras.nodes_minimax_h3 as core_h3
    import torch
    from comfy_extras.nodes_lt import LTXVConcatAVLatent, LTXVSeparateAVLatent
    from h3_stream_pack.nodes.latent_from_core import H3StreamLatentFromCore
    from h3_stream_pack.nodes.latent_to_core import H3StreamLatentToCore

    from h3_core.errors import H3Error
    from h3_core.pipeline import Latents
    from h3_core.request.grid import LatentShape

    results = []
    shape = LatentShape.for_request(96, 64, 22)
    g = torch.Generator().manual_seed(1)
    ours = Latents(torch.randn(shape.video, generator=g), torch.randn(shape.audio, generator=g), shape)
    core = H3StreamLatentToCore.execute(ours)[0]
    samples = core["samples"]
    results.append(("Add Guide for MiniMax H3 accepts it", samples.is_nested and len(samples.tensors) == 2
                    and samples.tensors[0].ndim == 5 and samples.tensors[0].shape[1] == 24))
    video, audio = LTXVSeparateAVLatent.execute(core).args
    back = H3StreamLatentFromCore.execute(LTXVConcatAVLatent.execute(video, audio).args[0])[0]
    results.append(("through Separate + Concat AV Latent and back, bitwise",
                    torch.equal(back.video.view(torch.int32), ours.video.view(torch.int32))
                    and torch.equal(back.audio.view(torch.int32), ours.audio.view(torch.int32)) and back.shape == shape))
    for width, height, length in ((96, 64, 5), (96, 64, 22), (64, 96, 23), (1344, 768, 124)):
        empty, frames = core_h3._empty_av_latent(width, height, length)
        converted = H3StreamLatentFromCore.execute(empty)[0]
        results.append((f"Empty MiniMax H3 AV Latent {width}x{height} length {length} -> {frames} frames",
                        converted.shape == LatentShape.for_request(width, height, frames)))
    try:
        H3StreamLatentFromCore.execute({"samples": video["samples"]})
        results.append(("a video-only latent is refused", False))
    except H3Error as error:
        results.append((f"a video-only latent is refused: {error}", str(error).startswith("latent: ")))
    for name, ok in results:
        print(f"{'ok    ' if ok else 'FAILED'} {name}")
    return 0 if all(ok for _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())
