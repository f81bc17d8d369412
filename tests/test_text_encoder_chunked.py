"""The text encoder's row-chunked path (long prompts): the same states as the fused path."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

import h3_core
from h3_core.runtime import ChunkingError
from h3_core.sources import resolve_model
from h3_core.sources.tiny_default import ensure_tiny_model

PROMPT = ("A red fox runs across a snowy field at dawn, its breath visible in the cold air; the singer whispers the "
          "lyrics while a piano plays softly in the background.")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return resolve_model(ensure_tiny_model(tmp_path_factory.mktemp("cache")))


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64, 10_000])
@pytest.mark.parametrize("with_image", [False, True])
def test_chunked_states_equal_fused(source, chunk_size, with_image):
    images = [Image.new("RGB", (64, 48), (200, 30, 30))] if with_image else []
    fused = h3_core.load_text_encoder(source.text_encoder, layer=source.text_encoder_layer)
    chunked = h3_core.load_text_encoder(source.text_encoder, layer=source.text_encoder_layer, chunk_size=chunk_size)
    want, tags = fused.encode(PROMPT, images)
    got, got_tags = chunked.encode(PROMPT, images)
    assert want.shape[0] > 30 and torch.equal(tags, got_tags)
    if chunk_size >= want.shape[0]:
        assert torch.equal(got, want)  # one chunk is the fused path
    else:
        assert rel(got, want) <= 1e-6


def test_chunked_and_layerwise_together(source):
    fused = h3_core.load_text_encoder(source.text_encoder, layer=source.text_encoder_layer)
    both = h3_core.load_text_encoder(source.text_encoder, layer=source.text_encoder_layer, chunk_size=8,
                                     residency="layerwise")
    assert rel(both.encode(PROMPT)[0], fused.encode(PROMPT)[0]) <= 1e-6


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_chunk_size(source, bad):
    with pytest.raises(ChunkingError, match="chunk_size must be a positive integer"):
        h3_core.load_text_encoder(source.text_encoder, layer=source.text_encoder_layer, chunk_size=bad)


def test_fused_and_chunked_enter_the_same_layer_code(source, monkeypatch):
    """Fused (no chunk size) and chunked prompts run through the same attention and MLP loops: each decoder layer
    enters `Attention.forward` once and the MLP once per row chunk; only the row ranges differ."""
    from h3_core.models.text_encoder import Attention, SwiGLU

    calls = {"attention": [], "mlp_rows": []}
    attention_forward, mlp_forward = Attention.forward, SwiGLU.forward

    def counting_attention(self, x, cos, sin, chunks):
        calls["attention"].append(chunks.size)
        return attention_forward(self, x, cos, sin, chunks)

    def counting_mlp(self, x):
        calls["mlp_rows"].append(x.shape[1])
        return mlp_forward(self, x)

    monkeypatch.setattr(Attention, "forward", counting_attention)
    monkeypatch.setattr(SwiGLU, "forward", counting_mlp)
    fused = h3_core.load_text_encoder(source.text_encoder, layer=source.text_encoder_layer)
    chunked = h3_core.load_text_encoder(source.text_encoder, layer=source.text_encoder_layer, chunk_size=16)
    layers = len(fused.language_model.layers)

    want, _ = fused.encode(PROMPT)
    rows = want.shape[0]
    assert calls == {"attention": [None] * layers, "mlp_rows": [rows] * layers}
    calls["attention"].clear()
    calls["mlp_rows"].clear()

    got, _ = chunked.encode(PROMPT)
    sizes = [16] * (rows // 16) + ([rows % 16] if rows % 16 else [])
    assert calls == {"attention": [16] * layers, "mlp_rows": sizes * layers}
    assert rel(got, want) <= 1e-6
