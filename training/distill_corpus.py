"""Training sequences from a self-distillation run (training/distill_data.py) for the drafter trainers.

A sequence is one finished item: its rendered prompt ids followed by the target's own response
ids, with the index where the response starts (drafters draft in responses at serving time, so a
trainer may weight or restrict its loss there). Read from whole shards only, so a run still in
progress gives the items finished so far (the plan is shuffled: any prefix is a mixed sample).

Nothing held out reaches a trainer: every item's messages go through the held-out guard again
here (training/heldout.py), and a leak stops the load with HeldoutLeak; the data was guarded when
it was made, this is the second gate. The validation split is by a hash of the item id, so it
is the same however many shards exist (a growing run only adds to both sides), and it is for
training curves only: acceptance is reported on the held-out sets, never on this split.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from distill_shards import read_records
from heldout import HeldoutGuard

PHASES = ("question", "response")


@dataclass(frozen=True)
class DistillSequence:
    id: str
    source: str             # the prompt's source (man, stdlib_code, self, ...)
    sampled: bool           # the response was sampled (T > 0) rather than greedy
    tokens: list[int]       # prompt ids + response ids
    response_start: int     # tokens[response_start:] is the target's response

    @property
    def response_tokens(self) -> int:
        return len(self.tokens) - self.response_start


def load(run_dir: Path, guard: HeldoutGuard, *, phases: Iterable[str] = PHASES,
         max_len: int | None = None, min_response: int = 1) -> list[DistillSequence]:
    """Every finished item of the run in `run_dir` (its OUT folder), in shard order. `max_len`
    cuts a sequence's end (the prompt is never cut: items whose prompt alone reaches it are
    skipped); items with fewer than `min_response` response tokens are skipped."""
    phases = tuple(phases)
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        raise ValueError(f"unknown phase(s) {unknown}; known: {', '.join(PHASES)}")
    shards = Path(run_dir) / "shards"
    if not shards.is_dir():
        raise FileNotFoundError(f"{run_dir} holds no shards/ folder: not a training/distill_data.py output")
    out = []
    for r in read_records(shards):   # read-only: the run may still be writing
        if r["phase"] not in phases:
            continue
        guard.check(r["messages"])
        prompt, response = list(r["prompt_ids"]), list(r["response_ids"])
        if max_len is not None:
            if len(prompt) >= max_len:
                continue
            response = response[:max_len - len(prompt)]
        if len(response) < min_response:
            continue
        out.append(DistillSequence(r["id"], r["source"], r["sampling"]["temperature"] > 0, prompt + response,
                                   len(prompt)))
    return out


def is_validation(item_id: str, share: float) -> bool:
    """Whether an item is in the validation split: a stable hash of its id, not its position."""
    h = int.from_bytes(hashlib.sha256(item_id.encode()).digest()[:8], "big")
    return h / 2 ** 64 < share


def split(seqs: list[DistillSequence], share: float) -> tuple[list[DistillSequence], list[DistillSequence]]:
    """(train, validation), validation about `share` of the items."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"validation share must be in [0, 1), got {share}")
    val = [s for s in seqs if is_validation(s.id, share)]
    return [s for s in seqs if not is_validation(s.id, share)], val


def describe(seqs: list[DistillSequence]) -> dict:
    """Counts for a drafter's card: items and response tokens by source, greedy vs sampled."""
    items, tokens = Counter(), Counter()
    for s in seqs:
        items[s.source] += 1
        tokens[s.source] += s.response_tokens
    return {"items": len(seqs), "sampled": sum(s.sampled for s in seqs),
            "response_tokens": sum(tokens.values()), "tokens": sum(len(s.tokens) for s in seqs),
            "by_source": {k: {"items": items[k], "response_tokens": tokens[k]} for k in sorted(items)}}
