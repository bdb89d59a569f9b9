"""Helpers for tests that act on a server while streams are in flight, and read its metrics."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


class FirstChunks:
    """Counts streams that have received their first chunk; `wait(n)` until n have. Its callback
    never blocks (a blocked callback would stall that client's stream)."""

    def __init__(self):
        self._n, self._cond = 0, threading.Condition()

    def on_first_chunk(self) -> Callable[[str], None]:
        seen = []

        def callback(chunk):
            if not seen:
                seen.append(chunk)
                with self._cond:
                    self._n += 1
                    self._cond.notify_all()
        return callback

    def wait(self, n: int, timeout: float = 120) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self._n >= n, timeout), f"only {self._n} of {n} streams started"


def during_streams(stream: Callable[[object, Callable[[str], None]], T], jobs: Sequence,
                   action: Callable[[], object], started: int | None = None) -> tuple[list[T], object]:
    """Run `stream(job, on_chunk)` for every job at once; when `started` of them (default: all)
    have streamed a chunk, call `action()`. Returns the streams' results in job order and what
    `action` returned."""
    first = FirstChunks()
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(stream, job, first.on_first_chunk()) for job in jobs]
        first.wait(len(jobs) if started is None else started)
        done = action()
        return [f.result() for f in futures], done


def scrape_metrics(url: str) -> dict[str, float]:
    """The server's specserve_* metrics: {name with labels: value}."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(specserve_\S+) (\S+)$", text, re.MULTILINE)}


def write_fault(fault_file: Path, text: str) -> None:
    """Replace the fault file whole: written in place, it is empty for a moment, and a drafter
    call reading it then runs without its fault (seen: every call of a loop slipping through)."""
    tmp = fault_file.with_name(fault_file.name + ".new")
    tmp.write_text(text)
    tmp.replace(fault_file)


class DrafterHold:
    """The fault hook's `hold` (specserve/serving/fault_injection.py) from the test's side: the
    engine stops inside its next drafter call, so what the test does meanwhile happens while the
    requests of that call are provably in flight, however fast they would otherwise finish.
    `next()` lets the held call go on and holds the one after it: every drafter call in between
    is held, whatever the load (a release followed by a new hold let busy-machine steps slip
    through unheld, and streams ended before the test had taken its steps)."""

    def __init__(self, fault_file: Path):
        self.file, self.marker = fault_file, fault_file.with_name(fault_file.name + ".held")
        self._last = 0     # the last call this test released

    def _say(self, text: str) -> None:
        write_fault(self.file, text)

    def hold(self) -> None:
        self._say("hold")

    def _held_call(self) -> int:
        """The number of the call held now, or 0 (none, or one this test already released)."""
        try:
            text = self.marker.read_text()
        except OSError:
            return 0
        n = int(text) if text.isdigit() else 0
        return n if n > self._last else 0

    def wait_held(self, futures: Sequence[Future], timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not self._held_call():
            assert not any(f.done() for f in futures), "a stream ended before the engine was held"
            assert time.monotonic() < deadline, "the engine made no drafter call to hold"
            time.sleep(0.05)

    def next(self) -> None:
        """Lets the held call go on; the engine's next drafter call holds (wait_held for it)."""
        n = self._held_call()
        assert n, "no drafter call is held"
        self._last = n
        self._say(f"released {n}")

    def release(self, timeout: float = 600) -> None:
        """Lets the held call go on and waits until it has; later calls run unheld."""
        self._say("")
        deadline = time.monotonic() + timeout
        while self.marker.exists():
            assert time.monotonic() < deadline, "the held drafter call did not go on"
            time.sleep(0.05)
