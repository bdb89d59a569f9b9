"""The committed demo EAGLE drafter on the demo target: greedy output with eagle (fused, and the
exported ONNX drafter as the remote models run it) equals plain decoding on held-out prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specserve.core.engine import Engine, EngineConfig, GenerationRequest
from specserve.model.transformer import load_model
from specserve.methods.eagle.drafter import load_eagle
from specserve.methods.eagle.proposer import EagleProposer
from specserve.methods.eagle.export import export
from specserve.methods.eagle.onnx_runtime import CalibrationOnnxRuntime, EagleOnnxRuntime, in_process_call
from specserve.methods.remote import RemoteProposer
from specserve.core.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
TARGET, DRAFTER = ROOT / "models/demo/target", ROOT / "models/demo/eagle"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    for folder in (TARGET, DRAFTER):
        if not (folder / "config.json").is_file():
            pytest.fail(f"demo checkpoint missing at {folder}")
    from tokenizers import Tokenizer

    target = load_model(TARGET)
    drafter = load_eagle(DRAFTER, target)
    report = export(target, drafter, tmp_path_factory.mktemp("onnx"))
    rt = EagleOnnxRuntime(str(report.backbone), target.cfg.num_kv_heads, target.cfg.head_dim)
    cal = CalibrationOnnxRuntime(str(report.calibration))

    bf16 = load_eagle(DRAFTER, target, dtype=torch.bfloat16)  # bf16 drafting for the fp32 target
    proposers = {"eagle": EagleProposer(drafter, target, max_num_seqs=4, max_model_len=512, max_draft_len=6),
                 "eagle_bf16": EagleProposer(bf16, target, max_num_seqs=4, max_model_len=512, max_draft_len=6,
                                             name="eagle_bf16"),
                 "eagle_remote": RemoteProposer("eagle_remote", in_process_call(rt, cal), max_draft_len=6, timeout_s=600,
                                                   release=rt.release)}
    tok = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    lines = (ROOT / "models/demo/heldout_prompts.jsonl").read_text().splitlines()
    prompts = [tok.encode(json.loads(line)["prompt"]).ids for line in lines[:4]]
    return Engine(target, EngineConfig(max_num_seqs=4, max_model_len=512, max_draft_len=6), proposers), prompts


@pytest.mark.parametrize("method", ["eagle", "eagle_bf16", "eagle_remote"])
def test_demo_eagle_greedy_equals_plain(engine, method):
    eng, prompts = engine
    reqs = lambda m: [GenerationRequest(f"{m}{i}", p, SamplingParams(max_tokens=48), m) for i, p in enumerate(prompts)]
    plain, spec = eng.generate(reqs("none")), eng.generate(reqs(method))
    for i in range(len(prompts)):
        assert spec[f"{method}{i}"].new_token_ids == plain[f"none{i}"].new_token_ids, f"prompt {i}"
    stats = [o.stats for o in spec.values()]
    # A trained drafter drafts and gets tokens accepted on held-out text.
    assert sum(s.accepted_tokens for s in stats) > 0 and all(s.proposer_errors == 0 for s in stats)


@pytest.mark.parametrize("method", ["eagle", "eagle_remote"])
def test_per_request_draft_policy(engine, method):
    """num_draft_tokens caps each step's draft; spec_threshold=0 turns the calibration stop off
    (a fixed length), 1.0 stops before any token the head is not certain of. All stay lossless."""
    eng, prompts = engine
    n = 40

    def run(tag, **policy):
        out = eng.generate([GenerationRequest(f"{tag}{i}", p, SamplingParams(max_tokens=n), method, **policy)
                            for i, p in enumerate(prompts)])
        return [out[f"{tag}{i}"] for i in range(len(prompts))]

    plain = eng.generate([GenerationRequest(f"p{i}", p, SamplingParams(max_tokens=n), "none")
                          for i, p in enumerate(prompts)])
    fixed = run("fixed", num_draft_tokens=3, spec_threshold=0.0)
    strict = run("strict", spec_threshold=1.0)
    adaptive = run("adaptive")
    for i in range(len(prompts)):
        want = plain[f"p{i}"].new_token_ids
        assert fixed[i].new_token_ids == want and strict[i].new_token_ids == want
        assert adaptive[i].new_token_ids == want
    for o in fixed:
        st = o.stats
        # Every step drafts exactly 3, except the last ones, where max_tokens leaves less room.
        assert st.draft_tokens <= 3 * st.steps and st.draft_tokens >= 3 * (st.steps - 3)
        assert st.draft_seconds > 0 and st.verify_seconds > 0
    # With 1.0 only tokens whose predicted acceptance rounds to exactly 1.0 in float32 survive.
    n_strict, n_adaptive = (sum(o.stats.draft_tokens for o in runs) for runs in (strict, adaptive))
    assert n_strict * 10 < n_adaptive, (n_strict, n_adaptive)
