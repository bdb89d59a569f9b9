"""Prometheus metrics on Triton's metrics port through the Python backend's custom metrics API.

Names mirror vLLM's speculative-decoding and latency metrics with our prefix. vLLM writes
`vllm:`; a colon is not accepted in custom metric names here, so ours are `specserve_…`. Every
metric is labelled by `method` and `tier` (one tier, "default", until tiers exist).

Each metric call is an IPC round trip to the Triton process, so calls are queued and made by one
worker thread, never on the engine thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

log = logging.getLogger("specserve.triton.metrics")

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5]

_COUNTERS = {
    "drafts": ("specserve_spec_decode_num_drafts_total", "Steps in which a draft was verified."),
    "draft_tokens": ("specserve_spec_decode_num_draft_tokens_total", "Drafted tokens verified."),
    "accepted": ("specserve_spec_decode_num_accepted_tokens_total", "Drafted tokens accepted."),
    "per_position": ("specserve_spec_decode_num_accepted_tokens_per_pos_total",
                     "Drafted tokens accepted at each draft position (label position, from 0)."),
    "by_proposer": ("specserve_spec_decode_num_accepted_tokens_per_proposer_total",
                    "Drafted tokens accepted, credited to each proposer whose candidate lies on them "
                    "(mtp; label proposer; a token several proposers drafted credits each)."),
    "requests": ("specserve_request_success_total", "Finished requests, by finish reason."),
    "prompt_tokens": ("specserve_prompt_tokens_total", "Prompt tokens prefilled."),
    "generation_tokens": ("specserve_generation_tokens_total", "Tokens generated."),
    "guard_steps": ("specserve_spec_decode_guard_steps_total",
                    "Steps a row of a guarded method (dflash) drafted with its fallback because its recent "
                    "output was a repeated pattern."),
    "guard_activations": ("specserve_spec_decode_guard_activations_total",
                          "Times the repetition guard stepped a row aside to its fallback."),
    "rejected": ("specserve_request_rejected_total",
                 "Requests refused at submission, by reason (busy: queue full; invalid; draining; "
                 "unavailable: the engine cannot run, a tensor-parallel worker died)."),
}
_HISTOGRAMS = {
    "ttft": ("specserve_time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS),
    "tpot": ("specserve_time_per_output_token_seconds",
             "Mean time per output token after the first, per request, in seconds.", TPOT_BUCKETS),
}

# Gauges. Running counts the engine's running requests, slots_used the KV slots allocated: the two
# are equal unless a slot leaks, which is what makes a leak visible.
_GAUGES = {
    "running": ("specserve_num_requests_running", "Requests running in the engine (holding a KV slot)."),
    "waiting": ("specserve_num_requests_waiting", "Requests queued for a KV slot (the admission queue)."),
    "slots_used": ("specserve_num_slots_used", "KV slots allocated."),
    "policy_draft_len": ("specserve_spec_decode_policy_draft_len",
                         "Draft length the adaptive draft policy chose for the last step."),
    "policy_verify_slowdown": ("specserve_spec_decode_policy_verify_slowdown",
                               "Recent verify forwards against the adaptive policy's start-up profile "
                               "(median; 1 = as fast as at start, 3 = three times slower)."),
}
# The adaptive draft policy's estimates per proposer (label proposer; draft_policy.ProposerEstimate).
_POLICY_GAUGES = {
    "gain": ("specserve_spec_decode_policy_estimated_gain",
             "Expected speed of drafting relative to plain decoding at the policy's last decision "
             "(below 1: the policy decodes plainly)."),
    "draft_ms": ("specserve_spec_decode_policy_draft_cost_ms",
                 "The proposer's full-width call, in milliseconds of the start-up profile's conditions."),
    "draft_cost_vs_start": ("specserve_spec_decode_policy_draft_cost_vs_start",
                            "The proposer's call cost relative to its first calls (3 = drafting looks three "
                            "times dearer than at start)."),
    "acceptance_length": ("specserve_spec_decode_policy_expected_acceptance_length",
                          "Tokens per step the policy expects from the proposer at the full draft length."),
}


class TritonMetrics:
    """Implements service.MetricsSink with pb_utils.MetricFamily counters and histograms."""

    def __init__(self, pb_utils: Any):
        fam = pb_utils.MetricFamily
        self._families = {key: fam(name=name, description=desc, kind=fam.COUNTER)
                          for key, (name, desc) in _COUNTERS.items()}
        self._families.update({key: fam(name=name, description=desc, kind=fam.HISTOGRAM)
                               for key, (name, desc, _) in _HISTOGRAMS.items()})
        self._families.update({key: fam(name=name, description=desc, kind=fam.GAUGE)
                               for key, (name, desc) in (*_GAUGES.items(), *_POLICY_GAUGES.items())})
        self._buckets = {key: b for key, (_, _, b) in _HISTOGRAMS.items()}
        self._metrics: dict[tuple, Any] = {}
        self._gauges: dict[tuple, float] = {}   # last value sent per (gauge, labels)
        self._gauges_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="specserve-metrics", daemon=True)
        self._thread.start()

    # -- MetricsSink ---------------------------------------------------------------------------
    def spec_step(self, method: str, tier: str, drafts: int, draft_tokens: int, accepted: int,
                  accepted_per_position: list[int]) -> None:
        labels = {"method": method, "tier": tier}
        self._inc("drafts", labels, drafts)
        self._inc("draft_tokens", labels, draft_tokens)
        self._inc("accepted", labels, accepted)
        for pos, n in enumerate(accepted_per_position):
            self._inc("per_position", {**labels, "position": str(pos)}, n)

    def guard(self, method: str, tier: str, steps: int, activations: int) -> None:
        labels = {"method": method, "tier": tier}
        self._inc("guard_steps", labels, steps)
        self._inc("guard_activations", labels, activations)
    def accepted_by_proposer(self, method: str, tier: str, counts: dict[str, int]) -> None:
        for proposer, n in counts.items():
            self._inc("by_proposer", {"method": method, "tier": tier, "proposer": proposer}, n)

    def first_token(self, method: str, tier: str, seconds: float) -> None:
        self._queue.put(("ttft", {"method": method, "tier": tier}, "observe", seconds))

    def finished(self, method: str, tier: str, reason: str, num_prompt: int, num_output: int,
                 time_per_output_token: float | None) -> None:
        labels = {"method": method, "tier": tier}
        self._inc("requests", {**labels, "finished_reason": reason}, 1)
        self._inc("prompt_tokens", labels, num_prompt)
        self._inc("generation_tokens", labels, num_output)
        if time_per_output_token is not None:
            self._queue.put(("tpot", labels, "observe", time_per_output_token))

    def state(self, running: int, waiting: int, slots_used: int, policy_draft_len: int | None) -> None:
        for key, n in (("running", running), ("waiting", waiting), ("slots_used", slots_used),
                       ("policy_draft_len", policy_draft_len)):
            self._set(key, {}, n)

    def policy(self, verify_slowdown: float, estimates: dict[str, Any]) -> None:
        """The adaptive policy's estimates (draft_policy.DraftPolicy.estimates), after every step."""
        self._set("policy_verify_slowdown", {}, round(verify_slowdown, 2))
        for proposer, est in estimates.items():
            for key in _POLICY_GAUGES:
                # Rounded: the estimates move a little every step, and each change is an IPC call;
                # a queue of them still draining at shutdown held up the model's unload.
                value = getattr(est, key)
                self._set(key, {"proposer": proposer}, None if value is None else round(value, 2))

    def _set(self, key: str, labels: dict[str, str], value: float | None) -> None:
        # Reported after every engine step: only changes go out (each set is an IPC call).
        ident = (key, tuple(labels.items()))
        with self._gauges_lock:   # the engine thread and submitting threads both report
            if value is not None and self._gauges.get(ident) != value:
                self._gauges[ident] = value
                self._queue.put((key, labels, "set", value))

    def rejected(self, reason: str) -> None:
        self._inc("rejected", {"reason": reason}, 1)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)
        # Metrics before their families (the backend requires that order).
        self._metrics.clear()
        self._families.clear()

    # -- worker --------------------------------------------------------------------------------
    def _inc(self, key: str, labels: dict[str, str], n: int) -> None:
        if n:
            self._queue.put((key, labels, "increment", n))

    def _metric(self, key: str, labels: dict[str, str]):
        ident = (key, tuple(sorted(labels.items())))
        m = self._metrics.get(ident)
        if m is None:
            family = self._families[key]
            if key in self._buckets:
                m = family.Metric(labels=labels, buckets=self._buckets[key])
            else:
                m = family.Metric(labels=labels)
            self._metrics[ident] = m
        return m

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            key, labels, op, value = item
            try:
                getattr(self._metric(key, labels), op)(value)
            except Exception:  # noqa: BLE001 — metrics must never take serving down
                log.exception("metric %s %s failed", key, op)


class TextGateMetrics:
    """`specserve_text_gate_total{decision, tier}` from preprocess: one per request the text-type
    gate acted on (decision dflash | fallback | unavailable; specserve/serving/text_gate.py)."""

    NAME = "specserve_text_gate_total"

    def __init__(self, pb_utils: Any):
        fam = pb_utils.MetricFamily
        self._family = fam(name=self.NAME, description="Requests the text-type gate decided, by decision "
                           "(dflash: kept; fallback: routed to the fallback; unavailable: no classifier, kept).",
                           kind=fam.COUNTER)
        self._metrics: dict[tuple[str, str], Any] = {}

    def count(self, decision: str, tier: str) -> None:
        try:
            m = self._metrics.get((decision, tier))
            if m is None:
                m = self._metrics[(decision, tier)] = self._family.Metric(labels={"decision": decision, "tier": tier})
            m.increment(1)
        except Exception:  # noqa: BLE001 — metrics must never take serving down
            log.exception("metric %s failed", self.NAME)

    def close(self) -> None:
        self._metrics.clear()   # metrics before their family (the backend requires that order)
        self._family = None
