"""`mtp`: several proposers draft at once, the arbiter merges their drafts into one tree, the target
verifies the tree in one forward (docs/design.md, 'The methods': MTP). Fused placement:
every sub-proposer runs in the engine process; remote_mtp.py is the remote placement.

Per step and row:
  1. each configured sub-proposer in the row's set drafts (greedily: the merged tree is point
     masses, so the sub-drafts' distributions are not needed for exact sampling); one that raises
     is left out for this step and counted (Draft.skipped → SpecStats.proposer_skipped), the
     others go on;
  2. each sub-draft's root-to-leaf paths become arbiter candidates, with the log-probs the
     drafter gave its tokens (Draft.logprobs, or log q from Draft.probs; else the configured prior);
  3. the arbiter (arbiter.py) merges the best few into one tree of ≤ the row's budget nodes.

observe() translates the engine's outcome on the merged tree into each sub-proposer's own: the
prefix of ITS draft that lies on the accepted path, so a stateful drafter rolls back correctly.

Features: sub-proposers that need target features get them; if one fails, the features it was
given are kept here and sent with its next call (the engine already counts them delivered).
A member that reads target layers besides the final hidden state (an EAGLE-3 drafter's
`feature_layers`) gets them: mtp names the union of its members' layers, so the engine hands it
[n, (1 + L) D] per token (the final hidden state, then those layers in ascending order), and each
member receives its own columns (`member_features`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from specserve.methods.mtp.arbiter import ArbiterConfig, Candidate, arbitrate
from specserve.methods.mtp.draft_rows import MIN_PROB
from specserve.methods.mtp.options import PROPOSERS as PROPOSERS_OPTION, SUBPROPOSERS, TREE_BUDGET
from specserve.core.proposer import Draft, DraftRequest, Proposer, ProposerDefaults, ProposerError, SequenceState, StepOutcome

log = logging.getLogger("specserve.mtp")

# Per-request options (sampling_parameters keys, through DraftRequest.options).
OPT_PROPOSERS, OPT_BUDGET = PROPOSERS_OPTION.key, TREE_BUDGET.key
DEFAULT_DEPTH = 8   # tokens drafted per sub-proposer per step, at most


def check_options(options: dict, served: tuple[str, ...], max_draft_len: int) -> None:
    """Per-request options (types already checked by triton/params.py); ValueError for the client."""
    names = options.get(OPT_PROPOSERS)
    if names is not None:
        if not names:
            raise ValueError(f"{OPT_PROPOSERS} must name at least one proposer")
        for n in names:
            if n not in SUBPROPOSERS:
                raise ValueError(f"{OPT_PROPOSERS}: unknown proposer {n!r}; known: {', '.join(SUBPROPOSERS)}")
            if n not in served:
                raise ValueError(f"{OPT_PROPOSERS}: proposer {n!r} is not served here; served: {', '.join(served)}")
    budget = options.get(OPT_BUDGET)
    if budget is not None and not 1 <= budget <= max_draft_len:
        raise ValueError(f"{OPT_BUDGET} must be an integer in [1, {max_draft_len}] (the server's "
                         f"max_draft_len), got {budget}")


@dataclass
class _Row:
    """What the last step drafted for one sequence: per sub-proposer its draft and where each of
    its nodes landed in the merged tree (None: cut by the budget)."""
    subs: dict[str, tuple[Draft, list[int | None]]] = field(default_factory=dict)


def candidates_of(name: str, draft: Draft, prior: float) -> list[Candidate]:
    """Root-to-leaf paths of a sub-draft, each with its per-token log-probs."""
    if draft.logprobs is not None:
        lps = [min(0.0, float(lp)) for lp in draft.logprobs]
    elif draft.probs is not None:
        q = draft.probs[torch.arange(len(draft)), torch.tensor(draft.tokens)].float().clamp_min(MIN_PROB)
        lps = q.log().tolist()
    else:
        lps = [prior] * len(draft)
    leaves = set(range(len(draft))) - set(draft.parents)
    out = []
    for leaf in sorted(leaves):
        path, n = [], leaf
        while n != -1:
            path.append(n)
            n = draft.parents[n]
        path.reverse()
        out.append(Candidate(name, tuple(draft.tokens[i] for i in path), tuple(lps[i] for i in path)))
    return out


def member_features(features: torch.Tensor, layers: tuple[int, ...], wanted: tuple[int, ...]) -> torch.Tensor:
    """features [n, (1 + L) D]: the final hidden state, then the residual streams after `layers`
    → [n, (1 + L') D]: the final hidden state, then those after `wanted` (a subset, its order).
    Example: layers (0, 1, 3), wanted (3,) → columns [0:D] and [3D:4D]."""
    if wanted == layers:
        return features
    n = features.shape[0]
    blocks = features.view(n, 1 + len(layers), -1)  # [n, 1 + L, D]
    cols = [0] + [1 + layers.index(i) for i in wanted]
    return blocks[:, cols].reshape(n, -1)


def map_nodes(draft: Draft, merged: Draft) -> list[int | None]:
    """Sub-draft node → merged-tree node with the same root path (None: not in the merged tree)."""
    index = {}
    for m, (t, p) in enumerate(zip(merged.tokens, merged.parents)):
        index[(p, t)] = m
    out: list[int | None] = []
    for t, p in zip(draft.tokens, draft.parents):
        parent = -1 if p == -1 else out[p]
        out.append(None if parent is None else index.get((parent, t)))
    return out


def sub_outcome(seq_id: int, draft: Draft, where: list[int | None], outcome: StepOutcome) -> StepOutcome:
    """The sub-proposer's view of a step: its nodes on the accepted merged path, root first."""
    accepted, parent = [], -1
    for m in outcome.accepted_nodes:
        nxt = next((j for j, (p, w) in enumerate(zip(draft.parents, where)) if p == parent and w == m), None)
        if nxt is None:
            break
        accepted.append(nxt)
        parent = nxt
    return StepOutcome(seq_id, len(draft), accepted, list(outcome.emitted))


class MultiDraftProposer(ProposerDefaults):
    name = "mtp"

    def __init__(self, proposers: Sequence[Proposer], *, max_draft_len: int, arbiter: ArbiterConfig | None = None,
                 depth: int = DEFAULT_DEPTH, vocab_size: int | None = None):
        """proposers: the served sub-proposers, by their `name` (a subset of SUBPROPOSERS);
        max_draft_len: the engine's (tree budgets above it are refused per request)."""
        names = [p.name for p in proposers]
        unknown = [n for n in names if n not in SUBPROPOSERS]
        if unknown or len(set(names)) != len(names) or not names:
            raise ValueError(f"mtp needs distinct sub-proposers from {', '.join(SUBPROPOSERS)}; got {names}")
        self.subs = {p.name: p for p in sorted(proposers, key=lambda p: SUBPROPOSERS.index(p.name))}
        self.arbiter = arbiter or ArbiterConfig()
        self.max_draft_len, self.depth, self.vocab_size = max_draft_len, depth, vocab_size
        self.needs_features = any(p.needs_features for p in proposers)
        # The union of the layers members read: the engine keeps them all, each member gets its own.
        self.feature_layers = tuple(sorted({i for p in proposers for i in p.feature_layers}))
        self._rows: dict[int, _Row] = {}
        self._backlog: dict[tuple[str, int], list[torch.Tensor]] = {}   # undelivered features

    @property
    def available(self) -> bool:
        return any(p.available for p in self.subs.values())

    def sequence_state(self, max_model_len: int) -> SequenceState:
        parts = {name: sub.sequence_state(max_model_len) for name, sub in self.subs.items()}
        return SequenceState(sum(p.bytes for p in parts.values()),
                             "sum of its drafters': " + ", ".join(f"{n} {p.bytes}" for n, p in parts.items()))

    # -- per-request options ------------------------------------------------------------------
    option_keys = (OPT_PROPOSERS, OPT_BUDGET)

    def check_options(self, options: dict) -> None:
        check_options(options, tuple(self.subs), self.max_draft_len)

    def _settings(self, r: DraftRequest) -> tuple[list[str], int]:
        opts = r.options or {}
        names = opts.get(OPT_PROPOSERS) or list(self.subs)
        budget = min(opts.get(OPT_BUDGET) or self.arbiter.budget, r.max_draft_len)
        return [n for n in self.subs if n in names], budget

    # -- drafting -------------------------------------------------------------------------------
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        settings = [self._settings(r) for r in requests]
        sub_drafts: list[dict[str, Draft]] = [{} for _ in requests]
        skipped: list[list[str]] = [[] for _ in requests]
        for name, sub in self.subs.items():
            rows = [i for i, (names, _) in enumerate(settings) if name in names]
            if not rows:
                continue
            reqs = [self._sub_request(sub, requests[i]) for i in rows]
            try:
                got = sub.propose(reqs)
                if len(got) != len(rows):
                    raise ProposerError(f"returned {len(got)} drafts for {len(rows)} requests")
            except Exception as e:  # noqa: BLE001 — one drafter's failure costs only its candidates
                if isinstance(e, ProposerError):
                    log.debug("mtp: %s left out this step (%s)", name, e)
                else:
                    log.exception("mtp: %s raised; left out this step", name)
                for i in rows:
                    skipped[i].append(name)
                continue
            for i, d in zip(rows, got):
                self._backlog.pop((name, requests[i].seq_id), None)   # delivered
                if self._bad(d):
                    skipped[i].append(name)
                else:
                    sub_drafts[i][name] = d
        drafts = []
        for r, (names, budget), subs, skip in zip(requests, settings, sub_drafts, skipped):
            cands = [c for n, d in subs.items() for c in candidates_of(n, d, self.arbiter.prior(n))]
            merged = arbitrate(cands, _with_budget(self.arbiter, budget), list(self.subs)).draft
            merged.skipped = tuple(skip)
            self._rows[r.seq_id] = _Row({n: (d, map_nodes(d, merged)) for n, d in subs.items()})
            drafts.append(merged)
        return drafts

    def _sub_request(self, sub: Proposer, r: DraftRequest) -> DraftRequest:
        features = None
        if sub.needs_features:
            chunks = self._backlog.setdefault((sub.name, r.seq_id), [])
            if r.features is not None and r.features.shape[0]:
                chunks.append(r.features)
            features = None if not chunks else chunks[0] if len(chunks) == 1 else torch.cat(chunks)
            if features is not None:
                features = member_features(features, self.feature_layers, sub.feature_layers)
        # generator=None: sub-proposers draft greedily, or with the seeded request's noise (the
        # merged tree is point masses either way).
        return DraftRequest(r.seq_id, r.token_ids, min(r.max_draft_len, self.depth), r.params, None,
                            features, r.threshold, seed=r.seed)

    def _bad(self, d: Draft) -> bool:
        try:
            d.check()
        except ValueError:
            return True
        return self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in d.tokens)

    # -- after verification ---------------------------------------------------------------------
    def observe(self, outcomes: list[StepOutcome]) -> None:
        per_sub: dict[str, list[StepOutcome]] = {}
        for o in outcomes:
            row = self._rows.pop(o.seq_id, None)
            if row is None:
                continue
            for name, (draft, where) in row.subs.items():
                per_sub.setdefault(name, []).append(sub_outcome(o.seq_id, draft, where, o))
        for name, outs in per_sub.items():
            self.subs[name].observe(outs)

    def release(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)
        for name, sub in self.subs.items():
            self._backlog.pop((name, seq_id), None)
            sub.release(seq_id)


def _with_budget(config: ArbiterConfig, budget: int) -> ArbiterConfig:
    return config if budget == config.budget else replace(config, budget=budget)
