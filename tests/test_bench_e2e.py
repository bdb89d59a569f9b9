"""A short `specserve bench` run through a real tritonserver on a tiny random model with a random
EAGLE drafter beside it: the report's schema, every figure a finite number, same-run ratios to
`none` for every method (none, ngram, eagle), an unoffered method reported as skipped, and the
Markdown and PNGs written."""

from __future__ import annotations

import json
import math

import pytest

from specserve.cli.bench.command import main
from specserve.cli.bench.fallback import random_checkpoint
from specserve.model.transformer import load_model
from specserve.methods.eagle.drafter import save_eagle
from test_eagle import random_drafter

pytestmark = pytest.mark.triton

SUMMARY_FIGURES = ("output_throughput", "request_throughput", "ttft_s", "tpot_s", "itl_s", "e2e_s",
                   "mean_acceptance_length", "draft_tokens_per_step", "duration_s")


def numbers(obj, path=""):
    """Every number in a JSON value, with its path."""
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from numbers(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from numbers(v, f"{path}[{i}]")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    # No EOS: every request runs to its budget, so each has several streamed responses.
    ckpt = random_checkpoint(root / "ckpt", hidden=64, layers=2, heads=4, kv_heads=2, max_len=512)
    # An EAGLE drafter in a folder 'eagle' beside the target: the bench's server serves it.
    save_eagle(random_drafter(load_model(ckpt), seed=5), json.loads((ckpt / "config.json").read_text()),
               root / "eagle")
    out = root / "out"
    report = main(["--target", str(ckpt), "--quick", "--methods", "none,ngram,eagle,not_a_method",
                   "--num-requests", "6", "--output-range", "8,24", "--concurrency", "2",
                   "--request-rate", "4,8", "--open-loop-requests", "4", "--block-size", "3",
                   "--peer-requests", "2", "--peer-threads", "1", "--out", str(out)])
    return report, out


def test_report_schema_and_files(run):
    report, out = run
    on_disk = json.loads((out / "bench.json").read_text())
    assert on_disk == json.loads(json.dumps(report))
    for key in ("schema", "created_utc", "command", "machine", "model", "server", "workload", "methods",
                "settings", "phases", "peers", "notes"):
        assert key in on_disk, key
    assert on_disk["schema"] == "specserve-bench/1"
    assert {"cpu_model", "logical_cores", "torch"} <= set(on_disk["machine"])
    assert [p["name"] for p in on_disk["phases"]] == ["closed_c2", "open_4rps", "open_8rps"]
    assert on_disk["workload"]["num_requests"] == 6
    for name in ("bench.md", "latency_cdf.png", "throughput_vs_rate.png", "speedup.png", "tritonserver.log"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "bench.md").read_text()
    assert "| C=2 | ngram |" in md and "| λ=8/s | none |" in md and "hf_generate" in md


def test_every_figure_is_a_finite_number(run):
    report, _ = run
    bad = [(p, v) for p, v in numbers(report) if not math.isfinite(v)]
    assert not bad
    for phase in report["phases"]:
        for method, s in phase["methods"].items():
            assert s["errors"] == 0 and s["completed"] == s["requests"] > 0, (phase["name"], method)
            for key in SUMMARY_FIGURES:
                assert s[key] is not None, (phase["name"], method, key)


def test_ratios_to_none_from_the_same_run_for_every_method(run):
    report, _ = run
    methods = ["none", "ngram", "eagle"]
    assert report["methods"]["run"] == methods
    assert report["server"]["drafters"] and report["server"]["drafters"][0].startswith("eagle=")
    for phase in report["phases"]:
        assert set(phase["speedup_vs_none"]) == set(methods)
        for method, ratios in phase["speedup_vs_none"].items():
            assert all(v is not None and v > 0 for v in ratios.values()), (phase["name"], method, ratios)
        assert phase["speedup_vs_none"]["none"]["output_throughput"] == 1.0
        # Greedy speculation is lossless: the same text as plain decoding for every request.
        assert phase["identical_outputs_vs_none"] == {m: 1.0 for m in methods}
        # Every method ran every block, in rotating order.
        assert all(sorted(order) == sorted(methods) for order in phase["block_order"])
        assert phase["block_order"][0] != phase["block_order"][1]
    eagle = report["phases"][0]["methods"]["eagle"]
    assert eagle["draft_tokens_per_step"] > 0 and eagle["mean_acceptance_length"] >= 1.0


def test_unoffered_method_is_skipped_with_the_servers_reason(run):
    report, out = run
    assert "unknown spec_method 'not_a_method'" in report["methods"]["skipped"]["not_a_method"]
    assert all("not_a_method" not in p["methods"] for p in report["phases"])
    assert "not_a_method" in (out / "bench.md").read_text()


def test_peers_report_ratios_or_say_why_not(run):
    report, _ = run
    peers = report["peers"]
    assert peers["status"] == "run" and peers["specserve_best"] in ("none", "ngram", "eagle")
    for name in ("hf_generate", "hf_prompt_lookup", "specserve_none", "specserve_ngram", "specserve_eagle"):
        s = peers["systems"][name]
        assert s["status"] == "run" and s["requests"] == 2
        assert s["ratio_to_specserve_none"] > 0 and s["ratio_to_specserve_best"] > 0
    assert peers["systems"]["specserve_none"]["ratio_to_specserve_none"] == 1.0
    assert peers["systems"]["hf_assisted"] == {"status": "not run",
                                               "reason": "no draft model configured (--draft-model)"}
