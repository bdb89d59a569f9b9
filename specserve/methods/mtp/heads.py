"""MTP heads: k residual blocks on the target's final hidden state, each predicting one more token.

Which token each head predicts (the engine's bookkeeping, specserve/core/engine.py): the features a
proposer receives are the target's final hidden states of COMMITTED tokens (their KV is in the
cache). The sequence's last token is PENDING: emitted, but with no KV and no feature yet. With
t the last committed position, f_t its feature and token t+1 the pending token:

    target.lm_head(f_t)              predicts t+1  (= the pending token, already known)
    lm_head(head_j(f_t)), j = 0..k-1 predicts t+2+j (the j-th token after the pending one)

So a step drafts the chain d_{t+2} .. d_{t+1+k} hanging off the pending token, from one row of
features. Worked example: prompt t_0..t_4 → prefill commits t_0..t_4 and emits t_5 (pending);
the proposer gets f_0..f_4, keeps f_4, and head 0 drafts t_6, head 1 t_7, … After verification
the engine sends the features of the newly committed tokens (t_5 plus the accepted drafts); the
last of those rows is the new f_t.

ForwardOutput.hidden (what the engine hands proposers) is AFTER the target's final RMSNorm, i.e.
already in the space the LM head reads. A head is therefore `h_j = f + down_j(silu(up_j(f)))`
and its logits are `target.lm_head(h_j)`: the final norm is not applied again (it would scale
by its weight twice). `down_j` starts at zero, so an untrained head is the target's own next-token
prediction. The LM head is the target's, frozen, and not stored with the heads.

The proposer drafts a CHAIN: the top-1 token of each head (greedy requests), or one draw from
each head's warped distribution (sampled requests; lossless because `probs` carries each head's
distribution q, and the verifier accepts d with min(1, p/q)). `probs` is also filled for greedy
requests (the head's temperature-free softmax) so a caller can read log q(token) as a confidence;
the verifier treats a greedy draft's probs as irrelevant (greedy verification is argmax match).
A chain, not a tree: the heads are independent given f_t, so a tree of head-wise alternatives
would be a product of marginals whose deeper nodes are rarely right (head 3's top-1 agreement is
well below head 0's, see models/demo/mtp/README.md); the arbiter (the `mtp` method) builds trees
from several proposers' chains instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model.transformer import CheckpointError, Transformer, read_drafter_weights
from specserve.core.proposer import Draft, DraftRequest, ProposerDefaults, ProposerError, StepOutcome
from specserve.core.sampling import target_probs

FORMAT = "specserve-mtp-heads"


class ResidualHead(nn.Module):
    """x + down(silu(up(x))): one head's map from f_t to the hidden state its token is read from."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.up = nn.Linear(hidden_size, intermediate_size)
        self.down = nn.Linear(intermediate_size, hidden_size)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.silu(self.up(x)))


@dataclass(frozen=True)
class MTPConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    intermediate_size: int = 512
    # What the heads were trained for: refused for any other target (a different model's
    # features mean nothing to them). The target folder's config.json is compared on these.
    target_model_type: str = ""
    target_num_layers: int = 0

    def to_json(self) -> dict:
        # specserve_drafter: how `specserve serve` recognises the folder beside the target (cli.py)
        return {"format": FORMAT, "specserve_drafter": "mtp", **self.__dict__}


class MTPHeads(nn.Module):
    """features [n, D] (the target's final, normed hidden state) → logits [n, k, V]."""

    def __init__(self, cfg: MTPConfig, lm_head_weight: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        if tuple(lm_head_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"LM head weight {tuple(lm_head_weight.shape)} does not match heads "
                             f"({cfg.vocab_size}, {cfg.hidden_size})")
        self.heads = nn.ModuleList(ResidualHead(cfg.hidden_size, cfg.intermediate_size)
                                   for _ in range(cfg.num_heads))
        # The target's LM head, frozen and shared: a buffer, so it is neither trained nor saved.
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)

    def hidden(self, features: torch.Tensor) -> torch.Tensor:
        # features [n, D] → [n, k, D]
        return torch.stack([h(features) for h in self.heads], dim=1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # features [n, D] → logits [n, k, V], fp32 (sampling and argmax want full precision)
        return F.linear(self.hidden(features), self.lm_head_weight).float()


# -- files -----------------------------------------------------------------------------------------

def _target_fields(model: Transformer) -> dict:
    c = model.cfg
    return {"hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "target_model_type": c.model_type,
            "target_num_layers": c.num_layers}


def save_mtp_heads(heads: MTPHeads, folder: str | Path, *, dtype: torch.dtype = torch.float32) -> None:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in heads.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(heads.cfg.to_json(), indent=2) + "\n")


