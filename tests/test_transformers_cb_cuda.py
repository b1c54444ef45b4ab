"""bcg.integrations.transformers on a GPU: transformers' continuous batching replaying its forward
through bcg graphs (staged and plain attention) gives transformers' own tokens, request by request."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import bcg.integrations.transformers as bcg_transformers  # noqa: E402
from bcg.integrations.transformers import divergence  # noqa: E402

from .cb_models import fresh_seed, generate, prompts, tiny_llama  # noqa: E402

pytestmark = pytest.mark.cuda

CB = {"block_size": 32, "num_blocks": 256, "max_batch_tokens": 256, "max_requests_per_batch": 32,
      "use_cuda_graph": False}
SHAPE = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 2, "intermediate": 512, "vocab": 2048}


@pytest.mark.parametrize("staged,async_batching", [(True, False), (False, False), (True, True)],
                         ids=["staged", "plain", "staged-async"])
def test_fp32_tokens_equal_transformers_request_by_request(staged: bool, async_batching: bool) -> None:
    """With ``async_batching``, transformers prepares each step's inputs on its own stream while the
    previous step computes, and runs the forward on its compute stream (the reference too)."""
    seed = fresh_seed()
    model = tiny_llama(seed, device="cuda", **SHAPE)
    requests = prompts(seed, 32, 1, 200, SHAPE["vocab"])
    cb = {**CB, "use_async_batching": async_batching}
    expected = generate(model, requests, 16, **cb)
    graphs = bcg_transformers.enable(model, staged=staged, kv_bounds=(512, 2048, 8192))
    got = generate(model, requests, 16, **cb)
    differ = [rid for rid in expected if got[rid] != expected[rid]]
    assert not differ, f"requests {differ} differ"
    stats = graphs.stats()
    print({k: stats[k] for k in ("captured_buckets", "capture_total_s", "fallbacks", "inline_replays",
                                 "staged_fallbacks", "steps")})
    assert stats["mode"] == "graph" and stats["graph_calls"] > stats["steps"] // 2
    if staged:
        assert stats["inline_replays"] > 0
    graphs.disable()


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "plain"])
def test_a_step_reads_what_transformers_wrote_late_on_its_default_stream(staged: bool,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' synchronous batching writes a step's last index copy on the default stream,
    unsynchronized, and runs the forward on its compute stream. Here that copy lands late on
    purpose (behind a long sleep, the storage holding trash until then): bcg's step still reads
    the step's own indices and gives transformers' tokens. Control: without bcg's wait it does not."""
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

    import bcg.integrations.transformers.graphs as cb_graphs

    seed = fresh_seed()
    model = tiny_llama(seed, device="cuda", **SHAPE)
    requests = prompts(seed, 8, 20, 120, SHAPE["vocab"])
    expected = generate(model, requests, 6, **CB)
    real = ContinuousBatchingIOs.get_model_kwargs
    late = [0]

    def get_model_kwargs(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(self, *args, **kwargs)
        torch.cuda.synchronize()
        good = self.read_index_storage.clone()
        self.read_index_storage.fill_(self._read_trash_index)
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.default_stream()):
            torch.cuda._sleep(20_000_000)  # (about 10 ms: far longer than the host takes to the forward)
            self.read_index_storage.copy_(good)
        late[0] += 1
        return out

    monkeypatch.setattr(ContinuousBatchingIOs, "get_model_kwargs", get_model_kwargs)
    cb = {**CB, "use_async_batching": False}  # (the synchronous batching this race is in)
    graphs = bcg_transformers.enable(model, staged=staged, kv_bounds=(512, 2048, 8192))
    try:
        got = generate(model, requests, 6, **cb)
        assert late[0] > 0 and graphs.stats()["graph_calls"] > 0
        assert got == expected, [rid for rid in expected if got[rid] != expected[rid]]
        monkeypatch.setattr(cb_graphs, "_after_default_stream", lambda device: None)
        unordered = generate(model, requests, 6, **cb)
    finally:
        graphs.disable()
    assert unordered != expected, "control: the late copy did not reach a step that does not wait for it"


def _preferred(reference: object, prompt: list[int], expected: list[int], got: list[int], i: int) -> str:
    """Which run's token ``i`` fp32 prefers (a failure says whose generation went wrong)."""
    ids = torch.tensor([prompt + expected[:i]], device="cuda")
    with torch.no_grad():
        exact = reference(input_ids=ids, use_cache=False).logits[0, -1].float()  # type: ignore[operator]
    best = "transformers' own run" if exact[expected[i]] > exact[got[i]] else "bcg's run"
    return f"fp32 prefers {best}'s token (expected {expected[i]}, got {got[i]}, fp32 argmax {exact.argmax().item()})"


