"""Incremental detokenization that is stateless per response.

In the ensemble every streamed response of `target_verifier` reaches `postprocess` on its own, so
postprocess cannot remember what it emitted before. Instead each response carries a *window*:
the last few token ids that were already sent, followed by the new ones, and `read_offset`, the
index in the window where the new ones start. Postprocess emits

    stable(decode(window)) minus stable(decode(window[:read_offset]))

where `stable(text)` drops the trailing U+FFFD characters that may still turn into a real
character when more bytes arrive (an unfinished UTF-8 character decodes as U+FFFD). The final
response is not held back: it emits `decode(window)` minus what was sent, so the concatenated
pieces equal the full decode exactly.

Why a window of a few preceding tokens works: a token's text can depend on its left neighbours
(a byte-level token may finish a character begun by the previous one; sentencepiece decoders
strip the leading space of the *first* token decoded). Decoding both the old and the new text
from the same window start makes those effects cancel in the difference, as long as the window
reaches back past any character still being assembled; CONTEXT_TOKENS is ample for that (a UTF-8
character has at most 4 bytes, and every token carries at least one).

Worked example (byte-level BPE, "中" = E4 B8 AD split as [E4 B8] [AD]):
    response 1: window [.. "a", E4B8], read_offset→E4B8: decode = "a\ufffd" → stable "a";
                old text "a" → emits "" (the half character is held back)
    response 2: window [.., "a", E4B8, AD], read_offset→AD: decode "a中", old stable "a" → "中"
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

REPLACEMENT = "\ufffd"
# An unfinished character shows as one U+FFFD (byte-level decoders: one per maximal invalid
# sequence) or up to 3 (byte-fallback decoders: one per byte of a 4-byte character missing its
# last byte). Holding back more could never make a character whole.
MAX_HELD_BACK = 3
CONTEXT_TOKENS = 8


class DetokenizeError(ValueError):
    """The tokenizer's decode is not prefix-stable on this window; streaming text would be wrong."""


@dataclass(frozen=True)
class TokenWindow:
    token_ids: list[int]
    read_offset: int    # token_ids[:read_offset] were sent before; the rest are new
    flush: bool         # final response: emit everything, hold nothing back


@dataclass
class ResponseMeta:
    """The per-response fields that postprocess passes through to the ensemble outputs, and the
    engine request id it needs to cancel the request when the client has gone."""
    request_id: str
    num_input_tokens: int
    num_output_tokens: int             # output tokens of this response (schema.NUM_OUTPUT_TOKENS)
    finish_reason: str = ""            # "" until the final response
    spec_stats: dict = field(default_factory=dict)
    # Why the engine ended the request early; postprocess answers the client with this error.
    error: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> "ResponseMeta":
        return cls(**json.loads(raw))


def make_window(tokens: Sequence[int], num_sent: int, flush: bool) -> TokenWindow:
    """The window for a response that sends tokens[num_sent:] after tokens[:num_sent] were sent."""
    start = max(0, num_sent - CONTEXT_TOKENS)
    return TokenWindow(list(tokens[start:]), num_sent - start, flush)


def stable(text: str) -> str:
    """`text` without the trailing U+FFFDs that may still become part of a character."""
    n = 0
    while n < MAX_HELD_BACK and n < len(text) and text[-1 - n] == REPLACEMENT:
        n += 1
    return text[:len(text) - n]


def text_delta(decode: Callable[[list[int]], str], window: TokenWindow) -> str:
    """The text this response adds to what the previous responses of its request emitted."""
    new = decode(window.token_ids)
    if not window.flush:
        new = stable(new)
    old = stable(decode(window.token_ids[:window.read_offset])) if window.read_offset else ""
    if not new.startswith(old):
        raise DetokenizeError(f"decoding is not prefix-stable: {old!r} is not a prefix of {new!r}")
    return new[len(old):]
