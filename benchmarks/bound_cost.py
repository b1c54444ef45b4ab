"""GPU cost of the flash kernel's ``max_seqlen`` bound and empty (zero-length) request slots: ATen's
``_flash_attention_forward`` at the 8B llama's attention shape (32 heads, 8 KV heads, head dim 128),
32 calls captured in one graph, median us per call over 30 replays, for the bench's request lengths
at T = 128, 512, 2048, with exact and upper bounds and 4 or 8 slots; ``equal`` says the output is
bit-identical to the first (exact) form's.

Run on a GPU: ``python benchmarks/bound_cost.py``.
"""
import itertools, torch
from torch.ops import aten
H, KV, D = 32, 8, 128
F = aten._flash_attention_forward.default
def run(T, lengths, slots, bound, reps=30):
    g0 = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g0)
    k = torch.randn(T, KV, D, device="cuda", dtype=torch.bfloat16, generator=g0)
    v = torch.randn(T, KV, D, device="cuda", dtype=torch.bfloat16, generator=g0)
    off = list(itertools.accumulate(lengths, initial=0)); off += [off[-1]] * (slots - len(lengths))
    cu = torch.tensor(off, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3): F(q, k, v, cu, cu, bound, bound, 0.0, True, False)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(32): o = F(q, k, v, cu, cu, bound, bound, 0.0, True, False)[0]
    for _ in range(3): g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1000 / 32)
    ts.sort()
    return ts[len(ts) // 2], o
for T, lengths in ((128, [38, 5, 68, 17]), (512, [278, 71, 73, 90]), (2048, [630, 251, 1038, 129])):
    m = max(lengths)
    cases = [(4, m), (4, -(-m // 128) * 128), (4, T), (8, T), (8, m)]
    if T == 512: cases += [(4, 384), (4, 385)]
    base = None
    for slots, bound in cases:
        us, o = run(T, lengths, slots, bound)
        if base is None: base, ref = us, o
        print(f"T={T} slots={slots} bound={bound:5d}: {us:7.2f} us/call ({us - base:+.2f}) equal={torch.equal(o, ref)}", flush=True)
