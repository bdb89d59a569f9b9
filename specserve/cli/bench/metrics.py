"""Serving metrics from request records: pure functions, no clocks, no I/O.

Definitions (per request; errored requests are counted, never timed):

    TTFT   time to first token: first response carrying tokens − send.
    TPOT   time per output token after the first:
           (last token-carrying response − first token-carrying response) / (output tokens − 1).
           Needs two token-carrying responses; otherwise undefined (None).
    ITL    inter-token latency as a client sees it: the gaps between consecutive token-carrying
           responses. With speculation a response can carry several tokens, so ITL ≥ TPOT.
    E2E    final response − send.

Per method and phase: P50 / P90 / P99 (linear interpolation between closest ranks, numpy's
default), mean, population standard deviation; output-token and request throughput over the sum of
the method's windows (`events.Window`); mean acceptance length = (accepted + steps) / steps summed
over requests (so averaged over steps, as docs/design.md, 'State and verification', defines it); draft tokens per step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from specserve.cli.bench.events import RequestRecord, Window


def ttft(rec: RequestRecord) -> float | None:
    first = next((c for c in rec.chunks if c.num_tokens > 0), None)
    return None if first is None or not rec.ok else first.t - rec.send_t


def tpot(rec: RequestRecord) -> float | None:
    times = [c.t for c in rec.chunks if c.num_tokens > 0]
    if not rec.ok or len(times) < 2 or rec.num_output_tokens < 2:
        return None
    return (times[-1] - times[0]) / (rec.num_output_tokens - 1)


def inter_token_latencies(rec: RequestRecord) -> list[float]:
    if not rec.ok:
        return []
    times = [c.t for c in rec.chunks if c.num_tokens > 0]
    return [b - a for a, b in zip(times, times[1:])]


def e2e(rec: RequestRecord) -> float | None:
    return rec.end_t - rec.send_t if rec.ok else None


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0 ≤ p ≤ 100), linear between closest ranks. values must be non-empty."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    rank = p / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclass(frozen=True)
class Distribution:
    n: int
    mean: float
    std: float             # population standard deviation
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    def to_dict(self) -> dict:
        return asdict(self)


def distribution(values: Iterable[float | None]) -> Distribution | None:
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    return Distribution(len(xs), mean, std, percentile(xs, 50), percentile(xs, 90), percentile(xs, 99),
                        min(xs), max(xs))


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def throughput(records: Sequence[RequestRecord], windows: Sequence[Window]) -> dict:
    """Output tokens and completed requests per second over the summed windows (None when the
    windows have no duration)."""
    duration = sum(max(0.0, w.end - w.start) for w in windows)
    done = [r for r in records if r.ok]
    tokens = sum(r.num_output_tokens for r in done)
    return {"duration_s": duration, "output_tokens": tokens, "completed": len(done),
            "output_throughput": _ratio(tokens, duration), "request_throughput": _ratio(len(done), duration)}


def speculation(records: Sequence[RequestRecord]) -> dict:
    """Acceptance figures from the server's per-request SpecStats (finished requests only)."""
    stats = [r.spec_stats for r in records if r.ok and r.spec_stats]
    steps = sum(s.get("steps", 0) for s in stats)
    drafts = sum(s.get("drafts", 0) for s in stats)
    accepted = sum(s.get("accepted_tokens", 0) for s in stats)
    draft_tokens = sum(s.get("draft_tokens", 0) for s in stats)
    # Per-position rates are per request and unconditional (accepted at i / drafting steps), so
    # the run's rate at i weights each request by its drafting steps.
    width = max((len(s.get("acceptance_rate_per_position", [])) for s in stats), default=0)
    per_pos = []
    for i in range(width):
        acc = sum(s["acceptance_rate_per_position"][i] * s.get("drafts", 0)
                  for s in stats if i < len(s.get("acceptance_rate_per_position", [])))
        per_pos.append(acc / drafts if drafts else 0.0)
    # Where a step's time goes: the proposer call and the verify forward, per request step (a
    # batched step charges each row the whole step, so at c > 1 these are per batch step).
    draft_s = sum(s.get("draft_seconds", 0.0) for s in stats)
    verify_s = sum(s.get("verify_seconds", 0.0) for s in stats)
    return {"steps": steps, "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "mean_acceptance_length": (accepted + steps) / steps if steps else None,
            "draft_tokens_per_step": draft_tokens / steps if steps else None,
            "draft_ms_per_step": 1000 * draft_s / steps if steps else None,
            "verify_ms_per_step": 1000 * verify_s / steps if steps else None,
            "drafting_step_share": drafts / steps if steps else None,
            "acceptance_rate_per_position": per_pos,
            "proposer_errors": sum(s.get("proposer_errors", 0) for s in stats)}


def summarize(records: Sequence[RequestRecord], windows: Sequence[Window]) -> dict:
    """Every figure for one method in one phase."""
    dists = {
        "ttft_s": distribution(ttft(r) for r in records),
        "tpot_s": distribution(tpot(r) for r in records),
        "itl_s": distribution(x for r in records for x in inter_token_latencies(r)),
        "e2e_s": distribution(e2e(r) for r in records),
    }
    return {"requests": len(records), "errors": sum(1 for r in records if r.error is not None),
            "error_messages": sorted({r.error for r in records if r.error is not None})[:5],
            **throughput(records, windows),
            **{k: (d.to_dict() if d else None) for k, d in dists.items()},
            **speculation(records)}


# Ratios to `none`, oriented so that > 1 always means the method is faster.
_HIGHER_IS_BETTER = ("output_throughput", "request_throughput")
_LOWER_IS_BETTER = (("ttft_s", "p50"), ("tpot_s", "mean"), ("tpot_s", "p50"), ("itl_s", "p50"),
                    ("e2e_s", "p50"), ("e2e_s", "p90"), ("e2e_s", "p99"), ("e2e_s", "mean"))


def speedup(method: dict, none: dict) -> dict:
    """method's summary against none's from the same phase; None where either side is missing."""
    out = {}
    for key in _HIGHER_IS_BETTER:
        a, b = method.get(key), none.get(key)
        out[key] = a / b if a is not None and b else None
    for key, stat in _LOWER_IS_BETTER:
        a, b = (method.get(key) or {}).get(stat), (none.get(key) or {}).get(stat)
        out[f"{key.removesuffix('_s')}_{stat}"] = b / a if a and b is not None else None
    return out


def identical_outputs(records: Sequence[RequestRecord], reference: Sequence[RequestRecord]) -> float | None:
    """Share of requests whose text equals the reference method's for the same workload request
    (greedy decoding is lossless, so this should be 1.0)."""
    ref = {r.index: r.text for r in reference if r.ok}
    pairs = [(r.text, ref[r.index]) for r in records if r.ok and r.index in ref]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None
