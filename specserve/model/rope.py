"""Rotary position embeddings and the `rope_scaling` variants Llama / Qwen2 / Mistral configs use.

Hugging Face configs spell the parameters two ways: `rope_theta` + `rope_scaling` (transformers 4)
and one `rope_parameters` dict (transformers 5). `RopeSpec.from_hf` reads either.

Supported `rope_type`s: default, linear, dynamic (NTK), llama3, yarn. Anything else is refused
with a clear error rather than silently computed as `default`, which would give wrong logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class UnsupportedRope(ValueError):
    pass


@dataclass(frozen=True)
class RopeSpec:
    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    params: dict = field(default_factory=dict)  # the variant's own keys (factor, …)
    max_position_embeddings: int = 2048

    @classmethod
    def from_hf(cls, cfg: dict, head_dim: int) -> "RopeSpec":
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedRope(
                f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedRope("partial_rotary_factor != 1 is not supported")
        return cls(head_dim=head_dim, theta=theta, rope_type=rope_type, params=params,
                   max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)))

    def _base_inv_freq(self, theta: float | None = None) -> torch.Tensor:
        theta = self.theta if theta is None else theta
        # On the CPU whatever device context builds the model: the tables are moved to the
        # positions' device at first use, and arithmetic on "meta" (load_model builds the model
        # there) would go through torch._refs, whose first call imports torch._dynamo (2 s).
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device="cpu").float() / self.head_dim
        return 1.0 / (theta ** exponents)  # [head_dim/2]

    def static_inv_freq(self) -> tuple[torch.Tensor, float]:
        """(inv_freq [head_dim/2], attention scaling) for every type but `dynamic`."""
        p, kind = self.params, self.rope_type
        if kind in ("default", "dynamic"):
            return self._base_inv_freq(), 1.0
        if kind == "linear":
            return self._base_inv_freq() / float(p["factor"]), 1.0
        if kind == "llama3":
            return _llama3(self._base_inv_freq(), p), 1.0
        if kind == "yarn":
            return _yarn(self, p)
        raise UnsupportedRope(kind)

    def dynamic_inv_freq(self, seq_len: int) -> torch.Tensor:
        """NTK-aware scaling recomputed for a sequence of `seq_len` positions (the row's max + 1)."""
        orig = int(self.params.get("original_max_position_embeddings", self.max_position_embeddings))
        if seq_len <= orig:
            return self._base_inv_freq()
        factor = float(self.params["factor"])
        d = self.head_dim
        base = self.theta * ((factor * seq_len / orig) - (factor - 1)) ** (d / (d - 2))
        return self._base_inv_freq(base)


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    # Between the two wavelengths, interpolate smoothly between scaled and unscaled.
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(spec: RopeSpec, p: dict) -> tuple[torch.Tensor, float]:
    d, base = spec.head_dim, spec.theta
    orig = int(p["original_max_position_embeddings"])
    factor = p.get("factor") or spec.max_position_embeddings / orig
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attn = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attn = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (d * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 → keep the original (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attn)


class RotaryEmbedding(torch.nn.Module):
    """cos / sin tables for explicit positions. Positions come in as an argument every call."""

    def __init__(self, spec: RopeSpec):
        super().__init__()
        self.spec = spec
        # A plain attribute, not a buffer: model.to(bf16) must not round the frequencies.
        self.inv_freq, self.scale = spec.static_inv_freq()  # [head_dim/2] fp32, float

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, T] → cos, sin: [B, 1, T, head_dim] (broadcast over heads)
        if self.spec.rope_type == "dynamic":
            row_len = (positions.max(dim=1).values + 1).tolist()
            inv = torch.stack([self.spec.dynamic_inv_freq(int(n)) for n in row_len]).to(positions.device)
        else:
            if self.inv_freq.device != positions.device:
                self.inv_freq = self.inv_freq.to(positions.device)
            inv = self.inv_freq[None].expand(positions.shape[0], -1)  # [B, head_dim/2]
        freqs = positions.float()[:, :, None] * inv[:, None, :]  # [B, T, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, head_dim]
        cos, sin = emb.cos() * self.scale, emb.sin() * self.scale
        return cos[:, None].to(dtype), sin[:, None].to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, head_dim]; cos/sin: [B, 1, T, head_dim]
    return x * cos + rotate_half(x) * sin
