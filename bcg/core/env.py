"""``BCG_*`` environment switches: one parser for every boolean flag."""

from __future__ import annotations

import os

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def env_flag(name: str, default: bool = False) -> bool:
    """The boolean value of environment variable ``name``.

    Accepts ``1``/``0``, ``true``/``false``, ``yes``/``no`` and ``on``/``off`` in
    any case, with surrounding spaces; unset or empty gives ``default``.

    Raises:
        ValueError: any other value (naming the variable), rather than guessing.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"environment variable {name}={raw!r} is not a flag: set it to 1/0, true/false, yes/no "
        "or on/off (any case), or unset it"
    )
