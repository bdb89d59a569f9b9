"""DFlash through a real tritonserver on the demo model: greedy output equals plain decoding, and
a bad spec_fallback gets its error naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.triton.client import CompletionError, StreamClient
from specserve.triton.launch import TritonServer
from specserve.triton.render import RepositorySettings, render_repository

pytestmark = pytest.mark.triton

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    repo = render_repository(RepositorySettings(DEMO / "target", max_num_seqs=4, max_model_len=512, max_draft_len=8,
                                                default_method="none",
                                                drafters=(("dflash", str(DEMO / "dflash")),)),
                             root / "model_repository")
    srv = TritonServer(repo, root, None, log_file=root / "tritonserver.log", exit_timeout_s=5)
    srv.start()
    try:
        srv.wait_ready(180)
    except BaseException:
        srv.stop()
        raise
    yield srv
    srv.stop()


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
