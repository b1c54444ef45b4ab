"""A graph's form: one capture of its code (its plan, how it launches, the staged breakpoints a
replay asks and prepares), and the copy of a form's outputs into the graph's.

:class:`bcg.BreakableGraph` holds its forms and chooses among them; this module is what one
form does when chosen.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from bcg.core import cudart
from bcg.core.plan import BreakpointStep, Recording, SegmentStep, Step
from bcg.core.pool import PoolHandle
from bcg.core.replay import Executor, StagedExecutor, make_executor, native_parts
from bcg.core.torch_internals import profiler_enabled, pytree, stream_readers
from bcg.errors import ReplayError
from bcg.keyed.variants import VariantCache, VariantPolicy

_current_stream = stream_readers()[1]


class Form:
    """One captured form of a graph: its plan, how it launches, and the staged breakpoints a
    replay asks and prepares first (``staged_breakpoints`` None: it takes any live metadata).

    Built by :meth:`BreakableGraph.install` and :meth:`BreakableGraph.add_form`.
    """

    def __init__(self, recording: Recording, name: str, outputs: Any, policy: VariantPolicy | None,
                 suspects: list[Any], graph_pool: PoolHandle | None) -> None:
        self.name = name
        self.breakable = name == "breakable"
        self.tier = name.startswith("tier")
        self.recording = recording
        self.plan: tuple[Step, ...] = tuple(recording.plan)
        self.outputs = outputs
        graph_mode = recording.mode == "graph"
        staged = recording.staged_breakpoints
        self.staged_breakpoints = staged if graph_mode and staged else None  # eager mode: its rerun decides
        self.variants: VariantCache | None = None
        if any(isinstance(s, BreakpointStep) and s.spec.key is not None for s in self.plan):
            # attaches itself to the keyed steps (graph mode) before the executor reads them
            self.variants = VariantCache(self.plan, recording.device if graph_mode else None,
                                         policy or VariantPolicy(), self._rebuild_executor, suspects, graph_pool)
        self.executor: Executor | None = self._new_executor() if graph_mode else None
        self._executors: dict[frozenset[str], Executor] = {}
        if self.executor is not None:
            self._executors[frozenset()] = self.executor
        self.disabled: frozenset[str] = frozenset()  # node groups skipped now
        self.replays = 0
        self.on_change: Any = None  # called when the executor changes (the graph's native replay is stale)
        self._output_copy: OutputCopy | None = None

    @property
    def segments(self) -> list[SegmentStep]:
        return [s for s in self.plan if isinstance(s, SegmentStep)]

    @property
    def replays_natively(self) -> bool:
        """Whether C can launch this form's plan: the native executor, no keyed breakpoints, no
        guards or poison."""
        rec = self.recording
        return (self.executor is not None and self.executor.name == "native" and self.variants is None
                and rec.guards is None and rec.poison is None)

    def native_entry(self, first: Form) -> tuple[Any, ...]:
        """This form as ``bcg._native.Replay`` takes it, in a graph whose first capture is ``first``:
        ``(checks, head, tail, prepares, form, after, annotate_head, annotate_tail)``. Without plans
        (a staged graph's breakable form, which counts its reasons and switches node groups, or an
        executor C cannot split), C hands the replay to Python; ``after`` copies the outputs into
        ``first``'s where this form has its own."""
        parts = native_parts(self.executor)
        staged = self.staged_breakpoints
        if parts is None or (self.breakable and first.staged_breakpoints is not None):
            parts = (None, None, None, None)
        after = None
        if self.outputs is not None and self.outputs is not first.outputs:
            after = functools.partial(self.copy_outputs_to, first.outputs)
        head, tail, annotate_head, annotate_tail = parts
        return (staged.checks() if staged is not None else None, head, tail,
                staged.prepares() if staged is not None else (), self, after, annotate_head, annotate_tail)

    def misfit(self, live: Any) -> str | None:
        """Why ``live`` does not fit this form's staged breakpoints (None: it fits)."""
        return self.staged_breakpoints.misfit(live) if self.staged_breakpoints is not None else None

    def copy_outputs_to(self, dst: Any) -> int:
        """After a replay of this form: copy its outputs into ``dst`` (the graph's, which another
        form wrote when captured); return how many tensors were copied."""
        copy = self._output_copy
        if copy is None or copy.dst is not dst or copy.src is not self.outputs:
            copy = self._output_copy = OutputCopy(dst, self.outputs, f"the {self.name} form")
        return copy()

    def prepare(self, live: Any) -> None:
        """Run the staged breakpoints' ``prepare`` (host writes that the launch copies in)."""
        if self.staged_breakpoints is not None:
            self.staged_breakpoints.prepare(live)

    def run(self, live: Any, stitch: bool, device: int | None) -> None:
        """Prepare and launch this form on the current stream (``live`` is set by the caller)."""
        rec = self.recording
        executor = self.executor
        profiling = executor is not None and profiler_enabled()
        if isinstance(executor, StagedExecutor) and not profiling:
            executor.run(live)  # (it prepares after launching the work before the staged copies)
            self.replays += 1
            return
        self.prepare(live)
        if executor is None:
            rec.rerun()  # type: ignore[misc]  # eager mode
        elif profiling:
            if self.variants is not None:
                self.variants.begin_replay(live, stitch=False)
            self._run_profiled()
        elif self.variants is not None and (stitched := self.variants.begin_replay(live, stitch)) is not None:
            cudart.launch(stitched, _current_stream(device))  # every keyed step hit: one launch
        else:
            executor.run()
        self.replays += 1

    def _run_profiled(self) -> None:
        """Replay with a ``record_function`` range per step (only while a profiler runs)."""
        for step in self.plan:
            label = f"bcg.segment[{step.index}]" if isinstance(step, SegmentStep) else f"bcg.breakpoint:{step.name}"
            with torch.profiler.record_function(label):
                step.launch()

    def _new_executor(self, name: str | None = None) -> Executor:
        """An executor of the plan (``make_executor``'s ``name``). Where the staged copies begin
        after other work (``Recording.stage_at``), it launches that work before it prepares; not
        with keyed breakpoints (a stitched launch takes the whole plan, prepared first)."""
        at = self.recording.stage_at
        if at and self.variants is None:
            return StagedExecutor(self.plan, at, self.prepare, name)
        return make_executor(self.plan, name)

    def _rebuild_executor(self) -> None:
        """Rebuild the executor from the plan (keyed steps made plain breakpoint calls again), same kind."""
        if self.executor is not None:
            self._set_executor(self._new_executor(self.executor.name))

    def _set_executor(self, executor: Executor) -> None:
        self.executor = executor
        self._executors = {self.disabled: executor}
        if self.on_change is not None:
            self.on_change()

    def use_executor(self, name: str | None) -> None:
        if self.executor is not None:
            self._set_executor(self._new_executor(name))

    def switch(self, disabled: frozenset[str]) -> bool:
        """Skip the node groups ``disabled`` (all or none of a group's nodes); False for a group
        this form cannot skip (its nodes always run)."""
        always_run = self.recording.always_run
        done = True
        target = frozenset(label for label in disabled if label not in always_run)
        if target != disabled:
            done = False
        if self.executor is None or target == self.disabled:
            return done and (self.executor is not None or not disabled)
        device = self.recording.device
        assert device is not None
        with torch.cuda.device(device):
            stream = _current_stream(device)
            try:
                for step in self.segments:
                    step.skip(target, stream)
                executor = self._executors.get(target)
                if executor is None:
                    executor = self._executors[target] = self._new_executor(self.executor.name)
            except BaseException:
                for step in self.segments:  # back to the groups skipped before (built, or nodes)
                    step.skip(self.disabled, stream)
                raise
        self.executor, self.disabled = executor, target
        if self.on_change is not None:
            self.on_change()
        return done

    def free(self) -> None:
        """Release the form's variants, steps and pool lease (see :mod:`bcg.core.process`)."""
        if self.variants is not None:
            self.variants.release()
        self.recording.release()


