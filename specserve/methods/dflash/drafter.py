"""The DFlash drafter: a block drafter over a bounded memory of target features (docs/design.md, 'The methods').

The drafter proposes a whole block in ONE forward pass. With t_p the sequence's pending token
(the last accepted one, whose target features do not exist yet) and block size B:

    block input  [embed(t_p), mask, …, mask] + block_embed[0..B-1]      # [B, D]; embed = target's
    context      the sequence's bounded memory (memory.py) of FUSED target features:
                 fused_t = norm(fuse([norm_0(final_t), norm_1(h^{l1}_t), …]))     # [D]
                 pool slots (+ slot embeddings), window anchors (+ age embeddings) and the
                 last W tokens (+ distance embeddings)                            # [M, D]
    layers       L small NON-causal layers: only block positions make queries; each layer
                 projects [context; block] to keys/values (the context is injected into
                 every layer), so block positions see the context and each other
    output       lm_head(norm(h_k)) for k = 0..B-2 → the distribution of t_{p+k+1}; the LM
                 head is the target's (frozen, not stored). Block position 0 also carries the
                 newest fused vector (f_{p-1}), so the first draft has EAGLE's direct path

Positions carry learned embeddings, not RoPE: the memory has no absolute positions past the
ring, and distance-to-the-block is what the drafter needs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.methods.dflash.memory import SlotPool
from specserve.model.transformer import CheckpointError, RMSNorm, Transformer, read_drafter_weights

MAX_ANCHOR_AGE = 16   # anchors older than this many windows share one age embedding


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layers: tuple[int, ...]      # residual streams fused besides the final hidden state
    num_layers: int = 3
    block_size: int = 8                 # B: the block drafts B - 1 tokens
    max_block_size: int = 16
    window: int = 32                    # W
    pool_slots: int = 64                # r
    pool_rank: int = 64                 # ρ
    rms_norm_eps: float = 1e-5

    def to_dict(self) -> dict:
        return {**asdict(self), "target_layers": list(self.target_layers)}

    @classmethod
    def from_dict(cls, raw: dict) -> "DFlashConfig":
        known = {f for f in cls.__dataclass_fields__}
        cfg = cls(**{k: v for k, v in raw.items() if k in known})
        return cls(**{**asdict(cfg), "target_layers": tuple(cfg.target_layers)})

    def check(self) -> None:
        if not 2 <= self.block_size <= self.max_block_size:
            raise ValueError(f"block_size must be in [2, {self.max_block_size}], got {self.block_size}")
        if self.window < 1 or self.pool_slots < 1 or self.pool_rank < 1:
            raise ValueError("window, pool_slots and pool_rank must be positive")


def default_target_layers(num_layers: int, count: int = 4) -> tuple[int, ...]:
    """`count` layers spread over the target's depth (the final hidden state comes on top)."""
    step = num_layers / (count + 1)   # 18 layers → (2, 6, 9, 13)
    return tuple(sorted({max(0, int(step * (i + 1)) - 1) for i in range(count)}))


