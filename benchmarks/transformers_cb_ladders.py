"""Bucket ladders for bcg in transformers' continuous batching, side by side in one process.

``benchmarks/transformers_cb.py``'s workload and bcg mode, one model (the same seeded weights) per
ladder, ``enable(model, buckets=ladder)``: every ladder's first run (which captures), then
``--runs`` rounds of one timed run per ladder, the order rotated each round. Reports per ladder
tokens/s paired round by round to the default ladder (a second default, ``default-again``, is
the run's A/A noise), TTFT, the buckets captured, seconds capturing and the steps that ran eagerly
before their bucket was captured, and the step sizes the loop asked for. Writes JSON.

Run on a GPU: ``python benchmarks/transformers_cb_ladders.py --runs 6 --out ladders.json``; the
options of ``transformers_cb.py`` set the workload (``--layers 32 --hidden 4096 --inter 14336``: 8B).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import statistics
from collections.abc import Callable
from typing import Any

import torch

import bcg.integrations.transformers as bcg_transformers
from bcg.runner import default_buckets, geometric_buckets

import transformers_cb as tcb

LADDERS: dict[str, list[int] | Callable[[int], list[int]] | None] = {
    "default": None, "default-again": None,
    # graphs up to the workload's max_batch_tokens (M): doubling from 128 (the default before it
    # ended at FLASH_MAX_BUCKET), quadrupling, or bcg's ladder from 8
    "x2-to-max": lambda M: geometric_buckets(128, M), "x4-to-max": lambda M: geometric_buckets(128, M, ratio=4),
    "from-8": lambda M: default_buckets(M, 8),
    "to-128": [128],  # graphs for decode steps only
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--ladders", default=",".join(LADDERS), help=f"of {', '.join(LADDERS)} (default: all)")
    p.add_argument("--out", default="ladders.json")
    cli, workload = p.parse_known_args()
    # transformers_cb.py's workload: its defaults, or its options given here (--layers 32 ...)
    args = tcb.parser().parse_args([*workload, "--runs", str(cli.runs)])
    ladders = cli.ladders.split(",")
    if ladders[0] != "default" or not set(ladders) <= set(LADDERS):
        p.error(f"--ladders: names of {', '.join(LADDERS)}, the first one 'default' (the others are paired to it)")
    logging.basicConfig(level=logging.WARNING)
    prompts = tcb.seeded_prompts(args)
    modes, steps = [], []
    for name in ladders:
        ladder = LADDERS[name]
        if callable(ladder):
            ladder = ladder(args.max_batch_tokens)
        mode = tcb.Mode("bcg", args, torch.device("cuda"), getattr(torch, args.dtype))
        mode.handle.disable()
        mode.handle = bcg_transformers.enable(mode.model, buckets=ladder, staged=not args.plain)
        mode.name = name
        modes.append(mode)
    forward = modes[0].model.forward

    def counted(*a: Any, **k: Any) -> Any:  # the step sizes (the same for every ladder)
        if k.get("cache") is not None:
            steps.append(k["input_ids"].shape[1])
        return forward(*a, **k)

    modes[0].model.forward = counted
    for mode in modes:
        mode.first = mode.run(prompts, args)
    for k in range(args.runs):
        for mode in modes[k % len(modes):] + modes[: k % len(modes)]:
            mode.timed.append(mode.run(prompts, args))
    timer = tcb.CaptureTimer()
    out: dict[str, Any] = {"step_sizes": sorted(collections.Counter(steps).items()), "ladders": {}}
    for mode in modes:
        r = mode.result(timer)
        r.pop("tokens")
        stats = mode.handle.runner.stats()
        r.update(paired_to_default=[a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(mode.timed, modes[0].timed)],
                 buckets=mode.handle.runner.buckets, captured_buckets=stats["captured_buckets"],
                 eager_before_capture=stats["fallbacks"]["not_captured_yet"],
                 eager_above_ladder=stats["fallbacks"]["too_large"])
        out["ladders"][mode.name] = r
        print(f"{mode.name:>14}: {statistics.median(r['tokens_per_s']):7.0f} tok/s, paired "
              f"{' '.join('%.3f' % x for x in r['paired_to_default'])}; TTFT p50 {r['ttft_p50_s'] * 1e3:.1f} ms; "
              f"graphs {r['captured_buckets']} in {r['capture_s']:.2f} s; eager before capture "
              f"{r['eager_before_capture']}, above the ladder {r['eager_above_ladder']}", flush=True)
    print("step sizes (all runs):", out["step_sizes"])
    with open(cli.out, "w") as f:
        json.dump(out, f, indent=1)
    timer.close()
    for mode in modes:
        mode.close()


if __name__ == "__main__":
    main()
