"""The EAGLE drafter's runtime on the REMOTE side: the exported ONNX backbone and calibration
head under onnxruntime, with the per-sequence drafter state keyed by the engine's sequence id.

This is what the Triton models `eagle_backbone` and `calibration_head` run (their model.py files
only convert tensors); it is plain Python so it is tested without a server.

Per step the engine sends, for each of its rows: the sequence id, the true target features of
the tokens committed since the last call (`num_new` of them) with the tokens that follow each
(t_{i+1}), the most tokens it may draft, and the row's sampling. The backbone appends those
pairs to the sequence's cache (its state), then drafts up to `max_draft_len` tokens on a scratch
copy, so the speculative pairs are never committed. A row drafts greedily (argmax: the engine
verifies it as a point mass, lossless for unseeded sampled requests too) unless it is seeded:
then draft token j is the fused drafter's choice, argmax(log q~ + g(seed, position)) with the
target's own noise (core/sampling.seeded_tokens), so a drafter close to the target proposes the
target's token. Worked example: 5 committed tokens t_0..t_4 (valid_from 3, num_new 2: pairs 3
and 4 arrive) and pending t_5; after ingesting, the sequence holds 5 pairs, and draft token j
predicts sequence index 6 + j = holds + 1 + j, which is len(token_ids) + j on the engine side.

A sequence the runtime has not seen (new, or the drafter was reloaded) must arrive with its
whole history (`valid_from == 0`); otherwise it is reported in `unknown`, and the engine
re-primes it by resending everything.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specserve.core.sampling_params import SamplingParams
from specserve.methods import row_sampling
from specserve.methods.eagle.draft_scalars import CALIBRATION_POSITIONS
from specserve.methods.onnx_session import inference_session


@dataclass
class DraftBatch:
    """The engine's request for one step (numpy, as it travels over BLS)."""
    seq_ids: np.ndarray        # [B] int64
    valid_from: np.ndarray     # [B] int64: pairs the engine believes the drafter holds
    num_new: np.ndarray        # [B] int64: new pairs for each row (≥ 1)
    features: np.ndarray       # [B, Tmax, D] float32, row b valid for its first num_new[b]
    next_tokens: np.ndarray    # [B, Tmax] int64
    max_draft_len: np.ndarray  # [B] int64
    # Each row's sampling (methods/row_sampling.py); absent or temperature 0: the row drafts greedily.
    row_seed: np.ndarray | None = None         # [B] int64: the seed's bits
    row_temperature: np.ndarray | None = None  # [B] float64
    row_top_k: np.ndarray | None = None        # [B] int64
    row_top_p: np.ndarray | None = None        # [B] float64

    def seeded_params(self) -> list[SamplingParams | None]:
        """Per row, its sampling when it drafts with its seed's noise, else None (greedy)."""
        return row_sampling.decode(self.row_seed, self.row_temperature, self.row_top_k, self.row_top_p,
                                   len(self.seq_ids))


@dataclass
class DraftResult:
    tokens: np.ndarray         # [B, K] int64 (K = max over rows of max_draft_len; -1 = none)
    hidden: np.ndarray         # [B, K, D] float32 draft hidden state per position
    scalars: np.ndarray        # [B, K, 3] float32 (top-1 prob, entropy, position / 8)
    logprobs: np.ndarray       # [B, K] float32 log q(draft token) (0 padded)
    unknown: np.ndarray        # [B] bool: the runtime lacks this sequence's history; re-prime it


@dataclass
class _State:
    k: np.ndarray  # [1, Hkv, P, hd]
    v: np.ndarray
    valid: int = 0


def _softmax_stats(logits: np.ndarray) -> tuple[np.ndarray, int, float, float]:
    """logits [V] → (q [V] float64, its top-1 token, q(top-1), entropy)."""
    z = logits.astype(np.float64) - logits.max()
    p = np.exp(z)
    p /= p.sum()
    top = int(p.argmax())
    entropy = float(-(p * np.log(np.maximum(p, 1e-30))).sum())
    return p, top, float(p[top]), entropy


