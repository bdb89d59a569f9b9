"""Train an EAGLE drafter and its calibration head for any supported target, from the target itself.

Self-distillation (no labels from anywhere but the target):

  data      sequences of corpus text (the demo corpus' train split, or --text-file), plus the
            target's OWN continuations of corpus prompts (greedy and sampled at T=0.8), so the
            drafter sees the distribution it will draft for at serving time;
  backbone  for every position i: input (f_i, t_{i+1}) → f̂_{i+1}; loss = SmoothL1(f̂, f) +
            w · CE(target distribution at i+1, softmax(lm_head(f̂))) with the target's LM head
            frozen; small noise on the input features (as EAGLE does) so the drafter tolerates
            its own imperfect features when it autoregresses;
  calibration  draft --calib-draft-len tokens (no early stop) against the target on training
            prompts through the real engine; each drafted position that was reached is one
            example (features → accepted or not); a small head is fit with BCE. The prompts are
            corpus windows plus prompts shaped like the serving traffic (--calib-prompts-file, or
            for the demo corpus its train split's function headers and prose openings), since a
            head fit on one kind of text is over-confident on another. Its calibration (predicted
            vs observed acceptance by bucket) on held-out prompts goes to training.json.

Deterministic (--seed), resumable (checkpoints in --work-dir every --ckpt-every steps), with
progress bars. Example (the demo drafter):

    python training/train_eagle.py --target models/demo/target --out models/demo/eagle \
        --steps 600 --seq-len 256 --batch 8
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
import torch.nn.functional as F
from tqdm import tqdm

from specserve.core.engine import Engine, EngineConfig, GenerationRequest
from specserve.core.masks import build_mask, chain_parents
from specserve.core.forward import ForwardBatch
from specserve.model.transformer import Transformer, load_model
from specserve.methods.eagle.drafter import CalibrationHead, EagleDrafter, save_eagle
from specserve.methods.eagle.proposer import EagleProposer
from specserve.core.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))
from run_checkpoint import resume, save  # noqa: E402 — the resumable checkpoint the trainers share


# -- data ----------------------------------------------------------------------------------------

def corpus_token_stream(tokenizer, text_file: Path | None, split: str) -> list[int]:
    if text_file is not None:
        texts = [text_file.read_text(encoding="utf-8")]
    else:
        sys.path.insert(0, str(ROOT / "training"))
        import corpus  # the demo corpus (training/corpus.py)

        texts = [d.text for d in corpus.documents(corpus.load_manifest(), split)]
    eot = tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for t in texts:
        ids += tokenizer.encode(t).ids + ([eot] if eot is not None else [])
    return ids


def self_continuations(target: Transformer, stream: list[int], *, n_prompts: int, prompt_len: int,
                       new_tokens: int, seed: int) -> list[list[int]]:
    """The target's own greedy and sampled (T=0.8) continuations of random corpus windows."""
    rng = random.Random(seed)
    engine = Engine(target, EngineConfig(max_num_seqs=8, max_model_len=prompt_len + new_tokens + 1),
                    eos_token_ids=())
    reqs = []
    for i in range(n_prompts):
        start = rng.randrange(0, len(stream) - prompt_len)
        params = SamplingParams(max_tokens=new_tokens) if i % 2 == 0 else \
            SamplingParams(max_tokens=new_tokens, temperature=0.8, seed=seed + i)
        reqs.append(GenerationRequest(str(i), stream[start:start + prompt_len], params))
    seqs = []
    for r in tqdm(reqs, desc="self-distillation continuations", unit="seq"):
        out = engine.generate([r])[r.request_id]
        seqs.append(r.prompt_ids + out.new_token_ids)
    return seqs


def batches(stream: list[int], extra: list[list[int]], *, seq_len: int, batch: int, seed: int):
    """Endless deterministic batches [batch, seq_len] mixing corpus windows and self-continuations."""
    rng = random.Random(seed)
    pool = [s[:seq_len] for s in extra if len(s) >= seq_len]
    while True:
        rows = []
        for _ in range(batch):
            if pool and rng.random() < 0.3:
                rows.append(rng.choice(pool))
            else:
                start = rng.randrange(0, len(stream) - seq_len)
                rows.append(stream[start:start + seq_len])
        yield torch.tensor(rows)


# -- backbone training -----------------------------------------------------------------------------

