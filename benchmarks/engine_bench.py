"""Engine throughput, measured side by side in one run (not a test: it prints ratios).

1. Decode tokens/s of the engine (`none`) vs transformers' `generate` (greedy, KV cache) on the
   same checkpoint, the same prompts, the same threads, alternating prompt by prompt.
2. Aggregate tokens/s of the engine at C concurrent requests vs 1, alternating round by round.

    python benchmarks/engine_bench.py --target models/demo/target [--new-tokens 64] [--out F]

Without --target (or when the folder is missing) it benchmarks a randomly initialised Llama of
the demo model's shape, and says so.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from specserve.core.engine import Engine, EngineConfig, GenerationRequest
from specserve.model.transformer import load_model
from specserve.core.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT = ROOT / "models/demo/heldout_prompts.jsonl"


def random_demo_shaped(path: Path) -> Path:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=384, intermediate_size=768,
                                   num_hidden_layers=18, num_attention_heads=6, num_key_value_heads=2,
                                   max_position_embeddings=2048, tie_word_embeddings=True,
                                   bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(path))
    return path


def load_prompts(target: Path, n: int, vocab: int) -> list[list[int]]:
    tok_file = target / "tokenizer.json"
    if HELD_OUT.is_file() and tok_file.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_file))
        texts = [json.loads(line)["prompt"] for line in HELD_OUT.read_text().splitlines()[:n]]
        return [tok.encode(t).ids for t in texts]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab, (24 + 8 * i,), generator=g).tolist() for i in range(n)]


def time_hf(ref, prompt: list[int], n: int) -> float:
    t0 = time.perf_counter()
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    dt = time.perf_counter() - t0
    assert out.shape[1] == len(prompt) + n
    return dt


def time_engine(engine: Engine, prompts: list[list[int]], n: int, tag: str) -> float:
    reqs = [GenerationRequest(f"{tag}-{i}", p, SamplingParams(max_tokens=n), "none")
            for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    dt = time.perf_counter() - t0
    assert all(len(o.new_token_ids) == n for o in outs.values())
    return dt


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=ROOT / "models/demo/target")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    target, note = args.target, "checkpoint"
    if not (target / "config.json").is_file():
        target = random_demo_shaped(Path(tempfile.mkdtemp()) / "random-demo-shape")
        note = "random weights, demo shape (no trained checkpoint found)"
    import transformers

    model = load_model(target)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    prompts = load_prompts(target, args.prompts, model.cfg.vocab_size)
    n, C = args.new_tokens, args.concurrency
    engine = Engine(model, EngineConfig(max_num_seqs=C, max_model_len=1024), eos_token_ids=())
    print(f"target: {target} ({note}); {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params; "
          f"threads={args.threads}; {n} new tokens per request", file=sys.stderr)

    # Warm up both paths once (first calls pay allocator and dispatch setup).
    time_hf(ref, prompts[0], 4)
    time_engine(engine, prompts[:1], 4, "warm")

    hf_t, eng_t = [], []
    with torch.inference_mode():
        for r in range(args.rounds):
            for i, p in enumerate(prompts):
                hf_t.append(time_hf(ref, p, n))
                eng_t.append(time_engine(engine, [p], n, f"s{r}-{i}"))
    batch_prompts = [prompts[i % len(prompts)] for i in range(C)]
    one_t, many_t = [], []
    for r in range(args.rounds):
        one_t.append(time_engine(engine, batch_prompts[:1], n, f"one{r}"))
        many_t.append(time_engine(engine, batch_prompts, n, f"many{r}"))

    hf_tps = n * len(hf_t) / sum(hf_t)
    eng_tps = n * len(eng_t) / sum(eng_t)
    one_tps = n * len(one_t) / sum(one_t)
    many_tps = n * C * len(many_t) / sum(many_t)
    result = {
        "target": str(target), "target_note": note, "threads": args.threads,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip() + f", {torch.get_num_threads()} threads",
        "new_tokens": n, "prompts": len(prompts), "rounds": args.rounds,
        "hf_generate_tok_s": round(hf_tps, 1), "engine_none_tok_s": round(eng_tps, 1),
        "engine_vs_hf": round(eng_tps / hf_tps, 2),
        "hf_step_ms_median": round(1000 * statistics.median(hf_t) / n, 2),
        "engine_step_ms_median": round(1000 * statistics.median(eng_t) / n, 2),
        "concurrency": C, "engine_1_tok_s": round(one_tps, 1), f"engine_{C}_tok_s": round(many_tps, 1),
        "concurrency_scaling": round(many_tps / one_tps, 2),
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    print("| measure | value |\n|---|---|")
    print(f"| transformers generate, tok/s | {result['hf_generate_tok_s']} |")
    print(f"| specserve engine `none`, tok/s | {result['engine_none_tok_s']} |")
    print(f"| **engine / transformers** | **{result['engine_vs_hf']}×** |")
    print(f"| engine, 1 request, tok/s | {result['engine_1_tok_s']} |")
    print(f"| engine, {C} concurrent, aggregate tok/s | {result[f'engine_{C}_tok_s']} |")
    print(f"| **{C} concurrent / 1** | **{result['concurrency_scaling']}×** |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
