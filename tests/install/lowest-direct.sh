#!/usr/bin/env bash
# Runs ruff and the API, storage, operator and chart-rendering tests against the lowest
# version of every direct dependency that pyproject.toml allows (uv's
# `--resolution lowest-direct`), so a lower bound the code has outgrown fails CI instead
# of a user's install.
#
#   bash tests/install/lowest-direct.sh [PYTEST ARGS...]     (`make lowest`)
#
# The environment is .venv-lowest/, synced exactly to the compiled pins on every run.
# torch is the exception: its lowest allowed release (2.9) would pull several GB of
# CUDA packages, so this run uses the same torch as .venv (the CPU build `make`
# installs) and torch's own bound is not exercised here.
set -euo pipefail
cd "$(dirname "$0")/../.."

BIN=.venv/bin
LOWEST=.venv-lowest
UV=(env -u VIRTUAL_ENV "$BIN/uv")

# uv reads no pip configuration; pip's find-links are where this machine keeps the CPU
# build of torch, so hand them to uv as well.
find_links=()
for location in $("$BIN/pip" config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | sort -u); do
    find_links+=(--find-links "$location")
done

[ -x "$LOWEST/bin/python" ] || "${UV[@]}" venv --quiet --python "$BIN/python" "$LOWEST"
torch=$("$BIN/python" -c 'from importlib.metadata import version; print(version("torch"))')
printf 'torch==%s\n' "$torch" > "$LOWEST/override.txt"

"${UV[@]}" pip compile --quiet pyproject.toml --extra dev --resolution lowest-direct \
    --python "$BIN/python" "${find_links[@]}" --override "$LOWEST/override.txt" \
    --no-header --output-file "$LOWEST/requirements.txt"
"${UV[@]}" pip sync --quiet --python "$LOWEST/bin/python" "${find_links[@]}" "$LOWEST/requirements.txt"
"${UV[@]}" pip install --quiet --python "$LOWEST/bin/python" --no-deps -e .

# A test tool may need a newer release of a runtime dependency than its bound (kubernetes
# 37 wants pydantic 2.13.5, transformers wants newer tokenizers): those runtime
# dependencies are then put back at their bounds (with what those releases need, e.g.
# pydantic-core), so the code under test still meets the oldest releases a user may have.
held=$("$BIN/python" - "$LOWEST/requirements.txt" <<'PY'
import re, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
runtime = project["dependencies"] + extras["operator"] + extras["trainer"]
pins = dict(re.findall(r"^([a-z0-9-]+)==(\S+)", open(sys.argv[1]).read(), re.M))
for requirement in runtime:
    name, bound = re.fullmatch(r"([\w.-]+)>=([\d.]+)", requirement.replace(" ", "")).groups()
    name = re.sub(r"[-_.]+", "-", name).lower()
    release = [int(n) for n in pins[name].split("+")[0].split(".")]
    lowest = [int(n) for n in bound.split(".")]
    if name != "torch" and release != lowest + [0] * (len(release) - len(lowest)):
        print(f"{name}=={bound}")
PY
)
if [ -n "$held" ]; then
    echo "lowest-direct: held at their bounds against the test tools' wishes:" $held
    "${UV[@]}" pip install --quiet --python "$LOWEST/bin/python" "${find_links[@]}" $held
fi

# The lowest ruff lints as `make lint` does (a second); the lowest mypy takes minutes
# on torch's sources, so it is not run here.
"$LOWEST/bin/ruff" check --quiet .
# This run is the last of `make test`'s steps before the suite, so its time is the suite's
# wait. test_lifeline_watch.py (35 s of its 92 s in a clean clone of 2026-12-01) is left
# out: it tests the operator's own sockets and timing, and the operator on kopf, kubernetes
# and prometheus-client, the dependencies it shares, runs in the other operator modules.
exec "$LOWEST/bin/python" -m pytest -p no:cacheprovider \
    --ignore=tests/operator/test_lifeline_watch.py \
    tests/api tests/operator \
    tests/storage/test_storage.py tests/storage/test_prepare.py \
    tests/storage/test_data.py tests/storage/test_checkpoint.py \
    tests/trainer/test_metrics.py tests/local/test_progress.py \
    tests/chart/test_render.py tests/chart/test_monitoring.py "$@"
