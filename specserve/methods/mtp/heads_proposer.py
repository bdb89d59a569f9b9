"""The fused MTP-heads proposer: the heads (heads.py, which says which token each head predicts)
run in the engine's process, one batched forward per step.

The proposer drafts a CHAIN: the top-1 token of each head (greedy requests), or one draw from
each head's warped distribution (sampled requests; lossless because `probs` carries each head's
distribution q, and the verifier accepts d with min(1, p/q)). `probs` is also filled for greedy
requests (the head's temperature-free softmax) so a caller can read log q(token) as a confidence;
the verifier treats a greedy draft's probs as irrelevant (greedy verification is argmax match).
A chain, not a tree: the heads are independent given f_t, so a tree of head-wise alternatives
would be a product of marginals whose deeper nodes are rarely right (head 3's top-1 agreement is
well below head 0's, see models/demo/mtp/README.md); the arbiter (the `mtp` method) builds trees
from several proposers' chains instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.core.proposer import Draft, DraftRequest, ProposerDefaults, ProposerError, SequenceState, StepOutcome
from specserve.core.sampling import seeded_tokens, target_probs
from specserve.methods.mtp.heads import MTPHeads


@dataclass
class _SeqState:
    feature: torch.Tensor  # [D] f_t of the last committed position t
    committed: int         # t + 1: how many committed tokens the proposer has seen features for


class MTPHeadsProposer(ProposerDefaults):
    """Fused MTP-heads proposer: one batched heads forward per step, no per-sequence KV."""

    name = "mtp_heads"
    needs_features = True

    def __init__(self, heads: MTPHeads, *, max_draft_len: int = 8, name: str = "mtp_heads"):
        self.heads, self.name = heads, name
        self.max_draft_len = min(max_draft_len, heads.cfg.num_heads)
        self._seqs: dict[int, _SeqState] = {}
        self.dtype = heads.lm_head_weight.dtype

    def sequence_state(self, max_model_len: int) -> SequenceState:
        D = self.heads.cfg.hidden_size
        return SequenceState(D * self.heads.lm_head_weight.element_size(), f"one feature vector [{D}]")

    def _last_features(self, requests: list[DraftRequest]) -> tuple[torch.Tensor, list[_SeqState]]:
        """[B, D] f_t per request and the states to store. Stores nothing (a raise here leaves the
        engine holding the features, which it resends with the next call).

        The engine's features are those of the tokens committed since the last call, so their last
        row is always f_t of the newest committed token: only that row is kept, and a call whose
        features were lost upstream (a composite proposer that failed after taking them) does not
        poison the next one. Without new features the stored row must already be the newest."""
        rows, states = [], []
        for r in requests:
            committed = len(r.token_ids) - 1  # the last token is pending: no feature yet
            if r.features is not None and r.features.shape[0] > 0:
                st = _SeqState(r.features[-1].to(self.dtype), committed)
            else:
                st = self._seqs.get(r.seq_id)
                if st is None or st.committed != committed:
                    held = "nothing" if st is None else f"the feature of position {st.committed - 1}"
                    raise ProposerError(f"sequence {r.seq_id}: no feature for its last committed position "
                                        f"{committed - 1} (the proposer holds {held})")
            rows.append(st.feature)
            states.append(st)
        return torch.stack(rows), states

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        if not requests:
            return []
        feats, states = self._last_features(requests)  # [B, D]
        logits = self.heads(feats.to(self.heads.lm_head_weight.device))  # [B, k, V]
        drafts = []
        for b, r in enumerate(requests):
            n = min(r.max_draft_len, self.max_draft_len)
            if n <= 0:
                drafts.append(Draft.empty())
                continue
            rows = logits[b, :n]  # [n, V]
            if r.generator is None:
                # Greedy: top-1 per head (seeded: the coupled choice at each head's position);
                # probs = the plain softmax, for confidence only.
                probs = rows.softmax(-1)
                m = len(r.token_ids)
                tokens = (rows.argmax(-1).tolist() if r.seed is None
                          else seeded_tokens(rows, r.params, list(range(m, m + n))))
            else:
                probs = target_probs(rows, r.params)  # [n, V] each head's warped distribution
                tokens = [int(torch.multinomial(probs[j], 1, generator=r.generator)) for j in range(n)]
            drafts.append(Draft.chain(tokens, probs))
        for r, st in zip(requests, states):
            self._seqs[r.seq_id] = st
        return drafts

    def observe(self, outcomes: list[StepOutcome]) -> None:
        pass  # no speculative state: the next call's features say what was committed

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