@dataclass
class EagleOnnxRuntime:
    backbone_path: str
    kv_heads: int
    head_dim: int
    device: str = "cpu"   # the engine's --device (execution_providers)

    def __post_init__(self):
        self.session = inference_session(self.backbone_path, self.device)
        self.states: dict[int, _State] = {}

    def _run(self, feats, toks, start: int, k, v):
        # feats [1, T, D], toks [1, T]; chain mask over the cached `start` pairs plus the new T.
        T = feats.shape[1]
        mask = np.zeros((1, T, start + T), dtype=bool)
        mask[0, :, :start] = True
        mask[0, :, start:] = np.tril(np.ones((T, T), dtype=bool))
        positions = (start + np.arange(T, dtype=np.int64))[None]
        return self.session.run(None, {"features": feats, "next_tokens": toks, "positions": positions,
                                       "past_k": k, "past_v": v, "mask": mask})

    def draft(self, batch: DraftBatch) -> DraftResult:
        B = len(batch.seq_ids)
        K = int(batch.max_draft_len.max(initial=0))
        D = batch.features.shape[-1]
        out_tokens = np.full((B, K), -1, dtype=np.int64)
        out_hidden = np.zeros((B, K, D), dtype=np.float32)
        out_scalars = np.zeros((B, K, 3), dtype=np.float32)
        out_logprobs = np.zeros((B, K), dtype=np.float32)
        unknown = np.zeros(B, dtype=bool)
        seeded = batch.seeded_params()
        for b in range(B):
            sid, start, n = int(batch.seq_ids[b]), int(batch.valid_from[b]), int(batch.num_new[b])
            st = self.states.get(sid)
            if start == 0:  # a new sequence, or the engine re-priming one: start over
                empty = np.zeros((1, self.kv_heads, 0, self.head_dim), dtype=np.float32)
                st = self.states[sid] = _State(empty, empty.copy())
            if st is None or st.valid != start:
                unknown[b] = True
                continue
            hidden, logits, st.k, st.v = self._run(batch.features[b:b + 1, :n], batch.next_tokens[b:b + 1, :n],
                                                   st.valid, st.k, st.v)
            st.valid += n
            h, lg = hidden[0, -1], logits[0, -1]
            k_scratch, v_scratch = st.k, st.v
            params = seeded[b]
            for j in range(int(batch.max_draft_len[b])):
                q, tok, top1, ent = _softmax_stats(lg)
                if params is not None:   # the coupled choice at sequence index st.valid + 1 + j
                    tok = row_sampling.seeded_choice(lg[None], params, [st.valid + 1 + j])[0]
                out_tokens[b, j] = tok
                out_hidden[b, j] = h
                out_scalars[b, j] = (top1, ent, j / CALIBRATION_POSITIONS)
                out_logprobs[b, j] = np.log(max(q[tok], 1e-30))
                if j + 1 == int(batch.max_draft_len[b]):
                    break
                hh, ll, k_scratch, v_scratch = self._run(h[None, None].astype(np.float32),
                                                         np.array([[tok]], dtype=np.int64),
                                                         st.valid + j, k_scratch, v_scratch)
                h, lg = hh[0, -1], ll[0, -1]
        return DraftResult(out_tokens, out_hidden, out_scalars, out_logprobs, unknown)

    def release(self, seq_ids) -> None:
        for sid in seq_ids:
            self.states.pop(int(sid), None)


@dataclass
class CalibrationOnnxRuntime:
    path: str
    device: str = "cpu"   # the engine's --device (execution_providers)

    def __post_init__(self):
        self.session = inference_session(self.path, self.device)

    def accept_prob(self, hidden: np.ndarray, scalars: np.ndarray) -> np.ndarray:
        """hidden [B, K, D], scalars [B, K, 3] → [B, K]."""
        B, K, D = hidden.shape
        if B * K == 0:
            return np.zeros((B, K), dtype=np.float32)
        p = self.session.run(["accept_prob"], {"hidden": hidden.reshape(B * K, D).astype(np.float32),
                                               "scalars": scalars.reshape(B * K, 3).astype(np.float32)})[0]
        return p.reshape(B, K)


def in_process_call(backbone: EagleOnnxRuntime, calibration: CalibrationOnnxRuntime):
    """What the `eagle_proposal` ensemble computes, as a RemoteProposer `call` without a server
    (benchmarks and tests): backbone draft, then the calibration head on its positions."""

    def call(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        res = backbone.draft(DraftBatch(**inputs))
        # draft_scalars and draft_logprobs too, as the mtp_proposal ensemble passes them on:
        # remote mtp's arbiter reads EAGLE's confidence from them (mtp/remote._eagle_candidate).
        return {"draft_tokens": res.tokens, "accept_prob": calibration.accept_prob(res.hidden, res.scalars),
                "draft_scalars": res.scalars, "draft_logprobs": res.logprobs, "unknown": res.unknown}

    return call
