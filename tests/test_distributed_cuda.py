"""Two GPUs, NCCL: tensor-parallel segments, collectives in breakpoints, ranks that agree, no hangs."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import bcg
import bcg.runner.tiers
from tests.ranks import run_world

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

SHAPE = {"layers": 2, "hidden": 256, "heads": 8, "kv_heads": 4, "intermediate": 512, "head_dim": 32}


def _lengths(rng: random.Random, T: int) -> tuple[int, ...]:
    r = rng.randint(1, min(4, T))
    cuts = sorted(rng.sample(range(1, T), r - 1))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, T]))


def _tp_model(rank: int) -> Any:
    import torch.distributed as dist

    from bcg.bench.workloads import llama

    device = torch.device("cuda", rank)
    model = llama.LlamaModel(SHAPE, device, max_pos=256, seed=0, tp=llama.TensorParallel(rank, dist.get_world_size()))
    return llama, model, device


def _tp_runner_matches_eager(rank: int, attn: str) -> Any:
    """A TP llama (all-reduces inside segments) through a GraphRunner with ranks, against eager TP."""
    llama, model, device = _tp_model(rank)
    bp = llama.BREAKPOINTS[attn]

    def forward(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return model.forward(x, pos, bp)

    def live_for(n: int) -> Any:
        return llama.Batch.build(tuple(llama.request_lengths(n, min(4, n), 0)), device)

    x0 = torch.zeros(128, model.hidden, device=device, dtype=model.dtype)
    pos0 = torch.zeros(128, dtype=torch.long, device=device)
    ranks = bcg.distributed.RankAgreement()
    options: dict[str, Any] = dict(buckets=[64, 128], example_inputs=(x0, pos0), live=live_for,
                                   progress=False, ranks=ranks)
    runner = bcg.GraphRunner(forward, capture_error_mode="thread_local", **options).capture()
    reference = bcg.GraphRunner(forward, mode="eager", **options).capture()  # eager TP on the padded inputs
    rng = random.Random(1)  # the same batches on both ranks
    same = []
    for _ in range(20):
        T = rng.randint(8, 128)
        lengths = _lengths(rng, T)
        gen = torch.Generator(device=device).manual_seed(rng.randrange(2**31))
        x = torch.randn(T, model.hidden, generator=gen, device=device, dtype=model.dtype)
        pos = torch.cat([torch.arange(n, device=device) for n in lengths])
        got = runner(x, pos, live=llama.Batch.build(lengths, device)).clone()
        want = reference(x, pos, live=llama.Batch.build(lengths, device))
        same.append(bool(torch.equal(got, want)))
    st = runner.stats()
    runner.reset()
    return same, st["failed_buckets"], st["replays"]


def _tp_staged_same_inputs(rank: int) -> Any:
    """Staged TP attention (slot tiers of 2 and 4, 8 slots) through a
    runner whose ranks promise the same inputs: against eager TP, with no exchange before a launch."""
    llama, model, device = _tp_model(rank)
    staged = model.staged_attention(8)
    bcg.runner.tiers.time_forms = lambda graph, indices, live, rounds=0: [[0.0], [1.0]]  # every tier kept

    def forward(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return model.forward(x, pos, staged.breakpoints["flash"])

    def lengths_for(n: int, k: int) -> list[int]:
        return llama.request_lengths(n, min(k, n), 0)

    x0 = torch.zeros(128, model.hidden, device=device, dtype=model.dtype)
    pos0 = torch.zeros(128, dtype=torch.long, device=device)
    ranks = bcg.distributed.RankAgreement(same_inputs=True)
    runner = bcg.GraphRunner(forward, buckets=[64, 128], example_inputs=(x0, pos0), progress=False, ranks=ranks,
                             live=lambda n: staged.capture_lives(n, lengths_for, [2, 4]),
                             capture_error_mode="thread_local").capture()
    tiers = [sum(f.name.startswith("tier") for f in runner.graph(n).forms) for n in runner.buckets]
    reference = bcg.GraphRunner(  # eager TP with exact bounds, on the padded inputs
        lambda x, pos: model.forward(x, pos, llama.attention_flash), mode="eager", buckets=[64, 128],
        example_inputs=(x0, pos0), progress=False,
        live=lambda n: llama.Batch.build(tuple(lengths_for(n, 4)), device)).capture()

    def no_exchange(values: Any) -> Any:
        raise AssertionError("a call exchanged before its launch, with same_inputs=True")

    ranks.max = no_exchange  # type: ignore[method-assign]
    rng = random.Random(3)  # the same batches on both ranks
    same = []
    for i in range(24):
        T = rng.randint(12, 128)
        r = rng.randint(1, 4) if i % 3 else rng.randint(5, 12)  # up to 8 slots inline; more: breakable
        cuts = sorted(rng.sample(range(1, T), r - 1))
        lengths = tuple(b - a for a, b in zip([0, *cuts], [*cuts, T]))
        gen = torch.Generator(device=device).manual_seed(rng.randrange(2**31))
        x = torch.randn(T, model.hidden, generator=gen, device=device, dtype=model.dtype)
        pos = torch.cat([torch.arange(n, device=device) for n in lengths])
        got = runner(x, pos, live=llama.Batch(lengths)).clone()
        want = reference(x, pos, live=llama.Batch.build(lengths, device))
        same.append(bool(torch.equal(got, want)))
    ranks.wait_checks()
    st = runner.stats()
    runner.reset()
    return same, tiers, st["inline_replays"], st["staged_fallbacks"], st["tier_replays"]


def _all_to_all(rank: int) -> Any:
    """A breakpoint running all_to_all_single with split sizes from bcg.live(); an all-reduce in a segment."""
    import torch.distributed as dist

    device = torch.device("cuda", rank)
    N, D = 64, 16

    @bcg.breakpoint(name="a2a", mutates=("out",))
    def a2a(inp: torch.Tensor, out: torch.Tensor) -> None:
        m = bcg.live()  # m[i][j]: rows rank i sends to rank j
        send = [m[rank][j] for j in range(2)]
        recv = [m[i][rank] for i in range(2)]
        out.zero_()
        dist.all_to_all_single(out[: sum(recv)], inp[: sum(send)], recv, send)

    def forward(x: torch.Tensor) -> torch.Tensor:
        inp = x * 2 + rank
        out = torch.empty_like(inp)
        a2a(inp, out)
        y = out * 3
        dist.all_reduce(y)
        return y + 1

    rng = random.Random(2)

    def matrix() -> list[list[int]]:
        return [[rng.randint(0, N // 2) for _ in range(2)] for _ in range(2)]

    x = torch.randn(N, D, device=device)
    graph = bcg.make_graph(forward, x, live=matrix(), capture_error_mode="thread_local")
    same = []
    for _ in range(20):
        m = matrix()
        x.copy_(torch.randn(N, D, device=device))
        got = graph.replay(live=m).clone()
        with bcg.live_scope(m):
            want = forward(x.clone())
        same.append(bool(torch.equal(got, want)))
    graph.reset()
    return same


def _failure_on_one_rank(rank: int) -> Any:
    """Rank 0's capture of bucket 64 syncs the host inside a segment: both ranks run bucket 64 eagerly."""
    import torch.distributed as dist

    device = torch.device("cuda", rank)
    w = torch.randn(32, 32, device=device)

    @bcg.breakpoint(name="scale")
    def scale(y: torch.Tensor) -> torch.Tensor:
        return y * float(bcg.live())

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = x @ w
        dist.all_reduce(y)
        if rank == 0 and x.shape[0] == 64 and torch.cuda.is_current_stream_capturing():
            y.sum().item()  # a host sync: this rank's capture fails
        y = scale(y)
        dist.all_reduce(y)
        return scale(y) + 1

    runner = bcg.GraphRunner(forward, buckets=[32, 64], example_inputs=(torch.zeros(64, 32, device=device),),
                             live=0.5, progress=False, ranks=bcg.distributed.RankAgreement(),
                             capture_error_mode="thread_local")
    runner.capture()
    same = []
    for T in (50, 20, 64, 30):
        x = torch.randn(T, 32, device=device)
        got = runner(x, live=0.25).clone()
        n = 32 if T <= 32 else T  # bucket 32 replays on zero-padded rows; bucket 64 ran eagerly on the real ones
        padded = torch.cat([x, x.new_zeros(n - T, 32)])
        with bcg.live_scope(0.25), torch.no_grad():
            want = forward(padded)[:T]
        same.append(bool(torch.equal(got, want)))
    st = runner.stats()
    runner.reset()
    return sorted(st["failed_buckets"]), same, st["fallbacks"]["capture_failed"], st["replays"][32]


