"""benchmarks/heldout_acceptance.py: the prompt spread, and one end-to-end run on a tiny served
checkpoint (ngram: no trained drafter needed) whose report pins the lossless check and the
acceptance arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import load_benchmark, make_served_checkpoint


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("heldout_acceptance")


def test_spread_takes_every_kth_item_and_all_when_asked_for_more(bench):
    items = list(range(10))
    assert bench.spread(items, 5) == [0, 2, 4, 6, 8]
    assert bench.spread(items, 3) == [0, 3, 6]
    assert bench.spread(items, 10) == items and bench.spread(items, 99) == items
    assert bench.spread(items, 0) == []


def test_a_run_reports_acceptance_and_the_lossless_check(bench, tmp_path):
    ckpt = Path(make_served_checkpoint(tmp_path / "t", seed=5, max_position_embeddings=2048))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "unk_token": "<unk>"}))
    out = tmp_path / "acc"
    rc = bench.main(["--target", str(ckpt), "--chat", "0", "--humaneval", "2", "--new-tokens", "12",
                     "--methods", "ngram", "--out", str(out)])
    report = json.loads(out.with_suffix(".json").read_text())
    assert rc == 0 and report["failures"] == []
    hum = report["sets"]["humaneval"]
    assert hum["prompts"] == ["HumanEval/0", "HumanEval/82"]
    none, ngram = hum["methods"]["none"], hum["methods"]["ngram"]
    assert none["mean_acceptance_length"] == 1.0 and none["draft_tokens_per_step"] == 0.0
    assert none["tokens"] == ngram["tokens"]
    # Each decode step commits its accepted drafts plus one token; a prompt's first token comes
    # from its prefill, which is no step: acceptance length = (tokens - prompts) / steps.
    assert none["steps"] == none["tokens"] - 2
    assert ngram["mean_acceptance_length"] == round((ngram["tokens"] - 2) / ngram["steps"], 3)
    assert "every method's output equals none's" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit):
        bench.main(["--target", str(ckpt), "--chat", "0", "--humaneval", "1", "--methods", "eagle"])
