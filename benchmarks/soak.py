"""Soak and leak benchmark (issue 14): thousands of mixed requests against one server.

    python benchmarks/soak.py --requests 2000 --concurrency 16 --out docs/reliability/soak.json

Starts `specserve serve` on the demo model (with its EAGLE drafter) unless --url is given, then
sends a deterministic mix from --concurrency client threads: methods none / ngram / eagle, greedy
and seeded sampling, short and long outputs, about 10 % cancelled mid-stream by the client, and
about 10 % bad inputs (NaN temperature, unknown keys, invalid JSON, an unknown method) interleaved.
It reports:
  - failed good requests (an error on a request that was valid and not cancelled: must be 0);
  - bad inputs that were NOT refused (must be 0), and good greedy outputs that differ from the
    first output seen for the same (prompt, budget) (must be 0: greedy is deterministic);
  - the engine's slot gauge at the end (specserve_num_slots_used; must be 0);
  - resident memory (RSS) of the whole server process tree, sampled every 2 s, and its growth
    between the first and the last tenth of the run (goal < 5 %).
This is a benchmark, not a test: it makes no timing claims and is not in `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specserve.triton.client import CompletionError, StreamClient, build_inputs  # noqa: E402
from specserve.triton.launch import Ports  # noqa: E402

BAD = [('{"temperature": NaN}', "temperature must be a finite number"),
       ('{"max_tokens": 4, "beam_width": 2}', "unknown sampling_parameters key"),
       ('{"max_tokens": 4', "not valid JSON"),
       ('{"spec_method": "bogus"}', "unknown spec_method")]


@dataclass
class Tally:
    sent: int = 0
    good_ok: int = 0
    good_failed: int = 0
    cancelled: int = 0
    bad_refused: int = 0
    bad_accepted: int = 0
    greedy_mismatch: int = 0
    by_method: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)


def tree_rss_kb(pid: int) -> int:
    """RSS of `pid` and all its descendants (tritonserver and its Python stubs), from /proc."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
        todo += children.get(p, [])
    return total


def slots_used(metrics_url: str) -> float | None:
    try:
        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    except OSError:
        return None
    m = re.search(r"^specserve_num_slots_used (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


def one(url: str, i: int, rng: random.Random, prompts: list[str], methods: list[str], tally: Tally,
        seen: dict, lock: threading.Lock) -> None:
    kind = rng.random()
    prompt = prompts[i % len(prompts)]
    if kind < 0.10:   # a bad input
        raw, want = BAD[i % len(BAD)]
        try:
            StreamClient(url).generate(prompt, raw, timeout=120)
            with lock:
                tally.bad_accepted += 1
        except CompletionError as e:
            with lock:
                if want in str(e):
                    tally.bad_refused += 1
                else:
                    tally.bad_accepted += 1
                    tally.failures.append(f"bad input got {e}")
        return
    method = methods[i % len(methods)]
    budget = rng.choice([16, 32, 64, 200])
    params = {"max_tokens": budget, "spec_method": method}
    if rng.random() < 0.3:
        params.update(temperature=0.8, top_p=0.95, seed=i)
    if kind < 0.20:   # cancelled by the client after its first response
        import tritonclient.grpc as grpcclient
        client = grpcclient.InferenceServerClient(url)
        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("llm", build_inputs(prompt, params), enable_empty_final_response=True)
        results.get(timeout=300)
        client.stop_stream(cancel_requests=True)
        client.close()
        with lock:
            tally.cancelled += 1
        return
    try:
        out = StreamClient(url).generate(prompt, params, timeout=600)
    except CompletionError as e:
        with lock:
            tally.good_failed += 1
            tally.failures.append(f"{method}: {e}")
        return
    with lock:
        tally.good_ok += 1
        tally.by_method[method] = tally.by_method.get(method, 0) + 1
        if "temperature" not in params:
            key = (prompt, budget)
            if seen.setdefault(key, out.text) != out.text:
                tally.greedy_mismatch += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="gRPC address of a running server (default: start one on the demo model)")
    ap.add_argument("--pid", type=int, help="with --url: the server's pid, for memory (default: not measured)")
    ap.add_argument("--metrics-url", help="with --url: its metrics URL")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--methods", default="none,ngram,eagle")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("work_dirs/soak/soak.json"))
    args = ap.parse_args()

    prompts = [json.loads(line)["prompt"] for line in (REPO / "models/demo/heldout_prompts.jsonl").open()]
    server = None
    if args.url:
        url, pid, metrics_url = args.url, args.pid, args.metrics_url
    else:
        ports = Ports.free()
        work = Path("work_dirs/soak/server")
        server = subprocess.Popen([sys.executable, "-m", "specserve.cli.main", "serve", "--target", "models/demo/target",
                                   "--http-port", str(ports.http), "--grpc-port", str(ports.grpc),
                                   "--metrics-port", str(ports.metrics), "--max-num-seqs", "16",
                                   "--work-dir", str(work)], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in server.stdout:
            if line.startswith("specserve: ready"):
                break
        else:
            raise SystemExit("the server did not start")
        threading.Thread(target=lambda: [None for _ in server.stdout], daemon=True).start()
        url, pid, metrics_url = f"localhost:{ports.grpc}", server.pid, f"http://localhost:{ports.metrics}/metrics"

    tally, seen, lock = Tally(), {}, threading.Lock()
    methods = args.methods.split(",")
    rss: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample_rss():
        while not stop.wait(2.0):
            if pid:
                rss.append((time.monotonic(), tree_rss_kb(pid)))

    threading.Thread(target=sample_rss, daemon=True).start()
    counter = iter(range(args.requests))
    start = time.monotonic()

    def worker(w: int):
        rng = random.Random(args.seed * 1000 + w)
        while True:
            with lock:
                i = next(counter, None)
                if i is None:
                    return
                tally.sent += 1
                if tally.sent % 100 == 0:
                    print(f"  {tally.sent}/{args.requests} sent, {time.monotonic() - start:.0f} s", flush=True)
            one(url, i, rng, prompts, methods, tally, seen, lock)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    time.sleep(3)   # gauges are reported asynchronously
    slots = slots_used(metrics_url)
    stop.set()
    tenth = max(len(rss) // 10, 1)
    first = sum(v for _, v in rss[:tenth]) / tenth if rss else None
    last = sum(v for _, v in rss[-tenth:]) / tenth if rss else None
    report = {"command": " ".join(sys.argv), "seconds": round(elapsed, 1), **asdict(tally),
              "slots_used_at_end": slots,
              "rss_kb_first_tenth": first, "rss_kb_last_tenth": last,
              "rss_growth_pct": None if not first else round(100 * (last - first) / first, 2),
              "rss_samples": len(rss)}
    report["failures"] = tally.failures[:20]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}, indent=1))
    if server is not None:
        server.send_signal(signal.SIGTERM)
        server.wait(120)
    ok = (tally.good_failed == 0 and tally.bad_accepted == 0 and tally.greedy_mismatch == 0 and slots == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
