"""Train MTP heads (specserve/methods/mtp/heads.py) for a target by self-distillation from it.

Head j reads f_t (the target's final hidden state at position t) and learns the target's own
next-token distribution at position t+1+j, i.e. the distribution of token t+2+j (top-K soft
labels: cross-entropy against the target's renormalised top-K probabilities). Everything comes
from the distillation cache (training/distill_cache.py: train-split corpus windows + the target's
greedy continuations of train-split prompts, or a self-distillation folder's windows with
--distill-dir there), so no target forward runs during training.

Reported: per-head teacher-forced top-1 agreement with the target (argmax head_j(f_t) == the
target's argmax at t+1+j) on the HELD-OUT cache (held-out documents and greedy continuations of
held-out prompts), and the greedy chain's expected acceptance (all of heads 0..j right).

Deterministic (--seed), resumable (--work-dir/mtp.pt every --ckpt-every steps; rerun the same
command), a tqdm bar, and a jsonl log per step. The demo heads:

    python training/distill_cache.py --target models/demo/target --work-dir checkpoints/distill --threads 1
    python training/train_mtp.py --target models/demo/target --cache checkpoints/distill \
        --out models/demo/mtp --work-dir checkpoints/mtp-demo --steps 1500 --batch 512 --threads 1
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
                           acceptance_prompts, heldout_benchmark_prompts, row_groups)
from run_checkpoint import resume, save  # noqa: E402

from specserve.model.transformer import load_model  # noqa: E402
from specserve.core.engine import Engine, EngineConfig, GenerationRequest  # noqa: E402
from specserve.methods.mtp.heads import (MTPConfig, MTPHeads, _target_fields, head_agreement,  # noqa: E402
                                     load_mtp_heads, save_mtp_heads)
from specserve.methods.mtp.heads_proposer import MTPHeadsProposer  # noqa: E402
from specserve.core.sampling import SamplingParams  # noqa: E402

RECHECK_PROMPTS, RECHECK_NEW_TOKENS = 4, 48


def recheck_rows(target, tokenizer) -> list[list[int]]:
    """The card's cheap recheck sample (tests/test_mtp_heads.py recomputes it): the first
    RECHECK_PROMPTS held-out benchmark prompts, each + the target's RECHECK_NEW_TOKENS greedy tokens."""
    prompts = heldout_benchmark_prompts(tokenizer, RECHECK_PROMPTS)
    engine = Engine(target, EngineConfig(max_num_seqs=len(prompts),
                                         max_model_len=max(map(len, prompts)) + RECHECK_NEW_TOKENS + 1),
                    eos_token_ids=())
    out = engine.generate([GenerationRequest(str(i), p, SamplingParams(max_tokens=RECHECK_NEW_TOKENS))
                           for i, p in enumerate(prompts)])
    return [p + out[str(i)].new_token_ids for i, p in enumerate(prompts)]


def load_cache(path: Path) -> DistillCache:
    return DistillCache(**torch.load(path, weights_only=False)["cache"])


def positions(cache: DistillCache, k: int) -> torch.Tensor:
    """All (row, t) with t + k < T: every head has a label. → [P, 2] int64."""
    N, T = cache.tokens.shape
    rows, ts = torch.meshgrid(torch.arange(N), torch.arange(T - k), indexing="ij")
    return torch.stack([rows.reshape(-1), ts.reshape(-1)], dim=1)


def gather(cache: DistillCache, pos: torch.Tensor, k: int):
    """pos [B, 2] → features [B, D] f32, label ids [B, k, K], label logits [B, k, K] f32."""
    r, t = pos[:, 0], pos[:, 1]
    feats = cache.hidden[r, t].float()
    ahead = t[:, None] + 1 + torch.arange(k)[None]  # [B, k]: the target's prediction at t+1+j
    return feats, cache.top_ids[r[:, None], ahead], cache.top_logits[r[:, None], ahead].float()


