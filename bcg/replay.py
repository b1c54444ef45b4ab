"""Executors: run a replay plan on the current stream.

The Python executor calls each step's ``launch`` in order. A native executor
(``csrc/``) can run the same plan in one C loop; both see the plan only
through ``SegmentStep``/``BreakpointStep``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from bcg.plan import BreakpointStep, Step


class PythonExecutor:
    """Replays a plan with a Python loop over ``step.launch``."""

    name = "python"

    def __init__(self, plan: Sequence[Step]) -> None:
        self._launches: tuple[Callable[[], None], ...] = tuple(step.launch for step in plan)
        self._plan = tuple(plan)

    def run(self) -> None:
        i = 0
        try:
            for i, launch in enumerate(self._launches):
                launch()
        except BaseException as exc:
            step = self._plan[i]
            if isinstance(step, BreakpointStep):
                exc.add_note(
                    f"bcg: raised by breakpoint {step.name!r} during replay; the segments after it "
                    "did not run and the graph stays replayable"
                )
            raise


def make_executor(plan: Sequence[Step], name: str | None = None) -> PythonExecutor:
    """The executor for ``plan``: ``name`` is ``"python"``, ``"native"`` or ``None`` (best available)."""
    if name not in (None, "python"):
        raise ValueError(f"unknown executor {name!r}: the native executor is not built in this install")
    return PythonExecutor(plan)
