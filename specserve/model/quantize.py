"""Weight-only quantization of the target at load (`specserve serve --quantize int8|int4`).

Which layers: every decoder layer's projections (the fused q/k/v, o, the fused gate/up, down)
become quantized linears (quantized_linear.py). Kept in --dtype:
  * the embedding: a lookup reads one row per token, so its bytes per step are tiny;
  * the LM head, unless `head` is int8: it is the target's own, and the drafters read it as a
    dense tensor (EAGLE's, DFlash's and the MTP heads' logits are target.lm_head.weight @ h); on
    tied checkpoints (SmolLM2) it is the embedding itself. With head int8 (`--quantize-head int8`)
    the target's logits come from an int8 copy (Int8Head) and `.weight` stays the dense tensor
    for the embedding and the drafters: on SmolLM2 the head is 49 152 x 576, the largest single
    read of a quantized step (docs/quantize/README.md measures its cost in perplexity and speed).
  * norms, RoPE, the KV cache: unchanged.

Activations run in --dtype (float32 or bfloat16; the scales are stored in it too). The CPU
kernels take either; CUDA's int4 kernel (tinygemm) takes bfloat16 only, so int4 on CUDA with
float32 is refused rather than silently cast.

A checkpoint folder may hold its projections already quantized (`import-gguf --keep-quantized`:
int4 group 32 from a GGUF file's Q4_0 / Q4_1 tensors, model/q4_checkpoint.py); its
quantization_config.json says so, and it is served as it is (`kept_quantization`,
`served_quantization`).

Nothing here imports torch at module level: the CLI offers the choices and checks a checkpoint's
shapes without loading it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specserve.model.transformer import ModelConfig, Transformer

QUANTIZE_MODES = ("none", "int8", "int4")
# The LM head's: int8 only, because int4 costs +6 % chat perplexity on SmolLM2 (docs/quantize).
HEAD_MODES = ("none", "int8")
# The int4 group sizes both int4 kernels take (_weight_int4pack_mm_for_cpu checks for these).
INT4_GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_GROUP_SIZE = 32
# CUDA's int4 packing tiles the output features by 8 and the input features by 32 at least.
CUDA_INT4_N_MULTIPLE, CUDA_INT4_K_MULTIPLE = 8, 32


class QuantizeError(ValueError):
    """The quantization asked for cannot be applied to this checkpoint, device or dtype."""


@dataclass(frozen=True)
class Quantization:
    mode: str = "none"                     # one of QUANTIZE_MODES
    group_size: int = DEFAULT_GROUP_SIZE   # int4 only: input features per scale and zero
    head: str = "none"                     # the LM head: one of HEAD_MODES

    def label(self) -> str:
        """"none", or what is quantized: "int4 group 32", "int8", "int8 head", "int4 group 32 + int8 head"."""
        body = [] if self.mode == "none" else [self.mode + (f" group {self.group_size}" if self.mode == "int4" else "")]
        head = [] if self.head == "none" else [f"{self.head} head"]
        return " + ".join(body + head) or "none"


def kept_quantization(folder: str | Path) -> Quantization | None:
    """The quantization a checkpoint folder's weights are stored in; None for a dense folder."""
    from specserve.model.q4_checkpoint import Q4_GROUP_SIZE, KeptRecordError, is_kept

    try:
        return Quantization("int4", Q4_GROUP_SIZE) if is_kept(folder) else None
    except KeptRecordError as e:
        raise QuantizeError(str(e)) from None


def served_quantization(asked: Quantization, kept: Quantization | None, folder: str | Path) -> Quantization:
    """What the target runs with: --quantize on a dense folder, the folder's own quantization on a
    kept one (where a --quantize of its own is refused: the weights are quantized already)."""
    if kept is None:
        return asked
    if asked.mode != "none":
        raise QuantizeError(f"{folder} holds int4 group {kept.group_size} weights kept from a GGUF file "
                            f"(quantization_config.json): it is served as it is, without --quantize {asked.mode}")
    return Quantization(kept.mode, kept.group_size, asked.head)   # the head is dense in a kept folder


def linear_shapes(cfg: "ModelConfig") -> dict[str, tuple[int, int]]:
    """The quantized linears of one decoder layer: name → (out_features, in_features)."""
    D, H, Hkv, hd, I = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    return {"self_attn.qkv_proj": ((H + 2 * Hkv) * hd, D), "self_attn.o_proj": (D, H * hd),
            "mlp.gate_up_proj": (2 * I, D), "mlp.down_proj": (D, I)}


def check_quantization(q: Quantization, cfg: "ModelConfig", device_type: str, dtype: str) -> None:
    """Raise QuantizeError when `q` cannot run on this checkpoint / device ("cpu" or "cuda") /
    activation dtype ("float32" or "bfloat16"); the message says what would."""
    if q.mode not in QUANTIZE_MODES:
        raise QuantizeError(f"quantize must be one of {', '.join(QUANTIZE_MODES)}, got {q.mode!r}")
    if q.head not in HEAD_MODES:
        raise QuantizeError(f"quantize head must be one of {', '.join(HEAD_MODES)}, got {q.head!r}")
    if q.mode != "int4":
        return
    if q.group_size not in INT4_GROUP_SIZES:
        raise QuantizeError(f"int4 group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))} "
                            f"(the int4 kernels' sizes), got {q.group_size}")
    shapes = linear_shapes(cfg)
    for name, (n, k) in shapes.items():
        if k % q.group_size:
            fits = [str(g) for g in INT4_GROUP_SIZES if all(kk % g == 0 for _, kk in shapes.values())]
            raise QuantizeError(f"int4 group size {q.group_size} does not divide {name}'s {k} input features; "
                                + (f"sizes that divide every layer's: {', '.join(fits)}" if fits else
                                   "no int4 group size divides every layer's: use int8"))
        if device_type == "cuda" and (n % CUDA_INT4_N_MULTIPLE or k % CUDA_INT4_K_MULTIPLE):
            raise QuantizeError(f"int4 on CUDA needs out features a multiple of {CUDA_INT4_N_MULTIPLE} and in "
                                f"features a multiple of {CUDA_INT4_K_MULTIPLE}; {name} is {n} x {k}")
    if device_type == "cuda" and dtype != "bfloat16":
        raise QuantizeError(f"int4 on CUDA needs --dtype bfloat16 (its kernel takes bf16 activations only), "
                            f"got {dtype}")


def quantize_target(model: "Transformer", q: Quantization) -> "Transformer":
    """Replace `model`'s decoder projections (q.mode) and LM head (q.head) by quantized ones in
    place (checked first); returns it. Mode and head none leave it as it is. On a folder whose
    projections are kept quantized, q.mode is none and only the head is quantized here."""
    check_quantization(q, model.cfg, model.device.type, str(model.dtype).removeprefix("torch."))
    from specserve.model.quantized_linear import Int4Linear, Int8Head, Int8Linear

    if q.head == "int8":
        model.lm_head = Int8Head(model.lm_head)
    if q.mode == "none":
        return model
    for layer in model.layers:
        for name in linear_shapes(model.cfg):
            parent_name, attr = name.split(".")
            parent = getattr(layer, parent_name)
            dense = getattr(parent, attr)
            setattr(parent, attr, Int8Linear(dense) if q.mode == "int8" else Int4Linear.from_linear(dense, q.group_size))
    return model
