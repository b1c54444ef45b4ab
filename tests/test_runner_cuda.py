"""bcg.GraphRunner on a GPU: bit-identical buckets, padding hygiene, fallbacks, shared pools, memory.

"Eager on the same kernels" means ``forward`` run eagerly on the zero-padded
bucket-size input, then sliced: eager on the unpadded input may differ in the
last bits, since GEMM kernels change with M.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import pytest
import torch

import bcg
from bcg.core.pool import pool_bytes

from .models import TinyLlama, positions_for, random_lengths

pytestmark = pytest.mark.cuda

HIDDEN = 256
DTYPE = torch.bfloat16


def _model(returning: bool = False, hidden: int = HIDDEN, intermediate: int = 512) -> TinyLlama:
    torch.manual_seed(0)
    return TinyLlama(layers=2, hidden=hidden, heads=8, kv_heads=2, intermediate=intermediate, returning=returning)


def _capture_live(n: int) -> dict:
    return {"lengths": [n]}


def _runner(model: TinyLlama, buckets: list[int], mode: str = "graph", hidden: int = HIDDEN, **kw) -> bcg.GraphRunner:
    x = torch.randn(8, hidden, device="cuda", dtype=DTYPE)
    pos = torch.arange(8, device="cuda")
    kw.setdefault("progress", False)
    runner = bcg.GraphRunner(model, buckets, example_inputs=(x, pos), mode=mode, live=_capture_live, **kw)
    return runner.capture()


def _batch(T: int, gen: torch.Generator, hidden: int = HIDDEN) -> tuple[torch.Tensor, torch.Tensor, dict]:
    lengths = random_lengths(T, min(T, 1 + int(torch.randint(0, 4, (1,), generator=gen))), gen) if T > 1 else [T]
    x = torch.randn(T, hidden, generator=gen).to("cuda", DTYPE)
    return x, positions_for(lengths, T, "cuda"), {"lengths": lengths}


def _padded_eager(model: TinyLlama, x: torch.Tensor, live: dict, n: int) -> torch.Tensor:
    """``forward`` on the zero-padded size-``n`` input, sliced to T: the same kernels as bucket ``n``."""
    T = x.shape[0]
    xp = torch.zeros(n, x.shape[1], device="cuda", dtype=x.dtype)
    xp[:T] = x
    with bcg.live_scope(live), torch.no_grad():
        return model(xp, positions_for(live["lengths"], n, "cuda"))[:T]


def _lengths_for(buckets: list[int], n: int) -> list[int]:
    """T = n, n - 1, the smallest T that maps to n, and a random one in between."""
    prev = max([b for b in buckets if b < n], default=0)
    return sorted({n, n - 1, prev + 1, random.Random(n).randint(prev + 1, n)} - {0})


# -- bit-identical per bucket --------------------------------------------------------------------


@pytest.mark.parametrize("returning", [False, True])
def test_every_bucket_is_bit_identical_to_eager_on_the_padded_input(returning: bool) -> None:
    model = _model(returning)
    buckets = [16, 32, 64, 128, 256]
    runner = _runner(model, buckets)
    reference = _runner(model, buckets, mode="eager")  # same ops, same padded shapes, eagerly
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for n in buckets:
        for T in [1, *_lengths_for(buckets, n)]:
            x, pos, live = _batch(T, gen)
            y = runner(x, pos, live=live).clone()
            bucket = runner.bucket_for(T)
            assert y.shape == (T, HIDDEN)
            assert torch.equal(y, reference(x, pos, live=live))
            assert torch.equal(y, _padded_eager(model, x, live, bucket))
            torch.testing.assert_close(
                y.float(), _padded_eager(model, x, live, T).float(), rtol=0.1, atol=0.1
            )  # unpadded: equal up to GEMM rounding (kernels change with M)
            checked += 1
    stats = runner.stats()
    assert stats["fallbacks"] == {"too_large": 0, "padding_waste": 0, "capture_failed": 0, "not_captured_yet": 0, "capture_busy": 0, "staged_unfit": 0}
    assert all(stats["replays"][b] >= 3 for b in buckets)
    assert stats["graph_calls"] == checked
    assert runner.graph(16).stats().breakpoints == 2


def test_a_lazy_runner_captures_each_bucket_after_its_first_call_and_replays_it_bit_identically() -> None:
    """lazy=True on the GPU: the first call of a bucket runs forward eagerly (unpadded), then
    captures the bucket into the runner's one pool; its later calls are replays, bit-identical to
    eager on the padded input. Buckets arrive in a random order."""
    model = _model()
    buckets = [16, 32, 64, 128]
    x0, pos0 = torch.randn(8, HIDDEN, device="cuda", dtype=DTYPE), torch.arange(8, device="cuda")
    runner = bcg.GraphRunner(model, buckets, example_inputs=(x0, pos0), live=_capture_live,
                             progress=False, lazy=True)
    gen = torch.Generator().manual_seed(3)
    order = [64, 16, 128, 32]
    for i, n in enumerate(order):
        for k in range(3):
            T = n - k - (i == 0)  # (the first call's T is not its bucket's: its run is watched, no probe)
            x, pos, live = _batch(T, gen)
            y = runner(x, pos, live=live).clone()
            if k == 0:  # eager, unpadded
                with bcg.live_scope(live), torch.no_grad():
                    assert torch.equal(y, model(x, pos))
                assert n in runner.captured_buckets
            else:
                assert torch.equal(y, _padded_eager(model, x, live, n))
        if i == 0:  # the first bucket, in a pool of its own; the runner's is laid out at the next capture
            first_pool = runner.graph(64).pool()
            assert first_pool != runner.pool() and runner.stats()["pool_bytes"] == pool_bytes(first_pool) > 0
        elif i == 1:  # ... which captured bucket 64 again, into the runner's pool, and freed its own
            assert runner.graph(64).pool() == runner.pool() and pool_bytes(first_pool) == 0
    for n in order:  # every bucket's graph, the recaptured one too
        x, pos, live = _batch(n - 3, gen)
        assert torch.equal(runner(x, pos, live=live), _padded_eager(model, x, live, n))
    stats = runner.stats()
    assert stats["captures"] == {"capture()": 0, "lazy": 4, "background": 0}
    assert stats["fallbacks"]["not_captured_yet"] == 4 and stats["graph_calls"] == 12
    assert runner.graph(16).stats().pool_bytes == stats["pool_bytes"] > 0  # one pool for every bucket
    runner.reset()


def _lazy_runner_with_a_view_into_its_own_pool(model: torch.nn.Module, buckets: list[int],
                                               gen: torch.Generator) -> tuple[bcg.GraphRunner, Any, torch.Tensor, torch.Tensor]:
    """A lazy runner after two calls in bucket 32 (captured by the first, into a pool of its own):
    the runner, that pool, the second call's output (a view into it) and a copy of it."""
    x0, pos0 = torch.randn(8, HIDDEN, device="cuda", dtype=DTYPE), torch.arange(8, device="cuda")
    runner = bcg.GraphRunner(model, buckets, example_inputs=(x0, pos0), live=_capture_live,
                             progress=False, lazy=True)
    x, pos, live = _batch(int(torch.randint(17, 31, (1,), generator=gen)), gen)
    runner(x, pos, live=live)
    own = runner.graph(32).pool()
    assert own != runner.pool() and pool_bytes(own) > 0
    x, pos, live = _batch(int(torch.randint(17, 31, (1,), generator=gen)), gen)
    view = runner(x, pos, live=live)
    return runner, own, view, view.clone()


