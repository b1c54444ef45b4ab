"""CPU tests of the bench's mode registry and of the staged attention (modes bcg-staged*).

The staged attention's kernels need a GPU; here its host side is checked: the flags,
the padded ``cu_seqlens`` that ``prepare`` writes, the bound it returns, ``fits``, the
staged case's wiring, and the measures a row gets around the timed replays.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

import bcg
from bcg.bench import cli, modes, registry, report, timing
from bcg.bench.workloads import llama


def _tiny_model(args: object) -> llama.LlamaModel:
    return llama.LlamaModel(llama.shape(args), torch.device("cpu"), max_pos=256)


# -- the registry -------------------------------------------------------------------------------


def test_mode_modules_do_not_import_each_other_and_load_in_order() -> None:
    """peers imported alone registers only the peers; load_modes adds bcg's modes, which run first."""
    code = (
        "import json, sys\n"
        "import bcg.bench.peers\n"
        "from bcg.bench.registry import MODES, MODE_MODULES, load_modes\n"
        "print(json.dumps(['bcg.bench.modes' in sys.modules, list(MODES)]))\n"
        "print(json.dumps(list(load_modes())))\n"
        "print(json.dumps(MODE_MODULES))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    first, loaded, module_list = map(json.loads, proc.stdout.splitlines())
    assert first == [False, ["piecewise-cuda-graphs", "breakable-cuda-graphs"]]
    assert loaded == list(registry.MODES)  # the same order as when cli loaded them
    assert loaded[:4] == ["eager", "floor", "floor-again", "bcg"] and loaded[-1] == "breakable-cuda-graphs"
    assert module_list == ["bcg.bench.modes", "bcg.bench.peers"]


# -- flags ----------------------------------------------------------------------------------------


def test_slots_flag() -> None:
    args = cli.parse_args([])
    assert args.slots == 8
    args = cli.parse_args(["--slots", "3", "--modes", "bcg-staged,bcg-staged-compile"])
    assert args.slots == 3 and args.modes == ["bcg-staged", "bcg-staged-compile"]
    assert llama.config(args, torch.device("cpu"))["slots"] == 3


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_bad_slots_exit_2(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.parse_args(["--slots", value])
    assert info.value.code == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    assert "--slots" in line


# -- prepare and fits ---------------------------------------------------------------------------------


def test_padded_offsets() -> None:
    assert llama.padded_offsets([3, 5, 2], 5) == [0, 3, 8, 10, 10, 10]
    assert llama.padded_offsets((3, 5, 2), 3) == [0, 3, 8, 10]  # every slot used: no sentinel
    assert llama.padded_offsets([7], 1) == [0, 7]
    with pytest.raises(ValueError, match="4 requests do not fit in 3 slots"):
        llama.padded_offsets([1, 1, 1, 1], 3)


def test_staged_prepare_writes_padded_offsets_and_returns_the_bound() -> None:
    staged = llama.StagedAttention(4, torch.device("cpu"))
    assert isinstance(staged.cu, bcg.StagingBuffer)
    assert staged.cu.device.shape == (5,) and staged.cu.device.dtype == torch.int32

    out = staged.prepare(llama.Batch((10, 2, 4)))
    assert staged.cu.host.tolist() == [0, 10, 12, 16, 16]  # the unused slot repeats T: zero-length
    assert torch.equal(out.cu, staged.cu.device) and out.cu.data_ptr() == staged.cu.device.data_ptr()
    assert out.max_len == 16  # the total tokens, a bound on the longest request (10)

    out = staged.prepare(llama.Batch((1, 1, 1, 5)))  # every slot used
    assert staged.cu.host.tolist() == [0, 1, 2, 3, 8]
    assert out.max_len == 8 and out.cu.shape == (5,) and out.slots == 4

    out = staged.prepare(llama.Batch((3, 4), slots=2))  # a tier's capture: all offsets written, 2 slots read
    assert staged.cu.host.tolist() == [0, 3, 7, 7, 7]
    assert out.cu.shape == (3,) and out.cu.data_ptr() == staged.cu.device.data_ptr() and out.slots == 2
    assert staged.prepare(llama.Batch((1, 6), slots=2)).cu is out.cu  # the same prefix view, kept


def test_staged_fits_is_false_past_the_slots_of_the_capture() -> None:
    staged = llama.StagedAttention(3, torch.device("cpu"))
    full = staged.prepare(llama.Batch((5,)))
    assert staged.fits(llama.Batch((5,)), full) is True
    assert staged.fits(llama.Batch((1, 2, 3)), full) is True  # R requests
    assert staged.fits(llama.Batch((1, 2, 3, 4)), full) is False  # R + 1
    tier = staged.prepare(llama.Batch((5,), slots=2))
    assert staged.fits(llama.Batch((1, 2)), tier) is True
    assert staged.fits(llama.Batch((1, 2, 3)), tier) is False
    assert bcg.breakpoint(prepare=staged.prepare, fits=staged.fits)(lambda: None).__bcg_breakpoint__.fits_reads_staged


def test_slot_tiers_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """The staged tiers: powers of two below --slots by default, or as given, or none; each below R."""
    assert llama.tiers_of(cli.parse_args([])) == [2, 4]
    assert llama.tiers_of(cli.parse_args(["--slots", "16"])) == [2, 4, 8]
    assert llama.tiers_of(cli.parse_args(["--slots", "2"])) == []
    assert llama.tiers_of(cli.parse_args(["--slot-tiers", "3,6"])) == [3, 6]
    assert llama.tiers_of(cli.parse_args(["--slot-tiers", "none"])) == []
    with pytest.raises(SystemExit) as info:
        cli.parse_args(["--slot-tiers", "4,8"])
    assert info.value.code == 2 and "--slot-tiers 8 must be below --slots 8" in capsys.readouterr().err
    assert llama.config(cli.parse_args([]), torch.device("cpu"))["slot_tiers"] == [2, 4]


def test_staged_breakpoints_share_one_prepare() -> None:
    """Both staged breakpoints carry the same prepare and fits objects (bcg calls a shared prepare once
    per replay), and the model makes one StagedAttention per slot count."""
    model = _tiny_model(cli.parse_args(["--shape", "tiny"]))
    staged = model.staged_attention(4)
    assert model.staged_attention(4) is staged and model.staged_attention(2) is not staged
    flash, varlen = staged.breakpoints["flash"], staged.breakpoints["varlen"]
    specs = [bp.__bcg_breakpoint__ for bp in (flash, varlen)]
    assert [s.name for s in specs] == ["attention_flash_staged", "attention_varlen_staged"]
    assert specs[0].prepare is specs[1].prepare and specs[0].fits is specs[1].fits
    assert specs[0].prepare.__wrapped__.__self__ is staged and specs[0].mutates == ("out",)  # (timed: UserTime)
    # the same function as the plain breakpoints
    assert flash.__wrapped__ is llama.attention_flash.__wrapped__ is llama.flash_attention
    assert varlen.__wrapped__ is llama.attention_varlen.__wrapped__ is llama.varlen_attention


# -- the staged case ------------------------------------------------------------------------------------


def test_staged_case_only_where_the_kernel_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU there is no staged form (the staged modes skip the point); where the kernel is usable
    the staged case shares the static inputs and carries host-only live metadata."""
    args = cli.parse_args(["--shape", "tiny", "--tokens", "32", "--slots", "6"], cuda=False)
    model = _tiny_model(args)
    dev = torch.device("cpu")
    case = llama.make_case(model, args, dev, "flash", 32)
    assert case.staged is None
    with pytest.raises(registry.NotApplicable, match="no staged breakpoint"):
        modes.build_bcg_staged(case, registry.BuildContext())

    monkeypatch.setitem(llama._BACKENDS, "varlen", ("varlen_attn", lambda device: True))
    case = llama.make_case(model, args, dev, "varlen", 32)
    staged = case.staged
    assert staged is not None and staged.staged is None
    assert staged.bp is model.staged_attention(6).breakpoints["varlen"]
    assert staged.static_args is case.static_args and staged.T == 32 and staged.attn == "varlen"
    lengths = tuple(case.fields["lengths"])
    for live in (staged.live, staged.fresh_live()):
        assert live == llama.Batch(lengths) and live.cu is None  # host only: no device cu_seqlens per call
    tiers = staged.live_for(32)  # the runner's capture at bucket T: tiers of 2 and 4 slots, then its own
    assert isinstance(tiers, bcg.StagedTiers) and [b.slots for b in tiers] == [2, 4, None]
    assert tiers[-1] == llama.Batch(lengths) and all(sum(b.lengths) == 32 for b in tiers)
    assert [len(b.lengths) for b in tiers] == [2, min(4, len(lengths)), len(lengths)]
    assert all(sum(b.lengths) == 20 for b in staged.live_for(20))
    assert [b.slots for b in staged.live_for(2)] == [2, None]  # 2 tokens: the 2-slot tier serves every batch
    # without a usable kernel, the staged breakpoint's function takes the host-only batch
    fwd, ref_fwd = staged.forward(staged.bp), case.forward(case.bp)
    with bcg.live_scope(staged.live):
        out = fwd(*staged.static_args)
    with bcg.live_scope(case.live):
        ref = ref_fwd(*case.static_args)
    assert torch.equal(out, ref)


# -- row measures -----------------------------------------------------------------------------------------


def test_runner_measures_inline_fraction_over_the_timed_replays() -> None:
    stats = {"graph_calls": 5, "inline_replays": 4, "staged_fallbacks": {"too many requests": 1}}
    start = modes._runner_measures(lambda: {**stats, "staged_fallbacks": dict(stats["staged_fallbacks"])},
                                   staged=True)
    stop = start()
    stats.update(graph_calls=13, inline_replays=10, staged_fallbacks={"too many requests": 3})  # the timed replays
    out = stop()
    assert out["inline_fraction"] == 0.75  # 6 inline of 8
    assert out["staged_fallbacks"] == {"too many requests": 2}
    assert "host_us_per_replay" not in out  # host time is sampled by the bench, interleaved (cli._measure_case)


def test_measure_runs_around_the_timed_replays() -> None:
    """A Built's measure starts before the timed replays and ends right after them; its fields go into the row."""
    events: list[str] = []

    @registry.register_mode("test-measured", needs_cuda=False)
    def build(case: object, ctx: object) -> registry.Built:
        built = modes.build_eager(case, ctx)  # type: ignore[arg-type]
        run = built.run

        def counted() -> torch.Tensor:
            events.append("run")
            return run()

        def start() -> object:
            events.append("start")
            return lambda: {"measured_runs": events.count("run"), "host_us_per_replay": 1.5, "inline_fraction": 0.5}

        return registry.Built(run=counted, measure=start)

    try:
        args = cli.parse_args(["--shape", "tiny", "--tokens", "16", "--attn", "loop"], cuda=False)
        dev = torch.device("cpu")
        case = llama.make_case(_tiny_model(args), args, dev, "loop", 16)
        ref = cli._reference(case, lambda: None)

        def fail(mode: str, exc: Exception) -> None:
            raise exc

        (row,) = cli._measure_case(case, ["test-measured"], lambda compiled: ref, registry.BuildContext(), 3, 1,
                                   lambda: None, failed=fail, skipped=fail, progress=lambda step: None)
    finally:
        del registry.MODES["test-measured"]
    # first replay, start, (1 warm-up + 3 timed), stop, then the check replay
    assert events == ["run", "start", "run", "run", "run", "run", "run"]
    assert row["measured_runs"] == 5 and row["rel_err"] == 0.0
    table = report.format_table([row])
    title, head, _, line = table.splitlines()
    assert title == "== llama =="
    assert head.split()[-15:] == ["host", "us", "host", "+fl", "bcg", "us", "inline", "hit", "stitch", "capts",
                                  "cache", "MiB", "tok/s", "idle", "us"]
    assert line.split()[-10:] == ["1.5", "-", "-", "0.50", "-", "-", "-", "-", "-", "-"]


def test_host_time_is_sampled_interleaved_after_the_timed_replays_and_paired_with_the_floors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Modes with Built.host get host_us_per_replay (their calls alone) and host_us_over_floor (paired with the
    floor's calls, round by round); the host calls come after the measures stopped, interleaved."""
    events: list[str] = []
    waits: list[bool] = []
    clock = [0.0]  # us of host time, as each call says

    def timed_ms(fn: Any, sync: Any, wait: bool = True) -> float:
        waits.append(wait)
        t0 = clock[0]
        fn()
        return (clock[0] - t0) / 1e3

    monkeypatch.setattr(timing, "timed_ms", timed_ms)

    def make(name: str, us: float, host: bool) -> Any:
        def build(case: object, ctx: object) -> registry.Built:
            eager = modes.build_eager(case, ctx)  # type: ignore[arg-type]

            def run() -> torch.Tensor:
                events.append(name)
                clock[0] += us * (3 if len(events) % 7 == 0 else 1)  # a slow call now and then
                return eager.run()

            return registry.Built(run=run, host=host, measure=lambda: (lambda: {"stopped_after": len(events)}))

        return registry.ModeSpec(name, build, False, "", lambda: None)

    monkeypatch.setitem(cli.MODES, "floor", make("floor", 8.0, True))
    monkeypatch.setitem(cli.MODES, "test-runner", make("test-runner", 20.0, True))
    monkeypatch.setitem(cli.MODES, "test-eager", make("test-eager", 50.0, False))
    args = cli.parse_args(["--shape", "tiny", "--tokens", "16", "--attn", "loop"], cuda=False)
    case = llama.make_case(_tiny_model(args), args, torch.device("cpu"), "loop", 16)
    ref = cli._reference(case, lambda: None)

    def fail(mode: str, exc: Exception) -> None:
        raise exc

    rows = {r["mode"]: r for r in cli._measure_case(case, ["floor", "test-runner", "test-eager"], lambda c: ref,
                                                      registry.BuildContext(), 5, 0, lambda: None, failed=fail,
                                                      skipped=fail, progress=lambda step: None)}
    assert rows["floor"]["host_us_per_replay"] == pytest.approx(8.0)
    assert rows["test-runner"]["host_us_per_replay"] == pytest.approx(20.0)
    assert rows["test-runner"]["host_us_over_floor"] == pytest.approx(12.0)
    assert rows["floor"]["host_us_over_floor"] == 0.0
    assert "host_us_per_replay" not in rows["test-eager"]
    timed = 3 + 3 * 5  # first replays, then 5 timed calls each
    assert all(r["stopped_after"] == timed for r in rows.values())  # measures stop before the host calls
    host_calls = events[timed:timed + 2 * cli.HOST_CALLS]
    assert waits == [True] * 3 * 5 + [False] * 2 * cli.HOST_CALLS  # host calls: until the call returns
    assert host_calls.count("floor") == host_calls.count("test-runner") == cli.HOST_CALLS
    assert all(len(set(host_calls[i:i + 5])) == 1 for i in range(0, len(host_calls), 5))  # blocks of 5 ...
    assert set(host_calls[:10]) == {"floor", "test-runner"}  # ... in rounds of both modes


def test_host_us_bcg_comes_from_the_host_timed_calls_alone_and_the_timed_replays_run_no_clock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner mode's host-timed calls go through its ``host_run`` (which keeps bcg's own time: the
    row's host_us_bcg is their median); its timed replays go through ``run``, with no clock; modes
    that keep none get no such field."""
    phase = ["first"]  # the first replay after each build, before the timed ones
    calls: dict[tuple[str, str], int] = {}

    def make(name: str, own: list[float] | None) -> Any:
        def build(case: object, ctx: object) -> registry.Built:
            eager = modes.build_eager(case, ctx)  # type: ignore[arg-type]

            def run() -> torch.Tensor:
                calls[(name, phase[0])] = calls.get((name, phase[0]), 0) + 1
                return eager.run()

            def host_run() -> torch.Tensor:
                assert phase[0] == "host", "host_run called outside the host-timed calls"
                assert own is not None
                own.append(7e-6)
                return eager.run()

            return registry.Built(run=run, host=True, host_run=host_run if own is not None else None,
                                  own_host_s=own)

        return registry.ModeSpec("x", build, False, "", lambda: None)

    real = timing.sample_interleaved

    def sample(fns: Any, sync: Any, iters: int, *args: Any, wait: bool = True, **kwargs: Any) -> Any:
        phase[0] = "timed" if wait else "host"
        try:
            return real(fns, sync, iters, *args, wait=wait, **kwargs)
        finally:
            phase[0] = "check"

    monkeypatch.setattr(cli, "sample_interleaved", sample)
    monkeypatch.setitem(cli.MODES, "floor", make("floor", None))
    monkeypatch.setitem(cli.MODES, "test-runner", make("test-runner", []))
    args = cli.parse_args(["--shape", "tiny", "--tokens", "16", "--attn", "loop"], cuda=False)
    case = llama.make_case(_tiny_model(args), args, torch.device("cpu"), "loop", 16)
    ref = cli._reference(case, lambda: None)

    def fail(mode: str, exc: Exception) -> None:
        raise exc

    rows = {r["mode"]: r for r in cli._measure_case(case, ["floor", "test-runner"], lambda c: ref,
                                                      registry.BuildContext(), 5, 0, lambda: None, failed=fail,
                                                      skipped=fail, progress=lambda step: None)}
    assert rows["test-runner"]["host_us_bcg"] == pytest.approx(7.0)
    assert "host_us_bcg" not in rows["floor"]
    assert calls[("test-runner", "timed")] == calls[("floor", "timed")] == 5
    assert ("test-runner", "host") not in calls  # its host-timed calls went through host_run
    assert calls[("floor", "host")] == cli.HOST_CALLS  # a mode without host_run: run


def test_user_time_clocks_only_while_counting() -> None:
    """The wrapped callbacks of a staged breakpoint pass through unclocked unless counting is set
    (so that the timed replays pay for no clock), and count every call while it is."""
    clock = timing.UserTime()
    wrapped = clock.wrap(lambda live: time.sleep(0.001) or live)
    assert wrapped(3) == 3 and clock.calls == 0 and clock.seconds == 0.0
    clock.counting = True
    assert wrapped(4) == 4 and clock.calls == 1 and clock.seconds >= 0.001


def test_user_time_counts_the_wrapped_callbacks_and_keeps_their_signature() -> None:
    clock = timing.UserTime()
    clock.counting = True

    def fits(live: Any, staged: Any) -> bool:
        time.sleep(0.002)
        return True

    wrapped = clock.wrap(fits)
    assert inspect.signature(wrapped) == inspect.signature(fits)  # bcg reads fits' arity from it
    assert wrapped(1, 2) is True and clock.seconds >= 0.002
    with pytest.raises(ZeroDivisionError):
        clock.wrap(lambda: 1 / 0)()
    assert clock.seconds >= 0.002  # (a callback that raises counts too)


def test_user_time_charges_each_wrapped_call_its_wrapper_overhead_besides_the_time_inside() -> None:
    """What a call's host time loses for its callbacks: the time inside them plus, per call, what the
    wrapper costs outside its clock (measured once, on a no-op), so that none of it counts as bcg's."""
    clock = timing.UserTime()
    clock.counting = True
    assert 0.0 <= clock.overhead < 1e-3 and clock.calls == 0 and clock.charged() == 0.0
    wrapped = clock.wrap(lambda live: time.sleep(0.001))
    for _ in range(3):
        wrapped(None)
    assert clock.calls == 3 and clock.seconds >= 0.003
    assert clock.charged() == pytest.approx(clock.seconds + 3 * clock.overhead)
    with pytest.raises(ZeroDivisionError):
        clock.wrap(lambda: 1 / 0)()
    assert clock.calls == 4  # (a callback that raises is charged too)


def test_a_floor_that_fails_while_its_host_time_is_sampled_is_reported_and_no_mode_is_paired_with_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [0]

    def build(case: object, ctx: object) -> registry.Built:
        eager = modes.build_eager(case, ctx)  # type: ignore[arg-type]

        def run() -> torch.Tensor:
            calls[0] += 1
            if calls[0] > 1 + 5 + 3:  # the first replay, the timed ones and 3 host calls pass; the 4th fails
                raise RuntimeError("replay broke")
            return eager.run()

        return registry.Built(run=run, host=True)

    def build_other(case: object, ctx: object) -> registry.Built:
        return registry.Built(run=modes.build_eager(case, ctx).run, host=True)  # type: ignore[arg-type]

    monkeypatch.setitem(cli.MODES, "floor", registry.ModeSpec("floor", build, False, "", lambda: None))
    monkeypatch.setitem(cli.MODES, "test-other", registry.ModeSpec("test-other", build_other, False, "", lambda: None))
    args = cli.parse_args(["--shape", "tiny", "--tokens", "16", "--attn", "loop"], cuda=False)
    case = llama.make_case(_tiny_model(args), args, torch.device("cpu"), "loop", 16)
    ref = cli._reference(case, lambda: None)
    errors: list[tuple[str, str]] = []
    rows = cli._measure_case(case, ["floor", "test-other"], lambda c: ref, registry.BuildContext(), 5, 0,
                             lambda: None, failed=lambda m, exc: errors.append((m, str(exc))),
                             skipped=lambda m, exc: None, progress=lambda step: None)
    assert errors == [("floor", "replay broke")]
    (row,) = rows
    assert row["mode"] == "test-other" and row["host_us_per_replay"] > 0
    assert "host_us_over_floor" not in row  # not paired with a floor that broke


# -- the whole forward compiled (issue 32) ---------------------------------------------------------------


def _tiny_inputs(model: llama.LlamaModel, T: int = 16) -> tuple[torch.Tensor, torch.Tensor, llama.Batch]:
    lengths = tuple(llama.request_lengths(T, 3, seed=1))
    x = torch.randn(T, model.hidden, dtype=model.dtype)
    pos = torch.cat([torch.arange(n) for n in lengths])
    return x, pos, llama.Batch(lengths)


@pytest.mark.parametrize("result", [False, True])
def test_the_llama_forward_compiles_whole_around_its_breakpoint_ops(result: bool) -> None:
    """fullgraph=True over all layers: each attention breakpoint is one op, no graph break, and the
    compiled forward equals the eager one (aot_eager: the same ATen kernels); ``result``: the
    attention's form that returns its result (the whole-compiled modes')."""
    torch._dynamo.reset()
    model = _tiny_model(cli.parse_args(["--shape", "tiny"]))
    x, pos, batch = _tiny_inputs(model)
    bp = llama.RESULTS[llama.attention_varlen] if result else llama.attention_varlen

    def forward(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return model.forward(x, pos, bp)

    with bcg.live_scope(batch):
        expected = forward(x, pos)
        out = torch.compile(forward, fullgraph=True, backend="aot_eager")(x, pos)
        explanation = torch._dynamo.explain(forward)(x, pos)
    assert explanation.graph_break_count == 0
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("attn", ["varlen", "loop"])
def test_kv_heads_repeated_before_the_attention_give_the_same_forward(attn: str) -> None:
    """``expand_kv``: the model repeats the KV heads before the call (what ``varlen`` gets where
    varlen_attn has no enable_gqa); the attentions take grouped or repeated heads alike."""
    model = _tiny_model(cli.parse_args(["--shape", "tiny"]))
    assert model.H > model.KV
    x, pos, batch = _tiny_inputs(model)
    seen: list[int] = []
    bp = llama.BREAKPOINTS[attn]

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        seen.append(k.shape[1])
        bp(q, k, v, out)

    with bcg.live_scope(batch):
        expected = model.forward(x, pos, attention)
        out = model.forward(x, pos, attention, expand_kv=True)
    layers = model.shape["layers"]
    assert seen == [model.KV] * layers + [model.H] * layers
    torch.testing.assert_close(out, expected)


def test_compiled_whole_compiles_every_forward_past_dynamos_recompile_limit() -> None:
    """Every mode's forward is the same lambda around another breakpoint: each whole compile has
    a code object, and so a Dynamo cache, of its own (one code object holds 8 at most)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()

    def make(k: int):  # type: ignore[no-untyped-def]
        return lambda x: x * 2 + k

    x = torch.randn(4)
    before = int(counters["stats"]["unique_graphs"])
    for k in range(12):
        torch.testing.assert_close(llama.compiled_whole(make(k), backend="eager")(x), x * 2 + k)
    assert int(counters["stats"]["unique_graphs"]) - before == 12


@pytest.mark.parametrize("attn", ["flash", "varlen"])
def test_the_partition_peers_attention_op_computes_the_breakpoints_attention(attn: str) -> None:
    """The peer's attention (a custom op tagged cudagraph_unsafe) reads the live batch as the
    breakpoints do and gives the same forward; it is made once per attention."""
    model = _tiny_model(cli.parse_args(["--shape", "tiny"]))
    x, pos, batch = _tiny_inputs(model)
    op = llama.partition_attention(attn)
    assert llama.partition_attention(attn) is op
    assert torch.Tag.cudagraph_unsafe in op._opoverload.tags  # type: ignore[attr-defined]
    bp = llama.attention_flash if attn == "flash" else llama.attention_varlen
    with bcg.live_scope(batch):
        torch.testing.assert_close(model.forward(x, pos, op), model.forward(x, pos, bp))


def test_captures_time_every_build_of_a_mode_in_the_same_rounds_and_rows_give_their_mean(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With captures=2 each mode is built twice, in turns (the second turn in reverse order, so
    that neither mode always takes the later memory), and both builds are timed in every round; a row's
    samples are the two builds' mean, sample by sample, its paired ratio to the floor that of the
    means, and ratio_to_floor_paired_by_capture each build's against the floor's mean. Measures,
    host times and build fields come from the first build, rel_err is the worse; all are closed."""
    clock = [0.0]
    built: list[str] = []
    closed: list[str] = []
    measured: list[str] = []

    def timed_ms(fn: Any, sync: Any, wait: bool = True) -> float:
        t0 = clock[0]
        fn()
        return (clock[0] - t0) / 1e3

    monkeypatch.setattr(timing, "timed_ms", timed_ms)

    def make(name: str, us: tuple[float, float], errs: tuple[float, float] = (0.0, 0.0)) -> Any:
        def build(case: object, ctx: object) -> registry.Built:
            k = sum(b.startswith(name + "/") for b in built)
            label = f"{name}/{k}"
            built.append(label)
            eager = modes.build_eager(case, ctx)  # type: ignore[arg-type]

            def run() -> torch.Tensor:
                clock[0] += us[k]
                return eager.run()

            def check() -> torch.Tensor:
                return eager.run() * (1 + errs[k])

            def measure() -> Any:
                measured.append(label)
                return lambda: {"measured_build": label}

            return registry.Built(run=run, host=True, check=check, measure=measure, capture_s=float(k),
                                  close=lambda: closed.append(label))

        return registry.ModeSpec(name, build, False, "", lambda: None)

    monkeypatch.setitem(cli.MODES, "floor", make("floor", (10.0, 12.0)))
    monkeypatch.setitem(cli.MODES, "test-runner", make("test-runner", (20.0, 24.0), errs=(0.0, 0.5)))
    args = cli.parse_args(["--shape", "tiny", "--tokens", "16", "--attn", "loop", "--captures", "2"], cuda=False)
    assert args.captures == 2 and cli.parse_args([], cuda=False).captures == 1
    case = llama.make_case(_tiny_model(args), args, torch.device("cpu"), "loop", 16)
    ref = cli._reference(case, lambda: None)

    def fail(mode: str, exc: Exception) -> None:
        raise exc

    rows = cli._measure_case(case, ["floor", "test-runner"], lambda c: ref, registry.BuildContext(), 10, 0,
                             lambda: None, failed=fail, skipped=fail, progress=lambda step: None,
                             captures=args.captures)
    cli._finish_case(case, rows)
    by = {r["mode"]: r for r in rows}
    assert built == ["floor/0", "test-runner/0", "test-runner/1", "floor/1"]
    assert sorted(closed) == sorted(built) and measured == ["floor/0", "test-runner/0"]
    runner, floor = by["test-runner"], by["floor"]
    assert runner["captures"] == floor["captures"] == 2
    assert runner["samples_ms"] == pytest.approx([0.022] * 10) and floor["samples_ms"] == pytest.approx([0.011] * 10)
    assert runner["capture_samples_ms"] == [pytest.approx([0.020] * 10), pytest.approx([0.024] * 10)]
    assert runner["ratio_to_floor_paired"] == pytest.approx(2.0)
    assert runner["ratio_to_floor_paired_by_capture"] == [pytest.approx(20 / 11), pytest.approx(24 / 11)]
    assert runner["measured_build"] == "test-runner/0" and runner["capture_s"] == 0.0
    assert runner["host_us_per_replay"] == pytest.approx(20.0)  # the first build's host calls
    assert runner["rel_err"] == pytest.approx(0.5) and floor["rel_err"] == 0.0  # the worse build's


def test_a_mode_whose_second_build_fails_is_reported_once_and_all_its_builds_are_closed() -> None:
    built: list[str] = []
    closed: list[str] = []
    errors: list[tuple[str, str]] = []

    def build(case: object, ctx: object) -> registry.Built:
        if len(built) == 1:
            raise RuntimeError("capture 2 broke")
        built.append("b")
        return registry.Built(run=modes.build_eager(case, ctx).run, close=lambda: closed.append("b"))  # type: ignore[arg-type]

    registry.register_mode("test-second-fails", needs_cuda=False)(build)
    try:
        args = cli.parse_args(["--shape", "tiny", "--tokens", "16", "--attn", "loop"], cuda=False)
        case = llama.make_case(_tiny_model(args), args, torch.device("cpu"), "loop", 16)
        ref = cli._reference(case, lambda: None)
        rows = cli._measure_case(case, ["test-second-fails", "eager"], lambda c: ref, registry.BuildContext(), 3, 0,
                                 lambda: None, failed=lambda m, exc: errors.append((m, str(exc))),
                                 skipped=lambda m, exc: None, progress=lambda step: None, captures=2)
    finally:
        del registry.MODES["test-second-fails"]
    assert errors == [("test-second-fails", "capture 2 broke")] and closed == ["b"]
    assert [r["mode"] for r in rows] == ["eager"] and rows[0]["captures"] == 2
