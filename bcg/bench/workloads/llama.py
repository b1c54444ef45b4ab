"""``llama``: prefill of a Llama-style decoder with random weights, attention as a breakpoint.

The model (RMSNorm, RoPE, GQA, SwiGLU; default 8B shape) is built once with
random weights (bf16 on the GPU, float32 on CPU) and reused for every mode and T.
The input is hidden states ``[T, hidden]`` (no embedding) plus positions, for a
batch of ``--requests`` prefill requests whose random lengths (seeded, fixed per
T) sum to T.

Attention is one ``@bcg.breakpoint`` per layer. It reads the request lengths
from :func:`bcg.live` and writes into a preallocated output argument in place
(no bridge copy); the whole-compiled modes call the ``flash`` and ``varlen``
forms that return their result instead (:data:`RESULTS`). Implementations
(``--attn``):

* ``varlen`` - one ``torch.nn.attention.varlen.varlen_attn`` call (causal); the
  breakpoint's host work builds ``cu_seqlens`` (int32, pinned, non-blocking copy)
  from the live lengths. Without CUDA (or without ``varlen_attn``) it falls back
  to the per-request SDPA loop; rows say which backend ran (``attn_backend``).
* ``flash`` - the flash kernel ``varlen_attn`` wraps
  (``torch.ops.aten._flash_attention_forward``), called directly as serving
  engines call their flash kernel: no Python custom-op dispatch, GQA native (no
  KV copies). Same cu_seqlens and fallback as ``varlen``.
* ``loop`` - a per-request causal ``F.scaled_dot_product_attention`` loop (host heavy).

GQA: ``flash`` takes the grouped KV heads, and so does ``varlen`` where this
torch's ``varlen_attn`` has ``enable_gqa``. Otherwise the KV heads are repeated to
the query heads (``repeat_interleave`` over the head dimension, written as
expand+reshape): for ``varlen`` by the model's code before the breakpoint is
called (:func:`expands_kv`), so graphs capture it and a whole-model compile fuses
it; ``loop`` and ``unfused`` repeat per request inside.

Staged attention (modes ``bcg-staged``, ``bcg-staged-compile``; ``flash`` and
``varlen`` on a GPU): the same function as a *staged* breakpoint
(``@bcg.breakpoint(prepare=..., fits=...)``, see :class:`StagedAttention`),
captured inline in the graph. Its live metadata is host-only (the lengths); one
``prepare`` per forward writes ``cu_seqlens`` for ``--slots`` request slots into
a :class:`bcg.StagingBuffer`, and ``max_seqlen`` is bounded by the bucket size.
Each runner bucket also keeps staged tiers (:class:`bcg.StagedTiers`) for fewer
slots (``--slot-tiers``, default the powers of two from 2 below ``--slots``): a
batch runs the first whose slots hold its requests, so it does not pay for
empty slots (the runner keeps a tier only where it times faster than the form
after it). A batch of more requests than ``--slots`` runs the breakable form.

``--attn decode,mixed`` run the decoder over a paged KV cache
(:mod:`bcg.bench.workloads.paged`). ``--attn decode-loop`` runs greedy decoding:
the model gains a token embedding and an LM head (``--vocab``), and a sample is
``--steps`` decode steps back to back (:class:`bcg.bench.case.DecodeLoop`):
each step's argmax is copied on the device into the next step's token ids and
the positions advance on the device (no host synchronization), while the
host builds each step's batch (contexts + 1, tables growing at page
boundaries), which the staged attention's ``prepare`` stages.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import itertools
import random
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

import bcg
from bcg.core.torch_internals import fresh_inductor_cache, has_triton, maybe_mark_dynamic
from bcg.bench.case import Case, DecodeLoop
from bcg.bench.timing import UserTime, compiling_call
from bcg.bench import lifecycle
from bcg.bench.workloads import paged
from bcg.bench.argtypes import nonnegative_int, positive_int
from bcg.core.compiled import dynamo_graphs

NAME = "llama"
NEEDS_CUDA = False

SHAPES: dict[str, dict[str, int]] = {
    "8b": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336},
    "tiny": {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512},
}
ATTN = ("flash", "varlen", "loop", "unfused")
LOOP = "decode-loop"  # greedy decoding over the paged cache, --steps steps per sample
PAGED = (*paged.KINDS, LOOP)  # the --attn kinds over a paged KV cache (T: the requests, or tokens for mixed)
REPEATS = ("fixed", "zipf", "never")  # how the specialized modes' length tuples repeat
LADDER_MIN = 16  # bcg.runner.default_buckets' smallest bucket
ROPE_THETA = 500000.0
NORM_EPS = 1e-5

try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # older torch
    _varlen_attn = None


def _causal_kwargs() -> dict[str, Any] | None:
    """How this torch's ``varlen_attn`` is asked for causal masking (None: not understood)."""
    if _varlen_attn is None:
        return None
    params = inspect.signature(_varlen_attn).parameters
    if "window_size" in params:
        return {"window_size": (-1, 0)}
    if "is_causal" in params:
        return {"is_causal": True}
    return None


_CAUSAL = _causal_kwargs()
# grouped KV heads, where this torch's varlen_attn takes them (else they are repeated first)
_GQA = {"enable_gqa": True} if _varlen_attn is not None and "enable_gqa" in inspect.signature(
    _varlen_attn).parameters else None
# the kernel behind varlen_attn, as one OpOverload (the cheapest call from Python)
_FLASH = getattr(getattr(torch.ops.aten, "_flash_attention_forward", None), "default", None)


# -- arguments ----------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def slot_tiers(text: str) -> list[int]:
    """``--slot-tiers``: comma-separated slot counts, or ``none``."""
    return [] if text.strip().lower() == "none" else int_list(text)


def default_slot_tiers(slots: int) -> list[int]:
    """The powers of two from 2 below ``slots``: the staged tiers captured by default."""
    return [k for k in (2 ** i for i in range(1, slots.bit_length())) if k < slots]


def attn_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    known = (*ATTN, *PAGED)
    bad = [v for v in values if v not in known]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"--attn takes a comma-separated subset of {','.join(known)}, got {text!r}")
    return values