def _many_replays(rank: int) -> Any:
    """1000 replays of a TP llama bucket: no hang, no memory growth."""
    llama, model, device = _tp_model(rank)
    lengths = (20, 44)
    x = torch.randn(64, model.hidden, device=device, dtype=model.dtype)
    pos = torch.cat([torch.arange(n, device=device) for n in lengths])
    batch = llama.Batch.build(lengths, device)
    graph = bcg.make_graph(lambda x, pos: model.forward(x, pos, llama.attention_flash), x, pos, live=batch,
                           capture_error_mode="thread_local")
    for _ in range(10):
        graph.replay(live=batch)
    torch.cuda.synchronize()
    before = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
    for _ in range(1000):
        graph.replay(live=batch)
    torch.cuda.synchronize()
    after = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
    graph.reset()
    return before, after


def _everything(rank: int) -> dict[str, Any]:
    """Every body above, in one world (one spawn and one NCCL set-up for all the tests)."""
    return {
        "tp_flash": _tp_runner_matches_eager(rank, "flash"),
        "tp_unfused": _tp_runner_matches_eager(rank, "unfused"),
        "tp_staged": _tp_staged_same_inputs(rank),
        "all_to_all": _all_to_all(rank),
        "failure": _failure_on_one_rank(rank),
        "many": _many_replays(rank),
    }


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_everything, backend="nccl", timeout_s=300)


