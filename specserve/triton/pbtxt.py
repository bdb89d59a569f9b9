"""The tensor lists of a config.pbtxt (protobuf text format), shared by the repository renderer
(render.py) and the native drafter backends' configs (drafter_backends.py)."""

from __future__ import annotations

from specserve.serving.schema import TensorSpec


def _tensor(t: TensorSpec, is_input: bool) -> str:
    dims = ", ".join(str(d) for d in t.dims)
    opt = " optional: true" if t.optional and is_input else ""
    return f'  {{ name: "{t.name}" data_type: TYPE_{t.dtype} dims: [ {dims} ]{opt} }}'


def tensors(kind: str, specs: tuple[TensorSpec, ...]) -> str:
    """kind "input" or "output" → its block: `input [ { name: … data_type: … dims: […] }, … ]`."""
    return f"{kind} [\n" + ",\n".join(_tensor(t, kind == "input") for t in specs) + "\n]\n"
