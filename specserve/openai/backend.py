"""The `llm` ensemble over tritonclient's asyncio gRPC streaming: one stream per request.

A request's stream stays open until its final response (the one with a finish_reason: asyncio's
stream_infer cannot ask for Triton's empty final response). Closing the generator early — the
HTTP client went away — cancels the gRPC call; Triton passes the cancellation to the ensemble,
whose postprocess cancels the engine request and frees its KV slot (schema.py, "Cancellation").
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from specserve.serving import schema
from specserve.triton.client import Piece, build_inputs, read_response


class BackendError(RuntimeError):
    """The server refused or failed the request; the message is the server's."""


@dataclass(frozen=True)
class ServedModel:
    """What the frontend must know of the served model. Told, not asked: the server's model
    configs are admin-only (they carry the deployment's internal key, auth.py)."""
    checkpoint: Path      # its chat template and tokenizer
    max_model_len: int    # as served (`serve --max-model-len`): the default max_tokens is what it leaves

    @property
    def model_id(self) -> str:
        return self.checkpoint.name


class TritonBackend:
    def __init__(self, url: str, model: str = schema.ENSEMBLE.name):
        self.url, self.model = url, model
        self._client = None

    @property
    def client(self):
        # Created on first use, inside the event loop that serves the requests.
        if self._client is None:
            import tritonclient.grpc.aio as grpcclient

            self._client = grpcclient.InferenceServerClient(self.url)
        return self._client

    async def generate(self, prompt: str, sampling: dict) -> AsyncIterator[Piece]:
        """The request's responses in order; raises BackendError on an error response."""
        done = asyncio.Event()

        async def requests():
            yield {"model_name": self.model, "inputs": build_inputs(prompt, sampling, stream=True)}
            await done.wait()   # keep the stream open until the final response

        responses = self.client.stream_infer(requests())
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    raise BackendError(error.message() if hasattr(error, "message") else str(error))
                piece = read_response(result)
                if piece is None:
                    continue
                if piece.finish_reason:
                    finished = True
                yield piece
                if finished:
                    return
        finally:
            done.set()   # ends the request stream: a finished request closes it normally
            if not finished:
                # A client gone mid-stream (or an error): cancel, so the engine frees the slot.
                # Only then: after the final response a cancel races tritonserver's own end of
                # the stream, and serve's shutdown twice found `llm` still live after OpenAI
                # requests (exit timeout, exit 1) where plain gRPC clients, which never cancel a
                # finished stream, left none.
                responses.cancel()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
