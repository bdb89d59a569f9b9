"""benchmarks/eagle_triton_bench.py on the committed demo model and drafter, two real
tritonservers (fused and remote placement), held-out prompts: every configuration's greedy text
equals `none`'s (the script exits otherwise), the per-request draft policy reaches the engine
through Triton (fixed 4 tokens), and the remote drafter is called once per decode step through
BLS, with the drafter models' compute inside that call."""

from __future__ import annotations

import json
import math

import pytest

from conftest import load_benchmark

pytestmark = pytest.mark.triton


def test_eagle_triton_bench_runs_every_configuration(tmp_path):
    out = tmp_path / "r.json"
    result = load_benchmark("eagle_triton_bench").main(["--prompts", "2", "--new-tokens", "24", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    rows = result["configs"]
    assert list(rows) == ["none", "eagle", "eagle_fixed4", "eagle_remote", "none_remote"]
    for name, r in rows.items():
        assert r.pop("identical_to_none") == "2/2", name
        assert r["requests"] == 2 and r["output_tokens"] == 48, name
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), name
        assert r["draft_ms"] >= 0 and r["verify_ms"] > 0 and r["step_ms"] > 0, name
    for name in ("none", "none_remote"):
        assert rows[name]["mean_acceptance_length"] == 1.0 and rows[name]["draft_tokens_per_step"] == 0
    # Fixed length 4: every step drafts 4 except where max_tokens leaves less room.
    assert 3.0 < rows["eagle_fixed4"]["draft_tokens_per_step"] <= 4.0
    assert rows["eagle"]["mean_acceptance_length"] > 1.5
    # Same weights in both placements, but fp32 ONNX remote vs (on bf16 hardware) bf16 fused
    # drafting, and the remote request length follows the last cut: close, not equal.
    assert rows["eagle_remote"]["mean_acceptance_length"] > 1.5
    remote = result["remote_placement"]
    # One BLS call per step that has room to draft: a request's last step (one token left to
    # emit) has none and makes no call, so up to one step per request goes without.
    assert remote["steps"] == rows["eagle_remote"]["steps"]
    assert remote["steps"] - 2 <= remote["proposal_calls"] <= remote["steps"]
    assert remote["proposal_calls"] > 0 and remote["drafter_models_compute_ms"] > 0
    # (Whether the models' compute fits inside the call's wall time is a timing question on a
    # shared machine — releases run outside the calls — so it is reported, not asserted.)
