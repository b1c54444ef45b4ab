"""Staged breakpoints with ``prepare_after_launch=True`` on a GPU: the graph is launched first and
waits, at a captured gate, for the metadata ``prepare`` writes after the launch."""

from __future__ import annotations

import itertools
import random
import time

import pytest
import torch

import bcg
from tests.test_staging_cuda import (
    DTYPE, HIDDEN, SLOTS, Block, Meta, Staging, TieredStaging, _attention_body, _capture_meta, _eager, _lengths,
    _runner,
)

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():  # pragma: no cover - collected on CPU machines
    pytest.skip("needs an NVIDIA GPU (CUDA not available)", allow_module_level=True)


@pytest.fixture(autouse=True)
def _always_launch_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check the launch-first path itself: keep it even where launches are late
    (small graphs on an idle GPU reach their gate in microseconds). The tests of late
    launches set their own value."""
    monkeypatch.setattr(bcg.staged.staging, "PREPARE_FIRST_REPLAYS", 0)


@pytest.fixture(autouse=True, params=["kernel", "stream memory operations", "kernel, Python executor"])
def _gate_form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test with both forms of the gate: bcg.staged.gate's kernel, and the stream memory
    operations bcg falls back to where the kernel cannot be built; and the kernel under the
    Python executor (segments launched through ``CUDAGraph.replay``, not from C)."""
    if request.param == "stream memory operations":
        monkeypatch.setattr(bcg.staged.gate, "kernel", lambda device: None)
    if request.param.endswith("Python executor"):
        monkeypatch.setenv("BCG_NATIVE", "0")


class GatedStaging(Staging):
    """Staging whose ``prepare`` can look at the stream, sleep, raise, or skip its write."""

    def __init__(self, forget_last: bool = False) -> None:
        super().__init__(forget_last)
        self.sleep_s = 0.0
        self.stream_idle: list[bool] = []  # per prepare: was the current stream idle (nothing queued)?
        self.raise_next = False
        self.skip_write = False  # keep the buffer's value (the previous replay's)

    def prepare(self, meta: Meta) -> Meta:
        if self.sleep_s:
            time.sleep(self.sleep_s)
            self.stream_idle.append(torch.cuda.current_stream().query())
        if self.raise_next:
            self.raise_next = False
            raise RuntimeError("prepare failed")
        if self.skip_write:
            return Meta(meta.lengths, self.buffer.device, bound=sum(meta.lengths))
        return super().prepare(meta)


def _settled(staging: Staging) -> bool:
    """Whether, the GPU drained, no gate is left open (a leak would hand its value to a later replay)."""
    torch.cuda.synchronize()
    return not staging.buffer.gate_open


def _gated_attention(staging: Staging):  # noqa: ANN202
    return bcg.breakpoint(name="attn", mutates=("out",), prepare=staging.prepare, fits=staging.fits,
                          prepare_after_launch=True)(_attention_body)


def _gated_runner(buckets: list[int], layers: int = 2) -> tuple[GatedStaging, Block, bcg.GraphRunner]:
    """A runner over ``layers`` gated attention layers, with its staging and its block (the eager reference)."""
    staging = GatedStaging()
    block = Block(_gated_attention(staging), layers=layers)
    return staging, block, _runner(block, buckets)


def _assert_replays_match_eager(graph: bcg.BreakableGraph, forward, x: torch.Tensor,  # noqa: ANN001
                                rng: random.Random, calls: int) -> None:
    """``calls`` replays of ``graph`` (captured on ``x``) on fresh inputs and lengths, each equal to ``forward``'s."""
    for _ in range(calls):
        meta = Meta(_lengths(rng, 128, rng.randint(1, SLOTS)))
        x.copy_(torch.randn(128, HIDDEN, device="cuda", dtype=DTYPE))
        out = graph.replay(meta)
        with bcg.live_scope(meta), torch.no_grad():
            assert torch.equal(out, forward(x)), meta.lengths


