"""The target_verifier's request handling, free of Triton types so it can be tested directly.

`execute()` hands each request here with a `Sender` over its Triton response sender. The engine
thread (EngineLoop) produces RequestOutputs; `_on_output` turns each into a response carrying a
token window for the stateless postprocess (see detokenize.py), with the final flag on the last.

Cancellation reaches the engine two ways, and both end in `engine.cancel`, which frees the KV slot
at once and yields a final "abort" output, answered with a bare final flag (the client is gone):
  * through the ensemble, postprocess notices the cancelled request and calls `cancel(id)` (by
    BLS; Triton 2.51 does not flag the in-flight target_verifier request itself);
  * for direct calls to target_verifier, a watcher thread polls the sender's `is_cancelled`
    (an IPC round trip, too costly to ask on every engine step).
A send that raises (client gone) cancels the request too.

A request the ENGINE ends early (an error in its row, the drain time running out at shutdown)
always gets an error response saying why, never something that looks like a normal completion.

A target that cannot run any more (a tensor-parallel worker died: TensorParallelError, or the
watcher thread finding a dead worker between steps) breaks the service for good: the requests in
flight end with the error, every later submit is refused with it at once, and `on_broken(why)`
is called once, where the Triton adapter unloads the model so that Triton reports it not ready
and its model control can load it again (a new engine, new workers).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Protocol

from specserve.core.engine import (FINISH_ABORT, FINISH_ERROR, Engine, GenerationRequest, RequestOutput,
                              RequestRejected, ServerBusy)
from specserve.core.engine_loop import EngineLoop, LoopState
from specserve.core.sampling import SamplingParams
from specserve.model.tensor_parallel import TensorParallelError
from specserve.model.tp_processes import TensorParallelTarget
from specserve.serving.detokenize import ResponseMeta, TokenWindow, make_window
from specserve.serving.params import RequestConfig

log = logging.getLogger("specserve.serving.verifier_service")

CANCEL_POLL_S = 0.1
# Test hook: while the file this names exists, the engine takes no decoding step (EngineLoop's
# `hold`), so a test can keep a request in flight for as long as it needs, whatever the load.
HOLD_FILE_ENV = "SPECSERVE_TEST_HOLD_FILE"
# What a request ended by a failed engine hears, whichever thread noticed the failure first.
ENGINE_FAILED = "the engine failed while running this request: {}"


def _test_hold() -> Callable[[], bool] | None:
    path = os.environ.get(HOLD_FILE_ENV)
    return None if not path else (lambda: os.path.exists(path))


@dataclass(frozen=True)
class VerifierResponse:
    window: TokenWindow
    meta: ResponseMeta
    final: bool


class Sender(Protocol):
    def send(self, response: VerifierResponse) -> None: ...   # raises if the client is gone
    def send_error(self, message: str) -> None: ...            # an error response, final
    def close(self) -> None: ...                               # the final flag, no response
    def is_cancelled(self) -> bool: ...


class MetricsSink(Protocol):
    """What the service reports; the Triton adapter turns it into Prometheus metrics."""
    def spec_step(self, method: str, tier: str, drafts: int, draft_tokens: int, accepted: int,
                  accepted_per_position: list[int]) -> None: ...
    # Repetition guard (dflash): steps drafted by the fallback and activations, per finished request.
    def guard(self, method: str, tier: str, steps: int, activations: int) -> None: ...
    def first_token(self, method: str, tier: str, seconds: float) -> None: ...
    def finished(self, method: str, tier: str, reason: str, num_prompt: int, num_output: int,
                 time_per_output_token: float | None) -> None: ...
    def state(self, running: int, waiting: int, slots_used: int, policy_draft_len: int | None) -> None: ...
    # Optional (looked up with getattr): accepted_by_proposer(method, tier, counts), and
    # policy(verify_slowdown, estimates): the adaptive draft policy's verify slowdown and its
    # draft_policy.ProposerEstimate by proposer name, after every step.
    def rejected(self, reason: str) -> None: ...   # "busy" | "invalid" | "draining" | "unavailable"


@dataclass
class _Stream:
    request_id: str
    sender: Sender
    config: RequestConfig
    method: str
    tokens: list[int]                      # prompt + output so far
    num_prompt: int
    num_sent: int                          # tokens whose text went out (the prompt counts as sent unless included)
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    # Cumulative SpecStats already reported to metrics, so each output reports only its delta.
    reported: tuple[int, int, int] = (0, 0, 0)
    reported_per_position: list[int] = field(default_factory=list)
    reported_by_proposer: dict[str, int] = field(default_factory=dict)
    # Once the final flag is out, Triton frees the request's response factory, and touching the
    # sender again (even is_cancelled) crashes tritonserver 2.51 (use after free). `done` records
    # that, under `lock`, which every final send and every is_cancelled call holds.
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False

    def final(self, send: Callable, *args) -> None:
        """Send the final response (or flag) once; later attempts are no-ops."""
        with self.lock:
            if not self.done:
                self.done = True
                _quietly(send, *args)


class VerifierService:
    def __init__(self, engine: Engine | Callable[[], Engine], metrics: MetricsSink | None = None,
                 on_broken: Callable[[str], None] | None = None):
        """`engine` may be a factory, so the engine is built on the loop thread that runs it.
        `on_broken(why)`: called once, from the thread that noticed, when the target can no longer run."""
        self.metrics = metrics
        self._on_broken = on_broken
        self.broken: str | None = None   # why the target cannot run, once it cannot
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        # Ids unique across reloads of this model too: postprocess remembers ids it cancelled.
        self._prefix = uuid.uuid4().hex[:8]
        self._stopping = threading.Event()
        self._draining = False
        self.loop = EngineLoop(engine, self._on_output, self._on_failure, self._on_state,
                               hold=_test_hold()).start()
        self.engine: Engine = self.loop.engine
        self._watcher = threading.Thread(target=self._watch_cancellations, name="specserve-cancel",
                                         daemon=True)
        self._watcher.start()

    # -- requests in ---------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], config: RequestConfig, sender: Sender) -> str:
        """Queue a request; raises RequestRejected (a ValueError) with a client-facing message."""
        try:
            params = SamplingParams(**{**config.sampling, "stop": tuple(config.sampling.get("stop", ())),
                                       "stop_token_ids": tuple(config.sampling.get("stop_token_ids", ()))})
        except TypeError as e:  # a direct caller of target_verifier skipped preprocess's checks
            raise RequestRejected(f"bad sampling parameters: {e}") from None
        rid = f"{self._prefix}-{next(self._ids)}"
        req = GenerationRequest(rid, list(prompt_ids), params, config.spec_method,
                                num_draft_tokens=config.num_draft_tokens, spec_threshold=config.spec_threshold,
                                draft_policy=config.draft_policy, priority=config.priority,
                                fallback_method=config.fallback_method, options=config.options)
        method = config.spec_method or self.engine.cfg.default_method
        num_sent = 0 if config.include_prompt else len(prompt_ids)
        stream = _Stream(rid, sender, config, method, list(prompt_ids), len(prompt_ids), num_sent)
        with self._lock:
            self._streams[rid] = stream
        try:
            self.loop.submit(req)
        except Exception as e:
            with self._lock:
                del self._streams[rid]
            if self.metrics is not None and isinstance(e, RequestRejected):
                reason = ("busy" if isinstance(e, ServerBusy) else "unavailable" if self.broken is not None
                          else "draining" if self._draining else "invalid")
                _quietly(self.metrics.rejected, reason)
            raise
        self._on_state(self.loop.state())
        return rid

    def cancel(self, request_id: str) -> None:
        """The client of `request_id` has gone (postprocess saw its cancellation)."""
        self.loop.cancel(request_id)

    # -- shutdown (specserve serve's SIGTERM handling, through the control input) ---------------
    def drain(self) -> None:
        """Refuse new requests; those in flight go on to their end."""
        self._draining = True
        self.loop.drain("the server is shutting down and accepts no new requests; retry on another replica")

    def abort_all(self, message: str) -> int:
        """End every request in flight with an error saying `message`; returns how many."""
        n = self.loop.num_live
        self.loop.cancel_all(message)
        return n

    @property
    def num_live(self) -> int:
        with self._lock:
            return len(self._streams)

    def stop(self) -> None:
        self._stopping.set()
        self.loop.stop()
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            s.final(s.sender.send_error, "the server is shutting down")
        if isinstance(self.engine.model, TensorParallelTarget):
            self.engine.model.close()   # its workers stop with the model, not only when this process exits

    def _break(self, why: str) -> None:
        """The target cannot run any more: refuse every later request with `why`, end those in
        flight with it, and tell the adapter (once)."""
        with self._lock:
            if self.broken is not None:
                return
            self.broken = why
        log.error("the engine cannot run any more: %s", why)
        self.loop.drain(why)
        self.loop.cancel_all(ENGINE_FAILED.format(why))
        if self._on_broken is not None:
            _quietly(self._on_broken, why)

    # -- outputs out (engine thread) -------------------------------------------------------------
    def _on_output(self, out: RequestOutput) -> None:
        with self._lock:
            s = self._streams.get(out.request_id)
            if s is not None and out.finished:
                del self._streams[out.request_id]
        if s is None:
            return
        now = time.monotonic()
        s.method = out.stats.method   # the engine's choice (a tier's fallback may replace the method)
        if out.new_token_ids and s.first_token_at is None:
            s.first_token_at = now
            if self.metrics is not None:
                _quietly(self.metrics.first_token, s.method, s.config.tier, now - s.arrived)
        s.tokens.extend(out.new_token_ids)
        self._report_spec(s, out)
        if out.finish_reason == FINISH_ABORT and out.error is None:
            # Cancelled by the client (or by us when a send failed): nobody reads the stream any
            # more, but Triton still needs the final flag to retire the request. A bare flag,
            # not an error response: an error from a step leaves the cancelled ensemble request
            # in flight.
            s.final(s.sender.close)
            self._report_finish(s, out, now)
            return
        if out.finish_reason in (FINISH_ABORT, FINISH_ERROR):
            # Ended by the engine: the client is still there and must hear why. The error travels
            # in the final response's meta and postprocess turns it into the client's error: an
            # error response from this (decoupled) step after streamed ones would leave the
            # ensemble request in flight in Triton 2.51, and shutdown would then hang on it.
            self._end_with_error(s, out.error or "the engine ended this request", out.finish_reason,
                                 _spec_stats(s, out))
            self._report_finish(s, out, now)
            return
        if not (s.config.stream or out.finished):
            return
        window = make_window(s.tokens, s.num_sent, flush=out.finished)
        # The output tokens this response carries (the vLLM backend's num_output_tokens), not
        # counting prompt tokens it repeats (include_prompt).
        num_new = len(s.tokens) - max(s.num_sent, s.num_prompt)
        s.num_sent = len(s.tokens)
        meta = ResponseMeta(s.request_id, out.num_prompt_tokens, num_new, out.finish_reason or "",
                            _spec_stats(s, out))
        response = VerifierResponse(window, meta, final=out.finished)
        if out.finished:
            s.final(s.sender.send, response)
            self._report_finish(s, out, now)
            return
        try:
            with s.lock:
                if s.done:  # the backend already completed it (a cancel seen by is_cancelled)
                    return
                s.sender.send(response)
        except Exception as e:  # noqa: BLE001 — the client went away; free the slot
            log.info("request %s: send failed (%s); cancelling it", s.request_id, e)
            self.loop.cancel(s.request_id)  # its abort output then ends the stream

    def _on_failure(self, request_id: str, error: BaseException) -> None:
        with self._lock:
            s = self._streams.pop(request_id, None)
        if s is not None:
            self._end_with_error(s, ENGINE_FAILED.format(error), "error", {"tier": s.config.tier})
        if isinstance(error, TensorParallelError):
            self._break(str(error))

    @staticmethod
    def _end_with_error(s: _Stream, message: str, reason: str, stats: dict) -> None:
        meta = ResponseMeta(s.request_id, s.num_prompt, len(s.tokens) - max(s.num_sent, s.num_prompt), reason,
                            stats, error=message)
        s.final(s.sender.send, VerifierResponse(make_window(s.tokens, s.num_sent, flush=True), meta, final=True))

    # -- cancellation ----------------------------------------------------------------------------
    def _watch_cancellations(self) -> None:
        """Also watches a tensor-parallel target's workers: one that dies while the server idles
        turns the model not ready then, not when the next request finds it."""
        target = self.engine.model if isinstance(self.engine.model, TensorParallelTarget) else None
        while not self._stopping.wait(CANCEL_POLL_S):
            if target is not None and self.broken is None and (why := target.health()) is not None:
                self._break(why)
            with self._lock:
                streams = list(self._streams.values())
            for s in streams:
                with s.lock:
                    if s.done:
                        continue
                    try:
                        cancelled = s.sender.is_cancelled()
                    except Exception:  # noqa: BLE001 — a sender that cannot answer has lost its client
                        cancelled = True
                if cancelled:
                    self.loop.cancel(s.request_id)

    # -- metrics ---------------------------------------------------------------------------------
    def _report_spec(self, s: _Stream, out: RequestOutput) -> None:
        if self.metrics is None:
            return
        st = out.stats
        now = (st.drafts, st.draft_tokens, st.accepted_tokens)
        per_pos = list(st.accepted_per_position)
        prev = s.reported_per_position + [0] * (len(per_pos) - len(s.reported_per_position))
        delta = [a - b for a, b in zip(now, s.reported)]
        delta_pos = [a - b for a, b in zip(per_pos, prev)]
        if any(delta) or any(delta_pos):
            _quietly(self.metrics.spec_step, s.method, s.config.tier, *delta, delta_pos)
        s.reported, s.reported_per_position = now, per_pos
        by = st.accepted_by_proposer
        delta_by = {k: n - s.reported_by_proposer.get(k, 0) for k, n in by.items() if n != s.reported_by_proposer.get(k, 0)}
        report = getattr(self.metrics, "accepted_by_proposer", None)   # optional in a MetricsSink
        if delta_by and report is not None:
            _quietly(report, s.method, s.config.tier, delta_by)
        s.reported_by_proposer = dict(by)

    def _on_state(self, state: LoopState) -> None:
        if self.metrics is not None:
            _quietly(self.metrics.state, state.running, state.waiting, self.engine.num_slots_used,
                     self.engine.last_policy_k)
            policy, report = self.engine.policy, getattr(self.metrics, "policy", None)
            if policy is not None and report is not None:
                _quietly(report, policy.verify_slowdown, policy.estimates())

    def _report_finish(self, s: _Stream, out: RequestOutput, now: float) -> None:
        if self.metrics is None:
            return
        tpot = None
        if s.first_token_at is not None and out.num_output_tokens > 1:
            tpot = (now - s.first_token_at) / (out.num_output_tokens - 1)
        _quietly(self.metrics.finished, s.method, s.config.tier, out.finish_reason or "abort",
                     out.num_prompt_tokens, out.num_output_tokens, tpot)
        if out.stats.guard_steps:
            _quietly(self.metrics.guard, s.method, s.config.tier, out.stats.guard_steps,
                     out.stats.guard_activations)


def _spec_stats(s: _Stream, out: RequestOutput) -> dict:
    """The engine's SpecStats plus the request's tier and, when the text-type gate acted on it,
    its decision (spec_stats on the client's side)."""
    stats = {**out.stats.to_dict(), "tier": s.config.tier}
    if s.config.text_gate is not None:
        stats["text_gate"] = s.config.text_gate
    return stats


def _quietly(fn: Callable, *args) -> None:
    """Call fn, logging (not raising) failures: one broken client must not stop the engine thread."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        log.exception("%s failed", getattr(fn, "__qualname__", fn))
