"""The runner's padded-row sanitizer: rows ``>= T`` of the bucket read as zero, inside the graph.

The graph begins by computing a row mask from a static device scalar holding
``T`` and zeroing the padded rows of the static inputs; then, through the
``after_breakpoint`` hook of :class:`bcg.capture`, those of the tensors that
cross each breakpoint. Which crossing tensors, along which dims, is decided in
each bucket's eager warm-up (:meth:`PaddingSanitizer.record`): every bridge,
and every other crossing tensor the run allocated (never weights, caches,
static or by-reference inputs), along the dims that equal the bucket size and
grow with it (a shape seen at another size).

All of that zeroing is the :data:`PADDING` node group (``bcg.core.session.node_group``): a
call whose ``T`` equals its bucket has no padded row, and the runner switches
the group off for it (its segments replay executables without those nodes),
and on again for the next call that pads.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bcg.core import cudart
from bcg.core.breakpoint import NOT_INLINE, BreakpointSpec, crossing_tensors, tensor_leaves
from bcg.core.bridge import argument_keys, in_place_position
from bcg.core.pool import blocks
from bcg.core.session import node_group
from bcg.core.torch_internals import TorchDispatchMode, has_internal_overlap
from bcg.runner.inputs import StaticInputs
from bcg.staged.staging import StagedWarmup

log = logging.getLogger("bcg")

PADDING = "bcg.padding"
"""The label of the sanitizer's node group: a replay with no padded row (``T`` equal to the
bucket) skips it (:meth:`bcg.BreakableGraph.set_enabled`)."""

_MAX_SUBSET_DIMS = 4  # dims equal to the bucket size considered jointly when matching shapes

# -- shape matching: which dims grow with the bucket --------------------------------------------

Pattern = tuple[torch.dtype, tuple[int, ...]]


def _dim_subsets(dims: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Non-empty subsets of ``dims``, smallest first (all of them jointly only, if there are many)."""
    if len(dims) > _MAX_SUBSET_DIMS:
        yield tuple(dims)
        return
    for r in range(1, len(dims) + 1):
        yield from itertools.combinations(dims, r)


def _pattern(dtype: torch.dtype, shape: tuple[int, ...], dims: tuple[int, ...]) -> Pattern:
    return dtype, tuple(-1 if d in dims else s for d, s in enumerate(shape))


def scaling_dims(shape: tuple[int, ...], n: int, other: tuple[int, ...], m: int) -> tuple[int, ...] | None:
    """Dims of a tensor that are ``n`` at size ``n`` and ``m`` at size ``m``; ``None`` if the rest differ."""
    if len(shape) != len(other):
        return None
    dims = tuple(d for d in range(len(shape)) if shape[d] == n and other[d] == m)
    if any(shape[d] != other[d] for d in range(len(shape)) if d not in dims):
        return None
    return dims


# -- which storages a run allocated -------------------------------------------------------------


class _DispatchStorages(TorchDispatchMode):
    """Storages that ops allocate while it is active (CPU runs, where there is no allocator to ask).

    An op's output is fresh when its storage is none of its inputs' (views,
    in-place and ``out=`` ops return their inputs' storages). Code a dispatch
    mode does not see (compiled code, extensions) goes unseen: CUDA runs use
    :class:`_AllocatorStorages` instead.
    """

    # compiled graphs call breakpoints' ops through higher-order operators (auto_functionalized)
    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Let torch.compile'd regions compile (and so warm up) under this mode, as they will run.
        return True

    def is_fresh(self, t: torch.Tensor) -> bool:
        return _storage_ptr(t) in self.storages

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not getattr(func, "is_view", False):
            inputs = {_storage_ptr(x) for x in tensor_leaves((args, kwargs))}
            for x in tensor_leaves(out):
                ptr = _storage_ptr(x)
                if ptr and ptr not in inputs:
                    self.storages.add(ptr)
        return out


