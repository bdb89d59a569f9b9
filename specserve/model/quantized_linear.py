"""Weight-only quantized linear layers on PyTorch's own kernels (what torchao wraps; gpt-fast's
recipe). The weight is stored as integers with float scales; the activations stay floating point
and the kernel dequantizes as it multiplies. No matmul is written here.

  int8: symmetric, one scale per output channel:       w ≈ q · s[n],              q ∈ [-128, 127]
        aten._weight_int8pack_mm (CPU, CUDA)
  int4: asymmetric, one scale and zero per group of G consecutive input features:
                                                       w ≈ (q - 8) · s[n, g] + z[n, g],  q ∈ [0, 15]
        aten._weight_int4pack_mm_for_cpu (CPU), aten._weight_int4pack_mm (CUDA: tinygemm,
        bf16 activations), each with its own packed weight layout

Shapes: N output features, K input features, G the int4 group size, M rows of activations.
The scales are kept in the activation dtype (the kernels want them to match).
"""

from __future__ import annotations

import torch
from torch import nn

INT4_ZERO = 8   # the kernels' int4 midpoint: q = 8 stands for the group's zero z


def int8_weights(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] → (q int8 [N, K], scales fp32 [N]), symmetric per output channel."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)             # [N]
    q = torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scales


def int4_weights(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] → (q int32 [N, K] in 0..15, scales_and_zeros fp32 [K/G, N, 2]): per group
    the range [min, max] maps onto 0..15, and z is the value q = 8 stands for (the kernels'
    convention)."""
    N, K = weight.shape
    groups = weight.float().reshape(N, K // group_size, group_size)   # [N, K/G, G]
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)                 # [N, K/G]
    scales = ((hi - lo) / 15).clamp(min=1e-6)
    zeros = lo + scales * INT4_ZERO
    q = torch.round((groups - lo[..., None]) / scales[..., None]).clamp(0, 15)
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # [K/G, N, 2]
    return q.to(torch.int32).reshape(N, K), scales_and_zeros


def _int4_inner_k_tiles(in_features: int) -> int:
    """The CUDA packing's tile count along K: the largest the kernel takes that divides K / 16."""
    return next(t for t in (8, 4, 2) if in_features % (16 * t) == 0)


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scales = int8_weights(linear.weight)
        dtype = linear.weight.dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", q)                          # [N, K]
        self.register_buffer("scales", scales.to(dtype))                # [N]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()             # [M, K]
        out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)  # [M, N]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class Int8Head(nn.Module):
    """The target's LM head computed from its own int8 copy (Int8Linear, one scale per vocabulary
    row), while `weight` stays the dense parameter it was: on a tied checkpoint that is the
    embedding, and the EAGLE / DFlash / MTP drafters read target.lm_head.weight as a dense tensor.
    Costs V·K bytes more memory (28 MB on SmolLM2) and reads them instead of the dense V·K·2 or ·4
    each step. reads_dense_weight tells bytes-per-step accounting (cli/bench/bandwidth.py)."""

    reads_dense_weight = False

    def __init__(self, head: nn.Linear):
        super().__init__()
        self.weight = head.weight            # shared with the embedding when tied; not read here
        self.quantized = Int8Linear(head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantized(x)             # [..., V]


class Int4Linear(nn.Module):
    """From integers and scales already on the int4 grid: q int32 [N, K] in 0..15,
    scales_and_zeros [K/G, N, 2] in the activation dtype (w = (q - 8) · s + z), on the device the
    kernel runs on. `from_linear` quantizes a dense layer; a GGUF's Q4_0 / Q4_1 tensors come in
    as they are (model/q4_checkpoint.py)."""

    def __init__(self, q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = group_size
        self.on_cuda = q.device.type == "cuda"
        if self.on_cuda:   # two 4-bit values per byte, even column high, then the tinygemm layout
            pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)        # [N, K/2]
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs, _int4_inner_k_tiles(self.in_features))
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)  # uint8 [N, K/2]
        self.register_buffer("weight_int4", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)      # [K/G, N, 2]
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> "Int4Linear":
        q, scales_and_zeros = int4_weights(linear.weight, group_size)
        return cls(q, scales_and_zeros.to(linear.weight.dtype), group_size, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()             # [M, K]
        mm = torch.ops.aten._weight_int4pack_mm if self.on_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
        out = mm(flat, self.weight_int4, self.group_size, self.scales_and_zeros)  # [M, N]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)
