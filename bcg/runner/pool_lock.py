"""The call lock of the runners that share one pool: graphs sharing a pool must never replay concurrently."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Iterator

import torch

from bcg.core.pool import PoolHandle
from bcg.core.torch_internals import stream_readers

log = logging.getLogger("bcg")

_current_raw_stream = stream_readers()[1]

IDLE_S = 0.05  # no call begun or in flight for this long: the callers paused (see yield_to_calls)


class PoolCallLock:
    """What every runner using one pool shares: the call lock, the stream of the last replay,
    and who may read returned views (see "Threads" in ``docs/runner.md``)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.last_stream: int | None = None  # raw cudaStream_t of the last replay
        self.first_caller: int | None = None  # thread ident of the first call
        self.shared = False  # called from more than one thread
        self.reader: int | None = None  # the thread inside ``locked()``
        self.background = 0  # background captures into the pool under way (each bucket's writes the pool)
        self._waiting = 0  # callers waiting for the lock (see let_callers_in)
        self._count = threading.Lock()
        self._caller = _CallerHold(self)  # (one object: a call's hot path makes none)
        self.in_capture_step = False  # a background capture holds the lock for a bucket now
        self.calls = 0  # calls begun while a background capture runs (see yield_to_calls)
        self.active = 0  # of those, calls not returned yet

    @contextlib.contextmanager
    def capture_step(self) -> Iterator[None]:
        """Hold the lock for one step of a background capture (a bucket's warm-up and capture),
        flagged so that calls that would wait for it can run eagerly instead."""
        with self.lock:
            self.in_capture_step = True
            try:
                yield
            finally:
                self.in_capture_step = False

    def for_caller(self) -> _CallerHold:
        """Hold the lock for a call (or ``locked()``): ``with lock.for_caller():``. A caller that
        has to wait for it is counted meanwhile (see :meth:`let_callers_in`)."""
        return self._caller

    def let_callers_in(self, timeout: float = 1.0) -> None:
        """Between two steps of a background capture (not holding the lock): wait until no caller
        waits for the lock, at most ``timeout`` seconds. Python's lock is not fair: a thread that
        releases it and takes it again at once can keep a waiting caller out for a whole ladder."""
        deadline = time.monotonic() + timeout
        while self._waiting and time.monotonic() < deadline:
            time.sleep(0.0002)

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Count a call made while a background capture runs, for :meth:`yield_to_calls`."""
        with self._count:
            self.calls += 1
            self.active += 1
        try:
            yield
        finally:
            with self._count:
                self.active -= 1

    def yield_to_calls(self, since: int, seconds: float, stop: threading.Event) -> None:
        """Between two steps of a background capture (not holding the lock): if calls came since
        the count was ``since``, wait while they keep coming (one in flight, or one begun in the
        last ``IDLE_S``: a caller that synchronizes on a replay's GPU work between two calls is
        still serving), at most ``seconds``, or until ``stop`` is set. Calls and the capture
        share the GIL and the GPU; the calls are served first."""
        if self.calls == since and not self.active:
            return
        deadline = time.monotonic() + seconds
        while True:
            seen = self.calls
            remaining = deadline - time.monotonic()
            if remaining <= 0 or stop.wait(min(remaining, IDLE_S)):
                return
            if self.calls == seen and not self.active:
                return

    def views_safe(self) -> bool:
        """Whether this call (under the lock) may return views: one calling thread so far, or
        ``locked()``; and no background capture under way, whose next bucket would write the pool
        before the caller reads the view (except inside ``locked()``)."""
        me = threading.get_ident()
        if self.background and self.reader != me:
            return False
        if self.first_caller is None:
            self.first_caller = me
        elif me != self.first_caller and not self.shared:
            self.shared = True
            log.info("bcg.GraphRunner: called from a second thread: outputs are copies from now on, "
                     "except inside `with runner.locked():` (or pass copy_outputs=False/True)")
        return not self.shared or self.reader == me

    def serialize_streams(self, device: int) -> int:
        """Order this replay after the previous one of any runner sharing the pool, if on another
        stream; return the current raw stream (the replay's)."""
        current = _current_raw_stream(device)
        last = self.last_stream
        if last is not None and last != current:
            torch.cuda.current_stream(device).wait_stream(stream_at(last, device))
        self.last_stream = current
        return current


def stream_at(raw: int, device: int) -> torch.cuda.Stream:
    """The torch stream whose raw ``cudaStream_t`` is ``raw`` on ``device``.

    Not ``torch.cuda.ExternalStream(raw)`` alone: torch reads a null pointer as "no stream
    given" and hands out one of its pooled streams, so waiting on it would not wait for
    torch's default stream (whose raw handle is null).
    """
    if raw == 0:
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(raw, device=device)


class _CallerHold:
    """``with`` it: take the call lock, counted as waiting only when it is taken already."""

    __slots__ = ("_owner",)

    def __init__(self, owner: PoolCallLock) -> None:
        self._owner = owner

    def __enter__(self) -> None:
        owner = self._owner
        if owner.lock.acquire(blocking=False):
            return
        with owner._count:
            owner._waiting += 1
        try:
            owner.lock.acquire()
        finally:
            with owner._count:
                owner._waiting -= 1

    def __exit__(self, *exc: object) -> None:
        self._owner.lock.release()


class PoolLocks:
    """One :class:`PoolCallLock` per pool, alive while some runner of that pool holds it.

    Process-wide (runners created apart must find each other's lock through the
    pool they share); entries go away with the last runner that holds them.
    """

    def __init__(self) -> None:
        self._locks: weakref.WeakValueDictionary[tuple[int, ...], PoolCallLock] = weakref.WeakValueDictionary()
        self._mutex = threading.Lock()

    def for_pool(self, pool: PoolHandle, default: PoolCallLock) -> PoolCallLock:
        """The lock of ``pool``: the one another runner registered, else ``default`` (registered now)."""
        with self._mutex:
            found = self._locks.get(tuple(pool))
            if found is None:
                self._locks[tuple(pool)] = found = default
            return found


POOL_LOCKS = PoolLocks()
