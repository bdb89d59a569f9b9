"""SmolLM2-135M-Instruct at concurrency 1, greedy, on held-out chat prompts: specserve through the
OpenAI API and through direct gRPC streaming, `none` and `ngram`, target fp32 and bf16, beside its
peers on the same checkpoint, the same cores and the same prompt token ids, in one run.

    python benchmarks/chat_peers.py --prompts 10 --new-tokens 128 --cores 2   # make chat-peers

Systems (each prompt goes to every system before the next prompt, in an order rotated per
prompt, so slow drift of the machine spreads over all of them):

    specserve_<api>_<method>_<dtype>   api: openai (streaming /v1/chat/completions with the official
                                       `openai` client, stream_options.include_usage) or grpc (the
                                       `llm` ensemble over tritonclient gRPC streaming); one
                                       `specserve serve --openai-port` per target dtype
    hf_generate_<dtype>                transformers `generate` on the same checkpoint folder
    llama_cpp / llama_cpp_lookup       llama-cpp-python on the GGUF file the checkpoint was imported
                                       from (its Q4_1 weights: its own arithmetic), plain and with
                                       LlamaPromptLookupDecoding (its n-gram drafter)

The prompt: the held-out conversation rendered by the checkpoint's chat template with
specserve.openai.chat.ChatTemplate (what the OpenAI layer does), sent as that text over gRPC and
as its token ids (tokenized as preprocess does) to the peers; the run checks that every system
saw the same number of prompt tokens and that the OpenAI API's text equals gRPC's, and fails (exit
1, report still written) otherwise. A peer whose package is missing is skipped, and says so.

Writes OUT.json (the command, prompts, machine, settings, every system's figures and outputs) and
OUT.md (the tables). docs/smollm2/peers.md says what is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

from specserve.cli.bench.events import Chunk, RequestRecord
from specserve.cli.bench.local_peers import LLAMA_LOOKUP as LOOKUP
from specserve.cli.bench.local_peers import LLAMA_MISSING, hf_runner, llama_runners, missing
from specserve.cli.bench.machine import machine_info
from specserve.cli.bench.metrics import distribution, e2e, tpot, ttft
from specserve.cli.bench.prompts import Prompt, balanced_subset, chat_prompts, read_chat_rows

ROOT = Path(__file__).resolve().parents[1]

HELDOUT = ROOT / "models" / "smollm2" / "heldout_chat.jsonl"
TARGET = ROOT / "models" / "smollm2" / "target"
GOAL_MS_PER_CHUNK, GOAL_PCT = 2.0, 5.0   # issue 21: the OpenAI layer's overhead against gRPC
clock = time.perf_counter


# -- pure logic (tests/test_chat_peers.py) -------------------------------------------------------
def throughput(records: list[RequestRecord]) -> float | None:
    """Output tokens / s over the requests' own wall time (exact at concurrency 1)."""
    secs = sum(e2e(r) for r in records)
    return sum(r.num_output_tokens for r in records) / secs if secs > 0 else None


def overhead(openai: list[RequestRecord], grpc: list[RequestRecord]) -> dict:
    """The OpenAI layer against direct gRPC on the same requests (paired by prompt): the extra
    wall time per streamed chunk, and how much of gRPC's tokens/s it costs (positive: slower)."""
    extra_s = sum(e2e(o) - e2e(g) for o, g in zip(openai, grpc, strict=True))
    chunks = sum(len(o.chunks) for o in openai)
    tps_o, tps_g = throughput(openai), throughput(grpc)
    ms = 1000 * extra_s / chunks if chunks else None
    pct = 100 * (1 - tps_o / tps_g) if tps_o and tps_g else None
    return {"ms_per_chunk": ms, "tokens_per_s_pct": pct, "chunks": chunks,
            "goal": {"ms_per_chunk": GOAL_MS_PER_CHUNK, "tokens_per_s_pct": GOAL_PCT},
            "meets_goal": ms is not None and pct is not None and ms <= GOAL_MS_PER_CHUNK and pct <= GOAL_PCT}


