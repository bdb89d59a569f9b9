"""Drive an Engine from one background thread; other threads submit and cancel.

The Triton `target_verifier` model's `execute` only queues requests here and returns; this
thread runs `engine.step()` while there is work and hands every RequestOutput to `on_output`
(which sends it through the request's response sender). All engine calls happen on this thread
or under its lock, so the engine itself stays single-threaded.

Pass a factory instead of an engine to build the engine ON this thread. Measured on the 2-core
CPU machine: a model loaded on one thread and run on another decodes slower than one loaded and
run on the same thread (demo model, batch-1 step: fp32 15.2 vs 14.0 ms, bf16 15.4 vs 10.3 ms),
and in Triton `initialize` runs on the stub's main thread while decoding runs here.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Union

from specserve.engine import Engine, GenerationRequest, RequestOutput

log = logging.getLogger("specserve.engine_loop")


class EngineLoop:
    def __init__(self, engine: Union[Engine, Callable[[], Engine]], on_output: Callable[[RequestOutput], None],
                 on_failure: Callable[[str, BaseException], None] | None = None):
        """on_failure(request_id, error) is called for every live request if a step raises.
        `engine` may be a factory: start() then builds it on the loop thread (and re-raises
        its error, if any)."""
        self._factory = None if isinstance(engine, Engine) else engine
        self.engine: Engine | None = engine if isinstance(engine, Engine) else None
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._on_output, self._on_failure = on_output, on_failure
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self._live: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error
        return self

    def submit(self, req: GenerationRequest) -> None:
        """Raises RequestRejected (synchronously, in the caller's thread) for a bad request."""
        with self._wake:
            self.engine.submit(req)
            self._live.add(req.request_id)
            self._wake.notify()

    def cancel(self, request_id: str) -> None:
        with self._wake:
            if self.engine.cancel(request_id):
                self._wake.notify()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

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
                while not self._stopping and not self.engine.has_work():
                    self._wake.wait()
                if self._stopping:
                    return
                error: BaseException | None = None
                try:
                    outputs = self.engine.step()
                except Exception as e:  # noqa: BLE001 — every live request must hear of it
                    log.exception("engine step failed; failing its requests")
                    error, outputs = e, []
                    self.engine.abort_all()
                    failed, self._live = self._live, set()
                else:
                    failed = set()
                    for out in outputs:
                        if out.finished:
                            self._live.discard(out.request_id)
            # Callbacks run outside the lock so a slow client never stalls submit/cancel.
            for out in outputs:
                self._on_output(out)
            for rid in failed:
                if self._on_failure:
                    self._on_failure(rid, error)
