"""A copy of the embedded tiny model whose audio decoder has one AMP block of one dilation per upsampling stage
instead of three of three: the tiny model's audio decode takes about 20 s for a 15 s window on a CPU (nine
convolutions per stage at up to 32 kHz), so a 45 s video of four windows would take minutes. Everything else (the transformer,
the text encoder, the video VAE, the grid, the sample rate) is the tiny model's."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def tinier_audio_model(tiny: Path, folder: Path) -> Path:
    """`tiny` copied to `folder` with a narrow random audio VAE (same layout, widths read from the shapes)."""
    from h3_core.models.audio_vae import AudioVAE, AudioVAEConfig
    from h3_core.sources.tiny_default import TINY_AUDIO_OUTPUT_SCALE, _randomize, _save

    if (folder / "model_index.json").exists():
        return folder
    shutil.copytree(tiny, folder)
    g = torch.Generator().manual_seed(3)
    mean = tuple((0.1 * torch.randn(32, generator=g)).tolist())
    std = tuple((0.8 + 0.4 * torch.rand(32, generator=g)).tolist())
    audio = AudioVAE(AudioVAEConfig(encoder_dim=4, latent_dim=64, decoder_dim=128,
                                    resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),),
                                    latents_mean=mean, latents_std=std))
    _randomize(audio, seed=5)
    with torch.no_grad():
        audio.decoder.conv_post.weight.mul_(TINY_AUDIO_OUTPUT_SCALE)
    state = dict(audio.state_dict())
    state["latents_mean"] = torch.tensor(mean)
    state["latents_std"] = torch.tensor(std)
    target = folder / "vae" / "minimax_h3_audio_vae_tiny_fp32.safetensors"
    target.unlink()
    _save(state, target)
    manifest = folder / "tiny_manifest.json"
    if manifest.exists():
        manifest.unlink()
    return folder
