"""The bench's decode-loop point on the CPU: its flags, its steps' metadata, the loop through a
GraphRunner over the staged attention (eager mode here) against the eager loop, and the bench's
rows (tests/test_decode_loop_cuda.py runs the loop on a GPU, queued ahead)."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import pytest
import torch

import bcg
from bcg.bench import cli, registry
from bcg.bench.case import Case, DecodeLoop, eager_step
from bcg.bench.registry import Built
from bcg.bench.workloads import llama, paged

LOOP_ARGS = ["--attn", "decode-loop", "--shape", "tiny", "--context", "24", "--page", "4", "--steps", "12",
             "--vocab", "96"]


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("argv, message", [
    (["--attn", "decode-loop", "--steps", "0"], "--steps"),
    (["--attn", "decode-loop", "--vocab", "0"], "--vocab"),
    (["--attn", "decode-loop", "--tp", "2"], "drop --tp 2"),
])
def test_bad_loop_flags_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.parse_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_loop_flags_and_config() -> None:
    args = cli.parse_args(["--attn", "decode-loop,decode", "--tokens", "1,8"])  # T below --requests: decode's
    assert (args.steps, args.vocab) == (64, 32000)
    config = llama.config(args, torch.device("cpu"))
    assert config["steps"] == 64 and config["vocab"] == 32000 and config["lengths"] == {}
    assert "vocab" not in llama.config(cli.parse_args(["--attn", "decode"]), torch.device("cpu"))


def test_decode_steps_grow_contexts_and_tables_across_page_boundaries() -> None:
    page = 4
    first = paged.PagedBatch((1, 1), (3, 8), ((5,), (1, 2)), page)
    steps = paged.DecodeSteps(first, ((5, 6, 7), (1, 2, 3)))
    assert steps.steps == 5  # request 1: 8 + 4 tokens fill its 3 pages
    b = steps.batch(1)
    assert b.ctx_lens == (4, 9) and b.tables == ((5,), (1, 2, 3)) and b.positions() == [3, 8]
    assert b.slots() == [5 * page + 3, 3 * page + 0]
    assert steps.batch(4).tables == ((5, 6), (1, 2, 3)) and steps.batch(4).ctx_lens == (7, 12)
    with pytest.raises(ValueError, match="past the pages"):
        steps.batch(5)
    with pytest.raises(ValueError, match="one new token"):
        paged.DecodeSteps(paged.PagedBatch((2,), (3,), ((1,),), page), ((1,),))


def test_a_loop_runs_each_step_on_the_previous_steps_output() -> None:
    """DecodeLoop: step 0 reads ``start``, every later step what ``advance`` wrote, each with its
    own live metadata; the result holds every step's output."""
    start = (torch.tensor([1.0, 2.0]),)
    seen = []

    def step(live: int) -> torch.Tensor:
        seen.append((live, x.clone()))
        return x * 10 + live

    x = torch.zeros(2)
    loop = DecodeLoop(3, start, lambda n: n, lambda inputs, out: inputs[0].copy_(out))
    out = loop.run(step, (x,))
    assert [s[0] for s in seen] == [0, 1, 2] and torch.equal(seen[0][1], start[0])
    assert torch.equal(out, torch.tensor([[10.0, 20.0], [101.0, 201.0], [1012.0, 2012.0]]))
    assert loop.gpu_idle(step, (x,)) == {}  # no CUDA events on the CPU


def _case(T: int, seed: int) -> Case:
    args = cli.parse_args([*LOOP_ARGS, "--tokens", str(T), "--seed", str(seed)], cuda=False)
    device = torch.device("cpu")
    return llama.make_case(llama.setup(args, device), args, device, llama.LOOP, T)


def test_a_staged_runner_loop_generates_the_eager_loops_ids() -> None:
    """The decode-loop case through a GraphRunner (eager mode on the CPU) over the staged paged
    attention: every step's ids equal the eager loop's from the same fresh ids, with contexts
    crossing page boundaries; the floor's attention is the middle step's."""
    case = _case(3, random.randrange(2**31))
    loop = case.loop
    assert loop is not None and case.staged is not None and case.staged.loop is loop
    assert loop.live(loop.steps - 1).batch.max_pages > loop.live(0).batch.max_pages
    case.write_inputs(True)
    with torch.no_grad():
        expected = loop.run(eager_step(case.forward(case.bp), case.static_args), case.static_args).clone()
    assert expected.shape == (12, 3) and expected.dtype == torch.int64 and len(set(expected.flatten().tolist())) > 3
    staged = case.staged
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (no CUDA: eager mode)
        runner = bcg.GraphRunner(staged.forward(staged.bp), buckets=[3], example_inputs=staged.static_args,
                                 live=staged.live_for, progress=False)
    runner.capture()
    args = runner.input_buffers(3)
    ids = loop.run(lambda live: runner(*args, live=live), args)
    assert torch.equal(ids, expected)
    assert not any(runner.stats()["staged_fallbacks"].values())
    # a loop that fed the host's start ids at every step would differ: the device feedback is tested
    frozen = loop.run(lambda live: runner(*(a.copy_(s) for a, s in zip(args, loop.start)), live=live), args)
    assert not torch.equal(frozen, expected)
    case.write_inputs(False)


def test_looped_builds_run_the_whole_loop_and_skip_host_timing() -> None:
    case = _case(1, 0)
    calls = []
    built = Built(run=lambda: torch.zeros(1), host=True)
    out = registry.looped(case, built, lambda live: calls.append(live) or torch.zeros(1, dtype=torch.int64),
                          case.static_args)
    assert out.host is False and out.check is out.run and out.measure is not None
    stop = out.measure()
    assert out.run().shape == (12, 1) and len(calls) == 12
    assert stop() == {}  # no GPU measures on the CPU
    assert registry.looped(_plain_case(), built, lambda live: torch.zeros(1), ()) is built


def _plain_case() -> Case:
    args = cli.parse_args(["--attn", "decode", "--shape", "tiny", "--tokens", "1", "--context", "8"], cuda=False)
    device = torch.device("cpu")
    return llama.make_case(llama.setup(args, device), args, device, "decode", 1)


def test_cpu_bench_rows_of_the_decode_loop(no_cuda: None, tmp_path: Path) -> None:
    """The CPU smoke run (eager, bcg-eager) of decode-loop: each sample a loop of --steps steps;
    rows have tokens/s and the ids equal the eager loop's."""
    rc = cli.main([*LOOP_ARGS, "--tokens", "1,3", "--iters", "2", "--warmup", "1", "--out", str(tmp_path),
                   "--no-progress"])
    assert rc == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    rows = doc["rows"]
    assert doc["errors"] == [] and {(r["T"], r["mode"]) for r in rows} == {
        (t, m) for t in (1, 3) for m in ("eager", "bcg-eager")}
    for r in rows:
        assert r["attn"] == "decode-loop" and r["steps"] == 12 and r["vocab"] == 96
        assert r["rel_err"] == 0.0 and r["ids_equal"] is True
        assert r["tokens_per_s"] == pytest.approx(r["T"] * 12 * 1e3 / r["ms_median"])
        assert r["context_pages"] == 9 and "host_us_per_replay" not in r  # (24 + 11) / 4 pages
