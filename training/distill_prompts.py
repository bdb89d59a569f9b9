"""Training prompts composed on this machine from text found on it (issue 22, item 1).

Each source yields snippets of real text; an instruction template turns a snippet into a user
turn (summarise, explain, rewrite, continue, convert to JSON, translate, ...). The sources:

  man          English manual pages (/usr/share/man/man*), troff markup stripped
  man_i18n     manual pages in other languages (/usr/share/man/<lang>/), asked about in English
  doc          READMEs and other text under /usr/share/doc (copyright files skipped)
  stdlib_code  functions and classes of Python's standard library source, by the ast module
  stdlib_doc   module docstrings of the standard library (prose about code)
  package_doc  installed packages' own documentation (dist-info METADATA descriptions, *.md, *.rst)
  self         instructions the target writes itself: it is asked, with its chat template, to
               write one question about a snippet (phase "question"); its answer becomes a prompt
               (phase "response", see self_instruct_prompt)

The plan is deterministic for a seed and a file tree, and the tool writes it once to the output
folder, so a resumed run never depends on the machine's files staying the same.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import os
import random
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

# Share of the composed prompts drawn from each source; "self" counts question requests.
DEFAULT_SHARES = {"man": 0.20, "man_i18n": 0.06, "doc": 0.12, "stdlib_code": 0.22,
                  "stdlib_doc": 0.08, "package_doc": 0.14, "self": 0.18}
MIN_CHARS, MAX_CHARS = 200, 1200


@dataclass(frozen=True)
class Sources:
    """Where each source's files are; tests point these at small folders of their own."""
    man: tuple[Path, ...] = ()
    doc: tuple[Path, ...] = ()
    stdlib: tuple[Path, ...] = ()
    packages: tuple[Path, ...] = ()

    @classmethod
    def of_this_machine(cls) -> "Sources":
        import site
        import sysconfig

        return cls(man=(Path("/usr/share/man"),), doc=(Path("/usr/share/doc"),),
                   stdlib=(Path(sysconfig.get_paths()["stdlib"]),),
                   packages=tuple(Path(p) for p in site.getsitepackages()))


@dataclass(frozen=True)
class PlannedPrompt:
    id: str                 # stable: a hash of source, file and text
    phase: str              # "question" (the target writes an instruction) | "response"
    source: str
    template: str
    origin: str             # the file the snippet came from, relative to the folder searched
                            # ("man/man1/ls.1.gz", "site-packages/x.dist-info/METADATA"): no
                            # path of the machine that planned goes into committed data
    messages: list[dict] = field(hash=False)


# -- reading the sources --------------------------------------------------------------------

_TROFF_ESCAPES = [(r"\\f(\[[^\]]*\]|\(..|.)", ""), (r"\\\(em|\\\(en", "-"), (r"\\\((lq|rq|dq)", '"'),
                  (r"\\\(..", ""), (r"\\[-]", "-"), (r"\\e", "\\\\"), (r"\\[&|^,/ ]", ""), (r"\\\*\S", "")]


def troff_to_text(src: str) -> str:
    """Manual-page markup to plain text, roughly: headings and body text kept, requests dropped."""
    out: list[str] = []
    for line in src.splitlines():
        if line.startswith((".", "'")):
            request, _, args = line.partition(" ")
            if request in (".SH", ".SS"):
                out += ["", args.strip().strip('"'), ""]
                continue
            if request in (".PP", ".LP", ".P", ".sp", ".IP", ".TP"):
                out.append("")
                if request == ".IP" and args:
                    out.append(args.split('" ')[0].strip('"'))
                continue
            if request not in (".B", ".I", ".BR", ".IR", ".BI", ".RB", ".RI", ".IB"):
                continue   # comments and every other request
            line = " ".join(part.strip('"') for part in args.split())
        for pattern, repl in _TROFF_ESCAPES:
            line = re.sub(pattern, repl, line)
        out.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


def read_text(path: Path) -> str | None:
    try:
        raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError):
        return None
    if b"\0" in raw[:4096]:
        return None
    return raw.decode("utf-8", errors="replace")


