"""Drafter memory per sequence, computed from the drafter's own state shapes.

Neither the engine nor the Proposer protocol reports how much state a proposer keeps per sequence,
so this builds each served drafter's per-sequence state the way its proposer does and counts the
bytes of its tensors (one sequence, sized for the deployment's max_model_len):

    none, ngram   nothing (ngram looks up the sequence's own tokens, which the engine keeps anyway)
    eagle         one slot of the drafter's KV cache: drafter.new_cache(1, max_model_len + max_draft_len + 1)
    draft         one slot of the draft model's KV cache, sized the same way
    dspark        eagle's slot plus its committed-pair buffers: features [max_draft_len + 1, D]
                  in the drafter's dtype and next tokens [max_draft_len + 1] int64
    dflash        the bounded memory's budget at max_model_len tokens (dflash/memory.py budget_bytes)
    mtp           the sum of its served members' (the MTP heads keep one feature vector [D])

The bytes exclude the drafter's weights (shared by all sequences).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class DraftMemory:
    bytes_per_sequence: int
    how: str

    def to_dict(self) -> dict:
        return asdict(self)


def _cache_bytes(cache) -> int:
    return cache.k.numel() * cache.k.element_size() + cache.v.numel() * cache.v.element_size()


def draft_memory(method: str, drafters: dict[str, Path], target, *, max_model_len: int, max_draft_len: int,
                 target_tokenizer=None) -> DraftMemory:
    """`method`'s drafter state for one sequence; drafters: the served METHOD → folder."""
    import torch

    from specserve.methods import registry

    spec = registry.get(method)
    slot_len = max_model_len + max_draft_len + 1
    if spec.drafts_with == "nothing":
        return DraftMemory(0, "no drafter state")
    if method == "eagle":
        from specserve.methods.eagle.drafter import load_eagle

        return DraftMemory(_cache_bytes(load_eagle(drafters["eagle"], target).new_cache(1, slot_len)),
                           f"EAGLE drafter KV cache, one slot of {slot_len} positions")
    if method == "draft":
        from specserve.methods.draft.drafter import load_draft_model
        from specserve.model.tokenizer import load_tokenizer

        tok = target_tokenizer or load_tokenizer(Path(drafters["draft"]))
        draft = load_draft_model(drafters["draft"], target, tok)
        return DraftMemory(_cache_bytes(draft.new_cache(1, slot_len)), f"draft model KV cache, one slot of {slot_len} positions")
    if method == "dflash":
        from specserve.methods.dflash.drafter import load_dflash
        from specserve.methods.dflash.memory import budget_bytes

        c = load_dflash(drafters["dflash"], target).cfg
        return DraftMemory(budget_bytes(max_model_len, c.window, c.pool_slots, c.pool_rank, c.hidden_size),
                           f"bounded memory at {max_model_len} tokens (W={c.window}, r={c.pool_slots}, ρ={c.pool_rank})")
    if spec.drafts_with == "other":   # dspark: eagle's slot and its committed-pair buffers
        from specserve.methods.eagle.drafter import load_eagle

        drafter = load_eagle(drafters[spec.drafter_of], target)
        W, D = max_draft_len + 1, drafter.cfg.hidden_size
        size = torch.tensor([], dtype=next(drafter.parameters()).dtype).element_size()
        return DraftMemory(_cache_bytes(drafter.new_cache(1, slot_len)) + W * D * size + W * 8,
                           f"{spec.drafter_of}'s KV cache slot + [{W}, {D}] features + [{W}] tokens")
    if spec.drafts_with == "composite":
        parts, total = [], 0
        for member in spec.members:
            if member.drafter is None:
                parts.append(f"{member.name} 0")
            elif member.drafter in drafters and member.drafter == method:   # the MTP heads
                from specserve.methods.mtp.heads import load_mtp_heads

                heads = load_mtp_heads(drafters[method], target)
                n = heads.cfg.hidden_size * heads.lm_head_weight.element_size()
                total += n
                parts.append(f"{member.name} {n} (one feature vector)")
            elif member.drafter in drafters:
                n = draft_memory(member.drafter, drafters, target, max_model_len=max_model_len,
                                 max_draft_len=max_draft_len, target_tokenizer=target_tokenizer).bytes_per_sequence
                total += n
                parts.append(f"{member.name} {n}")
        return DraftMemory(total, "sum of served members: " + ", ".join(parts))
    raise ValueError(f"no draft-memory rule for method {method!r}")
