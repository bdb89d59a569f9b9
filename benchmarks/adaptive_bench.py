"""Speculation that never costs throughput (issue 14): the default method (EAGLE) against plain
decoding at concurrency 1, 2, 4, 8, 16, 32 on the demo model, with the adaptive draft policy
and with the fixed one, through Triton, alternated in one run.

    python benchmarks/adaptive_bench.py [--prompts 8] [--new-tokens 64] \
        [--concurrency 1,2,4,8,16,32] [--out docs/reliability/adaptive.json]

One tritonserver (fused EAGLE drafter, fp32, `--draft-policy adaptive`, which profiles verify
costs at start); three configurations per block of requests, in an order rotated per block
(specserve.cli.bench.runner.run_phase): `none`, `eagle` (adaptive: the engine picks each step's
draft length) and `eagle/fixed` (draft_policy "fixed": up to 8 tokens every step, as before).
Prompts: held-out code and prose alternated. Greedy, so every configuration's text must equal
none's (checked). Output tokens/s and its ratio to none are from the same blocks.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serving_phases import DEMO, alternated_prompts, run_phases  # noqa: E402

CONFIGS = {"none": ("none", None), "eagle": ("eagle", "adaptive"), "eagle/fixed": ("eagle", "fixed")}


def _round(x):
    return None if x is None else round(x, 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts of each kind (code, prose)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--out", type=Path, default=Path("docs/reliability/adaptive.json"))
    args = ap.parse_args()

    from specserve.serving.settings import DeploymentSettings

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    settings = DeploymentSettings(DEMO / "target", max_num_seqs=max(concurrencies), max_model_len=1024,
                                  max_draft_len=8, default_method="eagle", drafters=(("eagle", str(DEMO / "eagle")),),
                                  draft_policy="adaptive", max_queue_len=4 * max(concurrencies))

    def sampling(req, config):
        method, policy = CONFIGS[config]
        out = {"max_tokens": req.max_tokens, "temperature": 0.0, "spec_method": method}
        if policy:
            out["draft_policy"] = policy
        return out

    phases = run_phases(settings, list(CONFIGS), sampling, prompts=alternated_prompts(args.prompts),
                        concurrencies=concurrencies, new_tokens=args.new_tokens)

    rows = []
    for c, summary in phases.items():
        base = summary["none"]["output_throughput"]
        for m in CONFIGS:
            s = summary[m]
            tps = s["output_throughput"]
            rows.append({"concurrency": c, "config": m, "tokens_per_s": round(tps, 1),
                         "x_none": round(tps / base, 3) if base else None,
                         "acceptance_length": _round(s["mean_acceptance_length"]),
                         "draft_tokens_per_step": _round(s["draft_tokens_per_step"]),
                         "identical_to_none": s["identical_to_none"], "errors": s["errors"]})
    report = {"command": "python " + " ".join(sys.argv), "machine": platform.processor() or platform.machine(),
              "rows": rows, "phases": {str(c): v for c, v in phases.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print("| concurrency | config | tok/s | × none | acc. len | draft tok/step | same text as none | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['config']} | {r['tokens_per_s']} | {r['x_none']} | "
              f"{r['acceptance_length']} | {r['draft_tokens_per_step']} | {r['identical_to_none']} | {r['errors']} |")
    bad = [r for r in rows if r["identical_to_none"] not in (None, 1.0) or r["errors"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
