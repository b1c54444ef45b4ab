"""Keyed breakpoints: a breakpoint's own work captured once per key (a *variant*) and replayed.

A breakpoint declared with ``@bcg.breakpoint(key=...)`` is *keyed*. The contract:

* ``key(live) -> hashable`` covers everything host-dynamic that the
  breakpoint's GPU work depends on: request lengths, split sizes, a kernel
  choice. Two live values with the same key must make the function launch the
  same kernels, with the same parameters, on the same tensors.
* The function reads device data only through its arguments (held by the graph
  at fixed addresses) and writes only them and its results. A tensor taken
  from ``bcg.live()`` is usually a new tensor at every replay: a variant would
  keep reading the capture-time one. bcg watches the ATen ops of a variant
  capture and keeps a key that touches such a tensor eager; kernels handed a
  raw pointer (Triton, extensions) are not seen, so do not pass them live
  tensors. Host memory is not watched at all: a copy from a pinned host
  buffer that the function fills on the host is recorded as the copy alone,
  and a variant replays it without the host write (put such values in the key,
  or in a staged breakpoint's ``prepare``).
* The first time a replay meets a key, the breakpoint runs eagerly (this
  replay's results), then its call is captured into a variant graph (so its
  Python code runs a second time, its GPU work recorded, not run: host side
  effects must tolerate that): a
  ``"thread_local"`` capture on bcg's capture stream, reading and writing the
  same argument and bridge addresses. Later replays with that key launch the
  variant instead of running the function.
* A capture that fails (a host sync, a pageable copy, a live tensor read,
  anything CUDA refuses) makes that key *eager-only*: the reason is logged once
  and counted in ``stats()``, and the replay never fails for it.
* When every breakpoint of a replay has a variant for its key, the segments and
  variants run as ONE executable graph, stitched per key tuple
  (:mod:`bcg.keyed.stitch`). Graphs with segments or variants that draw random
  numbers are never stitched: their replays go through torch, which advances
  the generator's offsets exactly as a piecewise replay does.
* With ``prepare=``/``fits=`` (a staged breakpoint) the two compose: inline
  while the metadata fits; the breakable form's step is keyed.
* ``key`` is called once per replay per breakpoint (steps sharing a breakpoint
  share its key), never during capture or plain eager calls. Eager mode calls
  it too, for the bookkeeping only.

Why a variant has a pool of its own (one per (breakpoint, key), shared by that
breakpoint's steps) rather than the graph's: the graph's pool holds, as free
blocks, the temporaries of its segments, and some of them are live across a
breakpoint at replay (a residual computed before it and read after it). A
variant captured into that pool could be handed such a block. Variants of one
key run one after another in stream order, so they can share one pool; and an
evicted key's pool goes back to the driver whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch
from bcg.core.torch_internals import TorchDispatchMode

from bcg.core import cudart
from bcg.core.args import check_bool, check_int, check_real
from bcg.core.breakpoint import BreakpointSpec, live, tensor_leaves
from bcg.core.rng import GeneratorWatch
from bcg.core.session import capture_call
from bcg.errors import VerificationError
from bcg.keyed.lru import Lru
from bcg.core.plan import BreakpointStep, SegmentStep, Step, breakpoint_tensors
from bcg.core.pool import PoolHandle, graph_pool_handle
from bcg.core.torch_internals import stream_readers
from bcg.core.process import on_release, release_when_safe
from bcg.keyed.stitch import StitchedCache
from bcg.core.storages import HeldStorages

log = logging.getLogger("bcg")


@dataclasses.dataclass(frozen=True)
class VariantPolicy:
    """How many variants and stitched executables a graph keeps, and when it stops capturing.

    Arguments:
        max_variants: (breakpoint, key) entries kept per graph, least recently
            used evicted first (an entry holds that key's variant of every step
            of the breakpoint).
        max_variant_bytes: pool bytes all entries may hold (measured as the
            growth of ``torch.cuda.memory_reserved`` over each variant capture).
        max_stitched: stitched executables kept per graph; a new key tuple
            beyond it updates the least recently used one in place
            (``cudaGraphExecUpdate``) where the driver allows, else replaces it.
        max_stitched_bytes: device memory the stitched executables may hold
            (measured as the drop of free memory over instantiate and upload).
        window: replays of a breakpoint over which its hit rate is judged.
        min_hit_rate: a breakpoint whose variants served fewer than this share
            of the replays in two windows in a row stops capturing, for the
            graph's lifetime; its variants that never served a replay are
            freed, and with none left it runs as a plain breakpoint again.
            ``stats()`` says so.
        audit_every: every Nth replay runs each keyed breakpoint that hits both
            ways, variant then eager, and compares; a difference raises
            :class:`bcg.errors.VerificationError` naming the breakpoint and key (0: never).
        stitch: launch a replay whose breakpoints all hit as one stitched graph.

    The bounds hold per graph: a ``GraphRunner``'s buckets, and a staged
    graph's breakable form, each keep their own. The counts and byte bounds are
    ints (``max_variants``, ``max_stitched`` and ``window`` >= 1, the others >= 0),
    ``min_hit_rate`` a number in ``[0, 1]``, ``stitch`` a bool: anything else
    raises ``TypeError`` (a wrong type) or ``ValueError`` (out of range) at construction.
    """

    max_variants: int = 64
    max_variant_bytes: int = 8 << 30
    max_stitched: int = 32
    max_stitched_bytes: int = 1 << 30
    window: int = 32
    min_hit_rate: float = 0.5
    audit_every: int = 0
    stitch: bool = True

    def __post_init__(self) -> None:
        where = "bcg.VariantPolicy"
        for name in ("max_variants", "max_stitched", "window"):
            check_int(where, name, getattr(self, name), minimum=1)
        for name in ("max_variant_bytes", "max_stitched_bytes", "audit_every"):
            check_int(where, name, getattr(self, name), minimum=0)
        check_real(where, "min_hit_rate", self.min_hit_rate, minimum=0.0, maximum=1.0,
                   hint="it is the share of replays a breakpoint's variants must serve")
        check_bool(where, "stitch", self.stitch)


def variant_key(spec: BreakpointSpec, value: Any) -> Hashable:
    """``spec.key(value)``, checked to be hashable (``TypeError`` naming the breakpoint otherwise)."""
    assert spec.key is not None
    key = spec.key(value)
    try:
        hash(key)
    except TypeError as exc:
        raise TypeError(
            f"the key= of breakpoint {spec.name!r} returned an unhashable {type(key).__name__} ({exc}); "
            "return a hashable value, e.g. a tuple of ints instead of a list or a tensor"
        ) from None
    return key


@dataclasses.dataclass
class KeyStats:
    """One keyed breakpoint's counts (see :meth:`KeyBook.summary`)."""

    replays: int = 0
    repeats: int = 0
    hits: int = 0
    misses: int = 0
    captures: int = 0
    eager_only: dict[str, int] = dataclasses.field(default_factory=dict)
    capturing: bool = True
    stopped: str | None = None
    window_replays: int = 0
    window_served: int = 0
    low_windows: int = 0  # consecutive windows below min_hit_rate


