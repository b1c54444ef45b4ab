"""Where a staged runner call spends its host time: each piece of ``GraphRunner.__call__`` timed
alone in a loop (us per call, best of 5 loops: warm caches) and right after a whole call with the GPU
idle (cold, as a call starts); the GPU time of one call queued behind a spin kernel (the host ahead)
for the runner, the executable of the tier it picks and the floor; then whole calls of the runner,
the bare graph, its executors and the floor, with the GPU idle before each (cold), host only and to
completion; last, in rounds, the runner's call cut into timed stages (a copy of its path for inputs
from ``input_buffers``, as at this commit), next to the real call, the floor and an ideal runner:
the live metadata, the tiers' ``fits``, ``prepare``, the live value set and one native launch, and
nothing else (the least host time any runner of this design can take). All of this with ``prepare``
before the launch (``--no-prepare-after-launch``: the pieces run forms directly, which a gated form
would not allow); last, whole calls of a second runner whose ``prepare`` runs after the launch
(``prepare_after_launch``, the workload's default), interleaved with the first and the floor.
The staging buffers are made without the gated-copy kernel (``bcg.gate``), so that the prepare-first
form's copies are plain copies, not gated: the pieces run ``prepare`` alone in loops and launch forms
directly, which gates would not allow. A diagnostic that reaches into the runner's private state; not
a bench row.
Run on a GPU: ``python benchmarks/host_path.py [T] [flash|varlen] [compile]`` (``compile``: the
runner over the torch.compile'd regions, against ``floor-compile``).
"""
import operator, statistics, time, sys
import torch
import bcg
from bcg.bench import cli, modes, registry
from bcg.bench.workloads import llama
from bcg.runner.inputs import check_inputs
from bcg.runner.padding import PADDING
from bcg.buckets import pick_bucket
from bcg.replay import stream_readers

T = int(sys.argv[1]) if len(sys.argv) > 1 else 128
attn = sys.argv[2] if len(sys.argv) > 2 else "flash"
compiled = "compile" in sys.argv[3:]
argv = ["--workload", "llama", "--tokens", str(T), "--attn", attn, "--ladder-max", "0"]
args = cli.parse_args(argv + ["--no-prepare-after-launch"])
bcg.gate.kernel = lambda device: None  # plain copies (above); before the model makes its buffers
dev = torch.device("cuda")
model = llama.setup(args, dev)
case = llama.make_case(model, args, dev, attn, T)
built = modes._bcg_staged(case, registry.BuildContext(), compiled=compiled)
st = case.staged
runner = [c.cell_contents for c in built.run.__closure__ if isinstance(c.cell_contents, bcg.GraphRunner)][0]
g = runner.graph(T)
inputs = runner.input_buffers(T)
live = st.fresh_live()
b = runner._buckets[T]
stager = g._parts.stager
sa = stager._prepares[0].__self__  # the workload's StagedAttention
offsets = llama.padded_offsets(live.lengths, sa.slots)
gd, gs = stream_readers()
s_raw = gs(0)

def rep(fn, n=2000):
    out = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        out.append((time.perf_counter_ns() - t0) / n / 1e3)
    return round(min(out), 2)

pieces = {
    "check_inputs": lambda: check_inputs(runner._inputs, inputs, "r"),
    "pick_bucket": lambda: pick_bucket(runner._buckets_list, T),
    "current_device": gd,
    "serialize_streams": lambda: runner._lock.serialize_streams(0),
    "static.write": lambda: runner._static.write(b.views, inputs, T, False, s_raw),
    "set_enabled(noop)": lambda: g.set_enabled(PADDING, False),
    "fresh_live": st.fresh_live,
    "misfit": lambda: stager.misfit(live),
    "prepare": lambda: stager.prepare(live),
    "slice": lambda: runner._slice(b, b.leaves, T, False, True),
    "tier choice": lambda: [t.would_fall_back(live) for t in b.tiers],
    "prepare: event query": sa.cu._read.query,
    "prepare: offsets": lambda: llama.padded_offsets(live.lengths, sa.slots),
    "prepare: host write": lambda: sa.cu.write(offsets),
    "empty call": lambda: None,
    "current_stream": torch.cuda.current_stream,
    "views_safe": runner._lock.views_safe,
}
res = {k: rep(f) for k, f in pieces.items()}
res["set_rows(memset)"] = rep(lambda: runner._sanitizer.set_rows(T, s_raw), 500)
torch.cuda.synchronize()
print("pieces us:", res, flush=True)

