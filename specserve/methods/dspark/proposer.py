"""DSPark: the whole speculative step with the fused EAGLE drafter (EAGLE-1 or EAGLE-3) as one
static computation per (batch bucket B, draft length K, KV span S, greedy/sampled) —
docs/design.md, 'The methods'.

One step, all on the device, no host decision inside:

  1. ingest: the drafter's forward over the pairs (f_i, t_{i+1}) the previous step committed
     (kept on the device in per-slot buffers, width max_draft_len + 1, masked by their count);
     a row's first step instead takes f̂ from the eager ingest of its prompt (`fresh`);
  2. draft: K drafter steps (argmax, or an inverse-CDF draw on a pre-drawn uniform for sampled
     rows, from the drafter's distribution warped by the request's parameters; seeded rows take
     the coupled choice argmax(log q + g) with the Gumbel noise of each position, computed on
     the device from the seed);
  3. calibrated cut: the calibration head's cumulative acceptance masks positions past the row's
     cut (and its room) — the graph always drafts K, the cut only sets `draft_lens`;
  4. verify + accept + commit: `static_step.target_step`;
  5. keep the committed pairs (target features, emitted tokens) for the next step's ingest.

An EAGLE-3 drafter (eagle3.py) runs the same step: the proposer names the drafter's target layers
(`feature_layers`), so the engine's prefill keeps them and the step's verify forward returns them
(`target_step(hidden_layers=...)`); step 5 keeps the committed pairs fused (g = fc of those layers),
which is what its ingest reads. It drafts with its own head over the reduced draft vocabulary
(head.DraftHead: the argmax, draw or coupled choice is taken over the draft ids and mapped
through d2t; verification reads its q expanded to the target vocabulary, zero outside the draft
ids), and the target verifies with its full distribution, so a token outside the draft vocabulary
costs acceptance only.

Draft-length adaptation stays graph-compatible in two ways: inside the graph, masking past the
calibrated cut; across steps, K is chosen on the host from the captured lengths 1..max_draft_len
(`draft_lengths`; at most 8 per bucket), the longest over the rows of last cut + 1 (capped by the
room; a row that drafted all of the last K counts as uncut), so a step drafts one token past
where the head stopped last time — close to the dynamic EAGLE path, which drafts until the
head's cut and then stops. Measured on the demo model (CPU, one
request): last cut + 2 over powers of two {1, 2, 4, 8} made most steps K = 8, 29 ms per step
against dynamic EAGLE's 24 ms.

Host-side state per sequence: the drafter slot and valid pairs (EagleProposer's), and how many
committed pairs wait in the device buffers (`_pending`). After the one host sync per step the
host knows the counts, so it advances `valid` by the ingested pairs and records the new ones.

Greedy output equals plain greedy decoding token for token (the target verifies every token);
sampled output follows the target distribution (static_step's acceptance is speculative sampling);
seeded output equals plain seeded decoding token for token (static_step's coupled acceptance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.core.cuda_graphs import GraphCache
from specserve.core.kv_cache import KVCache
from specserve.model.transformer import Transformer
from specserve.core.proposer import DraftRequest, ProposerDefaults, SequenceState
from specserve.methods.dspark.head import DraftHead
from specserve.methods.eagle.drafter import CalibrationHead, EagleDrafter
from specserve.methods.eagle.eagle3 import Eagle3Drafter
from specserve.methods.eagle.proposer import EagleProposer
from specserve.core.static_step import (DeviceKV, SamplingTensors, StaticOutcome, StaticRow, StepInputs,
                                   bucket_for, chain_batch, check_static_model, draw, span_for,
                                   step_noise, target_step, to_host, truncates, uniforms_for, warp)
from specserve.core.sampling import coupled_choice


def draft_lengths(max_draft_len: int) -> tuple[int, ...]:
    """The captured K set: every length 1..max_draft_len (a graph per bucket and K)."""
    return tuple(range(1, max_draft_len + 1))


@dataclass(frozen=True)
class StepKey:
    B: int
    K: int
    S: int
    sampled: bool
    seeded: bool = False   # some row is seeded: the graph computes the Gumbel noise
    # some sampled row has top-k / top-p: the graph sorts the vocabulary. False by default, as
    # `truncates` gives for greedy rows, so warm's greedy keys are the ones greedy steps run.
    truncated: bool = False


class DSParkProposer(ProposerDefaults):
    """The `dspark` method, a StaticStepProposer: the engine calls `step` for its rows (it has no
    `propose`): see Engine._decode_static."""

    name = "dspark"
    needs_features = True   # the engine's prefill hands over the prompt's features
    static_step = True

    def __init__(self, drafter: EagleDrafter | Eagle3Drafter, target: Transformer, *, max_num_seqs: int, max_model_len: int,
                 max_draft_len: int = 8, threshold: float | None = 0.3, span_set: str | None = None,
                 graph_mode: str = "auto"):
        """span_set: static_step.SPAN_SETS; None = "full" on CUDA (one graph per bucket and K, all
        captured by `warm`), "pow2" on a CPU (measured 2.4x faster there for short contexts)."""
        check_static_model(target)
        self.target, self.drafter = target, drafter
        # EAGLE-3: the engine keeps these layers' streams (prefill), and the step's verify keeps them too
        self.feature_layers = drafter.feature_layers
        if span_set is None:
            span_set = "full" if target.device.type == "cuda" else "pow2"
        self.max_draft_len, self.span_set = max_draft_len, span_set
        self.max_num_seqs = max_num_seqs
        # The prompt ingest, drafter slots and `valid` bookkeeping are EagleProposer's; one extra
        # drafter slot is the scratch padded rows write to.
        self.eagle = EagleProposer(drafter, target, max_num_seqs=max_num_seqs + 1, max_model_len=max_model_len,
                                   max_draft_len=max_draft_len, threshold=threshold, name=self.name)
        self._dscratch = self.eagle.cache.allocate()
        self._dkv = DeviceKV(self.eagle.cache)
        self.head = DraftHead(drafter, self.eagle._head_w)
        dev, D, W = target.device, drafter.cfg.hidden_size, max_draft_len + 1
        # Committed pairs of the last step, per drafter slot: features [W, D] and next tokens [W].
        self._feats = torch.zeros(self.eagle.cache.num_slots, W, D, dtype=self.eagle.dtype, device=dev)
        self._ftoks = torch.zeros(self.eagle.cache.num_slots, W, dtype=torch.long, device=dev)
        self._pending: dict[int, int] = {}   # seq_id → committed pairs waiting in the buffers
        self._last_cut: dict[int, int] = {}  # seq_id → last step's draft length
        self.ks = draft_lengths(max_draft_len)
        self._graph_mode = graph_mode
        self._graphs: GraphCache | None = None
        self._kv: DeviceKV | None = None
        self._scratch = -1

    # -- the StaticStepProposer interface (core/proposer.py) -------------------------------------
    def sequence_state(self, max_model_len: int) -> SequenceState:
        W, D = self._feats.shape[1:]
        buffers = self._feats[0].numel() * self._feats.element_size() + self._ftoks[0].numel() * self._ftoks.element_size()
        return SequenceState(self.eagle.cache.slot_bytes + buffers,
                             f"one slot of the drafter's KV cache ({self.eagle.cache.max_len} positions) "
                             f"+ committed pairs: [{W}, {D}] features, [{W}] tokens")

    def release(self, seq_id: int) -> None:
        self.eagle.release(seq_id)
        self._pending.pop(seq_id, None)
        self._last_cut.pop(seq_id, None)

    # -- the step ------------------------------------------------------------------------------------
    def bind(self, cache: KVCache, scratch_slot: int) -> None:
        """Attach the engine's target KV pool (whose `scratch_slot` no sequence owns)."""
        self._kv, self._scratch = DeviceKV(cache), scratch_slot
        self._cache_len = cache.max_len
        self._graphs = GraphCache(self._make_fn, self._example, self.target.device, self._graph_mode)

    def warm(self) -> None:
        """Capture the greedy graphs for every bucket and K at the full span (what a GPU uses); K = 0
        too: the step of rows with no room left to draft (choose_k)."""
        buckets = sorted({bucket_for(n, self.max_num_seqs) for n in range(1, self.max_num_seqs + 1)})
        S = span_for(1, self._cache_len, "full")
        self._graphs.warm([StepKey(b, k, S, False) for b in buckets for k in (0, *self.ks)])

    def choose_k(self, rows: list[StaticRow]) -> int:
        want = max(min(r.max_draft_len, self._last_cut.get(r.seq_id, self.max_draft_len) + 1) for r in rows)
        return 0 if want <= 0 else next(k for k in self.ks if k >= min(want, self.max_draft_len))

    @torch.inference_mode()
    def step(self, rows: list[StaticRow]) -> list[StaticOutcome]:
        if self._graphs is None:
            raise RuntimeError("DSParkProposer.bind(cache, scratch_slot) was not called")
        dev = self.target.device
        n = len(rows)
        B = bucket_for(n, self.max_num_seqs)
        K = self.choose_k(rows)
        sampled = any(not r.params.greedy for r in rows)
        coupled = any(r.seed is not None for r in rows)
        truncated = truncates([r.params for r in rows], self.target.cfg.vocab_size)
        S = span_for(max(r.length for r in rows) + K + 1, self._cache_len, self.span_set)
        fresh = [r for r in rows if r.seq_id not in self.eagle._seqs]
        h_fresh = torch.zeros(B, self.drafter.cfg.hidden_size, dtype=self.eagle.dtype, device=dev)
        if fresh:  # first step after the prefill: ingest the whole prompt eagerly (variable length)
            reqs = [DraftRequest(r.seq_id, r.token_ids, 0, r.params, r.generator, r.features, r.threshold)
                    for r in fresh]
            h = self.eagle.ingest(reqs)
            index = {r.seq_id: b for b, r in enumerate(rows)}
            h_fresh[[index[r.seq_id] for r in fresh]] = h
        pad = B - n
        states = [self.eagle._seqs[r.seq_id] for r in rows]
        new = [self._pending.get(r.seq_id, 0) for r in rows]
        for r, st, k in zip(rows, states, new):
            if st.valid + k != r.length:
                raise RuntimeError(f"dspark sequence {r.seq_id}: drafter holds {st.valid} + {k} pairs for "
                                   f"{r.length} committed tokens")
        long_ = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)
        thresholds = [self.eagle.threshold_for(DraftRequest(0, [], 0, r.params, threshold=r.threshold)) or 0.0
                      for r in rows]
        s = SamplingTensors.from_params([r.params for r in rows] + [None] * pad, dev)
        inputs = {
            "pending": long_([r.token_ids[-1] for r in rows] + [0] * pad),
            "lengths": long_([r.length for r in rows] + [0] * pad),
            "slots": long_([r.slot for r in rows] + [self._scratch] * pad),
            "dslots": long_([st.slot for st in states] + [self._dscratch] * pad),
            "dvalid": long_([st.valid for st in states] + [0] * pad),
            "n_new": long_(new + [0] * pad),
            "fresh": torch.tensor([k == 0 for k in new] + [True] * pad, device=dev),
            "h_fresh": h_fresh,
            "room": long_([r.max_draft_len for r in rows] + [0] * pad),
            "thresholds": torch.tensor(thresholds + [0.0] * pad, device=dev),
            "greedy": s.greedy, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
            "seeded": s.seeded, "seeds": s.seeds,
            "uniforms": uniforms_for([r.generator for r in rows] + [None] * pad, 2 * K + 1, dev),
        }
        out = to_host(self._graphs.run(StepKey(B, K, S, sampled, coupled, truncated), inputs)["out"])  # the one host sync
        outcomes = []
        for b, (r, st, k) in enumerate(zip(rows, states, new)):
            count, drafted = int(out[b, K + 1]), int(out[b, K + 2])
            st.valid += k
            self.eagle.cache.truncate(st.slot, st.valid)
            self._pending[r.seq_id] = count
            # Cut by the head (or the room) before K: probe one past it next step. Drafted all K:
            # K was the limit, not the head, so the next step may draft the full length.
            self._last_cut[r.seq_id] = drafted if drafted < K else self.max_draft_len
            outcomes.append(StaticOutcome(out[b, :count].tolist(), drafted, r.length + count, K))
        return outcomes

    # -- the static computation ------------------------------------------------------------------------
    def _example(self, key: StepKey) -> dict[str, torch.Tensor]:
        """All rows padded: warm-up and capture write only to the scratch slots."""
        dev, B = self.target.device, key.B
        zeros = lambda: torch.zeros(B, dtype=torch.long, device=dev)
        s = SamplingTensors.from_params([None] * B, dev)
        return {"pending": zeros(), "lengths": zeros(), "slots": zeros() + self._scratch,
                "dslots": zeros() + self._dscratch, "dvalid": zeros(), "n_new": zeros(),
                "fresh": torch.ones(B, dtype=torch.bool, device=dev),
                "h_fresh": torch.zeros(B, self.drafter.cfg.hidden_size, dtype=self.eagle.dtype, device=dev),
                "room": zeros(), "thresholds": torch.zeros(B, device=dev),
                "greedy": s.greedy, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                "seeded": s.seeded, "seeds": s.seeds,
                "uniforms": torch.ones(B, 2 * key.K + 1, device=dev)}

    def _make_fn(self, key: StepKey):
        return lambda x: self._compute(x, key)

    def _compute(self, x: dict[str, torch.Tensor], key: StepKey) -> dict[str, torch.Tensor]:
        B, K, S = key.B, key.K, key.S
        window = self.drafter.cfg.sliding_window
        embed_w, head = self.eagle._embed_w, self.head
        sampling = SamplingTensors(x["greedy"], x["temperature"], x["top_k"], x["top_p"], x["seeded"], x["seeds"])
        dslots, u = x["dslots"], x["uniforms"]  # u [B, 2K+1]: K draft draws, K acceptance tests, 1 draw
        # [B, K+1, V] the seeded rows' noise for the K drafted positions and the bonus one
        noise = step_noise(x["seeds"], x["lengths"], K, head.vocab) if key.seeded else None

        # 1. ingest the pairs the last step committed; f̂ of the pending token per row [B, D]
        toks = self._ftoks[dslots]  # [B, W]
        batch = chain_batch(toks, x["dvalid"], dslots, S, window)
        ingested = self.drafter(self._feats[dslots], F.embedding(toks, embed_w), batch, self._dkv)  # [B, W, D]
        D = ingested.shape[-1]
        at = (x["n_new"] - 1).clamp(min=0)[:, None, None].expand(B, 1, D)
        h = torch.where(x["fresh"][:, None], x["h_fresh"], ingested.gather(1, at)[:, 0])
        base = x["dvalid"] + x["n_new"]  # [B] = lengths: the pending token's pair index

        # 2. draft K tokens; 3. the calibrated cut
        drafted, qs, p_acc = [], [], []
        calibrate = self.drafter.calibration is not None
        for j in range(K):
            logits = head.logits(h)  # [B, Vd]: the target's LM head (Vd = V), or EAGLE-3's own
            pick = logits.argmax(-1)  # [B] draft ids
            if key.sampled:
                q_d = warp(logits[:, None], sampling, truncated=key.truncated)[:, 0]  # [B, Vd]
                pick = torch.where(sampling.greedy, pick, draw(q_d, u[:, j]))
                if noise is not None:
                    pick = torch.where(sampling.seeded, coupled_choice(q_d, head.draft_noise(noise[:, j])), pick)
                qs.append(head.expand(q_d))  # [B, V]: verification reads q over the target vocabulary
            if calibrate:
                scalars = CalibrationHead.scalar_features(logits, j)
                p_acc.append(torch.sigmoid(self.drafter.calibration(h, scalars)))  # [B]
            tok = head.to_target(pick)  # [B] target ids
            drafted.append(tok)
            if j < K - 1:  # the speculative pair (f̂, d_j) at base + j gives the next f̂
                b1 = chain_batch(tok[:, None], base + j, dslots, S, window)
                h = self.drafter(h[:, None], F.embedding(tok[:, None], embed_w), b1, self._dkv)[:, 0]
        lens = x["room"].clamp(max=K)
        if calibrate and K:
            thr = x["thresholds"][:, None]
            keep = (torch.stack(p_acc, 1).cumprod(1) >= thr) | (thr <= 0)  # [B, K]
            lens = torch.minimum(lens, keep.long().cumprod(1).sum(1))

        # 4. verify, accept, commit
        tokens = torch.cat([x["pending"][:, None], *[d[:, None] for d in drafted]], 1)  # [B, K+1]
        probs = torch.stack(qs, 1) if qs else None  # [B, K, V]
        res = target_step(self.target, self._kv,
                          StepInputs(tokens, x["lengths"], x["slots"], lens, sampling, u[:, K:], probs, noise),
                          S, sampled=key.sampled, hidden_layers=self.feature_layers, truncated=key.truncated)

        # 5. the committed pairs (f at each verified position, the token after it) for next step;
        # an EAGLE-3 drafter keeps them fused (g = fc of its layers), as its ingest reads them
        feats = torch.cat([res.hidden] + [res.layer_hidden[i] for i in self.feature_layers], -1)  # [B, K+1, (1+L)D]
        self._feats[dslots, :K + 1] = self.drafter.fuse(feats.to(self._feats.dtype))
        self._ftoks[dslots, :K + 1] = res.emitted
        return {"out": torch.cat([res.emitted, res.counts[:, None], lens[:, None]], 1)}  # [B, K+3]
