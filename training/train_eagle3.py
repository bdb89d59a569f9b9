"""Train an EAGLE-3-style drafter (specserve/methods/eagle/eagle3.py) and its calibration head for
any supported target, from the target itself.

Its own script, not a flag of train_eagle.py, because nothing of the backbone step is shared:
EAGLE-1 regresses the target's next feature and reuses the target's LM head; EAGLE-3 has no
feature loss, predicts tokens over its own reduced vocabulary, and unrolls itself. The data, the
calibration head and its report are train_eagle's (imported from it).

  data      corpus windows and the target's own continuations, as train_eagle (--text-file or the
            demo corpus), or the self-distillation shards of training/distill_data.py
            (--distill-dir, repeatable: prompt + response of each item, read only; windows end at an item's
            end and the loss is on its response only, --loss-on; see distill_windows). The items
            are fixed when a run starts (the folders' train split, --max-items, recorded in the
            work dir), so a resumed run trains on the same ones while a generator adds more;
  vocab     the --draft-vocab most frequent tokens of that data → d2t (draft id → target id
            offsets) and t2d (mask over the target vocabulary), fixed before step 0, saved in the
            work dir (a resumed run reads it back) and in the drafter;
  backbone  training-time test: for each window, step 0 reads the fused TRUE target layers
            (pair i = (fc[a_i, b_i, c_i], t_{i+1})); step k > 0 feeds the drafter's own
            step-(k-1) hidden state back (pair i+k = (ĥ, t_{i+k+1}) at position i+k), attending
            to the true pairs up to i and to its own earlier steps at i, as when it drafts k
            tokens ahead. Each step's loss is the cross-entropy against the target's next-token
            distribution restricted to the draft vocabulary (positions whose target argmax lies
            outside it are left out, since the drafter cannot propose it), weighted 0.8^k;
  calibration  as train_eagle: real drafting through the engine, then a small head fit with BCE;
            its scalars (top-1 probability, entropy) are over the draft vocabulary. With
            --distill-dir its prompts come from the folders' validation split (--calib-on), items
            the backbone never trained on, so the head predicts acceptance on unseen traffic.

Deterministic (--seed), resumable (checkpoints in --work-dir every --ckpt-every steps), with
progress bars. Example:

    python training/train_eagle3.py --target models/demo/target --out models/demo/eagle3 \
        --steps 600 --seq-len 256 --batch 8 --draft-vocab 4096 --ttt-steps 4
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.core.forward import ForwardBatch
from specserve.model.transformer import Transformer, load_model
from specserve.methods.eagle.drafter import save_eagle
from specserve.methods.eagle.eagle3 import Eagle3Drafter, default_aux_layer_ids, draft_vocab, engine_layers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))
import train_eagle as e1  # noqa: E402 — the data, calibration and report helpers
from run_checkpoint import resume, save  # noqa: E402
import distill_corpus  # noqa: E402
from distill_cache import add_distill_args, distill_splits, folders_meta, items_digest  # noqa: E402
import heldout  # noqa: E402

TTT_DECAY = 0.8   # weight of unrolled step k: 0.8^k (later steps are harder and matter less)


# -- data ----------------------------------------------------------------------------------------

def distill_items(folder: Path) -> list[distill_corpus.DistillSequence]:
    """Every finished item of a distill_data.py output folder, read by distill_corpus (read-only
    beside a running generator; held-out prompts refused again)."""
    seqs = distill_corpus.load(folder, heldout.HeldoutGuard(heldout.load_all()))
    if not seqs:
        raise SystemExit(f"{folder}: no finished shards")
    return seqs


def distill_sequences(folder: Path) -> list[list[int]]:
    """prompt + response ids of every finished item of a distill_data.py output folder."""
    return [s.tokens for s in distill_items(folder)]


def distill_prompts(folder: Path | list[distill_corpus.DistillSequence], n: int, seed: int) -> list[list[int]]:
    """Up to n of the folder's (or these items') prompts as the server sees them (chat-templated
    ids, ending with the assistant turn's opening), a seeded sample: what the calibration head
    should be fit on when the drafter serves chat. Training prompts only: distill_items refuses
    held-out ones."""
    items = distill_items(folder) if isinstance(folder, Path) else folder
    prompts = [s.tokens[:s.response_start] for s in items]
    random.Random(seed).shuffle(prompts)
    return prompts[:max(0, n)]


def calibration_prompts(items: list[distill_corpus.DistillSequence], *, windows: int, serving: int,
                        seq_len: int, seed: int) -> list[list[int]]:
    """The calibration head's prompts from these items: `windows` seeded windows of seq_len // 2 ids
    of their text end to end (prompt + response), then `serving` of their chat prompts
    (distill_prompts). main passes the validation split (--calib-on validation): the head learns
    how often drafts are accepted on text the drafter never trained on, as serving traffic is."""
    stream = [t for s in items for t in s.tokens]
    if windows and len(stream) <= seq_len:
        raise SystemExit(f"the calibration items hold {len(stream)} tokens, no more than --seq-len {seq_len}: "
                         "lower --calib-prompts to 0 or use --calib-on train")
    return calibration_windows(stream, windows, seq_len, seed) + distill_prompts(items, serving, seed + 2)


def calibration_windows(stream: list[int], n: int, seq_len: int, seed: int) -> list[list[int]]:
    """n seeded windows of seq_len // 2 ids of this token stream: the calibration head's text prompts."""
    rng = random.Random(seed + 1)
    return [stream[s:s + seq_len // 2] for s in (rng.randrange(0, len(stream) - seq_len) for _ in range(n))]


DATA_FILE = "distill_items.json"   # in the work dir: which items the run trains on


def run_items(folders: list[Path], work: Path, *, validation_share: float, max_items: int | None
              ) -> tuple[list[distill_corpus.DistillSequence], list[distill_corpus.DistillSequence]]:
    """The run's (training, validation) items: the folders' first `max_items` finished items (all
    when None), split by id hash; the training items are fixed when the run starts (written to the work dir). A resumed run
    must find the same items, so a folder that grew since (its generator still running) is
    refused with the --max-items that resumes on them, rather than read silently."""
    items, held = distill_splits(folders, share=validation_share, max_items=max_items)
    record = {"distill_dirs": folders_meta(folders), "finished_items": len(items) + len(held),
              "validation_share": validation_share, "train_items": len(items), "items_sha1": items_digest(items)}
    data_file = work / DATA_FILE
    if data_file.is_file():
        saved = json.loads(data_file.read_text())
        if saved["items_sha1"] != record["items_sha1"]:
            raise SystemExit(
                f"{work} holds a run on {saved['train_items']} training items of its first {saved['finished_items']} "
                f"finished ones (validation share {saved['validation_share']}); {', '.join(folders_meta(folders))} now give "
                f"{record['train_items']} of {record['finished_items']}. Resume with --max-items "
                f"{saved['finished_items']} --validation-share {saved['validation_share']}, or use another --work-dir")
    else:
        data_file.write_text(json.dumps(record, indent=1) + "\n")
    return items, held


def distill_windows(items: list[distill_corpus.DistillSequence], *, seq_len: int, batch: int, seed: int):
    """Endless deterministic batches of (tokens [B, T], loss mask [B, T]) from a distill folder.

    Each window ends where an item ends, so it holds that item's response whole (or its last T
    tokens) after as much of its prompt, then the item before it, as fits. mask[b, p] is 1 where
    token p + 1 is a response token: the drafter learns the target on what the target writes, not
    on the documents and code its prompts quote (60 % of the folder's tokens), which it will never
    draft. Items are drawn in proportion to the response tokens a window of theirs holds."""
    stream: list[int] = []
    is_response: list[bool] = []
    for it in items:
        stream += it.tokens
        is_response += [False] * it.response_start + [True] * it.response_tokens
    if len(stream) < seq_len:
        raise SystemExit(f"the distill folder holds {len(stream)} tokens, fewer than --seq-len {seq_len}")
    predicts = torch.tensor(is_response[1:] + [False], dtype=torch.float32)   # [N] token p+1 is a response
    ends, weights, end = [], [], 0
    for it in items:
        end += len(it.tokens)
        ends.append(max(end, seq_len))
        weights.append(min(it.response_tokens, seq_len))
    tokens = torch.tensor(stream)                                             # [N]
    rng = random.Random(seed)
    while True:
        rows = [e - seq_len for e in rng.choices(ends, weights=weights, k=batch)]
        yield (torch.stack([tokens[r:r + seq_len] for r in rows]),              # [B, T]
               torch.stack([predicts[r:r + seq_len] for r in rows]))            # [B, T]


def heldout_chat_prompts(target_dir: Path, chat_file: Path) -> list[list[int]]:
    """A held-out chat set (jsonl, one {"messages": [...]} per line) rendered by the target's chat
    template as the OpenAI layer renders it, tokenized as preprocess does: for the calibration
    report only (never fit on)."""
    from transformers import AutoTokenizer

    from specserve.openai.chat import ChatTemplate

    template = ChatTemplate(target_dir)
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    rows = [json.loads(line) for line in chat_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [tok(template.render(r["messages"])).input_ids for r in rows]


def token_counts(seqs: list[list[int]], vocab_size: int) -> torch.Tensor:
    c = Counter(t for s in seqs for t in s)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for t, n in c.items():
        counts[t] = n
    return counts  # [V]


# -- backbone training -----------------------------------------------------------------------------

class _UnrollKV:
    """The drafter's keys and values across unrolled steps, kept with their gradients: step k
    appends its T entries after steps 0..k-1 (a stand-in for KVCache during training)."""

    def __init__(self):
        self.k = self.v = None

    def write(self, layer, slots, starts, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)

    def read(self, layer, slots, span):
        return self.k, self.v


def unroll_mask(B: int, T: int, k: int) -> torch.Tensor:
    """[B, T, (k+1) T]: step k's pair i sees the true pairs 0..i (step 0, causal) and its own
    earlier steps at i (steps 1..k, the diagonal): what drafting k tokens ahead of i sees."""
    blocks = [torch.ones(T, T, dtype=torch.bool).tril()] + [torch.eye(T, dtype=torch.bool)] * k
    return torch.cat(blocks, dim=1).expand(B, T, (k + 1) * T)


@dataclass
class Losses:
    ce: float            # the weighted sum over unrolled steps
    top1: list[float]    # per step: drafted token (mapped to target ids) == the target's argmax


@torch.no_grad()
def window_targets(drafter: Eagle3Drafter, target: Transformer, tokens: torch.Tensor, *, bf16: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the drafter learns from on tokens [B, T], from one target forward: the fused layers'
    input feats [B, T, (1+L) D], the token embeddings [B, T, D], the target's argmax [B, T] and
    its logits over the draft vocabulary [B, T, Vd]."""
    layers = drafter.feature_layers
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = target.forward(e1.causal_batch(tokens), cache=None, hidden_layers=layers)
        feats = torch.cat([out.hidden] + [out.layer_hidden[i] for i in layers], dim=-1).float()  # [B, T, (1+L) D]
        tlogits = target.logits(out.hidden)                                              # [B, T, V]
        ids = drafter.target_ids()                                                       # [Vd]
        # Once per window, not per unrolled step (each is a pass over the full [B, T, V]):
        targmax = tlogits.argmax(-1)                                                     # [B, T]
        tdraft = tlogits[..., ids].float()                                               # [B, T, Vd]
        del tlogits
        embeds = target.embed_tokens(tokens).float()                                     # [B, T, D]
    return feats, embeds, targmax, tdraft


@torch.no_grad()
def validation_losses(drafter: Eagle3Drafter, target: Transformer, batches: list, *, ttt_steps: int,
                      bf16: bool) -> Losses:
    """The training loss and top-1 per unrolled step on fixed (tokens, mask) batches the run never
    trains on (the folders' validation split): the curve that shows the drafter generalising or
    only fitting its training items. Means over batches; no optimizer step."""
    was_training = drafter.training
    drafter.eval()
    ce, top1 = 0.0, [0.0] * ttt_steps
    for tokens, mask in batches:
        feats, embeds, targmax, tdraft = window_targets(drafter, target, tokens, bf16=bf16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            total, hits = unrolled_loss(drafter, tokens, feats, embeds, targmax, tdraft, ttt_steps=ttt_steps,
                                        loss_mask=mask)
        ce += float(total) / len(batches)
        top1 = [a + b / len(batches) for a, b in zip(top1, hits)]
    drafter.train(was_training)
    return Losses(ce, top1)


def train_step(drafter: Eagle3Drafter, target: Transformer, tokens: torch.Tensor, opt, *, ttt_steps: int,
               loss_mask: torch.Tensor | None = None, bf16: bool = False) -> Losses:
    """One optimizer step on tokens [B, T]. loss_mask [B, T] (1: learn the target's distribution
    at that position; distill_windows) leaves the other positions out of the loss and of top1;
    None learns every position. bf16: the window's forwards (the target's and the drafter's) under
    bf16 autocast, fp32 weights, optimizer and loss; the target's features and labels are then its
    bf16 forward's, close to but not exactly what an fp32 served target computes."""
    feats, embeds, targmax, tdraft = window_targets(drafter, target, tokens, bf16=bf16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):   # the forward only, not backward
        total, top1 = unrolled_loss(drafter, tokens, feats, embeds, targmax, tdraft, ttt_steps=ttt_steps,
                                    loss_mask=loss_mask)
    opt.zero_grad(set_to_none=True)
    total.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
    opt.step()
    return Losses(total.item(), top1)


def unrolled_loss(drafter: Eagle3Drafter, tokens, feats, embeds, targmax, tdraft, *, ttt_steps: int,
                  loss_mask) -> tuple[torch.Tensor, list[float]]:
    """The training-time-test loss of one window: tokens [B, T], feats [B, T, (1+L) D], embeds
    [B, T, D], the target's argmax [B, T] and its logits over the draft vocabulary [B, T, Vd]."""
    B, T = tokens.shape
    n = T - 1 - (ttt_steps - 1)   # pairs per step: step k predicts t_{i+k+2}, which must exist
    ids = drafter.target_ids()
    kv = _UnrollKV()
    zero = torch.zeros(B, dtype=torch.long)
    h = drafter.fuse(feats[:, :n])   # [B, n, D] step 0 reads the true fused features
    total, top1 = 0.0, []
    for k in range(ttt_steps):
        positions = (torch.arange(n) + k).expand(B, n)
        batch = ForwardBatch(tokens[:, 1 + k:1 + k + n], positions, zero, zero, unroll_mask(B, n, k))
        h = drafter(h, embeds[:, 1 + k:1 + k + n], batch, kv)           # [B, n, D], fed back next step
        logp = drafter.draft_logits(h).log_softmax(-1)                  # [B, n, Vd]
        best = targmax[:, 1 + k:1 + k + n]                              # [B, n] target argmax at i+k+1
        with torch.no_grad():
            p = tdraft[:, 1 + k:1 + k + n].softmax(-1)                  # [B, n, Vd] restricted to the draft vocab
            keep = drafter.t2d[best].float()                            # [B, n]
            counted = torch.ones_like(keep) if loss_mask is None else loss_mask[:, 1 + k:1 + k + n]
            keep = keep * counted
        ce = (-(p * logp).sum(-1) * keep).sum() / keep.sum().clamp_min(1)
        total = total + TTT_DECAY ** k * ce
        hit = (ids[logp.argmax(-1)] == best).float()
        top1.append(float((hit * counted).sum() / counted.sum().clamp_min(1)))
    return total, top1


def init_from_target(drafter: Eagle3Drafter, target: Transformer) -> None:
    """A far better start than random weights: the midlayer is the target's last layer reading
    the highest named layer (fc picks it out), its embedding half of q/k/v starts small, and the
    LM head is the target's rows of the draft vocabulary."""
    D = drafter.cfg.hidden_size
    last = target.layers[-1]
    m = drafter.midlayer
    with torch.no_grad():
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, -D:] = torch.eye(D)
        m.self_attn.qkv_proj.weight[:, D:] = last.self_attn.qkv_proj.weight
        m.self_attn.qkv_proj.weight[:, :D].mul_(0.1)
        if last.self_attn.qkv_proj.bias is not None:
            m.self_attn.qkv_proj.bias.copy_(last.self_attn.qkv_proj.bias)
        m.self_attn.o_proj.load_state_dict(last.self_attn.o_proj.state_dict())
        m.mlp.load_state_dict(last.mlp.state_dict())
        m.hidden_norm.load_state_dict(last.input_layernorm.state_dict())
        m.post_attention_layernorm.load_state_dict(last.post_attention_layernorm.state_dict())
        drafter.norm.load_state_dict(target.norm.state_dict())
        drafter.lm_head.weight.copy_(target.lm_head.weight[drafter.target_ids()])


# -- main ----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--text-file", type=Path, default=None, help="train on this text instead of the demo corpus")
    add_distill_args(ap)   # the items are fixed when the run starts (see run_items)
    ap.add_argument("--heldout-file", type=Path, default=None, help="calibration report prompts (text)")
    ap.add_argument("--heldout-chat", type=Path, default=None,
                    help="calibration report prompts: a held-out chat set (jsonl of messages), rendered by "
                         "the target's chat template (e.g. models/smollm2/heldout_chat.jsonl)")
    ap.add_argument("--work-dir", type=Path, default=None, help="checkpoints (default: checkpoints/eagle3-<name>)")
    ap.add_argument("--target-layers", type=int, nargs="+", default=None,
                    help="the fused layers as public hidden_states ids (id j = output of layer j - 1); "
                         "default: 2, L/2, L-3, the public EAGLE-3 choice")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (capped at the target's)")
    ap.add_argument("--ttt-steps", type=int, default=4, help="unrolled steps per window (training-time test)")
    ap.add_argument("--loss-on", choices=("responses", "all"), default="responses",
                    help="with --distill-dir: learn the target on its responses only (windows end at an "
                         "item's end) or on every token of prompt + response windows")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--self-prompts", type=int, default=32, help="target continuations to generate")
    ap.add_argument("--self-new-tokens", type=int, default=128)
    ap.add_argument("--calib-prompts", type=int, default=48)
    ap.add_argument("--calib-serving-prompts", type=int, default=64)
    ap.add_argument("--calib-prompts-file", type=Path, default=None)
    ap.add_argument("--calib-on", choices=("validation", "train"), default=None,
                    help="with --distill-dir: fit the calibration head on the folders' validation split "
                         "(the default: items the drafter never trained on) or on its training items")
    ap.add_argument("--calib-draft-len", type=int, default=8)
    ap.add_argument("--calib-new-tokens", type=int, default=64)
    ap.add_argument("--calib-epochs", type=int, default=30)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--val-every", type=int, default=50,
                    help="with --distill-dir: loss and top-1 on the validation split every N steps (0: never)")
    ap.add_argument("--val-batches", type=int, default=2, help="fixed validation batches of --batch windows")
    ap.add_argument("--stop-at", type=int, default=None,
                    help="checkpoint and exit at this step (to split a long run; rerun to resume)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--bf16", action="store_true",
                    help="the target's and the drafter's forwards under bf16 autocast (fp32 weights, optimizer "
                         "and loss): about 2x faster a step on CPUs with AMX / AVX512-BF16; the features and labels "
                         "are then the target's bf16 forward's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="dtype of the written weights (bfloat16: half the size of a committed drafter; "
                         "the calibration head stays fp32)")
    args = ap.parse_args(argv)
    if args.calib_on and not args.distill_dir:
        ap.error("--calib-on needs --distill-dir (a text corpus has no validation split)")
    calib_on = args.calib_on or ("validation" if args.distill_dir else "train")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.seq_len < args.ttt_steps + 2:
        ap.error("--seq-len must exceed --ttt-steps + 1")
    torch.manual_seed(args.seed)

    from tokenizers import Tokenizer

    target = load_model(args.target)
    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    work = args.work_dir or ROOT / "checkpoints" / f"eagle3-{args.out.name}"
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    if args.distill_dir:
        items, held = run_items(args.distill_dir, work, validation_share=args.validation_share,
                                max_items=args.max_items)
        seqs = [s.tokens for s in items]
        stream = [t for s in seqs for t in s]   # the calibration windows and the vocabulary count
        extra = seqs
    else:
        stream = e1.corpus_token_stream(tokenizer, args.text_file, "train")
        cont_file = work / "continuations.json"
        if cont_file.is_file():
            extra = json.loads(cont_file.read_text())
        else:
            extra = e1.self_continuations(target, stream, n_prompts=args.self_prompts, prompt_len=args.seq_len // 2,
                                          new_tokens=args.self_new_tokens, seed=args.seed)
            cont_file.write_text(json.dumps(extra))

    V = target.cfg.vocab_size
    vocab_file = work / "draft_vocab.pt"
    if vocab_file.is_file():
        vocab = torch.load(vocab_file, weights_only=True)
    else:
        d2t, t2d = draft_vocab(token_counts([stream] + extra, V), min(args.draft_vocab, V))
        vocab = {"d2t": d2t, "t2d": t2d}
        torch.save(vocab, vocab_file)
    L = target.cfg.num_layers
    layers = engine_layers(args.target_layers or default_aux_layer_ids(L), L)
    dcfg = target.cfg.__class__(**{**target.cfg.__dict__, "num_layers": 1})
    drafter = Eagle3Drafter(dcfg, layers, vocab["d2t"].shape[0], calibration=True)
    drafter.set_vocab(vocab["d2t"], vocab["t2d"])
    init_from_target(drafter, target)
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
    if args.distill_dir and args.loss_on == "responses":
        data = distill_windows(items, seq_len=args.seq_len, batch=args.batch, seed=args.seed)
    else:
        data = ((t, None) for t in e1.batches(stream, extra, seq_len=args.seq_len, batch=args.batch, seed=args.seed))
    for _ in range(step):  # replay the data order so a resumed run sees the same batches
        next(data)
    val_batches = []   # fixed windows of the validation split, drawn as training draws its own
    if args.distill_dir and args.val_every and held:
        val_data = distill_windows(held, seq_len=args.seq_len, batch=args.batch, seed=args.seed + 3)
        val_batches = [next(val_data) for _ in range(args.val_batches)]
    bar = tqdm(total=args.steps, initial=step, desc="EAGLE-3 backbone", unit="step")
    drafter.train()
    stop_at = min(args.steps, args.stop_at or args.steps)
    while step < stop_at:
        tokens, mask = next(data)
        losses = train_step(drafter, target, tokens, opt, ttt_steps=args.ttt_steps, loss_mask=mask, bf16=args.bf16)
        sched.step()
        step += 1
        row = {"step": step, **losses.__dict__}
        if val_batches and (step % args.val_every == 0 or step == args.steps):
            val = validation_losses(drafter, target, val_batches, ttt_steps=args.ttt_steps, bf16=args.bf16)
            row |= {"val_ce": val.ce, "val_top1": val.top1}
            bar.write(f"step {step}: validation ce {val.ce:.3f}, top-1 " + " / ".join(f"{t:.3f}" for t in val.top1))
        log_rows.append(row)
        bar.update(1)
        bar.set_postfix(ce=f"{losses.ce:.3f}", top1="/".join(f"{t:.2f}" for t in losses.top1))
        if step % args.ckpt_every == 0 or step == stop_at:
            save(ckpt, "drafter", drafter, opt, sched, step, log=log_rows)
    bar.close()
    if step < args.steps:
        print(f"stopped at step {step} of {args.steps}; rerun the same command to resume", file=sys.stderr)
        return
    drafter.eval().requires_grad_(False)

    if args.distill_dir and args.calib_prompts_file is None:
        # A distill folder's own prompts are the traffic it was made for (chat-templated).
        calib_items = held if calib_on == "validation" else items
        if not calib_items:
            raise SystemExit("--calib-on validation: the validation split is empty (--validation-share)")
        train_prompts = calibration_prompts(calib_items, windows=args.calib_prompts, serving=args.calib_serving_prompts,
                                            seq_len=args.seq_len, seed=args.seed)
        n_windows, n_serving = args.calib_prompts, len(train_prompts) - args.calib_prompts
    else:
        serving_like = e1.serving_like_prompts(tokenizer, args.calib_prompts_file, args.text_file,
                                               args.calib_serving_prompts)
        train_prompts = calibration_windows(stream, args.calib_prompts, args.seq_len, args.seed) + serving_like
        n_windows, n_serving = args.calib_prompts, len(serving_like)
    h, s, y = e1.collect_calibration(drafter, target, train_prompts, draft_len=args.calib_draft_len,
                                     new_tokens=args.calib_new_tokens, desc="calib-train")
    drafter.calibration.requires_grad_(True)
    e1.fit_calibration(drafter.calibration, h, s, y, epochs=args.calib_epochs, seed=args.seed)
    drafter.calibration.requires_grad_(False)
    report = {"train": e1.calibration_report(drafter.calibration, h, s, y)}
    heldout = (heldout_chat_prompts(args.target, args.heldout_chat) if args.heldout_chat is not None
               else e1.heldout_prompts(tokenizer, args.heldout_file))
    if heldout:
        hh, hs, hy = e1.collect_calibration(drafter, target, heldout, draft_len=args.calib_draft_len,
                                            new_tokens=args.calib_new_tokens, desc="calib-heldout")
        report["heldout"] = e1.calibration_report(drafter.calibration, hh, hs, hy)

    save_eagle(drafter, json.loads((args.target / "config.json").read_text()), args.out,
               dtype=getattr(torch, args.save_dtype))
    tail = log_rows[-20:]
    summary = {"target": str(args.target), "steps": args.steps, "seq_len": args.seq_len, "batch": args.batch,
               "ttt_steps": args.ttt_steps, "draft_vocab_size": drafter.draft_vocab_size,
               "loss_on": args.loss_on if args.distill_dir else "all",
               "saved_dtype": args.save_dtype, "bf16_autocast": args.bf16,
               "draft_vocab_coverage": round(float(token_counts([stream] + extra, V)[drafter.t2d].sum())
                                             / max(1, sum(len(s) for s in [stream] + extra)), 4),
               "target_layers": [i + 1 for i in layers],
               "tokens_seen": args.steps * args.batch * args.seq_len, "seed": args.seed,
               "wall_time_s": round(time.time() - t_start, 1),
               "final_teacher_forced_top1_per_step": [round(sum(r["top1"][k] for r in tail) / max(1, len(tail)), 4)
                                                      for k in range(args.ttt_steps)],
               # the last validation of the run: fixed windows of the folders' validation split
               "validation_top1_per_step": next(([round(t, 4) for t in r["val_top1"]]
                                                 for r in reversed(log_rows) if "val_top1" in r), None),
               "validation_windows": len(val_batches) * args.batch,
               "distill_items": (json.loads((work / DATA_FILE).read_text()) if args.distill_dir else None),
               "calibration_prompts": {"from": calib_on if args.calib_prompts_file is None else "file",
                                       "corpus_windows": n_windows, "serving_like": n_serving},
               "calibration": report, "command": " ".join(sys.argv)}
    (args.out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log_rows))
    print(json.dumps({k: v for k, v in summary.items() if k != "calibration"}, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
