"""`eagle`: one decoder layer drafting at the feature level, cut by its calibration head. Fused
(the drafter in the engine process) or remote (the exported drafter in the `eagle_proposal`
ensemble, called once per step by BLS, hot-loadable)."""

from __future__ import annotations

from specserve.methods.registry import BuildContext, MethodCapabilities, MethodSpec, register


def build(ctx: BuildContext):
    if ctx.placement == "remote":
        from specserve.methods.remote import RemoteProposer

        if ctx.remote is None:
            raise ValueError("eagle's remote placement calls the eagle_proposal models by BLS: build the "
                             "engine inside target_verifier (or pass its RemoteCalls)")
        return RemoteProposer("eagle", ctx.remote.eagle_proposal, max_draft_len=ctx.max_draft_len,
                              threshold=ctx.spec_threshold, release=ctx.remote.eagle_release,
                              timeout_s=ctx.remote_timeout_s)
    from specserve.methods.eagle.drafter import load_eagle
    from specserve.methods.eagle.proposer import EagleProposer

    drafter = load_eagle(ctx.folder, ctx.model, dtype=ctx.drafter_dtype)
    return EagleProposer(drafter, ctx.model, max_num_seqs=ctx.max_num_seqs, max_model_len=ctx.max_model_len,
                         max_draft_len=ctx.max_draft_len, threshold=ctx.spec_threshold, name="eagle")


SPEC = register(MethodSpec(
    "eagle", drafts_with="own", placements=("fused", "remote"),
    triton_models=("eagle_proposal", "eagle_backbone", "calibration_head"), folder_kinds=("eagle", "eagle3"),
    capabilities=MethodCapabilities(needs_features=True), builder=build))
