"""Remote EAGLE (ONNX runtime + engine-side RemoteProposer), without a server: lossless, equal
to the fused drafter's drafts, and unaffected by the drafter disappearing and coming back."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_tiny_checkpoint
from specserve.core.engine import Engine, EngineConfig, GenerationRequest
from specserve.model.transformer import load_model
from specserve.core.proposer import DraftRequest, ProposerError
from specserve.methods.eagle.proposer import EagleProposer
from specserve.methods.eagle.onnx_runtime import CalibrationOnnxRuntime, EagleOnnxRuntime, in_process_call
from specserve.methods.remote import RemoteProposer
from specserve.core.sampling import SamplingParams
from test_eagle import PROMPTS, random_drafter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import export_onnx  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("t"), "llama", seed=21)
    target = load_model(path)
    drafter = random_drafter(target, seed=1)
    report = export_onnx.export(target, drafter, tmp_path_factory.mktemp("onnx"))
    return target, drafter, report


class Drafter:
    """What the Triton proposal ensemble does, in-process; `down` makes calls fail like an
    unloaded model, and `reload()` brings back a fresh runtime (all sequence state lost)."""

    def __init__(self, target, report):
        self.target, self.report = target, report
        self.down = False
        self.reload()
        self.calls = 0

    def reload(self):
        c = self.target.cfg
        self.rt = EagleOnnxRuntime(str(self.report.backbone), c.num_kv_heads, c.head_dim)
        self.cal = CalibrationOnnxRuntime(str(self.report.calibration))

    def __call__(self, inputs):
        self.calls += 1
        if self.down:
            raise RuntimeError("model 'eagle_proposal' is not ready")
        return in_process_call(self.rt, self.cal)(inputs)


class FakeClock:
    """The proposer's clock, advanced by the test (back-off without waiting)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_failed_calls_back_off_exponentially_and_a_success_resets(setup):
    target, _, report = setup
    drafter, clock = Drafter(target, report), FakeClock()
    remote = RemoteProposer("eagle", drafter, max_draft_len=4, threshold=None, clock=clock)
    prompt = PROMPTS[0]
    with torch.inference_mode():
        feats = target.forward(_prefill(target, prompt), None).hidden[0]

    def propose():
        return remote.propose([DraftRequest(3, prompt + [42], 4, SamplingParams(), None, feats)])

    drafter.down = True
    waits = []
    for _ in range(5):
        calls = drafter.calls
        with pytest.raises(ProposerError):
            propose()
        assert drafter.calls == calls + 1            # it called (and failed)...
        with pytest.raises(ProposerError, match="backing off after failed calls"):
            propose()                                 # ...then does not call until the back-off ends
        assert drafter.calls == calls + 1
        waits.append(remote._retry_at - clock.now)
        clock.now = remote._retry_at
    assert waits == [0.25, 0.5, 1.0, 2.0, 4.0]
    drafter.down = False
    assert len(propose()[0].tokens) == 4 and remote._backoff == 0.0


def make_engine(target, proposers):
    return Engine(target, EngineConfig(max_num_seqs=4, max_model_len=256, max_draft_len=5), proposers,
                  eos_token_ids=())


def test_remote_drafts_equal_fused_drafts(setup):
    target, drafter, report = setup
    fused = EagleProposer(drafter, target, max_num_seqs=2, max_model_len=256, max_draft_len=5, threshold=None)
    remote = RemoteProposer("eagle", Drafter(target, report), max_draft_len=5, threshold=None, timeout_s=600)
    prompt = PROMPTS[0]
    with torch.inference_mode():
        feats = target.forward(_prefill(target, prompt), None).hidden[0]  # [T, D] prompt features
    req = lambda: DraftRequest(7, prompt + [42], 5, SamplingParams(), None, feats)
    a, b = fused.propose([req()]), remote.propose([req()])
    assert a[0].tokens == b[0].tokens and len(a[0].tokens) == 5


def _prefill(target, prompt):
    from specserve.core.masks import build_mask, chain_parents
    from specserve.core.forward import ForwardBatch

    T = len(prompt)
    mask, pos = build_mask([0], [chain_parents(T)], T)
    z = torch.zeros(1, dtype=torch.long)
    return ForwardBatch(torch.tensor([prompt]), pos, z, z, mask)


