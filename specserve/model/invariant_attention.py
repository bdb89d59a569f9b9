"""Per-query attention: each query's output is the same bits however many queries and rows the
forward holds, so a verify of K+1 tokens gives exactly the outputs of K+1 one-token decode steps.

Why: SDPA's CPU kernels block their work by the call's shape (queries, span, mask), so a query's
output in a 1-token decode and in a (K+1)-token verify round differently (one bf16 ulp at layer 3
of SmolLM2 int4 / bf16 in the case measured), and greedy speculative output then parts from
plain output at near-ties (5 of 6 chat answers within 96 tokens). PyTorch's weight-only int8 /
int4 kernels and bf16 linears compute each output row alone (checked up to 128 rows), so with
them attention is the one part of a step whose rounding depends on the batch.

How: one SDPA call per query, over exactly the cache entries that query sees (a contiguous range
as a copy, or the gathered entries of a tree node's context and ancestors), with no mask. A
decode step and a verify row at the same position then make the same call on the same numbers.
Cost: one call per query instead of one per run of rows; for decode and verify widths, not for
prompt prefill (Attention uses it up to PER_QUERY_MAX_QUERIES queries a forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ATTENTION_MODES = ("batched", "per-query")

# Forwards with more queries per row than this are prompt prefills: the same call in a plain and
# a speculative run, so batched SDPA keeps them fast without breaking the guarantee.
PER_QUERY_MAX_QUERIES = 64

# What query t of row b reads: (lo, hi) for the contiguous cache range [lo, hi), or the index
# tensor of the entries it sees (a tree node: its context and its ancestors).
QueryKeys = tuple[tuple["tuple[int, int] | torch.Tensor", ...], ...]


def query_keys(mask: torch.Tensor) -> QueryKeys:
    """mask [B, T, S] bool → each query's cache entries; worked out once per forward (on the
    host: the ranges decide slicing), shared by every layer."""
    host = mask.cpu()
    out = []
    for b in range(host.shape[0]):
        row = []
        for t in range(host.shape[1]):
            seen = host[b, t].nonzero().squeeze(1)                     # [n] increasing
            lo, hi = int(seen[0]), int(seen[-1]) + 1
            row.append((lo, hi) if hi - lo == len(seen) else seen.to(mask.device))
        out.append(tuple(row))
    return tuple(out)


def per_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: QueryKeys,
                        enable_gqa: bool) -> torch.Tensor:
    """q [B, H, T, hd], k, v [B, Hkv, S, hd], keys from query_keys → [B, H, T, hd]."""
    B, H, T, hd = q.shape
    rows = []
    for b in range(B):
        outs = []
        for t in range(T):
            seen = keys[b][t]
            if isinstance(seen, tuple):
                kk, vv = k[b:b + 1, :, seen[0]:seen[1]], v[b:b + 1, :, seen[0]:seen[1]]
            else:
                kk, vv = k[b:b + 1].index_select(2, seen), v[b:b + 1].index_select(2, seen)
            # contiguous: the pool's strides differ from a gathered copy's, and the call must
            # see the same layout wherever the entries came from
            outs.append(F.scaled_dot_product_attention(q[b:b + 1, :, t:t + 1].contiguous(), kk.contiguous(), vv.contiguous(),
                                                       enable_gqa=enable_gqa))   # [1, H, 1, hd]
        rows.append(torch.cat(outs, dim=2))
    return torch.cat(rows, dim=0)


def check_attention(mode: str, device_type: str, tensor_parallel: int) -> None:
    """Raise ValueError for an attention mode this deployment cannot run; the message says why."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_MODES)}, got {mode!r}")
    if mode == "per-query" and device_type != "cpu":
        # The CUDA static step is one captured graph; per-query slicing reads each query's
        # range on the host, which a graph cannot.
        raise ValueError(f"--attention per-query runs on CPU only (device {device_type}: the CUDA step is a "
                         "captured graph)")
    if mode == "per-query" and tensor_parallel > 1:
        raise ValueError("--attention per-query runs in one process: not with --tensor-parallel "
                         f"{tensor_parallel} (the ranks' attention is batched)")


# Call widths the probe tries: small, odd and power-of-two row counts, where kernels switch blocking.
PROBE_ROWS = (2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32, 33, 64, 65, 128, 129, 256, 512, 1024)


def row_variant_modules(model: "torch.nn.Module", max_rows: int, seed: int = 0) -> list[tuple[str, int]]:
    """Which of the target's row-wise modules (layer 0's norms and projections, the final norm, the
    LM head; every layer has layer 0's kinds and shapes) give some row other bits in a call of M
    rows (M up to max_rows) than in a call of that row alone: (name, the first such M); [] when none.
    Per-query attention makes a verify row exact only where this is []."""
    layer = model.layers[0]
    modules = {"layers.0.input_layernorm": layer.input_layernorm, "layers.0.self_attn.qkv_proj": layer.self_attn.qkv_proj,
               "layers.0.self_attn.o_proj": layer.self_attn.o_proj, "layers.0.post_attention_layernorm":
               layer.post_attention_layernorm, "layers.0.mlp.gate_up_proj": layer.mlp.gate_up_proj,
               "layers.0.mlp.down_proj": layer.mlp.down_proj, "norm": model.norm, "lm_head": model.lm_head}
    widths = sorted({m for m in PROBE_ROWS if m <= max_rows} | {max_rows})
    gen = torch.Generator().manual_seed(seed)
    found = []
    with torch.inference_mode():
        for name, module in modules.items():
            width = model.cfg.intermediate_size if name.endswith("down_proj") else model.cfg.hidden_size
            base = torch.randn(8, width, generator=gen).to(model.device, model.dtype)   # [8, in]
            alone = torch.cat([module(base[i:i + 1][None])[0] for i in range(8)])        # [8, out]
            for m in widths:
                rows = base[torch.arange(m) % 8][None]                                    # [1, m, in]
                if not torch.equal(module(rows)[0], alone[torch.arange(m) % 8]):
                    found.append((name, m))
                    break
    return found


def require_row_invariance(model: "torch.nn.Module", max_num_seqs: int) -> None:
    """Raise ValueError unless every per-query forward's rows (max_num_seqs rows of up to
    PER_QUERY_MAX_QUERIES queries, 1024 at most) are row-invariant in this target on this machine:
    without that, per-query attention would not make greedy output exact, only slower."""
    rows = min(1024, max_num_seqs * PER_QUERY_MAX_QUERIES)
    found = row_variant_modules(model, rows)
    if found:
        (name, m), others = found[0], ", ".join(n for n, _ in found[1:])
        raise ValueError(f"--attention per-query makes greedy output exact only where the target computes each row "
                         f"alone, and on this machine {name} rounds a row differently in a call of {m} rows"
                         f"{f' (and {others})' if others else ''}: float32 dense linears do; use --dtype bfloat16 "
                         f"or --quantize int8|int4, or --attention batched")
