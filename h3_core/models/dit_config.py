"""Configuration of the H3 diffusion transformer, read from either `config.json` dialect or from tensor shapes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import CheckpointError
from ..json_values import is_positive_real, is_whole

# Modality tags carried by every row of the packed sequence; they also index each block's AdaLN table.
VIDEO_TAG = 0
TEXT_TAG = 1
AUDIO_TAG = 2
NUM_MODALITIES = 3
# Six modulation vectors per (timestep, modality) row: shift, scale, gate for attention, then for the MLP.
NUM_MODULATIONS = 6

NATIVE_CLASS_NAME = "MiniMaxH3DiTModel"
DIFFUSERS_CLASS_NAME = "MiniMaxH3Transformer3DModel"


@dataclass(frozen=True)
class H3DiTConfig:
    """Hyper-parameters of the DiT. Defaults are the released 33B model."""

    num_layers: int = 50
    num_refiner_layers: int = 2
    hidden_size: int = 5376
    num_attention_heads: int = 56
    attention_head_dim: int = 128
    ffn_dim: int = 14336
    in_channels: int = 24
    audio_in_channels: int = 32
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 5120
    freq_dim: int = 256
    time_embed_hidden_dim: int = 5376
    time_embed_dim: int = 2688
    rope_freq_dim: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm_eps: float = 1e-5
    final_norm_eps: float = 1e-5

    def __post_init__(self):
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise ValueError(f"patch_size must be three positive integers (t, h, w), got {self.patch_size}.")
        if self.patch_size[0] != 1:
            raise ValueError(f"H3 packs one latent frame per row group (patch_t = 1), got patch_size {self.patch_size}.")
        if 6 * self.rope_freq_dim > self.attention_head_dim:
            raise ValueError(
                f"rope_freq_dim {self.rope_freq_dim} rotates {6 * self.rope_freq_dim} channels, more than "
                f"attention_head_dim {self.attention_head_dim}."
            )
        for name in ("num_layers", "hidden_size", "num_attention_heads", "attention_head_dim", "ffn_dim",
                     "in_channels", "audio_in_channels", "text_dim", "freq_dim", "time_embed_hidden_dim",
                     "time_embed_dim"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}.")
        if self.freq_dim % 2:
            raise ValueError(f"freq_dim must be even (cos and sin halves), got {self.freq_dim}.")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def video_patch_dim(self) -> int:
        pt, ph, pw = self.patch_size
        return self.in_channels * pt * ph * pw

    # ---- the two config.json dialects -------------------------------------------------------------------------

    _FLOAT_FIELDS = ("rope_theta", "norm_eps", "qk_norm_eps", "final_norm_eps")

    _NATIVE_FIELDS = {
        "num_layers": "num_layers",
        "token_refiner_num_layers": "num_refiner_layers",
        "hidden_size": "hidden_size",
        "num_attention_heads": "num_attention_heads",
        "attention_head_dim": "attention_head_dim",
        "ffn_hidden_size": "ffn_dim",
        "latents_dim": "in_channels",
        "audio_latents_dim": "audio_in_channels",
        "patch_size": "patch_size",
        "text_dim": "text_dim",
        "timestep_input_dim": "freq_dim",
        "time_embed_hidden_size": "time_embed_hidden_dim",
        "time_embed_dim": "time_embed_dim",
        "rope_inv_freq_len": "rope_freq_dim",
        "rope_theta": "rope_theta",
        "norm_eps": "norm_eps",
        "qk_norm_eps": "qk_norm_eps",
        "final_norm_eps": "final_norm_eps",
    }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: object = "config.json") -> "H3DiTConfig":
        """Read a native (`MiniMaxH3DiTModel`) or diffusers (`MiniMaxH3Transformer3DModel`) config.

        Unknown fields are ignored (both dialects carry bookkeeping such as `_diffusers_version`); derived fields
        (`adaln_out_features`, ...) are checked against the result.
        """
        if not isinstance(data, Mapping):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(data).__name__}.", path=source)
        class_name = data.get("_class_name")
        names = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        native = class_name == NATIVE_CLASS_NAME or (class_name is None and "latents_dim" in data)
        if native:
            for key, field in cls._NATIVE_FIELDS.items():
                if key in data:
                    values[field] = data[key]
        else:
            for key in names:
                if key in data:
                    values[key] = data[key]
        names_in_file = {field: key for key, field in cls._NATIVE_FIELDS.items()} if native else {}
        for field, value in values.items():
            cls._check_type(field, value, names_in_file.get(field, field), source)
        try:
            config = cls(**values)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{source}: invalid H3 transformer config: {exc}", path=source) from None
        derived = {
            "adaln_out_features": NUM_MODULATIONS * NUM_MODALITIES * config.hidden_size,
            "final_adaln_out_features": 2 * config.hidden_size,
        }
        for key, expected in derived.items():
            if key in data and (isinstance(data[key], bool) or data[key] != expected):
                raise CheckpointError(
                    f"{source}: {key} is {data[key]} but hidden_size {config.hidden_size} implies {expected}.",
                    path=source,
                    key=key,
                )
        return config

    @staticmethod
    def _check_type(field: str, value, key: str, source) -> None:
        """JSON types of one field (`key` as the file spells it): counts and widths are integers (not true, 2.0 or
        "2"), epsilons and theta finite positive numbers, patch_size three positive integers."""
        if field == "patch_size":
            ok, want = isinstance(value, (list, tuple)) and len(value) == 3 and all(is_whole(v) for v in value), \
                "a list of three positive integers (t, h, w)"
        elif field in H3DiTConfig._FLOAT_FIELDS:
            ok, want = is_positive_real(value), "a positive number"
        elif field == "num_refiner_layers":
            ok, want = is_whole(value, 0), "an integer >= 0"
        else:
            ok, want = is_whole(value), "a positive integer"
        if not ok:
            raise CheckpointError(f"{source}: '{key}' must be {want}, got {value!r}. Restore the config.json of the "
                                  "release.", path=source, key=key)

    def config_key(self, field: str, layout: str) -> str:
        """How `layout`'s config.json spells `field` (the native release renames most of them)."""
        if layout == "native":
            return next((key for key, name in self._NATIVE_FIELDS.items() if name == field), field)
        return field

    def to_native_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"_class_name": NATIVE_CLASS_NAME}
        for key, field in self._NATIVE_FIELDS.items():
            value = getattr(self, field)
            out[key] = list(value) if isinstance(value, tuple) else value
        out["adaln_out_features"] = NUM_MODULATIONS * NUM_MODALITIES * self.hidden_size
        out["final_adaln_out_features"] = 2 * self.hidden_size
        return out

    def to_diffusers_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"_class_name": DIFFUSERS_CLASS_NAME, "_diffusers_version": "0.42.1"}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out
