"""transformers' continuous batching, three ways: without graphs, with its own forced CUDA graphs, with bcg.

A Llama built from a config (random weights), greedy decoding of seeded prompts through
``model.generate_batch``. Modes, in one process, each with its own model instance (the same
weights) and persistent manager: every mode's first run (which captures), then ``--runs`` rounds
of one timed run per mode, alternated (the order rotated each round):

* ``transformers``: its continuous batching without graphs (``use_cuda_graph=False``);
* ``transformers-graphs``: its forced CUDA graphs (``use_cuda_graph=True``, default padding intervals);
* ``bcg``: ``bcg.integrations.transformers.enable(model)`` (graphs lazily captured per token bucket).

Reports per mode: generated tokens/s per run (and bcg's paired to the faster transformers mode,
round by round), time to first token p50/p99 over the timed runs, graphs captured and seconds
capturing, the memory graphs take (transformers': what its first run added above the no-graph
mode's; bcg: its pool), and how many requests' tokens equal the no-graph mode's, each that differs
traced to where it first differs and how near a tie that is in fp32. Writes JSON and a PNG.

Run: ``python benchmarks/transformers_cb.py [--requests 64 --new-tokens 128 --layers 16 ...]``
(``--small`` shrinks everything for a quick check). Without a GPU it runs the no-graph and
bcg (eager mode) modes only: a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import operator
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

import bcg
import bcg.integrations.transformers as bcg_transformers

MODES = ("transformers", "transformers-graphs", "bcg")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reserved() -> int:
    if not torch.cuda.is_available():
        return 0
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Any:
    import transformers

    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.inter,
                                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                      num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                                      max_position_embeddings=8192)
    torch.manual_seed(args.seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialized where it runs, in its dtype (an 8B model in seconds)
    try:
        with device:
            model = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.set_attn_implementation(args.attention)
    return model


def seeded_prompts(args: argparse.Namespace) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.requests,), generator=g).tolist()
    return [torch.randint(1, args.vocab, (n,), generator=g).tolist() for n in lengths]


class CaptureTimer:
    """Counts and times transformers' own graph captures (benchmark instrumentation only)."""

    def __init__(self) -> None:
        # transformers exposes no count or timing of its CUDA graph captures: wrap the private
        # ModelRunner._capture_graph, the one place they happen (transformers 5.17.0).
        from transformers.generation.continuous_batching import model_runner

        self.cls = model_runner.ModelRunner
        self.original = self.cls._capture_graph
        self.count, self.seconds = 0, 0.0
        timer = self

        def timed(runner: Any, *args: Any, **kwargs: Any) -> Any:
            sync()
            t0 = time.perf_counter()
            try:
                return timer.original(runner, *args, **kwargs)
            finally:
                sync()
                timer.count += 1
                timer.seconds += time.perf_counter() - t0

        self.cls._capture_graph = timed

    def close(self) -> None:
        self.cls._capture_graph = self.original


def run_once(model: Any, prompts: list[list[int]], args: argparse.Namespace, graphs: bool) -> dict[str, Any]:
    import transformers
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = transformers.GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1,
                                        pad_token_id=0)
    blocks = args.requests * -(-(args.max_prompt + args.new_tokens) // args.block_size) + 8
    cb = ContinuousBatchingConfig(block_size=args.block_size, num_blocks=blocks, max_batch_tokens=args.max_batch_tokens,
                                  max_requests_per_batch=args.requests, use_cuda_graph=graphs)
    sync()
    t0 = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, record_timestamps=True,
                               persistent_manager=True)
    sync()
    seconds = time.perf_counter() - t0
    # by prompt: a persistent manager numbers its requests on from one run to the next
    ordered = sorted(out.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[1]))
    tokens = [list(o.generated_tokens) for o in ordered]
    return {"seconds": seconds, "tokens_per_s": sum(map(len, tokens)) / seconds,
            "ttft_s": [o.timestamps[0] - o.created_time for o in out.values() if o.timestamps], "tokens": tokens}


