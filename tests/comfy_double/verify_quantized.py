"""Check that `python -m h3_core quantize` writes ComfyUI mixed-precision files a real ComfyUI loads (not run by the
tests; issue 17).

    <ComfyUI venv>/bin/python -B verify_quantized.py <ComfyUI folder>

The embedded tiny transformer (bf16 release layout, from this pack's cache) is quantised to fp8 and int8 with this
pack's tool, then each file is loaded by core's Load Diffusion Model node (`nodes.UNETLoader`, from a temporary
`diffusion_models` folder): the
model must be detected as MiniMax H3, its block matrices (transformer and token refiner) must load as core's
`QuantizedTensor`, and core's dequantisation of a block's attention output projection must equal this pack's
(h3_core.load_dit, fp32) bit for bit.
Prints one line per check; exit status 1 if any fails.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

PACK = Path(__file__).resolve().parents[2]


def main() -> int:
    folder = sys.argv[1]
    sys.dont_write_bytecode = True
    sys.argv = [sys.argv[0], "--cpu"]  # parsed when comfy.model_management is first imported
    sys.path.insert(0, folder)
    sys.path.insert(1, str(PACK))
    import comfy.options

    comfy.options.enable_args_parsing()
    import folder_paths
    import torch

    import h3_core
    import nodes
    from h3_core.sources.tiny_default import ensure_tiny_model

    source = next((ensure_tiny_model() / "diffusion_models").glob("minimax_h3_tiny_fl2va_*.safetensors"))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder_paths.add_model_folder_path("diffusion_models", tmp)  # where UNETLoader lists files
        for fmt in ("fp8", "int8"):
            target = Path(tmp) / f"minimax_h3_tiny_fl2va_{fmt}.safetensors"
            done = subprocess.run([sys.executable, "-m", "h3_core", "quantize", "--format", fmt, str(source),
                                   str(target)], cwd=PACK, capture_output=True, text=True)
            if done.returncode != 0:
                results.append((f"{fmt}: h3_core quantize failed: {done.stderr.strip()[-300:]}", False))
                continue
            try:
                model, = nodes.UNETLoader().load_unet(target.name, "default")
            except Exception as error:  # what UNETLoader would show the user
                results.append((f"{fmt}: core's loader refused it: {type(error).__name__}: {error}", False))
                continue
            core = model.model.diffusion_model
            weights = dict(core.named_parameters())
            quantised = [k for k, v in weights.items() if type(v).__name__ == "QuantizedTensor"]
            results.append((f"{fmt}: core detects {type(model.model).__name__}", type(model.model).__name__ ==
                            "MiniMaxH3"))
            results.append((f"{fmt}: {len(quantised)} block matrices load as core's QuantizedTensor",
                            bool(quantised) and all("blocks." in k for k in quantised)))
            # Both dequantised in fp32 (ours would be bf16 by default: the compute dtype of a quantised file).
            ours = h3_core.load_dit(target, dtype=torch.float32).blocks[0].attn.out_proj.weight
            theirs = weights["blocks.0.attn.out_proj.weight"].dequantize().float()
            results.append((f"{fmt}: core's dequantised blocks.0.attn.out_proj equals ours bitwise",
                            torch.equal(ours.view(torch.int32), theirs.view(torch.int32))))
    for name, ok in results:
        print(f"{'ok    ' if ok else 'FAILED'} {name}")
    return 0 if results and all(ok for _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())