def summarize(records: list[RequestRecord]) -> dict:
    def ms(d):
        return None if d is None else {k: v * 1000 for k, v in d.to_dict().items() if k in ("mean", "p50", "p90")}

    stats = [r.spec_stats for r in records if r.spec_stats.get("steps")]
    steps = sum(s["steps"] for s in stats)
    return {"requests": len(records), "output_tokens": sum(r.num_output_tokens for r in records),
            "e2e_s": sum(e2e(r) for r in records), "tokens_per_s": throughput(records),
            "ttft_ms": ms(distribution(ttft(r) for r in records)),
            "tpot_ms": ms(distribution(tpot(r) for r in records)),
            "mean_acceptance_length": (sum(s["accepted_tokens"] for s in stats) + steps) / steps if steps else None}


# -- the prompts ---------------------------------------------------------------------------------
def load_prompts(n: int, kinds: list[str] | None) -> list[Prompt]:
    return chat_prompts(TARGET, balanced_subset(read_chat_rows(HELDOUT), n, kinds))


# -- the systems: each runs one prompt and returns its RequestRecord -------------------------------
Runner = Callable[[Prompt, int], RequestRecord]


def openai_runner(port: int, method: str) -> Runner:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)

    def run(p: Prompt, max_tokens: int) -> RequestRecord:
        rec = RequestRecord(p.index, method, p.kind, send_t=clock())
        stream = client.chat.completions.create(
            model=TARGET.name, messages=p.messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"spec_method": method})
        text = []
        for chunk in stream:
            t = clock()
            if chunk.choices:
                choice = chunk.choices[0]
                if choice.delta.content:
                    # An OpenAI client is not told how many tokens a chunk carries; the metrics
                    # only need to know that it carried some.
                    rec.chunks.append(Chunk(t, 1))
                    text.append(choice.delta.content)
                if choice.finish_reason:
                    rec.finish_reason = choice.finish_reason
                    rec.spec_stats = (chunk.model_extra or {}).get("spec_stats") or {}
            if chunk.usage is not None:
                rec.num_input_tokens, rec.num_output_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
        rec.end_t, rec.text = clock(), "".join(text)
        return rec
    return run


def grpc_runner(url: str, method: str) -> Runner:
    from specserve.cli.bench.runner import StreamDriver
    from specserve.cli.bench.workload import WorkloadRequest

    driver = StreamDriver(url)

    def run(p: Prompt, max_tokens: int) -> RequestRecord:
        rec = driver.run(WorkloadRequest(p.index, p.kind, p.text, len(p.ids), max_tokens), method)
        if not rec.ok:
            raise RuntimeError(f"specserve gRPC {method}: {rec.error}")
        return rec
    return run


# -- setup ---------------------------------------------------------------------------------------
def serve_flags(drafters: list[str]) -> tuple[str, ...]:
    """c = 1: two KV slots are plenty; 2048 holds every held-out prompt and its answer. Drafters
    only where a method needs one (--drafter METHOD=DIR, as `specserve serve` takes them)."""
    base = ("--max-num-seqs", "2", "--max-model-len", "2048")
    if not drafters:
        return (*base, "--no-drafters")
    return (*base, *(a for d in drafters for a in ("--drafter", d)))


