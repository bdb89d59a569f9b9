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
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.core.forward import ForwardBatch
from specserve.model.transformer import CheckpointError, Transformer, read_drafter_weights

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
