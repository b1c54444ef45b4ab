"""Exceptions raised by bcg. Every one says what happened and what to do."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Iterable
from types import FrameType


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10 (which lacks it)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return
    try:
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]
    except AttributeError:  # an exception type that refuses attributes: leave it as it is
        pass


def _library_dirs() -> tuple[str, str]:
    """The folders of torch and bcg: frames there are not the user's."""
    import torch

    return os.path.dirname(torch.__file__), os.path.dirname(__file__)


def user_line(frames: Iterable[traceback.FrameSummary]) -> str:
    """``file:line: code`` of the innermost frame outside torch and bcg ("" if none)."""
    skip = _library_dirs()
    found = ""
    for frame in frames:
        if not frame.filename.startswith(skip):
            found = f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return found


def user_frame() -> FrameType | None:
    """The innermost live frame outside torch and bcg (the user's code, or Inductor's generated
    code) of the calling thread; None if there is none."""
    skip = _library_dirs()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
    return frame


class BcgError(RuntimeError):
    """Base class of all bcg errors."""


class CaptureError(BcgError):
    """A capture could not start or was abandoned; no stream is left capturing."""


class NestedCaptureError(CaptureError):
    """A capture was started while another capture is underway on this thread or stream."""


class CaptureInvalidatedError(CaptureError):
    """CUDA invalidated the capture; the message names the cause bcg identified and what to do."""


class HostSyncInCaptureError(CaptureInvalidatedError):
    """An operation that needs the host (``.item()``, a pageable copy, ...) ran inside a segment."""


class StreamForkError(CaptureInvalidatedError):
    """A segment waited on side-stream work from outside the capture: a fork crossed a breakpoint."""


class LiveReadInSegmentError(CaptureError):
    """``bcg.live()`` was read by code between breakpoints while that code was being captured."""


class ReplayError(BcgError):
    """A replay was refused before any work was launched, or a breakpoint broke its contract."""


class NoFormFitsError(ReplayError):
    """A replay's live metadata fits none of the graph's staged forms, and it has no breakable form
    (a :class:`bcg.GraphRunner` call runs eagerly instead: fallback ``"staged_unfit"``)."""


class GuardError(ReplayError):
    """A tensor the graph captured no longer has its captured address or layout (``Debug(guards=True)``)."""


class StaleTensorError(ReplayError):
    """A tensor the graph reads was replaced: nothing but the graph holds its storage any more."""


class BreakpointOutputMismatch(ReplayError):
    """A breakpoint returned, at replay, something its capture-time bridges cannot hold."""


class VerificationError(BcgError):
    """Replay and eager disagree: raised by :func:`bcg.verify` (``.report`` holds its
    :class:`bcg.verify.VerifyReport`) and by a keyed breakpoint's audit (``.report`` is None)."""

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report
