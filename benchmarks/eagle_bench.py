"""EAGLE on held-out prompts, greedy, one request at a time, every configuration measured
alternately against `none` in one run (ratios never come from different runs).

Configurations: `none`; EAGLE fused with the calibration head (adaptive length); EAGLE fused
with a fixed draft length of 4 (no calibration); EAGLE remote (the exported ONNX drafter under
onnxruntime, as the Triton drafter models run it, called in-process — so the difference to fused
is the ONNX runtime path, not BLS).

    python benchmarks/eagle_bench.py --target models/demo/target --drafter models/demo/eagle \
        [--prompts 16] [--new-tokens 96] [--out F]

Reports per configuration: mean acceptance length (accepted + 1 per step), draft tokens per
step, verified tokens per step, tokens/s and the speedup over `none`, and where a step's time
goes: the proposer call and the verify forward (ms per step, the engine's own timers).
`benchmarks/eagle_triton_bench.py` measures the same through Triton.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from specserve.core.engine import Engine, EngineConfig, GenerationRequest
from specserve.model.transformer import load_model
from specserve.methods.eagle.drafter import load_eagle
from specserve.methods.eagle.proposer import EagleProposer
from specserve.methods.eagle.export import export
from specserve.methods.eagle.onnx_runtime import CalibrationOnnxRuntime, EagleOnnxRuntime, in_process_call
from specserve.methods.remote import RemoteProposer
from specserve.core.sampling import SamplingParams
from specserve.model.devices import DRAFTER_DTYPES, resolve_drafter_dtype
from specserve.cli.bench.tally import SpecTally

ROOT = Path(__file__).resolve().parents[1]


def row(t: SpecTally, base: SpecTally) -> dict:
    return {"tok_s": round(t.tokens_per_s, 2), "speedup_vs_none": round(t.tokens_per_s / base.tokens_per_s, 3),
            "mean_acceptance_length": round(t.acceptance_length, 3),
            "draft_tokens_per_step": round(t.drafted_per_step, 3),
            "verified_tokens_per_step": round(t.verified_per_step, 3),
            "draft_ms_per_step": round(t.ms_per_step(t.draft_s), 3),
            "verify_ms_per_step": round(t.ms_per_step(t.verify_s), 3)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=ROOT / "models/demo/target")
    ap.add_argument("--drafter", type=Path, default=ROOT / "models/demo/eagle")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threshold", type=float, default=0.3)
    ap.add_argument("--max-draft-len", type=int, default=8)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--drafter-dtype", choices=DRAFTER_DTYPES, default="auto",
                    help="fused drafters' compute dtype, as `specserve serve --drafter-dtype`")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from tokenizers import Tokenizer

    target = load_model(args.target)
    drafter = load_eagle(args.drafter, target, dtype=resolve_drafter_dtype(args.drafter_dtype, target))
    tok = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    lines = (ROOT / "models/demo/heldout_prompts.jsonl").read_text().splitlines()[:args.prompts]
    prompts = [tok.encode(json.loads(line)["prompt"]).ids for line in lines]
    K, n = args.max_draft_len, args.new_tokens
    max_len = 1024
    onnx_dir = Path(tempfile.mkdtemp())
    report = export(target, load_eagle(args.drafter, target), onnx_dir)  # the remote drafter: fp32 ONNX
    rt = EagleOnnxRuntime(str(report.backbone), target.cfg.num_kv_heads, target.cfg.head_dim)
    cal = CalibrationOnnxRuntime(str(report.calibration))

    proposers = {
        "eagle": EagleProposer(drafter, target, max_num_seqs=1, max_model_len=max_len, max_draft_len=K,
                               threshold=args.threshold, name="eagle"),
        "eagle_fixed4": EagleProposer(drafter, target, max_num_seqs=1, max_model_len=max_len, max_draft_len=4,
                                      threshold=None, name="eagle_fixed4"),
        "eagle_remote": RemoteProposer("eagle_remote", in_process_call(rt, cal), max_draft_len=K,
                                       threshold=args.threshold,
                                       release=rt.release),
    }
    engine = Engine(target, EngineConfig(max_num_seqs=1, max_model_len=max_len, max_draft_len=K), proposers)
    methods = ["none", "eagle", "eagle_fixed4", "eagle_remote"]
    tallies = {m: SpecTally() for m in methods}
    # Warm-up (not timed).
    engine.generate([GenerationRequest(f"w{m}", prompts[0], SamplingParams(max_tokens=4), m) for m in methods[:1]])
    for i, p in enumerate(prompts):
        for m in methods:  # alternate configurations prompt by prompt
            t0 = time.perf_counter()
            out = engine.generate([GenerationRequest(f"{m}{i}", p, SamplingParams(max_tokens=n), m)])[f"{m}{i}"]
            tallies[m].add_engine(out, time.perf_counter() - t0)
    for m in methods[1:]:
        if tallies[m].outputs != tallies["none"].outputs:
            raise SystemExit(f"LOSSLESSNESS VIOLATED: {m} greedy output differs from none")
    base = tallies["none"]
    rows = {m: row(tallies[m], base) for m in methods}
    result = {"target": str(args.target), "drafter": str(args.drafter), "prompts": len(prompts),
              "new_tokens": n, "threshold": args.threshold, "max_draft_len": K, "threads": args.threads,
              "drafter_dtype": str(drafter.fc.weight.dtype),
              "machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "configs": rows}
    print("| config | tok/s | speedup vs none | mean acceptance length | draft tok/step | verified tok/step "
          "| draft ms/step | verify ms/step |")
    print("|---|---|---|---|---|---|---|---|")
    for m, r in rows.items():
        print(f"| {m} | {r['tok_s']} | {r['speedup_vs_none']}× | {r['mean_acceptance_length']} | "
              f"{r['draft_tokens_per_step']} | {r['verified_tokens_per_step']} | {r['draft_ms_per_step']} | "
              f"{r['verify_ms_per_step']} |")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
