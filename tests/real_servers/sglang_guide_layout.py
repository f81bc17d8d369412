"""Run SGLang 0.5.23's own H3 keyframe lowering in its venv (tests/real_servers/build_sglang_venv.sh) for
tests/test_guides_sglang.py; CPU only, no server.

    <sglang venv>/bin/python sglang_guide_layout.py OUT.npz

Writes, for each case, SGLang's packed-sequence fields (`minimax_h3_packed_sequence`: positions, tags, the visual and
audio row lists, the update mask, the used length) as arrays `CASE.FIELD`, and for each request that SGLang refuses
the refusal, and which conditions its plan sends to Qwen (`minimax_h3_resolve_plan`), as a JSON string `meta`.
Arrays only (np.savez, read back without pickle).
"""

from __future__ import annotations

import json
import sys


def _define_torchvision_schemas() -> None:
    # PyPI's torchvision links CUDA, so its C ops do not register here; sglang's imports only need the schemas.
    import torch

    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _define_torchvision_schemas.library = library  # keep it alive


# (name, text_len, latent_t, latent_h, latent_w, audio_t, frame_count, keyframe_frame_indices)
CASES = [
    ("first_124", 9, 37, 12, 20, 207, 124, [0]),
    ("last_124", 9, 37, 12, 20, 207, 124, [-1]),
    ("both_124", 9, 37, 12, 20, 207, 124, [0, -1]),
    ("first_1344", 256, 37, 48, 84, 207, 124, [0]),
    ("last_362", 9, 107, 12, 20, 603, 362, [-1]),
]
REFUSED = [("middle_124", 9, 37, 12, 20, 207, 124, [62])]


def main() -> None:
    _define_torchvision_schemas()
    import numpy as np
    from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.minimax_h3 import (
        packed_sequence, resolved_plan)

    arrays, meta = {}, {"refused": {}, "qwen": {}}
    for name, text_len, latent_t, latent_h, latent_w, audio_t, frame_count, indices in CASES:
        packed = packed_sequence.minimax_h3_packed_sequence(
            text_len=text_len, latent_t=latent_t, latent_h=latent_h, latent_w=latent_w, audio_t=audio_t,
            include_keyframe_cond=True, keyframe_frame_indices=indices, frame_count=frame_count)
        used = int(packed["cu_seqlens"][1])
        arrays[f"{name}.positions"] = packed["img_position_ids"][:used].numpy()
        arrays[f"{name}.tags"] = packed["token_tags"][:used].numpy()
        arrays[f"{name}.img_pos"] = packed["img_pos"].numpy()
        arrays[f"{name}.audio_pos"] = packed["audio_pos"].numpy()
        arrays[f"{name}.update_mask"] = packed["update_mask"].numpy()
    for name, text_len, latent_t, latent_h, latent_w, audio_t, frame_count, indices in REFUSED:
        try:
            packed_sequence.minimax_h3_packed_sequence(
                text_len=text_len, latent_t=latent_t, latent_h=latent_h, latent_w=latent_w, audio_t=audio_t,
                include_keyframe_cond=True, keyframe_frame_indices=indices, frame_count=frame_count)
            meta["refused"][name] = None
        except ValueError as exc:
            meta["refused"][name] = str(exc)

    def plan(task, conditions):
        canonical = {"schema": "minimax_h3.v1", "task": task, "prompt": "p", "conditions": conditions,
                     "target": {"duration_seconds": 5.0, "aspect_ratio": "16:9", "short_edge": 768}}
        try:
            return resolved_plan.minimax_h3_resolve_plan(canonical).encoders["qwen"]["ordered_condition_indices"]
        except ValueError as exc:
            return f"refused: {exc}"

    keyframe = {"type": "image", "role": "keyframe", "uri": "k.png"}
    meta["qwen"]["fl2va image keyframe at 0"] = plan("fl2va", [dict(keyframe, frame_index=0)])
    meta["qwen"]["fl2va image keyframe at 62"] = plan("fl2va", [dict(keyframe, frame_index=62)])
    meta["qwen"]["fl2va video keyframe at 0"] = plan("fl2va", [{"type": "video", "role": "keyframe",
                                                                "uri": "c.mp4", "frame_index": 0}])
    meta["qwen"]["ref2va reference image + image keyframe at 0"] = plan(
        "ref2va", [{"type": "image", "role": "reference", "uri": "r.png"}, dict(keyframe, frame_index=0)])
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez(sys.argv[1], **arrays)


if __name__ == "__main__":
    main()
