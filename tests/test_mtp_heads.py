"""MTP heads: which token each head predicts (pinned against a target forward), the proposer's
contract (shapes, probs, features kept, a raise consumes nothing), lossless greedy output, the
committed demo heads' agreement, folder/target mismatch, and the ONNX export's parity."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_checkpoint
from specserve.core.engine import Engine, EngineConfig, GenerationRequest
from specserve.core.forward import ForwardBatch
from specserve.model.transformer import CheckpointError, load_model
from specserve.core.proposer import DraftRequest, ProposerError
from specserve.methods.mtp.heads import (MTPConfig, MTPHeads, _target_fields, export_mtp_onnx, head_agreement,
                                     load_mtp_heads, save_mtp_heads)
from specserve.methods.mtp.heads_proposer import MTPHeadsProposer
from specserve.core.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 7, 300, 12], [11, 12, 13, 14, 11, 12, 13], [77], list(range(100, 140))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("mtp"), "llama", seed=21))


def random_heads(target, k=3, seed=0) -> MTPHeads:
    torch.manual_seed(seed)
    heads = MTPHeads(MTPConfig(**_target_fields(target), num_heads=k, intermediate_size=32), target.lm_head.weight)
    with torch.no_grad():
        for p in heads.heads.parameters():
            p.normal_(0, 0.2)
    return heads.eval().requires_grad_(False)


def full_forward_hidden(target, tokens: list[int]) -> torch.Tensor:
    T = len(tokens)
    zero = torch.zeros(1, dtype=torch.long)
    batch = ForwardBatch(torch.tensor([tokens]), torch.arange(T)[None], zero, zero,
                         torch.ones(T, T, dtype=torch.bool).tril()[None])
    with torch.inference_mode():
        return target.forward(batch, cache=None).hidden[0]  # [T, D]


class Recorder(MTPHeadsProposer):
    """Records, per call, each request's token_ids and the feature row the heads read."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[tuple[list[int], torch.Tensor]] = []

    def propose(self, requests):
        drafts = super().propose(requests)
        self.calls += [(list(r.token_ids), self._seqs[r.seq_id].feature.clone()) for r in requests]
        return drafts


def test_heads_read_the_last_committed_position_and_draft_after_the_pending_token(tiny):
    """In the engine, the row the heads read is the target's final hidden state at t = the last
    committed position (len(token_ids) - 2; token t+1 is pending), and head j's token is drafted
    at position t+2+j: its logits are lm_head(head_j(f_t))."""
    heads = random_heads(tiny)
    prop = Recorder(heads, max_draft_len=3)
    engine = Engine(tiny, EngineConfig(max_num_seqs=4, max_model_len=256, max_draft_len=3), {"mtp_heads": prop},
                    eos_token_ids=())
    engine.generate([GenerationRequest(str(i), p, SamplingParams(max_tokens=12), "mtp_heads")
                     for i, p in enumerate(PROMPTS)])
    assert len(prop.calls) >= 8
    for token_ids, feature in prop.calls:
        hidden = full_forward_hidden(tiny, token_ids)  # [T, D]; row T-1 is the pending token
        t = len(token_ids) - 2
        assert torch.allclose(feature, hidden[t], atol=1e-4)
        # The target's own head on f_t predicts the pending token (greedy decoding emitted it).
        assert int(tiny.logits(hidden[t]).argmax()) == token_ids[t + 1]
    assert prop._seqs == {}  # released


def test_proposer_shapes_and_probs(tiny):
    heads = random_heads(tiny, k=3)
    prop = MTPHeadsProposer(heads, max_draft_len=8)
    D, V = tiny.cfg.hidden_size, tiny.cfg.vocab_size
    f = torch.randn(4, D)
    assert heads(f[:2]).shape == (2, 3, V) and heads.hidden(f[:2]).shape == (2, 3, D)
    greedy, sampled = SamplingParams(max_tokens=9), SamplingParams(max_tokens=9, temperature=0.5, top_k=7)
    got = prop.propose([DraftRequest(0, [1, 2, 3, 4, 5], 8, greedy, features=f),
                        DraftRequest(1, [1, 2], 2, sampled, torch.Generator().manual_seed(0), features=f[:1])])
    assert [len(d) for d in got] == [3, 2]  # ≤ k heads, ≤ the request's max_draft_len
    logits = heads(f[3:4])[0]  # [k, V]: the last feature row
    assert got[0].tokens == logits.argmax(-1).tolist() and got[0].parents == [-1, 0, 1]
    assert torch.allclose(got[0].probs, logits.softmax(-1))
    assert int((got[1].probs > 0).sum(-1).eq(7).all()) and torch.allclose(got[1].probs.sum(-1), torch.ones(2))
    # Later calls carry only the newly committed features; the proposer keeps the last row.
    again = prop.propose([DraftRequest(0, [1, 2, 3, 4, 5, 6, 7], 8, greedy, features=f[:2])])
    assert again[0].tokens == heads(f[1:2])[0].argmax(-1).tolist()


