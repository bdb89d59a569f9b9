"""Build TensorRT engines from the exported ONNX drafter (GPU machines only).

    python training/build_trt.py --onnx-dir DIR --out DIR [--max-batch 16] [--max-tokens 1024]
        [--max-draft-len 8] [--fp16]

Writes <name>.plan for eagle_backbone.onnx and calibration_head.onnx with one optimisation
profile each: the backbone 1..max-batch rows, 1..max-tokens new pairs and 0..max-tokens cached
pairs; the calibration head 1..max-batch × max-draft-len positions (it scores every drafted
position of every row in one call).
Needs the `tensorrt` package (pip install -e '.[gpu]') and a CUDA GPU; without them it exits
with status 2 and says which is missing — it never writes a placeholder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The builder is the package's (an installed specserve builds plans at render time too).
from specserve.triton.tensorrt_plan import build, missing_requirements


def backbone_shapes(D: int, kv_heads: int, head_dim: int, max_batch: int, max_tokens: int):
    B, T, P = max_batch, max_tokens, max_tokens
    three = lambda last: ((1, 1, last), (B // 2 or 1, 1, last), (B, T, last))
    return {
        "features": three(D),
        "next_tokens": ((1, 1), (B // 2 or 1, 1), (B, T)),
        "positions": ((1, 1), (B // 2 or 1, 1), (B, T)),
        "past_k": ((1, kv_heads, 0, head_dim), (B // 2 or 1, kv_heads, P // 2, head_dim), (B, kv_heads, P, head_dim)),
        "past_v": ((1, kv_heads, 0, head_dim), (B // 2 or 1, kv_heads, P // 2, head_dim), (B, kv_heads, P, head_dim)),
        "mask": ((1, 1, 1), (B // 2 or 1, 1, P // 2 + 1), (B, T, P + T)),
    }


def calibration_shapes(D: int, max_batch: int, max_draft_len: int):
    n = max_batch * max_draft_len
    return {"hidden": ((1, D), (n, D), (n, D)), "scalars": ((1, 3), (n, 3), (n, 3))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--onnx-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--max-draft-len", type=int, default=8, help="the server's --max-draft-len")
    ap.add_argument("--fp16", action="store_true")
    args = ap.parse_args(argv)
    why = missing_requirements()
    if why:
        print(f"build_trt: cannot build TensorRT engines here: {why}", file=sys.stderr)
        return 2
    import onnx

    bb = args.onnx_dir / "eagle_backbone.onnx"
    graph = onnx.load(str(bb), load_external_data=False).graph
    dims = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    D, kv_heads, head_dim = dims["features"][2], dims["past_k"][1], dims["past_k"][3]
    args.out.mkdir(parents=True, exist_ok=True)
    build(bb, args.out / "eagle_backbone.plan",
          backbone_shapes(D, kv_heads, head_dim, args.max_batch, args.max_tokens), args.fp16)
    cal = args.onnx_dir / "calibration_head.onnx"
    if cal.is_file():
        build(cal, args.out / "calibration_head.plan", calibration_shapes(D, args.max_batch, args.max_draft_len),
              args.fp16)
    print(f"wrote TensorRT engines to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
