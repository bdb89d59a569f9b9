"""training/train_eagle.py: runs end to end on a tiny target, is deterministic, and resumes exactly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from conftest import make_tiny_checkpoint
from specserve.model.transformer import load_model
from specserve.methods.eagle.drafter import load_eagle
from specserve.model.tiny import CORPUS, train_tiny_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import train_eagle  # noqa: E402


def run(target, text, out, work, steps, *extra):
    train_eagle.main(["--target", str(target), "--out", str(out), "--text-file", str(text),
                      "--heldout-file", str(text), "--work-dir", str(work), "--steps", str(steps),
                      "--seq-len", "48", "--batch", "2", "--self-prompts", "2", "--self-new-tokens", "8",
                      "--calib-prompts", "4", "--calib-new-tokens", "8", "--calib-epochs", "2",
                      "--calib-prompts-file", str(text), "--ckpt-every", "5", *extra])


def test_train_eagle_is_deterministic_and_resumes(tmp_path):
    target = Path(make_tiny_checkpoint(tmp_path / "target", "llama", vocab_size=400, seed=3))
    train_tiny_tokenizer(target, 400)
    text = tmp_path / "text.txt"
    text.write_text(("\n".join(CORPUS) + "\n") * 20)

    run(target, text, tmp_path / "straight", tmp_path / "w1", steps=10)
    run(target, text, tmp_path / "resumed", tmp_path / "w2", 10, "--stop-at", "5")
    assert not (tmp_path / "resumed").exists()  # interrupted runs write no drafter
    run(target, text, tmp_path / "resumed", tmp_path / "w2", steps=10)  # resumes at step 5

    model = load_model(target)
    a = load_eagle(tmp_path / "straight", model).state_dict()
    b = load_eagle(tmp_path / "resumed", model).state_dict()
    assert a.keys() == b.keys() and any(k.startswith("calibration.") for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    summary = json.loads((tmp_path / "straight" / "training.json").read_text())
    assert summary["steps"] == 10 and summary["calibration"]["heldout"]["examples"] > 0
    chunks = [t for t in text.read_text().split("\n\n") if t.strip()]
    assert summary["calibration_prompts"] == {"corpus_windows": 4, "serving_like": min(64, len(chunks))}
    log = (tmp_path / "straight" / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in log] == list(range(1, 11))


def test_the_shared_run_checkpoint_round_trips_a_run(tmp_path):
    """training/run_checkpoint.py (every trainer's resume point): weights under the script's key,
    optimizer, schedule, step and extras come back; no file → a fresh run."""
    from run_checkpoint import resume, save

    def run():
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        return m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))

    m, opt, sched = run()
    assert resume(tmp_path / "x.pt", "heads", m, opt, sched) is None
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched.step()
    save(tmp_path / "x.pt", "heads", m, opt, sched, 7, log=[{"step": 7}])
    m2, opt2, sched2 = run()
    state = resume(tmp_path / "x.pt", "heads", m2, opt2, sched2)
    assert (state["step"], state["log"]) == (7, [{"step": 7}])
    assert torch.equal(m2.weight, m.weight) and sched2.last_epoch == sched.last_epoch == 1
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