def test_capture_after_a_lazy_call_captures_the_first_bucket_again_into_the_runners_pool() -> None:
    """A lazy runner's first bucket, in a pool of its own, is captured again by capture() (still
    counted as captured by its call), into the one pool with the rest; its own pool is freed at the
    next call (the last call's outputs stay valid until then), and every bucket replays
    bit-identically to eager on the padded input."""
    model, buckets, gen = _model(), [16, 32, 64], torch.Generator().manual_seed(4)
    runner, own, view, expected = _lazy_runner_with_a_view_into_its_own_pool(model, buckets, gen)
    runner.capture()
    assert runner.stats()["captures"] == {"capture()": 2, "lazy": 1, "background": 0}
    assert all(runner.graph(n).pool() == runner.pool() for n in buckets)
    assert pool_bytes(own) > 0  # (first: a freed pool would make the next line read freed memory)
    assert torch.equal(view, expected)  # valid until the next call
    for n in buckets:
        x, pos, live = _batch(n - 2, gen)
        assert torch.equal(runner(x, pos, live=live), _padded_eager(model, x, live, n))
    assert pool_bytes(own) == 0  # freed at the next call
    runner.reset()


def test_a_background_capture_after_a_lazy_call_captures_the_first_bucket_again_in_its_turn() -> None:
    """capture(background=True) on a lazy runner whose first bucket is in a pool of its own: that
    bucket is captured again in its turn, into the runner's pool (its own freed at the next call),
    still counted as captured by its call; every bucket then replays bit-identically."""
    model, buckets, gen = _model(), [16, 32, 64], torch.Generator().manual_seed(6)
    runner, own, view, expected = _lazy_runner_with_a_view_into_its_own_pool(model, buckets, gen)
    runner.capture(background=True)
    assert runner.wait_captured(60)
    assert pool_bytes(own) > 0  # kept until the next call (first: see the test above)
    assert torch.equal(view, expected)
    assert runner.stats()["captures"] == {"capture()": 0, "lazy": 1, "background": 2}
    assert all(runner.graph(n).pool() == runner.pool() for n in buckets)
    for n in buckets:
        x, pos, live = _batch(n - 1, gen)
        assert torch.equal(runner(x, pos, live=live), _padded_eager(model, x, live, n))
    assert pool_bytes(own) == 0
    runner.reset()


def _eager_calls(runner: bcg.GraphRunner) -> int:
    """Calls a background capture served eagerly (their bucket not captured yet, or busy)."""
    fallbacks = runner.stats()["fallbacks"]
    return fallbacks["not_captured_yet"] + fallbacks["capture_busy"]


class _DrawsRandomNumbers(torch.nn.Module):
    """``model`` plus zero times a dropout: the same values, and a draw on the default generator."""

    def __init__(self, model: TinyLlama) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.model(x, pos) + 0.0 * torch.nn.functional.dropout(x, 0.5, training=True)


