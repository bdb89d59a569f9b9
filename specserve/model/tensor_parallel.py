"""Tensor parallelism for the target: the sharding plan and the collective (docs/design.md,
'Tensor parallelism').

Megatron style over N ranks, applied to the one model file (transformer.py):

    qkv_proj      column-parallel: rank r keeps query heads  r·H/N   .. (r+1)·H/N   − 1
                                   and KV heads             r·Hkv/N .. (r+1)·Hkv/N − 1
                                   (each of q, k, v split by heads: the fused matrix is
                                   [q | k | v] stacked, so splitting it blindly in N would give
                                   rank 0 only query rows)
    o_proj        row-parallel: the input features of the rank's query heads; partial sums,
                  then ONE all-reduce (sum) per layer
    gate_up_proj  column-parallel: each of gate and up split in N (fused [gate | up] likewise)
    down_proj     row-parallel: the rank's intermediate features; ONE all-reduce per layer
    embedding, final norm, LM head, layer norms: replicated (every rank holds them whole).
    Vocabulary-parallel embedding / LM head can come later; replicated keeps the LM head, and so
    every fused drafter that reuses it, on rank 0 as it is.

Each rank's attention sees only its heads, so its KV pool holds only its Hkv/N KV heads.

KV heads are split, never replicated: N must divide the KV heads (and the query heads, and the
MLP width), else the model refuses with a message saying which. vLLM replicates KV heads when N
exceeds them; that costs a copy of the KV pool per replica and a second layout to test, for
configurations (N > Hkv) that the targets this is for rarely need (Llama-3-70B: 8 KV heads, 8
GPUs). It can be added when one does.

Worked example (the tiny test config: H = 4, Hkv = 2, hd = 16, N = 2): the fused qkv_proj
weight has rows [q0 q1 q2 q3 | k0 k1 | v0 v1] × 16; rank 0 keeps [q0 q1 | k0 | v0], rank 1
[q2 q3 | k1 | v1]. Query heads q0, q1 share KV head k0 under GQA on the full model, and they
do on rank 0: the grouping survives because N divides both head counts.

Within fp32 rounding the sharded model equals the whole one: the only difference is the order
of the sums the all-reduces split (see tests/test_tensor_parallel.py for the tolerance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class ShardedConfig(Protocol):
    """What the plan reads of transformer.ModelConfig (not imported: transformer imports us)."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int


class TensorParallelError(RuntimeError):
    """Tensor-parallel serving cannot go on: a worker died or hung, or a collective failed."""


@dataclass(frozen=True)
class Shard:
    """This process's part of an N-way sharded model: its rank and the process group the
    all-reduces run on (None when N = 1: the whole model, no collective)."""
    rank: int = 0
    world: int = 1
    group: Any = None   # a torch.distributed ProcessGroup (gloo on CPU, NCCL on CUDA)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (the row-parallel layers' partial sums)."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        try:
            dist.all_reduce(x, group=self.group)
        except RuntimeError as e:  # gloo: a peer closed its connection, or the timeout passed
            raise TensorParallelError(f"all-reduce over {self.world} tensor-parallel ranks failed: {e}") from e
        return x


WHOLE = Shard()


def check_divisible(cfg: ShardedConfig, world: int) -> None:
    """ValueError saying why `cfg` cannot be split over `world` ranks."""
    if world < 1:
        raise ValueError(f"tensor_parallel must be at least 1, got {world}")
    for what, n in (("query heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                    ("MLP features (intermediate_size)", cfg.intermediate_size)):
        if n % world:
            raise ValueError(f"tensor_parallel={world} does not divide the model's {n} {what}; "
                             f"choose a size that divides {cfg.num_kv_heads} KV heads, {cfg.num_heads} "
                             f"query heads and {cfg.intermediate_size} MLP features (KV heads are split "
                             "across ranks, never replicated)")


def rank_devices(device: torch.device, world: int) -> list[torch.device]:
    """The device of each rank: all on the CPU, or one GPU each from `device`'s index on
    (ValueError when there are too few)."""
    if device.type != "cuda":
        return [device] * world
    first, count = device.index or 0, torch.cuda.device_count()
    if first + world > count:
        raise ValueError(f"tensor_parallel={world} needs {world} GPUs from cuda:{first}; "
                         f"this machine has {count}")
    return [torch.device("cuda", first + r) for r in range(world)]


def check_tensor_parallel(cfg: ShardedConfig, world: int, device: torch.device, quantize: str) -> None:
    """Every refusal of a tensor-parallel size, before anything loads (ValueError)."""
    check_divisible(cfg, world)
    if world > 1 and quantize != "none":
        # Quantizing a shard would compute its own scales (per output channel of a row-parallel
        # shard's input slice, per group across a column split), a different target than N = 1.
        raise ValueError(f"tensor_parallel={world} with quantize={quantize} is not supported yet: "
                         "serve the sharded target unquantized")
    rank_devices(device, world)


def _rank_part(t: torch.Tensor, sizes: list[int], dim: int, shard: Shard) -> torch.Tensor:
    """Split t along dim into consecutive parts of `sizes` (q, k, v or gate, up), take the
    rank's N-th of each, and stack them back in the same order."""
    return torch.cat([part.chunk(shard.world, dim=dim)[shard.rank] for part in t.split(sizes, dim=dim)], dim=dim)


def shard_state(state: dict[str, torch.Tensor], cfg: ShardedConfig, shard: Shard) -> dict[str, torch.Tensor]:
    """A whole model's state dict (our names, projections fused) → this rank's part of it."""
    if shard.world == 1:
        return state
    hd = cfg.head_dim
    qkv = [cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd]
    gate_up = [cfg.intermediate_size, cfg.intermediate_size]
    out = {}
    for name, t in state.items():
        if name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
            out[name] = _rank_part(t, qkv, 0, shard)            # column-parallel, by heads
        elif name.endswith("mlp.gate_up_proj.weight"):
            out[name] = _rank_part(t, gate_up, 0, shard)        # column-parallel
        elif name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            out[name] = t.chunk(shard.world, dim=1)[shard.rank]  # row-parallel: input features
        else:
            out[name] = t                                       # replicated
    return {k: v.contiguous() for k, v in out.items()}
