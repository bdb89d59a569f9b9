"""Service tiers through one tritonserver on the demo model (issue 13, "Measure").

    python benchmarks/tiers_bench.py [--requests 32] [--rate 2.0] [--burst 32] [--max-num-seqs 4] \
        [--out docs/tiers/cpu_tiers.json]

One server, rendered with config/tiers.yaml (vip → dspark, standard → eagle adaptive,
batch → eagle adaptive, code → ngram; fused EAGLE drafter, fp32, greedy), two phases:

  mixed       the bench's request mix (specserve.cli.bench.workload: 80 % short, 15 % medium, 5 % long
              prompts; outputs 32..128 tokens here, to keep the run short) spread round-robin over
              the four tiers, sent open-loop at Poisson arrivals (--rate requests/s); per tier:
              TTFT, TPOT p50 / p99 and output tokens/s over the phase's wall time.
  saturation  --burst short batch-tier requests at once, then (--vip-delay s later, while they
              fill the --max-num-seqs KV slots and the queue) N vip requests with the same prompts
              and budgets, for each N in --vip-requests (16: as many as batch; 4: vip a minority);
              each twice: with the file's priorities (vip 9, batch 1), then after
              `specserve tiers apply` gives vip batch's priority (1) on the running server: the
              same load under plain FIFO. Reported: each tier's TTFT p99 and vip / batch.

Greedy outputs of every request are compared with plain decoding of the same prompt through
`llm` with spec_method none (lossless: they must be equal).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serving_phases import DEMO, alternated_prompts  # noqa: E402

TIERS_FILE = ROOT / "config" / "tiers.yaml"


def _tier_driver(url: str, model: str):
    from specserve.cli.bench.runner import StreamDriver

    class TierDriver(StreamDriver):
        """Requests go to a tier's ensemble and say nothing of the method: the tier decides."""
        def sampling(self, req, method):
            if method == "none":     # the reference: plain decoding through llm
                return {"max_tokens": req.max_tokens, "temperature": 0.0, "spec_method": "none"}
            return {"max_tokens": req.max_tokens, "temperature": 0.0}

    return TierDriver(url, model)


def _send_all(jobs, offsets):
    """jobs: [(driver, request, label)], sent at start + offset; → (records, Window)."""
    from specserve.cli.bench.events import Window
    from specserve.cli.bench.runner import clock

    start = clock() + 0.05
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [pool.submit(d.run, r, label, start + off) for (d, r, label), off in zip(jobs, offsets)]
        records = [f.result() for f in futures]
    return records, Window("all", start, clock())


def _by_tier(records, window, tiers) -> dict:
    from specserve.cli.bench.metrics import summarize
    return {t: summarize([r for r in records if r.method == t], [window]) for t in tiers}


