"""Append-only shards of finished items, written atomically, so a killed run resumes exactly.

A shard is `shards/shard-NNNNN.jsonl.gz`, one finished item per line, gzip-compressed with no
timestamp (the same records give the same bytes, so a shard committed to git is stored once and
never changes; compressed, the whole SmolLM2 run is a few MB). It is written whole to a
temporary name, fsynced and renamed into place (os.replace is atomic on POSIX), so a shard is
either complete or absent: a run killed at any point leaves only whole shards and, at worst, a
stale `*.tmp` that the next run deletes. The items that were finished but not yet in a shard are
generated again on resume; an item id is in at most one shard, so nothing is duplicated.
"""

from __future__ import annotations

import gzip
import io
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
        self._next = 1 + max((shard_number(p) for p in self._shards()), default=-1)

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
        path = self.folder / f"shard-{self._next:05d}{SHARD_SUFFIX}"
        tmp = self.folder / f"shard-{self._next:05d}.tmp"
        with open(tmp, "wb") as f:
            f.write(gzip_lines(json.dumps(r, ensure_ascii=False) for r in self._pending))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._next += 1
        self._pending = []


SHARD_SUFFIX = ".jsonl.gz"


def shard_number(path: Path) -> int:
    return int(path.name[len("shard-"):-len(SHARD_SUFFIX)])


def shard_files(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob(f"shard-*{SHARD_SUFFIX}"), key=shard_number)


def gzip_lines(lines) -> bytes:
    """Lines as gzip bytes with mtime 0 and no file name in the header: deterministic."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as z:
        for line in lines:
            z.write(line.encode() + b"\n")
    return buf.getvalue()


def read_gzip_lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def read_records(folder: Path) -> Iterator[dict]:
    """The records of the whole shards in `folder` (a `shards/` folder), in order. Read-only:
    safe beside a run that is still writing (unlike opening a ShardStore, which clears *.tmp)."""
    for path in shard_files(folder):
        for line in read_gzip_lines(path):
            yield json.loads(line)


def write_atomic(path: Path, data: str | bytes) -> None:
    tmp = Path(f"{path}.tmp")
    if isinstance(data, bytes):
        tmp.write_bytes(data)
    else:
        tmp.write_text(data)
    os.replace(tmp, path)
