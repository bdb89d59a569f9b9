"""Build a TensorRT plan from an ONNX file (GPU machines only): what `--drafter-backend tensorrt`
runs at render time (drafter_backends.build_plan) and training/build_trt.py's command runs for
the exported drafter. Inside the package, so an installed specserve builds plans without its
source tree."""

from __future__ import annotations

from pathlib import Path


def missing_requirements() -> str | None:
    """Why no plan can be built here (None: it can)."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "the tensorrt package is not installed (pip install -e '.[gpu]')"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    return None


def build(onnx_path: Path, plan_path: Path, shapes: dict[str, tuple[tuple, tuple, tuple]], fp16: bool) -> None:
    """One optimisation profile: shapes maps each input to its (min, opt, max) shape."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 2 << 30)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        name = network.get_input(i).name
        lo, opt, hi = shapes[name]
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path}")
    plan_path.write_bytes(bytes(plan))
