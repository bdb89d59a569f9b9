"""The engine: continuous batching around one target model, with speculative decoding.

Each `step()`:
  1. admits queued requests while KV slots are free (by tier priority, aged by steps waited:
     specserve/core/scheduling.py) and prefills them in one forward; each emits its first token;
  2. asks every running sequence's proposer for a draft (one call per proposer for its rows);
  3. verifies all rows in ONE target forward — rows may differ in draft size (chain or tree) and
     in context length; the mask and positions say which is which;
  4. commits each row's accepted path in the KV cache (rollback = moving the length back),
     emits the accepted tokens plus the recovered / bonus token, applies stop conditions;
  5. frees the slots of finished sequences.

Requests join between steps; `cancel` frees a slot at once. The engine is single-threaded: the
Triton adapter drives it from one background thread (`specserve.core.engine_loop`).

Isolation: whatever goes wrong with one row (an invalid distribution, a sampler error, a drafter
that returns garbage for it) ends that request alone, with finish reason "error" and a message;
the other rows of the batch carry on. A proposer that fails costs its rows one step of drafting,
never their drafter features.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from specserve.core.config import EngineConfig
from specserve.core.scheduling import MAX_PRIORITY, PriorityAging
from specserve.core.draft_policy import POLICIES, CostTable, DraftPolicy, grid, profile
from specserve.core.kv_cache import KVCache
from specserve.core.forward import ForwardBatch, ForwardOutput, TargetModel
from specserve.core.masks import build_mask
from specserve.core.proposer import (AnyProposer, Draft, DraftRequest, Proposer, ProposerError, ProposerUnavailable,
                                      StaticStepProposer, StepOutcome)
from specserve.core.sampling import SamplingParams, make_generator, sample, seeded, seeded_tokens, target_probs
from specserve.core.verify import Verdict, verify

log = logging.getLogger("specserve.core.engine")

FINISH_LENGTH, FINISH_STOP, FINISH_ABORT, FINISH_ERROR = "length", "stop", "abort", "error"


class RequestRejected(ValueError):
    """A request the engine will not run; the message is meant for the client."""


class ServerBusy(RequestRejected):
    """The admission queue is full; the client may retry later (or elsewhere)."""


@dataclass
class SpecStats:
    method: str
    steps: int = 0                  # decode steps (each emits accepted + 1 tokens)
    drafts: int = 0                 # steps in which at least one token was drafted
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    proposer_errors: int = 0        # steps whose draft failed (decoded plainly instead)
    # Wall time of the decode steps this request took part in, split into the proposer call
    # (drafting; for a remote drafter this includes the BLS round trip) and the verify forward
    # with acceptance. In a batched step every row is charged the whole step: exact at
    # concurrency 1, an upper bound per request otherwise.
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    # Repetition guard (specserve/core/repetition.py): steps drafted by the fallback method because the
    # recent output was a repeated pattern, and how many times the guard switched on.
    guard_steps: int = 0
    guard_activations: int = 0
    # Multi-draft methods (mtp): accepted tokens credited to each proposer whose candidate lies on
    # the accepted path (a token several proposers drafted credits each), and steps in which a
    # sub-proposer failed and was left out (Draft.sources / Draft.skipped).
    accepted_by_proposer: dict[str, int] = field(default_factory=dict)
    proposer_skipped: dict[str, int] = field(default_factory=dict)
    # The adaptive draft policy (draft_policy.py) on this request's steps: steps it drafted this
    # row shorter than its own cap, of which steps with no draft at all (k = 0), steps drafted
    # while off to keep measuring (probes), and its last decision: the cap, the expected speed of
    # drafting relative to plain, and the proposer's draft cost relative to its first calls.
    policy_capped_steps: int = 0
    policy_off_steps: int = 0
    policy_probe_steps: int = 0
    policy_last: dict = field(default_factory=dict)

    @property
    def mean_acceptance_length(self) -> float:
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0

    def record_sources(self, draft: Draft, accepted_nodes: list[int]) -> None:
        for name in draft.skipped:
            self.proposer_skipped[name] = self.proposer_skipped.get(name, 0) + 1
        if draft.sources is not None:
            for node in accepted_nodes:
                for name in draft.sources[node]:
                    self.accepted_by_proposer[name] = self.accepted_by_proposer.get(name, 0) + 1

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.steps += 1
        if num_drafted:
            self.drafts += 1
            self.draft_tokens += num_drafted
        self.accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_accepted:
            self.accepted_per_position += [0] * (num_accepted - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def to_dict(self) -> dict:
        # Per-position rates are unconditional: accepted at position i / steps that drafted.
        rates = [n / self.drafts for n in self.accepted_per_position] if self.drafts else []
        return {"method": self.method, "steps": self.steps, "drafts": self.drafts,
                "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "acceptance_rate_per_position": [round(r, 4) for r in rates],
                "proposer_errors": self.proposer_errors,
                "guard_steps": self.guard_steps, "guard_activations": self.guard_activations,
                "draft_seconds": round(self.draft_seconds, 6), "verify_seconds": round(self.verify_seconds, 6),
                "accepted_by_proposer": dict(self.accepted_by_proposer),
                "proposer_skipped": dict(self.proposer_skipped),
                "policy": {"capped_steps": self.policy_capped_steps, "off_steps": self.policy_off_steps,
                           "probe_steps": self.policy_probe_steps, "last": dict(self.policy_last)}}


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    method: str | None = None  # None → the engine's default method
    # Per-request draft policy (a tier's defaults arrive this way too). None → the engine's and
    # proposer's defaults. num_draft_tokens caps the tokens drafted per step (≤ max_draft_len);
    # spec_threshold is the calibration head's stop threshold (0 = always draft the full length).
    num_draft_tokens: int | None = None
    spec_threshold: float | None = None
    draft_policy: str | None = None   # "adaptive" | "fixed"; None → the engine's
    # Scheduling priority from the request's tier (0..MAX_PRIORITY, higher first; admission.py).
    priority: int = 0
    # The tier's fallback: the method the request starts on instead when, at admission, its own
    # method's proposer says it is unavailable (a remote drafter backing off after failures).
    # Decided once, before prefill, so no sequence ever changes proposer mid-stream.
    # It is also the method a DFlash row drafts with while the repetition guard is on (the
    # request's spec_fallback, else its tier's fallback; None → EngineConfig.guard_fallback).
    fallback_method: str | None = None
    # Method-specific options (e.g. mtp's proposer set and tree budget), checked by the method's
    # proposer (its check_options) and handed to it with every draft request.
    options: dict | None = None


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]       # tokens emitted since the previous output for this request
    finished: bool
    finish_reason: str | None      # "length" | "stop" | "abort" | "error" (EOS and stop strings are "stop")
    num_prompt_tokens: int
    num_output_tokens: int         # all emitted so far
    stats: SpecStats
    # Why the engine ended the request early ("error", or "abort" that the client did not ask for).
    error: str | None = None


@dataclass
class _Sequence:
    seq_id: int
    req: GenerationRequest
    proposer: AnyProposer
    generator: torch.Generator | None   # unseeded sampled requests only (seeded ones use `seed`)
    stats: SpecStats
    tokens: list[int]              # prompt + emitted; the last one is pending (no KV yet)
    num_prompt: int
    slot: int = -1
    new_tokens: list[int] = field(default_factory=list)  # emitted this step
    finish_reason: str | None = None
    error: str | None = None
    # Per proposer name: [n_i, F] chunks of the target features committed since that proposer
    # last took them (kept across steps without a call — a failed call, or no room to draft — so
    # nothing is lost). F = D, or more for a proposer with feature_layers.
    feature_chunks: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    # The repetition guard's fallback proposer (rows of a proposer with a guard), and whether the
    # guard has stepped this row aside to it now.
    fallback: Proposer | None = None   # never a static-step proposer (Engine.check)
    guarded: bool = False
    step_cap: int | None = None       # this step's draft cap from the adaptive policy
    step_room: int = 0                # this step's cap as the proposer saw it (policy statistics)
    draft_failed: bool = False        # this step's draft failed (it says nothing about acceptance)
    enqueued_step: int = 0            # the engine's step count when it was queued (admission aging)

    @property
    def priority(self) -> int:
        return self.req.priority

    @property
    def seed(self) -> int | None:
        """The seed of a seeded sampled request: its tokens come from per-position noise."""
        return self.req.params.seed if seeded(self.req.params) else None

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def drafting(self) -> Proposer:
        """The proposer that drafts this row's next step."""
        return self.fallback if self.guarded else self.proposer

    def feature_users(self) -> list[Proposer]:
        """Proposers that must see every committed token's features (the fallback too, so it
        can take over at any step)."""
        return [p for p in (self.proposer, self.fallback) if p is not None and p.needs_features]


