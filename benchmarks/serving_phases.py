"""Closed-loop serving phases through one tritonserver on the demo model, shared by the method
benchmarks (dspark_bench, adaptive_bench): held-out code and prose prompts alternated, every
configuration on every block of requests in an order rotated per block
(specserve.cli.bench.runner.run_phase), greedy outputs compared with the reference configuration's."""

from __future__ import annotations

import json
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"


def alternated_prompts(n_per_kind: int) -> list[dict]:
    held = [json.loads(line) for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()]
    code = [h for h in held if h["kind"] == "code"][:n_per_kind]
    prose = [h for h in held if h["kind"] == "prose"][:n_per_kind]
    out = []
    for c, p in zip(code, prose):
        out += [c, p]
    return out


@contextmanager
def started_server(settings, prefix: str = "serving-phases-") -> Iterator[object]:
    """A tritonserver rendered from DeploymentSettings `settings` in a fresh temporary folder,
    ready; stopped on exit (its log stays in that folder)."""
    from specserve.triton.launch import TritonServer
    from specserve.triton.render import render_repository

    work = Path(tempfile.mkdtemp(prefix=prefix))
    srv = TritonServer(render_repository(settings, work / "model_repository"), work, None,
                       log_file=work / "tritonserver.log", exit_timeout_s=5)
    srv.start()
    try:
        srv.wait_ready(300)
        yield srv
    finally:
        srv.stop()


def run_phases(settings, configs: list[str], sampling: Callable[[object, str], dict], *, prompts: list[dict],
               concurrencies: list[int], new_tokens: int, reference: str = "none", log=print) -> dict:
    """{concurrency: {config: summary}} for a server rendered from DeploymentSettings `settings`;
    `sampling(workload_request, config)` gives each request's sampling_parameters."""
    from specserve.cli.bench.metrics import speculation, summarize
    from specserve.cli.bench.runner import StreamDriver, run_phase
    from specserve.cli.bench.workload import WorkloadRequest
    from specserve.model.tokenizer import load_tokenizer

    class Driver(StreamDriver):
        def sampling(self, req, config):
            return sampling(req, config)

    tok = load_tokenizer(DEMO / "target")
    phases = {}
    with started_server(settings) as srv:
        driver = Driver(srv.grpc_url)
        for c in concurrencies:
            # At concurrency C a block holds at least C requests (so C are really in flight);
            # prompts repeat when there are fewer.
            n = max(len(prompts), 2 * c)
            reqs = [WorkloadRequest(i, prompts[i % len(prompts)]["kind"], prompts[i % len(prompts)]["prompt"],
                                    len(tok.encode(prompts[i % len(prompts)]["prompt"]).ids), new_tokens)
                    for i in range(n)]
            block = max(c, 4)
            log(f"concurrency {c}: {n} requests, blocks of {block}, configurations rotated per block")
            res = run_phase(driver, f"C={c}", reqs, configs, concurrency=c, block_size=block, log=log)
            summary = {m: summarize(res.records[m], res.windows[m]) for m in configs}
            ref = {r.index: r.text for r in res.records[reference]}
            for m in configs:
                same = [r.text == ref.get(r.index) for r in res.records[m] if r.ok]
                summary[m]["identical_to_none"] = sum(same) / len(same) if same else None
                # Per prompt kind (code / prose): acceptance, and tokens/s over the requests' own
                # wall time (exact at concurrency 1, where requests do not overlap).
                summary[m]["by_kind"] = {}
                for kind in sorted({r.bucket for r in res.records[m]}):
                    recs = [r for r in res.records[m] if r.bucket == kind and r.ok]
                    secs = sum(r.end_t - r.send_t for r in recs)
                    summary[m]["by_kind"][kind] = {
                        **speculation(recs), "requests": len(recs),
                        "guard_steps": sum(r.spec_stats.get("guard_steps", 0) for r in recs),
                        "tokens_per_s_per_request": sum(r.num_output_tokens for r in recs) / secs if secs else None}
            phases[c] = summary
    return phases
