"""Make the typo'd held-out prompt set for the MTP benchmark (seeded, so it is reproducible).

Every held-out prompt (models/demo/heldout_prompts.jsonl) gets max(3, words // N) typos (N = 12,
--words-per-typo), each in
a different word: a run of ≥ 3 ASCII letters, in prose or in code alike (identifiers, keywords and
words inside strings and docstrings; never punctuation, digits, whitespace or indentation, so
the code keeps its shape while its names are misspelt). A typo is one of: swap two adjacent
letters, drop a letter, insert a letter next to it on a QWERTY keyboard, or replace a letter with
such a neighbour.

    python benchmarks/make_typo_prompts.py [--seed 12] [--out docs/mtp/typo_prompts.jsonl]
    # the heavy set of the robustness table (a typo in every second word):
    python benchmarks/make_typo_prompts.py --seed 13 --words-per-typo 2 --out docs/mtp/typo_prompts_heavy.jsonl
    # the renamed set: 3 words that recur in the prompt misspelt the same way at every occurrence
    # (a misspelt name used throughout), so the continuation the target writes repeats them
    python benchmarks/make_typo_prompts.py --seed 14 --consistent --out docs/mtp/typo_prompts_renamed.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = ("qwertyuiop", "asdfghjkl", "zxcvbnm")
WORD = re.compile(r"[A-Za-z]{3,}")


def neighbours(c: str) -> str:
    low = c.lower()
    for r, row in enumerate(ROWS):
        if low in row:
            i = row.index(low)
            near = row[max(0, i - 1):i] + row[i + 1:i + 2]
            near += "".join(ROWS[q][i] for q in (r - 1, r + 1) if 0 <= q < len(ROWS) and i < len(ROWS[q]))
            return near.upper() if c.isupper() else near
    return low


def typo(word: str, rng: random.Random) -> tuple[str, str]:
    """One typo inside `word` → (new word, kind)."""
    kind = rng.choice(("swap", "drop", "insert", "replace"))
    i = rng.randrange(len(word) - 1) if kind == "swap" else rng.randrange(len(word))
    if kind == "swap" and word[i] != word[i + 1]:
        return word[:i] + word[i + 1] + word[i] + word[i + 2:], kind
    if kind == "drop":
        return word[:i] + word[i + 1:], kind
    if kind == "insert":
        return word[:i + 1] + rng.choice(neighbours(word[i])) + word[i + 1:], kind
    new = rng.choice([c for c in neighbours(word[i]) if c != word[i]] or ["x"])
    return word[:i] + new + word[i + 1:], "replace"


def corrupt(text: str, rng: random.Random, words_per_typo: int = 12) -> tuple[str, list[dict]]:
    words = list(WORD.finditer(text))
    n = max(3, len(words) // words_per_typo)
    if len(words) < n:
        raise ValueError(f"prompt has {len(words)} words of ≥ 3 letters, needs {n}")
    picked = sorted(rng.sample(range(len(words)), n))
    out, last, done = [], 0, []
    for k in picked:
        m = words[k]
        new, kind = typo(m.group(), rng)
        out += [text[last:m.start()], new]
        last = m.end()
        done.append({"at": m.start(), "word": m.group(), "typo": new, "kind": kind})
    out.append(text[last:])
    return "".join(out), done


def corrupt_consistently(text: str, rng: random.Random, n: int = 3) -> tuple[str, list[dict]]:
    """n distinct words (≥ 3 letters), the most frequent first (ties broken by the seeded rng), each
    misspelt one way and replaced at every whole-word occurrence."""
    counts: dict[str, int] = {}
    for m in WORD.finditer(text):
        counts[m.group()] = counts.get(m.group(), 0) + 1
    words = sorted(counts, key=lambda w: (-counts[w], rng.random()))
    if len(words) < n:
        raise ValueError(f"prompt has {len(words)} distinct words of ≥ 3 letters, needs {n}")
    done = []
    for word in words[:n]:
        new, kind = typo(word, rng)
        while new == word or new in counts:   # a real change, not another word of the prompt
            new, kind = typo(word, rng)
        text = re.sub(rf"(?<![A-Za-z]){word}(?![A-Za-z])", new, text)
        done.append({"word": word, "typo": new, "kind": kind, "occurrences": counts[word]})
    return text, done


def main(argv: list[str] | None = None) -> None:
    from specserve.core.paths import shown

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--out", type=Path, default=ROOT / "docs/mtp/typo_prompts.jsonl")
    ap.add_argument("--words-per-typo", type=int, default=12)
    ap.add_argument("--consistent", action="store_true",
                    help="misspell the 3 most frequent words the same way at every occurrence")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    rows = []
    for line in (ROOT / "models/demo/heldout_prompts.jsonl").read_text().splitlines():
        h = json.loads(line)
        text, typos = (corrupt_consistently(h["prompt"], rng) if args.consistent
                       else corrupt(h["prompt"], rng, args.words_per_typo))
        assert text != h["prompt"] and len(typos) >= 3
        rows.append({"id": h["id"], "kind": h["kind"], "prompt": text, "clean": h["prompt"], "typos": typos})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"{len(rows)} prompts, {sum(r.get('occurrences', 1) for row in rows for r in row['typos'])} typos (≥ 3 each) → {shown(args.out)}")


if __name__ == "__main__":
    main()
