"""bcg.GraphRunner and the bucket ladders, on a CPU (the runner in eager mode).

Eager mode runs ``forward`` on the padded static inputs with the same bucket
choice, padding, sanitizing of tensors crossing breakpoints and output slicing
as graph mode, so everything but the CUDA graphs themselves is exercised here.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import bcg
from bcg.runner.buckets import normalize_buckets, padding_ratio

from .models import TinyLlama
from .threads import run_in_threads

HIDDEN = 32


def _runner(forward, buckets, example, **kw):  # noqa: ANN001, ANN202
    kw.setdefault("progress", False)
    kw.setdefault("mode", "eager")
    return bcg.GraphRunner(forward, buckets, example_inputs=example, **kw)


# -- bucket ladders ---------------------------------------------------------------------------


def test_default_ladder_has_16_buckets_up_to_4096() -> None:
    ladder = bcg.runner.default_buckets()
    assert ladder == [16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]
    assert len(ladder) == 16
    assert all(b / a <= 2 for a, b in zip(ladder, ladder[1:]))
    assert all(b / a <= 1.5 for a, b in zip(ladder[1:], ladder[2:]))
    decode = bcg.runner.default_buckets(256, min_tokens=1)
    assert decode[:8] == [1, 2, 3, 4, 6, 8, 12, 16] and decode[-1] == 256
    assert bcg.runner.default_buckets(100) == [16, 32, 48, 64, 96, 100]


def test_geometric_buckets() -> None:
    assert bcg.runner.geometric_buckets(16, 4096) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert bcg.runner.geometric_buckets(16, 100) == [16, 32, 64, 100]
    ladder = bcg.runner.geometric_buckets(16, 4096, ratio=math.sqrt(2), multiple_of=16)
    assert ladder[0] == 16 and ladder[-1] == 4096
    assert all(b % 16 == 0 for b in ladder)
    assert ladder == sorted(set(ladder))
    assert bcg.runner.geometric_buckets(8, 8) == [8]
    for bad in ((0, 8), (8, 4)):
        with pytest.raises(ValueError):
            bcg.runner.geometric_buckets(*bad)
    with pytest.raises(ValueError, match="ratio"):
        bcg.runner.geometric_buckets(1, 8, ratio=1.0)


def test_stepped_buckets() -> None:
    assert bcg.runner.stepped_buckets(64, steps=((None, 16),)) == [1, 2, 4, 16, 32, 48, 64]
    ladder = bcg.runner.stepped_buckets(1024)
    assert ladder[:6] == [1, 2, 4, 8, 16, 24]
    assert 256 in ladder and 272 in ladder and 264 not in ladder
    assert 544 in ladder and 528 not in ladder
    assert ladder[-1] == 1024 and ladder == sorted(set(ladder))
    assert bcg.runner.stepped_buckets(100, steps=((None, 32),), head=())[-1] == 100  # max always included
    assert bcg.runner.stepped_buckets(3) == [1, 2, 3]


def test_pick_bucket_and_padding_ratio() -> None:
    ladder = [16, 32, 64]
    assert [bcg.runner.pick_bucket(ladder, t) for t in (0, 1, 15, 16, 17, 32, 33, 64, 65)] == [
        16, 16, 16, 16, 32, 32, 64, 64, None,
    ]
    assert padding_ratio(64, 16) == 0.75
    assert padding_ratio(16, 16) == 0.0


def test_normalize_buckets() -> None:
    assert normalize_buckets([32, 16, 16, 64]) == [16, 32, 64]
    with pytest.raises(ValueError):
        normalize_buckets([])
    with pytest.raises(ValueError):
        normalize_buckets([0, 16])
    with pytest.raises(TypeError):
        normalize_buckets([16.5])


# -- the runner end to end --------------------------------------------------------------------


def _llama(returning: bool = False) -> TinyLlama:
    torch.manual_seed(0)
    return TinyLlama(layers=2, hidden=HIDDEN, heads=4, kv_heads=2, intermediate=64, device="cpu",
                     dtype=torch.float32, returning=returning)


def _live(T: int) -> dict:
    return {"lengths": [T]}


def _padded(x: torch.Tensor, n: int, dim: int = 0) -> torch.Tensor:
    pad = list(x.shape)
    pad[dim] = n - x.shape[dim]
    return torch.cat([x, torch.zeros(pad, dtype=x.dtype)], dim)


@pytest.mark.parametrize("returning", [False, True])
def test_eager_runner_matches_forward_for_every_bucket(returning: bool) -> None:
    model = _llama(returning)
    buckets = [4, 8, 16]
    runner = _runner(model, buckets, (torch.randn(5, HIDDEN), torch.arange(5)), live=_live)
    runner.capture()
    gen = torch.Generator().manual_seed(0)
    for n in buckets:
        for T in sorted({n, n - 1, 1, int(torch.randint(1, n + 1, (1,), generator=gen))}):
            x = torch.randn(T, HIDDEN, generator=gen)
            pos = torch.arange(T)
            y = runner(x, pos, live=_live(T))
            assert runner.bucket_for(T) == n or T <= n // 2
            assert y.shape == (T, HIDDEN)
            with bcg.live_scope(_live(T)), torch.no_grad():
                unpadded = model(x, pos)
                bucket = runner.bucket_for(T)
                padded = model(_padded(x, bucket), _padded(pos, bucket))[:T]
            torch.testing.assert_close(y, unpadded, rtol=1e-5, atol=1e-5)
            assert torch.equal(y, padded)  # the same ops on the same shapes
    stats = runner.stats()
    assert stats["fallbacks"] == {"too_large": 0, "padding_waste": 0, "capture_failed": 0, "not_captured_yet": 0, "capture_busy": 0, "staged_unfit": 0}
    assert sum(stats["replays"].values()) == stats["calls"] == stats["graph_calls"]
    assert all(stats["replays"][b] > 0 for b in buckets)


def test_a_lazy_runner_serves_without_capture_and_captures_each_bucket_at_its_first_call() -> None:
    """lazy=True: a call whose bucket is not captured yet runs forward eagerly (unpadded) and then
    captures that bucket; the next call of it replays it. capture() captures what is left."""
    model = _llama()
    runner = _runner(model, [4, 8, 16], (torch.randn(5, HIDDEN), torch.arange(5)), live=_live, lazy=True)
    assert runner.captured_buckets == []
    gen = torch.Generator().manual_seed(1)

    def call(T: int) -> torch.Tensor:
        x, pos = torch.randn(T, HIDDEN, generator=gen), torch.arange(T)
        y = runner(x, pos, live=_live(T))
        with bcg.live_scope(_live(T)), torch.no_grad():
            torch.testing.assert_close(y, model(x, pos), rtol=1e-5, atol=1e-5)
        return y

    call(6)  # bucket 8: eager, then captured
    stats = runner.stats()
    assert stats["fallbacks"]["not_captured_yet"] == 1 and stats["graph_calls"] == 0
    assert runner.captured_buckets == [8] and stats["captures"] == {"capture()": 0, "lazy": 1, "background": 0}
    call(7)  # bucket 8 again: its graph (eager mode: the padded forward)
    stats = runner.stats()
    assert stats["fallbacks"]["not_captured_yet"] == 1 and stats["replays"][8] == 1
    call(12)  # bucket 16
    assert runner.captured_buckets == [8, 16]
    runner.capture()  # the rest
    stats = runner.stats()
    assert runner.captured_buckets == [4, 8, 16] and stats["captures"] == {"capture()": 1, "lazy": 2, "background": 0}
    call(3)
    assert runner.stats()["fallbacks"]["not_captured_yet"] == 2 and runner.stats()["replays"][4] == 1


def test_a_runner_lazy_k_captures_a_bucket_at_its_kth_call_only() -> None:
    """lazy=3: a bucket's first two calls run eagerly and capture nothing, its third runs eagerly
    and captures it, its fourth replays; another bucket keeps its own count; reset() starts over."""
    model = _llama()
    runner = _runner(model, [4, 8, 16], (torch.randn(5, HIDDEN), torch.arange(5)), live=_live, lazy=3)
    gen = torch.Generator()
    gen.seed()  # fresh inputs each run

    def call(T: int) -> None:
        x, pos = torch.randn(T, HIDDEN, generator=gen), torch.arange(T)
        y = runner(x, pos, live=_live(T))
        with bcg.live_scope(_live(T)), torch.no_grad():
            torch.testing.assert_close(y, model(x, pos), rtol=1e-5, atol=1e-5)

    for k, T in enumerate((6, 7), start=1):
        call(T)
        assert runner.captured_buckets == [] and runner.stats()["fallbacks"]["not_captured_yet"] == k
    call(12)  # bucket 16's first call: bucket 8's count is its own
    assert runner.captured_buckets == []
    call(5)  # bucket 8's third call: captured after it
    stats = runner.stats()
    assert runner.captured_buckets == [8] and stats["captures"]["lazy"] == 1
    assert stats["fallbacks"]["not_captured_yet"] == 4
    call(8)
    assert runner.stats()["replays"][8] == 1
    runner.reset()
    call(6)
    assert runner.captured_buckets == []


def test_a_lazy_runners_input_buffers_exist_before_any_call() -> None:
    model = _llama()
    runner = _runner(model, [4, 8], (torch.randn(5, HIDDEN), torch.arange(5)), live=_live, lazy=True)
    x, pos = runner.input_buffers(6)
    x.copy_(torch.randn(6, HIDDEN))
    pos.copy_(torch.arange(6))
    with bcg.live_scope(_live(6)), torch.no_grad():
        expected = model(x.clone(), pos.clone())
    torch.testing.assert_close(runner(x, pos, live=_live(6)), expected, rtol=1e-5, atol=1e-5)
    assert runner.captured_buckets == [8]


def _blocking_capture_live(bucket: int) -> tuple[Any, threading.Event, threading.Event, list[threading.Thread]]:
    """``(capture_live, inside, release, threads)``: a capture_live that, on the capture thread at
    ``bucket``, records that thread, sets ``inside`` and blocks (holding the call lock) until
    ``release`` is set."""
    inside, release = threading.Event(), threading.Event()
    threads: list[threading.Thread] = []

    def capture_live(n: int) -> dict:
        if threading.current_thread() is not threading.main_thread() and n == bucket:
            threads.append(threading.current_thread())
            inside.set()
            assert release.wait(30)
        return _live(n)

    return capture_live, inside, release, threads


def test_a_background_capture_serves_calls_eagerly_until_each_bucket_is_captured() -> None:
    """capture(background=True) returns at once. While the capture thread is inside a bucket's
    warm-up (holding the call lock), calls of buckets not captured yet run eagerly without
    waiting; once it is done every bucket replays, counted as captured by "background"."""
    model = _llama()
    capture_live, inside, release, capture_thread = _blocking_capture_live(16)

    runner = _runner(model, [4, 8, 16], (torch.randn(5, HIDDEN), torch.arange(5)), live=capture_live)
    assert runner.capture(background=True) is runner
    assert inside.wait(30) and runner.stats()["capturing"]
    gen = torch.Generator().manual_seed(2)

    def call(T: int) -> None:
        x, pos = torch.randn(T, HIDDEN, generator=gen), torch.arange(T)
        y = runner(x, pos, live=_live(T))
        with bcg.live_scope(_live(T)), torch.no_grad():
            torch.testing.assert_close(y, model(x, pos), rtol=1e-5, atol=1e-5)

    for T in (3, 6, 12):  # every bucket still uncaptured: eager, not blocked by the capture
        call(T)
    assert runner.stats()["fallbacks"]["not_captured_yet"] == 3 and runner.captured_buckets == []
    release.set()
    assert runner.wait_captured(30)
    assert capture_thread and not capture_thread[0].is_alive()
    stats = runner.stats()
    assert runner.captured_buckets == [4, 8, 16] and not stats["capturing"]
    assert stats["captures"] == {"capture()": 0, "lazy": 0, "background": 3}
    for T in (3, 6, 12, 16):
        call(T)
    stats = runner.stats()
    assert stats["fallbacks"]["not_captured_yet"] == 3 and stats["graph_calls"] == 4
    for background in (False, True):  # nothing left to capture
        with pytest.raises(bcg.BcgError, match="already captured"):
            runner.capture(background=background)


def test_a_call_of_a_captured_bucket_runs_eagerly_while_a_capture_step_holds_the_lock() -> None:
    """Bucket 16 is captured; the capture thread is inside bucket 8's (holding the call lock): a
    call of bucket 16 does not wait for it but runs eagerly (fallback "capture_busy"); once the
    ladder is captured it replays. A call on the runner's own buffers still waits (they are
    what the capture rewrites)."""
    model = _llama()
    inside, release = threading.Event(), threading.Event()

    def capture_live(n: int) -> dict:
        if threading.current_thread() is not threading.main_thread() and n == 8:
            inside.set()
            assert release.wait(30)
        return _live(n)

    runner = _runner(model, [4, 8, 16], (torch.randn(5, HIDDEN), torch.arange(5)), live=capture_live)
    runner.capture(background=True)
    assert inside.wait(30) and runner.captured_buckets == [16]
    gen = torch.Generator().manual_seed(3)
    x, pos = torch.randn(12, HIDDEN, generator=gen), torch.arange(12)
    threading.Timer(10, release.set).start()  # (a call that waits would block until then)
    t0 = time.monotonic()
    y = runner(x, pos, live=_live(12))
    assert time.monotonic() - t0 < 5 and not release.is_set()
    with bcg.live_scope(_live(12)), torch.no_grad():
        torch.testing.assert_close(y, model(x, pos), rtol=1e-5, atol=1e-5)
    assert runner.stats()["fallbacks"]["capture_busy"] == 1
    release.set()
    assert runner.wait_captured(30) and runner.captured_buckets == [4, 8, 16]
    runner(x, pos, live=_live(12))
    stats = runner.stats()
    assert stats["fallbacks"]["capture_busy"] == 1 and stats["graph_calls"] == 1


def test_calls_on_the_runners_own_buffers_wait_for_the_bucket_being_captured() -> None:
    """input_buffers() are the static inputs a capture rewrites: a call on them takes the call
    lock, so it runs after the bucket's capture, with its own values."""
    model = _llama()
    capture_live, inside, release, _ = _blocking_capture_live(8)

    runner = _runner(model, [4, 8], (torch.randn(5, HIDDEN), torch.arange(5)), live=capture_live,
                     lazy=True)  # (input_buffers before any capture)
    x, pos = runner.input_buffers(6)
    x.copy_(torch.randn(6, HIDDEN))
    pos.copy_(torch.arange(6))
    with bcg.live_scope(_live(6)), torch.no_grad():
        expected = model(x.clone(), pos.clone())
    runner.capture(background=True)
    assert inside.wait(30)
    done = threading.Event()
    result: list[torch.Tensor] = []

    def caller() -> None:
        result.append(runner(x, pos, live=_live(6)).clone())
        done.set()

    thread = threading.Thread(target=caller)
    thread.start()
    assert not done.wait(0.3)  # waits for the bucket's capture (which holds the lock)
    release.set()
    thread.join(30)
    assert done.is_set()
    torch.testing.assert_close(result[0], expected, rtol=1e-5, atol=1e-5)
    assert runner.wait_captured(30)


