"""Our target transformer against transformers' reference implementation (fp32, ≤ 1e-4)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers

from conftest import make_tiny_checkpoint
from specserve.core.masks import build_mask, chain_parents
from specserve.core.forward import ForwardBatch
from specserve.model.transformer import CheckpointError, load_model

TOL = 1e-4


def hf_logits(path, tokens: list[int]) -> torch.Tensor:
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0]  # [T, V]


def cached_forward(model, cache, slot: int, start: int, tokens: list[int], parents: list[int]):
    mask, positions = build_mask([start], [parents], len(tokens),
                                 sliding_window=model.cfg.sliding_window)
    batch = ForwardBatch(torch.tensor([tokens]), positions, torch.tensor([slot]),
                         torch.tensor([start]), mask)
    with torch.inference_mode():
        return model.logits(model.forward(batch, cache).hidden)[0]  # [T, V]


PROMPT = [5, 17, 99, 3, 250, 42, 7, 7, 300, 12, 64, 128]


def test_prefill_decode_and_tree_verify_match_transformers(tiny_ckpt):
    model = load_model(tiny_ckpt)
    cache = model.new_cache(num_slots=3, max_len=64)
    slot = 1  # not slot 0, so slot indexing is exercised
    ref = hf_logits(tiny_ckpt, PROMPT + [77, 78, 79])

    # Prefill the prompt.
    got = cached_forward(model, cache, slot, 0, PROMPT, chain_parents(len(PROMPT)))
    assert (got - ref[:len(PROMPT)]).abs().max() <= TOL

    # Single-token decode.
    n = len(PROMPT)
    got = cached_forward(model, cache, slot, n, [77], [-1])
    assert (got[0] - ref[n]).abs().max() <= TOL

    # Multi-token verify with a tree: node 0 = 78 (pending), then two branches 79 / 80 and 81
    # under 79. Each node's logits must equal the reference on its own root-to-node path.
    tree_tokens, parents = [78, 79, 80, 81], [-1, 0, 0, 1]
    got = cached_forward(model, cache, slot, n + 1, tree_tokens, parents)
    paths = {0: [78], 1: [78, 79], 2: [78, 80], 3: [78, 79, 81]}
    for node, path in paths.items():
        want = hf_logits(tiny_ckpt, PROMPT + [77] + path)[-1]
        assert (got[node] - want).abs().max() <= TOL, f"tree node {node}"


def test_score_matches_transformers(tiny_ckpt):
    model = load_model(tiny_ckpt)
    got = model.score(torch.tensor([PROMPT]))[0]
    assert (got - hf_logits(tiny_ckpt, PROMPT)).abs().max() <= TOL


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
])
def test_rope_scaling_variants(tmp_path, rope):
    path = make_tiny_checkpoint(tmp_path / "m", "llama", rope_scaling=rope, seed=3)
    model = load_model(path)
    got = model.score(torch.tensor([PROMPT]))[0]
    assert (got - hf_logits(path, PROMPT)).abs().max() <= TOL


def test_tied_embeddings_and_sharded_checkpoint(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "tied", "qwen2", tie=True, seed=4)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    ref.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    model = load_model(sharded)
    assert model.lm_head.weight is model.embed_tokens.weight
    got = model.score(torch.tensor([PROMPT]))[0]
    assert (got - hf_logits(path, PROMPT)).abs().max() <= TOL


def test_mistral_sliding_window(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "mistral", sliding_window=4, seed=5)
    model = load_model(path)
    assert model.cfg.sliding_window == 4
    got = model.score(torch.tensor([PROMPT]))[0]
    assert (got - hf_logits(path, PROMPT)).abs().max() <= TOL


def test_clear_errors_for_bad_checkpoints(tmp_path, tiny_ckpt):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match="unsupported architecture: model_type='gpt2'"):
        load_model(bad)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text(open(f"{tiny_ckpt}/config.json").read())
    (corrupt / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="cannot read weights"):
        load_model(corrupt)
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text(open(f"{tiny_ckpt}/config.json").read())
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(empty)


def test_intermediate_layer_hidden_states_match_transformers(tiny_ckpt):
    model = load_model(tiny_ckpt)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    T = len(PROMPT)
    mask, positions = build_mask([0], [chain_parents(T)], T)
    zero = torch.zeros(1, dtype=torch.long)
    with torch.inference_mode():
        out = model.forward(ForwardBatch(torch.tensor([PROMPT]), positions, zero, zero, mask),
                            cache=None, hidden_layers=(0,))
    # hidden_states[i + 1] is the residual stream after layer i; the last one is after the norm.
    assert (out.layer_hidden[0] - want[1]).abs().max() <= TOL
    assert (out.hidden - want[-1]).abs().max() <= TOL


def test_eos_ids_come_from_generation_config_as_well(tmp_path):
    # A chat model whose end-of-turn token is listed only in generation_config.json.
    path = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    from specserve.model.transformer import load_config

    assert load_config(path).eos_token_ids == (2, 7)
    assert load_model(path).cfg.eos_token_ids == (2, 7)
    (tmp_path / "ckpt" / "generation_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="generation_config.json is not valid JSON"):
        load_config(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_gives_the_bits_of_its_reference_formulation(tiny_ckpt, dtype):
    """Attention ropes q's and k's heads in one call and the forward hands SDPA its additive mask
    made once (fewer operator calls a step): the same bits as roping q and k apart and giving SDPA
    the boolean mask in every layer, which is what this reference computes."""
    import torch.nn.functional as F
    from specserve.model.rope import apply_rope
    from specserve.model.transformer import additive_mask

    model = load_model(tiny_ckpt, dtype=dtype)
    attn, cfg = model.layers[0].self_attn, model.cfg
    H, Hkv, hd = attn.heads, attn.kv_heads, cfg.head_dim
    torch.manual_seed(0)
    x = torch.randn(2, 7, cfg.hidden_size, dtype=dtype)
    # Row 0 sees its 3 earlier entries, row 1 does not; both are causal over the 7 new ones.
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    mask = torch.cat([torch.tensor([True, False])[:, None, None].expand(2, 7, 3), causal.expand(2, 7, 7)], -1)
    positions = torch.arange(7)[None] + torch.tensor([[3], [0]])    # [2, 7]
    cos, sin = model.rotary(positions, dtype)
    with torch.inference_mode():
        q, k, v = attn.qkv_proj(x).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
        q, k, v = (t.view(2, 7, n, hd).transpose(1, 2) for t, n in ((q, H), (k, Hkv), (v, Hkv)))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_all = torch.cat([torch.randn(2, Hkv, 3, hd, dtype=dtype), k], 2)
        v_all = torch.cat([torch.randn(2, Hkv, 3, hd, dtype=dtype), v], 2)

        class Pool:     # the cache: 3 earlier entries per row, then this forward's 7
            def write(self, layer, slots, starts, k_new, v_new):
                assert torch.equal(k_new, k) and torch.equal(v_new, v)

            def read(self, layer, slots, span):
                return k_all[:, :, :span], v_all[:, :, :span]

        want = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask[:, None], enable_gqa=H != Hkv)
        want = attn.o_proj(want.transpose(1, 2).reshape(2, 7, H * hd))
        batch = ForwardBatch(torch.zeros(2, 7, dtype=torch.long), positions, torch.tensor([0, 1]),
                             torch.tensor([3, 3]), additive_mask(mask, dtype))
        got = attn(x, cos, sin, batch, Pool())
    assert torch.equal(got, want)
    fewer = mask.clone()
    fewer[0, :, 0] = False       # the control: row 0 no longer sees its first entry
    with torch.inference_mode():
        other = attn(x, cos, sin, replace(batch, mask=additive_mask(fewer, dtype)), Pool())
    assert torch.equal(other[1], got[1]) and not torch.equal(other[0], got[0])
