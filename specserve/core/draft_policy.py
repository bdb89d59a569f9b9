"""Load-adaptive draft length: each step drafts the length that maximises expected goodput.

Speculation pays when the tokens a verify forward adds cost less than the steps they save. At
batch 1 a verify of 9 tokens costs little more than a 1-token step (the weights are read once
either way); in a full batch the same verify multiplies the compute of every row, and drafting
can make a busy server slower than plain decoding. So the engine asks, every step, for the cap k
on drafted tokens per row:

    k* = argmax_k  Σ_r E_p(r)(k) / (c(B, 1 + w(k)) + D(w(k)))        k ∈ {0, …, max_draft_len}

- c(B, T): seconds of a verify forward (with the LM head) of B rows × T tokens, PROFILED at
  start on this machine / GPU over a small grid (B ∈ {1, 2, 4, …, max_num_seqs}, T ∈ {1, 2, 3, 5,
  …, 1 + max_draft_len}) and interpolated linearly between grid points.
- E_p(k) = 1 + Σ_{i ≤ k} P_p(a step accepts at least i drafted tokens): the tokens a row of
  proposer p emits under cap k (a capped draft accepts min(a, k)). The probabilities are moving
  averages over the proposer's own steps, so they include its stopping rule (a calibration head
  drafts long only where it is confident; a per-token acceptance rate would miss exactly those
  long runs). A step capped at c says nothing about positions ≥ c, so it updates only positions
  below c (censored observations); positions never observed keep an optimistic prior, so the
  policy tries longer drafts where it does not know yet, and learns.
- w(k) = min(k, the proposer's usual widest draft in a step): the drafted width the cap allows.
- D(w) = a + b·w: seconds of a proposer call drafting w positions — a fixed part (an EAGLE
  drafter ingests the rows' new features whatever it drafts) and a part per position, fitted by
  least squares with forgetting to the proposer's measured calls. (Dividing a call's time by its
  positions made short drafts look dear, which made the policy draft shorter still.)

k = 0 (plain decoding) is always a candidate and its estimate is a measured plain step, so the
policy drafts only where it expects a gain. Rows whose request asks for the fixed policy keep
their own length, and the verify width they force is taken into account.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

POLICIES = ("adaptive", "fixed")
PRIOR_ACCEPT = 0.9     # optimistic prior P(accept) per position, until a proposer's own steps say otherwise
WEIGHT = 0.02          # moving-average weight of one row-step observation


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
            reps: int = 3) -> CostTable:
    """`verify(B, T)` runs one verify forward of B rows × T tokens; each grid point is timed
    `reps` times after a warm-up, keeping the fastest (the least disturbed by other work). A
    forward never costs less with more rows or tokens, so the table is made monotone in both
    (a point that measured low by noise is lifted to its smaller neighbour)."""
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
        seconds.append(row)
    for i, row in enumerate(seconds):
        for j in range(len(row)):
            row[j] = max([row[j]] + ([row[j - 1]] if j else []) + ([seconds[i - 1][j]] if i else []))
    return CostTable(tuple(batch_sizes), tuple(widths), tuple(tuple(r) for r in seconds))


@dataclass
class AcceptanceModel:
    """One proposer's behaviour per row (moving averages over the positions each step observed):
    at_least[i-1] = P(a row's step accepts at least i drafted tokens), and
    drafted_at_least[i-1] = P(the proposer drafts at least i tokens for a row)."""
    max_k: int
    at_least: list[float] = field(default_factory=list)
    drafted_at_least: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Prior: modest acceptance, full-length drafts, until the proposer's own steps say otherwise.
        if not self.at_least:
            self.at_least = [PRIOR_ACCEPT ** (i + 1) for i in range(self.max_k)]
        if not self.drafted_at_least:
            self.drafted_at_least = [1.0] * self.max_k

    def expected_tokens(self, k: int) -> float:
        """Tokens a row emits per step with at most k drafted (accepted ones + the bonus/recovered)."""
        return 1.0 + sum(self.at_least[:k])

    def drafted_width(self, k: int, rows: int = 1) -> float:
        """Expected widest draft among `rows` rows under cap k: the verify width minus 1.
        E[max] = Σ_i P(max ≥ i) = Σ_i 1 − (1 − P(d ≥ i))^rows."""
        return sum(1.0 - (1.0 - p) ** rows for p in self.drafted_at_least[:k])

    def update(self, drafted: Sequence[int], accepted: Sequence[int], caps: Sequence[int]) -> None:
        """One step's rows of this proposer: draft lengths, accepted counts, and the cap each row
        drafted under (positions at or past it were not observed)."""
        for d, a, c in zip(drafted, accepted, caps):
            for i in range(min(c, self.max_k)):
                self.at_least[i] += WEIGHT * ((1.0 if a > i else 0.0) - self.at_least[i])
                self.drafted_at_least[i] += WEIGHT * ((1.0 if d > i else 0.0) - self.drafted_at_least[i])


@dataclass
class DraftCost:
    """Seconds of one proposer call as a + b·(positions drafted), fitted to measured calls by
    exponentially forgetting least squares."""
    forget: float = 0.98
    _n: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def update(self, positions: int, seconds: float) -> None:
        f = self.forget
        self._n, self._x, self._y = f * self._n + 1, f * self._x + positions, f * self._y + seconds
        self._xx, self._xy = f * self._xx + positions * positions, f * self._xy + positions * seconds

    def fit(self) -> tuple[float, float]:
        """(a, b); with calls of one width only, all of it is per position (b = mean / width)."""
        if self._n == 0:
            return 0.0, 0.0
        var = self._xx / self._n - (self._x / self._n) ** 2
        if var <= 1e-9 * max(self._xx / self._n, 1.0):
            mean_x = self._x / self._n
            return 0.0, (self._y / self._n) / mean_x if mean_x else 0.0
        b = (self._xy / self._n - self._x / self._n * self._y / self._n) / var
        a = self._y / self._n - b * self._x / self._n
        if a < 0:                       # noise: keep the model physical
            return 0.0, self._xy / self._xx
        if b < 0:
            return self._y / self._n, 0.0
        return a, b

    def seconds(self, positions: float) -> float:
        if positions <= 0:
            return 0.0   # no call at all
        a, b = self.fit()
        return a + b * positions


@dataclass(frozen=True)
class Choice:
    k: int                      # draft cap for the adaptive rows this step
    goodput: float              # expected tokens per second at k
    plain_goodput: float        # expected tokens per second at k = 0


def choose(table: CostTable, batch: int, adaptive: Sequence[tuple[AcceptanceModel, int]],
           fixed: Sequence[tuple[AcceptanceModel, int]], draft_cost: Callable[[float], float]) -> Choice:
    """The cap k with the highest expected goodput. `adaptive`: (model, the row's own cap) of
    each adaptive row; `fixed`: (model, its fixed draft length) of rows outside the policy; the
    rest of the batch's `batch` rows do not draft (spec_method none). `draft_cost(w)`: seconds
    of the proposer calls that draft w positions (0 for w = 0)."""

    def width(rows: Sequence[tuple[AcceptanceModel, int]], k: int | None) -> float:
        """Expected verify width − 1 forced by `rows` (capped at k when given)."""
        by_model: dict[int, list] = {}
        for m, cap in rows:
            by_model.setdefault(id(m), [m, 0, 0])
            by_model[id(m)][1] += 1
            by_model[id(m)][2] = max(by_model[id(m)][2], cap if k is None else min(cap, k))
        return max((m.drafted_width(c, n) for m, n, c in by_model.values()), default=0.0)

    fixed_width = width(fixed, None)
    fixed_tokens = sum(m.expected_tokens(k) for m, k in fixed)
    plain_rows = batch - len(adaptive) - len(fixed)
    max_k = max((cap for _, cap in adaptive), default=0)
    groups: dict[tuple[int, int], list] = {}   # rows alike are counted once (this runs every step)
    for m, cap in adaptive:
        groups.setdefault((id(m), cap), [m, cap, 0])[2] += 1
    best: Choice | None = None
    plain = 0.0
    for k in range(max_k + 1):
        drafted = max(fixed_width, width(adaptive, k))
        seconds = table.cost(batch, 1 + drafted) + draft_cost(drafted)
        tokens = sum(n * m.expected_tokens(min(k, cap)) for m, cap, n in groups.values()) + fixed_tokens + plain_rows
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

    from specserve.core.masks import build_mask, chain_parents

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
