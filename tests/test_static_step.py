"""The static step (specserve.core.static_step): token for token equal to the dynamic step (greedy) for
several batch buckets with mixed context and draft lengths and padded rows; sampled acceptance
passes the distribution test of test_verify.py, and a broken variant fails it."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_checkpoint
from specserve.core.masks import build_mask, chain_parents
from specserve.core.forward import ForwardBatch
from specserve.model.transformer import load_model
from specserve.core.proposer import Draft
from specserve.core.sampling import SamplingParams
from specserve.core.static_step import (DeviceKV, SamplingTensors, StepInputs, acceptance, bucket_for, draw,
                                   final_distribution, greedy_acceptance, sampled_accepted, span_for,
                                   target_step, to_host, truncates, uniforms_for, warp)
from specserve.core.verify import Verdict, verify_greedy
from test_verify import (N_DRAWS, PARAMS, TV_BOUND, ToyLM, draw_chain, empirical_first_two,
                         exact_first_two)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("static"), "llama", seed=7))


# -- pure pieces ----------------------------------------------------------------------------------

def test_span_and_bucket_sets():
    assert [span_for(n, 300) for n in (1, 64, 65, 200, 300)] == [64, 64, 128, 256, 300]
    assert span_for(10, 300, "full") == 300
    with pytest.raises(ValueError, match="holds 300"):
        span_for(301, 300)
    assert [bucket_for(n, 16) for n in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert bucket_for(3, 3) == 3


def test_greedy_acceptance_worked_example():
    # The module docstring's example: K = 3, draft_lens = 2, drafts [7, 9, pad], argmax [7, 4, 5, 1].
    logits = torch.full((1, 4, 10), -1.0)
    for t, best in enumerate([7, 4, 5, 1]):
        logits[0, t, best] = 1.0
    acc = greedy_acceptance(logits, torch.tensor([[3, 7, 9, 5]]), torch.tensor([2]))
    assert acc.emitted.tolist() == [[7, 4, 0, 0]] and acc.counts.tolist() == [2]
    # All drafted accepted: the bonus is the argmax after the last one, even when padding would match.
    acc = greedy_acceptance(logits, torch.tensor([[3, 7, 4, 5]]), torch.tensor([2]))
    assert acc.emitted.tolist() == [[7, 4, 5, 0]] and acc.counts.tolist() == [3]


def test_draw_never_picks_zero_probability_tokens():
    dist = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(6, 5)
    u = torch.tensor([1e-9, 0.25, 0.5, 0.5001, 0.99, 1.0])
    assert draw(dist, u).tolist() == [1, 1, 1, 3, 3, 3]


# -- static == dynamic, greedy, on a real model ------------------------------------------------------

def _prefill(model, cache, slots, prompts):
    T = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p)
    mask, positions = build_mask([0] * len(prompts), [chain_parents(len(p)) for p in prompts], T)
    zeros = torch.zeros(len(prompts), dtype=torch.long)
    model.forward(ForwardBatch(tokens, positions, torch.tensor(slots), zeros, mask), cache)


def _dynamic_step(model, cache, slots, lengths, pending, drafts):
    """The engine's dynamic path: build_mask over the exact span, per-row verify_greedy."""
    T = 1 + max(len(d) for d in drafts)
    tokens = torch.zeros(len(slots), T, dtype=torch.long)
    for b, (p, d) in enumerate(zip(pending, drafts)):
        tokens[b, :1 + len(d)] = torch.tensor([p] + d)
    mask, positions = build_mask(lengths, [chain_parents(1 + len(d)) for d in drafts], T)
    hidden = model.forward(ForwardBatch(tokens, positions, torch.tensor(slots), torch.tensor(lengths), mask),
                           cache).hidden
    logits = model.logits(hidden)
    return [verify_greedy(logits[b, :1 + len(d)], Draft.chain(d)).emitted for b, d in enumerate(drafts)]


def _drafts(oracle, rows, K, g):
    """Per row: a prefix of the target's true continuation, of random length ≤ K, with one token
    corrupted at a random place half of the time (so accept, reject and bonus all happen)."""
    out = []
    for r in rows:
        n = int(torch.randint(0, K + 1, (), generator=g))
        d = list(oracle[r][:n])
        if d and torch.rand((), generator=g) < 0.5:
            i = int(torch.randint(0, n, (), generator=g))
            d[i] = (d[i] + 1) % 512
        out.append(d)
    return out


