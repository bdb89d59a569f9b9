"""A test hook: slow down or break the drafters of a running server from outside it.

With SPECSERVE_DRAFT_FAULT_FILE set in the server's environment, every drafter call first reads
that file: a number → sleep that many seconds (a drafter slowed by a busy machine); `raise` →
raise RuntimeError (a fused drafter's bug); `hold` → block, having written the call's number n
to `<file>.held` (so a test knows the engine is inside a drafter call with its requests in
flight, and acts on the server then: no race with how fast the requests finish); `released n`
→ call n goes on (its marker removed) and every later call holds in turn, so a test can act
between consecutive drafter calls with no call slipping through unheld however busy the
machine (tests/streams.py's DrafterHold.next); anything else ends the hold. Empty or missing →
nothing. A test rewrites the file to script its phases (tests/test_policy_recovery_triton.py).
Unset, nothing is wrapped.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from pathlib import Path
from typing import Mapping

FAULT_FILE_ENV = "SPECSERVE_DRAFT_FAULT_FILE"


def inject(proposers: Mapping[str, object]) -> None:
    """Wrap each drafter's `propose` (the instance attribute: the proposer is otherwise untouched)."""
    path = os.environ.get(FAULT_FILE_ENV)
    if not path:
        return
    for name, proposer in proposers.items():
        if name != "none" and hasattr(proposer, "propose"):
            proposer.propose = _faulty(proposer.propose, Path(path))


HOLD_POLL_S = 0.05     # how often a held call re-reads the file (a condition wait, not a timing bet)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


HOLD, RELEASED = "hold", "released"

# Drafter calls of this process, numbered as they hold (every wrapped proposer shares it).
_held_calls = itertools.count(1)


def _holds(fault: str, n: int) -> bool:
    """Whether call n stays held while the file says `fault`."""
    if fault == HOLD:
        return True
    word, _, last = fault.partition(" ")
    return word == RELEASED and last.isdigit() and int(last) < n


def _hold(path: Path) -> str:
    """Block while the file holds this call; → the fault to apply once it does not (none when
    the file released this call)."""
    n = next(_held_calls)
    held = path.with_name(path.name + ".held")
    tmp = held.with_name(held.name + f".{n}")
    tmp.write_text(str(n))
    tmp.replace(held)                  # whole: a reader sees no number or all of it
    while _holds(fault := _read(path), n):
        time.sleep(HOLD_POLL_S)
    if _read(held) == str(n):         # released: the test sees call n went on
        held.unlink(missing_ok=True)
    return "" if fault.startswith(RELEASED + " ") else fault


def _faulty(propose, path: Path):
    @functools.wraps(propose)
    def call(requests):
        fault = _read(path)
        if fault == HOLD or fault.startswith(RELEASED + " "):
            fault = _hold(path)
        if fault == "raise":
            raise RuntimeError(f"injected drafter fault ({FAULT_FILE_ENV})")
        if fault:
            time.sleep(float(fault))
        return propose(requests)
    return call
