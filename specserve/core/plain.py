"""`none`: plain decoding. Drafts nothing, so each step emits exactly one token."""

from __future__ import annotations

from specserve.core.proposer import Draft, DraftRequest, ProposerDefaults, SequenceState


class NoProposer(ProposerDefaults):
    name = "none"

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft.empty() for _ in requests]

    def sequence_state(self, max_model_len: int) -> SequenceState:
        return SequenceState(0, "no drafter state")
