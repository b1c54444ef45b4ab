"""Where a staged runner call's host time goes: the runner with ``prepare`` after the launch (gated,
launched first) and with it first, beside the floor. Wraps the runner's pieces (``_call``,
``graph.replay``, the executor's launch, the stager's steps, the workload's ``prepare``,
``StagingBuffer.write``) with timers and prints each one's inclusive host us, the median of 60 whole
calls, with the GPU busy behind a 20 ms spin kernel and then idle before each call. The timers add
about 0.3 us each. A diagnostic that reaches into the runner's private state; not a bench row.

Run on a GPU: ``python benchmarks/host_split.py T [flash|varlen]`` (``results/2026-12-01-h200-2eef6d3.log``).
"""
import statistics, sys, time
import torch
import bcg
from bcg import staging
from bcg.bench import cli, modes, registry
from bcg.bench.workloads import llama
ns = time.perf_counter_ns
T = int(sys.argv[1]); attn = sys.argv[2] if len(sys.argv) > 2 else "flash"
base = ["--workload", "llama", "--tokens", str(T), "--attn", attn, "--ladder-max", "0"]
dev = torch.device("cuda")
args = cli.parse_args(base)
model = llama.setup(args, dev)
ctx = registry.BuildContext()
cases = [llama.make_case(model, args, dev, attn, T), llama.make_case(model, cli.parse_args(base + ["--no-prepare-after-launch"]), dev, attn, T)]  # kept: graphs read their inputs
fl = modes._floor(cases[0], ctx, compiled=False)
gated = modes._bcg_staged(cases[0], ctx, compiled=False)
first = modes._bcg_staged(cases[1], ctx, compiled=False)
for _ in range(5): fl.run(); gated.run(); first.run()
torch.cuda.synchronize()
staging.PREPARE_FIRST_REPLAYS = 0
rec_all = {}
def wrap(obj, name, rec, key):
    f = getattr(obj, name)
    def w(*a, _f=f, _r=rec.setdefault(key, []), **k):
        t0 = ns(); r = _f(*a, **k); _r.append((ns() - t0) / 1e3); return r
    setattr(obj, name, w)
orig_write = staging.StagingBuffer.write
for label, built in (("gated", gated), ("first", first)):
    runner = [c.cell_contents for c in built.run.__closure__ if isinstance(c.cell_contents, bcg.GraphRunner)][0]
    rec = rec_all[label] = {}
    wrap(runner, "_checked_call", rec, "runner._checked_call")
    wrap(runner, "_call", rec, "runner._call")
    for form in [*runner.tiers(T), runner.graph(T)]:
        st = form._parts.stager
        wrap(form, "replay", rec, "graph.replay")
        wrap(form._executor, "run", rec, "executor.run")
        for n in ("misfit", "launch_first_now", "before_launch", "prepare_launched", "prepare", "_open_gates"):
            wrap(st, n, rec, "stager." + n)
        st._prepares[:] = [(lambda p: (lambda live, _p=p, _r=rec.setdefault("workload prepare", []): (lambda t0: (_p(live), _r.append((ns() - t0) / 1e3))[0])(ns())))(p) for p in st._prepares]
    print(label, "tiers", len(runner.tiers(T)), "stager gated", [len(f._parts.stager._gated) for f in [*runner.tiers(T), runner.graph(T)]])
writes = []
def timed_write(self, values, _w=orig_write):
    t0 = ns(); _w(self, values); writes.append((ns() - t0) / 1e3)
staging.StagingBuffer.write = timed_write
for cond in ("busy", "idle"):
    for label, built in (("gated", gated), ("first", first), ("floor", fl)):
        for v in rec_all.get(label, {}).values(): v.clear()
        writes.clear(); calls = []
        for _ in range(60):
            torch.cuda.synchronize()
            if cond == "busy": torch.cuda._sleep(20_000_000)
            t0 = ns(); built.run(); calls.append((ns() - t0) / 1e3)
        torch.cuda.synchronize()
        parts = {k: round(statistics.median(v), 2) for k, v in rec_all.get(label, {}).items() if v}
        print(f"T={T} {label} GPU {cond}: call {statistics.median(calls):.1f}", parts, "write", round(statistics.median(writes), 2) if writes else None, flush=True)