def test_remote_greedy_equals_plain_and_threshold_cuts(setup):
    target, _, report = setup
    remote = RemoteProposer("eagle", Drafter(target, report), max_draft_len=5, threshold=0.2, timeout_s=600)
    engine = make_engine(target, {"eagle": remote})
    reqs = lambda m: [GenerationRequest(f"{m}{i}", p, SamplingParams(max_tokens=16), m) for i, p in enumerate(PROMPTS)]
    plain, spec = engine.generate(reqs("none")), engine.generate(reqs("eagle"))
    for i in range(len(PROMPTS)):
        assert spec[f"eagle{i}"].new_token_ids == plain[f"none{i}"].new_token_ids
    assert not remote._seqs  # every sequence released


def test_drafter_unload_and_reload_mid_stream_stays_lossless(setup):
    target, _, report = setup
    drafter = Drafter(target, report)
    clock = FakeClock()   # one second per step: every back-off has passed by the next step
    remote = RemoteProposer("eagle", drafter, max_draft_len=4, threshold=None,
                            release=lambda ids: drafter.rt.release(ids), clock=clock)
    engine = make_engine(target, {"eagle": remote})
    reqs = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=24), "eagle") for i, p in enumerate(PROMPTS)]
    want = make_engine(target, {}).generate(
        [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=24), "none") for i, p in enumerate(PROMPTS)])
    for r in reqs:
        engine.submit(r)
    got = {r.request_id: [] for r in reqs}
    final = {}
    step = 0
    while engine.has_work():
        step += 1
        clock.now += 1.0
        if step == 4:
            drafter.down = True          # unloaded: calls fail
        if step == 7:
            drafter.down = False
            drafter.reload()             # loaded again: sequence state is gone → re-prime
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                final[out.request_id] = out
    for rid, out in want.items():
        assert got[rid] == out.new_token_ids, rid
        assert final[rid].finish_reason == "length"
    stats = [final[r.request_id].stats for r in reqs]
    assert all(s.proposer_errors == 3 for s in stats)
    # After the reload every sequence drafted again (re-primed from the engine-side history).
    # (3 failed steps and at most one final step with no room to draft)
    assert all(s.drafts >= s.steps - 4 for s in stats)
    remote.flush()  # releases are sent on the drafter's worker thread, never waited for by the engine
    assert set(drafter.rt.states) == set()  # released on the fresh runtime too


def test_a_hung_drafter_times_out_and_costs_only_speculation(setup):
    """A drafter that stops answering (hangs, not errors): the step waits at most timeout_s, later
    steps decode plainly without calling while the call is outstanding, output stays exact, and
    drafting resumes once the drafter answers again."""
    import threading

    target, _, report = setup
    drafter = Drafter(target, report)
    hang, unhang = threading.Event(), threading.Event()

    def call(inputs):
        if hang.is_set():
            assert unhang.wait(60)
        return drafter(inputs)

    clock = FakeClock()
    remote = RemoteProposer("eagle", call, max_draft_len=4, threshold=None, timeout_s=0.2, clock=clock)
    engine = make_engine(target, {"eagle": remote})
    reqs = [GenerationRequest(f"h{i}", p, SamplingParams(max_tokens=30), "eagle") for i, p in enumerate(PROMPTS)]
    want = make_engine(target, {}).generate(
        [GenerationRequest(f"h{i}", p, SamplingParams(max_tokens=30), "none") for i, p in enumerate(PROMPTS)])
    for r in reqs:
        engine.submit(r)
    got, final, step = {r.request_id: [] for r in reqs}, {}, 0
    while engine.has_work():
        step += 1
        clock.now += 1.0
        if step == 3:
            hang.set()
        if step == 6:
            hang.clear()
            unhang.set()    # the hung call returns; the next step calls again
            remote.flush()
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                final[out.request_id] = out
    for rid, out in want.items():
        assert got[rid] == out.new_token_ids, rid
    stats = [final[r.request_id].stats for r in reqs]
    # steps 3, 4, 5 decoded plainly (one timeout, two skipped calls), then drafting resumed
    assert all(s.proposer_errors == 3 for s in stats) and all(s.drafts >= s.steps - 4 for s in stats)


