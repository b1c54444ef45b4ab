"""bcg.integrations.transformers on the CPU: transformers' continuous batching through a GraphRunner
in eager mode (same buckets, padding, staged and plain attention; no graphs) on tiny models of
random weights (Llama, and the architectures of ``ARCHITECTURES``)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import pytest
import torch

pytest.importorskip("transformers")

import bcg  # noqa: E402
import bcg.integrations.transformers as bcg_transformers  # noqa: E402

from .cb_models import fresh_seed, generate, prompts, tiny_llama  # noqa: E402

CB = {"block_size": 16, "num_blocks": 256, "max_batch_tokens": 128, "max_requests_per_batch": 16}
VOCAB = 512


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "plain"])
def test_tokens_equal_transformers_request_by_request(staged: bool) -> None:
    seed = fresh_seed()
    model = tiny_llama(seed, vocab=VOCAB)
    requests = prompts(seed, 32, 1, 90, VOCAB)
    expected = generate(model, requests, 8, **CB)
    graphs = bcg_transformers.enable(model, staged=staged, kv_bounds=(256, 1024, 4096))
    got = generate(model, requests, 8, **CB)
    assert got.keys() == expected.keys()
    differ = [rid for rid in expected if got[rid] != expected[rid]]
    assert not differ, f"requests {differ} differ"
    stats = graphs.stats()
    assert stats["mode"] == "eager" and stats["steps"] == stats["calls"] > 0
    runs = graphs.attention.runs
    if staged:  # most steps ran the attention inline over the static indices
        assert runs["staged"] > runs["plain"] > 0
    else:
        assert runs["plain"] > 0 and runs["staged"] == 0


def test_steps_above_every_kv_bound_run_plain_attention() -> None:
    seed = fresh_seed()
    model = tiny_llama(seed, vocab=VOCAB)
    requests = prompts(seed, 12, 20, 60, VOCAB)
    expected = generate(model, requests, 6, **CB)
    graphs = bcg_transformers.enable(model, kv_bounds=(32,))
    assert generate(model, requests, 6, **CB) == expected
    assert graphs.attention.runs["plain"] > 0


def test_a_second_session_gets_new_graphs_and_equal_tokens() -> None:
    seed = fresh_seed()
    model = tiny_llama(seed, vocab=VOCAB)
    first, second = prompts(seed, 10, 1, 50, VOCAB), prompts(seed + 1, 10, 1, 50, VOCAB)
    expected = [generate(model, first, 5, **CB), generate(model, second, 5, **CB)]
    graphs = bcg_transformers.enable(model, kv_bounds=(256, 4096))
    assert [generate(model, first, 5, **CB), generate(model, second, 5, **CB)] == expected
    assert graphs.stats()["sessions"] == 2


def on_each_step(model: object, seen: Callable[[dict], object]) -> None:
    """Wrap ``model.forward`` (``del model.forward`` unwraps) so that ``seen`` gets each CB step's
    keyword arguments."""
    forward = model.forward

    def watched(*args: object, **kwargs: object) -> object:
        if kwargs.get("cache") is not None:
            seen(kwargs)
        return forward(*args, **kwargs)

    model.forward = watched


def counting_steps(model: object) -> list[int]:
    """Wrap ``model.forward`` so that each CB step's token count is appended to the returned list."""
    steps: list[int] = []
    on_each_step(model, lambda kwargs: steps.append(kwargs["input_ids"].shape[1]))
    return steps


def own_run(model: object, requests: list[list[int]], new_tokens: int) -> tuple[dict[str, list[int]], list[int]]:
    """transformers' own CB run (``CB``): its tokens by request and each step's token count."""
    steps = counting_steps(model)
    expected = generate(model, requests, new_tokens, **CB)
    del model.forward
    return expected, steps


def test_a_bucket_is_captured_at_its_second_step() -> None:
    """A bucket's first step runs eagerly and captures nothing; its second captures it: a step
    size seen once gets no graph."""
    buckets = bcg.runner.default_buckets(CB["max_batch_tokens"], min_tokens=8)  # the masked ladder
    for _ in range(20):  # a fresh workload whose steps fill one bucket once and another more than twice
        seed = fresh_seed()
        model = tiny_llama(seed, vocab=VOCAB)
        requests = prompts(seed, 12, 1, 90, VOCAB)
        expected, steps = own_run(model, requests, 6)
        per_bucket: dict[int, int] = {}
        for T in steps:
            bucket = next(b for b in buckets if b >= T)
            per_bucket[bucket] = per_bucket.get(bucket, 0) + 1
        if 1 in per_bucket.values() and max(per_bucket.values()) > 2:  # the checks below can fail both ways
            break
    else:
        pytest.fail(f"20 workloads had no bucket with one step and one with more than two: {per_bucket}")
    graphs = bcg_transformers.enable(model)
    steps_with_bcg = counting_steps(model)
    assert generate(model, requests, 6, **CB) == expected
    assert graphs.stats()["buckets"] == buckets and steps_with_bcg == steps
    stats = graphs.stats()
    assert stats["captured_buckets"] == sorted(b for b, calls in per_bucket.items() if calls >= 2)
    assert stats["fallbacks"]["not_captured_yet"] == sum(min(calls, 2) for calls in per_bucket.values())
    del model.forward
    graphs.disable()


