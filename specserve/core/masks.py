"""Attention masks for cached forwards: causal chains and draft trees, for rows of any length.

A row b writes its T new entries at cache offsets starts[b] .. starts[b]+T-1. Query t of row b may
see every committed entry before starts[b], plus the new entries that are its ancestors in the
draft tree (itself included). A chain is the tree in which each node's parent is the one before.

Worked example: a row with starts=3 and draft tree parents [-1, 0, 0, 1] (node 0 is the pending
token; nodes 1 and 2 are alternatives after it; node 3 follows node 1) gets, over cache 0..6:

    query 0: 1 1 1 | 1 0 0 0
    query 1: 1 1 1 | 1 1 0 0
    query 2: 1 1 1 | 1 0 1 0
    query 3: 1 1 1 | 1 1 0 1
"""

from __future__ import annotations

import torch


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """parents[i] < i (or -1 for a root) → [N, N] bool, [i, j] = j is i or an ancestor of i."""
    n = len(parents)
    anc = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            if p >= i:
                raise ValueError(f"tree node {i} has parent {p}; parents must come first")
            anc[i] |= anc[p]
    return anc


def tree_depths(parents: list[int]) -> list[int]:
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def build_mask(starts: list[int], parents: list[list[int]], T: int, *,
               sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask and RoPE positions for a batch of rows.

    starts[b]: committed length of row b. parents[b]: the tree of row b's new tokens (len ≤ T;
    the rest of the row is padding that sees only the context and itself).
    Returns mask [B, T, S] bool with S = max(starts) + T, and positions [B, T] int64.
    """
    B = len(starts)
    S = max(starts) + T
    mask = torch.zeros(B, T, S, dtype=torch.bool)
    positions = torch.zeros(B, T, dtype=torch.long)
    for b, (start, par) in enumerate(zip(starts, parents)):
        n = len(par)
        full = list(par) + [-1] * (T - n)  # padding: independent roots
        depth = tree_depths(full)
        positions[b] = torch.tensor(depth) + start
        mask[b, :, :start] = True
        mask[b, :, start:start + T] = ancestor_matrix(full)
        if sliding_window:
            key_pos = torch.full((S,), -10**9, dtype=torch.long)
            key_pos[:start] = torch.arange(start)
            key_pos[start:start + T] = positions[b]
            mask[b] &= (positions[b][:, None] - key_pos[None, :]) < sliding_window
    return mask, positions


def chain_parents(n: int) -> list[int]:
    return list(range(-1, n - 1))
