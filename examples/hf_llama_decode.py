"""A Hugging Face ``transformers`` Llama decoding through bcg, over a paged KV cache of its own.

The model runs with ``use_cache=False``: HF's ``DynamicCache`` grows at every step, its
``StaticCache`` is one dense row per batch slot, and its paged cache belongs to its own
continuous-batching manager. So its attention (registered with
``transformers.AttentionInterface``) keeps the K/V itself: :meth:`PagedHF.attention` hands each
layer's new K/V and queries to a breakpoint that writes them into a paged cache at the slots
the live metadata names and attends over each request's pages (the small paged attention below,
in plain PyTorch ops: block tables, and a trash page that only padded rows write to).

Several requests are prefilled eagerly (one packed forward), then decode a few tokens greedily,
one token each per step, through a :class:`bcg.GraphRunner` whose buckets are batch sizes: the
attention is *staged* (the block tables, slots and context lengths are written into staging
buffers before each replay; the attention runs inside the graph). Requests finish at different
steps, so the batch shrinks and calls are padded to a bucket.

What it checks and prints:

(a) the tokens decoded through bcg equal those of the same model decoding eagerly through the
    same attention (a second cache), and their logits match;
(b) on the CPU (float32) the tokens also equal HF's own ``generate`` (greedy, ``sdpa``,
    HF's cache) for each request alone;
(c) the time per decode step, eager and bcg.

Run: ``python examples/hf_llama_decode.py [--requests 4 --steps 8 --layers 2]``. Without CUDA
the runner runs in bcg's eager mode (same code, no graphs).
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time
from typing import Any, NamedTuple

import numpy as np
import torch

import bcg

PAGE = 16  # tokens per page of the KV cache


# -- a small paged attention ----------------------------------------------------------------------


class Batch(NamedTuple):
    """The live metadata of one forward over the paged cache (what ``bcg.live()`` returns).

    Arguments:
        q_lens: new tokens of each request (packed in this order in the forward's rows).
        ctx_lens: each request's context once its new tokens are written.
        tables: each request's pages of the cache, in order.
    """

    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    tables: tuple[tuple[int, ...], ...]

    def positions(self) -> list[int]:
        """Each new token's position in its request (RoPE), in row order."""
        return [p for q, c in zip(self.q_lens, self.ctx_lens) for p in range(c - q, c)]

    def arrays(self, rows: int, requests: int, pages: int) -> tuple[np.ndarray, ...]:
        """``(slots, cu_q, ctx, table)`` padded to static bounds: each row's cache slot (padded rows:
        the trash page 0), the requests' row offsets, their context lengths (0 for padded
        requests) and their block tables (``[requests, pages]``, unused entries: page 0)."""
        slots = np.arange(rows, dtype=np.int64) % PAGE
        real = [t[p // PAGE] * PAGE + p % PAGE for q, c, t in zip(self.q_lens, self.ctx_lens, self.tables)
                for p in range(c - q, c)]
        slots[: len(real)] = real
        cu = np.full(requests + 1, len(real), dtype=np.int32)
        cu[: len(self.q_lens) + 1] = list(itertools.accumulate(self.q_lens, initial=0))
        ctx = np.zeros(requests, dtype=np.int32)
        ctx[: len(self.ctx_lens)] = self.ctx_lens
        table = np.zeros((requests, pages), dtype=np.int32)
        for r, t in enumerate(self.tables):
            table[r, : len(t)] = t
        return slots, cu, ctx, table


def inert_batch(requests: int) -> Batch:
    """One-token requests on the trash page: what a capture runs with (its runs write K/V only there)."""
    return Batch((1,) * requests, (1,) * requests, ((0,),) * requests)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, cu_q: torch.Tensor,
                    ctx: torch.Tensor, table: torch.Tensor) -> None:
    """Write this forward's K/V at ``slots``, then causal attention of each row over its request's
    pages (every size a static bound, every index a device tensor: capturable). ``q``, ``out``:
    ``[T, heads, D]``; ``k``, ``v``: ``[T, kv_heads, D]``; caches ``[pages, PAGE, kv_heads, D]``."""
    T, H, D = q.shape
    KV = k.shape[1]
    flat_k, flat_v = k_cache.view(-1, KV, D), v_cache.view(-1, KV, D)
    flat_k.index_copy_(0, slots, k)
    flat_v.index_copy_(0, slots, v)
    R, P = table.shape
    t = torch.arange(T, device=q.device)
    r = torch.bucketize(t, cu_q[1:].long(), right=True).clamp(max=R - 1)  # each row's request
    pos = ctx.long()[r] - (cu_q[1:] - cu_q[:-1]).long()[r] + (t - cu_q.long()[r])  # its position
    index = (table.long().unsqueeze(-1) * PAGE + torch.arange(PAGE, device=q.device)).view(R, P * PAGE)[r]
    keys = flat_k[index].repeat_interleave(H // KV, dim=2).float()  # [T, P * PAGE, H, D]
    values = flat_v[index].repeat_interleave(H // KV, dim=2).float()
    scores = torch.einsum("thd,tlhd->thl", q.float(), keys) * D**-0.5
    visible = torch.arange(P * PAGE, device=q.device) <= pos.unsqueeze(1)  # [T, P * PAGE]
    o = torch.einsum("thl,tlhd->thd", scores.masked_fill(~visible.unsqueeze(1), -math.inf).softmax(-1), values)
    real = (t < cu_q[-1]).view(T, 1, 1)  # padded rows (no request) are written as zeros
    out.copy_(torch.where(real, o, torch.zeros((), device=o.device)).to(out.dtype))


class Staged(NamedTuple):
    """What the staged attention reads inline: the staging buffers' device tensors."""

    slots: torch.Tensor
    cu_q: torch.Tensor
    ctx: torch.Tensor
    table: torch.Tensor


class PagedHF:
    """The paged cache and the attention breakpoint HF's layers call (one object per model).

    Arguments:
        name: the name the attention is registered under with ``transformers.AttentionInterface``.
        config: the model's ``LlamaConfig``.
        pages_per_request, requests: the cache's bounds (page 0, the trash page, comes on top).
        staged: the attention reads its metadata from staging buffers (graphs); else from device
            tensors built at each call (eager).
    """

    def __init__(self, name: str, config: Any, pages_per_request: int, requests: int, staged: bool,
                 device: torch.device, dtype: torch.dtype) -> None:
        import transformers

        self.name, self.pages, self.requests = name, pages_per_request, requests
        transformers.AttentionInterface.register(name, self.attention)
        head_dim = config.hidden_size // config.num_attention_heads
        shape = (1 + requests * pages_per_request, PAGE, config.num_key_value_heads, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        mutates = ("out", "k_cache", "v_cache")
        if staged:  # rows bound: the largest bucket, one token per request
            dtypes = (torch.int64, torch.int32, torch.int32, torch.int32)
            shapes = ((requests,), (requests + 1,), (requests,), (requests, pages_per_request))
            self.buffers = [bcg.StagingBuffer(s, dtype=d, device=device) for s, d in zip(shapes, dtypes)]
            self.staged = Staged(*(b.device for b in self.buffers))
            self.attend = bcg.breakpoint(self._attend, mutates=mutates, prepare=self.prepare, fits=self.fits)
        else:
            self.attend = bcg.breakpoint(self._attend, mutates=mutates)

    def table(self, request: int) -> tuple[int, ...]:
        """Request ``request``'s pages (a fixed run of ``pages_per_request`` pages)."""
        return tuple(range(1 + request * self.pages, 1 + (request + 1) * self.pages))

    def fits(self, batch: Batch) -> bool:
        """Whether ``batch`` fits the staging buffers' bounds."""
        return len(batch.q_lens) <= self.requests and sum(batch.q_lens) <= self.requests

    def prepare(self, batch: Batch) -> Staged:
        """Write ``batch``'s metadata into the staging buffers (host only); return their device tensors."""
        for buffer, array in zip(self.buffers, batch.arrays(self.requests, self.requests, self.pages)):
            buffer.write(array)
        return self.staged

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """The breakpoint: inline, ``bcg.live()`` is what :meth:`prepare` returned; else the batch."""
        live = bcg.live()
        if isinstance(live, Staged):
            meta = (live.slots[: q.shape[0]], live.cu_q, live.ctx, live.table)
        else:
            meta = tuple(torch.from_numpy(a).to(q.device) for a in live.arrays(q.shape[0], self.requests, self.pages))
        paged_attention(q, k, v, out, k_cache, v_cache, *meta)

    def attention(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        """HF's attention signature over a packed ``[1, T]`` batch: the layer's queries and new
        K/V go to the paged attention breakpoint, with this layer's caches."""
        layer = module.layer_idx
        _, heads, T, dim = query.shape
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
        out = torch.empty(T, heads, dim, device=query.device, dtype=query.dtype)
        self.attend(q, k, v, out, k_cache=self.k[layer], v_cache=self.v[layer])
        return out.unsqueeze(0), None


def build_model(layers: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    import transformers

    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=4096)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def run(model: Any, state: PagedHF, prompts: list[list[int]], steps: int, device: torch.device,
        runner: bcg.GraphRunner | None) -> tuple[list[list[int]], list[torch.Tensor], list[float]]:
    """Prefill ``prompts`` eagerly into ``state``'s cache, then decode ``steps`` greedy tokens each
    (request r stops after ``steps - r`` tokens), through ``runner`` when given. Returns the tokens,
    each step's logits, and each decode step's seconds."""
    model.set_attn_implementation(state.name)
    R = len(prompts)
    lengths = [len(p) for p in prompts]
    batch = Batch(tuple(lengths), tuple(lengths), tuple(state.table(r) for r in range(R)))
    ids = torch.tensor([[t for p in prompts for t in p]], device=device)
    pos = torch.tensor([batch.positions()], device=device)
    with bcg.live_scope(batch), torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    ends = list(itertools.accumulate(lengths))
    last = [int(logits[e - 1].argmax()) for e in ends]
    tokens = [[t] for t in last]
    ctx = list(lengths)
    step_logits, seconds = [], []
    for step in range(1, steps):
        active = [r for r in range(R) if step < steps - r]
        for r in active:
            ctx[r] += 1
        batch = Batch((1,) * len(active), tuple(ctx[r] for r in active), tuple(state.table(r) for r in active))
        ids = torch.tensor([[tokens[r][-1] for r in active]], device=device)
        pos = torch.tensor([batch.positions()], device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if runner is not None:
            out = runner(ids, pos, live=batch)[0]
        else:
            with bcg.live_scope(batch), torch.no_grad():
                out = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
        step_logits.append(out.float().clone())
        for i, r in enumerate(active):
            tokens[r].append(int(out[i].argmax()))
    return tokens, step_logits, seconds


def hf_generate(model: Any, prompt: list[int], steps: int, device: torch.device) -> list[int]:
    """HF's own greedy decoding of one request (``sdpa``, HF's cache)."""
    before = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=steps, do_sample=False,
                             pad_token_id=0)
    finally:
        model.set_attn_implementation(before)
    return out[0, len(prompt):].tolist()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--steps", type=int, default=8, help="tokens decoded by the first request (default 8)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompt", type=int, default=20, help="the longest prompt (default 20)")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(args.seed)
    model = build_model(args.layers, device, dtype, args.seed)
    R = args.requests
    prompts = [torch.randint(1, 1000, (int(torch.randint(1, args.prompt + 1, (1,), generator=gen)),),
                             generator=gen).tolist() for _ in range(R)]
    pages = math.ceil((args.prompt + args.steps) / PAGE)
    eager_state = PagedHF("bcg_paged_eager", model.config, pages, R, staged=False, device=device, dtype=dtype)
    graph_state = PagedHF("bcg_paged_staged", model.config, pages, R, staged=True, device=device, dtype=dtype)

    def forward(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits

    buckets = [b for b in (1, 2, 4, 8, 16, 32) if b < R] + [R]
    model.set_attn_implementation(graph_state.name)  # (what the runner's captures record)
    runner = bcg.GraphRunner(
        forward, buckets, example_inputs=(torch.zeros(1, 1, dtype=torch.long, device=device),
                                          torch.zeros(1, 1, dtype=torch.long, device=device)),
        pad_dim=1, mode="graph" if device.type == "cuda" else "eager", progress=False,
        # the captures' warm-ups write K/V: only into the trash page
        live=lambda n: inert_batch(min(n, R)),
    )
    with torch.no_grad():
        runner.capture()
        eager_tokens, eager_logits, eager_s = run(model, eager_state, prompts, args.steps, device, None)
        graph_tokens, graph_logits, graph_s = run(model, graph_state, prompts, args.steps, device, runner)
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    result: dict[str, Any] = {
        "device": str(device), "mode": runner.mode, "requests": R, "prompts": [len(p) for p in prompts],
        "tokens_equal": graph_tokens == eager_tokens,
        "logits_close": all(torch.allclose(a, b, rtol=tol, atol=tol) for a, b in zip(graph_logits, eager_logits)),
        "eager_ms_per_step": statistics.median(eager_s) * 1e3, "bcg_ms_per_step": statistics.median(graph_s) * 1e3,
        "buckets": buckets, "fallbacks": runner.stats()["fallbacks"],
    }
    if dtype == torch.float32:
        result["hf_generate_equal"] = all(
            hf_generate(model, prompts[r], args.steps - r, device) == eager_tokens[r] for r in range(R))
    runner.reset()
    print(f"{R} requests (prompts {result['prompts']}), {args.steps} steps, {device} {str(dtype)[6:]}, bcg mode "
          f"{result['mode']}, buckets {buckets}")
    print(f"tokens through bcg == eager: {result['tokens_equal']}; logits close: {result['logits_close']}")
    if "hf_generate_equal" in result:
        print(f"eager paged decoding == HF generate (sdpa, HF cache), each request alone: {result['hf_generate_equal']}")
    print(f"per decode step: eager {result['eager_ms_per_step']:.3f} ms, bcg {result['bcg_ms_per_step']:.3f} ms")
    return result


if __name__ == "__main__":
    r = main()
    ok = r["tokens_equal"] and r["logits_close"] and r.get("hf_generate_equal", True)
    raise SystemExit(0 if ok else 1)
