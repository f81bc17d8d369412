"""Audio health: a decoded waveform checked before anything is saved.

Audio that fails without an error (NaN that breaks the video writer later, a constant -1.0 or 0.0 waveform, silence,
distortion) is found here, right after the audio decode (local runs: `H3Pipeline.decode_audio`; servers: the soundtrack
of the downloaded mp4, `RemoteEngine`). `check_audio(waveform)` returns the findings; `raise_audio_errors` raises one
`AudioHealthError` for the errors among them and returns the warnings (audio that may still be usable).

What the thresholds rest on
---------------------------
The H3 audio VAE's decoder (BigVGAN: SnakeBeta activations, a bias-free final convolution) ends in a hard clamp to
[-1, 1], not a tanh: in the original code, diffusers 0.42.1 (`AutoencoderKLMiniMaxH3Audio`, `torch.clamp(..., -1, 1)`),
ComfyUI core (`comfy/ldm/minimax/audio_vae.py`, `.clamp_(-1.0, 1.0)`) and here (`models/audio_vae.py`). So:

* a decoder driven far outside its range (latents not normalised or normalised twice, a transformer that overflowed,
  a wrong file) does not distort softly: its samples sit on the clamp's rails at exactly +-1.0, and when every sample
  does the waveform is the "constant -1.0" users report. A sample at |x| >= 0.999 (`CLIP_LEVEL`: the rail, with room
  for the AAC round trip of a server's mp4) counts as clipped.
* NaN passes through the clamp (torch.clamp keeps NaN): non-finite samples reach the writer unless checked here.
* exact zeros need zero weights or a path that never reached the decoder: a sampled latent drives the SnakeBeta /
  convolution stack to a waveform that moves.

Measured outputs (`benchmarks/audio_health.py` prints them): the tiny random model's decode of normal latents is
noise at about -21 dBFS RMS, DC 0.5 % of its RMS, peaks near 0.53, nothing on the rails (tiny-v1, before its final
convolution was scaled to that, put 85 % of its samples on the rails: the check's clipping error, rightly); the
released-width decoder with synthetic weights (scaled 0.5 / sqrt(fan_in)) makes -62 dBFS noise, which the check calls
silence (a warning about those weights). The released weights cannot be measured here (they are not
downloaded by this pack's checks), so the margins come from what good audio looks like at 32 kHz over H3's 4 to 15 s:

* constant (error): a channel whose peak-to-peak is under one 16-bit step (2 / 65536 = 3.1e-5) is a constant in the
  written file; near-constant (error): a channel that moves less than -60 dBFS (std < 1e-3) around a level at least
  ten times that movement and at least 0.01: a DC level with a whisper on it, the same failure not quite on a rail.
* silence (warning): the whole clip's RMS of what moves (the standard deviation: a DC level is not heard) under
  -60 dBFS (0.001). Dialogue is mastered around -20 to -30 dBFS RMS,
  quiet music -40 to -50, film room tone -50 to -60: under -60 over the whole clip nothing is heard at a normal
  playback level. A warning, not an error: a prompt may ask for silence, and the decoder's quiet output is then valid.
* DC offset (warning): |mean| >= 0.1 x the channel's RMS and >= 0.01 (-40 dBFS). Recorded and mastered audio is
  high-passed near 20 Hz; over 4 s a partial cycle of a 20 Hz tone leaves a mean of about 0.4 % of its amplitude, so
  good audio sits far under 10 %. The SnakeBeta's sin^2 term is never negative, which gives the decoder a DC path
  only training removes. DC clicks when playback starts and stops and eats headroom; the audio is still usable.
* clipping (warning over 1 % of the samples, error over 50 %): speech has no sample at full scale and even loud music
  masters keep clipped samples well under 1 %; 1 % is 320 rail samples a second, audible as distortion. Over half the
  samples on the rails is the saturated decoder above, whatever moves between.

Cost: one `var_mean` and one `aminmax` per channel in the common case (the clipped share and the non-finite counts are
computed only when those cheap reductions point at them); `benchmarks/audio_health.py` measures it against the decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import H3Error

ERROR = "error"
WARNING = "warning"

SIXTEEN_BIT_STEP = 2.0 / 65536  # peak-to-peak under one 16-bit step: a constant once written
NEAR_CONSTANT_STD = 1e-3  # -60 dBFS of movement...
NEAR_CONSTANT_LEVEL_RATIO = 10.0  # ...around a level at least ten times larger
SILENCE_RMS = 1e-3  # -60 dBFS over the whole clip
DC_RATIO = 0.1  # |mean| against the channel's RMS
DC_MIN_LEVEL = 0.01  # -40 dBFS: smaller offsets are harmless
CLIP_LEVEL = 0.999  # the decoder's clamp rail (+-1.0), with room for an AAC round trip
CLIP_WARNING_SHARE = 0.01
CLIP_ERROR_SHARE = 0.5

EDGE_SAMPLES = 4096  # 128 ms at each end left out of the level statistics (see check_audio)

CHANNEL_NAMES = ("left", "right")


class AudioHealthError(H3Error):
    """The decoded audio failed its health check (see `audio_health`); `findings` are the errors (and the warnings
    that came with them), each an `AudioFinding`."""

    def __init__(self, message: str, findings=()):
        super().__init__(message)
        self.findings = tuple(findings)


@dataclass(frozen=True)
class AudioFinding:
    """One symptom of a waveform: `symptom` (a short name: "non-finite samples", "constant waveform", ...),
    `severity` (ERROR: nothing is saved; WARNING: the audio may still be usable), `detail` (the numbers, in words),
    `cause` (the likely cause) and `fix`; `numbers` holds the figures behind `detail`."""

    symptom: str
    severity: str
    detail: str
    cause: str
    fix: str
    numbers: dict = field(default_factory=dict)

    @property
    def message(self) -> str:
        return f"{self.symptom}: {self.detail}. Likely cause: {self.cause}. {self.fix}"

    def __str__(self) -> str:
        return self.message


def _dbfs(value: float) -> str:
    return "-inf dBFS" if value <= 0 else f"{20 * math.log10(value):.1f} dBFS"


def _channels(indices) -> str:
    names = [CHANNEL_NAMES[i] if i < len(CHANNEL_NAMES) else f"channel {i}" for i in indices]
    return " and ".join(names) + (" channel" if len(names) == 1 else " channels")


class _Wording:
    """The causes and fixes, for audio this machine decoded or a server's soundtrack."""

    def __init__(self, remote: bool):
        self.remote = remote
        self.decoder = "the server's audio VAE decoder" if remote else "the audio VAE's decoder"
        self.rerun = ("check the server's H3 version and its audio VAE weights, or run locally to compare" if remote
                      else "check the audio VAE file (compare its checksum with the release), and run the transformer "
                           "in bfloat16 or float32 rather than float16")


