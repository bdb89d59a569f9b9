"""`none`: plain decoding. Drafts nothing, so each step emits exactly one token."""

from __future__ import annotations

from specserve.core.proposer import Draft, DraftRequest, StepOutcome


class NoProposer:
    name = "none"
    needs_features = False

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft.empty() for _ in requests]

    def observe(self, outcomes: list[StepOutcome]) -> None:
        pass

    def release(self, seq_id: int) -> None:
        pass
