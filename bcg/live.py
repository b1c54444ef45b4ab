"""Live metadata: the per-replay host object that breakpoints read with :func:`live`.

It is carried by a :class:`contextvars.ContextVar`, so it is thread- and
reentrancy-safe; nothing is stored in module globals.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

_UNSET: Any = object()
_LIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("bcg_live", default=_UNSET)


def live(default: Any = _UNSET) -> Any:
    """Return this replay's live metadata.

    Inside a breakpoint this is what was passed to ``graph.replay(live=...)``;
    during capture it is what was passed to ``bcg.capture(..., live=...)``; in a
    plain eager run it is what :func:`live_scope` set. Raises ``LookupError``
    when none is set, unless ``default`` is given.
    """
    value = _LIVE.get()
    if value is _UNSET:
        if default is not _UNSET:
            return default
        raise LookupError(
            "bcg.live() was called with no live metadata set: pass live=... to "
            "bcg.capture()/graph.replay(), or wrap an eager run in bcg.live_scope(meta)"
        )
    return value


@contextlib.contextmanager
def live_scope(value: Any) -> Iterator[Any]:
    """Make ``value`` what :func:`live` returns inside this block (for eager runs)."""
    token = _LIVE.set(value)
    try:
        yield value
    finally:
        _LIVE.reset(token)


def set_live(value: Any) -> contextvars.Token[Any]:
    """Set the live metadata; return the token for :func:`reset_live` (library use)."""
    return _LIVE.set(value)


def reset_live(token: contextvars.Token[Any]) -> None:
    _LIVE.reset(token)
