"""cli/bench/tally.py: the sums every request-by-request benchmark keeps, and what they mean."""

from types import SimpleNamespace

from specserve.cli.bench.tally import SpecTally


def test_figures_of_two_requests():
    t = SpecTally()
    t.add(seconds=2.0, ttft=0.5, output="a", tokens=30,
          stats={"steps": 10, "accepted_tokens": 20, "draft_tokens": 40, "draft_seconds": 0.2, "verify_seconds": 1.0})
    stats = SimpleNamespace(steps=10, accepted_tokens=0, draft_tokens=0, draft_seconds=0.0, verify_seconds=0.5)
    t.add_engine(SimpleNamespace(new_token_ids=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10), stats=stats), 2.0)
    assert (t.requests, t.tokens, t.steps, t.accepted, t.drafted) == (2, 40, 20, 20, 40)
    assert t.outputs == ["a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    assert t.acceptance_length == 2.0          # (20 accepted + 20 steps) / 20 steps
    assert t.drafted_per_step == 2.0 and t.verified_per_step == 3.0 and t.acceptance_rate == 0.5
    assert t.tokens_per_s == 10.0 and t.ms_per_step(t.verify_s) == 75.0 and t.ttft == 0.5


def test_an_empty_tally_divides_by_nothing():
    t = SpecTally()
    assert t.acceptance_length == 0.0 and t.acceptance_rate == 0.0 and t.tokens_per_s is None
