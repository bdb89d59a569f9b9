"""benchmarks/chat_peers.py's pure logic: the balanced prompt subset and the OpenAI layer's
overhead against gRPC (the benchmark itself starts servers: not run in the suite)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from conftest import load_benchmark
from specserve.cli.bench.events import Chunk, RequestRecord

@pytest.fixture(scope="module")
def bench():
    return load_benchmark("chat_peers")


ROWS = [{"kind": k, "id": i} for i, k in enumerate("aaaabbc")]


def test_subset_takes_the_kinds_in_turn_each_in_file_order(bench):
    assert [r["id"] for r in bench.balanced_subset(ROWS, 5)] == [0, 4, 6, 1, 5]
    # A kind that runs out leaves its turns to the others.
    assert [r["id"] for r in bench.balanced_subset(ROWS, 7)] == [0, 4, 6, 1, 5, 2, 3]
    assert len(bench.balanced_subset(ROWS, 99)) == len(ROWS)


def test_subset_of_chosen_kinds_in_the_order_given(bench):
    assert [r["id"] for r in bench.balanced_subset(ROWS, 3, ["c", "b"])] == [6, 4, 5]
    with pytest.raises(ValueError, match="no prompts of kind z"):
        bench.balanced_subset(ROWS, 3, ["a", "z"])


def test_subset_of_the_held_out_chat_prompts_is_balanced(bench):
    rows = [json.loads(line) for line in bench.HELDOUT.read_text().splitlines() if line.strip()]
    counts = Counter(r["kind"] for r in bench.balanced_subset(rows, 12))
    kinds = {r["kind"] for r in rows}
    assert set(counts) == kinds and max(counts.values()) - min(counts.values()) <= 1


def record(index: int, send: float, chunk_times: list[float], tokens: int) -> RequestRecord:
    return RequestRecord(index, "none", "code", send_t=send, chunks=[Chunk(t, 1) for t in chunk_times],
                         end_t=chunk_times[-1], num_output_tokens=tokens)


def test_overhead_is_extra_time_per_openai_chunk_and_the_share_of_tokens_per_s(bench):
    grpc = [record(0, 0.0, [0.1, 0.5, 1.0], 10), record(1, 0.0, [0.2, 1.0], 10)]
    openai = [record(0, 0.0, [0.1, 0.5, 1.001], 10), record(1, 0.0, [0.2, 1.004], 10)]
    o = bench.overhead(openai, grpc)
    assert o["chunks"] == 5
    assert o["ms_per_chunk"] == pytest.approx(5 / 5)           # 5 ms more over 5 chunks
    assert o["tokens_per_s_pct"] == pytest.approx(100 * (1 - (20 / 2.005) / (20 / 2.0)))
    assert o["meets_goal"]                                      # 1 ms per chunk, 0.25 %: within the goal
    slower = [record(0, 0.0, [0.1, 0.5, 1.2], 10), record(1, 0.0, [0.2, 1.0], 10)]
    assert not bench.overhead(slower, grpc)["meets_goal"]


def test_overhead_pairs_the_same_requests(bench):
    with pytest.raises(ValueError):
        bench.overhead([record(0, 0.0, [1.0], 1)], [])


def test_serve_flags_serve_drafters_only_when_named(bench):
    assert bench.serve_flags([]) == ("--max-num-seqs", "2", "--max-model-len", "2048", "--no-drafters")
    assert bench.serve_flags(["eagle=models/smollm2/eagle"]) == (
        "--max-num-seqs", "2", "--max-model-len", "2048", "--drafter", "eagle=models/smollm2/eagle")
