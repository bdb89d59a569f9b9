"""Render the model repository that Triton serves for one checkpoint.

`specserve/triton/model_repository/<model>/1/model.py` are the adapters (checked in, and package
data: a wheel carries them, so an installed specserve renders without its source tree); every
`config.pbtxt` is
written here from `schema.py`, never by hand. A deployment's settings (serving/settings.py)
travel as model config parameters, because ensembles cannot carry constants (docs/design.md, 'The shape'):
target_verifier's are DeploymentSettings.to_params(), which the adapter reads back with from_params().

    work_dir/model_repository/
      preprocess/       config.pbtxt  1/model.py
      target_verifier/  config.pbtxt  1/model.py
      postprocess/      config.pbtxt  1/model.py
      llm/              config.pbtxt  1/            (the ensemble; the default tier)
    and per service tier T of a tiers file (tiers.py; names from schema.tier_*):
      preprocess_T/     config.pbtxt  1/model.py    (preprocess, with T's settings as parameters)
      llm_T/            config.pbtxt  1/            (ensemble: preprocess_T → target_verifier → postprocess)
    and, when drafters run remotely (placement "remote"):
      eagle_backbone/   config.pbtxt  1/model.py 1/eagle_backbone.onnx
      calibration_head/ config.pbtxt  1/model.py 1/calibration_head.onnx
                        (--drafter-backend onnxruntime: 1/model.onnx for Triton's onnxruntime
                         backend; tensorrt: 1/model.plan for its tensorrt backend; see
                         drafter_backends.py)
      eagle_proposal/   config.pbtxt  1/            (ensemble: backbone → calibration head)
    and, with a text-type classifier (text_gate.py; preprocess calls it for dflash requests):
      text_classifier/  config.pbtxt  1/model.py 1/model.onnx 1/config.json
    and, with a remote EAGLE (remote mtp, remote_mtp.py):
      ngram_drafter/    config.pbtxt  1/model.py
      mtp_heads/        config.pbtxt  1/model.py 1/mtp_heads.onnx   (with --drafter mtp=DIR)
      draft_drafter/    config.pbtxt  1/model.py 1/draft/           (with --drafter draft=DIR)
      mtp_arbiter/      config.pbtxt  1/model.py
      mtp_proposal/     config.pbtxt  1/            (ensemble: the served drafters in parallel → mtp_arbiter)
"""

from __future__ import annotations

import json
import shutil
import tempfile
from importlib.resources import files
from pathlib import Path

from specserve.serving import schema
from specserve.methods import registry
from specserve.serving.build import mtp_runs_remote
from specserve.serving.schema import ModelSpec
from specserve.serving.settings import DeploymentSettings
from specserve.serving.tiers import Tier
from specserve.triton.pbtxt import tensors

# The adapters, located as package data (a Traversable: read, never assumed to be a folder on disk).
TEMPLATES = files("specserve.triton") / "model_repository"


def copy_adapter(spec: ModelSpec, vdir: Path) -> None:
    """Write the adapter of model `spec` as vdir/model.py."""
    src = TEMPLATES / spec.name / "1" / "model.py"
    if not src.is_file():
        raise FileNotFoundError(f"the installed specserve has no model template {spec.name}/1/model.py")
    (vdir / "model.py").write_bytes(src.read_bytes())


def _quote(value: object) -> str:
    """A protobuf text-format string literal (a tier's settings are JSON, full of quotes)."""
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _parameters(params: dict[str, object]) -> str:
    return "".join(f'parameters {{ key: "{k}" value: {{ string_value: {_quote(v)} }} }}\n'
                   for k, v in params.items())


def python_model_config(spec: ModelSpec, params: dict[str, object]) -> str:
    text = (f'name: "{spec.name}"\nbackend: "python"\nmax_batch_size: 0\n'
            + tensors("input", spec.inputs) + tensors("output", spec.outputs))
    if spec.decoupled:
        text += "model_transaction_policy { decoupled: true }\n"
    # One instance each: target_verifier owns the weights and the KV pool, and the tokenizer
    # models are cheap; ordering of one request's streamed responses relies on postprocess
    # running them in arrival order.
    text += "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
    return text + _parameters(params)


