"""Held storages: the memory a graph's captured kernels read, kept alive, and checked at replay.

A CUDA graph replays raw addresses. If a tensor it read at capture is freed
(a weight rebound to a new tensor, a cache reallocated), a replay would read
whatever lives there now. So, while a segment is captured, a dispatch mode
(:class:`StorageWatch`) looks at every ATen operation's tensor arguments and
keeps each storage that lives outside the graph's own pool (weights, caches,
static inputs, pinned host buffers): the graph holds it until ``reset()``,
and no replay reads freed memory.

Holding the old storage makes a replaced tensor a *silent* error instead: the
graph would keep computing with the old values. So the watch also keeps weak
references to the tensor objects through which the capture reached each
storage (the operation's argument and its ``_base``; in a ``torch.compile``'d
region, the region's inputs that Inductor's generated code views). When all of them are gone, the storage becomes a
*suspect*; the next replay asks its reference count whether anything besides
the graph still holds it, and raises :class:`bcg.errors.StaleTensorError` if not.
A replay with no suspect pays one list check.

Two kinds of storage are held without being watched, since no replay reads
old values from them:

* **Scratch**: the capture's first access to the storage overwrote all of it
  (``fill_``, ``zero_``, ``copy_``, a random fill, an ``out=`` argument,
  covering every byte and reading none of them), so every replay writes it
  before reading it. Dropping it changes nothing.
* **Another graph's output**: the storage lives in the private pool of
  another graph (bcg's or a ``torch.cuda.CUDAGraph``) that still holds its
  capture; that graph's replay rewrites it, as chained graphs expect. Once
  that graph is reset or freed, a replay that finds the storage held by
  nothing but bcg raises :class:`bcg.errors.StaleTensorError` naming it.

What it cannot see: memory a kernel reaches without an ATen operation taking
the tensor as an argument -- raw pointers handed to Triton kernels or C++/CUDA
extensions (inside ``torch.compile``'d regions, tensors only Inductor's Triton
kernels read), device pointers stored in other tensors, host memory behind
raw pointers. Keep such tensors alive yourself, and update them in place.
Tensors passed to a breakpoint are held by the graph itself (the breakpoint
gets the same objects at every replay), and so are the tensors they are views
of: replacing one of those is not detected.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
from bcg.core.torch_internals import TorchDispatchMode, storage_use_count, view_base, without_mode
from bcg.errors import StaleTensorError, user_frame

log = logging.getLogger("bcg")

_MAX_WATCHERS = 8  # tensor objects watched per storage
# in-place operations that write every element of their first argument without reading it
_OVERWRITES = frozenset(
    getattr(torch.ops.aten, name)
    for name in ("fill_", "zero_", "copy_", "normal_", "uniform_", "random_", "exponential_",
                 "geometric_", "cauchy_", "log_normal_", "bernoulli_")
)


class Writers(Protocol):
    """The graphs that rewrite a storage at their replay (:class:`bcg.core.pool.PoolWriters`)."""

    name: str

    def alive(self) -> bool: ...


class _Storage:
    """One storage a capture read: held strongly, with weak references to the tensors that reach it."""

    __slots__ = ("storage", "ptr", "what", "where", "scratch", "writers", "_refs", "_on_gone", "_bcg_refs")

    def __init__(self, storage: torch.UntypedStorage, t: torch.Tensor, op: str, scratch: bool | None = False,
                 writers: Writers | None = None) -> None:
        self.storage = storage
        self.ptr = storage.data_ptr()
        # the first access that touched its data overwrote all of it: held, never checked
        # (None: only views of it were made so far, which touch no data)
        self.scratch: bool | None = scratch
        self.writers = writers  # the other graphs whose replay rewrites it (it lives in their pool)
        self.what = f"a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
        self._refs: dict[int, weakref.ref[torch.Tensor]] = {}
        frame = user_frame()
        self.where = op
        if frame is not None:
            self.where = f"{op} at {frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"
            if "reinterpret_tensor" in frame.f_globals:
                # Inductor's generated code hands library kernels views it makes without an ATen
                # operation; the tensors they view are the compiled region's inputs, its locals.
                for value in list(frame.f_locals.values()):
                    if isinstance(value, torch.Tensor) and value is not t and _ptr(value) == self.ptr:
                        self.watch(value)
        self._on_gone: Callable[[_Storage], None] | None = None
        self._bcg_refs: int | None = None

    def watch(self, t: torch.Tensor) -> None:
        if len(self._refs) < _MAX_WATCHERS and id(t) not in self._refs:
            self._refs[id(t)] = weakref.ref(t)
        base = view_base(t)
        if base is not None and len(self._refs) < _MAX_WATCHERS and id(base) not in self._refs:
            self._refs[id(base)] = weakref.ref(base)

    def arm(self, on_gone: Callable[[_Storage], None]) -> bool:
        """Watch the tensors still alive (the capture's temporaries are gone): ``on_gone(self)``
        runs once all of them are collected. Returns False when none is alive."""
        alive = [t for t in (r() for r in self._refs.values()) if t is not None]
        self._on_gone = on_gone
        self._refs = {id(t): weakref.ref(t, self._gone) for t in alive}
        return bool(alive)

    def _gone(self, _ref: object) -> None:
        """A watched tensor was collected (on whichever thread dropped it): post once none is left."""
        on_gone = self._on_gone
        if on_gone is not None and all(r() is None for r in list(self._refs.values())):
            self._on_gone = None
            on_gone(self)

    def disarm(self) -> None:
        self._on_gone = None
        self._refs = {}

    def held_elsewhere(self, bcg_tensors: Callable[[], Iterable[torch.Tensor]]) -> bool:
        """Whether anything besides bcg (this hold, and the tensors bcg holds itself) holds the storage."""
        if self._bcg_refs is None:
            self._bcg_refs = len({id(t) for t in bcg_tensors() if _ptr(t) == self.ptr})
        return storage_use_count(self.storage) - 1 - self._bcg_refs > 0


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        yield from (v for v in value if isinstance(v, torch.Tensor))


def _covers_storage(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements are every byte of its storage, each once."""
    try:
        nbytes = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return False
    if t.storage_offset() != 0 or t.numel() * t.element_size() != nbytes:
        return False
    expected = 1
    for size, stride in sorted((s, st) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _overwritten(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> frozenset[int]:
    """The storages ``func`` writes whole without reading them: the first argument of an
    overwriting in-place operation, or ``out=`` arguments, that cover their storage, when no
    argument the operation reads shares that storage."""
    targets: list[torch.Tensor] = []
    reads: list[Any] = list(kwargs.items())
    if getattr(func, "overloadpacket", None) in _OVERWRITES and args:
        targets.extend(_tensors(args[0]))
        reads.extend(enumerate(args[1:]))
    else:
        reads.extend(enumerate(args))
    schema = getattr(func, "_schema", None)
    outs = {a.name for a in schema.arguments if a.is_out} if schema is not None else set()
    if outs:
        targets.extend(t for name in outs for t in _tensors(kwargs.get(name)))
        reads = [(k, v) for k, v in reads if k not in outs]
    if not targets:
        return frozenset()
    read = {_ptr(t) for _, v in reads for t in _tensors(v)}
    return frozenset(p for p in (_ptr(t) for t in targets if _covers_storage(t)) if p not in read)


def _ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return -1


class HeldStorages:
    """The storages one capture read outside its pool: held, and checked at replay.

    Arguments:
        storages: what the capture's :class:`StorageWatch` kept.
        where: what read them, for errors ("graph segments", "the variant of ...").
        suspects: the list a storage is posted to once it is a suspect (every tensor that
            reached it is gone); a graph shares one list between its own holds and its
            variants', and a replay checks each suspect before it launches.
    """

    def __init__(self, storages: list[_Storage], where: str, suspects: list[Any]) -> None:
        self._storages = storages
        self.where = where
        self.suspects = suspects
        self._bcg_tensors: Callable[[], Iterable[torch.Tensor]] = tuple
        for s in storages:
            if s.scratch:
                continue  # every replay writes it before reading it
            if not s.arm(self._post):
                self._post(s)  # reached only through temporaries: checked at every replay

    def __len__(self) -> int:
        return len(self._storages)

    @property
    def nbytes(self) -> int:
        return sum(s.storage.nbytes() for s in self._storages)

    def set_bcg_tensors(self, tensors: Callable[[], Iterable[torch.Tensor]]) -> None:
        """The tensors bcg itself holds (breakpoint arguments): they do not count as holders."""
        self._bcg_tensors = tensors

    def _post(self, storage: _Storage) -> None:
        self.suspects.append((self, storage))

    def release(self) -> None:
        """Stop watching and drop the storages (the graph is being freed)."""
        for s in self._storages:
            s.disarm()
        self.suspects[:] = [(h, s) for h, s in list(self.suspects) if h is not self]
        self._storages = []


def check_suspects(suspects: list[tuple[HeldStorages, _Storage]]) -> None:
    """Raise :class:`bcg.errors.StaleTensorError` for a suspect nothing but bcg holds any more.

    Storages still held elsewhere, or in the pool of another graph that still holds its
    capture, stay posted (checked again at the next replay).
    """
    for held, s in list(suspects):
        if s.held_elsewhere(held._bcg_tensors):
            continue
        if s.writers is not None:
            if s.writers.alive():
                continue  # that graph's replay rewrites it
            raise StaleTensorError(
                f"bcg: this replay would read {s.what}, an output of another graph that was reset or "
                f"freed ({s.writers.name}). {held.where[:1].upper()}{held.where[1:]} read it (first used by the capture "
                f"in {s.where}); no replay rewrites it any more and nothing but this graph references it. "
                "Keep that graph captured for as long as this one replays (reset it after this one), or "
                "reset() this graph and capture it again on tensors that live on. Nothing was launched."
            )
        raise StaleTensorError(
                f"bcg: this replay would read a replaced tensor: {s.what}, read by {held.where} "
                f"(first used by the capture in {s.where}), is no longer referenced by anything but "
                "this graph. The graph keeps its memory alive, so a replay would compute with the old "
                "values. Copy new values into the captured tensor in place (old.copy_(new)) instead of "
                "replacing it, keep a reference to it for as long as the graph replays, or reset() the "
                "graph and capture again. Nothing was launched."
            )


class StorageWatch(TorchDispatchMode):
    """During a capture: the storages outside the graph's pool that captured ATen operations read.

    Arguments:
        external: ``external(op, tensor, storage_ptr)``: whether the storage,
            an argument of ``op``, lives outside the capture's own pools (see
            :class:`bcg.core.pool.SegmentMap`).
        recording: whether the operations running now are being captured
            (False while a breakpoint runs eagerly between segments).
        writers: ``writers(storage_ptr)``: the other live graphs whose pool holds
            a device storage, or None (:meth:`bcg.core.pool.SegmentMap.writers`).
    """

    # compiled graphs call breakpoints' ops through higher-order operators (auto_functionalized)
    supports_higher_order_operators = True

    @classmethod
    def is_infra_mode(cls) -> bool:
        # Dynamo runs torch.compile'd code eagerly under any dispatch mode that is not an infra
        # mode; this one only looks, so compiled regions stay compiled while it watches.
        return True

    def __init__(self, external: Callable[[Any, torch.Tensor, int], bool], recording: Callable[[], bool],
                 writers: Callable[[int], Writers | None] = lambda ptr: None) -> None:
        super().__init__()
        self._external = external
        self._recording = recording
        self._writers = writers
        self._held: dict[int, _Storage] = {}
        self._skip: set[int] = set()
        self.unseen = 0  # tensor arguments without a storage bcg can hold (wrapper subclasses)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._recording():
            # (a view touches no data: whether a storage is scratch waits for the first op that does)
            overwritten = None if getattr(func, "is_view", False) else _overwritten(func, args, kwargs)
            self._see(func, args, overwritten)
            if kwargs:
                self._see(func, kwargs.values(), overwritten)
        return func(*args, **kwargs)

    def _see(self, func: Any, values: Iterable[Any], overwritten: frozenset[int] | None) -> None:
        for value in values:
            if isinstance(value, torch.Tensor):
                self._see_tensor(func, value, overwritten)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, torch.Tensor):
                        self._see_tensor(func, item, overwritten)

    def _see_tensor(self, func: Any, t: torch.Tensor, overwritten: frozenset[int] | None) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            self.unseen += 1
            return
        ptr = storage.data_ptr()
        if ptr in self._skip:
            return
        held = self._held.get(ptr)
        if held is None:
            if not ptr or not self._external(func, t, ptr):
                if t.device.type != "cpu":  # (a host tensor is asked again: only a copy reads it)
                    self._skip.add(ptr)
                return
            held = self._held[ptr] = _Storage(storage, t, str(func), scratch=None, writers=self._writers(ptr))
        if held.scratch is None and overwritten is not None:
            held.scratch = ptr in overwritten
        held.watch(t)

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """A block whose operations are not captured (a breakpoint's eager call) runs without
        this mode, so they do not pay its Python dispatch."""
        return without_mode(self)

    def held(self, where: str, suspects: list[Any]) -> HeldStorages:
        """What the capture read outside its pools, held from now on (the watch is done)."""
        out = HeldStorages(list(self._held.values()), where, suspects)
        self._held, self._skip = {}, set()
        if self.unseen:
            log.debug("bcg: %s: %d tensor argument(s) without a storage bcg can hold", where, self.unseen)
        return out