def ladder_max(text: str) -> int:
    """``--ladder-max``: 0 (skip the ladder) or at least the ladder's smallest bucket (16)."""
    value = nonnegative_int(text)
    if 0 < value < LADDER_MIN:
        raise argparse.ArgumentTypeError(f"must be 0 (skip the ladder) or at least {LADDER_MIN}, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("llama workload")
    g.add_argument("--shape", choices=sorted(SHAPES), default="8b",
                   help="model shape preset (default 8b; CPU runs always start from tiny)")
    g.add_argument("--layers", type=positive_int, help="override: decoder layers (= breakpoints)")
    g.add_argument("--hidden", type=positive_int, help="override: hidden size")
    g.add_argument("--heads", type=positive_int, help="override: query heads (must divide --hidden)")
    g.add_argument("--kv-heads", type=positive_int, help="override: key/value heads (GQA; must divide --heads)")
    g.add_argument("--head-dim", type=positive_int,
                   help="override: head dim, even (RoPE; default hidden // heads, which must then be even)")
    g.add_argument("--intermediate", type=positive_int, help="override: SwiGLU intermediate size")
    g.add_argument("--tokens", type=int_list, default=[128, 512, 2048],
                   help="comma-separated T values, each >= --requests (total tokens of the batch; "
                   "default 128,512,2048)")
    g.add_argument("--requests", type=positive_int, default=4, help="requests per batch (default 4)")
    g.add_argument("--ladder-max", type=ladder_max, default=4096,
                   help="capture a GraphRunner over the default 16-bucket ladder up to this many tokens and "
                   f"report its capture time and pool size (GPU only; 0 skips, else >= {LADDER_MIN}; default 4096)")
    g.add_argument("--lifecycle", action="store_true",
                   help="also report the runner's lifecycle over the ladder (up to --ladder-max, varlen): "
                   "time to the first result with capture-all, lazy and background capture, pools in "
                   "each order, memory a reset() frees, time to wake, calls/s during a background "
                   "capture (GPU only)")
    g.add_argument("--attn", type=attn_list, default=list(ATTN),
                   help="attention implementations: flash,varlen,loop,unfused (default all four; unfused: "
                   "per request GQA expand, q@k^T, scale, causal mask, float32 softmax, @v: ~10 launches each); "
                   "decode,mixed: a paged KV cache, T = requests of one new token each (decode) or tokens, "
                   "half of them decode tokens (mixed); decode-loop: greedy decoding of T requests, --steps "
                   "steps per sample, each step's argmax copied on the device into the next step's token ids "
                   "(rows add tokens_per_s = T * steps / the sample's seconds, gpu_idle_us_per_step: the "
                   "mean gap on the GPU between a step's end and the next step's start, from CUDA events in "
                   "loops run after the timed ones, i.e. how long the GPU waited for the host's loop, and "
                   "gpu_us_per_step)")
    g.add_argument("--context", type=positive_int, default=2048,
                   help="decode,mixed: the longest context of a request (contexts drawn from 1 to it; default 2048)")
    g.add_argument("--page", type=positive_int, default=16, help="decode,mixed: tokens per KV-cache page (default 16)")
    g.add_argument("--steps", type=positive_int, default=64,
                   help="decode-loop: decode steps per timed sample, back to back (default 64); contexts grow "
                   "by one per step, up to --context + steps - 1")
    g.add_argument("--vocab", type=positive_int, default=32000,
                   help="decode-loop: vocabulary size of the token embedding and LM head (default 32000)")
    g.add_argument("--zipf-tuples", type=positive_int, default=16, metavar="N",
                   help="mode bcg-specialized-zipf: length tuples drawn Zipf-distributed from N tuples (default 16)")
    g.add_argument("--zipf-s", type=float, default=1.0,
                   help="mode bcg-specialized-zipf: the Zipf exponent (P(k-th tuple) ~ k^-s; default 1.0)")
    g.add_argument("--slots", type=positive_int, default=8, metavar="R",
                   help="request slots of the staged attention (modes bcg-staged*): a batch of more than R "
                   "requests replays the breakable form (default 8)")
    g.add_argument("--slot-tiers", type=slot_tiers, default=None, metavar="K,...",
                   help="slot counts below R captured as staged tiers of each runner bucket "
                   "(bcg.StagedTiers): a batch of at most K requests replays the K-slot form "
                   "(default: the powers of two from 2 below R; 'none': no tiers)")


def check_args(args: argparse.Namespace) -> str | None:
    """Why the llama flags cannot build the model or its batches, naming the flags (None: they can).

    Shape fields not given as flags come from ``--shape``'s preset. GQA needs the KV heads
    to divide the query heads; the head dim (``--head-dim``, else hidden // heads, which
    must then divide exactly) must be even for RoPE; every T needs a token per request.
    """
    preset = SHAPES[args.shape]

    def field(key: str, flag: str) -> tuple[int, str]:
        value = getattr(args, key, None)
        if value is not None:
            return value, f"{flag} {value}"
        return preset[key], f"{flag} ({preset[key]} from --shape {args.shape})"

    hidden, hidden_s = field("hidden", "--hidden")
    heads, heads_s = field("heads", "--heads")
    kv_heads, kv_s = field("kv_heads", "--kv-heads")
    if heads % kv_heads:
        return f"{kv_s} must divide {heads_s}: each KV head serves heads / kv-heads query heads (GQA)"
    head_dim = getattr(args, "head_dim", None)
    if head_dim is not None:
        if head_dim % 2:
            return f"--head-dim {head_dim} must be even: RoPE rotates pairs of dimensions"
    elif hidden % heads:
        return f"{hidden_s} must be a multiple of {heads_s}: the head dim is hidden / heads (or pass --head-dim)"
    elif (hidden // heads) % 2:
        return (f"the head dim {hidden_s} / {heads_s} = {hidden // heads} must be even: RoPE rotates pairs of "
                "dimensions (or pass an even --head-dim)")
    tp = getattr(args, "tp", 1)
    intermediate, inter_s = field("intermediate", "--intermediate")
    for value, text in ((heads, heads_s), (kv_heads, kv_s), (intermediate, inter_s)):
        if value % tp:
            return f"--tp {tp} must divide {text}: each rank holds an equal share"
    small = [T for T in args.tokens if T < args.requests]
    prefill = [a for a in args.attn if a not in PAGED]  # decode: T is the requests; mixed: any T
    if small and prefill:
        return (f"--tokens {','.join(map(str, small))} is smaller than --requests {args.requests}: "
                f"every request of a {prefill[0]} prefill needs at least one token")
    if LOOP in args.attn and tp > 1:
        return f"--attn {LOOP} runs on one GPU: drop --tp {tp} (its embedding and LM head are not sharded)"
    big = [k for k in tiers_of(args) if k >= args.slots]
    if big:
        return (f"--slot-tiers {','.join(map(str, big))} must be below --slots {args.slots}: a tier is a "
                "staged form with fewer slots than the bucket's own")
    return None


def shape(args: argparse.Namespace) -> dict[str, int]:
    """The model shape: the preset with any per-field overrides; head_dim defaults to hidden // heads."""
    out = dict(SHAPES[args.shape])
    for key in ("layers", "hidden", "heads", "kv_heads", "intermediate"):
        value = getattr(args, key, None)
        if value is not None:
            out[key] = value
    out["head_dim"] = args.head_dim if getattr(args, "head_dim", None) else out["hidden"] // out["heads"]
    if out["heads"] % out["kv_heads"]:
        raise ValueError(f"heads ({out['heads']}) must be a multiple of kv_heads ({out['kv_heads']})")
    return out


def request_lengths(T: int, requests: int, seed: int) -> list[int]:
    """``requests`` random positive lengths summing to ``T``; the same for the same (T, requests, seed)."""
    if T < requests:
        raise ValueError(f"T={T} is smaller than the number of requests ({requests})")
    rng = random.Random(seed * 1_000_003 + T * 7919 + requests)
    cuts = sorted(rng.sample(range(1, T), requests - 1))
    bounds = [0, *cuts, T]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def bucket_lengths(args: argparse.Namespace, n: int, most: int | None = None) -> tuple[int, ...]:
    """The request lengths of a runner's batch of ``n`` tokens (a bucket's capture): ``--requests``
    of them, at most ``most`` and at most ``n``."""
    return tuple(request_lengths(n, min(args.requests, n, most or n), args.seed))


def points(args: argparse.Namespace) -> list[tuple[str | None, int | None]]:
    return [(attn, T) for attn in args.attn for T in args.tokens]


def tiers_of(args: argparse.Namespace) -> list[int]:
    """The staged tiers' slot counts (``--slot-tiers``, else the default for ``--slots``)."""
    tiers = getattr(args, "slot_tiers", None)
    return list(tiers) if tiers is not None else default_slot_tiers(args.slots)


def config(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    return {
        "shape_preset": args.shape,
        "shape": shape(args),
        "dtype": str(_dtype(device)).replace("torch.", ""),
        "tokens": list(args.tokens),
        "requests": args.requests,
        "attn": list(args.attn),
        "slots": args.slots,
        "slot_tiers": tiers_of(args),
        "lengths": ({str(T): request_lengths(T, args.requests, args.seed) for T in args.tokens}
                    if any(a not in PAGED for a in args.attn) else {}),  # the prefill requests
        **({"steps": args.steps, "vocab": args.vocab} if LOOP in args.attn else {}),
    }


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


# -- the model --------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """The live metadata of one forward: request lengths (host ints) and, on a GPU,
    ``cu_seqlens`` on the device, built once per forward as serving engines do.
    ``slots``: at a staged capture only, the request slots to capture for (a staged tier)."""

    lengths: tuple[int, ...]
    cu: torch.Tensor | None = None
    slots: int | None = None

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @staticmethod
    def build(lengths: tuple[int, ...], device: torch.device) -> Batch:
        """The metadata of a batch: one pinned host buffer and one non-blocking copy on a GPU."""
        return Batch(lengths, cu_seqlens(lengths, device) if device.type == "cuda" else None)


class StagedBatch(NamedTuple):  # a tuple: made at every replay's prepare, cheaply
    """What a staged attention reads when it runs inline (what its ``prepare`` returned at
    capture, frozen into the graph): ``cu_seqlens`` in a static device buffer, rewritten
    before every replay, ``max_len``, a bound on the longest request, and ``slots``, the
    requests its kernels take (``cu`` holds ``slots + 1`` offsets)."""

    cu: torch.Tensor
    max_len: int
    slots: int


@dataclass
class Layer:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor
    wo: torch.Tensor
    ffn_norm: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


class Regions:
    """The token-shaped work between attentions, as three functions of tensors.

    ``first`` runs up to layer 0's attention, ``middle`` from layer i's
    attention output to layer i+1's, ``last`` to the final norm. Shape
    constants are closed over; weights are arguments, so one compiled graph
    serves every layer. :meth:`compiled` wraps them in ``torch.compile``
    (Inductor, default mode) with the token dimension marked dynamic, so every
    token count shares one compile.
    """

    def __init__(self, H: int, KV: int, D: int, hidden: int, reduce: Any = None) -> None:
        self.H, self.KV, self.D, self.hidden = H, KV, D, hidden
        self.reduce = reduce  # tensor parallel: the all-reduce after each row-parallel matmul
        if reduce is None:
            def reduce(t: torch.Tensor) -> torch.Tensor:
                return t

        def qkv(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: torch.Tensor, wqkv: torch.Tensor) -> Any:
            T = x.shape[0]
            y = F.rms_norm(x, (hidden,), norm, NORM_EPS)
            q, k, v = F.linear(y, wqkv).split([H * D, KV * D, KV * D], dim=-1)
            q = _rope(q.view(T, H, D), cos, sin)
            k = _rope(k.view(T, KV, D), cos, sin)
            return q, k, v.view(T, KV, D), torch.empty_like(q)  # attention writes the last in place

        def mlp(x: torch.Tensor, o: torch.Tensor, wo: torch.Tensor, norm: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor) -> torch.Tensor:
            x = x + reduce(F.linear(o.view(x.shape[0], H * D), wo))
            y = F.rms_norm(x, (hidden,), norm, NORM_EPS)
            gate, up = F.linear(y, w_gate_up).chunk(2, dim=-1)
            return x + reduce(F.linear(F.silu(gate) * up, w_down))

        def first(x: torch.Tensor, pos: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                  norm: torch.Tensor, wqkv: torch.Tensor) -> Any:
            cos, sin = cos_table[pos].unsqueeze(1), sin_table[pos].unsqueeze(1)
            return (cos, sin, *qkv(x, cos, sin, norm, wqkv))

        def middle(x: torch.Tensor, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wo: torch.Tensor,
                   ffn_norm: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, attn_norm: torch.Tensor,
                   wqkv: torch.Tensor) -> Any:
            x = mlp(x, o, wo, ffn_norm, w_gate_up, w_down)
            return (x, *qkv(x, cos, sin, attn_norm, wqkv))

        def last(x: torch.Tensor, o: torch.Tensor, wo: torch.Tensor, ffn_norm: torch.Tensor, w_gate_up: torch.Tensor,
                 w_down: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
            return F.rms_norm(mlp(x, o, wo, ffn_norm, w_gate_up, w_down), (hidden,), norm, NORM_EPS)

        self.first, self.middle, self.last = first, middle, last

    def compiled(self, **compile_kwargs: Any) -> Regions:
        """The same regions through ``torch.compile`` (token dimension dynamic: one compile for all T)."""
        out = Regions(self.H, self.KV, self.D, self.hidden, self.reduce)
        out.first = _tokens_dynamic(torch.compile(self.first, **compile_kwargs), (0, 1))
        out.middle = _tokens_dynamic(torch.compile(self.middle, **compile_kwargs), (0, 1, 2, 3))
        out.last = _tokens_dynamic(torch.compile(self.last, **compile_kwargs), (0, 1))
        return out


def _tokens_dynamic(fn: Any, token_args: tuple[int, ...]) -> Any:
    """Call ``fn`` with dim 0 of the given arguments marked dynamic (no recompile per token count)."""
    mark = maybe_mark_dynamic

    def call(*args: Any) -> Any:
        for i in token_args:
            mark(args[i], 0)
        return fn(*args)

    return call


@dataclass(frozen=True)
class TensorParallel:
    """Megatron-style tensor parallelism over the default process group: this rank's share.

    Column-parallel QKV and gate/up (each rank holds ``heads / size`` query heads,
    ``kv_heads / size`` KV heads, ``intermediate / size`` columns), row-parallel O and
    down, each followed by an all-reduce of its partial sums.
    """

    rank: int
    size: int

    @staticmethod
    def reduce(t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place (NCCL on the current stream: captured in segments)."""
        import torch.distributed as dist

        dist.all_reduce(t)
        return t


class LlamaModel:
    """A Llama-style decoder stack with random weights; with ``vocab`` also a token embedding
    and an LM head (:meth:`decode_step`).

    With ``tp`` each rank holds its shard, drawn from its own seed (the sharded
    model is not the one-GPU model of the same seed; every mode of a run uses the same shards).

    Arguments:
        vocab: the vocabulary of the embedding and LM head (0: neither; not with ``tp``).
    """

    def __init__(self, shape: dict[str, int], device: torch.device, max_pos: int, seed: int = 0,
                 tp: TensorParallel | None = None, vocab: int = 0) -> None:
        if vocab and tp is not None:
            raise ValueError("the embedding and LM head are not sharded: vocab needs tp=None")
        self.shape = dict(shape)
        self.device = device
        self.dtype = dtype = _dtype(device)
        parts = tp.size if tp is not None else 1
        h, D = shape["hidden"], shape["head_dim"]
        H, KV, I = shape["heads"] // parts, shape["kv_heads"] // parts, shape["intermediate"] // parts
        self.H, self.KV, self.D, self.hidden = H, KV, D, h
        self.tp = tp
        gen = torch.Generator(device=device).manual_seed(seed + (1_000_003 * tp.rank if tp is not None else 0))

        def weight(out_f: int, in_f: int) -> torch.Tensor:
            w = torch.randn(out_f, in_f, generator=gen, device=device, dtype=dtype)
            return w.mul_(in_f**-0.5)

        def norm() -> torch.Tensor:
            return torch.ones(h, device=device, dtype=dtype)

        self.layers = [
            Layer(
                attn_norm=norm(),
                wqkv=weight((H + 2 * KV) * D, h),
                wo=weight(h, H * D),
                ffn_norm=norm(),
                w_gate_up=weight(2 * I, h),
                w_down=weight(h, I),
            )
            for _ in range(shape["layers"])
        ]
        self.norm = norm()
        # token embedding (unit-scale rows, as the hidden states the other points feed in) and LM head
        self.vocab = vocab
        self.embed = torch.randn(vocab, h, generator=gen, device=device, dtype=dtype) if vocab else None
        self.lm_head = weight(vocab, h) if vocab else None
        inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D))
        freqs = torch.outer(torch.arange(max_pos, device=device, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self.regions = Regions(H, KV, D, h, tp.reduce if tp is not None else None)
        # the same forward without the all-reduces (mode floor-no-allreduce: their share of the time)
        self.regions_no_reduce = Regions(H, KV, D, h) if tp is not None else None
        self._compiled: Regions | None = None
        self._staged: dict[tuple[int, bool], StagedAttention] = {}

    @property
    def nbytes(self) -> int:
        tensors = [t for layer in self.layers for t in vars(layer).values()]
        tensors += [t for t in (self.embed, self.lm_head) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def compiled_regions(self, fresh: bool = False) -> Regions:
        """The regions compiled by Inductor (made once; ``fresh``: a new compile from scratch)."""
        if fresh or self._compiled is None:
            if fresh:
                torch.compiler.reset()
            self._compiled = self.regions.compiled()
        return self._compiled

    def staged_attention(self, slots: int) -> StagedAttention:
        """The staged attentions over ``slots`` request slots on this model's device (made once per ``slots``)."""
        if slots not in self._staged:
            self._staged[slots] = StagedAttention(slots, self.device)
        return self._staged[slots]

    def forward(self, x: torch.Tensor, pos: torch.Tensor, attn: Any, regions: Regions | None = None,
                expand_kv: bool = False) -> torch.Tensor:
        """The decoder on ``x`` (``[T, hidden]``) at positions ``pos``; ``attn(q, k, v, out)`` is
        each layer's attention (or a sequence of them, one per layer: a paged cache's layers),
        which writes ``out`` or returns its result;
        ``expand_kv``: K and V reach it with their heads repeated to the query heads (GQA), by
        this code, before the call: captured in the segments, fused by a whole-model compile."""
        r = regions or self.regions
        layers = self.layers
        attns = list(attn) if isinstance(attn, (list, tuple)) else [attn] * len(layers)
        rep = self.H // self.KV if expand_kv else 1

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
            result = attns[i](q, _expand_kv(k, rep), _expand_kv(v, rep), o)
            return o if result is None else result  # written into o, or returned

        L0 = layers[0]
        cos, sin, q, k, v, o = r.first(x, pos, self.cos, self.sin, L0.attn_norm, L0.wqkv)
        for i, (layer, nxt) in enumerate(zip(layers, layers[1:])):
            o = attend(i, q, k, v, o)
            x, q, k, v, o = r.middle(x, o, cos, sin, layer.wo, layer.ffn_norm, layer.w_gate_up, layer.w_down,
                                     nxt.attn_norm, nxt.wqkv)
        o = attend(-1, q, k, v, o)
        L = layers[-1]
        return r.last(x, o, L.wo, L.ffn_norm, L.w_gate_up, L.w_down, self.norm)


    def decode_step(self, ids: torch.Tensor, pos: torch.Tensor, attn: Any) -> torch.Tensor:
        """One greedy decode step: embed ``ids`` (``[T]`` int64), :meth:`forward` at ``pos``
        (its final norm included), LM head, argmax: the next token ids, ``[T]`` int64, on the device."""
        if self.embed is None or self.lm_head is None:
            raise ValueError("this LlamaModel has no embedding and LM head: build it with vocab > 0")
        x = F.embedding(ids, self.embed)
        return torch.argmax(F.linear(self.forward(x, pos, attn), self.lm_head), dim=-1)


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * cos + rotated * sin


# -- attention --------------------------------------------------------------------------


def _expand_kv(t: torch.Tensor, rep: int) -> torch.Tensor:
    """``t.repeat_interleave(rep, dim=1)`` for ``[T, KV, D]``, as expand+reshape (no host sync)."""
    if rep == 1:
        return t
    T, KV, D = t.shape
    return t.unsqueeze(2).expand(T, KV, rep, D).reshape(T, KV * rep, D)


def sdpa_per_request(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lengths: Any) -> None:
    """Causal SDPA request by request; writes ``out`` in place."""
    rep = q.shape[1] // k.shape[1]
    k, v = _expand_kv(k, rep), _expand_kv(v, rep)
    start = 0
    for n in lengths:
        end = start + n
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0),
            k[start:end].transpose(0, 1).unsqueeze(0),
            v[start:end].transpose(0, 1).unsqueeze(0),
            is_causal=True,
        )
        out[start:end].copy_(o.squeeze(0).transpose(0, 1))
        start = end


def unfused_per_request(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lengths: Any) -> None:
    """Causal attention request by request from small ops (GQA expand, ``q @ k^T``, scale, causal
    ``masked_fill``, float32 softmax, ``@ v``, copy into ``out``): about ten launches per request,
    the shape of any breakpoint whose host work is many small launches."""
    rep = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5
    start = 0
    for n in lengths:
        end = start + n
        qs = q[start:end].transpose(0, 1)
        ks = _expand_kv(k[start:end], rep).transpose(0, 1)
        vs = _expand_kv(v[start:end], rep).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2)) * scale
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")).float(), dim=-1).to(q.dtype)
        out[start:end].copy_((probs @ vs).transpose(0, 1))
        start = end


