"""Seeded sampling in process on the demo model, every registered method: a seeded request gives
`none`'s text for the same seed, token for token, alone and inside a concurrent mixed batch
(other methods, unseeded and greedy rows, other draft lengths and policies), and when its drafter
fails mid-stream (the rows decode plainly)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.core.engine import GenerationRequest
from specserve.core.proposer import ProposerError
from specserve.core.sampling import SamplingParams
from specserve.methods import registry

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
DRAFTERS = tuple((m, str(DEMO / m)) for m in registry.folder_methods())
METHODS = [m for m in registry.names() if m != "none"]
PROMPTS = ["def parse_args(argv):\n    parser = argparse.", "The history of the city begins with"]
SAMPLING = {   # T = 0.7 and 1.0, with top-k and top-p
    "t0.7_topk": dict(temperature=0.7, top_k=50),
    "t1.0_topp": dict(temperature=1.0, top_p=0.9),
    "t1.0": dict(temperature=1.0),
}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def built():
    """The demo deployment, every method fused, with slots for a mixed batch of all of them."""
    from specserve.serving.build import build_engine
    from specserve.serving.settings import DeploymentSettings

    engine, tok = build_engine(DeploymentSettings(DEMO / "target", max_num_seqs=12, max_model_len=256, drafters=DRAFTERS,
                                                   device="cpu", draft_policy="fixed", default_method="none"))
    return engine, tok


def request(tok, rid, prompt, method, seed, sampling, **kw):
    params = SamplingParams(max_tokens=MAX_TOKENS, seed=seed, ignore_eos=True, **SAMPLING[sampling]) \
        if sampling else SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return GenerationRequest(rid, tok.encode(prompt).ids, params, method=method, **kw)


@pytest.fixture(scope="module")
def plain(built):
    """none's seeded outputs: (prompt index, sampling, seed) → tokens."""
    engine, tok = built
    reqs = {(i, s, seed): request(tok, f"none-{i}-{s}-{seed}", p, "none", seed, s)
            for i, p in enumerate(PROMPTS) for s in SAMPLING for seed in (1,)}
    out = engine.generate(list(reqs.values()))
    return {k: out[r.request_id].new_token_ids for k, r in reqs.items()}


@pytest.mark.parametrize("method", METHODS)
def test_seeded_output_equals_none_alone(built, plain, method):
    engine, tok = built
    accepted = 0
    for (i, s, seed), want in plain.items():
        r = request(tok, f"{method}-{i}-{s}-{seed}", PROMPTS[i], method, seed, s)
        got = engine.generate([r])[r.request_id]
        assert got.new_token_ids == want, (method, i, s, seed)
        assert got.stats.method == method and got.stats.proposer_errors == 0
        accepted += got.stats.accepted_tokens
    assert accepted > 0, f"{method} never had a drafted token accepted"


def test_seeded_output_equals_none_in_a_mixed_batch(built, plain):
    """All methods at once, seeded, beside unseeded sampled and greedy rows, with other draft caps
    and the adaptive policy: every seeded row still gives none's tokens."""
    engine, tok = built
    keys = list(plain)
    batch, want = [], {}
    for n, method in enumerate(METHODS):
        i, s, seed = keys[n % len(keys)]
        extra = {"num_draft_tokens": 2 + n % 3} if n % 2 else {"draft_policy": "adaptive"}
        if registry.get(method).step == "static":
            extra = {"num_draft_tokens": 3}
        r = request(tok, f"mix-{method}", PROMPTS[i], method, seed, s, **extra)
        batch.append(r)
        want[r.request_id] = plain[(i, s, seed)]
    batch.append(request(tok, "mix-unseeded", PROMPTS[0], "eagle", None, "t1.0"))
    batch.append(request(tok, "mix-greedy", PROMPTS[1], "dflash", None, None))
    i, s, seed = keys[-1]
    batch.append(request(tok, "mix-none", PROMPTS[i], "none", seed, s))
    want["mix-none"] = plain[keys[-1]]
    out = engine.generate(batch)
    for rid, tokens in want.items():
        assert out[rid].new_token_ids == tokens, rid
    assert len(out["mix-unseeded"].new_token_ids) == len(out["mix-greedy"].new_token_ids) == MAX_TOKENS


@pytest.mark.parametrize("method", [m for m in METHODS if registry.get(m).step == "dynamic"])
def test_a_drafter_failing_mid_stream_keeps_the_seeded_text(built, plain, method, monkeypatch):
    """The drafter fails from the third step on (as an unloaded remote one does): the request
    decodes plainly and gives the same tokens."""
    engine, tok = built
    proposer = engine.proposers[method]
    real, calls = proposer.propose, []

    def flaky(requests):
        calls.append(len(requests))
        if len(calls) > 2:
            raise ProposerError("model is not ready")
        return real(requests)

    monkeypatch.setattr(proposer, "propose", flaky)
    (i, s, seed), want = next(iter(plain.items()))
    r = request(tok, f"flaky-{method}", PROMPTS[i], method, seed, s)
    got = engine.generate([r])[r.request_id]
    assert got.new_token_ids == want
    assert got.stats.proposer_errors > 0