def test_reset_stops_a_background_capture_and_capture_starts_again() -> None:
    model = _llama()
    capture_live, inside, release, _ = _blocking_capture_live(16)

    runner = _runner(model, [4, 8, 16], (torch.randn(5, HIDDEN), torch.arange(5)), live=capture_live)
    runner.capture(background=True)
    assert inside.wait(30)
    threading.Timer(0.2, release.set).start()
    runner.reset()  # stops after the bucket under way
    assert not runner.stats()["capturing"] and runner.captured_buckets == []
    assert runner.wait_captured(0)
    release.set()
    runner.capture()
    assert runner.captured_buckets == [4, 8, 16] and runner.stats()["captures"]["capture()"] == 3


def test_waiting_for_a_background_capture_inside_locked_is_refused_not_a_deadlock() -> None:
    model = _llama()
    runner = _runner(model, [4, 8, 16], (torch.randn(5, HIDDEN), torch.arange(5)), live=_live)
    with runner.locked():  # the capture thread, started inside, waits for this lock
        runner.capture(background=True)
        for wait in (runner.reset, runner.wait_captured, runner.capture):
            with pytest.raises(bcg.BcgError, match="locked"):
                wait()
        assert runner.stats()["capturing"]
    assert runner.wait_captured(30) and runner.captured_buckets == [4, 8, 16]


