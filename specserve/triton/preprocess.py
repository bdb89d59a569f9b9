"""preprocess: text → token ids, and the request's flags and sampling parameters → RequestConfig."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specserve.triton.params import BadRequest, RequestConfig, make_request_config


@dataclass(frozen=True)
class Prepared:
    input_ids: list[int]
    config: RequestConfig


class Preprocessor:
    def __init__(self, checkpoint: str | Path, tier: str = "default"):
        from specserve.triton.tokenizer import load_tokenizer
        self.tokenizer = load_tokenizer(checkpoint)
        self.tier = tier

    def __call__(self, text: str | bytes | None, stream: bool | None, sampling_parameters: str | bytes | None,
                 exclude_input_in_output: bool | None) -> Prepared:
        if text is None:
            raise BadRequest("missing required input 'text_input'")
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadRequest(f"text_input is not valid UTF-8: {e.reason} at byte {e.start}") from None
        if not text:
            raise BadRequest("text_input is empty")
        config = make_request_config(sampling_parameters, stream, exclude_input_in_output, self.tier)
        # add_special_tokens: the checkpoint's post-processor adds BOS where the model expects
        # it, as transformers' tokenizer(text) does.
        ids = self.tokenizer.encode(text, add_special_tokens=True).ids
        return Prepared(ids, config)
