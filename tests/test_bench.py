"""CPU tests of the benchmark CLI (bcg.bench): flags, the no-CUDA path, bench.json and bench.png.

Every test here forces the no-CUDA path (``torch.cuda.is_available`` patched to
False), so it runs the same on a GPU machine.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bcg
from bcg.bench import cli, modes, registry, report
from bcg.bench.timing import rel_err
from bcg.bench.workloads import llama, micro

TOP_KEYS = {"gpu": str, "torch": str, "commit": str, "date": str, "config": dict, "rows": list}
ROW_TYPES = {
    "workload": (str,),
    "attn": (str, type(None)),
    "mode": (str,),
    "T": (int, type(None)),
    "ms_median": (float,),
    "ms_min": (float,),
    "first_replay_ms": (float,),
    "ratio_to_floor": (float, type(None)),
    "capture_s": (float, type(None)),
    "pool_mib": (float, type(None)),
    "extra_us_per_break": (float, type(None)),
    "rel_err": (float,),
}


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# -- flags ------------------------------------------------------------------------------------


def test_defaults() -> None:
    args = cli.parse_args([])
    assert args.workload == ["llama", "micro"]
    assert args.modes is None  # all registered modes
    assert args.tokens == [128, 512, 2048]
    assert args.attn == ["flash", "varlen", "loop", "unfused"]
    assert args.zipf_tuples == 16 and args.zipf_s == 1.0
    assert args.requests == 4
    assert args.segments == 64 and args.micro_iters == 200
    assert args.iters is None and args.warmup == 2 and args.out is None
    assert llama.shape(args) == {
        "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336, "head_dim": 128,
    }


def test_lists_and_overrides(tmp_path: Path) -> None:
    args = cli.parse_args([
        "--workload", "llama", "--modes", "eager,bcg,eager", "--tokens", "64,256", "--attn", "loop",
        "--shape", "tiny", "--layers", "3", "--kv-heads", "4", "--iters", "7", "--out", str(tmp_path),
    ])
    assert args.workload == ["llama"]
    assert args.modes == ["eager", "bcg"]  # deduplicated, order kept
    assert args.tokens == [64, 256] and args.attn == ["loop"] and args.iters == 7
    assert args.out == tmp_path
    assert llama.shape(args) == {
        "layers": 3, "hidden": 256, "heads": 4, "kv_heads": 4, "intermediate": 512, "head_dim": 64,
    }
    assert cli.parse_args(["--modes", "all"]).modes == list(registry.MODES)
    assert llama.shape(cli.parse_args(["--hidden", "1024", "--heads", "8"]))["head_dim"] == 128


@pytest.mark.parametrize(
    "argv",
    [
        ["--modes", "nope"],
        ["--workload", "llama,bert"],
        ["--attn", "paged"],
        ["--tokens", "12,x"],
        ["--tokens", "0"],
        ["--iters", "0"],
        ["--shape", "70b"],
    ],
)
def test_bad_flags_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.parse_args(argv)
    assert info.value.code == 2
    assert "bcg-bench" in capsys.readouterr().err


def test_mode_registry_lists_every_mode(capsys: pytest.CaptureFixture[str]) -> None:
    expected = ["eager", "floor", "floor-again", "bcg", "bcg-graph", "bcg-python", "bcg-eager", "floor-compile",
                "floor-compile-again", "bcg-compile",
                "bcg-staged", "bcg-staged-pycall", "bcg-staged-compile", "floor-fullcompile", "floor-fullcompile-again", "bcg-fullcompile",
                "bcg-staged-fullcompile",
                "inductor-partition", "bcg-specialized", "bcg-specialized-zipf",
                "bcg-specialized-never", "bcg-never", "floor-no-allreduce", "piecewise-cuda-graphs",
                "breakable-cuda-graphs"]
    assert list(registry.MODES) == expected
    assert registry.load_modes() is registry.MODES and list(registry.MODES) == expected  # idempotent
    assert cli.main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in [*expected, "llama", "micro"]:
        assert name in out


def test_registering_a_mode_makes_it_selectable() -> None:
    @registry.register_mode("test-extra", needs_cuda=False, help="a test mode")
    def build(case, ctx):  # pragma: no cover - never built here
        raise AssertionError

    try:
        assert cli.parse_args(["--modes", "test-extra"]).modes == ["test-extra"]
        with pytest.raises(ValueError, match="twice"):
            registry.register_mode("test-extra")(build)
    finally:
        del registry.MODES["test-extra"]


def test_skip_reasons() -> None:
    assert registry.skip_reason("floor", cuda=False) == "needs an NVIDIA GPU"
    assert registry.skip_reason("bcg-staged", cuda=False) == "needs an NVIDIA GPU"
    assert registry.skip_reason("eager", cuda=False) is None
    assert registry.skip_reason("bcg-eager", cuda=False) is None
    # bcg-python runs only where the native executor exists (else 'bcg' is already python)
    assert (registry.skip_reason("bcg-python", cuda=True) is None) == modes.has_native_executor()


def test_request_lengths_are_random_but_fixed() -> None:
    for T in (4, 128, 512, 2048):
        lengths = llama.request_lengths(T, 4, seed=0)
        assert len(lengths) == 4 and sum(lengths) == T and min(lengths) >= 1
        assert lengths == llama.request_lengths(T, 4, seed=0)
    assert llama.request_lengths(2048, 4, 0) != llama.request_lengths(2048, 4, 1)
    with pytest.raises(ValueError):
        llama.request_lengths(3, 4, 0)


def test_rel_err() -> None:
    a = torch.randn(8, 8)
    assert rel_err(a, a.clone()) == 0.0
    b = a.clone()
    b[0, 0] += 1.0
    assert rel_err(b, a) == pytest.approx(1.0 / a.abs().max().item())
    assert rel_err(a[:4], a) == float("inf")


def test_commit_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BCG_COMMIT", "abc1234")
    assert report.commit() == "abc1234"
    monkeypatch.delenv("BCG_COMMIT")
    assert isinstance(report.commit(), str) and report.commit()


# -- the no-CUDA run ----------------------------------------------------------------------------


def _check_doc(doc: dict) -> None:
    for key, typ in TOP_KEYS.items():
        assert isinstance(doc[key], typ), key
    assert "cuda" in doc  # None on CPU torch
    for row in doc["rows"]:
        for key, types in ROW_TYPES.items():
            assert key in row, key
            assert isinstance(row[key], types), (key, row[key])


def test_cpu_run_writes_json_and_png(no_cuda: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["--tokens", "16,48", "--iters", "2", "--warmup", "1", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "graph timings need an NVIDIA GPU" in out
    assert "workload micro skipped" in out
    doc = json.loads((tmp_path / "bench.json").read_text())
    _check_doc(doc)
    rows = doc["rows"]
    assert {(r["attn"], r["T"], r["mode"]) for r in rows} == {
        (a, t, m) for a in ("flash", "varlen", "loop", "unfused") for t in (16, 48) for m in ("eager", "bcg-eager")
    }
    for row in rows:
        assert row["workload"] == "llama"
        assert row["rel_err"] == 0.0  # same kernels, same inputs
        assert row["ratio_to_floor"] is None  # no floor without CUDA
        assert row["ms_min"] <= row["ms_median"]
        assert sum(row["lengths"]) == row["T"] and len(row["lengths"]) == 4
        assert row["iters"] == 2
    bcg_eager = [r for r in rows if r["mode"] == "bcg-eager"]
    assert all(r["breakpoints"] == 2 and r["segments"] == 3 for r in bcg_eager)  # tiny: 2 layers
    assert doc["config"]["llama"]["shape"]["layers"] == 2  # CPU runs the tiny shape
    assert doc["config"]["modes"] == ["eager", "bcg-eager"]
    assert doc["errors"] == []
    png = tmp_path / "bench.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {r["attn_backend"] for r in rows if r["attn"] == "flash"} == {
        "sdpa-per-request (aten._flash_attention_forward fallback: no CUDA)"
    }


def test_cpu_named_modes_that_cannot_run_are_refused(no_cuda: None, capsys: pytest.CaptureFixture[str]) -> None:
    """Modes named by hand that cannot run here: all named with their reasons, exit 2, nothing run."""
    for argv in (["--modes", "floor,bcg"], ["--modes", "floor,bcg,eager", "--tokens", "8", "--attn", "loop"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2
        captured = capsys.readouterr()
        assert captured.out == ""  # no smoke test, no empty table
        (line,) = [ln for ln in captured.err.splitlines() if "error:" in ln]
        assert "mode floor (needs an NVIDIA GPU)" in line and "mode bcg (needs an NVIDIA GPU)" in line
        assert "mode eager" not in line and "Traceback" not in captured.err


def test_cpu_named_workload_that_cannot_run_is_refused(no_cuda: None, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--workload", "micro"])
    assert info.value.code == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    assert "workload micro (needs an NVIDIA GPU)" in line


def test_cpu_modes_all_skips_what_cannot_run(no_cuda: None, capsys: pytest.CaptureFixture[str]) -> None:
    """``--modes all`` (like the default) runs what can run here and names what it skips."""
    rc = cli.main(["--modes", "all", "--tokens", "8", "--attn", "loop", "--iters", "1", "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "mode floor skipped: needs an NVIDIA GPU" in out
    assert "mode bcg skipped: needs an NVIDIA GPU" in out
    assert "median ms: eager" in out and "bcg-eager" in out


# -- bad input: usage, one error line naming the flag, exit 2, no traceback --------------------


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--requests", "0"], "--requests"),
        (["--requests", "1000", "--tokens", "128"], "--requests"),
        (["--layers", "0"], "--layers"),
        (["--layers", "-1"], "--layers"),
        (["--heads", "0"], "--heads"),
        (["--hidden", "30", "--heads", "4"], "--hidden"),
        (["--out", "/dev/null/x"], "--out"),
        (["--workload", "micro", "--segments", "-2"], "--segments"),
        # the other numeric flags and constraints of the workloads
        (["--hidden", "0"], "--hidden"),
        (["--hidden", "36", "--heads", "4"], "--head"),  # head dim 9: RoPE needs it even
        (["--head-dim", "7"], "--head-dim"),
        (["--head-dim", "0"], "--head-dim"),
        (["--kv-heads", "3"], "--kv-heads"),  # must divide heads (4 in the tiny shape)
        (["--kv-heads", "0"], "--kv-heads"),
        (["--intermediate", "-5"], "--intermediate"),
        (["--tokens", "2,64", "--requests", "3"], "--tokens"),
        (["--ladder-max", "8"], "--ladder-max"),
        (["--ladder-max", "-1"], "--ladder-max"),
        (["--micro-iters", "0"], "--micro-iters"),
        (["--iters", "-3"], "--iters"),
        (["--warmup", "-1"], "--warmup"),
        (["--capture-warmup", "-1"], "--capture-warmup"),
        (["--seed", "-1"], "--seed"),
        (["--layers", "two"], "--layers"),
    ],
)
def test_bad_input_is_one_error_line(argv: list[str], flag: str, no_cuda: None, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "never"
    if "--out" not in argv:
        argv = [*argv, "--out", str(out)]
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert captured.err.startswith("usage: bcg-bench")
    (line,) = [ln for ln in captured.err.splitlines() if "error:" in ln]
    assert line.startswith("bcg-bench: error:") and flag in line
    assert not out.exists()  # nothing is created before every argument is checked


def test_out_must_be_a_writable_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.parse_args(["--out", str(tmp_path / "a" / "b")]).out == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "file", tmp_path / "file" / "sub"):
        with pytest.raises(SystemExit) as info:
            cli.parse_args(["--out", str(bad)])
        assert info.value.code == 2
        assert "argument --out" in capsys.readouterr().err


def test_shape_checks_use_the_preset_that_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """Fields not given come from --shape; with CUDA the 8b preset, without it the tiny one."""
    assert llama.shape(cli.parse_args(["--kv-heads", "16"], cuda=True))["kv_heads"] == 16  # 8b: 32 heads
    # an explicit even head dim needs no hidden % heads
    assert llama.shape(cli.parse_args(["--hidden", "30", "--heads", "3", "--kv-heads", "1", "--head-dim", "8"]))[
        "head_dim"] == 8
    for argv, cuda, expected in [
        (["--heads", "12", "--hidden", "768"], True, "--kv-heads (8 from --shape 8b) must divide --heads 12"),
        (["--kv-heads", "8"], False, "--kv-heads 8 must divide --heads (4 from --shape tiny)"),
    ]:
        with pytest.raises(SystemExit) as info:
            cli.parse_args(argv, cuda=cuda)
        assert info.value.code == 2
        assert expected in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path of a fresh process")
def test_module_entry_point_without_cuda(tmp_path: Path) -> None:
    env = dict(os.environ, BCG_COMMIT="testsha")
    proc = subprocess.run(
        [sys.executable, "-m", "bcg.bench", "--tokens", "32", "--iters", "1", "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "graph timings need an NVIDIA GPU" in proc.stdout
    doc = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert doc["commit"] == "testsha"
    assert (tmp_path / "o" / "bench.png").exists()


def test_micro_case_on_cpu() -> None:
    """The micro workload's case and its extra measures (eager modes only: no GPU here)."""
    args = cli.parse_args(["--segments", "5", "--micro-iters", "2"])
    dev = torch.device("cpu")
    case = micro.make_case(micro.setup(args, dev), args, dev, None, None)
    sync = lambda: None  # noqa: E731
    ref = cli._reference(case, sync)
    def fail(mode: str, exc: Exception) -> None:
        raise exc

    rows = cli._measure_case(case, ["eager", "bcg-eager"], lambda compiled: ref, registry.BuildContext(), 2, 0, sync,
                             failed=fail, skipped=fail, progress=lambda step: None)
    assert [r["mode"] for r in rows] == ["eager", "bcg-eager"]
    cli._finish_case(case, rows)
    for row in rows:
        assert row["rel_err"] == 0.0 and row["K"] == 5
        assert row["us_per_replay"] == pytest.approx(row["ms_median"] * 1e3)
        assert row["us_per_segment"] == pytest.approx(row["us_per_replay"] / 5)
        assert row["us_per_segment_overhead"] == pytest.approx((row["us_per_replay"] - row["bp_eager_us"]) / 5)
    assert rows[1]["segments"] == 5 and rows[1]["breakpoints"] == 5


