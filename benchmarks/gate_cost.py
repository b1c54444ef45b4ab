"""What one staged copy costs a graph launch, in each of its captured forms: host us of the launch
(``CUDAGraph.replay`` behind a 0.3 ms spin kernel, so the GPU is busy and the launch never waits)
and GPU us (events around the replay, gates opened before it), per copy, as the median of paired
differences to the same graph without copies. Each graph is N small kernels (``add_``) with K copies
of 9 int32 (a ``cu_seqlens`` of 8 slots) spread through it, each with its own buffer and gate.

Forms: ``copy`` (a ``cudaMemcpyAsync`` node), ``memop gate`` (arrival write, wait, copy, write: the
stream memory operations bcg falls back to), ``gate kernel`` (``bcg.gate``'s kernel: what bcg captures).
Last, larger values (4 KiB to 1 MiB): one gated copy (``bcg.gate.capture``: one kernel up to 64 KiB,
else a copy node between two kernels) against one ``cudaMemcpyAsync``, each launched eagerly on an
open gate (not in a graph: the GPU times include each launch's latency).

Run on a GPU: ``python benchmarks/gate_cost.py [N] [K] [rounds]``.
"""
import statistics, sys, time
import torch
from bcg import cudart, gate

N = int(sys.argv[1]) if len(sys.argv) > 1 else 600
K = int(sys.argv[2]) if len(sys.argv) > 2 else 16
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 150
VALUES = 9
ns = time.perf_counter_ns
x = torch.zeros(1024, device="cuda")
kernel = gate.kernel(torch.cuda.current_device())
assert kernel is not None, "the gate kernel does not build here (see the bcg warning)"


class Copy:
    """One staged copy's memory: pinned values and flags, a device buffer."""

    def __init__(self, k: int) -> None:
        self.src = torch.arange(VALUES, dtype=torch.int32).add_(100 * k).pin_memory()
        self.dst = torch.zeros(VALUES, dtype=torch.int32, device="cuda")
        self.flags = torch.zeros(2, dtype=torch.int32).pin_memory()
        self.gate = cudart.host_device_pointer(self.flags.data_ptr())
        self.src_address = cudart.host_device_pointer(self.src.data_ptr())

    def capture(self, form: str, stream: int) -> None:
        nbytes = VALUES * 4
        if form == "copy":
            cudart.copy_host_to_device(self.dst.data_ptr(), self.src.data_ptr(), nbytes, stream)
        elif form == "memop gate":
            cudart.write_value32(stream, self.gate + 4, 1)
            cudart.wait_value32(stream, self.gate, 1)
            cudart.copy_host_to_device(self.dst.data_ptr(), self.src.data_ptr(), nbytes, stream)
            cudart.write_value32(stream, self.gate, 0)
        elif form == "gate kernel":
            gate.capture(kernel, stream, self.gate, self.src.data_ptr(), self.src_address, self.dst.data_ptr(), nbytes)


copies = [Copy(k) for k in range(K)]
FORMS = ("none", "copy", "memop gate", "gate kernel")
GATED = {"memop gate", "gate kernel"}


def open_gates() -> None:
    for c in copies:
        c.flags[0] = 1


graphs = {}
for form in FORMS:
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(g, stream=s):
        stream = torch.cuda.current_stream().cuda_stream
        for i in range(N):
            if i % (N // K) == 0 and i // (N // K) < K:
                copies[i // (N // K)].capture(form, stream)
            x.add_(1)
    open_gates()
    g.replay()
    torch.cuda.synchronize()
    graphs[form] = g

host = {f: [] for f in FORMS}
gpu = {f: [] for f in FORMS}
for _ in range(ROUNDS):
    for form, g in graphs.items():  # interleaved
        for c in copies:
            c.dst.zero_()
            c.flags[1] = 0
        torch.cuda.synchronize()
        torch.cuda._sleep(300_000)
        t0 = ns(); g.replay(); host[form].append((ns() - t0) / 1e3)
        if form in GATED:
            open_gates()  # after the launch, as prepare_after_launch does
        torch.cuda.synchronize()
        if form != "none":
            assert all(torch.equal(c.dst.cpu(), c.src) for c in copies), form
        if form in GATED:
            assert all(c.flags.tolist() == [0, 1] for c in copies), form
            open_gates()  # before: the GPU time of the copies, not of the wait
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); g.replay(); end.record(); end.synchronize()
        gpu[form].append(start.elapsed_time(end) * 1e3)
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {N} kernels, {K} copies of {VALUES} int32, "
      f"{ROUNDS} rounds; the graph without copies: launch {statistics.median(host['none']):.1f} us host, "
      f"{statistics.median(gpu['none']):.1f} us GPU")
for form in FORMS[1:]:
    dh = statistics.median(a - b for a, b in zip(host[form], host["none"])) / K
    dg = statistics.median(a - b for a, b in zip(gpu[form], gpu["none"])) / K
    print(f"  {form:12s} per copy: launch host +{dh:.2f} us, GPU +{dg:.2f} us")

# -- large values: the gated copy (one kernel up to gate.KERNEL_COPY_MAX, else a copy node between
# two kernels) against a plain cudaMemcpyAsync, GPU us of one copy launched on an open gate
stream = torch.cuda.current_stream().cuda_stream
for nbytes in (4096, gate.KERNEL_COPY_MAX, gate.KERNEL_COPY_MAX + 16, 1 << 20):
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).pin_memory()
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    flags = torch.zeros(2, dtype=torch.int32).pin_memory()
    gated, plain = [], []
    for _ in range(50):
        for form, out in (("gated", gated), ("plain", plain)):
            torch.cuda.synchronize()
            flags[:] = torch.tensor([int(form == "gated"), 0], dtype=torch.int32)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if form == "gated":
                gate.capture(kernel, stream, cudart.host_device_pointer(flags.data_ptr()), src.data_ptr(),
                             cudart.host_device_pointer(src.data_ptr()), dst.data_ptr(), nbytes)
            else:
                cudart.copy_host_to_device(dst.data_ptr(), src.data_ptr(), nbytes, stream)
            end.record(); end.synchronize()
            out.append(start.elapsed_time(end) * 1e3)
            assert torch.equal(dst.cpu(), src) and flags.tolist() == ([0, 1] if form == "gated" else [0, 0])
            dst.zero_()
    print(f"  {nbytes:8d} bytes: gated copy {statistics.median(gated):7.1f} us GPU, cudaMemcpyAsync {statistics.median(plain):7.1f}")
