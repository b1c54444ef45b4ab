"""Pool memory of the default capture: flat in depth, reused as ``torch.cuda.graph`` reuses it,
and the stats that say what a capture holds."""

from __future__ import annotations

import pytest
import torch

import bcg

from .models import TinyLlama, positions_for, random_lengths

pytestmark = pytest.mark.cuda

T, HIDDEN = 256, 256


def _pool_of(layers: int, **capture_kw: object) -> tuple[bcg.graph.GraphStats, TinyLlama, torch.Tensor, torch.Tensor, bcg.BreakableGraph]:
    torch.manual_seed(0)
    model = TinyLlama(layers=layers, hidden=HIDDEN, heads=8, kv_heads=2, intermediate=1024)
    x = torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16)
    pos = positions_for([T], T, "cuda")
    graph = bcg.make_graph(model, x, pos, live={"lengths": [T]}, **capture_kw)
    return graph.stats(), model, x, pos, graph


def test_default_capture_pool_is_flat_in_depth() -> None:
    default = {n: _pool_of(n)[0] for n in (4, 16)}
    one_activation = T * HIDDEN * 2  # one bf16 hidden state: each layer makes several
    growth = default[16].pool_bytes - default[4].pool_bytes
    assert default[4].pool_bytes > 4 * one_activation  # (the pool is measured: the control)
    assert growth < one_activation, (
        f"default pool grew {growth / 2**20:.2f} MiB from 4 to 16 layers; one hidden state is "
        f"{one_activation / 2**20:.2f} MiB"
    )


def test_default_capture_with_reuse_is_bit_identical_to_eager() -> None:
    _, model, x, pos, graph = _pool_of(6)
    gen = torch.Generator().manual_seed(5)
    for trial in range(50):
        lengths = random_lengths(T, 1 + trial % 7, gen)
        x.copy_(torch.randn(T, HIDDEN, generator=gen).to("cuda", torch.bfloat16))
        pos.copy_(positions_for(lengths, T, "cuda"))
        out = graph.replay(live={"lengths": lengths})
        with bcg.live_scope({"lengths": lengths}):
            assert torch.equal(out, model(x, pos)), f"trial {trial}: {lengths}"
