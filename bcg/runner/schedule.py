"""When a runner's buckets are captured: all now, each right after the call that needed it
(``lazy=True``), or on a thread of its own while calls are served (``background=True``).

All three go through one loop (:meth:`CaptureSchedule._capture_each`); they differ in the order
of the buckets and in what each bucket's step holds. How one bucket is captured is
:mod:`bcg.runner.ladder`'s.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import ContextManager

from bcg.errors import BcgError
from bcg.runner.ladder import Bucket, Ladder
from bcg.runner.pool_lock import PoolCallLock

log = logging.getLogger("bcg")

#: The share of the time a background capture leaves to calls while they come: after a bucket's
#: step, it waits up to three times as long while calls keep coming (they and the capture share
#: the GIL and the GPU, and a call beside a capture step runs slower). Serving first; the ladder
#: takes longer.
CALLS_SHARE = 0.75


@contextlib.contextmanager
def _held(bucket: Bucket) -> Iterator[bool]:
    """The step of a capture whose locks are held for the whole loop: every bucket is due."""
    yield True


class CaptureSchedule:
    """The capture drivers of one runner's :class:`~bcg.runner.ladder.Ladder`.

    Arguments:
        ladder: the buckets and how each is captured.
        lock: the call lock of the runner's pool.
        lazy: ``0``: not lazy; ``k``: a call whose bucket is not captured runs eagerly, and the
            ``k``-th such call of a bucket captures it after it runs.
        progress: show a tqdm bar while :meth:`capture` captures.
    """

    def __init__(self, ladder: Ladder, lock: PoolCallLock, *, lazy: int, progress: bool) -> None:
        self._ladder = ladder
        self.lock = lock
        self.lazy = lazy
        self._progress = progress
        self.serving = False  # calls are served (captured, capturing in the background, or lazy)
        self._background: threading.Thread | None = None
        self._background_error: BaseException | None = None
        self._stop = threading.Event()
        self._calls = 0  # background: calls begun when the last step began, and when it began
        self._t_step = 0.0

    # -- the one loop ------------------------------------------------------------------------
    def _capture_each(self, sizes: list[int], trigger: str,
                      step: Callable[[Bucket], ContextManager[bool]] = _held) -> None:
        """Capture each bucket of ``sizes`` in order, inside ``step(bucket)``, which says whether
        it is still due (a call may have captured it meanwhile); stop when asked to."""
        from tqdm import tqdm

        bar = tqdm(sizes, desc="bcg capture", unit="bucket", disable=not self._progress or trigger != "capture()")
        for n in bar:
            if self._stop.is_set():
                break
            bucket = self._ladder.buckets[n]
            with step(bucket) as due:
                if due:
                    bar.set_postfix_str(f"bucket {n}", refresh=False)
                    self._ladder.capture(bucket, trigger)
        bar.close()

    # -- now ---------------------------------------------------------------------------------
    def capture(self, background: bool) -> None:
        """:meth:`bcg.GraphRunner.capture`: every bucket not captured yet, largest first."""
        if background:
            self._start_background()
            return
        self.wait()  # (a background capture first finishes what it does)
        ladder = self._ladder
        with self.lock.lock, ladder.capturing(), ladder.on_device():
            self._refuse_captured()
            t_start = time.perf_counter()
            with self.ordered_with_calls():
                ladder.free_own_pools(keep=True)  # (captured again below, into the runner's pool)
                ladder.probe()
                self._capture_each(ladder.uncaptured(), "capture()")
            ladder.capture_total_s += time.perf_counter() - t_start
            self.serving = True
            ok = [b for b in ladder.sizes if ladder.buckets[b].captured]
            log.info(
                "bcg.GraphRunner(%s): %s %d of %d bucket(s) (%s) in %.2f s; pool %.1f MiB",
                ladder.name, "captured" if ladder.mode == "graph" else "warmed up (eager mode)",
                len(ok), len(ladder.sizes), ", ".join(map(str, ok)) or "none", ladder.capture_total_s,
                ladder.pool_bytes() / 2**20,
            )

    def _refuse_captured(self) -> None:
        if self.serving and not self.lazy and not self._ladder.uncaptured():
            raise BcgError("this GraphRunner is already captured: call reset() first to capture again")

    # -- lazily ------------------------------------------------------------------------------
    def capture_after_call(self, bucket: Bucket) -> None:
        """A lazy runner: capture ``bucket`` after a call that ran eagerly (the call lock is held),
        if it is the bucket's ``lazy``-th such call.

        The first bucket, unless it is the largest, goes into a pool of its own, with no run at
        the largest size before it and without its staged tiers (the first call returns sooner).
        The next lazy capture lays the runner's pool out for the largest bucket, captures its
        bucket, and captures the first one again, whole, into that pool (its own is freed)."""
        bucket.eager_calls += 1
        if bucket.eager_calls < self.lazy:
            return
        ladder = self._ladder
        with ladder.capturing(), ladder.on_device():
            t_start = time.perf_counter()
            with self.ordered_with_calls():
                again = ladder.free_own_pools()
                in_use = any(b.captured and b.own_pool is None for b in ladder.buckets.values())
                alone = not again and not in_use and ladder.give_own_pool(bucket)
                ladder.probe(first=bucket.size, lay_out=not alone and not in_use)
                self._capture_each([bucket.size, *(b.size for b in again)], "lazy")
            ladder.capture_total_s += time.perf_counter() - t_start
        log.info("bcg.GraphRunner(%s): bucket %d captured after a call (lazy) in %.2f s%s",
                 ladder.name, bucket.size, bucket.capture_s,
                 "".join(f"; bucket {b.size} again, into the runner's pool" for b in again))

    # -- in the background -------------------------------------------------------------------
    def _start_background(self) -> None:
        if self._ladder.ranks is not None:
            raise BcgError("capture(background=True) is not available with ranks=: every rank must "
                           "capture a bucket at the same point of its calls; capture() before serving")
        with self.lock.lock:
            if self.in_background:
                raise BcgError("this GraphRunner is already capturing in the background: wait_captured() first")
            self._refuse_captured()
            with self._ladder.on_device():
                self._ladder.setup()
            self.serving = True  # calls are served from now on
            self._background_error = None
            self._stop.clear()
            # Not a daemon: an interpreter exiting under a capture aborts the process. At exit
            # (the main thread has ended) the thread stops after the bucket under way.
            thread = threading.Thread(target=self._capture_in_background, name=f"bcg-capture-{self._ladder.name}",
                                      daemon=False)
            self._background = thread
            self.lock.background += 1  # calls return copies until it ends (see PoolCallLock.views_safe)
            thread.start()  # (under the lock: a reset() waits until it can join a started thread)

    def _capture_in_background(self) -> None:
        """The background thread: the probe, then each bucket largest first, each step under the
        call lock, in thread_local mode."""
        ladder = self._ladder
        t_start = time.perf_counter()
        try:
            with ladder.on_device():
                static, _ = ladder.setup()
                self._calls, self._t_step = self.lock.calls, time.perf_counter()
                with self.lock.capture_step(), ladder.capturing(), self.ordered_with_calls():
                    with static.preserved([ladder.probe_size]):
                        ladder.probe()
                self._capture_each(sorted(ladder.sizes, reverse=True), "background", self._background_step)
        except BaseException as exc:  # (a bucket's own failure is caught in Ladder.capture)
            self._background_error = exc
            log.error("bcg.GraphRunner(%s): the background capture stopped: %s: %s",
                      ladder.name, type(exc).__name__, exc, exc_info=exc)
        finally:
            with self.lock.lock:
                self.lock.background -= 1
            ladder.capture_total_s += time.perf_counter() - t_start
            log.info("bcg.GraphRunner(%s): background capture done: %d of %d bucket(s) in %.2f s",
                     ladder.name, sum(b.captured for b in ladder.buckets.values()), len(ladder.sizes),
                     time.perf_counter() - t_start)

    @contextlib.contextmanager
    def _background_step(self, bucket: Bucket) -> Iterator[bool]:
        """One bucket of a background capture: calls get ``CALLS_SHARE`` of the time while they
        come (the last step took the rest) and a waiting call goes first; then the call lock and
        the capture lock are held for the bucket's warm-up and capture, which load the example
        into the static inputs (calls may have filled them: they get their values back)."""
        lock, ladder = self.lock, self._ladder
        step_s = time.perf_counter() - self._t_step
        lock.yield_to_calls(self._calls, step_s * CALLS_SHARE / (1 - CALLS_SHARE), self._stop)
        lock.let_callers_in()
        if self._stop.is_set() or not threading.main_thread().is_alive():
            self._stop.set()
            yield False
            return
        self._calls, self._t_step = lock.calls, time.perf_counter()
        with lock.capture_step(), ladder.capturing():
            if bucket.done:  # (a lazy call captured it meanwhile)
                yield False
                return
            if bucket.own_pool is not None:  # served by its graph until now, captured again
                ladder.free_own_pools(keep=True)
            mode, ladder.capture_error_mode = ladder.capture_error_mode, "thread_local"
            try:
                assert ladder.static is not None
                with self.ordered_with_calls(), ladder.static.preserved([bucket.size]):
                    yield True
            finally:
                ladder.capture_error_mode = mode

    @contextlib.contextmanager
    def ordered_with_calls(self) -> Iterator[None]:
        """Around a capture's work (the probe, warm-ups, captures: every driver's), under the
        call lock: the work runs after the last call's replay (which may still run on the GPU:
        the warm-ups write the static inputs and the pool), and the next call after the work,
        whatever streams the calls use (``PoolCallLock.serialize_streams``)."""
        if self._ladder.mode != "graph":
            yield
            return
        device = self._ladder.device.index or 0
        self.lock.serialize_streams(device)
        try:
            yield
        finally:
            self.lock.serialize_streams(device)

    def may_serve_eagerly(self) -> bool:
        """Whether calls may run eagerly beside a background capture, without the call lock: one
        runs now, and ``forward`` draws no random numbers (torch marks the default CUDA generator
        as capturing during every capture, and a draw from another thread then raises; not known
        before a warm-up has told)."""
        ladder = self._ladder
        return self.in_background and (ladder.mode != "graph" or ladder.draws_rng is False)

    def eager_reason(self, bucket: Bucket | None) -> str | None:
        """Beside a background capture, why a call of ``bucket`` runs eagerly rather than wait for
        the call lock: its bucket is not captured yet, or it is but a capture step holds the lock
        (a replay would wait for a whole bucket's warm-up and capture; the step may end meanwhile,
        and the call then ran eagerly for nothing). None: the call goes the usual way (its bucket
        is captured and the lock free, or failed; it is above the ladder)."""
        if bucket is None or bucket.failure is not None:
            return None
        if not bucket.captured:
            return "not_captured_yet"
        return "capture_busy" if self.lock.in_capture_step else None

    @property
    def in_background(self) -> bool:
        """A background capture runs now."""
        thread = self._background
        return thread is not None and thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """:meth:`bcg.GraphRunner.wait_captured`."""
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
            raise BcgError(f"GraphRunner({self._ladder.name}): the background capture stopped: "
                           f"{type(error).__name__}: {error}") from error
        return True

    def stop(self) -> None:
        """Stop a background capture after the bucket it is capturing, and forget it."""
        thread = self._background
        if thread is not None:
            self._refuse_join_under_lock(thread, "reset()")
            self._stop.set()
            thread.join()
        self._stop.clear()
        self._background, self._background_error = None, None
        self.serving = False

    def _refuse_join_under_lock(self, thread: threading.Thread, what: str) -> None:
        """Waiting for the capture thread while holding the call lock it needs would never end."""
        if thread is threading.current_thread():
            raise BcgError(f"{what} was called from the runner's own capture thread")
        if thread.is_alive() and self.lock.reader == threading.get_ident():
            raise BcgError(f"{what} was called inside `with runner.locked():` while a background capture "
                           "runs: it waits for the capture, which waits for that lock. Call it outside the block")

