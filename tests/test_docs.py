"""The README and docs/ say only what the tree holds: links and file mentions resolve, the README
stays a user's page (≤ 300 lines), its method table lists the registered methods, and code cites
docs/design.md by section names that exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DESIGN = ROOT / "docs" / "design.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")    # [text](target)
CODE = re.compile(r"`([^`\n]+)`")                # `inline code`
CITATION = re.compile(r"docs/design\.md,? '([^']+)'")
# A mention is a file path only when it starts at a top-level entry of the repository; what the
# repository ignores (work_dirs/, checkpoints/, ...) is made by commands, so it is not checked.
IGNORED = {"work_dirs", "build", "runs", "data", "checkpoints"}
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".") and p.name not in IGNORED}
PLACEHOLDER = re.compile(r"[<>*{}$…|=\s]|\.\.\.|path/to")
# Checkpoint files a page names as a format (a Hugging Face folder's), not as files of this tree.
FORMAT_NAMES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "model.safetensors", "pytorch_model.bin"}
DATA_SUFFIXES = (".json", ".jsonl", ".png", ".md", ".txt", ".jinja")


def _relative(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


def _prose(page: Path) -> str:
    """The page without its fenced code blocks (shell lines there name files a command makes)."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def _mentioned_paths(page: Path) -> list[str]:
    found = []
    for text in CODE.findall(_prose(page)):
        text = text.strip().rstrip("/")
        if not text or PLACEHOLDER.search(text) or text.startswith(("/", "http")):
            continue
        first = text.split("/")[0]
        if first in TOP and (first != text or "." in text):
            found.append(text)
        elif "/" in text and (page.parent / first).is_dir() and page.parent != ROOT:
            found.append(text)  # a path inside a report's own folder
        elif "/" not in text and text.endswith(DATA_SUFFIXES) and text not in FORMAT_NAMES \
                and page.parent != ROOT and page.parent.parent == ROOT / "docs":
            found.append(text)  # a report's own data file, beside its page (docs/<topic>/)
    return found


def _command_paths(page: Path) -> list[str]:
    """Repository paths in the page's fenced commands: the scripts they run, the files they read and
    the committed reports they write."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", page.read_text(), flags=re.S | re.M)
    words = (w.strip("'\"()[],;:").rstrip("/") for block in blocks for w in block.split())
    return [w for w in words if "/" in w and w.split("/")[0] in TOP and not PLACEHOLDER.search(w)]


def test_readme_is_a_page_a_user_reads():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail to docs/"
    text = README.read_text()
    assert "DESIGN.md" not in text and "bench.lock" not in text


@pytest.mark.parametrize("page", PAGES, ids=_relative)
def test_relative_links_resolve(page: Path):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path) if path else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(target)
    assert not broken, f"{_relative(page)}: links to nothing: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=_relative)
def test_mentioned_files_exist(page: Path):
    missing = [p for p in (*_mentioned_paths(page), *_command_paths(page))
               if not (ROOT / p).exists() and not (page.parent / p).exists() and not _made_by_a_command(p)
               and not _is_output_prefix(p)]
    assert not missing, f"{_relative(page)} names files the tree does not have: {missing}"


def _is_output_prefix(path: str) -> bool:
    """`--out docs/x/report` of a benchmark that writes report.json and report.md: the prefix names
    no file itself, its two reports must both be in the tree."""
    stem = ROOT / path
    return not stem.suffix and stem.with_suffix(".json").exists() and stem.with_suffix(".md").exists()


def _made_by_a_command(path: str) -> bool:
    """A path the repository ignores (models/smollm2/target/, made by `make smollm2`) is made by a
    command the page gives, not a file of the tree."""
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0


def test_the_mention_check_sees_paths():
    """The checker itself: it picks repository paths and report files, and skips placeholders."""
    mentions = _mentioned_paths(ROOT / "docs" / "eagle" / "README.md")
    assert "specserve/methods/eagle/proposer.py" in mentions and "triton_fp32.json" in mentions
    assert not any("path/to" in m for m in mentions)


def _method_table_rows() -> list[str]:
    text = README.read_text()
    section = text.split("## Methods, and when to use which", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M)


def test_readme_method_table_has_one_row_per_method():
    rows = _method_table_rows()
    assert rows and len(rows) == len(set(rows)), rows


def test_readme_method_table_matches_the_registry():
    registry = pytest.importorskip("specserve.methods.registry",
                                   reason="the method registry is not in this tree yet")
    assert set(_method_table_rows()) == set(registry.names())


def test_code_cites_design_sections_that_exist():
    sections = {line[3:].strip() for line in DESIGN.read_text().splitlines() if line.startswith("## ")}
    stale, unknown = [], []
    for folder in ("specserve", "tests", "training", "benchmarks", "scripts",
                   "clients", "deploy", "docs", "models"):
        for f in (ROOT / folder).rglob("*"):
            if f.suffix not in (".py", ".md", ".sh", ".yaml", ".yml") or f == Path(__file__):
                continue
            text = f.read_text(errors="replace")
            if re.search(r"DESIGN\.md §", text):
                stale.append(_relative(f))
            unknown += [f"{_relative(f)}: {name}" for name in CITATION.findall(text)
                        if name not in sections]
    assert not stale, f"cite docs/design.md by section name, not DESIGN.md §N: {stale}"
    assert not unknown, f"citations of docs/design.md sections that do not exist: {unknown}"
