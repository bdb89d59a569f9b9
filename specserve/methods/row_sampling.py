"""Each row's sampling as it travels to remote drafters (schema.ROW_SAMPLING), so a drafter in
another process proposes a seeded row's draft token at sequence index i as the fused drafters
do: argmax(log q~_i + g(seed, i)), with the target's own warping and noise (core/sampling.py).

Greedy and unseeded sampled rows travel with temperature 0 and draft greedily (argmax, verified
as point masses). The seed's 64 bits travel as an int64 (sampling.seed_tensor), temperature and
top-p as float64, so the drafter's warped distribution is the engine's to the last bit.
"""

from __future__ import annotations

import numpy as np

from specserve.core.proposer import DraftRequest
from specserve.core.sampling_params import SamplingParams

# torch (core.sampling) is imported only where a row is encoded (the engine, which has it) or a
# seeded row drafts: the ONNX drafters' Triton stubs then start without it (2.4 s each here).

NAMES = ("row_seed", "row_temperature", "row_top_k", "row_top_p")   # schema.ROW_SAMPLING's, in order


def encode(requests: list[DraftRequest]) -> dict[str, np.ndarray]:
    """The rows' sampling, [B] each."""
    from specserve.core.sampling import seed_tensor

    coupled = [r.seed is not None for r in requests]
    return {"row_seed": seed_tensor([r.seed if c else 0 for r, c in zip(requests, coupled)]).numpy(),
            "row_temperature": np.array([r.params.temperature if c else 0.0 for r, c in zip(requests, coupled)],
                                        dtype=np.float64),
            "row_top_k": np.array([r.params.top_k for r in requests], dtype=np.int64),
            "row_top_p": np.array([r.params.top_p for r in requests], dtype=np.float64)}


def decode(row_seed: np.ndarray | None, row_temperature: np.ndarray | None, row_top_k: np.ndarray | None,
           row_top_p: np.ndarray | None, rows: int) -> list[SamplingParams | None]:
    """Per row, its sampling when it drafts with its seed's noise, else None (greedy drafts).
    Absent arrays (a caller that sends none): every row drafts greedily."""
    if row_temperature is None:
        return [None] * rows
    return [SamplingParams(temperature=float(row_temperature[b]), top_k=int(row_top_k[b]),
                           top_p=float(row_top_p[b]), seed=int(row_seed[b]) % 2 ** 64)
            if row_temperature[b] > 0 else None for b in range(rows)]


def seeded_choice(logits: np.ndarray, params: SamplingParams, positions: list[int]) -> list[int]:
    """logits [n, V] of a seeded row's drafter at sequence indices `positions` [n] → its n draft
    tokens: the coupled choice argmax(log q~ + g(seed, position)) of core.sampling.seeded_tokens."""
    import torch

    from specserve.core.sampling import seeded_tokens

    return seeded_tokens(torch.from_numpy(np.ascontiguousarray(logits)), params, positions)
