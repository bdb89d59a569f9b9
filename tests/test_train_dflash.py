"""training/train_dflash.py --distill-dir: the DFlash cache holds exactly the folder's train-split
windows (prompt + response end to end, as distill_cache cuts them) with the target's features, a
held-out prompt in the folder stops it, and a short run split by --stop-at resumes exactly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_served_checkpoint, make_tiny_checkpoint
from specserve.model.transformer import load_model
from test_distill_cache import ITEMS, write_folder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import train_dflash  # noqa: E402
from heldout import HeldoutLeak, load_chat  # noqa: E402

TINY = ["--layers", "1", "--window", "4", "--pool-slots", "4", "--pool-rank", "8", "--block-sizes", "4,2",
        "--block-size", "4", "--seqs-per-step", "2", "--anchors", "2", "--seq-len", "4", "--ckpt-every", "1",
        "--validation-share", "0.5", "--threads", "1"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_served_checkpoint(tmp_path_factory.mktemp("t"), seed=6, num_hidden_layers=4)


def run(target_dir, folder, tmp_path, name, *extra):
    train_dflash.main(["--target", str(target_dir), "--distill-dir", str(folder), "--out", str(tmp_path / name),
                       "--work-dir", str(tmp_path / f"work-{name}"), *TINY, *extra])
    return torch.load(tmp_path / f"work-{name}" / "train.pt", weights_only=False)


def test_the_cache_is_the_folders_train_windows_and_a_split_run_resumes_exactly(target_dir, tmp_path):
    folder = write_folder(tmp_path / "d", ITEMS)
    whole = run(target_dir, folder, tmp_path, "whole", "--steps", "4")
    cache = torch.load(tmp_path / "work-whole" / "cache.pt", weights_only=False)
    assert cache["tokens"].tolist() == [[5, 6, 7, 8], [9, 20, 21, 22], [23, 24, 25, 26]]
    assert cache["num_self"] == 0 and cache["data"]["train_items"] == 2
    target = load_model(target_dir)
    want = train_dflash.target_cache(target, cache["tokens"], train_dflash.dflash_config_for(target).target_layers)
    assert torch.equal(cache["features"], want["features"]) and torch.equal(cache["argmax"], want["argmax"])

    half = run(target_dir, folder, tmp_path, "split", "--steps", "4", "--stop-at", "2")
    assert half["step"] == 2 and not (tmp_path / "split").exists()   # checkpointed; no drafter written yet
    split = run(target_dir, folder, tmp_path, "split", "--steps", "4")
    assert split["step"] == whole["step"] == 4 and split["log"] == whole["log"]
    assert all(torch.equal(split["drafter"][k], v) for k, v in whole["drafter"].items())
    summary = json.loads((tmp_path / "whole" / "training.json").read_text())
    assert summary["distill"]["distill_dirs"] == [folder.as_posix()]
    assert summary["heldout_acceptance_length"]["all"] is None   # no held-out set given: none is made up


def test_a_held_out_prompt_in_the_folder_stops_training(target_dir, tmp_path):
    folder = write_folder(tmp_path / "d", ITEMS, {"i0": load_chat()[3].text})
    with pytest.raises(HeldoutLeak, match=r"^training prompt contains held-out chat prompt 4: "):
        run(target_dir, folder, tmp_path, "x", "--steps", "1")
    assert not (tmp_path / "work-x" / "cache.pt").exists()


def test_the_cache_keeps_argmax_ids_past_int16(tmp_path):
    """A 49 k vocabulary (SmolLM2) overflows int16: the cache keeps the target's argmax as it is."""
    target = load_model(make_tiny_checkpoint(tmp_path / "t", "llama", vocab_size=40000, seed=1))
    tokens = torch.randint(0, 40000, (2, 16), generator=torch.Generator().manual_seed(0))
    cache = train_dflash.target_cache(target, tokens, (0,))
    with torch.no_grad():
        want = target.logits(target.forward(train_dflash.causal_batch(tokens), cache=None).hidden).argmax(-1)
    assert bool((want > 32767).any()) and torch.equal(cache["argmax"].long(), want)
