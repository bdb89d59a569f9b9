"""ngram_drafter: prompt-lookup drafts for each row of the mtp_proposal ensemble
(specserve.methods.mtp.remote_batch.ngram_batch). Stateless: it reads each row's tokens."""

import triton_python_backend_utils as pb_utils

from specserve.methods.mtp.remote_batch import ngram_batch
from specserve.triton import pb
from specserve.serving import schema


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tokens = ngram_batch(pb.input_array(request, schema.CONTEXT_TOKENS),
                                     pb.input_array(request, schema.MAX_DRAFT_LEN))
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor(schema.NGRAM_TOKENS.name, tokens)]))
            except Exception as e:  # noqa: BLE001 — answer this request with the error, keep serving
                responses.append(pb.error_response(f"ngram_drafter: {e}"))
        return responses
