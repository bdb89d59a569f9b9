"""DFlash: one-pass block drafting over a bounded memory of target features (DESIGN.md §3).

The drafter proposes a whole block in ONE forward pass. With t_p the sequence's pending token
(the last accepted one, whose target features do not exist yet) and block size B:

    block input  [embed(t_p), mask, …, mask] + block_embed[0..B-1]      # [B, D]; embed = target's
    context      the sequence's bounded memory (dflash_memory.py) of FUSED target features:
                 fused_t = norm(fuse([norm_0(final_t), norm_1(h^{l1}_t), …]))     # [D]
                 pool slots (+ slot embeddings), window anchors (+ age embeddings) and the
                 last W tokens (+ distance embeddings)                            # [M, D]
    layers       L small NON-causal layers: only block positions make queries; each layer
                 projects [context; block] to keys/values (the context is injected into
                 every layer), so block positions see the context and each other
    output       lm_head(norm(h_k)) for k = 0..B-2 → the distribution of t_{p+k+1}; the LM
                 head is the target's (frozen, not stored). Block position 0 also carries the
                 newest fused vector (f_{p-1}), so the first draft has EAGLE's direct path

The drafted tokens are a chain verified by the target in one forward. Each position's
distribution q_k does not depend on the tokens drafted before it; it is still the distribution
the token was drawn from, which is all lossless verification needs.

Positions carry learned embeddings, not RoPE: the memory has no absolute positions past the
ring, and distance-to-the-block is what the drafter needs.

Worked example (B = 4, W = 4): committed t_0..t_9, pending t_10. Memory: ring t_6..t_9,
anchor of window 0 (t_0..t_3), pool over t_0..t_5. Block [t_10, m, m, m] → drafts t_11..t_13.
After verification the engine sends the target features of the newly committed tokens; the
memory ingests them and nothing else needs rolling back (drafts never enter the memory).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model.transformer import CheckpointError, RMSNorm, Transformer, read_drafter_weights
from specserve.core.proposer import Draft, DraftRequest, ProposerDefaults, ProposerError, StepOutcome
from specserve.methods.dflash.memory import MemoryView, SequenceMemory, SlotPool
from specserve.methods.dflash.spec import BLOCK_SIZE
from specserve.core.repetition import RepetitionGuard
from specserve.core.sampling import target_probs

MAX_ANCHOR_AGE = 16   # anchors older than this many windows share one age embedding
# Per-request option (sampling_parameters → DraftRequest.options; a tier's proposer.block_size):
# the row's block size B, in [2, the drafter's max_block_size]; None → the proposer's.
OPT_BLOCK_SIZE = BLOCK_SIZE.key


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


# -- the proposer ----------------------------------------------------------------------------------

def stack_views(views: list[MemoryView], window: int) -> tuple[torch.Tensor, ...]:
    """Per-row memory views → padded batch (ring right-aligned [A, W, D], anchors [A, K, D], …)."""
    A, D = len(views), views[0].ring.shape[-1]
    ref = views[0].ring
    K = max(1, max(v.anchors.shape[0] for v in views))
    ring = ref.new_zeros(A, window, D)
    ring_valid = torch.zeros(A, window, dtype=torch.bool, device=ref.device)
    anchors = ref.new_zeros(A, K, D)
    anchor_valid = torch.zeros(A, K, dtype=torch.bool, device=ref.device)
    for a, v in enumerate(views):
        w, k = v.ring.shape[0], v.anchors.shape[0]
        if w:
            ring[a, window - w:] = v.ring
            ring_valid[a, window - w:] = True
        if k:
            anchors[a, :k] = v.anchors
            anchor_valid[a, :k] = True
    pool = torch.stack([v.pool for v in views])
    return ring, ring_valid, anchors, anchor_valid, pool


class DFlashProposer(ProposerDefaults):
    """Fused DFlash proposer: one drafter forward per step drafts a block for every row."""

    name = "dflash"
    needs_features = True
    option_keys = (OPT_BLOCK_SIZE,)

    def __init__(self, drafter: DFlashDrafter, target: Transformer, *, max_num_seqs: int,
                 block_size: int | None = None, name: str = "dflash",
                 repetition_guard: RepetitionGuard | None = RepetitionGuard(), threshold: float | None = None):
        """threshold: keep drafted positions while the product of the drafter's top-1
        probabilities stays at or above it (an uncalibrated stand-in for EAGLE's predicted
        cumulative acceptance; a request's spec_threshold overrides it; None or 0: the whole
        block). The cut depends on the drafter's distributions only, never on sampled tokens,
        so sampled requests stay lossless."""
        self.name = name
        self.threshold = threshold
        # The engine steps a row aside to its fallback method while its recent output is a long
        # repeated pattern (specserve/core/repetition.py); None: never.
        self.repetition_guard = repetition_guard
        self.drafter, self.target = drafter, target
        self.block_size = block_size or drafter.cfg.block_size
        if not 2 <= self.block_size <= drafter.cfg.max_block_size:
            raise ValueError(f"block_size must be in [2, {drafter.cfg.max_block_size}], got {self.block_size}")
        self.max_num_seqs = max_num_seqs
        # The target layers whose residual streams the engine appends to the final hidden state.
        self.feature_layers: tuple[int, ...] = drafter.cfg.target_layers
        self.max_draft_len = self.block_size - 1   # the default block's; a request may ask for more
        self._mem: dict[int, SequenceMemory] = {}
        self.dtype = drafter.dtype
        same = self.dtype == target.dtype
        self._embed_w = target.embed_tokens.weight if same else target.embed_tokens.weight.to(self.dtype)
        self._head_w = target.lm_head.weight if same else target.lm_head.weight.to(self.dtype)

    def check_options(self, options: dict) -> None:
        """Per-request options (types already checked by triton/params.py); ValueError for the client."""
        b, top = options.get(OPT_BLOCK_SIZE), self.drafter.cfg.max_block_size
        if b is not None and not 2 <= b <= top:
            raise ValueError(f"{OPT_BLOCK_SIZE} must be an integer in [2, {top}] (the drafter's max_block_size), "
                             f"got {b}")

    def block_size_of(self, r: DraftRequest) -> int:
        return (r.options or {}).get(OPT_BLOCK_SIZE) or self.block_size

    def memory(self, seq_id: int) -> SequenceMemory | None:
        return self._mem.get(seq_id)

    def _new_memory(self) -> SequenceMemory:
        c = self.drafter.cfg
        return SequenceMemory(c.window, c.hidden_size, c.pool_slots, c.pool_rank, dtype=self.dtype,
                              device=self.target.device)

    def _ingest(self, requests: list[DraftRequest]) -> None:
        # Check every row before changing any memory: raising leaves the features with the engine.
        todo = []
        for r in requests:
            mem = self._mem.get(r.seq_id)
            n_have = 0 if mem is None else mem.n
            if mem is None and len(self._mem) >= self.max_num_seqs:
                raise ProposerError("no free DFlash memory slot")
            committed = len(r.token_ids) - 1  # the last token is pending: no features yet
            n = 0 if r.features is None else r.features.shape[0]
            if n_have == committed:
                continue  # already ingested (a call that raised after ingesting): nothing new
            if n_have + n != committed:
                raise ProposerError(f"sequence {r.seq_id}: DFlash memory holds {n_have} tokens, got {n} new "
                                    f"features for {committed} committed tokens; cannot re-prime")
            todo.append(r)
        if not todo:
            return
        fused = self.drafter.fuse_features(torch.cat([r.features for r in todo]))  # [Σn, D]
        for r, chunk in zip(todo, fused.split([r.features.shape[0] for r in todo])):
            if r.seq_id not in self._mem:
                self._mem[r.seq_id] = self._new_memory()
            self._mem[r.seq_id].append(chunk, self.drafter.pool)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        if not requests:
            return []
        self._ingest(requests)
        drafts = [Draft.empty() for _ in requests]
        rows = [b for b, r in enumerate(requests) if min(r.max_draft_len, self.block_size_of(r) - 1) > 0]
        if not rows:
            return drafts   # a feature-only call (e.g. the guard's fallback is drafting)
        views = [self._mem[requests[b].seq_id].view() for b in rows]
        ring, ring_valid, anchors, anchor_valid, pool = stack_views(views, self.drafter.cfg.window)
        ctx, valid = self.drafter.context(ring, ring_valid, anchors, anchor_valid, pool)
        first = F.embedding(torch.tensor([requests[b].token_ids[-1] for b in rows], device=self.target.device),
                            self._embed_w)                                                 # [A, D]
        # One block forward per block size in the batch: mask positions attend to each other, so a
        # row's drafts depend on its B, and a longer block cut short is not the shorter block.
        by_size: dict[int, list[int]] = {}
        for a, b in enumerate(rows):
            by_size.setdefault(self.block_size_of(requests[b]), []).append(a)
        for B, group in sorted(by_size.items()):
            idx = torch.tensor(group, device=first.device)
            hidden = self.drafter.run_block(first[idx], ring[idx, -1], ctx[idx], valid[idx], B)   # [G, B, D]
            # [G, B-1, V]: t_{p+1..p+B-1}. As a fresh 2-D [G·(B-1), D] matrix: oneDNN's bf16 matmul
            # takes a slow path on a strided slice (90 ms on this CPU instead of 1.2 ms), and even
            # on .contiguous() of it when G = 1, which keeps the size-1 dim's old stride (7 ms
            # instead of 0.5 ms for the demo drafter's block of 8).
            rows_d = hidden[:, :-1].reshape(-1, hidden.shape[-1])
            logits = F.linear(rows_d, self._head_w).float().view(len(group), B - 1, -1)
            for g, a in enumerate(group):
                drafts[rows[a]] = self._row_draft(requests[rows[a]], logits[g], B)
        return drafts

    def _row_draft(self, r: DraftRequest, logits: torch.Tensor, B: int) -> Draft:
        """logits [B-1, V] of one row's block → its chain, cut by the confidence threshold."""
        # [B-1] product of top-1 probabilities up to each position (non-increasing)
        confidence = torch.cumprod(logits.softmax(-1).amax(-1), dim=0)
        k = min(r.max_draft_len, B - 1)
        th = self.threshold if r.threshold is None else r.threshold
        if th:
            k = min(k, int((confidence >= th).sum()))
        if k == 0:
            return Draft.empty()
        if r.generator is None:
            return Draft.chain(logits[:k].argmax(-1).tolist())
        q = target_probs(logits[:k], r.params)            # [k, V]
        toks = torch.multinomial(q, 1, generator=r.generator)[:, 0]
        return Draft.chain(toks.tolist(), q)

    def observe(self, outcomes: list[StepOutcome]) -> None:
        pass  # drafts never enter the memory; the next call brings the committed tokens' features

    def release(self, seq_id: int) -> None:
        self._mem.pop(seq_id, None)