def snippet_of(text: str, rng: random.Random) -> str | None:
    """A run of whole paragraphs, MIN_CHARS..MAX_CHARS long, starting at a random paragraph."""
    paras = [p.strip() for p in re.split(r"\n\s*\n", text) if len(p.strip()) > 20]
    if not paras:
        return None
    start = rng.randrange(len(paras))
    chunk = ""
    for p in paras[start:]:
        if len(chunk) + len(p) > MAX_CHARS:
            break
        chunk = f"{chunk}\n\n{p}" if chunk else p
        if len(chunk) >= MIN_CHARS and rng.random() < 0.5:
            break
    if len(chunk) < MIN_CHARS:
        if not chunk and len(paras[start]) > MAX_CHARS:
            cut = paras[start][:MAX_CHARS]
            chunk = cut[:cut.rfind("\n")] if "\n" in cut else cut
        if len(chunk) < MIN_CHARS:
            return None
    return chunk


def code_snippet_of(text: str, rng: random.Random) -> str | None:
    """One function or class of a module, whole, short enough to quote."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    rng.shuffle(nodes)
    for node in nodes:
        # padded: a method's first line keeps its indentation, so dedent sees the whole block.
        seg = ast.get_source_segment(text, node, padded=True)
        seg = textwrap.dedent(seg) if seg else seg
        if seg and MIN_CHARS <= len(seg) <= MAX_CHARS + 300 and seg.count("\n") >= 4:
            return seg
    return None


def module_docstring_of(text: str, rng: random.Random) -> str | None:
    try:
        doc = ast.get_docstring(ast.parse(text))
    except (SyntaxError, ValueError):
        return None
    return snippet_of(doc, rng) if doc else None


@dataclass(frozen=True, order=True)
class Found:
    """A file found under a searched root: `path` to read it, `origin` to record it."""
    origin: str     # the root's own name, then the path below it: "man/man1/ls.1.gz"
    path: Path


def origin_of(root: Path, path: Path) -> str:
    return (Path(root.name) / path.relative_to(root)).as_posix()


def _files(roots: tuple[Path, ...], keep: Callable[[Path], bool], prune: tuple[str, ...] = (),
           max_depth: int = 99) -> list[Found]:
    """Files under `roots` that `keep` takes, not descending into folders named in `prune` or
    deeper than `max_depth` (site-packages holds torch's tens of thousands of files)."""
    found = []
    for root in roots:
        base = len(root.parts)
        for folder, dirs, names in os.walk(root):
            here = Path(folder)
            dirs[:] = sorted(d for d in dirs if d not in prune and len(here.parts) - base < max_depth)
            found += [Found(origin_of(root, here / n), here / n) for n in names if keep(here / n)]
    return sorted(set(found))


def _is_english_man(p: Path) -> bool:
    return p.parent.name.startswith("man") and p.parent.parent.name == "man"


def _is_i18n_man(p: Path) -> bool:
    return p.parent.name.startswith("man") and p.parent.parent.name != "man"


def _is_doc(p: Path) -> bool:
    name = p.name.lower()
    return ("copyright" not in name and "changelog" not in name and p.suffix not in (".html", ".png", ".svg")
            and re.match(r"(readme|news|faq|todo|authors|thanks|usage|install|.*\.(md|txt|rst))", name) is not None)


def _is_stdlib_py(p: Path) -> bool:
    return p.suffix == ".py"


STDLIB_PRUNE = ("site-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3")


def _is_package_doc(p: Path) -> bool:
    return (p.name == "METADATA" and p.parent.name.endswith(".dist-info")) or p.suffix in (".md", ".rst")


def _metadata_body(text: str) -> str:
    # METADATA: email-style headers, a blank line, then the long description.
    return text.split("\n\n", 1)[1] if "\n\n" in text else ""


@dataclass(frozen=True)
class SourceKind:
    files: Callable[[Sources], list[Found]]
    snippet: Callable[[str, random.Random], str | None]
    templates: tuple[tuple[str, str], ...]   # (name, "...{text}...")
    prepare: Callable[[str], str] = lambda t: t


PROSE = (
    ("summarise", "Summarise the following text in two or three sentences.\n\n{text}"),
    ("explain", "Explain in simple terms what this passage says.\n\n{text}"),
    ("rewrite", "Rewrite this text in plain English for a beginner.\n\n{text}"),
    ("continue", "Continue this text with one more paragraph in the same style.\n\n{text}"),
    ("json", "Extract the key facts from this text as a JSON object.\n\n{text}"),
    ("bullets", "Turn this text into a bulleted list of its main points.\n\n{text}"),
    ("translate_fr", "Translate the first two sentences of this text into French.\n\n{text}"),
    ("translate_es", "Translate the first two sentences of this text into Spanish.\n\n{text}"),
    ("questions", "Write three questions a reader might ask about this text, each with a short answer.\n\n{text}"),
    ("title", "Suggest a short title for this text and explain your choice in one sentence.\n\n{text}"),
)
MAN = PROSE + (
    ("man_example", "Here is part of a Unix manual page. Give an example command that uses what it describes, and explain it.\n\n{text}"),
    ("man_table", "Summarise the options described in this manual excerpt as a Markdown table.\n\n{text}"),
)
I18N = (
    ("to_english", "Translate this text into English.\n\n{text}"),
    ("summarise_en", "Summarise this text in English.\n\n{text}"),
    ("explain_en", "What is this text about? Answer in English.\n\n{text}"),
)
CODE = (
    ("explain_code", "Explain what this Python code does.\n\n```python\n{text}\n```"),
    ("docstring", "Add type hints and a docstring to this Python code.\n\n```python\n{text}\n```"),
    ("unit_test", "Write a unit test for this Python code.\n\n```python\n{text}\n```"),
    ("simplify", "Rewrite this Python code to be shorter and clearer, keeping its behaviour.\n\n```python\n{text}\n```"),
    ("to_javascript", "Convert this Python code to JavaScript.\n\n```python\n{text}\n```"),
    ("review", "Review this Python code: list possible bugs or improvements.\n\n```python\n{text}\n```"),
    ("comment", "Add a comment to each important line of this Python code.\n\n```python\n{text}\n```"),
)
# The request that makes the target write an instruction itself (phase "question").
SELF = (
    ("self_question", "Here is a text:\n\n{text}\n\nWrite one question or instruction that a user might give an AI "
                      "assistant about this topic. Reply with the question only."),
)

KINDS: dict[str, SourceKind] = {
    "man": SourceKind(lambda s: _files(s.man, _is_english_man), snippet_of, MAN, troff_to_text),
    "man_i18n": SourceKind(lambda s: _files(s.man, _is_i18n_man), snippet_of, I18N, troff_to_text),
    "doc": SourceKind(lambda s: _files(s.doc, _is_doc), snippet_of, PROSE),
    "stdlib_code": SourceKind(lambda s: _files(s.stdlib, _is_stdlib_py, STDLIB_PRUNE), code_snippet_of, CODE),
    "stdlib_doc": SourceKind(lambda s: _files(s.stdlib, _is_stdlib_py, STDLIB_PRUNE), module_docstring_of, PROSE),
    "package_doc": SourceKind(lambda s: _files(s.packages, _is_package_doc, max_depth=2), snippet_of, PROSE),
}


def _prepare(kind: str, path: Path, text: str) -> str:
    text = KINDS[kind].prepare(text)
    return _metadata_body(text) if path.name == "METADATA" else text


def prompt_id(*parts: str) -> str:
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:16]


