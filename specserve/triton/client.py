"""A small tritonclient.grpc streaming client for the `llm` ensemble (used by clients/, the demo
and the tests): one request per stream, responses gathered into a Completion."""

from __future__ import annotations

import json
import queue
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from specserve.serving import schema


class CompletionError(RuntimeError):
    """The server answered the request with an error; the message is the server's."""


@dataclass
class Completion:
    text: str
    chunks: list[str]                 # text_output of each response, in order
    finish_reason: str
    num_input_tokens: int
    num_output_tokens: int
    spec_stats: dict = field(default_factory=dict)
    ttft_s: float = 0.0               # first response with text
    first_response_s: float = 0.0     # first response of any kind (carries the prefill's token)
    total_s: float = 0.0


def build_inputs(prompt: str | bytes | None, sampling: dict | str | None = None, *,
                 stream: bool | None = True, exclude_input_in_output: bool | None = None,
                 return_flags: dict[str, bool] | None = None):
    """InferInputs for `llm`; None leaves an input out (they are optional except text_input).
    `return_flags`: the vLLM backend's return_* inputs by name (schema.RETURN_FLAGS)."""
    import tritonclient.grpc as grpcclient

    def tensor(spec: schema.TensorSpec, value):
        dtype = "BYTES" if spec.dtype == "STRING" else spec.dtype
        arr = np.array([value], dtype=spec.numpy_dtype)
        t = grpcclient.InferInput(spec.name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t

    if isinstance(sampling, dict):
        sampling = json.dumps(sampling)
    values = {schema.TEXT_INPUT: prompt.encode() if isinstance(prompt, str) else prompt,
              schema.STREAM: stream, schema.SAMPLING_PARAMETERS: sampling,
              schema.EXCLUDE_INPUT_IN_OUTPUT: exclude_input_in_output}
    flags = return_flags or {}
    values.update({spec: flags.get(spec.name) for spec in schema.RETURN_FLAGS})
    return [tensor(spec, v) for spec, v in values.items() if v is not None]


@dataclass(frozen=True)
class Piece:
    """One response of `llm`: its text and counters (num_output_tokens: this response's)."""
    text: str
    finish_reason: str                # "" until the final response
    num_input_tokens: int
    num_output_tokens: int
    spec_stats: dict


def read_response(result) -> Piece | None:
    """An InferResult of `llm` → its Piece; None for the empty final response."""
    text = result.as_numpy(schema.TEXT_OUTPUT.name)
    if text is None:
        return None

    def scalar(spec: schema.TensorSpec):
        return result.as_numpy(spec.name).reshape(-1)[0]

    return Piece(text.reshape(-1)[0].decode("utf-8"), scalar(schema.FINISH_REASON).decode(),
                 int(scalar(schema.NUM_INPUT_TOKENS)), int(scalar(schema.NUM_OUTPUT_TOKENS)),
                 json.loads(scalar(schema.SPEC_STATS)))


class StreamClient:
    def __init__(self, url: str, model: str = schema.ENSEMBLE.name):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.model = model

    def generate(self, prompt: str | bytes | None, sampling: dict | str | None = None, *,
                 stream: bool | None = True, exclude_input_in_output: bool | None = None,
                 timeout: float = 120.0, on_chunk: Callable[[str], None] | None = None) -> Completion:
        """Send one request and wait for its final response; on_chunk sees each piece of text."""
        results: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: results.put((result, error)))
        try:
            start = time.monotonic()
            self.client.async_stream_infer(
                self.model, build_inputs(prompt, sampling, stream=stream,
                                         exclude_input_in_output=exclude_input_in_output),
                enable_empty_final_response=True)
            return self._collect(results, start, timeout, on_chunk)
        finally:
            self.client.stop_stream()

    def _collect(self, results: queue.Queue, start: float, timeout: float,
                 on_chunk: Callable[[str], None] | None) -> Completion:
        out = Completion("", [], "", 0, 0)
        while True:
            result, error = results.get(timeout=timeout)
            if error is not None:
                raise CompletionError(str(error.message() if hasattr(error, "message") else error))
            if not out.first_response_s:
                out.first_response_s = time.monotonic() - start
            piece = read_response(result)
            if piece is not None:
                if piece.text and not out.ttft_s:
                    out.ttft_s = time.monotonic() - start
                out.chunks.append(piece.text)
                if on_chunk is not None:
                    on_chunk(piece.text)
                out.finish_reason = piece.finish_reason
                out.num_input_tokens = piece.num_input_tokens
                # Per response, as the vLLM backend counts them: the total is their sum.
                out.num_output_tokens += piece.num_output_tokens
                out.spec_stats = piece.spec_stats
            if result.get_response().parameters["triton_final_response"].bool_param:
                out.text = "".join(out.chunks)
                out.total_s = time.monotonic() - start
                return out

    def close(self) -> None:
        self.client.close()
