"""A test hook: slow down or break the drafters of a running server from outside it.

With SPECSERVE_DRAFT_FAULT_FILE set in the server's environment, every drafter call first reads
that file: a number → sleep that many seconds (a drafter slowed by a busy machine); `raise` →
raise RuntimeError (a fused drafter's bug); `hold` → block until the file says something else,
having created `<file>.held` (so a test knows the engine is inside a drafter call with its
requests in flight, and acts on the server then: no race with how fast the requests finish),
which the call removes once released (so the test knows it went on before holding the next);
empty or missing → nothing. A test rewrites the file to script its phases
(tests/test_policy_recovery_triton.py). Unset, nothing is wrapped.
"""

from __future__ import annotations

import functools
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


def _faulty(propose, path: Path):
    @functools.wraps(propose)
    def call(requests):
        fault = _read(path)
        if fault == "hold":
            held = path.with_name(path.name + ".held")
            held.touch()
            while (fault := _read(path)) == "hold":
                time.sleep(HOLD_POLL_S)
            held.unlink(missing_ok=True)   # released: a test may hold the next call now
        if fault == "raise":
            raise RuntimeError(f"injected drafter fault ({FAULT_FILE_ENV})")
        if fault:
            time.sleep(float(fault))
        return propose(requests)
    return call
