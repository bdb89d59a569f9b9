"""Remote ONNX drafters compute where the target does (issue 23): the onnxruntime providers a
drafter asks for follow the engine's --device, falling back to the CPU only with a warning, and
the rendered drafter models carry that device. No GPU is needed: the choice is tested against
provider lists, and the fallback with the CPU onnxruntime installed here."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from conftest import make_tiny_checkpoint
from specserve.methods.onnx_session import (CPU_PROVIDER, CUDA_PROVIDER, execution_providers,
                                           inference_session)

CPU_ONLY = [CPU_PROVIDER]
WITH_CUDA = ["TensorrtExecutionProvider", CUDA_PROVIDER, CPU_PROVIDER]


def test_cpu_runs_on_the_cpu(caplog):
    with caplog.at_level(logging.WARNING):
        assert execution_providers("cpu", WITH_CUDA) == [(CPU_PROVIDER, {})]
        assert execution_providers("cpu", CPU_ONLY) == [(CPU_PROVIDER, {})]
    assert not caplog.records


@pytest.mark.parametrize("device, index", [("cuda", 0), ("cuda:0", 0), ("cuda:1", 1)])
def test_cuda_asks_for_the_cuda_provider_on_that_gpu(device, index, caplog):
    with caplog.at_level(logging.WARNING):
        assert execution_providers(device, WITH_CUDA) == [(CUDA_PROVIDER, {"device_id": index}), (CPU_PROVIDER, {})]
    assert not caplog.records


def test_cuda_without_the_cuda_provider_falls_back_to_the_cpu_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert execution_providers("cuda", CPU_ONLY) == [(CPU_PROVIDER, {})]
    (record,) = caplog.records
    assert record.levelname == "WARNING"
    assert "no CUDAExecutionProvider" in record.message and "runs on the CPU" in record.message
    assert "onnxruntime-gpu" in record.message


def test_auto_follows_torch_like_the_target(monkeypatch, caplog):
    import torch

    with caplog.at_level(logging.WARNING):
        assert execution_providers("auto", CPU_ONLY) == [(CPU_PROVIDER, {})]
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        assert execution_providers("auto", WITH_CUDA) == [(CPU_PROVIDER, {})]
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert execution_providers("auto", WITH_CUDA) == [(CUDA_PROVIDER, {"device_id": 0}), (CPU_PROVIDER, {})]
    assert not caplog.records


def _identity_onnx(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_a_session_for_cuda_on_the_cpu_onnxruntime_still_runs(tmp_path, caplog):
    """What a drafter on a GPU target gets where only the CPU onnxruntime is installed (here):
    a working CPU session and the warning that says why."""
    import numpy as np
    import onnxruntime as ort

    if CUDA_PROVIDER in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider: the fallback is not reachable here")
    with caplog.at_level(logging.WARNING):
        session = inference_session(str(_identity_onnx(tmp_path / "id.onnx")), "cuda")
    assert session.get_providers() == [CPU_PROVIDER]
    assert "runs on the CPU" in caplog.text
    x = np.array([1.0, 2.0], dtype=np.float32)
    assert session.run(None, {"x": x})[0].tolist() == x.tolist()


def test_rendered_drafter_models_carry_the_engines_device(tmp_path):
    """The Python drafter models read their device from the rendered config: the engine's."""
    from specserve.methods.eagle.drafter import save_eagle
    from specserve.model.transformer import load_model
    from specserve.triton.render import render_eagle_proposal
    from test_eagle import random_drafter

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "llama", seed=3)
    save_eagle(random_drafter(load_model(ckpt), seed=5),
               json.loads((tmp_path / "ckpt" / "config.json").read_text()), tmp_path / "eagle")
    render_eagle_proposal(Path(ckpt), tmp_path / "eagle", tmp_path / "repo", version=1, device="cuda:1")
    for model in ("eagle_backbone", "calibration_head"):
        config = (tmp_path / "repo" / model / "config.pbtxt").read_text()
        assert 'parameters { key: "device" value: { string_value: "cuda:1" } }' in config, (model, config)
