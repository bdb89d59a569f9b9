"""DFlash (specserve/methods/dflash/): greedy output equals plain decoding on the demo model;
sampled output follows the target distribution; the bounded memory keeps exactly what training
computes and stays within W + n/W + r; the repetition guard triggers and releases; spec_fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_checkpoint
from specserve.core.engine import Engine, EngineConfig, GenerationRequest, RequestRejected
from specserve.model.transformer import load_model
from specserve.methods.dflash.drafter import DFlashDrafter, dflash_config_for, load_dflash, save_dflash
from specserve.methods.dflash.proposer import DFlashProposer, stack_views
from specserve.methods.dflash.memory import (SequenceMemory, batched_views, budget_bytes,
                                               full_feature_bytes)
from specserve.methods.ngram.proposer import NgramProposer
from specserve.core.repetition import RepetitionGuard, repeated_period
from specserve.core.sampling import SamplingParams
from specserve.serving.params import BadRequest, make_request_config
from test_eagle import two_token_joint_tv

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"


def random_dflash(target, seed: int, **cfg) -> DFlashDrafter:
    torch.manual_seed(seed)
    d = DFlashDrafter(dflash_config_for(target, **cfg))
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    return d.eval().requires_grad_(False)


# -- the bounded memory ----------------------------------------------------------------------------

def test_incremental_memory_equals_the_batched_views_training_uses():
    """Fed in uneven chunks, the server's memory holds exactly what batched_views computes for
    the same positions (ring, anchors, pool), so training sees the memory the server keeps."""
    torch.manual_seed(0)
    W, D, r, rank = 4, 16, 3, 5
    from specserve.methods.dflash.memory import SlotPool

    pool = SlotPool(D, r, rank)
    fused = torch.randn(1, 40, D)
    positions = [1, 3, 4, 5, 8, 9, 12, 13, 27, 40]
    views = batched_views(fused, torch.tensor([positions]), W, pool)
    for a, p in enumerate(positions):
        mem = SequenceMemory(W, D, r, rank)
        i = 0
        for step in (1, 3, 5, 2, 7):
            while i < p:
                j = min(p, i + step)
                mem.append(fused[0, i:j], pool)
                i = j
        ring, ring_valid, anchors, anchor_valid, pooled = stack_views([mem.view()], W)
        assert torch.equal(ring_valid[0], views.ring_valid[a])
        assert torch.allclose(ring[0], views.ring[a])
        k = int(views.anchor_valid[a].sum())
        assert int(anchor_valid.sum()) == k == max(0, (p - W) // W)
        assert torch.allclose(anchors[0, :k], views.anchors[a, :k], atol=1e-6)
        assert torch.allclose(pooled[0], views.pool[a], atol=1e-5)
        assert bool(pooled.abs().sum() > 0) == (p > W)   # the pool holds what left the ring


def test_memory_of_a_4k_sequence_stays_within_the_budget():
    W, D, r, rank = 32, 384, 64, 64
    from specserve.methods.dflash.memory import SlotPool

    pool = SlotPool(D, r, rank)
    mem = SequenceMemory(W, D, r, rank)
    torch.manual_seed(0)
    for chunk in torch.randn(4096, D).split(8):   # decode-sized steps
        mem.append(chunk, pool)
    view = mem.view()
    assert mem.n == 4096
    assert view.ring.shape == (W, D)
    assert view.anchors.shape == ((4096 - W) // W, D)   # 127 windows have left the ring
    assert view.pool.shape == (r, rank)
    assert mem.num_bytes() <= budget_bytes(4096, W, r, rank, D)
    assert mem.num_bytes() == 262656                     # (32 + 127) · 384 · 4 + 64 · 66 · 4 + 384 · 4
    assert mem.num_bytes() / full_feature_bytes(4096, D) < 0.05   # vs keeping every token's vector


# -- the repetition guard --------------------------------------------------------------------------

def test_repeated_period_pins_period_and_length():
    assert repeated_period([9] + [1, 2] * 8, min_len=15) == 2
    assert repeated_period([7] * 15) == 1
    assert repeated_period([7] * 14) is None                      # shorter than min_len
    assert repeated_period(list(range(3)) * 5) == 3
    assert repeated_period(list(range(9)) * 3) is None            # period 9 > max_period 8
    assert repeated_period([1, 2] * 7 + [3]) is None              # the last token breaks it
    with pytest.raises(ValueError, match="1 <= max_period < min_len"):
        RepetitionGuard(min_len=8, max_period=8)


def test_guard_triggers_on_a_repeated_pattern_and_releases_after_it():
    guard = RepetitionGuard()
    stream = list(range(100, 120)) + [5, 6, 7] * 8 + list(range(200, 220))
    on = [guard.active(stream[:i]) for i in range(1, len(stream) + 1)]
    # The pattern starts at index 20; the guard turns on once 15 of its tokens are out (index 34)
    # and off at the first token that breaks it (index 44).
    assert on.index(True) == 34
    assert on[34:44] == [True] * 10 and not any(on[44:]) and not any(on[:34])


# -- in process, on the demo model -----------------------------------------------------------------

@pytest.fixture(scope="module")
def demo():
    target = load_model(DEMO / "target")
    from tokenizers import Tokenizer

    return target, Tokenizer.from_file(str(DEMO / "target" / "tokenizer.json"))


def _engine(target, drafter, max_model_len=1024) -> Engine:
    proposer = DFlashProposer(drafter, target, max_num_seqs=4)
    return Engine(target, EngineConfig(max_num_seqs=4, max_model_len=max_model_len),
                  {"dflash": proposer, "ngram": NgramProposer()})


def test_greedy_dflash_equals_plain_on_the_demo_model(demo):
    """A batch of rows: held-out prompts and a prompt of 700 tokens (21 windows of W = 32 have
    left the ring: anchors and pool in use). Every output equals plain decoding token for token."""
    target, tok = demo
    drafter = load_dflash(DEMO / "dflash", target)
    rows = [json.loads(line)["prompt"] for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()]
    prompts = [tok.encode(p).ids for p in (rows[0], rows[5], rows[-1])]
    prompts.append(tok.encode((ROOT / "specserve" / "core" / "engine.py").read_text()).ids[:700])
    engine = _engine(target, drafter)
    reqs = lambda m: [GenerationRequest(f"{m}{i}", p, SamplingParams(max_tokens=32), m) for i, p in enumerate(prompts)]
    spec = engine.generate(reqs("dflash"))
    plain = engine.generate(reqs("none"))
    for i in range(len(prompts)):
        assert spec[f"dflash{i}"].new_token_ids == plain[f"none{i}"].new_token_ids, i
    stats = [spec[f"dflash{i}"].stats for i in range(len(prompts))]
    assert all(s.proposer_errors == 0 for s in stats)
    assert sum(s.accepted_tokens for s in stats) > 0
    assert engine.proposers["dflash"].memory(0) is None   # released with its sequence


def test_guard_steps_a_repeating_row_to_its_fallback_and_back(demo):
    """A guard of 6 tokens / period <= 3 on a prompt after which the demo target's output repeats
    for a while: the row drafts with its fallback (ngram) while the pattern lasts, counted in
    spec_stats, and returns to DFlash when the output breaks it; DFlash kept taking the
    features meanwhile (no proposer errors), and the output equals plain decoding."""
    target, tok = demo
    guard = RepetitionGuard(min_len=6, max_period=3)
    proposer = DFlashProposer(load_dflash(DEMO / "dflash", target), target, max_num_seqs=2, repetition_guard=guard)
    engine = Engine(target, EngineConfig(max_num_seqs=2, max_model_len=512),
                    {"dflash": proposer, "ngram": NgramProposer()})
    prompt = tok.encode("a = 1\n" * 10 + "def f(").ids
    engine.submit(GenerationRequest("d", prompt, SamplingParams(max_tokens=48), "dflash"))
    engine.submit(GenerationRequest("n", prompt, SamplingParams(max_tokens=48), "none"))
    seq = engine._by_id["d"]
    states, expected, out = [], [], {"d": [], "n": []}
    while engine.has_work():
        decoding = seq.slot >= 0 and seq.num_output >= 1   # after the prefill step
        want = guard.active(seq.tokens)                     # what the next decode step must see
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        if decoding:
            states.append(seq.guarded)
            expected.append(want)
    assert out["d"] == out["n"]
    assert states == expected
    on = states.index(True)
    assert not any(states[:on]) and False in states[on:]          # triggered, then released
    st = seq.stats
    assert (st.guard_activations, st.guard_steps) == (1, sum(states)) and st.proposer_errors == 0
    assert st.to_dict()["guard_steps"] == st.guard_steps


def test_spec_fallback_is_validated():
    with pytest.raises(BadRequest, match=r'^sampling_parameters.spec_fallback must name a method other than '
                                         r'dflash, got "dflash"$'):
        make_request_config('{"spec_fallback": "dflash"}', None, None)
    with pytest.raises(BadRequest, match=r"^sampling_parameters.spec_fallback must be a string, got 3$"):
        make_request_config('{"spec_fallback": 3}', None, None)
    assert make_request_config('{"spec_fallback": "none"}', None, None).fallback_method == "none"


def test_engine_refuses_an_unknown_fallback(tmp_path):
    target = load_model(make_tiny_checkpoint(tmp_path, "llama", seed=3))
    engine = _engine(target, random_dflash(target, 1, num_layers=1), max_model_len=256)
    req = GenerationRequest("a", [1, 2, 3], SamplingParams(max_tokens=4), "dflash", fallback_method="eagle")
    with pytest.raises(RequestRejected, match=r"^unknown fallback method 'eagle'; available: dflash, ngram, none$"):
        engine.check(req)
    req = GenerationRequest("a", [1, 2, 3], SamplingParams(max_tokens=4), "dflash", fallback_method="dflash")
    with pytest.raises(RequestRejected, match=r"^spec_fallback 'dflash' cannot stand in for dflash"):
        engine.check(req)


def test_sampled_dflash_follows_target_distribution(tmp_path):
    """Joint of generated tokens 2 and 3 (drafted in one block, verified in one step) vs the exact
    target joint: the block's own per-position q is what verification needs."""
    target = load_model(make_tiny_checkpoint(tmp_path / "small", "llama", vocab_size=8, seed=5))
    drafter = random_dflash(target, 2, num_layers=1, window=2, pool_slots=4, pool_rank=8, block_size=3)
    proposer = DFlashProposer(drafter, target, max_num_seqs=64)
    engine = Engine(target, EngineConfig(max_num_seqs=64, max_model_len=64, max_draft_len=2),
                    {"dflash": proposer, "ngram": NgramProposer()}, eos_token_ids=())
    tv = two_token_joint_tv(target, engine, "dflash")
    assert tv < 0.06, f"total variation {tv:.4f}"


