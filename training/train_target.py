"""Train the bundled demo target: a small Llama-architecture causal LM on the stdlib corpus.

    python training/train_target.py --steps 640            # train (resumes from the last checkpoint)
    python training/train_target.py --steps 640 --export   # also write models/demo/target when done
    python training/train_target.py --export-only          # export the latest checkpoint as it is

Reproducible: the model init uses --seed, and batch k is drawn from a generator seeded with
(seed, k), so a resumed run sees exactly the batches an uninterrupted run would have seen.
Checkpoints (model + optimizer + step) go to checkpoints/demo_target/ (git-ignored); the loss log
is appended to models/demo/train_log.jsonl, which the model card's curve is drawn from.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules, run as a script
import corpus  # noqa: E402

REPO = corpus.REPO
TARGET_DIR = REPO / "models" / "demo" / "target"
CKPT_DIR = REPO / "checkpoints" / "demo_target"
DATA_DIR = REPO / "data"
LOG = REPO / "models" / "demo" / "train_log.jsonl"


def model_config(args: argparse.Namespace, vocab_size: int, eot_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.d_model,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.d_model // args.head_dim,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
    )


def token_stream(split: str, tokenizer) -> np.ndarray:
    """All documents of a split as one uint16 id stream: [eot] doc [eot] doc ...

    Cached under data/ (git-ignored), keyed by the tokenizer file's size so a retrained
    tokenizer does not reuse stale ids.
    """
    key = (TARGET_DIR / "tokenizer.json").stat().st_size
    cache = DATA_DIR / f"demo_{split}_{key}.npy"
    if cache.exists():
        return np.load(cache)
    eot = tokenizer.convert_tokens_to_ids(corpus.EOT)
    ids: list[int] = []
    for doc in tqdm(corpus.documents(corpus.load_manifest(), split), desc=f"tokenize {split}"):
        ids.append(eot)
        ids.extend(tokenizer.encode(doc.text, add_special_tokens=False))
    arr = np.asarray(ids, dtype=np.uint16)  # vocab 8192 fits
    DATA_DIR.mkdir(exist_ok=True)
    np.save(cache, arr)
    return arr


def batch_at(stream: np.ndarray, step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number `step`: random windows drawn from a generator seeded by (seed, step)."""
    g = np.random.default_rng([args.seed, step])
    starts = g.integers(0, len(stream) - args.seq_len - 1, size=args.batch)
    x = np.stack([stream[s : s + args.seq_len + 1] for s in starts]).astype(np.int64)
    x = torch.from_numpy(x)  # [B, T+1]
    return x[:, :-1], x[:, 1:]  # inputs [B, T], targets [B, T]


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to 10% of the peak.

    With --rewarm-from S (continuing a finished run for more steps), steps from S on get a
    second cycle instead: a short linear rewarm to --rewarm-lr, then cosine down to the same
    floor (10% of --lr) at --steps. Steps before S keep the first cycle, which ended at S.
    """
    floor = 0.1 * args.lr
    if args.rewarm_from is not None and step >= args.rewarm_from:
        k = step - args.rewarm_from
        if k < args.rewarm_warmup:
            return floor + (args.rewarm_lr - floor) * (k + 1) / args.rewarm_warmup
        t = (k - args.rewarm_warmup) / max(1, args.steps - args.rewarm_from - args.rewarm_warmup)
        return floor + (args.rewarm_lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
    end = args.rewarm_from if args.rewarm_from is not None else args.steps
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, end - args.warmup)
    return floor + (args.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    # No weight decay on norms (1-D weights): decaying a gain towards 0 fights the normalisation.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def latest_checkpoint() -> Path | None:
    ckpts = sorted(CKPT_DIR.glob("step_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    return ckpts[-1] if ckpts else None


def save_checkpoint(model, opt, step: int, args: argparse.Namespace, elapsed: float) -> None:
    CKPT_DIR.mkdir(parents=True, exist_ok=True)
    path = CKPT_DIR / f"step_{step:06d}.pt"
    tmp = path.with_suffix(".tmp")
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "elapsed_s": elapsed}
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a kill mid-save never leaves a truncated "latest"
    for old in sorted(CKPT_DIR.glob("step_*.pt"))[:-2]:  # keep the last two
        old.unlink()


def truncate_log(step: int) -> None:
    """On resume, drop log lines past the checkpoint so the curve has no duplicated steps."""
    if not LOG.exists():
        return
    lines = [ln for ln in LOG.read_text().splitlines() if ln and json.loads(ln)["step"] < step]
    LOG.write_text("".join(ln + "\n" for ln in lines))


@torch.no_grad()
def heldout_loss(model, stream: np.ndarray, args: argparse.Namespace, n_windows: int = 8) -> float:
    """Mean loss on a fixed set of held-out windows (cheap progress signal, not the card figure)."""
    model.eval()
    stride = (len(stream) - args.seq_len - 1) // n_windows
    x = np.stack([stream[i * stride : i * stride + args.seq_len + 1] for i in range(n_windows)]).astype(np.int64)
    x = torch.from_numpy(x)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
        logits = model(input_ids=x[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    model.train()
    return loss.item()


def export(model: LlamaForCausalLM, tokenizer_dir: Path, out: Path) -> None:
    """Write the HF folder: bf16 safetensors + config + generation config (tokenizer is already there)."""
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)  # also records dtype "bfloat16" in config.json
    model.save_pretrained(out, safe_serialization=True)
    # transformers 5 writes rope_theta only inside "rope_parameters"; older readers (transformers
    # 4.x, other runtimes) look for the top-level key, and transformers 5 accepts both.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", model.config.rope_parameters["rope_theta"]
                   if getattr(model.config, "rope_parameters", None) else model.config.rope_theta)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    eot = model.config.eos_token_id
    GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, do_sample=False).save_pretrained(out)
    print(f"exported to {out} (tokenizer files from {tokenizer_dir})")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=640)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rewarm-from", type=int, default=None,
                    help="continue a run that finished at this step with a second warmup+cosine cycle")
    ap.add_argument("--rewarm-lr", type=float, default=5e-4)
    ap.add_argument("--rewarm-warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                    help="bf16 autocast for matmuls (fp32 master weights); much faster on AVX512-BF16 CPUs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--export", action="store_true", help="export to models/demo/target after the last step")
    ap.add_argument("--export-only", action="store_true", help="export the latest checkpoint and exit")
    ap.add_argument("--out", type=Path, default=TARGET_DIR)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(TARGET_DIR)
    eot = tok.convert_tokens_to_ids(corpus.EOT)
    config = model_config(args, len(tok), eot)
    model = LlamaForCausalLM(config)
    opt = make_optimizer(model, args)
    n_params = sum(p.numel() for p in model.parameters())

    start, elapsed = 0, 0.0
    ckpt = latest_checkpoint()
    if ckpt is not None:
        state = torch.load(ckpt, map_location="cpu")
        saved = {k: state["args"][k] for k in ("d_model", "layers", "ffn", "kv_heads", "head_dim", "seed")}
        mine = {k: vars(args)[k] for k in saved}
        if saved != mine:
            sys.exit(f"checkpoint {ckpt} was made with {saved}, not {mine}; move it away to start afresh")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, elapsed = state["step"], state["elapsed_s"]
        print(f"resumed from {ckpt} at step {start} ({elapsed:.0f} s already trained)")
    if args.export_only:
        if ckpt is None:
            sys.exit(f"no checkpoint under {CKPT_DIR}")
        export(model, TARGET_DIR, args.out)
        return

    train = token_stream("train", tok)
    held = token_stream("heldout", tok)
    print(f"params {n_params / 1e6:.2f} M; train {len(train):,} tokens; held-out {len(held):,} tokens; "
          f"{args.steps} steps x {args.batch * args.seq_len} tokens = {args.steps * args.batch * args.seq_len:,} tokens")
    truncate_log(start)
    model.train()
    t_last = time.time()
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="train", dynamic_ncols=True)
    with LOG.open("a") as log:
        for step in bar:
            x, y = batch_at(train, step, args)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                logits = model(input_ids=x).logits  # [B, T, V]
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip).item()
            opt.step()

            now = time.time()
            elapsed += now - t_last
            t_last = now
            rec = {"step": step, "loss": round(loss.item(), 4), "lr": round(lr_at(step, args), 7),
                   "grad_norm": round(gnorm, 3), "tokens": (step + 1) * args.batch * args.seq_len,
                   "elapsed_s": round(elapsed, 1)}
            done = step + 1
            if done % args.eval_every == 0 or done == args.steps:
                rec["heldout_loss"] = round(heldout_loss(model, held, args), 4)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{rec['tokens'] / max(elapsed, 1e-9):.0f}")
            if done % args.ckpt_every == 0 or done == args.steps:
                save_checkpoint(model, opt, done, args, elapsed)
                t_last = time.time()  # checkpoint time is not training time
    print(f"trained {args.steps} steps in {elapsed:.0f} s")
    if args.export:
        export(model, TARGET_DIR, args.out)


if __name__ == "__main__":
    main()