class Engine:
    def __init__(self, model: TargetModel, config: EngineConfig,
                 proposers: Mapping[str, AnyProposer] | None = None, *,
                 eos_token_ids: tuple[int, ...] | None = None,
                 detokenize: Callable[[list[int]], str] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        """`clock`: seconds for the timings the draft policy learns from and spec_stats report
        (tests inject one that the work advances, so nothing depends on the machine's load)."""
        from specserve.core.plain import NoProposer

        self.model, self.cfg = model, config
        limit = model.cfg.max_position_embeddings
        if config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                             f"max_position_embeddings={limit}")
        self.proposers: dict[str, AnyProposer] = {"none": NoProposer(), **(proposers or {})}
        if config.default_method not in self.proposers:
            raise ValueError(f"default method {config.default_method!r} has no proposer")
        self.eos = set(model.cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.detokenize = detokenize
        # Headroom past max_model_len: a verify forward writes up to 1 + max_draft_len entries
        # (padding included) after a row's committed length.
        # Static-step methods (DSPark) pad their batch bucket with rows that write to a scratch KV
        # slot no sequence owns: one more slot in the pool, reserved here.
        static: list[StaticStepProposer] = [p for p in self.proposers.values() if p.static_step]
        self.cache: KVCache = model.new_cache(config.max_num_seqs + bool(static),
                                              config.max_model_len + config.max_draft_len + 1)
        self._scratch_slots = int(bool(static))
        # Target layers whose residual streams some proposer reads (DFlash): every forward keeps them.
        self._feature_layers = tuple(sorted({i for p in self.proposers.values()
                                             for i in p.feature_layers}))
        if any(p.repetition_guard for p in self.proposers.values()) \
                and config.guard_fallback not in self.proposers:
            raise ValueError(f"guard_fallback {config.guard_fallback!r} has no proposer")
        if static:
            scratch = self.cache.allocate()
            for p in static:
                p.bind(self.cache, scratch)
        self._waiting: deque[_Sequence] = deque()   # arrival order; admission.py picks from it
        self._admission = PriorityAging(config.priority_aging_steps)
        self._steps = 0   # step() calls so far: the admission policy's clock
        self._running: list[_Sequence] = []
        self._by_id: dict[str, _Sequence] = {}
        self._aborted: list[RequestOutput] = []
        self._ids = itertools.count()
        if config.draft_policy not in POLICIES:
            raise ValueError(f"draft_policy must be one of {', '.join(POLICIES)}, got {config.draft_policy!r}")
        self._clock = clock
        self.policy: DraftPolicy | None = None     # the adaptive policy, once a row uses it
        if config.draft_policy == "adaptive":
            self._start_policy()
        self.last_policy_k: int | None = None      # the adaptive policy's last choice (metrics)

    # -- the adaptive draft policy ---------------------------------------------------------------
    def _start_policy(self) -> None:
        """Profile this engine's verify forward on free KV slots and start the policy on it."""
        self.cost_table = profile(self._profile_verify, *grid(self.cfg.max_num_seqs, self.cfg.max_draft_len),
                                  clock=self._clock)
        log.info("adaptive draft policy: verify cost table (ms) %s", self.cost_table.to_dict())

    @property
    def cost_table(self) -> CostTable | None:
        return None if self.policy is None else self.policy.table

    @cost_table.setter
    def cost_table(self, table: CostTable) -> None:
        self.policy = DraftPolicy(table, self.cfg.max_draft_len)

    @torch.inference_mode()
    def _profile_verify(self, b: int, t: int) -> None:
        """One verify forward (target + LM head over every position) of b rows × t tokens after 128
        committed positions per row, on the first b slots (before any request runs)."""
        from specserve.core.masks import chain_parents

        context = min(128, max(self.cfg.max_model_len - 1 - self.cfg.max_draft_len, 0))
        tokens = torch.randint(0, self.model.cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(b * 31 + t))
        mask, positions = build_mask([context] * b, [chain_parents(t)] * b, t,
                                     sliding_window=self.model.cfg.sliding_window)
        self.model.logits(self._forward(tokens, positions, list(range(b)), [context] * b, mask))

    # -- admission ----------------------------------------------------------------------------
    @property
    def methods(self) -> list[str]:
        return sorted(self.proposers)

    def check(self, req: GenerationRequest) -> None:
        """Raise RequestRejected with a client-facing message if `req` cannot run."""
        try:
            req.params.validate(max_tokens_limit=self.cfg.max_model_len)
        except ValueError as e:
            raise RequestRejected(str(e)) from None
        n = len(req.prompt_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty")
        if n + req.params.max_tokens > self.cfg.max_model_len:
            raise RequestRejected(
                f"prompt ({n} tokens) plus max_tokens ({req.params.max_tokens}) exceeds the model "
                f"length {self.cfg.max_model_len}")
        vocab = self.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt_ids):
            raise RequestRejected(f"prompt token ids must lie in [0, {vocab})")
        method = req.method or self.cfg.default_method
        if method not in self.proposers:
            raise RequestRejected(f"unknown spec_method {method!r}; available: {', '.join(self.methods)}")
        if req.fallback_method is not None and req.fallback_method not in self.proposers:
            raise RequestRejected(f"unknown fallback method {req.fallback_method!r}; available: "
                                  f"{', '.join(self.methods)}")
        if self.proposers[method].repetition_guard:
            fallback = req.fallback_method or self.cfg.guard_fallback
            if fallback == method or self.proposers[fallback].repetition_guard or self.proposers[fallback].static_step:
                raise RequestRejected(f"spec_fallback {fallback!r} cannot stand in for {method}: it must be "
                                      f"a method without a repetition guard or a static step")
        k = req.num_draft_tokens
        if k is not None and not (isinstance(k, int) and 0 <= k <= self.cfg.max_draft_len):
            raise RequestRejected(f"num_draft_tokens must be an integer in [0, {self.cfg.max_draft_len}] "
                                  f"(the server's max_draft_len), got {k!r}")
        th = req.spec_threshold
        if th is not None and not (isinstance(th, (int, float)) and 0.0 <= th <= 1.0):
            raise RequestRejected(f"spec_threshold must be a number in [0, 1], got {th!r}")
        if req.draft_policy is not None and req.draft_policy not in POLICIES:
            raise RequestRejected(f"draft_policy must be one of {', '.join(POLICIES)}, got {req.draft_policy!r}")
        p = req.priority
        if not (isinstance(p, int) and not isinstance(p, bool) and 0 <= p <= MAX_PRIORITY):
            raise RequestRejected(f"priority must be an integer in [0, {MAX_PRIORITY}], got {p!r}")
        if req.options:
            own = self.proposers[method].option_keys
            foreign = sorted(k for k in req.options if k not in own)
            if foreign:
                takers = sorted({m for k in foreign for m, p in self.proposers.items()
                                 if k in p.option_keys})
                raise RequestRejected(f"{', '.join(foreign)} {'applies' if len(foreign) == 1 else 'apply'} only to spec_method "
                                      f"{' or '.join(takers) or '(a method not served here)'}, "
                                      f"not to spec_method {method!r}")
            try:
                self.proposers[method].check_options(req.options)
            except ValueError as e:
                raise RequestRejected(str(e)) from None
        if req.params.stop and self.detokenize is None:
            raise RequestRejected("stop strings need a tokenizer; this engine has none")
        if req.request_id in self._by_id:
            raise RequestRejected(f"request id {req.request_id!r} is already running")

    def submit(self, req: GenerationRequest, *, checked: bool = False) -> None:
        """Queue `req`; `checked`: the caller already ran check() on it (the EngineLoop does, in
        the client's thread) and it need not run again."""
        if not checked:
            self.check(req)
        method = req.method or self.cfg.default_method
        seq = _Sequence(seq_id=next(self._ids), req=req, proposer=self.proposers[method],
                        generator=(None if req.params.greedy or seeded(req.params)
                                   else make_generator(req.params, self.model.device)),
                        stats=SpecStats(method), tokens=list(req.prompt_ids),
                        num_prompt=len(req.prompt_ids), enqueued_step=self._steps)
        self._waiting.append(seq)
        self._by_id[req.request_id] = seq

    def cancel(self, request_id: str, error: str | None = None) -> bool:
        """Stop a request now and free its slot; its final output comes from the next step().
        `error` says why when the engine (not the client) ends it; its output then carries it."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return False
        if seq in self._waiting:
            self._waiting.remove(seq)
        else:
            self._running.remove(seq)
        seq.finish_reason, seq.error = FINISH_ABORT, error
        self._aborted.append(self._output(seq))
        self._retire(seq)
        return True

    def abort_all(self) -> list[str]:
        """Drop every request (after a failed step); returns their ids. No outputs follow."""
        ids = list(self._by_id)
        for rid in ids:
            self.cancel(rid)
        self._aborted = []
        return ids

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._aborted)

    @property
    def num_free_slots(self) -> int:
        return self.cache.num_free

    @property
    def num_slots_used(self) -> int:
        """KV slots held by sequences (a static-step scratch slot is not counted)."""
        return self.cache.num_slots - self.cache.num_free - self._scratch_slots

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def _fail(self, seq: _Sequence, message: str) -> None:
        """End one row's request with an error; the rest of the batch is untouched."""
        log.warning("request %s failed: %s", seq.req.request_id, message)
        seq.finish_reason, seq.error = FINISH_ERROR, message

    # -- the step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        decoding = list(self._running)  # sequences admitted now decode from the next step
        self._steps += 1
        admitted = self._admit()
        for group in _prefill_groups(admitted, self.cfg.max_prefill_tokens):
            self._prefill(group)
        static = [s for s in decoding if s.proposer.static_step]
        if static:
            self._decode_static(static)
        if len(static) < len(decoding):
            self._decode([s for s in decoding if not s.proposer.static_step])
        for seq in admitted + decoding:
            if seq.new_tokens or seq.finish_reason:
                outputs.append(self._output(seq))
            seq.new_tokens = []
            if seq.finish_reason:
                self._running.remove(seq)
                self._retire(seq)
        return outputs

    def _admit(self) -> list[_Sequence]:
        admitted = []
        while self._waiting and self.cache.num_free:
            i = self._admission.pick(self._waiting, self._steps)
            seq = self._waiting[i]
            del self._waiting[i]
            fallback = seq.req.fallback_method
            if fallback and not seq.proposer.available:
                seq.proposer, seq.stats.method = self.proposers[fallback], fallback
            if seq.proposer.repetition_guard:
                seq.fallback = self.proposers[fallback or self.cfg.guard_fallback]
            seq.slot = self.cache.allocate()
            self._running.append(seq)
            admitted.append(seq)
        return admitted

    def _prefill(self, seqs: list[_Sequence]) -> None:
        T = max(len(s.tokens) for s in seqs)
        tokens = torch.zeros(len(seqs), T, dtype=torch.long)
        for b, s in enumerate(seqs):
            tokens[b, :len(s.tokens)] = torch.tensor(s.tokens)
        parents = [list(range(-1, len(s.tokens) - 1)) for s in seqs]
        mask, positions = build_mask([0] * len(seqs), parents, T, sliding_window=self.model.cfg.sliding_window)
        out = self._forward_all(tokens, positions, [s.slot for s in seqs], [0] * len(seqs), mask)
        hidden = out.hidden
        last = torch.tensor([len(s.tokens) - 1 for s in seqs])
        logits = self.model.logits(hidden[torch.arange(len(seqs)), last])  # [B, V]
        for b, s in enumerate(seqs):
            n = len(s.tokens)
            self.cache.truncate(s.slot, n)
            _keep_features(s, out, b, slice(0, n))
            try:
                first = self._first_token(logits[b], s)
            except Exception as e:  # noqa: BLE001 — this row's sampling failed; the others go on
                self._fail(s, f"sampling the first token failed: {e}")
                continue
            self._emit(s, [first])

    def _first_token(self, logits: torch.Tensor, seq: _Sequence) -> int:
        if seq.seed is not None:
            return seeded_tokens(logits[None], seq.req.params, [len(seq.tokens)])[0]
        if seq.generator is None:
            return int(logits.argmax())
        return sample(target_probs(logits[None], seq.req.params)[0], seq.generator)

    def _room(self, s: _Sequence) -> int:
        """Tokens row `s` may draft this step: its cap (the request's, then the policy's), never
        past max_tokens or the model length (the step adds one more token)."""
        cap = self.cfg.max_draft_len if s.req.num_draft_tokens is None else s.req.num_draft_tokens
        if s.step_cap is not None:
            cap = min(cap, s.step_cap)
        return max(min(cap, s.req.params.max_tokens - s.num_output - 1, self.cfg.max_model_len - len(s.tokens)), 0)

    def _draft(self, seqs: list[_Sequence]) -> list[Draft]:
        drafts: dict[int, Draft] = {}
        by_proposer: dict[str, list[_Sequence]] = {}
        for s in seqs:
            by_proposer.setdefault(s.drafting.name, []).append(s)
        self._sync_features(seqs)
        for name, group in by_proposer.items():
            requests, idle = [], []
            for s in group:
                room = s.step_room = self._room(s)
                if room <= 0:
                    # Nothing to draft (the policy's cap, or the end of the request): no call. The
                    # features wait for the next call, which takes them all at once.
                    drafts[s.seq_id] = Draft.empty()
                    idle.append(s)
                    continue
                requests.append(DraftRequest(s.seq_id, s.tokens, room, s.req.params, s.generator,
                                             _features(s, name), s.req.spec_threshold, s.req.options,
                                             s.seed))
            group = [s for s in group if all(s is not i for i in idle)]
            if not group:
                continue
            proposer = group[0].drafting
            t0 = self._clock()
            failed = True
            try:
                got = proposer.propose(requests)
                if len(got) != len(group):
                    raise ProposerError(f"returned {len(got)} drafts for {len(group)} requests")
            except Exception as e:  # noqa: BLE001 — a drafter failure only costs this step's draft
                # A remote drafter that is unloaded, restarting or hung (ProposerError), or a bug in
                # a fused one: these rows decode plainly this step and keep their features, which
                # the proposer receives with the next call.
                if isinstance(e, ProposerUnavailable):
                    log.debug("proposer %s skipped (%s)", name, e)
                elif isinstance(e, ProposerError):
                    log.warning("proposer %s failed (%s); decoding without a draft this step", name, e)
                else:
                    log.exception("proposer %s raised; decoding without a draft this step", name)
                got = [Draft.empty() for _ in group]
                for s in group:
                    s.stats.proposer_errors += 1
                    s.draft_failed = True
            else:
                failed = False
                for s in group:
                    s.feature_chunks.pop(name, None)  # delivered
            finally:
                elapsed = self._clock() - t0
                for s in group:
                    s.stats.draft_seconds += elapsed
                # A failed call (a back-off refusal, a time-out) is no measure of drafting's cost.
                if self.policy is not None and not failed:
                    self.policy.drafted(name, max(r.max_draft_len for r in requests), elapsed)
            for s, r, d in zip(group, requests, got):
                problem = _draft_problem(d, self.model.cfg.vocab_size)
                if problem:
                    log.warning("proposer %s: bad draft for request %s (%s); decoding it plainly",
                                name, s.req.request_id, problem)
                    s.stats.proposer_errors += 1
                    s.draft_failed = True
                    d = Draft.empty()
                drafts[s.seq_id] = _truncate(d, r.max_draft_len)
        return [drafts[s.seq_id] for s in seqs]

    def _sync_features(self, seqs: list[_Sequence]) -> None:
        """Hand features to the proposers that need them but do not draft a row this step (DFlash
        while its repetition guard is on; a fallback that reads features while DFlash drafts):
        a call with max_draft_len 0, so either can draft the next step. A failed call keeps the
        features for the next one."""
        by_name: dict[str, list[_Sequence]] = {}
        for s in seqs:
            for p in s.feature_users():
                if p is not s.drafting and s.feature_chunks.get(p.name):
                    by_name.setdefault(p.name, []).append(s)
        for name, group in by_name.items():
            proposer = next(p for p in group[0].feature_users() if p.name == name)
            requests = [DraftRequest(s.seq_id, s.tokens, 0, s.req.params, s.generator, _features(s, name),
                                     s.req.spec_threshold, seed=s.seed) for s in group]
            try:
                proposer.propose(requests)
            except Exception:  # noqa: BLE001 — the features wait for the next call
                log.warning("proposer %s failed to take features (it drafts nothing this step)", name,
                            exc_info=True)
                for s in group:
                    s.stats.proposer_errors += 1
            else:
                for s in group:
                    s.feature_chunks.pop(name, None)

    def _update_guards(self, seqs: list[_Sequence]) -> None:
        """Step rows aside to their fallback while their recent output repeats (repetition.py)."""
        for s in seqs:
            if s.fallback is None:
                continue
            was, s.guarded = s.guarded, s.proposer.repetition_guard.active(s.tokens)
            if s.guarded:
                s.stats.guard_steps += 1
                s.stats.guard_activations += not was

    def _plan(self, seqs: list[_Sequence]) -> None:
        """Set each adaptive row's draft cap for this step (draft_policy.py)."""
        adaptive, fixed = [], []   # (row, its own cap)
        for s in seqs:
            s.step_cap, s.draft_failed = None, False
            if s.drafting.name == "none":
                continue
            cap = self.cfg.max_draft_len if s.req.num_draft_tokens is None else s.req.num_draft_tokens
            (adaptive if (s.req.draft_policy or self.cfg.draft_policy) == "adaptive" else fixed).append((s, cap))
        if not adaptive:
            return
        if self.policy is None:   # a request asked for it on an engine started "fixed"
            self._start_policy()
        named = lambda rows: [(s.drafting.name, cap) for s, cap in rows]  # noqa: E731
        decision = self.policy.decide(len(seqs), named(adaptive), named(fixed))
        self.last_policy_k = decision.k
        estimates = self.policy.estimates()
        for s, cap in adaptive:
            s.step_cap = decision.k
            st = s.stats
            st.policy_capped_steps += decision.k < cap
            st.policy_off_steps += decision.k == 0 and cap > 0
            st.policy_probe_steps += decision.probe
            est = estimates[s.drafting.name]
            st.policy_last = {"k": decision.k, "estimated_gain": round(decision.gain, 3),
                              "draft_cost_vs_start": est.draft_cost_vs_start,
                              "verify_slowdown": round(self.policy.verify_slowdown, 3)}

    def _decode(self, seqs: list[_Sequence]) -> None:
        self._update_guards(seqs)
        self._plan(seqs)
        drafts = self._draft(seqs)
        t0 = self._clock()
        T = 1 + max(len(d) for d in drafts)
        B = len(seqs)
        tokens = torch.zeros(B, T, dtype=torch.long)
        for b, (s, d) in enumerate(zip(seqs, drafts)):
            tokens[b, :1 + len(d)] = torch.tensor([s.tokens[-1]] + d.tokens)
        starts = [self.cache.lengths[s.slot] for s in seqs]
        parents = [[-1] + [p + 1 for p in d.parents] for d in drafts]
        mask, positions = build_mask(starts, parents, T, sliding_window=self.model.cfg.sliding_window)
        t_forward = self._clock()
        out = self._forward_all(tokens, positions, [s.slot for s in seqs], starts, mask)
        logits = self.model.logits(out.hidden)  # [B, T, V]
        if self.policy is not None:   # the forward alone, as the cost table measured it
            self.policy.verified(B, T, self._clock() - t_forward)
        outcomes: dict[str, list[StepOutcome]] = {}
        observed: dict[str, tuple[list[int], list[int], list[int]]] = {}   # proposer → (drafted, accepted, caps)
        for b, (s, d) in enumerate(zip(seqs, drafts)):
            try:
                verdict: Verdict = verify(logits[b, :1 + len(d)], d, s.req.params, s.generator, len(s.tokens))
            except Exception as e:  # noqa: BLE001 — this row alone fails (e.g. an invalid distribution)
                self.cache.truncate(s.slot, starts[b])
                self._fail(s, f"verification failed: {e}")
                continue
            rows = [0] + [c + 1 for c in verdict.accepted_nodes]  # forward rows kept, in order
            self.cache.compact_path(s.slot, starts[b], rows)
            _keep_features(s, out, b, rows)
            s.stats.record(len(d), verdict.num_accepted)
            s.stats.record_sources(d, verdict.accepted_nodes)
            drafter = s.drafting
            if drafter.name != "none" and not s.draft_failed:
                seen = observed.setdefault(drafter.name, ([], [], []))
                seen[0].append(len(d))
                seen[1].append(verdict.num_accepted)
                seen[2].append(s.step_room)
            outcomes.setdefault(drafter.name, []).append(
                StepOutcome(s.seq_id, len(d), verdict.accepted_nodes, verdict.emitted))
            self._emit(s, verdict.emitted)
        elapsed = self._clock() - t0
        for s in seqs:
            s.stats.verify_seconds += elapsed
        for name, outs in outcomes.items():
            self.proposers[name].observe(outs)
        if self.policy is not None:
            for name, (drafted, accepted, caps) in observed.items():
                self.policy.accepted(name, drafted, accepted, caps)

    def _decode_static(self, seqs: list[_Sequence]) -> None:
        """Rows whose proposer runs the whole step as one static computation (DSPark): drafting,
        verification, acceptance and the KV commit happen inside it; the engine applies the new
        lengths and emits. The step's wall time is charged to verify_seconds (nothing is separate)."""
        from specserve.core.static_step import StaticRow

        by_proposer: dict[str, list[_Sequence]] = {}
        for s in seqs:
            by_proposer.setdefault(s.proposer.name, []).append(s)
        for name, group in by_proposer.items():
            # The adaptive policy caps the group's draft length as it does a dynamic proposer's
            # (k = 0: the static step of width 0, a plain step that keeps the drafter's state).
            self._plan(group)
            rows = []
            for s in group:
                s.step_room = self._room(s)
                rows.append(StaticRow(s.seq_id, s.slot, s.tokens, self.cache.lengths[s.slot], s.step_room,
                                      s.req.params, s.generator, _features(s, name),
                                      s.req.spec_threshold, s.seed))
                s.feature_chunks.pop(name, None)
            t0 = self._clock()
            outcomes = group[0].proposer.step(rows)
            elapsed = self._clock() - t0
            for s, o in zip(group, outcomes):
                self.cache.truncate(s.slot, o.new_length)
                s.stats.verify_seconds += elapsed
                s.stats.record(o.num_drafted, o.num_accepted)
                self._emit(s, o.emitted)
            if self.policy is not None:
                width = max(o.width for o in outcomes)
                self.policy.static_step(name, len(group), width, elapsed)
                # Every row verifies the step's width whatever its cut, so that is what it
                # "drafted" for the cost of a verify; positions past min(room, width) were not tried.
                self.policy.accepted(name, [width] * len(group), [o.num_accepted for o in outcomes],
                                     [min(s.step_room, width) for s in group])

    def _forward(self, tokens, positions, slots, starts, mask) -> torch.Tensor:
        return self._forward_all(tokens, positions, slots, starts, mask).hidden

    def _forward_all(self, tokens, positions, slots, starts, mask) -> ForwardOutput:
        """The target forward, keeping the residual streams proposers read (feature_layers)."""
        dev = self.model.device
        batch = ForwardBatch(tokens.to(dev), positions.to(dev), torch.tensor(slots, device=dev),
                             torch.tensor(starts, device=dev), mask.to(dev),
                             self.cache.runs_for(slots, mask.shape[-1]))
        return self.model.forward(batch, self.cache, hidden_layers=self._feature_layers)

    # -- output and stop conditions -----------------------------------------------------------
    def _emit(self, seq: _Sequence, tokens: list[int]) -> None:
        params = seq.req.params
        for t in tokens:
            seq.tokens.append(t)
            seq.new_tokens.append(t)
            if ((t in self.eos and not params.ignore_eos) or t in params.stop_token_ids
                    or self._hit_stop_string(seq)):
                seq.finish_reason = FINISH_STOP
            elif seq.num_output >= params.max_tokens:
                seq.finish_reason = FINISH_LENGTH
            if seq.finish_reason:
                return

    def _hit_stop_string(self, seq: _Sequence) -> bool:
        stops = seq.req.params.stop
        if not stops:
            return False
        # A stop string of c characters spans at most 4c byte-level tokens; decoding a bounded
        # tail keeps this O(1) per token. Checked after every token, so the first hit is the
        # token that completes the stop string.
        window = 4 * max(len(s) for s in stops) + 4
        out = seq.tokens[seq.num_prompt:]
        tail = self.detokenize(out[-window:])
        return any(s in tail for s in stops)

    def _output(self, seq: _Sequence) -> RequestOutput:
        return RequestOutput(seq.req.request_id, list(seq.new_tokens), seq.finish_reason is not None,
                             seq.finish_reason, seq.num_prompt, seq.num_output, seq.stats, seq.error)

    def _retire(self, seq: _Sequence) -> None:
        if seq.slot >= 0:
            self.cache.release(seq.slot)
            seq.slot = -1
        seq.proposer.release(seq.seq_id)
        del self._by_id[seq.req.request_id]

    # -- convenience --------------------------------------------------------------------------
    def generate(self, requests: list[GenerationRequest]) -> dict[str, RequestOutput]:
        """Run `requests` to completion; returns the final output of each with all its tokens."""
        for r in requests:
            self.submit(r)
        tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
        final: dict[str, RequestOutput] = {}
        while self.has_work():
            for out in self.step():
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    out.new_token_ids = tokens[out.request_id]
                    final[out.request_id] = out
        return final


def _prefill_groups(seqs: list[_Sequence], budget: int) -> list[list[_Sequence]]:
    """Batch prompts of similar length: rows are padded to the longest in their forward, so a
    group is closed when padding would exceed a quarter of its tokens or the budget. A prompt
    longer than the budget gets a forward of its own."""
    groups: list[list[_Sequence]] = []
    group: list[_Sequence] = []
    for s in sorted(seqs, key=lambda s: len(s.tokens)):
        n = len(s.tokens)
        real = sum(len(g.tokens) for g in group) + n
        padded = n * (len(group) + 1)  # sorted ascending: n is the group's longest
        if group and (padded > budget or padded > 1.25 * real):
            groups.append(group)
            group = []
        group.append(s)
    if group:
        groups.append(group)
    return groups


def _features(seq: _Sequence, name: str) -> torch.Tensor | None:
    """[n, F]: the committed features proposer `name` has not taken yet, or None."""
    chunks = seq.feature_chunks.get(name)
    return None if not chunks else chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def _keep_features(seq: _Sequence, out: ForwardOutput, b: int, rows) -> None:
    """Keep row b's features at forward positions `rows` (the tokens just committed) for every
    proposer of `seq` that reads them: the final hidden state [n, D], followed by the residual
    streams after the proposer's feature_layers ([n, (1 + L) D]) where it names some."""
    for p in seq.feature_users():
        feats = out.hidden[b, rows]
        layers = p.feature_layers
        if layers:
            feats = torch.cat([feats] + [out.layer_hidden[i][b, rows] for i in layers], dim=-1)
        seq.feature_chunks.setdefault(p.name, []).append(feats.clone())


def _draft_problem(draft: Draft, vocab_size: int) -> str | None:
    """Why a proposer's draft cannot be verified, or None if it can."""
    try:
        draft.check()
    except ValueError as e:
        return str(e)
    if any(not 0 <= t < vocab_size for t in draft.tokens):
        return f"drafted token ids must lie in [0, {vocab_size})"
    return None


def _truncate(draft: Draft, n: int) -> Draft:
    """Keep the first n nodes; parents precede children, so the result is still a tree."""
    if len(draft) <= n:
        return draft
    probs = None if draft.probs is None else draft.probs[:n]
    cut = lambda xs: None if xs is None else xs[:n]  # noqa: E731
    return Draft(draft.tokens[:n], draft.parents[:n], probs, cut(draft.logprobs), cut(draft.sources), draft.skipped)
