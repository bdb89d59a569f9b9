"""MTP multi-draft: the arbiter pinned on hand-made candidates, the fused `mtp` method lossless
(greedy equal to plain decoding, sampled following the target, with a broken sibling residual
shown to fail), sub-proposer failures and rollback, per-request options."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_served_checkpoint, make_tiny_checkpoint
from specserve.core import verify
from specserve.core.engine import Engine, EngineConfig, GenerationRequest, RequestRejected
from specserve.model.transformer import load_model
from specserve.methods.mtp.arbiter import ArbiterConfig, Candidate, arbitrate, score_candidates
from specserve.core.proposer import Draft, ProposerDefaults, ProposerError, StepOutcome
from specserve.methods.eagle.proposer import EagleProposer
from specserve.methods.mtp.proposer import (MultiDraftProposer, candidates_of, map_nodes, member_features,
                                            sub_outcome)
from specserve.methods.ngram.proposer import NgramProposer
from specserve.core.sampling import SamplingParams
from specserve.serving.params import BadRequest, make_request_config
from test_eagle import PROMPTS, random_drafter, two_token_joint_tv

ROOT = Path(__file__).resolve().parents[1]


# -- the arbiter ------------------------------------------------------------------------------------
def C(p, toks, lps):
    return Candidate(p, tuple(toks), tuple(lps))


def test_arbiter_worked_example_tree_sources_and_values():
    """The module docstring's example: shared prefix merged, agreement credited, ngram's prior."""
    cands = [C("eagle", [5, 6, 7], [-0.1, -0.2, -2.0]), C("ngram", [5, 6, 9], [-1, -1, -1])]
    assert score_candidates(cands, bonus=1.0) == [-2.0, -1.0]
    r = arbitrate(cands, ArbiterConfig(budget=16))
    assert r.draft.tokens == [5, 6, 9, 7] and r.draft.parents == [-1, 0, 1, 1] and r.draft.probs is None
    assert r.draft.sources == [("eagle", "ngram"), ("eagle", "ngram"), ("ngram",), ("eagle",)]
    assert r.values == [0.0, 0.0, -1.0, -2.0]
    assert [c.proposer for c in r.kept] == ["ngram", "eagle"] and r.scores == [-1.0, -2.0]
    cut = arbitrate(cands, ArbiterConfig(budget=3))
    assert (cut.draft.tokens, cut.draft.parents) == ([5, 6, 9], [-1, 0, 1])


def test_arbiter_budget_keeps_the_best_nodes_without_orphans():
    """Three proposers: a confident chain, a weak chain, and one agreeing with the first's prefix.
    Each cut keeps the N best nodes, and every kept node's parent is kept."""
    cands = [C("mtp_heads", [1, 2, 3, 4], [-0.1, -0.1, -0.3, -0.5]),
             C("eagle", [1, 2, 8], [-0.2, -0.4, -0.2]),
             C("ngram", [7, 7, 7], [-1, -1, -1])]
    full = arbitrate(cands, ArbiterConfig(budget=16))
    # eagle's candidate scores best (-0.2: [1 2] agreed on, then -0.2), so its nodes come first
    assert [c.proposer for c in full.kept] == ["eagle", "mtp_heads", "ngram"]
    assert full.scores == pytest.approx([-0.2, -0.8, -3.0])
    assert full.draft.tokens == [1, 2, 8, 3, 4, 7, 7, 7]
    assert full.draft.parents == [-1, 0, 1, 1, 3, -1, 5, 6]
    assert full.values == pytest.approx([0.0, 0.0, -0.2, -0.3, -0.8, -1.0, -2.0, -3.0])
    want = {1: [1], 2: [1, 2], 3: [1, 2, 8], 4: [1, 2, 8, 3], 5: [1, 2, 8, 3, 4], 6: [1, 2, 8, 3, 4, 7]}
    for n, tokens in want.items():
        d = arbitrate(cands, ArbiterConfig(budget=n)).draft
        assert d.tokens == tokens, n
        assert all(p < i for i, p in enumerate(d.parents))
        d.check()
    assert arbitrate(cands, ArbiterConfig(budget=0)).draft.tokens == []


def test_arbiter_keeps_the_best_few_and_breaks_ties_by_proposer_order():
    cands = [C("ngram", [4], [-1.0]), C("eagle", [5], [-1.0]), C("mtp_heads", [6], [-0.5]), C("draft", [9], [-3.0])]
    r = arbitrate(cands, ArbiterConfig(keep=3), order=["mtp_heads", "eagle", "draft", "ngram"])
    # equal scores: eagle before ngram (configured order); draft (worst) is not kept
    assert [c.proposer for c in r.kept] == ["mtp_heads", "eagle", "ngram"]
    assert r.draft.tokens == [6, 5, 4] and r.draft.parents == [-1, -1, -1]
    again = arbitrate(list(reversed(cands)), ArbiterConfig(keep=3), order=["mtp_heads", "eagle", "draft", "ngram"])
    assert again.draft.tokens == r.draft.tokens   # deterministic whatever the input order


