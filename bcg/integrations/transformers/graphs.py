"""``ContinuousBatchingGraphs``: transformers' continuous batching with its forward in a bcg ``GraphRunner``.

The one place transformers is wrapped is the base model's ``forward`` (``model.base_model``, an
instance attribute, so only this model is affected): transformers' ``ModelRunner`` calls
``model(**PagedAttentionArgs)`` once per step, the model's own forward passes those to its base
model and then runs its head, and transformers does everything else itself (scheduling, the
paged cache and its indices, logits processing, sampling, async batching). A base-model call
that carries a ``PagedAttentionCache`` runs the decoder through a lazy :class:`bcg.GraphRunner`
bucketed on the step's token count, with the attention a breakpoint (:mod:`.attention`), each
bucket captured at its second step, unless bcg cannot run it (``_why_not``; hooks on the model
log one warning per reason). Every other call goes to the base model's own forward. Tested with
transformers 5.17.0.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

import bcg
from bcg.integrations.transformers.attention import PagedAttention, flash_usable
from bcg.integrations.transformers.gather import load_kernel
from bcg.integrations.transformers.metadata import CaptureMeta, StaticIndices, StepMeta

log = logging.getLogger("bcg")

# The handle enabled on each model (enable again disables it): both held weakly (a model and its
# handle dropped without disable go, with what transformers' attention registry keeps of them).
_ENABLED: weakref.WeakKeyDictionary[Any, weakref.ref[ContinuousBatchingGraphs]] = weakref.WeakKeyDictionary()

#: The attention implementations whose paged function the integration calls.
BASES = ("paged|sdpa", "paged|eager")

#: KV bounds of the staged forms (keys read per step, all requests packed), smallest first, where
#: the staged attention runs transformers' function with a dense mask (its work follows the bound).
DEFAULT_KV_BOUNDS = (4096, 16384, 65536)
#: Buckets above it run the attention as a plain breakpoint, where it runs with a dense mask
#: (whose size follows the bucket's rows times the bound).
DEFAULT_STAGED_MAX_TOKENS = 512
#: The smallest default bucket where the staged attention runs flash. Its work follows each step's
#: real rows and keys, so a bucket's padded rows cost only the token-shaped matmuls, which up to
#: about this many rows take the time of reading their weights (memory-bound in half precision
#: on sm80 and newer): smaller buckets would add graphs, not speed. (The masked attention's work
#: follows the bucket's rows, so its ladder starts at 8.)
FLASH_MIN_BUCKET = 128
#: The largest default bucket where the staged attention runs flash. A larger step runs eagerly, on
#: its own tokens (no padding), the attention with the same flash kernel: its GPU work outlasts the
#: launches of an eager forward of the models this is served with, so a graph would add captures and
#: padding, not speed (``docs/transformers.md``). ``buckets=`` up to ``max_batch_tokens`` graphs every
#: step (a small model, whose large steps stay host-bound).
FLASH_MAX_BUCKET = 512
#: A bucket is captured at its second step (the first runs eagerly), as torch's CUDA graph trees
#: record a function at its second call: a step size seen once (a drained queue's last prefill
#: chunk) gets no graph.
CAPTURE_AT_STEP = 2


class ContinuousBatchingGraphs:
    """A model whose continuous-batching forward replays through a :class:`bcg.GraphRunner`.

    Built by :func:`bcg.integrations.transformers.enable` (its arguments are documented there).
    """

    def __init__(self, model: Any, *, buckets: Sequence[int] | None, staged: bool, kv_bounds: Sequence[int] | None,
                 staged_max_tokens: int | None, mode: str | None) -> None:
        import transformers

        self.model = model
        #: the base model's output class (a mixture of experts adds fields), as its forward returned
        #: it in the runner (which ran it before any step returns)
        self._output: Any = None
        self._buckets = list(buckets) if buckets is not None else None
        self.staged = staged
        self._mode = mode
        # transformers' CB runs a model set to "sdpa" or "eager" with its paged form (switched for
        # each session, and back when it stops): the paged function bcg calls
        self.base_name = _paged_base(_attention_name(model))
        _check_full_attention(model.config)
        #: whether the staged attention runs flash on this model (its device, dtype and head dim now)
        self.flash = staged and _flash_model(model)
        #: seconds :func:`.gather.load_kernel` took here (the flash staged attention's kernel)
        self.kernel_load_s = 0.0
        if self.flash:
            param = next(model.parameters())
            try:
                self.kernel_load_s = load_kernel(param.device, param.dtype, *_kv_shape(model.config))
            except Exception as exc:  # Triton installed but unable to build here: the masked way
                log.warning("bcg: the flash staged attention's kernel did not load (%s: %s); half precision "
                            "runs the masked staged attention", type(exc).__name__, exc)
                self.flash = False
        if staged_max_tokens is None:  # flash builds no mask: every bucket can run staged
            staged_max_tokens = 2**62 if self.flash else DEFAULT_STAGED_MAX_TOKENS
        # (with flash the one bound is a session's cache capacity: see _runner_for)
        bounds = () if self.flash else tuple(kv_bounds) if kv_bounds is not None else DEFAULT_KV_BOUNDS
        if self.flash and kv_bounds is not None:
            log.info("bcg: the staged attention runs flash, whose work follows each step's keys: kv_bounds %s "
                     "unused, one form per bucket reads up to the cache's capacity", tuple(kv_bounds))
        self._kv_bounds = bounds  # as asked: a session's are cut to its cache (see _runner_for)
        self.attention = PagedAttention(transformers.AttentionInterface()[self.base_name], staged, bounds, self.flash,
                                        staged_max_tokens)
        self.name = f"bcg_{self.base_name.replace('|', '_')}_{id(self):x}"
        transformers.AttentionInterface.register(self.name, self.attention)
        self._registry = transformers.AttentionInterface._global_mapping  # (for disable: see there)
        self.runner: bcg.GraphRunner | None = None
        # orders a session's start and release against a finalizer's release (_session_ended),
        # which may run on any thread
        self._session_lock = threading.RLock()
        self._ended_stats: dict[str, Any] = {}  # the last session's runner stats, once its graphs are freed
        # the CB session (its PagedAttentionCache, weakly) whose tensors the runner's graphs read
        self._cache: weakref.ref[Any] | None = None
        self.steps = 0
        self.sessions = 0
        # The wrapping: an instance attribute shadows the base model's class forward for this model
        # only. The model's own forward calls it, then runs its head (logits_to_keep, and any
        # scaling or softcapping of the logits) as it does without bcg.
        self._base = model.base_model
        previous = _ENABLED[model]() if model in _ENABLED else None
        if previous is not None:  # enabled again: this handle replaces that one
            log.info("bcg: transformers continuous batching enabled again on this model: the previous handle "
                     "is disabled (its graphs freed)")
            previous.disable()
        _ENABLED[model] = weakref.ref(self)
        self._disabled = False
        self._replaced = vars(self._base).get("forward")  # a wrapper already there (restored by disable)
        self._own_forward = self._base.forward
        own = inspect.signature(self._own_forward).parameters.values()
        # the names of the arguments it takes by position (GPT-2 and GPT-NeoX pass input_ids so)
        self._positional = [p.name for p in own if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self._installed = self._forward  # (the bound method, made once: disable compares it)
        self._base.forward = self._installed
        # Around each model call: a CB step that did not run here (the model's forward does not call
        # its base model, or the step cannot run on bcg) ran transformers' own forward: say so once.
        # (Per thread: a plain forward on another thread is not the generation thread's step.)
        self._step = threading.local()
        self._warned: set[str] = set()
        self._hooks = (model.register_forward_pre_hook(self._step_began, with_kwargs=True),
                       model.register_forward_hook(self._step_ended, with_kwargs=True))

    @property
    def staged_max_tokens(self) -> int:
        """Buckets above it run the attention as a plain breakpoint only."""
        return self.attention.staged_max_tokens

    # -- the step ----------------------------------------------------------------------------------

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        # (a step carries the cache by keyword; one that transformers compiles whole, under its
        # compile configs, runs its own forward in the compiled code: bcg steps aside)
        if self._disabled or not _is_step(kwargs) or torch.compiler.is_compiling():
            return self._own_forward(*args, **kwargs)
        named = self._named(args, kwargs)
        why = self._why_not(named, len(args))
        if why is not None or named is None:
            self._step.bypassed = why
            return self._own_forward(*args, **kwargs)
        kwargs = named
        cache = kwargs["cache"]
        self._step.pending = False  # (this step runs here)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise bcg.CaptureError(
                "transformers is capturing its own CUDA graph around a forward that bcg runs: pass "
                "ContinuousBatchingConfig(use_cuda_graph=False) to generate_batch / init_continuous_batching")
        meta = self._step_meta(kwargs)
        if kwargs["input_ids"].is_cuda:
            _after_default_stream(kwargs["input_ids"].device)
        runner = self._runner_for(cache, kwargs["input_ids"])
        indices = self.attention.indices
        if indices is not None:
            bucket = runner.bucket_for(meta.tokens)
            replays = bucket in runner.captured_buckets  # else this call captures it (eager mode too)
            if bucket is not None and self.attention.staged_for(bucket) and replays and meta.keys <= indices.read.numel():
                indices.load(meta)
                meta.loaded = True
            elif bucket is not None:
                indices.clear()  # this call may capture: captures must write to the trash only
            # (a step above the ladder runs eagerly and captures nothing: the buffers stay as they are)
        hidden = runner(kwargs["input_ids"], kwargs["position_ids"], live=meta)
        self.steps += 1
        return self._output(last_hidden_state=hidden)

    def _named(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The call's arguments by name (None: some taken by position cannot be named)."""
        if not args:
            return kwargs
        names = self._positional[: len(args)]
        if len(args) > len(names) or not kwargs.keys().isdisjoint(names):
            return None
        return {**dict(zip(names, args)), **kwargs}

    def _why_not(self, named: dict[str, Any] | None, positional: int) -> str | None:
        """Why the step of this base-model call (its arguments by name, see :meth:`_named`)
        cannot run on bcg (None: it can)."""
        attention = _attention_name(self.model)
        if attention != self.base_name:
            return (f"transformers runs it with attention {attention!r}, and bcg was enabled for "
                    f"{self.base_name!r}: call model.set_attn_implementation({self.base_name!r}) before generating")
        if named is None:
            return f"its base model's forward takes {positional} argument(s) by position that bcg cannot name"
        if named.get("input_ids") is None:
            return "it passes inputs_embeds, not input_ids"
        if len(named["write_index"]) != 1 or isinstance(named["cu_seq_lens_k"], dict):
            return "its layers form several attention groups (sliding-window layers)"
        if named.get("block_table") is not None:
            return "it reads a block table (transformers' flash decode path)"
        return None

    def _step_meta(self, kwargs: dict[str, Any]) -> StepMeta:
        write, read = kwargs["write_index"], kwargs["read_index"]
        mask, cu_k = kwargs.get("attention_mask"), kwargs["cu_seq_lens_k"]
        return StepMeta(cache=kwargs["cache"], tokens=kwargs["input_ids"].shape[1], write_index=write[0],
                        read_index=read[0], cu_q=kwargs["cu_seq_lens_q"], cu_k=cu_k, mask=mask,
                        max_q=int(kwargs.get("max_seqlen_q") or 0), max_k=int(kwargs.get("max_seqlen_k") or 0))

    def _step_began(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if not torch.compiler.is_compiling():
            self._step.pending, self._step.bypassed = _is_step(kwargs), None

    def _step_ended(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if _is_step(kwargs) and getattr(self._step, "pending", False):  # transformers' own forward ran it
            self._step.pending = False
            why = getattr(self._step, "bypassed", None) or (
                f"the model's forward does not pass it to its base model ({type(self._base).__name__}, where "
                "bcg runs)")
            if why not in self._warned:
                self._warned.add(why)
                log.warning("bcg: a continuous-batching step of %s ran transformers' own forward, without bcg: %s",
                            type(self.model).__name__, why)

    # -- the runner --------------------------------------------------------------------------------

    def _runner_for(self, cache: Any, input_ids: torch.Tensor) -> bcg.GraphRunner:
        """The runner of ``cache``'s CB session: a new session (a new cache) gets new graphs, since
        the graphs read the cache's tensors and the static indices at their addresses."""
        runner, current = self.runner, self._cache
        if runner is not None and current is not None and current() is cache:
            return runner
        with self._session_lock:
            self.release()
            self._cache = weakref.ref(cache)
            self.sessions += 1
            # When transformers drops the session's cache (a manager that is not kept), the graphs go
            # with it: they hold its K/V tensors, which the next session's cache needs the memory of.
            weakref.finalize(cache, _session_ended, weakref.ref(self), self.sessions).atexit = False
            max_tokens = cache.max_batch_tokens
            if self._buckets is not None:  # a step holds at most max_tokens: a bucket above is cut to it
                buckets = sorted({min(b, max_tokens) for b in self._buckets})
            elif self.flash:
                buckets = bcg.runner.geometric_buckets(min(FLASH_MIN_BUCKET, max_tokens),
                                                       min(FLASH_MAX_BUCKET, max_tokens))
            else:
                buckets = bcg.runner.default_buckets(max_tokens, min_tokens=min(8, max_tokens))
            # a step reads at most every page of the cache (or, reading none, its own tokens): a bound
            # above that is cut to it, so the last tier holds every step
            capacity = cache.num_pages + max_tokens
            # flash: one bound, the capacity, holds every step (its work follows the step's keys)
            bounds = [capacity] if self.flash else sorted({min(b, capacity) for b in self._kv_bounds})
            if self.staged and bounds:
                self.attention.kv_bounds = tuple(bounds)
                self.attention.indices = StaticIndices(cache, bounds[-1], pad_reads=not self.flash)
            else:
                self.attention.indices = None
            mode = self._mode or ("graph" if input_ids.is_cuda else "eager")
            example = torch.zeros(1, buckets[0], dtype=input_ids.dtype, device=input_ids.device)
            # (captures run on transformers' generation thread: CUDA work of the caller's threads
            # meanwhile is theirs, as transformers' own captures allow: capture_error_mode)
            self.runner = bcg.GraphRunner(self._decoder, buckets, example_inputs=(example, example.clone()),
                                          pad_dim=1, live=self._capture_live, mode=mode, lazy=CAPTURE_AT_STEP,
                                          progress=False, capture_error_mode="thread_local", name="transformers_cb")
            log.info("bcg: transformers continuous batching through GraphRunner (mode %s, buckets %s, staged %s)",
                     mode, buckets, self.attention.indices is not None)
            return self.runner

    def _capture_live(self, tokens: int) -> Any:
        """What bucket ``tokens``' warm-ups and captures run with: staged tiers, one per KV bound."""
        if not self.attention.staged_for(tokens):  # (its attention is a plain breakpoint)
            return CaptureMeta(None)
        # a step of this bucket reads at least its tokens (more than the previous bucket's): a bound
        # below the bucket would rarely hold one, so it gets no form (the last bound always does)
        *lower, last = self.attention.kv_bounds
        # with flash every step is staged and the last tier holds any: no breakable form to capture
        return bcg.StagedTiers(*(CaptureMeta(b) for b in (*lower, last) if b >= tokens or b == last),
                               breakable=not self.flash)

    def _decoder(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """What the runner captures: the decoder, its attention routed to the breakpoint."""
        with self._routed():
            try:
                # (the base model's own forward: the CB call that got here ran its module hooks)
                out = self._own_forward(input_ids=input_ids, position_ids=position_ids, use_cache=False)
                self._output = type(out)
                return out.last_hidden_state
            finally:
                self.attention.forget_mask()

    @contextlib.contextmanager
    def _routed(self) -> Iterator[None]:
        self.model.set_attn_implementation(self.name)
        try:
            yield
        finally:
            self.model.set_attn_implementation(self.base_name)

    # -- the handle --------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The runner's :meth:`bcg.GraphRunner.stats` (``{}`` before the first step; once a session's
        graphs are freed, as they were then), plus ``steps``
        (forwards run through the runner), ``sessions`` (CB sessions, each with its own graphs) and
        ``kernel_load_s`` (the flash staged attention's kernel, loaded at ``enable``; else 0)."""
        stats = self.runner.stats() if self.runner is not None else self._ended_stats
        return {**stats, "steps": self.steps, "sessions": self.sessions, "kernel_load_s": self.kernel_load_s}

    def release(self) -> None:
        """Free the graphs, their pool and the static indices (the next CB step captures again).
        Done when transformers drops a session's cache (a manager that is not kept), and by a new
        session."""
        with self._session_lock:
            # (the runner first: a finalizer run by a collection inside stats() finds none)
            runner, self.runner = self.runner, None
            self._cache = None
            self.attention.indices = None
            if runner is not None:
                try:
                    self._ended_stats = runner.stats()
                finally:
                    runner.reset()

    def disable(self) -> None:
        """Give the model its own forward back and free everything (see :meth:`release`)."""
        self.release()
        if self._disabled:
            return
        self._disabled = True  # (a wrapper added after enable may still call this handle's forward)
        if self.model in _ENABLED and _ENABLED[self.model]() is self:
            del _ENABLED[self.model]
        for hook in self._hooks:
            hook.remove()
        if vars(self._base).get("forward") is self._installed:
            if self._replaced is None:
                del self._base.forward
            else:
                self._base.forward = self._replaced
        else:
            log.warning("bcg: disable: the base model's forward was wrapped again after enable; that wrapper "
                        "stays, and its calls run the model's own forward")
        self.attention.modules.clear()  # (the layers it saw: the model can be freed)
        # transformers has no public way to unregister an attention function: its registry is a dict
        self._registry.pop(self.name, None)


def _session_ended(ref: weakref.ref[ContinuousBatchingGraphs], session: int) -> None:
    """A CB session's cache is gone: free its graphs, if that session is still the handle's."""
    handle = ref()
    # (never waits: a thread starting a session meanwhile releases the old one itself)
    if handle is None or not handle._session_lock.acquire(blocking=False):
        return
    try:
        if handle.sessions == session and handle.runner is not None:
            log.info("bcg: transformers continuous batching session %d ended: its graphs are freed", session)
            handle.release()
    finally:
        handle._session_lock.release()


def _after_default_stream(device: torch.device) -> None:
    """Order the current stream after the device's default stream.

    transformers' synchronous batching writes a step's tensors on the device's default stream
    (its last copy, of the read indices, or of the write indices where the step reads no cache,
    is not synchronized) and runs the forward on its own compute stream, which does not wait for
    the default stream. bcg reads those tensors first in the step (:meth:`StaticIndices.load`,
    the runner's input copies), so the step waits for that stream's work first. (With async
    batching the compute stream already waits for transformers' copies.)

    .. warning::
        The default stream is the device's, not the thread's: a step also waits for work other
        threads queued there.
    """
    stream = torch.cuda.current_stream(device)
    default = torch.cuda.default_stream(device)
    if stream != default:
        stream.wait_stream(default)


def _is_step(kwargs: dict[str, Any]) -> bool:
    """Whether a call's keyword arguments are a CB step's (transformers' paged cache and indices)."""
    return kwargs.get("cache") is not None and "write_index" in kwargs


def _paged_base(name: str) -> str:
    """The paged attention of :data:`BASES` that transformers' CB runs for a model whose attention
    is ``name`` (``"sdpa"`` runs ``"paged|sdpa"``); raises ``ValueError`` for any other."""
    base = name if name.startswith("paged|") else f"paged|{name}"
    if base not in BASES:
        raise ValueError(f"bcg.integrations.transformers.enable: the model's attention is {name!r}; bcg runs "
                         f"transformers' paged sdpa or eager attention: set one of 'sdpa', 'eager', {BASES[0]!r} "
                         f"or {BASES[1]!r} (model.set_attn_implementation('sdpa'))")
    return base


def _check_full_attention(config: Any) -> None:
    """Raise ``ValueError`` unless every layer has full attention, as transformers' CB cache groups
    them (sliding-window layers would need their own read order and a windowed mask)."""
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    _, types = group_layers_by_attn_type(config.get_text_config())
    if set(types) != {"full_attention"}:
        raise ValueError(f"bcg.integrations.transformers.enable: the model's layers have attention "
                         f"{sorted(set(types))}; bcg runs full attention only (no sliding-window layers)")


def _flash_model(model: Any) -> bool:
    """Whether the staged attention runs flash on ``model`` as it is now (its parameters' device and
    dtype, its head dimension)."""
    param = next(model.parameters())
    return flash_usable(param.device, param.dtype, _kv_shape(model.config)[1])


def _kv_shape(config: Any) -> tuple[int, int]:
    """``(kv_heads, head_dim)`` of a transformers config (Llama's attributes; a composite model's
    text config)."""
    config = config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads, head_dim


def _attention_name(model: Any) -> str:
    # transformers has no public getter of the attention implementation in use: its own code
    # reads config._attn_implementation (set_attn_implementation is the public setter).
    return str(model.config._attn_implementation)
