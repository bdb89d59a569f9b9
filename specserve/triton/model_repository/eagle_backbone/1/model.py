"""eagle_backbone: the EAGLE drafter's ONNX backbone with per-sequence state
(specserve.methods.eagle.onnx_runtime). One instance, so the state of a sequence is always here.

A request either drafts (seq_ids, valid_from, num_new, features, next_tokens, max_draft_len, and
optionally each row's sampling: schema.ROW_SAMPLING) or releases finished sequences (release_ids
alone; answered with empty outputs).
"""

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from specserve.methods.eagle.onnx_runtime import DraftBatch, EagleOnnxRuntime
from specserve.triton import pb
from specserve.serving import schema

DRAFT_INPUTS = ("seq_ids", "valid_from", "num_new", "features", "next_tokens", "max_draft_len")
SPECS = {t.name: t for t in schema.EAGLE_BACKBONE.inputs}
# Optional: without them every row drafts greedily (DraftBatch.seeded_params).
SAMPLING_INPUTS = tuple(t.name for t in schema.ROW_SAMPLING)


def _out(spec, arr):
    return pb_utils.Tensor(spec.name, np.ascontiguousarray(arr, dtype=spec.numpy_dtype))


class TritonPythonModel:
    def initialize(self, args):
        p = pb.model_parameters(args)
        version_dir = Path(args["model_repository"]) / args["model_version"]
        onnx_file = version_dir / "eagle_backbone.onnx"
        if not onnx_file.is_file():
            raise FileNotFoundError(f"eagle_backbone: {onnx_file} is missing")
        self.rt = EagleOnnxRuntime(str(onnx_file), int(p["kv_heads"]), int(p["head_dim"]), device=p.get("device", "auto"))
        self.hidden = int(p["hidden_size"])

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                release, arrays = pb.release_or_inputs(request, SPECS, DRAFT_INPUTS, "eagle_backbone")
                if release is not None:
                    self.rt.release(release)
                    res = None
                else:
                    sampling = {n: pb.input_array(request, SPECS[n]) for n in SAMPLING_INPUTS}
                    res = self.rt.draft(DraftBatch(**arrays, **sampling))
                if res is None:
                    outs = [_out(schema.DRAFT_TOKENS, np.zeros((0, 0))), _out(schema.DRAFT_HIDDEN, np.zeros((0, 0, self.hidden))),
                            _out(schema.DRAFT_SCALARS, np.zeros((0, 0, 3))), _out(schema.DRAFT_LOGPROBS, np.zeros((0, 0))),
                            _out(schema.UNKNOWN, np.zeros(0))]
                else:
                    outs = [_out(schema.DRAFT_TOKENS, res.tokens), _out(schema.DRAFT_HIDDEN, res.hidden),
                            _out(schema.DRAFT_SCALARS, res.scalars), _out(schema.DRAFT_LOGPROBS, res.logprobs),
                            _out(schema.UNKNOWN, res.unknown)]
                responses.append(pb_utils.InferenceResponse(output_tensors=outs))
            except Exception as e:  # noqa: BLE001 — answer this request with the error, keep serving
                responses.append(pb.error_response(f"eagle_backbone: {e}"))
        return responses