class Mode:
    """One mode's model (its own instance, the same seeded weights), its persistent CB manager
    (kept between its runs, with its graphs), and its runs."""

    def __init__(self, name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
        self.name = name
        self.graphs = name == "transformers-graphs"
        self.model = build_model(args, device, dtype)
        self.handle = bcg_transformers.enable(self.model, staged=not args.plain) if name == "bcg" else None
        self.first: dict[str, Any] = {}
        self.timed: list[dict[str, Any]] = []
        self.grew_bytes = 0  # reserved memory its first run added (its cache and, with graphs, theirs)

    def run(self, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
        logging.getLogger("bcg").info("mode %s", self.name)
        return run_once(self.model, prompts, args, graphs=self.graphs)

    def close(self) -> None:
        self.model.destroy_cached_continuous_batching_manager()
        if self.handle is not None:
            self.handle.disable()

    def result(self, timer: CaptureTimer) -> dict[str, Any]:
        ttft = sorted(t for r in self.timed for t in r["ttft_s"])
        result: dict[str, Any] = {
            "first_run_s": self.first["seconds"],
            "tokens_per_s": [r["tokens_per_s"] for r in self.timed],
            "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "first_run_grew_bytes": self.grew_bytes,
            "tokens": self.timed[-1]["tokens"],
            # requests whose tokens equal this mode's first run's, in each timed run (half
            # precision: another batching of the same requests may flip a near-tie)
            "requests_equal_to_first_run": [sum(map(operator.eq, r["tokens"], self.first["tokens"]))
                                            for r in self.timed],
        }
        if self.graphs:
            result.update(graphs_captured=timer.count, capture_s=timer.seconds)
        elif self.handle is not None:
            stats = self.handle.stats()
            result.update(graphs_captured=len(stats["captured_buckets"]), capture_s=stats["capture_total_s"],
                          capture_s_per_bucket=stats["capture_s"],
                          forms_captured=sum(len(self.handle.runner.graph(b).forms) for b in stats["captured_buckets"])
                          if stats["mode"] == "graph" else 0,
                          pool_bytes=stats["pool_bytes"], fallbacks=stats["fallbacks"],
                          inline_replays=stats["inline_replays"], staged_fallbacks=stats["staged_fallbacks"],
                          sessions=stats["sessions"], kernel_load_s=stats["kernel_load_s"])
        else:
            result.update(graphs_captured=0, capture_s=0.0)
        return result


def run_modes(names: list[str], prompts: list[list[int]], args: argparse.Namespace, device: torch.device,
              dtype: torch.dtype) -> dict[str, Any]:
    """Every mode's first run (which captures), then ``args.runs`` rounds of one timed run per
    mode, the order rotated each round; the paired ratio of each round is bcg's tokens/s over the
    faster transformers mode's in that round."""
    timer = CaptureTimer()
    modes = [Mode(name, args, device, dtype) for name in names]
    try:
        for mode in modes:
            before = reserved()
            mode.first = mode.run(prompts, args)
            mode.grew_bytes = reserved() - before
        for k in range(args.runs):
            for mode in modes[k % len(modes):] + modes[: k % len(modes)]:
                mode.timed.append(mode.run(prompts, args))
        results = {mode.name: mode.result(timer) for mode in modes}
    finally:
        for mode in modes:
            mode.close()
        timer.close()
    by_name = {mode.name: mode for mode in modes}
    base = [n for n in ("transformers", "transformers-graphs") if n in by_name]
    if "bcg" in by_name and base:
        results["bcg"]["ratio_to_fastest_transformers"] = [
            by_name["bcg"].timed[k]["tokens_per_s"] / max(by_name[n].timed[k]["tokens_per_s"] for n in base)
            for k in range(args.runs)]
    if "transformers" in results and "transformers-graphs" in results:
        results["transformers-graphs"]["graph_memory_bytes"] = (
            results["transformers-graphs"]["first_run_grew_bytes"] - results["transformers"]["first_run_grew_bytes"])
    return results


def trace_differences(tokens: list[list[int]], reference: list[list[int]], prompts: list[list[int]],
                      args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Each request whose tokens differ from ``reference``: where, and whether it is a near-tie
    (``bcg.integrations.transformers.divergence`` against an fp32 copy of the weights)."""
    differing = [k for k, (a, b) in enumerate(zip(tokens, reference)) if a != b]
    if not differing or args.dtype == "float32":
        return []
    half = build_model(args, device, getattr(torch, args.dtype))
    exact = build_model(args, device, torch.float32)
    for m in (half, exact):
        m.set_attn_implementation("sdpa")
    traces = []
    for k in differing:
        i, gap, noise = bcg_transformers.divergence(exact, half, prompts[k], reference[k], tokens[k])
        traces.append({"request": k, "first_differs_at": i, "fp32_gap": gap, "half_noise": noise})
    return traces


def _mib(r: dict[str, Any]) -> str:
    """The memory graphs take, as the report gives it (MiB), for the summary line."""
    taken = r.get("pool_bytes", r.get("graph_memory_bytes"))
    return "-" if taken is None else f"{taken / 2**20:.0f} MiB"


def draw(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(report["modes"])
    figures = [("generated tokens/s (median)", [statistics.median(report["modes"][m]["tokens_per_s"]) for m in modes]),
               ("TTFT p50 (s)", [report["modes"][m]["ttft_p50_s"] for m in modes]),
               ("graphs captured", [report["modes"][m]["graphs_captured"] for m in modes]),
               ("seconds capturing (hatched: bcg's kernel load)", [report["modes"][m]["capture_s"] for m in modes])]
    fig, axes = plt.subplots(1, len(figures), figsize=(4 * len(figures), 3.5))
    for ax, (title, values) in zip(axes, figures):
        ax.bar(modes, values, color=["#888", "#c96", "#369"][: len(modes)])
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelrotation=20)
    # the one-time load of the flash staged attention's kernel, at enable(), on top of the captures
    loaded = [(m, report["modes"][m]["kernel_load_s"], c) for m, c in zip(modes, figures[-1][1])
              if report["modes"][m].get("kernel_load_s")]
    if loaded:
        names, loads, bottoms = zip(*loaded)
        axes[-1].bar(names, loads, bottom=bottoms, color="none", edgecolor="#369", hatch="//")
    fig.suptitle(f"{report['model']}; {report['gpu']}, torch {report['torch']}, transformers "
                 f"{report['transformers']}, {report['commit']}, {report['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parser() -> argparse.ArgumentParser:
    """The script's options (the workload, the modes, the output), with their defaults."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--inter", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--attention", default="paged|sdpa", choices=bcg_transformers.BASES)
    p.add_argument("--runs", type=int, default=3, help="rounds of timed runs, one per mode each, after the first runs (default 3)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--plain", action="store_true", help="bcg: attention as a plain breakpoint (not staged)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small", action="store_true", help="4 layers, 16 requests, prompts up to 256, 32 tokens")
    p.add_argument("--out", default="benchmarks/results/transformers_cb")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser()
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1 (the timed rounds)")
    if args.small:
        args.layers, args.requests, args.max_prompt, args.new_tokens = 4, 16, 256, 32
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":  # a smoke run of the script: bcg in eager mode, no graph mode
        modes_cpu = [m for m in args.modes.split(",") if m != "transformers-graphs"]
        args.modes = ",".join(modes_cpu)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import transformers

    prompts = seeded_prompts(args)
    modes = [m for m in args.modes.split(",") if m]
    results = run_modes(modes, prompts, args, device, getattr(torch, args.dtype))
    reference = results.get("transformers", {}).get("tokens")
    for mode, r in results.items():
        tokens = r.pop("tokens")
        r["requests_equal_to_transformers"] = None if reference is None else sum(map(operator.eq, tokens, reference))
        if reference is not None and mode != "transformers":
            r["differences"] = trace_differences(tokens, reference, prompts, args, device)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__, "transformers": transformers.__version__,
        "bcg": bcg.__version__, "commit": commit, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": f"Llama {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads}, "
                 f"inter {args.inter}, vocab {args.vocab}, {args.dtype}, {args.attention}",
        "args": vars(args), "modes": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    draw(report, out.with_suffix(".png"))
    for mode, r in results.items():
        ratio = r.get("ratio_to_fastest_transformers")
        print(f"{mode:>20}: {statistics.median(r['tokens_per_s']):8.0f} tok/s (median of {len(r['tokens_per_s'])})"
              f"{f'  x{statistics.median(ratio):.3f} paired' if ratio else ''}  TTFT p50 {r['ttft_p50_s'] * 1e3:7.1f} ms "
              f"p99 {r['ttft_p99_s'] * 1e3:7.1f} ms  graphs {r['graphs_captured']:4d} in {r['capture_s']:6.2f} s  "
              f"{'(+ kernel load %.2f s)  ' % r['kernel_load_s'] if 'kernel_load_s' in r else ''}"
              f"equal {r['requests_equal_to_transformers']}/{args.requests}  memory {_mib(r)}")
    for mode, r in results.items():
        for t in r.get("differences", []):
            print(f"{mode} {t['request']}: first differs at token {t['first_differs_at']}, fp32 gap "
                  f"{t['fp32_gap']:.4f} ({t['fp32_gap'] / t['half_noise']:.2f} x the {args.dtype} noise {t['half_noise']:.4f})")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
