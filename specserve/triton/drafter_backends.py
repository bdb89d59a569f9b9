"""Which Triton backend runs each remote drafter model, and whether the server has it.

    --drafter-backend python       onnxruntime inside a Python model (the default; the only one the
                                   pip-installed tritonserver has)
    --drafter-backend onnxruntime  Triton's onnxruntime backend (platform onnxruntime_onnx)
    --drafter-backend tensorrt     Triton's tensorrt backend (platform tensorrt_plan, a plan built
                                   from the ONNX by tensorrt_plan.py; GPU machines only)

A native backend runs a model as a pure function of one request's tensors. That fits the
calibration head (draft features → acceptance probabilities). It does not fit eagle_backbone,
which keeps each sequence's drafter KV cache between calls (keyed by seq_ids, rolled back by
valid_from, freed by release_ids): so eagle_backbone stays a Python model whatever the flag says,
and asking for it natively is an error (STATEFUL says why).

The server's backends are the folders of its backend directory holding a libtriton_<name>.so
(what tritonserver loads a backend from); every rendered config.pbtxt is checked against them
before the server starts, so a missing backend is named instead of failing a model load.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from specserve.serving import schema
from specserve.serving.schema import ModelSpec
from specserve.serving.settings import DRAFTER_BACKENDS as BACKENDS
from specserve.triton.pbtxt import tensors

PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "tensorrt": "tensorrt_plan"}
MODEL_FILES = {"onnxruntime": "model.onnx", "tensorrt": "model.plan"}
# Drafter models that must stay Python models, and why.
STATEFUL = {
    schema.EAGLE_BACKBONE.name: "it keeps each sequence's drafter KV cache between calls (keyed by seq_ids, "
                                "rolled back by valid_from), which Triton's onnxruntime and tensorrt backends "
                                "cannot hold: they run a model as a pure function of one request's tensors",
}


class BackendError(ValueError):
    """A drafter backend this model or this server cannot use; the message says which and why."""


def model_backend(model: str, backend: str) -> str:
    """The backend `model` is rendered for when drafters are asked to run on `backend`."""
    if backend not in BACKENDS:
        raise BackendError(f"drafter backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return "python" if model in STATEFUL else backend


def native_model_config(spec: ModelSpec, backend: str) -> str:
    """config.pbtxt for a stateless drafter model on a native backend. No instance_group: Triton
    then places the model on a GPU where there is one, else on the CPU."""
    if spec.name in STATEFUL:
        raise BackendError(f"{spec.name} cannot run on Triton's {backend} backend: {STATEFUL[spec.name]}; "
                           f"it stays a Python model")
    if backend not in PLATFORMS:
        raise BackendError(f"{backend!r} is not a native backend; native: {', '.join(PLATFORMS)}")
    return (f'name: "{spec.name}"\nplatform: "{PLATFORMS[backend]}"\nmax_batch_size: 0\n'
            f'default_model_filename: "{MODEL_FILES[backend]}"\n'
            + tensors("input", spec.inputs) + tensors("output", spec.outputs))


def calibration_spec(hidden_size: int) -> ModelSpec:
    """calibration_head with the drafter's hidden size fixed: a native backend checks the config's
    dims against the model's, and the ONNX fixes D."""
    hidden = replace(schema.DRAFT_HIDDEN, dims=(-1, -1, hidden_size))
    return replace(schema.CALIBRATION_HEAD, inputs=(hidden, schema.DRAFT_SCALARS))