# -- progress output -----------------------------------------------------------------------------


def _message_lines(text: str) -> list[str]:
    return [ln for ln in text.split("\n") if "bcg-bench:" in ln]


def test_progress_redirected_messages_on_their_own_lines(no_cuda: None, capsys: pytest.CaptureFixture[str]) -> None:
    """Progress on (no --no-progress), stderr not a terminal: no bar frames, one message a line."""
    rc = cli.main(["--tokens", "8,16", "--attn", "loop", "--iters", "1"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "\r" not in captured.out
    lines = _message_lines(captured.out)
    assert all(ln.startswith("bcg-bench: ") and ln.count("bcg-bench:") == 1 for ln in lines), lines
    assert sum("median ms:" in ln for ln in lines) == 2
    assert any(ln.startswith("bcg-bench: llama: weights ") for ln in lines)


def test_progress_bar_on_a_terminal_keeps_messages_on_their_own_lines(
    no_cuda: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With a bar on stderr (a terminal), messages, log records and warnings printed while it is
    drawn each end up alone on a line: the bar is cleared first (what follows the last carriage
    return of a line is the message alone)."""
    import logging
    import warnings

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    handler = logging.StreamHandler(sys.stderr)  # as logging.basicConfig gives outside pytest
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.root.addHandler(handler)
    make_case = llama.make_case

    def noisy_make_case(*args: object, **kwargs: object) -> object:
        logging.getLogger("bcg.test").warning("a log record")
        warnings.warn("a warning", UserWarning, stacklevel=1)
        return make_case(*args, **kwargs)

    monkeypatch.setattr(llama, "make_case", noisy_make_case)
    try:
        rc = cli.main(["--tokens", "8,16", "--attn", "loop", "--iters", "1"])
    finally:
        logging.root.removeHandler(handler)
    assert rc == 0
    captured = capsys.readouterr()
    assert "\r" in captured.err and "row/s" in captured.err  # the bar was drawn, on stderr
    assert "row" not in captured.out  # and not on stdout
    lines = _message_lines(captured.out)
    assert sum("median ms:" in ln for ln in lines) == 2
    assert all(ln.split("\r")[-1].startswith("bcg-bench: ") for ln in lines), lines
    records = [ln.split("\r")[-1] for ln in captured.err.split("\n") if "a log record" in ln or "UserWarning: a warning" in ln]
    assert len(records) >= 3, captured.err
    assert all(r.startswith(("WARNING bcg.test: a log record", "WARNING py.warnings: ")) for r in records), records
    assert not any("%|" in ln for ln in records)


# -- report on GPU-shaped rows ------------------------------------------------------------------


def _fake_rows() -> list[dict]:
    rows = []
    for attn in ("varlen", "loop"):
        for T in (128, 512, 2048):
            floor = 8.0 * T / 128
            for mode, f in (("eager", 4.0), ("floor", 1.0), ("bcg", 1.05), ("piecewise-cuda-graphs", 1.06)):
                ms = floor * f
                rows.append({
                    "workload": "llama", "attn": attn, "mode": mode, "T": T, "ms_median": ms, "ms_min": ms * 0.98,
                    "first_replay_ms": ms * 1.5, "ratio_to_floor": f, "capture_s": None if mode == "eager" else 0.5,
                    "pool_mib": None if mode == "eager" else 300.0, "extra_us_per_break": (ms - floor) * 1e3 / 32,
                    "rel_err": 0.0,
                })
    for mode, us in (("eager", 400.0), ("floor", 60.0), ("bcg", 250.0)):
        rows.append({
            "workload": "micro", "attn": None, "mode": mode, "T": None, "ms_median": us / 1e3, "ms_min": us / 1e3,
            "first_replay_ms": us / 1e3, "ratio_to_floor": us / 60.0, "capture_s": 0.1, "pool_mib": 2.0,
            "extra_us_per_break": (us - 60.0) / 64, "rel_err": 0.0, "K": 64, "us_per_replay": us,
            "us_per_segment": us / 64, "bp_eager_us": 150.0, "us_per_segment_overhead": (us - 150.0) / 64,
        })
    return rows


def test_report_on_gpu_shaped_rows(tmp_path: Path) -> None:
    rows = _fake_rows()
    table = report.format_table(rows)
    assert "== llama ==" in table and "== micro ==" in table and "piecewise-cuda-graphs" in table
    report.write_png(tmp_path / "bench.png", rows, title="fake")
    assert (tmp_path / "bench.png").stat().st_size > 1000
    env = {"gpu": "fake", "torch": torch.__version__, "cuda": "13.0", "commit": "x", "date": "now"}
    report.write_json(tmp_path / "bench.json", env, {"k": 1}, rows + [{**rows[0], "rel_err": float("nan")}])
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["rows"][-1]["rel_err"] == "nan"  # strict JSON: NaN written as a string


def test_compiling_call_times_the_compile_and_counts_its_graphs() -> None:
    from bcg.bench.timing import compiling_call

    torch._dynamo.reset()
    seen: list[object] = []

    @bcg.breakpoint
    def bp(t: torch.Tensor) -> torch.Tensor:
        seen.append(bcg.live())
        return t + 1

    compiled = torch.compile(lambda x: bp(x.sin()).cos(), backend="eager")
    x = torch.randn(16)
    first = compiling_call(compiled, (x,), "live-1", lambda: None)
    assert first["graphs_compiled"] == 2 and first["compile_s"] > 0  # before and after the breakpoint
    again = compiling_call(compiled, (x,), "live-2", lambda: None)
    assert again["graphs_compiled"] == 0
    assert seen == ["live-1", "live-2"]


def test_sample_interleaved_takes_rounds_of_blocks_and_drops_a_failing_function() -> None:
    """Each round runs every function once as a block (warm-up calls, then timed calls), in a
    seeded random order per round; a function that raises is reported once and not called
    again, the others go on."""
    from bcg.bench.timing import sample_interleaved

    calls: list[str] = []
    errors: list[tuple[str, str]] = []

    def fn(name: str, fail_at: int | None = None):
        def run() -> None:
            calls.append(name)
            if fail_at is not None and calls.count(name) == fail_at:
                raise RuntimeError(f"{name} broke")

        return run

    names = [f"f{i}" for i in range(6)]
    samples = sample_interleaved({n: fn(n) for n in names}, lambda: None, iters=12, warmup=1, block=3)
    rounds = [calls[i:i + 24] for i in range(0, len(calls), 24)]  # 6 functions x (1 + 3) calls
    assert len(rounds) == 4 and len(calls) == 96
    blocks = [[r[i:i + 4] for i in range(0, 24, 4)] for r in rounds]
    assert all(len(set(b)) == 1 for r in blocks for b in r)  # a block is one function's calls
    orders = [tuple(b[0] for b in r) for r in blocks]
    assert all(sorted(o) == names for o in orders) and len(set(orders)) > 1  # each once, not one fixed order
    assert all(len(samples[n]) == 12 and all(x >= 0 for x in samples[n]) for n in names)

    calls.clear()
    samples = sample_interleaved({"a": fn("a"), "b": fn("b", fail_at=6), "c": fn("c")}, lambda: None, iters=7,
                                 warmup=1, block=4, on_error=lambda name, exc: errors.append((name, str(exc))))
    assert errors == [("b", "b broke")] and calls.count("b") == 6  # raised in round 2: never called again
    assert calls.count("a") == calls.count("c") == 9  # 2 rounds: 1 + 4, then 1 + 3
    assert len(samples["a"]) == len(samples["c"]) == 7 and len(samples["b"]) == 4
    with pytest.raises(RuntimeError, match="b broke"):
        calls.clear()
        sample_interleaved({"b": fn("b", fail_at=1)}, lambda: None, iters=1)


def test_paired_ratio_cancels_drift_shared_by_a_round() -> None:
    """Per round, block median over the reference's block median; the median of those."""
    from bcg.bench.timing import paired_ratio

    drift = [1.0, 1.3, 0.9, 1.6]  # the machine's speed per round, shared by both blocks of a round
    ref = [10.0 * d for d in drift for _ in range(5)]
    ours = [10.4 * d for d in drift for _ in range(5)]
    ours[2] = 100.0  # one outlier in a block: moves the plain median, not the paired one
    assert paired_ratio(ours, ref, block=5) == pytest.approx(1.04)
    assert statistics.median(ours) / statistics.median(ref) > 1.1
    assert paired_ratio(ref, ref, block=5) == 1.0
    assert paired_ratio(ours[:7], ref, block=5) == pytest.approx(1.04)  # a shorter last block
    assert paired_ratio([], ref) is None


def test_paired_difference_cancels_drift_shared_by_a_round() -> None:
    """Per round, block median minus the reference's block median; the median of those."""
    from bcg.bench.timing import paired_difference

    drift = [0.0, 40.0, 3.0, 60.0]  # a slow host adds to every call of a round alike
    ref = [7.0 + d for d in drift for _ in range(5)]
    ours = [19.0 + d for d in drift for _ in range(5)]
    ours[7] = 500.0  # one outlier in a block
    assert paired_difference(ours, ref, block=5) == pytest.approx(12.0)
    assert paired_difference(ours[:12], ref, block=5) == pytest.approx(12.0)  # a shorter last block ...
    assert statistics.median(ours[:12]) - statistics.median(ref) == pytest.approx(-6.5)  # ... unpaired: other rounds
    assert paired_difference([], ref) is None


def test_length_streams_repeat_as_named() -> None:
    fixed = llama.length_stream("fixed", 128, 4, seed=0)
    assert {fixed() for _ in range(5)} == {tuple(llama.request_lengths(128, 4, 0))}
    zipf = llama.length_stream("zipf", 128, 4, seed=0, tuples=16, s=1.0)
    draws = [zipf() for _ in range(2000)]
    counts = {t: draws.count(t) for t in set(draws)}
    assert len(counts) <= 16 and all(sum(t) == 128 and len(t) == 4 for t in counts)
    assert max(counts, key=counts.get) == tuple(llama.request_lengths(128, 4, 0))  # rank 1 is the point's tuple
    again = llama.length_stream("zipf", 128, 4, seed=0, tuples=16, s=1.0)
    assert [again() for _ in range(50)] == draws[:50]  # the same arguments, the same sequence
    never = llama.length_stream("never", 128, 4, seed=0)
    tuples = [never() for _ in range(500)]
    assert len(set(tuples)) == 500 and all(sum(t) == 128 and min(t) >= 1 for t in tuples)
    with pytest.raises(ValueError, match="kind"):
        llama.length_stream("sometimes", 128, 4, seed=0)


def test_lifecycle_report_on_a_cpu_runner() -> None:
    """bcg.bench.lifecycle.measure over eager-mode runners: every way of capturing reaches a first
    result, the lazy calls capture every bucket in a random order, the background capture serves
    calls; memory figures are CUDA-only."""
    import warnings

    from bcg.bench import lifecycle

    from .models import TinyLlama, positions_for

    model = TinyLlama(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64, device="cpu", dtype=torch.float32)
    buckets = [4, 8, 16]
    example = (torch.randn(5, 32), torch.arange(5))
    made: list[bcg.GraphRunner] = []

    def make(**options: object) -> bcg.GraphRunner:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (no CUDA: eager mode)
            runner = bcg.GraphRunner(model, buckets, example_inputs=example, progress=False,
                                     live=lambda n: {"lengths": [n]}, **options)
        made.append(runner)
        return runner

    def batch(T: int) -> tuple[tuple[torch.Tensor, ...], dict]:
        return (torch.randn(T, 32), positions_for([T], T, "cpu")), {"lengths": [T]}

    report = lifecycle.measure(model, make, batch, torch.device("cpu"), seed=1)
    assert len(made) == 4 and report["calls_T"] == 8
    for way in ("capture_all", "lazy", "background"):
        assert report[way]["to_first_result_s"] > 0 and report[way]["capture_s"] >= 0
    assert sorted(report["lazy"]["order"]) == buckets
    assert [bcg.runner.pick_bucket(buckets, T) for T in report["lazy"]["sizes"]] == report["lazy"]["order"]
    assert report["lazy_at_bucket_size"]["first_T"] == report["lazy"]["order"][0]
    for lazy in (report["lazy"], report["lazy_at_bucket_size"]):
        assert 0 < lazy["first_bucket_capture_s"] <= lazy["first_capture_total_s"] <= lazy["to_first_result_s"]
        assert lazy["eager_plus_one_capture_s"] == lazy["first_call_eager_s"] + lazy["first_bucket_capture_s"]
        assert lazy["capture_all_bucket_s"] > 0
        assert lazy["eager_plus_capture_all_bucket_s"] == lazy["first_call_eager_s"] + lazy["capture_all_bucket_s"]
    assert report["lazy"]["first_T"] < report["lazy"]["order"][0]  # a padded first call: its run is watched
    assert report["background"]["calls_during_capture"] >= 1
    assert report["background"]["eager_calls_per_s"] > 0
    assert report["sleep_wake"]["freed_mib"] is None and report["capture_all"]["pool_mib"] is None
    assert report["sleep_wake"]["freed_of_taken"] is None
    assert all(not r.captured_buckets for r in made)  # every runner was reset


def test_cpu_decode_and_mixed_points_over_a_paged_cache(no_cuda: None, tmp_path: Path) -> None:
    """--attn decode,mixed: T is the decode batch's requests or the mixed batch's tokens (so T may
    be below --requests: a decode batch of one); the graph's eager mode runs the same kernels as
    eager (rel_err 0)."""
    rc = cli.main(["--attn", "decode,mixed", "--tokens", "1,12", "--context", "40", "--page", "4", "--iters", "2",
                   "--warmup", "1", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    rows = doc["rows"]
    assert {(r["attn"], r["T"]) for r in rows} == {(a, t) for a in ("decode", "mixed") for t in (1, 12)}
    assert doc["errors"] == [] and all(r["rel_err"] == 0.0 for r in rows)
    for r in rows:
        assert r["tokens"] == r["T"] and r["page"] == 4 and r["context_pages"] == 10
        assert r["requests"] == (r["T"] if r["attn"] == "decode" else r["T"] // 2 + min(4, r["T"] - r["T"] // 2))
        assert r["max_context"] <= 40


def test_mean_of_captures_averages_sample_by_sample() -> None:
    from bcg.bench.timing import mean_of_captures

    assert mean_of_captures([[1.0, 2.0, 9.0], [3.0, 4.0, 1.0]]) == [2.0, 3.0, 5.0]
    assert mean_of_captures([[1.0, 2.0]]) == [1.0, 2.0]
    with pytest.raises(ValueError, match="all of one length"):
        mean_of_captures([[1.0, 2.0], [1.0]])
    with pytest.raises(ValueError):
        mean_of_captures([])
