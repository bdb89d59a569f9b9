"""`none`: plain decoding, the baseline and every method's last fallback (core/plain.py). The
engine builds its proposer itself, so every engine serves it."""

from specserve.methods.registry import MethodSpec, register

SPEC = register(MethodSpec("none"))
