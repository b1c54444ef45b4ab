"""Where a tensor-parallel staged call loses time against the TP floor (run under torchrun).

Builds the llama workload's TP case and five forms on each rank: the one-graph TP floor; the
staged runner with ``prepare`` after the launch (``after``) and before it (``first``), both with
``RankAgreement(same_inputs=True)``; and the same two without ``ranks=`` (``after0``, ``first0``:
no agreement and no check). Prints, from rank 0: whole calls interleaved in three rounds
(``bcg.bench.timing``: medians and paired ratios to the floor); the GPU time of one call queued
behind a 3M-cycle ``_sleep`` (the host ahead, so no gate waits); host time per call with the GPU
idle; and the host cost of ``RankAgreement.expect_same`` and of a blocking ``max()`` alone.
A diagnostic that builds modes through the bench's private helpers; not a bench row.
Run on two GPUs: ``python -m torch.distributed.run --standalone --nproc-per-node 2
benchmarks/tp_path.py [T] [flash|varlen]``.
"""
import os, statistics, sys, time
import torch, torch.distributed as dist
import bcg
from bcg.bench import cli, modes, registry, timing
from bcg.bench.workloads import llama

T = int(sys.argv[1]) if len(sys.argv) > 1 else 128
attn = sys.argv[2] if len(sys.argv) > 2 else "flash"
local = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(local)
dist.init_process_group("nccl")
rank = dist.get_rank(); dev = torch.device("cuda", local)
base = ["--tp", "2", "--workload", "llama", "--tokens", str(T), "--attn", attn, "--ladder-max", "0"]
args = cli.parse_args(base); args_pf = cli.parse_args(base + ["--no-prepare-after-launch"])
model = llama.setup(args, dev)
ctx = registry.BuildContext(); ctx.ranks = bcg.RankAgreement(same_inputs=True); ctx.capture_error_mode = "thread_local"
case = llama.make_case(model, args, dev, attn, T)
case_pf = llama.make_case(model, args_pf, dev, attn, T)
ctx0 = registry.BuildContext(); ctx0.capture_error_mode = "thread_local"  # no ranks: no agreement, no check
built = {"floor": modes._floor(case, ctx, False), "after": modes._bcg_staged(case, ctx, False),
         "first": modes._bcg_staged(case_pf, ctx, False), "after0": modes._bcg_staged(case, ctx0, False),
         "first0": modes._bcg_staged(case_pf, ctx0, False)}
fns = {k: b.run for k, b in built.items()}
sync = torch.cuda.synchronize
def say(*a):
    if rank: return
    print(f"[rank {rank}]", *a, flush=True)
for rnd in range(3):
    s = timing.sample_interleaved(fns, sync, 100, warmup=2, seed=rnd)
    say(f"round {rnd} wall ms median:", {k: round(statistics.median(v), 4) for k, v in s.items()},
        "paired/floor:", {k: round(timing.paired_ratio(v, s["floor"]), 4) for k, v in s.items() if k != "floor"})
# GPU time with the host ahead (both ranks sleep alike first)
for rnd in range(1):
    gpu = {}
    for k, f in fns.items():
        out = []
        for _ in range(30):
            sync(); torch.cuda._sleep(3_000_000)
            e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
            e0.record(); f(); e1.record(); sync()
            out.append(e0.elapsed_time(e1) * 1e3)
        gpu[k] = round(statistics.median(out), 1)
    say(f"GPU us, host ahead (round {rnd}):", gpu)
    host = {}
    for k, f in fns.items():
        out = timing.sample_ms(f, sync, 40, warmup=3, wait=False)
        host[k] = round(statistics.median(out) * 1e3, 1)
    say(f"host us, GPU idle (round {rnd}):", host)
# the gloo check's cost alone, and a blocking gloo all-reduce
r = ctx.ranks
t = []
for _ in range(200):
    t0 = time.perf_counter(); r.expect_same({"a": 1, "b": 2, "c": 3}); t.append((time.perf_counter() - t0) * 1e6)
r.wait_checks()
t2 = []
for _ in range(200):
    t0 = time.perf_counter(); r.max([1]); t2.append((time.perf_counter() - t0) * 1e6)
say("expect_same us median", round(statistics.median(t), 1), "| blocking gloo max() us median", round(statistics.median(t2), 1))
for b in built.values():
    if b.close: b.close()
dist.destroy_process_group()
