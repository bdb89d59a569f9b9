"""`dflash`: a block drafter over compact target features, fused only (its per-sequence memory
lives beside the engine's features); repetition-guarded, and gated per request by the text type."""

from __future__ import annotations

from specserve.methods.dflash.options import BLOCK_SIZE
from specserve.methods.registry import BuildContext, MethodCapabilities, MethodSpec, register


def build(ctx: BuildContext):
    from specserve.methods.dflash.drafter import load_dflash
    from specserve.methods.dflash.proposer import DFlashProposer

    drafter = load_dflash(ctx.folder, ctx.model, dtype=ctx.drafter_dtype, block_size=ctx.block_size)
    return DFlashProposer(drafter, ctx.model, max_num_seqs=ctx.max_num_seqs, name="dflash",
                          threshold=ctx.spec_threshold)


SPEC = register(MethodSpec(
    "dflash", drafts_with="own", options=(BLOCK_SIZE,), tier_settings=("dflash_text_types",),
    capabilities=MethodCapabilities(needs_features=True, feature_layers=True, repetition_guarded=True,
                                    text_gated=True),
    builder=build))
