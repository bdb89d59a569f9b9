"""Service tiers without a server: the tiers file and its errors, rendering llm_<tier> /
preprocess_<tier>, the merge order, priority admission with a full engine, the drafter-backend
choice and its checks, and the CLI's refusals before any server starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import make_tiny_checkpoint
from specserve.core.scheduling import PriorityAging
from specserve.core.proposer import ProposerDefaults
from specserve.serving import schema
from specserve.serving.params import BadRequest, RequestConfig, make_request_config
from specserve.serving.tiers import ServerLimits, Tier, TierError, load_tiers, parse_tiers

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "config" / "tiers.yaml"
DEMO = ROOT / "models" / "demo" / "target"
# What `specserve serve` on the demo model (EAGLE drafter beside it) serves.
SERVED = ServerLimits(("none", "ngram", "eagle", "dspark"), max_draft_len=8, max_model_len=2048,
                      drafted={"dspark": "eagle"})
PLAIN = ServerLimits(("none", "ngram"), max_draft_len=8, max_model_len=2048, drafted={"dspark": "eagle"})


# -- the tiers file -------------------------------------------------------------------------------
def test_the_committed_example_parses_to_these_tiers():
    assert load_tiers(EXAMPLE, SERVED) == (
        Tier("vip", "dspark", "eagle", 9, max_draft_len=6, spec_threshold=0.3, max_tokens=512),
        Tier("standard", "eagle", "ngram", 5, spec_threshold=0.3, draft_policy="adaptive", max_tokens=1024),
        Tier("batch", "eagle", "ngram", 1, draft_policy="adaptive", max_tokens=1536),
        Tier("code", "ngram", "none", 5, max_draft_len=8, draft_policy="fixed", max_tokens=1024),
    )


def _one(**tier) -> dict:
    return {"tiers": [{"name": "t", "method": "ngram", **tier}]}


BAD = [
    (_one(method="eagel"), "tier 't': method \"eagel\" is unknown; methods: none, ngram, eagle, dflash, draft, dspark, mtp"),
    (_one(method="dflash"), "tier 't': method 'dflash' needs a served dflash drafter, and this server serves none "
                            "(serve it with --drafter dflash=DIR); available here: none, ngram, eagle, dspark"),
    (_one(fallback="mtp"), "tier 't': fallback 'mtp' needs a served mtp drafter, and this server serves none "
                           "(serve it with --drafter mtp=DIR); available here: none, ngram, eagle, dspark"),
    (_one(limits={"max_tokens": 4096}), "tier 't': limits.max_tokens must be an integer in [1, 2048], got 4096"),
    (_one(limits={"max_tokens": 0}), "tier 't': limits.max_tokens must be an integer in [1, 2048], got 0"),
    (_one(proposer={"max_draft_len": 9}), "tier 't': proposer.max_draft_len must be an integer in [0, 8], got 9"),
    (_one(proposer={"spec_threshold": 1.5}), "tier 't': proposer.spec_threshold must be a number in [0, 1], got 1.5"),
    (_one(proposer={"draft_policy": "greedy"}),
     "tier 't': proposer.draft_policy must be one of adaptive, fixed, got \"greedy\""),
    (_one(priority=10), "tier 't': priority must be an integer in [0, 9], got 10"),
    (_one(priority=True), "tier 't': priority must be an integer in [0, 9], got true"),
    (_one(proposer={"block_size": 16}), "tier 't': proposer.block_size applies to method dflash only, not 'ngram'"),
    (_one(proposer={"block_size": 17}),
     "tier 't': proposer.block_size must be an integer in [2, 16], got 17"),
    (_one(proposer={"tree_budget": 0}), "tier 't': proposer.tree_budget must be an integer in [1, 64], got 0"),
    (_one(proposer={"proposers": ["eagle", "medusa"]}),
     "tier 't': proposer.proposers must be a non-empty list of mtp_heads, eagle, draft, ngram, got [\"eagle\", \"medusa\"]"),
    (_one(priorty=3), "tier 't': unknown key(s) priorty; allowed: name, method, fallback, priority, proposer, limits"),
    (_one(proposer={"draft_len": 3}), "tier 't' proposer: unknown key(s) draft_len; allowed: max_draft_len, "
                                      "spec_threshold, draft_policy, block_size, tree_budget, proposers, "
                                      "dflash_text_types"),
    (_one(limits={"max_tokens": 5, "rpm": 3}), "tier 't' limits: unknown key(s) rpm; allowed: max_tokens"),
    ({"tiers": [], "x": 1}, "tiers file: unknown key(s) x; allowed: tiers"),
    ({"tiers": []}, "tiers file: 'tiers' must be a non-empty list"),
    ({"tiers": [{"name": "Gold", "method": "none"}]},
     "tiers[0]: name must match [a-z][a-z0-9_]{0,31} (it becomes model names llm_<name>, preprocess_<name>), "
     "got \"Gold\""),
    ({"tiers": [{"name": "a", "method": "none"}, {"name": "a", "method": "ngram"}]},
     "tier 'a': name is used twice (tiers[1] repeats it)"),
    ({"tiers": [{"name": "a"}]}, "tier 'a': method is required"),
]


@pytest.mark.parametrize("doc, message", BAD, ids=[m[:40] for _, m in BAD])
def test_a_bad_tiers_file_names_the_tier_and_the_key(doc, message):
    with pytest.raises(TierError) as e:
        parse_tiers(doc, SERVED)
    assert str(e.value) == message


def test_a_drafter_that_is_not_served_is_named():
    with pytest.raises(TierError) as e:
        parse_tiers(_one(method="dspark"), PLAIN)
    assert str(e.value) == ("tier 't': method 'dspark' needs a served eagle drafter, and this server serves none "
                            "(serve it with --drafter eagle=DIR); available here: none, ngram")


def test_duplicate_yaml_keys_are_not_silently_merged(tmp_path):
    """A list of tiers, not a mapping: a repeated name is an error, not a silent overwrite."""
    f = tmp_path / "tiers.yaml"
    f.write_text("tiers:\n  - {name: a, method: none}\n  - {name: b, method: ngram}\n  - {name: a, method: ngram}\n")
    with pytest.raises(TierError, match=r"^tier 'a': name is used twice \(tiers\[2\] repeats it\)$"):
        load_tiers(f, SERVED)


# -- merge order: request > tier > server default ----------------------------------------------------
CODE = Tier("code", "ngram", "none", 5, max_draft_len=3, spec_threshold=0.2, draft_policy="fixed", max_tokens=100)


def test_the_tier_fills_what_the_request_leaves_unset():
    got = make_request_config(json.dumps({"temperature": 0.5}), True, None, CODE)
    assert got == RequestConfig(sampling={"temperature": 0.5, "max_tokens": 16}, spec_method="ngram",
                                num_draft_tokens=3, spec_threshold=0.2, draft_policy="fixed", stream=True,
                                include_prompt=False, tier="code", priority=5, fallback_method="none")


def test_the_request_beats_the_tier():
    raw = json.dumps({"spec_method": "eagle", "num_draft_tokens": 6, "spec_threshold": 0.0,
                      "draft_policy": "adaptive", "max_tokens": 100})
    got = make_request_config(raw, False, None, CODE)
    assert got == RequestConfig(sampling={"max_tokens": 100}, spec_method="eagle", num_draft_tokens=6,
                                spec_threshold=0.0, draft_policy="adaptive", stream=False, include_prompt=True,
                                tier="code", priority=5, fallback_method="none")
    # The tier's fallback serves the request's own method too (request > tier > server), except
    # when it is that method itself; the request's spec_fallback beats it.
    assert make_request_config(json.dumps({"spec_method": "none"}), False, None, CODE).fallback_method is None
    own = make_request_config(json.dumps({"spec_method": "eagle", "spec_fallback": "ngram"}), False, None, CODE)
    assert (own.spec_fallback, own.fallback_method) == ("ngram", "ngram")


def test_what_neither_sets_stays_for_the_server_default():
    got = make_request_config(None, False, None, Tier("lean", "eagle"))
    assert (got.spec_method, got.num_draft_tokens, got.spec_threshold, got.draft_policy, got.sampling) == \
        ("eagle", None, None, None, {})


def test_max_tokens_is_a_limit_not_a_default():
    with pytest.raises(BadRequest) as e:
        make_request_config(json.dumps({"max_tokens": 101}), True, None, CODE)
    assert str(e.value) == "sampling_parameters.max_tokens 101 exceeds the limit 100 of tier 'code'"
    tight = Tier("tight", "none", max_tokens=8)
    assert make_request_config(None, True, None, tight).sampling == {"max_tokens": 8}


def test_the_default_max_tokens_is_the_engines():
    from specserve.core.sampling import SamplingParams
    from specserve.serving.params import DEFAULT_MAX_TOKENS
    assert DEFAULT_MAX_TOKENS == SamplingParams().max_tokens


def test_priority_is_not_a_client_key():
    with pytest.raises(BadRequest, match="unknown sampling_parameters key"):
        make_request_config(json.dumps({"priority": 9}), True, None, CODE)


def test_preprocess_signs_the_tier_settings():
    from specserve.serving.auth import check_signature
    from specserve.serving.preprocess import Preprocessor

    pre = Preprocessor(DEMO, CODE, max_model_len=256, internal_key="k")
    out = pre("def f(x):", True, json.dumps({"max_tokens": 20}), None)
    assert (out.config.tier, out.config.priority, out.config.spec_method, out.config.sampling) == \
        ("code", 5, "ngram", {"max_tokens": 20})
    check_signature("k", out.input_ids, out.config_json, out.signature)


# -- rendering ---------------------------------------------------------------------------------------
def _parse(path: Path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_each_tier_renders_its_ensemble_and_preprocess(tmp_path):
    from specserve.serving.settings import DeploymentSettings
    from specserve.triton.render import render_repository

    tiers = load_tiers(EXAMPLE, SERVED)
    repo = render_repository(DeploymentSettings(DEMO, tiers=tiers, internal_key="k", draft_policy="fixed"),
                             tmp_path / "repo")
    models = sorted(p.name for p in repo.iterdir())
    assert models == ["llm", "llm_batch", "llm_code", "llm_standard", "llm_vip", "postprocess", "preprocess",
                      "preprocess_batch", "preprocess_code", "preprocess_standard", "preprocess_vip",
                      "target_verifier"]
    for t in tiers:
        ens = _parse(repo / f"llm_{t.name}" / "config.pbtxt")
        assert ens.platform == "ensemble"
        assert [s.model_name for s in ens.ensemble_scheduling.step] == [f"preprocess_{t.name}", "target_verifier",
                                                                         "postprocess"]
        pre = _parse(repo / f"preprocess_{t.name}" / "config.pbtxt")
        params = {k: v.string_value for k, v in pre.parameters.items()}
        # The JSON survives the text format's quoting, and the rest is the default preprocess's.
        assert Tier.from_json(params["tier_settings"]) == t
        assert (params["tier"], params["internal_key"]) == (t.name, "k")
        assert (repo / f"preprocess_{t.name}" / "1" / "model.py").read_text() == \
            (repo / "preprocess" / "1" / "model.py").read_text()
    # llm is still the default tier, with no tier settings.
    default = {k: v.string_value for k, v in _parse(repo / "preprocess" / "config.pbtxt").parameters.items()}
    assert "tier_settings" not in default and default["tier"] == "default"


def test_the_verifiers_settings_survive_rendering(tmp_path):
    """serve's flags → config.pbtxt parameters → the DeploymentSettings target_verifier builds."""
    from specserve.serving.settings import DeploymentSettings
    from specserve.triton.render import render_repository

    settings = DeploymentSettings(DEMO, max_num_seqs=3, max_model_len=256, max_draft_len=15, default_method="ngram",
                                  drafters=(("dflash", str(DEMO.parent / "dflash")),), spec_threshold=None,
                                  max_queue_len=7, draft_policy="adaptive", block_size=16, mtp_placement="fused",
                                  internal_key="k")
    repo = render_repository(settings, tmp_path / "repo")
    params = {k: v.string_value for k, v in _parse(repo / "target_verifier" / "config.pbtxt").parameters.items()}
    got = DeploymentSettings.from_params(params)
    assert (got.max_num_seqs, got.max_model_len, got.max_draft_len, got.default_method) == (3, 256, 15, "ngram")
    assert got.drafters == (("dflash", str((DEMO.parent / "dflash").resolve())),)
    assert (got.spec_threshold, got.max_queue_len, got.draft_policy, got.block_size) == (None, 7, "adaptive", 16)
    assert (got.placement, got.mtp_placement) == ("fused", "fused")
    assert DeploymentSettings.from_params({**params, "block_size": ""}).block_size is None


