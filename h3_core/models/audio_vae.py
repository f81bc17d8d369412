"""The H3 audio VAE: a DAC-style waveform encoder with a causal-attention projection to 32 latent channels, and a
BigVGAN-style decoder with anti-aliased SnakeBeta activations. Mono network, 32 kHz, hop 800 (40 latents per
second); stereo travels as two batch items. Always float32: bf16 audibly degrades the output.

Module names follow the original checkpoint (which the diffusers layout keeps verbatim). Convolutions that the
checkpoint stores with weight norm (`weight_g` / `weight_v`) are plain convolutions here: the loader folds the pair
into `weight` once, exactly as `torch.nn.utils.weight_norm` would compute it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import H3Error
from ..runtime.chunking import no_reclaim
from ..runtime.phase_scoped import PhaseScopedWeights
from ..runtime.residency import AllResident

# Published per-channel latent statistics of the released audio VAE (`audio_vae/config.json`); used when a ComfyUI
# file does not carry them.
PUBLISHED_LATENTS_MEAN = (
    -0.020211687488382354, 0.3876466479950502, -0.04398279799186767, -0.28591514936373,
    0.08179686214561671, -0.35782641352446604, 0.040623809960919084, -0.01552534501956604,
    -0.223362481667332, 0.1821006842509091, 0.2941778783780663, -0.07901167601970885,
    -0.056815072777201, -0.3699028221860095, -0.31616315591624855, 0.5905951377425391,
    -0.052139568068853864, 0.013673160263486295, -0.03691647864630577, 0.09732660653298163,
    -0.3394662328788498, -0.30685677538541667, -0.24504598907458763, -0.034698524462007344,
    0.02868032184767538, -0.21217779266454084, -0.1678263169941987, 0.3221287889040614,
    -0.1223055851554907, 0.4356604928128464, -0.0502599202236253, 0.3979258376211797,
)
PUBLISHED_LATENTS_STD = (
    1.6895524230479284, 2.76263727217653, 1.7945344281264435, 1.6801681847309828,
    1.6390226546605453, 2.7788298348882177, 1.7659090095747236, 1.6199757612137327,
    2.6336525640336896, 1.8539356672817833, 2.5056497896915633, 1.811019237886178,
    1.9579657790720237, 1.6685498243529284, 1.4922469314453364, 3.298670198067373,
    1.9491804496832168, 1.8720003270431442, 1.8334080103291832, 1.6488070416529093,
    1.6176957696319716, 1.9131449234774398, 1.5695245398428617, 1.6943659940415912,
    1.8318420762504692, 1.5540637421583379, 1.9344930328968526, 1.599198216109855,
    1.718045989838149, 1.6307219190837705, 1.8661226051202384, 1.5613768203168363,
)
STEREO_CHANNELS = 2
# Anti-aliased activations resample x2 with 12-tap Kaiser-sinc filters (the checkpoint also stores them as buffers).
RESAMPLE_RATIO = 2
RESAMPLE_TAPS = 12


def kaiser_sinc_lowpass(taps: int, cutoff: float, half_width: float) -> torch.Tensor:
    """A windowed-sinc low-pass `[1, 1, taps]` (unit DC gain), Kaiser window sized by the standard Kaiser formula for
    a transition band of `2 * half_width` (both in cycles per sample)."""
    half = taps // 2
    attenuation = 2.285 * (half - 1) * math.pi * (4 * half_width) + 7.95
    if attenuation > 50.0:
        beta = 0.1102 * (attenuation - 8.7)
    elif attenuation >= 21.0:
        beta = 0.5842 * (attenuation - 21) ** 0.4 + 0.07886 * (attenuation - 21.0)
    else:
        beta = 0.0
    window = torch.kaiser_window(taps, beta=beta, periodic=False)
    # Sample times centred on the filter; an even length puts the centre between two taps.
    time = torch.arange(-half, half) + 0.5 if taps % 2 == 0 else torch.arange(taps) - half
    if cutoff == 0:
        return torch.zeros(1, 1, taps)
    taps_values = 2 * cutoff * window * torch.sinc(2 * cutoff * time)
    return (taps_values / taps_values.sum()).view(1, 1, taps)


@functools.lru_cache(maxsize=None)
def _resampling_filter_on_cpu(ratio: int, taps: int) -> torch.Tensor:
    with torch.device("cpu"):
        return kaiser_sinc_lowpass(taps, cutoff=0.5 / ratio, half_width=0.6 / ratio)


def resampling_filter(ratio: int = RESAMPLE_RATIO, taps: int = RESAMPLE_TAPS) -> torch.Tensor:
    """The anti-aliasing filter of an x`ratio` resampler: cutoff at the new Nyquist, transition 0.6 / ratio.

    Computed once on the CPU and copied to the default device: the decoder holds 250 of them, and computing each on
    the meta device (as the loaders build the model) took seconds.
    """
    return _resampling_filter_on_cpu(ratio, taps).to(torch.get_default_device(), copy=True)


@dataclass(frozen=True)
class AudioVAEConfig:
    """Architecture of the audio VAE. Defaults are the released model."""

    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (2, 4, 4, 5, 5)
    latent_dim: int = 2048
    latent_channels: int = 32
    num_attention_heads: int = 8
    decoder_dim: int = 1024
    decoder_rates: tuple[int, ...] = (5, 5, 2, 2, 2, 2, 2)
    decoder_kernel_sizes: tuple[int, ...] = (9, 9, 4, 4, 4, 4, 4)
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    sample_rate: int = 32000
    latents_mean: tuple[float, ...] = PUBLISHED_LATENTS_MEAN
    latents_std: tuple[float, ...] = PUBLISHED_LATENTS_STD

    def __post_init__(self):
        if math.prod(self.decoder_rates) != self.hop_length:
            raise ValueError(f"decoder_rates {list(self.decoder_rates)} upsample by {math.prod(self.decoder_rates)}, "
                             f"but encoder_rates {list(self.encoder_rates)} downsample by {self.hop_length}.")
        if len(self.decoder_kernel_sizes) != len(self.decoder_rates):
            raise ValueError("decoder_kernel_sizes needs one entry per decoder rate.")
        for rate, kernel in zip(self.decoder_rates, self.decoder_kernel_sizes):
            if kernel < rate or (kernel - rate) % 2:
                raise ValueError(f"decoder kernel {kernel} with rate {rate}: kernel - rate must be even and >= 0 for "
                                 "the upsampler to produce exactly rate x its input length.")
        if self.decoder_dim % 2 ** len(self.decoder_rates):
            raise ValueError(f"decoder_dim {self.decoder_dim} must halve {len(self.decoder_rates)} times.")
        if self.latent_dim % self.num_attention_heads:
            raise ValueError(f"latent_dim {self.latent_dim} is not divisible by {self.num_attention_heads} heads.")
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes):
            raise ValueError("resblock_kernel_sizes and resblock_dilation_sizes need one entry per AMP block.")
        if len(self.latents_mean) != self.latent_channels or len(self.latents_std) != self.latent_channels:
            raise ValueError(f"latents_mean / latents_std need {self.latent_channels} values each, got "
                             f"{len(self.latents_mean)} / {len(self.latents_std)}.")
        if any(not s > 0 for s in self.latents_std):
            raise ValueError("every latents_std value must be positive.")

    @property
    def hop_length(self) -> int:
        return math.prod(self.encoder_rates)

    @property
    def decoder_out_channels(self) -> int:
        return self.decoder_dim // 2 ** len(self.decoder_rates)


# ---- layers ----------------------------------------------------------------------------------------------------------


class WeightNormConv1d(nn.Conv1d):
    """A Conv1d the checkpoint stores as a weight-norm pair (`weight_g`, `weight_v`); here the folded `weight`."""


class WeightNormConvTranspose1d(nn.ConvTranspose1d):
    """A ConvTranspose1d the checkpoint stores as a weight-norm pair; here the folded `weight`."""


WEIGHT_NORM_MODULES = (WeightNormConv1d, WeightNormConvTranspose1d)


def fold_weight_norm(weight_g: torch.Tensor, weight_v: torch.Tensor) -> torch.Tensor:
    """`g * v / ||v||` with the norm over every dim but 0: the same kernel `torch.nn.utils.weight_norm` runs."""
    return torch._weight_norm(weight_v, weight_g, 0)


class Snake(nn.Module):
    """`x + sin^2(alpha x) / (alpha + 1e-9)`, per-channel alpha `[1, C, 1]` (encoder side)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class SnakeBeta(nn.Module):
    """`x + sin^2(e^alpha x) / (e^beta + 1e-9)`, alpha and beta `[C]` stored in log scale (decoder side)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = torch.exp(self.alpha)[None, :, None]
        beta = torch.exp(self.beta)[None, :, None]
        return x + (beta + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


class UpSample(nn.Module):
    """x2 upsampling: replicate pad, depthwise transposed conv with the Kaiser-sinc `filter`, trim the margins."""

    def __init__(self, ratio: int = RESAMPLE_RATIO, taps: int = RESAMPLE_TAPS):
        super().__init__()
        self.ratio = ratio
        self.pad = taps // ratio - 1
        self.trim_left = self.pad * ratio + (taps - ratio) // 2
        self.trim_right = self.pad * ratio + (taps - ratio + 1) // 2
        self.register_buffer("filter", resampling_filter(ratio, taps))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[1]
        x = F.pad(x, (self.pad, self.pad), mode="replicate")
        x = self.ratio * F.conv_transpose1d(x, self.filter.expand(channels, -1, -1), stride=self.ratio,
                                            groups=channels)
        return x[..., self.trim_left:-self.trim_right]


class LowPass(nn.Module):
    """Depthwise Kaiser-sinc low-pass `filter` with stride: the x2 downsampler."""

    def __init__(self, ratio: int = RESAMPLE_RATIO, taps: int = RESAMPLE_TAPS):
        super().__init__()
        self.stride = ratio
        self.pad_left = taps // 2 - int(taps % 2 == 0)
        self.pad_right = taps // 2
        self.register_buffer("filter", resampling_filter(ratio, taps))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[1]
        x = F.pad(x, (self.pad_left, self.pad_right), mode="replicate")
        return F.conv1d(x, self.filter.expand(channels, -1, -1), stride=self.stride, groups=channels)


class DownSample(nn.Module):
    def __init__(self):
        super().__init__()
        self.lowpass = LowPass()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lowpass(x)


class AntiAliasedActivation(nn.Module):
    """Upsample x2 -> SnakeBeta -> downsample x2, so the nonlinearity does not alias."""

    def __init__(self, channels: int):
        super().__init__()
        self.act = SnakeBeta(channels)
        self.upsample = UpSample()
        self.downsample = DownSample()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsample(self.act(self.upsample(x)))


# ---- encoder ---------------------------------------------------------------------------------------------------------


class ResidualUnit(nn.Module):
    """Snake -> dilated conv k7 -> Snake -> conv k1, plus the input (center-cropped if the lengths differ)."""

    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.block = nn.Sequential(
            Snake(channels),
            WeightNormConv1d(channels, channels, 7, dilation=dilation, padding=3 * dilation),
            Snake(channels),
            WeightNormConv1d(channels, channels, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        crop = (x.shape[-1] - y.shape[-1]) // 2
        if crop > 0:
            x = x[..., crop:-crop]
        return x + y


class EncoderBlock(nn.Module):
    """Three residual units (dilations 1, 3, 9), Snake, then a strided conv doubling the width."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        half = channels // 2
        self.block = nn.Sequential(
            ResidualUnit(half, 1), ResidualUnit(half, 3), ResidualUnit(half, 9), Snake(half),
            WeightNormConv1d(half, channels, 2 * stride, stride=stride, padding=math.ceil(stride / 2)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class AudioEncoder(nn.Module):
    """`[N, 1, samples]` -> `[N, latent_dim, samples / hop]`."""

    def __init__(self, config: AudioVAEConfig):
        super().__init__()
        width = config.encoder_dim
        layers: list[nn.Module] = [WeightNormConv1d(1, width, 7, padding=3)]
        for stride in config.encoder_rates:
            width *= 2
            layers.append(EncoderBlock(width, stride))
        layers += [Snake(width), WeightNormConv1d(width, config.latent_dim, 3, padding=1)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, check_interrupt: Callable[[], None] | None = None) -> torch.Tensor:
        """`check_interrupt()` (optional) runs before every layer and may raise to stop."""
        for layer in self.block:
            if check_interrupt is not None:
                check_interrupt()
            x = layer(x)
        return x


class CausalAttention(nn.Module):
    """Causal attention narrowing `in_dim` to `out_dim`: heads are averaged, then the head width is average-pooled.

    The QKV projection has no bias of its own; its bias is `[q_bias | zero_k_bias | v_bias]` with a frozen zero key
    bias, as stored in the checkpoint.
    """

    def __init__(self, in_dim: int, out_dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.head_dim = in_dim // heads
        self.out_dim = out_dim
        self.qkv = nn.Linear(in_dim, 3 * in_dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(in_dim))
        self.v_bias = nn.Parameter(torch.zeros(in_dim))
        self.register_buffer("zero_k_bias", torch.zeros(in_dim))
        self.proj = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        bias = torch.cat((self.q_bias, self.zero_k_bias, self.v_bias))
        q, k, v = F.linear(x, self.qkv.weight, bias).view(batch, length, 3, self.heads, self.head_dim).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        out = out.transpose(1, 2).mean(dim=2)  # [batch, length, head_dim]
        return self.proj(F.adaptive_avg_pool1d(out, self.out_dim))


class GeGLU(nn.Module):
    """Pre-norm `w2(gelu_tanh(w0 x) * w1 x)`."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w0 = nn.Linear(dim, hidden)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.w2(F.gelu(self.w0(x), approximate="tanh") * self.w1(x))


class AttentionProjection(nn.Module):
    """`pre_block`: `h = proj(norm3(x)) + attn(norm1(x))`, then `h + mlp(norm2(h))`; `[N, T, D] -> [N, T, C]`."""

    def __init__(self, in_dim: int, out_dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(in_dim)
        self.attn = CausalAttention(in_dim, out_dim, heads)
        self.proj = nn.Linear(in_dim, out_dim)
        self.norm3 = nn.LayerNorm(in_dim)
        self.norm2 = nn.LayerNorm(out_dim)
        self.mlp = GeGLU(out_dim, 2 * out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.norm3(x)) + self.attn(self.norm1(x))
        return h + self.mlp(self.norm2(h))


# ---- decoder ---------------------------------------------------------------------------------------------------------


class AMPBlock(nn.Module):
    """BigVGAN AMP block: per dilation, act -> dilated conv -> act -> conv, plus the input."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = nn.ModuleList(
            WeightNormConv1d(channels, channels, kernel, dilation=d, padding=(kernel * d - d) // 2)
            for d in dilations)
        self.convs2 = nn.ModuleList(
            WeightNormConv1d(channels, channels, kernel, padding=(kernel - 1) // 2) for _ in dilations)
        self.activations = nn.ModuleList(AntiAliasedActivation(channels) for _ in range(2 * len(dilations)))

    def forward(self, x: torch.Tensor, check_interrupt: Callable[[], None] | None = None) -> torch.Tensor:
        """`check_interrupt()` (optional) runs after every dilation (one is about 0.4 s at 15 s of audio on 2 CPU
        cores even at the tiny model's widths) and may raise to stop."""
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, self.activations[::2], self.activations[1::2]):
            x = conv2(act2(conv1(act1(x)))) + x
            if check_interrupt is not None:
                check_interrupt()
        return x


class AudioDecoder(nn.Module):
    """BigVGAN: `[N, latent_dim, T]` -> `[N, 1, T * hop]`, clamped to [-1, 1]."""

    def __init__(self, config: AudioVAEConfig):
        super().__init__()
        c = config
        self.num_kernels = len(c.resblock_kernel_sizes)
        self.conv_pre = WeightNormConv1d(c.latent_dim, c.decoder_dim, 7, padding=3)
        # Each upsampler sits in a one-element list in the checkpoint (`ups.<i>.0`).
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        for i, (rate, kernel) in enumerate(zip(c.decoder_rates, c.decoder_kernel_sizes)):
            width = c.decoder_dim // 2 ** (i + 1)
            self.ups.append(nn.ModuleList([WeightNormConvTranspose1d(2 * width, width, kernel, rate,
                                                                     padding=(kernel - rate) // 2)]))
            for k, dilations in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes):
                self.resblocks.append(AMPBlock(width, k, tuple(dilations)))
        self.activation_post = AntiAliasedActivation(c.decoder_out_channels)
        self.conv_post = WeightNormConv1d(c.decoder_out_channels, 1, 7, padding=3, bias=False)
        # Where each upsampling stage's weights (`ups.i` with its AMP blocks) live during a forward;
        # load_audio_vae(residency="layerwise") replaces it with a manager that streams the stages.
        self.block_residency = AllResident(len(c.decoder_rates))
        # Runs after every AMP block; the loader sets the platform's host-heap trim (CPU: the blocks' freed
        # mid-size buffers would otherwise stay in the C heap and multiply its resident memory).
        self.between_blocks: Callable[[], None] = no_reclaim

    def stage_prefixes(self, stage: int) -> tuple[str, ...]:
        """Parameter-name prefixes (relative to the decoder) of upsampling stage `stage`: its upsampler and the
        AMP blocks that follow it."""
        blocks = range(stage * self.num_kernels, (stage + 1) * self.num_kernels)
        return (f"ups.{stage}.", *(f"resblocks.{j}." for j in blocks))

    def forward(self, x: torch.Tensor, check_interrupt: Callable[[], None] | None = None) -> torch.Tensor:
        """`check_interrupt()` (optional) runs before every stage and inside every AMP block, and may raise to stop
        (the streamed stages are released)."""
        x = self.conv_pre(x)
        residency = self.block_residency
        residency.begin_pass()
        try:
            for i, up in enumerate(self.ups):
                if check_interrupt is not None:
                    check_interrupt()
                residency.acquire(i)  # stage i on the device (and the next `prefetch` on their way)
                x = up[0](x)
                total = None
                for block in self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]:
                    out = block(x, check_interrupt)
                    total = out if total is None else total + out
                    del out
                    self.between_blocks()
                x = total / self.num_kernels
                residency.release(i)
        finally:
            residency.end_pass()  # also after an exception in a stage: the next decode starts clean
        return torch.clamp(self.conv_post(self.activation_post(x)), -1.0, 1.0)


# ---- the model -------------------------------------------------------------------------------------------------------


class AudioVAE(nn.Module):
    """The H3 audio VAE. Build it with `h3_core.load_audio_vae`; use `encode` / `decode`."""

    def __init__(self, config: AudioVAEConfig):
        super().__init__()
        c = config
        self.config = c
        self.encoder = AudioEncoder(c)
        self.pre_block = AttentionProjection(c.latent_dim, c.latent_channels, c.num_attention_heads)
        self.mean_proj = nn.Conv1d(c.latent_channels, c.latent_channels, 1)
        self.logs_proj = nn.Conv1d(c.latent_channels, c.latent_channels, 1)  # posterior log-std; unused at inference
        self.dec_in_proj = nn.Conv1d(c.latent_channels, c.latent_dim, 1)
        self.decoder = AudioDecoder(c)
        # Phase-scoped weights when loaded layerwise: "encoder" (encoder, pre_block and the posterior projections),
        # materialised for the duration of one `encode` call.
        self.weight_phases = PhaseScopedWeights()

    @property
    def device(self) -> torch.device:
        return self.mean_proj.weight.device

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    def close(self, restore: bool = True) -> None:
        """Drop the residency manager and phase-scoped weights: every streamed parameter gets its host tensor back
        (on the CPU), and the model then runs with all weights where they are. A resident VAE has nothing to
        release. `H3Pipeline.release` calls this with `restore=False` (the VAE is dropped)."""
        self.decoder.block_residency.close(restore)
        self.decoder.block_residency = AllResident(len(self.decoder.ups))
        self.weight_phases.close(restore)
        self.weight_phases = PhaseScopedWeights()

    def _stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.tensor(self.config.latents_mean, dtype=torch.float32, device=self.device).view(1, -1, 1)
        std = torch.tensor(self.config.latents_std, dtype=torch.float32, device=self.device).view(1, -1, 1)
        return mean, std

    @torch.no_grad()
    def encode(self, waveform: torch.Tensor, *, check_interrupt: Callable[[], None] | None = None) -> torch.Tensor:
        """Stereo waveform `[B, 2, N]` at 32 kHz -> normalised posterior mean `[B, 32, 2, ceil(N / 800)]` (float32).

        The two channels run as two batch items of the mono network; N is right-padded with zeros to a whole hop.
        `check_interrupt()` (optional) runs between the encoder's layers and may raise to stop.
        """
        if not isinstance(waveform, torch.Tensor) or waveform.ndim != 3 or waveform.shape[1] != STEREO_CHANNELS \
                or not waveform.is_floating_point() or waveform.shape[0] < 1 or waveform.shape[-1] < 1:
            got = tuple(waveform.shape) if isinstance(waveform, torch.Tensor) else type(waveform).__name__
            raise H3Error(f"waveform: expected a float tensor [B, 2, samples] at {self.sample_rate} Hz, got {got}. "
                          "Duplicate a mono track to two channels first.")
        batch, _, samples = waveform.shape
        hop = self.config.hop_length
        x = waveform.to(device=self.device, dtype=torch.float32).reshape(batch * STEREO_CHANNELS, 1, samples)
        x = F.pad(x, (0, (-samples) % hop))
        mean, std = self._stats()
        with self.weight_phases.phase("encoder"):
            hidden = self.pre_block(self.encoder(x, check_interrupt).transpose(1, 2)).transpose(1, 2)
            latent = (self.mean_proj(hidden) - mean) / std
        return latent.view(batch, STEREO_CHANNELS, *latent.shape[1:]).transpose(1, 2)

    @torch.no_grad()
    def decode(self, latent: torch.Tensor, *, check_interrupt: Callable[[], None] | None = None) -> torch.Tensor:
        """Normalised latent `[B, 32, 2, Ta]` -> stereo waveform `[B, 2, 800 * Ta]` at 32 kHz in [-1, 1] (float32).
        `check_interrupt()` (optional) runs between the decoder's stages and AMP blocks and may raise to stop."""
        c = self.config
        if not isinstance(latent, torch.Tensor) or latent.ndim != 4 or latent.shape[1] != c.latent_channels \
                or latent.shape[2] != STEREO_CHANNELS or not latent.is_floating_point() or min(latent.shape) < 1:
            got = tuple(latent.shape) if isinstance(latent, torch.Tensor) else type(latent).__name__
            raise H3Error(f"audio latent: expected a float tensor [B, {c.latent_channels}, 2, Ta], got {got}.")
        batch, channels, _, frames = latent.shape
        mean, std = self._stats()
        z = latent.to(device=self.device, dtype=torch.float32).transpose(1, 2).reshape(-1, channels, frames)
        waveform = self.decoder(self.dec_in_proj(z * std + mean), check_interrupt)
        return waveform.view(batch, STEREO_CHANNELS, -1)
