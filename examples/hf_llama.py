"""A Hugging Face ``transformers`` Llama under bcg: packed prefill, attention as the breakpoint.

A small ``LlamaForCausalLM`` with random weights (built from a config: nothing is
downloaded) runs a prefill of several requests packed in one sequence
(``input_ids`` of shape ``[1, T]``, ``position_ids`` restarting at 0 for each
request). Its attention is :func:`packed_attention`, a function registered with
``transformers.AttentionInterface``, which calls :func:`attend`, marked
``@bcg.breakpoint``: it reads the request lengths of this call from
``bcg.live()`` and runs causal attention within each request (on CUDA one
flash-attention call over the cumulative lengths, GQA native; elsewhere an
SDPA loop). Everything else (embedding, norms, projections, RoPE, MLP,
LM head) is captured into CUDA graph segments.

The three lines you add to your own Hugging Face model, once you have an
attention function like :func:`packed_attention`::

    transformers.AttentionInterface.register("bcg_packed", packed_attention)  # 1. register the attention
    model.set_attn_implementation("bcg_packed")  # 2. select it (or from_pretrained(..., attn_implementation="bcg_packed"))
    graph = bcg.make_graph(lambda i, p: model(input_ids=i, position_ids=p, use_cache=False).logits, ids, pos, live=meta)  # 3.

then ``graph.replay(live=new_meta)`` after writing new ids and positions into
``ids`` and ``pos`` in place (or, for a ladder of token buckets, line 3 becomes
``bcg.GraphRunner(forward, buckets, example_inputs=(ids, pos), pad_dim=1,
live=...)``: see :func:`run_runner`).

What it checks and prints:

(a) ``bcg.make_graph`` over the forward, replayed with new tokens and new
    request lengths: bit-identical (``torch.equal``) to the same model run
    eagerly on the same inputs;
(b) ``bcg.GraphRunner`` over a few token buckets, called with a token count
    that is not a bucket: bit-identical to the eager model on the same input
    zero-padded to the bucket (the same GEMM shapes; unpadded eager differs in
    the last bits, since GEMM kernels change with the row count);
(c) the packed attention against HF's own ``sdpa`` attention run on each
    request alone (within a tolerance: the kernels may differ);
(d) eager vs bcg time: median of synchronized runs, and the speedup.

With ``--compile`` the whole model is compiled with ``torch.compile(fullgraph=True)``:
:func:`attend`, the breakpoint inside :func:`packed_attention`, takes only
tensors and a float and writes its result in place, so in compiled code it is
one opaque op, and bcg captures Inductor's kernels around it. Every check then
compares with the compiled model run eagerly.

Run: ``python examples/hf_llama.py [--tokens 512 --requests 4 --layers 4 --iters 50] [--compile]``.
Without CUDA it runs on the CPU in float32 with bcg's eager mode (same code,
no graphs: the times say nothing there).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

import bcg

ATTN_NAME = "bcg_packed"

# The flash kernel behind SDPA and varlen_attn, with cumulative sequence lengths (packed requests) and GQA native.
_FLASH = getattr(getattr(torch.ops.aten, "_flash_attention_forward", None), "default", None)


# -- the attention function ---------------------------------------------------------------


def packed_live(lengths: list[int], device: torch.device | str) -> dict[str, Any]:
    """The live metadata of one forward: request lengths, and (on CUDA) their cumulative sums on the device."""
    lengths = [int(n) for n in lengths]
    cu = None
    if torch.device(device).type == "cuda":
        host = torch.tensor(list(itertools.accumulate(lengths, initial=0)), dtype=torch.int32, pin_memory=True)
        cu = host.to(device, non_blocking=True)
    return {"lengths": lengths, "cu_seqlens": cu, "max_len": max(lengths)}


@bcg.breakpoint(mutates="out")
def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, scaling: float) -> None:
    """The breakpoint: causal attention within each request of a packed batch, written into ``out``.

    ``query`` is ``[T, heads, head_dim]``, ``key``/``value`` ``[T, kv_heads,
    head_dim]`` (GQA: kv heads are shared by groups of query heads), ``out``
    ``[T, heads, head_dim]``. The request lengths come from
    ``bcg.live()["lengths"]``; rows of ``out`` past their sum (padding) are
    zeroed. Tensor arguments only, annotated, and results written in place: in
    ``torch.compile``'d code this function is one opaque op (``bcg::attend``),
    so the whole model compiles with ``fullgraph=True`` around it.
    """
    live = bcg.live()
    lengths = live["lengths"]
    n = sum(lengths)
    if (
        query.is_cuda and _FLASH is not None and live.get("cu_seqlens") is not None
        and query.dtype in (torch.float16, torch.bfloat16)
    ):
        # one kernel for all requests, GQA native
        o = _FLASH(query[:n], key[:n], value[:n], live["cu_seqlens"], live["cu_seqlens"], live["max_len"],
                   live["max_len"], 0.0, True, False, scale=scaling)[0]
        out[:n].copy_(o)
    else:
        start = 0
        for length in lengths:
            s = slice(start, start + length)
            o = F.scaled_dot_product_attention(query[s].transpose(0, 1), key[s].transpose(0, 1),
                                               value[s].transpose(0, 1), is_causal=True, scale=scaling,
                                               enable_gqa=True)
            out[s].copy_(o.transpose(0, 1))
            start += length
    out[n:].zero_()


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's attention signature around the breakpoint :func:`attend`, over a packed ``[1, T]`` batch.

    ``query`` is ``[1, heads, T, head_dim]``, ``key``/``value`` ``[1, kv_heads,
    T, head_dim]``; returns ``([1, T, heads, head_dim], None)``, as HF's
    attention functions do. ``attention_mask`` is ignored: HF builds none for
    an attention name it has no mask function for, and the requests'
    boundaries come from the live lengths.
    """
    _, heads, T, dim = query.shape
    # [T, heads, dim] views (HF's q/k/v are [T, heads, dim] in memory, transposed)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = query.new_empty(T, heads, dim)
    attend(q, k, v, out, float(scaling if scaling is not None else dim**-0.5))
    return out.unsqueeze(0), None


