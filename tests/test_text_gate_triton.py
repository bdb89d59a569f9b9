"""The text-type gate through a real tritonserver: preprocess asks the `text_classifier` model (by
BLS) for dflash requests only; a prose prompt runs its fallback (the default tier's: ngram; a
tier's own), and spec_stats say why; a code prompt keeps dflash. Unloading text_classifier fails
no request (it keeps dflash), is counted as decision=unavailable and logged once; loading it
again restores the routing, and a published new version is loaded by name.

This server (a tiny random checkpoint) serves no DFlash drafter, so a request that keeps dflash is
refused by the engine ("unknown spec_method 'dflash'"), which is what proves it kept it; where the
test needs a request that keeps dflash to succeed, it calls the preprocess model directly and reads
its output. DFlash itself through tritonserver: tests/test_triton_dflash.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_served_checkpoint, running_server
from specserve.cli.main import SERVE_TRITON_ARGS
from specserve.triton import drafters
from specserve.serving import schema
from specserve.triton.client import CompletionError, StreamClient, build_inputs
from specserve.serving.params import RequestConfig
from specserve.serving.settings import DeploymentSettings
from specserve.triton.render import render_repository
from specserve.serving.tiers import Tier
from streams import scrape_metrics

pytestmark = pytest.mark.triton

CLASSIFIER = Path(__file__).resolve().parents[1] / "models" / "demo" / "text_classifier"
CODE = 'def add(a, b):\n    """Return the sum of a and b.\n'
PROSE = "The quick brown fox jumps over the lazy dog, and then it rests in the shade of a tree."
DFLASH = {"spec_method": "dflash", "max_tokens": 4}
DOCS = Tier("docs", "ngram", "none", 1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("text_gate_server")
    ckpt = make_served_checkpoint(root / "ckpt", seed=3, max_position_embeddings=256)
    repo = render_repository(DeploymentSettings(ckpt, max_num_seqs=4, max_model_len=256, max_draft_len=4,
                                                default_method="none", spec_threshold=None, tiers=(DOCS,),
                                                text_classifier=str(CLASSIFIER), draft_policy="fixed"),
                                                root / "model_repository")
    with running_server(repo, root, SERVE_TRITON_ARGS) as srv:
        yield srv


def gen(srv, model, prompt, sampling):
    return StreamClient(srv.grpc_url, model).generate(prompt, sampling, timeout=120)


def preprocess(srv, prompt, sampling) -> RequestConfig:
    """Call the preprocess model itself and return the request config it hands the engine."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(srv.grpc_url)
    result = client.infer(schema.PREPROCESS.name, build_inputs(prompt, sampling),
                          outputs=[grpcclient.InferRequestedOutput(schema.REQUEST_CONFIG.name)])
    return RequestConfig.from_json(result.as_numpy(schema.REQUEST_CONFIG.name).reshape(-1)[0])


def gate_count(srv, decision, tier="default") -> float:
    metrics = scrape_metrics(srv.metrics_url)
    return sum(v for k, v in metrics.items() if k.startswith("specserve_text_gate_total{")
               and f'decision="{decision}"' in k and f'tier="{tier}"' in k)


def test_prose_runs_the_fallback_and_code_keeps_dflash(server):
    prose = gen(server, "llm", PROSE, DFLASH)
    assert prose.spec_stats["method"] == "ngram" and prose.num_output_tokens == 4
    gate = prose.spec_stats["text_gate"]
    assert (gate["decision"], gate["method"], gate["text_type"], gate["dflash_text_types"]) == \
        ("fallback", "ngram", "prose", ["code"]) and gate["prob"] > 0.9
    # The tier's fallback (none) beats the server's; the request's spec_fallback beats the tier's.
    assert gen(server, "llm_docs", PROSE, DFLASH).spec_stats["method"] == "none"
    assert gen(server, "llm_docs", PROSE, {**DFLASH, "spec_fallback": "ngram"}).spec_stats["method"] == "ngram"
    # A request that does not ask for dflash is not classified.
    assert "text_gate" not in gen(server, "llm", PROSE, {"max_tokens": 4}).spec_stats
    with pytest.raises(CompletionError, match="unknown spec_method 'dflash'"):
        gen(server, "llm", CODE, DFLASH)          # kept dflash, which this server does not serve
    assert gate_count(server, "fallback") >= 1 and gate_count(server, "dflash") >= 1
    assert gate_count(server, "fallback", "docs") == 2


def test_unloading_the_classifier_fails_nothing_is_counted_and_logged_once(server):
    assert preprocess(server, PROSE, DFLASH).spec_method == "ngram"
    before = gate_count(server, "unavailable")
    drafters.unload(server.grpc_url, schema.TEXT_CLASSIFIER.name, server.admin_key)
    try:
        for _ in range(3):
            config = preprocess(server, PROSE, DFLASH)
            assert config.spec_method == "dflash"
            assert config.text_gate["decision"] == "unavailable" and config.text_gate["text_type"] is None
            assert "text_classifier" in config.text_gate["error"]
        # Requests that do not run dflash never notice.
        assert gen(server, "llm", PROSE, {"max_tokens": 4}).num_output_tokens == 4
    finally:
        drafters.load(server.grpc_url, schema.TEXT_CLASSIFIER.name, server.admin_key)
    assert preprocess(server, PROSE, DFLASH).spec_method == "ngram"
    assert gate_count(server, "unavailable") - before == 3
    log = server.log_file.read_text(errors="replace")
    assert log.count("text_classifier is unavailable") == 1, log[-3000:]
    assert log.count("text_classifier answers again") == 1


def test_a_published_classifier_version_is_loaded_while_serving(server, monkeypatch, capsys):
    from specserve.cli.main import main

    monkeypatch.setenv("SPECSERVE_ADMIN_KEY", server.admin_key)
    assert main(["drafters", "publish", "--classifier", str(CLASSIFIER), "--repository", str(server.repository),
                 "--load", "--url", server.grpc_url]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "loaded text_classifier"
    served = {(m.name, m.version): m.state for m in drafters.list_models(server.grpc_url, server.admin_key)}
    assert served[("text_classifier", "2")] == "READY"
    assert preprocess(server, PROSE, DFLASH).text_gate["decision"] == "fallback"
    assert main(["drafters", "publish", "--classifier", str(CLASSIFIER), "--drafter", "x",
                 "--repository", str(server.repository)]) == 2
    assert capsys.readouterr().err == ("specserve: error: drafters publish takes either --classifier or --target "
                                       "and --drafter\n")