def test_bf16_flash_tokens_differ_only_at_near_ties() -> None:
    """bf16, flash: requests equal to transformers' own CB are counted; each that differs is traced
    to where it first differs, which must be a near-tie (the two tokens' fp32 logits closer than
    bf16's own error there)."""
    seed = fresh_seed()
    model = tiny_llama(seed, device="cuda", dtype=torch.bfloat16, **SHAPE)
    requests = prompts(seed, 32, 1, 200, SHAPE["vocab"])
    expected = generate(model, requests, 16, **CB)
    graphs = bcg_transformers.enable(model)  # defaults: flash, every step of a bucket staged
    if not graphs.flash:
        pytest.skip("ATen's flash attention does not run here (needs sm80+)")
    got = generate(model, requests, 16, persistent_manager=True, **CB)  # (kept: the graphs to look at)
    stats = graphs.stats()
    runs = graphs.attention.runs
    print({k: stats[k] for k in ("captured_buckets", "capture_total_s", "fallbacks", "inline_replays",
                                 "staged_fallbacks", "steps")}, dict(runs))
    # the KV bound is the cache's capacity: every step staged, each bucket has one form (no breakable
    # form, no tier), and the gather kernel was loaded at enable
    forms = {n: [f.name for f in graphs.runner.graph(n).forms] for n in stats["captured_buckets"]}
    assert forms and all(names == ["inline"] for names in forms.values()), forms
    model.destroy_cached_continuous_batching_manager()  # its cache goes: so do the graphs
    gc.collect()
    assert graphs.runner is None and graphs.stats()["captured_buckets"] == stats["captured_buckets"]
    assert stats["kernel_load_s"] > 0
    assert stats["fallbacks"]["staged_unfit"] == 0 and stats["staged_fallbacks"] == {}
    graphs.disable()
    assert all(len(t) == 16 for t in got.values())
    # every Python run took flash (the captures of the staged forms, and the steps that ran eagerly,
    # on their own sizes), and replays ran inline
    assert runs["flash"] == runs["staged"] + runs["plain"] and runs["staged"] > 0 and runs["plain"] > 0
    assert stats["inline_replays"] > 0

    reference = tiny_llama(seed, device="cuda", dtype=torch.float32, **SHAPE)
    reference.set_attn_implementation("sdpa")
    model.set_attn_implementation("sdpa")
    index = {f"req_{i}": i for i in range(len(requests))}
    differ = [rid for rid in expected if got[rid] != expected[rid]]
    for rid in differ:
        i, gap, noise = divergence(reference, model, requests[index[rid]], expected[rid], got[rid])
        print(f"{rid}: prompt {len(requests[index[rid]])} tokens, first differs at token {i}: fp32 gap {gap:.4f}, "
              f"bf16 noise {noise:.4f}")
        assert gap <= 4 * noise, (f"{rid} differs at token {i} where fp32 tells the tokens apart ({gap} > 4 x {noise}): "
                                  f"{_preferred(reference, requests[index[rid]], expected[rid], got[rid], i)}")
    print(f"bf16 flash: {len(expected) - len(differ)}/{len(expected)} requests equal to transformers' CB")
    # control: the check tells a wrong token from a near-tie
    rid = next(iter(expected))
    wrong = [(expected[rid][0] + SHAPE["vocab"] // 2) % SHAPE["vocab"], *expected[rid][1:]]
    _, gap, noise = divergence(reference, model, requests[index[rid]], expected[rid], wrong)
    assert gap > 4 * noise, f"a wrong first token passed as a near-tie ({gap} <= 4 x {noise})"
    # flash sums in another order than transformers' sdpa: greedy tokens of a random-weight model
    # flip at near-ties, so most requests, not all, are expected to agree
    assert len(differ) <= len(expected) // 2


def test_flash_attention_staged_and_eager_equals_transformers_paged_sdpa() -> None:
    """One layer's flash attention on real CB steps vs transformers' own ``paged|sdpa`` on the same
    step: staged (with padded rows and padded keys) and eager on the step's own sizes (what a step
    that does not replay runs)."""
    import transformers

    from bcg.integrations.transformers.attention import flash_staged_attention, flash_step_attention, flash_usable
    from bcg.integrations.transformers.metadata import StaticIndices, StepMeta

    seed = fresh_seed()
    model = tiny_llama(seed, device="cuda", dtype=torch.bfloat16, **SHAPE)
    heads, dim = SHAPE["heads"], SHAPE["hidden"] // SHAPE["heads"]
    if not flash_usable(torch.device("cuda"), torch.bfloat16, dim):
        pytest.skip("ATen's flash attention does not run here (needs sm80+)")
    layer = model.model.layers[0].self_attn
    sdpa = transformers.AttentionInterface()["paged|sdpa"]
    cb = {**CB, "max_batch_tokens": 128}
    g = torch.Generator(device="cuda").manual_seed(seed)
    checked: list[tuple[int, int, int]] = []  # (tokens, keys, rows) of each step checked

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16) * scale

    def check(kwargs: dict) -> None:
        cache, T = kwargs["cache"], kwargs["input_ids"].shape[1]
        write, read = kwargs["write_index"][0], kwargs["read_index"][0]
        keys = read.numel() or T
        rows = min(T + 8, cache.max_batch_tokens)
        kv_heads = cache.num_key_value_heads
        q, k, v = randn(1, heads, rows, dim), randn(1, kv_heads, rows, dim), randn(1, kv_heads, rows, dim)
        # padded rows hold large values: they must neither reach the real rows nor come out
        for t, n in ((q, heads), (k, kv_heads), (v, kv_heads)):
            t[:, :, T:] = randn(1, n, rows - T, dim, scale=100.0)
        # transformers' own paged sdpa first (it writes the new K/V; the staged run writes the same)
        expected, _ = sdpa(layer, q[:, :, :T], k[:, :, :T], v[:, :, :T], attention_mask=kwargs["attention_mask"],
                           scaling=layer.scaling, dropout=0.0, cache=cache, read_index=[read], write_index=[write])
        indices = StaticIndices(cache, keys + 37, pad_reads=False)
        indices.read.fill_(int(write[0]))  # read slots past the step's keys: a real slot, never attended
        indices.load(StepMeta(cache=cache, tokens=T, write_index=write, read_index=read,
                              cu_q=kwargs["cu_seq_lens_q"], cu_k=kwargs["cu_seq_lens_k"], mask=None))
        out = torch.full((1, rows, heads, dim), float("nan"), dtype=torch.bfloat16, device="cuda")
        flash_staged_attention(layer, q, k, v, indices.staged(keys + 37), out)
        torch.testing.assert_close(out[:, :T], expected, atol=2e-2, rtol=2e-2)
        assert torch.equal(out[:, T:], torch.zeros_like(out[:, T:])), "padded rows are not zeros"
        # eager, on the step's own T rows and keys (it writes the same new K/V again)
        meta = StepMeta(cache=cache, tokens=T, write_index=write, read_index=read, cu_q=kwargs["cu_seq_lens_q"],
                        cu_k=kwargs["cu_seq_lens_k"], mask=None, max_q=kwargs["max_seqlen_q"],
                        max_k=kwargs["max_seqlen_k"])
        out.fill_(float("nan"))
        flash_step_attention(layer, q[:, :, :T], k[:, :, :T], v[:, :, :T], meta, out[:, :T])
        torch.testing.assert_close(out[:, :T], expected, atol=2e-2, rtol=2e-2)
        assert out[:, T:].isnan().all(), "the eager attention wrote past its T rows"
        checked.append((T, keys, rows))

    own = model.forward

    def forward(*args: object, **kwargs: object) -> object:
        if kwargs.get("cache") is not None and len(checked) < 8:
            check(kwargs)  # before the real forward, which then writes the layer's real K/V
        return own(*args, **kwargs)

    model.forward = forward
    try:
        generate(model, prompts(seed, 12, 20, 60, SHAPE["vocab"]), 6, **cb)
    finally:
        del model.forward
    print("checked (tokens, keys, rows):", checked)
    assert any(rows > T for T, _, rows in checked), "no step with padded rows was checked"
    assert any(keys > T for T, keys, _ in checked), "no step reading the cache was checked"


@pytest.mark.parametrize("programs", [None, 2], ids=["grid", "2-programs"])
def test_the_bounded_kv_read_moves_the_keys_a_replay_stages_and_no_more(programs: int | None,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``gather_keys`` captured once in a CUDA graph: each replay moves ``cu_k[-1]`` rows (staged
    after the capture, on the device), equal to ``index_select``; the rows past them are untouched.
    With 2 programs each loops over many row blocks (the grid-stride step)."""
    from bcg.integrations.transformers import gather
    from bcg.integrations.transformers.gather import gather_keys, triton_usable

    if not triton_usable():
        pytest.skip("Triton does not import here")
    if programs is not None:
        monkeypatch.setattr(gather, "_programs", lambda device: programs)
    seed = fresh_seed()
    g = torch.Generator(device="cuda").manual_seed(seed)
    slots, kv_heads, dim, bound = 4096, 2, 64, 1000
    k_cache = torch.randn(slots, kv_heads, dim, generator=g, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(slots, kv_heads, dim, generator=g, device="cuda", dtype=torch.bfloat16)
    index = torch.randperm(slots, generator=g, device="cuda")[:bound]
    cu_k = torch.zeros(9, dtype=torch.int32, device="cuda")
    keys = torch.empty(bound, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    values = torch.empty_like(keys)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the first call compiles the kernel, outside the capture
        gather_keys(k_cache, v_cache, index, cu_k[:5], keys, values)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gather_keys(k_cache, v_cache, index, cu_k[:5], keys, values)  # reads cu_k[4]
    for total in (1, 17, 999, 1000, 0, 345):
        cu_k.fill_(-1)
        cu_k[4] = total
        keys.fill_(float("nan"))
        values.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(keys[:total], k_cache[index[:total]]), total
        assert torch.equal(values[:total], v_cache[index[:total]]), total
        assert keys[total:].isnan().all() and values[total:].isnan().all(), f"rows past {total} were written"