def med(fn, n=60, wait=True):
    s = []
    for _ in range(n):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn()
        if wait: torch.cuda.synchronize()
        s.append((time.perf_counter() - t0) * 1e6)
    return round(statistics.median(s), 1)
fl = modes._floor(case, registry.BuildContext(), compiled=compiled)
tier = next((t for t in b.tiers if t.would_fall_back(live) is None), g)  # the graph a call runs
call = lambda: runner(*inputs, live=st.fresh_live())

def cold(piece, n=40):  # us of piece right after a whole call, the GPU idle (as a call starts)
    s = []
    for _ in range(n):
        call(); torch.cuda.synchronize(); t0 = time.perf_counter_ns(); piece(); s.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    return round(statistics.median(s), 2)

print("cold pieces us:", {k: cold(pieces[k]) for k in pieces if k not in ("check_inputs", "static.write")}, flush=True)

def gpu_us(fn, n=20):  # GPU time of one replay queued behind a spin kernel (the host ahead)
    s = []
    for _ in range(n):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000); a.record(); fn(); z.record(); z.synchronize(); s.append(a.elapsed_time(z) * 1e3)
    return round(statistics.median(s), 1)

for r in range(2):
    print("gpu us (host ahead): runner", gpu_us(call), "tier executor", gpu_us(tier._executor.run), "floor", gpu_us(fl.run), flush=True)
for r in range(2):
    print("host-only us: runner", med(lambda: runner(*inputs, live=st.fresh_live()), wait=False),
          "graph.replay", med(lambda: g.replay(live), wait=False),
          "executor.run", med(g._executor.run, wait=False), "tier executor", med(tier._executor.run, wait=False),
          "floor", med(fl.run, wait=False), flush=True)
    print("wall us: runner", med(lambda: runner(*inputs, live=st.fresh_live())), "graph.replay", med(lambda: g.replay(live)),
          "executor.run", med(g._executor.run), "floor", med(fl.run), flush=True)
print("tiers", [t.staged_replays() for t in b.tiers], "main", g.staged_replays())
print("nodes", [s.nodes for s in g.segments], "switchable", [{k: len(v) for k, v in s.switchable.items()} for s in g.segments])

# -- the call in stages, cold (right after a synchronize, the GPU idle), in rounds ------------------
from bcg.breakpoint import _LIVE, set_live, reset_live
from bcg.replay import NativeExecutor

ns = time.perf_counter_ns
for form in (*b.tiers, g):  # the path copied below: native launches; no guards, poison or variants
    assert isinstance(form._executor, NativeExecutor) and form._executor.launches, "run with the native executor"
    assert form._parts.guards is None and form._parts.poison is None and form.variants is None


def staged_call(stamps):  # GraphRunner.__call__ for input_buffers(T) inputs, no ranks: stamps between stages
    t = [ns()]
    lv = st.fresh_live(); t.append(ns())
    with runner._lock.lock:
        handed = runner._handed_ids.get(id(inputs[runner._first_padded]))
        assert all(map(operator.is_, inputs, handed[2]))
        T_, n = handed[0], handed[1]; t.append(ns())
        chosen = runner._buckets[n]
        assert chosen.failure is None and runner._max_padding_ratio is None; t.append(ns())
        graph = chosen.graph
        for tr in chosen.tiers:
            if tr.would_fall_back(lv) is None:
                graph = tr
                break
        else:
            assert graph.would_fall_back(lv) is None  # (the real call would run the breakable form)
        t.append(ns())
        device = gd()
        stream = runner._lock.serialize_streams(device); t.append(ns())
        runner._sanitizer.set_rows(T_, stream); t.append(ns())
        graph.set_enabled(PADDING, T_ < n); t.append(ns())
        assert gd() == graph._parts.device
        graph._parts.stager.prepare(lv); graph._inline_replays += 1; t.append(ns())
        token = set_live(lv); graph._replaying += 1; t.append(ns())
        graph._executor.run(); t.append(ns())
        graph._replaying -= 1; reset_live(token); chosen.replays += 1; runner._real_rows += T_; t.append(ns())  # (and live reset)
        out = runner._slice(chosen, chosen.leaves, T_, not runner._lock.views_safe(), keep=True); t.append(ns())
    stamps.append([(b - a) / 1e3 for a, b in zip(t, t[1:])] + [(t[-1] - t[0]) / 1e3])
    return out