def _storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage; 0 for a tensor without one (sparse, some subclasses)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


class _AllocatorStorages:
    """Fresh storages judged by the CUDA caching allocator: those not in use when the run began.

    Covers every allocation the allocator serves (ATen, compiled code,
    extensions that allocate through torch) with no hook in the run. A block
    freed during the run and handed out again counts as not fresh (left
    unsanitized, never wrongly zeroed): only tensors that existed before the
    run and were dropped during it can do that.
    """

    def __init__(self, device: int) -> None:
        self._device = device
        self._before: set[int] = set()

    def __enter__(self) -> _AllocatorStorages:
        self._before = {address for address, _, in_use in blocks(self._device) if in_use}
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def is_fresh(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() not in self._before


# -- the recorder of eager runs ------------------------------------------------------------------


class CrossingRecorder(StagedWarmup):
    """The active recorder of the runner's eager runs (warm-ups, probes, ``mode="eager"`` calls).

    Breakpoints run as plain calls, staged ones inline (as a capture records
    them); then ``on_crossing(tensors, bridged)`` gets the tensors crossing it
    (as :class:`bcg.capture` passes them to ``after_breakpoint``: the ``k``-th
    call of an eager run lines up with the ``k``-th of a capture), and for each
    whether a capture gives it a bridge (a returned tensor that is not one of
    the arguments exactly; never for a staged breakpoint run inline).

    ``observe=True`` watches a plain eager run without changing it: staged
    breakpoints run their breakable form, ``bcg.live()`` may be read anywhere,
    and a crossing it cannot record stops the watching (``failure``), not the run.
    """

    segment_label = "GraphRunner's eager run"

    def __init__(self, on_crossing: Callable[[list[torch.Tensor], list[bool]], None] | None = None,
                 observe: bool = False) -> None:
        super().__init__()
        self._on_crossing = on_crossing
        self._observe = observe
        self.failure: Exception | None = None  # observe=True: why the watching stopped
        if observe:
            self.refuses_live_reads = False

    def on_breakpoint(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = self.run_breakpoint(spec.fn, args, kwargs)
        self._report(spec, result, args, kwargs, None)
        return result

    def on_staged(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = NOT_INLINE if self._observe else self.staged_breakpoints.record(self, spec, args, kwargs)
        if result is NOT_INLINE:
            return self.on_breakpoint(spec, args, kwargs)
        self._report(spec, result, args, kwargs, lambda t: False)
        return result

    def _report(self, spec: BreakpointSpec, result: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                bridged: Callable[[torch.Tensor], bool] | None) -> None:
        """Pass the crossing tensors to ``on_crossing``; ``bridged``: which results a capture gives a
        bridge (``None``: those that are not arguments changed in place)."""
        on_crossing = self._on_crossing
        if on_crossing is None:  # (none, or an observation that stopped)
            return
        try:
            if bridged is None:
                keys = argument_keys(args, kwargs)
                bridged = lambda t: in_place_position(t, keys) is None  # noqa: E731
            results = tensor_leaves(result)
            bridges = {id(t) for t in results if bridged(t)}
            crossing = crossing_tensors(results, spec, args, kwargs)
            on_crossing(crossing, [id(t) in bridges for t in crossing])
        except Exception as exc:
            if not self._observe:
                raise
            self._on_crossing, self.failure = None, exc
            log.debug("bcg.GraphRunner: stopped watching an eager run at breakpoint %s: %r", spec.name, exc)


# -- the sanitizer --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Zeroing:
    """How to sanitize one tensor crossing a breakpoint: its expected shape, dtype, dims to zero past T."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    dims: tuple[int, ...]


ZeroingSchedule = list[list[_Zeroing]]  # per breakpoint call, per crossing tensor


class PaddingSanitizer:
    """Zeroes the rows ``>= T`` of the padded inputs and of the tensors crossing breakpoints.

    Arguments:
        static: the static inputs (which of them are padded, along which dim).
        rows: the most rows any run has (the largest bucket, or the probe size).
        device: the runner's device.
        enabled: ``False`` records shapes only (``sanitize=False``): nothing is zeroed.
    """

    def __init__(self, static: StaticInputs, rows: int, device: torch.device, enabled: bool) -> None:
        self.enabled = enabled
        self._static = static
        self._device = device
        self._arange = torch.arange(rows, device=device)
        self._t_dev = torch.zeros((), dtype=torch.int32, device=device)  # int32: set with one memset
        # the last value written into _t_dev (stream order); the native call reads it (a call with
        # the same T does not call set_rows)
        self.rows_written: int | None = None
        self._pad_mask = torch.zeros(rows, dtype=torch.bool, device=device)
        self._mask_views: dict[tuple[int, int, int], torch.Tensor] = {}
        self._patterns: dict[int, set[Pattern]] = {}  # run size -> shapes of fresh crossing tensors
        self._schedules: dict[int, ZeroingSchedule] = {}  # run size -> how to zero each crossing tensor

    @property
    def sizes_seen(self) -> bool:
        return bool(self._patterns)

    def has_run(self, n: int) -> bool:
        return n in self._patterns

    def set_rows(self, T: int, stream: int | None = None) -> None:
        """Make ``T`` the real row count the next run or replay masks against.

        With ``stream`` (a raw CUDA stream of the device): one ``cuMemsetD32Async``
        there, less host time than ``fill_``; and none when ``T`` is
        the value last written so (the runner orders each replay after the
        previous one, across streams too, so every reader is queued after it).
        """
        if stream is None:
            self._t_dev.fill_(T)
            self.rows_written = None
        elif T != self.rows_written:
            cudart.memset_d32(self._t_dev.data_ptr(), T, 1, stream)
            self.rows_written = T

    def _mask_view(self, n: int, dim: int, ndim: int) -> torch.Tensor:
        key = (n, dim, ndim)
        view = self._mask_views.get(key)
        if view is None:
            shape = [1] * ndim
            shape[dim] = n
            view = self._mask_views[key] = self._pad_mask[:n].view(shape)
        return view

    def zero_inputs(self, n: int, views: list[Any]) -> None:
        """Compute the row mask and zero the padded inputs' rows ``>= T`` (captured as the graph's start,
        in the :data:`PADDING` node group)."""
        if not self.enabled:
            return
        with node_group(PADDING):
            torch.ge(self._arange[:n], self._t_dev, out=self._pad_mask[:n])
            for view, dim in self._static.padded_views(views):
                view.masked_fill_(self._mask_view(n, dim, view.dim()), 0)

    def _known_patterns(self, n: int) -> frozenset[Pattern]:
        """Shapes (with bucket-sized dims as -1) of crossing tensors seen in runs of other sizes."""
        known: set[Pattern] = set()
        for size, patterns in self._patterns.items():
            if size != n:
                known |= patterns
        return frozenset(known)

    def _classify(
        self, t: torch.Tensor, n: int, known: frozenset[Pattern], record: set[Pattern], eligible: bool
    ) -> tuple[int, ...]:
        """The dims along which a tensor crossing a breakpoint at size ``n`` is zeroed past ``T``.

        Only ``eligible`` tensors on the runner's device qualify; their shapes
        are recorded in ``record``. The dims are the smallest set of dims equal
        to ``n`` whose pattern (the shape with those dims as -1, and the dtype)
        was seen at another size: dims that grow with the bucket. So a
        ``[heads, T, dim]`` tensor at a bucket equal to ``heads`` is zeroed
        along T only, and fixed-shape tensors never.
        """
        if not eligible or t.device != self._device or t.dim() == 0:
            return ()
        shape = tuple(t.shape)
        eq = [d for d, size in enumerate(shape) if size == n]
        if not eq:
            return ()
        subsets = list(_dim_subsets(eq))
        for dims in subsets:
            record.add(_pattern(t.dtype, shape, dims))
        for dims in subsets:  # the fewest dims that explain the shape
            if _pattern(t.dtype, shape, dims) in known:
                break
        else:
            return ()
        if has_internal_overlap(t):
            return ()
        return dims

    @contextlib.contextmanager
    def recording(self, n: int, static_ptrs: set[int], bridges_are_copies: bool,
                  observe: bool = False) -> Iterator[CrossingRecorder]:
        """The recorder of a warm-up (or probe) run at size ``n``, inside the block
        (``observe``: of a plain eager run, see :class:`CrossingRecorder`).

        A crossing tensor is eligible for zeroing when a capture gives it a
        bridge (``bridges_are_copies``: graph mode, a graph-owned copy, always
        safe to zero), or when it was allocated during this run (judged by the
        CUDA caching allocator; on a CPU, by watching dispatch) and is no
        parameter, static or by-reference input. The schedule is kept for
        :meth:`hook` at size ``n`` when the block ends without an error.
        """
        record: set[Pattern] = set()
        known = self._known_patterns(n)
        schedule: ZeroingSchedule = []
        fresh: _DispatchStorages | _AllocatorStorages = (
            _AllocatorStorages(self._device.index or 0) if self._device.type == "cuda" else _DispatchStorages()
        )

        def eligible(t: torch.Tensor, bridged: bool) -> bool:
            if bridged and bridges_are_copies:
                return True
            return (
                fresh.is_fresh(t)
                and t.untyped_storage().data_ptr() not in static_ptrs
                and not isinstance(t, torch.nn.Parameter)
            )

        def on_crossing(tensors: list[torch.Tensor], bridged: list[bool]) -> None:
            schedule.append([
                _Zeroing(tuple(t.shape), t.dtype, self._classify(t, n, known, record, eligible(t, b)))
                for t, b in zip(tensors, bridged)
            ])

        with fresh:
            recorder = CrossingRecorder(on_crossing, observe)
            yield recorder
        if recorder.failure is None:
            self._patterns[n] = record
            self._schedules[n] = schedule

    def hook(self, n: int) -> Callable[[list[torch.Tensor]], None] | None:
        """An ``after_breakpoint`` hook applying the schedule of the warm-up at size ``n``.

        The ``k``-th call zeroes, for each crossing tensor that has the shape
        and dtype the warm-up saw at that position, its rows ``>= T`` along the
        first scheduled dim (``masked_fill_`` against the row mask computed at the
        start of the graph) and, along the others, only NaN past ``T`` (a
        ``[T, T]`` additive mask keeps its ``-inf``), in the :data:`PADDING` node
        group. One hook per capture or eager run: it counts calls.
        """
        schedule = self._schedules.get(n)
        if not self.enabled or not schedule or not any(z.dims for call in schedule for z in call):
            return None
        calls = iter(schedule)

        def hook(tensors: list[torch.Tensor]) -> None:
            zeroings = next(calls, ())
            if len(zeroings) != len(tensors):
                log.debug("bcg.GraphRunner: a breakpoint crossed %d tensor(s) at size %d, %d in the "
                          "warm-up; the extra ones are not sanitized", len(tensors), n, len(zeroings))
            with node_group(PADDING):
                for z, t in zip(zeroings, tensors):
                    if z.dims and t.dtype == z.dtype and t.shape == z.shape:
                        rows, *others = z.dims
                        t.masked_fill_(self._mask_view(n, rows, t.dim()), 0)
                        if others and t.is_floating_point():
                            # along the other dims only NaN goes: real rows keep their values past T (a -inf
                            # key mask), and NaN garbage there cannot spread into their sums
                            pad = functools.reduce(torch.logical_or, (self._mask_view(n, d, t.dim()) for d in others))
                            t.masked_fill_(pad & t.isnan(), 0)

        return hook
