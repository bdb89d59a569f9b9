"""DFlash's bounded context memory: what the block drafter remembers of a sequence (docs/design.md, 'The methods').

A sequence's n committed tokens each have a FUSED feature vector f_t [D] (the drafter's learned
projection of several target layers). The memory keeps, per sequence:

  ring     the last W fused vectors exactly (t in [n-W, n)), with their distance n - t;
  anchors  one vector per older window of W tokens that has wholly left the ring: the window's
           mean (window k = tokens [kW, (k+1)W), kept once (k+1)W <= n - W);
  pool     r learned slots summarising EVERY token that has left the ring (t < n - W), as a
           running softmax-weighted mean per slot over a rank-ρ projection of the vectors:
               N_j = Σ_t exp(s_j(f_t) - m_j) · P f_t     [ρ]      s_j(f) = <S_j, f> / sqrt(D)
               Z_j = Σ_t exp(s_j(f_t) - m_j)                        m_j = running max of s_j
               pool_j = N_j / Z_j   (0 while nothing has left the ring)
           updated token by token as tokens leave the ring.

Size per sequence: W·D + (n/W)·D + r·(ρ + 2) + D (the window being summed into its anchor)
numbers, so it grows like W + n/W + r, not n. `MemoryView` is what a drafter step reads; the
training code computes the SAME view for many positions at once (`batched_views`), with masks
instead of running sums, so training sees exactly the memory the server keeps.

Worked example (W = 4): after n = 13 tokens, the ring holds t = 9..12 (distances 4..1), tokens
0..8 have left it, window 0 (t = 0..3) and window 1 (t = 4..7) have anchors, t = 8 sits in the
partial-window sum, and the pool has absorbed t = 0..8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn


_TINY = torch.finfo(torch.float32).tiny


def _flush(x: torch.Tensor) -> torch.Tensor:
    """Subnormal numbers → 0. exp() of very negative scores is subnormal, and CPUs compute with
    subnormals up to ~100× slower (a drafter layer over such a pool: 120 ms instead of 1.4 ms)."""
    return x.masked_fill(x.abs() < _TINY, 0.0)


class SlotPool(nn.Module):
    """The learned parts of the pool: slot scores S [r, D] and the low-rank projection P [ρ, D]."""

    def __init__(self, hidden_size: int, slots: int, rank: int):
        super().__init__()
        self.score = nn.Linear(hidden_size, slots, bias=False)  # s(f) = S f / sqrt(D)
        self.down = nn.Linear(hidden_size, rank, bias=False)    # P
        self.scale = 1.0 / math.sqrt(hidden_size)

    def scores(self, f: torch.Tensor) -> torch.Tensor:
        return self.score(f).float() * self.scale  # [..., r]

    def project(self, f: torch.Tensor) -> torch.Tensor:
        return self.down(f).float()  # [..., ρ]


@dataclass
class MemoryView:
    """One sequence's memory as a drafter step reads it."""
    ring: torch.Tensor       # [w, D] the last w <= W fused vectors, oldest first
    anchors: torch.Tensor    # [k, D] one per old window, oldest first
    pool: torch.Tensor       # [r, ρ] pool_j = N_j / Z_j (zeros while empty)