def ensemble_config(spec: ModelSpec, steps: tuple[ModelSpec, ...]) -> str:
    carried = {t.name for t in spec.inputs} | {t.name for m in steps for t in m.outputs}
    # A step's outputs that no later step and no ensemble output reads stay unmapped
    # (eagle_backbone's draft_logprobs in eagle_proposal: only mtp_proposal's arbiter reads them).
    used = {t.name for t in spec.outputs} | {t.name for m in steps for t in m.inputs}

    def step(m: ModelSpec) -> str:
        # Inputs nothing in the ensemble produces (target_verifier's cancel_request_id, sent only
        # by BLS) stay unmapped.
        ins = "".join(f'      input_map {{ key: "{t.name}" value: "{t.name}" }}\n'
                      for t in m.inputs if t.name in carried)
        outs = "".join(f'      output_map {{ key: "{t.name}" value: "{t.name}" }}\n' for t in m.outputs
                       if t.name in used)
        return f'    {{\n      model_name: "{m.name}"\n      model_version: -1\n{ins}{outs}    }}'

    return (f'name: "{spec.name}"\nplatform: "ensemble"\nmax_batch_size: 0\n'
            + tensors("input", spec.inputs) + tensors("output", spec.outputs)
            + "ensemble_scheduling {\n  step [\n" + ",\n".join(step(m) for m in steps) + "\n  ]\n}\n")


def render_repository(settings: DeploymentSettings, out_dir: Path) -> Path:
    """Write the repository under out_dir (replacing an earlier rendering); returns its path."""
    repo = Path(out_dir)
    if repo.exists():
        shutil.rmtree(repo)
    settings = settings.resolved()   # every model sees the same max_model_len and default method
    ckpt = str(Path(settings.checkpoint).resolve())
    params = {
        schema.PREPROCESS.name: {"checkpoint": ckpt, "tier": schema.DEFAULT_TIER,
                                 "max_model_len": settings.max_model_len,
                                 "internal_key": settings.internal_key,
                                 "default_method": settings.default_method,
                                 "text_gate": text_gate_parameter(settings)},
        schema.TARGET_VERIFIER.name: settings.to_params(),
        schema.POSTPROCESS.name: {"checkpoint": ckpt, "internal_key": settings.internal_key},
    }
    for spec in schema.ENSEMBLE_STEPS:
        (repo / spec.name / "1").mkdir(parents=True)
        copy_adapter(spec, repo / spec.name / "1")
        (repo / spec.name / "config.pbtxt").write_text(python_model_config(spec, params[spec.name]))
    (repo / schema.ENSEMBLE.name / "1").mkdir(parents=True)
    (repo / schema.ENSEMBLE.name / "config.pbtxt").write_text(
        ensemble_config(schema.ENSEMBLE, schema.ENSEMBLE_STEPS))
    for tier in settings.tiers:
        render_tier(tier, params[schema.PREPROCESS.name], repo)
    if settings.text_classifier is not None:
        render_text_classifier(Path(settings.text_classifier), repo, version=1)
    # EAGLE's models serve remote EAGLE and remote mtp (whose ensemble reuses them), whichever
    # placement the `eagle` method itself has.
    remote_mtp = mtp_runs_remote(settings.mtp_placement, settings.drafters)
    if settings.placement == "remote" or remote_mtp:
        for method, folder in settings.drafters:
            if "remote" not in registry.get(method).placements or method == registry.composite().name:
                continue  # runs inside the engine in either placement (fused only); mtp below
            render_eagle_proposal(Path(settings.checkpoint), Path(folder), repo, version=1,
                                  backend=settings.drafter_backend, max_num_seqs=settings.max_num_seqs,
                                  max_draft_len=settings.max_draft_len, device=settings.device)
    if remote_mtp:
        render_mtp_proposal(settings, repo)
    return repo


def text_gate_parameter(settings: DeploymentSettings) -> str:
    """preprocess's `text_gate` parameter: "" without a classifier, else the gate's settings."""
    from specserve.serving.text_classifier import check_text_types

    if settings.text_classifier is None:
        return ""
    types = check_text_types(settings.dflash_text_types, "dflash text types")
    return json.dumps({"dflash_text_types": list(types)})


