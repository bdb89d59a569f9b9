"""`dspark`: the served EAGLE drafter, fused, run as one static step per (batch bucket, K),
whichever placement EAGLE itself uses."""

from __future__ import annotations

from specserve.methods.registry import BuildContext, MethodCapabilities, MethodSpec, register


def build(ctx: BuildContext):
    from specserve.methods.dspark.proposer import DSParkProposer
    from specserve.methods.eagle.drafter import load_eagle
    from specserve.methods.eagle.proposer import EagleProposer

    # Share the fused EAGLE proposer's drafter weights when there is one.
    eagle = ctx.built.get("eagle")
    drafter = eagle.drafter if isinstance(eagle, EagleProposer) else load_eagle(
        dict(ctx.drafters)["eagle"], ctx.model, dtype=ctx.drafter_dtype)
    return DSParkProposer(drafter, ctx.model, max_num_seqs=ctx.max_num_seqs, max_model_len=ctx.max_model_len,
                          max_draft_len=ctx.max_draft_len, threshold=ctx.spec_threshold)


SPEC = register(MethodSpec("dspark", drafts_with="other", drafter_of="eagle", step="static",
                           capabilities=MethodCapabilities(needs_features=True), builder=build))
