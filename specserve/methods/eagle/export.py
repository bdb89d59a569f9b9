"""Export an EAGLE drafter to ONNX: the backbone step (own KV as explicit inputs/outputs, with the
target's embedding and LM head folded in) and the calibration head. Used by
`training/export_onnx.py` and by the renderer when drafters are served remotely.

Writes DIR/eagle_backbone.onnx and DIR/calibration_head.onnx, checks both with onnx.checker and
compares onnxruntime with torch on shapes other than the export example (max |diff| <= tol).

eagle_backbone I/O (B rows, T new pairs, P cached pairs, D hidden, V vocab):
  features     [B, T, D]  float32  target features f_i of the pairs
  next_tokens  [B, T]     int64    t_{i+1}
  positions    [B, T]     int64    RoPE positions (pair index i)
  past_k/v     [B, Hkv, P, hd]     the drafter's cache for this row
  mask         [B, T, P+T] bool    True = may attend (explicit, like every forward here)
  → hidden [B, T, D] (f̂_{i+1}), logits [B, T, V], present_k/v [B, Hkv, P+T, hd]
calibration_head I/O: hidden [N, D], scalars [N, 3] (top-1 prob, entropy, position/8) → accept_prob [N]
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specserve.core.masks import build_mask
from specserve.core.forward import ForwardBatch
from specserve.model.transformer import Attention, Transformer
from specserve.methods.eagle.drafter import EagleDrafter

OPSET = 17


class _ConcatKV:
    """Stands in for KVCache during export: the new k/v are appended to the explicit past."""

    def __init__(self, past_k: torch.Tensor, past_v: torch.Tensor):
        self.k, self.v = past_k, past_v

    def write(self, layer, slots, starts, k, v):
        self.k = torch.cat([self.k, k], dim=2)
        self.v = torch.cat([self.v, v], dim=2)

    def read(self, layer, slots, span):
        return self.k, self.v


class EagleStep(nn.Module):
    def __init__(self, drafter: EagleDrafter, target: Transformer):
        super().__init__()
        self.drafter = drafter
        for m in drafter.modules():
            if isinstance(m, Attention):
                m.expand_kv_heads = True
        self.embed = target.embed_tokens
        self.lm_head = target.lm_head

    def forward(self, features, next_tokens, positions, past_k, past_v, mask):
        kv = _ConcatKV(past_k, past_v)
        zeros = torch.zeros(features.shape[0], dtype=torch.long)
        batch = ForwardBatch(next_tokens, positions, zeros, zeros, mask)
        hidden = self.drafter(features, self.embed(next_tokens), batch, kv)
        return hidden, self.lm_head(hidden).float(), kv.k, kv.v


class CalibrationStep(nn.Module):
    def __init__(self, drafter: EagleDrafter):
        super().__init__()
        self.head = drafter.calibration

    def forward(self, hidden, scalars):
        return torch.sigmoid(self.head(hidden, scalars))


@dataclass
class ExportReport:
    backbone: Path
    calibration: Path | None
    backbone_max_abs_diff: float
    calibration_max_abs_diff: float | None


def example_inputs(drafter: EagleDrafter, vocab: int, B: int = 2, T: int = 3, P: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    c = drafter.cfg
    feats = torch.randn(B, T, c.hidden_size, generator=g)
    toks = torch.randint(0, vocab, (B, T), generator=g)
    mask, positions = build_mask([P] * B, [list(range(-1, T - 1))] * B, T)
    past_k = torch.randn(B, c.num_kv_heads, P, c.head_dim, generator=g)
    past_v = torch.randn(B, c.num_kv_heads, P, c.head_dim, generator=g)
    return feats, toks, positions, past_k, past_v, mask


def export(target: Transformer, drafter: EagleDrafter, out: Path, tol: float = 1e-4) -> ExportReport:
    if not isinstance(drafter, EagleDrafter):
        raise ValueError(
            "EAGLE-3 drafters cannot be exported to ONNX yet, so they have no remote placement: the "
            "eagle_backbone step and its BLS schema carry one final hidden state per token [B, T, D] and "
            "use the target's LM head, while an EAGLE-3 drafter needs the fused target layers "
            "[B, T, (1 + L) D] on ingest, its own hidden state when drafting, and its reduced-vocabulary "
            "LM head with d2t. Serve it fused (placement: fused).")
    import onnx
    import onnxruntime as ort

    out.mkdir(parents=True, exist_ok=True)
    step = EagleStep(drafter, target).eval()
    inputs = example_inputs(drafter, target.cfg.vocab_size)
    names_in = ["features", "next_tokens", "positions", "past_k", "past_v", "mask"]
    names_out = ["hidden", "logits", "present_k", "present_v"]
    dyn = {"features": {0: "B", 1: "T"}, "next_tokens": {0: "B", 1: "T"}, "positions": {0: "B", 1: "T"},
           "past_k": {0: "B", 2: "P"}, "past_v": {0: "B", 2: "P"}, "mask": {0: "B", 1: "T", 2: "S"},
           "hidden": {0: "B", 1: "T"}, "logits": {0: "B", 1: "T"},
           "present_k": {0: "B", 2: "S"}, "present_v": {0: "B", 2: "S"}}
    bb = out / "eagle_backbone.onnx"
    with torch.no_grad():
        torch.onnx.export(step, inputs, str(bb), input_names=names_in, output_names=names_out,
                          dynamic_axes=dyn, opset_version=OPSET, dynamo=False)
    onnx.checker.check_model(str(bb))
    # Check on DIFFERENT shapes than the export example, so dynamic axes are really dynamic.
    check = example_inputs(drafter, target.cfg.vocab_size, B=3, T=1, P=9, seed=1)
    with torch.no_grad():
        want = step(*check)
    sess = ort.InferenceSession(str(bb), providers=["CPUExecutionProvider"])
    got = sess.run(names_out, {n: t.numpy() for n, t in zip(names_in, check)})
    bb_diff = max(float(np.abs(g - w.numpy()).max()) for g, w in zip(got, want))
    if bb_diff > tol:
        raise RuntimeError(f"onnxruntime differs from torch by {bb_diff:.2e} > {tol} on eagle_backbone")

    cal_path, cal_diff = None, None
    if drafter.calibration is not None:
        cal = CalibrationStep(drafter).eval()
        cal_path = out / "calibration_head.onnx"
        h = torch.randn(4, drafter.cfg.hidden_size)
        s = torch.rand(4, 3)
        with torch.no_grad():
            torch.onnx.export(cal, (h, s), str(cal_path), input_names=["hidden", "scalars"],
                              output_names=["accept_prob"], opset_version=OPSET, dynamo=False,
                              dynamic_axes={"hidden": {0: "N"}, "scalars": {0: "N"}, "accept_prob": {0: "N"}})
        onnx.checker.check_model(str(cal_path))
        h2, s2 = torch.randn(7, drafter.cfg.hidden_size), torch.rand(7, 3)
        with torch.no_grad():
            want = cal(h2, s2).numpy()
        got = ort.InferenceSession(str(cal_path), providers=["CPUExecutionProvider"]).run(
            ["accept_prob"], {"hidden": h2.numpy(), "scalars": s2.numpy()})[0]
        cal_diff = float(np.abs(got - want).max())
        if cal_diff > tol:
            raise RuntimeError(f"onnxruntime differs from torch by {cal_diff:.2e} > {tol} on calibration_head")
    return ExportReport(bb, cal_path, bb_diff, cal_diff)
