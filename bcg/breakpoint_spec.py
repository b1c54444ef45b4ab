"""What the library knows about one ``@bcg.breakpoint`` function."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, eq=False)
class BreakpointSpec:
    """A breakpoint: the eager function, its optional capture stub, and a name.

    ``enabled`` is a bool or a zero-argument callable asked at each capture-time
    call; a disabled breakpoint is captured into the segment like any code.
    """

    fn: Callable[..., Any]
    name: str
    enabled: bool | Callable[[], bool] = True
    capture_stub: Callable[..., Any] | None = None

    def is_enabled(self) -> bool:
        return bool(self.enabled() if callable(self.enabled) else self.enabled)
