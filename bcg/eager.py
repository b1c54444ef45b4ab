"""Eager mode: run the code as-is, record its segment/breakpoint structure, and hold every
replay to the contracts graph mode enforces.

Used by ``make_graph(..., mode="eager")`` (debugging, machines with no CUDA).
Work between breakpoints is counted in ATen operations through a dispatch
mode, so a region with no tensor work is not a segment, as in graph mode. Each
breakpoint call's output contract is recorded (a :class:`bcg.core.bridge.BridgeSet`
that allocates nothing) and every replay is checked against it: the same
breakpoints in the same order, the same output structure, shapes, dtypes,
frozen values and in-place results, or :class:`bcg.errors.BreakpointOutputMismatch`
-- the debugging mode is at least as strict as graph mode. Staged
breakpoints run as in graph mode: inline (the recorded ``prepare`` values,
this replay's buffers uploaded) when every one fits, else the breakable form.
Keyed breakpoints run eagerly; their keys are computed (and must be
hashable) and counted as in graph mode, but no variant is captured.
"""

from __future__ import annotations

import logging
from typing import Any

from bcg.core.torch_internals import TorchDispatchMode

from bcg.core.breakpoint import BreakpointSpec, Recorder, live
from bcg.core.bridge import BridgeSet
from bcg.errors import BreakpointOutputMismatch
from bcg.core.plan import BreakpointStep, SegmentStep, Step
from bcg.staged.staging import NOT_INLINE, StagedBreakpoints
from bcg.keyed.variants import VariantCache

log = logging.getLogger("bcg")


class _OpCounter(TorchDispatchMode):
    """Counts non-view ATen operations while ``counting`` is set."""

    # compiled graphs call their breakpoints' ops through higher-order operators
    # (auto_functionalized); they pass through here and are counted as one operation
    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.counting = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile'd code compiles and runs compiled under this mode (fullgraph=True
        # refuses to run under a mode that is not so marked); its operations are still counted
        # where they go through the dispatcher.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.counting and not getattr(func, "is_view", False):
            self.ops += 1
        return func(*args, **(kwargs or {}))


class EagerRecorder(Recorder):
    """The active recorder of an eager-mode recording: runs breakpoints plainly, records structure."""

    segment_label = "an eager-mode segment"

    def __init__(self) -> None:
        super().__init__()
        self.plan: list[Step] = []
        self._counter = _OpCounter()
        self._segments = 0
        self._breakpoints = 0
        self.staged_breakpoints = StagedBreakpoints()

    def on_staged(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = self.staged_breakpoints.record(self, spec, args, kwargs)  # inline: segment work, not a step
        return self.on_breakpoint(spec, args, kwargs) if result is NOT_INLINE else result

    def __enter__(self) -> EagerRecorder:
        self._counter.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if exc[0] is None:
                self._close_region()
        finally:
            self._counter.__exit__(*exc)

    def _close_region(self) -> None:
        if self._counter.ops:
            self.plan.append(SegmentStep(index=self._segments, cuda_graph=None, nodes=self._counter.ops, kernel_nodes=None))
            self._segments += 1
        self._counter.ops = 0

    def on_breakpoint(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._close_region()
        self._counter.counting = False
        try:
            result = self.run_breakpoint(spec.fn, args, kwargs)
        finally:
            self._counter.counting = True
        contract = BridgeSet(spec.name, result, args, kwargs, allocate=False)
        self.plan.append(BreakpointStep(spec=spec, args=(), kwargs={}, bridges=contract, index=self._breakpoints))
        self._breakpoints += 1
        log.debug("breakpoint %r after segment %d (eager mode)", spec.name, self._segments - 1)
        return result

    def on_graph_break(self) -> None:
        self._close_region()


class EagerReplay(Recorder):
    """The active recorder of an eager-mode replay: each breakpoint call is checked against
    the recording's (same breakpoint at the same position, same output contract)."""

    segment_label = "an eager-mode segment"

    def __init__(self, plan: tuple[Step, ...], staged_breakpoints: StagedBreakpoints | None = None,
                 variants: VariantCache | None = None) -> None:
        super().__init__()
        self._steps = [s for s in plan if isinstance(s, BreakpointStep)]
        self._variants = variants  # keyed breakpoints: their keys are computed and counted
        self._keyed: set[BreakpointSpec] = set()
        self._next = 0
        self._staged_breakpoints = staged_breakpoints
        self._inline: bool | None = None  # decided at the first staged call, for the whole replay

    def on_staged(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """As a graph replay: inline with the recorded values when every staged breakpoint fits
        (each ``prepare`` runs once), else the breakable form (real metadata)."""
        staged = self._staged_breakpoints
        if staged is None or spec.name not in staged.names:
            return self.on_breakpoint(spec, args, kwargs)  # recorded as a breakpoint
        if self._inline is None:
            value = live(static_ok=True)
            self._inline = staged.misfit(value) is None
            if self._inline:
                staged.prepare_and_upload(value)
        if self._inline:
            return self.run_breakpoint(spec.fn, args, kwargs, live=staged.value(spec))
        return self.run_breakpoint(spec.fn, args, kwargs)

    def on_breakpoint(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        k = self._next
        recorded = self._steps[k] if k < len(self._steps) else None
        if recorded is None or recorded.spec is not spec:
            expected = f"breakpoint {recorded.name!r}" if recorded is not None else "no more breakpoints"
            raise BreakpointOutputMismatch(
                f"eager replay called breakpoint {spec.name!r} as breakpoint call {k}, where the recording "
                f"had {expected}: the control flow between breakpoints changed, which graph mode would "
                "have frozen at capture. Make that control flow depend only on values fixed at capture, "
                "or move it into a breakpoint"
            )
        self._next += 1
        if spec.key is not None and self._variants is not None:
            self._variants.observe_eager(spec, live(static_ok=True), first=spec not in self._keyed)
            self._keyed.add(spec)
        result = self.run_breakpoint(spec.fn, args, kwargs)
        contract = recorded.bridges
        if contract is not None and (result is not None or not contract.empty):
            contract.check(result, args, kwargs)
        return result

    def finish(self) -> None:
        """Raise if the replay called fewer breakpoints than the recording."""
        if self._next != len(self._steps):
            raise BreakpointOutputMismatch(
                f"eager replay called {self._next} breakpoint(s) where the recording called "
                f"{len(self._steps)} (next: {self._steps[self._next].name!r}): the control flow between "
                "breakpoints changed, which graph mode would have frozen at capture"
            )
