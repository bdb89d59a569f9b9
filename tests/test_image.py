"""The built CPU image, where a Docker daemon answers (`make image-check` builds it and runs the
whole serve / stream / stop / compose check; docs/deploy/image_check.txt is its last report).
Without a daemon or without the image these tests skip, saying so: CI has no dockerd."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "specserve:cpu"


def _docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def image() -> str:
    if shutil.which("docker") is None:
        pytest.skip("no docker client on this machine")
    if _docker("info", timeout=30).returncode != 0:
        pytest.skip("no Docker daemon answers (start dockerd to run the image tests)")
    if _docker("image", "inspect", IMAGE, timeout=30).returncode != 0:
        pytest.skip(f"no {IMAGE} image: `make image-check` builds it")
    return IMAGE


def test_the_image_holds_what_it_needs(image):
    r = _docker("run", "--rm", "--entrypoint", "python3", image, "scripts/image_check.py", "--image", "cpu",
                timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for check in ("imports", "torch", "onnxruntime", "tritonserver"):
        assert f"image-check cpu {check}: ok" in r.stdout, r.stdout


def test_container_check_says_when_no_daemon_answers(tmp_path):
    """make image-check on a machine without dockerd: exit 3 and a sentence, nothing tried."""
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path / 'none.sock'}"}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "container_check.py")], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 3 and "no Docker daemon answers" in r.stderr, (r.returncode, r.stderr)
