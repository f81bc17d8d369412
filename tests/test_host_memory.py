"""Layerwise residency never doubles the weights in host memory.

A native-layout checkpoint of a few hundred MB (fused QKV stored per-head interleaved, so the resident loader must
de-interleave it: a copy) is loaded with `residency="layerwise"` on the CPU used as the device, and one forward
runs. In a fresh process, the growth of anonymous memory (RssAnon in /proc/self/status: pages not backed by a file)
from before `load_dit` to after the forward must stay under 15 % of the file size and must not grow with the
number of blocks (8 vs 16): the host store reads the file itself, and only the staging ring (read_ahead + 1 = 2
blocks, bound as the device tensors on the CPU) is ever materialised. A resident load of the same file (every weight
read into the process's own memory) is the control showing that the measurement sees copies.

Raw RssAnon also counts freed heap pages glibc keeps for reuse (the transient copies of one block and of the text
refiner: 27-45 MB, varying with heap layout), so the comparisons use the memory in use, read after malloc_trim(0).

Each case runs in its own process, forked from one that imported torch once, all five side by side (`measured` says
why not several cases in one process).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from child_cases import forked_result, run_cases
from h3_core.checkpoints.dit_loader import _offloaded
from h3_core.models.dit import H3DiT, RotaryEmbedding3D
from h3_core.models.dit_config import H3DiTConfig
from offload_fixtures import random_state, save_native

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists() or not sys.platform.startswith("linux"),
                                reason="RssAnon is read from Linux /proc, malloc_trim from glibc")
# 26.2 MB of float32 weights per block; 16 blocks + refiner + embedders: a 0.46 GB file.
BIG = H3DiTConfig(
    num_layers=16, num_refiner_layers=1, hidden_size=512, num_attention_heads=4, attention_head_dim=128,
    ffn_dim=2048, in_channels=16, audio_in_channels=32, text_dim=512, freq_dim=256, time_embed_hidden_dim=512,
    time_embed_dim=256, rope_freq_dim=16,
)

MEASURE = r"""
import ctypes, json, sys
sys.path.insert(0, "tests")
import torch
import h3_core
from h3_core.models.dit_config import H3DiTConfig
from h3_fixtures import packed_inputs
from child_cases import report_forked_cases

def rss_anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

def rss_anon_in_use():
    # glibc keeps freed heap pages for reuse; give them back first so the reading is what is in use.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_anon()

def measure(case):
    folder, residency, lora = case["folder"], case["residency"], case.get("lora")
    config = H3DiTConfig.from_dict(json.load(open(folder + "/config.json")))
    inputs = packed_inputs(config, text_len=9, latent_frames=3, latent_hw=(4, 6), audio_latents=7)
    with torch.no_grad():  # warm the kernels and allocator arenas the forward will use, outside the measurement
        a, b = torch.randn(64, 512), torch.randn(512, 512)
        (a @ b).sum(); torch.nn.functional.scaled_dot_product_attention(*[torch.randn(1, 4, 64, 128)] * 3)
    before = rss_anon_in_use()
    model = h3_core.load_dit(folder, residency=residency, loras=[(lora, 1.0)] if lora else [])
    loaded = rss_anon()
    with torch.no_grad():
        video, audio = model(**inputs)
        after = rss_anon()
        after_in_use = rss_anon_in_use()
        model(**inputs)
        second_in_use = rss_anon_in_use()
    assert torch.isfinite(video).all() and torch.isfinite(audio).all()
    return {"before": before, "loaded": loaded, "after": after, "after_in_use": after_in_use,
            "second_in_use": second_in_use}