def test_agreement_outranks_a_lone_confident_candidate():
    """Two weak proposers agreeing on [3, 4] beat one confident proposer's [8, 9]."""
    cands = [C("eagle", [8, 9], [-0.4, -0.4]), C("ngram", [3, 4], [-1, -1]), C("draft", [3, 4], [-0.9, -0.9])]
    r = arbitrate(cands, ArbiterConfig(budget=2, bonus=1.0))
    assert r.draft.tokens == [3, 4] and r.draft.sources == [("draft", "ngram"), ("draft", "ngram")]
    lone = arbitrate(cands, ArbiterConfig(budget=2, bonus=0.0))
    assert lone.draft.tokens == [8, 9]


def test_sub_draft_paths_logprobs_and_outcome_translation():
    tree = Draft([10, 11, 12, 13], [-1, 0, 0, 2], logprobs=[-0.1, -0.2, -0.3, -0.4])
    assert candidates_of("mtp_heads", tree, prior=-1.0) == [
        C("mtp_heads", [10, 11], [-0.1, -0.2]), C("mtp_heads", [10, 12, 13], [-0.1, -0.3, -0.4])]
    probs = torch.zeros(2, 16)
    probs[0, 3], probs[1, 4] = 0.5, 0.25
    got = candidates_of("eagle", Draft.chain([3, 4], probs), prior=-1.0)[0]
    assert got.logprobs == pytest.approx((-0.6931, -1.3863), abs=1e-4)
    assert candidates_of("ngram", Draft.chain([1, 2]), prior=-0.7)[0].logprobs == (-0.7, -0.7)

    merged = Draft([10, 12, 5, 13], [-1, 0, -1, 1])
    where = map_nodes(tree, merged)
    assert where == [0, None, 1, 3]
    out = sub_outcome(7, tree, where, StepOutcome(7, 4, [0, 1, 3], [10, 12, 13, 2]))
    assert (out.num_drafted, out.accepted_nodes, out.emitted) == (4, [0, 2, 3], [10, 12, 13, 2])
    other = sub_outcome(7, tree, where, StepOutcome(7, 4, [2], [5, 1]))
    assert other.accepted_nodes == []


# -- the fused method through the engine -----------------------------------------------------------
@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("t"), "llama", seed=21)


class Fixed(ProposerDefaults):
    """A scripted sub-proposer drafting a fixed chain (recording what it was told)."""
    needs_features = False

    def __init__(self, name, tokens, logprob=-0.5, fail_on=()):
        self.name, self.tokens, self.logprob, self.fail_on = name, tokens, logprob, set(fail_on)
        self.calls, self.outcomes, self.released = 0, [], []

    def propose(self, requests):
        self.calls += 1
        if self.calls in self.fail_on:
            raise ProposerError(f"{self.name} is down")
        return [Draft.chain(self.tokens[:r.max_draft_len], logprobs=[self.logprob] * min(len(self.tokens), r.max_draft_len))
                for r in requests]

    def observe(self, outcomes):
        self.outcomes += outcomes

    def release(self, seq_id):
        self.released.append(seq_id)


class Flaky(ProposerDefaults):
    """Wraps a proposer; its `fail_on`-th calls raise ProposerError (like a remote drafter down)."""

    def __init__(self, inner, fail_on):
        self.inner, self.fail_on, self.calls = inner, set(fail_on), 0
        self.name, self.needs_features = inner.name, inner.needs_features

    def propose(self, requests):
        self.calls += 1
        if self.calls in self.fail_on:
            raise ProposerError("down for this step")
        return self.inner.propose(requests)

    def observe(self, outcomes):
        self.inner.observe(outcomes)

    def release(self, seq_id):
        self.inner.release(seq_id)


def mtp_engine(target, subs, *, max_draft_len=8, max_num_seqs=4, budget=16):
    mtp = MultiDraftProposer(subs, max_draft_len=max_draft_len, arbiter=ArbiterConfig(budget=budget),
                             vocab_size=target.cfg.vocab_size)
    return Engine(target, EngineConfig(max_num_seqs=max_num_seqs, max_model_len=256, max_draft_len=max_draft_len),
                  {"mtp": mtp}, eos_token_ids=())


def eagle(target, seed=1, max_num_seqs=4, max_draft_len=8):
    return EagleProposer(random_drafter(target, seed=seed), target, max_num_seqs=max_num_seqs, max_model_len=256,
                         max_draft_len=max_draft_len, threshold=None)


def reqs(method, n=20, **kw):
    return [GenerationRequest(f"{method}{i}", p, SamplingParams(max_tokens=n), method, **kw) for i, p in enumerate(PROMPTS)]


def test_greedy_mtp_equals_plain_decoding_and_credits_proposers(target_path):
    target = load_model(target_path)
    plain = {k[4:]: o for k, o in mtp_engine(target, [NgramProposer()]).generate(reqs("none")).items()}
    # A "draft" sub that always guesses the first prompt's continuation: accepted only there.
    want0 = plain["0"].new_token_ids
    guess = Fixed("draft", want0[1:6])
    engine = mtp_engine(target, [eagle(target), NgramProposer(), guess])
    spec = engine.generate(reqs("mtp"))
    for i in range(len(PROMPTS)):
        assert spec[f"mtp{i}"].new_token_ids == plain[str(i)].new_token_ids, i
    s0 = spec["mtp0"].stats
    assert s0.steps < 20 - 4 and s0.accepted_by_proposer["draft"] >= 4   # its guess was taken in one step
    for o in spec.values():
        st = o.stats
        assert set(st.accepted_by_proposer) <= {"eagle", "ngram", "draft"} and not st.proposer_skipped
        # every accepted token was drafted by at least one proposer; none is credited twice by one
        assert max(st.accepted_by_proposer.values(), default=0) <= st.accepted_tokens
        assert sum(st.accepted_by_proposer.values()) >= st.accepted_tokens
        assert st.to_dict()["accepted_by_proposer"] == st.accepted_by_proposer
    assert engine.num_free_slots == 4 and engine.proposers["mtp"].subs["eagle"].cache.num_free == 4
    assert sorted(guess.released) == sorted(range(len(PROMPTS)))


