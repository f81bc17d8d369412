"""Memory profiles plan quantised files at their stored sizes: the released widths and depths in the quantised
files users run on small machines (the DiT as one Q8_0 GGUF, the text encoder as a published Q4_K `qwen3vl` GGUF cut
at layer 50 with its Q8_0 mmproj), header-only (sparse files, `benchmarks/synthetic_h3.py`), so the plans are the
ones those downloads get. What each streamed unit holds is counted from the files by gguf's own reader."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import pytest

from h3_core.planning.memory_profiles import GIB, PROFILES, residency_plan
from h3_core.sources.model_sources import ModelSources

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import synthetic_h3 as synth  # noqa: E402

DEVICE_OF = {"GPU": "cuda", "Mac": "mps"}
LAYER = 50  # H3 reads the text encoder's hidden states after decoder layer 50
BF16 = 2


@pytest.fixture(scope="module")
def quantised(tmp_path_factory) -> ModelSources:
    root = tmp_path_factory.mktemp("released-quantised")
    dit, _ = synth.write_dit_gguf(root / "diffusion_models" / "dit-Q8_0.gguf", 50, values=False, sync=False)
    text, _ = synth.write_text_encoder_gguf(root / "text_encoders" / "Qwen3-VL-32B-Q4_K.gguf",
                                            root / "text_encoders" / "mmproj-Qwen3-VL-32B-Q8_0.gguf", LAYER,
                                            values=False, sync=False)
    video, _ = synth.write_video_vae(root / "vae", values=False, sync=False)
    audio, _ = synth.write_audio_vae(root / "vae", values=False, sync=False)
    return ModelSources(transformer=dit, text_encoder=text, video_vae=video, audio_vae=audio, root=root)


def stored_bytes(path: Path, prefix: str, count: int, skip: str | None = None) -> tuple[int, ...]:
    """Bytes of each unit `prefix.format(i)` in the file, as gguf's reader sizes its tensors."""
    tensors = gguf.GGUFReader(path).tensors
    return tuple(sum(int(t.n_bytes) for t in tensors if t.name.startswith(prefix.format(i))
                     and (skip is None or skip not in t.name)) for i in range(count))


PLAIN_BYTES = {gguf.GGMLQuantizationType.F32: 4, gguf.GGMLQuantizationType.F16: 2, gguf.GGMLQuantizationType.BF16: 2}


def logical_elements(path: Path, prefix: str) -> int:
    return sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors if t.name.startswith(prefix))


def materialised_bytes(path: Path, prefix: str) -> int:
    """A unit's weights as a forward holds them: quantised ones dequantised to bf16, plain ones as stored."""
    return sum(int(t.n_elements) * PLAIN_BYTES.get(t.tensor_type, BF16) for t in gguf.GGUFReader(path).tensors
               if t.name.startswith(prefix))


@pytest.mark.parametrize("name", ["16 GB GPU", "12 GB GPU", "32 GB Mac"])
def test_the_small_machine_profiles_plan_the_quantised_files_at_their_stored_sizes(quantised, name):
    profile = PROFILES[name]
    planned = residency_plan(quantised, profile, device=DEVICE_OF[profile.machine], host_memory_bytes=64 * GIB)
    components = {c.name: c for c in planned.plan.components}
    text, dit = components["text_encoder"], components["transformer"]
    assert text.residency == dit.residency == "layerwise"

    # The text encoder streams each decoder layer at its Q4_K / F32 size in the file, layers 0-49.
    layers = stored_bytes(quantised.text_encoder, "blk.{}.", LAYER)
    assert text.unit_sizes == layers and text.unit_bytes == max(layers)
    # and one layer dequantised (bf16, the loader's default for a quantised weight) beside it while it runs.
    assert text.dequantised_unit_bytes == materialised_bytes(quantised.text_encoder, "blk.0.")
    assert max(layers) < 0.3 * text.dequantised_unit_bytes  # Q4_K: 4.5 bits a weight against 16

    # The transformer's blocks stream at their Q8_0 size, the AdaLN projection split off as a unit of its own.
    blocks = stored_bytes(quantised.transformer, "blocks.{}.", 50, skip="adaln_proj")
    adaln = stored_bytes(quantised.transformer, "blocks.{}.adaln_proj.", 50)
    assert dit.unit_sizes == blocks and dit.companion_unit_bytes == max(adaln)
    assert max(blocks) < 0.55 * logical_elements(quantised.transformer, "blocks.0.") * BF16  # 8.5 bits against 16

    # The whole plan fits its budget, with the quantised units counted as above.
    assert planned.plan.peak_bytes <= planned.plan.budget_bytes == profile.budget_bytes()


def test_a_quantised_token_embedding_is_planned_with_its_stored_bytes_beside_it_while_it_is_decoded(quantised):
    """The embeddings part of the text encode holds the dequantised embedding and, while it is decoded, the Q4_K
    bytes it is decoded from (measured at these sizes: 1.45 GiB + 0.41 GiB, benchmarks/whole_model.py)."""
    from h3_core.planning.phase_plans import plan_for_budget

    plan = plan_for_budget(quantised, device="cpu", budget_bytes=1 << 40, width=256, height=256, num_frames=22,
                           keyframes=True, steps=2, residency="layerwise")
    text = plan.phase("text encode")
    items = {(i.what, i.during): i.nbytes for i in text.items}
    embedding = next(t for t in gguf.GGUFReader(quantised.text_encoder).tensors if t.name == "token_embd.weight")
    assert items[("phase staging", "embeddings")] == int(embedding.n_bytes)
    assert items[("phase weights", "embeddings")] == int(embedding.n_elements) * BF16
    assert text.part_bytes("embeddings") >= int(embedding.n_bytes) + int(embedding.n_elements) * BF16


def test_on_the_cpu_components_used_once_per_request_stream_and_a_many_tile_decode_stays_resident(quantised):
    """With room for everything, the CPU still streams a large component whose units run once per request: its reads
    then overlap its compute instead of a whole resident load first (the released video VAE's took 7-10 s of a 23 s
    decode, benchmarks/whole_model.py). A decode of many tiles (one pass each) keeps its VAE resident; the
    transformer streams at 2 steps (one model call) and stays resident at 30; a GPU plan is unchanged."""
    from h3_core.planning.phase_plans import plan_for_budget

    def chosen(device="cpu", **request):
        plan = plan_for_budget(quantised, device=device, budget_bytes=1 << 40, keyframes=True, **request)
        return {c.name: c.residency for c in plan.components}

    small = chosen(width=128, height=128, num_frames=22, steps=2)
    assert small == dict.fromkeys(("text_encoder", "transformer", "video_vae", "audio_vae"), "layerwise")
    large = chosen(width=1344, height=768, num_frames=124, steps=30)
    assert large["video_vae"] == large["transformer"] == "resident"  # 30 tiles x 5 clips; 29 model calls
    assert large["audio_vae"] == large["text_encoder"] == "layerwise"
    assert set(chosen("cuda", width=128, height=128, num_frames=22, steps=2).values()) == {"resident"}
