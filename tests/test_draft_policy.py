"""The load-adaptive draft policy (issue 14): its arithmetic pinned on hand-made cost tables, and
the engine under it — lossless, drafting at batch 1 where a verify is cheap, not at all where it
is not."""

from __future__ import annotations

import dataclasses
import itertools

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


# -- issue 25: the policy keeps learning while off, on noise-robust, same-condition costs ----------
from specserve.core.draft_policy import (COST_WINDOW, HYSTERESIS, PROBE_EVERY, RECOVERY_STEPS,  # noqa: E402
                                         DraftPolicy)
from specserve.core.proposer import Draft, ProposerDefaults, ProposerError  # noqa: E402


def simulate(policy: DraftPolicy, draft_seconds, steps: int, accept: int = 8, slowdown: float = 1.0):
    """`steps` single-row steps of a proposer drafting whatever the policy allows, each call
    costing draft_seconds(step) and each verify the table's cost × slowdown; the row accepts up to
    `accept` tokens. Returns each step's Decision."""
    out = []
    for i in range(steps):
        d = policy.decide(1, [("p", 8)], [])
        if d.k:
            policy.drafted("p", d.k, draft_seconds(i) * slowdown)
        policy.verified(1, 1 + d.k, TABLE.cost(1, 1 + d.k) * slowdown)
        if d.k:
            policy.accepted("p", [d.k], [min(accept, d.k)], [d.k])
        out.append(d)
    return out


def test_one_slow_call_does_not_flip_the_policy_a_burst_does_and_it_comes_back_within_the_bound():
    policy = DraftPolicy(TABLE, 8)
    assert all(d.k == 8 for d in simulate(policy, lambda i: 0.001, 20))
    # One call 100× dearer (a noisy neighbour for a moment): the median of the window ignores it.
    assert all(d.k == 8 for d in simulate(policy, lambda i: 0.1 if i == 0 else 0.001, 10))
    # A burst: every call 200 ms against a 10 ms plain step. Off once most of the window is slow.
    burst = simulate(policy, lambda i: 0.2, 60)
    first_off = next(i for i, d in enumerate(burst) if d.k == 0)
    assert first_off == COST_WINDOW // 2 + 1 and not policy.on
    off = burst[first_off:]
    # While off it still drafts now and then, at most one step in PROBE_EVERY (probes).
    probes = [i for i, d in enumerate(off) if d.k]
    assert all(off[i].probe for i in probes) and len(probes) == len(off) // PROBE_EVERY
    assert policy.estimates()["p"].draft_cost_vs_start > 50      # visible: drafting looks 200× dearer
    # The burst ends: back on within the stated bound, and it stays on.
    after = simulate(policy, lambda i: 0.001, RECOVERY_STEPS + 20)
    back = next(i for i, d in enumerate(after) if d.k and not d.probe)
    assert back < RECOVERY_STEPS and all(d.k == 8 and not d.probe for d in after[back:])
    assert policy.estimates()["p"].draft_cost_vs_start == pytest.approx(1.0)


def test_contention_that_slows_verify_and_drafter_alike_changes_nothing():
    """Costs are compared in the same conditions: a drafter call half a plain step long stays
    half a step long when a neighbour makes everything 20× slower."""
    policy = DraftPolicy(TABLE, 8)
    simulate(policy, lambda i: 0.005, 20, accept=3)
    busy = simulate(policy, lambda i: 0.005, 40, accept=3, slowdown=20.0)
    assert all(d.k > 0 and not d.probe for d in busy) and policy.on
    assert policy.verify_slowdown == pytest.approx(20.0)


def test_hysteresis_holds_the_state_inside_the_band():
    policy = DraftPolicy(CostTable((1,), (1, 9), ((0.010, 0.010),)), 8)
    # Acceptance none at all: k ≥ 1 only costs the drafting → off; the band keeps it off at a 5 % gain.
    simulate(policy, lambda i: 0.001, 400, accept=0)
    assert not policy.on
    m = policy.acceptance("p")
    m.at_least = [0.08] + [0.0] * 7   # 1.08 tokens per 10.1 ms vs 1 per 10 ms: 7 % faster
    d = policy.decide(1, [("p", 8)], [])
    assert 1.0 < d.gain < 1.0 + HYSTERESIS and not policy.on


def test_probes_are_not_spent_where_the_verify_table_alone_rules_drafting_out():
    steep = CostTable((1,), (1, 9), ((0.01, 0.09),))       # every drafted token costs a full step
    policy = DraftPolicy(steep, 8)
    assert all(d.k == 0 and not d.probe for d in simulate(policy, lambda i: 0.0, 5 * PROBE_EVERY))


