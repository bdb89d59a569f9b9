"""A test hook: slow down or break the drafters of a running server from outside it.

With SPECSERVE_DRAFT_FAULT_FILE set in the server's environment, every drafter call first reads
that file: a number → sleep that many seconds (a drafter slowed by a busy machine); `raise` →
raise RuntimeError (a fused drafter's bug); empty or missing → nothing. A test rewrites the file
to script its phases (tests/test_policy_recovery_triton.py). Unset, nothing is wrapped.
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


def _faulty(propose, path: Path):
    @functools.wraps(propose)
    def call(requests):
        try:
            fault = path.read_text().strip()
        except OSError:
            fault = ""
        if fault == "raise":
            raise RuntimeError(f"injected drafter fault ({FAULT_FILE_ENV})")
        if fault:
            time.sleep(float(fault))
        return propose(requests)
    return call
