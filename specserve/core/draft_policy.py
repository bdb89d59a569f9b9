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
  policy tries longer drafts where it does not know yet, and learns. A step whose draft failed
  (a drafter unloaded, restarting or raising) says nothing about acceptance and is not counted.
- w(k) = min(k, the proposer's usual widest draft in a step): the drafted width the cap allows.
- D(w) = a + b·w: a proposer call drafting w positions, in PROFILE-TIME seconds — a fixed part
  (an EAGLE drafter ingests the rows' new features whatever it drafts) and a part per position.

Noise and contention (issue 25). The table is measured once; a busy machine later makes every
call slower. Comparing today's drafter calls with the table's quiet-machine verify would make
drafting look dear exactly when a neighbour takes the CPU — and with k = 0 the drafter is never
called again, so that verdict would be permanent. Hence:

1. Same conditions: each call's seconds are divided by the slowdown of the SAME step's verify
   forward (measured / profiled), so D is in the table's units; contention that slows both
   leaves the decision unchanged, and only a drafter that got dearer relative to the target moves it.
2. Robust statistics: D is fitted to the last COST_WINDOW successful calls by Theil–Sen (median
   of pairwise slopes, median intercept), so fewer than half of them, however slow, move nothing.
3. Hysteresis: drafting switches off when plain decoding is expected to be faster (the policy's
   promise: never slower than plain), and back on only when drafting is expected to beat it by
   more than HYSTERESIS.
4. It keeps learning while off: every PROBE_EVERY-th step that it decides k = 0 it drafts anyway
   at the rows' own cap (a probe; at most 1 step in PROBE_EVERY while off), as long as the verify
   table alone leaves room for a gain (free drafting, prior acceptance) — where it does not, no
   measurement could change the decision and no probe is spent. A probe's acceptance counts
   PROBE_EVERY times (it stands for the steps it samples), so the estimates follow a drafter
   whose acceptance came back about as fast as if it drafted every step.

Recovery bound (pinned by tests/test_draft_policy.py): once the drafter's calls are back to what
they cost before, drafting resumes after at most RECOVERY_STEPS = PROBE_EVERY × (COST_WINDOW // 2
+ 1) decision steps (that many probes replace the median of the window), provided the estimates
from before the slowdown showed a gain above HYSTERESIS and the calls had one width (the cap; a
window mixing widths fits a slope across slow and fast calls, which can take longer). A drafter that failed instead (unloaded,
raising) never changed the estimates, so it drafts again on its first successful call.

Static steps (DSPark: drafting inside the one computation, so no call to time apart): the
engine caps their rows the same way, and `static_step` charges drafting with the part of the
step's seconds that the verify table does not explain at that width (in table units), which also
holds the step's fixed ingest: an over-estimate, so the policy errs toward plain steps.

k = 0 (plain decoding) is always a candidate and its estimate is a measured plain step, so the
policy drafts only where it expects a gain. Rows whose request asks for the fixed policy keep
their own length, and the verify width they force is taken into account.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

POLICIES = ("adaptive", "fixed")
PRIOR_ACCEPT = 0.9     # optimistic prior P(accept) per position, until a proposer's own steps say otherwise
WEIGHT = 0.02          # moving-average weight of one row-step observation
COST_WINDOW = 9        # successful calls the draft cost is fitted to (odd: a median is one of them)
PROBE_EVERY = 8        # while off, every 8th decision drafts anyway (a bounded share of steps)
HYSTERESIS = 0.1       # off → on only when drafting is expected to beat plain by more than 10 %
RECOVERY_STEPS = PROBE_EVERY * (COST_WINDOW // 2 + 1)


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
            reps: int = 3, clock: Callable[[], float] = time.perf_counter) -> CostTable:
    """`verify(B, T)` runs one verify forward of B rows × T tokens; each grid point is timed
    `reps` times after a warm-up, keeping the fastest (the least disturbed by other work). The
    reps run in rounds over the whole grid, so a neighbour busy for part of the profile disturbs
    every point's worst time, not all times of a few points (which skewed the table's shape). A
    forward never costs less with more rows or tokens, so the table is made monotone in both
    (a point that measured low by noise is lifted to its smaller neighbour)."""
    points = [(b, t) for b in batch_sizes for t in widths]
    for b, t in points:
        verify(b, t)
    best = {p: float("inf") for p in points}
    for _ in range(reps):
        for b, t in points:
            t0 = clock()
            verify(b, t)
            best[b, t] = min(best[b, t], clock() - t0)
    seconds = [[best[b, t] for t in widths] for b in batch_sizes]
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

    def update(self, drafted: Sequence[int], accepted: Sequence[int], caps: Sequence[int],
               weight: float = WEIGHT) -> None:
        """One step's rows of this proposer: draft lengths, accepted counts, and the cap each row
        drafted under (positions at or past it were not observed)."""
        for d, a, c in zip(drafted, accepted, caps):
            for i in range(min(c, self.max_k)):
                self.at_least[i] += weight * ((1.0 if a > i else 0.0) - self.at_least[i])
                self.drafted_at_least[i] += weight * ((1.0 if d > i else 0.0) - self.drafted_at_least[i])


@dataclass
class DraftCost:
    """Seconds of one proposer call as a + b·(positions drafted), fitted by Theil–Sen to the last
    `window` calls: b = the median of the pairwise slopes, a = the median of y − b·x. Fewer than
    half of the calls, however far off, cannot move it (least squares followed one slow call)."""
    window: int = COST_WINDOW
    _calls: deque = field(default_factory=deque)   # (positions, seconds), oldest first
    _fit: tuple[float, float] = (0.0, 0.0)

    def update(self, positions: int, seconds: float) -> None:
        self._calls.append((positions, seconds))
        if len(self._calls) > self.window:
            self._calls.popleft()
        self._fit = self._refit()

    def _refit(self) -> tuple[float, float]:
        calls = list(self._calls)
        slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(calls) for x2, y2 in calls[i + 1:] if x2 != x1]
        if not slopes:     # one width only: all of it per position (b = median / width)
            x = calls[0][0]
            return 0.0, statistics.median(y for _, y in calls) / x if x else 0.0
        b = statistics.median(slopes)
        a = statistics.median(y - b * x for x, y in calls)
        if a < 0:                       # noise: keep the model physical
            return 0.0, statistics.median(y / x for x, y in calls if x)
        if b < 0:
            return statistics.median(y for _, y in calls), 0.0
        return a, b

    @property
    def full(self) -> bool:
        """The window holds `window` calls."""
        return len(self._calls) == self.window

    def fit(self) -> tuple[float, float]:
        """(a, b); with calls of one width only, all of it is per position."""
        return self._fit

    def seconds(self, positions: float) -> float:
        if positions <= 0:
            return 0.0   # no call at all
        a, b = self._fit
        return a + b * positions


@dataclass(frozen=True)
class Choice:
    k: int                      # draft cap for the adaptive rows this step
    goodput: float              # expected tokens per second at k
    plain_goodput: float        # expected tokens per second at k = 0
    drafting_k: int = 0         # the best k ≥ 1 (0 when no row may draft)
    drafting_goodput: float = 0.0   # expected tokens per second at drafting_k

    @property
    def gain(self) -> float:
        """Expected speed of the best drafting choice relative to plain decoding."""
        return self.drafting_goodput / self.plain_goodput if self.drafting_k else 0.0


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
    goodput = []   # [k]
    for k in range(max_k + 1):
        drafted = max(fixed_width, width(adaptive, k))
        seconds = table.cost(batch, 1 + drafted) + draft_cost(drafted)
        tokens = sum(n * m.expected_tokens(min(k, cap)) for m, cap, n in groups.values()) + fixed_tokens + plain_rows
        goodput.append(tokens / seconds)
    best = max(range(max_k + 1), key=lambda k: (goodput[k], -k))           # the first of equals
    drafting = max(range(1, max_k + 1), key=lambda k: (goodput[k], -k), default=0)
    return Choice(best, goodput[best], goodput[0], drafting, goodput[drafting] if drafting else 0.0)


@dataclass(frozen=True)
class Decision:
    """One step's cap for the adaptive rows, and why."""
    k: int
    gain: float              # expected speed of drafting (at its best k ≥ 1) relative to plain
    probe: bool = False      # drafting while off, to keep measuring


@dataclass(frozen=True)
class ProposerEstimate:
    """What the policy believes about one proposer (metrics and spec_stats)."""
    gain: float                 # the last decision's expected drafting / plain speed (batches with its rows)
    draft_ms: float             # a full-width call, in profile-time milliseconds
    draft_cost_vs_start: float  # that cost / the same at its first COST_WINDOW calls (1 = unchanged)
    acceptance_length: float    # expected tokens per step at the full draft length


@dataclass
class _Proposer:
    acceptance: AcceptanceModel
    cost: DraftCost = field(default_factory=DraftCost)
    start_fit: tuple[float, float] | None = None   # D's (a, b) over the first COST_WINDOW calls
    started: bool = False                          # start_fit is final (the window filled once)
    gain: float = 0.0


class DraftPolicy:
    """The adaptive policy's state across steps: per proposer acceptance and draft cost, the
    on/off state with its hysteresis and probes, and the verify slowdown of recent steps.
    The engine calls, each step: decide → drafted (per successful proposer call) → verified →
    accepted (per proposer, rows whose draft did not fail)."""

    def __init__(self, table: CostTable, max_draft_len: int):
        self.table, self.max_draft_len = table, max_draft_len
        self._proposers: dict[str, _Proposer] = {}
        self.on = True               # optimistic start, like the acceptance prior
        self._off_steps = 0          # consecutive decisions off (probe timing)
        self._probing = False        # this step is a probe
        self._pending: list[tuple[str, int, float]] = []   # this step's calls, until its verify is timed
        self._slowdown: deque[float] = deque(maxlen=COST_WINDOW)   # measured / profiled verify

    def _get(self, name: str) -> _Proposer:
        if name not in self._proposers:
            self._proposers[name] = _Proposer(AcceptanceModel(self.max_draft_len))
        return self._proposers[name]

    def acceptance(self, name: str) -> AcceptanceModel:
        return self._get(name).acceptance

    def decide(self, batch: int, adaptive: Sequence[tuple[str, int]], fixed: Sequence[tuple[str, int]]) -> Decision:
        """`adaptive` / `fixed`: (proposer name, the row's own cap) of each drafting row of the
        batch of `batch` rows."""
        names = {n for n, _ in (*adaptive, *fixed)}
        costs = [self._get(n).cost for n in names]
        rows = lambda rs: [(self._get(n).acceptance, cap) for n, cap in rs]  # noqa: E731
        choice = choose(self.table, batch, rows(adaptive), rows(fixed), lambda w: sum(c.seconds(w) for c in costs))
        for n, _ in adaptive:
            self._get(n).gain = choice.gain
        self._probing = False
        if not choice.drafting_k:    # no adaptive row may draft this step: nothing to decide
            return Decision(0, 0.0)
        if self.on and choice.gain < 1.0:
            self.on, self._off_steps = False, 0
        elif not self.on and choice.gain > 1.0 + HYSTERESIS:
            self.on = True
        if self.on:
            return Decision(choice.drafting_k, choice.gain)
        self._off_steps += 1
        self._probing = self._off_steps % PROBE_EVERY == 0 and self._may_pay(batch, adaptive, fixed)
        # A probe drafts at the rows' own cap: it observes every position, and its calls have the
        # width of the calls before (one width: the window's median is what the bound counts on).
        cap = max(c for _, c in adaptive)
        return Decision(cap if self._probing else 0, choice.gain, self._probing)

    def _may_pay(self, batch: int, adaptive: Sequence[tuple[str, int]], fixed: Sequence[tuple[str, int]]) -> bool:
        """Could drafting beat plain here on the verify table alone (free drafting, prior acceptance)?"""
        prior = {n: AcceptanceModel(self.max_draft_len) for n, _ in (*adaptive, *fixed)}
        best = choose(self.table, batch, [(prior[n], c) for n, c in adaptive], [(prior[n], c) for n, c in fixed],
                      lambda w: 0.0)
        return best.gain > 1.0

    def drafted(self, name: str, positions: int, seconds: float) -> None:
        """A successful proposer call of this step (wall seconds); counted once the step's verify is timed."""
        self._pending.append((name, positions, seconds))

    def verified(self, batch: int, width: int, seconds: float) -> None:
        """This step's verify forward: B rows × `width` tokens took `seconds`. Its slowdown against
        the table converts this step's calls to profile-time seconds (same conditions)."""
        slowdown = max(seconds, 1e-9) / self.table.cost(batch, width)
        self._slowdown.append(slowdown)
        for name, positions, s in self._pending:
            p = self._get(name)
            p.cost.update(positions, s / slowdown)
            if not p.started:   # the start is the proposer's first COST_WINDOW calls
                p.start_fit, p.started = p.cost.fit(), p.cost.full
        self._pending = []

    def static_step(self, name: str, batch: int, width: int, seconds: float) -> None:
        """A static step of proposer `name` (DSPark: drafting, verify and acceptance in one
        computation, no separate timings) over `batch` rows at drafted width `width` took
        `seconds`. Its drafting is the part the verify table does not explain:
        seconds / slowdown − c(batch, 1 + width), in profile-time seconds, the slowdown being that
        of recent dynamic verifies (1 when none ran). The remainder also holds what the static step
        pays at width 0 (its drafter's ingest), so drafting is charged a little more than it
        costs: the policy errs toward plain steps."""
        if width <= 0:
            return
        p = self._get(name)
        p.cost.update(width, max(seconds / self.verify_slowdown - self.table.cost(batch, 1 + width), 0.0))
        if not p.started:
            p.start_fit, p.started = p.cost.fit(), p.cost.full

    def accepted(self, name: str, drafted: Sequence[int], accepted: Sequence[int], caps: Sequence[int]) -> None:
        """This step's rows of proposer `name` whose draft did not fail (a probe's count PROBE_EVERY times)."""
        weight = min(PROBE_EVERY * WEIGHT, 0.5) if self._probing else WEIGHT
        self._get(name).acceptance.update(drafted, accepted, caps, weight)

    @property
    def verify_slowdown(self) -> float:
        """Recent verify forwards against the profiled table (median; 1 = as quiet as at start)."""
        return statistics.median(self._slowdown) if self._slowdown else 1.0

    def estimates(self) -> dict[str, ProposerEstimate]:
        out = {}
        for name, p in list(self._proposers.items()):
            full = p.acceptance.drafted_width(self.max_draft_len)
            now = p.cost.seconds(full)
            start = (p.start_fit[0] + p.start_fit[1] * full) if p.start_fit else now
            out[name] = ProposerEstimate(round(p.gain, 3), round(1e3 * now, 3),
                                         round(now / start, 3) if start > 0 else 1.0,
                                         round(p.acceptance.expected_tokens(self.max_draft_len), 3))
        return out
