"""What an image must hold before it is worth starting: run inside it as its last build step
(Dockerfile), by `make image-check` in the built CPU image, and by `make gpu-check` on a GPU
machine (--device, which also needs a GPU to be visible).

    python3 scripts/image_check.py --image cpu|gpu [--device] [--skip CHECK]

Checks: specserve and its runtime modules import; torch is the build the image is meant to have
(CPU build in cpu, a CUDA build in gpu); onnxruntime offers the providers the drafters ask for
(CUDAExecutionProvider in gpu); TensorRT imports in gpu; the tritonserver the launcher would run,
its libraries and the backends the model repository uses resolve every shared library (ldd).
Prints one line per check and exits non-zero naming every failure.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path
from typing import Callable

MODULES = ("specserve.cli.main", "specserve.triton.launch", "specserve.serving.build", "numpy",
           "tritonclient.grpc", "tritonclient.http", "transformers", "onnx")


def _ldd_missing(path: Path) -> list[str]:
    out = subprocess.run(["ldd", str(path)], capture_output=True, text=True, env=_server_env()).stdout
    return [line.split()[0] for line in out.splitlines() if "not found" in line]


def _server_env() -> dict[str, str]:
    from specserve.triton.launch import server_env

    return server_env()


def check_imports(image: str) -> str:
    versions = []
    for name in MODULES:
        mod = importlib.import_module(name)
        versions.append(f"{name.split('.')[0]} {getattr(mod, '__version__', '')}".strip())
    numpy = importlib.import_module("numpy")
    if int(numpy.__version__.split(".")[0]) >= 2:
        raise AssertionError(f"numpy {numpy.__version__}: the Python backend stub needs numpy<2")
    return ", ".join(dict.fromkeys(versions))


def check_torch(image: str, device: bool) -> str:
    import torch

    cuda = torch.version.cuda
    if image == "cpu" and cuda is not None:
        raise AssertionError(f"torch {torch.__version__} is a CUDA {cuda} build in the cpu image")
    if image == "gpu" and cuda is None:
        raise AssertionError(f"torch {torch.__version__} is a CPU build in the gpu image")
    line = f"torch {torch.__version__}, CUDA build {cuda}"
    if device:
        if not torch.cuda.is_available():
            raise AssertionError(f"{line}: no CUDA GPU visible")
        line += f", GPU {torch.cuda.get_device_name()}"
    return line


def check_onnxruntime(image: str, device: bool) -> str:
    import onnxruntime as ort

    providers = ort.get_available_providers()
    want = ["CUDAExecutionProvider", "CPUExecutionProvider"] if image == "gpu" else ["CPUExecutionProvider"]
    missing = [p for p in want if p not in providers]
    if missing:
        raise AssertionError(f"onnxruntime {ort.__version__} lacks {missing} (has {providers})")
    line = f"onnxruntime {ort.__version__}: {', '.join(providers)}"
    if device:
        from specserve.methods.onnx_session import execution_providers

        chosen = execution_providers("cuda")
        if chosen[0][0] != "CUDAExecutionProvider":
            raise AssertionError(f"the drafters would run on {chosen} with --device cuda")
        line += f"; drafters on cuda get {chosen[0][0]}"
    return line


def check_tensorrt(image: str) -> str:
    if image != "gpu":
        return "not in the cpu image"
    import tensorrt

    return f"tensorrt {tensorrt.__version__}"


def check_tritonserver(image: str) -> str:
    from specserve.triton.launch import NGC_ROOT, find_tritonserver, prepare_backends
    import tempfile

    binary = find_tritonserver()
    if image == "gpu" and not str(binary).startswith(str(NGC_ROOT)):
        raise AssertionError(f"the gpu image would run {binary}, not Triton's own {NGC_ROOT}")
    backends = prepare_backends(Path(tempfile.mkdtemp(prefix="image-check-")))
    libs = [binary, *sorted(backends.glob("*/libtriton_*.so"))]
    if image == "gpu":
        names = {p.parent.name for p in libs[1:]}
        if not {"python", "onnxruntime", "tensorrt"} <= names:
            raise AssertionError(f"backends in {backends}: {sorted(names)}; python, onnxruntime and tensorrt needed")
    missing = {str(p): m for p in libs if (m := _ldd_missing(p))}
    if missing:
        raise AssertionError(f"unresolved shared libraries: {missing}")
    return f"{binary}, backends: {', '.join(p.parent.name for p in libs[1:])}; every shared library resolves"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image", choices=("cpu", "gpu"), required=True)
    p.add_argument("--device", action="store_true", help="also need a visible GPU (make gpu-check)")
    p.add_argument("--skip", action="append", default=[], metavar="CHECK",
                   help="leave a check out, e.g. tritonserver on a GPU machine without Triton")
    args = p.parse_args(argv)
    checks: dict[str, Callable[[], str]] = {
        "imports": lambda: check_imports(args.image),
        "torch": lambda: check_torch(args.image, args.device),
        "onnxruntime": lambda: check_onnxruntime(args.image, args.device),
        "tensorrt": lambda: check_tensorrt(args.image),
        "tritonserver": lambda: check_tritonserver(args.image),
    }
    failed = []
    for name, check in checks.items():
        if name in args.skip:
            print(f"image-check {args.image} {name}: skipped (--skip)", flush=True)
            continue
        try:
            print(f"image-check {args.image} {name}: ok: {check()}", flush=True)
        except Exception as e:  # noqa: BLE001 — report every failing check, not the first
            failed.append(name)
            print(f"image-check {args.image} {name}: FAILED: {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