def _draw(files: list[tuple[str, Found]], n: int, rng: random.Random, templates, phase: str,
          accept: Callable[[list[dict]], bool], source: str) -> Iterator[PlannedPrompt]:
    """Up to n prompts from `files` ((kind, file): the kind says how to read the file), a file
    visited again only once every file was, each snippet used once."""
    seen: set[str] = set()
    made = 0
    tries = 0
    order = list(files)
    rng.shuffle(order)
    while made < n and order and tries < 20 * n + 100:
        kind, found = order[tries % len(order)]
        path = found.path
        tries += 1
        text = read_text(path)
        if text is None:
            continue
        snippet = KINDS[kind].snippet(_prepare(kind, path, text), rng)
        if snippet is None:
            continue
        key = re.sub(r"\s+", " ", snippet)
        if key in seen:
            continue
        seen.add(key)
        name, template = rng.choice(templates)
        messages = [{"role": "user", "content": template.format(text=snippet)}]
        if not accept(messages):
            continue
        made += 1
        yield PlannedPrompt(prompt_id(source, found.origin, name, snippet), phase, source, name, found.origin,
                            messages)


@dataclass
class PlanReport:
    """What planning found and dropped, for the data card."""
    files: dict[str, int] = field(default_factory=dict)
    planned: dict[str, int] = field(default_factory=dict)
    refused_heldout: int = 0
    refused_length: int = 0
    avoided: dict[str, int] = field(default_factory=dict)   # files left out: an earlier plan drew from them


