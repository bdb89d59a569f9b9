"""Per-query attention (model/invariant_attention.py): a verify row is the bits of its decode step.

Pinned: which entries each query reads; per-query attention equals SDPA's attention (up to
rounding) and gives every query the same bits whatever else its call holds (more queries, more
rows, a longer padded span, a tree's gathered entries); the row-invariance probe finds a module
that rounds by call width (the broken control: a module whose output depends on the call) and
build refuses per-query attention on such a target; the mode's refusals on CUDA and with tensor
parallelism. The engine-level guarantee (bf16 quantized targets, every method, greedy output ==
plain output token for token) is in test_quantize.py's quantized_demo cases.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import make_tiny_checkpoint
from specserve.model.invariant_attention import (check_attention, per_query_attention, query_plan,
                                                 require_row_invariance, row_variant_modules)
from specserve.model.transformer import load_model

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"


def chain_mask(context: int, width: int, span: int) -> torch.Tensor:
    """[1, width, span]: query t sees entries 0 .. context + t (a decode / chain verify)."""
    return (torch.arange(span)[None, :] <= context + torch.arange(width)[:, None])[None]


def qkv(seed: int, B: int, T: int, S: int, dtype: torch.dtype, H: int = 4, Hkv: int = 2, hd: int = 16):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, n, hd, generator=g).to(dtype) for h, n in ((H, T), (Hkv, S), (Hkv, S)))


def chain_positions(context: int, width: int, rows: int = 1) -> torch.Tensor:
    return (context + torch.arange(width))[None].expand(rows, width)


def calls(plan):
    return [(c.row, c.queries, c.slots, c.span, None if c.gather is None else (c.gather.tolist(), c.offset))
            for c in plan.calls]


def test_query_plan_puts_each_position_at_its_row_of_its_block():
    # Two rows of a chain verify, positions 3 and 4: block 0, rows 3 and 4, over 16 entries.
    plan = query_plan(chain_mask(3, 2, 8).expand(2, 2, 8), chain_positions(3, 2, rows=2))
    assert calls(plan) == [(0, [0, 1], [3, 4], 16, None), (1, [0, 1], [3, 4], 16, None)]
    assert plan.read_span == 16
    # Positions 14 .. 17 cross a block: two calls, the second over 32 entries.
    plan = query_plan(chain_mask(14, 4, 18), chain_positions(14, 4))
    assert calls(plan) == [(0, [0, 1], [14, 15], 16, None), (0, [2, 3], [0, 1], 32, None)]
    assert [c.run for c in plan.calls] == [True, True]
    assert plan.read_span == 32
    second = plan.calls[1].mask[0, 0] == 0                                     # [16, 32]: kept entries
    assert second.shape == (16, 32)
    assert second[0].nonzero().squeeze(1).tolist() == list(range(17))         # position 16: entries 0 .. 16
    assert second[1].nonzero().squeeze(1).tolist() == list(range(18))         # position 17
    assert [row.nonzero().squeeze(1).tolist() for row in second[2:]] == [[0]] * 14   # idle rows
    # A tree: context 0..2, nodes at 3 (position 3), 4 (its sibling, position 3), 5 (child of 4,
    # position 4), and a sliding-window query at 5 seeing 2 .. 5: the sibling and the child are
    # copied to their chain offsets, the others read the row as it is.
    tree = torch.zeros(1, 4, 8, dtype=torch.bool)
    tree[0, 0, [0, 1, 2, 3]] = True
    tree[0, 1, [0, 1, 2, 4]] = True
    tree[0, 2, [0, 1, 2, 4, 5]] = True
    tree[0, 3, 2:6] = True
    plan = query_plan(tree, torch.tensor([[3, 3, 4, 5]]))
    assert calls(plan) == [(0, [1], [3], 16, ([0, 1, 2, 4], 0)), (0, [2], [4], 16, ([0, 1, 2, 4, 5], 0)),
                           (0, [0, 3], [3, 5], 16, None)]
    # chains copy by slices; the block holding queries 0 and 3 (slots 3 and 5) by index
    assert [c.run for c in plan.calls] == [True, True, False]
    assert (plan.calls[2].mask[0, 0, 5] == 0).nonzero().squeeze(1).tolist() == [2, 3, 4, 5]
    assert plan.calls[2].mask.dtype == torch.float32 and plan.calls[2].mask[0, 0, 5, 0] == float("-inf")


def test_per_query_attention_is_sdpas_attention():
    q, k, v = qkv(0, 2, 5, 20, torch.float32)
    mask = chain_mask(10, 5, 20).expand(2, 5, 20)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    got = per_query_attention(q, k, v, query_plan(mask, chain_positions(10, 5, rows=2)))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verify_row_is_the_bits_of_its_decode_call(dtype):
    """Five queries of two rows in one call, against each query alone in a decode-shaped call over
    only the entries it sees (no padding past its position): the same bits, every query."""
    context, T, S = 30, 5, 64
    q, k, v = qkv(1, 2, T, S, dtype)
    mask = chain_mask(context, T, S).expand(2, T, S)
    verify = per_query_attention(q, k, v, query_plan(mask, chain_positions(context, T, rows=2)))        # [2, H, T, hd]
    for b in range(2):
        for t in range(T):
            n = context + t + 1
            decode = per_query_attention(q[b:b + 1, :, t:t + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
                                         query_plan(chain_mask(context + t, 1, n), chain_positions(context + t, 1)))
            assert torch.equal(verify[b:b + 1, :, t:t + 1], decode), (b, t)


def test_a_tree_node_reads_its_gathered_entries_as_a_chain_would():
    """A tree node at cache position 6 whose ancestors sit at 3 and 5 (4 is a sibling's): the same
    bits as the chain that holds context, ancestors and the node contiguously."""
    q, k, v = qkv(2, 1, 1, 8, torch.bfloat16)
    seen = [0, 1, 2, 3, 5, 6]
    tree = torch.zeros(1, 1, 8, dtype=torch.bool)
    tree[0, 0, seen] = True
    node = per_query_attention(q, k, v, query_plan(tree, torch.tensor([[5]])))
    chain_k, chain_v = k[:, :, seen], v[:, :, seen]
    chain = per_query_attention(q, chain_k, chain_v, query_plan(chain_mask(5, 1, 6), chain_positions(5, 1)))
    assert torch.equal(node, chain)


def verify_and_decode_logits(model, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt prefilled into two cache slots; then `tokens` decoded one step at a time in slot 0
    and verified in one forward in slot 1, each over a span just long enough (as the engine's
    masks are): their logits [len(tokens), V], decode's and verify's."""
    from specserve.core.forward import ForwardBatch

    cache = model.new_cache(2, 128)

    def forward(ids: list[int], slot: int, start: int) -> torch.Tensor:
        T = len(ids)
        positions = torch.arange(start, start + T)[None]                           # [1, T]
        mask = (torch.arange(start + T)[None, :] <= positions[0][:, None])[None]   # [1, T, start + T]
        batch = ForwardBatch(torch.tensor([ids]), positions, torch.tensor([slot]), torch.tensor([start]), mask)
        return model.logits(model(batch, cache).hidden)[0]                          # [T, V]

    with torch.inference_mode():
        for slot in (0, 1):
            forward(prompt, slot, 0)
        decode = torch.cat([forward([t], 0, len(prompt) + i) for i, t in enumerate(tokens)])
        verify = forward(tokens, 1, len(prompt))
    return decode, verify


def test_a_bf16_quantized_target_verifies_with_its_decode_logits():
    """The demo target, int4 + int8 head, bf16: eight tokens verified in one forward give, bit for
    bit, the logits of eight decode steps (what makes greedy speculative output plain output)."""
    from specserve.model.quantize import Quantization, quantize_target

    model = quantize_target(load_model(DEMO / "target", dtype=torch.bfloat16), Quantization("int4", 32, "int8"))
    if row_variant_modules(model, 16):
        pytest.skip(f"this CPU's kernels round rows by call width: {row_variant_modules(model, 16)}")
    model.per_query_attention = True
    decode, verify = verify_and_decode_logits(model, list(range(40, 70)), [5, 17, 3, 99, 250, 8, 41, 7])
    assert torch.equal(decode, verify)


class ByWidth(nn.Module):
    """A broken kernel: its rounding depends on how many rows the call holds."""

    def __init__(self, inner: nn.Module, from_rows: int):
        super().__init__()
        self.inner, self.from_rows = inner, from_rows

    def forward(self, x):
        out = self.inner(x)
        return out + 1e-3 if x.reshape(-1, x.shape[-1]).shape[0] >= self.from_rows else out


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("inv") / "tiny", "llama", seed=3)


