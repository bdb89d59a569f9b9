"""ONNX export of the EAGLE drafter: checker passes, onnxruntime matches torch, KV I/O chains."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_tiny_checkpoint
from specserve.core.masks import build_mask
from specserve.model.transformer import load_model
from test_eagle import random_drafter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import export_onnx  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("t"), "qwen2", seed=8)  # GQA + q/k/v bias
    target = load_model(path)
    drafter = random_drafter(target, seed=4)
    out = tmp_path_factory.mktemp("onnx")
    report = export_onnx.export(target, drafter, out, tol=TOL)
    return target, drafter, report


def test_export_checks_and_matches_torch(exported):
    _, _, report = exported
    assert report.backbone.is_file() and report.calibration.is_file()
    assert report.backbone_max_abs_diff <= TOL and report.calibration_max_abs_diff <= TOL


def test_explicit_kv_chains_like_one_pass(exported):
    """Ingest 3 pairs, then feed present_k/v back as past for a 4th: equals one 4-pair pass."""
    import onnxruntime as ort

    target, drafter, report = exported
    sess = ort.InferenceSession(str(report.backbone), providers=["CPUExecutionProvider"])
    c = drafter.cfg
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(1, 4, c.hidden_size, generator=g)
    toks = torch.randint(0, target.cfg.vocab_size, (1, 4), generator=g)
    empty = np.zeros((1, c.num_kv_heads, 0, c.head_dim), dtype=np.float32)

    def run(f, t, start, past_k, past_v):
        T = f.shape[1]
        mask, pos = build_mask([start], [list(range(-1, T - 1))], T)
        return sess.run(None, {"features": f.numpy(), "next_tokens": t.numpy(), "positions": pos.numpy(),
                               "past_k": past_k, "past_v": past_v, "mask": mask.numpy()})

    h3, _, k3, v3 = run(feats[:, :3], toks[:, :3], 0, empty, empty)
    h1, logits1, k4, v4 = run(feats[:, 3:], toks[:, 3:], 3, k3, v3)
    full_h, full_logits, full_k, _ = run(feats, toks, 0, empty, empty)
    np.testing.assert_allclose(h3, full_h[:, :3], atol=TOL)
    np.testing.assert_allclose(h1, full_h[:, 3:], atol=TOL)
    np.testing.assert_allclose(logits1, full_logits[:, 3:], atol=TOL)
    np.testing.assert_allclose(k4, full_k, atol=TOL)


@pytest.mark.gpu
def test_tensorrt_engines_build(exported, tmp_path):
    import build_trt

    why = build_trt.missing_requirements()
    if why:
        pytest.skip(f"TensorRT build needs a GPU machine: {why}")
    _, _, report = exported
    assert build_trt.main(["--onnx-dir", str(report.backbone.parent), "--out", str(tmp_path),
                           "--max-batch", "4", "--max-tokens", "64"]) == 0
    assert (tmp_path / "eagle_backbone.plan").stat().st_size > 0
    assert (tmp_path / "calibration_head.plan").stat().st_size > 0


def test_build_trt_refuses_without_gpu(exported, tmp_path, capsys):
    import build_trt

    if build_trt.missing_requirements() is None:
        pytest.skip("this machine has TensorRT and a GPU")
    assert build_trt.main(["--onnx-dir", ".", "--out", str(tmp_path)]) == 2
    assert "cannot build TensorRT engines here" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_tensorrt_profiles_cover_what_the_remote_drafter_feeds(exported):
    """build_trt's optimisation profiles (checked here on CPU, built only on a GPU) must admit
    every input shape the remote runtime sends: record them while drafting for 4 sequences
    (prompts of up to 40 pairs, then steps) and compare with the profiles' [min, max]."""
    import build_trt
    from specserve.methods.eagle.onnx_runtime import CalibrationOnnxRuntime, DraftBatch, EagleOnnxRuntime

    target, drafter, report = exported
    c = target.cfg
    rt = EagleOnnxRuntime(str(report.backbone), c.num_kv_heads, c.head_dim)
    cal = CalibrationOnnxRuntime(str(report.calibration))
    seen: dict[str, list[tuple]] = {}
    for runtime in (rt, cal):
        inner = runtime.session

        class Recorder:
            def run(self, names, feeds, _inner=inner):
                for k, v in feeds.items():
                    seen.setdefault(k, []).append(v.shape)
                return _inner.run(names, feeds)
        runtime.session = Recorder()
    g = torch.Generator().manual_seed(0)
    B, K, D = 4, 8, c.hidden_size
    lengths = [40, 1, 17, 33]
    for step in range(3):
        n = lengths if step == 0 else [3, 1, 5, 2]
        T = max(n)
        batch = DraftBatch(seq_ids=np.arange(B), valid_from=np.array([0] * B if step == 0 else valid),
                           num_new=np.array(n), features=torch.randn(B, T, D, generator=g).numpy(),
                           next_tokens=np.ones((B, T), dtype=np.int64), max_draft_len=np.full(B, K))
        res = rt.draft(batch)
        cal.accept_prob(res.hidden, res.scalars)
        valid = (np.array(lengths) if step == 0 else valid + np.array(n))
    profiles = {**build_trt.backbone_shapes(D, c.num_kv_heads, c.head_dim, max_batch=B, max_tokens=64),
                **build_trt.calibration_shapes(D, max_batch=B, max_draft_len=K)}
    assert set(seen) == set(profiles)
    for name, shapes in seen.items():
        lo, _, hi = profiles[name]
        for shape in shapes:
            assert len(shape) == len(lo) and all(a <= s <= b for a, s, b in zip(lo, shape, hi)), (name, shape, lo, hi)
