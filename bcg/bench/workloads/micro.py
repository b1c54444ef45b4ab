"""``micro``: K one-kernel segments separated by K one-kernel breakpoints.

The forward is ``seg 0, bp 0, seg 1, bp 1, ..., seg K-1, bp K-1`` on a small
float32 vector: each segment is one elementwise kernel (``y = 2x`` then
``y = y + x``), each breakpoint one in-place kernel (``y *= 0.5``). GPU time is
negligible, so a replay's time is the library's own cost of launching K
segments and calling K breakpoints.

Extra row fields: ``us_per_replay`` (median), ``us_per_segment`` (= / K),
``bp_eager_us`` (the breakpoints' own eager cost: K plain calls of the
breakpoint body, timed the same way) and ``us_per_segment_overhead`` =
(``us_per_replay`` - ``bp_eager_us``) / K.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

import bcg
from bcg.bench.case import Case
from bcg.bench.timing import sample_ms, sync_fn
from bcg.bench.argtypes import positive_int

NAME = "micro"
NEEDS_CUDA = True
NUMEL = 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("micro workload")
    g.add_argument("--segments", type=positive_int, default=64, help="K: segments and breakpoints (default 64)")
    g.add_argument("--micro-iters", type=positive_int, default=200,
                   help="timed replays per micro row (default 200: a replay is ~0.1 ms)")


def points(args: argparse.Namespace) -> list[tuple[str | None, int | None]]:
    return [(None, None)]


def config(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    return {"segments": args.segments, "numel": NUMEL, "iters": args.micro_iters}


def setup(args: argparse.Namespace, device: torch.device) -> None:
    if args.segments < 1 or args.micro_iters < 1:
        raise ValueError("--segments and --micro-iters must be at least 1")


def halve_raw(y: torch.Tensor) -> None:
    y.mul_(0.5)


halve = bcg.breakpoint(halve_raw, name="micro_halve", mutates=("y",))


def make_case(state: None, args: argparse.Namespace, device: torch.device, attn: str | None, T: int | None) -> Case:
    K = args.segments
    gen = torch.Generator(device=device).manual_seed(args.seed)
    x_base = torch.randn(NUMEL, generator=gen, device=device)
    x_fresh = torch.randn(NUMEL, generator=gen, device=device)
    x = x_base.clone()

    def write_inputs(fresh: bool) -> None:
        x.copy_(x_fresh if fresh else x_base)

    def make_forward(bp: Any) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            y = x * 2.0
            bp(y)
            for _ in range(K - 1):
                y = y + x
                bp(y)
            return y

        return forward

    sync = sync_fn(device)
    scratch = torch.zeros(NUMEL, device=device)

    def k_breakpoints() -> None:
        for _ in range(K):
            halve_raw(scratch)

    def finish_row(row: dict[str, Any]) -> None:
        if "bp_eager_us" not in state_cache:
            samples = sample_ms(k_breakpoints, sync, iters=max(row["iters"], 5), warmup=3)
            state_cache["bp_eager_us"] = statistics.median(samples) * 1e3
        bp_us = state_cache["bp_eager_us"]
        us = row["ms_median"] * 1e3
        row.update(
            K=K,
            us_per_replay=us,
            us_per_segment=us / K,
            bp_eager_us=bp_us,
            us_per_segment_overhead=(us - bp_us) / K,
        )

    state_cache: dict[str, float] = {}
    return Case(
        workload=NAME,
        use_runner=False,
        attn=None,
        T=None,
        device=device,
        static_args=(x,),
        live=None,
        make_forward=make_forward,
        bp=halve,
        bp_raw=halve_raw,
        bp_frozen=halve_raw,
        num_breaks=K,
        write_inputs=write_inputs,
        fields={"K": K},
        iters=args.micro_iters,
        finish_row=finish_row,
    )
