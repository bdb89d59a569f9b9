"""DFlash through a real tritonserver on the demo model: greedy output equals plain decoding, a bad
spec_fallback gets its error naming the field, the text-type gate (the committed classifier)
keeps dflash for a code prompt and runs the fallback for a prose prompt where a tier says so, and
seeded sampled output equals plain seeded decoding alone and in a mixed batch."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from specserve.triton.client import CompletionError, StreamClient
from conftest import running_server
from specserve.serving.settings import DeploymentSettings
from specserve.triton.render import render_repository
from specserve.serving.tiers import Tier

pytestmark = pytest.mark.triton

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
# The server gates nothing away (DFlash for every text type); this tier keeps DFlash for code only.
CODE_ONLY = Tier("gated", "dflash", "ngram", 1, dflash_text_types=("code",))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    repo = render_repository(DeploymentSettings(DEMO / "target", max_num_seqs=4, max_model_len=512, max_draft_len=8,
                                                default_method="none",
                                                drafters=(("dflash", str(DEMO / "dflash")),),
                                                text_classifier=str(DEMO / "text_classifier"),
                                                dflash_text_types=("code", "prose"), tiers=(CODE_ONLY,),
                                                draft_policy="fixed"),
                             root / "model_repository")
    with running_server(repo, root) as srv:
        yield srv


def test_greedy_dflash_equals_none_through_triton(server):
    client = StreamClient(server.grpc_url)
    rows = [json.loads(line) for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()]
    for row in (rows[1], rows[-1]):   # one code prompt, one prose prompt
        plain = client.generate(row["prompt"], {"max_tokens": 32, "spec_method": "none"})
        spec = client.generate(row["prompt"], {"max_tokens": 32, "spec_method": "dflash"})
        assert spec.text == plain.text, row["id"]
        st = spec.spec_stats
        assert st["method"] == "dflash" and st["draft_tokens"] > 0 and st["proposer_errors"] == 0
        assert st["accepted_tokens"] > 0 and "guard_steps" in st
    # a request's own block size: whole blocks of 4 (spec_threshold 0 cuts nothing) → 3 drafted per step
    small = client.generate(rows[1]["prompt"], {"max_tokens": 32, "spec_method": "dflash", "dflash_block_size": 4,
                                                "spec_threshold": 0})
    assert small.text == client.generate(rows[1]["prompt"], {"max_tokens": 32, "spec_method": "none"}).text
    st = small.spec_stats
    assert st["draft_tokens"] <= 3 * st["drafts"] and st["draft_tokens"] > 2 * st["drafts"], st


def test_bad_spec_fallback_is_refused_naming_the_field(server):
    client = StreamClient(server.grpc_url)
    with pytest.raises(CompletionError) as err:
        client.generate("def f(x):", {"max_tokens": 4, "spec_method": "dflash", "spec_fallback": "dflash"}, timeout=30)
    assert str(err.value) == ("in ensemble 'llm', sampling_parameters.spec_fallback must name a method other than "
                              "dflash, got \"dflash\"")
    with pytest.raises(CompletionError) as err:
        client.generate("def f(x):", {"max_tokens": 4, "spec_method": "dflash", "spec_fallback": "eagle"}, timeout=30)
    assert str(err.value) == "in ensemble 'llm', unknown fallback method 'eagle'; available: dflash, ngram, none"
    ok = client.generate("def f(x):", {"max_tokens": 4, "spec_method": "dflash", "spec_fallback": "none"})
    assert ok.spec_stats["method"] == "dflash"


def test_the_text_gate_routes_prose_to_the_fallback_and_keeps_dflash_for_code(server):
    rows = [json.loads(line) for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()]
    for row, method, decision in ((rows[1], "dflash", "dflash"), (rows[-1], "ngram", "fallback")):
        assert row["kind"] == {"dflash": "code", "ngram": "prose"}[method]
        plain = StreamClient(server.grpc_url).generate(row["prompt"], {"max_tokens": 24, "spec_method": "none"})
        got = StreamClient(server.grpc_url, "llm_gated").generate(row["prompt"], {"max_tokens": 24})
        assert got.text == plain.text, row["id"]
        st = got.spec_stats
        assert (st["method"], st["text_gate"]["decision"], st["text_gate"]["text_type"]) == \
            (method, decision, row["kind"]), st
        assert st["draft_tokens"] > 0


# -- seeded sampling (core/sampling.py): the seed alone decides the text, DFlash's block included ------

SEEDED = [{"temperature": 0.7, "top_k": 50, "seed": 21}, {"temperature": 1.0, "top_p": 0.9, "seed": 22}]


def seeded(srv, prompt, method, sampling, max_tokens=40):
    return StreamClient(srv.grpc_url).generate(
        prompt, {"max_tokens": max_tokens, "ignore_eos": True, "spec_method": method, **sampling}, timeout=300)


def test_seeded_dflash_equals_none_alone_and_in_a_mixed_batch(server):
    """DFlash's fused block drafter proposes with the request's noise: each seeded text is none's
    for the same seed, alone and among concurrent requests of other methods and seeds, greedy
    and unseeded (max_num_seqs 4: the batch holds them together)."""
    rows = [json.loads(line) for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()]
    code, prose = rows[1]["prompt"], rows[-1]["prompt"]
    cases = [(code, SEEDED[0]), (prose, SEEDED[1])]
    want = [seeded(server, p, "none", s).text for p, s in cases]
    for (p, s), text in zip(cases, want):
        got = seeded(server, p, "dflash", s)
        assert got.text == text, s
        st = got.spec_stats
        assert st["method"] == "dflash" and st["draft_tokens"] > 0 and st["proposer_errors"] == 0, st
    jobs = [("dflash", code, SEEDED[0]), ("dflash", prose, SEEDED[1]), ("ngram", code, SEEDED[1]),
            ("dflash", prose, {}), ("none", code, {"temperature": 1.0}), ("dflash", code, {"temperature": 0.7})]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: seeded(server, j[1], j[0], j[2]), jobs))
    assert results[0].text == want[0] and results[1].text == want[1]
    assert results[2].text == seeded(server, code, "none", SEEDED[1]).text
    for r in results[:2]:
        assert r.spec_stats["draft_tokens"] > 0 and r.spec_stats["proposer_errors"] == 0, r.spec_stats
    assert all(r.finish_reason == "length" for r in results)
