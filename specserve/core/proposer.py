"""The proposer interface every drafter implements, fused (in-process) or remote (Triton/BLS).

Terminology (docs/design.md, 'State and verification'; defined once here): a step DRAFTS k tokens; the target ACCEPTS a
prefix of them (a root-to-node path, for trees); on the first rejection it emits a RECOVERED
token, and if every drafted token on the path is accepted it emits a BONUS token. ACCEPTANCE
LENGTH = accepted + 1 (the recovered / bonus token counts), averaged over steps.

A draft is a tree hanging off the sequence's pending token (the last emitted token, whose KV the
target has not computed yet). A chain is the tree whose node i has parent i-1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

from specserve.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    # Annotations only: the Triton drafter adapters that build Drafts (mtp_arbiter) run without torch.
    import torch

    from specserve.core.kv_cache import KVCache
    from specserve.core.repetition import RepetitionGuard
    from specserve.core.static_step import StaticOutcome, StaticRow


class ProposerError(RuntimeError):
    """The proposer cannot draft this step (e.g. a remote drafter is unloaded or restarting).

    The engine then decodes the affected rows without a draft; it never fails the request.
    Any other exception from a proposer is a bug (the engine logs it with its traceback and
    decodes those rows plainly).
    """


class ProposerUnavailable(ProposerError):
    """The proposer skipped this step on purpose (backing off after failures, or an earlier call
    has not returned): expected while a drafter is down, so logged quietly."""


@dataclass
class Draft:
    tokens: list[int]                  # N drafted token ids
    parents: list[int]                 # N; parents[i] < i, or -1 = child of the pending token
    # [N, V] the distribution each token was drawn from, for lossless sampling; None when the
    # tokens were chosen deterministically (n-gram, argmax): then q is a point mass.
    probs: torch.Tensor | None = None
    # Optional, for arbiters (proposers/arbiter.py), never used by verification: N log-probs the
    # drafter gave its own tokens (its confidence; a greedy drafter's probs is None), and per node
    # the names of the proposers whose candidate passes through it (the engine credits accepted
    # tokens to them in SpecStats.accepted_by_proposer).
    logprobs: list[float] | None = None
    sources: list[tuple[str, ...]] | None = None
    # Sub-proposers (or proposal models) that failed this step and were left out of the draft
    # (a multi-draft proposer's partial failure; the engine counts them per request).
    skipped: tuple[str, ...] = ()

    @classmethod
    def chain(cls, tokens: list[int], probs: torch.Tensor | None = None,
              logprobs: list[float] | None = None) -> "Draft":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), probs, logprobs)

    @classmethod
    def empty(cls) -> "Draft":
        return cls([], [])

    def __len__(self) -> int:
        return len(self.tokens)

    def check(self) -> None:
        if len(self.parents) != len(self.tokens):
            raise ValueError("draft tokens and parents differ in length")
        if any(not -1 <= p < i for i, p in enumerate(self.parents)):
            raise ValueError(f"draft parents must satisfy -1 <= parents[i] < i: {self.parents}")
        if self.probs is not None and self.probs.shape[0] != len(self.tokens):
            raise ValueError("draft probs must have one row per drafted token")
        for name in ("logprobs", "sources"):
            if getattr(self, name) is not None and len(getattr(self, name)) != len(self.tokens):
                raise ValueError(f"draft {name} must have one entry per drafted token")


@dataclass
class DraftRequest:
    seq_id: int
    token_ids: list[int]          # the whole sequence so far: prompt + emitted (last = pending)
    max_draft_len: int            # upper bound on N for this step
    params: SamplingParams        # the request's sampling (greedy: temperature == 0)
    # The request's generator, for drafters that sample (then they must return probs);
    # None for greedy and for seeded requests.
    generator: torch.Generator | None = None
    # Target features (final hidden states, [n, D]) of the tokens committed since the previous
    # request for this sequence; only filled for proposers with `needs_features`. A proposer with
    # a `feature_layers` attribute (target layer indices, e.g. DFlash) gets the final hidden
    # state followed by the residual stream after each of those layers: [n, (1 + L) D].
    # max_draft_len may be 0: a call that only hands over features (e.g. DFlash while its
    # repetition guard has the row drafting with another method).
    features: torch.Tensor | None = None
    # The request's calibration stop threshold; None → the proposer's own default. Proposers
    # without a calibration head ignore it.
    threshold: float | None = None
    # The request's method-specific options (e.g. mtp's proposer set and tree budget), already
    # checked by the proposer's `check_options`; None → the proposer's defaults.
    options: dict | None = None
    # A seeded sampled request's seed (core/sampling.py, seeded sampling), else None. A drafter
    # that can proposes draft token j as argmax(log q~ + g(seed, len(token_ids) + j)), with q~
    # its distribution warped by params (sampling.seeded_tokens); one that ignores the seed
    # drafts greedily (generator is None), which is still exact, only accepted less often.
    seed: int | None = None


@dataclass(frozen=True)
class SequenceState:
    """The most drafter state one sequence holds (its slot of the proposer's caches and buffers),
    counted from the tensors the proposer allocated; the drafter's weights, which every sequence
    shares, are not in it. `how` says what was counted (benchmarks print it)."""
    bytes: int
    how: str


@dataclass
class StepOutcome:
    """What the engine tells a proposer after verifying its draft (for per-sequence drafter state)."""
    seq_id: int
    num_drafted: int
    accepted_nodes: list[int] = field(default_factory=list)  # indices into the draft, root→leaf
    emitted: list[int] = field(default_factory=list)         # accepted tokens + recovered/bonus


class Capabilities(Protocol):
    """What the engine asks of every proposer, dynamic or static step. The engine dispatches on
    these declared attributes only (ProposerDefaults gives each its neutral value)."""

    name: str
    # The proposer reads target features (DraftRequest.features).
    needs_features: bool
    # Target layer indices whose residual streams it reads besides the final hidden state (DFlash);
    # () for none. Every target forward keeps the union over the served proposers.
    feature_layers: tuple[int, ...]
    # Steps a row aside to a fallback method while its output repeats (DFlash); None: never.
    repetition_guard: "RepetitionGuard | None"
    # Per-request option keys (DraftRequest.options) it takes; the engine refuses keys the
    # request's method does not name and calls check_options when a request arrives (Engine.check).
    option_keys: tuple[str, ...]
    # The proposer runs the whole step (draft, verify, commit) itself: a StaticStepProposer.
    static_step: bool

    @property
    def available(self) -> bool:
        """False while the proposer cannot draft (a remote drafter backing off): a request with a
        fallback method starts on that instead (Engine._admit)."""
        ...

    def check_options(self, options: dict) -> None:
        """Raise ValueError with a message for the client for options this proposer refuses."""
        ...

    def observe(self, outcomes: list[StepOutcome]) -> None:
        """Verification results of the last step (drafter state may roll back from them)."""
        ...

    def release(self, seq_id: int) -> None:
        """The sequence ended; drop any state kept for it."""
        ...

    def sequence_state(self, max_model_len: int) -> SequenceState:
        """The drafter state one sequence of max_model_len tokens holds at most."""
        ...


@runtime_checkable
class Proposer(Capabilities, Protocol):
    """A dynamic-step proposer: the engine asks it for drafts and verifies them itself."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One draft per request, in order. Must not raise for a sequence it has not seen."""
        ...


@runtime_checkable
class StaticStepProposer(Capabilities, Protocol):
    """A proposer whose rows run the whole speculative step as one static computation (DSPark):
    drafting, verification, acceptance and the KV commit (Engine._decode_static). It has no
    propose(); static_step is True."""

    def bind(self, cache: "KVCache", scratch_slot: int) -> None:
        """Attach the engine's target KV pool, whose `scratch_slot` no sequence owns."""
        ...

    def warm(self) -> None:
        """Capture the step's graphs now (on a GPU), not on a request's path."""
        ...

    def step(self, rows: "list[StaticRow]") -> "list[StaticOutcome]":
        """One step for these rows: what each emitted and its new committed length."""
        ...


AnyProposer = Proposer | StaticStepProposer


class ProposerDefaults:
    """The neutral value of every capability; proposers inherit it and override what they have."""

    needs_features: bool = False
    feature_layers: tuple[int, ...] = ()
    repetition_guard: "RepetitionGuard | None" = None
    option_keys: tuple[str, ...] = ()
    static_step: bool = False
    available: bool = True

    def check_options(self, options: dict) -> None:
        pass   # the engine already refused keys outside option_keys

    def observe(self, outcomes: list[StepOutcome]) -> None:
        pass

    def release(self, seq_id: int) -> None:
        pass

    def sequence_state(self, max_model_len: int) -> SequenceState:
        # No neutral value: a proposer that keeps state and says 0 would be a wrong figure.
        raise NotImplementedError(f"proposer {self.name!r} does not report its per-sequence state")


@dataclass(frozen=True)
class RemoteCalls:
    """The calls remote proposers make to their Triton models, handed to the engine's builder by
    the Triton adapter (specserve.triton.bls.remote_calls): the layers below never import Triton.
    A call takes a dict of named numpy arrays and returns one; a release takes sequence ids."""

    eagle_proposal: Callable[[dict], dict]
    eagle_release: Callable[[list[int]], Any]
    # served mtp members (in the mtp spec's order) → the mtp_proposal call / its release
    mtp_proposal: Callable[[list[str]], Callable[[dict], dict]]
    mtp_release: Callable[[list[str]], Callable[[list[int]], Any]]