def test_a_tier_named_default_sets_llms_own_settings(tmp_path):
    from specserve.serving.settings import DeploymentSettings
    from specserve.triton.render import render_repository

    tier = Tier("default", "ngram", priority=3)
    repo = render_repository(DeploymentSettings(DEMO, tiers=(tier,), draft_policy="fixed"), tmp_path / "repo")
    assert not (repo / "llm_default").exists() and not (repo / "preprocess_default").exists()
    params = {k: v.string_value for k, v in _parse(repo / "preprocess" / "config.pbtxt").parameters.items()}
    assert Tier.from_json(params["tier_settings"]) == tier


def test_tier_model_names_derive_from_the_schema():
    assert schema.tier_ensemble("vip").name == "llm_vip" and schema.tier_preprocess("vip").name == "preprocess_vip"
    assert schema.tier_ensemble("default") is schema.ENSEMBLE and schema.tier_preprocess("default") is schema.PREPROCESS
    assert [schema.tier_of_preprocess(n) for n in ("preprocess", "preprocess_vip", "postprocess")] == \
        ["default", "vip", None]


def test_drafter_models_derive_from_the_proposal_registry():
    from specserve.triton import drafters
    assert drafters.DRAFTER_MODELS == ("eagle_proposal", "eagle_backbone", "calibration_head", "mtp_proposal",
                                       "mtp_heads", "draft_drafter", "ngram_drafter", "mtp_arbiter")
    assert drafters.PARTS == {"eagle_proposal": ("eagle_backbone", "calibration_head"),
                              "mtp_proposal": ("mtp_heads", "eagle_backbone", "calibration_head", "draft_drafter",
                                               "ngram_drafter", "mtp_arbiter")}
    # a deployment's mtp_proposal has the served sub-proposers' models only
    assert [m.name for m in schema.mtp_proposal_steps(["eagle", "ngram"])] == \
        ["eagle_backbone", "calibration_head", "ngram_drafter", "mtp_arbiter"]
    with pytest.raises(ValueError, match=r"mtp_proposal: no drafter models for \['medusa'\]"):
        schema.mtp_proposal_steps(["medusa"])


