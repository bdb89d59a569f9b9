"""What the core asks of a target model: one explicit forward, its logits, a KV pool.

The engine and the static step are written against `TargetModel`, not against the transformer in
specserve.model, so the core imports nothing above itself; specserve.model.transformer.Transformer
satisfies the protocol (as does any test double with the same methods).

Shapes: B rows, T new tokens per row, S keys visible (the span of cache read), D hidden size,
Hkv key/value heads, hd head dim, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.core.kv_cache import KVCache


@dataclass
class ForwardBatch:
    """What one target forward needs, all explicit."""
    tokens: torch.Tensor     # [B, T] int64
    positions: torch.Tensor  # [B, T] int64 RoPE positions (tree nodes: context length + depth)
    slots: torch.Tensor      # [B] int64 cache slot of each row
    starts: torch.Tensor     # [B] int64 cache offset where this forward's T entries are written
    mask: torch.Tensor       # [B, T, S] bool, True = query t may attend to cache entry s
    # Row ranges [a, b) whose slots are consecutive, covering the rows in order (KVCache.runs_for,
    # worked out on the host by whoever built the batch); None: read all rows at once. Attention
    # reads each run as a view of the pool: one read of scattered slots copies every layer's
    # [B, Hkv, S, hd] (measured: 45 % of a 64-row SmolLM2 decode step on CPU).
    slot_runs: tuple[tuple[int, int], ...] | None = None


@dataclass
class ForwardOutput:
    hidden: torch.Tensor                      # [B, T, D] after the final norm (feeds the LM head)
    layer_hidden: dict[int, torch.Tensor]     # layer index → [B, T, D] residual stream after it


class CacheIO(Protocol):
    """The KV pool as a forward sees it: KVCache, or the static step's sync-free DeviceKV."""

    def write(self, layer: int, slots: torch.Tensor, starts: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None: ...  # k, v [B, Hkv, T, hd]

    def read(self, layer: int, slots: torch.Tensor,
             span: int) -> tuple[torch.Tensor, torch.Tensor]: ...  # k, v [B, Hkv, span, hd]


class RopeInfo(Protocol):
    @property
    def rope_type(self) -> str: ...  # "dynamic" (NTK) reads positions on the host


class TargetConfig(Protocol):
    """The target's configuration fields the core reads (read-only: configs are frozen)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    @property
    def sliding_window(self) -> int | None: ...
    @property
    def rope(self) -> RopeInfo: ...


class TargetModel(Protocol):
    @property
    def cfg(self) -> TargetConfig: ...
    @property
    def device(self) -> torch.device: ...

    def new_cache(self, num_slots: int, max_len: int) -> KVCache: ...

    def forward(self, batch: ForwardBatch, cache: CacheIO | None,
                hidden_layers: tuple[int, ...] = ()) -> ForwardOutput: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [..., D] → [..., V] fp32
