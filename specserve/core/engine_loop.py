"""Drive an Engine from one background thread; other threads submit and cancel.

The Triton `target_verifier` model's `execute` only queues requests here and returns; this
thread runs `engine.step()` while there is work and hands every RequestOutput to `on_output`
(which sends it through the request's response sender).

The engine is touched by this thread only. Other threads never wait for a step: `submit`
validates the request in the caller's thread (so a bad request is refused at once, with its
message) and puts it in an inbox; `cancel` does the same with the request id; the loop applies
the inbox between steps. A step may take long (a remote drafter that hangs until its timeout, a
long prefill), and no client's submit or cancel should wait for it.

The admission queue is bounded: the inbox plus the engine's waiting list hold at most
`max_queue_len` requests; beyond it `submit` raises ServerBusy at once.

The loop thread never dies: an exception in a step fails the requests of that step and the loop
goes on; an exception in a callback is logged.

Pass a factory instead of an engine to build the engine ON this thread. Measured on the 2-core
CPU machine: a model loaded on one thread and run on another decodes slower than one loaded and
run on the same thread (demo model, batch-1 step: fp32 15.2 vs 14.0 ms, bf16 15.4 vs 10.3 ms),
and in Triton `initialize` runs on the stub's main thread while decoding runs here.

`hold` (tests only) pauses decoding: while it returns True the loop takes no step for running
rows, but still applies the inbox (a submit, a cancel) with one step, so an ended request still
gets its final output. Tests use it to keep a request provably in flight (the drain time at
shutdown running out) instead of racing a long request against the clock.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Union

from specserve.core.engine import Engine, GenerationRequest, RequestOutput, RequestRejected, ServerBusy

log = logging.getLogger("specserve.core.engine_loop")

HOLD_POLL_S = 0.05   # how often a held loop asks `hold` again (a test's hold is a file, not an event)


@dataclass(frozen=True)
class LoopState:
    """What the loop reports after every step (for metrics): slots in use and queue depth."""
    running: int       # requests holding a KV slot
    waiting: int       # requests queued for a slot (engine queue + inbox)
    live: int          # requests submitted and not yet finished


class EngineLoop:
    def __init__(self, engine: Union[Engine, Callable[[], Engine]], on_output: Callable[[RequestOutput], None],
                 on_failure: Callable[[str, BaseException], None] | None = None,
                 on_state: Callable[[LoopState], None] | None = None, *,
                 hold: Callable[[], bool] | None = None):
        """on_failure(request_id, error) is called for every request of a step that raised.
        on_state(LoopState) after every step and every change of the queue.
        hold() → True pauses decoding (a test hook; see the module docstring).
        `engine` may be a factory: start() then builds it on the loop thread (and re-raises
        its error, if any)."""
        self._factory = None if isinstance(engine, Engine) else engine
        self.engine: Engine | None = engine if isinstance(engine, Engine) else None
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._on_output, self._on_failure, self._on_state = on_output, on_failure, on_state
        self._hold = hold
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self._draining: str | None = None   # refusal message once draining
        self._inbox: deque[tuple[str, object]] = deque()  # ("submit", req) | ("cancel", (id, error))
        self._queued = 0                     # submits in the inbox
        self._live: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error
        return self

    # -- other threads -------------------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> None:
        """Raises RequestRejected (ServerBusy when the queue is full) in the caller's thread."""
        self.engine.check(req)  # pure validation against the engine's fixed limits
        with self._wake:
            if self._draining is not None:
                raise RequestRejected(self._draining)
            if req.request_id in self._live:
                raise RequestRejected(f"request id {req.request_id!r} is already running")
            bound = self.engine.cfg.max_queue_len
            waiting = self._queued + self.engine.num_waiting
            # Requests that will find a free slot at the next step do not count as queued.
            if waiting >= self.engine.num_free_slots + bound:
                raise ServerBusy(f"server busy: {waiting} requests are already waiting for one of "
                                 f"{self.engine.cfg.max_num_seqs} slots (max_queue_len={bound}); "
                                 "retry later")
            self._inbox.append(("submit", req))
            self._queued += 1
            self._live.add(req.request_id)
            self._wake.notify()

    def cancel(self, request_id: str, error: str | None = None) -> None:
        """End a request; with `error`, its final output says why (the engine ended it)."""
        with self._wake:
            if request_id in self._live:
                self._inbox.append(("cancel", (request_id, error)))
                self._wake.notify()

    def drain(self, message: str) -> None:
        """Refuse new requests with `message`; running and queued ones go on to their end."""
        with self._wake:
            self._draining = message

    def cancel_all(self, error: str) -> None:
        with self._wake:
            for rid in list(self._live):
                self._inbox.append(("cancel", (rid, error)))
            self._wake.notify()

    @property
    def num_live(self) -> int:
        with self._lock:
            return len(self._live)

    def state(self) -> LoopState:
        e = self.engine
        with self._lock:
            return LoopState(e.num_running, e.num_waiting + self._queued, len(self._live))

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    # -- the loop thread -----------------------------------------------------------------------
    def _run(self) -> None:
        if self._factory is not None:
            try:
                self.engine = self._factory()
            except BaseException as e:  # noqa: BLE001 — handed to start(), which re-raises it
                self._build_error = e
        self._built.set()
        if self._build_error is not None:
            return
        while True:
            with self._wake:
                while not self._stopping and not self._inbox and not self._may_step():
                    self._wake.wait(HOLD_POLL_S if self._hold is not None and self.engine.has_work() else None)
                if self._stopping:
                    return
                inbox, self._inbox, self._queued = self._inbox, deque(), 0
            try:
                self._iteration(inbox)
            except BaseException:  # noqa: BLE001 — the loop must outlive any bug in its own handling
                log.exception("engine loop iteration failed; continuing")

    def _may_step(self) -> bool:
        return self.engine.has_work() and not (self._hold is not None and self._hold())

    def _iteration(self, inbox: deque) -> None:
        rejected: list[tuple[str, BaseException]] = []
        for kind, item in inbox:
            if kind == "submit":
                try:
                    self.engine.submit(item, checked=True)
                except Exception as e:  # noqa: BLE001 — checked in submit(); only a bug gets here
                    rejected.append((item.request_id, e))
            else:
                rid, error = item
                self.engine.cancel(rid, error)
        error: BaseException | None = None
        failed: list[str] = [rid for rid, _ in rejected]
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 — every request of the step must hear of it
            log.exception("engine step failed; failing its requests")
            error, outputs = e, []
            failed += self.engine.abort_all()
        finished = [out.request_id for out in outputs if out.finished]
        with self._lock:
            self._live.difference_update(finished)
            self._live.difference_update(failed)
        # Callbacks run outside the lock so a slow client never stalls submit/cancel.
        for out in outputs:
            self._call(self._on_output, out)
        if self._on_failure is not None:
            for rid, e in rejected:
                self._call(self._on_failure, rid, e)
            for rid in failed[len(rejected):]:
                self._call(self._on_failure, rid, error)
        if self._on_state is not None:
            self._call(self._on_state, self.state())

    @staticmethod
    def _call(fn: Callable, *args) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 — one broken callback must not stop the loop
            log.exception("engine loop callback %s failed", getattr(fn, "__qualname__", fn))
