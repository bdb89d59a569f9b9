"""The benchmark's request mix, deterministic by seed.

A production-like mix by prompt length, in the target's tokens:

    short   80 %   1 … 127 tokens      natural prompts (held-out function headers, prose openings)
    medium  15 %   128 … 1024 tokens   windows of held-out documents
    long     5 %   1025 … the cap      windows of held-out documents

and an output budget (`max_tokens`) drawn uniformly from `output_range` (32–512 by default).
Every request must fit the model: prompt + max_tokens <= max_model_len. A bucket the model is too
short for is capped (its range shrinks to what fits) and the cap is recorded, never hidden.

Bucket counts use largest remainders (20 requests → 16 / 3 / 1), so small quick runs keep the
proportions as closely as integers allow; the order of requests is then shuffled by the seed.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from specserve.core.paths import shown

REPO = Path(__file__).resolve().parents[3]
DEFAULT_PROMPTS = REPO / "models" / "demo" / "heldout_prompts.jsonl"

# name, share, (lowest, highest) prompt tokens; None = up to the model length.
MIX: tuple[tuple[str, float, tuple[int, int | None]], ...] = (
    ("short", 0.80, (1, 127)),
    ("medium", 0.15, (128, 1024)),
    ("long", 0.05, (1025, None)),
)


@dataclass(frozen=True)
class WorkloadRequest:
    index: int
    bucket: str
    prompt: str
    num_prompt_tokens: int     # by the target's tokenizer
    max_tokens: int


@dataclass(frozen=True)
class BucketPlan:
    name: str
    count: int
    lo: int                    # prompt tokens, after capping by the model length
    hi: int
    capped: bool               # the model length cut this bucket's range


def bucket_counts(n: int, shares: Sequence[float]) -> list[int]:
    """Largest-remainder apportionment of n requests; ties go to the earlier bucket."""
    raw = [n * s / sum(shares) for s in shares]
    counts = [int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


def plan_buckets(n: int, max_model_len: int, min_output: int) -> list[BucketPlan]:
    counts = bucket_counts(n, [share for _, share, _ in MIX])
    top = max_model_len - min_output          # the longest prompt that still leaves min_output
    plans = []
    for (name, _, (lo, hi)), count in zip(MIX, counts):
        want_hi = top if hi is None else hi
        cap_hi = min(want_hi, top)
        cap_lo = min(lo, cap_hi)
        plans.append(BucketPlan(name, count, max(1, cap_lo), max(1, cap_hi),
                                capped=(cap_hi < want_hi) or (cap_lo < lo)))
    return plans


class TextSource:
    """Prompt text by token length: natural short prompts, and a token stream of long documents
    from which windows of any length are cut."""

    def __init__(self, short_prompts: list[str], documents: list[str], encode: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str]):
        if not short_prompts and not documents:
            raise ValueError("no prompt text: both the prompt list and the documents are empty")
        self.encode, self.decode = encode, decode
        self.short = [(p, len(encode(p))) for p in short_prompts]
        self._documents = documents
        self._stream: list[int] | None = None

    @property
    def stream(self) -> list[int]:
        if self._stream is None:  # tokenised on first use: quick runs without long prompts skip it
            ids: list[int] = []
            for d in self._documents or [p for p, _ in self.short]:
                ids += self.encode(d + "\n\n")
            self._stream = ids
        return self._stream

    def natural(self, rng: random.Random, lo: int, hi: int) -> tuple[str, int] | None:
        fits = [(p, n) for p, n in self.short if lo <= n <= hi]
        return rng.choice(fits) if fits else None

    def window(self, rng: random.Random, n_tokens: int) -> tuple[str, int]:
        """About n_tokens of running text (re-encoding a decoded window can change its length by
        a token or two; the result never exceeds n_tokens, and its true length is returned)."""
        ids = self.stream
        while len(ids) < n_tokens + 1:
            ids = ids + ids
        start = rng.randrange(0, len(ids) - n_tokens)
        take = n_tokens
        for _ in range(4):
            text = self.decode(ids[start:start + take])
            n = len(self.encode(text))
            if n <= n_tokens:
                return text, n
            take -= n - n_tokens
        raise ValueError(f"could not cut a window of at most {n_tokens} tokens")


def build_workload(source: TextSource, num_requests: int, max_model_len: int, *, seed: int = 0,
                   output_range: tuple[int, int] = (32, 512)) -> tuple[list[WorkloadRequest], list[BucketPlan]]:
    lo_out, hi_out = output_range
    if not 1 <= lo_out <= hi_out:
        raise ValueError(f"bad output range {output_range}")
    if max_model_len <= lo_out:
        raise ValueError(f"max_model_len {max_model_len} leaves no room for {lo_out} output tokens")
    rng = random.Random(seed)
    plans = plan_buckets(num_requests, max_model_len, lo_out)
    requests = []
    for plan in plans:
        for _ in range(plan.count):
            got = source.natural(rng, plan.lo, plan.hi) if plan.name == "short" else None
            if got is None:
                got = source.window(rng, rng.randint(plan.lo, plan.hi))
            prompt, n_prompt = got
            max_tokens = min(rng.randint(lo_out, hi_out), max_model_len - n_prompt)
            requests.append((plan.name, prompt, n_prompt, max_tokens))
    rng.shuffle(requests)
    return [WorkloadRequest(i, *r) for i, r in enumerate(requests)], plans


def describe(requests: list[WorkloadRequest], plans: list[BucketPlan], output_range: tuple[int, int],
             seed: int) -> dict:
    """The workload as the report records it."""
    buckets = {}
    for plan in plans:
        mine = [r for r in requests if r.bucket == plan.name]
        lens = [r.num_prompt_tokens for r in mine]
        buckets[plan.name] = {**asdict(plan), "share": plan.count / max(1, len(requests)),
                              "prompt_tokens_min": min(lens, default=0), "prompt_tokens_max": max(lens, default=0),
                              "prompt_tokens_mean": sum(lens) / len(lens) if lens else 0.0}
    outs = [r.max_tokens for r in requests]
    return {"seed": seed, "num_requests": len(requests), "output_range": list(output_range),
            "max_tokens_mean": sum(outs) / len(outs) if outs else 0.0,
            "target_mix": {name: share for name, share, _ in MIX}, "buckets": buckets}


# -- where the text comes from ------------------------------------------------------------------------
def read_prompts_file(path: Path) -> list[str]:
    """JSON lines with a "prompt" key (models/demo/heldout_prompts.jsonl), or plain text lines."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            out.append(line)
            continue
        out.append(obj["prompt"] if isinstance(obj, dict) else str(obj))
    return out