@pytest.mark.parametrize("pad_reads", [True, False])
def test_static_indices_load_pads_reads_only_when_asked(pad_reads: bool) -> None:
    """The masked attention reads every read slot (those past the step's keys must be the trash);
    flash reads only the step's keys, so a step does not refill the rest of the cache's capacity."""
    from types import SimpleNamespace

    from bcg.integrations.transformers.metadata import StaticIndices, StepMeta

    class Cache(SimpleNamespace):  # (held weakly)
        pass

    g = torch.Generator().manual_seed(fresh_seed())
    cache = Cache(key_cache=[torch.zeros(1)], max_batch_tokens=16, write_trash_index=1000, read_trash_index=1001)
    indices = StaticIndices(cache, 64, pad_reads=pad_reads)
    reads = []
    for T, K in ((int(torch.randint(9, 17, (1,), generator=g)), 60), (int(torch.randint(1, 9, (1,), generator=g)), 20)):
        write, read = torch.randperm(900, generator=g)[:T], torch.randperm(900, generator=g)[:K]
        indices.load(StepMeta(cache=cache, tokens=T, write_index=write, read_index=read,
                              cu_q=torch.tensor([0, T], dtype=torch.int32), cu_k=torch.tensor([0, K], dtype=torch.int32),
                              mask=None))
        assert torch.equal(indices.write[:T], write) and (indices.write[T:] == 1000).all()
        assert torch.equal(indices.read[:K], read)
        assert (indices.cu_q[2:] == T).all() and (indices.cu_k[2:] == K).all()  # padded requests: empty
        reads.append(read)
    # past the second step's 20 keys: the trash if padded, else the first step's reads (and the
    # buffer's initial trash past its 60)
    expected = torch.full((44,), 1001) if pad_reads else torch.cat([reads[0][20:], torch.full((4,), 1001)])
    assert torch.equal(indices.read[20:], expected)
    # inert for a capture: every row writes to the trash and no request has a key; the read slots
    # go to the trash only if the attention reads past the keys
    indices.clear()
    assert (indices.write == 1000).all() and (indices.cu_q == 0).all() and (indices.cu_k == 0).all()
    assert torch.equal(indices.read, torch.full((64,), 1001)) if pad_reads else torch.equal(indices.read[:20], reads[1])


def test_steps_above_the_ladder_run_eagerly_and_equal_transformers() -> None:
    """A step larger than the last bucket runs eagerly on its own tokens (counted as ``too_large``),
    capturing nothing; the tokens equal transformers' own, and the smaller steps still run on bcg."""
    seed = fresh_seed()
    model = tiny_llama(seed, vocab=VOCAB)
    requests = prompts(seed, 10, 20, 90, VOCAB)
    expected, steps = own_run(model, requests, 6)
    assert max(steps) > 16 and min(steps) <= 16, steps  # (prompts of 20+ tokens, decode steps of <= 10)
    graphs = bcg_transformers.enable(model, buckets=[8, 16])
    assert generate(model, requests, 6, persistent_manager=True, **CB) == expected
    stats = graphs.stats()
    assert stats["fallbacks"]["too_large"] == sum(T > 16 for T in steps)
    assert set(stats["captured_buckets"]) <= {8, 16} and stats["steps"] == len(steps)
    model.destroy_cached_continuous_batching_manager()
    graphs.disable()


def test_other_forwards_and_disable_leave_the_model_as_it_was() -> None:
    seed = fresh_seed()
    model = tiny_llama(seed, vocab=VOCAB)
    ids = torch.randint(1, VOCAB, (2, 9))
    model.set_attn_implementation("sdpa")
    expected = model(input_ids=ids).logits
    model.set_attn_implementation("paged|sdpa")
    graphs = bcg_transformers.enable(model)
    model.set_attn_implementation("sdpa")  # not a CB call: the model's own forward
    torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)
    model.set_attn_implementation("paged|sdpa")
    assert "forward" in vars(model.base_model)
    graphs.disable()
    assert "forward" not in vars(model) and "forward" not in vars(model.base_model) and graphs.stats()["steps"] == 0


