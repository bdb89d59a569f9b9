"""Build the engine a deployment serves: model, tokenizer and the method → proposer wiring.

The one place that says which speculation methods exist; new proposers (EAGLE, MTP, DFlash,
DSPark) are added to PROPOSERS. Shared by the target_verifier model, the CLI and benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from specserve.triton.tokenizer import load_tokenizer, make_decode

if TYPE_CHECKING:
    from specserve.proposers.base import Proposer


def _ngram() -> "Proposer":
    from specserve.proposers.ngram import NgramProposer
    return NgramProposer()


# "none" (plain decoding) is built into the engine.
PROPOSERS: dict[str, Callable[[], "Proposer"]] = {
    "ngram": _ngram,
}


@dataclass(frozen=True)
class EngineSettings:
    checkpoint: Path
    max_num_seqs: int = 16
    max_model_len: int | None = None     # None → min(the model's max_position_embeddings, 2048)
    max_draft_len: int = 8
    default_method: str = "none"


def default_max_model_len(checkpoint: str | Path) -> int:
    from specserve.model import load_config
    return min(load_config(checkpoint).max_position_embeddings, 2048)


def build_engine(settings: EngineSettings):
    """→ (Engine, tokenizers.Tokenizer). Raises CheckpointError for an unusable checkpoint."""
    from specserve.engine import Engine, EngineConfig
    from specserve.model import load_model

    tokenizer = load_tokenizer(settings.checkpoint)
    model = load_model(settings.checkpoint)
    max_len = settings.max_model_len or default_max_model_len(settings.checkpoint)
    config = EngineConfig(max_num_seqs=settings.max_num_seqs, max_model_len=max_len,
                          max_draft_len=settings.max_draft_len, default_method=settings.default_method)
    proposers = {name: make() for name, make in PROPOSERS.items()}
    engine = Engine(model, config, proposers, detokenize=make_decode(tokenizer))
    return engine, tokenizer
