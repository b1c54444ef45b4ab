# `make test` and `make bench` do all set-up on a fresh machine (tools/venv.sh says how).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bcg-installed
BENCH_STAMP := $(VENV)/.bcg-bench

.PHONY: test test-cuda bench clean

$(STAMP): pyproject.toml setup.py tools/venv.sh $(wildcard csrc/*.c)
	PYTHON=$(PYTHON) VENV=$(VENV) sh tools/venv.sh
	@touch $(STAMP)

# The bench extra (matplotlib for the PNG), when the venv does not see it already.
$(BENCH_STAMP): $(STAMP)
	@$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q --no-build-isolation -e ".[bench]"
	@touch $(BENCH_STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

# Only the GPU tests; fails, with the reason, where no GPU is usable (instead of skipping them all).
test-cuda: $(STAMP)
	@$(PY) -c "import sys; from tests.conftest import cuda_problem; p = cuda_problem(); sys.exit(p and 'make test-cuda: no usable GPU: ' + p)"
	$(PY) -m pytest -q -m cuda

bench: $(BENCH_STAMP)
	$(PY) -m bcg.bench --out benchmarks/results/run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info bcg/*.so