# Causal LMs whose head is more than the output embeddings (Granite and Cohere scale the logits),
# whose base model returns more than hidden states (Mixtral's router logits), or whose decoder
# differs from Llama's (Qwen3's and OLMo2's query/key norms, Gemma's scaled embeddings, Phi-3's
# fused projections), each with the config values that make the difference show
ARCHITECTURES = {
    "Llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "Granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 4.0, "embedding_multiplier": 2.0,
                                                        "residual_multiplier": 0.5, "attention_multiplier": 0.3}),
    "Cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.25}),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "Olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "Gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "Mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "Phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # (these two call their base model with input_ids by position, and have no grouped KV heads)
    "GPT2": ("GPT2Config", "GPT2LMHeadModel", {"num_key_value_heads": 4}),
    "GPTNeoX": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"num_key_value_heads": 4}),
}


def tiny_model(arch: str, seed: int) -> object:
    """A two-layer model of ``arch`` (random weights), attention ``paged|sdpa``."""
    import transformers

    config_name, model_name, extra = ARCHITECTURES[arch]
    shape = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096}
    config = getattr(transformers, config_name)(**{**shape, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    model.set_attn_implementation("paged|sdpa")
    return model


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logprobs_and_tokens_equal_transformers_across_architectures(arch: str,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The model's own forward keeps its head: logits_to_keep, and any scaling of the logits (which
    greedy tokens would not show, its logprobs do)."""
    import transformers
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    seed = fresh_seed()
    model = tiny_model(arch, seed)
    requests = prompts(seed, 10, 1, 60, VOCAB)
    generation = transformers.GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=0)

    def generate_with_logprobs() -> dict[str, tuple[list[int], list[float]]]:
        cb = ContinuousBatchingConfig(**CB, return_logprobs=True)
        out = model.generate_batch(requests, generation_config=generation, continuous_batching_config=cb)
        return {rid: (list(o.generated_tokens), list(o.logprobs)) for rid, o in out.items()}

    expected = generate_with_logprobs()
    graphs = bcg_transformers.enable(model)
    with caplog.at_level(logging.WARNING, logger="bcg"):
        got = generate_with_logprobs()
    assert not [r for r in caplog.records if r.name == "bcg"]  # every step ran on bcg
    assert graphs.stats()["steps"] > 0
    assert got.keys() == expected.keys()
    for rid, (tokens, logprobs) in expected.items():
        assert got[rid][0] == tokens, f"request {rid}"
        torch.testing.assert_close(torch.tensor(got[rid][1]), torch.tensor(logprobs), rtol=1e-5, atol=1e-5)
    graphs.disable()


def test_a_composite_model_runs_its_text_steps_on_bcg() -> None:
    """A vision-language model (Llava): its text config sizes the attention, and its CB steps
    (text only) run through bcg with transformers' own tokens."""
    import transformers

    seed = fresh_seed()
    text = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 32, "patch_size": 8}
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        text_config=text.to_dict(), vision_config=vision, image_token_index=VOCAB - 1)).eval()
    model.set_attn_implementation("paged|sdpa")
    requests = prompts(seed, 8, 1, 60, VOCAB - 1)
    expected = generate(model, requests, 5, **CB)
    graphs = bcg_transformers.enable(model)
    assert generate(model, requests, 5, **CB) == expected and graphs.stats()["steps"] > 0
    graphs.disable()


def test_sampled_tokens_equal_transformers_with_its_seed() -> None:
    """Sampling (temperature, top-k, top-p) stays transformers': with its CB seed the tokens and
    their logprobs equal its own, on a model whose head scales the logits (Granite), which sampling
    depends on."""
    import transformers
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    seed = fresh_seed()
    model = tiny_model("Granite", seed)
    with torch.no_grad():  # logits of a few units (random weights give about 0.1): sampling follows them
        model.get_output_embeddings().weight.mul_(30)
    requests = prompts(seed, 10, 1, 60, VOCAB)
    generation = transformers.GenerationConfig(max_new_tokens=6, do_sample=True, temperature=0.8, top_k=50, top_p=0.9,
                                               eos_token_id=-1, pad_token_id=0)

    def sample() -> dict[str, tuple[list[int], torch.Tensor]]:
        cb = ContinuousBatchingConfig(**CB, seed=seed, return_logprobs=True)
        out = model.generate_batch(requests, generation_config=generation, continuous_batching_config=cb)
        return {rid: (list(o.generated_tokens), torch.tensor(o.logprobs)) for rid, o in out.items()}

    expected = sample()
    assert {r: t for r, (t, _) in sample().items()} == {r: t for r, (t, _) in expected.items()}  # (it repeats)
    graphs = bcg_transformers.enable(model)
    got = sample()
    assert graphs.stats()["steps"] > 0 and got.keys() == expected.keys()
    for rid, (tokens, logprobs) in expected.items():
        assert got[rid][0] == tokens, f"request {rid}"
        torch.testing.assert_close(got[rid][1], logprobs, rtol=1e-5, atol=1e-5)
    graphs.disable()