@pytest.mark.parametrize("own_buffers, rng", [(False, False), (True, False), (False, True)],
                         ids=["inputs", "own_buffers", "draws_rng"])
def test_a_background_capture_serves_every_call_right_while_the_ladder_captures(own_buffers: bool, rng: bool) -> None:
    """capture(background=True): this thread calls the runner continuously while the ladder
    captures on the runner's thread ("thread_local", on bcg's capture stream). Every call is
    right: eager (unpadded) while its bucket is not captured yet, bit-identical to eager on the
    padded input once it is; calls on input_buffers() too (a capture gives them their values back);
    a forward that draws random numbers too (its eager calls wait for the gaps between captures:
    a draw during another thread's capture raises in torch)."""
    ref = _model()  # the expected values, computed here during captures: no draw
    model = _DrawsRandomNumbers(ref) if rng else ref
    buckets = [16, 32, 64, 128, 256]
    x0, pos0 = torch.randn(8, HIDDEN, device="cuda", dtype=DTYPE), torch.arange(8, device="cuda")
    runner = bcg.GraphRunner(model, buckets, example_inputs=(x0, pos0), live=_capture_live, progress=False)
    gen = torch.Generator().manual_seed(4)
    assert runner.capture(background=True) is runner
    eager_calls = graph_calls = after = 0
    while after < 10:
        if runner.wait_captured(0):
            after += 1  # a few more calls once the ladder is captured
        T = int(torch.randint(1, buckets[-1] + 1, (1,), generator=gen))
        x, pos, live = _batch(T, gen)
        n = runner.bucket_for(T)
        before = _eager_calls(runner)
        if own_buffers:  # filled and called under the lock, as docs/runner.md asks during a background capture
            with runner.locked():
                bx, bpos = runner.input_buffers(T)
                bx.copy_(x)
                bpos.copy_(pos)
                y = runner(bx, bpos, live=live).clone()
        else:
            y = runner(x, pos, live=live).clone()
        eager = _eager_calls(runner) > before
        if eager:
            with bcg.live_scope(live), torch.no_grad():
                expected = ref(x, pos)
            eager_calls += 1
        else:
            expected = _padded_eager(ref, x, live, n)
            graph_calls += 1
        assert torch.equal(y, expected), f"T={T}, bucket {n}, {'eager' if eager else 'replayed'}"
    assert runner.wait_captured(60)
    stats = runner.stats()
    assert runner.captured_buckets == buckets and stats["captures"]["background"] == len(buckets)
    assert graph_calls >= 10 and eager_calls + graph_calls == stats["calls"]
    assert runner.graph(16).stats().pool_bytes == stats["pool_bytes"] > 0  # one pool for every bucket
    runner.reset()


@pytest.mark.parametrize("sanitize", [True, False])
def test_inputs_built_in_the_runner_buffers_are_not_copied(monkeypatch: pytest.MonkeyPatch, sanitize: bool) -> None:
    """Calls on ``input_buffers(T)`` copy nothing and match eager (without sanitizing, the rows
    past ``T`` are still zeroed: stale rows of a longer call must not leak in); calls on the
    caller's own tensors copy each padded input once (one ``cudaMemcpyAsync``) and match too."""
    from bcg.runner import inputs

    copies: list[int] = []
    copy = inputs.cudart.copy_device_to_device

    def spy(dst: int, src: int, nbytes: int, stream: int) -> None:
        copies.append(nbytes)
        copy(dst, src, nbytes, stream)

    monkeypatch.setattr(inputs.cudart, "copy_device_to_device", spy)
    from bcg.runner import graph_runner

    checked: list[int] = []
    check_inputs = graph_runner.check_inputs
    monkeypatch.setattr(graph_runner, "check_inputs", lambda *a: checked.append(1) or check_inputs(*a))
    model = _model()
    buckets = [16, 64]
    runner = _runner(model, buckets, sanitize=sanitize)
    gen = torch.Generator().manual_seed(6)
    for T in (64, 16, 5, 64, 40, 1, 5):
        x, pos, live = _batch(T, gen)
        bx, bpos = runner.input_buffers(T)
        bx.copy_(x)
        bpos.copy_(pos)
        del copies[:], checked[:]
        y = runner(bx, bpos, live=live).clone()
        assert copies == [], f"T={T}: the call copied inputs that were already in place"
        assert checked == [], f"T={T}: the call checked the inputs input_buffers made"
        assert torch.equal(y, _padded_eager(model, x, live, runner.bucket_for(T)))
        if not sanitize:  # the graph read zeros past T (the earlier T=64 call left its rows there)
            assert not runner.input_buffers(runner.bucket_for(T))[0][T:].any(), f"T={T}"
        if T <= 16:  # the same inputs through the larger bucket
            assert torch.equal(runner(bx, bpos, live=live, bucket=64), _padded_eager(model, x, live, 64))
        y_own = runner(x, pos, live=live)
        assert len(copies) == 2 and checked, "the caller's own tensors are checked and copied"
        assert torch.equal(y_own, y)


