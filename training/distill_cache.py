"""The target's outputs, computed once, for training drafters on them (MTP heads, draft model).

The target forward is the expensive part of self-distillation on this 2-core CPU machine, so
both `training/train_mtp.py` and `training/train_draft.py` read one cache instead of re-running it
every step:

  tokens   [N, T] int64  windows: demo-corpus train-split windows, plus the target's own greedy
                         continuations of train-split prompts (the text it will draft for); or,
                         with --distill-dir, a self-distillation folder's items (see below)
  hidden   [N, T, D] f16 the target's final hidden state (after the final norm, what
                         ForwardOutput.hidden holds and what the engine hands proposers)
  top_ids  [N, T, K] i64 the target's K most likely next tokens at each position (predicting
                         position t+1), best first
  top_logits [N, T, K] f16 their logits (fp32 logits of the LM head, rounded to f16)

A split's cache is `<work-dir>/<split>.pt`. The held-out split (held-out documents, and greedy
continuations of models/demo/heldout_prompts.jsonl) is only evaluated on, never trained on.
Deterministic (seeded window choice; greedy continuations).

--distill-dir DIR reads a training/distill_data.py output folder instead (read only; its finished
shards; repeatable, the folders' items end to end in order, the held-out guard re-run on load by training/distill_corpus.py): each item's prompt +
response ids, end to end in shard order, cut into consecutive windows of --length tokens. No
continuations are generated: the responses are already the target's own. `train.pt` holds the
folder's train split and `heldout.pt` its own validation split (distill_corpus.split, by item id
hash): the curve the trainers report on, NOT the issue's held-out sets, which no trainer sees.
The meta records the folder, the items used and the split.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from specserve.core.engine import Engine, EngineConfig, GenerationRequest
from specserve.model.transformer import Transformer
from specserve.core.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))
import distill_corpus  # noqa: E402 — a distill_data.py folder as training sequences
import heldout  # noqa: E402 — the guard distill_corpus re-runs on load


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
def run_target(target: Transformer, rows: list[list[int]], *, top_k: int, batch: int, desc: str,
               bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Equal-length rows → (tokens, hidden f16, top ids, top logits f16), one causal forward each.
    bf16: the forward under bf16 autocast (about 2x faster on CPUs with AMX / AVX512-BF16; the
    labels are then the target's bf16 forward's, as train_eagle3 --bf16 learns from)."""
    tokens = torch.tensor(rows)  # [N, T]
    hidden, ids, vals = [], [], []
    for i in tqdm(range(0, len(rows), batch), desc=desc, unit="batch"):
        from specserve.core.forward import ForwardBatch  # noqa: PLC0415 — keeps the module import light

        x = tokens[i:i + batch]
        B, T = x.shape
        positions = torch.arange(T).expand(B, T)
        mask = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
        zero = torch.zeros(B, dtype=torch.long)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            h = target.forward(ForwardBatch(x, positions, zero, zero, mask), cache=None).hidden  # [B, T, D]
            logits = target.logits(h).float()  # [B, T, V]
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


def cached(path: Path, want: dict, make: Callable[[], DistillCache]) -> DistillCache:
    """The cache at `path` if it was built with the settings `want`, else make and save it."""
    if path.is_file():
        state = torch.load(path, weights_only=False)
        if state["want"] == want:
            return DistillCache(**state["cache"])
        print(f"{path}: built with other settings; rebuilding", file=sys.stderr)
    cache = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"want": want, "cache": cache.__dict__}, path)
    print(json.dumps(cache.meta), file=sys.stderr)
    return cache


def load_or_build(path: Path, target: Transformer, tokenizer, split: str, **kw) -> DistillCache:
    """The demo-corpus cache of `split` at `path` (built when missing or built otherwise)."""
    want = {"split": split, **{k: v for k, v in kw.items() if k != "batch"}}
    return cached(path, want, lambda: build(target, tokenizer, split, **kw))


# -- a self-distillation folder ------------------------------------------------------------------

