"""Operator commands for hot-loading drafters (Triton's model-control API, explicit mode).

    specserve drafters list    [--url localhost:8001]
    specserve drafters load    NAME [--url …]
    specserve drafters unload  NAME [--url …]
    specserve drafters publish --target T --drafter DIR --repository REPO [--load] [--url …]
    specserve drafters publish --classifier DIR --repository REPO [--load] [--url …]

`publish` exports a (re)trained EAGLE drafter as the next version of the remote drafter models
in a served repository (work_dirs/serve/model_repository for `specserve serve`); with --load,
or a later `load eagle_proposal`, Triton switches to it while streams keep running.

Model control is admin-only (auth.py): every command sends the admin key, from
$SPECSERVE_ADMIN_KEY or the key file `specserve serve` wrote (<work dir>/admin_key).

text_classifier, the text-type gate's classifier (specserve/serving/text_gate.py), loads and unloads the
same way; while it is unloaded, dflash requests keep dflash (counted, logged once).

Unloading a drafter never fails a request: the engine decodes the affected sequences plainly
while it is gone and re-primes them when it is back (specserve/methods/remote.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specserve.serving import schema
from specserve.serving.auth import grpc_headers

# The models an operator may load / unload: every remote proposal ensemble and its parts, as
# registered once in schema.REMOTE_PROPOSALS. The engine (target_verifier) and the llm ensembles
# are not drafters and are refused.
DRAFTER_MODELS = tuple(dict.fromkeys(name for proposal, steps in schema.REMOTE_PROPOSALS.values()
                                     for name in (proposal.name, *(s.name for s in steps))))
# What load / unload accept: the drafters, and text_classifier (the text-type gate's classifier,
# text_gate.py), hot-loadable the same way: while it is unloaded, dflash requests keep dflash
# (counted as decision=unavailable).
LOADABLE_MODELS = (*DRAFTER_MODELS, schema.TEXT_CLASSIFIER.name)


class DrafterError(RuntimeError):
    pass


@dataclass
class ModelState:
    name: str
    version: str
    state: str     # READY / UNAVAILABLE / LOADING …
    reason: str


def _client(url: str):
    import tritonclient.grpc as grpcclient

    return grpcclient.InferenceServerClient(url)


def list_models(url: str, admin_key: str | None = None) -> list[ModelState]:
    from tritonclient.utils import InferenceServerException

    try:
        index = _client(url).get_model_repository_index(as_json=True, headers=grpc_headers(admin_key)).get("models", [])
    except InferenceServerException as e:
        raise DrafterError(f"cannot reach Triton at {url}: {e.message()}") from None
    return [ModelState(m["name"], m.get("version", ""), m.get("state", ""), m.get("reason", ""))
            for m in index]


def _check_name(name: str) -> None:
    if name not in LOADABLE_MODELS:
        raise DrafterError(f"{name!r} is not a drafter model; drafters: {', '.join(LOADABLE_MODELS)}")


# An ensemble's composing models are (re)loaded before it, so a new version of either part is
# picked up by `load eagle_proposal`.
PARTS = {proposal.name: tuple(s.name for s in steps) for proposal, steps in schema.REMOTE_PROPOSALS.values()}


def load(url: str, name: str, admin_key: str | None = None) -> None:
    """Load (or reload, picking up a new version directory) a drafter model."""
    from tritonclient.utils import InferenceServerException

    _check_name(name)
    client = _client(url)
    parts = PARTS.get(name, ())
    if parts:   # an ensemble's members are those its repository has (mtp_proposal's: those served)
        present = {m.name for m in list_models(url, admin_key)}
        parts = tuple(p for p in parts if p in present)
    for model in (*parts, name):
        try:
            client.load_model(model, headers=grpc_headers(admin_key))
        except InferenceServerException as e:
            raise DrafterError(f"loading {model} failed: {e.message()}") from None


def next_version(repository: Path, name: str = "eagle_backbone") -> int:
    versions = [int(p.name) for p in (Path(repository) / name).glob("*") if p.is_dir() and p.name.isdigit()]
    return max(versions, default=0) + 1


def publish(target: Path, drafter: Path, repository: Path) -> int:
    """Write `drafter` as the next version of the remote EAGLE models; returns that version."""
    from specserve.triton.drafter_backends import rendered_backend
    from specserve.triton.render import render_eagle_proposal

    if not (Path(repository) / schema.EAGLE_PROPOSAL.name / "config.pbtxt").is_file():
        raise DrafterError(f"{repository} serves no remote EAGLE drafter (start it with --placement remote)")
    version = next_version(repository)
    # The new version runs on the backend the served one was rendered for.
    backend = rendered_backend(Path(repository), schema.CALIBRATION_HEAD.name)
    render_eagle_proposal(Path(target), Path(drafter), Path(repository), version=version, backend=backend)
    return version


def publish_classifier(folder: Path, repository: Path) -> int:
    """Write a (retrained) text-type classifier as the next version of text_classifier; returns
    that version. `load text_classifier` then switches to it."""
    from specserve.serving.text_classifier import GateError
    from specserve.triton.render import render_text_classifier

    name = schema.TEXT_CLASSIFIER.name
    if not (Path(repository) / name / "config.pbtxt").is_file():
        raise DrafterError(f"{repository} serves no {name} (serve one with --text-classifier DIR)")
    version = next_version(repository, name)
    try:
        render_text_classifier(Path(folder), Path(repository), version=version)
    except GateError as e:
        raise DrafterError(str(e)) from None
    return version


def unload(url: str, name: str, admin_key: str | None = None) -> None:
    from tritonclient.utils import InferenceServerException

    _check_name(name)
    try:
        # unload_dependents: unloading eagle_proposal also unloads its two composing models.
        _client(url).unload_model(name, unload_dependents=True, headers=grpc_headers(admin_key))
    except InferenceServerException as e:
        raise DrafterError(f"unloading {name} failed: {e.message()}") from None
