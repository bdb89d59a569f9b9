"""onnxruntime sessions for the remote drafters (eagle_backbone, calibration_head, mtp_heads): one
thread, no spinning, on the engine's device. Free of torch, so the Triton stubs of the ONNX
drafters start without importing it (2.4 s and about 200 MB each on this CPU)."""

from __future__ import annotations

import logging
from typing import Sequence


def session_options(threads: int = 1):
    """One intra-op thread, no spinning: a drafter step is tiny, and spinning pool threads fight
    the target's own threads for the same cores (measured: a 1-layer step went from ~60 ms to
    a few ms on 2 cores)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


CUDA_PROVIDER = "CUDAExecutionProvider"
CPU_PROVIDER = "CPUExecutionProvider"
log = logging.getLogger(__name__)


def execution_providers(device: str, available: Sequence[str] | None = None) -> list[tuple[str, dict]]:
    """The onnxruntime providers for a drafter on `device` (the engine's --device: auto, cpu,
    cuda[:N]), so a remote drafter computes where the target does. cuda asks for the CUDA
    provider on that GPU, with the CPU one after it for the operators CUDA lacks; when this
    onnxruntime has no CUDA provider (the CPU wheel), the drafter falls back to the CPU, with a
    warning. auto is cuda when torch sees a GPU, as for the target (model.devices), and cpu
    when this onnxruntime has no CUDA provider."""
    if available is None:
        import onnxruntime as ort

        available = ort.get_available_providers()
    if device == "auto":
        if CUDA_PROVIDER not in available:
            return [(CPU_PROVIDER, {})]   # a CPU onnxruntime: no need to ask torch about GPUs
        from specserve.model.devices import resolve_device

        device = str(resolve_device("auto"))
    if not device.startswith("cuda"):
        return [(CPU_PROVIDER, {})]
    if CUDA_PROVIDER not in available:
        log.warning("drafter device %s: this onnxruntime has no %s (providers: %s); the drafter runs "
                    "on the CPU. Install onnxruntime-gpu instead of onnxruntime.", device, CUDA_PROVIDER,
                    ", ".join(available))
        return [(CPU_PROVIDER, {})]
    index = device.partition(":")[2] or "0"
    return [(CUDA_PROVIDER, {"device_id": int(index)}), (CPU_PROVIDER, {})]


def inference_session(path: str, device: str = "cpu"):
    """An onnxruntime session for `path` on `device` (execution_providers), warning when a
    requested CUDA provider could not be created (onnxruntime then runs on the CPU)."""
    import onnxruntime as ort

    providers = execution_providers(device)
    session = ort.InferenceSession(str(path), session_options(), providers=providers)
    if providers[0][0] == CUDA_PROVIDER and CUDA_PROVIDER not in session.get_providers():
        log.warning("drafter %s: onnxruntime could not start %s on %s; it runs on the CPU", path,
                    CUDA_PROVIDER, device)
    return session
