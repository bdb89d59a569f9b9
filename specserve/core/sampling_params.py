"""A request's sampling parameters and their validation: apart from sampling.py (the target
distribution they define, in torch) so that processes which only pass parameters along — the
Triton drafter adapters, the serving layer's request parsing — need not import torch.
sampling.py re-exports everything here."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this a temperature is refused rather than treated as greedy: a client asking for 1e-45
# most likely has a bug, and silently changing the method would hide it.
MIN_TEMPERATURE = 1e-5


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0            # 0 = off
    seed: int | None = None   # per-request generator seed; None = nondeterministic
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # keep generating past EOS (benchmarks want fixed output lengths)
    # The request's own end tokens, beside the model's eos ids (a chat turn's end marker, say);
    # ignore_eos does not lift them, as in vLLM.
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def top_k_cuts(self, vocab_size: int) -> bool:
        """top-k removes tokens from a vocabulary of this size (0 is off; k >= V keeps all)."""
        return 0 < self.top_k < vocab_size

    def truncates(self, vocab_size: int) -> bool:
        """Sampling cuts the tempered distribution (top-k or top-p): the one rule both
        sampling.target_probs and the static step's graph variant (static_step.truncates) follow."""
        return not self.greedy and (self.top_k_cuts(vocab_size) or self.top_p < 1.0)

    def validate(self, *, max_tokens_limit: int | None = None) -> None:
        """Raise ValueError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if max_tokens_limit is not None and self.max_tokens > max_tokens_limit:
            raise ValueError(f"max_tokens={self.max_tokens} exceeds the limit {max_tokens_limit}")
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if 0 < t < MIN_TEMPERATURE:
            # logits / t overflows to inf (then NaN) long before t reaches the denormals.
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {t!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:  # NaN fails the comparison too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2 ** 64):
            raise ValueError(f"seed must be an integer in [0, 2^64), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {list(self.stop_token_ids)!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {list(self.stop)!r}")
