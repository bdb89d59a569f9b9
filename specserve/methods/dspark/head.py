"""The drafter's token head inside DSPark's static step, for an EAGLE-1 drafter (the target's LM
head: the draft vocabulary is the target's) and an EAGLE-3 one (its own head over a reduced draft
vocabulary, mapped through d2t), with no host sync and fixed shapes, so the step stays capturable
as a CUDA graph.

The step picks draft tokens in the draft vocabulary (argmax, an inverse-CDF draw or the coupled
choice, over Vd entries rather than V: warping and drawing cost the draft vocabulary's size) and
maps them to target ids; what verification reads is the drafter's q expanded to the target
vocabulary, exactly zero outside the draft ids, as the dynamic EAGLE proposer's
(eagle3.Eagle3Drafter.to_target gives the same q over logits; here the draft ids are picked first
and mapped with the drafter's target ids, made once when its vocabulary is set).

Worked example (target vocabulary V = 8, draft vocabulary Vd = 3 on target ids [2, 3, 5], so
d2t = [2, 2, 3]): own logits [0.1, 1.5, -0.2] → greedy draft id 1 → target id 1 + d2t[1] = 3;
q_d = softmax = [0.17, 0.69, 0.14] → q over the target vocabulary [0, 0, 0.17, 0.69, 0, 0.14, 0, 0].
A seeded row's coupled choice over the draft ids reads the target vocabulary's noise at [2, 3, 5],
so it is the choice argmax(log q + g) over the target vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.methods.eagle.drafter import EagleDrafter
from specserve.methods.eagle.eagle3 import Eagle3Drafter


class DraftHead:
    def __init__(self, drafter: EagleDrafter | Eagle3Drafter, target_head: torch.Tensor | None):
        """target_head [V, D]: the target's LM head in the drafter's dtype (EAGLE-1 drafts with it);
        None for an EAGLE-3 drafter, which has its own."""
        self.drafter = drafter
        own = isinstance(drafter, Eagle3Drafter)
        if own == (target_head is not None):
            raise ValueError("an EAGLE-1 drafter drafts with the target's LM head, an EAGLE-3 one with its own")
        self._target_head = target_head
        # [Vd] target id of each draft id; None: the draft vocabulary is the target's (EAGLE-1)
        self.ids = drafter.target_ids() if own else None
        self.vocab = drafter.cfg.vocab_size if own else target_head.shape[0]  # V

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, D] → [B, Vd] fp32 over the draft vocabulary; the calibration head's top-1
        probability and entropy are computed over these (as the dynamic proposer does)."""
        if self.ids is not None:
            return self.drafter.draft_logits(h)
        return F.linear(h, self._target_head).float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """[B] draft ids → [B] target ids (id + d2t[id])."""
        return draft_ids if self.ids is None else self.ids[draft_ids]

    def expand(self, q_d: torch.Tensor) -> torch.Tensor:
        """[B, Vd] probabilities over the draft vocabulary → [B, V] over the target's, 0 elsewhere."""
        if self.ids is None:
            return q_d
        return q_d.new_zeros(q_d.shape[0], self.vocab).index_copy(1, self.ids, q_d)

    def draft_noise(self, noise: torch.Tensor) -> torch.Tensor:
        """[B, V] Gumbel noise over the target vocabulary → [B, Vd], each draft id its target id's."""
        return noise if self.ids is None else noise[:, self.ids]
