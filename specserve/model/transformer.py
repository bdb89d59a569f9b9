"""The target transformer: Llama, Qwen2 and Mistral families, from a Hugging Face checkpoint folder.

One readable file in the spirit of gpt-fast / nanoGPT: fixed-size cache, explicit state. Every
forward takes the tokens, their RoPE positions, the cache slots and write offsets, and the
attention mask as arguments — nothing is stashed on the module between calls.

Shapes: B rows, T new tokens per row, S keys visible (the span of cache read), D hidden size,
H query heads, Hkv key/value heads, hd head dim, V vocabulary.

Tensor parallelism (tensor_parallel.py) shards this same model: built with a Shard of N ranks,
each attention keeps H/N query and Hkv/N KV heads (`heads`, `kv_heads` below: the counts on
this rank), each MLP I/N features, and o_proj / down_proj end in one all-reduce each.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.core.forward import CacheIO, ForwardBatch, ForwardOutput
from specserve.model.invariant_attention import PER_QUERY_MAX_QUERIES, QueryPlan, per_query_attention, query_plan
from specserve.core.kv_cache import KVCache
from specserve.model.q4_checkpoint import (KEPT_KINDS, Q4_GROUP_SIZE, KeptRecordError, Q4Weights, int4_linear,
                                           is_kept, take_stored)
from specserve.model.rope import RopeSpec, RotaryEmbedding, apply_rope
from specserve.model.tensor_parallel import WHOLE, Shard, check_divisible, shard_state

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


class CheckpointError(ValueError):
    """The checkpoint folder cannot be served: unsupported architecture, missing or corrupt file."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2 always; Llama when configured)
    sliding_window: int | None = None  # Mistral: attend to at most this many previous positions
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        mtype = cfg.get("model_type")
        if mtype not in SUPPORTED_MODEL_TYPES:
            arch = cfg.get("architectures")
            raise CheckpointError(
                f"unsupported architecture: model_type={mtype!r} architectures={arch!r}; "
                f"specserve serves {', '.join(SUPPORTED_MODEL_TYPES)} checkpoints")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"unsupported hidden_act {act!r} (only 'silu')")
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            eos_ids = _token_ids(cfg.get("eos_token_id"))
            window = cfg.get("sliding_window")
            if mtype == "qwen2" and not cfg.get("use_sliding_window", False):
                window = None  # Qwen2 configs carry a window they do not use unless asked to
            return cls(
                model_type=mtype,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=RopeSpec.from_hf(cfg, head_dim),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=mtype == "qwen2" or bool(cfg.get("attention_bias", False)),
                sliding_window=int(window) if window else None,
                eos_token_ids=eos_ids,
                bos_token_id=cfg.get("bos_token_id"),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json lacks required key {e.args[0]!r}") from None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementation, so bf16 weights match it.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    # The ONNX exporter cannot lower SDPA's enable_gqa; export sets this to repeat k/v heads instead.
    expand_kv_heads = False

    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard = WHOLE):
        super().__init__()
        self.layer, self.cfg, self.shard = layer, cfg, shard
        # This rank's heads (all of them when not sharded).
        self.heads, self.kv_heads = cfg.num_heads // shard.world, cfg.num_kv_heads // shard.world
        D, H, Hkv, hd = cfg.hidden_size, self.heads, self.kv_heads, cfg.head_dim
        # q, k, v fused into one matmul (a decode step is small: fewer, larger matmuls win).
        self.qkv_proj = nn.Linear(D, (H + 2 * Hkv) * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * hd, D, bias=False)  # row-parallel when sharded (no bias to split)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                cache: CacheIO | None, plan: QueryPlan | None = None) -> torch.Tensor:
        """plan: per-query attention's calls (invariant_attention.py); None: batched SDPA."""
        B, T, _ = x.shape
        H, Hkv, hd = self.heads, self.kv_heads, self.cfg.head_dim
        qkv = self.qkv_proj(x)  # [B, T, (H + 2 Hkv) hd]
        qk, v = qkv.split([(H + Hkv) * hd, Hkv * hd], dim=-1)
        # RoPE on q's and k's heads in one pass: the same elementwise arithmetic (the same bits)
        # in half the operator calls, which a small model's decode step is made of on a CPU.
        qk = apply_rope(qk.view(B, T, H + Hkv, hd).transpose(1, 2), cos, sin)  # [B, H + Hkv, T, hd]
        q, k = qk[:, :H], qk[:, H:]                 # [B, H, T, hd], [B, Hkv, T, hd]
        v = v.view(B, T, Hkv, hd).transpose(1, 2)  # [B, Hkv, T, hd]
        if cache is None:
            out = self._attend(q, k, v, batch.mask, plan)
        else:
            cache.write(self.layer, batch.slots, batch.starts, k, v)
            # per-query: the span its calls lay out (each a power of two past its block's end)
            S = plan.read_span if plan is not None else batch.mask.shape[-1]
            # One read per run of consecutive slots: each is a view of the pool, where one read of
            # scattered slots would copy [B, Hkv, S, hd] per layer (ForwardBatch.slot_runs).
            runs = batch.slot_runs or ((0, B),)
            out = torch.cat([self._attend(q[a:b], *cache.read(self.layer, batch.slots[a:b], S), batch.mask[a:b],
                                          plan and plan.rows(a, b)) for a, b in runs]) if len(runs) > 1 else \
                self._attend(q, *cache.read(self.layer, batch.slots, S), batch.mask, plan)   # k, v [B, Hkv, S, hd]
        # [B, T, D]: this rank's heads' share of o_proj, summed over the ranks
        return self.shard.all_reduce(self.o_proj(out.transpose(1, 2).reshape(B, T, H * hd)))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                plan: QueryPlan | None) -> torch.Tensor:
        """q [B, H, T, hd], k, v [B, Hkv, S, hd], mask [B, T, S] (bool, or additive in q's dtype) → [B, H, T, hd]."""
        gqa = self.kv_heads != self.heads
        if plan is not None:
            return per_query_attention(q, k, v, plan)
        if gqa and self.expand_kv_heads:
            rep = self.heads // self.kv_heads
            k, v, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=gqa)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard = WHOLE):
        super().__init__()
        self.shard = shard
        width = cfg.intermediate_size // shard.world  # I/N: this rank's features
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [B, T, I/N] each
        return self.shard.all_reduce(self.down_proj(F.silu(gate) * up))  # [B, T, D]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard = WHOLE):
        super().__init__()
        self.self_attn = Attention(cfg, layer, shard)
        self.mlp = MLP(cfg, shard)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, batch, cache, plan=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, cache, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    # Per-query attention (model/invariant_attention.py): set by the engine's builder when the
    # served target is one whose steps are row-invariant with it (serving/build.py).
    per_query_attention = False

    def __init__(self, cfg: ModelConfig, shard: Shard = WHOLE):
        super().__init__()
        check_divisible(cfg, shard.world)
        self.cfg, self.shard = cfg, shard
        # Replicated when sharded. Built from an empty weight, then initialised as nn.Embedding
        # would (the same draws), except on "meta" (load_model: the checkpoint fills it): there
        # normal_ goes through torch._refs, whose first call imports torch._dynamo, 2 s of every
        # server stub's start that nothing else in serving needs.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        if not self.embed_tokens.weight.is_meta:
            nn.init.normal_(self.embed_tokens.weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, shard) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.rope)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        c = self.cfg
        # Sharded: this rank's Hkv/N KV heads only.
        return KVCache(num_layers=c.num_layers, num_slots=num_slots, num_kv_heads=c.num_kv_heads // self.shard.world,
                       max_len=max_len, head_dim=c.head_dim, dtype=self.dtype, device=self.device)

    def forward(self, batch: ForwardBatch, cache: CacheIO | None,
                hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        x = self.embed_tokens(batch.tokens)  # [B, T, D]
        cos, sin = self.rotary(batch.positions, x.dtype)
        # Per-query attention (--per-query-attention) for decode and verify widths; a wider
        # forward is a prompt prefill, the same call in a plain and a speculative run.
        per_query = self.per_query_attention and batch.tokens.shape[1] <= PER_QUERY_MAX_QUERIES
        plan = query_plan(batch.mask, batch.positions, self.dtype) if per_query else None
        if plan is None:
            # The boolean mask as SDPA's additive one, made once: SDPA converts a boolean mask to
            # exactly this (0 where allowed, -inf elsewhere, in the query's dtype) in every layer.
            batch = replace(batch, mask=additive_mask(batch.mask, x.dtype))
        layer_hidden: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, batch, cache, plan)
            if i in hidden_layers:
                layer_hidden[i] = x
        return ForwardOutput(hidden=self.norm(x), layer_hidden=layer_hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., D] → logits [..., V] in fp32 (sampling and argmax want full precision)
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def score(self, tokens: torch.Tensor) -> torch.Tensor:
        """Plain causal forward without a cache: tokens [B, T] → logits [B, T, V]."""
        return self.logits(self.forward(causal_batch(tokens, self.cfg.sliding_window), cache=None).hidden)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """mask [B, T, S] bool (True = may attend) → [B, T, S] in `dtype`: 0 where True, -inf where not."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def causal_batch(tokens: torch.Tensor, sliding_window: int | None) -> ForwardBatch:
    """tokens [B, T] as one cache-free causal forward (positions 0 .. T-1)."""
    B, T = tokens.shape
    positions = torch.arange(T, device=tokens.device).expand(B, T)
    mask = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
    if sliding_window:
        mask &= (positions[0][:, None] - positions[0][None, :]) < sliding_window
    zeros = torch.zeros(B, dtype=torch.long, device=tokens.device)
    return ForwardBatch(tokens, positions, zeros, zeros, mask.expand(B, T, T))


# ---------------------------------------------------------------------------------------------
# Loading a Hugging Face checkpoint folder

def _read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} has no config.json")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is corrupt: {e}") from None
        files = [path / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path} lacks shard(s) named in its index: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors weights")
    return files


def read_drafter_weights(folder: Path, what: str) -> dict[str, torch.Tensor]:
    """A drafter folder's model.safetensors (DFlash, MTP heads); CheckpointError naming `what`
    when it is missing, or the file when it cannot be read."""
    st = Path(folder) / "model.safetensors"
    if not st.is_file():
        raise CheckpointError(f"{what} has no model.safetensors")
    return _read_weights([st])


def _read_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"cannot read weights {f}: {e}") from None
    return state


def fuse_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face's separate q/k/v and gate/up projections → our fused qkv_proj / gate_up_proj.

    Tensors that are not all present are left alone, so a missing one is reported by name later.
    Kept int4 tensors (q4_checkpoint.py) are concatenated by rows like the weights they stand for.
    """
    out = dict(state)
    groups = [(("q_proj", "k_proj", "v_proj"), "qkv_proj", ("weight", "bias") + KEPT_KINDS),
              (("gate_proj", "up_proj"), "gate_up_proj", ("weight",) + KEPT_KINDS)]
    for key in list(state):
        for parts, fused, kinds in groups:
            for kind in kinds:
                suffix = f".{parts[0]}.{kind}"
                if key.endswith(suffix):
                    prefix = key[: -len(suffix)]
                    names = [f"{prefix}.{p}.{kind}" for p in parts]
                    if all(n in state for n in names):
                        out[f"{prefix}.{fused}.{kind}"] = torch.cat([state[n] for n in names])
                        for n in names:
                            del out[n]
    return out


