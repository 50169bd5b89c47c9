# syntax=docker/dockerfile:1.7
# The kubetrain trainer image: the official PyTorch CUDA runtime plus kubetrain.
# Worker pods run `python -m kubetrain.trainer.launch /etc/kubetrain/job.yaml` in it
# (torchrun, its options in PET_* variables, with warm restarts in place).
#
#   docker build -f images/trainer.Dockerfile -t ghcr.io/kubetrain/trainer:0.1.0 .
#
# PYTORCH_IMAGE picks the CUDA/PyTorch pair; it must match your drivers
# (docs/images.md). The wheel goes in with its `trainer` extra and `fault-tolerance`
# (torchft, for spec.faultTolerance's replica groups and their lighthouse); the extras'
# `torch>=2.9` is satisfied by the base, so pip never replaces the CUDA build of torch.
ARG PYTORCH_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime

FROM ${PYTORCH_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kubetrain ./kubetrain
COPY operator ./operator
COPY trainer ./trainer
RUN pip install --no-cache-dir build \
 && python -m build --wheel --outdir /wheels .

FROM ${PYTORCH_IMAGE}
LABEL org.opencontainers.image.title="kubetrain trainer" \
      org.opencontainers.image.source="https://github.com/kubetrain/kubetrain" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    wheel=$(ls /wheels/kubetrain-*.whl) \
 && pip install --no-cache-dir "${wheel}[trainer,fault-tolerance]" \
 && python -c "import torch, kubetrain.trainer; print('torch', torch.__version__)"
# UID 1000 is the runAsUser of the worker pods the operator creates.
RUN groupadd --gid 1000 kubetrain \
 && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash kubetrain
ENV PYTHONUNBUFFERED=1 \
    HOME=/home/kubetrain
# The metrics log (./metrics.jsonl) and compile caches are written under here.
WORKDIR /home/kubetrain
USER 1000:1000
EXPOSE 29400 9400
CMD ["python", "-m", "kubetrain.trainer", "--help"]
