"""The gated copy (``bcg.staged.gate``) on a GPU: the kernel waits at its gate, copies any dtype and
size bit-exact, and clears the gate; staged graphs copy through it, or through the stream
memory operations where it cannot be built."""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass

import pytest
import torch

import bcg
from bcg.core import cudart
from bcg.staged import gate

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():  # pragma: no cover - collected on CPU machines
    pytest.skip("needs an NVIDIA GPU (CUDA not available)", allow_module_level=True)


def test_the_kernel_builds_on_this_gpu() -> None:
    # where it does not, staged copies still work (the stream memory operations) but each launch
    # costs microseconds more: on the GPUs this suite runs on, that would be a regression
    assert gate.kernel(torch.cuda.current_device()) is not None


def _flags(gate_value: int) -> tuple[torch.Tensor, int]:
    flags = torch.tensor([gate_value, 0], dtype=torch.int32).pin_memory()
    return flags, cudart.host_device_pointer(flags.data_ptr())


def _capture(flags_address: int, host: torch.Tensor, device: torch.Tensor, nbytes: int,
             src_offset: int = 0, dst_offset: int = 0) -> None:
    """The gated copy of ``nbytes`` from ``host`` to ``device`` (at those byte offsets), launched now."""
    gate.capture(gate.kernel(torch.cuda.current_device()), torch.cuda.current_stream().cuda_stream, flags_address,
                 host.data_ptr() + src_offset, cudart.host_device_pointer(host.data_ptr()) + src_offset,
                 device.data_ptr() + dst_offset, nbytes)


KERNEL_MAX = gate.KERNEL_COPY_MAX  # one kernel up to this many bytes, a copy node between two past it


@pytest.mark.parametrize(("nbytes", "src_offset", "dst_offset"), [
    (0, 0, 0), (1, 0, 0), (36, 0, 0), (50, 1, 3), (4099, 16, 32), (KERNEL_MAX, 0, 0), (KERNEL_MAX - 7, 5, 0),
    (KERNEL_MAX + 1, 0, 0), (300_007, 5, 3),
])
def test_the_gated_copy_copies_every_byte_at_any_alignment(nbytes: int, src_offset: int, dst_offset: int) -> None:
    host = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8).pin_memory()
    device = torch.zeros(nbytes + 64, dtype=torch.uint8, device="cuda")
    flags, flags_address = _flags(1)  # open: the copy runs at once
    _capture(flags_address, host, device, nbytes, src_offset, dst_offset)
    torch.cuda.synchronize()
    assert torch.equal(device[dst_offset:dst_offset + nbytes].cpu(), host[src_offset:src_offset + nbytes])
    assert not device[:dst_offset].any() and not device[dst_offset + nbytes:].any()  # nothing else written
    assert flags.tolist() == [0, 1]  # gate closed, arrival set