def render_text_classifier(folder: Path, repo: Path, *, version: int) -> None:
    """Version `version` of text_classifier from a classifier folder (checked here, so a bad
    folder is named before any server starts). A later version (a retrained classifier) is the
    same call with version + 1, then `specserve drafters load text_classifier`."""
    from specserve.serving.text_classifier import CONFIG_FILE, MODEL_FILE, ClassifierConfig, GateError

    ClassifierConfig.load(folder)
    if not (folder / MODEL_FILE).is_file():
        raise GateError(f"{folder}: {MODEL_FILE} is missing")
    spec = schema.TEXT_CLASSIFIER
    vdir = repo / spec.name / str(version)
    vdir.mkdir(parents=True, exist_ok=True)
    copy_adapter(spec, vdir)
    for name in (MODEL_FILE, CONFIG_FILE):
        shutil.copy2(folder / name, vdir / name)
    (repo / spec.name / "config.pbtxt").write_text(python_model_config(spec, {}))


def render_mtp_proposal(settings: DeploymentSettings, repo: Path) -> None:
    """mtp_proposal and its own models: ngram_drafter and mtp_arbiter always, mtp_heads and
    draft_drafter where their weights are served (factory.mtp_subproposers, as the engine's
    remote mtp); the EAGLE models are render_eagle_proposal's."""
    served = registry.served_members(settings.drafters)
    folders = {m.name: Path(dict(settings.drafters)[m.drafter]) for m in registry.composite().members
               if m.drafter and m.name in served}
    steps = schema.mtp_proposal_steps(served)
    for spec in (schema.NGRAM_DRAFTER, schema.MTP_ARBITER):
        (repo / spec.name / "1").mkdir(parents=True, exist_ok=True)
        copy_adapter(spec, repo / spec.name / "1")
        (repo / spec.name / "config.pbtxt").write_text(python_model_config(spec, {}))
    if "mtp_heads" in folders:
        render_mtp_heads(Path(settings.checkpoint), folders["mtp_heads"], repo, version=1, device=settings.device)
    if "draft" in folders:
        render_draft_drafter(settings, folders["draft"], repo, version=1)
    (repo / schema.MTP_PROPOSAL.name / "1").mkdir(parents=True, exist_ok=True)
    (repo / schema.MTP_PROPOSAL.name / "config.pbtxt").write_text(ensemble_config(schema.MTP_PROPOSAL, steps))


def _template(spec: ModelSpec, repo: Path, version: int) -> Path:
    vdir = repo / spec.name / str(version)
    vdir.mkdir(parents=True, exist_ok=True)
    copy_adapter(spec, vdir)
    return vdir


def render_mtp_heads(checkpoint: Path, folder: Path, repo: Path, *, version: int, device: str = "auto") -> None:
    """Version `version` of mtp_heads: the heads in `folder` (checked against the target) exported
    to ONNX in fp32 with the target's LM head embedded (mtp.export_mtp_onnx), run on `device`
    (the engine's, so the heads compute where the target does)."""
    from specserve.model.transformer import load_model
    from specserve.methods.mtp.heads import export_mtp_onnx, load_mtp_heads

    heads = load_mtp_heads(folder, load_model(checkpoint))
    export_mtp_onnx(heads, _template(schema.MTP_HEADS, repo, version) / "mtp_heads.onnx")
    (repo / schema.MTP_HEADS.name / "config.pbtxt").write_text(python_model_config(schema.MTP_HEADS, {"device": device}))


def render_draft_drafter(settings: DeploymentSettings, folder: Path, repo: Path, *, version: int) -> None:
    """Version `version` of draft_drafter: a copy of the draft model's folder (its config, weights
    and tokenizer), refused here already when its tokenizer does not give the target's ids."""
    from specserve.methods.draft.drafter import check_tokenizer
    from specserve.model.tokenizer import load_tokenizer

    check_tokenizer(load_tokenizer(settings.checkpoint), load_tokenizer(folder))
    dest = _template(schema.DRAFT_DRAFTER, repo, version) / "draft"
    dest.mkdir(exist_ok=True)
    for f in sorted(Path(folder).iterdir()):
        if f.is_file() and f.suffix in (".json", ".safetensors"):
            shutil.copy2(f, dest / f.name)
    params = {"checkpoint": str(Path(settings.checkpoint).resolve()), "max_num_seqs": settings.max_num_seqs,
              "max_model_len": settings.model_len(), "max_draft_len": settings.max_draft_len,
              "drafter_dtype": settings.drafter_dtype, "device": settings.device}
    (repo / schema.DRAFT_DRAFTER.name / "config.pbtxt").write_text(python_model_config(schema.DRAFT_DRAFTER, params))


