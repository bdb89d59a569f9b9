"""The text-type gate: a small classifier decides per request whether DFlash runs or the
request's fallback method does (DESIGN.md §3, DFlash).

DFlash drafts a whole block per step, which pays off where the continuation is predictable, as
in code and structured text (JSON, YAML, SQL …); on natural language a block is expected to be
accepted less far, so there a request may do better on its fallback method. Which text types
keep DFlash is configuration (server flag, tier); the default keeps it for `code` only. (Whether
it pays off is DFlash's to measure: this module only classifies and routes.)

    prompt ──features()──▶ [D] ──ONNX MLP──▶ p(text type) ──route()──▶ dflash | the fallback

Three pieces, each usable without Triton:
  * `features(text)`: hashed byte n-grams and byte-class ("shape") n-grams of the prompt's tail,
    pure numpy; THE one implementation, used by training (training/train_text_classifier.py) and
    serving (the `text_classifier` Triton model), so they cannot drift apart;
  * `TextClassifier`: the exported ONNX model (models/demo/text_classifier) under onnxruntime;
  * `TextGate.apply`: the preprocess rewrite. It acts only on requests whose effective method is
    the gated one; the classifier is called through a function that may fail (in Triton a BLS
    call to `text_classifier`, which an operator may unload): then the request keeps its method,
    the decision is `unavailable` (counted), and the change of state is logged once.

Fallback of a gated request (the contract with the DFlash proposer): the request's
`spec_fallback` → its tier's `fallback` → `DEFAULT_FALLBACK` (ngram); never the gated method.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

from specserve.methods import registry
from specserve.serving.params import BadRequest

if TYPE_CHECKING:
    from specserve.serving.params import RequestConfig
    from specserve.serving.tiers import Tier

log = logging.getLogger("specserve.serving.text_gate")

TEXT_TYPES = ("code", "prose")          # the classifier's labels, in output order
DEFAULT_DFLASH_TYPES = ("code",)         # text types that keep DFlash unless configured otherwise
DEFAULT_FALLBACK = "ngram"               # the server's fallback when neither request nor tier names one
# The method the gate acts on (its spec says text_gated).
GATED_METHOD = registry.gated_method()
CONFIG_FILE, MODEL_FILE = "config.json", "model.onnx"
# Decisions, as counted in specserve_text_gate_total{decision=…} and shown in spec_stats.
KEPT, ROUTED, UNAVAILABLE = "dflash", "fallback", "unavailable"
DECISIONS = (KEPT, ROUTED, UNAVAILABLE)


class GateError(ValueError):
    """A gate configuration or classifier folder that cannot be used; the message says why."""


# -- features ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FeatureParams:
    """Feature layout; stored in the classifier's config.json so serving computes what training did."""
    max_chars: int = 1024            # the prompt's last characters (the continuation follows them)
    raw_buckets: int = 2048          # hashed byte 1..3-grams
    raw_orders: tuple[int, ...] = (1, 2, 3)
    shape_buckets: int = 1024        # hashed byte-class 3..5-grams (indentation, "a(a, a):", …)
    shape_orders: tuple[int, ...] = (3, 4, 5)

    @property
    def dim(self) -> int:
        return self.raw_buckets + self.shape_buckets + 1   # + log length

    @classmethod
    def from_dict(cls, d: dict) -> "FeatureParams":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def _byte_classes() -> np.ndarray:
    """byte → class id: letters, digits, non-ASCII each one class; every other byte its own."""
    table = np.arange(256, dtype=np.int64)
    table[ord("a"):ord("z") + 1] = ord("a")
    table[ord("A"):ord("Z") + 1] = ord("A")
    table[ord("0"):ord("9") + 1] = ord("0")
    table[128:] = 128
    return table


_CLASSES = _byte_classes()
_PRIME = 1_000_003                 # n-gram hash: h = (h * P + byte + 1) mod 2**31, per order


def _hashed_counts(seq: np.ndarray, orders: tuple[int, ...], buckets: int) -> np.ndarray:
    """Counts of every n-gram of `seq` (n in orders), hashed into `buckets`."""
    counts = np.zeros(buckets, dtype=np.float32)
    for n in orders:
        if len(seq) < n:
            continue
        h = np.full(len(seq) - n + 1, n, dtype=np.int64)   # seeded by n: orders hash apart
        for i in range(n):
            h = (h * _PRIME + seq[i:len(seq) - n + 1 + i] + 1) % (1 << 31)
        counts += np.bincount(h % buckets, minlength=buckets).astype(np.float32)
    return counts