def expands_kv(attn: str) -> bool:
    """Whether the model repeats the KV heads before ``attn``'s call: ``varlen`` where this
    torch's ``varlen_attn`` has no ``enable_gqa`` (docs/compile.md: keep a breakpoint's body to
    its kernel call). ``flash`` is GQA native; ``loop`` and ``unfused`` repeat per request."""
    return attn == "varlen" and _GQA is None


def varlen_usable(device: torch.device) -> bool:
    return _varlen_attn is not None and _CAUSAL is not None and device.type == "cuda"


def flash_usable(device: torch.device) -> bool:
    return _FLASH is not None and device.type == "cuda"


_BACKENDS = {"varlen": ("varlen_attn", varlen_usable), "flash": ("aten._flash_attention_forward", flash_usable)}


def attn_backend(attn: str, device: torch.device) -> str:
    if attn == "loop":
        return "sdpa-per-request"
    if attn == "unfused":
        return "unfused-per-request"
    name, usable = _BACKENDS[attn]
    if usable(device):
        return name
    if device.type != "cuda":
        return f"sdpa-per-request ({name} fallback: no CUDA)"
    return f"sdpa-per-request ({name} fallback: not in this torch)"


def cu_seqlens(lengths: Any, device: torch.device) -> torch.Tensor:
    """``[0, l0, l0+l1, ...]`` as int32 on ``device`` (pinned host buffer, non-blocking copy)."""
    offsets = list(itertools.accumulate(lengths, initial=0))
    host = torch.tensor(offsets, dtype=torch.int32, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int) -> torch.Tensor:
    """One causal ``varlen_attn`` call over the packed batch."""
    assert _varlen_attn is not None and _CAUSAL is not None
    rep = q.shape[1] // k.shape[1]
    if rep > 1 and _GQA is not None:
        return _varlen_attn(q, k, v, cu, cu, max_len, max_len, **_CAUSAL, **_GQA)
    return _varlen_attn(q, _expand_kv(k, rep), _expand_kv(v, rep), cu, cu, max_len, max_len, **_CAUSAL)


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int) -> torch.Tensor:
    """One causal flash-attention call over the packed batch, GQA native."""
    assert _FLASH is not None
    return _FLASH(q, k, v, cu, cu, max_len, max_len, 0.0, True, False)[0]


