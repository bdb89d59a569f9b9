"""Where a remote drafter's chain is cut by its calibration head, in numpy: the engine's remote
proposers and the mtp_arbiter Triton model (which runs without torch) cut the same way."""

from __future__ import annotations

import numpy as np


def calibration_cut(tokens: np.ndarray, probs: np.ndarray | None, threshold: float | None) -> list[int]:
    """A remote chain [K] (-1 padded) cut where the calibration head's cumulative acceptance
    probability (probs [K]) falls below the threshold; no threshold or no probs: the whole chain."""
    keep, cum = [], 1.0
    for j, t in enumerate(tokens.tolist()):
        if t < 0:
            break
        if probs is not None and threshold:
            cum *= float(probs[j])
            if cum < threshold:
                break
        keep.append(int(t))
    return keep
