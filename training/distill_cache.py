"""The target's outputs, computed once, for training drafters on them (MTP heads, draft model).

The target forward is the expensive part of self-distillation on this 2-core CPU machine, so
both `training/train_mtp.py` and `training/train_draft.py` read one cache instead of re-running it
every step:

  tokens   [N, T] int64  windows: demo-corpus train-split windows, plus the target's own greedy
                         continuations of train-split prompts (the text it will draft for)
  hidden   [N, T, D] f16 the target's final hidden state (after the final norm, what
                         ForwardOutput.hidden holds and what the engine hands proposers)
  top_ids  [N, T, K] i64 the target's K most likely next tokens at each position (predicting
                         position t+1), best first
  top_logits [N, T, K] f16 their logits (fp32 logits of the LM head, rounded to f16)

A split's cache is `<work-dir>/<split>.pt`. The held-out split (held-out documents, and greedy
continuations of models/demo/heldout_prompts.jsonl) is only evaluated on, never trained on.
Deterministic (seeded window choice; greedy continuations).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.core.engine import Engine, EngineConfig, GenerationRequest
from specserve.model.transformer import Transformer
from specserve.core.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class DistillCache:
    tokens: torch.Tensor      # [N, T] int64
    hidden: torch.Tensor      # [N, T, D] float16
    top_ids: torch.Tensor     # [N, T, K] int64
    top_logits: torch.Tensor  # [N, T, K] float16
    meta: dict

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()


def _corpus():
    sys.path.insert(0, str(ROOT / "training"))
    import corpus  # the demo corpus (training/corpus.py), rebuilt offline from the stdlib

    return corpus


def split_stream(tokenizer, split: str) -> list[int]:
    corpus = _corpus()
    eot = tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for d in corpus.documents(corpus.load_manifest(), split):
        ids += tokenizer.encode(d.text).ids + ([eot] if eot is not None else [])
    return ids


def split_prompts(tokenizer, split: str, n: int) -> list[list[int]]:
    """Serving-like prompts (function headers, prose openings) of one split: for `heldout` exactly
    the benchmark prompts' construction (training/corpus.py), for `train` the same from train docs."""
    corpus = _corpus()
    n_prose = n // 4
    prompts = corpus.split_prompts(corpus.load_manifest(), split, n - n_prose, n_prose)
    return [tokenizer.encode(p["prompt"]).ids for p in prompts]


def greedy_continuations(target: Transformer, prompts: list[list[int]], *, length: int,
                         batch: int = 16) -> list[list[int]]:
    """prompt + the target's greedy continuation (EOS ignored) up to `length` tokens, per prompt."""
    engine = Engine(target, EngineConfig(max_num_seqs=batch, max_model_len=length + 1), eos_token_ids=())
    out: list[list[int]] = []
    for i in tqdm(range(0, len(prompts), batch), desc="greedy continuations", unit="batch"):
        chunk = prompts[i:i + batch]
        reqs = [GenerationRequest(str(i + k), p, SamplingParams(max_tokens=length - len(p), ignore_eos=True))
                for k, p in enumerate(chunk)]
        got = engine.generate(reqs)
        out += [r.prompt_ids + got[r.request_id].new_token_ids for r in reqs]
    return out


def windows(stream: list[int], n: int, length: int, rng: random.Random) -> list[list[int]]:
    starts = sorted(rng.randrange(0, len(stream) - length) for _ in range(n))
    return [stream[s:s + length] for s in starts]


