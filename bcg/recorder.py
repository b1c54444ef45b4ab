"""The active recorder: whoever is capturing (or eagerly recording) on this context.

Breakpoints look it up on every call; ``None`` means "plain call". It lives in a
:class:`contextvars.ContextVar`, so captures on different threads never see
each other.
"""

from __future__ import annotations

import contextvars
from typing import Any, Protocol

from bcg.breakpoint_spec import BreakpointSpec


class Recorder(Protocol):
    """What a capture (or an eager structure recording) must handle."""

    def call_breakpoint(
        self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any: ...

    def graph_break(self) -> None: ...


ACTIVE: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "bcg_active_recorder", default=None
)
