"""Shared by the transformers continuous-batching tests: a random-weight Llama and its requests."""

from __future__ import annotations

import os
import random
from typing import Any

import torch


def fresh_seed() -> int:
    """A random seed, printed (a failure names the seed: ``BCG_TEST_SEED=<seed>`` reruns with it)."""
    seed = int(os.environ.get("BCG_TEST_SEED") or random.randrange(2**31))
    print(f"seed {seed}")
    return seed


def tiny_llama(seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32, layers: int = 2,
               hidden: int = 64, heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
               vocab: int = 512) -> Any:
    """A Llama from a config (random weights), attention ``paged|sdpa``."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, head_dim=hidden // heads,
                                      max_position_embeddings=4096)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    model.set_attn_implementation("paged|sdpa")
    return model


def prompts(seed: int, n: int, shortest: int, longest: int, vocab: int) -> list[list[int]]:
    """``n`` prompts of mixed lengths in ``[shortest, longest]``, seeded."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (k,), generator=g).tolist() for k in lengths]


def generate(model: Any, requests: list[list[int]], new_tokens: int, persistent_manager: bool = False,
             **cb: Any) -> dict[str, list[int]]:
    """transformers' continuous batching, greedy: each request's generated tokens, by request id
    (``persistent_manager``: its manager, cache and bcg's graphs kept until
    ``model.destroy_cached_continuous_batching_manager()``)."""
    import transformers
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                                           pad_token_id=0)
    out = model.generate_batch(requests, generation_config=config, persistent_manager=persistent_manager,
                               continuous_batching_config=ContinuousBatchingConfig(**cb))
    return {rid: list(o.generated_tokens) for rid, o in out.items()}