# -- priority admission, with a full engine ------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiers_llama"), "llama", seed=7)


def _engine(path, aging_steps: int):
    from specserve.core.engine import Engine, EngineConfig
    from specserve.model.transformer import load_model

    # One KV slot: every request after the first waits, and each holds the slot for two steps
    # (prefill emits its first token, one decode step its second and last).
    return Engine(load_model(path), EngineConfig(max_num_seqs=1, max_model_len=64, priority_aging_steps=aging_steps),
                  eos_token_ids=())


def _req(rid: str, priority: int):
    from specserve.core.engine import GenerationRequest
    from specserve.core.sampling import SamplingParams
    return GenerationRequest(rid, [5, 6, 7], SamplingParams(max_tokens=2), priority=priority)


def _admitted(outputs) -> list[str]:
    return [o.request_id for o in outputs if o.num_output_tokens == 1]


def test_a_full_engine_admits_higher_priority_first_and_fifo_within_one(engine_ckpt):
    eng = _engine(engine_ckpt, aging_steps=2)
    for rid, p in (("b0", 1), ("b1", 1), ("s0", 5), ("v0", 9), ("v1", 9)):
        eng.submit(_req(rid, p))
    order = []
    while eng.has_work():
        order += _admitted(eng.step())
    assert order == ["v0", "v1", "s0", "b0", "b1"]