def test_the_launched_graph_waits_for_prepare_and_replays_stay_bit_identical() -> None:
    staging, block, runner = _gated_runner([64, 256], layers=3)
    assert runner.graph(256).stats().staged == ("attn",)
    assert runner.graph(64).prepares_after_launch and runner.graph(256).prepares_after_launch
    rng = random.Random(3)
    inline = fallback = 0
    for i in range(100):
        T = 256 if i % 10 == 0 else rng.randint(SLOTS + 1, 256)  # T = bucket: the trimmed executable
        requests = rng.randint(1, SLOTS + 1)  # SLOTS + 1 does not fit: the breakable form runs
        meta = Meta(_lengths(rng, T, requests))
        x = torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE)
        staging.sleep_s = 0.02 if i % 25 == 0 else 0.0
        idle_before = len(staging.stream_idle)
        y = runner(x, live=meta)
        if staging.sleep_s and requests <= SLOTS:
            # 20 ms after the launch the graph (well under 1 ms of work) has not finished: it waits
            # at its gate for this prepare's metadata
            assert staging.stream_idle[idle_before:] == [False], f"call {i}"
        assert torch.equal(y, _eager(block, x, meta)), f"call {i}: T={T}, lengths={meta.lengths}"
        inline += requests <= SLOTS
        fallback += requests > SLOTS
    stats = runner.stats()
    assert stats["inline_replays"] == inline and inline > 0
    assert stats["staged_fallbacks"] == {"attn does not fit": fallback} and fallback > 0
    assert _settled(staging)
    runner.reset()


def test_replays_queued_behind_a_busy_gpu_each_read_their_own_metadata() -> None:
    staging, block, runner = _gated_runner([128])
    rng = random.Random(5)
    calls = []
    for _ in range(2):
        torch.cuda._sleep(50_000_000)  # tens of ms of GPU time: the host runs ahead of it
        for _ in range(12):
            meta = Meta(_lengths(rng, 128, rng.randint(1, SLOTS)))
            x = torch.randn(128, HIDDEN, device="cuda", dtype=DTYPE)
            calls.append((x, meta, runner(x, live=meta).clone()))  # the clone is queued after the replay
    torch.cuda.synchronize()
    for i, (x, meta, y) in enumerate(calls):
        assert torch.equal(y, _eager(block, x, meta)), f"call {i}: lengths={meta.lengths}"
    assert runner.stats()["inline_replays"] == len(calls)
    runner.reset()


def test_a_prepare_that_raises_after_the_launch_says_so_and_the_next_call_is_right() -> None:
    staging, block, runner = _gated_runner([128])
    rng = random.Random(9)
    x = torch.randn(128, HIDDEN, device="cuda", dtype=DTYPE)
    staging.raise_next = True
    with pytest.raises(RuntimeError, match="prepare failed") as info:
        runner(x, live=Meta(_lengths(rng, 128, 2)))
    assert any("metadata staged at capture" in note for note in getattr(info.value, "__notes__", []))
    assert _settled(staging)  # the launched replay ran to its end (with the capture's metadata)
    for _ in range(5):
        meta = Meta(_lengths(rng, 128, rng.randint(1, SLOTS)))
        x = torch.randn(128, HIDDEN, device="cuda", dtype=DTYPE)
        assert torch.equal(runner(x, live=meta), _eager(block, x, meta)), meta.lengths
    runner.reset()


def test_staged_tiers_share_the_buffer_and_its_gate() -> None:
    class GatedTiers(TieredStaging, GatedStaging):  # the tiers' prepare, which can raise
        pass

    staging = GatedTiers()
    attention = bcg.breakpoint(name="attn", mutates=("out",), prepare=staging.prepare, fits=staging.fits,
                               prepare_after_launch=True)(_attention_body)
    block = Block(attention)

    def tiers(n: int) -> bcg.StagedTiers:
        return bcg.StagedTiers(*(Meta(_lengths(random.Random(k), n, min(k, n)), slots=k) for k in (1, 2)),
                               _capture_meta(n))

    runner = _runner(block, [96, 192], capture_live=tiers)
    forms = [g for n in (96, 192) for g in (*runner.tiers(n), runner.graph(n))]
    assert len(forms) == 6 and all(g.prepares_after_launch for g in forms)
    rng = random.Random(13)
    calls = []
    for i in range(60):  # tiers of 1 and 2 slots, the bucket's 4, and the breakable form, interleaved
        T = rng.randint(SLOTS + 1, 192)
        meta = Meta(_lengths(rng, T, rng.randint(1, SLOTS + 1)))
        x = torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE)
        if i == 30:  # the 2-slot tier's prepare raises: its replay runs its own capture values
            staging.raise_next = True
            meta = Meta(_lengths(rng, T, 2))
            with pytest.raises(RuntimeError, match="prepare failed"):
                runner(x, live=meta)
            continue
        calls.append((x, meta, runner(x, live=meta).clone()))
    torch.cuda.synchronize()
    for i, (x, meta, y) in enumerate(calls):
        assert torch.equal(y, _eager(block, x, meta)), f"call {i}: lengths={meta.lengths}"
    assert runner.stats()["tier_replays"] > 0 and runner.stats()["staged_fallbacks"]
    assert _settled(staging)
    runner.reset()


