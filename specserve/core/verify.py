"""Lossless verification of a draft (chain or tree) against the target's logits.

Input rows are in forward order: row 0 is the pending token (the tree's root), row i+1 is draft
node i. Row r's logits predict the token that follows the path root → r.

- Greedy: walk from the root, at each node move to the child whose token is the target's argmax;
  emit the argmax where no child matches (recovered) or at a leaf (bonus). The output is exactly
  the target's greedy continuation.
- Sampling (multi-draft recursive rejection sampling): at a node with target distribution p, try
  its children in order; child c with token x drawn from q_c is accepted with probability
  min(1, p(x) / q_c(x)); on rejection p ← normalise(max(p − q_c, 0)) and the next child is tried
  against that residual; when no child is accepted, the recovered token is drawn from the final
  residual. Each child's token must have been drawn independently from its q_c, or be a
  deterministic choice (q_c = point mass). A chain is the one-child case: standard speculative
  sampling. The emitted sequence then has exactly the target's distribution.
- Seeded sampling (core/sampling.py): the target's token after each row is the coupled sample
  argmax(log p~ + g(seed, position)) with the noise of that row's predicted sequence index; the
  walk is then the greedy one with those tokens in place of the argmax (a node's children carry
  distinct tokens, so at most one can match). The emitted token at each position is a function
  of the seed and the prefix alone, whatever was drafted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.core.proposer import Draft
from specserve.core.sampling import SamplingParams, sample, seeded, seeded_tokens, target_probs


@dataclass
class Verdict:
    accepted_nodes: list[int]  # draft node indices along the accepted path, root → leaf
    emitted: list[int]         # accepted draft tokens, then the recovered or bonus token
    bonus: bool                # True when the path ended at a leaf (every drafted token on it accepted)

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


def _children(draft: Draft) -> list[list[int]]:
    """children[r] for forward rows r (0 = root, i+1 = draft node i), as draft node indices."""
    kids: list[list[int]] = [[] for _ in range(len(draft) + 1)]
    for i, p in enumerate(draft.parents):
        kids[p + 1].append(i)
    return kids


def verify_greedy(logits: torch.Tensor, draft: Draft) -> Verdict:
    """logits [N+1, V] in forward order."""
    return _follow(logits.argmax(-1).tolist(), draft)


def depths(draft: Draft) -> list[int]:
    """[N+1] per forward row: 0 for the root, the node's depth in the tree for draft node i."""
    out = [0]
    for p in draft.parents:
        out.append(out[p + 1] + 1)
    return out


def verify_seeded(logits: torch.Tensor, draft: Draft, params: SamplingParams, position: int) -> Verdict:
    """logits [N+1, V] in forward order; `position`: the sequence index the root row predicts
    (len(tokens) with the pending token included). Row r predicts position + depth(r)."""
    best = seeded_tokens(logits, params, [position + d for d in depths(draft)])  # [N+1]
    return _follow(best, draft)


def _follow(best: list[int], draft: Draft) -> Verdict:
    """Walk from the root along the children whose token is the target's token of their parent
    row (best [N+1]); emit that token where none matches (recovered) or at a leaf (bonus)."""
    kids = _children(draft)
    row, path = 0, []
    while True:
        want = best[row]
        nxt = next((c for c in kids[row] if draft.tokens[c] == want), None)
        if nxt is None:
            emitted = [draft.tokens[c] for c in path] + [want]
            return Verdict(path, emitted, bonus=not kids[row])
        path.append(nxt)
        row = nxt + 1


def sibling_residual(p: torch.Tensor, x: int, q: torch.Tensor | None) -> torch.Tensor:
    """The distribution the next sibling (or the recovered token) is checked against after a child
    with token x drawn from q was rejected: normalise(max(p − q, 0)); for a point mass, p with x
    removed. Skipping it breaks exactness (tests/test_mtp.py shows the distribution test fail)."""
    residual = p.clone()
    if q is None:
        residual[x] = 0.0
    else:
        residual = (residual - q).clamp_min(0.0)
    total = float(residual.sum())
    # A zero residual means rejection had probability 0; only rounding gets here.
    return residual / total if total > 0 else p


def verify_sampled(logits: torch.Tensor, draft: Draft, params: SamplingParams,
                   generator: torch.Generator) -> Verdict:
    """logits [N+1, V] in forward order; draft.probs [N, V] or None (point masses)."""
    probs = target_probs(logits, params)  # [N+1, V]
    kids = _children(draft)
    row, path = 0, []
    while True:
        p = probs[row]
        accepted = None
        for c in kids[row]:
            x = draft.tokens[c]
            q = None if draft.probs is None else draft.probs[c].float()
            qx = 1.0 if q is None else float(q[x])
            px = float(p[x])
            if qx > 0 and float(torch.rand((), generator=generator, device=generator.device)) * qx < px:
                accepted = c
                break
            p = sibling_residual(p, x, q)
        if accepted is None:
            emitted = [draft.tokens[c] for c in path] + [sample(p, generator)]
            return Verdict(path, emitted, bonus=not kids[row])
        path.append(accepted)
        row = accepted + 1


def verify(logits: torch.Tensor, draft: Draft, params: SamplingParams,
           generator: torch.Generator | None, position: int | None = None) -> Verdict:
    """`position`: the sequence index the root row predicts; needed for seeded requests."""
    if params.greedy:
        return verify_greedy(logits, draft)
    if seeded(params):
        assert position is not None, "seeded sampling needs the row's sequence position"
        return verify_seeded(logits, draft, params, position)
    assert generator is not None, "sampling needs the request's generator"
    return verify_sampled(logits, draft, params, generator)