def test_aging_admits_the_lowest_tier_under_a_steady_stream_of_vip_requests(engine_ckpt):
    """A batch request (1) queued first, then one vip request (9) before every step. With one
    level per 2 steps, vips queued fewer than (9 - 1) * 2 = 16 steps after it may pass it: v1..v16
    (queued at steps 0..15). The batch request is admitted at step 33, after exactly 16 vips."""
    eng = _engine(engine_ckpt, aging_steps=2)
    eng.submit(_req("batch", 1))
    order, step = [], 0
    while "batch" not in order:
        step += 1
        eng.submit(_req(f"v{step}", 9))
        order += _admitted(eng.step())
    assert step == 33 and order == [f"v{i}" for i in range(1, 17)] + ["batch"]


def test_without_aging_the_stream_of_vip_requests_would_starve_it(engine_ckpt):
    eng = _engine(engine_ckpt, aging_steps=10**9)
    eng.submit(_req("batch", 1))
    order = []
    for step in range(1, 81):
        eng.submit(_req(f"v{step}", 9))
        order += _admitted(eng.step())
    assert "batch" not in order and len(order) == 40


def test_policy_picks_the_oldest_of_equal_effective_priority():
    from types import SimpleNamespace as W
    policy = PriorityAging(aging_steps=4)
    waiting = [W(priority=1, enqueued_step=0), W(priority=3, enqueued_step=4), W(priority=3, enqueued_step=8)]
    assert [policy.effective(w, 8) for w in waiting] == [3, 4, 3]
    assert policy.pick(waiting, 8) == 1
    assert [policy.effective(w, 11) for w in waiting] == [3, 4, 3] and policy.pick(waiting, 11) == 1
    assert [policy.effective(w, 12) for w in waiting] == [4, 5, 4] and policy.pick(waiting, 12) == 1
    assert policy.pick(waiting[::2], 8) == 0   # 3 and 3: the older
    with pytest.raises(ValueError, match="aging_steps must be at least 1, got 0"):
        PriorityAging(0)