@pytest.mark.parametrize("B", [1, 3, 8])
def test_static_step_equals_dynamic_step_greedy(model, B):
    K, steps = 4, 6
    g = torch.Generator().manual_seed(B)
    prompts = [torch.randint(3, 512, (int(torch.randint(2, 40, (), generator=g)),), generator=g).tolist()
               for _ in range(B)]
    bucket = bucket_for(B, 8) if B != 3 else 4  # B = 3 runs in a bucket of 4: one padded row
    dyn = model.new_cache(bucket + 1, 128)
    sta = model.new_cache(bucket + 1, 128)
    scratch = bucket  # the last slot: padded rows write there
    slots = list(range(B))
    for cache in (dyn, sta):
        _prefill(model, cache, slots, [p[:-1] for p in prompts])
    seqs = [list(p) for p in prompts]  # the last token of each is pending
    kv = DeviceKV(sta)
    for _ in range(steps):
        lengths = [len(s) - 1 for s in seqs]
        # The target's greedy continuation of each row, as the oracle drafts come from.
        oracle = [model.score(torch.tensor([s]))[0, -1:].argmax(-1).tolist() for s in seqs]
        for b, s in enumerate(seqs):
            x = list(s)
            for _ in range(K - 1):
                x.append(int(model.score(torch.tensor([x]))[0, -1].argmax()))
            oracle[b] = x[len(s):] + [0]
        drafts = _drafts(oracle, range(B), K, g)
        want = _dynamic_step(model, dyn, slots, lengths, [s[-1] for s in seqs], drafts)

        pad = bucket - B
        tokens = torch.zeros(bucket, K + 1, dtype=torch.long)
        for b, (s, d) in enumerate(zip(seqs, drafts)):
            tokens[b, :1 + len(d)] = torch.tensor([s[-1]] + d)
        inp = StepInputs(tokens, torch.tensor(lengths + [0] * pad), torch.tensor(slots + [scratch] * pad),
                         torch.tensor([len(d) for d in drafts] + [0] * pad),
                         SamplingTensors.from_params([SamplingParams()] * B + [None] * pad, "cpu"),
                         torch.ones(bucket, K + 1))
        span = span_for(max(lengths) + K + 1, 128)
        res = target_step(model, kv, inp, span, sampled=False)
        host = to_host(res.emitted, res.counts, res.new_lengths)
        for b in range(B):
            n = int(host[b, K + 1])
            assert host[b, :n].tolist() == want[b], f"row {b}"
            assert int(host[b, K + 2]) == lengths[b] + n
            seqs[b] += want[b]
        # The committed KV is the dynamic path's (the rows' new lengths, both caches).
        for b in range(B):
            n = len(seqs[b]) - 1
            assert torch.allclose(sta.k[:, b, :, :n], dyn.k[:, b, :, :n], atol=1e-5)


def test_mixed_greedy_and_sampled_rows_keep_greedy_rows_exact(model):
    """A sampled row in the bucket must not change a greedy row's tokens (the per-row select)."""
    B, K = 2, 3
    cache = model.new_cache(B + 1, 64)
    _prefill(model, cache, [0, 1], [[5, 6, 7, 8], [9, 10]])
    tokens = torch.tensor([[9, 1, 2, 3], [11, 4, 5, 6]])
    inp = lambda s: StepInputs(tokens, torch.tensor([4, 2]), torch.tensor([0, 1]), torch.tensor([3, 3]),
                               s, uniforms_for([None, torch.Generator().manual_seed(0)], K + 1, "cpu"))
    both_greedy = SamplingTensors.from_params([SamplingParams(), SamplingParams()], "cpu")
    mixed = SamplingTensors.from_params([SamplingParams(), SamplingParams(temperature=1.0)], "cpu")
    a = target_step(model, DeviceKV(cache), inp(both_greedy), 64, sampled=False)
    b = target_step(model, DeviceKV(cache), inp(mixed), 64, sampled=True)
    n = int(a.counts[0])
    assert b.counts[0] == n and b.emitted[0, :n].tolist() == a.emitted[0, :n].tolist()


# -- sampled acceptance: the distribution test -----------------------------------------------------------

def static_sampler(logits, draft: Draft, params, g, *, pad: int = 1) -> Verdict:
    """test_verify's sampler interface over the static acceptance: one row, chain drafts padded by
    `pad` unused columns (so masking past draft_lens is part of what is tested)."""
    K = len(draft) + pad
    tokens = torch.zeros(1, K + 1, dtype=torch.long)
    tokens[0, 1:1 + len(draft)] = torch.tensor(draft.tokens)
    V = logits.shape[-1]
    full = torch.cat([logits, torch.zeros(pad, V)])[None]  # [1, K+1, V]
    probs = None
    if draft.probs is not None:
        probs = torch.cat([draft.probs, torch.full((pad, V), 1.0 / V)])[None]
    # "plain" rows (no top-k / top-p) take warp's sort-free variant, as a served step would
    acc = acceptance(full, tokens, torch.tensor([len(draft)]), SamplingTensors.from_params([params], "cpu"),
                     probs, uniforms_for([g], K + 1, "cpu"), sampled=True, truncated=truncates([params], V))
    n = int(acc.counts[0])
    return Verdict(list(range(n - 1)), acc.emitted[0, :n].tolist(), n - 1 == len(draft))


