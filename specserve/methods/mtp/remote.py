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

Here: the engine-side proposer and the numpy functions the two Triton models run (also called
in-process by tests).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Callable

import numpy as np

from specserve.methods import row_sampling
from specserve.methods.mtp.arbiter import ArbiterConfig, Candidate, arbitrate
from specserve.core.proposer import Draft, DraftRequest
from specserve.methods.mtp.proposer import OPT_BUDGET, OPT_PROPOSERS, SUBPROPOSERS
from specserve.methods.ngram.proposer import NgramProposer, lookup
from specserve.methods.remote import Call, RemoteProposer, calibration_cut

if TYPE_CHECKING:
    from specserve.core.proposer import RemoteCalls

log = logging.getLogger("specserve.remote_mtp")

NGRAM = NgramProposer()   # the fused method's n-gram settings, shared
SAMPLING_KEYS = row_sampling.NAMES


def mask_of(names) -> int:
    return sum(1 << SUBPROPOSERS.index(n) for n in names)


def names_of(mask: int) -> tuple[str, ...]:
    return tuple(n for i, n in enumerate(SUBPROPOSERS) if mask >> i & 1)


# -- what the Triton models compute --------------------------------------------------------------------
def ngram_batch(context_tokens: np.ndarray, max_draft_len: np.ndarray) -> np.ndarray:
    """ngram_drafter: [B, L] tokens (-1 padded), [B] → [B, K] lookup drafts (-1 padded)."""
    rows = [lookup([int(t) for t in row if t >= 0], max_n=NGRAM.max_n, min_n=NGRAM.min_n, k=min(NGRAM.k, int(k)))
            for row, k in zip(context_tokens, max_draft_len)]
    out = np.full((len(rows), max((len(r) for r in rows), default=0)), -1, dtype=np.int64)
    for b, r in enumerate(rows):
        out[b, :len(r)] = r
    return out


def _eagle_candidate(tokens: np.ndarray, logprobs: np.ndarray | None, scalars: np.ndarray | None,
                     accept: np.ndarray | None, threshold: float) -> Candidate | None:
    """EAGLE's chain up to its calibration cut (as methods/remote.calibration_cut); confidence =
    log q(token) (draft_logprobs), as the fused proposer's Draft.logprobs; from a drafter that
    sends none, the log of its top-1 probability (draft_scalars[..., 0]: the same for greedy rows)."""
    kept = calibration_cut(tokens, accept, threshold if threshold > 0 else None)
    if not kept:
        return None
    if logprobs is not None:
        lps = [float(logprobs[j]) for j in range(len(kept))]
    else:
        lps = [math.log(max(float(scalars[j, 0]), 1e-30)) if scalars is not None else ArbiterConfig().prior("eagle")
               for j in range(len(kept))]
    return Candidate("eagle", tuple(kept), tuple(lps))


def _scored_chain(name: str, tokens: np.ndarray, logprobs: np.ndarray | None, prior: float) -> Candidate | None:
    """A -1 padded chain with the log-probs its drafter gave (mtp_heads, draft_drafter)."""
    toks = tuple(int(t) for t in tokens if t >= 0)
    if not toks:
        return None
    lps = (prior,) * len(toks) if logprobs is None else tuple(float(x) for x in logprobs[:len(toks)])
    return Candidate(name, toks, lps)


def arbitrate_batch(inputs: dict[str, np.ndarray | None], config: ArbiterConfig = ArbiterConfig()) -> dict[str, np.ndarray]:
    """mtp_arbiter: the drafters' outputs (any may be None) and each row's tree budget, proposer
    mask and threshold → the merged tree per row, -1 padded (schema.MTP_ARBITER). Candidates are
    listed in SUBPROPOSERS order, as fused mtp lists them (the arbiter's tie-breaks)."""
    budget, mask, threshold = inputs["tree_budget"], inputs["proposer_mask"], inputs["row_threshold"]
    got = {k: inputs.get(k) for k in ("draft_tokens", "draft_scalars", "draft_logprobs", "accept_prob", "ngram_tokens",
                                       "heads_tokens",
                                       "heads_logprobs", "draft_model_tokens", "draft_model_logprobs")}
    has = {k: v is not None and v.size > 0 for k, v in got.items()}
    trees = []
    for b in range(len(budget)):
        wanted = names_of(int(mask[b]))
        cands: list[Candidate | None] = []
        if "mtp_heads" in wanted and has["heads_tokens"]:
            cands.append(_scored_chain("mtp_heads", got["heads_tokens"][b],
                                       got["heads_logprobs"][b] if has["heads_logprobs"] else None,
                                       config.prior("mtp_heads")))
        if "eagle" in wanted and has["draft_tokens"]:
            scalars, accept = got["draft_scalars"], got["accept_prob"]
            logprobs = got["draft_logprobs"][b] if has["draft_logprobs"] else None
            cands.append(_eagle_candidate(got["draft_tokens"][b], logprobs, scalars[b] if has["draft_scalars"] else None,
                                          accept[b] if has["accept_prob"] else None, float(threshold[b])))
        if "draft" in wanted and has["draft_model_tokens"]:
            cands.append(_scored_chain("draft", got["draft_model_tokens"][b],
                                       got["draft_model_logprobs"][b] if has["draft_model_logprobs"] else None,
                                       config.prior("draft")))
        if "ngram" in wanted and has["ngram_tokens"]:
            cands.append(_scored_chain("ngram", got["ngram_tokens"][b], None, config.prior("ngram")))
        cfg = ArbiterConfig(int(budget[b]), config.keep, config.bonus, config.priors, config.default_prior)
        trees.append(arbitrate([c for c in cands if c], cfg, list(SUBPROPOSERS)).draft)
    N = max((len(t) for t in trees), default=0)
    out = {k: np.full((len(trees), N), -1, dtype=np.int64) for k in ("tree_tokens", "tree_parents", "tree_sources")}
    for b, t in enumerate(trees):
        out["tree_tokens"][b, :len(t)] = t.tokens
        out["tree_parents"][b, :len(t)] = t.parents
        out["tree_sources"][b, :len(t)] = [mask_of(s) for s in t.sources]
    return out


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