def test_a_failing_sub_proposer_is_left_out_and_keeps_its_features(target_path):
    """EAGLE fails on its 2nd and 3rd calls: those steps go on with ngram, are counted, and EAGLE
    gets the features it missed with its next call (no re-prime error after)."""
    target = load_model(target_path)
    prompt = PROMPTS[0]
    plain = mtp_engine(target, [NgramProposer()]).generate([GenerationRequest("a", prompt, SamplingParams(max_tokens=24), "none")])
    flaky = Flaky(eagle(target), fail_on=(2, 3))
    engine = mtp_engine(target, [flaky, NgramProposer()])
    out = engine.generate([GenerationRequest("a", prompt, SamplingParams(max_tokens=24), "mtp")])["a"]
    assert out.new_token_ids == plain["a"].new_token_ids
    assert out.stats.proposer_skipped == {"eagle": 2} and out.stats.proposer_errors == 0
    assert flaky.calls >= 5 and out.stats.to_dict()["proposer_skipped"] == {"eagle": 2}


def test_each_sub_proposer_observes_its_own_accepted_prefix(target_path):
    target = load_model(target_path)
    prompt = [5, 17, 99, 3]
    want = mtp_engine(target, [NgramProposer()]).generate(
        [GenerationRequest("a", prompt, SamplingParams(max_tokens=8), "none")])["a"].new_token_ids
    right = Fixed("draft", want[1:4], logprob=-0.1)          # drafted after the first token: all right
    wrong = Fixed("mtp_heads", [want[1], (want[2] + 1) % 512], logprob=-0.2)   # right, then wrong
    engine = mtp_engine(target, [right, wrong])
    engine.submit(GenerationRequest("a", prompt, SamplingParams(max_tokens=8), "mtp"))
    engine.step()   # prefill
    engine.step()   # the first decode step verifies the merged tree
    (r,), (w,) = right.outcomes, wrong.outcomes
    assert (r.num_drafted, r.accepted_nodes) == (3, [0, 1, 2])
    assert (w.num_drafted, w.accepted_nodes) == (2, [0])
    assert r.emitted == w.emitted == want[1:5]


# -- an EAGLE-3 member: mtp forwards the target layers it reads ----------------------------------------
def test_member_features_take_the_final_hidden_state_and_the_members_layers():
    D = 2
    feats = torch.arange(2 * 4 * D).view(2, 4 * D)   # per token: final, layer 0, layer 1, layer 3
    assert member_features(feats, (0, 1, 3), (3,)).tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert member_features(feats, (0, 1, 3), ()).tolist() == [[0, 1], [8, 9]]
    assert member_features(feats, (0, 1, 3), (3, 0)).tolist() == [[0, 1, 6, 7, 2, 3], [8, 9, 14, 15, 10, 11]]
    assert member_features(feats, (0, 1, 3), (0, 1, 3)) is feats


def test_fused_mtp_with_an_eagle3_member_equals_plain_decoding(tmp_path):
    """mtp's builder takes an EAGLE-3 drafter as its EAGLE member (fused placement): mtp names its
    layers, the engine keeps them, EAGLE gets [n, 4D] and the MTP heads [n, D] per token; greedy
    output equals plain decoding, and EAGLE's drafts are accepted (its features are right)."""
    from specserve.methods.mtp import spec as mtp_spec
    from specserve.methods.mtp.heads import MTPConfig, MTPHeads, _target_fields, save_mtp_heads
    from specserve.methods.registry import BuildContext
    from test_eagle3 import LAYERS, fitted_eagle3

    target = load_model(make_tiny_checkpoint(tmp_path / "t", "llama", seed=21, num_hidden_layers=LAYERS))
    plain = mtp_engine(target, [NgramProposer()]).generate(reqs("none", 24))
    drafter = fitted_eagle3(target, [p + plain[f"none{i}"].new_token_ids for i, p in enumerate(PROMPTS)], 128)
    e3 = EagleProposer(drafter, target, max_num_seqs=4, max_model_len=256, max_draft_len=8, threshold=None)
    save_mtp_heads(MTPHeads(MTPConfig(**{**_target_fields(target), "num_heads": 3, "intermediate_size": 16}),
                            target.lm_head.weight), tmp_path / "mtp")
    ctx = BuildContext(model=target, checkpoint=tmp_path / "t", folder=str(tmp_path / "mtp"),
                       drafters=(("eagle", "e3"), ("mtp", str(tmp_path / "mtp"))),
                       built={"eagle": e3, "ngram": NgramProposer()}, max_num_seqs=4, max_model_len=256,
                       max_draft_len=8, spec_threshold=None, drafter_dtype=torch.float32, block_size=None,
                       placement="fused", remote=None, remote_timeout_s=1.0)
    mtp = mtp_spec.build(ctx)
    assert mtp.feature_layers == (0, 1, 3) and set(mtp.subs) == {"eagle", "ngram", "mtp_heads"}
    engine = Engine(target, EngineConfig(max_num_seqs=4, max_model_len=256, max_draft_len=8), {"mtp": mtp},
                    eos_token_ids=())
    spec = engine.generate(reqs("mtp", 24))
    for i in range(len(PROMPTS)):
        assert spec[f"mtp{i}"].new_token_ids == plain[f"none{i}"].new_token_ids, i
        assert not spec[f"mtp{i}"].stats.proposer_skipped   # a wrong feature width would skip EAGLE
    assert sum(o.stats.accepted_by_proposer.get("eagle", 0) for o in spec.values()) > 0
    # EAGLE alone in mtp drafts what the eagle method drafts with the same drafter: its tree is
    # that chain, so the acceptance is the same, request by request (wrong columns would differ).
    alone = engine.generate(reqs("mtp", 24, options={"mtp_proposers": ["eagle"]}))
    direct = Engine(target, EngineConfig(max_num_seqs=4, max_model_len=256, max_draft_len=8),
                    {"eagle": EagleProposer(drafter, target, max_num_seqs=4, max_model_len=256, max_draft_len=8,
                                            threshold=None)}, eos_token_ids=()).generate(reqs("eagle", 24))
    for i in range(len(PROMPTS)):
        assert alone[f"mtp{i}"].new_token_ids == plain[f"none{i}"].new_token_ids, i
        assert alone[f"mtp{i}"].stats.accepted_tokens == direct[f"eagle{i}"].stats.accepted_tokens > 0, i
    assert engine.num_free_slots == 4 and e3.cache.num_free == 4


