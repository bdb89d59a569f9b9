"""DeploymentSettings: one default per setting, and the same settings through the Triton model
parameters (to_params / from_params) and through `specserve serve`'s flags (add_arguments /
from_args)."""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import numpy as np

from specserve.core.config import EngineConfig
from specserve.serving import settings as S
from specserve.serving.settings import DeploymentSettings
from specserve.serving.tiers import Tier

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
FIELDS = {f.name: f for f in dataclasses.fields(DeploymentSettings)}

# A value other than the default for every setting.
CHANGED = dict(checkpoint=(DEMO / "target").resolve(), max_num_seqs=3, max_model_len=256, max_draft_len=15,
               default_method="ngram", drafters=(("dflash", str((DEMO / "dflash").resolve())),),
               placement="remote", mtp_placement="fused", spec_threshold=None, dtype="bfloat16",
               quantize="int4", quantize_group_size=64, quantize_head="int8", attention="per-query", linear_kernel="aten", drafter_dtype="float32", device="cpu", tensor_parallel=2, remote_timeout_s=2.5, max_queue_len=7, draft_policy="fixed", block_size=16,
               internal_key="k", tiers=(Tier("vip", "ngram", priority=3),), drafter_backend="onnxruntime",
               text_classifier="clf", dflash_text_types=("code", "prose"))


def test_every_setting_is_changed_by_the_examples_here():
    assert set(CHANGED) == set(FIELDS)
    defaults = DeploymentSettings(CHANGED["checkpoint"])
    assert all(CHANGED[n] != getattr(defaults, n) for n in FIELDS if n not in ("checkpoint", "internal_key"))


def test_settings_survive_the_model_parameters():
    """settings → target_verifier's parameters → settings: every parameter field comes back."""
    changed = DeploymentSettings(**CHANGED)
    params = changed.to_params()
    assert all(isinstance(v, str) for v in params.values())
    assert set(params) == {n for n, f in FIELDS.items() if f.metadata["param"] is not None}
    back = DeploymentSettings.from_params(params)
    assert back == dataclasses.replace(DeploymentSettings(changed.checkpoint, internal_key="k"),
                                       **{n: CHANGED[n] for n in params})
    assert DeploymentSettings.from_params(back.to_params()) == back
    # Optional values travel as "" (None), and a parameter left out keeps its default.
    defaults = DeploymentSettings(changed.checkpoint, internal_key="k")
    assert DeploymentSettings.from_params(defaults.to_params()) == defaults
    assert DeploymentSettings.from_params({"checkpoint": "/t"}).max_queue_len == EngineConfig().max_queue_len


def test_settings_come_from_the_serve_flags():
    """`specserve serve` flags → settings: each generated flag sets its field."""
    from specserve.cli.main import build_parser

    flags = ["serve", "--target", str(CHANGED["checkpoint"]), "--max-num-seqs", "3", "--max-model-len", "256",
             "--max-draft-len", "15", "--default-method", "ngram", "--placement", "remote", "--mtp-placement",
             "fused", "--spec-threshold", "0.5", "--dtype", "bfloat16", "--quantize", "int4", "--quantize-group-size", "64",
             "--quantize-head", "int8", "--attention", "per-query", "--linear-kernel", "aten",
             "--drafter-dtype", "float32", "--device",
             "cpu", "--tensor-parallel", "2", "--remote-timeout", "2.5", "--max-queue-len", "7", "--draft-policy", "fixed", "--dflash-block-size", "16",
             "--drafter-backend", "onnxruntime", "--text-classifier", "clf", "--dflash-text-types", "code,prose"]
    args = build_parser().parse_args(flags)
    found = {n: CHANGED[n] for n in ("drafters", "tiers", "dflash_text_types", "internal_key")}
    got = S.from_args(args, **found)
    assert got == DeploymentSettings(**{**CHANGED, "spec_threshold": 0.5})
    # Every setting with a flag is one of these; the rest serve finds (drafters, tiers) or makes (the key).
    assert {f.name for f in S.cli_fields()} == set(FIELDS) - {"drafters", "tiers", "internal_key"}


def test_serve_resolves_what_it_finds_into_the_settings():
    """On the demo target, serve finds every drafter beside it and serves the first one's
    method by default, at the model's length."""
    from specserve.cli.main import build_parser, serve_settings
    from specserve.methods import registry

    args = build_parser().parse_args(["serve", "--target", str(DEMO / "target"), "--no-text-gate"])
    settings, methods = serve_settings(args)
    assert [m for m, _ in settings.drafters] == list(registry.folder_methods())
    assert (settings.default_method, settings.max_model_len, settings.text_classifier) == ("eagle", 2048, None)
    assert (settings.mtp_placement, settings.draft_policy) == ("remote", "adaptive")
    assert set(methods) == set(registry.names())


