"""Isolation and faults inside the engine and its loop, without a server (issue 14): a bad row
fails alone, a failing or garbage-returning proposer costs only speculation (never features or
exactness), the admission queue is bounded, and no step blocks submit / cancel."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import make_tiny_checkpoint
from specserve.core.engine import (Engine, EngineConfig, GenerationRequest, RequestRejected, ServerBusy)
from specserve.core.engine_loop import EngineLoop
from specserve.model.transformer import load_model
from specserve.core.proposer import Draft, ProposerDefaults, ProposerError
from specserve.methods.ngram.proposer import NgramProposer
from specserve.core.sampling import SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 7, 300, 12], [11, 12, 13, 14, 11, 12, 13], [400, 3, 3, 3, 3, 3],
           [77, 78], list(range(100, 130))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("iso"), "llama", seed=4))


def make_engine(model, proposers=None, **cfg) -> Engine:
    return Engine(model, EngineConfig(**{"max_num_seqs": 8, "max_model_len": 256, **cfg}),
                  proposers or {"ngram": NgramProposer(num_draft_tokens=4)}, eos_token_ids=())


def req(i, prompt, method="none", n=20, **kw) -> GenerationRequest:
    return GenerationRequest(str(i), list(prompt), SamplingParams(max_tokens=n, **kw), method)


def solo(model, r: GenerationRequest) -> list[int]:
    return make_engine(model).generate([GenerationRequest(r.request_id, r.prompt_ids, r.params, "none")])[
        r.request_id].new_token_ids


def test_a_row_whose_distribution_is_invalid_fails_alone(model):
    """A NaN temperature that got past validation (simulated) fails its own request with a
    message; the other rows of the same batches finish with their exact solo output."""
    engine = make_engine(model)
    good = [req(i, p, "ngram" if i % 2 else "none") for i, p in enumerate(PROMPTS[:4])]
    bad = req("bad", PROMPTS[4], temperature=0.7, seed=1)
    for r in good[:2] + [bad] + good[2:]:
        engine.submit(r)
    object.__setattr__(bad.params, "temperature", float("nan"))  # after validate(), as a bug would be
    out = run(engine)
    assert out["bad"].finish_reason == "error"
    assert out["bad"].error == ("sampling the first token failed: the sampling parameters give an invalid "
                                "probability distribution (check temperature, top_p, top_k)")
    for r in good:
        assert out[r.request_id].new_token_ids == solo(model, r), r.request_id
        assert out[r.request_id].finish_reason == "length" and out[r.request_id].error is None
    assert engine.num_free_slots == 8


def run(engine) -> dict:
    """Step until done; each request's final output, carrying all its tokens."""
    tokens, final = {}, {}
    while engine.has_work():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                o.new_token_ids = tokens[o.request_id]
                final[o.request_id] = o
    return final