def export_native_calibration(drafter, path: Path, tol: float = 1e-4) -> None:
    """The calibration head as ONNX with the schema's tensor names and shapes (draft_hidden
    [B, K, D], draft_scalars [B, K, 3] → accept_prob [B, K]), which a native backend serves as it
    is (the Python model reshapes to [N, ·] itself). Checked against torch on other shapes."""
    import numpy as np
    import onnxruntime as ort
    import torch

    head = drafter.calibration

    class Native(torch.nn.Module):
        def forward(self, hidden, scalars):   # [B, K, D], [B, K, 3] → [B, K]
            B, K = hidden.shape[0], hidden.shape[1]
            flat = head(hidden.reshape(B * K, hidden.shape[2]), scalars.reshape(B * K, 3))
            return torch.sigmoid(flat).reshape(B, K)

    D = drafter.cfg.hidden_size
    names = [schema.DRAFT_HIDDEN.name, schema.DRAFT_SCALARS.name]
    out = schema.ACCEPT_PROB.name
    model = Native().eval()
    with torch.no_grad():
        torch.onnx.export(model, (torch.randn(2, 3, D), torch.rand(2, 3, 3)), str(path), input_names=names,
                          output_names=[out], opset_version=17, dynamo=False,
                          dynamic_axes={names[0]: {0: "B", 1: "K"}, names[1]: {0: "B", 1: "K"}, out: {0: "B", 1: "K"}})
        h, s = torch.randn(3, 5, D), torch.rand(3, 5, 3)
        want = model(h, s).numpy()
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        [out], {names[0]: h.numpy(), names[1]: s.numpy()})[0]
    diff = float(np.abs(got - want).max())
    if diff > tol:
        raise RuntimeError(f"onnxruntime differs from torch by {diff:.2e} > {tol} on the native calibration_head")


def build_plan(onnx_path: Path, plan_path: Path, hidden_size: int, max_num_seqs: int, max_draft_len: int) -> None:
    """A TensorRT plan for the native calibration head (tensorrt_plan's builder)."""
    from specserve.triton import tensorrt_plan

    why = tensorrt_plan.missing_requirements()
    if why:
        raise BackendError(f"cannot build a TensorRT plan for calibration_head here: {why}")
    B, K = max_num_seqs, max_draft_len
    shapes = {schema.DRAFT_HIDDEN.name: ((1, 1, hidden_size), (B, K, hidden_size), (B, K, hidden_size)),
              schema.DRAFT_SCALARS.name: ((1, 1, 3), (B, K, 3), (B, K, 3))}
    tensorrt_plan.build(onnx_path, plan_path, shapes, fp16=False)


# -- what the server has ---------------------------------------------------------------------------
_BACKEND_RE = re.compile(r'^backend:\s*"([^"]+)"', re.M)
_PLATFORM_RE = re.compile(r'^platform:\s*"([^"]+)"', re.M)
_PLATFORM_BACKEND = {"ensemble": None, **{p: b for b, p in PLATFORMS.items()}}


def required_backend(config_text: str) -> str | None:
    """The backend a rendered config.pbtxt needs (None: an ensemble, run by Triton itself)."""
    m = _BACKEND_RE.search(config_text)
    if m:
        return m.group(1)
    m = _PLATFORM_RE.search(config_text)
    if not m:
        raise BackendError("config names neither a backend nor a platform")
    if m.group(1) not in _PLATFORM_BACKEND:
        raise BackendError(f"unknown platform {m.group(1)!r}")
    return _PLATFORM_BACKEND[m.group(1)]


def server_backends(backend_dir: Path) -> list[str]:
    """The backends a tritonserver started with --backend-directory=backend_dir can load."""
    d = Path(backend_dir)
    if not d.is_dir():
        return []
    return sorted(p.name for p in d.iterdir() if p.is_dir() and (p / f"libtriton_{p.name}.so").is_file())


def check_available(backend: str, backend_dir: Path) -> None:
    """Refuse a --drafter-backend the server lacks, before rendering anything."""
    have = server_backends(backend_dir)
    if backend != "python" and backend not in have:
        raise BackendError(f"--drafter-backend {backend}: this tritonserver has no {backend} backend "
                           f"(its backends, in {backend_dir}: {', '.join(have) or 'none'}); the pip-installed "
                           f"tritonserver has only python, the NGC container has onnxruntime and tensorrt. "
                           f"Use --drafter-backend python here")


def check_repository(repo: Path, backend_dir: Path) -> None:
    """Every rendered model's backend must be one the server has."""
    have = server_backends(backend_dir)
    for config in sorted(Path(repo).glob("*/config.pbtxt")):
        need = required_backend(config.read_text())
        if need is not None and need not in have:
            raise BackendError(f"model {config.parent.name} is rendered for Triton's {need} backend, which this "
                               f"tritonserver does not have (its backends, in {backend_dir}: "
                               f"{', '.join(have) or 'none'})")


def rendered_backend(repo: Path, model: str) -> str:
    """The drafter backend a served model was rendered for (drafters publish keeps it)."""
    need = required_backend((Path(repo) / model / "config.pbtxt").read_text())
    return need or "python"
