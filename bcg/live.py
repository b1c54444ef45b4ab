"""Live metadata: the per-replay host object that breakpoints read with :func:`live`.

It is carried by a :class:`contextvars.ContextVar`, so it is thread- and
reentrancy-safe; nothing is stored in module globals.
"""

from __future__ import annotations

import contextlib
import contextvars
import traceback
from collections.abc import Iterator
from typing import Any

from bcg.errors import LiveReadInSegmentError, user_line
from bcg.recorder import ACTIVE


class _Unset:
    """The type of :data:`_UNSET`, "no value given" (``None`` is a valid live value).

    One instance; compared by identity (``is _UNSET``). Its repr makes signatures
    read ``live=<unset>``; copies are the instance itself.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "<unset>"

    def __copy__(self) -> _Unset:
        return self

    def __deepcopy__(self, memo: object) -> _Unset:
        return self


_UNSET: Any = _Unset()
_LIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("bcg_live", default=_UNSET)


def live(default: Any = _UNSET, *, static_ok: bool = False) -> Any:
    """Return this replay's live metadata.

    Inside a breakpoint this is what was passed to ``graph.replay(live=...)``;
    during capture it is what was passed to ``bcg.capture(..., live=...)``; in a
    plain eager run it is what :func:`live_scope` set.

    Arguments:
        default: returned when no live metadata is set (otherwise ``LookupError``).
        static_ok: allow a read from code between breakpoints while it is being
            captured (or recorded in eager mode). Such code runs once, at capture:
            whatever it derives from the value is frozen into the graph. Pass
            ``True`` only for fields that never change for this graph.

    .. warning::
        Read per-replay values only inside ``@bcg.breakpoint`` functions. A read
        from segment code during a capture raises :class:`bcg.LiveReadInSegmentError`
        naming the line, unless ``static_ok=True``.
    """
    if not static_ok:
        recorder = ACTIVE.get()
        if recorder is not None and recorder.in_segment:
            where = user_line(traceback.extract_stack()[:-1])
            raise LiveReadInSegmentError(
                f"bcg.live() was read{' at ' + where if where else ''} by code between breakpoints "
                f"while {recorder.segment_label} was being recorded: its value would be frozen into the "
                "graph, and every replay would reuse the capture-time metadata. Move the code that "
                "depends on it into a @bcg.breakpoint function (it runs at every replay), or, if it only "
                "reads fields that never change for this graph, call bcg.live(static_ok=True)."
            )
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
