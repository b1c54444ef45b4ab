"""Where a replay's per-segment time goes: graph launches, breakpoint calls, GPU gaps.

A diagnostic for the native replay path (issue: per-segment overhead). On one
GPU, with K one-kernel graphs and K one-kernel breakpoints (the ``micro``
workload's shape), it times, in microseconds per step, both the host time to
issue the work (``host``: until the call returns) and the wall time until the
GPU has finished it (``wall``: synchronized):

* ``cuGraphLaunch`` alone: a ``bcg._native.Plan`` of K handles (the C loop);
* ``CUDAGraph.replay()`` alone: a Python loop over torch's replay;
* the native loop with K no-op Python calls between the launches;
* the eager breakpoint body alone (K ``mul_``);
* the whole micro replay through ``bcg.make_graph``, native and Python executors.

Usage: ``python benchmarks/launch_cost.py [--out FILE.json] [--segments K]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any, Callable

import torch

import bcg
from bcg import native
from bcg.bench.timing import sample_ms


def _time(fn: Callable[[], None], iters: int, wait: bool) -> float:
    """Median seconds of ``fn`` (synchronized before each call; after it too if ``wait``)."""
    return statistics.median(sample_ms(fn, torch.cuda.synchronize, iters, warmup=3, wait=wait)) / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--segments", type=int, default=64)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out")
    args = p.parse_args()
    K, iters = args.segments, args.iters
    x = torch.randn(1024, device="cuda")
    y = torch.empty_like(x)
    stream = torch.cuda.Stream()
    graphs = []
    with torch.cuda.stream(stream):
        y.copy_(x * 2)  # warm up the kernel
        for _ in range(K):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                y.mul_(1.0001)
            graphs.append(g)
    torch.cuda.synchronize()
    handles = [int(g.raw_cuda_graph_exec()) for g in graphs]
    mod = native.module()
    launches = mod.Plan(handles)
    noop = (lambda: None)
    with_calls = mod.Plan([s for h in handles for s in (h, noop)])

    def raw_stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    def torch_replays() -> None:
        for g in graphs:
            g.replay()

    def eager_body() -> None:
        for _ in range(K):
            y.mul_(0.5)

    results: dict[str, Any] = {"K": K, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    cases: dict[str, Callable[[], None]] = {
        "native cuGraphLaunch x K": lambda: launches.replay(raw_stream()),
        "torch CUDAGraph.replay x K": torch_replays,
        "native launch + no-op call x K": lambda: with_calls.replay(raw_stream()),
        "eager mul_ x K": eager_body,
    }
    halve = bcg.breakpoint(lambda t: t.mul_(0.5), name="halve", mutates=("t",))

    def forward(t: torch.Tensor) -> torch.Tensor:
        out = t * 2.0
        halve(out)
        for _ in range(K - 1):
            out = out + t
            halve(out)
        return out

    graph = bcg.make_graph(forward, x)
    for executor in ("native", "python"):
        graph.use_executor(executor)
        cases[f"bcg micro replay ({executor})"] = graph.replay
    for name, fn in cases.items():
        host = _time(fn, iters, wait=False) * 1e6 / K
        wall = _time(fn, iters, wait=True) * 1e6 / K
        results[name] = {"host_us_per_step": host, "wall_us_per_step": wall}
        print(f"{name:34} host {host:6.2f} us/step   wall {wall:6.2f} us/step", flush=True)
    graph.reset()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
