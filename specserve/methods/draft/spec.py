"""`draft`: a separate small causal LM with its own KV cache, fused only as a method of its own
(inside remote mtp it runs as the Triton model draft_drafter). Refuses a draft model whose
tokenizer does not give the target's ids."""

from __future__ import annotations

from specserve.methods.registry import BuildContext, MethodSpec, register


def build(ctx: BuildContext):
    from specserve.methods.draft.drafter import load_draft_model
    from specserve.methods.draft.proposer import DraftModelProposer
    from specserve.model.tokenizer import load_tokenizer

    draft = load_draft_model(ctx.folder, ctx.model, load_tokenizer(ctx.checkpoint), dtype=ctx.drafter_dtype)
    return DraftModelProposer(draft, max_num_seqs=ctx.max_num_seqs, max_model_len=ctx.max_model_len,
                              max_draft_len=ctx.max_draft_len)


SPEC = register(MethodSpec("draft", drafts_with="own", builder=build))