# -- sampled output is exact; a broken sibling residual is not -----------------------------------------
def _sibling_engine(target):
    """Two subs drafting the target's two likeliest second tokens as root siblings (every step)."""
    from specserve.core.sampling import target_probs
    sp = SamplingParams(temperature=1.0, top_k=6)
    with torch.inference_mode():
        p1 = target_probs(target.score(torch.tensor([[1, 3, 5]]))[0, -1:], sp)[0]
        first = int(p1.argmax())
        p2 = target_probs(target.score(torch.tensor([[1, 3, 5, first]]))[0, -1:], sp)[0]
    a, b = p2.topk(2).indices.tolist()
    subs = [Fixed("mtp_heads", [a], logprob=-0.1), Fixed("draft", [b], logprob=-0.2)]
    return mtp_engine(target, subs, max_draft_len=2, max_num_seqs=64)


def _broken_residual(p, x, q):
    return p   # the next sibling and the recovered token are checked against p itself


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "broken-sibling-residual"])
def test_sampled_mtp_follows_target_distribution(tmp_path, monkeypatch, broken):
    """The joint of tokens 2 and 3 against the exact target joint (test_eagle's helper); the first
    decode step verifies a tree with two point-mass root siblings. Skipping the residual update
    between siblings must fail this same check."""
    target = load_model(make_tiny_checkpoint(tmp_path / "small", "llama", vocab_size=8, seed=5))
    if broken:
        monkeypatch.setattr(verify, "sibling_residual", _broken_residual)
    tv = two_token_joint_tv(target, _sibling_engine(target), "mtp")
    if broken:
        assert tv > 0.1, f"the broken variant went unnoticed: total variation {tv:.4f}"
    else:
        assert tv < 0.06, f"total variation {tv:.4f}"


# -- per-request options ----------------------------------------------------------------------------
def test_request_options_pick_proposers_and_budget(target_path):
    target = load_model(target_path)
    engine = mtp_engine(target, [eagle(target), NgramProposer()], max_draft_len=8)
    plain = engine.generate(reqs("none"))
    only = engine.generate(reqs("mtp", options={"mtp_proposers": ["ngram"]}))
    small = engine.generate(reqs("mtp", options={"mtp_tree_budget": 2}))
    for i in range(len(PROMPTS)):
        assert only[f"mtp{i}"].new_token_ids == small[f"mtp{i}"].new_token_ids == plain[f"none{i}"].new_token_ids
    assert all(set(o.stats.accepted_by_proposer) <= {"ngram"} for o in only.values())
    assert sum(o.stats.accepted_tokens for o in only.values()) > 0
    assert all(o.stats.draft_tokens <= 2 * o.stats.drafts for o in small.values())


BAD_OPTIONS = [
    ({"mtp_proposers": ["medusa"]}, "mtp", "mtp_proposers: unknown proposer 'medusa'; known: mtp_heads, eagle, draft, ngram"),
    ({"mtp_proposers": ["draft"]}, "mtp", "mtp_proposers: proposer 'draft' is not served here; served: eagle, ngram"),
    ({"mtp_proposers": []}, "mtp", "mtp_proposers must name at least one proposer"),
    ({"mtp_tree_budget": 9}, "mtp", "mtp_tree_budget must be an integer in [1, 8] (the server's max_draft_len), got 9"),
    ({"mtp_tree_budget": 0}, "mtp", "mtp_tree_budget must be an integer in [1, 8] (the server's max_draft_len), got 0"),
    ({"mtp_tree_budget": 4}, "none", "mtp_tree_budget applies only to spec_method mtp, not to spec_method 'none'"),
]


