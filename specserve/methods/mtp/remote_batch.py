"""What the stateless Triton models of remote `mtp` compute, in numpy: ngram_drafter (prompt lookup
per row) and mtp_arbiter (the drafters' outputs merged into one tree per row, by the fused
method's arbiter). Their processes import this and never torch: a Python-backend stub that
imports torch pays seconds of CPU and hundreds of MB at every load and reload.
The engine side of remote mtp is remote.py."""

from __future__ import annotations

import math

import numpy as np

from specserve.methods.calibration_cut import calibration_cut
from specserve.methods.mtp.arbiter import ArbiterConfig, Candidate, arbitrate
from specserve.methods.mtp.draft_rows import MIN_PROB
from specserve.methods.mtp.options import SUBPROPOSERS
from specserve.methods.ngram.lookup import MAX_N, MIN_N, NUM_DRAFT_TOKENS, lookup


def mask_of(names) -> int:
    return sum(1 << SUBPROPOSERS.index(n) for n in names)


def names_of(mask: int) -> tuple[str, ...]:
    return tuple(n for i, n in enumerate(SUBPROPOSERS) if mask >> i & 1)


# -- what the Triton models compute --------------------------------------------------------------------
def ngram_batch(context_tokens: np.ndarray, max_draft_len: np.ndarray) -> np.ndarray:
    """ngram_drafter: [B, L] tokens (-1 padded), [B] → [B, K] lookup drafts (-1 padded)."""
    # The fused method's n-gram settings (NgramProposer's defaults).
    rows = [lookup([int(t) for t in row if t >= 0], max_n=MAX_N, min_n=MIN_N, k=min(NUM_DRAFT_TOKENS, int(k)))
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
        lps = [math.log(max(float(scalars[j, 0]), MIN_PROB)) if scalars is not None else ArbiterConfig().prior("eagle")
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
