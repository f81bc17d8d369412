"""The TAEH3 decoder cases recorded from madebyollin's `taehv` package, for CI, where `taehv` cannot be installed
(it is not on PyPI; install it from a checkout of github.com/madebyollin/taehv to record or to run the live tests).

The weights are seeded, made the same way here and by the recorder: `TAEH3Decoder`'s default initialisation under
`torch.manual_seed(seed)` (any weights would do: they are the input both decoders get), the last convolution scaled
so the frames span [0, 1] instead of clamping to black. The expected frames come from `taehv.TAEHV` alone.

    python tests/taeh3_reference.py record      # with taehv installed: rewrites reference_outputs/taeh3_taehv.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

RECORDED = Path(__file__).resolve().parent / "reference_outputs" / "taeh3_taehv.json"
SAMPLES = 1024  # values kept per decoded clip: evenly spaced over the flattened frames

# name: (weight seed, weight dtype, latent seed, latent shape [B, C, T, h, w], spatial stages)
CASES = {
    "full_clip": (0, "float32", 10, (1, 24, 7, 3, 5), (True, True, True)),
    "fp16_one_stage": (1, "float16", 11, (1, 24, 2, 4, 4), (True, False, False)),
}


def seeded_decoder_state(seed: int, dtype=torch.float32) -> dict:
    from h3_core.models.taeh3 import TAEH3Decoder

    torch.manual_seed(seed)
    decoder = TAEH3Decoder()
    with torch.no_grad():  # random convolutions shrink the signal: scaled, the last one spans the [0, 1] range
        decoder.decoder[22].weight.mul_(100.0)
        decoder.decoder[22].bias.fill_(0.5)
    return {key: value.to(dtype).contiguous() for key, value in decoder.state_dict().items()}


def case_inputs(name: str):
    seed, dtype, latent_seed, shape, stages = CASES[name]
    state = seeded_decoder_state(seed, getattr(torch, dtype))
    latent = torch.randn(shape, generator=torch.Generator().manual_seed(latent_seed))
    return state, latent, stages


def samples(frames: torch.Tensor) -> list[float]:
    flat = frames.detach().to(torch.float32).flatten()
    step = max(1, flat.numel() // SAMPLES)
    return flat[::step][:SAMPLES].tolist()


def taehv_decode(name: str) -> dict:
    """The case decoded by `taehv.TAEHV` (the reference): the clip and its first latent frame decoded alone."""
    import taehv

    state, latent, stages = case_inputs(name)
    reference = taehv.TAEHV(checkpoint_path=None, patch_size=2, latent_channels=24, decoder_space_upscale=stages)
    reference.is_h3 = True
    missing, unexpected = reference.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    assert not unexpected and all(key.startswith("encoder.") for key in missing), (missing, unexpected)
    reference.eval()
    with torch.no_grad():
        clip = reference.decode_video(latent.movedim(1, 2).clone(), parallel=True, show_progress_bar=False)
        first = reference.decode_video(latent[:, :, :1].movedim(1, 2).clone(), parallel=True,
                                       show_progress_bar=False)[0, 0]
    return {"clip": clip, "first": first}


def record() -> None:
    import taehv

    out = {"recorded_with": f"taehv {getattr(taehv, '__version__', '0.1.0')} (madebyollin/taehv), torch "
                            f"{torch.__version__}", "samples_per_clip": SAMPLES, "cases": {}}
    for name in CASES:
        decoded = taehv_decode(name)
        out["cases"][name] = {part: {"shape": list(t.shape), "mean": float(t.double().mean()),
                                     "std": float(t.double().std()), "samples": samples(t)}
                              for part, t in decoded.items()}
    RECORDED.parent.mkdir(exist_ok=True)
    RECORDED.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {RECORDED}")


def recorded() -> dict:
    return json.loads(RECORDED.read_text())


if __name__ == "__main__":
    if sys.argv[1:] != ["record"]:
        sys.exit(__doc__)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    record()