class _Switchable(ProposerDefaults):
    """A drafter that drafts nothing, and says whether it is available (a remote one backing off
    after failed calls is not)."""
    name, needs_features = "eagle", False

    def __init__(self, available: bool):
        self.available = available

    def propose(self, requests):
        from specserve.core.proposer import Draft
        assert self.available, "an unavailable proposer's request should have started on its fallback"
        return [Draft.empty() for _ in requests]

    def observe(self, outcomes):
        pass

    def release(self, seq_id):
        pass


def test_a_request_starts_on_its_fallback_when_its_drafter_is_unavailable(engine_ckpt):
    from specserve.core.engine import Engine, EngineConfig, GenerationRequest
    from specserve.model.transformer import load_model
    from specserve.methods.ngram.proposer import NgramProposer
    from specserve.core.sampling import SamplingParams

    drafter = _Switchable(available=False)
    eng = Engine(load_model(engine_ckpt), EngineConfig(max_num_seqs=2, max_model_len=64),
                 {"ngram": NgramProposer(), "eagle": drafter}, eos_token_ids=())

    def run(rid, method, fallback=None):
        req = GenerationRequest(rid, [5, 6, 7, 5, 6], SamplingParams(max_tokens=12), method, fallback_method=fallback)
        return eng.generate([req])[rid]

    plain = run("p", "none")
    down = run("f", "eagle", "ngram")
    assert down.stats.method == "ngram" and down.stats.draft_tokens > 0 and down.new_token_ids == plain.new_token_ids
    drafter.available = True
    up = run("g", "eagle", "ngram")
    assert up.stats.method == "eagle" and up.new_token_ids == plain.new_token_ids


