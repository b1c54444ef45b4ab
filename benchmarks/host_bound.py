"""Where a llama replay's time goes: host time, GPU time, and the GPU's idle gaps.

For each mode (floor, bcg-graph, bcg, ...) at one T and attention kind, measures

* ``host_us``: the replay call alone (until it returns, no synchronize);
* ``wall_us``: the full replay (until the GPU is done), what the bench reports;
* ``gpu_us``: the replay's GPU time with all its work already queued: the host
  issues it behind a spin kernel that outlasts the host's work (CUDA events
  around the replay). ``wall_us - gpu_us`` is the time the GPU waited for the
  host; ``gpu_us`` minus the floor's is work or gaps the GPU itself pays.

and one attention breakpoint's host time (``bp_host_us``) next to the floor's
GPU time per layer. ``--trace`` adds a profiler trace of one queued replay per
mode (the host's profiler overhead is hidden behind the spin kernel), summarized
per layer: GPU busy time, and the idle gaps between consecutive GPU operations,
keyed by where each came from (``graph``: a graph launch; ``eager``: a kernel
launch). Run on a GPU:
``python benchmarks/host_bound.py --tokens 128 --attn flash [--trace] [--out FILE.json]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

import torch

import bcg
from bcg.bench import cli, modes, registry, report
from bcg.bench.timing import sample_ms
from bcg.bench.workloads import llama

# variants of the registered modes, to split the runner's cost from the library's
VARIANTS: dict[str, Callable[[Any, registry.BuildContext], registry.Built]] = {
    "bcg-graph-compile": lambda case, ctx: modes._bcg_graph(case, ctx, None, compiled=True),
    "bcg-compile-nosanitize": lambda case, ctx: modes._bcg_runner(case, ctx, None, compiled=True, sanitize=False),
    "bcg-staged-graph": lambda case, ctx: modes._bcg_graph(_staged(case), ctx, None),
    "bcg-staged-nosanitize": lambda case, ctx: modes._bcg_runner(_staged(case), ctx, None, staged=True, sanitize=False),
}


def _staged(case: Any) -> Any:
    if case.staged is None:
        raise registry.NotApplicable(f"{case.label} has no staged breakpoint here")
    return case.staged


def _median_us(fn: Callable[[], Any], wait: bool, iters: int = 30) -> float:
    return statistics.median(sample_ms(fn, torch.cuda.synchronize, iters, warmup=3, wait=wait)) * 1e3


def _spin_cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # warm-up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def _gpu_us(fn: Callable[[], Any], spin_ms: float, cycles_per_ms: float, iters: int = 10) -> tuple[float, bool]:
    """Median GPU µs of ``fn`` with its work queued; False if the host ever finished after the spin."""
    times, ahead = [], True
    for _ in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(spin_ms * cycles_per_ms))
        start.record()
        fn()
        ahead &= not start.query()  # the spin still runs: the GPU never waited for the host
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[2:]), ahead


def _trace(fn: Callable[[], Any], spin_ms: float, cycles_per_ms: float, layers: int) -> dict[str, Any]:
    """One queued replay under the profiler: GPU busy time and idle gaps per layer, by source."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(int(spin_ms * cycles_per_ms))
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    launcher = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launcher[e["args"]["correlation"]] = e["name"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    spin = max((i for i, e in enumerate(gpu) if "spin" in e["name"] or "sleep" in e["name"]), default=-1)
    gpu = gpu[spin + 1:]

    def source(e: dict[str, Any]) -> str:
        return "graph" if "GraphLaunch" in launcher.get(e["args"].get("correlation"), "") else "eager"

    busy: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    gaps: dict[str, float] = collections.Counter()
    eager_kernels: dict[str, float] = collections.Counter()
    for prev, nxt in zip([None, *gpu], gpu):
        src = source(nxt)
        busy[src] += nxt["dur"]
        count[src] += 1
        if src == "eager":
            eager_kernels[nxt["name"][:60]] += nxt["dur"]
        if prev is not None:
            gaps[f"{source(prev)}->{src}"] += max(0.0, nxt["ts"] - (prev["ts"] + prev["dur"]))
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"] if gpu else 0.0
    per = 1.0 / layers
    return {
        "span_us_per_layer": span * per,
        "busy_us_per_layer": {k: v * per for k, v in busy.items()},
        "ops_per_layer": {k: v * per for k, v in count.items()},
        "gap_us_per_layer": {k: v * per for k, v in gaps.items()},
        "eager_kernel_us_per_layer": {k: v * per for k, v in eager_kernels.most_common(8)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--attn", choices=("flash", "varlen"), default="flash")
    p.add_argument("--modes", default="floor,bcg-graph,bcg,floor-compile,bcg-compile",
                   help=f"registered modes and {','.join(VARIANTS)}")
    p.add_argument("--trace", action="store_true", help="add a profiler summary of one queued replay per mode")
    p.add_argument("--out")
    ns = p.parse_args()
    args = cli.parse_args(["--workload", "llama", "--tokens", str(ns.tokens), "--attn", ns.attn, "--ladder-max", "0"])
    device = torch.device("cuda")
    model = llama.setup(args, device)
    case = llama.make_case(model, args, device, ns.attn, ns.tokens)
    layers = model.shape["layers"]
    out: dict[str, Any] = {"T": ns.tokens, "attn": ns.attn, "layers": layers, **report.environment()}
    # one breakpoint's host cost, on the first layer's real q, k, v
    cos, sin, q, k, v, o = model.regions.first(*case.static_args, model.cos, model.sin,
                                               model.layers[0].attn_norm, model.layers[0].wqkv)

    def breakpoints() -> None:
        with bcg.live_scope(case.fresh_live()):
            for _ in range(layers):
                case.bp(q, k, v, o)

    out["bp_host_us"] = _median_us(breakpoints, wait=False) / layers
    out["bp_wall_us"] = _median_us(breakpoints, wait=True) / layers
    print(f"one attention breakpoint: host {out['bp_host_us']:.1f} us, alone on the GPU {out['bp_wall_us']:.1f} us",
          flush=True)
    cycles_per_ms = _spin_cycles_per_ms()
    for mode in ns.modes.split(","):
        build = VARIANTS.get(mode) or registry.MODES[mode].build
        try:
            built = build(case, registry.BuildContext())
        except registry.NotApplicable as exc:
            print(f"{mode}: skipped ({exc})")
            continue
        try:
            host = _median_us(built.run, wait=False)
            wall = _median_us(built.run, wait=True)
            spin_ms = max(5.0, 4 * host / 1e3)
            gpu, ahead = _gpu_us(built.run, spin_ms, cycles_per_ms)
            row: dict[str, Any] = {"host_us": host, "wall_us": wall, "gpu_us": gpu, "gpu_queued": ahead,
                                   "wall_us_per_layer": wall / layers, "gpu_us_per_layer": gpu / layers}
            if ns.trace:
                row["trace"] = _trace(built.run, 3 * spin_ms, cycles_per_ms, layers)
        finally:
            built.close()
        out[mode] = row
        print(f"{mode:24} host {host:8.1f} us  wall {wall:8.1f} us  gpu {gpu:8.1f} us{'' if ahead else ' (not queued)'}"
              f"  per layer: wall {wall / layers:6.1f} gpu {gpu / layers:6.1f}", flush=True)
        if ns.trace:
            t = row["trace"]
            print(f"    trace per layer: span {t['span_us_per_layer']:.1f}  busy "
                  + " ".join(f"{k}={v:.1f}" for k, v in t["busy_us_per_layer"].items())
                  + "  ops " + " ".join(f"{k}={v:.1f}" for k, v in t["ops_per_layer"].items())
                  + "  gaps " + " ".join(f"{k}={v:.1f}" for k, v in t["gap_us_per_layer"].items()), flush=True)
            for name, us in t["eager_kernel_us_per_layer"].items():
                print(f"      eager {us:7.1f} us  {name}")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