def causal_batch(tokens: torch.Tensor) -> ForwardBatch:
    """tokens [B, T] as one causal forward from position 0, no cache (train_dflash and train_draft too)."""
    B, T = tokens.shape
    mask, positions = build_mask([0] * B, [chain_parents(T)] * B, T)
    zero = torch.zeros(B, dtype=torch.long)
    return ForwardBatch(tokens, positions, zero, zero, mask)


@dataclass
class Losses:
    regression: float
    ce: float
    top1: float  # drafter argmax == target argmax, teacher-forced


def train_step(drafter: EagleDrafter, target: Transformer, tokens: torch.Tensor, opt,
               *, ce_weight: float, noise: float, gen: torch.Generator) -> Losses:
    with torch.no_grad():
        feats = target.forward(causal_batch(tokens), cache=None).hidden  # [B, T, D]
        tlogp = target.logits(feats).log_softmax(-1)                      # [B, T, V]
    f_in, f_out = feats[:, :-1], feats[:, 1:]
    nxt = tokens[:, 1:]
    f_in = f_in + (torch.rand(f_in.shape, generator=gen) - 0.5) * 2 * noise
    with torch.no_grad():
        embeds = target.embed_tokens(nxt)
    pred = drafter(f_in, embeds, causal_batch(nxt), cache=None)  # [B, T-1, D]
    reg = F.smooth_l1_loss(pred, f_out)
    dlogp = target.logits(pred).log_softmax(-1)
    tp = tlogp[:, 1:].exp()
    ce = -(tp * dlogp).sum(-1).mean()
    loss = reg + ce_weight * ce
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
    opt.step()
    top1 = (dlogp.argmax(-1) == tlogp[:, 1:].argmax(-1)).float().mean()
    return Losses(reg.item(), ce.item(), top1.item())


# -- calibration -------------------------------------------------------------------------------------

class RecordingProposer(EagleProposer):
    """Drafts a fixed length and records each position's calibration inputs; `observe` labels them."""

    def __init__(self, *a, **kw):
        super().__init__(*a, threshold=None, **kw)
        self.rows: list[int] = []
        self.pending: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.examples: list[tuple[torch.Tensor, torch.Tensor, float]] = []

    def propose(self, requests):
        self.rows = [r.seq_id for r in requests]
        self.pending = {r.seq_id: [] for r in requests}
        return super().propose(requests)

    def threshold_for(self, r):
        return 1.0  # any positive value: makes propose() call _calibrate (which never stops it)

    def _calibrate(self, h, logits, j):
        scalars = CalibrationHead.scalar_features(logits, j)
        for b, sid in enumerate(self.rows):
            if len(self.pending[sid]) == j:
                self.pending[sid].append((h[b].float().clone(), scalars[b].clone()))
        return None

    def observe(self, outcomes):
        for o in outcomes:
            recs = self.pending.get(o.seq_id, [])[:o.num_drafted]
            n_acc = len(o.accepted_nodes)
            # Conditional labels: positions up to and including the first rejection.
            for j, (h, s) in enumerate(recs[:n_acc + 1]):
                self.examples.append((h, s, 1.0 if j < n_acc else 0.0))


def collect_calibration(drafter, target, prompts, *, draft_len: int, new_tokens: int, desc: str):
    max_len = min(1024, target.cfg.max_position_embeddings)
    prop = RecordingProposer(drafter, target, max_num_seqs=8, max_model_len=max_len, max_draft_len=draft_len)
    engine = Engine(target, EngineConfig(max_num_seqs=8, max_model_len=max_len, max_draft_len=draft_len),
                    {"eagle": prop}, eos_token_ids=())
    for i in tqdm(range(0, len(prompts), 8), desc=desc, unit="batch"):
        chunk = prompts[i:i + 8]
        engine.generate([GenerationRequest(f"{desc}{i + k}", p[:max_len - new_tokens - 1], SamplingParams(max_tokens=new_tokens),
                                           "eagle") for k, p in enumerate(chunk)])
    h = torch.stack([e[0] for e in prop.examples])
    s = torch.stack([e[1] for e in prop.examples])
    y = torch.tensor([e[2] for e in prop.examples])
    return h, s, y


