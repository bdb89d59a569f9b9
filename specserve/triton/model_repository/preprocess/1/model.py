"""preprocess: tokenize text_input and normalise the request's parameters (specserve.serving.preprocess)."""

import json

import triton_python_backend_utils as pb_utils

from specserve.triton import pb
from specserve.serving import schema
from specserve.serving.preprocess import Preprocessor
from specserve.serving.tiers import Tier


class TritonPythonModel:
    def initialize(self, args):
        params = pb.model_parameters(args)
        # preprocess_<tier> carries its tier's settings (tiers.py); plain `preprocess` may not.
        tier = Tier.from_json(params["tier_settings"]) if params.get("tier_settings") else params.get("tier", "default")
        self.metrics = None
        gate = None
        if params.get("text_gate"):   # a text_classifier is served (render.py): gate dflash requests
            from specserve.serving.text_gate import TextGate
            from specserve.triton import bls
            from specserve.triton.metrics import TextGateMetrics

            pb.route_logging()
            self.metrics = TextGateMetrics(pb_utils)
            gate = TextGate(bls.text_type_call(), tuple(json.loads(params["text_gate"])["dflash_text_types"]),
                            default_method=params["default_method"], count=self.metrics.count)
        self.pre = Preprocessor(params["checkpoint"], tier=tier,
                                max_model_len=int(params["max_model_len"]), internal_key=params["internal_key"],
                                gate=gate)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                out = self.pre(pb.input_scalar(request, schema.TEXT_INPUT),
                               pb.input_scalar(request, schema.STREAM),
                               pb.input_scalar(request, schema.SAMPLING_PARAMETERS),
                               pb.input_scalar(request, schema.EXCLUDE_INPUT_IN_OUTPUT),
                               {spec.name: pb.input_scalar(request, spec) for spec in schema.RETURN_FLAGS})
                responses.append(pb.response({schema.INPUT_IDS: out.input_ids,
                                              schema.REQUEST_CONFIG: out.config_json,
                                              schema.SIGNATURE: out.signature}))
            except ValueError as e:  # BadRequest and malformed tensors: the client's error
                responses.append(pb.error_response(str(e)))
            except Exception as e:  # noqa: BLE001 — answer this request, keep the others
                responses.append(pb.error_response(f"internal error in preprocess: {type(e).__name__}: {e}"))
        return responses

    def finalize(self):
        if self.metrics is not None:
            self.metrics.close()