def heldout_documents() -> tuple[list[str], str]:
    """The demo corpus's held-out documents (training/corpus.py), or [] with the reason."""
    import importlib.util
    import sys

    path = REPO / "training" / "corpus.py"
    if not path.is_file():
        return [], f"{path} not found"
    spec = importlib.util.spec_from_file_location("specserve_demo_corpus", path)
    corpus = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = corpus  # dataclasses look their module up there
    try:
        spec.loader.exec_module(corpus)
        return [d.text for d in corpus.documents(corpus.load_manifest(), "heldout")], "held-out demo corpus"
    except (OSError, ValueError, KeyError) as e:
        return [], f"held-out corpus unavailable: {e}"


def text_source(tokenizer, prompts_file: Path | None) -> tuple[TextSource, dict]:
    """Short prompts from prompts_file (default: the demo's held-out prompts); long text from the
    held-out corpus, or from the prompts file itself when the corpus is unavailable."""
    path = Path(prompts_file) if prompts_file else DEFAULT_PROMPTS
    prompts = read_prompts_file(path) if path.is_file() else []
    if prompts_file:
        documents, long_text = [], "the prompts file, concatenated"
    else:
        documents, why = heldout_documents()
        long_text = why if documents else f"the prompts, concatenated ({why})"
    encode = lambda s: tokenizer.encode(s).ids  # noqa: E731
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    return TextSource(prompts, documents, encode, decode), {
        "short_prompts": shown(path) if prompts else "none", "long_text": long_text}
