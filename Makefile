# `make test` and `make bench` do all set-up on a fresh machine.
# With an importable torch (the GPU box, no registry) the venv sees that
# interpreter's packages (also when it is itself a venv, through a .pth file) and
# bcg is installed without dependencies; otherwise the CPU wheel of
# torch==2.13.0 and the test dependencies are installed from the registry.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bcg-installed

.PHONY: test test-cuda bench clean

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*.c)
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "make: torch found in $(PYTHON): reusing its packages"; \
		$(PYTHON) -m venv --system-site-packages $(VENV) && \
		$(PYTHON) -c "import site; print(chr(10).join(site.getsitepackages()))" \
			> "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/bcg-parent-site.pth" && \
		$(PY) -c "import torch" && \
		$(PY) -m pip install -q --no-deps --no-build-isolation -e . ; \
	else \
		$(PYTHON) -m venv $(VENV) && \
		$(PY) -m pip install -q --upgrade pip setuptools wheel && \
		$(PY) -m pip install -q torch==2.13.0 && \
		$(PY) -m pip install -q pytest tqdm matplotlib numpy && \
		$(PY) -m pip install -q --no-build-isolation -e . ; \
	fi
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-cuda: $(STAMP)
	$(PY) -m pytest -q -m cuda

bench: $(STAMP)
	$(PY) -m bcg.bench --out benchmarks/results/run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info bcg/*.so
