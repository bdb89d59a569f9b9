"""The KV cache: one preallocated pool, a slot per sequence, a valid length per slot.

Layout (docs/design.md, 'State and verification'):  k, v : [layers, slots, kv_heads, max_len, head_dim]

- A sequence owns a slot while it runs. `lengths[slot]` counts the entries that hold the KV of
  committed tokens; everything at or past it is stale and is masked out by the caller and
  overwritten by the next write.
- Rejecting draft tokens is `truncate(slot, n)`: moving the length back. Nothing is cleared.
- Tree verification writes all N draft nodes contiguously after the committed entries; the
  accepted root-to-leaf path is then moved into place by `compact_path`.
- Nothing here allocates a pool-sized tensor after construction.
"""

from __future__ import annotations

from typing import Sequence

import torch


class CacheFull(RuntimeError):
    pass


def slot_runs(slots: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Row ranges [a, b) of `slots` (one per row, in row order) whose slots are consecutive:
    slot_runs([4, 5, 6, 0, 2, 3]) == ((0, 3), (3, 4), (4, 6)). ForwardBatch.slot_runs."""
    runs, a = [], 0
    for b in range(1, len(slots) + 1):
        if b == len(slots) or slots[b] != slots[b - 1] + 1:
            runs.append((a, b))
            a = b
    return tuple(runs)


# Read run by run only when one gather would copy more than this per layer (keys and values).
# Measured on this CPU, every run one row long (benchmarks/scattered_slots.py): a 0.8 MB gather
# was 8 % faster than its runs (demo model, 8 rows x 100 tokens), 3.3 MB 5 % slower (16 x 200),
# 13 MB 19 % slower (32 x 400), 59 MB 28 % slower (SmolLM2, 64 x 600).
GATHER_BYTES_LIMIT = 2 << 20


class KVCache:
    def __init__(self, *, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots, self.max_len = num_slots, max_len
        self.lengths = [0] * num_slots  # host-side: read every step, never worth a device sync
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._heads = torch.arange(num_kv_heads, device=device)

    # -- slot ownership -------------------------------------------------------------------
    def allocate(self) -> int:
        if not self._free:
            raise CacheFull(f"all {self.num_slots} KV slots are in use")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"slot {slot} released twice")
        self.lengths[slot] = 0
        self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def runs_for(self, slots: Sequence[int], span: int) -> tuple[tuple[int, int], ...] | None:
        """ForwardBatch.slot_runs for a forward over these rows reading `span` entries: the runs
        on a CPU when gathering the rows would copy more than GATHER_BYTES_LIMIT a layer; None
        (one read) otherwise, and always on CUDA, where one gather costs less than an attention
        launch per run."""
        if self.k.device.type != "cpu":
            return None
        copied = 2 * len(slots) * self.k.shape[2] * span * self.k.shape[4] * self.k.element_size()
        return slot_runs(slots) if copied > GATHER_BYTES_LIMIT else None

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot's keys and values (every slot is allocated whole, at max_len)."""
        return (self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()) // self.num_slots

    # -- per-layer access used by the model's attention ----------------------------------------
    def write(self, layer: int, slots: torch.Tensor, starts: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [B, kv_heads, T, head_dim] at positions starts[b] .. starts[b]+T-1 of slots[b]."""
        B, _, T, _ = k.shape
        if B == 1:
            s, st = int(slots[0]), int(starts[0])
            self.k[layer, s, :, st:st + T] = k[0]
            self.v[layer, s, :, st:st + T] = v[0]
            return
        cols = starts[:, None] + torch.arange(T, device=starts.device)[None]  # [B, T]
        # Advanced indices broadcast to [B, kv_heads, T]; each element is a head_dim vector.
        idx = (slots[:, None, None], self._heads[None, :, None], cols[:, None, :])
        self.k[layer].index_put_(idx, k)
        self.v[layer].index_put_(idx, v)

    def read(self, layer: int, slots: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, kv_heads, span, head_dim] of the first `span` entries of each slot."""
        first = int(slots[0])
        if slots.numel() == 1 or torch.equal(slots, torch.arange(first, first + slots.numel())):
            # Contiguous slots: a view, no copy.
            return (self.k[layer, first:first + slots.numel(), :, :span],
                    self.v[layer, first:first + slots.numel(), :, :span])
        return self.k[layer, slots, :, :span], self.v[layer, slots, :, :span]

    # -- commit / rollback --------------------------------------------------------------------
    def truncate(self, slot: int, length: int) -> None:
        """Roll back (or commit) by moving the valid length; stale entries stay until overwritten."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"length {length} outside [0, {self.max_len}]")
        self.lengths[slot] = length

    def compact_path(self, slot: int, base: int, path: list[int]) -> None:
        """Move the entries of an accepted tree path into a contiguous run starting at `base`.

        `path` holds the path's node offsets relative to `base`, in root-to-leaf order, strictly
        increasing (a node is always written after its parent). Worked example: the step wrote
        [root, a, b, c, d] at base..base+4 and the accepted path is root → b → d, path = [0, 2, 4]:
        afterwards entries base, base+1, base+2 hold root, b, d and the length is base+3.
        """
        if any(q <= p for p, q in zip(path, path[1:])):
            raise ValueError(f"tree path offsets must increase, got {path}")
        n = len(path)
        src = torch.tensor(path, device=self.k.device) + base
        if not torch.equal(src, torch.arange(base, base + n, device=self.k.device)):
            # Right-hand side advanced indexing copies first, so overlapping moves are safe.
            self.k[:, slot, :, base:base + n] = self.k[:, slot, :, src]
            self.v[:, slot, :, base:base + n] = self.v[:, slot, :, src]
        self.lengths[slot] = base + n