@pytest.mark.parametrize("options, method, message", BAD_OPTIONS, ids=[m[:30] for *_, m in BAD_OPTIONS])
def test_bad_options_are_refused_with_a_clear_message(target_path, options, method, message):
    target = load_model(target_path)
    engine = mtp_engine(target, [eagle(target), NgramProposer()])
    with pytest.raises(RequestRejected) as e:
        engine.check(GenerationRequest("x", [1, 2], SamplingParams(max_tokens=4), method, options=options))
    assert str(e.value) == message


def test_sampling_parameters_carry_the_options_with_type_checks():
    cfg = make_request_config(json.dumps({"spec_method": "mtp", "mtp_proposers": ["eagle", "ngram"],
                                          "mtp_tree_budget": "8"}), False, None)
    assert cfg.spec_method == "mtp" and cfg.options == {"mtp_proposers": ["eagle", "ngram"], "mtp_tree_budget": 8}
    assert make_request_config(json.dumps({"max_tokens": 3}), False, None).options is None
    for raw, message in ((('{"mtp_proposers": "eagle"}'), 'sampling_parameters.mtp_proposers must be a list of strings, got "eagle"'),
                         (('{"mtp_proposers": [1]}'), "sampling_parameters.mtp_proposers must be a list of strings, got [1]"),
                         (('{"mtp_tree_budget": 2.5}'), "sampling_parameters.mtp_tree_budget must be an integer, got 2.5")):
        with pytest.raises(BadRequest) as e:
            make_request_config(raw, False, None)
        assert str(e.value) == message


def test_a_tier_sets_mtp_options_and_the_request_wins():
    from specserve.serving.tiers import Tier

    tier = Tier("robust", "mtp", "eagle", 3, tree_budget=6, proposers=("eagle", "ngram"))
    cfg = make_request_config(json.dumps({"mtp_tree_budget": 4}), False, None, tier)
    assert cfg.spec_method == "mtp" and cfg.options == {"mtp_tree_budget": 4, "mtp_proposers": ["eagle", "ngram"]}
    other = make_request_config(json.dumps({"spec_method": "eagle"}), False, None, tier)
    assert other.options is None


def test_a_dflash_tier_sets_the_block_size_and_the_request_wins():
    from specserve.serving.tiers import Tier

    tier = Tier("batch", "dflash", "eagle", 0, block_size=16)
    assert make_request_config("{}", False, None, tier).options == {"dflash_block_size": 16}
    own = make_request_config(json.dumps({"dflash_block_size": 4}), False, None, tier)
    assert own.spec_method == "dflash" and own.options == {"dflash_block_size": 4}
    assert make_request_config(json.dumps({"spec_method": "eagle"}), False, None, tier).options is None


# -- the remote arbiter's batch function (what mtp_arbiter and ngram_drafter run) ---------------------
def test_remote_arbiter_batch_carries_trees_with_parents_and_sources():
    import numpy as np

    from specserve.methods.mtp.remote import arbitrate_batch, mask_of, names_of, ngram_batch

    assert names_of(mask_of(["ngram", "eagle"])) == ("eagle", "ngram")
    ctx = np.array([[1, 2, 3, 1, 2, -1], [7, 8, 9, 7, 8, 9]])
    assert ngram_batch(ctx, np.array([2, 4])).tolist() == [[3, 1, -1], [7, 8, 9]]
    scalars = np.zeros((2, 3, 3), dtype=np.float32)
    scalars[:, :, 0] = [[0.9, 0.8, 0.5], [0.5, 0.5, 0.5]]   # EAGLE's top-1 probabilities
    out = arbitrate_batch({
        "draft_tokens": np.array([[3, 1, 5], [4, 4, 4]]), "draft_scalars": scalars,
        "accept_prob": np.array([[0.9, 0.9, 0.1], [0.9, 0.9, 0.9]], dtype=np.float32),
        "ngram_tokens": np.array([[3, 1, -1], [7, 8, 9]]),
        "tree_budget": np.array([16, 2]), "proposer_mask": np.array([mask_of(["eagle", "ngram"]), mask_of(["ngram"])]),
        "row_threshold": np.array([0.5, 0.0], dtype=np.float32)})
    # row 0: EAGLE cut after 2 tokens (0.9 × 0.9 × 0.1 < 0.5), agreeing with n-gram on [3, 1]
    assert out["tree_tokens"].tolist() == [[3, 1], [7, 8]]
    assert out["tree_parents"].tolist() == [[-1, 0], [-1, 0]]
    both, ngram = mask_of(["eagle", "ngram"]), mask_of(["ngram"])
    assert out["tree_sources"].tolist() == [[both, both], [ngram, ngram]]
    empty = arbitrate_batch({"tree_budget": np.array([4]), "proposer_mask": np.array([both]),
                             "row_threshold": np.array([0.3], dtype=np.float32)})
    assert empty["tree_tokens"].shape == (1, 0)


# -- the typo'd prompt sets of the benchmark (benchmarks/make_typo_prompts.py) -------------------------
def _typo_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_typo_prompts", ROOT / "benchmarks/make_typo_prompts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_renamed_words_are_misspelt_the_same_way_at_every_occurrence():
    import random

    mod = _typo_module()
    text = "def foo(bar):\n    foo = bar + foo\n    return foobar(foo, bar, baz_qux)\n"
    out, done = mod.corrupt_consistently(text, random.Random(0))
    assert [(d["word"], d["occurrences"]) for d in done][:2] == [("foo", 4), ("bar", 3)]
    for d in done:
        assert d["typo"] != d["word"] and d["typo"] in out
    # whole words only: the identifier foobar keeps its letters; the rest of the text is unchanged
    assert "foobar(" in out
    expect = text
    import re
    for d in done:
        expect = re.sub(rf"(?<![A-Za-z]){d['word']}(?![A-Za-z])", d["typo"], expect)
    assert out == expect


