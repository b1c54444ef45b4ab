"""Probe (not used by bcg): can a captured graph wait on a host-written flag, so that a staged replay
is launched before its metadata is written and ``prepare`` runs while the GPU does the work before the
first attention? One ``torch.cuda.graph``: 21 matmuls, ``cuStreamWaitValue32`` on a pinned int32 flag,
the metadata's H2D copy, ``cuStreamWriteValue32`` resetting the flag, a kernel reading the metadata.
Checks that the wait and write are captured, that 50 replays whose metadata is written after the
launch read it right, that the GPU does wait for the flag, and times both orders.
Run on a GPU: ``python benchmarks/gate_probe.py`` (torch and cuda-python only).
"""
import statistics
import time

import numpy as np
import torch
from cuda.bindings import driver as cu

def ok(r):
    err = r[0] if isinstance(r, tuple) else r
    assert err == cu.CUresult.CUDA_SUCCESS, r
    return r[1] if isinstance(r, tuple) and len(r) == 2 else r

torch.cuda.init(); dev = torch.device("cuda")
print("torch", torch.__version__, "driver", ok(cu.cuDriverGetVersion()))
cud = ok(cu.cuDeviceGet(0))
for name in ("CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR", "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS",
             "CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY", "CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING"):
    a = getattr(cu.CUdevice_attribute, name, None)
    print(name, ok(cu.cuDeviceGetAttribute(a, cud)) if a is not None else "n/a")
flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
fnp = flag.numpy()
r = cu.cuMemHostGetDevicePointer(flag.data_ptr(), 0); print("host->device pointer", r[0], hex(int(r[1])) if r[0] == 0 else "", hex(flag.data_ptr()))
dptr = int(r[1]) if r[0] == 0 else flag.data_ptr()
meta_h = torch.zeros(9, dtype=torch.int32, pin_memory=True); mnp = meta_h.numpy()
meta_d = torch.zeros(9, dtype=torch.int32, device=dev)
x = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
s = torch.cuda.Stream()
g = torch.cuda.CUDAGraph()
for _ in range(2):
    with torch.cuda.stream(s): y = x @ x
torch.cuda.synchronize()
try:
    with torch.cuda.graph(g, stream=s):
        y = x @ x
        for _ in range(20): y = y @ x  # ~ pre-attention work
        ok(cu.cuStreamWaitValue32(s.cuda_stream, dptr, 1, cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ))
        meta_d.copy_(meta_h, non_blocking=True)
        ok(cu.cuStreamWriteValue32(s.cuda_stream, dptr, 0, cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT))
        out = meta_d * 2 + y[0, :9].float().sum().int() * 0
    print("captured")
except Exception as exc:
    print("CAPTURE FAILED:", type(exc).__name__, exc); raise SystemExit(0)
bad = 0
for i in range(50):
    vals = np.random.randint(0, 1000, 9).astype(np.int32)
    g.replay()
    mnp[:] = vals; fnp[0] = 1
    torch.cuda.synchronize()
    bad += int(not np.array_equal(out.cpu().numpy(), vals * 2)) + int(fnp[0] != 0)
print("50 replays, metadata written after the launch: mismatches", bad)
# the GPU really waits: without the flag the replay does not finish
g.replay(); time.sleep(0.05); done = torch.cuda.current_stream().query(); mnp[:] = 7; fnp[0] = 1; torch.cuda.synchronize()
print("finished before the flag was set:", done, "(must be False); result", out[:3].tolist())
# timing: launch-then-write vs write-then-launch (GPU idle before each)
def t(first):
    xs = []
    for _ in range(200):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        if first: mnp[:] = 3; fnp[0] = 1; g.replay()
        else: g.replay(); mnp[:] = 3; fnp[0] = 1
        torch.cuda.synchronize(); xs.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(xs)
print("wall us: flag before launch", round(t(True), 1), "after launch", round(t(False), 1))