# -- model and inputs -----------------------------------------------------------------------


def build_model(layers: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """A small random ``LlamaForCausalLM`` (no download), eval mode, attention = :func:`packed_attention`."""
    import transformers

    transformers.AttentionInterface.register(ATTN_NAME, packed_attention)  # line 1 of 3
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    model.set_attn_implementation(ATTN_NAME)  # line 2 of 3
    return model


def split_lengths(total: int, requests: int, gen: torch.Generator) -> list[int]:
    """``requests`` random positive lengths summing to ``total``."""
    requests = max(1, min(requests, total))
    cuts = sorted(torch.randperm(total - 1, generator=gen)[: requests - 1].add(1).tolist())
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def packed_inputs(
    lengths: list[int], capacity: int, vocab: int, gen: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[1, capacity]`` token ids and position ids (restarting at 0 per request); zeros past ``sum(lengths)``."""
    n = sum(lengths)
    ids = torch.zeros(1, capacity, dtype=torch.long)
    ids[0, :n] = torch.randint(0, vocab, (n,), generator=gen)
    pos = torch.zeros(1, capacity, dtype=torch.long)
    pos[0, :n] = torch.cat([torch.arange(length) for length in lengths])
    return ids.to(device), pos.to(device)


def make_forward(model: Any) -> Any:
    def forward(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits

    return forward


def compile_forward(forward: Any, device: torch.device) -> Any:
    """The whole forward compiled with ``fullgraph=True`` (static shapes: each token count compiles
    once, in a warm-up, outside any capture); :func:`attend` is one op in the graph. Inductor on a
    GPU; on the CPU ``aot_eager`` (Inductor's CPU backend compiles C++ for minutes)."""
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    return torch.compile(forward, fullgraph=True, dynamic=False, backend=backend)


def eager(forward: Any, ids: torch.Tensor, pos: torch.Tensor, live: dict[str, Any]) -> torch.Tensor:
    """The model run eagerly (the breakpoint is a plain call outside a capture)."""
    with bcg.live_scope(live):
        return forward(ids, pos)


def median_ms(fn: Any, iters: int, device: torch.device, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` in ms, each run synchronized before and after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


# -- the checks -----------------------------------------------------------------------------


def check_packing(model: Any, forward: Any, lengths: list[int], gen: torch.Generator, device: torch.device) -> float:
    """Relative max error of the packed run against HF's ``sdpa`` on each request alone."""
    ids, pos = packed_inputs(lengths, sum(lengths), model.config.vocab_size, gen, device)
    packed = eager(forward, ids, pos, packed_live(lengths, device)).float()
    model.set_attn_implementation("sdpa")
    try:
        starts = list(itertools.accumulate(lengths, initial=0))
        alone = torch.cat([model(input_ids=ids[:, a:b], use_cache=False).logits.float()
                           for a, b in zip(starts, starts[1:])], dim=1)
    finally:
        model.set_attn_implementation(ATTN_NAME)
    return ((packed - alone).abs().max() / alone.abs().max().clamp_min(1e-12)).item()


def run_graph(forward: Any, args: argparse.Namespace, vocab: int, gen: torch.Generator, device: torch.device,
              mode: str) -> dict[str, Any]:
    """(a) and (d): ``bcg.make_graph``, replayed with new tokens and lengths, against eager; timings."""
    T = args.tokens
    lengths0 = split_lengths(T, args.requests, gen)
    ids, pos = packed_inputs(lengths0, T, vocab, gen, device)
    graph = bcg.make_graph(forward, ids, pos, live=packed_live(lengths0, device), mode=mode)  # line 3 of 3
    equal = []
    for _ in range(3):  # new tokens and new request lengths at every replay
        lengths = split_lengths(T, args.requests, gen)
        new_ids, new_pos = packed_inputs(lengths, T, vocab, gen, device)
        ids.copy_(new_ids)
        pos.copy_(new_pos)
        live = packed_live(lengths, device)
        y = graph.replay(live=live).clone()
        equal.append(torch.equal(y, eager(forward, ids, pos, live)))
    live = packed_live(lengths, device)
    eager_ms = median_ms(lambda: eager(forward, ids, pos, live), args.iters, device)
    bcg_ms = median_ms(lambda: graph.replay(live=live), args.iters, device)
    return {
        "lengths": lengths, "graph_equal": all(equal), "segments": graph.stats().segments,
        "breakpoints": graph.stats().breakpoints, "eager_ms": eager_ms, "bcg_ms": bcg_ms, "speedup": eager_ms / bcg_ms,
    }


def run_runner(forward: Any, args: argparse.Namespace, vocab: int, gen: torch.Generator, device: torch.device,
               mode: str) -> dict[str, Any]:
    """(b): ``bcg.GraphRunner`` over token buckets, called with a token count that is not a bucket."""
    T = args.tokens
    buckets = bcg.runner.geometric_buckets(max(1, T // 8), T)
    example = packed_inputs([T], T, vocab, gen, device)
    runner = bcg.GraphRunner(forward, buckets, example_inputs=example, pad_dim=1, mode=mode, progress=False,
                             live=lambda size: packed_live([size], device))
    runner.capture()
    n = args.runner_tokens or (T // 2 + T // 8 + 3 if T >= 8 else T)
    n = min(n, T)
    bucket = runner.bucket_for(n)
    lengths = split_lengths(n, args.requests, gen)
    ids, pos = packed_inputs(lengths, n, vocab, gen, device)
    live = packed_live(lengths, device)
    y = runner(ids, pos, live=live).clone()
    padded_ids, padded_pos = (F.pad(t, (0, bucket - n)) for t in (ids, pos))  # zeros
    reference = eager(forward, padded_ids, padded_pos, live)[:, :n]
    out = {
        "runner_buckets": buckets, "runner_tokens": n, "runner_bucket": bucket, "runner_lengths": lengths,
        "runner_equal": y.shape == reference.shape and torch.equal(y, reference),
        "runner_fallbacks": runner.stats()["fallbacks"],
    }
    out["runner_eager_ms"] = median_ms(lambda: eager(forward, ids, pos, live), args.iters, device)
    out["runner_ms"] = median_ms(lambda: runner(ids, pos, live=live), args.iters, device)
    out["runner_speedup"] = out["runner_eager_ms"] / out["runner_ms"]
    runner.reset()
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--tokens", "-T", type=int, default=None,
                   help="packed tokens per forward (default 512 on CUDA, 128 on the CPU)")
    p.add_argument("--requests", type=int, default=4, help="requests packed in one forward (default 4)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed runs per mode, median reported (default 50 on CUDA, 5 on the CPU)")
    p.add_argument("--runner-tokens", type=int, default=0,
                   help="tokens of the GraphRunner call (default: between two buckets)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true",
                   help="compile the whole model with torch.compile(fullgraph=True): the attention breakpoint "
                   "is one op inside the compiled graph (on the CPU with the aot_eager backend)")
    args = p.parse_args(argv)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = args.device.type == "cuda"
    args.tokens = args.tokens if args.tokens is not None else (512 if cuda else 128)
    args.iters = args.iters if args.iters is not None else (50 if cuda else 5)
    if args.tokens < 1 or args.requests < 1 or args.layers < 1 or args.iters < 1:
        p.error("--tokens, --requests, --layers and --iters must be positive")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import transformers

    device = args.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mode = "graph" if device.type == "cuda" else "eager"  # bcg's eager mode: same structure, no CUDA graphs
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        model = build_model(args.layers, device, dtype, args.seed)
        forward = make_forward(model)
        vocab = model.config.vocab_size
        result: dict[str, Any] = {
            "transformers": transformers.__version__, "torch": torch.__version__, "device": str(device),
            "dtype": str(dtype).removeprefix("torch."), "mode": mode, "tokens": args.tokens, "layers": args.layers,
            "compiled": args.compile,
        }
        result["packed_rel_err"] = check_packing(model, forward, split_lengths(min(args.tokens, 64), 3, gen), gen,
                                                 device)
        result["packed_ok"] = result["packed_rel_err"] < (0.05 if dtype == torch.bfloat16 else 1e-4)
        if args.compile:  # every check below compares with the same compiled forward run eagerly
            from torch._dynamo.utils import counters  # torch's count of the graphs Dynamo compiled

            def dynamo_graphs() -> int:
                return int(counters["stats"]["unique_graphs"])

            graphs0 = dynamo_graphs()
            forward = compile_forward(forward, device)
        result.update(run_graph(forward, args, vocab, gen, device, mode))
        result.update(run_runner(forward, args, vocab, gen, device, mode))
        if args.compile:
            result["dynamo_graphs"] = dynamo_graphs() - graphs0

    r = result
    print(f"transformers {r['transformers']}, torch {r['torch']}, {r['device']} {r['dtype']}, bcg mode={mode}; "
          f"Llama {args.layers} layers, T={args.tokens}, requests {r['lengths']}")
    if args.compile:
        print(f"torch.compile(fullgraph=True): {r['dynamo_graphs']} graphs compiled (one per token count); "
              "'eager' below is the compiled model run without CUDA graphs")
    print(f"packed attention vs HF sdpa per request: rel err {r['packed_rel_err']:.2e} "
          f"({'ok' if r['packed_ok'] else 'TOO LARGE'})")
    print(f"make_graph: {r['segments']} segments, {r['breakpoints']} breakpoints; "
          f"bit-identical to eager: {r['graph_equal']}")
    print(f"GraphRunner buckets {r['runner_buckets']}: T={r['runner_tokens']} -> bucket {r['runner_bucket']}, "
          f"bit-identical to eager on the padded input: {r['runner_equal']}")
    print(f"eager {r['eager_ms']:.3f} ms   bcg {r['bcg_ms']:.3f} ms   speedup {r['speedup']:.2f}x   "
          f"(median of {args.iters})")
    print(f"T={r['runner_tokens']}: eager {r['runner_eager_ms']:.3f} ms   GraphRunner {r['runner_ms']:.3f} ms   "
          f"speedup {r['runner_speedup']:.2f}x")
    if mode == "eager":
        print("(no CUDA: bcg ran in eager mode, so the times compare eager with eager)")
    return result


if __name__ == "__main__":
    out = main()
    raise SystemExit(0 if out["graph_equal"] and out["runner_equal"] and out["packed_ok"] else 1)
