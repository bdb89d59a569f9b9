"""The engine's configuration: EngineConfig, apart from the engine so that what reads its
defaults (serving/settings.py, and through it the CLI's flags) does not import torch."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.core.scheduling import AGING_STEPS


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16          # KV slots = sequences running at once
    max_model_len: int = 2048       # prompt + output tokens of one sequence
    max_draft_len: int = 8          # drafted tokens (chain length or tree nodes) per step
    default_method: str = "none"
    max_prefill_tokens: int = 4096  # padded tokens per prefill forward (bounds its memory)
    # Requests waiting for a slot, at most; beyond it a request is refused at once (ServerBusy)
    # rather than queued without bound. Checked by the EngineLoop, which also counts its inbox.
    max_queue_len: int = 128
    # "adaptive": each step drafts the length with the best expected goodput at the current batch
    # (draft_policy.py; profiles verify costs at start); "fixed": every row drafts its cap.
    # Requests may choose either (GenerationRequest.draft_policy).
    draft_policy: str = "fixed"
    # When slots are full, waiting requests are admitted by priority, aged by steps waited
    # (admission.py: one level per this many steps, so the lowest tier is never starved).
    priority_aging_steps: int = AGING_STEPS
    # The method a row of a proposer with a repetition guard (DFlash) drafts with while its recent
    # output is a long repeated pattern, unless the request names its own (fallback_method).
    guard_fallback: str = "ngram"
