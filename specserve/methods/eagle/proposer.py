"""The fused EAGLE proposer: the drafter (drafter.py) runs in the engine's process, batched over
sequences (docs/design.md, 'The methods').

Worked example: committed tokens t_0..t_4 (features f_0..f_4 known) and pending token t_5. The
drafter has pairs 0..4 cached; pair 4 = (f_4, t_5) gives f̂_5 → draft d_6; then pair 5 =
(f̂_5, d_6) gives f̂_6 → d_7, and so on. After verification the engine sends the true features
of the newly committed tokens; the speculative pairs (5, 6, …) are simply overwritten, since the
drafter's valid length only ever counts pairs built from true features.

Drafting stops before the token at which the calibration head's predicted cumulative acceptance
would fall below `threshold`, so the draft length adapts.

An EAGLE-3 drafter (eagle3.py) runs the same loop: it names the target layers it reads
(`feature_layers`, so the engine hands over [n, (1 + L) D] per token), fuses the TRUE features
once on ingest (`fuse`), and drafts from its own LM head over a reduced vocabulary, mapped back to
target ids (`to_target`: -inf outside, so q is zero there and normalised over the draft ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.core.forward import ForwardBatch
from specserve.core.masks import build_mask
from specserve.core.proposer import Draft, DraftRequest, ProposerDefaults, ProposerError, SequenceState, StepOutcome
from specserve.core.sampling import seeded_tokens, target_probs
from specserve.methods.eagle.drafter import CalibrationHead, EagleDrafter
from specserve.methods.eagle.eagle3 import Eagle3Drafter
from specserve.model.transformer import Transformer


@dataclass
class _SeqState:
    slot: int
    valid: int  # drafter cache entries built from TRUE target features (pairs 0..valid-1)


class EagleProposer(ProposerDefaults):
    """Fused EAGLE proposer: the drafter runs in the engine's process, batched over sequences."""

    name = "eagle"
    needs_features = True

    def __init__(self, drafter: EagleDrafter | Eagle3Drafter, target: Transformer, *, max_num_seqs: int,
                 max_model_len: int, max_draft_len: int = 8, threshold: float | None = 0.3,
                 name: str = "eagle"):
        """threshold: stop drafting when the predicted cumulative acceptance falls below it
        (None, or a drafter without a calibration head: always draft max_draft_len)."""
        self.name = name
        self.drafter, self.target = drafter, target
        self.max_draft_len = max_draft_len
        self.threshold = threshold  # threshold_for() ignores it for a drafter without a calibration head
        self.cache = drafter.new_cache(max_num_seqs, max_model_len + max_draft_len + 1)
        self._seqs: dict[int, _SeqState] = {}
        self.feature_layers = drafter.feature_layers   # the engine keeps these layers' streams for it
        # EAGLE-1 reuses the target's embedding and LM head, EAGLE-3 only its embedding; a drafter
        # computing in another dtype (bf16 drafting for an fp32 target) gets its own cast copies.
        self.dtype = drafter.fc.weight.dtype
        same = self.dtype == target.dtype
        self._embed_w = target.embed_tokens.weight if same else target.embed_tokens.weight.to(self.dtype)
        self._own_head = isinstance(drafter, Eagle3Drafter)
        # Draft id → target id ([Vd], for greedy picks), None when the two are the same ids.
        self._draft_ids = drafter.target_ids().tolist() if self._own_head else None
        self._head_w = None if self._own_head else \
            target.lm_head.weight if same else target.lm_head.weight.to(self.dtype)
        D = drafter.cfg.hidden_size
        self._feature_width = D * (1 + len(self.feature_layers))  # what the engine sends per token

    def sequence_state(self, max_model_len: int) -> SequenceState:
        return SequenceState(self.cache.slot_bytes, f"one slot of the drafter's KV cache ({self.cache.max_len} positions)")

    # Ingest the true features of newly committed tokens (DSPark calls it for its rows' prompts);
    # returns the last f̂ per row [B, D].
    def ingest(self, requests: list[DraftRequest]) -> torch.Tensor:
        rows, starts, counts = [], [], []
        for r in requests:
            st = self._seqs.get(r.seq_id)
            if st is None:
                if self.cache.num_free == 0:
                    raise ProposerError("no free drafter slot")
                st = self._seqs[r.seq_id] = _SeqState(self.cache.allocate(), 0)
            committed = len(r.token_ids) - 1  # the last token is pending: no feature yet
            n = 0 if r.features is None else r.features.shape[0]
            if n == 0 or st.valid + n != committed:
                raise ProposerError(f"sequence {r.seq_id}: drafter holds {st.valid} pairs, got {n} new "
                                    f"features for {committed} committed tokens; cannot re-prime")
            if r.features.shape[-1] != self._feature_width:
                raise ProposerError(f"sequence {r.seq_id}: the drafter reads {self._feature_width} features a "
                                    f"token (target layers {list(self.feature_layers)}), got "
                                    f"{r.features.shape[-1]}")
            rows.append(st)
            starts.append(st.valid)
            counts.append(n)
        # Rows are padded to the longest in their forward, and padding is written to the cache
        # too: a sequence's first ingest (its whole prompt, from offset 0) must not share a forward
        # with a long-running sequence, whose offset plus that padding would run past the pool.
        last = torch.zeros(len(requests), self.drafter.cfg.hidden_size, dtype=self.dtype,
                           device=self.target.device)
        for group in ([b for b, s in enumerate(starts) if s == 0], [b for b, s in enumerate(starts) if s > 0]):
            if group:
                last[group] = self._ingest_rows([requests[b] for b in group], [rows[b] for b in group],
                                                [starts[b] for b in group], [counts[b] for b in group])
        return last  # [B, D]

    def _ingest_rows(self, requests, rows, starts, counts) -> torch.Tensor:
        T, B = max(counts), len(requests)
        feats = torch.zeros(B, T, self._feature_width, dtype=self.dtype, device=self.target.device)
        nxt = torch.zeros(B, T, dtype=torch.long)
        for b, (r, n) in enumerate(zip(requests, counts)):
            feats[b, :n] = r.features
            committed = len(r.token_ids) - 1
            nxt[b, :n] = torch.tensor(r.token_ids[committed - n + 1: committed + 1])  # t_{i+1}
        parents = [list(range(-1, n - 1)) for n in counts]
        hidden = self._run(self.drafter.fuse(feats), nxt, [st.slot for st in rows], starts, parents, T)
        for st, n in zip(rows, counts):
            st.valid += n
            self.cache.truncate(st.slot, st.valid)
        return hidden[torch.arange(B), torch.tensor(counts) - 1]  # [B, D]

    def _run(self, feats, nxt, slots, starts, parents, T) -> torch.Tensor:
        dev = self.target.device
        mask, positions = build_mask(starts, parents, T, sliding_window=self.drafter.cfg.sliding_window)
        batch = ForwardBatch(nxt.to(dev), positions.to(dev), torch.tensor(slots, device=dev),
                             torch.tensor(starts, device=dev), mask.to(dev),
                             self.cache.runs_for(slots, mask.shape[-1]))
        embeds = F.embedding(batch.tokens, self._embed_w)
        return self.drafter(feats, embeds, batch, self.cache)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        if not requests:
            return []
        h = self.ingest(requests)  # [B, D] f̂ of each row's pending token
        B = len(requests)
        limits = [min(r.max_draft_len, self.max_draft_len) for r in requests]
        tokens: list[list[int]] = [[] for _ in range(B)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]   # greedy rows: log q of the argmax (confidence)
        active = [lim > 0 for lim in limits]
        # Per-row stop threshold (a request may override the proposer's); 0 or None = fixed length.
        thresholds = [self.threshold_for(r) for r in requests]
        calibrate = any(thresholds)
        cum = [1.0] * B
        slots = [self._seqs[r.seq_id].slot for r in requests]
        base = [self._seqs[r.seq_id].valid for r in requests]
        for j in range(max(limits, default=0)):
            if not any(active):
                break
            # [B, Vd] the drafter's own logits; [B, V] over target ids only where a sampled or
            # seeded row needs the target vocabulary (greedy rows pick over the draft vocabulary).
            logits_d = self._draft_logits(h)
            logits = self._to_target(logits_d) if any(
                a and (r.generator is not None or r.seed is not None) for a, r in zip(active, requests)) else None
            p_accept = self._calibrate(h, logits_d, j) if calibrate else None
            picked = []
            for b, r in enumerate(requests):
                if not active[b]:
                    picked.append(0)
                    continue
                if r.generator is None and r.seed is None:   # greedy: the argmax, as a target id
                    i = int(logits_d[b].argmax())
                    tok = i if self._draft_ids is None else int(self._draft_ids[i])
                    q, lp = None, float(logits_d[b, i] - logits_d[b].logsumexp(-1))
                elif r.generator is None:   # seeded: the coupled choice at this position
                    tok = seeded_tokens(logits[b:b + 1], r.params, [len(r.token_ids) + j])[0]
                    q, lp = None, float(logits[b, tok] - logits[b].logsumexp(-1))
                else:
                    q = target_probs(logits[b:b + 1], r.params)[0]
                    tok = int(torch.multinomial(q, 1, generator=r.generator))
                if p_accept is not None and thresholds[b]:
                    cum[b] *= float(p_accept[b])
                    if cum[b] < thresholds[b]:
                        active[b] = False
                        picked.append(0)
                        continue
                tokens[b].append(tok)
                if q is not None:
                    probs[b].append(q)
                else:
                    logps[b].append(lp)
                picked.append(tok)
                if len(tokens[b]) >= limits[b]:
                    active[b] = False
            if not any(active):
                break
            # Speculative pair (f̂, d) at offset base + j; overwritten once true features arrive.
            nxt = torch.tensor(picked)[:, None]
            starts = [bs + j for bs in base]
            h = self._run(h[:, None], nxt, slots, starts, [[-1]] * B, 1)[:, 0]
        return [Draft.chain(t, torch.stack(p) if p else None, lp if len(lp) == len(t) else None)
                for t, p, lp in zip(tokens, probs, logps)]

    def _draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, D] → logits over the drafter's vocabulary [B, Vd] (EAGLE-1: the target's, V)."""
        if not self._own_head:
            return F.linear(h, self._head_w).float()  # the target's LM head
        return self.drafter.draft_logits(h)

    def _to_target(self, logits_d: torch.Tensor) -> torch.Tensor:
        """[B, Vd] → [B, V] over target ids (-inf outside a reduced draft vocabulary)."""
        return logits_d if not self._own_head else self.drafter.to_target(logits_d)

    def threshold_for(self, r: DraftRequest) -> float | None:
        if self.drafter.calibration is None:
            return None
        return self.threshold if r.threshold is None else r.threshold

    def _calibrate(self, h: torch.Tensor, logits: torch.Tensor, j: int) -> torch.Tensor:
        # logits [B, Vd]: with a reduced vocabulary the top-1 probability and entropy are the
        # drafter's own, over the draft ids (the target-vocabulary view adds only -inf entries,
        # whose 0 · log 0 terms would be NaN).
        scalars = CalibrationHead.scalar_features(logits, j)
        return torch.sigmoid(self.drafter.calibration(h, scalars))  # [B]

    def observe(self, outcomes: list[StepOutcome]) -> None:
        pass  # rollback is implicit: `valid` only counts pairs built from true features

    def release(self, seq_id: int) -> None:
        st = self._seqs.pop(seq_id, None)
        if st is not None:
            self.cache.release(st.slot)
