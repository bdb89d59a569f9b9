"""Proposer.sequence_state: the drafter state one sequence holds, counted from the tensors each
proposer allocates, as make compare reports it (cli/bench/draft_memory.py)."""

from __future__ import annotations

import pytest

from specserve.cli.bench.draft_memory import draft_memory
from specserve.core.proposer import SequenceState
from specserve.methods.dflash.memory import budget_bytes
from specserve.model.transformer import load_model
from specserve.serving.settings import DeploymentSettings

DEMO = "models/demo"
DRAFTERS = tuple((m, f"{DEMO}/{m}") for m in ("eagle", "dflash", "draft", "mtp"))
LEN = 256   # max_model_len; slots hold LEN + max_draft_len (8) + 1 positions
# Pinned: the default (auto) drafts in bf16 where the CPU has bf16 matmuls (AMX / AVX512-BF16),
# which halves the drafter tensors; the figures below are fp32's on any machine.
F32 = "float32"


@pytest.fixture(scope="module")
def target():
    return load_model(f"{DEMO}/target")


@pytest.fixture(scope="module")
def states(target):
    settings = DeploymentSettings(f"{DEMO}/target", max_model_len=LEN, drafters=DRAFTERS, max_num_seqs=3,
                                  drafter_dtype=F32)
    return draft_memory(target, settings, ["none", "ngram", "eagle", "dflash", "draft", "dspark", "mtp"])


def test_each_method_counts_its_own_tensors(states):
    f32 = 4
    eagle = 2 * 1 * 2 * (LEN + 9) * 64 * f32                 # k and v, 1 layer, 2 kv heads, head_dim 64
    assert states["none"] == states["ngram"] == SequenceState(0, "no drafter state")
    assert states["eagle"] == SequenceState(eagle, f"one slot of the drafter's KV cache ({LEN + 9} positions)")
    assert states["dspark"].bytes == eagle + 9 * 384 * f32 + 9 * 8   # committed pairs [9, 384] and [9] int64
    assert states["dspark"].how.endswith("committed pairs: [9, 384] features, [9] tokens")
    draft = 2 * 3 * 2 * (LEN + 9) * 64 * f32                 # the demo draft model: 3 layers, 2 kv heads
    assert states["draft"] == SequenceState(draft, f"one slot of the draft model's KV cache ({LEN + 9} positions)")
    heads = 384 * f32                                        # the MTP heads keep one feature vector
    assert states["mtp"] == SequenceState(heads + eagle + draft,
                                          f"sum of its drafters': mtp_heads {heads}, eagle {eagle}, draft {draft}, ngram 0")


def test_dflash_is_its_bounded_memory_budget(states, target):
    from specserve.methods.dflash.drafter import load_dflash

    c = load_dflash(f"{DEMO}/dflash", target).cfg
    assert states["dflash"].bytes == budget_bytes(LEN, c.window, c.pool_slots, c.pool_rank, c.hidden_size)
    assert states["dflash"].how.startswith(f"the bounded memory's budget at {LEN} tokens")


def test_a_slot_does_not_depend_on_how_many_the_engine_has(target, states):
    one = draft_memory(target, DeploymentSettings(f"{DEMO}/target", max_model_len=LEN, drafters=DRAFTERS,
                                                  max_num_seqs=1, drafter_dtype=F32), ["eagle", "dspark"])
    assert one["eagle"] == states["eagle"] and one["dspark"] == states["dspark"]


def test_a_remote_proposer_says_its_state_is_elsewhere():
    from specserve.methods.remote import RemoteProposer

    with pytest.raises(NotImplementedError, match="kept by its Triton model"):
        RemoteProposer("eagle", lambda x: x).sequence_state(LEN)


def test_bf16_drafters_count_two_bytes_an_element(target):
    """--drafter-dtype bfloat16 (auto's choice on bf16 hardware): the KV slots and DFlash's vectors
    are bf16, its pool's running sums stay fp32 (budget_bytes)."""
    import torch

    from specserve.methods.dflash.drafter import load_dflash

    got = draft_memory(target, DeploymentSettings(f"{DEMO}/target", max_model_len=LEN, drafters=DRAFTERS,
                                                  max_num_seqs=1, drafter_dtype="bfloat16"), ["eagle", "dflash"])
    assert got["eagle"].bytes == 2 * 1 * 2 * (LEN + 9) * 64 * 2
    c = load_dflash(f"{DEMO}/dflash", target).cfg
    assert got["dflash"].bytes == budget_bytes(LEN, c.window, c.pool_slots, c.pool_rank, c.hidden_size, torch.bfloat16)
    assert got["dflash"].bytes == (32 + LEN // 32) * 384 * 2 + (64 * 66 + 384) * 4