def test_calls_on_input_buffers_run_in_c_and_match_the_python_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a T's output views exist, a call on ``input_buffers(T)`` runs in one native call (no
    Python ``_call``); its outputs, the counts and the padded-row zeroing equal the Python call's
    (``BCG_NATIVE=0``), on fresh inputs, and on a second stream the Python call orders the replay."""
    from bcg.runner.graph_runner import GraphRunner

    python_calls = [0]
    real = GraphRunner._call

    def counted(self, *args, **kwargs):  # noqa: ANN001,ANN202
        python_calls[0] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GraphRunner, "_call", counted)
    model = _model()
    results = {}
    for native_env in ("1", "0"):
        monkeypatch.setenv("BCG_NATIVE", native_env)
        runner = _runner(model, [16, 64])
        gen = torch.Generator().manual_seed(21)
        outs, firsts = [], set()
        python_calls[0] = 0
        for T in (64, 16, 5, 64, 40, 5, 16, 40):
            x, pos, live = _batch(T, gen)
            bx, bpos = runner.input_buffers(T)
            bx.copy_(x)
            bpos.copy_(pos)
            before = python_calls[0]
            y = runner(bx, bpos, live=live)
            if native_env == "1":  # the first call of a T makes its views in Python; later ones are C's
                assert python_calls[0] - before == (T not in firsts), T
            firsts.add(T)
            assert torch.equal(y, _padded_eager(model, x, live, runner.bucket_for(T))), T
            outs.append(y.clone())
        if native_env == "0":
            assert python_calls[0] == 8
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # another stream than the last replay's: Python orders it
            before = python_calls[0]
            x, pos, live = _batch(40, gen)
            bx, bpos = runner.input_buffers(40)
            bx.copy_(x)
            bpos.copy_(pos)
            y = runner(bx, bpos, live=live)
            assert python_calls[0] == before + 1
            assert torch.equal(y, _padded_eager(model, x, live, 64))
        torch.cuda.synchronize()
        stats = runner.stats()
        results[native_env] = (outs, {k: stats[k] for k in ("calls", "graph_calls", "padding_ratio")})
        runner.reset()
    assert all(torch.equal(a, b) for a, b in zip(results["1"][0], results["0"][0]))
    assert results["1"][1] == results["0"][1]


def test_decode_style_batches_padded_along_dim_1() -> None:
    """Bucketing over the batch size of ``[2, B, H]`` inputs (pad_dim=1, per-bucket buffers)."""
    torch.manual_seed(1)
    emb = torch.nn.Embedding(1000, HIDDEN, device="cuda", dtype=DTYPE)
    lin = torch.nn.Linear(HIDDEN, HIDDEN, device="cuda", dtype=DTYPE)

    @bcg.breakpoint
    def rows(h: torch.Tensor) -> torch.Tensor:
        B = bcg.live()
        out = torch.empty_like(h)
        out[:, :B] = torch.tanh(h[:, :B])
        return out

    def forward(ids: torch.Tensor) -> torch.Tensor:
        return lin(rows(lin(emb(ids))))

    buckets = bcg.runner.default_buckets(64, min_tokens=1)
    example = (torch.randint(0, 1000, (2, 4), device="cuda"),)
    kw = dict(example_inputs=example, pad_dim=1, live=lambda n: n, progress=False)
    runner = bcg.GraphRunner(forward, buckets, **kw).capture()
    reference = bcg.GraphRunner(forward, buckets, mode="eager", **kw).capture()
    for B in (1, 2, 3, 5, 7, 8, 33, 63, 64):
        ids = torch.randint(0, 1000, (2, B), device="cuda")
        y = runner(ids, live=B)
        assert y.shape == (2, B, HIDDEN)
        assert torch.equal(y, reference(ids, live=B))
        assert not torch.isnan(runner.bucket_outputs(runner.bucket_for(B))).any()


# -- padding hygiene ----------------------------------------------------------------------------


def _poison_pool(pool: tuple[int, int], stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """Fill blocks of ``pool`` (small and large, on ``stream``) with NaN and free them; keep the graph."""
    graph = torch.cuda.CUDAGraph()
    sizes = [128 << 10] * 64 + [512 << 10] * 32 + [4 << 20] * 8 + [16 << 20] * 4 + [96 << 20] * 2
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        junk = [torch.empty(s // 2, device="cuda", dtype=torch.bfloat16) for s in sizes]
        for j in junk:
            j.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    del junk
    return graph


def _poison_default_allocator() -> None:
    junk = [torch.full((s,), float("nan"), device="cuda", dtype=torch.bfloat16) for s in (1 << 16, 1 << 20, 1 << 26)]
    torch.cuda.synchronize()
    del junk


@bcg.breakpoint
def _rows_returning(h: torch.Tensor) -> torch.Tensor:
    """A fresh ``torch.empty`` result (default allocator) with only the real rows written."""
    T = sum(bcg.live()["lengths"])
    out = torch.empty_like(h)
    out[:T] = torch.tanh(h[:T])
    return out


@bcg.breakpoint(mutates=("out",))
def _rows_into(h: torch.Tensor, out: torch.Tensor) -> None:
    """Writes only the real rows of ``out`` (pool memory)."""
    T = sum(bcg.live()["lengths"])
    out[:T] = h[:T] * 0.5


class _Leaky(torch.nn.Module):
    """Both breakpoints leave padded rows unwritten, and a sum over tokens follows each."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.a = torch.nn.Linear(HIDDEN, HIDDEN, device="cuda", dtype=DTYPE)
        self.b = torch.nn.Linear(HIDDEN, HIDDEN, device="cuda", dtype=DTYPE)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        r = _rows_returning(h)
        h = h + r.sum(0, keepdim=True) / 1024
        o = torch.empty_like(h)
        _rows_into(h, o)
        return self.b(o + o.sum(0, keepdim=True) / 1024)