def check_audio(waveform: torch.Tensor, *, remote: bool = False) -> list[AudioFinding]:
    """The findings of a decoded waveform `[channels, samples]` (32 kHz, float, expected in [-1, 1]); an empty list
    for healthy audio. `remote`: the waveform is a server's soundtrack (the causes and fixes name the server)."""
    if not isinstance(waveform, torch.Tensor) or waveform.ndim != 2 or not waveform.is_floating_point() \
            or waveform.shape[1] < 1:
        got = tuple(waveform.shape) if isinstance(waveform, torch.Tensor) else type(waveform).__name__
        raise H3Error(f"waveform: expected a float tensor [channels, samples], got {got}.")
    words = _Wording(remote)
    x = waveform.detach()
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    low, high = torch.aminmax(x, dim=1)  # over the whole clip: a NaN or an Inf anywhere shows in these
    if not bool(torch.isfinite(low).all() and torch.isfinite(high).all()):
        return [_non_finite(x, words)]
    # The level statistics skip the clip's edges: an AAC soundtrack ramps in and out there (a constant -1.0 sent
    # through AAC differs from its level in its first and last ~2600 samples).
    edge = EDGE_SAMPLES if x.shape[1] > 4 * EDGE_SAMPLES else 0
    body = x[:, edge: x.shape[1] - edge]
    var, mean = torch.var_mean(body, dim=1, correction=0)
    var, mean, low, high = var.tolist(), mean.tolist(), low.tolist(), high.tolist()
    stds = [math.sqrt(v) for v in var]
    rms = [math.sqrt(v + m * m) for v, m in zip(var, mean)]
    findings = []

    quiet = [i for i in range(len(var)) if stds[i] < NEAR_CONSTANT_STD]
    spans = {}
    if quiet:  # rare: the body's own peak-to-peak, for the channels that hardly move
        body_low, body_high = torch.aminmax(body[quiet], dim=1)
        spans = dict(zip(quiet, (body_high - body_low).tolist()))
    constant = [i for i in quiet if spans[i] < SIXTEEN_BIT_STEP]
    near = [i for i in quiet if i not in constant
            and abs(mean[i]) >= max(DC_MIN_LEVEL, NEAR_CONSTANT_LEVEL_RATIO * stds[i])]
    if constant:
        findings.append(_constant(constant, [mean[i] for i in constant], len(var), words))
    if near:
        findings.append(_near_constant(near, [mean[i] for i in near], [stds[i] for i in near], words))
    stuck = set(constant) | set(near)

    sound = math.sqrt(sum(var) / len(var))  # the RMS of what moves (a DC level is not heard)
    if not stuck and sound < SILENCE_RMS:
        findings.append(AudioFinding(
            "silence", WARNING, f"the whole clip's RMS is {_dbfs(sound)} (under {_dbfs(SILENCE_RMS)}; its peak "
            f"{max(max(abs(v) for v in low), max(high)):.2g}): nothing will be heard",
            "the prompt asked for no sound, or the audio latents carry almost nothing",
            "Describe the sound you want in the prompt (dialogue, effects, music), or another seed; the audio is "
            "saved as it is.", {"rms": sound}))

    offsets = [i for i in range(len(var)) if i not in stuck and abs(mean[i]) >= DC_MIN_LEVEL
               and abs(mean[i]) >= DC_RATIO * rms[i]]
    if offsets:
        shown = ", ".join(f"{CHANNEL_NAMES[i] if i < 2 else i} mean {mean[i]:+.3f} = {abs(mean[i]) / rms[i]:.0%} "
                          f"of its RMS" for i in offsets)
        findings.append(AudioFinding(
            "DC offset", WARNING, f"the {_channels(offsets)} sit off zero ({shown}; good audio stays under "
            f"{DC_RATIO:.0%}); playback will click when it starts and stops",
            f"{words.decoder} has a DC path (its SnakeBeta activations are never negative) that its latents drive when "
            "they are off their trained range", "The audio is saved as it is; a high-pass filter (20 Hz) removes the "
            "offset; another seed may not have it.",
            {"mean": [mean[i] for i in offsets], "rms": [rms[i] for i in offsets]}))

    if max(high) >= CLIP_LEVEL or min(low) <= -CLIP_LEVEL:
        clipped = [i for i in range(len(var)) if i not in stuck]
        if clipped:
            share = float((x[clipped].abs() >= CLIP_LEVEL).sum()) / (len(clipped) * x.shape[1])
            if share >= CLIP_ERROR_SHARE:
                findings.append(AudioFinding(
                    "clipping", ERROR, f"{share:.0%} of the samples sit on the decoder's +-1.0 clamp (over "
                    f"{CLIP_ERROR_SHARE:.0%}: a saturated, distorted waveform, not sound)",
                    f"{words.decoder} was driven far outside its range: audio latents not normalised (or normalised "
                    "twice), a transformer that overflowed, or a wrong or corrupt audio VAE file",
                    f"Nothing was saved; {words.rerun}.", {"clipped_share": share}))
            elif share >= CLIP_WARNING_SHARE:
                findings.append(AudioFinding(
                    "clipping", WARNING, f"{share:.1%} of the samples sit on the +-1.0 clamp (over "
                    f"{CLIP_WARNING_SHARE:.0%}; loud masters stay under it): audible distortion on peaks",
                    f"{words.decoder} output went past full scale on loud passages",
                    "The audio is saved as it is; another seed, or a prompt asking for quieter sound, may not clip.",
                    {"clipped_share": share}))
    return findings


