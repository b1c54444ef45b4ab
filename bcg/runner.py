"""``bcg.GraphRunner``: one breakable graph per bucket size, padded inputs, one shared memory pool.

::

    runner = bcg.GraphRunner(forward, buckets=bcg.default_buckets(4096),
                             example_inputs=(x, positions), pad_dim=0,
                             capture_live=lambda bucket: meta_for(bucket))
    runner.capture()                     # largest bucket first, one pool, one capture stream
    y = runner(x, positions, live=meta)  # smallest bucket >= T, padded; returns y[:T]

How a call runs (``T`` = the inputs' size along their pad dim):

1. Guards, before anything is written: number of inputs, and for each input
   its type, dtype, device and every dimension but the pad dim (errors name the
   input position and the expected value).
2. Bucket: the smallest bucket ``>= T``. The call runs ``forward`` eagerly on
   the real inputs instead (with ``live`` set through :func:`bcg.live_scope`),
   counted in ``stats()["fallbacks"]`` by reason, when ``T`` is above the
   largest bucket (``"too_large"``), when ``(bucket - T) / bucket`` is above
   ``max_padding_ratio`` (``"padding_waste"``), or when that bucket's capture
   failed (``"capture_failed"``; see below).
3. Inputs are copied into the bucket's static buffers (``T`` rows); the rows
   past ``T`` read as zero: the graph begins by computing a row mask from a
   static device scalar holding ``T`` (set by one ``fill_`` per call) and
   zeroing the padded rows of the static inputs, and -- through the
   ``after_breakpoint`` hook of :class:`bcg.capture` -- of the tensors that
   cross each breakpoint, so garbage a breakpoint leaves in padded rows (say,
   attention that only writes the real rows of ``torch.empty`` memory) never
   reaches later layers. No host launch is spent on it. Which crossing tensors,
   along which dims, is decided in each bucket's eager warm-up: every bridge
   (a graph-owned copy of a returned tensor, always safe to zero), and every
   other crossing tensor the caching allocator handed out during the run --
   whoever allocated it: ATen, compiled code, an extension -- never weights,
   caches, static or by-reference inputs, whatever their shapes; along the
   dims that equal the bucket size and grow with it (a shape seen at another
   size). A breakpoint declaring no ``mutates`` has all its tensor arguments
   sanitized after it; declare ``mutates=(...)`` (``()`` for read-only
   arguments) to spare those kernels.
4. Replay with ``live``; every output tensor is returned narrowed to ``T``
   along the dims that grow with the bucket (found by comparing the output
   shapes of two bucket sizes at capture; other outputs are returned whole).

Lifetimes and threading:

* Outputs are views of the graph's static output memory in the shared pool
  (no copy): valid until the next call of this runner, or of any runner that
  shares its pool, or ``reset()``. The ``T`` rows are the real result.
* Calls are serialized by a lock shared by all runners that share a pool,
  and a call issued on another CUDA stream than the previous one first waits
  for it, since graphs sharing a pool must never replay concurrently.
* Threads: with ``copy_outputs=None`` (default) outputs are views while every
  call comes from one thread; once runners sharing the pool have been called
  from a second thread, calls return copies, made under the lock, unless they
  are made inside ``with runner.locked():``, which holds the lock (no other
  thread's call can overwrite the views) until the block ends. ``True``:
  always copies; ``False``: always views (the caller synchronizes threads).
* Inference only: capture, replays and fallbacks run under ``torch.no_grad()``.

A bucket whose capture raised is logged once (``logging.getLogger("bcg")``,
warning level, with the cause) and skipped: calls that would use it run
eagerly on the real inputs, counted as ``"capture_failed"``. They are not
promoted to the next larger bucket, because a capture failure is usually
specific to a shape and a larger bucket adds padding; leave the bucket out of
the ladder to promote such calls instead. The other buckets work as usual.

``mode="eager"`` (and ``mode="graph"`` when CUDA is unavailable or the inputs
are not on a GPU, with one warning) runs ``forward`` eagerly on the padded
static buffers at every call, with the same bucket choice, padding, row
sanitizing and slicing: the whole runner works, and is tested, on a CPU.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from bcg.breakpoint_spec import BreakpointSpec
from bcg.buckets import default_buckets, normalize_buckets, pick_bucket
from bcg.bridge import argument_keys, in_place_position, same_value
from bcg.capture import capture, capture_lock, capture_stream
from bcg.errors import BcgError, ReplayError
from bcg.graph import BreakableGraph
from bcg.live import _UNSET, live_scope
from bcg.memory import PoolAnchor, PoolHandle, blocks, graph_pool_handle, pool_bytes
from bcg.recorder import ACTIVE, Recorder, crossing_tensors, tensor_leaves
from bcg.replay import stream_readers

log = logging.getLogger("bcg")

__all__ = ["FALLBACK_REASONS", "GraphRunner"]

#: The reasons a call runs ``forward`` eagerly instead of replaying a graph.
FALLBACK_REASONS = ("too_large", "padding_waste", "capture_failed")

_MODES = ("graph", "eager")
_PADDED, _BY_REFERENCE, _VALUE = "padded", "by_reference", "value"
_MAX_SUBSET_DIMS = 4  # dims equal to the bucket size considered jointly when matching shapes


# -- pools shared between runners --------------------------------------------------------------


class _PoolGuard:
    """What every runner using one pool shares: the call lock, the stream of the last replay,
    and who may read returned views (see "Threads" in the module documentation)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.last_stream: int | None = None  # raw cudaStream_t of the last replay
        self.first_caller: int | None = None  # thread ident of the first call
        self.shared = False  # called from more than one thread
        self.reader: int | None = None  # the thread inside ``locked()``

    def views_safe(self) -> bool:
        """Whether this call (under the lock) may return views: one calling thread so far, or ``locked()``."""
        me = threading.get_ident()
        if self.first_caller is None:
            self.first_caller = me
        elif me != self.first_caller and not self.shared:
            self.shared = True
            log.info("bcg.GraphRunner: called from a second thread: outputs are copies from now on, "
                     "except inside `with runner.locked():` (or pass copy_outputs=False/True)")
        return not self.shared or self.reader == me


