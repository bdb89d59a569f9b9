"""Which kernel a dense (not quantized) linear layer of the target runs on a CPU.

`nn.Linear` on a CPU in float32 calls PyTorch's BLAS path (MKL `sgemm`). Measured on this
project's 2-core AMD EPYC (benchmarks/dense_kernels.py, docs/kernels/): a decode step's 30
gate/up projections (30 distinct 3072 x 576 weights, so they stream from memory as in a forward)
take 19.9 ms at 1 row, 34.0 ms at 2 rows and 39.4 ms at 3, against 8.9 / 11.0 / 11.4 ms through
oneDNN (`torch.ops.mkldnn._linear_pointwise`, the op Inductor's CPU fusion passes emit) — a
verify of 2-3 tokens, the width weak drafters actually use, paid 1.7-2.0x a plain step in the
BLAS path. bfloat16 linears already run on oneDNN, so only float32 has a choice.

Kernels (`--linear-kernel`):
  aten    nn.Linear as PyTorch dispatches it (BLAS on CPU, cuBLAS on CUDA)
  onednn  every dense nn.Linear of the target becomes a `OneDNNLinear` sharing its parameters
          (tied embeddings stay tied; quantized modules and the drafters are untouched)
  auto    onednn for a float32 target on a CPU with oneDNN, one process; aten otherwise

Neither kernel makes a row's result independent of the rows beside it in the call (fp32 rounds a
1-row and a k-row call differently, ~1e-6, as MKL did): greedy speculative output equals plain
output as it did before, through the verify's argmax, and the tests check it with this kernel.
"""

from __future__ import annotations

import torch
from torch import nn

LINEAR_KERNELS = ("auto", "aten", "onednn")


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def resolve_linear_kernel(kernel: str, device_type: str, dtype: str, tensor_parallel: int = 1) -> str:
    """The kernel `kernel` means for this target ("aten" or "onednn"); ValueError for one it cannot run."""
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"linear kernel must be one of {', '.join(LINEAR_KERNELS)}, got {kernel!r}")
    usable = device_type == "cpu" and tensor_parallel == 1 and onednn_available()
    if kernel == "auto":
        return "onednn" if usable and dtype == "float32" else "aten"
    if kernel == "onednn" and not usable:
        why = ("it runs on a CPU only" if device_type != "cpu" else
               "tensor-parallel workers build their own shards with nn.Linear" if tensor_parallel > 1 else
               "this PyTorch build has no oneDNN (torch.backends.mkldnn)")
        raise ValueError(f"--linear-kernel onednn: {why}; use --linear-kernel aten")
    return kernel


class OneDNNLinear(nn.Linear):
    """nn.Linear whose forward is oneDNN's linear (same parameters, same result up to fp32 rounding)."""

    @classmethod
    def of(cls, linear: nn.Linear) -> "OneDNNLinear":
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.in_features, out.out_features = linear.in_features, linear.out_features
        out.weight = linear.weight          # the same Parameter: a tied embedding stays tied
        out.bias = linear.bias
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in] → [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def use_onednn_linears(model: nn.Module) -> int:
    """Swap every plain nn.Linear under `model` (not subclasses: quantized or sharded layers keep
    their own kernels) for a OneDNNLinear; returns how many were swapped."""
    swaps = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, m in swaps:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, OneDNNLinear.of(m))
    return len(swaps)