def test_a_breakpoint_that_raises_before_the_gated_segment_leaves_no_gate_open() -> None:
    staging = GatedStaging()
    attention = _gated_attention(staging)
    fail = [False]

    @bcg.breakpoint(name="host_step", mutates=())
    def host_step(x: torch.Tensor) -> None:
        if fail[0]:
            raise ValueError("host step failed")

    block = Block(attention)

    def forward(x: torch.Tensor) -> torch.Tensor:
        host_step(x)  # a breakpoint before the staged attention: prepare runs before the launch
        return block(x)

    x = torch.randn(128, HIDDEN, device="cuda", dtype=DTYPE)
    rng = random.Random(17)
    graph = bcg.make_graph(forward, x, live=Meta(_lengths(rng, 128, SLOTS)))
    assert graph.num_breakpoints == 1
    fail[0] = True
    with pytest.raises(ValueError, match="host step failed"):
        graph.replay(Meta(_lengths(rng, 128, 2)))  # prepared, gate opened; the gated segment never launched
    fail[0] = False
    assert not graph.prepares_after_launch and _settled(staging)
    _assert_replays_match_eager(graph, forward, x, rng, calls=5)
    graph.reset()


def _graph_with_a_breakpoint_step(staging: GatedStaging, guards: bool = False):  # noqa: ANN202
    """A gated staged attention after a plain breakpoint: ``prepare`` runs before the launch."""
    block = Block(_gated_attention(staging))

    @bcg.breakpoint(name="host_step", mutates=())
    def host_step(x: torch.Tensor) -> None:
        pass

    def forward(x: torch.Tensor) -> torch.Tensor:
        host_step(x)
        return block(x)

    x = torch.randn(128, HIDDEN, device="cuda", dtype=DTYPE)
    graph = bcg.make_graph(forward, x, live=Meta(_lengths(random.Random(31), 128, SLOTS)), guards=guards)
    return graph, forward, x


def test_a_guard_failure_before_a_prepare_first_launch_leaves_no_gate_open() -> None:
    staging = GatedStaging()
    graph, forward, x = _graph_with_a_breakpoint_step(staging, guards=True)
    rng = random.Random(37)
    alias = x.detach()  # the captured storage
    x.set_(torch.randn(128, HIDDEN, device="cuda", dtype=DTYPE))
    with pytest.raises(bcg.GuardError):
        graph.replay(Meta(_lengths(rng, 128, 2)))
    assert _settled(staging)
    x.set_(alias)
    _assert_replays_match_eager(graph, forward, x, rng, calls=3)
    graph.reset()


@pytest.mark.parametrize("breakpoint_step", [False, True], ids=["launch-first", "prepare-first"])
def test_a_prepare_that_skips_its_write_replays_the_previous_metadata(breakpoint_step: bool) -> None:
    staging = GatedStaging()
    if breakpoint_step:
        graph, forward, x = _graph_with_a_breakpoint_step(staging)
    else:
        block = Block(_gated_attention(staging))
        forward = block
        x = torch.randn(128, HIDDEN, device="cuda", dtype=DTYPE)
        graph = bcg.make_graph(block, x, live=Meta(_lengths(random.Random(31), 128, SLOTS)))
    assert graph.prepares_after_launch is not breakpoint_step
    rng = random.Random(41)
    calls = []
    torch.cuda._sleep(50_000_000)  # the replays queue up behind the GPU
    for i in range(12):
        meta = Meta(_lengths(rng, 128, rng.randint(1, SLOTS)))
        staging.skip_write = i % 3 == 2
        if not staging.skip_write:
            written = meta  # what the buffer holds from now on
        x.copy_(torch.randn(128, HIDDEN, device="cuda", dtype=DTYPE))
        out = graph.replay(meta)
        calls.append((x.clone(), written, out.clone()))  # queued after the replay
    assert _settled(staging)
    for i, (x_i, written, y) in enumerate(calls):
        with bcg.live_scope(written), torch.no_grad():
            assert torch.equal(y, forward(x_i)), (i, written.lengths)
    graph.reset()


@pytest.mark.parametrize("compute_outputs", [True, False])
def test_a_capture_leaves_the_gate_closed_whether_it_runs_the_segment_or_not(compute_outputs: bool) -> None:
    staging = GatedStaging()
    block = Block(_gated_attention(staging))
    x = torch.randn(64, HIDDEN, device="cuda", dtype=DTYPE)
    rng = random.Random(19)
    graph = bcg.BreakableGraph()
    meta0 = Meta(_lengths(rng, 64, 3))
    with torch.no_grad(), bcg.capture(graph, live=meta0, compute_outputs=compute_outputs):
        out = block(x)
    assert _settled(staging)  # a segment run at capture has read its gate's value
    if compute_outputs:
        assert torch.equal(out, _eager(block, x, meta0))
    for _ in range(5):
        meta = Meta(_lengths(rng, 64, rng.randint(1, SLOTS)))
        x.copy_(torch.randn(64, HIDDEN, device="cuda", dtype=DTYPE))
        graph.replay(meta)  # a gate left open would hand this replay the previous value
        assert torch.equal(out, _eager(block, x, meta)), meta.lengths
    assert _settled(staging)
    graph.reset()


