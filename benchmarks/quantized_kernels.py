"""One SmolLM2 projection at M = 1 (576 → 1536, as gate/up), dense against the int8 and int4 (group 32)
weight-only kernels that `--quantize` serves with (specserve/model/quantized_linear.py), for fp32 and
bf16 activations: which activation dtype a CPU's quantized kernels want.

    python benchmarks/quantized_kernels.py [--threads 2] [--calls 200]

Prints µs a call (the mean of --calls after 10 warm-up calls), alternating nothing: each kernel is
timed alone on the same input, so run it on a quiet machine (docs/quantize/README.md).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from specserve.model.quantized_linear import Int4Linear, Int8Linear


def per_call_us(layer: torch.nn.Module, x: torch.Tensor, calls: int) -> float:
    for _ in range(10):
        layer(x)
    start = time.perf_counter()
    for _ in range(calls):
        layer(x)
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--in-features", type=int, default=576)
    ap.add_argument("--out-features", type=int, default=1536)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dense = torch.nn.Linear(args.in_features, args.out_features, bias=False)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads, "
          f"{args.in_features} -> {args.out_features}, M = 1; us a call")
    print(f"{'activations':12} {'dense':>8} {'int8':>8} {'int4 g32':>9}")
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            layer = dense.to(dtype)
            x = torch.randn(1, 1, args.in_features, dtype=dtype)   # [B, T, D]
            row = [per_call_us(m, x, args.calls) for m in (layer, Int8Linear(layer), Int4Linear.from_linear(layer, 32))]
            print(f"{str(dtype).removeprefix('torch.'):12} " + " ".join(f"{v:8.0f}" for v in row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
