"""`specserve bench`: run the serving benchmark and write its report.

    specserve bench --quick                                  # starts a server on the demo model
    specserve bench --url localhost:8001 --methods none,ngram --concurrency 1,4,8 \\
                    --request-rate 0.5,1,2 --num-requests 200 --out bench_out

Without --url it starts tritonserver itself on --target (default: the demo model; when the demo
model's weights are absent, a small random-weight model, and the report says so).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from specserve.cli.bench.fallback import DEMO_TARGET, has_weights, random_checkpoint
from specserve.core.paths import shown

# --quick: sized for a 2-core CPU shared with other work, so `make bench` ends within ~15 min.
QUICK = {"num_requests": 20, "output_range": "32,256", "concurrency": "4", "request_rate": "0.2,0.6",
         "open_loop_requests": 10, "block_size": 10, "peer_requests": 3}
FULL = {"num_requests": 100, "output_range": "32,512", "concurrency": "1,4,8", "request_rate": "0.5,1,2,4",
        "open_loop_requests": 0, "block_size": 16, "peer_requests": 10}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", help="gRPC address of a running server (host:port)")
    where.add_argument("--target", type=Path,
                       help="checkpoint to serve with a server started here (default: the demo model)")
    p.add_argument("--model", default="llm", help="the ensemble to call: `llm`, or a tier's `llm_<tier>` "
                   "(default: %(default)s)")
    p.add_argument("--tokenizer", type=Path, help="checkpoint folder whose tokenizer.json sizes prompts; with "
                   "--url also the weights the peers load (default: --target, or the demo model)")
    p.add_argument("--max-model-len", type=int, help="the server's model length (default: the checkpoint's, ≤ 2048)")
    p.add_argument("--methods", default="none,ngram,eagle",
                   help="comma-separated; a method the server does not offer is skipped and reported (default: %(default)s)")
    p.add_argument("--concurrency", help="closed-loop concurrencies, comma-separated (quick: %s, full: %s)"
                   % (QUICK["concurrency"], FULL["concurrency"]))
    p.add_argument("--request-rate", help="open-loop Poisson rates in requests/s, comma-separated; '' for none "
                   "(quick: %s, full: %s)" % (QUICK["request_rate"], FULL["request_rate"]))
    p.add_argument("--num-requests", type=int, help="workload size (quick: %d, full: %d)"
                   % (QUICK["num_requests"], FULL["num_requests"]))
    p.add_argument("--open-loop-requests", type=int,
                   help="requests per open-loop rate, the workload's first ones (0 = all; quick: %d)" % QUICK["open_loop_requests"])
    p.add_argument("--output-range", help="min,max output tokens drawn per request (quick: %s, full: %s)"
                   % (QUICK["output_range"], FULL["output_range"]))
    p.add_argument("--block-size", type=int, help="requests per interleaving block (quick: %d, full: %d)"
                   % (QUICK["block_size"], FULL["block_size"]))
    p.add_argument("--quick", action="store_true", help="small sizes for a CPU machine (see the defaults)")
    p.add_argument("--prompts-file", type=Path, help="JSON lines with a 'prompt' key, or text lines "
                   "(default: the demo's held-out prompts, plus the held-out corpus for long prompts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                   help="also run transformers generate / prompt lookup / assisted generation (default: on)")
    p.add_argument("--peer-requests", type=int, help="requests for the peer comparison (quick: %d, full: %d)"
                   % (QUICK["peer_requests"], FULL["peer_requests"]))
    p.add_argument("--peer-threads", type=int, help="torch threads for the transformers peers (default: the "
                   "faster, measured here, of 1 and the OMP_NUM_THREADS a server started here gets)")
    p.add_argument("--draft-model", type=Path, help="a small causal LM for transformers' assisted generation")
    p.add_argument("--max-num-seqs", type=int, default=16, help="KV slots of a server started here")
    p.add_argument("--drafter", action="append", default=[], metavar="METHOD=DIR",
                   help="a drafter for a server started here, as for `specserve serve` (repeatable; default: an "
                        "EAGLE drafter in a folder 'eagle' beside the target, when there is one)")
    p.add_argument("--no-drafters", action="store_true", help="start the server without drafters")
    p.add_argument("--out", type=Path, default=Path("work_dirs/bench"), help="report folder (default: %(default)s)")


def _resolve(args: argparse.Namespace) -> dict:
    sizes = QUICK if args.quick else FULL
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else sizes[name]  # noqa: E731
    out_lo, out_hi = _ints(pick("output_range"))
    return {"num_requests": pick("num_requests"), "output_range": (out_lo, out_hi),
            "concurrency": _ints(pick("concurrency")), "request_rate": _floats(pick("request_rate")),
            "open_loop_requests": pick("open_loop_requests"), "block_size": pick("block_size"),
            "peer_requests": pick("peer_requests")}


def _model(args: argparse.Namespace, notes: list[str]) -> tuple[Path | None, str]:
    """The checkpoint served (None with --url and no local copy) and how to describe it."""
    if args.url:
        local = args.target or args.tokenizer or DEMO_TARGET
        return (local if has_weights(local) else None), "served at " + args.url
    if args.target is not None:
        if not has_weights(args.target):
            raise SystemExit(f"--target {args.target}: no config.json and *.safetensors there")
        kind = "demo model" if Path(args.target).resolve() == DEMO_TARGET.resolve() else "checkpoint"
        return args.target, kind
    if has_weights(DEMO_TARGET):
        return DEMO_TARGET, "demo model"
    path = random_checkpoint(Path(tempfile.gettempdir()) / "specserve-bench-random-demo-shape")
    notes.append(f"The demo model's weights are not in {DEMO_TARGET}; this run used a random-weight Llama "
                 "of the demo model's shape (18 layers, hidden 384) with the demo tokenizer: speed figures "
                 "are real, acceptance figures say nothing about a trained model.")
    return path, "random weights (demo model absent)"


@contextlib.contextmanager
def _server(args: argparse.Namespace, checkpoint: Path | None, max_len: int, out: Path, log):
    """Yield (gRPC address, drafters served): --url as given, or a tritonserver started here."""
    if args.url:
        yield args.url, None
        return
    from specserve.cli.checks import CliError, resolve_drafters
    from specserve.triton.launch import TritonServer
    from specserve.serving.settings import DeploymentSettings
    from specserve.triton.render import render_repository

    try:
        drafters = resolve_drafters(Path(checkpoint), args.drafter, args.no_drafters)
    except CliError as e:
        raise SystemExit(f"specserve bench: {e}") from None
    from specserve.serving.build import where_drafters_run

    # Every method is asked for by name; drafted lengths are fixed, as the figures always were.
    settings = DeploymentSettings(checkpoint, max_num_seqs=args.max_num_seqs, max_model_len=max_len,
                                  drafters=drafters, default_method="none", draft_policy="fixed")
    for line in where_drafters_run(settings):
        log(f"bench: serving {line}")
    work = Path(tempfile.mkdtemp(prefix="specserve-bench-"))
    try:
        repo = render_repository(settings, work / "model_repository")
        server = TritonServer(repo, work, None, log_file=out / "tritonserver.log", exit_timeout_s=5)
        log(f"bench: starting tritonserver (log: {server.log_file})")
        try:
            server.start()
            server.wait_ready(300)
            yield server.grpc_url, [f"{m}={shown(f)}" for m, f in drafters]
        finally:
            server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _offered(driver, methods: list[str], log) -> tuple[list[str], dict[str, str]]:
    """The requested methods the server runs, and the server's reason for each it does not."""
    run, skipped = [], {}
    for m in methods:
        reason = driver.probe(m)
        if reason is None:
            run.append(m)
            continue
        if m == "none":
            raise SystemExit(f"the server cannot run plain decoding (`none`): {reason}")
        skipped[m] = reason
        log(f"bench: skipping {m}: {reason}")
    return run, skipped


