"""EAGLE drafting with a calibration head (DESIGN.md §3).

The draft backbone autoregresses at the feature level. With f_i the target's final (normed)
hidden state at token t_i, a "pair" i is (f_i, t_{i+1}):

    x_i  = fc([embed(t_{i+1}), f_i])           # [2D] → [D]; embed = the target's, frozen
    f̂_{i+1} = decoder_layer(x_i) at position i  # one Llama layer with its own KV cache
    logits  = target.lm_head(f̂_{i+1})          # predicts t_{i+2}; the LM head is the target's

Worked example: committed tokens t_0..t_4 (features f_0..f_4 known) and pending token t_5. The
drafter has pairs 0..4 cached; pair 4 = (f_4, t_5) gives f̂_5 → draft d_6; then pair 5 =
(f̂_5, d_6) gives f̂_6 → d_7, and so on. After verification the engine sends the true features
of the newly committed tokens; the speculative pairs (5, 6, …) are simply overwritten, since the
drafter's valid length only ever counts pairs built from true features.

The CALIBRATION HEAD reads, per drafted position, the draft hidden state, the drafter's top-1
probability, its entropy and the position, and predicts the probability that the target accepts
that token given the earlier ones were accepted. Drafting stops before the token at which the
predicted cumulative acceptance would fall below `threshold`, so the draft length adapts.

Checkpoints use the published EAGLE-1 layout (`fc.weight`, `fc.bias`, `layers.0.*`, a Llama-style
config.json); layer 0 has no input norm, as in EAGLE-1. Our own files add `calibration.*`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.core.kv_cache import KVCache
from specserve.core.masks import build_mask
from specserve.model.transformer import (CheckpointError, DecoderLayer, ForwardBatch, ModelConfig, Transformer,
                             fuse_projections)
from specserve.core.proposer import Draft, DraftRequest, ProposerDefaults, ProposerError, StepOutcome
from specserve.model.rope import RotaryEmbedding
from specserve.core.sampling import target_probs

CALIBRATION_POSITIONS = 8  # the position feature is j / CALIBRATION_POSITIONS


class CalibrationHead(nn.Module):
    """Per drafted position: P(target accepts it | the earlier draft tokens were accepted)."""

    def __init__(self, hidden_size: int, width: int = 64):
        super().__init__()
        self.proj = nn.Linear(hidden_size, width)
        self.scalars = nn.Linear(3, width)
        self.out = nn.Linear(width, 1)

    @staticmethod
    def scalar_features(logits: torch.Tensor, position: int) -> torch.Tensor:
        """logits [B, V] of the drafter at draft position `position` → [B, 3]."""
        logp = logits.float().log_softmax(-1)
        p = logp.exp()
        top1 = p.max(-1).values
        entropy = -(p * logp).sum(-1)
        pos = torch.full_like(top1, position / CALIBRATION_POSITIONS)
        return torch.stack([top1, entropy, pos], dim=-1)

    def forward(self, hidden: torch.Tensor, scalars: torch.Tensor) -> torch.Tensor:
        # hidden [B, D], scalars [B, 3] → acceptance logit [B] (sigmoid gives the probability)
        return self.out(F.silu(self.proj(hidden.float()) + self.scalars(scalars))).squeeze(-1)


class EagleDrafter(nn.Module):
    def __init__(self, cfg: ModelConfig, *, calibration: bool = True):
        super().__init__()
        if cfg.num_layers != 1:
            raise ValueError("the EAGLE backbone has exactly one decoder layer")
        self.cfg = cfg
        D = cfg.hidden_size
        self.fc = nn.Linear(2 * D, D, bias=True)
        self.layers = nn.ModuleList([DecoderLayer(cfg, 0)])
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE-1: layer 0 has no input norm
        self.rotary = RotaryEmbedding(cfg.rope)
        self.calibration = CalibrationHead(D) if calibration else None

    def forward(self, features: torch.Tensor, next_embeds: torch.Tensor, batch: ForwardBatch,
                cache: KVCache | None) -> torch.Tensor:
        # features [B, T, D] (f_i), next_embeds [B, T, D] (embed(t_{i+1})) → f̂_{i+1} [B, T, D]
        x = self.fc(torch.cat([next_embeds, features], dim=-1))
        cos, sin = self.rotary(batch.positions, x.dtype)
        return self.layers[0](x, cos, sin, batch, cache)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        c = self.cfg
        w = self.fc.weight
        return KVCache(num_layers=1, num_slots=num_slots, num_kv_heads=c.num_kv_heads, max_len=max_len,
                       head_dim=c.head_dim, dtype=w.dtype, device=w.device)


# -- checkpoints ---------------------------------------------------------------------------------

def _eagle_config(target_cfg: ModelConfig, raw: dict) -> ModelConfig:
    cfg = ModelConfig.from_hf({**raw, "num_hidden_layers": 1,
                               "model_type": raw.get("model_type", target_cfg.model_type)})
    if cfg.hidden_size != target_cfg.hidden_size:
        raise CheckpointError(f"drafter hidden_size {cfg.hidden_size} != target's {target_cfg.hidden_size}")
    return cfg


def load_eagle(path: str | Path, target: Transformer, dtype: torch.dtype | None = None) -> EagleDrafter:
    """Load an EAGLE-1-layout drafter (safetensors or pytorch_model.bin) for `target`, computing
    in `dtype` (default: the target's). The drafter's precision never affects what is emitted
    (the target verifies every token), only how often its drafts are accepted."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"EAGLE drafter {path} has no config.json")
    raw = json.loads(cfg_file.read_text())
    cfg = _eagle_config(target.cfg, raw)
    st, bin_ = path / "model.safetensors", path / "pytorch_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file
            state = load_file(str(st))
        elif bin_.is_file():
            state = torch.load(str(bin_), map_location="cpu", weights_only=True)
        else:
            raise CheckpointError(f"EAGLE drafter {path} has neither model.safetensors nor pytorch_model.bin")
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 — any unreadable file is a checkpoint error here
        raise CheckpointError(f"cannot read EAGLE weights in {path}: {e}") from None
    state = fuse_projections(state)
    state.pop("embed_tokens.weight", None)  # some EAGLE-1 files carry a copy; ours is the target's
    state.pop("layers.0.input_layernorm.weight", None)
    has_calib = any(k.startswith("calibration.") for k in state)
    drafter = EagleDrafter(cfg, calibration=has_calib)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"EAGLE drafter {path}: missing {missing[:4]}, unexpected {unexpected[:4]}")
    drafter = drafter.to(device=target.device, dtype=dtype or target.dtype)
    if drafter.calibration is not None:
        drafter.calibration.float()  # tiny, and it computes in fp32 (its inputs are upcast)
    return drafter.eval().requires_grad_(False)


