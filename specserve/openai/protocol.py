"""OpenAI request bodies → a GenerateCall for the `llm` ensemble; the OpenAI error shape.

Checked here, each error naming its field (`param`): the OpenAI fields we implement (max_tokens /
max_completion_tokens, temperature, top_p, seed, stop, n = 1, stream, stream_options), the
ones we do not (refused unless left at their default, so nothing is silently ignored), and our
own options as extra fields (spec_method, …), passed on in sampling_parameters, where the server
checks them again with the limits it knows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# Our options a request may add to an OpenAI body (sampling_parameters keys, params.py), with the
# JSON types they take; the server checks their values.
EXTRA_FIELDS: dict[str, tuple[type, ...]] = {
    "spec_method": (str,), "num_draft_tokens": (int,), "spec_threshold": (int, float),
    "draft_policy": (str,), "spec_fallback": (str,), "mtp_proposers": (list,), "mtp_tree_budget": (int,),
    "dflash_block_size": (int,), "top_k": (int,), "ignore_eos": (bool,), "stop_token_ids": (list,),
}
# OpenAI fields we do not implement: accepted only at the value that means "off".
UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "presence_penalty": 0, "frequency_penalty": 0, "logprobs": False, "top_logprobs": 0, "echo": False,
    "logit_bias": {}, "best_of": 1, "suffix": "", "tools": [], "tool_choice": "none",
    "response_format": {"type": "text"}, "parallel_tool_calls": False,
}
IGNORED = ("user", "metadata", "store", "service_tier")   # no effect on the output
MAX_STOP = 4   # OpenAI's limit on stop sequences
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default (the gRPC API's is greedy)


class OpenAIError(Exception):
    """An error in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class GenerateCall:
    """What one OpenAI request asks of the `llm` ensemble."""
    prompt: str | None                    # completions: the prompt; chat: None until rendered
    messages: list[dict] | None           # chat: the conversation, for the chat template
    sampling: dict[str, Any] = field(default_factory=dict)   # sampling_parameters (max_tokens maybe unset)
    stream: bool = False
    include_usage: bool = False


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise OpenAIError(f"{key} must be a number in [{lo:g}, {hi:g}], got {v!r}", key)
    return float(v)


def _max_tokens(body: dict) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):   # the newer name wins, as OpenAI's
        v = body.get(key)
        if v is not None:
            if not _is_int(v) or v < 1:
                raise OpenAIError(f"{key} must be a positive integer, got {v!r}", key)
            return v
    return None


def _stop(body: dict) -> list[str] | None:
    v = body.get("stop")
    if v is None:
        return None
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise OpenAIError(f"stop must be a non-empty string or a list of at most {MAX_STOP}, got {v!r}", "stop")
    return stops


def _check_known(body: dict, own: tuple[str, ...]) -> None:
    for key, value in body.items():
        if key in own or key in EXTRA_FIELDS or key in IGNORED or value is None:
            continue
        if key in UNSUPPORTED_DEFAULTS:
            if value != UNSUPPORTED_DEFAULTS[key]:
                raise OpenAIError(f"{key} is not supported by this server", key)
            continue
        raise OpenAIError(f"unknown field {key!r}", key)


def _sampling(body: dict) -> dict[str, Any]:
    if body.get("n") not in (None, 1):
        raise OpenAIError(f"n must be 1 (one choice per request), got {body['n']!r}", "n")
    sampling: dict[str, Any] = {}
    max_tokens = _max_tokens(body)
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    temperature = _number(body, "temperature", 0, 2)
    sampling["temperature"] = DEFAULT_TEMPERATURE if temperature is None else temperature
    top_p = _number(body, "top_p", 0, 1)
    if top_p is not None:
        sampling["top_p"] = top_p
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed) or seed < 0:
            raise OpenAIError(f"seed must be an integer >= 0, got {seed!r}", "seed")
        sampling["seed"] = seed
    stop = _stop(body)
    if stop:
        sampling["stop"] = stop
    for key, types in EXTRA_FIELDS.items():
        if body.get(key) is None:
            continue
        v = body[key]
        if isinstance(v, bool) and bool not in types or not isinstance(v, types):
            raise OpenAIError(f"{key} must be of type {' or '.join(t.__name__ for t in types)}, got {v!r}", key)
        sampling[key] = v
    return sampling


def _stream(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise OpenAIError(f"stream must be a boolean, got {stream!r}", "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise OpenAIError("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise OpenAIError(f"stream_options must be an object with a boolean include_usage, got {opts!r}",
                          "stream_options")
    return stream, opts.get("include_usage", False)


def _content(message: dict, i: int) -> str:
    """A message's text: a string, or a list of text parts (OpenAI's content parts)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise OpenAIError(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def parse_chat(body: Any) -> GenerateCall:
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty list", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise OpenAIError(f"messages[{i}] must be an object with a string role", f"messages[{i}]")
        turns.append({"role": m["role"], "content": _content(m, i)})
    _check_known(body, ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                        "seed", "stop", "n", "stream", "stream_options"))
    stream, usage = _stream(body)
    return GenerateCall(None, turns, _sampling(body), stream, usage)


def parse_completion(body: Any) -> GenerateCall:
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise OpenAIError("prompt must be one non-empty string (one prompt per request; no token ids)", "prompt")
    _check_known(body, ("model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
                        "stream_options"))
    stream, usage = _stream(body)
    return GenerateCall(prompt, None, _sampling(body), stream, usage)
