"""BLS calls from the engine thread to remote proposal models (inside Triton's Python backend).

`proposal_call(model)` returns the `call` a RemoteProposer needs; any error the server answers
(e.g. "model is not ready" while the drafter is unloaded) is raised, and the RemoteProposer turns
it into "no draft this step".
"""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

from specserve.core.proposer import RemoteCalls
from specserve.serving import schema
from specserve.serving.schema import ModelSpec


def remote_calls() -> RemoteCalls:
    """The BLS calls of a deployment's remote proposers, for build_engine (target_verifier)."""
    return RemoteCalls(eagle_proposal=proposal_call(), eagle_release=release_call(),
                       mtp_proposal=mtp_call, mtp_release=mtp_release_call)


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
    from specserve.serving.text_classifier import Classification, ClassifierUnavailable

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
def _try(spec: ModelSpec, inputs: dict[str, np.ndarray], outputs: tuple[str, ...]) -> dict[str, np.ndarray] | None:
    try:
        return _exec(spec, inputs, outputs)
    except RuntimeError:
        return None


def _drafter_alone(name: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """Member `name`'s drafter models of mtp_proposal by BLS, in the order its registry entry
    lists them (Member.triton_models): the first drafts (None when it is down); each later one
    works on what came before and is left out when down (EAGLE's calibration_head: without it
    EAGLE's chain is not cut). Returns what mtp_arbiter reads, and `unknown`."""
    first, *rest = schema.MTP_DRAFTERS[name]
    got = _try(first, _inputs_for(first, inputs), tuple(t.name for t in first.outputs))
    if got is None:
        return None
    for spec in rest:
        more = _try(spec, _inputs_for(spec, {**inputs, **got}), tuple(t.name for t in spec.outputs))
        got.update(more or {})
    wanted = {t.name for t in schema.MTP_ARBITER.inputs} | {schema.UNKNOWN.name}
    return {k: v for k, v in got.items() if k in wanted}


def _inputs_for(spec: ModelSpec, available: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {t.name: available[t.name] for t in spec.inputs if t.name in available}


def mtp_call(served: list[str] | tuple[str, ...]):
    """The remote `mtp` proposer's call: the mtp_proposal ensemble; when it fails (a member model
    unloaded), the drafters of the `served` sub-proposers that are still loaded, then
    mtp_arbiter, by BLS one at a time. The answer's `skipped` names the ensemble and the
    sub-proposers left out (counted per request in spec_stats)."""
    ensemble = proposal_call(schema.MTP_PROPOSAL)
    tree_outputs = tuple(t.name for t in schema.MTP_ARBITER.outputs)
    schema.mtp_proposal_steps(served)   # refuses unknown names now, not on the first failure

    def call(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            return ensemble(inputs)
        except RuntimeError as e:
            failure = e
        drafted, skipped = {}, ["mtp_proposal"]
        unknown = np.zeros(len(inputs[schema.SEQ_IDS.name]), dtype=bool)
        for name in schema.MTP_DRAFTERS:
            if name not in served:
                continue
            got = _drafter_alone(name, inputs)
            if got is None:
                skipped.append(name)
                continue
            unknown = got.pop(schema.UNKNOWN.name, unknown)
            drafted.update(got)
        if not drafted:
            raise failure
        settings = {t.name: inputs[t.name] for t in schema.TREE_SETTINGS}
        out = _exec(schema.MTP_ARBITER, {**drafted, **settings}, tree_outputs)
        return {**out, schema.UNKNOWN.name: unknown, "skipped": skipped}
    return call


def mtp_release_call(served: list[str] | tuple[str, ...]):
    """Frees a finished sequence in every served mtp drafter model that keeps per-sequence state
    (those taking release_ids: eagle_backbone, draft_drafter). Each is tried; failures are raised
    together after (RemoteProposer logs them; an unloaded drafter has no state to free)."""
    keepers = [spec for spec in schema.mtp_proposal_steps(served) if schema.RELEASE_IDS in spec.inputs]

    def release(ids) -> None:
        errors = []
        for spec in keepers:
            try:
                _exec(spec, {schema.RELEASE_IDS.name: np.asarray(ids, dtype=np.int64)}, (spec.outputs[0].name,))
            except RuntimeError as e:
                errors.append(str(e))
        if errors:
            raise RuntimeError("; ".join(errors))
    return release
