"""The load-adaptive draft policy (issue 14): its arithmetic pinned on hand-made cost tables, and
the engine under it — lossless, drafting at batch 1 where a verify is cheap, not at all where it
is not."""

from __future__ import annotations

import pytest

from conftest import make_tiny_checkpoint
from specserve.draft_policy import AcceptanceModel, CostTable, choose, grid
from specserve.engine import Engine, EngineConfig, GenerationRequest
from specserve.model import load_model
from specserve.proposers.ngram import NgramProposer
from specserve.sampling import SamplingParams

# A CPU-like table: at batch 1 width is nearly free; at batch 16 cost grows with every token.
TABLE = CostTable(batch_sizes=(1, 16), widths=(1, 5, 9),
                  seconds=((0.010, 0.012, 0.014), (0.020, 0.080, 0.160)))


def test_cost_table_interpolates_between_grid_points():
    assert TABLE.cost(1, 1) == 0.010 and TABLE.cost(16, 9) == 0.160
    assert TABLE.cost(1, 3) == pytest.approx(0.011)            # halfway between widths 1 and 5
    assert TABLE.cost(4, 1) == pytest.approx(0.010 + 0.010 * 3 / 15)
    assert TABLE.cost(16, 13) == pytest.approx(0.240)          # past the grid: the last segment goes on


def model(at_least, width):
    return AcceptanceModel(len(at_least), list(at_least), width)


def test_acceptance_model_counts_uncapped_steps():
    m = AcceptanceModel(4)
    assert m.at_least == pytest.approx([0.6, 0.36, 0.216, 0.1296]) and m.width == 4.0
    assert m.expected_tokens(2) == pytest.approx(1.96) and m.drafted_width(2) == 2.0
    m.update(drafted=[3, 1], accepted=[3, 0])        # one row accepted all 3, the other none
    w = 0.02
    assert m.at_least[0] == pytest.approx(0.6 + w * (1 - 0.6) + w * (0 - (0.6 + w * 0.4)))
    assert m.at_least[3] == pytest.approx(0.1296 * (1 - w) ** 2)   # nobody accepted a 4th token
    assert m.width == pytest.approx(4 + w * (3 - 4))


# A proposer whose own stopping rule drafts ~5 tokens and gets 4 accepted most of the time.
CONFIDENT = model([0.95, 0.9, 0.85, 0.8, 0.3, 0.2, 0.1, 0.05], width=5.5)


def test_choice_drafts_long_when_verify_is_cheap_and_not_at_all_when_it_is_not():
    one = choose(TABLE, 1, [(CONFIDENT, 8)], [], draft_cost_per_token=0.0005)
    # k = 8: 1 + 4.15 tokens; the proposer drafts 5.5 wide, so c(1, 6.5) = 0.01275 s + 5.5 × 0.0005
    assert one.k == 8 and one.plain_goodput == 100.0
    assert one.goodput == pytest.approx(5.15 / 0.0155)
    # The same proposer under a cap: 4 tokens cap the tail it would have had
    assert choose(TABLE, 1, [(CONFIDENT, 4)], [], draft_cost_per_token=0.0005).k == 4
    weak = model([0.3, 0.1, 0.05, 0.0], width=4)
    busy = choose(TABLE, 16, [(weak, 4)] * 16, [], draft_cost_per_token=0.0005)
    assert busy.k == 0 and busy.goodput == busy.plain_goodput == pytest.approx(16 / 0.020)
    # A fixed row that drafts 8 anyway makes width free for the adaptive rows.
    beside = choose(TABLE, 16, [(CONFIDENT, 8)], [(CONFIDENT, 8)], draft_cost_per_token=0.0)
    assert beside.k == 8


def test_grid_covers_the_engine_limits():
    assert grid(16, 8) == ((1, 2, 4, 8, 16), (1, 2, 3, 5, 9))
    assert grid(6, 4) == ((1, 2, 4, 6), (1, 2, 3, 5))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("pol"), "llama", seed=6))


PROMPTS = [[11, 12, 13, 14, 11, 12, 13, 14, 11, 12], [5, 6, 5, 6, 5, 6, 5], [400, 3, 3, 3, 3, 3], [9, 8, 9, 8]]


def run(model, policy: str, table: CostTable | None = None):
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_model_len=128, max_draft_len=8, draft_policy=policy),
                    {"ngram": NgramProposer(num_draft_tokens=8)}, eos_token_ids=())
    if table is not None:
        engine.cost_table = table
    reqs = [GenerationRequest(str(i), p, SamplingParams(max_tokens=24), "ngram") for i, p in enumerate(PROMPTS)]
    return engine, engine.generate(reqs)


def test_the_engine_profiles_its_own_verify_costs(target):
    engine, _ = run(target, "adaptive")
    t = engine.cost_table
    assert (t.batch_sizes, t.widths) == ((1, 2, 4), (1, 2, 3, 5, 9))
    assert all(s > 0 for row in t.seconds for s in row)


def test_adaptive_policy_is_lossless_and_follows_the_cost_table(target):
    _, plain = run(target, "fixed")
    flat = CostTable((1, 4), (1, 9), ((0.01, 0.01), (0.01, 0.0101)))     # width costs nothing
    steep = CostTable((1, 4), (1, 9), ((0.01, 0.09), (0.04, 0.36)))      # width costs in proportion
    engine, cheap = run(target, "adaptive", flat)
    assert engine.last_policy_k is not None
    _, dear = run(target, "adaptive", steep)
    for rid, out in plain.items():
        assert cheap[rid].new_token_ids == out.new_token_ids == dear[rid].new_token_ids
    assert sum(o.stats.draft_tokens for o in cheap.values()) > 0
    assert sum(o.stats.draft_tokens for o in dear.values()) == 0     # never worth it: plain decoding
