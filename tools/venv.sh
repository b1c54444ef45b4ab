#!/bin/sh
# Creates the venv that `make test` and `make bench` use: torch, bcg (editable, with its
# C extension), the test dependencies and, on a GPU machine, cuda-bindings.
#
# * python3 already imports torch (a GPU box without a registry): the venv sees that
#   interpreter's packages and bcg is installed without dependencies.
# * Otherwise torch==$TORCH_VERSION: the CUDA build on a machine with an NVIDIA GPU, the CPU
#   build elsewhere. Packages come from where pip is told to look, as pip itself reads it
#   (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX, pip.conf):
#   - BCG_WHEELS=dir: from that folder of wheels alone (offline; pip's --no-index --find-links):
#     it must hold torch and its dependencies, setuptools, wheel, numpy, tqdm, pytest and
#     matplotlib with theirs (and cuda-bindings on a GPU machine);
#   - without a GPU, where the user set no index and no find-links: torch from PyTorch's CPU
#     index ($CPU_INDEX), everything else from the default index;
#   - without a GPU, where the user did set one: torch==$TORCH_VERSION+cpu from there if it
#     has it, else torch==$TORCH_VERSION from there.
# * With a usable GPU (and only then), graph capture needs cuda-bindings (of torch's CUDA
#   major version): installed if missing, or a clear error when it cannot be. It is of no use
#   without one, so it is never installed there (the `cuda` extra of pyproject.toml is the same
#   package, for GPU machines only).
set -eu
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
PY=$VENV/bin/python
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
CPU_INDEX=https://download.pytorch.org/whl/cpu

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

# Whether the user told pip where to look (environment or pip's configuration files).
user_sources() {
    [ -n "${PIP_INDEX_URL:-}${PIP_EXTRA_INDEX_URL:-}${PIP_FIND_LINKS:-}${PIP_NO_INDEX:-}" ] && return 0
    "$PY" -m pip config list 2>/dev/null | grep -Eq '^[^.]*\.(index-url|extra-index-url|find-links|no-index)='
}

if [ -n "${BCG_WHEELS:-}" ]; then
    if [ ! -d "$BCG_WHEELS" ]; then
        echo "venv: error: BCG_WHEELS=$BCG_WHEELS is not a folder (of wheels to install from)" >&2
        exit 1
    fi
    BCG_WHEELS=$(cd "$BCG_WHEELS" && pwd)
    echo "venv: installing from the wheels in $BCG_WHEELS only (BCG_WHEELS)"
    PIP_NO_INDEX=1
    PIP_FIND_LINKS="$BCG_WHEELS${PIP_FIND_LINKS:+ $PIP_FIND_LINKS}"
    export PIP_NO_INDEX PIP_FIND_LINKS
fi

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
    if [ -n "${BCG_WHEELS:-}" ]; then
        "$PY" -m pip install -q --upgrade setuptools wheel
    else
        "$PY" -m pip install -q --upgrade pip setuptools wheel
    fi
    if has_gpu; then
        echo "venv: NVIDIA GPU found: installing torch==$TORCH_VERSION (CUDA build)"
        "$PY" -m pip install -q "torch==$TORCH_VERSION"
    elif user_sources; then
        echo "venv: no NVIDIA GPU: installing torch==$TORCH_VERSION+cpu from your pip index / find-links"
        if ! "$PY" -m pip install -q "torch==$TORCH_VERSION+cpu" 2>/dev/null; then
            echo "venv: no torch==$TORCH_VERSION+cpu there: installing torch==$TORCH_VERSION from it"
            "$PY" -m pip install -q "torch==$TORCH_VERSION"
        fi
    else
        echo "venv: no NVIDIA GPU: installing the CPU wheel torch==$TORCH_VERSION+cpu (PyTorch's CPU index)"
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
