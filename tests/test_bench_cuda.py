"""GPU tests of the benchmark CLI: a tiny llama and a small micro run, end to end (< 30 s)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import torch

from bcg.bench import cli, modes, registry
from bcg.bench.workloads import llama

pytestmark = pytest.mark.cuda

TINY = ["--shape", "tiny", "--iters", "3", "--warmup", "1", "--no-progress"]
STAGED = {"bcg-staged", "bcg-staged-pycall", "bcg-staged-compile"}  # flash and varlen only
KEYED = {"bcg-specialized", "bcg-specialized-zipf", "bcg-specialized-never", "bcg-never"}  # unfused only
# the whole forward compiled: a compile per mode and point, so a test of their own (one point per attention)
FULL = {"floor-fullcompile", "floor-fullcompile-again", "bcg-fullcompile", "bcg-staged-fullcompile",
        "inductor-partition"}


def _rows(out: Path) -> tuple[dict, list[dict]]:
    doc = json.loads((out / "bench.json").read_text())
    return doc, doc["rows"]


def test_tiny_llama_all_modes(tmp_path: Path) -> None:
    available = [m for m in registry.load_modes() if m not in FULL and registry.skip_reason(m, True) is None]
    rc = cli.main(["--workload", "llama", "--tokens", "64,256", *TINY, "--modes", ",".join(available),
                   "--out", str(tmp_path)])
    doc, rows = _rows(tmp_path)
    assert doc["errors"] == [] and rc == 0
    run = set(doc["config"]["modes"])
    assert {"eager", "floor", "bcg", "bcg-eager"} <= run
    if modes.has_native_executor():
        assert "bcg-python" in run
    for module, mode in (("piecewise_cuda_graphs", "piecewise-cuda-graphs"), ("breakable_cuda_graphs", "breakable-cuda-graphs")):
        assert (mode in run) == (importlib.util.find_spec(module) is not None)
    points = {(r["attn"], r["T"]) for r in rows}
    assert points == {(a, t) for a in ("flash", "varlen", "loop", "unfused") for t in (64, 256)}
    for attn, T in points:
        # staged forms: flash and varlen; keyed forms: unfused
        expected = run - (set() if attn in ("flash", "varlen") else STAGED) - (set() if attn == "unfused" else KEYED)
        expected -= {"floor-no-allreduce"}  # --tp only
        assert {r["mode"] for r in rows if (r["attn"], r["T"]) == (attn, T)} == expected
    for row in rows:
        assert row["ms_median"] > 0 and row["ms_min"] <= row["ms_median"]
        assert isinstance(row["ratio_to_floor"], float) and isinstance(row["extra_us_per_break"], float)
        if row["mode"] in STAGED:
            # the same kernels, but max_seqlen is the bound T (not the longest request) and
            # zero-length requests fill the unused slots: equal up to bf16 rounding at most
            assert row["rel_err"] < 1e-2, row
            assert row["inline_fraction"] == 1.0 and row["staged_fallbacks"] == {}, row
        elif row["mode"].startswith("bcg"):
            # the graph runs the very kernels eager runs: bitwise equal on fresh inputs
            assert row["rel_err"] == 0.0, row
        if row["mode"] in ("floor", "bcg", *STAGED, *KEYED):
            assert isinstance(row["host_us_per_replay"], float) and row["host_us_per_replay"] > 0, row
        if row["mode"] in STAGED:  # bcg's own share of the host-timed calls: less fits and prepare
            assert 0 < row["host_us_bcg"] < row["host_us_per_replay"], row
        if row["mode"] == "bcg-specialized":  # one tuple: after the warm-up calls, every call one stitched launch
            assert row["hit_rate"] == 1.0 and row["stitched_share"] == 1.0 and row["variant_captures"] == 0, row
            assert row["cache_mib"] > 0 and "inline_fraction" not in row, row
            assert row["stitched_instantiations"] >= 1 and row["stitched_instantiate_ms"] > 0, row
        if row["mode"] == "bcg-specialized-never":  # made plain breakpoint calls during the warm-up calls
            assert row["hit_rate"] is None and row["stitched_share"] == 0.0 and row["variant_captures"] == 0, row
        if row["mode"] in ("bcg", "bcg-python"):
            assert row["breakpoints"] == 2 and row["segments"] == 3
            assert row["pool_mib"] > 0 and row["capture_s"] > 0
        assert len(row["samples_ms"]) == row["iters"] and isinstance(row["ratio_to_floor_paired"], float)
        if row["mode"] == "floor":
            assert row["ratio_to_floor"] == 1.0 and row["extra_us_per_break"] == 0.0
            assert row["ratio_to_floor_paired"] == 1.0
            assert row["segments"] == 1 and row["pool_mib"] > 0
        if row["attn"] == "varlen":
            assert row["attn_backend"] == "varlen_attn"  # torch >= 2.10 has torch.nn.attention.varlen
        if row["attn"] == "flash":
            assert row["attn_backend"] == "aten._flash_attention_forward"
    assert (tmp_path / "bench.png").stat().st_size > 1000


def test_tiny_llama_whole_forward_compiled(tmp_path: Path) -> None:
    """The whole forward compiled with fullgraph=True: bcg's graphs replay exactly the compiled
    kernels (rel_err 0 against the compiled forward run eagerly; staged: up to the bound
    max_seqlen), the peer runs, and rows carry compile seconds and the ratio to floor-fullcompile."""
    available = sorted(m for m in FULL if registry.skip_reason(m, True) is None)
    if not {"floor-fullcompile", "bcg-fullcompile"} <= set(available):
        pytest.skip(f"whole-forward compile modes not available here: {sorted(FULL - set(available))}")
    rc = cli.main(["--workload", "llama", "--tokens", "64", "--attn", "flash,varlen", *TINY,
                   "--modes", ",".join(["floor", *available]), "--out", str(tmp_path)])
    doc, rows = _rows(tmp_path)
    assert doc["errors"] == [] and rc == 0, doc["errors"]
    assert {(r["attn"], r["mode"]) for r in rows} == {(a, m) for a in ("flash", "varlen") for m in ["floor", *available]}
    for row in rows:
        if row["mode"] == "floor":
            continue
        assert row["compile_s"] > 0 and isinstance(row["ratio_to_floor_fullcompile_paired"], float), row
        if row["mode"] == "bcg-fullcompile":
            assert row["rel_err"] == 0.0 and row["breakpoints"] == 2 and row["segments"] == 3, row
        elif row["mode"] == "bcg-staged-fullcompile":
            assert row["rel_err"] < 1e-2 and row["inline_fraction"] == 1.0, row
        elif row["mode"] in ("floor-fullcompile", "floor-fullcompile-again", "inductor-partition"):
            assert row["rel_err"] < 1e-2, row


def test_staged_falls_back_when_the_requests_exceed_the_slots(tmp_path: Path) -> None:
    """4 requests, 2 slots (no tiers below 2): every replay runs the breakable form, still correct."""
    rc = cli.main(["--workload", "llama", "--tokens", "64", "--attn", "flash,varlen", "--modes", "bcg-staged",
                   "--slots", "2", "--ladder-max", "0", *TINY, "--out", str(tmp_path)])
    doc, rows = _rows(tmp_path)
    assert rc == 0 and doc["errors"] == []
    assert [r["attn"] for r in rows] == ["flash", "varlen"] and doc["config"]["llama"]["slots"] == 2
    for row in rows:
        # the capture's metadata has as many requests as fit the slots (2): the bucket has its
        # inline form, and every replay (4 requests) falls back to the breakable form, counted
        assert row["inline_fraction"] == 0.0, row
        assert list(row["staged_fallbacks"]) == [f"attention_{row['attn']}_staged does not fit"], row
        assert row["rel_err"] == 0.0, row  # the breakable form runs the eager kernels


def test_micro(tmp_path: Path) -> None:
    rc = cli.main(["--workload", "micro", "--segments", "8", "--micro-iters", "10", "--warmup", "2", "--no-progress",
                   "--modes", "eager,floor,bcg,bcg-eager", "--out", str(tmp_path)])
    doc, rows = _rows(tmp_path)
    assert rc == 0 and doc["errors"] == []
    assert [r["mode"] for r in rows] == ["eager", "floor", "bcg", "bcg-eager"]
    for row in rows:
        assert row["K"] == 8 and row["rel_err"] == 0.0
        for key in ("us_per_replay", "us_per_segment", "bp_eager_us", "us_per_segment_overhead"):
            assert isinstance(row[key], float), key
    bcg_row = rows[2]
    assert bcg_row["segments"] == 8 and bcg_row["breakpoints"] == 8


@pytest.mark.parametrize("kernel", ["varlen", "flash"])
def test_packed_attention_matches_per_request_sdpa(kernel: str) -> None:
    """The varlen and flash breakpoint bodies are causal per request, like the SDPA loop (GQA)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = llama.request_lengths(200, 4, seed=0)
    T, H, KV, D = 200, 8, 2, 64
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(T, KV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(T, KV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    out_loop = torch.empty_like(q)
    out_packed = getattr(llama, kernel)(q, k, v, llama.cu_seqlens(lengths, q.device), max(lengths))
    llama.sdpa_per_request(q, k, v, out_loop, lengths)
    torch.testing.assert_close(out_packed, out_loop, atol=2e-2, rtol=2e-2)
