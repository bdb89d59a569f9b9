"""Does speculation come back after a contended phase (issue 25)? c = 1 eagle speed on the demo
model before, during and after a CPU-heavy neighbour, with the adaptive draft policy and with the
fixed one, in one run.

    python benchmarks/adaptive_recovery.py [--prompts 6] [--new-tokens 96] [--hogs 0] \
        [--out docs/reliability/adaptive_recovery.json]

For each policy, one tritonserver (demo target, fused EAGLE drafter, fp32, `draft_policy` the
server's default, so no other request feeds that policy's estimates) goes through three phases:
`before` (quiet), `during` (--hogs busy-looping processes beside the server; default: one per
CPU core) and `after` (the hogs killed). In each phase every prompt runs with `none` and with
`eagle`, one request at a time, in an order alternated per prompt, so each phase's eagle / none
ratio is measured under the same conditions. Greedy: eagle's text must equal none's (checked;
the script exits 1 otherwise). The servers run one after the other, never beside each other.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
PHASES = ("before", "during", "after")
HOG = "while True: pass"


def prompts(n: int) -> list[str]:
    held = [json.loads(line) for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()]
    return [h["prompt"] for h in held if h["kind"] == "code"][:n]


def run_phase(client, texts: list[str], new_tokens: int) -> dict:
    """Every prompt with none and eagle at c = 1 → per method: tokens/s and the policy's counts."""
    runs = {"none": [], "eagle": []}
    for i, p in enumerate(texts):
        for method in (("none", "eagle") if i % 2 == 0 else ("eagle", "none")):
            t0 = time.perf_counter()
            out = client.generate(p, {"max_tokens": new_tokens, "temperature": 0.0, "spec_method": method})
            runs[method].append((out, time.perf_counter() - t0))
    summary = {}
    for method, rs in runs.items():
        tokens, seconds = sum(o.num_output_tokens for o, _ in rs), sum(s for _, s in rs)
        stats = [o.spec_stats for o, _ in rs]
        steps = sum(s["steps"] for s in stats)
        summary[method] = {"tokens_per_s": round(tokens / seconds, 1),
                           "acceptance_length": round((sum(s["accepted_tokens"] for s in stats) + steps) / steps, 2),
                           "draft_tokens_per_step": round(sum(s["draft_tokens"] for s in stats) / steps, 2),
                           "policy_off_steps": sum(s["policy"]["off_steps"] for s in stats),
                           "policy_probe_steps": sum(s["policy"]["probe_steps"] for s in stats),
                           "steps": steps}
    summary["eagle"]["x_none"] = round(summary["eagle"]["tokens_per_s"] / summary["none"]["tokens_per_s"], 3)
    summary["identical_to_none"] = all(a.text == b.text for (a, _), (b, _) in zip(runs["eagle"], runs["none"]))
    summary["policy_last"] = runs["eagle"][-1][0].spec_stats["policy"]["last"]
    return summary


def one_server(policy: str, texts: list[str], new_tokens: int, hogs: int, log=print) -> dict:
    from serving_phases import started_server
    from specserve.triton.client import StreamClient
    from specserve.serving.settings import DeploymentSettings

    settings = DeploymentSettings(DEMO / "target", max_num_seqs=4, max_model_len=1024, max_draft_len=8,
                                  default_method="eagle", drafters=(("eagle", str(DEMO / "eagle")),),
                                  draft_policy=policy)
    out = {}
    with started_server(settings, f"adaptive-recovery-{policy}-") as srv:
        client = StreamClient(srv.grpc_url)
        client.generate(texts[0], {"max_tokens": 16, "spec_method": "eagle"})   # warm-up, not counted
        for phase in PHASES:
            pids = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hogs)] if phase == "during" else []
            try:
                out[phase] = run_phase(client, texts, new_tokens)
            finally:
                for p in pids:
                    p.kill()
                    p.wait()
            log(f"{policy} {phase}: {json.dumps(out[phase])}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6, help="held-out code prompts per phase")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--hogs", type=int, default=0, help="busy processes during the contended phase (0: one per core)")
    ap.add_argument("--out", type=Path, default=Path("docs/reliability/adaptive_recovery.json"))
    args = ap.parse_args()
    hogs = args.hogs or os.cpu_count() or 1
    texts = prompts(args.prompts)
    results = {policy: one_server(policy, texts, args.new_tokens, hogs) for policy in ("adaptive", "fixed")}
    rows = [{"policy": policy, "phase": phase, **{k: v for k, v in r[phase]["eagle"].items()},
             "none_tokens_per_s": r[phase]["none"]["tokens_per_s"], "identical_to_none": r[phase]["identical_to_none"]}
            for policy, r in results.items() for phase in PHASES]
    report = {"command": "python " + " ".join(sys.argv), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "hogs": hogs, "rows": rows, "phases": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print("| policy | phase | eagle tok/s | none tok/s | × none | acc. len | draft tok/step | policy off steps "
          "| probes | same text as none |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['phase']} | {r['tokens_per_s']} | {r['none_tokens_per_s']} | {r['x_none']} | "
              f"{r['acceptance_length']} | {r['draft_tokens_per_step']} | {r['policy_off_steps']} | "
              f"{r['policy_probe_steps']} | {r['identical_to_none']} |")
    return 0 if all(r["identical_to_none"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
