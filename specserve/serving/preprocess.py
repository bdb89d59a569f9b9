"""preprocess: text → token ids, and the request's flags and sampling parameters → RequestConfig,
signed for target_verifier (auth.py). With a text-type gate (text_gate.py), a request whose
effective method is dflash runs it or its fallback by its prompt's text type."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specserve.serving.auth import sign
from specserve.serving.params import BadRequest, RequestConfig, make_request_config
from specserve.serving.tiers import Tier

if TYPE_CHECKING:
    from specserve.serving.text_gate import TextGate

# A normalizer (NFKC, say) may map several bytes of text to fewer; this bounds that contraction.
NORMALIZER_SLACK = 4


@dataclass(frozen=True)
class Prepared:
    input_ids: list[int]
    config: RequestConfig
    config_json: str
    signature: str


def max_prompt_bytes(tokenizer, max_model_len: int) -> int:
    """The most UTF-8 bytes a prompt that fits `max_model_len` tokens can have, so a larger one is
    refused before tokenizing it (tokenizing megabytes takes seconds of the shared CPU).

    Each token covers at most as many bytes of text as its vocabulary string has (byte-level BPE
    writes each byte as one character; sentencepiece's '▁' stands for one space; byte-fallback
    tokens '<0xE4>' for one byte), so the bound never refuses a prompt that fits."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    longest = max(len(tok.encode("utf-8")) for tok in vocab)
    slack = NORMALIZER_SLACK if tokenizer.normalizer is not None else 1
    return max_model_len * longest * slack


def check_return_flags(flags: dict[str, bool | None]) -> None:
    """Refuse the additional outputs we cannot give (log-probabilities) rather than ignore them."""
    from specserve.serving.schema import UNSUPPORTED_RETURN_FLAGS

    asked = [spec.name for spec in UNSUPPORTED_RETURN_FLAGS if flags.get(spec.name)]
    if asked:
        raise BadRequest(f"{', '.join(asked)}: specserve does not compute log-probabilities")


class Preprocessor:
    def __init__(self, checkpoint: str | Path, tier: "Tier | str" = "default", *, max_model_len: int | None = None,
                 internal_key: str = "", gate: "TextGate | None" = None):
        """`tier`: a Tier (preprocess_<tier>, whose settings fill what a request leaves unset and
        whose priority the request carries; tiers.py) or just a tier name (server defaults).
        `gate`: the text-type gate, or None when no classifier is served."""
        from specserve.model.tokenizer import load_tokenizer
        self.tokenizer = load_tokenizer(checkpoint)
        self.tier = tier
        self.max_model_len = max_model_len
        self.max_bytes = None if max_model_len is None else max_prompt_bytes(self.tokenizer, max_model_len)
        self.key = internal_key
        self.gate = gate

    def __call__(self, text: str | bytes | None, stream: bool | None, sampling_parameters: str | bytes | None,
                 exclude_input_in_output: bool | None, return_flags: dict[str, bool | None] | None = None) -> Prepared:
        """`return_flags`: the vLLM backend's return_* inputs the request set (schema.RETURN_FLAGS)."""
        if text is None:
            raise BadRequest("missing required input 'text_input'")
        check_return_flags(return_flags or {})
        size = len(text) if isinstance(text, bytes) else len(text.encode("utf-8", "surrogatepass"))
        if self.max_bytes is not None and size > self.max_bytes:
            raise BadRequest(f"text_input is {size} bytes, more than any prompt that fits the model length "
                             f"{self.max_model_len} can have ({self.max_bytes} bytes); refused before tokenizing")
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadRequest(f"text_input is not valid UTF-8: {e.reason} at byte {e.start}") from None
        if not text:
            raise BadRequest("text_input is empty")
        config = make_request_config(sampling_parameters, stream, exclude_input_in_output, self.tier)
        if self.gate is not None:
            config = self.gate.apply(text, config, self.tier)
        # add_special_tokens: the checkpoint's post-processor adds BOS where the model expects
        # it, as transformers' tokenizer(text) does.
        ids = self.tokenizer.encode(text, add_special_tokens=True).ids
        config_json = config.to_json()
        return Prepared(ids, config, config_json, sign(self.key, ids, config_json))
