"""The calibration head both EAGLE drafters carry (drafter.py, eagle3.py): per drafted position,
P(target accepts it | the earlier draft tokens were accepted), from the draft hidden state and
scalars of the drafter's own logits (docs/design.md, 'The methods')."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.methods.eagle.draft_scalars import CALIBRATION_POSITIONS


class CalibrationHead(nn.Module):
    """Per drafted position: P(target accepts it | the earlier draft tokens were accepted)."""

    def __init__(self, hidden_size: int, width: int = 64):
        super().__init__()
        self.proj = nn.Linear(hidden_size, width)
        self.scalars = nn.Linear(3, width)
        self.out = nn.Linear(width, 1)

    @staticmethod
    def scalar_features(logits: torch.Tensor, position: int) -> torch.Tensor:
        """logits [B, V] of the drafter at draft position `position` → [B, 3]."""
        logp = logits.float().log_softmax(-1)
        p = logp.exp()
        top1 = p.max(-1).values
        entropy = -(p * logp).sum(-1)
        pos = torch.full_like(top1, position / CALIBRATION_POSITIONS)
        return torch.stack([top1, entropy, pos], dim=-1)

    def forward(self, hidden: torch.Tensor, scalars: torch.Tensor) -> torch.Tensor:
        # hidden [B, D], scalars [B, 3] → acceptance logit [B] (sigmoid gives the probability)
        return self.out(F.silu(self.proj(hidden.float()) + self.scalars(scalars))).squeeze(-1)
