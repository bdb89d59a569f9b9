"""`ngram`: prompt lookup decoding. No model: find the latest earlier occurrence of the sequence's
last n tokens and draft the tokens that followed it (trying n = max_n down to min_n).

Worked example, n = 2: sequence [a b c d a b] ends in [a b]; its latest earlier occurrence starts
at index 0, so the draft is what followed: [c d a b …] up to max_draft_len tokens.
"""

from __future__ import annotations

from specserve.core.proposer import Draft, DraftRequest, ProposerDefaults


def lookup(tokens: list[int], *, max_n: int, min_n: int, k: int) -> list[int]:
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        tail = tokens[L - n:]
        # Scan right to left for the latest match that is not the tail itself.
        for start in range(L - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                follow = tokens[start + n:start + n + k]
                if follow:
                    return follow
    return []


class NgramProposer(ProposerDefaults):
    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1, num_draft_tokens: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n, self.k = max_n, min_n, num_draft_tokens

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft.chain(lookup(r.token_ids, max_n=self.max_n, min_n=self.min_n,
                                   k=min(self.k, r.max_draft_len)))
                for r in requests]