def _non_finite(x: torch.Tensor, words: _Wording) -> AudioFinding:
    nan = int(torch.isnan(x).sum())
    inf = int(torch.isinf(x).sum())
    return AudioFinding(
        "non-finite samples", ERROR, f"{nan} NaN and {inf} Inf among {x.numel()} samples (a video writer fails on "
        "them, or writes noise)",
        f"{words.decoder} overflowed or read a corrupt weight, or its latents were not finite",
        f"Nothing was saved; {words.rerun}.", {"nan": nan, "inf": inf, "samples": x.numel()})


def _constant(channels, levels, total, words: _Wording) -> AudioFinding:
    level = levels[0]
    which = "every channel" if len(channels) == total else f"the {_channels(channels)}"
    if all(abs(v) < SIXTEEN_BIT_STEP for v in levels):
        return AudioFinding(
            "constant 0.0 waveform", ERROR, f"{which} is exactly silent: all samples 0.0 (no movement of one 16-bit "
            "step)",
            ("the server's soundtrack is empty or zero (an mp4 without sound, or a decoder that never ran)"
             if words.remote else
             "zeros never come out of the decoder from sampled latents: its weights are zero or missing (a wrong or "
             "damaged audio VAE file), or the waveform was replaced before this check"),
            f"Nothing was saved; {words.rerun}.", {"levels": list(levels)})
    on_rail = all(abs(v) >= CLIP_LEVEL for v in levels)
    return AudioFinding(
        f"constant {level:+.1f} waveform" if on_rail else "constant waveform", ERROR,
        f"{which} holds one value ({', '.join(f'{v:+.4f}' for v in levels)}) for the whole clip",
        (f"{words.decoder} saturated: every sample landed on its +-1.0 clamp, so its latents were far outside the "
         "trained range (not normalised, normalised twice, or an overflowed transformer), or the audio VAE file is "
         "wrong or corrupt") if on_rail else
        f"{words.decoder} produced a DC level only: its latents carry no signal, or its weights are damaged",
        f"Nothing was saved; {words.rerun}.", {"levels": list(levels)})