def _peers(args: argparse.Namespace, checkpoint: Path | None, requests, methods: list[str], driver, log) -> dict:
    if not args.peers:
        return {"status": "not run", "reason": "--no-peers"}
    if checkpoint is None:
        return {"status": "not run", "reason": "the served checkpoint is not on this machine (give --tokenizer DIR)"}
    import torch

    from specserve.cli.bench.peers import run_peers
    from specserve.triton.launch import server_env

    threads = torch.get_num_threads()
    candidates = [args.peer_threads] if args.peer_threads else [1, int(server_env().get("OMP_NUM_THREADS", "1"))]
    log("bench: peers (transformers) at concurrency 1")
    try:
        return run_peers(checkpoint, requests, methods, driver, draft_model=args.draft_model,
                         thread_candidates=candidates, log=log)
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace) -> dict:
    from specserve.cli.bench import report as report_mod
    from specserve.cli.bench.runner import StreamDriver, run_phase
    from specserve.cli.bench.workload import build_workload, describe, text_source
    from specserve.model.tokenizer import load_tokenizer
    from specserve.serving.settings import DeploymentSettings

    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    cfg = _resolve(args)
    notes: list[str] = []
    checkpoint, kind = _model(args, notes)
    max_len = args.max_model_len or (DeploymentSettings(checkpoint).model_len() if checkpoint else 2048)
    requested = [m.strip() for m in args.methods.split(",") if m.strip()]
    # Every ratio is to `none` measured in the same run.
    methods = requested if "none" in requested else ["none", *requested]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    source, source_note = text_source(load_tokenizer(args.tokenizer or checkpoint or DEMO_TARGET), args.prompts_file)
    requests, plans = build_workload(source, cfg["num_requests"], max_len, seed=args.seed,
                                     output_range=cfg["output_range"])
    log(f"bench: model {checkpoint or args.url} ({kind}); {len(requests)} requests; "
        f"buckets {[(p.name, p.count) for p in plans]}")

    t_start = time.perf_counter()
    machine = report_mod.machine()  # before the run: the load average says what else was running
    with _server(args, checkpoint, max_len, out, log) as (url, drafters):
        driver = StreamDriver(url, model=args.model)
        methods, skipped = _offered(driver, methods, log)
        for m in methods:  # warm-up, not recorded
            driver.run(requests[0], m)
        phases = []
        for c in cfg["concurrency"]:
            log(f"bench: closed loop, concurrency {c}")
            phases.append(run_phase(driver, f"closed_c{c}", requests, methods, concurrency=c,
                                    block_size=cfg["block_size"], seed=args.seed, rotation=len(phases), log=log))
        open_reqs = requests[: cfg["open_loop_requests"] or len(requests)]
        for rate in cfg["request_rate"]:
            log(f"bench: open loop, {rate:g} requests/s (Poisson), {len(open_reqs)} requests")
            phases.append(run_phase(driver, f"open_{rate:g}rps", open_reqs, methods, request_rate=rate,
                                    block_size=cfg["block_size"], seed=args.seed, rotation=len(phases), log=log))
        peers = _peers(args, checkpoint, requests[: cfg["peer_requests"]], methods, driver, log)

    report = {
        "schema": report_mod.SCHEMA,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": _command_line(args),
        "wall_s": time.perf_counter() - t_start,
        "machine": {**machine, "load_average_1m_end": os.getloadavg()[0]},
        "model": {"path": shown(checkpoint) if checkpoint else str(args.url), "kind": kind, "max_model_len": max_len},
        "server": {"url": url, "model": args.model, "started_by_bench": not args.url,
                   "max_num_seqs": None if args.url else args.max_num_seqs, "drafters": drafters},
        "workload": {**describe(requests, plans, cfg["output_range"], args.seed), "sources": source_note,
                     "quick": args.quick},
        "methods": {"requested": requested, "run": methods, "skipped": skipped},
        "settings": {**cfg, "output_range": list(cfg["output_range"]), "sampling": "greedy (temperature 0)"},
        "phases": [report_mod.phase_summary(p) for p in phases],
        "peers": peers,
        "notes": notes + ["Ratios to `none` are measured in this run, methods interleaved block by block."],
    }
    report_mod.write_json(report, out)
    (out / "bench.md").write_text(report_mod.markdown(report))
    report_mod.plots(report, phases, out)
    log(f"bench: report in {out}/ (bench.json, bench.md, latency_cdf.png, throughput_vs_rate.png, speedup.png)")
    print(report_mod.markdown(report))
    return report


def run_cli(args: argparse.Namespace) -> int:
    """The `specserve bench` subcommand's entry (specserve/cli/main.py)."""
    run(args)
    return 0


def _command_line(args: argparse.Namespace) -> str:
    if getattr(args, "argv", None) is not None:   # called through main()
        return shlex.join(["specserve", "bench", *args.argv])
    return shlex.join(["specserve", *sys.argv[1:]])   # the `specserve bench` subcommand


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="specserve bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return run(args)