class _MLP(nn.Module):
    """SwiGLU with the target's parameter names (so a target layer's MLP loads into it)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DFlashLayer(nn.Module):
    """Block positions attend to [context; block] (no causal mask); context only gives keys/values."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        D, H, Hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(D, H * hd, bias=False)
        self.kv_proj = nn.Linear(D, 2 * Hkv * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, D, bias=False)
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.context_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps)
        self.mlp = _MLP(D, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, ctx: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        # h [A, B, D] block, ctx [A, M, D] context, key_valid [A, M + B] → [A, B, D]
        c = self.cfg
        A, B, _ = h.shape
        x = self.input_layernorm(h)
        kv = self.kv_proj(torch.cat([self.context_layernorm(ctx), x], dim=1))   # [A, M+B, 2 Hkv hd]
        k, v = kv.view(A, -1, 2, c.num_kv_heads, c.head_dim).permute(2, 0, 3, 1, 4)  # 2 × [A, Hkv, M+B, hd]
        q = self.q_proj(x).view(A, B, c.num_heads, c.head_dim).transpose(1, 2)      # [A, H, B, hd]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_valid[:, None, None, :],
                                             enable_gqa=c.num_kv_heads != c.num_heads)
        h = h + self.o_proj(out.transpose(1, 2).reshape(A, B, c.num_heads * c.head_dim))
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        n_in = 1 + len(cfg.target_layers)
        self.in_norms = nn.ModuleList(RMSNorm(D, eps) for _ in range(n_in))  # layers differ in scale
        self.fuse = nn.Linear(n_in * D, D, bias=False)
        self.fuse_norm = RMSNorm(D, eps)
        self.pool = SlotPool(D, cfg.pool_slots, cfg.pool_rank)
        self.pool_up = nn.Linear(cfg.pool_rank, D, bias=False)
        self.slot_embed = nn.Parameter(torch.randn(cfg.pool_slots, D) * 0.02)
        self.ring_embed = nn.Parameter(torch.randn(cfg.window, D) * 0.02)     # column j: distance W - j
        self.anchor_embed = nn.Parameter(torch.randn(MAX_ANCHOR_AGE, D) * 0.02)  # by age in windows
        self.block_embed = nn.Parameter(torch.randn(cfg.max_block_size, D) * 0.02)
        self.mask_embed = nn.Parameter(torch.randn(D) * 0.02)
        # Block position 0 carries the pending token AND the newest fused vector (the token before
        # it), as EAGLE's input pairs (f_{p-1}, t_p): the direct path to the next token.
        self.first_proj = nn.Linear(D, D, bias=False)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(D, eps)

    @property
    def dtype(self) -> torch.dtype:
        return self.fuse.weight.dtype

    def fuse_features(self, feats: torch.Tensor) -> torch.Tensor:
        # feats [..., (1 + L) D] = [final hidden, residual after each target layer] → fused [..., D]
        parts = feats.to(self.dtype).chunk(len(self.in_norms), dim=-1)
        return self.fuse_norm(self.fuse(torch.cat([n(p) for n, p in zip(self.in_norms, parts)], dim=-1)))

    def context(self, ring: torch.Tensor, ring_valid: torch.Tensor, anchors: torch.Tensor,
                anchor_valid: torch.Tensor, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Memory views → (context vectors [A, r + K + W, D], valid [A, r + K + W]).

        ring [A, W, D] right-aligned (column W-1 = the newest token), anchors [A, K, D] oldest
        first (valid ones first), pool [A, r, ρ]."""
        A = ring.shape[0]
        dt = self.dtype
        pool_vec = self.pool_up(pool.to(dt)) + self.slot_embed                    # [A, r, D]
        count = anchor_valid.sum(1, keepdim=True)                                  # [A, 1]
        age = (count - 1 - torch.arange(anchors.shape[1], device=anchors.device)).clamp(0, MAX_ANCHOR_AGE - 1)
        anchor_vec = anchors.to(dt) + self.anchor_embed[age]                      # [A, K, D]
        ring_vec = ring.to(dt) + self.ring_embed                                  # [A, W, D]
        ctx = torch.cat([pool_vec, anchor_vec, ring_vec], dim=1)
        valid = torch.cat([torch.ones(A, pool.shape[1], dtype=torch.bool, device=ring.device),
                           anchor_valid, ring_valid], dim=1)
        return ctx, valid

    def run_block(self, first_embed: torch.Tensor, newest: torch.Tensor, ctx: torch.Tensor, ctx_valid: torch.Tensor,
                  B: int) -> torch.Tensor:
        """first_embed [A, D] = embed(t_p), newest [A, D] = the newest fused vector (f_{p-1}; zeros
        when the memory is empty) → hidden [A, B, D] of the whole block. Output k (0..B-2)
        predicts t_{p+k+1}, as in a causal LM: position 0 (t_p with f_{p-1}) gives the next token
        directly, EAGLE-like; mask positions give the later ones. Output B-1 is unused."""
        A = first_embed.shape[0]
        first = first_embed.to(self.dtype) + self.first_proj(newest.to(self.dtype))
        h = torch.cat([first[:, None], self.mask_embed.expand(A, B - 1, -1)], dim=1)
        h = h + self.block_embed[:B]                                                # [A, B, D]
        key_valid = torch.cat([ctx_valid, torch.ones(A, B, dtype=torch.bool, device=h.device)], dim=1)
        for layer in self.layers:
            h = layer(h, ctx, key_valid)
        return self.norm(h)


def narrowed(drafter: DFlashDrafter, *, window: int | None = None, pool_slots: int | None = None) -> DFlashDrafter:
    """The same drafter reading a smaller memory: the ring's newest `window` distances and the
    first `pool_slots` pool slots (for measuring what W and r buy; the drafter was trained with
    its own W and r, so this is a lower bound on a drafter trained at the smaller size)."""
    c = drafter.cfg
    w, r = window or c.window, pool_slots or c.pool_slots
    if not (1 <= w <= c.window and 1 <= r <= c.pool_slots):
        raise ValueError(f"narrowed: window in [1, {c.window}] and pool_slots in [1, {c.pool_slots}], got {w}, {r}")
    out = DFlashDrafter(DFlashConfig(**{**asdict(c), "window": w, "pool_slots": r}))
    state = dict(drafter.state_dict())
    state["ring_embed"] = state["ring_embed"][c.window - w:]
    state["slot_embed"] = state["slot_embed"][:r]
    state["pool.score.weight"] = state["pool.score.weight"][:r]
    out.load_state_dict(state)
    return out.to(drafter.dtype).eval().requires_grad_(False)


def init_from_target(drafter: DFlashDrafter, target: Transformer) -> None:
    """Start from the target's last layers (attention and MLP weights, norms) and a fusion that
    passes the final hidden state through: a far better start than random weights."""
    cfg = drafter.cfg
    D, H, Hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    src = target.layers[-cfg.num_layers:]
    with torch.no_grad():
        for dst, s in zip(drafter.layers, src):
            q, k, v = s.self_attn.qkv_proj.weight.split([H * hd, Hkv * hd, Hkv * hd])
            dst.q_proj.weight.copy_(q)
            dst.kv_proj.weight.copy_(torch.cat([k, v]))
            dst.o_proj.weight.copy_(s.self_attn.o_proj.weight)
            dst.mlp.load_state_dict(s.mlp.state_dict())
            dst.input_layernorm.weight.copy_(s.input_layernorm.weight)
            dst.context_layernorm.weight.copy_(s.input_layernorm.weight)
            dst.post_attention_layernorm.weight.copy_(s.post_attention_layernorm.weight)
        drafter.fuse.weight.zero_()
        drafter.fuse.weight[:, :D] = torch.eye(D)
        drafter.first_proj.weight.copy_(torch.eye(D))
        drafter.norm.weight.copy_(target.norm.weight)


# -- checkpoints ---------------------------------------------------------------------------------

def dflash_config_for(target: Transformer, **overrides) -> DFlashConfig:
    t = target.cfg
    base = dict(hidden_size=t.hidden_size, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
                head_dim=t.head_dim, intermediate_size=t.intermediate_size, vocab_size=t.vocab_size,
                target_layers=default_target_layers(t.num_layers), rms_norm_eps=t.rms_norm_eps)
    return DFlashConfig(**{**base, **overrides})


def save_dflash(drafter: DFlashDrafter, path: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))
    cfg = {"specserve_drafter": "dflash", "architectures": ["DFlashDrafter"], **drafter.cfg.to_dict()}
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def load_dflash(path: str | Path, target: Transformer, dtype: torch.dtype | None = None,
                **overrides) -> DFlashDrafter:
    """Load a DFlash drafter for `target`; `overrides` (e.g. block_size) replace config values
    that do not change the weights."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"DFlash drafter {path} has no config.json")
    raw = json.loads(cfg_file.read_text())
    if raw.get("specserve_drafter") != "dflash":
        raise CheckpointError(f"{path} is not a DFlash drafter (config.json specserve_drafter = "
                              f"{raw.get('specserve_drafter')!r})")
    cfg = DFlashConfig.from_dict({**raw, **{k: v for k, v in overrides.items() if v is not None}})
    try:
        cfg.check()
    except ValueError as e:
        raise CheckpointError(f"DFlash drafter {path}: {e}") from None
    t = target.cfg
    if cfg.hidden_size != t.hidden_size or cfg.vocab_size != t.vocab_size:
        raise CheckpointError(f"DFlash drafter {path} (hidden {cfg.hidden_size}, vocab {cfg.vocab_size}) "
                              f"does not fit the target (hidden {t.hidden_size}, vocab {t.vocab_size})")
    if any(not 0 <= i < t.num_layers for i in cfg.target_layers):
        raise CheckpointError(f"DFlash drafter {path}: target_layers {cfg.target_layers} outside the "
                              f"target's {t.num_layers} layers")
    state = read_drafter_weights(path, f"DFlash drafter {path}")
    drafter = DFlashDrafter(cfg)
    state = {k: v.float() for k, v in state.items()}
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"DFlash drafter {path}: missing {missing[:4]}, unexpected {unexpected[:4]}")
    drafter = drafter.to(device=target.device, dtype=dtype or target.dtype)
    return drafter.eval().requires_grad_(False)
