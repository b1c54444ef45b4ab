"""Which staged tiers a runner bucket keeps: each is timed at capture against the form its
calls would replay without it, and dropped unless it is faster in every timed round.

A tier (:class:`bcg.StagedTiers`) is there for speed: its staged breakpoints
have smaller bounds (fewer request slots, a shorter context). It also costs the
GPU something the form after it does not: it ends by copying its outputs into
the bucket's. Where the kernels gain less than that copy (small bounds, small
models), the tier would make every call it serves slower; so it is replayed
against the next form, on its own capture value, before any call sees it.

Faster means faster in every round, not in the median: where the two forms
time alike, a median would keep or drop the tier by chance, so two captures of
the same model would serve calls with different forms.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bcg.form import Form
from bcg.graph import BreakableGraph

log = logging.getLogger("bcg")

#: Timed rounds per tier; each round replays the tier and the next form (order alternating).
ROUNDS = 5

#: Each sample queues replays of one form for at least this much GPU time (seconds).
SAMPLE_S = 1e-3


def keep_faster_tiers(graph: BreakableGraph, tiers: Sequence[tuple[Form, Any]],
                      all_ranks: Callable[[bool], bool] | None = None) -> list[str]:
    """Time each tier of ``graph`` against the form a replay of its capture value would run
    without it (the next tier kept, or the inline form), largest bounds first; drop it unless
    it is faster in every round. Returns the names of the tiers dropped.

    Arguments:
        tiers: the tier forms and the live values they were captured with.
        all_ranks: with ranks, ``RankAgreement.all``: a tier is kept only where every rank
            timed it faster in every round (the ranks' forms stay the same).

    .. warning::
        Each tier is replayed about ``2 * ROUNDS`` times on the bucket's example inputs (more
        where one replay is short), on the current stream; other work on the device makes
        the timing, and so the choice, noisier. The replays go through Python: where one
        replay's GPU work is shorter than that host path, the timing measures the host, and
        the two forms time alike.
    """
    dropped = []
    counts = [(f, f.replays) for f in graph.forms]  # (the timing's replays are not calls)
    for form, live in reversed(tiers):
        i = graph.forms.index(form)
        j = graph.choose(live, start=i + 1)
        try:
            own, other = time_forms(graph, (i, j), live)
            faster = bool(own) and all(a < b for a, b in zip(own, other, strict=True))
        except Exception as exc:  # (a replay that raises here would raise at a call too: drop the tier)
            log.warning("bcg: timing %s failed, the tier is dropped: %s: %s", form.name, type(exc).__name__, exc)
            own = other = [math.nan]
            faster = False
        if all_ranks is not None:
            faster = all_ranks(faster)
        log.debug("bcg: %s: %.1f us per replay (median), the %s form %.1f us: %s", form.name,
                  statistics.median(own) * 1e6, graph.forms[j].name, statistics.median(other) * 1e6,
                  "kept" if faster else "dropped")
        if not faster:
            graph.drop_form(i)
            dropped.append(form.name)
    for f, replays in counts:
        f.replays = replays
    return dropped


def time_forms(graph: BreakableGraph, indices: Sequence[int], live: Any,
               rounds: int = ROUNDS) -> list[list[float]]:
    """The GPU seconds per replay of each form of ``indices`` with ``live``, one sample per round:
    replays queued back to back on the current stream, in ``rounds`` rounds (form order
    alternating), after one untimed replay of each."""
    for k in indices:
        graph.replay_form(k, live)
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    first.record()
    graph.replay_form(indices[0], live)
    last.record()
    last.synchronize()
    per_replay = first.elapsed_time(last) / 1e3
    repeat = max(1, min(100, math.ceil(SAMPLE_S / max(per_replay, 1e-6))))
    marks = []
    for r in range(rounds):
        for k in (indices if r % 2 == 0 else indices[::-1]):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeat):
                graph.replay_form(k, live)
            end.record()
            marks.append((k, start, end))
    marks[-1][2].synchronize()
    samples: dict[int, list[float]] = {k: [] for k in indices}
    for k, start, end in marks:
        samples[k].append(start.elapsed_time(end) / 1e3 / repeat)
    return [samples[k] for k in indices]
