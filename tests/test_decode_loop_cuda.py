"""Decode loops that run ahead on a GPU: a GraphRunner called step after step on inputs written
by the device from the previous step's output, with no host synchronization, each step's staged
metadata its own (docs/staged.md, "Decode loops that run ahead").

What keeps a replay queued behind others from reading a later step's metadata depends on how the
buffer reaches the device. A small one travels in a kernel's parameters, set at each replay and
kept by launches already queued: the host never waits. A large one is a captured copy from pinned
memory, and ``StagingBuffer.write`` waits for the event recorded after the previous replay's copy.
The controls take each away (the parameters set once; every CUDA event read as done) and assert
that the same loop then goes wrong, so the loops that pass are evidence of each."""

from __future__ import annotations

import random

import pytest
import torch

import bcg
from bcg.bench import cli
from bcg.staged.kernel import StageLaunch, param_bytes
from bcg.bench.case import DecodeLoop, eager_step
from bcg.bench.modes import MODES
from bcg.bench.registry import BuildContext
from bcg.bench.workloads import llama

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():  # pragma: no cover - collected on CPU machines
    pytest.skip("needs an NVIDIA GPU (CUDA not available)", allow_module_level=True)

ROWS, HIDDEN, STEPS = 8, 16, 32
#: buffer sizes (float32 values) for each route: ROWS values travel in kernel parameters, more
#: than ``param_bytes()`` bytes are copied
SIZES = {"parameters": ROWS, "copy": param_bytes() // 4 + 1}


def _busy_gpu(ms: float) -> None:
    """Queue about ``ms`` milliseconds of GPU spin on the current stream (``torch.cuda._sleep``,
    its cycles calibrated once with CUDA events), so that the steps queued after it wait."""
    global _CYCLES_PER_MS
    if _CYCLES_PER_MS is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS = 10_000_000 / max(start.elapsed_time(end), 1e-3)
    torch.cuda._sleep(int(ms * _CYCLES_PER_MS))


_CYCLES_PER_MS: float | None = None


class Addends:
    """A staged breakpoint that adds each row's addend of this step (the live metadata: one host
    number per row, at most ``ROWS``), staged in one StagingBuffer of ``ROWS`` values: a step
    that read another step's addends would change the loop's sums."""

    def __init__(self, size: int = ROWS) -> None:
        self.size = size
        self.buffer = bcg.StagingBuffer((size,), dtype=torch.float32)
        self.breakpoint = bcg.breakpoint(self._add, name="add_staged", mutates=("out",), prepare=self.prepare,
                                         fits=self.fits)

    def prepare(self, addends: tuple[float, ...]) -> torch.Tensor:
        self.buffer.write((*addends, *(0.0,) * (self.size - len(addends))))
        return self.buffer.device

    def fits(self, addends: tuple[float, ...]) -> bool:
        return len(addends) <= ROWS

    @staticmethod
    def _add(x: torch.Tensor, out: torch.Tensor) -> None:
        v = bcg.live()  # inline: the staged device buffer; the breakable form and eager calls: the host values
        v = v[: x.shape[0]] if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=x.dtype).to(x.device)
        out.copy_(x + v.unsqueeze(1))


