# Everything installs into a project venv, idempotently: `make test` and `make run` on a fresh
# machine need nothing else. torch==2.13.0 goes first (a CPU build); the project's range keeps it.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= A class
# Prometheus and promtool for the monitoring tests: the Debian package's static binaries,
# unpacked into the venv (no system-wide install; PyPI has no Prometheus).
PROM_DIR := $(VENV)/prometheus
PROMETHEUS := $(PROM_DIR)/usr/bin/prometheus

.PHONY: install run generate test lint proto clean prometheus multinode-demo gpu-check

install: $(STAMP)

# A new package, or changed C++ of the CPU kernels, needs a reinstall: setup.py builds the kernels
# (against the torch installed first, hence --no-build-isolation), so no engine compiles at start.
$(STAMP): pyproject.toml setup.py $(wildcard */__init__.py kernels/cpu/*.cpp kernels/cpu/*.h)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 'setuptools>=68' 'ninja>=1.11,<2'
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	touch $(STAMP)

run: install  # the embedded default: tiny model, 2 prefill + 2 decode ranks, gRPC on :50051
	$(VENV)/bin/epcluster serve

generate: install  # offline, in-process generation
	$(VENV)/bin/epcluster generate --model tiny --prompt "$(PROMPT)" --max-tokens 32

prometheus: $(PROMETHEUS)

$(PROMETHEUS):
	rm -rf $(PROM_DIR)/deb && mkdir -p $(PROM_DIR)/deb
	cd $(PROM_DIR)/deb && (apt-get download prometheus 2>/dev/null \
		|| (apt-get update -qq && apt-get download prometheus))
	dpkg -x $(PROM_DIR)/deb/prometheus_*.deb $(PROM_DIR)
	rm -rf $(PROM_DIR)/deb
	$(PROMETHEUS) --version | head -1

test: install prometheus
	$(PY) -m pytest -q

gpu-check: install  # the first thing to run on a GPU (bench/gpu_check.py); DRY_RUN=1 without one
	$(PY) -m bench.gpu_check $(if $(DRY_RUN),--dry-run)

multinode-demo: install  # three Ray nodes as network namespaces on this machine (root)
	$(PY) -m deploy.multinode_demo

proto: install  # regenerate router/proto/*_pb2*.py from epcluster.proto
	PYTHON=$(PY) router/proto/generate.sh

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache build kernels/cpu/_ext_*
