"""Self-distillation data for any target: the target's own responses to prompts made here.

    python training/distill_data.py --target models/smollm2/target --out work_dirs/smollm2_distill \
        [--prompts 3000] [--max-tokens 256] [--temperature 0.7] [--sampled-share 0.5] [--dtype float32]

Prompts come from text found on this machine (training/distill_prompts.py: manual pages, docs,
the standard library's source, installed packages' docs) and from instructions the target writes
itself (phase "question": it is asked to write a question about a snippet; its answer is then a
prompt of phase "response"). Each prompt is rendered with the target's chat template
(transformers' apply_chat_template, as the OpenAI API does) and answered by our engine, batched
(plain decoding: the tokens are the target's own), greedy or sampled at --temperature with a
per-item seed (reproducible whatever the batch: seeded sampling is position-keyed).

Held-out prompts never enter: a planned prompt that equals or contains one of the held-out chat
set or HumanEval (training/heldout.py) is dropped and counted, and every item is checked again,
raising HeldoutLeak, right before it is submitted.

Output folder (resumable: run the same command again after a kill; nothing is duplicated or lost):
  run.json       the settings; a resumed run must have the same ones
  plan.jsonl.gz  the planned prompts (gzip, deterministic), written once (a resumed run does not re-read the machine)
  shards/        finished items, whole shards only (training/distill_shards.py); each line:
                 id, phase, source, template, origin, messages, prompt_ids, response_ids,
                 response_text, finish_reason, sampling {temperature, seed, max_tokens}
  summary.json   counts by source, phase and sampling, tokens, refusals: what the data card reports
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import distill_prompts  # noqa: E402
import heldout  # noqa: E402
from distill_shards import ShardStore, gzip_lines, read_gzip_lines, write_atomic  # noqa: E402

PLAN_FILE, RUN_FILE, SUMMARY_FILE = "plan.jsonl.gz", "run.json", "summary.json"


@dataclass(frozen=True)
class DistillConfig:
    target: Path
    out: Path
    prompts: int = 3000
    seed: int = 0
    max_tokens: int = 256
    question_tokens: int = 64
    temperature: float = 0.7
    sampled_share: float = 0.5     # share of items sampled at `temperature`; the rest greedy
    max_num_seqs: int = 16
    max_model_len: int = 1024
    dtype: str = "float32"
    shard_size: int = 32
    heldout_chat: Path = heldout.CHAT_SET
    avoid_plans: tuple[Path, ...] = ()   # earlier folders whose plans' files this plan leaves out
    shares: tuple[tuple[str, float], ...] = ()   # (source, weight) overriding DEFAULT_SHARES'

    def plan_shares(self) -> dict[str, float]:
        """DEFAULT_SHARES with `shares` put in, scaled to sum to 1 (weights, not fractions, so
        raising one source's share lowers the others in proportion)."""
        merged = dict(distill_prompts.DEFAULT_SHARES)
        for source, weight in self.shares:
            if source not in merged:
                raise ValueError(f"unknown prompt source {source!r}; sources: {', '.join(merged)}")
            if weight < 0:
                raise ValueError(f"share of {source!r} is negative ({weight})")
            merged[source] = weight
        total = sum(merged.values())
        if total <= 0:
            raise ValueError("every share is 0: nothing to plan")
        return {k: v / total for k, v in merged.items()}

    def settings(self) -> dict:
        """What must not change between a run and its resumption. Files count by content, not by
        path, so a run may resume from another checkout or with the target found elsewhere.
        `max_num_seqs` is left out: it sets how many rows decode together, which changes speed but
        not a record (each response equals the engine's output for its prompt alone), so a
        resumed run may batch wider (48 rows decode 2.3x the tokens/s of 16 here)."""
        d = {k: v for k, v in asdict(self).items()
             if k not in ("out", "target", "heldout_chat", "max_num_seqs", "avoid_plans", "shares")}
        if self.shares:   # only when set, so folders planned before the option keep their settings
            d["shares"] = self.plan_shares()
        if self.avoid_plans:   # by content: the plans, wherever their folders are
            d["avoid_plans_sha1"] = [hashlib.sha1((Path(f) / PLAN_FILE).read_bytes()).hexdigest()
                                     for f in self.avoid_plans]
        d["heldout_chat_sha1"] = hashlib.sha1(Path(self.heldout_chat).read_bytes()).hexdigest()
        d["target_config_sha1"] = hashlib.sha1((self.target / "config.json").read_bytes()).hexdigest()
        d["target_weights_sha1"] = _weights_id(self.target)
        return d


def _weights_id(target: Path) -> str:
    """Names and sizes of the weight files: cheap, and changes when the checkpoint does."""
    files = sorted(target.glob("*.safetensors"))
    return hashlib.sha1(json.dumps([(f.name, f.stat().st_size) for f in files]).encode()).hexdigest()


@dataclass(frozen=True)
class Sampling:
    temperature: float
    seed: int | None
    max_tokens: int


@dataclass(frozen=True)
class Item:
    id: str
    phase: str
    source: str
    template: str
    origin: str
    messages: list[dict] = field(hash=False)
    sampling: Sampling = field(hash=False, default=Sampling(0.0, None, 0))


class SettingsChanged(RuntimeError):
    """The output folder holds a run with other settings."""


def sampling_for(item_id: str, cfg: DistillConfig, max_tokens: int) -> Sampling:
    """Greedy or sampled, by a hash of the id: stable across runs, about `sampled_share` sampled."""
    h = int(hashlib.sha1(item_id.encode()).hexdigest()[:12], 16)
    if (h % 10_000) / 10_000 < cfg.sampled_share:
        return Sampling(cfg.temperature, h % (2 ** 31), max_tokens)
    return Sampling(0.0, None, max_tokens)


class PromptRenderer:
    """Messages → the token ids serving sends: the chat template rendered, then tokenized."""

    def __init__(self, target: Path):
        from specserve.openai.chat import ChatTemplate

        self.template = ChatTemplate(target)
        self.tokenizer = self.template.tokenizer

    def ids(self, messages: list[dict]) -> list[int]:
        return self.tokenizer(self.template.render(messages)).input_ids

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _item_of(row: dict) -> Item:
    return Item(row["id"], row["phase"], row["source"], row["template"], row["origin"], row["messages"],
                Sampling(**row["sampling"]))


def _row_of(item: Item) -> dict:
    return {**asdict(item), "sampling": asdict(item.sampling)}


def load_or_plan(cfg: DistillConfig, sources: distill_prompts.Sources, guard: heldout.HeldoutGuard,
                 renderer: PromptRenderer) -> tuple[list[Item], dict]:
    """The run's plan: read back when the folder has one, else made now and written once."""
    run_file, plan_file = cfg.out / RUN_FILE, cfg.out / PLAN_FILE
    settings = cfg.settings()
    if run_file.exists():
        saved = json.loads(run_file.read_text())
        saved["settings"].pop("max_num_seqs", None)   # recorded by runs made before it was left out
        if saved["settings"] != settings:
            changed = sorted(k for k in settings.keys() | saved["settings"].keys()
                             if saved["settings"].get(k) != settings.get(k))
            raise SettingsChanged(f"{cfg.out} holds a run with other settings ({', '.join(changed)}); "
                                  f"use another --out or the same settings")
        if plan_file.exists():
            items = [_item_of(json.loads(line)) for line in read_gzip_lines(plan_file)]
            return items, saved["plan_report"]
    limit = cfg.max_model_len - cfg.max_tokens

    def accept(messages: list[dict]) -> str | None:
        if any(guard.leak(m["content"]) for m in messages):
            return "heldout"
        return "length" if len(renderer.ids(messages)) > limit else None

    avoid = frozenset(row["origin"] for f in cfg.avoid_plans for row in map(json.loads, read_gzip_lines(Path(f) / PLAN_FILE)))
    planned, report = distill_prompts.plan_prompts(sources, cfg.prompts, cfg.seed, accept,
                                                    shares=cfg.plan_shares(), avoid_origins=avoid)
    items = [Item(p.id, p.phase, p.source, p.template, p.origin, p.messages,
                  sampling_for(p.id, cfg, cfg.question_tokens if p.phase == "question" else cfg.max_tokens))
             for p in planned]
    cfg.out.mkdir(parents=True, exist_ok=True)
    write_atomic(plan_file, gzip_lines(json.dumps(_row_of(i), ensure_ascii=False) for i in items))
    report_d = asdict(report)
    write_atomic(run_file, json.dumps({"settings": settings, "plan_report": report_d}, indent=1))
    return items, report_d


def derived_items(questions: Iterable[dict], plan: dict[str, Item], cfg: DistillConfig,
                  guard: heldout.HeldoutGuard, renderer: PromptRenderer, refused: Counter) -> list[Item]:
    """Phase "response" items made of the target's own questions (finished phase "question" items)."""
    limit = cfg.max_model_len - cfg.max_tokens
    out = []
    for q in sorted(questions, key=lambda r: r["id"]):
        rng = random.Random(q["id"])
        messages = distill_prompts.self_instruct_prompt(q["response_text"], plan[q["id"]].messages[0]["content"], rng)
        if messages is None:
            refused["unusable_question"] += 1
            continue
        if any(guard.leak(m["content"]) for m in messages):
            refused["heldout"] += 1
            continue
        if len(renderer.ids(messages)) > limit:
            refused["length"] += 1
            continue
        item_id = f"self-{q['id']}"
        out.append(Item(item_id, "response", "self", "self_answer", q["origin"], messages,
                        sampling_for(item_id, cfg, cfg.max_tokens)))
    return out


def generate(engine, items: list[Item], renderer: PromptRenderer, guard: heldout.HeldoutGuard,
             on_done: Callable[[dict], None], desc: str, done_before: int = 0, total: int | None = None) -> None:
    """Answer `items` through the engine, at most max_num_seqs at once (a finished row's slot
    takes the next item at once), calling on_done with each finished record."""
    from tqdm import tqdm

    from specserve.core.engine import GenerationRequest
    from specserve.core.sampling import SamplingParams

    queue = deque(items)
    inflight: dict[str, tuple[Item, list[int], list[int]]] = {}
    cap = engine.cfg.max_num_seqs
    bar = tqdm(total=total or len(items), initial=done_before, desc=desc, mininterval=10, smoothing=0.05)
    while queue or inflight:
        while queue and len(inflight) < cap:
            item = queue.popleft()
            guard.check(item.messages)   # the last gate: nothing held out reaches the engine
            ids = renderer.ids(item.messages)
            s = item.sampling
            params = SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, seed=s.seed)
            engine.submit(GenerationRequest(item.id, ids, params, "none"))
            inflight[item.id] = (item, ids, [])
        for out in engine.step():
            item, ids, tokens = inflight[out.request_id]
            tokens += out.new_token_ids
            if not out.finished:
                continue
            if out.error:
                raise RuntimeError(f"item {item.id} failed in the engine: {out.error}")
            del inflight[out.request_id]
            on_done({**_row_of(item), "prompt_ids": ids, "response_ids": tokens,
                     "response_text": renderer.text(tokens), "finish_reason": out.finish_reason})
            bar.update(1)
    bar.close()


