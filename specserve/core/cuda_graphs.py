"""Capture a static step as a CUDA graph per shape key and replay it; on a CPU, run it eagerly
through the same wrapper (so CPU tests exercise the buffer handling a graph relies on).

A step function takes a dict of input tensors and returns a dict of output tensors, with shapes
fixed by its key (batch bucket, draft length, span, greedy/sampled). A graph replays the kernels
recorded at capture on the SAME memory: inputs are copied into static buffers before each replay
and outputs are read from static buffers after it, so

  - a caller must consume (copy to the host) the outputs of one run before the next run of the
    same key, and
  - everything the function touches besides its inputs (weights, the KV pool, a drafter's
    feature buffers) must never be reallocated.

All graphs share one private memory pool: they run one at a time, so their temporaries can
overlap. Warm-up runs (before capture, on a side stream, as CUDA graph capture requires) use the
example inputs; make those write only to scratch state (padded rows point at a scratch KV slot).
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

StepFn = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
MODES = ("auto", "eager", "graph")


class StaticGraph:
    def __init__(self, fn: StepFn, example: dict[str, torch.Tensor], *, capture: bool, pool=None,
                 warmup: int = 2):
        self.fn = fn
        self.inputs = {k: v.clone() for k, v in example.items()}  # the static input buffers
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: dict[str, torch.Tensor] | None = None
        if capture:
            self._capture(pool, warmup)

    def _capture(self, pool, warmup: int) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy initialisations (cuBLAS handles, RoPE tables) happen here
            for _ in range(warmup):
                self.fn(self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = self.fn(self.inputs)

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name, value in inputs.items():
            self.inputs[name].copy_(value, non_blocking=True)
        if self.graph is None:
            return self.fn(self.inputs)
        self.graph.replay()
        return self.outputs


class GraphCache:
    """StaticGraph per key, built on first use (or ahead of time with `warm`).

    mode: "graph" captures CUDA graphs, "eager" runs the function, "auto" captures on CUDA only.
    """

    def __init__(self, make_fn: Callable[[Hashable], StepFn],
                 make_example: Callable[[Hashable], dict[str, torch.Tensor]],
                 device: torch.device, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"graph mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.capture = mode == "graph" or (mode == "auto" and torch.device(device).type == "cuda")
        if self.capture and torch.device(device).type != "cuda":
            raise ValueError("CUDA graph capture needs a CUDA device")
        self.make_fn, self.make_example = make_fn, make_example
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.graphs: dict[Hashable, StaticGraph] = {}

    def get(self, key: Hashable) -> StaticGraph:
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = StaticGraph(self.make_fn(key), self.make_example(key),
                                               capture=self.capture, pool=self.pool)
        return g

    def run(self, key: Hashable, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.get(key)(inputs)

    def warm(self, keys: list[Hashable]) -> None:
        """Capture every key now (at startup, not on a request's path); eagerly: make the buffers."""
        for key in keys:
            self.get(key)
