"""What a benchmark report says about the machine it ran on: CPU, load, versions, the commit.

One function for every report, so figures from two benchmarks can be read side by side: the
CPU model and its bf16 matmul flags (bf16 speed depends on them), the load at start and end (a
shared machine's figures are only as good as its quiet), the OpenMP settings (its wait policy
decides how much CPU idle threads burn beside other processes), package versions, and the
specserve commit with whether the tree had uncommitted changes.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PACKAGES = ("torch", "transformers", "llama_cpp_python", "openai", "tritonclient", "numpy")
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")


def machine_info(repo: Path, cores: list[int], loadavg_start: tuple[float, float, float]) -> dict:
    import torch

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = cpuinfo.splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), None)
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    versions = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=repo, capture_output=True, text=True).stdout.strip()

    return {"cpu": model, "cpu_count": os.cpu_count(), "cores_used": cores,
            "bf16_matmul_flags": [f for f in flags if f in BF16_FLAGS],
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "openmp_env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")},
            "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg(), "platform": platform.platform(),
            "python": platform.python_version(), "versions": versions,
            "specserve_commit": git("rev-parse", "HEAD"), "uncommitted_changes": bool(git("status", "--porcelain"))}
