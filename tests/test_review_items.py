"""Code-review items of issue 14: `H3DiT.close()`, the MPS chunk caps, the reclaim order, options that were
silently dropped (`return_dict`, unknown device types) and errors that were swallowed (cudart statuses)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import h3_core
from h3_core.runtime import AllResident
from h3_fixtures import packed_inputs
from offload_fixtures import SMALL, random_state, same_outputs, save_native


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_native(random_state(SMALL, seed=11), SMALL, tmp_path_factory.mktemp("review") / "native")


@pytest.fixture(scope="module")
def inputs():
    return packed_inputs(SMALL, seed=5)


def forward(model, inputs):
    with torch.no_grad():
        return model(**inputs)


# ---- H3DiT.close() -------------------------------------------------------------------------------------------------


def test_close_leaves_a_layerwise_transformer_usable_and_resident(checkpoint, inputs):
    reference = forward(h3_core.load_dit(checkpoint), inputs)
    model = h3_core.load_dit(checkpoint, residency="layerwise")
    forward(model, inputs)
    model.close()
    assert isinstance(model.block_residency, AllResident) and isinstance(model.adaln_residency, AllResident)
    assert all(p.numel() > 1 for p in model.parameters())  # no placeholder is left bound
    assert same_outputs(forward(model, inputs), reference)
    model.close()  # idempotent
    assert same_outputs(forward(model, inputs), reference)


def test_close_keeps_the_loras_of_the_streamed_weights(checkpoint, inputs, tmp_path):
    g = torch.Generator().manual_seed(3)
    inner, hidden, ffn = SMALL.inner_dim, SMALL.hidden_size, SMALL.ffn_dim
    lora = {"blocks.1.attn.qkv_proj.lora_A.weight": torch.randn(2, hidden, generator=g),
            "blocks.1.attn.qkv_proj.lora_B.weight": torch.randn(3 * inner, 2, generator=g) * 0.3,
            "blocks.2.mlp.fc1.lora_A.weight": torch.randn(2, hidden, generator=g),
            "blocks.2.mlp.fc1.lora_B.weight": torch.randn(2 * ffn, 2, generator=g) * 0.3}
    path = tmp_path / "lora.safetensors"
    save_file(lora, str(path))
    with_lora = forward(h3_core.load_dit(checkpoint, loras=[(path, 0.7)]), inputs)
    assert not torch.equal(with_lora[0], forward(h3_core.load_dit(checkpoint), inputs)[0])
    model = h3_core.load_dit(checkpoint, residency="layerwise", loras=[(path, 0.7)])
    model.close()
    assert same_outputs(forward(model, inputs), with_lora)
