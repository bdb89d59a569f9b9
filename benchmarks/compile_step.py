"""Does `torch.compile` make the target's step faster on this CPU? (issue 26, "a compiled step")

    python benchmarks/compile_step.py [--target models/smollm2/target] [--configs float32:none:0 ...]
        [--rounds 5] [--steps 10] [--span 128] [--threads 2] [--out docs/compile/compile_step.json]

The step measured is the static step (core/static_step.target_step: the verify forward over the
KV pool, the LM head, greedy acceptance and the commit), at batch 1, one row whose K drafted
tokens are verified (K = 0 is a plain decode step), reading a --span-entry KV span. Three ways of
running the same function on the same inputs, in one process:

  eager     the step as the engine runs it on a CPU today;
  compiled  the whole step through torch.compile (Inductor, static shapes: one graph per key, as
            a served bucket would have), compiled once before timing;
  blocks    only each decoder layer's MLP block (norm, gate/up, SiLU·up, down, residual) compiled,
            the attention and its KV reads and writes left eager: the part with no data-dependent
            indexing, where fusing the small elementwise kernels is what compile is for.

Each config is "dtype:quantize:K" (quantize: none, int8, int4 with group 32; the quantized
linears are specserve's own, model/quantized_linear.py). Rounds alternate the three ways; each
round times --steps steps after the warm-up; the median round is reported as ms per step, with
the compile time and whether the emitted tokens equal eager's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specserve.core.static_step import DeviceKV, SamplingTensors, StepInputs, target_step  # noqa: E402
from specserve.model import transformer  # noqa: E402
from specserve.model.quantize import Quantization, quantize_target  # noqa: E402

DEFAULT_CONFIGS = ("float32:none:0", "bfloat16:none:0", "bfloat16:int4:0", "float32:none:4")


def mlp_block(layer: transformer.DecoderLayer, x: torch.Tensor) -> torch.Tensor:
    return x + layer.mlp(layer.post_attention_layernorm(x))   # x [B, T, D]


@contextlib.contextmanager
def compiled_blocks(block):
    """DecoderLayer.forward with its MLP block run by `block` (the compiled mlp_block)."""
    eager = transformer.DecoderLayer.forward

    def forward(self, x, cos, sin, batch, cache):
        return block(self, x + self.self_attn(self.input_layernorm(x), cos, sin, batch, cache))

    transformer.DecoderLayer.forward = forward
    try:
        yield
    finally:
        transformer.DecoderLayer.forward = eager


def measure(target: str, config: str, rounds: int, steps: int, span: int) -> dict:
    dtype_name, quant, k = config.split(":")
    K = int(k)
    model = transformer.load_model(target, dtype=getattr(torch, dtype_name)).eval()
    if quant != "none":
        model = quantize_target(model, Quantization(quant, 32))
    kv = DeviceKV(model.new_cache(2, span * 2))
    gen = torch.Generator().manual_seed(0)
    inp = StepInputs(tokens=torch.randint(0, model.cfg.vocab_size, (1, K + 1), generator=gen),  # [1, K+1]
                     lengths=torch.tensor([span // 2]), slots=torch.tensor([0]), draft_lens=torch.tensor([K]),
                     sampling=SamplingTensors.from_params([None], "cpu"), uniforms=torch.ones(1, K + 1))

    def step(i: StepInputs) -> torch.Tensor:
        r = target_step(model, kv, i, span, sampled=False)
        return r.emitted                                    # [1, K+1]

    whole = torch.compile(step, dynamic=False)
    block = torch.compile(mlp_block, dynamic=False)
    ways = {"eager": (step, contextlib.nullcontext), "compiled": (whole, contextlib.nullcontext),
            "blocks": (step, lambda: compiled_blocks(block))}
    out: dict[str, dict] = {}
    with torch.inference_mode():
        for name, (fn, ctx) in ways.items():   # first call: compiles (timed), then warm-up
            with ctx():
                t = time.perf_counter()
                emitted = fn(inp)
                out[name] = {"first_call_s": round(time.perf_counter() - t, 2), "emitted": emitted.tolist(), "ms": []}
                fn(inp)
        for _ in range(rounds):
            for name, (fn, ctx) in ways.items():
                with ctx():
                    t = time.perf_counter()
                    for _ in range(steps):
                        fn(inp)
                    out[name]["ms"].append((time.perf_counter() - t) / steps * 1e3)
    eager_ms = statistics.median(out["eager"]["ms"])
    row = {"config": config, "dtype": dtype_name, "quantize": quant, "draft_len": K}
    for name, r in out.items():
        ms = statistics.median(r["ms"])
        row[name] = {"ms_per_step": round(ms, 2), "vs_eager": round(eager_ms / ms, 3),
                     "first_call_s": r["first_call_s"], "rounds_ms": [round(x, 2) for x in r["ms"]],
                     "same_tokens_as_eager": r["emitted"] == out["eager"]["emitted"]}
    torch._dynamo.reset()
    return row


def table(rows: list[dict]) -> str:
    lines = ["| config | eager ms | compiled ms (× eager speed) | compile s | blocks ms (×) | compile s | same tokens |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        e, c, b = r["eager"], r["compiled"], r["blocks"]
        lines.append(f"| {r['config']} | {e['ms_per_step']} | {c['ms_per_step']} ({c['vs_eager']}×) | "
                     f"{c['first_call_s']} | {b['ms_per_step']} ({b['vs_eager']}×) | {b['first_call_s']} | "
                     f"{c['same_tokens_as_eager'] and b['same_tokens_as_eager']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="models/smollm2/target")
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), help="dtype:quantize:K each")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--span", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for config in args.configs:
        rows.append(measure(args.target, config, args.rounds, args.steps, args.span))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    report = {"command": "python benchmarks/compile_step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": {"processor": platform.processor() or platform.machine(), "threads": args.threads,
                          "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()},
              "rows": rows}
    print(table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
