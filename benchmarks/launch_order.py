"""The host time of a whole forward's launch, and what it does to ``prepare_after_launch``: the floor's
``replay()`` host us with the GPU idle, behind a 30 ms spin kernel and behind a 0.3 ms one; for the
staged runner with ``prepare`` after the launch (gated copies) and with it first (no gates): the
whole call's, its executor's launch and its ``prepare_launched`` host us, GPU idle or busy; then
whole calls of the floor and both runners interleaved one by one (to completion), three rounds of
60, with their paired ratios to the floor; last, host us with the GPU idle, the three interleaved
call by call (the host's drift shared), and their median paired differences to the floor's. A
diagnostic that reaches into the runner's private state (it wraps each form's executor); not a
bench row.

Run on a GPU: ``python benchmarks/launch_order.py T [flash|varlen]`` (one T per process).
"""
import statistics, sys, time
import torch
import bcg
from bcg.bench import cli, modes, registry
from bcg.bench.workloads import llama

def med(x): return round(statistics.median(x), 1) if x else None
ns = time.perf_counter_ns
T = int(sys.argv[1]); attn = sys.argv[2] if len(sys.argv) > 2 else "flash"
base = ["--workload", "llama", "--tokens", str(T), "--attn", attn, "--ladder-max", "0"]
args = cli.parse_args(base)
dev = torch.device("cuda")
model = llama.setup(args, dev)
case = llama.make_case(model, args, dev, attn, T)
ctx = registry.BuildContext()
fl = modes._floor(case, ctx, compiled=False)
gated = modes._bcg_staged(case, ctx, compiled=False)
case2 = llama.make_case(model, cli.parse_args(base + ["--no-prepare-after-launch"]), dev, attn, T)
first = modes._bcg_staged(case2, ctx, compiled=False)
for _ in range(5): fl.run(); gated.run(); first.run()
torch.cuda.synchronize()
recs = {}
wrapped = []  # (object, method name) wrapped with a timer below; unwrapped for the interleaved host us
for label, built in (("after launch", gated), ("prepare first", first)):
    runner = [c.cell_contents for c in built.run.__closure__ if isinstance(c.cell_contents, bcg.GraphRunner)][0]
    rec = recs[label] = {"run": [], "prepare_launched": []}
    for form in [*runner.tiers(T), runner.graph(T)]:
        for obj, name in ((form._executor, "run"), (form._parts.stager, "prepare_launched")):
            f = getattr(obj, name)
            def w(*a, _f=f, _r=rec[name], **k):
                t0 = ns(); r = _f(*a, **k); _r.append((ns() - t0) / 1e3); return r
            setattr(obj, name, w)
            wrapped.append((obj, name))
print(f"T={T} {attn}: nodes per launch: floor ops as in kernel_diff; forms {[s.nodes for s in runner.graph(T).segments]}")
idle, busy, short = [], [], []
for _ in range(30):
    torch.cuda.synchronize(); t0 = ns(); fl.run(); idle.append((ns() - t0) / 1e3)
    torch.cuda.synchronize(); torch.cuda._sleep(30_000_000); t0 = ns(); fl.run(); busy.append((ns() - t0) / 1e3)
    torch.cuda.synchronize(); torch.cuda._sleep(300_000); t0 = ns(); fl.run(); short.append((ns() - t0) / 1e3)
torch.cuda.synchronize()
print(f"T={T}: floor replay host us: GPU idle {med(idle)} (max {max(idle):.0f}), behind 30 ms spin {med(busy)}, behind 0.3 ms spin {med(short)}", flush=True)
for label, built in (("after launch", gated), ("prepare first", first)):
    rec = recs[label]
    for cond in ("idle", "busy"):
        for k in rec: rec[k].clear()
        calls = []
        for _ in range(30):
            torch.cuda.synchronize()
            if cond == "busy": torch.cuda._sleep(30_000_000)
            t0 = ns(); built.run(); calls.append((ns() - t0) / 1e3)
        torch.cuda.synchronize()
        print(f"T={T}: staged {label}, GPU {cond}: call {med(calls)}, executor.run {med(rec['run'])}, prepare_launched {med(rec['prepare_launched'])}", flush=True)
for r in range(3):
    wall = {"floor": [], "after launch": [], "prepare first": []}
    for _ in range(60):
        for k, fn in (("floor", fl.run), ("after launch", gated.run), ("prepare first", first.run)):
            torch.cuda.synchronize(); t0 = ns(); fn(); torch.cuda.synchronize(); wall[k].append((ns() - t0) / 1e3)
    print(f"T={T} round {r}: wall us", {k: med(v) for k, v in wall.items()}, "ratio to floor",
          {k: round(statistics.median([a / b for a, b in zip(v, wall['floor'])]), 4) for k, v in wall.items() if k != "floor"}, flush=True)
for obj, name in wrapped:
    delattr(obj, name)  # the timers off: the class's method again
# Host us, the GPU idle before each call, the three forms interleaved call by call (the host's drift shared).
host = {"floor": [], "after launch": [], "prepare first": []}
for _ in range(300):
    for k, fn in (("floor", fl.run), ("after launch", gated.run), ("prepare first", first.run)):
        torch.cuda.synchronize(); t0 = ns(); fn(); host[k].append((ns() - t0) / 1e3)
torch.cuda.synchronize()
print(f"T={T}: host us interleaved (GPU idle, 300 each, median):", {k: med(v) for k, v in host.items()},
      "median paired difference to the floor:", {k: med([a - b for a, b in zip(v, host["floor"])]) for k, v in host.items() if k != "floor"}, flush=True)
