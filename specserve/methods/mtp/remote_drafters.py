"""What the Triton model `draft_drafter` computes: the draft model's chains for the remote `mtp`
(remote.py), each with the log-probability its drafter gave every token, exactly as the fused
proposers' Draft.probs are read by the arbiter (proposer.candidates_of: log of q(token), q
floored at draft_rows.MIN_PROB). Plain Python, so it is tested and timed without a server; the
model.py file only converts tensors. The MTP heads' remote runtime is heads_onnx_runtime.py
(torch-free).

draft_drafter keeps the draft model's KV cache per sequence, keyed by the engine's sequence id,
in the fused proposer's own code (draft/proposer.py, DraftModelProposer). Every call carries the
row's whole token list (context_tokens, which the ensemble already sends for n-gram lookup), and the
proposer brings its cache up to it by keeping the longest prefix it still matches and feeding the
rest. So a step it missed, a rejected draft, or a reload (empty cache) costs only a longer
catch-up, never a wrong draft, and it needs no `unknown` / re-prime round trip and no observe():
what fused mtp's observe() rolls back, the next catch-up finds mismatched and drops. Slots are
freed by release_ids and, should a release be lost, the least recently used sequence is evicted
(its state is only a cache).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from specserve.core.proposer import DraftRequest
from specserve.core.sampling_params import SamplingParams
from specserve.methods import row_sampling
from specserve.methods.mtp.draft_rows import MIN_PROB, padded


def load_remote_draft(folder: str | Path, checkpoint: str | Path, *, dtype: str = "auto",
                      device: str = "cpu"):
    """The draft model in `folder` for the target at `checkpoint`, checked as the fused one is
    (its tokenizer must give the target's ids on the probe string; same vocabulary size) without
    loading the target's weights."""
    from specserve.model.transformer import CheckpointError, load_config, load_model
    from specserve.methods.draft.drafter import check_tokenizer
    from specserve.model.devices import resolve_device, resolve_drafter_dtype
    from specserve.model.tokenizer import load_tokenizer

    check_tokenizer(load_tokenizer(checkpoint), load_tokenizer(folder))
    model = load_model(folder, device=resolve_device(device))
    vocab = load_config(checkpoint).vocab_size
    if model.cfg.vocab_size != vocab:
        raise CheckpointError(f"draft model {folder}: vocab_size {model.cfg.vocab_size} != the target's {vocab}")
    # "auto" as for the fused drafter (bfloat16 where the hardware has fast bf16 matmuls).
    return model.to(resolve_drafter_dtype(dtype, model))


class DraftModelService:
    """draft_drafter's state: the fused DraftModelProposer over `max_num_seqs` cache slots."""

    def __init__(self, draft, *, max_num_seqs: int, max_model_len: int, max_draft_len: int):
        from specserve.methods.draft.proposer import DraftModelProposer

        self.proposer = DraftModelProposer(draft, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                           max_draft_len=max_draft_len)
        self.max_num_seqs = max_num_seqs
        self._used: OrderedDict[int, None] = OrderedDict()   # sequence ids, least recently used first
        self.evicted = 0

    def _make_room(self, seq_ids: list[int]) -> None:
        fresh = [s for s in seq_ids if s not in self._used]
        while len(fresh) > self.proposer.cache.num_free:
            victim = next((s for s in self._used if s not in seq_ids), None)
            if victim is None:
                raise ValueError(f"draft_drafter: {len(seq_ids)} sequences in one call, more than its "
                                 f"{self.max_num_seqs} slots")
            self.release([victim])
            self.evicted += 1

    @torch.inference_mode()
    def chains(self, seq_ids: np.ndarray, context_tokens: np.ndarray, max_draft_len: np.ndarray,
               row_seed=None, row_temperature=None, row_top_k=None, row_top_p=None) -> tuple[np.ndarray, np.ndarray]:
        """seq_ids [B], context_tokens [B, L] (-1 padded; the last token of a row is pending),
        max_draft_len [B] → tokens [B, K] (-1 padded), logprobs [B, K] (0 padded). Seeded rows
        (row_sampling.py) draft with their noise, as the fused proposer does for them."""
        ids = [int(s) for s in seq_ids]
        if len(set(ids)) != len(ids):
            raise ValueError("draft_drafter: a sequence id appears twice in one call")
        self._make_room(ids)
        seeded = row_sampling.decode(row_seed, row_temperature, row_top_k, row_top_p, len(ids))
        requests = [DraftRequest(s, [int(t) for t in row if t >= 0], int(k), p or SamplingParams(),
                                 seed=None if p is None else p.seed)
                    for s, row, k, p in zip(ids, context_tokens, max_draft_len, seeded)]
        for s in ids:
            self._used[s] = None
            self._used.move_to_end(s)
        drafts = self.proposer.propose(requests)
        tokens, lps = [], []
        for d in drafts:
            tokens.append(d.tokens)
            if d.tokens:
                q = d.probs[torch.arange(len(d)), torch.tensor(d.tokens)].float().clamp_min(MIN_PROB)
                lps.append(q.log().tolist())
            else:
                lps.append([])
        return padded(tokens, -1, np.int64), padded(lps, 0.0, np.float32)

    def release(self, seq_ids) -> None:
        for s in seq_ids:
            self._used.pop(int(s), None)
            self.proposer.release(int(s))
