"""Which waiting request gets the next free KV slot: priority with aging.

A request carries its tier's priority (0..9, higher first; GenerationRequest.priority). While it
waits for a slot, its effective priority rises by one level every `aging_steps` engine steps:

    effective = priority + (steps waited) // aging_steps

The next slot goes to the highest effective priority; ties go to the request that has waited
longest (FIFO), so equal priorities keep today's arrival order.

No starvation: a request R of priority p is passed only by requests that arrived before it or
fewer than (P - p) · aging_steps steps after it, where P = 9 is the highest priority. A request
that arrived d ≥ (P - p) · aging_steps steps after R has waited d steps less, so its effective
priority is at most R's (floor((w + d) / a) ≥ floor(w / a) + (P - p)), and on a tie R, the older,
wins. Arrivals in a bounded window are finite (the queue is bounded, and each step admits at most
max_num_seqs), so R is admitted after finitely many others. Worked example (a = 32): a batch
request (p = 1) can be passed only by vip requests (9) that arrive within 256 steps after it.

Steps, not wall time: the order depends only on the sequence of submits and steps, so it is
deterministic and tests can pin it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

# Steps a waiting request needs to gain one priority level. On the demo model a busy step takes
# ~20-40 ms on CPU, so vip requests (9) arriving more than 8 × 32 = 256 steps (~5-10 s) after a
# batch request (1) no longer pass it.
AGING_STEPS = 32
MAX_PRIORITY = 9


class Waiting(Protocol):
    priority: int
    enqueued_step: int     # the engine step count when it was queued


@dataclass(frozen=True)
class PriorityAging:
    aging_steps: int = AGING_STEPS

    def __post_init__(self) -> None:
        if self.aging_steps < 1:
            raise ValueError(f"aging_steps must be at least 1, got {self.aging_steps}")

    def effective(self, w: Waiting, step: int) -> int:
        return w.priority + (step - w.enqueued_step) // self.aging_steps

    def pick(self, waiting: Sequence[Waiting], step: int) -> int:
        """Index of the request to admit next; `waiting` is in arrival order, not empty."""
        # max() keeps the first of equal keys: among equal effective priorities, the oldest.
        return max(range(len(waiting)), key=lambda i: self.effective(waiting[i], step))