_GUARDS: dict[tuple[int, ...], _PoolGuard] = {}
_GUARDS_LOCK = threading.Lock()


_current_device, _current_raw_stream = stream_readers()


def _guard_for(pool: PoolHandle, default: _PoolGuard) -> _PoolGuard:
    with _GUARDS_LOCK:
        return _GUARDS.setdefault(tuple(pool), default)


# -- inputs ------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Input:
    """What one position of ``example_inputs`` requires of a call."""

    index: int
    kind: str  # _PADDED, _BY_REFERENCE or _VALUE
    example: Any
    pad_dim: int = -1
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    shape: tuple[int, ...] = ()  # the example's shape (its pad dim is free)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def shape_text(self) -> str:
        dims = ["T" if d == self.pad_dim else str(s) for d, s in enumerate(self.shape)]
        return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"

    def describe(self) -> str:
        if self.kind == _VALUE:
            return f"the value {self.example!r} (non-tensor inputs are frozen at capture)"
        if self.kind == _BY_REFERENCE:
            return (
                f"the same {self.dtype} tensor of shape {tuple(self.shape)} on {self.device} as in "
                "example_inputs (it is not padded, pad_dim None: the graphs read it in place)"
            )
        return f"a {self.dtype} tensor on {self.device} of shape {self.shape_text()}, T along dim {self.pad_dim}"


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


# -- shape matching: which dims grow with the bucket --------------------------------------------

_Pattern = tuple[torch.dtype, tuple[int, ...]]


