"""What weight-only quantization costs and buys on SmolLM2 (issue 26): quality measured, not assumed.

    python benchmarks/quantize_quality.py [--target models/smollm2/target] [--prompts 8] [--new-tokens 64]
        [--texts 8] [--speed-tokens 64] [--rounds 3] [--threads 2] [--group-size 32] [--configs A,B] [--out F.json]

In process, one engine per configuration (`specserve serve`'s own build_engine), greedy, c = 1
for speed:

1. Held-out chat prompts (models/smollm2/heldout_chat.jsonl, the first --prompts, rendered with
   the checkpoint's chat template) answered greedily by the fp32 target (up to --new-tokens,
   stopping at end of turn). Perplexity of each configuration on those answers (the prompt is
   context, only the answer tokens count). These are fp32's own argmax tokens, so the text favours
   fp32: any disagreement raises a quantized model's figure, which makes it a conservative
   measure of the loss.
2. Perplexity on natural held-out text that no configuration wrote: the first --texts prompt +
   reference pairs of models/demo/heldout_prompts.jsonl (Python standard-library code and prose),
   reference tokens only.
3. How often greedy output parts from fp32's on the chat prompts: the share of prompts whose
   answer differs, the share of answer tokens from the first difference on, the mean common prefix.
4. Plain decode tokens/s at c = 1 (`none`, --speed-tokens tokens, end of turn ignored), every
   configuration once per round after one untimed warm-up request each, --rounds rounds alternated,
   the median kept; a step's time is the
   engine's own (SpecStats draft + verify seconds), so the prefill is not in it.

Configurations: fp32 and bf16 (dense), int8 and int4 (group --group-size) with fp32 and with bf16
activations (--dtype), and the LM head quantized too: `+head8` is `--quantize-head int8` as served
(model/quantize.py: an int8 copy for the logits, the dense embedding kept), on int8 and on int4
with fp32 activations and on int4 with bf16 ones (the fast configuration); `+head4` quantizes the
head to int4 by hand, a configuration `serve` refuses, kept here to show why.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from specserve.cli.bench.bandwidth import weight_bytes  # noqa: E402

CHAT = ROOT / "models" / "smollm2" / "heldout_chat.jsonl"
TEXTS = ROOT / "models" / "demo" / "heldout_prompts.jsonl"
OUT = ROOT / "docs" / "quantize" / "quantize_quality.json"


@dataclass(frozen=True)
class Config:
    name: str
    dtype: str
    quantize: str
    head: str = "none"     # "int8": --quantize-head int8; "int4": by hand (not a served mode)


def configs(group_size: int) -> list[Config]:
    return [Config("fp32", "float32", "none"), Config("bf16", "bfloat16", "none"),
            Config("int8", "float32", "int8"), Config("int8/bf16", "bfloat16", "int8"),
            Config(f"int4-g{group_size}", "float32", "int4"), Config(f"int4-g{group_size}/bf16", "bfloat16", "int4"),
            Config("int8+head8", "float32", "int8", "int8"), Config(f"int4-g{group_size}+head8", "float32", "int4", "int8"),
            Config(f"int4-g{group_size}/bf16+head8", "bfloat16", "int4", "int8"),
            Config(f"int4-g{group_size}+head4", "float32", "int4", "int4")]


def build(target: Path, cfg: Config, group_size: int, max_num_seqs: int):
    from torch import nn

    from specserve.model.quantized_linear import Int4Linear
    from specserve.serving.build import build_engine
    from specserve.serving.settings import DeploymentSettings

    engine, tok = build_engine(DeploymentSettings(target, max_num_seqs=max_num_seqs, max_model_len=1024, device="cpu",
                                                  dtype=cfg.dtype, quantize=cfg.quantize, quantize_group_size=group_size,
                                                  quantize_head="int8" if cfg.head == "int8" else "none",
                                                  draft_policy="fixed", default_method="none"))
    if cfg.head == "int4":   # an int4 copy of the (tied) head; the embedding keeps the dense weight
        model = engine.model
        head = nn.Linear(model.cfg.hidden_size, model.cfg.vocab_size, bias=False, dtype=model.dtype)
        head.weight = model.lm_head.weight
        model.lm_head = Int4Linear.from_linear(head, group_size)
    return engine, tok


def chat_prompts(target: Path, n: int, tok) -> list[list[int]]:
    from specserve.openai.chat import ChatTemplate

    template = ChatTemplate(target)
    lines = [json.loads(line) for line in CHAT.read_text().splitlines() if line.strip()][:n]
    return [tok.encode(template.render(item["messages"]), add_special_tokens=False).ids for item in lines]


def natural_texts(n: int, tok) -> list[tuple[list[int], list[int]]]:
    items = [json.loads(line) for line in TEXTS.read_text().splitlines() if line.strip()][:n]
    return [(tok.encode(i["prompt"], add_special_tokens=False).ids, tok.encode(i["reference"], add_special_tokens=False).ids)
            for i in items]


def greedy(engine, prompts: list[list[int]], n: int, tag: str) -> list[list[int]]:
    from specserve.core.engine import GenerationRequest
    from specserve.core.sampling import SamplingParams

    reqs = [GenerationRequest(f"{tag}-{i}", p, SamplingParams(max_tokens=n), "none") for i, p in enumerate(prompts)]
    out = engine.generate(reqs)
    return [out[r.request_id].new_token_ids for r in reqs]


def perplexity(model, pairs: list[tuple[list[int], list[int]]]) -> float:
    """exp(mean NLL) of the continuation tokens given their context, over all pairs."""
    import torch

    nll, count = 0.0, 0
    for context, continuation in pairs:
        if not continuation:
            continue
        tokens = torch.tensor([context + continuation])
        logp = torch.log_softmax(model.score(tokens)[0, len(context) - 1:-1].double(), dim=-1)  # [n, V]
        nll -= logp.gather(1, torch.tensor(continuation)[:, None]).sum().item()
        count += len(continuation)
    return math.exp(nll / count)


def divergence(ref: list[list[int]], got: list[list[int]]) -> dict:
    prefixes, after, total = [], 0, 0
    for a, b in zip(ref, got):
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(common)
        after += max(len(a), len(b)) - common if a != b else 0
        total += max(len(a), len(b))
    return {"prompts_differing": round(sum(a != b for a, b in zip(ref, got)) / len(ref), 3),
            "tokens_from_first_difference": round(after / total, 3),
            "mean_common_prefix": round(statistics.mean(prefixes), 1)}


def decode_tok_s(engine, prompt: list[int], n: int, tag: str) -> float:
    from specserve.core.engine import GenerationRequest
    from specserve.core.sampling import SamplingParams

    r = GenerationRequest(tag, prompt, SamplingParams(max_tokens=n, ignore_eos=True), "none")
    stats = engine.generate([r])[tag].stats
    return stats.steps / (stats.draft_seconds + stats.verify_seconds)


def run(args, log=print) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    every = configs(args.group_size)
    names = ["fp32", *(n for n in args.configs.split(",") if n and n != "fp32")] if args.configs else [c.name for c in every]
    unknown = set(names) - {c.name for c in every}
    if unknown:
        raise SystemExit(f"--configs: unknown {', '.join(sorted(unknown))} (known: {', '.join(c.name for c in every)})")
    cfgs = [c for c in every if c.name in names]
    built = {}
    for c in cfgs:
        t0 = time.perf_counter()
        built[c.name] = build(args.target, c, args.group_size, max(args.prompts, 1))
        log(f"built {c.name} in {time.perf_counter() - t0:.1f} s")
    tok = built["fp32"][1]
    prompts = chat_prompts(args.target, args.prompts, tok)
    answers = {c.name: greedy(built[c.name][0], prompts, args.new_tokens, c.name) for c in cfgs}
    chat_pairs = list(zip(prompts, answers["fp32"]))
    texts = natural_texts(args.texts, tok)
    quality = {}
    for c in cfgs:
        model = built[c.name][0].model
        quality[c.name] = {"chat_ppl_on_fp32_answers": round(perplexity(model, chat_pairs), 4),
                           "natural_text_ppl": round(perplexity(model, texts), 4),
                           "vs_fp32_greedy": divergence(answers["fp32"], answers[c.name]),
                           "weight_bytes_per_step": weight_bytes(model)}
        log(f"{c.name}: {quality[c.name]}")
    for c in cfgs:
        for key in ("chat_ppl_on_fp32_answers", "natural_text_ppl"):
            quality[c.name][key.replace("ppl", "ppl_vs_fp32")] = round(quality[c.name][key] / quality["fp32"][key], 4)
    speed = {c.name: [] for c in cfgs}
    for c in cfgs:   # untimed: a first c = 1 request per engine ran 20-50x slower than the next ones
        decode_tok_s(built[c.name][0], prompts[0], args.speed_tokens, f"warm-{c.name}")
    for rnd in range(args.rounds):
        for c in cfgs:
            speed[c.name].append(decode_tok_s(built[c.name][0], prompts[0], args.speed_tokens, f"speed-{rnd}-{c.name}"))
        log(f"round {rnd}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in speed.items()))
    fp32 = statistics.median(speed["fp32"])
    return {
        "command": "python benchmarks/quantize_quality.py " + " ".join(sys.argv[1:]),
        "target": str(args.target.relative_to(ROOT) if args.target.is_relative_to(ROOT) else args.target),
        "machine": {"platform": platform.platform(), "threads": args.threads, "torch": torch.__version__,
                    "cpu": platform.processor() or platform.machine(), "loadavg_end": list(os.getloadavg())},
        "settings": {"configs": [c.name for c in cfgs], "prompts": args.prompts, "new_tokens": args.new_tokens, "texts": args.texts,
                     "speed_tokens": args.speed_tokens, "rounds": args.rounds, "group_size": args.group_size},
        "quality": quality,
        "decode_tok_s_c1": {k: {"median": round(statistics.median(v), 2), "all": [round(x, 2) for x in v],
                                "vs_fp32": round(statistics.median(v) / fp32, 3)} for k, v in speed.items()},
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=ROOT / "models" / "smollm2" / "target")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--texts", type=int, default=8)
    ap.add_argument("--speed-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--configs", default="", help="comma-separated configurations (fp32 always; default: all)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    args.target = args.target.resolve()
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
