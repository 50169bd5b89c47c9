# The two commands the README documents: `make demo` and `make test`.
# Each creates .venv on first use and installs what it needs into it.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test lint lowest packages images checkov

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first: a bare `torch` requirement would pull the CUDA build.
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	# dev includes kubetrain[all]: the operator and trainer extras.
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# kubeflow's SDK, whose status reporter a test runs against the operator's endpoint unchanged.
# Beside the venv, not in it: kubeflow 0.5 pins kubernetes<36, the operator needs 37 or newer,
# and its reporter needs only requests.
KUBEFLOW_SDK := $(VENV)/kubeflow-sdk
$(KUBEFLOW_SDK)/.installed: $(VENV)/.installed
	$(BIN)/pip install -q --no-deps --target $(KUBEFLOW_SDK) kubeflow==0.5.0 \
		'kubeflow-trainer-api>=2.3,<2.4'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/kubetrain run examples/quickstart.yaml

# ruff, mypy, the tiers as import contracts (pyproject.toml's [tool.importlinter]), and
# every test's fixtures wired without running one (--setup-plan: a scope mismatch or a
# missing fixture fails here in 30 s, not 40 minutes into the suite).
lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/pytest -q --setup-plan tests > $(VENV)/setup-plan.log \
		|| { tail -40 $(VENV)/setup-plan.log; exit 1; }

# The API, storage and operator tests against the lowest version of every direct
# dependency that pyproject.toml allows, in .venv-lowest (a wrong lower bound fails here),
# on two workers: 97 s against 172 s on one, beside lint, in the CI run of 2026-11-26.
lowest: $(VENV)/.installed
	bash tests/install/lowest-direct.sh -q -n 2

# Every Debian package the tests and the image build need (buildah, containerd, promtool,
# chromium, ...), in one serial step: apt cannot run twice at once. Fails naming the package
# when one cannot be installed; under CI=true also when not root.
packages:
	bash tests/install/debian-packages.sh

# The operator and trainer images without Docker: Debian's buildah from offline stand-in
# bases, as OCI archives in ~/.cache/kubetrain/images, cached by content hash
# (docs/images.md). Needs root; installs its Debian packages when missing.
images:
	$(PYTHON) images/offline/build_images.py

# checkov, for the chart's security test, in its own venv (its pins clash with ours): here
# rather than inside pytest, where installing it took a worker 65 s in CI's run of stop 55.
CHECKOV_VENV := .venv-checkov
checkov: $(CHECKOV_VENV)/.installed
$(CHECKOV_VENV)/.installed: tests/chart/checkov-requirements.txt
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install -q -r tests/chart/checkov-requirements.txt
	touch $@

# What the suite needs, side by side (--output-sync keeps each one's output together): the
# venv, then lint, the lowest-bounds run and kubeflow's SDK, which need it; beside them the
# Debian packages, the images and checkov, which do not. The venv's install keeps one core
# busy for its first two minutes; the images' base fills the other (apt's calls wait for
# each other on one lock). Then the whole suite, on three pytest-xdist workers
# (tests/conftest.py says how the tests are shared between them), whose whole-loop and
# image tests run the images just built.
test:
	$(MAKE) --no-print-directory -j4 --output-sync=target \
		$(VENV)/.installed images packages checkov lint lowest $(KUBEFLOW_SDK)/.installed
	$(BIN)/pytest -n 3