@dataclass
class SequenceMemory:
    """Per-sequence state, updated incrementally; never holds more than W + n/W + r vectors."""
    window: int
    hidden_size: int
    slots: int
    rank: int
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    n: int = 0                                   # tokens ingested
    ring: torch.Tensor = field(init=False)       # [W, D] circular: token t at row t % W
    anchors: list[torch.Tensor] = field(init=False, default_factory=list)  # k × [D]
    window_sum: torch.Tensor = field(init=False)  # [D] fp32 sum of the window leaving the ring
    num: torch.Tensor = field(init=False)        # [r, ρ] fp32 N_j
    den: torch.Tensor = field(init=False)        # [r] fp32 Z_j
    peak: torch.Tensor = field(init=False)       # [r] fp32 m_j (running max of the scores)

    def __post_init__(self):
        W, D, dev = self.window, self.hidden_size, self.device
        self.ring = torch.zeros(W, D, dtype=self.dtype, device=dev)
        self.anchors = []
        self.window_sum = torch.zeros(D, dtype=torch.float32, device=dev)
        self.num = torch.zeros(self.slots, self.rank, dtype=torch.float32, device=dev)
        self.den = torch.zeros(self.slots, dtype=torch.float32, device=dev)
        self.peak = torch.full((self.slots,), -math.inf, dtype=torch.float32, device=dev)

    def append(self, fused: torch.Tensor, pool: SlotPool) -> None:
        """Ingest the fused vectors [m, D] of the next m committed tokens (in order)."""
        W, n, m = self.window, self.n, fused.shape[0]
        lo, hi = max(0, n - W), max(0, n + m - W)   # tokens that leave the ring now: [lo, hi)
        if hi > lo:
            from_ring = self.ring[[t % W for t in range(lo, min(hi, n))]]  # read before overwriting
            self._evict(torch.cat([from_ring, fused[: max(0, hi - n)].to(self.dtype)]), lo, pool)
        for t in range(max(n, n + m - W), n + m):  # only the last W new vectors stay
            self.ring[t % W] = fused[t - n]
        self.n = n + m

    def _evict(self, vec: torch.Tensor, first: int, pool: SlotPool) -> None:
        """vec [e, D]: tokens first .. first+e-1 leaving the ring, oldest first."""
        W, end, pos = self.window, first + vec.shape[0], first
        while pos < end:   # window sums → anchors, split at window boundaries
            stop = min(end, (pos // W + 1) * W)
            self.window_sum += vec[pos - first: stop - first].float().sum(0)
            if stop % W == 0:   # window pos // W has wholly left the ring
                self.anchors.append((self.window_sum / W).to(self.dtype))
                self.window_sum.zero_()
            pos = stop
        x = vec.to(pool.score.weight.dtype)
        s, v = pool.scores(x), pool.project(x)             # [e, r], [e, ρ]
        peak = torch.maximum(self.peak, s.max(0).values)   # [r]
        old = _flush(torch.exp(self.peak - peak))   # rescale the running sums to the new max (0 when empty)
        w = _flush(torch.exp(s - peak))             # [e, r]
        self.num = _flush(self.num * old[:, None] + w.T @ v)
        self.den = self.den * old + w.sum(0)
        self.peak = peak

    def view(self) -> MemoryView:
        W, n = self.window, self.n
        w = min(n, W)
        order = [(t % W) for t in range(n - w, n)]
        ring = self.ring[order]
        anchors = (torch.stack(self.anchors) if self.anchors
                   else self.ring.new_zeros(0, self.hidden_size))
        pool = torch.where(self.den[:, None] > 0, self.num / self.den.clamp_min(1e-30)[:, None],
                           torch.zeros_like(self.num))
        return MemoryView(ring, anchors, pool)

    def num_bytes(self) -> int:
        """Bytes of drafter state this sequence holds now."""
        tensors = [self.ring, self.window_sum, self.num, self.den, self.peak, *self.anchors]
        return sum(t.numel() * t.element_size() for t in tensors)


def full_feature_bytes(n: int, hidden_size: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of a drafter that keeps every token's fused feature vector (the unbounded baseline)."""
    return n * hidden_size * torch.tensor([], dtype=dtype).element_size()


def budget_bytes(n: int, window: int, slots: int, rank: int, hidden_size: int,
                 dtype: torch.dtype = torch.float32) -> int:
    """The W + n/W + r budget: W ring vectors, one anchor per window, r pool slots of ρ + 2 fp32
    numbers (N_j, Z_j, m_j) and one fp32 vector for the window being summed."""
    size = torch.tensor([], dtype=dtype).element_size()
    return (window + n // window) * hidden_size * size + (slots * (rank + 2) + hidden_size) * 4


# -- the same memory for many positions at once (training) ---------------------------------------

@dataclass
class BatchedViews:
    ring: torch.Tensor        # [A, W, D] the ring at each anchor position, right-aligned
    ring_valid: torch.Tensor  # [A, W] bool
    anchors: torch.Tensor     # [A, K, D]
    anchor_valid: torch.Tensor  # [A, K] bool
    pool: torch.Tensor        # [A, r, ρ]


def batched_views(fused: torch.Tensor, positions: torch.Tensor, window: int, pool: SlotPool) -> BatchedViews:
    """The memory each (sequence, position) pair would hold, computed in one go.

    fused [S, T, D] fused vectors of S sequences; positions [S, A] pending-token indices p
    (the memory holds tokens 0..p-1). Returns views flattened to S·A rows, differentiable in
    `fused` and in the pool's parameters; equals SequenceMemory.view() after p tokens.
    """
    S, T, D = fused.shape
    A = positions.shape[1]
    W = window
    dev = fused.device
    p = positions.reshape(-1)                                   # [S·A]
    seq = torch.arange(S, device=dev).repeat_interleave(A)      # [S·A]
    # ring: tokens p-W .. p-1 (right-aligned: column W-1 is token p-1)
    idx = p[:, None] - W + torch.arange(W, device=dev)[None, :]  # [S·A, W]
    ring_valid = idx >= 0
    ring = fused[seq[:, None], idx.clamp_min(0)]                # [S·A, W, D]
    ring = ring * ring_valid[..., None]
    # anchors: window means of windows k with (k+1)W <= p - W
    K = max(T // W, 1)
    full = fused[:, : (T // W) * W].reshape(S, T // W, W, D).float().mean(2) if T >= W else \
        fused.new_zeros(S, 1, D).float()
    anchors = full[seq].to(fused.dtype)                          # [S·A, K, D]
    k = torch.arange(K, device=dev)
    anchor_valid = (k[None, :] + 1) * W <= (p[:, None] - W)
    anchors = anchors * anchor_valid[..., None]
    # pool: softmax over evicted tokens t < p - W of s_j(f_t), applied to P f_t
    s = pool.scores(fused)                                       # [S, T, r]
    v = pool.project(fused)                                      # [S, T, ρ]
    t = torch.arange(T, device=dev)
    evicted = t[None, :] < (p[:, None] - W)                      # [S·A, T]
    # A finite fill (not -inf) keeps an empty pool's gradients finite; masked weights are 0.
    logits = s[seq].masked_fill(~evicted[..., None], -1e9)       # [S·A, T, r]
    weights = torch.softmax(logits, dim=1) * evicted[..., None]  # empty pool → zeros
    pooled = torch.einsum("atr,atq->arq", weights, v[seq])       # [S·A, r, ρ]
    return BatchedViews(ring, ring_valid, anchors, anchor_valid, pooled)
