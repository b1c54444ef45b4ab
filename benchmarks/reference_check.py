"""Why our llama floor/eager differ from the issue's reference figures: kernel fusion.

Times, at T=128 with 4 requests (8B shape, varlen attention frozen), the bench's
llama forward (fused QKV and gate/up GEMMs, F.rms_norm) against an unfused
variant of the same weights (separate Q/K/V and gate/up GEMMs, RMSNorm written
out in float32), each eagerly and as one torch.cuda.CUDAGraph (the floor).
Usage (GPU): python benchmarks/reference_check.py
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from bcg.bench.timing import sample_ms
from bcg.bench.workloads import llama


def unfused_forward(model: llama.LlamaModel, x: torch.Tensor, pos: torch.Tensor, attn) -> torch.Tensor:  # noqa: ANN001
    T = x.shape[0]
    H, KV, D = model.H, model.KV, model.D
    cos, sin = model.cos[pos].unsqueeze(1), model.sin[pos].unsqueeze(1)

    def rms(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        tf = t.float()
        return (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + llama.NORM_EPS)).to(t.dtype) * w

    for layer in model.layers:
        y = rms(x, layer.attn_norm)
        wq, wk, wv = layer.wqkv.split([H * D, KV * D, KV * D], dim=0)
        q = llama._rope(F.linear(y, wq).view(T, H, D), cos, sin)
        k = llama._rope(F.linear(y, wk).view(T, KV, D), cos, sin)
        v = F.linear(y, wv).view(T, KV, D)
        o = torch.empty_like(q)
        attn(q, k, v, o)
        x = x + F.linear(o.view(T, H * D), layer.wo)
        y = rms(x, layer.ffn_norm)
        wg, wu = layer.w_gate_up.chunk(2, dim=0)
        x = x + F.linear(F.silu(F.linear(y, wg)) * F.linear(y, wu), layer.w_down)
    return x


def median_ms(fn, iters: int = 30) -> float:  # noqa: ANN001
    return statistics.median(sample_ms(fn, torch.cuda.synchronize, iters, warmup=3))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=4)
    args = p.parse_args()
    device = torch.device("cuda")
    shape = dict(llama.SHAPES["8b"], head_dim=128)
    model = llama.LlamaModel(shape, device, max_pos=args.tokens)
    lengths = tuple(llama.request_lengths(args.tokens, args.requests, 0))
    attn = llama.frozen_attention("varlen", lengths, device)
    x = torch.randn(args.tokens, model.hidden, device=device, dtype=model.dtype)
    pos = torch.cat([torch.arange(n, device=device) for n in lengths])
    for name, fwd in (("fused (bench)", model.forward), ("unfused", lambda *a: unfused_forward(model, *a))):
        eager = median_ms(lambda: fwd(x, pos, attn))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fwd(x, pos, attn)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            fwd(x, pos, attn)
        floor = median_ms(g.replay)
        g.reset()
        print(f"{name:14} T={args.tokens}: eager {eager:7.2f} ms   floor (one graph) {floor:6.2f} ms", flush=True)


if __name__ == "__main__":
    main()
