"""Staged copies on a GPU: every dtype and size copied bit-exact, replays queued behind a busy GPU
each reading their own values, a prepare that skips its write replaying the previous value, and
staged tiers sharing one buffer."""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass

import pytest
import torch

import bcg
from tests.test_staging_cuda import (
    DTYPE, HIDDEN, SLOTS, Block, Meta, Staging, TieredStaging, _attention_body, _capture_meta, _eager, _lengths,
    _runner,
)

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("every_tier_kept")]  # (tests of what tiers do)

if not torch.cuda.is_available():  # pragma: no cover - collected on CPU machines
    pytest.skip("needs an NVIDIA GPU (CUDA not available)", allow_module_level=True)

#: sizes on both sides of each parameters limit (4,088 and 8,184 bytes) and far past them
SHAPES = [((1,), torch.int8), ((3,), torch.float16), ((9,), torch.int32), ((1000,), torch.int64),
          ((70_001,), torch.int32), ((4, 5), torch.bool), ((7,), torch.float64), ((1022,), torch.int32),
          ((1023,), torch.int32), ((1023,), torch.int64), ((2047,), torch.int32)]


def _values(rng: random.Random, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -2**31), min(info.max, 2**31 - 1), shape, generator=g, dtype=torch.int64).to(dtype)


@dataclass(frozen=True)
class Values:
    """Live metadata: the values of every buffer (host tensors); ``device`` set in the staged form."""

    host: tuple[torch.Tensor, ...]
    device: tuple[torch.Tensor, ...] | None = None


class Buffers:
    def __init__(self) -> None:
        self.buffers = [bcg.StagingBuffer(shape, dtype=dtype) for shape, dtype in SHAPES]

    def prepare(self, values: Values) -> Values:
        for buf, v in zip(self.buffers, values.host):
            buf.write(v)
        return Values(values.host, tuple(buf.device for buf in self.buffers))


def _live(rng: random.Random) -> Values:
    """Fresh random values for every buffer."""
    return Values(tuple(_values(rng, shape, dtype) for shape, dtype in SHAPES))


def _graph(rng: random.Random, group: str | None = None) -> tuple[bcg.BreakableGraph, list[torch.Tensor]]:
    """A graph whose staged breakpoint copies every buffer into outputs (inside the node group
    ``group`` when given), and those outputs."""
    staging = Buffers()

    @bcg.breakpoint(name="read", mutates=("outs",), prepare=staging.prepare, fits=lambda values: True)
    def read(outs: list[torch.Tensor]) -> None:
        values = bcg.live()
        sources = values.device if values.device is not None else [v.to("cuda") for v in values.host]
        for out, src in zip(outs, sources):
            out.copy_(src)

    outs = [torch.zeros(shape, dtype=dtype, device="cuda") for shape, dtype in SHAPES]

    def forward(outs: list[torch.Tensor]) -> torch.Tensor:
        with bcg.core.session.node_group(group) if group is not None else contextlib.nullcontext():
            read(outs)
        return outs[2].float().sum()  # segment work after the staged step

    graph = bcg.make_graph(forward, outs, live=_live(rng))
    return graph, outs


def test_staged_copies_of_every_dtype_and_size_are_bit_exact() -> None:
    rng = random.Random(11)
    graph, outs = _graph(rng)
    assert graph.stats().staged.breakpoints == ("read",)
    for _ in range(20):
        live = _live(rng)
        graph.replay(live)
        for out, v in zip(outs, live.host):
            assert torch.equal(out.cpu(), v)


@pytest.mark.parametrize("executor", ["native", "python"])
def test_replays_queued_behind_a_busy_gpu_read_their_own_values(executor: str) -> None:
    rng = random.Random(12)
    graph, outs = _graph(rng)
    try:
        graph.use_executor(executor)
    except bcg.ReplayError:
        pytest.skip("no native executor in this install")
    acc = [torch.zeros(out.shape, dtype=torch.float64, device="cuda") for out in outs]
    expected = [torch.zeros(out.shape, dtype=torch.float64) for out in outs]
    for _ in range(2):
        torch.cuda._sleep(50_000_000)  # tens of ms: the host runs ahead, replays queue up
        for _ in range(10):
            live = _live(rng)
            graph.replay(live)
            for a, out, e, v in zip(acc, outs, expected, live.host):
                a.add_(out.double())  # queued after the replay, before the next
                e.add_(v.double())
    torch.cuda.synchronize()
    for a, e in zip(acc, expected):
        assert torch.equal(a.cpu(), e)


