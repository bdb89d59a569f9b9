"""The text-type gate (specserve/serving/text_gate.py): the feature function, the committed classifier
(pinned examples, held-out accuracy recomputed, the 40 demo prompts), routing in both
configurations, the fallback order, the preprocess rewrite, an unavailable classifier, and its
configuration (tiers file, renderer, CLI)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from specserve.serving.text_classifier import (Classification, ClassifierUnavailable, FeatureParams, GateError,
                                               TextClassifier, check_text_types, features, parse_text_types)
from specserve.serving.text_gate import DEFAULT_FALLBACK, GATED_METHOD, TextGate, resolve_fallback, route
from specserve.serving.params import BadRequest, RequestConfig, make_request_config
from specserve.serving.tiers import ServerLimits, Tier, TierError, parse_tier

REPO = Path(__file__).resolve().parents[1]
CLASSIFIER = REPO / "models" / "demo" / "text_classifier"
TARGET = REPO / "models" / "demo" / "target"

CODE_PROMPT = 'def add(a, b):\n    """Return the sum of a and b.\n'
PROSE_PROMPT = "The quick brown fox jumps over the lazy dog, and then it rests in the shade of a tree."


@pytest.fixture(scope="module")
def clf():
    return TextClassifier(CLASSIFIER)


# -- features ---------------------------------------------------------------------------------------
def test_features_are_pinned():
    v = features("def f(x):\n    return x\n")
    assert v.shape == (FeatureParams().dim,) == (3073,) and v.dtype == np.float32
    nz = np.flatnonzero(v)
    assert len(nz) == 101 and nz[:8].tolist() == [20, 63, 70, 80, 142, 387, 441, 555]
    assert v[20] == pytest.approx(0.117889, abs=1e-6)
    assert v[-1] == pytest.approx(np.log1p(23) / 10)           # 23 bytes
    assert np.flatnonzero(features("ab")).tolist() == [283, 677, 678, 3072]
    # Each n-gram block is L2-normalised, so the text's length shows only in the last feature.
    assert np.linalg.norm(v[:2048]) == pytest.approx(1.0) and np.linalg.norm(v[2048:3072]) == pytest.approx(1.0)


def test_features_read_only_the_last_max_chars():
    params = FeatureParams(max_chars=8)
    assert np.array_equal(features("x" * 100 + "abcdefgh", params), features("abcdefgh", params))
    assert not features("").any()


# -- the committed classifier -------------------------------------------------------------------------
@pytest.mark.parametrize("text,kind", [
    (CODE_PROMPT, "code"),
    ("for i in range(10):\n    total += i * i\nprint(total)\n", "code"),
    ('{"name": "specserve", "version": 3, "tags": ["llm", "triton"]}', "code"),
    ("server:\n  host: 0.0.0.0\n  port: 8000\n  workers: 4\n", "code"),
    ("SELECT id, name FROM users WHERE age > 30 ORDER BY name;", "code"),
    ("<ul>\n  <li><a href=\"/docs\">Docs</a></li>\n</ul>\n", "code"),
    (PROSE_PROMPT, "prose"),
    ("Use the `max_tokens` parameter to limit how many tokens the model writes before it stops.", "prose"),
    ("Please summarise the following article in three sentences. The article is about the history "
     "of the printing press in Europe.", "prose"),
])
def test_committed_classifier_on_pinned_examples(clf, text, kind):
    found = clf.classify(text)
    assert found.text_type == kind and found.prob > 0.5


def test_heldout_accuracy_recomputed_from_the_committed_model(clf):
    """A fixed sample of the held-out documents' samples (written by the training script, never
    trained on): accuracy must reach the goal of 0.95."""
    rows = [json.loads(ln) for ln in (CLASSIFIER / "heldout_sample.jsonl").read_text().splitlines()]
    assert len(rows) == 400 and sum(r["label"] == "code" for r in rows) == 200
    p = clf.p_code([r["text"] for r in rows])
    pred = np.where(p >= clf.cfg.threshold, "code", "prose")
    acc = float((pred == np.array([r["label"] for r in rows])).mean())
    assert acc >= 0.95, acc