def tier_parameters(preprocess_params: dict[str, object], tier: Tier) -> dict[str, object]:
    """preprocess_<tier>'s parameters: the default preprocess's, plus the tier's settings."""
    return {**preprocess_params, "tier": tier.name, "tier_settings": tier.to_json()}


def render_tier(tier: Tier, preprocess_params: dict[str, object], repo: Path) -> None:
    """preprocess_<tier> (the preprocess adapter with the tier's settings) and the llm_<tier>
    ensemble; for the tier named "default", only preprocess's own config (llm is already there)."""
    pre = schema.tier_preprocess(tier.name)
    (repo / pre.name / "1").mkdir(parents=True, exist_ok=True)
    copy_adapter(schema.PREPROCESS, repo / pre.name / "1")
    (repo / pre.name / "config.pbtxt").write_text(python_model_config(pre, tier_parameters(preprocess_params, tier)))
    ens = schema.tier_ensemble(tier.name)
    (repo / ens.name / "1").mkdir(parents=True, exist_ok=True)
    (repo / ens.name / "config.pbtxt").write_text(ensemble_config(ens, schema.tier_steps(tier.name)))


def render_eagle_proposal(checkpoint: Path, drafter_dir: Path, repo: Path, *, version: int,
                          backend: str = "python", max_num_seqs: int = 16, max_draft_len: int = 8,
                          device: str = "auto") -> None:
    """Export the drafter to ONNX into version `version` of eagle_backbone / calibration_head and
    write their configs and the eagle_proposal ensemble. A later version (hot-loading a retrained
    drafter) is the same call with version + 1, then `specserve drafters load eagle_proposal`.
    `backend` (drafter_backends.py) applies to the stateless calibration head; eagle_backbone
    is always a Python model (it holds per-sequence state). The Python models run their ONNX
    sessions on `device`, the engine's --device (onnx_session.execution_providers): a drafter
    beside a GPU target computes on that GPU; auto, the default, is the engine's own default."""
    from specserve.model.transformer import load_model
    from specserve.methods.eagle.drafter import load_eagle
    from specserve.methods.eagle.export import export
    from specserve.triton import drafter_backends as db

    target = load_model(checkpoint)
    drafter = load_eagle(drafter_dir, target)
    if drafter.calibration is None:
        raise ValueError(f"remote EAGLE needs a drafter with a calibration head; {drafter_dir} has none")
    out = Path(tempfile.mkdtemp(prefix="specserve-export-"))  # never inside the served repository
    report = export(target, drafter, out)
    c = drafter.cfg
    backbone_params = {"kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "hidden_size": c.hidden_size,
                       "device": device}
    for spec, onnx_file, params in ((schema.EAGLE_BACKBONE, report.backbone, backbone_params),
                                    (schema.CALIBRATION_HEAD, report.calibration, {"device": device})):
        vdir = repo / spec.name / str(version)
        vdir.mkdir(parents=True, exist_ok=True)
        native = db.model_backend(spec.name, backend)
        if native == "python":
            copy_adapter(spec, vdir)
            shutil.move(str(onnx_file), vdir / onnx_file.name)
            (repo / spec.name / "config.pbtxt").write_text(python_model_config(spec, params))
            continue
        onnx_path = vdir / db.MODEL_FILES["onnxruntime"]
        db.export_native_calibration(drafter, onnx_path if native == "onnxruntime" else out / "native.onnx")
        if native == "tensorrt":
            db.build_plan(out / "native.onnx", vdir / db.MODEL_FILES["tensorrt"], c.hidden_size,
                          max_num_seqs, max_draft_len)
        (repo / spec.name / "config.pbtxt").write_text(
            db.native_model_config(db.calibration_spec(c.hidden_size), native))
    shutil.rmtree(out)
    proposal, steps = schema.REMOTE_PROPOSALS[schema.EAGLE_PROPOSAL.name]
    (repo / proposal.name / "1").mkdir(parents=True, exist_ok=True)
    (repo / proposal.name / "config.pbtxt").write_text(ensemble_config(proposal, steps))
