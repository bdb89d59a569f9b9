"""calibration_head: predicted acceptance probability of each drafted position (ONNX under
onnxruntime; specserve.methods.eagle.onnx_runtime.CalibrationOnnxRuntime)."""

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from specserve.methods.eagle.onnx_runtime import CalibrationOnnxRuntime
from specserve.triton import pb
from specserve.serving import schema


class TritonPythonModel:
    def initialize(self, args):
        onnx_file = Path(args["model_repository"]) / args["model_version"] / "calibration_head.onnx"
        if not onnx_file.is_file():
            raise FileNotFoundError(f"calibration_head: {onnx_file} is missing")
        self.rt = CalibrationOnnxRuntime(str(onnx_file), device=pb.model_parameters(args).get("device", "auto"))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                hidden = pb.input_array(request, schema.DRAFT_HIDDEN)
                scalars = pb.input_array(request, schema.DRAFT_SCALARS)
                prob = self.rt.accept_prob(hidden, scalars)
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor(schema.ACCEPT_PROB.name, np.ascontiguousarray(prob, dtype=np.float32))]))
            except Exception as e:  # noqa: BLE001
                responses.append(pb.error_response(f"calibration_head: {e}"))
        return responses
