"""Service tiers through a real tritonserver: each tier's ensemble runs its method, a request's
override beats its tier, outputs equal plain decoding, the tier's limit is enforced, and
`tiers apply` changes a tier while 8 streams run on it without failing any."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import make_served_checkpoint, running_server
from specserve.cli.main import SERVE_TRITON_ARGS, main
from specserve.model.transformer import load_model
from specserve.methods.eagle.drafter import save_eagle
from specserve.triton import tier_control
from specserve.triton.client import CompletionError, StreamClient
from specserve.serving.settings import DeploymentSettings
from specserve.triton.render import render_repository
from specserve.serving.tiers import Tier, TierError
from streams import during_streams
from test_eagle import random_drafter

pytestmark = pytest.mark.triton

PROMPTS = ["def add(a, b):\n    return", "Hello 世界! 😀 the quick", "the quick brown fox", "中文 and 🚀"]
FAST = Tier("fast", "eagle", "ngram", 9, max_draft_len=3)
CODE = Tier("code", "ngram", "none", 1, max_tokens=300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiers_server")
    ckpt = make_served_checkpoint(root / "ckpt", seed=3, max_position_embeddings=512)
    save_eagle(random_drafter(load_model(ckpt), seed=5), json.loads((ckpt / "config.json").read_text()),
               root / "eagle")
    repo = render_repository(DeploymentSettings(ckpt, max_num_seqs=16, max_model_len=512, max_draft_len=4,
                                                default_method="none", drafters=(("eagle", str(root / "eagle")),),
                                                spec_threshold=None, tiers=(FAST, CODE), draft_policy="fixed",
                                                mtp_placement="fused"),   # the tiers run eagle and ngram; mtp is not served here
                             root / "model_repository")
    with running_server(repo, root, SERVE_TRITON_ARGS) as srv:
        yield srv


def gen(srv, model, prompt, sampling, **kw):
    return StreamClient(srv.grpc_url, model).generate(prompt, sampling, timeout=300, **kw)


def test_each_tier_runs_its_method_a_request_override_beats_it_and_outputs_equal_none(server):
    for p in PROMPTS:
        plain = gen(server, "llm", p, {"max_tokens": 40})
        assert (plain.spec_stats["method"], plain.spec_stats["tier"]) == ("none", "default")
        fast = gen(server, "llm_fast", p, {"max_tokens": 40})
        assert (fast.spec_stats["method"], fast.spec_stats["tier"]) == ("eagle", "fast")
        # The tier's max_draft_len (3) caps every draft.
        assert 0 < fast.spec_stats["draft_tokens"] <= 3 * fast.spec_stats["drafts"]
        code = gen(server, "llm_code", p, {"max_tokens": 40})
        assert (code.spec_stats["method"], code.spec_stats["tier"]) == ("ngram", "code")
        override = gen(server, "llm_code", p, {"max_tokens": 40, "spec_method": "eagle", "num_draft_tokens": 4})
        assert (override.spec_stats["method"], override.spec_stats["tier"]) == ("eagle", "code")
        assert plain.text == fast.text == code.text == override.text, p


def test_the_tiers_max_tokens_limit_is_enforced_by_its_ensemble_only(server):
    with pytest.raises(CompletionError, match="sampling_parameters.max_tokens 301 exceeds the limit 300 of tier 'code'"):
        gen(server, "llm_code", PROMPTS[0], {"max_tokens": 301})
    assert gen(server, "llm", PROMPTS[0], {"max_tokens": 301, "ignore_eos": True}).num_output_tokens == 301


def test_tiers_list_shows_what_each_tier_serves(server, monkeypatch, capsys):
    monkeypatch.setenv("SPECSERVE_ADMIN_KEY", server.admin_key)
    assert main(["tiers", "list", "--url", server.grpc_url]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "code         llm_code         method=ngram fallback=none priority=1 num_draft_tokens=None "
        "spec_threshold=None draft_policy=None max_tokens<=300",
        "default      llm              method=(server default) fallback=none priority=0 num_draft_tokens=None "
        "spec_threshold=None draft_policy=None max_tokens<=None",
        "fast         llm_fast         method=eagle fallback=ngram priority=9 num_draft_tokens=3 "
        "spec_threshold=None draft_policy=None max_tokens<=None",
    ]


def test_tiers_apply_during_eight_streams_fails_nothing_and_later_requests_get_the_change(server, tmp_path):
    max_tokens = 200
    want = {p: gen(server, "llm", p, {"max_tokens": max_tokens}) for p in PROMPTS}
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    new = tmp_path / "tiers.yaml"
    new.write_text(yaml.safe_dump({"tiers": [
        {"name": "code", "method": "eagle", "fallback": "ngram", "priority": 3, "limits": {"max_tokens": 300}},
        {"name": "fast", "method": "eagle", "fallback": "ngram", "priority": 9, "proposer": {"max_draft_len": 3}},
    ]}))
    results, changes = during_streams(
        lambda p, on_chunk: gen(server, "llm_code", p, {"max_tokens": max_tokens}, on_chunk=on_chunk), jobs,
        lambda: tier_control.apply(server.grpc_url, new, server.admin_key))
    assert changes == [tier_control.Change("code", True), tier_control.Change("fast", False)]
    for p, r in zip(jobs, results):
        assert (r.text, r.finish_reason) == (want[p].text, want[p].finish_reason)
        assert r.spec_stats["method"] == "ngram"     # they were past preprocess_code when it changed
    after = gen(server, "llm_code", PROMPTS[0], {"max_tokens": 40})
    assert (after.spec_stats["method"], after.spec_stats["tier"]) == ("eagle", "code")
    assert after.text == want[PROMPTS[0]].text[:len(after.text)]
    served = {st.tier.name: st.tier for st in tier_control.list_tiers(server.grpc_url, server.admin_key)}
    assert served["code"] == Tier("code", "eagle", "ngram", 3, max_tokens=300)


def test_tiers_apply_refuses_a_bad_or_new_tier_and_changes_nothing(server, tmp_path):
    before = tier_control.list_tiers(server.grpc_url, server.admin_key)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"tiers": [{"name": "fast", "method": "ngram"},
                                             {"name": "code", "method": "dflash"}]}))
    with pytest.raises(TierError) as e:
        tier_control.apply(server.grpc_url, bad, server.admin_key)
    assert str(e.value) == ("tier 'code': method 'dflash' needs a served dflash drafter, and this server serves "
                            "none (serve it with --drafter dflash=DIR); available here: none, ngram, eagle, dspark, mtp")
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump({"tiers": [{"name": "fast", "method": "ngram"},
                                             {"name": "gold", "method": "eagle"}]}))
    with pytest.raises(TierError) as e:
        tier_control.apply(server.grpc_url, new, server.admin_key)
    assert str(e.value) == ("tier 'gold': this server does not serve it (no ready model preprocess_gold); a new "
                            "tier needs a restart with `specserve serve --tiers FILE`")
    assert tier_control.list_tiers(server.grpc_url, server.admin_key) == before


def test_model_control_for_tiers_is_admin_only(server):
    with pytest.raises(tier_control.TierControlError):
        tier_control.list_tiers(server.grpc_url, None)


def test_tiers_apply_cli_says_what_changed_and_writes_the_repository(server, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECSERVE_ADMIN_KEY", server.admin_key)
    served = {st.tier.name: st.tier for st in tier_control.list_tiers(server.grpc_url, server.admin_key)}
    same = tmp_path / "same.yaml"
    same.write_text(yaml.safe_dump({"tiers": [
        {"name": "fast", "method": "eagle", "fallback": "ngram", "priority": 9, "proposer": {"max_draft_len": 3}},
        {"name": "code", "method": served["code"].method, "fallback": served["code"].fallback,
         "priority": served["code"].priority, "limits": {"max_tokens": 250}},
    ]}))
    repo = server.repository
    assert main(["tiers", "apply", str(same), "--url", server.grpc_url, "--repository", str(repo)]) == 0
    assert capsys.readouterr().out.splitlines() == ["fast: unchanged", "code: changed (preprocess reloaded)"]
    on_disk = (repo / "preprocess_code" / "config.pbtxt").read_text()
    assert '\\"max_tokens\\": 250' in on_disk and 'name: "preprocess_code"' in on_disk
    with pytest.raises(CompletionError, match="exceeds the limit 250 of tier 'code'"):
        gen(server, "llm_code", PROMPTS[0], {"max_tokens": 251})
