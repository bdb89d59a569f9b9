"""target_verifier: the engine, as a decoupled model (specserve.serving.verifier_service).

execute() only queues: each request goes to the engine's continuous batch and its responses are
streamed back later, from the engine thread, through the request's response sender.

Three kinds of request arrive (see specserve/serving/auth.py for the keys):
  * a generation request from the ensemble: input_ids + request_config + preprocess's signature;
  * a cancellation from postprocess (cancel_request_id + internal_key);
  * a shutdown control from `specserve serve` (control + internal_key): drain | abort | status.
"""

import json

import triton_python_backend_utils as pb_utils

from specserve.serving import auth, schema
from specserve.triton import bls, pb
from specserve.serving.build import build_engine
from specserve.triton.metrics import TritonMetrics
from specserve.serving.params import RequestConfig
from specserve.serving.settings import DeploymentSettings
from specserve.serving.verifier_service import VerifierResponse, VerifierService

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# This model's own input specs (all optional here; see schema.py), by name.
IN = {t.name: t for t in schema.TARGET_VERIFIER.inputs}


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

    def send_json(self, payload: dict) -> None:
        """The answer to a control request: its JSON in response_meta, final."""
        self._sender.send(pb.response({schema.TOKEN_WINDOW: [], schema.READ_OFFSET: 0, schema.FLUSH: True,
                                       schema.RESPONSE_META: json.dumps(payload)}), flags=FINAL)

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
        self.key = p["internal_key"]
        settings = DeploymentSettings.from_params(p)
        self.metrics = TritonMetrics(pb_utils)
        # Built on the engine's own thread: a model loaded on another thread decodes slower.
        # Remote proposers call their Triton models by BLS: the calls are made here, in the only
        # layer that touches Triton, and handed down to the builder.
        remote = bls.remote_calls()
        # A target that cannot run any more (a tensor-parallel worker died) unloads this model:
        # Triton then reports it not ready, and model control's load builds a new engine.
        name = args["model_name"]
        self.service = VerifierService(lambda: build_engine(settings, remote)[0], self.metrics,
                                       on_broken=lambda why: pb.unload_later(name))

    def execute(self, requests):
        for request in requests:
            sender = _Sender(request)
            try:
                self._handle(request, sender)
            except ValueError as e:  # RequestRejected, AuthError and malformed tensors: the client's error
                sender.send_error(str(e))
            except Exception as e:  # noqa: BLE001 — every request must get its final response
                sender.send_error(f"internal error in target_verifier: {type(e).__name__}: {e}")
        return None

    def _handle(self, request, sender: _Sender) -> None:
        cancel = pb.input_scalar(request, IN[schema.CANCEL_REQUEST_ID.name])
        control = pb.input_scalar(request, IN[schema.CONTROL.name])
        if cancel is not None or control is not None:
            auth.check_key(self.key, pb.input_scalar(request, IN[schema.INTERNAL_KEY.name]),
                           "cancel_request_id" if cancel is not None else "control")
        if cancel is not None:  # from postprocess: the client of that request has gone
            self.service.cancel(cancel.decode("utf-8"))
            sender.close()
            return
        if control is not None:
            sender.send_json(self._control(control.decode("utf-8")))
            return
        ids = pb.input_array(request, IN[schema.INPUT_IDS.name])
        config = pb.input_scalar(request, IN[schema.REQUEST_CONFIG.name])
        signature = pb.input_scalar(request, IN[schema.SIGNATURE.name])
        if ids is None or config is None:
            raise ValueError("target_verifier is internal: call the 'llm' ensemble")
        ids = [int(t) for t in ids.reshape(-1)]
        config = config.decode("utf-8") if isinstance(config, bytes) else config
        auth.check_signature(self.key, ids, config,
                             signature.decode("utf-8") if isinstance(signature, bytes) else (signature or ""))
        self.service.submit(ids, RequestConfig.from_json(config), sender)

    def _control(self, command: str) -> dict:
        if command == "drain":
            self.service.drain()
        elif command == "abort":
            self.service.abort_all("the server is shutting down: its drain time ran out before this request "
                                   "finished")
        elif command != "status":
            raise ValueError(f"control must be one of {', '.join(schema.CONTROLS)}, got {command!r}")
        return {"live": self.service.num_live}

    def finalize(self):
        self.service.stop()
        self.metrics.close()
