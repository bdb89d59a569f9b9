"""Per-query attention: each query's output is the same bits however many queries and rows the
forward holds, so a verify of K+1 tokens gives exactly the outputs of K+1 one-token decode steps.

Why: SDPA's CPU kernels block their work by the call's shape (queries, span, mask), so a query's
output in a 1-token decode and in a (K+1)-token verify round differently (one bf16 ulp at layer 3
of SmolLM2 int4 / bf16 in the case measured), and greedy speculative output then parts from
plain output at near-ties (5 of 6 chat answers within 96 tokens). PyTorch's weight-only int8 /
int4 kernels and bf16 linears compute each output row alone (probed up to 256 rows), so with
them attention is the one part of a step whose rounding depends on the batch.

How: every query's attention is one row of an SDPA call whose shape is fixed by the query's own
position P alone: QUERY_BLOCK query rows, the query at row P mod QUERY_BLOCK (other rows: this
forward's other queries of the same block, or idle), over a span S that is the power of two at or
above the block's end, with the query's entries at their cache offsets (P - count + 1 .. P). SDPA
computes each query row from its own q, mask row and the entries it keeps, so a decode step and
a verify row at the same position are the same row of the same-shaped call on the same numbers:
the same bits. Masked entries add exp(-inf) = 0 whatever their (finite) values. A query whose
entries are not the cache row's own at those offsets (a tree node off the first branch, whose
ancestors sit elsewhere) gets a call of its own over a copy laid out as its chain would be.
Measured on an AMD EPYC: a 16-row call over 128 entries takes what a 1-row call takes (138
against 158 µs); the copies around it bring a layer to about 80 µs more than batched SDPA, and
serving to 12-14 % slower at c = 1 (docs/quantize/README.md). For decode and verify widths, not
for prompt prefill (Attention uses it up to PER_QUERY_MAX_QUERIES queries a forward).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

ATTENTION_MODES = ("batched", "per-query")

# Forwards with more queries per row than this are prompt prefills: the same call in a plain and
# a speculative run, so batched SDPA keeps them fast without breaking the guarantee.
PER_QUERY_MAX_QUERIES = 64


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# Query rows of every per-query call; a position's row in it is position mod QUERY_BLOCK.
QUERY_BLOCK = 16


@dataclass(frozen=True)
class QueryCall:
    """One SDPA call of a per-query forward: queries `queries` of row `row`, at block rows `slots`."""
    row: int
    queries: list[int]                 # t indices in the forward
    slots: list[int]                   # each one's row in the call: its position mod QUERY_BLOCK
    span: int                          # entries: the power of two ≥ the block's end
    mask: torch.Tensor                 # [1, 1, QUERY_BLOCK, span] additive (0 kept, -inf not) in q's
                                       # dtype, converted once per forward; idle rows keep entry 0
    gather: torch.Tensor | None        # [count] the one query's entries, copied; None: the row's own
    offset: int = 0                    # where the copied entries go: P - count + 1
    run: bool = True                   # queries and slots both consecutive (a chain): slices, not the
                                       # slower index copies; worked out here, not once per layer


@dataclass(frozen=True)
class QueryPlan:
    calls: tuple[QueryCall, ...]
    read_span: int                     # entries Attention reads from the cache: every call's span

    def rows(self, a: int, b: int) -> "QueryPlan":
        """The calls of forward rows a .. b - 1, renumbered from 0 (Attention's runs of slots)."""
        return QueryPlan(tuple(replace(c, row=c.row - a) for c in self.calls if a <= c.row < b), self.read_span)


def _consecutive(xs: list[int]) -> bool:
    return xs == list(range(xs[0], xs[0] + len(xs)))


def query_plan(mask: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> QueryPlan:
    """mask [B, T, S] bool, positions [B, T] → the calls of a per-query forward, for q in `dtype`;
    worked out once per forward on the host and shared by every layer."""
    # numpy on the host: a few microseconds an operation, where small torch ops cost tens
    host, pos = mask.cpu().numpy(), positions.cpu().numpy()
    B, T, S = host.shape
    count = host.sum(-1)                                                        # [B, T]
    first = host.argmax(-1)                                                     # [B, T] first kept entry
    last = S - 1 - host[..., ::-1].argmax(-1)                                   # [B, T] last kept entry
    own = (last == pos) & (last - first + 1 == count)     # keeps exactly the row's entries up to P
    calls = []
    for b in range(B):
        blocks: dict[int, list[int]] = {}                                       # block start → t
        for t in range(T):
            P = int(pos[b, t])
            if own[b, t]:
                blocks.setdefault(P - P % QUERY_BLOCK, []).append(t)
            else:
                span, c = _pow2(P - P % QUERY_BLOCK + QUERY_BLOCK), int(count[b, t])
                seen = torch.from_numpy(host[b, t].nonzero()[0]).to(mask.device)
                calls.append(QueryCall(b, [t], [P % QUERY_BLOCK], span, _mask(np.array([P]), np.array([c]), span,
                                                                              mask.device, dtype), seen, P - c + 1))
        for start, ts in blocks.items():
            Ps, span = pos[b, ts], _pow2(start + QUERY_BLOCK)
            slots = (Ps % QUERY_BLOCK).tolist()
            calls.append(QueryCall(b, ts, slots, span, _mask(Ps, count[b, ts], span, mask.device, dtype), None,
                                   run=_consecutive(ts) and _consecutive(slots)))
    return QueryPlan(tuple(calls), max((c.span for c in calls), default=0))


def _mask(Ps: np.ndarray, counts: np.ndarray, span: int, device, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, QUERY_BLOCK, span] additive: the row of position P keeps entries P - count + 1 .. P;
    idle rows keep entry 0 (a row with none would be NaN)."""
    entries = np.arange(span)[None, :]                                          # [1, span]
    keep = np.zeros((QUERY_BLOCK, span), dtype=bool)
    keep[:, 0] = True
    keep[Ps % QUERY_BLOCK] = (entries >= (Ps - counts + 1)[:, None]) & (entries <= Ps[:, None])
    additive = np.where(keep, 0.0, -np.inf).astype(np.float32)
    return torch.from_numpy(additive)[None, None].to(device, dtype)


def _padded(x: torch.Tensor, span: int) -> torch.Tensor:
    """x [B, Hkv, S, hd] → [B, Hkv, max(S, span), hd]: zeros past the cache's end (a row shorter
    than its power-of-two span), once per layer rather than once per call."""
    if x.shape[2] >= span:
        return x
    out = x.new_zeros(x.shape[0], x.shape[1], span, x.shape[3])
    out[:, :, :x.shape[2]] = x
    return out


def _laid_out(x: torch.Tensor, call: QueryCall) -> torch.Tensor:
    """x [B, Hkv, S ≥ span, hd] → [1, Hkv, span, hd], contiguous (one layout wherever the entries
    came from): the cache row's first `span` entries, or the gathered ones at their chain offsets,
    zeros elsewhere."""
    if call.gather is None:
        return x[call.row:call.row + 1, :, :call.span].contiguous()
    out = x.new_zeros(1, x.shape[1], call.span, x.shape[3])
    out[:, :, call.offset:call.offset + len(call.gather)] = x[call.row:call.row + 1].index_select(2, call.gather)
    return out


def per_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: QueryPlan) -> torch.Tensor:
    """q [B, H, T, hd], k, v [B, Hkv, S, hd] (H a multiple of Hkv), plan from query_plan → [B, H, T, hd]."""
    B, H, T, hd = q.shape
    k, v = _padded(k, plan.read_span), _padded(v, plan.read_span)
    out = torch.empty_like(q)
    for call in plan.calls:
        block = q.new_zeros(1, H, QUERY_BLOCK, hd)
        t0, s0, n = call.queries[0], call.slots[0], len(call.queries)
        if call.run:
            block[0, :, s0:s0 + n] = q[call.row, :, t0:t0 + n]
        else:
            block[0][:, call.slots] = q[call.row][:, call.queries]
        res = F.scaled_dot_product_attention(block, _laid_out(k, call), _laid_out(v, call), attn_mask=call.mask,
                                             enable_gqa=k.shape[1] != H)              # [1, H, QUERY_BLOCK, hd]
        if call.run:
            out[call.row, :, t0:t0 + n] = res[0, :, s0:s0 + n]
        else:
            out[call.row][:, call.queries] = res[0][:, call.slots]
    return out


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
