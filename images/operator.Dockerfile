# syntax=docker/dockerfile:1.7
# The kubetrain operator image: Python, kopf and the Kubernetes client. No torch:
# the operator never imports it, and the image stays around 150 MB.
#
#   docker build -f images/operator.Dockerfile -t ghcr.io/kubetrain/operator:0.1.0 .
#
# Bases are pinned to exact releases; pin them by digest in your own registry
# (docs/images.md shows how).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kubetrain ./kubetrain
COPY operator ./operator
COPY trainer ./trainer
RUN pip install --no-cache-dir --upgrade pip build \
 && python -m build --wheel --outdir /wheels .
# The wheel with its `operator` extra: exactly the libraries pyproject.toml says the
# operator imports, and no torch (the `trainer` extra's).
RUN python -m venv /opt/kubetrain \
 && wheel=$(ls /wheels/kubetrain-*.whl) \
 && /opt/kubetrain/bin/pip install --no-cache-dir "${wheel}[operator]" \
 && ! /opt/kubetrain/bin/python -c "import torch" 2>/dev/null \
 && /opt/kubetrain/bin/kubetrain operator --help >/dev/null

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kubetrain operator" \
      org.opencontainers.image.source="https://github.com/kubetrain/kubetrain" \
      org.opencontainers.image.licenses="Apache-2.0"
# The chart runs the operator with a read-only root filesystem: no .pyc writes.
ENV PATH=/opt/kubetrain/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /opt/kubetrain /opt/kubetrain
# 65532 is the chart's runAsUser; the numeric USER lets runAsNonRoot verify it.
RUN groupadd --gid 65532 kubetrain \
 && useradd --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin kubetrain
USER 65532:65532
EXPOSE 9090 8080
ENTRYPOINT ["kubetrain", "operator"]
