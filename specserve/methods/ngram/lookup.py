"""Prompt lookup itself, in plain Python: the fused `ngram` proposer and the remote ngram_drafter
Triton model (which runs without torch) both call it, with the same settings."""

from __future__ import annotations

# ngram's settings: n-grams of MAX_N down to MIN_N tokens, NUM_DRAFT_TOKENS drafted at most.
MAX_N, MIN_N, NUM_DRAFT_TOKENS = 3, 1, 4


def lookup(tokens: list[int], *, max_n: int = MAX_N, min_n: int = MIN_N, k: int = NUM_DRAFT_TOKENS) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the sequence's last n tokens,
    trying n = max_n down to min_n; [] when none occurs."""
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
