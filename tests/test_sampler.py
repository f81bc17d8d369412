"""Sampler math against the reference scheduler (diffusers MiniMaxH3Scheduler)."""

from __future__ import annotations

import pytest
import torch

from h3_core.errors import H3Error
from h3_core.pipeline.sampler import Schedule, euler_step, initial_noise, noise_condition, sigma_schedule

diffusers = pytest.importorskip("diffusers")


@pytest.mark.parametrize("steps", [2, 3, 4, 10, 20, 30, 50, 100])
@pytest.mark.parametrize("shift", [12.0, 3.0, 1.0, 5.5])
def test_sigma_schedule_matches_reference(steps, shift):
    ref = diffusers.MiniMaxH3Scheduler(shift=shift)
    ref.set_timesteps(steps)
    ours = sigma_schedule(steps, shift)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, ref.sigmas)
    assert ours[-1] == 0 and ours[0] == 1


def test_schedule_values_from_the_spec():
    s = Schedule.build(50)
    assert s.num_model_calls == 49
    assert abs(float(s.video_sigmas[1]) - 0.99827) < 1e-5
    assert abs(float(s.audio_sigmas[1]) - 0.99310) < 1e-5
    assert abs(float(s.video_sigmas[-2]) - 0.2) < 1e-6
    assert abs(float(s.video_timesteps[-1]) - 0.8) < 1e-6
    assert abs(float(s.audio_timesteps[-1]) - 0.941) < 1e-3
    assert float(s.video_timesteps[0]) == 0.0 and float(s.audio_timesteps[0]) == 0.0


def test_euler_loop_matches_reference_bitwise():
    steps = 12
    video_ref, audio_ref = diffusers.MiniMaxH3Scheduler(shift=12.0), diffusers.MiniMaxH3Scheduler(shift=3.0)
    video_ref.set_timesteps(steps)
    audio_ref.set_timesteps(steps)
    ours = Schedule.build(steps)
    g = torch.Generator().manual_seed(0)
    x_ref = x = torch.randn(40, 16, generator=g)
    a_ref = a = torch.randn(10, 8, generator=g)
    for i in range(ours.num_model_calls):
        v, va = torch.randn(40, 16, generator=g), torch.randn(10, 8, generator=g)
        assert ours.video_timesteps[i] == video_ref.timesteps[i]
        x_ref = video_ref.step(v, video_ref.timesteps[i], x_ref, return_dict=False)[0]
        a_ref = audio_ref.step(va, audio_ref.timesteps[i], a_ref, return_dict=False)[0]
        x = euler_step(x, v, ours.video_timesteps[i], ours.video_sigmas[i], ours.video_sigmas[i + 1])
        a = euler_step(a, va, ours.audio_timesteps[i], ours.audio_sigmas[i], ours.audio_sigmas[i + 1])
        assert torch.equal(x, x_ref) and torch.equal(a, a_ref), i


def test_last_step_lands_on_the_denoised_estimate():
    s = Schedule.build(3)
    x, v = torch.randn(4, 3), torch.randn(4, 3)
    out = euler_step(x, v, s.video_timesteps[-1], s.video_sigmas[-2], s.video_sigmas[-1])
    assert torch.allclose(out, x + (1 - s.video_timesteps[-1]) * v)


def test_condition_noise_matches_reference_scale_noise():
    clean, noise = torch.randn(1, 4, 1, 2, 2), torch.randn(1, 4, 1, 2, 2)
    ref = diffusers.MiniMaxH3Scheduler().scale_noise(clean, 0.999, noise)
    assert torch.equal(noise_condition(clean, noise), ref)


def test_seeded_noise_is_reproducible_and_ordered():
    conds, video, audio = initial_noise((1, 4, 2, 4, 6), 10, 8, seed=7, condition_shapes=[(1, 4, 1, 4, 6)])
    again = initial_noise((1, 4, 2, 4, 6), 10, 8, seed=7, condition_shapes=[(1, 4, 1, 4, 6)])
    assert torch.equal(video, again[1]) and torch.equal(audio, again[2]) and torch.equal(conds[0], again[0][0])
    # One stream in the order condition -> video -> audio (the diffusers convention).
    g = torch.Generator().manual_seed(7)
    assert torch.equal(conds[0], torch.randn(1, 4, 1, 4, 6, generator=g))
    assert torch.equal(video, torch.randn(1, 4, 2, 4, 6, generator=g))
    assert torch.equal(audio, torch.randn(10, 8, generator=g))
    assert not torch.equal(initial_noise((1, 4, 2, 4, 6), 10, 8, seed=8)[1], video)


def test_bad_schedule_arguments():
    with pytest.raises(H3Error, match="steps must be at least 2"):
        sigma_schedule(1, 12.0)
    with pytest.raises(H3Error, match="shift must be positive"):
        sigma_schedule(10, 0.0)
