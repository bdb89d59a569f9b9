"""The target's dense linear kernels on this CPU at the row counts a decode / verify step uses.

    python benchmarks/dense_kernels.py [--rows 1,2,3,4,5,6,8,9,16] [--threads 2] [--reps 7] [--out F.json]

For each row count M, one "layer sweep" is 30 distinct weights of SmolLM2-135M's widest
projection shape (gate/up, 3072 x 576: 212 MB in fp32, so they stream from memory as in a real
forward, not from cache) and one LM-head call (49 152 x 576), through each kernel:
  aten     F.linear (MKL sgemm for float32 on a CPU)
  onednn   torch.ops.mkldnn._linear_pointwise (model/dense_linear.OneDNNLinear)
and, for reference, bf16 F.linear (already oneDNN). The best of --reps runs is kept (the least
disturbed by other work). Prints one row per M: ms per sweep and per head call, and onednn's
speed over aten's.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F


def best_ms(fn, reps: int) -> float:
    fn()   # warm-up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,9,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    onednn = torch.ops.mkldnn._linear_pointwise
    torch.manual_seed(0)
    layers = [torch.randn(3072, 576) for _ in range(30)]   # 30 x [N, K] fp32
    head = torch.randn(49152, 576)
    layers_bf16 = [w.bfloat16() for w in layers]
    rows = []
    print(f"{'M':>3} {'aten 30x':>9} {'onednn 30x':>10} {'x':>5} {'bf16 30x':>9} {'aten head':>9} {'onednn head':>11} {'x':>5}")
    for M in (int(m) for m in args.rows.split(",")):
        x = torch.randn(M, 576)   # [M, K]
        xb = x.bfloat16()
        r = {"rows": M,
             "aten_sweep_ms": best_ms(lambda: [F.linear(x, w) for w in layers], args.reps),
             "onednn_sweep_ms": best_ms(lambda: [onednn(x, w, None, "none", [], "") for w in layers], args.reps),
             "bf16_sweep_ms": best_ms(lambda: [F.linear(xb, w) for w in layers_bf16], args.reps),
             "aten_head_ms": best_ms(lambda: F.linear(x, head), args.reps),
             "onednn_head_ms": best_ms(lambda: onednn(x, head, None, "none", [], ""), args.reps)}
        r = {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}
        rows.append(r)
        print(f"{M:3d} {r['aten_sweep_ms']:9.2f} {r['onednn_sweep_ms']:10.2f} "
              f"{r['aten_sweep_ms'] / r['onednn_sweep_ms']:5.2f} {r['bf16_sweep_ms']:9.2f} "
              f"{r['aten_head_ms']:9.2f} {r['onednn_head_ms']:11.2f} {r['aten_head_ms'] / r['onednn_head_ms']:5.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python benchmarks/dense_kernels.py " + " ".join(argv or []),
                       "torch": torch.__version__, "threads": args.threads, "reps": args.reps,
                       "cpu": platform.processor() or platform.machine(), "rows": rows}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
