"""`ngram`: prompt lookup decoding, no model (proposer.py)."""

from __future__ import annotations

from specserve.methods.registry import BuildContext, MethodSpec, register


def build(ctx: BuildContext):
    from specserve.methods.ngram.proposer import NgramProposer
    return NgramProposer()


SPEC = register(MethodSpec("ngram", builder=build))