def start_server(stack: ExitStack, dtype: str, env: dict, flags: tuple[str, ...]) -> tuple[str, int]:
    """One `specserve serve --openai-port` for this target dtype: (gRPC url, OpenAI port)."""
    from specserve.cli.serve_process import serve_process

    (ROOT / "work_dirs").mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"chat-peers-{dtype}-", dir=ROOT / "work_dirs"))
    stack.callback(shutil.rmtree, work, ignore_errors=True)   # after the server stops (its log is serve's output)
    served = stack.enter_context(serve_process(
        [sys.executable, "-m", "specserve.cli.main"], "--target", str(TARGET), "--dtype", dtype,
        *flags, "--openai-port", "0", "--work-dir", str(work), env=env, ready_timeout=900))
    port = served.openai_port()
    served.keep_reading()
    stack.callback(served.stop)
    print(f"chat_peers: specserve {dtype} ready (gRPC localhost:{served.ports.grpc}, OpenAI {port}; "
          f"work dir {work})", flush=True)
    return f"localhost:{served.ports.grpc}", port


def machine(cores: list[int], loadavg_start: tuple[float, float, float]) -> dict:
    return machine_info(ROOT, cores, loadavg_start)


# -- report --------------------------------------------------------------------------------------
def fmt(x, spec: str = ".1f") -> str:
    return "–" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    ref = report["reference"]
    lines = ["# SmolLM2-135M-Instruct chat peers (c = 1, greedy)", "",
             f"`{report['command']}`", "",
             f"{len(report['prompts'])} held-out chat prompts ({', '.join(report['settings']['kinds'])}), "
             f"{report['settings']['new_tokens']} new tokens at most, {len(report['machine']['cores_used'])} "
             f"core(s) of {report['machine']['cpu']}; × = tokens/s ÷ {ref}'s, measured in the same run.", "",
             "| system | tokens/s | × | TTFT mean / p50 / p90 ms | TPOT mean / p50 / p90 ms | acc. len | same text as ref |",
             "|---|---:|---:|---|---|---:|---:|"]
    for name, s in report["systems"].items():
        if s["status"] != "run":
            lines.append(f"| {name} | not run: {s['reason']} | | | | | |")
            continue
        m = s["summary"]

        def dist(d):
            return "–" if d is None else f"{d['mean']:.0f} / {d['p50']:.0f} / {d['p90']:.0f}"
        lines.append(f"| {name} | {fmt(m['tokens_per_s'])} | {fmt(s['ratio_to_reference'], '.2f')} | "
                     f"{dist(m['ttft_ms'])} | {dist(m['tpot_ms'])} | {fmt(m['mean_acceptance_length'], '.2f')} | "
                     f"{fmt(s['identical_text_to_reference'], '.0%')} |")
    lines += ["", f"OpenAI layer against direct gRPC (goal ≤ {GOAL_MS_PER_CHUNK:g} ms per streamed chunk, "
                  f"≤ {GOAL_PCT:g} % of tokens/s):", "",
              "| dtype | method | ms / chunk | % of tokens/s | chunks | goal met |", "|---|---|---:|---:|---:|---|"]
    for dtype, by_method in report["openai_overhead"].items():
        for method, o in by_method.items():
            lines.append(f"| {dtype} | {method} | {fmt(o['ms_per_chunk'], '.2f')} | {fmt(o['tokens_per_s_pct'], '.1f')} | "
                         f"{o['chunks']} | {'yes' if o['meets_goal'] else 'no'} |")
    lines += ["", "Checks: " + ("all passed" if not report["failures"] else "FAILED"), ""]
    lines += [f"- {c}" for c in report["checks"]] + [f"- FAILED: {f}" for f in report["failures"]]
    return "\n".join(lines) + "\n"


