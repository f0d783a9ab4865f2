# syntax=docker/dockerfile:1
# The infer8 server image: `infer8 serve`, as a non-root user, models mounted at /models.
#
# CPU (the default):
#   docker build -t infer8:cpu .
# CUDA: a CUDA base image (Python >= 3.10 is installed from its packages when missing) and the
# CUDA build of the torch CI tests (TORCH_SPEC's default); every other package, Triton included,
# at the version of scripts/constraints.txt, the one the kernels are compile-checked with
# (tests/gpu/test_triton_compile.py). A torch whose own Triton pin differs fails the build here,
# not the first request. TORCH_INDEX_URL must be an index that has that torch for the base image's
# CUDA:
#   docker build -t infer8:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# Run (arguments are `infer8 serve` flags; no model argument serves the default model):
#   docker run --rm -p 8000:8000 -v /srv/models:/models:ro infer8:cpu /models/<model-dir>
#
# Shutdown: `docker stop` / Kubernetes send SIGTERM; tini (PID 1) forwards it to the server,
# which stops accepting requests and lets in-flight ones run for --shutdown-grace-period-s
# (default 25 s) before aborting them. Give the container at least that long before SIGKILL
# (`docker stop -t`, terminationGracePeriodSeconds: see deploy/k8s and docs/deployment.md).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC=torch==2.13.0
ARG DEBIAN_FRONTEND=noninteractive

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# A C compiler at run time: Triton builds its CUDA launcher with it (against Python.h) on first
# use, and the CPU kernels (src/infer8/kernels/cpu/csrc) is built with it; without one the GPU path
# fails on the first request and the CPU path falls back to slower torch code.
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends tini ca-certificates gcc libc6-dev; \
    if ! python3 -c "import ensurepip" 2>/dev/null; then \
        apt-get install -y --no-install-recommends python3 python3-venv python3-dev; \
    fi; \
    rm -rf /var/lib/apt/lists/*; \
    python3 -m venv /opt/venv

# torch first: the largest layer changes least.
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

COPY pyproject.toml README.md /tmp/infer8-src/
COPY scripts/constraints.txt /tmp/infer8-src/scripts/constraints.txt
COPY src/infer8 /tmp/infer8-src/src/infer8
RUN pip install -c /tmp/infer8-src/scripts/constraints.txt /tmp/infer8-src && rm -rf /tmp/infer8-src

RUN set -eux; \
    groupadd --system --gid 10001 infer8; \
    useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/infer8 infer8; \
    mkdir -p /models; \
    chown 10001:10001 /models

USER 10001:10001
WORKDIR /home/infer8
# Where `infer8 pull` puts the default model (Kubernetes overlays point it at a volume).
ENV HOME=/home/infer8 \
    INFER8_CACHE=/home/infer8/.cache/infer8
VOLUME ["/models"]
EXPOSE 8000
STOPSIGNAL SIGTERM
ENTRYPOINT ["tini", "--", "infer8", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
