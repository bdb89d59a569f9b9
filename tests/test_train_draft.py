"""training/train_draft.py --init-from-target: the target cut to a few of its layers is exactly the
target when it keeps them all, the saved folder loads in transformers and serves as its assisted
generation's assistant_model (output equal to plain greedy) and as specserve's `draft` method, and
a short run on a distill folder's cache split by --stop-at resumes exactly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_served_checkpoint
from specserve.model.tokenizer import load_tokenizer
from specserve.model.transformer import load_model
from specserve.methods.draft.drafter import load_draft_model, save_draft_model
from test_distill_cache import ITEMS, write_folder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import distill_cache  # noqa: E402
import train_draft  # noqa: E402
from train_eagle import causal_batch  # noqa: E402


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def target_dir(request, tmp_path_factory):
    return make_served_checkpoint(tmp_path_factory.mktemp("t"), seed=8, num_hidden_layers=4, tie=request.param)


def logits(model, tokens):
    with torch.no_grad():
        return model.logits(model.forward(causal_batch(tokens), cache=None).hidden)


def test_spaced_layers_keep_the_first_and_the_last():
    assert train_draft.spaced_layers(30, 1) == [29]
    assert train_draft.spaced_layers(30, 2) == [0, 29]
    assert train_draft.spaced_layers(30, 4) == [0, 10, 19, 29]
    assert train_draft.spaced_layers(4, 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"^cannot keep 5 of the target's 4 layers$"):
        train_draft.spaced_layers(4, 5)


def test_keeping_every_layer_is_exactly_the_target_and_a_cut_keeps_the_named_layers(target_dir):
    target = load_model(target_dir)
    tokens = torch.randint(0, target.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    whole = train_draft.student_from_target(target, [0, 1, 2, 3])
    assert torch.equal(logits(whole, tokens), logits(target, tokens))
    assert whole.cfg.tie_word_embeddings == target.cfg.tie_word_embeddings
    cut = train_draft.student_from_target(target, [0, 3])
    assert cut.cfg.num_layers == 2 and cut.cfg.hidden_size == target.cfg.hidden_size
    for dst, src in zip(cut.layers, (target.layers[0], target.layers[3])):
        assert all(torch.equal(a, b) for a, b in zip(dst.state_dict().values(), src.state_dict().values()))
    assert torch.equal(cut.embed_tokens.weight, target.embed_tokens.weight)
    assert torch.equal(cut.lm_head.weight, target.lm_head.weight)
    with pytest.raises(SystemExit, match=r"^--target-layers \[0, 4\]: the target has layers 0\.\.3$"):
        train_draft.student_from_target(target, [0, 4])


def test_the_saved_draft_loads_in_transformers_and_assists_its_generation(target_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    target = load_model(target_dir)
    draft = train_draft.student_from_target(target, [0, 3])
    save_draft_model(draft, tmp_path / "draft", tokenizer_from=target_dir, dtype=torch.float32)
    assert sorted(p.name for p in (tmp_path / "draft").iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json"]
    hf_draft = AutoModelForCausalLM.from_pretrained(str(tmp_path / "draft")).eval()
    tokens = torch.randint(3, target.cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf_draft(tokens).logits, logits(draft, tokens), rtol=1e-4, atol=1e-4)
        hf_target = AutoModelForCausalLM.from_pretrained(str(target_dir)).eval()
        kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=2)
        plain = hf_target.generate(tokens, **kw)
        assisted = hf_target.generate(tokens, assistant_model=hf_draft, **kw)
    assert torch.equal(assisted, plain)
    served = load_draft_model(tmp_path / "draft", target, load_tokenizer(target_dir))   # what `draft` serves
    assert torch.equal(logits(served, tokens), logits(draft, tokens))


def test_a_short_run_on_a_distill_cache_resumes_exactly(target_dir, tmp_path):
    folder = write_folder(tmp_path / "d", ITEMS)
    distill_cache.main(["--target", str(target_dir), "--work-dir", str(tmp_path / "cache"), "--distill-dir",
                        str(folder), "--validation-share", "0.5", "--length", "4", "--top-k", "3"])

    def run(name, *extra):
        train_draft.main(["--target", str(target_dir), "--cache", str(tmp_path / "cache"), "--out",
                          str(tmp_path / name), "--work-dir", str(tmp_path / f"work-{name}"), "--init-from-target",
                          "--layers", "2", "--freeze-embedding", "--steps", "4", "--batch", "2", "--ckpt-every", "1",
                          "--accept-prompts", "2", "--accept-new-tokens", "6", "--max-draft-len", "2", *extra])
        return torch.load(tmp_path / f"work-{name}" / "draft.pt", weights_only=False)

    whole = run("whole")
    assert run("split", "--stop-at", "2")["step"] == 2 and not (tmp_path / "split").exists()
    split = run("split")
    assert split["step"] == whole["step"] == 4
    assert all(torch.equal(split["model"][k], v) for k, v in whole["model"].items())
    assert (tmp_path / "split" / "train_log.jsonl").read_text() == (tmp_path / "whole" / "train_log.jsonl").read_text()
    target = load_model(target_dir)
    assert torch.equal(whole["model"]["embed_tokens.weight"], target.embed_tokens.weight)   # frozen
    summary = json.loads((tmp_path / "whole" / "training.json").read_text())
    assert summary["init"] == {"from_target_layers": [0, 3], "frozen_embedding": True}
    assert summary["train_cache"]["distill_dirs"] == [folder.as_posix()]
    assert set(summary["heldout_teacher_forced_top1"]) == {"all", "distill_windows", "positions"}
    assert summary["acceptance_in_process"]["outputs_equal_none"] is True
