"""Render the model repository that Triton serves for one checkpoint.

`model_repository/<model>/1/model.py` are the adapters (checked in); every `config.pbtxt` is
written here from `schema.py`, never by hand. Deployment settings (checkpoint path, engine sizes)
travel as model config parameters, because ensembles cannot carry constants (DESIGN.md §2).

    work_dir/model_repository/
      preprocess/       config.pbtxt  1/model.py
      target_verifier/  config.pbtxt  1/model.py
      postprocess/      config.pbtxt  1/model.py
      llm/              config.pbtxt  1/            (the ensemble)
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from specserve.triton import schema
from specserve.triton.schema import ModelSpec, TensorSpec

TEMPLATES = Path(__file__).resolve().parents[2] / "model_repository"


@dataclass(frozen=True)
class RepositorySettings:
    checkpoint: Path
    max_num_seqs: int = 16
    max_model_len: int = 2048
    max_draft_len: int = 8
    default_method: str = "none"
    tier: str = "default"


def _tensor(t: TensorSpec, is_input: bool) -> str:
    dims = ", ".join(str(d) for d in t.dims)
    opt = " optional: true" if t.optional and is_input else ""
    return f'  {{ name: "{t.name}" data_type: TYPE_{t.dtype} dims: [ {dims} ]{opt} }}'


def _tensors(kind: str, specs: tuple[TensorSpec, ...]) -> str:
    return f"{kind} [\n" + ",\n".join(_tensor(t, kind == "input") for t in specs) + "\n]\n"


def _parameters(params: dict[str, object]) -> str:
    return "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n'
                   for k, v in params.items())


def python_model_config(spec: ModelSpec, params: dict[str, object]) -> str:
    text = (f'name: "{spec.name}"\nbackend: "python"\nmax_batch_size: 0\n'
            + _tensors("input", spec.inputs) + _tensors("output", spec.outputs))
    if spec.decoupled:
        text += "model_transaction_policy { decoupled: true }\n"
    # One instance each: target_verifier owns the weights and the KV pool, and the tokenizer
    # models are cheap; ordering of one request's streamed responses relies on postprocess
    # running them in arrival order.
    text += "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
    return text + _parameters(params)


def ensemble_config(spec: ModelSpec, steps: tuple[ModelSpec, ...]) -> str:
    carried = {t.name for t in spec.inputs} | {t.name for m in steps for t in m.outputs}

    def step(m: ModelSpec) -> str:
        # Inputs nothing in the ensemble produces (target_verifier's cancel_request_id, sent only
        # by BLS) stay unmapped.
        ins = "".join(f'      input_map {{ key: "{t.name}" value: "{t.name}" }}\n'
                      for t in m.inputs if t.name in carried)
        outs = "".join(f'      output_map {{ key: "{t.name}" value: "{t.name}" }}\n' for t in m.outputs)
        return f'    {{\n      model_name: "{m.name}"\n      model_version: -1\n{ins}{outs}    }}'

    return (f'name: "{spec.name}"\nplatform: "ensemble"\nmax_batch_size: 0\n'
            + _tensors("input", spec.inputs) + _tensors("output", spec.outputs)
            + "ensemble_scheduling {\n  step [\n" + ",\n".join(step(m) for m in steps) + "\n  ]\n}\n")


def render_repository(settings: RepositorySettings, out_dir: Path) -> Path:
    """Write the repository under out_dir (replacing an earlier rendering); returns its path."""
    if not TEMPLATES.is_dir():
        raise FileNotFoundError(f"model templates not found at {TEMPLATES}; specserve must be installed "
                                "from its source tree (pip install -e .)")
    repo = Path(out_dir)
    if repo.exists():
        shutil.rmtree(repo)
    ckpt = str(Path(settings.checkpoint).resolve())
    params = {
        schema.PREPROCESS.name: {"checkpoint": ckpt, "tier": settings.tier},
        schema.TARGET_VERIFIER.name: {"checkpoint": ckpt, "max_num_seqs": settings.max_num_seqs,
                                      "max_model_len": settings.max_model_len,
                                      "max_draft_len": settings.max_draft_len,
                                      "default_method": settings.default_method},
        schema.POSTPROCESS.name: {"checkpoint": ckpt},
    }
    for spec in schema.ENSEMBLE_STEPS:
        src = TEMPLATES / spec.name / "1" / "model.py"
        if not src.exists():
            raise FileNotFoundError(f"missing model template {src}")
        (repo / spec.name / "1").mkdir(parents=True)
        shutil.copy2(src, repo / spec.name / "1" / "model.py")
        (repo / spec.name / "config.pbtxt").write_text(python_model_config(spec, params[spec.name]))
    (repo / schema.ENSEMBLE.name / "1").mkdir(parents=True)
    (repo / schema.ENSEMBLE.name / "config.pbtxt").write_text(
        ensemble_config(schema.ENSEMBLE, schema.ENSEMBLE_STEPS))
    return repo