def _dim_subsets(dims: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Non-empty subsets of ``dims``, smallest first (all of them jointly only, if there are many)."""
    if len(dims) > _MAX_SUBSET_DIMS:
        yield tuple(dims)
        return
    for r in range(1, len(dims) + 1):
        yield from itertools.combinations(dims, r)


def _pattern(dtype: torch.dtype, shape: tuple[int, ...], dims: tuple[int, ...]) -> _Pattern:
    return dtype, tuple(-1 if d in dims else s for d, s in enumerate(shape))


def _scaling_dims(shape: tuple[int, ...], n: int, other: tuple[int, ...], m: int) -> tuple[int, ...] | None:
    """Dims of an output that are ``n`` at size ``n`` and ``m`` at size ``m``; ``None`` if the rest differ."""
    if len(shape) != len(other):
        return None
    dims = tuple(d for d in range(len(shape)) if shape[d] == n and other[d] == m)
    if any(shape[d] != other[d] for d in range(len(shape)) if d not in dims):
        return None
    return dims


class _Recorder(Recorder):
    """The active recorder of the runner's eager runs (warm-ups, probes, ``mode="eager"`` calls).

    Breakpoints run as plain calls; then ``on_crossing(k, tensors, bridged)``
    gets the index of the breakpoint call, the tensors crossing it (as
    :class:`bcg.capture` passes them to ``after_breakpoint``: the ``k``-th list
    of an eager run lines up with the ``k``-th of a capture), and for each
    whether a capture gives it a bridge (a returned tensor that is not one of
    the arguments exactly).
    """

    segment_label = "GraphRunner's eager run"

    def __init__(self, on_crossing: Callable[[int, list[torch.Tensor], list[bool]], None]) -> None:
        super().__init__()
        self._on_crossing = on_crossing
        self._calls = 0

    def on_breakpoint(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = self.run_breakpoint(spec.fn, args, kwargs)
        results = tensor_leaves(result)
        keys = argument_keys(args, kwargs)
        bridges = {id(t) for t in results if in_place_position(t, keys) is None}
        crossing = crossing_tensors(results, spec, args, kwargs)
        k, self._calls = self._calls, self._calls + 1
        self._on_crossing(k, crossing, [id(t) in bridges for t in crossing])
        return result


class _DispatchStorages(TorchDispatchMode):
    """Storages that ops allocate while it is active (CPU runs, where there is no allocator to ask).

    An op's output is fresh when its storage is none of its inputs' (views,
    in-place and ``out=`` ops return their inputs' storages). Weights, caches
    and static buffers that existed before the run are never fresh, so they
    are never sanitized, whatever their shapes. Code a dispatch mode does not
    see (compiled code, extensions) goes unseen: CUDA runs use
    :class:`_AllocatorStorages` instead.
    """

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Let torch.compile'd regions compile (and so warm up) under this mode, as they will run.
        return True

    def is_fresh(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.storages

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not getattr(func, "is_view", False):
            inputs = {x.untyped_storage().data_ptr() for x in tensor_leaves((args, kwargs))}
            for x in tensor_leaves(out):
                ptr = x.untyped_storage().data_ptr()
                if ptr and ptr not in inputs:
                    self.storages.add(ptr)
        return out


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


@dataclass(frozen=True)
class _Decision:
    """How to sanitize one tensor crossing a breakpoint: its expected shape, dtype, dims to zero past T."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    dims: tuple[int, ...]


_Plan = list[list[_Decision]]  # per breakpoint call, per crossing tensor


# -- buckets -----------------------------------------------------------------------------------


@dataclass(eq=False)
class _Bucket:
    size: int
    views: list[Any] = field(default_factory=list)
    graph: BreakableGraph | None = None
    leaves: list[Any] | None = None  # graph mode: the static outputs; eager mode: the last outputs
    spec: Any = None
    single: bool = False
    slice_dims: list[tuple[int, ...]] = field(default_factory=list)
    failure: str | None = None
    captured: bool = False
    capture_s: float = 0.0
    replays: int = 0


class GraphRunner:
    """Run ``forward`` through one captured :class:`bcg.BreakableGraph` per bucket size.

    ``forward(*inputs)`` is called with ``example_inputs``-like inputs; tensor
    inputs are padded along ``pad_dim`` (an int for all of them, or one entry
    per input: ``None`` for a tensor that is not bucketed, such as a KV cache,
    which the graphs read in place: calls must pass that same tensor).
    Non-tensor inputs are frozen: calls must pass values equal to the example's.

    ``buckets``: sizes to capture (default :func:`bcg.default_buckets`).
    ``capture_live``: what :func:`bcg.live` returns during each bucket's
    warm-up and capture; a callable is called with the size. Give a callable
    whenever live metadata depends on the size (request lengths do): the
    forward also runs once at a probe size that is not a bucket, to learn
    which dims grow with the size, and metadata for another size would make
    attention read out of bounds.
    ``max_padding_ratio``: run eagerly when ``(bucket - T) / bucket`` exceeds
    it (default ``None``: never). ``copy_outputs``: ``True`` returns copies,
    ``False`` views valid until the next call, ``None`` (default) views while
    one thread calls and copies once several do (see :meth:`locked`). ``sanitize``: zero padded rows of inputs
    and of tensors crossing breakpoints inside the graph (default ``True``;
    ``False`` zeroes only the inputs' tails, with host launches). ``pool`` /
    ``stream``: share a pool (and capture stream) with another runner
    (``other.pool()``). ``mode``: ``"graph"`` or ``"eager"``. ``progress``:
    show a tqdm bar while capturing.

    See the module documentation for how a call runs, fallbacks, output
    lifetimes and thread safety.
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        buckets: Sequence[int] | None = None,
        *,
        example_inputs: Sequence[Any],
        pad_dim: int | Sequence[int | None] = 0,
        mode: str = "graph",
        capture_live: Any = _UNSET,
        max_padding_ratio: float | None = None,
        copy_outputs: bool | None = None,
        sanitize: bool = True,
        pool: PoolHandle | None = None,
        stream: torch.cuda.Stream | None = None,
        capture_error_mode: str = "global",
        progress: bool = True,
        name: str | None = None,
    ) -> None:
        if not callable(forward):
            raise TypeError(f"forward must be callable, got {type(forward).__name__}")
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, not {mode!r}")
        if max_padding_ratio is not None and not 0.0 <= max_padding_ratio < 1.0:
            raise ValueError(f"max_padding_ratio must be in [0, 1) or None, got {max_padding_ratio}")
        if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, (tuple, list)):
            raise TypeError("example_inputs must be a tuple (or list) of forward's positional inputs")
        self._forward = forward
        self.name = name or getattr(forward, "__qualname__", type(forward).__name__)
        self._buckets_list = normalize_buckets(default_buckets() if buckets is None else buckets)
        self._inputs = self._describe_inputs(tuple(example_inputs), pad_dim)
        self._padded = [s for s in self._inputs if s.kind == _PADDED]
        if not self._padded:
            raise ValueError(
                "example_inputs needs at least one padded tensor input (the one whose size along pad_dim is T)"
            )
        devices = {s.device for s in self._padded}
        if len(devices) > 1:
            raise ValueError(f"all padded inputs must be on one device, got {sorted(map(str, devices))}")
        self._device = devices.pop()
        if mode == "graph" and (self._device.type != "cuda" or not torch.cuda.is_available()):
            why = "CUDA is not available" if not torch.cuda.is_available() else f"the inputs are on {self._device}"
            warnings.warn(
                f"bcg.GraphRunner: {why}, falling back to mode='eager' (same buckets, padding and "
                "slicing; forward runs eagerly at every call, no CUDA graphs)",
                RuntimeWarning,
                stacklevel=2,
            )
            mode = "eager"
        self._mode = mode
        self._capture_live = capture_live
        self._max_padding_ratio = max_padding_ratio
        self._copy_outputs = copy_outputs if copy_outputs is None else bool(copy_outputs)
        self._sanitize = bool(sanitize)
        self._capture_error_mode = capture_error_mode
        self._progress = progress
        self._user_pool = pool
        self._pool: PoolHandle | None = pool
        self._stream = stream
        self._pool_anchor: PoolAnchor | None = None
        guard = _PoolGuard()
        self._guard = _guard_for(pool, guard) if pool is not None else guard
        self._largest_alone: int | None = None
        self._clear_state()

    # -- set-up ------------------------------------------------------------------------------
    @staticmethod
    def _describe_inputs(examples: tuple[Any, ...], pad_dim: int | Sequence[int | None]) -> list[_Input]:
        if isinstance(pad_dim, int) and not isinstance(pad_dim, bool):
            dims: list[int | None] = [pad_dim if isinstance(x, torch.Tensor) else None for x in examples]
        else:
            dims = list(pad_dim)  # type: ignore[arg-type]
            if len(dims) != len(examples):
                raise ValueError(
                    f"pad_dim has {len(dims)} entries but example_inputs has {len(examples)}: give one "
                    "entry per input (None for inputs that are not padded)"
                )
        specs = []
        for i, (x, d) in enumerate(zip(examples, dims)):
            if not isinstance(x, torch.Tensor):
                if d is not None:
                    raise ValueError(f"input {i} is a {type(x).__name__}, not a tensor: its pad_dim must be None")
                specs.append(_Input(i, _VALUE, x))
                continue
            shape = tuple(x.shape)
            if d is None:
                specs.append(_Input(i, _BY_REFERENCE, x, -1, x.dtype, x.device, shape))
                continue
            if x.dim() == 0 or not -x.dim() <= d < x.dim():
                raise ValueError(
                    f"input {i} has shape {shape}, which has no dim {d} to pad; give pad_dim per input "
                    "(None for inputs that are not padded)"
                )
            specs.append(_Input(i, _PADDED, x, d % x.dim(), x.dtype, x.device, shape))
        return specs

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.device(self._device) if self._mode == "graph" else contextlib.nullcontext()

    def _capturing(self) -> contextlib.AbstractContextManager[Any]:
        """Graph mode: the process's capture lock, held across warm-ups and captures, which share
        the capture stream (another thread's capture must not record the warm-ups)."""
        return capture_lock() if self._mode == "graph" else contextlib.nullcontext()

    def _clear_state(self) -> None:
        self._buckets = {b: _Bucket(b) for b in self._buckets_list}
        self._captured = False
        self._buffers: dict[int, torch.Tensor] = {}  # input index -> shared buffer (max rows)
        self._own_buffers: dict[tuple[int, int], torch.Tensor] = {}  # (input, size) -> buffer
        self._views_cache: dict[int, list[Any]] = {}
        self._static_ptrs: set[int] = set()
        self._mask_views: dict[tuple[int, int, int], torch.Tensor] = {}
        self._patterns: dict[int, set[_Pattern]] = {}  # run size -> shapes of fresh crossing tensors
        self._plans: dict[int, _Plan] = {}  # run size -> how to sanitize each crossing tensor
        self._out_shapes: dict[int, tuple[Any, list[tuple[int, ...] | None]]] = {}
        self._capture_total_s = 0.0
        self._calls = 0
        self._graph_calls = 0
        self._real_rows = 0
        self._padded_rows = 0
        self._fallbacks = dict.fromkeys(FALLBACK_REASONS, 0)
        self._probe_size = self._choose_probe_size()
        self._rows = max(self._buckets_list[-1], self._probe_size)
        self._arange: torch.Tensor | None = None
        self._t_dev: torch.Tensor | None = None
        self._pad_mask: torch.Tensor | None = None

    def _choose_probe_size(self) -> int:
        """A second size to run once, so the first bucket captured knows which dims grow with the size."""
        biggest = self._buckets_list[-1]
        for b in self._buckets_list:
            if 1 < b < biggest:
                return b
        return biggest // 2 if biggest > 2 else biggest + 1

    def _setup(self) -> None:
        if self._arange is not None:
            return
        dev = self._device
        self._arange = torch.arange(self._rows, device=dev)
        self._t_dev = torch.zeros((), dtype=torch.long, device=dev)
        self._pad_mask = torch.zeros(self._rows, dtype=torch.bool, device=dev)
        for s in self._inputs:
            if s.kind == _BY_REFERENCE:  # never sanitized: the graphs read it in place
                self._static_ptrs.add(s.example.untyped_storage().data_ptr())
        for s in self._padded:
            if all(n == 1 for n in s.shape[: s.pad_dim]):  # a prefix along pad_dim stays contiguous
                shape = list(s.shape)
                shape[s.pad_dim] = self._rows
                buf = torch.zeros(shape, dtype=s.dtype, device=dev)
                self._buffers[s.index] = buf
                self._static_ptrs.add(buf.untyped_storage().data_ptr())
        if self._mode == "graph":
            if self._pool is None:
                self._pool = graph_pool_handle()
                self._guard = _guard_for(self._pool, self._guard)
            if self._stream is None:
                self._stream = capture_stream(self._device.index or 0)
            if self._pool_anchor is None:  # the pool outlives any one bucket's graph, failed ones too
                self._pool_anchor = PoolAnchor(self._device.index or 0, self._pool, self._stream)

    def _views(self, n: int) -> list[Any]:
        """The inputs ``forward`` is run on at size ``n``: static buffers of ``n`` rows, and the rest."""
        views = self._views_cache.get(n)
        if views is not None:
            return views
        views = []
        for s in self._inputs:
            if s.kind != _PADDED:
                views.append(s.example)
                continue
            buf = self._buffers.get(s.index)
            if buf is None:
                shape = list(s.shape)
                shape[s.pad_dim] = n
                buf = torch.zeros(shape, dtype=s.dtype, device=self._device)
                self._own_buffers[(s.index, n)] = buf
                self._static_ptrs.add(buf.untyped_storage().data_ptr())
            views.append(buf.narrow(s.pad_dim, 0, n))
        self._views_cache[n] = views
        return views

    def _load_example(self, n: int, views: list[Any]) -> None:
        """Fill the size-``n`` static inputs with the example's rows (zeros past them); ``T = n``."""
        for s in self._padded:
            view = views[s.index]
            view.zero_()
            rows = min(n, s.shape[s.pad_dim])
            view.narrow(s.pad_dim, 0, rows).copy_(s.example.narrow(s.pad_dim, 0, rows))
        assert self._t_dev is not None
        self._t_dev.fill_(n)

    def _live_for(self, n: int) -> Any:
        live = self._capture_live
        if live is _UNSET:
            return _UNSET
        return live(n) if callable(live) else live

    # -- the padded forward and its sanitizing ---------------------------------------------------
    def _mask_view(self, n: int, dim: int, ndim: int) -> torch.Tensor:
        key = (n, dim, ndim)
        view = self._mask_views.get(key)
        if view is None:
            assert self._pad_mask is not None
            shape = [1] * ndim
            shape[dim] = n
            view = self._mask_views[key] = self._pad_mask[:n].view(shape)
        return view

    def _padded_forward(self, n: int, views: list[Any]) -> Any:
        """``forward`` on the size-``n`` static inputs; first (if sanitizing) zero rows ``>= T``."""
        if self._sanitize:
            assert self._arange is not None and self._pad_mask is not None
            torch.ge(self._arange[:n], self._t_dev, out=self._pad_mask[:n])
            for s in self._padded:
                views[s.index].masked_fill_(self._mask_view(n, s.pad_dim, s.ndim), 0)
        return self._forward(*views)

    def _known_patterns(self, n: int) -> frozenset[_Pattern]:
        """Shapes (with bucket-sized dims as -1) of crossing tensors seen in runs of other sizes."""
        known: set[_Pattern] = set()
        for size, patterns in self._patterns.items():
            if size != n:
                known |= patterns
        return frozenset(known)

    def _classify(
        self, t: torch.Tensor, n: int, known: frozenset[_Pattern], record: set[_Pattern], eligible: bool
    ) -> tuple[int, ...]:
        """The dims along which a tensor crossing a breakpoint at size ``n`` is zeroed past ``T``.

        Only ``eligible`` tensors qualify (bridges of a capture, or tensors
        allocated during the run that are not parameters, static inputs or
        by-reference inputs: see :meth:`_run_recorded`), on the runner's
        device; their shapes are recorded in ``record``. The dims are the
        smallest set of dims equal to ``n`` whose pattern (the shape with those
        dims as -1, and the dtype) was seen at another size: dims that grow
        with the bucket. So a ``[heads, T, dim]`` tensor at a bucket equal to
        ``heads`` is zeroed along T only, and fixed-shape tensors never.
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
        if torch._debug_has_internal_overlap(t) == 1:
            return ()
        return dims

    def _plan_hook(self, n: int, plan: _Plan | None) -> Callable[[list[torch.Tensor]], None] | None:
        """An ``after_breakpoint`` hook applying ``plan`` (from the warm-up at size ``n``).

        The ``k``-th call zeroes, for each crossing tensor that has the shape
        and dtype the warm-up saw at that position, the rows ``>= T`` along the
        planned dims (``masked_fill_`` against the row mask computed at the
        start of the graph). One hook per capture or eager run: it counts calls.
        """
        if not self._sanitize or not plan or not any(d.dims for call in plan for d in call):
            return None
        calls = iter(plan)

        def hook(tensors: list[torch.Tensor]) -> None:
            decisions = next(calls, ())
            if len(decisions) != len(tensors):
                log.debug("bcg.GraphRunner: a breakpoint crossed %d tensor(s) at size %d, %d in the "
                          "warm-up; the extra ones are not sanitized", len(tensors), n, len(decisions))
            for d, t in zip(decisions, tensors):
                if d.dims and t.dtype == d.dtype and t.shape == d.shape:
                    for dim in d.dims:
                        t.masked_fill_(self._mask_view(n, dim, t.dim()), 0)

        return hook

    def _run_eager(self, n: int, views: list[Any], live: Any, recorder: _Recorder) -> Any:
        """Run the padded forward eagerly at size ``n`` with ``recorder`` handling breakpoints."""
        token = ACTIVE.set(recorder)
        try:
            with torch.no_grad(), live_scope(live) if live is not _UNSET else contextlib.nullcontext():
                return self._padded_forward(n, views)
        finally:
            ACTIVE.reset(token)

    def _run_recorded(self, n: int) -> Any:
        """A warm-up (or probe) run at size ``n`` on example data: records the sanitizing plan and shapes.

        A crossing tensor is eligible for sanitizing when a capture gives it a
        bridge (graph mode: a graph-owned copy, always safe to zero), or when
        it was allocated during this run (judged by the CUDA caching
        allocator; on a CPU, by watching dispatch) and is no parameter, static
        or by-reference input.
        """
        views = self._views(n)
        self._load_example(n, views)
        record: set[_Pattern] = set()
        known = self._known_patterns(n)
        plan: _Plan = []
        fresh: _DispatchStorages | _AllocatorStorages = (
            _AllocatorStorages(self._device.index or 0) if self._device.type == "cuda" else _DispatchStorages()
        )
        bridges_are_copies = self._mode == "graph"

        def eligible(t: torch.Tensor, bridged: bool) -> bool:
            if bridged and bridges_are_copies:
                return True
            return (
                fresh.is_fresh(t)
                and t.untyped_storage().data_ptr() not in self._static_ptrs
                and not isinstance(t, torch.nn.Parameter)
            )

        def on_crossing(k: int, tensors: list[torch.Tensor], bridged: list[bool]) -> None:
            plan.append([
                _Decision(tuple(t.shape), t.dtype, self._classify(t, n, known, record, eligible(t, b)))
                for t, b in zip(tensors, bridged)
            ])

        live = self._live_for(n)
        with fresh:
            if self._mode == "graph":
                assert self._stream is not None
                current = torch.cuda.current_stream(self._device)
                self._stream.wait_stream(current)
                with torch.cuda.stream(self._stream):
                    out = self._run_eager(n, views, live, _Recorder(on_crossing))
                current.wait_stream(self._stream)
            else:
                out = self._run_eager(n, views, live, _Recorder(on_crossing))
        self._patterns[n] = record
        self._plans[n] = plan
        leaves, spec = pytree.tree_flatten(out)
        self._out_shapes[n] = (spec, [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in leaves])
        return out

    # -- capture ------------------------------------------------------------------------------
    def capture(self) -> GraphRunner:
        """Warm up and capture every bucket, largest first, into one pool on one capture stream.

        Shows a tqdm progress bar (``progress=False`` hides it), records
        per-bucket seconds (``stats()["capture_s"]``), logs the total and the
        pool size. A bucket whose warm-up or capture raises is logged and
        skipped (see the module documentation). In eager mode each bucket is
        run once instead. Returns the runner.
        """
        with self._guard.lock, self._capturing(), self._on_device():
            if self._captured:
                raise BcgError("this GraphRunner is already captured: call reset() first to capture again")
            self._setup()
            t_start = time.perf_counter()
            try:
                self._run_recorded(self._probe_size)
            except Exception as exc:  # the buckets' own warm-ups report failures
                log.debug("bcg.GraphRunner: the probe run at size %d raised: %r", self._probe_size, exc)
            from tqdm import tqdm

            order = sorted(self._buckets_list, reverse=True)
            bar = tqdm(order, desc="bcg capture", unit="bucket", disable=not self._progress)
            for n in bar:
                bar.set_postfix_str(f"bucket {n}", refresh=False)
                bucket = self._buckets[n]
                t0 = time.perf_counter()
                try:
                    self._capture_bucket(bucket)
                except Exception as exc:
                    bucket.failure = f"{type(exc).__name__}: {exc}"
                    bucket.graph = None
                    log.warning(
                        "bcg.GraphRunner(%s): capturing bucket %d failed, calls that would use it run "
                        "eagerly (fallback 'capture_failed'): %s",
                        self.name, n, bucket.failure, exc_info=exc,
                    )
                bucket.capture_s = time.perf_counter() - t0
            bar.close()
            for n in order:
                self._finish_bucket(self._buckets[n])
            self._capture_total_s = time.perf_counter() - t_start
            self._captured = True
            ok = [b for b in self._buckets_list if self._buckets[b].captured]
            log.info(
                "bcg.GraphRunner(%s): %s %d of %d bucket(s) (%s) in %.2f s; pool %.1f MiB",
                self.name, "captured" if self._mode == "graph" else "warmed up (eager mode)",
                len(ok), len(order), ", ".join(map(str, ok)) or "none", self._capture_total_s,
                self._pool_bytes() / 2**20,
            )
            return self

    def _capture_bucket(self, bucket: _Bucket) -> None:
        n = bucket.size
        out = self._run_recorded(n)  # the warm-up, on the capture stream
        bucket.views = self._views(n)
        if self._mode == "eager":
            bucket.captured = True
            return
        del out
        graph, out = self._capture_graph(n, self._pool)
        bucket.graph = graph
        # The static outputs live in the pool; hold them through non-owning aliases so the
        # buckets captured next reuse their memory (outputs are valid until the next call).
        from bcg.ownership import PoolMembership

        assert self._pool is not None
        leaves, bucket.spec = pytree.tree_flatten(PoolMembership(self._pool, self._device.index or 0).release(out))
        bucket.leaves = leaves
        bucket.captured = True

    def _capture_graph(self, n: int, pool: PoolHandle | None) -> tuple[BreakableGraph, Any]:
        views = self._views(n)
        self._load_example(n, views)
        live = self._live_for(n)
        hook = self._plan_hook(n, self._plans.get(n))
        graph = BreakableGraph()
        with torch.no_grad(), capture(
            graph,
            pool=pool,
            stream=self._stream,
            capture_error_mode=self._capture_error_mode,
            live=live,
            ownership="pool",
            after_breakpoint=hook,
        ):
            out = self._padded_forward(n, views)
        return graph, out

    def _finish_bucket(self, bucket: _Bucket) -> None:
        """After all captures: how to slice the bucket's outputs."""
        if not bucket.captured:
            return
        n = bucket.size
        spec, shapes = self._out_shapes[n]
        if bucket.spec is None:
            bucket.spec = spec
        bucket.single = bucket.spec.is_leaf()
        others = [(m, s) for m, (sp, s) in self._out_shapes.items() if m != n and sp == spec]
        dims_per_leaf: list[tuple[int, ...]] = []
        for k, shape in enumerate(shapes):
            dims: tuple[int, ...] | None = ()
            if shape is not None:
                comparable = [(m, other[k]) for m, other in others if other[k] is not None]
                if not comparable:  # no run of another size to compare with: every dim of size n
                    dims = tuple(d for d, size in enumerate(shape) if size == n)
                else:
                    for m, other_shape in comparable:
                        dims = _scaling_dims(shape, n, other_shape, m)
                        if dims is not None:
                            break
                    if dims is None:
                        log.debug("bcg.GraphRunner: output %d of bucket %d is returned unsliced: its shape "
                                  "does not grow with the bucket size consistently", k, n)
                        dims = ()
            dims_per_leaf.append(dims)
        bucket.slice_dims = dims_per_leaf

    def measure_largest_alone(self) -> int:
        """Capture the largest bucket alone in a fresh pool and return that pool's bytes.

        The graph is freed right after; the figure lands in
        ``stats()["largest_alone_pool_bytes"]`` and ``stats()["pool_ratio"]``
        (all buckets' shared pool / this), whose target is <= 1.1. Graph mode
        only (0 in eager mode). Capture the runner first so the shapes used
        to sanitize are known, or a probe run is made.
        """
        if self._mode != "graph":
            self._largest_alone = 0
            return 0
        with self._guard.lock, self._capturing(), self._on_device():
            self._setup()
            n = self._buckets_list[-1]
            if not self._patterns:
                self._run_recorded(self._probe_size)
            if n not in self._patterns:
                self._run_recorded(n)
            pool = graph_pool_handle()
            graph, out = self._capture_graph(n, pool)
            try:
                size = pool_bytes(pool, self._device.index)
            finally:
                del out
                graph.reset()
            self._largest_alone = size
            log.info(
                "bcg.GraphRunner(%s): pool of all buckets %.1f MiB, largest bucket (%d) alone %.1f MiB",
                self.name, self._pool_bytes() / 2**20, n, size / 2**20,
            )
            return size

    # -- calls -----------------------------------------------------------------------------------
    def _check(self, inputs: tuple[Any, ...]) -> int:
        """Validate a call's inputs against the example's; return ``T``. Raises before any side effect."""
        specs = self._inputs
        if len(inputs) != len(specs):
            raise TypeError(
                f"GraphRunner({self.name}) takes {len(specs)} input(s), like example_inputs, "
                f"but {len(inputs)} were given"
            )
        T = -1
        first = -1
        for s, x in zip(specs, inputs):
            if s.kind == _VALUE:
                if not same_value(x, s.example):
                    raise ValueError(f"input {s.index} is {x!r}; expected {s.describe()}")
                continue
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {s.index} is a {type(x).__name__}; expected {s.describe()}")
            if x.dtype != s.dtype:
                raise TypeError(f"input {s.index} has dtype {x.dtype}; expected {s.describe()}")
            if x.device != s.device:
                raise ValueError(f"input {s.index} is on {x.device}; expected {s.describe()}")
            if s.kind == _BY_REFERENCE:
                if x is not s.example and not _same_tensor(x, s.example):
                    raise ValueError(f"input {s.index} is another tensor; expected {s.describe()}")
                continue
            shape = x.shape
            d = s.pad_dim
            if len(shape) != s.ndim or shape[:d] != s.shape[:d] or shape[d + 1 :] != s.shape[d + 1 :]:
                raise ValueError(f"input {s.index} has shape {tuple(shape)}; expected {s.describe()}")
            if T < 0:
                T, first = shape[d], s.index
            elif shape[d] != T:
                raise ValueError(
                    f"input {s.index} has {shape[d]} rows along its pad dim {d} but input {first} has {T}: "
                    "all padded inputs must have the same size T"
                )
        return T

    def __call__(self, *inputs: Any, live: Any = _UNSET) -> Any:
        """Run ``forward(*inputs)`` through the graph of the smallest bucket ``>= T``; outputs sliced to ``T``.

        ``live`` is what :func:`bcg.live` returns inside breakpoints. Outputs are
        views valid until the next call, or copies (see ``copy_outputs`` and :meth:`locked`).
        """
        with self._guard.lock:
            if not self._captured:
                raise ReplayError(f"GraphRunner({self.name}) is not captured: call runner.capture() first")
            T = self._check(inputs)
            n = pick_bucket(self._buckets_list, T)
            if n is None:
                return self._fallback("too_large", inputs, live)
            bucket = self._buckets[n]
            if bucket.failure is not None:
                return self._fallback("capture_failed", inputs, live)
            if self._max_padding_ratio is not None and (n - T) > self._max_padding_ratio * n:
                return self._fallback("padding_waste", inputs, live)
            graph = bucket.graph
            if graph is not None:
                device = _current_device()
                if device != self._device.index:
                    raise ReplayError(
                        f"GraphRunner({self.name}) was captured on {self._device} but the current device is "
                        f"cuda:{device}: call it under torch.cuda.device({self._device.index})"
                    )
                self._serialize_streams(device)
            views = bucket.views
            for s in self._padded:
                views[s.index].narrow(s.pad_dim, 0, T).copy_(inputs[s.index])
            if self._sanitize:
                self._t_dev.fill_(T)  # type: ignore[union-attr]
            elif T < n:
                for s in self._padded:
                    views[s.index].narrow(s.pad_dim, T, n - T).zero_()
            if graph is not None:
                graph._replay_unchecked(live)
                leaves = bucket.leaves
            else:
                hook = self._plan_hook(n, self._plans.get(n))
                recorder = _Recorder((lambda k, ts, br: hook(ts)) if hook is not None else (lambda k, ts, br: None))
                leaves, _ = pytree.tree_flatten(self._run_eager(n, views, live, recorder))
                bucket.leaves = leaves
            bucket.replays += 1
            self._calls += 1
            self._graph_calls += 1
            self._real_rows += T
            self._padded_rows += n
            assert leaves is not None
            copy = self._copy_outputs
            if copy is None:
                copy = not self._guard.views_safe()
            return self._slice(bucket, leaves, T, copy)

    @contextlib.contextmanager
    def locked(self) -> Iterator[GraphRunner]:
        """Hold the call lock (shared by runners sharing the pool) for the whole block.

        Calls made inside the block return views even when several threads use
        the runner (``copy_outputs=None``): no other thread's call can
        overwrite them before the block ends. Read or copy what you need inside::

            with runner.locked():
                y = runner(x, live=meta)
                logits = head(y)          # reads the view while no other call can run
        """
        guard = self._guard
        with guard.lock:
            me = threading.get_ident()
            previous, guard.reader = guard.reader, me
            try:
                yield self
            finally:
                guard.reader = previous

    def _serialize_streams(self, device: int) -> None:
        """Order this replay after the previous one of any runner sharing the pool, if on another stream."""
        current = _current_raw_stream(device)
        last = self._guard.last_stream
        if last is not None and last != current:
            torch.cuda.current_stream(device).wait_stream(torch.cuda.ExternalStream(last, device=device))
        self._guard.last_stream = current

    def _slice(self, bucket: _Bucket, leaves: list[Any], T: int, copy: bool) -> Any:
        if bucket.single:
            t = leaves[0]
            for d in bucket.slice_dims[0]:
                t = t.narrow(d, 0, T)
            return t.clone(memory_format=torch.contiguous_format) if copy else t
        out = []
        for leaf, dims in zip(leaves, bucket.slice_dims):
            for d in dims:
                leaf = leaf.narrow(d, 0, T)
            if copy and isinstance(leaf, torch.Tensor):
                leaf = leaf.clone(memory_format=torch.contiguous_format)
            out.append(leaf)
        return pytree.tree_unflatten(out, bucket.spec)

    def _fallback(self, reason: str, inputs: tuple[Any, ...], live: Any) -> Any:
        self._fallbacks[reason] += 1
        self._calls += 1
        with torch.no_grad(), live_scope(live) if live is not _UNSET else contextlib.nullcontext():
            return self._forward(*inputs)

    # -- inspection ------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        """``"graph"`` or ``"eager"`` (after any automatic fallback)."""
        return self._mode

    @property
    def buckets(self) -> list[int]:
        """The bucket ladder, ascending."""
        return list(self._buckets_list)

    @property
    def is_captured(self) -> bool:
        return self._captured

    @property
    def captured_buckets(self) -> list[int]:
        return [b for b in self._buckets_list if self._buckets[b].captured]

    @property
    def failed_buckets(self) -> dict[int, str]:
        """Bucket -> ``"ExceptionType: message"`` for buckets whose capture raised."""
        return {b: x.failure for b, x in self._buckets.items() if x.failure is not None}

    def bucket_for(self, T: int) -> int | None:
        """The bucket a call with ``T`` rows maps to (``None``: above the ladder), before fallbacks."""
        return pick_bucket(self._buckets_list, T)

    def graph(self, bucket: int) -> BreakableGraph:
        """The captured graph of ``bucket`` (graph mode)."""
        b = self._buckets.get(bucket)
        if b is None or b.graph is None:
            raise KeyError(f"no captured graph for bucket {bucket}")
        return b.graph

    def bucket_outputs(self, bucket: int) -> Any:
        """The full, unsliced outputs of ``bucket``'s last run (padded rows included); valid until the next call."""
        b = self._buckets.get(bucket)
        if b is None or b.leaves is None:
            raise KeyError(f"bucket {bucket} has no outputs (not captured, or not run yet in eager mode)")
        return pytree.tree_unflatten(list(b.leaves), b.spec)

    def pool(self) -> PoolHandle:
        """The private pool every bucket's graph lives in; pass it as ``pool=`` to share it."""
        if self._pool is None:
            raise ReplayError("this GraphRunner has no pool yet: capture it first (graph mode)")
        return self._pool

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The capture stream (graph mode, after capture)."""
        return self._stream

    def _pool_bytes(self) -> int:
        if self._mode != "graph" or self._pool is None:
            return 0
        return pool_bytes(self._pool, self._device.index)

    def stats(self) -> dict[str, Any]:
        """Counters and sizes.

        ``capture_s`` ({bucket: seconds, warm-up included}), ``capture_total_s``,
        ``pool_bytes`` (the shared pool: every bucket, and any other runner
        sharing it), ``largest_alone_pool_bytes`` and ``pool_ratio`` (after
        :meth:`measure_largest_alone`), ``fallbacks`` ({reason: calls}),
        ``replays`` ({bucket: calls}), ``calls``, ``graph_calls``,
        ``padding_ratio`` (padded rows / bucket rows over graph calls),
        ``captured_buckets``, ``failed_buckets``, ``mode``, ``buckets``.
        """
        pool = self._pool_bytes()
        alone = self._largest_alone
        return {
            "mode": self._mode,
            "buckets": list(self._buckets_list),
            "captured_buckets": self.captured_buckets,
            "failed_buckets": self.failed_buckets,
            "capture_s": {b: x.capture_s for b, x in self._buckets.items() if x.captured or x.failure},
            "capture_total_s": self._capture_total_s,
            "pool_bytes": pool,
            "largest_alone_pool_bytes": alone,
            "pool_ratio": pool / alone if alone else None,
            "calls": self._calls,
            "graph_calls": self._graph_calls,
            "replays": {b: x.replays for b, x in self._buckets.items()},
            "fallbacks": dict(self._fallbacks),
            "padding_ratio": 1 - self._real_rows / self._padded_rows if self._padded_rows else 0.0,
        }

    # -- release ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Free every bucket's graph, the static buffers and counters; ``capture()`` again to reuse."""
        with self._guard.lock:
            for bucket in self._buckets.values():
                bucket.leaves = None
                if bucket.graph is not None:
                    bucket.graph.reset()
                    bucket.graph = None
            if self._pool_anchor is not None:
                self._pool_anchor.release()
                self._pool_anchor = None
            if self._user_pool is None:
                self._pool = None  # a pool whose graphs are all gone is not captured into again
            self._largest_alone = None
            self._clear_state()

    def __enter__(self) -> GraphRunner:
        if not self._captured:
            self.capture()
        return self

    def __exit__(self, *exc: object) -> None:
        self.reset()

    def __repr__(self) -> str:
        state = "captured" if self._captured else "not captured"
        return (
            f"GraphRunner({self.name}, mode={self._mode}, {state}, buckets={self._buckets_list}, "
            f"failed={sorted(self.failed_buckets)})"
        )
