"""training/distill_cache.py --distill-dir: a self-distillation folder's items become exactly the
expected windows (prompt + response, end to end, the folder's own split by item id hash), run
through the target once, with the folder and the split in the meta; a held-out prompt in the
folder stops the build before anything is written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_checkpoint
from specserve.model.transformer import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import distill_cache  # noqa: E402
from distill_shards import gzip_lines  # noqa: E402
from heldout import HeldoutLeak, load_chat  # noqa: E402
from train_eagle import causal_batch  # noqa: E402

# With --validation-share 0.5 the id hash puts i1 and i2 in the validation split, i0 and i3 in train.
ITEMS = {"i0": ([5, 6, 7], [8, 9]), "i1": ([10, 11], [12, 13, 14]), "i2": ([15], [16, 17, 18, 19]),
         "i3": ([20, 21, 22], [23, 24, 25, 26])}


def write_folder(root: Path, items: dict, contents: dict | None = None) -> Path:
    """A distill_data.py output folder: whole shards of finished items, a partial one being written."""
    shards = root / "shards"
    shards.mkdir(parents=True)
    rows = [json.dumps({"id": i, "phase": "response", "source": "man", "messages": [
        {"role": "user", "content": (contents or {}).get(i, f"question {i}")}],
        "sampling": {"temperature": 0.7 if i == "i3" else 0.0}, "prompt_ids": p, "response_ids": r})
        for i, (p, r) in items.items()]
    (shards / "shard-00000.jsonl.gz").write_bytes(gzip_lines(rows[:2]))
    (shards / "shard-00001.jsonl.gz").write_bytes(gzip_lines(rows[2:]))
    (shards / "shard-00002.tmp").write_text("partial")
    return root


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("t"), "llama", seed=4)


def build(target_dir, folder, work, *extra):
    distill_cache.main(["--target", str(target_dir), "--work-dir", str(work), "--distill-dir", str(folder),
                        "--validation-share", "0.5", "--length", "4", "--top-k", "3", *extra])


def test_the_folder_gives_exactly_the_expected_windows_and_the_targets_outputs(target_dir, tmp_path):
    folder = write_folder(tmp_path / "d", ITEMS)
    build(target_dir, folder, tmp_path / "w")
    train = distill_cache.DistillCache(**torch.load(tmp_path / "w" / "train.pt", weights_only=False)["cache"])
    val = distill_cache.DistillCache(**torch.load(tmp_path / "w" / "heldout.pt", weights_only=False)["cache"])
    # train: i0 then i3 end to end, cut every 4 tokens; validation: i1 then i2, the rest [18, 19] dropped
    assert train.tokens.tolist() == [[5, 6, 7, 8], [9, 20, 21, 22], [23, 24, 25, 26]]
    assert val.tokens.tolist() == [[10, 11, 12, 13], [14, 15, 16, 17]]

    target = load_model(target_dir)
    with torch.no_grad():
        h = target.forward(causal_batch(train.tokens), cache=None).hidden  # [3, 4, D]
        top = target.logits(h).topk(3, dim=-1)
    torch.testing.assert_close(train.hidden, h.half())
    assert torch.equal(train.top_ids, top.indices)
    torch.testing.assert_close(train.top_logits, top.values.half())

    m = train.meta
    assert {k: m[k] for k in ("split", "distill_dirs", "validation_share", "max_items", "items", "sampled_items",
                              "item_tokens", "response_tokens", "distill_windows", "corpus_windows",
                              "greedy_continuations", "length", "top_k", "tokens")} == {
        "split": "train", "distill_dirs": [folder.as_posix()], "validation_share": 0.5, "max_items": None,
        "items": 2, "sampled_items": 1, "item_tokens": 12, "response_tokens": 6, "distill_windows": 3,
        "corpus_windows": 0, "greedy_continuations": 0, "length": 4, "top_k": 3, "tokens": 12}
    assert (val.meta["split"], val.meta["items"], val.meta["distill_windows"]) == ("validation", 2, 2)
    assert distill_cache.row_groups(m) == {"distill_windows": slice(0, None)}
    assert (folder / "shards" / "shard-00002.tmp").read_text() == "partial"   # read only


def test_max_items_takes_the_first_items_and_a_grown_folder_rebuilds(target_dir, tmp_path):
    folder = write_folder(tmp_path / "d", ITEMS)
    build(target_dir, folder, tmp_path / "w", "--max-items", "3")   # i0, i1, i2: i3 is left out
    train = torch.load(tmp_path / "w" / "train.pt", weights_only=False)["cache"]
    assert train["tokens"].tolist() == [[5, 6, 7, 8]] and train["meta"]["max_items"] == 3
    build(target_dir, folder, tmp_path / "w")
    assert torch.load(tmp_path / "w" / "train.pt", weights_only=False)["cache"]["tokens"].shape == (3, 4)


def test_a_held_out_prompt_in_the_folder_stops_the_build(target_dir, tmp_path):
    leaked = load_chat()[0].text
    folder = write_folder(tmp_path / "d", ITEMS, {"i2": f"Please answer: {leaked}"})
    with pytest.raises(HeldoutLeak, match=r"^training prompt contains held-out chat prompt 1: "):
        build(target_dir, folder, tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_several_folders_are_read_end_to_end_in_order_and_a_repeated_item_is_refused(target_dir, tmp_path):
    """--distill-dir given twice: the first folder's items, then the second's, split by id as one."""
    first = write_folder(tmp_path / "d1", ITEMS)
    second = write_folder(tmp_path / "d2", {"j0": ([30, 31], [32, 33]), "j1": ([34], [35, 36, 37]),
                                            "j2": ([38, 39, 40], [41])})   # j1 in the validation split
    distill_cache.main(["--target", str(target_dir), "--work-dir", str(tmp_path / "w"), "--distill-dir", str(first),
                        "--distill-dir", str(second), "--validation-share", "0.5", "--length", "4", "--top-k", "3"])
    train = torch.load(tmp_path / "w" / "train.pt", weights_only=False)["cache"]
    # train: i0, i3 (the first folder), then j0, j2 (the second), end to end, cut every 4 tokens
    assert train["tokens"].tolist() == [[5, 6, 7, 8], [9, 20, 21, 22], [23, 24, 25, 26], [30, 31, 32, 33],
                                        [38, 39, 40, 41]]
    assert train["meta"]["distill_dirs"] == [first.as_posix(), second.as_posix()]
    val = torch.load(tmp_path / "w" / "heldout.pt", weights_only=False)["cache"]
    assert val["tokens"].tolist() == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 34, 35]]
    with pytest.raises(SystemExit, match=rf"^item i0 is in both {first} and {first}: give a folder once"):
        distill_cache.distill_splits([first, first], share=0.5)


def test_a_bf16_cache_is_built_apart_and_follows_the_fp32_one(target_dir, tmp_path):
    """--bf16: the target forward under autocast; the cache says so, is not taken for the fp32
    one (same work dir: rebuilt), and its hidden states stay close to fp32's."""
    folder = write_folder(tmp_path / "d", ITEMS)
    build(target_dir, folder, tmp_path / "w")
    fp32 = torch.load(tmp_path / "w" / "train.pt", weights_only=False)
    build(target_dir, folder, tmp_path / "w", "--bf16")
    bf16 = torch.load(tmp_path / "w" / "train.pt", weights_only=False)
    assert (fp32["want"]["bf16_autocast"], bf16["want"]["bf16_autocast"]) == (False, True)
    assert bf16["cache"]["meta"]["bf16_autocast"] is True
    assert torch.equal(bf16["cache"]["tokens"], fp32["cache"]["tokens"])
    a, b = fp32["cache"]["hidden"].float(), bf16["cache"]["hidden"].float()
    assert not torch.equal(a, b) and float((a - b).norm() / a.norm()) < 0.05
    with pytest.raises(SystemExit):
        distill_cache.main(["--target", str(target_dir), "--work-dir", str(tmp_path / "x"), "--bf16"])
