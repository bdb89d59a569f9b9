"""Where one decode step of the target goes, operator by operator (torch.profiler, CPU).

    python benchmarks/step_profile.py [--target models/smollm2/target] [--dtype bfloat16]
        [--quantize int4] [--steps 10] [--span 128] [--threads 2] [--rows 15]

The step is the static step (core/static_step.target_step) at batch 1, K = 0 (a plain decode
step: the forward over the KV pool, the LM head, greedy acceptance), after 5 untimed steps.
Prints the wall time per step, then the operators by self CPU time, divided by --steps so each
figure is per step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.core.static_step import DeviceKV, SamplingTensors, StepInputs, target_step  # noqa: E402
from specserve.model.quantize import Quantization, quantize_target  # noqa: E402
from specserve.model.transformer import load_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="models/smollm2/target")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--quantize", default="int4", choices=("none", "int8", "int4"))
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--span", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.target, dtype=getattr(torch, args.dtype)).eval()
    if args.quantize != "none":
        model = quantize_target(model, Quantization(args.quantize, args.group_size))
    kv = DeviceKV(model.new_cache(1, 2 * args.span))
    inp = StepInputs(tokens=torch.tensor([[42]]), lengths=torch.tensor([args.span // 2]), slots=torch.tensor([0]),
                     draft_lens=torch.tensor([0]), sampling=SamplingTensors.from_params([None], "cpu"),
                     uniforms=torch.ones(1, 1))
    with torch.inference_mode():
        for _ in range(5):
            target_step(model, kv, inp, args.span, sampled=False)
        t = time.perf_counter()
        for _ in range(args.steps):
            target_step(model, kv, inp, args.span, sampled=False)
        wall = (time.perf_counter() - t) / args.steps * 1e3
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                target_step(model, kv, inp, args.span, sampled=False)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"{args.dtype} {args.quantize}: {wall:.1f} ms a step unprofiled; profiled, per step:")
    print(f"{'operator':48} {'ms':>7} {'share':>6} {'calls':>6}")
    for e in events[:args.rows]:
        print(f"{e.key[:48]:48} {e.self_cpu_time_total / 1e3 / args.steps:7.2f} "
              f"{e.self_cpu_time_total / total:6.1%} {e.count // args.steps:6d}")
    rest = sum(e.self_cpu_time_total for e in events[args.rows:])
    print(f"{'(the other ' + str(len(events) - args.rows) + ' operators)':48} {rest / 1e3 / args.steps:7.2f} {rest / total:6.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