def test_the_committed_renamed_set_is_what_its_command_makes(tmp_path):
    _typo_module().main(["--seed", "14", "--consistent", "--out", str(tmp_path / "r.jsonl")])
    assert (tmp_path / "r.jsonl").read_text() == (ROOT / "docs/mtp/typo_prompts_renamed.jsonl").read_text()


# -- remote mtp with all four sub-proposers, in process: the same trees as fused mtp ---------------
class Recorder:
    """Wraps a proposer and records every tree it proposes (seq, length, tokens, parents, sources)."""

    def __init__(self, inner):
        self.inner, self.trees = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, requests):
        drafts = self.inner.propose(requests)
        self.trees += [(r.seq_id, len(r.token_ids), d.tokens, d.parents, [tuple(sorted(s)) for s in d.sources], d.skipped)
                       for r, d in zip(requests, drafts)]
        return drafts


@pytest.fixture(scope="module")
def four_drafters(target_path, tmp_path_factory):
    """The tiny target's EAGLE (random, exported), MTP heads (random, exported) and two draft
    models: the target itself (drafts accepted in full) and a random one (drafts rejected)."""
    from specserve.methods.eagle.export import export
    from specserve.methods.mtp.heads import MTPConfig, MTPHeads, _target_fields, export_mtp_onnx

    target = load_model(target_path)
    out = tmp_path_factory.mktemp("remote_mtp")
    drafter = random_drafter(target, seed=1)
    report = export(target, drafter, out)
    torch.manual_seed(4)
    heads = MTPHeads(MTPConfig(**{**_target_fields(target), "num_heads": 3, "intermediate_size": 32}),
                     target.lm_head.weight)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.2)
    heads = heads.eval().requires_grad_(False)
    export_mtp_onnx(heads, out / "mtp_heads.onnx")
    drafts = {"target": load_model(target_path), "random": load_model(make_tiny_checkpoint(out / "d", "llama", seed=22))}
    return target, drafter, report, heads, out / "mtp_heads.onnx", drafts


SEEDED_MTP = [SamplingParams(max_tokens=24, temperature=0.7, top_k=50, seed=31),
              SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=32)]


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("draft_kind", ["target", "random"])
def test_remote_mtp_proposes_the_fused_trees_with_all_four_drafters(four_drafters, draft_kind, sampling):
    """4 sequences batched, greedy or seeded (every member proposes with the row's noise, remote
    as fused): remote mtp (in_process_call: the ONNX EAGLE and MTP heads, the draft model's
    service, n-gram, the arbiter batch) proposes exactly fused mtp's tree at every step, and both
    credit the same proposers. The draft model's cache is rolled back by observe() fused and by
    its catch-up remotely; a stale entry would change its drafts."""
    from specserve.methods.draft.proposer import DraftModelProposer
    from specserve.methods.eagle.onnx_runtime import CalibrationOnnxRuntime, EagleOnnxRuntime
    from specserve.methods.eagle.onnx_runtime import in_process_call as eagle_call
    from specserve.methods.mtp.heads_proposer import MTPHeadsProposer
    from specserve.methods.mtp.proposer import SUBPROPOSERS
    from specserve.methods.mtp.remote import RemoteMTPProposer, draft_call, heads_call, in_process_call
    from specserve.methods.mtp.heads_onnx_runtime import HeadsOnnxRuntime
    from specserve.methods.mtp.remote_drafters import DraftModelService

    target, drafter, report, heads, heads_onnx, drafts = four_drafters
    draft, L, seqs = drafts[draft_kind], 5, 4

    def requests(method):
        if sampling == "greedy":
            return reqs(method, n=24)
        return [GenerationRequest(f"{method}{i}", p, SEEDED_MTP[i % 2], method) for i, p in enumerate(PROMPTS)]
    fused = MultiDraftProposer([MTPHeadsProposer(heads, max_draft_len=L), eagle(target, seed=1, max_draft_len=L),
                                DraftModelProposer(draft, max_num_seqs=seqs, max_model_len=256, max_draft_len=L),
                                NgramProposer()], max_draft_len=L, vocab_size=target.cfg.vocab_size)
    c = target.cfg
    remote_call = in_process_call(
        eagle_call(EagleOnnxRuntime(str(report.backbone), c.num_kv_heads, c.head_dim),
                   CalibrationOnnxRuntime(str(report.calibration))),
        heads=heads_call(HeadsOnnxRuntime(heads_onnx)),
        draft=draft_call(DraftModelService(draft, max_num_seqs=seqs, max_model_len=256, max_draft_len=L)))
    remote = RemoteMTPProposer(remote_call, served=SUBPROPOSERS, max_draft_len=L, budget=16, threshold=None)
    outputs, trees = {}, {}
    for kind, proposer in (("fused", fused), ("remote", remote)):
        rec = Recorder(proposer)
        engine = Engine(target, EngineConfig(max_num_seqs=seqs, max_model_len=256, max_draft_len=L), {"mtp": rec},
                        eos_token_ids=())
        outputs[kind] = engine.generate(requests("mtp"))
        trees[kind] = sorted(rec.trees, key=lambda t: t[:2])
    assert len(trees["fused"]) > 4 * 4 and trees["remote"] == trees["fused"]
    for k, o in outputs["fused"].items():
        assert outputs["remote"][k].new_token_ids == o.new_token_ids
        assert outputs["remote"][k].stats.accepted_by_proposer == o.stats.accepted_by_proposer
    if sampling == "seeded":
        plain = Engine(target, EngineConfig(max_num_seqs=seqs, max_model_len=256), {}, eos_token_ids=())
        for k, o in plain.generate(requests("none")).items():
            assert outputs["remote"][k.replace("none", "mtp", 1)].new_token_ids == o.new_token_ids, k
        return
    credited = {p for o in outputs["remote"].values() for p in o.stats.accepted_by_proposer}
    # the target as draft model wins every step; the random one loses to EAGLE and n-gram
    assert credited == ({"draft"} if draft_kind == "target" else {"eagle", "ngram"})