def test_wrappers_of_the_base_forward_before_and_after_enable(caplog: pytest.LogCaptureFixture) -> None:
    """A ``*args`` wrapper on GPT-2's base model (which takes input_ids by position) before enable:
    its steps run transformers' forward and a warning says why, plain calls still work. A wrapper
    added after enable outlives disable (with a warning); calls through it run the model's own."""
    seed = fresh_seed()
    model = tiny_model("GPT2", seed)
    requests = prompts(seed, 6, 1, 40, VOCAB)
    ids = torch.randint(1, VOCAB, (2, 9))

    def plain() -> torch.Tensor:  # a plain forward, ids by position (with a non-paged attention)
        model.set_attn_implementation("sdpa")
        try:
            return model(ids).logits
        finally:
            model.set_attn_implementation("paged|sdpa")

    expected, logits = generate(model, requests, 4, **CB), plain()
    own = model.base_model.forward

    def before(*args: object, **kwargs: object) -> object:
        return own(*args, **kwargs)

    model.base_model.forward = before
    graphs = bcg_transformers.enable(model)
    with caplog.at_level(logging.WARNING, logger="bcg"):
        assert generate(model, requests, 4, **CB) == expected
        torch.testing.assert_close(plain(), logits, rtol=0, atol=0)
    warnings = [r.getMessage() for r in caplog.records if r.name == "bcg"]
    assert len(warnings) == 1 and "by position" in warnings[0] and graphs.steps == 0, warnings
    graphs.disable()
    assert vars(model.base_model)["forward"] is before
    del model.base_model.forward
    caplog.clear()

    graphs = bcg_transformers.enable(model)
    enabled = model.base_model.forward

    def after(*args: object, **kwargs: object) -> object:
        return enabled(*args, **kwargs)

    model.base_model.forward = after
    with caplog.at_level(logging.WARNING, logger="bcg"):
        assert generate(model, requests, 4, **CB) == expected and graphs.steps > 0
        graphs.disable()
        assert generate(model, requests, 4, **CB) == expected
    warnings = [r.getMessage() for r in caplog.records if r.name == "bcg"]
    assert len(warnings) == 1 and "wrapped again after enable" in warnings[0], warnings
    assert vars(model.base_model)["forward"] is after


def test_a_step_transformers_compiles_runs_its_compiled_forward() -> None:
    """Under transformers' compile configs each step is compiled whole (fullgraph), which cannot call
    into bcg: bcg steps aside there, and the tokens are transformers' compiled ones."""
    seed = fresh_seed()
    model = tiny_llama(seed, vocab=VOCAB, layers=1)
    requests = prompts(seed, 3, 1, 20, VOCAB)
    compiled = {**CB, "default_compile_level": 1}
    expected = generate(model, requests, 3, **compiled)
    graphs = bcg_transformers.enable(model)
    assert generate(model, requests, 3, **compiled) == expected and graphs.steps == 0
    graphs.disable()


def test_disable_lets_the_model_go_and_restores_a_wrapper_it_found() -> None:
    """After ``disable`` nothing of bcg holds the model's layers (its attention function is
    unregistered), and a forward wrapper that was on the base model before ``enable`` is back."""
    import gc
    import weakref

    import transformers

    seed = fresh_seed()
    model = tiny_llama(seed, vocab=VOCAB)
    theirs = model.base_model.forward  # (a wrapper of someone else's, as accelerate's hooks install)
    model.base_model.forward = theirs
    graphs = bcg_transformers.enable(model)
    requests = prompts(seed, 6, 1, 40, VOCAB)
    generate(model, requests, 4, **CB)
    assert graphs.stats()["steps"] > 0 and graphs.name in transformers.AttentionInterface()
    graphs.disable()
    assert graphs.name not in transformers.AttentionInterface() and vars(model.base_model)["forward"] is theirs
    layer = weakref.ref(model.base_model.layers[0].self_attn)
    del model, theirs, graphs  # (the user drops the model and the handle)
    gc.collect()
    assert layer() is None
    # a model and its handle dropped without disable go too
    model = tiny_llama(seed, vocab=VOCAB)
    graphs = bcg_transformers.enable(model)
    generate(model, requests, 4, **CB)
    assert graphs.stats()["steps"] > 0
    layer = weakref.ref(model.base_model.layers[0].self_attn)
    del model, graphs
    gc.collect()
    assert layer() is None


def test_a_model_left_at_sdpa_runs_its_cb_sessions_on_bcg_and_keeps_sdpa() -> None:
    """transformers' CB switches a model at "sdpa" to "paged|sdpa" for a session and back when it
    stops: enable() takes such a model, and its other forwards stay transformers' sdpa."""
    seed = fresh_seed()
    model = tiny_llama(seed, vocab=VOCAB)
    model.set_attn_implementation("sdpa")
    requests = prompts(seed, 10, 1, 60, VOCAB)
    expected = generate(model, requests, 5, **CB)
    ids = torch.randint(1, VOCAB, (2, 9))
    logits = model(input_ids=ids).logits
    graphs = bcg_transformers.enable(model)
    assert generate(model, requests, 5, **CB) == expected
    assert graphs.stats()["steps"] > 0 and graphs.attention.runs["staged"] > 0
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(model(input_ids=ids).logits, logits, rtol=0, atol=0)
    graphs.disable()