@torch.inference_mode()
def run_target(target: Transformer, rows: list[list[int]], *, top_k: int, batch: int,
               desc: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Equal-length rows → (tokens, hidden f16, top ids, top logits f16), one causal forward each."""
    tokens = torch.tensor(rows)  # [N, T]
    hidden, ids, vals = [], [], []
    for i in tqdm(range(0, len(rows), batch), desc=desc, unit="batch"):
        from specserve.core.forward import ForwardBatch  # noqa: PLC0415 — keeps the module import light

        x = tokens[i:i + batch]
        B, T = x.shape
        positions = torch.arange(T).expand(B, T)
        mask = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
        zero = torch.zeros(B, dtype=torch.long)
        h = target.forward(ForwardBatch(x, positions, zero, zero, mask), cache=None).hidden  # [B, T, D]
        logits = target.logits(h)  # [B, T, V] fp32
        top = logits.topk(top_k, dim=-1)
        hidden.append(h.half())
        ids.append(top.indices)
        vals.append(top.values.half())
    return tokens, torch.cat(hidden), torch.cat(ids), torch.cat(vals)


def build(target: Transformer, tokenizer, split: str, *, n_windows: int, n_prompts: int, length: int,
          top_k: int, seed: int, batch: int = 8) -> DistillCache:
    """Rows of `length` tokens: n_windows corpus windows of the split + greedy continuations of
    n_prompts serving-like prompts of the split (the prompt, at most length/2 tokens, then the
    target's greedy tokens up to `length`)."""
    t0 = time.time()
    rng = random.Random(seed)
    stream = split_stream(tokenizer, split)
    rows = windows(stream, n_windows, length, rng)
    prompts = [p[-(length // 2):] for p in split_prompts(tokenizer, split, n_prompts)] if n_prompts else []
    if prompts:
        rows += greedy_continuations(target, prompts, length=length)  # prompt, then the target's own
    tokens, hidden, ids, vals = run_target(target, rows, top_k=top_k, batch=batch, desc=f"target forward ({split})")
    meta = {"split": split, "corpus_windows": n_windows, "greedy_continuations": len(prompts), "length": length,
            "top_k": top_k, "seed": seed, "tokens": tokens.numel(), "wall_time_s": round(time.time() - t0, 1)}
    return DistillCache(tokens, hidden, ids, vals, meta)


def load_or_build(path: Path, target: Transformer, tokenizer, split: str, **kw) -> DistillCache:
    """The cache at `path` if it was built with the same settings, else build and save it."""
    want = {"split": split, **{k: v for k, v in kw.items() if k != "batch"}}
    if path.is_file():
        state = torch.load(path, weights_only=False)
        if state["want"] == want:
            return DistillCache(**state["cache"])
        print(f"{path}: built with other settings; rebuilding", file=sys.stderr)
    cache = build(target, tokenizer, split, **kw)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"want": want, "cache": cache.__dict__}, path)
    print(json.dumps(cache.meta), file=sys.stderr)
    return cache


def main(argv: list[str] | None = None) -> None:

    from tokenizers import Tokenizer

    from specserve.model.transformer import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--work-dir", type=Path, required=True, help="writes train.pt and heldout.pt here")
    ap.add_argument("--windows", type=int, default=2000, help="train-split corpus windows")
    ap.add_argument("--prompts", type=int, default=256, help="train-split prompts continued greedily")
    ap.add_argument("--heldout-windows", type=int, default=200)
    ap.add_argument("--heldout-prompts", type=int, default=40)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model(args.target)
    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    kw = dict(length=args.length, top_k=args.top_k, seed=args.seed)
    load_or_build(args.work_dir / "train.pt", target, tokenizer, "train", n_windows=args.windows,
                  n_prompts=args.prompts, **kw)
    load_or_build(args.work_dir / "heldout.pt", target, tokenizer, "heldout", n_windows=args.heldout_windows,
                  n_prompts=args.heldout_prompts, **kw)


if __name__ == "__main__":
    main()


def distilled_trainer_args(description: str, *, steps: int, batch: int, batch_help: str,
                           ckpt_every: int) -> argparse.ArgumentParser:
    """The flags every trainer on this cache takes (train_mtp, train_draft); each adds its own."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--cache", type=Path, required=True, help="folder with train.pt and heldout.pt")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work-dir", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--batch", type=int, default=batch, help=batch_help)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ckpt-every", type=int, default=ckpt_every)
    ap.add_argument("--accept-prompts", type=int, default=8, help="held-out benchmark prompts for the "
                    "in-process acceptance figure (evaluation only)")
    ap.add_argument("--accept-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def heldout_benchmark_prompts(tokenizer, n: int) -> list[list[int]]:
    """The first n benchmark prompts (models/demo/heldout_prompts.jsonl): evaluation only."""
    lines = (ROOT / "models/demo/heldout_prompts.jsonl").read_text().splitlines()[:n]
    return [tokenizer.encode(json.loads(x)["prompt"]).ids for x in lines]


def acceptance_in_process(target: Transformer, method: str, proposer, prompts: list[list[int]], *,
                          new_tokens: int, max_draft_len: int, batch: int = 4) -> dict:
    """Greedy generation with `method` vs plain (none) in one engine: mean acceptance length
    (accepted + 1 per verify step) and whether every output equals plain decoding."""
    max_len = max(len(p) for p in prompts) + new_tokens + 1
    engine = Engine(target, EngineConfig(max_num_seqs=batch, max_model_len=max_len, max_draft_len=max_draft_len),
                    {method: proposer}, eos_token_ids=())
    reqs = lambda m: [GenerationRequest(f"{m}{i}", p, SamplingParams(max_tokens=new_tokens), m)  # noqa: E731
                      for i, p in enumerate(prompts)]
    plain, spec = {}, {}
    for i in tqdm(range(0, len(prompts), batch), desc=f"acceptance ({method})", unit="batch"):
        plain |= engine.generate(reqs("none")[i:i + batch])
        spec |= engine.generate(reqs(method)[i:i + batch])
    steps = sum(o.stats.steps for o in spec.values())  # decode steps, as SpecStats counts them
    accepted = sum(o.stats.accepted_tokens for o in spec.values())
    equal = all(spec[f"{method}{i}"].new_token_ids == plain[f"none{i}"].new_token_ids for i in range(len(prompts)))
    return {"prompts": len(prompts), "new_tokens": new_tokens, "max_draft_len": max_draft_len,
            "verify_steps": steps, "accepted_tokens": accepted,
            "proposer_errors": sum(o.stats.proposer_errors for o in spec.values()),
            "mean_acceptance_length": round((accepted + steps) / max(1, steps), 4),
            "outputs_equal_none": equal}
