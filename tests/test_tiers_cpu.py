"""Which staged tiers a runner bucket keeps (bcg.runner.tiers), with the timing replaced: each
tier against the form its value would run without it, largest bounds first; ranks agree."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import bcg
import bcg.runner.tiers as tiers
from bcg.errors import ReplayError


class FakeForm:
    def __init__(self, name: str, bound: int | None) -> None:
        self.name, self.bound, self.replays = name, bound, 0
        self.tier = name.startswith("tier")


class FakeGraph:
    """Forms with a bound each (None: takes anything); choose and drop_form as BreakableGraph's."""

    def __init__(self, *forms: FakeForm) -> None:
        self._forms = list(forms)
        self.dropped: list[str] = []

    @property
    def forms(self) -> tuple[FakeForm, ...]:
        return tuple(self._forms)

    def choose(self, live: int, start: int = 0) -> int:
        return next(i for i in range(start, len(self._forms))
                    if self._forms[i].bound is None or live <= self._forms[i].bound)

    def drop_form(self, index: int) -> None:
        assert self._forms[index].tier
        self.dropped.append(self._forms.pop(index).name)


def _timed(monkeypatch: pytest.MonkeyPatch, per_replay: dict[str, float | list[float]]) -> list[tuple[str, str, Any]]:
    """Replace the timing: each form takes ``per_replay[name]`` in each of three rounds (or the
    rounds' samples given); returns the pairs timed."""
    pairs: list[tuple[str, str, Any]] = []

    def time_forms(graph: FakeGraph, indices: Any, live: Any, rounds: int = 0) -> list[list[float]]:
        names = [graph.forms[k].name for k in indices]
        pairs.append((names[0], names[1], live))
        for k in indices:
            graph.forms[k].replays += 7  # what the timing's replays would count
        return [v if isinstance(v := per_replay[n], list) else [v] * 3 for n in names]

    monkeypatch.setattr(tiers, "time_forms", time_forms)
    return pairs


def _graph() -> tuple[FakeGraph, list[tuple[FakeForm, int]]]:
    forms = [FakeForm("tier 0", 1), FakeForm("tier 1", 2), FakeForm("inline", 4), FakeForm("breakable", None)]
    forms[2].replays = 3
    return FakeGraph(*forms), [(forms[0], 1), (forms[1], 2)]


def test_a_tier_no_faster_than_the_next_form_is_dropped_and_the_smaller_one_faces_what_is_left(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pairs = _timed(monkeypatch, {"tier 0": 1.0, "tier 1": 2.5, "inline": 2.0})
    graph, captured = _graph()
    assert tiers.keep_faster_tiers(graph, captured) == ["tier 1"]
    # largest bounds first; tier 0 then faces the inline form, since tier 1 is gone
    assert pairs == [("tier 1", "inline", 2), ("tier 0", "inline", 1)]
    assert [f.name for f in graph.forms] == ["tier 0", "inline", "breakable"]
    assert [f.replays for f in graph.forms] == [0, 3, 0]  # the timing's replays are not counted


def test_a_kept_tier_is_the_next_form_of_the_tier_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    pairs = _timed(monkeypatch, {"tier 0": 1.0, "tier 1": 1.0, "inline": 2.0})
    graph, captured = _graph()
    assert tiers.keep_faster_tiers(graph, captured) == ["tier 0"]  # a tie is not faster
    assert pairs == [("tier 1", "inline", 2), ("tier 0", "tier 1", 1)]


def test_a_tier_faster_in_the_median_but_not_in_every_round_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    # tier 1 wins four rounds of five and loses one: the forms time alike within the noise
    _timed(monkeypatch, {"tier 0": [1.0] * 5, "tier 1": [1.9, 1.9, 2.1, 1.9, 1.9], "inline": [2.0] * 5})
    graph, captured = _graph()
    assert tiers.keep_faster_tiers(graph, captured) == ["tier 1"]
    assert [f.name for f in graph.forms] == ["tier 0", "inline", "breakable"]


def test_ranks_keep_a_tier_only_where_every_rank_timed_it_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    _timed(monkeypatch, {"tier 0": 1.0, "tier 1": 1.5, "inline": 2.0})  # both faster here
    asked: list[bool] = []

    def all_ranks(flag: bool) -> bool:  # the other rank timed tier 1 slower
        asked.append(flag)
        return flag and len(asked) != 1

    graph, captured = _graph()
    assert tiers.keep_faster_tiers(graph, captured, all_ranks) == ["tier 1"]
    assert asked == [True, True] and [f.name for f in graph.forms] == ["tier 0", "inline", "breakable"]


def test_a_tier_whose_timing_raises_is_dropped_and_the_rest_still_timed(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    def time_forms(graph: FakeGraph, indices: Any, live: Any, rounds: int = 0) -> list[list[float]]:
        if graph.forms[indices[0]].name == "tier 1":
            raise ReplayError("a replay failed")
        return [[1.0, 1.0], [2.0, 2.0]]

    monkeypatch.setattr(tiers, "time_forms", time_forms)
    graph, captured = _graph()
    asked: list[bool] = []
    with caplog.at_level(logging.WARNING, logger="bcg"):
        assert tiers.keep_faster_tiers(graph, captured, lambda flag: asked.append(flag) or flag) == ["tier 1"]
    assert asked == [False, True]  # every rank still takes part in each vote
    assert "timing tier 1 failed" in caplog.text and [f.name for f in graph.forms] == ["tier 0", "inline", "breakable"]


def test_drop_form_refuses_a_form_that_is_not_a_staged_tier() -> None:
    graph = bcg.make_graph(lambda x: x * 2, torch.randn(3), mode="eager")  # one form
    with pytest.raises(ReplayError, match="drops a staged tier"):
        graph.drop_form(0)
    assert len(graph.forms) == 1
    assert graph.choose(start=0) == 0
