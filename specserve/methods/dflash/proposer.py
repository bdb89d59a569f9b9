"""The fused DFlash proposer: one drafter (drafter.py) forward per step drafts a block for every row
(docs/design.md, 'The methods').

The drafted tokens are a chain verified by the target in one forward. Each position's
distribution q_k does not depend on the tokens drafted before it; it is still the distribution
the token was drawn from, which is all lossless verification needs.

Worked example (B = 4, W = 4): committed t_0..t_9, pending t_10. Memory: ring t_6..t_9,
anchor of window 0 (t_0..t_3), pool over t_0..t_5. Block [t_10, m, m, m] → drafts t_11..t_13.
After verification the engine sends the target features of the newly committed tokens; the
memory ingests them and nothing else needs rolling back (drafts never enter the memory).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.core.proposer import Draft, DraftRequest, ProposerDefaults, ProposerError, SequenceState, StepOutcome
from specserve.methods.dflash.options import BLOCK_SIZE
from specserve.core.repetition import RepetitionGuard
from specserve.core.sampling import seeded_tokens, target_probs
from specserve.methods.dflash.drafter import DFlashDrafter
from specserve.methods.dflash.memory import MemoryView, SequenceMemory, budget_bytes
from specserve.model.transformer import Transformer

# Per-request option (sampling_parameters → DraftRequest.options; a tier's proposer.block_size):
# the row's block size B, in [2, the drafter's max_block_size]; None → the proposer's.
OPT_BLOCK_SIZE = BLOCK_SIZE.key


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

    def sequence_state(self, max_model_len: int) -> SequenceState:
        c = self.drafter.cfg
        return SequenceState(budget_bytes(max_model_len, c.window, c.pool_slots, c.pool_rank, c.hidden_size, self.dtype),
                             f"the bounded memory's budget at {max_model_len} tokens "
                             f"(W={c.window}, r={c.pool_slots}, ρ={c.pool_rank})")

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
        if r.seed is not None:   # seeded: the coupled choice at each block position
            n = len(r.token_ids)
            return Draft.chain(seeded_tokens(logits[:k], r.params, list(range(n, n + k))))
        if r.generator is None:
            return Draft.chain(logits[:k].argmax(-1).tolist())
        q = target_probs(logits[:k], r.params)            # [k, V]
        toks = torch.multinomial(q, 1, generator=r.generator)[:, 0]
        return Draft.chain(toks.tolist(), q)

    def observe(self, outcomes: list[StepOutcome]) -> None:
        pass  # drafts never enter the memory; the next call brings the committed tokens' features

    def release(self, seq_id: int) -> None:
        self._mem.pop(seq_id, None)
