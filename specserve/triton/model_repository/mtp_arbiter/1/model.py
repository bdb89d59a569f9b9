"""mtp_arbiter: merges the drafters' drafts of each row into one tree of at most the row's budget
nodes (specserve.methods.mtp.arbiter via remote_batch.arbitrate_batch). Stateless; every drafter
input is optional (the engine's fallback calls it with the drafters that are still loaded)."""

import numpy as np
import triton_python_backend_utils as pb_utils

from specserve.methods.mtp.remote_batch import arbitrate_batch
from specserve.triton import pb
from specserve.serving import schema


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                out = arbitrate_batch({t.name: pb.input_array(request, t) for t in schema.MTP_ARBITER.inputs})
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor(t.name, np.ascontiguousarray(out[t.name], dtype=t.numpy_dtype))
                    for t in schema.MTP_ARBITER.outputs]))
            except Exception as e:  # noqa: BLE001
                responses.append(pb.error_response(f"mtp_arbiter: {e}"))
        return responses
