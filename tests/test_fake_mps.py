"""The MPS path's rules run on a fake MPS (tests/fake_mps.py): no fp8 / float64, a per-op buffer limit, frees
deferred until synchronise."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fake_mps import FakeMps, FakeMpsError
from h3_core.runtime import ComponentPlan, Platform, check_admission, admission_violations
from h3_core.runtime.platform import GiB

MiB = 1 << 20


def test_the_fake_refuses_float64_and_fp8_as_mps_does():
    fake = FakeMps()
    x = torch.ones(4, dtype=torch.bfloat16)
    with fake.active():
        assert (x.float() * 2).dtype == torch.float32  # what MPS has works
        for dtype in (torch.float64, torch.float8_e4m3fn, torch.float8_e5m2):
            with pytest.raises(FakeMpsError, match="MPS has no"):
                x.to(dtype)
        with pytest.raises(FakeMpsError, match="MPS has no"):
            torch.zeros(2, dtype=torch.float64)
    assert x.double().dtype == torch.float64  # outside the fake: the CPU


def test_the_fake_refuses_an_op_over_its_buffer_limit_and_counts_sdpa_scores():
    fake = FakeMps(max_buffer_bytes=MiB)
    with fake.active():
        torch.empty(MiB, dtype=torch.uint8)
        with pytest.raises(FakeMpsError, match="over MPS's 1048576-byte limit"):
            torch.empty(MiB + 1, dtype=torch.uint8)
        q = torch.zeros(1, 4, 256, 8)  # scores: 4 x 256 x 512 x 4 bytes = 2 MiB, the output only 32 KiB
        kv = torch.zeros(1, 4, 512, 8)
        with pytest.raises(FakeMpsError, match="scores"):
            F.scaled_dot_product_attention(q, kv, kv)
        F.scaled_dot_product_attention(q[:, :, :128], kv, kv)


def test_frees_are_held_until_synchronize_and_reclaim_releases_them():
    from h3_core.runtime.offload_backends import SynchronousBackend

    fake = FakeMps()
    platform = fake.platform()
    buffer = platform.empty(3 * MiB)
    assert (platform.allocated_bytes(), platform.driver_bytes()) == (3 * MiB, 3 * MiB)
    del buffer
    assert (platform.allocated_bytes(), platform.driver_bytes()) == (0, 3 * MiB)  # freed, not yet given back
    platform.reclaim()  # synchronise, then empty the cache
    assert platform.driver_bytes() == 0 and fake.synchronizations == 1
    # Why the MPS default reclaims at every release: the backend's reclaim path on the fake MPS.
    backend = SynchronousBackend(platform.device, platform=platform)
    assert backend.reclaim_every == platform.default_reclaim_every == 1


def test_mps_admission_and_chunk_caps_on_the_fake_platform():
    platform = FakeMps().platform()
    assert platform == Platform("mps") and platform.unified_memory and not platform.asynchronous_copies
    from h3_core.components import COMPONENTS

    layerwise = {name: ComponentPlan("layerwise", "mps") for name in COMPONENTS}
    check_admission(layerwise, platform)
    assert admission_violations({**layerwise, "text_encoder": ComponentPlan("resident", "mps")}, platform)
    from h3_core.runtime.chunking import backend_row_limit

    @dataclasses.dataclass
    class Widths:  # the released DiT's widths
        hidden_size: int = 5120
        inner_dim: int = 5120
        ffn_dim: int = 13824
        num_attention_heads: int = 40

    chunking = platform.chunking
    assert chunking.max_buffer_bytes == 4 * GiB
    # 16k rows: the score matrix caps query rows at 4 GiB / (40 heads x 16k keys x 2 bytes), and the long-sequence
    # rule at 2048 rows; a short sequence is one chunk.
    assert backend_row_limit(16_384, Widths(), element_bytes=2, backend=chunking) == 2048
    assert backend_row_limit(2_000, Widths(), element_bytes=2, backend=chunking) is None


def _tiny_language_model():
    from h3_core.models.text_encoder import LanguageModel, LanguageModelConfig

    torch.manual_seed(0)
    config = LanguageModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, mrope_section=(2, 1, 1))
    return LanguageModel(config, 1).eval()


def test_text_encoder_attention_keeps_under_the_mps_buffer_limit():
    """A long prompt's fused attention materialises a score matrix over MPS's per-op limit (here scaled down: 4
    heads x 512 x 512 float32 scores = 4 MiB against 1 MiB); with the platform's chunking the text encoder caps its
    query rows as the DiT does, and the states equal the fused ones."""
    from h3_core.models.text_encoder import text_positions

    model = _tiny_language_model()
    rows = 512
    x = torch.randn(1, rows, 32)
    with torch.no_grad():
        fused = model(x, text_positions(rows))
        fake = FakeMps(max_buffer_bytes=MiB)
        with fake.active(), pytest.raises(FakeMpsError, match="scores"):
            model(x, text_positions(rows))  # no caps: the fused call is over the limit
        model.chunking = dataclasses.replace(fake.platform().chunking, max_buffer_bytes=MiB)
        assert model.chunk_rows(rows, 1, 4) == 128
        fake = FakeMps(max_buffer_bytes=MiB)
        with fake.active():
            capped = model(x, text_positions(rows))
        assert 0 < fake.largest_op_bytes <= MiB
        torch.testing.assert_close(capped, fused, rtol=1e-5, atol=1e-5)
        model.chunk_size = 256  # an explicit size above the limit is lowered to it, with a warning
        from h3_core.runtime.chunking import ChunkSizeClamped

        with pytest.warns(ChunkSizeClamped), fake.active():
            model(x, text_positions(rows))
        model.chunk_size = 64  # below it: kept
        assert model.chunk_rows(rows, 1, 4) == 64
