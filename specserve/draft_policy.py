"""Load-adaptive draft length: each step drafts the length that maximises expected goodput.

Speculation pays when the tokens a verify forward adds cost less than the steps they save. At
batch 1 a verify of 9 tokens costs little more than a 1-token step (the weights are read once
either way); in a full batch the same verify multiplies the compute of every row, and drafting
can make a busy server slower than plain decoding. So the engine asks, every step:

    k* = argmax_k  Σ_r E_r(k) / (c(B, 1 + k) + d · k)        k ∈ {0, …, max_draft_len}

- c(B, T): seconds of a verify forward (with the LM head) of B rows × T tokens, PROFILED at
  start on this machine / GPU over a small grid (B ∈ {1, 2, 4, …, max_num_seqs}, T ∈ {1, 2, 3, 5,
  …, 1 + max_draft_len}) and interpolated linearly between grid points.
- d: seconds of drafting per drafted position, an exponential moving average of what the
  proposers' calls took (0 for n-gram lookup).
- E_r(k) = 1 + α_r + α_r² + … + α_r^k: the tokens row r is expected to emit with k drafted,
  where α_r is its conditional acceptance rate (P(the next drafted token is accepted | the
  previous ones were)), a moving average of its own accept / reject history.

k = 0 (plain decoding) is always a candidate and its estimate is a measured plain step, so the
policy drafts only where it expects a gain. Rows whose request asks for the fixed policy keep
their own length, and the verify width they force is taken into account. The calibration head,
where a drafter has one, may still cut a row's draft shorter within k*.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Callable, Sequence

POLICIES = ("adaptive", "fixed")
ALPHA_PRIOR = 0.6     # a new row's acceptance rate, until its own history says otherwise
ALPHA_WEIGHT = 0.15   # moving-average weight of one accept / reject observation
DRAFT_COST_WEIGHT = 0.2


@dataclass(frozen=True)
class CostTable:
    """Verify-forward seconds on a (batch, width) grid; `cost(B, T)` interpolates."""
    batch_sizes: tuple[int, ...]
    widths: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]   # [len(batch_sizes)][len(widths)]

    def cost(self, batch: int, width: int) -> float:
        return _lerp(self.batch_sizes, batch, lambda i: _lerp(self.widths, width, lambda j: self.seconds[i][j]))

    def to_dict(self) -> dict:
        return {"batch_sizes": list(self.batch_sizes), "widths": list(self.widths),
                "ms": [[round(1e3 * s, 3) for s in row] for row in self.seconds]}


def _lerp(xs: Sequence[int], x: float, f: Callable[[int], float]) -> float:
    """f interpolated linearly at x between grid points xs (extrapolated past the last one)."""
    if len(xs) == 1:
        return f(0)
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    lo, hi = xs[i - 1], xs[i]
    w = (x - lo) / (hi - lo)
    return f(i - 1) * (1 - w) + f(i) * w


def grid(max_num_seqs: int, max_draft_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    batches = sorted({min(2 ** i, max_num_seqs) for i in range(max_num_seqs.bit_length() + 1)})
    widths = sorted({w for w in (1, 2, 3, 5, 9, 17) if w <= 1 + max_draft_len} | {1 + max_draft_len})
    return tuple(batches), tuple(widths)


def profile(verify: Callable[[int, int], None], batch_sizes: Sequence[int], widths: Sequence[int],
            reps: int = 2) -> CostTable:
    """`verify(B, T)` runs one verify forward of B rows × T tokens; each grid point is timed
    `reps` times after a warm-up, keeping the fastest (the least disturbed by other work)."""
    seconds = []
    for b in batch_sizes:
        row = []
        for t in widths:
            verify(b, t)
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                verify(b, t)
                best = min(best, time.perf_counter() - t0)
            row.append(best)
        seconds.append(tuple(row))
    return CostTable(tuple(batch_sizes), tuple(widths), tuple(seconds))


def expected_tokens(alpha: float, k: int) -> float:
    """1 + α + … + α^k: tokens a row emits with k drafted, each accepted with rate α given the
    previous one was."""
    return float(sum(alpha ** i for i in range(k + 1)))


def update_alpha(alpha: float, num_drafted: int, num_accepted: int) -> float:
    """One step's evidence: `num_accepted` acceptances, then a rejection unless all were accepted."""
    for _ in range(num_accepted):
        alpha += ALPHA_WEIGHT * (1.0 - alpha)
    if num_accepted < num_drafted:
        alpha += ALPHA_WEIGHT * (0.0 - alpha)
    return alpha


@dataclass(frozen=True)
class Choice:
    k: int                      # draft length for the adaptive rows this step
    goodput: float              # expected tokens per second at k
    plain_goodput: float        # expected tokens per second at k = 0


def choose(table: CostTable, batch: int, alphas: Sequence[float], fixed: Sequence[tuple[float, int]],
           max_k: int, draft_cost_per_token: float) -> Choice:
    """The k in 0..max_k with the highest expected goodput for `alphas` (adaptive rows), beside
    `fixed` rows given as (α, their own draft length), in a batch of `batch` rows."""
    fixed_k = max((k for _, k in fixed), default=0)
    fixed_tokens = sum(expected_tokens(a, k) for a, k in fixed)
    plain_rows = batch - len(alphas) - len(fixed)   # rows that never draft (spec_method none)
    best: Choice | None = None
    plain = 0.0
    for k in range(max_k + 1):
        width = 1 + max(k, fixed_k)
        seconds = table.cost(batch, width) + draft_cost_per_token * max(k, fixed_k)
        tokens = sum(expected_tokens(a, k) for a in alphas) + fixed_tokens + plain_rows
        g = tokens / seconds
        if k == 0:
            plain = g
        if best is None or g > best.goodput:
            best = Choice(k, g, plain)
    return Choice(best.k, best.goodput, plain)


def profile_engine_verify(engine) -> CostTable:
    """Profile the engine's own verify forward (target forward + LM head over every position) on
    free KV slots, before any request runs. Context: 128 committed positions per row."""
    import torch

    from specserve.masks import build_mask, chain_parents

    cfg = engine.cfg
    batches, widths = grid(cfg.max_num_seqs, cfg.max_draft_len)
    context = min(128, max(cfg.max_model_len - 1 - cfg.max_draft_len, 0))
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model.cfg.vocab_size

    @torch.inference_mode()
    def verify(b: int, t: int) -> None:
        tokens = torch.randint(0, vocab, (b, t), generator=gen)
        mask, positions = build_mask([context] * b, [chain_parents(t)] * b, t,
                                     sliding_window=engine.model.cfg.sliding_window)
        hidden = engine._forward(tokens, positions, list(range(b)), [context] * b, mask)
        engine.model.logits(hidden)

    return profile(verify, batches, widths)
