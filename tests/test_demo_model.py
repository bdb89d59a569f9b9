"""The committed demo target: still the model the card describes, and specserve reads it exactly.

(a) Held-out bits per byte on a fixed slice of held-out text, rebuilt from the corpus manifest,
    must stay within a small tolerance of the figure training/eval_target.py recorded in
    models/demo/eval.json — a broken, truncated or swapped checkpoint fails this.
(b) specserve's own model must give transformers' logits on the same checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

REPO = Path(__file__).resolve().parent.parent
TARGET = REPO / "models" / "demo" / "target"
EVAL_JSON = REPO / "models" / "demo" / "eval.json"
BPB_TOLERANCE = 0.05  # bits per byte; run-to-run noise is ~1e-6, a wrong checkpoint is off by >1

sys.path.insert(0, str(REPO / "training"))  # training/ holds scripts, not a package
import corpus  # noqa: E402
from eval_target import nats_and_bytes  # noqa: E402


@pytest.fixture(scope="module")
def hf_model():
    if not (TARGET / "config.json").is_file():
        pytest.fail(f"demo checkpoint missing at {TARGET}")
    model = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(TARGET)


def test_config_is_llama_with_eot_as_eos(hf_model):
    model, tok = hf_model
    assert model.config.model_type == "llama"
    assert model.config.eos_token_id == tok.convert_tokens_to_ids(corpus.EOT) == tok.eos_token_id
    probe = "def f(x):\n\treturn x  # héllo 世界 🙂 \x00\n"
    assert tok.decode(tok.encode(probe, add_special_tokens=False)) == probe


def test_heldout_bits_per_byte_matches_card(hf_model):
    recorded = json.loads(EVAL_JSON.read_text())["test_slice"]
    manifest = corpus.load_manifest()
    problems = corpus.verify(manifest, split="heldout")
    if problems:
        pytest.skip(f"this interpreter's stdlib differs from the corpus manifest ({problems[0]}, ...); "
                    "the held-out text cannot be rebuilt")
    model, tok = hf_model
    docs = corpus.heldout_slice(manifest, recorded["first_bytes"])
    got = nats_and_bytes(model, tok, docs)
    assert got["bytes"] == recorded["bytes"] and got["tokens"] == recorded["tokens"]
    assert got["bpb"] <= recorded["bpb"] + BPB_TOLERANCE, (
        f"held-out bpb {got['bpb']:.4f} exceeds the recorded {recorded['bpb']:.4f} + {BPB_TOLERANCE}")


def test_specserve_logits_match_transformers(hf_model):
    from specserve.model.transformer import load_model

    model, tok = hf_model
    # Text from the committed prompt file, so this check needs no stdlib match.
    prompts = [json.loads(ln) for ln in corpus.PROMPTS.read_text().splitlines() if ln]
    eot = tok.convert_tokens_to_ids(corpus.EOT)
    rows = [[eot] + tok.encode(p["prompt"] + p["reference"], add_special_tokens=False) for p in prompts[:4]]
    width = min(len(r) for r in rows)
    rows = [r[:width] for r in rows]  # [B=4, T=width]
    tokens = torch.tensor(rows)
    ours = load_model(TARGET, dtype=torch.float32)
    got = ours.score(tokens)  # [B, T, V]
    with torch.no_grad():
        want = model(input_ids=tokens).logits.float()  # [B, T, V]
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    assert diff <= 1e-3, f"specserve vs transformers logits differ by {diff}"
