"""Draft-model proposer: the draft model (drafter.py) drafts a chain, with its own small KV cache
(one slot per sequence).

Per sequence the proposer remembers which tokens its cache holds (`_SeqState.tokens`, the cache's
valid length is their count). A step:
  1. keeps the longest prefix of those that is still a prefix of the sequence (the engine's
     token_ids: prompt + emitted, the last one pending), and feeds the rest, pending token
     included, in one forward; its last row's logits give draft token 0;
  2. feeds each drafted token back, one forward per token, up to max_draft_len tokens. The last
     drafted token is never fed (nothing would read its KV).
`observe` rolls the cache back to the pending token plus the accepted drafted tokens, whose KV is
right; step 1 of the next call re-checks that against the real tokens (the recovered/bonus token
is always fed then, it was never drafted here).

Greedy requests draft the argmax; sampled requests draw from the draft model's distribution
warped by the request's temperature / top-k / top-p, and `probs` carries it for lossless
verification (greedy drafts carry the plain softmax, as a confidence only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.core.forward import ForwardBatch
from specserve.core.masks import build_mask, chain_parents
from specserve.core.proposer import Draft, DraftRequest, ProposerDefaults, ProposerError, SequenceState, StepOutcome
from specserve.core.sampling import seeded_tokens, target_probs
from specserve.model.transformer import Transformer


@dataclass
class _SeqState:
    slot: int
    tokens: list[int]   # the tokens whose KV the draft cache holds, in order
    base: int = 0       # len(token_ids) at the last propose (through the pending token)


class DraftModelProposer(ProposerDefaults):
    """Fused draft-model proposer: the small LM runs in the engine's process, batched over rows."""

    name = "draft"
    needs_features = False

    def __init__(self, draft: Transformer, *, max_num_seqs: int, max_model_len: int,
                 max_draft_len: int = 8, name: str = "draft"):
        self.draft, self.name = draft, name
        self.max_draft_len = max_draft_len
        # Room past max_model_len: drafted tokens are fed after the sequence's last token.
        self.cache = draft.new_cache(max_num_seqs, max_model_len + max_draft_len + 1)
        self._seqs: dict[int, _SeqState] = {}

    def sequence_state(self, max_model_len: int) -> SequenceState:
        return SequenceState(self.cache.slot_bytes,
                             f"one slot of the draft model's KV cache ({self.cache.max_len} positions)")

    def _forward(self, rows: list[_SeqState], new: list[list[int]]) -> torch.Tensor:
        """Feed new[b] after rows[b].tokens (all rows in one padded forward) → logits [B, V] of
        each row's last new token. Updates each row's tokens and cache length."""
        dev = self.draft.device
        T = max(len(n) for n in new)
        starts = [len(st.tokens) for st in rows]
        tokens = torch.zeros(len(rows), T, dtype=torch.long)
        for b, n in enumerate(new):
            tokens[b, :len(n)] = torch.tensor(n)
        mask, positions = build_mask(starts, [chain_parents(len(n)) for n in new], T,
                                     sliding_window=self.draft.cfg.sliding_window)
        slots = [st.slot for st in rows]
        batch = ForwardBatch(tokens.to(dev), positions.to(dev), torch.tensor(slots, device=dev),
                             torch.tensor(starts, device=dev), mask.to(dev),
                             self.cache.runs_for(slots, mask.shape[-1]))
        hidden = self.draft.forward(batch, self.cache).hidden  # [B, T, D]
        last = hidden[torch.arange(len(rows)), torch.tensor([len(n) - 1 for n in new])]  # [B, D]
        for st, n in zip(rows, new):
            st.tokens += n
            self.cache.truncate(st.slot, len(st.tokens))
        return self.draft.logits(last)  # [B, V] fp32

    def _catch_up(self, requests: list[DraftRequest], states: list[_SeqState]) -> torch.Tensor:
        """Bring each row's cache to its token_ids (pending token included) → logits [B, V]."""
        new = []
        for r, st in zip(requests, states):
            keep = 0
            limit = min(len(st.tokens), len(r.token_ids) - 1)  # the pending token is always fed
            while keep < limit and st.tokens[keep] == r.token_ids[keep]:
                keep += 1
            del st.tokens[keep:]
            self.cache.truncate(st.slot, keep)
            new.append(list(r.token_ids[keep:]))
        # On the draft model's device: a sampled row draws with the request's generator, which
        # lives on the engine's device.
        logits = torch.zeros(len(requests), self.draft.cfg.vocab_size, device=self.draft.device)
        # Padding is written to the cache too (after each row's tokens): a row with a long catch-up
        # (a new sequence's prompt) must not pad a row that is already far along past the pool.
        groups: dict[bool, list[int]] = {}
        for b, (st, n) in enumerate(zip(states, new)):
            groups.setdefault(len(st.tokens) == 0, []).append(b)
        for idx in groups.values():
            T = max(len(new[b]) for b in idx)
            if max(len(states[b].tokens) for b in idx) + T > self.cache.max_len:
                chunks = [[b] for b in idx]  # too long to pad together: one forward per row
            else:
                chunks = [idx]
            for chunk in chunks:
                logits[chunk] = self._forward([states[b] for b in chunk], [new[b] for b in chunk])
        return logits

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        if not requests:
            return []
        fresh = [r.seq_id for r in requests if r.seq_id not in self._seqs]
        if len(fresh) > self.cache.num_free:
            raise ProposerError(f"no free draft-model slot for {len(fresh) - self.cache.num_free} sequence(s)")
        for sid in fresh:
            self._seqs[sid] = _SeqState(self.cache.allocate(), [])
        states = [self._seqs[r.seq_id] for r in requests]
        for r, st in zip(requests, states):
            st.base = len(r.token_ids)
        logits = self._catch_up(requests, states)  # [B, V] predicts draft token 0
        limits = [min(r.max_draft_len, self.max_draft_len) for r in requests]
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [b for b, lim in enumerate(limits) if lim > 0]
        while active:
            for b in active:
                r = requests[b]
                if r.seed is not None:   # seeded: the coupled choice; q as for greedy rows (unused by verify)
                    q = logits[b].softmax(-1)
                    tok = seeded_tokens(logits[b:b + 1], r.params, [len(r.token_ids) + len(tokens[b])])[0]
                elif r.generator is None:
                    q = logits[b].softmax(-1)
                    tok = int(logits[b].argmax())
                else:
                    q = target_probs(logits[b:b + 1], r.params)[0]
                    tok = int(torch.multinomial(q, 1, generator=r.generator))
                tokens[b].append(tok)
                probs[b].append(q)
            active = [b for b in active if len(tokens[b]) < limits[b]]
            if active:
                logits[active] = self._forward([states[b] for b in active], [[tokens[b][-1]] for b in active])
        return [Draft.chain(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def observe(self, outcomes: list[StepOutcome]) -> None:
        """Roll each sequence's cache back to its pending token + the accepted drafted tokens."""
        for o in outcomes:
            st = self._seqs.get(o.seq_id)
            if st is None:
                continue
            keep = min(len(st.tokens), st.base + len(o.accepted_nodes))
            del st.tokens[keep:]
            self.cache.truncate(st.slot, keep)

    def release(self, seq_id: int) -> None:
        st = self._seqs.pop(seq_id, None)
        if st is not None:
            self.cache.release(st.slot)