def load_mtp_heads(folder: str | Path, model: Transformer, dtype: torch.dtype | None = None) -> MTPHeads:
    """MTP heads from `folder` (config.json + model.safetensors) for the target `model`, computing
    in `dtype` (default: the target's). Refuses heads trained for another target."""
    folder = Path(folder)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"MTP heads {folder} have no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
    if raw.get("format") != FORMAT:
        raise CheckpointError(f"{folder} is not an MTP heads folder (config.json format is "
                              f"{raw.get('format')!r}, expected {FORMAT!r})")
    cfg = MTPConfig(**{k: v for k, v in raw.items() if k not in ("format", "specserve_drafter")})
    want = _target_fields(model)
    differ = [f"{k} {getattr(cfg, k)!r} (target: {v!r})" for k, v in want.items() if getattr(cfg, k) != v]
    if differ:
        raise CheckpointError(f"MTP heads {folder} were made for another target: {', '.join(differ)}")
    state = read_drafter_weights(folder, f"the MTP heads folder {folder}")
    dtype = dtype or model.dtype
    heads = MTPHeads(cfg, model.lm_head.weight.to(dtype))
    missing, unexpected = heads.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "lm_head_weight"]
    if missing or unexpected:
        raise CheckpointError(f"MTP heads {folder}: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return heads.to(device=model.device, dtype=dtype).eval().requires_grad_(False)


def export_mtp_onnx(heads: MTPHeads, path: str | Path, *, opset: int = 17) -> None:
    """ONNX graph features [n, D] (fp32) → logits [n, k, V] (fp32), n dynamic; the LM head is
    embedded as a constant (the remote placement has no target weights to share)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    import copy

    module = copy.deepcopy(heads).float().eval()  # the caller's heads keep their dtype
    example = torch.zeros(2, heads.cfg.hidden_size)
    torch.onnx.export(module, (example,), str(path), input_names=["features"], output_names=["logits"],
                      dynamic_axes={"features": {0: "n"}, "logits": {0: "n"}}, opset_version=opset,
                      dynamo=False)


@torch.inference_mode()
def head_agreement(target: Transformer, heads: MTPHeads, rows: list[list[int]]) -> list[float]:
    """Teacher-forced top-1 agreement of each head with the target on token rows: over every
    position t with t+1+k < T, argmax lm_head(head_j(f_t)) == argmax target.logits(f_{t+1+j})."""
    k = heads.cfg.num_heads
    hits = torch.zeros(k)
    total = 0
    for row in rows:
        T = len(row)
        if T <= k + 1:
            continue
        from specserve.model.transformer import ForwardBatch  # noqa: PLC0415

        x = torch.tensor([row], device=target.device)
        pos = torch.arange(T, device=target.device)[None]
        zero = torch.zeros(1, dtype=torch.long, device=target.device)
        mask = torch.ones(T, T, dtype=torch.bool, device=target.device).tril()[None]
        f = target.forward(ForwardBatch(x, pos, zero, zero, mask), cache=None).hidden[0]  # [T, D]
        best = target.logits(f).argmax(-1)  # [T]: the target's prediction of token t+1
        n = T - 1 - k
        guess = heads(f[:n].to(heads.lm_head_weight.dtype)).argmax(-1)  # [n, k]
        ahead = torch.arange(n, device=f.device)[:, None] + 1 + torch.arange(k, device=f.device)[None]
        hits += (guess == best[ahead]).float().sum(0).cpu()
        total += n
    return [round(float(h) / max(1, total), 4) for h in hits]


# -- the proposer ----------------------------------------------------------------------------------

@dataclass
class _SeqState:
    feature: torch.Tensor  # [D] f_t of the last committed position t
    committed: int         # t + 1: how many committed tokens the proposer has seen features for


class MTPHeadsProposer(ProposerDefaults):
    """Fused MTP-heads proposer: one batched heads forward per step, no per-sequence KV."""

    name = "mtp_heads"
    needs_features = True

    def __init__(self, heads: MTPHeads, *, max_draft_len: int = 8, name: str = "mtp_heads"):
        self.heads, self.name = heads, name
        self.max_draft_len = min(max_draft_len, heads.cfg.num_heads)
        self._seqs: dict[int, _SeqState] = {}
        self.dtype = heads.lm_head_weight.dtype

    def _last_features(self, requests: list[DraftRequest]) -> tuple[torch.Tensor, list[_SeqState]]:
        """[B, D] f_t per request and the states to store. Stores nothing (a raise here leaves the
        engine holding the features, which it resends with the next call).

        The engine's features are those of the tokens committed since the last call, so their last
        row is always f_t of the newest committed token: only that row is kept, and a call whose
        features were lost upstream (a composite proposer that failed after taking them) does not
        poison the next one. Without new features the stored row must already be the newest."""
        rows, states = [], []
        for r in requests:
            committed = len(r.token_ids) - 1  # the last token is pending: no feature yet
            if r.features is not None and r.features.shape[0] > 0:
                st = _SeqState(r.features[-1].to(self.dtype), committed)
            else:
                st = self._seqs.get(r.seq_id)
                if st is None or st.committed != committed:
                    held = "nothing" if st is None else f"the feature of position {st.committed - 1}"
                    raise ProposerError(f"sequence {r.seq_id}: no feature for its last committed position "
                                        f"{committed - 1} (the proposer holds {held})")
            rows.append(st.feature)
            states.append(st)
        return torch.stack(rows), states

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        if not requests:
            return []
        feats, states = self._last_features(requests)  # [B, D]
        logits = self.heads(feats.to(self.heads.lm_head_weight.device))  # [B, k, V]
        drafts = []
        for b, r in enumerate(requests):
            n = min(r.max_draft_len, self.max_draft_len)
            if n <= 0:
                drafts.append(Draft.empty())
                continue
            rows = logits[b, :n]  # [n, V]
            if r.generator is None:
                # Greedy: top-1 per head; probs = the plain softmax, for confidence only.
                probs = rows.softmax(-1)
                tokens = rows.argmax(-1).tolist()
            else:
                probs = target_probs(rows, r.params)  # [n, V] each head's warped distribution
                tokens = [int(torch.multinomial(probs[j], 1, generator=r.generator)) for j in range(n)]
            drafts.append(Draft.chain(tokens, probs))
        for r, st in zip(requests, states):
            self._seqs[r.seq_id] = st
        return drafts

    def observe(self, outcomes: list[StepOutcome]) -> None:
        pass  # no speculative state: the next call's features say what was committed

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