@pytest.mark.parametrize("which", ["llama", "leaky"])
def test_no_nan_anywhere_with_huge_padding_and_poisoned_memory(which: str) -> None:
    stream = torch.cuda.Stream()
    pool = bcg.graph_pool_handle()
    poison = _poison_pool(pool, stream)
    model = _model(returning=False) if which == "llama" else _Leaky()
    buckets = [64, 2048]
    runner = _runner(model, buckets, pool=pool, stream=stream)
    unsafe_pool = bcg.graph_pool_handle()
    unsafe_poison = _poison_pool(unsafe_pool, stream)
    unsafe = _runner(model, buckets, pool=unsafe_pool, stream=stream, sanitize=False)

    # The eager memory breakpoints allocate during a call comes from a fresh private pool whose
    # one 2 MiB segment was just filled with NaN (two 1 MiB fills, freed): the call's first
    # allocation, _rows_returning's torch.empty_like(h) (at most 1 MiB), is then NaN wherever
    # the breakpoint does not write. _poison_default_allocator alone guarantees nothing: the
    # caching allocator picks among all its free blocks, NaN-filled or not. (Routed as
    # bcg.core.pool.PoolLease does; a torch.cuda.MemPool would empty the cache when collected.)
    device = torch.cuda.current_device()

    def with_nan_memory(call):  # noqa: ANN001, ANN202
        nan_pool = torch.cuda.graph_pool_handle()
        torch._C._cuda_beginAllocateCurrentThreadToPool(device, nan_pool)
        try:
            junk = [torch.full((1 << 19,), float("nan"), device="cuda", dtype=DTYPE) for _ in range(2)]
            torch.cuda.synchronize()
            del junk
            return call()
        finally:
            torch._C._cuda_endAllocateToPool(device, nan_pool)
            torch._C._cuda_releasePool(device, nan_pool)  # freed by the next empty_cache()

    gen = torch.Generator().manual_seed(3)
    for T in (1, 2, 3, 63, 65):
        _poison_default_allocator()
        x, pos, live = _batch(T, gen)
        bucket = runner.bucket_for(T)
        y = with_nan_memory(lambda: runner(x, pos, live=live))
        full = runner.bucket_outputs(bucket)
        assert torch.isfinite(y).all()
        assert torch.isfinite(full).all(), f"NaN/inf in padded rows of bucket {bucket} at T={T}"
        if which == "llama":
            expected = _padded_eager(model, x, live, bucket)
            assert torch.equal(y, expected)
        else:
            with bcg.live_scope(live), torch.no_grad():
                expected = model(x, pos)  # unpadded: the sums over tokens see only real rows
            torch.testing.assert_close(y.float(), expected.float(), rtol=0.1, atol=0.1)

        # The control: the same call without sanitizing, under the same poison.
        _poison_default_allocator()
        y_unsafe = with_nan_memory(lambda: unsafe(x, pos, live=live))
        full_unsafe = unsafe.bucket_outputs(bucket)
        assert unsafe.bucket_for(T) == bucket and bucket > T
        if which == "leaky":
            # Certain: _rows_returning's result is fresh NaN memory past row T; its bridge copies
            # every row, and the sum over tokens after it spreads the NaN into every element of h,
            # so of o (real rows via _rows_into, the sum again) and of the output, padded rows too.
            assert torch.isnan(full_unsafe[T:]).any(), f"T={T}: the poison did not reach the padded rows"
        else:
            # No assertion on the padded rows: attention writes only the real rows of `a`, which
            # lives in the graph's pool and may hold NaN or the finite values of an earlier
            # temporary (whatever the allocator handed out). Every op but attention is row-wise
            # and attention reads only the real rows, so the real rows are exact either way.
            assert torch.equal(y_unsafe, expected)
    del poison, unsafe_poison