torch.set_num_threads(1)
report_forked_cases(measure)
"""


def state_bytes(config: H3DiTConfig) -> dict[str, int]:
    """The float32 bytes of every tensor `random_state(config)` makes, from the shapes alone."""
    with torch.device("meta"):
        model = H3DiT(config)
    sizes = {name: p.numel() * 4 for name, p in model.named_parameters()}
    sizes["rope.inv_freq"] = RotaryEmbedding3D.frequencies(config.rope_freq_dim, config.rope_theta).numel() * 4
    return sizes


def with_blocks(n: int, refiner: int | None = None) -> H3DiTConfig:
    return H3DiTConfig(**{**BIG.__dict__, "num_layers": n,
                          **({} if refiner is None else {"num_refiner_layers": refiner})})


BLOCK_BYTES = sum(v for k, v in state_bytes(with_blocks(1, 0)).items() if k.startswith("blocks."))
FIXED_BYTES = sum(v for k, v in state_bytes(BIG).items() if not _offloaded(k))


def write_block_lora(path: Path, config: H3DiTConfig, rank: int = 16) -> Path:
    """A rank-16 LoRA on every block's attention and MLP projections (original names)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(9)
    shapes = {"attn.qkv_proj": (3 * config.inner_dim, config.hidden_size), "attn.out_proj": (config.hidden_size,
              config.inner_dim), "mlp.fc1": (2 * config.ffn_dim, config.hidden_size),
              "mlp.fc2": (config.hidden_size, config.ffn_dim)}
    state = {}
    for i in range(config.num_layers):
        for module, (rows, cols) in shapes.items():
            state[f"blocks.{i}.{module}.lora_A.weight"] = torch.randn(rank, cols, generator=g) * 0.01
            state[f"blocks.{i}.{module}.lora_B.weight"] = torch.randn(rows, rank, generator=g) * 0.01
    save_file(state, str(path))
    return path


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Every case measured once, each in its own process, all side by side; case id -> the readings, with
    `growth`, `in_use` and `file` added.

    One child imports torch and h3_core once and forks a process per case: each case starts from the state a fresh
    interpreter has after those imports, and sees no other case's allocations. Not several cases one after another
    in one process: the cases before disturb the readings. Measured so, after a throw-away first case, the raw
    growth of a forward was +80 MB instead of +46 MB (the first case's frees raise glibc's mmap threshold, so later
    transients stay in the heap) and one LoRA case read 3.2 MB in use instead of ~37 MB, hiding what is tested.
    """
    root = tmp_path_factory.mktemp("host_memory")
    state = random_state(BIG, seed=1)
    big = save_native(state, BIG, root / "blocks16")
    small_state = {k: v for k, v in state.items() if not k.startswith("blocks.") or int(k.split(".")[1]) < 8}
    small = save_native(small_state, with_blocks(8), root / "blocks8")
    del state, small_state
    folders = {8: small, 16: big}
    loras = {n: write_block_lora(root / f"lora{n}.safetensors", with_blocks(n)) for n in (8, 16)}
    cases = {**{f"layerwise-{n}": dict(folder=str(folders[n]), residency="layerwise") for n in (8, 16)},
             "resident-16": dict(folder=str(big), residency="resident"),
             **{f"lora-{n}": dict(folder=str(folders[n]), residency="layerwise", lora=str(loras[n])) for n in (8, 16)}}
    outcomes = run_cases(MEASURE, cases, timeout_s=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    out = {}
    for case, parameters in cases.items():
        result = dict(forked_result(outcomes[case]))
        result["growth"] = result["after"] - result["before"]
        result["in_use"] = result["after_in_use"] - result["before"]
        result["file"] = (Path(parameters["folder"]) / "model.safetensors").stat().st_size
        result["lora_file"] = Path(parameters["lora"]).stat().st_size if "lora" in parameters else 0
        out[case] = result
    return out


def test_layerwise_load_and_forward_keep_anonymous_memory_flat(measured):
    runs = {n: measured[f"layerwise-{n}"] for n in (8, 16)}
    resident = measured["resident-16"]
    for n, run in runs.items():
        print(f"{n} blocks: file {run['file'] / 1e6:.0f} MB, RssAnon +{(run['loaded'] - run['before']) / 1e6:.1f} MB "
              f"after load_dit, +{run['growth'] / 1e6:.1f} MB after one forward "
              f"({100 * run['growth'] / run['file']:.1f} % of the file), +{run['in_use'] / 1e6:.1f} MB in use "
              f"({100 * run['in_use'] / run['file']:.1f} %)")
    # The several-hundred-MB checkpoint: load_dit and a forward add under 15 % of the file in anonymous memory,
    # even counting the pages glibc keeps cached.
    assert runs[16]["file"] > 400e6
    assert runs[16]["growth"] < 0.15 * runs[16]["file"]
    for run in runs.values():
        # Loading reads only the weights that stay on the device (norms, embeddings, output layer: read into the
        # process's own memory, a few MB whatever the block count, plus the module's own objects); the streamed
        # ones are not touched.
        assert run["loaded"] - run["before"] < FIXED_BYTES + (2 << 20) < 0.025 * run["file"]
        assert run["in_use"] < 2.5 * BLOCK_BYTES  # the staging ring of 2 blocks, whatever the block count
        assert run["second_in_use"] - run["after_in_use"] < 0.1 * BLOCK_BYTES  # a second pass adds nothing
    assert abs((runs[16]["loaded"] - runs[16]["before"]) - (runs[8]["loaded"] - runs[8]["before"])) < 1 << 20
    # 8 more blocks (210 MB more file) add less than a tenth of one block in anonymous memory in use.
    assert abs(runs[16]["in_use"] - runs[8]["in_use"]) < 0.1 * BLOCK_BYTES
    # Control: the resident loader reads every weight into the process's own memory, and the probe sees it.
    print(f"control, resident 16 blocks: RssAnon +{resident['growth'] / 1e6:.1f} MB, "
          f"+{resident['in_use'] / 1e6:.1f} MB in use (file {resident['file'] / 1e6:.0f} MB)")
    assert resident["in_use"] > 0.9 * resident["file"] > 5 * runs[16]["in_use"]


def test_a_lora_on_every_block_keeps_layerwise_memory_flat(measured):
    """The LoRA's factors stay memory-mapped and each block is folded when materialised: no host copy of the
    weights, and no growth with the number of blocks."""
    runs = {n: measured[f"lora-{n}"] for n in (8, 16)}
    for n, run in runs.items():
        print(f"{n} blocks + LoRA ({run['lora_file'] / 1e6:.0f} MB): RssAnon +{run['in_use'] / 1e6:.1f} MB in "
              f"use after one forward ({100 * run['in_use'] / run['file']:.1f} % of the file)")
        assert run["loaded"] - run["before"] < FIXED_BYTES + (2 << 20)  # the fixed weights, as without a LoRA
        assert run["in_use"] < 2.5 * BLOCK_BYTES  # the staging ring of 2 blocks, whatever the block count
        assert run["second_in_use"] - run["after_in_use"] < 0.1 * BLOCK_BYTES
    assert abs(runs[16]["in_use"] - runs[8]["in_use"]) < 0.1 * BLOCK_BYTES
