"""Train a small draft model (a few-layer Llama, the target's tokenizer) distilled from the target.

The student is an ordinary tied-embedding Llama (HF layout, loads with specserve.model.transformer.load_model)
whose embedding starts as the target's embedding projected onto its top principal directions
(E_draft = E_target · P, P the top `hidden` right singular vectors of E_target): since both LMs
read logits off their embedding, the student starts able to express the target's output space.
--init-from-target instead makes the student the target's own architecture cut to a few layers:
its embedding, --layers of its decoder layers (--target-layers, default evenly spaced from the
first to the last), its final norm and its LM head (tied as the target's config says), so the
student starts as the target with layers skipped (all layers kept: exactly the target). Its
embedding and LM head are the target's vocabulary; --freeze-embedding keeps them the target's
bytes (and skips their optimizer state, most of the memory for a 49 k vocabulary).
Loss: cross-entropy against the target's renormalised top-K distribution at every position
(soft labels from the distillation cache, training/distill_cache.py: train-split corpus windows +
the target's greedy continuations of train-split prompts, or a self-distillation folder's windows
with --distill-dir there). No target forward during training.

Reported: held-out teacher-forced top-1 agreement with the target, and the draft model's
acceptance length in process (engine, spec_method draft vs none, greedy, held-out benchmark
prompts) with output equality.

Deterministic (--seed), resumable (--work-dir/draft.pt every --ckpt-every steps; rerun the same
command), a tqdm bar, a jsonl log per step. The demo draft model:

    python training/distill_cache.py --target models/demo/target --work-dir checkpoints/distill --threads 1
    python training/train_draft.py --target models/demo/target --cache checkpoints/distill \
        --out models/demo/draft --work-dir checkpoints/draft-demo --steps 800 --batch 16 --threads 1
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distill_cache import (DistillCache, acceptance_in_process, distilled_trainer_args,  # noqa: E402
                           acceptance_prompts, row_groups)
from run_checkpoint import resume, save  # noqa: E402
from train_eagle import causal_batch  # noqa: E402 — the whole-sequence causal batch

from specserve.model.transformer import ModelConfig, Transformer, load_model  # noqa: E402
from specserve.methods.draft.drafter import save_draft_model  # noqa: E402
from specserve.methods.draft.proposer import DraftModelProposer  # noqa: E402


def load_cache(path: Path) -> DistillCache:
    return DistillCache(**torch.load(path, weights_only=False)["cache"])


def draft_config(target: Transformer, *, hidden: int, layers: int, heads: int, kv_heads: int,
                 intermediate: int) -> ModelConfig:
    t = target.cfg
    return ModelConfig.from_hf({
        "model_type": "llama", "vocab_size": t.vocab_size, "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads, "rms_norm_eps": t.rms_norm_eps, "rope_theta": t.rope.theta,
        "max_position_embeddings": t.max_position_embeddings, "tie_word_embeddings": True,
        "bos_token_id": t.bos_token_id, "eos_token_id": list(t.eos_token_ids)})


def init_student(target: Transformer, cfg: ModelConfig, seed: int) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            p.data /= (2 * cfg.num_layers) ** 0.5  # GPT-2 style: residual branches start small
    with torch.no_grad():
        E = target.embed_tokens.weight.float()  # [V, Dt]
        _, _, Vh = torch.linalg.svd(E, full_matrices=False)
        model.embed_tokens.weight.copy_(E @ Vh[:cfg.hidden_size].T)  # [V, D]
    model.lm_head.weight = model.embed_tokens.weight
    return model


def spaced_layers(num_layers: int, n: int) -> list[int]:
    """n layer ids evenly spaced over 0..num_layers-1, first and last included (n = 1: the last)."""
    if not 1 <= n <= num_layers:
        raise ValueError(f"cannot keep {n} of the target's {num_layers} layers")
    if n == 1:
        return [num_layers - 1]
    return [round(i * (num_layers - 1) / (n - 1)) for i in range(n)]


def student_from_target(target: Transformer, layer_ids: list[int]) -> Transformer:
    """The target cut to `layer_ids` (in that order): its config with fewer layers, its embedding,
    those decoder layers, its final norm, its LM head tied or not as the target's is."""
    c = target.cfg
    if c.model_type != "llama" or c.attention_bias or c.sliding_window or c.rope.rope_type != "default":
        raise SystemExit("--init-from-target makes Llama draft models (no attention bias, sliding window or "
                         f"RoPE scaling); the target is {c.model_type}")
    if any(not 0 <= i < c.num_layers for i in layer_ids):
        raise SystemExit(f"--target-layers {layer_ids}: the target has layers 0..{c.num_layers - 1}")
    model = Transformer(dataclasses.replace(c, num_layers=len(layer_ids))).to(target.dtype)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.embed_tokens.weight)
        if not c.tie_word_embeddings:
            model.lm_head.weight.copy_(target.lm_head.weight)
        model.norm.load_state_dict(target.norm.state_dict())
        for dst, i in zip(model.layers, layer_ids):
            dst.load_state_dict(target.layers[i].state_dict())
    return model


def student_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    return model.logits(model.forward(causal_batch(tokens), cache=None).hidden)  # [B, T, V]


@torch.no_grad()
def agreement(model: Transformer, cache: DistillCache, *, batch: int = 16) -> dict:
    """Teacher-forced top-1 agreement with the target over the cache, and per row origin."""
    hits = []
    for i in range(0, len(cache.tokens), batch):
        hits.append(student_logits(model, cache.tokens[i:i + batch]).argmax(-1) == cache.top_ids[i:i + batch, :, 0])
    h = torch.cat(hits)  # [N, T]
    return {"all": round(float(h.float().mean()), 4),
            **{name: round(float(h[rows].float().mean()), 4) for name, rows in row_groups(cache.meta).items()},
            "positions": h.numel()}