def build(cfg: DistillConfig):
    from specserve.serving.build import build_engine
    from specserve.serving.settings import DeploymentSettings

    engine, _ = build_engine(DeploymentSettings(cfg.target, max_num_seqs=cfg.max_num_seqs,
                                                max_model_len=cfg.max_model_len, device="cpu",
                                                dtype=cfg.dtype, draft_policy="fixed"))
    return engine


def run(cfg: DistillConfig, sources: distill_prompts.Sources, engine=None,
        on_record: Callable[[dict], None] | None = None) -> dict:
    """Plan (or read the plan), answer every item not yet in a shard, write summary.json.
    `on_record`: called after each finished record is handed to the store (tests kill runs there)."""
    guard = heldout.HeldoutGuard(heldout.load_chat(cfg.heldout_chat) + heldout.load_humaneval())
    renderer = PromptRenderer(cfg.target)
    plan, plan_report = load_or_plan(cfg, sources, guard, renderer)
    store = ShardStore(cfg.out, cfg.shard_size)
    done = store.done_ids()
    engine = engine or build(cfg)
    started = time.perf_counter()
    made = Counter()

    def keep(record: dict) -> None:
        store.add(record)
        made["items"] += 1
        made["tokens"] += len(record["response_ids"])
        if on_record is not None:
            on_record(record)

    by_id = {i.id: i for i in plan}
    questions = [i for i in plan if i.phase == "question"]
    todo = [i for i in questions if i.id not in done]
    generate(engine, todo, renderer, guard, keep, "questions", len(questions) - len(todo), len(questions))
    store.flush()
    refused: Counter = Counter()
    asked = [r for r in store.records() if r["phase"] == "question"]
    responses = [i for i in plan if i.phase == "response"] + derived_items(asked, by_id, cfg, guard, renderer, refused)
    todo = [i for i in responses if i.id not in done]
    generate(engine, todo, renderer, guard, keep, "responses", len(responses) - len(todo), len(responses))
    store.flush()
    seconds = time.perf_counter() - started
    summary = summarise(store, plan_report, dict(refused), guard, cfg)
    summary["last_session"] = {"items": made["items"], "response_tokens": made["tokens"],
                               "seconds": round(seconds, 1),
                               "items_per_min": round(60 * made["items"] / max(seconds, 1e-9), 2),
                               "tokens_per_s": round(made["tokens"] / max(seconds, 1e-9), 2)}
    write_atomic(cfg.out / SUMMARY_FILE, json.dumps(summary, indent=1))
    return summary