@pytest.mark.parametrize("case", ["attention", "no-base-model-call"])
def test_a_step_bcg_cannot_run_runs_transformers_forward_and_says_why_once(case: str,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    """A CB step that cannot run on bcg runs transformers' own forward (the tokens stay its own),
    and one warning says why: the session runs another attention than enable saw (transformers
    switches a model at "sdpa" to "paged|flash_attention_2" where flash-attn is installed), or the
    model's forward does not call its base model (OPT's calls ``model.decoder``)."""
    import transformers

    seed = fresh_seed()
    if case == "attention":
        model = tiny_llama(seed, vocab=VOCAB)
        why = "attention 'paged[|]eager'.*set_attn_implementation[(]'paged[|]sdpa'[)]"
    else:
        torch.manual_seed(seed)
        model = transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=VOCAB, hidden_size=64, ffn_dim=128, word_embed_proj_dim=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=512)).eval()
        why = "does not pass it to its base model [(]OPTModel"
    requests = prompts(seed, 8, 1, 60, VOCAB)
    session = "paged|eager" if case == "attention" else "paged|sdpa"
    model.set_attn_implementation(session)
    expected = generate(model, requests, 5, **CB)  # transformers' own, with the session's attention
    model.set_attn_implementation("paged|sdpa")
    graphs = bcg_transformers.enable(model)
    model.set_attn_implementation(session)  # (for "attention": the switch, as transformers would make it)
    with caplog.at_level(logging.WARNING, logger="bcg"):
        assert generate(model, requests, 5, **CB) == expected
    warnings = [r.getMessage() for r in caplog.records if r.name == "bcg"]
    assert len(warnings) == 1 and re.search(why, warnings[0]), warnings
    assert graphs.stats()["steps"] == 0
    graphs.disable()


def test_a_sessions_graphs_go_with_the_cache_transformers_drops() -> None:
    """The graphs hold a session's cache tensors, whose memory the next session's cache needs:
    when transformers drops the cache (a manager that is not kept), bcg frees them; with a kept
    manager they stay until it is destroyed. ``stats()`` still reports the ended session."""
    import gc
    import weakref

    seed = fresh_seed()
    model = tiny_llama(seed, vocab=VOCAB)
    requests = prompts(seed, 8, 1, 60, VOCAB)
    expected = generate(model, requests, 4, **CB)
    graphs = bcg_transformers.enable(model)
    caches: list[weakref.ref] = []

    def watch(kwargs: dict) -> None:
        if not any(c() is kwargs["cache"] for c in caches):
            caches.append(weakref.ref(kwargs["cache"]))

    on_each_step(model, watch)
    assert generate(model, requests, 4, **CB) == expected
    gc.collect()
    assert len(caches) == 1 and caches[0]() is None and graphs.runner is None
    ended = graphs.stats()
    assert ended["captured_buckets"] and ended["steps"] > 0 and ended["sessions"] == 1
    generate(model, requests, 4, persistent_manager=True, **CB)
    gc.collect()
    assert len(caches) == 2 and caches[1]() is not None and graphs.runner is not None
    model.destroy_cached_continuous_batching_manager()
    gc.collect()
    assert caches[1]() is None and graphs.runner is None and graphs.stats()["sessions"] == 2
    # a cache that outlives its session (held here) and goes during a later session: that
    # session's graphs stay
    held: list[object] = []

    def hold(kwargs: dict) -> None:
        if not any(c is kwargs["cache"] for c in held):
            held.append(kwargs["cache"])

    del model.forward
    on_each_step(model, hold)
    generate(model, requests, 4, **CB)
    assert graphs.runner is not None  # (its cache is held)
    generate(model, requests, 4, persistent_manager=True, **CB)
    assert len(held) == 2 and graphs.stats()["sessions"] == 4
    del held[:]
    gc.collect()
    assert graphs.runner is not None  # the third session's cache went during the fourth: its graphs stay
    model.destroy_cached_continuous_batching_manager()
    gc.collect()
    assert graphs.runner is None
    del model.forward
    graphs.disable()