class KeyBook:
    """Per keyed breakpoint: which keys were seen, how often they repeat, whether to keep capturing."""

    def __init__(self, policy: VariantPolicy) -> None:
        self.policy = policy
        self._stats: dict[BreakpointSpec, KeyStats] = {}
        self._seen: dict[BreakpointSpec, OrderedDict[Hashable, None]] = {}

    def stats(self, spec: BreakpointSpec) -> KeyStats:
        st = self._stats.get(spec)
        if st is None:
            st = self._stats[spec] = KeyStats()
            self._seen[spec] = OrderedDict()
        return st

    def observe(self, spec: BreakpointSpec, key: Hashable, served: bool | None = None) -> KeyStats:
        """Count one replay of ``spec`` with ``key``; judge its hit rate at each window's end.

        ``served``: whether a captured variant serves this key (None, as in eager mode: whether
        the key was seen before). Capturing stops after two windows in a row in which fewer than
        ``min_hit_rate`` of the replays were served: keys that never repeat, or that repeat only
        after the cache has evicted them (a working set larger than the cache).
        """
        st = self.stats(spec)
        seen = self._seen[spec]
        repeat = key in seen
        if repeat:
            seen.move_to_end(key)
        else:
            seen[key] = None
            if len(seen) > 4 * self.policy.max_variants:  # bounded memory for keys that never repeat
                seen.popitem(last=False)
        st.replays += 1
        st.repeats += repeat
        st.window_replays += 1
        st.window_served += repeat if served is None else served
        if st.window_replays >= self.policy.window:
            rate = st.window_served / st.window_replays
            st.low_windows = st.low_windows + 1 if rate < self.policy.min_hit_rate else 0
            if st.capturing and st.low_windows >= 2:
                st.capturing = False
                st.stopped = (
                    f"variants served {rate:.0%} of the last {st.window_replays} replays, under min_hit_rate "
                    f"{self.policy.min_hit_rate:.0%} for two windows in a row: no new variants are captured"
                )
                log.warning("bcg: keyed breakpoint %r: %s", spec.name, st.stopped)
            st.window_replays = st.window_served = 0
        return st

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per breakpoint name: replays, repeats, hits/misses (step calls), hit_rate, captures,
        eager_only ({reason: keys}), capturing, and why capturing stopped."""
        out: dict[str, dict[str, Any]] = {}
        for spec, st in self._stats.items():
            calls = st.hits + st.misses
            out[spec.name] = {
                "replays": st.replays,
                "repeats": st.repeats,
                "hits": st.hits,
                "misses": st.misses,
                "hit_rate": st.hits / calls if calls else None,
                "captures": st.captures,
                "eager_only": dict(st.eager_only),
                "capturing": st.capturing,
                "stopped": st.stopped,
            }
        return out


# -- variants of one (breakpoint, key) -----------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Variant:
    """One step's captured call: a ``torch.cuda.CUDAGraph`` (``nodes`` 0: it launches nothing),
    and the storages it reads outside its pools (held, see :mod:`bcg.core.storages`)."""

    graph: torch.cuda.CUDAGraph
    nodes: int
    uses_rng: bool | None = None  # learnt at the first launch, which goes through torch
    held: HeldStorages | None = None
    rng: GeneratorWatch | None = None  # its capture's: the generators whose offsets tell uses_rng
    _free: Any = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._free = on_release(self, self.graph.reset)  # when released or collected, never during a capture

    @property
    def graph_handle(self) -> int:
        return int(self.graph.raw_cuda_graph())

    def release(self) -> None:
        if self.held is not None:
            self.held.release()
        self._free()


@dataclasses.dataclass(eq=False)
class VariantEntry:
    """A key's variants of every step of one breakpoint, in one pool of their own."""

    spec: BreakpointSpec
    key: Hashable
    pool: PoolHandle
    variants: dict[int, Variant] = dataclasses.field(default_factory=dict)  # by step index
    failed: str | None = None
    hits: int = 0  # step calls it served

    def release(self) -> None:
        for v in self.variants.values():
            v.release()
        self.variants.clear()


