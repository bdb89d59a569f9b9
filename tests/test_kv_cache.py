"""Rollback and tree-path compaction leave the cache as if the accepted sequence were prefilled."""

from __future__ import annotations

import pytest
import torch

from specserve.core.kv_cache import CacheFull
from specserve.core.masks import build_mask, chain_parents
from specserve.core.forward import ForwardBatch
from specserve.model.transformer import load_model

PROMPT = [5, 17, 99, 3, 250, 42, 7]


def run(model, cache, slot, start, tokens, parents):
    mask, pos = build_mask([start], [parents], len(tokens))
    batch = ForwardBatch(torch.tensor([tokens]), pos, torch.tensor([slot]), torch.tensor([start]), mask)
    with torch.inference_mode():
        model.forward(batch, cache)


def valid(cache, slot):
    n = cache.lengths[slot]
    return cache.k[:, slot, :, :n], cache.v[:, slot, :, :n]


def reference(model, tokens):
    cache = model.new_cache(1, 64)
    run(model, cache, 0, 0, tokens, chain_parents(len(tokens)))
    cache.truncate(0, len(tokens))
    return valid(cache, 0)


def test_rollback_equals_prefill_of_accepted(tiny_ckpt):
    model = load_model(tiny_ckpt)
    cache = model.new_cache(2, 64)
    run(model, cache, 1, 0, PROMPT, chain_parents(len(PROMPT)))
    cache.truncate(1, len(PROMPT))
    # Verify a chain of 4 drafted tokens, accept 2 of them (plus the pending token).
    chain = [8, 9, 10, 11, 12]
    run(model, cache, 1, len(PROMPT), chain, chain_parents(len(chain)))
    cache.truncate(1, len(PROMPT) + 3)
    k, v = valid(cache, 1)
    rk, rv = reference(model, PROMPT + chain[:3])
    torch.testing.assert_close(k, rk, atol=1e-5, rtol=0)
    torch.testing.assert_close(v, rv, atol=1e-5, rtol=0)
    # A later write after the rollback overwrites the stale entries correctly.
    run(model, cache, 1, len(PROMPT) + 3, [40, 41], [-1, 0])
    cache.truncate(1, len(PROMPT) + 5)
    k, v = valid(cache, 1)
    rk, rv = reference(model, PROMPT + chain[:3] + [40, 41])
    torch.testing.assert_close(k, rk, atol=1e-5, rtol=0)


@pytest.mark.parametrize("path", [[0, 2, 4], [0, 1, 3], [0, 2], [0]])
def test_tree_path_compaction_equals_prefill_of_path(tiny_ckpt, path):
    model = load_model(tiny_ckpt)
    cache = model.new_cache(3, 64)
    run(model, cache, 2, 0, PROMPT, chain_parents(len(PROMPT)))
    cache.truncate(2, len(PROMPT))
    # root=30; children 31 and 32; 33 under 31; 34 under 32.
    tokens, parents = [30, 31, 32, 33, 34], [-1, 0, 0, 1, 2]
    run(model, cache, 2, len(PROMPT), tokens, parents)
    for a, b in zip(path, path[1:]):
        assert parents[b] == a  # the parametrised paths are real root-to-node paths
    cache.compact_path(2, len(PROMPT), path)
    assert cache.lengths[2] == len(PROMPT) + len(path)
    k, v = valid(cache, 2)
    rk, rv = reference(model, PROMPT + [tokens[i] for i in path])
    torch.testing.assert_close(k, rk, atol=1e-5, rtol=0)
    torch.testing.assert_close(v, rv, atol=1e-5, rtol=0)


def test_slots_allocate_release_and_errors(tiny_ckpt):
    cache = load_model(tiny_ckpt).new_cache(2, 16)
    a, b = cache.allocate(), cache.allocate()
    assert {a, b} == {0, 1}
    with pytest.raises(CacheFull, match="all 2 KV slots are in use"):
        cache.allocate()
    cache.release(a)
    with pytest.raises(ValueError, match="released twice"):
        cache.release(a)
    with pytest.raises(ValueError, match="must increase"):
        cache.compact_path(b, 0, [0, 2, 1])
    with pytest.raises(ValueError, match="outside"):
        cache.truncate(b, 17)


def test_slot_runs_split_rows_where_slots_stop_being_consecutive():
    from specserve.core.kv_cache import slot_runs

    assert slot_runs([4, 5, 6, 0, 2, 3]) == ((0, 3), (3, 4), (4, 6))
    assert slot_runs([7]) == ((0, 1),) and slot_runs([]) == ()
    assert slot_runs([3, 2, 1]) == ((0, 1), (1, 2), (2, 3))


def test_runs_are_used_where_the_gather_would_copy_more_than_the_limit():
    from specserve.core.kv_cache import GATHER_BYTES_LIMIT, KVCache

    cache = KVCache(num_layers=1, num_slots=8, num_kv_heads=2, max_len=4096, head_dim=64)
    per_entry = 2 * 2 * 64 * 4                       # k and v, 2 heads, head_dim 64, fp32: per row and entry
    at_limit = GATHER_BYTES_LIMIT // (3 * per_entry)  # 3 rows copying exactly the limit
    assert cache.runs_for([4, 5, 0], at_limit) is None
    assert cache.runs_for([4, 5, 0], at_limit + 1) == ((0, 2), (2, 3))
    off_cpu = KVCache(num_layers=1, num_slots=8, num_kv_heads=2, max_len=4096, head_dim=64, device="meta")
    assert off_cpu.runs_for([4, 5, 0], 4096) is None   # one gather beats a launch per run there


def test_reading_by_runs_equals_one_gathered_read_bit_for_bit(tiny_ckpt):
    """Rows in scattered slots: attention over each run's view of the pool gives exactly the
    hidden states of one read that gathers every row's slot."""
    from specserve.core.kv_cache import slot_runs

    model = load_model(tiny_ckpt)
    slots, lens = [5, 6, 0, 3, 4], [9, 4, 7, 11, 6]
    outs = {}
    for runs in (None, slot_runs(slots)):
        cache = model.new_cache(8, 64)
        g = torch.Generator().manual_seed(0)
        for s, n in zip(slots, lens):   # each row's own context first
            run(model, cache, s, 0, torch.randint(0, 200, (n,), generator=g).tolist(), chain_parents(n))
        tokens = torch.randint(0, 200, (len(slots), 3), generator=g)
        mask, pos = build_mask(lens, [chain_parents(3)] * len(slots), 3)
        batch = ForwardBatch(tokens, pos, torch.tensor(slots), torch.tensor(lens), mask, runs)
        with torch.inference_mode():
            outs[runs] = model.forward(batch, cache).hidden
    assert len(slot_runs(slots)) == 3
    assert torch.equal(outs[None], outs[slot_runs(slots)])
