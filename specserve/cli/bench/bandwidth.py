"""The memory-bandwidth bound of a decode step on this machine.

A decode step at M = 1 reads every weight once, so a configuration cannot decode faster than
bandwidth ÷ (weight bytes per step) tokens/s at one token a step. `copy_bandwidth` measures the
bandwidth with a copy loop (torch's copy_ over tensors much larger than the caches, on the torch
threads the caller set, as a decode step runs; a copy reads and writes each byte: 2 × size).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float      # the best copy of `repeats`
    array_bytes: int
    repeats: int
    threads: int
    method: str = "torch Tensor.copy_ of a float32 tensor, best of the repeats; a copy counts 2 × its size"

    def to_dict(self) -> dict:
        return asdict(self)


def copy_bandwidth(array_bytes: int = 256 << 20, repeats: int = 10) -> Bandwidth:
    import torch

    src = torch.ones(array_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)   # touch every page first
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    nbytes = src.numel() * src.element_size()
    return Bandwidth(2 * nbytes / best, nbytes, repeats, torch.get_num_threads())


def weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads: every parameter and buffer but the embedding
    table (a step reads one row of it), RoPE's tables and a quantized head's dense weight (it
    reads its int8 copy, model/quantized_linear.Int8Head); a tied head counted once."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    embed, head = model.embed_tokens.weight, model.lm_head
    head_weight = getattr(head, "weight", None)
    unread = set() if head_weight is embed else {id(embed)}
    if not getattr(head, "reads_dense_weight", True):
        unread.add(id(head_weight))
    seen, total = set(), 0
    for name, t in tensors:
        if id(t) in seen or id(t) in unread or name.startswith("rotary"):
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def bound_fraction(tokens_per_s: float | None, bytes_per_step: int | None, bandwidth: Bandwidth) -> float | None:
    """tokens/s as a fraction of bandwidth ÷ bytes per step (one token a weight pass: a
    speculative method, several tokens a pass, can exceed 1)."""
    if not tokens_per_s or not bytes_per_step:
        return None
    return tokens_per_s / (bandwidth.bytes_per_s / bytes_per_step)