def _brief(s: dict) -> dict:
    r = lambda x: None if x is None else round(x, 4)
    return {"requests": s["requests"], "errors": s["errors"],
            "ttft_p50_s": r((s["ttft_s"] or {}).get("p50")), "ttft_p99_s": r((s["ttft_s"] or {}).get("p99")),
            "tpot_p50_s": r((s["tpot_s"] or {}).get("p50")), "tpot_p99_s": r((s["tpot_s"] or {}).get("p99")),
            "tokens_per_s": r(s["output_throughput"]), "acceptance_length": r(s["mean_acceptance_length"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32, help="mixed phase: requests over all tiers")
    ap.add_argument("--rate", type=float, default=2.0, help="mixed phase: Poisson arrivals per second")
    ap.add_argument("--burst", type=int, default=16, help="saturation phase: requests of each tier")
    ap.add_argument("--vip-delay", type=float, default=1.0, help="saturation phase: vip requests start this late")
    ap.add_argument("--vip-requests", default="16,4", help="saturation phase: vip requests per run, one run each")
    ap.add_argument("--burst-tokens", type=int, default=48, help="saturation phase: output tokens each")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("docs/tiers/cpu_tiers.json"))
    args = ap.parse_args()

    import yaml

    from specserve.cli.bench.runner import poisson_offsets
    from specserve.cli.bench.workload import WorkloadRequest, build_workload, describe, text_source
    from specserve.serving import schema
    from specserve.triton import tier_control
    from specserve.methods import registry
    from specserve.triton.launch import TritonServer
    from specserve.serving.settings import DeploymentSettings
    from specserve.triton.render import render_repository
    from specserve.serving.tiers import ServerLimits, load_tiers
    from specserve.model.tokenizer import load_tokenizer

    # The server takes the demo model's full length (the tiers' limits go up to 1536); the
    # workload's prompts are cut at 1024 tokens (the plan records the cap) to keep the run short.
    max_len, workload_len = 2048, 1024
    tiers = load_tiers(TIERS_FILE, ServerLimits(("none", "ngram", "eagle", "dspark"), 8, max_len,
                                                drafted=registry.borrowed()))
    names = [t.name for t in tiers]
    settings = DeploymentSettings(DEMO / "target", max_num_seqs=args.max_num_seqs, max_model_len=max_len,
                                  max_draft_len=8, default_method="eagle", drafters=(("eagle", str(DEMO / "eagle")),),
                                  draft_policy="adaptive", max_queue_len=4 * args.burst, tiers=tiers)
    tok = load_tokenizer(DEMO / "target")
    source, _ = text_source(tok, None)
    # Outputs 32..128 (the bench's default is 32..512): the run must stay a few minutes on 2 CPUs.
    workload, plans = build_workload(source, args.requests, workload_len, seed=0, output_range=(32, 128))
    work = Path(tempfile.mkdtemp(prefix="tiers-bench-"))
    srv = TritonServer(render_repository(settings, work / "model_repository"), work, None,
                       log_file=work / "tritonserver.log", exit_timeout_s=5,
                       extra_args=["--model-control-mode=explicit", "--load-model=*"])
    report = {"command": "python " + " ".join(sys.argv), "machine": platform.processor() or platform.machine(),
              "tiers": [json.loads(t.to_json()) for t in tiers], "max_num_seqs": args.max_num_seqs,
              "workload": describe(workload, plans, (32, 128), 0)}
    srv.start()
    try:
        t0 = time.monotonic()
        srv.wait_ready(600)
        print(f"server ready in {time.monotonic() - t0:.0f} s", flush=True)
        drivers = {t: _tier_driver(srv.grpc_url, schema.tier_ensemble(t).name) for t in names}
        reference = _tier_driver(srv.grpc_url, schema.ENSEMBLE.name)

        # -- mixed: the bench's mix over all tiers, open loop --------------------------------------
        jobs = [(drivers[names[r.index % len(names)]], r, names[r.index % len(names)]) for r in workload]
        records, window = _send_all(jobs, poisson_offsets(len(jobs), args.rate, seed=0))
        with ThreadPoolExecutor(args.max_num_seqs) as pool:   # plain decoding, for the lossless check
            refs = dict(zip((r.index for r in workload), pool.map(lambda r: reference.run(r, "none").text, workload)))
        mixed = {t: _brief(s) for t, s in _by_tier(records, window, names).items()}
        same = [rec.text == refs[rec.index] for rec in records if rec.ok]
        report["mixed"] = {"rate_per_s": args.rate, "wall_s": round(window.end - window.start, 2),
                           "identical_to_none": sum(same) / len(same) if same else None, "per_tier": mixed}
        print(json.dumps(report["mixed"], indent=1), flush=True)

        # -- saturation: vip vs batch, with priorities and then without ------------------------------
        prompts = alternated_prompts(args.burst // 2 + 1)
        burst = [WorkloadRequest(i, "short", prompts[i % len(prompts)]["prompt"], 0, args.burst_tokens)
                 for i in range(args.burst)]
        fifo_file = work / "tiers_fifo.yaml"      # vip with batch's priority
        doc = yaml.safe_load(TIERS_FILE.read_text())
        batch_priority = next(t["priority"] for t in doc["tiers"] if t["name"] == "batch")
        for t in doc["tiers"]:
            if t["name"] == "vip":
                t["priority"] = batch_priority
        fifo_file.write_text(yaml.safe_dump(doc))
        shapes = {}
        for n_vip in [int(n) for n in args.vip_requests.split(",")]:
            sat = {}
            for label, tiers_file in (("priority", TIERS_FILE), ("fifo", fifo_file)):
                tier_control.apply(srv.grpc_url, tiers_file, srv.admin_key)   # on the running server
                jobs = [(drivers["batch"], r, "batch") for r in burst] + \
                       [(drivers["vip"], r, "vip") for r in burst[:n_vip]]
                records, window = _send_all(jobs, [0.0] * len(burst) + [args.vip_delay] * n_vip)
                per = {t: _brief(s) for t, s in _by_tier(records, window, ["vip", "batch"]).items()}
                ratio = (per["vip"]["ttft_p99_s"] / per["batch"]["ttft_p99_s"]
                         if per["vip"]["ttft_p99_s"] and per["batch"]["ttft_p99_s"] else None)
                sat[label] = {"per_tier": per, "vip_over_batch_ttft_p99": None if ratio is None else round(ratio, 3),
                              "wall_s": round(window.end - window.start, 2)}
                print(f"{n_vip} vip / {len(burst)} batch, {label}:", json.dumps(sat[label], indent=1), flush=True)
            shapes[f"{n_vip}_vip_{len(burst)}_batch"] = sat
        report["saturation"] = {"batch_requests": args.burst, "vip_delay_s": args.vip_delay,
                                "output_tokens": args.burst_tokens, "goal": "vip TTFT p99 <= 0.5 x batch",
                                **shapes}
    finally:
        srv.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
