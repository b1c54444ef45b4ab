"""What :meth:`bcg.GraphRunner.stats` reports: counters and sizes over a runner's buckets."""

from __future__ import annotations

from typing import Any

from bcg.runner.ladder import TRIGGERS, Ladder


def runner_stats(ladder: Ladder, capturing: bool, fallbacks: dict[str, int], real_rows: int) -> dict[str, Any]:
    """The dict :meth:`bcg.GraphRunner.stats` returns (its docstring names the keys).

    Arguments:
        ladder: the runner's buckets.
        capturing: a background capture runs now.
        fallbacks: calls run eagerly, by reason.
        real_rows: the rows of graph calls that were the calls' own (not padding).
    """
    buckets = ladder.buckets
    pool = ladder.pool_bytes()
    alone = ladder.largest_alone
    staged = [st.staged for x in buckets.values() if x.graph is not None
              for st in (x.graph.stats(),) if st.staged is not None]
    graph_calls = sum(x.replays for x in buckets.values())
    padded_rows = sum(x.size * x.replays for x in buckets.values())
    staged_fallbacks: dict[str, int] = {}
    for st in staged:
        for reason, count in st.breakable_replays.items():
            staged_fallbacks[reason] = staged_fallbacks.get(reason, 0) + count
    return {
        "mode": ladder.mode,
        "buckets": list(ladder.sizes),
        "captured_buckets": [b for b in ladder.sizes if buckets[b].captured],
        "failed_buckets": {b: x.failure for b, x in buckets.items() if x.failure is not None},
        "capture_s": {b: x.capture_s for b, x in buckets.items() if x.captured or x.failure},
        "captures": {trigger: sum(1 for x in buckets.values() if x.captured and x.trigger == trigger)
                     for trigger in TRIGGERS},
        "capturing": capturing,
        "capture_total_s": ladder.capture_total_s,
        "pool_bytes": pool,
        "largest_alone_pool_bytes": alone,
        "pool_ratio": pool / alone if alone else None,
        "calls": graph_calls + sum(fallbacks.values()),
        "graph_calls": graph_calls,
        "replays": {b: x.replays for b, x in buckets.items()},
        "fallbacks": dict(fallbacks),
        "padding_ratio": 1 - real_rows / padded_rows if padded_rows else 0.0,
        "inline_replays": sum(st.inline_replays for st in staged),
        "tier_replays": sum(sum(st.replays[:-1]) for st in staged),
        "staged_fallbacks": staged_fallbacks,
        "variants": _variant_stats(ladder),
    }


def _variant_stats(ladder: Ladder) -> dict[str, Any] | None:
    """Keyed breakpoints over every bucket's graph (None without any)."""
    per_bucket: dict[int, dict[str, Any]] = {}
    caches = []
    for b, x in ladder.buckets.items():
        keyed = x.graph.stats().keyed if x.graph is not None else None
        if keyed:
            per_bucket[b] = keyed
            caches.extend(keyed.values())
    if not caches:
        return None
    totals = {"hits": 0, "misses": 0, "captures": 0}
    for st in caches:
        for bp in st["breakpoints"].values():
            for k in totals:
                totals[k] += bp[k]
    calls = totals["hits"] + totals["misses"]
    return {
        **totals,
        "hit_rate": totals["hits"] / calls if calls else None,
        "stitched_replays": sum(st["stitched_replays"] for st in caches),
        "evictions": sum(st["evictions"] for st in caches),
        "cache_bytes": sum(st["variant_bytes"] + (st["stitched"] or {}).get("bytes", 0) for st in caches),
        "buckets": per_bucket,
    }