def plan_prompts(sources: Sources, total: int, seed: int, accept: Callable[[list[dict]], str | None],
                 shares: dict[str, float] | None = None,
                 avoid_origins: frozenset[str] = frozenset()) -> tuple[list[PlannedPrompt], PlanReport]:
    """`total` prompts (fewer where a source runs dry), shuffled so any prefix mixes sources.
    `accept(messages)` → None to keep, or "heldout" / "length" to say why it is dropped.
    `avoid_origins`: files an earlier plan drew from (their origins), left out whole, so a second
    folder of data shares no snippet with the first (nor its validation split one with the
    first's training items)."""
    shares = shares or DEFAULT_SHARES
    report = PlanReport()
    rng = random.Random(seed)

    def keep(messages: list[dict]) -> bool:
        why = accept(messages)
        if why == "heldout":
            report.refused_heldout += 1
        elif why == "length":
            report.refused_length += 1
        return why is None

    prompts: list[PlannedPrompt] = []
    file_lists: dict[str, list[Found]] = {}
    for kind in KINDS:
        found = KINDS[kind].files(sources)
        file_lists[kind] = [f for f in found if f.origin not in avoid_origins]
        report.files[kind] = len(found)
        if avoid_origins:
            report.avoided[kind] = len(found) - len(file_lists[kind])
    for source, share in shares.items():
        n = round(total * share)
        if source == "self":
            # Question requests about prose snippets of every source but code.
            pool = [(k, p) for k in ("man", "doc", "package_doc") for p in file_lists[k]]
            drawn = list(_draw(pool, n, random.Random(rng.random()), SELF, "question", keep, "self"))
        else:
            drawn = list(_draw([(source, p) for p in file_lists[source]], n, random.Random(rng.random()),
                               KINDS[source].templates, "response", keep, source))
        report.planned[source] = len(drawn)
        prompts += drawn
    rng.shuffle(prompts)
    return prompts, report


# Replies that answer the request instead of writing a question (SmolLM2's greedy reply to the
# question request is often "I'm ready to help. What's your question?").
NOT_A_QUESTION = re.compile(r"^(i'm|i am|i'd|i would|sure|of course|certainly|great|okay|ok|here)\b"
                            r"|your (next )?question|ready to (help|assist)", re.I)


def self_instruct_prompt(question_text: str, snippet_message: str, rng: random.Random) -> list[dict] | None:
    """The target's own question (phase "question" output) as a user turn: alone, or after the
    snippet it was asked about. None when the answer is not a usable question."""
    lines = [ln.strip() for ln in question_text.strip().splitlines() if ln.strip()]
    if not lines:
        return None
    q = re.sub(r"^(question|instruction|q)\s*[:.]\s*", "", lines[0], flags=re.I).strip().strip('"').strip()
    if not 12 <= len(q) <= 300 or NOT_A_QUESTION.search(q):
        return None
    if rng.random() < 0.5:
        return [{"role": "user", "content": q}]
    text = snippet_message.split("\n\n", 1)[1].rsplit("\n\nWrite one question", 1)[0]
    return [{"role": "user", "content": f"{text}\n\n{q}"}]
