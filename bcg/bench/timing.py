"""Timing: a synchronized host wall clock around each replay.

Every measured call is ``sync(); t0 = perf_counter(); fn(); sync(); t1``, where
``sync`` is ``torch.cuda.synchronize`` (a no-op without CUDA). A sample is thus
the end-to-end latency of one forward as a caller sees it: host launch work,
eager breakpoint work, GPU execution, and any GPU idle gap while the host falls
behind, plus one synchronize (a few microseconds). CUDA events would hide the
host side, which is exactly what breakable graphs are about, so we do not use them.
"""

from __future__ import annotations

import functools
import operator
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


class UserTime:
    """Seconds spent in the user's callbacks that :meth:`wrap` wrapped (a staged breakpoint's
    ``fits`` and ``prepare``): a call's host time less :meth:`charged` is bcg's own (``host_us_bcg``).

    The wrappers count only while :attr:`counting` is set (the host-timed calls set it); otherwise
    they pass the call through unclocked, so that the clocks add nothing to the timed replays.
    One per set of callbacks (not per process): each workload object that makes them owns one.
    """

    def __init__(self, overhead: float | None = None) -> None:
        self.seconds = 0.0  # inside the wrapped callbacks, from clock to clock, while counting
        self.calls = 0
        self.counting = False
        # per call, what the wrapper costs outside its clock reads (its frame, the calls of the
        # clock): neither the user's nor bcg's, so charged to the callbacks (see charged);
        # None: measured now
        self.overhead = _wrapper_overhead() if overhead is None else overhead

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, timed into :attr:`seconds` while :attr:`counting` (its signature kept: bcg
        reads ``fits``' arity)."""
        clock = time.perf_counter

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.counting:
                return fn(*args, **kwargs)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += clock() - t0
                self.calls += 1

        return timed

    def charged(self) -> float:
        """Seconds the wrapped callbacks cost their callers so far: :attr:`seconds` plus the
        wrapper's :attr:`overhead` per call."""
        return self.seconds + self.calls * self.overhead


def _wrapper_overhead(calls: int = 2000, rounds: int = 5) -> float:
    """Seconds per call that calling a :meth:`UserTime.wrap` wrapper of a no-op costs outside its
    clock reads: the least over ``rounds`` (a host hiccup counts as bcg's, not the wrapper's)."""
    probe = UserTime(overhead=0.0)
    probe.counting = True
    noop = probe.wrap(lambda: None)
    clock = time.perf_counter
    best = float("inf")
    for _ in range(rounds):
        t0 = clock()
        for _ in range(calls):
            pass
        t1 = clock()
        probe.seconds = 0.0
        for _ in range(calls):
            noop()
        t2 = clock()
        best = min(best, ((t2 - t1) - (t1 - t0) - probe.seconds) / calls)
    return max(best, 0.0)


def sync_fn(device: torch.device) -> Callable[[], None]:
    """``torch.cuda.synchronize`` for a CUDA device, else a no-op."""
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def timed_ms(fn: Callable[[], Any], sync: Callable[[], None], wait: bool = True) -> float:
    """Milliseconds of one synchronized call of ``fn`` (``wait=False``: until ``fn`` returns,
    i.e. the host's time to issue its work, the GPU idle at the start)."""
    sync()
    t0 = time.perf_counter()
    fn()
    if wait:
        sync()
    return (time.perf_counter() - t0) * 1e3


def sample_ms(
    fn: Callable[[], Any], sync: Callable[[], None], iters: int, warmup: int = 0, wait: bool = True
) -> list[float]:
    """``warmup`` untimed calls, then ``iters`` samples of :func:`timed_ms` (ms)."""
    for _ in range(warmup):
        fn()
    sync()
    samples = [timed_ms(fn, sync, wait) for _ in range(iters)]
    sync()
    return samples


BLOCK = 5  # timed calls of one function per round in sample_interleaved


def sample_interleaved(
    fns: dict[str, Callable[[], Any]],
    sync: Callable[[], None],
    iters: int,
    warmup: int = 0,
    on_error: Callable[[str, Exception], None] | None = None,
    block: int = BLOCK,
    seed: int = 0,
    wait: bool = True,
) -> dict[str, list[float]]:
    """``iters`` :func:`timed_ms` samples of each function, taken in rounds of short blocks (ms per name).

    Each round runs every function once as a block, in a fresh random order
    (seeded): ``warmup`` untimed calls, then up to ``block`` timed calls. A
    GPU's clocks follow its recent load (on an H200 a 50 ms replay ran 3 %
    faster right after a host-bound run than right after another graph
    replay), and a replay's host path runs faster warm: so each timed call
    follows calls of the same function, as in a serving loop, and the rounds
    spread the machine's drift over all functions alike, where long
    back-to-back blocks favour whichever ran in the better period. A function
    that raises is passed to ``on_error`` (else the error propagates) and
    dropped from later rounds; its samples so far are kept. ``wait=False``:
    each sample is the host's time until ``fn`` returns (see :func:`timed_ms`).
    """
    rng = random.Random(seed)
    active = dict(fns)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    while active and any(len(samples[name]) < iters for name in active):
        order = list(active)
        rng.shuffle(order)
        for name in order:
            fn = active[name]
            try:
                for _ in range(warmup):
                    fn()
                for _ in range(min(block, iters - len(samples[name]))):
                    samples[name].append(timed_ms(fn, sync, wait))
            except Exception as exc:
                if on_error is None:
                    raise
                del active[name]
                on_error(name, exc)
    sync()
    return samples


def mean_of_captures(samples: list[list[float]]) -> list[float]:
    """Sample by sample, the mean over the captures of one mode (one list per capture, all timed by
    one :func:`sample_interleaved` call: sample ``i`` of every list ran in the same round)."""
    if not samples or len({len(s) for s in samples}) != 1:
        raise ValueError(f"mean_of_captures: one list per capture, all of one length (got lengths "
                         f"{[len(s) for s in samples]})")
    return [statistics.fmean(column) for column in zip(*samples)]


def compiling_call(fn: Callable[..., Any], args: tuple[Any, ...], live: Any, sync: Callable[[], None]) -> dict[str, Any]:
    """One eager call of a ``torch.compile``'d ``fn`` (where it compiles, if it has not yet):
    ``{"compile_s": seconds until the device is done, "graphs_compiled": Dynamo graphs made}``."""
    import bcg
    from bcg.core.compiled import dynamo_graphs

    graphs0 = dynamo_graphs()
    t0 = time.perf_counter()
    with bcg.live_scope(live), torch.no_grad():
        fn(*args)
    sync()
    return {"compile_s": time.perf_counter() - t0, "graphs_compiled": dynamo_graphs() - graphs0}


def _paired(samples: list[float], reference: list[float], block: int,
            combine: Callable[[float, float], float]) -> float | None:
    rounds = min(len(samples), len(reference))
    per_round = [
        combine(statistics.median(samples[i:i + block]), statistics.median(reference[i:i + block]))
        for i in range(0, rounds, block)
    ]
    return statistics.median(per_round) if per_round else None


def paired_ratio(samples: list[float], reference: list[float], block: int = BLOCK) -> float | None:
    """The median over rounds of ``samples``' block median / ``reference``'s block median in the
    same round (both from one :func:`sample_interleaved` call). The two blocks of a round ran
    within moments of each other, so the machine's drift cancels in each quotient; None when
    there is no common round."""
    return _paired(samples, reference, block, operator.truediv)


def paired_difference(samples: list[float], reference: list[float], block: int = BLOCK) -> float | None:
    """:func:`paired_ratio`'s difference: the median over rounds of ``samples``' block median minus
    ``reference``'s in the same round (a drift that adds to every call of a round cancels); None
    when there is no common round."""
    return _paired(samples, reference, block, operator.sub)


def summarize(samples: list[float]) -> dict[str, float]:
    return {
        "ms_median": statistics.median(samples),
        "ms_min": min(samples),
        "ms_mean": statistics.fmean(samples),
    }


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|out - ref| / max|ref|`` in float32; exactly 0.0 when the tensors are equal."""
    out = out.detach().float()
    ref = ref.detach().float()
    if out.shape != ref.shape:
        return float("inf")
    if torch.equal(out, ref):
        return 0.0
    scale = ref.abs().max().item()
    diff = (out - ref).abs().max().item()
    return diff / scale if scale > 0 else diff