class _LiveTensorRead(RuntimeError):
    pass


class _WatchLiveTensors(TorchDispatchMode):
    """Raises when an ATen op reads or writes one of the live metadata's CUDA tensors."""

    # compiled graphs call breakpoints' ops through higher-order operators (auto_functionalized)
    supports_higher_order_operators = True

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self._storages = storages

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for t in tensor_leaves((args, kwargs)):
            if t.is_cuda and t.untyped_storage().data_ptr() in self._storages:
                raise _LiveTensorRead(
                    f"{func} used a tensor of bcg.live() (a new tensor at every replay; a variant would "
                    "keep the capture-time one): pass it as an argument, or build it inside the breakpoint"
                )
        return func(*args, **(kwargs or {}))


def live_tensors(value: Any, depth: int = 8, limit: int = 1 << 16) -> list[torch.Tensor]:
    """The tensors reachable from a live value through containers, dataclasses and attributes
    (``__dict__`` and ``__slots__``): at most ``depth`` levels and ``limit`` objects looked at."""
    out: list[torch.Tensor] = []
    todo: list[tuple[Any, int]] = [(value, depth)]
    seen = 0
    while todo and seen < limit:
        obj, d = todo.pop()
        seen += 1
        if isinstance(obj, torch.Tensor):
            out.append(obj)
            continue
        if d == 0 or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)) or callable(obj):
            continue
        if dataclasses.is_dataclass(obj):
            children: list[Any] = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
        elif isinstance(obj, dict):
            children = list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = list(obj)
        else:
            children = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
            for cls in type(obj).__mro__:
                slots = cls.__dict__.get("__slots__", ())
                for name in (slots,) if isinstance(slots, str) else slots:
                    if hasattr(obj, name):
                        children.append(getattr(obj, name))
        todo.extend((child, d - 1) for child in children)
    return out


