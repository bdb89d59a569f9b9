"""The text-type gate: a small classifier decides per request whether DFlash runs or the
request's fallback method does (docs/design.md, 'The methods': DFlash).

DFlash drafts a whole block per step, which pays off where the continuation is predictable, as
in code and structured text (JSON, YAML, SQL …); on natural language a block is expected to be
accepted less far, so there a request may do better on its fallback method. Which text types
keep DFlash is configuration (server flag, tier); the default keeps it for `code` only. (Whether
it pays off is DFlash's to measure: this module only classifies and routes.)

    prompt ──features()──▶ [D] ──ONNX MLP──▶ p(text type) ──route()──▶ dflash | the fallback

The classifier (features, the ONNX model, the configured text types) is text_classifier.py.
`TextGate.apply` is the preprocess rewrite. It acts only on requests whose effective method is
the gated one; the classifier is called through a function that may fail (in Triton a BLS call
to `text_classifier`, which an operator may unload): then the request keeps its method, the
decision is `unavailable` (counted), and the change of state is logged once.

Fallback of a gated request (the contract with the DFlash proposer): the request's
`spec_fallback` → its tier's `fallback` → `DEFAULT_FALLBACK` (ngram); never the gated method.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from specserve.methods import registry
from specserve.serving.params import BadRequest
from specserve.serving.text_classifier import (DEFAULT_DFLASH_TYPES, Classification, ClassifierUnavailable,
                                               check_text_types)

if TYPE_CHECKING:
    from specserve.serving.params import RequestConfig
    from specserve.serving.tiers import Tier

log = logging.getLogger("specserve.serving.text_gate")

DEFAULT_FALLBACK = "ngram"               # the server's fallback when neither request nor tier names one
# The method the gate acts on (its spec says text_gated).
GATED_METHOD = registry.gated_method()
# Decisions, as counted in specserve_text_gate_total{decision=…} and shown in spec_stats.
KEPT, ROUTED, UNAVAILABLE = "dflash", "fallback", "unavailable"


def resolve_fallback(spec_fallback: str | None, tier: "Tier | str | None") -> str:
    """The method a gated request runs when its text type does not keep DFlash: the request's
    `spec_fallback`, else its tier's fallback, else DEFAULT_FALLBACK; never the gated method."""
    if spec_fallback is not None:
        if spec_fallback == GATED_METHOD:
            raise BadRequest(f"sampling_parameters.spec_fallback must name a method other than {GATED_METHOD}, "
                             f"got {spec_fallback!r}")
        return spec_fallback
    tier_fallback = getattr(tier, "fallback", None)
    if tier_fallback and tier_fallback != GATED_METHOD:
        return tier_fallback
    return DEFAULT_FALLBACK


@dataclass(frozen=True)
class GateDecision:
    decision: str               # KEPT | ROUTED | UNAVAILABLE
    method: str                 # the method the request runs
    text_type: str | None       # None when the classifier was unavailable
    prob: float | None
    dflash_text_types: tuple[str, ...]
    error: str | None = None    # why the classifier was unavailable

    def to_dict(self) -> dict:
        d = {"decision": self.decision, "method": self.method, "text_type": self.text_type,
             "prob": None if self.prob is None else round(self.prob, 4),
             "dflash_text_types": list(self.dflash_text_types)}
        if self.error is not None:
            d["error"] = self.error
        return d


def route(found: Classification, dflash_types: tuple[str, ...], fallback: str) -> GateDecision:
    if found.text_type in dflash_types:
        return GateDecision(KEPT, GATED_METHOD, found.text_type, found.prob, dflash_types)
    return GateDecision(ROUTED, fallback, found.text_type, found.prob, dflash_types)


class TextGate:
    """The preprocess rewrite. `classify` raises ClassifierUnavailable when it cannot answer;
    `count(decision, tier)` is called once per gated request (the metric)."""

    def __init__(self, classify: Callable[[str], Classification], dflash_types: tuple[str, ...] = DEFAULT_DFLASH_TYPES,
                 *, default_method: str = "none", count: Callable[[str, str], None] | None = None):
        self.classify = classify
        self.dflash_types = check_text_types(dflash_types, "dflash text types")
        self.default_method = default_method
        self.count = count
        self._unavailable: str | None = None   # the last failure, while the classifier is failing

    def types_for(self, tier: "Tier | str | None") -> tuple[str, ...]:
        own = getattr(tier, "dflash_text_types", None)
        return self.dflash_types if own is None else tuple(own)

    def apply(self, text: str, config: "RequestConfig", tier: "Tier | str | None" = None) -> "RequestConfig":
        """`config` unchanged unless its effective method is the gated one; then the same config
        with the routed method, and the decision in `text_gate` (shown in spec_stats)."""
        if (config.spec_method or self.default_method) != GATED_METHOD:
            return config
        types = self.types_for(tier)
        # The same fallback the engine's repetition guard uses (params.make_request_config).
        fallback = resolve_fallback(config.fallback_method, None)
        try:
            found = self.classify(text)
        except ClassifierUnavailable as e:
            if self._unavailable is None:
                log.warning("text_classifier is unavailable (%s): %s requests keep %s, counted as "
                            "decision=%s, until it answers again", e, GATED_METHOD, GATED_METHOD, UNAVAILABLE)
            self._unavailable = str(e)
            decision = GateDecision(UNAVAILABLE, GATED_METHOD, None, None, types, error=str(e))
        else:
            if self._unavailable is not None:
                log.warning("text_classifier answers again; the text-type gate routes %s requests", GATED_METHOD)
                self._unavailable = None
            decision = route(found, types, fallback)
        if self.count is not None:
            self.count(decision.decision, config.tier)
        if decision.decision == ROUTED:
            # The fallback now is the request's method; the tier's fallback (for an unavailable
            # DFlash proposer) no longer applies to it.
            # Its options were dflash's (the engine checked they belong to the request's method).
            config = replace(config, spec_method=decision.method, fallback_method=None, options=None)
        return replace(config, text_gate=decision.to_dict())
