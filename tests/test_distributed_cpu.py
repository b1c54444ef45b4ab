"""Rank agreement over a gloo world of 2 processes on the CPU: votes, bucket choice, capture failures."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import bcg
from bcg.distributed.agreement import CaptureVote, RankAgreement, replay_on_ranks
from tests.ranks import WORLD, run_world

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

# -- bodies (module level: spawned processes import them) ---------------------------------------


def _agreement(rank: int) -> Any:
    ranks = RankAgreement()
    return ranks.max([rank, 10 - rank]), ranks.all(rank == 0), ranks.all(True), ranks.same(7), ranks.same(rank)


def _votes(rank: int, fail_rank: int, fail_after: int, barriers: int) -> Any:
    """A capture with ``barriers`` eager breakpoints; ``fail_rank`` raises after ``fail_after`` of them."""
    vote = CaptureVote(RankAgreement())
    try:
        for i in range(barriers):
            if rank == fail_rank and i == fail_after:
                raise RuntimeError("injected capture failure")
            vote.barrier()
        if rank == fail_rank and fail_after >= barriers:
            raise RuntimeError("injected failure after the last breakpoint")
        outcome = vote.finish()
    except Exception as exc:
        outcome = vote.fail()
        return outcome, type(exc).__name__
    return outcome, None


class _Forms:
    """A graph of ``n`` forms as ``replay_on_ranks`` sees it: this rank's choice and whether it
    could stitch given; records the replay it is asked for."""

    def __init__(self, n: int, choice: int, keyed: bool, stitchable: bool) -> None:
        self.forms = [object()] * n
        self.keyed = keyed
        self.choice, self.stitchable = choice, stitchable
        self.replayed: tuple[int, bool] | None = None

    def choose(self, live: Any) -> int:
        return self.choice

    def would_stitch(self, index: int, live: Any) -> bool:
        return self.stitchable

    def replay_form(self, index: int, live: Any, *, stitch: bool = True) -> None:
        self.replayed = (index, stitch)


def _replay_on_ranks(rank: int) -> Any:
    """Rank 0 chooses form 0 and could stitch, rank 1 form 2 and could not; then one plain form."""
    out = []
    for same_inputs in (False, True):
        ranks = RankAgreement(same_inputs=same_inputs)
        keyed, plain = _Forms(3, 2 * rank, keyed=True, stitchable=rank == 0), _Forms(1, 0, keyed=False, stitchable=False)
        for graph in (keyed, plain):
            out.append((replay_on_ranks(ranks, graph, None), graph.replayed))
    return out


class _Net:
    """A forward with one breakpoint; rank 0 fails to warm up bucket 32 when told to."""

    def __init__(self, rank: int, fail_bucket: int | None) -> None:
        self.rank = rank
        self.fail_bucket = fail_bucket
        self.w = torch.ones(4, 4)

        @bcg.breakpoint(name="scale")
        def scale(y: torch.Tensor) -> torch.Tensor:
            return y * float(bcg.live())

        self.scale = scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 0 and x.shape[0] == self.fail_bucket:
            raise RuntimeError(f"injected failure at {x.shape[0]} rows")
        return self.scale(x @ self.w) + 1


def _runner(rank: int, fail_bucket: int | None) -> Any:
    ranks = RankAgreement()
    net = _Net(rank, fail_bucket)
    runner = bcg.GraphRunner(net, buckets=[16, 32], example_inputs=(torch.zeros(32, 4),), mode="eager",
                             live=2.0, progress=False, ranks=ranks)
    runner.capture()
    failed = sorted(runner.failed_buckets)
    outs = []
    for T in ([10, 20] if rank == 0 else [12, 9]):  # rank 0's 20 rows pick bucket 32 on both ranks
        x = torch.randn(T, 4)
        got = runner(x, live=3.0)
        with bcg.live_scope(3.0):
            want = net.scale(x @ net.w) + 1
        outs.append(bool(torch.equal(got, want)) and tuple(got.shape) == (T, 4))
    st = runner.stats()
    return failed, outs, st["replays"], st["fallbacks"]


def _same_inputs(rank: int, diverge: bool, fail: bool = False) -> Any:
    """A runner whose ranks promise the same inputs: no exchange before a call's run, a check after.
    With ``diverge``, rank 1's second call has other rows (another bucket); with ``fail``, rank 0's
    forward raises in bucket 32 (its second call) after the capture."""
    ranks = RankAgreement(same_inputs=True)
    net = _Net(rank, None)
    runner = bcg.GraphRunner(net, buckets=[16, 32], example_inputs=(torch.zeros(32, 4),), mode="eager",
                             live=2.0, progress=False, ranks=ranks)
    runner.capture()

    def no_exchange(values: Any) -> Any:
        raise AssertionError("a call exchanged before running, with same_inputs=True")

    ranks.max = no_exchange  # type: ignore[method-assign]  # (the captures' votes are over)
    if fail:
        net.fail_bucket = 32
    outs, errors = [], []
    for T in [10, 20 if rank == 0 or not diverge else 12, 40, 5]:  # 40: too large, eager on both ranks
        x = torch.randn(T, 4)
        try:
            got = runner(x, live=3.0)
        except (bcg.ReplayError, RuntimeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        with bcg.live_scope(3.0):
            want = net.scale(x @ net.w) + 1
        outs.append(bool(torch.equal(got, want)))
    try:
        ranks.wait_checks()
    except bcg.ReplayError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    st = runner.stats()
    return outs, errors, st["replays"], st["fallbacks"]["too_large"]


# -- tests ------------------------------------------------------------------------------------------


def test_rank_agreement_reduces_across_ranks() -> None:
    for rank, (mx, only0, every, same7, same_rank) in enumerate(run_world(_agreement)):
        assert mx == [1, 10]
        assert only0 is False and every is True
        assert same7 is True and same_rank is False


@pytest.mark.parametrize(
    "fail_rank,fail_after,barriers",
    [(-1, 0, 3), (0, 1, 3), (1, 0, 3), (0, 3, 3), (0, 0, 0)],
    ids=["all-succeed", "rank0-mid", "rank1-first", "rank0-after-last", "no-breakpoints"],
)
def test_capture_votes_end_together_when_a_rank_fails(fail_rank: int, fail_after: int, barriers: int) -> None:
    import functools

    results = run_world(functools.partial(_votes, fail_rank=fail_rank, fail_after=fail_after, barriers=barriers))
    outcomes = [ok for ok, _ in results]
    if fail_rank < 0:
        assert outcomes == [True, True] and all(err is None for _, err in results)
    else:
        assert outcomes == [False, False]  # every rank falls back, none hangs
        healthy = results[1 - fail_rank][1]
        assert healthy in (None, "CaptureError")


def test_ranks_replay_one_form_and_stitch_only_where_every_rank_can() -> None:
    results = run_world(_replay_on_ranks)
    for rank, out in enumerate(results):
        agreed, plain, alone, plain_alone = out
        assert agreed == (2, (2, False))  # the most general form chosen, piecewise: rank 1 cannot stitch
        assert plain == (0, (0, True))
        assert alone == (2 * rank, (2 * rank, False))  # same inputs: each rank's own form, stitching agreed
        assert plain_alone == (0, (0, True))


def test_runner_ranks_pick_one_bucket_and_share_a_capture_failure() -> None:
    import functools

    results = run_world(functools.partial(_runner, fail_bucket=32))
    for rank, (failed, outs, replays, fallbacks) in enumerate(results):
        assert failed == [32], (rank, failed)  # rank 0 failed it; rank 1 agreed
        assert outs == [True, True], rank
        # call 1: max T 20 -> bucket 32 (failed: eager on both ranks); call 2: max T 12 -> bucket 16
        assert fallbacks["capture_failed"] == 1 and replays[16] == 1 and replays[32] == 0, (rank, replays, fallbacks)


def _explicit_bucket(rank: int) -> Any:
    """Ranks pass the same bucket with different rows: the padding-waste rule must not split them."""
    ranks = RankAgreement()
    net = _Net(rank, None)
    runner = bcg.GraphRunner(net, buckets=[16, 32], example_inputs=(torch.zeros(32, 4),), mode="eager",
                             live=2.0, progress=False, ranks=ranks, max_padding_ratio=0.5)
    runner.capture()
    x = torch.randn(8 if rank == 0 else 20, 4)  # rank 0 alone would waste 75% of bucket 32
    got = runner(x, live=3.0, bucket=32)
    with bcg.live_scope(3.0):
        want = net.scale(x @ net.w) + 1
    st = runner.stats()
    return bool(torch.equal(got, want)), st["replays"][32], st["fallbacks"]["padding_waste"]


def test_runner_ranks_given_one_bucket_agree_on_padding_waste() -> None:
    results = run_world(_explicit_bucket)
    assert results == [(True, 1, 0), (True, 1, 0)], results  # judged on the largest T of all ranks


def test_runner_ranks_without_failures() -> None:
    import functools

    results = run_world(functools.partial(_runner, fail_bucket=None))
    for failed, outs, replays, _ in results:
        assert failed == [] and outs == [True, True]
        assert replays == {16: 1, 32: 1}  # both ranks ran bucket 32 for the first call


def test_same_inputs_ranks_choose_locally_and_check_after_the_call() -> None:
    import functools

    for rank, (outs, errors, replays, too_large) in enumerate(run_world(functools.partial(_same_inputs, diverge=False))):
        assert outs == [True] * 4 and errors == [], (rank, errors)
        assert replays == {16: 2, 32: 1} and too_large == 1, (rank, replays)


def test_same_inputs_ranks_that_diverge_raise_at_the_next_call() -> None:
    import functools

    for rank, (outs, errors, replays, _) in enumerate(run_world(functools.partial(_same_inputs, diverge=True))):
        # call 2 differed (rank 0: 20 rows, bucket 32; rank 1: 12 rows, bucket 16): call 3 raises on both
        assert len(errors) == 1 and outs == [True, True, True], (rank, errors, outs)
        assert "differed at check 1" in errors[0] and "call T from 12 to 20" in errors[0], errors[0]
        assert "bucket from 16 to 32" in errors[0] and "same_inputs=False" in errors[0]


def test_same_inputs_a_call_that_raises_on_one_rank_still_posts_its_check() -> None:
    """Rank 0's second call raises in forward; rank 1's runs: both ranks' next call raises ReplayError
    (the checks stay paired: no rank waits for ever), and the calls after it run."""
    import functools

    results = run_world(functools.partial(_same_inputs, diverge=False, fail=True))
    for rank, (outs, errors, replays, _) in enumerate(results):
        raised = ["RuntimeError: injected failure at 32 rows"] if rank == 0 else []
        assert errors[: len(raised)] == raised, (rank, errors)
        mismatch = errors[len(raised):]
        assert len(mismatch) == 1 and "differed at check 1" in mismatch[0] and "-100 raised) from -100 to 0" in mismatch[0]
        assert len(outs) == 4 - len(errors) and all(outs), (rank, outs)


def test_bench_tp2_relaunches_through_torchrun_and_writes_a_file_per_rank(tmp_path: Any) -> None:
    import json

    from bcg.bench import cli

    rc = cli.main(["--tp", "2", "--workload", "llama", "--attn", "flash,unfused", "--tokens", "16", "--iters", "2",
                   "--warmup", "1", "--no-progress", "--ladder-max", "0", "--out", str(tmp_path)])
    assert rc == 0
    for rank in range(WORLD):
        doc = json.loads((tmp_path / f"bench.rank{rank}.json").read_text())
        assert doc["errors"] == []
        rows = doc["rows"]
        assert {(r["attn"], r["mode"]) for r in rows} == {(a, m) for a in ("flash", "unfused") for m in ("eager", "bcg-eager")}
        for row in rows:
            assert row["tp"] == 2 and row["rank"] == rank and row["rel_err"] == 0.0
        assert (tmp_path / f"bench.rank{rank}.png").stat().st_size > 1000


def test_tp_refuses_shapes_it_cannot_shard() -> None:
    from bcg.bench import cli

    with pytest.raises(SystemExit):
        cli.parse_args(["--tp", "3", "--shape", "tiny"], cuda=False)  # 4 heads, 2 KV heads


def test_rank_agreement_flag_needs_tp() -> None:
    from bcg.bench import cli

    with pytest.raises(SystemExit):
        cli.parse_args(["--rank-agreement", "every-call"], cuda=False)
    assert cli.parse_args(["--tp", "2", "--rank-agreement", "every-call"], cuda=False).rank_agreement == "every-call"