def test_enabling_again_replaces_the_previous_handle() -> None:
    seed = fresh_seed()
    model = tiny_llama(seed, vocab=VOCAB)
    requests = prompts(seed, 6, 1, 40, VOCAB)
    expected = generate(model, requests, 4, **CB)
    first = bcg_transformers.enable(model)
    assert generate(model, requests, 4, persistent_manager=True, **CB) == expected
    assert first.runner is not None  # (the manager is kept: so are its cache and the graphs)
    steps = first.steps
    second = bcg_transformers.enable(model)
    assert first.runner is None  # disabled: its graphs freed
    model.destroy_cached_continuous_batching_manager()
    assert generate(model, requests, 4, **CB) == expected
    assert second.steps > 0 and first.steps == steps  # every step went to the new handle
    first.disable()  # a stale handle leaves the new one in place
    assert vars(model.base_model)["forward"] == second._forward
    second.disable()
    assert "forward" not in vars(model.base_model)


def test_enable_refuses_what_it_cannot_run() -> None:
    from bcg.integrations.transformers.graphs import _paged_base

    model = tiny_llama(0, vocab=VOCAB)
    model.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match="attention is 'flex_attention'.*'sdpa'"):
        bcg_transformers.enable(model)
    assert "forward" not in vars(model.base_model)
    with pytest.raises(ValueError, match="attention is 'paged[|]flash_attention_2'"):
        _paged_base("paged|flash_attention_2")  # (setting it needs the flash-attn package)
    assert [_paged_base(n) for n in ("sdpa", "eager", "paged|sdpa", "paged|eager")] == [
        "paged|sdpa", "paged|eager", "paged|sdpa", "paged|eager"]
    model.set_attn_implementation("paged|eager")
    with pytest.raises(ValueError, match="kv_bounds"):
        bcg_transformers.enable(model, kv_bounds=(4096, 1024))
    with pytest.raises(ValueError, match="mode"):
        bcg_transformers.enable(model, mode="fast")


@pytest.mark.parametrize("buckets", [[], [0, 8], [8, 8.5]])
def test_enable_refuses_a_bad_bucket_ladder(buckets: list) -> None:
    """A ladder the runner would refuse is refused by ``enable``, not at the first step (where
    transformers would catch it and fail every request)."""
    model = tiny_llama(0, vocab=VOCAB)
    with pytest.raises((ValueError, TypeError), match="buckets"):
        bcg_transformers.enable(model, buckets=buckets)
    assert "forward" not in vars(model.base_model)


def test_a_bucket_above_the_caches_step_size_is_cut_to_it() -> None:
    """``max_batch_tokens`` bounds every step: a bucket above it becomes a bucket of that size,
    which captures (the static indices hold that many tokens) and runs the steps above the others."""
    torch.manual_seed(fresh_seed())
    model = tiny_llama(1)
    requests = prompts(1, 12, 1, 90, 512)
    expected = generate(model, requests, 6, **CB)
    graphs = bcg_transformers.enable(model, buckets=[4, 16, 256])
    try:
        assert generate(model, requests, 6, **CB) == expected
        stats = graphs.stats()
    finally:
        graphs.disable()
    assert not stats["failed_buckets"] and stats["fallbacks"]["capture_failed"] == 0
    assert max(stats["buckets"]) == CB["max_batch_tokens"]


def test_defaults_without_flash_keep_the_masked_staged_attention() -> None:
    model = tiny_llama(0, vocab=VOCAB)  # fp32 on the CPU: no flash
    graphs = bcg_transformers.enable(model)
    assert graphs.flash is False
    assert graphs.staged_max_tokens == bcg_transformers.DEFAULT_STAGED_MAX_TOKENS
    assert graphs.attention.kv_bounds == bcg_transformers.DEFAULT_KV_BOUNDS
    requests = prompts(fresh_seed(), 6, 1, 40, VOCAB)
    generate(model, requests, 4, **CB)
    # the masked attention's ladder starts at 8 (its work follows the bucket's rows)
    assert graphs.stats()["buckets"] == bcg.runner.default_buckets(CB["max_batch_tokens"], min_tokens=8)
    graphs.disable()
    graphs = bcg_transformers.enable(model, staged_max_tokens=64, kv_bounds=(128,))
    assert graphs.staged_max_tokens == 64 and graphs.attention.kv_bounds == (128,)
    graphs.disable()
    with pytest.raises(ValueError, match="staged_max_tokens"):
        bcg_transformers.enable(model, staged_max_tokens=-1)


def test_paged_eager_attention_equals_transformers() -> None:
    seed = fresh_seed()
    model = tiny_llama(seed, vocab=VOCAB)
    model.set_attn_implementation("paged|eager")
    requests = prompts(seed, 16, 1, 70, VOCAB)
    expected = generate(model, requests, 6, **CB)
    bcg_transformers.enable(model, kv_bounds=(256, 4096))
    assert generate(model, requests, 6, **CB) == expected


def test_the_example_runs_and_its_tokens_are_equal() -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "transformers_cb.py"
    spec = importlib.util.spec_from_file_location("transformers_cb_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--requests", "8", "--new-tokens", "4", "--seed", str(fresh_seed())]) is True