# In process through the engine, with the cost clock injected: the target's forwards and the
# drafter's calls advance it by scripted amounts, so nothing depends on this machine's load.
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class TimedTarget:
    """The target model, each forward charged to the clock at TABLE's cost × slowdown."""

    def __init__(self, model, clock: Clock):
        self._model, self._clock, self.slowdown = model, clock, 1.0

    def forward(self, batch, cache, **kw):
        b, t = batch.tokens.shape
        self._clock.t += TABLE.cost(b, t) * self.slowdown
        return self._model.forward(batch, cache, **kw)

    def __getattr__(self, name):
        return getattr(self._model, name)


class OracleDrafter(ProposerDefaults):
    """Drafts the target's own greedy continuation (known from a plain run); each call costs
    `seconds` on the clock, or raises `error` when set."""
    name, needs_features = "oracle", False

    def __init__(self, want: list[int], clock: Clock):
        self.want, self._clock, self.seconds, self.error = want, clock, 0.001, None

    def propose(self, requests):
        if self.error is not None:
            raise self.error
        self._clock.t += self.seconds
        return [Draft.chain(self.want[len(r.token_ids):len(r.token_ids) + r.max_draft_len]) for r in requests]

    def observe(self, outcomes):
        pass

    def release(self, seq_id):
        pass


PROMPT = [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]


def oracle_engine(target):
    clock = Clock()
    model = TimedTarget(target, clock)
    plain = Engine(target, EngineConfig(max_num_seqs=1, max_model_len=512, max_draft_len=8), eos_token_ids=())
    want = PROMPT + plain.generate([GenerationRequest("p", PROMPT, SamplingParams(max_tokens=480))])["p"].new_token_ids
    drafter = OracleDrafter(want, clock)
    engine = Engine(model, EngineConfig(max_num_seqs=1, max_model_len=512, max_draft_len=8, draft_policy="adaptive"),
                    {"oracle": drafter}, eos_token_ids=(), clock=clock)
    engine.submit(GenerationRequest("r", PROMPT, SamplingParams(max_tokens=480), "oracle"))
    engine.want = want
    return engine, drafter, model


def steps(engine, n: int) -> list[int]:
    """n engine steps → the policy's cap at each; the request keeps running, losslessly."""
    caps = []
    for _ in range(n):
        assert not any(o.finished for o in engine.step())
        caps.append(engine.last_policy_k)
    seq = engine._by_id["r"]
    assert seq.tokens == engine.want[:len(seq.tokens)]    # greedy: exactly the plain output
    return caps


def test_engine_a_burst_of_slow_drafter_calls_turns_drafting_off_and_it_comes_back_within_the_bound(target):
    engine, drafter, _ = oracle_engine(target)
    # The profile ran on the injected clock too: the engine measured exactly TABLE's costs.
    assert engine.cost_table.cost(1, 9) == pytest.approx(TABLE.cost(1, 9))
    engine.step()   # prefill
    assert steps(engine, 12) == [8] * 12
    drafter.seconds = 0.2                         # the burst: a drafter call = 20 plain steps
    burst = steps(engine, 30)
    half = COST_WINDOW // 2
    assert burst[:half + 1] == [8] * (half + 1) and burst[half + 1] == 0   # off once most of the window is slow
    assert 0 < sum(k > 0 for k in burst[half + 1:]) <= 30 // PROBE_EVERY   # while off: probes only
    st = engine._by_id["r"].stats
    assert st.policy_last["draft_cost_vs_start"] > 50 and st.policy_last["estimated_gain"] < 1
    drafter.seconds = 0.001                       # quiet again
    after = steps(engine, RECOVERY_STEPS + 5)
    back = min(i for i in range(len(after)) if all(k == 8 for k in after[i:]))
    assert back <= RECOVERY_STEPS
    assert st.policy_off_steps > 0 and 0 < st.policy_probe_steps <= (30 + RECOVERY_STEPS) // PROBE_EVERY
    assert st.policy_last["k"] == 8 and st.policy_last["estimated_gain"] > 1 + HYSTERESIS
    assert st.policy_capped_steps >= st.policy_off_steps
    assert st.to_dict()["policy"] == {"capped_steps": st.policy_capped_steps, "off_steps": st.policy_off_steps,
                                      "probe_steps": st.policy_probe_steps, "last": st.policy_last}


@pytest.mark.parametrize("error", [ProposerError("drafter unloaded"), RuntimeError("a fused drafter raised")])
def test_engine_drafts_again_at_once_after_the_drafter_failed_for_a_while(target, error):
    """Failed calls say nothing about acceptance or cost: 150 of them (the acceptance estimates
    used to decay to 0 from them, switching drafting off for good) change no estimate."""
    engine, drafter, _ = oracle_engine(target)
    engine.step()
    steps(engine, 12)
    estimates = lambda: dataclasses.replace(engine.policy.estimates()["oracle"], gain=None)  # noqa: E731
    before = estimates()
    drafter.error = error
    assert steps(engine, 150) == [8] * 150
    assert estimates() == before and engine._by_id["r"].stats.proposer_errors == 150
    drafter.error = None
    drafted = engine._by_id["r"].stats.draft_tokens
    assert steps(engine, 3) == [8] * 3 and engine._by_id["r"].stats.draft_tokens >= drafted + 3


