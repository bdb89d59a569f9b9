"""training/distill_corpus.py: a distillation run's shards as training sequences, guarded again
against held-out prompts, with a validation split that does not move as the run grows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import distill_corpus  # noqa: E402
import distill_shards  # noqa: E402
from distill_shards import ShardStore  # noqa: E402
from heldout import HeldoutGuard, HeldoutLeak, HeldoutPrompt  # noqa: E402

GUARD = HeldoutGuard([HeldoutPrompt("chat", "3", "prose", "Explain what a B-tree is.")])


def record(i: int, phase="response", source="man", temperature=0.0, prompt=(1, 2, 3), response=(7, 8, 9, 10),
           content=None):
    return {"id": f"item-{i}", "phase": phase, "source": source, "template": "t", "origin": "o",
            "messages": [{"role": "user", "content": content or f"question {i}"}],
            "sampling": {"temperature": temperature, "seed": None, "max_tokens": 16},
            "prompt_ids": list(prompt), "response_ids": list(response), "response_text": "",
            "finish_reason": "stop"}


def write_run(root: Path, records: list[dict], shard_size=2) -> Path:
    store = ShardStore(root, shard_size)
    for r in records:
        store.add(r)
    store.flush()
    return root


def test_sequences_are_prompt_then_response_in_shard_order(tmp_path):
    run = write_run(tmp_path, [record(0), record(1, phase="question", source="self", temperature=0.7,
                                                 prompt=(4, 5), response=(6,)),
                               record(2, source="stdlib_code", response=())])
    seqs = distill_corpus.load(run, GUARD)
    assert [(s.id, s.source, s.sampled, s.tokens, s.response_start) for s in seqs] == [
        ("item-0", "man", False, [1, 2, 3, 7, 8, 9, 10], 3), ("item-1", "self", True, [4, 5, 6], 2)]
    assert [s.id for s in distill_corpus.load(run, GUARD, phases=["response"])] == ["item-0"]
    with pytest.raises(ValueError, match=r"^unknown phase\(s\) \['answers'\]; known: question, response$"):
        distill_corpus.load(run, GUARD, phases=["answers"])


def test_max_len_cuts_the_response_and_skips_prompts_that_fill_it(tmp_path):
    run = write_run(tmp_path, [record(0), record(1, prompt=(1, 2, 3, 4, 5))])
    seqs = distill_corpus.load(run, GUARD, max_len=5)
    assert [(s.id, s.tokens, s.response_tokens) for s in seqs] == [("item-0", [1, 2, 3, 7, 8], 2)]
    assert distill_corpus.load(run, GUARD, max_len=5, min_response=3) == []


def test_a_held_out_prompt_in_the_shards_stops_the_load(tmp_path):
    run = write_run(tmp_path, [record(0), record(1, content="Please: explain what a  B-tree is. Thanks")])
    with pytest.raises(HeldoutLeak, match=r"^training prompt contains held-out chat prompt 3: "
                                          r"'Explain what a B-tree is.'$"):
        distill_corpus.load(run, GUARD)


def test_reading_beside_a_running_job_leaves_its_partial_shard_alone(tmp_path):
    run = write_run(tmp_path, [record(0), record(1)])
    partial = run / "shards" / "shard-00001.tmp"
    partial.write_text("{")
    assert len(distill_corpus.load(run, GUARD)) == 2
    assert partial.read_text() == "{"
    with pytest.raises(FileNotFoundError, match="holds no shards/ folder"):
        distill_corpus.load(tmp_path / "nothing", GUARD)


def test_the_validation_split_does_not_move_as_the_run_grows(tmp_path):
    seqs = distill_corpus.load(write_run(tmp_path, [record(i) for i in range(400)], shard_size=32), GUARD)
    train, val = distill_corpus.split(seqs, 0.1)
    assert len(train) + len(val) == 400 and 20 <= len(val) <= 60
    assert not {s.id for s in train} & {s.id for s in val}
    _, val_prefix = distill_corpus.split(seqs[:150], 0.1)
    assert [s.id for s in val_prefix] == [s.id for s in val if int(s.id.split("-")[1]) < 150]
    assert distill_corpus.split(seqs, 0.0) == (seqs, [])
    with pytest.raises(ValueError, match=r"^validation share must be in \[0, 1\), got 1.0$"):
        distill_corpus.split(seqs, 1.0)


def test_describe_counts_items_and_response_tokens_by_source(tmp_path):
    run = write_run(tmp_path, [record(0), record(1, source="doc", temperature=0.7, response=(5, 6)),
                               record(2, source="doc")])
    assert distill_corpus.describe(distill_corpus.load(run, GUARD)) == {
        "items": 3, "sampled": 1, "response_tokens": 10, "tokens": 19,
        "by_source": {"doc": {"items": 2, "response_tokens": 6}, "man": {"items": 1, "response_tokens": 4}}}


def test_shards_are_gzip_with_the_same_bytes_for_the_same_records(tmp_path):
    """Committed shards must not change when a session makes them again: no timestamp, no name."""
    a = write_run(tmp_path / "a", [record(0), record(1), record(2)])
    b = write_run(tmp_path / "b", [record(0), record(1), record(2)])
    names = [p.name for p in sorted((a / "shards").iterdir())]
    assert names == ["shard-00000.jsonl.gz", "shard-00001.jsonl.gz"]
    for name in names:
        raw = (a / "shards" / name).read_bytes()
        assert raw[:2] == b"\x1f\x8b" and raw[4:8] == b"\0\0\0\0"   # gzip magic, mtime 0
        assert raw == (b / "shards" / name).read_bytes()
    assert [r["id"] for r in distill_shards.read_records(a / "shards")] == ["item-0", "item-1", "item-2"]
    assert ShardStore(a, 2)._next == 2   # a resumed store numbers on after the last shard


def test_shards_are_read_in_number_order_past_five_digits(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for n in (100000, 99999, 2):
        (shards / f"shard-{n:05d}.jsonl.gz").write_bytes(distill_shards.gzip_lines([f'{{"id": "{n}"}}']))
    assert [r["id"] for r in distill_shards.read_records(shards)] == ["2", "99999", "100000"]