def test_draft_service_evicts_the_least_recently_used_sequence_and_catches_up(four_drafters):
    """draft_drafter's state is a cache: with its slots full a new sequence evicts the least
    recently used one, which later drafts the same chain from its tokens alone."""
    from specserve.methods.mtp.remote_drafters import DraftModelService

    *_, drafts = four_drafters
    service = DraftModelService(drafts["random"], max_num_seqs=2, max_model_len=64, max_draft_len=4)
    ctx = np.array([[5, 17, 99, 3], [11, 12, 13, -1], [77, 78, -1, -1]])
    first, lps = service.chains(np.array([1, 2]), ctx[:2], np.array([4, 2]))
    assert (first[1, 2:] == -1).all() and (first[0] >= 0).all() and (lps <= 0).all()
    service.chains(np.array([3]), ctx[2:], np.array([3]))          # evicts sequence 1
    assert service.evicted == 1 and set(service._used) == {2, 3}
    again, lps_again = service.chains(np.array([1]), ctx[:1], np.array([4]))   # evicts 2, recomputes 1
    assert again.tolist() == first[:1].tolist() and np.allclose(lps_again, lps[:1], atol=1e-5)
    with pytest.raises(ValueError, match="draft_drafter: 3 sequences in one call, more than its 2 slots"):
        service.chains(np.array([7, 8, 9]), ctx, np.array([1, 1, 1]))


def test_mtp_proposal_renders_the_served_drafters_only(four_drafters, target_path, tmp_path):
    """No draft model served → no draft_drafter, and the ensemble does not name it; MTP heads
    served → mtp_heads with their ONNX export."""
    import re

    from specserve.methods.mtp.heads import save_mtp_heads
    from specserve.serving.settings import DeploymentSettings
    from specserve.triton.render import render_mtp_proposal

    heads = four_drafters[3]
    save_mtp_heads(heads, tmp_path / "mtp")
    steps = {}
    for name, drafted in (("plain", (("eagle", "unused"),)), ("heads", (("eagle", "unused"), ("mtp", str(tmp_path / "mtp"))))):
        repo = tmp_path / name
        render_mtp_proposal(DeploymentSettings(target_path, drafters=drafted, placement="remote",
                                               draft_policy="fixed", default_method="none"), repo)
        steps[name] = re.findall(r'model_name: "(\w+)"', (repo / "mtp_proposal" / "config.pbtxt").read_text())
        assert sorted(p.name for p in repo.iterdir()) == sorted({"mtp_proposal", "ngram_drafter", "mtp_arbiter",
                                                                 *(["mtp_heads"] if name == "heads" else [])})
    assert steps["plain"] == ["eagle_backbone", "calibration_head", "ngram_drafter", "mtp_arbiter"]
    assert steps["heads"] == ["mtp_heads", "eagle_backbone", "calibration_head", "ngram_drafter", "mtp_arbiter"]
    assert (tmp_path / "heads" / "mtp_heads" / "1" / "mtp_heads.onnx").is_file()


def test_remote_mtp_credits_the_demo_heads_and_draft_model(tmp_path):
    """The committed demo MTP heads and draft model behind remote mtp's models (in process: what
    mtp_heads and draft_drafter run, rendered fp32): greedy output equals plain decoding on two
    held-out prompts, and accepted tokens are credited to both."""
    from specserve.methods.mtp.heads import export_mtp_onnx, load_mtp_heads
    from specserve.methods.mtp.remote import RemoteMTPProposer, draft_call, heads_call, in_process_call
    from specserve.methods.mtp.heads_onnx_runtime import HeadsOnnxRuntime
    from specserve.methods.mtp.remote_drafters import DraftModelService, load_remote_draft
    from specserve.model.tokenizer import load_tokenizer

    demo = ROOT / "models" / "demo"
    target = load_model(demo / "target")
    export_mtp_onnx(load_mtp_heads(demo / "mtp", target), tmp_path / "mtp_heads.onnx")
    draft = load_remote_draft(demo / "draft", demo / "target", dtype="float32")
    call = in_process_call(None, heads=heads_call(HeadsOnnxRuntime(tmp_path / "mtp_heads.onnx")),
                           draft=draft_call(DraftModelService(draft, max_num_seqs=2, max_model_len=512, max_draft_len=8)))
    remote = RemoteMTPProposer(call, served=("mtp_heads", "draft", "ngram"), max_draft_len=8, budget=16, threshold=None)
    engine = Engine(target, EngineConfig(max_num_seqs=2, max_model_len=512, max_draft_len=8), {"mtp": remote})
    tok = load_tokenizer(demo / "target")
    prompts = [json.loads(line)["prompt"] for line in (demo / "heldout_prompts.jsonl").read_text().splitlines()[:2]]
    out = {}
    for method in ("none", "mtp"):
        out[method] = engine.generate([GenerationRequest(f"{method}{i}", tok.encode(p).ids, SamplingParams(max_tokens=32),
                                                         method) for i, p in enumerate(prompts)])
    credited = {}
    for i in range(len(prompts)):
        assert out["mtp"][f"mtp{i}"].new_token_ids == out["none"][f"none{i}"].new_token_ids
        for k, v in out["mtp"][f"mtp{i}"].stats.accepted_by_proposer.items():
            credited[k] = credited.get(k, 0) + v
    assert credited.get("mtp_heads", 0) > 0 and credited.get("draft", 0) > 0, credited


