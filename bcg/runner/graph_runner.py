"""``bcg.GraphRunner``: one breakable graph per bucket size, padded inputs, one shared memory pool.

How a call runs, fallbacks, output lifetimes and threading: ``docs/runner.md``.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from bcg.core.torch_internals import pytree

from bcg.capture import capture_into
from bcg.core.breakpoint import UNSET, live_scope, recording
from bcg.core.pool import PoolHandle, PoolLease, PoolMembership, graph_pool_handle, pool_bytes
from bcg.core.process import capture_lock, capture_stream, release_when_safe
from bcg.core.session import CaptureOptions
from bcg.core.torch_internals import stream_readers
from bcg.distributed.agreement import CaptureVote, RankAgreement
from bcg.errors import BcgError, CaptureError, ReplayError, add_note
from bcg.graph import BreakableGraph, copy_outputs_into
from bcg.keyed.variants import VariantPolicy
from bcg.runner.arguments import check_runner_arguments
from bcg.runner.buckets import default_buckets, normalize_buckets, pick_bucket
from bcg.runner.inputs import PADDED, StaticInputs, check_inputs, describe_inputs
from bcg.runner.padding import PADDING, CrossingRecorder, PaddingSanitizer, scaling_dims
from bcg.runner.pool_lock import POOL_LOCKS, PoolCallLock
from bcg.staged.staging import StagedTiers, StagedWarmup

log = logging.getLogger("bcg")

#: The reasons a call runs ``forward`` eagerly instead of replaying a graph (``"not_captured_yet"``:
#: ``lazy=True``, the call's bucket is captured right after it; or a background capture has not
#: reached it yet. ``"capture_busy"``: its bucket is captured, but a background capture holds the
#: call lock for another bucket, which the replay would wait for).
FALLBACK_REASONS = ("too_large", "padding_waste", "capture_failed", "not_captured_yet", "capture_busy")

#: The share of the time a background capture leaves to calls while they come: after a bucket's
#: step, it waits up to three times as long while calls keep coming (they and the capture share
#: the GIL and the GPU, and a call beside a capture step runs slower). Serving first; the ladder
#: takes longer.
CALLS_SHARE = 0.75


#: A call's route in :meth:`bcg.distributed.RankAgreement.expect_same` checks (the key names the
#: codes, for its error message): k >= 0 the bucket graph's form k (:meth:`BreakableGraph.choose`),
#: -2 - i eager for ``FALLBACK_REASONS[i]``, and ``_RAISED``.
_RAISED = -100
_ROUTE = "route (k >= 0 form k, {}, {} raised)".format(
    ", ".join(f"{-2 - i} {reason}" for i, reason in enumerate(FALLBACK_REASONS)), _RAISED
)


_NOT_EAGER = object()  # _eager_while_capturing: the call goes the usual way, under the call lock

_current_device = stream_readers()[0]


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
    trigger: str | None = None  # what captured it: "capture()", "lazy" (a call) or "background"
    # A lazy runner's first bucket, when it is not the largest, is captured into a pool of its
    # own (this lease): the runner's pool is laid out for the largest bucket at the next capture,
    # which recaptures this bucket there (see GraphRunner._capture_lazily).
    own_pool: PoolLease | None = None
    capture_s: float = 0.0
    replays: int = 0
    sliced: dict[int, list[Any]] = field(default_factory=dict)  # graph mode: T -> the leaves' views

    def free_graphs(self) -> None:
        """Reset and drop the bucket's graph (its pool memory returns), and forget the outputs and
        output views that lived there."""
        self.leaves = None
        self.sliced.clear()
        if self.graph is not None:
            self.graph.reset()
            self.graph = None
        if self.own_pool is not None:
            self.own_pool.release()
            self.own_pool = None
            release_when_safe(torch.cuda.empty_cache)  # the pool's blocks go back to the driver


_SLICED_KEPT = 64  # distinct T per bucket whose output views are kept
_HANDED_KEPT = 256  # distinct T whose input_buffers are kept (a call on them is recognized, not checked)


class GraphRunner:
    """Run ``forward`` through one captured :class:`bcg.BreakableGraph` per bucket size.

    ``forward(*inputs)`` is called with ``example_inputs``-like inputs; tensor
    inputs are padded along ``pad_dim`` (an int for all of them, or one entry
    per input: ``None`` for a tensor that is not bucketed, such as a KV cache,
    which the graphs read in place: calls must pass that same tensor).
    Non-tensor inputs are frozen: calls must pass values equal to the example's.

    ``buckets``: sizes to capture (default :func:`bcg.runner.default_buckets`).
    ``capture_live``: what :func:`bcg.live` returns during each bucket's
    warm-up and capture; a callable is called with the size. Give a callable
    whenever live metadata depends on the size (request lengths do): the
    forward also runs once at another size (a probe run), to learn which dims
    grow with the size, and metadata for another size would make attention
    read out of bounds. It may return a :class:`bcg.StagedTiers`:
    the bucket then also gets one inline form per earlier value, for calls
    whose metadata fits smaller static bounds (see there).
    ``max_padding_ratio``: run eagerly when ``(bucket - T) / bucket`` exceeds
    it (default ``None``: never). ``copy_outputs``: ``True`` returns copies,
    ``False`` views valid until the next call, ``None`` (default) views while
    one thread calls and copies once several do (see :meth:`locked`). ``sanitize``: zero padded rows of inputs
    and of tensors crossing breakpoints inside the graph (default ``True``;
    ``False`` zeroes only the inputs' tails, with host launches). ``pool`` /
    ``stream``: share a pool (and capture stream) with another runner
    (``other.pool()``). ``mode``: ``"graph"`` or ``"eager"``. ``progress``:
    show a tqdm bar while capturing. ``variants``: a :class:`bcg.VariantPolicy`
    for keyed breakpoints (each bucket's graph keeps its own variants).
    ``lazy``: ``runner.capture()`` becomes optional: a call whose bucket is not
    captured yet runs ``forward`` eagerly (unpadded, as the other fallbacks), then
    captures that bucket before it returns; later calls replay it
    (``stats()["captures"]`` counts captures by trigger). The first bucket
    is captured into a pool of its own and again, into the runner's pool, at
    the next capture (``docs/runner.md``). ``capture()`` then captures the
    buckets not captured yet. ``capture(background=True)``
    captures on a thread of its own while calls are served (see there).
    ``ranks``: a :class:`bcg.distributed.RankAgreement` (multi-GPU): the ranks vote through
    each bucket's capture, so a failure on one rank fails the bucket on all;
    each call picks the bucket of the largest ``T`` of all ranks and one form
    of replay for all (see :meth:`__call__`), or, with
    ``RankAgreement(same_inputs=True)``, chooses locally and checks afterwards.
    Every rank must make the same calls in the same order.

    ``docs/runner.md`` says how a call runs: fallbacks, padded-row
    sanitizing, output lifetimes and thread safety.

    Every argument is checked before anything is built
    (:func:`bcg.runner.arguments.check_runner_arguments`): ``buckets`` ints >= 1,
    ``pad_dim`` an int or one int or ``None`` per input, ``max_padding_ratio``
    in ``[0, 1)``, the flags bools; a wrong type raises ``TypeError``, a value
    out of range ``ValueError``, naming the argument, what it got and what it expects.
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        buckets: Sequence[int] | None = None,
        *,
        example_inputs: Sequence[Any],
        pad_dim: int | Sequence[int | None] = 0,
        mode: str = "graph",
        capture_live: Any = UNSET,
        max_padding_ratio: float | None = None,
        copy_outputs: bool | None = None,
        sanitize: bool = True,
        pool: PoolHandle | None = None,
        stream: torch.cuda.Stream | None = None,
        capture_error_mode: str = "global",
        progress: bool = True,
        name: str | None = None,
        variants: VariantPolicy | None = None,
        ranks: RankAgreement | None = None,
        lazy: bool = False,
    ) -> None:
        check_runner_arguments(forward, buckets, example_inputs, pad_dim, mode, max_padding_ratio, copy_outputs,
                               sanitize, pool, stream, capture_error_mode, progress, name, variants, ranks, lazy)
        self._forward = forward
        self.name = name or getattr(forward, "__qualname__", type(forward).__name__)
        self._buckets_list = normalize_buckets(default_buckets() if buckets is None else buckets)
        self._inputs = describe_inputs(tuple(example_inputs), pad_dim)
        padded = [s for s in self._inputs if s.kind == PADDED]
        if not padded:
            raise ValueError(
                "example_inputs needs at least one padded tensor input (the one whose size along pad_dim is T)"
            )
        self._first_padded = padded[0].index
        devices = {s.device for s in padded}
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
        self._variants = variants
        self._ranks = ranks
        self._lazy = bool(lazy)
        self._barrier: Callable[[], None] | None = None  # the open bucket's CaptureVote.barrier
        self._progress = progress
        self._user_pool = pool
        self._pool: PoolHandle | None = pool
        self._stream = stream
        self._lease: PoolLease | None = None
        lock = PoolCallLock()
        self._lock = POOL_LOCKS.for_pool(pool, lock) if pool is not None else lock
        self._largest_alone: int | None = None
        self._background: threading.Thread | None = None  # capture(background=True)'s thread
        self._background_error: BaseException | None = None
        self._stop_background = threading.Event()
        self._counts_lock = threading.Lock()  # fallbacks are counted by calls outside the call lock too
        self._clear_state()

    # -- set-up ------------------------------------------------------------------------------
    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.device(self._device) if self._mode == "graph" else contextlib.nullcontext()

    def _capturing(self) -> contextlib.AbstractContextManager[Any]:
        """Graph mode: the process's capture lock, held across warm-ups and captures, which share
        the capture stream (another thread's capture must not record the warm-ups)."""
        return capture_lock() if self._mode == "graph" else contextlib.nullcontext()

    def _clear_state(self) -> None:
        self._buckets = {b: _Bucket(b) for b in self._buckets_list}
        self._retired: list[_Bucket] = []  # graphs in pools of their own, freed at the next call
        self._captured = False
        self._out_shapes: dict[int, tuple[Any, list[tuple[int, ...] | None]]] = {}
        self._capture_total_s = 0.0
        self._real_rows = 0  # (calls, graph calls and padded rows: from the buckets' replays, in stats())
        self._fallbacks = dict.fromkeys(FALLBACK_REASONS, 0)
        self._probe_size = self._choose_probe_size()
        self._rows = max(self._buckets_list[-1], self._probe_size)
        self._static: StaticInputs | None = None
        self._sanitizer: PaddingSanitizer | None = None
        # input_buffers(T), as handed out: T -> inputs, and id(first padded view) -> (T, bucket, inputs)
        self._handed: dict[int, tuple[Any, ...]] = {}
        self._handed_ids: dict[int, tuple[int, int, tuple[Any, ...]]] = {}
        # A warm-up drew random numbers (the default generator moved): captures then run the
        # forward's last segment, the only way bcg learns whether that segment uses RNG.
        self._draws_rng: bool | None = None  # None: no warm-up has told yet (graph mode)

    def _choose_probe_size(self) -> int:
        """A second size to run once, so the first bucket captured knows which dims grow with the size."""
        biggest = self._buckets_list[-1]
        for b in self._buckets_list:
            if 1 < b < biggest:
                return b
        return biggest // 2 if biggest > 2 else biggest + 1

    def _setup(self) -> tuple[StaticInputs, PaddingSanitizer]:
        if self._static is None or self._sanitizer is None:
            self._static = StaticInputs(self._inputs, self._rows, self._device)
            self._sanitizer = PaddingSanitizer(self._static.padded, self._rows, self._device, self._sanitize)
        if self._mode == "graph":
            if self._pool is None:
                self._pool = graph_pool_handle()
                self._lock = POOL_LOCKS.for_pool(self._pool, self._lock)
            if self._stream is None:
                self._stream = capture_stream(self._device.index or 0)
            if self._lease is None:  # the pool outlives any one bucket's graph, failed ones too
                self._lease = PoolLease(self._device.index or 0, self._pool, self._stream)
        return self._static, self._sanitizer

    def _lives_for(self, n: int) -> tuple[Any, ...]:
        """The capture-time live values of bucket ``n``: its staged tiers' (if any), its own last."""
        live = self._capture_live
        if live is UNSET:
            return (UNSET,)
        live = live(n) if callable(live) else live
        return tuple(live) if isinstance(live, StagedTiers) else (live,)

    def _live_for(self, n: int) -> Any:
        return self._lives_for(n)[-1]

    # -- the padded forward ----------------------------------------------------------------------
    def _padded_forward(self, n: int, views: list[Any]) -> Any:
        """``forward`` on the size-``n`` static inputs; first (if sanitizing) zero rows ``>= T``."""
        assert self._sanitizer is not None
        self._sanitizer.zero_inputs(n, views)
        return self._forward(*views)

    def _run_eager(self, n: int, views: list[Any], live: Any, recorder: CrossingRecorder) -> Any:
        """Run the padded forward eagerly at size ``n`` with ``recorder`` handling breakpoints."""
        with recording(recorder, live), torch.no_grad():
            return self._padded_forward(n, views)

    def _run_recorded(self, n: int, observe: bool = False) -> Any:
        """A warm-up (or probe) run at size ``n`` on example data: records how to sanitize, and shapes.

        ``observe``: staged breakpoints run their breakable form (a probe run that only tells
        which dims grow: see :class:`CrossingRecorder`)."""
        static, sanitizer = self._setup()
        views = static.load_example(n)
        sanitizer.set_rows(n)
        live = self._live_for(n)
        generator = torch.cuda.default_generators[self._device.index or 0] if self._mode == "graph" else None
        offset = generator.get_offset() if generator is not None else 0
        with self._recording(n, observe) as recorder:
            with self._on_capture_stream() if self._mode == "graph" else contextlib.nullcontext():
                out = self._run_eager(n, views, live, recorder)
        if generator is not None:
            self._draws_rng = bool(self._draws_rng) or generator.get_offset() != offset
        self._note_out_shapes(n, out)
        return out

    def _recording(self, n: int, observe: bool) -> Any:
        """The sanitizer's recording of an eager run at size ``n`` (see :meth:`PaddingSanitizer.recording`)."""
        static, sanitizer = self._setup()
        return sanitizer.recording(n, static.static_ptrs, bridges_are_copies=self._mode == "graph", observe=observe)

    def _note_out_shapes(self, n: int, out: Any) -> None:
        leaves, spec = pytree.tree_flatten(out)
        self._out_shapes[n] = (spec, [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in leaves])

    @contextlib.contextmanager
    def _on_capture_stream(self) -> Iterator[None]:
        """Run the block on the capture stream, after the current stream's queued work and before its next."""
        assert self._stream is not None
        current = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(current)
        try:
            with torch.cuda.stream(self._stream):
                yield
        finally:
            current.wait_stream(self._stream)

    # -- capture ------------------------------------------------------------------------------
    def capture(self, background: bool = False) -> GraphRunner:
        """Warm up and capture every bucket, largest first, into one pool on one capture stream.

        Shows a tqdm progress bar (``progress=False`` hides it), records
        per-bucket seconds (``stats()["capture_s"]``), logs the total and the
        pool size. A bucket whose warm-up or capture raises is logged and
        skipped (see the module documentation). In eager mode each bucket is
        run once instead. With ``lazy=True``, captures the buckets that calls
        have not captured yet, and the first lazy bucket again, into the
        runner's pool. Returns the runner.

        Arguments:
            background: return at once and capture on a thread of its own
                (:meth:`wait_captured` waits for it). Calls are served
                meanwhile: eagerly (fallback ``"not_captured_yet"``) while
                their bucket is not captured, by its graph once it is. Each
                bucket's warm-up and capture hold the call lock (they write the
                static inputs and the pool that replays use), so a call that
                needs them waits for at most one bucket; a call running eagerly
                on inputs of its own does not wait. While calls come, the
                capture waits between buckets (calls get ``CALLS_SHARE`` of the
                time), so the ladder takes longer under load. The captures use
                ``capture_error_mode="thread_local"`` whatever the runner's.

        .. warning::
            While a background capture runs, code on other threads must not
            synchronize the whole device (``torch.cuda.synchronize()``): CUDA
            refuses that during any capture. Synchronize streams or events.
            Nor draw random numbers from the default CUDA generator, which torch
            marks as capturing during every capture: use a ``torch.Generator``
            of your own.
        """
        if background:
            return self._start_background()
        self.wait_captured()  # (a background capture first finishes what it does)
        with self._lock.lock, self._capturing(), self._on_device():
            if self._captured and not self._lazy and not self._uncaptured():
                raise BcgError("this GraphRunner is already captured: call reset() first to capture again")
            t_start = time.perf_counter()
            self._free_own_pools(keep=True)  # (captured again below, into the runner's pool)
            self._prepare_captures()
            from tqdm import tqdm

            order = self._uncaptured()
            bar = tqdm(order, desc="bcg capture", unit="bucket", disable=not self._progress)
            for n in bar:
                bar.set_postfix_str(f"bucket {n}", refresh=False)
                self._capture_one(self._buckets[n], "capture()")
            bar.close()
            for n in order:
                self._finish_bucket(self._buckets[n])
            self._capture_total_s += time.perf_counter() - t_start
            self._captured = True
            ok = [b for b in self._buckets_list if self._buckets[b].captured]
            log.info(
                "bcg.GraphRunner(%s): %s %d of %d bucket(s) (%s) in %.2f s; pool %.1f MiB",
                self.name, "captured" if self._mode == "graph" else "warmed up (eager mode)",
                len(ok), len(self._buckets_list), ", ".join(map(str, ok)) or "none", self._capture_total_s,
                self._pool_bytes() / 2**20,
            )
            return self

    def _prepare_captures(self, first: int | None = None, lay_out: bool = False) -> None:
        """Before a capture (under the capture lock): the static buffers, and, unless a run at
        another size has told, a probe run that tells which output dims grow with the size.

        ``first``: the bucket a lazy call captures. ``lay_out``: the probe runs at the largest
        bucket (unless that is ``first``) with its allocations in the runner's pool, so the pool
        holds segments sized for the largest bucket, which the captures then carve from in
        whatever order calls bring buckets (otherwise each larger bucket adds segments of its own).
        """
        self._setup()
        largest = self._buckets_list[-1]
        lease = self._lease if lay_out and first != largest else None  # (graph mode only)
        if lease is None and any(m != first for m in self._out_shapes):
            return
        if lease is not None:
            size = largest
        elif first != self._probe_size:
            size = self._probe_size
        else:  # another size than the bucket's own, below the largest (first < largest <= rows)
            assert first is not None
            size = first // 2 if first // 2 > 1 else first + 1
        try:
            with lease.allocating() if lease is not None else contextlib.nullcontext():
                self._run_recorded(size, observe=lease is None)
        except Exception as exc:  # the buckets' own warm-ups report failures
            log.debug("bcg.GraphRunner: the probe run raised: %r", exc)

    def _free_own_pools(self, keep: bool = False) -> list[_Bucket]:
        """Take the buckets captured into pools of their own out of them, to be captured again into
        the runner's pool (keeping the trigger that first captured them), and return them.

        Their graphs and pools are freed now (inside a call), or, with ``keep``, at the next call
        or ``reset()``: the outputs the last call returned stay valid until the next call."""
        freed = [b for b in self._buckets.values() if b.own_pool is not None]
        for bucket in freed:
            if keep:
                self._retired.append(_Bucket(bucket.size, graph=bucket.graph, own_pool=bucket.own_pool))
                bucket.graph, bucket.own_pool, bucket.leaves = None, None, None
                bucket.sliced.clear()
            else:
                bucket.free_graphs()
            bucket.captured = False
        return freed

    def _free_retired(self) -> None:
        """Free what :meth:`_free_own_pools` kept (the call lock is held)."""
        while self._retired:
            self._retired.pop().free_graphs()

    def _capture_one(self, bucket: _Bucket, trigger: str) -> None:
        """Warm up and capture ``bucket`` (under the capture lock); a failure is logged and the
        bucket's calls run eagerly (fallback ``capture_failed``). With ranks, they vote."""
        n = bucket.size
        t0 = time.perf_counter()
        vote = CaptureVote(self._ranks) if self._ranks is not None else None
        self._barrier = vote.barrier if vote is not None else None
        try:
            self._capture_bucket(bucket)
            if vote is not None and not vote.finish():
                raise CaptureError(f"another rank failed to capture bucket {n}: every rank runs it eagerly")
            bucket.trigger = bucket.trigger or trigger  # (a bucket captured again keeps the first)
        except Exception as exc:
            if vote is not None:
                vote.fail()
            bucket.free_graphs()  # (captured here, failed on another rank)
            bucket.failure = f"{type(exc).__name__}: {exc}"
            bucket.captured = False
            log.warning(
                "bcg.GraphRunner(%s): capturing bucket %d failed, calls that would use it run "
                "eagerly (fallback 'capture_failed'): %s",
                self.name, n, bucket.failure, exc_info=exc,
            )
        finally:
            self._barrier = None
        bucket.capture_s = time.perf_counter() - t0

    def _capture_lazily(self, bucket: _Bucket) -> None:
        """``lazy=True``: capture ``bucket`` after a call that ran eagerly (the call lock is held).

        The first bucket, unless it is the largest, goes into a pool of its own, with no run at
        the largest size before it and without its staged tiers (the first call returns sooner).
        The next lazy capture lays the runner's pool out for the largest bucket, captures its
        bucket, and captures the first one again, whole, into that pool (its own is freed)."""
        with self._capturing(), self._on_device():
            t_start = time.perf_counter()
            again = self._free_own_pools()
            in_use = any(b.captured and b.own_pool is None for b in self._buckets.values())
            if (self._mode == "graph" and self._user_pool is None and not again and not in_use
                    and bucket.size != self._buckets_list[-1]):
                assert self._stream is not None
                bucket.own_pool = PoolLease(self._device.index or 0, graph_pool_handle(), self._stream)
                self._prepare_captures(first=bucket.size)
            else:
                self._prepare_captures(first=bucket.size, lay_out=not in_use)
            for b in [bucket, *again]:
                self._capture_one(b, "lazy")
                self._finish_bucket(b)
            self._capture_total_s += time.perf_counter() - t_start
        log.info("bcg.GraphRunner(%s): bucket %d captured after a call (lazy) in %.2f s%s",
                 self.name, bucket.size, bucket.capture_s,
                 "".join(f"; bucket {b.size} again, into the runner's pool" for b in again))

    def _start_background(self) -> GraphRunner:
        if self._ranks is not None:
            raise BcgError("capture(background=True) is not available with ranks=: every rank must "
                           "capture a bucket at the same point of its calls; capture() before serving")
        with self._lock.lock:
            if self._background is not None and self._background.is_alive():
                raise BcgError("this GraphRunner is already capturing in the background: wait_captured() first")
            if self._captured and not self._lazy and not self._uncaptured():
                raise BcgError("this GraphRunner is already captured: call reset() first to capture again")
            with self._on_device():
                self._setup()
            self._captured = True  # calls are served from now on
            self._background_error = None
            self._stop_background.clear()
            # Not a daemon: an interpreter exiting under a capture aborts the process. At exit
            # (the main thread has ended) the thread stops after the bucket under way.
            thread = threading.Thread(target=self._capture_in_background, name=f"bcg-capture-{self.name}",
                                      daemon=False)
            self._background = thread
            self._lock.background += 1  # calls return copies until it ends (see PoolCallLock.views_safe)
            thread.start()  # (under the lock: a reset() waits until it can join a started thread)
        return self

    def _capture_in_background(self) -> None:
        """The background thread: each bucket largest first, under the call lock, in thread_local mode."""
        t_start = time.perf_counter()
        try:
            with self._on_device():
                static, _ = self._setup()
                calls, t_step = self._lock.calls, time.perf_counter()
                with self._lock.capture_step(), self._capturing():
                    self._order_with_calls()
                    with static.preserved([self._probe_size]):
                        self._prepare_captures()
                    self._order_with_calls()
                for n in sorted(self._buckets_list, reverse=True):
                    # calls get CALLS_SHARE of the time while they come (the last step took the rest)
                    step_s = time.perf_counter() - t_step
                    self._lock.yield_to_calls(calls, step_s * CALLS_SHARE / (1 - CALLS_SHARE), self._stop_background)
                    self._lock.let_callers_in()  # a call waiting for the lock runs before this bucket
                    if self._stop_background.is_set() or not threading.main_thread().is_alive():
                        break
                    calls, t_step = self._lock.calls, time.perf_counter()
                    with self._lock.capture_step(), self._capturing():
                        bucket = self._buckets[n]
                        if (bucket.captured and bucket.own_pool is None) or bucket.failure is not None:
                            continue  # (a lazy call captured it meanwhile)
                        if bucket.own_pool is not None:  # served by its graph until now, captured again
                            self._free_own_pools(keep=True)
                        self._order_with_calls()
                        mode, self._capture_error_mode = self._capture_error_mode, "thread_local"
                        try:
                            # The capture loads the example into the static inputs, which calls
                            # may have filled (input_buffers): they get their values back.
                            with static.preserved([n]):
                                self._capture_one(bucket, "background")
                        finally:
                            self._capture_error_mode = mode
                            self._order_with_calls()
                        self._finish_bucket(bucket)
        except BaseException as exc:  # (a bucket's own failure is caught in _capture_one)
            self._background_error = exc
            log.error("bcg.GraphRunner(%s): the background capture stopped: %s: %s",
                      self.name, type(exc).__name__, exc, exc_info=exc)
        finally:
            with self._lock.lock:
                self._lock.background -= 1
            self._capture_total_s += time.perf_counter() - t_start
            log.info("bcg.GraphRunner(%s): background capture done: %d of %d bucket(s) in %.2f s",
                     self.name, len(self.captured_buckets), len(self._buckets_list),
                     time.perf_counter() - t_start)

    def _order_with_calls(self) -> None:
        """Order the capture thread's work after the last call's (its replay may still run on the
        GPU: the warm-ups write the pool), and the next call after this thread's work on the
        static inputs and the pool, whatever streams the calls use (``PoolCallLock.serialize_streams``)."""
        if self._mode == "graph":
            self._lock.serialize_streams(self._device.index or 0)

    def wait_captured(self, timeout: float | None = None) -> bool:
        """Wait for a background capture (:meth:`capture` with ``background=True``) to finish.

        Returns ``False`` when ``timeout`` (seconds) passed first, ``True`` otherwise (also
        when none runs).

        Raises:
            BcgError: the background capture stopped on an error (the error is its cause).
        """
        thread = self._background
        if thread is None:
            return True
        self._refuse_join_under_lock(thread, "wait_captured()")
        thread.join(timeout)
        if thread.is_alive():
            return False
        error, self._background_error = self._background_error, None
        if self._background is thread:
            self._background = None
        if error is not None:
            raise BcgError(f"GraphRunner({self.name}): the background capture stopped: "
                           f"{type(error).__name__}: {error}") from error
        return True

    def _refuse_join_under_lock(self, thread: threading.Thread, what: str) -> None:
        """Waiting for the capture thread while holding the call lock it needs would never end."""
        if thread is threading.current_thread():
            raise BcgError(f"{what} was called from the runner's own capture thread")
        if thread.is_alive() and self._lock.reader == threading.get_ident():
            raise BcgError(f"{what} was called inside `with runner.locked():` while a background capture "
                           "runs: it waits for the capture, which waits for that lock. Call it outside the block")

    def _uncaptured(self) -> list[int]:
        """The buckets neither captured nor failed, largest first."""
        return [n for n in sorted(self._buckets_list, reverse=True)
                if not self._buckets[n].captured and self._buckets[n].failure is None]

    def _capturing_in_background(self) -> bool:
        thread = self._background
        return thread is not None and thread.is_alive()

    def _capture_bucket(self, bucket: _Bucket) -> None:
        n = bucket.size
        out = self._run_recorded(n)  # the warm-up, on the capture stream
        assert self._static is not None
        bucket.views = self._static.views(n)
        if self._mode == "eager":
            bucket.captured = True
            return
        del out
        graph = BreakableGraph()
        bucket.graph = graph
        pool = bucket.own_pool.pool if bucket.own_pool is not None else self._pool
        assert pool is not None
        out = self._capture_graph(graph, n, self._live_for(n), pool=pool)
        # The static outputs live in the pool; hold them through non-owning aliases so the
        # buckets captured next reuse their memory (outputs are valid until the next call).
        membership = PoolMembership(pool, self._device.index or 0)
        graph.outputs = out
        if graph.staged:
            # The breakable form, for calls whose metadata does not fit, captured while the
            # inline form's outputs are held; a replay of it copies its outputs into those.
            self._capture_graph(graph, n, self._live_for(n), form="breakable", pool=pool,
                                release=membership.release)
            # A bucket in a pool of its own (a lazy runner's first) is captured again at the next
            # capture: its tiers (calls with fewer requests run faster) come then, not before
            # the first result.
            tier_lives = self._lives_for(n)[:-1] if bucket.own_pool is None else ()
            if tier_lives and self._barrier is not None:
                # Every rank has the bucket's graph and breakable form before any tier's eager
                # warm-up (with collectives) runs: a rank that failed after its last vote cast
                # False, and the others learn it here, not inside a tier's capture.
                self._barrier()
            for live in tier_lives:
                self._capture_tier(graph, n, out, live, pool)
        graph.outputs = membership.release(out)
        if self._sanitize:
            # Build the executables without the zeroing (calls with T == n replay them) now,
            # rather than at the first such call.
            graph.set_enabled(PADDING, False)
            graph.set_enabled(PADDING, True)
        leaves, bucket.spec = pytree.tree_flatten(graph.outputs)
        bucket.leaves = leaves
        bucket.captured = True

    def _capture_graph(self, graph: BreakableGraph, n: int, live: Any, form: str = "main", into: Any = None,
                       pool: PoolHandle | None = None, agree: Callable[[], bool] | None = None,
                       release: Callable[[Any], Any] | None = None) -> Any:
        """Capture the padded forward at size ``n`` into ``graph`` (its ``form``, see
        :func:`bcg.capture.capture_into`) with ``live``; return its outputs (``into``: copied
        there at the graph's end, and ``into`` returned)."""
        static, sanitizer = self._setup()
        views = static.load_example(n)  # before the capture: its copies must not be captured
        sanitizer.set_rows(n)
        options = CaptureOptions(
            pool=pool if pool is not None else self._pool,
            stream=self._stream,
            capture_error_mode=self._capture_error_mode,
            live=live,
            after_breakpoint=sanitizer.hook(n),
            barrier=self._barrier,
            # Calls replay before reading: the last segment need not run at capture, unless the
            # forward draws random numbers (learnt only from a run: see _run_recorded).
            compute_outputs=bool(self._draws_rng),
        )

        def forward() -> Any:
            out = self._padded_forward(n, views)
            if into is not None:
                copy_outputs_into(into, out, "a staged tier")
                return into
            return out

        with torch.no_grad():
            return capture_into(graph, forward, options, variants=self._variants, form=form, agree=agree,
                                release=release)

    def _capture_tier(self, graph: BreakableGraph, n: int, outputs: Any, live: Any, pool: PoolHandle) -> None:
        """A staged tier of bucket ``n``'s graph: its forward warmed up, then captured with
        ``live``, ending with a copy of its outputs into ``outputs`` (the bucket's, held
        meanwhile); skipped (logged) when a staged breakpoint did not run inline, or a step
        failed. With ranks, the ranks vote through it as through a bucket's capture: all keep
        it, or none."""
        vote = CaptureVote(self._ranks) if self._ranks is not None else None
        bucket_barrier, self._barrier = self._barrier, (vote.barrier if vote is not None else None)
        try:
            static, sanitizer = self._setup()
            views = static.load_example(n)
            sanitizer.set_rows(n)
            with self._on_capture_stream(), recording(StagedWarmup(), live), torch.no_grad():
                self._padded_forward(n, views)  # its own warm-up: kernels at its bounds run once first
            self._capture_graph(graph, n, live, form="tier", into=outputs, pool=pool,
                                agree=vote.finish if vote is not None else None)
        except Exception as exc:  # the bucket's own forms serve the calls instead
            if vote is not None:
                vote.fail()
            log.warning("bcg.GraphRunner(%s): bucket %d: a staged tier's capture failed, skipped: %s: %s",
                        self.name, n, type(exc).__name__, exc)
        finally:
            self._barrier = bucket_barrier

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
                        dims = scaling_dims(shape, n, other_shape, m)
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
        with self._lock.lock, self._capturing(), self._on_device():
            _, sanitizer = self._setup()
            n = self._buckets_list[-1]
            if not sanitizer.sizes_seen:
                self._run_recorded(self._probe_size)
            if not sanitizer.has_run(n):
                self._run_recorded(n)
            pool = graph_pool_handle()
            graph = BreakableGraph()
            out = self._capture_graph(graph, n, self._live_for(n), pool=pool)
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
    def __call__(self, *inputs: Any, live: Any = UNSET, bucket: int | None = None) -> Any:
        """Run ``forward(*inputs)`` through the graph of the smallest bucket ``>= T``; outputs sliced to ``T``.

        ``live`` is what :func:`bcg.live` returns inside breakpoints. Outputs are
        views valid until the next call, or copies (see ``copy_outputs`` and :meth:`locked`).
        Calls with the same ``T`` and bucket return the same view objects, as
        first made (their autograd and inference-mode state too): do not change
        their metadata in place (e.g. ``unsqueeze_``). A call with no padded
        row (``T`` equal to the bucket) skips the in-graph zeroing.

        Arguments:
            bucket: run this bucket (of the ladder, ``>= T``) instead of picking one.

        With ``ranks=`` (multi-GPU), the bucket is picked for the largest ``T``
        of all ranks (unless ``bucket`` is given), and the ranks agree on whether
        to run the breakable form and whether to stitch: one or two all-reduces
        on the CPU group per call. With ``RankAgreement(same_inputs=True)`` the
        call chooses locally (keyed graphs still agree on stitching) and, after
        the launch, checks in the background that every rank chose alike
        (:meth:`bcg.distributed.RankAgreement.expect_same`; a difference raises
        :class:`bcg.ReplayError` at the next call).
        """
        if self._lock.background:  # a background capture of the pool runs: it yields to calls
            with self._lock.serving():
                if self._capturing_in_background() and bucket is None and self._ranks is None:
                    out = self._eager_while_capturing(inputs, live)
                    if out is not _NOT_EAGER:
                        return out
                return self._locked_call(inputs, live, bucket)
        return self._locked_call(inputs, live, bucket)

    def _locked_call(self, inputs: tuple[Any, ...], live: Any, bucket: int | None) -> Any:
        with self._lock.for_caller():
            if self._retired:
                self._free_retired()
            if not self._captured:
                if not self._lazy:
                    raise ReplayError(f"GraphRunner({self.name}) is not captured: call runner.capture() first")
                with self._on_device():
                    self._setup()  # (lazy: buckets are captured by the calls that need them)
                self._captured = True
            ranks = self._ranks
            if ranks is None or not ranks.same_inputs:
                return self._call(inputs, live, bucket, None)
            return self._checked_call(inputs, live, bucket, ranks)

    def _checked_call(self, inputs: tuple[Any, ...], live: Any, bucket: int | None, ranks: RankAgreement) -> Any:
        """A call under ``RankAgreement(same_inputs=True)``: chosen locally, then checked.

        Every call posts one check after its launch (the GPU works meanwhile), even a call
        that raised, so the ranks' checks stay paired; the call's own exception goes on,
        with a failed check as its note.
        """
        choice = {"call T": -1, "bucket": 0, _ROUTE: _RAISED}
        try:
            out = self._call(inputs, live, bucket, choice)
        except BaseException as exc:
            try:
                ranks.expect_same(choice)
            except ReplayError as check:
                add_note(exc, f"bcg: and the ranks' previous check failed: {check}")
            raise
        ranks.expect_same(choice)
        return out

    def _call(self, inputs: tuple[Any, ...], live: Any, bucket: int | None, choice: dict[str, int] | None) -> Any:
        """One call, under the call lock; ``choice`` (same inputs only) records what it chose."""
        ranks = self._ranks
        agree = ranks if ranks is not None and not ranks.same_inputs else None  # before every launch
        handed = self._handed_ids.get(id(inputs[self._first_padded])) if len(inputs) > self._first_padded else None
        if handed is not None and len(inputs) == len(handed[2]) and all(map(operator.is_, inputs, handed[2])):
            T = handed[0]  # input_buffers(T) itself: valid as made
        else:
            handed = None
            T = check_inputs(self._inputs, inputs, self.name)
        if choice is not None:
            choice["call T"] = T
        if bucket is not None:
            if bucket not in self._buckets or bucket < T:
                raise ValueError(
                    f"GraphRunner({self.name}): bucket={bucket} is not a bucket of the ladder "
                    f"{self._buckets_list} at least T={T}"
                )
            n: int | None = bucket
            T_all = agree.max([T])[0] if agree is not None else T  # (every rank judges the padding alike)
        elif handed is not None and agree is None:
            n, T_all = handed[1], T  # the bucket input_buffers(T) picked for T
        else:
            T_all = agree.max([T])[0] if agree is not None else T
            n = pick_bucket(self._buckets_list, T_all)
        if choice is not None:
            choice["bucket"] = n or 0
        if n is None:
            return self._fallback("too_large", inputs, live, choice)
        chosen = self._buckets[n]
        if chosen.failure is not None:
            return self._fallback("capture_failed", inputs, live, choice)
        if not chosen.captured:  # lazy=True, or a background capture: this call runs eagerly
            if handed is not None and self._mode == "graph":  # on the runner's own buffers: after
                self._lock.serialize_streams(self._device.index or 0)  # the last work on them
            lazy = self._lazy and not self._capturing_in_background()  # (else the background thread captures)
            # The first call's run, watched, tells the first capture which dims grow with the size
            # (as a probe run would; not with ranks, whose calls' T differ: all ranks probe alike)
            observe = lazy and self._ranks is None and 1 < T != n and not self._out_shapes
            out = self._fallback("not_captured_yet", inputs, live, choice, observe_at=T if observe else None)
            if lazy:
                self._capture_lazily(chosen)
            return out
        if self._max_padding_ratio is not None and (n - T_all) > self._max_padding_ratio * n:
            return self._fallback("padding_waste", inputs, live, choice)
        static, sanitizer = self._static, self._sanitizer
        assert static is not None and sanitizer is not None
        graph = chosen.graph
        route = 0  # the form replayed (see _ROUTE)
        stream: int | None = None
        if graph is not None:
            device = _current_device()
            if device != self._device.index:
                raise ReplayError(
                    f"GraphRunner({self.name}) was captured on {self._device} but the current device is "
                    f"cuda:{device}: call it under torch.cuda.device({self._device.index})"
                )
            stream = self._lock.serialize_streams(device)
        if handed is not None and handed[1] == n:
            if not self._sanitize:
                static.zero_tails(chosen.views, T)  # (the rows before T are the call's own)
        else:
            static.write(chosen.views, inputs, T, zero_tail=not self._sanitize, stream=stream)
        if self._sanitize:
            sanitizer.set_rows(T, stream)  # every call (written if it changed): a stitched launch runs the zeroing too
        if graph is not None:
            if self._sanitize:
                graph.set_enabled(PADDING, T < n)  # nothing padded: skip the zeroing nodes
            if ranks is None:
                graph.replay(live)
            else:
                route = graph.choose(live)
                stitch = True
                if agree is not None:
                    route, stitch = self._agree_on_replay(graph, route, live, agree)
                elif graph.keyed:  # same inputs: stitch only where every rank would (variant caches
                    stitch = ranks.all(graph.would_stitch(route, live))  # are per-rank state)
                graph.replay_form(route, live, stitch=stitch)
            leaves = chosen.leaves
        else:
            hook = sanitizer.hook(n)
            recorder = CrossingRecorder((lambda ts, br: hook(ts)) if hook is not None else None)
            leaves, _ = pytree.tree_flatten(self._run_eager(n, chosen.views, live, recorder))
            chosen.leaves = leaves
        chosen.replays += 1
        self._real_rows += T
        if choice is not None:
            choice[_ROUTE] = route
        assert leaves is not None
        copy = self._copy_outputs
        if copy is None:
            copy = not self._lock.views_safe()
        return self._slice(chosen, leaves, T, copy, keep=graph is not None)

    def _eager_while_capturing(self, inputs: tuple[Any, ...], live: Any) -> Any:
        """During a background capture, a call runs eagerly without waiting for the call lock
        when its bucket is not captured yet, or when it is but a capture step holds the lock (a
        replay would wait for a whole bucket's warm-up and capture): it reads only its own
        inputs. Returns ``_NOT_EAGER`` for a call that goes the usual way, under the lock (its
        bucket is captured and the lock free, or failed; it is above the ladder; its inputs are
        the runner's own buffers, which a capture rewrites; or the forward may draw random
        numbers: torch marks the default CUDA generator as capturing during every capture, and a
        draw from another thread then raises)."""
        if self._mode == "graph" and self._draws_rng is not False:  # draws, or not known yet
            return _NOT_EAGER  # eager under the lock: between two buckets' captures
        first = inputs[self._first_padded] if len(inputs) > self._first_padded else None
        if first is not None and id(first) in self._handed_ids:
            return _NOT_EAGER
        T = check_inputs(self._inputs, inputs, self.name)
        n = pick_bucket(self._buckets_list, T)
        if n is None:
            return _NOT_EAGER
        chosen = self._buckets[n]
        if chosen.failure is not None:
            return _NOT_EAGER
        if not chosen.captured:
            return self._fallback("not_captured_yet", inputs, live, None)
        if self._lock.in_capture_step:  # (it may end meanwhile: then this call ran eagerly for nothing)
            return self._fallback("capture_busy", inputs, live, None)
        return _NOT_EAGER

    def _agree_on_replay(self, graph: BreakableGraph, form: int, live: Any, ranks: RankAgreement) -> tuple[int, bool]:
        """``(form, stitch)`` for this call, the same on every rank: the most general form any rank
        chose (forms are tried in order, so a later one takes whatever an earlier one does),
        stitched only where every rank would stitch it (a rank whose first build of an
        executable the driver refuses still replays piecewise: the same collectives in the
        same order). One all-reduce when the graph has several forms or keyed breakpoints."""
        forms = len(graph.forms)
        keyed = graph.keyed
        if forms == 1 and not keyed:
            return form, True
        values = [form] + ([int(not graph.would_stitch(k, live)) for k in range(forms)] if keyed else [])
        agreed = ranks.max(values)
        form = agreed[0]
        return form, not (keyed and agreed[1 + form])

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
        guard = self._lock
        with guard.for_caller():
            me = threading.get_ident()
            previous, guard.reader = guard.reader, me
            try:
                yield self
            finally:
                guard.reader = previous

    def _slice(self, bucket: _Bucket, leaves: list[Any], T: int, copy: bool, keep: bool) -> Any:
        """The outputs' first ``T`` rows: views (kept per ``T`` when ``keep``: the graph's static
        outputs), or copies."""
        views = bucket.sliced.get(T) if keep else None
        if views is None:
            views = []
            for leaf, dims in zip(leaves, bucket.slice_dims):
                for d in dims:
                    leaf = leaf.narrow(d, 0, T)
                views.append(leaf)
            if keep:
                if len(bucket.sliced) >= _SLICED_KEPT:
                    bucket.sliced.clear()
                bucket.sliced[T] = views
        if copy:
            views = [v.clone(memory_format=torch.contiguous_format) if isinstance(v, torch.Tensor) else v
                     for v in views]
        if bucket.single:
            return views[0]
        return pytree.tree_unflatten(views, bucket.spec)

    def _fallback(self, reason: str, inputs: tuple[Any, ...], live: Any, choice: dict[str, int] | None,
                  observe_at: int | None = None) -> Any:
        """``forward(*inputs)`` eagerly, counted under ``reason`` (and noted in ``choice``, if any).

        ``observe_at``: the call's ``T``; the run is also recorded as a run at that size (as a
        probe run is), unchanged (see :class:`CrossingRecorder`)."""
        with self._counts_lock:
            self._fallbacks[reason] += 1
        if observe_at is None:
            with torch.no_grad(), live_scope(live):
                out = self._forward(*inputs)
        else:
            with self._recording(observe_at, observe=True) as recorder, recording(recorder, live), torch.no_grad():
                out = self._forward(*inputs)
            if recorder.failure is None:  # (else a probe run tells the capture instead)
                self._note_out_shapes(observe_at, out)
        if choice is not None:
            choice[_ROUTE] = -2 - FALLBACK_REASONS.index(reason)
        return out

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

    def input_buffers(self, T: int) -> tuple[Any, ...]:
        """Inputs for a call with ``T`` rows that the call does not copy: the first ``T`` rows of
        the static input buffers of ``T``'s bucket (by-reference and value inputs as given).

        Fill them in place (``buf.copy_(ids)``, or write the batch there as it is
        built) and pass them as the call's inputs: the call then skips the
        input copies, as a serving engine that builds its batch in persistent
        buffers does. Any other tensors are copied in as usual.

        .. warning::
            The buffers are the graphs' inputs: the next call reads what they
            hold then, and a call with more rows, or of another bucket, may
            overwrite them. Write them right before the call that uses them.
            ``reset()`` replaces them. Calls with the same ``T`` return the
            same tensors, and a call on them is recognized as such, not
            checked: do not change their metadata in place (``unsqueeze_``,
            ``resize_``, ``as_strided_``).
        """
        with self._lock.for_caller():
            if self._lazy and self._static is None:
                with self._on_device():
                    self._setup()
            static = self._static
            if (not self._captured and not self._lazy) or static is None:
                raise ReplayError(f"GraphRunner({self.name}) is not captured: call runner.capture() first")
            handed = self._handed.get(T)
            if handed is not None:
                return handed
            n = pick_bucket(self._buckets_list, T)
            if T < 1 or n is None:
                raise ValueError(f"GraphRunner({self.name}): no bucket holds T={T} rows (ladder {self._buckets_list})")
            views = static.views(n)
            handed = tuple(
                views[s.index].narrow(s.pad_dim, 0, T) if s.kind == PADDED else views[s.index] for s in static.specs
            )
            if len(self._handed) >= _HANDED_KEPT:
                self._handed.clear()
                self._handed_ids.clear()
            self._handed[T] = handed
            self._handed_ids[id(handed[self._first_padded])] = (T, n, handed)  # held: the id stays unique
            return handed

    def bucket_outputs(self, bucket: int) -> Any:
        """The full, unsliced outputs of ``bucket``'s last run (padded rows included); valid until the next call.
        Before the bucket's first call they hold no result (the capture does not run the forward's end)."""
        b = self._buckets.get(bucket)
        if b is None or b.leaves is None:
            raise KeyError(f"bucket {bucket} has no outputs (not captured, or not run yet in eager mode)")
        return pytree.tree_unflatten(list(b.leaves), b.spec)

    def pool(self) -> PoolHandle:
        """The private pool the buckets' graphs live in (a lazy runner's first bucket, until the next
        capture, in one of its own); pass it as ``pool=`` to share it."""
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
        leases = [b.own_pool for b in [*self._buckets.values(), *self._retired]]  # (read once: a capture may clear one)
        own = [lease.pool for lease in leases if lease is not None]
        return sum(pool_bytes(pool, self._device.index) for pool in [self._pool, *own])

    def stats(self) -> dict[str, Any]:
        """Counters and sizes.

        ``capture_s`` ({bucket: seconds, warm-up included}), ``capture_total_s``,
        ``captures`` ({trigger: buckets captured by it}: ``"capture()"``, ``"lazy"``,
        ``"background"``), ``capturing`` (a background capture runs now),
        ``pool_bytes`` (the shared pool: every bucket, and any other runner
        sharing it; a lazy runner's first bucket's own pool too), ``largest_alone_pool_bytes`` and ``pool_ratio`` (after
        :meth:`measure_largest_alone`), ``fallbacks`` ({reason: calls run
        eagerly}), ``replays`` ({bucket: calls}), ``calls``, ``graph_calls``,
        ``padding_ratio`` (padded rows / bucket rows over graph calls),
        ``captured_buckets``, ``failed_buckets``, ``mode``, ``buckets``;
        ``inline_replays`` (graph calls whose staged breakpoints ran inline),
        ``tier_replays`` (those of them that ran a staged tier, see
        :class:`bcg.StagedTiers`) and ``staged_fallbacks`` ({reason: graph
        calls that ran the breakable form}); ``variants`` (keyed breakpoints,
        over every bucket's graph: ``hits`` and ``misses`` (step calls),
        ``hit_rate``, ``captures``, ``stitched_replays``, ``evictions``,
        ``cache_bytes`` (variant pools and stitched executables) and
        ``buckets`` ({bucket: {form: :meth:`bcg.keyed.variants.VariantCache.stats`}});
        None without keyed breakpoints).

        .. warning::
            Not for every call: ``pool_bytes`` reads ``torch.cuda.memory_snapshot()``,
            which takes milliseconds over a large heap and holds the allocator's
            lock meanwhile. Poll a background capture with ``wait_captured(0)``.
        """
        pool = self._pool_bytes()
        alone = self._largest_alone
        staged = [st.staged for x in self._buckets.values() if x.graph is not None
                  for st in (x.graph.stats(),) if st.staged is not None]
        graph_calls = sum(x.replays for x in self._buckets.values())
        padded_rows = sum(x.size * x.replays for x in self._buckets.values())
        staged_fallbacks: dict[str, int] = {}
        for st in staged:
            for reason, count in st.breakable_replays.items():
                staged_fallbacks[reason] = staged_fallbacks.get(reason, 0) + count
        return {
            "mode": self._mode,
            "buckets": list(self._buckets_list),
            "captured_buckets": self.captured_buckets,
            "failed_buckets": self.failed_buckets,
            "capture_s": {b: x.capture_s for b, x in self._buckets.items() if x.captured or x.failure},
            "captures": {trigger: sum(1 for x in self._buckets.values() if x.captured and x.trigger == trigger)
                         for trigger in ("capture()", "lazy", "background")},
            "capturing": self._capturing_in_background(),
            "capture_total_s": self._capture_total_s,
            "pool_bytes": pool,
            "largest_alone_pool_bytes": alone,
            "pool_ratio": pool / alone if alone else None,
            "calls": graph_calls + sum(self._fallbacks.values()),
            "graph_calls": graph_calls,
            "replays": {b: x.replays for b, x in self._buckets.items()},
            "fallbacks": dict(self._fallbacks),
            "padding_ratio": 1 - self._real_rows / padded_rows if padded_rows else 0.0,
            "inline_replays": sum(st.inline_replays for st in staged),
            "tier_replays": sum(sum(st.replays[:-1]) for st in staged),
            "staged_fallbacks": staged_fallbacks,
            "variants": self._variant_stats(),
        }

    def _variant_stats(self) -> dict[str, Any] | None:
        per_bucket: dict[int, dict[str, Any]] = {}
        caches = []
        for b, x in self._buckets.items():
            keyed = x.graph.stats().keyed if x.graph is not None else None
            if keyed:
                per_bucket[b] = keyed
                caches.extend(keyed.values())
        if not caches:
            return None
        totals = {"hits": 0, "misses": 0, "captures": 0}
        for st in caches:
            for bp in st["breakpoints"].values():
                for k in totals:
                    totals[k] += bp[k]
        calls = totals["hits"] + totals["misses"]
        return {
            **totals,
            "hit_rate": totals["hits"] / calls if calls else None,
            "stitched_replays": sum(st["stitched_replays"] for st in caches),
            "evictions": sum(st["evictions"] for st in caches),
            "cache_bytes": sum(st["variant_bytes"] + (st["stitched"] or {}).get("bytes", 0) for st in caches),
            "buckets": per_bucket,
        }

    # -- release ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Free every bucket's graph, the static buffers and counters; ``capture()`` again to reuse.

        A background capture is stopped first (after the bucket it is capturing)."""
        thread = self._background
        if thread is not None:
            self._refuse_join_under_lock(thread, "reset()")
            self._stop_background.set()
            thread.join()
        self._background, self._background_error = None, None
        with self._lock.lock:
            for bucket in self._buckets.values():
                bucket.free_graphs()
            self._free_retired()
            if self._lease is not None:
                self._lease.release()
                self._lease = None
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