def _packed_attention(kernel: Any, usable: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``kernel`` (:func:`flash` or :func:`varlen`) over the batch :func:`bcg.live` returns, or
    the SDPA loop where ``usable(device)`` says it cannot run: the result.

    The batch is a :class:`Batch` (its ``cu`` built per forward; None, as in the staged modes'
    host-only metadata: built here from the lengths) or, inline, a :class:`StagedBatch`.
    """
    batch = bcg.live()
    if not usable(q.device):
        out = torch.empty_like(q)
        sdpa_per_request(q, k, v, out, batch.lengths)
        return out
    cu = batch.cu if batch.cu is not None else cu_seqlens(batch.lengths, q.device)
    return kernel(q, k, v, cu, batch.max_len)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """Flash attention over the live batch, written into ``out``: the function of
    ``attention_flash`` and of ``attention_flash_staged``."""
    out.copy_(_packed_attention(flash, flash_usable, q, k, v))


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """``varlen_attn`` over the live batch, written into ``out``: the function of
    ``attention_varlen`` and of ``attention_varlen_staged``."""
    out.copy_(_packed_attention(varlen, varlen_usable, q, k, v))


def flash_result(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`flash_attention` returning its result (``out`` is not used): what the whole-compiled
    modes call, so that the compiled code reads the kernel's output where it lies."""
    return _packed_attention(flash, flash_usable, q, k, v)


def varlen_result(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`varlen_attention` returning its result (``out`` is not used)."""
    return _packed_attention(varlen, varlen_usable, q, k, v)


def _result_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


attention_flash = bcg.breakpoint(flash_attention, name="attention_flash", mutates=("out",))
attention_varlen = bcg.breakpoint(varlen_attention, name="attention_varlen", mutates=("out",))
# the same attentions returning their result: the whole-compiled modes' (see RESULTS)
attention_flash_result = bcg.breakpoint(flash_result, name="attention_flash_result", fake=_result_fake)
attention_varlen_result = bcg.breakpoint(varlen_result, name="attention_varlen_result", fake=_result_fake)


@bcg.breakpoint(name="attention_loop", mutates=("out",))
def attention_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    sdpa_per_request(q, k, v, out, bcg.live().lengths)


def _unfused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    unfused_per_request(q, k, v, out, bcg.live().lengths)


attention_unfused = bcg.breakpoint(_unfused_attention, name="attention_unfused", mutates=("out",))
# keyed: the request lengths decide every launch; the modes bcg-specialized* use it
attention_unfused_keyed = bcg.breakpoint(
    _unfused_attention, name="attention_unfused_keyed", mutates=("out",), key=lambda batch: batch.lengths
)

BREAKPOINTS = {"flash": attention_flash, "varlen": attention_varlen, "loop": attention_loop,
               "unfused": attention_unfused}


def length_stream(kind: str, T: int, requests: int, seed: int, tuples: int = 16, s: float = 1.0) -> Any:
    """A function returning the next batch's request lengths (``requests`` summing to ``T``).

    ``kind``: ``"fixed"`` (always the point's tuple), ``"zipf"`` (drawn from ``tuples`` tuples,
    the k-th with probability ~ k^-s) or ``"never"`` (a tuple never returned before).
    The same arguments give the same sequence.
    """
    fixed = tuple(request_lengths(T, requests, seed))
    if kind == "fixed":
        return lambda: fixed
    rng = random.Random(seed * 7919 + T)
    if kind == "zipf":
        pool = [fixed] + [tuple(request_lengths(T, requests, seed + 1000 + i)) for i in range(tuples - 1)]
        weights = [1.0 / (k + 1) ** s for k in range(len(pool))]
        return lambda: rng.choices(pool, weights)[0]
    if kind != "never":
        raise ValueError(f"kind must be one of {REPEATS}, not {kind!r}")
    seen: set[tuple[int, ...]] = set()

    def never() -> tuple[int, ...]:
        for _ in range(10_000):
            cuts = sorted(rng.sample(range(1, T), requests - 1))
            lengths = tuple(b - a for a, b in zip([0, *cuts], [*cuts, T]))
            if lengths not in seen:
                seen.add(lengths)
                return lengths
        raise RuntimeError(f"no new tuple of {requests} lengths summing to {T} left")

    return never


def padded_offsets(lengths: Sequence[int], slots: int) -> list[int]:
    """``cu_seqlens`` for ``slots`` request slots: ``[0, l0, l0+l1, ..., T]`` and, for each
    unused slot, ``T`` again (a zero-length request); ``slots + 1`` offsets."""
    if len(lengths) > slots:
        raise ValueError(f"{len(lengths)} requests do not fit in {slots} slots")
    offsets = list(itertools.accumulate(lengths, initial=0))
    return offsets + [offsets[-1]] * (slots - len(lengths))


class StagedAttention:
    """The staged ``flash`` and ``varlen`` attentions over ``slots`` request slots.

    ``cu_seqlens`` lives in one :class:`bcg.StagingBuffer` of ``slots + 1`` int32
    offsets; every layer's breakpoint shares one :meth:`prepare` (the same bound-method
    object), so bcg stages it once per forward, not per layer.

    Arguments:
        slots: R, the most requests of a batch that runs inline (:meth:`fits`).
        device: the device of the staged ``cu_seqlens`` (where the kernels run).
    """

    def __init__(self, slots: int, device: torch.device) -> None:
        self.slots = slots
        self.cu = bcg.StagingBuffer((slots + 1,), dtype=torch.int32, device=device)
        self._prefixes: dict[int, torch.Tensor] = {}  # k -> cu.device[:k + 1], made once (not per replay)
        self.user_time = UserTime()  # (host_us_bcg: the call's host time less these two)
        prepare, fits = self.user_time.wrap(self.prepare), self.user_time.wrap(self.fits)  # one object each,
        self.breakpoints: dict[str, Any] = {
            attn: bcg.breakpoint(fn, name=f"attention_{attn}_staged", mutates=("out",), prepare=prepare, fits=fits)
            for attn, fn in (("flash", flash_attention), ("varlen", varlen_attention))
        }
        # the same, returning their result (the whole-compiled modes': see RESULTS)
        self.results: dict[str, Any] = {
            attn: bcg.breakpoint(fn, name=f"attention_{attn}_result_staged", fake=_result_fake, prepare=prepare,
                                 fits=fits)
            for attn, fn in (("flash", flash_result), ("varlen", varlen_result))
        }

    def fits(self, batch: Batch, staged: StagedBatch) -> bool:
        """Whether ``batch``'s requests fit the slots of the graph captured with ``staged`` (else
        bcg tries the next tier, then replays the breakable form)."""
        return len(batch.lengths) <= staged.slots

    def prepare(self, batch: Batch) -> StagedBatch:
        """Write ``batch``'s :func:`padded_offsets` over all slots into the staging buffer (host
        only) and return what the inline attention reads: the buffer's first ``batch.slots + 1``
        offsets (all of them when ``slots`` is None), and ``max_len`` = the total tokens. Only
        the capture's return value is used: there the total is the bucket size, a bound on the
        longest request of any batch the graph replays, and the offsets a prefix that a tier's
        kernels read as its fewer slots."""
        self.cu.write(padded_offsets(batch.lengths, self.slots))
        slots = self.slots if batch.slots is None else min(batch.slots, self.slots)
        prefix = self._prefixes.get(slots)
        if prefix is None:
            prefix = self._prefixes[slots] = self.cu.device[: slots + 1]
        return StagedBatch(prefix, sum(batch.lengths), slots)

    def capture_lives(self, n: int, lengths_for: Any, tiers: Sequence[int]) -> bcg.StagedTiers:
        """The capture-time batches of a runner bucket of ``n`` tokens: one per tier of ``tiers``
        slots (``lengths_for(n, k)``: ``n`` tokens in at most ``k`` requests), then the bucket's own."""
        lives = []
        for k in sorted({k for k in tiers if k < self.slots}):
            lives.append(Batch(tuple(lengths_for(n, k)), slots=k))
            if k >= n:  # n tokens hold at most n requests: this tier serves every batch that fits
                break
        return bcg.StagedTiers(*lives, Batch(tuple(lengths_for(n, self.slots))))


