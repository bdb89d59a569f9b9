"""A GGUF file's Q4_0 / Q4_1 projections → kept int4 weights (model/q4_checkpoint.py), unchanged.

Per block of 32 weights of one row, Q4_1 stores float16 d and m and 4-bit q (w = d · q + m),
Q4_0 float16 d and q (w = d · (q − 8), so m = −8 d, exact in float16). The integers are unpacked
by the `gguf` package's own dequantizer, run on a copy of the raw blocks whose d is set to 1 (and
m to 0): it then returns q itself (Q4_1) or q − 8 (Q4_0), in its nibble order. d and m are the
blocks' float16 header fields (ggml's block_q4_0 / block_q4_1 layout).

Which tensors are projections is gguf's naming (TENSOR_NAMES), which Hugging Face name each one
has is transformers' GGUF map, and the row order transformers restores on q and k (llama.cpp
permutes their rows for its RoPE) is transformers' own processor applied to the row indices.
Every kept tensor is checked against transformers' dequantized weight: d · q + m must equal it
bit for bit, or the import stops.

Q8_0 is not kept: one scale per 32 weights has no exact layout in the kernels here (the int8
kernel takes one scale per output channel); nor are the K-quants and the others. Both are named
in the error, which says how to import them dequantized instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specserve.model.q4_checkpoint import KEPT_FILE, KEPT_METHOD, Q4_GROUP_SIZE, Q4Weights, kernel_weight

KEPT_TYPES = ("Q4_0", "Q4_1")


class GGUFKeepError(ValueError):
    """A projection of the GGUF file cannot be kept quantized; the message names it and its type."""


def projection_names(num_layers: int) -> list[str]:
    """The GGUF names of the decoder projections (blk.0.attn_q.weight, …)."""
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    kinds = (MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K, MODEL_TENSOR.ATTN_V, MODEL_TENSOR.ATTN_OUT,
             MODEL_TENSOR.FFN_GATE, MODEL_TENSOR.FFN_UP, MODEL_TENSOR.FFN_DOWN)
    return [TENSOR_NAMES[k].format(bid=i) + ".weight" for i in range(num_layers) for k in kinds]


def check_keepable(reader, num_layers: int) -> dict[str, int]:
    """Raise GGUFKeepError naming the first projection that is not Q4_0 / Q4_1; returns the
    projections' type counts."""
    from gguf import GGMLQuantizationType

    tensors = {t.name: t for t in reader.tensors}
    types: dict[str, int] = {}
    for name in projection_names(num_layers):
        qtype = GGMLQuantizationType(tensors[name].tensor_type).name
        if qtype == "Q8_0":
            raise GGUFKeepError(
                f"{name} is Q8_0, which cannot be kept quantized: its one scale per 32 weights has no exact layout "
                f"in the int8 kernel (one scale per output channel); import without --keep-quantized (exact, "
                f"dequantized) and serve with --quantize int8 to requantize it per channel")
        if qtype not in KEPT_TYPES:
            raise GGUFKeepError(f"{name} is {qtype}; --keep-quantized keeps Q4_0 and Q4_1 projections only (the "
                                f"int4 kernel's group-32 layout); import without --keep-quantized to dequantize it")
        types[qtype] = types.get(qtype, 0) + 1
    return types


