"""The OpenAI routes: /v1/models, /v1/completions, /v1/chat/completions (server-sent events or not).

Usage counts are the server's: prompt_tokens = num_input_tokens, completion_tokens = the sum of
the responses' num_output_tokens. With stream_options.include_usage the stream ends with a chunk
whose choices are empty and whose usage is set (every other chunk carries "usage": null), then
`data: [DONE]`. Our spec_stats ride on the response (streaming: on the chunk with the finish_reason).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

# At module level: FastAPI resolves the routes' annotations (Request) in this module's namespace.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from specserve.openai.backend import BackendError, ServedModel, TritonBackend
from specserve.openai.chat import ChatTemplate
from specserve.openai.protocol import GenerateCall, OpenAIError, parse_chat, parse_completion
from specserve.triton.client import Piece

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class Kind:
    """What differs between the two generation routes."""
    id_prefix: str
    object: str
    chunk_object: str


CHAT = Kind("chatcmpl", "chat.completion", "chat.completion.chunk")
COMPLETION = Kind("cmpl", "text_completion", "text_completion")


def _param_of(message: str) -> str | None:
    """The field a server message is about ("sampling_parameters.top_k must …", "max_tokens=9 exceeds …")."""
    from specserve.serving.params import SAMPLING_KEYS

    m = re.search(r"\b([a-z_]+)(?: must|=\d| \d+ exceeds)", message)
    return m.group(1) if m and m.group(1) in SAMPLING_KEYS else None


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _choice(kind: Kind, text: str, finish: str | None, *, delta: bool, first: bool = False) -> dict:
    if kind is COMPLETION:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if not delta:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}
    body = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    return {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish}


def _finish(reason: str) -> str:
    return reason if reason in FINISH_REASONS else "stop"


class OpenAIService:
    def __init__(self, backend: TritonBackend, served: ServedModel, chat: ChatTemplate):
        self.backend, self.served, self.chat = backend, served, chat

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.served.model_id, "object": "model", "created": 0,
                                            "owned_by": "specserve", "max_model_len": self.served.max_model_len}]}

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.served.model_id:
            raise OpenAIError(f"the model {model!r} does not exist; this server serves {self.served.model_id!r}",
                              "model", status=404, code="model_not_found")

    def _prepare(self, call: GenerateCall) -> tuple[str, dict]:
        """The prompt text and sampling_parameters; max_tokens defaults to what the model length leaves."""
        prompt = call.prompt if call.messages is None else self.chat.render(call.messages)
        sampling = dict(call.sampling)
        if "max_tokens" not in sampling:
            left = self.served.max_model_len - self.chat.count_tokens(prompt)
            if left < 1:
                raise OpenAIError(f"the prompt fills the model length {self.served.max_model_len}",
                                  "messages" if call.messages is not None else "prompt")
            sampling["max_tokens"] = left
        return prompt, sampling

    async def handle(self, kind: Kind, body) -> tuple[dict | None, AsyncIterator[str] | None]:
        """(the JSON response, None) or (None, the SSE lines); raises OpenAIError before any output."""
        call = parse_chat(body) if kind is CHAT else parse_completion(body)
        self._check_model(body)
        prompt, sampling = self._prepare(call)
        pieces = self.backend.generate(prompt, sampling)
        try:
            first = await pieces.__anext__()
        except BackendError as e:
            await pieces.aclose()
            raise OpenAIError(str(e), _param_of(str(e))) from None
        rid, created = f"{kind.id_prefix}-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": kind.object, "created": created, "model": self.served.model_id}
        if not call.stream:
            return await self._collect(kind, head, first, pieces), None
        return None, self._events(kind, {**head, "object": kind.chunk_object}, first, pieces, call.include_usage)

    async def _collect(self, kind: Kind, head: dict, first: Piece, pieces: AsyncIterator[Piece]) -> dict:
        last, text, n_out = first, [first.text], first.num_output_tokens
        try:
            async for p in pieces:
                last = p
                text.append(p.text)
                n_out += p.num_output_tokens
        except BackendError as e:
            raise OpenAIError(str(e), None, status=500, kind="server_error") from None
        return {**head, "choices": [_choice(kind, "".join(text), _finish(last.finish_reason), delta=False)],
                "usage": _usage(last.num_input_tokens, n_out), "spec_stats": last.spec_stats}

    async def _events(self, kind: Kind, head: dict, first: Piece, pieces: AsyncIterator[Piece],
                      include_usage: bool) -> AsyncIterator[str]:
        def event(obj: dict) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        extra = {"usage": None} if include_usage else {}
        n_in, n_out = first.num_input_tokens, 0
        try:
            p, is_first = first, True
            while True:
                n_out += p.num_output_tokens
                finish = _finish(p.finish_reason) if p.finish_reason else None
                if p.text or is_first:
                    yield event({**head, "choices": [_choice(kind, p.text, None, delta=True, first=is_first)],
                                 **extra})
                if finish:
                    yield event({**head, "choices": [_choice(kind, "", finish, delta=True)],
                                 "spec_stats": p.spec_stats, **extra})
                    break
                p, is_first = await pieces.__anext__(), False
        except BackendError as e:   # mid-stream: the error travels as an event
            yield event(OpenAIError(str(e), None, status=500, kind="server_error").body())
        except StopAsyncIteration:
            pass
        finally:
            await pieces.aclose()
        if include_usage:
            yield event({**head, "choices": [], "usage": _usage(n_in, n_out)})
        yield "data: [DONE]\n\n"


def make_app(service: OpenAIService) -> FastAPI:
    app = FastAPI(title="specserve OpenAI-compatible API")

    def error(e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def generate(kind: Kind, request: Request):
        try:
            body = await request.json()
        except ValueError:
            return error(OpenAIError("the request body is not valid JSON"))
        try:
            result, events = await service.handle(kind, body)
        except OpenAIError as e:
            return error(e)
        if events is None:
            return JSONResponse(result)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/v1/models")
    async def models():
        return service.models()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(CHAT, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(COMPLETION, request)

    return app
