"""Verification and debugging aids that need no GPU: verify in eager mode, describe, logging."""

from __future__ import annotations

import logging

import pytest
import torch

import bcg

from .models import TinyLlama, positions_for, random_lengths


def _inputs(T: int, gen: torch.Generator):  # noqa: ANN202
    def make() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(T, 64, generator=gen), positions_for([T], T, "cpu")

    return make


def test_verify_passes_in_eager_mode() -> None:
    model = TinyLlama(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    T = 16
    samples = [{"lengths": random_lengths(T, 1 + i % 3, gen)} for i in range(5)]
    report = bcg.verify(model, _inputs(T, gen), samples, mode="eager")
    assert report.ok and report.samples == 5
    assert "replay equals eager" in str(report)


def test_verify_names_a_breakpoint_whose_output_changes_from_the_same_inputs() -> None:
    calls = {"n": 0}

    @bcg.breakpoint
    def drifting(t: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return t + calls["n"]  # reads hidden state: not a function of its inputs and live()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return drifting(x * 2) - 1

    gen = torch.Generator().manual_seed(1)
    with pytest.raises(bcg.errors.VerificationError) as info:
        bcg.verify(fn, lambda: (torch.randn(8, generator=gen),), [None, None], mode="eager")
    first = info.value.report.first
    assert first is not None and first.where == "breakpoint"
    assert first.breakpoint_after.endswith("drifting")
    report = bcg.verify(fn, lambda: (torch.randn(8, generator=gen),), [None], mode="eager", raise_on_mismatch=False)
    assert not report.ok and "drifting" in str(report)


def test_verify_rejects_empty_samples_and_foreign_graphs() -> None:
    with pytest.raises(ValueError, match="at least one"):
        bcg.verify(lambda x: x, lambda: (torch.randn(2),), [])
    with pytest.raises(ValueError, match="make_graph"):
        bcg.verify(bcg.BreakableGraph(), lambda: (torch.randn(2),), [None])


def test_describe_lists_segments_and_breakpoints() -> None:
    model = TinyLlama(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, device="cpu", dtype=torch.float32, returning=True)
    T = 8
    graph = bcg.make_graph(model, torch.randn(T, 64), positions_for([T], T, "cpu"), mode="eager", live={"lengths": [T]})
    text = graph.describe()
    assert text.count("breakpoint") >= 2 and "segment[0]" in text and "segment[2]" in text
    assert "eager mode" in text and "attention_returning" in text


def test_capture_logs_a_summary_at_info(caplog: pytest.LogCaptureFixture) -> None:
    @bcg.breakpoint
    def bp(t: torch.Tensor) -> None:
        t.add_(1)

    with caplog.at_level(logging.DEBUG, logger="bcg"):
        bcg.make_graph(lambda t: bp(t * 2), torch.randn(3), mode="eager")
    assert any(r.levelno == logging.INFO and "1 breakpoint" in r.getMessage() for r in caplog.records)
    assert any(r.levelno == logging.DEBUG and "breakpoint" in r.getMessage() for r in caplog.records)