# -- the graph's cache --------------------------------------------------------------------------


class VariantCache:
    """A graph's keyed breakpoints: their keys per replay, variants, stitched executables, audit.

    Built by the capture (``device`` None: eager mode, bookkeeping only). It
    attaches a :class:`StepVariants` to each keyed step of ``plan`` (graph
    mode), through which replays of that step dispatch.
    """

    def __init__(self, plan: tuple[Step, ...] | list[Step], device: int | None, policy: VariantPolicy,
                 on_made_plain: Callable[[], None] | None = None, suspects: list[Any] | None = None,
                 graph_pool: PoolHandle | None = None) -> None:
        self.policy = policy
        self._suspects = suspects if suspects is not None else []  # the graph's: where variants post suspects
        self.graph_pool = graph_pool  # arguments and bridges live there: not held by variants
        self._on_made_plain = on_made_plain  # the graph rebuilds its executor: plain steps call fn directly
        self.device = device
        self.book = KeyBook(policy)
        self._plan = tuple(plan)
        keyed = [s for s in self._plan if isinstance(s, BreakpointStep) and s.spec.key is not None]
        self._specs: tuple[BreakpointSpec, ...] = tuple(dict.fromkeys(s.spec for s in keyed))
        self._steps_of: dict[BreakpointSpec, int] = {}
        for s in keyed:
            self._steps_of[s.spec] = self._steps_of.get(s.spec, 0) + 1
        self._entries: Lru[tuple[BreakpointSpec, Hashable], VariantEntry] = Lru(
            policy.max_variants, policy.max_variant_bytes
        )
        self._keys: dict[BreakpointSpec, Hashable] = {}
        self._replays = 0
        self.auditing = False
        self.evictions = 0
        self.stitched_replays = 0
        self._logged: set[tuple[str, str]] = set()
        self.stitch_blocker = self._stitch_blocker()
        self.stitched = StitchedCache(policy.max_stitched, policy.max_stitched_bytes) if device is not None else None
        if device is not None:
            for s in keyed:
                s.variants = StepVariants(self, s)

    def _stitch_blocker(self) -> str | None:
        if not self.policy.stitch:
            return "stitching is off (VariantPolicy.stitch=False)"
        for s in self._plan:
            if isinstance(s, SegmentStep) and s.uses_rng:
                return f"segment {s.index} draws random numbers (its replay must advance torch's generator)"
            if isinstance(s, SegmentStep) and s.staged:
                return (f"segment {s.index} carries staged values in kernel parameters, which each replay "
                        "sets in the segment's own executable")
            if isinstance(s, BreakpointStep) and s.spec.key is None:
                return f"breakpoint {s.name!r} has no key= (it runs eagerly at every replay)"
        return None

    # -- per replay ---------------------------------------------------------------------------
    def begin_replay(self, value: Any, stitch: bool = True) -> int | None:
        """Compute this replay's keys; return the stitched executable to launch, if every step hits.

        Arguments:
            value: the replay's live metadata.
            stitch: False runs the steps one by one (verify's tapped replay).
        """
        self._replays += 1
        every = self.policy.audit_every
        self.auditing = bool(every) and self._replays % every == 0
        keys = self._keys = {}
        for spec in self._specs:
            keys[spec] = key = variant_key(spec, value)
            self._observe(spec, key)
        if not stitch or self.auditing:
            return None
        entries = self._stitchable(keys, touch=True)
        if entries is None:
            return None
        assert self.stitched is not None
        tuple_key = tuple(keys.values())
        handle = self.stitched.get(tuple_key)
        if handle is None:
            handle = self.stitched.build(tuple_key, self._children(keys), tuple((e.spec, e.key) for e in entries),
                                         self._stream())
            if handle is None:
                return None
        self.stitched_replays += 1
        for entry in entries:
            self.book.stats(entry.spec).hits += self._steps_of[entry.spec]
            entry.hits += self._steps_of[entry.spec]
        return handle

    def would_stitch(self, value: Any) -> bool:
        """Whether a replay with ``value`` would be one stitched launch, as far as this graph can
        tell now (no side effect; the first build of an executable may still be refused)."""
        every = self.policy.audit_every
        if every and (self._replays + 1) % every == 0:
            return False
        return self._stitchable({spec: variant_key(spec, value) for spec in self._specs}, touch=False) is not None

    def _stitchable(self, keys: dict[BreakpointSpec, Hashable], touch: bool) -> list[VariantEntry] | None:
        """The entries of ``keys`` when each is complete and draws no random numbers, and the
        graph can be stitched; else None. ``touch``: mark them recently used."""
        if self.stitch_blocker is not None or self.stitched is None or self.stitched.blocked is not None:
            return None
        entries = []
        for spec, key in keys.items():
            entry = self._entries.get((spec, key)) if touch else self._entries.peek((spec, key))
            if entry is None or entry.failed is not None or len(entry.variants) < self._steps_of[spec]:
                return None
            if any(v.uses_rng is not False for v in entry.variants.values()):
                return None  # not launched through torch yet, or draws random numbers
            entries.append(entry)
        return entries

    def _observe(self, spec: BreakpointSpec, key: Hashable) -> None:
        """Count ``spec``'s key for this replay; when capturing stops, free its unused variants and,
        if none is left, make its steps plain breakpoint calls."""
        st = self.book.stats(spec)
        was_capturing = st.capturing
        served = None
        if self.device is not None:
            entry = self._entries.peek((spec, key))
            served = entry is not None and entry.failed is None and len(entry.variants) == self._steps_of[spec]
        self.book.observe(spec, key, served)
        if was_capturing and not st.capturing:
            self._drop_unused(spec, key)
            if not any(e.spec is spec for _, e in self._entries.items()):
                self._make_plain(spec)

    def _children(self, keys: dict[BreakpointSpec, Hashable]) -> list[int]:
        """The ``cudaGraph_t`` of each step of the plan in order (steps that launch nothing left out)."""
        out = []
        for step in self._plan:
            if isinstance(step, SegmentStep):
                out.append(step.graph_handle)
                continue
            entry = self._entries.get((step.spec, keys[step.spec]))
            assert entry is not None
            v = entry.variants[step.index]
            if v.nodes:
                out.append(v.graph_handle)
        return out

    def key_for(self, spec: BreakpointSpec) -> Hashable:
        """This replay's key of ``spec`` (computed by :meth:`begin_replay`, or now)."""
        key = self._keys.get(spec, _MISSING)
        if key is _MISSING:
            key = self._keys[spec] = variant_key(spec, live(static_ok=True))
        return key

    def entry(self, spec: BreakpointSpec, key: Hashable) -> VariantEntry | None:
        return self._entries.get((spec, key))

    def _stream(self) -> int:
        assert self.device is not None
        return int(torch.cuda.current_stream(self.device).cuda_stream)

    # -- capturing ----------------------------------------------------------------------------
    def capture(self, step: BreakpointStep, key: Hashable) -> None:
        """Capture ``step``'s call as its variant for ``key`` (after the eager run); never raises
        for a call CUDA cannot capture: the key becomes eager-only."""
        spec = step.spec
        st = self.book.stats(spec)
        if not st.capturing:
            return
        assert self.device is not None
        entry = self._entries.get((spec, key))
        if entry is None:
            if not self._make_room():
                return
            entry = VariantEntry(spec, key, graph_pool_handle())
            self._entries.put((spec, key), entry)
        storages = {t.untyped_storage().data_ptr() for t in live_tensors(live(None, static_ok=True)) if t.is_cuda}
        before = torch.cuda.memory_reserved(self.device)
        try:
            with _WatchLiveTensors(storages) if storages else contextlib.nullcontext():
                graph, nodes, watch, rng = capture_call(step.eager_launch, entry.pool, self.device, self.graph_pool)
        except Exception as exc:  # any refusal: the key stays eager
            self._fail(entry, exc)
            return
        held = watch.held(f"the variant of breakpoint {spec.name!r} for key {key!r}", self._suspects)
        held.set_bcg_tensors(functools.partial(breakpoint_tensors, (step,)))
        uses_rng = True if rng.took else False if not nodes else None  # (None: its first launch tells)
        entry.variants[step.index] = Variant(graph, nodes, uses_rng=uses_rng, held=held, rng=rng)
        self._entries.add_bytes((spec, key), max(torch.cuda.memory_reserved(self.device) - before, 0))
        st.captures += 1

    def _fail(self, entry: VariantEntry, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        st = self.book.stats(entry.spec)
        st.eager_only[reason] = st.eager_only.get(reason, 0) + 1
        if (entry.spec.name, reason) not in self._logged:
            self._logged.add((entry.spec.name, reason))
            log.warning(
                "bcg: keyed breakpoint %r cannot be captured for key %r; it runs eagerly for that key: %s",
                entry.spec.name, entry.key, reason,
            )
        if entry.variants:
            self._free([entry], empty_cache=False)
        entry.failed = reason

    def _free(self, entries: list[VariantEntry], empty_cache: bool = True) -> None:
        """Release ``entries``' variants and the stitched executables built from them; the pools
        go back to the driver (``empty_cache``). The executables leave the cache now; the
        freeing runs after a synchronize (a queued replay may still launch them), once no
        capture is underway (see :mod:`bcg.core.process`)."""
        if self.stitched is not None:
            for entry in entries:
                self.stitched.drop((entry.spec, entry.key))
        for entry in entries:
            for v in entry.variants.values():
                if v.held is not None:
                    v.held.release()  # not read any more: stop checking them
        device = self.device

        def free() -> None:
            torch.cuda.synchronize(device)
            for entry in entries:
                entry.release()
            if empty_cache:
                torch.cuda.empty_cache()

        release_when_safe(free)

    def _pop(self, keys: list[tuple[BreakpointSpec, Hashable]]) -> list[VariantEntry]:
        return [e for e in (self._entries.pop(k) for k in keys) if e is not None]

    def _make_room(self) -> bool:
        """Evict least recently used entries (not this replay's) so one more fits; False if none can go."""
        current = {(spec, key) for spec, key in self._keys.items()}
        victims = self._pop(self._entries.over(lambda k: k in current, room=1))
        if victims:
            self._free(victims)
            self.evictions += len(victims)
        return not self._entries.full(room=1)

    def _drop_unused(self, spec: BreakpointSpec, current: Hashable) -> None:
        """``spec`` stopped capturing: free its variants that never served a replay."""
        unused = self._pop([k for k, e in self._entries.items() if e.spec is spec and not e.hits and k != (spec, current)])
        if unused:
            self._free(unused)
            log.info("bcg: keyed breakpoint %r: freed %d variant key(s) that never served a replay", spec.name,
                     len(unused))

    def _make_plain(self, spec: BreakpointSpec) -> None:
        """``spec`` stopped capturing and holds no variant: its steps become plain breakpoint calls
        (from the next replay on), so they cost exactly what an unkeyed breakpoint costs."""
        self._specs = tuple(s for s in self._specs if s is not spec)
        for step in self._plan:
            if isinstance(step, BreakpointStep) and step.spec is spec:
                step.variants = None
        self.book.stats(spec).stopped = f"{self.book.stats(spec).stopped}; it now runs as a plain breakpoint"
        if self.stitch_blocker is None:
            self.stitch_blocker = f"breakpoint {spec.name!r} stopped capturing variants (its keys did not repeat)"
        if self._on_made_plain is not None:
            self._on_made_plain()

    def evict(self, spec: BreakpointSpec, key: Hashable) -> None:
        """Drop the variants of ``spec`` for ``key`` (after a failed audit): the key is captured anew."""
        entries = self._pop([(spec, key)])
        if entries:
            self._free(entries)

    # -- eager mode -----------------------------------------------------------------------------
    def observe_eager(self, spec: BreakpointSpec, value: Any, first: bool) -> None:
        """Eager mode: one call of ``spec`` (``first``: its first in this replay, whose key is
        computed and counted as a graph replay counts it); no variant is captured."""
        if first:
            self._observe(spec, variant_key(spec, value))
        self.book.stats(spec).misses += 1

    # -- release and stats ------------------------------------------------------------------------
    def release(self) -> None:
        """Free every variant and stitched executable (the caller synchronized)."""
        if self.stitched is not None:
            self.stitched.release()
        for _, entry in self._entries.items():
            entry.release()
        self._entries = Lru(self.policy.max_variants, self.policy.max_variant_bytes)

    def stats(self) -> dict[str, Any]:
        """``breakpoints`` (per name, see :meth:`KeyBook.summary`), ``entries``, ``variant_bytes``,
        ``evictions``, ``stitched_replays``, ``stitch_blocker`` and ``stitched`` (the cache's own)."""
        return {
            "breakpoints": self.book.summary(),
            "entries": len(self._entries),
            "variant_bytes": self._entries.nbytes,
            "evictions": self.evictions,
            "stitched_replays": self.stitched_replays,
            "stitch_blocker": self.stitch_blocker,
            "stitched": self.stitched.stats() if self.stitched is not None else None,
        }


_MISSING = object()


class StepVariants:
    """A keyed step's replay: launch its variant for this replay's key, else run eagerly and capture."""

    def __init__(self, cache: VariantCache, step: BreakpointStep) -> None:
        self.cache = cache
        self.step = step
        self._get_device, self._get_stream = stream_readers()

    def run(self) -> None:
        cache, step = self.cache, self.step
        spec = step.spec
        key = cache.key_for(spec)
        entry = cache.entry(spec, key)
        variant = entry.variants.get(step.index) if entry is not None and entry.failed is None else None
        st = cache.book.stats(spec)
        if variant is not None:
            st.hits += 1
            entry.hits += 1  # type: ignore[union-attr]
            if cache.auditing:
                self._audit(variant, key)
            else:
                self._launch(variant)
            return
        st.misses += 1
        step.eager_launch()
        if entry is None or entry.failed is None:
            cache.capture(step, key)

    def _launch(self, variant: Variant) -> None:
        if not variant.nodes:
            return
        if variant.uses_rng is None or variant.uses_rng:
            # through torch: it advances the generator for a variant that draws random numbers;
            # the first launch tells whether this one does
            assert variant.rng is not None
            offsets = variant.rng.offsets()
            variant.graph.replay()
            variant.uses_rng = variant.rng.moved(offsets)
            return
        cudart.launch(int(variant.graph.raw_cuda_graph_exec()), self._get_stream(self._get_device()))

    def _audit(self, variant: Variant, key: Hashable) -> None:
        """Run the variant, then the function eagerly from the same state; raise if they differ.

        A variant that draws random numbers cannot match its eager call (other draws): it is
        launched, not audited. The state is saved by cloning every argument the breakpoint may
        write (all of them without ``mutates=``).
        """
        step = self.step
        written = step.spec.mutated_tensors(step.args, step.kwargs)
        saved = [t.clone() for t in written] if not variant.uses_rng else []
        self._launch(variant)
        if variant.uses_rng:  # (learnt at its first launch) nothing to compare: other draws
            return
        results = step.bridges.tensors() if step.bridges is not None else []
        got = [t.clone() for t in results + written]
        for t, s in zip(written, saved):
            t.copy_(s)
        step.eager_launch()
        for i, (g, w) in enumerate(zip(got, results + written)):
            if not _same(g, w):
                self.cache.evict(step.spec, key)
                diff = (g.double() - w.double()).abs().nan_to_num(nan=float("inf")).max().item() if g.numel() else 0.0
                raise VerificationError(
                    f"audit: keyed breakpoint {step.name!r} (step {step.index}) with key {key!r}: its variant, "
                    f"captured at an earlier replay with the same key, wrote different values than the eager "
                    f"call ({'result' if i < len(results) else 'written argument'} {i if i < len(results) else i - len(results)}, "
                    f"max |variant - eager| = {diff:.3g}). The key misses something the function's GPU work "
                    "depends on: add it to key=. The variant was dropped; this replay's values are the eager ones"
                )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values, NaN equal to NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if not a.is_floating_point():
        return False
    nan_a, nan_b = a.isnan(), b.isnan()
    return torch.equal(nan_a, nan_b) and torch.equal(a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0))
