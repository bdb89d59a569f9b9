"""The EAGLE-3 drafter: one decoder layer on a fusion of low, middle and high target layers, with
its own LM head over a reduced draft vocabulary (docs/design.md, 'The methods').

With a_i, b_i, c_i the target's residual streams at token t_i after three named layers (the
engine hands them over: `feature_layers`), a pair i is (g_i, t_{i+1}):

    g_i   = fc([a_i, b_i, c_i])                      # [3D] → [D], only for TRUE target features
    u     = [input_layernorm(embed(t_{i+1})), hidden_norm(g_i)]   # [2D]; embed = the target's
    h     = g_i + attn(u) at position i;  ĥ_{i+1} = h + mlp(post_attention_layernorm(h))   # [D]
    logits_d = lm_head(norm(ĥ_{i+1}))                # [Vd] over the draft vocabulary
    target id of draft id k = k + d2t[k]             # predicts t_{i+2}

When the drafter autoregresses, its own ĥ (pre-norm, [D]) takes g's place: pair i+1 is
(ĥ_{i+1}, d_{i+2}) without fc, exactly as it was trained (training-time test, train_eagle.py).

The reduced vocabulary never touches exactness: the drafter's distribution over the target
vocabulary is q = softmax(logits_d) scattered to the target ids and zero elsewhere (a proper,
normalised q), and the target verifies with its own full distribution. A token outside the draft
vocabulary simply cannot be drafted; the target still emits it as a recovered or bonus token.

Checkpoints use the public EAGLE-3 layout: `fc.weight` (no bias), `midlayer.*` (separate q/k/v,
q/k/v taking 2D inputs, `input_layernorm` and `hidden_norm`), `norm.weight`, `lm_head.weight`,
`d2t` (int64 offsets, [Vd]) and `t2d` (bool mask over the target vocabulary, [V]); config.json is
Llama-style with `draft_vocab_size` and `eagle_aux_hidden_state_layer_ids` (top level or in
`eagle_config`) counted as Hugging Face's hidden_states are: id j is the OUTPUT OF LAYER j - 1
(0 would be the embedding). Ours add `calibration.*`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.core.forward import ForwardBatch
from specserve.core.kv_cache import KVCache
from specserve.model.rope import RotaryEmbedding
from specserve.model.transformer import MLP, Attention, CheckpointError, ModelConfig, RMSNorm
from specserve.methods.eagle.calibration import CalibrationHead

ARCHITECTURE = "LlamaForCausalLMEagle3"   # what public EAGLE-3 checkpoints name themselves


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """The public default when a checkpoint names none (low, middle, high), in hidden_states ids."""
    return 2, num_layers // 2, num_layers - 3


def engine_layers(aux_ids, num_layers: int) -> tuple[int, ...]:
    """Public hidden_states ids (j = output of layer j - 1) → our engine's layer indices (i = the
    residual stream after layer i, core/engine._keep_features)."""
    layers = tuple(int(j) - 1 for j in aux_ids)
    if any(not 0 <= i < num_layers for i in layers):
        raise CheckpointError(f"eagle_aux_hidden_state_layer_ids {list(aux_ids)} must lie in [1, {num_layers}] "
                              f"for a {num_layers}-layer target (id j is the output of layer j - 1)")
    return layers


def draft_vocab(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `size` most frequent target tokens (counts [V], ties to the lower id) → (d2t [size]
    int64 offsets, t2d [V] bool). Draft ids keep the target's order, so target = draft + d2t."""
    V = counts.shape[0]
    if not 0 < size <= V:
        raise ValueError(f"draft vocabulary size must be in [1, {V}], got {size}")
    order = sorted(range(V), key=lambda t: (-int(counts[t]), t))[:size]
    ids = torch.tensor(sorted(order), dtype=torch.long)  # [size] target ids, ascending
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(size), t2d


