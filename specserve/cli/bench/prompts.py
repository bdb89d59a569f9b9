"""Held-out prompts as every system of a comparison sees them: the text sent to specserve over gRPC
and the token ids handed to in-process peers (transformers, llama.cpp), tokenized as the server's
preprocess does, so a run can check that every system saw the same number of prompt tokens.

Chat prompts (models/<target>/heldout_chat.jsonl: {"kind", "messages"} a line) are rendered by the
checkpoint's chat template (specserve.openai.chat.ChatTemplate, what the OpenAI layer does);
completion prompts (HumanEval's function headers) are sent as they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    index: int
    set_name: str                # "chat" | "humaneval" (or any completion set's name)
    key: str                     # the chat set's line number, HumanEval's task_id
    kind: str                    # the chat set's kind, "code" for HumanEval
    text: str                    # what specserve gets (a chat prompt: rendered, ending with the assistant's opening)
    ids: tuple[int, ...]         # the same text tokenized as preprocess does
    messages: tuple[dict, ...] = ()   # chat prompts only


def balanced_subset(rows: list[dict], n: int, kinds: list[str] | None = None) -> list[dict]:
    """n rows taken round-robin over the kinds (in the order they first appear, or as given),
    each kind's rows in file order, so every kind gets n // len(kinds) or one more."""
    kinds = kinds or list(dict.fromkeys(r["kind"] for r in rows))
    unknown = [k for k in kinds if not any(r["kind"] == k for r in rows)]
    if unknown:
        raise ValueError(f"no prompts of kind {', '.join(unknown)}")
    queues = {k: [r for r in rows if r["kind"] == k] for k in kinds}
    out: list[dict] = []
    while len(out) < n and any(queues.values()):
        for k in kinds:
            if queues[k] and len(out) < n:
                out.append(queues[k].pop(0))
    return out


def read_chat_rows(path: Path) -> list[dict]:
    """The chat set's rows, each with its 1-based line number as "line"."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            rows.append({**json.loads(line), "line": n})
    return rows


def chat_prompts(target: Path, rows: list[dict], start: int = 0) -> list[Prompt]:
    """rows rendered with target's chat template; indices from `start`."""
    from specserve.openai.chat import ChatTemplate

    template = ChatTemplate(target)
    out = []
    for i, row in enumerate(rows, start):
        text = template.render(row["messages"])
        out.append(Prompt(i, "chat", str(row.get("line", i)), row["kind"], text,
                          tuple(template.tokenizer(text).input_ids), tuple(row["messages"])))
    return out


def completion_prompts(target: Path, set_name: str, items: list[tuple[str, str, str]], start: int = 0) -> list[Prompt]:
    """(key, kind, text) items sent as they are; indices from `start`."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(target))
    return [Prompt(i, set_name, key, kind, text, tuple(tokenizer(text).input_ids))
            for i, (key, kind, text) in enumerate(items, start)]
