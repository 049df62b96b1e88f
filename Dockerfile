# syntax=docker/dockerfile:1
#
# The trainwire GPU worker: one `trainwire serve` process, one training session, on two ports:
# 50051 the gRPC API, 8000 the Tinker SDK front (trainwire[tinker], installed).
#
#   docker build -t trainwire-worker:0.1.0 .
#   docker run --gpus 1 -p 50051:50051 -v trainwire-state:/var/lib/trainwire \
#       -v /path/to/models:/models:ro trainwire-worker:0.1.0
#
# The default command serves gRPC only: the front refuses to listen beyond loopback without keys,
# so it starts with them (--tinker-listen 0.0.0.0:8000 --tinker-token-file or --tenants; see
# deploy/README.md, "The image on its own").
#
# torch's Linux wheels bring their own CUDA user-space libraries (cuBLAS, cuDNN, NCCL, ...) as pip
# packages, so the base only has to be the CUDA *base* flavour whose version matches torch's build:
# torch 2.13.0 is built for CUDA 13.0 (its cuda-toolkit pin is 13.0.3). The base image sets
# NVIDIA_REQUIRE_CUDA, so the NVIDIA container toolkit refuses a host whose driver is too old for
# CUDA 13.0 (driver >= 580) instead of failing at the first kernel. A `-runtime-`/`-cudnn-runtime-`
# base would ship a second copy of those libraries (several GB) that torch never loads.
# For reproducible builds pin the digest too: --build-arg CUDA_IMAGE=nvidia/cuda:13.0.3-base-ubuntu24.04@sha256:...
ARG CUDA_IMAGE=nvidia/cuda:13.0.3-base-ubuntu24.04

# ---- builder: a virtual environment with torch, the dependencies and the trainwire wheel ----------
FROM ${CUDA_IMAGE} AS builder

ARG TORCH_VERSION=2.13.0
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# Ubuntu's archive keeps only the current build of a package, so exact apt pins break the build as
# soon as a security update lands; the base image tag pins the release instead.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first, in its own layer: by far the largest, and it changes least often.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
# src/trainwire, trainwire/client and trainwire/server are links into the folders copied here.
COPY src/ src/
COPY trainwire/ trainwire/
COPY client/ client/
COPY server/ server/
# Build the wheel, install it with its dependencies and the Tinker front's extra (pip
# byte-compiles them, so the read-only image needs no bytecode cache), then drop pip: nothing that
# builds or installs packages reaches the runtime image, only /opt/venv does.
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && pip install --no-cache-dir "$(echo /wheels/trainwire-*.whl)[tinker]" \
    && pip uninstall --yes pip

# ---- runtime ---------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE}

LABEL org.opencontainers.image.title="trainwire-worker" \
      org.opencontainers.image.description="A trainwire training-session server (trainwire serve) for one GPU" \
      org.opencontainers.image.licenses="Apache-2.0"

# The interpreter only (the virtual environment links to it): no pip, no venv module, no compilers.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 trainwire \
    && useradd --system --uid 10001 --gid trainwire --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin trainwire \
    && install -d -o trainwire -g trainwire -m 0750 /var/lib/trainwire \
    && install -d -m 0755 /models

COPY --from=builder /opt/venv /opt/venv

# HOME and every cache point into /tmp, the one scratch directory (an emptyDir or a tmpfs when the
# root filesystem is read-only). Models come from --model-root, never from a hub at run time.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/.cache/huggingface \
    HF_HUB_OFFLINE=1 \
    MPLCONFIGDIR=/tmp/.cache/matplotlib \
    TRITON_CACHE_DIR=/tmp/.cache/triton \
    CUDA_CACHE_PATH=/tmp/.cache/nv

USER 10001:10001
WORKDIR /var/lib/trainwire
# The session's checkpoints and operation journal: keep it on a volume that outlives the container.
VOLUME ["/var/lib/trainwire"]
# gRPC, and the Tinker SDK front (--tinker-listen).
EXPOSE 50051 8000

# The standard gRPC health service (grpc.health.v1) answers SERVING once a restart has restored its
# checkpoint; it is NOT_SERVING while loading or restoring, hence the long start period. Plaintext
# only: with --tls-cert in the command, probe from outside the container instead.
HEALTHCHECK --interval=30s --timeout=10s --start-period=10m --retries=3 \
    CMD ["/opt/venv/bin/python", "-c", "import sys, grpc; from grpc_health.v1 import health_pb2, health_pb2_grpc; channel = grpc.insecure_channel('127.0.0.1:50051'); reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5); sys.exit(0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1)"]

ENTRYPOINT ["trainwire", "serve"]
CMD ["--listen", "0.0.0.0:50051", "--state-dir", "/var/lib/trainwire", "--model-root", "/models"]
