"""`mtp`: several drafters draft at once and the arbiter merges their drafts into one tree.
Remote (the mtp_proposal ensemble: every member a Triton model, in parallel; needs a served EAGLE
drafter for the ensemble's EAGLE models) or fused (the members one after another in the engine).
Its own drafter folder (`--drafter mtp=DIR`, optional) holds the MTP heads."""

from __future__ import annotations

from specserve.methods.mtp.options import MEMBERS, PROPOSERS, TREE_BUDGET
from specserve.methods.registry import BuildContext, MethodCapabilities, MethodSpec, register, served_members


def _heads(ctx: BuildContext):
    try:
        from specserve.methods.mtp.heads import load_mtp_heads
        from specserve.methods.mtp.heads_proposer import MTPHeadsProposer
    except ImportError as e:
        raise ValueError(f"--drafter mtp={ctx.folder}: the MTP heads proposer is not available ({e})") from None
    heads = load_mtp_heads(ctx.folder, ctx.model, dtype=ctx.drafter_dtype)
    return MTPHeadsProposer(heads, max_draft_len=ctx.max_draft_len)


def build(ctx: BuildContext):
    """Over every served member, sharing the served methods' proposers (fused), or the remote
    proposer calling mtp_proposal (its members: the same served set)."""
    if ctx.placement == "remote":
        from specserve.methods.mtp.remote import remote_mtp

        if ctx.remote is None:
            raise ValueError("mtp's remote placement calls the mtp_proposal ensemble by BLS: build the engine "
                             "inside target_verifier (or pass its RemoteCalls)")
        return remote_mtp(ctx.remote, served_members(ctx.drafters), max_draft_len=ctx.max_draft_len,
                          threshold=ctx.spec_threshold, timeout_s=ctx.remote_timeout_s)
    from specserve.methods.mtp.proposer import MultiDraftProposer

    # Members that read target layers (an EAGLE-3 drafter) get them: MultiDraftProposer names the
    # union of their feature_layers and hands each member its own.
    subs = [ctx.built[m.name] for m in SPEC.members if m.drafter != SPEC.name and m.name in ctx.built]
    if ctx.folder:
        subs.append(_heads(ctx))
    return MultiDraftProposer(subs, max_draft_len=ctx.max_draft_len, vocab_size=ctx.model.cfg.vocab_size)


SPEC = register(MethodSpec(
    "mtp", drafts_with="composite",
    members=MEMBERS,
    placements=("fused", "remote"), remote_needs=("eagle",),
    options=(TREE_BUDGET, PROPOSERS), triton_models=("mtp_proposal", "mtp_arbiter"),
    capabilities=MethodCapabilities(needs_features=True), builder=build))
