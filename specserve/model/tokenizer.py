"""Load a checkpoint's tokenizer.json with `tokenizers` (no torch, no transformers: fast to import
in the preprocess / postprocess processes)."""

from __future__ import annotations

from pathlib import Path


class TokenizerError(ValueError):
    """The checkpoint has no usable tokenizer.json."""


def load_tokenizer(checkpoint: str | Path):
    from tokenizers import Tokenizer

    path = Path(checkpoint) / "tokenizer.json"
    if not path.exists():
        raise TokenizerError(f"{checkpoint} has no tokenizer.json (specserve needs the fast tokenizer file)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise TokenizerError(f"cannot read {path}: {e}") from None


def make_decode(tokenizer):
    """The decode every part of specserve uses: special tokens (BOS, EOS) carry no text."""
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)