def test_remote_requests_at_most_probe_beyond_last_kept():
    """With a threshold, each step asks the remote drafter for at most PROBE tokens beyond what
    the cut kept in that sequence's previous step (every requested position costs a drafter
    forward); without one (or with spec_threshold 0), always the full length."""
    asked: list[list[int]] = []

    def call(inputs):  # drafts 10, 11, … with acceptance 0.9, 0.9, 0.1, …: a 0.5 cut keeps 2
        asked.append(inputs["max_draft_len"].tolist())
        B, K = len(inputs["seq_ids"]), int(inputs["max_draft_len"].max())
        probs = np.full((B, K), 0.1, dtype=np.float32)
        probs[:, :2] = 0.9
        return {"draft_tokens": np.tile(np.arange(10, 10 + K), (B, 1)), "accept_prob": probs,
                "unknown": np.zeros(B, dtype=bool)}

    def steps(remote, threshold=None):
        drafts = []
        for n in (4, 3, 1):  # features committed before each step
            tokens = list(range(sum((4, 3, 1)[:len(drafts) + 1]) + 1))
            drafts.append(remote.propose([DraftRequest(0, tokens, 8, SamplingParams(), None, torch.zeros(n, 8),
                                                       threshold)])[0].tokens)
        return drafts

    probe = min(8, 2 + RemoteProposer.PROBE)
    assert probe < 8
    remote = RemoteProposer("eagle", call, max_draft_len=8, threshold=0.5)
    assert steps(remote) == [[10, 11]] * 3
    assert asked == [[8], [probe], [probe]]
    asked.clear()
    assert steps(RemoteProposer("eagle", call, max_draft_len=8, threshold=None)) == [list(range(10, 18))] * 3
    assert asked == [[8], [8], [8]]
    asked.clear()
    steps(RemoteProposer("eagle", call, max_draft_len=8, threshold=0.5), threshold=0.0)  # per-request: fixed
    assert asked == [[8], [8], [8]]


# -- seeded rows: the remote drafter proposes with the request's noise (core/sampling.py) --------------

SEEDED = [SamplingParams(max_tokens=24, temperature=0.7, top_k=50, seed=11),
          SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=2 ** 64 - 3)]


def test_seeded_remote_drafts_equal_fused_seeded_drafts(setup):
    """Same weights, same noise: the ONNX drafter's seeded draft is the fused one's, token for
    token (and not its greedy draft, so the seed did travel)."""
    target, drafter, report = setup
    prompt = PROMPTS[0]
    with torch.inference_mode():
        feats = target.forward(_prefill(target, prompt), None).hidden[0]  # [T, D] prompt features
    for i, params in enumerate(SEEDED):
        fused = EagleProposer(drafter, target, max_num_seqs=2, max_model_len=256, max_draft_len=5, threshold=None)
        remote = RemoteProposer("eagle", Drafter(target, report), max_draft_len=5, threshold=None, timeout_s=600)
        req = lambda p, seed: DraftRequest(7, prompt + [42], 5, p, None, feats, seed=seed)
        a, b = fused.propose([req(params, params.seed)]), remote.propose([req(params, params.seed)])
        assert a[0].tokens == b[0].tokens and len(a[0].tokens) == 5, params
        greedy = RemoteProposer("eagle", Drafter(target, report), max_draft_len=5, threshold=None, timeout_s=600)
        assert greedy.propose([req(SamplingParams(), None)])[0].tokens != b[0].tokens, params


def _without_seed(drafter):
    """The drafter's call with the rows' sampling dropped: what a drafter that ignores the seed
    computes (greedy drafts for every row)."""
    return lambda inputs: drafter({k: v for k, v in inputs.items() if not k.startswith("row_")})


def test_seeded_remote_equals_none_and_accepts_more_than_greedy_drafting(setup):
    target, _, report = setup
    reqs = lambda m: [GenerationRequest(f"{m}{i}{j}", p, s, m) for i, p in enumerate(PROMPTS)
                      for j, s in enumerate(SEEDED)]
    want = make_engine(target, {}).generate(reqs("none"))
    accepted = {}
    for kind, call in (("coupled", Drafter(target, report)), ("greedy", _without_seed(Drafter(target, report)))):
        remote = RemoteProposer("eagle", call, max_draft_len=5, threshold=None, timeout_s=600)
        got = make_engine(target, {"eagle": remote}).generate(reqs("eagle"))
        for rid, out in want.items():
            assert got[rid.replace("none", "eagle")].new_token_ids == out.new_token_ids, (kind, rid)
        stats = [o.stats for o in got.values()]
        assert all(s.proposer_errors == 0 and s.draft_tokens > 0 for s in stats), kind
        accepted[kind] = sum(s.accepted_tokens for s in stats)
    assert accepted["coupled"] > accepted["greedy"], accepted
