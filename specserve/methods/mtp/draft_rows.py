"""What the MTP drafters hand the arbiter, in the form every runtime shares: a draft token's
log-probability floor and ragged rows padded into one array. Free of torch, so the torch-free
heads runtime (heads_onnx_runtime.py) and the torch-bound ones (proposer.py, remote_drafters.py,
remote_batch.py) read the same constants.
"""

from __future__ import annotations

import numpy as np

# A drafter's q(token) is floored here before its log is taken: a head that gives a token
# probability 0 (underflow in fp16/bf16 softmax) still yields a finite log-prob for the arbiter.
MIN_PROB = 1e-30


def padded(rows: list[list], fill, dtype) -> np.ndarray:
    """Ragged rows → [B, max len] of `dtype`, `fill` past each row's end."""
    out = np.full((len(rows), max((len(r) for r in rows), default=0)), fill, dtype=dtype)
    for b, r in enumerate(rows):
        out[b, :len(r)] = r
    return out
