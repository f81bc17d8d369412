"""Components that do not belong to one H3 model are refused when the pipeline is set up, from their headers,
naming both files and the two widths (a text encoder of another width used to fail inside the transformer at the
first forward; a VAE with other latent channels after all the sampling, naming no file)."""

from __future__ import annotations

import dataclasses

import pytest
from h3_fixtures import reference_model, save_comfy

from h3_core.errors import CheckpointError
from h3_core.pipeline import H3Pipeline
from h3_core.sources import resolve_model
from h3_core.sources.tiny_default import TINY_DIT

# (which width of the tiny transformer changes, the component it no longer fits, the message's middle)
MISMATCHES = [
    ({"text_dim": 48}, "text_encoder", "takes text features of width 48 but the text encoder ({}) produces text "
                                       "features of width 32"),
    ({"in_channels": 16}, "video_vae", "takes video latents of 16 channels but the video VAE ({}) has latents of "
                                       "24 channels"),
    ({"audio_in_channels": 16}, "audio_vae", "takes audio latents of 16 channels but the audio VAE ({}) has "
                                             "latents of 32 channels"),
]


@pytest.mark.parametrize("change,component,middle", MISMATCHES, ids=[m[1] for m in MISMATCHES])
def test_mismatched_components_are_refused_at_setup(tiny, tmp_path, change, component, middle):
    config = dataclasses.replace(TINY_DIT, **change)
    transformer = save_comfy(reference_model(config, seed=2), config, tmp_path / "minimax_h3_other.safetensors")
    sources = resolve_model(tiny).replace(transformer=transformer)
    with pytest.raises(CheckpointError) as info:
        H3Pipeline(sources)
    other = getattr(sources, component)
    what = component.replace("_vae", " VAE").replace("_", " ")
    assert str(info.value) == (f"the transformer ({transformer}) {middle.format(other)}: they are not parts of the "
                               f"same H3 model. Use the {what} released with this transformer.")
    assert info.value.path == other


def test_matching_components_pass(tiny):
    pipe = H3Pipeline(resolve_model(tiny))  # the tiny model's own four components: no error
    assert pipe.loaded == ()  # checked from the headers: nothing was loaded