def test_one_default_per_setting():
    """The serve flags' defaults are the fields' own, and the settings the engine shares with
    the core's EngineConfig default to EngineConfig's values."""
    from specserve.cli.main import build_parser

    args = build_parser().parse_args(["serve", "--target", "t"])
    for f in S.cli_fields():
        if f.default is not dataclasses.MISSING:
            assert getattr(args, f.name) == f.default, f.name
    engine = EngineConfig()
    for name in ("max_num_seqs", "max_draft_len", "max_queue_len"):
        assert FIELDS[name].default == getattr(engine, name), name
    assert S.default_max_model_len(10 ** 6) == engine.max_model_len and S.default_max_model_len(64) == 64


def test_a_served_deployments_defaults_and_the_engine_config_built_from_them():
    served = DeploymentSettings(DEMO / "target", drafters=(("eagle", str(DEMO / "eagle")),))
    assert (served.mtp_placement, served.draft_policy, served.method_by_default()) == ("remote", "adaptive", "eagle")
    assert DeploymentSettings(DEMO / "target").method_by_default() == "none"
    config = served.engine_config()
    assert (config.max_model_len, config.default_method, config.draft_policy) == (2048, "eagle", "adaptive")
    assert served.resolved().max_model_len == 2048 and served.resolved().default_method == "eagle"
    rest = {f.name for f in dataclasses.fields(EngineConfig)} - {"max_model_len", "default_method", "draft_policy"}
    shared = rest & set(FIELDS)
    assert all(getattr(config, n) == getattr(served, n) for n in shared)
    assert all(getattr(config, n) == getattr(EngineConfig(), n) for n in rest - shared)


def test_the_rendered_verifier_parameters_are_the_settings_params(tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from specserve.triton.render import render_repository

    settings = DeploymentSettings(DEMO / "target", max_num_seqs=2, internal_key="k")
    repo = render_repository(settings, tmp_path / "repo")
    cfg = text_format.Parse((repo / "target_verifier" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert {k: v.string_value for k, v in cfg.parameters.items()} == settings.resolved().to_params()


def test_an_mtp_member_alone_calls_its_models_in_the_registrys_order(monkeypatch):
    """When mtp_proposal fails, each member's models are called one by one (bls._drafter_alone),
    read from the registry: the first drafts, a later one that is down is left out, and only what
    the arbiter reads comes back."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    from specserve.methods import registry
    from specserve.serving import schema
    from specserve.triton import bls

    down, calls = set(), []

    def fake_exec(spec, inputs, outputs):
        calls.append((spec.name, sorted(inputs)))
        if spec.name in down:
            raise RuntimeError(f"{spec.name}: model is not ready")
        return {name: np.zeros(1) for name in outputs}

    monkeypatch.setattr(bls, "_exec", fake_exec)
    inputs = {t.name: np.zeros(1) for t in schema.MTP_PROPOSAL.inputs}
    arbiter_reads = {t.name for t in schema.MTP_ARBITER.inputs} | {schema.UNKNOWN.name}
    for member in registry.composite().members:
        calls.clear()
        got = bls._drafter_alone(member.name, inputs)
        assert [c[0] for c in calls] == list(member.triton_models)
        assert got and set(got) <= arbiter_reads, member.name
    calls.clear()
    eagle = bls._drafter_alone("eagle", inputs)
    assert set(eagle) == {schema.DRAFT_TOKENS.name, schema.DRAFT_SCALARS.name, schema.DRAFT_LOGPROBS.name,
                          schema.UNKNOWN.name, schema.ACCEPT_PROB.name}
    assert calls[1] == ("calibration_head", sorted([schema.DRAFT_HIDDEN.name, schema.DRAFT_SCALARS.name]))
    down.add("calibration_head")   # EAGLE's chain is then not cut: accept_prob left out
    assert set(bls._drafter_alone("eagle", inputs)) == {schema.DRAFT_TOKENS.name, schema.DRAFT_SCALARS.name,
                                                         schema.DRAFT_LOGPROBS.name, schema.UNKNOWN.name}
    down.add("eagle_backbone")
    assert bls._drafter_alone("eagle", inputs) is None
    assert set(bls._drafter_alone("ngram", inputs)) == {schema.NGRAM_TOKENS.name}

