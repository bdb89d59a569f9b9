"""Step time of a tensor-parallel target against the whole one, and the all-reduce share of a step.

    nice -n 10 python benchmarks/tp_step.py --out docs/tp           # demo model and SmolLM2-135M

For each model and each N (1, and the smallest N > 1 that shards it: 2 for the demo model, 3 for
SmolLM2-135M, whose 9 query and 3 KV heads 2 does not divide), at batch 1 with --context tokens
already in the KV: the median time of
  - a plain decode step (1 token), and
  - a verify of --verify tokens (the static step's target forward + acceptance, as a draft of
    --verify − 1 tokens is checked),
each the forward on every rank + rank 0's LM head + acceptance, and, for N > 1, the time rank 0
spends inside the all-reduces of that step (torch.distributed.all_reduce wrapped in a timer),
which includes waiting for the slower rank. One torch thread per rank (the CPU has few cores:
N ranks of one thread against N = 1 of one thread, the same total compute split N ways).

On a CPU this shows the overhead of tensor parallelism (the collectives, the step message, the
ranks' skew), not its gain: the gain is splitting a memory-bound step's weight reads over N
devices' bandwidth, and N ranks on one CPU share one memory system.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MODELS = {"demo": ROOT / "models" / "demo" / "target", "smollm2": ROOT / "models" / "smollm2" / "target"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="demo,smollm2", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--context", type=int, default=128, help="tokens already in the KV")
    p.add_argument("--verify", type=int, default=8, help="tokens in the verify step")
    p.add_argument("--reps", type=int, default=20, help="timed steps per cell (after 3 warm-up steps)")
    p.add_argument("--out", type=Path, help="folder for tp_step.json")
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    return args


class AllReduceTimer:
    """Wraps torch.distributed.all_reduce in this process (rank 0) and sums the seconds spent in it."""

    def __init__(self):
        self.seconds, self.calls, self._inner = 0.0, 0, dist.all_reduce

    def __enter__(self):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return self._inner(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        dist.all_reduce = timed
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._inner

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def smallest_world(cfg) -> int:
    return next(n for n in range(2, cfg.num_kv_heads + 1)
                if not (cfg.num_heads % n or cfg.num_kv_heads % n or cfg.intermediate_size % n))


@torch.inference_mode()
def time_steps(model, args, timer: AllReduceTimer | None) -> dict:
    """Median ms of a decode step and of a verify of args.verify tokens (batch 1), and the median
    share of each step spent in all-reduces on rank 0."""
    from specserve.core.static_step import DeviceKV, SamplingTensors, StepInputs, span_for, target_step

    max_len = args.context + args.verify + 2
    cache = model.new_cache(1, max_len)
    cache.allocate()
    kv = DeviceKV(cache)
    span = span_for(args.context + args.verify, max_len, "full")
    out = {}
    for name, T in (("decode", 1), (f"verify{args.verify}", args.verify)):
        # Positions context … context+T−1 are written each step and never committed: every step the same.
        inp = StepInputs(torch.zeros(1, T, dtype=torch.long), torch.tensor([args.context]), torch.tensor([0]),
                         torch.tensor([T - 1]), SamplingTensors.from_params([None], model.device),
                         torch.ones(1, T))
        times, shares, calls = [], [], 0
        for i in range(3 + args.reps):
            if timer is not None:
                timer.reset()
            t0 = time.perf_counter()
            target_step(model, kv, inp, span, sampled=False)
            dt = time.perf_counter() - t0
            if i >= 3:
                times.append(dt)
                if timer is not None:
                    shares.append(timer.seconds / dt)
                    calls = timer.calls
        out[name] = {"ms": round(1000 * statistics.median(times), 3),
                     "all_reduce_share": round(statistics.median(shares), 3) if shares else None,
                     "all_reduces": calls if timer is not None else 0}
    return out


def measure(name: str, args) -> dict:
    from specserve.model.tp_processes import start_tensor_parallel
    from specserve.model.transformer import load_config, load_model

    ckpt = MODELS[name]
    cfg = load_config(ckpt)
    world = smallest_world(cfg)
    row = {"checkpoint": str(ckpt.relative_to(ROOT)), "layers": cfg.num_layers, "hidden": cfg.hidden_size,
           "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "world": world}
    whole = load_model(ckpt, dtype=torch.float32)
    row["N=1"] = time_steps(whole, args, None)
    del whole
    target = start_tensor_parallel(ckpt, world, dtype=torch.float32)   # workers take this process's 1 thread
    try:
        with AllReduceTimer() as timer:
            row[f"N={world}"] = time_steps(target, args, timer)
    finally:
        target.close()
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    report = {"command": "python benchmarks/tp_step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "torch": torch.__version__, "machine": f"{platform.machine()}, {torch.get_num_threads()} thread per rank",
              "dtype": "float32", "batch": 1, "context": args.context, "verify": args.verify, "reps": args.reps,
              "models": {}}
    for name in args.models:
        report["models"][name] = row = measure(name, args)
        w = row["world"]
        for step in ("decode", f"verify{args.verify}"):
            one, many = row["N=1"][step], row[f"N={w}"][step]
            print(f"{name} {step}: N=1 {one['ms']} ms, N={w} {many['ms']} ms "
                  f"({many['ms'] / one['ms']:.2f}x), all-reduce share {many['all_reduce_share']} "
                  f"({many['all_reduces']} all-reduces)", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tp_step.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
