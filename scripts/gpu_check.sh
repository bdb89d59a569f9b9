#!/usr/bin/env bash
# `make gpu-check`: on a GPU machine, in under 10 minutes: install what the GPU tests need, run
# every gpu-marked test, then the bf16 timing table on a random-weight Llama-3-8B-shaped target
# and the tensor-parallel check over every GPU the machine has (skipped, saying so, on one GPU).
# Output goes to $OUT (docs/gpu by default): gpu_tests.txt, table.md, timing.json. The GPU
# image's own check with a GPU visible:
#   docker run --rm --gpus all --entrypoint python3 specserve:gpu scripts/image_check.py --image gpu --device
#
# The CUDA build of torch comes from the machine (the NGC PyTorch container, or any CUDA torch
# already installed for $GPU_PY): this script never installs torch. The package itself is
# installed without its dependency pins (they pin the CPU torch build used on CPU machines).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PY:-python3}
OUT=${OUT:-docs/gpu}
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: torch sees no CUDA GPU')"
"$PY" -m pip install -q --no-deps -e .
"$PY" -m pip install -q "numpy<2" "transformers>=4.45" "safetensors>=0.4" "tokenizers>=0.20" "onnx>=1.16" \
    "pyyaml>=6" "tqdm>=4.66" "pytest>=8" "tritonclient[grpc,http]>=2.50" "onnxruntime-gpu==1.19.2" "tensorrt==10.5.*"
mkdir -p "$OUT"
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name())" \
    | tee "$OUT/gpu_tests.txt"
# What the GPU image must hold (scripts/image_check.py, as its build runs it) plus a visible GPU;
# outside the image (no /opt/tritonserver) the server check is left out.
SKIP=$([ -x /opt/tritonserver/bin/tritonserver ] || echo "--skip tritonserver")
"$PY" scripts/image_check.py --image gpu --device $SKIP 2>&1 | tee -a "$OUT/gpu_tests.txt"
# -rs lists every skip with its reason: on a GPU machine none of the gpu tests should skip.
timeout 240 "$PY" -m pytest -q -m gpu -rs tests 2>&1 | tee -a "$OUT/gpu_tests.txt"
timeout 330 "$PY" benchmarks/gpu_check.py --out "$OUT"