def test_divergence_tells_a_near_tie_from_a_wrong_token() -> None:
    from bcg.integrations.transformers import divergence

    seed = fresh_seed()
    shape = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256, "vocab": 1024}
    reference = tiny_llama(seed, **shape)
    half = tiny_llama(seed, dtype=torch.bfloat16, **shape)
    for m in (reference, half):
        m.set_attn_implementation("sdpa")
    prompt = prompts(seed, 1, 8, 40, shape["vocab"])[0]
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor([prompt + [5]])).logits[0, -1]
    ranked = logits.argsort(descending=True).tolist()
    best, second, worst = ranked[0], ranked[1], ranked[-1]
    i, gap, noise = divergence(reference, half, prompt, [5, best], [5, second])
    assert i == 1 and noise > 0
    assert gap == pytest.approx((logits[best] - logits[second]).item(), abs=1e-5)
    i, gap, noise = divergence(reference, half, prompt, [5, best, 1], [5, worst, 1])
    assert i == 1 and gap > 4 * noise
    with pytest.raises(ValueError, match="agree"):
        divergence(reference, half, prompt, [5, best], [5, best])


def test_with_flash_each_bucket_gets_one_staged_form_over_the_cache_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the staged attention runs flash (its work follows the real keys at any bound), a CB
    session's buckets each capture one form bounded by the cache's capacity, and no breakable
    form, whatever ``kv_bounds`` asks (bounds for the masked attention)."""
    from types import SimpleNamespace

    from bcg.integrations.transformers import graphs as graphs_module
    from bcg.integrations.transformers.metadata import CaptureMeta

    loads = []
    monkeypatch.setattr(graphs_module, "_flash_model", lambda model: True)  # (flash needs a GPU)
    monkeypatch.setattr(graphs_module, "load_kernel", lambda *args: loads.append(args) or 0.25)
    class Cache(SimpleNamespace):  # (bcg holds a session's cache weakly)
        pass

    cache = Cache(max_batch_tokens=64, num_pages=960, key_cache=[torch.zeros(1)],
                            write_trash_index=0, read_trash_index=1)
    capacity = cache.num_pages + cache.max_batch_tokens
    ids = torch.zeros(1, 8, dtype=torch.long)
    for asked in (None, (100,), (600, 4096)):
        graphs = bcg_transformers.enable(tiny_llama(0, vocab=VOCAB), kv_bounds=asked, mode="eager")
        assert graphs.flash and graphs.staged_max_tokens >= cache.max_batch_tokens
        assert graphs.stats()["kernel_load_s"] == 0.25 and len(loads) == 1 and loads.pop()[2:] == (2, 16)
        graphs._runner_for(cache, ids)
        assert graphs.attention.kv_bounds == (capacity,)
        assert graphs.attention.indices is not None and graphs.attention.indices.read.numel() == capacity
        for tokens in (8, 64):
            tiers = graphs._capture_live(tokens)
            assert not tiers.breakable and list(tiers) == [CaptureMeta(capacity)]
        assert graphs.runner.buckets == [64]  # the first bucket is cut to the cache's max_batch_tokens
        graphs.disable()
    # the default ladder: FLASH_MIN_BUCKET, then doubling up to FLASH_MAX_BUCKET, both cut to
    # max_batch_tokens (larger steps run eagerly); a ladder passed is kept
    for asked, widest, expected in ((None, 1000, [128, 256, 512]), (None, 300, [128, 256, 300]),
                                    ([8, 64, 1000], 1000, [8, 64, 1000])):
        graphs = bcg_transformers.enable(tiny_llama(0, vocab=VOCAB), buckets=asked, mode="eager")
        wide = Cache(**{**vars(cache), "max_batch_tokens": widest})
        graphs._runner_for(wide, ids)
        assert graphs.runner.buckets == expected
        graphs.disable()


@pytest.mark.parametrize("config", [{"sliding_window": 64}, {"layer_types": ["sliding_attention", "full_attention"],
                                                              "sliding_window": 64}], ids=["all", "mixed"])
def test_sliding_window_attention_is_refused_at_enable(config: dict) -> None:
    """transformers' CB cache gives sliding-window layers (Mistral's, Gemma 2's) their own read
    order and a windowed mask, which the staged and plain attention do not run: enable raises."""
    import transformers

    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, **config)).eval()
    model.set_attn_implementation("paged|sdpa")
    with pytest.raises(ValueError, match="sliding_attention.*full attention only"):
        bcg_transformers.enable(model)
    assert "forward" not in vars(model.base_model)


def test_a_flash_kernel_that_does_not_load_leaves_the_masked_attention(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    from bcg.integrations.transformers import graphs as graphs_module

    def broken(*args: object) -> float:
        raise RuntimeError("no C compiler")

    monkeypatch.setattr(graphs_module, "_flash_model", lambda model: True)
    monkeypatch.setattr(graphs_module, "load_kernel", broken)
    with caplog.at_level("WARNING", logger="bcg"):
        graphs = bcg_transformers.enable(tiny_llama(0, vocab=VOCAB))
    assert "no C compiler" in caplog.text
    assert graphs.flash is False and graphs.attention.flash is False and graphs.stats()["kernel_load_s"] == 0.0
    assert graphs.attention.kv_bounds == bcg_transformers.DEFAULT_KV_BOUNDS
    assert graphs.staged_max_tokens == bcg_transformers.DEFAULT_STAGED_MAX_TOKENS
    graphs.disable()


def test_a_flash_setup_refuses_a_model_cast_after_enable() -> None:
    """The flash decision is made at enable(): a staged run whose queries flash cannot take (here
    fp32 on the CPU) raises, naming what to do, instead of running flash on them."""
    import bcg
    from bcg.integrations.transformers.attention import PagedAttention
    from bcg.integrations.transformers.metadata import Staged

    attention = PagedAttention(lambda *args, **kwargs: None, staged=True, kv_bounds=(64,), flash=True,
                               staged_max_tokens=64)
    layer = torch.nn.Module()
    attention.modules[0] = layer  # (held weakly there)
    q, kv = torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 8, 16)
    index, cu = torch.zeros(64, dtype=torch.long), torch.zeros(9, dtype=torch.int32)
    with bcg.live_scope(Staged(cache=None, write=index, read=index, cu_q=cu, cu_k=cu, kv_bound=64)):
        with pytest.raises(RuntimeError, match=r"disable\(\) and enable\(\) again"):
            attention._attend(q, kv, kv, torch.empty(1, 8, 4, 16), 0)
    assert attention.runs["flash"] == 0


def test_the_manager_streams_requests_added_while_it_runs() -> None:
    """transformers' ``ContinuousBatchingManager`` (the engine behind ``transformers serve``): its
    background thread runs the steps through bcg, requests added while it runs are streamed token
    by token, and each request's tokens equal transformers' own."""
    import transformers
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    seed = fresh_seed()
    model = tiny_llama(seed, vocab=VOCAB)
    requests = prompts(seed, 8, 1, 60, VOCAB)
    new_tokens = 6

    def serve() -> dict[str, list[list[int]]]:
        generation = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                                                   pad_token_id=0)
        manager = model.init_continuous_batching(generation_config=generation,
                                                 continuous_batching_config=ContinuousBatchingConfig(**CB))
        manager.start()
        streamed: dict[str, list[list[int]]] = {}
        try:
            half = len(requests) // 2
            for i, request in enumerate(requests[:half]):
                manager.add_request(request, request_id=f"r{i}", max_new_tokens=new_tokens, streaming=True)
            finished = 0
            while finished < len(requests):
                out = manager.get_result(timeout=60)
                if len(streamed) == 0:  # the first result is out: the rest join a running loop
                    for i, request in enumerate(requests[half:], half):
                        manager.add_request(request, request_id=f"r{i}", max_new_tokens=new_tokens, streaming=True)
                assert out is not None and out.error is None, out
                streamed.setdefault(out.request_id, []).append(list(out.generated_tokens))
                finished += out.is_finished()
        finally:
            manager.stop(block=True)
            manager.destroy()
        return streamed

    expected = serve()
    graphs = bcg_transformers.enable(model)
    got = serve()
    assert graphs.stats()["steps"] > 0
    assert {rid: s[-1] for rid, s in got.items()} == {rid: s[-1] for rid, s in expected.items()}
    for rid, stream in got.items():  # each streamed result holds the tokens so far
        assert len(stream[-1]) == new_tokens and all(stream[-1][: len(s)] == s for s in stream), rid
    assert max(map(len, got.values())) > 1  # the tokens came in more than one result
    graphs.disable()


def test_buckets_above_staged_max_tokens_run_a_plain_attention_and_warn_of_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    """Buckets above ``staged_max_tokens`` have no staged form by design: their steps run the plain
    attention, equal to transformers, with no warning that the staged form did not fit."""
    seed = fresh_seed()
    model = tiny_llama(seed, vocab=VOCAB)
    requests = prompts(seed, 12, 20, 60, VOCAB)  # prefill steps of more than 16 tokens, decode steps of fewer
    expected = generate(model, requests, 6, **CB)
    graphs = bcg_transformers.enable(model, staged_max_tokens=16, kv_bounds=(256, 4096))
    try:
        with caplog.at_level(logging.INFO, logger="bcg"):
            assert generate(model, requests, 6, **CB) == expected
        stats = graphs.stats()
    finally:
        graphs.disable()
    assert max(stats["buckets"]) > 16 and min(stats["buckets"]) <= 16
    runs = graphs.attention.runs
    assert runs["staged"] > 0 and runs["plain"] > 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