def features(text: str, params: FeatureParams = FeatureParams()) -> np.ndarray:
    """[D] float32: log1p counts of hashed byte n-grams and byte-class n-grams of the text's last
    `max_chars` characters, each block L2-normalised, and log(1 + bytes) / 10."""
    data = text[-params.max_chars:].encode("utf-8", "replace")
    seq = np.frombuffer(data, dtype=np.uint8).astype(np.int64)        # [L]
    blocks = []
    for s, orders, buckets in ((seq, params.raw_orders, params.raw_buckets),
                               (_CLASSES[seq], params.shape_orders, params.shape_buckets)):
        v = np.log1p(_hashed_counts(s, orders, buckets))
        norm = float(np.linalg.norm(v))
        blocks.append(v / norm if norm > 0 else v)
    blocks.append(np.array([np.log1p(len(data)) / 10.0], dtype=np.float32))
    return np.concatenate(blocks).astype(np.float32)


def featurize(texts: Iterable[str], params: FeatureParams = FeatureParams()) -> np.ndarray:
    """[B, D] float32."""
    rows = [features(t, params) for t in texts]
    return np.stack(rows) if rows else np.zeros((0, params.dim), np.float32)


# -- the classifier --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClassifierConfig:
    labels: tuple[str, ...] = TEXT_TYPES
    threshold: float = 0.5           # p(code) at or above → code
    features: FeatureParams = field(default_factory=FeatureParams)
    input_name: str = "features"     # ONNX: features [B, D] → probs [B, len(labels)]
    output_name: str = "probs"

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "specserve_text_classifier": 1}, indent=1)

    @classmethod
    def load(cls, folder: str | Path) -> "ClassifierConfig":
        path = Path(folder) / CONFIG_FILE
        if not path.is_file():
            raise GateError(f"{folder} is not a text classifier folder: {CONFIG_FILE} is missing")
        d = json.loads(path.read_text())
        if d.get("specserve_text_classifier") != 1:
            raise GateError(f"{path} is not a specserve text classifier config")
        cfg = cls(tuple(d["labels"]), float(d["threshold"]), FeatureParams.from_dict(d["features"]),
                  d["input_name"], d["output_name"])
        if cfg.labels != TEXT_TYPES:
            raise GateError(f"{path}: labels must be {list(TEXT_TYPES)}, got {list(cfg.labels)}")
        return cfg


@dataclass(frozen=True)
class Classification:
    text_type: str     # one of TEXT_TYPES
    prob: float        # the classifier's probability of that type


def decide(p_code: float, threshold: float) -> Classification:
    return Classification("code", p_code) if p_code >= threshold else Classification("prose", 1.0 - p_code)


class TextClassifier:
    """The exported classifier under onnxruntime (one intra-op thread: a request is one row)."""

    def __init__(self, folder: str | Path):
        import onnxruntime as ort

        self.cfg = ClassifierConfig.load(folder)
        model = Path(folder) / MODEL_FILE
        if not model.is_file():
            raise GateError(f"{folder}: {MODEL_FILE} is missing")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])

    def p_code(self, texts: list[str]) -> np.ndarray:
        """[B] probability of `code` per text."""
        x = featurize(texts, self.cfg.features)                          # [B, D]
        probs = self.session.run([self.cfg.output_name], {self.cfg.input_name: x})[0]  # [B, 2]
        return probs[:, self.cfg.labels.index("code")]

    def classify(self, text: str) -> Classification:
        return decide(float(self.p_code([text])[0]), self.cfg.threshold)


# -- configuration and routing ---------------------------------------------------------------------
def check_text_types(types: Iterable[str], where: str) -> tuple[str, ...]:
    """A list of text types that keep DFlash (may be empty: DFlash for nothing)."""
    if not isinstance(types, (list, tuple)) or not all(isinstance(t, str) for t in types):
        raise GateError(f"{where} must be a list of text types ({', '.join(TEXT_TYPES)}), "
                        f"got {json.dumps(types, default=str)}")
    types = tuple(types)
    bad = [t for t in types if t not in TEXT_TYPES]
    if bad or len(set(types)) != len(types):
        raise GateError(f"{where} must list distinct text types from {', '.join(TEXT_TYPES)}, "
                        f"got {json.dumps(list(types))}")
    return types


def parse_text_types(text: str, where: str = "--dflash-text-types") -> tuple[str, ...]:
    """The flag's comma list ("code", "code,prose", "" for none)."""
    return check_text_types([t.strip() for t in text.split(",") if t.strip()], where)


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


class ClassifierUnavailable(RuntimeError):
    """The classifier could not answer (unloaded, restarting, failed); the request keeps its method."""


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