def _token_ids(value) -> tuple[int, ...]:
    """A config's eos_token_id: one id, a list of them, or None."""
    if value is None:
        return ()
    return tuple(int(i) for i in value) if isinstance(value, list) else (int(value),)


def _with_generation_eos(cfg: ModelConfig, path: Path) -> ModelConfig:
    """End-of-sequence ids from generation_config.json as well as config.json: a chat model's
    end-of-turn token is often listed only there (transformers' generate stops on either)."""
    gen_file = path / "generation_config.json"
    if not gen_file.is_file():
        return cfg
    try:
        gen = json.loads(gen_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{gen_file} is not valid JSON: {e}") from None
    ids = tuple(dict.fromkeys(cfg.eos_token_ids + _token_ids(gen.get("eos_token_id"))))
    return replace(cfg, eos_token_ids=ids)


def load_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    return _with_generation_eos(ModelConfig.from_hf(_read_config(path)), path)


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", shard: Shard = WHOLE) -> Transformer:
    """Build a Transformer from a Hugging Face folder (config.json + single or sharded safetensors).
    `shard`: this rank's part of a tensor-parallel target (tensor_parallel.py); default the whole.
    A folder with kept int4 projections (quantization_config.json) gets them as int4 linears."""
    path = Path(path)
    cfg = load_config(path)
    check_divisible(cfg, shard.world)
    state = _read_weights(_weight_files(path))
    # HF names: model.layers.0.self_attn.q_proj.weight …; ours drop the "model." prefix.
    ours = fuse_projections({k.removeprefix("model."): v for k, v in state.items()})
    with torch.device("meta"):
        whole = Transformer(cfg)  # the checkpoint is checked against the whole model's shapes
        model = whole if shard.world == 1 else Transformer(cfg, shard)
    kept = _take_kept(path, whole, ours)
    if kept and shard.world > 1:
        # Sharding kept int4 groups would split a group's scale across ranks: not built.
        raise CheckpointError(f"{path}: kept int4 projections cannot be sharded for tensor parallelism yet; "
                              "import the GGUF without --keep-quantized")
    expected = set(whole.state_dict().keys()) - {f"{name}.weight" for name in kept}
    if cfg.tie_word_embeddings:
        ours.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(ours))
    unexpected = sorted(k for k in set(ours) - expected if "rotary_emb" not in k)
    if missing:
        raise CheckpointError(f"{path}: weights missing for {len(missing)} tensors, e.g. {missing[:3]}")
    if unexpected:
        raise CheckpointError(f"{path}: unexpected tensors {unexpected[:3]} (wrong architecture?)")
    for name, param in whole.state_dict().items():
        if name in ours and tuple(ours[name].shape) != tuple(param.shape):
            raise CheckpointError(f"{path}: tensor {name} has shape {tuple(ours[name].shape)}, "
                                  f"config implies {tuple(param.shape)}")
    model = model.to_empty(device=device)
    model.load_state_dict(shard_state({k: v for k, v in ours.items() if k in expected}, cfg, shard), strict=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    for name, weights in kept.items():
        parent, attr = name.rsplit(".", 1)
        bias = model.get_submodule(name).bias   # loaded above (Qwen2's q/k/v bias)
        setattr(model.get_submodule(parent), attr, int4_linear(weights, bias, dtype, torch.device(device)))
    model.rotary = RotaryEmbedding(cfg.rope)  # built under "meta" above; make the real tables
    return model.to(dtype).eval().requires_grad_(False)


def _take_kept(path: Path, model: Transformer, ours: dict[str, torch.Tensor]) -> dict[str, Q4Weights]:
    """The kept int4 projections of a --keep-quantized folder, taken out of `ours` (our fused
    names: layers.0.self_attn.qkv_proj …); {} for a dense folder. `model`: the one being built."""
    try:
        if not is_kept(path):
            return {}
    except KeptRecordError as e:
        raise CheckpointError(str(e)) from None
    kept = {}
    for name, module in model.layers.named_modules(prefix="layers"):
        if not isinstance(module, nn.Linear):   # a decoder layer's linears are its projections
            continue
        weights = take_stored(ours, name)
        if weights is None:
            raise CheckpointError(f"{path}: kept int4 tensors missing for {name} (qweight, scales, mins)")
        n, k = module.out_features, module.in_features
        groups = (n, k // Q4_GROUP_SIZE)
        if (tuple(weights.q.shape), tuple(weights.scales.shape), tuple(weights.mins.shape)) != ((n, k), groups, groups):
            raise CheckpointError(f"{path}: kept int4 tensors of {name} are {tuple(weights.q.shape)} with "
                                  f"scales {tuple(weights.scales.shape)}, config implies ({n}, {k})")
        kept[name] = weights
    return kept
