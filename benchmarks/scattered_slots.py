"""Decode steps over rows whose KV slots are scattered: attention reading each run of
consecutive slots as a view of the pool (ForwardBatch.slot_runs, the engine's default on a CPU)
against one gathered read of every row's slot (the engine before slot runs), alternated round by
round on the same engine and the same sequences, so both see the same contexts.

    python benchmarks/scattered_slots.py --target models/smollm2/target [--rows 64] [--context 600] \
        [--steps 10] [--rounds 2]

Scattering: `--rows` requests are admitted, every other one ends after 2 tokens, and `--rows`/2
new requests take the freed slots, so no two consecutive rows hold consecutive slots (every run
is one row long: the most reads). Reports seconds a step and output tokens/s of each read, per
round and as the ratio of their sums. Greedy, float32, the fixed draft policy, `none`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from specserve.core.engine import GenerationRequest  # noqa: E402
from specserve.core.kv_cache import KVCache, slot_runs  # noqa: E402
from specserve.core.sampling_params import SamplingParams  # noqa: E402
from specserve.serving.build import build_engine  # noqa: E402
from specserve.serving.settings import DeploymentSettings  # noqa: E402

# How KVCache.runs_for answers during each read's steps: always runs / always one gather.
READS = {"runs": lambda cache, slots, span: slot_runs(slots), "gather": lambda cache, slots, span: None}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=ROOT / "models" / "smollm2" / "target")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=600, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per read and round")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    if args.rows < 4 or args.rows % 2:
        ap.error("--rows must be even and at least 4")
    new_tokens = 8 + 2 * args.steps * args.rounds   # every long request lasts the whole run
    engine, tok = build_engine(DeploymentSettings(args.target, max_num_seqs=args.rows,
                                                  max_model_len=args.context + new_tokens + 16,
                                                  device="cpu", dtype="float32", draft_policy="fixed"))
    V = engine.model.cfg.vocab_size

    def prompt(i: int) -> list[int]:
        return [(97 * i + 13 * j) % (V - 1) + 1 for j in range(args.context)]

    for i in range(args.rows):
        engine.submit(GenerationRequest(f"a{i}", prompt(i), SamplingParams(
            max_tokens=2 if i % 2 else new_tokens, temperature=0.0, ignore_eos=True), "none"))
    for _ in range(3):
        engine.step()
    for i in range(args.rows // 2):
        engine.submit(GenerationRequest(f"b{i}", prompt(args.rows + i), SamplingParams(
            max_tokens=new_tokens, temperature=0.0, ignore_eos=True), "none"))
    for _ in range(3):
        engine.step()
    rounds, default = [], KVCache.runs_for
    for r in range(args.rounds):
        got = {}
        for name in (("runs", "gather") if r % 2 else ("gather", "runs")):
            KVCache.runs_for = READS[name]
            tokens, t0 = 0, time.perf_counter()
            for _ in range(args.steps):
                tokens += sum(len(o.new_token_ids) for o in engine.step())
            dt = time.perf_counter() - t0
            got[name] = {"s_per_step": round(dt / args.steps, 4), "tokens": tokens, "seconds": round(dt, 3)}
        rounds.append(got)
    KVCache.runs_for = default
    total = {n: sum(r[n]["seconds"] for r in rounds) for n in READS}
    cache = engine.cache
    gather_mb = 2 * args.rows * cache.k.shape[2] * (args.context + 8) * cache.k.shape[4] * cache.k.element_size() / 1e6
    result = {"rows": args.rows, "context": args.context, "steps": args.steps, "rounds": rounds,
              "gather_mb_per_layer": round(gather_mb, 1),
              "gather_over_runs_time": round(total["gather"] / total["runs"], 3)}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
