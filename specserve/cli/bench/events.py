"""What the driver records about one request: when it was sent, when each streamed response
arrived and how many tokens it carried, and how it ended. Times are seconds on one monotonic clock
(`time.perf_counter`) shared by every request of a run."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Chunk:
    t: float               # arrival time of the response
    num_tokens: int        # output tokens it carried (the delta of num_output_tokens)


@dataclass
class RequestRecord:
    index: int             # the workload request
    method: str
    bucket: str
    send_t: float
    chunks: list[Chunk] = field(default_factory=list)
    end_t: float | None = None          # arrival of the final response (or of the error)
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str = ""
    spec_stats: dict = field(default_factory=dict)   # the server's cumulative SpecStats
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_t is not None


@dataclass(frozen=True)
class Window:
    """One method's share of a phase: the wall-clock span of one block of requests. Throughput
    divides by the sum of a method's windows, so interleaved blocks do not count each other."""
    method: str
    start: float
    end: float