def test_engine_contention_on_target_and_drafter_alike_keeps_drafting(target):
    engine, drafter, model = oracle_engine(target)
    drafter.seconds = 0.005                       # half a plain step
    engine.step()
    steps(engine, 12)
    model.slowdown, drafter.seconds = 20.0, 0.1   # a neighbour makes everything 20× slower
    assert steps(engine, 30) == [8] * 30
    assert engine._by_id["r"].stats.policy_last["verify_slowdown"] == pytest.approx(20.0)


# -- a static step (DSPark): drafting inside the step, its cost the part the table does not explain --
def test_a_static_steps_drafting_is_what_the_verify_table_does_not_explain():
    """Steps of widths 1 and 2 that cost the table's verify + (1 ms + 2 ms per drafted token):
    the fitted draft cost is that line (17 ms at the full width 8), also when every step runs
    twice as slow as the table under contention the dynamic verifies measured."""
    for slowdown in (1.0, 2.0):
        policy = DraftPolicy(TABLE, 8)
        if slowdown != 1.0:
            policy.verified(1, 1, TABLE.cost(1, 1) * slowdown)
        for i in range(COST_WINDOW):
            w = 1 + i % 2
            policy.static_step("d", 1, w, (TABLE.cost(1, 1 + w) + 0.001 + 0.002 * w) * slowdown)
        assert policy.estimates()["d"].draft_ms == pytest.approx(17.0)
    policy.static_step("d", 1, 0, 1.0)   # width 0: no drafting, nothing to learn
    assert policy.estimates()["d"].draft_ms == pytest.approx(17.0)


def _dspark_engine(model, table: CostTable):
    from specserve.methods.dspark.proposer import DSParkProposer
    from test_eagle import random_drafter

    kw = dict(max_num_seqs=4, max_model_len=128, max_draft_len=5)
    # A clock that moves 1 ms a reading: the steps' measured times, from which the policy fits
    # the drafting cost, are then the same on a quiet and a loaded machine (with the wall clock a
    # loaded run once measured drafting dear under the flat table and turned it off).
    ticks = itertools.count()
    engine = Engine(model, EngineConfig(draft_policy="adaptive", **kw),
                    {"dspark": DSParkProposer(random_drafter(model, seed=1), model, threshold=None, **kw)},
                    eos_token_ids=(), clock=lambda: next(ticks) * 0.001)
    engine.cost_table = table
    return engine


def test_dspark_follows_the_adaptive_policy_off_where_width_is_dear(target):
    """Under a table where every drafted token costs a full step, dspark runs its width-0 step
    (no token drafted) after the optimistic start, with the plain tokens; under a flat table it
    drafts on most steps. A fixed-policy request on the same engine keeps drafting."""
    prompts = [GenerationRequest(str(i), p, SamplingParams(max_tokens=24), "dspark") for i, p in enumerate(PROMPTS)]
    plain = Engine(target, EngineConfig(max_num_seqs=4, max_model_len=128), {}, eos_token_ids=()).generate(
        [dataclasses.replace(r, method="none") for r in prompts])
    steep = CostTable((1, 4), (1, 9), ((0.01, 0.09), (0.04, 0.36)))
    flat = CostTable((1, 4), (1, 9), ((0.01, 0.01), (0.01, 0.0101)))
    dear = _dspark_engine(target, steep).generate(prompts)
    cheap = _dspark_engine(target, flat).generate(prompts)
    for rid, out in plain.items():
        assert dear[rid].new_token_ids == out.new_token_ids == cheap[rid].new_token_ids, rid
    # the optimistic prior drafts the first steps; then off, with a probe every PROBE_EVERY steps
    off = [o.stats.policy_off_steps for o in dear.values()]
    assert all(n > 0 for n in off) and sum(o.stats.drafts for o in dear.values()) < sum(o.stats.steps for o in dear.values()) / 2
    assert sum(o.stats.policy_off_steps for o in cheap.values()) == 0
    assert sum(o.stats.drafts for o in cheap.values()) > 0
    fixed = _dspark_engine(target, steep).generate([dataclasses.replace(prompts[0], draft_policy="fixed")])["0"]
    assert fixed.new_token_ids == plain["0"].new_token_ids and fixed.stats.policy_off_steps == 0
    assert fixed.stats.drafts >= fixed.stats.steps - 1   # all but a last step with no room left
