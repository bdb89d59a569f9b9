"""The drafter fault hook's hold (specserve/serving/fault_injection.py) with the test side's
DrafterHold (tests/streams.py): every drafter call between `hold()` and `release()` is held in
turn, so a test acts between consecutive calls with none slipping through unheld."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

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


@pytest.mark.parametrize("trial", range(10))   # a race shows in some trials, not every one
def test_each_call_is_held_until_the_test_lets_it_go(hooked, trial):
    fault, proposer = hooked
    hold = DrafterHold(fault)
    hold.hold()
    # The engine's loop: drafter calls one after another, as fast as it can. Its future ends
    # wait_held at once should a call slip through unheld (the fault file written in place was
    # empty for a moment, and a loop once ran all its calls through that moment).
    with ThreadPoolExecutor(1) as pool:
        loop = pool.submit(lambda: [proposer.propose([]) for _ in range(5)])
        try:
            for k in range(3):
                hold.wait_held([loop])
                assert proposer.done == k        # call k + 1 is held: none went on unheld
                hold.next()
            hold.wait_held([loop])
            assert proposer.done == 3
        finally:
            hold.release()
        assert loop.result(10) == [[f"draft {i}"] for i in range(1, 6)]
    assert not hold.marker.exists()


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
