"""A GraphRunner's serving lifecycle, measured: capture all buckets first, lazily or in the background;
sleep (``reset()``) and wake (capture again).

:func:`measure` builds fresh runners through a factory and reports, for each way of capturing,
the time from the runner's construction to the first result, the capture seconds and the pool
against the largest bucket captured alone (buckets captured largest first, or in the random
order calls bring them); the memory a ``reset()`` gives back and the time to wake; and, while a
background capture runs, the calls per second a serving thread gets, against the eager forward's.
Every call is synchronized, so its result is ready when it is counted.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import torch

import bcg

MiB = 2**20


def measure(
    forward: Callable[..., Any],
    make: Callable[..., bcg.GraphRunner],
    batch: Callable[[int], tuple[tuple[Any, ...], Any]],
    device: torch.device,
    seed: int = 0,
) -> dict[str, Any]:
    """The lifecycle report of the runners ``make(**options)`` builds (each a new one).

    Arguments:
        forward: the runners' forward, called eagerly for the eager rate.
        make: a new runner for ``options`` (``lazy=True``, or none), over one ladder.
        batch: ``batch(T)`` -> ``(inputs, live)`` of a call with ``T`` rows.
        device: where the runners run (memory figures on CUDA only).
        seed: the order lazy calls bring buckets in, and their sizes.
    """
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def reserved() -> float | None:
        """``memory_reserved()`` with no cached free block: a capture empties the cache as it
        starts (as ``torch.cuda.graph`` does), so blocks cached before it must not count."""
        if not cuda:
            return None
        sync()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(device) / MiB

    def call(runner: bcg.GraphRunner, T: int) -> None:
        inputs, live = batch(T)
        runner(*inputs, live=live)
        if cuda:  # the caller's stream only: a device-wide synchronize is refused during a capture
            torch.cuda.current_stream(device).synchronize()

    def pool_mib(runner: bcg.GraphRunner) -> float | None:
        return runner.stats()["pool_bytes"] / MiB if cuda else None

    def eager(inputs: tuple[Any, ...], live: Any) -> None:
        with bcg.live_scope(live), torch.no_grad():
            forward(*inputs)
        sync()

    def eager_rate_at(T: int) -> float:
        inputs, live = batch(T)
        n_eager, t0 = 0, time.perf_counter()
        while n_eager < 5 or time.perf_counter() - t0 < 0.5:
            eager(inputs, live)
            n_eager += 1
        return n_eager / (time.perf_counter() - t0)

    report: dict[str, Any] = {}
    # -- every bucket first, largest first; then sleep and wake ---------------------------------
    before = reserved()
    t0 = time.perf_counter()
    runner = make()
    buckets = runner.buckets
    mid = buckets[len(buckets) // 2]
    # the lazy calls' buckets in a random order, each call of a size in its bucket's range
    rng = random.Random(seed)
    order = rng.sample(buckets, len(buckets))
    sizes = [rng.randint(prev + 1, n - 1) if n - 1 > prev else n for n, prev in
             ((n, max([b for b in buckets if b < n], default=0)) for n in order)]  # (padded: T < n)
    runner.capture()
    call(runner, mid)
    first = time.perf_counter() - t0
    bucket_capture_s = runner.stats()["capture_s"][order[0]]
    captured = reserved()
    alone = runner.measure_largest_alone() / MiB if cuda else None
    pool = pool_mib(runner)
    report["capture_all"] = {
        "to_first_result_s": first,
        "capture_s": runner.stats()["capture_total_s"],
        "pool_mib": pool,
        "largest_alone_mib": alone,
        "pool_ratio_largest_first": pool / alone if pool and alone else None,
    }
    runner.reset()
    slept = reserved()
    t0 = time.perf_counter()
    runner.capture()
    call(runner, mid)
    report["sleep_wake"] = {
        "reserved_mib_before_capture": before,
        "reserved_mib_captured": captured,
        "reserved_mib_after_reset": slept,
        "freed_mib": captured - slept if captured is not None and slept is not None else None,
        "freed_of_taken": (captured - slept) / (captured - before)
        if captured is not None and slept is not None and before is not None and captured > before else None,
        "wake_to_first_result_s": time.perf_counter() - t0,
    }
    runner.reset()
    del runner
    # -- lazily, buckets in the order calls bring them -------------------------------------------
    # One eager forward first (at calls_T): what a process pays at its first eager call of the
    # forward (first uses of its ops) is not the lazy runner's, and the eager reference is warm.
    eager(*batch(mid))

    def lazy_first(T: int) -> tuple[bcg.GraphRunner, dict[str, Any]]:
        t0 = time.perf_counter()
        runner = make(lazy=True)
        call(runner, T)
        first = time.perf_counter() - t0
        stats = runner.stats()
        return runner, {
            "first_T": T,
            "to_first_result_s": first,
            # the first call's pieces: its bucket's warm-up and capture, and all the first
            # capture took (any probe run, the static inputs and the bucket)
            "first_bucket_capture_s": stats["capture_s"][order[0]],
            "first_capture_total_s": stats["capture_total_s"],
        }

    runner, report["lazy"] = lazy_first(sizes[0])
    for n in sizes[1:]:
        call(runner, n)
    pool = pool_mib(runner)
    report["lazy"].update({
        "capture_s": runner.stats()["capture_total_s"],
        "order": order,
        "sizes": sizes,
        "pool_mib": pool,
        "pool_ratio_random_order": pool / alone if pool and alone else None,
    })
    runner.reset()
    del runner
    # the same first bucket, called at its own size (no other size seen: a probe run is needed)
    runner, report["lazy_at_bucket_size"] = lazy_first(order[0])
    runner.reset()
    del runner
    # -- in the background, while a thread serves calls ------------------------------------------
    t0 = time.perf_counter()
    runner = make()
    runner.capture(background=True)
    call(runner, mid)
    first = time.perf_counter() - t0
    served, t_serve = 1, time.perf_counter()
    while not runner.wait_captured(0):  # (not stats(): its pool size reads torch's memory snapshot)
        call(runner, mid)
        served += 1
    serving_s = time.perf_counter() - t_serve
    runner.wait_captured()
    stats = runner.stats()
    report["background"] = {
        "to_first_result_s": first,
        "capture_s": stats["capture_total_s"],
        "calls_during_capture": served,
        "calls_per_s_during_capture": served / serving_s if serving_s > 0 else None,
        "eager_calls_during_capture": stats["fallbacks"]["not_captured_yet"] + stats["fallbacks"]["capture_busy"],
        "pool_mib": pool_mib(runner),
    }
    runner.reset()
    del runner
    # -- the eager forward's rate, for comparison -------------------------------------------------
    eager_rate = eager_rate_at(mid)
    report["background"]["eager_calls_per_s"] = eager_rate
    # the lazy target: one eager forward (the first call's) plus one bucket's capture: its own,
    # and the same bucket's in capture_all (in a pool already laid out)
    for lazy in (report["lazy"], report["lazy_at_bucket_size"]):
        lazy["first_call_eager_s"] = 1 / eager_rate_at(lazy["first_T"])
        lazy["eager_plus_one_capture_s"] = lazy["first_call_eager_s"] + lazy["first_bucket_capture_s"]
        lazy["capture_all_bucket_s"] = bucket_capture_s
        lazy["eager_plus_capture_all_bucket_s"] = lazy["first_call_eager_s"] + bucket_capture_s
    rate = report["background"]["calls_per_s_during_capture"]
    report["background"]["rate_ratio_to_eager"] = rate / eager_rate if rate else None
    report["calls_T"] = mid
    report["note"] = (
        "to_first_result_s: from the runner's construction to the first call's result (T = calls_T; "
        "lazy: T = first_T, in bucket order[0], against eager_plus_one_capture_s, that call's eager "
        "forward plus its bucket's warm-up and capture, and eager_plus_capture_all_bucket_s, with that "
        "bucket's warm-up and capture in capture_all instead; lazy calls have sizes[i] rows, in "
        "bucket order[i]; lazy_at_bucket_size: a first call of order[0] rows; one eager forward of "
        "calls_T rows runs before the lazy runners are made); "
        "capture_s: the runner's capture seconds (warm-ups included; background: on its thread); "
        "pool ratios against the largest bucket captured alone; reserved_mib_*: memory_reserved() "
        "after empty_cache(); freed_mib: that before and after reset(), freed_of_taken: against what "
        "the capture took; background: calls of T = calls_T made back to back while the ladder "
        "captured, against the eager forward's rate measured after"
    )
    return report