@pytest.mark.parametrize("attn", ["flash", "unfused"])
def test_tp_llama_through_a_runner_is_bit_identical_to_eager_tp(world: list[dict[str, Any]], attn: str) -> None:
    for rank, result in enumerate(world):
        same, failed, replays = result[f"tp_{attn}"]
        assert same == [True] * 20, (rank, same)
        assert failed == {} and sum(replays.values()) == 20


def test_staged_tp_with_same_inputs_is_bit_identical_and_never_exchanges_before_a_launch(
    world: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(world):
        same, tiers, inline, fallbacks, tier_replays = result["tp_staged"]
        assert same == [True] * 24, (rank, same)
        assert tiers == [2, 2], (rank, tiers)  # both ranks kept both tiers of both buckets
        # random.Random(3) draws 16 batches of <= 4 requests (a tier), 1 of 7 (the bucket's 8 slots)
        # and 7 of 9 to 12 (the breakable form)
        assert (inline, tier_replays, sum(fallbacks.values())) == (17, 16, 7), (rank, inline, tier_replays, fallbacks)


def test_an_all_to_all_breakpoint_with_random_splits(world: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(world):
        assert result["all_to_all"] == [True] * 20, rank


def test_a_capture_failure_on_one_rank_makes_both_run_the_bucket_eagerly(world: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(world):
        failed, same, eager_calls, graph_calls = result["failure"]
        assert failed == [64], (rank, failed)
        assert same == [True] * 4, (rank, same)
        assert eager_calls == 2 and graph_calls == 2, rank  # T 50, 64 eagerly; T 20, 30 from bucket 32


def test_a_thousand_replays_neither_hang_nor_grow_memory(world: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(world):
        before, after = result["many"]
        assert after == before, (rank, before, after)
