"""MTP multi-draft through Triton, against none and EAGLE, on clean and typo'd held-out prompts.

Part 1 (through Triton; one tritonserver per mtp placement, --mtp-placements remote,fused, both
started at once, EAGLE fused in each, as served by default). Greedy, one request at a time, every
configuration on every prompt in an order rotated per prompt, the prompt sets alternated:

    none        plain decoding
    eagle       EAGLE + calibration head (threshold 0.3), fused
    draft       the draft model alone (the `draft` method)
    mtp         every served sub-proposer (MTP heads, EAGLE, draft model, n-gram), tree budget 16,
                in the first placement (remote: the mtp_proposal ensemble, drafters in parallel)
    mtp_fast    mtp without the draft model (mtp_proposers: mtp_heads, eagle, ngram)
    mtp_fused, mtp_fast_fused   the same on the second server (mtp's drafters in the engine)

The typo'd set is docs/mtp/typo_prompts.jsonl (benchmarks/make_typo_prompts.py, seeded: ≥ 3
typos per prompt). Per configuration and set: mean acceptance length, tokens/s, speedup over
none, and each proposer's share of accepted tokens (a token several proposers drafted counts for
each, so shares can add up to more than 1). Greedy outputs must equal none's.

Part 2 (in-process engine, same weights; no Triton: these isolate the method): on clean prompts,
acceptance length and tokens/s against the tree budget (4, 8, 16, 32 nodes), and what each extra
proposer costs per step (proposer sets grown one at a time; each sub-proposer's own call time);
and robustness: eagle, draft, mtp and mtp_fast on the clean, typo'd and heavily typo'd prompts
(docs/mtp/typo_prompts_heavy.jsonl: a typo in every second word).

    python benchmarks/mtp_bench.py [--prompts 16] [--new-tokens 64] [--out docs/mtp/bench.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from eagle_triton_bench import Tally, goal_line  # noqa: E402

DEMO = ROOT / "models" / "demo"
DRAFTERS = (("eagle", DEMO / "eagle"), ("draft", DEMO / "draft"), ("mtp", DEMO / "mtp"))
FAST = ["mtp_heads", "eagle", "ngram"]
CONFIGS: dict[str, dict] = {
    "none": {"spec_method": "none"},
    "eagle": {"spec_method": "eagle"},
    "draft": {"spec_method": "draft"},
    "mtp": {"spec_method": "mtp"},
    "mtp_fast": {"spec_method": "mtp", "mtp_proposers": FAST},
}
# Prompt sets through Triton: clean, 3+ scattered typos each, and "renamed": 3 recurring words
# misspelt the same way at every occurrence (a misspelt name used throughout, which the target's
# continuation repeats: the case a drafter that reads tokens or copies context can catch).
SETS = ("clean", "typo", "renamed")
BUDGETS = (4, 8, 16, 32)
GROWN = (["ngram"], ["ngram", "mtp_heads"], ["ngram", "mtp_heads", "eagle"], ["ngram", "mtp_heads", "eagle", "draft"])


def _typo_set(name: str) -> dict[int, dict]:
    return {r["id"]: r for r in map(json.loads, (ROOT / "docs/mtp" / name).read_text().splitlines())}


def prompt_sets(n: int) -> dict[str, list[str]]:
    held = [json.loads(line) for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()]
    typo, heavy = _typo_set("typo_prompts.jsonl"), _typo_set("typo_prompts_heavy.jsonl")
    renamed = _typo_set("typo_prompts_renamed.jsonl")
    # code and prose interleaved, so a small n still has both
    code, prose = [h for h in held if h["kind"] == "code"], [h for h in held if h["kind"] == "prose"]
    order = [x for pair in zip(code, prose) for x in pair] + code[len(prose):]
    chosen = order[:n]
    for h in chosen:
        assert typo[h["id"]]["clean"] == heavy[h["id"]]["clean"] == renamed[h["id"]]["clean"] == h["prompt"], \
            "docs/mtp/typo_prompts*.jsonl are stale; rerun make_typo_prompts.py"
    return {"clean": [h["prompt"] for h in chosen], "typo": [typo[h["id"]]["prompt"] for h in chosen],
            "heavy": [heavy[h["id"]]["prompt"] for h in chosen], "renamed": [renamed[h["id"]]["prompt"] for h in chosen]}


def triton_part(args, sets: dict[str, list[str]]) -> dict:
    from tqdm import tqdm

    from specserve.triton.client import StreamClient
    from specserve.triton.launch import TritonServer
    from specserve.serving.settings import DeploymentSettings
    from specserve.triton.render import render_repository

    # One server per mtp placement, started together, EAGLE fused in each (its default); none,
    # eagle and draft run on the first, mtp and mtp_fast on each (suffixed _fused on a fused one).
    placements = args.mtp_placements.split(",")
    work = Path(tempfile.mkdtemp(prefix="mtp-bench-"))
    servers = {}
    for p in placements:
        repo = render_repository(DeploymentSettings(DEMO / "target", max_num_seqs=2, max_model_len=1024,
                                                    max_draft_len=args.max_draft_len, default_method="none",
                                                    drafters=tuple((m, str(f)) for m, f in DRAFTERS),
                                                    mtp_placement=p, spec_threshold=0.3, draft_policy="fixed"),
                                                    work / p / "model_repository")
        servers[p] = TritonServer(repo, work / p, None, log_file=work / p / "tritonserver.log").start()
    where = {c: placements[0] for c in CONFIGS}
    params = dict(CONFIGS)
    for p in placements[1:]:
        for c in ("mtp", "mtp_fast"):
            where[f"{c}_{p}"], params[f"{c}_{p}"] = p, CONFIGS[c]
    configs = list(params)
    tallies = {s: {c: Tally() for c in configs} for s in SETS}
    credits = {s: {c: {} for c in configs} for s in SETS}
    try:
        for srv in servers.values():
            srv.wait_ready(600)
        clients = {p: StreamClient(srv.grpc_url) for p, srv in servers.items()}
        for c in configs * 2:   # warm-up, not timed
            clients[where[c]].generate(sets["clean"][0], {"max_tokens": 16, "temperature": 0, **params[c]})
        runs = [(i, s, c) for i in range(len(sets["clean"])) for s in SETS
                for c in configs[i % len(configs):] + configs[:i % len(configs)]]
        for i, s, c in tqdm(runs, desc="requests", unit="req"):
            out = clients[where[c]].generate(sets[s][i], {"max_tokens": args.new_tokens, "temperature": 0,
                                                          "ignore_eos": True, **params[c]})
            st = out.spec_stats
            if out.finish_reason != "length" or st.get("proposer_errors") or st.get("proposer_skipped"):
                raise SystemExit(f"{c} {s} prompt {i}: finish {out.finish_reason}, stats {st}")
            tallies[s][c].add(out)
            for k, n in st.get("accepted_by_proposer", {}).items():
                credits[s][c][k] = credits[s][c].get(k, 0) + n
    finally:
        for srv in servers.values():
            srv.stop()
    for s in SETS:
        for c in configs:
            if tallies[s][c].texts != tallies[s]["none"].texts:
                raise SystemExit(f"LOSSLESSNESS VIOLATED: {c} greedy output differs from none on the {s} prompts")
    out = {}
    for s in SETS:
        rows = {c: tallies[s][c].row(tallies[s]["none"]) for c in configs}
        for c in configs:
            acc = max(1, tallies[s][c].accepted)
            if credits[s][c]:
                rows[c]["share_of_accepted"] = {k: round(n / acc, 3) for k, n in sorted(credits[s][c].items())}
            rows[c]["identical_to_none"] = f"{len(tallies[s][c].texts)}/{len(tallies[s]['none'].texts)}"
        out[s] = rows
    return out


ROBUST = {"eagle": ("eagle", None), "draft": ("draft", None), "mtp": ("mtp", None),
          "mtp_fast": ("mtp", {"mtp_proposers": FAST})}


def in_process_part(args, sets: dict[str, list[str]]) -> dict:
    """Tree-budget sweep and per-proposer cost, on an engine built like the server's."""
    import torch

    from specserve.core.engine import GenerationRequest
    from specserve.core.sampling import SamplingParams
    from specserve.serving.build import build_engine
    from specserve.serving.settings import DeploymentSettings

    torch.set_num_threads(1)
    engine, tok = build_engine(DeploymentSettings(DEMO / "target", max_num_seqs=2, max_model_len=1024,
                                                  max_draft_len=max(BUDGETS),
                                                  drafters=tuple((m, str(f)) for m, f in DRAFTERS), spec_threshold=0.3,
                                                  draft_policy="fixed", default_method="none"))
    mtp = engine.proposers["mtp"]
    timers = {name: [0.0, 0] for name in mtp.subs}
    for name, sub in mtp.subs.items():   # time each sub-proposer's own call
        def timed(requests, _inner=sub.propose, _t=timers[name]):
            t0 = time.perf_counter()
            try:
                return _inner(requests)
            finally:
                _t[0] += time.perf_counter() - t0
                _t[1] += 1
        sub.propose = timed
    ids = {s: [tok.encode(p).ids for p in ps] for s, ps in sets.items()}
    # (label, method, options, prompt set); every configuration on every prompt, order rotated per prompt
    sweeps = args.in_process == "all"
    configs = [("none", "none", None, "clean"), ("eagle", "eagle", None, "clean"),
               *((f"budget {b}", "mtp", {"mtp_tree_budget": b}, "clean") for b in BUDGETS if sweeps),
               *(("+".join(g), "mtp", {"mtp_proposers": g, "mtp_tree_budget": 16}, "clean") for g in GROWN if sweeps),
               *((f"{s} {c}", m, o, s) for s in sets for c, (m, o) in ROBUST.items())]
    sums = {label: {"steps": 0, "acc": 0, "drafted": 0, "out": 0, "draft_s": 0.0, "verify_s": 0.0, "wall": 0.0}
            for label, *_ in configs}
    calls = {label: {name: [0.0, 0] for name in mtp.subs} for label, *_ in configs}
    n = len(ids["clean"])
    warm = {m: (m, m, None, "clean") for _, m, *_ in configs}   # pass 0: each method once, not counted
    for i in range(n + 1):
        todo = list(warm.values()) if i == 0 else configs[i % len(configs):] + configs[:i % len(configs)]
        for label, method, options, pset in todo:
            p = ids[pset][max(i - 1, 0)]
            for t in timers.values():
                t[:] = [0.0, 0]
            t0 = time.perf_counter()
            o = engine.generate([GenerationRequest("r", p, SamplingParams(max_tokens=args.new_tokens, ignore_eos=True),
                                                   method, options=options)])["r"]
            if i == 0:
                continue
            s, st = sums[label], o.stats
            s["wall"] += time.perf_counter() - t0
            s["steps"] += st.steps
            s["acc"] += st.accepted_tokens
            s["drafted"] += st.draft_tokens
            s["out"] += len(o.new_token_ids)
            s["draft_s"] += st.draft_seconds
            s["verify_s"] += st.verify_seconds
            if method == "mtp":
                for name, t in timers.items():
                    calls[label][name][0] += t[0]
                    calls[label][name][1] += t[1]
    rows = {}
    for label, method, *_ in configs:
        s = sums[label]
        rows[label] = {"mean_acceptance_length": round((s["acc"] + s["steps"]) / s["steps"], 3),
                       "tok_s": round(s["out"] / s["wall"], 2),
                       "draft_tokens_per_step": round(s["drafted"] / s["steps"], 2),
                       "draft_ms_per_step": round(1e3 * s["draft_s"] / s["steps"], 2),
                       "verify_ms_per_step": round(1e3 * s["verify_s"] / s["steps"], 2)}
        if method == "mtp":
            rows[label]["sub_proposer_ms_per_call"] = {k: round(1e3 * t[0] / t[1], 2) for k, t in calls[label].items() if t[1]}
    for r in rows.values():
        r["speedup_vs_none"] = round(r["tok_s"] / rows["none"]["tok_s"], 3)
    return {"none": rows["none"], "eagle": rows["eagle"],
            "tree_budget": {b: rows[f"budget {b}"] for b in BUDGETS} if sweeps else {},
            "proposer_sets": {"+".join(g): rows["+".join(g)] for g in GROWN} if sweeps else {},
            "robustness": {s: {c: rows[f"{s} {c}"] for c in ROBUST} for s in sets}}


