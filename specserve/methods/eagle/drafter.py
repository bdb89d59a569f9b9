"""The EAGLE drafter: one decoder layer on the target's features, and a calibration head (docs/design.md, 'The methods').

The draft backbone autoregresses at the feature level. With f_i the target's final (normed)
hidden state at token t_i, a "pair" i is (f_i, t_{i+1}):

    x_i  = fc([embed(t_{i+1}), f_i])           # [2D] → [D]; embed = the target's, frozen
    f̂_{i+1} = decoder_layer(x_i) at position i  # one Llama layer with its own KV cache
    logits  = target.lm_head(f̂_{i+1})          # predicts t_{i+2}; the LM head is the target's

The CALIBRATION HEAD reads, per drafted position, the draft hidden state, the drafter's top-1
probability, its entropy and the position, and predicts the probability that the target accepts
that token given the earlier ones were accepted (the proposer, proposer.py, cuts drafts with it);
it lives in calibration.py, shared with the EAGLE-3 drafter.

Checkpoints use the published EAGLE-1 layout (`fc.weight`, `fc.bias`, `layers.0.*`, a Llama-style
config.json); layer 0 has no input norm, as in EAGLE-1. Our own files add `calibration.*`.
The EAGLE-3 variant (fused target layers, its own reduced-vocabulary LM head) is eagle3.py;
load_eagle loads either layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specserve.core.forward import ForwardBatch
from specserve.core.kv_cache import KVCache
from specserve.model.rope import RotaryEmbedding
from specserve.model.transformer import CheckpointError, DecoderLayer, ModelConfig, Transformer, fuse_projections
from specserve.methods.eagle.calibration import CALIBRATION_POSITIONS, CalibrationHead  # noqa: F401 — re-exported
from specserve.methods.eagle.eagle3 import Eagle3Drafter, build_eagle3, eagle3_config_fields


class EagleDrafter(nn.Module):
    feature_layers: tuple[int, ...] = ()   # EAGLE-1 reads the final hidden state only

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

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return features  # [B, T, D]: true features enter a pair as they are (EAGLE-3 fuses them)

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


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    st, bin_ = path / "model.safetensors", path / "pytorch_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file
            return load_file(str(st))
        if bin_.is_file():
            return torch.load(str(bin_), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 — any unreadable file is a checkpoint error here
        raise CheckpointError(f"cannot read EAGLE weights in {path}: {e}") from None
    raise CheckpointError(f"EAGLE drafter {path} has neither model.safetensors nor pytorch_model.bin")


def is_eagle3_state(state: dict) -> bool:
    return any(k.startswith(("midlayer.", "model.midlayer.")) for k in state)


def is_eagle3_folder(path: str | Path) -> bool:
    """Whether a drafter folder holds the EAGLE-3 layout, from its weights' names (a safetensors
    header read, no tensors) — what deployment decisions need before any weight is loaded. A
    folder with no weights is not (loading it says what is missing)."""
    path = Path(path)
    st = path / "model.safetensors"
    if not st.is_file() and not (path / "pytorch_model.bin").is_file():
        return False
    if st.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(st), framework="pt") as f:
                return is_eagle3_state(dict.fromkeys(f.keys()))
        except Exception as e:  # noqa: BLE001 — any unreadable file is a checkpoint error here
            raise CheckpointError(f"cannot read EAGLE weights in {path}: {e}") from None
    return is_eagle3_state(_read_state(path))


def load_eagle(path: str | Path, target: Transformer, dtype: torch.dtype | None = None) -> "EagleDrafter | Eagle3Drafter":
    """Load an EAGLE drafter (safetensors or pytorch_model.bin) for `target`, computing in
    `dtype` (default: the target's): the EAGLE-1 layout (EagleDrafter) or, when its weights
    carry `midlayer.*`, the EAGLE-3 layout (eagle3.Eagle3Drafter). The drafter's precision never
    affects what is emitted (the target verifies every token), only how often its drafts are
    accepted."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"EAGLE drafter {path} has no config.json")
    raw = json.loads(cfg_file.read_text())
    cfg = _eagle_config(target.cfg, raw)
    state = fuse_projections(_read_state(path))
    if is_eagle3_state(state):
        try:
            drafter = build_eagle3(cfg, raw, target.cfg, state)
        except CheckpointError as e:
            raise CheckpointError(f"EAGLE drafter {path}: {e}") from None
    else:
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


def save_eagle(drafter: "EagleDrafter | Eagle3Drafter", target_config: dict, path: str | Path,
               dtype: torch.dtype = torch.float32) -> None:
    """Write the drafter in its public layout (separate q/k/v, gate/up) plus calibration.*: the
    EAGLE-1 one for an EagleDrafter, the EAGLE-3 one (with d2t, t2d) for an Eagle3Drafter.
    dtype: the stored weights' (bfloat16 halves a committed drafter; load_eagle casts to the
    drafting dtype either way). The calibration head is always stored in fp32, as it computes."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = drafter.cfg
    state = {}
    for k, v in drafter.state_dict().items():
        v = v.detach().contiguous()
        if v.is_floating_point():   # d2t (int64) and t2d (bool) keep their dtypes
            v = v.to(torch.float32 if k.startswith("calibration.") else dtype)
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
    if isinstance(drafter, Eagle3Drafter):
        cfg = {**cfg, **eagle3_config_fields(drafter), "specserve_drafter": "eagle3"}
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
