"""A runner's ladder: its buckets, their graphs in one pool, and how one bucket is captured.

Per bucket: a warm-up run (which also records how to sanitize padded rows), the
capture of its graph's first form, its breakable form (staged breakpoints),
its staged tiers, and how its outputs are sliced to a call's ``T``. A probe
run at another size first tells which output dims grow with the size. When
buckets are captured (now, lazily, in the background) is
:mod:`bcg.runner.schedule`'s decision; calls are :mod:`bcg.runner.graph_runner`'s.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from bcg.capture import capture_into
from bcg.core.breakpoint import recording
from bcg.core.debug import Debug
from bcg.core.pool import PoolHandle, PoolLease, PoolMembership, graph_pool_handle, pool_bytes
from bcg.core.process import capture_lock, capture_stream, release_when_safe
from bcg.core.session import CaptureOptions
from bcg.core.torch_internals import pytree
from bcg.distributed.agreement import CaptureVote, RankAgreement
from bcg.errors import CaptureError
from bcg.form import copy_outputs_into
from bcg.graph import BreakableGraph
from bcg.keyed.variants import VariantPolicy
from bcg.runner.inputs import InputSpec, StaticInputs
from bcg.runner.pool_lock import POOL_LOCKS, PoolCallLock
from bcg.runner.sanitizer import PADDING, CrossingRecorder, PaddingSanitizer, scaling_dims
from bcg.runner.tiers import keep_faster_tiers
from bcg.staged.staging import StagedTiers, StagedWarmup

log = logging.getLogger("bcg")

#: What captured a bucket (``stats()["captures"]``): ``GraphRunner.capture()``, a call (``lazy=True``),
#: or a background capture.
TRIGGERS = ("capture()", "lazy", "background")

_SLICED_KEPT = 64  # distinct T per bucket whose output views are kept


@dataclass(eq=False)
class Bucket:
    """One bucket of the ladder: its graph, its static outputs and how a call slices them."""

    size: int
    views: list[Any] = field(default_factory=list)  # the static inputs forward runs on at this size
    graph: BreakableGraph | None = None
    leaves: list[Any] | None = None  # graph mode: the static outputs; eager mode: the last outputs
    spec: Any = None
    single: bool = False
    slice_dims: list[tuple[int, ...]] = field(default_factory=list)
    failure: str | None = None
    captured: bool = False
    trigger: str | None = None  # one of TRIGGERS: what first captured it
    # A lazy runner's first bucket, when it is not the largest, is captured into a pool of its
    # own (this lease): the runner's pool is laid out for the largest bucket at the next capture,
    # which captures this bucket again there (see bcg.runner.schedule).
    own_pool: PoolLease | None = None
    capture_s: float = 0.0
    replays: int = 0
    eager_calls: int = 0  # lazy: calls that ran eagerly since it was last captured or freed
    sliced: dict[int, list[Any]] = field(default_factory=dict)  # graph mode: T -> the leaves' views

    def slice(self, leaves: list[Any], T: int, copy: bool, keep: bool) -> Any:
        """The outputs (``leaves``) cut to a call's ``T`` rows: views (kept per ``T`` when ``keep``:
        the graph's static outputs), or copies."""
        views = self.sliced.get(T) if keep else None
        if views is None:
            views = []
            for leaf, dims in zip(leaves, self.slice_dims):
                for d in dims:
                    leaf = leaf.narrow(d, 0, T)
                views.append(leaf)
            if keep:
                if len(self.sliced) >= _SLICED_KEPT:
                    self.sliced.clear()
                self.sliced[T] = views
        if copy:
            views = [v.clone(memory_format=torch.contiguous_format) if isinstance(v, torch.Tensor) else v
                     for v in views]
        return views[0] if self.single else self.unflatten(views)

    def unflatten(self, leaves: list[Any]) -> Any:
        """``leaves`` in the structure ``forward`` returns."""
        return pytree.tree_unflatten(list(leaves), self.spec)

    @property
    def done(self) -> bool:
        """Captured into the runner's pool, or failed: no capture is due."""
        return (self.captured and self.own_pool is None) or self.failure is not None

    def free_graphs(self) -> None:
        """Reset and drop the bucket's graph (its pool memory returns), and forget the outputs and
        output views that lived there."""
        self.leaves = None
        self.sliced.clear()
        self.eager_calls = 0
        if self.graph is not None:
            self.graph.reset()
            self.graph = None
        if self.own_pool is not None:
            self.own_pool.release()
            self.own_pool = None
            release_when_safe(torch.cuda.empty_cache)  # the pool's blocks go back to the driver


