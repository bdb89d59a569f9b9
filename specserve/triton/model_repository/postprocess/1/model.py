"""postprocess: one target_verifier response → text_output and the counters (stateless).

Also the one place that sees a client's cancellation (see specserve/serving/schema.py): a
cancelled response makes it tell target_verifier, by BLS, to cancel the engine request.
"""

import json
from collections import deque

import numpy as np
import triton_python_backend_utils as pb_utils

from specserve.triton import pb
from specserve.serving import schema
from specserve.serving.detokenize import ResponseMeta, TokenWindow, text_delta
from specserve.model.tokenizer import load_tokenizer, make_decode


class TritonPythonModel:
    def initialize(self, args):
        params = pb.model_parameters(args)
        self.decode = make_decode(load_tokenizer(params["checkpoint"]))
        self.key = params["internal_key"]  # authorises the cancel (auth.py)
        # Responses already in flight keep arriving after a cancel; tell the engine once.
        self.cancelled = deque(maxlen=1024)

    def cancel_upstream(self, request_id: str) -> None:
        if request_id in self.cancelled:
            return
        self.cancelled.append(request_id)
        inputs = [pb_utils.Tensor(spec.name, np.array([value.encode()], dtype=np.object_))
                  for spec, value in ((schema.CANCEL_REQUEST_ID, request_id), (schema.INTERNAL_KEY, self.key))]
        bls = pb_utils.InferenceRequest(model_name=schema.TARGET_VERIFIER.name, inputs=inputs,
                                        requested_output_names=[])
        for response in bls.exec(decoupled=True):  # drains the one empty, final response
            if response.has_error():  # the client is gone either way: log, don't fail
                pb_utils.Logger.log_warn(f"cancelling {request_id} failed: {response.error().message()}")

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                window = TokenWindow([int(t) for t in pb.input_array(request, schema.TOKEN_WINDOW)],
                                     int(pb.input_scalar(request, schema.READ_OFFSET)),
                                     bool(pb.input_scalar(request, schema.FLUSH)))
                meta = ResponseMeta.from_json(pb.input_scalar(request, schema.RESPONSE_META))
                if request.is_cancelled():
                    # Answer normally all the same: in Triton 2.51 an error response here leaves
                    # the cancelled ensemble request in flight forever (shutdown then hangs).
                    self.cancel_upstream(meta.request_id)
                elif meta.error is not None:
                    # The engine ended this request early (service.py): the client hears why.
                    responses.append(pb.error_response(meta.error))
                    continue
                responses.append(pb.response({
                    schema.TEXT_OUTPUT: text_delta(self.decode, window),
                    schema.NUM_INPUT_TOKENS: meta.num_input_tokens,
                    schema.NUM_OUTPUT_TOKENS: meta.num_output_tokens,
                    schema.FINISH_REASON: meta.finish_reason,
                    schema.SPEC_STATS: json.dumps(meta.spec_stats),
                }))
            except ValueError as e:  # DetokenizeError, malformed tensors
                responses.append(pb.error_response(str(e)))
            except Exception as e:  # noqa: BLE001 — answer this request, keep the others
                responses.append(pb.error_response(f"internal error in postprocess: {type(e).__name__}: {e}"))
        return responses
