"""Append-only shards of finished items, written atomically, so a killed run resumes exactly.

A shard is `shards/shard-NNNNN.jsonl`, one finished item per line. It is written whole to a
temporary name, fsynced and renamed into place (os.replace is atomic on POSIX), so a shard is
either complete or absent: a run killed at any point leaves only whole shards and, at worst, a
stale `*.tmp` that the next run deletes. The items that were finished but not yet in a shard are
generated again on resume; an item id is in at most one shard, so nothing is duplicated.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator


class ShardStore:
    def __init__(self, folder: Path, shard_size: int):
        self.folder = Path(folder) / "shards"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.shard_size = shard_size
        for stale in self.folder.glob("*.tmp"):
            stale.unlink()
        self._pending: list[dict] = []
        self._next = 1 + max((int(p.stem.split("-")[1]) for p in self._shards()), default=-1)

    def _shards(self) -> list[Path]:
        return shard_files(self.folder)

    def records(self) -> Iterator[dict]:
        return read_records(self.folder)

    def done_ids(self) -> set[str]:
        return {r["id"] for r in self.records()}

    def add(self, record: dict) -> None:
        self._pending.append(record)
        if len(self._pending) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        path = self.folder / f"shard-{self._next:05d}.jsonl"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for r in self._pending:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._next += 1
        self._pending = []


def shard_files(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob("shard-*.jsonl"))


def read_records(folder: Path) -> Iterator[dict]:
    """The records of the whole shards in `folder` (a `shards/` folder), in order. Read-only:
    safe beside a run that is still writing (unlike opening a ShardStore, which clears *.tmp)."""
    for path in shard_files(folder):
        with open(path) as f:
            for line in f:
                yield json.loads(line)


def write_atomic(path: Path, text: str) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
