"""EAGLE drafter: lossless greedy and sampled output through the engine, checkpoint layouts."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from conftest import make_tiny_checkpoint
from specserve.core.engine import Engine, EngineConfig, GenerationRequest
from specserve.model.transformer import CheckpointError, load_model
from specserve.methods.eagle.drafter import EagleDrafter, load_eagle, save_eagle
from specserve.methods.eagle.proposer import EagleProposer
from specserve.core.sampling import SamplingParams, target_probs

PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 7, 300, 12], [11, 12, 13, 14, 11, 12, 13], [77],
           list(range(100, 140))]


def random_drafter(target, seed: int, calibration: bool = True) -> EagleDrafter:
    torch.manual_seed(seed)
    cfg = target.cfg.__class__(**{**target.cfg.__dict__, "num_layers": 1})
    d = EagleDrafter(cfg, calibration=calibration)
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    return d.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("t"), "llama", seed=21)


def engine_with(target, drafter, *, threshold, max_num_seqs=4, max_draft_len=5):
    prop = EagleProposer(drafter, target, max_num_seqs=max_num_seqs, max_model_len=256,
                         max_draft_len=max_draft_len, threshold=threshold)
    return Engine(target, EngineConfig(max_num_seqs=max_num_seqs, max_model_len=256,
                                       max_draft_len=max_draft_len), {"eagle": prop}, eos_token_ids=())


@pytest.mark.parametrize("threshold", [None, 0.2])
def test_greedy_eagle_equals_plain_decoding(target_path, threshold):
    target = load_model(target_path)
    drafter = random_drafter(target, seed=1)
    reqs = lambda m: [GenerationRequest(f"{m}{i}", p, SamplingParams(max_tokens=20), m)
                      for i, p in enumerate(PROMPTS)]
    engine = engine_with(target, drafter, threshold=threshold)
    plain = engine.generate(reqs("none"))
    spec = engine.generate(reqs("eagle"))
    for i in range(len(PROMPTS)):
        assert spec[f"eagle{i}"].new_token_ids == plain[f"none{i}"].new_token_ids
    stats = [o.stats for o in spec.values()]
    assert sum(s.draft_tokens for s in stats) > 0
    if threshold is None:
        # No calibration: full-length drafts except in the last steps (room < 5 there).
        assert all(s.draft_tokens >= 5 * (s.drafts - 4) for s in stats)
    assert engine.num_free_slots == 4 and engine.proposers["eagle"].cache.num_free == 4


def two_token_joint_tv(target, engine, method: str, n: int = 3000, params: dict | None = None) -> float:
    """Total variation between the generated joint of tokens 2 and 3 (drafted and verified in one
    step) and the exact target joint, over n unseeded requests of `method` on `target` (vocab 8):
    the rejection sampler. Their generators are seeded 0..n-1 in submission order so the run is
    repeatable (a `seed` in the request would route it to seeded sampling, tests/test_seeded.py)."""
    from unittest import mock

    params = params or dict(temperature=1.0, top_k=6)
    prompt = [1, 3, 5]
    streams = itertools.count()
    repeatable = lambda _params, device: torch.Generator(device=device).manual_seed(next(streams))  # noqa: E731
    with mock.patch("specserve.core.engine.make_generator", repeatable):
        outs = engine.generate([GenerationRequest(str(i), prompt, SamplingParams(max_tokens=4, **params), method)
                                for i in range(n)])
    counts = torch.zeros(8, 8)
    for o in outs.values():
        counts[o.new_token_ids[1], o.new_token_ids[2]] += 1
    # The first decode step of every request drafts 2 tokens (room = 4 - 1 - 1).
    assert all(o.stats.draft_tokens >= 2 for o in outs.values())
    sp = SamplingParams(**params)
    with torch.inference_mode():
        p1 = target_probs(target.score(torch.tensor([prompt]))[0, -1:], sp)[0]
        # exact joint of (t2, t3): sum over t1 of p(t1) p(t2|t1) p(t3|t1,t2)
        exact = torch.zeros(8, 8)
        for a in range(8):
            pa = float(p1[a])
            if pa == 0:
                continue
            p2 = target_probs(target.score(torch.tensor([prompt + [a]]))[0, -1:], sp)[0]
            for b in range(8):
                if p2[b] == 0:
                    continue
                p3 = target_probs(target.score(torch.tensor([prompt + [a, b]]))[0, -1:], sp)[0]
                exact[b] += pa * float(p2[b]) * p3
    return 0.5 * (counts / n - exact).abs().sum().item()


def test_sampled_eagle_follows_target_distribution(tmp_path):
    """Joint of generated tokens 2 and 3 (drafted and verified in one step) vs the exact target."""
    target = load_model(make_tiny_checkpoint(tmp_path / "small", "llama", vocab_size=8, seed=5))
    engine = engine_with(target, random_drafter(target, seed=2, calibration=False), threshold=None,
                         max_num_seqs=64, max_draft_len=2)
    tv = two_token_joint_tv(target, engine, "eagle")
    assert tv < 0.06, f"total variation {tv:.4f}"


def test_save_and_load_roundtrip_keeps_drafts(target_path, tmp_path):
    target = load_model(target_path)
    drafter = random_drafter(target, seed=3)
    cfg = json.loads(open(f"{target_path}/config.json").read())
    save_eagle(drafter, cfg, tmp_path / "eagle")
    again = load_eagle(tmp_path / "eagle", target)
    for (k, a), (k2, b) in zip(drafter.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k


def test_eagle1_layout_checkpoint_loads_and_drafts(target_path, tmp_path):
    """A checkpoint laid out like the published EAGLE-1 heads: pytorch_model.bin with fc.*,
    layers.0.* (separate q/k/v, no input norm) and a copy of embed_tokens."""
    target = load_model(target_path)
    c = target.cfg
    D, hd = c.hidden_size, c.head_dim
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1
    state = {
        "fc.weight": r(D, 2 * D), "fc.bias": r(D), "embed_tokens.weight": r(c.vocab_size, D),
        "layers.0.self_attn.q_proj.weight": r(c.num_heads * hd, D),
        "layers.0.self_attn.k_proj.weight": r(c.num_kv_heads * hd, D),
        "layers.0.self_attn.v_proj.weight": r(c.num_kv_heads * hd, D),
        "layers.0.self_attn.o_proj.weight": r(D, c.num_heads * hd),
        "layers.0.mlp.gate_proj.weight": r(c.intermediate_size, D),
        "layers.0.mlp.up_proj.weight": r(c.intermediate_size, D),
        "layers.0.mlp.down_proj.weight": r(D, c.intermediate_size),
        "layers.0.post_attention_layernorm.weight": torch.ones(D),
    }
    folder = tmp_path / "eagle1"
    folder.mkdir()
    torch.save(state, folder / "pytorch_model.bin")
    cfg = json.loads(open(f"{target_path}/config.json").read())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    drafter = load_eagle(folder, target)
    assert drafter.calibration is None
    torch.testing.assert_close(drafter.fc.weight, state["fc.weight"])
    prop = EagleProposer(drafter, target, max_num_seqs=2, max_model_len=128, max_draft_len=4)
    engine = Engine(target, EngineConfig(max_num_seqs=2, max_model_len=128, max_draft_len=4),
                    {"eagle": prop}, eos_token_ids=())
    out = engine.generate([GenerationRequest("a", PROMPTS[0], SamplingParams(max_tokens=12), "eagle")])["a"]
    # Full-length drafts except in the last steps, where room = max_tokens - emitted - 1 < 4.
    assert out.stats.draft_tokens >= 4 * (out.stats.drafts - 3) and out.stats.drafts > 0

    del state["fc.bias"]
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="missing \\['fc.bias'\\]"):
        load_eagle(folder, target)


def test_long_prompt_joining_a_long_running_sequence_fits_the_drafter_cache(target_path):
    """Regression: a new sequence's whole-prompt ingest used to share a padded forward with a
    sequence near the model length, writing past the drafter's KV pool."""
    target = load_model(target_path)
    engine = engine_with(target, random_drafter(target, seed=6), threshold=None, max_num_seqs=2)
    long_run = GenerationRequest("long", list(range(5, 200)), SamplingParams(max_tokens=50), "eagle")
    engine.submit(long_run)
    for _ in range(3):
        engine.step()  # "long" is now at ~200 committed tokens
    late = GenerationRequest("late", list(range(10, 180)), SamplingParams(max_tokens=8), "eagle")
    engine.submit(late)
    got = []
    while engine.has_work():
        got += [t for o in engine.step() if o.request_id == "late" for t in o.new_token_ids]
    plain = engine_with(target, random_drafter(target, seed=6), threshold=None, max_num_seqs=2)
    want = plain.generate([GenerationRequest("late", late.prompt_ids, SamplingParams(max_tokens=8), "none")])
    assert got == want["late"].new_token_ids and engine.num_free_slots == 2