def compare(report: dict, records: dict[str, list[RequestRecord]], prompts: list[Prompt], args) -> None:
    """Checks: the same prompt everywhere, OpenAI text == gRPC text (failures); greedy agreement
    with the reference and between methods (reported)."""
    checks, failures = report["checks"], report["failures"]
    for name, recs in records.items():
        bad = [p.index for p, r in zip(prompts, recs) if r.num_input_tokens != len(p.ids)]
        if bad:
            failures.append(f"{name}: prompt token count differs from the chat-templated ids on prompts {bad}")
    if not failures:
        checks.append("every system saw the chat-templated prompt's token count on every prompt")
    for dtype in args.dtypes:
        for method in args.methods:
            o, g = records.get(f"specserve_openai_{method}_{dtype}"), records.get(f"specserve_grpc_{method}_{dtype}")
            if o is None or g is None:
                continue
            bad = [r.index for r, s in zip(o, g) if r.text != s.text]
            if dtype != "float32" and method != "none":
                # Not a check: the adaptive policy picks draft lengths from measured costs, and in
                # bf16 a verify of another width rounds differently, so two runs of one request
                # may differ (the bf16 caveat: only fp32 greedy output is exact).
                checks.append(f"{dtype} {method}: OpenAI text == gRPC text on {len(o) - len(bad)}/{len(o)} prompts "
                              "(bf16 with drafting: informative)")
            elif bad:
                failures.append(f"{dtype} {method}: OpenAI text differs from gRPC text on prompts {bad}")
            else:
                checks.append(f"{dtype} {method}: OpenAI text == gRPC text on every prompt")
    ref = records[report["reference"]]
    for name, recs in records.items():
        same = sum(a.text == b.text for a, b in zip(recs, ref)) / len(ref)
        report["systems"][name]["identical_text_to_reference"] = same
    for dtype in args.dtypes:
        ours = records[f"specserve_grpc_none_{dtype}"]
        for name in [f"hf_generate_{dtype}", *(f"specserve_grpc_{m}_{dtype}" for m in args.methods[1:])]:
            if name in records:
                same = sum(a.text == b.text for a, b in zip(records[name], ours))
                checks.append(f"{name} text == specserve {dtype} `none`: {same}/{len(ours)} prompts"
                              + ("" if dtype == "float32" else " (bf16: informative)"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=10, help="held-out chat prompts, balanced across kinds")
    p.add_argument("--kinds", default=None, help="comma list of prompt kinds (default: every kind in the file)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--cores", type=int, default=2,
                   help="pin the run (servers and peers) to this many cores; every system gets as many threads")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--methods", default="none,ngram")
    p.add_argument("--drafter", action="append", default=[], metavar="METHOD=DIR",
                   help="serve this trained drafter (as `specserve serve --drafter`), for --methods that "
                        "need one, e.g. eagle=models/smollm2/eagle (repeatable; none: no drafters)")
    p.add_argument("--peers", default="hf,llama", help="comma list of peers to run: hf (transformers), llama (llama.cpp)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "smollm2" / "peers_cpu",
                   help="writes OUT.json and OUT.md (default: beside docs/smollm2/peers.md)")
    args = p.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    # Every ratio is to `none` measured in the same run.
    args.methods = ["none", *(m for m in args.methods.split(",") if m != "none")]
    peers = args.peers.split(",") if args.peers else []
    unknown = set(peers) - {"hf", "llama"}
    if unknown:
        p.error(f"--peers: unknown {', '.join(sorted(unknown))} (hf, llama)")

    loadavg_start = os.getloadavg()
    # The same cores for everything: the servers (children) inherit this affinity.
    cores = sorted(os.sched_getaffinity(0))[:args.cores]
    os.sched_setaffinity(0, cores)
    threads = len(cores)
    import torch
    torch.set_num_threads(threads)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}

    prompts = load_prompts(args.prompts, args.kinds.split(",") if args.kinds else None)
    print(f"chat_peers: {len(prompts)} prompts ({', '.join(p.kind for p in prompts)}), {args.new_tokens} new tokens, "
          f"cores {cores}", flush=True)
    systems: dict[str, Runner] = {}
    skipped: dict[str, str] = {}
    # The peers first: a peer that cannot load fails the run before the (slow) server starts.
    peer_systems: dict[str, Runner] = {}
    add_peers(peer_systems, skipped, peers, args.dtypes, threads)
    with ExitStack() as stack:
        for dtype in args.dtypes:
            url, port = start_server(stack, dtype, env, serve_flags(args.drafter))
            for method in args.methods:
                systems[f"specserve_openai_{method}_{dtype}"] = openai_runner(port, method)
                systems[f"specserve_grpc_{method}_{dtype}"] = grpc_runner(url, method)
        systems.update(peer_systems)
        records = measure(systems, prompts, args.new_tokens)

    reference = f"specserve_grpc_none_{args.dtypes[0]}"
    report = {"command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/chat_peers.py", *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": machine(cores, loadavg_start),
              "settings": {"new_tokens": args.new_tokens, "kinds": sorted({p.kind for p in prompts}), "threads": threads,
                           "dtypes": args.dtypes, "methods": args.methods, "serve_flags": list(serve_flags(args.drafter)),
                           "llama_cpp_lookup": LOOKUP, "concurrency": 1, "temperature": 0},
              "prompts": [{"index": p.index, "kind": p.kind, "messages": p.messages, "num_prompt_tokens": len(p.ids)}
                          for p in prompts],
              "reference": reference, "checks": [], "failures": [], "systems": {}, "openai_overhead": {}}
    ref_tps = throughput(records[reference])
    for name, recs in records.items():
        s = summarize(recs)
        report["systems"][name] = {"status": "run", "summary": s,
                                   "ratio_to_reference": s["tokens_per_s"] / ref_tps if s["tokens_per_s"] and ref_tps else None,
                                   "outputs": [r.text for r in recs]}
    for name, reason in skipped.items():
        report["systems"][name] = {"status": "not run", "reason": reason}
    for dtype in args.dtypes:
        report["openai_overhead"][dtype] = {
            m: overhead(records[f"specserve_openai_{m}_{dtype}"], records[f"specserve_grpc_{m}_{dtype}"])
            for m in args.methods}
    compare(report, records, prompts, args)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    table = markdown(report)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    print(f"chat_peers: wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.md')}")
    return 1 if report["failures"] else 0