_PARTITION_OPS: dict[str, Any] = {}


def partition_attention(attn: str) -> Any:
    """The ``flash``/``varlen`` attention as a custom op tagged ``cudagraph_unsafe`` (made once):
    what a user of Inductor's graph partition writes (mode ``inductor-partition``). It reads the
    batch from :func:`bcg.live` as the breakpoints do, returns its result, as the whole-compiled
    bcg modes' breakpoints do (:data:`RESULTS`), and runs eagerly between Inductor's graphs."""
    op = _PARTITION_OPS.get(attn)
    if op is None:
        fn = flash_result if attn == "flash" else varlen_result

        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            return fn(q, k, v, out)

        op = torch.library.custom_op(f"bcg_bench::attention_{attn}_unsafe", mutates_args=(),
                                     tags=(torch.Tag.cudagraph_unsafe,))(attention)
        op.register_fake(_result_fake)
        _PARTITION_OPS[attn] = op
    return op


def compiled_whole(fn: Any, **compile_kwargs: Any) -> Any:
    """``fn`` (a forward) compiled whole with ``fullgraph=True``, static shapes, through a code object
    of its own: Dynamo keeps its compiled code per code object (at most ``recompile_limit`` entries),
    and every mode's forward is the same lambda around another breakpoint."""
    fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return torch.compile(fresh, fullgraph=True, dynamic=False, **compile_kwargs)


