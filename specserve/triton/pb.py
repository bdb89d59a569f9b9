"""Tensor conversion helpers for the model_repository adapters (importable only inside Triton's
Python backend stub, where `triton_python_backend_utils` exists)."""

from __future__ import annotations

import json
import logging

import numpy as np
import triton_python_backend_utils as pb_utils

from specserve.serving.schema import RELEASE_IDS, TensorSpec


def model_parameters(args: dict) -> dict[str, str]:
    """The string parameters the renderer put in this model's config.pbtxt."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def input_array(request, spec: TensorSpec) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
    if tensor is None:
        if spec.optional:
            return None
        raise ValueError(f"missing required input {spec.name!r}")
    return tensor.as_numpy()


def release_or_inputs(request, specs: dict[str, TensorSpec], names, model: str):
    """A stateful drafter's request (eagle_backbone, draft_drafter): (the sequence ids to release,
    None), or (None, its inputs by name); ValueError naming what is missing, for the caller."""
    release = input_array(request, RELEASE_IDS)
    if release is not None:
        return release.reshape(-1).tolist(), None
    arrays = {n: input_array(request, specs[n]) for n in names}
    missing = [n for n, a in arrays.items() if a is None]
    if missing:
        raise ValueError(f"{model} needs {', '.join(missing)} (or release_ids)")
    return None, arrays


def input_scalar(request, spec: TensorSpec):
    """The single element of a [1]-shaped input, or None for an absent optional input."""
    arr = input_array(request, spec)
    if arr is None:
        return None
    if arr.size != 1:
        raise ValueError(f"input {spec.name!r} must hold exactly one element, got shape {list(arr.shape)}")
    value = arr.reshape(-1)[0]
    return value.item() if isinstance(value, np.generic) else value


def output_tensor(spec: TensorSpec, value) -> "pb_utils.Tensor":
    if spec.dtype == "STRING":
        items = [value] if isinstance(value, (str, bytes)) else list(value)
        arr = np.array([v.encode("utf-8") if isinstance(v, str) else v for v in items], dtype=np.object_)
    else:
        arr = np.asarray(value, dtype=spec.numpy_dtype).reshape(-1)
    return pb_utils.Tensor(spec.name, arr)


def response(values: dict[TensorSpec, object]) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(output_tensors=[output_tensor(s, v) for s, v in values.items()])


def error_response(message: str) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))


class _TritonLogHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        log = pb_utils.Logger
        write = (log.log_error if record.levelno >= logging.ERROR else
                 log.log_warn if record.levelno >= logging.WARNING else log.log_info)
        write(self.format(record))


def route_logging(level: int = logging.INFO) -> None:
    """Send specserve's log records to Triton's log (with its timestamps and verbosity), not the
    stub's bare stderr."""
    logger = logging.getLogger("specserve")
    if not any(isinstance(h, _TritonLogHandler) for h in logger.handlers):
        handler = _TritonLogHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level)


def unload_later(model_name: str) -> None:
    """Ask Triton to unload `model_name` (this very model, say), from a thread of its own: the
    caller may be the engine thread, which the unload's finalize stops.

    This tritonserver's Python backend cannot report a loaded model not ready (a model-defined
    readiness check came to the backend later), so a model that cannot serve any more unloads
    itself: Triton then reports it (and the ensembles it is a step of) not ready, and model
    control's `load` builds it again. Needs explicit model control (`specserve serve` runs it);
    in another mode the unload is refused, and that is logged."""
    import threading

    def unload() -> None:
        logging.getLogger("specserve").error("%s unloads itself: Triton reports it not ready until model "
                                             "control loads it again", model_name)
        try:
            pb_utils.unload_model(model_name=model_name)
        except Exception as e:  # noqa: BLE001 — nothing more this model can do
            logging.getLogger("specserve").error("%s could not unload itself (%s): it stays loaded and refuses "
                                                 "every request until it is loaded again", model_name, e)

    threading.Thread(target=unload, name="specserve-unload", daemon=True).start()
