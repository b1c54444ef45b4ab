"""Which kernels make a staged replay's GPU time differ from the floor's: one queued replay of each
of ``floor``, a bare staged graph and the staged runner under the profiler (behind a spin kernel, so
the host is ahead), summed per kernel name; prints span, busy time and the largest differences.

Run on a GPU: ``python benchmarks/kernel_diff.py 128 flash [compile] [slots=4]`` (T, then ``flash``
or ``varlen``; ``compile``: over the compiled regions, against the compiled floor; ``slots=K``:
the staged workload's ``--slots``).
"""
import collections
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile
from bcg.bench import cli, modes, registry
from bcg.bench.workloads import llama

T = int(sys.argv[1]); attn = sys.argv[2]
compiled = "compile" in sys.argv[3:]
slots = [a.split("=")[1] for a in sys.argv[3:] if a.startswith("slots=")]
args = cli.parse_args(["--workload", "llama", "--tokens", str(T), "--attn", attn, "--ladder-max", "0",
                       *(["--slots", slots[0]] if slots else [])])
dev = torch.device("cuda")
model = llama.setup(args, dev)
case = llama.make_case(model, args, dev, attn, T)
ctx = registry.BuildContext()
built = {"floor": modes._floor(case, ctx, compiled=compiled),
         "staged-graph": modes._bcg_graph(case.staged, ctx, None, compiled=compiled),
         "staged": modes._bcg_staged(case, ctx, compiled=compiled)}
print(f"T={T} {attn} compiled={compiled} slots={args.slots} tiers={llama.tiers_of(args)}")

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

res = {k: prof(b.run) for k, b in built.items()}
for k, (span, busy, n, _, ends) in res.items():
    print(f"{k:14s} span {span:8.1f} busy {busy:8.1f} ops {n}  first/last {ends}")
names = set().union(*(r[3].keys() for r in res.values()))
rows = []
for nm in names:
    f = res["floor"][3].get(nm, [0, 0.0]); s = res["staged-graph"][3].get(nm, [0, 0.0]); r = res["staged"][3].get(nm, [0, 0.0])
    rows.append((r[1] - f[1], nm, f, s, r))  # the runner (its staged tier, if any) against the floor
rows.sort(key=lambda x: -abs(x[0]))
for d, nm, f, s, r in rows[:14]:
    print(f"{d:8.1f}  floor {f[0]:4d} {f[1]:8.1f}  sgraph {s[0]:4d} {s[1]:8.1f}  srunner {r[0]:4d} {r[1]:8.1f}  {nm}")
