"""transformers' continuous batching (``model.generate_batch``) with its forward replayed by bcg.

A Llama built from a config (random weights) generates greedily for a batch of prompts of mixed
lengths, first through transformers' own continuous batching, then again after one call,
``bcg.integrations.transformers.enable(model)``, which runs each step's decoder through a lazy
``bcg.GraphRunner`` (one graph per token bucket) with the attention a staged breakpoint over
transformers' paged cache. It checks that every request's tokens are equal and prints the
runner's stats.

Run: ``python examples/transformers_cb.py [--requests 16 --new-tokens 8 --layers 2]``. Without
CUDA the runner runs in bcg's eager mode (the same buckets, padding and staged attention, no graphs).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import bcg.integrations.transformers as bcg_transformers


def main(argv: list[str] | None = None) -> bool:
    import transformers
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--longest", type=int, default=100, help="the longest prompt (default 100)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=4096)
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(config).to(device).eval()  # float32
    model.set_attn_implementation("paged|sdpa")  # transformers' paged attention, which bcg stages
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(1, 1000, (int(n),), generator=g).tolist()
               for n in torch.randint(1, args.longest + 1, (args.requests,), generator=g)]
    generation = transformers.GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1,
                                               pad_token_id=0)

    def generate() -> tuple[dict[str, list[int]], float]:
        cb = ContinuousBatchingConfig(block_size=32, num_blocks=128, max_batch_tokens=256,
                                      max_requests_per_batch=args.requests, use_cuda_graph=False)
        t0 = time.perf_counter()
        out: Any = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=cb)
        return {rid: list(o.generated_tokens) for rid, o in out.items()}, time.perf_counter() - t0

    expected, t_own = generate()
    graphs = bcg_transformers.enable(model)  # the one call
    got, t_bcg = generate()
    same = got == expected
    stats = graphs.stats()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {device}, bcg mode {stats['mode']}; "
          f"{args.requests} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens")
    print(f"tokens equal to transformers' own continuous batching, request by request: {same}")
    print(f"buckets captured {stats['captured_buckets']}, steps {stats['steps']}, graph calls {stats['graph_calls']}, "
          f"fallbacks { {k: v for k, v in stats['fallbacks'].items() if v} }")
    print(f"generate_batch: transformers {t_own:.2f} s, bcg {t_bcg:.2f} s (the first bcg run captures its graphs)")
    graphs.disable()
    return same


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
