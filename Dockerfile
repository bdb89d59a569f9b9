# specserve images: two build targets, one source tree.
#
#   gpu  NGC PyTorch (its CUDA torch, TensorRT) + Triton 2.51 from the NGC Triton image of the
#        same release + onnxruntime-gpu + specserve.
#                                 docker build --target gpu -t specserve:gpu .
#   cpu  a Debian bookworm base made locally (scripts/make_base_image.sh: no registry needed) +
#        the CPU torch + the tritonserver inside the nvidia-pytriton wheel (Python backend
#        only), the demo model baked in at /models.
#                                 scripts/make_base_image.sh && docker build --target cpu -t specserve:cpu .
#
# Both run `specserve serve` (ENTRYPOINT specserve); docker-compose.yml and deploy/k8s pass the
# serve flags. Both run scripts/image_check.py as their last build step, so an image that is
# missing a library or has the wrong torch build is not made. The cpu image is built and served
# by `make image-check` (docs/deploy/image_check.txt); the gpu image has not been built yet
# (docs/deploy.md says what has run where).

# 24.10 is Triton 2.51.0: the same server version as the nvidia-pytriton 0.7.0 wheel the CPU
# path and the tests use, so a repository rendered and tested on the CPU loads the same way on
# the GPU. The PyTorch image of the same release shares its stack: Ubuntu 22.04, Python 3.10,
# CUDA 12.6.2, cuDNN 9.5, TensorRT 10.5.0 (NGC framework support matrix, 24.10).
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:24.10-py3
ARG PYTORCH_IMAGE=nvcr.io/nvidia/pytorch:24.10-py3
# The CPU image's base: any Debian/Ubuntu root with python3.11, its venv module and libpython3.11
# (the Python backend stub links it); scripts/make_base_image.sh makes this one with debootstrap.
ARG CPU_BASE=specserve-base:bookworm
# The cpu stage comes first: Docker's classic builder (no buildx) builds every stage before
# the target, and the gpu stages' NGC bases cannot be pulled where only the cpu image is made.

# ---------------------------------------------------------------------------------------------
FROM ${CPU_BASE} AS cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    HOME=/var/lib/specserve \
    HF_HOME=/var/lib/specserve/hf \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}
WORKDIR /opt/specserve
# A virtual environment: Debian's python refuses pip outside one (PEP 668); the Python backend
# stub runs this same interpreter.
RUN python3 -m venv /opt/venv
# wheels/ is a wheelhouse: when it holds wheels, everything is installed from it alone, offline
# (an air-gapped build; `make image-check` fills it from this machine's pip with `pip download`).
# Otherwise from the package index, torch from the PyTorch CPU index (PyPI's default linux
# torch is the multi-GB CUDA build), the version pyproject.toml pins, first, so that
# `pip install -e` keeps it.
COPY wheels/ /tmp/wheels/
RUN if ls /tmp/wheels/*.whl >/dev/null 2>&1; then \
        pip install --no-index --find-links /tmp/wheels torch==2.13.0; \
    else pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; fi
COPY . /opt/specserve
# pyproject.toml brings nvidia-pytriton==0.7.0 (tritonserver 2.51 with the Python backend) and
# numpy<2, which the Python backend stub needs (docs/design.md, "Running Triton on CPU").
RUN if ls /tmp/wheels/*.whl >/dev/null 2>&1; then pip install --no-index --find-links /tmp/wheels -e /opt/specserve; \
    else pip install -e /opt/specserve; fi \
 && rm -rf /tmp/wheels /opt/specserve/wheels \
 && python3 scripts/image_check.py --image cpu \
 && useradd --uid 1000 --no-create-home --home-dir /var/lib/specserve specserve \
 && mkdir -p /var/lib/specserve && chown 1000:1000 /var/lib/specserve \
 && ln -s /opt/specserve/models/demo /models
USER 1000:1000
EXPOSE 8000 8001 8002
ENTRYPOINT ["specserve"]
CMD ["serve", "--target", "/models/target", "--drafter", "eagle=/models/eagle", "--work-dir", "/var/lib/specserve"]

# ---------------------------------------------------------------------------------------------
FROM ${TRITON_IMAGE} AS triton

FROM ${PYTORCH_IMAGE} AS gpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    HF_HUB_OFFLINE=1 \
    HOME=/var/lib/specserve \
    HF_HOME=/var/lib/specserve/hf \
    PATH=/opt/tritonserver/bin:${PATH}
WORKDIR /opt/specserve
# One torch: the base's. NVIDIA builds it against the CUDA, cuDNN and NCCL in this image, the
# ones Triton's backends, onnxruntime-gpu's CUDA provider and TensorRT load too, so one process
# holds one CUDA stack. PyPI's torch would bring a second CUDA stack as nvidia-* wheels (GBs,
# not necessarily the cuDNN the others load) and replace the base's build. Nothing below may
# reinstall torch: specserve goes in with --no-deps, its other dependencies from
# docker/requirements-gpu.txt, which leaves torch out (tests/test_deploy.py checks both).
#
# Triton itself is copied from the NGC Triton image of the same release, as Triton's own
# compose.py does for custom images: the server, its libraries and the python, onnxruntime and
# tensorrt backends, plus the runtime libraries the PyTorch image lacks. image_check.py runs
# ldd on each and fails the build on a missing one.
COPY --from=triton /opt/tritonserver/bin /opt/tritonserver/bin
COPY --from=triton /opt/tritonserver/lib /opt/tritonserver/lib
COPY --from=triton /opt/tritonserver/backends/python /opt/tritonserver/backends/python
COPY --from=triton /opt/tritonserver/backends/onnxruntime /opt/tritonserver/backends/onnxruntime
COPY --from=triton /opt/tritonserver/backends/tensorrt /opt/tritonserver/backends/tensorrt
RUN apt-get update \
 && apt-get install -y --no-install-recommends libb64-0d libre2-9 libnuma1 libarchive13 libssl3 \
 && rm -rf /var/lib/apt/lists/*
COPY docker/requirements-gpu.txt /tmp/requirements-gpu.txt
RUN python3 -m pip install -r /tmp/requirements-gpu.txt
COPY . /opt/specserve
# Editable, like a checkout: one copy of the code, the one scripts/ (image_check) runs beside. The
# package needs no source tree to serve (its Triton adapters are package data; tests/test_wheel.py).
RUN python3 -m pip install --no-deps -e /opt/specserve \
 && python3 scripts/image_check.py --image gpu \
 && mkdir -p /var/lib/specserve && chown 1000:1000 /var/lib/specserve
USER 1000:1000
EXPOSE 8000 8001 8002
ENTRYPOINT ["specserve"]
CMD ["serve", "--target", "/models/target", "--work-dir", "/var/lib/specserve"]