def test_zeroing_is_skipped_when_nothing_is_padded_and_runs_again_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """``T`` equal to the bucket disables the padded-row zeroing; the next padded call enables it
    again, and its padded rows are finite under poisoned memory (the model's sums over tokens
    would spread any NaN left there into the real rows)."""
    from bcg.runner.sanitizer import PADDING

    asked: list[tuple[bool, bool]] = []
    set_enabled = bcg.BreakableGraph.set_enabled

    def spy(graph: bcg.BreakableGraph, label: str, enabled: bool) -> bool:
        done = set_enabled(graph, label, enabled)
        if label == PADDING:
            asked.append((enabled, done))
        return done

    monkeypatch.setattr(bcg.BreakableGraph, "set_enabled", spy)
    stream = torch.cuda.Stream()
    pool = bcg.graph_pool_handle()
    poison = _poison_pool(pool, stream)
    model = _Leaky()
    runner = _runner(model, [64, 256], pool=pool, stream=stream)
    for n in (64, 256):  # the zeroing was recorded as the group, in a segment after each breakpoint
        per_segment = [len(s.node_groups.get(PADDING, ())) for s in runner.graph(n).forms[0].segments]
        assert sum(per_segment) >= 4 and sum(k > 0 for k in per_segment) >= 2, (n, per_segment)
    gen = torch.Generator().manual_seed(5)
    for T in (64, 63, 64, 64, 1, 256, 200, 256, 64, 17):
        _poison_default_allocator()
        x, pos, live = _batch(T, gen)
        y = runner(x, pos, live=live)
        bucket = runner.bucket_for(T)
        assert asked[-1] == (T < bucket, True), f"T={T}: the zeroing was not switched as asked"
        for step in runner.graph(bucket).forms[0].segments:  # each replays its executable without the zeroing
            if step.node_groups.get(PADDING):
                assert step.skipped == (frozenset({PADDING}) if T == bucket else frozenset()), (T, step.index)
        assert torch.isfinite(runner.bucket_outputs(bucket)).all(), f"NaN/inf in bucket {bucket} at T={T}"
        with bcg.live_scope(live), torch.no_grad():
            expected = model(x, pos)
        torch.testing.assert_close(y.float(), expected.float(), rtol=0.1, atol=0.1)
    del poison