def add_peers(systems: dict[str, Runner], skipped: dict[str, str], peers: list[str], dtypes: list[str],
              threads: int) -> None:
    import transformers

    for peer, names in (("hf", [f"hf_generate_{d}" for d in dtypes]), ("llama", ["llama_cpp", "llama_cpp_lookup"])):
        if peer not in peers:
            skipped.update({name: "left out by --peers" for name in names})
            print(f"chat_peers: skipping {', '.join(names)}: left out by --peers", flush=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(TARGET))
    if "hf" in peers:
        import torch

        for dtype in dtypes:
            model = transformers.AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=getattr(torch, dtype)).eval()
            systems[f"hf_generate_{dtype}"] = hf_runner(model, tokenizer)
    if "llama" in peers:
        reason = missing("llama_cpp", LLAMA_MISSING)
        if reason:
            for name in ("llama_cpp", "llama_cpp_lookup"):
                skipped[name] = reason
            print(f"chat_peers: skipping llama.cpp: {reason}", flush=True)
        else:
            from specserve.model.smollm2 import verified_gguf

            systems.update(llama_runners(verified_gguf(), TARGET, threads))


def measure(systems: dict[str, Runner], prompts: list[Prompt], new_tokens: int) -> dict[str, list[RequestRecord]]:
    from specserve.cli.bench.runner import rotate

    names = list(systems)
    for name in names:   # first calls pay one-off setup (allocator, caches, connections)
        systems[name](prompts[0], 4)
    records: dict[str, list[RequestRecord]] = {n: [] for n in names}
    for p in prompts:
        for name in rotate(names, p.index):
            records[name].append(systems[name](p, new_tokens))
        print(f"chat_peers: prompt {p.index + 1}/{len(prompts)} ({p.kind}): " + ", ".join(
            f"{n} {throughput(records[n]):.1f}" for n in names) + " tok/s", flush=True)
    return records


if __name__ == "__main__":
    sys.exit(main())
