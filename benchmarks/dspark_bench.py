"""DSPark vs dynamic EAGLE vs plain decoding, through Triton, on the demo model (issue 10's CPU
measurement), plus two in-process measurements that explain the figures.

    python benchmarks/dspark_bench.py [--prompts 8] [--new-tokens 64] [--concurrency 1,16] [--out F.json]

1. Serving (tritonserver started here, fused EAGLE drafter, float32, greedy): held-out code and
   prose prompts alternated (code, prose, code, …), every method on every block of requests in
   an order rotated per block (specserve.cli.bench.runner.run_phase), at each concurrency: output
   tokens/s, inter-token latency (gap between streamed responses) p50 / p99 / standard deviation,
   acceptance length; dspark/eagle ratios; greedy outputs of every method compared with none's.
2. Spans (in process): the dspark step with each attention-span set (static_step.SPAN_SETS) on
   the same requests: which one is fastest on this machine.
3. Step breakdown (in process, one bucket): where a dspark step's time goes — the drafter
   (ingest + K draft forwards), the target's verify forward, acceptance — against the dynamic
   path's proposer call and verify forward for the same K.
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

sys.path.insert(0, str(ROOT / "benchmarks"))
from serving_phases import DEMO, alternated_prompts, run_phases  # noqa: E402

METHODS = ["dspark", "eagle", "none"]


def serving(args, log=print) -> dict:
    from specserve.serving.settings import DeploymentSettings

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    settings = DeploymentSettings(DEMO / "target", max_num_seqs=max(concurrencies), max_model_len=1024,
                                  max_draft_len=8, default_method="none",
                                  drafters=(("eagle", str(DEMO / "eagle")),), device="cpu", draft_policy="fixed")
    phases = run_phases(settings, METHODS,
                        lambda req, m: {"max_tokens": req.max_tokens, "temperature": 0.0, "spec_method": m},
                        prompts=alternated_prompts(args.prompts), concurrencies=concurrencies,
                        new_tokens=args.new_tokens, log=log)
    return {f"C={c}": v for c, v in phases.items()}


def _engine(span_set: str, max_num_seqs: int):
    import torch

    from specserve.core.engine import Engine, EngineConfig
    from specserve.model.transformer import load_model
    from specserve.methods.dspark.proposer import DSParkProposer
    from specserve.methods.eagle.drafter import load_eagle
    from specserve.methods.eagle.proposer import EagleProposer
    from specserve.model.devices import resolve_drafter_dtype

    target = load_model(DEMO / "target")
    drafter = load_eagle(DEMO / "eagle", target, dtype=resolve_drafter_dtype("auto", target))
    kw = dict(max_num_seqs=max_num_seqs, max_model_len=1024, max_draft_len=8, threshold=0.3)
    proposers = {"dspark": DSParkProposer(drafter, target, span_set=span_set, **kw),
                 "eagle": EagleProposer(drafter, target, **kw)}
    torch.manual_seed(0)
    return Engine(target, EngineConfig(max_num_seqs=max_num_seqs, max_model_len=1024, max_draft_len=8), proposers)


def _requests(method: str, n: int, new_tokens: int):
    from specserve.core.engine import GenerationRequest
    from specserve.core.sampling import SamplingParams
    from specserve.model.tokenizer import load_tokenizer

    tok = load_tokenizer(DEMO / "target")
    prompts = alternated_prompts(max(1, n // 2) + 1)[:n]
    return [GenerationRequest(f"{method}{i}", tok.encode(p["prompt"]).ids, SamplingParams(max_tokens=new_tokens),
                              method) for i, p in enumerate(prompts)]


def spans(args, log=print) -> dict:
    from specserve.core.static_step import SPAN_SETS

    out = {}
    for batch in (1, 8):
        engines = {s: _engine(s, max(batch, 1)) for s in SPAN_SETS}
        times = {s: [] for s in SPAN_SETS}
        for rep in range(3):  # alternated, best of 3 per set
            for s in (SPAN_SETS if rep % 2 == 0 else SPAN_SETS[::-1]):
                t0 = time.perf_counter()
                engines[s].generate(_requests("dspark", batch, args.new_tokens))
                times[s].append(time.perf_counter() - t0)
        out[f"B={batch}"] = {s: round(min(v), 3) for s, v in times.items()}
        log(f"spans, {batch} request(s) x {args.new_tokens} tokens, best of 3 (s): {out[f'B={batch}']}")
    return out


def breakdown(args, log=print) -> dict:
    import torch

    with torch.inference_mode():
        return _breakdown(args, log)


def _breakdown(args, log) -> dict:
    """Time the pieces of one step for a bucket of B rows mid-generation, K = 4 and 8."""
    import torch

    from specserve.methods.dspark.proposer import StepKey
    from specserve.core.static_step import (DeviceKV, SamplingTensors, StepInputs, span_for, target_step)

    out = {}
    for B in (1, 16):
        engine = _engine("pow2", B)
        # Bring B sequences to mid-generation with dspark (so its buffers hold real pairs).
        reqs = _requests("dspark", B, 600)
        for r in reqs:
            engine.submit(r)
        for _ in range(6):
            engine.step()
        ds = engine.proposers["dspark"]
        seqs = list(engine._running)
        rows_len = max(engine.cache.lengths[s.slot] for s in seqs)
        for K in (4, 8):
            S = span_for(rows_len + K + 1, engine.cache.max_len)
            key = StepKey(B, K, S, False)
            graph = ds._graphs.get(key)
            x = graph.inputs
            # Re-point the example (padded) inputs at the running rows, with K-token drafts.
            states = [ds.eagle._seqs[s.seq_id] for s in seqs]
            dev = torch.device("cpu")
            x["lengths"][:] = torch.tensor([engine.cache.lengths[s.slot] for s in seqs])
            x["slots"][:] = torch.tensor([s.slot for s in seqs])
            x["dslots"][:] = torch.tensor([st.slot for st in states])
            x["dvalid"][:] = torch.tensor([st.valid for st in states])
            x["n_new"][:] = torch.tensor([ds._pending[s.seq_id] for s in seqs])
            x["fresh"][:] = False
            x["room"][:] = K
            kv = DeviceKV(engine.cache)
            tokens = torch.randint(0, 8192, (B, K + 1))
            sampling = SamplingTensors.from_params([None] * B, dev)
            inp = StepInputs(tokens, x["lengths"].clone(), x["slots"].clone(), torch.full((B,), K), sampling,
                             torch.ones(B, K + 1))

            def timed(fn, reps=5):
                fn()
                ts = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                return 1000 * statistics.median(ts)

            with torch.inference_mode():
                whole = timed(lambda: ds._compute(x, key))
                verify = timed(lambda: target_step(engine.model, kv, inp, S, sampled=False))

            row = {"S": S, "dspark_step_ms": round(whole, 2), "verify_forward_and_acceptance_ms": round(verify, 2),
                   "drafter_ingest_and_drafts_ms": round(whole - verify, 2)}
            out[f"B={B},K={K}"] = row
            log(f"breakdown B={B} K={K}: {row}")
        # Whole generations, same requests: per-step time of each method from the engine's timers.
        fresh = _engine("pow2", B)
        for method in ("eagle", "dspark", "eagle", "dspark"):  # the second round is the one kept (warm)
            done = fresh.generate(_requests(method, B, args.new_tokens))
            st = [o.stats for o in done.values()]
            steps = max(x.steps for x in st)  # batched: every row is charged the whole step
            row = {"steps": steps, "acceptance_length": round(sum(x.mean_acceptance_length for x in st) / len(st), 2),
                   "draft_ms_per_step": round(1000 * max(x.draft_seconds for x in st) / steps, 2),
                   "verify_ms_per_step": round(1000 * max(x.verify_seconds for x in st) / steps, 2)}
            out[f"B={B},{method}"] = row
            log(f"per step B={B} {method}: {row}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts per kind (code, prose)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--parts", default="serving,spans,breakdown")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    report = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
              "command": "python benchmarks/dspark_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    parts = args.parts.split(",")
    if "serving" in parts:
        report["serving"] = serving(args)
        for name, s in report["serving"].items():
            print(f"\n{name}: method  tok/s   ITL p50 / p99 / std (ms)   acceptance   identical")
            for m in METHODS:
                r, itl = s[m], s[m]["itl_s"] or {}
                print(f"  {m:>7} {r['output_throughput'] or 0:7.1f}   {1000 * itl.get('p50', 0):6.1f} / "
                      f"{1000 * itl.get('p99', 0):6.1f} / {1000 * itl.get('std', 0):6.1f}   "
                      f"{r['mean_acceptance_length'] or 0:5.2f}   {r['identical_to_none']}")
            d, e = s["dspark"], s["eagle"]
            ratio = (d["output_throughput"] or 0) / (e["output_throughput"] or 1)
            std_ratio = (d["itl_s"] or {}).get("std", 0) / max((e["itl_s"] or {}).get("std", 1e-9), 1e-9)
            s["dspark_over_eagle"] = {"throughput": round(ratio, 3), "itl_std": round(std_ratio, 3)}
            print(f"  dspark / eagle: throughput {ratio:.2f}x, ITL std {std_ratio:.2f}x")
    if "spans" in parts:
        report["spans"] = spans(args)
    if "breakdown" in parts:
        report["breakdown"] = breakdown(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
