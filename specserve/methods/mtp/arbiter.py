"""The MTP arbiter: merge several proposers' candidate drafts into one prefix tree of ≤ N nodes.

Pure and deterministic (no torch): the fused `mtp` method (proposer.py) and the remote
`mtp_arbiter` Triton model run this same function.

Scoring, per candidate c (a chain of tokens t_0..t_{k-1} from proposer P with the log-probs
l_0..l_{k-1} P gave them; a deterministic proposer such as n-gram gives each token a configured
prior log-prob instead):

    term_d   = min(0, l_d + bonus × (n_d − 1))     n_d = distinct proposers (among ALL candidates)
                                                     whose candidate starts with t_0..t_d
    score(c) = Σ_d term_d                            own confidence + agreement, as a log-prob

Each term is capped at 0 so a score stays a (heuristic) log-probability that the prefix is right,
and so it never grows with depth. The best `keep` candidates (score desc; ties: proposer order,
then candidate order) are merged into a prefix tree (shared prefixes become one node). A node's
value is the best partial score (through its depth) of a kept candidate passing through it:
never more than its parent's, and a child is deeper, so "the N best nodes by (value desc, depth
asc, insertion order)" is closed under parents — the cut never orphans a node.

Worked example (bonus 1, prior for ngram −1): eagle [5 6 7] with log-probs [−0.1 −0.2 −2.0],
ngram [5 6 9]. Prefix [5] and [5 6] have n = 2, the rest n = 1. eagle: min(0, −0.1+1) +
min(0, −0.2+1) + (−2.0) = −2.0; ngram: 0 + 0 + (−1) = −1. Tree: 5 → 6 → {9 (ngram, −1),
7 (eagle, −2)}; node values 0, 0, −1, −2; with N = 3 the node 7 is cut.

Output tokens are point masses (Draft.probs is None): verification's multi-draft recursive
rejection removes a rejected sibling's token from the residual, which keeps sampling exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from specserve.core.proposer import Draft

DEFAULT_BUDGET = 16
DEFAULT_KEEP = 6
DEFAULT_BONUS = 1.0
DEFAULT_PRIOR = -1.0


@dataclass(frozen=True)
class Candidate:
    proposer: str
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]   # one per token, ≤ 0

    def __post_init__(self):
        if len(self.tokens) != len(self.logprobs):
            raise ValueError(f"candidate from {self.proposer}: {len(self.tokens)} tokens, "
                             f"{len(self.logprobs)} log-probs")


@dataclass(frozen=True)
class ArbiterConfig:
    budget: int = DEFAULT_BUDGET      # tree nodes at most
    keep: int = DEFAULT_KEEP          # candidates merged at most
    bonus: float = DEFAULT_BONUS      # log-prob credit per other proposer sharing a prefix
    # Per-token log-prob of proposers whose drafts carry no confidence (point masses: n-gram).
    priors: Mapping[str, float] = field(default_factory=lambda: {"ngram": DEFAULT_PRIOR})
    default_prior: float = DEFAULT_PRIOR

    def __post_init__(self):
        if self.budget < 0 or self.keep < 1 or self.bonus < 0:
            raise ValueError(f"arbiter needs budget >= 0, keep >= 1, bonus >= 0; got {self.budget}, "
                             f"{self.keep}, {self.bonus}")

    def prior(self, proposer: str) -> float:
        return self.priors.get(proposer, self.default_prior)


@dataclass
class ArbiterResult:
    draft: Draft                        # the merged tree, point masses; draft.sources filled
    values: list[float]                 # per node: its value (see the module docstring)
    kept: list[Candidate]               # the merged candidates, best first
    scores: list[float]                 # their scores


def _support(candidates: list[Candidate]) -> dict[tuple[int, ...], set[str]]:
    """prefix → the proposers whose candidate starts with it."""
    support: dict[tuple[int, ...], set[str]] = {}
    for c in candidates:
        for d in range(len(c.tokens)):
            support.setdefault(c.tokens[:d + 1], set()).add(c.proposer)
    return support


def _terms(c: Candidate, support: dict[tuple[int, ...], set[str]], bonus: float) -> list[float]:
    return [min(0.0, lp + bonus * (len(support[c.tokens[:d + 1]]) - 1)) for d, lp in enumerate(c.logprobs)]


def score_candidates(candidates: list[Candidate], bonus: float) -> list[float]:
    support = _support(candidates)
    return [sum(_terms(c, support, bonus)) for c in candidates]


def arbitrate(candidates: list[Candidate], config: ArbiterConfig, order: list[str] | None = None) -> ArbiterResult:
    """Merge `candidates` into one tree. `order`: the proposers' configured order (tie-breaks);
    by default the order in which they first appear."""
    candidates = [c for c in candidates if c.tokens]
    order = order or list(dict.fromkeys(c.proposer for c in candidates))
    rank = {p: i for i, p in enumerate(order)}
    support = _support(candidates)
    terms = [_terms(c, support, config.bonus) for c in candidates]
    scores = [sum(t) for t in terms]
    best = sorted(range(len(candidates)),
                  key=lambda i: (-scores[i], rank.get(candidates[i].proposer, len(rank)), i))[:config.keep]

    # Prefix trie of the kept candidates, nodes in insertion order (parents before children).
    index: dict[tuple[int, ...], int] = {}
    prefixes: list[tuple[int, ...]] = []
    parents, depths, values = [], [], []
    for i in best:
        c, partial = candidates[i], 0.0
        for d in range(len(c.tokens)):
            prefix = c.tokens[:d + 1]
            partial += terms[i][d]
            node = index.get(prefix)
            if node is None:
                node = index[prefix] = len(prefixes)
                prefixes.append(prefix)
                parents.append(-1 if d == 0 else index[c.tokens[:d]])
                depths.append(d)
                values.append(partial)
            else:
                values[node] = max(values[node], partial)
    chosen = sorted(range(len(prefixes)), key=lambda n: (-values[n], depths[n], n))[:config.budget]
    chosen.sort()   # back to insertion order: parents precede children
    new = {old: i for i, old in enumerate(chosen)}
    assert all(parents[n] == -1 or parents[n] in new for n in chosen), "the cut orphaned a node"
    draft = Draft([prefixes[n][-1] for n in chosen], [-1 if parents[n] == -1 else new[parents[n]] for n in chosen],
                  None, sources=[tuple(sorted(support[prefixes[n]])) for n in chosen])
    return ArbiterResult(draft, [values[n] for n in chosen], [candidates[i] for i in best], [scores[i] for i in best])