def soft_ce(logits: torch.Tensor, ids: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """logits [B, k, V]; the target's top-K ids/logits [B, k, K] → mean CE per head [k]."""
    p = teacher.softmax(-1)  # renormalised over the top K
    logq = logits.log_softmax(-1).gather(-1, ids)  # [B, k, K]
    return -(p * logq).sum(-1).mean(0)


@torch.no_grad()
def evaluate(heads: MTPHeads, cache: DistillCache, k: int, *, greedy_rows_from: int | None = None,
             batch: int = 2048) -> dict:
    """Per-head top-1 agreement with the target's argmax, over all positions of `cache` (and
    separately over its greedy-continuation rows, whose text is the target's own)."""
    pos = positions(cache, k)
    hits = torch.zeros(len(pos), k, dtype=torch.bool)
    for i in range(0, len(pos), batch):
        feats, ids, _ = gather(cache, pos[i:i + batch], k)
        hits[i:i + batch] = heads(feats).argmax(-1) == ids[..., 0]

    def summarise(h: torch.Tensor) -> dict:
        chain = h.cumprod(dim=1).float().mean(0)  # heads 0..j all right
        return {"positions": len(h), "agreement_per_head": [round(float(x), 4) for x in h.float().mean(0)],
                "chain_all_right_through_head": [round(float(x), 4) for x in chain],
                # greedy acceptance length of a k-chain from these heads: 1 + E[accepted]
                "expected_acceptance_length": round(1 + float(chain.sum()), 4)}

    out = {"all": summarise(hits)}
    if greedy_rows_from is not None:
        out["greedy_continuations"] = summarise(hits[pos[:, 0] >= greedy_rows_from])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = distilled_trainer_args(__doc__, steps=1500, batch=512, batch_help="positions per step", ckpt_every=100)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=512)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()

    target = load_model(args.target)
    train, heldout = load_cache(args.cache / "train.pt"), load_cache(args.cache / "heldout.pt")
    k = args.heads
    cfg = MTPConfig(**_target_fields(target), num_heads=k, intermediate_size=args.intermediate)
    heads = MTPHeads(cfg, target.lm_head.weight)
    opt = torch.optim.AdamW(heads.heads.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / max(1, args.steps)))

    args.work_dir.mkdir(parents=True, exist_ok=True)
    ckpt, log_file = args.work_dir / "mtp.pt", args.work_dir / "train_log.jsonl"
    state = resume(ckpt, "heads", heads.heads, opt, sched)
    step, elapsed = (state["step"], state["elapsed"]) if state else (0, 0.0)
    # The log holds exactly the steps of the checkpoint (a crash after it may have added more).
    rows = [json.loads(x) for x in log_file.read_text().splitlines()] if log_file.is_file() else []
    log_file.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step))

    pos = positions(train, k)
    bar = tqdm(total=args.steps, initial=step, desc="MTP heads", unit="step")
    t0 = time.time()
    with log_file.open("a") as log:
        stop_at = min(args.steps, args.stop_at or args.steps)
        while step < stop_at:
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)  # per step: resumable
            feats, ids, teacher = gather(train, pos[torch.randint(len(pos), (args.batch,), generator=g)], k)
            logits = heads(feats)  # [B, k, V]
            per_head = soft_ce(logits, ids, teacher)  # [k]
            loss = per_head.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(heads.heads.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            top1 = (logits.argmax(-1) == ids[..., 0]).float().mean(0)
            row = {"step": step, "loss": round(loss.item(), 5), "ce_per_head": [round(x, 4) for x in per_head.tolist()],
                   "top1_per_head": [round(x, 4) for x in top1.tolist()], "lr": sched.get_last_lr()[0]}
            log.write(json.dumps(row) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", top1="/".join(f"{x:.2f}" for x in top1.tolist()))
            if step % args.ckpt_every == 0 or step == stop_at:
                log.flush()
                save(ckpt, "heads", heads.heads, opt, sched, step, elapsed=elapsed + time.time() - t0)
    bar.close()
    if step < args.steps:
        print(f"stopped at step {step} of {args.steps}; rerun the same command to resume", file=sys.stderr)
        return
    elapsed += time.time() - t0
    heads.eval()
    greedy = row_groups(heldout.meta).get("greedy_continuations")  # a distill folder's cache has none apart
    report = {"heldout": evaluate(heads, heldout, k, greedy_rows_from=greedy.start if greedy else None),
              "train_sample": evaluate(heads, DistillCache(train.tokens[:256], train.hidden[:256], train.top_ids[:256],
                                                           train.top_logits[:256], train.meta), k)}
    save_mtp_heads(heads, args.out)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    saved = load_mtp_heads(args.out, target)
    report["recheck_sample"] = {"rows": f"first {RECHECK_PROMPTS} held-out benchmark prompts + "
                                        f"{RECHECK_NEW_TOKENS} greedy tokens",
                                "agreement_per_head": head_agreement(target, saved, recheck_rows(target, tokenizer))}
    proposer = MTPHeadsProposer(saved, max_draft_len=k)
    report["acceptance_in_process"] = acceptance_in_process(
        target, "mtp_heads", proposer, acceptance_prompts(args, tokenizer),
        new_tokens=args.accept_new_tokens, max_draft_len=k)
    summary = {"target": args.target.as_posix(), "heads": k, "intermediate_size": args.intermediate,
               "steps": args.steps, "batch_positions": args.batch, "seed": args.seed, "lr": args.lr,
               "train_cache": train.meta, "heldout_cache": heldout.meta,
               "training_wall_time_s": round(elapsed, 1), "script_wall_time_s": round(time.time() - t_start, 1),
               "eval": report, "command": " ".join(["python", "training/train_mtp.py", *(argv or sys.argv[1:])])}
    (args.out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "train_log.jsonl").write_text(log_file.read_text())
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