def test_small_values_travel_in_kernel_parameters_and_writes_never_wait_for_the_gpu() -> None:
    """A buffer of at most ``param_bytes()`` reaches the device in a kernel's parameters (set at each
    replay, kept by launches already queued); larger ones by a captured copy. With only the former,
    ``prepare``'s writes never wait for queued replays: the host queues them all while the GPU is
    still busy with the work before them, and each replay reads its own values."""
    from bcg.staged.kernel import param_bytes

    sizes = [bcg.StagingBuffer(shape, dtype=dtype) for shape, dtype in SHAPES]
    routes = [b.in_parameters for b in sizes]
    assert routes == [b.device.numel() * b.device.element_size() <= param_bytes() for b in sizes]
    assert any(routes) and not all(routes)

    buffers = [bcg.StagingBuffer(9, dtype=torch.int32), bcg.StagingBuffer((2, 3), dtype=torch.float16)]

    def prepare(values: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        for buf, v in zip(buffers, values):
            buf.write(v)
        return tuple(buf.device for buf in buffers)

    @bcg.breakpoint(name="read", mutates=("outs",), prepare=prepare, fits=lambda values: True)
    def read(outs: list[torch.Tensor]) -> None:
        for out, src in zip(outs, bcg.live()):
            out.copy_(src)

    outs = [torch.zeros(9, dtype=torch.int32, device="cuda"), torch.zeros(2, 3, dtype=torch.float16, device="cuda")]

    def live() -> tuple[torch.Tensor, ...]:
        return torch.randint(-2**31, 2**31 - 1, (9,), dtype=torch.int32), torch.randn(2, 3).half()

    def forward(outs: list[torch.Tensor]) -> torch.Tensor:
        read(outs)
        return outs[0] + 0  # segment work after the staged step

    graph = bcg.make_graph(forward, outs, live=live())
    assert all(b.in_parameters for b in buffers)
    acc = [[] for _ in outs]
    expected = []
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # a few hundred ms of GPU work before every replay
    busy = torch.cuda.Event()
    busy.record()
    for _ in range(12):
        values = live()
        graph.replay(values)
        for a, out in zip(acc, outs):
            a.append(out.clone())  # queued after the replay, before the next
        expected.append(values)
    assert not busy.query()  # the host never waited for the GPU
    torch.cuda.synchronize()
    for got, values in zip(zip(*acc), expected):
        assert all(torch.equal(g.cpu(), v) for g, v in zip(got, values))
    graph.reset()


def test_a_node_group_holding_a_staged_copy_always_runs() -> None:
    # every replay's prepare writes the buffer the copy reads: a group holding it is never skipped
    rng = random.Random(15)
    graph, outs = _graph(rng, group="s")
    assert graph.set_enabled("s", False) is False  # the group always runs
    for _ in range(4):
        live = _live(rng)
        graph.replay(live)
        for out, v in zip(outs, live.host):
            assert torch.equal(out.cpu(), v)


class SkippingStaging(Staging):
    """Staging whose ``prepare`` can skip its write (the buffer keeps the previous replay's value)."""

    def __init__(self) -> None:
        super().__init__()
        self.skip_write = False

    def prepare(self, meta: Meta) -> Meta:
        if self.skip_write:
            return Meta(meta.lengths, self.buffer.device, bound=sum(meta.lengths))
        return super().prepare(meta)


def test_a_prepare_that_skips_its_write_replays_the_previous_metadata() -> None:
    staging = SkippingStaging()
    block = Block(bcg.breakpoint(name="attn", mutates=("out",), prepare=staging.prepare,
                                 fits=staging.fits)(_attention_body))
    x = torch.randn(128, HIDDEN, device="cuda", dtype=DTYPE)
    graph = bcg.make_graph(block, x, live=Meta(_lengths(random.Random(31), 128, SLOTS)))
    rng = random.Random(41)
    calls = []
    torch.cuda._sleep(50_000_000)  # the replays queue up behind the GPU
    written = None
    for i in range(12):
        meta = Meta(_lengths(rng, 128, rng.randint(1, SLOTS)))
        staging.skip_write = i % 3 == 2 and written is not None
        if not staging.skip_write:
            written = meta  # what the buffer holds from now on
        x.copy_(torch.randn(128, HIDDEN, device="cuda", dtype=DTYPE))
        out = graph.replay(meta)
        calls.append((x.clone(), written, out.clone()))  # queued after the replay
    torch.cuda.synchronize()
    for i, (x_i, written, y) in enumerate(calls):
        with bcg.live_scope(written), torch.no_grad():
            assert torch.equal(y, block(x_i)), (i, written.lengths)
    graph.reset()


def test_staged_tiers_share_the_buffer_and_replays_stay_bit_identical() -> None:
    staging = TieredStaging()
    attention = bcg.breakpoint(name="attn", mutates=("out",), prepare=staging.prepare,
                               fits=staging.fits)(_attention_body)
    block = Block(attention)

    def tiers(n: int) -> bcg.StagedTiers:
        return bcg.StagedTiers(*(Meta(_lengths(random.Random(k), n, min(k, n)), slots=k) for k in (1, 2)),
                               _capture_meta(n))

    runner = _runner(block, [96, 192], live=tiers)
    for n in (96, 192):
        assert [f.name for f in runner.graph(n).forms] == ["tier 0", "tier 1", "inline", "breakable"]
    rng = random.Random(13)
    calls = []
    for _ in range(60):  # tiers of 1 and 2 slots, the bucket's 4, and the breakable form, interleaved
        T = rng.randint(SLOTS + 1, 192)
        meta = Meta(_lengths(rng, T, rng.randint(1, SLOTS + 1)))
        x = torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE)
        calls.append((x, meta, runner(x, live=meta).clone()))
    torch.cuda.synchronize()
    for i, (x, meta, y) in enumerate(calls):
        assert torch.equal(y, _eager(block, x, meta)), f"call {i}: lengths={meta.lengths}"
    assert runner.stats()["tier_replays"] > 0 and runner.stats()["staged_fallbacks"]
    runner.reset()