@dataclass(frozen=True)
class BucketLives:
    """What ``live`` gives one bucket at its capture, asked once: ``values``, its staged tiers'
    (if any) and its own last; ``breakable``, whether its staged graph gets a breakable form
    (always with ranks)."""

    values: tuple[Any, ...]
    breakable: bool

    @property
    def own(self) -> Any:
        return self.values[-1]

    @property
    def tiers(self) -> tuple[Any, ...]:
        return self.values[:-1]


class Ladder:
    """The buckets of a :class:`bcg.GraphRunner`, captured into one pool on one capture stream.

    Arguments:
        forward: the runner's function.
        sizes: the bucket sizes, ascending.
        inputs: what each position of the example inputs requires.
        device: the padded inputs' device.
        mode: ``"graph"`` or ``"eager"`` (each bucket is run instead of captured).
        live: what :func:`bcg.live` returns during each bucket's warm-up and
            capture (a callable is called with the size; a :class:`bcg.StagedTiers`
            adds staged tiers).
        lock: the call lock of the pool (registered as the new pool's, when the
            ladder makes one).
        sanitize, pool, stream, capture_error_mode, variants, debug, ranks: as in
            :class:`bcg.GraphRunner`.
    """

    def __init__(self, forward: Callable[..., Any], name: str, sizes: list[int], inputs: list[InputSpec],
                 device: torch.device, lock: PoolCallLock, *, mode: str, live: Any, sanitize: bool,
                 pool: PoolHandle | None,
                 stream: torch.cuda.Stream | None, capture_error_mode: str, variants: VariantPolicy | None,
                 debug: Debug | None, ranks: RankAgreement | None) -> None:
        self._forward = forward
        self.name = name
        self.sizes = sizes
        self.inputs = inputs
        self.device = device
        self.mode = mode
        self._live = live
        self.sanitize = sanitize
        self.user_pool = pool
        self._lock = lock
        self.pool: PoolHandle | None = pool
        self.stream = stream
        self.capture_error_mode = capture_error_mode
        self._variants = variants
        self._debug = debug
        self.ranks = ranks
        self._lease: PoolLease | None = None  # the runner's pool lease
        self._barrier: Callable[[], None] | None = None  # the open bucket's CaptureVote.barrier
        self.largest_alone: int | None = None
        self.clear()

    def clear(self) -> None:
        """Forget every bucket and run (the graphs must have been freed)."""
        self.buckets = {b: Bucket(b) for b in self.sizes}
        self.kept_own_pools: list[Bucket] = []  # own pools (and graphs) taken from buckets: freed at the next call
        self.capture_total_s = 0.0
        self._out_shapes: dict[int, tuple[Any, list[tuple[int, ...] | None]]] = {}
        self.probe_size = self._choose_probe_size()
        self._rows = max(self.sizes[-1], self.probe_size)
        self.static: StaticInputs | None = None
        self.sanitizer: PaddingSanitizer | None = None
        # A warm-up drew random numbers (the default generator moved): captures then run the
        # forward's last segment, the only way bcg learns whether that segment uses RNG.
        self.draws_rng: bool | None = None  # None: no warm-up has told yet (graph mode)

    def _choose_probe_size(self) -> int:
        """A second size to run once, so the first bucket captured knows which dims grow with the size."""
        biggest = self.sizes[-1]
        for b in self.sizes:
            if 1 < b < biggest:
                return b
        return biggest // 2 if biggest > 2 else biggest + 1

    # -- set-up ------------------------------------------------------------------------------
    def on_device(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.device(self.device) if self.mode == "graph" else contextlib.nullcontext()

    def capturing(self) -> contextlib.AbstractContextManager[Any]:
        """Graph mode: the process's capture lock, held across warm-ups and captures, which share
        the capture stream (another thread's capture must not record the warm-ups)."""
        return capture_lock() if self.mode == "graph" else contextlib.nullcontext()

    def setup(self) -> tuple[StaticInputs, PaddingSanitizer]:
        """The static inputs and the sanitizer; in graph mode also the pool, its lease and the stream."""
        if self.static is None or self.sanitizer is None:
            self.static = StaticInputs(self.inputs, self._rows, self.device)
            self.sanitizer = PaddingSanitizer(self.static, self._rows, self.device, self.sanitize)
        if self.mode == "graph":
            if self.pool is None:
                self.pool = graph_pool_handle()
                POOL_LOCKS.for_pool(self.pool, self._lock)  # (a new pool: runners sharing it find this lock)
            if self.stream is None:
                self.stream = capture_stream(self.device.index or 0)
            if self._lease is None:  # the pool outlives any one bucket's graph, failed ones too
                self._lease = PoolLease(self.device.index or 0, self.pool, self.stream,
                                        owner=f"the graphs of bcg.GraphRunner({self.name})")
        return self.static, self.sanitizer

    def _live_value(self, n: int) -> Any:
        """What ``live`` gives bucket ``n`` (UNSET, a value, or :class:`bcg.StagedTiers`)."""
        live = self._live
        return live(n) if callable(live) else live

    def _lives_for(self, n: int) -> BucketLives:
        """What ``live`` gives size ``n``, asked once (a capture runs every form on these values)."""
        live = self._live_value(n)
        if isinstance(live, StagedTiers):
            return BucketLives(tuple(live), self.ranks is not None or live.breakable)
        return BucketLives((live,), True)

    # -- runs --------------------------------------------------------------------------------
    def padded_forward(self, n: int, views: list[Any]) -> Any:
        """``forward`` on the size-``n`` static inputs; first (if sanitizing) zero rows ``>= T``."""
        assert self.sanitizer is not None
        self.sanitizer.zero_inputs(n, views)
        return self._forward(*views)

    def run_eager(self, n: int, views: list[Any], live: Any, recorder: CrossingRecorder) -> Any:
        """Run the padded forward eagerly at size ``n`` with ``recorder`` handling breakpoints."""
        with recording(recorder, live), torch.no_grad():
            return self.padded_forward(n, views)

    def run_recorded(self, n: int, observe: bool = False, lives: BucketLives | None = None) -> Any:
        """A warm-up (or probe) run at size ``n`` on example data: records how to sanitize, and shapes.

        ``observe``: staged breakpoints run their breakable form (a probe run that only tells
        which dims grow: see :class:`CrossingRecorder`). ``lives``: what ``live`` gave ``n``
        (default: asked now); the run takes the bucket's own."""
        static, sanitizer = self.setup()
        views = static.load_example(n)
        sanitizer.set_rows(n)
        live = (lives if lives is not None else self._lives_for(n)).own
        generator = torch.cuda.default_generators[self.device.index or 0] if self.mode == "graph" else None
        offset = generator.get_offset() if generator is not None else 0
        with self.recording(n, observe) as recorder:
            with self._on_capture_stream() if self.mode == "graph" else contextlib.nullcontext():
                out = self.run_eager(n, views, live, recorder)
        if generator is not None:
            self.draws_rng = bool(self.draws_rng) or generator.get_offset() != offset
        self.note_out_shapes(n, out)
        return out

    def run_observed(self, T: int, inputs: tuple[Any, ...], live: Any) -> Any:
        """``forward(*inputs)`` eagerly on a call's own inputs of ``T`` rows, watched as a probe run
        at size ``T`` is (which dims grow with the size, the outputs' shapes: the next capture
        uses them) and otherwise unchanged (see :class:`CrossingRecorder`); returns its outputs."""
        with self.recording(T, observe=True) as recorder, recording(recorder, live), torch.no_grad():
            out = self._forward(*inputs)
        if recorder.failure is None:  # (else a probe run tells the capture instead)
            self.note_out_shapes(T, out)
        return out

    def recording(self, n: int, observe: bool) -> Any:
        """The sanitizer's recording of an eager run at size ``n`` (see :meth:`PaddingSanitizer.recording`)."""
        static, sanitizer = self.setup()
        return sanitizer.recording(n, static.static_ptrs, bridges_are_copies=self.mode == "graph", observe=observe)

    @property
    def shapes_known(self) -> bool:
        """A run has told the outputs' shapes at some size."""
        return bool(self._out_shapes)

    def note_out_shapes(self, n: int, out: Any) -> None:
        leaves, spec = pytree.tree_flatten(out)
        self._out_shapes[n] = (spec, [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in leaves])

    @contextlib.contextmanager
    def _on_capture_stream(self) -> Iterator[None]:
        """Run the block on the capture stream, after the current stream's queued work and before its next."""
        assert self.stream is not None
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            current.wait_stream(self.stream)

    def probe(self, first: int | None = None, lay_out: bool = False) -> None:
        """Before captures (under the capture lock): unless a run at another size has told, a
        probe run that tells which output dims grow with the size.

        ``first``: the bucket a lazy call captures. ``lay_out``: the probe runs at the largest
        bucket (unless that is ``first``), once as usual and once more with its allocations in the
        runner's pool, so the pool holds segments sized for the largest bucket, which the captures
        then carve from in whatever order calls bring buckets (otherwise each larger bucket adds
        segments of its own).
        """
        self.setup()
        largest = self.sizes[-1]
        lease = self._lease if lay_out and first != largest else None  # (graph mode only)
        if lease is None and any(m != first for m in self._out_shapes):
            return
        if lease is not None:
            size = largest
        elif first != self.probe_size:
            size = self.probe_size
        else:  # another size than the bucket's own, below the largest (first < largest <= rows)
            assert first is not None
            size = first // 2 if first // 2 > 1 else first + 1
        try:
            if lease is None:
                self.run_recorded(size, observe=True)
            else:
                # First outside the pool: what forward builds and keeps on its first run at this
                # size (a cache sized to the longest input) must not live in the pool, whose
                # tensors later captures may reuse once dropped and whose non-owning aliases a
                # graph holds. Then in the pool, which keeps the segments once the run's tensors go.
                self.run_recorded(size)
                with lease.allocating():
                    self.run_recorded(size)
        except Exception as exc:  # the buckets' own warm-ups report failures
            log.debug("bcg.GraphRunner: the probe run raised: %r", exc)

    # -- pools -------------------------------------------------------------------------------
    def give_own_pool(self, bucket: Bucket) -> bool:
        """Give ``bucket`` (a lazy runner's first, captured while nothing is in the runner's pool) a
        pool of its own, unless it is the largest or the runner's pool is the user's; return
        whether it got one."""
        if self.mode != "graph" or self.user_pool is not None or bucket.size == self.sizes[-1]:
            return False
        assert self.stream is not None
        bucket.own_pool = PoolLease(self.device.index or 0, graph_pool_handle(), self.stream,
                                    owner=f"bucket {bucket.size} of bcg.GraphRunner({self.name})")
        return True

    def free_own_pools(self, keep: bool = False) -> list[Bucket]:
        """Take the buckets captured into pools of their own out of them, to be captured again into
        the runner's pool (keeping the trigger that first captured them), and return them.

        Their graphs and pools are freed now (inside a call), or, with ``keep``, at the next call
        or ``reset()``: the outputs the last call returned stay valid until the next call."""
        freed = [b for b in self.buckets.values() if b.own_pool is not None]
        for bucket in freed:
            if keep:
                self.kept_own_pools.append(Bucket(bucket.size, graph=bucket.graph, own_pool=bucket.own_pool))
                bucket.graph, bucket.own_pool, bucket.leaves = None, None, None
                bucket.sliced.clear()
            else:
                bucket.free_graphs()
            bucket.captured = False
        return freed

    def free_kept_own_pools(self) -> None:
        """Free the own pools (and their graphs) :meth:`free_own_pools` kept (the call lock is held)."""
        while self.kept_own_pools:
            self.kept_own_pools.pop().free_graphs()

    def pool_bytes(self) -> int:
        """Bytes of the runner's pool, and of any bucket's pool of its own."""
        if self.mode != "graph" or self.pool is None:
            return 0
        # (each read once: a capture may clear one)
        leases = [b.own_pool for b in [*self.buckets.values(), *self.kept_own_pools]]
        own = [lease.pool for lease in leases if lease is not None]
        return sum(pool_bytes(pool, self.device.index) for pool in [self.pool, *own])

    def uncaptured(self) -> list[int]:
        """The buckets neither captured nor failed, largest first."""
        return [n for n in sorted(self.sizes, reverse=True)
                if not self.buckets[n].captured and self.buckets[n].failure is None]

    # -- one bucket --------------------------------------------------------------------------
    def capture(self, bucket: Bucket, trigger: str) -> None:
        """Warm up and capture ``bucket`` (under the capture lock), then tell how to slice its
        outputs; a failure is logged and the bucket's calls run eagerly (fallback
        ``capture_failed``). With ranks, they vote."""
        n = bucket.size
        t0 = time.perf_counter()
        vote = CaptureVote(self.ranks) if self.ranks is not None else None
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
        self._finish_bucket(bucket)

    def _capture_bucket(self, bucket: Bucket) -> None:
        n = bucket.size
        lives = self._lives_for(n)
        out = self.run_recorded(n, lives=lives)  # the warm-up, on the capture stream
        assert self.static is not None
        bucket.views = self.static.views(n)
        if self.mode == "eager":
            bucket.captured = True
            return
        del out
        graph = BreakableGraph()
        bucket.graph = graph
        pool = bucket.own_pool.pool if bucket.own_pool is not None else self.pool
        assert pool is not None
        out = self._capture_graph(graph, n, lives.own, pool=pool)
        membership = PoolMembership(pool, self.device.index or 0)
        graph.outputs = out
        tier_lives: tuple[Any, ...] = ()
        if graph.staged:
            # The breakable form, for calls whose metadata does not fit, captured while the
            # inline form's outputs are held; a replay of it copies its outputs into those.
            if lives.breakable:
                self._capture_graph(graph, n, lives.own, form="breakable", pool=pool, release=membership.release)
            # A bucket in a pool of its own (a lazy runner's first) is captured again at the next
            # capture: its tiers (calls with fewer requests run faster) come then, not before
            # the first result.
            tier_lives = lives.tiers if bucket.own_pool is None else ()
            if tier_lives and self._barrier is not None:
                # Every rank has the bucket's graph and breakable form before any tier's eager
                # warm-up (with collectives) runs: a rank that failed after its last vote cast
                # False, and the others learn it here, not inside a tier's capture.
                self._barrier()
        # The static outputs live in the pool; hold them through non-owning aliases so the
        # buckets captured next reuse their memory (outputs are valid until the next call). The
        # tiers come after: a call replays one form, so a tier may reuse that memory too, and
        # where its own outputs land there it copies nothing into them (copy_outputs_into).
        out = graph.outputs = membership.release(out)
        tier_lives = [live for live in tier_lives if self._capture_tier(graph, n, out, live, pool)]
        if self.sanitize:
            # Build the executables without the zeroing (calls with T == n replay them) now,
            # rather than at the first such call.
            graph.set_enabled(PADDING, False)
            graph.set_enabled(PADDING, True)
        if tier_lives:  # (in capture order, as the graph holds them)
            with self._on_capture_stream():
                keep_faster_tiers(graph, list(zip([f for f in graph.forms if f.tier], tier_lives)),
                                  self.ranks.all if self.ranks is not None else None)
        leaves, bucket.spec = pytree.tree_flatten(graph.outputs)
        bucket.leaves = leaves
        bucket.captured = True

    def _capture_graph(self, graph: BreakableGraph, n: int, live: Any, form: str = "first", into: Any = None,
                       pool: PoolHandle | None = None, agree: Callable[[], bool] | None = None,
                       release: Callable[[Any], Any] | None = None) -> Any:
        """Capture the padded forward at size ``n`` into ``graph`` (its ``form``, see
        :func:`bcg.capture.capture_into`) with ``live``; return its outputs (``into``: copied
        there at the graph's end, and ``into`` returned)."""
        static, sanitizer = self.setup()
        views = static.load_example(n)  # before the capture: its copies must not be captured
        sanitizer.set_rows(n)
        options = CaptureOptions(
            pool=pool if pool is not None else self.pool,
            stream=self.stream,
            capture_error_mode=self.capture_error_mode,
            live=live,
            debug=self._debug,
            after_breakpoint=sanitizer.hook(n),
            barrier=self._barrier,
            # Calls replay before reading: the last segment need not run at capture, unless the
            # forward draws random numbers (learnt only from a run: see run_recorded).
            compute_outputs=bool(self.draws_rng),
        )

        def forward() -> Any:
            out = self.padded_forward(n, views)
            if into is not None:
                copied = copy_outputs_into(into, out, "a staged tier")
                log.debug("bcg.GraphRunner(%s): bucket %d: a staged tier copies %d output tensor(s) into the "
                          "bucket's (the others landed there)", self.name, n, copied)
                return into
            return out

        with torch.no_grad():
            return capture_into(graph, forward, options, variants=self._variants, form=form, agree=agree,
                                release=release)

    def _capture_tier(self, graph: BreakableGraph, n: int, outputs: Any, live: Any, pool: PoolHandle) -> bool:
        """A staged tier of bucket ``n``'s graph: its forward warmed up, then captured with
        ``live``, ending with a copy of its outputs into ``outputs`` (the bucket's, as non-owning
        aliases: what lands on them is not copied); skipped (logged; returns False) when a staged
        breakpoint did not run inline, or a step failed. With ranks, the ranks vote through it as
        through a bucket's capture: all keep it, or none."""
        vote = CaptureVote(self.ranks) if self.ranks is not None else None
        bucket_barrier, self._barrier = self._barrier, (vote.barrier if vote is not None else None)
        try:
            static, sanitizer = self.setup()
            views = static.load_example(n)
            sanitizer.set_rows(n)
            with self._on_capture_stream(), recording(StagedWarmup(), live), torch.no_grad():
                self.padded_forward(n, views)  # its own warm-up: kernels at its bounds run once first
            self._capture_graph(graph, n, live, form="tier", into=outputs, pool=pool,
                                agree=vote.finish if vote is not None else None)
            return True
        except Exception as exc:  # the bucket's own forms serve the calls instead
            if vote is not None:
                vote.fail()
            log.warning("bcg.GraphRunner(%s): bucket %d: a staged tier's capture failed, skipped: %s: %s",
                        self.name, n, type(exc).__name__, exc)
            return False
        finally:
            self._barrier = bucket_barrier

    def _finish_bucket(self, bucket: Bucket) -> None:
        """After its captures: how to slice the bucket's outputs (the dims that grow with the size)."""
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
        """Capture the largest bucket alone in a fresh pool, free it, and return that pool's bytes
        (under the capture lock; graph mode)."""
        _, sanitizer = self.setup()
        n = self.sizes[-1]
        lives = self._lives_for(n)  # (asked once: the warm-up and the capture run on the same value)
        if not sanitizer.sizes_seen:
            self.run_recorded(self.probe_size)
        if not sanitizer.has_run(n):
            self.run_recorded(n, lives=lives)
        pool = graph_pool_handle()
        graph = BreakableGraph()
        out = self._capture_graph(graph, n, lives.own, pool=pool)
        try:
            size = pool_bytes(pool, self.device.index)
        finally:
            del out
            graph.reset()
        self.largest_alone = size
        return size

    def free(self) -> None:
        """Free every bucket's graph, the runner's pool lease and the static inputs."""
        for bucket in self.buckets.values():
            bucket.free_graphs()
        self.free_kept_own_pools()
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        if self.user_pool is None:
            self.pool = None  # a pool whose graphs are all gone is not captured into again
        self.largest_alone = None
        self.clear()
