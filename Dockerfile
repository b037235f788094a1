# syntax=docker/dockerfile:1
# zoomer-serve: the demo model server with the interceptors, the embedded collector, reports and locust.
#
#   docker build -t zoomer-serve:0.1.0-cpu .                                  # CPU build of torch (default)
#   docker build -t zoomer-serve:0.1.0-cu130 --build-arg TORCH_VARIANT=cu130 .  # CUDA 13.0 build of torch
#
# TORCH_VARIANT names a folder of the PyTorch wheel index: cpu, or a CUDA build of TORCH_VERSION (cu126,
# cu129, cu130, cu132 for 2.13.0). The CUDA wheels bring the CUDA runtime libraries with them; the host needs
# the NVIDIA driver and the NVIDIA Container Toolkit (see deploy/compose.gpu.yml).
ARG PYTHON_IMAGE=python:3.12.13-slim-trixie
FROM ${PYTHON_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from the PyTorch index: an unpinned torch from PyPI would pull a CUDA build of several GB.
RUN pip install --index-url https://download.pytorch.org/whl/${TORCH_VARIANT} torch==${TORCH_VERSION}

WORKDIR /app
COPY pyproject.toml README.md ./
COPY zoomer_serve ./zoomer_serve
COPY interceptors ./interceptors
# The project and its dependencies; the torch above already satisfies its torch requirement.
RUN pip install . && python -c "import torch, zoomer_serve, interceptors; print('torch', torch.__version__)"

# Not part of the package: the locustfile (benchmarks/) and the health probes (deploy/healthcheck.py).
COPY benchmarks ./benchmarks
COPY deploy ./deploy

# An unprivileged user; /data (collector store) and /profiles (profiler traces) are volume mount points
# owned by it, so new named volumes start writable.
RUN useradd --uid 10001 --create-home zoomer \
    && mkdir -p /data /profiles \
    && chown zoomer /data /profiles
USER 10001

ENV ZOOMER_STORE=/data/zoomer.duckdb
EXPOSE 50051
CMD ["zoomer-serve", "serve-demo", "--host", "0.0.0.0", "--port", "50051"]