def test_verify_covers_a_gated_graph_and_catches_an_incomplete_prepare(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bcg.staged.staging, "PREPARE_FIRST_REPLAYS", 4)

    def make_inputs() -> tuple[torch.Tensor]:
        return (torch.randn(96, HIDDEN, device="cuda", dtype=DTYPE),)

    rng = random.Random(23)
    samples = [Meta(_lengths(rng, 96, r)) for r in (1, 2, 3, 4, 5)]
    report = bcg.verify(Block(_gated_attention(GatedStaging())), make_inputs, samples)
    assert report.ok and report.samples == 5
    graph = report.graph
    inline = sum(len(m.lengths) <= SLOTS for m in samples)  # (a sample of more requests runs the breakable form)
    assert graph.launch_order()[0] == inline >= bcg.staged.staging.LATE_STREAK  # each inline sample replayed whole, launched first ...
    graph.replay(samples[0])
    assert graph.launch_order()[0] == inline + 1  # ... none counted toward the order: the next replay launches first too
    with pytest.raises(bcg.VerificationError, match="output"):
        bcg.verify(Block(_gated_attention(GatedStaging(forget_last=True))), make_inputs, samples)


def test_without_the_flag_prepare_runs_before_the_launch() -> None:
    staging = GatedStaging()
    attention = bcg.breakpoint(name="attn", mutates=("out",), prepare=staging.prepare, fits=staging.fits)(
        _attention_body)
    runner = _runner(Block(attention), [64])
    torch.cuda.synchronize()
    staging.sleep_s = 0.01
    meta = Meta(_lengths(random.Random(29), 64, 2))
    runner(torch.randn(64, HIDDEN, device="cuda", dtype=DTYPE), live=meta)
    torch.cuda.synchronize()
    assert staging.stream_idle == [True]  # nothing of this call was queued yet
    assert list(itertools.accumulate(meta.lengths, initial=0)) == staging.buffer.device.tolist()[:3]
    runner.reset()


def _gated_graph(seed: int) -> tuple[bcg.BreakableGraph, Block, GatedStaging, torch.Tensor, random.Random]:
    """A graph of gated attention layers, launched first (its plan is one segment)."""
    staging = GatedStaging()
    block = Block(_gated_attention(staging))
    x = torch.randn(128, HIDDEN, device="cuda", dtype=DTYPE)
    rng = random.Random(seed)
    graph = bcg.make_graph(block, x, live=Meta(_lengths(rng, 128, SLOTS)))
    assert graph.prepares_after_launch
    return graph, block, staging, x, rng


def test_launches_that_return_after_the_gpu_reached_a_gate_make_prepare_run_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bcg.staged.staging, "PREPARE_FIRST_REPLAYS", 4)
    graph, block, staging, x, rng = _gated_graph(43)
    replay = torch.cuda.CUDAGraph.replay

    def slow_launch(self: torch.cuda.CUDAGraph) -> None:  # a launch whose host part outlasts the GPU's way to the gate
        replay(self)
        time.sleep(0.005)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", slow_launch)
    graph.use_executor("python")  # its segment launches go through CUDAGraph.replay
    counts = []
    for _ in range(bcg.staged.staging.LATE_STREAK + 4 + 1):
        torch.cuda.synchronize()  # the GPU idle: it reaches the gate at once
        _assert_replays_match_eager(graph, block, x, rng, calls=1)
        stats = graph.stats()
        counts.append((stats.launched_first, stats.late_launches))
    streak = bcg.staged.staging.LATE_STREAK
    # every launch-first replay was late; after the streak, 4 replays ran prepare first, then one launched first again
    assert counts == [(i, i) for i in range(1, streak + 1)] + [(streak, streak)] * 4 + [(streak + 1, streak + 1)]
    assert _settled(staging)
    graph.reset()


def test_launches_that_return_before_the_gpu_reaches_a_gate_stay_launch_first() -> None:
    graph, block, staging, x, rng = _gated_graph(47)
    for _ in range(8):
        torch.cuda._sleep(20_000_000)  # the GPU busy for milliseconds: the launch returns long before it reaches the gate
        _assert_replays_match_eager(graph, block, x, rng, calls=1)
    stats = graph.stats()
    assert (stats.launched_first, stats.late_launches) == (8, 0)
    assert _settled(staging)
    graph.reset()