def test_mtp_runs_remote_by_default_whatever_eagles_placement(tmp_path, monkeypatch):
    """mtp's placement is its own (default remote): with EAGLE fused, the repository still has
    mtp_proposal and the EAGLE models it reuses, and the engine's mtp is the remote proposer while
    its eagle stays fused; --mtp-placement fused renders none of them. Remote needs an EAGLE drafter."""
    from specserve.methods.eagle.drafter import save_eagle
    from specserve.methods.mtp.remote import RemoteMTPProposer
    from specserve.serving.build import build_engine, mtp_runs_remote
    from specserve.serving.settings import DeploymentSettings
    from specserve.triton.render import render_repository

    target_path = make_served_checkpoint(tmp_path / "ckpt", seed=3, max_position_embeddings=256)
    target = load_model(target_path)
    save_eagle(random_drafter(target, seed=5), json.loads((target_path / "config.json").read_text()), tmp_path / "eagle")
    drafted = (("eagle", str(tmp_path / "eagle")),)
    assert mtp_runs_remote("remote", drafted) and not mtp_runs_remote("fused", drafted)
    assert not mtp_runs_remote("remote", ())                      # mtp is not served
    assert not mtp_runs_remote("remote", (("draft", "d"),))       # no EAGLE drafter: mtp runs fused
    with pytest.raises(ValueError) as e:
        mtp_runs_remote("cloud", drafted)
    assert str(e.value) == "mtp placement must be one of fused, remote, got 'cloud'"
    remote_models = {"mtp_proposal", "ngram_drafter", "mtp_arbiter", "eagle_backbone", "calibration_head"}
    for mtp_placement in ("remote", "fused"):
        repo = render_repository(DeploymentSettings(target_path, max_model_len=128, drafters=drafted,
                                                    mtp_placement=mtp_placement, draft_policy="fixed",
                                                    default_method="none"), tmp_path / mtp_placement)
        names = {p.name for p in repo.iterdir()}
        assert names & remote_models == (remote_models if mtp_placement == "remote" else set()), names
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2

        cfg = text_format.Parse((repo / "target_verifier" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        settings = DeploymentSettings.from_params({k: v.string_value for k, v in cfg.parameters.items()})
        assert (settings.placement, settings.mtp_placement) == ("fused", mtp_placement)
        # bls imports the Python backend's module, which exists only inside tritonserver: building
        # the proposer needs only its name (the calls are made while serving).
        monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
        from specserve.triton import bls

        engine, _ = build_engine(settings, bls.remote_calls())   # as target_verifier builds it
        assert isinstance(engine.proposers["eagle"], EagleProposer)
        assert isinstance(engine.proposers["mtp"], RemoteMTPProposer) == (mtp_placement == "remote")


def test_startup_lines_say_where_each_drafter_and_mtp_run():
    from specserve.methods import registry
    from specserve.serving.build import where_drafters_run
    from specserve.serving.settings import DeploymentSettings

    demo = ROOT / "models" / "demo"
    found = tuple((m, str(demo / m)) for m in registry.folder_methods())   # every drafter of the demo
    served = DeploymentSettings(demo / "target", drafters=found)
    assert where_drafters_run(served) == [
        "drafter eagle from models/demo/eagle (fused)", "drafter dflash from models/demo/dflash (fused)",
        "drafter draft from models/demo/draft (fused)", "drafter mtp from models/demo/mtp (remote)",
        "mtp merges mtp_heads, eagle, draft, ngram (remote: the mtp_proposal ensemble)"]
    assert where_drafters_run(replace(served, placement="remote", mtp_placement="fused"))[1:] == [
        "drafter dflash from models/demo/dflash (fused: no remote export)",
        "drafter draft from models/demo/draft (fused: no remote export)", "drafter mtp from models/demo/mtp (fused)",
        "mtp merges mtp_heads, eagle, draft, ngram (fused)"]
    assert where_drafters_run(replace(served, drafters=found[2:3]))[-1] == \
        "mtp merges draft, ngram (fused: remote needs an EAGLE drafter)"
    # Built in process (no BLS calls to make), mtp runs fused whatever its placement, and says so.
    assert where_drafters_run(served, bls_calls=False)[-2:] == [
        "drafter mtp from models/demo/mtp (fused)",
        "mtp merges mtp_heads, eagle, draft, ngram (fused: built in process, with no BLS calls to make)"]
