"""Int4 weights kept from a GGUF file (`import-gguf --keep-quantized`): how a checkpoint folder
stores them, and the int4 kernel's layout they take at load.

A kept linear L (one Hugging Face projection: q_proj, …, down_proj) is three tensors in the
folder's safetensors instead of L.weight, in GGUF's own numbers (Q4_0 and Q4_1 both become
w = d · q + m, Q4_0 with m = −8 d):

  L.qweight  uint8   [N, K/2]   q ∈ 0..15, column 2j in the low nibble, 2j + 1 in the high
  L.scales   float16 [N, K/G]   d, one per group of G = 32 consecutive input features
  L.mins     float16 [N, K/G]   m

The int4 kernel's convention is w = (q − 8) · s + z (model/quantized_linear.py), so it takes
s = d and z = m + 8 d, computed in float32 and stored in the activation dtype:

  * float32: 8 d is exact, and so is m + 8 d unless the two are far apart in magnitude
    (`inexact_zeros` counts the groups where it is not); with an exact z the kernel's weight,
    (q − 8) · d + z rounded once to float32, is gguf's d · q + m rounded once: bit for bit.
  * bfloat16: d and z round to 8 bits of mantissa (from float16's 11): a requantization of the
    scales, measured by `kernel_weight` (import-gguf reports it; docs/quantize/README.md).

Fused projections (q/k/v, gate/up) are the row-wise concatenation of their parts' tensors
(transformer.fuse_projections), which the group layout along K allows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

Q4_GROUP_SIZE = 32        # GGUF's Q4_0 / Q4_1 block: 32 consecutive weights of one row
KEPT_KINDS = ("qweight", "scales", "mins")
# The folder's record of it, beside config.json.
KEPT_FILE = "quantization_config.json"
KEPT_METHOD = "specserve_gguf_int4"


class KeptRecordError(ValueError):
    """A quantization_config.json that is not one this module wrote."""


def is_kept(folder: str | Path) -> bool:
    """Whether the folder stores kept int4 projections (its record checked); False for a dense one."""
    path = Path(folder) / KEPT_FILE
    if not path.is_file():
        return False
    try:
        record = json.loads(path.read_text())
        found = (record["quant_method"], record["bits"], record["group_size"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise KeptRecordError(f"{path} is not a quantization record: {e!r}") from None
    if found != (KEPT_METHOD, 4, Q4_GROUP_SIZE):
        raise KeptRecordError(f"{path}: quant_method {found[0]!r}, {found[1]} bits, group size {found[2]} is not "
                              f"what specserve serves ({KEPT_METHOD}, 4 bits, group size {Q4_GROUP_SIZE})")
    return True


@dataclass(frozen=True)
class Q4Weights:
    q: torch.Tensor         # uint8 [N, K], values 0..15
    scales: torch.Tensor    # float16 [N, K/G]: d
    mins: torch.Tensor      # float16 [N, K/G]: m

    def dequantized(self) -> torch.Tensor:
        """d · q + m in float32 [N, K], gguf's own formula (one rounding)."""
        return self.scales.float().repeat_interleave(Q4_GROUP_SIZE, 1) * self.q.float() + \
            self.mins.float().repeat_interleave(Q4_GROUP_SIZE, 1)

    def kernel_scales_and_zeros(self, dtype: torch.dtype) -> torch.Tensor:
        """The int4 kernel's [K/G, N, 2] (s = d, z = m + 8 d) in `dtype`."""
        d = self.scales.float()
        z = self.mins.float() + 8 * d
        return torch.stack([d, z], dim=-1).transpose(0, 1).contiguous().to(dtype)

    def inexact_zeros(self) -> int:
        """Groups whose z = m + 8 d is not exact in float32."""
        exact = self.mins.double() + 8 * self.scales.double()
        return int((self.mins.float() + 8 * self.scales.float()).double().ne(exact).sum())


def kernel_weight(w: Q4Weights, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] the int4 kernel multiplies by with its scales and zeros in `dtype`:
    (q − 8) · s + z in float32, as it dequantizes (the product is exact, one rounding in the sum)."""
    sz = w.kernel_scales_and_zeros(dtype).float()                      # [K/G, N, 2]
    s = sz[..., 0].T.repeat_interleave(Q4_GROUP_SIZE, 1)
    z = sz[..., 1].T.repeat_interleave(Q4_GROUP_SIZE, 1)
    return (w.q.float() - 8) * s + z


def to_stored(prefix: str, w: Q4Weights) -> dict[str, torch.Tensor]:
    """The folder's tensors of the linear `prefix` (e.g. model.layers.0.self_attn.q_proj)."""
    packed = (w.q[:, 0::2] | w.q[:, 1::2] << 4).contiguous()           # [N, K/2]
    return {f"{prefix}.qweight": packed, f"{prefix}.scales": w.scales.contiguous(),
            f"{prefix}.mins": w.mins.contiguous()}


def take_stored(state: dict[str, torch.Tensor], prefix: str) -> Q4Weights | None:
    """Remove the linear `prefix`'s kept tensors from `state`; None when it has none."""
    if f"{prefix}.qweight" not in state:
        return None
    packed, scales, mins = (state.pop(f"{prefix}.{k}") for k in KEPT_KINDS)
    q = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)   # [N, K]
    return Q4Weights(q, scales, mins)


def int4_linear(w: Q4Weights, bias: torch.Tensor | None, dtype: torch.dtype,
                device: torch.device) -> "torch.nn.Module":
    from specserve.model.quantized_linear import Int4Linear

    return Int4Linear(w.q.to(device, torch.int32), w.kernel_scales_and_zeros(dtype).to(device),
                      Q4_GROUP_SIZE, None if bias is None else bias.to(device, dtype))
