"""The drafter adapters that need no torch import none: the stateless ones of remote mtp
(ngram_drafter, mtp_arbiter) and the ONNX drafters under onnxruntime (eagle_backbone,
calibration_head, mtp_heads; a seeded row imports torch when it drafts). Each is its own
Python-backend stub process, loaded and reloaded through model control, and torch's
import costs seconds of CPU and hundreds of MB there. Checked in a fresh interpreter with a
stand-in for triton_python_backend_utils (only the stub provides the real one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1] / "specserve" / "triton" / "model_repository"
PROBE = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("adapter", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
assert hasattr(module, "TritonPythonModel"), "not an adapter"
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


@pytest.mark.parametrize("model", ["ngram_drafter", "mtp_arbiter", "eagle_backbone", "calibration_head",
                                   "mtp_heads"])
def test_adapter_imports_no_torch(model, tmp_path):
    (tmp_path / "triton_python_backend_utils.py").write_text(
        "class TritonModelException(Exception):\n    pass\n\n\ndef __getattr__(name):\n    return None\n")
    out = subprocess.run([sys.executable, "-c", PROBE, str(REPO / model / "1" / "model.py")], capture_output=True,
                         text=True, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, check=True)
    assert out.stdout.strip() == "[]", out.stdout
