"""The price of reproducibility: acceptance length of seeded (coupled Gumbel-max) against unseeded
(rejection sampling) requests, for EAGLE, DFlash and MTP on the demo model.

    python benchmarks/seeded_acceptance.py [--prompts 3] [--new-tokens 48] [--seeds 2] [--out F.json]

In process, one engine with every demo drafter fused (float32 target), the held-out prompts of
models/demo/heldout_prompts.jsonl (code and prose alternated: serving_phases.alternated_prompts),
all requests of one (method, temperature, mode) in one batch, `ignore_eos` so every request
makes --new-tokens tokens. Unseeded requests draw from fresh random generators, so their
numbers move a little from run to run; the seeded ones are the same every run.
Acceptance length = (accepted + steps) / steps over all requests
(docs/design.md, 'State and verification'). It also checks that every seeded output equals `none`'s for its seed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from serving_phases import DEMO, alternated_prompts  # noqa: E402

METHODS = ("eagle", "dflash", "mtp")
TEMPERATURES = (0.7, 1.0)


def run(args, log=print) -> dict:
    import torch

    from specserve.core.engine import GenerationRequest
    from specserve.core.sampling import SamplingParams
    from specserve.methods import registry
    from specserve.serving.build import build_engine
    from specserve.serving.settings import DeploymentSettings

    torch.set_num_threads(args.threads)
    drafters = tuple((m, str(DEMO / m)) for m in registry.folder_methods())
    prompts = alternated_prompts(args.prompts)
    n = len(prompts) * args.seeds
    engine, tok = build_engine(DeploymentSettings(DEMO / "target", max_num_seqs=n, max_model_len=512, drafters=drafters,
                                                   device="cpu", draft_policy="fixed", default_method="none"))
    ids = [tok.encode(p["prompt"]).ids for p in prompts]

    def batch(method: str, temperature: float, mode: str) -> dict:
        reqs = []
        for i, p in enumerate(ids):
            for s in range(args.seeds):
                seed = 1 + s + args.seeds * i
                params = SamplingParams(max_tokens=args.new_tokens, temperature=temperature, ignore_eos=True,
                                        seed=seed if mode == "seeded" else None)
                reqs.append(GenerationRequest(f"{method}-{mode}-{i}-{s}", p, params, method=method))
        t0 = time.perf_counter()
        out = engine.generate(reqs)
        steps = sum(o.stats.steps for o in out.values())
        accepted = sum(o.stats.accepted_tokens for o in out.values())
        return {"acceptance_length": round((accepted + steps) / steps, 3), "steps": steps,
                "draft_tokens": sum(o.stats.draft_tokens for o in out.values()),
                "accepted_tokens": accepted, "seconds": round(time.perf_counter() - t0, 2),
                "tokens": {rid: o.new_token_ids for rid, o in out.items()}}

    results: dict = {}
    for T in TEMPERATURES:
        plain = batch("none", T, "seeded")["tokens"]
        for m in METHODS:
            row = {}
            for mode in ("seeded", "unseeded"):
                r = batch(m, T, mode)
                if mode == "seeded":
                    r["equals_none"] = all(r["tokens"][rid] == plain[rid.replace(m, "none", 1)] for rid in r["tokens"])
                del r["tokens"]
                row[mode] = r
            row["seeded_over_unseeded"] = round(row["seeded"]["acceptance_length"]
                                                / row["unseeded"]["acceptance_length"], 3)
            results.setdefault(f"T={T}", {})[m] = row
            log(f"T={T} {m}: seeded {row['seeded']['acceptance_length']} vs unseeded "
                f"{row['unseeded']['acceptance_length']} (equals none: {row['seeded']['equals_none']})")
    return {"results": results,
            "setup": {"prompts": f"{len(prompts)} held-out prompts (models/demo/heldout_prompts.jsonl, "
                                 f"code and prose alternated)", "seeds_per_prompt": args.seeds,
                      "new_tokens": args.new_tokens, "max_draft_len": 8, "spec_threshold": 0.3,
                      "draft_policy": "fixed", "target_dtype": "float32", "device": "cpu",
                      "machine": platform.processor() or platform.machine(), "threads": args.threads},
            "command": " ".join(["python", "benchmarks/seeded_acceptance.py", *sys.argv[1:]])}


def main(doc: str = __doc__, measure=None, default_out: Path = ROOT / "docs" / "sampling" / "seeded.json") -> None:
    """The command line of this benchmark, and of remote_seeded_acceptance (its `measure`)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3, help="held-out prompts of each kind (code, prose)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--seeds", type=int, default=2, help="requests (seeds) per prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=default_out)
    args = ap.parse_args()
    report = (measure or run)(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
