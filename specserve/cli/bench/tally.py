"""What a benchmark sums over the requests of one configuration, and the figures derived from it.

The engine counts, per request, steps, drafted and accepted tokens and the seconds spent drafting
and verifying (core/engine.py SpecStats, the same names in a Triton response's spec_stats). Every
benchmark that compares configurations request by request sums them here, so mean acceptance
length and tokens/s mean one thing in every report:

    acceptance length   (accepted + steps) / steps  (each step also emits one token of its own)
    tokens/s            output tokens / wall seconds of those requests
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecTally:
    requests: int = 0
    seconds: float = 0.0        # wall clock of the requests (the benchmark says whose clock)
    ttft: float = 0.0           # summed time to first token, where the benchmark measures it
    tokens: int = 0             # output tokens
    steps: int = 0
    accepted: int = 0
    drafted: int = 0
    draft_s: float = 0.0        # engine: proposer calls
    verify_s: float = 0.0       # engine: verify forward + acceptance
    outputs: list = field(default_factory=list)   # each request's output (ids or text), in order

    def add(self, *, seconds: float, output, tokens: int, stats: dict, ttft: float = 0.0) -> None:
        """One request: its wall seconds, output, output token count and the engine's counters
        (steps, accepted_tokens, draft_tokens[, draft_seconds, verify_seconds])."""
        self.requests += 1
        self.seconds += seconds
        self.ttft += ttft
        self.tokens += tokens
        self.steps += stats["steps"]
        self.accepted += stats["accepted_tokens"]
        self.drafted += stats["draft_tokens"]
        self.draft_s += stats.get("draft_seconds", 0.0)
        self.verify_s += stats.get("verify_seconds", 0.0)
        self.outputs.append(output)

    def add_engine(self, out, seconds: float) -> None:
        """One in-process engine output (core/engine.py GenerationOutput)."""
        s = out.stats
        self.add(seconds=seconds, output=list(out.new_token_ids), tokens=len(out.new_token_ids),
                 stats={"steps": s.steps, "accepted_tokens": s.accepted_tokens, "draft_tokens": s.draft_tokens,
                        "draft_seconds": s.draft_seconds, "verify_seconds": s.verify_seconds})

    @property
    def acceptance_length(self) -> float:
        return (self.accepted + self.steps) / max(1, self.steps)

    @property
    def drafted_per_step(self) -> float:
        return self.drafted / max(1, self.steps)

    @property
    def verified_per_step(self) -> float:
        return (self.drafted + self.steps) / max(1, self.steps)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(1, self.drafted)

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds else None

    def ms_per_step(self, seconds: float) -> float:
        return 1e3 * seconds / max(1, self.steps)
