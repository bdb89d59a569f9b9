"""mtp_heads: the MTP heads' ONNX graph under onnxruntime (specserve.methods.mtp.heads_onnx_runtime.
HeadsOnnxRuntime): each row's f_t (its last new feature row) → the chain of each head's top-1
token with its log-probability. Stateless. Its version folder holds mtp_heads.onnx."""

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from specserve.methods.mtp.heads_onnx_runtime import HeadsOnnxRuntime
from specserve.triton import pb
from specserve.serving import schema


class TritonPythonModel:
    def initialize(self, args):
        onnx_file = Path(args["model_repository"]) / args["model_version"] / "mtp_heads.onnx"
        if not onnx_file.is_file():
            raise FileNotFoundError(f"mtp_heads: {onnx_file} is missing")
        self.rt = HeadsOnnxRuntime(onnx_file, device=pb.model_parameters(args).get("device", "auto"))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tokens, lps = self.rt.chains(*(pb.input_array(request, t) for t in schema.MTP_HEADS.inputs))
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor(schema.HEADS_TOKENS.name, np.ascontiguousarray(tokens, dtype=np.int64)),
                    pb_utils.Tensor(schema.HEADS_LOGPROBS.name, np.ascontiguousarray(lps, dtype=np.float32))]))
            except Exception as e:  # noqa: BLE001 — answer this request with the error, keep serving
                responses.append(pb.error_response(f"mtp_heads: {e}"))
        return responses
