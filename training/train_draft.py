"""Train a small draft model (a few-layer Llama, the target's tokenizer) distilled from the target.

The student is an ordinary tied-embedding Llama (HF layout, loads with specserve.model.transformer.load_model)
whose embedding starts as the target's embedding projected onto its top principal directions
(E_draft = E_target · P, P the top `hidden` right singular vectors of E_target): since both LMs
read logits off their embedding, the student starts able to express the target's output space.
Loss: cross-entropy against the target's renormalised top-K distribution at every position
(soft labels from the distillation cache, training/distill_cache.py: train-split corpus windows +
the target's greedy continuations of train-split prompts). No target forward during training.

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

import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distill_cache import (DistillCache, acceptance_in_process, distilled_trainer_args,  # noqa: E402
                           heldout_benchmark_prompts)
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


def student_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    return model.logits(model.forward(causal_batch(tokens), cache=None).hidden)  # [B, T, V]


@torch.no_grad()
def agreement(model: Transformer, cache: DistillCache, *, greedy_rows_from: int, batch: int = 16) -> dict:
    hits = []
    for i in range(0, len(cache.tokens), batch):
        hits.append(student_logits(model, cache.tokens[i:i + batch]).argmax(-1) == cache.top_ids[i:i + batch, :, 0])
    h = torch.cat(hits)  # [N, T]
    return {"all": round(float(h.float().mean()), 4),
            "corpus_windows": round(float(h[:greedy_rows_from].float().mean()), 4),
            "greedy_continuations": round(float(h[greedy_rows_from:].float().mean()), 4),
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
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_model(args.target)
    train, heldout = load_cache(args.cache / "train.pt"), load_cache(args.cache / "heldout.pt")
    cfg = draft_config(target, hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                       intermediate=args.intermediate)
    model = init_student(target, cfg, args.seed).train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
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
        while step < args.steps:
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)  # per step: resumable
            idx = torch.randint(len(train.tokens), (args.batch,), generator=g)
            logits = student_logits(model, train.tokens[idx])  # [B, T, V]
            ids, teacher = train.top_ids[idx], train.top_logits[idx].float()  # [B, T, K]
            logq = logits.log_softmax(-1).gather(-1, ids)
            loss = -(teacher.softmax(-1) * logq).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            top1 = float((logits.argmax(-1) == ids[..., 0]).float().mean())
            log.write(json.dumps({"step": step, "loss": round(loss.item(), 5), "top1": round(top1, 4),
                                  "lr": sched.get_last_lr()[0]}) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{top1:.3f}")
            if step % args.ckpt_every == 0 or step == args.steps:
                log.flush()
                save(ckpt, "model", model, opt, sched, step, elapsed=elapsed + time.time() - t0)
    bar.close()
    elapsed += time.time() - t0
    model.eval().requires_grad_(False)
    save_draft_model(model, args.out, tokenizer_from=args.target)

    # Evaluate the model as saved (bf16 weights, loaded in fp32 as the engine serves it).
    from tokenizers import Tokenizer

    from specserve.methods.draft.drafter import load_draft_model

    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    saved = load_draft_model(args.out, target, tokenizer)
    agree = agreement(saved, heldout, greedy_rows_from=heldout.meta["corpus_windows"])
    prompts = heldout_benchmark_prompts(tokenizer, args.accept_prompts)
    max_len = max(len(p) for p in prompts) + args.accept_new_tokens + 1
    proposer = DraftModelProposer(saved, max_num_seqs=4, max_model_len=max_len, max_draft_len=args.max_draft_len)
    accept = acceptance_in_process(target, "draft", proposer, prompts, new_tokens=args.accept_new_tokens,
                                   max_draft_len=args.max_draft_len)
    params = sum(p.numel() for p in saved.parameters())
    summary = {"target": args.target.as_posix(), "config": {"hidden": args.hidden, "layers": args.layers,
               "heads": args.heads, "kv_heads": args.kv_heads, "intermediate": args.intermediate},
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
