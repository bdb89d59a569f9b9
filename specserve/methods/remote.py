"""A proposer whose drafter runs elsewhere (a Triton proposal ensemble, called by BLS).

The engine side keeps, per sequence, the target features it has committed (the history) and how
many pairs the remote drafter holds. Each step sends only what the drafter lacks; if the drafter
says it does not know a sequence (it was unloaded and loaded again, or restarted), the same step
re-primes it by sending the whole history. If the call fails (the model is unloaded, not ready),
the step raises ProposerError and the engine decodes those rows plainly; nothing is lost, since
the history still holds every feature. Greedy drafts are point masses, so verification stays
lossless for sampled requests as well; each row's sampling travels too (schema.ROW_SAMPLING), so
a drafter that can proposes with a seeded row's noise, as the fused drafters do (row_sampling.py).

A drafter that HANGS (rather than refusing) must not hang the engine: every call runs on one
worker thread and is waited for at most `timeout_s`; past it the step decodes plainly, and while
that call is still outstanding later steps do not call again (they decode plainly at once). When
it returns, drafting resumes. Releases are sent on the same worker and never waited for.

After a failed call the proposer backs off: it does not call again for BACKOFF_MIN_S, doubling
per consecutive failure up to BACKOFF_MAX_S (a killed drafter stub answers each call only after
about a second, and a step must not pay that every time). The first success resets it.

`call` performs one round trip: a dict of numpy inputs (DraftBatch fields) → a dict with
`draft_tokens` [B, K], `accept_prob` [B, K] (optional) and `unknown` [B]. In Triton it wraps a
BLS request to `eagle_proposal`; in tests it calls the ONNX runtime directly.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from specserve.core.proposer import Draft, DraftRequest, ProposerDefaults, ProposerError, ProposerUnavailable, SequenceState, StepOutcome
from specserve.methods import row_sampling
from specserve.methods.calibration_cut import calibration_cut

log = logging.getLogger("specserve.remote")

Call = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass
class _History:
    features: list[torch.Tensor] = field(default_factory=list)  # chunks of [n, D]
    length: int = 0        # pairs whose features we hold
    remote_valid: int = 0  # pairs the remote drafter holds (as far as we know)
    kept: int | None = None  # draft tokens the threshold cut kept last step (None: no step yet)

    def slice(self, start: int) -> torch.Tensor:
        return torch.cat(self.features)[start:]


class RemoteProposer(ProposerDefaults):
    needs_features = True

    # With a threshold, ask the drafter for at most this many tokens beyond what the cut kept in
    # the sequence's previous step. The remote drafter drafts every position it is asked for
    # before the calibration head scores them, so unbounded requests pay for positions the cut
    # drops (demo model, 8 drafted per step for 4.5 kept). Measured in-process on 12 held-out
    # prompts, speedup over none with probe 2 / 3 / 4 / unbounded: 2.26 / 2.30 / 2.31 / 2.27×.
    PROBE = 4

    # The deployment's default (DeploymentSettings.remote_timeout_s says why).
    TIMEOUT_S = 1.0
    BACKOFF_MIN_S, BACKOFF_MAX_S = 0.25, 8.0

    def __init__(self, name: str, call: Call, *, max_draft_len: int = 8, threshold: float | None = 0.3,
                 release: Callable[[list[int]], None] | None = None, timeout_s: float = TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic):
        self.name, self._call, self._release = name, call, release
        self.max_draft_len, self.threshold = max_draft_len, threshold
        self.timeout_s = timeout_s
        self._seqs: dict[int, _History] = {}
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"specserve-{name}-bls")
        self._pending: Future | None = None   # a call that timed out and has not returned yet
        self._clock = clock
        self._backoff, self._retry_at = 0.0, float("-inf")

    @property
    def available(self) -> bool:
        """False while backing off after failed calls or while a hung call is outstanding: a
        request with a fallback method starts on that instead (Engine._admit)."""
        return self._clock() >= self._retry_at and (self._pending is None or self._pending.done())

    def _batch(self, requests: list[DraftRequest], rows: list[int], *, reprime: bool) -> dict[str, np.ndarray]:
        B = len(rows)
        starts, counts, feats, nxt = [], [], [], []
        for i in rows:
            r, h = requests[i], self._seqs[requests[i].seq_id]
            start = 0 if reprime else h.remote_valid
            f = h.slice(start)  # [n, D]
            committed = len(r.token_ids) - 1
            starts.append(start)
            counts.append(committed - start)
            feats.append(f)
            nxt.append(r.token_ids[start + 1: committed + 1])
        T, D = max(counts), feats[0].shape[-1]
        features = np.zeros((B, T, D), dtype=np.float32)
        next_tokens = np.zeros((B, T), dtype=np.int64)
        for b, (f, t) in enumerate(zip(feats, nxt)):
            features[b, :len(t)] = f.float().numpy()
            next_tokens[b, :len(t)] = t
        return {"seq_ids": np.array([requests[i].seq_id for i in rows], dtype=np.int64),
                "valid_from": np.array(starts, dtype=np.int64), "num_new": np.array(counts, dtype=np.int64),
                "features": features, "next_tokens": next_tokens,
                "max_draft_len": np.array([self._request_len(requests[i]) for i in rows], dtype=np.int64),
                **row_sampling.encode([requests[i] for i in rows])}

    def _threshold(self, r: DraftRequest) -> float | None:
        return self.threshold if r.threshold is None else r.threshold

    def _request_len(self, r: DraftRequest) -> int:
        cap = min(r.max_draft_len, self.max_draft_len)
        kept = self._seqs[r.seq_id].kept
        if not self._threshold(r) or kept is None:
            return cap
        return min(cap, kept + self.PROBE)

    def _round_trip(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        now = self._clock()
        if now < self._retry_at:
            raise ProposerUnavailable(f"{self.name}: backing off after failed calls; next try in "
                                f"{self._retry_at - now:.2f} s")
        try:
            out = self._round_trip_now(batch)
        except ProposerUnavailable:
            raise
        except ProposerError:
            self._backoff = min(max(2 * self._backoff, self.BACKOFF_MIN_S), self.BACKOFF_MAX_S)
            self._retry_at = self._clock() + self._backoff
            raise
        self._backoff = 0.0
        return out

    def _round_trip_now(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._pending is not None:
            if not self._pending.done():
                raise ProposerUnavailable(f"{self.name}: the remote drafter has not answered an earlier call yet")
            self._pending = None
        future = self._worker.submit(self._call, batch)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            self._pending = future
            raise ProposerError(f"{self.name}: the remote drafter did not answer within {self.timeout_s:g} s") from None
        except ProposerError:
            raise
        except Exception as e:  # noqa: BLE001 — a failed remote call means "no draft this step"
            raise ProposerError(f"{self.name}: remote drafter call failed: {e}") from e

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        # The engine's contract: a proposer that raises has not consumed the features it was
        # given (the engine sends them again next step), so undo what this call appended.
        before = {r.seq_id: (len(h.features), h.length) for r in requests if (h := self._seqs.get(r.seq_id))}
        try:
            return self._propose(requests)
        except Exception:
            for r in requests:
                h = self._seqs.get(r.seq_id)
                if h is None:
                    continue
                if r.seq_id in before:
                    n, h.length = before[r.seq_id]
                    del h.features[n:]
                else:
                    del self._seqs[r.seq_id]
            raise

    def _propose(self, requests: list[DraftRequest]) -> list[Draft]:
        for r in requests:
            h = self._seqs.setdefault(r.seq_id, _History())
            if r.features is not None and r.features.shape[0]:
                h.features.append(r.features.detach().to("cpu"))
                h.length += r.features.shape[0]
            if h.length != len(r.token_ids) - 1:
                raise ProposerError(f"{self.name}: sequence {r.seq_id} has {h.length} features for "
                                    f"{len(r.token_ids) - 1} committed tokens")
        rows = list(range(len(requests)))
        out = self._round_trip(self._batch(requests, rows, reprime=False))
        drafts = self._row_drafts(requests, rows, out)
        unknown = out["unknown"].astype(bool)
        if unknown.any():
            # The drafter lost these sequences (reloaded); re-prime them with their history now.
            again = [i for i in rows if unknown[i]]
            log.info("%s: re-priming %d sequence(s) on the remote drafter", self.name, len(again))
            redo = self._round_trip(self._batch(requests, again, reprime=True))
            if redo["unknown"].astype(bool).any():
                raise ProposerError(f"{self.name}: remote drafter refused to re-prime sequences")
            for i, d in zip(again, self._row_drafts(requests, again, redo)):
                drafts[i] = d
        for r, d in zip(requests, drafts):
            h = self._seqs[r.seq_id]
            h.remote_valid = len(r.token_ids) - 1
            h.kept = len(d)
        return drafts

    def _row_drafts(self, requests: list[DraftRequest], rows: list[int], out: dict[str, np.ndarray]) -> list[Draft]:
        """The draft of each of `rows` from one round trip's outputs (out's row j is rows[j])."""
        tokens, probs = out["draft_tokens"], out.get("accept_prob")
        return [Draft.chain(calibration_cut(tokens[j], None if probs is None else probs[j], self._threshold(requests[i])))
                for j, i in enumerate(rows)]

    def observe(self, outcomes: list[StepOutcome]) -> None:
        pass  # the drafter only ever commits pairs built from true features

    def sequence_state(self, max_model_len: int) -> SequenceState:
        raise NotImplementedError(f"{self.name}: a remote drafter's state is kept by its Triton model, not here; "
                                  f"count it on an engine built in process (placement fused)")

    def release(self, seq_id: int) -> None:
        if self._seqs.pop(seq_id, None) is not None and self._release is not None:
            self._worker.submit(self._release_quietly, seq_id)

    def flush(self) -> None:
        """Wait until every call and release sent so far has run (tests, shutdown)."""
        self._worker.submit(lambda: None).result()

    def _release_quietly(self, seq_id: int) -> None:
        try:
            self._release([seq_id])
        except Exception as e:  # noqa: BLE001 — an unloaded drafter has no state to free
            log.info("%s: release of sequence %d not delivered (%s)", self.name, seq_id, e)
