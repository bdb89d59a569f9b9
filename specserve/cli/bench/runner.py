"""Drive the `llm` ensemble over gRPC streaming and record every response's arrival time.

One tritonclient gRPC client and stream per in-flight request (a client holds one stream), so the
arrival of each streamed response is timestamped in its own callback as it comes in.

Fairness of ratios: a phase (closed loop at C, or open loop at λ) splits the workload into blocks,
and every method runs every block — the same prompts and budgets, greedy — in round-robin order
that rotates by block (block 0: none, ngram, …; block 1: ngram, …, none). Each method's
throughput divides by its own blocks' wall time, and slow drift of the machine (other jobs on a
shared CPU) spreads over all methods instead of landing on one.
"""

from __future__ import annotations

import json
import queue
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specserve.cli.bench.events import Chunk, RequestRecord, Window
from specserve.cli.bench.workload import WorkloadRequest

clock = time.perf_counter


class StreamDriver:
    def __init__(self, url: str, model: str = "llm", timeout_s: float = 600.0, temperature: float = 0.0):
        self.url, self.model, self.timeout_s, self.temperature = url, model, timeout_s, temperature

    def sampling(self, req: WorkloadRequest, method: str) -> dict:
        # Greedy by default: speculation is lossless, so every method produces the same tokens and
        # the comparison is of time alone. Sampled (make compare's T = 0.7): the same distribution.
        return {"max_tokens": req.max_tokens, "temperature": self.temperature, "spec_method": method}

    def run(self, req: WorkloadRequest, method: str, send_at: float | None = None) -> RequestRecord:
        """Send req (at clock() == send_at when given) and wait for its final response."""
        import tritonclient.grpc as grpcclient

        from specserve.serving import schema
        from specserve.triton.client import build_inputs

        client = grpcclient.InferenceServerClient(self.url)
        arrivals: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: arrivals.put((clock(), result, error)))
        inputs = build_inputs(req.prompt, self.sampling(req, method), stream=True, exclude_input_in_output=True)
        try:
            if send_at is not None:
                time.sleep(max(0.0, send_at - clock()))
            rec = RequestRecord(req.index, method, req.bucket, send_t=clock())
            try:
                client.async_stream_infer(self.model, inputs, enable_empty_final_response=True)
            except Exception as e:  # noqa: BLE001 — a failed send is this request's error, not the run's
                rec.error, rec.end_t = f"send failed: {e}", clock()
                return rec
            pieces = []
            while True:
                try:
                    t, result, error = arrivals.get(timeout=self.timeout_s)
                except queue.Empty:
                    rec.error, rec.end_t = f"no response within {self.timeout_s:.0f} s", None
                    break
                if error is not None:
                    rec.error = str(error.message() if hasattr(error, "message") else error)
                    rec.end_t = t
                    break
                text = result.as_numpy(schema.TEXT_OUTPUT.name)
                if text is not None:
                    n_new = int(result.as_numpy(schema.NUM_OUTPUT_TOKENS.name).reshape(-1)[0])  # this response's
                    rec.chunks.append(Chunk(t, n_new))
                    rec.num_output_tokens += n_new
                    rec.num_input_tokens = int(result.as_numpy(schema.NUM_INPUT_TOKENS.name).reshape(-1)[0])
                    rec.finish_reason = result.as_numpy(schema.FINISH_REASON.name).reshape(-1)[0].decode()
                    rec.spec_stats = json.loads(result.as_numpy(schema.SPEC_STATS.name).reshape(-1)[0])
                    pieces.append(text.reshape(-1)[0].decode("utf-8", errors="replace"))
                if result.get_response().parameters["triton_final_response"].bool_param:
                    rec.end_t = t
                    break
            rec.text = "".join(pieces)
            return rec
        finally:
            client.stop_stream(cancel_requests=True)
            client.close()

    def probe(self, method: str) -> str | None:
        """None when the server runs `method`; else the server's reason (e.g. unknown spec_method)."""
        rec = self.run(WorkloadRequest(-1, "probe", "Hello", 0, 2), method)
        return rec.error


@dataclass
class PhaseResult:
    name: str
    mode: str                         # "closed" | "open"
    concurrency: int | None
    request_rate: float | None
    records: dict[str, list[RequestRecord]] = field(default_factory=dict)
    windows: dict[str, list[Window]] = field(default_factory=dict)
    order: list[list[str]] = field(default_factory=list)   # the method order of each block


def blocks(requests: list[WorkloadRequest], size: int) -> list[list[WorkloadRequest]]:
    return [requests[i:i + size] for i in range(0, len(requests), size)]


def rotate(methods: list[str], k: int) -> list[str]:
    k %= len(methods)
    return methods[k:] + methods[:k]


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the block start) of a Poisson process at `rate` requests/s; the first
    request goes at 0."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def closed_loop(driver: StreamDriver, requests: list[WorkloadRequest], method: str,
                concurrency: int) -> tuple[list[RequestRecord], Window]:
    """C workers; each sends its next request as soon as its previous one finished."""
    todo = list(requests)
    lock = threading.Lock()
    records: list[RequestRecord] = []

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                req = todo.pop(0)
            rec = driver.run(req, method)
            with lock:
                records.append(rec)

    start = clock()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, len(requests)))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sorted(records, key=lambda r: r.index), Window(method, start, clock())


def open_loop(driver: StreamDriver, requests: list[WorkloadRequest], method: str, rate: float,
              seed: int) -> tuple[list[RequestRecord], Window]:
    """Requests sent at Poisson arrival times regardless of how many are in flight."""
    offsets = poisson_offsets(len(requests), rate, seed)
    start = clock() + 0.05  # every thread is set up before the first send
    with ThreadPoolExecutor(max_workers=max(1, len(requests))) as pool:
        futures = [pool.submit(driver.run, req, method, start + off) for req, off in zip(requests, offsets)]
        records = [f.result() for f in futures]
    return records, Window(method, start, clock())


def run_phase(driver: StreamDriver, name: str, requests: list[WorkloadRequest], methods: list[str], *,
              concurrency: int | None = None, request_rate: float | None = None, block_size: int,
              seed: int = 0, rotation: int = 0, log=print) -> PhaseResult:
    """One phase, methods interleaved block by block (see the module docstring). `rotation` shifts
    the first block's order, so phases of one block each still alternate which method goes first."""
    if (concurrency is None) == (request_rate is None):
        raise ValueError("a phase is either closed-loop (concurrency) or open-loop (request_rate)")
    res = PhaseResult(name, "closed" if concurrency else "open", concurrency, request_rate,
                      {m: [] for m in methods}, {m: [] for m in methods})
    for b, block in enumerate(blocks(requests, block_size)):
        order = rotate(methods, b + rotation)
        res.order.append(order)
        for method in order:
            if concurrency is not None:
                recs, win = closed_loop(driver, block, method, concurrency)
            else:
                # The same arrival times for every method of this block.
                recs, win = open_loop(driver, block, method, request_rate, seed * 1000 + b)
            res.records[method] += recs
            res.windows[method].append(win)
            toks = sum(r.num_output_tokens for r in recs if r.ok)
            errs = sum(1 for r in recs if r.error)
            log(f"  {name} block {b + 1}: {method:>6}: {len(recs)} requests, {toks} tokens in "
                f"{win.end - win.start:.1f} s" + (f", {errs} errors" if errs else ""))
    return res
