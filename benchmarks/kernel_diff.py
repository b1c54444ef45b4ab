"""Which kernels make a staged replay's GPU time differ from the floor's: queued replays of
``floor``, a second capture of the floor (``floor-again``: the A/A), a bare staged graph and the
staged runner under the profiler (behind a spin kernel, so the host is ahead), summed per kernel
name; prints span and busy time per form (median, min and max over the rounds) and the kernels
whose time differs most between the runner and the floor (medians over the rounds).

Each round profiles one replay of every form, in a fresh random order, so the GPU's clock drift
spreads over the forms alike; ``floor-again`` shows how far two captures of the same work differ.

Run on a GPU: ``python benchmarks/kernel_diff.py 128 flash [compile] [slots=4] [rounds=5]`` (T, then
``flash`` or ``varlen``; ``compile``: over the compiled regions, against the compiled floor;
``slots=K``: the staged workload's ``--slots``; ``rounds=N``, default 1).
"""
import collections
import json
import os
import random
import statistics
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile
from bcg.bench import cli, modes, registry
from bcg.bench.workloads import llama

T = int(sys.argv[1]); attn = sys.argv[2]
compiled = "compile" in sys.argv[3:]
slots = [a.split("=")[1] for a in sys.argv[3:] if a.startswith("slots=")]
rounds = int(([a.split("=")[1] for a in sys.argv[3:] if a.startswith("rounds=")] or ["1"])[0])
args = cli.parse_args(["--workload", "llama", "--tokens", str(T), "--attn", attn, "--ladder-max", "0",
                       *(["--slots", slots[0]] if slots else [])])
dev = torch.device("cuda")
model = llama.setup(args, dev)
case = llama.make_case(model, args, dev, attn, T)
ctx = registry.BuildContext()
built = {"floor": modes._floor(case, ctx, compiled=compiled),
         "floor-again": modes._floor(case, ctx, compiled=compiled),
         "staged-graph": modes._bcg_graph(case.staged, ctx, None, compiled=compiled),
         "staged": modes._bcg_staged(case, ctx, compiled=compiled)}
print(f"T={T} {attn} compiled={compiled} slots={args.slots} tiers={llama.tiers_of(args)} rounds={rounds}")

def prof(fn):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        torch.cuda._sleep(50_000_000)
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.json"); p.export_chrome_trace(path)
        ev = json.load(open(path))["traceEvents"]
    gpu = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    i = max(i for i, e in enumerate(gpu) if "sleep" in e["name"] or "spin" in e["name"])
    gpu = gpu[i + 1:]
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in gpu:
        k = e["name"][:70]; agg[k][0] += 1; agg[k][1] += e["dur"]
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    busy = sum(e["dur"] for e in gpu)
    ends = [(e["name"][:50], round(e["dur"], 1)) for e in gpu[:3] + gpu[-3:]]  # first and last three ops
    return span, busy, len(gpu), agg, ends

runs = collections.defaultdict(list)  # form -> one prof() result per round
order = list(built)
rng = random.Random(0)
for _ in range(rounds):
    rng.shuffle(order)
    for k in order:
        runs[k].append(prof(built[k].run))
med = statistics.median
for k in built:
    spans = [r[0] for r in runs[k]]
    print(f"{k:14s} span {med(spans):8.1f} ({min(spans):.1f}-{max(spans):.1f}) busy {med(r[1] for r in runs[k]):8.1f} "
          f"ops {runs[k][0][2]}  first/last {runs[k][0][4]}")
names = set().union(*(r[3].keys() for rs in runs.values() for r in rs))


def per_kernel(form: str, name: str) -> tuple[int, float]:
    """(calls, median us over the rounds) of kernel ``name`` in ``form``'s replays."""
    got = [r[3].get(name, [0, 0.0]) for r in runs[form]]
    return got[0][0], med(g[1] for g in got)


rows = []
for nm in names:
    f, a, s, r = (per_kernel(form, nm) for form in ("floor", "floor-again", "staged-graph", "staged"))
    rows.append((r[1] - f[1], nm, f, a, s, r))  # the runner (its staged tier, if any) against the floor
rows.sort(key=lambda x: -abs(x[0]))
for d, nm, f, a, s, r in rows[:14]:
    print(f"{d:8.1f}  floor {f[0]:4d} {f[1]:8.1f}  again {a[1]:8.1f}  sgraph {s[0]:4d} {s[1]:8.1f}  "
          f"srunner {r[0]:4d} {r[1]:8.1f}  {nm}")