def test_the_remote_proposer_is_unavailable_while_backing_off():
    from specserve.methods.remote import RemoteProposer

    now = [100.0]
    p = RemoteProposer("eagle", call=lambda batch: {}, clock=lambda: now[0])
    assert p.available
    p._retry_at = 100.5   # what a failed call sets (now + back-off)
    assert not p.available
    now[0] = 100.5
    assert p.available


def test_the_engine_refuses_a_priority_out_of_range(engine_ckpt):
    from specserve.core.engine import RequestRejected
    eng = _engine(engine_ckpt, aging_steps=2)
    with pytest.raises(RequestRejected, match=r"^priority must be an integer in \[0, 9\], got 12$"):
        eng.submit(_req("x", 12))


def test_priority_travels_from_the_tier_to_the_engine_and_spec_stats_carry_the_tier(engine_ckpt):
    import threading

    from specserve.serving.verifier_service import VerifierService

    eng = _engine(engine_ckpt, aging_steps=2)
    svc = VerifierService(eng)
    seen, done = [], threading.Event()
    submit = svc.loop.submit
    svc.loop.submit = lambda req: (seen.append(req), submit(req))[1]

    class Sender:
        final = None

        def send(self, r):
            if r.final:
                Sender.final = r
                done.set()

        send_error = close = lambda self, *a: done.set()
        is_cancelled = lambda self: False

    try:
        config = make_request_config(None, True, None, Tier("vip", "none", priority=9, max_tokens=2))
        svc.submit([5, 6, 7], config, Sender())
        assert done.wait(30)
    finally:
        svc.stop()
    assert (seen[0].priority, seen[0].method) == (9, "none")
    assert Sender.final.meta.spec_stats["tier"] == "vip" and Sender.final.meta.spec_stats["method"] == "none"


# -- drafter backends ------------------------------------------------------------------------------------
def test_native_backends_apply_to_the_stateless_calibration_head_only():
    from specserve.triton import drafter_backends as db

    assert [db.model_backend("calibration_head", b) for b in db.BACKENDS] == ["python", "onnxruntime", "tensorrt"]
    assert [db.model_backend("eagle_backbone", b) for b in db.BACKENDS] == ["python"] * 3
    with pytest.raises(db.BackendError) as e:
        db.native_model_config(schema.EAGLE_BACKBONE, "onnxruntime")
    assert str(e.value) == (
        "eagle_backbone cannot run on Triton's onnxruntime backend: it keeps each sequence's drafter KV cache "
        "between calls (keyed by seq_ids, rolled back by valid_from), which Triton's onnxruntime and tensorrt "
        "backends cannot hold: they run a model as a pure function of one request's tensors; it stays a Python model")
    cfg = db.native_model_config(db.calibration_spec(64), "tensorrt")
    assert 'platform: "tensorrt_plan"' in cfg and 'default_model_filename: "model.plan"' in cfg
    assert '{ name: "draft_hidden" data_type: TYPE_FP32 dims: [ -1, -1, 64 ] }' in cfg
    assert db.required_backend(cfg) == "tensorrt"


def test_a_repository_is_checked_against_the_servers_backends(tmp_path):
    from specserve.triton import drafter_backends as db

    backends = tmp_path / "backends"
    (backends / "python").mkdir(parents=True)
    (backends / "python" / "libtriton_python.so").write_bytes(b"")
    (backends / "onnxruntime").mkdir()          # a folder without the library is not a backend
    assert db.server_backends(backends) == ["python"]
    repo = tmp_path / "repo"
    (repo / "calibration_head").mkdir(parents=True)
    (repo / "calibration_head" / "config.pbtxt").write_text(
        db.native_model_config(db.calibration_spec(64), "onnxruntime"))
    with pytest.raises(db.BackendError) as e:
        db.check_repository(repo, backends)
    assert str(e.value) == (f"model calibration_head is rendered for Triton's onnxruntime backend, which this "
                            f"tritonserver does not have (its backends, in {backends}: python)")