def main(argv: list[str] | None = None) -> None:
    ap = distilled_trainer_args(__doc__, steps=800, batch=16, batch_help="rows of the cache's length per step",
                                ckpt_every=50)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--max-draft-len", type=int, default=4)
    ap.add_argument("--init-from-target", action="store_true",
                    help="the target cut to --layers of its layers (its embedding, norm and LM head); "
                         "--hidden/--heads/--kv-heads/--intermediate are then the target's")
    ap.add_argument("--target-layers", type=int, nargs="+", default=None,
                    help="--init-from-target: the target's layers to keep, in order (default: --layers "
                         "evenly spaced, first and last included)")
    ap.add_argument("--freeze-embedding", action="store_true",
                    help="--init-from-target: keep the target's embedding and LM head as they are (not trained)")
    args = ap.parse_args(argv)
    if (args.target_layers or args.freeze_embedding) and not args.init_from_target:
        ap.error("--target-layers and --freeze-embedding go with --init-from-target")
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_model(args.target)
    train, heldout = load_cache(args.cache / "train.pt"), load_cache(args.cache / "heldout.pt")
    if args.init_from_target:
        layer_ids = args.target_layers or spaced_layers(target.cfg.num_layers, args.layers)
        model = student_from_target(target, layer_ids).train().requires_grad_(True)
        if args.freeze_embedding:
            model.embed_tokens.requires_grad_(False)
            model.lm_head.requires_grad_(False)
    else:
        layer_ids = None
        cfg = draft_config(target, hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                           intermediate=args.intermediate)
        model = init_student(target, cfg, args.seed).train().requires_grad_(True)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / max(1, args.steps)))

    args.work_dir.mkdir(parents=True, exist_ok=True)
    ckpt, log_file = args.work_dir / "draft.pt", args.work_dir / "train_log.jsonl"
    state = resume(ckpt, "model", model, opt, sched)
    step, elapsed = (state["step"], state["elapsed"]) if state else (0, 0.0)
    rows = [json.loads(x) for x in log_file.read_text().splitlines()] if log_file.is_file() else []
    log_file.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step))

    bar = tqdm(total=args.steps, initial=step, desc="draft model", unit="step")
    t0 = time.time()
    with log_file.open("a") as log:
        stop_at = min(args.steps, args.stop_at or args.steps)
        while step < stop_at:
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)  # per step: resumable
            idx = torch.randint(len(train.tokens), (args.batch,), generator=g)
            logits = student_logits(model, train.tokens[idx])  # [B, T, V]
            ids, teacher = train.top_ids[idx], train.top_logits[idx].float()  # [B, T, K]
            logq = logits.log_softmax(-1).gather(-1, ids)
            loss = -(teacher.softmax(-1) * logq).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            opt.step()
            sched.step()
            step += 1
            top1 = float((logits.argmax(-1) == ids[..., 0]).float().mean())
            log.write(json.dumps({"step": step, "loss": round(loss.item(), 5), "top1": round(top1, 4),
                                  "lr": sched.get_last_lr()[0]}) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{top1:.3f}")
            if step % args.ckpt_every == 0 or step == stop_at:
                log.flush()
                save(ckpt, "model", model, opt, sched, step, elapsed=elapsed + time.time() - t0)
    bar.close()
    if step < args.steps:
        print(f"stopped at step {step} of {args.steps}; rerun the same command to resume", file=sys.stderr)
        return
    elapsed += time.time() - t0
    model.eval().requires_grad_(False)
    save_draft_model(model, args.out, tokenizer_from=args.target)

    # Evaluate the model as saved (bf16 weights, loaded in fp32 as the engine serves it).
    from tokenizers import Tokenizer

    from specserve.methods.draft.drafter import load_draft_model

    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    saved = load_draft_model(args.out, target, tokenizer)
    agree = agreement(saved, heldout)
    prompts = acceptance_prompts(args, tokenizer)
    max_len = max(len(p) for p in prompts) + args.accept_new_tokens + 1
    proposer = DraftModelProposer(saved, max_num_seqs=4, max_model_len=max_len, max_draft_len=args.max_draft_len)
    accept = acceptance_in_process(target, "draft", proposer, prompts, new_tokens=args.accept_new_tokens,
                                   max_draft_len=args.max_draft_len)
    params = sum(p.numel() for p in saved.parameters())
    c = saved.cfg
    summary = {"target": args.target.as_posix(), "config": {"hidden": c.hidden_size, "layers": c.num_layers,
               "heads": c.num_heads, "kv_heads": c.num_kv_heads, "intermediate": c.intermediate_size},
               "init": ({"from_target_layers": layer_ids, "frozen_embedding": args.freeze_embedding}
                        if args.init_from_target else "random, embedding projected onto the target's"),
               "parameters": params, "steps": args.steps, "batch_rows": args.batch,
               "row_length": int(train.tokens.shape[1]),
               "tokens_seen": args.steps * args.batch * int(train.tokens.shape[1]),
               "seed": args.seed, "lr": args.lr, "train_cache": train.meta, "heldout_cache": heldout.meta,
               "training_wall_time_s": round(elapsed, 1),
               "heldout_teacher_forced_top1": agree, "acceptance_in_process": accept,
               "command": " ".join(["python", "training/train_draft.py", *(argv or sys.argv[1:])])}
    (args.out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "train_log.jsonl").write_text(log_file.read_text())
    print(json.dumps({k: summary[k] for k in ("heldout_teacher_forced_top1", "acceptance_in_process")}, indent=2))


if __name__ == "__main__":
    main()
