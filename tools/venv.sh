#!/bin/sh
# Creates the venv that `make test` and `make bench` use: torch, bcg (editable, with its
# C extension), the test dependencies and, on a GPU machine, cuda-bindings.
#
# * python3 already imports torch (a GPU box without a registry): the venv sees that
#   interpreter's packages and bcg is installed without dependencies.
# * Otherwise, from the registry: torch==$TORCH_VERSION, the CUDA build on a machine with an
#   NVIDIA GPU, the CPU wheel (PyTorch's CPU index) elsewhere.
# * With a usable GPU, graph capture needs cuda-bindings (of torch's CUDA major version):
#   installed if missing, or a clear error when it cannot be.
set -eu
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
PY=$VENV/bin/python
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
CPU_INDEX=https://download.pytorch.org/whl/cpu

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

if "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "venv: torch found in $PYTHON: reusing its packages"
    "$PYTHON" -m venv --system-site-packages "$VENV"
    # When $PYTHON is itself a venv, --system-site-packages reaches only the base
    # interpreter: a .pth file makes $PYTHON's own packages visible too.
    purelib=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PYTHON" -c "import site; print(chr(10).join(site.getsitepackages()))" > "$purelib/bcg-parent-site.pth"
    "$PY" -c "import torch"
    "$PY" -m pip install -q --no-deps --no-build-isolation -e .
else
    "$PYTHON" -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip setuptools wheel
    if has_gpu; then
        echo "venv: NVIDIA GPU found: installing torch==$TORCH_VERSION (CUDA build)"
        "$PY" -m pip install -q "torch==$TORCH_VERSION"
    else
        echo "venv: no NVIDIA GPU: installing the CPU wheel torch==$TORCH_VERSION+cpu"
        # torch alone from the CPU index (its dependencies come from the default index below)
        "$PY" -m pip install -q --no-deps --index-url "$CPU_INDEX" "torch==$TORCH_VERSION+cpu"
    fi
    "$PY" -m pip install -q --no-build-isolation -e ".[test]"
fi

if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
    && ! "$PY" -c "import cuda.bindings.runtime" 2>/dev/null; then
    major=$("$PY" -c "import torch; print(torch.version.cuda.split('.')[0])")
    echo "venv: graph capture needs cuda-bindings: installing cuda-bindings==$major.*"
    if ! "$PY" -m pip install -q "cuda-bindings==$major.*"; then
        echo "venv: error: this machine has a usable GPU, but cuda-bindings (needed for graph capture) is not installed and pip could not install it (no registry?). Install cuda-bindings==$major.* for $PYTHON, then run make again." >&2
        exit 1
    fi
fi
