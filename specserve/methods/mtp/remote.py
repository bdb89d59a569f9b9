"""`mtp`, remote placement: the drafters run as Triton models in parallel inside the ensemble
`mtp_proposal` (mtp_heads ∥ eagle_backbone → calibration_head ∥ draft_drafter ∥ ngram_drafter, each
where its weights are served: the mtp spec's members), feeding `mtp_arbiter`, which merges their
drafts with the same arbiter as the fused method (arbiter.py); the engine calls the ensemble once
per step by BLS (schema.MTP_PROPOSAL says what travels). What mtp_heads and draft_drafter compute
is remote_mtp_drafters.py.

A Triton ensemble fails as a whole when one of its models is unloaded. Then the call falls back
(specserve.triton.bls.mtp_call): it calls the drafter models that are still loaded one by one,
and mtp_arbiter with what they returned; the step's draft lists the ensemble and every drafter
left out in Draft.skipped (spec_stats `proposer_skipped`). If the arbiter or every drafter is
gone, the call fails and the engine decodes the step plainly (RemoteProposer: back-off, never a
failed request). EAGLE's per-sequence state lives in eagle_backbone as for remote EAGLE: a
drafter that missed steps answers `unknown` and is re-primed with the history. The draft model's
lives in draft_drafter, which catches up from the row's tokens by itself (never `unknown`).

Here: the engine-side proposer and the in-process stand-in for the ensemble; what the ngram_drafter
and mtp_arbiter Triton models compute is remote_batch.py (numpy, no torch in their processes).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import numpy as np

from specserve.methods import row_sampling
from specserve.core.proposer import Draft, DraftRequest
from specserve.methods.mtp.proposer import OPT_BUDGET, OPT_PROPOSERS
from specserve.methods.mtp.remote_batch import arbitrate_batch, mask_of, names_of, ngram_batch  # noqa: F401 — re-exported
from specserve.methods.mtp.options import SUBPROPOSERS
from specserve.methods.remote import Call, RemoteProposer

if TYPE_CHECKING:
    from specserve.core.proposer import RemoteCalls

log = logging.getLogger("specserve.remote_mtp")

SAMPLING_KEYS = row_sampling.NAMES


def heads_call(rt) -> Callable[[dict], dict]:
    """mtp_heads as a function of the ensemble's inputs (rt: remote_mtp_drafters.HeadsOnnxRuntime)."""
    def call(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tokens, lps = rt.chains(inputs["features"], inputs["num_new"], inputs["max_draft_len"],
                                *(inputs.get(k) for k in ("valid_from", *SAMPLING_KEYS)))
        return {"heads_tokens": tokens, "heads_logprobs": lps}
    return call


def draft_call(service) -> Callable[[dict], dict]:
    """draft_drafter as a function of the ensemble's inputs (remote_mtp_drafters.DraftModelService)."""
    def call(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tokens, lps = service.chains(inputs["seq_ids"], inputs["context_tokens"], inputs["max_draft_len"],
                                     *(inputs.get(k) for k in SAMPLING_KEYS))
        return {"draft_model_tokens": tokens, "draft_model_logprobs": lps}
    return call


def in_process_call(eagle_call: Callable[[dict], dict] | None, *, heads: Callable[[dict], dict] | None = None,
                    draft: Callable[[dict], dict] | None = None) -> Call:
    """What the mtp_proposal ensemble computes, without Triton (tests, benchmarks): `eagle_call`
    is EAGLE's proposal (eagle_onnx.in_process_call), `heads` / `draft` are heads_call /
    draft_call; None for a drafter that is not served (or down)."""
    def call(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        drafted = {"ngram_tokens": ngram_batch(inputs["context_tokens"], inputs["max_draft_len"])}
        for other in (heads, draft):
            if other is not None:
                drafted.update(other(inputs))
        B = len(inputs["seq_ids"])
        unknown = np.zeros(B, dtype=bool)
        if eagle_call is not None:
            e = eagle_call({k: inputs[k] for k in ("seq_ids", "valid_from", "num_new", "features", "next_tokens",
                                                   "max_draft_len", *SAMPLING_KEYS) if k in inputs})
            drafted.update(draft_tokens=e["draft_tokens"], accept_prob=e.get("accept_prob"),
                           draft_scalars=e.get("draft_scalars"), draft_logprobs=e.get("draft_logprobs"))
            unknown = e["unknown"]
        out = arbitrate_batch({**drafted, **{k: inputs[k] for k in ("tree_budget", "proposer_mask", "row_threshold")}})
        return {**out, "unknown": unknown}
    return call


# -- the engine side ------------------------------------------------------------------------------------
class RemoteMTPProposer(RemoteProposer):
    """RemoteProposer's feature history, re-priming, timeout and back-off, for tree drafts."""

    def __init__(self, call: Call, *, served: tuple[str, ...], max_draft_len: int, budget: int,
                 depth: int = 8, threshold: float | None = 0.3, release=None, **kw):
        super().__init__("mtp", call, max_draft_len=max_draft_len, threshold=threshold, release=release, **kw)
        self.served, self.budget, self.depth = served, budget, depth

    option_keys = (OPT_PROPOSERS, OPT_BUDGET)

    def check_options(self, options: dict) -> None:
        from specserve.methods.mtp.proposer import check_options
        check_options(options, self.served, self.max_draft_len)

    def _request_len(self, r: DraftRequest) -> int:
        return min(r.max_draft_len, self.depth)

    def _batch(self, requests, rows, *, reprime):
        batch = super()._batch(requests, rows, reprime=reprime)
        L = max(len(requests[i].token_ids) for i in rows)
        context = np.full((len(rows), L), -1, dtype=np.int64)
        budget, mask, threshold = [], [], []
        for j, i in enumerate(rows):
            r = requests[i]
            context[j, :len(r.token_ids)] = r.token_ids
            opts = r.options or {}
            budget.append(min(opts.get(OPT_BUDGET) or self.budget, r.max_draft_len))
            mask.append(mask_of(opts.get(OPT_PROPOSERS) or self.served))
            threshold.append(self._threshold(r) or 0.0)
        return {**batch, "context_tokens": context, "tree_budget": np.array(budget, dtype=np.int64),
                "proposer_mask": np.array(mask, dtype=np.int64), "row_threshold": np.array(threshold, dtype=np.float32)}

    def _row_drafts(self, requests, rows, out) -> list[Draft]:
        skipped = tuple(out.get("skipped", ()))
        drafts = []
        for j in range(len(rows)):
            n = int((out["tree_tokens"][j] >= 0).sum())
            drafts.append(Draft([int(t) for t in out["tree_tokens"][j, :n]], [int(p) for p in out["tree_parents"][j, :n]],
                                None, sources=[names_of(int(m)) for m in out["tree_sources"][j, :n]], skipped=skipped))
        return drafts


def remote_mtp(remote: "RemoteCalls", served, *, max_draft_len: int, threshold: float | None,
               timeout_s: float) -> RemoteMTPProposer:
    """The remote `mtp` proposer of a deployment (the mtp spec's builder): `served` are its
    members, the mtp_proposal ensemble's (render.render_mtp_proposal renders the same set);
    `remote` has the BLS calls (specserve.triton.bls.remote_calls)."""
    from specserve.methods.mtp.arbiter import DEFAULT_BUDGET

    served = [n for n in SUBPROPOSERS if n in served]
    return RemoteMTPProposer(remote.mtp_proposal(served), served=tuple(served), max_draft_len=max_draft_len,
                             budget=DEFAULT_BUDGET, threshold=threshold, release=remote.mtp_release(served),
                             timeout_s=timeout_s)
