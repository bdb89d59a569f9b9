"""The text classifier behind the text-type gate (text_gate.py): features, the ONNX model, and
the text types a configuration may name.

  * `features(text)`: hashed byte n-grams and byte-class ("shape") n-grams of the prompt's tail,
    pure numpy; THE one implementation, used by training (training/train_text_classifier.py) and
    serving (the `text_classifier` Triton model), so they cannot drift apart;
  * `TextClassifier`: the exported ONNX model (models/demo/text_classifier) under onnxruntime;
  * `check_text_types` / `parse_text_types`: the text types that keep DFlash, as configured (server
    flag, tier).

Nothing here knows about methods or requests, so tiers and the Triton adapters can use it
without the gate.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

TEXT_TYPES = ("code", "prose")          # the classifier's labels, in output order
DEFAULT_DFLASH_TYPES = ("code",)         # text types that keep DFlash unless configured otherwise
CONFIG_FILE, MODEL_FILE = "config.json", "model.onnx"


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


class ClassifierUnavailable(RuntimeError):
    """The classifier could not answer (unloaded, restarting, failed); the request keeps its method."""


# -- configuration ----------------------------------------------------------------------------------
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