@pytest.mark.parametrize("numel", [1000, KERNEL_MAX // 4 + 1000])
def test_the_gated_copy_waits_at_a_closed_gate_and_reads_what_was_written_before_it_opened(numel: int) -> None:
    host = torch.zeros(numel, dtype=torch.int32).pin_memory()
    device = torch.zeros(numel, dtype=torch.int32, device="cuda")
    flags, flags_address = _flags(0)
    stream = torch.cuda.current_stream()
    _capture(flags_address, host, device, numel * 4)
    values = torch.randint(-2**31, 2**31 - 1, (numel,), dtype=torch.int32)
    try:
        deadline = time.monotonic() + 5
        while flags[1].item() == 0 and time.monotonic() < deadline:  # the arrival: the GPU is at the gate
            time.sleep(1e-4)
        assert flags[1].item() == 1
        time.sleep(0.01)
        assert not stream.query()  # still waiting
        host.copy_(values)  # written while the copy waits, then released
    finally:
        flags[0] = 1  # (released whatever happened: a copy left waiting would hang the next tests)
    stream.synchronize()
    assert torch.equal(device.cpu(), values)
    assert flags[0].item() == 0


# -- staged graphs -------------------------------------------------------------------------------

SHAPES = [((1,), torch.int8), ((3,), torch.float16), ((9,), torch.int32), ((1000,), torch.int64),
          ((70_001,), torch.int32), ((4, 5), torch.bool), ((7,), torch.float64)]


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


def _graph(after_launch: bool, rng: random.Random,
           switchable: str | None = None) -> tuple[bcg.BreakableGraph, Buffers, list[torch.Tensor]]:
    """A graph whose staged breakpoint copies every buffer into outputs (inside ``bcg.switchable(switchable)``
    when given), with its staging and outputs."""
    staging = Buffers()

    @bcg.breakpoint(name="read", mutates=("outs",), prepare=staging.prepare, fits=lambda values: True,
                    prepare_after_launch=after_launch)
    def read(outs: list[torch.Tensor]) -> None:
        values = bcg.live()
        sources = values.device if values.device is not None else [v.to("cuda") for v in values.host]
        for out, src in zip(outs, sources):
            out.copy_(src)

    outs = [torch.zeros(shape, dtype=dtype, device="cuda") for shape, dtype in SHAPES]

    def forward(outs: list[torch.Tensor]) -> torch.Tensor:
        with bcg.switchable(switchable) if switchable is not None else contextlib.nullcontext():
            read(outs)
        return outs[2].float().sum()  # segment work after the staged step

    graph = bcg.make_graph(forward, outs, live=_live(rng))
    return graph, staging, outs


@pytest.fixture(params=["kernel", "stream memory operations"])
def gate_form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param != "kernel":
        monkeypatch.setattr(gate, "kernel", lambda device: None)  # as where NVRTC is missing
    return str(request.param)


@pytest.mark.parametrize("after_launch", [False, True])
def test_staged_copies_of_every_dtype_and_size_are_bit_exact(gate_form: str, after_launch: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bcg.staged.staging, "PREPARE_FIRST_REPLAYS", 0)  # launch first even when late (idle GPU)
    rng = random.Random(11)
    graph, staging, outs = _graph(after_launch, rng)
    assert graph.stats().staged == ("read",)
    assert all(buf.gate_open is False for buf in staging.buffers)
    for _ in range(20):
        live = _live(rng)
        graph.replay(live)
        for out, v in zip(outs, live.host):
            assert torch.equal(out.cpu(), v)
    torch.cuda.synchronize()
    assert not any(buf.gate_open for buf in staging.buffers)  # every released value was read
    # gated: the kernel for every staged copy; the stream memory operations only when asked
    assert graph.prepares_after_launch == after_launch
    assert graph.launch_order()[0] == (20 if after_launch else 0)


@pytest.mark.parametrize("after_launch", [False, True])
def test_replays_queued_behind_a_busy_gpu_read_their_own_values(gate_form: str, after_launch: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bcg.staged.staging, "PREPARE_FIRST_REPLAYS", 0)  # keep launching first on a busy GPU
    rng = random.Random(12)
    graph, staging, outs = _graph(after_launch, rng)
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


def test_without_the_kernel_and_without_prepare_after_launch_the_copy_is_not_gated(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gate, "kernel", lambda device: None)
    rng = random.Random(13)
    graph, staging, outs = _graph(False, rng)
    live = _live(rng)
    graph.prepare_staged(live)
    assert not any(buf.gate_open for buf in staging.buffers)  # a plain copy: no gate to open
    graph.replay(live)
    for out, v in zip(outs, live.host):
        assert torch.equal(out.cpu(), v)


def test_a_switchable_block_holding_a_staged_copy_always_runs(gate_form: str) -> None:
    # the copy must run at every replay (its gate is opened for it): a group holding it is not skipped
    rng = random.Random(15)
    graph, staging, outs = _graph(False, rng, switchable="s")
    assert graph.set_enabled("s", False) is False  # the group always runs
    for _ in range(4):
        live = _live(rng)
        graph.replay(live)
        for out, v in zip(outs, live.host):
            assert torch.equal(out.cpu(), v)
    assert not any(buf.gate_open for buf in staging.buffers)


def test_with_the_kernel_every_staged_copy_is_gated() -> None:
    rng = random.Random(14)
    graph, staging, outs = _graph(False, rng)
    live = _live(rng)
    graph.prepare_staged(live)  # prepare, then the gates open ...
    assert all(buf.gate_open for buf in staging.buffers)
    graph.settle_staged()  # ... no launch follows: closed again
    assert not any(buf.gate_open for buf in staging.buffers)
    graph.replay(live)
    for out, v in zip(outs, live.host):
        assert torch.equal(out.cpu(), v)
    assert not any(buf.gate_open for buf in staging.buffers)  # the copies closed them