def distill_splits(folders: Sequence[Path], *, share: float, max_items: int | None = None
                   ) -> tuple[list[distill_corpus.DistillSequence], list[distill_corpus.DistillSequence]]:
    """(train, validation) items of one or more distill_data.py folders: their finished items end
    to end in the order given, the first `max_items` of them (all when None; each plan is shuffled,
    so a prefix is a mixed sample), guarded against the held-out sets again, split by item id hash.
    An item id found in two folders is refused: the same folder given twice, or two plans drawn
    from the same files (the second should be planned with distill_data --avoid-plan-of)."""
    guard = heldout.HeldoutGuard(heldout.load_all())
    seqs: list[distill_corpus.DistillSequence] = []
    found_in: dict[str, Path] = {}
    for folder in folders:
        got = distill_corpus.load(folder, guard)
        if not got:
            raise SystemExit(f"{folder}: no finished items")
        for s in got:
            if s.id in found_in:
                raise SystemExit(f"item {s.id} is in both {found_in[s.id]} and {folder}: give a folder once, "
                                 f"and plan a second folder with distill_data.py --avoid-plan-of the first")
            found_in[s.id] = folder
        seqs += got
    seqs = seqs[:max_items] if max_items is not None else seqs
    return distill_corpus.split(seqs, share)


def folders_meta(folders: Sequence[Path]) -> list[str]:
    """The folders as a cache's meta records them (and compares them on reuse)."""
    return [Path(f).as_posix() for f in folders]


def add_distill_args(ap: argparse.ArgumentParser) -> None:
    """--distill-dir (repeatable), --validation-share, --max-items: the same in every trainer."""
    ap.add_argument("--distill-dir", type=Path, action="append", default=[], metavar="DIR",
                    help="train on a training/distill_data.py output folder (read only; its finished shards) "
                         "instead of the demo corpus; repeatable: the folders' items end to end, in order")
    ap.add_argument("--validation-share", type=float, default=0.05,
                    help="--distill-dir: the items left out of training (the validation split, by id hash)")
    ap.add_argument("--max-items", type=int, default=None,
                    help="--distill-dir: only the first N finished items of the folders, in order (default: all)")


def packed_windows(seqs: list[distill_corpus.DistillSequence], length: int) -> list[list[int]]:
    """The items' prompt + response ids end to end (in order), cut into consecutive windows of
    `length` tokens; the shorter rest is dropped. A window may span two items, as train_eagle3's
    do: its labels are the target's forward on the window itself, so they stay the target's own."""
    stream = [t for s in seqs for t in s.tokens]
    return [stream[i:i + length] for i in range(0, len(stream) - length + 1, length)]


def items_digest(seqs: list[distill_corpus.DistillSequence]) -> str:
    """Names the exact items (ids and tokens) a cache was built from: a grown folder rebuilds it."""
    h = hashlib.sha1()
    for s in seqs:
        h.update(json.dumps([s.id, s.response_start, s.tokens]).encode())
    return h.hexdigest()


def build_distill(target: Transformer, seqs: list[distill_corpus.DistillSequence], split: str, *,
                  length: int, top_k: int, source: dict, batch: int = 8, bf16: bool = False) -> DistillCache:
    """The cache of one side of a distill folder's split: its packed windows through the target."""
    t0 = time.time()
    rows = packed_windows(seqs, length)
    if not rows:
        raise SystemExit(f"the {split} split holds fewer than {length} tokens: lower --length or add items")
    tokens, hidden, ids, vals = run_target(target, rows, top_k=top_k, batch=batch, desc=f"target forward ({split})",
                                           bf16=bf16)
    d = distill_corpus.describe(seqs)
    meta = {"split": split, **source, "items": d["items"], "sampled_items": d["sampled"],
            "item_tokens": d["tokens"], "response_tokens": d["response_tokens"], "by_source": d["by_source"],
            "distill_windows": len(rows), "corpus_windows": 0, "greedy_continuations": 0, "length": length,
            "top_k": top_k, "tokens": tokens.numel(), "wall_time_s": round(time.time() - t0, 1)}
    return DistillCache(tokens, hidden, ids, vals, meta)