def fit_calibration(head: CalibrationHead, h, s, y, *, epochs: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3, weight_decay=0.01)
    n = len(y)
    for _ in tqdm(range(epochs), desc="calibration head", unit="epoch"):
        order = torch.randperm(n, generator=g)
        for i in range(0, n, 256):
            idx = order[i:i + 256]
            loss = F.binary_cross_entropy_with_logits(head(h[idx], s[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


def calibration_report(head: CalibrationHead, h, s, y, buckets: int = 10) -> dict:
    with torch.no_grad():
        p = torch.sigmoid(head(h, s))
    rows = []
    for k in range(buckets):
        lo, hi = k / buckets, (k + 1) / buckets
        sel = (p >= lo) & ((p < hi) if k < buckets - 1 else (p <= hi))
        if sel.any():
            rows.append({"bucket": f"{lo:.1f}-{hi:.1f}", "n": int(sel.sum()),
                         "predicted": round(float(p[sel].mean()), 4), "observed": round(float(y[sel].mean()), 4)})
    ece = sum(r["n"] * abs(r["predicted"] - r["observed"]) for r in rows) / max(1, len(y))
    brier = float(((p - y) ** 2).mean())
    return {"examples": len(y), "base_rate": round(float(y.mean()), 4),
            "expected_calibration_error": round(ece, 4), "brier": round(brier, 4), "buckets": rows}


# -- main ----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--text-file", type=Path, default=None, help="train on this text instead of the demo corpus")
    ap.add_argument("--heldout-file", type=Path, default=None, help="calibration report prompts (text)")
    ap.add_argument("--work-dir", type=Path, default=None, help="checkpoints (default: checkpoints/eagle-<name>)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ce-weight", type=float, default=0.1)
    ap.add_argument("--noise", type=float, default=0.05)
    ap.add_argument("--self-prompts", type=int, default=32, help="target continuations to generate")
    ap.add_argument("--self-new-tokens", type=int, default=128)
    ap.add_argument("--calib-prompts", type=int, default=48, help="corpus windows to fit the calibration head on")
    ap.add_argument("--calib-serving-prompts", type=int, default=64,
                    help="serving-like prompts to fit it on too (0: none); from --calib-prompts-file, or the "
                         "demo corpus' train split (function headers and prose openings)")
    ap.add_argument("--calib-prompts-file", type=Path, default=None,
                    help="serving-like prompts, separated by blank lines")
    ap.add_argument("--calib-draft-len", type=int, default=8)
    ap.add_argument("--calib-new-tokens", type=int, default=64)
    ap.add_argument("--calib-epochs", type=int, default=30)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--stop-at", type=int, default=None,
                    help="checkpoint and exit at this step (to split a long run; rerun to resume)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from tokenizers import Tokenizer

    target = load_model(args.target)
    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    work = args.work_dir or ROOT / "checkpoints" / f"eagle-{args.out.name}"
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    stream = corpus_token_stream(tokenizer, args.text_file, "train")
    cont_file = work / "continuations.json"
    if cont_file.is_file():
        extra = json.loads(cont_file.read_text())
    else:
        extra = self_continuations(target, stream, n_prompts=args.self_prompts, prompt_len=args.seq_len // 2,
                                   new_tokens=args.self_new_tokens, seed=args.seed)
        cont_file.write_text(json.dumps(extra))

    dcfg = target.cfg.__class__(**{**target.cfg.__dict__, "num_layers": 1})
    drafter = EagleDrafter(dcfg, calibration=True)
    # Start from the target's last layer: a far better initial point than random weights.
    last = target.layers[-1].state_dict()
    drafter.layers[0].load_state_dict({k: v for k, v in last.items() if not k.startswith("input_layernorm")},
                                      strict=False)
    with torch.no_grad():
        D = dcfg.hidden_size
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, D:] = torch.eye(D)  # x = f_i at first (the feature half)
        drafter.fc.weight[:, :D] = torch.eye(D) * 0.5  # plus the next token's embedding
        drafter.fc.bias.zero_()
    drafter.requires_grad_(True)
    drafter.calibration.requires_grad_(False)
    backbone_params = [p for n, p in drafter.named_parameters() if not n.startswith("calibration.")]
    opt = torch.optim.AdamW(backbone_params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 30) * max(0.1, 1 - s / max(1, args.steps)))

    step, log_rows = 0, []
    ckpt = work / "backbone.pt"
    state = resume(ckpt, "drafter", drafter, opt, sched)
    if state:
        step, log_rows = state["step"], state["log"]
    data = batches(stream, extra, seq_len=args.seq_len, batch=args.batch, seed=args.seed)
    for _ in range(step):  # replay the data order so a resumed run sees the same batches
        next(data)
    bar = tqdm(total=args.steps, initial=step, desc="EAGLE backbone", unit="step")
    drafter.train()
    stop_at = min(args.steps, args.stop_at or args.steps)
    while step < stop_at:
        # Noise seeded by step, so a resumed run draws exactly what an uninterrupted one would.
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        losses = train_step(drafter, target, next(data), opt, ce_weight=args.ce_weight, noise=args.noise, gen=gen)
        sched.step()
        step += 1
        log_rows.append({"step": step, **losses.__dict__})
        bar.update(1)
        bar.set_postfix(reg=f"{losses.regression:.4f}", ce=f"{losses.ce:.3f}", top1=f"{losses.top1:.3f}")
        if step % args.ckpt_every == 0 or step == stop_at:
            save(ckpt, "drafter", drafter, opt, sched, step, log=log_rows)
    bar.close()
    if step < args.steps:
        print(f"stopped at step {step} of {args.steps}; rerun the same command to resume", file=sys.stderr)
        return
    drafter.eval().requires_grad_(False)

    # Calibration head: examples from real drafting against the target.
    rng = random.Random(args.seed + 1)
    starts = [rng.randrange(0, len(stream) - args.seq_len) for _ in range(args.calib_prompts)]
    train_prompts = [stream[s:s + args.seq_len // 2] for s in starts]
    serving_like = serving_like_prompts(tokenizer, args.calib_prompts_file, args.text_file,
                                        args.calib_serving_prompts)
    train_prompts += serving_like
    h, s, y = collect_calibration(drafter, target, train_prompts, draft_len=args.calib_draft_len,
                                  new_tokens=args.calib_new_tokens, desc="calib-train")
    drafter.calibration.requires_grad_(True)
    fit_calibration(drafter.calibration, h, s, y, epochs=args.calib_epochs, seed=args.seed)
    drafter.calibration.requires_grad_(False)
    report = {"train": calibration_report(drafter.calibration, h, s, y)}
    heldout = heldout_prompts(tokenizer, args.heldout_file)
    if heldout:
        hh, hs, hy = collect_calibration(drafter, target, heldout, draft_len=args.calib_draft_len,
                                         new_tokens=args.calib_new_tokens, desc="calib-heldout")
        report["heldout"] = calibration_report(drafter.calibration, hh, hs, hy)

    save_eagle(drafter, json.loads((args.target / "config.json").read_text()), args.out)
    summary = {"target": str(args.target), "steps": args.steps, "seq_len": args.seq_len, "batch": args.batch,
               "tokens_seen": args.steps * args.batch * args.seq_len, "seed": args.seed,
               "wall_time_s": round(time.time() - t_start, 1),
               "final_teacher_forced_top1": round(sum(r["top1"] for r in log_rows[-20:]) / max(1, len(log_rows[-20:])), 4),
               "calibration_prompts": {"corpus_windows": len(starts), "serving_like": len(serving_like)},
               "calibration": report, "command": " ".join(sys.argv)}
    (args.out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log_rows))
    print(json.dumps({k: v for k, v in summary.items() if k != "calibration"}, indent=2))
    print(json.dumps(report, indent=2))


def serving_like_prompts(tokenizer, prompts_file: Path | None, text_file: Path | None, n: int) -> list[list[int]]:
    """Up to n prompts of the kind the server will see, never from the held-out split."""
    if n <= 0:
        return []
    if prompts_file is not None:
        texts = [t for t in prompts_file.read_text(encoding="utf-8").split("\n\n") if t.strip()]
    elif text_file is None:
        sys.path.insert(0, str(ROOT / "training"))
        import corpus

        n_prose = n // 4
        texts = [p["prompt"] for p in corpus.split_prompts(corpus.load_manifest(), "train", n - n_prose, n_prose)]
    else:
        return []  # a custom corpus: its windows are all we know about the traffic
    return [tokenizer.encode(t).ids for t in texts[:n]]


def heldout_prompts(tokenizer, heldout_file: Path | None) -> list[list[int]]:
    if heldout_file is not None:
        return [tokenizer.encode(t).ids for t in heldout_file.read_text(encoding="utf-8").split("\n\n") if t.strip()]
    f = ROOT / "models/demo/heldout_prompts.jsonl"
    if not f.is_file():
        return []
    return [tokenizer.encode(json.loads(line)["prompt"]).ids for line in f.read_text().splitlines()]


if __name__ == "__main__":
    main()
