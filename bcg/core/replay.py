"""Executors: run a replay plan on the current stream.

The Python executor calls each step's ``launch`` in order. The native executor
(``csrc/``, module ``bcg._native``) runs the same plan in one C loop: segments
are launched with ``cuGraphLaunch`` straight from C, and only breakpoints (and
segments that use RNG, whose replay must go through torch) call back into
Python. Both see the plan only through ``SegmentStep``/``BreakpointStep``. A plan
with staged copies (``Recording.stage_at``) replays in two parts, its staged
breakpoints' ``prepare`` between them (:class:`StagedExecutor`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Union

from bcg.core import native
from bcg.core.torch_internals import stream_readers
from bcg.errors import ReplayError, add_note
from bcg.core.plan import BreakpointStep, SegmentStep, Step

log = logging.getLogger("bcg")

EXECUTORS = ("python", "native")


def _breakpoint_note(step: BreakpointStep) -> str:
    return (
        f"bcg: raised by breakpoint {step.name!r} during replay; the segments after it "
        "did not run and the graph stays replayable"
    )


class PythonExecutor:
    """Replays a plan with a Python loop over ``step.launch``."""

    name = "python"

    def __init__(self, plan: Sequence[Step]) -> None:
        self._launches: tuple[Callable[[], None], ...] = tuple(step.launch for step in plan)
        self._plan = tuple(plan)

    def run(self) -> None:
        try:
            for launch in self._launches:
                launch()
        except BaseException as exc:
            step = _failed_breakpoint(exc, self._plan)
            if step is not None:
                add_note(exc, _breakpoint_note(step))
            raise


def _failed_breakpoint(exc: BaseException, plan: Sequence[Step]) -> BreakpointStep | None:
    """The breakpoint whose function raised ``exc`` (read from its traceback), if any.

    Only runs after a failure, so the replay loop itself counts nothing.
    """
    codes: dict[Any, BreakpointStep] = {}
    for step in plan:
        if isinstance(step, BreakpointStep):
            code = getattr(step.spec.fn, "__code__", None)
            if code is not None:
                codes.setdefault(code, step)
    tb = exc.__traceback__
    while tb is not None:
        step = codes.get(tb.tb_frame.f_code)
        if step is not None:
            return step
        tb = tb.tb_next
    return None


class NativeExecutor:
    """Replays a plan in one C loop (``bcg._native.Plan``).

    Segments are launched by handle (their ``cudaGraphExec_t``) with
    ``cuGraphLaunch`` on the caller's current stream, read at each replay.
    Breakpoints, and segments that use RNG (``SegmentStep.uses_rng``), are
    called through their ``launch``, so torch advances the RNG generator
    exactly as its own replay does.
    """

    name = "native"

    def __init__(self, plan: Sequence[Step]) -> None:
        self._plan = tuple(plan)
        steps: list[Any] = []
        self._plan_index: list[int] = []  # each C step's plan step (a segment's parameter steps are its own)
        for i, step in enumerate(self._plan):
            if isinstance(step, BreakpointStep):
                steps.append(step.call())
            elif step.uses_rng:
                steps.append(step.launch)
            else:
                steps.extend(step.staged_updates())
                steps.append(step.exec_handle)
            self._plan_index.extend([i] * (len(steps) - len(self._plan_index)))
        self._native = native.module().Plan(steps)
        self._replay: Callable[..., None] = self._native.replay
        self._get_device: Callable[[], int] | None = None
        self._get_stream: Callable[[int], int] | None = None
        if self._native.launches:
            self._get_device, self._get_stream = stream_readers()

    @property
    def launches(self) -> int:
        """How many segments the C loop launches itself (the others go through torch)."""
        return int(self._native.launches)

    def current(self) -> tuple[int, int] | None:
        """``(stream, device)`` where :meth:`run` launches now; None for a plan of callables only."""
        if self._get_device is None:
            return None
        assert self._get_stream is not None
        device = self._get_device()
        return self._get_stream(device), device

    @property
    def plan(self) -> Any:
        """The ``bcg._native.Plan`` this executor replays."""
        return self._native

    def run(self, where: tuple[int, int] | None = None) -> None:
        """One replay on ``where`` (``(stream, device)`` from :meth:`current`; None: read now)."""
        try:
            if self._get_device is None:
                self._replay(0)  # callables only: no stream, no driver needed
            else:
                if where is None:
                    where = self.current()
                    assert where is not None
                self._replay(*where)
        except BaseException as exc:
            self.annotate(exc)
            raise

    def annotate(self, exc: BaseException) -> None:
        """Add a note to ``exc``, raised by the last replay, naming the step that failed."""
        failed = self._native.failed_step
        i = self._plan_index[failed] if 0 <= failed < len(self._plan_index) else -1
        step = self._plan[i] if i >= 0 else None
        if isinstance(step, BreakpointStep):
            add_note(exc, _breakpoint_note(step))
        elif isinstance(step, SegmentStep) and getattr(exc, "cuda_error", None) is not None:
            add_note(
                exc,
                f"bcg: segment {step.index} (plan step {i}) failed to launch during a native "
                "replay; the steps before it ran and the ones after it did not",
            )


class StagedExecutor:
    """Replays a plan whose staged copies begin at step ``at``: the steps before it, then
    ``prepare(live)`` (the staged breakpoints' host writes, which those copies read), then the rest.
    The GPU runs the first part while the host prepares."""

    def __init__(self, plan: Sequence[Step], at: int, prepare: Callable[[Any], None], name: str | None = None) -> None:
        self._head = make_executor(plan[:at], name)
        self._tail = make_executor(plan[at:], name)
        self._prepare = prepare
        self.name = self._tail.name
        head, tail = self._head, self._tail
        self.native = (head, tail) if isinstance(head, NativeExecutor) and isinstance(tail, NativeExecutor) else None

    def run(self, live: Any) -> None:
        """One replay; ``prepare(live)`` runs between the two parts (native ones launch on the
        device and stream read once, before the first)."""
        native = self.native
        if native is not None:
            head, tail = native
            where = head.current() or tail.current()
            head.run(where)
            self._prepare(live)
            tail.run(where)
            return
        self._head.run()
        self._prepare(live)
        self._tail.run()


Executor = Union[PythonExecutor, NativeExecutor, StagedExecutor]

# A form's plans as the native replay takes them: (head, tail, annotate_head, annotate_tail)
NativeParts = tuple[Any, Any, Callable[[BaseException], None] | None, Callable[[BaseException], None]]


def native_parts(executor: Executor | None) -> NativeParts | None:
    """``executor``'s ``bcg._native.Plan`` s for a replay in C (``head`` None: the staged
    ``prepare`` s run first), or None when it replays in Python (the Python executor)."""
    if isinstance(executor, NativeExecutor):
        return None, executor.plan, None, executor.annotate
    if isinstance(executor, StagedExecutor) and executor.native is not None:
        head, tail = executor.native
        return head.plan, tail.plan, head.annotate, tail.annotate
    return None


def _plan_launches(plan: Sequence[Step]) -> bool:
    return any(isinstance(s, SegmentStep) and not s.uses_rng for s in plan)


def make_executor(plan: Sequence[Step], name: str | None = None) -> Executor:
    """The executor for ``plan``: ``name`` is ``"python"``, ``"native"`` or ``None`` (best available).

    ``None`` picks the native executor when ``bcg._native`` is built, the
    environment does not say ``BCG_NATIVE=0`` and (for a plan that launches
    graphs) the CUDA driver loads; otherwise the Python one. ``"native"`` raises
    :class:`bcg.ReplayError` when the extension is not built.
    """
    if name is None:
        if not native.enabled_by_env():
            return PythonExecutor(plan)
        if not native.available():
            log.debug("bcg: replaying with the Python executor: %s", native.why_unavailable())
            return PythonExecutor(plan)
        if _plan_launches(plan):
            why = native.driver_error()
            if why is not None:
                log.debug("bcg: replaying with the Python executor: %s", why)
                return PythonExecutor(plan)
        return NativeExecutor(plan)
    if name == "python":
        return PythonExecutor(plan)
    if name == "native":
        if not native.available():
            raise ReplayError(
                f"the native executor is not available: {native.why_unavailable()}; "
                "or replay with the Python executor (use_executor('python'))"
            )
        return NativeExecutor(plan)
    raise ValueError(f"unknown executor {name!r}: choose one of {EXECUTORS} or None (the best available)")