def test_a_raise_consumes_no_features(tiny):
    prop = MTPHeadsProposer(random_heads(tiny), max_draft_len=3)
    f = torch.randn(3, tiny.cfg.hidden_size)
    greedy = SamplingParams(max_tokens=9)
    prop.propose([DraftRequest(0, [1, 2, 3, 4], 3, greedy, features=f)])
    with pytest.raises(ProposerError) as e:
        prop.propose([DraftRequest(0, [1, 2, 3, 4, 5, 6, 7], 3, greedy, features=None)])
    assert str(e.value) == ("sequence 0: no feature for its last committed position 5 "
                            "(the proposer holds the feature of position 2)")
    assert prop._seqs[0].committed == 3  # unchanged: the engine resends the features next call
    # Only the newest row matters: features lost upstream do not poison later calls.
    got = prop.propose([DraftRequest(0, [1, 2, 3, 4, 5, 6, 7], 3, greedy, features=f[:2])])
    assert prop._seqs[0].committed == 6 and torch.equal(prop._seqs[0].feature, f[1])
    assert got[0].tokens == prop.heads(f[1:2])[0].argmax(-1).tolist()
    # Nothing new committed (no features): the stored row is still the newest.
    assert prop.propose([DraftRequest(0, [1, 2, 3, 4, 5, 6, 7], 3, greedy)])[0].tokens == got[0].tokens
    with pytest.raises(ProposerError, match=r"sequence 1: .* \(the proposer holds nothing\)"):
        prop.propose([DraftRequest(1, [1, 2], 3, greedy)])
    prop.release(0)
    assert prop._seqs == {}


def test_greedy_mtp_heads_equal_plain_decoding(tiny):
    prop = MTPHeadsProposer(random_heads(tiny, seed=3), max_draft_len=3)
    engine = Engine(tiny, EngineConfig(max_num_seqs=4, max_model_len=256, max_draft_len=3), {"mtp_heads": prop},
                    eos_token_ids=())
    reqs = lambda m: [GenerationRequest(f"{m}{i}", p, SamplingParams(max_tokens=20), m)  # noqa: E731
                      for i, p in enumerate(PROMPTS)]
    plain, spec = engine.generate(reqs("none")), engine.generate(reqs("mtp_heads"))
    for i in range(len(PROMPTS)):
        assert spec[f"mtp_heads{i}"].new_token_ids == plain[f"none{i}"].new_token_ids
    assert sum(o.stats.draft_tokens for o in spec.values()) > 0


def test_sampled_mtp_heads_follow_target_distribution(tmp_path):
    """Joint of generated tokens 2 and 3 (drafted by heads 0 and 1, verified in one step) vs the
    exact target, as the EAGLE and DSPark sampled tests check."""
    from test_eagle import two_token_joint_tv

    target = load_model(make_tiny_checkpoint(tmp_path / "small", "llama", vocab_size=8, seed=5))
    prop = MTPHeadsProposer(random_heads(target, k=2, seed=4), max_draft_len=2)
    engine = Engine(target, EngineConfig(max_num_seqs=64, max_model_len=256, max_draft_len=2), {"mtp_heads": prop},
                    eos_token_ids=())
    tv = two_token_joint_tv(target, engine, "mtp_heads")
    assert tv < 0.06, f"total variation {tv:.4f}"


def test_save_load_roundtrip_and_a_folder_for_another_target(tiny, tmp_path):
    heads = random_heads(tiny)
    save_mtp_heads(heads, tmp_path / "mtp")
    again = load_mtp_heads(tmp_path / "mtp", tiny)
    f = torch.randn(2, tiny.cfg.hidden_size)
    assert torch.equal(again(f), heads(f))
    other = load_model(make_tiny_checkpoint(tmp_path / "other", "llama", vocab_size=300, seed=2))
    with pytest.raises(CheckpointError) as e:
        load_mtp_heads(tmp_path / "mtp", other)
    assert str(e.value) == (f"MTP heads {tmp_path / 'mtp'} were made for another target: "
                            f"vocab_size 512 (target: 300)")
    with pytest.raises(CheckpointError) as e:
        load_mtp_heads(DEMO / "mtp", tiny)
    assert str(e.value) == (f"MTP heads {DEMO / 'mtp'} were made for another target: hidden_size 384 (target: 64), "
                            f"vocab_size 8192 (target: 512), target_num_layers 18 (target: 2)")


def test_onnx_export_matches_torch(tiny, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    heads = random_heads(tiny)
    export_mtp_onnx(heads, tmp_path / "mtp.onnx")
    f = torch.randn(5, tiny.cfg.hidden_size)
    got = ort.InferenceSession(str(tmp_path / "mtp.onnx"), providers=["CPUExecutionProvider"]).run(
        ["logits"], {"features": f.numpy()})[0]
    assert got.shape == (5, 3, tiny.cfg.vocab_size)
    assert abs(torch.from_numpy(got) - heads(f)).max() < 1e-4


# -- the committed demo heads -----------------------------------------------------------------------

def test_demo_heads_reach_their_cards_agreement():
    """A cheap recheck of models/demo/mtp/training.json's recheck_sample (same rows, recomputed)."""
    sys.path.insert(0, str(ROOT / "training"))
    from train_mtp import recheck_rows
    from tokenizers import Tokenizer

    card = json.loads((DEMO / "mtp" / "training.json").read_text())["eval"]["recheck_sample"]
    target = load_model(DEMO / "target")
    heads = load_mtp_heads(DEMO / "mtp", target)
    rows = recheck_rows(target, Tokenizer.from_file(str(DEMO / "target" / "tokenizer.json")))
    got = head_agreement(target, heads, rows)
    assert got == pytest.approx(card["agreement_per_head"], abs=0.01)
    assert got[0] > 0.5 and got == sorted(got, reverse=True)  # nearer tokens are easier
