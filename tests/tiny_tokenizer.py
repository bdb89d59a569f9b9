"""The tiny byte-level BPE tokenizer for tests; it lives in specserve.tiny (the demo uses it too)."""

from specserve.tiny import CORPUS, SPECIAL, train_tiny_tokenizer  # noqa: F401
