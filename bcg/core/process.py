"""What every bcg capture in the process shares, and the frees that wait until no capture runs.

CUDA forbids destroying a graph, and the allocator's ``empty_cache`` (a
``cudaFree``), while a stream captures: the capture is invalidated, in
``"thread_local"`` mode too. A process that captures on one thread while
another drops graphs (a server) must therefore never free CUDA graph
resources during a capture. Every graph resource bcg creates (segments,
variants, stitched and trimmed executables, pool leases) is freed through
:func:`release_when_safe`: right away when no bcg capture is underway, else
queued and run, on the thread whose capture ends, once it has ended. Objects
that own such resources register them with :func:`on_release`, so garbage
collection of a ``BreakableGraph`` or a ``GraphRunner`` frees them the same way.

Process-wide, and why (see also DESIGN.md):

* the capture lock (reentrant): captures are serialized per process. In
  ``"global"`` mode one thread's unsafe CUDA call invalidates another thread's
  capture, and the capture stream below is shared. The runner and
  ``make_graph`` hold it across warm-up and capture. Its outermost release
  runs the queued frees.
* one capture stream per device, reused as ``torch.cuda.graph`` reuses its own, but
  created for bcg alone (torch's pooled streams are handed out again after 32 requests).
* Python's cycle collector, paused while any capture runs (reference counted):
  collecting a cycle that holds a graph bcg did not make (a user's, Inductor's)
  would destroy it during the capture.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bcg.core import cudart

log = logging.getLogger("bcg")

Free = Callable[[], None]


def _run(frees: list[Free]) -> None:
    """Run each free; one that raises is logged (a free must not fail the caller)."""
    for free in frees:
        try:
            free()
        except Exception:  # a sticky CUDA error, a context torn down: nothing left to free
            log.exception("bcg: a deferred free of CUDA graph resources failed")


class CaptureLock:
    """The process's reentrant capture lock; its outermost release runs the queued frees.

    ``capturing`` counts the captures underway (only the lock's holder
    captures). A free asked for while another thread holds the lock, or while
    this thread captures, is queued; the holder's outermost release runs the
    queue before it lets the lock go, so no capture can begin meanwhile.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._guard = threading.Lock()  # orders a deferral against the outermost release
        self._depth = 0  # the holder's acquisitions (only the holder touches it)
        self._deferred: list[Free] = []
        self.capturing = 0

    def acquire(self, blocking: bool = True) -> bool:
        if not self._lock.acquire(blocking):
            return False
        self._depth += 1
        return True

    def release(self) -> None:
        while self._depth == 1 and not self.capturing:
            # (allocated before the guard: an allocation may run the garbage collector, whose
            # finalizers may free graphs, which takes the guard: not reentrant)
            fresh: list[Free] = []
            with self._guard:
                batch, self._deferred = self._deferred, fresh
                if not batch:
                    self._depth = 0
                    self._lock.release()
                    return
            log.debug("bcg: running %d free(s) deferred while a capture ran", len(batch))
            _run(batch)
        self._depth -= 1
        self._lock.release()

    def __enter__(self) -> CaptureLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release_when_safe(self, free: Free) -> None:
        """Run ``free`` now, unless a capture is underway (on another thread, or this one): then
        when the last capture ends."""
        with self._guard:
            if not self._lock.acquire(blocking=False):  # another thread holds it: it runs the queue
                self._deferred.append(free)
                return
            self._depth += 1
            if self.capturing:  # this thread is inside its own capture
                self._deferred.append(free)
                free = _nothing
        try:
            _run([free])
        finally:
            self.release()

    @property
    def deferred(self) -> int:
        """Frees waiting for a capture to end."""
        return len(self._deferred)


def _nothing() -> None:
    pass


class _Process:
    def __init__(self) -> None:
        self.lock = CaptureLock()
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._gc_lock = threading.Lock()
        self._gc_depth = 0
        self._gc_was_enabled = False

    def stream(self, device: int) -> torch.cuda.Stream:
        with self.lock:
            stream = self._streams.get(device)
            if stream is None:
                # Not torch.cuda.Stream(): torch hands out its 32 pooled streams round-robin, so
                # the 33rd stream a process asks for (a user's, another thread's) would be this
                # one, and its work would be recorded into bcg's captures.
                with torch.cuda.device(device):
                    handle = cudart.stream_create()
                stream = self._streams[device] = torch.cuda.ExternalStream(handle, device=device)
            return stream

    def pause_gc(self) -> None:
        with self._gc_lock:
            if self._gc_depth == 0:
                self._gc_was_enabled = gc.isenabled()
                gc.disable()
            self._gc_depth += 1

    def resume_gc(self) -> None:
        """Undo one :meth:`pause_gc`; the last one collects the captures' young garbage now."""
        with self._gc_lock:
            self._gc_depth -= 1
            if self._gc_depth or not self._gc_was_enabled:
                return
            gc.enable()
        gc.collect(0)


_PROCESS = _Process()


def capture_lock() -> CaptureLock:
    """The per-process capture lock (reentrant): hold it to keep other threads' captures out."""
    return _PROCESS.lock


def capture_stream(device: int | None = None) -> torch.cuda.Stream:
    """The capture stream bcg uses on ``device`` (default: the current one) when none is given."""
    return _PROCESS.stream(torch.cuda.current_device() if device is None else device)


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Mark a capture underway on this thread (which holds the capture lock) for the block, with
    the cycle collector paused: frees asked for meanwhile wait until it ends."""
    lock = _PROCESS.lock
    lock.acquire()
    lock.capturing += 1
    _PROCESS.pause_gc()
    try:
        yield
    finally:
        lock.capturing -= 1
        try:
            _PROCESS.resume_gc()
        finally:
            lock.release()


def release_when_safe(free: Free) -> None:
    """Run ``free`` (it frees CUDA graph resources) now, or, while a bcg capture is underway in
    the process, once it has ended."""
    _PROCESS.lock.release_when_safe(free)


def on_release(owner: Any, free: Free) -> weakref.finalize:
    """Arrange for ``free`` to run, through :func:`release_when_safe`, when ``owner`` is collected.

    Returns the finalizer: call it to release explicitly (it runs once).
    ``free`` must not reference ``owner``. Nothing runs at interpreter exit.
    """
    finalizer = weakref.finalize(owner, release_when_safe, free)
    finalizer.atexit = False
    return finalizer
