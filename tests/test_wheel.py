"""`pip install` of the wheel alone gives a working `specserve serve`: build the wheel from this
tree, install it and its dependencies (nothing else: no source tree, no site packages of ours)
into a fresh venv, run that venv's `specserve serve` on a tiny checkpoint from a folder outside
the repository, get one completion over gRPC, and stop it with SIGTERM.

Installing is the slow part, so it works offline from a wheelhouse in the user's cache
(~/.cache/specserve/wheelhouse, or under $XDG_CACHE_HOME: outside the clone, so that a fresh clone
reuses it the way pip reuses its own cache) that the first run fills with `pip download` from the
indexes pip is configured with (and fills again when a dependency changes). The venv is made and
filled by uv (`uv venv`, `uv pip install`): the same wheel metadata decides what is installed as
with pip, but uv links the files from its cache instead of unpacking torch's 700 MB every run
(about 1 s instead of 40).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_served_checkpoint, serve_process

pytestmark = [pytest.mark.triton, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
# What the wheel is built from (pyproject.toml names the README as the long description).
SOURCES = ("pyproject.toml", "README.md", "specserve")
WHEELHOUSE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specserve" / "wheelhouse"
BUILD_REQUIRES = ("setuptools>=68", "wheel")    # pyproject.toml's [build-system]


def offline(cmd: list[str], fill: tuple[str, ...]) -> None:
    """`cmd` (a pip or uv command) from the wheelhouse alone; when that fails (the first run, or a
    dependency that changed), download `fill` and what it needs into the wheelhouse, then again."""
    cmd = [*cmd, "-q", "--no-index", "--find-links", str(WHEELHOUSE)]
    if subprocess.run(cmd, capture_output=True).returncode == 0:
        return
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(WHEELHOUSE),
                    *fill], check=True)
    for w in WHEELHOUSE.glob("specserve-*.whl"):
        w.unlink()   # the wheel under test is always the one just built
    subprocess.run(cmd, check=True)


def build_wheel(out: Path) -> Path:
    """The wheel of this tree, built from a copy of its sources (setuptools writes build/ and
    *.egg-info beside what it builds, which must not land in the working tree)."""
    src = out / "src"
    src.mkdir(parents=True)
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    offline([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(src)], fill=BUILD_REQUIRES)
    (wheel,) = out.glob("specserve-*.whl")
    return wheel


def fresh_venv(path: Path, wheel: Path) -> Path:
    """A venv holding only `wheel` and its dependencies; returns its bin folder."""
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))   # the test extra's uv, beside this python
    assert uv, "uv is missing from the test environment (pyproject.toml's test extra installs it)"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(path)], check=True)
    offline([uv, "pip", "install", "--offline", "--python", str(path / "bin" / "python"), str(wheel)],
            fill=(str(wheel),))
    return path / "bin"


def test_the_wheel_alone_serves(tmp_path):
    from specserve.triton.client import StreamClient

    wheel = build_wheel(tmp_path / "dist")
    bindir = fresh_venv(tmp_path / "venv", wheel)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    # Nothing of this tree may leak in: no PYTHONPATH, no active venv, not this venv's bin on PATH.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(bindir), *(p for p in env.get("PATH", "").split(os.pathsep)
                                                  if Path(p).resolve() != Path(sys.executable).parent.resolve())])
    where = subprocess.run([str(bindir / "python"), "-c", "import specserve; print(specserve.__file__)"],
                           cwd=outside, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(tmp_path / "venv"), where
    ckpt = make_served_checkpoint(tmp_path / "ckpt")
    with serve_process([str(bindir / "specserve")], "--target", str(ckpt), "--max-num-seqs", "2",
                       "--max-model-len", "128", "--work-dir", str(outside / "work"), cwd=outside, env=env) as served:
        out = StreamClient(f"localhost:{served.ports.grpc}").generate("hello 世界", {"max_tokens": 5})
        assert out.num_output_tokens == 5
        assert served.stop() == 0, served.tail()