@pytest.mark.parametrize("nbytes", [16, 64_000], ids=["parameters", "copy"])
def test_a_staging_buffer_made_inside_a_capture_is_refused_and_the_capture_unwinds(nbytes: int) -> None:
    """Its memory would come from the graph's pool (freed with the graph while the buffer lives),
    and its kernel's module would load during the capture: a CaptureError says to create it
    before, no stream stays capturing, and a buffer made afterwards carries its values in."""
    x = torch.randn(8, device="cuda")
    x * 2  # warm up
    with pytest.raises(bcg.CaptureError, match="create staging buffers before capturing"):
        with bcg.capture(bcg.BreakableGraph()):
            x * 2  # a segment's work before it
            bcg.StagingBuffer(nbytes // 4, dtype=torch.int32)
    assert not torch.cuda.is_current_stream_capturing()
    buffer = bcg.StagingBuffer(nbytes // 4, dtype=torch.int32)
    values = torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32)

    @bcg.breakpoint(name="read_made_after", mutates=("out",), prepare=lambda v: (buffer.write(v), buffer.device)[1],
                    fits=lambda v: True)
    def read(out: torch.Tensor) -> None:
        out.copy_(bcg.live())

    out = torch.zeros(nbytes // 4, dtype=torch.int32, device="cuda")
    graph = bcg.make_graph(lambda o: (read(o), o + 0)[1], out, live=values)
    fresh = torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32)
    result = graph.replay(live=fresh)
    assert torch.equal(result.cpu(), fresh)
