"""Parse a request's `sampling_parameters` JSON, `stream` and `exclude_input_in_output` flags.

`preprocess` parses (so a malformed request fails before it reaches the engine) and hands the
engine a normalised `RequestConfig` as JSON. Value ranges (max_tokens ≤ the model length, top_p
in (0, 1], …) are checked once, by `SamplingParams.validate` inside the engine, which knows the
limits. This module stays free of torch so `preprocess` starts fast.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from specserve.methods import registry

if TYPE_CHECKING:
    from specserve.serving.tiers import Tier

# The keys a client may send, with the JSON types each accepts. `spec_method` overrides the
# tier's speculation method ("none" = plain decoding); `num_draft_tokens` caps the tokens drafted
# per step and `spec_threshold` sets the calibration head's stop threshold (0 = fixed length).
_INT, _NUM, _BOOL = "an integer", "a number", "a boolean"
SAMPLING_KEYS: dict[str, str] = {
    "max_tokens": _INT,
    "temperature": _NUM,
    "top_p": _NUM,
    "top_k": _INT,
    "seed": _INT,
    "stop": "a string or a list of strings",
    "ignore_eos": _BOOL,
    "stop_token_ids": "a list of integers",
    "spec_method": "a string",
    "num_draft_tokens": _INT,
    "spec_threshold": _NUM,
    "draft_policy": "a string",
    "spec_fallback": "a string",
    **{key: registry.option(key)[1].kind for key in registry.option_keys()},
}
# The draft policy, not sampling. draft_policy: "adaptive" (the engine picks each step's draft
# length for the best expected goodput at the current load) or "fixed" (always the full length).
# spec_fallback: the method a dflash request runs instead of dflash: when the text-type gate routes
# it away (specserve/serving/text_gate.py) and while its repetition guard is on; before the tier's
# fallback, then the server's (ngram). Any served method but dflash.
SPEC_KEYS = ("spec_method", "num_draft_tokens", "spec_threshold", "draft_policy", "spec_fallback")
# Method options (GenerationRequest.options), checked for type here and for meaning by the
# method's proposer: mtp_proposers = the sub-proposers whose drafts `mtp` merges for this request
# (of those served), mtp_tree_budget = the merged tree's nodes at most (≤ the server's max_draft_len);
# dflash_block_size = dflash's block size B for the request (drafts ≤ B - 1 tokens per step).
# Each method declares its own (methods/registry.py OptionSpec).
OPTION_KEYS = registry.option_keys()


class BadRequest(ValueError):
    """The request is malformed; the message is for the client."""


@dataclass(frozen=True)
class RequestConfig:
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields the client set
    spec_method: str | None = None   # None → the tier's / engine's default method
    num_draft_tokens: int | None = None  # None → the server's max_draft_len
    spec_threshold: float | None = None  # None → the server's --spec-threshold
    draft_policy: str | None = None      # None → the server's --draft-policy
    spec_fallback: str | None = None     # the client's own; the effective one is fallback_method
    stream: bool = False             # stream one response per engine output, or one at the end
    include_prompt: bool = False     # text_output starts with the prompt text
    tier: str = "default"
    # The effective fallback: the request's spec_fallback, else its tier's fallback (tiers.py) unless
    # that is the request's own method; None → the server's (EngineConfig.guard_fallback,
    # text_gate.DEFAULT_FALLBACK: both ngram).
    fallback_method: str | None = None
    options: dict[str, Any] | None = None   # OPTION_KEYS the request (or its tier) set
    # The tier's scheduling priority (tiers.py; never a client's key): higher is admitted first
    # when the engine's slots are full (specserve/core/scheduling.py).
    priority: int = 0
    # The text-type gate's decision (text_gate.GateDecision.to_dict; never a client's key), shown
    # in spec_stats; None when the gate did not act on this request.
    text_gate: dict[str, Any] | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> "RequestConfig":
        return cls(**json.loads(raw))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _from_string(kind: str, value: Any) -> Any:
    """Numbers and booleans sent as strings ("64", "0.7", "true"), as Triton's vLLM backend
    accepts them and genai-perf sends them; anything that does not parse is left as it was."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        if kind == _INT:
            return int(text)
        if kind == _NUM:
            return float(text)
    except ValueError:
        return value
    if kind == _BOOL and text.lower() in ("true", "false"):
        return text.lower() == "true"
    return value