def ideal_runner():  # what any runner of this design must do: metadata, fits, prepare, live, one launch
    forms = tuple((form._parts.stager.misfit, tuple(form._parts.stager._prepares), form._executor._replay)
                  for form in (*b.tiers, g))
    handed_get, lock, out, first_padded = runner._handed_ids.get, runner._lock.lock, b.sliced[T], runner._first_padded

    def call():
        lv = st.fresh_live()
        with lock:
            handed_get(id(inputs[first_padded]))
            for misfit, prepares, launch in forms:
                if misfit(lv) is None:
                    break
            else:
                raise AssertionError("no form fits: the real call would run the breakable form")
            device = gd()
            for prepare in prepares:
                prepare(lv)
            token = _LIVE.set(lv)
            launch(gs(device), device)
            _LIVE.reset(token)
            return out

    return call


stages = ["fresh_live", "lock+handed", "bucket", "tier fits", "device+streams", "set_rows", "set_enabled",
          "prepare", "set_live", "launch (executor.run)", "counters (and live reset)", "slice", "TOTAL"]
ideal = ideal_runner()
for r in range(3):
    stamps, real_us, ideal_us, floor_us = [], [], [], []
    for _ in range(60):
        torch.cuda.synchronize(); staged_call(stamps)
        torch.cuda.synchronize(); t0 = ns(); call(); real_us.append((ns() - t0) / 1e3)
        torch.cuda.synchronize(); t0 = ns(); ideal(); ideal_us.append((ns() - t0) / 1e3)
        torch.cuda.synchronize(); t0 = ns(); fl.run(); floor_us.append((ns() - t0) / 1e3)
    torch.cuda.synchronize()
    print(f"round {r}: call in stages, cold us:",
          {k: round(statistics.median(c), 2) for k, c in zip(stages, zip(*stamps))}, flush=True)
    print(f"round {r}: host-only us: runner call {statistics.median(real_us):.1f}, ideal runner "
          f"{statistics.median(ideal_us):.1f}, floor replay {statistics.median(floor_us):.1f}", flush=True)

# -- prepare after the launch: whole calls of a gated runner, interleaved with the first and the floor --
args_gated = cli.parse_args(argv)
assert llama.after_launch(args_gated)
case_gated = llama.make_case(model, args_gated, dev, attn, T)
built_gated = modes._bcg_staged(case_gated, registry.BuildContext(), compiled=compiled)
runner_gated = [c.cell_contents for c in built_gated.run.__closure__ if isinstance(c.cell_contents, bcg.GraphRunner)][0]
inputs_gated = runner_gated.input_buffers(T)
assert runner_gated.graph(T)._launches_first and all(t._launches_first for t in runner_gated.tiers(T))
call_gated = lambda: runner_gated(*inputs_gated, live=case_gated.staged.fresh_live())
for _ in range(20):
    call_gated()
torch.cuda.synchronize()
for r in range(3):
    host = {"prepare first": [], "after launch": [], "floor": []}
    wall = {k: [] for k in host}
    for _ in range(100):
        for k, fn in (("prepare first", call), ("after launch", call_gated), ("floor", fl.run)):
            torch.cuda.synchronize(); t0 = ns(); fn(); t1 = ns(); torch.cuda.synchronize(); t2 = ns()
            host[k].append((t1 - t0) / 1e3); wall[k].append((t2 - t0) / 1e3)
    print(f"round {r}: host-only us:", {k: round(statistics.median(v), 1) for k, v in host.items()},
          "wall us:", {k: round(statistics.median(v), 1) for k, v in wall.items()},
          "wall ratio to floor:", {k: round(statistics.median([a / b for a, b in zip(v, wall["floor"])]), 4)
                                   for k, v in wall.items() if k != "floor"}, flush=True)