def load_or_build_distill(work_dir: Path, target: Transformer, folders: Sequence[Path], *, share: float,
                          max_items: int | None, length: int, top_k: int, batch: int = 8,
                          bf16: bool = False) -> None:
    """train.pt (the folders' train split) and heldout.pt (their validation split) in `work_dir`."""
    train, val = distill_splits(folders, share=share, max_items=max_items)
    source = {"distill_dirs": folders_meta(folders), "validation_share": share, "max_items": max_items,
              "split_by": "distill_corpus.split (item id hash)", "bf16_autocast": bf16}
    for file, split, seqs in (("train.pt", "train", train), ("heldout.pt", "validation", val)):
        want = {"split": split, **source, "items_sha1": items_digest(seqs), "length": length, "top_k": top_k}
        cached(work_dir / file, want, lambda seqs=seqs, split=split: build_distill(
            target, seqs, split, length=length, top_k=top_k, source=source, batch=batch, bf16=bf16))


def main(argv: list[str] | None = None) -> None:

    from tokenizers import Tokenizer

    from specserve.model.transformer import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--work-dir", type=Path, required=True, help="writes train.pt and heldout.pt here")
    add_distill_args(ap)   # heldout.pt holds the validation split
    ap.add_argument("--windows", type=int, default=2000, help="demo corpus: train-split corpus windows")
    ap.add_argument("--prompts", type=int, default=256, help="demo corpus: train-split prompts continued greedily")
    ap.add_argument("--heldout-windows", type=int, default=200, help="demo corpus")
    ap.add_argument("--heldout-prompts", type=int, default=40, help="demo corpus")
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16", action="store_true",
                    help="--distill-dir: the target forward under bf16 autocast (about 2x faster on CPUs with "
                         "AMX / AVX512-BF16; the cache then holds the bf16 forward's outputs, in its meta)")
    args = ap.parse_args(argv)
    if args.bf16 and not args.distill_dir:
        ap.error("--bf16 is for --distill-dir caches")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model(args.target)
    if args.distill_dir:
        load_or_build_distill(args.work_dir, target, args.distill_dir, share=args.validation_share,
                              max_items=args.max_items, length=args.length, top_k=args.top_k, bf16=args.bf16)
        return
    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    kw = dict(length=args.length, top_k=args.top_k, seed=args.seed)
    load_or_build(args.work_dir / "train.pt", target, tokenizer, "train", n_windows=args.windows,
                  n_prompts=args.prompts, **kw)
    load_or_build(args.work_dir / "heldout.pt", target, tokenizer, "heldout", n_windows=args.heldout_windows,
                  n_prompts=args.heldout_prompts, **kw)



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
    ap.add_argument("--stop-at", type=int, default=None,
                    help="checkpoint and exit at this step (to split a long run; rerun to resume)")
    ap.add_argument("--accept-prompts", type=int, default=8, help="held-out benchmark prompts for the "
                    "in-process acceptance figure (evaluation only)")
    ap.add_argument("--accept-chat", type=Path, default=None,
                    help="take the acceptance prompts from this held-out chat set (jsonl of messages, e.g. "
                         "models/smollm2/heldout_chat.jsonl), rendered by the target's chat template")
    ap.add_argument("--accept-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def heldout_benchmark_prompts(tokenizer, n: int) -> list[list[int]]:
    """The first n benchmark prompts (models/demo/heldout_prompts.jsonl): evaluation only."""
    lines = (ROOT / "models/demo/heldout_prompts.jsonl").read_text().splitlines()[:n]
    return [tokenizer.encode(json.loads(x)["prompt"]).ids for x in lines]


def acceptance_prompts(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    """The first --accept-prompts held-out prompts of the in-process acceptance figure (evaluation
    only): of --accept-chat rendered as the server renders chat, else the demo benchmark prompts."""
    if args.accept_chat is not None:
        from train_eagle3 import heldout_chat_prompts  # noqa: PLC0415 — pulls in transformers

        return heldout_chat_prompts(args.target, args.accept_chat)[:args.accept_prompts]
    return heldout_benchmark_prompts(tokenizer, args.accept_prompts)


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


def row_groups(meta: dict) -> dict[str, slice]:
    """The cache's rows by origin, for per-origin figures: a demo cache's corpus windows then greedy
    continuations; a distill folder's windows as one group."""
    if "distill_windows" in meta:
        return {"distill_windows": slice(0, None)}
    n = meta["corpus_windows"]
    return {"corpus_windows": slice(0, n), "greedy_continuations": slice(n, None)}


if __name__ == "__main__":
    main()