def _near_constant(channels, levels, stds, words: _Wording) -> AudioFinding:
    shown = ", ".join(f"{v:+.4f} +- {s:.1e}" for v, s in zip(levels, stds))
    return AudioFinding(
        "near-constant waveform", ERROR, f"the {_channels(channels)} stay at one level ({shown}: movement under "
        f"{_dbfs(NEAR_CONSTANT_STD)}, a tenth of the level or less)",
        f"{words.decoder} was driven against its clamp or to a DC level: latents far outside the trained range, or a "
        "wrong or corrupt audio VAE file", f"Nothing was saved; {words.rerun}.",
        {"levels": list(levels), "stds": list(stds)})


def raise_audio_errors(findings, source: str = "the decoded audio") -> list[AudioFinding]:
    """Raise one `AudioHealthError` naming every error of `findings` (with `source`: where the audio came from);
    return the warnings when there is no error."""
    errors = [f for f in findings if f.severity == ERROR]
    if errors:
        text = "; and ".join(f.message for f in errors)
        raise AudioHealthError(f"{source} failed its audio health check: {text}", findings)
    return [f for f in findings if f.severity == WARNING]


def warning_line(finding: AudioFinding) -> str:
    """One line for a log, a CLI's stderr or a node's text."""
    return f"audio warning: {finding.message}"
