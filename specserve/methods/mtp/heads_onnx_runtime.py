"""What the Triton model `mtp_heads` computes for the remote `mtp` (remote.py): per row the chain
of each head's top-1 token with the log-probability the heads gave it, exactly as the fused
proposers' Draft.probs are read by the arbiter (proposer.candidates_of: log of q(token), q
floored at draft_rows.MIN_PROB). Plain Python, so it is tested without a server; model.py only
converts tensors.

mtp_heads is stateless: the heads read only f_t, the target's final hidden state at the last
committed position, which is the last of each row's new feature rows (the engine sends the
features committed since the previous call, as for EAGLE; at least one row per step). The ONNX
export (mtp.export_mtp_onnx: features [n, D] → logits [n, k, V], the target's LM head embedded)
runs under onnxruntime. Free of torch (seeded rows import it when they draft), so the stub starts
without it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specserve.methods import row_sampling
from specserve.methods.mtp.draft_rows import MIN_PROB, padded
from specserve.methods.onnx_session import inference_session

class HeadsOnnxRuntime:
    """The MTP heads' ONNX graph → per row the chain of each head's top-1 token."""

    def __init__(self, onnx_file: str | Path, device: str = "cpu"):
        self.session = inference_session(str(onnx_file), device)

    def chains(self, features: np.ndarray, num_new: np.ndarray, max_draft_len: np.ndarray,
               valid_from: np.ndarray | None = None, row_seed=None, row_temperature=None, row_top_k=None,
               row_top_p=None) -> tuple[np.ndarray, np.ndarray]:
        """features [B, T, D], num_new [B], max_draft_len [B] → tokens [B, K] (-1 padded),
        logprobs [B, K] (0 padded). A row without a new feature row has no f_t: no chain.
        A seeded row (row_sampling.py; valid_from [B] then places it) takes at head j the
        coupled choice at sequence index len(token_ids) + j = valid_from + num_new + 1 + j, as
        the fused heads proposer."""
        seeded = row_sampling.decode(row_seed, row_temperature, row_top_k, row_top_p, len(num_new))
        rows = [b for b in range(len(num_new)) if num_new[b] > 0 and max_draft_len[b] > 0]
        tokens: list[list[int]] = [[] for _ in num_new]
        lps: list[list[float]] = [[] for _ in num_new]
        if rows:
            f = np.stack([features[b, int(num_new[b]) - 1] for b in rows]).astype(np.float32)   # [n, D]
            logits = self.session.run(["logits"], {"features": f})[0]                             # [n, k, V]
            best = logits.argmax(-1)                                                               # [n, k]
            # q(token) = the plain softmax at the drafted token, in float32 as the fused proposer's
            # probs (at the argmax the numerator is exp(0) = 1)
            shifted = logits - logits.max(-1, keepdims=True)
            total = np.exp(shifted).sum(-1, dtype=np.float32)                                      # [n, k]
            for j, b in enumerate(rows):
                n = min(int(max_draft_len[b]), logits.shape[1])
                params = seeded[b]
                if params is None:
                    chain = best[j, :n]
                else:
                    m = int(valid_from[b] + num_new[b]) + 1
                    chain = np.array(row_sampling.seeded_choice(logits[j, :n], params, list(range(m, m + n))))
                q = np.exp(shifted[j, np.arange(n), chain]) / total[j, :n]
                tokens[b] = chain.tolist()
                lps[b] = np.log(np.maximum(q, MIN_PROB)).tolist()
        return padded(tokens, -1, np.int64), padded(lps, 0.0, np.float32)
