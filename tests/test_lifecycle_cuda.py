"""The serving lifecycle on a GPU: weights updated in place keep every graph right; moved weights
are refused until a recapture; a reset runner gives its memory back and captures again.

The forward reads its weight from a dict, as a model reads its parameters: ``weights["w"].copy_(new)``
updates in place (an RL weight sync), ``weights["w"] = new`` moves it (an offload and reload, or
``load_state_dict(assign=True)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import bcg
from bcg.errors import StaleTensorError

pytestmark = pytest.mark.cuda

N = 256
ROWS = 32


def _model(kind: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], dict[str, torch.Tensor], Any]:
    """``(forward, weights, make_live)``: a matmul, a breakpoint adding ``b`` (plain, staged or
    keyed), another matmul."""
    weights = {"w": torch.randn(N, N, device="cuda") / N**0.5}
    if kind == "staged":
        staged_b = bcg.StagingBuffer(1, dtype=torch.float32)

        def prepare(live: dict[str, float]) -> torch.Tensor:
            staged_b.write([live["b"]])
            return staged_b.device

        @bcg.breakpoint(mutates="h", prepare=prepare, fits=lambda live: True)
        def add(h: torch.Tensor) -> None:
            b = bcg.live()
            h.add_(b if isinstance(b, torch.Tensor) else float(b["b"]))  # inline: the staged tensor
    elif kind == "keyed":
        @bcg.breakpoint(mutates="h", key=lambda live: live["b"])
        def add(h: torch.Tensor) -> None:
            h.add_(float(bcg.live()["b"]))
    else:
        @bcg.breakpoint(mutates="h")
        def add(h: torch.Tensor) -> None:
            h.add_(float(bcg.live()["b"]))

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = x @ weights["w"]
        add(h)
        return torch.tanh(h @ weights["w"])

    return forward, weights, lambda b: {"b": b}


def _eager(x: torch.Tensor, w: torch.Tensor, b: float) -> torch.Tensor:
    return torch.tanh((x @ w + b) @ w)


@pytest.mark.parametrize("kind", ["plain", "staged", "keyed"])
def test_weights_updated_in_place_are_followed_without_a_recapture(kind: str) -> None:
    forward, weights, live = _model(kind)
    x = torch.randn(ROWS, N, device="cuda")
    graph = bcg.make_graph(forward, x, live=live(1.0))
    for step in range(3):
        for b in (0.5, 0.5, -1.0):  # (keyed: the second 0.5 replays its variant)
            x.copy_(torch.randn(ROWS, N, device="cuda"))
            torch.testing.assert_close(graph.replay(live=live(b)), _eager(x, weights["w"], b), rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"{kind}, weights version {step}, b={b}: {m}")
        weights["w"].copy_(torch.randn(N, N, device="cuda") / N**0.5)  # the sync: same storage, new values
    graph.reset()


@pytest.mark.parametrize("kind", ["plain", "staged", "keyed"])
def test_moved_weights_are_refused_until_a_recapture(kind: str) -> None:
    forward, weights, live = _model(kind)
    x = torch.randn(ROWS, N, device="cuda")
    graph = bcg.make_graph(forward, x, live=live(1.0))
    graph.replay(live=live(0.5))
    weights["w"] = torch.randn(N, N, device="cuda") / N**0.5  # moved: the old storage is the graph's alone
    with pytest.raises(StaleTensorError, match="replaced tensor"):
        graph.replay(live=live(0.5))
    graph.reset()
    graph = bcg.make_graph(forward, x, live=live(1.0))
    torch.testing.assert_close(graph.replay(live=live(0.25)), _eager(x, weights["w"], 0.25), rtol=1e-4, atol=1e-4)
    graph.reset()


@pytest.mark.parametrize("lazy", [False, True])
def test_a_reset_runner_gives_its_memory_back_and_wakes_on_moved_weights(lazy: bool) -> None:
    """Sleep: reset() frees every graph, the pool and the static inputs (memory reserved back to
    its level before the capture, but for torch's cuBLAS workspaces). The weights then move.
    Wake: capture() (or, lazily, the calls) rebuilds the ladder on the new weights."""
    forward, weights, live = _model("plain")
    buckets = [16, 32]
    example = torch.randn(24, N, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    runner = bcg.GraphRunner(forward, buckets, example_inputs=(example,), live=live(1.0),
                             progress=False, lazy=lazy)

    def check(T: int, b: float) -> None:
        x = torch.randn(T, N, device="cuda")
        torch.testing.assert_close(runner(x, live=live(b)), _eager(x, weights["w"], b), rtol=1e-4, atol=1e-4)

    if not lazy:
        runner.capture()
    for T in (10, 30, 12, 31):
        check(T, 0.5)
    assert runner.stats()["pool_bytes"] > 0
    weights["w"] = torch.randn(N, N, device="cuda") / N**0.5  # moved under the graphs
    with pytest.raises(StaleTensorError):
        runner(torch.randn(10, N, device="cuda"), live=live(0.5))
    runner.reset()  # empties torch's cache itself
    torch.cuda.synchronize()
    held_by_torch = 64 << 20  # torch's per-(handle, stream) cuBLAS workspaces, allocated outside any pool
    assert torch.cuda.memory_reserved() - before <= held_by_torch + weights["w"].nbytes
    if not lazy:
        runner.capture()
    for T in (10, 30, 12, 31):
        check(T, -0.75)
    runner.reset()
