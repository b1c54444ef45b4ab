"""``bcg.verify``: prove a breakable graph computes what the eager code computes.

For each live sample it writes fresh inputs, replays the graph while tapping
every breakpoint's inputs and outputs, runs the same function eagerly with the
same taps, and compares step by step. The first divergence names the segment
(or breakpoint) that produced it — the usual culprit is a dynamic op nobody
marked as a breakpoint, captured with the capture-time metadata.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from bcg.core.torch_internals import pytree

from bcg.core.args import check_bool, check_callable, check_real, fail
from bcg.core.breakpoint import BreakpointSpec, Recorder, live_scope, recording
from bcg.errors import VerificationError
from bcg.graph import BreakableGraph
from bcg.make_graph import make_graph
from bcg.core.plan import BreakpointStep, GraphSource, SegmentStep, Step

log = logging.getLogger("bcg")


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x.detach().clone() for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _read_tensors(spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Clones of a breakpoint's input tensors: all but those it declares in ``mutates``."""
    written = {id(t) for t in spec.mutated_tensors(args, kwargs)} if spec.mutates is not None else set()
    return [t.detach().clone() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and id(t) not in written]


def _written_tensors(spec: BreakpointSpec, result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    return _tensors(result) + _tensors(spec.mutated_tensors(args, kwargs))


@dataclass
class _Tap:
    """What crossed one breakpoint: its tensor inputs before, its outputs after."""

    name: str
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor] = field(default_factory=list)


