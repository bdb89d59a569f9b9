"""Measure the exported demo target and write the figures the model card cites.

    python training/eval_target.py              # writes models/demo/eval.json + training_curve.png

Measured here, never typed in: held-out loss / perplexity / bits per byte (whole held-out split
and the fixed slice the test re-checks), greedy completions of held-out function headers, and
batch-1 decode time of the target vs a one-layer EAGLE-style drafter on this CPU.

Bits per byte: each document is encoded as [eot] + tokens and scored in non-overlapping windows
of ``WINDOW`` tokens (each window starts without earlier context). bpb = total nats / ln 2 /
total UTF-8 bytes of the documents scored. Tokenization round-trips exactly, so the bytes
are exactly the text the tokens spell.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules, run as a script
import corpus  # noqa: E402

TARGET_DIR = corpus.REPO / "models" / "demo" / "target"
EVAL_JSON = corpus.REPO / "models" / "demo" / "eval.json"
CURVE_PNG = corpus.REPO / "models" / "demo" / "training_curve.png"
LOG = corpus.REPO / "models" / "demo" / "train_log.jsonl"
WINDOW = 512
SLICE_BYTES = 16384  # the test's fixed held-out slice


@torch.no_grad()
def nats_and_bytes(model, tokenizer, docs: list[str], window: int = WINDOW, batch: int = 8,
                   progress: bool = False) -> dict:
    """Summed next-token nats, predicted-token count and UTF-8 bytes over ``docs``."""
    eot = tokenizer.convert_tokens_to_ids(corpus.EOT)
    rows = []  # (inputs, targets) windows of at most `window` tokens
    for doc in docs:
        ids = [eot] + tokenizer.encode(doc, add_special_tokens=False)
        for i in range(0, len(ids) - 1, window):
            rows.append((ids[i : i + window], ids[i + 1 : i + window + 1]))
    nats, n_tok = 0.0, 0
    it = range(0, len(rows), batch)
    for b in tqdm(it, desc="eval", disable=not progress):
        chunk = rows[b : b + batch]
        width = max(len(x) for x, _ in chunk)
        x = torch.full((len(chunk), width), eot, dtype=torch.long)  # [B, W]; padding is never scored
        y = torch.full((len(chunk), width), -100, dtype=torch.long)  # [B, W]; -100 = ignore
        for r, (xi, yi) in enumerate(chunk):
            # Every window has len(targets) == len(inputs) except a doc's last (one shorter).
            x[r, : len(xi)] = torch.tensor(xi)
            y[r, : len(yi)] = torch.tensor(yi)
        # Right padding with a causal mask cannot affect the real positions before it.
        logits = model(input_ids=x).logits.float()  # [B, W, V]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                 ignore_index=-100, reduction="sum")
        nats += loss.item()
        n_tok += int((y != -100).sum())
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    return {"docs": len(docs), "bytes": n_bytes, "tokens": n_tok, "nats": nats,
            "loss": nats / n_tok, "ppl": math.exp(nats / n_tok), "bpb": nats / math.log(2) / n_bytes}


def load_target(path: Path = TARGET_DIR, dtype: torch.dtype = torch.float32):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list[dict], n: int, new_tokens: int) -> list[dict]:
    out = []
    for p in tqdm(prompts[:n], desc="complete"):
        ids = tokenizer(p["prompt"], return_tensors="pt", add_special_tokens=False).input_ids
        eot = tokenizer.convert_tokens_to_ids(corpus.EOT)
        ids = torch.cat([torch.tensor([[eot]]), ids], dim=1)  # documents start after an eot in training
        gen = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=eot, pad_token_id=eot)
        out.append({"source": p["source"], "prompt": p["prompt"],
                    "completion": tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=False)})
    return out


class OneLayerDrafter(torch.nn.Module):
    """Cost model of an EAGLE-style drafter: fc(2d -> d) on [target hidden, token embedding],
    one Llama decoder layer, final norm, and the target's (tied) LM head. Random weights: only
    its speed is measured here."""

    def __init__(self, target: LlamaForCausalLM):
        super().__init__()
        cfg = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1})
        d = cfg.hidden_size
        self.fc = torch.nn.Linear(2 * d, d, bias=False)
        self.body = LlamaForCausalLM(cfg).model  # embed (shared below) + 1 layer + norm
        self.body.embed_tokens = target.model.embed_tokens
        self.lm_head = target.lm_head
        self.to(target.dtype)

    def forward(self, token: torch.Tensor, hidden: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        e = self.body.embed_tokens(token)  # [1, 1, d]
        x = self.fc(torch.cat([hidden, e], dim=-1))  # [1, 1, d]
        h = self.body(inputs_embeds=x, cache=cache, use_cache=True).last_hidden_state
        return self.lm_head(h)  # [1, 1, V]


@torch.no_grad()
def decode_timing(model: LlamaForCausalLM, context: int = 128, steps: int = 64, repeats: int = 3) -> dict:
    """Median seconds per batch-1 decode step (KV cache, eager) for the target and a one-layer drafter."""
    torch.manual_seed(0)
    drafter = OneLayerDrafter(model).eval()
    prompt = torch.randint(1, model.config.vocab_size, (1, context))
    hidden = torch.randn(1, 1, model.config.hidden_size, dtype=model.dtype)

    def run_target() -> list[float]:
        cache = DynamicCache()
        model(input_ids=prompt, cache=cache, use_cache=True)
        tok, times = prompt[:, -1:], []
        for _ in range(steps):
            t = time.perf_counter()
            tok = model(input_ids=tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t)
        return times

    def run_drafter() -> list[float]:
        cache = DynamicCache()
        drafter.body(input_ids=prompt, cache=cache, use_cache=True)  # prime its KV
        tok, times = prompt[:, -1:], []
        for _ in range(steps):
            t = time.perf_counter()
            tok = drafter(tok, hidden, cache)[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t)
        return times

    target_t = statistics.median(x for _ in range(repeats) for x in run_target())
    draft_t = statistics.median(x for _ in range(repeats) for x in run_drafter())
    return {"context": context, "steps": steps * repeats, "threads": torch.get_num_threads(),
            "dtype": str(model.dtype).replace("torch.", ""), "target_ms": target_t * 1e3,
            "drafter_ms": draft_t * 1e3, "ratio": draft_t / target_t}


def plot_curve(log: Path, out: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(ln) for ln in log.read_text().splitlines() if ln]
    tokens = [r["tokens"] / 1e6 for r in recs]
    loss = [r["loss"] for r in recs]
    k = 20  # trailing mean; single 4k-token batches are noisy
    smooth = [statistics.fmean(loss[max(0, i - k + 1) : i + 1]) for i in range(len(loss))]
    held = [(r["tokens"] / 1e6, r["heldout_loss"]) for r in recs if "heldout_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(tokens, loss, color="0.8", lw=0.6, label="train loss (per batch)")
    ax.plot(tokens, smooth, color="C0", label=f"train loss ({k}-step mean)")
    ax.plot(*zip(*held), "o-", color="C1", ms=3, label="held-out loss (8 fixed windows)")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(top=min(9.5, max(loss) + 0.2))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("specserve demo target: training curve")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    last = recs[-1]
    return {"steps": last["step"] + 1, "tokens": last["tokens"], "train_wall_s": last["elapsed_s"],
            "final_train_loss_20step_mean": smooth[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--completions", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    manifest = corpus.load_manifest()
    model, tok = load_target()
    n_params = sum(p.numel() for p in model.parameters())
    result = {"checkpoint": str(TARGET_DIR.relative_to(corpus.REPO)), "params": n_params,
              "eval_dtype": "float32 (bf16 weights upcast)", "window": WINDOW,
              "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}"}
    result["training"] = plot_curve(LOG, CURVE_PNG)
    result["test_slice"] = {"first_bytes": SLICE_BYTES,
                            **nats_and_bytes(model, tok, corpus.heldout_slice(manifest, SLICE_BYTES))}
    print("test slice:", result["test_slice"])
    docs = [d.text for d in corpus.documents(manifest, "heldout")]
    result["heldout"] = nats_and_bytes(model, tok, docs, progress=True)
    print("held-out:", result["heldout"])
    prompts = [json.loads(ln) for ln in corpus.PROMPTS.read_text().splitlines() if ln]
    code = [p for p in prompts if p["kind"] == "code"]
    result["completions"] = greedy_completions(model, tok, code, args.completions, args.new_tokens)
    result["decode_timing"] = {
        "fp32": decode_timing(model),
        "bf16": decode_timing(AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.bfloat16).eval()),
    }
    print("decode timing:", result["decode_timing"])
    EVAL_JSON.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {EVAL_JSON} and {CURVE_PNG}")


if __name__ == "__main__":
    main()
