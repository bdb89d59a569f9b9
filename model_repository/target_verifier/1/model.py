"""target_verifier: the engine, as a decoupled model (specserve.triton.service).

execute() only queues: each request goes to the engine's continuous batch and its responses are
streamed back later, from the engine thread, through the request's response sender.
"""

from pathlib import Path

import triton_python_backend_utils as pb_utils

from specserve.triton import pb, schema
from specserve.triton.factory import EngineSettings, build_engine
from specserve.triton.metrics import TritonMetrics
from specserve.triton.params import RequestConfig
from specserve.triton.render import decode_drafters
from specserve.triton.service import VerifierResponse, VerifierService

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# This model's own input specs: input_ids / request_config are optional here (see schema.py).
INPUT_IDS, REQUEST_CONFIG, CANCEL_REQUEST_ID = schema.TARGET_VERIFIER.inputs


class _Sender:
    """service.Sender over a Triton response sender."""

    def __init__(self, request):
        self._sender = request.get_response_sender()

    def send(self, r: VerifierResponse) -> None:
        self._sender.send(pb.response({schema.TOKEN_WINDOW: r.window.token_ids,
                                       schema.READ_OFFSET: r.window.read_offset,
                                       schema.FLUSH: r.window.flush,
                                       schema.RESPONSE_META: r.meta.to_json()}),
                          flags=FINAL if r.final else 0)

    def send_error(self, message: str) -> None:
        self._sender.send(pb.error_response(message), flags=FINAL)

    def close(self) -> None:
        self._sender.send(flags=FINAL)

    def is_cancelled(self) -> bool:
        return self._sender.is_cancelled()


class TritonPythonModel:
    def initialize(self, args):
        pb.route_logging()
        p = pb.model_parameters(args)
        settings = EngineSettings(checkpoint=Path(p["checkpoint"]), max_num_seqs=int(p["max_num_seqs"]),
                                  max_model_len=int(p["max_model_len"]), max_draft_len=int(p["max_draft_len"]),
                                  default_method=p["default_method"],
                                  drafters=decode_drafters(p.get("drafters", "")),
                                  placement=p.get("placement", "fused"), dtype=p.get("dtype", "float32"),
                                  drafter_dtype=p.get("drafter_dtype", "auto"), device=p.get("device", "auto"),
                                  spec_threshold=float(p["spec_threshold"]) if p.get("spec_threshold") else None)
        self.metrics = TritonMetrics(pb_utils)
        # Built on the engine's own thread: a model loaded on another thread decodes slower.
        self.service = VerifierService(lambda: build_engine(settings)[0], self.metrics)

    def execute(self, requests):
        for request in requests:
            sender = _Sender(request)
            try:
                cancel = pb.input_scalar(request, CANCEL_REQUEST_ID)
                if cancel is not None:  # from postprocess: the client of that request has gone
                    self.service.cancel(cancel.decode("utf-8"))
                    sender.close()
                    continue
                ids, config = pb.input_array(request, INPUT_IDS), pb.input_scalar(request, REQUEST_CONFIG)
                if ids is None or config is None:
                    raise ValueError("target_verifier needs input_ids and request_config (or cancel_request_id)")
                self.service.submit([int(t) for t in ids], RequestConfig.from_json(config), sender)
            except ValueError as e:  # RequestRejected and malformed tensors: the client's error
                sender.send_error(str(e))
            except Exception as e:  # noqa: BLE001 — every request must get its final response
                sender.send_error(f"internal error in target_verifier: {type(e).__name__}: {e}")
        return None

    def finalize(self):
        self.service.stop()
        self.metrics.close()