def frozen_attention(attn: str, lengths: tuple[int, ...], device: torch.device) -> tuple[Any, Any]:
    """The same attention with the lengths frozen now, capturable inside one CUDA graph:
    ``(writes_out, returns_result)``, the second None unless ``attn`` is ``flash`` or
    ``varlen`` on a GPU (the whole-compiled floor's form: see :data:`RESULTS`). The metadata
    is uploaded once, shared by both."""
    if attn == "unfused":
        return (lambda q, k, v, out: unfused_per_request(q, k, v, out, lengths)), None
    if attn in _BACKENDS and _BACKENDS[attn][1](device):
        cu = cu_seqlens(lengths, device)
        max_len = max(lengths)
        kernel = flash if attn == "flash" else varlen

        def returns(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            return kernel(q, k, v, cu, max_len)

        def writes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
            out.copy_(returns(q, k, v, out))

        return writes, returns
    return (lambda q, k, v, out: sdpa_per_request(q, k, v, out, lengths)), None


#: The whole-compiled modes' attention: each breakpoint's form that returns its result, so the
#: compiled code reads it where the kernel wrote it (no ``out.copy_``; docs/compile.md). The
#: other modes keep the forms that write ``out``, whose breakable replays copy the same bytes.
RESULTS = {attention_flash: attention_flash_result, attention_varlen: attention_varlen_result}


# -- cases --------------------------------------------------------------------------------


def setup(args: argparse.Namespace, device: torch.device) -> LlamaModel:
    tp = None
    if getattr(args, "tp", 1) > 1:
        import torch.distributed as dist

        tp = TensorParallel(dist.get_rank(), dist.get_world_size())
    paged_points = any(a in PAGED for a in args.attn)
    loop = LOOP in args.attn
    # a decode loop's positions reach --context + --steps - 1
    max_pos = max(*args.tokens, args.ladder_max, args.context if paged_points else 0,
                  args.context + args.steps if loop else 0)
    return LlamaModel(shape(args), device, max_pos=max_pos, seed=args.seed, tp=tp, vocab=args.vocab if loop else 0)


def make_case(model: LlamaModel, args: argparse.Namespace, device: torch.device, attn: str | None, T: int | None) -> Case:
    assert attn is not None and T is not None
    if attn in PAGED:
        return _paged_case(model, args, device, attn, T)
    lengths = tuple(request_lengths(T, args.requests, args.seed))
    gen = torch.Generator(device=device).manual_seed(args.seed * 7 + T)
    x_base = torch.randn(T, model.hidden, generator=gen, device=device, dtype=model.dtype)
    x_fresh = torch.randn(T, model.hidden, generator=gen, device=device, dtype=model.dtype)
    x = x_base.clone()
    pos = torch.cat([torch.arange(n, device=device) for n in lengths])

    def write_inputs(fresh: bool) -> None:
        x.copy_(x_fresh if fresh else x_base)

    expand = expands_kv(attn)

    def make_forward(bp: Any) -> Any:
        return lambda x, pos: model.forward(x, pos, bp, expand_kv=expand)

    def make_compiled_forward(bp: Any) -> Any:
        regions = model.compiled_regions()
        return lambda x, pos: model.forward(x, pos, bp, regions, expand_kv=expand)

    def make_forward_no_reduce(bp: Any) -> Any:
        return lambda x, pos: model.forward(x, pos, bp, model.regions_no_reduce, expand_kv=expand)

    lengths_for = functools.partial(bucket_lengths, args)  # a runner's batch of n tokens

    bp = BREAKPOINTS[attn]
    bp_frozen, bp_frozen_result = frozen_attention(attn, lengths, device)
    results: dict[Any, Any] = {}  # each attention's form that returns its result (the whole-compiled modes')
    if bp_frozen_result is not None:
        results = {**RESULTS, bp_frozen: bp_frozen_result}
    case = Case(
        workload=NAME,
        attn=attn,
        T=T,
        device=device,
        static_args=(x, pos),
        live=Batch.build(lengths, device),
        new_live=lambda: Batch.build(lengths, device),
        make_forward=make_forward,
        make_compiled_forward=make_compiled_forward if compile_usable(device) is None and model.tp is None else None,
        make_fullcompile_forward=((lambda bp: compiled_whole(make_forward(results.get(bp, bp))))
                                  if compile_usable(device) is None and model.tp is None else None),
        make_partition_forward=((lambda: make_forward(partition_attention(attn)))
                                if attn in _BACKENDS and _BACKENDS[attn][1](device)
                                and hasattr(torch.Tag, "cudagraph_unsafe") and model.tp is None else None),
        make_forward_no_reduce=make_forward_no_reduce if model.tp is not None else None,
        bp=bp,
        bp_raw=bp.__wrapped__,  # type: ignore[attr-defined]
        bp_frozen=bp_frozen,
        num_breaks=model.shape["layers"],
        write_inputs=write_inputs,
        fields={"attn_backend": attn_backend(attn, device), "lengths": list(lengths),
                **({"tp": model.tp.size, "rank": model.tp.rank} if model.tp is not None else {})},
        live_for=lambda n: Batch.build(lengths_for(n), device),
    )
    if attn == "unfused":
        def stream(kind: str) -> Any:
            lengths_of = length_stream(kind, T, args.requests, args.seed, args.zipf_tuples, args.zipf_s)
            return lambda: Batch(lengths_of())

        # host-only metadata (the keyed breakpoint reads the lengths, never a live tensor)
        case.specialized = dataclasses.replace(
            case,
            bp=attention_unfused_keyed,
            live=Batch(lengths),
            new_live=lambda: Batch(lengths),
            live_for=lambda n: Batch(lengths_for(n)),
        )
        case.live_stream = stream
    if attn in _BACKENDS and _BACKENDS[attn][1](device):
        # host-only metadata: the staged prepare (inline) or the breakpoint (fallback) builds cu_seqlens
        staged = model.staged_attention(args.slots)
        results[staged.breakpoints[attn]] = staged.results[attn]
        case.staged = dataclasses.replace(
            case,
            bp=staged.breakpoints[attn],
            live=Batch(lengths),
            new_live=lambda: Batch(lengths),
            live_for=lambda n: staged.capture_lives(n, lengths_for, tiers_of(args)),
            user_time=staged.user_time,
        )
    return case


def _paged_case(model: LlamaModel, args: argparse.Namespace, device: torch.device, kind: str, T: int) -> Case:
    """A decode or mixed batch over a paged KV cache (``bcg.bench.workloads.paged``): T rows, the
    cache holding every request's context; the staged form's bounds are the point's own rows and
    requests, and ``--context`` in pages. ``decode-loop``: a decode batch of T requests, each
    with pages reserved for ``--steps`` more tokens (the bound grows as much), run as
    :func:`_decode_loop`."""
    loop = kind == LOOP
    steps = args.steps if loop else 1
    page = args.page
    bound = -(-(args.context + steps - 1) // page)  # pages per request
    reserved: list[tuple[int, ...]] = []  # each request's pages, for its context at the last step

    def tables_of(ctx: list[int]) -> tuple[tuple[int, ...], ...]:
        need = [-(-(c + steps - 1) // page) for c in ctx]
        starts = itertools.accumulate(need[:-1], initial=1)
        reserved.extend(tuple(range(start, start + n)) for start, n in zip(starts, need))
        return tuple(t[: -(-c // page)] for t, c in zip(reserved, ctx))  # the pages the contexts cover

    batch = paged.make_batch("decode" if loop else kind, T, args.context, args.requests, page, args.seed, tables_of)
    cache = paged.PagedKVCache(model.shape["layers"], 1 + sum(map(len, reserved)), page, model.KV, model.D, device,
                               model.dtype)
    rows = batch.tokens
    bp = paged.paged_breakpoint()
    staged = paged.StagedPagedAttention(rows, batch.requests, bound, page, device)
    max_q = 1 if kind != "mixed" else rows

    def capture_live(n: int, tiered: bool = False) -> Any:  # warm-ups and captures write the trash page only
        return paged.capture_lives(min(n, batch.requests), page, max_q, bound, tiered)

    fields = {"attn_backend": "paged: gather + " + ("flash seqused_k" if paged.flash_paged_usable(device, model.dtype)
                                                     else "masked attention"),
              "requests": batch.requests, "tokens": rows, "context_pages": bound, "page": page,
              "max_context": max(batch.ctx_lens)}
    if loop:
        case = _decode_loop(model, args, device, T, paged.DecodeSteps(batch, reserved), cache, bp)
        case.fields.update(fields)
    else:
        gen = torch.Generator(device=device).manual_seed(args.seed * 7 + T)
        x_base = torch.randn(rows, model.hidden, generator=gen, device=device, dtype=model.dtype)
        x_fresh = torch.randn(rows, model.hidden, generator=gen, device=device, dtype=model.dtype)
        x = x_base.clone()
        pos = torch.tensor(batch.positions(), device=device)

        def write_inputs(fresh: bool) -> None:
            x.copy_(x_fresh if fresh else x_base)

        def make_forward(bp: Any) -> Any:
            layers = paged.per_layer(bp, cache)
            return lambda x, pos: model.forward(x, pos, layers)

        case = Case(
            workload=NAME,
            attn=kind,
            T=T,
            device=device,
            static_args=(x, pos),
            live=paged.PagedLive(batch),
            new_live=lambda: paged.PagedLive(batch),
            make_forward=make_forward,
            bp=bp,
            bp_raw=bp.__wrapped__,  # type: ignore[attr-defined]
            bp_frozen=paged.frozen(batch, rows, device),
            num_breaks=model.shape["layers"],
            write_inputs=write_inputs,
            fields=fields,
        )
    case.live_for = capture_live
    case.staged = dataclasses.replace(case, bp=staged.breakpoint, live=paged.PagedLive(batch),
                                      new_live=lambda: paged.PagedLive(batch),
                                      live_for=functools.partial(capture_live, tiered=True),
                                      user_time=staged.user_time)
    return case


def _decode_loop(model: LlamaModel, args: argparse.Namespace, device: torch.device, T: int,
                 steps: paged.DecodeSteps, cache: paged.PagedKVCache, bp: Any) -> Case:
    """The ``decode-loop`` point: greedy decoding of T requests, ``--steps`` steps per sample.

    The forward is one step, ``(ids, pos) -> next ids`` (:meth:`LlamaModel.decode_step`). Each
    step's next ids are its argmax, copied on the device into the ids the next step reads, and
    the positions advance by one on the device (:class:`bcg.bench.case.DecodeLoop`); step ``n``'s
    live metadata is ``steps.batch(n)``, built on the host at every step. The floor's attention
    is frozen at the middle step's batch, so that over a loop it reads as many keys as the
    loops whose contexts grow (a step's attention work follows its context lengths)."""
    first = steps.first
    rows, n = first.tokens, args.steps
    vocab = model.vocab
    gen = torch.Generator(device=device).manual_seed(args.seed * 7 + T)
    ids_base = torch.randint(vocab, (rows,), generator=gen, device=device)
    ids_fresh = torch.randint(vocab, (rows,), generator=gen, device=device)
    start = (ids_base.clone(), torch.tensor(first.positions(), device=device))
    ids, pos = start[0].clone(), start[1].clone()  # the inputs the captures read (the floor's loop writes them)

    def write_inputs(fresh: bool) -> None:
        start[0].copy_(ids_fresh if fresh else ids_base)

    def make_forward(bp: Any) -> Any:
        layers = paged.per_layer(bp, cache)
        return lambda ids, pos: model.decode_step(ids, pos, layers)

    def advance(inputs: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        inputs[0].copy_(out)  # the sampled ids: the next step's input, with no host round trip
        inputs[1].add_(1)

    def live(step: int) -> paged.PagedLive:
        return paged.PagedLive(steps.batch(step))

    def finish_row(row: dict[str, Any]) -> None:
        row["tokens_per_s"] = rows * n * 1e3 / row["ms_median"] if row["ms_median"] > 0 else None
        paired = row.get("ratio_to_floor_paired")
        row["tokens_per_s_to_floor_paired"] = 1 / paired if paired else None
        row["ids_equal"] = row["rel_err"] == 0.0  # every step's ids equal the eager loop's

    return Case(
        workload=NAME,
        attn=LOOP,
        T=T,
        device=device,
        static_args=(ids, pos),
        live=live(0),
        new_live=lambda: live(0),
        make_forward=make_forward,
        bp=bp,
        bp_raw=bp.__wrapped__,  # type: ignore[attr-defined]
        bp_frozen=paged.frozen(steps.batch(n // 2), rows, device),
        num_breaks=model.shape["layers"],
        write_inputs=write_inputs,
        fields={"steps": n, "vocab": vocab},
        finish_row=finish_row,
        loop=DecodeLoop(n, start, live, advance),
    )


def compile_usable(device: torch.device) -> str | None:
    """Why the compiled regions cannot run here (None: they can): Inductor needs Triton on a GPU."""
    if device.type != "cuda":
        return "torch.compile modes need a GPU here (Inductor's CPU backend compiles C++ for minutes)"
    return None if has_triton() else "Triton is not installed"


# -- the bucket ladder: what a serving engine captures ---------------------------------------


def extra(model: LlamaModel, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """``{"runner": ..., "runner_compile": ...}``: capture a GraphRunner over the default
    16-bucket ladder up to ``--ladder-max`` tokens (varlen attention, one pool, largest
    first) and report capture seconds and pool sizes; the same with the staged attention
    (``runner_staged``: both forms per bucket; when mode ``bcg-staged`` is requested); then the same over Inductor-compiled
    regions from a fresh compile (when mode ``bcg-compile`` is requested and usable),
    reporting compile and capture seconds apart."""
    if device.type != "cuda" or args.ladder_max <= 0:
        return {}
    out = {"runner": _ladder(model, args, device, None)}
    if (args.modes is None or "bcg-staged" in args.modes) and varlen_usable(device):
        staged = out["runner_staged"] = _ladder(model, args, device, None, staged=True)
        staged["pool_ratio_to_breakable"] = staged["pool_mib_total"] / out["runner"]["pool_mib_total"]
        staged["note_staged"] = ("staged varlen attention: each bucket holds its inline form, its staged tiers "
                                 f"({tiers_of(args)} slots, those that timed faster) and its breakable form in "
                                 "the one pool; "
                                 "pool_ratio_to_breakable compares with 'runner'")
    if getattr(args, "lifecycle", False) and varlen_usable(device):
        out["lifecycle"] = _lifecycle(model, args, device, staged=True)
        out["lifecycle_breakable"] = _lifecycle(model, args, device, staged=False)
    if (args.modes is None or "bcg-compile" in args.modes) and compile_usable(device) is None:
        with _cold_compile_caches():
            out["runner_compile"] = _ladder(model, args, device, model.compiled_regions(fresh=True))
        out["runner_compile"]["caches"] = "cold: Dynamo reset, fresh Inductor and Triton cache directories"
    return out


def _lifecycle(model: LlamaModel, args: argparse.Namespace, device: torch.device, staged: bool) -> dict[str, Any]:
    """:func:`bcg.bench.lifecycle.measure` over the ladder's runner (``staged``: its staged form)."""
    buckets, x, pos, forward, capture_live, live_for = _ladder_runner(model, args, device, None, staged)

    def make(**options: Any) -> bcg.GraphRunner:
        return bcg.GraphRunner(forward, buckets=buckets, example_inputs=(x, pos), live=capture_live,
                               progress=False, **options)

    gen = torch.Generator(device=device).manual_seed(args.seed)  # not the default one: see docs/runner.md

    def batch(T: int) -> tuple[tuple[Any, ...], Any]:
        live = live_for(T)
        xs = torch.randn(T, model.hidden, device=device, dtype=model.dtype, generator=gen)
        ps = torch.cat([torch.arange(n, device=device) for n in live.lengths])
        return (xs, ps), live

    return {"buckets": buckets, "staged": staged,
            **lifecycle.measure(forward, make, batch, device, seed=args.seed)}


def _cold_compile_caches() -> Any:
    """A context in which torch.compile starts from empty on-disk caches (Inductor's own)."""
    return fresh_inductor_cache()


def _ladder_runner(model: LlamaModel, args: argparse.Namespace, device: torch.device, regions: Regions | None,
                   staged: bool) -> tuple[list[int], torch.Tensor, torch.Tensor, Any, Any, Any]:
    """The ladder's runner over varlen attention (``staged``: its staged form, host-only live
    metadata and both forms per bucket): buckets, example inputs, forward, ``capture_live``, and
    ``live_for(T)``, a call's live metadata."""
    buckets = bcg.runner.default_buckets(args.ladder_max)
    x = torch.randn(buckets[-1], model.hidden, device=device, dtype=model.dtype)
    pos = torch.arange(buckets[-1], device=device)
    staged_attention = model.staged_attention(args.slots)
    bp = staged_attention.breakpoints["varlen"] if staged else attention_varlen

    lengths_for = functools.partial(bucket_lengths, args)  # a runner's batch of n tokens

    def live_for(n: int) -> Batch:
        return Batch(lengths_for(n)) if staged else Batch.build(lengths_for(n), device)

    def capture_live(n: int) -> Any:  # the staged form's tiers too
        return staged_attention.capture_lives(n, lengths_for, tiers_of(args)) if staged else live_for(n)

    def forward(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return model.forward(x, pos, bp, regions, expand_kv=expands_kv("varlen"))

    return buckets, x, pos, forward, capture_live, live_for


def _ladder(
    model: LlamaModel, args: argparse.Namespace, device: torch.device, regions: Regions | None, staged: bool = False
) -> dict[str, Any]:
    """The ladder over varlen attention; ``staged``: its staged form (host-only live metadata,
    both forms per bucket)."""
    buckets, x, pos, forward, capture_live, live_for = _ladder_runner(model, args, device, regions, staged)
    section: dict[str, Any] = {"buckets": buckets}
    if regions is not None:
        # the compile: one eager call at the largest bucket (Dynamo + Inductor + Triton)
        section.update(compiling_call(forward, (x, pos), live_for(buckets[-1]), torch.cuda.synchronize))
    runner = bcg.GraphRunner(forward, buckets=buckets, example_inputs=(x, pos), live=capture_live,
                             progress=False)
    graphs0 = dynamo_graphs() if regions is not None else 0
    t0 = time.perf_counter()
    runner.capture()
    total = time.perf_counter() - t0
    if regions is None:
        runner.measure_largest_alone()
    else:
        section["graphs_compiled_during_capture"] = dynamo_graphs() - graphs0
    stats = runner.stats()
    # one call per bucket, checked against the eager forward on the same (padded) inputs
    worst = 0.0
    for b in buckets[:: max(1, len(buckets) // 4)]:
        T = max(1, b - 1)
        live = live_for(T)
        xb = torch.randn(T, model.hidden, device=device, dtype=model.dtype)
        pb = torch.cat([torch.arange(n, device=device) for n in live.lengths])
        y = runner(xb, pb, live=live)
        with bcg.live_scope(live), torch.no_grad():
            ref = forward(xb, pb)
        worst = max(worst, float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)))
    runner.reset()
    section.update(
        capture_s={str(b): s for b, s in stats["capture_s"].items()},
        capture_s_total=total,
        pool_mib_total=stats["pool_bytes"] / 2**20,
        failed_buckets=stats["failed_buckets"],
        rel_err_vs_unpadded_eager=worst,
        note="capture_s includes each bucket's eager warm-up; rel_err compares runner(T=bucket-1) "
        "with the unpadded eager forward (GEMM kernels may differ with M, so not necessarily 0)",
    )
    if regions is None:
        section.update(
            pool_mib_largest_alone=stats["largest_alone_pool_bytes"] / 2**20,
            pool_ratio=stats["pool_ratio"],
        )
    else:
        section["compile_plus_capture_s"] = section["compile_s"] + total
    return section