def save_eagle(drafter: EagleDrafter, target_config: dict, path: str | Path) -> None:
    """Write the drafter in the EAGLE-1 layout (separate q/k/v, gate/up) plus calibration.*."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = drafter.cfg
    state = {}
    for k, v in drafter.state_dict().items():
        v = v.detach().to(torch.float32).contiguous()
        if k.endswith("qkv_proj.weight") or k.endswith("qkv_proj.bias"):
            kind = k.rsplit(".", 1)[1]
            prefix = k[: -len(f"qkv_proj.{kind}")]
            q, kk, vv = v.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                 c.num_kv_heads * c.head_dim])
            state.update({f"{prefix}q_proj.{kind}": q.contiguous(), f"{prefix}k_proj.{kind}": kk.contiguous(),
                          f"{prefix}v_proj.{kind}": vv.contiguous()})
        elif k.endswith("gate_up_proj.weight"):
            gate, up = v.chunk(2)
            prefix = k[: -len("gate_up_proj.weight")]
            state.update({f"{prefix}gate_proj.weight": gate.contiguous(), f"{prefix}up_proj.weight": up.contiguous()})
        else:
            state[k] = v
    save_file(state, str(path / "model.safetensors"))
    cfg = {**target_config, "num_hidden_layers": 1, "architectures": ["EagleDrafter"],
           "specserve_drafter": "eagle"}
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# -- the proposer ----------------------------------------------------------------------------------

@dataclass
class _SeqState:
    slot: int
    valid: int  # drafter cache entries built from TRUE target features (pairs 0..valid-1)


class EagleProposer(ProposerDefaults):
    """Fused EAGLE proposer: the drafter runs in the engine's process, batched over sequences."""

    name = "eagle"
    needs_features = True

    def __init__(self, drafter: EagleDrafter, target: Transformer, *, max_num_seqs: int,
                 max_model_len: int, max_draft_len: int = 8, threshold: float | None = 0.3,
                 name: str = "eagle"):
        """threshold: stop drafting when the predicted cumulative acceptance falls below it
        (None, or a drafter without a calibration head: always draft max_draft_len)."""
        self.name = name
        self.drafter, self.target = drafter, target
        self.max_draft_len = max_draft_len
        self.threshold = threshold  # _threshold() ignores it for a drafter without a calibration head
        self.cache = drafter.new_cache(max_num_seqs, max_model_len + max_draft_len + 1)
        self._seqs: dict[int, _SeqState] = {}
        # The drafter reuses the target's embedding and LM head; a drafter computing in another
        # dtype (bf16 drafting for an fp32 target) gets its own cast copy of the two.
        self.dtype = drafter.fc.weight.dtype
        same = self.dtype == target.dtype
        self._embed_w = target.embed_tokens.weight if same else target.embed_tokens.weight.to(self.dtype)
        self._head_w = target.lm_head.weight if same else target.lm_head.weight.to(self.dtype)

    # ingest the true features of newly committed tokens; returns the last f̂ per row [B, D]
    def _ingest(self, requests: list[DraftRequest]) -> torch.Tensor:
        rows, starts, counts = [], [], []
        for r in requests:
            st = self._seqs.get(r.seq_id)
            if st is None:
                if self.cache.num_free == 0:
                    raise ProposerError("no free drafter slot")
                st = self._seqs[r.seq_id] = _SeqState(self.cache.allocate(), 0)
            committed = len(r.token_ids) - 1  # the last token is pending: no feature yet
            n = 0 if r.features is None else r.features.shape[0]
            if n == 0 or st.valid + n != committed:
                raise ProposerError(f"sequence {r.seq_id}: drafter holds {st.valid} pairs, got {n} new "
                                    f"features for {committed} committed tokens; cannot re-prime")
            rows.append(st)
            starts.append(st.valid)
            counts.append(n)
        # Rows are padded to the longest in their forward, and padding is written to the cache
        # too: a sequence's first ingest (its whole prompt, from offset 0) must not share a forward
        # with a long-running sequence, whose offset plus that padding would run past the pool.
        last = torch.zeros(len(requests), self.drafter.cfg.hidden_size, dtype=self.dtype,
                           device=self.target.device)
        for group in ([b for b, s in enumerate(starts) if s == 0], [b for b, s in enumerate(starts) if s > 0]):
            if group:
                last[group] = self._ingest_rows([requests[b] for b in group], [rows[b] for b in group],
                                                [starts[b] for b in group], [counts[b] for b in group])
        return last  # [B, D]

    def _ingest_rows(self, requests, rows, starts, counts) -> torch.Tensor:
        T, B = max(counts), len(requests)
        D = self.drafter.cfg.hidden_size
        feats = torch.zeros(B, T, D, dtype=self.dtype, device=self.target.device)
        nxt = torch.zeros(B, T, dtype=torch.long)
        for b, (r, n) in enumerate(zip(requests, counts)):
            feats[b, :n] = r.features
            committed = len(r.token_ids) - 1
            nxt[b, :n] = torch.tensor(r.token_ids[committed - n + 1: committed + 1])  # t_{i+1}
        parents = [list(range(-1, n - 1)) for n in counts]
        hidden = self._run(feats, nxt, [st.slot for st in rows], starts, parents, T)
        for st, n in zip(rows, counts):
            st.valid += n
            self.cache.truncate(st.slot, st.valid)
        return hidden[torch.arange(B), torch.tensor(counts) - 1]  # [B, D]

    def _run(self, feats, nxt, slots, starts, parents, T) -> torch.Tensor:
        dev = self.target.device
        mask, positions = build_mask(starts, parents, T, sliding_window=self.drafter.cfg.sliding_window)
        batch = ForwardBatch(nxt.to(dev), positions.to(dev), torch.tensor(slots, device=dev),
                             torch.tensor(starts, device=dev), mask.to(dev))
        embeds = F.embedding(batch.tokens, self._embed_w)
        return self.drafter(feats, embeds, batch, self.cache)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        if not requests:
            return []
        h = self._ingest(requests)  # [B, D] f̂ of each row's pending token
        B = len(requests)
        limits = [min(r.max_draft_len, self.max_draft_len) for r in requests]
        tokens: list[list[int]] = [[] for _ in range(B)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]   # greedy rows: log q of the argmax (confidence)
        active = [lim > 0 for lim in limits]
        # Per-row stop threshold (a request may override the proposer's); 0 or None = fixed length.
        thresholds = [self._threshold(r) for r in requests]
        calibrate = any(thresholds)
        cum = [1.0] * B
        slots = [self._seqs[r.seq_id].slot for r in requests]
        base = [self._seqs[r.seq_id].valid for r in requests]
        for j in range(max(limits, default=0)):
            if not any(active):
                break
            logits = F.linear(h, self._head_w).float()  # [B, V], the target's LM head
            p_accept = self._calibrate(h, logits, j) if calibrate else None
            picked = []
            for b, r in enumerate(requests):
                if not active[b]:
                    picked.append(0)
                    continue
                if r.generator is None:
                    tok, q = int(logits[b].argmax()), None
                    lp = float(logits[b, tok] - logits[b].logsumexp(-1))
                else:
                    q = target_probs(logits[b:b + 1], r.params)[0]
                    tok = int(torch.multinomial(q, 1, generator=r.generator))
                if p_accept is not None and thresholds[b]:
                    cum[b] *= float(p_accept[b])
                    if cum[b] < thresholds[b]:
                        active[b] = False
                        picked.append(0)
                        continue
                tokens[b].append(tok)
                if q is not None:
                    probs[b].append(q)
                else:
                    logps[b].append(lp)
                picked.append(tok)
                if len(tokens[b]) >= limits[b]:
                    active[b] = False
            if not any(active):
                break
            # Speculative pair (f̂, d) at offset base + j; overwritten once true features arrive.
            nxt = torch.tensor(picked)[:, None]
            starts = [bs + j for bs in base]
            h = self._run(h[:, None], nxt, slots, starts, [[-1]] * B, 1)[:, 0]
        return [Draft.chain(t, torch.stack(p) if p else None, lp if len(lp) == len(t) else None)
                for t, p, lp in zip(tokens, probs, logps)]

    def _threshold(self, r: DraftRequest) -> float | None:
        if self.drafter.calibration is None:
            return None
        return self.threshold if r.threshold is None else r.threshold

    def _calibrate(self, h: torch.Tensor, logits: torch.Tensor, j: int) -> torch.Tensor:
        scalars = CalibrationHead.scalar_features(logits, j)
        return torch.sigmoid(self.drafter.calibration(h, scalars))  # [B]

    def observe(self, outcomes: list[StepOutcome]) -> None:
        pass  # rollback is implicit: `valid` only counts pairs built from true features

    def release(self, seq_id: int) -> None:
        st = self._seqs.pop(seq_id, None)
        if st is not None:
            self.cache.release(st.slot)
