"""Loader for ``bcg._native``, the optional C replay loop (built from ``csrc/``).

The extension is imported lazily, at the first question asked here, so a
missing or broken build never breaks ``import bcg``: :func:`available` says
whether it can be used and :func:`why_unavailable` says why not.
``BCG_NATIVE=0`` in the environment makes the default executor the Python one
(see :func:`enabled_by_env`); an explicit ``use_executor("native")`` still works.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from bcg.core.env import env_flag

ENV_VAR = "BCG_NATIVE"


@functools.cache
def _load() -> tuple[ModuleType | None, str | None]:
    try:
        module = importlib.import_module("bcg._native")
    except ImportError as exc:
        return None, (
            f"the C extension bcg._native is not built or cannot be loaded ({exc}); build it with "
            "a C compiler and the Python headers: pip install --no-build-isolation -e ."
        )
    return module, None


def available() -> bool:
    """Whether the C extension ``bcg._native`` is built and importable."""
    return _load()[0] is not None


def why_unavailable() -> str | None:
    """Why :func:`available` is false (``None`` when it is true)."""
    return _load()[1]


def module() -> ModuleType:
    """The ``bcg._native`` module; ``ImportError`` saying why when it is not available."""
    mod, reason = _load()
    if mod is None:
        raise ImportError(reason)
    return mod


def enabled_by_env() -> bool:
    """False when ``BCG_NATIVE`` is off (``0``/``false``/``no``/``off``): default to Python.

    Raises ``ValueError`` for a value that is not a flag (see :func:`bcg.core.env.env_flag`).
    """
    return env_flag(ENV_VAR, default=True)


def driver_error() -> str | None:
    """Why the CUDA driver (``libcuda.so.1``) cannot be loaded, or ``None`` when it can.

    Only graph launches need it; a plan of callables replays without it.
    """
    mod, reason = _load()
    if mod is None:
        return reason
    try:
        mod.load_driver()
    except RuntimeError as exc:
        return str(exc)
    return None
