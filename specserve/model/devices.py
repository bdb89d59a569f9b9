"""Where a model computes and in which precision: the `--device`, `--dtype` and `--drafter-dtype`
choices, resolved for torch. torch is imported inside the functions, so the CLI can offer the
choices without loading it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16")
DRAFTER_DTYPES = ("auto", *DTYPES)


def resolve_drafter_dtype(name: str, model) -> "torch.dtype":
    import torch

    if name == "auto":
        fast_bf16 = model.device.type == "cuda" or torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return torch.bfloat16 if fast_bf16 else model.dtype
    if name not in DRAFTER_DTYPES:
        raise ValueError(f"drafter dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def resolve_device(name: str) -> "torch.device":
    """auto → cuda when a GPU is visible, else cpu; cpu and cuda[:N] as given (checked here)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: this torch build sees no CUDA GPU "
                             f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
        if (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return device

