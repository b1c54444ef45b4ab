"""``bcg.GraphRunner``: one breakable graph per bucket size, padded inputs, one shared memory pool.

This file is the runner's face and its calls: construction, a call's way to a bucket's graph (or
to ``forward`` run eagerly, with the reason), its outputs, inspection and reset. The buckets and
how each is captured are :mod:`bcg.runner.ladder`'s; when they are captured,
:mod:`bcg.runner.schedule`'s. How a call runs, fallbacks, output lifetimes and threading:
``docs/runner.md``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from bcg.core.breakpoint import UNSET, live_scope
from bcg.core.debug import Debug
from bcg.core.pool import PoolHandle
from bcg.core.process import release_when_safe
from bcg.core.torch_internals import pytree, stream_readers
from bcg.distributed.agreement import RankAgreement, checked_call, replay_on_ranks
from bcg.errors import NoFormFitsError, ReplayError
from bcg.graph import BreakableGraph
from bcg.keyed.variants import VariantPolicy
from bcg.runner.arguments import check_runner_arguments
from bcg.runner.buckets import default_buckets, normalize_buckets, pick_bucket, too_padded
from bcg.runner.inputs import HandedInputs, check_inputs, describe_inputs, padded_device
from bcg.runner.ladder import Ladder
from bcg.runner.native_call import native_call
from bcg.runner.pool_lock import POOL_LOCKS, PoolCallLock
from bcg.runner.sanitizer import PADDING, CrossingRecorder
from bcg.runner.schedule import CaptureSchedule
from bcg.runner.stats import runner_stats

log = logging.getLogger("bcg")

#: The reasons a call runs ``forward`` eagerly instead of replaying a graph (``"not_captured_yet"``:
#: ``lazy=True``, the call's bucket is captured right after it; or a background capture has not
#: reached it yet. ``"capture_busy"``: its bucket is captured, but a background capture holds the
#: call lock for another bucket, which the replay would wait for. ``"staged_unfit"``: the call's live
#: metadata fits none of the bucket's staged forms, and it has no breakable form: ``StagedTiers(breakable=False)``).
FALLBACK_REASONS = ("too_large", "padding_waste", "capture_failed", "not_captured_yet", "capture_busy", "staged_unfit")

#: A call's route in :meth:`bcg.distributed.RankAgreement.expect_same` checks (the key names the
#: codes, for its error message): k >= 0 the bucket graph's form k (:meth:`BreakableGraph.choose`),
#: -2 - i eager for ``FALLBACK_REASONS[i]``, and ``_RAISED``.
_RAISED = -100
_ROUTE = "route (k >= 0 form k, {}, {} raised)".format(
    ", ".join(f"{-2 - i} {reason}" for i, reason in enumerate(FALLBACK_REASONS)), _RAISED
)

_current_device = stream_readers()[0]



class GraphRunner:
    """Run ``forward`` through one captured :class:`bcg.BreakableGraph` per bucket size.

    A call with ``T`` rows runs the graph of the smallest bucket ``>= T`` on
    its inputs padded to that bucket, and returns the outputs' first ``T``
    rows. ``docs/runner.md`` says how a call runs: fallbacks, padded-row
    sanitizing, output lifetimes and thread safety.

    Arguments:
        forward: the function, called as ``forward(*inputs)``.
        buckets: the sizes to capture (default :func:`bcg.runner.default_buckets`).
        example_inputs: a tuple of ``forward``'s inputs, which warm-ups and captures run on.
            Non-tensor inputs are frozen: calls pass values equal to the example's.
        pad_dim: the dim tensor inputs are padded along: an int for all of them, or one
            entry per input, ``None`` for a tensor that is not bucketed (a KV cache,
            which the graphs read in place: calls pass that same tensor).
        live: what :func:`bcg.live` returns during each bucket's warm-up and capture, as
            in :class:`bcg.capture`; a callable is called with the bucket size. Give a
            callable whenever live metadata depends on the size (request lengths do):
            ``forward`` also runs once at another size (a probe run) to learn which dims
            grow with the size. It may return a :class:`bcg.StagedTiers`: the bucket then
            also gets one form per earlier value, for calls whose metadata fits smaller
            static bounds.
        pool, stream, capture_error_mode, variants, debug: as in :class:`bcg.capture`
            (``pool=other.pool()`` shares another runner's pool; each bucket's graph keeps
            its own keyed variants).
        mode: ``"graph"``, or ``"eager"`` (same buckets, padding and slicing, no graphs;
            the fallback where CUDA is not available).
        lazy: ``capture()`` becomes optional: a call whose bucket is not captured runs
            ``forward`` eagerly, then captures that bucket before it returns. An int ``k``:
            a bucket's first ``k - 1`` calls only run eagerly, the ``k``-th also captures it
            (``True`` is 1), so sizes seen fewer than ``k`` times get no graph.
        max_padding_ratio: run eagerly when ``(bucket - T) / bucket`` exceeds it (default
            ``None``: never).
        copy_outputs: ``True`` returns copies, ``False`` views valid until the next call or capture,
            ``None`` (default) views while one thread calls and copies once several do
            (see :meth:`locked`).
        sanitize: zero the padded rows of inputs and of tensors crossing breakpoints
            inside the graph (default); ``False`` zeroes only the inputs' tails.
        progress: show a tqdm bar while :meth:`capture` captures.
        name: for logs and errors (default: ``forward``'s name).
        ranks: a :class:`bcg.distributed.RankAgreement` (multi-GPU): the ranks vote
            through each bucket's capture, and each call picks the bucket of the largest
            ``T`` of all ranks and one form of replay for all (see :meth:`__call__`).
            Every rank makes the same calls in the same order.

    A wrong argument raises ``TypeError`` or ``ValueError`` naming it, before anything is built.
    """

    def __init__(
        self, forward: Callable[..., Any], buckets: Sequence[int] | None = None, *,
        example_inputs: Sequence[Any], pad_dim: int | Sequence[int | None] = 0, live: Any = UNSET,
        pool: PoolHandle | None = None, stream: torch.cuda.Stream | None = None, capture_error_mode: str = "global",
        variants: VariantPolicy | None = None, debug: Debug | None = None, mode: str = "graph",
        lazy: bool | int = False, max_padding_ratio: float | None = None, copy_outputs: bool | None = None,
        sanitize: bool = True, progress: bool = True, name: str | None = None, ranks: RankAgreement | None = None,
    ) -> None:
        check_runner_arguments(forward, buckets, example_inputs, pad_dim, mode, max_padding_ratio, copy_outputs,
                               sanitize, pool, stream, capture_error_mode, progress, name, variants, debug, ranks,
                               lazy)
        self._forward = forward
        self.name = name or getattr(forward, "__qualname__", type(forward).__name__)
        self._inputs = describe_inputs(tuple(example_inputs), pad_dim)
        self._first_padded, self._device = padded_device(self._inputs)
        if mode == "graph" and (self._device.type != "cuda" or not torch.cuda.is_available()):
            why = "CUDA is not available" if not torch.cuda.is_available() else f"the inputs are on {self._device}"
            warnings.warn(
                f"bcg.GraphRunner: {why}, falling back to mode='eager' (same buckets, padding and "
                "slicing; forward runs eagerly at every call, no CUDA graphs)",
                RuntimeWarning,
                stacklevel=2,
            )
            mode = "eager"
        self._max_padding_ratio = max_padding_ratio
        self._copy_outputs = copy_outputs
        self._ranks = ranks
        self._lock = POOL_LOCKS.for_pool(pool, PoolCallLock()) if pool is not None else PoolCallLock()
        sizes = normalize_buckets(default_buckets() if buckets is None else buckets)
        self._ladder = Ladder(forward, self.name, sizes, self._inputs, self._device, self._lock, mode=mode,
                              live=live, sanitize=sanitize, pool=pool, stream=stream,
                              capture_error_mode=capture_error_mode, variants=variants, debug=debug, ranks=ranks)
        self._schedule = CaptureSchedule(self._ladder, self._lock, lazy=int(lazy), progress=progress)
        self._counts_lock = threading.Lock()  # fallbacks are counted by calls outside the call lock too
        self._clear_counts()

    def _clear_counts(self) -> None:
        self._real_rows = 0  # (calls, graph calls and padded rows: from the buckets' replays, in stats())
        self._fallbacks = dict.fromkeys(FALLBACK_REASONS, 0)
        self._handed = HandedInputs(self._first_padded)  # input_buffers(T), as handed out
        self._native: Any = None  # the call in C (runner.native_call); None: built at the next call

    # -- capture ------------------------------------------------------------------------------
    def capture(self, background: bool = False) -> GraphRunner:
        """Warm up and capture every bucket, largest first, into one pool on one capture stream.

        Shows a tqdm progress bar (``progress=False`` hides it), records
        per-bucket seconds (``stats()["capture_s"]``), logs the total and the
        pool size. A bucket whose warm-up or capture raises is logged and its
        calls run eagerly (fallback ``capture_failed``). In eager mode each
        bucket is run once instead. With ``lazy=True``, captures the buckets
        that calls have not captured yet, and the first lazy bucket again, into
        the runner's pool. Returns the runner.

        Arguments:
            background: return at once and capture on a thread of its own
                (:meth:`wait_captured` waits for it). Calls are served
                meanwhile: eagerly (fallback ``"not_captured_yet"``) while
                their bucket is not captured, by its graph once it is. Each
                bucket's warm-up and capture hold the call lock (they write the
                static inputs and the pool that replays use), so a call that
                needs them waits for at most one bucket; a call running eagerly
                on inputs of its own does not wait. While calls come, the
                capture waits between buckets (calls get most of the time), so
                the ladder takes longer under load. The captures use
                ``capture_error_mode="thread_local"`` whatever the runner's.

        .. warning::
            While a background capture runs, code on other threads must not
            synchronize the whole device (``torch.cuda.synchronize()``): CUDA
            refuses that during any capture. Synchronize streams or events.
            Nor draw random numbers from the default CUDA generator, which torch
            marks as capturing during every capture: use a ``torch.Generator``
            of your own.
        """
        self._schedule.capture(background)
        return self

    def wait_captured(self, timeout: float | None = None) -> bool:
        """Wait for a background capture (:meth:`capture` with ``background=True``) to finish.

        Returns ``False`` when ``timeout`` (seconds) passed first, ``True`` otherwise (also
        when none runs).

        Raises:
            BcgError: the background capture stopped on an error (the error is its cause).
        """
        return self._schedule.wait(timeout)

    def measure_largest_alone(self) -> int:
        """Capture the largest bucket alone in a fresh pool and return that pool's bytes.

        The graph is freed right after; the figure lands in
        ``stats()["largest_alone_pool_bytes"]`` and ``stats()["pool_ratio"]``
        (all buckets' shared pool / this), whose target is <= 1.1. Graph mode
        only (0 in eager mode). Capture the runner first so the shapes used
        to sanitize are known, or a probe run is made.
        """
        ladder = self._ladder
        if ladder.mode != "graph":
            ladder.largest_alone = 0
            return 0
        with self._lock.lock, ladder.capturing(), ladder.on_device(), self._schedule.ordered_with_calls():
            size = ladder.measure_largest_alone()
        log.info("bcg.GraphRunner(%s): pool of all buckets %.1f MiB, largest bucket (%d) alone %.1f MiB",
                 self.name, ladder.pool_bytes() / 2**20, ladder.sizes[-1], size / 2**20)
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
        try:
            if bucket is None:  # a call on input_buffers(T) that nothing holds up: all of it in C
                if self._native is None:
                    self._native = native_call(self, self._handed, self._ladder, self._schedule, self._lock,
                                               self._device.index or 0, self._copy_outputs, self._max_padding_ratio,
                                               self._ranks)
                if self._native and (out := self._native.call(inputs, live)) is not NotImplemented:
                    return out
            if self._lock.background:  # a background capture of the pool runs: it yields to calls
                with self._lock.serving():
                    schedule = self._schedule
                    # (not on the runner's own buffers, which a capture rewrites)
                    if bucket is None and self._ranks is None and schedule.may_serve_eagerly() \
                            and not self._handed.owns(inputs):
                        n = pick_bucket(self._ladder.sizes, check_inputs(self._inputs, inputs, self.name))
                        reason = schedule.eager_reason(self._ladder.buckets[n] if n is not None else None)
                        if reason is not None:
                            return self._fallback(reason, inputs, live, None)
                    return self._locked_call(inputs, live, bucket)
            return self._locked_call(inputs, live, bucket)
        except NoFormFitsError:  # chosen before any launch (StagedTiers(breakable=False))
            with self._lock.for_caller():  # (the eager run reads the static inputs the next call writes)
                self._after_last_call(self._handed.owns(inputs))
                return self._fallback("staged_unfit", inputs, live, None)

    def _locked_call(self, inputs: tuple[Any, ...], live: Any, bucket: int | None) -> Any:
        with self._lock.for_caller():
            if self._ladder.kept_own_pools:
                self._ladder.free_kept_own_pools()
            if not self._schedule.serving:
                if not self._schedule.lazy:
                    raise ReplayError(f"GraphRunner({self.name}) is not captured: call runner.capture() first")
                with self._ladder.on_device():
                    self._ladder.setup()  # (lazy: buckets are captured by the calls that need them)
                self._schedule.serving = True
            ranks = self._ranks
            if ranks is None or not ranks.same_inputs:
                return self._call(inputs, live, bucket, None)
            return checked_call(ranks, lambda choice: self._call(inputs, live, bucket, choice), {_ROUTE: _RAISED})

    def _after_last_call(self, on_own_buffers: bool) -> None:
        """Before an eager run on the runner's own buffers (``input_buffers``), under the call lock:
        order it after the last call's work on them, on whatever stream that ran."""
        if on_own_buffers and self._ladder.mode == "graph":
            self._lock.serialize_streams(self._device.index or 0)

    def _call(self, inputs: tuple[Any, ...], live: Any, bucket: int | None, choice: dict[str, int] | None) -> Any:
        """One call, under the call lock; ``choice`` (same inputs only) records what it chose."""
        ranks = self._ranks
        agree = ranks if ranks is not None and not ranks.same_inputs else None  # before every launch
        handed = self._handed.recognize(inputs)  # (T, bucket) of input_buffers(T) itself: valid as made
        T = handed[0] if handed is not None else check_inputs(self._inputs, inputs, self.name)
        if choice is not None:
            choice["call T"] = T
        T_all = agree.max([T])[0] if agree is not None else T  # (every rank judges the padding alike)
        if bucket is not None:
            if bucket not in self._ladder.buckets or bucket < T:
                raise ValueError(
                    f"GraphRunner({self.name}): bucket={bucket} is not a bucket of the ladder "
                    f"{self._ladder.sizes} at least T={T}"
                )
            n: int | None = bucket
        elif handed is not None and agree is None:
            n = handed[1]  # the bucket input_buffers(T) picked for T
        else:
            n = pick_bucket(self._ladder.sizes, T_all)
        if choice is not None:
            choice["bucket"] = n or 0
        if n is None:
            return self._fallback("too_large", inputs, live, choice)
        chosen = self._ladder.buckets[n]
        if chosen.failure is not None:
            self._after_last_call(handed is not None)
            return self._fallback("capture_failed", inputs, live, choice)
        if not chosen.captured:  # lazy=True, or a background capture: this call runs eagerly
            self._after_last_call(handed is not None)
            lazy = self._schedule.lazy and not self._schedule.in_background  # (else the background thread captures)
            # The first call's run, watched, tells the first capture which dims grow with the size
            # (as a probe run would; not with ranks, whose calls' T differ: all ranks probe alike)
            observe = lazy and self._ranks is None and 1 < T != n and not self._ladder.shapes_known
            out = self._fallback("not_captured_yet", inputs, live, choice, observe_at=T if observe else None)
            if lazy:
                self._schedule.capture_after_call(chosen)
            return out
        if too_padded(n, T_all, self._max_padding_ratio):
            self._after_last_call(handed is not None)
            return self._fallback("padding_waste", inputs, live, choice)
        static, sanitizer = self._ladder.static, self._ladder.sanitizer
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
        elif self._device.type == "cuda":  # eager mode on a GPU: its runs read the static inputs too
            self._lock.serialize_streams(self._device.index or 0)
        if handed is not None and handed[1] == n:
            if not self._ladder.sanitize:
                static.zero_tails(chosen.views, T)  # (the rows before T are the call's own)
        else:
            static.write(chosen.views, inputs, T, zero_tail=not self._ladder.sanitize, stream=stream)
        if self._ladder.sanitize:
            sanitizer.set_rows(T, stream)  # every call (written if it changed): a stitched launch runs the zeroing too
        if graph is not None:
            if self._ladder.sanitize:
                graph.set_enabled(PADDING, T < n)  # nothing padded: skip the zeroing nodes
            if ranks is None:
                graph.replay(live)
            else:
                route = replay_on_ranks(ranks, graph, live)
            leaves = chosen.leaves
        else:
            hook = sanitizer.hook(n)
            recorder = CrossingRecorder((lambda ts, br: hook(ts)) if hook is not None else None)
            leaves, _ = pytree.tree_flatten(self._ladder.run_eager(n, chosen.views, live, recorder))
            chosen.leaves = leaves
        chosen.replays += 1
        self._real_rows += T
        if choice is not None:
            choice[_ROUTE] = route
        assert leaves is not None
        copy = self._copy_outputs
        if copy is None:
            copy = not self._lock.views_safe()
        return chosen.slice(leaves, T, copy, keep=graph is not None)

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
            out = self._ladder.run_observed(observe_at, inputs, live)
        if choice is not None:
            choice[_ROUTE] = -2 - FALLBACK_REASONS.index(reason)
        return out

    # -- inspection ------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        """``"graph"`` or ``"eager"`` (after any automatic fallback)."""
        return self._ladder.mode

    @property
    def buckets(self) -> list[int]:
        """The bucket ladder, ascending."""
        return list(self._ladder.sizes)

    @property
    def is_captured(self) -> bool:
        return self._schedule.serving

    @property
    def captured_buckets(self) -> list[int]:
        return [b for b in self._ladder.sizes if self._ladder.buckets[b].captured]

    @property
    def failed_buckets(self) -> dict[int, str]:
        """Bucket -> ``"ExceptionType: message"`` for buckets whose capture raised."""
        return {b: x.failure for b, x in self._ladder.buckets.items() if x.failure is not None}

    def bucket_for(self, T: int) -> int | None:
        """The bucket a call with ``T`` rows maps to (``None``: above the ladder), before fallbacks."""
        return pick_bucket(self._ladder.sizes, T)

    def graph(self, bucket: int) -> BreakableGraph:
        """The captured graph of ``bucket`` (graph mode)."""
        b = self._ladder.buckets.get(bucket)
        if b is None or b.graph is None:
            why = (f"it is not a bucket of {self._ladder.sizes}" if b is None
                   else "this runner runs in eager mode (no CUDA, or mode='eager'): graphs need mode='graph' on a GPU"
                   if self.mode == "eager"
                   else "it is not captured (yet, or its capture failed: see stats()['failed_buckets'])")
            raise KeyError(f"GraphRunner({self.name}): no captured graph for bucket {bucket}: {why}")
        return b.graph

    def input_buffers(self, T: int) -> tuple[Any, ...]:
        """Inputs for a call with ``T`` rows that the call does not copy: the first ``T`` rows of
        the static inputs of ``T``'s bucket (by-reference and value inputs as given).

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
            if self._schedule.lazy and self._ladder.static is None:
                with self._ladder.on_device():
                    self._ladder.setup()
            static = self._ladder.static
            if (not self._schedule.serving and not self._schedule.lazy) or static is None:
                raise ReplayError(f"GraphRunner({self.name}) is not captured: call runner.capture() first")
            handed = self._handed.get(T)
            if handed is not None:
                return handed
            n = pick_bucket(self._ladder.sizes, T)
            if T < 1 or n is None:
                raise ValueError(f"GraphRunner({self.name}): no bucket holds T={T} rows (ladder {self._ladder.sizes})")
            return self._handed.add(T, n, static.call_inputs(n, T))

    def bucket_outputs(self, bucket: int) -> Any:
        """The full, unsliced outputs of ``bucket``'s last run (padded rows included); valid until the next call.
        Before the bucket's first call they hold no result (the capture does not run the forward's end)."""
        b = self._ladder.buckets.get(bucket)
        if b is None or b.leaves is None:
            raise KeyError(f"bucket {bucket} has no outputs (not captured, or not run yet in eager mode)")
        return b.unflatten(b.leaves)

    def pool(self) -> PoolHandle:
        """The private pool the buckets' graphs live in (a lazy runner's first bucket, until the next
        capture, in one of its own); pass it as ``pool=`` to share it."""
        if self._ladder.pool is None:
            raise ReplayError("this GraphRunner has no pool yet: capture it first (graph mode)")
        return self._ladder.pool

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The capture stream (graph mode, after capture)."""
        return self._ladder.stream

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
        return runner_stats(self._ladder, self._schedule.in_background, self._fallbacks, self._real_rows)

    # -- release ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Free every bucket's graph, the static inputs and counters; ``capture()`` again to reuse.

        A background capture is stopped first (after the bucket it is capturing)."""
        self._schedule.stop()
        with self._lock.lock:
            self._ladder.free()
            self._clear_counts()
        if torch.cuda.is_initialized():
            release_when_safe(torch.cuda.empty_cache)  # the pool's blocks and the static inputs go back

    def __enter__(self) -> GraphRunner:
        if not self._schedule.serving:
            self.capture()
        return self

    def __exit__(self, *exc: object) -> None:
        self.reset()

    def __repr__(self) -> str:
        state = "captured" if self._schedule.serving else "not captured"
        return (
            f"GraphRunner({self.name}, mode={self.mode}, {state}, buckets={self._ladder.sizes}, "
            f"failed={sorted(self.failed_buckets)})"
        )