def test_a_row_that_fails_in_verification_fails_alone(model):
    engine = make_engine(model)
    good = [req(i, p) for i, p in enumerate(PROMPTS[:3])]
    bad = req("bad", PROMPTS[3], temperature=0.7, seed=1, n=30)
    engine.submit(bad)
    for r in good:
        engine.submit(r)
    engine.step()   # prefill: the bad row samples fine
    object.__setattr__(bad.params, "temperature", float("nan"))
    outs = {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert outs["bad"][-1].finish_reason == "error" and outs["bad"][-1].error.startswith("verification failed: ")
    for r in good:
        tokens = [t for o in outs[r.request_id] for t in o.new_token_ids]
        assert outs[r.request_id][-1].finish_reason == "length"
        # the first token came with the prefill step, before `outs` was recorded
        assert tokens == solo(model, r)[1:]


class Flaky(ProposerDefaults):
    """A feature-consuming proposer that fails every other call (raising `error`) and otherwise
    drafts a few ids that are out of the vocabulary for one sequence; it checks that every call
    hands it exactly the features of all committed tokens, in order (none lost to a failure)."""
    name, needs_features = "flaky", True

    def __init__(self, error: Exception, vocab: int):
        self.error, self.vocab, self.calls, self.held = error, vocab, 0, {}

    def propose(self, requests):
        self.calls += 1
        for r in requests:
            n = self.held.get(r.seq_id, 0) + (0 if r.features is None else r.features.shape[0])
            assert n == len(r.token_ids) - 1, "features were lost or duplicated"
        if self.calls % 2:
            raise self.error
        for r in requests:
            self.held[r.seq_id] = len(r.token_ids) - 1
        return [Draft.chain([self.vocab + 5, 1]) if r.seq_id == 0 else Draft.chain(r.token_ids[-2:][:r.max_draft_len])
                for r in requests]

    def observe(self, outcomes):
        pass

    def release(self, seq_id):
        self.held.pop(seq_id, None)


@pytest.mark.parametrize("error", [ProposerError("drafter unloaded"), RuntimeError("a bug in a fused drafter")])
def test_proposer_failures_and_bad_drafts_cost_only_speculation(model, error):
    flaky = Flaky(error, model.cfg.vocab_size)
    engine = make_engine(model, {"flaky": flaky})
    rs = [req(i, p, "flaky") for i, p in enumerate(PROMPTS[:3])]
    out = engine.generate(rs)
    assert flaky.calls > 4
    for r in rs:
        assert out[r.request_id].new_token_ids == solo(model, r)
        assert out[r.request_id].finish_reason == "length"
        assert out[r.request_id].stats.proposer_errors > 0
    # seq 0's out-of-vocabulary drafts were dropped (decoded plainly), counted as errors too
    assert out["0"].stats.proposer_errors > out["1"].stats.proposer_errors


class Gate(ProposerDefaults):
    """A proposer whose propose() blocks until released: a remote drafter that hangs."""
    name, needs_features = "gate", False

    def __init__(self):
        self.entered, self.release_ = threading.Event(), threading.Event()

    def propose(self, requests):
        self.entered.set()
        assert self.release_.wait(30)
        return [Draft.empty() for _ in requests]

    def observe(self, outcomes):
        pass

    def release(self, seq_id):
        pass


def test_a_hung_step_never_blocks_submit_or_cancel_and_the_queue_is_bounded(model):
    gate = Gate()
    engine = make_engine(model, {"gate": gate}, max_num_seqs=2, max_queue_len=2)
    outs, done = [], threading.Event()

    def on_output(o):
        outs.append(o)
        if o.finished and sum(x.finished for x in outs) == 4:
            done.set()

    loop = EngineLoop(engine, on_output).start()
    try:
        loop.submit(req("a", PROMPTS[0], "gate", n=5))
        loop.submit(req("b", PROMPTS[1], "gate", n=5))
        assert gate.entered.wait(30)   # the loop thread is now stuck inside a step
        # Two slots busy: two more may queue, the fifth is refused at once, with the message.
        loop.submit(req("c", PROMPTS[2], n=5))
        loop.submit(req("d", PROMPTS[3], n=5))
        with pytest.raises(ServerBusy, match=r"^server busy: 2 requests are already waiting for one of 2 slots "
                                             r"\(max_queue_len=2\); retry later$"):
            loop.submit(req("e", PROMPTS[4], n=5))
        with pytest.raises(RequestRejected, match="max_tokens must be a positive integer, got 0"):
            loop.submit(req("f", PROMPTS[4], n=0))   # validated in the caller's thread too
        loop.cancel("d")                              # returns at once as well
        assert loop.state().waiting == 2 and loop.state().live == 4
        gate.release_.set()
        assert done.wait(60)
    finally:
        gate.release_.set()
        loop.stop()
    final = {o.request_id: o for o in outs if o.finished}
    assert {k: v.finish_reason for k, v in final.items()} == {"a": "length", "b": "length", "c": "length",
                                                               "d": "abort"}
    assert final["d"].error is None    # the client asked for it
    assert engine.num_free_slots == 2 and loop.state() == loop.state().__class__(0, 0, 0)


def test_the_loop_survives_a_failing_callback_and_a_failing_step(model):
    engine = make_engine(model)
    calls, failures = [], []

    def on_output(o):
        calls.append(o.request_id)
        raise RuntimeError("a broken sender")

    loop = EngineLoop(engine, on_output, lambda rid, e: failures.append((rid, str(e)))).start()
    try:
        real_step = engine.step
        engine.step = lambda: (_ for _ in ()).throw(RuntimeError("step exploded"))
        loop.submit(req("x", PROMPTS[0], n=3))
        for _ in range(200):
            if failures:
                break
            threading.Event().wait(0.05)
        assert failures == [("x", "step exploded")]
        engine.step = real_step
        got = threading.Event()
        loop._on_output = lambda o: got.set() if o.finished else None
        loop.submit(req("y", PROMPTS[1], n=3))
        assert got.wait(30), "the loop died"
    finally:
        loop.stop()


def test_a_held_loop_decodes_nothing_yet_ends_a_cancelled_request_and_resumes_when_released(model):
    """The test hook behind SPECSERVE_TEST_HOLD_FILE: a request stays in flight, one token long,
    for as long as the hold lasts; a cancel still ends it with its reason."""
    engine = make_engine(model)
    held = threading.Event()
    held.set()
    outs, first, finished = [], threading.Event(), {"a": threading.Event(), "b": threading.Event()}

    def on_output(o):
        outs.append(o)
        first.set()
        if o.finished:
            finished[o.request_id].set()

    loop = EngineLoop(engine, on_output, hold=held.is_set).start()
    try:
        loop.submit(req("a", PROMPTS[0], n=50))
        assert first.wait(60)                     # its prefill ran with the submit; then the hold
        loop.cancel("a", "the drain time ran out")
        assert finished["a"].wait(60)
        a = [o for o in outs if o.request_id == "a"]
        assert [t for o in a for t in o.new_token_ids] == solo(model, req("a", PROMPTS[0], n=1))
        assert (a[-1].finish_reason, a[-1].error) == ("abort", "the drain time ran out")
        loop.submit(req("b", PROMPTS[1], n=5))
        held.clear()
        assert finished["b"].wait(60)
    finally:
        held.clear()
        loop.stop()
    b = [t for o in outs if o.request_id == "b" for t in o.new_token_ids]
    assert b == solo(model, req("b", PROMPTS[1], n=5))


def test_engine_ended_requests_carry_their_reason(model):
    engine = make_engine(model)
    engine.submit(req("z", PROMPTS[0], n=50))
    engine.step()
    assert engine.cancel("z", "the server is shutting down")
    (out,) = engine.step()
    assert (out.finish_reason, out.error, out.finished) == ("abort", "the server is shutting down", True)


def test_seed_range_and_denormal_temperature_are_refused_by_name():
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\^64\), got -1"):
        SamplingParams(temperature=1.0, seed=-1).validate()
    SamplingParams(temperature=1.0, seed=2 ** 64 - 1).validate()
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or at least 1e-05, got 5e-324"):
        SamplingParams(temperature=5e-324).validate()
    torch.Generator().manual_seed(2 ** 64 - 1)   # the largest seed accepted is one torch takes