def test_calls_return_copies_while_a_background_capture_runs_except_inside_locked() -> None:
    """A background capture writes the pool the returned views live in: views are safe only
    where no capture can run before the caller reads them."""
    from bcg.runner.pool_lock import PoolCallLock

    lock = PoolCallLock()
    assert lock.views_safe()
    lock.background += 1
    assert not lock.views_safe()
    lock.reader = threading.get_ident()  # inside locked()
    assert lock.views_safe()
    lock.reader = None
    lock.background -= 1
    assert lock.views_safe()


def test_a_background_capture_is_refused_with_ranks() -> None:
    class _Ranks:  # (never used: refused before anything runs)
        same_inputs = True

    runner = _runner(_llama(), [4], (torch.randn(5, HIDDEN), torch.arange(5)), live=_live,
                     ranks=_Ranks())  # type: ignore[arg-type]
    with pytest.raises(bcg.BcgError, match="ranks"):
        runner.capture(background=True)


def test_a_runner_that_is_not_lazy_refuses_calls_before_capture() -> None:
    runner = _runner(_llama(), [4, 8], (torch.randn(5, HIDDEN), torch.arange(5)), live=_live)
    with pytest.raises(bcg.ReplayError, match="not captured"):
        runner(torch.randn(3, HIDDEN), torch.arange(3), live=_live(3))


@bcg.breakpoint
def _partial_returning(x: torch.Tensor) -> torch.Tensor:
    """Writes only the real rows of its result; the padded rows are NaN (poisoned memory)."""
    T = bcg.live()
    out = torch.full_like(x, float("nan"))
    out[:T] = x[:T] * 2
    return out


@bcg.breakpoint(mutates=("out",))
def _partial_into(x: torch.Tensor, out: torch.Tensor) -> None:
    T = bcg.live()
    out[:T] = x[:T] + 1


