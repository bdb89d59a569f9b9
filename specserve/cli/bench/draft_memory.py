"""Drafter state per sequence, as each served proposer reports it (Proposer.sequence_state).

The proposers are built in process exactly as the server builds them (serving/build.py
build_proposers; fused, one sequence), so the figure is that of the tensors the server allocates:
the drafter's KV cache slot, DSPark's committed-pair buffers, DFlash's bounded-memory budget, a
composite's members summed. The bytes exclude the drafter's weights (shared by all sequences).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from specserve.core.proposer import SequenceState
from specserve.serving.settings import DeploymentSettings


def draft_memory(target, settings: DeploymentSettings, methods: Iterable[str]) -> dict[str, SequenceState]:
    """Each of `methods`' drafter state for one sequence of the deployment's max_model_len tokens;
    target: the loaded target model the proposers read (embedding, LM head)."""
    from specserve.core.plain import NoProposer
    from specserve.serving.build import build_proposers

    one = replace(settings, max_num_seqs=1, placement="fused")
    max_len = one.model_len()
    proposers = {"none": NoProposer(), **build_proposers(target, one, max_len)}
    return {m: proposers[m].sequence_state(max_len) for m in methods}
