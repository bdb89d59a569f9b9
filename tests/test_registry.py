"""The method registry against what its builders make: each method's declared capabilities,
options and step are those of the proposer it builds (a conformance check, not a second list)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.core.proposer import Proposer, StaticStepProposer
from specserve.methods import registry

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
DRAFTERS = tuple((m, str(DEMO / m)) for m in registry.folder_methods())


@pytest.fixture(scope="module")
def built():
    """Every method of the demo deployment (all drafters served), built in process (fused)."""
    from specserve.serving.build import build_engine
    from specserve.serving.settings import DeploymentSettings

    engine, _ = build_engine(DeploymentSettings(DEMO / "target", max_num_seqs=2, max_model_len=256, drafters=DRAFTERS,
                                                device="cpu", draft_policy="fixed", default_method="none"))
    return engine.proposers


def test_the_demo_deployment_serves_every_registered_method(built):
    assert sorted(built) == sorted(registry.names())


@pytest.mark.parametrize("name", registry.names())
def test_each_spec_matches_the_proposer_it_builds(built, name):
    spec, proposer = registry.get(name), built[name]
    assert proposer.name == name
    assert proposer.static_step == (spec.step == "static")
    assert isinstance(proposer, StaticStepProposer if spec.step == "static" else Proposer)
    assert set(proposer.option_keys) == set(spec.option_keys)
    caps = spec.capabilities
    assert bool(proposer.feature_layers) == caps.feature_layers
    assert (proposer.repetition_guard is not None) == caps.repetition_guarded
    if spec.drafts_with == "composite":   # needs features when one of its members does
        assert caps.needs_features or not proposer.needs_features
    else:
        assert proposer.needs_features == caps.needs_features
    state = proposer.sequence_state(256)   # every proposer counts its own per-sequence state
    assert (state.bytes == 0) == (spec.drafts_with == "nothing"), state


def test_the_registry_is_consistent():
    names = registry.names()
    assert names[0] == "none" and len(set(names)) == len(names)
    for spec in registry.specs():
        assert spec.drafter_of is None or registry.get(spec.drafter_of).drafts_with == "own"
        assert all(m.drafter is None or m.drafter == spec.name or registry.get(m.drafter).drafts_with == "own"
                   for m in spec.members)
        assert all(need in names for need in spec.remote_needs)
        assert ("remote" in spec.placements) == bool(spec.triton_models), spec.name
    keys = registry.option_keys()
    assert len(set(keys)) == len(keys)
    assert registry.gated_method() in registry.guarded()   # the gate's fallback is the guard's


def test_every_member_and_remote_model_has_a_schema():
    from specserve.serving import schema

    models = {m.name for m in (schema.EAGLE_PROPOSAL, *schema.EAGLE_PROPOSAL_STEPS, schema.MTP_PROPOSAL,
                               *schema.MTP_PROPOSAL_STEPS)}
    for spec in registry.specs():
        assert set(spec.triton_models) <= models, spec.name
        for m in spec.members:
            assert [t.name for t in schema.MTP_DRAFTERS[m.name]] == list(m.triton_models)
