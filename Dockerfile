# syntax=docker/dockerfile:1
# specserve images: two build targets, one source tree.
#
#   gpu  the NGC Triton container (native ONNX Runtime / TensorRT / Python backends, CUDA) with
#        specserve installed.     docker build --target gpu -t specserve:gpu .
#   cpu  python:3.11-slim with the tritonserver that ships inside the nvidia-pytriton wheel (Python
#        backend only), the demo model baked in at /models.
#                                 docker build --target cpu -t specserve:cpu .
#
# Both run `specserve serve` (ENTRYPOINT specserve); docker-compose.yml and deploy/k8s pass the
# serve flags. Neither image has been built on the machines this repository is developed on
# (no Docker daemon there); the docker-compose.yml and Kubernetes manifests are checked by
# validators in tests/test_deploy.py.

# 24.10 is Triton 2.51.0: the same server version as the nvidia-pytriton 0.7.0 wheel the CPU
# path and the tests use, so a repository rendered and tested on the CPU loads the same way here.
# The image is Ubuntu 22.04 with Python 3.10 (the system interpreter is also the Python
# backend stub's, so specserve is installed into it).
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:24.10-py3

# ---------------------------------------------------------------------------------------------
FROM ${TRITON_IMAGE} AS gpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    HF_HUB_OFFLINE=1 \
    HOME=/var/lib/specserve \
    HF_HOME=/var/lib/specserve/hf
WORKDIR /opt/specserve
# What the GPU image needs from pip:
#  - torch==2.13.0 from PyPI, which for linux x86_64 is a CUDA build: it brings its own CUDA
#    runtime, cuDNN and NCCL as nvidia-* wheels (several GB), so the host needs an NVIDIA driver
#    recent enough for that CUDA version plus the NVIDIA Container Toolkit; the CUDA in the
#    NGC base image is used by Triton's native backends, not by torch.
#  - specserve's own dependencies (pyproject.toml). They include the CPU onnxruntime (used only
#    when drafters run as Python models, --drafter-backend python) and nvidia-pytriton, whose
#    bundled tritonserver is unused here: the launcher prefers /opt/tritonserver.
# The `gpu` extra (onnxruntime-gpu, tensorrt) is not installed: onnxruntime-gpu and onnxruntime
# are one Python module and cannot sit side by side, and the NGC image already carries TensorRT
# and the native onnxruntime backend.
RUN python3 -m pip install torch==2.13.0
COPY . /opt/specserve
# Editable: the renderer reads the model_repository/ adapters from the source tree.
RUN python3 -m pip install -e /opt/specserve \
 && mkdir -p /var/lib/specserve && chown 1000:1000 /var/lib/specserve
# uid 1000 is the NGC image's triton-server user.
USER 1000:1000
EXPOSE 8000 8001 8002
ENTRYPOINT ["specserve"]
CMD ["serve", "--target", "/models/target", "--work-dir", "/var/lib/specserve"]

# ---------------------------------------------------------------------------------------------
FROM python:3.11-slim AS cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    HOME=/var/lib/specserve \
    HF_HOME=/var/lib/specserve/hf
WORKDIR /opt/specserve
# The CPU build of torch (PyPI's default linux wheel is the multi-GB CUDA build); pinned to the
# version pyproject.toml pins, installed first so `pip install -e` below keeps it.
RUN python3 -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY . /opt/specserve
# pyproject.toml brings nvidia-pytriton==0.7.0 (tritonserver 2.51 with the Python backend) and
# numpy<2, which the Python backend stub needs (docs/design.md, "Running Triton on CPU").
RUN python3 -m pip install -e /opt/specserve \
 && useradd --uid 1000 --no-create-home --home-dir /var/lib/specserve specserve \
 && mkdir -p /var/lib/specserve && chown 1000:1000 /var/lib/specserve \
 && ln -s /opt/specserve/models/demo /models
USER 1000:1000
EXPOSE 8000 8001 8002
ENTRYPOINT ["specserve"]
CMD ["serve", "--target", "/models/target", "--drafter", "eagle=/models/eagle", "--work-dir", "/var/lib/specserve"]
