"""What switching the runner's zeroing off saves, and what the runner's per-call CUDA calls cost.

A probe graph of 32 layers (bf16 [128, 4096] GEMM + SiLU), with and without a masked_fill_ per
layer recorded as a node group: its GPU time with the group enabled and disabled
(cudaGraphNodeSetEnabled), the host cost of switching, and host us of single calls (copy_,
cudaMemcpyAsync, fill_, cuMemsetD32Async, launches). Run on a GPU: ``python benchmarks/switch_cost.py``.
"""
import statistics, time, torch
from cuda.bindings import runtime as rt, driver as drv

def ck(r):
    err = r[0] if isinstance(r, tuple) else r
    assert int(err) == 0, r
    return r[1:] if isinstance(r, tuple) and len(r) > 1 else None

dev = torch.device("cuda")
T, H = 128, 4096
L = 32
w = torch.randn(H, H, device=dev, dtype=torch.bfloat16) * 0.01
x0 = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
ar = torch.arange(T, device=dev)
tdev = torch.zeros((), dtype=torch.int32, device=dev)
mask = torch.zeros(T, dtype=torch.bool, device=dev)
s = torch.cuda.Stream()

def body(zero, cap=False):
    x = x0
    torch.ge(ar, tdev, out=mask)
    nodes = []
    for _ in range(L):
        x = x @ w
        x = torch.nn.functional.silu(x)
        if zero and not cap:
            x.masked_fill_(mask.view(T, 1), 0)
        if zero and cap:
            before = set(int(n) for n in graph_nodes(s))
            x.masked_fill_(mask.view(T, 1), 0)
            after = graph_nodes(s)
            nodes += [n for n in after if int(n) not in before]
    return x, nodes

def graph_nodes(stream):
    st, cid, g, deps, *_ = ck(rt.cudaStreamGetCaptureInfo(stream.cuda_stream))
    _, n = ck(rt.cudaGraphGetNodes(g, 0))
    ns, n2 = ck(rt.cudaGraphGetNodes(g, n))
    return list(ns)[:n]

def capture(zero):
    for _ in range(2):
        with torch.cuda.stream(s):
            body(zero)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.stream(s):
        g.capture_begin()
        out, nodes = body(zero, True)
        g.capture_end()
    g.instantiate()
    g.replay(); torch.cuda.synchronize()
    return g, out, nodes

g0, _, _ = capture(False)
g1, _, nodes = capture(True)
print("zero nodes", len(nodes))
exe = g1.raw_cuda_graph_exec()
types = set()
for n in nodes:
    t = ck(rt.cudaGraphNodeGetType(n))[0]
    types.add(str(t))
print("types", types)

def gpu_us(g, n=200):
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10): g.replay()
    torch.cuda.synchronize()
    res = []
    for _ in range(5):
        e0.record()
        for _ in range(n): g.replay()
        e1.record(); torch.cuda.synchronize()
        res.append(e0.elapsed_time(e1) * 1e3 / n)
    return round(min(res), 2)

def set_enabled(on):
    for n in nodes:
        ck(rt.cudaGraphNodeSetEnabled(exe, n, 1 if on else 0))

for rnd in range(2):
    print("no zero", gpu_us(g0))
    set_enabled(True); print("zero enabled", gpu_us(g1))
    set_enabled(False); print("zero disabled", gpu_us(g1))
# host cost of toggling
t0 = time.perf_counter(); 
for _ in range(50): set_enabled(True); set_enabled(False)
print("setenabled per node us", (time.perf_counter() - t0) * 1e6 / (100 * len(nodes)))

# host costs
cur = torch.cuda.current_stream().cuda_stream
a = torch.empty(T, dtype=torch.long, device=dev); b = torch.randint(0, 100, (T,), device=dev)
def med(fn, n=200):
    r = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); r.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return round(statistics.median(r) * 1e6, 2)
nb = a.numel() * a.element_size()
D2D = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
print("torch copy_", med(lambda: a.copy_(b)))
print("torch narrow+copy_", med(lambda: a.narrow(0, 0, T).copy_(b)))
print("rt memcpyAsync", med(lambda: rt.cudaMemcpyAsync(a.data_ptr(), b.data_ptr(), nb, D2D, cur)))
print("drv cuMemcpyDtoDAsync", med(lambda: drv.cuMemcpyDtoDAsync(a.data_ptr(), b.data_ptr(), nb, cur)))
print("torch fill_", med(lambda: tdev.fill_(77)))
p = tdev.data_ptr()
print("drv cuMemsetD32Async", med(lambda: drv.cuMemsetD32Async(p, 77, 1, cur)))
torch.cuda.synchronize(); print("memset value", tdev.item())
print("data_ptr", med(lambda: b.data_ptr()))
print("narrow", med(lambda: b.narrow(0, 0, 100)))
print("current_stream", med(lambda: torch.cuda.current_stream().cuda_stream))
print("torch._C._cuda_getCurrentRawStream", med(lambda: torch._C._cuda_getCurrentRawStream(0)))
print("g.replay", med(lambda: g1.replay()))
print("cudaGraphLaunch", med(lambda: rt.cudaGraphLaunch(exe, cur)))
print("cuGraphLaunch", med(lambda: drv.cuGraphLaunch(exe, cur)))