class _CrossRow(torch.nn.Module):
    """Each breakpoint leaves NaN in padded rows, and the next op mixes all rows (a sum over tokens)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.w = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w(x)
        a = _partial_returning(h)
        h = h + a.sum(0, keepdim=True) / 64
        out = torch.full_like(h, float("nan"))
        _partial_into(h, out)
        return self.w(out + out.sum(0, keepdim=True) / 64)


def _assert_call_equals_eager_without_nan(runner: bcg.GraphRunner, model: torch.nn.Module, T: int) -> None:
    """A call of ``T`` fresh random rows (live metadata ``T``) equals ``model`` run eagerly, with no NaN."""
    x = torch.randn(T, HIDDEN)
    y = runner(x, live=T)
    with bcg.live_scope(T), torch.no_grad():
        expected = model(x)
    assert not torch.isnan(y).any()
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_rows_crossing_breakpoints_are_zeroed_so_padding_never_leaks() -> None:
    model = _CrossRow()
    runner = _runner(model, [8, 32], (torch.randn(3, HIDDEN),), live=lambda n: n)
    runner.capture()
    for T in (1, 5, 8, 9, 31, 32):
        _assert_call_equals_eager_without_nan(runner, model, T)
        full = runner.bucket_outputs(runner.bucket_for(T))
        assert not torch.isnan(full).any()  # padded rows too

    # Without sanitizing, the NaN in padded rows reaches the real rows through the sum.
    unsafe = _runner(model, [8, 32], (torch.randn(3, HIDDEN),), live=lambda n: n, sanitize=False)
    unsafe.capture()
    assert torch.isnan(unsafe(torch.randn(5, HIDDEN), live=5)).all()
    assert not torch.isnan(unsafe(torch.randn(8, HIDDEN), live=8)).any()  # T = bucket: no padding


@pytest.mark.parametrize("first_T", [5, 8])
def test_a_lazy_runners_first_call_tells_its_capture_which_rows_to_zero(first_T: int) -> None:
    """The first call's eager run (T not a bucket size) is watched as a run at its size, so its
    bucket's capture runs forward once more (the warm-up) instead of twice (a probe run before);
    at T equal to the bucket a probe run at another size is still needed. Either way, padded
    calls after it never leak the NaN of padded rows."""
    model = _CrossRow()
    runs = [0]

    def forward(x: torch.Tensor) -> torch.Tensor:
        runs[0] += 1
        return model(x)

    runner = _runner(forward, [8, 32], (torch.randn(3, HIDDEN),), live=lambda n: n, lazy=True)
    for k, T in enumerate((first_T, 3, 7, 20, 1)):
        _assert_call_equals_eager_without_nan(runner, model, T)
        if k == 0:  # the call's run and the warm-up, and at T = 8 a probe run
            assert runs[0] == (2 if first_T != 8 else 3)
    assert runner.captured_buckets == [8, 32] and runner.stats()["fallbacks"]["not_captured_yet"] == 2


def test_a_lazy_runners_first_call_runs_forward_as_it_is() -> None:
    """The watched first call is the plain eager forward: segment code that reads bcg.live() (which a
    capture refuses) gives its result; the bucket's capture then fails, and calls stay eager."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * bcg.live()

    runner = _runner(forward, [8], (torch.randn(3, HIDDEN),), live=lambda n: n, lazy=True)
    x = torch.randn(5, HIDDEN)
    torch.testing.assert_close(runner(x, live=5), x * 5)
    assert 8 in runner.failed_buckets and "bcg.live()" in runner.failed_buckets[8]
    torch.testing.assert_close(runner(x, live=2), x * 2)
    assert runner.stats()["fallbacks"]["capture_failed"] == 1


def test_a_lazy_runners_watched_first_call_survives_what_it_cannot_record() -> None:
    """A tensor crossing a breakpoint that the watching cannot record (a sparse one: no storage)
    stops the watching, not the call; the bucket's capture, which must record it, fails."""
    @bcg.breakpoint
    def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.to_sparse()

    def forward(x: torch.Tensor) -> torch.Tensor:
        y, s = split(x)
        return y + s.to_dense()

    runner = _runner(forward, [8], (torch.randn(3, HIDDEN),), lazy=True)
    x = torch.randn(5, HIDDEN)
    torch.testing.assert_close(runner(x), x * 3)
    assert 8 in runner.failed_buckets
    torch.testing.assert_close(runner(x[:4]), x[:4] * 3)


