"""Paths as reports show them: relative to the repository root when inside it, so committed
reports never carry the path of the machine that wrote them."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def shown(path: str | Path) -> str:
    p = Path(path).resolve()
    try:
        return str(p.relative_to(REPO))
    except ValueError:
        return str(path)
