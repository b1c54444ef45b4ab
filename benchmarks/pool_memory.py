"""Where a breakable graph's pool memory goes, against one ``torch.cuda.graph`` of the same forward.

For the llama workload (8B shape by default) at each T, captures the forward in
several ways, each into a fresh private pool, and reports the pool's bytes
(``reserved``; and ``reserved_growth``, what ``torch.cuda.memory_reserved()``
grew by, default pool included), the bytes still allocated in it after the capture (``active``:
outputs and anything held), the free bytes it caches (``inactive``), and the
largest live and free blocks:

* ``floor``: the forward with frozen attention, one ``torch.cuda.graph``;
* ``one-segment``: the same frozen forward through ``bcg.capture`` (no break);
* ``frozen-breaks``: frozen attention inside the segments, a ``bcg.graph_break()``
  after each (segments, no eager work);
* ``bcg-<ownership>``: ``bcg.make_graph`` with attention as the breakpoint.

Run on a GPU: ``python benchmarks/pool_memory.py --tokens 512 2048 [--layers 32] [--out FILE.json]``.
"""

from __future__ import annotations

import argparse
import gc
import json
from collections.abc import Callable
from typing import Any

import torch

import bcg
from bcg.bench.workloads import llama
from bcg.capture import capture_stream
from bcg.pool import blocks, pool_bytes

MiB = 2**20


def _pool_report(pool: Any, device: int) -> dict[str, Any]:
    live = sorted((size for _, size, used in blocks(device, pool) if used), reverse=True)
    free = sorted((size for _, size, used in blocks(device, pool) if not used), reverse=True)
    return {
        "reserved_mib": pool_bytes(pool, device) / MiB,
        "active_mib": sum(live) / MiB,
        "inactive_mib": sum(free) / MiB,
        "live_blocks_mib": [round(s / MiB, 2) for s in live[:12]],
        "free_blocks_mib": [round(s / MiB, 2) for s in free[:12]],
        "live_blocks": len(live),
    }


def _measure(name: str, capture: Callable[[Any], Any], device: int) -> dict[str, Any]:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    pool = bcg.graph_pool_handle()
    reserved = torch.cuda.memory_reserved(device)
    release = capture(pool)
    torch.cuda.synchronize()
    row = {"mode": name, "reserved_growth_mib": (torch.cuda.memory_reserved(device) - reserved) / MiB,
           **_pool_report(pool, device)}
    release()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--attn", default="flash", choices=llama.ATTN)
    p.add_argument("--out", help="write the rows as JSON")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    dev = torch.cuda.current_device()
    shape = dict(llama.SHAPES["8b"], layers=args.layers)
    shape["head_dim"] = shape["hidden"] // shape["heads"]
    model = llama.LlamaModel(shape, device, max_pos=max(args.tokens))
    rows = []
    for T in args.tokens:
        lengths = tuple(llama.request_lengths(T, args.requests, 0))
        x = torch.randn(T, model.hidden, device=device, dtype=model.dtype)
        pos = torch.cat([torch.arange(n, device=device) for n in lengths])
        live = llama.Batch.build(lengths, device)
        frozen = llama.frozen_attention(args.attn, lengths, device)
        bp = llama.BREAKPOINTS[args.attn]

        def frozen_with_break(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor) -> None:
            frozen(q, k, v, o)
            bcg.graph_break()

        with bcg.live_scope(live):
            model.forward(x, pos, bp)  # warm up every kernel outside any capture
        torch.cuda.synchronize()

        def floor(pool: Any) -> Callable[[], None]:
            g = torch.cuda.CUDAGraph()
            stream = capture_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                model.forward(x, pos, frozen)
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(g, pool=pool, stream=stream):
                out = model.forward(x, pos, frozen)
            held = [g, out]
            return lambda: (held[0].reset(), held.clear())

        def through_capture(attn: Any, ownership: str) -> Callable[[Any], Callable[[], None]]:
            def capture(pool: Any) -> Callable[[], None]:
                graph = bcg.make_graph(lambda a, b: model.forward(a, b, attn), x, pos, live=live, pool=pool,
                                       ownership=ownership)
                return graph.reset

            return capture

        modes = {
            "floor": floor,
            "one-segment": through_capture(frozen, "pool"),
            "frozen-breaks": through_capture(frozen_with_break, "pool"),
            "bcg-pool": through_capture(bp, "pool"),
            "bcg-graph": through_capture(bp, "graph"),
        }
        for name, capture in modes.items():
            row = {"T": T, "layers": args.layers, **_measure(name, capture, dev)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        floor_mib = next(r["reserved_mib"] for r in rows if r["T"] == T and r["mode"] == "floor")
        for r in rows:
            if r["T"] == T:
                r["ratio_to_floor"] = r["reserved_mib"] / floor_mib
        print(f"T={T}: " + ", ".join(f"{r['mode']} {r['reserved_mib']:.0f} MiB ({r['ratio_to_floor']:.2f}x)"
                                      for r in rows if r["T"] == T), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
