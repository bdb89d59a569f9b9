"""Change service tiers on a running server (Triton's model-control API; the server runs in
explicit model-control mode, as `specserve serve` starts it).

    specserve tiers list        [--url localhost:8001] [--admin-key-file …]
    specserve tiers apply FILE  [--url …] [--admin-key-file …] [--repository REPO]

`apply` checks FILE against what the server serves (its methods, max_draft_len and
max_model_len, read from target_verifier's config) exactly as `serve --tiers` does, and refuses
the whole file before changing anything if one tier is bad or is not served (a new tier needs a
restart with --tiers: its ensemble does not exist yet). Then, for each tier whose settings
changed, it re-renders preprocess_<tier>'s config — the served config with the new tier_settings
parameter — and loads preprocess_<tier> with it. Triton loads the new version beside the old
one and switches; requests already past preprocess (every in-flight stream) never see the
change, and new requests get the new settings. With --repository (the served repository, when
it is on this machine) the rendered config.pbtxt is written there too, so a later reload from
disk keeps the change. Tiers the file does not name are left as they are.

Model control and model configs are admin-only (auth.py): every call sends the admin key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specserve.serving import schema
from specserve.serving.auth import grpc_headers
from specserve.serving.tiers import ServerLimits, Tier, TierError, default_tier, parse_tiers

TIER_SETTINGS = "tier_settings"   # the preprocess_<tier> parameter that carries Tier.to_json()


class TierControlError(RuntimeError):
    pass


@dataclass(frozen=True)
class ServedTier:
    tier: Tier
    preprocess: str     # model names
    ensemble: str
    state: str          # READY / UNAVAILABLE / …


@dataclass(frozen=True)
class Change:
    tier: str
    changed: bool


def _client(url: str):
    import tritonclient.grpc as grpcclient

    return grpcclient.InferenceServerClient(url)


def _call(what: str, fn, *args, **kw):
    from tritonclient.utils import InferenceServerException

    try:
        return fn(*args, **kw)
    except InferenceServerException as e:
        raise TierControlError(f"{what} failed: {e.message()}") from None


def _config(client, name: str, key: str | None) -> dict:
    return _call(f"reading {name}'s config", client.get_model_config, name, as_json=True,
                 headers=grpc_headers(key))["config"]


def _params(config: dict) -> dict[str, str]:
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


def server_limits(client, key: str | None) -> ServerLimits:
    """What the running server serves, from target_verifier's rendered parameters."""
    from specserve.methods import registry
    from specserve.serving.build import served_methods
    from specserve.serving.settings import DeploymentSettings

    settings = DeploymentSettings.from_params(_params(_config(client, schema.TARGET_VERIFIER.name, key)))
    return ServerLimits(tuple(served_methods(settings.drafters)), settings.max_draft_len, settings.model_len(),
                        drafted=registry.borrowed())


def list_tiers(url: str, admin_key: str | None) -> list[ServedTier]:
    client = _client(url)
    index = _call(f"reaching Triton at {url}", client.get_model_repository_index, as_json=True,
                  headers=grpc_headers(admin_key)).get("models", [])
    out = []
    for m in index:
        tier_name = schema.tier_of_preprocess(m["name"])
        if tier_name is None or m.get("state") != "READY":
            continue
        raw = _params(_config(client, m["name"], admin_key)).get(TIER_SETTINGS)
        tier = Tier.from_json(raw) if raw else default_tier()
        out.append(ServedTier(tier, m["name"], schema.tier_ensemble(tier_name).name, m.get("state", "")))
    return sorted(out, key=lambda st: st.tier.name)


def apply(url: str, tiers_file: Path, admin_key: str | None, repository: Path | None = None) -> list[Change]:
    """Validate the whole file first, then reload each changed tier's preprocess."""
    import yaml

    from specserve.triton.render import python_model_config

    client = _client(url)
    try:
        doc = yaml.safe_load(Path(tiers_file).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise TierError(f"cannot read tiers file {tiers_file}: {e}") from None
    tiers = parse_tiers(doc, server_limits(client, admin_key))
    index = _call(f"reaching Triton at {url}", client.get_model_repository_index, as_json=True,
                  headers=grpc_headers(admin_key)).get("models", [])
    ready = {m["name"] for m in index if m.get("state") == "READY"}
    for t in tiers:
        name = schema.tier_preprocess(t.name).name
        if name not in ready:
            raise TierError(f"tier {t.name!r}: this server does not serve it (no ready model {name}); a new "
                            f"tier needs a restart with `specserve serve --tiers FILE`")
    changes = []
    for t in tiers:
        spec = schema.tier_preprocess(t.name)
        config = _config(client, spec.name, admin_key)
        new = t.to_json()
        if _params(config).get(TIER_SETTINGS) == new:
            changes.append(Change(t.name, False))
            continue
        config.setdefault("parameters", {})
        config["parameters"]["tier"] = {"string_value": t.name}
        config["parameters"][TIER_SETTINGS] = {"string_value": new}
        _call(f"loading {spec.name}", client.load_model, spec.name, config=json.dumps(config),
              headers=grpc_headers(admin_key))
        if repository is not None and (Path(repository) / spec.name / "config.pbtxt").is_file():
            (Path(repository) / spec.name / "config.pbtxt").write_text(python_model_config(spec, _params(config)))
        changes.append(Change(t.name, True))
    return changes