def print_sweeps(ip: dict) -> None:
    print("\nin-process, clean prompts: tree budget")
    print("| budget | mean acceptance length | tok/s | speedup vs none | draft ms/step | verify ms/step |")
    print("|---|---|---|---|---|---|")
    for b, r in ip["tree_budget"].items():
        print(f"| {b} | {r['mean_acceptance_length']} | {r['tok_s']} | {r['speedup_vs_none']}× | "
              f"{r['draft_ms_per_step']} | {r['verify_ms_per_step']} |")
    print("\nin-process, clean prompts: proposers added one at a time (budget 16)")
    print("| proposers | mean acceptance length | tok/s | speedup vs none | draft ms/step | verify ms/step | ms per call of each |")
    print("|---|---|---|---|---|---|---|")
    for g, r in ip["proposer_sets"].items():
        calls = ", ".join(f"{k} {v}" for k, v in r.get("sub_proposer_ms_per_call", {}).items())
        print(f"| {g} | {r['mean_acceptance_length']} | {r['tok_s']} | {r['speedup_vs_none']}× | "
              f"{r['draft_ms_per_step']} | {r['verify_ms_per_step']} | {calls} |")
    print(f"(eagle alone: acceptance {ip['eagle']['mean_acceptance_length']}, {ip['eagle']['speedup_vs_none']}× over none)")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-draft-len", type=int, default=16, help="the server's (= mtp's default tree budget)")
    ap.add_argument("--sweep-prompts", type=int, default=8, help="prompts for the in-process part")
    ap.add_argument("--skip-triton", action="store_true")
    ap.add_argument("--mtp-placements", default="remote,fused",
                    help="mtp placements compared through Triton, one server each (EAGLE fused in all); "
                         "the first also serves none, eagle and draft")
    ap.add_argument("--in-process", choices=("all", "robustness", "none"), default="all",
                    help="which in-process parts run: all (budget and proposer sweeps + robustness), "
                         "robustness only, or none")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    sets = prompt_sets(args.prompts)
    from specserve.core.paths import shown

    result = {"target": shown(DEMO / "target"), "drafters": {m: shown(f) for m, f in DRAFTERS},
              "prompts": args.prompts, "new_tokens": args.new_tokens, "max_draft_len": args.max_draft_len,
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
              "command": " ".join(["python", "benchmarks/mtp_bench.py", *(argv if argv is not None else sys.argv[1:])])}
    if not args.skip_triton:
        result["triton"] = triton_part(args, sets)
    if args.in_process != "none":
        result["in_process"] = in_process_part(args, {s: ps[:args.sweep_prompts] for s, ps in sets.items()})

    if "triton" in result:
        for s in SETS:
            print(f"\n{s} prompts (through Triton)")
            print("| config | tok/s | speedup vs none | mean acceptance length | draft tok/step | step ms | draft ms | "
                  "verify ms | share of accepted tokens |")
            print("|---|---|---|---|---|---|---|---|---|")
            for c, r in result["triton"][s].items():
                share = ", ".join(f"{k} {v:.0%}" for k, v in r.get("share_of_accepted", {}).items())
                print(f"| {c} | {r['tok_s']} | {r['speedup_vs_none']}× | {r['mean_acceptance_length']} | "
                      f"{r['draft_tokens_per_step']} | {r['step_ms']} | {r['draft_ms']} | {r['verify_ms']} | {share} |")
        t = result["triton"]
        al = {s: {c: t[s][c]["mean_acceptance_length"] for c in CONFIGS} for s in SETS}
        goals = {"mtp_vs_eagle_acceptance_clean": round(al["clean"]["mtp"] / al["clean"]["eagle"], 3),
                 **{f"{c}_acceptance_drop_{s}": round(1 - al[s][c] / al["clean"][c], 3)
                    for s in SETS[1:] for c in ("eagle", "mtp", "mtp_fast")},
                 **{f"{c}_vs_eagle_speedup_clean": round(t["clean"][c]["speedup_vs_none"]
                                                         / t["clean"]["eagle"]["speedup_vs_none"], 3)
                    for c in t["clean"] if c.startswith("mtp")}}
        result["goals"] = goals
        print()
        print(goal_line("mtp / eagle mean acceptance length, clean", goals["mtp_vs_eagle_acceptance_clean"], 1.15, "×"))
        for s in SETS[1:]:
            print(f"acceptance length drop on the {s} prompts: mtp {goals[f'mtp_acceptance_drop_{s}']:.1%}, "
                  f"mtp_fast {goals[f'mtp_fast_acceptance_drop_{s}']:.1%}, "
                  f"eagle {goals[f'eagle_acceptance_drop_{s}']:.1%} (goal: mtp's smaller)")
        for c in (c for c in t["clean"] if c.startswith("mtp")):
            print(goal_line(f"{c} speedup / eagle speedup, clean", goals[f"{c}_vs_eagle_speedup_clean"], 1.0, "×"))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    ip = result.get("in_process")
    if ip is None:
        return result
    if args.in_process == "all":
        print_sweeps(ip)
    rob = ip["robustness"]
    print("\nin-process robustness: mean acceptance length (change vs clean)")
    print("| config | " + " | ".join(rob) + " |")
    print("|---|" + "---|" * len(rob))
    for c in ROBUST:
        clean = rob["clean"][c]["mean_acceptance_length"]
        cells = [f"{rob[s][c]['mean_acceptance_length']} ({rob[s][c]['mean_acceptance_length'] / clean - 1:+.1%})"
                 for s in rob]
        print(f"| {c} | " + " | ".join(cells) + " |")
    return result


if __name__ == "__main__":
    main()