def test_the_probe_finds_a_module_that_rounds_by_call_width(tiny_bf16):
    model = load_model(tiny_bf16, dtype=torch.bfloat16)
    assert row_variant_modules(model, 64) == []
    model.layers[0].mlp.down_proj = ByWidth(model.layers[0].mlp.down_proj, from_rows=5)
    assert row_variant_modules(model, 64) == [("layers.0.mlp.down_proj", 5)]
    assert row_variant_modules(model, 4) == []          # only the widths served are probed
    with pytest.raises(ValueError) as e:
        require_row_invariance(model, max_num_seqs=2)
    assert str(e.value) == (
        "--attention per-query makes greedy output exact only where the target computes each row alone, and on "
        "this machine layers.0.mlp.down_proj rounds a row differently in a call of 5 rows: float32 dense "
        "linears do; use --dtype bfloat16 or --quantize int8|int4, or --attention batched")


def test_the_attention_mode_is_checked_with_exact_messages():
    check_attention("per-query", "cpu", 1)
    check_attention("batched", "cuda", 4)
    with pytest.raises(ValueError, match=r"^attention must be one of batched, per-query, got 'flash'$"):
        check_attention("flash", "cpu", 1)
    with pytest.raises(ValueError, match=r"^--attention per-query runs on CPU only \(device cuda: the CUDA step "
                                         r"is a captured graph\)$"):
        check_attention("per-query", "cuda", 1)
    with pytest.raises(ValueError, match=r"^--attention per-query runs in one process: not with --tensor-parallel 2 "
                                         r"\(the ranks' attention is batched\)$"):
        check_attention("per-query", "cpu", 2)


def test_serve_refuses_per_query_attention_with_tensor_parallelism_before_starting(tmp_path):
    from specserve.cli.checks import CliError
    from specserve.cli.main import build_parser, serve_settings
    from specserve.model.tiny import make_tiny_llama

    tiny = make_tiny_llama(tmp_path / "tiny")
    args = build_parser().parse_args(["serve", "--target", str(tiny), "--attention", "per-query",
                                      "--tensor-parallel", "2", "--device", "cpu", "--no-drafters"])
    with pytest.raises(CliError) as e:
        serve_settings(args)
    assert str(e.value) == ("--attention per-query runs in one process: not with --tensor-parallel 2 "
                            "(the ranks' attention is batched)")
    ok = build_parser().parse_args(["serve", "--target", str(tiny), "--attention", "per-query", "--device", "cpu",
                                    "--no-drafters"])
    settings, _ = serve_settings(ok)
    assert settings.attention == "per-query"