def q4_weights(tensor) -> Q4Weights:
    """One Q4_0 / Q4_1 tensor of a GGUFReader as it is stored: q [N, K], d and m [N, K/32]."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(tensor.tensor_type)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows = np.asarray(tensor.data).view(np.uint8)                      # [N, K/32 · type_size]
    n = rows.shape[0]
    blocks = rows.reshape(-1, type_size)                               # [N · K/32, type_size]
    d = blocks[:, 0:2].view(np.float16).reshape(n, -1)                 # [N, K/32]
    unit = blocks.copy()
    unit[:, 0:2] = np.array([1.0], np.float16).view(np.uint8)
    if qtype == GGMLQuantizationType.Q4_1:
        m = blocks[:, 2:4].view(np.float16).reshape(n, -1)
        unit[:, 2:4] = np.array([0.0], np.float16).view(np.uint8)
        q = dequantize(unit.reshape(n, -1), qtype)                     # [N, K]: q
    else:
        m = (-8 * d.astype(np.float32)).astype(np.float16)
        q = dequantize(unit.reshape(n, -1), qtype) + 8                 # [N, K]: (q − 8) + 8
    assert q.shape[1] == d.shape[1] * block_size
    return Q4Weights(torch.from_numpy(q.astype(np.uint8)), torch.from_numpy(d.copy()), torch.from_numpy(m.copy()))


def rows_reordered(w: Q4Weights, order: np.ndarray) -> Q4Weights:
    idx = torch.from_numpy(np.ascontiguousarray(order))
    return Q4Weights(w.q[idx], w.scales[idx], w.mins[idx])


@dataclass(frozen=True)
class KeptReport:
    types: dict[str, int]                  # projection tensors per GGUF type
    max_abs_diff: dict[str, float]         # the kernel's weights vs gguf's, per activation dtype
    max_abs_weight: float
    inexact_zeros: int                     # groups whose float32 zero m + 8 d rounds

    def record(self, source: str) -> dict:
        """The folder's quantization_config.json (q4_checkpoint.is_kept reads it back)."""
        return {"quant_method": KEPT_METHOD, "bits": 4, "group_size": Q4_GROUP_SIZE,
                "layout": "per projection L: L.qweight uint8 [N, K/2] (column 2j low nibble, 2j+1 high), "
                          "L.scales d and L.mins m float16 [N, K/32]; w = d * q + m",
                "modules": "decoder projections (q, k, v, o, gate, up, down); embedding, LM head, norms dense",
                "source": {"gguf": source, "types": self.types},
                # The int4 kernel's weights against gguf's dequantization, per activation dtype.
                "max_abs_diff_vs_gguf": self.max_abs_diff, "max_abs_weight": self.max_abs_weight,
                "inexact_float32_zeros": self.inexact_zeros}

    @classmethod
    def of_folder(cls, folder: Path) -> "KeptReport":
        """The report a --keep-quantized folder's quantization_config.json holds."""
        rec = json.loads((folder / KEPT_FILE).read_text())
        return cls(rec["source"]["types"], rec["max_abs_diff_vs_gguf"], rec["max_abs_weight"],
                   rec["inexact_float32_zeros"])

    def summary(self) -> str:
        """The import's line on what was kept and how exactly the kernels serve it."""
        types = ", ".join(f"{n} {t}" for t, n in sorted(self.types.items()))
        f32, bf16 = self.max_abs_diff["float32"], self.max_abs_diff["bfloat16"]
        exact = "bit-exact" if f32 == 0 else f"max abs diff {f32:.3g}"
        return (f"kept {sum(self.types.values())} projections quantized ({types}) as int4 group {Q4_GROUP_SIZE}; "
                f"the int4 kernel's weights vs gguf's dequantization: float32 {exact}, bfloat16 max abs diff "
                f"{bf16:.3g} (scales and zeros rounded to bfloat16; largest |w| {self.max_abs_weight:.3g})")


def kept_projections(reader, loaded, architecture: str, num_layers: int) -> tuple[dict[str, Q4Weights], KeptReport]:
    """{Hugging Face name (model.layers.0.self_attn.q_proj): kept weights} of a GGUFReader, checked
    against `loaded`, transformers' dequantized load of the same file; and the import report.
    `architecture`: the file's general.architecture (transformers' processors are keyed by it)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    types = check_keepable(reader, num_layers)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=loaded.config.to_dict())
    to_hf = get_gguf_hf_weights_map(loaded, processor)
    state = loaded.state_dict()
    tensors = {t.name: t for t in reader.tensors}
    kept: dict[str, Q4Weights] = {}
    diffs = {"float32": 0.0, "bfloat16": 0.0}
    top, inexact = 0.0, 0
    for name in projection_names(num_layers):
        hf_name = to_hf[name]
        w = q4_weights(tensors[name])
        n = w.q.shape[0]
        order = processor.process(weights=np.arange(n)[:, None], name=name).weights[:, 0]
        w = rows_reordered(w, order)
        gguf_w = state[hf_name].float()                                # transformers' (gguf's) values
        if not torch.equal(w.dequantized(), gguf_w):
            raise GGUFKeepError(f"{name}: its int4 values do not reproduce the gguf package's dequantization "
                                f"(an unexpected layout); import without --keep-quantized")
        for dtype in diffs:
            err = (kernel_weight(w, getattr(torch, dtype)) - gguf_w).abs().max().item()
            diffs[dtype] = max(diffs[dtype], err)
        top = max(top, gguf_w.abs().max().item())
        inexact += w.inexact_zeros()
        kept[hf_name.removesuffix(".weight")] = w
    return kept, KeptReport(types, diffs, top, inexact)