class MidLayer(nn.Module):
    """The EAGLE-3 decoder layer: attention reads [normed embedding, normed hidden] (2D)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, hd = cfg.hidden_size, cfg.head_dim
        self.self_attn = Attention(cfg, 0)
        self.self_attn.qkv_proj = nn.Linear(2 * D, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd,
                                            bias=cfg.attention_bias)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)   # on the embedding
        self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps)       # on the fused / own hidden state
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps)

    def forward(self, hidden, embeds, cos, sin, batch, cache):
        # hidden [B, T, D], embeds [B, T, D] → [B, T, D] (pre-norm: it is fed back when drafting)
        u = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2D]
        h = hidden + self.self_attn(u, cos, sin, batch, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    """Same calling convention as EagleDrafter (proposer.py drives both): `fuse` the engine's
    features once, `forward` a pair, then `draft_logits` / `to_target` for tokens."""

    def __init__(self, cfg: ModelConfig, feature_layers: tuple[int, ...], draft_vocab_size: int,
                 *, calibration: bool = True):
        super().__init__()
        self.cfg, self.feature_layers = cfg, tuple(feature_layers)
        D, V = cfg.hidden_size, cfg.vocab_size
        self.fc = nn.Linear(len(self.feature_layers) * D, D, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(D, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))  # [Vd] offsets
        self.register_buffer("t2d", torch.ones(V, dtype=torch.bool) if draft_vocab_size == V
                             else torch.zeros(V, dtype=torch.bool))                     # [V]
        # The map in both forms every consumer needs, made once here and in set_vocab, never per
        # step: [Vd] target id of each draft id (not saved: it follows from d2t), and whether the
        # draft vocabulary is the target's own, as a host bool so to_target needs no device sync.
        self.register_buffer("ids", torch.arange(draft_vocab_size), persistent=False)     # [Vd]
        self._identity = draft_vocab_size == V
        self.rotary = RotaryEmbedding(cfg.rope)
        self.calibration = CalibrationHead(D) if calibration else None

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        ids = torch.arange(d2t.shape[0]) + d2t.cpu()
        V = self.cfg.vocab_size
        if d2t.shape != (self.draft_vocab_size,) or t2d.shape != (V,):
            raise CheckpointError(f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not match a draft "
                                  f"vocabulary of {self.draft_vocab_size} over {V} target tokens")
        if bool((ids < 0).any() or (ids >= V).any()) or ids.unique().numel() != ids.numel() \
                or not bool(t2d.cpu().bool()[ids].all()) or int(t2d.sum()) != ids.numel():
            raise CheckpointError("d2t must map draft ids to distinct target ids, the ones t2d marks")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d.bool())
        self.ids.copy_(ids)
        self._identity = ids.numel() == V and bool((d2t == 0).all())

    def target_ids(self) -> torch.Tensor:
        return self.ids  # [Vd]

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        # features [B, T, (1 + L) D] (the final hidden state, then the L named layers) → g [B, T, D]
        return self.fc(features[..., self.cfg.hidden_size:])

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, batch: ForwardBatch,
                cache) -> torch.Tensor:
        # hidden [B, T, D] (g_i, or the drafter's own ĥ), next_embeds [B, T, D] → ĥ_{i+1} [B, T, D]
        cos, sin = self.rotary(batch.positions, hidden.dtype)
        return self.midlayer(hidden, next_embeds, cos, sin, batch, cache)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [..., D] → [..., Vd] fp32
        return self.lm_head(self.norm(hidden)).float()

    def to_target(self, logits_d: torch.Tensor) -> torch.Tensor:
        # [..., Vd] → [..., V]: -inf outside the draft vocabulary, so its softmax is q there and 0 elsewhere
        if self._identity:
            return logits_d
        full = logits_d.new_full((*logits_d.shape[:-1], self.cfg.vocab_size), float("-inf"))
        full[..., self.target_ids()] = logits_d
        return full

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        c, w = self.cfg, self.fc.weight
        return KVCache(num_layers=1, num_slots=num_slots, num_kv_heads=c.num_kv_heads, max_len=max_len,
                       head_dim=c.head_dim, dtype=w.dtype, device=w.device)


def eagle3_layers_and_vocab(raw: dict, target_cfg: ModelConfig) -> tuple[tuple[int, ...], int]:
    """From a config.json: the engine layers it reads and its draft vocabulary size."""
    eagle_cfg = raw.get("eagle_config") or {}
    if eagle_cfg.get("use_aux_hidden_state", True) is False:
        raise CheckpointError("EAGLE-3 drafters without auxiliary hidden states (use_aux_hidden_state: "
                              "false) are not supported: specserve fuses target layers through fc")
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle_cfg.get("eagle_aux_hidden_state_layer_ids") \
        or default_aux_layer_ids(target_cfg.num_layers)
    return engine_layers(ids, target_cfg.num_layers), int(raw.get("draft_vocab_size") or target_cfg.vocab_size)


def eagle3_config_fields(drafter: Eagle3Drafter) -> dict:
    """The config.json fields public loaders read (layer ids in the public convention)."""
    ids = [i + 1 for i in drafter.feature_layers]
    return {"architectures": [ARCHITECTURE], "draft_vocab_size": drafter.draft_vocab_size,
            "target_hidden_size": drafter.cfg.hidden_size, "eagle_aux_hidden_state_layer_ids": ids,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}


def build_eagle3(cfg: ModelConfig, raw: dict, target_cfg: ModelConfig, state: dict) -> Eagle3Drafter:
    """An Eagle3Drafter from a public-layout state (q/k/v already fused) and its config."""
    layers, vocab = eagle3_layers_and_vocab(raw, target_cfg)
    state = {k.removeprefix("model."): v for k, v in state.items()}  # some exports nest under model.
    state.pop("embed_tokens.weight", None)  # a frozen copy of the target's, which we use
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    if vocab != cfg.vocab_size and d2t is None:
        raise CheckpointError(f"EAGLE-3 drafter with draft_vocab_size {vocab} < {cfg.vocab_size} has no d2t")
    has_calib = any(k.startswith("calibration.") for k in state)
    drafter = Eagle3Drafter(cfg, layers, vocab, calibration=has_calib)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in ("d2t", "t2d")]
    if missing or unexpected:
        raise CheckpointError(f"EAGLE-3 drafter: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if d2t is not None:
        if t2d is None:   # only d2t stored: t2d follows from it
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[torch.arange(vocab) + d2t.long()] = True
        drafter.set_vocab(d2t.long(), t2d.bool())
    return drafter

