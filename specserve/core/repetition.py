"""The repetition guard: is a sequence's recent output a long repeated pattern?

While it is (e.g. the same line, or `a, b, a, b, …`), a DFlash row drafts with its fallback
method instead (default ngram, which copies a repetition perfectly); the row returns to DFlash
when the pattern ends. The check is a pure function of the last tokens, so it can be pinned by
tests and costs O(min_len · max_period) per step.

Worked example (min_len 6, max_period 3): [5, 1, 2, 1, 2, 1, 2] ends in 6 tokens of period 2
→ 2; [1, 2, 1, 2, 1, 3] → None (the last token breaks every period ≤ 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def repeated_period(tokens: Sequence[int], *, min_len: int = 15, max_period: int = 8) -> int | None:
    """The smallest period p ≤ max_period such that the last min_len tokens repeat with period p
    (t[i] == t[i - p] across them), or None. Fewer than min_len tokens → None."""
    if len(tokens) < min_len:
        return None
    tail = list(tokens[-min_len:])
    for p in range(1, min(max_period, min_len - 1) + 1):
        if all(tail[i] == tail[i - p] for i in range(p, min_len)):
            return p
    return None


@dataclass(frozen=True)
class RepetitionGuard:
    min_len: int = 15      # tokens the pattern must span
    max_period: int = 8    # longest period counted as "a short pattern"

    def __post_init__(self):
        if self.max_period < 1 or self.min_len <= self.max_period:
            raise ValueError(f"repetition guard needs 1 <= max_period < min_len, got max_period="
                             f"{self.max_period} min_len={self.min_len}")

    def active(self, tokens: Sequence[int]) -> bool:
        return repeated_period(tokens, min_len=self.min_len, max_period=self.max_period) is not None
