"""The engine loop: greedy equality with transformers, batching invariance, join / cancel, limits."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from specserve.core.engine import Engine, EngineConfig, GenerationRequest, RequestRejected
from specserve.model.transformer import load_model
from specserve.core.proposer import Draft, DraftRequest, ProposerDefaults, ProposerError, StepOutcome
from specserve.methods.ngram.proposer import NgramProposer, lookup
from specserve.core.sampling import SamplingParams

PROMPTS = [
    [5, 17, 99, 3, 250, 42, 7, 7, 300, 12, 64, 128, 5, 17, 99],
    [11, 12, 13, 14, 11, 12, 13],
    [400, 3, 3, 3, 3, 3, 3, 3],
    [77],
    list(range(100, 160)),
]
MAX_NEW = 24


def engine_for(path, **cfg) -> Engine:
    model = load_model(path)
    return Engine(model, EngineConfig(**{"max_num_seqs": 4, "max_model_len": 256, **cfg}),
                  {"ngram": NgramProposer(num_draft_tokens=5)}, eos_token_ids=())


@functools.lru_cache(maxsize=8)
def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path, prompt, n=MAX_NEW) -> list[int]:
    ref = hf_model(path)
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def req(i, prompt, method, n=MAX_NEW, **kw) -> GenerationRequest:
    return GenerationRequest(str(i), prompt, SamplingParams(max_tokens=n, **kw), method)


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_greedy_equals_transformers_generate(tiny_ckpt, method):
    engine = engine_for(tiny_ckpt)
    outs = engine.generate([req(i, p, method) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        assert outs[str(i)].new_token_ids == hf_greedy(tiny_ckpt, p), f"prompt {i}"
        assert outs[str(i)].finish_reason == "length"
    if method == "ngram":
        # The repetitive prompts must have exercised multi-token acceptance.
        assert sum(o.stats.accepted_tokens for o in outs.values()) > 0
    assert engine.num_free_slots == 4


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    from conftest import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=7)


def solo_outputs(path, reqs):
    solo = {}
    for r in reqs:
        solo[r.request_id] = engine_for(path).generate([r])[r.request_id].new_token_ids
    return solo


def sixteen_requests():
    reqs = []
    for i in range(16):
        prompt = PROMPTS[i % len(PROMPTS)] + [i + 20, (7 * i) % 300]
        method = ["none", "ngram"][i % 2]
        kw = {} if i % 3 else {"temperature": 0.8, "top_k": 20, "seed": i}
        reqs.append(req(i, prompt, method, n=10 + i, **kw))
    return reqs


def test_sixteen_concurrent_requests_equal_solo(llama_ckpt):
    reqs = sixteen_requests()
    solo = solo_outputs(llama_ckpt, reqs)
    engine = engine_for(llama_ckpt, max_num_seqs=16)
    together = engine.generate(reqs)
    for r in reqs:
        assert together[r.request_id].new_token_ids == solo[r.request_id], r.request_id
    assert engine.num_free_slots == 16


def test_join_and_cancel_mid_flight_leave_others_unchanged(llama_ckpt):
    reqs = sixteen_requests()[:8]
    solo = solo_outputs(llama_ckpt, reqs)
    engine = engine_for(llama_ckpt, max_num_seqs=6)  # fewer slots than requests: some queue
    got = {r.request_id: [] for r in reqs}
    finished = {}
    victims = {"3", "6"}
    pending = list(reqs)
    for r in pending[:3]:
        engine.submit(r)
    steps = 0
    while engine.has_work() or pending:
        steps += 1
        if steps == 3:
            for r in pending[3:]:
                engine.submit(r)  # join mid-flight (some wait for a slot)
            pending = []
        if steps in (4, 6):
            for v in sorted(victims):
                if v not in finished and engine.cancel(v):
                    victims.discard(v)
                    break
        if steps < 3 and not engine.has_work():
            break
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished["3"] == "abort" and finished["6"] == "abort"
    for r in reqs:
        if r.request_id in ("3", "6"):
            assert got[r.request_id] == solo[r.request_id][:len(got[r.request_id])]
        else:
            assert got[r.request_id] == solo[r.request_id], r.request_id
            assert finished[r.request_id] == "length"
    assert engine.num_free_slots == 6
    assert not engine.has_work()


def test_cancel_waiting_request_and_unknown_id(llama_ckpt):
    engine = engine_for(llama_ckpt, max_num_seqs=1)
    engine.submit(req("a", PROMPTS[0], "none", n=5))
    engine.submit(req("b", PROMPTS[1], "none", n=5))
    engine.step()  # "a" runs, "b" waits for the only slot
    assert engine.cancel("b") and not engine.cancel("zzz")
    outs = engine.step()
    assert any(o.request_id == "b" and o.finish_reason == "abort" and o.new_token_ids == [] for o in outs)
    while engine.has_work():
        engine.step()
    assert engine.num_free_slots == 1


def test_admission_errors_are_clear(llama_ckpt):
    engine = engine_for(llama_ckpt, max_model_len=64)
    cases = [
        (req("e1", [], "none"), "the prompt is empty"),
        (req("e2", list(range(60)), "none", n=10),
         r"prompt \(60 tokens\) plus max_tokens \(10\) exceeds the model length 64"),
        (req("e3", [1, 2], "none", n=0), "max_tokens must be a positive integer, got 0"),
        (req("e4", [1, 2], "bogus"), "unknown spec_method 'bogus'; available: ngram, none"),
        (req("e5", [1, 2], "none", temperature=-1.0), "temperature must be a finite number >= 0, got -1.0"),
        (req("e5n", [1, 2], "none", temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
        (req("e5i", [1, 2], "none", temperature=float("inf")), "temperature must be a finite number >= 0, got inf"),
        (req("e5d", [1, 2], "none", temperature=1e-45),
         r"temperature must be 0 \(greedy\) or at least 1e-05, got 1e-45"),
        (req("e5s", [1, 2], "none", seed=2 ** 64), r"seed must be an integer in \[0, 2\^64\), got 18446744073709551616"),
        (req("e6n", [1, 2], "none", top_p=float("nan")), r"top_p must be in \(0, 1\], got nan"),
        (req("e6", [1, 2], "none", top_p=0.0), r"top_p must be in \(0, 1\]"),
        (req("e7", [1, 2], "none", top_k=-3), "top_k must be an integer >= 0"),
        (req("e8", [1, 99999], "none"), r"prompt token ids must lie in \[0, 512\)"),
        (req("e9", [1, 2], "none", stop=("x",)), "stop strings need a tokenizer"),
        (GenerationRequest("e10", [1, 2], SamplingParams(max_tokens=4), "ngram", num_draft_tokens=9),
         r"num_draft_tokens must be an integer in \[0, 8\] \(the server's max_draft_len\), got 9"),
        (GenerationRequest("e11", [1, 2], SamplingParams(max_tokens=4), "ngram", spec_threshold=1.5),
         r"spec_threshold must be a number in \[0, 1\], got 1.5"),
    ]
    for bad, msg in cases:
        with pytest.raises(RequestRejected, match=msg):
            engine.submit(bad)
    assert not engine.has_work()


def test_eos_and_stop_strings(llama_ckpt):
    plain = engine_for(llama_ckpt).generate([req("p", PROMPTS[0], "none", n=20)])["p"].new_token_ids
    eos = plain[5]
    model = load_model(llama_ckpt)
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_model_len=256), {"ngram": NgramProposer()},
                    eos_token_ids=(eos,), detokenize=lambda ids: " ".join(map(str, ids)) + " ")
    out = engine.generate([req("e", PROMPTS[0], "ngram", n=20)])["e"]
    first = plain.index(eos)
    assert out.new_token_ids == plain[:first + 1] and out.finish_reason == "stop"
    stop = f" {plain[2]} {plain[3]} "
    out = engine.generate([req("s", PROMPTS[0], "none", n=20, stop=(stop,))])["s"]
    assert out.new_token_ids == plain[:4] and out.finish_reason == "stop"


class ScriptedProposer(ProposerDefaults):
    """Drafts from a script: the true greedy continuation with a wrong token at chosen places,
    and a tree with a decoy sibling, so acceptance, recovery and bonus are all exercised."""

    name, needs_features = "scripted", True

    def __init__(self, truth: list[int], vocab: int, fail_every: int = 0):
        self.truth, self.vocab, self.calls, self.fail_every = truth, vocab, 0, fail_every
        self.observed: list[StepOutcome] = []
        self.features_seen: list[int] = []

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        self.calls += 1
        if self.fail_every and self.calls % self.fail_every == 0:
            raise ProposerError("drafter unloaded")
        drafts = []
        for r in requests:
            self.features_seen.append(0 if r.features is None else r.features.shape[0])
            done = len(r.token_ids) - self.prompt_len
            want = self.truth[done:done + r.max_draft_len]
            k = min(len(want), 1 + self.calls % 4)
            chain = list(want[:k])
            if self.calls % 3 == 0 and k > 1:
                chain[k - 1] = (chain[k - 1] + 1) % self.vocab  # a wrong last token
            if self.calls % 2 == 0 and chain:
                # Tree: decoy first child (wrong token), then the chain as the second branch.
                decoy = (chain[0] + 5) % self.vocab
                tokens = [decoy] + chain
                parents = [-1, -1] + list(range(1, len(chain)))
                drafts.append(Draft(tokens[:r.max_draft_len], parents[:r.max_draft_len]))
            else:
                drafts.append(Draft.chain(chain))
        return drafts

    def observe(self, outcomes):
        self.observed += outcomes

    def release(self, seq_id):
        pass


@pytest.mark.parametrize("fail_every", [0, 3])
def test_scripted_trees_and_failures_stay_lossless(llama_ckpt, fail_every):
    truth = hf_greedy(llama_ckpt, PROMPTS[0], 30)
    model = load_model(llama_ckpt)
    prop = ScriptedProposer(truth, model.cfg.vocab_size, fail_every)
    prop.prompt_len = len(PROMPTS[0])
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_model_len=256), {"scripted": prop},
                    eos_token_ids=())
    out = engine.generate([req("t", PROMPTS[0], "scripted", n=30)])["t"]
    assert out.new_token_ids == truth
    s = out.stats
    assert s.accepted_tokens > 0 and s.steps < 30
    assert s.steps + s.accepted_tokens == 29  # the prefill emitted the first token
    assert (s.proposer_errors > 0) == (fail_every > 0)
    # Features arrive for exactly the tokens committed since the last draft (prompt first).
    assert prop.features_seen[0] == len(PROMPTS[0])
    assert all(len(o.emitted) == len(o.accepted_nodes) + 1 for o in prop.observed)


def test_ngram_lookup_examples():
    assert lookup([1, 2, 3, 4, 1, 2], max_n=2, min_n=1, k=3) == [3, 4, 1]
    assert lookup([1, 2, 3, 9, 2, 3, 7, 2, 3], max_n=2, min_n=1, k=2) == [7, 2]  # latest match
    assert lookup([1, 2, 3], max_n=3, min_n=1, k=4) == []
    assert lookup([5, 6, 5], max_n=3, min_n=1, k=4) == [6, 5]


def test_prefill_groups_bound_padding_and_budget():
    from specserve.core.engine import _prefill_groups

    class S:
        def __init__(self, n):
            self.tokens = [0] * n

    seqs = [S(n) for n in (100, 10, 12, 11, 95, 5000, 9)]
    groups = [[len(s.tokens) for s in g] for g in _prefill_groups(seqs, budget=4096)]
    assert groups == [[9, 10, 11, 12], [95, 100], [5000]]


def test_ignore_eos_runs_to_max_tokens(llama_ckpt):
    plain = engine_for(llama_ckpt).generate([req("p", PROMPTS[0], "none", n=20)])["p"].new_token_ids
    eos = plain[5]
    model = load_model(llama_ckpt)
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_model_len=256), eos_token_ids=(eos,))
    out = engine.generate([req("i", PROMPTS[0], "none", n=20, ignore_eos=True)])["i"]
    assert out.new_token_ids == plain and out.finish_reason == "length"
    with pytest.raises(RequestRejected, match="ignore_eos must be a boolean"):
        engine.submit(req("bad", PROMPTS[0], "none", ignore_eos="yes"))


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_stop_token_ids_end_the_request(llama_ckpt, method):
    plain = engine_for(llama_ckpt).generate([req("p", PROMPTS[0], "none", n=20)])["p"].new_token_ids
    stop = plain[5]
    first = plain.index(stop)   # the first time that token comes
    engine = engine_for(llama_ckpt)
    out = engine.generate([req("s", PROMPTS[0], method, n=20, stop_token_ids=(stop,))])["s"]
    assert out.new_token_ids == plain[:first + 1] and out.finish_reason == "stop"
    # ignore_eos lifts the model's eos ids only, not the request's own stop tokens (as vLLM).
    out = engine.generate([req("i", PROMPTS[0], method, n=20, stop_token_ids=(stop,), ignore_eos=True)])["i"]
    assert out.new_token_ids == plain[:first + 1]
    with pytest.raises(RequestRejected, match="stop_token_ids must be a list of token ids"):
        engine.submit(req("bad", PROMPTS[0], "none", stop_token_ids=(-1,)))