def test_save_and_load_roundtrip(tmp_path):
    target = load_model(make_tiny_checkpoint(tmp_path / "t", "llama", seed=3))
    drafter = random_dflash(target, 4, num_layers=2, window=8)
    save_dflash(drafter, tmp_path / "d", dtype=torch.float32)
    loaded = load_dflash(tmp_path / "d", target, block_size=4)
    assert loaded.cfg.block_size == 4 and loaded.cfg.window == 8
    for (k, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k


def test_serve_finds_every_drafter_beside_the_demo_target():
    from specserve.cli.checks import CliError, resolve_drafters
    from specserve.methods import registry

    target = DEMO / "target"
    found = resolve_drafters(target, [], False)
    assert [(m, Path(f).name) for m, f in found] == [(m, m) for m in registry.folder_methods()]
    assert resolve_drafters(target, [f"dflash={DEMO / 'dflash'}"], False) == (("dflash", str(DEMO / "dflash")),)
    with pytest.raises(CliError, match="unknown method 'flash'; drafters: eagle, dflash, draft, mtp$"):
        resolve_drafters(target, ["flash=x"], False)


def test_confidence_threshold_cuts_the_block(tmp_path):
    """spec_threshold on DFlash: drafted positions are kept while the product of the drafter's
    top-1 probabilities stays >= it; 1.0 keeps none, 0 keeps the whole block; output unchanged."""
    target = load_model(make_tiny_checkpoint(tmp_path, "llama", seed=3))
    proposer = DFlashProposer(random_dflash(target, 1, num_layers=1, window=4), target, max_num_seqs=4)
    engine = Engine(target, EngineConfig(max_num_seqs=4, max_model_len=256),
                    {"dflash": proposer, "ngram": NgramProposer()}, eos_token_ids=())
    prompt = [5, 17, 99, 3, 250, 42, 7, 7, 300, 12]
    got = {th: engine.generate([GenerationRequest("r", prompt, SamplingParams(max_tokens=12), "dflash",
                                                  spec_threshold=th)])["r"] for th in (0.0, 0.5, 1.0)}
    plain = engine.generate([GenerationRequest("p", prompt, SamplingParams(max_tokens=12), "none")])["p"]
    assert all(o.new_token_ids == plain.new_token_ids for o in got.values())
    assert got[1.0].stats.draft_tokens == 0
    # nothing is accepted from this random drafter: one token per step, so step i (output i) has
    # room min(7, 12 - i - 1): full blocks of 7, then what is left
    assert got[0.0].stats.draft_tokens == sum(min(7, 12 - i - 1) for i in range(1, 11)) == 49
    assert got[0.0].stats.draft_tokens > got[0.5].stats.draft_tokens


def test_block_size_per_request_in_one_batch(tmp_path):
    """dflash_block_size per request: rows of one step with B = 3, 4 and 16 (and the proposer's
    default 8) each draft whole blocks of their own B - 1 (capped by the room left), in one batch;
    outputs equal plain decoding. The random drafter accepts nothing, so step i (output i) drafts
    min(B - 1, 12 - i - 1)."""
    target = load_model(make_tiny_checkpoint(tmp_path, "llama", seed=3))
    proposer = DFlashProposer(random_dflash(target, 1, num_layers=1, window=4), target, max_num_seqs=4,
                              threshold=0.0)
    engine = Engine(target, EngineConfig(max_num_seqs=4, max_model_len=256, max_draft_len=15),
                    {"dflash": proposer, "ngram": NgramProposer()}, eos_token_ids=())
    prompt = [5, 17, 99, 3, 250, 42, 7, 7, 300, 12]
    sizes = {"b3": 3, "b4": 4, "b16": 16, "default": None}
    got = engine.generate([GenerationRequest(rid, prompt, SamplingParams(max_tokens=12), "dflash",
                                             options=None if b is None else {"dflash_block_size": b})
                           for rid, b in sizes.items()])
    plain = engine.generate([GenerationRequest("p", prompt, SamplingParams(max_tokens=12), "none")])["p"]
    for rid, b in sizes.items():
        assert got[rid].new_token_ids == plain.new_token_ids
        assert got[rid].stats.draft_tokens == sum(min((b or 8) - 1, 12 - i - 1) for i in range(1, 11)), rid


@pytest.mark.parametrize("options, method, message", [
    ({"dflash_block_size": 1}, "dflash",
     "dflash_block_size must be an integer in [2, 16] (the drafter's max_block_size), got 1"),
    ({"dflash_block_size": 17}, "dflash",
     "dflash_block_size must be an integer in [2, 16] (the drafter's max_block_size), got 17"),
    ({"dflash_block_size": 4}, "ngram", "dflash_block_size applies only to spec_method dflash, not to spec_method 'ngram'"),
    ({"mtp_tree_budget": 4}, "dflash", "mtp_tree_budget applies only to spec_method (a method not served here), "
                                       "not to spec_method 'dflash'"),
])
def test_block_size_option_is_checked(tmp_path, options, method, message):
    target = load_model(make_tiny_checkpoint(tmp_path, "llama", seed=3))
    engine = Engine(target, EngineConfig(max_num_seqs=2, max_model_len=64),
                    {"dflash": DFlashProposer(random_dflash(target, 1, num_layers=1, window=4), target, max_num_seqs=2),
                     "ngram": NgramProposer()})
    with pytest.raises(RequestRejected) as e:
        engine.check(GenerationRequest("x", [1, 2], SamplingParams(max_tokens=4), method, options=options))
    assert str(e.value) == message


def test_missing_or_unreadable_drafter_weights_are_named(demo, tmp_path):
    import shutil

    from specserve.model.transformer import CheckpointError
    from specserve.methods.mtp.heads import load_mtp_heads

    target, _ = demo
    for name, load, what in (("dflash", load_dflash, "DFlash drafter"), ("mtp", load_mtp_heads, "the MTP heads folder")):
        folder = tmp_path / name
        shutil.copytree(DEMO / name, folder)
        (folder / "model.safetensors").write_bytes(b"junk")
        with pytest.raises(CheckpointError, match=f"^cannot read weights {folder / 'model.safetensors'}: "):
            load(folder, target)
        (folder / "model.safetensors").unlink()
        with pytest.raises(CheckpointError) as e:
            load(folder, target)
        assert str(e.value) == f"{what} {folder} has no model.safetensors"
