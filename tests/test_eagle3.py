"""EAGLE-3 drafter (methods/eagle/eagle3.py): fused target layers and a reduced draft vocabulary
keep greedy and sampled output exact; the public checkpoint layout loads and computes what the
layout says; the placement it does not support (remote: no ONNX export yet) refuses it by name.
DSPark with an EAGLE-3 drafter is tested in test_dspark.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_checkpoint
from test_eagle import PROMPTS, engine_with, two_token_joint_tv
from specserve.core.engine import Engine, EngineConfig, GenerationRequest
from specserve.core.proposer import ProposerError
from specserve.core.sampling import SamplingParams
from specserve.model.transformer import CheckpointError, load_model
from specserve.methods.eagle.drafter import load_eagle, save_eagle
from specserve.methods.eagle.eagle3 import Eagle3Drafter, draft_vocab, engine_layers
from specserve.methods.eagle.proposer import EagleProposer

LAYERS = 4   # target layers: room for a distinct low, middle and high one


def random_eagle3(target, seed: int, draft_size: int, *, layers=(0, 1, 3), calibration: bool = True,
                  head_scale: float = 0.1) -> Eagle3Drafter:
    """Random weights; its draft vocabulary the `draft_size` ids a seeded count picks."""
    torch.manual_seed(seed)
    cfg = target.cfg.__class__(**{**target.cfg.__dict__, "num_layers": 1})
    d = Eagle3Drafter(cfg, layers, draft_size, calibration=calibration)
    d.set_vocab(*draft_vocab(torch.randint(0, 1000, (cfg.vocab_size,)), draft_size))
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.dim() == 2:
                p.normal_(0, head_scale if name == "lm_head.weight" else 0.1)
    return d.eval().requires_grad_(False)


def fitted_eagle3(target, sequences: list[list[int]], draft_size: int, *, layers=(0, 1, 3), seed: int = 0,
                  steps: int = 300) -> Eagle3Drafter:
    """A random EAGLE-3 drafter whose LM head is fitted (cross-entropy, Adam) to predict, from
    its hidden state over the TRUE pairs of `sequences` (the target's own output), the token
    after next; its draft vocabulary is their `draft_size` most frequent tokens. Enough for
    its first draft token to be accepted on those sequences, so tests see real acceptance."""
    from specserve.core.forward import ForwardBatch
    from specserve.core.masks import build_mask, chain_parents
    counts = torch.zeros(target.cfg.vocab_size, dtype=torch.long)
    for seq in sequences:
        counts += torch.bincount(torch.tensor(seq), minlength=target.cfg.vocab_size)
    d = random_eagle3(target, seed, draft_size, layers=layers)
    d.set_vocab(*draft_vocab(counts, draft_size))
    draft_id = torch.full((target.cfg.vocab_size,), -1, dtype=torch.long)
    draft_id[d.target_ids()] = torch.arange(draft_size)
    xs, ys = [], []
    with torch.no_grad():
        for seq in sequences:
            tokens = torch.tensor([seq])
            T = tokens.shape[1]
            mask, positions = build_mask([0], [chain_parents(T)], T)
            zero = torch.zeros(1, dtype=torch.long)
            out = target.forward(ForwardBatch(tokens, positions, zero, zero, mask), None, hidden_layers=layers)
            feats = torch.cat([out.hidden] + [out.layer_hidden[i] for i in layers], -1)[:, :T - 2]  # pairs 0..T-3
            m, p = build_mask([0], [chain_parents(T - 2)], T - 2)
            h = d(d.fuse(feats), target.embed_tokens(tokens[:, 1:T - 1]),
                  ForwardBatch(tokens[:, 1:T - 1], p, zero, zero, m), None)[0]  # ĥ_{i+1}, predicts t_{i+2}
            xs.append(d.norm(h))
            ys.append(draft_id[tokens[0, 2:]])
    x, y = torch.cat(xs), torch.cat(ys)
    keep = y >= 0   # tokens outside the draft vocabulary cannot be drafted
    head = d.lm_head.weight.detach().clone().requires_grad_(True)
    opt = torch.optim.Adam([head], lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(x[keep] @ head.T, y[keep]).backward()
        opt.step()
    with torch.no_grad():
        d.lm_head.weight.copy_(head)
    return d.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("t3"), "llama", seed=21, num_hidden_layers=LAYERS)


def test_draft_vocab_keeps_the_most_frequent_ids_as_offsets():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    d2t, t2d = draft_vocab(counts, 3)
    assert (torch.arange(3) + d2t).tolist() == [2, 3, 5]   # 9, 9, 7; ascending target ids
    assert d2t.tolist() == [2, 2, 3] and t2d.tolist() == [False, False, True, True, False, True]
    d2t, _ = draft_vocab(torch.tensor([1, 1, 1, 0]), 2)    # ties go to the lower id
    assert (torch.arange(2) + d2t).tolist() == [0, 1]


def test_public_layer_ids_are_converted_to_engine_layers():
    assert engine_layers([2, 9, 15], 18) == (1, 8, 14)     # id j = the output of layer j - 1
    with pytest.raises(CheckpointError, match="must lie in \\[1, 18\\]"):
        engine_layers([0, 9, 15], 18)                       # 0 is the embedding: not kept


@pytest.mark.parametrize("threshold", [None, 0.2])
def test_greedy_eagle3_with_a_reduced_vocabulary_equals_plain_decoding(target_path, threshold):
    target = load_model(target_path)
    drafter = random_eagle3(target, seed=1, draft_size=128)
    engine = engine_with(target, drafter, threshold=threshold)
    assert engine.proposers["eagle"].feature_layers == (0, 1, 3)
    reqs = lambda m: [GenerationRequest(f"{m}{i}", p, SamplingParams(max_tokens=20), m)  # noqa: E731
                      for i, p in enumerate(PROMPTS)]
    plain, spec = engine.generate(reqs("none")), engine.generate(reqs("eagle"))
    for i in range(len(PROMPTS)):
        assert spec[f"eagle{i}"].new_token_ids == plain[f"none{i}"].new_token_ids
    assert sum(o.stats.draft_tokens for o in spec.values()) > 0
    # The calibration head's scalars come from the draft vocabulary's logits: finite, where the
    # target-vocabulary view (-inf outside) would give a NaN entropy.
    from specserve.methods.eagle.calibration import CalibrationHead
    prop = engine.proposers["eagle"]
    h = torch.randn(3, target.cfg.hidden_size)
    logits_d = prop._draft_logits(h)
    logits = prop._to_target(logits_d)
    assert logits.shape[-1] == target.cfg.vocab_size and logits_d.shape[-1] == 128
    # A greedy row's pick over the draft vocabulary, mapped through d2t, is the full view's argmax.
    assert [prop._draft_ids[i] for i in logits_d.argmax(-1).tolist()] == logits.argmax(-1).tolist()
    assert bool(torch.isfinite(prop._calibrate(h, logits_d, 0)).all())
    assert bool(torch.isnan(CalibrationHead.scalar_features(logits, 0)).any())
    ids = set(drafter.target_ids().tolist())
    drafted = EagleProposer(drafter, target, max_num_seqs=1, max_model_len=64, max_draft_len=4)
    eng = Engine(target, EngineConfig(max_num_seqs=1, max_model_len=64, max_draft_len=4), {"eagle": drafted},
                 eos_token_ids=())
    seen: list[int] = []
    real = drafted.propose
    drafted.propose = lambda rs: [seen.extend(d.tokens) or d for d in real(rs)]  # noqa: E731
    eng.generate([GenerationRequest("x", PROMPTS[0], SamplingParams(max_tokens=12), "eagle")])
    assert seen and set(seen) <= ids   # it drafts only inside its vocabulary


class _WrongQ(EagleProposer):
    """Broken on purpose: tokens are drawn from q, but the q it reports is mapped to target ids
    with a wrong d2t (each draft id's probability lands on the next draft id's target token)."""

    def propose(self, requests):
        drafts = super().propose(requests)
        ids = self.drafter.target_ids()
        for d in drafts:
            if d.probs is not None:
                wrong = torch.zeros_like(d.probs)
                wrong[:, ids] = d.probs[:, ids.roll(1)]
                d.probs = wrong
        return drafts


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "broken-d2t-q"])
def test_sampled_eagle3_follows_target_distribution(tmp_path, broken):
    """test_eagle's joint of tokens 2 and 3 against the exact target, drafted from 5 of the 8
    target ids (so the target's top-6 mass outside them is only reachable through recovery).
    The same check must catch a q mapped with the wrong d2t."""
    target = load_model(make_tiny_checkpoint(tmp_path / "small", "llama", vocab_size=8, seed=5,
                                             num_hidden_layers=LAYERS))
    drafter = random_eagle3(target, seed=2, draft_size=5, calibration=False, head_scale=1.0)
    cls = _WrongQ if broken else EagleProposer
    prop = cls(drafter, target, max_num_seqs=64, max_model_len=256, max_draft_len=2, threshold=None)
    engine = Engine(target, EngineConfig(max_num_seqs=64, max_model_len=256, max_draft_len=2), {"eagle": prop},
                    eos_token_ids=())
    tv = two_token_joint_tv(target, engine, "eagle")
    if broken:
        assert tv > 0.1, f"the broken variant went unnoticed: total variation {tv:.4f}"
    else:
        assert tv < 0.06, f"total variation {tv:.4f}"


# -- checkpoints -------------------------------------------------------------------------------------

def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    # x [B, H, T, hd]: rotate-half RoPE at integer positions pos [T]
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = pos[:, None].float() * inv[None]                       # [T, hd/2]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _public_forward(s: dict, aux: torch.Tensor, emb: torch.Tensor, c, eps: float, theta: float):
    """The public EAGLE-3 layout computed with plain tensor ops: aux [T, 3D], emb [T, D] →
    (pre-norm hidden [T, D], draft logits [T, Vd]) for a causal chain at positions 0..T-1."""
    T, H, Hkv, hd = aux.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
    g = aux @ s["fc.weight"].T
    u = torch.cat([_rms(emb, s["midlayer.input_layernorm.weight"], eps),
                   _rms(g, s["midlayer.hidden_norm.weight"], eps)], -1)
    q = (u @ s["midlayer.self_attn.q_proj.weight"].T).view(T, H, hd).transpose(0, 1)[None]
    k = (u @ s["midlayer.self_attn.k_proj.weight"].T).view(T, Hkv, hd).transpose(0, 1)[None]
    v = (u @ s["midlayer.self_attn.v_proj.weight"].T).view(T, Hkv, hd).transpose(0, 1)[None]
    pos = torch.arange(T)
    q, k = _rope(q, pos, theta), _rope(k, pos, theta)
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1).reshape(T, H * hd)
    h = g + att @ s["midlayer.self_attn.o_proj.weight"].T
    x = _rms(h, s["midlayer.post_attention_layernorm.weight"], eps)
    h = h + (F.silu(x @ s["midlayer.mlp.gate_proj.weight"].T) * (x @ s["midlayer.mlp.up_proj.weight"].T)) \
        @ s["midlayer.mlp.down_proj.weight"].T
    return h, _rms(h, s["norm.weight"], eps) @ s["lm_head.weight"].T


def _public_checkpoint(target, folder, target_cfg: dict, Vd: int, *, nest_config: bool):
    c = target.cfg
    D, hd, V = c.hidden_size, c.head_dim, c.vocab_size
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    ids = torch.randperm(V, generator=g)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    state = {
        "fc.weight": r(D, 3 * D), "norm.weight": 1 + r(D), "lm_head.weight": r(Vd, D),
        "d2t": ids - torch.arange(Vd), "t2d": t2d, "embed_tokens.weight": r(V, D),
        "midlayer.input_layernorm.weight": 1 + r(D), "midlayer.hidden_norm.weight": 1 + r(D),
        "midlayer.post_attention_layernorm.weight": 1 + r(D),
        "midlayer.self_attn.q_proj.weight": r(c.num_heads * hd, 2 * D),
        "midlayer.self_attn.k_proj.weight": r(c.num_kv_heads * hd, 2 * D),
        "midlayer.self_attn.v_proj.weight": r(c.num_kv_heads * hd, 2 * D),
        "midlayer.self_attn.o_proj.weight": r(D, c.num_heads * hd),
        "midlayer.mlp.gate_proj.weight": r(c.intermediate_size, D),
        "midlayer.mlp.up_proj.weight": r(c.intermediate_size, D),
        "midlayer.mlp.down_proj.weight": r(D, c.intermediate_size),
    }
    folder.mkdir()
    from safetensors.torch import save_file
    save_file(state, str(folder / "model.safetensors"))
    ids_cfg = {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}   # outputs of layers 0, 1 and 3
    cfg = {**target_cfg, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
           "draft_vocab_size": Vd, **({"eagle_config": ids_cfg} if nest_config else ids_cfg)}
    (folder / "config.json").write_text(json.dumps(cfg))
    return state


@pytest.mark.parametrize("nest_config", [False, True], ids=["top-level-ids", "eagle_config-ids"])
def test_public_eagle3_layout_loads_and_computes_what_it_says(target_path, tmp_path, nest_config):
    target = load_model(target_path)
    tcfg = json.loads(open(f"{target_path}/config.json").read())
    state = _public_checkpoint(target, tmp_path / "pub", tcfg, 96, nest_config=nest_config)
    drafter = load_eagle(tmp_path / "pub", target)
    assert isinstance(drafter, Eagle3Drafter) and drafter.calibration is None
    assert drafter.feature_layers == (0, 1, 3) and drafter.draft_vocab_size == 96

    tokens = torch.tensor([PROMPTS[0]])
    T = tokens.shape[1] - 1
    from specserve.core.masks import build_mask, chain_parents
    from specserve.core.forward import ForwardBatch
    mask, positions = build_mask([0], [chain_parents(T + 1)], T + 1)
    zero = torch.zeros(1, dtype=torch.long)
    with torch.no_grad():
        out = target.forward(ForwardBatch(tokens, positions, zero, zero, mask), None, hidden_layers=(0, 1, 3))
        # What the engine hands the proposer per token: final hidden, then the named layers.
        feats = torch.cat([out.hidden] + [out.layer_hidden[i] for i in (0, 1, 3)], -1)[:, :T]  # [1, T, 4D]
        emb = target.embed_tokens(tokens[:, 1:])                                               # [1, T, D]
        m, p = build_mask([0], [chain_parents(T)], T)
        got = drafter(drafter.fuse(feats), emb, ForwardBatch(tokens[:, 1:], p, zero, zero, m), None)[0]
        want_h, want_logits = _public_forward(state, feats[0, :, target.cfg.hidden_size:], emb[0], target.cfg,
                                              target.cfg.rms_norm_eps, target.cfg.rope.theta)
        torch.testing.assert_close(got, want_h, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(drafter.draft_logits(got), want_logits, rtol=1e-4, atol=1e-5)
        full = drafter.to_target(drafter.draft_logits(got))                                   # [T, V]
    ids = torch.nonzero(state["t2d"]).squeeze(1)
    torch.testing.assert_close(full[:, ids], want_logits, rtol=1e-4, atol=1e-5)
    assert bool(torch.isneginf(full[:, ~state["t2d"]]).all())

    # It drafts through the engine, and the output is the target's.
    engine = engine_with(target, drafter, threshold=None)
    reqs = lambda m: [GenerationRequest(f"{m}{i}", p, SamplingParams(max_tokens=12), m)  # noqa: E731
                      for i, p in enumerate(PROMPTS)]
    plain, spec = engine.generate(reqs("none")), engine.generate(reqs("eagle"))
    assert all(spec[f"eagle{i}"].new_token_ids == plain[f"none{i}"].new_token_ids for i in range(len(PROMPTS)))


def test_public_layout_without_d2t_or_with_a_bad_one_is_refused(target_path, tmp_path):
    from safetensors.torch import load_file, save_file
    target = load_model(target_path)
    tcfg = json.loads(open(f"{target_path}/config.json").read())
    _public_checkpoint(target, tmp_path / "pub", tcfg, 96, nest_config=False)
    st = load_file(str(tmp_path / "pub" / "model.safetensors"))
    save_file({k: v for k, v in st.items() if k not in ("d2t", "t2d")}, str(tmp_path / "pub" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="draft_vocab_size 96 < 512 has no d2t"):
        load_eagle(tmp_path / "pub", target)
    save_file({**st, "d2t": torch.zeros(96, dtype=torch.long)}, str(tmp_path / "pub" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="d2t must map draft ids to distinct target ids"):
        load_eagle(tmp_path / "pub", target)


def test_our_eagle3_checkpoint_round_trips_in_the_public_layout(target_path, tmp_path):
    target = load_model(target_path)
    drafter = random_eagle3(target, seed=3, draft_size=100)
    save_eagle(drafter, json.loads(open(f"{target_path}/config.json").read()), tmp_path / "e3")
    raw = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert raw["draft_vocab_size"] == 100 and raw["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    from safetensors.torch import load_file
    keys = set(load_file(str(tmp_path / "e3" / "model.safetensors")))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
            "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight"} <= keys
    again = load_eagle(tmp_path / "e3", target)
    a, b = drafter.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_serve_finds_an_eagle3_drafter_in_the_eagle_folder_beside_the_target(target_path, tmp_path):
    """`specserve serve --target T` serves T/../eagle whichever layout it holds (its config says
    "eagle3"); a folder whose config names another method is not taken for eagle's."""
    import shutil

    from specserve.cli.checks import resolve_drafters

    shutil.copytree(target_path, tmp_path / "target")
    target = load_model(target_path)
    save_eagle(random_eagle3(target, seed=3, draft_size=100), json.loads(open(f"{target_path}/config.json").read()),
               tmp_path / "eagle")
    assert json.loads((tmp_path / "eagle" / "config.json").read_text())["specserve_drafter"] == "eagle3"
    assert resolve_drafters(tmp_path / "target", [], False) == (("eagle", str((tmp_path / "eagle").resolve())),)
    raw = json.loads((tmp_path / "eagle" / "config.json").read_text())
    (tmp_path / "eagle" / "config.json").write_text(json.dumps({**raw, "specserve_drafter": "dflash"}))
    assert resolve_drafters(tmp_path / "target", [], False) == ()


def test_a_bf16_stored_drafter_keeps_its_vocabulary_and_an_fp32_calibration_head(target_path, tmp_path):
    """save_eagle(dtype=bfloat16): the weights are stored rounded to bf16 (what a committed drafter
    ships), d2t / t2d keep their integer / bool dtypes and the calibration head stays fp32."""
    from safetensors.torch import load_file
    target = load_model(target_path)
    drafter = random_eagle3(target, seed=3, draft_size=100)
    save_eagle(drafter, json.loads(open(f"{target_path}/config.json").read()), tmp_path / "bf", dtype=torch.bfloat16)
    stored = load_file(str(tmp_path / "bf" / "model.safetensors"))
    assert stored["fc.weight"].dtype == torch.bfloat16 and stored["lm_head.weight"].dtype == torch.bfloat16
    assert stored["d2t"].dtype == torch.int64 and stored["t2d"].dtype == torch.bool
    assert {v.dtype for k, v in stored.items() if k.startswith("calibration.")} == {torch.float32}
    again = load_eagle(tmp_path / "bf", target)   # cast to the fp32 target's dtype
    a, b = drafter.state_dict(), again.state_dict()
    for k in a:
        want = a[k] if k.startswith("calibration.") or not a[k].is_floating_point() else \
            a[k].to(torch.bfloat16).to(a[k].dtype)
        assert torch.equal(b[k], want), k


def test_features_of_the_wrong_width_are_a_proposer_error(target_path):
    """An EAGLE-3 drafter fed only the final hidden state (a composite that does not forward the
    layers it names) says what it reads instead of computing garbage."""
    from specserve.core.proposer import DraftRequest
    target = load_model(target_path)
    prop = EagleProposer(random_eagle3(target, seed=4, draft_size=64), target, max_num_seqs=1,
                         max_model_len=64, max_draft_len=2)
    D = target.cfg.hidden_size
    req = DraftRequest(0, [1, 2, 3], 2, SamplingParams(), features=torch.zeros(2, D))
    with pytest.raises(ProposerError, match=f"reads {4 * D} features a token \\(target layers \\[0, 1, 3\\]\\), got {D}"):
        prop.propose([req])


def test_the_remote_placement_refuses_an_eagle3_drafter(target_path, tmp_path):
    from specserve.methods.eagle.export import export
    target = load_model(target_path)
    drafter = random_eagle3(target, seed=5, draft_size=64)
    with pytest.raises(ValueError, match="EAGLE-3 drafters cannot be exported to ONNX yet"):
        export(target, drafter, tmp_path / "onnx")
    # The renderer's remote placement (eagle_proposal) goes through that export, before writing anything.
    from pathlib import Path
    from specserve.triton.render import render_eagle_proposal
    save_eagle(drafter, json.loads(open(f"{target_path}/config.json").read()), tmp_path / "e3")
    with pytest.raises(ValueError, match="EAGLE-3 drafters cannot be exported to ONNX yet.*Serve it fused"):
        render_eagle_proposal(Path(target_path), tmp_path / "e3", tmp_path / "repo", version=1)
    assert not (tmp_path / "repo" / "eagle_backbone").exists()
    # Remote mtp's ensemble reuses EAGLE's ONNX models: with an EAGLE-3 drafter, mtp's default
    # remote placement runs fused instead and says why, so a plain `serve` serves every method.
    from specserve.serving.build import mtp_fused_because, where_drafters_run
    from specserve.serving.settings import DeploymentSettings
    from specserve.triton.render import render_repository
    settings = DeploymentSettings(Path(target_path), drafters=(("eagle", str(tmp_path / "e3")),), device="cpu",
                                  placement="fused", mtp_placement="remote")
    why = ("the EAGLE drafter is EAGLE-3-style, which has no ONNX export yet for the mtp_proposal "
           "ensemble's EAGLE models")
    assert mtp_fused_because(settings, bls_calls=True) == why
    assert any(why in line for line in where_drafters_run(settings))
    repo = render_repository(settings, tmp_path / "repo2")
    assert not (repo / "eagle_backbone").exists() and not (repo / "mtp_proposal").exists()
