"""The load-adaptive draft policy (issue 14): its arithmetic pinned on hand-made cost tables, and
the engine under it — lossless, drafting at batch 1 where a verify is cheap, not at all where it
is not."""

from __future__ import annotations

import pytest

from conftest import make_tiny_checkpoint
from specserve.core.draft_policy import AcceptanceModel, CostTable, DraftCost, choose, grid
from specserve.core.engine import Engine, EngineConfig, GenerationRequest
from specserve.model.transformer import load_model
from specserve.methods.ngram.proposer import NgramProposer
from specserve.core.sampling import SamplingParams

# A CPU-like table: at batch 1 width is nearly free; at batch 16 cost grows with every token.
TABLE = CostTable(batch_sizes=(1, 16), widths=(1, 5, 9),
                  seconds=((0.010, 0.012, 0.014), (0.020, 0.080, 0.160)))


def test_cost_table_interpolates_between_grid_points():
    assert TABLE.cost(1, 1) == 0.010 and TABLE.cost(16, 9) == 0.160
    assert TABLE.cost(1, 3) == pytest.approx(0.011)            # halfway between widths 1 and 5
    assert TABLE.cost(4, 1) == pytest.approx(0.010 + 0.010 * 3 / 15)
    assert TABLE.cost(16, 13) == pytest.approx(0.240)          # past the grid: the last segment goes on


def model(at_least, drafted_at_least):
    return AcceptanceModel(len(at_least), list(at_least), list(drafted_at_least))


def test_acceptance_model_learns_from_uncapped_rows():
    m = AcceptanceModel(4)
    assert m.at_least == pytest.approx([0.9, 0.81, 0.729, 0.6561]) and m.drafted_at_least == [1.0] * 4
    assert m.expected_tokens(2) == pytest.approx(2.71) and m.drafted_width(2) == 2.0
    # Uncapped (cap 4): one row accepted all 3 it drafted, the other none of 1.
    m.update(drafted=[3, 1], accepted=[3, 0], caps=[4, 4])
    w = 0.02
    assert m.at_least[0] == pytest.approx(0.9 + w * (1 - 0.9) + w * (0 - (0.9 + w * 0.1)))
    assert m.at_least[3] == pytest.approx(0.6561 * (1 - w) ** 2)   # nobody accepted a 4th token
    assert m.drafted_at_least == pytest.approx([1.0, 1 - w, 1 - w, (1 - w) ** 2])
    # A row capped at 1 tells nothing about positions 2..4.
    before = list(m.at_least)
    m.update(drafted=[1], accepted=[1], caps=[1])
    assert m.at_least[1:] == before[1:] and m.at_least[0] == pytest.approx(before[0] + w * (1 - before[0]))


def test_expected_width_is_the_widest_of_the_batch():
    m = model([0.5] * 4, [1.0, 0.5, 0.5, 0.0])       # drafts 1 or 3 tokens, half and half
    assert m.drafted_width(4, rows=1) == pytest.approx(2.0)
    assert m.drafted_width(4, rows=2) == pytest.approx(1 + 0.75 + 0.75)   # P(max >= i) = 1 - 0.5^2
    assert m.drafted_width(1, rows=16) == pytest.approx(1.0)


# A proposer whose own stopping rule drafts 4 or 8 tokens and gets most of the first 4 accepted.
CONFIDENT = model([0.95, 0.9, 0.85, 0.8, 0.3, 0.2, 0.1, 0.05], [1, 1, 1, 1, 0.4, 0.4, 0.4, 0.4])


def test_choice_drafts_long_when_verify_is_cheap_and_not_at_all_when_it_is_not():
    one = choose(TABLE, 1, [(CONFIDENT, 8)], [], draft_cost=lambda w: 0.0005 * w)
    # k = 6: 1 + 4.0 tokens; expected width 4 + 2 × 0.4 = 4.8, so c(1, 5.8) = 0.0124 s + 4.8 × 0.0005
    # (k = 8 adds 0.15 expected tokens for 0.8 more width: 5.15 / 0.0156 s is less)
    assert one.k == 6 and one.plain_goodput == 100.0
    assert one.goodput == pytest.approx(5.0 / (0.0124 + 0.0024))
    weak = model([0.3, 0.1, 0.05, 0.0], [1.0] * 4)
    busy = choose(TABLE, 16, [(weak, 4)] * 16, [], draft_cost=lambda w: 0.0005 * w)
    assert busy.k == 0 and busy.goodput == busy.plain_goodput == pytest.approx(16 / 0.020)
    # A fixed row that drafts 8 anyway makes width free for the adaptive rows.
    beside = choose(TABLE, 16, [(CONFIDENT, 8)], [(model([0.5] * 8, [1.0] * 8), 8)], draft_cost=lambda w: 0.0)
    assert beside.k == 8


def test_draft_cost_separates_the_fixed_part_of_a_call():
    c = DraftCost()
    assert c.seconds(3) == 0.0
    for w, t in [(1, 0.012), (4, 0.018), (8, 0.026), (2, 0.014)] * 5:   # 10 ms per call + 2 ms per position
        c.update(w, t)
    a, b = c.fit()
    assert a == pytest.approx(0.010) and b == pytest.approx(0.002)
    assert c.seconds(0) == 0.0 and c.seconds(5) == pytest.approx(0.020)
    one = DraftCost()
    one.update(8, 0.024)                    # a single width: all of it per position
    assert one.fit() == (0.0, pytest.approx(0.003))


def test_the_cost_table_is_monotone_whatever_the_noise():
    noise = iter([5, 3, 9, 2] * 10)   # seconds per call, in order: warm-up then 3 reps per point
    clock = {"t": 0.0}
    import specserve.core.draft_policy as dp

    def verify(b, t):
        clock["t"] += next(noise)

    real = dp.time.perf_counter
    dp.time.perf_counter = lambda: clock["t"]
    try:
        table = dp.profile(verify, (1, 2), (1, 2))
    finally:
        dp.time.perf_counter = real
    flat = [x for row in table.seconds for x in row]
    assert table.seconds[0][0] <= table.seconds[0][1] <= table.seconds[1][1]
    assert table.seconds[0][0] <= table.seconds[1][0] <= table.seconds[1][1] and min(flat) > 0


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