def test_bfloat16_target_drafts_with_its_calibration_head(target_path, tmp_path):
    """A bf16 target (serve --dtype bfloat16) loads its drafter in bf16 with the calibration head
    kept in fp32, and drafts with the head on; the head's threshold still cuts drafts."""
    fp32 = load_model(target_path)
    save_eagle(random_drafter(fp32, seed=4), json.loads(open(f"{target_path}/config.json").read()), tmp_path / "d")
    target = load_model(target_path, dtype=torch.bfloat16)
    drafter = load_eagle(tmp_path / "d", target)
    assert drafter.fc.weight.dtype == torch.bfloat16
    assert drafter.calibration.out.weight.dtype == torch.float32
    reqs = [GenerationRequest(f"b{i}", p, SamplingParams(max_tokens=12), "eagle") for i, p in enumerate(PROMPTS)]
    full = engine_with(target, drafter, threshold=None).generate(reqs)
    cut = engine_with(target, drafter, threshold=0.99).generate(reqs)
    n_full = sum(o.stats.draft_tokens for o in full.values())
    n_cut = sum(o.stats.draft_tokens for o in cut.values())
    assert n_full > 0 and n_cut < n_full
    assert all(len(o.new_token_ids) == 12 for o in (*full.values(), *cut.values()))
