"""Reporting: the terminal table, ``bench.json`` and ``bench.png``."""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch


def commit() -> str:
    """``$BCG_COMMIT`` if set, else ``git rev-parse --short HEAD`` (+``-dirty``), else ``"unknown"``."""
    env = os.environ.get("BCG_COMMIT")
    if env:
        return env
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("-dirty" if dirty else "")) if sha else "unknown"


def environment() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name(0) if cuda else "none (no CUDA device)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


# -- table -------------------------------------------------------------------------------


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


_LLAMA_COLS = (
    ("attn", "attn", "s", 6), ("T", "T", "d", 5), ("mode", "mode", "s", 21), ("median ms", "ms_median", ".3f", 10),
    ("min ms", "ms_min", ".3f", 9), ("1st ms", "first_replay_ms", ".2f", 9), ("/floor", "ratio_to_floor", ".3f", 7),
    ("us/brk", "extra_us_per_break", ".1f", 8), ("capt s", "capture_s", ".2f", 7), ("pool MiB", "pool_mib", ".1f", 9),
    ("pool/fl", "pool_ratio_to_floor", ".2f", 7), ("rel_err", "rel_err", ".2g", 8), ("/fl-comp", "ratio_to_floor_compile", ".3f", 8),
    ("/fl pair", "ratio_to_floor_paired", ".3f", 8), ("/fc pair", "ratio_to_floor_compile_paired", ".3f", 8),
    ("compile s", "compile_s", ".2f", 9), ("host us", "host_us_per_replay", ".1f", 8),
    ("host +fl", "host_us_over_floor", "+.1f", 8), ("bcg us", "host_us_bcg", ".1f", 7),
    ("inline", "inline_fraction", ".2f", 6), ("hit", "hit_rate", ".2f", 5), ("stitch", "stitched_share", ".2f", 6),
    ("capts", "variant_captures", "d", 5), ("cache MiB", "cache_mib", ".1f", 9),
    ("tok/s", "tokens_per_s", ".0f", 8), ("idle us", "gpu_idle_us_per_step", ".1f", 7),
)
_MICRO_COLS = (
    ("mode", "mode", "s", 21), ("K", "K", "d", 4), ("us/replay", "us_per_replay", ".1f", 10),
    ("us/seg", "us_per_segment", ".2f", 8), ("bp eager us", "bp_eager_us", ".1f", 11),
    ("ovh us/seg", "us_per_segment_overhead", ".2f", 10), ("/floor", "ratio_to_floor", ".2f", 7),
    ("capt s", "capture_s", ".2f", 7), ("rel_err", "rel_err", ".2g", 8),
)


def _table(rows: Sequence[dict[str, Any]], cols: Sequence[tuple[str, str, str, int]]) -> str:
    head = "  ".join(f"{title:>{w}}" for title, _, _, w in cols)
    lines = [head, "-" * len(head)]
    for row in rows:
        lines.append("  ".join(f"{_fmt(row.get(key), spec):>{w}}" for _, key, spec, w in cols))
    return "\n".join(lines)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """One table per workload (llama-like rows, then micro rows)."""
    parts = []
    by_workload: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_workload.setdefault(row["workload"], []).append(row)
    for workload, wrows in by_workload.items():
        cols = _MICRO_COLS if workload == "micro" else _LLAMA_COLS
        parts.append(f"== {workload} ==\n{_table(wrows, cols)}")
    return "\n\n".join(parts)


# -- JSON -------------------------------------------------------------------------------------


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf become strings, tuples lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: Path, env: dict[str, Any], config: dict[str, Any], rows: Sequence[dict[str, Any]],
               extra: dict[str, Any] | None = None) -> None:
    doc = {**env, "config": config, "rows": list(rows), **(extra or {})}
    path.write_text(json.dumps(_clean(doc), indent=2) + "\n")


# -- PNG --------------------------------------------------------------------------------------


def write_png(path: Path, rows: Sequence[dict[str, Any]], title: str = "") -> None:
    """Time relative to floor vs T per mode for each attention (all modes, and a zoom on the
    graph modes below), and the micro overhead bars."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    llama = [r for r in rows if r["workload"] != "micro" and r.get("T") is not None]
    micro = [r for r in rows if r["workload"] == "micro"]
    attns = list(dict.fromkeys(r["attn"] for r in llama))
    cols = len(attns) + (1 if micro else 0)
    fig = plt.figure(figsize=(5.5 * max(cols, 1), 8.0 if attns else 4.2))
    grid = fig.add_gridspec(2 if attns else 1, max(cols, 1))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    colors = {m: f"C{i % 10}" for i, m in enumerate(modes)}
    for i, attn in enumerate(attns):
        sub = [r for r in llama if r["attn"] == attn]
        has_floor = any(r.get("ratio_to_floor") is not None for r in sub)
        series = {}
        for mode in dict.fromkeys(r["mode"] for r in sub):
            pts = sorted((r["T"], _relative(r, sub, has_floor)) for r in sub if r["mode"] == mode)
            series[mode] = [(t, y) for t, y in pts if isinstance(y, (int, float)) and math.isfinite(y)]
        ticks = sorted({r["T"] for r in sub})
        zoom = {m: p for m, p in series.items() if p and max(y for _, y in p) < 1.5}
        for row, (data, label) in enumerate(((series, "all modes"), (zoom, "zoom: within 1.5x"))):
            ax = fig.add_subplot(grid[row, i])
            for mode, pts in data.items():
                if pts:
                    ax.plot([t for t, _ in pts], [y for _, y in pts], marker="o", label=mode, color=colors[mode])
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel("T (tokens)")
            ax.set_ylabel("time / floor" if has_floor else "time / eager (no floor without CUDA)")
            ax.set_title(f"llama prefill, attn={attn} ({label})", fontsize=10)
            if data:
                ax.legend(fontsize=7)
            ax.grid(alpha=0.3, which="both")
    if micro:
        ax = fig.add_subplot(grid[:, len(attns)] if attns else grid[0, 0])
        names = [r["mode"] for r in micro]
        vals = [r.get("us_per_segment_overhead") or 0.0 for r in micro]
        bars = ax.bar(range(len(names)), vals, color=[colors[n] for n in names])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_ylabel("µs per segment, minus the breakpoints' eager cost")
        ax.set_title(f"micro: K={micro[0].get('K')} segments + K breakpoints", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    if not cols:
        fig.add_subplot(grid[0, 0]).text(0.5, 0.5, "no rows", ha="center", va="center")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _relative(row: dict[str, Any], rows: Sequence[dict[str, Any]], has_floor: bool) -> float | None:
    if has_floor:
        return row.get("ratio_to_floor")
    base = next((r for r in rows if r["mode"] == "eager" and r["T"] == row["T"]), None)
    if base is None or not base.get("ms_median"):
        return None
    return row["ms_median"] / base["ms_median"]
