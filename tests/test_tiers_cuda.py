"""Staged tiers timed at capture on a GPU: a tier slower than the form after it is dropped, a
faster one is kept, and calls stay bit-identical to eager whichever form serves them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch

import bcg

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():  # pragma: no cover - collected on CPU machines
    pytest.skip("needs an NVIDIA GPU (CUDA not available)", allow_module_level=True)

SLOTS = 4
#: identity passes a form's inline breakpoint adds, by the slots it was captured for: the
#: 2-slot tier is slower than the inline form (4 slots), the 1-slot tier faster
EXTRA = {1: 0, 2: 600, SLOTS: 200}


@dataclass(frozen=True)
class Live:
    requests: int
    slots: int | None = None  # a tier's capture: the slots it is for


class Staged(NamedTuple):
    slots: int
    scale: torch.Tensor


def test_a_tier_slower_than_the_next_form_is_dropped_and_a_faster_one_kept() -> None:
    scale = bcg.StagingBuffer(1, dtype=torch.float32)

    def prepare(live: Live) -> Staged:
        scale.write([float(live.requests)])
        return Staged(live.slots or SLOTS, scale.device)

    def fits(live: Live, staged: Staged) -> bool:
        return live.requests <= staged.slots

    @bcg.breakpoint(name="stage", mutates=("out",), prepare=prepare, fits=fits)
    def stage(h: torch.Tensor, out: torch.Tensor) -> None:
        value = bcg.live()
        if isinstance(value, Staged):  # inline: the scale from the staging buffer, and its passes
            out.copy_(h * value.scale)
            for _ in range(EXTRA[value.slots]):
                out.add_(0.0)
        else:  # eager, or the breakable form: the real metadata
            out.copy_(h * float(value.requests))

    w = torch.randn(256, 256, device="cuda") / 16

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = x @ w
        out = torch.empty_like(h)
        stage(h, out)
        return torch.relu(out) @ w

    runner = bcg.GraphRunner(forward, buckets=[64], example_inputs=(torch.randn(64, 256, device="cuda"),),
                             live=lambda n: bcg.StagedTiers(Live(1, slots=1), Live(2, slots=2), Live(SLOTS)),
                             progress=False).capture()
    graph = runner.graph(64)
    assert [f.name for f in graph.forms] == ["tier 0", "inline", "breakable"]
    assert graph.choose(Live(1)) == 0 and graph.choose(Live(2)) == 1 and graph.choose(Live(1), start=1) == 1
    assert runner.stats()["inline_replays"] == 0  # the timing's replays are not calls
    served = {1: 0, 2: 0, 5: 0}
    for i in range(24):
        requests = [1, 2, 5][i % 3]  # 5 > SLOTS: the breakable form
        x = torch.randn(64, 256, device="cuda")
        with bcg.live_scope(Live(requests)), torch.no_grad():
            expected = forward(x)
        assert torch.equal(runner(x, live=Live(requests)), expected), (i, requests)
        served[requests] += 1
    stats = runner.stats()
    assert stats["tier_replays"] == served[1] and stats["inline_replays"] == served[1] + served[2]
    assert stats["staged_fallbacks"] == {"stage does not fit": served[5]}
    runner.reset()
