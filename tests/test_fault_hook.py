"""The drafter fault hook's hold (specserve/serving/fault_injection.py) with the test side's
DrafterHold (tests/streams.py): every drafter call between `hold()` and `release()` is held in
turn, so a test acts between consecutive calls with none slipping through unheld."""

from __future__ import annotations

import pytest

from specserve.serving import fault_injection
from streams import DrafterHold


class Counting:
    def __init__(self):
        self.done = 0

    def propose(self, requests):
        self.done += 1
        return [f"draft {self.done}"]


@pytest.fixture
def hooked(tmp_path, monkeypatch):
    fault = tmp_path / "fault"
    fault.write_text("")
    monkeypatch.setenv(fault_injection.FAULT_FILE_ENV, str(fault))
    proposer = Counting()
    fault_injection.inject({"eagle": proposer})
    return fault, proposer


def test_next_without_a_held_call_is_refused(hooked):
    fault, _ = hooked
    with pytest.raises(AssertionError, match="no drafter call is held"):
        DrafterHold(fault).next()


def test_raise_and_an_empty_file_keep_their_meaning(hooked):
    fault, proposer = hooked
    fault.write_text("raise")
    with pytest.raises(RuntimeError, match="injected drafter fault"):
        proposer.propose([])
    fault.write_text("")
    assert proposer.propose([]) == ["draft 1"]