def copy_outputs_into(dst: Any, src: Any, source: str) -> int:
    """Copy the result ``src`` (of ``source``: "an eager replay", ...) into the tensors of ``dst``;
    return how many tensors were copied (see :class:`OutputCopy`).

    Raises :class:`bcg.ReplayError` when the structure, a shape or a dtype differs.
    """
    return OutputCopy(dst, src, source)()


class OutputCopy:
    """The copy of ``src``'s tensors into ``dst``'s, decided once for trees whose tensors stay
    the same (a form's outputs into the graph's): call it to copy; it returns how many tensors
    it copied.

    A tensor of ``src`` that already is its ``dst`` (the same memory, shape, strides and dtype)
    is not copied; one whose memory overlaps a tensor of ``dst`` that is written is cloned first,
    so that no copy reads memory an earlier copy wrote.

    Raises :class:`bcg.ReplayError` when the structure, a shape or a dtype differs.
    """

    __slots__ = ("dst", "src", "_pairs")

    def __init__(self, dst: Any, src: Any, source: str) -> None:
        self.dst, self.src = dst, src
        dst_leaves, dst_spec = pytree.tree_flatten(dst)
        src_leaves, src_spec = pytree.tree_flatten(src)
        if dst_spec != src_spec:
            raise ReplayError(
                f"{source} returned {src_spec}, but the capture returned {dst_spec}; graph mode "
                "returns the captured outputs, so the function must return the same structure every time"
            )
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, (d, s) in enumerate(zip(dst_leaves, src_leaves)):
            if isinstance(d, torch.Tensor):
                if not isinstance(s, torch.Tensor) or s.shape != d.shape or s.dtype != d.dtype:
                    what = f"{tuple(s.shape)} {s.dtype}" if isinstance(s, torch.Tensor) else type(s).__name__
                    raise ReplayError(
                        f"{source}: output {i} is {what} but was {tuple(d.shape)} {d.dtype} at capture; "
                        "graph mode's outputs have the captured shapes and dtypes"
                    )
                if not _same_memory(d, s):
                    pairs.append((d, s))
        written = [_extent(d) for d, _ in pairs]
        # (destination, source, whether the source is cloned before any copy)
        self._pairs = [(d, s, any(_overlap(_extent(s), w) for w in written)) for d, s in pairs]

    def __call__(self) -> int:
        pairs = self._pairs
        sources = [s.clone() if clone else s for _, s, clone in pairs]  # before any copy
        for (d, _, _), s in zip(pairs, sources):
            d.copy_(s)
        return len(pairs)


def _extent(t: torch.Tensor) -> tuple[str, int, int]:
    """The device and the byte range ``[lo, hi)`` that ``t``'s elements span (empty: ``lo == hi``)."""
    if t.numel() == 0:
        return str(t.device), 0, 0
    lo = hi = t.data_ptr()
    for size, stride in zip(t.shape, t.stride()):
        reach = (size - 1) * stride * t.element_size()
        lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
    return str(t.device), lo, hi + t.element_size()


def _overlap(a: tuple[str, int, int], b: tuple[str, int, int]) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def _same_memory(d: torch.Tensor, s: torch.Tensor) -> bool:
    """Whether ``s`` and ``d`` are one tensor's memory (a copy between them would change nothing)."""
    return (d.device == s.device and d.data_ptr() == s.data_ptr() and d.shape == s.shape and d.stride() == s.stride()
            and d.dtype == s.dtype and d.is_conj() == s.is_conj() and d.is_neg() == s.is_neg() and d.numel() > 0)