def broken_static_sampler(logits, draft: Draft, params, g) -> Verdict:
    """BROKEN on purpose: the static acceptance test, but the token after a rejection is drawn
    from p instead of the residual max(p − q, 0)."""
    K = len(draft)
    tokens = torch.tensor([[0] + draft.tokens])
    probs = warp(logits[None], SamplingTensors.from_params([params], "cpu"))
    u = uniforms_for([g], K + 1, "cpu")
    lens = torch.tensor([K])
    accepted = sampled_accepted(probs, tokens, lens, draft.probs[None], u)
    p = probs[0, int(accepted)][None]
    n = int(accepted) + 1
    emitted = draft.tokens[:n - 1] + [int(draw(p, u[:, K]))]
    return Verdict(list(range(n - 1)), emitted, n - 1 == K)


@pytest.mark.parametrize("pname", list(PARAMS))
def test_static_sampled_acceptance_matches_target_distribution(pname):
    params = PARAMS[pname]
    target, d1 = ToyLM(1), ToyLM(2)
    make = lambda ctx, g: draw_chain(d1, ctx, 3, g)
    want = exact_first_two(target, params)
    got = empirical_first_two(static_sampler, target, params, make, N_DRAWS, seed=11)
    tv = 0.5 * (got - want).abs().sum().item()
    assert tv < TV_BOUND, f"total variation {tv:.4f}"


def test_truncates_names_the_rows_that_need_the_vocabulary_sorts():
    V = 100
    assert not truncates([None, SamplingParams(), SamplingParams(temperature=0.7)], V)
    assert truncates([None, SamplingParams(temperature=0.7, top_k=40)], V)
    assert truncates([SamplingParams(temperature=0.7, top_p=0.9)], V)
    assert not truncates([SamplingParams(top_k=40)], V)   # greedy: its top-k is never used
    # top-k at or past the vocabulary keeps every token, as target_probs treats it
    assert not truncates([SamplingParams(temperature=0.7, top_k=V)], V)
    assert truncates([SamplingParams(temperature=0.7, top_k=V - 1)], V)


def test_a_top_k_the_rule_calls_no_cut_leaves_target_probs_untouched():
    """SamplingParams.truncates is the rule target_probs follows: where it says no cut, the
    reference distribution is the plain tempered softmax (and a cutting top-k is not)."""
    from specserve.core.sampling import target_probs

    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    plain = (logits / 0.7).softmax(-1)
    for k in (0, 50, 80):
        p = SamplingParams(temperature=0.7, top_k=k)
        assert not p.truncates(50) and torch.equal(target_probs(logits, p), plain)
    cut = SamplingParams(temperature=0.7, top_k=49)
    assert cut.truncates(50) and not torch.allclose(target_probs(logits, cut), plain)


def test_warp_without_truncation_is_the_full_warp_bit_for_bit():
    """No row truncates: skipping the sorts gives the same probabilities, even where the tempered
    softmax underflows to exact zeros (the only tokens top_p = 1 drops)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 1000, generator=g) * torch.tensor([1.0, 30.0, 300.0])[:, None, None]
    s = SamplingTensors.from_params([SamplingParams(temperature=t) for t in (1.0, 0.7, 0.05)], "cpu")
    full, fast = warp(logits, s, truncated=True), warp(logits, s, truncated=False)
    assert (full == 0).any() and torch.equal(full, fast)
    # the control: a row with top-k does change the probabilities, so that variant must sort
    s_k = SamplingTensors.from_params([SamplingParams(temperature=1.0, top_k=5)] * 3, "cpu")
    assert not torch.equal(warp(logits, s_k, truncated=True), warp(logits, s_k, truncated=False))


def test_static_point_mass_drafts_are_lossless():
    """Deterministic drafts (probs None: the argmax drafts of a greedy drafter under sampling)."""
    params = PARAMS["warped"]
    target = ToyLM(4)
    make = lambda ctx, g: Draft.chain([1, 2, 3])
    want = exact_first_two(target, params)
    got = empirical_first_two(static_sampler, target, params, make, N_DRAWS, seed=12)
    assert 0.5 * (got - want).abs().sum().item() < TV_BOUND


def test_broken_static_acceptance_fails_the_same_bound():
    params = PARAMS["plain"]
    target, d1 = ToyLM(1), ToyLM(2)
    make = lambda ctx, g: draw_chain(d1, ctx, 3, g)
    want = exact_first_two(target, params)
    got = empirical_first_two(broken_static_sampler, target, params, make, N_DRAWS, seed=11)
    tv = 0.5 * (got - want).abs().sum().item()
    assert tv > TV_BOUND, f"the broken static acceptance should be caught; TV {tv:.4f}"


def test_final_distribution_is_the_residual_after_a_rejection():
    p = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]])  # [1, K+1 = 2, V = 3]
    q = torch.tensor([[[0.2, 0.6, 0.2]]])
    tokens = torch.tensor([[0, 1]])
    rejected = final_distribution(p, tokens, torch.tensor([1]), q, torch.tensor([0]))
    assert torch.allclose(rejected, torch.tensor([[1.0, 0.0, 0.0]]))  # max(p - q, 0) = [.3, 0, 0]
    bonus = final_distribution(p, tokens, torch.tensor([1]), q, torch.tensor([1]))
    assert torch.allclose(bonus, p[:, 1])
