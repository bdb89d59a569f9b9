"""The checkpoint's chat template, rendered by transformers (never re-implemented here)."""

from __future__ import annotations

from pathlib import Path

from specserve.openai.protocol import OpenAIError


class ChatTemplate:
    def __init__(self, checkpoint: str | Path):
        import transformers

        # tokenizer_config.json (or chat_template.jinja) carries the template; tokenizer.json the vocabulary.
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))

    @property
    def available(self) -> bool:
        return bool(self.tokenizer.chat_template)

    def render(self, messages: list[dict]) -> str:
        """The prompt text for `messages`, ending with the assistant turn's opening."""
        from jinja2 import TemplateError

        if not self.available:
            raise OpenAIError("the served checkpoint has no chat template; use /v1/completions", "messages")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError as e:  # the template's own raise_exception (roles out of order, …)
            raise OpenAIError(f"the chat template refused these messages: {e}", "messages") from None

    def count_tokens(self, text: str) -> int:
        """Prompt tokens as preprocess counts them (the rendered template writes its special tokens)."""
        return len(self.tokenizer(text).input_ids)
