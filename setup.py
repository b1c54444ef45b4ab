"""Build script: the package is pure Python plus (see csrc/) an optional C extension.

``bcg._native`` is plain C against the CPython API: no PyTorch C++ ABI and no
CUDA toolkit at build time (the driver is opened with dlopen at run time). It is
optional: without a C compiler or the Python headers the install still succeeds
and bcg replays with its Python executor.
"""

import sys

from setuptools import Extension, setup

_libraries = ["dl"] if sys.platform.startswith("linux") else []

setup(
    ext_modules=[
        Extension(
            "bcg._native",
            sources=["csrc/native.c"],
            libraries=_libraries,
            extra_compile_args=["-O2", "-Wall"] if sys.platform != "win32" else [],
            optional=True,
        )
    ],
)
