# Needs only python3 and make: uv is bootstrapped into .tools/, the project into .venv/.
PYTHON ?= python3
UV_VERSION ?= 0.13.9
TOOLS := .tools
UV := $(TOOLS)/bin/uv
VENV := .venv
RUN := $(VENV)/bin
NPROC ?= 4
PYTEST_ARGS ?=
# pytest-xdist's test processes for the quick tier: two per core, as about a third of
# its time is tests waiting (timeouts, retries, heartbeats) while the core is idle
TEST_PROCESSES ?= $(shell echo $$((2 * $$(nproc))))
# the quick tier's selection and scheduling (an idle test process steals queued tests)
QUICK := --quick -n $(TEST_PROCESSES) --dist worksteal
# the other tier's: one test process per core and one more, an idle one stealing queued
# tests (a job's processes leave a core idle while they start, wait on each other or on
# a timeout: with one per core both cores were busy 78% of the tier, with one more 97%)
E2E := -m e2e -n $(shell echo $$(($$(nproc) + 1))) --dist worksteal
export UV_PYTHON_DOWNLOADS := never

.PHONY: run test check lint validate bench sync torch ray torchft-venv docs docs-serve clean

$(UV):
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/pip install --quiet --disable-pip-version-check "uv==$(UV_VERSION)"

# Non-editable on purpose: tests run against the installed package layout (the wheel's).
# Inexact: a torch installed by `make torch` stays. The build's own directories go first:
# setuptools keeps build/lib between builds, so a module deleted from the tree would
# otherwise stay in the wheel.
sync: $(UV)
	rm -rf build shardwire.egg-info
	$(UV) sync --locked --inexact --no-editable --compile-bytecode --extra examples --reinstall-package shardwire --python $(PYTHON) --quiet

# torch for the torch backend (the `torch` extra) and its tests, which skip without it.
# pip, not uv: pip's configuration can point at a local CPU build, which uv would not see.
TORCH_SPEC ?= torch==2.13.0
torch: sync
	$(TOOLS)/bin/pip --python $(RUN)/python install --quiet --disable-pip-version-check "$(TORCH_SPEC)"

# Ray for `shardwire ray` and `shardwire.ray` (the `ray` extra) and their tests, which
# skip without it; pip, as for torch, so the same configuration applies.
ray: sync
	$(TOOLS)/bin/pip --python $(RUN)/python install --quiet --disable-pip-version-check "ray[train]>=2.60"

# An interpreter beside the project's for `bench goodput --compare-torchft`: torch's CPU
# build, torchft and this checkout (torchft is never a dependency of the package).
TORCHFT_VENV ?= $(HOME)/.cache/torchft-venv
torchft-venv: $(UV)
	$(PYTHON) -m venv $(TORCHFT_VENV)
	$(TORCHFT_VENV)/bin/pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)" torchft-nightly .

run: sync
	$(RUN)/shardwire launch --standalone --nproc-per-node $(NPROC) examples/digits.py

# The whole suite in two runs: the quick tier on two test processes per core (its tests
# run in the test process alone), then the tests that start processes or open
# namespaces on one test process per core and one more (one at a time, the run took
# 1.4x as long as on one per core; one more took 0.8x). Tests marked long(SECONDS) start first (tests/longfirst.py), so the run does not
# end on one of minutes drawn last. Each log ends with the slowest tests, so a slow one is
# seen as it lands.
test: sync
	$(RUN)/python -m pytest $(QUICK) --durations=25 $(PYTEST_ARGS)
	$(RUN)/python -m pytest $(E2E) --durations=25 $(PYTEST_ARGS)

# The quick tier: lint, then every test that starts no process and opens no namespace.
check: lint
	$(RUN)/python -m pytest $(QUICK) --durations=10 $(PYTEST_ARGS)

lint: sync
	$(RUN)/ruff check .
	$(RUN)/ruff format --check .
	$(RUN)/mypy -p shardwire.protocol -p shardwire.coordinator -p shardwire.worker -p shardwire.torch -p shardwire.ray

# Dockerfile and compose file, checked without a Docker engine.
validate:
	bash scripts/validate-deploy.sh

bench: sync
	$(RUN)/shardwire bench transport

# The documentation site: the generated reference pages must match the code (run
# `$(RUN)/python scripts/docs_reference.py` to regenerate them), then a strict build.
docs: sync
	$(RUN)/python scripts/docs_reference.py --check
	$(RUN)/mkdocs build --strict --site-dir site

docs-serve: sync
	$(RUN)/mkdocs serve --dev-addr 127.0.0.1:8000

clean:
	rm -rf $(VENV) $(TOOLS) build *.egg-info site
