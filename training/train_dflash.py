"""Train a DFlash block drafter for any supported target, from the target itself.

Self-distillation (no labels from anywhere but the target):

  data     sequences of corpus text (the demo corpus' train split, or --text-file) and the
           target's OWN greedy continuations of corpus prompts; or (--distill-dir) a
           training/distill_data.py folder's train split, prompt + response of each item end to
           end in windows of --seq-len, as training/distill_cache.py cuts them (its validation
           split is left out; the responses are already the target's own, none are generated);
  cache    one target forward per sequence, kept for the whole run: the target's features
           (final hidden state + the residual streams after the drafter's target layers, fp16)
           and its greedy choice at every position (argmax);
  blocks   per sequence, random anchor positions p; the block [t_p, mask × (B-1)] is drafted
           over the memory the server would hold after p tokens (methods/dflash/memory.batched_views:
           the same ring, anchors and pool, computed for many positions at once);
  labels   block position k predicts the target's greedy token after t_p..t_{p+k-1}: the argmax
           at p+k-1, valid only while the sequence itself follows the target's greedy chain
           (t_{p+j} = argmax at p+j-1 for j < k) — exactly what verification would accept;
  loss     cross-entropy per block position with weight γ^(k-1) (position-decayed: early
           positions gate every later one), averaged over valid positions; block size cycles
           through --block-sizes so one drafter serves 4, 8 and 16.

Deterministic (--seed), resumable (checkpoints in --work-dir every --ckpt-every steps; the cache
is kept there too), with progress bars. Example (the demo drafter):

    python training/train_dflash.py --target models/demo/target --out models/demo/dflash \\
        --work-dir checkpoints/dflash-demo --steps 2000 --threads 1
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specserve.core.engine import Engine, EngineConfig, GenerationRequest
from specserve.model.transformer import Transformer, load_model
from specserve.methods.dflash.drafter import DFlashDrafter, dflash_config_for, init_from_target, save_dflash
from specserve.methods.dflash.proposer import DFlashProposer
from specserve.methods.dflash.memory import batched_views
from specserve.methods.ngram.proposer import NgramProposer
from specserve.core.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))
from run_checkpoint import resume, save  # noqa: E402 — the resumable checkpoint the trainers share
from distill_cache import add_distill_args, distill_splits, folders_meta, items_digest, packed_windows  # noqa: E402 — a distill folder's rows
from train_eagle import causal_batch, corpus_token_stream  # noqa: E402 — shared helpers


# -- data and cache ------------------------------------------------------------------------------

def greedy_continuations(target: Transformer, stream: list[int], *, n: int, prompt_len: int, new_tokens: int,
                         seed: int, batch: int = 16) -> list[list[int]]:
    rng = random.Random(seed)
    engine = Engine(target, EngineConfig(max_num_seqs=batch, max_model_len=prompt_len + new_tokens + 1),
                    eos_token_ids=())
    starts = [rng.randrange(0, len(stream) - prompt_len) for _ in range(n)]
    out = []
    for i in tqdm(range(0, n, batch), desc="target continuations", unit="batch"):
        reqs = [GenerationRequest(str(j), stream[s:s + prompt_len], SamplingParams(max_tokens=new_tokens))
                for j, s in enumerate(starts[i:i + batch])]
        got = engine.generate(reqs)
        out += [r.prompt_ids + got[r.request_id].new_token_ids for r in reqs]
    return out


@torch.inference_mode()
def target_cache(target: Transformer, seqs: torch.Tensor, layers: tuple[int, ...], batch: int = 8) -> dict:
    """seqs [N, T] → features [N, T, (1+L) D] fp16 (final hidden, then each layer's residual) and
    the target's argmax [N, T] (int16, or int32 for a vocabulary past int16's range: SmolLM2's 49 152)."""
    id_dtype = torch.int16 if target.cfg.vocab_size <= torch.iinfo(torch.int16).max + 1 else torch.int32
    feats, argmax = [], []
    for i in tqdm(range(0, len(seqs), batch), desc="target features", unit="batch"):
        x = seqs[i:i + batch]
        out = target.forward(causal_batch(x), cache=None, hidden_layers=layers)
        feats.append(torch.cat([out.hidden] + [out.layer_hidden[l] for l in layers], -1).half())
        argmax.append(target.logits(out.hidden).argmax(-1).to(id_dtype))
    return {"tokens": seqs, "features": torch.cat(feats), "argmax": torch.cat(argmax)}


# -- training --------------------------------------------------------------------------------------

def block_labels(tokens: torch.Tensor, argmax: torch.Tensor, p: torch.Tensor, B: int, gamma: float):
    """tokens, argmax [S, T]; p [S, A] → labels [S·A, B-1], weights [S·A, B-1] (0 = not valid)."""
    S, T = tokens.shape
    A = p.shape[1]
    seq = torch.arange(S).repeat_interleave(A)
    pf = p.reshape(-1)
    k = torch.arange(1, B)                                      # block positions 1..B-1
    at = pf[:, None] + k[None, :] - 1                           # argmax index predicting t_{p+k}
    inside = at <= T - 1
    labels = argmax[seq[:, None], at.clamp(max=T - 1)].long()
    # the chain is the target's while t_{p+j} == argmax[p+j-1] for j = 1..k-1
    nxt = (pf[:, None] + k[None, :]).clamp(max=T - 1)          # index p+k
    follows = (tokens[seq[:, None], nxt] == argmax[seq[:, None], nxt - 1].long()) & (pf[:, None] + k[None, :] <= T - 1)
    chain_ok = torch.ones_like(follows)
    chain_ok[:, 1:] = torch.cumprod(follows[:, :-1].int(), dim=1).bool()
    weights = (gamma ** (k - 1).float())[None, :] * (inside & chain_ok)
    return labels, weights


def train_step(drafter: DFlashDrafter, target: Transformer, cache: dict, opt, *, step: int, seed: int,
               seqs_per_step: int, anchors: int, block: int, gamma: float) -> dict:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    N, T = cache["tokens"].shape
    idx = torch.randint(0, N, (seqs_per_step,), generator=g)
    tokens, argmax = cache["tokens"][idx], cache["argmax"][idx]
    p = torch.randint(1, T - 1, (seqs_per_step, anchors), generator=g)     # pending-token indices
    fused = drafter.fuse_features(cache["features"][idx].float())           # [S, T, D]
    v = batched_views(fused, p, drafter.cfg.window, drafter.pool)
    ctx, valid = drafter.context(v.ring, v.ring_valid, v.anchors, v.anchor_valid, v.pool)
    first = tokens.gather(1, p).reshape(-1)                                 # t_p per block
    with torch.no_grad():
        first_embed = target.embed_tokens(first)
    hidden = drafter.run_block(first_embed, v.ring[:, -1], ctx, valid, block)  # [S·A, B, D]
    logits = target.logits(hidden[:, :-1])                                  # [S·A, B-1, V]
    labels, weights = block_labels(tokens, argmax, p, block, gamma)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    loss = (ce * weights.reshape(-1)).sum() / weights.sum().clamp_min(1e-6)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
    opt.step()
    with torch.no_grad():
        valid_pos = weights > 0
        hit = (logits.argmax(-1) == labels) & valid_pos
        # teacher-forced acceptance length estimate: 1 + leading run of hits over valid blocks
        run = torch.cumprod(hit.int(), dim=1).sum(1).float()
        top1 = hit.sum(0).float() / valid_pos.sum(0).clamp_min(1)
    return {"step": step + 1, "block": block, "loss": round(loss.item(), 5),
            "top1_pos1": round(top1[0].item(), 4), "accept_len_tf": round(1 + run.mean().item(), 4)}


@torch.inference_mode()
def heldout_acceptance(drafter: DFlashDrafter, target: Transformer, prompts: list[list[int]], kinds: list[str],
                       *, new_tokens: int, block_size: int) -> dict:
    """Greedy generation through the engine on held-out prompts: mean acceptance length by kind,
    and whether every output equals plain decoding."""
    longest = max(len(p) for p in prompts) + new_tokens + block_size + 2
    proposer = DFlashProposer(drafter, target, max_num_seqs=8, block_size=block_size)
    engine = Engine(target, EngineConfig(max_num_seqs=8, max_model_len=longest, max_draft_len=block_size - 1),
                    {"dflash": proposer, "ngram": NgramProposer()})
    by_kind: dict[str, list[int]] = {}
    same = True
    for i, (p, kind) in enumerate(tqdm(list(zip(prompts, kinds)), desc="held-out acceptance", unit="prompt")):
        params = SamplingParams(max_tokens=new_tokens)
        got = engine.generate([GenerationRequest(f"d{i}", p, params, "dflash"),
                               GenerationRequest(f"n{i}", p, params, "none")])
        st = got[f"d{i}"].stats
        same &= got[f"d{i}"].new_token_ids == got[f"n{i}"].new_token_ids
        acc = by_kind.setdefault(kind, [0, 0])
        acc[0] += st.accepted_tokens + st.steps
        acc[1] += st.steps
    out = {k: round(a / s, 4) for k, (a, s) in by_kind.items()}
    tot = [sum(v[0] for v in by_kind.values()), sum(v[1] for v in by_kind.values())]
    out["all"] = round(tot[0] / tot[1], 4)
    out["outputs_equal_plain"] = bool(same)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--text-file", type=Path, default=None, help="train on this text instead of the demo corpus")
    add_distill_args(ap)
    ap.add_argument("--heldout-chat", type=Path, default=None,
                    help="held-out acceptance on a chat set (jsonl of messages, e.g. models/smollm2/heldout_chat.jsonl), "
                         "rendered by the target's chat template: evaluation only")
    ap.add_argument("--work-dir", type=Path, default=None, help="cache + checkpoints (default: checkpoints/dflash-<name>)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--corpus-seqs", type=int, default=640, help="corpus windows in the cache")
    ap.add_argument("--self-seqs", type=int, default=192, help="target greedy continuations in the cache")
    ap.add_argument("--self-prompt-len", type=int, default=48)
    ap.add_argument("--seqs-per-step", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=8, help="blocks per sequence per step")
    ap.add_argument("--block-sizes", default="8,16,8,4", help="block size of step i: the list, cycled")
    ap.add_argument("--gamma", type=float, default=0.85, help="loss weight of block position k: gamma^(k-1)")
    ap.add_argument("--layers", type=int, default=3, help="drafter layers")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--pool-slots", type=int, default=64)
    ap.add_argument("--pool-rank", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=8, help="the served default block size")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--stop-at", type=int, default=None, help="checkpoint and exit at this step (rerun to resume)")
    ap.add_argument("--heldout-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.text_file is not None and args.distill_dir:
        ap.error("--text-file and --distill-dir are two data sources: give one")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from tokenizers import Tokenizer

    target = load_model(args.target).requires_grad_(False)
    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    work = args.work_dir or ROOT / "checkpoints" / f"dflash-{args.out.name}"
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    cfg = dflash_config_for(target, num_layers=args.layers, window=args.window, pool_slots=args.pool_slots,
                            pool_rank=args.pool_rank, block_size=args.block_size)

    cache_file = work / "cache.pt"
    items, data = [], None   # data: what a distill folder's cache was built from (None: the corpus path)
    if args.distill_dir:
        items, _ = distill_splits(args.distill_dir, share=args.validation_share, max_items=args.max_items)
        data = {"distill_dirs": folders_meta(args.distill_dir), "validation_share": args.validation_share,
                "max_items": args.max_items, "train_items": len(items), "items_sha1": items_digest(items),
                "seq_len": args.seq_len}
    cache = torch.load(cache_file, weights_only=False) if cache_file.is_file() else None
    if cache is not None and cache.get("data") != data:
        print(f"{cache_file}: built from other data; rebuilding", file=sys.stderr)
        cache = None
    if cache is None:
        T = args.seq_len
        if args.distill_dir:
            rows, num_self = packed_windows(items, T), 0
            if not rows:
                raise SystemExit(f"{', '.join(folders_meta(args.distill_dir))}: the train split holds fewer than {T} tokens")
        else:
            stream = corpus_token_stream(tokenizer, args.text_file, "train")
            rng = random.Random(args.seed)
            rows = [stream[s:s + T] for s in (rng.randrange(0, len(stream) - T) for _ in range(args.corpus_seqs))]
            rows += greedy_continuations(target, stream, n=args.self_seqs, prompt_len=args.self_prompt_len,
                                         new_tokens=T - args.self_prompt_len, seed=args.seed + 1)
            num_self = args.self_seqs
        cache = target_cache(target, torch.tensor(rows), cfg.target_layers)
        cache["num_self"] = num_self
        if data is not None:
            cache["data"] = data
        torch.save(cache, cache_file)
    print(f"cache: {tuple(cache['tokens'].shape)} sequences×tokens, features {tuple(cache['features'].shape)}",
          file=sys.stderr)

    drafter = DFlashDrafter(cfg)
    init_from_target(drafter, target)
    drafter.train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / max(1, args.steps)))
    step, log_rows = 0, []
    ckpt = work / "train.pt"
    state = resume(ckpt, "drafter", drafter, opt, sched)
    if state:
        step, log_rows = state["step"], state["log"]
    sizes = [int(b) for b in args.block_sizes.split(",")]
    stop_at = min(args.steps, args.stop_at or args.steps)
    bar = tqdm(total=args.steps, initial=step, desc="DFlash drafter", unit="step")
    while step < stop_at:
        row = train_step(drafter, target, cache, opt, step=step, seed=args.seed, seqs_per_step=args.seqs_per_step,
                         anchors=args.anchors, block=sizes[step % len(sizes)], gamma=args.gamma)
        sched.step()
        step += 1
        log_rows.append(row)
        bar.update(1)
        bar.set_postfix(loss=f"{row['loss']:.3f}", top1=f"{row['top1_pos1']:.3f}", acc=f"{row['accept_len_tf']:.2f}")
        if step % args.ckpt_every == 0 or step == stop_at:
            save(ckpt, "drafter", drafter, opt, sched, step, log=log_rows)
    bar.close()
    if step < args.steps:
        print(f"stopped at step {step} of {args.steps}; rerun the same command to resume", file=sys.stderr)
        return
    drafter.eval().requires_grad_(False)
    save_dflash(drafter, args.out)

    prompts_file = ROOT / "models/demo/heldout_prompts.jsonl"
    heldout = {}
    prompts = None
    if args.heldout_chat is not None:
        from train_eagle3 import heldout_chat_prompts

        prompts = heldout_chat_prompts(args.target, args.heldout_chat)
        kinds = [json.loads(line)["kind"] for line in args.heldout_chat.read_text(encoding="utf-8").splitlines()
                 if line.strip()]
    elif args.text_file is None and not args.distill_dir and prompts_file.is_file():
        rows = [json.loads(line) for line in prompts_file.read_text().splitlines()]
        prompts, kinds = [tokenizer.encode(r["prompt"]).ids for r in rows], [r["kind"] for r in rows]
    if prompts is not None:
        from specserve.methods.dflash.drafter import load_dflash

        served = load_dflash(args.out, target)   # the stored (bf16) weights, as the server loads them
        heldout = heldout_acceptance(served, target, prompts, kinds,
                                     new_tokens=args.heldout_tokens, block_size=args.block_size)
    else:
        heldout = {"all": None, "note": "no held-out prompts for a custom corpus"}
    last = log_rows[-40:]
    summary = {"target": Path(args.target).as_posix(), "steps": args.steps, "seq_len": args.seq_len,
               "cache_sequences": int(cache["tokens"].shape[0]), "self_continuations": int(cache["num_self"]),
               **({"distill": cache["data"]} if "data" in cache else {}),
               "seqs_per_step": args.seqs_per_step, "anchors_per_seq": args.anchors, "block_sizes": sizes,
               "gamma": args.gamma, "config": cfg.to_dict(), "seed": args.seed,
               "parameters": sum(p.numel() for p in drafter.parameters()),
               "wall_time_s": round(time.time() - t_start, 1),
               "final_loss": round(sum(r["loss"] for r in last) / len(last), 4),
               "final_top1_pos1": round(sum(r["top1_pos1"] for r in last) / len(last), 4),
               "heldout_acceptance_length": heldout, "command": " ".join(sys.argv)}
    (args.out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log_rows))
    plot_curve(log_rows, args.out / "training_curve.png")
    print(json.dumps(summary, indent=2))


def plot_curve(rows: list[dict], path: Path, smooth: int = 25) -> None:
    """Loss and teacher-forced position-1 top-1 against step (moving average over `smooth` steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def avg(key):
        vals = [r[key] for r in rows]
        return [sum(vals[max(0, i - smooth + 1): i + 1]) / len(vals[max(0, i - smooth + 1): i + 1])
                for i in range(len(vals))]

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    ax[0].plot(steps, avg("loss"))
    ax[0].set(xlabel="step", ylabel="block CE (position-weighted)", title="loss")
    ax[1].plot(steps, avg("top1_pos1"), label="top-1, block position 1")
    ax[1].plot(steps, [a - 1 for a in avg("accept_len_tf")], label="accepted per block (teacher-forced)")
    ax[1].set(xlabel="step", title="agreement with the target")
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
