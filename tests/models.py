"""A small Llama-style decoder used by the tests, with attention as a breakpoint.

Attention reads the request lengths from ``bcg.live()`` and writes its result
in place into a preallocated ``out`` argument (``varlen``) or returns it
(``returning``), so both bridge styles are exercised.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import bcg


def _varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Causal attention per request; q [T, H, D], k/v [T, Hkv, D]; rows past sum(lengths) are not written."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    n = sum(lengths)
    if q.is_cuda and _varlen_available():
        from torch.nn.attention.varlen import varlen_attn

        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).to(q.device, non_blocking=True)
        m = max(lengths)
        return varlen_attn(q[:n], k[:n], v[:n], cu, cu, m, m, window_size=(-1, 0))
    outs = []
    start = 0
    for length in lengths:
        sl = slice(start, start + length)
        o = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1), is_causal=True
        )
        outs.append(o.transpose(0, 1))
        start += length
    return torch.cat(outs)


@bcg.breakpoint(mutates=("out",))
def attention_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    lengths = bcg.live()["lengths"]
    n = sum(lengths)
    out[:n].copy_(_attend(q, k, v, lengths))


def attention_into_unmarked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """The same attention, *not* marked as a breakpoint, and capturable (a per-request SDPA
    loop with Python slicing): captured, it silently replays the capture-time lengths. A plain
    ``bcg.live()`` here makes the capture raise; this one claims, wrongly, that the lengths are
    static (``static_ok=True``), which only ``bcg.verify`` can catch."""
    lengths = bcg.live(static_ok=True)["lengths"]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    start = 0
    for length in lengths:
        sl = slice(start, start + length)
        o = F.scaled_dot_product_attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1), is_causal=True)
        out[sl].copy_(o.transpose(0, 1))
        start += length


@bcg.breakpoint
def attention_returning(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    lengths = bcg.live()["lengths"]
    out = torch.zeros_like(q)
    out[: sum(lengths)] = _attend(q, k, v, lengths)
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class TinyLlama(torch.nn.Module):
    """``layers`` decoder layers: RMSNorm, QKV, RoPE, attention (breakpoint), O, RMSNorm, SwiGLU."""

    def __init__(
        self,
        layers: int = 2,
        hidden: int = 128,
        heads: int = 4,
        kv_heads: int = 2,
        intermediate: int = 256,
        device: str = "cuda",
        dtype: torch.dtype = torch.bfloat16,
        returning: bool = False,
        forget_layer: int | None = None,
    ) -> None:
        super().__init__()
        self.forget_layer = forget_layer
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.returning = returning
        g = torch.Generator(device="cpu").manual_seed(0)

        def w(*shape: int) -> torch.nn.Parameter:
            t = torch.randn(*shape, generator=g) / math.sqrt(shape[-1])
            return torch.nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)

        qkv = (heads + 2 * kv_heads) * self.head_dim
        self.layers = torch.nn.ModuleList()
        for _ in range(layers):
            layer = torch.nn.Module()
            layer.norm1 = torch.nn.Parameter(torch.ones(hidden, device=device, dtype=dtype), requires_grad=False)
            layer.norm2 = torch.nn.Parameter(torch.ones(hidden, device=device, dtype=dtype), requires_grad=False)
            layer.qkv = w(qkv, hidden)
            layer.o = w(hidden, hidden)
            layer.gate_up = w(2 * intermediate, hidden)
            layer.down = w(hidden, intermediate)
            self.layers.append(layer)
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        self.register_buffer("inv_freq", inv.to(device), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos = freqs.cos().to(x.dtype)[:, None, :]
        sin = freqs.sin().to(x.dtype)[:, None, :]
        h = x
        for i, layer in enumerate(self.layers):
            y = rms_norm(h, layer.norm1)
            qkv = F.linear(y, layer.qkv)
            q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], -1)
            q = rope(q.view(t, self.heads, self.head_dim), cos, sin)
            k = rope(k.view(t, self.kv_heads, self.head_dim), cos, sin)
            v = v.reshape(t, self.kv_heads, self.head_dim)
            if i == self.forget_layer:
                a = torch.empty_like(q)
                attention_into_unmarked(q, k, v, a)
            elif self.returning:
                a = attention_returning(q, k, v)
            else:
                a = torch.empty_like(q)
                attention_into(q, k, v, a)
            h = h + F.linear(a.view(t, -1), layer.o)
            y = rms_norm(h, layer.norm2)
            gate, up = F.linear(y, layer.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down)
        return h


def random_lengths(total: int, requests: int, gen: torch.Generator) -> list[int]:
    """``requests`` positive lengths summing to ``total``."""
    cuts = sorted(torch.randperm(total - 1, generator=gen)[: requests - 1].add(1).tolist())
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def positions_for(lengths: list[int], capacity: int, device: str) -> torch.Tensor:
    pos = torch.zeros(capacity, dtype=torch.long)
    start = 0
    for n in lengths:
        pos[start : start + n] = torch.arange(n)
        start += n
    return pos.to(device)