def test_sanitizing_follows_the_dims_that_grow_with_the_bucket() -> None:
    """A by-reference cache whose size happens to equal a bucket is left alone, and a
    ``[heads, T, dim]`` tensor at a bucket equal to ``heads`` is zeroed along T only."""
    heads = 8
    cache = torch.arange(8 * 4, dtype=torch.float32).view(8, 4)  # 8 == a bucket, but fixed shape
    seen: list[torch.Tensor] = []

    @bcg.breakpoint(mutates=("cache", "out"))
    def write(x: torch.Tensor, cache: torch.Tensor, out: torch.Tensor) -> None:
        T = bcg.live()
        out[:, :T] = x[:, :T] * 3
        cache[0].add_(1)

    @bcg.breakpoint
    def look(t: torch.Tensor) -> None:
        seen.append(t.clone())

    def forward(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        h = x.t().unsqueeze(0).expand(heads, -1, -1).contiguous()  # [heads, T, 4]
        out = torch.full_like(h, float("nan"))
        write(h, cache, out)
        look(out)
        return out

    runner = _runner(forward, [8, 16], (torch.randn(4, 3), cache), pad_dim=(1, None), live=lambda n: n)
    runner.capture()
    before = cache.clone()
    x = torch.randn(4, 5)
    seen.clear()
    y = runner(x, cache, live=5)
    assert y.shape == (heads, 5, 4)
    torch.testing.assert_close(y, (x.t() * 3).expand(heads, -1, -1))
    crossed = seen[0]
    assert crossed.shape == (heads, 8, 4)
    assert torch.equal(crossed[:, 5:], torch.zeros(heads, 3, 4))  # zeroed along T, not heads
    assert torch.equal(cache[1:], before[1:]) and torch.equal(cache[0], before[0] + 1)  # cache untouched


@pytest.mark.parametrize("returned", [False, True], ids=["argument", "returned"])
def test_an_additive_key_mask_crossing_breakpoints_keeps_its_minus_inf(returned: bool) -> None:
    """A ``[T, T]`` mask with ``-inf`` in the padded key columns, crossing breakpoints (an argument
    of a breakpoint without ``mutates=``, or a breakpoint's result): the runner zeroes its padded
    rows, not the real rows' masked columns, so a padded call equals eager."""
    weights = [torch.randn(HIDDEN, HIDDEN) / HIDDEN**0.5 for _ in range(6)]

    @bcg.breakpoint
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.softmax(q @ k.T / HIDDEN**0.5 + mask, dim=-1) @ v

    @bcg.breakpoint
    def key_mask(valid: torch.Tensor) -> torch.Tensor:
        return torch.zeros(valid.shape[0], valid.shape[0]).masked_fill(valid[None, :] == 0, float("-inf"))

    def forward(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        if returned:
            mask = key_mask(valid)
        else:
            mask = torch.zeros(x.shape[0], x.shape[0]).masked_fill(valid[None, :] == 0, float("-inf"))
        for layer in range(2):
            q, k, v = (x @ weights[3 * layer + i] for i in range(3))
            x = x + attention(q, k, v, mask)
        return x

    runner = _runner(forward, [8, 16], (torch.randn(4, HIDDEN), torch.ones(4)))
    runner.capture()
    for T in (5, 11):
        x = torch.randn(T, HIDDEN)
        torch.testing.assert_close(runner(x, torch.ones(T)), forward(x, torch.ones(T)))


def test_nan_past_t_in_a_real_row_is_zeroed_along_every_dim_that_grows() -> None:
    """A breakpoint that leaves NaN past ``T`` in the real rows of a ``[T, T]`` result (it writes
    only ``[:T, :T]`` of NaN-filled memory): a later sum over the row stays finite and equals eager."""

    @bcg.breakpoint
    def scores(x: torch.Tensor) -> torch.Tensor:
        T = bcg.live()
        out = torch.full((x.shape[0], x.shape[0]), float("nan"))
        out[:T, :T] = x[:T] @ x[:T].T
        return out

    def forward(x: torch.Tensor) -> torch.Tensor:
        return scores(x * 2).sum(dim=1, keepdim=True) * x

    runner = _runner(forward, [8, 16], (torch.randn(4, HIDDEN),), live=lambda n: n)
    runner.capture()
    x = torch.randn(6, HIDDEN)
    y = runner(x, live=6)
    assert torch.isfinite(y).all()
    with bcg.live_scope(6):
        torch.testing.assert_close(y, forward(x))


def test_an_unfit_call_on_the_runners_own_buffers_runs_eagerly_under_the_call_lock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A call no staged form fits (``StagedTiers(breakable=False)``) runs eagerly; on the runner's
    own buffers that eager run reads what another thread's call would write, so it holds the lock."""
    held: list[bool] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        held.append(runner._lock.lock._is_owned())  # (the pool's call lock, an RLock)
        return x * 2

    runner = _runner(forward, [4, 8], (torch.randn(2, 3),))
    runner.capture()
    buffers = runner.input_buffers(3)
    x = torch.randn(3, 3)
    buffers[0].copy_(x)

    def unfit(*args: object, **kwargs: object) -> None:
        raise bcg.errors.NoFormFitsError("no staged form fits")  # what such a bucket's replay raises

    monkeypatch.setattr(runner._ladder, "run_eager", unfit)
    held.clear()
    torch.testing.assert_close(runner(*buffers), x * 2)
    assert runner.stats()["fallbacks"]["staged_unfit"] == 1
    assert held == [True]


def test_tensors_that_existed_before_the_run_are_never_sanitized() -> None:
    """A plain (non-Parameter) tensor held by the model, shaped like a token tensor at the
    largest bucket (``[16, H]``, bucket 16), passed to a breakpoint that declares no
    ``mutates`` (so every argument crosses it), keeps its rows past T."""
    table = torch.randn(16, HIDDEN)
    original = table.clone()

    @bcg.breakpoint
    def lookup(h: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        T = bcg.live()
        out = torch.full_like(h, float("nan"))
        out[:T] = h[:T] + table[:T]
        return out

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        a = lookup(h, table)
        return a + a.sum(0, keepdim=True) + table.sum(0, keepdim=True)

    runner = _runner(forward, [4, 8, 16], (torch.randn(3, HIDDEN),), live=lambda n: n)
    runner.capture()
    for T in (1, 5, 16, 9):
        x = torch.randn(T, HIDDEN)
        y = runner(x, live=T)
        with bcg.live_scope(T), torch.no_grad():
            expected = forward(x)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(table, original)


def test_decode_style_batch_bucketing_with_pad_dim_1() -> None:
    """Bucketing over the batch, padded along dim 1 of ``[2, B, H]`` (per-bucket buffers)."""
    torch.manual_seed(2)
    emb = torch.nn.Embedding(50, HIDDEN)
    lin = torch.nn.Linear(HIDDEN, HIDDEN)

    @bcg.breakpoint
    def scale(h: torch.Tensor) -> torch.Tensor:
        B = bcg.live()
        out = torch.full_like(h, float("nan"))
        out[:, :B] = h[:, :B] * 0.5
        return out

    def forward(ids: torch.Tensor, pos: torch.Tensor, flag: str) -> torch.Tensor:
        assert flag == "decode"
        h = emb(ids) + pos[..., None].float()  # [2, B, H]
        h = scale(lin(h))
        return lin(h + h.sum(1, keepdim=True))

    ids = torch.randint(0, 50, (2, 3))
    runner = _runner(forward, [1, 2, 4, 8], (ids, torch.zeros(2, 3, dtype=torch.long), "decode"),
                     pad_dim=1, live=lambda n: n)
    runner.capture()
    for B in (1, 2, 3, 4, 5, 8):
        ids = torch.randint(0, 50, (2, B))
        pos = torch.randint(0, 9, (2, B))
        y = runner(ids, pos, "decode", live=B)
        with bcg.live_scope(B), torch.no_grad():
            expected = forward(ids, pos, "decode")
        assert y.shape == (2, B, HIDDEN)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pad_dim", [0, 1])
def test_inputs_built_in_the_runner_buffers_give_the_same_outputs(pad_dim: int) -> None:
    """``input_buffers(T)``: shared buffers (pad_dim 0) and per-bucket ones (pad_dim 1, a
    leading dim of 2), a value input passed through; outputs as with the caller's tensors."""
    torch.manual_seed(3)
    lin = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(x: torch.Tensor, flag: str) -> torch.Tensor:
        assert flag == "on"
        return lin(x) * 2

    shape = (5, HIDDEN) if pad_dim == 0 else (2, 5, HIDDEN)
    runner = _runner(forward, [4, 8, 16], (torch.randn(shape), "on"), pad_dim=pad_dim)
    with pytest.raises(bcg.ReplayError, match="not captured"):
        runner.input_buffers(4)
    runner.capture()
    with pytest.raises(ValueError, match="no bucket holds T=17"):
        runner.input_buffers(17)
    gen = torch.Generator().manual_seed(4)
    for T in (16, 3, 8, 11, 1):
        size = list(shape)
        size[pad_dim] = T
        x = torch.randn(size, generator=gen)
        buf, flag = runner.input_buffers(T)
        assert flag == "on" and buf.shape == x.shape
        buf.copy_(x)
        y = runner(buf, flag, live=None).clone()
        with torch.no_grad():
            expected = forward(x, "on")
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(runner(x, "on", live=None), y)
    stats = runner.stats()  # each T ran its own bucket, the handed buffers' and a copied input's alike
    assert stats["replays"] == {4: 4, 8: 2, 16: 4}
    assert stats["calls"] == stats["graph_calls"] == 10


def test_input_buffers_calls_still_fall_back_for_padding_waste() -> None:
    lin = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return lin(x) + 1

    runner = _runner(forward, [4, 16], (torch.randn(5, HIDDEN),), max_padding_ratio=0.5)
    runner.capture()
    buf, = runner.input_buffers(5)  # bucket 16: 11 of its 16 rows would be padding
    x = torch.randn(5, HIDDEN)
    buf.copy_(x)
    y = runner(buf)
    with torch.no_grad():
        torch.testing.assert_close(y, forward(x), rtol=1e-5, atol=1e-5)
    stats = runner.stats()
    assert stats["fallbacks"]["padding_waste"] == 1 and stats["replays"] == {4: 0, 16: 0}
    assert stats["calls"] == 1 and stats["graph_calls"] == 0 and stats["padding_ratio"] == 0.0
    buf, = runner.input_buffers(3)  # bucket 4: 1 padded row of 4
    buf.copy_(x[:3])
    runner(buf)
    stats = runner.stats()
    assert stats["replays"] == {4: 1, 16: 0} and stats["calls"] == 2 and stats["graph_calls"] == 1
    assert stats["padding_ratio"] == pytest.approx(0.25)


def test_outputs_are_sliced_only_along_dims_that_grow_with_the_bucket() -> None:
    const = torch.arange(16.0)

    def forward(x: torch.Tensor) -> tuple:
        scores = x @ x.t()  # [T, T]
        return x * 2, scores, const * 1, x.sum(), "tag", x.shape[0]

    runner = _runner(forward, [4, 16], (torch.randn(3, 16),))
    runner.capture()
    x = torch.randn(3, 16)
    y, scores, c, total, tag, rows = runner(x)
    assert torch.equal(y, x * 2)
    torch.testing.assert_close(scores, x @ x.t())  # both dims sliced
    assert c.shape == (16,)  # fixed shape equal to a bucket size: returned whole
    torch.testing.assert_close(total, x.sum())
    assert tag == "tag" and rows == 4  # frozen non-tensor results are the bucket's
    y16, scores16, c16, *_ = runner(torch.randn(16, 16))
    assert y16.shape == (16, 16) and scores16.shape == (16, 16) and torch.equal(c16, const)


@pytest.mark.parametrize("sanitize", [True, False])
def test_padded_rows_of_the_static_inputs_are_zero(sanitize: bool) -> None:
    """In-graph masking (sanitize) or host-side zeroing of the tails: a sum over all rows sees T rows."""

    def forward(x: torch.Tensor, pos: torch.Tensor) -> tuple:
        return x.sum(0), pos.sum(), (x != 0).sum()

    runner = _runner(forward, [8], (torch.randn(2, 3), torch.arange(2)), sanitize=sanitize)
    runner.capture()
    runner(torch.full((8, 3), 7.0), torch.full((8,), 5))  # fill every row first
    x = torch.randn(3, 3) + 10
    total, pos_total, nonzero = runner(x, torch.tensor([1, 2, 3]))
    torch.testing.assert_close(total, x.sum(0))
    assert int(pos_total) == 6 and int(nonzero) == 9


def test_outputs_are_views_unless_copy_outputs() -> None:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    view_runner = _runner(forward, [8], (torch.randn(2, 4),))
    copy_runner = _runner(forward, [8], (torch.randn(2, 4),), copy_outputs=True)
    for runner in (view_runner, copy_runner):
        runner.capture()
    x = torch.randn(3, 4)
    v = view_runner(x)
    c = copy_runner(x)
    assert torch.equal(v, c)
    assert v._base is not None and v.data_ptr() == view_runner.bucket_outputs(8).data_ptr()
    assert c._base is None and c.is_contiguous()


# -- guards -------------------------------------------------------------------------------------


def _guarded_runner():  # noqa: ANN202
    def forward(x: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
        return x * scale + pos[:, None]

    runner = _runner(forward, [4, 8], (torch.randn(2, 6), torch.arange(2), 2.0))
    runner.capture()
    return runner


@pytest.mark.parametrize(
    ("args", "error", "pattern"),
    [
        ((torch.randn(3, 6), torch.arange(3)), TypeError, r"takes 3 input\(s\).*2 were given"),
        ((torch.randn(3, 6, dtype=torch.float64), torch.arange(3), 2.0), TypeError,
         r"input 0 has dtype torch.float64; expected a torch.float32 tensor on cpu of shape \(T, 6\)"),
        ((torch.randn(3, 6), torch.arange(3, dtype=torch.int32), 2.0), TypeError,
         r"input 1 has dtype torch.int32; expected a torch.int64 tensor"),
        ((torch.randn(3, 5), torch.arange(3), 2.0), ValueError,
         r"input 0 has shape \(3, 5\); expected .* of shape \(T, 6\), T along dim 0"),
        ((torch.randn(3, 6, 1), torch.arange(3), 2.0), ValueError, r"input 0 has shape \(3, 6, 1\)"),
        ((torch.randn(3, 6), torch.arange(4), 2.0), ValueError,
         r"input 1 has 4 rows along its pad dim 0 but input 0 has 3"),
        ((torch.randn(3, 6), [0, 1, 2], 2.0), TypeError, r"input 1 is a list; expected a torch.int64 tensor"),
        ((torch.randn(3, 6), torch.arange(3), 3.0), ValueError, r"input 2 is 3.0; expected the value 2.0"),
        ((torch.randn(3, 6, device="meta"), torch.arange(3), 2.0), ValueError,
         r"input 0 is on meta; expected a torch.float32 tensor on cpu"),
    ],
)
def test_guards_name_the_input_and_come_before_any_side_effect(args, error, pattern) -> None:  # noqa: ANN001
    runner = _guarded_runner()
    runner(torch.ones(4, 6), torch.arange(4), 2.0)
    before = runner.stats()
    static = runner.bucket_outputs(4).clone()
    buffers = [b.clone() for b in runner._ladder.static.buffers()]
    with pytest.raises(error, match=pattern):
        runner(*args)
    assert runner.stats() == before
    assert torch.equal(runner.bucket_outputs(4), static)
    assert all(torch.equal(a, b) for a, b in zip(buffers, runner._ladder.static.buffers()))


def test_by_reference_inputs_must_be_the_example_tensor() -> None:
    cache = torch.zeros(8, 4)

    def forward(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache[: x.shape[0]] += x
        return x + cache[: x.shape[0]]

    runner = _runner(forward, [4, 8], (torch.randn(2, 4), cache), pad_dim=[0, None])
    runner.capture()
    cache.zero_()
    y = runner(torch.ones(3, 4), cache)
    assert torch.equal(y, torch.full((3, 4), 2.0))
    with pytest.raises(ValueError, match=r"input 1 is another tensor; expected the same torch.float32 tensor"):
        runner(torch.ones(3, 4), cache.clone())


def test_constructor_validation() -> None:
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="input 1 has shape"):
        bcg.GraphRunner(lambda a, b: a, [4], example_inputs=(x, torch.tensor(1.0)), mode="eager")
    with pytest.raises(ValueError, match="at least one padded tensor"):
        bcg.GraphRunner(lambda a: a, [4], example_inputs=(x,), pad_dim=[None], mode="eager")
    with pytest.raises(ValueError, match="pad_dim has 2 entries"):
        bcg.GraphRunner(lambda a: a, [4], example_inputs=(x,), pad_dim=[0, None], mode="eager")
    with pytest.raises(ValueError, match="input 1 is a int"):
        bcg.GraphRunner(lambda a, b: a, [4], example_inputs=(x, 3), pad_dim=[0, 0], mode="eager")
    with pytest.raises(ValueError, match="max_padding_ratio"):
        bcg.GraphRunner(lambda a: a, [4], example_inputs=(x,), max_padding_ratio=1.5, mode="eager")
    with pytest.raises(ValueError, match="mode"):
        bcg.GraphRunner(lambda a: a, [4], example_inputs=(x,), mode="fast")
    with pytest.raises(TypeError, match="example_inputs"):
        bcg.GraphRunner(lambda a: a, [4], example_inputs=x, mode="eager")
    runner = bcg.GraphRunner(lambda a: a, [4], example_inputs=(x,), mode="eager", pad_dim=-2)
    assert runner._inputs[0].pad_dim == 0


# -- fallbacks ----------------------------------------------------------------------------------


def test_fallback_reasons_are_counted_and_run_forward_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    capturing = {"on": False}
    calls: list[int] = []

    @bcg.breakpoint
    def scale(h: torch.Tensor) -> torch.Tensor:
        return h * bcg.live(1.0)

    def forward(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        if capturing["on"] and x.shape[0] == 16:
            raise RuntimeError("this size cannot be captured")
        return scale(F.relu(x))

    runner = _runner(forward, [4, 16, 32], (torch.randn(2, 3),), max_padding_ratio=0.5, live=1.0)
    capturing["on"] = True
    with caplog.at_level(logging.WARNING, logger="bcg"):
        runner.capture()
    capturing["on"] = False
    failures = [r for r in caplog.records if "capturing bucket 16 failed" in r.getMessage()]
    assert len(failures) == 1
    assert "RuntimeError: this size cannot be captured" in failures[0].getMessage()
    assert failures[0].exc_info is not None
    assert runner.failed_buckets == {16: "RuntimeError: this size cannot be captured"}
    assert runner.captured_buckets == [4, 32]

    def check(T: int) -> None:
        x = torch.randn(T, 3)
        calls.clear()
        torch.testing.assert_close(runner(x, live=2.0), F.relu(x) * 2)

    check(3)  # bucket 4: padded run
    assert calls == [4]
    check(40)  # above the ladder
    assert calls == [40]
    check(10)  # bucket 16 failed: eager on the real rows, not promoted to 32
    assert calls == [10]
    check(17)  # bucket 32, 15/32 padding: fine
    check(15)
    check(9)
    check(1)  # bucket 4, 3/4 padding > 0.5: eager
    assert calls == [1]
    stats = runner.stats()
    assert stats["fallbacks"] == {"too_large": 1, "padding_waste": 1, "capture_failed": 3, "not_captured_yet": 0, "capture_busy": 0, "staged_unfit": 0}
    assert stats["replays"] == {4: 1, 16: 0, 32: 1}
    assert stats["calls"] == 7 and stats["graph_calls"] == 2
    assert set(stats["capture_s"]) == {4, 16, 32}


# -- capture bookkeeping, lifecycle -------------------------------------------------------------


def test_capture_records_seconds_per_bucket_and_shows_progress(capsys: pytest.CaptureFixture[str]) -> None:
    runner = _runner(lambda x: x * 2, [2, 4, 8], (torch.randn(1, 2),), progress=True)
    assert runner.capture() is runner
    err = capsys.readouterr().err
    assert "bcg capture" in err and "3/3" in err
    stats = runner.stats()
    assert set(stats["capture_s"]) == {2, 4, 8}
    assert all(s >= 0 for s in stats["capture_s"].values())
    assert stats["capture_total_s"] >= sum(stats["capture_s"].values())
    assert stats["pool_bytes"] == 0 and stats["mode"] == "eager"
    assert runner.measure_largest_alone() == 0


def test_calls_before_capture_after_reset_and_double_capture() -> None:
    runner = _runner(lambda x: x + 1, [4], (torch.randn(1, 2),))
    with pytest.raises(bcg.ReplayError, match="capture"):
        runner(torch.randn(2, 2))
    runner.capture()
    with pytest.raises(bcg.BcgError, match="already captured"):
        runner.capture()
    runner(torch.randn(2, 2))
    runner.reset()
    assert not runner.is_captured and runner.stats()["calls"] == 0
    with pytest.raises(bcg.ReplayError, match="capture"):
        runner(torch.randn(2, 2))
    runner.capture()
    torch.testing.assert_close(runner(torch.ones(3, 2)), torch.full((3, 2), 2.0))
    runner.reset()
    with _runner(lambda x: x + 1, [4], (torch.randn(1, 2),)) as ctx:
        assert ctx.is_captured
        torch.testing.assert_close(ctx(torch.ones(1, 2)), torch.full((1, 2), 2.0))
    assert not ctx.is_captured


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_graph_mode_without_cuda_falls_back_to_eager_with_one_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner = bcg.GraphRunner(lambda x: x * 3, [4, 8], example_inputs=(torch.randn(1, 2),), progress=False)
        runner.capture()
        y = runner(torch.ones(5, 2))
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == [
        "bcg.GraphRunner: CUDA is not available, falling back to mode='eager' (same buckets, padding "
        "and slicing; forward runs eagerly at every call, no CUDA graphs)"
    ]
    assert runner.mode == "eager"
    torch.testing.assert_close(y, torch.full((5, 2), 3.0))


def test_concurrent_calls_are_serialized_and_correct() -> None:
    model = _llama()
    runner = _runner(model, [4, 8, 16], (torch.randn(5, HIDDEN), torch.arange(5)), live=_live)
    runner.capture()

    def work(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(10):
            T = int(torch.randint(1, 17, (1,), generator=gen))
            x = torch.randn(T, HIDDEN, generator=gen)
            pos = torch.arange(T)
            y = runner(x, pos, live=_live(T)).clone()
            with bcg.live_scope(_live(T)), torch.no_grad():
                expected = model(x, pos)
            torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)

    errors = run_in_threads(work, range(4))
    assert not errors, errors
    assert runner.stats()["calls"] == 40


_EXIT_SCRIPT = """
import logging, sys, threading, time
import torch
import bcg

logging.basicConfig(level=logging.INFO, stream=sys.stderr)

def capture_live(n):
    if threading.current_thread() is not threading.main_thread():
        time.sleep(0.3)  # a slow bucket, so the ladder is still under way when the main thread ends
    return None

runner = bcg.GraphRunner(lambda x: x * 2, [2, 4, 8, 16, 32, 64, 128, 256], example_inputs=(torch.randn(3, 4),),
                         live=capture_live, progress=False)
runner.capture(background=True)
time.sleep(0.5)
assert runner.stats()["capturing"]
print("main thread ends", flush=True)
"""


def test_the_interpreter_exits_cleanly_during_a_background_capture_and_stops_it_early() -> None:
    """The main thread ends while the ladder captures: the capture thread (not a daemon, since an
    interpreter exiting under a CUDA capture aborts) stops after its bucket under way, and the
    process exits 0 without capturing the rest of the ladder."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "main thread ends" in done.stdout
    line = [x for x in done.stderr.splitlines() if "background capture done" in x]
    assert line, done.stderr
    captured = int(line[0].split("done: ")[1].split(" of ")[0])
    assert captured < 8, line[0]


def test_a_caller_waiting_for_the_call_lock_gets_in_at_the_capture_threads_next_step() -> None:
    """A background capture takes the call lock per bucket and calls let_callers_in() before each:
    a caller waiting in for_caller() (a call, locked(), input_buffers()) gets the lock within one
    step. (Without let_callers_in, Python's unfair lock let the loop below keep a caller out for
    tens of steps, and a real ladder's whole capture.)"""
    from bcg.runner.pool_lock import PoolCallLock

    lock = PoolCallLock()
    steps, stop = [0], threading.Event()

    def capture_thread() -> None:
        while not stop.is_set() and steps[0] < 5000:
            lock.let_callers_in()
            with lock.lock:  # one bucket's capture
                steps[0] += 1
                time.sleep(0.0003)

    thread = threading.Thread(target=capture_thread)
    thread.start()
    try:
        while steps[0] < 20:
            time.sleep(0.001)
        waited = []
        for _ in range(20):
            before = steps[0]
            with lock.for_caller():
                waited.append(steps[0] - before)
    finally:
        stop.set()
        thread.join()
    assert max(waited) <= 1, waited


def test_a_background_capture_yields_to_calls_only_while_they_come() -> None:
    """Between two buckets, a background capture waits while calls are served (one in flight, or
    one begun in the last IDLE_S), up to its budget; it does not wait when no call came, and
    stops waiting once the calls stop or the runner stops it."""
    from bcg.runner.pool_lock import PoolCallLock

    lock, stop = PoolCallLock(), threading.Event()

    def waited(since: int, budget: float) -> float:
        t0 = time.perf_counter()
        lock.yield_to_calls(since, budget, stop)
        return time.perf_counter() - t0

    assert waited(lock.calls, 5.0) < 0.05  # no call came during the step: no wait

    done = threading.Event()

    def caller(seconds: float) -> None:  # calls back to back for ``seconds``
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            with lock.serving():
                time.sleep(0.002)
        done.set()

    since = lock.calls
    thread = threading.Thread(target=caller, args=(0.3,))
    thread.start()
    while lock.calls == since:
        time.sleep(0.0005)
    w = waited(since, 5.0)  # the calls keep coming for 0.3 s: waits for them, then resumes
    thread.join()
    assert 0.2 < w < 1.0, w
    assert done.is_set()

    since = lock.calls
    thread = threading.Thread(target=caller, args=(2.0,))
    thread.start()
    while lock.calls == since:
        time.sleep(0.0005)
    assert 0.1 <= waited(since, 0.1) < 0.5  # at most its budget
    threading.Timer(0.1, stop.set).start()
    assert waited(since, 5.0) < 0.5  # stopped (reset(), the interpreter's exit)
    thread.join()
    assert lock.active == 0