def test_native_calls_switch_the_zeroing_when_padding_starts_or_stops_and_ask_nothing_between(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls on ``input_buffers(T)`` (the native call) ask ``set_enabled`` only when the padding
    changes; between, the graph's native replay carries the groups off. Padded rows hold NaN
    before each padded call, and the model sums over tokens: outputs stay finite and equal eager."""
    from bcg.core import native
    from bcg.runner.graph_runner import GraphRunner
    from bcg.runner.sanitizer import PADDING

    asked: list[bool] = []
    set_enabled = bcg.BreakableGraph.set_enabled

    def spy(graph: bcg.BreakableGraph, label: str, enabled: bool) -> bool:
        if label == PADDING:
            asked.append(enabled)
        return set_enabled(graph, label, enabled)

    python_calls = [0]
    real = GraphRunner._call

    def counted(self, *args, **kwargs):  # noqa: ANN001,ANN202
        python_calls[0] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(bcg.BreakableGraph, "set_enabled", spy)
    monkeypatch.setattr(GraphRunner, "_call", counted)
    model = _Leaky()
    runner = _runner(model, [64])
    gen = torch.Generator().manual_seed(9)
    seen: set[int] = set()
    previous = 64
    for T in (64, 64, 40, 40, 40, 64, 64, 17, 17, 64):
        x, pos, live = _batch(T, gen)
        full_x, full_pos = runner.input_buffers(64)
        full_x[T:] = float("nan")  # what a larger batch, or garbage, left in the padded rows
        bx, bpos = runner.input_buffers(T)
        bx.copy_(x)
        bpos.copy_(pos)
        asked.clear()
        before = python_calls[0]
        y = runner(bx, bpos, live=live)
        in_c = python_calls[0] == before
        assert in_c == (T in seen), f"T={T}: the call ran in {'C' if in_c else 'Python'}"
        if in_c:  # asked only where the padding changed since the last call
            assert asked == ([T < 64] if (T < 64) != (previous < 64) else []), (T, previous, asked)
        seen.add(T)
        previous = T
        replay = runner.graph(64)._native
        assert isinstance(replay, native.module().Replay), T
        assert replay.groups_off == (frozenset({PADDING}) if T == 64 else frozenset()), T
        assert torch.isfinite(y).all(), f"NaN/inf at T={T}"
        with bcg.live_scope(live), torch.no_grad():
            expected = model(x, pos)
        torch.testing.assert_close(y.float(), expected.float(), rtol=0.1, atol=0.1)


@pytest.mark.parametrize("draws", [False, True], ids=["no-rng", "rng-after-the-last-breakpoint"])
def test_captures_run_the_last_segment_only_when_the_forward_draws_random_numbers(
    monkeypatch: pytest.MonkeyPatch, draws: bool
) -> None:
    """The runner's captures upload the forward's last segment without running it, unless its
    warm-up drew random numbers: then the segment runs at capture, is known to use RNG, and
    each call draws fresh numbers, as eager calls do."""
    from bcg.core.session import CaptureSession

    runs: list[int] = []
    capture_run = CaptureSession._capture_run

    def counting(session: CaptureSession, graph: torch.cuda.CUDAGraph) -> None:
        runs.append(session._segment_index)
        capture_run(session, graph)

    monkeypatch.setattr(CaptureSession, "_capture_run", counting)

    @bcg.breakpoint(mutates=())
    def scale(h: torch.Tensor) -> torch.Tensor:
        return h * bcg.live()

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = scale(x * 2)
        return h + torch.rand_like(h) if draws else h + 1

    x = torch.randn(64, 32, device="cuda")
    runner = bcg.GraphRunner(forward, [64], example_inputs=(x,), live=3.0, progress=False).capture()
    graph = runner.graph(64)
    assert graph.stats().segments == 2 and runs == ([0, 1] if draws else [0])  # the last one ran, or not
    assert graph.forms[0].segments[-1].uses_rng == draws
    first = runner(x, live=3.0).clone()
    second = runner(x, live=3.0).clone()
    if draws:
        assert not torch.equal(first, second)  # fresh numbers each call
        noise = first - x * 6
        assert bool(((noise > -1e-3) & (noise < 1 + 1e-3)).all()) and noise.std() > 0.2  # uniform [0, 1)
    else:
        assert torch.equal(first, x * 6 + 1) and torch.equal(second, first)
    runner.reset()


# -- fallbacks and guards ------------------------------------------------------------------------


def test_each_fallback_reason_triggers_and_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    model = _model()

    def forward(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 32:
            x = x * (x.float().abs().sum().item() > -1)  # a host sync: not capturable
        return model(x, pos)

    example = (torch.randn(8, HIDDEN, device="cuda", dtype=DTYPE), torch.arange(8, device="cuda"))
    runner = bcg.GraphRunner(forward, [16, 32, 64], example_inputs=example, max_padding_ratio=0.5,
                             live=_capture_live, progress=False)
    with caplog.at_level(logging.WARNING, logger="bcg"):
        runner.capture()
    failures = [r for r in caplog.records if "capturing bucket" in r.getMessage()]
    assert len(failures) == 1 and "bucket 32" in failures[0].getMessage()
    assert "HostSyncInCaptureError" in failures[0].getMessage()
    assert list(runner.failed_buckets) == [32] and runner.captured_buckets == [16, 64]

    gen = torch.Generator().manual_seed(4)
    expected_reasons = {100: "too_large", 20: "capture_failed", 17: "capture_failed", 5: "padding_waste",
                        40: None, 16: None, 10: None, 64: None}
    for T, reason in expected_reasons.items():
        before = runner.stats()["fallbacks"]
        x, pos, live = _batch(T, gen)
        y = runner(x, pos, live=live)
        after = runner.stats()["fallbacks"]
        if reason is None:
            assert after == before
            assert torch.equal(y, _padded_eager(model, x, live, runner.bucket_for(T)))
        else:
            assert after[reason] == before[reason] + 1
            with bcg.live_scope(live), torch.no_grad():
                assert torch.equal(y, forward(x, pos))  # forward on the real inputs
    assert runner.stats()["fallbacks"] == {"too_large": 1, "padding_waste": 1, "capture_failed": 2, "not_captured_yet": 0, "capture_busy": 0, "staged_unfit": 0}


def test_guards_name_the_input_before_any_side_effect() -> None:
    runner = _runner(_model(), [16, 32])
    gen = torch.Generator().manual_seed(5)
    x, pos, live = _batch(10, gen)
    runner(x, pos, live=live)
    out = runner.bucket_outputs(16).clone()
    buffers = [b.clone() for b in runner._ladder.static.buffers()]
    calls = runner.stats()["calls"]
    cases = [
        ((x.cpu(), pos), ValueError, r"input 0 is on cpu; expected a torch.bfloat16 tensor on cuda:0 of shape \(T, 256\)"),
        ((x.float(), pos), TypeError, r"input 0 has dtype torch.float32; expected a torch.bfloat16"),
        ((x, pos.int()), TypeError, r"input 1 has dtype torch.int32; expected a torch.int64"),
        ((x[:, :128], pos), ValueError, r"input 0 has shape \(10, 128\); expected .*\(T, 256\)"),
        ((x, pos[:9]), ValueError, r"input 1 has 9 rows along its pad dim 0 but input 0 has 10"),
        ((x,), TypeError, r"takes 2 input\(s\)"),
    ]
    for args, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            runner(*args, live=live)
    assert runner.stats()["calls"] == calls
    assert torch.equal(runner.bucket_outputs(16), out)
    assert all(torch.equal(a, b) for a, b in zip(buffers, runner._ladder.static.buffers()))


# -- pools ---------------------------------------------------------------------------------------


def test_two_runners_sharing_one_pool_used_alternately() -> None:
    model_a = _model()
    model_b = _model(returning=True, hidden=128, intermediate=256)
    runner_a = _runner(model_a, [32, 64, 128])
    runner_b = _runner(model_b, [16, 64, 256], hidden=128, pool=runner_a.pool(), stream=runner_a.stream)
    assert runner_b.pool() == runner_a.pool()
    ref_a = _runner(model_a, [32, 64, 128], mode="eager")
    ref_b = _runner(model_b, [16, 64, 256], mode="eager", hidden=128)
    gen = torch.Generator().manual_seed(6)
    rng = random.Random(6)
    for i in range(24):
        use_a = i % 2 == 0 if i < 12 else rng.random() < 0.5
        runner, ref, hidden, top = (runner_a, ref_a, HIDDEN, 128) if use_a else (runner_b, ref_b, 128, 256)
        x, pos, live = _batch(rng.randint(1, top), gen, hidden)
        y = runner(x, pos, live=live).clone()  # valid until the next call of either runner
        assert torch.equal(y, ref(x, pos, live=live))
    assert runner_a.stats()["pool_bytes"] == runner_b.stats()["pool_bytes"] > 0


def test_pool_of_all_buckets_is_close_to_the_largest_bucket_alone() -> None:
    hidden = 1024
    model = _model(hidden=hidden, intermediate=2048)
    buckets = bcg.runner.default_buckets(2048)
    runner = _runner(model, buckets, hidden=hidden)
    alone = runner.measure_largest_alone()
    stats = runner.stats()
    total = stats["pool_bytes"]
    print(
        f"pool of all {len(buckets)} buckets: {total / 2**20:.1f} MiB; largest bucket ({buckets[-1]}) "
        f"alone: {alone / 2**20:.1f} MiB; ratio {total / alone:.3f}; capture {stats['capture_total_s']:.2f} s"
    )
    assert stats["largest_alone_pool_bytes"] == alone > 0
    assert stats["pool_ratio"] == pytest.approx(total / alone)
    assert total <= 1.1 * alone


def test_capture_of_16_buckets_records_seconds_and_reset_frees_everything() -> None:
    from bcg.core.process import capture_stream

    model = _model()
    gen = torch.Generator().manual_seed(7)
    x, pos, live = _batch(1, gen)
    # torch caches one cuBLAS workspace per (handle, stream) for the life of the process (32 MiB
    # each on Hopper by default), allocated through the caching allocator and never freed. This
    # runner's GEMMs run on bcg's capture stream (warm-ups, and the captures themselves) and the
    # reference below on the current stream: run the same forward on both first, so that those
    # workspaces exist before the baseline (run alone, this test saw exactly 64 MiB of them).
    for stream in (capture_stream(), torch.cuda.current_stream()):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _padded_eager(model, x, live, 16)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # a baseline without cached free blocks, which empty_cache() drops below
    reserved0 = torch.cuda.memory_reserved()
    runner = _runner(model, bcg.runner.default_buckets(4096))
    stats = runner.stats()
    assert len(stats["capture_s"]) == 16 and runner.captured_buckets == bcg.runner.default_buckets(4096)
    assert all(s > 0 for s in stats["capture_s"].values()) and stats["capture_total_s"] > 0
    print(
        f"16 buckets captured in {stats['capture_total_s']:.2f} s (per bucket: "
        + ", ".join(f"{b}: {s * 1e3:.0f} ms" for b, s in stats["capture_s"].items())
        + f"); pool {stats['pool_bytes'] / 2**20:.1f} MiB"
    )
    for _ in range(20):
        y = runner(x, pos, live=live)
    assert torch.equal(y, _padded_eager(model, x, live, 16))
    del y  # a view of the pool
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        runner(x, pos, live=live)
    torch.cuda.synchronize()
    print(f"T=1 call (bucket 16, 2 layers): {(time.perf_counter() - t0) / 200 * 1e6:.1f} us")  # informative only
    pool = runner.pool()
    runner.reset()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert bcg.core.pool.pool_bytes(pool, 0) == 0
    growth = torch.cuda.memory_reserved() - reserved0
    print(f"reserved after reset: {growth / 2**20:+.1f} MiB")
    # The allowance: a few 2 MiB segments holding small blocks that outlive the runner (torch's
    # graph RNG state, say), and room for a cuBLASLt workspace created lazily on a path the
    # warm-up above did not take. Less than one 32 MiB cuBLAS workspace (one per stream that
    # leaked) and than the pool (48 MiB), the buffers and outputs together.
    allowance = 16 * 2**20
    assert growth <= allowance, (
        f"reserved memory grew by {growth / 2**20:.1f} MiB after reset() and empty_cache() "
        f"(allowance {allowance / 2**20:.0f} MiB; pool was {stats['pool_bytes'] / 2**20:.1f} MiB)"
    )
    with pytest.raises(bcg.ReplayError):
        runner(x, pos, live=live)


def test_outputs_are_views_valid_until_the_next_call_unless_copied() -> None:
    model = _model()
    view_runner = _runner(model, [64])
    copy_runner = _runner(model, [64], copy_outputs=True)
    gen = torch.Generator().manual_seed(8)
    x1, pos1, live1 = _batch(40, gen)
    x2, pos2, live2 = _batch(40, gen)
    v1 = view_runner(x1, pos1, live=live1)
    c1 = copy_runner(x1, pos1, live=live1)
    first = v1.clone()
    assert torch.equal(c1, first)
    v2 = view_runner(x2, pos2, live=live2)
    copy_runner(x2, pos2, live=live2)
    assert v1.data_ptr() == v2.data_ptr()  # the same static memory: v1 now holds the second result
    assert torch.equal(c1, first)


def test_a_conjugated_complex_input_keeps_its_conjugation() -> None:
    """A contiguous input with torch's lazy conjugate (or negative) bit is copied as its values,
    not as its bytes."""
    runner = bcg.GraphRunner(lambda x: x * 2, [8], progress=False,
                             example_inputs=(torch.randn(4, 3, dtype=torch.complex64, device="cuda"),))
    runner.capture()
    for T in (5, 8):
        x = torch.randn(T, 3, dtype=torch.complex64, device="cuda")
        torch.testing.assert_close(runner(x.conj()), x.conj() * 2)
    runner.reset()

