"""Exceptions raised by bcg. Every one says what happened and what to do."""

from __future__ import annotations


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10 (which lacks it)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return
    try:
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]
    except AttributeError:  # an exception type that refuses attributes: leave it as it is
        pass


class BcgError(RuntimeError):
    """Base class of all bcg errors."""


class CaptureError(BcgError):
    """A capture could not start or was abandoned; no stream is left capturing."""


class NestedCaptureError(CaptureError):
    """A capture was started while another capture is underway on this thread or stream."""


class HostSyncInCaptureError(CaptureError):
    """An operation that needs the host (``.item()``, a pageable copy, ...) ran inside a segment."""


class ReplayError(BcgError):
    """A replay was refused before any work was launched, or a breakpoint broke its contract."""


class BreakpointOutputMismatch(ReplayError):
    """A breakpoint returned, at replay, something its capture-time bridges cannot hold."""
