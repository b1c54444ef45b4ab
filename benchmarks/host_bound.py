"""Is a llama replay host-bound? Host time to issue a replay vs the GPU's time to run it.

For each mode (floor, bcg-graph, bcg, ...) at one T, times the replay call
alone (``host``: until it returns, no synchronize) and the full replay
(``wall``: until the GPU is done), and one attention breakpoint's host time
(``bp_host_us``: the eager call with its live metadata, not synchronized) next
to the floor's GPU time per layer. When the breakpoints' host time per layer
exceeds the GPU time of a layer, the GPU waits for the host at every break and
no replay engine can reach the floor. Run on a GPU:
``python benchmarks/host_bound.py --tokens 128 [--out FILE.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any, Callable

import torch

import bcg
from bcg.bench import cli, modes
from bcg.bench.timing import sample_ms
from bcg.bench.workloads import llama


def _median_us(fn: Callable[[], Any], wait: bool, iters: int = 30) -> float:
    return statistics.median(sample_ms(fn, torch.cuda.synchronize, iters, warmup=3, wait=wait)) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--modes", default="floor,bcg-graph,bcg,floor-compile,bcg-compile")
    p.add_argument("--out")
    ns = p.parse_args()
    args = cli.parse_args(["--workload", "llama", "--tokens", str(ns.tokens), "--attn", "varlen", "--ladder-max", "0"])
    device = torch.device("cuda")
    model = llama.setup(args, device)
    case = llama.make_case(model, args, device, "varlen", ns.tokens)
    layers = model.shape["layers"]
    out: dict[str, Any] = {"T": ns.tokens, "layers": layers, "gpu": torch.cuda.get_device_name(),
                           "torch": torch.__version__}
    # one breakpoint's host cost, on the first layer's real q, k, v
    cos, sin, q, k, v, o = model.regions.first(*case.static_args, model.cos, model.sin,
                                               model.layers[0].attn_norm, model.layers[0].wqkv)

    def breakpoints() -> None:
        with bcg.live_scope(case.fresh_live()):
            for _ in range(layers):
                llama.attention_varlen(q, k, v, o)

    out["bp_host_us"] = _median_us(breakpoints, wait=False) / layers
    out["bp_wall_us"] = _median_us(breakpoints, wait=True) / layers
    print(f"one attention breakpoint: host {out['bp_host_us']:.1f} us, alone on the GPU {out['bp_wall_us']:.1f} us",
          flush=True)
    for mode in ns.modes.split(","):
        try:
            built = modes.MODES[mode].build(case, modes.BuildContext())
        except modes.NotApplicable as exc:
            print(f"{mode}: skipped ({exc})")
            continue
        try:
            host = _median_us(built.run, wait=False)
            wall = _median_us(built.run, wait=True)
        finally:
            built.close()
        out[mode] = {"host_us": host, "wall_us": wall, "wall_us_per_layer": wall / layers}
        print(f"{mode:14} host {host:9.1f} us  wall {wall:9.1f} us  ({wall / layers:6.1f} us per layer)", flush=True)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