def summarise(store: ShardStore, plan_report: dict, refused: dict, guard: heldout.HeldoutGuard,
              cfg: DistillConfig) -> dict:
    by = Counter()
    tokens = Counter()
    for r in store.records():
        mode = "greedy" if r["sampling"]["temperature"] == 0 else f"T={r['sampling']['temperature']}"
        by[f"{r['phase']}/{r['source']}/{mode}"] += 1
        tokens[r["phase"]] += len(r["response_ids"])
        tokens["prompt"] += len(r["prompt_ids"])
    return {"items": dict(sorted(by.items())), "tokens": dict(tokens), "plan": plan_report,
            "refused_self_instruct": refused, "heldout": guard.summary(),
            "engine": {"method": "none", "max_num_seqs": cfg.max_num_seqs, "max_model_len": cfg.max_model_len,
                       "dtype": cfg.dtype, "device": "cpu"}}


def main(argv: list[str] | None = None) -> int:
    d = DistillConfig(Path("."), Path("."))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    for name in ("prompts", "seed", "max_tokens", "question_tokens", "max_num_seqs", "max_model_len", "shard_size"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--sampled-share", type=float, default=d.sampled_share)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=d.dtype)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--avoid-plan-of", type=Path, action="append", default=[], metavar="DIR",
                   help="an earlier output folder: leave out every file its plan drew from (repeatable)")
    p.add_argument("--share", action="append", default=[], metavar="SOURCE=WEIGHT",
                   help="weight of one prompt source (repeatable); the others keep their default "
                        f"weights and all are scaled to sum to 1. Defaults: {distill_prompts.DEFAULT_SHARES}")
    args = p.parse_args(argv)
    shares = []
    for spec in args.share:
        source, sep, weight = spec.partition("=")
        try:
            shares.append((source, float(weight)))
        except ValueError:
            sep = ""
        if not sep:
            p.error(f"--share {spec}: expected SOURCE=WEIGHT, for example self=0.4")
    for f in args.avoid_plan_of:
        if not (f / PLAN_FILE).is_file():
            p.error(f"--avoid-plan-of {f}: no {PLAN_FILE} there")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    cfg = DistillConfig(args.target, args.out, prompts=args.prompts, seed=args.seed, max_tokens=args.max_tokens,
                        question_tokens=args.question_tokens, temperature=args.temperature,
                        sampled_share=args.sampled_share, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.max_model_len, dtype=args.dtype, shard_size=args.shard_size,
                        avoid_plans=tuple(args.avoid_plan_of), shares=tuple(shares))
    try:
        cfg.plan_shares()
    except ValueError as e:
        p.error(f"--share: {e}")
    summary = run(cfg, distill_prompts.Sources.of_this_machine())
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