def test_the_40_heldout_demo_prompts_are_classified_by_their_kind(clf):
    prompts = [json.loads(ln) for ln in (REPO / "models/demo/heldout_prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 40
    got = [clf.classify(p["prompt"]).text_type for p in prompts]
    assert got == [p["kind"] for p in prompts]


def test_classifier_folder_errors(tmp_path):
    with pytest.raises(GateError, match="config.json is missing"):
        TextClassifier(tmp_path)
    (tmp_path / "config.json").write_text((CLASSIFIER / "config.json").read_text())
    with pytest.raises(GateError, match="model.onnx is missing"):
        TextClassifier(tmp_path)


# -- routing ----------------------------------------------------------------------------------------
def test_route_both_configurations():
    code, prose = Classification("code", 0.9), Classification("prose", 0.8)
    assert route(code, ("code",), "eagle").method == GATED_METHOD
    assert route(prose, ("code",), "eagle").method == "eagle"
    assert route(code, ("prose",), "eagle").method == "eagle"       # the reverse configuration
    assert route(prose, ("prose",), "eagle").method == GATED_METHOD
    assert route(prose, ("code", "prose"), "eagle").method == GATED_METHOD
    assert route(code, (), "none").method == "none"
    assert route(prose, ("code",), "eagle").to_dict() == {
        "decision": "fallback", "method": "eagle", "text_type": "prose", "prob": 0.8, "dflash_text_types": ["code"]}


def test_fallback_order_request_then_tier_then_ngram():
    tier = Tier("t", GATED_METHOD, fallback="eagle")
    assert resolve_fallback("none", tier) == "none"
    assert resolve_fallback(None, tier) == "eagle"
    assert resolve_fallback(None, "default") == DEFAULT_FALLBACK == "ngram"
    assert resolve_fallback(None, Tier("t", "eagle", fallback=GATED_METHOD)) == "ngram"
    with pytest.raises(BadRequest, match="spec_fallback must name a method other than dflash, got 'dflash'"):
        resolve_fallback(GATED_METHOD, tier)


class Counter:
    def __init__(self):
        self.seen = []

    def __call__(self, decision, tier):
        self.seen.append((decision, tier))


def _config(sampling: dict, tier="default") -> RequestConfig:
    return make_request_config(json.dumps(sampling), False, None, tier)


def test_gate_routes_a_code_and_a_prose_prompt_as_configured(clf):
    count = Counter()
    gate = TextGate(clf.classify, ("code",), count=count)
    code = gate.apply(CODE_PROMPT, _config({"spec_method": "dflash"}))
    prose = gate.apply(PROSE_PROMPT, _config({"spec_method": "dflash"}))
    assert code.spec_method == GATED_METHOD and code.text_gate["decision"] == "dflash"
    assert prose.spec_method == "ngram" and prose.text_gate["decision"] == "fallback"
    assert prose.text_gate["text_type"] == "prose" and prose.text_gate["prob"] > 0.5
    assert count.seen == [("dflash", "default"), ("fallback", "default")]

    reverse = TextGate(clf.classify, ("prose",))
    assert reverse.apply(CODE_PROMPT, _config({"spec_method": "dflash", "spec_fallback": "none"})).spec_method == "none"
    assert reverse.apply(PROSE_PROMPT, _config({"spec_method": "dflash"})).spec_method == GATED_METHOD


def test_gate_leaves_other_methods_alone_and_uses_the_default_method():
    def never(text):
        raise AssertionError("classified a request that does not run dflash")

    gate = TextGate(never, default_method="eagle")
    config = _config({"spec_method": "ngram"})
    assert gate.apply(PROSE_PROMPT, config) is config
    assert gate.apply(PROSE_PROMPT, _config({})).text_gate is None
    dflash_default = TextGate(lambda t: Classification("prose", 0.9), default_method=GATED_METHOD)
    assert dflash_default.apply(PROSE_PROMPT, _config({})).spec_method == "ngram"


def test_tier_types_and_fallback_apply(clf):
    tier = Tier("docs", GATED_METHOD, fallback="eagle", dflash_text_types=("prose",), block_size=4)
    gate = TextGate(clf.classify, ("code",))
    code = gate.apply(CODE_PROMPT, _config({}, tier), tier)
    # routed away: dflash's options (the tier's block size) go with it, eagle would refuse them
    assert code.spec_method == "eagle" and code.fallback_method is None and code.tier == "docs"
    assert code.options is None
    prose = gate.apply(PROSE_PROMPT, _config({}, tier), tier)
    assert prose.spec_method == GATED_METHOD and prose.fallback_method == "eagle"   # the tier's, if dflash is down
    assert prose.options == {"dflash_block_size": 4}


def test_unavailable_classifier_keeps_dflash_counts_and_logs_each_transition(caplog):
    state = {"up": False}

    def classify(text):
        if not state["up"]:
            raise ClassifierUnavailable("text_classifier: model is not ready")
        return Classification("prose", 0.9)

    count = Counter()
    gate = TextGate(classify, count=count)
    with caplog.at_level(logging.WARNING, logger="specserve.serving.text_gate"):
        for _ in range(3):
            c = gate.apply(PROSE_PROMPT, _config({"spec_method": "dflash"}))
            assert c.spec_method == GATED_METHOD
            assert c.text_gate == {"decision": "unavailable", "method": "dflash", "text_type": None, "prob": None,
                                   "dflash_text_types": ["code"], "error": "text_classifier: model is not ready"}
        state["up"] = True
        assert gate.apply(PROSE_PROMPT, _config({"spec_method": "dflash"})).spec_method == "ngram"
        state["up"] = False
        gate.apply(PROSE_PROMPT, _config({"spec_method": "dflash"}))
    assert [d for d, _ in count.seen] == ["unavailable"] * 3 + ["fallback", "unavailable"]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3, messages          # down, back, down again: once per transition
    assert "unavailable" in messages[0] and "answers again" in messages[1] and "unavailable" in messages[2]


def test_preprocess_rewrites_the_signed_config(clf):
    from specserve.serving.auth import check_signature
    from specserve.serving.preprocess import Preprocessor

    pre = Preprocessor(TARGET, max_model_len=512, internal_key="k", gate=TextGate(clf.classify))
    sampling = json.dumps({"spec_method": "dflash", "max_tokens": 8})
    code = pre(CODE_PROMPT, False, sampling, None)
    prose = pre(PROSE_PROMPT.encode(), False, sampling, None)
    assert code.config.spec_method == GATED_METHOD and prose.config.spec_method == "ngram"
    sent = RequestConfig.from_json(prose.config_json)
    assert sent.spec_method == "ngram" and sent.text_gate["decision"] == "fallback"
    check_signature("k", prose.input_ids, prose.config_json, prose.signature)   # the rewrite is what is signed
    with pytest.raises(BadRequest, match="spec_fallback must name a method other than dflash"):
        pre(PROSE_PROMPT, False, json.dumps({"spec_method": "dflash", "spec_fallback": "dflash"}), None)
    with pytest.raises(BadRequest, match=r"sampling_parameters.spec_fallback must be a string, got 3"):
        pre(PROSE_PROMPT, False, json.dumps({"spec_fallback": 3}), None)


def test_spec_stats_show_the_decision():
    from types import SimpleNamespace

    from specserve.core.engine import SpecStats
    from specserve.serving.verifier_service import _spec_stats

    decision = {"decision": "fallback", "method": "ngram", "text_type": "prose", "prob": 0.99,
                "dflash_text_types": ["code"]}
    stream = SimpleNamespace(config=RequestConfig(tier="default", text_gate=decision))
    stats = _spec_stats(stream, SimpleNamespace(stats=SpecStats(method="ngram")))
    assert stats["text_gate"] == decision and stats["method"] == "ngram"
    assert "text_gate" not in _spec_stats(SimpleNamespace(config=RequestConfig()),
                                          SimpleNamespace(stats=SpecStats(method="none")))


# -- configuration ----------------------------------------------------------------------------------
def test_text_types_are_validated():
    assert parse_text_types("code, prose") == ("code", "prose") and parse_text_types("") == ()
    with pytest.raises(GateError, match=r"--dflash-text-types must list distinct text types from code, prose, "
                                        r'got \["code", "poetry"\]'):
        parse_text_types("code,poetry")
    with pytest.raises(GateError, match='must be a list of text types \\(code, prose\\), got "code"'):
        check_text_types("code", "x")


def test_tier_dflash_text_types():
    server = ServerLimits(("none", "ngram", "eagle", GATED_METHOD), 8, 512)
    tier = parse_tier({"name": "docs", "method": GATED_METHOD, "fallback": "eagle",
                       "proposer": {"dflash_text_types": ["prose"]}}, server, 0)
    assert tier.dflash_text_types == ("prose",) and Tier.from_json(tier.to_json()) == tier
    with pytest.raises(TierError, match="tier 'docs': proposer.dflash_text_types must list distinct text types"):
        parse_tier({"name": "docs", "method": GATED_METHOD, "proposer": {"dflash_text_types": ["json"]}}, server, 0)
    with pytest.raises(TierError, match="proposer.dflash_text_types applies to method dflash only, not 'eagle'"):
        parse_tier({"name": "x", "method": "eagle", "proposer": {"dflash_text_types": ["code"]}}, server, 0)


def test_renderer_serves_the_classifier_and_configures_preprocess(tmp_path):
    from specserve.serving.settings import DeploymentSettings
    from specserve.triton.render import render_repository

    repo = render_repository(DeploymentSettings(TARGET, text_classifier=str(CLASSIFIER),
                                                dflash_text_types=("prose",), default_method="ngram",
                                                tiers=(Tier("docs", "ngram"),), draft_policy="fixed"),
                                                tmp_path / "repo")
    assert sorted(p.name for p in (repo / "text_classifier" / "1").iterdir()) == ["config.json", "model.onnx",
                                                                                   "model.py"]
    for pre in ("preprocess", "preprocess_docs"):
        config = (repo / pre / "config.pbtxt").read_text()
        assert 'key: "text_gate" value: { string_value: "{\\"dflash_text_types\\": [\\"prose\\"]}" }' in config
        assert 'key: "default_method" value: { string_value: "ngram" }' in config
    plain = render_repository(DeploymentSettings(TARGET, draft_policy="fixed"), tmp_path / "plain")
    assert not (plain / "text_classifier").exists()
    assert 'key: "text_gate" value: { string_value: "" }' in (plain / "preprocess" / "config.pbtxt").read_text()
    with pytest.raises(GateError, match="is not a text classifier folder: config.json is missing"):
        render_repository(DeploymentSettings(TARGET, text_classifier=str(tmp_path), draft_policy="fixed"),
                          tmp_path / "bad")


def test_cli_resolves_the_classifier():
    from specserve.cli.checks import CliError
    from specserve.cli.main import resolve_text_classifier

    served = ["none", "ngram", GATED_METHOD]
    assert resolve_text_classifier(TARGET, None, False, served) == str(CLASSIFIER.resolve())   # found beside it
    assert resolve_text_classifier(TARGET, None, False, ["none", "ngram"]) is None             # no dflash served
    assert resolve_text_classifier(TARGET, None, True, served) is None
    with pytest.raises(CliError, match="--text-classifier gates dflash requests, and this server does not serve dflash"):
        resolve_text_classifier(TARGET, CLASSIFIER, False, ["none", "ngram"])
    with pytest.raises(CliError, match="--text-classifier and --no-text-gate contradict each other"):
        resolve_text_classifier(TARGET, CLASSIFIER, True, served)
    with pytest.raises(CliError, match="--text-classifier: .*config.json is not a specserve text classifier config"):
        resolve_text_classifier(TARGET, TARGET, False, served)