def _check_type(key: str, value: Any) -> Any:
    kind = SAMPLING_KEYS[key]
    if key == "seed" and value is None:
        return None
    value = _from_string(kind, value)
    if kind == _INT and _is_int(value):
        return value
    if kind == _NUM and (_is_int(value) or isinstance(value, float)):
        return float(value)
    if kind == _BOOL and isinstance(value, bool):
        return value
    if key == "stop":
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
    if key == "spec_fallback" and isinstance(value, str):
        guarded = registry.guarded()   # methods with a repetition guard: never a fallback
        if value in guarded:
            raise BadRequest(f"sampling_parameters.spec_fallback must name a method other than "
                             f"{' / '.join(guarded)}, got {json.dumps(value)}")
    if key in ("spec_method", "draft_policy", "spec_fallback") and isinstance(value, str):
        return value
    if kind == "a list of integers" and isinstance(value, list) and all(_is_int(t) for t in value):
        return value
    if kind == "a list of strings" and isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise BadRequest(f"sampling_parameters.{key} must be {kind}, got {json.dumps(value)}")


def parse_sampling_parameters(raw: str | bytes | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """JSON object text → (SamplingParams keyword arguments, the draft-policy keys that were set)."""
    if raw is None:
        return {}, {}
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest("sampling_parameters is not valid UTF-8") from None
    if not raw.strip():
        return {}, {}
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BadRequest(f"sampling_parameters is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"sampling_parameters must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(SAMPLING_KEYS))
    if unknown:
        raise BadRequest(f"unknown sampling_parameters key(s): {', '.join(unknown)}; "
                         f"allowed: {', '.join(SAMPLING_KEYS)}")
    checked = {k: _check_type(k, v) for k, v in obj.items()}
    spec = {k: checked.pop(k) for k in SPEC_KEYS if k in checked}
    options = {k: checked.pop(k) for k in OPTION_KEYS if k in checked}
    if options:
        spec["options"] = options
    return checked, spec


def make_request_config(sampling_parameters: str | bytes | None, stream: bool | None,
                        exclude_input_in_output: bool | None, tier: "Tier | str" = "default") -> RequestConfig:
    """Apply the vLLM backend's defaults: the prompt is included unless excluded, except when
    streaming, where responses carry only new text unless the client asks for the prompt.
    With a Tier, its settings fill what the request left unset (request > tier > server default;
    tiers.py) and its max_tokens limit is enforced."""
    sampling, spec = parse_sampling_parameters(sampling_parameters)
    own_fallback = spec.get("spec_fallback")   # the request's own beats its tier's
    stream = bool(stream)
    include = (not stream) if exclude_input_in_output is None else not exclude_input_in_output
    if isinstance(tier, str):
        return RequestConfig(sampling=sampling, stream=stream, include_prompt=include, tier=tier,
                             fallback_method=own_fallback, **spec)
    sampling, spec = apply_tier(tier, sampling, spec)
    # request > tier > server (None): the tier's fallback serves whichever method the request runs,
    # unless it is that method itself.
    method = spec.get("spec_method") or tier.method
    fallback = own_fallback or (tier.fallback if tier.fallback and tier.fallback != method else None)
    return RequestConfig(sampling=sampling, stream=stream, include_prompt=include, tier=tier.name,
                         priority=tier.priority, fallback_method=fallback, **spec)


# The server's default max_tokens (SamplingParams.max_tokens), which a tier's limit may lower.
DEFAULT_MAX_TOKENS = 16


def apply_tier(tier: "Tier", sampling: dict[str, Any], spec: dict[str, Any]) -> tuple[dict, dict]:
    """The request's own keys win; the tier fills the rest; what neither sets stays unset, for the
    engine's defaults. Returns new (sampling, spec) dicts."""
    sampling, spec = dict(sampling), dict(spec)
    tier_spec = {"spec_method": tier.method or None, "num_draft_tokens": tier.max_draft_len,
                 "spec_threshold": tier.spec_threshold, "draft_policy": tier.draft_policy}
    for key, value in tier_spec.items():
        if key not in spec and value is not None:
            spec[key] = value
    # The tier's method options (each option's tier setting), for requests that run the method
    # they belong to.
    options = dict(spec.get("options") or {})
    for key in OPTION_KEYS:
        method, option = registry.option(key)
        value = getattr(tier, option.tier_setting)
        if key not in options and value is not None and spec.get("spec_method") == method.name:
            options[key] = list(value) if isinstance(value, tuple) else value
    if options:
        spec["options"] = options
    if tier.max_tokens is not None:
        asked = sampling.get("max_tokens")
        if asked is None:
            sampling["max_tokens"] = min(DEFAULT_MAX_TOKENS, tier.max_tokens)
        elif asked > tier.max_tokens:
            raise BadRequest(f"sampling_parameters.max_tokens {asked} exceeds the limit {tier.max_tokens} "
                             f"of tier {tier.name!r}")
    return sampling, spec
