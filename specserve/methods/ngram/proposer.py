"""`ngram`: prompt lookup decoding. No model: find the latest earlier occurrence of the sequence's
last n tokens and draft the tokens that followed it (trying n = max_n down to min_n).

Worked example, n = 2: sequence [a b c d a b] ends in [a b]; its latest earlier occurrence starts
at index 0, so the draft is what followed: [c d a b …] up to max_draft_len tokens.
"""

from __future__ import annotations

from specserve.core.proposer import Draft, DraftRequest, ProposerDefaults, SequenceState
from specserve.methods.ngram.lookup import MAX_N, MIN_N, NUM_DRAFT_TOKENS, lookup


class NgramProposer(ProposerDefaults):
    name = "ngram"

    def __init__(self, max_n: int = MAX_N, min_n: int = MIN_N, num_draft_tokens: int = NUM_DRAFT_TOKENS):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n, self.k = max_n, min_n, num_draft_tokens

    def sequence_state(self, max_model_len: int) -> SequenceState:
        # It looks up the sequence's own tokens, which the engine keeps anyway.
        return SequenceState(0, "no drafter state")

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft.chain(lookup(r.token_ids, max_n=self.max_n, min_n=self.min_n,
                                   k=min(self.k, r.max_draft_len)))
                for r in requests]
