"""Shutdown controls `specserve serve` sends to its own engine (target_verifier), over gRPC.

    drain   refuse new requests with a clear message; those in flight go on
    status  {"live": requests in flight}
    abort   end every request in flight with an error saying the drain time ran out

They carry the deployment's internal key (auth.py), so no client can send them.
"""

from __future__ import annotations

import json
import queue

import numpy as np

from specserve.serving import schema


class ControlError(RuntimeError):
    pass


def send_control(url: str, internal_key: str, command: str, timeout: float = 10.0) -> dict:
    import tritonclient.grpc as grpcclient

    if command not in schema.CONTROLS:
        raise ValueError(f"control must be one of {', '.join(schema.CONTROLS)}, got {command!r}")
    inputs = []
    for spec, value in ((schema.CONTROL, command), (schema.INTERNAL_KEY, internal_key)):
        t = grpcclient.InferInput(spec.name, [1], "BYTES")
        t.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
        inputs.append(t)
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(schema.TARGET_VERIFIER.name, inputs)
        result, error = results.get(timeout=timeout)
    except queue.Empty:
        raise ControlError(f"no answer to {command!r} from {url} within {timeout:.0f} s") from None
    finally:
        try:
            client.stop_stream()
        finally:
            client.close()
    if error is not None:
        raise ControlError(f"{command}: {error.message() if hasattr(error, 'message') else error}")
    return json.loads(result.as_numpy(schema.RESPONSE_META.name).reshape(-1)[0])