def test_the_native_calibration_head_equals_the_python_models(tmp_path):
    """The ONNX the onnxruntime backend would serve (schema names, [B, K, ·]) computes what the
    Python model computes from its own ONNX."""
    import numpy as np
    import onnxruntime as ort

    from specserve.model.transformer import load_model
    from specserve.methods.eagle.drafter import save_eagle
    from specserve.methods.eagle.onnx_runtime import CalibrationOnnxRuntime
    from specserve.triton.render import render_eagle_proposal
    from test_eagle import random_drafter

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "llama", seed=3)
    target = load_model(ckpt)
    save_eagle(random_drafter(target, seed=5), json.loads((tmp_path / "ckpt" / "config.json").read_text()),
               tmp_path / "eagle")
    py, native = tmp_path / "py", tmp_path / "native"
    render_eagle_proposal(Path(ckpt), tmp_path / "eagle", py, version=1)
    render_eagle_proposal(Path(ckpt), tmp_path / "eagle", native, version=1, backend="onnxruntime")
    cal = _parse(native / "calibration_head" / "config.pbtxt")
    assert (cal.platform, cal.backend, cal.default_model_filename) == ("onnxruntime_onnx", "", "model.onnx")
    assert _parse(native / "eagle_backbone" / "config.pbtxt").backend == "python"
    assert sorted(p.name for p in (native / "calibration_head" / "1").iterdir()) == ["model.onnx"]
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((3, 4, 64)).astype(np.float32)
    scalars = rng.random((3, 4, 3)).astype(np.float32)
    want = CalibrationOnnxRuntime(str(py / "calibration_head" / "1" / "calibration_head.onnx")).accept_prob(hidden, scalars)
    got = ort.InferenceSession(str(native / "calibration_head" / "1" / "model.onnx"),
                               providers=["CPUExecutionProvider"]).run(
        ["accept_prob"], {"draft_hidden": hidden, "draft_scalars": scalars})[0]
    assert got.shape == (3, 4) and np.abs(got - want).max() < 1e-5


# -- the CLI refuses before any server starts -------------------------------------------------------------
def _serve(tmp_path, *flags):
    from specserve.cli.main import main
    from specserve.triton.launch import Ports

    ports = Ports.free()
    return main(["serve", "--target", str(DEMO), "--work-dir", str(tmp_path / "work"),
                 "--http-port", str(ports.http), "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics),
                 *flags])


def test_serve_refuses_a_bad_tiers_file_naming_tier_and_key(tmp_path, capsys):
    bad = tmp_path / "tiers.yaml"
    bad.write_text(yaml.safe_dump({"tiers": [{"name": "batch", "method": "ngram", "priority": 10}]}))
    assert _serve(tmp_path, "--tiers", str(bad)) == 2
    assert capsys.readouterr().err == (
        f"specserve: error: --tiers {bad}: tier 'batch': priority must be an integer in [0, 9], got 10\n")
    assert not (tmp_path / "work" / "model_repository").exists()


def test_serve_names_the_missing_native_backend(tmp_path, capsys):
    assert _serve(tmp_path, "--placement", "remote", "--drafter-backend", "onnxruntime") == 2
    err = capsys.readouterr().err
    backends = (tmp_path / "work").resolve() / "backends"
    assert err == (f"specserve: error: --drafter-backend onnxruntime: this tritonserver has no onnxruntime backend "
                   f"(its backends, in {backends}: python); the pip-installed tritonserver has only python, "
                   f"the NGC container has onnxruntime and tensorrt. Use --drafter-backend python here\n")
    assert not (tmp_path / "work" / "model_repository").exists()


def test_serve_says_native_backends_are_for_remote_drafters(tmp_path, capsys):
    assert _serve(tmp_path, "--drafter-backend", "tensorrt") == 2
    assert capsys.readouterr().err == ("specserve: error: --drafter-backend tensorrt applies to remote drafter "
                                       "models; add --placement remote (fused drafters run inside the engine)\n")
