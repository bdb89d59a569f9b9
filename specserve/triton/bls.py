"""BLS calls from the engine thread to remote proposal models (inside Triton's Python backend).

`proposal_call(model)` returns the `call` a RemoteProposer needs; any error the server answers
(e.g. "model is not ready" while the drafter is unloaded) is raised, and the RemoteProposer turns
it into "no draft this step".
"""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from specserve.triton import schema
from specserve.triton.schema import ModelSpec


def _request(spec: ModelSpec, inputs: dict[str, np.ndarray], outputs: tuple[str, ...]):
    tensors = [pb_utils.Tensor(name, np.ascontiguousarray(arr)) for name, arr in inputs.items()]
    return pb_utils.InferenceRequest(model_name=spec.name, requested_output_names=list(outputs), inputs=tensors)


def _exec(spec: ModelSpec, inputs: dict[str, np.ndarray], outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
    response = _request(spec, inputs, outputs).exec()
    if response.has_error():
        raise RuntimeError(f"{spec.name}: {response.error().message()}")
    out = {}
    for name in outputs:
        t = pb_utils.get_output_tensor_by_name(response, name)
        if t is None:
            raise RuntimeError(f"{spec.name} returned no {name!r}")
        out[name] = t.as_numpy()
    return out


def proposal_call(spec: ModelSpec = schema.EAGLE_PROPOSAL):
    outputs = tuple(t.name for t in spec.outputs)
    return lambda inputs: _exec(spec, inputs, outputs)


def release_call(spec: ModelSpec = schema.EAGLE_BACKBONE):
    outputs = (schema.UNKNOWN.name,)
    return lambda ids: _exec(spec, {schema.RELEASE_IDS.name: np.asarray(ids, dtype=np.int64)}, outputs)


def text_type_call(spec: ModelSpec = schema.TEXT_CLASSIFIER):
    """`classify(text) → Classification` for the text-type gate; any failure (the model unloaded,
    restarting or erroring) raises ClassifierUnavailable, which keeps the request's method."""
    from specserve.text_gate import Classification, ClassifierUnavailable

    outputs = (schema.TEXT_TYPE.name, schema.TEXT_TYPE_PROB.name)

    def classify(text: str) -> Classification:
        try:
            out = _exec(spec, {schema.GATE_TEXT.name: np.array([text.encode("utf-8", "surrogatepass")],
                                                                dtype=np.object_)}, outputs)
            found = out[schema.TEXT_TYPE.name].reshape(-1)[0]
            prob = float(out[schema.TEXT_TYPE_PROB.name].reshape(-1)[0])
        except Exception as e:  # noqa: BLE001 — whatever failed, the gate must not fail the request
            raise ClassifierUnavailable(str(e)) from None
        return Classification(found.decode() if isinstance(found, bytes) else str(found), prob)
    return classify
