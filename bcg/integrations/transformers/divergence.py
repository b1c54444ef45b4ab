"""Where two greedy generations part, and whether half precision can tell their tokens apart there.

Another attention kernel sums in another order: in half precision, greedy tokens then flip where the
two best logits are closer than the rounding error (a near-tie), and everything after differs.
:func:`divergence` finds the first differing token and measures both against an fp32 forward.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["divergence"]


@torch.no_grad()
def divergence(reference: Any, model: Any, prompt: list[int], expected: list[int],
               got: list[int]) -> tuple[int, float, float]:
    """Where greedy ``got`` first leaves ``expected``, measured in fp32.

    Arguments:
        reference: the model in fp32; model: the same weights in half precision (the run's dtype).
            Both with a plain attention implementation (``model.set_attn_implementation("sdpa")``).
        prompt: the request's prompt tokens.
        expected, got: the two generations' tokens (greedy).

    Returns ``(index, gap, noise)``: the first differing token; how far apart the two tokens'
    logits are there in fp32 (same context: the prompt and the tokens before ``index``); and how
    far ``model``'s own logits are from fp32 there (the 99th percentile over the vocabulary). A
    ``gap`` within a few times ``noise`` is a near-tie half precision cannot resolve, whichever
    attention kernel runs; a wrong token sits far further down.
    Raises ``ValueError`` when the generations agree.
    """
    i = next((k for k, (a, b) in enumerate(zip(expected, got)) if a != b), None)
    if i is None:
        raise ValueError("bcg.integrations.transformers.divergence: the generations agree")
    device = next(reference.parameters()).device
    ids = torch.tensor([prompt + expected[:i]], device=device)
    exact = reference(input_ids=ids, use_cache=False).logits[0, -1].float()
    half = model(input_ids=ids, use_cache=False).logits[0, -1].float()
    gap = (exact[expected[i]] - exact[got[i]]).abs().item()
    return i, gap, torch.quantile((half - exact).abs(), 0.99).item()