class _EagerTapRecorder(Recorder):
    """Active recorder for the eager reference run: runs breakpoints, records their taps."""

    segment_label = "the eager reference run of bcg.verify"

    def __init__(self, steps: set[int]) -> None:
        super().__init__()
        self.taps: list[_Tap] = []
        self._steps = steps  # id() of the specs that are steps of the replayed plan

    def on_staged(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if id(spec) in self._steps:
            return self.on_breakpoint(spec, args, kwargs)
        # inline in a segment (with the real metadata here: the exact reference): compared
        # through what reads its results
        return self.run_breakpoint(spec.fn, args, kwargs)

    def on_breakpoint(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tap = _Tap(spec.name, _read_tensors(spec, args, kwargs))
        result = self.run_breakpoint(spec.fn, args, kwargs)
        tap.outputs = _written_tensors(spec, result, args, kwargs)
        self.taps.append(tap)
        return result


@dataclass(frozen=True)
class Mismatch:
    """Where replay and eager first disagree."""

    sample: int
    live: Any
    where: str  # "segment", "breakpoint", "output", "replay" or "structure"
    segment: int | None
    breakpoint_before: str | None
    breakpoint_after: str | None
    tensor: int
    max_abs_diff: float

    def __str__(self) -> str:
        if self.where == "structure":
            return f"sample {self.sample}: the eager run called different breakpoints than the capture ({self.breakpoint_after})"
        around = f"between breakpoint {self.breakpoint_before!r} and {self.breakpoint_after!r}"
        if self.where == "replay":
            return (
                f"sample {self.sample} (live={self.live!r}): replaying the whole graph again (keyed breakpoints "
                f"from their variants, stitched where possible) gave different outputs than eager; tensor "
                f"{self.tensor}, max |replay - eager| = {self.max_abs_diff:.3g}. A keyed breakpoint's key= "
                "probably misses something its GPU work depends on"
            )
        if self.where == "breakpoint":
            what = f"breakpoint {self.breakpoint_after!r} returned/wrote different values from the same inputs"
        elif self.where == "output":
            what = f"segment {self.segment} (after breakpoint {self.breakpoint_before!r}) produced different outputs"
        else:
            what = f"segment {self.segment} ({around}) produced different values"
        return (
            f"sample {self.sample} (live={self.live!r}): {what}; tensor {self.tensor}, "
            f"max |replay - eager| = {self.max_abs_diff:.3g}. A dynamic op in that segment was probably "
            "captured with capture-time metadata: mark it with @bcg.breakpoint."
        )


@dataclass
class VerifyReport:
    """The outcome of :func:`verify`."""

    samples: int
    mismatches: list[Mismatch]
    graph: BreakableGraph

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def first(self) -> Mismatch | None:
        return self.mismatches[0] if self.mismatches else None

    def __str__(self) -> str:
        if self.ok:
            return f"bcg.verify: {self.samples} live samples, replay equals eager at every breakpoint and output"
        lines = [f"bcg.verify: {len(self.mismatches)} of {self.samples} samples diverge; first:", f"  {self.first}"]
        return "\n".join(lines)


def verify(
    fn: Callable[..., Any] | BreakableGraph,
    make_inputs: Callable[[], Sequence[Any]],
    live_samples: Sequence[Any],
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    raise_on_mismatch: bool = True,
    **make_graph_kwargs: Any,
) -> VerifyReport:
    """Replay vs. eager, step by step, for every live sample.

    ``fn`` is a function (captured here with :func:`bcg.make_graph` on
    ``make_inputs()`` and ``live_samples[0]``) or a graph made by ``make_graph``.
    ``make_inputs()`` returns fresh input tensors (same shapes as the static
    arguments); they are copied into the static arguments before each sample.
    Comparison is exact by default (same kernels give the same bits); NaN equals
    NaN. Breakpoints should declare ``mutates`` (their written arguments are then
    compared as outputs, not inputs); tensors must be fully written by the code
    (rows left uninitialised differ between runs). Keyed breakpoints (``key=``)
    run from their variants where this sample's key was met before (a miss
    otherwise); a sample that passes step by step is then replayed whole
    (stitched once the graph can stitch and the keys' variants have launched
    once) and compared again, so a key that misses a field is caught when two
    samples share it. Give repeated samples to exercise stitched replays.
    Raises :class:`VerificationError` on a mismatch unless
    ``raise_on_mismatch=False``; ``TypeError`` or ``ValueError`` naming an argument
    that is wrong (``fn`` and ``make_inputs`` callable, ``live_samples`` a non-empty
    sequence, ``rtol``/``atol`` numbers >= 0).
    """
    _check_arguments(fn, make_inputs, live_samples, rtol, atol, raise_on_mismatch)
    if isinstance(fn, BreakableGraph):
        graph = fn
    else:
        graph = make_graph(fn, *make_inputs(), live=live_samples[0], **make_graph_kwargs)
    source = graph.source
    if source is None:
        raise ValueError("verify needs a graph made by bcg.make_graph (it must know its function and inputs)")
    static = source.static_args
    mismatches: list[Mismatch] = []
    for i, live in enumerate(live_samples):
        fresh = make_inputs()
        for dst, src in zip(pytree.tree_leaves(static), pytree.tree_leaves(tuple(fresh))):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        saved = _tensors(static)
        replay_taps, replay_out, plan = _tapped_replay(graph, live)
        for dst, src in zip([x for x in pytree.tree_leaves(static) if isinstance(x, torch.Tensor)], saved):
            dst.copy_(src)
        eager_taps, eager_out = _tapped_eager(source, live, plan)
        found = _compare(plan, i, live, replay_taps, replay_out, eager_taps, eager_out, rtol, atol)
        if found is None and _keyed(plan):
            found = _whole_replay(graph, live, i, static, saved, eager_out, rtol, atol)
        if found is not None:
            mismatches.append(found)
            log.warning("bcg.verify: %s", found)
    report = VerifyReport(len(live_samples), mismatches, graph)
    if mismatches and raise_on_mismatch:
        raise VerificationError(str(report), report)
    log.info("%s", report)
    return report


def _check_arguments(fn: Any, make_inputs: Any, live_samples: Any, rtol: Any, atol: Any,
                     raise_on_mismatch: Any) -> None:
    where = "bcg.verify"
    if not isinstance(fn, BreakableGraph):
        check_callable(where, "fn", fn, expects="a function or a graph made by bcg.make_graph",
                       hint="the signature is verify(fn, make_inputs, live_samples, ...)")
    if not callable(make_inputs):
        hint = "pass a function that returns fresh inputs, e.g. make_inputs=lambda: (torch.randn(8),)"
        check_callable(where, "make_inputs", make_inputs, expects="a function returning fresh inputs", hint=hint)
    if isinstance(live_samples, (str, bytes)) or not isinstance(live_samples, Sequence):
        fail(where, "live_samples", "a sequence (a list or tuple) of live values, one per sample", live_samples,
             "e.g. live_samples=[meta_a, meta_b], or [None] for a graph that reads no live metadata")
    if not live_samples:
        fail(where, "live_samples", "a non-empty sequence", live_samples,
             "verify needs at least one live sample ([None] for a graph that reads no live metadata)", ValueError)
    check_real(where, "rtol", rtol, minimum=0.0)
    check_real(where, "atol", atol, minimum=0.0)
    check_bool(where, "raise_on_mismatch", raise_on_mismatch)


def _tapped_replay(graph: BreakableGraph, live: Any) -> tuple[list[_Tap], list[torch.Tensor], tuple[Step, ...]]:
    """The replay's taps and outputs, and the plan that ran: that of the form a replay with
    ``live`` runs (:meth:`bcg.BreakableGraph.choose`), step by step."""
    if graph.mode != "graph":
        assert graph.source is not None
        taps, _ = _tapped_eager(graph.source, live, graph.plan)
        graph.replay(live=live)
        return taps, _tensors(graph.outputs), graph.plan
    graph.check_held()
    form = graph.forms[graph.choose(live)]
    plan = form.plan
    taps: list[_Tap] = []
    with live_scope(live):
        form.prepare(live)
        if form.variants is not None:
            form.variants.begin_replay(live, stitch=False)  # keys for the steps; a hit launches its variant
        for step in plan:
            if isinstance(step, BreakpointStep):
                tap = _Tap(step.name, _read_tensors(step.spec, step.args, step.kwargs))
                step.launch()
                bridges = step.bridges.tensors() if step.bridges is not None else []
                tap.outputs = _written_tensors(step.spec, bridges, step.args, step.kwargs)
                taps.append(tap)
            else:
                step.launch()
    if form.outputs is not None and form.outputs is not graph.outputs:
        form.copy_outputs_to(graph.outputs)
    return taps, _tensors(graph.outputs), plan


def _keyed(plan: tuple[Step, ...]) -> bool:
    return any(isinstance(s, BreakpointStep) and s.variants is not None for s in plan)


def _whole_replay(graph: BreakableGraph, live: Any, sample: int, static: Any, saved: list[torch.Tensor],
                  eager_out: list[torch.Tensor], rtol: float, atol: float) -> Mismatch | None:
    """Replay the whole graph again, as a user would, and compare its outputs: keyed breakpoints
    (now every key of this sample has a variant: one stitched launch where the graph stitches)."""
    for dst, src in zip([x for x in pytree.tree_leaves(static) if isinstance(x, torch.Tensor)], saved):
        dst.copy_(src)
    graph.replay(live)
    d = _diff(_tensors(graph.outputs), eager_out, rtol, atol)
    if d is None:
        return None
    return Mismatch(sample, live, "replay", None, None, None, *d)


def _tapped_eager(source: GraphSource, live: Any, plan: tuple[Step, ...]) -> tuple[list[_Tap], list[torch.Tensor]]:
    recorder = _EagerTapRecorder({id(s.spec) for s in plan if isinstance(s, BreakpointStep)})
    with recording(recorder, live):
        out = source()
    return recorder.taps, _tensors(out)


def _diff(a: list[torch.Tensor], b: list[torch.Tensor], rtol: float, atol: float) -> tuple[int, float] | None:
    for j, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape or not torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
            if x.shape != y.shape:
                return j, float("inf")
            d = (x.double() - y.double()).abs().nan_to_num(nan=float("inf"))
            return j, float(d.max()) if d.numel() else 0.0
    if len(a) != len(b):
        return min(len(a), len(b)), float("inf")
    return None


def _compare(
    plan: tuple[Step, ...],
    sample: int,
    live: Any,
    replay_taps: list[_Tap],
    replay_out: list[torch.Tensor],
    eager_taps: list[_Tap],
    eager_out: list[torch.Tensor],
    rtol: float,
    atol: float,
) -> Mismatch | None:
    names = [t.name for t in replay_taps]
    if names != [t.name for t in eager_taps]:
        return Mismatch(sample, live, "structure", None, None, f"capture {names} vs eager {[t.name for t in eager_taps]}", 0, 0.0)
    # segment index preceding each breakpoint, in plan order
    seg_before: list[int | None] = []
    last_seg: int | None = None
    for step in plan:
        if isinstance(step, SegmentStep):
            last_seg = step.index
        else:
            seg_before.append(last_seg)
            last_seg = None
    for k, (r, e) in enumerate(zip(replay_taps, eager_taps)):
        before = names[k - 1] if k else None
        d = _diff(r.inputs, e.inputs, rtol, atol)
        if d is not None:
            return Mismatch(sample, live, "segment", seg_before[k] if k < len(seg_before) else None, before, names[k], *d)
        d = _diff(r.outputs, e.outputs, rtol, atol)
        if d is not None:
            return Mismatch(sample, live, "breakpoint", None, before, names[k], *d)
    d = _diff(replay_out, eager_out, rtol, atol)
    if d is not None:
        segments = [s for s in plan if isinstance(s, SegmentStep)]
        last = segments[-1].index if segments else None
        return Mismatch(sample, live, "output", last, names[-1] if names else None, None, *d)
    return None
