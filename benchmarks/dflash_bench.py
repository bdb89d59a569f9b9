"""DFlash vs EAGLE vs plain decoding on the demo model (issue 11's measurement list).

    python benchmarks/dflash_bench.py [--prompts 8] [--new-tokens 64] [--concurrency 1,8] [--out F.json]

1. Serving (one tritonserver started here, both drafters fused, float32 target, greedy):
   held-out code and prose prompts alternated, none / eagle / dflash (block cut by confidence at
   the server's spec_threshold 0.3) / dflash_full (whole blocks) on every block of requests
   in an order rotated per block (benchmarks/serving_phases.py), at concurrency 1 (one request
   at a time) and 8: acceptance length by prompt kind, tokens/s, speedups; every greedy output
   compared with none's.
2. Sweeps (in process, the same held-out prompts, greedy, batched): acceptance length against
   the block size (4, 8, 16) and against the memory's W and r. W and r are narrowed at inference
   from the trained drafter (W = 32, r = 64): the newest W distances of the ring, the first r pool
   slots (dflash.narrowed) — no drafter was retrained at the smaller sizes.
3. Memory: drafter state bytes per sequence at 512, 2048 and 4096 tokens against a drafter that
   keeps every token's fused feature vector (and every token's raw multi-layer features).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from serving_phases import DEMO, alternated_prompts, run_phases  # noqa: E402

# configuration → sampling-parameter overrides. dflash cuts its block where the product of its
# top-1 probabilities falls below the server's --spec-threshold (0.3); dflash_full drafts the
# whole block every step (spec_threshold 0).
CONFIGS = {"dflash": {"spec_method": "dflash"}, "dflash_full": {"spec_method": "dflash", "spec_threshold": 0},
           "eagle": {"spec_method": "eagle"}, "none": {"spec_method": "none"}}
METHODS = list(CONFIGS)


def serving(args, log=print) -> dict:
    from specserve.serving.settings import DeploymentSettings

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    settings = DeploymentSettings(DEMO / "target", max_num_seqs=max(concurrencies), max_model_len=1024,
                                  max_draft_len=8, default_method="none",
                                  drafters=(("eagle", str(DEMO / "eagle")), ("dflash", str(DEMO / "dflash"))),
                                  device="cpu", draft_policy="fixed")
    phases = run_phases(settings, METHODS,
                        lambda req, m: {"max_tokens": req.max_tokens, "temperature": 0.0, **CONFIGS[m]},
                        prompts=alternated_prompts(args.prompts), concurrencies=concurrencies,
                        new_tokens=args.new_tokens, log=log)
    return {f"C={c}": v for c, v in phases.items()}


def sweeps(args, log=print) -> dict:
    import torch

    from specserve.core.engine import Engine, EngineConfig, GenerationRequest
    from specserve.model.transformer import load_model
    from specserve.methods.dflash.drafter import load_dflash, narrowed
    from specserve.methods.dflash.proposer import DFlashProposer
    from specserve.methods.ngram.proposer import NgramProposer
    from specserve.core.sampling import SamplingParams
    from specserve.model.devices import resolve_drafter_dtype
    from specserve.model.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    target = load_model(DEMO / "target")
    tok = load_tokenizer(DEMO / "target")
    base = load_dflash(DEMO / "dflash", target, dtype=resolve_drafter_dtype("auto", target))
    prompts = alternated_prompts(args.prompts)
    ids = [tok.encode(p["prompt"]).ids for p in prompts]

    def acceptance(drafter, block: int) -> dict:
        proposer = DFlashProposer(drafter, target, max_num_seqs=len(ids), block_size=block)
        engine = Engine(target, EngineConfig(max_num_seqs=len(ids), max_model_len=1024, max_draft_len=block - 1),
                        {"dflash": proposer, "ngram": NgramProposer()})
        got = engine.generate([GenerationRequest(str(i), p, SamplingParams(max_tokens=args.new_tokens), "dflash")
                               for i, p in enumerate(ids)])
        by_kind: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            st = got[str(i)].stats
            acc = by_kind.setdefault(p["kind"], [0, 0])
            acc[0] += st.accepted_tokens + st.steps
            acc[1] += st.steps
        out = {k: round(a / s, 4) for k, (a, s) in by_kind.items()}
        out["all"] = round(sum(a for a, _ in by_kind.values()) / sum(s for _, s in by_kind.values()), 4)
        out["guard_steps"] = sum(got[str(i)].stats.guard_steps for i in range(len(ids)))
        return out

    res = {"block_size": {}, "window": {}, "pool_slots": {}}
    for b in (4, 8, 16):
        res["block_size"][b] = acceptance(base, b)
        log(f"block {b}: {res['block_size'][b]}")
    c = base.cfg
    for w in (8, 16, c.window):
        res["window"][w] = res["block_size"][8] if w == c.window else acceptance(narrowed(base, window=w), 8)
        log(f"W {w}: {res['window'][w]}")
    for r in (1, 16, c.pool_slots):
        res["pool_slots"][r] = res["block_size"][8] if r == c.pool_slots else acceptance(narrowed(base, pool_slots=r), 8)
        log(f"r {r}: {res['pool_slots'][r]}")
    res["note"] = ("in process, batched, greedy; W and r narrowed at inference from the trained drafter "
                   f"(W={c.window}, r={c.pool_slots}); prompts are short (tens of tokens) + {args.new_tokens} "
                   "new tokens, so the memory past the ring is small here")
    return res


def memory_table() -> dict:
    import torch

    from specserve.model.transformer import load_model
    from specserve.methods.dflash.drafter import load_dflash
    from specserve.methods.dflash.memory import SequenceMemory, budget_bytes, full_feature_bytes

    target = load_model(DEMO / "target")
    d = load_dflash(DEMO / "dflash", target)
    c = d.cfg
    raw_width = (1 + len(c.target_layers)) * c.hidden_size
    out = {}
    for n in (512, 2048, 4096):
        mem = SequenceMemory(c.window, c.hidden_size, c.pool_slots, c.pool_rank)
        feats = torch.randn(n, raw_width)
        with torch.inference_mode():
            for chunk in feats.split(64):
                mem.append(d.fuse_features(chunk), d.pool)
        full = full_feature_bytes(n, c.hidden_size)
        out[n] = {"bounded_bytes": mem.num_bytes(), "budget_bytes": budget_bytes(n, c.window, c.pool_slots,
                                                                                  c.pool_rank, c.hidden_size),
                  "every_token_fused_bytes": full, "every_token_raw_features_bytes": n * raw_width * 4,
                  "ratio_to_fused": round(mem.num_bytes() / full, 4),
                  "ratio_to_raw": round(mem.num_bytes() / (n * raw_width * 4), 4)}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per kind (code, prose)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for the in-process sweeps")
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    t0 = time.time()
    report = {"command": "python benchmarks/dflash_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "python": platform.python_version(),
                          "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
              "drafter": json.loads((DEMO / "dflash" / "config.json").read_text()),
              "memory": memory_table()}
    if not args.skip_serving:
        report["serving"] = serving(args)
    report["sweeps"] = sweeps(args)
    report["wall_time_s"] = round(time.time() - t0, 1)
    if "serving" in report:
        report["summary"] = summary(report["serving"])
        print(json.dumps(report["summary"], indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def summary(serving: dict) -> dict:
    out = {}
    for phase, res in serving.items():
        tps = {m: res[m]["output_throughput"] for m in METHODS}
        out[phase] = {
            "acceptance_length": {m: {k: round(v["mean_acceptance_length"], 3)
                                      for k, v in res[m]["by_kind"].items() if v["mean_acceptance_length"]}
                                  for m in ("dflash", "dflash_full", "eagle")},
            "tokens_per_s": {m: round(v, 2) for m, v in tps.items()},
            "speedup_dflash_over_none": round(tps["dflash"] / tps["none"], 3),
            "speedup_dflash_full_over_none": round(tps["dflash_full"] / tps["none"], 3),
            "speedup_dflash_over_eagle": round(tps["dflash"] / tps["eagle"], 3),
            "speedup_eagle_over_none": round(tps["eagle"] / tps["none"], 3),
            "identical_to_none": {m: res[m]["identical_to_none"] for m in METHODS},
            "proposer_errors": {m: res[m]["proposer_errors"] for m in METHODS},
            "guard_steps_of_steps": {m: {k: [v["guard_steps"], v["steps"]] for k, v in res[m]["by_kind"].items()}
                                     for m in ("dflash", "dflash_full")},
        }
    return out


if __name__ == "__main__":
    main()