def _addend_loop(rng: random.Random, route: str = "parameters") -> tuple[bcg.GraphRunner, DecodeLoop, torch.Tensor,
                                                                          torch.Tensor]:
    """A runner over one staged step ``x -> 2 * x - x + addends``, and a decode loop of ``STEPS``
    steps whose next input is the step's output (a device copy), with fresh integer addends per
    step and row; the expected end: the start plus each row's sum (exact in float32)."""
    _busy_gpu(0)  # calibrated now, outside the checks
    staged = Addends(SIZES[route])
    assert staged.buffer.in_parameters == (route == "parameters")

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = 2 * x - x  # captured work before the staged copy
        out = torch.empty_like(h)
        staged.breakpoint(h, out)
        return out

    runner = bcg.GraphRunner(forward, buckets=[ROWS], example_inputs=(torch.zeros(ROWS, HIDDEN, device="cuda"),),
                             live=lambda n: tuple(float(i) for i in range(n)), progress=False)
    runner.capture()
    addends = [tuple(float(rng.randint(1, 1000)) for _ in range(ROWS)) for _ in range(STEPS)]
    start = torch.tensor([[rng.randint(-1000, 1000) for _ in range(HIDDEN)] for _ in range(ROWS)],
                         dtype=torch.float32, device="cuda")

    def advance(inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        inputs[0].copy_(out)

    loop = DecodeLoop(STEPS, (start,), lambda n: addends[n], advance)
    sums = torch.tensor([sum(a[r] for a in addends) for r in range(ROWS)], device="cuda")
    return runner, loop, start + sums.unsqueeze(1), torch.tensor(addends[-1], device="cuda")


def _run_behind_a_busy_gpu(runner: bcg.GraphRunner, loop: DecodeLoop) -> torch.Tensor:
    """The loop queued behind 200 ms of GPU spin (every step's host work is done long before the
    GPU reaches step 0, unless a write waits); the input after the last step."""
    (x,) = runner.input_buffers(ROWS)
    _busy_gpu(200)
    loop.run(lambda live: runner(x, live=live), (x,))
    torch.cuda.synchronize()
    return x.clone()


@pytest.mark.parametrize("route", ["parameters", "copy"])
def test_a_loop_queued_behind_a_busy_gpu_reads_each_steps_own_metadata(monkeypatch: pytest.MonkeyPatch,
                                                                        route: str) -> None:
    """No host synchronization in the loop (sync debug mode "error"), yet every step reads its own
    addends: in kernel parameters with no wait at all (the GPU is still busy when the loop ends);
    copied, with the host blocked in StagingBuffer.write on the previous step's copy event."""
    runner, loop, expected, _ = _addend_loop(random.Random(), route)
    (x,) = runner.input_buffers(ROWS)
    loop.run(lambda live: runner(x, live=live), (x,))  # a first loop, not timed: lazy set-up outside the check
    torch.cuda.synchronize()
    waits = []
    synchronize = torch.cuda.Event.synchronize

    def counted(event: torch.cuda.Event) -> None:
        waits.append(event)
        synchronize(event)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", counted)
    torch.cuda.set_sync_debug_mode("error")
    try:
        end = _run_behind_a_busy_gpu(runner, loop)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(end, expected)
    if route == "copy":
        assert waits, "the loop ran ahead of a busy GPU, so a write must have waited for a copy event"
    else:
        assert not waits
    stats = runner.stats()
    assert stats["graph_calls"] == stats["inline_replays"] == 2 * STEPS and not any(stats["staged_fallbacks"].values())
    runner.reset()


def test_control_with_the_parameters_set_once_a_queued_step_reads_the_captures_metadata(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop in kernel parameters, replayed by the Python executor with the per-replay setting
    taken away: every step adds the addends set last before it (the first loop's last), not its own."""
    runner, loop, expected, last = _addend_loop(random.Random(), "parameters")
    (x,) = runner.input_buffers(ROWS)
    loop.run(lambda live: runner(x, live=live), (x,))
    torch.cuda.synchronize()
    graph = runner.graph(ROWS)
    assert graph is not None
    graph.use_executor("python")
    monkeypatch.setattr(StageLaunch, "set_in", lambda self, graph_exec, node: None)
    end = _run_behind_a_busy_gpu(runner, loop)
    monkeypatch.undo()
    assert not torch.equal(end, expected)
    assert torch.equal(end, loop.start[0] + STEPS * last.unsqueeze(1))
    runner.reset()


def test_control_without_the_wait_a_queued_copy_reads_a_later_steps_metadata(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The copied loop with StagingBuffer.write's wait taken away (every CUDA event reads as done):
    the copies, queued behind the busy GPU, read whatever the host wrote last."""
    runner, loop, expected, last = _addend_loop(random.Random(), "copy")
    (x,) = runner.input_buffers(ROWS)
    loop.run(lambda live: runner(x, live=live), (x,))
    torch.cuda.synchronize()
    monkeypatch.setattr(torch.cuda.Event, "query", lambda event: True)
    end = _run_behind_a_busy_gpu(runner, loop)
    monkeypatch.undo()
    assert not torch.equal(end, expected)
    # every copy ran after the host's last write: each step added the last step's addends
    assert torch.equal(end, loop.start[0] + STEPS * last.unsqueeze(1))
    runner.reset()


def test_the_bench_decode_loop_runs_ahead_and_equals_the_eager_loop() -> None:
    """The bench's decode-loop point (tiny model, contexts crossing page boundaries and staged
    tiers as they grow): bcg-staged's and bcg's loops, queued behind a busy GPU with no host
    synchronization, generate the eager loop's ids at every step; the rows' GPU measures exist."""
    args = cli.parse_args(["--workload", "llama", "--attn", "decode-loop", "--shape", "tiny", "--tokens", "4",
                           "--context", "24", "--page", "4", "--steps", "24", "--vocab", "256",
                           "--seed", str(random.randrange(2**31))], cuda=True)
    device = torch.device("cuda", torch.cuda.current_device())
    model = llama.setup(args, device)
    case = llama.make_case(model, args, device, "decode-loop", 4)
    assert case.loop is not None
    lives = [case.loop.live(n).batch for n in range(args.steps)]
    assert lives[-1].max_pages > lives[0].max_pages  # the tables grow across page boundaries
    case.write_inputs(True)  # fresh ids
    step = eager_step(case.forward(case.bp), case.static_args)
    with torch.no_grad():
        expected = case.loop.run(step, case.static_args).clone()
    assert len(set(expected.flatten().tolist())) > 1
    for mode in ("bcg-staged", "bcg"):
        built = MODES[mode].build(case, BuildContext())
        try:
            built.run()  # set-up outside the check
            stop = built.measure() if built.measure is not None else None
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                _busy_gpu(100)
                ids = built.run()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            assert torch.equal(ids, expected), mode
            if stop is not None:
                fields = stop()
                assert fields["gpu_idle_us_per_step"] >= 0 and fields["gpu_us_per_step"] > 0
                if mode == "bcg-staged":
                    assert fields["inline_fraction"] == 1.0
        finally:
            built.close()
    case.write_inputs(False)
